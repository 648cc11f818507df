"""kvcentric next to a real vLLM on this machine: the same random-weight Llama checkpoint (`small`, 24 M, and
`medium`, 136 M: --shapes) served by
`kvcentric up --colocated 1` (2 threads), `kvcentric up --prefill 1 --decode 1` (1 thread each) and vLLM's
OpenAI server (fp32, its defaults, 2 threads), measured in interleaved rounds by one streaming client; each
figure is given as a ratio to vLLM's in the same round, and greedy outputs are compared. vLLM stays up for the
whole run and one kvcentric cluster at a time beside it (`Turns`; --together: all of them), each turn once the
machine is quiet, with the servers not measured frozen (SIGSTOP) so that none idles beside another's figures
(--no-freeze: they idle, as in the runs before 2026-11-27 19:30 UTC).

Each shape is measured on each instruction set named by --isa: `native` as the CPU is, `avx2` with every side
capped to AVX2 (our kernels built for x86-64-v3, torch's ATen kernels and oneDNN capped through
ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, vLLM's too), so an AVX-512 machine measures the AVX2 path as well.
Every prompt is drawn afresh for its shape, instruction set, round and test: none was sent before to any
server, so no figure is a prefix-cache hit.

It needs the peer installed in a venv of its own (`bench/serving/vllm_peer/setup.sh`); without it, it says so and exits
0 (skipped). It is never run by `make test`.

Usage:
    bench/serving/vllm_peer/setup.sh /work/vllm-venv
    .venv/bin/python -m bench.serving.bench_vs_vllm [--peer-venv /work/vllm-venv] [--rounds 3]
        [--only "colocated mixed"] [--shapes small medium] [--isa native avx2]

Writes bench/results/vs_vllm_<shape>_<isa>.json and .png (--out: the stem) and prints each ratio table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
from bench import harness
from bench.harness import cpu_isa_flags, cpu_model  # noqa: F401 (the benches beside it read them from here)

from bench.serving.vllm_peer.checkpoint import build_checkpoint, build_small_checkpoint  # noqa: F401 (bench_alone imports it)
from bench.harness import UpProcess


RESULTS = harness.RESULTS
ISA_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"KVC_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
"""The environment every server of a run gets, per instruction set (`--isa`): vLLM reads the torch and oneDNN
caps as ours does."""
DEPLOYMENTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "colocated split": (["--colocated", "1"], {"KVC_STEP_TOKENS": "0"}),
    "colocated mixed": (["--colocated", "1"], {"KVC_STEP_TOKENS": "2048"}),
    "colocated mixed slices": (["--colocated", "1"], {"KVC_STEP_TOKENS": "2048", "KVC_DECODE_ATTENTION": "slices"}),
    "1P+1D": (["--prefill", "1", "--decode", "1"], {}),
    "1P+1D own cores": (["--prefill", "1", "--decode", "1", "--no-lend-cores"], {}),
    "1P+1D SLO 0.5 s": (["--prefill", "1", "--decode", "1", "--tbt-slo-s", "0.5", "--lend-pace-s", "0.4"], {}),
}
"""`kvcentric up` flags and engine settings (environment) of each deployment measured. `1P+1D SLO 0.5 s`: the
decode paces itself at 0.4 s in a burst instead of 80 ms (0.8 of the TBT SLO, 0.1 s by default), so a burst's
time between tokens is near vLLM's own (its 2048-token steps take 0.4 s here) and the prefill has more of the
cores meanwhile: where 1P+1D's throughput is traded for the isolation its default SLO keeps."""
TESTS = ("ttft_s", "tbt_s", "burst_tokens_per_s", "concurrent_tokens_per_s", "burst_tbt_p99_s")
TEST_NAMES = {"ttft_s": "TTFT, {input_len}-token prompt", "tbt_s": "mean time between tokens",
              "burst_tokens_per_s": "{requests} requests at once, output tok/s",
              "concurrent_tokens_per_s": "{requests} requests at concurrency {concurrency}, output tok/s",
              "burst_tbt_p99_s": "{requests} requests at once, 99th percentile time between tokens"}
