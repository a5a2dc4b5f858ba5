"""The explorer in real headless chromium, against a real 4-rank gloo run.

One server and one page for the whole module (starting 4 rank processes costs seconds);
the tests run in order and each starts from a state it sets itself (Reset or a control).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.explorer_harness import browser_page, explore_server, needs_chromium

pytestmark = [needs_chromium, pytest.mark.browser]

START_S = 60_000  # ms: first page load waits for the ranks to start
STEP_S = 30_000  # ms: one step, or a few with the Train animation


class Live:
    def __init__(self, url: str, page: object, outside: list[str]) -> None:
        self.url, self.page, self.outside = url, page, outside


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    outside: list[str] = []
    with explore_server("--seed", "7", "--step-interval", "0.25") as url:
        with browser_page(url, outside) as page:
            yield Live(url, page, outside)


def counter(live: Live) -> str:
    return live.page.get_by_test_id("step-counter").inner_text()  # type: ignore[attr-defined]


def expect_counter(live: Live, text: str, timeout: int = STEP_S) -> None:
    from playwright.sync_api import expect

    expect(live.page.get_by_test_id("step-counter")).to_have_text(  # type: ignore[attr-defined]
        text, timeout=timeout)


def button(live: Live, name: str):
    return live.page.get_by_role("button", name=name, exact=True)  # type: ignore[attr-defined]


def wait_ready(live: Live, timeout: int = START_S) -> None:
    from playwright.sync_api import expect

    expect(live.page.get_by_test_id("status")).to_have_text(  # type: ignore[attr-defined]
        re.compile("ready|paused|run complete"), timeout=timeout)


def number(live: Live, testid: str) -> float:
    text = live.page.get_by_test_id(testid).inner_text()  # type: ignore[attr-defined]
    return float(text.rstrip("%"))


def test_page_loads_with_controls_and_four_ranks(live: Live) -> None:
    from playwright.sync_api import expect

    page = live.page
    wait_ready(live)
    expect_counter(live, "Step 0 / 12")
    for name in ("Reset", "Train", "Pause", "Train Step"):
        expect(button(live, name)).to_be_visible()
    expect(page.get_by_test_id("rank-panel")).to_have_count(4)
    for label in ("Sharding strategy", "World size", "Mixed precision", "Wrap policy"):
        expect(page.get_by_label(label)).to_be_enabled()
    offload = page.get_by_test_id("ctl-offload")
    if not _has_gpu():
        expect(offload).to_be_disabled()
        expect(page.get_by_test_id("offload-reason")).to_contain_text("No GPU")
    # The shard map: rank 1 of 4 owns rows 8..15 of the first layer's weight.
    rank1 = page.locator('[data-testid="rank-panel"][data-rank="1"]')
    expect(rank1.locator('[data-param="0.weight"]')).to_have_attribute("data-rows", "8-16")
    expect(page.get_by_test_id("how-params")).to_contain_text("FULL_SHARD")


def test_train_step_runs_one_step_from_engine_events(live: Live) -> None:
    from playwright.sync_api import expect

    button(live, "Reset").click()
    expect_counter(live, "Step 0 / 12")
    wait_ready(live)
    button(live, "Train Step").click()
    expect_counter(live, "Step 1 / 12")
    panel = live.page.get_by_test_id("rank-panel").first
    # The phases come from the engine: all-gathers and reduce-scatters with their bytes.
    gathers = panel.locator('[data-testid="phase"][data-phase="all_gather"]')
    expect(gathers.first).to_be_attached()
    assert int(gathers.first.get_attribute("data-bytes")) > 0
    expect(panel.locator('[data-testid="phase"][data-phase="reduce_scatter"]').first) \
        .to_be_attached()
    expect(panel.locator('[data-testid="phase"][data-phase="optimizer"]')).to_have_count(1)


def test_train_runs_to_twelve_and_learns(live: Live, tmp_path_factory) -> None:
    button(live, "Reset").click()
    expect_counter(live, "Step 0 / 12")
    wait_ready(live)
    loss0 = number(live, "loss-value")
    button(live, "Train").click()
    expect_counter(live, "Step 12 / 12", timeout=60_000)
    loss, acc = number(live, "loss-value"), number(live, "accuracy-value")
    assert loss < 0.75 * loss0, (loss0, loss)
    assert acc > 60.0, f"accuracy {acc}% is not well above chance (25%)"
    time.sleep(1.6)  # let the last step's playback finish for the picture
    shot = tmp_path_factory.mktemp("explorer") / "explorer.png"
    live.page.screenshot(path=str(shot), full_page=True)  # type: ignore[attr-defined]
    assert shot.stat().st_size > 50_000
    # `SHARDWISE_EXPLORER_SCREENSHOT=docs/explorer.png pytest ...` refreshes the docs image.
    if os.environ.get("SHARDWISE_EXPLORER_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["SHARDWISE_EXPLORER_SCREENSHOT"]))


def test_pause_holds_the_counter(live: Live) -> None:
    from playwright.sync_api import expect

    button(live, "Reset").click()
    expect_counter(live, "Step 0 / 12")
    wait_ready(live)
    button(live, "Train").click()
    expect(live.page.get_by_test_id("step-counter")).not_to_have_text(  # type: ignore
        "Step 0 / 12", timeout=STEP_S)
    button(live, "Pause").click()
    expect(live.page.get_by_test_id("status")).to_have_text("paused")  # type: ignore
    held = counter(live)
    time.sleep(2.0)  # several step intervals: nothing may move
    assert counter(live) == held
    assert held != "Step 12 / 12"
    button(live, "Train Step").click()  # and stepping resumes from where it stopped
    k = int(held.split()[1])
    expect_counter(live, f"Step {k + 1} / 12")


def test_reset_returns_to_step_zero(live: Live) -> None:
    button(live, "Reset").click()
    expect_counter(live, "Step 0 / 12")
    wait_ready(live)
    state = _get(live.url + "api/state")
    assert state["step"] == 0 and len(state["history"]) == 1


def test_controls_reshard_and_rank_panels_follow_world_size(live: Live) -> None:
    from playwright.sync_api import expect

    page = live.page
    page.get_by_label("World size").select_option("2")  # type: ignore[attr-defined]
    expect(page.get_by_test_id("rank-panel")).to_have_count(2, timeout=START_S)
    wait_ready(live)
    expect_counter(live, "Step 0 / 12")
    rank1 = page.locator('[data-testid="rank-panel"][data-rank="1"]')
    expect(rank1.locator('[data-param="0.weight"]')).to_have_attribute("data-rows", "16-32")
    # NO_SHARD is DDP: every rank holds all rows and gradients are all-reduced.
    page.get_by_label("Sharding strategy").select_option("NO_SHARD")  # type: ignore
    expect(rank1.locator('[data-param="0.weight"]')).to_have_attribute(
        "data-rows", "0-32", timeout=START_S)
    wait_ready(live)
    button(live, "Train Step").click()
    expect_counter(live, "Step 1 / 12")
    expect(rank1.locator('[data-testid="phase"][data-phase="all_reduce"]').first) \
        .to_be_attached()
    expect(rank1.locator('[data-testid="phase"][data-phase="all_gather"]')).to_have_count(0)


def test_posts_need_json_and_a_loopback_host(live: Live) -> None:
    req = urllib.request.Request(live.url + "api/step", data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as bad_type:
        urllib.request.urlopen(req, timeout=10)
    assert bad_type.value.code == 415
    req = urllib.request.Request(live.url + "api/info", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as bad_host:
        urllib.request.urlopen(req, timeout=10)
    assert bad_host.value.code == 421
    req = urllib.request.Request(live.url + "api/config", method="POST",
                                 data=json.dumps({"world_size": 9}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as bad_value:
        urllib.request.urlopen(req, timeout=10)
    assert bad_value.value.code == 400
    assert "world_size=9" in bad_value.value.read().decode()


def test_no_request_left_the_server(live: Live) -> None:
    assert live.outside == [], f"the page requested outside the server: {live.outside}"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as res:
        return json.loads(res.read())


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
