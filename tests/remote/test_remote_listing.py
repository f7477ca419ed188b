"""How a bucket scan reads (LocalS3 on 127.0.0.1, its request log): the first header reads are sized from what
is known (the listing's object sizes, the headers already seen), and header reads start while a long listing
is still coming; the results are the local scan's whatever the sizes, page boundaries and layout."""

from __future__ import annotations

import os
import random

import lorafast
from helpers.servers import FIRST_GUESS_BYTES, LocalS3, files_under, keys_after, normalized
from lorafast.testing import write_attention_adapter, write_safetensors


def _header_size(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _gets(server: LocalS3) -> dict[str, list[str]]:
    """Each object's GET ranges, in order."""
    out: dict[str, list[str]] = {}
    for method, path, rng in server.requests:
        if method == "GET" and "?" not in path:
            out.setdefault(path, []).append(rng or "")
    return out


def _long_header(path: str, data: tuple[int, int]) -> None:
    """A header of ~20 KB (160 tensors), over the first guess; `data` is each tensor's shape."""
    write_safetensors(
        path,
        {f"base_model.model.layers.{i}.mlp.m{j}.lora_{ab}.weight": ("F32", data) for i in range(40)
         for j in range(2) for ab in "AB"},
    )  # fmt: skip


def test_header_longer_than_the_first_read_costs_one_more_read(tmp_path):
    root = tmp_path / "b" / "big"
    os.makedirs(root)
    for i in range(3):
        _long_header(str(root / f"a{i}.safetensors"), (4, 256))  # 160 KiB of data: no object is read whole
    assert _header_size(str(root / "a0.safetensors")) > FIRST_GUESS_BYTES
    server = LocalS3(str(tmp_path))
    try:
        report = lorafast.scan("s3://b/", storage_options=server.storage_options, concurrency=1)
        assert normalized(report, "s3://b", str(tmp_path / "b")) == normalized(lorafast.scan(str(tmp_path / "b")))
        gets = _gets(server)
        size = _header_size(str(root / "a0.safetensors"))
        # The first read out: the guess, then the rest of its header. The last one fits the header seen: one read.
        order = list(gets)
        assert gets[order[0]] == [f"bytes=0-{FIRST_GUESS_BYTES - 1}", f"bytes={FIRST_GUESS_BYTES}-{size - 1}"]
        assert len(gets[order[-1]]) == 1 and gets[order[-1]][0] != gets[order[0]][0]
    finally:
        server.stop()


def test_small_listed_objects_are_read_whole(tmp_path):
    """An object of at most 64 KiB that the listing sized is read whole by the first read: one request even
    with a header over the first guess (a web server, which cannot be listed, needs two)."""
    root = tmp_path / "b"
    os.makedirs(root)
    _long_header(str(root / "small.safetensors"), (1, 4))  # ~20 KB header, 2.5 KiB of data
    size = os.path.getsize(root / "small.safetensors")
    assert FIRST_GUESS_BYTES < _header_size(str(root / "small.safetensors")) < size <= 64 << 10
    server = LocalS3(str(tmp_path))
    try:
        report = lorafast.scan("s3://b/", storage_options=server.storage_options)
        assert not report.errors and report.record(0)["num_tensors"] == 160
        assert _gets(server) == {"/b/small.safetensors": [f"bytes=0-{size - 1}"]}
        # Named directly, the object is not listed: the first guess, then the rest of the header.
        server.clear()
        lorafast.scan("s3://b/small.safetensors", storage_options=server.storage_options)
        assert len(_gets(server)["/b/small.safetensors"]) == 2
    finally:
        server.stop()


def test_header_reads_start_before_a_long_listing_ends(tmp_path):
    """Pages after the first are held 0.3 s each: reads of the folders the first (short) page settled are
    under way before the last page is asked for, and the result is the local scan's, in its order."""
    root = tmp_path / "b"
    for i in range(150):
        write_attention_adapter(root / f"f{i:03d}", layers=1)  # two objects each: 300 keys
    server = LocalS3(str(tmp_path), page_delay=0.3, page_keys=100)
    try:
        # 300 keys: a first page of 64, then pages of 100
        report = lorafast.scan("s3://b", storage_options=server.storage_options, concurrency=8)
        assert normalized(report, "s3://b", str(root)) == normalized(lorafast.scan(str(root)))
        requests = server.requests
        lists = [i for i, (_, path, _) in enumerate(requests) if "list-type=2" in path]
        assert len(lists) == 4 and "max-keys=64" in requests[lists[0]][1]
        assert any(method == "GET" and "?" not in path for method, path, _ in requests[: lists[-1]])
        # Every adapter read once: a config and a header read each.
        assert sum(len(r) for r in _gets(server).values()) == 300
    finally:
        server.stop()


def test_streamed_listing_keeps_the_local_rules(tmp_path):
    """A PEFT folder leaves its sub-folders out, even those the listing settles before its adapter_config.json
    (keys sort "0..." first); one-file folders, hidden folders and nested fleets, over several pages."""
    root = tmp_path / "b"
    write_attention_adapter(root / "peft")
    for i in range(80):
        write_attention_adapter(root / "peft" / f"0{i:02d}", layers=1)  # inside a PEFT folder: not adapters
    for i in range(40):
        write_attention_adapter(root / "nested" / f"n{i:02d}", layers=1)
        os.makedirs(root / "one" / f"o{i:02d}")
        write_safetensors(root / "one" / f"o{i:02d}" / "w.safetensors", {"x.lora_A.weight": ("F32", (2, 4))})
    write_attention_adapter(root / ".hidden" / "h")
    write_safetensors(root / "top.safetensors", {"x.lora_A.weight": ("F32", (2, 4))})
    server = LocalS3(str(tmp_path), page_keys=50)
    try:
        for prefix in ("s3://b", "s3://b/peft", "s3://b/nested"):
            local = str(root) + prefix[len("s3://b") :]
            report = lorafast.scan(prefix, storage_options=server.storage_options, concurrency=4)
            assert normalized(report, "s3://b", str(root)) == normalized(lorafast.scan(local)), prefix
            assert len(report) == {"s3://b": 82, "s3://b/peft": 1, "s3://b/nested": 40}[prefix]
    finally:
        server.stop()


def test_local_s3_lists_a_page_as_a_sorted_walk_of_the_whole_bucket_would(tmp_path):
    """LocalS3 walks only the folders a page can come from (`keys_after`); on random trees of names that sort
    around "/" ("a-b/x" < "a/x"), it gives what the sorted list of every key, filtered, gives."""
    rng = random.Random(7)
    names = ["a", "a-b", "a.b", "a0", "ab", "b", ".h", "z", "a b", "\u00e9"]
    for trial in range(60):
        root = tmp_path / str(trial)
        root.mkdir()
        for _ in range(rng.randint(0, 25)):
            parts = [rng.choice(names) for _ in range(rng.randint(1, 4))]
            try:
                (root.joinpath(*parts[:-1])).mkdir(parents=True, exist_ok=True)
                if not root.joinpath(*parts).is_dir():
                    root.joinpath(*parts).touch()
            except (FileExistsError, NotADirectoryError):
                pass  # a file where a folder was drawn, or the other way round
        every = sorted(k for _, k in files_under(str(root)))
        for prefix in ["", "a", "a/", "a-", "b/a", "z"]:
            for after in ["", "a", "a/", "a-b/", "a/b", "ab", "zz", *every[:3]]:
                want = [k for k in every if k.startswith(prefix) and k > after]
                assert list(keys_after(str(root), prefix, after)) == want, (trial, prefix, after)
