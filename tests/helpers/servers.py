"""Loopback servers and fleets for the remote-scan tests and benchmarks (no internet needed).

- `build_fleet(root, n)`: sample adapters of every kind, the malformed-header corpus, broken
  folders, and adapters whose headers are longer than the speculative first range request.
- `MotoS3`: a real S3 API server (moto in server mode) on 127.0.0.1, in a subprocess.
- `LocalS3`: a small S3-compatible server over a folder on 127.0.0.1 (listing, ranged GET, HEAD), which
  logs its requests; the benchmark's S3 server.
- `RangeServer`: a threaded HTTP server on 127.0.0.1 whose first path segment picks a behaviour
  (honours Range, ignores it, truncates, lies, stalls, fails transiently, Hugging Face layout).
- `normalized(report, local_root, url_root)`: a report as plain data with paths mapped, so a
  remote scan can be compared with a local one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote
from xml.sax.saxutils import escape

import numpy as np
from lorafast.sample import write_samples
from lorafast.testing import write_safetensors

from helpers.fleets import write_failed
from helpers.malformed import write_corpus

#: The most the core asks for in a first read (rust/remote/mod.rs SPECULATIVE_BYTES); later first reads fit the
#: store's headers.
SPECULATIVE_BYTES = 64 << 10
#: The core's first read while it knows nothing of a store's headers (rust/remote/mod.rs FIRST_GUESS_BYTES).
FIRST_GUESS_BYTES = 12 << 10


def long_peft(path: str, modules: int = 400) -> None:
    """A PEFT folder whose header (~90 KB) is longer than the first range request."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for i in range(modules):
        key = f"base_model.model.model.layers.{i // 4}.self_attn.{'qkvo'[i % 4]}_proj"
        tensors[f"{key}.lora_A.weight"] = ("BF16", (4, 16))
        tensors[f"{key}.lora_B.weight"] = ("BF16", (16, 4))
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def long_kohya(path: str, modules: int = 300) -> None:
    """A kohya file with a long header and one `.alpha` scalar per module (alphas differ)."""
    tensors: dict[str, Any] = {}
    for i in range(modules):
        key = f"lora_unet_down_blocks_{i // 10}_attentions_{i % 10}_proj_in"
        tensors[f"{key}.lora_down.weight"] = ("F16", (4, 32))
        tensors[f"{key}.lora_up.weight"] = ("F16", (32, 4))
        tensors[f"{key}.alpha"] = np.array(1.0 + (i % 7), dtype=np.float32)
    write_safetensors(path, tensors)


def build_fleet(root: str, samples: int = 120) -> str:
    """Writes a mixed fleet under `root` (good, broken, long headers, hidden) and returns `root`.

    Every entry scans the same locally and remotely; torch `.bin` weights, which only local scans read, are
    tested on their own (`test_remote_s3.py::test_pickle_weights_are_named_not_read`).
    """
    write_samples(os.path.join(root, "samples"), samples, seed=3)
    write_corpus(os.path.join(root, "broken", "headers"))
    open(os.path.join(root, "broken", "headers", "empty.safetensors"), "wb").close()
    long_peft(os.path.join(root, "long", "peft"))
    long_kohya(os.path.join(root, "long", "kohya.safetensors"))
    write_failed(os.path.join(root, "broken"), "no_weights", "bad_config", "list_config")
    hidden = os.path.join(root, ".cache")
    os.makedirs(hidden, exist_ok=True)
    shutil.copy(os.path.join(root, "long", "kohya.safetensors"), os.path.join(hidden, "skipped.safetensors"))
    with open(os.path.join(root, "README.txt"), "w") as f:
        f.write("not an adapter")
    return root


