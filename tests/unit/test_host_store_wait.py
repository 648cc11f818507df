"""A pull from the host store waits for the push to commit (woken by the commit, not by polling) and
gives up at its deadline."""

from __future__ import annotations

import asyncio
import time

from kvcentric.proto import kv_pb2
from kvcentric.runtime.host_store import HostKVStore


async def push(store: HostKVStore, request_id: str) -> None:
    await store.begin(kv_pb2.KVHeader(request_id=request_id))
    store.commit(request_id, kv_pb2.KVCommit())


async def test_a_pull_that_comes_first_gets_the_kv_as_soon_as_the_push_commits():
    store = HostKVStore(1 << 20)
    pull = asyncio.create_task(store.wait_for("r1", timeout_s=5.0))
    await asyncio.sleep(0.01)
    await push(store, "other")  # another request's commit wakes the pull, which waits on
    await asyncio.sleep(0.01)
    assert not pull.done()
    started = time.monotonic()
    await push(store, "r1")
    entry = await asyncio.wait_for(pull, 1.0)
    assert entry is store.get("r1") and entry.header.request_id == "r1"
    assert time.monotonic() - started < 0.5


async def test_stored_kv_is_returned_without_waiting():
    store = HostKVStore(1 << 20)
    await push(store, "r1")
    assert (await store.wait_for("r1", timeout_s=0.0)).header.request_id == "r1"


async def test_a_pull_gives_up_at_its_deadline():
    store = HostKVStore(1 << 20)
    started = time.monotonic()
    assert await store.wait_for("r1", timeout_s=0.05) is None
    assert 0.04 <= time.monotonic() - started < 1.0


async def test_several_pulls_of_one_request_all_get_it():
    store = HostKVStore(1 << 20)
    pulls = [asyncio.create_task(store.wait_for("r1", timeout_s=5.0)) for _ in range(3)]
    await asyncio.sleep(0.01)
    await push(store, "r1")
    assert all(entry is not None for entry in await asyncio.wait_for(asyncio.gather(*pulls), 1.0))
