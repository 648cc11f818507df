"""Execution-time model of one serving instance: prefill and decode-step seconds from token counts,
fitted to profile samples or derived from a roofline of model shape × hardware; it predicts, it runs nothing.

Mooncake §6.1 estimates prefill time "based on the request's length and prefix cache hit length" with a
model derived from offline data; §2 notes prefill grows superlinearly with input (quadratic attention)
and a decode step sublinearly with batch size. The forms used here:

    T_prefill(n_new, n_cached) = p0 + p1*n_new + p2*n_new*n_cached + p3*n_new**2          [seconds]
    T_decode_step(batch, kv_tokens) = d0 + d1*batch + d2*kv_tokens                           [seconds]

`n_new` tokens are computed on top of `n_cached` tokens whose KV is reused. p1 is the per-token cost
of the linear layers (MLP, projections), p2 the attention of each new token over the cached prefix
(so the time is linear in the cached prefix for a fixed n_new), p3 the causal attention among the new
tokens (n_new**2/2 query-key pairs, so p3 = p2/2 in a roofline), p0 the fixed cost of one forward pass.
In a decode step every sequence of the batch adds one token: d1 is the per-sequence compute, d2 the
cost of reading the KV of `kv_tokens` context tokens (the whole batch's), d0 reading the weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from kvcentric.model.config import ModelConfig, load_model_config


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One serving instance's hardware: peak numbers, and the fraction of them that serving reaches."""

    name: str
    devices: int
    """Accelerators per instance (tensor parallel)."""
    flops: float
    """Peak dense FLOP/s of one device at the serving dtype."""
    mem_bw: float
    """Memory bandwidth of one device, bytes/s."""
    mem_bytes: float
    """Memory of one device, bytes (weights plus KV cache must fit)."""
    host_bytes: float
    """Host DRAM an instance lends to the prefix-cache pool, bytes."""
    dtype_bytes: int = 2
    mfu: float = 0.5
    """Fraction of peak FLOP/s reached by prefill and decode compute."""
    mbu: float = 0.7
    """Fraction of peak memory bandwidth reached by a decode step."""
    overhead_s: float = 0.0
    """Fixed seconds per forward pass (kernel launches, tensor-parallel all-reduce latency)."""


HARDWARE: dict[str, HardwareSpec] = {
    # Mooncake §8: 8 A800-SXM4-80GB per node (312 TFLOP/s bf16, ~2 TB/s HBM each), 800 Gbps RDMA (the
    # link is the scheduler's --link-gbps). mfu/mbu are typical of tensor-parallel serving, not measured;
    # overhead: 2 all-reduces per layer of LLaMA2-70B (160) at ~20 µs. Host DRAM lent to the cache pool:
    # 1 TB per node (an assumption).
    "8xA800-800gbps": HardwareSpec("8xA800-800gbps", devices=8, flops=312e12, mem_bw=2.0e12, mem_bytes=80e9,
                                   host_bytes=1e12, dtype_bytes=2, mfu=0.5, mbu=0.7, overhead_s=0.003),
    # A 2-core x86 VM: ~300 GFLOP/s nominal fp32 matmul on 2 threads, ~10 GB/s memory; mfu 0.3 because a
    # served step reaches a fraction of the nominal rate (the measured rates: docs/performance.md).
    "cpu-2core": HardwareSpec("cpu-2core", devices=1, flops=300e9, mem_bw=10e9, mem_bytes=16e9, host_bytes=4e9,
                              dtype_bytes=4, mfu=0.3, mbu=0.8, overhead_s=0.0),
}


def hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE)}") from None


