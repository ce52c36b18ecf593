"""Inference engines: token ids in, token ids with logprobs and policy versions out.

`base` holds the contract (torch-free). Implementations register as
`agentrl.engines` entry points and are imported only when used:
`scripted` (canned replies with a timing model, torch-free) and `hf`
(a transformers model with continuous batching; imports torch).
"""
