"""Start N local workers with PyTorch's own elastic launcher (what `torchrun` runs).

`launch(fn, nproc, *args)` is `torchrun --standalone --nproc-per-node N` in-process: a
c10d rendezvous on 127.0.0.1 at a free port, workers started by torch.distributed's
launcher, each calling `fn(*args)` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set. Under an
existing torchrun (RANK in the environment) callers should run `fn` directly instead.

How a launch ends, as the caller sees it: the workers' return values; `WorkerFailure`
(the root-cause rank, its message, and its traceback only when it crashed); or
`Interrupted` (SIGINT/SIGTERM, with every worker gone). torchelastic's own log lines and
its temporary folder stay out of sight; see [Note: worker signals].

[Note: worker signals] A terminal's Ctrl-C reaches the whole process group: the launcher
and every worker. A worker that is still importing torch turns it into a KeyboardInterrupt
traceback, and torchelastic forwards the same SIGINT to workers on its way out. So workers
ignore SIGINT from their first line (`SHARDWISE_WORKER` makes `shardwise/__init__.py` do
it before torch is imported) and the launcher alone decides: it turns SIGINT into a SIGKILL
of the workers (stop now, as SIGTERM's default action did before `shardwise train` made
SIGTERM a request to checkpoint and stop), then raises `Interrupted`. SIGTERM, SIGHUP,
SIGQUIT and the caller's `stop_signals` are passed on to the workers, and the workers get
`grace_s` to act on them (train/preempt.py) before torchelastic kills them. A worker whose
launcher dies outright gets SIGTERM from the kernel (PR_SET_PDEATHSIG).

[Note: relayed stops] The launcher passes a stop signal on as its relay, `SIGRTMIN + signum`
(`relay_signal`), not as the signal itself. Slurm's scancel, a time limit or systemd signal
every process of the job: each worker gets SIGTERM directly *and* from the launcher, and a
second SIGTERM means "stop now" to a worker finishing its step (train/preempt.py), so the
checkpoint of the stop was lost; a relay is the same request, never a second one. And once
the launcher is shutting down it no longer reads the workers' results, while torchelastic's
worker wrapper waits for that read after the function returns: a worker that got a relay
ends its process as soon as its function returned (the checkpoint written) instead of
waiting there until `grace_s` ran out and it was killed (25 s of a 30 s KillWait).

[Note: forked workers] Each spawned worker starts a new interpreter and imports torch and
shardwise again: 2-3 s of CPU per worker before its first line, most of a short run's wall
time on a small machine (a 3-step tiny run: 7.2 s; 14-21 s beside a test suite). The launcher
has imported all of it already, so on Linux its workers are forked from it instead, as
PyTorch's own multi-process tests start theirs, but only where a fork is sound: no CUDA
(the CUDA runtime does not survive a fork; GPU runs spawn, as before) and no thread the
launcher started since it imported this module (an OpenMP pool that a fork leaves behind
would hang the child's first parallel region). A forked worker does not inherit the
launcher's signal dispositions: it resets them first thing (`_run_then_finish`), and the
launcher's handler does nothing in a worker that got a signal before that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .engine.comm.process_group import free_port

log = logging.getLogger(__name__)


def _os_threads() -> int:
    """This process's OS threads (Linux; 0 where /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


# [Note: forked workers]: the threads the process had once torch was imported (this module
# imports it through free_port's module); one started after this is a reason to spawn.
_THREADS_AT_IMPORT = _os_threads()


def start_method() -> str:
    """How `launch` starts its workers: "fork" where that is sound, else "spawn"
    ([Note: forked workers])."""
    if os.environ.get("SHARDWISE_START_METHOD") in ("fork", "spawn"):
        return os.environ["SHARDWISE_START_METHOD"]
    if sys.platform != "linux" or not _THREADS_AT_IMPORT:
        return "spawn"
    import torch

    if torch.cuda.is_available() or _os_threads() > _THREADS_AT_IMPORT:
        return "spawn"
    return "fork"

WORKER_ENV = "SHARDWISE_WORKER"


def relay_signal(signum: int) -> int:
    """The signal a launcher passes `signum` on as ([Note: relayed stops])."""
    return int(signal.SIGRTMIN) + int(signum)


class _Relay(int):
    """A relay as torchelastic's shutdown takes a signal: a number with a `name`."""

    @property
    def name(self) -> str:
        return f"relay of {signal.Signals(self - int(signal.SIGRTMIN)).name}"


# The stop signal this worker's launcher passed on (0: none): the launcher is shutting down.
_relayed = 0


