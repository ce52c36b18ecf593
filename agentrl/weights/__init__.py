"""The weights leg: how a trainer's new weights reach every engine.

- `buckets`: `NamedTensorBuckets`, the trainer's weights under HF names in size-bounded buckets.
- `transport`: the `weight_transport` choice and the collective path's contract (torch- and vLLM-free:
  vLLM loads its plugin hook in every process).
- `wire`: the bucket layout both ends of a broadcast agree on.
- `sender`: the trainer's rank 0 in a weight-transfer group.
- `sync`: `CollectiveSync`, the coordinator of a collective update, used by the `vllm` engine (a pool of
  one) and the `ray` pool: group forming, deadlines, blame, retry over a new group, teardown.
- `gloo_backend`: the receiving end inside vLLM workers (registered with vLLM's factory).

Modules that move tensors import torch; `transport`, `sync` and this package do not.
"""
