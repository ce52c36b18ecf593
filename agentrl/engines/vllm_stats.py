"""What vLLM's scheduler reports, kept for the `vllm` engine's `stats()` (`rollout/engine/<key>`).

vLLM hands its scheduler and iteration stats to "stat loggers" in the
frontend process after every engine step. `SchedulerCounters.logger_factory()`
is such a logger: it keeps the last running/waiting request counts and KV
cache usage, and run-long sums of prefix-cache queries and hits, prompt
tokens and preemptions, for a run to log next to its own metrics. Only
attribute reads per step; vLLM is imported only when the factory is made.
"""

from __future__ import annotations

from typing import Any


class SchedulerCounters:
    """The scheduler's last state and run-long sums, as vLLM's stat loggers see them."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens whose KV was there
        self.preempted = 0  # requests preempted (KV evicted, recomputed later)
        self.prompt_tokens = 0

    def record(self, scheduler: Any, iteration: Any) -> None:
        """One engine step's `SchedulerStats` and `IterationStats` (either may be None)."""
        if scheduler is not None:
            self.running = scheduler.num_running_reqs
            self.waiting = scheduler.num_waiting_reqs
            self.kv_cache_usage = scheduler.kv_cache_usage
            cache = scheduler.prefix_cache_stats
            if cache is not None:
                self.prefix_queries += cache.queries
                self.prefix_hits += cache.hits
        if iteration is not None:
            self.preempted += iteration.num_preempted_reqs
            self.prompt_tokens += iteration.num_prompt_tokens

    def stats(self) -> dict[str, float]:
        return {
            "running": float(self.running),
            "waiting": float(self.waiting),
            "kv_cache_usage": float(self.kv_cache_usage),
            "prefix_cache_hit_share": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "prompt_tokens": float(self.prompt_tokens),
            "preempted_requests": float(self.preempted),
        }

    def logger_factory(self) -> Any:
        """A vLLM `StatLoggerFactory` whose loggers feed these counters."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        counters = self

        class _Feed(StatLoggerBase):  # type: ignore[misc]  # vLLM is not type-checked here (follow_imports=skip)
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:  # fmt: skip
                counters.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Feed
