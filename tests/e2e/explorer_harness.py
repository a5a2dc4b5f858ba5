"""Shared by the explorer's browser tests: start `shardwise explore`, drive Debian chromium.

The server runs as the real CLI in a subprocess (`python -m shardwise.cli explore`), so
the tests cover argument parsing, the printed URL, the worker processes and shutdown.
The browser is the system's chromium driven by Playwright; never a downloaded browser.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[2]

_MISSING = (f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium) "
            "to run the explorer's browser tests")


def skip_reason(browser: Path, env: dict[str, str]) -> str | None:
    """Why a browser test is skipped, or None when it runs (and fails without a browser).

    In CI (CI=true, as CI's runner sets it) a missing browser is a failure, not a skip: a
    skipped browser suite would leave CI green with the explorer untested.
    """
    in_ci = env.get("CI", "").lower() in ("1", "true", "yes")
    return None if browser.exists() or in_ci else _MISSING


needs_chromium = pytest.mark.skipif(skip_reason(CHROMIUM, dict(os.environ)) is not None,
                                    reason=_MISSING)


def require_chromium() -> None:
    """Fail (in CI) rather than run a browser test without a browser."""
    if not CHROMIUM.exists():
        pytest.fail(_MISSING)


@contextmanager
def explore_server(*args: str, start_timeout_s: float = 90.0) -> Iterator[str]:
    """Run `shardwise explore --no-browser --port 0 ARGS`; yield its URL; stop it after."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "explore", "--no-browser", "--port", "0", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        try:
            url = lines.get(timeout=start_timeout_s).strip()
        except queue.Empty:
            raise RuntimeError(f"explore printed no URL; stderr:\n{''.join(err)}") from None
        assert url.startswith("http://127.0.0.1:") and url.endswith("/"), url
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown closes the ranks
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # Shown by pytest only when a test failed: the server's own account of it.
        print(f"--- shardwise explore stderr ---\n{''.join(err)}", file=sys.stderr)


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@contextmanager
def browser_page(url: str, outside: list[str]) -> Iterator[object]:
    """A page on `url`; every request not addressed to the server lands in `outside`
    (and is aborted, so the test never depends on the network)."""
    from playwright.sync_api import sync_playwright

    require_chromium()
    home = origin(url)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})

            def guard(route: object) -> None:
                req_url = route.request.url  # type: ignore[attr-defined]
                if origin(req_url) == home or req_url.startswith("data:"):
                    route.continue_()  # type: ignore[attr-defined]
                else:
                    outside.append(req_url)
                    route.abort()  # type: ignore[attr-defined]

            page.route("**/*", guard)
            page.on("request", lambda r: None if (origin(r.url) == home or
                                                  r.url.startswith("data:"))
                    else outside.append(r.url))
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            yield page
            assert not errors, f"JavaScript errors on the page: {errors}"
        finally:
            browser.close()
