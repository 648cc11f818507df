"""The CPU attention kernels (`engine/model/kernels`): decode over the paged cache in place gives the numbers of
gathering the blocks and running SDPA, prefill of whole prompts those of causal SDPA per prompt, in fp32 and
bf16, with GQA, sliding windows, any block layout and prompt lengths; the fused layer ops give torch's SwiGLU to fp32
rounding and torch's rotary and cache write bit for bit; the small GEMM gives torch's linear layers to fp32 rounding,
each row's sums the same whatever rows are beside it; the engine's steps give the same tokens with them as
without; without a working compiler the engine falls back to SDPA and torch's ops."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvcentric.engine.model import kernels
from kvcentric.engine.model.batch import AttentionBatch
from kvcentric.engine.model.gemm import SMALL_GEMM_ROWS, TwoLayouts, linear, linear_add, pack_weight, two_layouts
from kvcentric.engine.model.llama import Rotary
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def kernel() -> kernels.CpuAttention:
    loaded = kernels.load()
    assert loaded is not None, "the kernel did not build on a machine with a compiler"
    return loaded


def gathered(q, k_cache, v_cache, tables, lengths, block_size, window=None):
    """What the engine computed before the kernel: every block copied out, then one masked SDPA call."""
    blocks = k_cache.shape[0] // block_size
    keys, values = (c.view(blocks, block_size, *c.shape[1:])[tables].flatten(1, 2).transpose(1, 2)
                    for c in (k_cache, v_cache))
    key_pos = torch.arange(tables.shape[1] * block_size)[None]
    mask = key_pos < lengths[:, None]
    if window is not None:
        mask &= key_pos >= lengths[:, None] - window
    return F.scaled_dot_product_attention(q[:, :, None].float(), keys.float(), values.float(),
                                          attn_mask=mask[:, None, None], enable_gqa=True)[:, :, 0]


def case(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, max_len: int, seed: int,
         dtype=torch.float32):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    per_row = -(-max_len // block_size)
    blocks = batch * per_row + 3
    k_cache, v_cache = (torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    order = torch.randperm(blocks, generator=generator)[:batch * per_row]
    tables = order.view(batch, per_row).contiguous()
    lengths = torch.tensor([rng.randint(1, max_len) for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, lengths


@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,block_size,max_len", [
    (1, 8, 4, 64, 16, 300),    # one sequence: its heads split over the team
    (3, 4, 1, 32, 4, 70),      # multi-query, small blocks
    (9, 8, 8, 16, 16, 50),     # enough sequences for a whole row of heads per item, no GQA
    (32, 8, 2, 64, 16, 289),   # a decode batch of `small`'s shape, groups of 4
    (10, 12, 4, 128, 16, 100),  # groups of three (an odd last row), a wide head
    (8, 6, 2, 48, 8, 77),       # three vectors a head
])
def test_matches_gather_and_sdpa_in_fp32(kernel, batch, heads, kv_heads, head_dim, block_size, max_len):
    q, k_cache, v_cache, tables, lengths = case(batch, heads, kv_heads, head_dim, block_size, max_len, seed=batch)
    out = kernel.decode(q, k_cache, v_cache, tables, lengths, block_size)
    assert out is not None and out.shape == q.shape
    torch.testing.assert_close(out, gathered(q, k_cache, v_cache, tables, lengths, block_size), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window_attends_to_the_last_positions_only(kernel, window):
    q, k_cache, v_cache, tables, lengths = case(5, 4, 2, 32, 8, 60, seed=window)
    out = kernel.decode(q, k_cache, v_cache, tables, lengths, 8, window)
    torch.testing.assert_close(out, gathered(q, k_cache, v_cache, tables, lengths, 8, window), atol=2e-6, rtol=1e-5)


def test_bf16_within_its_rounding(kernel):
    q, k_cache, v_cache, tables, lengths = case(12, 8, 4, 64, 16, 200, seed=3, dtype=torch.bfloat16)
    out = kernel.decode(q, k_cache, v_cache, tables, lengths, 16)
    assert out is not None and out.dtype == torch.bfloat16
    expected = gathered(q, k_cache, v_cache, tables, lengths, 16)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_declines_what_it_does_not_take(kernel):
    q, k_cache, v_cache, tables, lengths = case(2, 4, 2, 32, 16, 20, seed=1)
    assert kernel.decode(q.half(), k_cache.half(), v_cache.half(), tables, lengths, 16) is None  # fp16
    assert kernel.decode(q, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, tables, lengths, 16) is None
    assert kernel.decode(q, k_cache, v_cache, tables.int(), lengths, 16) is None  # int32 tables
    assert kernel.decode(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, tables, lengths, 16) is None
    rows = torch.randn(10, 8, 32)
    out = torch.full((10, 4, 32), 7.0)
    starts, lengths = torch.tensor([0, 4]), torch.tensor([4, 6])
    assert not kernel.prefill(rows[:, :4].half(), rows[:, 4:6].half(), rows[:, 6:].half(), out.half(), starts, lengths)
    assert not kernel.prefill(rows[:, :4], rows[:, 4:6], rows[:, 6:], out, starts, torch.tensor([4, 7]))  # past the end
    assert not kernel.prefill(rows[:, :4, :24], rows[:, 4:6, :24], rows[:, 6:, :24], out[..., :24], starts, lengths)
    assert bool((out == 7.0).all())  # declined: nothing written


def test_one_openmp_runtime_in_the_process(kernel):
    """The library links the libgomp torch loaded, so its loops run on torch's team, not a second one."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


