"""Scans of file systems as a hostile user leaves them. FIFOs, devices, sockets, dangling links,
link loops, unreadable files and folders, names that are not UTF-8, 1,000-level trees and a
100,000-entry folder: each gives a row or a clear error, within a bounded time. Also huge timeouts,
connection resets, unsupported URL schemes, and a panic in the core (forced by a test hook)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading

import lorafast
import pytest
from helpers.servers import RangeServer
from lorafast import _core
from lorafast.errors import AdapterError, InternalError, LorafastError
from lorafast.testing import write_peft_adapter, write_raw, write_safetensors

#: Wall-clock bound for work done in a child interpreter: a hang fails the test instead of the suite.
CHILD_TIMEOUT = 240


def adapter(path, r=4):
    write_safetensors(path, {"m.lora_A.weight": ("F16", (r, 8)), "m.lora_B.weight": ("F16", (8, r))})
    return os.fspath(path)


def peft(dir_, r=4):
    tensors = {"m.lora_A.weight": ("F16", (r, 8)), "m.lora_B.weight": ("F16", (8, r))}
    return write_peft_adapter(dir_, tensors, r=r, lora_alpha=r, target_modules=["m"])


def in_child(code: str, *args: str, timeout: float = CHILD_TIMEOUT):
    """Runs `code` in a fresh interpreter and returns what it printed, as JSON. A hang there is
    killed after `timeout` and a crash (SIGSEGV) is a nonzero status: either fails the test,
    neither stalls or kills the suite."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"status {out.returncode}: {out.stderr[-2000:]}"
    return json.loads(out.stdout)


def errors_by_name(report, root):
    return {os.path.relpath(p, root): code for p, code, _ in report.errors}


# ------------------------------------------------------------------ FIFOs, devices, sockets, links


FIFO_CHECKS = """
import json, sys, lorafast
root, plain = sys.argv[1], sys.argv[2]
out = {"scan": [[p, c] for p, c, _ in lorafast.scan([root]).errors]}
for mode in ("pread", "mmap"):
    try:
        lorafast.read_header(plain, mode=mode)
    except lorafast.AdapterError as e:
        out[mode] = [e.code, e.path]
for name in ("cfg", "weights"):
    try:
        lorafast.inspect(root + "/" + name)
    except lorafast.AdapterError as e:
        out[name] = [e.code, e.path]
print(json.dumps(out))
"""


def test_fifos_never_block(tmp_path):
    cfg, weights = tmp_path / "cfg", tmp_path / "weights"
    peft(cfg)
    os.unlink(cfg / "adapter_config.json")
    os.mkfifo(cfg / "adapter_config.json")
    peft(weights)
    os.unlink(weights / "adapter_model.safetensors")
    os.mkfifo(weights / "adapter_model.safetensors")
    plain = tmp_path / "plain.safetensors"
    os.mkfifo(plain)
    got = in_child(FIFO_CHECKS, str(tmp_path), str(plain))
    cfg_file, weights_file = str(cfg / "adapter_config.json"), str(weights / "adapter_model.safetensors")
    assert sorted(got["scan"]) == sorted(
        [[cfg_file, "not_regular_file"], [str(plain), "not_regular_file"], [weights_file, "not_regular_file"]]
    )
    assert got["pread"] == got["mmap"] == ["not_regular_file", str(plain)]
    assert got["cfg"] == ["not_regular_file", cfg_file]
    assert got["weights"] == ["not_regular_file", weights_file]
    cli = subprocess.run([sys.executable, "-m", "lorafast", "header", str(plain)], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT)  # fmt: skip
    assert cli.returncode == 1 and "[not_regular_file]" in cli.stderr and "FIFO" in cli.stderr


def test_sockets_devices_and_bad_links_each_get_a_row(tmp_path):
    adapter(tmp_path / "good.safetensors")
    (tmp_path / "dangling.safetensors").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop.safetensors").symlink_to("loop.safetensors")
    (tmp_path / "null.safetensors").symlink_to("/dev/null")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.safetensors"))
    # A symlinked folder is still not followed, even when named like an adapter: no row.
    (tmp_path / "real").mkdir()
    (tmp_path / "folder.safetensors").symlink_to(tmp_path / "real", target_is_directory=True)
    try:
        report = lorafast.scan([tmp_path])
    finally:
        sock.close()
    assert len(report) == 5
    assert errors_by_name(report, tmp_path) == {
        "dangling.safetensors": "dangling_link",
        "loop.safetensors": "symlink_loop",
        "null.safetensors": "not_regular_file",
        "sock.safetensors": "not_regular_file",
    }
    messages = {os.path.basename(p): m for p, _, m in report.errors}
    assert "character device" in messages["null.safetensors"] and "socket" in messages["sock.safetensors"]
    assert "dangling" in messages["dangling.safetensors"]
    # inspect raises: builtin OS errors for links, AdapterError for what is no regular file.
    with pytest.raises(FileNotFoundError) as info:
        lorafast.inspect(tmp_path / "dangling.safetensors")
    assert info.value.errno == errno.ENOENT and "dangling symlink" in str(info.value)
    with pytest.raises(OSError) as info:
        lorafast.inspect(tmp_path / "loop.safetensors")
    assert info.value.errno == errno.ELOOP
    with pytest.raises(AdapterError) as info:
        lorafast.inspect(tmp_path / "null.safetensors")
    assert info.value.code == "not_regular_file"


