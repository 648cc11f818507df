"""What the prefill, decode and colocated services share, once: their parts built from the engine config
(model runner, device pool, model thread, wake-up, spans, token outbox, job intake, KV pusher, in-process
messenger, load reporter with its heartbeat thread, role change), starting and stopping them, and the
health and readiness they report. Each role adds its engine, its sink for pushed KV, its jobs and its
work loop; this class decides nothing about a request.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import msgspec
import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.protocol import Cancel, Role
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.service.intake import JobIntake
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.service.messenger import Messenger, mooncake_parts
from kvcentric.engine.service.node import (ModelThread, Wakeup, core_share, engine_threads, gpu_uuids, host_pool,
                                           load_runner, serial_elsewhere)
from kvcentric.engine.service.outbox import TokenOutbox
from kvcentric.engine.service.reporter import Reporter
from kvcentric.engine.service.roles import RoleChange
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.service.spans import RequestSpans
from kvcentric.engine.service.speed import RECALIBRATION_BUDGET_S, STEADY_BUDGET_S, SpeedMeter
from kvcentric.runtime.service import Service
from kvcentric.runtime.security import transfer_tls
from kvcentric.runtime.transfer import KVPusher

RECALIBRATE_EVERY_S = 2.0
"""While a part of its model is a guess (calibrated on a busy machine), an idle engine calibrates again this often."""
STEADY_EVERY_S = 4.0
"""While a part is steady (measured on a steadily busy machine), an idle engine calibrates it again this often."""
AGE_OUT_EVERY_S = 30.0
"""An idle engine takes the samples older than `speed.SAMPLE_MAX_AGE_S` out of its fit this often."""
IDLE_BEFORE_S = 3.0
"""A calibration again waits until the engine has timed no step for this long (it borrows KV blocks meanwhile: a
request just served finds its blocks all free again first)."""


class EngineService(Service):
    """The parts every engine role has; a role calls `attach` once its engine and KV sink exist."""

    role: Role | str = "engine"

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, with_host_pool: bool = True,
                 build: Callable[[EngineConfig, ModelRunner | None], ModelRunner] = load_runner) -> None:
        """`runner`: the model (weights and paged KV memory) of the service this one takes over from; `build`
        makes it (or takes the one handed over), in the model thread."""
        super().__init__(config)
        self.config: EngineConfig = config
        threads = engine_threads(config, runner)
        self.model = ModelThread(self.role, threads, core_share(config, self.role, self.instance_id, threads))
        self.runner = self.model.call(build, config, runner)
        self.runner.threads = self.model.threads
        takes = self.model.share is not None and self.model.share.takes
        self.runner.model.look = self.model.refresh if takes else None  # not a former role's
        if config.cuda_graphs and not config.layerkv and self.role in ("decode", "colocated"):  # LayerKV: eager
            self.model.call(self.runner.capture_decode_graphs, config.max_batch)  # no-op off CUDA
        self.pool = BlockPool(config.num_kv_blocks, config.block_size)
        self.host: HostBlockPool | None = host_pool(config, self.runner.block_bytes) if with_host_pool else None
        self.wake = Wakeup()
        self.spans = RequestSpans()
        self.outbox = TokenOutbox(self.spans)
        self.intake = JobIntake(self.counters)
        self.gpus = gpu_uuids(self.runner.device)
        self.mooncake = mooncake_parts(config)
        """This engine's Transfer Engine, sending and receiving sides (None: no Mooncake transport)."""
        self.pusher = KVPusher(config.kv_stripes, config.kv_rate_limit_gbps * 1e9 / 8, tls=transfer_tls(config),
                               transport=config.kv_transport, gpus=self.gpus,
                               mooncake=self.mooncake[0] if self.mooncake else None)
        """The messenger's client side: pushes to decode peers (over the transport each link chose), pulls from
        block holders."""
        self.speed = SpeedMeter(self.runner, config.model, config.prefill_chunk, config.slow_step_s,
                                config.slow_while_file)
        """This instance's own prefill chunk and decode step times, and the cost model fitted to them."""
        self.recalibrated_at = 0.0
        self.aged_at = time.monotonic()
        """time.monotonic() of the latest calibration made while idle."""
        self.steps_seen, self.worked_at = 0, 0.0
        """Steps timed so far as the latest look at them counted, and when that count (or the work) last moved."""
        self.metrics.vllm_labels = {"model_name": self.runner.config.name}
        self.metrics.vllm_gauges = self.vllm_gauges

    def attach(self, sink, source=None) -> None:
        """The in-process messenger (serving pushes into `sink`, pulls from `source` or else the host pool), the load
        reporter and the role change."""
        self.messenger = Messenger(sink, self.host, self.runner, self.gpus,
                                   self.mooncake[1] if self.mooncake else None, source)
        self.reporter = Reporter(self.bus, self.instance_id, self.config.cluster, self.pool, self.host, self.pusher,
                                 heartbeat_every_s=2 * self.config.load_interval_s)
        self.role_change = RoleChange(self.role, self.tasks, self.counters, self.log, self.idle, self.report_load,
                                      self.reporter.publish_cache_forgotten)
        self.reporter.speed = self.speed
        self.reporter.block_bytes = self.runner.block_bytes

    def occupancy(self) -> tuple[int, int]:
        """(running, waiting) requests on this instance now; a role fills it in."""
        return 0, 0

    def preemptions(self) -> int:
        """Sequences preempted for want of KV blocks so far (a role that decodes fills it in)."""
        return 0

    def vllm_gauges(self) -> dict[str, float]:
        """The series vLLM's dashboards read of an engine, under vLLM's names: requests running and waiting,
        the KV cache's use (0..1; `gpu_cache_usage_perc` is its name before vLLM 0.10), preemptions."""
        running, waiting = self.occupancy()
        used = 1.0 - self.pool.num_free / max(1, self.pool.num_blocks)
        return {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage_perc": used,
                "gpu_cache_usage_perc": used, "num_preemptions_total": self.preemptions()}

    # ---------------------------------------------------------------- what a role fills in

    async def take_jobs(self) -> None:
        """Subscribe to the role's job subjects (the last thing `start` does: jobs may arrive at once)."""

    async def on_cancel(self, cancel: Cancel) -> None:
        """Drop the request wherever this instance holds it."""

    async def report_load(self) -> None:
        """Publish this instance's load report(s)."""

    async def work_loop(self) -> None:
        """Run the engine's steps in the model thread until stopping."""

    def idle(self) -> bool:
        """Nothing queued, running or still to send (a drain waits for this)."""
        return True

    def on_refit(self) -> None:
        """The measured cost model changed (a role that predicts with it takes it here)."""

    async def calibrate(self) -> None:
        """Time a few shapes of the work this role does, so the first load report carries a measured model
        (--no-calibrate: learn from serving alone)."""
        if not self.config.calibrate:
            return
        timed = await self.model.run(self.speed.calibrate, self.pool, self.role != "decode",
                                     self.role != "prefill", self.config.max_batch, borrow=False)
        self.on_refit()
        self.steps_seen = self.speed.fit.prefill.seen + self.speed.fit.decode.seen  # its own steps are no work
        self.log.info("calibrated %d shapes (%s): %s", timed, self.calibration_state(), self.speed.measured())

    async def recalibrate(self) -> None:
        """While a part of the model is a guess or not fitted yet (the first calibration ran out of time; every
        RECALIBRATE_EVERY_S) or steady (every STEADY_EVERY_S, more briefly) and nothing is being served: calibrate it
        again, so a machine that has gone quiet is measured within seconds (`SpeedMeter.calibrate` says when it
        counts)."""
        fits = {"prefill": self.speed.fit.prefill.fit, "decode": self.speed.fit.decode.fit}
        missing = {part for part in self.parts if fits[part] is None}
        parts, now = self.speed.unsettled | missing, time.monotonic()
        steady_only = not (self.speed.guess or missing)
        steps = self.speed.fit.prefill.seen + self.speed.fit.decode.seen
        if steps != self.steps_seen or not self.idle():
            self.steps_seen, self.worked_at = steps, now
        if now - self.worked_at < IDLE_BEFORE_S or self.role_change.draining:
            return
        if now - self.aged_at >= AGE_OUT_EVERY_S:  # old samples decay; the parts that lost some are measured again
            self.aged_at = now
            aged = await self.model.run(self.speed.age_out, borrow=False) & self.parts
            parts, steady_only = parts | aged, steady_only and not aged
        if not parts or (steady_only and now - self.recalibrated_at < STEADY_EVERY_S):
            return
        timed = await self.calibrate_again(parts, STEADY_BUDGET_S if steady_only else RECALIBRATION_BUDGET_S)
        if steady_only and self.speed.guess:  # the machine changed under a steady model: measure it fully now
            timed = await self.calibrate_again(set(self.speed.unsettled), RECALIBRATION_BUDGET_S)
        self.log.info("calibrated %s again, %d shapes (%s)", " and ".join(sorted(parts)), timed,
                      self.calibration_state())

    async def calibrate_again(self, parts: set[str], budget_s: float) -> int:
        timed = await self.model.run(self.speed.calibrate, self.pool, "prefill" in parts, "decode" in parts,
                                     self.config.max_batch, budget_s, borrow=False)
        self.recalibrated_at = time.monotonic()
        self.steps_seen = self.speed.fit.prefill.seen + self.speed.fit.decode.seen  # its own steps are no work
        self.on_refit()
        return timed

    @property
    def parts(self) -> set[str]:
        """The parts of the cost model this role's work times: prefill, decode, or both (colocated)."""
        return {part for part, runs in (("prefill", self.role != "decode"), ("decode", self.role != "prefill")) if runs}

    def calibration_state(self) -> str:
        """What the latest calibration saw of the machine, and which parts are still a guess."""
        stretch = self.speed.last_stretch
        seen = stretch.describe() if stretch is not None else "not watched"
        guess, steady = (", ".join(sorted(parts)) for parts in (self.speed.guess, self.speed.steady))
        said = [f"a guess: {guess}" if guess else "", f"steady on a busy machine: {steady}" if steady else ""]
        return f"{seen}; {'; '.join(part for part in said if part) or 'measured'}"

    # ---------------------------------------------------------------- lifecycle, health

    async def start(self) -> None:
        await self.calibrate()
        await self.reporter.start_heartbeat(self.nats_access)
        await self.messenger.start(self.config)
        await self.intake.take_cancels(self.bus, self.on_cancel)
        await self.role_change.listen(self.bus, self.instance_id)
        await self.reporter.listen_for_resync()
        self.tasks.spawn(self.tasks.every(self.config.load_interval_s, self.report_load), "load-reports")
        self.tasks.spawn(self.tasks.every(self.config.kv_digest_every_s, self.reporter.publish_digest), "kv-digests")
        if self.config.calibrate:
            self.tasks.spawn(self.tasks.every(RECALIBRATE_EVERY_S, self.recalibrate), "recalibrate")
        self.tasks.spawn(self.outbox.send(self.bus), "outbox")
        self.tasks.spawn(self.work_loop(), "work-loop")
        await self.take_jobs()

    async def stop(self) -> None:
        await self.reporter.stop_heartbeat()
        await self.messenger.stop()
        self.model.close()
        await self.pusher.close()

    @property
    def hands_over(self) -> bool:
        return self.role_change.next_role is not None

    @classmethod
    def prepare_process(cls, config: EngineConfig) -> EngineConfig:
        """The model thread's OpenMP team is the process's only one (see `ModelThread`): its thread count is
        fixed now, and every other thread, the event loop's first, computes serially."""
        threads = config.torch_threads or torch.get_num_threads()
        serial_elsewhere()
        return dataclasses.replace(config, torch_threads=threads)

    def successor(self) -> Service | None:
        return self.role_change.successor(self.config, self.instance_id, self.runner)

    async def readiness(self) -> str:
        return self.reporter.readiness(self.role_change.draining)

    def health(self) -> dict:
        return {"kv_addr": self.messenger.addr, "model": self.config.model, "cluster": self.config.cluster,
                "draining_to": self.role_change.draining_to,
                "link_bandwidth": dict(self.pusher.bandwidth), "stats": self.gauges(),
                "kv_transport": self.config.kv_transport, "host_id": self.messenger.transfer.endpoint.host,
                "kv_transports_taken": list(self.messenger.transfer.endpoint.transports),
                "kv_links": {addr: {"transport": link.transport, "reason": link.reason}
                             for addr, link in self.pusher.links.items()},
                "measured_cost": msgspec.to_builtins(self.speed.measured()),
                "calibration": self.calibration_state()}


