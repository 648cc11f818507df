"""A service process takes what it built at start out of the garbage collector's walks (`freeze_heap`) once
it runs under `run_service`; a service a test runs beside others leaves the process's collector alone."""

from __future__ import annotations

import asyncio
import gc

from kvcentric.config import BusConfig
from kvcentric.runtime.http import process_gauges
from kvcentric.runtime.service import Service, freeze_heap


def test_freeze_heap_takes_every_live_object_out_of_the_collections_and_metrics_show_it(monkeypatch):
    monkeypatch.delenv("KVC_GC_FREEZE", raising=False)
    gc.unfreeze()
    try:
        kept = [[i] for i in range(1000)]  # tracked objects alive at the freeze
        freeze_heap()
        assert gc.get_freeze_count() >= len(kept)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in kept)  # no generation holds them now
        assert process_gauges()["gc_frozen_objects"] == gc.get_freeze_count()
    finally:
        gc.unfreeze()


def test_kvc_gc_freeze_0_leaves_the_collector_as_it_is(monkeypatch):
    monkeypatch.setenv("KVC_GC_FREEZE", "0")
    gc.unfreeze()
    freeze_heap()
    assert gc.get_freeze_count() == 0


def test_a_started_service_freezes_the_heap_only_of_a_process_it_has_to_itself(nats_url, monkeypatch):
    monkeypatch.delenv("KVC_GC_FREEZE", raising=False)

    async def frozen_after_open(owns_process: bool) -> int:
        service = Service(BusConfig(nats_url=nats_url))
        service.owns_process = owns_process  # run_service sets it
        await service.open()
        try:
            assert service.ready
            return gc.get_freeze_count()
        finally:
            await service.close()

    gc.unfreeze()
    try:
        assert asyncio.run(frozen_after_open(False)) == 0
        assert asyncio.run(frozen_after_open(True)) > 10_000
    finally:
        gc.unfreeze()
