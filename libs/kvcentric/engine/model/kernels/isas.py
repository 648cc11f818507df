"""Which instruction set the CPU kernels are built for (`KVC_CPU_ISA`), the compiler flags of each, whether this
CPU can run it, and the environment that caps torch's own kernels to the same set for a like-for-like comparison.

`native` (the default) builds for the CPU the process runs on; `avx512`, `avx2` and `portable` build for a level
of x86-64 whatever the CPU, e.g. to measure how the kernels and torch do on a CPU without AVX-512 from one with it.
The kernels themselves (`simd.h`) have AVX-512 and AVX2 + FMA vector paths and a scalar one; the library says
which it was built with (`CpuAttention.isa`). This module builds and loads nothing (`kernels.build`, `load`).

`avx512-emulated` (`EMULATED`) is not a speed option and KVC_CPU_ISA does not take it: a build for tests that compiles
the AVX-512 source lines of the kernels, 16 lanes and their register tiles, with AVX2's flags over SIMDe's portable
`__m512` (`avx512_emulated.h`; SIMDe's headers: `apt-get install libsimde-dev`), so a CPU without AVX-512 runs that
path (slowly) and the tests check it there.

Torch picks its vector kernels once, when it is imported, so capping it takes the environment of a new process::

    env = {**os.environ, **kernels.capped_env("avx2")}
    subprocess.run([sys.executable, "-m", "bench.engine.bench_cpu_kernels"], env=env)

which sets KVC_CPU_ISA=avx2, ATEN_CPU_CAPABILITY=avx2 (ATen's elementwise and reduction kernels),
ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's GEMM and convolutions) and MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's GEMM, which
F.linear calls for fp32).
"""

from __future__ import annotations

import os
import platform
from typing import Literal

Isa = Literal["native", "avx512", "avx2", "portable", "avx512-emulated"]
ISAS: tuple[Isa, ...] = ("native", "avx512", "avx2", "portable")
"""What KVC_CPU_ISA takes."""
EMULATED: Isa = "avx512-emulated"
"""The AVX-512 path over SIMDe for tests on a CPU without AVX-512; `kernels.build` and `load` take it by name."""
ENV = "KVC_CPU_ISA"

COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
"""Every build's flags; an ISA's own are added to them."""
X86 = platform.machine().lower() in ("x86_64", "amd64")
EMULATION_FLAGS = ("-DKVC_AVX512_EMULATED", "-Wno-psabi")
"""simd.h's AVX-512 branch over SIMDe (-Wno-psabi: SIMDe's 64-byte vectors passed by value without AVX-512 are
GCC's note about an ABI no other object shares)."""
ISA_FLAGS: dict[Isa, tuple[tuple[str, ...], ...]] = {
    "native": (("-march=native",), ()),  # () where the compiler does not take -march=native
    "avx512": (("-march=x86-64-v4",), ("-march=skylake-avx512",)),  # the second for compilers before GCC 11
    "avx2": (("-march=x86-64-v3",), ("-march=haswell",)),
    "portable": (("-march=x86-64",),) if X86 else ((),),
    EMULATED: (("-march=x86-64-v3", *EMULATION_FLAGS), ("-march=haswell", *EMULATION_FLAGS)) if X86
    else (EMULATION_FLAGS,),
}
"""The ISA's flags, tried in order until one compiles."""

CPU_FLAGS: dict[Isa, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd", "avx2", "fma"),
    "avx2": ("avx2", "fma", "bmi2", "f16c", "movbe"),
    EMULATED: ("avx2", "fma", "bmi2", "f16c", "movbe"),  # built with AVX2's flags
}
"""What /proc/cpuinfo must list for code built for the ISA to run (x86-64-v4 and v3's features)."""

TORCH_CAPS: dict[Isa, dict[str, str]] = {
    "native": {},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
"""The environment that holds torch to the ISA (read when torch is imported; SSE4.1 is oneDNN's floor)."""


class UnsupportedIsa(RuntimeError):
    """The kernels were asked for an instruction set this CPU cannot run (running them would end in SIGILL)."""


def isa() -> Isa:
    """The instruction set in force: KVC_CPU_ISA, `native` when unset; ValueError naming the variable otherwise."""
    value = os.environ.get(ENV, "").strip().lower() or "native"
    if value not in ISAS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(ISAS)}")
    return value


def checked(name: str | None, emulated: bool = False) -> Isa:
    """`name` as an Isa (None: `isa()`); ValueError for another name, and for `EMULATED` unless `emulated`."""
    if name is None:
        return isa()
    if emulated and name == EMULATED:
        return EMULATED
    if name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}: expected one of {', '.join(ISAS)}")
    return name


def capped_env(name: str) -> dict[str, str]:
    """The environment variables for a new process whose kernels are built for `name` and whose torch is held to
    the same instruction set (nothing of torch's for `native`)."""
    return {ENV: checked(name), **TORCH_CAPS[checked(name)]}


def cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists for the first CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def check_cpu(name: Isa) -> None:
    """Raises UnsupportedIsa, saying what is missing, where this CPU cannot run code built for `name`."""
    if name in ("native", "portable") or (name == EMULATED and not X86):  # SIMDe needs nothing of another CPU
        return
    if not X86:
        raise UnsupportedIsa(f"this CPU is {platform.machine()}, not x86-64; {ENV}={name} cannot run here")
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo to go by: the library is loaded as asked
        return
    missing = [flag for flag in CPU_FLAGS[name] if flag not in flags]
    if missing:
        raise UnsupportedIsa(f"this CPU has no {', '.join(missing)}; {ENV}={name} cannot run here")


def runnable() -> list[Isa]:
    """The instruction sets this CPU can run, `native` first."""
    runs = []
    for name in ISAS:
        try:
            check_cpu(name)
        except UnsupportedIsa:
            continue
        runs.append(name)
    return runs
