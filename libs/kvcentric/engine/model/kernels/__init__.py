"""CPU kernels torch does not have, written in C++ (`attention.cpp`, `layer_ops.cpp`) and built on first use with
the machine's C++ compiler.

`CpuAttention.decode`: decode attention over the paged KV cache, read in place through each sequence's block
table. Torch has no such op on the CPU; the fallback gathers every key and value into a padded batch and runs
SDPA over the copy, reading every key and value twice and writing them once (docs/performance.md).

`CpuAttention.prefill`: causal attention of whole prompts over their own keys and values, flash style (key
tiles with an online softmax, grouped query heads sharing each key tile), every prompt of a step in one call
whatever its length, where torch's CPU flash SDPA needs a call per run of equal lengths (docs/performance.md).

`CpuLayerOps`: a layer's small fp32 ops in one pass each (`ops.LayerOps`): SwiGLU's silu(gate) x up, and the
rotary embedding of q and k with the KV cache write. RMSNorm stays torch's (a one-pass kernel measured no faster
in the engine).

`CpuLayerOps.small_linear`: the fp32 linear layers of a step of few rows (a decode step's) over weights packed
in panels (`gemm.cpp`), each panel streamed once with software prefetch; oneDNN's GEMM, laid out for many rows,
reads the weights of a few rows below the core's memory rate, which this one reaches (docs/performance.md,
"Decode's linear layers"). Its sums do not depend on the rows beside a row.

`CpuMasks.refuse`: structured output's grammar masks written into a decode batch's sampling logits (-inf where a
row's grammar refuses a token) straight from the packed bitmask llguidance fills, in one call
(`engine/cores/decode_sampling.py`).

The library is a plain shared object (no torch headers, so it builds in about half a second), compiled
with -fopenmp against the libgomp torch already loaded, so its parallel loops run on the calling thread's
torch team rather than a second one; it is called through ctypes, which releases the GIL for the call.
Its loops are written once over the vectors of `simd.h`: AVX-512, AVX2 + FMA, or scalar, whichever the build's
instruction set has (`KVC_CPU_ISA`: native, the default, or avx512, avx2, portable; `isas.py`, which also gives
the environment that holds torch to the same set for a comparison). The tests also build `avx512-emulated`
(`isas.EMULATED`): the AVX-512 lines over SIMDe's portable vectors, for a CPU without AVX-512 (`simde_version`).
Built once per source, compiler flags and CPU into a cache directory (`KVC_KERNEL_CACHE`, default
~/.cache/kvcentric/kernels), atomically, so concurrent engines share one build. An image without a compiler carries
builds made ahead of time (`prebuild`, into `KVC_KERNEL_PREBUILT`): where no compiler is found, `native` takes the
widest of them this CPU runs, and a named ISA its own. Where no compiler works (`CXX`, else c++/g++/clang++)
`load()` says why once and returns None, and the engine keeps the gather; where KVC_CPU_ISA names a set this CPU
cannot run, it raises.

It computes; it decides nothing about when a kernel is used (`ModelRunner`, `llama.Attention`).

Build ahead of time for every ISA (an image's build stage, which has the compiler its runtime stage lacks)::

    KVC_KERNEL_PREBUILT=/opt/kvcentric/kernels python -m kvcentric.engine.model.kernels --prebuild

and check the build this machine would use::

    python -m kvcentric.engine.model.kernels
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvcentric.engine.model.kernels.isas import COMMON_FLAGS, EMULATED, ISA_FLAGS, Isa, UnsupportedIsa, capped_env, \
    check_cpu, checked, isa, runnable

__all__ = ["EMULATED", "CpuAttention", "CpuLayerOps", "CpuMasks", "Isa", "UnsupportedIsa", "build", "cache_dir",
           "capped_env", "compiler", "cpu_signature", "flags", "isa", "load", "load_layer_ops", "prebuild",
           "prebuilt", "runnable", "simde_version"]

log = logging.getLogger("kvcentric.kernels")

SOURCES = (Path(__file__).with_name("attention.cpp"), Path(__file__).with_name("layer_ops.cpp"),
           Path(__file__).with_name("gemm.cpp"))
HEADERS = (Path(__file__).with_name("fast_exp.h"), Path(__file__).with_name("simd.h"),
           Path(__file__).with_name("avx512_emulated.h"))
"""Included by the sources: part of what a build is cached by, not compiled on their own."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
BUILD_TIMEOUT_S = 120.0

