"""`kvcentric sim`: replay a trace or a Poisson workload on a simulated cluster and write summary.json,
requests.jsonl, load.json and PNG plots; `kvcentric sim cache`: hit ratios of one global block pool.
It parses flags, builds the simulation from presets, and writes results; the modelling is elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Literal

from kvcentric.config import ConfigError, add_arguments, from_namespace, require, setting
from kvcentric.core.costmodel import (HARDWARE, CostModel, decode_capacity_tokens, hardware, host_cache_blocks,
                                      load_cost_model)
from kvcentric.model.config import PRESETS, preset
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.eviction import EVICTION_POLICIES, EvictionName, parse_capacity
from kvcentric.core.sim.cachesim import replay_pool
from kvcentric.core.sim.cluster import ClusterSpec, Progress, Simulation
from kvcentric.core.sim.metrics import summarize, write_results
from kvcentric.core.sim.slo import TBT_FACTOR, TTFT_FACTOR, Slos, load_reference, normalised_p90s, relative_slos
from kvcentric.core.sim.workload import load_trace, poisson_workload

def _shared_folder() -> Path:
    """$KVC_SHARED, else `shared/` inside the repository, else `shared/` beside it (as the tests resolve it)."""
    repo = Path(__file__).resolve().parents[3]
    if os.environ.get("KVC_SHARED"):
        return Path(os.environ["KVC_SHARED"])
    return repo / "shared" if (repo / "shared").is_dir() else repo.parent / "shared"


DEFAULT_TRACE = str(_shared_folder() / "traces" / "conversation_trace.jsonl")
"""The FAST'25 conversation trace in the `shared/` folder (see `_shared_folder`)."""


