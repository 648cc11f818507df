"""The conductor's local block index is seeded without losing or reordering an event: batches that come
while the dump is paged in wait, and are applied after it, in arrival order; once live, events apply at
once."""

from __future__ import annotations

from kvcentric.core.protocol import BlockEvicted, BlockStored, KVEventBatch
from kvcentric.core.scheduling.prefix import HolderIndex
from kvcentric.core.scheduling.seeding import IndexSeeding


def seeding(patience_s: float = 5.0) -> IndexSeeding:
    return IndexSeeding(HolderIndex(lease_ttl_s=60.0), patience_s)


def test_events_wait_while_seeding_and_apply_after_the_dump_in_arrival_order():
    state = seeding()
    state.on_events(KVEventBatch(events=[BlockStored(node_id="p0", block_hashes=["a", "b"])]), now=1.0)
    state.on_events(KVEventBatch(events=[BlockEvicted(node_id="p0", block_hashes=["b"])]), now=2.0)
    assert state.index.match(["a", "b"]) == {} and not state.live
    assert state.apply_page([BlockStored(node_id="p1", block_hashes=["a"])], next_cursor=0, now=3.0)
    assert state.go_live(seeded=True) == 2
    assert state.live and state.seeded and state.pending is None
    assert state.index.match(["a", "b"]) == {"p0": 1, "p1": 1}


def test_once_live_events_apply_at_once():
    state = seeding()
    state.go_live(seeded=False)
    state.on_events(KVEventBatch(events=[BlockStored(node_id="p0", block_hashes=["a"])]), now=1.0)
    assert state.index.match(["a"]) == {"p0": 1} and not state.seeded


def test_the_dump_is_paged_and_its_blocks_counted_until_the_cursor_is_zero():
    state = seeding()
    assert not state.apply_page([BlockStored(node_id="p0", block_hashes=["a", "b"])], next_cursor=7, now=0.0)
    assert state.cursor == 7 and state.dump_blocks == 2
    assert state.apply_page([BlockStored(node_id="p1", block_hashes=["c"])], next_cursor=0, now=0.0)
    assert state.dump_blocks == 3 and state.cursor == 0


def test_a_failed_page_restarts_the_dump_from_the_first_page():
    state = seeding()
    state.apply_page([BlockStored(node_id="p0", block_hashes=["a"])], next_cursor=4, now=0.0)
    state.restart_dump()
    assert state.cursor == 0 and state.dump_blocks == 0


def test_patience_runs_out_patience_s_after_seeding_began():
    state = seeding(patience_s=5.0)
    state.begin(now=10.0)
    assert not state.out_of_patience(14.9) and state.out_of_patience(15.0)
