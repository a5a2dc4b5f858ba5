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
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import re
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

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
            _watch_sigint()


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


# Set when SIGINT reached this process (`_watch_sigint`): the exit is not a clean one.
_interrupted = False


def _watch_sigint() -> None:
    """Let the exit drain see a Ctrl-C even when something caught the KeyboardInterrupt
    (torch.multiprocessing.spawn's worker wrapper swallows it and exits 0): such a rank left
    its peers mid-step, and a barrier at exit would pair with their next collective and wait
    out the timeout. Only Python's own SIGINT handler, in the main thread, is wrapped: it
    notes the signal, then raises KeyboardInterrupt as before. Part of the exit drain (same
    switch, SHARDWISE_EXIT_DRAIN=0; docs/design.md, "Global effects")."""
    import signal

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def interrupted(signum: int, frame: Any) -> None:
        global _interrupted
        _interrupted = True
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, interrupted)


def mark_failed() -> None:
    global _failed
    _failed = True


def init_process_group(backend_name: str, timeout: float,
                       slurm: Mapping[str, str] | None = None) -> None:
    """Start the default group from torchrun's variables, or from `slurm` (torchrun's names,
    as `torch_env_from_slurm` gives them) without touching the environment."""
    global timeout_s
    timeout_s = timeout
    # Imported before the group exists: importing torch.distributed.fsdp's FSDP1 modules
    # registers torch's "fake" backend (for hpu), and when that happens after the default
    # group was made, the device meshes made later ask for a "fake" backend the group does
    # not know ("Unknown c10d backend type FAKE": torchtitan's build_mesh, imported lazily).
    import torch.distributed.fsdp  # noqa: F401
    td = datetime.timedelta(seconds=timeout)
    if slurm:
        dist.init_process_group(
            backend_name, init_method=f"tcp://{slurm['MASTER_ADDR']}:{slurm['MASTER_PORT']}",
            rank=int(slurm["RANK"]), world_size=int(slurm["WORLD_SIZE"]), timeout=td)
    else:
        dist.init_process_group(backend_name, timeout=td, **_restart_store(td))
    _remember_store()
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
    return _failed or _interrupted or getattr(sys, "last_value", None) is not None \
        or getattr(sys, "last_exc", None) is not None or _exit_status not in (None, 0)


def _release_failed_frames() -> None:
    """Drop the locals of the frames the uncaught exception's traceback keeps.

    The failed collective's frames (the exception's cause: torch's collective call, then
    shardwise's issue) hold the aliases it was handed as locals, and CPython keeps the last
    uncaught exception (sys.last_value) with its traceback to the end: the drain would then
    wait its whole bound for aliases that no gloo thread holds. Those frames have returned;
    their locals would only be freed at finalization.
    """
    seen: set[int] = set()
    pending = [getattr(sys, "last_exc", None), getattr(sys, "last_value", None)]
    while pending:
        exc = pending.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]


def _at_exit() -> None:
    """The exit drain for scripts that end without finish() ([Note: gloo teardown])."""
    try:
        if not is_initialized():
            limit_s = _FAILED_DRAIN_S if _ending_with_error() else _DRAIN_LIMIT_S
            wait_for_gloo_drops(limit_s)
            wait_for_gloo_workers(limit_s)
        elif _ending_with_error():
            # [Note: stopping together]: say why in the store, then leave without waiting.
            status, cause = _exit_cause()
            announce_stop(cause, status)
            leave(status)
            _release_failed_frames()
            wait_for_gloo_drops(_FAILED_DRAIN_S)
            wait_for_gloo_workers(_FAILED_DRAIN_S)
        else:
            finish()
    except Exception as e:  # noqa: BLE001 - an exit handler must not turn success into failure
        # Seen, not swallowed: a barrier that failed means a peer ended badly or not at all.
        log.warning("shardwise exit: the barrier with the peers failed (a peer probably ended "
                    "with an error): %s", " ".join(str(e).split())[:300])
        wait_for_gloo_drops(_FAILED_DRAIN_S)
        wait_for_gloo_workers(_FAILED_DRAIN_S)


