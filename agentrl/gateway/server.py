"""The OpenAI-compatible HTTP server (aiohttp) in front of any agentrl engine.

Routes (each `/v1/...` also under `/s/{session}/v1/...`):

- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``;
- ``POST /sessions`` opens a session (its id, key and base URL back);
- ``POST /episodes`` claims an episode a training run offers (remote mode, `agentrl.gateway.episodes`);
- ``POST /s/{session}/reward`` sets the episode's (or one turn's) reward;
- ``POST /s/{session}/close`` ends it (later calls get 409);
- ``GET /health``.

A session is found by its path prefix or, on plain `/v1/...`, by its key as
the bearer token. Every refusal is an OpenAI-shaped JSON error with a 4xx
status; one bad request never disturbs the other sessions. The gateway binds
loopback unless a token is configured (`GatewayConfig`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.gateway import anthropic_api, responses_api
from agentrl.gateway.config import GatewayConfig
from agentrl.gateway.protocol import (
    ChatRequest,
    GatewayError,
    bad,
    chat_response,
    check_sampling,
    completion_response,
    fingerprint,
    parse_chat_request,
)
from agentrl.gateway.session import Backend, Session
from agentrl.gateway.streaming import STREAM_MARKERS, AnswerWriter, ChatWriter, ContentStream, Event

if TYPE_CHECKING:
    from agentrl.gateway.episodes import EpisodeBoard

log = logging.getLogger(__name__)
ENDED_KEPT = 100_000  # ended session ids remembered, so late calls get 409 rather than 404
CLAIM_WAIT_S = 30.0  # how long POST /episodes waits for an episode by default (the agent may ask up to MAX)
MAX_CLAIM_WAIT_S = 120.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CloseHook = Callable[[Session], Awaitable[dict[str, Any]]]


def _error(e: GatewayError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-shaped JSON error; the server keeps serving."""
    try:
        return await handler(request)
    except GatewayError as e:
        return _error(e)
    except web.HTTPRequestEntityTooLarge as e:
        return _error(GatewayError(413, f"the request body is larger than the gateway's limit ({e.text})",
                                   code="body_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(GatewayError(e.status, f"{e.reason}: {request.method} {request.path}"))
    except Exception as e:
        log.exception("gateway: %s %s failed", request.method, request.path)
        return _error(GatewayError(500, f"internal error: {type(e).__name__}: {e}"))


class Gateway:
    """Sessions over one `Backend`, served over HTTP. An async context manager (starts and stops the server).

    With `episodes` (a training run in remote mode) agents claim the run's episodes with
    ``POST /episodes`` and cannot open sessions of their own; without it they open them
    with ``POST /sessions``. A session may carry its own backend (a run's eval sampling).
    """

    def __init__(self, config: GatewayConfig, backend: Backend, *, on_close: CloseHook | None = None,
                 episodes: EpisodeBoard | None = None) -> None:
        self.config = config
        self.backend = backend
        self.on_close = on_close
        self.episodes = episodes
        self.sessions: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.shutdown_timeout_s = 2.0  # stop() waits this long for calls still running

    # -- sessions (in process)

    def open_session(self, id: str | None = None, *, backend: Backend | None = None) -> Session:
        """A new session (on `backend`, else the gateway's); 429 past `max_sessions`, 409 for a used id."""
        if len(self.sessions) >= self.config.max_sessions:
            raise GatewayError(429, f"{len(self.sessions)} sessions are open (gateway.max_sessions)", code="too_many_sessions")
        if id is not None and (id in self.sessions or id in self._ended):
            raise GatewayError(409, f"session {id!r} already exists", code="session_exists")
        session = Session(backend or self.backend, id=id)
        self.sessions[session.id] = session
        self._by_key[session.key] = session
        return session

    def close_session(self, session: Session) -> None:
        """End a session: later calls get 409. Its branches stay with the `Session` object."""
        session.close()
        self.sessions.pop(session.id, None)
        self._by_key.pop(session.key, None)
        self._ended[session.id] = None
        self._ended[session.key] = None
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of one session (path-prefixed)."""
        return f"{self.url}/s/{session.id}/v1"

    # -- server lifecycle

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=self.config.max_body_bytes)
        for prefix in ("", "/s/{sid}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/v1/messages", self._messages)
            app.router.add_post(prefix + "/v1/responses", self._responses)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_post("/sessions", self._open)
        app.router.add_post("/episodes", self._claim)
        app.router.add_post("/s/{sid}/reward", self._reward)
        app.router.add_post("/s/{sid}/close", self._close)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> str:
        """Bind and serve; returns the root URL (``http://host:port``)."""
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=self.shutdown_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else self.config.port
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- auth

    def _bearer(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization", "")
        if header.lower().startswith("bearer "):
            return header[7:].strip() or None
        return request.headers.get("x-api-key") or request.headers.get("api-key") or None

    def _admin(self, request: web.Request) -> None:
        token = self.config.token
        if token and self._bearer(request) != token:
            raise GatewayError(401, "this endpoint needs the gateway token as the bearer token", code="invalid_api_key")

    def _session(self, request: web.Request) -> Session:
        key = self._bearer(request)
        sid = request.match_info.get("sid")
        if sid is None:
            found = self._by_key.get(key or "")
            if found is None:
                if key in self._ended:
                    raise GatewayError(409, "this session key belongs to a session that has ended", code="session_closed")
                raise GatewayError(401, "unknown API key: use a session's key, or its base URL /s/{session}/v1",
                                   code="invalid_api_key")
            return found
        session = self.sessions.get(sid)
        if session is None:
            if sid in self._ended:
                raise GatewayError(409, f"session {sid!r} has ended; open a new one", code="session_closed")
            raise GatewayError(404, f"unknown session {sid!r}", code="unknown_session")
        if key == session.key or (self.config.token and key == self.config.token):
            return session
        if self.config.token:
            raise GatewayError(401, f"session {sid!r} needs its key or the gateway token as the bearer token",
                               code="invalid_api_key")
        if key in self._by_key:
            raise GatewayError(401, f"this key belongs to another session, not {sid!r}", code="invalid_api_key")
        return session

    async def _json(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise bad(f"the body is not valid JSON: {e}") from None

    # -- handlers

    async def _models(self, request: web.Request) -> web.Response:
        if "sid" in request.match_info:
            self._session(request)
        elif self.config.token and self._bearer(request) != self.config.token:
            self._session(request)  # a session key will do; anything else is a 401
        names = list(self.config.model_policies) or [self.config.model_name]
        models = [{"id": name, "object": "model", "created": 0, "owned_by": "agentrl"} for name in names]
        return web.json_response({"object": "list", "data": models})

    def _policy(self, chat: ChatRequest) -> str:
        """Set the policy that samples `chat` (from its `model`, `gateway.model_policies`); the model name its
        reply carries. A model the mapping does not hold is a 404 naming the served ones."""
        chat.policy = self.config.policy_of(chat.model)
        return chat.model if chat.policy is not None else self.config.model_name

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._json(request)
        chat = parse_chat_request(body, session.backend.sampling)
        model = self._policy(chat)
        if chat.stream:
            writer = ChatWriter(model, chat, session.backend.tokenizer.decode)
            return await self.stream_answer(request, session, chat, fingerprint(body), writer)
        result = await session.chat(chat, fingerprint(body))
        return web.json_response(chat_response(result, chat, model, session.backend.tokenizer.decode))

    async def stream_answer(self, request: web.Request, session: Session, chat: ChatRequest, key: str,
                            writer: AnswerWriter) -> web.StreamResponse:
        """An SSE answer sent as the engine samples, in the events of `writer`'s API: content as it decodes,
        calls and ids at the end.

        Nothing is sent before the first tokens, so a refused call is still a plain 4xx JSON error;
        a failure after that ends the stream with the API's error event. A client that hangs up
        cancels the call. The same driver serves every API: only the writer differs.
        """
        backend = session.backend
        decode = backend.tokenizer.decode
        updates: asyncio.Queue[list[int] | None] = asyncio.Queue()
        prompt: list[int] = []

        async def answer() -> Any:
            try:
                return await session.chat(chat, key, on_tokens=updates.put_nowait, on_prompt=prompt.append)
            finally:
                updates.put_nowait(None)

        task = asyncio.ensure_future(answer())
        parse = chat.tool_choice != "none" and not (chat.constraint is not None and chat.constraint.kind == "json")
        content = ContentStream(decode, backend.tokenizer.eos_ids,
                                STREAM_MARKERS.get(backend.parser.name) if parse else (), strip=parse)
        wait_s = backend.generate_timeout_s + 60.0  # the session's own deadlines end the call first
        try:
            async with asyncio.timeout(wait_s):
                ids = await updates.get()
            if ids is None:  # answered without a stream (a retry, or refused): no token was sent yet
                result = await task
                response = await self._sse(request)
                for event in (*writer.opening(result.prompt_len, result), *writer.closing(result, sent="")):
                    await _send(response, event)
                return await _done(response, writer.trailer)
            response = await self._sse(request)
            for event in writer.opening(prompt[0] if prompt else 0, None):
                await _send(response, event)
            while ids is not None:
                piece = content.feed(ids)
                if piece:
                    for event in writer.content(piece):
                        await _send(response, event)
                async with asyncio.timeout(wait_s):
                    ids = await updates.get()
            try:
                result = await task
            except Exception as e:  # the status line is sent: the failure goes in an error event
                error = e if isinstance(e, GatewayError) else GatewayError(500, f"internal error: {type(e).__name__}: {e}")
                await _send(response, writer.failure(error))
                return await _done(response, writer.trailer)
            for event in writer.closing(result, sent=content.sent):
                await _send(response, event)
            return await _done(response, writer.trailer)
        finally:
            if not task.done():
                task.cancel()

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API over the same sessions (`agentrl.gateway.anthropic_api`); its errors
        in that API's shape."""
        try:
            session = self._session(request)
            body = await self._json(request)
            call = anthropic_api.parse_messages_request(body, session.backend.sampling, session.threads)
            model = self._policy(call.chat)
            writer = anthropic_api.MessagesWriter(model, call)
            if call.chat.stream:
                return await self.stream_answer(request, session, call.chat, fingerprint(body), writer)
            result = await session.chat(call.chat, fingerprint(body))
            call.keep(writer.id, result)
            return web.json_response(anthropic_api.message_response(result, model, writer.id, call.chat.stop))
        except GatewayError as e:
            return web.json_response(anthropic_api.error_body(e), status=e.status)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI Responses API over the same sessions (`agentrl.gateway.responses_api`)."""
        session = self._session(request)
        body = await self._json(request)
        call = responses_api.parse_responses_request(body, session.backend.sampling, session.responses)
        writer = responses_api.ResponsesWriter(self._policy(call.chat), call)
        if call.chat.stream:
            return await self.stream_answer(request, session, call.chat, fingerprint(body), writer)
        result = await session.chat(call.chat, fingerprint(body))
        return web.json_response(writer.response(result))

    @staticmethod
    async def _sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._json(request)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        backend = session.backend
        check_sampling(body, backend.sampling)
        prompt = _prompt_ids(body.get("prompt"), backend.tokenizer.encode)
        if body.get("echo"):
            raise bad("echo is not served", "echo")
        if body.get("suffix"):
            raise bad("suffix is not served", "suffix")
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        seed = body.get("seed") if isinstance(body.get("seed"), int) else None
        model = str(body.get("model", ""))
        policy = self.config.policy_of(model)
        completion = await session.complete(prompt, max_tokens, stop, seed, policy)
        decode = backend.tokenizer.decode
        eos = backend.tokenizer.eos_ids
        ids = completion.ids
        text = decode(ids[:-1] if ids and ids[-1] in eos else ids)
        out = completion_response(completion, prompt, text, model if policy is not None else self.config.model_name,
                                  logprobs=body.get("logprobs") is not None,
                                  decode=decode, echo_ids=bool(body.get("return_token_ids")))
        if not body.get("stream"):
            return web.json_response(out)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(out).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _open(self, request: web.Request) -> web.Response:
        self._admin(request)
        if self.episodes is not None:
            raise GatewayError(403, "this gateway serves a training run: claim its episodes with POST /episodes "
                               "(agentrl gateway CONFIG serves sessions agents open themselves)", code="episodes_only")
        body = await self._json(request)
        sid = body.get("id") if isinstance(body, dict) else None
        if sid is not None and (not isinstance(sid, str) or not sid.replace("-", "").replace("_", "").isalnum()):
            raise bad("id must be letters, digits, - or _", "id")
        task = body.get("task", {}) if isinstance(body, dict) else {}
        if not isinstance(task, dict):
            raise bad("task must be a JSON object", "task")
        session = self.open_session(sid)
        session.task = task
        return web.json_response({"id": session.id, "api_key": session.key, "base_url": self.base_url(session)})

    async def _claim(self, request: web.Request) -> web.Response:
        """Hand the oldest offered episode to this agent: its task, session id, key and base URL (204: none came)."""
        self._admin(request)
        if self.episodes is None:
            raise GatewayError(404, "this gateway hands out no episodes (only `agentrl train` with env.mode=remote "
                               "does); open a session with POST /sessions", code="no_episodes")
        body = await self._json(request)
        wait = body.get("wait_s", CLAIM_WAIT_S) if isinstance(body, dict) else None
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_CLAIM_WAIT_S:
            raise bad(f"wait_s must be a number of seconds in [0, {MAX_CLAIM_WAIT_S:g}], got {wait!r}", "wait_s")
        if self.episodes.closed:
            raise GatewayError(410, "the run is over: no more episodes", code="run_ended")
        offer = await self.episodes.claim(float(wait))
        if offer is None:
            if self.episodes.closed:
                raise GatewayError(410, "the run is over: no more episodes", code="run_ended")
            return web.Response(status=204)
        session = offer.session
        return web.json_response({"id": session.id, "api_key": session.key, "base_url": self.base_url(session),
                                  "session_url": f"{self.url}/s/{session.id}", "task": offer.task},
                                 dumps=_dumps_any)

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await self._json(request)
        if not isinstance(body, dict) or isinstance(body.get("reward"), bool) or not isinstance(body.get("reward"), int | float):
            raise bad("send {\"reward\": <number>, \"turn\"?: <call index>, \"breakdown\"?: {name: number}}", "reward")
        turn = body.get("turn")
        if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int)):
            raise bad(f"turn must be an integer call index, got {turn!r}", "turn")
        breakdown = body.get("breakdown") or {}
        if not isinstance(breakdown, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in breakdown.values()
        ):
            raise bad("breakdown must map names to numbers", "breakdown")
        session.set_reward(float(body["reward"]), turn=turn, breakdown={str(k): float(v) for k, v in breakdown.items()})
        return web.json_response({"ok": True})

    async def _close(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if session.closed:
            raise GatewayError(409, f"session {session.id!r} has ended", code="session_closed")
        body = await self._json(request)
        error = body.get("error") if isinstance(body, dict) else None
        if error is not None and not isinstance(error, str):
            raise bad("error must be a string: why the agent gave up on the episode", "error")
        session.agent_error = error or None
        self.close_session(session)
        summary: dict[str, Any] = {"id": session.id, "calls": session.calls,
                                   "branches": len(session.branches) + len(session.token_branches)}
        if self.on_close is not None:
            summary.update(await self.on_close(session))
        return web.json_response(summary)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self.sessions), "time": time.time()})


def _dumps_any(value: Any) -> str:
    """JSON of a task as an agent gets it (a value JSON cannot hold becomes its string)."""
    return json.dumps(value, default=str)


async def _send(response: web.StreamResponse, event: Event) -> None:
    """One SSE event: ``data: {...}`` (with an ``event:`` line when the API names its events)."""
    if isinstance(event, tuple):
        name, data = event
        await response.write(f"event: {name}\n".encode() + b"data: " + json.dumps(data).encode() + b"\n\n")
    else:
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")


async def _done(response: web.StreamResponse, trailer: bytes = b"data: [DONE]\n\n") -> web.StreamResponse:
    if trailer:
        await response.write(trailer)
    await response.write_eof()
    return response


def _prompt_ids(prompt: Any, encode: Callable[[str], list[int]]) -> list[int]:
    """A `/v1/completions` prompt (text, token ids, or a one-item batch of either) as token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return list(prompt)
    raise bad("prompt must be a non-empty string or list of token ids (one prompt per call)", "prompt")