def prompt_rows(lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int, dtype=torch.float32):
    """q, k, v as the engine has them: views of one [tokens, heads + 2 kv_heads, head_dim] projection."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(lengths), heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    return rows[:, :heads], rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:], starts, torch.tensor(lengths)


def causal_sdpa(q, k, v, starts, lengths):
    out = torch.zeros(q.shape, dtype=torch.float32)
    for start, length in zip(starts.tolist(), lengths.tolist()):
        rows = slice(start, start + length)
        out[rows] = F.scaled_dot_product_attention(*(t[rows].float().transpose(0, 1) for t in (q, k, v)),
                                                   is_causal=True, enable_gqa=True).transpose(0, 1)
    return out


@pytest.mark.parametrize("lengths,heads,kv_heads,head_dim", [
    ([256], 8, 4, 64),                 # one prompt of `small`'s shape
    ([1, 2, 63, 64, 65, 130], 4, 1, 32),  # lengths around the tiles, multi-query
    ([300, 17], 6, 6, 16),             # no GQA, an odd group of rows
    ([129], 12, 4, 128),               # groups of three, a wide head
    ([70, 33], 4, 2, 48),              # three vectors a row (AVX-512: the 3-wide accumulators)
    ([90], 6, 2, 96),                  # four vectors and two
])
def test_prefill_matches_causal_sdpa_in_fp32(kernel, lengths, heads, kv_heads, head_dim):
    q, k, v, starts, lengths_ = prompt_rows(lengths, heads, kv_heads, head_dim, seed=len(lengths))
    out = torch.empty(q.shape)
    assert kernel.prefill(q, k, v, out, starts, lengths_)
    torch.testing.assert_close(out, causal_sdpa(q, k, v, starts, lengths_), atol=2e-6, rtol=1e-5)


def test_the_portable_build_computes_the_same(kernel_builds: Path):
    """The library built for plain x86-64 (no vector paths): the same prefill, decode and ops (the session's build,
    `kernel_builds`)."""
    path = kernels.build(kernel_builds, isa="portable")
    portable, ops = kernels.CpuAttention(path), kernels.CpuLayerOps(path)
    q, k, v, starts, lengths = prompt_rows([1, 63, 65, 256], 8, 4, 64, seed=11)
    out = torch.empty(q.shape)
    assert portable.prefill(q, k, v, out, starts, lengths)
    torch.testing.assert_close(out, causal_sdpa(q, k, v, starts, lengths), atol=2e-6, rtol=1e-5)
    q, k_cache, v_cache, tables, lengths = case(12, 8, 4, 64, 16, 90, seed=4)
    torch.testing.assert_close(portable.decode(q, k_cache, v_cache, tables, lengths, 16),
                               gathered(q, k_cache, v_cache, tables, lengths, 16), atol=2e-6, rtol=1e-5)
    gate_up = torch.randn(5, 64)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :32]) * gate_up[:, 32:], rtol=1e-6, atol=0)
    weight, x = torch.randn(48, 40), torch.randn(13, 40)
    torch.testing.assert_close(ops.small_linear(x, ops.pack_panels(weight), 48), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_prefill_writes_only_the_prompts_rows(kernel):
    q, k, v, _, _ = prompt_rows([50], 4, 2, 32, seed=5)
    out = torch.full(q.shape, 3.0)
    assert kernel.prefill(q, k, v, out, torch.tensor([10, 30]), torch.tensor([12, 8]))
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[10:22] = untouched[30:38] = False
    assert bool((out[untouched] == 3.0).all())
    starts, lengths = torch.tensor([10, 30]), torch.tensor([12, 8])
    expected = causal_sdpa(q, k, v, starts, lengths)
    torch.testing.assert_close(out[~untouched], expected[~untouched], atol=2e-6, rtol=1e-5)


def test_prefill_bf16_within_its_rounding(kernel):
    q, k, v, starts, lengths = prompt_rows([100, 200], 8, 4, 64, seed=9, dtype=torch.bfloat16)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    assert kernel.prefill(q, k, v, out, starts, lengths)
    torch.testing.assert_close(out.float(), causal_sdpa(q, k, v, starts, lengths), atol=1e-2, rtol=1e-2)


def decode_tokens(cpu_kernels: bool) -> list[list[int]]:
    """Greedy tokens of three prompts of different lengths (prefilled), then decoded together for 12 steps."""
    config = preset("tiny")
    runner = ModelRunner(config, 64, 4, seed=7, cpu_kernels=cpu_kernels)
    assert (runner.kernels is not None) == cpu_kernels
    prompts = [[1, 5, 9, 13, 17, 21, 25], [1, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(3)]
    tokens = []
    for prompt, table in zip(prompts, tables):
        logits = runner.prefill(prompt, table, 0, len(prompt))
        tokens.append([int(logits.argmax())])
    positions = [len(p) for p in prompts]
    for _ in range(12):
        logits = runner.decode([t[-1] for t in tokens], positions, tables)
        for row, sequence in enumerate(tokens):
            sequence.append(int(logits[row].argmax()))
        positions = [p + 1 for p in positions]
    return tokens


def test_engine_computes_the_same_tokens_with_the_kernels():
    assert decode_tokens(True) == decode_tokens(False)


@pytest.fixture(scope="module")
def layer_ops() -> kernels.CpuLayerOps:
    loaded = kernels.load_layer_ops()
    assert loaded is not None, "the library did not build on a machine with a compiler"
    return loaded


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_mul_is_torchs_to_fp32_rounding(layer_ops, rows):
    gate_up = torch.randn(rows, 2 * 1408, generator=torch.Generator().manual_seed(rows)) * 4
    gate_up[0, :6] = torch.tensor([100.0, -100.0, 88.8, -88.8, 0.0, -0.0])  # e^-x past both ends of its range
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    got = layer_ops.silu_mul(gate_up)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    strided = torch.randn(rows, 2 * 1408 + 16)[:, :2 * 1408]  # rows of a wider tensor
    torch.testing.assert_close(layer_ops.silu_mul(strided), F.silu(strided[:, :1408]) * strided[:, 1408:],
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_rms_norm_is_torchs_to_fp32_rounding(layer_ops, rows):
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 512, generator=generator) * 3, torch.randn(512, generator=generator)
    got = layer_ops.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, F.rms_norm(x, weight.shape, weight, 1e-5), rtol=2e-6, atol=1e-6)
    strided = torch.randn(rows, 512 + 16, generator=generator)[:, 16:]  # rows of a wider tensor
    torch.testing.assert_close(layer_ops.rms_norm(strided, weight, 1e-6), F.rms_norm(strided, (512,), weight, 1e-6),
                               rtol=2e-6, atol=1e-6)


def test_rms_norm_leaves_what_it_does_not_take_to_torch(layer_ops):
    weight = torch.randn(64)
    for x in (torch.randn(2, 3, 64), torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, 4).t()):
        expected = F.rms_norm(x, weight.shape, weight.to(x.dtype), 1e-5)
        assert torch.equal(layer_ops.rms_norm(x, weight.to(x.dtype), 1e-5), expected)


def test_rotate_store_is_torchs_rotary_and_cache_write_bit_for_bit(layer_ops):
    config = preset("small")
    rotary = Rotary(config)
    rotary.compute_tables(torch.device("cpu"), torch.float32)
    heads, kv_heads, tokens = config.num_heads, config.num_kv_heads, 300
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, config.head_dim, generator=generator)
    positions = torch.randint(0, config.max_position, (tokens,), generator=generator)
    slots = torch.randperm(1000, generator=generator)[:tokens]
    caches = [torch.zeros(1000, kv_heads, config.head_dim) for _ in range(4)]
    q, k, v = layer_ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots, *caches[:2])
    rotated = rotary(qkv[:, :heads + kv_heads], AttentionBatch(positions, slots))
    caches[2].index_copy_(0, slots, rotated[:, heads:])
    caches[3].index_copy_(0, slots, qkv[:, heads + kv_heads:])
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])
    assert torch.equal(v, qkv[:, heads + kv_heads:])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError):  # never a write past the cache
        layer_ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots + 1000, *caches[:2])


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 31, 64])
@pytest.mark.parametrize("out_features, in_features", [(1024, 512), (2816, 512), (512, 1408), (48, 40)])
def test_small_linear_is_torchs_to_fp32_rounding(layer_ops, rows, out_features, in_features):
    """Every row count (one block of rows or several), a width with a last panel of 16 (48), an input width no
    multiple of a vector (40), with and without bias and residual, rows of a wider tensor."""
    generator = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    x = torch.randn(rows, in_features + 8, generator=generator)[:, 8:]
    bias = torch.randn(out_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    panels = layer_ops.pack_panels(weight)
    assert panels is not None
    expected = x.double() @ weight.double().t()
    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
        got = layer_ops.small_linear(x, panels, out_features, b, r)
        want = expected + (0 if b is None else b.double()) + (0 if r is None else r.double())
        assert got is not None and got.shape == (rows, out_features) and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_small_linear_rows_do_not_depend_on_the_batch(layer_ops):
    """A row's outputs are the same bits alone, first, last or among 31 others (a decode step's logits do not
    depend on what else is in the batch), on one thread or two."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(1024, 512, generator=generator), torch.randn(32, 512, generator=generator)
    panels = layer_ops.pack_panels(weight)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            batched = layer_ops.small_linear(x, panels, 1024)
            for row in (0, 17, 31):
                assert torch.equal(layer_ops.small_linear(x[row:row + 1], panels, 1024)[0], batched[row])
                assert torch.equal(layer_ops.small_linear(x[row:], panels, 1024)[0], batched[row])
    finally:
        torch.set_num_threads(threads)


