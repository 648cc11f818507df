"""How the fault suite's load harness judges answers and draws its figures (no servers): what counts as a
clean refusal, as hung, and how many seconds the cluster took to recover."""

from __future__ import annotations

from load import Answer, figures, recovery

ERROR = {"message": "try later", "type": "service_unavailable", "param": None, "code": None}


def answer(started: float, ok: bool = True, **fields) -> Answer:
    defaults = {"ended": started + 1.0, "status": 200, "done": ok, "longest_wait_s": 0.5}
    return Answer(started=started, **{**defaults, **fields})


def test_a_refusal_is_clean_only_as_a_429_or_503_with_retry_after_in_openais_shape():
    assert answer(0, ok=False, status=503, error=ERROR, shaped=True, retry_after="1").clean_refusal
    assert not answer(0, ok=False, status=503, error=ERROR, shaped=True).clean_refusal  # no Retry-After
    assert not answer(0, ok=False, status=500, error={**ERROR, "type": "server_error"}, shaped=True,
                      retry_after="1").clean_refusal
    assert not answer(0, ok=False, status=503, error={"message": "x"}, shaped=False, retry_after="1").clean_refusal
    assert not answer(0, ok=False, status=429, error=ERROR, shaped=True, retry_after="1").clean_refusal  # wrong type
    in_stream = answer(0, ok=False, status=200, error=ERROR, shaped=True, in_stream=True)
    assert in_stream.clean_refusal and not in_stream.ok


def test_every_request_falls_in_one_figure_and_a_long_wait_is_hung_whatever_its_end():
    answers = [answer(0), answer(1, longest_wait_s=9.0),
               answer(2, ok=False, status=503, error=ERROR, shaped=True, retry_after="1"),
               answer(3, ok=False, status=500, error=ERROR, shaped=True), answer(4, ended=0.0)]
    figured, wrong = figures("f", answers, fault_end=2.5, bound_s=6.5, in_flight_at_fault=1)
    assert (figured.sent, figured.completed, figured.hung, figured.failed_cleanly, figured.failed_otherwise) == \
        (5, 1, 2, 1, 1)
    assert [brief["status"] for brief in wrong["failed otherwise"]] == [500]


def test_recovery_is_when_the_last_run_of_successes_after_the_fault_began():
    failed = {"ok": False, "status": 503}
    assert recovery([answer(0, **failed), answer(5), answer(6)], fault_end=4.0) == 0.0
    assert recovery([answer(4.5, **failed), answer(5), answer(5.5, **failed), answer(7), answer(8)],
                    fault_end=4.0) == 3.0
    assert recovery([answer(5), answer(6, **failed)], fault_end=4.0) is None
