"""LayerKV's control in an engine (arXiv 2410.00428 §3.1): before each step it forecasts the free device blocks
(eq. 5) and offloads the retained layers of the newest decoding requests when they would run short (else swaps
the oldest ones' host layers back in while the forecast with them back allows: one layer ahead), then
decides whether the next queued prompt may start: its predicted prefill must fit the decoding requests' TPOT
budget (eqs. 1–3, Algorithm 1), and its blocks must fit with at least the layers eq. 4 says to keep (the
most that fit, spread over the depth). It learns the TPOT and the prefill correction α from the engine's own
step timings and the link from the copies `LayeredKV` times. On a prefill instance (no decode engine) only the
placement applies: a prompt starts once its blocks fit with its layers split between device and host. Time is
passed in; the arithmetic is `core.layerkv`'s; the copies are `engine/kv/layered.py`'s.
"""

from __future__ import annotations

import dataclasses

from kvcentric.core.costmodel import HARDWARE
from kvcentric.core.layerkv.placement import min_retained_layers
from kvcentric.core.layerkv.pool import LayerBlockPool
from kvcentric.core.layerkv.scheduler import (Decoding, Holding, PrefillCost, forecast_free, offload_victims,
                                              schedule_prefills)
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.kv.layered import LayeredKV
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.runner import ModelRunner

FORECAST_STAGES = 4
"""Stages of eq. 5's forecast, each a block's worth of decode steps."""
TPOT_WEIGHT = 0.2
"""How fast the TPOT estimate follows new decode steps (an exponential average)."""


