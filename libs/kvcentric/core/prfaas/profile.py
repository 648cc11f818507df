"""The profile `kvcentric plan --profile P.json` reads: per-hardware prefill latency and KV size by length,
interpolated, the decode rate and the PrfaaS egress bandwidth; it measures nothing and plans nothing.

These are the measured inputs of the throughput model (PrfaaS §3.4.1, Table 4; the paper's Table 5 is
one such profile). The JSON file is one object:

    {
      "prfaas":     {"name": "8xH200", "lengths": [1024, 8192, 32768, 131072],
                     "prefill_s": [0.44, 0.72, 1.84, 7.40], "kv_mib": [190.8, 308.9, 701.3, 2316.3]},
      "pd_prefill": {"name": "8xH20", "lengths": [...], "prefill_s": [...]},
      "decode":     {"name": "8xH20", "max_batch": 20, "step_s": 0.025},
      "egress_gbps": 100
    }

- `prfaas`: one instance of the PrfaaS cluster. `lengths` (tokens, strictly increasing), `prefill_s`
  (seconds to prefill that many uncached tokens, T_prefill(l)) and the KV that prefill produces, S_kv(l),
  as `kv_mib` (MiB = 2**20 bytes) or `kv_bytes`. Required: equation (3) divides B_out by S_kv.
- `pd_prefill`: one prefill instance of the local PD cluster (PD-P), same fields; KV optional (unused:
  PD-P ships KV over RDMA, which §3.4.1 assumes is never the bottleneck).
- `decode`: one PD-D instance, either `max_batch` (BS_max) and `step_s` (T_decode, seconds per decode
  step at that batch, i.e. 1/SLO tokens per second) or `tokens_per_s` (= BS_max / T_decode, the
  instance's output tokens per second). Equation (5) is N_d * tokens_per_s / L_out.
- `egress_gbps`: B_out, the PrfaaS cluster's total cross-datacenter egress in Gbit/s (1e9 bits/s).

Between measured lengths both curves are linear in l (the profiles of hybrid models are close to
linear: Table 5's latency rises 0.39 -> 0.57 µs per token from 1K to 128K). Beyond the last point the
last segment is extended; below the first, the first segment is extended but never below the line
through the origin, so a value stays positive. Values may not decrease with length.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kvcentric.core.prfaas.inputs import Fields, InputError, load_document

MIB = 2 ** 20
BYTES_PER_S_PER_GBPS = 1e9 / 8


@dataclasses.dataclass(frozen=True)
class Curve:
    """y(l), piecewise linear through measured (length, value) points, extended as the module says."""

    lengths: tuple[float, ...]
    values: tuple[float, ...]

    def __call__(self, length):
        lengths = np.asarray(length, dtype=float)
        x, y = np.asarray(self.lengths), np.asarray(self.values)
        inside = np.interp(lengths, x, y)
        high = y[-1] + (lengths - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        low = np.maximum(y[0] + (lengths - x[0]) * (y[1] - y[0]) / (x[1] - x[0]), y[0] * lengths / x[0])
        out = np.where(lengths > x[-1], high, np.where(lengths < x[0], low, inside))
        return float(out) if out.ndim == 0 else out

    def covers(self, length: float) -> bool:
        return self.lengths[0] <= length <= self.lengths[-1]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One instance of a prefill role: T_prefill(l) in seconds and, where known, S_kv(l) in bytes."""

    name: str
    prefill: Curve
    kv: Curve | None = None

    def t_prefill(self, length):
        return self.prefill(length)

    def kv_bytes(self, length):
        if self.kv is None:
            raise ValueError(f"profile {self.name!r} has no KV sizes")
        return self.kv(length)


@dataclasses.dataclass(frozen=True)
class DecodeProfile:
    """One PD-D instance: BS_max / T_decode output tokens per second under the TBT SLO (equation 5)."""

    name: str
    tokens_per_s: float
    max_batch: int | None = None
    step_s: float | None = None

    def throughput(self, output_length: float) -> float:
        """Requests per second of one instance: BS_max / (T_decode * L_out)."""
        return self.tokens_per_s / output_length


