"""The CPU kernels in every instruction-set build this CPU can run (`KVC_CPU_ISA`: portable, avx2, avx512, native),
each loaded from its own library in this process: decode and prefill attention give SDPA's numbers, the layer ops
torch's, the small GEMM torch's linear to fp32 rounding and the same bits in every build (one in-order fused
multiply-add chain per output, whatever the vectors); the AVX-512 build compiles on any x86-64 machine; the ISA
is chosen by name, checked against the CPU before loading, and capped alike for torch in a subprocess.

The `avx512` cases run on a CPU without AVX-512 too, through the `avx512-emulated` build (the kernels' AVX-512 lines,
16 lanes and tiles, over SIMDe's portable `__m512`), wherever the compiler finds SIMDe's headers (libsimde-dev);
they skip only where the CPU has no AVX-512 and there is no SIMDe to emulate it with."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvcentric.engine.model import kernels
from kvcentric.engine.model.kernels import isas
from kvcentric.engine.model.batch import AttentionBatch
from kvcentric.engine.model.llama import Rotary
from kvcentric.model.config import preset

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler on this machine")

VECTORS = {"portable": "portable", "avx2": "avx2", "avx512": "avx512", kernels.EMULATED: "avx512-emulated"}
"""What the library of each ISA says it was built with (`native`: whichever this CPU has)."""


def emulation() -> str:
    """Why the AVX-512 path cannot be emulated here ("" where it can: SIMDe's headers found, and the AVX2 its
    build is compiled for)."""
    try:
        isas.check_cpu(kernels.EMULATED)
    except kernels.UnsupportedIsa as exc:
        return str(exc)
    if kernels.simde_version() is None:
        return ("the compiler finds no SIMDe headers to emulate it with (simde/x86/avx512.h: apt-get install "
                "libsimde-dev; a machine with only Python and pip has none)")
    return ""


@pytest.fixture(scope="session")
def builds(kernel_builds) -> dict[str, Path]:
    """Each runnable ISA's library, built side by side into the session's folder of builds (`kernel_builds`, which
    compiled them in parallel; `native` from the cache the engine uses, built there once per source), and
    `avx512-emulated` where this CPU has no AVX-512 and the emulation can be built."""
    names: list[str] = [name for name in kernels.runnable() if name != "native"]
    if "avx512" not in names and not emulation():
        names.append(kernels.EMULATED)
    built = {name: kernels.build(kernel_builds, name) for name in names}
    built["native"] = kernels.build(None, "native")
    return built


@pytest.fixture(params=list(isas.ISAS))
def library(request, builds) -> tuple[str, kernels.CpuAttention, kernels.CpuLayerOps]:
    """The ISA's library; `avx512`'s is the emulated build where this CPU has no AVX-512."""
    name = request.param
    if name == "avx512" and name not in builds:
        if kernels.EMULATED not in builds:
            pytest.skip(f"this CPU has no AVX-512, and the AVX-512 path cannot be emulated: {emulation()}")
        name = kernels.EMULATED
    if name not in builds:
        pytest.skip(f"this CPU cannot run {name}")
    path = builds[name]
    return name, kernels.CpuAttention(path), kernels.CpuLayerOps(path)


def test_each_build_says_which_vectors_it_has(library):
    name, attention, _ = library
    expected = VECTORS.get(name) or ("avx512" if "avx512f" in isas.cpu_flags() else
                                     "avx2" if {"avx2", "fma"} <= isas.cpu_flags() else "portable")
    assert attention.isa == expected and f"kernels-{name}-" in attention.path.name


def test_the_emulated_avx512_build_has_no_avx512_instruction(builds):
    """What runs as `avx512` here on a CPU without it is SIMDe's code for AVX2: no zmm register, no mask register
    (an instruction of AVX-512 left in it would end in SIGILL, or would mean a real intrinsic slipped through)."""
    if kernels.EMULATED not in builds:
        pytest.skip("no emulated build here: " + ("this CPU has AVX-512" if "avx512" in builds else emulation()))
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to disassemble it with")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(builds[kernels.EMULATED])], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    assert "kvc_prefill_attention" in code and "kvc_small_gemm" in code
    assert not re.search(r"%zmm|%k[0-7]\b", code)


def paged_case(batch, heads, kv_heads, head_dim, block_size, max_len, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    per_row = -(-max_len // block_size)
    blocks = batch * per_row + 2
    k_cache, v_cache = (torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    tables = torch.randperm(blocks, generator=generator)[:batch * per_row].view(batch, per_row).contiguous()
    lengths = torch.randint(1, max_len + 1, (batch,), generator=generator)
    q = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, lengths


def gathered_sdpa(q, k_cache, v_cache, tables, lengths, block_size, window=None):
    blocks = k_cache.shape[0] // block_size
    keys, values = (c.view(blocks, block_size, *c.shape[1:])[tables].flatten(1, 2).transpose(1, 2).float()
                    for c in (k_cache, v_cache))
    position = torch.arange(tables.shape[1] * block_size)[None]
    mask = position < lengths[:, None]
    if window is not None:
        mask &= position >= lengths[:, None] - window
    return F.scaled_dot_product_attention(q[:, :, None].float(), keys, values, attn_mask=mask[:, None, None],
                                          enable_gqa=True)[:, :, 0]


@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,block_size,max_len,window", [
    (3, 4, 4, 32, 16, 70, None),     # no GQA: every row alone
    (5, 8, 4, 64, 16, 200, None),    # groups of two, `small`'s heads
    (4, 12, 4, 128, 8, 90, None),    # groups of three (an odd last row), a wide head: two passes of AVX2 vectors
    (9, 16, 4, 64, 16, 50, 20),      # a whole slot's heads per item, groups of four, a sliding window
    (2, 6, 2, 48, 4, 33, None),      # three vectors of AVX-512, six of AVX2
])
def test_decode_is_sdpa_over_the_gathered_blocks(library, batch, heads, kv_heads, head_dim, block_size, max_len,
                                                 window):
    _, attention, _ = library
    q, k_cache, v_cache, tables, lengths = paged_case(batch, heads, kv_heads, head_dim, block_size, max_len, head_dim)
    out = attention.decode(q, k_cache, v_cache, tables, lengths, block_size, window)
    expected = gathered_sdpa(q, k_cache, v_cache, tables, lengths, block_size, window)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_decode_bf16_within_its_rounding(library):
    _, attention, _ = library
    q, k_cache, v_cache, tables, lengths = paged_case(6, 8, 4, 64, 16, 120, 1, torch.bfloat16)
    out = attention.decode(q, k_cache, v_cache, tables, lengths, 16)
    assert out is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), gathered_sdpa(q, k_cache, v_cache, tables, lengths, 16), atol=1e-2,
                               rtol=1e-2)


def causal_case(lengths, heads, kv_heads, head_dim, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(lengths), heads + 2 * kv_heads, head_dim, generator=generator)
    q, k, v = rows[:, :heads], rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    expected = torch.cat([F.scaled_dot_product_attention(*(t[a:a + n].transpose(0, 1) for t in (q, k, v)),
                                                         is_causal=True, enable_gqa=True).transpose(0, 1)
                          for a, n in zip(starts.tolist(), lengths)])
    return q, k, v, starts, torch.tensor(lengths), expected


@pytest.mark.parametrize("lengths,heads,kv_heads,head_dim", [
    ([1, 2, 63, 64, 65, 130], 4, 1, 32),  # lengths around the key and query tiles, multi-query
    ([100], 8, 4, 64),                    # `small`'s heads
    ([70], 12, 4, 128),                   # groups of three, a wide head
    ([30, 17], 6, 6, 48),                 # no GQA, an odd number of vectors a head
])
def test_prefill_is_causal_sdpa(library, lengths, heads, kv_heads, head_dim):
    _, attention, _ = library
    q, k, v, starts, lengths_, expected = causal_case(lengths, heads, kv_heads, head_dim, head_dim)
    out = torch.empty(q.shape)
    assert attention.prefill(q, k, v, out, starts, lengths_)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_prefill_takes_heads_of_whole_16s_only(library):
    _, attention, _ = library
    q, k, v, starts, lengths, _ = causal_case([9], 4, 2, 24, 0)
    assert not attention.prefill(q, k, v, torch.empty(q.shape), starts, lengths)


def test_layer_ops_are_torchs(library):
    _, _, ops = library
    generator = torch.Generator().manual_seed(2)
    gate_up = torch.randn(7, 2 * 200, generator=generator) * 4
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 88.8, -88.8])  # e^-x past both ends of its range
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :200]) * gate_up[:, 200:], rtol=1e-6, atol=0)
    x, weight = torch.randn(33, 200, generator=generator) * 3, torch.randn(200, generator=generator)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (200,), weight, 1e-5), rtol=2e-6,
                               atol=1e-6)
    config = preset("small")
    rotary = Rotary(config)
    rotary.compute_tables(torch.device("cpu"), torch.float32)
    heads, kv_heads = config.num_heads, config.num_kv_heads
    qkv = torch.randn(40, heads + 2 * kv_heads, config.head_dim, generator=generator)
    positions, slots = torch.randint(0, 512, (40,), generator=generator), torch.randperm(64, generator=generator)[:40]
    caches = [torch.zeros(64, kv_heads, config.head_dim) for _ in range(2)]
    q, k, v = ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots, *caches)
    rotated = rotary(qkv[:, :heads + kv_heads], AttentionBatch(positions, slots))
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])  # bit for bit
    assert torch.equal(caches[0][slots], rotated[:, heads:]) and torch.equal(caches[1][slots], v)



ROW_COUNTS = (1, 3, 8, 33)
"""Rows of a case (sequences, prompt tokens, activations): one, an odd few, a whole AVX2 vector's worth, and past
AVX-512's 16 and 32, so that every tail of the 16-lane loops is taken."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", ROW_COUNTS)
def test_decode_at_every_row_count(library, batch, dtype):
    """Heads of 48 (three AVX-512 vectors, six of AVX2), of 40 (whole vectors of AVX2, none of AVX-512: its scalar
    loops) and of 16 (`tiny`'s: one AVX-512 vector), groups of three (an odd last row), contexts ending inside
    blocks; from 8 sequences on an item reads a slot's heads together."""
    _, attention, _ = library
    for heads, kv_heads, head_dim in ((6, 2, 48), (3, 1, 40), (4, 2, 16)):
        q, k_cache, v_cache, tables, lengths = paged_case(batch, heads, kv_heads, head_dim, 16, 75, batch, dtype)
        out = attention.decode(q, k_cache, v_cache, tables, lengths, 16)
        assert out is not None and out.dtype == dtype
        expected = gathered_sdpa(q, k_cache, v_cache, tables, lengths, 16)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
        else:
            torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_prefill_at_every_row_count(library, rows, dtype):
    """A prompt of `rows` tokens alone and beside one of 70 (a second key tile, 6 keys into it), heads of 80 (with
    AVX-512 a pass of four vectors and one left over) in groups of three, and of 16: the masked loads of the key
    tiles' tails."""
    _, attention, _ = library
    for lengths, head_dim in (([rows], 80), ([rows, 70], 80), ([rows, 70], 16)):
        q, k, v, starts, lengths_, expected = causal_case(lengths, 6, 2, head_dim, rows)
        if dtype == torch.bfloat16:  # SDPA of the rounded inputs
            q, k, v = (t.to(dtype) for t in (q, k, v))
            expected = torch.cat([
                F.scaled_dot_product_attention(*(t[a:a + n].float().transpose(0, 1) for t in (q, k, v)),
                                               is_causal=True, enable_gqa=True).transpose(0, 1)
                for a, n in zip(starts.tolist(), lengths)])
        out = torch.empty(q.shape, dtype=dtype)
        assert attention.prefill(q, k, v, out, starts, lengths_)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
        else:
            torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_layer_ops_at_every_row_count(library, rows):
    """SwiGLU and RMSNorm over widths of 37 and 200 (no whole number of 16: 2 x 16 + 5, 12 x 16 + 8), rows of a wider
    tensor; the rotary and cache write bit for bit at heads of 40 (halves of 20) and 64."""
    _, _, ops = library
    generator = torch.Generator().manual_seed(rows)
    for width in (37, 200):
        gate_up = (torch.randn(rows, 2 * width + 3, generator=generator) * 4)[:, :2 * width]
        torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :width]) * gate_up[:, width:], rtol=1e-6,
                                   atol=0)
        x = (torch.randn(rows, width + 3, generator=generator) * 3)[:, 3:]
        weight = torch.randn(width, generator=generator)
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (width,), weight, 1e-5), rtol=2e-6,
                                   atol=1e-6)
    for heads, kv_heads, head_dim in ((3, 1, 40), (8, 4, 64)):
        config = dataclasses.replace(preset("small"), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
        rotary = Rotary(config)
        rotary.compute_tables(torch.device("cpu"), torch.float32)
        qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator)
        positions = torch.randint(0, config.max_position, (rows,), generator=generator)
        slots = torch.randperm(40, generator=generator)[:rows]
        caches = [torch.zeros(40, kv_heads, head_dim) for _ in range(2)]
        q, k, v = ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots, *caches)
        rotated = rotary(qkv[:, :heads + kv_heads], AttentionBatch(positions, slots))
        assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])
        assert torch.equal(caches[0][slots], rotated[:, heads:]) and torch.equal(caches[1][slots], v)

