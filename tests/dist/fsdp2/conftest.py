"""One run of processes per world size for every selected FSDP2 case (see harness.py).

The test that happens to start a world's run would be charged the whole run's time; its
report (and every case's) carries the case's own duration instead, measured in the ranks
([Note: case deadlines] in harness.py), and the summary says what the runs cost besides.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import pytest

from tests.dist.fsdp2.harness import Case, CaseResult, run_world

RUNNER = pytest.StashKey["Fsdp2Runner"]()


class Fsdp2Runner:
    def __init__(self, session: pytest.Session) -> None:
        self.session = session
        self.results: dict[int, dict[str, CaseResult]] = {}
        self.wall: dict[int, float] = {}  # world -> seconds its runs took, start-up included

    def _selected(self, world: int) -> list[Case]:
        cases: list[Case] = []
        for item in self.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            case = params.get("case")
            if isinstance(case, Case) and params.get("world") == world and case not in cases:
                cases.append(case)
        return cases

    def check(self, case: Case, world: int) -> None:
        if world not in self.results:
            start = time.perf_counter()
            self.results[world] = run_world(world, self._selected(world))
            self.wall[world] = time.perf_counter() - start
        ok, detail, _ = self.results[world].get(case.id, CaseResult(False, "case was not run",
                                                                    0.0))
        if not ok:
            pytest.fail(f"{case.id} at {world} ranks:\n{detail}", pytrace=False)

    def seconds(self, case: Case, world: int) -> float | None:
        got = self.results.get(world, {}).get(case.id)
        return None if got is None else got.seconds

    def summary(self) -> list[str]:
        lines = []
        for world, results in sorted(self.results.items()):
            in_cases = sum(r.seconds for r in results.values())
            slowest = sorted(results.items(), key=lambda kv: -kv[1].seconds)[:5]
            lines.append(
                f"fsdp2 grid at {world} ranks: {len(results)} cases in {self.wall[world]:.1f} s "
                f"({in_cases:.1f} s in the cases, {self.wall[world] - in_cases:.1f} s start-up, "
                "exchanges and restarts); slowest: "
                + ", ".join(f"{cid} {r.seconds:.1f} s" for cid, r in slowest))
        return lines


@pytest.fixture(scope="session")
def fsdp2(request: pytest.FixtureRequest) -> Fsdp2Runner:
    runner = Fsdp2Runner(request.session)
    request.config.stash[RUNNER] = runner
    return runner


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    params = getattr(getattr(item, "callspec", None), "params", {})
    runner = item.config.stash.get(RUNNER, None)
    if report.when == "call" and runner is not None and isinstance(params.get("case"), Case):
        seconds = runner.seconds(params["case"], params.get("world"))
        if seconds is not None:
            report.duration = seconds


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    runner = terminalreporter.config.stash.get(RUNNER, None)
    if runner is not None:
        for line in runner.summary():
            terminalreporter.write_line(line)
