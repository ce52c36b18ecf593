"""Starting or joining Ray for the plugins that place actors on it (the `ray` engine pool and trainer group).

Ray is imported only when one of them is built. Whoever starts Ray owns it and
shuts it down on close; a plugin built after another one started it (a `ray`
trainer group and a `ray` engine pool in one run) joins that Ray instead.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping

from agentrl.errors import AgentrlError


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


def require_free(address: str | None, need: Mapping[str, float], what: str, *, grace_s: float = 10.0) -> None:
    """On a local Ray (`address` None), fail soon if `need` (e.g. {"CPU": 2}) is more than Ray has free.

    A local Ray has no autoscaler: actors that do not fit would stay pending
    until their start deadline. Resources of actors just closed take a moment
    to come back (a restart builds a new group right after the old one
    closed), so the check waits up to `grace_s` for them. On a cluster
    (`address` set) nodes may still join, so nothing is checked there.
    """
    if address is not None:
        return
    import ray

    deadline = time.monotonic() + grace_s
    while True:
        free = ray.available_resources()
        short = {k: v for k, v in need.items() if v > 0 and v > free.get(k, 0.0) + 1e-9}
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if short:
        have = {k: round(free.get(k, 0.0), 3) for k in need}
        raise AgentrlError(
            f"{what} needs {dict(need)} of the local Ray, which has {have} free "
            "(another Ray plugin of this run may hold the rest): lower the per-actor num_cpus/num_gpus "
            "(fractions are fine), or start Ray yourself (`ray start --head --num-cpus N`) and set address: auto"
        )


_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_resources(value: Mapping[str, float], *, key: str) -> dict[str, float]:
    """Custom Ray resources asked of each actor (`{"trainer_node": 1}`), validated; a ValueError names `key`.

    They steer placement on a cluster: a node offers them (`ray start
    --resources='{"trainer_node": 8}'`) and only actors asking for them land
    there. CPUs and GPUs have their own keys, so naming them here is an error.
    """
    out = {}
    for name, amount in value.items():
        if name in _BUILTIN_RESOURCES:
            raise ValueError(f"{key}.{name}: set CPUs/GPUs with their own keys, not as a custom resource")
        if not amount > 0:
            raise ValueError(f"{key}.{name}={amount!r}: a resource amount must be > 0")
        out[str(name)] = float(amount)
    return out
