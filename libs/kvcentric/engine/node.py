"""What an engine instance computes with: its model runner (or the one a role change hands over), its host
block pool, the one thread the model runs in, and the wake-up of its work loop.

It builds and runs; it does not schedule requests or talk to the network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import torch

from kvcentric.engine.config import EngineConfig
from kvcentric.engine.kvpool import HostBlockPool
from kvcentric.engine.runner import ModelRunner
from kvcentric.model.config import load_model_config


def load_runner(config: EngineConfig, runner: ModelRunner | None = None) -> ModelRunner:
    """The model with its paged KV memory: `runner` when one is handed over, else loaded from `config`."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    return runner or ModelRunner(load_model_config(config.model), config.num_kv_blocks, config.block_size,
                                 config.seed, config.dtype, config.device, config.onednn)


def host_pool(config: EngineConfig, block_bytes: int) -> HostBlockPool | None:
    """The host-memory block pool of --host-pool-mb (None when that is too small for one block); page-locked
    on a CUDA engine, whose side stream copies blocks into it behind the compute."""
    host_blocks = (config.host_pool_mb << 20) // block_bytes
    pinned = config.device.startswith("cuda")
    return HostBlockPool(host_blocks, block_bytes, config.host_pool_policy, pinned) if host_blocks else None


class ModelThread:
    """One worker thread runs the model, so the event loop keeps serving NATS and gRPC meanwhile."""

    def __init__(self, role: str) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{role}-model")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Wakeup:
    """The work loop's wake-up: a new job or a committed KV sets it; the loop sleeps until then."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def set(self) -> None:
        self.event.set()

    async def sleep(self, timeout_s: float) -> None:
        """Until set or `timeout_s` passed, whichever is first; then unset."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except TimeoutError:
            pass
        self.event.clear()
