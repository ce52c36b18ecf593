"""What env authors build on, beside the contract in `agentrl.env`.

- `tool_env`: `ToolEnv`, an env whose actions are tool calls (malformed calls become messages).
- `rewards`: the `Reward` contract and combinators (`weighted`).
- `gym_bridge`: any Gymnasium env as an agentrl env; `gym_export`: agentrl envs as Gymnasium envs.
- `check`: `check_env`, the contract checks behind `agentrl check-env`.
- `testing`: small real envs for tests, benchmarks and dry runs.

No torch.
"""