GEMM_SHAPES = [(48, 33), (80, 64), (208, 40)]
"""[out, in]: a last panel of 16 (48, 80, 208 = 13 x 16: AVX2's strips of 4 and 2 panels with one left over), an
input width no multiple of a vector (33, 40)."""


def gemm_case(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    x = torch.randn(37, in_features + 5, generator=generator)[:, 5:]  # rows of a wider tensor
    return weight, x, torch.randn(out_features, generator=generator), torch.randn(37, out_features,
                                                                                 generator=generator)


@pytest.mark.parametrize("out_features,in_features", GEMM_SHAPES)
def test_small_gemm_is_torchs_linear_at_every_row_count(library, out_features, in_features):
    """Rows 1 to 37: every register block of rows and strip of panels, with and without bias and residual."""
    _, _, ops = library
    weight, x, bias, residual = gemm_case(out_features, in_features)
    panels = ops.pack_panels(weight)
    full = x.double() @ weight.double().t()
    for rows in range(1, 38):
        for b, r in ((None, None), (bias, residual[:rows]), (None, residual[:rows])):
            got = ops.small_linear(x[:rows], panels, out_features, b, r)
            want = full[:rows] + (0 if b is None else b.double()) + (0 if r is None else r.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [258, 300, 32000])
def test_grammar_masks_refuse_what_the_packed_bitmask_refuses(library, vocab):
    """`CpuMasks.refuse` against torch's way (the bits unpacked, a `where`): -inf exactly where a row's bit is clear,
    every other logit untouched, rows mapped to bitmask rows in order, out of order, or not at all (-1); words whose
    bits are all set, none set and mixed, the last word's bits past the vocabulary ignored, bit 31 included."""
    import ctypes

    import numpy as np

    masks = kernels.CpuMasks(library[1].path)
    generator = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bitmask = generator.integers(-2**31, 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
    bitmask[0, : words // 2] = -1  # every token of those words allowed
    bitmask[1, 1:] = 0  # the first 32 tokens' bits at random, no other token allowed
    bitmask[2, -1] = -1  # the bits past the vocabulary set: nothing to write there
    allowed = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab,
                                             bitorder="little").view(np.bool_))
    for slots in (None, [4, 0, 2, 1, 3], [3, -1, 0, -1, 4, 1]):
        rows = 5 if slots is None else len(slots)
        logits = torch.randn(rows, vocab + 3, generator=torch.Generator().manual_seed(vocab))[:, :vocab]  # strided
        want = logits.clone()
        for row, slot in enumerate(range(rows) if slots is None else slots):
            if slot >= 0:
                want[row] = torch.where(allowed[slot], logits[row], float("-inf"))
        assert masks.takes(logits)
        masks.refuse(logits, bitmask.ctypes.data, words, None if slots is None else (ctypes.c_int64 * rows)(*slots))
        assert torch.equal(logits, want)
        assert bool(torch.isinf(want).any()) and bool(torch.isfinite(want).any())
    with pytest.raises(ValueError):  # wider than the bitmask: nothing read past its rows
        masks.refuse(torch.zeros(2, 32 * words + 1), bitmask.ctypes.data, words, None)
    assert not masks.takes(torch.zeros(2, vocab, dtype=torch.bfloat16))
    assert not masks.takes(torch.zeros(vocab, 2).t())


def test_small_gemm_gives_the_same_bits_in_every_build(builds):
    """Each output is one in-order fused multiply-add chain from zero in every build, so the vectors change no bit
    (a row alone or among others, on one thread or two): the 16-lane path too, emulated where the CPU lacks it
    (panels of 32, blocks of 12 rows), against AVX2's 8 lanes and the scalar loops."""
    outputs = {}
    threads = torch.get_num_threads()
    try:
        for name, path in builds.items():
            ops = kernels.CpuLayerOps(path)
            for count in (1, 2):
                torch.set_num_threads(count)
                for out_features, in_features in GEMM_SHAPES:
                    weight, x, bias, residual = gemm_case(out_features, in_features, seed=1)
                    panels = ops.pack_panels(weight)
                    for rows in (1, 2, 3, 5, 8, 13, 33, 37):
                        got = ops.small_linear(x[:rows], panels, out_features, bias, residual[:rows])
                        outputs.setdefault((out_features, rows), []).append((name, got))
                        alone = ops.small_linear(x[rows - 1:rows], panels, out_features, bias, residual[rows - 1:rows])
                        assert torch.equal(alone[0], got[-1]), (name, out_features, rows)
    finally:
        torch.set_num_threads(threads)
    for case, results in outputs.items():
        first_name, first = results[0]
        for name, got in results[1:]:
            assert torch.equal(got, first), (case, first_name, name)


def test_the_avx512_build_compiles_on_any_x86_64_machine(tmp_path):
    """Compile only (unoptimized: the intrinsics and their target checks, quickly); it runs where the CPU has it."""
    if not isas.X86:
        pytest.skip("not an x86-64 machine")
    cxx = kernels.compiler()
    assert cxx is not None
    errors = []
    for flags in kernels.flags("avx512"):
        result = subprocess.run([cxx, *flags, "-O0", "-o", str(tmp_path / "avx512.so"), *map(str, kernels.SOURCES)],
                                capture_output=True, text=True, timeout=120)
        if result.returncode == 0:
            break
        errors.append(result.stderr[-2000:])
    else:
        pytest.fail("\n".join(errors))
    symbols = subprocess.run(["nm", "-D", str(tmp_path / "avx512.so")], capture_output=True, text=True).stdout
    assert "kvc_small_gemm" in symbols and "kvc_prefill_attention" in symbols


def test_an_isa_this_cpu_cannot_run_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(isas, "cpu_flags", lambda: {"sse2", "avx", "avx2", "fma", "bmi2", "f16c", "movbe"})
    monkeypatch.setattr(isas, "X86", True)
    with pytest.raises(kernels.UnsupportedIsa, match="this CPU has no avx512f, .*KVC_CPU_ISA=avx512 cannot run here"):
        kernels.load("avx512")
    monkeypatch.setenv("KVC_CPU_ISA", "avx512")
    with pytest.raises(kernels.UnsupportedIsa, match="KVC_CPU_ISA=avx512"):
        kernels.load()
    assert kernels.runnable() == ["native", "avx2", "portable"]


def test_the_isa_is_chosen_by_name(monkeypatch):
    monkeypatch.delenv("KVC_CPU_ISA", raising=False)
    assert kernels.isa() == "native"
    monkeypatch.setenv("KVC_CPU_ISA", " AVX2 ")
    assert kernels.isa() == "avx2"
    monkeypatch.setenv("KVC_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="KVC_CPU_ISA='sse9'"):
        kernels.isa()
    with pytest.raises(ValueError, match="'avx3'"):
        kernels.build(isa="avx3")
    assert kernels.flags("avx2")[0][-1] == "-march=x86-64-v3" and kernels.flags("avx512")[0][-1] == "-march=x86-64-v4"
    assert all("-march=native" not in flags for name in ("portable", "avx2", "avx512")
               for flags in kernels.flags(name))


def test_the_emulated_build_is_for_tests_not_a_choice_of_users(monkeypatch, tmp_path):
    """`avx512-emulated` is built and loaded by name only: KVC_CPU_ISA, capped_env and runnable do not offer it, and
    its build says what it needs where SIMDe's headers are missing."""
    monkeypatch.setenv("KVC_CPU_ISA", kernels.EMULATED)
    with pytest.raises(ValueError, match="expected one of native, avx512, avx2, portable"):
        kernels.isa()
    with pytest.raises(ValueError, match="'avx512-emulated'"):
        kernels.capped_env(kernels.EMULATED)
    assert kernels.EMULATED not in kernels.runnable() and kernels.EMULATED not in isas.ISAS
    assert isas.checked(kernels.EMULATED, emulated=True) == kernels.EMULATED
    assert all("-DKVC_AVX512_EMULATED" in flags and "-march=x86-64-v4" not in flags
               for flags in kernels.flags(kernels.EMULATED))
    monkeypatch.setattr(isas, "cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.setattr(isas, "X86", True)
    with pytest.raises(kernels.UnsupportedIsa, match="this CPU has no avx2"):
        kernels.load(kernels.EMULATED)
    monkeypatch.setattr(kernels, "simde_version", lambda: None)
    with pytest.raises(RuntimeError, match="needs SIMDe's headers .*libsimde-dev"):
        kernels.build(tmp_path, kernels.EMULATED)

def test_capped_env_holds_torch_to_the_same_isa():
    assert kernels.capped_env("avx2") == {"KVC_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                          "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert kernels.capped_env("native") == {"KVC_CPU_ISA": "native"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, **kernels.capped_env("portable")}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "DEFAULT", result.stderr[-1000:]
