"""The GPU decode path: the Triton paged attention kernel (`kernels/paged.py`) and decode steps through fixed buffers
replayed from CUDA graphs (`engine/model/graphs.py`).

On the CPU the kernel runs in Triton's interpreter and the buffers run eagerly (the CPU kernel reads the same
tables and lengths); with KVC_TEST_DEVICE=cuda (bench/engine/gpu_check.sh) the kernel is compiled for the GPU and the
steps are captured and replayed as graphs, checked against eager steps."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from factories import TEST_DEVICE

if TEST_DEVICE != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated: before the import below

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvcentric.core.block_pool import BlockPool  # noqa: E402
from kvcentric.engine.model.kernels import fused  # noqa: E402
from kvcentric.engine.model.graphs import DecodeGraphs, batch_buckets  # noqa: E402
from kvcentric.engine.model.kernels.fused import FusedOps  # noqa: E402
from kvcentric.engine.model.kernels.gpucheck import self_check  # noqa: E402
from kvcentric.engine.model.kernels.paged import PagedAttention, splits_for  # noqa: E402
from kvcentric.engine.model.batch import AttentionBatch, gather_blocks  # noqa: E402
from kvcentric.engine.model.dispatch import use_ops  # noqa: E402
from kvcentric.engine.model.llama import RMSNorm, Rotary  # noqa: E402
from kvcentric.engine.model.runner import ModelRunner, gpu_kernels_work  # noqa: E402
from kvcentric.model.config import preset  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)


def reference(q, k_cache, v_cache, tables, lengths, block_size, window=None):
    """Gather + SDPA in fp32 (the path the kernel replaces)."""
    keys, values = (gather_blocks(c.float(), tables, block_size) for c in (k_cache, v_cache))
    positions = torch.arange(tables.shape[1] * block_size, device=q.device)[None]
    newest = (lengths - 1)[:, None]
    mask = positions <= newest
    if window:
        mask &= positions > newest - window
    return F.scaled_dot_product_attention(q.float().unsqueeze(2), keys, values, attn_mask=mask[:, None, None],
                                          enable_gqa=True).squeeze(2)


def case(heads, kv_heads, head_dim, dtype, lengths=(1, 5, 64, 65, 130), block_size=4, blocks=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    v_cache = torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    width = max(lengths) // block_size + 1
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:width] for _ in lengths]).to(DEVICE)
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(DEVICE, dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, device=DEVICE)


@pytest.mark.parametrize("splits", [1, 4], ids=["whole", "split4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (8, 8, 64), (32, 8, 128), (6, 2, 24)],
                         ids=["gqa2-d16", "mha-d64", "gqa4-d128", "gqa3-d24"])
def test_paged_kernel_matches_gather_and_sdpa(dtype, window, heads, kv_heads, head_dim, splits):
    """Lengths of 1 (a share with no keys at 4 splits), around the 64-key tiles, and past them."""
    q, k_cache, v_cache, tables, lengths = case(heads, kv_heads, head_dim, dtype)
    out = PagedAttention(splits).decode(q, k_cache, v_cache, tables, lengths, 4, window)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding (8 bits)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, lengths, 4, window),
                               atol=tolerance, rtol=0)


def test_split_counts_fill_the_gpu_for_small_batches_only():
    assert [splits_for(batch, 8) for batch in (1, 2, 4, 16, 32, 64)] == [16, 16, 8, 2, 1, 1]


@pytest.mark.parametrize("splits", [1, 4], ids=["whole", "split4"])
def test_paged_kernel_reads_nothing_outside_a_sequences_blocks_and_length(splits):
    q, k_cache, v_cache, tables, lengths = case(4, 2, 16, torch.float32, lengths=(3, 9, 70))
    expected = PagedAttention(splits).decode(q, k_cache, v_cache, tables, lengths, 4)
    poisoned_k, poisoned_v = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    for row, length in enumerate(lengths.tolist()):
        for position in range(length):
            slot = tables[row, position // 4] * 4 + position % 4
            poisoned_k[slot], poisoned_v[slot] = k_cache[slot], v_cache[slot]
    out = PagedAttention(splits).decode(q, poisoned_k, poisoned_v, tables, lengths, 4)
    assert torch.equal(out, expected)


def test_batch_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]


# ---------------------------------------------------------------- decode steps through the graphs' buffers

BLOCK = 4
BLOCKS = 40
"""The allocator's blocks; the runner's cache has one more, the padding rows' spare block."""


VARIANTS = {"fp32": ("float32", None), "bf16-window6": ("bfloat16", 6)}
"""dtype and sliding window of the graphs' model (`tiny`, or `tiny` with Mistral's window of 6 positions)."""


