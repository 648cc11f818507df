"""Which CPU kernel runs where: each kernel of `engine/model/kernels` raced against torch's own op at a model's shapes
and the row counts its steps use, and kept only up to the row count where it is the faster of the two.

The kernels were tuned on one CPU; on another they can be many times slower than torch (the small GEMM on a CPU without
the vector path it was tuned for: docs/performance.md, "Every CPU"). So for each kernel site (`Site`: the small GEMM of
each distinct projection shape at 1, 2, 4 ... SMALL_GEMM_ROWS rows; decode attention at a few batch sizes; prefill
attention at a few prompt lengths; RMSNorm, SwiGLU and rotary + cache write at decode and prefill row counts) the kernel
is timed against what the engine runs without it (oneDNN's GEMM over the blocked weights, gather + SDPA, torch's SDPA,
torch's ops), in interleaved samples, the fastest of each kept (`races.py`). A site's kernel runs up to the last row
count before the first one where it is not faster (its row limit, `decide`); one not faster at its first count does not
run at all, and a GEMM shape with a limit of 0 gets no second weight layout.

The timings are cached on disk beside the built library (`kernels.cache_dir()`), one JSON file per CPU, torch
version, thread count and library build, each case named by its shapes; a later start reads them and times nothing.
A start times at most KVC_KERNEL_CHECK_S seconds (default 2) of cases not yet cached; a case left over counts as a
loss until a later start has timed it. A case timed while more threads wanted to run than there are cores is
cached as such, decides as timed, and is timed again by a start that finds the machine quiet.

It times, decides and caches; it does not apply the choice (`chosen.py`). `decide` and `next_cases` are pure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from kvcentric.engine.model.kernels import races
from kvcentric.engine.model.gemm import SMALL_GEMM_ROWS, projection_shapes
from kvcentric.model.config import ModelConfig

log = logging.getLogger("kvcentric.kernels")

VERSION = 2
"""Part of the cache key: a change to how cases are timed makes every start time them again."""
UNLIMITED = 1 << 62
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_BATCHES = (1, 8, 32)
"""Sequences of a decode step, each over DECODE_CONTEXT positions."""
DECODE_CONTEXT = 256
PREFILL_LENGTHS = (64, 512, 2048)
"""Tokens of a whole prompt attending to itself (a long prompt's too: on the AVX2 build the kernel that wins at 512
tokens of `small` is level with torch at 2048)."""
OP_ROWS = (1, 16, 512)
"""Rows of a decode step, a bigger one, and a prompt's MLP block (`llama.MLP_ROWS`)."""
BUDGET_S = float(os.environ.get("KVC_KERNEL_CHECK_S", "2"))


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds a call of the kernel and of torch's op took (the fastest sample of each)."""

    kernel_s: float
    torch_s: float
    steady: bool = True
    """Timed on a quiet machine (`races.crowded`); one that was not is timed again at a start that finds it quiet."""

    @property
    def ratio(self) -> float:
        return self.kernel_s / self.torch_s if self.torch_s > 0 else float("inf")

    @property
    def wins(self) -> bool:
        return self.kernel_s < self.torch_s


@dataclasses.dataclass(frozen=True)
class Site:
    """A place where a kernel may run instead of torch's op."""

    kernel: str
    """What the choice is asked by: "decode_attention", "rms_norm", "gemm 512->1024" ..."""
    detail: str
    """The shapes and types it is timed at (part of each case's cache key)."""
    rows: tuple[int, ...]
    """The row counts timed, ascending (a GEMM's rows, a decode step's sequences, a prompt's tokens)."""
    ceiling: int = UNLIMITED
    """The most rows it may run, where it wins at every count timed."""
    shape: tuple[int, ...] = ()
    """A GEMM's (out_features, in_features, with a residual)."""

    def case(self, rows: int) -> str:
        return f"{self.kernel} [{self.detail}] x{rows}"


def gemm_name(out_features: int, in_features: int) -> str:
    return f"gemm {in_features}->{out_features}"


