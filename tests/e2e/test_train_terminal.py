"""`shardwise train`'s progress bar in a real terminal: tmux runs a 2-step job in an 80-column
pane, and the pane's text (what a user sees) is checked.

Everything else tests the console with stdout piped, where the bar turns into plain lines
(train_console.py); only a terminal shows whether the bar fits on one line, whether the
workers' output or a validation line breaks it, and whether it ends cleanly before the
summary. tmux is in .ci/run's apt-get line; without it (and no way to install it) the test
skips, saying so.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

WIDTH, HEIGHT = 80, 60
TIMEOUT_S = 240
TINY = ["--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "4",
        "--train.steps", "2", "--train.eval_batches", "1", "--checkpoint.interval", "0",
        "--log.sample_tokens", "0", "--nproc", "2", "--name", "tty"]
BAR = re.compile(r"^train: +\d+%\|")


def _tmux() -> str:
    found = shutil.which("tmux")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "tmux"], capture_output=True,
                       timeout=300, check=False)
        found = shutil.which("tmux")
    if found is None:
        pytest.skip("tmux is not installed and could not be installed (apt-get install tmux; "
                    ".ci/run installs it): the progress bar needs a real terminal")
    return found


def test_progress_bar_renders_on_one_line_and_ends_clean(tmp_path: Path) -> None:
    tmux = _tmux()
    sock = f"shardwise-test-{os.getpid()}"  # a server of our own, never a user's
    env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', ''))}"
    cmd = (f"cd {shlex.quote(str(tmp_path))} && env {env} {shlex.quote(sys.executable)} -m "
           f"shardwise.cli train {' '.join(TINY)}; echo EXIT=$?; sleep {TIMEOUT_S}")

    def pane() -> list[str]:
        # -J: lines the terminal wrapped come back joined, so a wrapped bar is one long line.
        out = subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-J", "-t", "run",
                              "-S", "-"], capture_output=True, text=True, check=True).stdout
        return out.rstrip("\n").splitlines()

    subprocess.run([tmux, "-L", sock, "new-session", "-d", "-s", "run", "-x", str(WIDTH),
                    "-y", str(HEIGHT), cmd], check=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(line.startswith("EXIT=") for line in pane()):
            assert time.monotonic() < deadline, "\n".join(pane())
            time.sleep(1)
        lines = pane()
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], capture_output=True, check=False)
    text = "\n".join(lines)
    assert "EXIT=0" in text, text
    bars = [i for i, line in enumerate(lines) if BAR.match(line)]
    # One bar line, finished: no half-drawn bar left behind by a validation line or a worker.
    assert len(bars) == 1, text
    bar = lines[bars[0]]
    assert re.match(r"^train: 100%\|.*\| 2/2 \[", bar), bar
    assert len(bar) <= WIDTH, f"the bar wrapped ({len(bar)} > {WIDTH} columns): {bar!r}"
    assert not any("\r" in line or "\x1b" in line for line in lines), text
    # Clean end: the bar, one blank line, then the summary; the validation line above it.
    assert lines[bars[0] + 1] == "" and lines[bars[0] + 2].startswith("done: step 2"), text
    assert any(line.startswith("step     2: val loss") for line in lines[:bars[0]]), text
