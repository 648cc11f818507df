"""Leading blocks of a prompt held by instances that are not prefill candidates: a decode instance keeping the KV
that a prefill instance killed mid-prompt had pushed it (`engine/service/keptkv.py`). As Mooncake's KV pool serves
a prefix from wherever it lies, the chosen prefill instance pulls them from there when that is predicted to give
the first token sooner than computing them. It picks the source of a pull for a choice already made; it does not
choose the prefill instance (the placement policy does), and reads no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from kvcentric.core.protocol import ScheduleRequest
from kvcentric.core.scheduling.estimators import Estimator, LinkTable
from kvcentric.core.scheduling.policies import PrefillChoice
from kvcentric.core.scheduling.registry import DecodeState
from kvcentric.core.scheduling.view import BlockHolder


def block_holders(hits: Mapping[str, int], decodes: Iterable[DecodeState],
                  candidates: Collection[str]) -> list[BlockHolder]:
    """The decode instances among `decodes` holding leading blocks of the prompt (`hits`: instance id -> leading
    blocks held), but for those that are prefill `candidates` too (colocated: their blocks are theirs to reuse)."""
    return [BlockHolder(state.instance_id, state.kv_addr, state.cluster, hits[state.instance_id])
            for state in decodes
            if hits.get(state.instance_id, 0) > 0 and state.kv_addr and state.instance_id not in candidates]


def pull_from_holder(request: ScheduleRequest, choice: PrefillChoice, holders: Iterable[BlockHolder],
                     estimator: Estimator, links: LinkTable, now: float) -> PrefillChoice:
    """`choice`, or the same instance pulling the blocks after its own from the holder of the most, where that
    holder has more than `choice` reuses and T_transfer + T_queue + T_prefill(len, its blocks) is below `choice`'s
    predicted TTFT."""
    holder = max(holders, key=lambda h: h.held_blocks, default=None)
    if holder is None or holder.held_blocks <= choice.prefix_blocks:
        return choice
    instance, local = choice.instance, choice.local_blocks
    prefill_s = estimator.t_prefill(request.n_tokens, holder.held_blocks, instance.cost)
    transfer_s = links.t_transfer(holder.instance_id, instance.instance_id,
                                  estimator.block_bytes(holder.held_blocks - local), now)
    ttft = transfer_s + instance.queue_s + prefill_s
    if ttft >= choice.ttft_s:
        return choice
    return PrefillChoice(instance, ttft, prefill_s, holder.held_blocks, holder, local)
