"""The token stats a TorchTrainer step writes survive the store's JSON and reach the token view."""

from __future__ import annotations

import json

from agentrl.replay.tokens import TOKEN_STAT_FIELDS, TokenDecoder, token_view
from agentrl.types import Group, Trajectory, Turn


def _trajectory(completion: list[int], reward: float) -> Trajectory:
    prompt = [5, 6, 7, 8]
    n = len(completion)
    return Trajectory(task_id="t", env="e", messages=[], token_ids=prompt + completion,
                      loss_mask=[0] * 4 + [1] * n, logprobs=[0.0] * 4 + [-1.0] * n,
                      versions=[-1] * 4 + [0] * n, turns=[Turn(start=4, end=4 + n)], reward=reward)  # fmt: skip


def test_trainer_token_stats_come_out_of_token_view(tiny_llama_path: str) -> None:
    from agentrl.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer({"dtype": "fp32", "off_policy": {"mode": "tis"}}, tiny_llama_path)
    trajs = [_trajectory([9, 10, 11], 1.0), _trajectory([12, 13], 0.0)]
    result = trainer.train_step([Group(task_id="t", trajectories=trajs)])
    trajs[0].info["token_stats"] = result.token_stats[trajs[0].id]  # as the training loop stores them

    stored = Trajectory.from_dict(json.loads(json.dumps(trajs[0].to_dict())))  # as the store keeps it
    view = token_view(stored, TokenDecoder(None, "none"))
    stats = trajs[0].info["token_stats"]
    for name in TOKEN_STAT_FIELDS:
        assert view[name] == stats[name], name
        assert view[name][:4] == [None] * 4, name  # prompt: n/a
    assert all(isinstance(x, float) and x < 0 for x in view["trainer_logprobs"][4:])
    assert all(isinstance(x, float) and x > 0 for x in view["advantages"][4:])  # the better sibling
    assert all(isinstance(x, float) and 0 < x <= 2.0 for x in view["is_weights"][4:])  # tis cap 2
    assert view["is_mask"][4:] == [1.0, 1.0, 1.0]