# --- stopping together --------------------------------------------------------------------
# [Note: stopping together] Whatever stops one rank (a signal, an exception, a refusal, a
# collective that timed out) must stop every rank within seconds, and each must be able to
# say which rank stopped first and why. Two rules do it:
#
# - A stopping rank never waits on its peers: no barrier (`leave`). Its gloo connections
#   close only when the process ends: destroy_process_group, _abort_process_group and
#   ProcessGroup.abort() close nothing while anything (a sub-group, a mesh, a unit) still
#   holds the group, and they wait for every collective in flight, which on a stalled or
#   dead peer means the collective timeout (both measured). So the command ends a stopping
#   rank with os._exit (`exit_now`, after flushing) and the kernel closes its sockets; a
#   library script's exit handler tears the group down on a helper thread bounded by
#   _LEAVE_S, and ends the process itself past the bound.
# - Closing its connections is how the others learn: a peer's pending or next collective
#   fails within moments ("Connection closed by peer") instead of at the timeout. Before
#   leaving, the rank writes {rank, cause, status} under one key of the group's rendezvous
#   store, first writer wins (compare_set), so the peer whose collective failed reads who
#   stopped first and why (`first_stop`, quoted by every CollectiveError) rather than guessing
#   from a socket error. The store lives in torchrun's agent, or in rank 0's process (env://,
#   tcp://: Slurm tasks, mp.spawn). There rank 0 keeps the store up while leaving, at most
#   _LEAVE_S, until every peer has read the record. When rank 0 itself stopped first and is
#   about to end (the command's path), it first shuts down its connected sockets other than
#   the store's (`_close_peer_sockets`: the peers' collectives fail at once, and read the
#   record from the store that is still up); gloo's listening socket is left alone (shutting
#   it down aborts gloo's loop thread: measured). A library script's rank 0 does not touch
#   sockets it may not own: its peers then say that rank 0 ended first, and rank 0's own
#   output says why. A rank killed outright (SIGKILL) writes nothing; its peers then say
#   the collective failed and no rank said why.

_LEAVE_S = 2.0
# Store calls on the stopping path: the store may be gone with rank 0.
_STORE_S = 2.0
# The first stop record this process knows of (its own or a peer's), once known.
_stop: dict[str, Any] | None = None
# The default group's store, kept past destroy_process_group (rank 0 serves it from here).
_store: Any = None
# Set once a store call failed: the store's host (rank 0, or torchrun's agent) is gone.
_store_gone = False


# This process's rank in the default group, kept past the group's teardown.
_my_rank = 0


def _remember_store() -> None:
    global _store, _stop, _my_rank
    _stop = None
    with contextlib.suppress(Exception):
        _store = dist.distributed_c10d._get_default_store()
        _my_rank = dist.get_rank()


def _stop_key() -> str:
    # Per torchelastic attempt: the agent's store keeps the keys of a failed attempt.
    return f"shardwise/stop/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """fd 2 to /dev/null for one store call: c10d prints a C++ stack trace of its own before
    raising when the store's host is gone, and the caller words that case itself."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _store_call(fn: Any) -> Any:
    """`fn(store)` bounded by _STORE_S; None when there is no store or it is gone."""
    if _store is None:
        _remember_store()
    store = _store
    if store is None:
        return None
    try:
        with _quiet_stderr():
            store.set_timeout(datetime.timedelta(seconds=_STORE_S))
            return fn(store)
    except Exception as e:  # noqa: BLE001 - the host may be gone: the caller says so
        global _store_gone
        _store_gone = True
        log.debug("shardwise stop: the rendezvous store did not answer: %s", e)
        return None


