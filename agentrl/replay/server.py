"""`agentrl replay`: an aiohttp server over one run's store, and the single-page app.

Read-only: the store is opened with SQLite `mode=ro` and every route is GET,
except `POST /api/trajectories/{id}/check` (re-execution against the env,
which writes nothing). Live: every request reads the latest committed data.

Security, because model output is untrusted text and the server may be reached
by other pages in the same browser:
- bound to loopback by default; on any other address every request needs the
  random access token printed at start (`?token=` once, then a cookie);
- on loopback the Host header must be a loopback name (no DNS rebinding);
- the POST needs a custom header, so a cross-site form cannot trigger it;
- static files come from a fixed list loaded at start (no path is ever joined
  from a request), and a strict Content-Security-Policy forbids inline script;
- the app renders every model-produced string with `textContent`, never HTML.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import ipaddress
import json
import secrets
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.env import Env
from agentrl.replay.overview import overview_layout
from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.replay.reexec import default_env_factory, recheck
from agentrl.replay.tokens import TokenDecoder, json_safe, token_view
from agentrl.store.summary import final_answer, prompt_layout, question

STATIC_FILES = {  # URL path -> (package file, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
}
TOKEN_COOKIE = "agentrl_replay_token"
CHECK_HEADER = "X-Agentrl-Request"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
TOKENIZER_LOAD_TIMEOUT_S = 180.0
"""How long a trajectory request waits for the run's tokenizer (importing transformers and loading it
can take a minute on a busy CPU); loading starts with the server."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class ReplaySettings:
    """How the app serves a store. `token` None means no token is asked for."""

    store_path: Path
    token: str | None = None
    allowed_hosts: tuple[str, ...] | None = None  # Host header values accepted; None = any
    tokenizer: str | None = None
    check_timeout_s: float = 60.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_urlsafe(24)


def settings_for_bind(store_path: Path, host: str, port: int, *, token: str | None = None,
                      tokenizer: str | None = None) -> ReplaySettings:  # fmt: skip
    """Loopback: no token, Host header pinned. Any other address: a token (a new random one if None)."""
    if is_loopback(host):
        hosts = tuple(f"{name}:{port}" for name in LOOPBACK_NAMES)
        return ReplaySettings(store_path, token=token, allowed_hosts=hosts, tokenizer=tokenizer)
    return ReplaySettings(store_path, token=token or new_token(), allowed_hosts=None, tokenizer=tokenizer)


