"""Remote scans at network speed: lorafast against boto3 / huggingface_hub loops, behind a latency proxy.

Writes N small-header adapters (one .safetensors of 16 tensors each: a ~2 KB header, 128 KiB of data, so what
a first read asks past the header is tensor data), and serves them on loopback from
  s3:       moto's S3 app (as tests/helpers/servers.py MotoS3 runs it, but behind an HTTP/1.1 keep-alive server),
  s3-light: tests/helpers/servers.py LocalS3's answers (ListObjectsV2, ranged GET, HEAD over a folder; `S3Store`) from
            one asyncio event loop with keep-alive: a lighter S3-compatible server than moto, and
  http:     the range server of tests/helpers/servers.py, with keep-alive, laid out as the Hub's resolve URLs,
each in a subprocess, behind benches/netproxy.py (an asyncio TCP proxy on 127.0.0.1 that adds the round trip
time, a handshake round trip per new connection, and a bandwidth limit per direction). For each store and
RTT, in the same run:
  lorafast.scan(..., concurrency=C)          list (s3) + one ranged GET per adapter, full validation
  B1 sequential loop                          s3: boto3 get_object(Range=0-65535) + json.loads;
                                              http: huggingface_hub HfApi.parse_safetensors_file_metadata
  B2 the same on a thread pool of C threads   (boto3 with max_pool_connections=C; one hf session per thread)
The bound is min(C / RTT, server capacity) adapters/s: C / RTT for one request per adapter, and the server's
capacity measured in the same run with no proxy (the faster of lorafast and the thread pool, straight to the
server), since a Python server on a shared machine can be slower than the network model. Both are printed.
Client CPU is this process's CPU time (time.process_time: every thread, lorafast's tokio workers included) per
adapter; server and proxy CPU are read from /proc so a saturated server is visible; each row carries the
1-minute load average (the machine is shared). Only 127.0.0.1 is used.
Usage: python benches/bench_remote.py [-n 800] [--rtt-ms 20 80] [--mbit 200] [-c 16] [--stores s3 s3-light http]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lorafast
from lorafast.testing import write_safetensors

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests")]
from helpers.servers import files_under  # noqa: E402

BUCKET = "bench"
HOST = "127.0.0.1"
WEIGHTS = "adapter_model.safetensors"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_fleet(root: str, n: int) -> list[str]:
    """n single-file adapters `bench/aNNNNN/resolve/main/adapter_model.safetensors`; returns the repo ids."""
    repos = []
    for i in range(n):
        repo = f"{BUCKET}/a{i:05d}"
        folder = os.path.join(root, repo, "resolve", "main")
        os.makedirs(folder)
        tensors = {}
        for layer in range(4):
            for m in ("q_proj", "v_proj"):
                key = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                tensors[f"{key}.lora_A.weight"] = ("BF16", (8, 512))
                tensors[f"{key}.lora_B.weight"] = ("BF16", (512, 8))
        write_safetensors(os.path.join(folder, WEIGHTS), tensors)
        repos.append(repo)
    return repos


def checked(report: Any) -> int:
    assert not report.errors, report.errors[:3]
    assert set(report.columns()["rank"].tolist()) == {8}
    return len(report)


def max_rank(header: dict[str, Any]) -> int:
    return max((v["shape"][0] for k, v in header.items() if k.endswith("lora_A.weight")), default=0)


# ------------------------------------------------------------------ servers and the proxy


class Child:
    """A subprocess that prints its port first and stops when its stdin closes."""

    #: Niceness of the children (servers and proxy: the "network"), lowered when `--nice` is given, so that
    #: other work on a shared machine does not show up as network latency.
    nice = 0

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=(lambda: os.nice(Child.nice)) if Child.nice else None,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"{args[0]} did not start: {line!r}")
        self.port = int(line)

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> str:
        out = ""
        try:
            out = self.proc.communicate(timeout=10)[0] or ""
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return out


def serve_http(root: str) -> None:
    """Child mode: tests/helpers/servers.py's range server over `root`, HTTP/1.1 keep-alive, until stdin closes."""
    from helpers.servers import RangeServer, _Server

    _Server.request_queue_size = 1024  # the listen backlog (5 by default drops bursts of connects)
    server = RangeServer(root, keep_alive=True)
    print(server.httpd.server_address[1], flush=True)
    sys.stdin.read()
    server.stop()


