"""Imported first by `shardwise/__init__.py`, before torch: a worker process started by
`shardwise.launch` (SHARDWISE_WORKER=1) ignores SIGINT from here on.

The launcher alone handles Ctrl-C; a worker still importing torch when the terminal's SIGINT
arrives would print a KeyboardInterrupt traceback of its own. See [Note: worker signals] in
shardwise/launch.py.
"""

from __future__ import annotations

import os
import signal

if os.environ.get("SHARDWISE_WORKER") == "1":
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # imported from a thread: not a worker's first import
        pass
