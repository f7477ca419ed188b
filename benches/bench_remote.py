"""Remote scan throughput: lorafast.scan of an S3 bucket against boto3 loops, on a loopback S3 server.

Writes 2,000 dense PEFT adapters (448 tensors each, the header fits the first 64 KiB range), puts
them into moto's S3 server on 127.0.0.1, then times, in this one run:
  lorafast.scan("s3://bench/")  list + config + ranged header reads, full validation and classification;
  B1 a Python loop: list_objects_v2, then per adapter get_object(config) + get_object(Range=...) + json.loads;
  B2 the same loop on 32 threads.
Prints adapters/s, the ratios, and the CPU seconds of the S3 server and of this client per run:
moto is a Python server, so on a small machine it, not the client, bounds the fastest method.
Usage: python benches/bench_remote.py [-n 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lorafast

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
from bench_scan import make_dense  # noqa: E402
from servers import MotoS3  # noqa: E402

BUCKET = "bench"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def max_rank(header: dict[str, Any]) -> int:
    return max((v["shape"][0] for k, v in header.items() if k.endswith("lora_A.weight")), default=0)


def read_adapter(client: Any, folder: str) -> int:
    json.loads(client.get_object(Bucket=BUCKET, Key=f"{folder}/adapter_config.json")["Body"].read())
    key = f"{folder}/adapter_model.safetensors"
    body = client.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-65535")["Body"].read()
    (n,) = struct.unpack("<Q", body[:8])
    if 8 + n > len(body):
        body += client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={len(body)}-{7 + n}")["Body"].read()
    return max_rank(json.loads(body[8 : 8 + n]))


def list_folders(client: Any) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return sorted(k.rsplit("/", 1)[0] for k in keys if k.endswith("/adapter_config.json"))


def boto3_loop(server: MotoS3) -> int:
    client = server.client()
    return sum(1 for folder in list_folders(client) if read_adapter(client, folder) >= 0)


def boto3_threads(server: MotoS3) -> int:
    from botocore.config import Config

    client = server.client(config=Config(max_pool_connections=32))  # boto3 clients are thread-safe
    with ThreadPoolExecutor(32) as pool:
        return sum(1 for r in pool.map(lambda f: read_adapter(client, f), list_folders(client)) if r >= 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"lorafast {lorafast.__version__}, core build: {lorafast._core.build_profile}, cpus: {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        make_dense(tmp, args.n)
        print(f"wrote {args.n} adapters in {time.perf_counter() - t:.1f}s")
        server = MotoS3()
        try:
            t = time.perf_counter()
            objects = server.upload(BUCKET, tmp)
            print(f"uploaded {objects} objects to moto on 127.0.0.1 in {time.perf_counter() - t:.1f}s\n")
            opts = server.storage_options

            def lorafast_scan() -> int:
                report = lorafast.scan(f"s3://{BUCKET}/", storage_options=opts)
                assert not report.errors, report.errors[:3]
                return len(report)

            methods: list[tuple[str, Callable[[], int]]] = [
                ("lorafast.scan (s3://, 64 in flight)", lorafast_scan),
                ("B1 boto3 loop: get_object(Range) + json.loads", lambda: boto3_loop(server)),
                ("B2 boto3 on 32 threads", lambda: boto3_threads(server)),
            ]
            rows = []
            for name, fn in methods:
                best, cpu, client = float("inf"), 0.0, 0.0
                for _ in range(args.repeat):
                    c0, p0, t0 = cpu_seconds(server.proc.pid), cpu_seconds(os.getpid()), time.perf_counter()
                    count = fn()
                    elapsed = time.perf_counter() - t0
                    if elapsed < best:
                        best, cpu = elapsed, cpu_seconds(server.proc.pid) - c0
                        client = cpu_seconds(os.getpid()) - p0
                    assert count == args.n, (name, count)
                rows.append((name, args.n / best, best, cpu, client))
        finally:
            server.stop()
    base = rows[0][1]
    print(
        f"{'method':48} {'adapters/s':>11} {'seconds':>8} {'server cpu s':>13} {'client cpu s':>13} {'lorafast x':>11}"
    )
    for name, rate, secs, cpu, client in rows:
        print(f"{name:48} {rate:11.0f} {secs:8.2f} {cpu:13.2f} {client:13.2f} {base / rate:11.2f}")


if __name__ == "__main__":
    main()
