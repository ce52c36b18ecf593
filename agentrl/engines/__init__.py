"""Inference engines: token ids in, token ids with logprobs and policy versions out.

`base` holds the contract (torch-free). Implementations register as
`agentrl.engines` entry points and are imported only when used:
`scripted` (canned replies with a timing model, torch-free), `hf`
(a transformers model with continuous batching; imports torch) and `vllm`
(vLLM's AsyncLLM; `vllm_worker` runs inside vLLM's worker processes).
"""
