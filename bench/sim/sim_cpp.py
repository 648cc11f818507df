"""Chunked pipeline parallelism at paper scale (Mooncake §5.1), in the simulator: TTFT of one prompt alone in a
cluster of LLaMA2-70B on 8xA800 nodes (the roofline of `--model llama2-70b --hardware 8xA800-800gbps`), for
prompt lengths 1K..128K, on one prefill node and on pipelined prefill groups of X = 2 and 4 nodes (chunks of
512 tokens). The simulator drives the live Conductor core, which places the request on the group and
predicts its TTFT with the group's pipelined T_prefill; hidden-state hops between nodes are not modelled
(8192 x 2 bytes x 512 tokens = 8 MiB a chunk, about 0.1 ms at 800 Gbps).

Usage:
    .venv/bin/python -m bench.sim.sim_cpp

Writes bench/results/sim_cpp.json and bench/results/sim_cpp.png.
"""

from __future__ import annotations

from bench.sim.common import RESULTS, pyplot, save_json

from kvcentric.core.sim.workload import SimRequest
from kvcentric.tools.sim import SimConfig, build

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
GROUPS = [1, 2, 4]


def ttft(stages: int, length: int) -> tuple[float, float]:
    """Simulated and conductor-predicted TTFT of one prompt of `length` tokens."""
    simulation, _ = build(SimConfig(prefill=1, decode=1, prefill_pipeline=stages, rejection="never", progress=False,
                                    plots=False, sample_s=0))
    blocks = -(-length // 512)
    record = simulation.run([SimRequest("r", 0.0, length, 1, [f"x{length}-{i}" for i in range(blocks)])], 0)[0]
    return record.ttft_s, record.predicted_ttft_s


def main() -> None:
    rows = []
    for length in LENGTHS:
        row: dict = {"prompt_tokens": length}
        for stages in GROUPS:
            simulated, predicted = ttft(stages, length)
            row[f"x{stages}_ttft_s"], row[f"x{stages}_predicted_s"] = round(simulated, 4), round(predicted, 4)
        for stages in GROUPS[1:]:
            row[f"x{stages}_speedup"] = round(row["x1_ttft_s"] / row[f"x{stages}_ttft_s"], 3)
        rows.append(row)
        print(f"{length:>7} tokens: " + "  ".join(f"X={s}: {row[f'x{s}_ttft_s']:.3f} s" for s in GROUPS), flush=True)
    save_json("sim_cpp.json", {"model": "llama2-70b", "hardware": "8xA800-800gbps", "chunk": 512, "rows": rows})
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for stages in GROUPS:
        label = "1 node" if stages == 1 else f"group of {stages} nodes"
        axis.plot(LENGTHS, [r[f"x{stages}_ttft_s"] for r in rows], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("TTFT (s), prompt alone")
    axis.set_title("Chunked pipeline parallelism, LLaMA2-70B on 8xA800 (sim)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "sim_cpp.png", dpi=120)
    print(f"wrote {RESULTS / 'sim_cpp.json'} and sim_cpp.png")


if __name__ == "__main__":
    main()
