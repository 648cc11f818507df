"""LayerKV on versus off at the paper's scale, simulated: Llama-2-7B on one A100-class GPU (the roofline cost
model), a vLLM-0.5-style iteration loop (an iteration prefills the prompts admitted, else decodes the batch;
newest preempted and recomputed when blocks run out), Poisson arrivals of 1K–4K-token prompts at rising rates.
LayerKV's decisions are the engine's own pure parts: `LayerBlockPool` placement (eq. 4 and the most layers that
fit), the SLO-aware admission (eqs. 1–3, Algorithm 1) and the eq. 5 forecast with its offloads. A decode step
with host-resident layers takes the longer of its compute and the reload of those layers over PCIe (the copy
runs one layer ahead, beside the compute); the prefill's offload is hidden (eq. 4 keeps enough layers).

Usage: .venv/bin/python -m bench.sim.sim_layerkv [--rates 0.5,1,2,3,4] [--duration-s 300] [--device-tokens 20000]
Writes bench/results/layerkv_sim.json and bench/results/layerkv_sim.png.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import random
import statistics
from pathlib import Path

from bench.serving.bench_layerkv import A100, CONFIGS, PAPER_TPOT_SLO_S, PAPER_TTFT_SLO_S, percentile, plot

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.costmodel import CostModel
from kvcentric.core.layerkv.placement import min_retained_layers
from kvcentric.core.layerkv.pool import LayerBlockPool
from kvcentric.core.layerkv.scheduler import (Decoding, Holding, PrefillCost, forecast_free, offload_victims,
                                              schedule_prefills)
from kvcentric.model.config import preset
from bench import harness

RESULTS = harness.RESULTS
BLOCK = 16
MAX_BATCHED_TOKENS = 8192
"""Prompt tokens one prefill iteration takes at most (vLLM's max_num_batched_tokens)."""


@dataclasses.dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    generated: int = 0
    first_at: float | None = None
    last_at: float = 0.0
    blocks: list[int] = dataclasses.field(default_factory=list)
    on_host: int = 0
    """Layer blocks it holds on the host (kept up to date by `Simulation.count`)."""
    on_device: int = 0


class Simulation:
    def __init__(self, config: str, args, cost: CostModel) -> None:
        self.config, self.args, self.cost = config, args, cost
        self.model = preset("llama2-7b")
        self.layer_block_bytes = 2 * BLOCK * self.model.num_kv_heads * self.model.head_dim * 2
        blocks = args.device_tokens // BLOCK
        self.pool: BlockPool = BlockPool(blocks, BLOCK) if config == "vllm" else \
            LayerBlockPool(blocks, BLOCK, self.model.num_layers, int(args.host_gb * 2 ** 30) // self.layer_block_bytes)
        self.prefill_cost = PrefillCost(self.model.num_params, self.model.num_layers, self.model.hidden_size,
                                        A100.flops * A100.mfu)
        self.tpot_slo_s = PAPER_TPOT_SLO_S if config == "layerkv" else 0.0
        self.reserve = int(args.threshold * blocks * self.model.num_layers)
        self.queue: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.now, self.tpot_s = 0.0, 0.0
        self.stats = collections.Counter()

    # ---------------------------------------------------------------- one iteration

    def iterate(self) -> None:
        inbound = 0
        if isinstance(self.pool, LayerBlockPool) and not self.offload_if_short():
            inbound = self.reload_if_room()
        admitted = self.admit()
        if admitted:
            self.now += sum(self.cost.t_prefill(r.prompt + r.generated) for r in admitted)
            for request in admitted:
                request.first_at = request.first_at if request.generated else self.now
                request.last_at, request.generated = self.now, max(1, request.generated)
                self.running.append(request)
            return
        self.grow()
        if not self.running:
            return
        batch = self.running
        if self.args.decode == "swap":  # only requests whose every layer is on the device, as vLLM's swap-in
            batch = [r for r in self.running if r.on_host == 0] or self.running
        context = sum(r.prompt + r.generated for r in batch)
        compute = self.cost.t_decode(len(batch), context)
        streamed = sum(r.on_host for r in batch)
        reload = (inbound + streamed) * self.layer_block_bytes / self.args.pcie_gbps / 1e9
        step = max(compute, reload)
        self.stats["reload_bound_steps"] += reload > compute
        self.now += step
        self.tpot_s = step if not self.tpot_s else 0.8 * self.tpot_s + 0.2 * step
        for request in list(batch):
            request.generated += 1
            request.last_at = self.now
            if request.generated >= request.output:
                self.running.remove(request)
                self.pool.free(request.blocks)
                request.blocks = []

    def admit(self) -> list[Request]:
        """The prompts this iteration prefills: vLLM's while their blocks fit; LayerKV's Algorithm 1."""
        admitted: list[Request] = []
        tokens, budget_used = 0, 0.0
        while self.queue and tokens + self.queue[0].prompt <= MAX_BATCHED_TOKENS:
            request = self.queue[0]
            needed = self.pool.blocks_for(request.prompt + request.generated + 1)
            if isinstance(self.pool, LayerBlockPool):
                if not self.layerkv_fits(request, needed, budget_used):
                    break
                budget_used += self.prefill_cost.seconds(request.prompt)
            elif not self.pool.can_allocate(needed):
                break
            request.blocks = self.pool.allocate(needed)
            if isinstance(self.pool, LayerBlockPool):
                self.pool.placement = None
                self.count(request)
            admitted.append(self.queue.popleft())
            tokens += request.prompt
        return admitted

    def layerkv_fits(self, request: Request, needed: int, budget_used: float) -> bool:
        assert isinstance(self.pool, LayerBlockPool)
        decoding = [Decoding(self.now - (r.first_at or self.now), r.generated, max(1, r.output - r.generated))
                    for r in self.running]
        admission = schedule_prefills([request.prompt], decoding, self.tpot_slo_s, self.tpot_s, self.prefill_cost)
        if budget_used + admission.prefill_s[0] > admission.budget_s:
            self.stats["held_for_slo"] += 1
            return False
        at_least = min_retained_layers(self.model.num_layers, self.cost.t_prefill(request.prompt), request.prompt,
                                       self.model.num_kv_heads, self.model.head_dim, 2, self.args.pcie_gbps * 1e9)
        layers = self.pool.fitting_layers(needed, at_least, self.reserve)
        if layers is None:
            self.stats["held_for_blocks"] += 1
            return False
        self.pool.placement = layers
        self.stats["prompt_layers_offloaded"] += self.model.num_layers - len(layers)
        return True

    def grow(self) -> None:
        """A block more for each request that fills its last one; the newest preempted when none is left."""
        for request in list(self.running):
            if request not in self.running or self.pool.blocks_for(request.prompt + request.generated + 1) <= \
                    len(request.blocks):
                continue
            while not self.pool.can_allocate(1):
                victim = self.running.pop()
                self.pool.free(victim.blocks)
                victim.blocks = []
                self.queue.appendleft(victim)  # recomputed: its prompt and what it generated
                self.stats["preemptions"] += 1
                if victim is request:
                    break
            if request in self.running:
                request.blocks += self.pool.allocate(1)
                if isinstance(self.pool, LayerBlockPool):
                    self.count(request, request.blocks[-1:])

    def host_layer_blocks(self) -> int:
        return sum(r.on_host for r in self.running)

    def count(self, request: Request, blocks: list[int] | None = None) -> None:
        """Its layer blocks on the host and the device: all again, or those of `blocks` added."""
        assert isinstance(self.pool, LayerBlockPool)
        if blocks is None:
            request.on_host = request.on_device = 0
        on_host = self.pool.host_layer_blocks_of(request.blocks if blocks is None else blocks)
        request.on_host += on_host
        request.on_device += len(request.blocks if blocks is None else blocks) * self.model.num_layers - on_host

    def reload_if_room(self) -> int:
        """The engine's policy: the oldest requests' host layers come back while the device has room."""
        assert isinstance(self.pool, LayerBlockPool)
        spare = self.pool.device_free_layer_blocks - self.reserve - len(self.running) * self.model.num_layers
        moved = 0
        for request in self.running:
            if request.on_host > spare:
                break
            if request.on_host:
                spare -= request.on_host
                moved += self.pool.reload(request.blocks)
                self.pool.take_inbound()
                self.count(request)
        return moved

    def offload_if_short(self) -> bool:
        assert isinstance(self.pool, LayerBlockPool)
        newest = list(reversed(self.running))
        holdings = [Holding(str(id(r)), max(1, r.output - r.generated), r.on_device, self.model.num_layers)
                    for r in newest]
        forecast = forecast_free(self.pool.device_free_layer_blocks, holdings, 4, BLOCK)
        victims = set(offload_victims(forecast, self.reserve, holdings))
        for request in newest:
            if str(id(request)) in victims:
                self.pool.offload(request.blocks)
                self.pool.take_moves()
                self.count(request)
                self.stats["forecast_offloads"] += 1
        return bool(victims)

    # ---------------------------------------------------------------- the run

    def run(self, load: list[Request]) -> dict:
        pending = collections.deque(load)
        cap = 20 * self.args.duration_s
        while (pending or self.queue or self.running) and self.now < cap:
            if not self.queue and not self.running:
                self.now = max(self.now, pending[0].arrival)
            while pending and pending[0].arrival <= self.now:
                self.queue.append(pending.popleft())
            self.iterate()
        return self.summary(load)

    def summary(self, load: list[Request]) -> dict:
        done = [r for r in load if r.generated >= r.output and r.first_at is not None]
        ttft = [r.first_at - r.arrival for r in load if r.first_at is not None]
        tpot = [(r.last_at - r.first_at) / max(1, r.generated - 1) for r in done if r.first_at is not None]
        violated = sum(1 for r in load if r not in done or (r.first_at or math.inf) - r.arrival > PAPER_TTFT_SLO_S
                       or (r.last_at - (r.first_at or 0)) / max(1, r.generated - 1) > PAPER_TPOT_SLO_S)
        return {"config": self.config, "requests": len(load), "completed": len(done),
                "ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_p90_s": percentile(ttft, 0.9),
                "tpot_p90_s": percentile(tpot, 0.9), "throughput_rps": len(done) / self.now if self.now else 0.0,
                "slo_violation_rate": violated / len(load) if load else 0.0, "stats": dict(self.stats)}


def workload(rate: float, args, seed: int) -> list[Request]:
    rng, now, out = random.Random(seed), 0.0, []
    while True:
        now += rng.expovariate(rate)
        if now > args.duration_s:
            return out
        out.append(Request(now, rng.randint(args.min_prompt, args.max_prompt),
                           rng.randint(args.min_output, args.max_output)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.5,1,1.5,2,3,4")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--min-prompt", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=4096)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--device-tokens", type=int, default=20000, help="device KV cache, tokens (all layers)")
    parser.add_argument("--host-gb", type=float, default=256.0)
    parser.add_argument("--pcie-gbps", type=float, default=25.0, help="host-device copy bandwidth, GB/s")
    parser.add_argument("--threshold", type=float, default=0.1)
    parser.add_argument("--decode", choices=("stream", "swap"), default="stream",
                        help="stream: host layers are read over PCIe every step (this engine); swap: a request "
                             "decodes only once its layers are back on the device (the paper's vLLM base)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "layerkv_sim.json"))
    args = parser.parse_args()
    cost = CostModel.roofline(preset("llama2-7b"), A100)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for config in CONFIGS:
            row = {"rate": rate, **Simulation(config, args, cost).run(workload(rate, args, args.seed))}
            rows.append(row)
            print(json.dumps(row))
    result = {"bench": "layerkv_sim", "where": f"simulated, A100 roofline, decode={args.decode}", "model": "llama2-7b",
              "args": vars(args), "ttft_slo_s": PAPER_TTFT_SLO_S, "tpot_slo_s": PAPER_TPOT_SLO_S, "rows": rows}
    harness.write(args.out, result)
    plot(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
