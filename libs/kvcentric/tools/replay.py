"""`kvcentric bench replay`: a Mooncake trace, or a Poisson workload, sent as real requests to a running
gateway at the trace's times, measured as clients see them; writes requests.jsonl, summary.json (the keys
of `kvcentric sim`, plus rejected_429) and TTFT/TBT CDF plots. The metric definitions are the simulator's
(`kvcentric.core.sim.metrics`); this module turns trace lines into prompts, schedules, and records.

Each trace hash id becomes a deterministic block of tokens (seeded by the id), so replayed prompts share
exactly the prefixes the trace says they share; `--scale K` shrinks the 512-token blocks (and prompts)
K times for CPU-sized models.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import random
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from kvcentric.config import ConfigError, add_arguments, from_namespace, require, setting
from kvcentric.tools.replay_http import Outcome, completion_body, send
from kvcentric.core.sim.metrics import Record, summarize
from kvcentric.core.sim.slo import TBT_FACTOR, TTFT_FACTOR, Slos, load_reference, normalised_p90s, relative_slos
from kvcentric.core.sim.workload import SimRequest, load_trace, poisson_workload

TRACE_BLOCK_TOKENS = 512
TOKEN_RANGE = (32, 127)
"""Replayed token ids: printable ASCII in the byte tokenizer, ordinary tokens in real vocabularies."""


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    url: str = setting("http://127.0.0.1:8000", "the gateway to replay against")
    speed: float = setting(1.0, "arrival times are divided by this")
    limit: int = setting(0, "replay only the first N lines (0: all)")
    scale: float = setting(1.0, "divide prompt lengths and the 512-token blocks by this (16: 32-token blocks)")
    output_scale: float = setting(1.0, "divide output lengths by this")
    max_output_tokens: int = setting(0, "cap output lengths at this (0: no cap)")
    out: str = setting("replay-out", "output directory")
    ttft_slo_s: float = setting(30.0, "TTFT SLO, seconds (Mooncake §8.1.3: 30)")
    tbt_slo_s: float = setting(0.1, "TBT SLO: a request's mean time between tokens, seconds (Mooncake: 0.1)")
    slo_reference: str = setting("", "summary.json (or its folder) of a replay at the lowest rate: the SLOs become "
                                     "--ttft-slo-factor and --tbt-slo-factor times its P90 TTFT and P90 TBT "
                                     "(Mooncake §2, §8.1), replacing --ttft-slo-s and --tbt-slo-s, and the "
                                     "plots are normalised by them")
    ttft_slo_factor: float = setting(TTFT_FACTOR, "with --slo-reference: TTFT SLO = this × unloaded P90 TTFT")
    tbt_slo_factor: float = setting(TBT_FACTOR, "with --slo-reference: TBT SLO = this × unloaded P90 TBT")
    api_key: str = setting("", "bearer token, for a gateway started with --api-key")
    seed: int = setting(0, "seed of the tokens each hash id becomes")
    rps: float = setting(1.0, "poisson: requests per second")
    num_requests: int = setting(100, "poisson: number of requests")
    input_len: int = setting(1024, "poisson: prompt tokens (before --scale)")
    output_len: int = setting(128, "poisson: output tokens (before --output-scale)")
    cache_ratio: float = setting(0.5, "poisson: share of each prompt that is a shared prefix")
    timeout_s: float = setting(600.0, "give up on one request after this long")
    label: str = setting("", "name of this run in summary.json and the plots")
    plots: bool = setting(True, "write PNG plots (needs matplotlib)")
    progress: bool = setting(True, "progress bar on stderr")

    def __post_init__(self) -> None:
        require(self.url.startswith(("http://", "https://")), "url", f"expected http://host:port, got {self.url!r}")
        require(self.speed > 0, "speed", "must be positive")
        require(self.scale >= 1 and self.output_scale >= 1, "scale", "--scale and --output-scale must be >= 1")
        require(self.limit >= 0 and self.max_output_tokens >= 0, "limit", "--limit and --max-output-tokens >= 0")
        require(self.ttft_slo_s > 0 and self.tbt_slo_s > 0, "ttft_slo_s", "SLOs must be positive")
        require(self.ttft_slo_factor > 0 and self.tbt_slo_factor > 0, "ttft_slo_factor", "factors must be positive")

    @property
    def block_len(self) -> int:
        """Tokens a trace block becomes."""
        return max(1, round(TRACE_BLOCK_TOKENS / self.scale))


@dataclasses.dataclass(slots=True)
class Planned:
    request: SimRequest
    token_ids: list[int]
    max_tokens: int


# ---------------------------------------------------------------- trace lines -> prompts


@functools.lru_cache(maxsize=1 << 16)
def block_tokens(key: str, length: int, seed: int) -> tuple[int, ...]:
    """The tokens of one hash id: the same id (and seed) always gives the same block."""
    rng = random.Random(f"{seed}:{key}")
    return tuple(rng.randrange(*TOKEN_RANGE) for _ in range(length))


def prompt_tokens(hashes: list[str], length: int, block_len: int, seed: int) -> list[int]:
    """`length` tokens made of the hash ids' blocks in order (the last block cut short)."""
    tokens: list[int] = []
    for key in hashes:
        if len(tokens) >= length:
            break
        tokens += block_tokens(key, block_len, seed)
    while len(tokens) < length:  # a line with fewer ids than its length needs: pad deterministically
        tokens += block_tokens(f"pad{len(tokens)}", block_len, seed)
    return tokens[:length]