@dataclasses.dataclass(frozen=True)
class PrfaasProfile:
    prfaas: HardwareProfile
    pd_prefill: HardwareProfile
    decode: DecodeProfile
    egress_gbps: float
    """B_out of the PrfaaS cluster, Gbit/s."""

    @property
    def egress_bytes_per_s(self) -> float:
        return self.egress_gbps * BYTES_PER_S_PER_GBPS

    def with_egress(self, gbps: float) -> PrfaasProfile:
        if gbps <= 0:
            raise ValueError(f"egress bandwidth must be > 0 Gbps, got {gbps}")
        return dataclasses.replace(self, egress_gbps=gbps)

    @classmethod
    def from_dict(cls, data: dict) -> PrfaasProfile:
        top = Fields(data, "profile")
        top.reject_unknown(("prfaas", "pd_prefill", "decode", "egress_gbps", "notes"))
        return cls(_hardware(top.child("prfaas"), kv_required=True),
                   _hardware(top.child("pd_prefill"), kv_required=False),
                   _decode(top.child("decode")), top.number("egress_gbps", positive=True))

    @classmethod
    def load(cls, path: str | Path) -> PrfaasProfile:
        return cls.from_dict(load_document(path, "profile"))

    def to_dict(self) -> dict:
        def hardware(h: HardwareProfile) -> dict:
            out = {"name": h.name, "lengths": list(h.prefill.lengths), "prefill_s": list(h.prefill.values)}
            if h.kv is not None:
                out["kv_bytes"] = list(h.kv.values)
            return out
        decode = {"name": self.decode.name, "tokens_per_s": self.decode.tokens_per_s}
        if self.decode.max_batch is not None:
            decode = {"name": self.decode.name, "max_batch": self.decode.max_batch, "step_s": self.decode.step_s}
        return {"prfaas": hardware(self.prfaas), "pd_prefill": hardware(self.pd_prefill), "decode": decode,
                "egress_gbps": self.egress_gbps}


def _hardware(fields: Fields, kv_required: bool) -> HardwareProfile:
    fields.reject_unknown(("name", "lengths", "prefill_s", "kv_mib", "kv_bytes", "notes"))
    name = fields.text("name", default=fields.path)
    lengths = fields.numbers("lengths", min_items=2)
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise fields.fail("lengths", f"must be strictly increasing, got {lengths}")
    prefill = _curve(fields, "prefill_s", lengths, scale=1.0)
    if fields.has("kv_mib") and fields.has("kv_bytes"):
        raise fields.fail("kv_mib", "give kv_mib or kv_bytes, not both")
    kv = None
    if fields.has("kv_mib") or fields.has("kv_bytes"):
        key = "kv_mib" if fields.has("kv_mib") else "kv_bytes"
        kv = _curve(fields, key, lengths, scale=MIB if key == "kv_mib" else 1.0)
    elif kv_required:
        raise fields.fail("kv_mib", "missing (or kv_bytes): the KV size S_kv(l) at each length")
    return HardwareProfile(name, prefill, kv)


def _curve(fields: Fields, key: str, lengths: list[float], scale: float) -> Curve:
    values = fields.numbers(key)
    if len(values) != len(lengths):
        raise fields.fail(key, f"has {len(values)} values for {len(lengths)} lengths")
    if any(b < a for a, b in zip(values, values[1:])):
        raise fields.fail(key, f"may not decrease with length, got {values}")
    return Curve(tuple(lengths), tuple(v * scale for v in values))


def _decode(fields: Fields) -> DecodeProfile:
    fields.reject_unknown(("name", "max_batch", "step_s", "tokens_per_s", "notes"))
    name = fields.text("name", default=fields.path)
    by_batch = fields.has("max_batch") or fields.has("step_s")
    if by_batch and fields.has("tokens_per_s"):
        raise fields.fail("tokens_per_s", "give tokens_per_s or max_batch with step_s, not both")
    if fields.has("tokens_per_s"):
        return DecodeProfile(name, fields.number("tokens_per_s", positive=True))
    if not by_batch:
        raise InputError("profile: decode: give max_batch (BS_max) and step_s (T_decode), or tokens_per_s")
    batch = fields.integer("max_batch", minimum=1)
    step = fields.number("step_s", positive=True)
    return DecodeProfile(name, batch / step, batch, step)
