"""The examples of README.md, docs/*.md and CONTRIBUTING.md run as tests: every `sh` block against a live
cluster, the Python blocks (the OpenAI client against the same cluster), and the runnable `bash` blocks
(`kvcentric sim`, `kvcentric plan`, the replays, one unit test) in an empty directory or the checkout, checked
against the output the documents print. A block that cannot run here is listed in NOT_RUN with the reason,
and its `kvcentric` commands are still parsed and validated by the real CLI; a new block that is in neither
list fails `test_every_block_is_run_or_has_a_reason`.

The only edits to a block before it runs are the ones listed next to it (each must still apply, or the
test fails): the cluster's port for 127.0.0.1:8000, and smaller inputs where the documents' own would take
minutes here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]
"""Every document whose examples run here."""
TEXTS = [path.read_text() for path in DOCUMENTS]
README = TEXTS[0]
EXAMPLES = [body for text in TEXTS for body in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]
FENCED = [found for text in TEXTS for found in re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, flags=re.S | re.M)]
BASH = [body for language, body in FENCED if language == "bash"]
PYTHON = [body for language, body in FENCED if language == "python"]
PORT = "{port}"
"""Stands for the test cluster's gateway port in a substitution."""


@dataclasses.dataclass(frozen=True)
class Run:
    """How a block runs: the edits made to it first, (old, new) each, and whether it needs the cluster."""

    edits: tuple[tuple[str, str], ...] = ()
    cluster: bool = False
    timeout_s: float = 60.0
    in_checkout: bool = False
    """Run in the checkout itself (a block that reads the tests), not in an empty directory."""


TO_THE_CLUSTER = (("127.0.0.1:8000", f"127.0.0.1:{PORT}"),)

RUN_BASH = {
    ".venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_scheduling_eviction.py": Run(
        in_checkout=True, timeout_s=120.0),
    ".venv/bin/python -m kvcentric.engine.model.kernels": Run(in_checkout=True, timeout_s=180.0),
    "kvcentric sim --speed 2": Run(),
    "--prefill-pipeline 4 --out sim-cpp": Run(),
    "python -m bench.papers.prfaas_table6": Run(),
    "kvcentric certs --out secure": Run(),
    "kvcentric bench replay ../shared/traces/": Run(cluster=True, edits=(
        ("kvcentric up --model tiny &\n", ""),  # the test's cluster serves `tiny` already
        *TO_THE_CLUSTER,
        ("--limit 500", "--limit 4"),  # 500 requests take minutes; the first 4 lines all arrive at t = 0
    )),
    "kvcentric bench replay poisson": Run(cluster=True, edits=(
        ("kvcentric up --prefill 1 --decode 1 --port 8000 &   # then, once it is ready:\n", ""),
        ("kvcentric up --colocated 2 --port 8001 &\n", ""),  # both replays go to the test's 1P+1D cluster
        *TO_THE_CLUSTER, ("127.0.0.1:8001", f"127.0.0.1:{PORT}"),
        ("--rps 2 --num-requests 200 --input-len 1536", "--rps 8 --num-requests 4 --input-len 64"),
        ("--output-len 128", "--output-len 8"),
    )),
}
NOT_RUN = {
    "make up ": "`make up` serves until Ctrl-C and `make test` is this suite; "
                "test_the_readme_leads_with_the_two_commands checks the block",
    "kvcentric kvs-meta  --nats-url nats://10.0.0.1:4222": "addresses of five other machines (10.0.0.x)",
    ".venv/bin/python -m bench.papers.prfaas_live": "~30 s, and it writes bench/results/ in the checkout; "
                                             "tests/integration/test_prfaas_live.py runs a small version of it",
    "# datacenter B (PrfaaS)": "hosts nats-a and nats-b of two datacenters, and a topology.json of its own",
    "kvcentric role decode-1 prefill": "it switches a live instance's role; the shared test cluster has no "
                                       "decode-1 and its instances serve other tests "
                                       "(tests/integration/test_role_switch.py switches one)",
    "OTEL_EXPORTER_OTLP_ENDPOINT=": "a cluster that serves until Ctrl-C, exporting to a collector on :4317; "
                                    "tests/integration/test_tracing_e2e.py runs `kvcentric up` with these variables",
    "--prefill-pipeline 2 --decode 1   # serves until Ctrl-C": "a cluster that serves until Ctrl-C; "
                                                             "tests/integration/test_pipeline_prefill.py runs it",
    "docker compose up --build": "needs docker; tests/unit/test_compose.py checks docker-compose.yml",
    "apt-get install -y libsimde-dev": "installs a system package (root and the network); make test runs "
                                       "tests/unit/test_cpu_isa.py, these cases included where SIMDe is installed",
    "python3 -m bench.engine.bench_gpu --eager-too": "needs a GPU; bench/engine/gpu_check.sh runs it there, and "
                                             "tests/integration/test_bench_gpu.py runs a CPU smoke of it",
    "docker compose -f docker-compose.prfaas.yml up --build ": "needs docker; tests/unit/test_compose_prfaas.py "
                                                               "checks the file",
    "docker compose -f docker-compose.yml -f docker-compose.secure.yml up": "needs docker: "
        "tests/deploy/test_compose_secure_live.py runs it as written (`make compose-check`)",
    "docker compose -f docker-compose.prfaas.yml -f docker-compose.prfaas.secure.yml up": "needs docker: "
        "tests/deploy/test_compose_prfaas_secure_live.py runs it as written (`make compose-check`)",
    "kvcentric up --secure --port 8443": "a cluster that serves until Ctrl-C, and a request to it with the paths "
                                         "of its log dir; tests/integration/test_security.py runs `kvcentric up "
                                         "--secure` and sends that request with its CA and API key",
}
RUN_PYTHON = {"from openai import OpenAI": Run(cluster=True, edits=TO_THE_CLUSTER),
              "class FIFOPolicy": Run()}
