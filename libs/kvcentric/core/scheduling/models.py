"""Which cost model predicts for each instance: the one it measured of itself (`MeasuredCost` in its load
reports), else the prior (`--profile`, else a roofline of `--model` on `--hardware`); whether early rejection
may trust it; and the view of predicted against measured times that the conductor's /health shows. Pure; it
predicts nothing itself and rejects nothing.

A measured model, or a prior that came from an explicit profile, is trusted. A part the instance says is a guess
(`MeasuredCost.guess`: timed while the machine was busy) is not: it predicts (ranks) for the instance until measured
again, a trusted peer's or a trusted prior's model standing in for it where there is one. An instance that has not
measured a part yet (its calibration ran out of time on a loaded machine, or serving one prompt shape cannot fit it)
is predicted by a peer's measured model of that part, a peer of the same cluster (the same hardware and model
there), trusted as the peer's is: otherwise its roofline guess would rank it and admission could never
judge its queue. A roofline prior only ranks instances: the Conductor places on an instance with no measured
model (and no measured peer) by load, and never rejects on its guess.
"""

from __future__ import annotations

import dataclasses

from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import LoadReport, MeasuredCost


def as_measured(cost: CostModel, model: str = "", device: str = "") -> MeasuredCost:
    """A cost model as an instance would announce it (the simulator's instances with their own profile)."""
    return MeasuredCost(prefill=list(cost.prefill), decode=list(cost.decode), prefill_error=0.0, decode_error=0.0,
                        prefill_chunk=cost.prefill_chunk, kv_bytes_per_token=cost.kv_bytes_per_token,
                        model=model or cost.source, device=device)


def measured_model(prior: CostModel, measured: MeasuredCost) -> CostModel:
    """`prior` with the parts `measured` holds (chunked prefill as the engine runs it)."""
    p = measured.prefill if len(measured.prefill) == 4 else prior.prefill
    d = measured.decode if len(measured.decode) == 3 else prior.decode
    return dataclasses.replace(
        prior, prefill=(p[0], p[1], p[2], p[3]), decode=(d[0], d[1], d[2]),
        kv_bytes_per_token=measured.kv_bytes_per_token or prior.kv_bytes_per_token,
        prefill_chunk=measured.prefill_chunk if len(measured.prefill) == 4 else prior.prefill_chunk,
        source=f"measured:{measured.model}@{measured.device}/{measured.dtype}")


class InstanceModels:
    """The cost model of every instance that reported one, over a shared prior."""

    def __init__(self, prior: CostModel, prior_trusted: bool = True, use_measured: bool = True) -> None:
        """`prior_trusted`: the prior may reject (an explicit profile, or measurements switched off)."""
        self.prior, self.prior_trusted, self.use_measured = prior, prior_trusted, use_measured
        self.measured: dict[str, MeasuredCost] = {}
        self.models: dict[str, CostModel] = {}
        self.clusters: dict[str, str] = {}
        """instance id -> its cluster (the peers whose measured model it may borrow)."""
        self.roles: dict[str, set[str]] = {}
        """instance id -> the roles it reported in (a peer serves the same role)."""

    def learn(self, report: LoadReport) -> bool:
        """Take the measured model a report carries; True when it is this instance's first."""
        self.clusters[report.instance_id] = report.cluster
        self.roles.setdefault(report.instance_id, set()).add(report.role)
        if report.cost is None or not self.use_measured:
            return False
        first = report.instance_id not in self.models
        self.measured[report.instance_id] = report.cost
        self.models[report.instance_id] = measured_model(self.prior, report.cost)
        return first

    def model_of(self, instance_id: str, role: str) -> tuple[CostModel, bool]:
        """The model predicting `role`'s work on the instance, and whether rejection may trust it."""
        if self._measures(instance_id, role):
            return self.models[instance_id], True
        peer = self.peer(instance_id, role)
        if peer is not None:
            return self.models[peer], True
        if self.guesses(instance_id, role) and not self.prior_trusted:
            return self.models[instance_id], False
        return self.prior, self.prior_trusted

    def _measures(self, instance_id: str, role: str) -> bool:
        """Whether the instance measured `role`'s part of its model, on a machine it could trust."""
        measured = self.measured.get(instance_id)
        return measured is not None and bool(measured.prefill if role == "prefill" else measured.decode) \
            and part(role) not in measured.guess

    def guesses(self, instance_id: str, role: str) -> bool:
        """Whether the instance's model of `role`'s part is a guess (timed while its machine was busy)."""
        measured = self.measured.get(instance_id)
        return measured is not None and part(role) in measured.guess \
            and bool(measured.prefill if role == "prefill" else measured.decode)

    def peer(self, instance_id: str, role: str) -> str | None:
        """The first instance of `instance_id`'s cluster serving `role` that measured its part (None: none)."""
        cluster = self.clusters.get(instance_id, "")
        for other in self.measured:
            if other != instance_id and self.clusters.get(other) == cluster and role in self.roles.get(other, ()) \
                    and self._measures(other, role):
                return other
        return None

    def forget(self, instance_id: str) -> None:
        self.measured.pop(instance_id, None)
        self.models.pop(instance_id, None)
        self.clusters.pop(instance_id, None)
        self.roles.pop(instance_id, None)

    def source(self, instance_id: str, role: str) -> str:
        """"measured", "peer" (a peer's measured model), "prior" (trusted to reject: a profile, or --cost-source
        prior), "busy" (its own, timed while its machine was busy: only ranks) or "guess" (a roofline prior that only
        ranks)."""
        model, trusted = self.model_of(instance_id, role)
        if model is not self.prior:
            if not trusted:
                return "busy"
            return "measured" if self._measures(instance_id, role) else "peer"
        return "prior" if trusted else "guess"

    def view(self, instance_id: str, roles: list[str]) -> dict:
        """What /health shows of one instance: where its model comes from, the fit's error and samples, and
        the latest prefill chunk and decode step it timed against what its model and the prior predict."""
        measured = self.measured.get(instance_id)
        shown: dict = {role: self.source(instance_id, role) for role in roles}
        shown = {"model_source": shown}
        if measured is None:
            return shown
        model = self.models[instance_id]
        shown.update(model=measured.model, device=measured.device, dtype=measured.dtype, version=measured.version,
                     fit_error={"prefill": measured.prefill_error, "decode": measured.decode_error},
                     samples={"prefill": measured.prefill_samples, "decode": measured.decode_samples})
        if len(measured.last_prefill) == 3:
            n_new, n_cached, seconds = measured.last_prefill
            shown["prefill_chunk"] = _compare([int(n_new), int(n_cached)], seconds,
                                              model.t_prefill(int(n_new), int(n_cached)),
                                              self.prior.t_prefill(int(n_new), int(n_cached)))
        if len(measured.last_decode) == 3:
            batch, kv_tokens, seconds = measured.last_decode
            shown["decode_step"] = _compare([int(batch), int(kv_tokens)], seconds, model.t_decode(batch, kv_tokens),
                                            self.prior.t_decode(batch, kv_tokens))
        return shown


def part(role: str) -> str:
    """The part of a cost model a role's work uses: a colocated instance reports as prefill and as decode."""
    return "prefill" if role == "prefill" else "decode"


def _compare(shape: list[int], measured_s: float, predicted_s: float, prior_s: float) -> dict:
    return {"shape": shape, "measured_s": round(measured_s, 6), "predicted_s": round(predicted_s, 6),
            "prior_s": round(prior_s, 6),
            "rel_error": round(abs(predicted_s - measured_s) / measured_s, 4) if measured_s > 0 else None}
