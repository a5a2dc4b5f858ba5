"""The process group's life (start-up with the restart store, a clean end) and membership.

Part of the communication layer (collectives.py says how it is split): this file owns init,
teardown and who is in a group; the others the operations. None holds a process-group
singleton of its own: torch.distributed's default group is the one they all use.

[Note: gloo teardown] A process that used gloo could abort at exit after all its work was
done ("terminate called without an active exception", torchrun: exitcode -6), in about 1 run
in 11 of a plain user script (3 of 20 measured here before the fix, 2 ranks; PyTorch's own
FSDP2 on gloo does the same). The mechanism:

- A gloo collective runs on one of the process group's worker threads, and the work object
  it holds keeps references to the tensors it was given. After the work completes, the
  caller is woken first; the worker drops its reference a moment later.
- When Python has already dropped its own reference by then, PyTorch preserves the tensor's
  Python object and hands ownership of it to the C++ tensor, so the worker's drop is the last
  one and must take the GIL to free a Python object.
- A thread that asks for the GIL after the interpreter has begun finalizing is ended by
  CPython with pthread_exit. The forced unwind meets a noexcept destructor in gloo's worker
  loop, and C++ calls std::terminate: SIGABRT.

So the race is between a worker thread's last drop and the end of the script. Sleeping
before exit (0.1 s, the old fix) narrows it. It is closed here instead by knowing when the
drops have happened: every tensor shardwise hands to a gloo collective is a fresh alias
(`handoff`), of which shardwise keeps only a weak reference. The alias's Python object dies
exactly when gloo's last reference to it goes. At exit (an `atexit` handler registered when
shardwise first communicates, unless SHARDWISE_EXIT_DRAIN=0; or `finish()`), after a
barrier with the peers and
destroy_process_group, the process waits, with the GIL released, until every alias is dead.

Collectives that do not go through shardwise have no alias: DTensor's own (`full_tensor()`,
redistribute, a TP plan's), a user's `dist.all_reduce`. A script whose last collectives are
those aborted in 1 of 100 launches at 2 ranks (meta init, `materialize`, `full_tensor()` of
every parameter; 4 of 34 in issue 35), and every time when the worker is slow to let go
(tests/e2e/exit_slow_release.py). Their drops are seen from the other side: a worker that
has dropped everything is back in its queue's condition-variable wait. So the drain then
also waits until every gloo worker thread of the process (c10d names them
"pt_gloo_runloop") is parked in a futex wait, read from /proc/self/task, three samples in a
row a switch interval apart (`wait_for_gloo_workers`); running, runnable or in any other call
(a Python callback's sleep, a free's munmap) counts as busy. This covers every process group,
DeviceMesh's subgroups included, which the barrier on the default group does not wait for.
A worker waiting for the GIL is in a futex wait too, but this thread sleeps with the GIL
released between samples, so it gets the GIL there. Without /proc (not Linux) only the
aliases are watched. No worker thread then holds anything that needs the GIL, whenever
finalization starts. Measured with benchmarks/exit_stress.py; see benchmarks/RESULTS.md.

The barrier is skipped when this process is ending with a non-zero status: an uncaught
exception, a collective that failed here, or `sys.exit(code)` with a non-zero code (noted by
`_watch_sys_exit`, installed with the drain and under its switch). A peer may then be dead,
or still inside a collective this rank will never join; a barrier would pair with that
collective and both would wait out the collective timeout. Skipping it, this rank tears down
at once, its connections close, and the peer's pending collective fails within moments
("Connection closed by peer"): the whole exit then takes seconds, not the timeout (measured
in tests/e2e/test_exit.py). On a clean end the barrier waits, bounded by the collective
timeout, for peers that are still working; a failed barrier is a warning, never a changed
exit status. The wait for gloo's drops is bounded too, so a collective stuck on a dead peer
cannot hold the exit either.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import platform
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

# The collective timeout given at init (None: torch's default); errors quote it.
timeout_s: float | None = None

# Weak references to the tensor aliases that gloo collectives were given ([Note: gloo teardown]).
_handed: list[weakref.ref] = []
_PRUNE_AT = 256
_exit_registered = False
# Set when a collective failed in this process: at exit, do not wait for peers.
_failed = False
# The status this process declared it is ending with (`ending_with`; None: not known).
_exit_status: int | None = None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def handoff(t: torch.Tensor) -> torch.Tensor:
    """The tensor to give a gloo collective in place of `t` (same storage, own identity).

    See [Note: gloo teardown]: the alias lets the exit path see when gloo let go of it.
    """
    global _handed
    v = t.detach()
    _handed.append(weakref.ref(v))
    if len(_handed) >= _PRUNE_AT:
        _handed = [r for r in _handed if r() is not None]
    return v


def held_by_gloo() -> int:
    """How many tensors handed to gloo collectives a gloo thread may still release."""
    return sum(1 for r in _handed if r() is not None)


def communicating() -> None:
    """Called before every collective: the first one registers the exit drain."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        if os.environ.get("SHARDWISE_EXIT_DRAIN", "1") != "0":
            atexit.register(_at_exit)
            _watch_sys_exit()


