"""PrfaaS §4 on the simulator: PrfaaS-PD, homogeneous PD and naive heterogeneous PD (Table 6's three
deployments) serve the paper's workload through the live Conductor core, with queues, a shared 100 Gbps
inter-cluster link and decode batches of BS_max; it measures the highest arrival rate each sustains.

    .venv/bin/python -m bench.papers.prfaas_sim     # ~1 min; bench/results/prfaas_sim.{json,png}

Inputs are those of bench/papers/prfaas_table6.py (bench/papers/PRFAAS.md): Table 5's H200 prefill and KV sizes, the
derived H20 prefill, decode at 25 ms per step with BS_max = 20, the truncated log-normal workload
(μ = 9.90, σ = 1.00 on [128, 128K], 1024 output tokens), t and the counts from the planner. The prefill
curves become the cost model's quadratic T(n) = p0 + p1·n + p3·n² (least squares on relative error, 1%
mean error), the KV size its affine S_kv(n) = fixed + n·per_token. Table 6 is the model without queues;
here requests arrive as a Poisson process and a rate counts as sustained when the waiting time (end to
end minus prefill and decode work) of neither the remote nor the local requests grows over the second
half of a 30-minute run (< 0.02 s/s) and stays under 60 s on average in its last fifth.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

from kvcentric.core.costmodel import CostModel
from kvcentric.tools.plan import PlanConfig, resolve
from kvcentric.core.prfaas.planner import best_threshold, plan
from kvcentric.core.prfaas.throughput import Counts, operating_point, route_workload
from kvcentric.core.prfaas.topology import Topology
from kvcentric.core.scheduling.clusters import ClusterSetup
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.sim.cluster import ClusterSpec, Simulation
from kvcentric.core.sim.workload import SimRequest
from bench import harness

BENCH = Path(__file__).resolve().parent
RESULTS = harness.RESULTS
BLOCK = 512
STEP_S, BS_MAX, OUTPUT = 0.025, 20, 1024
DURATION_S = 1800.0
"""Simulated seconds of arrivals per run."""


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str
    pd_prefill: int
    prfaas: int
    decode: int
    threshold: float | None
    """None: one cluster, no routing (homogeneous)."""
    adjust_s: float = 0.0


def fit_prefill(curve) -> tuple[float, float, float, float]:
    """Quadratic fit of a piecewise-linear profile curve over [128, 128K] (relative error)."""
    lengths = np.geomspace(128, 128 * 1024, 64)
    samples = [(int(n), 0, float(curve(n))) for n in lengths]
    model, errors = CostModel.fit(samples, [(1, 0, STEP_S), (10, 0, STEP_S), (20, 0, STEP_S)], 1)
    return model.prefill, errors["prefill"]


def cost_models(profile) -> tuple[CostModel, CostModel, dict]:
    """(H200 = PrfaaS, H20 = PD) cost models and their fit errors."""
    kv = profile.prfaas.kv
    per_token, fixed = np.polyfit(np.array(kv.lengths), np.array(kv.values), 1)
    h200, h200_err = fit_prefill(profile.prfaas.t_prefill)
    h20, h20_err = fit_prefill(profile.pd_prefill.t_prefill)
    decode = (STEP_S - BS_MAX * 1e-5, 1e-5, 0.0)  # 25 ms at BS_max; the small slope lets the conductor balance
    make = lambda prefill, name: CostModel(prefill, decode, int(per_token), name, int(fixed))  # noqa: E731
    fits = {"h200_prefill": list(h200), "h200_fit_error": h200_err, "h20_prefill": list(h20),
            "h20_fit_error": h20_err, "kv_bytes_per_token": int(per_token), "kv_bytes_fixed": int(fixed)}
    return make(h200, "8xH200 (Table 5 fit)"), make(h20, "8xH20 (derived, fit)"), fits


def workload(rate: float, seed: int, duration_s: float = DURATION_S) -> list[SimRequest]:
    """Poisson arrivals; lengths from the truncated log-normal of §4.1; no shared prefixes."""
    rng, now, requests = random.Random(seed), 0.0, []
    while now < duration_s:
        length = 0
        while not 128 <= length <= 128 * 1024:
            length = int(round(math.exp(rng.gauss(9.90, 1.00))))
        index = len(requests)
        hashes = [f"u{index}.{b}" for b in range(-(-length // BLOCK))]
        requests.append(SimRequest(f"r{index}", now, length, OUTPUT, hashes))
        now += rng.expovariate(rate)
    return requests


def simulation(d: Deployment, h200: CostModel, h20: CostModel, link_gbps: float) -> Simulation:
    scheduler = SchedulerConfig(rejection="never", block_size=BLOCK, link_gbps=800.0)
    spec = ClusterSpec(prefill=d.pd_prefill, decode=d.decode, prfaas=d.prfaas, decode_max_batch=BS_MAX,
                       link_bytes_per_s=800e9 / 8, num_layers=61)
    if d.threshold is None:
        return Simulation(scheduler, h20, spec)
    topology = Topology.from_dict({"clusters": [{"name": "pd", "role": "pd", "instances": d.pd_prefill + d.decode},
                                                {"name": "prfaas", "role": "prfaas", "instances": d.prfaas}],
                                   "links": [{"between": ["prfaas", "pd"], "gbps": link_gbps}]})
    setup = ClusterSetup(topology, "pd", d.threshold, d.adjust_s, costs={"prfaas": h200})
    return Simulation(scheduler, h20, spec, setup)


def run(d: Deployment, rate: float, h200: CostModel, h20: CostModel, link_gbps: float, seed: int = 0) -> dict:
    sim = simulation(d, h200, h20, link_gbps)
    records = sim.run(workload(rate, seed), sample_s=0)
    done = [r for r in records if r.status == "completed"]
    remote = [r for r in done if r.prefill_id.startswith("r")]
    arrival = np.array([r.request.arrival_s for r in done])
    work = np.array([(h200 if r.prefill_id.startswith("r") else h20).t_prefill(r.request.input_len)
                     + (OUTPUT - 1) * STEP_S for r in done])
    wait = np.array([r.finish - r.request.arrival_s for r in done]) - work
    ttft = np.array([r.ttft_s for r in done])
    is_remote = np.array([r.prefill_id.startswith("r") for r in done], dtype=bool)
    slope, last = growth(arrival, wait, is_remote)
    sent = sum(i.kv_bytes_sent for i in sim.prefills.values() if getattr(i, "remote", False))
    router = sim.conductor.router
    return {"rate": rate, "requests": len(records), "completed": len(done), "wait_slope": round(slope, 4),
            "sustained": slope < 0.02 and last < 60.0 and len(done) == len(records),
            "wait_mean_s": round(float(wait.mean()), 2), "wait_last_fifth_s": round(last, 2),
            "ttft_mean_s": round(float(ttft.mean()), 3), "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3),
            "offloaded": round(len(remote) / len(done), 4), "egress_gbps": round(sent * 8 / 1e9 / DURATION_S, 2),
            "final_threshold": router.threshold if router else None}


def growth(arrival: np.ndarray, wait: np.ndarray, is_remote: np.ndarray) -> tuple[float, float]:
    """Of the requests prefilled remotely and of those prefilled locally, the larger growth of the waiting
    time over the second half of the run (seconds per second) and the larger mean wait of the last fifth."""
    slope, last = 0.0, 0.0
    for part in (is_remote, ~is_remote):
        late, final = part & (arrival >= 0.5 * DURATION_S), part & (arrival >= 0.8 * DURATION_S)
        if late.sum() > 10:
            slope = max(slope, float(np.polyfit(arrival[late], wait[late], 1)[0]))
        if final.any():
            last = max(last, float(wait[final].mean()))
    return slope, last


def capacity(d: Deployment, h200, h20, link_gbps: float, grid: list[float]) -> tuple[float, list[dict]]:
    """The highest sustained rate: the grid, then bisection between the last sustained and the next rate."""
    runs, low, high = [], 0.0, None
    for rate in grid:
        result = run(d, rate, h200, h20, link_gbps)
        runs.append(result)
        if not result["sustained"]:
            high = rate
            break
        low = rate
    for _ in range(4 if high else 0):
        middle = round((low + high) / 2, 3)
        result = run(d, middle, h200, h20, link_gbps)
        runs.append(result)
        low, high = (middle, high) if result["sustained"] else (low, middle)
    return low, sorted(runs, key=lambda r: r["rate"])


def deployments(table6: dict) -> list[Deployment]:
    """Table 6's three columns with the planner's counts and t (bench/papers/prfaas_table6.py's optimum)."""
    counts = table6["counts"]
    return [Deployment("PrfaaS-PD", counts["pd_prefill"], counts["prfaas"], counts["decode"], table6["threshold"]),
            Deployment("homogeneous PD", 9, 0, 3, None),
            Deployment("naive heterogeneous PD", 0, counts["prfaas"], counts["pd_prefill"] + counts["decode"], 0.0)]


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (name, column), color in zip(result["deployments"].items(), ("C0", "C1", "C2")):
        runs = [r for r in column["runs"] if r["rate"] <= column["capacity_rps"] * 1.25]
        left.plot([r["rate"] for r in runs], [max(r["wait_mean_s"], 0.01) for r in runs], "o-", color=color,
                  label=f"{name}: sustains {column['capacity_rps']:.2f} (model {column['model_lambda_max']:.2f})")
        left.axvline(column["model_lambda_max"], color=color, ls=":", lw=1)
        ttft = sorted(column["at_common_rate"]["ttft_s"])
        right.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), color=color, label=name)
    left.set(yscale="log", xlabel="offered rate (req/s)", ylabel="mean waiting time (s)",
             title="Waiting vs offered rate (dotted: model Λ_max)")
    left.legend(fontsize=8)
    right.set(xscale="log", xlabel="TTFT (s)", ylabel="CDF", title=f"TTFT at {result['common_rate']} req/s")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure(d: Deployment, h200, h20, link_gbps: float, common_rate: float, light_rate: float) -> dict:
    grid = [round(1.0 + 0.25 * i, 2) for i in range(16)]
    sustained, runs = capacity(d, h200, h20, link_gbps, grid)
    light = run(d, light_rate, h200, h20, link_gbps, seed=1)
    common = run(d, common_rate, h200, h20, link_gbps, seed=2)
    sim_ttft = simulation(d, h200, h20, link_gbps)  # the TTFT CDF of the common-rate run, kept for the plot
    records = sim_ttft.run(workload(common_rate, 2), sample_s=0)
    common["ttft_s"] = [round(r.ttft_s, 3) for r in records if r.status == "completed"]
    return {"capacity_rps": sustained, "runs": runs, "light_load": light, "at_common_rate": common}