def files_under(root: str) -> Iterator[tuple[str, str]]:
    """(absolute path, key relative to root) of every file, hidden ones included."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            yield full, os.path.relpath(full, root).replace(os.sep, "/")


def keys_after(root: str, prefix: str, after: str) -> Iterator[str]:
    """The keys (paths relative to `root`, "/"-separated) that start with `prefix` and sort after `after`, in
    sorted order, walking only the folders that can hold them, as a store lists a page without reading the
    whole bucket. (Walking every folder for each page took 35-170 ms for buckets of 800-3,000 objects, which
    delayed a listing client's first reads by as much.)"""

    def walk(folder: str, base: str) -> Iterator[str]:
        # A folder's keys sort as its entries' names do with "/" after a folder's name: "a-b/x" < "a/x".
        # As `files_under` (os.walk): a link to a folder is neither walked nor a key.
        with os.scandir(folder) as it:
            found = [(e, e.is_dir()) for e in it]
        entries = sorted(
            (e.name + "/" if is_dir else e.name, e, is_dir) for e, is_dir in found if not (is_dir and e.is_symlink())
        )
        for name, entry, is_dir in entries:
            key = base + name
            if not (key.startswith(prefix) or prefix.startswith(key)):
                continue  # neither under the prefix nor above it
            if is_dir:
                # Every key below starts with `key`: all of them sort before `after` unless `after` is below too.
                if key > after or after.startswith(key):
                    yield from walk(entry.path, key)
            elif key > after and key.startswith(prefix):
                yield key

    return walk(root, "")


def http_date(timestamp: float) -> str:
    return formatdate(timestamp, usegmt=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_options(endpoint: str) -> dict[str, str]:
    """lorafast's `storage_options` for a loopback S3 server (moto's, with the key pair it was started with,
    or `LocalS3`, which checks none)."""
    return {
        "endpoint": endpoint,
        "region": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }


class MotoS3:
    """moto's S3 server on 127.0.0.1 in a subprocess; `storage_options` reach it from lorafast."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    @property
    def storage_options(self) -> dict[str, str]:
        return s3_options(self.endpoint)

    def client(self, **kwargs: Any) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            **kwargs,
        )

    def upload(self, bucket: str, root: str) -> int:
        """Creates `bucket` and puts every file under `root` into it; returns the object count."""
        client = self.client()
        client.create_bucket(Bucket=bucket)
        items = list(files_under(root))

        def put(item: tuple[str, str]) -> None:
            with open(item[0], "rb") as f:
                client.put_object(Bucket=bucket, Key=item[1], Body=f.read())

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, items))
        return len(items)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def parse_range(spec: str | None, size: int) -> tuple[int, int] | None:
    """A `Range: bytes=a-b` (or `a-`, or `-n`) header as [start, end) of an object of `size` bytes; None for none."""
    if not spec or not spec.startswith("bytes="):
        return None
    a, _, b = spec[len("bytes=") :].partition("-")
    if a == "":
        return max(size - int(b), 0), size
    return int(a), min(int(b) + 1 if b else size, size)


class _Handler(BaseHTTPRequestHandler):
    # One response per connection: under load, keep-alive reuse against this small threaded server
    # was seen to hand the client a stale byte stream ("invalid HTTP version parsed") in 1 of ~5 full runs.
    protocol_version = "HTTP/1.0"
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1
            self.connection_number = self.server.connections

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _file(self) -> tuple[str, str] | None:
        """(mode, file path) for the request, or None (then a 404 has been sent)."""
        parts = self.path.split("?")[0].lstrip("/").split("/")
        mode, rest = parts[0], parts[1:]
        if mode == "hf" and len(rest) >= 4 and rest[2] == "resolve":
            rest = rest[:2] + rest[4:]  # /hf/{org}/{repo}/resolve/{rev}/path -> {org}/{repo}/path
        path = os.path.join(self.server.root, *rest)
        if not rest or not os.path.isfile(path):
            self._send(404, b"not found")
            return None
        return mode, path

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _range(self, size: int) -> tuple[int, int] | None:
        return parse_range(self.headers.get("Range"), size)

    def do_HEAD(self) -> None:
        self._log()
        self._serve(head=True)

    def do_GET(self) -> None:
        self._log()
        self._serve(head=False)

    def _log(self) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, self.path, self.headers.get("Range")))
            self.server.request_connections.append(self.connection_number)

    def _serve(self, head: bool) -> None:
        try:
            found = self._file()
            if found is None:
                return
            mode, path = found
            if mode == "hf":  # the Hub redirects resolve URLs to its file servers
                self.send_response(302)
                self.send_header("Location", "/ok/" + os.path.relpath(path, self.server.root))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with open(path, "rb") as f:
                data = f.read()
            st = os.stat(path)
            # Validators as web servers send them: an ETag from size and mtime (nginx's kind) and Last-Modified.
            validators = {"ETag": f'"{st.st_size:x}-{st.st_mtime_ns:x}"', "Last-Modified": http_date(st.st_mtime)}
            if mode == "slow":
                # Counted while held, before any answer: the client cannot have its slot back yet.
                with self.server.lock:
                    self.server.in_flight += 1
                    self.server.peak = max(self.server.peak, self.server.in_flight)
                time.sleep(self.server.delay)
                with self.server.lock:
                    self.server.in_flight -= 1
            if mode == "flaky":
                with self.server.lock:
                    attempt = self.server.attempts.get(path, 0)
                    self.server.attempts[path] = attempt + 1
                if attempt == 0:
                    return self._send(503, b"busy, try again")
                if attempt == 1:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
            if mode == "lie":  # claims the object is 16 bytes long
                data = data[:16]
            rng = None if mode == "norange" else self._range(len(data))
            if rng is None:
                return self._send(200, data, validators, head=head)
            a, b = rng
            if a >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head=head)
            body = data[a:b]
            headers = {"Content-Range": f"bytes {a}-{b - 1}/{len(data)}", **validators}
            if mode == "short":  # a consistent Content-Length, but fewer bytes than the range says
                body = body[: len(body) // 2]
            if mode == "truncate":  # announces the whole range, sends half, hangs up
                self.send_response(206)
                self.send_header("Content-Range", headers["Content-Range"])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self._send(206, body, headers, head=head)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True


class _KeepAliveHandler(_Handler):
    """HTTP/1.1: one connection serves many requests (for the tests that count connections, and benches)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    root: str
    delay: float
    requests: list[tuple[str, str, str | None]]
    attempts: dict[str, int]
    lock: threading.Lock
    #: Connections accepted since the last `clear`, and the number of the one each request came on.
    connections: int = 0
    request_connections: list[int]
    #: `slow` requests being held now, and the most at once since the last `clear`.
    in_flight: int = 0
    peak: int = 0

    def handle_error(self, request: Any, client_address: Any) -> None:  # clients that hang up are expected
        pass


class _LoopbackServer:
    """What both loopback servers share: `httpd` served from a thread on 127.0.0.1, and its request log."""

    def __init__(self, httpd: _Server, root: str) -> None:
        self.httpd = httpd
        httpd.root = root
        httpd.requests = []
        httpd.request_connections = []
        httpd.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        self.thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def requests(self) -> list[tuple[str, str, str | None]]:
        with self.httpd.lock:
            return list(self.httpd.requests)

    @property
    def connections(self) -> int:
        """Connections accepted since the last `clear`."""
        with self.httpd.lock:
            return self.httpd.connections

    @property
    def request_connections(self) -> list[int]:
        """For each request of `requests`, the number of the connection it came on."""
        with self.httpd.lock:
            return list(self.httpd.request_connections)

    def clear(self) -> None:
        with self.httpd.lock:
            self._reset()

    def _reset(self) -> None:
        """Forget what was served so far (the caller holds the lock)."""
        self.httpd.requests.clear()
        self.httpd.request_connections.clear()
        self.httpd.connections = 0

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class RangeServer(_LoopbackServer):
    """HTTP server over `root` on 127.0.0.1. URL `{url}/{mode}/{relative path}`, modes:

    ok (Range honoured), norange (always 200 with the whole file), truncate (half the announced
    body, then hang up), short (a 206 whose body is shorter than its Content-Range), lie (claims
    the file is 16 bytes), slow (waits `delay` s first), flaky (503, then a dropped connection,
    then ok, per file), hf (`/hf/{org}/{repo}/resolve/{rev}/{path}`, redirected like the Hub).
    """

    def __init__(self, root: str, delay: float = 3.0, keep_alive: bool = False) -> None:
        httpd = _Server(("127.0.0.1", 0), _KeepAliveHandler if keep_alive else _Handler)
        httpd.delay = delay
        httpd.attempts = {}
        super().__init__(httpd, root)

    @property
    def peak(self) -> int:
        """The most `slow` requests held at once (all unanswered) since the last `clear`."""
        with self.httpd.lock:
            return self.httpd.peak

    def _reset(self) -> None:
        super()._reset()
        self.httpd.attempts.clear()
        self.httpd.peak = self.httpd.in_flight


class S3Store:
    """What `LocalS3` answers, apart from HTTP: path-style `/{bucket}/{key}` GET and HEAD (with `Range`), and
    ListObjectsV2 on `/{bucket}?list-type=2`, over the folders of `root`. Shared by `LocalS3` (a threaded server,
    for tests) and the benchmark's event-loop server (`benches/bench_remote.py`)."""

    def __init__(self, root: str, page_delay: float = 0.0, page_keys: int = 1000) -> None:
        self.root = root
        self.page_delay = page_delay
        self.page_keys = page_keys
        self.etags: dict[tuple[str, int, int, int], str] = {}
        self.lock = threading.Lock()

    def answer(self, target: str, range_spec: str | None) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of a GET of `target` (a HEAD sends the same without the body)."""
        path, _, query = target.partition("?")
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        root = os.path.join(self.root, bucket)
        if not bucket or not os.path.isdir(root):
            return self._error(404, "NoSuchBucket")
        if not key:
            return self._list(root, parse_qs(query))
        full = os.path.join(root, *key.split("/"))
        if ".." in key.split("/") or not os.path.isfile(full):
            return self._error(404, "NoSuchKey")
        with open(full, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            headers = {"ETag": self.etag(full, st, f), "Last-Modified": http_date(st.st_mtime)}
            rng = parse_range(range_spec, size)
            # Only the range is read, as a store serves it (the benchmark's objects are 130 KB).
            if rng is None:
                f.seek(0)
                return 200, headers, f.read()
            a, b = rng
            if a >= size:
                return 416, {"Content-Range": f"bytes */{size}"}, b""
            f.seek(a)
            body = f.read(b - a)
        headers["Content-Range"] = f"bytes {a}-{b - 1}/{size}"
        return 206, headers, body

    def etag(self, path: str, st: os.stat_result, f: Any) -> str:
        """The md5 of the content in quotes, as S3 gives for an object put in one piece (cached until the file
        changes: ctime moves on every write, whatever a writer sets the mtime to)."""
        key = (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self.lock:
            found = self.etags.get(key)
        if found is None:
            found = f'"{hashlib.md5(f.read()).hexdigest()}"'
            with self.lock:
                self.etags[key] = found
        return found

    @staticmethod
    def _error(status: int, code: str) -> tuple[int, dict[str, str], bytes]:
        body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code></Error>'.encode()
        return status, {"Content-Type": "application/xml"}, body

    def _list(self, root: str, q: dict[str, list[str]]) -> tuple[int, dict[str, str], bytes]:
        arg = lambda name, default="": q.get(name, [default])[0]  # noqa: E731
        prefix, delimiter = arg("prefix"), arg("delimiter")
        after = max(arg("continuation-token"), arg("start-after"))
        if arg("continuation-token"):
            time.sleep(self.page_delay)
        limit = min(int(arg("max-keys", "1000")), self.page_keys)
        contents: list[str] = []
        prefixes: list[str] = []
        last = ""
        truncated = False
        for k in keys_after(root, prefix, after):
            if len(contents) + len(prefixes) == limit:
                truncated = True  # a key follows the page's last
                break
            rest = k[len(prefix) :]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter)[0] + delimiter
                if not prefixes or prefixes[-1] != common:
                    prefixes.append(common)
                last = k
                continue
            full = os.path.join(root, *k.split("/"))
            with open(full, "rb") as f:
                st = os.fstat(f.fileno())
                etag = self.etag(full, st, f)
            modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
            contents.append(
                f"<Contents><Key>{escape(k)}</Key><LastModified>{modified}</LastModified>"
                f"<ETag>{escape(etag)}</ETag><Size>{st.st_size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
            )
            last = k
        if delimiter and truncated and prefixes and last.startswith(prefixes[-1]):
            # The next page starts after every key under the last common prefix.
            last = prefixes[-1] + "\U0010ffff"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(os.path.basename(root))}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{limit}</MaxKeys>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
            + "".join(contents)
            + "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
            + (f"<NextContinuationToken>{escape(last)}</NextContinuationToken>" if truncated else "")
            + "</ListBucketResult>"
        ).encode()
        return 200, {"Content-Type": "application/xml"}, body


class _S3Handler(_Handler):
    """`LocalS3`'s requests, answered by its `S3Store`."""

    server: _S3Server

    def _serve(self, head: bool) -> None:
        try:
            status, headers, body = self.server.store.answer(self.path, self.headers.get("Range"))
            self._send(status, body, headers, head=head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class _KeepAliveS3Handler(_S3Handler):
    protocol_version = _KeepAliveHandler.protocol_version
    disable_nagle_algorithm = True


class _S3Server(_Server):
    request_queue_size = 1024  # the listen backlog (5 by default drops bursts of connects)
    store: S3Store


class LocalS3(_LoopbackServer):
    """A small S3-compatible server over a folder, on 127.0.0.1: each top-level folder of `root` is a bucket.

    It answers ListObjectsV2 (prefix, delimiter, pages of at most 1,000 keys), GET with `Range` and HEAD, with
    S3's ETag (the md5 of the content) and Last-Modified (the file's mtime, to the second); it checks no
    signature. Files changed on disk are served as changed, and every request is logged in `requests`, so
    tests can count what a scan asked for. `page_keys` caps a listing page (S3's cap: 1,000) and `page_delay`
    holds each page after the first that many seconds, for tests of long listings. Much lighter than moto, which makes it the benchmark's S3 server
    (`keep_alive=True`: HTTP/1.1 connections that serve many requests, as S3's do).
    """

    def __init__(self, root: str, keep_alive: bool = False, page_delay: float = 0.0, page_keys: int = 1000) -> None:
        httpd = _S3Server(("127.0.0.1", 0), _KeepAliveS3Handler if keep_alive else _S3Handler)
        httpd.store = S3Store(root, page_delay, page_keys)
        super().__init__(httpd, root)
        self.endpoint = self.url

    @property
    def storage_options(self) -> dict[str, str]:
        return s3_options(self.endpoint)


def _map(value: Any, src: str, dst: str) -> Any:
    if isinstance(value, str):
        return dst + value[len(src) :] if value.startswith(src) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, src, dst) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, src, dst) for k, v in value.items()}
    return value


