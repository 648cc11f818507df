"""The fault-injection figures of issue 15 on this machine: every scenario of tests/faults (the same code the
suite asserts with) run once on one `kvcentric up` cluster, written to bench/results/faults.json with the
machine, and printed as the table in docs/operations.md. It asserts nothing; `make test` runs the assertions.

    PYTHONPATH=tests:tests/faults .venv/bin/python -m bench.serving.faults               # every scenario
    PYTHONPATH=tests:tests/faults .venv/bin/python -m bench.serving.faults --only kill   # only those named *kill*
"""

from __future__ import annotations

import argparse
import json
import time
from bench import harness

try:  # tests/faults' modules import their siblings by name, so both folders go on PYTHONPATH
    from scenarios import FAULTS, GRACE_S, cluster, problems, run
except ImportError as missing:
    raise SystemExit(f"{missing}: run as PYTHONPATH=tests:tests/faults python -m bench.serving.faults") from None


COLUMNS = ("sent", "completed", "failed_cleanly", "hung", "failed_otherwise", "blocks_leaked", "recovery_s")
HEADINGS = ("fault", "sent", "completed", "failed cleanly (429/503)", "hung (past the bound)", "failed otherwise",
            "blocks leaked", "s to recover", "bound s", "met")


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
    parser.add_argument("--out", default=str(harness.RESULTS / "faults.json"))
    args = parser.parse_args()
    described, started = harness.machine(), time.monotonic()
    rows = []
    with cluster() as up:
        for fault in (f for f in FAULTS if args.only in f.name):
            figured, wrong = run(up, fault)
            found = problems(figured, wrong)
            rows.append({**figured.as_row(), "met": not found, "problems": found})
            print(json.dumps(rows[-1]), flush=True)
    result = {"machine": described, "grace_s": GRACE_S, "seconds": round(time.monotonic() - started, 1),
              "scenarios": rows}
    harness.write(args.out, result)
    print(table(rows))
    print(f"{described['cpu']}, {described['cores']} cores; {result['seconds']} s; written to {args.out}")


if __name__ == "__main__":
    main()
