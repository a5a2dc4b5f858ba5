"""Setting up the one-copy channel between the two ranks of a pair, and closing it.

Both ranks ask at the same point of their schedules (the first exchange in parts of a
group); every step of the set-up is agreed over gloo before the next, so a failure on one
side turns the one-copy path off on both and never leaves a rank waiting ([Note: one-copy
exchange] in cma.py, one_copy.py for the channel itself).
"""

from __future__ import annotations

import atexit
import os
import socket
import struct
import uuid
import weakref

import torch
import torch.distributed as dist

from . import cma
from .one_copy import _MAGIC, _SETUP_TAG, Channel, _recv_exactly
from .process_group import handoff

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


# At a clean exit, how long the peer gets to read what this rank still holds for it.
_DRAIN_AT_EXIT_S = 10.0


def _close_all() -> None:
    from .process_group import ending_with_error

    clean = not ending_with_error()
    for ch in list(_channels.values()):
        if ch is not None:
            if clean:
                ch.drain(_DRAIN_AT_EXIT_S)
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
