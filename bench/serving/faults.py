"""The fault-injection figures of issue 15 on this machine: every scenario of tests/faults (the same code the
suite asserts with) run once on one `kvcentric up` cluster, written to bench/results/faults.json with the
machine, and printed as the README's table. It asserts nothing; `make test` runs the assertions.

    .venv/bin/python bench/faults.py                       # every scenario, about 4 minutes on an idle 2-core box
    .venv/bin/python bench/faults.py --only kill          # the scenarios whose name holds "kill"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "faults")]  # the test harness, the scenarios

from scenarios import FAULTS, GRACE_S, cluster, problems, run  # noqa: E402

COLUMNS = ("sent", "completed", "failed_cleanly", "hung", "failed_otherwise", "blocks_leaked", "recovery_s")
HEADINGS = ("fault", "sent", "completed", "failed cleanly (429/503)", "hung (past the bound)", "failed otherwise",
            "blocks leaked", "s to recover", "bound s", "met")


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        model = ""
    import torch
    return (f"{platform.machine()} {model}, {os.cpu_count()} cpus, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at start")


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADINGS) + " |", "|" + "---|" * len(HEADINGS)]
    for row in rows:
        recovery = "never" if row["recovery_s"] is None else f"{row['recovery_s']:g}"
        cells = [row["fault"], *(str(row[column]) for column in COLUMNS[:-1]), recovery, f"{row['bound_s']:g}",
                 "yes" if row["met"] else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the scenarios whose name holds this")
    parser.add_argument("--out", default=str(HERE / "results" / "faults.json"))
    args = parser.parse_args()
    described, started = machine(), time.monotonic()
    rows = []
    with cluster() as up:
        for fault in (f for f in FAULTS if args.only in f.name):
            figured, wrong = run(up, fault)
            found = problems(figured, wrong)
            rows.append({**figured.as_row(), "met": not found, "problems": found})
            print(json.dumps(rows[-1]), flush=True)
    result = {"machine": described, "grace_s": GRACE_S, "seconds": round(time.monotonic() - started, 1),
              "scenarios": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"{described}; {result['seconds']} s; written to {args.out}")


if __name__ == "__main__":
    main()