def announce_stop(cause: str, status: int) -> dict[str, Any]:
    """Record in the group's store that this rank stops, and why, unless a rank did first;
    return the first record ({"rank", "cause", "status"}: this rank's, or the earlier one).

    [Note: stopping together]. Call before `leave`; without a group (or a store that
    answers), this rank's own record is returned.
    """
    global _stop, _my_rank
    if _stop is not None:
        return _stop
    if is_initialized():
        _my_rank = rank()
    mine = {"rank": _my_rank, "cause": " ".join(cause.split())[:500], "status": int(status)}
    if not is_initialized() or world_size() == 1:
        _stop = mine
        return mine
    key = _stop_key()
    raw = _store_call(lambda st: st.compare_set(key, "", json.dumps(mine)))
    first = mine
    if raw is not None:
        with contextlib.suppress(ValueError, TypeError):
            first = json.loads(raw)
        if first["rank"] != mine["rank"]:
            _store_call(lambda st: st.add(f"{key}/seen", 1))
    _stop = first
    return first


def first_stop() -> dict[str, Any] | None:
    """The first stop record a rank announced, read without waiting; None when none was (a
    rank killed outright) or the store is gone with its host. Reading it tells the announcing
    rank that this one has seen it ([Note: stopping together])."""
    global _stop
    if _stop is not None:
        return _stop
    key = _stop_key()

    def read(st: Any) -> Any:
        return st.get(key) if st.check([key]) else None

    raw = _store_call(read)
    if raw is None:
        return None
    try:
        _stop = json.loads(raw)
    except (ValueError, TypeError):
        return None
    _store_call(lambda st: st.add(f"{key}/seen", 1))
    return _stop


def stop_note() -> str:
    """Who stopped first and why, for the message of a collective that failed ("" if no rank
    said: one died without a word)."""
    first = first_stop()
    if first is not None:
        return "" if first["rank"] == _my_rank else \
            f"rank {first['rank']} stopped first ({first['cause']})"
    if not _store_gone:
        return ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the launcher's rendezvous store is gone too (the launcher ended)"
    return ("rank 0 ended first (the group's store, which rank 0 served, is gone with it; "
            "rank 0's own output says why)")


def _hosts_store() -> bool:
    """Whether this process serves the group's store (env:// or tcp:// start-up: rank 0);
    torchrun's workers use their agent's."""
    return rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def leave(status: int, limit_s: float = _LEAVE_S, then_exit: bool = False) -> None:
    """Leave the process group without waiting on any peer ([Note: stopping together]).

    then_exit: end the process here (`exit_now`): the way its connections close at once.
    Otherwise the teardown runs on a helper thread, and when it does not end within
    `limit_s` (a collective in flight on a stalled or dead peer holds it), the process ends
    here all the same. A process that serves the store keeps it up, at most `limit_s`, until
    every peer has read another rank's stop record. The exit drain waits at no barrier after.
    """
    global _failed
    _failed = True
    ending_with(status)
    n, hosts, key = world_size(), _hosts_store(), _stop_key()
    if then_exit and hosts and n > 1 and _stop is not None and _stop["rank"] == _my_rank:
        with contextlib.suppress(ValueError, TypeError):
            _close_peer_sockets(int(launch_var("MASTER_PORT") or 0))
    if is_initialized() and not then_exit:
        helper = threading.Thread(target=_destroy_quietly, name="shardwise-leave", daemon=True)
        helper.start()
        helper.join(limit_s)
        if helper.is_alive():
            log.debug("shardwise stop: the group's teardown waits on a peer; exiting now")
            exit_now(status)
    # (A library script's rank 0 that stopped first closed no socket: its peers learn only
    # when it ends, so waiting for them to read would only delay that.)
    if hosts and n > 1 and _stop is not None and (then_exit or _stop["rank"] != _my_rank):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            seen = _store_call(lambda st: st.add(f"{key}/seen", 0))
            if seen is None or seen >= n - 1:
                break
            time.sleep(0.02)
    if then_exit:
        exit_now(status)


def _close_peer_sockets(store_port: int) -> int:
    """Shut down this process's connected TCP sockets, except the store's (port
    `store_port`, either end); return how many. Only for a process about to end: the
    peers' collectives then fail at once, while the store still answers them."""
    import socket

    if not store_port:
        return 0
    closed = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if sock.type != socket.SOCK_STREAM or \
                    sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            local, remote = sock.getsockname()[1], sock.getpeername()[1]  # a listener: raises
            if store_port not in (local, remote):
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:
            continue
        finally:
            sock.close()
    return closed


