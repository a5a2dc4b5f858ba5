"""Two ranks on one host exchanging parts in one copy: the doorbell channel and its exchanges
(set up by one_copy_setup.py).

See [Note: one-copy exchange] in cma.py for why. The doorbells do not go over gloo: a small
gloo message costs about 145 us and 75 us of CPU per rank on the development machine (its
loop thread wakes for every one), a Unix socket message 30 us and 15 us. The channel is a
Unix stream socket in the abstract namespace, connected when the pair transport first moves
parts; the peer's pid is the kernel's (`SO_PEERCRED`, in this process's pid namespace), not
one the peer reports.

[Note: one-copy order] A message is (kind, tag, seq, n) and n (address, bytes) regions.
Both ranks issue their exchanges in the same order (the engine's schedule is the same on
both; the debug check verifies it), and per tag the seq numbers count them, so a message
names exactly the exchange it belongs to. Issuing sends this rank's doorbell; waiting reads
the peer's regions into the receive tensors (on the waiting thread: a copy there does not
compete with the compute that a reader thread would slow, measured 5-8% of a bench30m step),
acknowledges, and waits for the peer's acknowledgement, after which the sends may be reused
as after a gloo send. Progress must not need the peer's own wait, though: a rank may wait
its exchanges in another order, or block in another collective first (the debug check does,
when ranks diverge), and gloo would still complete. So a wait that has not been
acknowledged within 2 ms sends a nudge, and the peer's reader thread, which takes every
message as it arrives, does the read for it. A dead peer closes the socket: every wait in
flight fails at once, by name; a stalled one fails at the timeout.

[Note: one-copy release] Waiting for the peer's acknowledgement made every exchange a
barrier: a rank could not go on until its peer had reached the same wait, so each rank's
jitter added up over the step's exchanges. The two sides are separate instead. A caller
that needs only its receives (a gather about to compute, a reduction about to sum) waits
for them alone (`wait_received`) and keeps the exchange; what it sent stays alive and
unwritten until it waits for the release (`wait`) right before it frees or reuses those
buffers: a unit's reshard (the gathered rows it sent), the pool taking back a send buffer.
By then the peer has almost always read them. The exchange stays in the channel until
released, so the acknowledgement and a peer's nudge still find it. No one waits on an
acknowledgement at once any more, so it rides on the next message this rank sends (usually
the next prefetch's doorbell): one socket write and one reader wake-up per exchange and rank
instead of two. It goes on its own when this rank is about to block (the peer may be waiting
on it too) and when the peer nudged for it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from . import cma

DOOR, ACK, NUDGE = 1, 2, 3
# How long a wait gives the peer to read our parts itself before asking its reader thread.
_NUDGE_AFTER_S = 0.002
_HEADER = struct.Struct("<4q")
_MAGIC = 0x5A17C0DE
_SETUP_TAG = 23010


class Channel:
    """The doorbell socket to the one peer and the thread that answers it."""

    def __init__(self, sock: socket.socket, peer_pid: int, timeout_s: float) -> None:
        self.sock, self.peer_pid, self.timeout_s = sock, peer_pid, timeout_s
        self.lock = threading.Lock()
        self.doors: dict[tuple[int, int], list[int]] = {}  # arrived before our issue
        self.exchanges: dict[tuple[int, int], Exchange] = {}  # issued here, not finished
        self.seqs: dict[int, int] = {}
        self.error: Exception | None = None
        self._send_lock = threading.Lock()
        # Acknowledgements not sent yet ([Note: one-copy release]), under `lock`.
        self._acks: list[bytes] = []
        sock.settimeout(None)  # the reader blocks; waits have their own timeout
        self.thread = threading.Thread(target=self._serve, name="shardwise-one-copy",
                                       daemon=True)
        self.thread.start()

    def next_seq(self, tag: int) -> int:
        self.seqs[tag] = seq = self.seqs.get(tag, 0) + 1
        return seq

    def send(self, kind: int, tag: int, seq: int, regions: list[int]) -> None:
        """Send one message, after the acknowledgements that wait for a ride."""
        n = len(regions) // 2
        msg = _HEADER.pack(kind, tag, seq, n) + struct.pack(f"<{2 * n}q", *regions)
        with self.lock:
            batch, self._acks = self._acks, []
        self._write(b"".join(batch) + msg if batch else msg)

    def flush(self) -> None:
        """Send the acknowledgements that wait for a ride, now."""
        with self.lock:
            if not self._acks:
                return
            batch, self._acks = self._acks, []
        self._write(b"".join(batch))

    def acknowledge(self, ex: Exchange, now: bool) -> None:
        """Tell the peer we read its parts of `ex`: with our next message, or `now` (also when
        the peer already asked: it waits on it)."""
        with self.lock:
            if not (now or ex.nudged):
                self._acks.append(_HEADER.pack(ACK, ex.tag, ex.seq, 0))
                return
        self.send(ACK, ex.tag, ex.seq, [])

    def _write(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as e:
            raise _lost(e) from e

    def _serve(self) -> None:
        try:
            while True:
                kind, tag, seq, n = _HEADER.unpack(_recv_exactly(self.sock, _HEADER.size))
                regions = list(struct.unpack(f"<{2 * n}q", _recv_exactly(self.sock, 16 * n)))
                self._take(kind, (tag, seq), regions)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            self._fail(e)

    def _take(self, kind: int, key: tuple[int, int], regions: list[int]) -> None:
        read_here = flush = False
        with self.lock:
            ex = self.exchanges.get(key)
            if ex is None:
                # A nudge or acknowledgement for an exchange already finished here (or
                # dropped). A nudge can never precede our issue: the peer's wait needs our
                # doorbell first. Our acknowledgement of it may still wait for a ride.
                if kind == DOOR:
                    self.doors[key] = regions
                    _bound(self.doors)
                flush = kind == NUDGE and bool(self._acks)
            elif kind == DOOR:
                ex.door = regions
            elif kind == NUDGE:
                ex.nudged = True
                read_here = ex.door is not None and not ex.claimed
                ex.claimed = ex.claimed or read_here
                # Read already: its acknowledgement may be waiting for a ride.
                flush = not read_here and bool(self._acks)
            else:
                ex.was_acked = True
        if ex is None:
            if flush:
                self.flush()
        elif kind == DOOR:
            ex.door_in.set()
        elif kind == ACK:
            ex.acked.set()
        elif read_here:  # the peer waits on us while this rank is busy elsewhere
            ex.consume(ack_now=True)
        elif flush:
            self.flush()

    def _fail(self, cause: BaseException) -> None:
        err = _lost(None if isinstance(cause, EOFError) else cause)
        with self.lock:
            if self.error is None:
                self.error = err
            waiting = list(self.exchanges.values())
        for ex in waiting:
            for event in (ex.door_in, ex.read, ex.acked):
                event.set()

    def drain(self, limit_s: float) -> None:
        """Before this process goes: let the peer read what this rank sent and still holds
        ([Note: one-copy release]: a unit left gathered by a forward that no backward
        followed). Its reads are nudged and waited for, within `limit_s` in all."""
        deadline = time.monotonic() + limit_s
        with self.lock:
            held = [ex for ex in self.exchanges.values() if not ex.acked.is_set()]
        for ex in held:
            if self.error is not None:
                return
            try:
                self.send(NUDGE, ex.tag, ex.seq, [])  # our own acknowledgements go too
            except dist.DistError:
                return
            ex.acked.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the reader and close the socket (at exit, or when the group goes)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(timeout=1.0)
        self.sock.close()


def _lost(cause: BaseException | None) -> Exception:
    why = f": {cause}" if cause is not None else ": the peer closed it"
    return dist.DistError(f"one-copy doorbell channel to the peer rank lost{why} "
                          "(connection closed: the peer died or timed out)")


def usable(tensors: list[torch.Tensor]) -> bool:
    """Whether the exchange of these tensors can go by one copy: host memory, contiguous
    (the same answer on both ranks, whose layouts are the same)."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


