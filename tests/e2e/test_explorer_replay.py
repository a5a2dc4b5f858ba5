"""`shardwise explore --replay runs/NAME` in headless chromium, on a fixture run folder."""

from __future__ import annotations

import pytest

from tests.e2e.explorer_harness import browser_page, explore_server, needs_chromium
from tests.e2e.replay_fixture import write_run

pytestmark = [needs_chromium, pytest.mark.browser]


def test_replay_shows_per_rank_timelines_and_memory(tmp_path) -> None:
    from playwright.sync_api import expect

    run = write_run(tmp_path / "runs" / "fixture")
    outside: list[str] = []
    with explore_server("--replay", str(run)) as url, browser_page(url, outside) as page:
        expect(page.get_by_test_id("status")).to_have_text("replay")
        expect(page.locator("#live")).to_be_hidden()
        expect(page.get_by_test_id("replay-rank")).to_have_count(2)
        first = page.locator('[data-testid="replay-rank"][data-rank="0"]')
        # Steps 1 and 2 by default: 2 x 15 events; per step 2 gathers + 1 reduce-scatter
        # of both units (2 x 2704 + 2704 bytes of buffers), of which each of the 2 ranks
        # sends half.
        expect(first).to_contain_text("30 events")
        expect(first).to_contain_text("8.11 KB sent")
        expect(page.get_by_test_id("replay-memory")).to_be_visible()
        expect(page.locator("#replay-table tr")).to_have_count(4)  # header + 3 steps
        page.locator("#replay-count").fill("1")
        page.locator("#replay-count").dispatch_event("change")
        expect(first).to_contain_text("15 events")
        page.screenshot(path=str(tmp_path / "replay.png"), full_page=True)
    assert outside == [], f"the page requested outside the server: {outside}"


def test_replay_of_a_folder_without_events_fails_clearly(tmp_path) -> None:
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    res = subprocess.run([sys.executable, "-m", "shardwise.cli", "explore", "--no-browser",
                          "--replay", str(tmp_path / "empty")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "no events-rank*.jsonl" in res.stderr