@dataclasses.dataclass(frozen=True)
class Target:
    """A model as an engine runs it on the CPU: what the choice is made for."""

    config: ModelConfig
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    onednn: bool = True
    """Torch's GEMM runs over oneDNN's blocked weights (`gemm.pack_weight`), else over the plain ones."""
    gemm_rows: int = SMALL_GEMM_ROWS
    """The most rows the small GEMM may take (KVC_SMALL_GEMM_ROWS; 0: never)."""

    @property
    def decode_context(self) -> int:
        """Positions each sequence of a decode race attends to."""
        return min(DECODE_CONTEXT, self.config.max_position - 1)

    def sites(self, layer_ops: bool = True) -> list[Site]:
        """Every site of the model's steps: attention's; with `layer_ops` (fp32) the layer ops' and the GEMM's."""
        c = self.config
        kind = str(self.dtype).removeprefix("torch.")
        heads = f"{kind} {c.num_heads}/{c.num_kv_heads}x{c.head_dim}"
        sites = [Site("decode_attention", f"{heads} block {self.block_size} context {self.decode_context}",
                      DECODE_BATCHES),
                 Site("prefill_attention", heads, tuple(n for n in PREFILL_LENGTHS if n <= c.max_position))]
        if not layer_ops or self.dtype != torch.float32:
            return sites
        sites += [Site("rms_norm", f"{kind} {c.hidden_size}", OP_ROWS),
                  Site("silu_mul", f"{kind} {c.intermediate_size}", OP_ROWS),
                  Site("rotate_store", f"{heads} positions {c.max_position}", OP_ROWS)]
        return sites + self.gemm_sites()

    def gemm_sites(self) -> list[Site]:
        """The small GEMM's sites: each distinct projection shape it takes (out_features a multiple of 16)."""
        if self.gemm_rows <= 0:
            return []
        rows = (*(n for n in GEMM_ROWS if n < self.gemm_rows), self.gemm_rows)
        weights = "blocked" if self.onednn and torch.backends.mkldnn.is_available() else "plain"
        shapes = dict.fromkeys((out, width, residual) for out, width, residual in projection_shapes(self.config)
                               if out % 16 == 0)
        return [Site(gemm_name(out, width), f"float32 {weights}{' +residual' if residual else ''}", rows,
                     self.gemm_rows, (out, width, int(residual))) for out, width, residual in shapes]


@dataclasses.dataclass(frozen=True)
class Choice:
    """Per kernel, the most rows it runs (0: never; UNLIMITED: any count), and the timings that decided it."""

    limits: Mapping[str, int]
    sites: tuple[Site, ...] = ()
    timings: Mapping[str, Timing] = dataclasses.field(default_factory=dict)

    def rows(self, kernel: str) -> int:
        return self.limits.get(kernel, 0)

    def gemm_rows(self, out_features: int, in_features: int) -> int:
        return self.rows(gemm_name(out_features, in_features))

    def summary(self) -> str:
        """One line: each kernel's use and its time against torch's."""
        return "kernels: " + "; ".join(self.describe(site) for site in self.sites)

    def describe(self, site: Site) -> str:
        limit = self.rows(site.kernel)
        timed = [(rows, self.timings[site.case(rows)]) for rows in site.rows if site.case(rows) in self.timings]
        if not timed:
            return f"{site.kernel}: torch (not timed yet)"
        if limit == 0:
            return f"{site.kernel}: torch ({timed[0][1].ratio:.2f}x torch at {timed[0][0]})"
        within = [(rows, t) for rows, t in timed if rows <= limit]
        ratios = f"{within[0][1].ratio:.2f}x torch at {within[0][0]}"
        if len(within) > 1:
            ratios += f", {within[-1][1].ratio:.2f}x at {within[-1][0]}"
        if limit >= UNLIMITED:
            return f"{site.kernel}: kernel ({ratios})"
        return f"{site.kernel}: kernel up to {limit} row{'s' if limit > 1 else ''} ({ratios})"

    def table(self) -> str:
        """Every case timed: kernel and torch times, their ratio, and which of the two runs there."""
        lines = [f"{'site':<26} {'shapes':<40} {'rows':>5} {'kernel ms':>10} {'torch ms':>10} {'ratio':>6}  runs"]
        for site in self.sites:
            for rows in site.rows:
                timing = self.timings.get(site.case(rows))
                runs = "kernel" if rows <= self.rows(site.kernel) else "torch"
                if timing is None:
                    lines.append(f"{site.kernel:<26} {site.detail:<40} {rows:>5} {'-':>10} {'-':>10} {'-':>6}  {runs}")
                    continue
                lines.append(f"{site.kernel:<26} {site.detail:<40} {rows:>5} {1e3 * timing.kernel_s:>10.3f} "
                             f"{1e3 * timing.torch_s:>10.3f} {timing.ratio:>6.2f}  {runs}")
        return "\n".join(lines)


def row_limit(site: Site, timings: Mapping[str, Timing]) -> int:
    """The last row count before the first one where the kernel is not faster (or not timed); `site.ceiling` where
    it wins at every count."""
    limit = 0
    for rows in site.rows:
        timing = timings.get(site.case(rows))
        if timing is None or not timing.wins:
            return limit
        limit = rows
    return site.ceiling


def decide(sites: Sequence[Site], timings: Mapping[str, Timing]) -> Choice:
    cases = {site.case(rows) for site in sites for rows in site.rows}
    return Choice({site.kernel: row_limit(site, timings) for site in sites}, tuple(sites),
                  {case: timing for case, timing in timings.items() if case in cases})


