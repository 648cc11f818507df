"""`kvcentric plan`: files in, the Table-6-style text out, plan.json and the Figure 5 PNGs written."""

import json
import shlex
from pathlib import Path

import pytest

from kvcentric.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench" / "papers" / "prfaas_profile_table5.json"
WORKLOAD = ROOT / "bench" / "papers" / "prfaas_workload_table5.json"


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_plan_prints_the_optimum_and_writes_json_and_plots(tmp_path, capsys):
    code, out, _ = run(["plan", "--profile", str(PROFILE), "--workload", str(WORKLOAD), "--prfaas-instances", "4",
                        "--pd-instances", "8", "--out", str(tmp_path)], capsys)
    assert code == 0
    assert "N_prfaas / N_p / N_d" in out and "4 / 3 / 5" in out and "— / 9 / 3" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["prfaas_pd"]["counts"] == {"prfaas": 4, "pd_prefill": 3, "decode": 5}
    assert data["profile"]["egress_gbps"] == 100
    for png in ("plan_split.png", "plan_threshold.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_takes_counts_and_bandwidth_from_a_topology(tmp_path, capsys):
    topology = tmp_path / "t.yaml"
    topology.write_text("clusters:\n  - {name: a, role: pd, instances: 8}\n  - {name: b, role: prfaas, instances: 4}\n"
                        "links:\n  - {between: [a, b], gbps: 10}\n")
    code, out, _ = run(["plan", "--profile", str(PROFILE), "--workload", str(WORKLOAD), "--topology", str(topology),
                        "--no-plots", "--out", str(tmp_path)], capsys)
    assert code == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["inputs"]["egress_gbps"] == 10 and data["inputs"]["n_prfaas"] == 4
    assert not (tmp_path / "plan_split.png").exists()


def test_plan_names_the_bad_field(tmp_path, capsys):
    bad = tmp_path / "p.json"
    profile = json.loads(PROFILE.read_text())
    profile["decode"]["step_s"] = -1
    bad.write_text(json.dumps(profile))
    code, _, err = run(["plan", "--profile", str(bad), "--workload", str(WORKLOAD), "--prfaas-instances", "4",
                        "--pd-instances", "8"], capsys)
    assert code == 2 and "profile: decode.step_s: must be > 0" in err


def test_plan_requires_its_inputs(capsys):
    code, _, err = run(["plan", "--workload", str(WORKLOAD), "--prfaas-instances", "4", "--pd-instances", "8"], capsys)
    assert code == 2 and "--profile: required" in err
    code, _, err = run(["plan", "--profile", str(PROFILE), "--workload", str(WORKLOAD)], capsys)
    assert code == 2 and "--pd-instances" in err and "--topology" in err


def test_the_readme_example_runs_and_prints_what_the_readme_shows(tmp_path, capsys, monkeypatch):
    readme = (ROOT / "docs" / "papers.md").read_text()
    section = readme.split("## Prefill-as-a-Service planner", 1)[1].split("\n## ", 1)[0]
    commands = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    line = next(c for c in commands.splitlines() if c.startswith("kvcentric plan"))
    argv = shlex.split(line.split("#")[0])[1:]
    argv[argv.index("--out") + 1] = str(tmp_path)
    monkeypatch.chdir(ROOT)
    code, out, _ = run(argv, capsys)
    assert code == 0
    shown = section.split("The output of that second command:\n\n```\n", 1)[1].split("```", 1)[0]
    printed = [row.rstrip() for row in out.splitlines()]
    assert shown.splitlines() == printed[:len(shown.splitlines())]