def _destroy_quietly() -> None:
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def exit_now(status: int) -> None:
    """End this process at once with `status`: logs and stdio flushed, no interpreter teardown
    (which would wait on the threads of a collective stuck on a peer)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _exit_cause() -> tuple[int, str]:
    """The status and the cause of a process ending with an error, as the exit handler sees
    it: an uncaught exception, a declared sys.exit code, or a collective that failed here."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(exc, KeyboardInterrupt):
        return 130, "interrupted (KeyboardInterrupt)"
    if isinstance(exc, BaseException):
        text = " ".join(str(exc).split())
        return 1, f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if _exit_status not in (None, 0):
        return int(_exit_status), f"exit status {_exit_status}"
    if _interrupted:
        return 130, "interrupted (SIGINT)"
    return 1, "a collective failed"


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


# --------------------------------------------------------------------------------------------------
# Process groups of a few consecutive ranks inside a shard group (hpZ's post-forward groups).
#
# `fully_shard(m, reshard_after_forward=k)` keeps, between forward and backward, a shard of
# each parameter over the k consecutive ranks of the shard group that this rank belongs to
# (FSDP2's `(S/k, k)` post-forward mesh, engine/core/unit.py); backward's all-gather runs in
# that group. Only the group's own members create it (`use_local_synchronization`): the
# fully_shard call that asks for it may run on a sub-mesh whose other world ranks never call
# anything. One group per set of ranks is made and kept: every unit of a model asks for the
# same one, and a second group with the same ranks would take the same (hashed) name.

# (default group, global ranks) -> the group; cleared when the default group changes (a
# new init_process_group), whose groups are gone with it.
_groups: dict[tuple[int, ...], ProcessGroup] = {}
_made_under: list[object] = []


