"""KV block location metadata in Redis: block hash -> holders, node -> blocks. One round trip per batch.

Keys: `kvc:blk:<hash>` is a set of "node_id:tier" holders; `kvc:node:<node_id>` is the set of
"tier:hash" the node holds (so a departed node can be purged from exactly what it held). It stores,
answers and dumps the index page by page (for a conductor's local mirror); it does not decide placement.
Tiers: `device` is an engine's paged cache, `dram` a node's host pool (Mooncake's KVCache pool).
"""

from __future__ import annotations

from collections.abc import Mapping

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from kvcentric.core.protocol import BlockEvicted, BlockStored, KVEvent

HOLDERS_LUA = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = table.concat(redis.call('SMEMBERS', key), ',')
end
return out
"""
BLOCK_PREFIX = "kvc:blk:"
NODE_PREFIX = "kvc:node:"
LEASE_PREFIX = "kvc:lease:"
NODES = "kvc:nodes"
"""Every node that ever stored a block or held a lease; the sweeper purges those whose lease is gone."""
DUMP_MAX_BYTES = 256 * 1024
"""About the most bytes of block hashes one dump page carries: well under NATS's 1 MB payload limit."""
DUMP_SCAN_STEP = 256
"""Keys one SCAN step asks for; a page ends after the step that reaches its count or DUMP_MAX_BYTES."""


class KVMetaStore:
    def __init__(self, redis: Redis, lease_ttl_s: float = 5.0) -> None:
        self.redis, self.lease_ttl_s = redis, lease_ttl_s
        self._holders_script: AsyncScript | None = None

    async def apply(self, events: list[KVEvent]) -> None:
        """Apply a batch of stored/evicted events in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for node_id in {e.node_id for e in events}:  # a node that stores blocks is alive: lease it
            pipe.set(LEASE_PREFIX + node_id, "1", px=max(1, int(self.lease_ttl_s * 1000)))
            pipe.sadd(NODES, node_id)
        for event in events:
            holder = f"{event.node_id}:{event.tier}"
            for block_hash in event.block_hashes:
                if isinstance(event, BlockStored):
                    pipe.sadd(BLOCK_PREFIX + block_hash, holder)
                    pipe.sadd(NODE_PREFIX + event.node_id, f"{event.tier}:{block_hash}")
                elif isinstance(event, BlockEvicted):
                    pipe.srem(BLOCK_PREFIX + block_hash, holder)
                    pipe.srem(NODE_PREFIX + event.node_id, f"{event.tier}:{block_hash}")
        if len(pipe):
            await pipe.execute()

    async def holders(self, block_hashes: list[str]) -> list[list[str]]:
        """For each hash, its holders as sorted "node_id:tier" strings (empty when nobody has it); one
        Redis call, a Lua script that answers the whole batch as one array of strings."""
        if not block_hashes:
            return []
        if self._holders_script is None:
            self._holders_script = self.redis.register_script(HOLDERS_LUA)
        joined = await self._holders_script(keys=[BLOCK_PREFIX + h for h in block_hashes])
        return [sorted(_text(text).split(",")) if text else [] for text in joined]

    async def dump(self, cursor: int = 0, count: int = 2000,
                   max_bytes: int = DUMP_MAX_BYTES) -> tuple[list[BlockStored], int]:
        """One page of the whole index from `cursor` (0: the start): the blocks as BlockStored events,
        one per holder, and the next cursor (0: that was the last page). SCAN steps over `kvc:blk:*`,
        each with one Lua read of the holders, until about `count` blocks or `max_bytes` of hashes."""
        hashes: list[str] = []
        holders: list[list[str]] = []
        size = 0
        while True:
            cursor, keys = await self.redis.scan(cursor, match=BLOCK_PREFIX + "*",
                                                 count=max(1, min(count - len(hashes), DUMP_SCAN_STEP)))
            step = [_text(key)[len(BLOCK_PREFIX):] for key in keys]
            found = await self.holders(step)
            hashes += step
            holders += found
            size += sum((len(block_hash) + 3) * len(held) for block_hash, held in zip(step, found))
            if not cursor or len(hashes) >= count or size >= max_bytes:
                return dump_events(hashes, holders), int(cursor)

    async def node_blocks(self, node_id: str) -> dict[str, set[str]]:
        """What the index says `node_id` holds: tier -> block hashes (one round trip)."""
        tiers: dict[str, set[str]] = {}
        for member in await self.redis.smembers(NODE_PREFIX + node_id):
            tier, _, block_hash = _text(member).partition(":")
            tiers.setdefault(tier, set()).add(block_hash)
        return tiers

    async def renew_leases(self, node_ids: list[str]) -> None:
        """Heartbeats: each node's lease lives `lease_ttl_s` more seconds (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.set(LEASE_PREFIX + node_id, "1", px=max(1, int(self.lease_ttl_s * 1000)))
            pipe.sadd(NODES, node_id)
        await pipe.execute()

    async def expired_nodes(self) -> list[str]:
        """Nodes known here whose lease has run out."""
        nodes = sorted(_text(n) for n in await self.redis.smembers(NODES))
        if not nodes:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for node_id in nodes:
            pipe.exists(LEASE_PREFIX + node_id)
        alive = await pipe.execute()
        return [node_id for node_id, live in zip(nodes, alive) if not live]

    async def purge_node(self, node_id: str) -> int:
        """Drop a node from every block it held; returns how many blocks it held."""
        held = await self.redis.smembers(NODE_PREFIX + node_id)
        pipe = self.redis.pipeline(transaction=False)
        for member in held:
            tier, _, block_hash = _text(member).partition(":")
            pipe.srem(BLOCK_PREFIX + block_hash, f"{node_id}:{tier}")
        pipe.delete(NODE_PREFIX + node_id)
        pipe.srem(NODES, node_id)
        await pipe.execute()
        return len(held)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def dump_events(hashes: list[str], holders: list[list[str]]) -> list[BlockStored]:
    """Blocks with their "node_id:tier" holders, regrouped as one BlockStored per holder (first seen
    first, hashes in the order given); a block nobody holds adds nothing."""
    groups: dict[str, list[str]] = {}
    for block_hash, held in zip(hashes, holders):
        for holder in held:
            groups.setdefault(holder, []).append(block_hash)
    events = []
    for holder, blocks in groups.items():
        node_id, _, tier = holder.rpartition(":")
        if node_id:
            events.append(BlockStored(node_id=node_id, block_hashes=blocks, tier=tier))
    return events


