"""The Conductor's core: turns a ScheduleRequest and the prefix blocks each instance holds into a Placement
or a Rejection, and keeps the dispatch-time accounting the next decision needs. Pure, time passed in.

Mooncake Algorithm 1 end to end: each decision first builds every candidate's view (`view.PrefillView`: its last
load report, the placements in flight there, its TTFT correction and the prompt's blocks it holds, a pipelined
group's from its stages in `groups`), the placement policy picks from those views the prefill instance and predicts
TTFT (`policies`), and it pulls the prompt's leading blocks from a decode instance that kept them after their
prefill died mid-prompt where that is sooner (`holders`); admission picks the decode instance by predicted TBT and
applies the rejection mode (`admission`), and on a placement the chosen instances' queues, the pull link and the
decode forecast are updated ("updates the cache and queue times for that instance accordingly", §6.1: the placement
counts in the instance's T_queue until its load reports list it, and the prompt's blocks count as held there until
its KV events say so). Placement ranks, and admission judges, each predicted TTFT times its instance's learned
correction (`correction`: actual over predicted, from first tokens, timed chunks and late placements), against the
request's SLOs (`slo`: absolute, or relative to the unloaded speed of the fastest trusted model). An idle prefill
instance refused on its prediction gets one request now and then anyway (`probe_every_s`), so a stale estimate is
measured again instead of refusing for ever. It decides where a request goes; it does not send it there, ask
kvs-meta, or read a clock. The live conductor service and the simulator drive this same class.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import LoadReport, Placement, Rejection, RequestOutcome, ScheduleRequest
from kvcentric.core.scheduling.admission import Admission, DecodeChoice
from kvcentric.core.scheduling.bursts import OfferedWork
from kvcentric.core.scheduling.clusters import ClusterRouter, ClusterSetup
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.correction import TtftCorrection
from kvcentric.core.scheduling.estimators import Estimator, LinkTable
from kvcentric.core.scheduling.groups import PrefillGroups
from kvcentric.core.scheduling.holders import block_holders, pull_from_holder
from kvcentric.core.scheduling.models import InstanceModels
from kvcentric.core.scheduling.policies import PrefillChoice, make_policy
from kvcentric.core.scheduling.prefix import ExpectedBlocks
from kvcentric.core.scheduling.registry import DecodeState, InstanceRegistry, PrefillState
from kvcentric.core.scheduling.slo import Slo
from kvcentric.core.scheduling.view import BlockHolder, PrefillView, PromptBlocks, instance_view

MAX_PENDING = 100_000
"""Placements remembered for their outcome; the oldest are dropped beyond this."""


RELATIVE_MIN_PREDICTED_S = 0.25
"""With a relative TTFT SLO: predictions below this count as it in the TTFT correction's ratios (a first token's
fixed costs beside the prefill, the bus and the KV hand-over, are not a slower machine; an absolute SLO's is a
twentieth of it)."""
RELATIVE_MAX_WAIT_S = 120.0
"""With a relative TTFT SLO: a placement waiting longer than this for its first token is taken as lost."""


EXPECTED_SLACK_S = 5.0
"""How long after its predicted first token a placed prompt's blocks still count as expected on its prefill
instance when no KV event has announced them."""


@dataclasses.dataclass(slots=True)
class Pending:
    predicted_ttft_s: float
    decode_id: str
    predicted_tbt_s: float = -1.0
    prefill_id: str = ""


class Tally(dict[str, float]):
    """Counts and sums by name, as a Counter but for float sums too: a name never added reads as 0."""

    def __missing__(self, name: str) -> float:
        return 0


class Conductor:
    def __init__(self, config: SchedulerConfig, cost: CostModel, *, stale_after_s: float = 1.5,
                 stuck_after_s: float = math.inf, clusters: ClusterSetup | None = None, prior_trusted: bool = True,
                 use_measured: bool = True) -> None:
        """`cost` is the prior; each instance's own measured model replaces it once reported (`use_measured`).
        `prior_trusted`: the prior may reject requests (a profile, the simulator); else it only ranks."""
        self.config = config
        self.estimator = Estimator(cost, config.block_size)
        self.links = LinkTable(config.link_bytes_per_s)
        self.models = InstanceModels(cost, prior_trusted, use_measured)
        self.registry = InstanceRegistry(self.estimator, stale_after_s, stuck_after_s, self.models, config.queue_time)
        self.expected = ExpectedBlocks() if config.expect_cache else None
        """Blocks placed prompts will leave on their prefill instances, not yet announced (§6.1)."""
        self.groups = PrefillGroups(cost)
        """Pipelined prefill groups (Mooncake §5.1): their stages placed on as one candidate each."""
        self.policy = self._make_policy(self.estimator)
        self.router = ClusterRouter(clusters, self.estimator, self._make_policy) if clusters else None
        """PrfaaS routing across clusters (§3.3); None: one cluster, every instance a candidate."""
        self.admission = Admission(config.rejection, self.estimator, config.ttft_slo_s, config.tbt_slo_s,
                                   config.priority_step, config.top_priority, config.slo_headroom)
        self.slos = config.slos
        floor, wait = ((config.ttft_slo_s / 20, 3 * config.ttft_slo_s) if config.ttft_slo_s
                       else (RELATIVE_MIN_PREDICTED_S, RELATIVE_MAX_WAIT_S))
        self.correction = TtftCorrection(floor, max_wait_s=wait,
                                         spread=config.ttft_correction_spread) if config.ttft_correction else None
        """Each prefill instance's actual / predicted TTFT, which admission multiplies its predictions by."""
        self.offered = OfferedWork(config.burst_s)
        """The prefill work offered lately, against the pool's capacity: a burst is queued, overload refused."""
        self.t_d = config.decode_time_s
        self.pending: dict[str, Pending] = {}
        self.refused_since: dict[str, float] = {}
        """prefill instance id -> since when it has been idle and refused work on its prediction, with no placement
        (after `probe_every_s` of that it is given a probe: one request over its SLO, placed anyway)."""
        self.stats = Tally()

    def _make_policy(self, estimator: Estimator):
        config = self.config
        return make_policy(config.policy, estimator, self.links, config.kvcache_balancing_threshold, config.seed)

    # ---------------------------------------------------------------- inputs

    def observe(self, report: LoadReport, now: float) -> None:
        """A load report from an instance (NATS `kvc.load.<role>.<id>`, or the simulator); a `repeat`
        only says it lives: its old numbers teach nothing about egress, links or the decode batch."""
        before = self.registry.prefill.get(report.instance_id)
        old_cost = before.cost if before is not None else None
        state = self.registry.observe(report, now)
        self.groups.observe(report)
        if report.repeat:
            return
        if self.correction is not None and isinstance(state, PrefillState):
            self._rebase(state, old_cost, report)
        if self.router is not None:
            self.router.observe(report, now)
        if report.link_bandwidth:
            self._learn_links(report)
        if self.correction is not None and isinstance(state, PrefillState):
            self._learn_chunk(state, report)
        if isinstance(state, DecodeState):
            state.forecast.expire(now, self.t_d)
            state.forecast.reconcile(state.running, state.kv_tokens, now, self.t_d)

    def _rebase(self, state: PrefillState, old: CostModel | None, report: LoadReport) -> None:
        """The instance's prefill model changed (a refit it reported): carry what the correction learned against
        the old model over to the new one, scaled by the two models' times for its latest chunk (512 new tokens
        if it reported none)."""
        assert self.correction is not None
        new = state.cost
        if old is None or new is None or old.prefill == new.prefill:
            return
        chunk, _ = latest_chunk(report)
        n_new, n_cached = (int(chunk[0]), int(chunk[1])) if len(chunk) == 3 else (512, 0)
        before, after = old.t_prefill(n_new, n_cached), new.t_prefill(n_new, n_cached)
        if before > 0 and after > 0:
            self.correction.rebase(state.instance_id, before / after)

    def _learn_chunk(self, state: PrefillState, report: LoadReport) -> None:
        """The latest prefill chunk the instance timed against what its own model predicts for it: from every
        report that carries one, else from the cost model's (a sender from before reports carried it)."""
        assert self.correction is not None
        chunk, samples = latest_chunk(report)
        if state.cost is None or len(chunk) != 3:
            return
        n_new, n_cached, seconds = chunk
        self.correction.learn_chunk(state.instance_id, samples, state.cost.t_prefill(int(n_new), int(n_cached)),
                                    seconds)

    def _learn_links(self, report: LoadReport) -> None:
        """Measured bandwidth from this instance to peers (keyed by messenger address) for T_transfer."""
        states: list[PrefillState | DecodeState] = [*self.registry.prefill.values(), *self.registry.decode.values()]
        by_addr = {s.kv_addr: s.instance_id for s in states}
        for addr, bytes_per_s in report.link_bandwidth.items():
            if bytes_per_s > 0:
                self.links.set_bandwidth(report.instance_id, by_addr.get(addr, addr), bytes_per_s)

    def on_first_token(self, outcome: RequestOutcome, now: float) -> None:
        """A request's first token is out (the gateway's RequestOutcome sent then, on kvc.conductor.first_token):
        its prefill instance's TTFT correction learns from it, whichever replica placed it."""
        if self.correction is not None:
            self.correction.learn(outcome.prefill_id, outcome.request_id, outcome.predicted_ttft_s, outcome.ttft_s)

    def on_outcome(self, outcome: RequestOutcome, now: float) -> None:
        """A request ended: compare predicted with actual TTFT and TBT, and learn the decode duration t_d (and
        its TTFT correction, when its first token was not heard of)."""
        self.on_first_token(outcome, now)
        pending = self.pending.pop(outcome.request_id, None)
        if pending is None:
            return
        self._forget_placed(outcome.request_id, pending)
        if outcome.finish_reason in ("stop", "length") and outcome.ttft_s > 0:
            error = pending.predicted_ttft_s - outcome.ttft_s
            self.stats["outcomes"] += 1
            self.stats["ttft_error_sum_s"] += error
            self.stats["ttft_abs_error_sum_s"] += abs(error)
            self.stats["ttft_rel_error_sum"] += abs(error) / outcome.ttft_s
            decode_s = outcome.e2e_s - outcome.ttft_s
            if outcome.completion_tokens > 1 and decode_s > 0:
                self._count_tbt(pending.predicted_tbt_s, decode_s / (outcome.completion_tokens - 1))
            if self.config.adapt_decode_time and outcome.completion_tokens > 1 and decode_s > 0:
                self.t_d += 0.05 * (decode_s - self.t_d)

    def _count_tbt(self, predicted_s: float, tbt_s: float) -> None:
        """The predicted decode step at placement against the request's mean time between tokens."""
        if predicted_s > 0:
            error = predicted_s - tbt_s
            self.stats["tbt_outcomes"] += 1
            self.stats["tbt_error_sum_s"] += error
            self.stats["tbt_abs_error_sum_s"] += abs(error)
            self.stats["tbt_rel_error_sum"] += abs(error) / tbt_s

    def forget(self, request_id: str) -> None:
        """A placed request ended without an outcome worth learning from (rejected after prefill, failed)."""
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            self._forget_placed(request_id, pending)

    def _forget_placed(self, request_id: str, pending: Pending) -> None:
        """A placed request is over: out of its decode forecast, and of its prefill's in-flight placements."""
        state = self.registry.decode.get(pending.decode_id)
        if state is not None:
            state.forecast.remove(request_id)
        self.registry.unplace(pending.prefill_id, request_id)
        self._forget_waiting(request_id, pending)

    def _forget_waiting(self, request_id: str, pending: Pending) -> None:
        if self.correction is not None:
            self.correction.placed_done(pending.prefill_id, request_id)

    # ---------------------------------------------------------------- the decision

    def schedule(self, request: ScheduleRequest, hits: Mapping[str, int], now: float) -> Placement | Rejection:
        """Place `request`; `hits` maps prefill instance id -> leading blocks of it that instance holds
        (ignored below `cache_aware_scheduling_min_tokens`). Instances in `request.avoid` (a migrated request's
        failed ones) are not considered; the stages of a prefill group are one candidate."""
        alive = [s for s in self.registry.alive_prefill(now) if s.instance_id not in request.avoid]
        whole, groups = self.groups.split(alive)
        decodes = [s for s in self.registry.alive_decode(now) if s.instance_id not in request.avoid]
        if self.router is not None:
            decodes = self.router.in_scope(decodes, self.router.pd)
        if not (whole or groups) or not decodes:
            return self._no_instance(request, whole or groups, decodes)
        prefills = self._candidates(request, hits, whole, groups, now)
        choice = self._choose_prefill(request, prefills, now, len(decodes))
        if choice is None:
            return self._no_instance(request, [], decodes)
        if self.router is None and self.cache_aware(request):  # a killed prefill's KV, kept where it was pushed
            holders = block_holders(hits, decodes, self.registry.prefill)
            choice = pull_from_holder(request, choice, holders, self.estimator, self.links, now)
        slo = self.slo_for(request.n_tokens, alive, decodes)
        decode = self._decode_for(request, choice, decodes, now, slo)
        judged_ttft_s = self.judged_ttft_s(choice)
        self.offered.offer(choice.prefill_s, now, len(prefills))
        burst_s = self.offered.allowance_s(now, len(prefills))
        verdict = self.admission.verdict(request, judged_ttft_s, decode, self.t_d, slo, burst_s)
        if verdict is not None and not self._probe(choice, decode, verdict, now):
            self.stats[f"rejected_{verdict.stage}"] += 1
            return Rejection.overloaded(request.request_id, verdict.message, retry_after_s=verdict.retry_after_s,
                                        stage=verdict.stage, load=round(verdict.load, 4))
        if burst_s and judged_ttft_s > self.admission.threshold(request.priority) * slo.ttft_s:
            self.stats["queued_burst"] += 1
        self._account(request, choice, decode, now)
        return self._placement(request, choice, decode, slo)

    def _candidates(self, request: ScheduleRequest, hits: Mapping[str, int], whole: list[PrefillState],
                    groups: list[list[PrefillState]], now: float) -> list[PrefillView]:
        """Each whole instance, then each complete group, as the policy sees it for this decision: with the
        prompt's blocks it holds (`hits`) and is expected to hold (none below the cache-aware minimum), and its
        TTFT correction now."""
        if self.expected is not None:
            self.expected.expire(now)
        prompt = PromptBlocks()
        if self.cache_aware(request):
            expected = self.expected.match(request.block_hashes) if self.expected is not None else {}
            prompt = PromptBlocks(hits, expected)
        correction = self.correction
        if correction is None:
            views = [instance_view(state, now, prompt) for state in whole]
            return views + [self.groups.view(stages, now, prompt) for stages in groups]
        views = [instance_view(state, now, prompt, correction.factor(state.instance_id, now)) for state in whole]
        return views + [self.groups.view(stages, now, prompt, correction.factor(stages[0].instance_id, now))
                        for stages in groups]

    def prefill_views(self, now: float) -> list[PrefillView]:
        """Every alive prefill instance (each stage of a group by itself) as of `now`, for no prompt in
        particular: what the PrfaaS router's status and tests read queues from."""
        return [instance_view(state, now) for state in self.registry.alive_prefill(now)]

    def slo_for(self, n_tokens: int, prefills: list[PrefillState], decodes: list[DecodeState]) -> Slo:
        """The SLOs of a request of `n_tokens`: the absolute ones, or relative to the unloaded speed of the
        fastest trusted model among `prefills` and `decodes`."""
        if not self.slos.relative:
            return self.admission.slo
        prior = self.estimator.cost
        return self.slos.for_request(n_tokens, [s.cost or prior for s in prefills if s.trusted],
                                     [s.cost or prior for s in decodes if s.trusted])

    def slo_view(self, now: float) -> dict:
        """The SLOs in force (absolute, or relative with their value for a 256-token prompt now), for /health."""
        prior = self.estimator.cost
        prefills = [s.cost or prior for s in self.registry.alive_prefill(now) if s.trusted]
        decodes = [s.cost or prior for s in self.registry.alive_decode(now) if s.trusted]
        return self.slos.describe(prefills, decodes)

    def _probe(self, choice: PrefillChoice, decode: DecodeChoice, verdict, now: float) -> bool:
        """Place a request its prefill instance's prediction refused, when that instance is idle and has been
        refused work (with nothing placed there) for `probe_every_s`: what it measures then corrects the estimate
        (its own model, the TTFT correction), instead of a stale one refusing for ever."""
        every, instance = self.config.probe_every_s, choice.instance
        if not every or verdict.stage != "prefill" or not decode.room or decode.load > verdict.threshold:
            return False
        if instance.queue_s > 0 or instance.in_flight:
            return False
        since = self.refused_since.setdefault(instance.instance_id, now)
        if now - since < every:
            return False
        self.stats["probes"] += 1
        return True

    @staticmethod
    def judged_ttft_s(choice: PrefillChoice) -> float:
        """The TTFT admission holds to the SLO: the prediction times its instance's correction (1 without); 0
        where the prediction is only the prior's guess (never a reason to reject)."""
        if not choice.instance.trusted:
            return 0.0
        return choice.ttft_s * choice.instance.correction

    def cache_aware(self, request: ScheduleRequest) -> bool:
        """Whether the prompt is long enough for its prefix hits to count (Llumnix's minimum tokens)."""
        return request.n_tokens >= self.config.cache_aware_scheduling_min_tokens

    def _no_instance(self, request: ScheduleRequest, prefills: list, decodes: list) -> Rejection:
        missing = " and ".join(r for r, alive in (("prefill", prefills), ("decode", decodes)) if not alive)
        self.stats["rejected_no_instance"] += 1
        return Rejection.no_instance(request.request_id, f"no {missing} instance is alive")

    def _choose_prefill(self, request: ScheduleRequest, prefills: list[PrefillView], now: float,
                        decodes: int = 0) -> PrefillChoice | None:
        """The placement policy over every alive instance, or, with clusters, over the routed cluster's."""
        if self.router is None:
            return self.policy.choose(request, prefills, now)
        self.router.tick(prefills, now, decodes)
        return self.router.choose(request, prefills, now)

    def _decode_for(self, request: ScheduleRequest, choice: PrefillChoice, decodes: list[DecodeState],
                    now: float, slo: Slo | None = None) -> DecodeChoice:
        """Colocated: an instance that reports in both roles decodes what it prefilled (no KV transfer)."""
        arrival = now + choice.ttft_s
        state = self.registry.serving_decode(choice.instance.instance_id, now)
        if state is None:
            return self.admission.choose_decode(request, decodes, arrival, now, self.t_d, slo)
        if self.admission.mode == "predictive":
            return self.admission.judge_predicted(request, state, arrival, self.t_d, slo)
        return self.admission.judge_current(request, state, now, slo)

    def _account(self, request: ScheduleRequest, choice: PrefillChoice, decode: DecodeChoice, now: float) -> None:
        instance = choice.instance
        self.refused_since.pop(instance.instance_id, None)
        if self.router is not None:
            self.router.account(request, choice, now)
        cached = self.estimator.cached_tokens(request.n_tokens, choice.prefix_blocks)
        self.registry.place(instance.instance_id, request.request_id, choice.prefill_s, request.n_tokens - cached,
                            now)
        if self.expected is not None and request.block_hashes:
            self.expected.expect(instance.instance_id, request.block_hashes, now + choice.ttft_s + EXPECTED_SLACK_S)
        if choice.source is not None:
            nbytes = self.estimator.block_bytes(choice.pull_blocks)
            self.links.reserve(choice.source.instance_id, instance.instance_id, nbytes, now)
            self.stats["pulls"] += 1
            self.stats["pulled_blocks"] += choice.pull_blocks
            self.stats["pulls_from_decode"] += isinstance(choice.source, BlockHolder)
        decode.instance.forecast.add(request.request_id, now + choice.ttft_s, request.n_tokens)
        if len(self.pending) >= MAX_PENDING:
            oldest = next(iter(self.pending))
            self._forget_waiting(oldest, self.pending.pop(oldest))
        tbt = decode.tbt_s if math.isfinite(decode.tbt_s) else -1.0
        self.pending[request.request_id] = Pending(choice.ttft_s, decode.instance.instance_id, tbt,
                                                   instance.instance_id)
        if self.correction is not None:
            self.correction.placed(instance.instance_id, request.request_id, choice.ttft_s, now)
        self.stats["placed"] += 1
        self.stats["placed_unjudged"] += not (choice.instance.trusted and decode.instance.trusted)

    def _placement(self, request: ScheduleRequest, choice: PrefillChoice, decode: DecodeChoice,
                   slo: Slo | None = None) -> Placement:
        source = choice.source
        pull = request.block_hashes[choice.local_blocks:choice.prefix_blocks] if source is not None else []
        tbt = decode.tbt_s if math.isfinite(decode.tbt_s) else -1.0
        holder, prefix_tokens = choice.decode_prefix_source, choice.decode_prefix_tokens
        prefix_blocks = -(-prefix_tokens // self.config.block_size) if holder is not None else 0
        return Placement(request_id=request.request_id, prefill_id=choice.instance.instance_id,
                         decode_id=decode.instance.instance_id, decode_kv_addr=decode.instance.kv_addr,
                         cached_tokens=self.estimator.cached_tokens(request.n_tokens, choice.prefix_blocks),
                         predicted_ttft_s=round(choice.ttft_s, 6), predicted_tbt_s=round(tbt, 6),
                         kv_source_id=source.instance_id if source is not None else "",
                         kv_source_addr=source.kv_addr if source is not None else "", pull_block_hashes=pull,
                         decode_prefix_addr=holder.kv_addr if holder is not None else "",
                         decode_prefix_hashes=request.block_hashes[:prefix_blocks],
                         decode_prefix_tokens=prefix_tokens if holder is not None else 0,
                         pipeline_addrs=list(choice.instance.pipeline_addrs),
                         ttft_slo_s=_finite(slo.ttft_s) if slo else 0.0, tbt_slo_s=_finite(slo.tbt_s) if slo else 0.0,
                         decode_tbt_check=self.admission.mode == "none")


def _finite(seconds: float) -> float:
    """An SLO as a Placement carries it: rounded, 0 where there is none (infinite)."""
    return round(seconds, 6) if math.isfinite(seconds) else 0.0


def latest_chunk(report: LoadReport) -> tuple[list[float], int]:
    """The latest prefill chunk the instance timed, (n_new, n_cached, seconds), and its number: from the report
    when it carries one, else from its cost model (a sender from before reports carried it); [] when neither."""
    if len(report.last_prefill) == 3 or report.cost is None:
        return report.last_prefill, report.prefill_samples
    return report.cost.last_prefill, report.cost.prefill_samples