class LayerKV:
    def __init__(self, pool: LayerBlockPool, layered: LayeredKV, tpot_slo_s: float, offload_threshold: float,
                 flops: float, decode_mode: str = "swap") -> None:
        """`tpot_slo_s`: 0 admits every prompt whose blocks fit (LayerKV without its SLO-aware scheduler);
        `offload_threshold`: the share of device layer blocks kept free (eq. 5's threshold); `decode_mode`:
        "swap", a request with host layers waits out of the decode batch until they are back (`held`), or
        "stream", it decodes reading them every step."""
        if decode_mode not in ("swap", "stream"):
            raise ValueError(f"decode_mode must be swap or stream, got {decode_mode!r}")
        config = layered.runner.config
        self.pool, self.layered, self.config = pool, layered, config
        self.decode_mode = decode_mode
        self.tpot_slo_s = tpot_slo_s
        self.reserve = int(offload_threshold * pool.device_layer_blocks)
        self.cost = PrefillCost(config.num_params, config.num_layers, config.hidden_size, flops)
        self.tpot_s = 0.0
        self.decoding_since: dict[str, float] = {}
        self.queued_since: dict[str, float] = {}
        self.stats = {"layerkv_prefills_admitted": 0, "layerkv_held_for_slo": 0, "layerkv_held_for_blocks": 0,
                      "layerkv_forecast_offloads": 0, "layerkv_swap_ins": 0, "layerkv_queue_delay_s_sum": 0.0,
                      "layerkv_decode_held_steps": 0,
                      "layerkv_retained_layers_sum": 0, "layerkv_min_retained_layers_sum": 0}

    # ---------------------------------------------------------------- before each step

    def admit(self, prefill: PrefillEngine, decode: DecodeEngine | None, now: float) -> bool:
        """Whether the prefill side may run this step; when it starts a prompt, `pool.placement` says which of
        its layers stay on the device (`placed` clears it after the prefill engine allocated). `decode`: None
        on a prefill instance, where no request decodes: no TPOT budget, no forecast, and no device blocks
        reserved for growth (a prompt's blocks are all allocated when it starts)."""
        self._note(prefill, decode, now)
        if decode is not None and not self.offload_if_short(decode):
            self.reload_if_room(decode)
        if prefill.running or not prefill.queue:
            return True
        seqlen = len(prefill.queue[0].token_ids)
        decoding = self.decoding(decode, now) if decode is not None else []
        admission = schedule_prefills([seqlen], decoding, self.tpot_slo_s, self.tpot_s, self.cost)
        if admission.admitted == 0:
            self.stats["layerkv_held_for_slo"] += 1
            return False
        config = self.config
        at_least = min_retained_layers(config.num_layers, admission.prefill_s[0], seqlen, config.num_kv_heads,
                                       config.head_dim, self.layered.runner.k_cache.element_size(),
                                       self.layered.bandwidth_bps)
        reserve = self.reserve if decode is not None else 0
        layers = self.pool.fitting_layers(self.pool.blocks_for(seqlen), at_least, reserve)
        if layers is None:
            self.stats["layerkv_held_for_blocks"] += 1
            return False
        self.pool.placement = layers
        self.stats["layerkv_retained_layers_sum"] += len(layers)
        self.stats["layerkv_min_retained_layers_sum"] += at_least
        return True

    def unplaceable(self, seqlen: int) -> str:
        """Why a prompt of `seqlen` tokens could never start here, even with every block free ("" if it could):
        its layers fit neither a layer's device blocks nor, all of them, the host memory."""
        blocks = self.pool.blocks_for(seqlen)
        if self.pool.can_ever_place(blocks):
            return ""
        return (f"prompt of {seqlen} tokens: its {blocks} blocks fit no layer's {self.pool.device_blocks} device "
                f"blocks, and its {blocks * self.pool.num_layers} layer blocks exceed the "
                f"{self.pool.host_blocks} of host memory (--layerkv-host-mb)")

    def placed(self, prefill: PrefillEngine, now: float) -> None:
        """The prefill engine has allocated (or not): later allocations are a decoding request's growth."""
        self.pool.placement = None
        for request_id in prefill.running:
            since = self.queued_since.pop(request_id, None)
            if since is not None:
                self.stats["layerkv_prefills_admitted"] += 1
                self.stats["layerkv_queue_delay_s_sum"] += now - since

    def _note(self, prefill: PrefillEngine, decode: DecodeEngine | None, now: float) -> None:
        self.queued_since = {job.request_id: self.queued_since.get(job.request_id, now) for job in prefill.queue}
        if decode is None:
            return
        running = {r.key for r in decode.requests.values() if r.state == "running"}
        for key in running - self.decoding_since.keys():
            self.decoding_since[key] = now
        for key in self.decoding_since.keys() - running:
            del self.decoding_since[key]

    def decoding(self, decode: DecodeEngine, now: float) -> list[Decoding]:
        """Eq. 1's inputs per decoding request; the remaining tokens predicted by its length limit."""
        return [Decoding(now - self.decoding_since.get(r.key, now), len(r.generated), _remaining(r))
                for r in decode.requests.values() if r.state == "running"]

    def offload_if_short(self, decode: DecodeEngine) -> list[str]:
        """Eq. 5: forecast the free device layer blocks; below the threshold, the newest requests' device
        layers go to the host (the copies run before the next step). Returns the requests offloaded."""
        running = [r for r in reversed(decode.requests.values()) if r.state == "running" and r.blocks]
        holdings = self.holdings(running)
        victims = set(offload_victims(self.forecast(self.pool.device_free_layer_blocks, holdings), self.reserve,
                                      holdings))
        for request in running:
            if request.key in victims:
                self.pool.offload(request.blocks)
        self.stats["layerkv_forecast_offloads"] += len(victims)
        return [r.key for r in running if r.key in victims]

    def reload_if_room(self, decode: DecodeEngine) -> int:
        """Swap in: bring decoding requests' host layers back into device blocks, oldest request first, while
        eq. 5's forecast with them back stays at or above the threshold (so the next step's forecast does not
        offload them again); from then on they decode in place. The copies run one layer ahead of each layer's
        compute in the next step. Returns the layer blocks brought back."""
        running = [r for r in decode.requests.values() if r.state == "running" and r.blocks]
        holdings = self.holdings(running)
        moved = 0
        for index, request in enumerate(running):
            on_host = self.pool.host_layer_blocks_of(request.blocks)
            if not on_host:
                continue
            holding = holdings[index]
            back = dataclasses.replace(holding, device_layer_blocks=holding.device_layer_blocks + on_host)
            trial = [*holdings[:index], back, *holdings[index + 1:]]
            if min(self.forecast(self.pool.device_free_layer_blocks - on_host, trial)) < self.reserve:
                break
            reloaded = self.pool.reload(request.blocks)
            moved += reloaded
            self.stats["layerkv_swap_ins"] += reloaded > 0
            holdings[index] = self.holdings([request])[0]
        return moved

    def held(self, decode: DecodeEngine) -> set[str]:
        """With "swap": the decoding requests that sit out this step because some of their layers are in host
        memory (`reload_if_room` brings them back, oldest first, when eq. 5's forecast has room). So that
        someone always decodes, the oldest waits no longer once every running request would wait. Nothing is
        held with "stream"."""
        if self.decode_mode != "swap":
            return set()
        running = [r for r in decode.requests.values() if r.state == "running"]
        waiting = [r.key for r in running if r.blocks and self.pool.host_layer_blocks_of(r.blocks)]
        if waiting and len(waiting) == len(running):
            waiting = waiting[1:]
        self.stats["layerkv_decode_held_steps"] += len(waiting)
        return set(waiting)

    def holdings(self, running: list[DecodeRequest]) -> list[Holding]:
        return [Holding(r.key, _remaining(r), self.pool.device_layer_blocks_of(r.blocks), self.pool.num_layers)
                for r in running]

    def forecast(self, free_now: int, holdings: list[Holding]) -> list[int]:
        return forecast_free(free_now, holdings, FORECAST_STAGES, self.pool.block_size)

    # ---------------------------------------------------------------- after each step

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A prefill chunk's measured time refits eq. 3's α."""
        if new_tokens > 0 and seconds > 0:
            self.cost = self.cost.refit(new_tokens, seconds, cached_tokens)

    def observe_decode(self, seconds: float) -> None:
        """A decode step's measured time: the current TPOT of eq. 1."""
        if seconds > 0:
            self.tpot_s = seconds if self.tpot_s <= 0 else (1 - TPOT_WEIGHT) * self.tpot_s + TPOT_WEIGHT * seconds

    def gauges(self) -> dict[str, float]:
        return {**self.stats, **self.pool.stats, **self.layered.stats,
                "layerkv_copy_bandwidth_bps": self.layered.bandwidth_bps, "layerkv_tpot_s": self.tpot_s,
                "layerkv_prefill_alpha": self.cost.alpha,
                "layerkv_device_layer_blocks_free": self.pool.device_free_layer_blocks,
                "layerkv_host_layer_blocks_free": len(self.pool.host_free)}


def _remaining(request: DecodeRequest) -> int:
    return max(1, request.job.sampling.max_tokens - len(request.generated))


def layer_wise(runner: ModelRunner, config: EngineConfig) -> LayerKV:
    """LayerKV for an engine with `--layerkv`: its pool (the device cache's blocks per layer, `--layerkv-host-mb`
    of host layer blocks; it replaces the plain pool), its layered execution (from now on the runner's) with
    the copy bandwidth probed, and its control."""
    layer_block_bytes = 2 * config.block_size * runner.layer_token_bytes
    pool = LayerBlockPool(config.num_kv_blocks, config.block_size, runner.config.num_layers,
                          (config.layerkv_host_mb << 20) // layer_block_bytes)
    layered = LayeredKV(runner, pool)
    layered.probe_bandwidth()
    return LayerKV(pool, layered, config.layerkv_tpot_slo_s, config.layerkv_offload_threshold,
                   HARDWARE[config.hardware].flops, config.layerkv_decode)