@dataclasses.dataclass(frozen=True)
class CostModel:
    prefill: tuple[float, float, float, float]
    """(p0, p1, p2, p3) of T_prefill = p0 + p1*n_new + p2*n_new*n_cached + p3*n_new**2 seconds."""
    decode: tuple[float, float, float]
    """(d0, d1, d2) of T_decode_step = d0 + d1*batch + d2*kv_tokens seconds."""
    kv_bytes_per_token: int
    """KV bytes of one token over all layers (what a transfer moves per cached token)."""
    source: str = ""
    """Where the coefficients came from (a profile file, or roofline:<model>@<hardware>)."""
    kv_bytes_fixed: int = 0
    """KV bytes of a request whatever its length: the fixed-size state of a hybrid model's linear-attention
    layers (PrfaaS Table 5: 190.8 MiB at 1K tokens, 2316 MiB at 128K, i.e. about 174 MiB + 17 KB/token)."""
    prefill_chunk: int = 0
    """Tokens the instance computes per prefill step (chunked prefill), when the coefficients were fitted to
    chunks: a longer prompt then costs the sum of its chunks (p0 once per chunk). 0: one pass per prompt."""

    def t_prefill(self, n_new: int, n_cached: int = 0) -> float:
        p0, p1, p2, p3 = self.prefill
        chunk = self.prefill_chunk
        if chunk <= 0 or n_new <= chunk:
            return p0 + n_new * (p1 + p2 * n_cached + p3 * n_new)
        return self._chunked(n_new, n_cached, chunk)

    def _chunked(self, n_new: int, n_cached: int, chunk: int) -> float:
        """Sum over the chunks of n_new: k-1 full ones and a last of `rest`, each attending over the cached
        prefix and the chunks before it."""
        p0, p1, p2, p3 = self.prefill
        k = -(-n_new // chunk)
        rest = n_new - (k - 1) * chunk
        squares = (k - 1) * chunk * chunk + rest * rest
        earlier = chunk * chunk * (k - 1) * (k - 2) / 2 + rest * (k - 1) * chunk
        return k * p0 + p1 * n_new + p2 * (n_new * n_cached + earlier) + p3 * squares

    def t_decode(self, batch: float, kv_tokens: float) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * kv_tokens

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token + (self.kv_bytes_fixed if tokens > 0 else 0)

    # ---------------------------------------------------------------- persistence

    def to_dict(self) -> dict:
        fixed = {"kv_bytes_fixed": self.kv_bytes_fixed} if self.kv_bytes_fixed else {}
        fixed |= {"prefill_chunk": self.prefill_chunk} if self.prefill_chunk else {}
        return {"prefill": list(self.prefill), "decode": list(self.decode),
                "kv_bytes_per_token": self.kv_bytes_per_token, "source": self.source, **fixed}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """From `to_dict()` output, or a dict whose "cost_model" key holds it (a whole profile.json)."""
        data = data.get("cost_model", data)
        try:
            prefill = tuple(float(x) for x in data["prefill"])
            decode = tuple(float(x) for x in data["decode"])
            per_token, source = int(data["kv_bytes_per_token"]), str(data.get("source", ""))
            fixed = int(data.get("kv_bytes_fixed", 0))
            chunk = int(data.get("prefill_chunk", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a cost model: {exc!r}") from None
        if len(prefill) != 4 or len(decode) != 3:
            raise ValueError("a cost model has 4 prefill and 3 decode coefficients")
        p0, p1, p2, p3 = prefill
        d0, d1, d2 = decode
        return cls((p0, p1, p2, p3), (d0, d1, d2), per_token, source, fixed, chunk)

    def save(self, path: str | Path, **extra) -> None:
        """Write {"cost_model": {...}, **extra} as JSON (extra: samples, fit errors, hardware...)."""
        Path(path).write_text(json.dumps({"cost_model": self.to_dict(), **extra}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

    # ---------------------------------------------------------------- construction

    @classmethod
    def fit(cls, prefill_samples: list[tuple[int, int, float]], decode_samples: list[tuple[int, int, float]],
            kv_bytes_per_token: int) -> tuple[CostModel, dict]:
        """Least-squares fit with non-negative coefficients, minimising relative error.

        prefill_samples: (n_new, n_cached, seconds); decode_samples: (batch, kv_tokens, seconds). Each row is
        weighted by 1/seconds so short and long runs count alike. Returns the model and, per part, the
        mean and max relative error |predicted - measured| / measured over the samples.
        """
        if len(prefill_samples) < 4 or len(decode_samples) < 3:
            raise ValueError("need at least 4 prefill and 3 decode samples")
        p = np.asarray(prefill_samples, dtype=float)
        d = np.asarray(decode_samples, dtype=float)
        n, c = p[:, 0], p[:, 1]
        prefill_x = np.column_stack([np.ones_like(n), n, n * c, n * n])
        decode_x = np.column_stack([np.ones_like(d[:, 0]), d[:, 0], d[:, 1]])
        prefill = _relative_nnls(prefill_x, p[:, 2])
        decode = _relative_nnls(decode_x, d[:, 2])
        model = cls(tuple(prefill), tuple(decode), int(kv_bytes_per_token), "fit")
        report = {"prefill": _errors(prefill_x @ prefill, p[:, 2]), "decode": _errors(decode_x @ decode, d[:, 2]),
                  "samples": {"prefill": len(p), "decode": len(d)}}
        return model, report

    @classmethod
    def roofline(cls, model: ModelConfig, hardware: HardwareSpec) -> CostModel:
        """Coefficients from FLOPs and bytes (see the module docstring for the forms).

        F = devices*flops*mfu, M = devices*mem_bw*mbu, W = num_params*dtype_bytes, A = 4*L*H*head_dim
        (FLOPs of one query-key pair over all layers: QK^T and PV, 2 FLOPs per multiply-add):
        p0 = d0 = W/M + overhead (one pass reads the weights once), p1 = d1 = 2*num_params/F,
        p2 = A/F, p3 = A/(2F) (causal), d2 = kv_bytes_per_token/M. Compute and memory time are added,
        not overlapped: this overstates short prompts by at most W/M.
        """
        flops = hardware.devices * hardware.flops * hardware.mfu
        bandwidth = hardware.devices * hardware.mem_bw * hardware.mbu
        weights = model.num_params * hardware.dtype_bytes
        pair = 4 * model.num_layers * model.num_heads * model.head_dim
        kv_per_token = model.kv_bytes_per_token(hardware.dtype_bytes)
        fixed = weights / bandwidth + hardware.overhead_s
        per_token = 2 * model.num_params / flops
        return cls((fixed, per_token, pair / flops, pair / (2 * flops)),
                   (fixed, per_token, kv_per_token / bandwidth), kv_per_token,
                   f"roofline:{model.name}@{hardware.name}")


def load_cost_model(profile: str, model: str, hardware_name: str) -> CostModel:
    """The cost model a service or the simulator predicts with: the `kvcentric profile` JSON at `profile`
    when one is given, else the roofline of `model` (a preset or checkpoint directory) on the
    `hardware_name` preset. Every --profile / --model / --hardware flag set resolves here."""
    if profile:
        return CostModel.load(profile)
    return CostModel.roofline(load_model_config(model), hardware(hardware_name))


@dataclasses.dataclass(frozen=True)
class TBTVerdict:
    """A decode instance's double-check of its TBT SLO before a request joins the batch (Mooncake §3
    step 4): the predicted step time with the request in the batch, against the SLO."""

    accepted: bool
    predicted_s: float
    slo_s: float

    @property
    def reason(self) -> str:
        return (f"rejected by decode for TBT: predicted step time {self.predicted_s:.3g} s with this request "
                f"in the batch exceeds the TBT SLO of {self.slo_s:.3g} s")


def decode_tbt_check(cost: CostModel, batch: int, kv_tokens: int, new_tokens: int, slo_s: float) -> TBTVerdict:
    """Whether a decode step keeps within `slo_s` when one sequence of `new_tokens` context tokens joins the
    `batch` sequences that hold `kv_tokens` context tokens; `slo_s` 0 turns the check off (always accepted).
    It predicts with the cost model; it does not reject anything itself."""
    predicted = cost.t_decode(batch + 1, kv_tokens + new_tokens)
    return TBTVerdict(slo_s <= 0 or predicted <= slo_s, predicted, slo_s)


def decode_capacity_tokens(model: ModelConfig, hardware: HardwareSpec, usable: float = 0.9) -> int:
    """KV tokens that fit in an instance's device memory after the weights (`usable` of it for KV)."""
    free = hardware.devices * hardware.mem_bytes * usable - model.num_params * hardware.dtype_bytes
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {hardware.name}")
    return int(free // model.kv_bytes_per_token(hardware.dtype_bytes))


def host_cache_blocks(model: ModelConfig, hardware: HardwareSpec, block_tokens: int) -> int:
    """Prefix-cache blocks of `block_tokens` tokens that an instance's lent host DRAM holds."""
    return int(hardware.host_bytes // (block_tokens * model.kv_bytes_per_token(hardware.dtype_bytes)))


def _relative_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||(x b - y)/y|| subject to b >= 0, with columns scaled to unit norm for conditioning."""
    if np.any(y <= 0):
        raise ValueError("sample times must be positive")
    weighted = x / y[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(weighted / scale, np.ones_like(y))
    return coef / scale


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: argmin ||a x - b|| with x >= 0.

    Exact by enumeration: the optimum is the unconstrained fit on its support, so the best of the
    fits on every subset of columns whose coefficients are all non-negative is the answer.
    """
    n = a.shape[1]
    if n > 10:
        raise ValueError("nnls enumerates column subsets; use it for at most 10 columns")
    best, best_residual = np.zeros(n), float(np.sum(b * b))
    for mask in range(1, 1 << n):
        columns = [i for i in range(n) if mask >> i & 1]
        coef = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
        if (coef < 0).any():
            continue
        residual = float(np.sum((a[:, columns] @ coef - b) ** 2))
        if residual < best_residual:
            best = np.zeros(n)
            best[columns] = coef
            best_residual = residual
    return best


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    relative = np.abs(predicted - measured) / measured
    return {"mean_rel_error": float(relative.mean()), "max_rel_error": float(relative.max())}
