"""One training run: builds the parts, drives the loop, evaluates, logs, checkpoints.

- `loop`: `train()`, the loop on one screen (rollout -> train -> sync -> store -> log).
- `wiring`: builds the run's parts from the config (env factory, engine, tokenizer, trainer) and syncs weights.
- `resources`: sandboxes/verifiers/reward models shared by the envs of a run.
- `evaluation`: held-out evaluation (`agentrl eval` and the loop's periodic one).
- `demonstrations`: SFT warm start samples from worked demonstrations.
- `metrics_log`, `alerts`, `progress`, `plot`, `run_dir`: what the run writes and shows.
- `ray_runtime`: starting or joining Ray when a plugin needs it.
- `commands`: the `agentrl eval` and `agentrl plot` commands.

Importing this package imports no torch; the trainer and engine plugins do, when built.
"""