def block_ranks(shard_group: ProcessGroup | None, k: int) -> list[int]:
    """The global ranks of this rank's block of `k` consecutive shard-group ranks."""
    ranks = group_ranks(shard_group)
    me = rank(shard_group)
    first = (me // k) * k
    return ranks[first : first + k]


def block_group(shard_group: ProcessGroup | None, k: int) -> ProcessGroup:
    """This rank's process group of `k` consecutive ranks of `shard_group` (k divides its
    size; made once per set of ranks, by those ranks only)."""
    default = dist.distributed_c10d._get_default_group()
    if not _made_under or _made_under[0] is not default:
        _groups.clear()
        _made_under[:] = [default]
    ranks = tuple(block_ranks(shard_group, k))
    group = _groups.get(ranks)
    if group is None:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        assert group is not None, f"rank {dist.get_rank()} is not in its own block {ranks}"
        _groups[ranks] = group
    return group


# --------------------------------------------------------------------------------------------------
# DeviceMesh dims that need process groups of their own (fully_shard's dp_mesh_dims).
#
# Flattening several dims of a mesh into one creates that dim's process group (a collective
# over the mesh's ranks the first time; DeviceMesh keeps it by name after that), so it lives
# here with the other calls that talk to torch.distributed.


def flatten(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]` as one dim named "_".join(names) (FSDP2's name for it), or the named
    dim itself when there is one."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of `meshes` in order (sub-meshes of one root mesh);
    no new group: each dim keeps its own."""
    if len(meshes) == 1:
        return meshes[0]
    return DeviceMesh._concatenate(meshes)


# --------------------------------------------------------------------------------------------------
# Slurm's `srun` without torchrun: SLURM_* variables into torchrun's.
#
# torch.distributed's `env://` start-up reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
# and shardwise reads LOCAL_RANK and LOCAL_WORLD_SIZE too (the device, HYBRID_SHARD's node
# groups, threads per rank). torchrun sets all of them; `srun` sets its own SLURM_* variables
# instead. `torch_env_from_slurm(environ)` translates one into the other, and
# `use_slurm_env()` applies it to this process; `init_distributed` uses the translation
# without applying it when no group and no RANK exist, so `srun python train.py` joins one
# process group (docs/launching.md).
#
# Only the standard library is imported: this runs before torch does anything distributed.

# Set by use_slurm_env (and by shardwise's Ray helper) so the header can name the launcher.
LAUNCHER_ENV = "SHARDWISE_LAUNCHER"
# SHARDWISE_SLURM=0 leaves the SLURM_* variables alone (e.g. to run one process inside an
# allocation); "1" (or unset) translates them when a task of an srun step is found.
OPT_OUT_ENV = "SHARDWISE_SLURM"
# Ports below Linux's ephemeral range (32768-60999), so one the OS handed out for an
# outgoing connection cannot already hold it.
PORT_BASE, PORT_SPAN = 20000, 10000


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5 (zero padding kept). Several
    bracket groups in one name (`rack[1-2]-n[1-2]`) expand as a product, like scontrol.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("SLURM node list is empty")
    hosts: list[str] = []
    for name in _split_top_level(text, nodelist):
        hosts += _expand_one(name, nodelist)
    return hosts


def _split_top_level(text: str, whole: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            why = "nested brackets" if depth > 1 else "unbalanced brackets"
            raise ValueError(f"SLURM node list {whole!r} is not allowed: {why}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"SLURM node list {whole!r} is not allowed: unbalanced brackets")
    parts.append(text[start:])
    if any(not p.strip() for p in parts):
        raise ValueError(f"SLURM node list {whole!r} is not allowed: an empty host name")
    return [p.strip() for p in parts]


def _expand_one(name: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        if "]" in name:
            raise ValueError(f"SLURM node list {whole!r} is not allowed: unbalanced brackets")
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM node list {whole!r} is not allowed: {item!r} is not a "
                             "number or a range such as 01-04")
        if not sep:
            numbers = [lo]
        else:
            if int(hi) < int(lo):
                raise ValueError(f"SLURM node list {whole!r} is not allowed: the range "
                                 f"{item!r} runs backwards")
            width = len(lo)  # node[08-10]: node08 node09 node10
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        for n in numbers:
            out += _expand_one(f"{head}{n}{tail}", whole)
    return out


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The task count of node `node` from Slurm's `2(x3),1` form (3 nodes with 2, then 1)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"SLURM tasks per node {tasks_per_node!r} is not allowed: "
                             f"{part!r} is not N or N(xK)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node >= len(counts):
        raise ValueError(f"SLURM tasks per node {tasks_per_node!r} lists {len(counts)} nodes; "
                         f"this is node {node}")
    return counts[node]


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an `srun` step (not the batch script itself, which
    runs once however many tasks the job asked for), and the user did not opt out."""
    if environ.get(OPT_OUT_ENV, "1") == "0":
        return False
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and step is not None \
        and step != "batch"


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not allowed: must be an integer") from None
    return None


def torch_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for this task of an srun step ({} outside one).

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and
    GROUP_WORLD_SIZE (the nodes) come from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the
    tasks on this node, SLURM_NODEID and the node count. MASTER_ADDR is the first host of
    the step's node list (where task 0 runs, under Slurm's default block distribution);
    MASTER_PORT is 20000 + job id mod 10000, so every task of the job agrees on it without
    talking. A MASTER_ADDR or MASTER_PORT already set is kept: the way to choose them.
    """
    if not in_srun_step(environ):
        return {}
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    local = _int(environ, "SLURM_LOCALID")
    node = _int(environ, "SLURM_NODEID") or 0
    assert rank is not None and world is not None  # in_srun_step checked them
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} is not allowed with SLURM_NTASKS={world}: "
                         "need 0 <= rank < tasks")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
        or environ.get("SLURM_NODELIST")
    if not nodelist and "MASTER_ADDR" not in environ:
        raise ValueError("SLURM_JOB_NODELIST is not set, so the address of task 0 is "
                         "unknown: set MASTER_ADDR")
    hosts = expand_nodelist(nodelist) if nodelist else []
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") \
        or len(hosts) or 1
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node:
        local_world = tasks_on_node(per_node, node)
    elif world % nodes == 0:
        local_world = world // nodes
    else:
        raise ValueError(f"SLURM_NTASKS={world} over {nodes} nodes is uneven and "
                         "SLURM_TASKS_PER_NODE is not set: set it (or --ntasks-per-node)")
    if local is None or not 0 <= local < local_world:
        raise ValueError(f"SLURM_LOCALID={environ.get('SLURM_LOCALID')!r} is not allowed "
                         f"with {local_world} tasks on this node")
    port = environ.get("MASTER_PORT")
    if port is None:
        job = _int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise ValueError("SLURM_JOB_ID is not set, so no port can be derived: set "
                             "MASTER_PORT")
        port = str(PORT_BASE + job % PORT_SPAN)
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or hosts[0], "MASTER_PORT": port,
        LAUNCHER_ENV: "slurm",
    }


