"""A loopback TCP proxy that adds round-trip time and limits bandwidth (a small netem in asyncio).

    python benches/netproxy.py --upstream-port 9000 --rtt-ms 20 --mbit 200 [--lifetime 900]

Listens on 127.0.0.1 (an ephemeral port, printed as the first line of stdout) and forwards every
connection to 127.0.0.1:UPSTREAM. Only loopback addresses are ever used. Each direction models one
link shared by all connections:
- a chunk that arrives at time t leaves the link at max(t, link free) + len / bandwidth and is
  delivered RTT/2 later, so a request and its answer cost one RTT plus their transfer time;
- a new connection delivers nothing before one RTT has passed (the TCP handshake), so connection
  reuse matters as it does on a real network.
A line on stdin prints "connections bytes_up bytes_down" so far. Bounded: at most --max-conns
connections (others are refused), at most 4 MiB queued per direction and connection (the reader
waits), idle connections close after --idle seconds, and the process exits after --lifetime seconds
or when its stdin closes (the parent died), whichever comes first.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

HOST = "127.0.0.1"
CHUNK = 64 << 10
QUEUE_CHUNKS = 64


class Link:
    """One direction of the path: serialisation at `rate` bytes/s, then `delay` seconds of flight."""

    def __init__(self, rate: float, delay: float) -> None:
        self.rate, self.delay, self.free = rate, delay, 0.0
        self.bytes = 0

    def departure(self, now: float, size: int) -> float:
        self.free = max(self.free, now) + size / self.rate
        self.bytes += size
        return self.free + self.delay


class Proxy:
    def __init__(self, upstream_port: int, rtt: float, rate: float, max_conns: int, idle: float) -> None:
        self.upstream_port, self.rtt, self.idle, self.max_conns = upstream_port, rtt, idle, max_conns
        self.up, self.down = Link(rate, rtt / 2), Link(rate, rtt / 2)
        self.open = 0
        self.accepted = 0

    async def pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link, not_before: float
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

        async def read() -> None:
            try:
                while True:
                    data = await asyncio.wait_for(reader.read(CHUNK), self.idle)
                    if not data:
                        break
                    await queue.put((max(link.departure(loop.time(), len(data)), not_before), data))
            except (OSError, asyncio.TimeoutError):
                pass
            await queue.put((loop.time(), b""))

        async def write() -> None:
            try:
                while True:
                    at, data = await queue.get()
                    delay = at - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if not data:
                        if writer.can_write_eof():
                            writer.write_eof()
                        break
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass

        await asyncio.gather(read(), write())

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self.open >= self.max_conns:
            cwriter.close()
            return
        self.open += 1
        self.accepted += 1
        swriter = None
        try:
            sreader, swriter = await asyncio.open_connection(HOST, self.upstream_port)
            # Nothing is delivered before the handshake's round trip has passed.
            not_before = asyncio.get_running_loop().time() + self.rtt
            await asyncio.gather(
                self.pump(creader, swriter, self.up, not_before + self.rtt / 2),
                self.pump(sreader, cwriter, self.down, not_before),
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self.open -= 1
            for w in (cwriter, swriter):
                if w is not None:
                    w.close()


async def main_async(args: argparse.Namespace) -> None:
    proxy = Proxy(args.upstream_port, args.rtt_ms / 1000, args.mbit * 1e6 / 8, args.max_conns, args.idle)
    server = await asyncio.start_server(proxy.handle, HOST, 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.create_future()

    def on_stdin() -> None:  # EOF: stop; a line: print "connections bytes_up bytes_down"
        data = sys.stdin.buffer.read1(4096)  # type: ignore[attr-defined]
        if not data:
            if not stdin_closed.done():
                stdin_closed.set_result(None)
            return
        for _ in range(data.count(b"\n")):
            print(proxy.accepted, proxy.up.bytes, proxy.down.bytes, flush=True)

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    try:
        await asyncio.wait_for(stdin_closed, args.lifetime)
    except asyncio.TimeoutError:
        pass
    server.close()
    print(f"connections {proxy.accepted}, bytes up {proxy.up.bytes}, down {proxy.down.bytes}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream-port", type=int, required=True)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--mbit", type=float, default=200.0, help="bandwidth per direction, Mbit/s")
    ap.add_argument("--max-conns", type=int, default=1024)
    ap.add_argument("--idle", type=float, default=60.0, help="close a connection idle this many seconds")
    ap.add_argument("--lifetime", type=float, default=900.0, help="exit after this many seconds")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