def ending_with(status: int) -> None:
    """Record the status this process is about to exit with (the exit drain reads it)."""
    global _exit_status
    _exit_status = status


def _watch_sys_exit() -> None:
    """Let the exit drain see `sys.exit(code)` (part of the exit drain, so under the same
    switch, SHARDWISE_EXIT_DRAIN=0; docs/design.md, "Global effects").

    CPython keeps no record of a SystemExit's code for exit handlers to read (unlike an
    uncaught exception's `sys.last_exc`; no audit event either), and a rank ending with
    `sys.exit(1)` while a peer waits in a collective must not wait at the barrier for the
    collective timeout. So sys.exit notes the code, then exits exactly as before.
    """
    real = sys.exit
    if getattr(real, "_shardwise_watch", False):
        return

    def exit(status: object = None) -> None:  # noqa: A001 - stands in for sys.exit
        ending_with(0 if status is None else status if isinstance(status, int) else 1)
        real(status)

    exit._shardwise_watch = True  # type: ignore[attr-defined]
    sys.exit = exit


def mark_failed() -> None:
    global _failed
    _failed = True


def init_process_group(backend_name: str, timeout: float) -> None:
    global timeout_s
    timeout_s = timeout
    # Imported before the group exists: importing torch.distributed.fsdp's FSDP1 modules
    # registers torch's "fake" backend (for hpu), and when that happens after the default
    # group was made, the device meshes made later ask for a "fake" backend the group does
    # not know ("Unknown c10d backend type FAKE": torchtitan's build_mesh, imported lazily).
    import torch.distributed.fsdp  # noqa: F401
    td = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend_name, timeout=td, **_restart_store(td))
    communicating()


def _restart_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """A store of this attempt's own keys, after a single-node torchelastic restart.

    [Note: restart store] torchrun's workers share the agent's TCPStore, which outlives a
    restart with every key the failed attempt wrote. A restarted rank can then read a dead
    peer's address and fail to connect (gloo: "connectFullMesh failed ... Connection
    refused"; pytorch/pytorch#135712). Prefixing by TORCHELASTIC_RESTART_COUNT isolates the
    attempts; it is only safe with one agent, since agents of a multi-node job count
    restarts differently (there, start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    """
    env = os.environ
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == 0
            or env.get("WORLD_SIZE") != env.get("LOCAL_WORLD_SIZE")):
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"shardwise/restart-{attempt}/", store),
            "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"])}


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()
    wait_for_gloo_drops(_FAILED_DRAIN_S)
    wait_for_gloo_workers(_FAILED_DRAIN_S)


def finish() -> None:
    """End a run that went well: wait for the peers, tear down, let gloo let go.

    Safe to call more than once, and what the exit handler does for scripts that never call
    it ([Note: gloo teardown]).
    """
    if is_initialized():
        try:
            if not _failed:  # out of step with the peers: a barrier would pair wrongly
                _bounded_barrier(timeout_s or DEFAULT_TIMEOUT_S)
        finally:
            dist.destroy_process_group()
    limit_s = _FAILED_DRAIN_S if _failed else _DRAIN_LIMIT_S
    wait_for_gloo_drops(limit_s)
    wait_for_gloo_workers(limit_s)


DEFAULT_TIMEOUT_S = 300.0  # torch's default collective timeout


def _bounded_barrier(limit_s: float) -> None:
    """A barrier with the peers that gives up after `limit_s` (it raises then)."""
    work = dist.barrier(async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=limit_s))


# How long the exit path waits for gloo's worker threads to drop what they were handed:
# after a completed barrier they do so within microseconds, so this bound is only reached when
# a collective is stuck on a dead peer (then the exit is already a failure).
_DRAIN_LIMIT_S = 10.0
_FAILED_DRAIN_S = 1.0


def wait_for_gloo_drops(limit_s: float) -> bool:
    """Sleep (GIL released) until gloo holds none of the handed tensors; False on timeout."""
    deadline = time.monotonic() + limit_s
    pause = 0.0005
    while held_by_gloo():
        if time.monotonic() >= deadline:
            log.debug("gloo still holds %d tensors at exit", held_by_gloo())
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    _handed.clear()
    return True