def link_study(profile, lengths, t: float, h200, h20, links=(10.0, 5.0)) -> list[dict]:
    """A scarcer link (§3.4.3): the planned t kept, t re-planned for the link (`best_threshold`), and t
    moved by the conductor's short-term rule every 5 s; sustained rate of each beside the model's."""
    grid, rows = [round(1.0 + 0.25 * i, 2) for i in range(12)], []
    for gbps in links:
        linked = profile.with_egress(gbps)
        counts = Counts(4, 3, 5)
        fixed_model = operating_point(linked, route_workload(linked, lengths, [t]), counts, OUTPUT).lambda_max
        replanned = best_threshold(linked, lengths, counts)
        row = {"link_gbps": gbps, "planned_t": t, "model_at_planned_t": round(fixed_model, 3),
               "replanned_t": round(replanned.threshold), "model_at_replanned_t": round(replanned.lambda_max, 3)}
        for key, d in (("planned", Deployment("PrfaaS-PD", 3, 4, 5, t)),
                       ("replanned", Deployment("PrfaaS-PD", 3, 4, 5, replanned.threshold)),
                       ("short_term", Deployment("PrfaaS-PD", 3, 4, 5, t, adjust_s=5.0))):
            sustained, runs = capacity(d, h200, h20, gbps, grid)
            at = next((r for r in runs if r["rate"] == sustained), {})
            row[f"sim_{key}"] = sustained
            row[f"t_after_{key}"] = round(at.get("final_threshold") or 0)
        rows.append(row)
        print(f"link {gbps:g} Gbps: sustained {row['sim_planned']:.2f} at t {t:,.0f} (model {fixed_model:.2f}), "
              f"{row['sim_replanned']:.2f} at re-planned t {row['replanned_t']:,} "
              f"(model {row['model_at_replanned_t']:.2f}), "
              f"{row['sim_short_term']:.2f} with short-term steps of t (ending at {row['t_after_short_term']:,})",
              flush=True)
    return rows


