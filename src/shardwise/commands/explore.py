"""`shardwise explore`: the explorer page, live on local ranks or replaying a recorded run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import threading
import webbrowser
from types import FrameType

import uvicorn


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardwise explore",
        description="Watch FSDP shard, gather, reduce and learn, live in the browser: a real "
                    "sharded run of a 676-parameter MLP on 1-4 local gloo ranks.")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    ap.add_argument("--no-browser", action="store_true", help="do not open a browser")
    ap.add_argument("--replay", metavar="RUN_DIR",
                    help="show a recorded `shardwise train` run (runs/NAME) instead")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the first run's data and initialisation (default: random)")
    ap.add_argument("--step-interval", type=float, default=0.8, metavar="SECONDS",
                    help="pause between steps while Train animates (default 0.8)")
    ap.add_argument("--world-size", type=int, default=4, help="initial world size (1-4)")
    return ap


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from shardwise.explorer.server import LOOPBACK_NAMES, create_app

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.replay:
            from shardwise.explorer.replay import load_run

            app = create_app(replay=load_run(args.replay),
                             loopback_only=args.host in LOOPBACK_NAMES)
        else:
            from shardwise.explorer.session import Session
            from shardwise.explorer.workers import RunConfig

            if args.step_interval < 0:
                raise ValueError(f"--step-interval={args.step_interval} must be >= 0")
            session = Session(RunConfig(world_size=args.world_size), seed=args.seed,
                              step_interval_s=args.step_interval)
            app = create_app(session=session, loopback_only=args.host in LOOPBACK_NAMES)
    except ValueError as exc:
        print(f"shardwise explore: {exc}", file=sys.stderr)
        return 2

    # Bind first, so the printed URL names the real port (also with --port 0) and a
    # browser that connects before uvicorn starts waits in the listen backlog.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"shardwise explore: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    sock.listen(64)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    url = f"http://{host}:{port}/"
    print(url, flush=True)
    if not args.no_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                            lifespan="on")
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it handled; the shutdown already happened
    return 0


class _Server(uvicorn.Server):
    """Also ends the live SSE streams when asked to exit: uvicorn's graceful shutdown waits
    for open responses, and an event stream to an open browser tab never ends by itself."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        end = getattr(self.config.app.state, "end_streams", None)
        if end is not None:
            try:
                asyncio.get_running_loop().call_soon_threadsafe(end)
            except RuntimeError:
                pass  # no loop running yet: nothing is streaming
        super().handle_exit(sig, frame)
