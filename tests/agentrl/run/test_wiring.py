"""Run wiring: the probe env is closed with the run even if the engine fails to close; run.seed seeds rollouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.config import RunConfig, resolve_config
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envkit.testing import TrivialEnv
from agentrl.run.resources import RunResources
from agentrl.run.wiring import EvalParts, Parts, rollout_manager


class ClosingEnv(TrivialEnv):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class BrokenEngine(ScriptedEngine):
    async def close(self) -> None:
        raise RuntimeError("engine close failed")


async def test_closing_the_parts_closes_the_probe_env_and_the_run_resources() -> None:
    tokenizer = SimpleChatTokenizer()
    probe = ClosingEnv()
    resources = RunResources()
    sandbox = resources.get("sandbox:x", ClosingEnv)  # anything with an async close()
    parts = EvalParts(ClosingEnv, probe, [], ScriptedEngine(tokenizer=tokenizer), tokenizer, resources)
    await parts.close()
    assert probe.closed == 1 and sandbox.closed == 1 and len(resources) == 0

    again = resources.get("sandbox:x", ClosingEnv)
    broken = EvalParts(ClosingEnv, probe, [], BrokenEngine(tokenizer=tokenizer), tokenizer, resources)
    with pytest.raises(RuntimeError, match="engine close failed"):
        await broken.close()
    assert probe.closed == 2 and again.closed == 1  # closed even though the engine's close failed


async def _seeds(config: RunConfig) -> list[int | None]:
    tokenizer = SimpleChatTokenizer()
    parts = Parts(TrivialEnv, TrivialEnv(), [], [], ScriptedEngine(tokenizer=tokenizer), tokenizer,
                  trainer=SimpleNamespace(policy_version=0))
    tasks = [{"id": f"t{i}", "prompt": "go"} for i in range(2)]
    async with rollout_manager(config, parts, tasks) as manager:
        return [t.seed async for group in manager.groups() for t in group.trajectories]


async def test_run_seed_seeds_the_episodes() -> None:
    """`run.seed` reaches the rollouts: another seed samples other episodes, the same seed the same."""
    def config(seed: int) -> RunConfig:
        return resolve_config({"env": "agentrl.envkit.testing:TrivialEnv", "engine": "scripted", "run": {"seed": seed},
                               "rollout": {"group_size": 2, "groups_per_step": 1, "max_staleness": 9}})

    first, again, other = await _seeds(config(0)), await _seeds(config(0)), await _seeds(config(7))
    assert len(first) == 4 and len(set(first)) == 4
    assert sorted(first) == sorted(again)  # type: ignore[type-var]
    assert not set(first) & set(other)


class _Source:
    """A weight source that says what it handed out, like the trainers' (no torch needed here)."""

    def __init__(self, buckets: int, mb_each: int) -> None:
        self._n, self._mb = buckets, mb_each
        self.sent_bytes = self.sent_buckets = 0

    def buckets(self):  # type: ignore[no-untyped-def]
        for i in range(self._n):
            self.sent_bytes += self._mb * 2**20
            self.sent_buckets += 1
            yield [(f"w{i}", None)]


class DeafEngine(ScriptedEngine):
    """Reads the weights but keeps serving its old version: an update that did not take."""

    async def update_weights(self, weights, version):  # type: ignore[no-untyped-def]
        for _bucket in weights.buckets():
            pass


async def test_a_weight_sync_is_measured_and_its_version_checked() -> None:
    from agentrl.errors import AgentrlError
    from agentrl.run.wiring import sync_weights

    trainer = SimpleNamespace(policy_version=3, state_for_engines=lambda: _Source(buckets=2, mb_each=3))
    engine = ScriptedEngine(tokenizer=SimpleChatTokenizer())
    metrics = await sync_weights(engine, trainer)
    assert engine.policy_version == 3
    assert metrics["weight_sync/mb"] == 6.0 and metrics["weight_sync/buckets"] == 2.0
    assert metrics["weight_sync/mb_per_s"] == pytest.approx(6.0 / metrics["time/weight_sync_s"])
    with pytest.raises(AgentrlError, match=r"DeafEngine serves policy version 0 after update_weights\(version=3\)"):
        await sync_weights(DeafEngine(tokenizer=SimpleChatTokenizer()), trainer)