class ReplayApp:
    """Routes and state of one replay server (one read-only store connection)."""

    def __init__(self, settings: ReplaySettings, *, make_env: Callable[[str], Env] | None = None) -> None:
        self.settings = settings
        self.queries = TrajectoryQueries.open(settings.store_path)
        self.store = self.queries.store
        self._make_env = make_env
        self._decoder: asyncio.Future[TokenDecoder] | None = None
        self._check_lock = asyncio.Lock()
        package = importlib.resources.files("agentrl.replay") / "static"
        self._static = {
            url: ((package / name).read_bytes(), ctype) for url, (name, ctype) in STATIC_FILES.items()
        }

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        for url in STATIC_FILES:
            app.router.add_get(url, self._static_file)
        app.router.add_get("/api/run", self._run)
        app.router.add_get("/api/metrics", self._metrics)
        app.router.add_get("/api/trajectories", self._list)
        app.router.add_get("/api/count", self._count)
        app.router.add_get("/api/trajectories/{id}", self._trajectory)
        app.router.add_get("/api/groups/{id}", self._group)
        app.router.add_post("/api/trajectories/{id}/check", self._check)
        app.on_startup.append(self._start_loading_tokenizer)
        app.on_cleanup.append(self._close)
        return app

    async def _start_loading_tokenizer(self, _app: web.Application) -> None:
        self._token_decoder()

    async def _close(self, _app: web.Application) -> None:
        self.queries.close()

    # -- middleware ----------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        s = self.settings
        if s.allowed_hosts is not None and request.host not in s.allowed_hosts:
            return _error(403, f"Host {request.host!r} is not allowed (open http://{s.allowed_hosts[1]}/)")
        if s.token is not None:
            given = (
                request.query.get("token")
                or request.headers.get("X-Agentrl-Token")
                or request.cookies.get(TOKEN_COOKIE)
            )
            if not given or not hmac.compare_digest(given.encode(), s.token.encode()):
                return _error(401, "an access token is required: open the URL printed by `agentrl replay`")
            if "token" in request.query and request.method == "GET" and request.path == "/":
                # keep the token out of the address bar and history: cookie, then redirect
                redirect = web.Response(status=302, headers={"Location": "/"})
                redirect.set_cookie(TOKEN_COOKIE, s.token, httponly=True, samesite="Strict")
                _secure(redirect)
                return redirect
        if request.method == "POST" and request.headers.get(CHECK_HEADER) != "check":
            return _error(403, f"POST needs the header {CHECK_HEADER}: check")
        response: web.StreamResponse
        try:
            response = await handler(request)
        except web.HTTPException as e:
            if e.status == 405:
                response = _error(405, "this server is read-only")
            elif e.status == 404:
                response = _error(404, "not found")
            else:
                response = web.Response(status=e.status, text=e.text, content_type=e.content_type)
        _secure(response)
        return response

    # -- static --------------------------------------------------------------

    async def _static_file(self, request: web.Request) -> web.Response:
        body, ctype = self._static[request.path]
        return web.Response(body=body, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})

    # -- API -----------------------------------------------------------------

    async def _db(self, fn: Callable[[], Any]) -> Any:
        """Store reads run in a thread so a slow query never stalls the event loop."""
        async with asyncio.timeout(30):
            return await asyncio.to_thread(fn)

    async def _run(self, request: web.Request) -> web.Response:
        def read() -> dict[str, Any]:
            q = self.queries
            return {
                "path": str(q.store.path),
                "config": q.store.run_config(),
                "count": q.store.count(),
                "latest": (q.query(limit=1) or [{}])[0].get("seq"),
                "filters": {k: q.distinct(k) for k in ("env", "status", "error_class", "tool")}
                | {"policy": run_policies(q)},
            }

        return _json(await self._db(read))

    async def _metrics(self, request: web.Request) -> web.Response:
        def read() -> dict[str, Any]:
            metrics, steps = self.store.metrics(), self.queries.step_rewards()
            return {
                "metrics": [{"step": s, "values": v} for s, v in metrics],
                "steps": steps,
                "layout": overview_layout(metrics, steps),
            }

        return _json(await self._db(read))

    def _filters(self, request: web.Request) -> TrajectoryFilter:
        try:
            return TrajectoryFilter.from_params(request.query)
        except ValueError as e:
            raise _bad_request(str(e)) from None

    async def _list(self, request: web.Request) -> web.Response:
        filters = self._filters(request)
        q = request.query
        try:
            limit = int(q.get("limit", "50"))
            offset = int(q.get("offset", "0"))
        except ValueError:
            raise _bad_request("limit and offset must be integers") from None

        def read() -> dict[str, Any]:
            items, cursor = self.queries.page(
                filters,
                order=q.get("order", "newest"),
                limit=limit,
                offset=offset,
                cursor=q.get("cursor") or None,
            )
            return {"items": items, "next_cursor": cursor}

        try:
            return _json(await self._db(read))
        except ValueError as e:
            raise _bad_request(str(e)) from None

    async def _count(self, request: web.Request) -> web.Response:
        filters = self._filters(request)
        return _json({"count": await self._db(lambda: self.queries.count(filters))})

    async def _trajectory(self, request: web.Request) -> web.Response:
        tid = request.match_info["id"]

        try:
            async with asyncio.timeout(TOKENIZER_LOAD_TIMEOUT_S):
                decoder = await asyncio.shield(self._token_decoder())
        except TimeoutError:
            return _error(503, "the run's tokenizer is still loading: try again in a moment")

        def read() -> dict[str, Any]:
            record = self.store.get_record(tid)
            t = record.trajectory
            d = t.to_dict()
            for key in ("token_ids", "loss_mask", "logprobs", "versions"):
                d.pop(key)
            return {
                "trajectory": d,
                "step": record.step,
                "status": record.status,
                "seq": record.seq,
                "created_at": record.created_at,
                "layout": prompt_layout(t).to_dict(),
                "tokens": token_view(t, decoder),
            }

        try:
            return _json(await self._db(read))
        except KeyError:
            return _error(404, "no such trajectory")

    def _token_decoder(self) -> asyncio.Future[TokenDecoder]:
        """The run's token decoder, loaded once in a thread (started when the server starts)."""
        if self._decoder is None:

            def load() -> TokenDecoder:
                return TokenDecoder.for_run(self.store.run_config(), self.settings.tokenizer)

            self._decoder = asyncio.ensure_future(asyncio.to_thread(load))
        return self._decoder

    async def _group(self, request: web.Request) -> web.Response:
        gid = request.match_info["id"]

        def read() -> dict[str, Any] | None:
            members = self.queries.group_members(gid)
            if not members:
                return None
            out = []
            asked = ""
            for m in members:
                t = self.store.get_trajectory(str(m["id"]))
                final = final_answer(t)
                asked = asked or question(t)
                stats = t.info.get("token_stats") if isinstance(t.info.get("token_stats"), dict) else {}
                adv = t.info.get("advantage")
                if adv is None and isinstance(stats, dict) and isinstance(stats.get("advantages"), list):
                    adv = next((a for a, k in zip(stats["advantages"], t.loss_mask, strict=False) if k), None)
                seat = {k: t.info[k] for k in ("agent", "outcome") if isinstance(t.info.get(k), str)}
                out.append(
                    {**m, **seat, "final": final, "reward_breakdown": t.reward_breakdown, "advantage": adv}
                )
            return {"group": self.queries.group(gid), "question": asked, "members": out}

        data = await self._db(read)
        return _error(404, "no such group") if data is None else _json(data)

    async def _check(self, request: web.Request) -> web.Response:
        tid = request.match_info["id"]
        try:
            traj = await self._db(lambda: self.store.get_trajectory(tid))
        except KeyError:
            return _error(404, "no such trajectory")
        config = await self._db(self.store.run_config)
        async with self._check_lock:  # one re-execution at a time
            try:
                make_env = self._make_env or default_env_factory(config)
            except Exception as e:
                return _json(
                    {"trajectory_id": tid, "ok": False, "error": f"{type(e).__name__}: {e}", "steps": []}
                )
            report = await recheck(traj, make_env, timeout_s=self.settings.check_timeout_s)
        return _json(report.to_dict())


