"""Reading a peer process's memory in one copy (Linux cross-memory attach).

[Note: one-copy exchange] Over TCP loopback each byte a pair of ranks exchanges is copied
twice by the kernel (sender's buffer into the socket, socket into the receiver's buffer),
plus the protocol's own work: measured on the development machine, 64 MB each way between
two ranks cost 35-38 ms of CPU per rank, 2.6x a 64 MB memcpy (14 ms). `process_vm_readv`
copies straight from the peer's address space into ours: one copy, memcpy speed (14-17 ms
for the same 64 MB). The exchange then only needs small messages, over a Unix socket
(one_copy.py): the sender's addresses (its "doorbell", sent when the data is ready) and the
receiver's acknowledgement (sent once it has read them, after which the sender may reuse
its buffers).

The system call needs the right to ptrace the peer: the same user and no ptrace-restricting
policy (Yama's ptrace_scope above 0, a seccomp filter, a missing CAP_SYS_PTRACE in some
containers). Whether it works is probed once per process group, both ways, and both ranks
take the answer agreed over the group, so a rank never reads while its peer sends over gloo.
`SHARDWISE_CMA=0` turns it off. Measured on bench30m at two ranks (benchmarks/RESULTS.md,
"One copy per byte"): FULL_SHARD from 0.95-0.99x the same-bytes bound over gloo to
0.83-0.84x, and from 0.64-0.70x FSDP2's step time to 0.55-0.58x.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

_IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()


def enabled() -> bool:
    """Whether this process may try one-copy exchanges at all (before the probe)."""
    return _readv is not None and os.environ.get("SHARDWISE_CMA", "1") != "0"


def read(pid: int, dst: list[torch.Tensor], src: list[tuple[int, int]]) -> None:
    """Copy the peer's `src` regions (address, bytes) into the contiguous CPU tensors `dst`,
    region for region. Raises OSError when the kernel refuses or reads short."""
    if _readv is None:
        raise OSError("process_vm_readv is not available on this platform")
    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} destinations for {len(src)} peer regions")
    local, remote = [], []
    for t, (addr, n) in zip(dst, src):
        want = t.numel() * t.element_size()
        if want != n:
            raise ValueError(f"peer sent {n} bytes where {want} were expected")
        if n:
            local.append((t.data_ptr(), n))
            remote.append((addr, n))
    for i in range(0, len(local), _IOV_MAX):
        _read_some(pid, local[i : i + _IOV_MAX], remote[i : i + _IOV_MAX])


def _read_some(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    while local:
        n = len(local)
        liov = (_Iovec * n)(*[_Iovec(a, b) for a, b in local])
        riov = (_Iovec * n)(*[_Iovec(a, b) for a, b in remote])
        got = _readv(pid, liov, n, riov, n, 0)  # type: ignore[operator]
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(f"process_vm_readv from pid {pid} read nothing")
        local, remote = _advance(local, got), _advance(remote, got)


def _advance(iovs: list[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    """What is left of `iovs` once `done` bytes of them were read (a short read)."""
    out = []
    for addr, n in iovs:
        if done >= n:
            done -= n
            continue
        out.append((addr + done, n - done))
        done = 0
    return out