class RecordingEngine(ScriptedEngine):
    """Remembers the sampling temperature of every generate call."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.temperatures: list[float] = []

    async def generate(self, prompt_ids, sampling):  # type: ignore[no-untyped-def]
        self.temperatures.append(sampling.temperature)
        return await super().generate(prompt_ids, sampling)


@pytest.mark.parametrize("eval_temperature,expected", [(None, 0.7), (0.0, 0.0)])
async def test_evaluations_sample_at_the_eval_temperature(eval_temperature: float | None, expected: float) -> None:
    from agentrl.run.wiring import evaluate_config

    config = resolve_config({"env": "agentrl.envkit.testing:TrivialEnv", "engine": "scripted",
                             "run": {"eval_temperature": eval_temperature},
                             "rollout": {"sampling": {"temperature": 0.7}},
                             "trainer": {"temperature": 0.7}})  # fmt: skip
    tokenizer = SimpleChatTokenizer()
    engine = RecordingEngine(tokenizer=tokenizer)
    parts = EvalParts(TrivialEnv, TrivialEnv(), [{"id": "t", "prompt": "go"}], engine, tokenizer)
    result = await evaluate_config(config, parts)
    assert result.n_tasks == 1 and engine.temperatures and set(engine.temperatures) == {expected}
    assert config.rollout.sampling.temperature == 0.7  # the training rollouts keep theirs


def test_greedy_evaluation_takes_one_sample() -> None:
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"run: .*eval_samples=4 with eval_temperature=0"):
        resolve_config({"env": "agentrl.envkit.testing:TrivialEnv", "run": {"eval_temperature": 0, "eval_samples": 4}})


def test_a_vllm_engine_is_sized_for_the_trainers_lora_rank() -> None:
    """Without engine.lora_rank a LoRA run's vllm engine gets the trainer's rank (rounded up to one vLLM sizes
    its LoRA layers for), so a sync is the adapter alone; an explicit value is the user's; no LoRA, no layers.
    A ray pool's vllm replicas get the same."""
    from agentrl.engines.ray_pool import RayEnginePool
    from agentrl.engines.vllm_engine import VLLMEngine
    from agentrl.run.wiring import engine_params, trainer_lora_rank

    def config(trainer: dict[str, object], engine: dict[str, object] | None = None) -> RunConfig:
        return resolve_config({"env": "agentrl.envkit.testing:TrivialEnv", "engine": {"name": "vllm", **(engine or {})},
                               "trainer": trainer})  # fmt: skip

    fields = set(VLLMEngine.Config.model_fields)
    lora = {"lora": {"r": 12, "alpha": 24}}
    params = engine_params(config(lora), "/m", fields)
    assert params["model"] == "/m" and params["lora_rank"] == 12
    assert engine_params(config(lora, {"lora_rank": 64}), "/m", fields)["lora_rank"] == 64  # the user's own
    assert engine_params(config({}), "/m", fields)["lora_rank"] == 0  # no LoRA: no LoRA layers
    assert engine_params(config(lora), "/m", {"model"})["lora_rank"] == 0  # an engine that has no such key: untouched
    assert trainer_lora_rank(config({"lora": {"r": 12, "alpha": 24}})) == 12
    assert trainer_lora_rank(config({})) == 0
    assert VLLMEngine.Config(model="m", lora_rank=12).lora_rank == 16
    assert VLLMEngine.Config(model="m", lora_rank=32).lora_rank == 32
    # a ray pool's vllm replicas: the same rank, unless the replica's params give one; hf replicas have no such key
    pool = set(RayEnginePool.Config.model_fields)

    def replica_fields(name: str) -> set[str]:
        return set(VLLMEngine.Config.model_fields) if name == "vllm" else {"model"}

    def pool_params(replica: dict[str, object], trainer: dict[str, object] = lora) -> dict[str, object]:
        got = engine_params(config(trainer, {"name": "ray", "replica": replica}), "/m", pool,
                            replica_fields=replica_fields)["replica"]  # fmt: skip
        assert isinstance(got, dict)
        return got

    assert pool_params({"name": "vllm", "params": {"max_model_len": 512}})["params"] == {"max_model_len": 512,
                                                                                       "lora_rank": 12}  # fmt: skip
    assert pool_params({"name": "vllm", "params": {"lora_rank": 64}})["params"] == {"lora_rank": 64}
    assert pool_params({"name": "vllm"}, {})["params"] == {}
    assert pool_params({"name": "hf"})["params"] == {}
    with pytest.raises(ValueError, match="vLLM serves ranks up to one of"):
        VLLMEngine.Config(model="m", lora_rank=1000)