def test_a_device_given_directly_is_not_a_regular_file():
    report = lorafast.scan(["/dev/zero"])
    [(path, code, message)] = report.errors
    assert (path, code) == ("/dev/zero", "not_regular_file")
    assert "character device" in message and "Not a directory" not in message
    for call in (lorafast.inspect, lorafast.read_header):
        with pytest.raises(AdapterError) as info:
            call("/dev/zero")
        assert info.value.code == "not_regular_file" and info.value.path == "/dev/zero"


# ------------------------------------------------------------------ unreadable files and folders

UNREADABLE = {
    "locked.safetensors": ("permission_denied", "Permission denied"),
    "nosearch": ("permission_denied", "cannot search this folder"),
    "nolist": ("permission_denied", "cannot list this folder"),
    "badcfg/adapter_config.json": ("permission_denied", "Permission denied"),
}


def _unreadable_tree(base):
    adapter(os.path.join(base, "good.safetensors"))
    adapter(os.path.join(base, "locked.safetensors"))
    os.chmod(os.path.join(base, "locked.safetensors"), 0)
    peft(os.path.join(base, "nosearch"))  # readable, not searchable: no file in it can be opened
    os.chmod(os.path.join(base, "nosearch"), 0o644)
    os.mkdir(os.path.join(base, "nolist"))
    adapter(os.path.join(base, "nolist", "a.safetensors"))  # searchable, not readable: cannot be listed
    adapter(os.path.join(base, "nolist", "b.safetensors"))
    os.chmod(os.path.join(base, "nolist"), 0o311)
    peft(os.path.join(base, "badcfg"))
    os.chmod(os.path.join(base, "badcfg", "adapter_config.json"), 0)