def note_relayed(signum: int) -> None:
    """A worker's handler of a relay ([Note: relayed stops]) says which signal it carried."""
    global _relayed
    _relayed = signum


def _relay_default(relay: int, frame: Any) -> None:
    """A relay no handler of the function takes: the stop signal's default action, an end."""
    signum = relay - int(signal.SIGRTMIN)
    note_relayed(signum)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)


class Interrupted(Exception):
    """The launch was stopped by SIGINT or SIGTERM; no worker is left running."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum  # what a shell reports for a process killed by it
        super().__init__(signal.Signals(signum).name)


class WorkerFailure(RuntimeError):
    """A worker failed. `rank` is the root cause (the first to fail); `traceback` is set only
    for a crash (an exception the caller did not declare expected, or a death by signal)."""

    def __init__(self, rank: int, message: str, exit_code: int, traceback: str = "") -> None:
        super().__init__(message)
        self.rank, self.message, self.exit_code = rank, message, exit_code
        self.traceback = traceback


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def workers_ignore_sigint() -> Iterator[None]:
    """Processes spawned inside this block ignore SIGINT from their first line on."""
    before = os.environ.get(WORKER_ENV)
    os.environ[WORKER_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WORKER_ENV, None)
        else:
            os.environ[WORKER_ENV] = before


def launch(fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0,
           expected: dict[type[BaseException], int] | None = None,
           stop_signals: tuple[str, ...] = (), grace_s: int = 10,
           fresh: bool = False) -> list[Any]:
    """Run `fn(*args)` on `nproc` local worker processes; return their values by rank.

    expected: exception types a worker raises on purpose -> the exit status they mean; such
    an error ends the launch as a one-line `WorkerFailure` (no traceback).
    stop_signals: signal names besides SIGTERM, SIGHUP and SIGQUIT that the launcher passes
    on to the workers (then raises `Interrupted`); grace_s: how long workers may take to end
    after such a signal before they are killed.
    fresh: spawn new interpreters even where workers would be forked ([Note: forked
    workers]): a measurement of a fresh process (its memory) must not start from the
    launcher's pages.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a positive integer")
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Our own folder for torchelastic's logs and the workers' reports: removed afterwards
    # (by default torchelastic leaves an empty /tmp/torchelastic_* per launch).
    tmp = tempfile.mkdtemp(prefix="shardwise-launch-")
    options: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    stops = tuple(signal.Signals[n] for n in ("SIGTERM", "SIGHUP", "SIGQUIT", *stop_signals))
    # Ours, not torchelastic's: it would pass each signal on as itself ([Note: relayed
    # stops]). An empty list registers none of its handlers (it logs, and we swallow it).
    handled = ""
    if "signals_to_handle" in names:  # torch >= 2.8; older versions read the variable below
        options["signals_to_handle"] = handled
    if "shutdown_timeout" in names:
        options["shutdown_timeout"] = grace_s
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
        monitor_interval=0.1, start_method="spawn" if fresh else start_method(),
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")), **options)
    sigint = _Sigint(stops)
    env_before = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled
    try:
        with _quiet_torchelastic(max_restarts), workers_ignore_sigint(), sigint:
            results = elastic_launch(config, _run_then_finish)(
                tmp, expected or {}, tuple(int(s) for s in stops), fn, *args)
        return [results[r] for r in sorted(results)]
    except SignalException as e:
        raise Interrupted(sigint.received or int(e.sigval)) from None
    except ChildFailedError as e:
        if sigint.received:
            raise Interrupted(sigint.received) from None
        raise _root_cause(tmp, e) from None
    finally:
        if env_before is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = env_before
        shutil.rmtree(tmp, ignore_errors=True)


class _Sigint:
    """While active (main thread only), SIGINT asks torchelastic to stop the workers at once
    with SIGKILL (they ignore SIGINT, and take SIGTERM as a request to checkpoint first); a
    stop signal (`stops`) asks it to pass the signal's relay on ([Note: relayed stops]). The
    first is remembered, so the caller can report it; later ones change nothing."""

    def __init__(self, stops: tuple[signal.Signals, ...] = ()) -> None:
        self.received = 0
        self.stops = stops
        self._before: list[tuple[int, Any]] = []
        self._pid = os.getpid()

    def _handler(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if os.getpid() != self._pid:
            return  # a forked worker before it set its own ([Note: forked workers])
        if self.received:
            return  # a second signal while the workers are being stopped
        self.received = signum
        sigval = signal.SIGKILL if signum == signal.SIGINT else _Relay(relay_signal(signum))
        raise SignalException(f"got {signal.Signals(signum).name}", sigval=sigval)  # type: ignore[arg-type]

    def __enter__(self) -> _Sigint:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, *self.stops):
                self._before.append((s, signal.signal(s, self._handler)))
        return self

    def __exit__(self, *exc: object) -> None:
        for s, before in reversed(self._before):
            signal.signal(s, before)
        self._before.clear()


