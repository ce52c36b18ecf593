"""Token text and per-token fields for the token view."""

from __future__ import annotations

import math

import pytest

from agentrl.replay.tokens import TokenDecoder, json_safe, token_view
from agentrl.types import Trajectory, Turn


def _traj(**info: object) -> Trajectory:
    return Trajectory(task_id="t", env="e", messages=[], token_ids=[72, 105, 33, 257], loss_mask=[0, 1, 1, 1],
                      logprobs=[0.0, -0.5, math.nan, -math.inf], versions=[-1, 3, 3, 4],
                      turns=[Turn(start=1, end=4)], info=dict(info))  # fmt: skip


def test_simple_decoder_and_fields() -> None:
    view = token_view(_traj(token_stats={"advantages": [0.0, 1.0, 1.0, 1.0], "is_weights": [1.0]}),
                      TokenDecoder.for_run({"replay": {"tokenizer": "simple"}}))  # fmt: skip
    assert view["text"] == ["H", "i", "!", "<|im_end|>"]
    assert view["logprobs"] == [0.0, -0.5, None, None]  # JSON-safe
    assert view["advantages"] == [0.0, 1.0, 1.0, 1.0]
    assert view["is_weights"] is None  # wrong length: ignored, shown as n/a
    assert view["trainer_logprobs"] is None and view["is_mask"] is None
    assert view["turn"] == [-1, 0, 0, 0]


def test_scalar_advantage_is_spread_over_sampled_tokens() -> None:
    view = token_view(_traj(advantage=-0.25), TokenDecoder(None, "none"))
    assert view["advantages"] == [None, -0.25, -0.25, -0.25]
    assert view["text"] is None


def test_unknown_tokenizers_fall_back_to_ids() -> None:
    for config in ({"model": {"path": "no-such-model-anywhere"}}, {}, None):
        decoder = TokenDecoder.for_run(config)
        assert decoder.name.startswith("none") and decoder.text(5) is None


@pytest.mark.model
def test_hf_tokenizer_from_the_run_config(smollm2_path: str, smol_tokenizer: object) -> None:
    decoder = TokenDecoder.for_run({"model": {"path": smollm2_path}})
    ids = smol_tokenizer.encode("Hello world, 12 + 7 = 19")  # type: ignore[attr-defined]
    assert "".join(decoder.text(i) or "" for i in ids) == "Hello world, 12 + 7 = 19"
    im_start = smol_tokenizer.convert_tokens_to_ids("<|im_start|>")  # type: ignore[attr-defined]
    assert decoder.text(im_start) == "<|im_start|>"


def test_json_safe() -> None:
    assert json_safe({"a": [1.0, math.nan, {"b": math.inf}], 2: "x"}) == {
        "a": [1.0, None, {"b": None}],
        "2": "x",
    }