PLOT_LABELS = {"ttft_s": "TTFT\n(lower better)", "tbt_s": "TBT\n(lower better)",
               "burst_tokens_per_s": "tok/s at once\n(higher better)",
               "concurrent_tokens_per_s": "tok/s conc. 8\n(higher better)",
               "burst_tbt_p99_s": "p99 TBT at once\n(lower better)"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"),
                        help="venv made by bench/serving/vllm_peer/setup.sh")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "kvc-vllm-{shape}"),
                        help="where each shape's shared random checkpoint is built (kept between runs)")
    parser.add_argument("--shapes", nargs="+", default=["small", "medium"], choices=["small", "medium"],
                        help="model shapes measured, one after another (presets of kvcentric.model.config)")
    parser.add_argument("--isa", nargs="+", default=["native"], choices=list(ISA_ENV),
                        help="instruction sets measured: native, and/or capped to AVX2 on every side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="vLLM's OpenMP threads (bound to cores 0..N-1)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens of the throughput tests")
    parser.add_argument("--tbt-output-len", type=int, default=128, help="output tokens of the TBT test")
    parser.add_argument("--ttft-prompts", type=int, default=9,
                        help="prompts of the TTFT test, one at a time, in each round (the round's figure is their "
                             "median: a median of 3 moved by a quarter between rounds)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=["colocated split", "colocated mixed", "1P+1D"],
                        choices=list(DEPLOYMENTS))
    parser.add_argument("--together", action="store_true",
                        help="every server up for the whole run (default: vLLM and one kvcentric cluster at a time)")
    parser.add_argument("--no-freeze", dest="freeze", action="store_false",
                        help="leave the other servers idling beside the one measured (default: they are frozen with "
                             "SIGSTOP for its turn, so each is measured as if alone on the box; the runs before "
                             "2026-11-27 19:30 UTC left them idling)")
    parser.add_argument("--label", default="", help="a note stored in the JSON (what engine change is measured)")
    parser.add_argument("--log-dir", default="", help="keep every server's logs here (default: a temp dir, removed)")
    parser.add_argument("--out", default=str(RESULTS / "vs_vllm"),
                        help="path stem: each shape and instruction set writes <stem>_<shape>_<isa>.json and .png")
    return parser.parse_args()


# ---------------------------------------------------------------- servers


class PeerServer:
    """vLLM's OpenAI server from the peer venv, on a free port: fp32, its defaults, `threads` OpenMP threads."""

    def __init__(self, python: Path, checkpoint: Path, threads: int, log_path: Path, timeout_s: float = 900,
                 extra_env: dict[str, str] | None = None) -> None:
        port = free_port()
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
               "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
                "--served-model-name", checkpoint.name, "--dtype", "float32", "--host", "127.0.0.1",
                "--port", str(port)]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url, self.log_path, self.timeout_s = f"http://127.0.0.1:{port}", log_path, timeout_s

    def wait_ready(self) -> None:
        log_path, timeout_s = self.log_path, self.timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"vLLM not ready after {timeout_s} s:\n{log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peer_python(venv: str) -> Path | None:
    """The peer venv's python when it imports vllm, else None."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300)
    return python if probe.returncode == 0 else None


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


# ---------------------------------------------------------------- client


REJECTED = {"count": 0}
"""429 answers (overload rejections) retried so far, over every server."""
FAILED: list[str] = []
"""Requests that ended in an error (server and message): left out of the figures, reported."""


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int, start: float,
               count_tokens: bool = False) -> dict:
    """One streamed greedy completion, retried after Retry-After when rejected (429) as a client would: TTFT
    (from `start`, retries included), first/last token times, text, tokens. `count_tokens`: ask for the
    sampled tokens' logprobs, whose entries say how many tokens each event carries (`first_tokens`: those of
    the first)."""
    while True:
        try:
            return stream_once(url, model, prompt, max_tokens, start, count_tokens)
        except urllib.error.HTTPError as error:
            if error.code != 429:
                FAILED.append(f"{url}: HTTP {error.code} {error.read()[:200]!r}")
                return {}
            REJECTED["count"] += 1
            time.sleep(float(error.headers.get("Retry-After") or 1))


def stream_once(url: str, model: str, prompt: list[int], max_tokens: int, start: float,
                count_tokens: bool = False) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if count_tokens:
        body["logprobs"] = 0
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    first = last = None
    text, ids, tokens, first_tokens, times = [], [], 0, 1, []
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):  # the stream was open (a keep-alive went out) when the request failed
                FAILED.append(f"{url}: error event after {tokens or len(times)} tokens: {event['error']}")
                return {}
            if event.get("choices"):  # a token's event, its text maybe empty (bytes of a character held back)
                last = time.perf_counter()
                times.append(last)
                if first is None:
                    first = last
                    first_tokens = len((event["choices"][0].get("logprobs") or {}).get("tokens") or [None])
                text.append(event["choices"][0].get("text") or "")
                ids += event["choices"][0].get("token_ids") or []
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if first is None or tokens != max_tokens:
        FAILED.append(f"{url}: {tokens} tokens of {max_tokens}")
        return {}
    return {"ttft_s": first - start, "first": first, "last": last, "text": "".join(text), "ids": ids, "tokens": tokens,
            "first_tokens": first_tokens, "times": times}


def run_batch(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        return list(pool.map(lambda p: {**stream_one(url, model, p, max_tokens, start), "start": start}, prompts))


def completed(results: list[dict]) -> list[dict]:
    return [r for r in results if "tokens" in r]


def random_prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    """Distinct prompts of printable bytes (no shared prefix: no server reuses a cached one)."""
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(count)]


def one_round(url: str, model: str, args, prompts: dict[str, list[list[int]]]) -> tuple[dict, dict]:
    """The four tests on one server: figures and the output (token ids and text) of every prompt. Two lone
    prompts go first, not counted: after idling through the other servers' turns the first prompt or two of
    any server here (one process alone as well) ran up to 40% slow, and could move the TTFT test's median."""
    for prompt in prompts["ttft_warm"]:
        stream_one(url, model, prompt, 1, time.perf_counter())
    ttft = [stream_one(url, model, p, 1, time.perf_counter()) for p in prompts["ttft"]]
    tbt = [stream_one(url, model, p, args.tbt_output_len, time.perf_counter(), count_tokens=True)
           for p in prompts["tbt"]]
    burst = run_batch(url, model, prompts["burst"], args.output_len, len(prompts["burst"]))
    paced = run_batch(url, model, prompts["concurrent"], args.output_len, args.concurrency)
    figures = {"ttft_s": middle([r["ttft_s"] for r in completed(ttft)]),
               "tbt_s": middle([time_between_tokens(r) for r in completed(tbt)]),
               "burst_tokens_per_s": throughput(completed(burst)),
               "concurrent_tokens_per_s": throughput(completed(paced)),
               "burst_tbt_p99_s": gap_percentile(completed(burst), 0.99)}
    outputs = {f"{kind}{i}": {"ids": r["ids"], "text": r["text"]}
               for kind, results in (("tbt", tbt), ("burst", burst), ("concurrent", paced))
               for i, r in enumerate(results) if "text" in r}
    return figures, outputs


