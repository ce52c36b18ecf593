"""Episodes and groups: from a task to finished `Group`s under the staleness gate.

- `episode`: `run_episode`, one episode's turns (engine -> conversation -> env), each under a deadline.
- `manager`: `RolloutManager`, many episodes in flight, GRPO groups, failure policy, staleness.
- `config`: the run config's `rollout:` section.
- `task_stream`: the task order, resume cursors and solved-task filtering.
- `metrics`: per-step rollout metrics.

No torch.
"""
