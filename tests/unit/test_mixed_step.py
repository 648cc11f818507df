"""Mixed colocated steps (decode rows and prompt chunks of several prompts in one forward pass) generate the
same greedy tokens as `transformers`, with either decode attention, under budgets that split prompts."""

from __future__ import annotations

import pytest
import torch

from checkpoints import build_checkpoint, hf_model
from factories import TEST_DEVICE
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import DecodeJob, PrefillJob, SamplingParams
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.cores.mixed import MixedStepper
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import load_model_config

OUTPUT = 12


@pytest.fixture(scope="module", params=["llama", "mistral"])
def checkpoint(request, tmp_path_factory):
    directory = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return directory, hf_model(directory)


def prompts() -> list[list[int]]:
    lengths = (5, 30, 17, 41, 9)  # mistral's window is 24: some prompts outgrow it
    return [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def transformers_greedy(model, tokens: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=OUTPUT, min_new_tokens=OUTPUT, do_sample=False,
                             pad_token_id=0)
    return out[0, len(tokens):].tolist()


def run_mixed(directory, step_tokens: int, decode_attention: str) -> tuple[dict[str, list[int]], int]:
    """Every prompt submitted at once and stepped to the end; the tokens of each and the number of steps."""
    runner = ModelRunner(load_model_config(str(directory)), 96, 4, device=TEST_DEVICE)
    runner.capture_decode_graphs(8)  # on CUDA its decode-only steps replay graphs; elsewhere nothing
    engine = ColocatedEngine(runner, BlockPool(96, 4), BlockHasher("sha256_cbor", 4))
    stepper = MixedStepper(engine, step_tokens, decode_attention)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    for index, tokens in enumerate(prompts()):
        engine.submit(PrefillJob(request_id=f"r{index}", token_ids=tokens, sampling=params, decode_id="",
                                 decode_kv_addr=""), DecodeJob(request_id=f"r{index}", n_prompt_tokens=len(tokens),
                                                               sampling=params))
    generated: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts()))}
    steps = 0
    while engine.has_work:
        step, failed = stepper.schedule()
        assert not failed
        firsts, tokens = stepper.execute(step)
        for chunk in stepper.update(step, firsts, tokens):
            generated[chunk.request_id] += chunk.token_ids
        steps += 1
    assert engine.pool.num_free == engine.pool.num_blocks  # every block given back
    return generated, steps


@pytest.mark.parametrize("decode_attention", ["padded", "slices"])
@pytest.mark.parametrize("step_tokens", [16, 64])
def test_mixed_steps_generate_what_transformers_generates(checkpoint, step_tokens, decode_attention):
    directory, reference = checkpoint
    generated, steps = run_mixed(directory, step_tokens, decode_attention)
    for index, tokens in enumerate(prompts()):
        assert generated[f"r{index}"] == transformers_greedy(reference, tokens), f"prompt {index}"
    assert steps < sum(len(p) for p in prompts()) // step_tokens + len(prompts()) + OUTPUT + 2


def test_a_big_budget_prefills_every_prompt_in_one_step(checkpoint):
    directory, _ = checkpoint
    _, steps = run_mixed(directory, 512, "padded")
    assert steps == OUTPUT  # the first step samples every first token; then OUTPUT - 1 decode steps


def test_decode_only_steps_go_through_the_runners_decode_and_its_graphs(checkpoint, monkeypatch):
    directory, reference = checkpoint
    rows: list[int] = []
    plain = ModelRunner.decode

    def counted(self, token_ids, positions, block_tables):
        rows.append(len(token_ids))
        return plain(self, token_ids, positions, block_tables)

    monkeypatch.setattr(ModelRunner, "decode", counted)
    generated, steps = run_mixed(directory, 512, "padded")
    assert rows == [len(prompts())] * (OUTPUT - 1)  # the first step prefills every prompt, the rest decode only
    assert generated["r3"] == transformers_greedy(reference, prompts()[3])


def test_a_prefix_loading_from_the_host_pool_layer_by_layer_is_in_the_cache_before_a_mixed_step(checkpoint):
    """A mixed step runs every chunk in one forward pass, so a prompt's host-pool prefix (which otherwise loads
    layer by layer beside its first chunk) is settled before it; the tokens are still transformers' own."""
    from kvcentric.engine.kv.kvpool import HostBlockPool
    directory, reference = checkpoint
    runner = ModelRunner(load_model_config(str(directory)), 96, 4, device=TEST_DEVICE)
    runner.capture_decode_graphs(8)  # on CUDA its decode-only steps replay graphs; elsewhere nothing
    engine = ColocatedEngine(runner, BlockPool(96, 4), BlockHasher("sha256_cbor", 4),
                             host=HostBlockPool(64, runner.block_bytes))
    stepper = MixedStepper(engine, 64, "padded")
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    prefix, other = prompts()[3], prompts()[1]

    def generate(batch: dict[str, list[int]]) -> dict[str, list[int]]:
        for name, tokens in batch.items():
            engine.submit(PrefillJob(request_id=name, token_ids=tokens, sampling=params, decode_id="",
                                     decode_kv_addr=""), DecodeJob(request_id=name, n_prompt_tokens=len(tokens),
                                                                   sampling=params))
        generated: dict[str, list[int]] = {name: [] for name in batch}
        while engine.has_work:
            step, _ = stepper.schedule()
            firsts, tokens = stepper.execute(step)
            for chunk in stepper.update(step, firsts, tokens):
                generated[chunk.request_id] += chunk.token_ids
        return generated

    generate({"warm": prefix})
    engine.prefill.writer.collect(wait=True)
    engine.pool.uncache(list(range(engine.pool.num_blocks)))  # the prefix is in the host pool only
    longer = prefix + [5, 6, 7, 8, 9]
    generated = generate({"longer": longer, "other": other})
    assert engine.prefill.stats["prefill_tokens_from_host"] == 40
    assert generated == {"longer": transformers_greedy(reference, longer),
                         "other": transformers_greedy(reference, other)}
    assert not engine.prefill.host.pins


