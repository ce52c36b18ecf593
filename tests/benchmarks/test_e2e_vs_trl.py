"""benchmarks/e2e_vs_trl.py: TRL sees exactly the tokens agentrl sees, and the workload follows the config.

The benchmark's comparison is only fair if TRL's GRPOTrainer trains on the same
prompts and the same multi-turn token layout as agentrl, so these tests pin
that down with the real SmolLM2 tokenizer: first-turn prompts (few-shot demos
and tool description included) are token-identical, TRL parses the model's
Hermes tool call, and the tool-result delta TRL appends equals agentrl's.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("e2e_vs_trl")


def test_measure_excludes_warmup(bench: ModuleType) -> None:
    # steps end at t=10 (warm-up), 14, 20: two measured steps over 10 s with 30 + 50 tokens
    s_per_step, tok_s = bench.measure([10.0, 14.0, 20.0], [999.0, 30.0, 50.0], warmup=1)
    assert s_per_step == pytest.approx(5.0)
    assert tok_s == pytest.approx(8.0)
    with pytest.raises(ValueError, match="warmup"):
        bench.measure([10.0], [1.0], warmup=1)


def test_workload_follows_config_and_overrides(bench: ModuleType) -> None:
    args = bench.parse_args(["rollout.group_size=4", "trainer.lr=3e-6", "--steps", "2", "--warmup", "1"])
    assert args.config.endswith("examples/calculator.yaml")
    config = bench.load_workload(args)
    assert config.rollout.group_size == 4 and config.run.steps == 3
    assert config.run.eval_every == 0 and config.warm_start.steps == 0
    prompts = [SimpleNamespace(agentrl_ids=[0] * 300)]
    settings = bench.trl_settings(config, prompts, "fp32")
    ro = config.rollout
    assert settings["num_generations"] == 4
    per_step = settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"]
    assert per_step == ro.group_size * ro.groups_per_step
    assert settings["generation_kwargs"] == {"max_new_tokens": ro.max_new_tokens_per_turn}
    assert settings["max_tool_calling_iterations"] == ro.max_turns - 1
    assert settings["max_completion_length"] == ro.max_total_tokens - 300
    assert settings["learning_rate"] == pytest.approx(3e-6)
    assert settings["temperature"] == ro.sampling.temperature
    assert settings["beta"] == 0.0 and settings["bf16"] is False


@pytest.mark.model
@pytest.mark.parametrize("tools_in_prompt", [True, False])
def test_trl_prompts_are_token_identical_to_agentrl(
    bench: ModuleType, smollm2_path: str, tools_in_prompt: bool
) -> None:
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from agentrl.envs.calculator import calculator

    overrides = [
        f"model.path={smollm2_path}",
        f"env.tools_in_prompt={str(tools_in_prompt).lower()}",
        "env.few_shot=2",
    ]
    config = bench.load_workload(bench.parse_args(overrides))
    prompts = bench.build_prompts(config, 6)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = bench.with_hermes_calls(tok.chat_template)
    assert bench._prompt_mismatches(tok, [calculator], prompts) == 0
    text = tok.decode(prompts[0].agentrl_ids)
    assert ("<tools>" in text) == tools_in_prompt  # the tool description, when the env renders it
    assert text.count("<tool_call>") >= 2  # the few-shot demos' calls
    assert len({tuple(p.agentrl_ids) for p in prompts}) == len(prompts)  # distinct tasks, stream order


@pytest.mark.model
def test_trl_tool_turn_matches_agentrl_conversation(bench: ModuleType, smollm2_path: str) -> None:
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response, qwen3_template

    from agentrl.chat.conversation import Conversation, HFChatTokenizer
    from agentrl.envs.calculator import calculator
    from agentrl.types import Completion, Message, ToolCall

    config = bench.load_workload(bench.parse_args([f"model.path={smollm2_path}"]))
    prompt = bench.build_prompts(config, 1)[0]
    tok: Any = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = bench.with_hermes_calls(tok.chat_template)
    tok.response_template = qwen3_template

    reply = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call><|im_end|>'
    )
    ids = tok.encode(reply, add_special_tokens=False)
    parsed = parse_response(tok, ids, prefix=prompt.agentrl_ids, tools=[calculator])
    assert parsed["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": "12 + 7"},
    }

    # agentrl: sampled ids verbatim, then the tool message as a template delta
    chat = HFChatTokenizer.from_pretrained(smollm2_path)
    env = config.registry().create_env(config.env.name, config.env.params)
    conv = Conversation(chat, env.initial_messages(prompt.task), tools=env.prompt_tools())
    assert conv.prompt_ids == prompt.agentrl_ids
    call = ToolCall("calculator", {"expression": "12 + 7"}, id="c0")
    conv.add_completion(
        Completion(ids, [0.0] * len(ids), [0] * len(ids), "stop"),
        Message("assistant", "", tool_calls=[call]),
    )
    assert conv.add_messages([Message("tool", "19", tool_call_id="c0", name="calculator")])
    agentrl_delta = conv.token_ids[len(prompt.agentrl_ids) + len(ids) :]

    # TRL: the suffix its tool loop appends after the same completion
    fake = SimpleNamespace(
        processing_class=tok, chat_template=None, _is_vlm=False, chat_template_kwargs={}, _tokenizer=tok
    )
    trl_delta = GRPOTrainer._get_tool_suffix_ids(
        fake, [{"role": "tool", "name": "calculator", "content": "19"}]
    )
    assert trl_delta == agentrl_delta
    assert tok.decode(trl_delta).endswith("<|im_start|>assistant\n")