@dataclasses.dataclass(frozen=True)
class SimConfig(SchedulerConfig):
    block_size: int = setting(512, "tokens per prefix-hash block (Mooncake traces: 512)")
    link_gbps: float = setting(800.0, "KV transfer bandwidth of each instance, Gbit/s (Mooncake §8: 800 Gbps RDMA)")
    workload: Literal["trace", "poisson"] = setting("trace", "replay --trace, or generate Poisson arrivals")
    trace: str = setting(DEFAULT_TRACE, "Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    speed: float = setting(1.0, "replay speed: arrival times are divided by this")
    limit: int = setting(0, "replay only the first N requests (0: all)")
    rps: float = setting(1.0, "poisson: requests per second")
    num_requests: int = setting(1000, "poisson: number of requests")
    input_len: int = setting(8192, "poisson: prompt tokens")
    output_len: int = setting(256, "poisson: output tokens")
    cache_ratio: float = setting(0.5, "poisson: share of each prompt that is a shared prefix")
    architecture: Literal["disaggregated", "colocated"] = setting("disaggregated", "P prefill + D decode, "
                                                                  "or N colocated instances (vLLM-like)")
    prefill: int = setting(8, "prefill instances (disaggregated)")
    decode: int = setting(8, "decode instances (disaggregated)")
    instances: int = setting(16, "colocated instances")
    chunked_prefill: bool = setting(False, "colocated: mix prompt chunks into decode steps")
    prefill_chunk: int = setting(2048, "colocated chunked prefill: tokens per step (decode sequences included)")
    cache_blocks: str = setting("auto", "prefix-cache blocks per instance: a number, inf, or auto (host DRAM "
                                        "of --hardware / KV bytes of a block)")
    eviction: EvictionName = setting("lru", "prefix-cache eviction policy")
    model: str = setting("llama2-70b", "model preset (shapes for the roofline and memory sizes)")
    hardware: str = setting("8xA800-800gbps", f"hardware preset: {', '.join(HARDWARE)}")
    profile: str = setting("", "cost model JSON from `kvcentric profile` (default: roofline of --model on --hardware)")
    prefill_profile: str = setting("", "disaggregated: cost model JSON of the prefill pool, which then differs from "
                                       "the rest (a mixed fleet); its instances announce it, and the conductor "
                                       "predicts each instance with its own model (default: as --profile)")
    decode_profile: str = setting("", "disaggregated: cost model JSON of the decode pool (default: as --profile)")
    prefill_pipeline: int = setting(1, "disaggregated: nodes of each prefill instance; X > 1 makes each a pipelined "
                                       "prefill group of X nodes (Mooncake §5.1, chunked pipeline parallelism) "
                                       "that pipelines chunks of 512 tokens")
    decode_kv_tokens: int = setting(0, "KV tokens a decode instance holds (0: from --hardware memory)")
    decode_max_batch: int = setting(0, "disaggregated: most sequences a decode instance runs at once, BS_max "
                                       "(0: only its KV capacity limits the batch)")
    slo_reference: str = setting("", "summary.json (or its folder) of a run at the lowest rate: the SLOs become "
                                     "--ttft-slo-factor and --tbt-slo-factor times its P90 TTFT and P90 TBT "
                                     "(Mooncake §2, §8.1), replacing --ttft-slo-s and --tbt-slo-s, and the "
                                     "plots are normalised by them")
    ttft_slo_factor: float = setting(TTFT_FACTOR, "with --slo-reference: TTFT SLO = this × unloaded P90 TTFT")
    tbt_slo_factor: float = setting(TBT_FACTOR, "with --slo-reference: TBT SLO = this × unloaded P90 TBT")
    noise: float = setting(0.0, "lognormal sigma of execution-time noise (0: exact cost model)")
    low_priority_share: float = setting(0.0, "this share of requests (seeded draw) gets priority -1, the rest 0")
    sample_s: float = setting(1.0, "load sampled every this many simulated seconds (0: never)")
    out: str = setting("sim-out", "output directory")
    plots: bool = setting(True, "write PNG plots (needs matplotlib)")
    progress: bool = setting(True, "progress line on stderr")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.speed > 0, "speed", "must be positive")
        require(min(self.prefill, self.decode, self.instances) >= 1, "prefill", "instance counts must be >= 1")
        require(self.prefill_pipeline >= 1, "prefill_pipeline", "must be at least 1")
        require(self.prefill_chunk >= 16, "prefill_chunk", "must be at least 16")
        if self.cache_blocks != "auto":
            try:
                parse_capacity(self.cache_blocks)
            except ValueError as exc:
                require(False, "cache_blocks", str(exc))
        require(0 <= self.low_priority_share <= 1, "low_priority_share", "must be in [0, 1]")
        require(self.decode_max_batch >= 0, "decode_max_batch", "must be >= 0")
        require(self.ttft_slo_factor > 0 and self.tbt_slo_factor > 0, "ttft_slo_factor", "factors must be positive")
        require(self.ttft_slo_s > 0 and self.tbt_slo_s > 0, "ttft_slo_s",
                "the simulator's SLOs are absolute: give seconds, or --slo-reference for relative ones")
        require(self.model in PRESETS, "model", f"choose a preset: {', '.join(PRESETS)}")
        require(self.hardware in HARDWARE, "hardware", f"choose one of {', '.join(HARDWARE)}")
        for name in ("prefill_profile", "decode_profile"):
            if getattr(self, name):
                try:
                    CostModel.load(getattr(self, name))
                except (OSError, ValueError) as exc:
                    require(False, name, str(exc))

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)})


def build(config: SimConfig) -> tuple[Simulation, dict]:
    """The simulation and a description of what it models (kept in summary.json)."""
    model, spec = preset(config.model), hardware(config.hardware)
    cost = load_cost_model(config.profile, config.model, config.hardware)
    capacity = config.decode_kv_tokens or decode_capacity_tokens(model, spec)
    blocks = host_cache_blocks(model, spec, config.block_size) if config.cache_blocks == "auto" else \
        parse_capacity(config.cache_blocks)
    cluster = ClusterSpec(config.architecture, config.prefill, config.decode, config.instances,
                          config.prefill_chunk if config.chunked_prefill else 0, blocks, config.eviction, capacity,
                          config.link_bytes_per_s, model.num_layers, config.noise, config.seed,
                          decode_max_batch=config.decode_max_batch, prefill_pipeline=config.prefill_pipeline)
    about = {"cost_model": cost.to_dict(), "cache_blocks_per_instance": blocks,
             "decode_capacity_tokens": capacity, "config": dataclasses.asdict(config)}
    pools = {role: CostModel.load(path) for role, path in (("prefill", config.prefill_profile),
                                                           ("decode", config.decode_profile)) if path}
    about["pool_cost_models"] = {role: pool.to_dict() for role, pool in pools.items()}
    return Simulation(config.scheduler, cost, cluster, pool_costs=pools), about