def test_unreadable_files_and_folders_are_named_with_what_failed():
    """Run by a process that mode bits apply to: root ignores them, so as root the check runs in a
    forked child that has become `nobody` (the tree sits in a folder that `nobody` can reach)."""
    base = tempfile.mkdtemp(prefix="lorafast-perm-")
    os.chmod(base, 0o755)
    try:
        _unreadable_tree(base)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            status = 1
            try:
                if os.geteuid() == 0:
                    os.setgroups([])
                    os.setgid(65534)
                    os.setuid(65534)
                report = lorafast.scan([base])
                rows = [[os.path.relpath(p, base), c, m] for p, c, m in report.errors]
                os.write(write, json.dumps({"rows": rows, "n": len(report)}).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        with os.fdopen(read) as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        got = json.loads(data)
        assert got["n"] == 5
        assert {path: code for path, code, _ in got["rows"]} == {p: c for p, (c, _) in UNREADABLE.items()}
        for path, _, message in got["rows"]:
            assert UNREADABLE[path][1] in message, (path, message)
    finally:
        for sub in ("nosearch", "nolist"):
            if os.path.exists(os.path.join(base, sub)):
                os.chmod(os.path.join(base, sub), 0o755)
        shutil.rmtree(base)


# ------------------------------------------------------------------ deep and wide trees

DEEP_SCAN = """
import json, sys, lorafast
rows = {}
for threads in (1, 2):
    r = lorafast.scan([sys.argv[1]], threads=threads)
    rows[threads] = [r.paths, r.errors]
print(json.dumps({"rows": rows, "discover": lorafast._core.discover([sys.argv[1]])}))
"""


def _remove_deep(root, levels):
    """Bottom-up, without recursion (shutil.rmtree recurses once per level)."""
    deepest = os.path.join(root, *["d"] * levels)
    for i in range(levels, -1, -1):
        shutil.rmtree(os.path.join(root, *["d"] * i), ignore_errors=True)
    assert not os.path.exists(deepest)


def test_a_thousand_level_tree_with_an_adapter_at_the_bottom(tmp_path):
    levels = 1000
    bottom = os.path.join(tmp_path, *["d"] * levels)
    try:
        at = os.fspath(tmp_path)
        for _ in range(levels):  # os.makedirs recurses once per level
            at = os.path.join(at, "d")
            os.mkdir(at)
        peft(bottom)
        adapter(tmp_path / "top.safetensors")
        got = in_child(DEEP_SCAN, str(tmp_path))
        for paths, errors in got["rows"].values():
            assert paths == [str(tmp_path / "top.safetensors"), bottom] and errors == []
        assert got["discover"] == [[str(tmp_path / "top.safetensors"), None], [bottom, None]]
    finally:
        _remove_deep(tmp_path, levels)


WIDE_SCAN = """
import json, sys, lorafast
r = lorafast.scan([sys.argv[1]])
print(json.dumps({"n": len(r), "errors": r.errors[:3], "first": r.paths[0], "last": r.paths[-1],
                  "sorted": r.paths == sorted(r.paths)}))
"""


def test_a_hundred_thousand_entry_folder(tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir()
    src, notes = adapter(tmp_path / "src.safetensors"), tmp_path / "notes.txt"
    notes.write_text("not an adapter")
    # Hard links: 100,000 entries at one syscall each (ext4 allows 65,000 links per file).
    for i in range(50_000):
        os.link(src, wide / f"a{i:05d}.safetensors")
        os.link(notes, wide / f"n{i:05d}.txt")
    got = in_child(WIDE_SCAN, str(wide))
    assert got["n"] == 50_000 and got["errors"] == [] and got["sorted"]
    assert (got["first"], got["last"]) == (str(wide / "a00000.safetensors"), str(wide / "a49999.safetensors"))


# ------------------------------------------------------------------ names that are not UTF-8


def test_names_that_are_not_utf8_keep_their_bytes(tmp_path):
    root = os.fsencode(tmp_path)
    names = {b"bad\xff.safetensors", b"good.safetensors", b"sub\xfe"}
    adapter(os.fsdecode(root + b"/bad\xff.safetensors"))
    adapter(os.fsdecode(root + b"/good.safetensors"))
    peft(os.fsdecode(root + b"/sub\xfe"))
    write_raw(os.fsdecode(root + b"/broken\xfd.safetensors"), b'{"t": {"dtype": "F99"}}', 0)
    # Hidden, whatever the bytes after the dot: skipped like any hidden entry.
    adapter(os.fsdecode(root + b"/.\xffhidden.safetensors"))
    peft(os.fsdecode(root + b"/.\xfedir/inner"))
    report = lorafast.scan([tmp_path])
    assert len(report) == 4
    assert all(os.path.lexists(os.fsencode(p)) for p in report.paths)
    assert {os.path.basename(os.fsencode(p)) for p in report.ok_paths} == names
    [(bad_path, code, _)] = report.errors
    assert os.fsencode(bad_path) == root + b"/broken\xfd.safetensors" and code == "unknown_dtype"
    adapters = list(report)
    assert [a.path for a in adapters] == report.ok_paths
    assert {os.path.basename(os.fsencode(a.weight_files[0])) for a in adapters} == {
        b"bad\xff.safetensors",
        b"good.safetensors",
        b"adapter_model.safetensors",
    }
    # bytes paths work as well as their fsdecoded str.
    assert lorafast.inspect(root + b"/bad\xff.safetensors").path == os.fsdecode(root + b"/bad\xff.safetensors")
    assert list(lorafast.read_header(root + b"/sub\xfe/adapter_model.safetensors").tensors) == [
        "m.lora_A.weight",
        "m.lora_B.weight",
    ]
    found = [os.fsencode(p) for p, _ in _core.discover([os.fsdecode(root)])]
    assert len(found) == 4 and all(os.path.lexists(p) for p in found)
    items = _core.discover_targets([os.fsdecode(root)])
    assert [os.fsencode(i[0]) for i in items] == found
    assert len(_core.scan_targets(items)) == 4


# ------------------------------------------------------------------ timeouts, URLs, connections


@pytest.mark.parametrize("timeout", [1e20, 1e300, 2**64, float("inf")])
def test_huge_timeouts_are_clamped_not_a_panic(tmp_path, timeout):
    path = adapter(tmp_path / "a.safetensors")
    assert lorafast.scan([path], timeout=timeout).errors == []
    assert lorafast.inspect(path, timeout=timeout).num_tensors == 2


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), -float("inf")])
def test_nonsense_timeouts_raise_value_error_naming_timeout(tmp_path, timeout):
    path = adapter(tmp_path / "a.safetensors")
    for call in (lorafast.scan, lorafast.inspect):
        with pytest.raises(ValueError, match="timeout"):
            call(path, timeout=timeout)