def main() -> int:
    started = time.monotonic()
    profile, lengths, n_prfaas, n_pd = resolve(PlanConfig(profile=str(BENCH / "prfaas_profile_table5.json"),
                                                          workload=str(BENCH / "prfaas_workload_table5.json"),
                                                          prfaas_instances=4, pd_instances=8))
    model = plan(profile, lengths, n_prfaas, n_pd, 12).to_dict()
    h200, h20, fits = cost_models(profile)
    keys = {"PrfaaS-PD": "prfaas_pd", "homogeneous PD": "homogeneous_pd",
            "naive heterogeneous PD": "naive_heterogeneous"}
    result = {"inputs": {"cost_models": fits, "link_gbps": profile.egress_gbps, "duration_s": DURATION_S,
                         "decode": {"step_s": STEP_S, "max_batch": BS_MAX}, "output_tokens": OUTPUT},
              "common_rate": 2.0, "light_rate": 0.2, "deployments": {}}
    for d in deployments(model["prfaas_pd"]):
        column = measure(d, h200, h20, profile.egress_gbps, result["common_rate"], result["light_rate"])
        column.update(dataclasses.asdict(d), model_lambda_max=model[keys[d.name]]["lambda_max"])
        result["deployments"][d.name] = column
        print(f"{d.name:<24} sustains {column['capacity_rps']:.2f} req/s (model Λ_max "
              f"{column['model_lambda_max']:.2f}); TTFT at {result['light_rate']} req/s "
              f"{column['light_load']['ttft_mean_s']:.2f} / {column['light_load']['ttft_p90_s']:.2f} s, at "
              f"{result['common_rate']} req/s {column['at_common_rate']['ttft_mean_s']:.2f} / "
              f"{column['at_common_rate']['ttft_p90_s']:.2f} s", flush=True)
    result["link_study"] = link_study(profile, lengths, model["prfaas_pd"]["threshold"], h200, h20)
    base = result["deployments"]["homogeneous PD"]["capacity_rps"]
    result["ratio_vs_homogeneous"] = {name: round(c["capacity_rps"] / base, 3)
                                      for name, c in result["deployments"].items()}
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    harness.write(RESULTS / "prfaas_sim.json", harness.record("prfaas_sim", **result))
    plot(result, RESULTS / "prfaas_sim.png")
    print(f"ratio vs homogeneous: {result['ratio_vs_homogeneous']}; {result['elapsed_s']} s; "
          f"wrote {RESULTS / 'prfaas_sim.json'} and prfaas_sim.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
