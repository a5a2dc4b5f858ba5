"""Run many small distributed cases in one set of processes, one result per case.

A case is a module-level function `fn(rank, world, ex, **kwargs)` (ex: common.Expect). All
cases of a world size run one after another in the same `run_distributed` call, so process
start-up (several seconds on this machine) is paid once per world size, not once per case.

Keeping the ranks in step: a case that fails through `Expect` ran all of its collectives, so
the next case can start. A case that raises may have left the ranks at different points of
their collective sequence; the ranks then check the default group with one all-reduce and,
if in doubt, stop, and the parent starts fresh processes for the remaining cases. A rank that
dies (a crash) is found from the progress files: its case fails, the rest run again.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 30.0  # a rank stuck in a case's collective gives up after this
SIDE_TIMEOUT_S = 120.0  # the between-cases exchange waits longer than any stuck collective
GRID_TIMEOUT_S = 1500.0


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., None]
    kwargs: dict[str, Any] = field(default_factory=dict)
    worlds: tuple[int, ...] = (2, 3)
    last: bool = False  # run after the others (may crash the process)

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
         last: bool = False, **axes: list[Any]) -> list[Case]:
    """One case per combination of the option axes."""
    combos: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        combos = [{**c, key: v} for c in combos for v in values]
    return [Case(name, fn, c, worlds, last) for c in combos]


def params_for(cases: list[Case]) -> list[Any]:
    import pytest

    return [pytest.param(c, w, id=f"{c.id}-w{w}") for c in cases for w in c.worlds]


# --- inside the ranks -----------------------------------------------------------------------


def run_cases(rank: int, world: int, specs: list[tuple[str, str, str, dict]], outdir: str
              ) -> None:
    import torch.distributed as dist

    from tests.dist.fsdp2.common import Expect

    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SIDE_TIMEOUT_S))
    progress = open(os.path.join(outdir, f"progress-{rank}"), "a")  # noqa: SIM115
    for cid, mod, fname, kwargs in specs:
        progress.write(cid + "\n")
        progress.flush()
        torch.manual_seed(0)
        ex = Expect()
        try:
            getattr(importlib.import_module(mod), fname)(rank, world, ex, **kwargs)
            outcome = ("soft", ex.report()) if ex.failures else ("ok", "")
        except Exception:  # noqa: BLE001 - the case's failure is its result
            outcome = ("hard", _short_traceback())
        try:
            outcomes: list[Any] = [None] * world
            dist.all_gather_object(outcomes, outcome, group=side)
        except Exception:  # noqa: BLE001 - a peer is gone: nothing more can run here
            os._exit(3)
        if rank == 0:
            _write_result(outdir, cid, outcomes)
        hard = [o for o in outcomes if o[0] == "hard"]
        if hard and not _still_in_step(side, world, outcomes):
            progress.close()
            os._exit(0)  # the parent reruns the remaining cases in fresh processes
    progress.close()


def _short_traceback() -> str:
    lines = traceback.format_exc().strip().splitlines()
    return "\n".join(lines[-14:])


def _write_result(outdir: str, cid: str, outcomes: list[tuple[str, str]]) -> None:
    ok = all(o[0] == "ok" for o in outcomes)
    detail = "" if ok else _merge(outcomes)
    with open(os.path.join(outdir, "results.jsonl"), "a") as f:
        f.write(json.dumps({"id": cid, "ok": ok, "detail": detail}) + "\n")


def _merge(outcomes: list[tuple[str, str]]) -> str:
    """Ranks with the same message are listed once: 'ranks [0, 2]: ...'."""
    by_msg: dict[str, list[int]] = {}
    for r, (status, msg) in enumerate(outcomes):
        if status != "ok":
            by_msg.setdefault(f"({status}) {msg}", []).append(r)
    return "\n".join(f"ranks {rs}: {msg}" for msg, rs in by_msg.items())


def _still_in_step(side: Any, world: int, outcomes: list[tuple[str, str]]) -> bool:
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


def run_world(world: int, cases: list[Case]) -> dict[str, tuple[bool, str]]:
    """Run `cases` at `world` ranks; case id -> (passed, failure detail)."""
    from shardwise.testing import DistributedError, run_distributed

    order = [c for c in cases if not c.last] + [c for c in cases if c.last]
    results: dict[str, tuple[bool, str]] = {}
    while True:
        remaining = [c for c in order if c.id not in results]
        if not remaining:
            return results
        specs = [(c.id, c.fn.__module__, c.fn.__name__, c.kwargs) for c in remaining]
        outdir = tempfile.mkdtemp(prefix=f"fsdp2-w{world}-")
        error = ""
        try:
            run_distributed(run_cases, world, specs, outdir, timeout_s=GRID_TIMEOUT_S,
                            collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        except DistributedError as e:
            error = str(e)
        got = _read_results(outdir)
        results.update(got)
        left = [c for c in remaining if c.id not in results]
        started = _started(outdir)
        shutil.rmtree(outdir, ignore_errors=True)
        if left and (left[0].id in started or not got):
            # Started but never finished: it took the processes down (crash or hang).
            results[left[0].id] = (False, "the processes died in this case:\n"
                                   + (error[-3000:] or "(no message)"))


def _read_results(outdir: str) -> dict[str, tuple[bool, str]]:
    path = os.path.join(outdir, "results.jsonl")
    out: dict[str, tuple[bool, str]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[rec["id"]] = (rec["ok"], rec["detail"])
    return out


def _started(outdir: str) -> set[str]:
    names: set[str] = set()
    for fn in os.listdir(outdir):
        if fn.startswith("progress-"):
            with open(os.path.join(outdir, fn)) as f:
                names.update(line.strip() for line in f)
    return names
