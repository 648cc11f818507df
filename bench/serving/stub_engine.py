"""A zero-cost engine for measuring what the gateway, NATS and the conductor add to a request: one process
that registers as a prefill and a decode instance (load reports ~10/s) and answers submits at once; the
prefill submit publishes the request's only token chunk, finish_reason included. No torch, no KV.

Usage:
    .venv/bin/python -m bench.serving.stub_engine --nats-url nats://127.0.0.1:4222 [--instance-id stub] [--port 0]
"""

from __future__ import annotations

import argparse
import time

from kvcentric.config import BusConfig, add_arguments, from_namespace
from kvcentric.core.protocol import DecodeJob, LoadReport, PrefillJob, SubmitAck, Subjects, TokenChunk
from kvcentric.runtime.service import Service, run_service

STUB_TOKEN = 65  # "A" in the byte tokenizer
NUM_BLOCKS = 1 << 20


class StubEngine(Service):
    role = "stub"

    def __init__(self, config: BusConfig) -> None:
        super().__init__(config)
        self.prefill_id = f"{self.instance_id}-p"
        self.decode_id = f"{self.instance_id}-d"

    async def start(self) -> None:
        refuse = SubmitAck.refused
        await self.bus.subscribe(Subjects.submit("prefill", self.prefill_id), PrefillJob, self.on_prefill,
                             bad_reply=refuse)
        await self.bus.subscribe(Subjects.submit("decode", self.decode_id), DecodeJob, self.on_decode, bad_reply=refuse)
        self.tasks.spawn(self.tasks.every(0.1, self.report_load), "load-reports")

    async def on_decode(self, job: DecodeJob) -> SubmitAck:
        self.counters["decode_submits_total"] += 1
        return SubmitAck.accepted()

    async def on_prefill(self, job: PrefillJob) -> SubmitAck:
        """The whole generation: one token, finished."""
        self.counters["prefill_submits_total"] += 1
        await self.bus.publish(Subjects.out(job.request_id),
                               TokenChunk.final(job.request_id, "length", seq=0, token_ids=[STUB_TOKEN],
                                                prompt_tokens=len(job.token_ids), completion_tokens=1))
        return SubmitAck.accepted()

    async def report_load(self) -> None:
        for role, instance in (("prefill", self.prefill_id), ("decode", self.decode_id)):
            report = LoadReport(instance_id=instance, role=role, cluster=self.config.cluster, kv_addr="127.0.0.1:1",
                                queued_requests=0, queued_tokens=0, running=0, kv_blocks_total=NUM_BLOCKS,
                                kv_blocks_free=NUM_BLOCKS, ts=time.time())
            await self.bus.publish(Subjects.load(role, instance), report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, BusConfig)
    run_service(StubEngine(from_namespace(BusConfig, parser.parse_args())))


if __name__ == "__main__":
    main()