class _Restarts(logging.Handler):
    """Swallows torchelastic's log records; a worker failure that torchelastic answers with
    a restart is said in one line (the last failure is the caller's to report)."""

    def __init__(self, max_restarts: int) -> None:
        super().__init__(logging.ERROR)
        self.max_restarts = max_restarts
        self.failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("failed (exitcode"):
            self.failures += 1
            if self.failures <= self.max_restarts:
                code, local_rank = record.args[0], record.args[1]  # type: ignore[index]
                # The first failure torchelastic noticed, which may be a consequence (a rank
                # whose peer died first): said as such.
                log.warning("a worker failed (first seen: rank %s, %s); restarting all "
                            "workers from the latest checkpoint (restart %d of %d)",
                            local_rank, _exit_text(code), self.failures, self.max_restarts)


@contextlib.contextmanager
def _quiet_torchelastic(max_restarts: int) -> Iterator[None]:
    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    handler = _Restarts(max_restarts)
    for lg in loggers:
        lg.propagate = False
        lg.handlers = [handler]
    try:
        yield
    finally:
        for lg, (level, propagate, handlers) in zip(loggers, saved):
            lg.setLevel(level)
            lg.propagate = propagate
            lg.handlers = handlers


def _exit_text(code: object) -> str:
    if isinstance(code, int) and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit status {code}"


def _root_cause(tmp: str, e: Any) -> WorkerFailure:
    """The first failure of the last attempt: a worker's own report, or its exit status."""
    reports = []
    for p in Path(tmp).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(p.read_text()))
    if reports:
        last = max(r["attempt"] for r in reports)
        first = min((r for r in reports if r["attempt"] == last), key=lambda r: r["time"])
        return WorkerFailure(first["rank"], first["message"], first["exit_code"],
                             first.get("traceback", ""))
    failures = sorted(e.failures.items(), key=lambda kv: kv[1].timestamp)
    rank, failure = failures[0] if failures else (0, None)
    code = failure.exitcode if failure is not None else 1
    return WorkerFailure(rank, f"rank {rank} died ({_exit_text(code)}) without a report",
                         1, traceback="(no traceback: the process was killed)")


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGTERM this process when its launcher dies (torch sets SIGINT, which
    a worker ignores here). Elsewhere a no-op."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _run_then_finish(tmp: str, expected: dict[type[BaseException], int],
                     stops: tuple[int, ...], fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, then the clean teardown of the process group `fn` set up (if any).

    A failure is written to `tmp/rank{r}.json` for the launcher, and the process ends at
    once (no traceback on the console, no interpreter teardown that could wait on a
    collective another rank will never join). See [Note: gloo teardown] in
    shardwise.engine.comm.process_group: a worker process that exits straight after its last
    collective can abort.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_parent_death_signal()
    parent = os.getppid()
    for s in stops:  # fn's own handlers (a StopRequest) take the relays they know
        # (A forked worker had the launcher's handler: [Note: forked workers].)
        signal.signal(s, signal.SIG_DFL)
        signal.signal(relay_signal(s), _relay_default)
    try:
        value = fn(*args)
        from .engine.comm import collectives

        collectives.finish()
        if _relayed or os.getppid() != parent:
            # The launcher stops (or is gone): nobody reads `value`, and torchelastic's
            # wrapper would wait for that read until the worker is killed.
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(0)
        return value
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then exit
        if isinstance(exc, SystemExit) and not exc.code:
            return None
        code = next((c for t, c in expected.items() if isinstance(exc, t)), None)
        rank = int(os.environ.get("RANK", "0"))
        report = {"rank": rank, "time": time.time(), "exit_code": code or 1,
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                  "message": " ".join(str(exc).split()) or type(exc).__name__}
        if code is None:
            report["message"] = f"{type(exc).__name__}: {report['message']}"
            report["traceback"] = traceback.format_exc()
        path = Path(tmp) / f"rank{rank}.json"
        with contextlib.suppress(OSError):
            path.with_suffix(".tmp").write_text(json.dumps(report))
            path.with_suffix(".tmp").replace(path)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(report["exit_code"])