def time_between_tokens(result: dict) -> float:
    """Mean seconds per token after the first event: a server that holds back the bytes of an unfinished
    character sends some tokens together, and those of the first event came before the clock started."""
    return (result["last"] - result["first"]) / max(1, result["tokens"] - result["first_tokens"])


def gap_percentile(results: list[dict], share: float) -> float:
    """The `share` percentile of the times between two token events of one stream, over all the streams: how
    long a running request's next token waited while the burst's prompts computed (each event carries one
    token: the streams ask for token ids, so no server holds a token back for its text)."""
    gaps = sorted(b - a for r in results for a, b in zip(r["times"], r["times"][1:]))
    return gaps[min(len(gaps) - 1, int(share * len(gaps)))] if gaps else float("nan")


def middle(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def throughput(results: list[dict]) -> float:
    if not results:
        return float("nan")
    wall = max(r["last"] for r in results) - results[0]["start"]
    return sum(r["tokens"] for r in results) / wall


# ---------------------------------------------------------------- report


def ratios(rounds: list[dict], name: str) -> dict[str, list[float]]:
    """Per test, kvcentric / vLLM in each round (for times: >1 is slower; for tokens/s: >1 is faster)."""
    return {test: [r[name][test] / r["vLLM"][test] for r in rounds] for test in TESTS}


def table(result: dict) -> str:
    names = [n for n in result["deployments"] if n != "vLLM"]
    lines = [f"| test | vLLM | {' | '.join(f'{n} / vLLM' for n in names)} |", "|---|---|" + "---|" * len(names)]
    for test in TESTS:
        peer = [r["vLLM"][test] for r in result["rounds"]]
        unit = (lambda v: f"{v:.0f}") if test.endswith("per_s") else (lambda v: f"{v * 1000:.1f} ms")
        cells = [span(result["ratios"][n][test], "{:.2f}×") for n in names]
        label = TEST_NAMES[test].format(**result["workload"])
        lines.append(f"| {label} | {unit(min(peer))}–{unit(max(peer))} | {' | '.join(cells)} |")
    return "\n".join(lines)


def span(values: list[float], fmt: str) -> str:
    return fmt.format(min(values)) + "–" + fmt.format(max(values)) if len(values) > 1 else fmt.format(values[0])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["deployments"] if n != "vLLM"]
    fig, ax = plt.subplots(figsize=(9.5, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        medians = [statistics.median(result["ratios"][name][t]) for t in TESTS]
        ax.bar([x + i * width for x in range(len(TESTS))], medians, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(TESTS))])
    ax.set_xticklabels([PLOT_LABELS[t] for t in TESTS])
    ax.set_ylabel("kvcentric / vLLM (median of rounds)")
    ax.set_title(f"kvcentric vs vLLM {result['peer_version']}, {result['shape']} fp32, {result['isa']}, "
                 f"{result['machine']['cpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare_outputs(outputs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per deployment: how many prompts' greedy token ids (vLLM's `return_token_ids`) equal vLLM's, and how many
    texts do. The texts of these random-weight models are mostly bytes that are not UTF-8; the servers render
    those differently (ours as U+FFFD, as `tokenizers` decodes them; vLLM drops some), so ids are what says
    whether the tokens agree."""
    peer = outputs["vLLM"]
    compared = {}
    for name, out in outputs.items():
        if name == "vLLM":
            continue
        parted = {k: first_difference(out[k]["ids"], peer[k]["ids"]) for k in peer
                  if k in out and out[k]["ids"] != peer[k]["ids"]}
        compared[name] = {"same": sum(k in out for k in peer) - len(parted), "prompts": len(peer),
                          "same_text": sum(k in out and out[k]["text"] == peer[k]["text"] for k in peer),
                          "differing": list(parted)[:5], "first_differences": parted,
                          "missing": sum(k not in out for k in peer)}
    return compared


def first_difference(ours: list[int], theirs: list[int]) -> dict[str, int | None]:
    """Where two greedy answers part: the position of the first differing token and each server's token there (None
    past the end of a shorter answer), so a near-tie can be looked at later."""
    position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return {"position": position, "ours": ours[position] if position < len(ours) else None,
            "vllm": theirs[position] if position < len(theirs) else None}


# ---------------------------------------------------------------- main


def start_servers(args, checkpoint: Path, python: Path, log_dir: Path) -> dict:
    """vLLM, and with --together every kvcentric cluster too (else each comes up in its turn: `Turns`)."""
    peer = PeerServer(python, checkpoint, args.threads, log_dir / "vllm.log", extra_env=ISA_ENV[args.run_isa])
    servers: dict = {"vLLM": peer}
    try:
        for name in args.only if args.together else []:
            servers[name] = start_cluster(name, checkpoint, log_dir, args.run_isa)
        peer.wait_ready()
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def start_cluster(name: str, checkpoint: Path, log_dir: Path, isa: str = "native") -> UpProcess:
    flags, env = DEPLOYMENTS[name]
    print(f"starting {name}", file=sys.stderr, flush=True)
    return UpProcess(str(log_dir / name.replace(" ", "_")), "--model", str(checkpoint), *flags, timeout_s=600,
                     env={"KVC_DTYPE": "float32", **ISA_ENV[isa], **env})


def settle(timeout_s: float = 20.0, idle_share: float = 0.85) -> float:
    """Wait until the machine is quiet (its CPUs idle at least `idle_share` of one second), at most
    `timeout_s`; returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        before = cpu_times()
        time.sleep(1.0)
        after = cpu_times()
        if (after[1] - before[1]) / max(1, after[0] - before[0]) >= idle_share:
            break
    return time.monotonic() - start


