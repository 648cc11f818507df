"""What the prefill and decode services share: their config, model and KV pool set-up, the in-process
messenger's gRPC server, load reports, and cancel handling. The role-specific loops live in
`services/prefill` and `services/decode`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import torch

from kvcentric.engine.block_pool import BlockPool
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.runner import ModelRunner
from kvcentric.model.config import load_model_config
from kvcentric.protocol import Cancel, LoadReport, Subjects
from kvcentric.service import Service
from kvcentric.transfer import KVTransferServicer, start_server


class EngineService(Service):
    """Base of the two engine roles; subclasses provide the KV sink and the work loop."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.config: EngineConfig = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.runner = ModelRunner(load_model_config(config.model), config.num_kv_blocks, config.block_size,
                                  config.seed, config.dtype, config.device)
        self.pool = BlockPool(config.num_kv_blocks, config.block_size)
        # One worker thread runs the model so the event loop keeps serving NATS and gRPC meanwhile.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-model")
        self.wake = asyncio.Event()
        self.kv_addr = ""
        self._grpc = None

    def kv_sink(self):
        raise NotImplementedError

    def load_report(self) -> LoadReport:
        raise NotImplementedError

    async def on_cancel(self, cancel: Cancel) -> None:
        raise NotImplementedError

    async def work_loop(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self.transfer = KVTransferServicer(self.kv_sink())
        self._grpc, port = await start_server(self.transfer, self.config.kv_host, self.config.kv_port)
        self.kv_addr = self.config.kv_advertise or f"{self.config.kv_host}:{port}"
        await self.subscribe(Subjects.CANCEL_ALL, Cancel, self.on_cancel)
        self.spawn(self.every(self.config.load_interval_s, self.report_load), "load-reports")
        self.spawn(self.work_loop(), "work-loop")

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def report_load(self) -> None:
        await self.publish(Subjects.load(self.role, self.instance_id), self.load_report())

    async def run_model(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def wait_for_work(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self.wake.clear()

    def base_load(self, queued_requests: int, queued_tokens: int, running: int) -> LoadReport:
        return LoadReport(self.instance_id, self.role, self.config.cluster, self.kv_addr, queued_requests,
                          queued_tokens, running, self.pool.num_blocks, self.pool.num_free, time.time())

    def health(self) -> dict:
        return {"kv_addr": self.kv_addr, "model": self.config.model, "stats": self.engine_stats()}

    def engine_stats(self) -> dict:
        return {**self.engine.stats, **self.transfer.stats, "kv_blocks_free": self.pool.num_free,
                "kv_blocks_total": self.pool.num_blocks}

    def gauges(self) -> dict[str, float]:
        return self.engine_stats()
