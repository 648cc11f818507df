"""`kvcentric sim cache`: the hit ratio of one global block pool replaying a trace in arrival order
(Mooncake Table 1); it counts hits and models no timing.

hit_ratio: blocks found in the pool / all blocks. prefix_hit_ratio: blocks found before the request's
first miss / all blocks (what a prefix cache can actually reuse). Each request is looked up, then its
blocks are used (present ones touched, missing ones inserted, evicting down to capacity).
"""

from __future__ import annotations

from kvcentric.core.scheduling.eviction import BlockCache
from kvcentric.core.sim.workload import SimRequest


def replay_pool(requests: list[SimRequest], policy: str, capacity: float) -> dict:
    cache = BlockCache(capacity, policy)
    total = hits = prefix_hits = 0
    for request in requests:
        keys = request.hashes
        total += len(keys)
        hits += cache.hits(keys)
        prefix_hits += cache.prefix_len(keys)
        cache.insert(keys)
    return {"policy": policy, "capacity": capacity, "blocks": total,
            "hit_ratio": hits / total if total else 0.0,
            "prefix_hit_ratio": prefix_hits / total if total else 0.0}
