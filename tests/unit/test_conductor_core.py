from factories import load_report
from kvcentric.protocol import Placement, Rejection, ScheduleRequest
from kvcentric.scheduling.conductor import Conductor
from kvcentric.scheduling.registry import InstanceRegistry


def request(n_tokens=100, request_id="r"):
    return ScheduleRequest(request_id, n_tokens, [], 16)


def conductor_with(*reports, now=0.0):
    registry = InstanceRegistry(stale_after_s=1.0)
    for report in reports:
        registry.observe(report, now)
    return Conductor(registry)


def test_no_engines_gives_a_no_instance_rejection_naming_the_missing_role():
    decision = conductor_with(load_report("p0", "prefill")).schedule(request(), now=0.0)
    assert isinstance(decision, Rejection)
    assert decision.reason == "no_instance" and "decode" in decision.message


def test_least_loaded_prefill_and_decode_are_chosen():
    conductor = conductor_with(load_report("p0", "prefill", queued_tokens=500), load_report("p1", "prefill"),
                               load_report("d0", "decode", running=3), load_report("d1", "decode", running=1))
    decision = conductor.schedule(request(), now=0.1)
    assert isinstance(decision, Placement)
    assert (decision.prefill_id, decision.decode_id) == ("p1", "d1")
    assert decision.decode_kv_addr == load_report("d1", "decode").kv_addr


def test_dispatches_since_the_last_report_count_as_load():
    conductor = conductor_with(load_report("p0", "prefill"), load_report("p1", "prefill"),
                               load_report("d0", "decode"))
    first = conductor.schedule(request(1000, "a"), now=0.1)
    second = conductor.schedule(request(1000, "b"), now=0.1)
    assert {first.prefill_id, second.prefill_id} == {"p0", "p1"}


def test_a_new_report_replaces_dispatch_estimates():
    registry = InstanceRegistry()
    registry.observe(load_report("p0", "prefill"), 0.0)
    registry.note_dispatch("p0", 300)
    assert registry.instances["p0"].prefill_load == 300
    registry.observe(load_report("p0", "prefill", queued_tokens=120), 0.1)
    assert registry.instances["p0"].prefill_load == 120


def test_instances_without_recent_reports_are_not_placed():
    conductor = conductor_with(load_report("p0", "prefill"), load_report("d0", "decode"), now=0.0)
    assert isinstance(conductor.schedule(request(), now=0.5), Placement)
    assert isinstance(conductor.schedule(request(), now=5.0), Rejection)
    assert conductor.registry.snapshot(5.0) == []