def cpu_times() -> tuple[int, int]:
    """(all, idle) jiffies of every CPU so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (a server's workers, an `up`'s children)."""
    return [root, *(child.pid for child in psutil.Process(root).children(recursive=True))]


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Turns:
    """The servers as each turn needs them. By default vLLM is up throughout and one kvcentric cluster at a
    time: the one measured, or during vLLM's turn the one measured next, so every figure is taken with exactly
    one other server beside it (an idle 1P+1D cluster's processes switch context about 300 times a second,
    which a second and a third cluster would add to every figure of ours and to none of vLLM's). The servers
    not measured are frozen (SIGSTOP) for the turn, unless --no-freeze: an idle vLLM beside our cluster put a
    lone prompt's first token at 68-80 ms where the cluster alone read 65-68. With --together every server is
    up from the start, as in the runs before 2026-11-26."""

    def __init__(self, args, servers: dict, checkpoint: Path, log_dir: Path) -> None:
        self.args, self.servers, self.checkpoint, self.log_dir = args, servers, checkpoint, log_dir
        self.models: dict[str, str] = {}
        self.frozen: dict[str, list[int]] = {}
        """Server -> the processes stopped (SIGSTOP) for another's turn."""
        self.warm = random_prompts(random.Random(f"warm {args.seed}"), args.concurrency, args.input_len)
        self.warm_burst = random_prompts(random.Random(f"warm burst {args.seed}"), args.requests, args.input_len)
        for name in list(servers):
            self.up(name)

    def up(self, name: str) -> str:
        """`name` serving (started, when it was not, and warmed up: compiled, allocated), its URL."""
        if name not in self.servers:
            for other in [n for n in self.servers if n != "vLLM"]:
                self.thaw(other)
                self.servers.pop(other).stop()
                self.models.pop(other, None)
            self.servers[name] = start_cluster(name, self.checkpoint, self.log_dir, self.args.run_isa)
        server = self.servers[name]
        self.thaw(name)
        if name not in self.models:
            self.models[name] = served_model(server.url)
            run_batch(server.url, self.models[name], self.warm, self.args.output_len, self.args.concurrency)
            # and the burst's shapes (until 2026-11-27 only the batch above: vLLM, up for the whole run, read
            # 486-534 tokens/s at once in round 1 and 599-645 by round 3, while each cluster of ours, started
            # fresh for its turn, read the same in every round)
            run_batch(server.url, self.models[name], self.warm_burst, self.args.output_len, self.args.requests)
        return server.url

    def turn(self, name: str, following: str | None) -> tuple[str, str]:
        """The URL and model of `name` for its turn; vLLM's brings `following` up beside it first."""
        if name == "vLLM" and following is not None and not self.args.together:
            self.up(following)
        url = self.up(name)
        if self.args.freeze:
            for other in self.servers:
                if other != name and other not in self.frozen:
                    self.frozen[other] = process_tree(self.servers[other].process.pid)
                    signal_all(self.frozen[other], signal.SIGSTOP)
        return url, self.models[name]

    def thaw(self, name: str) -> None:
        """Let `name`'s processes run again, if another's turn stopped them."""
        signal_all(self.frozen.pop(name, []), signal.SIGCONT)

    def stop(self) -> None:
        for name, server in self.servers.items():
            self.thaw(name)
            server.stop()


