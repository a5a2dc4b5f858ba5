"""Two ranks on one host exchanging parts in one copy: a doorbell channel and the probe.

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
"""

from __future__ import annotations

import atexit
import os
import socket
import struct
import threading
import uuid
import weakref

import torch
import torch.distributed as dist

from . import cma
from .process_group import handoff

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
        sock.settimeout(None)  # the reader blocks; waits have their own timeout
        self.thread = threading.Thread(target=self._serve, name="shardwise-one-copy",
                                       daemon=True)
        self.thread.start()

    def next_seq(self, tag: int) -> int:
        self.seqs[tag] = seq = self.seqs.get(tag, 0) + 1
        return seq

    def send(self, kind: int, tag: int, seq: int, regions: list[int]) -> None:
        n = len(regions) // 2
        msg = _HEADER.pack(kind, tag, seq, n) + struct.pack(f"<{2 * n}q", *regions)
        try:
            with self._send_lock:
                self.sock.sendall(msg)
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
        read_here = False
        with self.lock:
            ex = self.exchanges.get(key)
            if ex is None:
                # A nudge or acknowledgement for an exchange already finished (or dropped):
                # nothing to do. A nudge can never precede our issue: the peer's wait
                # needs our doorbell first.
                if kind == DOOR:
                    self.doors[key] = regions
                    _bound(self.doors)
                return
            if kind == DOOR:
                ex.door = regions
            elif kind == NUDGE:
                read_here = ex.door is not None and not ex.claimed
                ex.claimed = ex.claimed or read_here
            else:
                ex.was_acked = True
        if kind == DOOR:
            ex.door_in.set()
        elif kind == ACK:
            ex.acked.set()
        elif read_here:  # the peer waits on us while this rank is busy elsewhere
            ex.consume()

    def _fail(self, cause: BaseException) -> None:
        err = _lost(None if isinstance(cause, EOFError) else cause)
        with self.lock:
            if self.error is None:
                self.error = err
            waiting = list(self.exchanges.values())
        for ex in waiting:
            for event in (ex.door_in, ex.read, ex.acked):
                event.set()

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

    def consume(self) -> None:
        """Read the peer's parts (its doorbell's regions) into ours and acknowledge them."""
        ch, regions = self.channel, self.door or []
        try:
            if len(regions) != 2 * len(self.recvs):
                raise RuntimeError(f"the peer sent {len(regions) // 2} parts where "
                                   f"{len(self.recvs)} were expected")
            cma.read(ch.peer_pid, self.recvs, list(zip(regions[0::2], regions[1::2])))
            ch.send(ACK, self.tag, self.seq, [])
            self.was_read = True
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

    def wait(self) -> None:
        try:
            self._wait()
        finally:  # done, or failed: either way no longer the channel's to answer
            with self.channel.lock:
                self.channel.exchanges.pop(self.key, None)
            self.sends = []

    def _wait(self) -> None:
        ch = self.channel
        if not self.read.is_set():
            self._until(self.door_in)
            with ch.lock:
                mine, self.claimed = not self.claimed, True
            if mine and self.door is not None:
                self.consume()  # here, on the waiting thread: [Note: one-copy order]
            self._until(self.read)
        if not self.acked.wait(_NUDGE_AFTER_S):
            ch.send(NUDGE, self.tag, self.seq, [])
            self._until(self.acked)
        if self.error is not None:
            raise self.error
        if not (self.was_read and self.was_acked):  # the channel failed under us
            raise ch.error or _lost(None)

    def _until(self, event: threading.Event) -> None:
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


_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def channel_for(group: dist.ProcessGroup | None, me: int, peer_global: int,
                timeout_s: float) -> Channel | None:
    """The group's channel, set up by the first exchange that asks (both ranks ask at the
    same point of their schedules); None when the group moves its bytes over gloo."""
    key = group if group is not None else dist.group.WORLD
    if key not in _channels:
        _channels[key] = connect(group, me, peer_global, timeout_s)
    return _channels[key]


