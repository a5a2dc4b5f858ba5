"""The explorer's web server: static page, a Server-Sent Events feed, POST controls.

Routes (live mode):
    GET  /                 the page (static/index.html); assets under /static/
    GET  /api/info         {"mode": "live"} or {"mode": "replay"}
    GET  /api/state        the session's current state (JSON)
    GET  /api/events       SSE: an `event: state` message on connect and on every change
    POST /api/reset | /api/train | /api/pause | /api/step       the four buttons
    POST /api/config       {"strategy"?, "world_size"?, "mixed_precision"?, "wrap"?,
                            "cpu_offload"?}: change controls, which starts a new run
Replay mode (`--replay runs/NAME`):
    GET  /api/replay       summary of the recorded run
    GET  /api/replay/window?start=S&count=N     events and working set for steps S..S+N-1

Every POST must carry `Content-Type: application/json`: a cross-site form cannot send
that without a CORS preflight, which this server never grants, so another web page open
in the same browser cannot press the buttons. Requests whose Host header is not this
machine's loopback name are refused (DNS rebinding) when bound to loopback. Any request
but GET/HEAD/OPTIONS whose `Origin` is not the server's own, or that the browser marks
`Sec-Fetch-Site: cross-site`/`same-site`, is refused with 403 whatever the bind address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .replay import Replay
from .session import Session

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1, bracketed or not)."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def cross_origin_refusal(method: str, headers: Headers) -> str | None:
    """Why a state-changing request must be refused as cross-origin, or None if it may run.

    The JSON content type already forces a CORS preflight on other pages; this is the
    second lock, and the only one a form/`no-cors` quirk or a future route cannot undo.
    Requests without these headers come from non-browser clients (curl, tests), which no
    web page can make a user's browser send.
    """
    if method in ("GET", "HEAD", "OPTIONS"):
        return None
    site = headers.get("sec-fetch-site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    origin = headers.get("origin")
    if origin is None:
        return None
    scheme, sep, netloc = origin.partition("://")
    host = headers.get("host", "")
    # `null` (sandboxed frames, file:// pages) and any other site never match.
    if not sep or scheme.lower() not in ("http", "https") or netloc.lower() != host.lower():
        return f"request from origin {origin!r} refused: only this page may use the controls"
    return None


class SameOriginControls:
    """403 for POSTs that a page on another origin made the browser send (CSRF)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            reason = cross_origin_refusal(scope["method"], Headers(scope=scope))
            if reason is not None:
                await JSONResponse({"error": reason}, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LoopbackHostOnly:
    """Refuse requests addressed to any host name but the loopback ones."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if not is_loopback(name):
                await Response(f"host {host!r} refused", status_code=421)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _json_body_required(request: Request) -> Response | None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/json":
        return JSONResponse({"error": "POST needs Content-Type: application/json"},
                            status_code=415)
    return None


def _sse(payload: dict) -> str:
    return f"event: state\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(session: Session | None = None, replay: Replay | None = None,
               loopback_only: bool = True) -> Starlette:
    """The ASGI app for a live `session` or a `replay` (exactly one of them)."""
    if (session is None) == (replay is None):
        raise ValueError("create_app needs exactly one of session= or replay=")
    stopping = asyncio.Event()

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def info(request: Request) -> Response:
        return JSONResponse({"mode": "live" if session is not None else "replay"})

    async def state(request: Request) -> Response:
        assert session is not None
        return JSONResponse(session.state())

    async def events(request: Request) -> Response:
        assert session is not None
        queue = session.subscribe()

        async def stream() -> AsyncIterator[str]:
            try:
                yield _sse(session.state())
                while not stopping.is_set():
                    try:
                        item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"  # a comment line: keeps proxies from closing
                        continue
                    if item is None:  # the server is stopping
                        break
                    yield _sse(item)
            finally:
                session.unsubscribe(queue)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    def control(action: str):
        async def handler(request: Request) -> Response:
            assert session is not None
            refused = _json_body_required(request)
            if refused is not None:
                return refused
            if action == "config":
                try:
                    body: Any = await request.json()
                except json.JSONDecodeError as exc:
                    return JSONResponse({"error": f"body is not JSON: {exc}"}, status_code=400)
                if not isinstance(body, dict):
                    return JSONResponse({"error": "body must be a JSON object"},
                                        status_code=400)
                try:
                    await session.configure(body)
                except ValueError as exc:
                    return JSONResponse({"error": str(exc)}, status_code=400)
            elif action == "reset":
                await session.reset()
            elif action == "train":
                await session.train()
            elif action == "pause":
                await session.pause()
            elif action == "step":
                await session.train_step()
            return JSONResponse(session.state())

        return handler

    async def replay_summary(request: Request) -> Response:
        assert replay is not None
        return JSONResponse(replay.summary())

    async def replay_window(request: Request) -> Response:
        assert replay is not None
        try:
            start = int(request.query_params.get("start", replay.steps[0] if replay.steps
                                                 else 0))
            count = int(request.query_params.get("count", 4))
        except ValueError:
            return JSONResponse({"error": "start and count must be integers"}, status_code=400)
        return JSONResponse(replay.window(start, count))

    routes = [Route("/", index), Route("/api/info", info),
              Mount("/static", app=StaticFiles(directory=STATIC), name="static")]
    if session is not None:
        routes += [Route("/api/state", state), Route("/api/events", events)]
        routes += [Route(f"/api/{name}", control(name), methods=["POST"])
                   for name in ("reset", "train", "pause", "step", "config")]
    else:
        routes += [Route("/api/replay", replay_summary),
                   Route("/api/replay/window", replay_window)]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Workers start in the background: the page is served at once and shows progress.
        starting = asyncio.create_task(session.start()) if session is not None else None
        try:
            yield
        finally:
            stopping.set()
            if session is not None:
                session.end_streams()
                if starting is not None and not starting.done():
                    await asyncio.wait([starting], timeout=120)
                await session.close()

    app = Starlette(routes=routes, lifespan=lifespan)

    def end_streams() -> None:
        # uvicorn waits for open responses before the lifespan shutdown runs, and an SSE
        # response never ends by itself: the CLI calls this first (see commands/explore.py).
        stopping.set()
        if session is not None:
            session.end_streams()

    app.state.end_streams = end_streams
    app.add_middleware(SameOriginControls)
    if loopback_only:
        app.add_middleware(LoopbackHostOnly)
    return app
