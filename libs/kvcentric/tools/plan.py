"""`kvcentric plan`: reads a profile and a workload, runs the PrfaaS planner, prints the Table-6-style
optimum and writes plan.json and Figure 5's two PNGs; it changes no cluster (the conductor applies plans).

    kvcentric plan --profile P.json --workload W.json --prfaas-instances 4 --pd-instances 8 --out DIR
    kvcentric plan --profile P.json --workload W.json --topology T.yaml --out DIR

The profile format is in `kvcentric.core.prfaas.profile`, the workload's in `kvcentric.core.prfaas.workload`,
the topology's in `kvcentric.core.prfaas.topology` (README "Prefill-as-a-Service planner" has examples).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Literal

from kvcentric.config import ConfigError, require, setting


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    profile: str = setting("", "profile JSON/YAML: prefill latency and KV size by length per hardware, "
                               "decode rate, egress Gbps (kvcentric.core.prfaas.profile)")
    workload: str = setting("", "workload JSON/YAML: lognormal, lengths or a Mooncake trace "
                                "(kvcentric.core.prfaas.workload)")
    out: str = setting("", "folder for plan.json, plan_split.png and plan_threshold.png (none: print only)")
    topology: str = setting("", "topology JSON/YAML; gives the instance counts and B_out unless the flags do")
    prfaas_instances: int = setting(0, "N_prfaas, instances of the PrfaaS cluster (0: from --topology)")
    pd_instances: int = setting(0, "N_p + N_d, instances of the local PD cluster (0: from --topology)")
    homogeneous_instances: int = setting(0, "size of the homogeneous-PD baseline (0: prfaas + pd instances)")
    egress_gbps: float = setting(0.0, "B_out in Gbit/s, overriding the profile's and the topology's (0: keep)")
    threshold_points: int = setting(1000, "log-spaced thresholds t in the grid search")
    mode: Literal["representative", "expected"] = setting(
        "representative", "service time per side: T(E[L]) as PrfaaS §3.4.1, or E[T(L)]")
    plots: bool = setting(True, "write the two PNGs of Figure 5 (needs matplotlib)")

    def __post_init__(self) -> None:
        require(bool(self.profile), "profile", "required: a profile JSON file")
        require(bool(self.workload), "workload", "required: a workload JSON file")
        require(self.prfaas_instances >= 0, "prfaas_instances", f"must be >= 0, got {self.prfaas_instances}")
        require(self.pd_instances >= 0, "pd_instances", f"must be >= 0, got {self.pd_instances}")
        require(self.homogeneous_instances >= 0, "homogeneous_instances", "must be >= 0")
        require(self.egress_gbps >= 0, "egress_gbps", f"must be >= 0, got {self.egress_gbps}")
        require(self.threshold_points >= 2, "threshold_points", f"must be >= 2, got {self.threshold_points}")
        require(bool(self.topology) or (self.prfaas_instances > 0 and self.pd_instances > 0), "pd_instances",
                "give --prfaas-instances and --pd-instances (both >= 1), or --topology")


def resolve(config: PlanConfig):
    """(profile, workload, n_prfaas, n_pd) from the files and flags; InputError/ConfigError name the field."""
    from kvcentric.core.prfaas.profile import PrfaasProfile
    from kvcentric.core.prfaas.topology import Topology
    from kvcentric.core.prfaas.workload import load_workload
    profile = PrfaasProfile.load(config.profile)
    workload = load_workload(config.workload)
    n_prfaas, n_pd = config.prfaas_instances, config.pd_instances
    if config.topology:
        topo_prfaas, topo_pd, topo_gbps = Topology.load(config.topology).planner_counts()
        n_prfaas, n_pd = n_prfaas or topo_prfaas, n_pd or topo_pd
        if topo_gbps > 0:
            profile = profile.with_egress(topo_gbps)
    require(n_prfaas > 0, "prfaas_instances", "no PrfaaS instances (the topology has no prfaas cluster)")
    require(n_pd > 0, "pd_instances", "no PD instances")
    if config.egress_gbps > 0:
        profile = profile.with_egress(config.egress_gbps)
    return profile, workload, n_prfaas, n_pd


def main(config: PlanConfig) -> int:
    from kvcentric.tools import plan_report as report
    from kvcentric.core.prfaas.inputs import InputError
    from kvcentric.core.prfaas.planner import plan
    try:
        profile, workload, n_prfaas, n_pd = resolve(config)
    except (InputError, ConfigError) as exc:
        print(f"kvcentric plan: error: {exc}", file=sys.stderr)
        return 2
    result = plan(profile, workload, n_prfaas, n_pd, config.homogeneous_instances or None,
                  config.threshold_points, config.mode)
    print(report.table(result))
    if config.out:
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        report.write_json(result, out / "plan.json", profile=profile.to_dict())
        written = [out / "plan.json"]
        if config.plots:
            report.plot_split_search(result, out / "plan_split.png")
            report.plot_threshold_search(result, out / "plan_threshold.png")
            written += [out / "plan_split.png", out / "plan_threshold.png"]
        print("wrote " + ", ".join(str(p) for p in written))
    return 0
