"""A migrated request's continuation on the engine cores (CPU, no servers): prefilled again as prompt +
the tokens already streamed, it generates the very tokens the undisturbed request went on with, penalties,
min_tokens and seeded draws included; and the conductor core does not place it where it failed."""

import msgspec
import pytest

from factories import make_conductor, make_pool, make_runner, prefill_job, prompt, schedule_request
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.migration import continuation
from kvcentric.core.protocol import Placement, Rejection, SamplingParams
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.cores.prefill import PrefillEngine
from test_model_and_engines import handoff

PENALISED = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5,
                           repetition_penalty=1.3)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11, frequency_penalty=0.8)


GENERATED: dict[tuple, list[int]] = {}


def generate(token_ids: list[int], params: SamplingParams) -> list[int]:
    """Prefill on one engine, decode on another, as the cluster does (remembered: the engines are
    deterministic, and several tests start from the same undisturbed run)."""
    key = (tuple(token_ids), msgspec.json.encode(params))
    if key not in GENERATED:
        GENERATED[key] = run(token_ids, params)
    return GENERATED[key]


def run(token_ids: list[int], params: SamplingParams) -> list[int]:
    # On the CPU: the model its random weights give there is one where forgetting the streamed tokens changes
    # the penalised output (another device draws other weights).
    p_runner, d_runner = make_runner(block_size=4, device="cpu"), make_runner(block_size=4, device="cpu")
    prefill = PrefillEngine(p_runner, make_pool(p_runner), BlockHasher(block_size=4), chunk_tokens=8)
    decode = DecodeEngine(d_runner, make_pool(d_runner))
    job = prefill_job(token_ids, params)
    prefill.submit(job)
    tokens, _ = handoff(prefill, decode, job, params)
    return tokens


@pytest.mark.parametrize("params", [PENALISED, SEEDED], ids=["penalised-greedy", "seeded"])
@pytest.mark.parametrize("streamed", [1, 9])
def test_the_continuation_generates_what_the_undisturbed_request_went_on_with(params, streamed):
    undisturbed = generate(prompt(21), params)
    resumed_prompt, resumed = continuation(prompt(21), undisturbed[:streamed], params)
    assert generate(resumed_prompt, resumed) == undisturbed[streamed:]


def test_without_resumed_tokens_the_penalties_would_forget_the_streamed_tokens():
    undisturbed = generate(prompt(21), PENALISED)
    resumed_prompt, resumed = continuation(prompt(21), undisturbed[:9], PENALISED)
    forgetful = msgspec.structs.replace(resumed, resumed_tokens=0)
    assert generate(resumed_prompt, forgetful) != undisturbed[9:]


def test_min_tokens_counts_the_streamed_tokens():
    params = SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=list(range(256)))
    undisturbed = generate(prompt(21), params)
    resumed_prompt, resumed = continuation(prompt(21), undisturbed[:2], params)
    assert len(undisturbed) == 5  # the stop tokens were held back for 4 tokens, then one stopped it
    assert generate(resumed_prompt, resumed) == undisturbed[2:]


def test_the_conductor_does_not_place_a_continuation_on_the_instances_it_avoids():
    conductor = make_conductor(prefills=2, decodes=2)
    placed = conductor.schedule(msgspec.structs.replace(schedule_request(), avoid=["p0", "d0"]), {}, 0.0)
    assert isinstance(placed, Placement) and (placed.prefill_id, placed.decode_id) == ("p1", "d1")
    nowhere = conductor.schedule(msgspec.structs.replace(schedule_request(request_id="r2"), avoid=["p0", "p1"]),
                                 {}, 0.0)
    assert isinstance(nowhere, Rejection) and nowhere.reason == "no_instance"