def workload(config: SimConfig):
    if config.workload == "poisson":
        requests = poisson_workload(config.rps, config.num_requests, config.input_len, config.output_len,
                                    config.cache_ratio, config.block_size, seed=config.seed)
    else:
        requests = load_trace(config.trace, config.speed, config.limit)
    if config.low_priority_share > 0:
        rng = random.Random(config.seed)
        for request in requests:
            request.priority = -1 if rng.random() < config.low_priority_share else 0
    return requests


def with_slos(config: SimConfig) -> tuple[SimConfig, Slos]:
    """The config with its SLOs made relative to --slo-reference (if given), and the SLOs in force."""
    if not config.slo_reference:
        return config, Slos(config.ttft_slo_s, config.tbt_slo_s)
    slos = relative_slos(load_reference(config.slo_reference), config.ttft_slo_factor, config.tbt_slo_factor)
    return dataclasses.replace(config, ttft_slo_s=slos.ttft_s, tbt_slo_s=slos.tbt_s), slos


def run(config: SimConfig) -> dict:
    """Run one simulation and write its results under --out; returns the summary."""
    started = time.monotonic()
    config, slos = with_slos(config)
    requests = workload(config)
    simulation, about = build(config)
    progress = Progress(len(requests), sys.stderr) if config.progress else None
    records = simulation.run(requests, config.sample_s, progress)
    if progress is not None:
        progress.close()
    summary = summarize(records, config.ttft_slo_s, config.tbt_slo_s)
    summary.update(normalised_p90s(summary, slos), slos=slos.to_dict())
    summary["sim_wall_s"] = round(time.monotonic() - started, 2)
    summary["conductor"] = {k: round(v, 4) for k, v in simulation.conductor.stats.items()}
    out = Path(config.out)
    write_results(out, {**summary, **about}, records, simulation.series)
    if config.plots:
        from kvcentric.tools.sim_plots import plot_run
        plot_run(out, records, simulation.series, config.ttft_slo_s, config.tbt_slo_s,
                 normalised=bool(config.slo_reference))
    return summary


def cache_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvcentric sim cache", description=(
        "Hit ratio of one global block pool replaying a trace in arrival order (Mooncake Table 1)."))
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    parser.add_argument("--policy", default="lru", choices=EVICTION_POLICIES)
    parser.add_argument("--capacity", default="inf", help="pool capacity in blocks, or inf")
    parser.add_argument("--limit", type=int, default=0, help="only the first N requests (0: all)")
    args = parser.parse_args(argv)
    try:
        capacity = parse_capacity(args.capacity)
        requests = load_trace(args.trace, limit=args.limit)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"kvcentric sim cache: error: {exc}\n")
    result = replay_pool(requests, args.policy, capacity)
    print(json.dumps({"hit_ratio": round(result["hit_ratio"], 4),
                      "prefix_hit_ratio": round(result["prefix_hit_ratio"], 4)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcentric sim", description=(
        "Simulate a cluster serving a trace with the live Conductor core. "
        "`kvcentric sim cache --help` for the global-pool cache hit ratio."))
    add_arguments(parser, SimConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cache"]:
        return cache_main(argv[1:])
    parser = build_parser()
    try:
        config = from_namespace(SimConfig, parser.parse_args(argv))
        summary = run(config)
    except ConfigError as exc:
        parser.exit(2, f"kvcentric sim: error: {exc}\n")
    except (ValueError, OSError) as exc:
        parser.exit(1, f"kvcentric sim: {exc}\n")
    keys = ("requests", "completed", "completed_within_slo", "rejected_before_prefill", "rejected_after_prefill",
            "ttft_mean_s", "ttft_p90_s", "tbt_p90_s", "ttft_p90_normalised", "tbt_p90_normalised", "slo_attainment",
            "goodput_rps", "prefix_hit_ratio",
            "sim_wall_s")
    print(json.dumps({k: round(summary[k], 4) if isinstance(summary[k], float) else summary[k] for k in keys}))
    print(f"results in {config.out}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