def connect(group: dist.ProcessGroup | None, me: int, peer_global: int,
            timeout_s: float) -> Channel | None:
    """The channel to the peer when both ranks can read each other's memory, else None on
    both ranks (each step's outcome is agreed over gloo before the next)."""
    if not _agree(cma.enabled(), group, peer_global):
        return None
    if not _agree(_host_id() == _exchange_bytes(_host_id(), group, peer_global), group,
                  peer_global):
        return None
    sock = _socket(group, me, peer_global, timeout_s)
    if not _agree(sock is not None, group, peer_global):
        if sock is not None:
            sock.close()
        return None
    assert sock is not None
    pid = _peer_pid(sock)
    if not _agree(_probe(sock, pid), group, peer_global):
        sock.close()
        return None
    return Channel(sock, pid, timeout_s)


def _host_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return (socket.gethostname().encode() + b"/" + boot)[:120].ljust(128, b"\0")


def _exchange_bytes(mine: bytes, group: dist.ProcessGroup | None, peer: int) -> bytes:
    out = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    theirs = torch.empty_like(out)
    s = dist.isend(handoff(out), peer, group=group, tag=_SETUP_TAG)
    r = dist.irecv(handoff(theirs), peer, group=group, tag=_SETUP_TAG)
    s.wait()
    r.wait()
    return bytes(theirs.tolist())


def _agree(ok: bool, group: dist.ProcessGroup | None, peer: int) -> bool:
    theirs = _exchange_bytes(bytes([int(ok)]), group, peer)
    return ok and theirs[0] == 1


def _socket(group: dist.ProcessGroup | None, me: int, peer: int,
            timeout_s: float) -> socket.socket | None:
    """Rank 0 of the pair listens on a fresh abstract name, rank 1 connects to it. Both
    ranks make the same two gloo exchanges whatever fails (the name, then whether both
    succeeded), so a failure on one side never leaves the other waiting in a third."""
    srv = sock = None
    if me == 0:
        name = b"\0shardwise-" + uuid.uuid4().hex.encode()
        try:
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(name)
            srv.listen(1)
        except OSError:
            _close(srv)
            srv, name = None, b""
        _exchange_bytes(name.ljust(64, b"\0"), group, peer)
        if not _agree(srv is not None, group, peer):
            _close(srv)
            return None
        assert srv is not None
        srv.settimeout(timeout_s)
        try:
            sock, _ = srv.accept()
        except OSError:
            return None  # connect() then agrees on the failure with the peer
        finally:
            srv.close()
    else:
        name = _exchange_bytes(b"".ljust(64, b"\0"), group, peer).rstrip(b"\0")
        try:
            if not name:
                raise OSError("the peer could not listen")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(name)
        except OSError:
            _close(sock)
            sock = None
        if not _agree(sock is not None, group, peer):
            _close(sock)
            return None
    assert sock is not None
    sock.settimeout(timeout_s)
    return sock


def _close(s: socket.socket | None) -> None:
    if s is not None:
        s.close()


def group_timeout_s(group: dist.ProcessGroup | None, fallback: float) -> float:
    """The group's own collective timeout (set by whoever made it: sw.init_distributed, a
    direct dist.init_process_group, new_group), so a one-copy wait gives up when gloo would."""
    g = group if group is not None else dist.group.WORLD
    try:
        return float(g._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - private API: the layer's timeout instead
        return fallback


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _probe(sock: socket.socket, pid: int) -> bool:
    """Read a known value from the peer, as the exchanges will (before the reader starts,
    so plain blocking messages: this rank's address out, the peer's in, then done)."""
    value = torch.tensor([_MAGIC + os.getpid() % 1000], dtype=torch.int64)
    ok = False
    try:
        sock.sendall(struct.pack("<2q", value.data_ptr(), os.getpid() % 1000))
        addr, their_mod = struct.unpack("<2q", _recv_exactly(sock, 16))
        got = torch.zeros(1, dtype=torch.int64)
        try:
            cma.read(pid, [got], [(addr, 8)])
            ok = int(got[0]) == _MAGIC + their_mod
        except (OSError, ValueError):
            pass
        sock.sendall(b"d")
        _recv_exactly(sock, 1)  # the peer has read ours: `value` may go
    except (OSError, EOFError):
        return False
    return ok


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from the socket; EOFError when the peer closed it first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _close_all() -> None:
    for ch in list(_channels.values()):
        if ch is not None:
            ch.close()


def _forget_in_child() -> None:
    # A forked child has the sockets but not the reader threads: it must not use them.
    for ch in list(_channels.values()):
        if ch is not None:
            ch.error = dist.DistError("a one-copy channel cannot be used in a forked child")
            ch.sock.close()
    _channels.clear()


atexit.register(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
