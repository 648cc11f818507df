"""The gateway's silence watch: it checks the requests being served every WATCH_PERIOD_S, and while none is
served it sleeps until one is placed, so an idle gateway does not wake for nothing."""

import asyncio
import logging

from kvc_gateway import relay
from kvc_gateway.migrating import Migrations
from kvcentric.core.migration import MigrationPolicy
from kvcentric.core.protocol import Placement
from kvcentric.runtime.http import Metrics


def test_the_check_sleeps_while_nothing_is_served_and_wakes_when_a_request_is_placed():
    async def scenario() -> None:
        running: dict[int, relay.Job] = {}
        migrations = Migrations(None, Metrics("gateway", "g0"), running, MigrationPolicy(), 1.5,
                                logging.getLogger("test"))
        check = asyncio.ensure_future(migrations.check())
        await asyncio.sleep(0.05)
        assert not check.done()  # nothing served: asleep
        job = relay.Job("cmpl-1", None, [1, 2, 3], False, 0.0,
                        placement=Placement(request_id="cmpl-1", prefill_id="p0", decode_id="d0",
                                            decode_kv_addr="127.0.0.1:1"))
        running[id(job)] = job
        migrations.placed(job)
        await asyncio.wait_for(check, 1.0)
        await asyncio.wait_for(migrations.check(), 1.0)  # one served: each check returns at once
        running.clear()
        check = asyncio.ensure_future(migrations.check())
        await asyncio.sleep(0.05)
        assert not check.done()  # the last one ended: asleep again
        check.cancel()

    asyncio.run(scenario())
