"""Our model and paged cache against `transformers` on tiny random checkpoints of each architecture.

With KVC_TEST_DEVICE=cuda (bench/engine/gpu_check.sh) ours runs on the GPU in fp32, its decode steps through the Triton
paged kernel replayed from CUDA graphs, against transformers on the CPU."""

from __future__ import annotations

import pytest
import torch

from checkpoints import build_checkpoint, hf_model
from factories import TEST_DEVICE
from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import load_model_config
from kvcentric.core.protocol import SamplingParams

ARCHITECTURES = {
    "llama-gqa-bias": ("llama", {}),
    "llama-llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope-tied": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                         "tie_word_embeddings": True, "attention_bias": False}),
    "mistral-sliding-window": ("mistral", {}),
    "qwen2-bias-tied": ("qwen2", {}),
}
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    architecture, overrides = ARCHITECTURES[request.param]
    directory = build_checkpoint(tmp_path_factory.mktemp(request.param), architecture, **overrides)
    return directory, hf_model(directory)


def runner_for(directory, num_blocks=64, block_size=4) -> tuple[ModelRunner, BlockPool]:
    runner = ModelRunner(load_model_config(str(directory)), num_blocks, block_size, device=TEST_DEVICE)
    assert runner.capture_decode_graphs(4) == (TEST_DEVICE == "cuda")
    return runner, BlockPool(num_blocks, block_size)


def hf_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_logits_match_transformers(checkpoint):
    directory, reference = checkpoint
    runner, pool = runner_for(directory)
    tokens = prompt(37)
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    torch.testing.assert_close(runner.prefill(tokens, blocks, 0).cpu(), hf_last_logits(reference, tokens),
                               atol=ATOL, rtol=0)


def test_twenty_decode_steps_on_the_paged_cache_match_transformers(checkpoint):
    directory, reference = checkpoint
    runner, pool = runner_for(directory)
    tokens = prompt(21)
    blocks = pool.allocate(pool.blocks_for(len(tokens) + 20))
    runner.prefill(tokens, blocks, 0)
    for step in range(20):  # beyond Mistral's 24-token window on purpose
        tokens.append((step * 37 + 5) % 300)
        ours = runner.decode([tokens[-1]], [len(tokens) - 1], [blocks])[0].cpu()
        torch.testing.assert_close(ours, hf_last_logits(reference, tokens), atol=ATOL, rtol=0)


def test_prefill_reusing_a_cached_prefix_and_chunks_match_transformers(checkpoint):
    directory, reference = checkpoint
    runner, pool = runner_for(directory)
    tokens = prompt(45, seed=2)
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    runner.prefill(tokens, blocks, 0, 16)  # the cached prefix: 4 full blocks
    runner.prefill(tokens, blocks, 16, 30)  # a middle chunk
    torch.testing.assert_close(runner.prefill(tokens, blocks, 30).cpu(), hf_last_logits(reference, tokens),
                               atol=ATOL, rtol=0)


def test_greedy_generation_equals_transformers_generate(checkpoint):
    directory, reference = checkpoint
    runner, pool = runner_for(directory)
    tokens = prompt(12, seed=3)
    ours, _ = generate(runner, pool, tokens, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([tokens]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                    pad_token_id=0)[0, len(tokens):].tolist()
    assert ours == theirs


def test_batched_decode_of_sequences_of_different_lengths_matches_one_by_one(checkpoint):
    directory, _ = checkpoint
    runner, pool = runner_for(directory, num_blocks=128)
    prompts = [prompt(n, seed=n) for n in (5, 17, 30)]
    tables = [pool.allocate(pool.blocks_for(len(p) + 1)) for p in prompts]
    for p, table in zip(prompts, tables):
        runner.prefill(p, table, 0)
    batched = runner.decode([7, 8, 9], [len(p) for p in prompts], tables)
    for row, (p, table) in enumerate(zip(prompts, tables)):
        alone = runner.decode([7 + row], [len(p)], [table])[0]
        torch.testing.assert_close(batched[row], alone, atol=1e-5, rtol=0)
