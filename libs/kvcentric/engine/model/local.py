"""Single-process generation with the same model and cache: the reference the disaggregated path must match."""

from __future__ import annotations

from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.model.sampling import sample
from kvcentric.core.stopping import finish_reason
from kvcentric.core.protocol import SamplingParams


def generate(runner: ModelRunner, pool: BlockPool, token_ids: list[int],
             params: SamplingParams) -> tuple[list[int], str]:
    """Prefill then decode one prompt in this process; returns (generated ids, finish reason)."""
    blocks = pool.allocate(pool.blocks_for(len(token_ids) + params.max_tokens))
    try:
        out = [sample(runner.prefill(token_ids, blocks, 0), params, 0)]
        eos = runner.config.eos_token_ids
        while (reason := finish_reason(out[-1], len(out), params, eos)) is None:
            position = len(token_ids) + len(out) - 1
            logits = runner.decode([out[-1]], [position], [blocks])[0]
            out.append(sample(logits, params, len(out)))
        return out, reason
    finally:
        pool.free(blocks)
