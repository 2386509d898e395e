"""The engine's bookkeeping checked whole (`--debug-checks` after every step, and the tests
after every scenario): a leak or a double free found at the step that made it, not later."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine


def check_engine(engine: Engine) -> None:
    """Every KV block is free, cached-idle or owned, exactly once; each block's reference
    count equals the live requests holding it; the prefix index agrees with the allocator;
    every live request is queued exactly where the loop expects it; every adapter reference
    count equals the live requests bound to it (raises AssertionError otherwise)."""
    requests = engine.live_requests()
    engine.allocator.check_owners({req.id: req.block_ids for req in requests})
    engine.allocator.check_consistency()
    if engine.prefix_cache is not None:
        engine.prefix_cache.check_consistency()
    elif engine.allocator.num_cached_idle:
        raise AssertionError("cached KV blocks without a prefix cache")
    live = {req.id for req in requests}
    queued = ({r.id for r in engine.scheduler.running} | {r.id for r in engine.scheduler.waiting}
              | engine.constraints.compiling)
    if queued != live:
        raise AssertionError(f"scheduler holds {sorted(queued)} but live requests are {sorted(live)}")
    if engine.lora is not None:
        engine.lora.check_consistency(requests)
    engine.runner.check_ranks()