def graph_runner(triton: bool, variant: str = "fp32") -> tuple[ModelRunner, DecodeGraphs]:
    """A `tiny` runner and its decode graphs with max batch 8: captured on CUDA, run eagerly over the same buffers
    on the CPU (its attention through the Triton kernel in the interpreter when `triton`, else the CPU kernel)."""
    dtype, window = VARIANTS[variant]
    config = dataclasses.replace(preset("tiny"), sliding_window=window)
    if DEVICE.type == "cuda":
        runner = ModelRunner(config, BLOCKS, BLOCK, dtype=dtype, device="cuda")
        assert runner.capture_decode_graphs(8) and runner.graphs is not None
        return runner, runner.graphs
    runner = ModelRunner(config, BLOCKS + 1, BLOCK, dtype=dtype)  # its last block is the spare one
    if triton:
        runner.kernels = PagedAttention(splits=2)  # the interpreter runs each program in turn: keep them few
    return runner, DecodeGraphs(runner, 8, BLOCKS * BLOCK, capture=False)


def prompts(count: int) -> list[list[int]]:
    return [[(7 * row + 3 * i) % 250 + 3 for i in range(5 + 6 * row)] for row in range(count)]


def outside_spare(cache: torch.Tensor) -> torch.Tensor:
    return cache[:, :BLOCKS * BLOCK]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("triton", [False, True], ids=["device-kernel", "triton"])
def test_steps_through_the_buffers_equal_plain_steps_and_padding_writes_only_the_spare_block(triton, variant):
    if triton and DEVICE.type == "cuda":
        pytest.skip("on CUDA the device kernel is the Triton one")
    runner, graphs = graph_runner(triton, variant)
    tolerance = 1e-5 if runner.dtype == torch.float32 else 2e-2  # bf16: GEMMs of 8 rows against 5 may round apart
    pool = BlockPool(BLOCKS, BLOCK)
    texts = prompts(5)
    tables = [pool.allocate(pool.blocks_for(len(t) + 4)) for t in texts]
    for text, table in zip(texts, tables):
        runner.prefill(text, table, 0)
    start = (runner.k_cache.clone(), runner.v_cache.clone())

    def steps(through_graphs: bool) -> list[torch.Tensor]:
        runner.k_cache.copy_(start[0])
        runner.v_cache.copy_(start[1])
        runner.graphs = graphs if through_graphs else None
        out = []
        for step, count in enumerate((5, 3, 1)):  # a smaller step after a bigger one in the same bucket
            ids = [(11 * row + step) % 250 + 3 for row in range(count)]
            positions = [len(t) + step for t in texts[:count]]
            out.append(runner.decode(ids, positions, tables[:count]))
        return out

    plain, plain_cache = steps(False), (outside_spare(runner.k_cache).clone(), outside_spare(runner.v_cache).clone())
    replayed = steps(True)
    for ours, theirs in zip(replayed, plain):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=0)
    # the padding rows wrote their KV only into the spare block: every other slot is as the plain steps left it
    torch.testing.assert_close(outside_spare(runner.k_cache), plain_cache[0], atol=tolerance, rtol=0)
    torch.testing.assert_close(outside_spare(runner.v_cache), plain_cache[1], atol=tolerance, rtol=0)


def test_a_step_past_the_largest_bucket_runs_eagerly():
    runner, graphs = graph_runner(False)
    pool = BlockPool(BLOCKS, BLOCK)
    tables = [pool.allocate(1) for _ in range(9)]
    assert graphs.run([5] * 9, [0] * 9, tables) is None
    runner.graphs = graphs
    assert runner.decode([5] * 9, [0] * 9, tables).shape == (9, preset("tiny").vocab_size)


def test_no_spare_block_and_no_graphs_off_cuda_or_when_turned_off():
    cpu = ModelRunner(preset("tiny"), 16, BLOCK)
    assert cpu.capture_decode_graphs(8) is False and cpu.graphs is None
    assert cpu.k_cache.shape[1] == 16 * BLOCK
    if DEVICE.type == "cuda":
        off = ModelRunner(preset("tiny"), 16, BLOCK, device="cuda", cuda_graphs=False)
        assert off.capture_decode_graphs(8) is False and off.k_cache.shape[1] == 16 * BLOCK
        on = ModelRunner(preset("tiny"), 16, BLOCK, device="cuda")
        assert on.k_cache.shape[1] == 17 * BLOCK and on.num_blocks == 16