def measure(args, turns: Turns, report) -> None:
    """The rounds, the servers' turns in an order rotated each round, each after the machine is quiet;
    `report(rounds, outputs)` after each round (the JSON so far)."""
    names = ["vLLM", *args.only]
    rng = random.Random(f"measure {args.seed}")
    rounds: list[dict] = []
    outputs: dict = {}
    for index in range(args.rounds):
        prompts = {"ttft_warm": random_prompts(rng, 2, args.input_len),
                   "ttft": random_prompts(rng, args.ttft_prompts, args.input_len),
                   "tbt": random_prompts(rng, 2, args.input_len),
                   "burst": random_prompts(rng, args.requests, args.input_len),
                   "concurrent": random_prompts(rng, args.requests, args.input_len)}
        order = names[index % len(names):] + names[:index % len(names)]
        figures = {}
        for position, name in enumerate(order):
            following = next((n for n in order[position + 1:] + order[:position] if n != "vLLM"), None)
            url, model = turns.turn(name, following)
            waited = settle()
            print(f"round {index + 1}/{args.rounds}: {name} (machine quiet after {waited:.0f} s)",
                  file=sys.stderr, flush=True)
            figures[name], answers = one_round(url, model, args, prompts)
            print(f"  {name}: {json.dumps(figures[name])}", file=sys.stderr, flush=True)
            outputs.setdefault(name, {}).update({f"r{index}-{k}": v for k, v in answers.items()})
        rounds.append(figures)
        report(rounds, outputs)