def test_a_step_of_prompts_that_all_ask_for_prompt_logprobs_and_no_decode_rows_ends_them():
    """Each such prompt runs alone (it needs every row's logits), so the batched pass has nothing to do: it must
    not run (it raised on an empty batch, and the echo request hung)."""
    from factories import decode_job, make_pool, make_runner, prefill_job
    runner = make_runner(block_size=4)
    engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=6)
    stepper = MixedStepper(engine, 2048)
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1)
    job = prefill_job([256, 5, 6, 7, 8, 9, 10, 11, 12], params, request_id="echo")
    engine.submit(job, decode_job("echo", 9, params))
    step, failed = stepper.schedule()
    assert not failed and not step.batch and [(c.start, c.end) for c in step.chunks] == [(0, 9)]
    firsts, tokens = stepper.execute(step)
    out = stepper.update(step, firsts, tokens)
    assert tokens == [] and len(out) == 1 and out[0].finish_reason == "length" and out[0].error == ""
    assert len(out[0].prompt_logprobs) == 8 and not engine.has_work


def test_a_mixed_step_takes_no_chunk_of_a_prompt_a_lane_computes():
    """The colocated lane computes prompts in passes of its own (`PrefillEngine.computing` holds them meanwhile):
    the model thread's next step must take neither their next chunk nor the same prompt twice."""
    from factories import decode_job, make_pool, make_runner, prefill_job
    runner = make_runner(block_size=4)
    engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=8)
    stepper = MixedStepper(engine, 12)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for name, length in (("a", 20), ("b", 7), ("c", 9)):
        engine.submit(prefill_job(list(range(3, 3 + length)), params, request_id=name),
                      decode_job(name, length, params))
    lane = engine.prefill.schedule_step(8)  # the lane's pass: a's first 8 tokens
    assert [(c.work.request_id, c.start, c.end) for c in lane] == [("a", 0, 8)]
    engine.prefill.computing.add("a")
    step, _ = stepper.schedule()
    assert [(c.work.request_id, c.start, c.end) for c in step.chunks] == [("b", 0, 7), ("c", 0, 5)]
    engine.prefill.computing.discard("a")
    stepper.execute(step)  # b and c computed, not ended: their chunks come back
    stepper.update(step, [None if not c.last else 0 for c in step.chunks], [])
    engine.prefill.update(lane[0])
    again, _ = stepper.schedule()
    assert [(c.work.request_id, c.start) for c in again.chunks][0] == ("a", 8)  # a in progress comes first again


@pytest.mark.parametrize("threads, lane_computing, waiting, expected", [
    (2, True, 0, 0.5),        # the lane computes: the model thread has one thread of two
    (2, False, 5000, 0.5),    # 5000 - 1024 > 2048 wait after the step: the lane starts beside it
    (2, False, 3072, 1.0),    # 3072 - 1024 = 2048 is not more than a step's: no lane, both threads
    (2, False, 256, 1.0),     # a lone prompt
    (4, True, 0, 0.75),       # three threads of four
    (1, True, 9000, 1.0),     # one thread: no lane beside it
])
def test_a_step_beside_the_lane_takes_the_share_of_its_threads(threads, lane_computing, waiting, expected):
    from kvcentric.engine.cores.mixed import lane_prompt_share
    assert lane_prompt_share(2048, threads, lane_computing, waiting) == expected


def test_a_step_takes_its_share_of_the_budget_the_decode_rows_leave():
    """`schedule(prompt_share)`: the prompt chunks fill that share of what the decode batch leaves of the budget,
    and a token at least while it leaves any, so a step beside the lane never starves the prompts."""
    from factories import decode_job, make_pool, make_runner, prefill_job
    runner = make_runner(block_size=4)
    engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=8)
    stepper = MixedStepper(engine, 12)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for name in ("a", "b"):
        engine.submit(prefill_job(list(range(3, 13)), params, request_id=name), decode_job(name, 10, params))
    step, _ = stepper.schedule(0.5)
    assert [(c.work.request_id, c.start, c.end) for c in step.chunks] == [("a", 0, 6)]
    step, _ = stepper.schedule(0.01)
    assert [(c.work.request_id, c.start, c.end) for c in step.chunks] == [("a", 0, 1)]
    step, _ = stepper.schedule()  # nothing computed yet: the same prompts again, under the whole budget of 12
    assert [(c.work.request_id, c.start, c.end) for c in step.chunks] == [("a", 0, 10), ("b", 0, 2)]