def serve_s3_light(root: str) -> None:
    """Child mode: LocalS3's answers (tests/helpers/servers.py `S3Store`; bucket = a top-level folder of `root`) from one
    asyncio event loop, HTTP/1.1 keep-alive, until stdin closes.

    Not LocalS3's own threaded server: with a thread per connection, 16 connections' requests handed the GIL
    from thread to thread, and the kernel's context switches were over half of the server's CPU (0.5 ms a
    request), so that requests arriving within one round trip queued behind each other.
    """
    from http import HTTPStatus

    from helpers.servers import S3Store

    store = S3Store(root)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ", 2)
                fields = dict((k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in head[1:] if h))
                if method in ("GET", "HEAD") and "list-type=" in target:
                    # A listing walks the bucket (tens of ms): on a thread, as a store serves reads while it lists.
                    answer = functools.partial(store.answer, target, fields.get("range"))
                    status, headers, body = await asyncio.get_running_loop().run_in_executor(None, answer)
                elif method in ("GET", "HEAD"):
                    status, headers, body = store.answer(target, fields.get("range"))
                else:
                    status, headers, body = 501, {}, b""
                lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
                lines += [f"{k}: {v}" for k, v in headers.items()] + [f"Content-Length: {len(body)}", "", ""]
                writer.write("\r\n".join(lines).encode() + (body if method != "HEAD" else b""))
                await writer.drain()
                if fields.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, HOST, 0, backlog=1024)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