# ---------------------------------------------------------------- the fused layer ops (kernels/fused.py)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rms_norm_and_swiglu_keep_torchs_arithmetic(dtype):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=generator).to(DEVICE, dtype)
    norm = RMSNorm(96, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    expected = norm(x)
    norm.ops = FusedOps()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: an ulp where the two sums round apart
    torch.testing.assert_close(norm(x), expected, atol=tolerance, rtol=tolerance)
    gate_up = torch.randn(5, 2 * 1100, generator=generator).to(DEVICE, dtype)  # past one 1024-wide tile
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(FusedOps.silu_mul(gate_up), F.silu(gate) * up, atol=tolerance, rtol=tolerance)


@triton.jit
def _round_to_bf16(x_ptr, out_ptr, SIZE: tl.constexpr):
    at = tl.arange(0, SIZE)
    tl.store(out_ptr + at, fused._rounded(tl.load(x_ptr + at), 1))


def test_the_bf16_rounding_is_to_nearest_even_and_keeps_nans():
    """Every NaN stays one, the GPU's own (bits 0x7fffffff) included, whose rounding carry would wrap it to -0."""
    bits = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800000, 0x3F808000, 0x3F818000, 0x3F80C000,
                         0x00000001], dtype=torch.int64).to(torch.int32)  # NaNs, inf, two ties, above a tie, tiny
    x = bits.view(torch.float32).to(DEVICE)
    out = torch.empty_like(x)
    _round_to_bf16[(1,)](x, out, SIZE=8)
    assert out[:3].isnan().all()
    torch.testing.assert_close(out[3:], x[3:].to(torch.bfloat16).float(), atol=0, rtol=0)  # torch rounds to even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rotary_writes_the_cache_as_rotary_and_index_copy_do(dtype):
    config = preset("tiny")
    rotary = Rotary(config).to(DEVICE)
    rotary.compute_tables(DEVICE, dtype)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    generator = torch.Generator().manual_seed(4)
    qkv = torch.randn(6, heads + 2 * kv_heads, dim, generator=generator).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 7, 30, 31, 500], device=DEVICE)
    slots = torch.tensor([9, 3, 40, 41, 0, 17], device=DEVICE)
    caches = [torch.zeros(64, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    q, k, v = FusedOps.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots, *caches[:2])
    batch = AttentionBatch(positions, slots)
    expected_q = rotary(qkv[:, :heads], batch)
    expected_k = rotary(qkv[:, heads:heads + kv_heads], batch)
    caches[2].index_copy_(0, slots, expected_k)
    caches[3].index_copy_(0, slots, qkv[:, heads + kv_heads:])
    exact = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 0}  # bf16: same roundings
    for ours, theirs in ((q, expected_q), (k, expected_k), (v, qkv[:, heads + kv_heads:]), (caches[0], caches[2]),
                         (caches[1], caches[3])):
        torch.testing.assert_close(ours, theirs, **exact)


def test_a_model_with_every_gpu_kernel_decodes_the_tokens_of_the_plain_one():
    """The whole GPU layer (fused ops, Triton paged decode) through the runner: the greedy tokens and logits of
    torch's ops with SDPA. On the CPU in the interpreter; on CUDA compiled."""
    plain = ModelRunner(preset("tiny"), 16, BLOCK, device=TEST_DEVICE, cpu_kernels=False, gpu_kernels=False)
    fused = ModelRunner(preset("tiny"), 16, BLOCK, device=TEST_DEVICE)
    if DEVICE.type == "cpu":
        fused.kernels = PagedAttention(splits=2)  # the interpreter runs each program in turn: keep them few
        use_ops(fused.model, FusedOps())
    tables = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    texts = [[5, 9, 14, 200, 3, 3, 41], [77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    tokens: dict[str, list[list[int]]] = {}
    last: dict[str, torch.Tensor] = {}
    for name, runner in (("plain", plain), ("fused", fused)):
        firsts = [int(runner.prefill(text, table, 0).argmax()) for text, table in zip(texts, tables)]
        out = [[first] for first in firsts]
        for step in range(6):
            positions = [len(text) + step for text in texts]
            logits = runner.decode([o[-1] for o in out], positions, tables)
            for row, chosen in enumerate(logits.argmax(-1).tolist()):
                out[row].append(chosen)
        tokens[name], last[name] = out, logits
    assert tokens["fused"] == tokens["plain"]
    torch.testing.assert_close(last["fused"], last["plain"], atol=1e-4, rtol=0)


# ---------------------------------------------------------------- the check at start (kernels/gpucheck.py)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_the_start_check_passes_working_kernels(dtype, model, block_size):
    assert self_check(preset(model), dtype, DEVICE, block_size) is None


def test_the_start_check_names_a_kernel_that_disagrees(monkeypatch):
    monkeypatch.setattr(PagedAttention, "decode", lambda self, q, *rest: torch.zeros_like(q))
    assert "paged decode attention" in self_check(preset("tiny"), torch.float32, DEVICE, 4)


def test_kernels_that_fail_their_check_leave_torchs_ops_with_a_warning(monkeypatch):
    import kvcentric.engine.model.kernels.gpucheck as gpucheck

    def broken(*args):
        raise RuntimeError("PTX .version 9.9 does not support .target sm_70")

    monkeypatch.setattr(gpucheck, "self_check", broken)
    with pytest.warns(RuntimeWarning, match="failed their check.*sm_70.*torch's ops"):
        assert gpu_kernels_work(preset("tiny"), torch.float32, DEVICE, 4) is False
    monkeypatch.setattr(gpucheck, "self_check", lambda *args: None)
    assert gpu_kernels_work(preset("tiny"), torch.float32, DEVICE, 4) is True
