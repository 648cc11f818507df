"""The pure parts of keeping a killed prefill's KV at its decode instance (`core/kept_kv.py`) and of pulling it
for the continuation (`core/scheduling/holders.py`, through the Conductor): which tokens arrived in every layer,
how long their blocks stay kept, and when a placement pulls them from the decode instance."""

from __future__ import annotations

import pytest

from factories import decode_report, make_conductor, schedule_request
from kvcentric.core.kept_kv import KeptBlocks, ReceivedKV
from kvcentric.core.protocol import BlockStored, Placement, ScheduleRequest
from kvcentric.core.scheduling.prefix import HolderIndex

LAYERS = 4


def pushed(received: ReceivedKV, chunks: list[tuple[int, int]], last_layers: int = LAYERS) -> None:
    """Chunks pushed layer by layer, the last one only up to `last_layers` (the push broke off there)."""
    for index, (start, end) in enumerate(chunks):
        layers = last_layers if index == len(chunks) - 1 else LAYERS
        for layer in range(layers):
            received.add(layer, start, end)


def test_the_tokens_of_every_layer_are_the_chunks_whose_every_layer_arrived():
    received = ReceivedKV(LAYERS)
    pushed(received, [(0, 64), (64, 128), (128, 192)], last_layers=2)  # killed while chunk 3's layer 2 computed
    assert received.ends == [192, 192, 128, 128]
    assert received.whole_tokens == 128
    assert received.whole_blocks(16) == 8
    assert received.whole_blocks(48) == 2  # rounded down to whole blocks


def test_a_range_that_comes_before_the_gap_behind_it_is_filled_counts_once_it_is():
    """A push striped over several connections deals layers round-robin: a layer's later chunk may come first."""
    received = ReceivedKV(1)
    received.add(0, 64, 128)
    received.add(0, 192, 256)
    assert received.whole_tokens == 0
    received.add(0, 0, 64)
    assert received.whole_tokens == 128  # 192..256 still waits for 128..192
    received.add(0, 128, 192)
    assert received.whole_tokens == 256


def test_nothing_arrived_is_no_token_and_a_prompt_of_no_layers_has_none():
    assert ReceivedKV(LAYERS).whole_tokens == 0
    assert ReceivedKV(0).whole_tokens == 0


def test_kept_blocks_are_due_keep_s_after_they_were_kept_and_kept_again_from_then():
    kept = KeptBlocks(30.0)
    kept.keep(["a", "b"], now=0.0)
    kept.keep(["b", "c"], now=10.0)
    assert kept.due(29.9) == []
    assert kept.due(30.0) == ["a"]
    assert "a" not in kept and len(kept) == 2
    assert kept.release(["b", "x"]) == ["b"]  # handed over: forgotten before its time
    assert kept.due(100.0) == ["c"] and len(kept) == 0


def test_a_negative_keep_time_is_refused():
    with pytest.raises(ValueError):
        KeptBlocks(-1.0)


# ---------------------------------------------------------------- the conductor pulls from the decode instance

def continuation(n_tokens: int = 1000, avoid: tuple[str, ...] = ("p0",)) -> ScheduleRequest:
    """A killed prefill's request asked again: p0 (dead) avoided."""
    request = schedule_request(n_tokens)
    return ScheduleRequest(request_id=request.request_id, n_tokens=request.n_tokens,
                           block_hashes=request.block_hashes, max_tokens=request.max_tokens, avoid=list(avoid))


def test_a_continuation_pulls_the_prompts_blocks_its_decode_instance_kept():
    conductor = make_conductor(prefills=2, decodes=1)
    placement = conductor.schedule(continuation(), {"d0": 6}, now=0.0)  # d0 kept 6 of the 10 blocks
    assert isinstance(placement, Placement)
    assert placement.prefill_id == "p1"
    assert (placement.kv_source_id, placement.kv_source_addr) == ("d0", "d0:7000")
    assert placement.pull_block_hashes == [f"h{i}" for i in range(6)]
    assert placement.cached_tokens == 600
    assert conductor.stats["pulls_from_decode"] == 1 and conductor.stats["pulled_blocks"] == 6


def test_the_blocks_the_chosen_instance_holds_itself_are_not_pulled_again():
    conductor = make_conductor(prefills=2, decodes=1)
    placement = conductor.schedule(continuation(), {"p1": 2, "d0": 6}, now=0.0)
    assert isinstance(placement, Placement)
    assert placement.kv_source_id == "d0" and placement.pull_block_hashes == ["h2", "h3", "h4", "h5"]


def test_no_pull_from_a_decode_instance_holding_no_more_than_the_chosen_one_reuses():
    conductor = make_conductor(prefills=2, decodes=1)
    placement = conductor.schedule(continuation(), {"p1": 6, "d0": 6}, now=0.0)
    assert isinstance(placement, Placement)
    assert placement.kv_source_id == "" and placement.cached_tokens == 600


def test_no_pull_where_the_transfer_takes_longer_than_computing_the_blocks():
    conductor = make_conductor(prefills=2, decodes=1, link_gbps=1e-6)  # 125 bytes/s: the prefix computes sooner
    placement = conductor.schedule(continuation(), {"d0": 6}, now=0.0)
    assert isinstance(placement, Placement)
    assert placement.kv_source_id == "" and placement.cached_tokens == 0


def test_no_pull_from_a_decode_instance_the_request_avoids_nor_below_the_cache_aware_minimum():
    conductor = make_conductor(prefills=2, decodes=2)
    avoided = conductor.schedule(continuation(avoid=("p0", "d0")), {"d0": 6}, now=0.0)
    assert isinstance(avoided, Placement) and avoided.kv_source_id == "" and avoided.decode_id == "d1"
    short = make_conductor(prefills=2, decodes=1, cache_aware_scheduling_min_tokens=2000)
    placement = short.schedule(continuation(), {"d0": 6}, now=0.0)
    assert isinstance(placement, Placement) and placement.kv_source_id == ""


def test_every_placement_policy_pulls_a_killed_prefills_kept_blocks():
    for policy in ("random", "load_balance", "cache_aware", "kvcentric", "llumnix", "kv_cache_hit_len"):
        placement = make_conductor(prefills=2, decodes=1, policy=policy).schedule(continuation(), {"d0": 6}, 0.0)
        assert isinstance(placement, Placement) and placement.kv_source_id == "d0", policy


def test_a_decode_instances_announced_blocks_are_matched_like_any_holders():
    """The decode instance announces what it kept as a prefill announces its blocks (tier "device"); the
    conductor's mirror of kvs-meta then finds them as hits under its id."""
    index = HolderIndex()
    index.apply([BlockStored(node_id="d0", block_hashes=["h0", "h1", "h2"], tier="device")], now=0.0)
    conductor = make_conductor(prefills=2, decodes=1)
    conductor.observe(decode_report("d0"), 0.0)
    placement = conductor.schedule(continuation(), index.match([f"h{i}" for i in range(10)]), now=0.0)
    assert isinstance(placement, Placement) and placement.pull_block_hashes == ["h0", "h1", "h2"]
