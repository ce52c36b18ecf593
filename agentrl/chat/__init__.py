"""The token-exact conversation: sampled ids kept verbatim, everything else as chat-template deltas.

- `conversation`: `Conversation`, the per-episode token list with loss masks, logprobs and versions.
- `tokenizers`: the chat-template adapters it renders deltas with (HF, simple, tool formatting).
- `tool_parsers`: reading tool calls out of a decoded reply (hermes, llama3_json, json).

Used by the rollout (native envs) and the gateway (agents from outside) alike. No torch.
"""
