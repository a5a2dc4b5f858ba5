"""One run of processes per world size for every selected FSDP2 case (see harness.py)."""

from __future__ import annotations

import pytest

from tests.dist.fsdp2.harness import Case, run_world


class Fsdp2Runner:
    def __init__(self, session: pytest.Session) -> None:
        self.session = session
        self.results: dict[int, dict[str, tuple[bool, str]]] = {}

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
            self.results[world] = run_world(world, self._selected(world))
        ok, detail = self.results[world].get(case.id, (False, "case was not run"))
        if not ok:
            pytest.fail(f"{case.id} at {world} ranks:\n{detail}", pytrace=False)


@pytest.fixture(scope="session")
def fsdp2(request: pytest.FixtureRequest) -> Fsdp2Runner:
    return Fsdp2Runner(request.session)
