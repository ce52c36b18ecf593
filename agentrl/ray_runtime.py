"""Starting or joining Ray for the plugins that place actors on it (the `ray` engine pool and trainer group).

Ray is imported only when one of them is built. Whoever starts Ray owns it and
shuts it down on close; a plugin built after another one started it (a `ray`
trainer group and a `ray` engine pool in one run) joins that Ray instead.
"""

from __future__ import annotations

import math
import os


def start_or_join(address: str | None, num_cpus: float) -> bool:
    """Make sure Ray is initialised; True when this call started it (the caller then shuts it down).

    `address` None starts a local Ray with at least `num_cpus` CPUs (the
    machine's count, or more so that the caller's actors fit); otherwise joins
    the cluster at `address` ('auto' = the one `ray start` made here).
    """
    import ray

    if ray.is_initialized():
        return False
    local = address is None
    ray.init(
        address=address,
        num_cpus=max(os.cpu_count() or 1, math.ceil(num_cpus)) if local else None,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    return True


def actor_died(exc: BaseException) -> bool:
    """Whether `exc` says a Ray actor is gone (its process died, its node was lost)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, ActorDiedError | ActorUnavailableError | RayActorError)