def test_small_linear_declines_what_it_does_not_take(layer_ops):
    assert layer_ops.pack_panels(torch.randn(40, 64)) is None  # out not a multiple of 16
    assert layer_ops.pack_panels(torch.randn(32, 64, dtype=torch.bfloat16)) is None
    panels = layer_ops.pack_panels(torch.randn(32, 64))
    assert layer_ops.small_linear(torch.randn(64, 4).t(), panels, 32) is None  # columns not contiguous
    assert layer_ops.small_linear(torch.randn(4, 63), panels, 32) is None  # another input width
    assert layer_ops.small_linear(torch.randn(4, 64, dtype=torch.bfloat16), panels, 32) is None
    assert layer_ops.small_linear(torch.randn(4, 64), panels, 32, bias=torch.randn(31)) is None
    assert layer_ops.small_linear(torch.randn(4, 64), panels, 32, residual=torch.randn(3, 32)) is None


def test_two_layouts_take_few_rows_to_the_small_gemm_and_many_to_onednn(layer_ops):
    generator = torch.Generator().manual_seed(5)
    plain = torch.randn(512, 1408, generator=generator) / 1408 ** 0.5
    blocked = pack_weight(plain, True)
    both = two_layouts(blocked, layer_ops)
    assert isinstance(both, TwoLayouts) and torch.equal(both.panels, layer_ops.pack_panels(plain))
    for rows in (1, SMALL_GEMM_ROWS, SMALL_GEMM_ROWS + 1, 600):
        x, residual = torch.randn(rows, 1408, generator=generator), torch.randn(rows, 512, generator=generator)
        small = rows <= SMALL_GEMM_ROWS
        expected = layer_ops.small_linear(x, both.panels, 512) if small else linear(x, blocked)
        assert torch.equal(linear(x, both), expected)
        expected = layer_ops.small_linear(x, both.panels, 512, None, residual) if small \
            else linear_add(x, blocked, None, residual)
        assert torch.equal(linear_add(x, both, None, residual), expected)
        torch.testing.assert_close(linear(x, both), x @ plain.t(), rtol=1e-4, atol=1e-4)
    assert two_layouts(both, layer_ops) is both
    odd = pack_weight(torch.randn(258, 512), True)  # a vocabulary of 258: no panels, oneDNN's layout as it was
    assert two_layouts(odd, layer_ops) is odd