def use_slurm_env() -> bool:
    """Inside an srun task without torchrun's variables, set them from Slurm's (see
    `torch_env_from_slurm`); True when it did. A process torchrun started (RANK set) is
    left alone: `srun torchrun ...` works as before. Call before `sw.init_distributed()`."""
    if "RANK" in os.environ:
        return False
    env = torch_env_from_slurm(os.environ)
    os.environ.update(env)
    return bool(env)


# --------------------------------------------------------------------------------------------------
# Process-group start-up from torchrun's environment, and gradient-sync control.


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it); another process may
    still take it before the caller binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    backend: str | None = None, timeout_s: float | None = None
) -> tuple[int, int, torch.device]:
    """Join the process group described by torchrun's environment; return (rank, world, device).

    Inside a task of an srun step without torchrun (SLURM_PROCID, no RANK) the ranks come
    from Slurm's variables (`torch_env_from_slurm`), passed to the group's start without
    writing os.environ; a task they cannot place raises ValueError before any group exists.
    Without any launcher's variables it starts a one-process group on 127.0.0.1, so the same
    script runs alone. Backend: NCCL when CUDA is available, else gloo. `timeout_s` (default
    SHARDWISE_TIMEOUT or 300) bounds every collective, so a dead rank raises instead of
    hanging forever.
    """
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo', 'nccl' or None")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which is not available here; use 'gloo'")
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} is not allowed: must be a finite number > 0")
    else:
        env = os.environ.get("SHARDWISE_TIMEOUT")
        try:
            timeout_s = float(env) if env is not None else DEFAULT_TIMEOUT_S
        except ValueError:
            timeout_s = math.nan
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"SHARDWISE_TIMEOUT={env!r} is not allowed: must be a finite "
                             "number of seconds > 0")
    slurm: dict[str, str] = {}
    if "RANK" not in os.environ and not is_initialized():
        # An srun task without torchrun: Slurm's variables say who we are. They are passed to
        # the group's start explicitly, never written into os.environ (a library call must
        # not change the process's environment); a task that cannot be placed stops here,
        # before any group exists, rather than training alone as one of N silent copies.
        try:
            slurm = torch_env_from_slurm(os.environ)
        except ValueError as e:
            raise ValueError(f"sw.init_distributed(): this is task {os.environ.get('SLURM_PROCID')}"
                             f" of an srun step, but {e}") from None
        _launch_env.clear()
        _launch_env.update(slurm)
    if "RANK" not in os.environ and not is_initialized() and not slurm:
        # Alone (no launcher); a group that exists already (Ray Train's) is joined as it is.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = float(timeout_s)
    local_rank = int(launch_var("LOCAL_RANK") or 0)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not is_initialized():
        init_process_group(backend, timeout, slurm)
    return rank(), world_size(), device


# What init_distributed read from Slurm's variables (torchrun's names -> values) when it
# started the group from them; empty otherwise. Read through `launch_var`.
_launch_env: dict[str, str] = {}


def launch_var(name: str) -> str | None:
    """A launcher variable (RANK, LOCAL_WORLD_SIZE, ...): the environment's, else the one
    init_distributed derived from Slurm's variables without writing it into the environment."""
    value = os.environ.get(name)
    return value if value not in (None, "") else _launch_env.get(name)

