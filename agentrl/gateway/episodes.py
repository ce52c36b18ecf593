"""Episodes a training run hands to remote agents: the run-scoped gateway of ``env: {name: agent, mode: remote}``.

The rollout manager drives every episode as for any env; in remote mode the
`agent` env *offers* the episode here instead of calling agent code itself.
An agent in another process or container, knowing only the gateway's address
and token, claims it with ``POST /episodes`` (long poll: it gets the task, a
session base URL and key, or 204 when none came in time), makes its OpenAI
calls, posts the reward and closes the session. The env waits for the claim
(`claim_timeout_s`) and then for the close (`rollout.episode_timeout_s`);
cancellation withdraws the offer and ends the session, so the agent's next
call gets a 409.

`RemoteAgents` owns one `Gateway` (started on the first offer, stopped when the
run's resources close) and one `EpisodeBoard` (offers waiting for agents,
agents waiting for offers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import AgentrlError, ConfigError
from agentrl.gateway.config import GatewayConfig
from agentrl.gateway.server import Gateway
from agentrl.gateway.session import Backend, Session
from agentrl.types import JSON

log = logging.getLogger(__name__)
UNCLAIMED_WARN_EVERY_S = 60.0


class NoRemoteAgents(AgentrlError):
    """Remote mode: no agent claimed any episode for several claim windows in a row; the run stops."""


@dataclass(eq=False)
class Offer:
    """One episode waiting for (or held by) a remote agent."""

    session: Session
    task: dict[str, JSON]
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class EpisodeBoard:
    """Offers in order of arrival; agents that poll while none waits get the next one first."""

    def __init__(self) -> None:
        self._offers: deque[Offer] = deque()
        self._agents: deque[asyncio.Future[Offer | None]] = deque()
        self._by_session: dict[str, Offer] = {}
        self.closed = False
        self.claims = 0  # episodes handed to agents so far
        self.last_claim_at = time.monotonic()  # when the last one was (or when the board opened)

    def offer(self, session: Session, task: dict[str, JSON]) -> Offer:
        """Put an episode up for agents; the caller waits on `claimed` / `ended` and withdraws it at the end."""
        offer = Offer(session, task)
        self._by_session[session.id] = offer
        while self._agents:
            agent = self._agents.popleft()
            if not agent.done():
                agent.set_result(offer)
                self._claimed(offer)
                return offer
        self._offers.append(offer)
        return offer

    async def claim(self, wait_s: float) -> Offer | None:
        """The oldest waiting offer, waiting up to `wait_s` for one; None when none came (or the board closed)."""
        while self._offers:
            offer = self._offers.popleft()
            if not offer.session.closed:
                self._claimed(offer)
                return offer
        if self.closed:
            return None
        agent: asyncio.Future[Offer | None] = asyncio.get_running_loop().create_future()
        self._agents.append(agent)
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(agent)
        except TimeoutError:
            pass
        except asyncio.CancelledError:  # the agent hung up: an offer handed to it goes back to the front
            handed = agent.result() if agent.done() and not agent.cancelled() else None
            if handed is not None:
                handed.claimed.clear()
                self._offers.appendleft(handed)
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._agents.remove(agent)
        if agent.done() and not agent.cancelled():  # also when the offer came as the wait ran out
            return agent.result()
        agent.cancel()
        return None

    def _claimed(self, offer: Offer) -> None:
        offer.claimed.set()
        self.claims += 1
        self.last_claim_at = time.monotonic()

    def withdraw(self, offer: Offer) -> None:
        """Take an offer off the board (its episode ended, failed or was cancelled)."""
        with contextlib.suppress(ValueError):
            self._offers.remove(offer)
        self._by_session.pop(offer.session.id, None)
        offer.ended.set()

    def session_closed(self, session: Session) -> None:
        """The agent closed its session: the episode's driver stops waiting."""
        offer = self._by_session.get(session.id)
        if offer is not None:
            offer.ended.set()

    def close(self) -> None:
        """No more offers: agents waiting are answered (none), later claims get none."""
        self.closed = True
        for agent in self._agents:
            if not agent.done():
                agent.set_result(None)
        self._agents.clear()

    @property
    def waiting(self) -> int:
        """Offers not yet claimed."""
        return len(self._offers)


class RemoteAgents:
    """The gateway of a training run in remote mode: one server, started on first use, closed with the run."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.board = EpisodeBoard()
        self.gateway: Gateway | None = None
        self._starting = asyncio.Lock()
        self.unclaimed = 0  # episodes no agent claimed in time, this run
        self._warned_at = -UNCLAIMED_WARN_EVERY_S

    async def start(self, backend: Backend) -> Gateway:
        """The running gateway (started now with `backend` as its default when it is not running yet)."""
        async with self._starting:
            if self.gateway is None:
                gateway = Gateway(self.config, backend, episodes=self.board, on_close=self._on_close)
                try:
                    await gateway.start()
                except OSError as e:
                    await gateway.stop()
                    raise ConfigError(f"env.gateway: cannot serve remote agents on {self.config.host}:"
                                      f"{self.config.port} ({e}); choose another gateway.port") from e
                self.gateway = gateway
                log.warning("agentrl gateway for remote agents: %s (claim episodes with POST /episodes)", gateway.url)
            return self.gateway

    def give_up(self, claim_timeout_s: float, windows: int) -> NoRemoteAgents | None:
        """The error that stops the run when no agent claimed anything for `windows` claim windows in a row
        (None while one may still come; `windows` 0 never gives up). It says where agents should claim."""
        idle = time.monotonic() - self.board.last_claim_at
        if windows <= 0 or idle < windows * claim_timeout_s:
            return None
        url = self.gateway.url if self.gateway is not None else f"http://{self.config.host}:{self.config.port}"
        token = ("with the bearer token of env.gateway.token" if self.config.token else
                 "with any bearer token (a loopback gateway without env.gateway.token)")
        who = ("no remote agent connected" if self.board.claims == 0 else
               f"no remote agent claimed an episode for {idle:.0f}s (after {self.board.claims} claimed)")
        return NoRemoteAgents(
            f"{who}: {self.unclaimed} episode(s) went unclaimed, {windows} claim windows of "
            f"env.claim_timeout_s={claim_timeout_s:g}s in a row, so the run stops. Agents claim episodes with "
            f"POST {url}/episodes {token} (examples/openai-agent/remote_agent.py --gateway {url} --token ...); "
            "raise env.claim_give_up_after (0 = wait forever) when agents start late"
        )

    def note_unclaimed(self) -> None:
        """Count an episode no agent claimed; say so on the log (at most every `UNCLAIMED_WARN_EVERY_S`)."""
        self.unclaimed += 1
        now = time.monotonic()
        if now - self._warned_at >= UNCLAIMED_WARN_EVERY_S:
            self._warned_at = now
            url = self.gateway.url if self.gateway is not None else "(not started)"
            log.warning("remote agents: %d episode(s) went unclaimed so far, %d wait now: are agents claiming "
                        "from %s/episodes?", self.unclaimed, self.board.waiting, url)

    async def _on_close(self, session: Session) -> dict[str, Any]:
        self.board.session_closed(session)
        return {}

    async def close(self) -> None:
        """Stop handing out episodes and stop the server (the run is over)."""
        self.board.close()
        gateway, self.gateway = self.gateway, None
        if gateway is not None:
            await gateway.stop()