def serve_s3() -> None:
    """Child mode: moto's S3 app behind a threaded HTTP/1.1 keep-alive server, until stdin closes.

    moto's own server (werkzeug's development server) closes every connection after one response,
    which no real S3 endpoint does; behind the proxy that would add a handshake round trip to every
    request of every method.
    """
    import io
    import urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from moto.server import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def handle_wsgi(self) -> None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = b""
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
            else:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path, _, query = self.path.partition("?")
            environ: dict[str, Any] = {
                "REQUEST_METHOD": self.command,
                "PATH_INFO": urllib.parse.unquote(path),
                "QUERY_STRING": query,
                "RAW_URI": self.path,
                "REQUEST_URI": self.path,
                "SERVER_NAME": HOST,
                "SERVER_PORT": str(self.server.server_address[1]),
                "SERVER_PROTOCOL": "HTTP/1.1",
                "REMOTE_ADDR": HOST,
                "CONTENT_LENGTH": str(len(body)),
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "wsgi.input": io.BytesIO(body),
                "wsgi.errors": sys.stderr,
                "wsgi.url_scheme": "http",
                "wsgi.version": (1, 0),
                "wsgi.multithread": True,
                "wsgi.multiprocess": False,
                "wsgi.run_once": False,
            }
            for k, v in self.headers.items():
                if k.lower() not in ("content-type", "content-length"):
                    environ["HTTP_" + k.upper().replace("-", "_")] = v
            started: list[Any] = []

            def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                started[:] = [status, headers]
                return lambda data: None

            result = app(environ, start_response)
            try:
                data = b"".join(result)
            finally:
                getattr(result, "close", lambda: None)()
            status, headers = started
            code, _, reason = status.partition(" ")
            self.send_response(int(code), reason)
            head = self.command == "HEAD"
            for k, v in headers:
                if k.lower() not in ("connection", "transfer-encoding") and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_wsgi

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024

    httpd = Server((HOST, 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(httpd.server_address[1], flush=True)
    sys.stdin.read()
    httpd.shutdown()


class Proxy(Child):
    def __init__(self, upstream: int, rtt_ms: float, mbit: float) -> None:
        script = os.path.join(HERE, "netproxy.py")
        super().__init__([script, "--upstream-port", str(upstream), "--rtt-ms", str(rtt_ms), "--mbit", str(mbit)])

    def stats(self) -> tuple[int, int, int]:
        """(connections accepted, bytes up, bytes down) so far."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        a, up, down = self.proc.stdout.readline().split()
        return int(a), int(up), int(down)


# ------------------------------------------------------------------ the methods


def s3_read(client: Any, key: str) -> int:
    body = client.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-65535")["Body"].read()
    (n,) = struct.unpack("<Q", body[:8])
    if 8 + n > len(body):
        body += client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={len(body)}-{7 + n}")["Body"].read()
    return max_rank(json.loads(body[8 : 8 + n]))


def s3_keys(client: Any) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith(".safetensors"))


def s3_client(endpoint: str, pool: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(max_pool_connections=pool, retries={"max_attempts": 1}),
    )


def hf_read(api: Any, repo: str) -> int:
    meta = api.parse_safetensors_file_metadata(repo, WEIGHTS)
    return max(t.shape[0] for k, t in meta.tensors.items() if k.endswith("lora_A.weight"))


async def raw_gets(port: int, paths: list[str], c: int) -> int:
    """`c` keep-alive connections sending one ranged GET per path (4 KiB: what lorafast asks for once it knows
    a store's headers are short), reading each answer whole; returns how many held a complete header."""
    todo = list(reversed(paths))
    complete = 0

    async def connection() -> None:
        nonlocal complete
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            while todo:
                writer.write(f"GET {todo.pop()} HTTP/1.1\r\nHost: {HOST}\r\nRange: bytes=0-4095\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                body = await reader.readexactly(int(found.group(1)) if found else 0)
                complete += len(body) >= 8 and 8 + struct.unpack("<Q", body[:8])[0] <= len(body)
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(c)))
    return complete


class Case:
    """One store behind one proxy: the methods to time."""

    def __init__(self, store: str, port: int, repos: list[str], concurrency: int, seq_n: int) -> None:
        self.store, self.repos, self.c, self.port = store, repos, concurrency, port
        self.seq_n = min(seq_n, len(repos))
        self.endpoint = f"http://{HOST}:{port}"
        self.s3 = store.startswith("s3")

    def inputs(self) -> tuple[list[str], dict[str, str] | None]:
        """What lorafast is given: the bucket, or the weights' URLs; and the storage options."""
        if self.s3:
            opts = {"endpoint": self.endpoint, "region": "us-east-1", "aws_access_key_id": "testing"}
            opts["aws_secret_access_key"] = "testing"
            return [f"s3://{BUCKET}/"], opts
        return [f"{self.endpoint}/ok/{r}/resolve/main/{WEIGHTS}" for r in self.repos], None

    def lorafast(self) -> int:
        paths, opts = self.inputs()
        return checked(lorafast.scan(paths, storage_options=opts, concurrency=self.c))

    def index_rescan(self, db: str) -> Callable[[], int]:
        """lorafast.Index: fills `db` now (untimed); the returned call is a rescan of the unchanged fleet, which
        must read no header (the listing only, or for http one HEAD per file)."""
        paths, opts = self.inputs()
        with lorafast.Index(db) as index:
            index.scan(paths, storage_options=opts, concurrency=self.c)

        def rescan() -> int:
            with lorafast.Index(db) as index:
                report = index.scan(paths, storage_options=opts, concurrency=self.c)
            assert report.reads == 0 and not report.changed, (report.reads, report.changed[:3])
            return checked(report)

        return rescan

    def floor(self) -> int:
        """B0, the least a client can do on this path: raw ranged GETs on `c` keep-alive connections, keys known
        in advance (no listing), nothing parsed but the header length."""
        if self.store == "s3":  # moto's keys leave out the resolve/main folders
            paths = [f"/{r}/{WEIGHTS}" for r in self.repos]
        else:
            paths = [f"{'' if self.s3 else '/ok'}/{r}/resolve/main/{WEIGHTS}" for r in self.repos]
        return asyncio.run(raw_gets(self.port, paths, self.c))

    def sequential(self) -> int:
        if self.s3:
            client = s3_client(self.endpoint, 1)
            keys = s3_keys(client)[: self.seq_n]
            return sum(1 for k in keys if s3_read(client, k) == 8)
        from huggingface_hub import HfApi

        api = HfApi(endpoint=f"{self.endpoint}/ok", token=False)
        return sum(1 for r in self.repos[: self.seq_n] if hf_read(api, r) == 8)

    def threads(self) -> int:
        with ThreadPoolExecutor(self.c) as pool:
            if self.s3:
                client = s3_client(self.endpoint, self.c)  # boto3 clients are thread-safe
                return sum(1 for r in pool.map(lambda k: s3_read(client, k), s3_keys(client)) if r == 8)
            from huggingface_hub import HfApi

            api = HfApi(endpoint=f"{self.endpoint}/ok", token=False)
            return sum(1 for r in pool.map(lambda repo: hf_read(api, repo), self.repos) if r == 8)


def timed(fn: Callable[[], int], server: Child, proxy: Proxy | None) -> dict[str, float]:
    pid = server.proc.pid
    s0, p0 = cpu_seconds(pid), proxy.cpu() if proxy else 0.0
    k0 = proxy.stats() if proxy else (0, 0, 0)
    c0, t0 = time.process_time(), time.perf_counter()
    count = fn()
    if not count:
        raise RuntimeError(f"{fn.__name__} read no adapter")
    wall, client = time.perf_counter() - t0, time.process_time() - c0
    k1 = proxy.stats() if proxy else (0, 0, 0)
    return {
        "count": count,
        "wall": wall,
        "rate": count / wall,
        "client_ms": 1e3 * client / count,
        "server_cpu": cpu_seconds(pid) - s0,
        "proxy_cpu": (proxy.cpu() - p0) if proxy else 0.0,
        "conns": k1[0] - k0[0],
        "kib_down": (k1[2] - k0[2]) / 1024 / count,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=800)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[20.0, 80.0])
    ap.add_argument("--mbit", type=float, default=200.0, help="proxy bandwidth per direction")
    ap.add_argument("--seq-n", type=int, default=30, help="adapters the sequential loop reads")
    ap.add_argument("--stores", nargs="+", default=["s3", "s3-light", "http"], choices=["s3", "s3-light", "http"])
    ap.add_argument("--serve-http", help=argparse.SUPPRESS)
    ap.add_argument("--serve-s3-light", help=argparse.SUPPRESS)
    ap.add_argument("--serve-s3", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nice", type=int, default=0, help="niceness change of the servers and proxy (e.g. -10, root)")
    args = ap.parse_args()
    Child.nice = args.nice
    if args.serve_http:
        return serve_http(args.serve_http)
    if args.serve_s3:
        return serve_s3()
    if args.serve_s3_light:
        return serve_s3_light(args.serve_s3_light)
    import huggingface_hub

    print(
        f"lorafast {lorafast.__version__} (core build: {lorafast._core.build_profile}), "
        f"huggingface_hub {huggingface_hub.__version__}, cpus: {os.cpu_count()}; "
        f"{args.n} adapters, concurrency {args.concurrency}, {args.mbit:g} Mbit/s each way"
    )
    rows = []
    tmp = tempfile.mkdtemp(prefix="lf-bench-remote-")
    try:
        repos = make_fleet(tmp, args.n)
        for store in args.stores:
            if store == "s3":
                server: Any = Child([os.path.abspath(__file__), "--serve-s3"])
                client = s3_client(f"http://{HOST}:{server.port}", 8)
                client.create_bucket(Bucket=BUCKET)
                for full, key in files_under(os.path.join(tmp, BUCKET)):
                    with open(full, "rb") as f:
                        # Public objects: the raw-GET floor (B0) sends no signature.
                        key = key.replace("/resolve/main", "")
                        client.put_object(Bucket=BUCKET, Key=key, Body=f.read(), ACL="public-read")
            elif store == "s3-light":
                server = Child([os.path.abspath(__file__), "--serve-s3-light", tmp])
            else:
                server = Child([os.path.abspath(__file__), "--serve-http", tmp])
            base_port = server.port
            try:
                # Server capacity with no proxy: the most any method reaches here, in this run.
                direct = Case(store, base_port, repos, args.concurrency, args.seq_n)
                direct.lorafast()  # warm-up (lazy imports, the server's first requests)
                r = timed(direct.lorafast, server, None)
                rows.append((store, 0.0, "lorafast, no proxy", r, (0.0, 0.0, 0.0)))
                print_row(rows[-1])
                t = timed(direct.threads, server, None)
                rows.append((store, 0.0, f"B2 {args.concurrency} threads, no proxy", t, (0.0, 0.0, 0.0)))
                print_row(rows[-1])
                capacity = max(r["rate"], t["rate"])
                for rtt in args.rtt_ms:
                    proxy = Proxy(base_port, rtt, args.mbit)
                    try:
                        case = Case(store, proxy.port, repos, args.concurrency, args.seq_n)
                        bound = (args.concurrency / (rtt / 1e3), capacity)
                        floor = 0.0
                        for name, fn in [
                            (f"B0 raw GETs, {args.concurrency} connections", case.floor),
                            (f"lorafast.scan, concurrency={args.concurrency}", case.lorafast),
                            ("B1 sequential " + ("boto3" if case.s3 else "huggingface_hub"), case.sequential),
                            (f"B2 {args.concurrency} threads", case.threads),
                            (
                                "lorafast.Index rescan, unchanged",
                                case.index_rescan(os.path.join(tmp, f"{store}-{rtt:g}.db")),
                            ),
                        ]:
                            r = timed(fn, server, proxy)
                            if name.startswith("B0"):
                                floor = r["rate"]
                            # An unchanged rescan sends (almost) no request per adapter: no bound applies.
                            rows.append((store, rtt, name, r, (0.0, 0.0, 0.0) if "Index" in name else (*bound, floor)))
                            print_row(rows[-1])
                    finally:
                        proxy.stop()
            finally:
                server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("bound = min(C/RTT, server capacity with no proxy); x B0 = rate / the raw-GET floor's rate on the same path")
    print(f"{'store':8} {'rtt':>4} {'method':36} {'adapters/s':>10} {'C/RTT':>6} {'capacity':>8} {'% bound':>7} "
          f"{'%C/RTT':>6} {'x B0':>5} {'client ms/ad':>12} {'server cpu s':>12} {'proxy cpu s':>11} {'conns':>5} "
          f"{'KiB/ad':>6} {'load':>5}")  # fmt: skip
    for row in rows:
        print_row(row)


def print_row(row: tuple[str, float, str, dict[str, float], tuple[float, float, float]]) -> None:
    store, rtt, name, r, (net, capacity, floor) = row
    if net:
        bound = min(net, capacity)
        pct = f"{net:6.0f} {capacity:8.0f} {100 * r['rate'] / bound:6.0f}% {100 * r['rate'] / net:5.0f}%"
        pct += f" {r['rate'] / floor:5.2f}"
    else:
        pct = f"{'':6} {'':8} {'':7} {'':6} {'':5}"
    print(
        f"{store:8} {rtt:4.0f} {name:36} {r['rate']:10.0f} {pct} {r['client_ms']:12.3f} "
        f"{r['server_cpu']:12.2f} {r['proxy_cpu']:11.2f} {r['conns']:5.0f} {r['kib_down']:6.1f} {r['load']:5.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
