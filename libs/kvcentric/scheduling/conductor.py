"""The Conductor's core: turns a ScheduleRequest into a Placement or a Rejection. Pure, time passed in.

This version places by least load (prefill: queued tokens; decode: running plus waiting requests);
Mooncake's KVCache-centric Algorithm 1 and early rejection arrive behind the same `schedule` call.
It decides where a request goes; it does not send it there.
"""

from __future__ import annotations

from kvcentric.protocol import Placement, Rejection, ScheduleRequest
from kvcentric.scheduling.registry import InstanceRegistry


class Conductor:
    def __init__(self, registry: InstanceRegistry) -> None:
        self.registry = registry

    def schedule(self, request: ScheduleRequest, now: float) -> Placement | Rejection:
        prefills = self.registry.alive("prefill", now)
        decodes = self.registry.alive("decode", now)
        if not prefills or not decodes:
            missing = " and ".join(r for r, alive in (("prefill", prefills), ("decode", decodes)) if not alive)
            return Rejection(request.request_id, "no_instance", f"no {missing} instance is alive", 1.0)
        prefill = min(prefills, key=lambda i: (i.prefill_load, i.instance_id))
        decode = min(decodes, key=lambda i: (i.decode_load, i.instance_id))
        self.registry.note_dispatch(prefill.instance_id, request.n_tokens)
        self.registry.note_dispatch(decode.instance_id, 0)
        return Placement(request.request_id, prefill.instance_id, decode.instance_id, decode.report.kv_addr)
