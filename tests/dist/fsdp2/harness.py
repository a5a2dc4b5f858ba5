"""Run many small distributed cases in one set of processes, one result per case.

A case is a module-level function `fn(rank, world, ex, **kwargs)` (ex: common.Expect). All
cases of a world size run one after another in the same `run_distributed` call, so process
start-up (several seconds on this machine) is paid once per world size, not once per case.

Keeping the ranks in step: a case that fails through `Expect` ran all of its collectives, so
the next case can start. A case that raises may have left the ranks at different points of
their collective sequence; the ranks then check the default group with one all-reduce and,
if in doubt, stop, and the parent starts fresh processes for the remaining cases. A rank that
dies (a crash) is found from the progress files: its case fails, the rest run again.

[Note: case deadlines] Each case has its own deadline (`Case.timeout_s`), kept by a watchdog
in every rank: `faulthandler.dump_traceback_later`, a C thread that needs no GIL, so a case
stuck in native code is caught too. When it fires it writes where the rank was and ends the
process; the parent names the case that was running, its deadline and the ranks' stacks, and
reruns the remaining cases in fresh processes. A rank that finished the case waits for its
peers GRACE_S past the deadline, so the watchdog that fires is the one of the rank that
overran. The run as a whole has no budget of its own that could blame an innocent case:
its backstop is the sum of the deadlines. Each case's duration is measured inside the ranks
(the slowest rank's), so a report charges every case its own time, not the first case the
whole grid's.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

COLLECTIVE_TIMEOUT_S = 30.0  # a rank stuck in a case's collective gives up after this
# A case's own deadline ([Note: case deadlines]): it is there to catch hangs, not slowness.
# Cases take seconds (clip_grad_norm at 3 ranks, among the heavier ones, took 9 s on 2 cores
# shared with other jobs at a load average of 25); 300 s leaves room for far worse machines.
CASE_TIMEOUT_S = 300.0
GRACE_S = 30.0  # how long a rank that finished a case waits past the deadline for its peers


class CaseResult(NamedTuple):
    ok: bool
    detail: str  # why it failed ("" when it passed)
    seconds: float  # the case's own duration (the slowest rank's; to the deadline if it overran)


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., None]
    kwargs: dict[str, Any] = field(default_factory=dict)
    worlds: tuple[int, ...] = (2, 3)
    last: bool = False  # run after the others (may crash the process)
    timeout_s: float = CASE_TIMEOUT_S  # this case's deadline ([Note: case deadlines])

    @property
    def id(self) -> str:
        if not self.kwargs:
            return self.name
        return self.name + "[" + ",".join(f"{k}={v}" for k, v in self.kwargs.items()) + "]"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Case) and other.id == self.id


def grid(name: str, fn: Callable[..., None], worlds: tuple[int, ...] = (2, 3),
         last: bool = False, timeout_s: float = CASE_TIMEOUT_S, **axes: list[Any]
         ) -> list[Case]:
    """One case per combination of the option axes."""
    combos: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        combos = [{**c, key: v} for c in combos for v in values]
    return [Case(name, fn, c, worlds, last, timeout_s) for c in combos]


def params_for(cases: list[Case]) -> list[Any]:
    import pytest

    return [pytest.param(c, w, id=f"{c.id}-w{w}") for c in cases for w in c.worlds]


# --- inside the ranks -----------------------------------------------------------------------


def run_cases(rank: int, world: int, specs: list[tuple[str, str, str, dict, float]],
              outdir: str) -> None:
    import torch.distributed as dist

    from tests.dist.fsdp2.common import Expect

    # The exchange after a case outlasts any case's deadline: a rank waiting there for a
    # peer that overran must not give up before the peer's watchdog names it.
    side_s = max(spec[4] for spec in specs) + 2 * GRACE_S
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=side_s))
    progress = open(os.path.join(outdir, f"progress-{rank}"), "a")  # noqa: SIM115
    watchdog = open(os.path.join(outdir, f"overran-{rank}"), "w")  # noqa: SIM115
    for cid, mod, fname, kwargs, timeout_s in specs:
        progress.write(f"{cid}\t{time.time():.3f}\n")
        progress.flush()
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=watchdog)
        start = time.perf_counter()
        torch.manual_seed(0)
        ex = Expect()
        try:
            getattr(importlib.import_module(mod), fname)(rank, world, ex, **kwargs)
            outcome = ("soft", ex.report()) if ex.failures else ("ok", "")
        except Exception:  # noqa: BLE001 - the case's failure is its result
            outcome = ("hard", _short_traceback())
        seconds = time.perf_counter() - start
        faulthandler.dump_traceback_later(max(timeout_s - seconds, 0.0) + GRACE_S, exit=True,
                                          file=watchdog)
        try:
            outcomes: list[Any] = [None] * world
            dist.all_gather_object(outcomes, (*outcome, seconds), group=side)
        except Exception:  # noqa: BLE001 - a peer is gone: nothing more can run here
            os._exit(3)
        if rank == 0:
            _write_result(outdir, cid, outcomes)
        hard = [o for o in outcomes if o[0] == "hard"]
        if hard and not _still_in_step(side, world, outcomes):
            progress.close()
            os._exit(0)  # the parent reruns the remaining cases in fresh processes
        faulthandler.cancel_dump_traceback_later()
    progress.close()
    watchdog.close()


def _short_traceback() -> str:
    lines = traceback.format_exc().strip().splitlines()
    return "\n".join(lines[-14:])


def _write_result(outdir: str, cid: str, outcomes: list[tuple[str, str, float]]) -> None:
    ok = all(o[0] == "ok" for o in outcomes)
    detail = "" if ok else _merge(outcomes)
    seconds = max(o[2] for o in outcomes)
    with open(os.path.join(outdir, "results.jsonl"), "a") as f:
        f.write(json.dumps({"id": cid, "ok": ok, "detail": detail, "seconds": seconds}) + "\n")


def _merge(outcomes: list[tuple[str, str, float]]) -> str:
    """Ranks with the same message are listed once: 'ranks [0, 2]: ...'."""
    by_msg: dict[str, list[int]] = {}
    for r, (status, msg, _) in enumerate(outcomes):
        if status != "ok":
            by_msg.setdefault(f"({status}) {msg}", []).append(r)
    return "\n".join(f"ranks {rs}: {msg}" for msg, rs in by_msg.items())


def _still_in_step(side: Any, world: int, outcomes: list[tuple[str, str, float]]) -> bool:
    """After a raising case: can the default group still be trusted for the next case?"""
    import torch.distributed as dist

    last_lines = {o[1].strip().splitlines()[-1] if o[1] else "" for o in outcomes}
    healthy = all(o[0] == "hard" for o in outcomes) and len(last_lines) == 1
    if healthy:
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
            healthy = t.item() == world
        except Exception:  # noqa: BLE001
            healthy = False
    votes: list[Any] = [None] * world
    try:
        dist.all_gather_object(votes, healthy, group=side)
    except Exception:  # noqa: BLE001
        return False
    return all(votes)


# --- in the pytest process ------------------------------------------------------------------


def run_world(world: int, cases: list[Case]) -> dict[str, CaseResult]:
    """Run `cases` at `world` ranks; case id -> its result."""
    from shardwise.testing import DistributedError, run_distributed

    order = [c for c in cases if not c.last] + [c for c in cases if c.last]
    results: dict[str, CaseResult] = {}
    while True:
        remaining = [c for c in order if c.id not in results]
        if not remaining:
            return results
        specs = [(c.id, c.fn.__module__, c.fn.__name__, c.kwargs, c.timeout_s)
                 for c in remaining]
        outdir = tempfile.mkdtemp(prefix=f"fsdp2-w{world}-")
        error = ""
        try:
            # A backstop only: every case is bounded by its own deadline.
            backstop = sum(c.timeout_s + GRACE_S for c in remaining) + 120.0
            run_distributed(run_cases, world, specs, outdir, timeout_s=backstop,
                            collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        except DistributedError as e:
            error = str(e)
        ended = time.time()
        got = _read_results(outdir)
        results.update(got)
        left = [c for c in remaining if c.id not in results]
        started = _started(outdir)
        overran = _overran(outdir, world)
        shutil.rmtree(outdir, ignore_errors=True)
        if left and (left[0].id in started or not got):
            # Started but never finished: it took the processes down (crash or hang).
            case = left[0]
            if overran:
                results[case.id] = CaseResult(False, _overran_detail(case, overran),
                                              case.timeout_s)
            else:
                since = started.get(case.id, ended)
                results[case.id] = CaseResult(False, "the processes died in this case:\n"
                                              + (error[-3000:] or "(no message)"),
                                              ended - since)


def _read_results(outdir: str) -> dict[str, CaseResult]:
    path = os.path.join(outdir, "results.jsonl")
    out: dict[str, CaseResult] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[rec["id"]] = CaseResult(rec["ok"], rec["detail"], rec["seconds"])
    return out


def _started(outdir: str) -> dict[str, float]:
    """Case id -> when it started (the earliest rank), from the progress files."""
    started: dict[str, float] = {}
    for fn in os.listdir(outdir):
        if fn.startswith("progress-"):
            with open(os.path.join(outdir, fn)) as f:
                for line in f:
                    cid, _, at = line.rstrip("\n").rpartition("\t")
                    if cid:
                        started[cid] = min(float(at), started.get(cid, float("inf")))
    return started


def _overran(outdir: str, world: int) -> dict[int, str]:
    """Rank -> the stacks its watchdog wrote, for the ranks whose case ran past its deadline."""
    out: dict[int, str] = {}
    for rank in range(world):
        path = os.path.join(outdir, f"overran-{rank}")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().strip()
            if text:
                out[rank] = text
    return out


def _overran_detail(case: Case, overran: dict[int, str]) -> str:
    where = "\n".join(f"--- rank {r} ---\n" + "\n".join(text.splitlines()[:24])
                      for r, text in sorted(overran.items()))
    return (f"ran past its deadline of {case.timeout_s:g} s (Case.timeout_s) on ranks "
            f"{sorted(overran)}; where each was (most recent call first):\n{where}")
