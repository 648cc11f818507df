"""Prefill-as-a-Service (PrfaaS, Qin et al. 2026): the throughput model, planner, routing rules and topology.

Pure, synchronous code: it computes what the paper's §3.3–§3.4 decide (where a request prefills, the
threshold t, the N_p/N_d split, role changes); it sends nothing and starts nothing.

- `profile`    what `kvcentric plan --profile` reads: prefill latency and KV size by length per hardware
- `workload`   uncached-length distributions: truncated log-normal, explicit lengths, Mooncake traces
- `throughput` equations (3)–(6): Θ_prfaas, Θ_pd-p, Θ_pd-d and Λ_max at one operating point
- `planner`    the grid search of §3.4.2 over t and N_p/N_d, with the two baselines of Table 6
- `report`     the Table-6-style text, the plan JSON and Figure 5's two plots
- `replan`     the long-term role change of §3.4.3 from measured pool load
- `routing`    the short-term routing rules of §3.3 and §3.4.3
- `topology`   clusters and inter-cluster links from JSON or YAML
- `inputs`     field-checked readers shared by the three input files
- `cli`        `kvcentric plan`
"""
