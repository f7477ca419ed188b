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
import collections
import sys

HOST = "127.0.0.1"
#: Bytes queued per direction and connection before its sender is paused.
QUEUE_LIMIT = 4 << 20
#: The event loop's timers wake on whole milliseconds (epoll's timeout is rounded up), so a timer set for a
#: delivery fires up to 1 ms late: 0.5 ms a hop on average, 1 ms a round trip (a request and its answer took
#: 22.1 ms at 20 ms). A chunk is delivered when due within SLACK, by a timer set SLACK early: on time on average.
SLACK = 0.0005


class Link:
    """One direction of the path: serialisation at `rate` bytes/s, then `delay` seconds of flight."""

    def __init__(self, rate: float, delay: float) -> None:
        self.rate, self.delay, self.free = rate, delay, 0.0
        self.bytes = 0

    def departure(self, now: float, size: int) -> float:
        self.free = max(self.free, now) + size / self.rate
        self.bytes += size
        return self.free + self.delay


class Direction:
    """One connection's bytes one way: each chunk is written to `dest` when its link delivers it (never before
    `not_before`), in order, by one timer for the head of the queue. Protocol callbacks and timers, not a reader
    and a writer task per direction with `wait_for` per read: the proxy's own CPU per request delayed every
    answer on this 2-core machine, and held the raw-GET floor to 77-85% of `concurrency / RTT` at 20 ms."""

    def __init__(self, loop: asyncio.AbstractEventLoop, link: Link, not_before: float) -> None:
        self.loop, self.link, self.not_before = loop, link, not_before
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()  # None: the sender's EOF
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.source: asyncio.Transport | None = None  # paused while too much is queued or `dest` is full
        self.dest: asyncio.Transport | None = None  # None until the upstream connection is made
        self.holds: set[str] = set()
        self.closed = False  # the sender's connection is gone: close `dest` once the queue is delivered

    def push(self, data: bytes) -> None:
        self.queue.append((max(self.link.departure(self.loop.time(), len(data)), self.not_before), data))
        self.queued += len(data)
        if self.queued > QUEUE_LIMIT:
            self.hold("queue")
        self.schedule()

    def end(self, closed: bool) -> None:
        """The sender's EOF (`closed`: or its whole connection), delivered after what it sent."""
        at = max(self.queue[-1][0] if self.queue else 0.0, self.loop.time())
        self.queue.append((at, None))
        self.closed = self.closed or closed
        self.schedule()

    def hold(self, why: str) -> None:
        if not self.holds and self.source is not None and not self.source.is_closing():
            self.source.pause_reading()
        self.holds.add(why)

    def release(self, why: str) -> None:
        self.holds.discard(why)
        if not self.holds and self.source is not None and not self.source.is_closing():
            self.source.resume_reading()

    def schedule(self) -> None:
        if self.timer is None and self.queue and self.dest is not None:
            self.timer = self.loop.call_at(self.queue[0][0] - SLACK, self.deliver)

    def deliver(self) -> None:
        self.timer = None
        dest, now = self.dest, self.loop.time() + SLACK
        assert dest is not None
        while self.queue and self.queue[0][0] <= now:
            data = self.queue.popleft()[1]
            if dest.is_closing():
                continue
            if data is not None:
                self.queued -= len(data)
                dest.write(data)
            elif self.closed:
                dest.close()
            elif dest.can_write_eof():
                dest.write_eof()
        if self.queued <= QUEUE_LIMIT // 2:
            self.release("queue")
        self.schedule()


class End(asyncio.Protocol):
    """One end of a proxied connection (the client's or the upstream server's): what it receives goes out by
    `outbound`; `inbound` writes into it."""

    def __init__(self, conn: Connection, outbound: Direction, inbound: Direction) -> None:
        self.conn, self.outbound, self.inbound = conn, outbound, inbound

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.outbound.source, self.inbound.dest = transport, transport
        self.inbound.schedule()

    def data_received(self, data: bytes) -> None:
        self.conn.active = self.outbound.loop.time()
        self.outbound.push(data)

    def eof_received(self) -> bool:
        self.outbound.end(closed=False)
        return True  # half-open: the answer may still come

    def connection_lost(self, exc: Exception | None) -> None:
        self.outbound.end(closed=True)
        self.conn.lost()

    # The transport's buffer is full: stop reading from the other end until it drains.
    def pause_writing(self) -> None:
        self.inbound.hold("dest")

    def resume_writing(self) -> None:
        self.inbound.release("dest")


class Connection:
    """A client's connection and its upstream one; nothing is delivered before the handshake's round trip."""

    def __init__(self, proxy: Proxy) -> None:
        loop = asyncio.get_running_loop()
        self.proxy, self.active, self.ends = proxy, loop.time(), 2
        not_before = loop.time() + proxy.rtt
        self.up = Direction(loop, proxy.up, not_before + proxy.rtt / 2)
        self.down = Direction(loop, proxy.down, not_before)
        self.transports: list[asyncio.Transport] = []

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(
                lambda: End(self, self.down, self.up), HOST, self.proxy.upstream_port
            )
            self.transports.append(transport)
        except OSError:
            self.lost()  # the upstream end that never was
            self.close()

    def lost(self) -> None:
        self.ends -= 1
        if self.ends == 0:
            self.proxy.open -= 1
            self.proxy.conns.discard(self)

    def close(self) -> None:
        for t in self.transports:
            t.close()


class Proxy:
    def __init__(self, upstream_port: int, rtt: float, rate: float, max_conns: int, idle: float) -> None:
        self.upstream_port, self.rtt, self.idle, self.max_conns = upstream_port, rtt, idle, max_conns
        self.up, self.down = Link(rate, rtt / 2), Link(rate, rtt / 2)
        self.open = 0
        self.accepted = 0
        self.conns: set[Connection] = set()

    def accept(self) -> asyncio.Protocol:
        if self.open >= self.max_conns:
            return Refused()
        self.open += 1
        self.accepted += 1
        conn = Connection(self)
        self.conns.add(conn)
        asyncio.get_running_loop().create_task(conn.connect())
        return Accepted(conn)

    async def sweep(self) -> None:
        """Closes connections idle for longer than `idle`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(self.idle, 1.0))
            for conn in [c for c in self.conns if loop.time() - c.active > self.idle]:
                conn.close()


class Accepted(End):
    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, conn.up, conn.down)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.conn.transports.append(transport)
        super().connection_made(transport)


class Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


async def main_async(args: argparse.Namespace) -> None:
    proxy = Proxy(args.upstream_port, args.rtt_ms / 1000, args.mbit * 1e6 / 8, args.max_conns, args.idle)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(proxy.accept, HOST, 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    sweeper = loop.create_task(proxy.sweep())
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
    sweeper.cancel()
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