NOT_RUN_PYTHON = {
    "tracing.capture()": "a fragment of engine code (it needs a bus span, a request id `rid`, and elides with "
                         "`...`); tests/integration/test_tracing_e2e.py checks the spans the engines make with it",
}


def block(blocks: list[str], key: str) -> str:
    found = [body for body in blocks if key in body]
    assert len(found) == 1, f"{len(found)} blocks of {', '.join(p.name for p in DOCUMENTS)} contain {key!r}"
    return found[0]


def edited(script: str, run: Run, port: int | None) -> str:
    for old, new in run.edits:
        assert old in script, f"the README block no longer contains {old!r}: update the edit"
        script = script.replace(old, new.replace(PORT, str(port)))
    return script


def workdir(tmp_path: Path, script: str) -> Path:
    """An empty directory beside a link to ../shared (the traces), holding a copy of the bench package (its
    scripts and inputs, not its results) when the block runs one (`python -m bench.<group>.<name>`), so that
    what it writes stays out of the checkout."""
    cwd = tmp_path / "main"
    (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    if re.search(r"-m bench\.", script):
        shutil.copytree(ROOT / "bench", cwd / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    (cwd / "bench" / "results").mkdir(parents=True)
    return cwd


def run_script(argv: list[str], cwd: Path, timeout_s: float) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


# ---------------------------------------------------------------- sh: curl against the cluster


def test_the_readme_leads_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    assert first_block.splitlines()[0].startswith("make up") and "make test" in first_block.splitlines()[1]
    assert README.index("make up") < README.index("## ")


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 3 and len(BASH) >= len(RUN_BASH) and PYTHON


@pytest.mark.parametrize("example", EXAMPLES)
def test_readme_example_runs(cluster, example):
    script = example.replace("127.0.0.1:8000", f"127.0.0.1:{cluster.port}")
    result = subprocess.run(["bash", "-eo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    output = result.stdout.strip()
    if "stream" in script:
        assert output.endswith("data: [DONE]")
    else:
        decoder, position = json.JSONDecoder(), 0
        while position < len(output):  # one JSON document per curl, back to back
            body, position = decoder.raw_decode(output, position)
            assert "error" not in body
            position = len(output) - len(output[position:].lstrip())


# ---------------------------------------------------------------- python and bash blocks


@pytest.mark.parametrize("blocks, listed", [(BASH, {**RUN_BASH, **NOT_RUN}),
                                             (PYTHON, {**RUN_PYTHON, **NOT_RUN_PYTHON})], ids=["bash", "python"])
def test_every_block_is_run_or_has_a_reason(blocks, listed):
    for body in blocks:
        keys = [key for key in listed if key in body]
        assert len(keys) == 1, f"README block matched by {keys}; run it here or give a reason:\n{body}"
    for key in listed:
        block(blocks, key)  # no stale entry


@pytest.mark.parametrize("key", sorted(RUN_PYTHON))
def test_readme_python_example_runs(request, tmp_path, key):
    run = RUN_PYTHON[key]
    port = request.getfixturevalue("cluster").port if run.cluster else None
    output = run_script([sys.executable, "-c", edited(block(PYTHON, key), run, port)], tmp_path, run.timeout_s)
    assert output.endswith("\n")  # the completion's text, printed


@pytest.mark.parametrize("key", sorted(RUN_BASH))
def test_readme_bash_block_runs(request, tmp_path, key):
    run = RUN_BASH[key]
    port = request.getfixturevalue("cluster").port if run.cluster else None
    script = edited(block(BASH, key), run, port)
    cwd = ROOT if run.in_checkout else workdir(tmp_path, script)
    output = run_script(["bash", "-eo", "pipefail", "-c", script], cwd, run.timeout_s)
    for comment in re.findall(r"#\s*(\{.*\})\s*$", script, flags=re.M):  # `# {"hit_ratio": ...}`: what it prints
        assert json.loads(comment) in [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    check_outputs(key, cwd, output)


def check_outputs(key: str, cwd: Path, output: str) -> None:
    """What each block must leave behind, and the output the README shows for it."""
    if key.startswith("kvcentric sim"):
        for out in ("sim-out", "sim-colocated"):
            assert json.loads((cwd / out / "summary.json").read_text())["completed"] > 0
    elif key.startswith("python -m bench.papers.prfaas_table6"):
        shown = re.search(r"The output of that second command:\n\n```\n(.*?)```", "\n".join(TEXTS),
                          flags=re.S).group(1)
        lines = [line.rstrip() for line in output.splitlines()]
        start = lines.index(shown.splitlines()[0].rstrip())
        assert lines[start:start + len(shown.splitlines())] == [line.rstrip() for line in shown.splitlines()]
        assert (cwd / "plan-out" / "plan.json").exists()
    elif key.startswith("kvcentric bench replay ../"):
        summary = json.loads((cwd / "replay-out" / "summary.json").read_text())
        assert summary["requests"] == 4 and summary["completed"] == 4, summary
    elif key.startswith("kvcentric bench replay poisson"):
        for run in ("pd", "colocated"):
            summary = json.loads((cwd / "runs" / run / "summary.json").read_text())
            assert summary["completed"] == 4, summary
        compared = json.loads((cwd / "bench" / "results" / "pd_vs_colocated.json").read_text())
        assert set(compared) == {"1P+1D", "2-colocated"}
    elif key.startswith(".venv/bin/python -m kvcentric.engine.model.kernels"):
        differences = [float(found) for found in re.findall(r"max \|kernel - [^|]*\| = (\S+)", output)]
        assert len(differences) == 4 and max(differences) < 1e-4, output  # decode, prefill, SwiGLU, RMSNorm
        assert "grammar masks, the same logits as torch's where: True" in output, output
    elif key.startswith("kvcentric certs"):
        folder = cwd / "secure"
        assert (folder.stat().st_mode & 0o777) == 0o700 and "wrote the CA" in output
        for name in ("ca.pem", "nats.pem", "service.pem", "gateway.pem", "api-keys", "nats-passwords.env"):
            assert name in output.split() and (folder / name).exists(), name
    elif key.startswith(".venv/bin/python -m pytest"):
        assert re.search(r"\b\d+ passed\b", output) and "failed" not in output, output[-2000:]


# ---------------------------------------------------------------- blocks that do not run here


def commands(script: str) -> list[list[str]]:
    """The `kvcentric ...` commands of a block, as argv (continuations joined, comments, leading
    VAR=value settings and a trailing & dropped)."""
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"\w+=\S*", argv[0]):
            argv.pop(0)
        if argv and argv[-1] == "&":
            argv.pop()
        if argv[:1] == ["kvcentric"]:
            found.append(argv[1:])
    return found


@pytest.mark.parametrize("key", sorted(k for k in NOT_RUN if any(k in body and commands(body) for body in BASH)))
def test_the_commands_of_a_block_not_run_here_are_valid(key):
    """Its flags parse with the real CLI, and each service's settings pass its config's validation."""
    from kvcentric.cli import SERVICES, _config_class, build_parser
    from kvcentric.config import from_namespace
    from kvcentric.tools.up import UpConfig

    for argv in commands(block(BASH, key)):
        if argv[:1] == ["certs"]:  # its own parser (`kvcentric.tools.secure`)
            from kvcentric.tools.secure import certs_parser
            certs_parser().parse_args(argv[1:])
            continue
        args = build_parser().parse_args(argv)
        if args.command == "up":
            from_namespace(UpConfig, args)
        elif args.command in SERVICES and not getattr(args, "topology", ""):  # a topology file of its own
            from_namespace(_config_class(args.command), args)