_loaded: dict[tuple[str, Isa], CpuAttention | None] = {}
_simde: dict[str, str | None] = {}


def cache_dir() -> Path:
    base = os.environ.get("KVC_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvcentric", "kernels")
    return Path(base)


def prebuilt_dir() -> Path | None:
    """Where builds made ahead of time lie (`KVC_KERNEL_PREBUILT`; None when unset)."""
    base = os.environ.get("KVC_KERNEL_PREBUILT", "")
    return Path(base) if base else None


def source_digest() -> str:
    """What a build made ahead of time must have been made from: the sources and headers of this version."""
    return hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))).hexdigest()[:16]


def prebuilt(name: Isa, directory: Path | None = None) -> Path | None:
    """The build made ahead of time (in `directory`, default `KVC_KERNEL_PREBUILT`) for `name`, of these sources;
    for `native`, the widest set this CPU runs. None where there is none."""
    directory = directory or prebuilt_dir()
    if directory is None:
        return None
    candidates: tuple[Isa, ...] = ("avx512", "avx2", "portable") if name == "native" else (name,)
    for candidate in candidates:
        path = directory / f"kernels-{candidate}-{source_digest()}.so"
        if path.exists() and candidate in runnable():
            return path
    return None


def prebuild(directory: Path, builds: Path | None = None) -> list[Path]:
    """Build the kernels for every ISA the compiler can target (not `native`: the image may run on another CPU)
    into `directory`, named so that `prebuilt` finds them; returns what was built. `builds`: the folder `build`
    compiles into (and reuses what it already holds there, as its cache); default a temporary one."""
    built = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("avx512", "avx2", "portable"):
            try:
                library = build(builds or Path(scratch), name)
            except RuntimeError as exc:
                log.warning("no prebuilt kernels for %s: %s", name, exc)
                continue
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / f"kernels-{name}-{source_digest()}.so"
            shutil.copyfile(library, target)
            built.append(target)
    return built


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def simde_version() -> str | None:
    """SIMDe's version where the C++ compiler finds its AVX-512 header (`simde/x86/avx512.h`: the system's, e.g.
    Debian's libsimde-dev, or a clone on CPATH), which the `avx512-emulated` build needs; None where it does not."""
    cxx = compiler()
    if cxx is None:
        return None
    if cxx not in _simde:
        probe = "#include <simde/x86/avx512.h>\nkvc_simde SIMDE_VERSION_MAJOR SIMDE_VERSION_MINOR SIMDE_VERSION_MICRO\n"
        try:
            result = subprocess.run([cxx, "-x", "c++", "-std=c++17", "-E", "-P", "-"], input=probe,
                                    capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            result = None
        lines = [] if result is None or result.returncode != 0 else \
            [line for line in result.stdout.splitlines() if line.startswith("kvc_simde ")]
        _simde[cxx] = ".".join(lines[-1].split()[1:]) if lines else None
    return _simde[cxx]


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared by two kinds of machine keeps
    one build per kind)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def flags(name: Isa) -> list[tuple[str, ...]]:
    """The compiler flags of a build for `name`, each set of them tried in turn until one compiles."""
    return [(*COMMON_FLAGS, *own) for own in ISA_FLAGS[name]]


