"""lorafast.convert when the output cannot be written (read-only folder, file-size limit, full disk) or the source
is replaced during the call: a `ConvertError` that names the file, nothing left behind, and the recorded
source_sha256 is the hash of the data that was converted."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import lorafast
from lorafast import ConvertError, convert
from lorafast.converting import api
from test_convert import stacked_adapter, write_kohya

#: a kohya file with 128 KiB of tensor data, so a write fails in the middle of the data
_WIDE = 4096


def _big_kohya(folder: Path, seed: int = 1) -> str:
    return write_kohya(folder, {"lora_unet_mid_block_attentions_0_proj_in": ((4, _WIDE), (_WIDE, 4), 2.0)}, seed)


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _refused(src: str, out: Path) -> ConvertError:
    with pytest.raises(ConvertError) as info:
        convert(src, "peft", out)
    assert info.value.code == "write_error"
    return info.value


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[object]:
    """`mount(options)`: a small tmpfs at a new folder (root only; the test is skipped where it cannot mount)."""
    made: list[Path] = []

    def make(options: str) -> Path:
        point = tmp_path / f"mnt{len(made)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        made.append(point)
        return point

    yield make
    for point in made:
        subprocess.run(["umount", str(point)], check=True)


def test_read_only_parent_is_a_convert_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _big_kohya(tmp_path / "k")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)  # root passes that check, so the folder's refusal is also given by os.mkdir
    real_mkdir = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: object, **kw: object) -> None:
        if os.path.dirname(os.fspath(path)) == str(parent):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        real_mkdir(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", mkdir)
    err = _refused(src, parent / "out")
    assert str(parent / "out") in str(err) and "Permission denied" in str(err)
    assert err.path == str(parent / "out")
    assert _left(parent) == []


def test_read_only_file_system_is_a_convert_error(tmp_path: Path, mount) -> None:
    src = _big_kohya(tmp_path / "k")
    ro = mount("ro,size=1m")
    err = _refused(src, ro / "a" / "out")  # the missing folder above `out` cannot be made either
    assert "Read-only file system" in str(err) and str(ro / "a" / "out") in str(err)
    assert _left(ro) == []


def test_output_under_a_file_is_a_convert_error(tmp_path: Path) -> None:
    src = _big_kohya(tmp_path / "k")
    (tmp_path / "file").write_text("x")
    for out, why in ((tmp_path / "file" / "out", "File exists"), (tmp_path / "file" / "a" / "out", "Not a directory")):
        assert str(_refused(src, out)) == f"cannot write {out}: {why}"
    assert _left(tmp_path) == ["file", "k"]


def test_missing_parents_made_for_a_failed_convert_are_removed(tmp_path: Path) -> None:
    """A convert that makes the folders above its output and then fails leaves none of them."""
    src = stacked_adapter(tmp_path / "s", 1, shared_outer=False)  # outer factors differ: shared_outer is lossy
    with pytest.raises(ConvertError) as info:
        convert(src, "shared_outer", tmp_path / "a" / "b" / "out")
    assert info.value.code == "lossy"
    assert _left(tmp_path) == ["s"]


_CHILD = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process instead of failing the write
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
from lorafast import ConvertError, convert
try:
    convert(sys.argv[1], "peft", sys.argv[2])
except ConvertError as exc:
    print(json.dumps([exc.code, str(exc)]))
"""


def test_file_size_limit_is_a_convert_error(tmp_path: Path) -> None:
    src = _big_kohya(tmp_path / "k")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", _CHILD, src, str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    code, message = json.loads(done.stdout)
    assert code == "write_error" and message == f"cannot write {out / 'adapter_model.safetensors'}: File too large"
    assert _left(tmp_path) == ["k"]


def test_full_disk_is_a_convert_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _big_kohya(tmp_path / "k")

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # every way the writer puts bytes in the file
    monkeypatch.setattr(os, "writev", full)
    monkeypatch.setattr(os, "sendfile", full)
    err = _refused(src, tmp_path / "out")
    assert str(err) == f"cannot write {tmp_path / 'out' / 'adapter_model.safetensors'}: No space left on device"
    assert _left(tmp_path) == ["k"]


def test_full_tmpfs_is_a_convert_error(tmp_path: Path, mount) -> None:
    src = _big_kohya(tmp_path / "k")
    small = mount("size=64k")
    err = _refused(src, small / "out")
    assert "No space left on device" in str(err)
    assert _left(small) == []


def _data_sha(path: str) -> str:
    raw = Path(path).read_bytes()
    return hashlib.sha256(raw[8 + int.from_bytes(raw[:8], "little") :]).hexdigest()


def test_source_replaced_during_the_call_hashes_what_was_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch as st
    import torch

    src = _big_kohya(tmp_path / "k", seed=1)
    other = _big_kohya(tmp_path / "other", seed=2)  # same names and shapes, other data
    original, replacement = _data_sha(src), _data_sha(other)
    assert original != replacement
    down = st.load_file(src)["lora_unet_mid_block_attentions_0_proj_in.lora_down.weight"]
    real = api._content_hash

    def replaced_first(*args: object) -> None:
        os.replace(other, src)  # the path now names another file, after the source was opened
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "_content_hash", replaced_first)
    res = convert(src, "peft", tmp_path / "out")
    assert _data_sha(src) == replacement
    assert res.source_sha256 == original
    with lorafast.tensors.TensorFile(res.files[0]) as tf:
        assert json.loads(tf.metadata["lorafast.converted"])["source_sha256"] == original
        # the output holds the original's data, which is what the hash names
        assert torch.equal(tf.view("unet.mid_block.attentions.0.proj_in.lora_A.weight"), down)