def write_report(args, python: Path, deployments: list[str], load_before) -> Callable[[list, dict], None]:
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()

    def report(rounds: list[dict], outputs: dict) -> None:
        result = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "peer_version": version, "deployments": deployments, "shape": args.run_shape,
                  "isa": args.run_isa, "isa_env": ISA_ENV[args.run_isa],
                  "workload": {"input_len": args.input_len, "output_len": args.output_len,
                               "tbt_output_len": args.tbt_output_len, "requests": args.requests,
                               "concurrency": args.concurrency, "vllm_threads": args.threads},
                  "machine": {**harness.machine(), "load_average_before": load_before,
                              "load_average_now": os.getloadavg()},
                  "rounds": rounds, "ratios": {n: ratios(rounds, n) for n in deployments if n != "vLLM"},
                  "greedy_outputs": compare_outputs(outputs), "rejected_429_retried": REJECTED["count"],
                  "failed_requests": FAILED}
        out = Path(f"{args.out}_{args.run_shape}_{args.run_isa}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        plot(result, out.with_suffix(".png"))
        print(table(result), file=sys.stderr, flush=True)
        print(json.dumps(result["greedy_outputs"]), file=sys.stderr, flush=True)

    return report


def main() -> None:
    args = parse_args()
    python = peer_python(args.peer_venv)
    if python is None:
        print(f"SKIPPED: no vLLM peer in {args.peer_venv} (install it with bench/serving/vllm_peer/setup.sh "
              f"{args.peer_venv}); nothing measured.")
        return
    for shape in args.shapes:
        checkpoint = build_checkpoint(Path(args.checkpoint.format(shape=shape)), shape)
        for isa in args.isa:
            print(f"== {shape} on {isa} ({cpu_model()})", file=sys.stderr, flush=True)
            args.run_shape, args.run_isa = shape, isa
            args.seed = f"{shape} {isa} {time.time_ns()}"  # prompts never sent before, by any run
            report = write_report(args, python, ["vLLM", *args.only], os.getloadavg())
            with tempfile.TemporaryDirectory(prefix="kvc-vs-vllm-") as temp:
                logs = os.path.join(args.log_dir, f"{shape}_{isa}") if args.log_dir else temp
                Path(logs).mkdir(parents=True, exist_ok=True)
                turns = Turns(args, start_servers(args, checkpoint, python, Path(logs)), checkpoint, Path(logs))
                try:
                    measure(args, turns, report)
                finally:
                    turns.stop()


if __name__ == "__main__":
    main()