def build(directory: Path | None = None, isa: str | None = None) -> Path:
    """The built library's path for instruction set `isa` (default: KVC_CPU_ISA's, `native` when unset), built now
    when this source, compiler, ISA (and for `native` the CPU) have none yet; raises RuntimeError saying why it
    cannot be built. It builds for any ISA whatever this CPU runs (`load` checks that)."""
    name = checked(isa, emulated=True)
    cxx = compiler()
    if cxx is None and name == EMULATED:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++) for the avx512-emulated build")
    if cxx is None:
        ahead = prebuilt(name)
        if ahead is not None:
            return ahead
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++), and no build made ahead of "
                           f"time for {name} in KVC_KERNEL_PREBUILT ({prebuilt_dir() or 'unset'})")
    directory = directory or cache_dir()
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    machine = cpu_signature() if name == "native" else platform.machine()
    if name == EMULATED:
        version = simde_version()
        if version is None:
            raise RuntimeError(f"the {EMULATED} build needs SIMDe's headers (simde/x86/avx512.h), which {cxx} does "
                               "not find: apt-get install libsimde-dev, or put a clone of SIMDe on CPATH")
        machine += f" simde {version}"  # a new SIMDe is a new build
    errors = []
    for flag_set in flags(name):
        key = hashlib.sha256(source + " ".join((cxx, *flag_set)).encode() + machine.encode()).hexdigest()[:16]
        target = directory / f"kernels-{name}-{key}.so"
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run([cxx, *flag_set, "-o", str(built), *map(str, SOURCES)], capture_output=True,
                                    text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode == 0:
                os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
                return target
            errors.append(f"{cxx} {' '.join(flag_set)}: {result.stderr.strip()[-500:]}")
    raise RuntimeError(f"the kernels did not compile for {name}:\n" + "\n".join(errors))


class CpuAttention:
    """The loaded library's attention kernels, callable on CPU tensors (`ops.AttentionKernels`)."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        self.path = path
        library.kvc_kernels_isa.restype = ctypes.c_char_p
        self.isa: str = library.kvc_kernels_isa().decode()
        """The vectors the library was built with: avx512, avx2 or portable (scalar loops), or avx512-emulated (the
        AVX-512 lines over SIMDe: `isas.EMULATED`)."""
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.decode_function = library.kvc_paged_decode_attention
        self.decode_function.argtypes = [ctypes.c_int, pointer, size, pointer, pointer, pointer, size, pointer,
                                         pointer, size, size, size, size, size, size, ctypes.c_float]
        self.decode_function.restype = ctypes.c_int
        self.prefill_function = library.kvc_prefill_attention
        self.prefill_function.argtypes = [ctypes.c_int, pointer, size, pointer, size, pointer, size, pointer, size,
                                          pointer, pointer, size, size, size, size, ctypes.c_float]
        self.prefill_function.restype = ctypes.c_int

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor, block_size: int, window: int | None = None) -> torch.Tensor | None:
        """[batch, heads, head_dim] attention output of one query row per sequence (q: [batch, heads, head_dim])
        over the first lengths[b] positions of its block table (the last `window` of them with a sliding
        window); None when these tensors are not ones it takes (the caller gathers instead)."""
        if not self.takes_decode(q, k_cache, v_cache, tables, lengths):
            return None
        batch, heads, head_dim = q.shape
        out = torch.empty((batch, heads, head_dim), dtype=q.dtype)
        status = self.decode_function(DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                               v_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lengths.data_ptr(),
                               out.data_ptr(), batch, heads, k_cache.shape[1], head_dim, block_size, window or 0,
                               1.0 / math.sqrt(head_dim))
        return out if status == 0 else None

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> bool:
        """Causal attention of whole prompts: rows starts[s] .. starts[s] + lengths[s] - 1 of q ([tokens, heads,
        head_dim]) over the same rows of k and v ([tokens, kv_heads, head_dim]), into those rows of `out`; False
        (nothing written) when these tensors are not ones it takes."""
        if not self.takes_prefill(q, k, v, out, starts, lengths):
            return False
        heads, head_dim = q.shape[1], q.shape[2]
        status = self.prefill_function(DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                       v.data_ptr(), v.stride(0), out.data_ptr(), out.stride(0), starts.data_ptr(),
                                       lengths.data_ptr(), starts.shape[0], heads, k.shape[1], head_dim,
                                       1.0 / math.sqrt(head_dim))
        return status == 0

    @staticmethod
    def takes_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                      lengths: torch.Tensor) -> bool:
        rows = (q, k, v, out)
        return (all(t.device.type == "cpu" and t.dim() == 3 and t.dtype == q.dtype and t.stride(2) == 1
                    and t.stride(1) == t.shape[2] and t.shape[0] == q.shape[0] and t.shape[2] == q.shape[2]
                    for t in rows)
                and q.dtype in DTYPE_CODES and out.shape[1] == q.shape[1] and k.shape[1] == v.shape[1]
                and q.shape[1] % k.shape[1] == 0 and starts.dtype == lengths.dtype == torch.int64
                and starts.is_contiguous() and lengths.is_contiguous() and starts.shape == lengths.shape
                and starts.device.type == lengths.device.type == "cpu" and bool(starts.numel())
                and int((starts + lengths).max()) <= q.shape[0] and int(starts.min()) >= 0)

    @staticmethod
    def takes_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lengths: torch.Tensor) -> bool:
        tensors = (q, k_cache, v_cache, tables, lengths)
        return (all(t.device.type == "cpu" for t in tensors) and q.dtype in DTYPE_CODES
                and k_cache.dtype == q.dtype == v_cache.dtype and q.dim() == 3 and k_cache.dim() == 3
                and q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.shape == v_cache.shape and k_cache.shape[2] == q.shape[2]
                and q.shape[1] % k_cache.shape[1] == 0 and tables.dtype == lengths.dtype == torch.int64
                and tables.is_contiguous() and lengths.is_contiguous() and tables.shape[0] == lengths.shape[0]
                == q.shape[0])


class CpuLayerOps:
    """The `ops.LayerOps` of an fp32 CPU model, from the same library: silu x up, rotary + cache write, and
    RMSNorm in one pass each (`layer_ops.cpp`)."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.silu_mul_function = library.kvc_silu_mul
        self.silu_mul_function.argtypes = [pointer, size, pointer, size, size]
        self.silu_mul_function.restype = None
        self.rotate_store_function = library.kvc_rotate_store
        self.rotate_store_function.argtypes = [pointer, size, pointer, pointer, size, pointer, pointer, pointer,
                                               pointer, pointer, size, size, size, size, size, size]
        self.rotate_store_function.restype = ctypes.c_int
        self.rms_norm_function = library.kvc_rms_norm
        self.rms_norm_function.argtypes = [pointer, size, pointer, pointer, size, size, ctypes.c_float]
        self.rms_norm_function.restype = None
        self.pack_panels_function = library.kvc_pack_panels
        self.pack_panels_function.argtypes = [pointer, size, size, pointer]
        self.pack_panels_function.restype = ctypes.c_int
        self.small_gemm_function = library.kvc_small_gemm
        self.small_gemm_function.argtypes = [pointer, size, pointer, pointer, pointer, size, pointer, size, size, size,
                                             size]
        self.small_gemm_function.restype = None

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A [out, in] fp32 CPU weight laid out for `small_linear`, or None where it does not take it (out not a
        multiple of 16, another dtype or device)."""
        if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or weight.shape[0] % 16 != 0 or weight.shape[1] == 0):
            return None
        weight = weight.detach().contiguous()
        panels = torch.empty(weight.numel(), dtype=torch.float32)
        if self.pack_panels_function(weight.data_ptr(), weight.shape[0], weight.shape[1], panels.data_ptr()) != 0:
            return None
        return panels

    def small_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """x @ weightᵀ (+ bias) (+ residual) over the `pack_panels` of weight, [rows, out_features]; None where these
        tensors are not ones it takes (the caller runs its GEMM)."""
        rows, width = x.shape[0], panels.numel() // out_features
        if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1
                or x.shape[1] != width or rows == 0):
            return None
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                 or bias.shape != (out_features,)):
            return None
        if residual is not None and (residual.dtype != torch.float32 or residual.stride(1) != 1
                                     or residual.shape != (rows, out_features)):
            return None
        out = torch.empty((rows, out_features), dtype=torch.float32)
        self.small_gemm_function(x.data_ptr(), x.stride(0), panels.data_ptr(),
                                 None if bias is None else bias.data_ptr(),
                                 None if residual is None else residual.data_ptr(),
                                 0 if residual is None else residual.stride(0), out.data_ptr(), out_features, rows,
                                 out_features, width)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of [rows, width] rows (torch's for any other shape or type)."""
        if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1
                or weight.dtype != torch.float32 or not weight.is_contiguous() or weight.shape != (x.shape[1],)):
            return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.rms_norm_function(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                               eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [rows, 2 width] gate|up projection, as [rows, width]."""
        if gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.stride(1) != 1:
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate).mul_(up)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype)
        self.silu_mul_function(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width)
        return out

    def rotate_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k of a [tokens, heads + 2 kv_heads, head_dim] q|k|v projection rotated by their `positions` (the
        half-split rotary over the first halves of the [max_position, head_dim] tables), the rotated keys and the
        values written to cache `slots`; returns q, k, v (as the GPU's `fused.rotate_store`)."""
        tokens, head_dim = qkv.shape[0], qkv.shape[2]
        out = torch.empty((tokens, heads + kv_heads, head_dim), dtype=qkv.dtype)
        positions, slots = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        cos, sin = cos.to(qkv.dtype).contiguous(), sin.to(qkv.dtype).contiguous()
        status = self.rotate_store_function(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                                            cos.stride(0), positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                                            v_cache.data_ptr(), out.data_ptr(), tokens, heads, kv_heads, head_dim,
                                            min(cos.shape[0], sin.shape[0]), min(k_cache.shape[0], v_cache.shape[0]))
        if status != 0:  # checked in the kernel, before anything is written, as torch's ops would raise
            raise IndexError("a position past the rotary tables or a slot past the KV cache")
        return out[:, :heads], out[:, heads:], qkv[:, heads + kv_heads:]

    @staticmethod
    def fits(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """What `rotate_store` takes: fp32 on the CPU, contiguous heads of contiguous dims, the caches and the
        tables alike, int64 positions and slots (checked by the caller's types)."""
        return (qkv.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and qkv.device.type == "cpu"
                and qkv.stride(2) == 1 and qkv.stride(1) == qkv.shape[2] and k_cache.is_contiguous()
                and v_cache.is_contiguous() and qkv.shape[2] % 2 == 0 and k_cache.device.type == "cpu")


class CpuMasks:
    """Sampling's grammar masks applied to a block of fp32 CPU logits in place, read from llguidance's packed
    bitmask (`layer_ops.cpp`'s `kvc_refuse_masked`): one call where torch took four (unpack, wrap, select, where)."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.refuse_function = library.kvc_refuse_masked
        self.refuse_function.argtypes = [pointer, size, pointer, size, pointer, size, size]
        self.refuse_function.restype = None

    @staticmethod
    def takes(logits: torch.Tensor) -> bool:
        """What `refuse` writes into: fp32 rows on the CPU, each contiguous."""
        return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
                and logits.stride(1) == 1)

    def refuse(self, logits: torch.Tensor, words: int, words_per_row: int,
               slots: ctypes.Array[ctypes.c_int64] | None) -> None:
        """logits[r, t] = -inf where bit t of bitmask row `slots[r]` (at address `words`, `words_per_row` 32-bit words
        a row; a slot of -1 leaves its row alone; None: row r is bitmask row r) is clear; `takes(logits)` holds.
        A row of logits wider than its bitmask row is refused (ValueError), as torch's `where` would refuse it."""
        if logits.shape[1] > 32 * words_per_row:
            raise ValueError(f"{logits.shape[1]} logits a row against a bitmask of {32 * words_per_row} tokens")
        self.refuse_function(logits.data_ptr(), logits.stride(0), words, words_per_row, slots, logits.shape[0],
                             logits.shape[1])


def load(isa: str | None = None) -> CpuAttention | None:
    """The kernels of this process for instruction set `isa` (default: KVC_CPU_ISA's; built on first use), or None
    when they cannot be built here (logged once); UnsupportedIsa where this CPU cannot run that set."""
    name = checked(isa, emulated=True)
    check_cpu(name)
    key = (str(cache_dir()), name)
    if key not in _loaded:
        try:
            kernels = CpuAttention(build(isa=name))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            log.warning("CPU attention kernels unavailable, attention runs through torch's SDPA (decode over a "
                        "gathered copy of the KV): %s", exc)
            _loaded[key] = None
        else:
            log.info("CPU kernels built for %s (KVC_CPU_ISA=%s): %s", kernels.isa, name, kernels.path)
            _loaded[key] = kernels
    return _loaded[key]


def load_layer_ops(isa: str | None = None) -> CpuLayerOps | None:
    """The fused layer ops of the same library (None where it cannot be built: `load` has said why)."""
    kernels = load(isa)
    return None if kernels is None else CpuLayerOps(kernels.path)


def main(argv: list[str] | None = None) -> None:
    """Build the kernels (or say why not), check one call of each against torch's op, then time them against torch's
    ops at a model's shapes and print where each runs (`choice.py`)."""
    import argparse

    import torch.nn.functional as F

    parser = argparse.ArgumentParser(prog="python -m kvcentric.engine.model.kernels", description=main.__doc__)
    parser.add_argument("--model", default="small", help="preset or checkpoint directory whose shapes are timed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="most seconds spent timing cases not cached")
    parser.add_argument("--retime", action="store_true", help="time every case again, cached or not")
    parser.add_argument("--prebuild", action="store_true",
                        help="only build for every ISA into KVC_KERNEL_PREBUILT (an image's build stage)")
    args = parser.parse_args(argv)
    if args.prebuild:
        into = prebuilt_dir()
        if into is None:
            raise SystemExit("--prebuild: set KVC_KERNEL_PREBUILT to the folder to build into")
        built = prebuild(into)
        if not built:
            raise SystemExit("--prebuild: the kernels compiled for no instruction set")
        print("\n".join(str(path) for path in built))
        return
    try:
        kernel = CpuAttention(build())
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"the CPU attention kernels cannot be built here (engines will use torch's SDPA): {exc}") \
            from None
    generator = torch.Generator().manual_seed(0)
    block_size, blocks, kv_heads, heads, head_dim = 16, 64, 2, 4, 32
    k_cache, v_cache = (torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator) for _ in range(2))
    tables = torch.randperm(blocks, generator=generator)[:12].view(3, 4)
    lengths = torch.tensor([64, 33, 1])
    q = torch.randn(3, heads, head_dim, generator=generator)
    out = kernel.decode(q, k_cache, v_cache, tables, lengths, block_size)
    assert out is not None
    keys, values = (c.view(blocks, block_size, kv_heads, head_dim)[tables].flatten(1, 2).transpose(1, 2)
                    for c in (k_cache, v_cache))
    mask = (torch.arange(4 * block_size)[None] < lengths[:, None])[:, None, None]
    expected = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)[:, :, 0]
    error = float((out - expected).abs().max())
    print(f"{kernel.path}: decode, max |kernel - gather + SDPA| = {error:.1e}")
    rows = torch.randn(40, heads + 2 * kv_heads, head_dim, generator=generator)
    q, k, v = rows[:, :heads], rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:]
    out = torch.empty(40, heads, head_dim)
    assert kernel.prefill(q, k, v, out, torch.tensor([0, 25]), torch.tensor([25, 15]))
    expected = torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                         v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True)
                          .transpose(0, 1) for a, b in ((0, 25), (25, 40))])
    prefill_error = float((out - expected).abs().max())
    print(f"{kernel.path}: prefill, max |kernel - SDPA| = {prefill_error:.1e}")
    gate_up = torch.randn(40, 2 * 96, generator=generator)
    swiglu = CpuLayerOps(kernel.path).silu_mul(gate_up)
    ops_error = float((swiglu - F.silu(gate_up[:, :96]) * gate_up[:, 96:]).abs().max())
    print(f"{kernel.path}: SwiGLU, max |kernel - torch| = {ops_error:.1e}")
    hidden, weight = torch.randn(40, 96, generator=generator), torch.randn(96, generator=generator)
    norm = CpuLayerOps(kernel.path).rms_norm(hidden, weight, 1e-5)
    norm_error = float((norm - F.rms_norm(hidden, weight.shape, weight, 1e-5)).abs().max())
    print(f"{kernel.path}: RMSNorm, max |kernel - torch| = {norm_error:.1e}")
    vocab = 300
    bitmask = torch.randint(-2**31, 2**31, (3, (vocab + 31) // 32), dtype=torch.int64, generator=generator).int()
    logits = torch.randn(3, vocab, generator=generator)
    masked = logits.clone()
    CpuMasks(kernel.path).refuse(masked, bitmask.data_ptr(), bitmask.shape[1], None)
    bits = (bitmask.view(torch.uint8).view(3, -1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1  # (little-endian)
    allowed = bits.flatten(1)[:, :vocab].bool()
    masks_agree = torch.equal(masked, torch.where(allowed, logits, float("-inf")))
    print(f"{kernel.path}: grammar masks, the same logits as torch's where: {masks_agree}")
    if max(error, prefill_error, ops_error, norm_error) > 1e-4 or not masks_agree:
        raise SystemExit("the kernels disagree with torch's ops")
    from kvcentric.engine.model.kernels import choice
    from kvcentric.model.config import load_model_config

    if args.threads:
        torch.set_num_threads(args.threads)
    target = choice.Target(load_model_config(args.model), getattr(torch, args.dtype), args.block_size)
    ops = CpuLayerOps(kernel.path) if target.dtype == torch.float32 else None
    chosen = choice.choose(target, kernel, ops, cache_dir(), cpu_signature(), args.budget_s, args.retime)
    print(f"\n{args.model}, {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}:")
    print(chosen.table())
    print(chosen.summary())


if __name__ == "__main__":
    main()
