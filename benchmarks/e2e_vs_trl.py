"""End to end: agentrl async (staleness 1) vs agentrl sync (staleness 0) vs TRL's GRPOTrainer.

The workload is read from a run config (default `examples/calculator.yaml`, plus
`a.b=c` overrides), never hard-coded: the same model weights, the same training
tasks in the same order, the same prompts (token-identical: few-shot demos and
tool description included), group size, completions per optimizer step,
turns, new tokens per turn, sampling, learning rate, precision and LoRA.

- agentrl runs the real training path (`agentrl.run.loop.train`) with eval off and
  no warm start, once at `rollout.max_staleness=1` and once at `0`.
- TRL runs `GRPOTrainer` (multi-turn tool calling with its own `tools=` loop,
  plain transformers `generate`, no vLLM, beta=0, fp32) on the same prompts;
  the reward is the env's own `score()`. The model's chat template is only
  extended to render `tool_calls` in Hermes format, exactly as agentrl renders
  them for a template that lacks them (GRPOTrainer refuses such a template),
  and TRL's Qwen3/Hermes response parser reads the calls. Prompts TRL would
  tokenize differently from agentrl are counted and shown (`prompt_mismatches`).
  TRL runs fp32 by default: its bf16 mode autocasts the lm_head matmul too,
  which on this CPU is several times slower than fp32 (`--trl-precision`).

Each system runs in its own subprocess (fresh process, no shared state), one
after the other. Seconds per optimizer step = wall time between the end of the
warm-up steps and the end of the last step, divided by the measured steps.
Generated tokens/s = policy-sampled tokens (tool output excluded) of the
measured steps' batches over that same wall time.

TRL is not a dependency of agentrl: install it with `pip install "trl==1.16.0"`
(it leaves torch and transformers as they are), or `pip install -e ".[bench]"`.

    python benchmarks/e2e_vs_trl.py [CONFIG] [a.b=c ...] [--steps 3] [--warmup 2]

Summary line: speedup_vs_trl=<trl s/step / async s/step> async_vs_sync=<sync s/step / async s/step> ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from agentrl.config import RunConfig, load_config
from agentrl.trainers.config import TrainerConfig  # pydantic only, no torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "calculator.yaml"
TRL_VERSION = "1.16.0"
SYSTEMS = ("agentrl_async", "agentrl_sync", "trl")


# --------------------------------------------------------------------------- arguments and workload


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="run config YAML")
    p.add_argument("overrides", nargs="*", default=[], help="a.b=c overrides of the run config")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps per system")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="optimizer steps run first and not measured (2: the async run's second batch is sampled during the "
        "slow first step, so step 2 is not steady state either)",
    )
    p.add_argument("--async-staleness", type=int, default=1, help="max_staleness of the async agentrl run")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"
    )
    p.add_argument(
        "--trl-precision",
        choices=("match", "fp32", "bf16"),
        default="fp32",
        help="TRL's training precision (default fp32: TRL's bf16 autocasts the lm_head matmul too, which is "
        "several times slower on CPU); 'match' follows trainer.dtype",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per system")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_intermixed_args(argv)
    # a lone `a.b=c` lands in `config`; move it to the overrides
    if "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides = [args.config, *args.overrides]
        args.config = str(DEFAULT_CONFIG)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first step loads and compiles; it is never measured)")
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; allowed: {', '.join(SYSTEMS)}")
    return args


def load_workload(args: argparse.Namespace, *extra: str) -> RunConfig:
    """The user's run config with the benchmark's changes: steps, no eval, no warm start, JSONL only
    (and `extra` overrides last)."""
    return load_config(Path(args.config), [*args.overrides, *_fixed_overrides(args), *extra])


def _fixed_overrides(args: argparse.Namespace) -> list[str]:
    total = args.warmup + args.steps
    return [
        f"run.steps={total}",
        "run.eval_every=0",
        f"run.save_every={total}",
        "run.loggers=[jsonl]",
        "warm_start.steps=0",
    ]


@dataclass(frozen=True)
class Prompt:
    """One training task as both systems see it."""

    task: dict[str, Any]
    messages: list[dict[str, Any]]  # chat messages for TRL (tools and calls inlined as agentrl renders them)
    agentrl_ids: list[int]  # agentrl's first-turn prompt ids for this task


def build_prompts(config: RunConfig, n: int) -> list[Prompt]:
    """The first `n` tasks of agentrl's task stream, with agentrl's exact first-turn prompts.

    agentrl's HF chat tokenizer puts the tool description into the system
    message and writes tool calls into assistant content (Hermes format) when
    the model's chat template cannot; the same preprocessing is applied here
    so TRL renders the same text with the same template.
    """
    from agentrl.chat.conversation import (
        Budgets,
        Conversation,
        HFChatTokenizer,
        with_calls_in_content,
        with_tools_system_prompt,
    )
    from agentrl.engines.models import resolve_model
    from agentrl.rollout.task_stream import TaskStream

    tokenizer = HFChatTokenizer.from_pretrained(resolve_model(config.model.path))
    env = config.registry().create_env(config.env.name, config.env.params)
    stream = TaskStream(list(env.tasks("train")), seed=config.run.seed)
    schemas = env.prompt_tools()  # None when the env keeps tool schemas out of the prompt
    prompts = []
    for position in range(n):
        task = stream.task_at(position)
        opening, _ = asyncio.run(env.reset(task, seed=config.run.seed))
        conv = Conversation(
            tokenizer, opening, tools=schemas, budgets=Budgets.from_rollout_config(config.rollout)
        )
        messages = opening
        if schemas and not tokenizer.tools_in_template:
            messages = with_tools_system_prompt(messages, schemas)
        if not tokenizer.calls_in_template:
            messages = with_calls_in_content(messages)
        chat = (
            [{"role": m.role, "content": m.content} for m in messages]
            if not tokenizer.calls_in_template
            else [m.to_chat() for m in messages]
        )
        prompts.append(Prompt(task=dict(task), messages=chat, agentrl_ids=list(conv.prompt_ids)))
    return prompts


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    system: str
    s_per_step: float
    tokens_per_s: float
    steps: int
    completions_per_step: float
    reward_mean: float
    note: str = ""


def measure(step_end_times: Sequence[float], tokens: Sequence[float], warmup: int) -> tuple[float, float]:
    """(seconds per step, tokens/s) over the steps after `warmup`.

    `step_end_times[i]` is when step i+1 ended; `tokens[i]` its generated tokens.
    The clock starts when the last warm-up step ends.
    """
    if warmup < 1 or len(step_end_times) <= warmup or len(tokens) != len(step_end_times):
        raise ValueError(
            f"need more than warmup={warmup} (>= 1) finished steps with token counts, got "
            f"{len(step_end_times)} times and {len(tokens)} counts"
        )
    wall = step_end_times[-1] - step_end_times[warmup - 1]
    return wall / (len(step_end_times) - warmup), sum(tokens[warmup:]) / wall


# --------------------------------------------------------------------------- agentrl


def run_agentrl(args: argparse.Namespace, staleness: int) -> Result:
    from agentrl.run.loop import train

    with tempfile.TemporaryDirectory(prefix="e2e-vs-trl-") as tmp:
        config = load_workload(args, f"rollout.max_staleness={staleness}", f"run.output_dir={tmp}")
        run_dir = asyncio.run(train(config))
        rows = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
    rows = sorted((r for r in rows if r["step"] >= 1), key=lambda r: r["step"])
    s_per_step, tok_s = measure(
        [r["time"] for r in rows], [r.get("batch/sampled_tokens", 0.0) for r in rows], args.warmup
    )
    measured = rows[args.warmup :]
    return Result(
        system=f"agentrl_{'async' if staleness else 'sync'}",
        s_per_step=s_per_step,
        tokens_per_s=tok_s,
        steps=len(measured),
        completions_per_step=_mean([r.get("batch/trajectories", 0.0) for r in measured]),
        reward_mean=_mean([r.get("reward/mean", 0.0) for r in measured]),
        note=f"max_staleness={staleness}",
    )


# --------------------------------------------------------------------------- TRL


def trainer_config(config: RunConfig) -> TrainerConfig:
    """The run's validated `torch` trainer config (the only trainer the TRL mapping knows)."""
    tr = config.trainer.config
    if not isinstance(tr, TrainerConfig):
        raise ValueError(
            f"trainer.name={config.trainer.name!r}: the TRL comparison maps the `torch` trainer only"
        )
    return tr


