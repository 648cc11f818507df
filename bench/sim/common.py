"""Helpers the paper reproductions share: build and run one simulation from SimConfig overrides, keep its
summary, save JSON, and get a headless pyplot. It runs `kvcentric.sim`; it models nothing itself."""

from __future__ import annotations

import time
from pathlib import Path

from kvcentric.tools.sim import SimConfig, build, workload
from kvcentric.core.sim.metrics import summarize
from bench import harness

RESULTS = harness.RESULTS
_traces: dict = {}


def simulate(**overrides) -> tuple[dict, list, object]:
    """(summary, records, load series) of one run; the trace is loaded once per (path, speed)."""
    config = SimConfig(progress=False, plots=False, **overrides)
    key = (config.workload, config.trace, config.speed, config.limit)
    if key not in _traces:
        _traces[key] = workload(config)
    started = time.monotonic()
    simulation, about = build(config)
    records = simulation.run(_traces[key], config.sample_s)
    summary = summarize(records, config.ttft_slo_s, config.tbt_slo_s)
    summary["sim_wall_s"] = round(time.monotonic() - started, 2)
    summary["conductor_stats"] = dict(simulation.conductor.stats)
    summary["settings"] = {k: v for k, v in overrides.items()}
    return summary, records, simulation.series


def save_json(name: str, data) -> Path:
    """Write `data` to bench/results/NAME with the machine record (the harness's result shape)."""
    return harness.write(RESULTS / name, data, indent=2)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def brief(summary: dict, *keys: str) -> dict:
    return {k: round(summary[k], 4) if isinstance(summary[k], float) else summary[k] for k in keys}