# c10d names each ProcessGroupGloo worker thread so (runLoop sets it in torch 2.13; a torch
# that leaves them unnamed gives this wait nothing to see, and only the aliases are watched).
_GLOO_WORKER = "pt_gloo_runloop"
# The futex syscall's number by machine: a parked worker sleeps in one (its queue's condition
# variable). Another machine falls back to the thread's state alone.
_FUTEX = {"x86_64": "202", "aarch64": "98", "arm64": "98", "riscv64": "98", "ppc64le": "221",
          "s390x": "238"}.get(platform.machine())
# A worker waiting for the GIL sleeps in a futex too, but gets the GIL while this thread
# sleeps between samples: parked must hold this many samples in a row, a switch interval apart.
_PARKED_SAMPLES = 3


def busy_gloo_workers() -> int | None:
    """How many gloo worker threads of this process are not parked; None where /proc is absent.

    Parked: asleep in a futex wait ("S" in /proc/self/task/*/stat, syscall futex). Running,
    runnable, or in any other call, a worker may still be about to drop what a finished
    collective gave it ([Note: gloo teardown]).
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    busy = 0
    for tid in tids:
        task = f"/proc/self/task/{tid}"
        try:
            with open(f"{task}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has ended
            continue
        state = stat[stat.rindex(")") + 2]
        call = _FUTEX
        if _FUTEX is not None:
            try:
                with open(f"{task}/syscall") as f:
                    call = f.read().split(" ", 1)[0]
            except OSError:  # not readable here: judge by the state alone
                pass
        if state != "S" or call != _FUTEX:
            busy += 1
    return busy


def wait_for_gloo_workers(limit_s: float) -> bool:
    """Sleep (GIL released) until every gloo worker thread is parked; False on timeout.

    The drops of collectives that did not go through `handoff` (DTensor's own, the user's
    `dist.all_reduce`) have no alias to watch; they are done once the worker that ran the
    collective is back in its queue's wait ([Note: gloo teardown]). Where /proc is absent
    (not Linux) there is nothing to watch and this returns at once.
    """
    deadline = time.monotonic() + limit_s
    parked = 0
    while parked < _PARKED_SAMPLES:
        busy = busy_gloo_workers()
        if busy is None:
            return True
        parked = parked + 1 if busy == 0 else 0
        if parked == _PARKED_SAMPLES:
            break
        if time.monotonic() >= deadline:
            log.debug("%d gloo worker threads still busy at exit", busy)
            return False
        time.sleep(sys.getswitchinterval())
    return True


def ending_with_error() -> bool:
    """Whether this process is ending with an error (exit handlers ask)."""
    return _ending_with_error()


def _ending_with_error() -> bool:
    # CPython stores an uncaught exception (KeyboardInterrupt included) here before it runs
    # the exit handlers; a sys.exit code only when declared with ending_with.
    return _failed or getattr(sys, "last_value", None) is not None \
        or getattr(sys, "last_exc", None) is not None or _exit_status not in (None, 0)


def _at_exit() -> None:
    """The exit drain for scripts that end without finish() ([Note: gloo teardown])."""
    try:
        if not is_initialized():
            wait_for_gloo_drops(_DRAIN_LIMIT_S)
            wait_for_gloo_workers(_DRAIN_LIMIT_S)
        elif _ending_with_error():
            destroy_process_group()
        else:
            finish()
    except Exception as e:  # noqa: BLE001 - an exit handler must not turn success into failure
        # Seen, not swallowed: a barrier that failed means a peer ended badly or not at all.
        log.warning("shardwise exit: the barrier with the peers failed (a peer probably ended "
                    "with an error): %s", " ".join(str(e).split())[:300])
        wait_for_gloo_drops(_FAILED_DRAIN_S)
        wait_for_gloo_workers(_FAILED_DRAIN_S)


# --- who is in a group ------------------------------------------------------------------


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def backend(group: ProcessGroup | None = None) -> str:
    return str(dist.get_backend(group)) if is_initialized() else "none"


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group`, in group-rank order."""
    if not is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def global_rank_of(group: ProcessGroup | None, group_rank: int) -> int:
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def world_group() -> ProcessGroup:
    """The default process group as an object (what DeviceMesh.from_group needs)."""
    return dist.group.WORLD  # type: ignore[return-value]


def byte_device(group: ProcessGroup | None) -> torch.device:
    """Where small host-side exchanges live for `group`'s backend (NCCL needs the GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend(group) == "nccl" \
        else torch.device("cpu")
