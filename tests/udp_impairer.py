"""A userspace UDP impairer for tests: a stand-in for `tc netem`, which this kernel lacks.

`tc qdisc add dev lo root netem ...` fails here and on CI's machines of the same kind ("Error: Specified qdisc kind
is unknown.": no sch_netem module), and nftables can drop packets but not delay or reorder them. So the jitter and
reordering tests put this relay on the caller's path instead: the caller uses relay-only ICE through Debian's
coturn, its TURN server URL names this relay, and the relay forwards every datagram between the caller and coturn
(caller -> impairer -> coturn -> agent), impairing each direction on the way:

- loss: a share of the datagrams is dropped;
- jitter: each datagram waits delay_ms ± jitter_ms (uniform), and leaves no earlier than the one before it in its
  direction, as a queue on a real path keeps order: jitter changes the spacing, not the order;
- reordering: a share of the datagrams is held back until the next datagram of its direction has gone, then sent
  right after it: each such event is one adjacent swap (a held datagram with no successor leaves after max_hold_ms).

It counts what it did (Counts), so a test can check that the impairment really happened. Everything runs on the
event loop of the thread that made it, with plain non-blocking sockets on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import socket
import time
from typing import Callable

MAX_DATAGRAM = 65_535


@dataclasses.dataclass(frozen=True)
class Impairment:
    loss: float = 0.0  # share of datagrams dropped (0.05 = 5 %)
    delay_ms: float = 0.0  # one-way delay added to every datagram
    jitter_ms: float = 0.0  # each datagram's delay is delay_ms ± jitter_ms, uniform, order kept
    reorder: float = 0.0  # share of datagrams swapped with the next one of their direction
    max_hold_ms: float = 200.0  # a datagram held for reordering leaves after this if nothing follows it

    def __post_init__(self) -> None:
        if not (0 <= self.loss < 1 and 0 <= self.reorder < 1 and 0 <= self.jitter_ms <= self.delay_ms):
            raise ValueError(f"bad impairment {self}: shares in [0, 1), jitter_ms <= delay_ms")


@dataclasses.dataclass
class Counts:
    """What the impairer did since the last impair(): datagrams in, dropped, swapped, and each one's added delay."""
    datagrams: int = 0
    dropped: int = 0
    reordered: int = 0  # swaps: a held datagram sent after one that arrived later
    delays_ms: list[float] = dataclasses.field(default_factory=list)  # arrival to sending, per forwarded datagram

    def delay_ms_at(self, quantile: float) -> float:
        ordered = sorted(self.delays_ms)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] if ordered else 0.0


class _Lane:
    """One direction of one flow: its queue in sending order, and a datagram held back for a swap."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self.send = send
        self.queue: collections.deque[tuple[float, float, bytes]] = collections.deque()  # (due, arrived, data)
        self.last_due = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.held: tuple[float, bytes, asyncio.TimerHandle] | None = None  # (arrived, data, its max_hold timer)


class UdpImpairer:
    """Listens on 127.0.0.1:`port` and relays to `upstream`, one upstream socket per client address."""

    def __init__(self, port: int, upstream: tuple[str, int], seed: int = 15) -> None:
        self._loop = asyncio.get_running_loop()
        self._upstream = upstream
        self._random = random.Random(seed)
        self.impairment = Impairment()
        self.counts = Counts()
        self._front = self._socket(port)
        self._loop.add_reader(self._front.fileno(), self._from_clients)
        self._flows: dict[tuple[str, int], tuple[socket.socket, _Lane, _Lane]] = {}

    def impair(self, impairment: Impairment) -> None:
        """Applies `impairment` from now on and starts counting afresh."""
        self.impairment, self.counts = impairment, Counts()

    def close(self) -> None:
        for sock in [self._front, *(flow[0] for flow in self._flows.values())]:
            self._loop.remove_reader(sock.fileno())
            sock.close()
        for _, up, down in self._flows.values():
            for lane in (up, down):
                for handle in (lane.timer, lane.held[2] if lane.held else None):
                    if handle is not None:
                        handle.cancel()
        self._flows.clear()

    @staticmethod
    def _socket(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", port))
        sock.setblocking(False)
        return sock

    def _flow(self, client: tuple[str, int]) -> tuple[socket.socket, _Lane, _Lane]:
        if client not in self._flows:
            sock = self._socket(0)
            up = _Lane(lambda data: self._sendto(sock, data, self._upstream))
            down = _Lane(lambda data: self._sendto(self._front, data, client))
            self._flows[client] = (sock, up, down)
            self._loop.add_reader(sock.fileno(), self._from_upstream, client)
        return self._flows[client]

    @staticmethod
    def _sendto(sock: socket.socket, data: bytes, to: tuple[str, int]) -> None:
        try:
            sock.sendto(data, to)
        except (BlockingIOError, OSError):  # a full socket buffer, or the flow closed: the datagram is lost
            pass

    def _from_clients(self) -> None:
        for _ in range(64):  # bounded: let the loop run other work between bursts
            try:
                data, client = self._front.recvfrom(MAX_DATAGRAM)
            except BlockingIOError:
                return
            self._arrive(self._flow(client)[1], data)

    def _from_upstream(self, client: tuple[str, int]) -> None:
        sock, _, down = self._flows[client]
        for _ in range(64):
            try:
                data = sock.recv(MAX_DATAGRAM)
            except BlockingIOError:
                return
            self._arrive(down, data)

    def _arrive(self, lane: _Lane, data: bytes) -> None:
        imp, now = self.impairment, time.monotonic()
        self.counts.datagrams += 1
        if self._random.random() < imp.loss:
            self.counts.dropped += 1
            return
        if lane.held is None and self._random.random() < imp.reorder:
            handle = self._loop.call_later(imp.max_hold_ms / 1000, self._release_held, lane)
            lane.held = (now, data, handle)
            return
        self._enqueue(lane, now, data)
        if lane.held is not None:  # the held one goes right behind this later one: a swap
            arrived, held, handle = lane.held
            handle.cancel()
            lane.held = None
            self.counts.reordered += 1
            self._enqueue(lane, arrived, held)

    def _release_held(self, lane: _Lane) -> None:
        if lane.held is not None:
            arrived, data, _ = lane.held
            lane.held = None
            self._enqueue(lane, arrived, data)

    def _enqueue(self, lane: _Lane, arrived: float, data: bytes) -> None:
        imp = self.impairment
        delay = imp.delay_ms + self._random.uniform(-imp.jitter_ms, imp.jitter_ms) if imp.delay_ms else 0.0
        due = max(time.monotonic() + delay / 1000, lane.last_due)  # never before the datagram ahead of it
        lane.last_due = due
        lane.queue.append((due, arrived, data))
        self._send_due(lane)

    def _send_due(self, lane: _Lane) -> None:
        now = time.monotonic()
        while lane.queue and lane.queue[0][0] <= now:
            _, arrived, data = lane.queue.popleft()
            self.counts.delays_ms.append((now - arrived) * 1000)
            lane.send(data)
        if lane.timer is not None:
            lane.timer.cancel()
            lane.timer = None
        if lane.queue:
            lane.timer = self._loop.call_at(self._loop.time() + (lane.queue[0][0] - now), self._send_due, lane)
