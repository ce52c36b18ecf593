"""The calculator agent of agent.py as a *remote* agent: it claims episodes from a training run over HTTP.

For `agentrl train` with ``env: {name: agent, mode: remote}`` (remote.yaml). The
agent knows only the run gateway's address and token; each worker loops:

1. ``POST {gateway}/episodes`` (admin token, long poll) -> the task, a session
   ``base_url`` and ``api_key`` (204: no episode yet, ask again);
2. the tool-calling loop of agent.py against ``{base_url}/chat/completions``;
3. ``POST {session_url}/reward`` with its reward, then ``POST {session_url}/close``
   (``{"error": ...}`` when the agent gave up).

Without ``--openai`` it needs nothing but the Python 3.11 standard library
(urllib), so it runs inside the docker sandbox image (python3-minimal):

    python3 remote_agent.py --gateway http://127.0.0.1:8400 --token "$TOKEN" --workers 4
    python3 remote_agent.py --gateway ... --openai   # agent.py's solve() on the openai SDK instead

It exits when the run is over (410) or the gateway stays unreachable for
``--patience-s`` seconds (the run ended, or never started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import MAX_CALLS, SYSTEM, TOOLS, calculator, few_shot, final_number


class RunOver(Exception):
    """The gateway answered 410: the run hands out no more episodes."""


def post(url: str, token: str, body: dict[str, Any], timeout_s: float = 600.0) -> tuple[int, Any]:
    """POST JSON with a bearer token: (status, decoded body or None)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else None


def solve_urllib(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """agent.py's tool loop on plain HTTP: reward 1.0 for the right final number."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *few_shot(),
                                      {"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_CALLS):
        status, body = post(f"{base_url}/chat/completions", api_key,
                            {"model": "policy", "messages": messages, "tools": TOOLS})
        if status != 200:
            raise RuntimeError(f"chat call failed ({status}): {body}")
        message = body["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            try:
                expression = str(json.loads(call["function"]["arguments"]).get("expression", ""))
                result = calculator(expression)
            except (json.JSONDecodeError, AttributeError):
                result = "Error: the arguments are not a JSON object"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    else:
        return 0.0
    answer = final_number(messages[-1].get("content") or "")
    return 1.0 if answer is not None and abs(answer - float(task["answer"])) < 1e-6 else 0.0


def solve_openai(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """agent.py's solve() itself, on an `openai.AsyncOpenAI` client bound to the session."""
    import openai
    from agent import solve

    async def run() -> float:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            return await solve(task, client)

    return asyncio.run(run())


COUNTS_LOCK = threading.Lock()


def count(counts: dict[str, int], key: str) -> None:
    with COUNTS_LOCK:
        counts[key] += 1


def worker(gateway: str, token: str, use_openai: bool, patience_s: float, counts: dict[str, int]) -> None:
    """Claim and play episodes until the run is over."""
    last_contact = time.monotonic()
    solve = solve_openai if use_openai else solve_urllib
    while True:
        try:
            status, episode = post(f"{gateway}/episodes", token, {"wait_s": 10})
        except OSError:  # not up yet, or gone
            if time.monotonic() - last_contact > patience_s:
                return
            time.sleep(0.5)
            continue
        last_contact = time.monotonic()
        if status == 410:
            return
        if status == 204:
            continue
        if status != 200:
            raise RuntimeError(f"POST /episodes answered {status}: {episode}")
        session = episode["session_url"]
        try:
            reward = solve(episode["task"], episode["base_url"], episode["api_key"])
        except Exception as e:  # give the episode back as failed; the run decides (a spent budget: reward 0)
            post(f"{session}/close", token, {"error": f"{type(e).__name__}: {e}"})
            count(counts, "failed")
            continue
        post(f"{session}/reward", token, {"reward": reward})
        post(f"{session}/close", token, {})
        count(counts, "episodes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", required=True, help="the run gateway's root URL, e.g. http://127.0.0.1:8400")
    parser.add_argument("--token", required=True, help="the gateway's admin token (env.gateway.token)")
    parser.add_argument("--workers", type=int, default=4, help="episodes played at once")
    parser.add_argument("--openai", action="store_true", help="use agent.py's solve() on the openai SDK")
    parser.add_argument("--patience-s", type=float, default=60.0, help="exit after this long without the gateway")
    args = parser.parse_args()
    counts = {"episodes": 0, "failed": 0}
    threads = [threading.Thread(target=worker, args=(args.gateway.rstrip("/"), args.token, args.openai,
                                                     args.patience_s, counts)) for _ in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"remote agent done: episodes={counts['episodes']} failed={counts['failed']}", flush=True)


if __name__ == "__main__":
    main()