def test_url_with_a_huge_timeout_and_concurrency(tmp_path):
    adapter(tmp_path / "a.safetensors")
    server = RangeServer(str(tmp_path), delay=0.1)
    try:
        report = lorafast.scan([f"{server.url}/ok/a.safetensors"], timeout=1e19, concurrency=2**62)
        assert report.errors == [] and len(report) == 1
    finally:
        server.stop()


SETTINGS_FIFOS = """
import json, sys, lorafast
port = sys.argv[1]
report = lorafast.scan([f"hf://org/repo/a.safetensors", "s3://bucket/a.safetensors"],
                       storage_options={"endpoint": f"http://127.0.0.1:{port}", "skip_signature": "true"}, timeout=5)
print(json.dumps(report.errors))
"""


def test_fifos_as_token_and_aws_settings_files_do_not_block(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    env = {**os.environ, "HF_TOKEN_PATH": str(fifo), "AWS_SHARED_CREDENTIALS_FILE": str(fifo),
           "AWS_CONFIG_FILE": str(fifo), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}  # fmt: skip
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", SETTINGS_FIFOS, str(port)], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # Both read their settings (the FIFO is skipped), then fail to connect: a row each, no hang.
    assert [code for _, code, _ in json.loads(out.stdout)] == ["connection_error", "connection_error"]


def _resetting_server():
    """A server that reads each request and answers with a TCP reset."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_connection_reset_and_refused_are_connection_errors():
    srv = _resetting_server()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    try:
        urls = [f"http://127.0.0.1:{srv.getsockname()[1]}/a.safetensors", f"http://127.0.0.1:{refused_port}/a"]
        report = lorafast.scan(urls, timeout=5)
    finally:
        srv.close()
    assert [code for _, code, _ in report.errors] == ["connection_error", "connection_error"]
    assert "reset" in report.errors[0][2] and "refused" in report.errors[1][2]


def test_unsupported_scheme_is_invalid_url():
    report = lorafast.scan(["ftp://host/x.safetensors"])
    assert [(p, c) for p, c, _ in report.errors] == [("ftp://host/x.safetensors", "invalid_url")]
    with pytest.raises(AdapterError) as info:
        lorafast.inspect("ftp://host/x.safetensors")
    assert info.value.code == "invalid_url"


# ------------------------------------------------------------------ panics


@pytest.fixture
def panic_on():
    armed = []

    def arm(path):
        _core._debug_panic_on(os.fspath(path))
        armed.append(path)

    yield arm
    _core._debug_panic_on(None)


def test_a_panic_is_one_error_row_in_a_scan(tmp_path, panic_on):
    paths = [adapter(tmp_path / f"{c}.safetensors") for c in "abc"]
    panic_on(paths[1])
    report = lorafast.scan([tmp_path], threads=2)
    assert report.paths == paths
    [(path, code, message)] = report.errors
    assert (path, code) == (paths[1], "internal") and "forced panic" in message
    assert [a.path for a in report] == [paths[0], paths[2]]  # iterating re-reads the rows that were read


def test_a_panic_at_the_python_boundary_is_an_internal_error(tmp_path, panic_on):
    good, victim = adapter(tmp_path / "good.safetensors"), adapter(tmp_path / "victim.safetensors")
    panic_on(victim)
    for call in (lorafast.inspect, lorafast.read_header):
        with pytest.raises(InternalError) as info:
            call(victim)
        err = info.value
        assert (err.code, err.path) == ("internal", victim) and "forced panic" in str(err)
        # An ordinary Exception (pyo3's PanicException is a BaseException): `except Exception` works.
        assert isinstance(err, LorafastError) and isinstance(err, RuntimeError) and not isinstance(err, ValueError)
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy) is InternalError and (copy.code, copy.path, str(copy)) == (err.code, err.path, str(err))
    ok, failed = lorafast.inspect_many([good, victim])
    assert ok.path == good and isinstance(failed, InternalError) and failed.path == victim
    _core._debug_panic_on(None)
    assert lorafast.inspect(victim).num_tensors == 2


def test_error_codes_are_exported():
    assert {"not_regular_file", "dangling_link", "symlink_loop", "internal", "connection_error", "invalid_url"} <= set(
        lorafast.ADAPTER_ERROR_CODES
    )
    assert not set(lorafast.ADAPTER_ERROR_CODES) & set(lorafast.HEADER_ERROR_CODES)