def mooncake_batch_reply(keys: list[str], holders: list[list[str]],
                         endpoints: Mapping[str, tuple[str, int]] | None = None) -> dict:
    """The JSON of Mooncake's master `GET /batch_query_keys`: per key, `ok` and a replica descriptor per
    holder (`size_`, `buffer_address_`, `protocol_`, `transport_endpoint_`), or `ok: false` with the
    master's `OBJECT_NOT_FOUND`. `endpoints` maps a node to (messenger address, block bytes) from its
    load reports. Beyond the master: every tier is listed (it lists memory replicas only), each
    descriptor also names its `node_id` and `tier`, and `buffer_address_` is 0 (blocks are pulled by hash
    over gRPC, not read at an address)."""
    endpoints = endpoints or {}
    data: dict[str, dict] = {}
    for key, found in zip(keys, holders):
        if not found:
            data[key] = {"ok": False, "error": "OBJECT_NOT_FOUND"}
            continue
        values = []
        for holder in found:
            node_id, _, tier = holder.rpartition(":")
            addr, size = endpoints.get(node_id, ("", 0))
            values.append({"size_": size, "buffer_address_": 0, "protocol_": "grpc", "transport_endpoint_": addr,
                           "node_id": node_id, "tier": tier})
        data[key] = {"ok": True, "values": values}
    return {"success": True, "data": data}
