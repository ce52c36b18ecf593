"""Remake the inspector screenshots of README.md and docs/replay.md from a real run.

    python scripts/replay_screenshots.py                          # trains RUN first (about 20 min on 2 CPU cores)
    python scripts/replay_screenshots.py --run runs/screens/calculator   # reuse a run of examples/calculator.yaml

The run is the README's main job (`agentrl train examples/calculator.yaml`:
SmolLM2-135M-Instruct, two worked demonstrations in every prompt, the
calculator tool) shortened by `OVERRIDES` to 6 steps with a held-out
evaluation on 16 tasks every 2 steps. The pages are shot in Chromium (Debian
`chromium`, driven by Playwright; `.ci/setup_browser.sh`) at 1280x820 and
written to docs/replay-{overview,list,conversation,tokens,group}.png.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.replay.server import serve_in_thread
from agentrl.store.trajectory_store import resolve_store_path, upgrade_store

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OVERRIDES = (
    "run.steps=8",
    "run.eval_every=2",
    "run.eval_tasks=16",
    "run.save_every=8",
    "run.loggers=[jsonl]",
)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
VIEWPORT: Any = {"width": 1280, "height": 820}  # playwright ViewportSize


def train(out_dir: Path) -> Path:
    """`agentrl train examples/calculator.yaml` + OVERRIDES into OUT_DIR/calculator."""
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(ROOT / "examples" / "calculator.yaml"),
           f"run.output_dir={out_dir}", "run.name=calculator", *OVERRIDES]  # fmt: skip
    print("training:", " ".join(cmd[2:]), flush=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return out_dir / "calculator"


def pick(run: Path) -> tuple[str, str, int]:
    """A trajectory to show (a late step's, rewarded, with a tool call), its group (one with mixed rewards
    if there is one) and its least likely sampled token in the first turn (to hover in the token view)."""
    with TrajectoryQueries.open(run) as q:
        rows = q.query(TrajectoryFilter(status="trained", reward_min=1.0), order="newest", limit=200)
        rows = [r for r in rows if int(str(r["num_tool_calls"])) >= 1] or rows
        if not rows:
            raise SystemExit(f"{run}: no trained trajectory with reward 1 to show")
        groups = [str(r["group_id"]) for r in rows]
        mixed = next((g for g in groups if len({m["reward"] for m in q.group_members(g)}) > 1), groups[0])
        shown = str(next(r for r in rows if r["group_id"] == mixed)["id"])
        turn = q.store.get_trajectory(shown).turns[0]
        logprobs = q.store.get_trajectory(shown).logprobs
        return shown, mixed, min(range(turn.start, turn.end), key=lambda i: logprobs[i])


def screenshots(run: Path, docs: Path = DOCS) -> list[Path]:
    """Shoot the five views of RUN into DOCS/replay-*.png; returns the files."""
    from playwright.sync_api import sync_playwright

    old = upgrade_store(run)
    if old is not None:
        print(f"upgraded {resolve_store_path(run)} from store schema {old}")
    traj_id, group_id, token_index = pick(run)
    out: list[Path] = []

    def shoot(page: Any, name: str) -> None:
        path = docs / f"replay-{name}.png"
        page.screenshot(path=str(path))
        print("wrote", path, flush=True)
        out.append(path)

    with serve_in_thread(resolve_store_path(run)) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport=VIEWPORT).new_page()

        page.goto(url + "/")
        page.wait_for_selector("#charts .chart svg path.line")
        shoot(page, "overview")

        page.goto(url + "/#/list?status=trained")
        page.wait_for_selector("#traj-table tbody tr")
        shoot(page, "list")

        page.goto(url + f"/#/t/{traj_id}")
        page.wait_for_selector("#conversation .msg")
        page.evaluate(
            "window.scrollBy(0, document.querySelector('.playback.panel').getBoundingClientRect().top - 8)"
        )
        shoot(page, "conversation")

        page.goto(url + f"/#/t/{traj_id}?tab=tokens")
        page.wait_for_selector("#tokens span.tok")
        page.select_option("#colour-by", "logprobs")
        token = page.locator(f"#tokens span.tok[data-i='{token_index}']")
        # room below the last line, so the model's first turn can sit mid-screen with the tooltip under it
        page.evaluate("document.getElementById('app').style.paddingBottom = '420px'")
        token.evaluate("el => { el.scrollIntoView({block: 'start'}); window.scrollBy(0, -300); }")
        token.hover()
        shoot(page, "tokens")

        page.goto(url + f"/#/g/{group_id}")
        page.wait_for_selector("#siblings .sibling")
        shoot(page, "group")
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, help="an existing run directory (default: train one into --out)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "screens", help="where to train the run")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where the PNGs go")
    args = parser.parse_args()
    run = args.run or train(args.out)
    screenshots(run, args.docs)


if __name__ == "__main__":
    main()
