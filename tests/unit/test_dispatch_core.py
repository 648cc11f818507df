"""The jobs a placement implies, and which dispatch parts of a schedule request are refused."""

from __future__ import annotations

from kvcentric.core.dispatch import bad_dispatch, jobs
from kvcentric.core.protocol import DecodeJob, Dispatch, Placement, PrefillJob, SamplingParams, ScheduleRequest


def request(n_tokens: int = 3, max_tokens: int = 4, token_ids=(1, 2, 3), sampling_max: int = 4,
            request_id: str = "r1") -> ScheduleRequest:
    return ScheduleRequest(request_id=request_id, n_tokens=n_tokens, block_hashes=[], max_tokens=max_tokens,
                           dispatch=Dispatch(token_ids=list(token_ids),
                                             sampling=SamplingParams(max_tokens=sampling_max)))


def test_a_request_without_a_dispatch_part_is_fine():
    assert bad_dispatch(ScheduleRequest(request_id="r1", n_tokens=3, block_hashes=[], max_tokens=4)) == ""


def test_a_sound_dispatch_part_is_fine():
    assert bad_dispatch(request()) == ""


def test_token_ids_that_disagree_with_n_tokens_are_refused():
    assert bad_dispatch(request(n_tokens=5)) == "dispatch.token_ids has 3 tokens, n_tokens says 5"


def test_max_tokens_that_disagree_are_refused():
    assert bad_dispatch(request(sampling_max=8)) == "dispatch.sampling.max_tokens is 8, max_tokens says 4"


def test_a_request_id_that_is_no_subject_token_is_refused():
    assert "request_id" in bad_dispatch(request(request_id="a.b"))


def test_a_pair_gets_a_prefill_and_a_decode_job():
    placement = Placement(request_id="r1", prefill_id="p0", decode_id="d0", decode_kv_addr="10.0.0.1:9000")
    submits = jobs("r1", placement, [1, 2, 3], SamplingParams(max_tokens=4))
    assert [(role, instance) for role, instance, _ in submits] == [("prefill", "p0"), ("decode", "d0")]
    prefill, decode = submits[0][2], submits[1][2]
    assert isinstance(prefill, PrefillJob) and prefill.decode_id == "d0" and prefill.decode_kv_addr == "10.0.0.1:9000"
    assert isinstance(decode, DecodeJob) and decode.n_prompt_tokens == 3


def test_a_colocated_instance_gets_only_the_prefill_job():
    placement = Placement(request_id="r1", prefill_id="c0", decode_id="c0", decode_kv_addr="")
    submits = jobs("r1", placement, [1, 2], SamplingParams(max_tokens=4))
    assert [(role, instance) for role, instance, _ in submits] == [("prefill", "c0")]


def test_the_decode_waits_for_kv_three_times_the_predicted_ttft_and_at_least_30_s():
    def waited(predicted_ttft_s: float) -> float:
        placement = Placement(request_id="r1", prefill_id="p0", decode_id="d0", decode_kv_addr="a:1",
                              predicted_ttft_s=predicted_ttft_s)
        decode = jobs("r1", placement, [1, 2, 3], SamplingParams(max_tokens=4))[1][2]
        assert isinstance(decode, DecodeJob)
        return decode.kv_wait_s

    assert waited(0.5) == 30.0
    assert waited(25.0) == 75.0
