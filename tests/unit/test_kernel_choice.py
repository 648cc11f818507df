"""The kernel choice (`engine/model/kernels/choice.py`, `chosen.py`): from timings, each kernel runs up to the last row
count before the first where it is not faster than torch's op, never where it loses at its first, and a GEMM shape
it never wins gets no second weight layout; the cache is keyed by CPU, torch, threads and build, written once and
read back without timing; engines choosing so compute the tokens of torch's ops."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kvcentric.engine.model import kernels
from kvcentric.engine.model.kernels import choice, chosen, races
from kvcentric.engine.model.kernels.choice import UNLIMITED, Choice, Site, Target, Timing, decide, next_cases, row_limit
from kvcentric.engine.model.gemm import TwoLayouts, linear, pack_weight, two_layouts
from kvcentric.engine.model.runner import ModelRunner, weight_copies
from kvcentric.model.config import preset

needs_compiler = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler on this machine")

WIN, LOSS = Timing(1.0, 2.0), Timing(2.0, 1.0)


def timed(site: Site, **by_rows: Timing) -> dict[str, Timing]:
    return {site.case(int(rows.removeprefix("x"))): timing for rows, timing in by_rows.items()}


GEMM = Site("gemm 512->1024", "float32 blocked", (1, 2, 4, 8, 16, 32, 64, 128), 128, (1024, 512, 0))
NORM = Site("rms_norm", "float32 512", (1, 16, 512))


def test_the_kernel_runs_up_to_the_last_count_before_its_first_loss():
    assert row_limit(GEMM, timed(GEMM, x1=WIN, x2=WIN, x4=WIN, x8=WIN, x16=LOSS, x32=WIN)) == 8
    assert row_limit(NORM, timed(NORM, x1=WIN, x16=LOSS, x512=WIN)) == 1


def test_a_kernel_faster_at_every_count_runs_up_to_its_ceiling():
    assert row_limit(GEMM, timed(GEMM, **{f"x{n}": WIN for n in GEMM.rows})) == 128
    assert row_limit(NORM, timed(NORM, x1=WIN, x16=WIN, x512=WIN)) == UNLIMITED


def test_a_kernel_slower_at_its_first_count_or_not_timed_never_runs():
    assert row_limit(GEMM, timed(GEMM, x1=LOSS, x2=WIN)) == 0
    assert row_limit(GEMM, {}) == 0
    assert row_limit(GEMM, timed(GEMM, x1=Timing(1.0, 1.0))) == 0  # a tie is torch's
    assert row_limit(GEMM, timed(GEMM, x1=WIN, x4=WIN)) == 1  # a count not timed is a loss until it is


def test_the_choice_is_asked_by_kernel_and_gemm_shape():
    sites = [GEMM, NORM, Site("silu_mul", "float32 1408", (1, 16, 512))]
    choice_ = decide(sites, {**timed(GEMM, x1=WIN, x2=WIN, x4=LOSS), **timed(NORM, x1=WIN, x16=WIN, x512=WIN),
                             "unrelated case": WIN})
    assert choice_.gemm_rows(1024, 512) == 2 and choice_.gemm_rows(512, 1024) == 0
    assert choice_.rows("rms_norm") == UNLIMITED and choice_.rows("silu_mul") == 0
    assert "unrelated case" not in choice_.timings
    summary = choice_.summary()
    assert "gemm 512->1024: kernel up to 2 rows (0.50x torch at 1, 0.50x at 2)" in summary
    assert "rms_norm: kernel (0.50x" in summary and "silu_mul: torch (not timed yet)" in summary
    assert len(choice_.table().splitlines()) == 1 + 8 + 3 + 3


def test_next_cases_are_the_first_untimed_count_of_each_site_still_winning():
    assert next_cases([GEMM, NORM], {}) == [(GEMM, 1), (NORM, 1)]
    timings = {**timed(GEMM, x1=WIN, x2=WIN), **timed(NORM, x1=LOSS)}
    assert next_cases([GEMM, NORM], timings) == [(GEMM, 4)]
    timings.update(timed(GEMM, **{f"x{n}": WIN for n in GEMM.rows}))
    assert next_cases([GEMM, NORM], timings) == []


def test_the_sites_are_the_models_distinct_shapes():
    sites = {site.kernel: site for site in Target(preset("small")).sites()}
    assert set(sites) == {"decode_attention", "prefill_attention", "rms_norm", "silu_mul", "rotate_store",
                          "gemm 512->1024", "gemm 512->512", "gemm 512->2816", "gemm 1408->512"}
    assert sites["gemm 512->512"].shape == (512, 512, 1) and "+residual" in sites["gemm 512->512"].detail
    assert Target(preset("small"), gemm_rows=48).gemm_sites()[0].rows == (1, 2, 4, 8, 16, 32, 48)
    assert Target(preset("small"), gemm_rows=0).gemm_sites() == []
    assert {s.kernel for s in Target(preset("small"), torch.bfloat16).sites()} == {"decode_attention",
                                                                                 "prefill_attention"}
    assert "bfloat16" in Target(preset("small"), torch.bfloat16).sites()[0].detail
    assert {s.kernel for s in Target(preset("small")).sites(layer_ops=False)} == {"decode_attention",
                                                                                "prefill_attention"}


def test_the_cache_key_changes_with_the_cpu_torch_threads_and_build():
    base = ("x86_64 model name: AMD EPYC flags: avx2", "2.13.0+cpu", 2, "attention-0123456789abcdef.so")
    keys = {choice.cache_key(*base)}
    for index, other in enumerate(("x86_64 model name: Xeon flags: avx512f", "2.14.0+cpu", 1,
                                   "attention-fedcba9876543210.so")):
        keys.add(choice.cache_key(*base[:index], other, *base[index + 1:]))
    assert len(keys) == 5 and choice.cache_key(*base) in keys


def test_timings_are_merged_into_the_cache_file(tmp_path):
    path = choice.cache_path(tmp_path, "k")
    crowded = Timing(1.0, 3.0, steady=False)
    choice.write_timings(path, {"a x1": WIN, "c x1": crowded}, {"threads": 2})
    choice.write_timings(path, {"b x1": LOSS}, {"threads": 2})  # another engine's, later
    assert choice.read_timings(path) == {"a x1": WIN, "b x1": LOSS, "c x1": crowded}
    assert json.loads(path.read_text())["about"] == {"threads": 2}
    path.write_text("{not json")
    assert choice.read_timings(path) == {}


def test_timings_taken_on_a_crowded_machine_are_timed_again_once_it_is_quiet(tmp_path, monkeypatch):
    attention, target = SimpleNamespace(path="attention-0123.so"), Target(preset("tiny"))
    monkeypatch.setattr(races, "prepare", lambda *args: lambda rows: (int, int))
    monkeypatch.setattr(races, "crowded", lambda: True)
    monkeypatch.setattr(races, "race", lambda kernel, torch_op: (1.0, 2.0, False))
    crowded = choice.choose(target, attention, None, tmp_path, "cpu")
    assert crowded.rows("decode_attention") == UNLIMITED  # it decides as timed
    assert not any(timing.steady for timing in crowded.timings.values())

    def no_timing(*args):
        raise AssertionError("timed again on a crowded machine")

    monkeypatch.setattr(races, "race", no_timing)
    assert choice.choose(target, attention, None, tmp_path, "cpu").limits == crowded.limits  # cached as it was
    monkeypatch.setattr(races, "crowded", lambda: False)
    monkeypatch.setattr(races, "race", lambda kernel, torch_op: (2.0, 1.0, True))
    quiet = choice.choose(target, attention, None, tmp_path, "cpu")
    assert quiet.rows("decode_attention") == 0
    assert all(quiet.timings[site.case(site.rows[0])].steady for site in quiet.sites)
    monkeypatch.setattr(races, "race", no_timing)
    assert choice.choose(target, attention, None, tmp_path, "cpu").limits == quiet.limits


def test_the_budget_stops_the_timing(monkeypatch):
    monkeypatch.setattr(races, "prepare", lambda *args: lambda rows: (int, int))
    monkeypatch.setattr(races, "race", lambda kernel, torch_op: (1.0, 2.0, True))
    timings: dict[str, Timing] = {}
    assert choice.time_missing(Target(preset("tiny")), [GEMM, NORM], timings, None, None, -1.0) == {}
    assert timings == {}


def test_kvc_kernels_names_itself_when_wrong(monkeypatch):
    monkeypatch.setenv("KVC_KERNELS", "fast")
    with pytest.raises(ValueError, match="KVC_KERNELS"):
        chosen.mode()
    monkeypatch.setenv("KVC_KERNELS", "off")
    assert chosen.cpu_kernels(preset("tiny"), torch.float32, 4) == (None, None)


@needs_compiler
def test_a_choice_that_fails_leaves_every_kernel_on(monkeypatch, caplog):
    def failing(*args):
        raise RuntimeError("a race went wrong")

    monkeypatch.setenv("KVC_KERNELS", "auto")
    monkeypatch.setattr(chosen, "choose", failing)
    attention, ops = chosen.cpu_kernels(preset("tiny"), torch.float32, 4)
    assert isinstance(attention, kernels.CpuAttention) and isinstance(ops, kernels.CpuLayerOps)
    assert "a race went wrong" in caplog.text


def forced(wins: dict[str, int]) -> Choice:
    """The choice where each kernel named wins up to that many rows of its site's counts (the others never)."""
    sites = Target(preset("tiny")).sites()
    timings = {site.case(rows): WIN if rows <= wins.get(site.kernel, 0) else LOSS
               for site in sites for rows in site.rows}
    return decide(sites, timings)


