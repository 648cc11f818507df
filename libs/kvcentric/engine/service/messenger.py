"""An engine's in-process messenger: the KVTransfer gRPC server that takes pushed KV into the role's sink,
serves this node's host-pool blocks to peers that pull them (hot-spot replication; on a decode instance, the
blocks of a push that broke off, `keptkv.py`) and keeps the blocks a decode instance puts back there (the KV of
the tokens it generated, for a request migrated after it dies).

It moves KV in and blocks in and out (over gRPC, and where a link chose it Mooncake's Transfer Engine, whose
registered memory `mooncake_parts` sets up once per engine); what pushed KV becomes is the sink's business.
"""

from __future__ import annotations

import logging

from kvcentric.engine.config import EngineConfig
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.runtime.mooncake import MooncakeReceiver, MooncakeSender, open_mooncake
from kvcentric.runtime.mooncake import available as mooncake_unavailable
from kvcentric.runtime.security import transfer_tls
from kvcentric.runtime.transfer import BlockSource, KVSink, KVTransferServicer, advertised_address, start_server

log = logging.getLogger("kvcentric.messenger")


class HostPoolSource:
    """The messenger's block source: prefix blocks served from this node's host pool (for pulls)."""

    def __init__(self, host: HostBlockPool, runner: ModelRunner) -> None:
        self.host, self.runner = host, runner

    def read_blocks(self, block_hashes: list[str], dtype: str, block_size: int):
        if dtype != self.runner.dtype_name or block_size != self.runner.block_size:
            raise ValueError(f"blocks here are {self.runner.dtype_name} x {self.runner.block_size} tokens, "
                             f"asked for {dtype} x {block_size}")
        for index, block_hash in enumerate(block_hashes):
            data = self.host.read(block_hash, index)
            yield block_hash, data
            if data is None:
                return


def mooncake_parts(config: EngineConfig) -> tuple[MooncakeSender, MooncakeReceiver] | None:
    """This engine's Transfer Engine (`runtime/mooncake.py`), its sending and receiving sides, where
    --kv-transport may use it, the package imports and the KV transfer is not under TLS; else None."""
    if config.kv_transport not in ("auto", "mooncake") or not config.kv_mooncake_mb:
        return None
    if config.tls_cert:  # the Transfer Engine's own connections are not the KV transfer's mutual TLS
        log.warning("--tls-cert: no Mooncake transport (its connections would bypass TLS); pushes go over gRPC")
        return None
    parts = open_mooncake(config.kv_advertise.rsplit(":", 1)[0] if config.kv_advertise else config.kv_host,
                          config.kv_mooncake_mb << 20, config.kv_mooncake_protocol, config.kv_mooncake_device)
    if parts is None and config.kv_transport == "mooncake":
        log.warning("--kv-transport mooncake, but Mooncake's Transfer Engine is unavailable here: %s; pushes go "
                    "over gRPC", mooncake_unavailable() or "it did not start")
    return parts


class Messenger:
    """The gRPC server on --kv-host:--kv-port; `addr` is what peers push to once it listens."""

    def __init__(self, sink: KVSink, host: HostBlockPool | None, runner: ModelRunner, gpus: tuple[str, ...] = (),
                 mooncake: MooncakeReceiver | None = None, source: BlockSource | None = None) -> None:
        """`gpus`, `mooncake`: what the servicer advertises and reads with (`KVTransferServicer`); `source`: what
        pulls are served from, where not the host pool (a decode instance's kept blocks, `keptkv.py`)."""
        if source is None and host is not None:
            source = HostPoolSource(host, runner)
        self.transfer = KVTransferServicer(sink, source, host, gpus, mooncake)
        self.addr = ""
        self._server = None
        self.more_services: list = []
        """Other gRPC services this server offers (a pipeline stage's StageTransfer), added before `start`."""

    @property
    def stats(self):
        return self.transfer.stats

    async def start(self, config: EngineConfig) -> None:
        self._server, port = await start_server(self.transfer, config.kv_host, config.kv_port,
                                                   self.more_services, transfer_tls(config))
        self.addr = config.kv_advertise or advertised_address(config.kv_host, port)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)
        self.transfer.segments.close()
        if self.transfer.mooncake is not None:
            self.transfer.mooncake.close()
