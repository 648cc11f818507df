"""How long `kvcentric sim` takes to replay the whole conversation trace on 8P+8D (target: under 60 s),
run as a user would run it: the command line, plots included.

Usage: .venv/bin/python -m bench.sim.sim_speed   -> bench/results/sim_speed.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

from bench.sim.common import save_json


def main() -> None:
    rows = []
    for flags in ([], ["--speed", "2"], ["--architecture", "colocated", "--instances", "16"],
                  ["--architecture", "colocated", "--instances", "16", "--chunked-prefill"]):
        with tempfile.TemporaryDirectory() as out:
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "kvcentric", "sim", "--out", out, "--no-progress", *flags],
                                    capture_output=True, text=True, check=True)
            wall = time.monotonic() - started
        summary = json.loads(result.stdout)
        rows.append({"flags": " ".join(flags) or "(defaults: 8P+8D, 1x)", "wall_s": round(wall, 2),
                     "requests": summary["requests"], "sim_wall_s": summary["sim_wall_s"]})
        print(rows[-1])
    save_json("sim_speed.json", {"benchmark": "kvcentric sim, whole conversation trace", "target_s": 60, "runs": rows})


if __name__ == "__main__":
    main()