@needs_compiler
def test_a_gemm_shape_the_kernel_never_wins_keeps_one_layout():
    ops = kernels.load_layer_ops()
    assert ops is not None
    choice_ = forced({"gemm 64->256": 8})
    wrapped = chosen.ChosenOps(ops, choice_)
    blocked = pack_weight(torch.randn(128, 64), True)
    assert two_layouts(blocked, wrapped) is blocked  # gemm 64->128: never
    gate_up = pack_weight(torch.randn(256, 64), True)
    both = two_layouts(gate_up, wrapped)
    assert isinstance(both, TwoLayouts) and both.rows == 8
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 64)
        small = ops.small_linear(x, both.panels, 256) if rows <= 8 else linear(x, gate_up)
        assert torch.equal(linear(x, both), small)
    assert weight_copies(preset("tiny"), wrapped) == 2
    assert weight_copies(preset("tiny"), chosen.ChosenOps(ops, forced({"rms_norm": 512}))) == 1
    assert chosen.ChosenOps.of(ops, forced({})) is None
    assert chosen.ChosenAttention.of(kernels.load(), forced({"rms_norm": 512})) is None


@needs_compiler
def test_the_check_times_once_then_reads_its_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(races, "MIN_PAIRS", 1)
    monkeypatch.setattr(races, "CASE_S", 0.0)
    monkeypatch.setattr(races, "crowded", lambda: False)  # a busy test machine: cached all the same
    attention = kernels.load()
    ops = kernels.CpuLayerOps(attention.path)
    target = Target(preset("tiny"), block_size=4, gemm_rows=4)
    first = choice.choose(target, attention, ops, tmp_path, kernels.cpu_signature(), budget_s=60.0)
    [written] = tmp_path.glob("choice-*.json")
    cases = json.loads(written.read_text())["cases"]
    assert set(cases) == set(first.timings) and all(site.case(site.rows[0]) in cases for site in first.sites)

    def no_timing(*args):
        raise AssertionError("timed a case the cache has")

    monkeypatch.setattr(races, "race", no_timing)
    again = choice.choose(target, attention, ops, tmp_path, kernels.cpu_signature())
    assert again.limits == first.limits and again.timings == first.timings