def next_cases(sites: Sequence[Site], timings: Mapping[str, Timing]) -> list[tuple[Site, int]]:
    """The next row count to time of each site still undecided: its first one not timed, where the kernel won at
    every one before it."""
    pending = []
    for site in sites:
        for rows in site.rows:
            timing = timings.get(site.case(rows))
            if timing is None:
                pending.append((site, rows))
                break
            if not timing.wins:
                break
    return pending


def cache_key(cpu: str, torch_version: str, threads: int, build: str) -> str:
    """What the timings depend on besides the shapes: the CPU, torch, the thread count and the kernels' build."""
    text = "\n".join((str(VERSION), cpu, torch_version, str(threads), build))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(directory: Path, key: str) -> Path:
    return directory / f"choice-{key}.json"


def read_timings(path: Path) -> dict[str, Timing]:
    try:
        cases = json.loads(path.read_text())["cases"]
        return {case: Timing(float(kernel_s), float(torch_s), bool(steady))
                for case, (kernel_s, torch_s, steady) in cases.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def write_timings(path: Path, timings: Mapping[str, Timing], about: Mapping[str, object]) -> None:
    """The timings added to those on disk (another engine may have written some meanwhile), atomically."""
    merged = {**read_timings(path), **timings}
    body = {"about": dict(about),
            "cases": {case: [t.kernel_s, t.torch_s, t.steady] for case, t in sorted(merged.items())}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as scratch:
            json.dump(body, scratch, indent=1)
        os.replace(scratch.name, path)
    except OSError as error:
        log.warning("kernel choice: could not cache the timings in %s (%s); the next start times them again",
                    path, error)


def choose(target: Target, attention, ops, directory: Path, cpu: str, budget_s: float | None = None,
           retime: bool = False) -> Choice:
    """The choice for `target` with these kernels (`kernels.CpuAttention`, `kernels.CpuLayerOps` or None) on this
    `cpu` (`kernels.cpu_signature`): the timings cached in `directory`, plus the cases still missing timed now,
    within `budget_s` (KVC_KERNEL_CHECK_S), and cached; on a quiet machine the cases timed on a crowded one are
    timed again (their cached timing decides where the budget runs out first); `retime`: every case timed again."""
    sites = target.sites(ops is not None)
    threads, build = torch.get_num_threads(), Path(attention.path).name
    path = cache_path(directory, cache_key(cpu, torch.__version__, threads, build))
    with one_at_a_time(directory):  # engines starting together: the first times, the others read its timings
        cached = {} if retime else read_timings(path)
        quiet = not races.crowded()
        timings = {case: timing for case, timing in cached.items() if timing.steady or not quiet}
        measured = time_missing(target, sites, timings, attention, ops, BUDGET_S if budget_s is None else budget_s)
        timings = {**cached, **timings}
        if measured:
            write_timings(path, measured, {"cpu": cpu.strip(), "torch": torch.__version__, "threads": threads,
                                           "build": build})
    return decide(sites, timings)


@contextlib.contextmanager
def one_at_a_time(directory: Path) -> Iterator[None]:
    """Held by one process of the machine at a time (a lock file in `directory`; none where it cannot be made)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / "choice.lock", "a")  # noqa: SIM115 - closed below, after the lock is let go
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def time_missing(target: Target, sites: Sequence[Site], timings: dict[str, Timing], attention, ops,
                 budget_s: float) -> dict[str, Timing]:
    """Time the cases `next_cases` asks for, round after round, into `timings` until none is left or `budget_s` is
    spent; returns the ones timed."""
    started, unsteady = time.perf_counter(), 0
    measured: dict[str, Timing] = {}
    prepared: dict[str, races.Prepared] = {}
    while pending := next_cases(sites, timings):
        for site, rows in pending:
            if time.perf_counter() - started > budget_s:
                log.warning("kernel choice: the %.1f s budget (KVC_KERNEL_CHECK_S) is spent with %d kernel sites "
                            "left to time; they run torch's ops until a later start has timed them", budget_s,
                            len(next_cases(sites, timings)))
                return measured
            if site.kernel not in prepared:
                prepared[site.kernel] = races.prepare(site, target, attention, ops)
            timing = timings[site.case(rows)] = Timing(*races.race(*prepared[site.kernel](rows)))
            if not timing.wins or rows == site.rows[-1]:
                del prepared[site.kernel]  # decided: its tensors go
            measured[site.case(rows)] = timing
            unsteady += not timing.steady
    if unsteady:
        log.warning("kernel choice: %d cases timed while more threads wanted to run than there are cores; they "
                    "are timed again at a start that finds the machine quiet", unsteady)
    return measured