def trl_settings(config: RunConfig, prompts: Sequence[Prompt], precision: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments equivalent to the agentrl run config."""
    ro, tr = config.rollout, trainer_config(config)
    total = ro.group_size * ro.groups_per_step
    longest_prompt = max(len(p.agentrl_ids) for p in prompts)
    completion_budget = max(1, ro.max_total_tokens - longest_prompt)
    est_len = longest_prompt + min(completion_budget, ro.max_turns * ro.max_new_tokens_per_turn)
    # TRL pads each micro-batch; take the most sequences per forward pass that agentrl's token budget allows
    micro = max(
        [b for b in range(1, total + 1) if total % b == 0 and b * est_len <= tr.micro_batch_tokens] or [1]
    )
    loss = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum": "dr_grpo"}[tr.loss_agg]
    bf16 = tr.dtype == "bf16" if precision == "match" else precision == "bf16"
    sampling = ro.sampling
    return {
        "num_generations": ro.group_size,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": total // micro,  # one optimizer step per `total` completions
        "max_completion_length": completion_budget,
        "generation_kwargs": {"max_new_tokens": ro.max_new_tokens_per_turn},  # per turn, as agentrl
        "max_tool_calling_iterations": ro.max_turns - 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "learning_rate": tr.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": tr.weight_decay,
        "adam_beta1": tr.betas[0],
        "adam_beta2": tr.betas[1],
        "max_grad_norm": tr.max_grad_norm or 0.0,
        "beta": 0.0,
        "epsilon": tr.clip_low,
        "epsilon_high": tr.clip_high,
        "loss_type": loss,
        "scale_rewards": "none" if tr.advantage == "dr_grpo" else "group",
        "num_iterations": tr.epochs,
        "bf16": bf16,
        "gradient_checkpointing": tr.gradient_checkpointing,
        "shuffle_dataset": False,  # the dataset is already in agentrl's task order
        "seed": config.run.seed,
    }


def run_trl(args: argparse.Namespace) -> Result:
    trl = _require_trl()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]
    from trl.chat_template_utils import qwen3_template

    from agentrl.engines.models import resolve_model
    from agentrl.types import Message

    config = load_workload(args)
    ro = config.rollout
    total_steps = args.warmup + args.steps
    prompts = build_prompts(config, total_steps * ro.groups_per_step)
    settings = trl_settings(config, prompts, args.trl_precision)
    model_path = resolve_model(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if getattr(tokenizer, "response_template", None) is None:
        tokenizer.response_template = (
            qwen3_template  # Hermes <tool_call> JSON after "<|im_start|>assistant\n"
        )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # fp32 master weights

    tokenizer.chat_template = with_hermes_calls(tokenizer.chat_template)
    env: Any = config.registry().create_env(config.env.name, config.env.params)  # a ToolEnv: has score()
    tools = [t.fn for t in env.tools]
    mismatched = _prompt_mismatches(tokenizer, tools, prompts)

    def reward(prompts: list[Any], completions: list[Any], task: list[str], **_: Any) -> list[float | None]:
        """The env's own score() on prompt + TRL's multi-turn completion."""
        out: list[float | None] = []
        for prompt, completion, raw in zip(prompts, completions, task, strict=True):
            messages = [
                Message(role=m["role"], content=m.get("content") or "") for m in [*prompt, *completion]
            ]
            result = asyncio.run(env.score(json.loads(raw), messages))
            out.append(float(getattr(result, "value", result)))
        return out

    peft_config = None
    lora = trainer_config(config).lora
    if lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        )

    clock = _StepClock()
    with tempfile.TemporaryDirectory(prefix="e2e-vs-trl-trl-") as tmp:
        trl_args = GRPOConfig(
            output_dir=tmp,
            max_steps=total_steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            **settings,
        )
        dataset = Dataset.from_list([{"prompt": p.messages, "task": json.dumps(p.task)} for p in prompts])
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=trl_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            tools=tools,
            peft_config=peft_config,
            callbacks=[clock.callback(TrainerCallback)],
        )
        trainer.train()
    per_step = settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"]
    tokens = [clock.mean_length.get(i + 1, 0.0) * per_step for i in range(len(clock.ends))]
    s_per_step, tok_s = measure(clock.ends, tokens, args.warmup)
    rewards = [clock.reward.get(i + 1, 0.0) for i in range(args.warmup, len(clock.ends))]
    return Result(
        system="trl",
        s_per_step=s_per_step,
        tokens_per_s=tok_s,
        steps=len(clock.ends) - args.warmup,
        completions_per_step=float(per_step),
        reward_mean=_mean(rewards),
        note=(
            f"trl=={trl.__version__} micro_batch={settings['per_device_train_batch_size']} "
            f"bf16={settings['bf16']} prompt_mismatches={mismatched}/{len(prompts)}"
        ),
    )


_CALLS = (
    "{% set ns_calls = namespace(text='') %}"
    "{% for tc in (message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else []) %}"
    "{% set fn = tc['function'] if tc['function'] is defined else tc %}"
    "{% set ns_calls.text = ns_calls.text ~ ('\n' if ns_calls.text else '') ~ '<tool_call>\n' "
    "~ ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) ~ '\n</tool_call>' %}"
    "{% endfor %}"
    "{% set hermes_content = ((message['content'] or '') ~ '\n' ~ ns_calls.text) "
    "if (ns_calls.text and message['content']) else (ns_calls.text or message['content']) %}"
)


def with_hermes_calls(template: str) -> str:
    """The model's chat template, made to render `tool_calls` the way agentrl does for it.

    GRPOTrainer refuses a template that drops tool calls. agentrl writes them
    into the assistant content in Hermes format (`agentrl.chat.conversation.hermes_content`)
    for such templates; this does the same inside the template, so every
    conversation without `tool_calls` renders exactly as before.
    """
    if "tool_calls" in template:
        return template
    loop, content = "{% for message in messages %}", "message['content']"
    if template.count(loop) != 1 or content not in template:
        raise ValueError(
            "e2e_vs_trl: the chat template neither renders tool_calls nor has the simple "
            f"`{loop} ... {content}` shape this benchmark can extend; give the model a tool-calling template"
        )
    return template.replace(content, "hermes_content").replace(loop, loop + _CALLS)


def _prompt_mismatches(tokenizer: Any, tools: list[Any], prompts: Sequence[Prompt]) -> int:
    """How many prompts TRL would tokenize differently from agentrl (rendered as GRPOTrainer does)."""
    bad = 0
    for p in prompts:
        ids = tokenizer.apply_chat_template(
            p.messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        bad += list(ids) != p.agentrl_ids
    return bad


class _StepClock:
    """Optimizer-step end times and the per-step logs TRL emits (completion lengths, reward)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.mean_length: dict[int, float] = {}
        self.reward: dict[int, float] = {}

    def callback(self, base: type) -> Any:
        clock = self

        class Clock(base):  # type: ignore[misc, valid-type]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                clock.ends.append(time.time())

            def on_log(
                self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any
            ) -> None:
                if logs and "completions/mean_length" in logs:
                    clock.mean_length[state.global_step] = float(logs["completions/mean_length"])
                    clock.reward[state.global_step] = float(logs.get("reward", 0.0))

        return Clock()


# --------------------------------------------------------------------------- orchestration


def run_worker(args: argparse.Namespace) -> Result:
    if args.worker == "trl":
        return run_trl(args)
    return run_agentrl(args, args.async_staleness if args.worker == "agentrl_async" else 0)


def run_system(system: str, argv: Sequence[str], timeout: float) -> Result | str:
    """One system in a fresh subprocess; its Result, or why there is none."""
    with tempfile.TemporaryDirectory(prefix="e2e-vs-trl-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", system, "--result", str(out)]
        print(f"== {system}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            # workers log to stderr only (TRL prints its logs to stdout): stdout keeps just the table
            proc = subprocess.run(cmd, timeout=timeout, check=False, stdout=sys.stderr)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f}s"
        print(
            f"== {system}: done in {time.perf_counter() - started:.0f}s (rc={proc.returncode})",
            file=sys.stderr,
        )
        if proc.returncode != 0 or not out.exists():
            return f"failed (exit {proc.returncode}); see its output above"
        return Result(**json.loads(out.read_text()))


def describe(config: RunConfig, args: argparse.Namespace) -> str:
    ro, tr = config.rollout, trainer_config(config)
    lines = [
        f"config: {args.config} {' '.join(args.overrides)}".rstrip(),
        f"model: {config.model.path}  env: {config.env.name} {config.env.params}",
        f"group_size={ro.group_size} groups_per_step={ro.groups_per_step} "
        f"(={ro.group_size * ro.groups_per_step} completions/step) max_turns={ro.max_turns} "
        f"max_new_tokens_per_turn={ro.max_new_tokens_per_turn} max_total_tokens={ro.max_total_tokens} "
        f"temperature={ro.sampling.temperature}",
        f"trainer: lr={tr.lr} dtype={tr.dtype} lora={tr.lora} micro_batch_tokens={tr.micro_batch_tokens}",
        f"steps: {args.warmup} warm-up + {args.steps} measured per system",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.worker:
        result = run_worker(args)
        Path(args.result).write_text(json.dumps(asdict(result)))
        return
    config = load_workload(args)  # validate before spending minutes
    print(describe(config, args), file=sys.stderr)
    if "trl" in args.systems.split(","):
        _require_trl()  # before spending minutes on the agentrl runs
    results: dict[str, Result | str] = {}
    for system in args.systems.split(","):
        results[system] = run_system(system, raw, args.timeout)
    print(f"{'system':<14} {'s/step':>9} {'tokens/s':>9} {'steps':>5} {'compl/step':>10} {'reward':>7}  note")
    for system, r in results.items():
        if isinstance(r, str):
            print(f"{system:<14} {r}")
        else:
            print(
                f"{system:<14} {r.s_per_step:9.2f} {r.tokens_per_s:9.1f} {r.steps:5d} "
                f"{r.completions_per_step:10.0f} {r.reward_mean:7.3f}  {r.note}"
            )
    print(summary(results))


def summary(results: dict[str, Result | str]) -> str:
    def s(name: str) -> float:
        r = results.get(name)
        return r.s_per_step if isinstance(r, Result) else math.nan

    def t(name: str) -> float:
        r = results.get(name)
        return r.tokens_per_s if isinstance(r, Result) else math.nan

    a, y, x = s("agentrl_async"), s("agentrl_sync"), s("trl")
    return (
        f"speedup_vs_trl={x / a:.2f} async_vs_sync={y / a:.2f} "
        f"async_s_per_step={a:.2f} sync_s_per_step={y:.2f} trl_s_per_step={x:.2f} "
        f"async_tok_s={t('agentrl_async'):.1f} sync_tok_s={t('agentrl_sync'):.1f} trl_tok_s={t('trl'):.1f}"
    )


def _require_trl() -> Any:
    """The `trl` module, or exit with how to install it."""
    try:
        import trl
    except ImportError:
        raise SystemExit(
            f"TRL is not installed. Install it with:  pip install 'trl=={TRL_VERSION}'  "
            "(or pip install -e '.[bench]'; it leaves torch and transformers as they are), "
            "or run with --systems agentrl_async,agentrl_sync"
        ) from None
    return trl


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


if __name__ == "__main__":
    main()