def greedy_tokens() -> list[list[int]]:
    """Three prompts prefilled, decoded together for 4 steps, then the first alone for 4 (a step of 1 row)."""
    runner = ModelRunner(preset("tiny"), 64, 4, seed=7)
    prompts = [[1, 5, 9, 13, 17, 21, 25], [1, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(3)]
    tokens = [[int(runner.prefill(p, t, 0, len(p)).argmax())] for p, t in zip(prompts, tables)]
    positions = [len(p) for p in prompts]
    for step in range(8):
        count = 3 if step < 4 else 1
        logits = runner.decode([t[-1] for t in tokens[:count]], positions[:count], tables[:count])
        for row in range(count):
            tokens[row].append(int(logits[row].argmax()))
            positions[row] += 1
    return tokens


@needs_compiler
def test_engines_choosing_kernels_compute_the_tokens_of_torchs_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("KVC_KERNELS", "off")
    expected = greedy_tokens()
    monkeypatch.setenv("KVC_KERNELS", "auto")
    monkeypatch.setattr(races, "MIN_PAIRS", 1)
    monkeypatch.setattr(races, "CASE_S", 0.0)
    monkeypatch.setattr(chosen, "choose", lambda target, attention, ops, directory, cpu:
                        choice.choose(target, attention, ops, tmp_path, cpu, budget_s=1.0))
    assert greedy_tokens() == expected  # as timed on this machine
    every_way = {"decode_attention": 1, "prefill_attention": 64, "rms_norm": 16, "silu_mul": 1, "rotate_store": 1,
                 "gemm 64->128": 2, "gemm 64->64": 1, "gemm 64->256": 128, "gemm 128->64": 0}
    monkeypatch.setattr(chosen, "choose", lambda *args, **kwargs: forced(every_way))
    assert greedy_tokens() == expected  # kernels and torch's ops by row count, crossing within these steps