def plan(requests: list[SimRequest], config: ReplayConfig, max_model_len: int) -> list[Planned]:
    """Prompts and output lengths, scaled and fitted into the context (the prompt gives way)."""
    planned = []
    for request in requests:
        max_tokens = max(1, round(request.output_len / config.output_scale))
        if config.max_output_tokens:
            max_tokens = min(max_tokens, config.max_output_tokens)
        max_tokens = min(max_tokens, max_model_len // 2)
        length = max(1, min(math.ceil(request.input_len / config.scale), max_model_len - max_tokens))
        planned.append(Planned(request, prompt_tokens(request.hashes, length, config.block_len, config.seed),
                               max_tokens))
    return planned


def workload(trace: str, config: ReplayConfig) -> list[SimRequest]:
    if trace == "poisson":
        return poisson_workload(config.rps, config.num_requests, config.input_len, config.output_len,
                                config.cache_ratio, TRACE_BLOCK_TOKENS, seed=config.seed)
    return load_trace(trace, config.speed, config.limit)


# ---------------------------------------------------------------- sending


class ProgressBar:
    """One line on stderr: sent, done, rejected, elapsed; redrawn in place on a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.sent = self.done = self.rejected = self.failed = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.drawn_at = 0.0

    def finished(self, outcome: Outcome) -> None:
        self.done += 1
        self.rejected += outcome.status == 429
        self.failed += outcome.status not in (200, 429) or bool(outcome.error)
        self.draw()

    def draw(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not final and now - self.drawn_at < (0.2 if self.tty else 5.0)):
            return
        self.drawn_at = now
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, {self.sent} sent, "
                f"{self.rejected} rejected (429), {self.failed} failed, {now - self.started:.0f} s")
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "", file=sys.stderr,
              flush=True)


async def send_all(planned: list[Planned], config: ReplayConfig, model: str) -> tuple[float, list[Outcome]]:
    """Send each request at its arrival time (open loop); returns the start time and the outcomes."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    progress = ProgressBar(len(planned), config.progress)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start, tasks = time.perf_counter(), []
        for item in planned:
            delay = start + item.request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = completion_body(model, item.token_ids, item.max_tokens)
            task = asyncio.ensure_future(send(session, config.url, body, headers, config.timeout_s))
            task.add_done_callback(lambda t: progress.finished(t.result()))
            tasks.append(task)
            progress.sent += 1
        outcomes = await asyncio.gather(*tasks)
    progress.draw(final=True)
    return start, outcomes


# ---------------------------------------------------------------- results


def status_of(outcome: Outcome) -> str:
    if outcome.status == 429:
        return "rejected_before_prefill"
    if outcome.status == 200 and outcome.error_type == "rate_limit_exceeded":
        return "rejected_after_prefill"
    if outcome.status == 200 and not outcome.error and outcome.finish_reason:
        return "completed"
    return "failed"


def to_record(item: Planned, outcome: Outcome, start: float, block_len: int, tbt_slo_s: float = 0.1) -> Record:
    """The simulator's Record of a replayed request (times relative to the replay's start)."""
    r = item.request
    request = SimRequest(r.request_id, r.arrival_s, len(item.token_ids),
                         outcome.completion_tokens or item.max_tokens, r.hashes, r.priority)
    return Record(request, status_of(outcome), reason=outcome.error[:300], prefill_id=outcome.prefill_id,
                  decode_id=outcome.decode_id, predicted_ttft_s=outcome.predicted_ttft_s,
                  cached_blocks=outcome.cached_tokens // block_len,
                  prefill_start=0.0 if outcome.status == 200 else -1.0,
                  first_token=outcome.first_token - start if outcome.first_token >= 0 else -1.0,
                  finish=outcome.finish - start, max_gap_s=max(outcome.gaps, default=0.0),
                  slow_gaps=sum(gap > tbt_slo_s for gap in outcome.gaps))


def row(record: Record, item: Planned, outcome: Outcome, start: float) -> dict:
    return {**record.row(), "http_status": outcome.status, "finish_reason": outcome.finish_reason,
            "send_lag_s": round(outcome.sent - start - item.request.arrival_s, 4),
            "prompt_tokens": len(item.token_ids), "completion_tokens": outcome.completion_tokens,
            "cached_tokens": outcome.cached_tokens, "trace_input_len": item.request.input_len,
            **({"retry_after_s": outcome.retry_after_s} if outcome.status == 429 else {})}


def write(out: Path, summary: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "requests.jsonl", "w") as lines:
        for line in rows:
            lines.write(json.dumps(line) + "\n")


def served_model(config: ReplayConfig) -> tuple[str, int]:
    """The gateway's model name and context length, from GET /v1/models."""
    request = urllib.request.Request(config.url + "/v1/models", headers={"Authorization": f"Bearer {config.api_key}"}
                                     if config.api_key else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        card = json.load(response)["data"][0]
    return card["id"], int(card.get("max_model_len", 2048))


def with_slos(config: ReplayConfig) -> tuple[ReplayConfig, Slos]:
    """The config with its SLOs made relative to --slo-reference (if given), and the SLOs in force."""
    if not config.slo_reference:
        return config, Slos(config.ttft_slo_s, config.tbt_slo_s)
    slos = relative_slos(load_reference(config.slo_reference), config.ttft_slo_factor, config.tbt_slo_factor)
    return dataclasses.replace(config, ttft_slo_s=slos.ttft_s, tbt_slo_s=slos.tbt_s), slos


def run(trace: str, config: ReplayConfig) -> dict:
    config, slos = with_slos(config)
    model, max_model_len = served_model(config)
    planned = plan(workload(trace, config), config, max_model_len)
    if not planned:
        raise ValueError(f"{trace}: no requests to replay")
    start, outcomes = asyncio.run(send_all(planned, config, model))
    records = [to_record(p, o, start, config.block_len, config.tbt_slo_s) for p, o in zip(planned, outcomes)]
    summary = {**summarize(records, config.ttft_slo_s, config.tbt_slo_s),
               "rejected_429": sum(o.status == 429 for o in outcomes),
               "failed": sum(r.status == "failed" for r in records),
               "label": config.label or Path(trace).stem, "trace": trace, "model": model,
               "wall_s": time.perf_counter() - start, "config": dataclasses.asdict(config), "slos": slos.to_dict()}
    summary.update(normalised_p90s(summary, slos))
    out = Path(config.out)
    write(out, summary, [row(r, p, o, start) for r, p, o in zip(records, planned, outcomes)])
    if config.plots:
        from kvcentric.tools.replay_plots import plot_cdfs, record_values
        plot_cdfs(out / "ttft_tbt_cdf.png", {summary["label"]: record_values(records)}, config.ttft_slo_s,
                  config.tbt_slo_s, normalised=bool(config.slo_reference))
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcentric bench replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", metavar="TRACE", help="Mooncake JSONL trace, or 'poisson' (see --rps ...)")
    add_arguments(parser, ReplayConfig)
    return parser


SHOWN = ("requests", "completed", "completed_within_slo", "rejected_429", "rejected_after_prefill", "failed",
         "ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p90_s", "ttft_p90_normalised", "tbt_p90_normalised",
         "slo_attainment", "goodput_rps", "prefix_hit_ratio")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = from_namespace(ReplayConfig, args)
        summary = run(args.trace, config)
    except ConfigError as exc:
        parser.exit(2, f"kvcentric bench replay: error: {exc}\n")
    except (ValueError, OSError) as exc:
        parser.exit(1, f"kvcentric bench replay: {exc}\n")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items() if k in SHOWN}))
    print(f"results in {config.out}/", file=sys.stderr)
    return 0


def bench_main(argv: list[str]) -> int:
    """`kvcentric bench <benchmark> ...`; replay is the one there is."""
    if argv[:1] != ["replay"]:
        print("usage: kvcentric bench replay TRACE --url URL [--speed S] [--limit N] [--scale K] [--out DIR] ...\n"
              "(`kvcentric bench replay --help` for every flag)", file=sys.stderr)
        return 2
    return main(argv[1:])
