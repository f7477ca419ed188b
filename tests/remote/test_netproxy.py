"""benches/netproxy.py, the latency proxy of `benches/bench_remote.py`: what goes through it arrives whole and in
order both ways, a half-closed connection still gets its answer, and connections past --max-conns are refused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

PROXY = os.path.join(os.path.dirname(__file__), "..", "..", "benches", "netproxy.py")


def reversing_server() -> tuple[socket.socket, threading.Thread]:
    """Loopback server: reads each connection to EOF, answers with the bytes reversed, closes."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = bytearray()
                while chunk := conn.recv(1 << 16):
                    data += chunk
                conn.sendall(bytes(reversed(data)))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.fixture
def proxy():
    srv, _ = reversing_server()
    p = subprocess.Popen(
        [sys.executable, PROXY, "--upstream-port", str(srv.getsockname()[1]), "--rtt-ms", "4", "--mbit", "400",
         "--max-conns", "2", "--lifetime", "60"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    port = int(p.stdout.readline())
    yield port
    p.communicate(timeout=10)  # its stdin closes: it exits
    srv.close()


def exchange(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        out = bytearray()
        while chunk := c.recv(1 << 16):
            out += chunk
        return bytes(out)


def test_bytes_arrive_whole_and_in_order_both_ways(proxy):
    # 6 MiB: past the 4 MiB a direction queues before it pauses its sender.
    payload = os.urandom(6 << 20)
    assert exchange(proxy, payload) == payload[::-1]
    assert exchange(proxy, b"x") == b"x"


def test_connections_past_the_limit_are_refused(proxy):
    held = [socket.create_connection(("127.0.0.1", proxy), timeout=30) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", proxy), timeout=30) as extra:
            assert extra.recv(1) == b""  # closed by the proxy
    finally:
        for c in held:
            c.close()
