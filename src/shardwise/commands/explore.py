"""`shardwise explore`: the explorer page, live on local ranks or replaying a recorded run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
import webbrowser
from types import FrameType

import uvicorn

from ._args import Parser, at_least, finite, report


def _parser() -> argparse.ArgumentParser:
    ap = Parser(
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


def exposure_warning(host: str) -> str | None:
    """What to tell the user when `--host` makes the page reachable from other machines."""
    from shardwise.explorer.server import is_loopback

    if is_loopback(host):
        return None
    return (f"--host={host!r} serves the explorer beyond this machine: anyone who can reach "
            "this address can watch the run and press its buttons (there is no login); "
            "omit --host to serve 127.0.0.1 only")


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    at_least(ap, "port", args.port, 0)
    if args.port > 65535:
        ap.error(f"--port={args.port} is not allowed: must be in [0, 65535]")
    finite(ap, "step-interval", args.step_interval, 0.0)
    if args.replay is None and not 1 <= args.world_size <= 4:
        ap.error(f"--world-size={args.world_size} is not allowed: must be in [1, 4]")
    try:  # before anything starts: a host that cannot be bound is a bad option
        socket.getaddrinfo(args.host, None)
    except (OSError, UnicodeError) as exc:
        ap.error(f"--host={args.host!r} is not allowed: not an address of this machine ({exc})")
    from shardwise.explorer.server import create_app, is_loopback

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warning = exposure_warning(args.host)
    if warning is not None:
        logging.getLogger("shardwise.explore").warning("%s", warning)
    try:
        if args.replay:
            from shardwise.explorer.replay import load_run

            app = create_app(replay=load_run(args.replay),
                             loopback_only=is_loopback(args.host))
        else:
            from shardwise.explorer.session import Session
            from shardwise.explorer.workers import RunConfig

            session = Session(RunConfig(world_size=args.world_size), seed=args.seed,
                              step_interval_s=args.step_interval)
            app = create_app(session=session, loopback_only=is_loopback(args.host))
    except ValueError as exc:
        return report("shardwise explore", exc)

    # Bind first, so the printed URL names the real port (also with --port 0) and a
    # browser that connects before uvicorn starts waits in the listen backlog.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        return report("shardwise explore",
                      f"--host={args.host!r} --port={args.port}: cannot bind: {exc}")
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
    # uvicorn handles SIGTERM like Ctrl-C, then raises it again with the handler it found:
    # this one, so the process ends through the line below (and Python's cleanup, which
    # frees the rank queues' semaphores) instead of dying by the signal.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        server.signal = server.signal or signal.SIGINT  # the shutdown already happened
    except _Terminated:
        server.signal = server.signal or signal.SIGTERM
    if server.signal:
        name = signal.Signals(server.signal).name
        print(f"shardwise explore: stopped ({name}); the explorer's ranks have exited",
              file=sys.stderr)
        return 128 + server.signal
    return 0


class _Terminated(Exception):
    pass


def _terminated(sig: int, frame: FrameType | None) -> None:
    raise _Terminated


class _Server(uvicorn.Server):
    """Also ends the live SSE streams when asked to exit: uvicorn's graceful shutdown waits
    for open responses, and an event stream to an open browser tab never ends by itself."""

    signal = 0  # the signal that stopped the server (SIGINT or SIGTERM), for the exit status

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signal = self.signal or int(sig)
        end = getattr(self.config.app.state, "end_streams", None)
        if end is not None:
            try:
                asyncio.get_running_loop().call_soon_threadsafe(end)
            except RuntimeError:
                pass  # no loop running yet: nothing is streaming
        super().handle_exit(sig, frame)