def test_fp32_cpu_runners_use_the_layer_ops_and_compute_the_same_logits():
    with_ops, without = (ModelRunner(preset("tiny"), 64, 4, seed=7) for _ in range(2))
    assert isinstance(with_ops.model.layers[0].mlp.ops, kernels.CpuLayerOps)
    assert isinstance(with_ops.model.layers[0].mlp.gate_up, TwoLayouts)
    from kvcentric.engine.model.dispatch import use_ops
    use_ops(without.model, None)
    prompt = list(range(1, 40))
    got, expected = (r.prefill(prompt, list(range(16)), 0, len(prompt), every_row=True) for r in (with_ops, without))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(with_ops.k_cache, without.k_cache) or torch.allclose(with_ops.k_cache, without.k_cache,
                                                                            rtol=1e-5, atol=1e-6)
    assert ModelRunner(preset("tiny"), 16, 4, dtype="bfloat16").model.layers[0].mlp.ops is None  # fp32 only
    assert ModelRunner(preset("tiny"), 16, 4, cpu_kernels=False).model.layers[0].mlp.ops is None


def test_without_a_compiler_the_engine_gathers(tmp_path: Path, monkeypatch, caplog):
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'no such compiler here' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    monkeypatch.setenv("KVC_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no such compiler here"):
        kernels.build()
    assert kernels.load() is None
    assert "attention runs through torch's SDPA" in caplog.text
    runner = ModelRunner(preset("tiny"), 8, 4, seed=0)
    assert runner.kernels is None and runner.model.layers[0].mlp.ops is None
    logits = runner.decode([1], [0], [[0]])
    assert logits.shape == (1, preset("tiny").vocab_size) and torch.isfinite(logits).all()


def test_build_is_cached_per_source_and_cpu(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KVC_KERNEL_CACHE", str(tmp_path))
    first = kernels.build()
    modified = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == modified  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch left behind
    assert shutil.which(kernels.compiler() or "")


def test_without_a_compiler_the_widest_prebuilt_kernels_this_cpu_runs_are_used(tmp_path: Path, monkeypatch,
                                                                              kernel_builds: Path):
    monkeypatch.setenv("KVC_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVC_KERNEL_PREBUILT", str(tmp_path / "prebuilt"))
    built = kernels.prebuild(tmp_path / "prebuilt", kernel_builds)  # the session's compiles, copied in
    assert "portable" in [path.name.split("-")[1] for path in built]
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-compiler-here"))
    assert kernels.compiler() is None
    widest = next(name for name in ("avx512", "avx2", "portable") if name in kernels.runnable())
    library = kernels.build()
    assert library.parent == tmp_path / "prebuilt" and library.name.startswith(f"kernels-{widest}-")
    assert kernels.CpuAttention(library).isa == widest
    assert kernels.build(isa="portable").name.startswith("kernels-portable-")
    for path in built:
        path.unlink()
    with pytest.raises(RuntimeError, match="no build made ahead of time"):
        kernels.build()