def normalized(report: Any, src: str | None = None, dst: str | None = None) -> dict[str, Any]:
    """Everything a report holds, as plain data; paths starting with `src` rewritten to start with `dst`."""
    data = {
        "paths": report.paths,
        "errors": report.errors,
        "columns": {k: v.tolist() for k, v in report.columns().items()},
        "records": [report.record(i) for i in range(len(report))],
        "summary": report.summary(),
    }
    return _map(data, src, dst) if src is not None and dst is not None else data


class _HostileHandler(_Handler):
    """`HostileServer`'s requests: every request's headers logged, then `/{mode}/{path}` answered by a mode below
    or, for the `RangeServer` modes (`ok`, `hf`, ...), as `RangeServer` answers."""

    server: _HostileServer

    def _log(self) -> None:
        super()._log()
        with self.server.lock:
            self.server.seen_headers.append((self.path, dict(self.headers.items())))

    def _serve(self, head: bool) -> None:
        mode = self.path.lstrip("/").split("/", 1)[0]
        answer = getattr(self, f"_mode_{mode}", None)
        if answer is None:
            return super()._serve(head)
        try:
            answer()
        except OSError:  # the client hung up: what a bounded client does
            self.close_connection = True

    def _forever(self, chunk: bytes, pause: float = 0.0) -> None:
        """Writes `chunk` until the client hangs up (or 120 s pass, so that no thread outlives a test run)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.wfile.write(chunk)
            self.wfile.flush()
            if pause:
                time.sleep(pause)

    def _mode_endless_headers(self) -> None:
        self.wfile.write(b"HTTP/1.1 206 Partial Content\r\n")
        self._forever(b"X-Filler: " + b"a" * 1000 + b"\r\n")

    def _mode_endless_body(self) -> None:
        """200 with no length: zeros until the client hangs up."""
        self.wfile.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        self._forever(b"\0" * (64 << 10))

    def _mode_endless_range(self) -> None:
        """206 with the range asked for, but no length and a body that never ends."""
        rng = self._range(1 << 40) or (0, 1 << 40)
        self.wfile.write(
            f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {rng[0]}-{rng[1] - 1}/{1 << 40}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        self._forever(b"\0" * (64 << 10))

    def _mode_overlong(self) -> None:
        """206 with the range asked for, but a length of 2**40 and a body of zeros that goes on past the range."""
        rng = self._range(1 << 40) or (0, 1 << 40)
        self.wfile.write(
            f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {rng[0]}-{rng[1] - 1}/{1 << 40}\r\n"
            f"Content-Length: {1 << 40}\r\nConnection: close\r\n\r\n".encode()
        )
        self._forever(b"\0" * (64 << 10))

    def _found(self) -> tuple[bytes, tuple[int, int]] | None:
        """The file's bytes and the range asked for (404 sent when there is no such file)."""
        found = self._file()
        if found is None:
            return None
        with open(found[1], "rb") as f:
            data = f.read()
        return data, self._range(len(data)) or (0, len(data))

    def _partial(self, body: bytes, content_range: str) -> None:
        self._send(206, body, {"Content-Range": content_range})

    def _mode_drip(self) -> None:
        """A valid answer, one byte every 0.5 s: each read is quick, the whole never comes."""
        found = self._found()
        if found is not None:
            data, (a, b) = found
            head = f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b - 1}/{len(data)}\r\n"
            for byte in (head + f"Content-Length: {b - a}\r\n\r\n").encode() + data[a:b]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)

    def _mode_star(self) -> None:
        """The range asked for, of an object of unknown size (`bytes a-b/*`)."""
        found = self._found()
        if found is not None:
            data, (a, b) = found
            self._partial(data[a:b], f"bytes {a}-{b - 1}/*")

    def _mode_huge(self) -> None:
        """The range asked for, of an object said to be 2**60 bytes long."""
        found = self._file()
        if found is not None:
            with open(found[1], "rb") as f:
                data = f.read()
            a, b = self._range(1 << 60) or (0, len(data))
            body = data[a:b].ljust(b - a, b"\0")  # as much as asked for: the object goes on
            self._partial(body, f"bytes {a}-{b - 1}/{1 << 60}")

    def _mode_shifted(self) -> None:
        """Another range than the one asked for: one byte further on, of the same length."""
        found = self._found()
        if found is not None:
            data, (a, b) = found
            self._partial(data[a + 1 : b + 1], f"bytes {a + 1}-{b}/{len(data)}")

    def _mode_redirect(self) -> None:
        """302 to the same path (mode `ok`, or `hf` under `/redirect/hf/...`) on `redirect_to`."""
        rest = self.path.split("/", 2)[2]
        self.send_response(302)
        self.send_header("Location", f"{self.server.redirect_to}/{rest if rest.startswith('hf/') else 'ok/' + rest}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _mode_loop(self) -> None:
        """302 to the same URL, for ever."""
        self.send_response(302)
        self.send_header("Location", self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _HostileServer(_Server):
    seen_headers: list[tuple[str, dict[str, str]]]
    redirect_to: str


class HostileServer(_LoopbackServer):
    """A server over `root` that misbehaves, on `host` (any loopback address: 127.0.0.2 is another host for a
    client). URL `{url}/{mode}/{relative path}`; every request's headers are kept in `seen_headers`. Modes, besides
    `RangeServer`'s: endless_headers (response headers that never end), endless_body (200, zeros forever),
    endless_range (206 of the range asked for, no length, zeros forever), drip (a valid 206, one byte every 0.5 s),
    star (`Content-Range: bytes a-b/*`), huge (a total of 2**60), shifted (another range than asked for), redirect
    (302 to the same path on `redirect_to`: `/redirect/x` to `{redirect_to}/ok/x`, `/redirect/hf/...` to
    `{redirect_to}/hf/...`), loop (302 to the same URL)."""

    httpd: _HostileServer

    def __init__(self, root: str, host: str = "127.0.0.1", redirect_to: str = "") -> None:
        httpd = _HostileServer((host, 0), _HostileHandler)
        httpd.seen_headers = []
        httpd.redirect_to = redirect_to
        httpd.delay = 0.0
        httpd.attempts = {}
        super().__init__(httpd, root)
        self.url = f"http://{host}:{httpd.server_address[1]}"

    def _reset(self) -> None:
        super()._reset()
        self.httpd.seen_headers.clear()

    @property
    def seen_headers(self) -> list[tuple[str, dict[str, str]]]:
        """(path, request headers) of every request so far."""
        with self.httpd.lock:
            return list(self.httpd.seen_headers)