def run_policies(queries: TrajectoryQueries) -> list[str]:
    """The policies the list can be filtered by: those of the run config's `policies:` and those in the
    stored trajectories (empty for a single-policy run)."""
    config = queries.store.run_config() or {}
    configured = config.get("policies")
    names = set(configured) if isinstance(configured, dict) else set()
    return sorted(names | set(queries.distinct("policy")))


def _secure(response: web.StreamResponse) -> None:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers.setdefault("Cache-Control", "no-store")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(json_safe(data), allow_nan=False, ensure_ascii=False),
        status=status,
        content_type="application/json",
    )


def _error(status: int, message: str) -> web.Response:
    response = _json({"error": message}, status=status)
    _secure(response)
    return response


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=json.dumps({"error": message}),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def create_app(settings: ReplaySettings, *, make_env: Callable[[str], Env] | None = None) -> web.Application:
    """The aiohttp application (used by `serve` and by tests)."""
    return ReplayApp(settings, make_env=make_env).build()


async def serve(
    settings: ReplaySettings,
    host: str,
    port: int,
    *,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    make_env: Callable[[str], Env] | None = None,
) -> None:
    """Serve until `stop` is set (or forever). `on_ready` gets the URL to open."""
    runner = web.AppRunner(create_app(settings, make_env=make_env), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}/"
        if settings.token:
            url += f"?token={settings.token}"
        if settings.allowed_hosts is not None and port == 0:
            settings.allowed_hosts = tuple(f"{name}:{bound}" for name in LOOPBACK_NAMES)
        if on_ready:
            on_ready(url)
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


@contextmanager
def serve_in_thread(store_path: Path, *, start_timeout_s: float = 60.0) -> Iterator[str]:
    """`agentrl replay` over STORE_PATH on a free loopback port, in a background thread; yields its URL.

    For scripts and tests that drive the real server from synchronous code (a browser, screenshots).
    The server stops and its thread is joined when the block ends.
    """
    settings = settings_for_bind(store_path, "127.0.0.1", 0)
    loop, stop, ready = asyncio.new_event_loop(), asyncio.Event(), threading.Event()
    urls: list[str] = []

    def on_ready(url: str) -> None:
        urls.append(url.rstrip("/"))
        ready.set()

    thread = threading.Thread(
        target=lambda: loop.run_until_complete(serve(settings, "127.0.0.1", 0, on_ready=on_ready, stop=stop)),
        name="agentrl-replay",
        daemon=True,
    )
    thread.start()
    try:
        if not ready.wait(start_timeout_s):
            raise RuntimeError(
                f"the replay server over {store_path} did not start within {start_timeout_s:g}s"
            )
        yield urls[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