class Exchange:
    """One exchange in flight over the channel ([Note: one-copy order])."""

    def __init__(self, channel: Channel, sends: list[torch.Tensor],
                 recvs: list[torch.Tensor], tag: int) -> None:
        self.channel, self.sends, self.recvs, self.tag = channel, sends, recvs, tag
        self.seq = seq = channel.next_seq(tag)
        self.key = key = (tag, seq)
        self.door: list[int] | None = None  # the peer's regions, once its doorbell is in
        self.claimed = False  # a thread has taken the read on
        self.nudged = False  # the peer asked for our read: acknowledge it at once
        self.door_in, self.read, self.acked = (threading.Event(), threading.Event(),
                                               threading.Event())
        self.was_read = self.was_acked = False  # set by completion only, not by a failure
        self.error: Exception | None = None
        regions = [x for t in sends for x in (t.data_ptr(), t.numel() * t.element_size())]
        with channel.lock:
            if channel.error is not None:
                raise channel.error
            channel.exchanges[key] = self
            _bound(channel.exchanges)
            self.door = channel.doors.pop(key, None)
        channel.send(DOOR, tag, seq, regions)
        if self.door is not None:
            self.door_in.set()

    def consume(self, ack_now: bool = False) -> None:
        """Read the peer's parts (its doorbell's regions) into ours and acknowledge them
        (with our next message, unless `ack_now`: [Note: one-copy release])."""
        ch, regions = self.channel, self.door or []
        try:
            if len(regions) != 2 * len(self.recvs):
                raise RuntimeError(f"the peer sent {len(regions) // 2} parts where "
                                   f"{len(self.recvs)} were expected")
            cma.read(ch.peer_pid, self.recvs, list(zip(regions[0::2], regions[1::2])))
            self.was_read = True
            ch.acknowledge(self, ack_now)
        except (RuntimeError, ValueError) as e:
            self.error = RuntimeError(f"one-copy exchange {self.seq} (tag {self.tag}): {e}; "
                                      "the ranks' schedules differ")
        except OSError as e:  # the peer is gone, or its memory is: never a silent value
            self.error = dist.DistError(f"one-copy exchange {self.seq} (tag {self.tag}): "
                                        f"reading the peer's memory failed: {e}")
        except dist.DistError as e:
            self.error = e
        self.recvs = []
        self.read.set()

    def wait_received(self) -> None:
        """The receive side: the peer's parts are in ours. The peer may still be reading our
        sends ([Note: one-copy release]): `wait` before they may be freed or written."""
        try:
            self._wait_read()
        except BaseException:
            self._leave()
            raise

    def wait(self) -> None:
        """Both sides: our receives are filled and the peer has read our sends."""
        try:
            self._wait_read()
            # A caller that waits for both sides goes on at once: nothing of ours may wait
            # for a ride that may not come.
            self.channel.flush()
            self._until_acked()
            if self.error is not None:
                raise self.error
            if not self.was_acked:  # the channel failed under us
                raise self.channel.error or _lost(None)
        finally:  # done, or failed: either way no longer the channel's to answer
            self._leave()

    @property
    def released(self) -> bool:
        """Whether the peer has read our sends (a question only: nothing waits)."""
        return self.acked.is_set() and self.was_acked

    def _leave(self) -> None:
        with self.channel.lock:
            self.channel.exchanges.pop(self.key, None)
        self.sends = []

    def _wait_read(self) -> None:
        ch = self.channel
        if not self.read.is_set():
            self._until(self.door_in)
            with ch.lock:
                mine, self.claimed = not self.claimed, True
            if mine and self.door is not None:
                self.consume()  # here, on the waiting thread: [Note: one-copy order]
            self._until(self.read)
        if self.error is not None:
            raise self.error
        if not self.was_read:  # the channel failed under us
            raise ch.error or _lost(None)

    def _until_acked(self) -> None:
        """Wait for the peer's acknowledgement, nudging it after 2 ms and again, less and
        less often, while it does not come: a nudge that reached the peer before its own
        issue found nothing to answer, and its acknowledgement may wait for a ride."""
        ch, pause = self.channel, _NUDGE_AFTER_S
        deadline = time.monotonic() + ch.timeout_s
        while not self.acked.wait(min(pause, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise dist.DistError(f"one-copy exchange {self.seq} (tag {self.tag}) timed "
                                     f"out after {ch.timeout_s:g} s: the peer stalled")
            ch.send(NUDGE, self.tag, self.seq, [])
            pause = min(pause * 4, 0.5)

    def _until(self, event: threading.Event) -> None:
        if not event.is_set():
            self.channel.flush()  # about to block: the peer may wait on ours as well
        if not event.wait(self.channel.timeout_s):
            raise dist.DistError(f"one-copy exchange {self.seq} (tag {self.tag}) timed out "
                                 f"after {self.channel.timeout_s:g} s: the peer stalled")
        if self.error is not None:
            raise self.error


# Exchanges a caller dropped without waiting (an exception mid-forward, then training goes
# on) would hold their tensors in the channel forever: the oldest go past this many. The
# engine has a few in flight at a time; a peer that still waits on a dropped one gets no
# acknowledgement and fails at its timeout.
_KEEP = 256


def _bound(d: dict) -> None:
    while len(d) > _KEEP:
        del d[next(iter(d))]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from the socket; EOFError when the peer closed it first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)
