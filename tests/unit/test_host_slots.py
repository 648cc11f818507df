"""The host pool's bookkeeping on its own (`core/host_slots.py`, no torch): a reserved slot is neither found nor
evicted until committed, a released one is free again, pinned blocks are stepped over by eviction, and any
sequence of reserves, commits, releases and pins never holds more blocks than the capacity nor loses a slot."""

from __future__ import annotations

import random

import pytest

from kvcentric.core.host_slots import HostSlots


def test_a_reserved_block_is_found_and_announced_only_once_committed():
    slots = HostSlots(2)
    slot = slots.reserve("a", 0)
    assert slot is not None and "a" not in slots and not slots.wanted("a")
    assert slots.drain_events() == ([], [])
    slots.commit(slot)
    assert "a" in slots and slots.touch("a") == slot and slots.drain_events() == (["a"], [])


def test_a_released_slot_is_free_again_and_its_block_wanted():
    slots = HostSlots(1)
    slot = slots.reserve("a", 0)
    assert slots.reserve("b", 0) is None  # the one slot is being written
    slots.release(slot)
    assert slots.wanted("a") and slots.reserve("b", 0) == slot


def test_eviction_steps_over_pinned_blocks_and_keeps_their_place():
    slots = HostSlots(2, "lru")
    for name in ("a", "b"):
        slots.commit(slots.reserve(name, 0))
    slots.pin("a")
    assert slots.reserve("c", 0) is not None and "b" not in slots and "a" in slots
    slots.unpin("a")
    assert slots.drain_events()[1] == ["b"]


def test_a_held_block_is_not_reserved_twice():
    slots = HostSlots(2)
    slots.commit(slots.reserve("a", 0))
    with pytest.raises(ValueError):
        slots.reserve("a", 0)


@pytest.mark.parametrize("seed", range(10))
def test_no_sequence_loses_a_slot_or_holds_more_than_the_capacity(seed):
    rng, capacity = random.Random(seed), 4
    slots, writing, pinned = HostSlots(capacity, rng.choice(["lru", "lfu", "length_aware"])), [], []
    for _ in range(300):
        action, name = rng.choice(["reserve", "commit", "release", "pin", "unpin"]), f"h{rng.randrange(8)}"
        if action == "reserve" and slots.wanted(name):
            slot = slots.reserve(name, rng.randrange(4))
            if slot is not None:
                writing.append(slot)
        elif action in ("commit", "release") and writing:
            slot = writing.pop(rng.randrange(len(writing)))
            (slots.commit if action == "commit" else slots.release)(slot)
        elif action == "pin" and name in slots:
            slots.pin(name)
            pinned.append(name)
        elif action == "unpin" and pinned:
            slots.unpin(pinned.pop())
        assert len(slots) + len(slots.reserved) + len(slots.free_slots) == capacity
    for slot in writing:
        slots.release(slot)
    for name in pinned:
        slots.unpin(name)
    assert not slots.pins and not slots.reserved and len(slots) + len(slots.free_slots) == capacity
