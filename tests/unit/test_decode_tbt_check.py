"""The decode instance's TBT double-check (Mooncake §3 step 4, §7): the pure check, the decode engine's
`check_tbt`/`reject_kv` verbs on a real tiny model, the service's sink, the simulator sharing the check,
the engine settings, and the gateway's mapping of the 429 it ends a request with."""

from __future__ import annotations

import asyncio
import collections
import json
import types

import pytest

from factories import decode_job, make_pool, make_runner
from kvc_decode.service import TBT_REJECTIONS, CheckedDecodeSink
from kvc_gateway.relay import Job, pieces
from kvc_gateway.textstream import TextStream
from kvcentric.core.openai_api import parse_completion
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.config import ConfigError
from kvcentric.core.costmodel import CostModel, TBTVerdict, decode_tbt_check
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.cores.decode import DecodeEngine, KVRejected
from kvcentric.engine.service.intake import JobIntake
from kvcentric.engine.service.node import Wakeup
from kvcentric.engine.service.spans import RequestSpans
from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import TokenChunk
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.sim.cluster import ClusterSpec, Simulation
from kvcentric.core.sim.metrics import Record
from kvcentric.core.sim.workload import SimRequest

STEP = CostModel((0.0, 0.0, 0.0, 0.0), (0.01, 0.001, 1e-5), 1024)
"""A decode step lasts 10 ms + 1 ms per sequence + 10 µs per context token."""
PER_SEQUENCE = CostModel((0.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0), 1024)
"""A decode step lasts one second per sequence in the batch."""


# ---------------------------------------------------------------- the pure check


def test_the_prediction_counts_the_newcomer_in_the_batch_and_its_context():
    verdict = decode_tbt_check(STEP, batch=3, kv_tokens=1000, new_tokens=100, slo_s=1.0)
    assert verdict.predicted_s == pytest.approx(0.01 + 0.001 * 4 + 1e-5 * 1100)
    assert verdict.accepted and verdict.slo_s == 1.0


def test_a_request_is_rejected_when_the_predicted_step_exceeds_the_slo_and_accepted_at_it():
    predicted = STEP.t_decode(4, 1100)
    assert decode_tbt_check(STEP, 3, 1000, 100, predicted).accepted
    rejected = decode_tbt_check(STEP, 3, 1000, 100, predicted * 0.99)
    assert not rejected.accepted
    assert "rejected by decode for TBT" in rejected.reason
    assert f"{predicted:.3g} s" in rejected.reason and f"{predicted * 0.99:.3g} s" in rejected.reason


def test_an_slo_of_zero_turns_the_check_off():
    assert decode_tbt_check(STEP, 10_000, 10**9, 10**6, 0.0).accepted


# ---------------------------------------------------------------- the simulator runs the same check


def sim_with_one_decode(tbt_slo_s: float) -> Simulation:
    scheduler = SchedulerConfig(rejection="none", tbt_slo_s=tbt_slo_s, ttft_slo_s=1000.0)
    return Simulation(scheduler, STEP, ClusterSpec(prefill=1, decode=1))


def sim_record(input_len: int) -> Record:
    return Record(SimRequest("r", 0.0, input_len, 8, []))


@pytest.mark.parametrize("margin, accepted", [(1.01, True), (0.99, False)])
def test_the_simulated_decode_accepts_exactly_when_the_shared_check_does(margin, accepted):
    predicted = decode_tbt_check(STEP, 0, 0, 501, 1.0).predicted_s
    sim = sim_with_one_decode(predicted * margin)
    record = sim_record(500)
    assert sim.decode_accepts(sim.decodes["d0"], record, 0.0) is accepted
    assert record.reason == ("" if accepted else "decode_tbt")


# ---------------------------------------------------------------- the decode engine


def arrived(engine: DecodeEngine, request_id: str, n_prompt: int = 4) -> None:
    """A request whose every layer has arrived (the KV bytes themselves do not matter here)."""
    engine.add(decode_job(request_id, n_prompt), 0.0)
    engine.begin_kv(request_id, n_prompt, engine.runner.config.num_layers, [256] + [1] * (n_prompt - 1))
    engine.requests[request_id].layer_tokens = [n_prompt] * engine.runner.config.num_layers


def make_engine(cost: CostModel | None = PER_SEQUENCE, tbt_slo_s: float = 1.5) -> DecodeEngine:
    runner = make_runner()
    return DecodeEngine(runner, make_pool(runner), cost=cost, tbt_slo_s=tbt_slo_s)


def test_the_engine_accepts_while_the_batch_keeps_the_slo_and_rejects_the_request_that_would_break_it():
    engine = make_engine()
    arrived(engine, "a")
    first = engine.check_tbt("a")
    assert first.accepted and first.predicted_s == pytest.approx(1.0)  # alone in the batch
    engine.commit_kv("a", 5)
    arrived(engine, "b")
    blocks_of_b = len(engine.requests["b"].blocks)
    free_before = engine.pool.num_free
    verdict = engine.check_tbt("b")
    assert not verdict.accepted and verdict.predicted_s == pytest.approx(2.0)
    chunk = engine.reject_kv("b", verdict)
    assert (chunk.finish_reason, chunk.error_status, chunk.token_ids) == ("error", 429, [])
    assert "rejected by decode for TBT" in chunk.error and "b" not in engine.requests
    assert engine.pool.num_free == free_before + blocks_of_b  # freed at once
    assert engine.stats["requests_rejected_tbt"] == 1
    engine.abort("a", "abort")
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_engine_predicts_over_the_context_of_every_request_with_its_kv_here():
    engine = make_engine(STEP, tbt_slo_s=10.0)
    arrived(engine, "a", n_prompt=6)
    engine.commit_kv("a", 5)  # context 6 + 1
    arrived(engine, "b", n_prompt=4)  # its KV is here but it has not joined: not in the batch yet
    arrived(engine, "c", n_prompt=3)
    assert engine.check_tbt("c").predicted_s == pytest.approx(STEP.t_decode(2, 7 + 4))


def test_a_request_with_layers_missing_is_neither_checked_nor_rejected():
    engine = make_engine()
    arrived(engine, "a")
    engine.requests["a"].layer_tokens[0] = 1
    with pytest.raises(KVRejected, match="incomplete"):
        engine.check_tbt("a")
    with pytest.raises(KVRejected, match="incomplete"):
        engine.reject_kv("a", TBTVerdict(False, 2.0, 1.0))


def test_without_an_slo_every_request_is_accepted_and_no_cost_model_is_needed():
    engine = make_engine(cost=None, tbt_slo_s=0.0)
    for rid in ("a", "b", "c"):
        arrived(engine, rid)
        assert engine.check_tbt(rid).accepted
        engine.commit_kv(rid, 5)


def test_an_slo_without_a_cost_model_is_refused():
    with pytest.raises(ValueError, match="cost model"):
        make_engine(cost=None, tbt_slo_s=0.1)


# ---------------------------------------------------------------- the decode service's sink


def make_sink(tbt_slo_s: float):
    """The sink, its engine, the intake whose counters it counts in, and the chunks it emitted."""
    engine = make_engine(tbt_slo_s=tbt_slo_s)
    emitted: list[TokenChunk] = []
    intake = JobIntake(collections.Counter())
    sink = CheckedDecodeSink(engine, intake.counters, intake, RequestSpans(), emitted.extend, Wakeup())
    return sink, engine, intake, emitted


def test_the_sink_rejects_after_prefill_with_429_counts_it_and_frees_the_blocks():
    sink, engine, intake, emitted = make_sink(tbt_slo_s=0.5)  # even a batch of one is over
    arrived(engine, "r")
    sink.commit("r", types.SimpleNamespace(first_token=5, extras=b""))
    [chunk] = emitted
    assert chunk.finish_reason == "error" and chunk.error_status == 429 and chunk.token_ids == []
    assert intake.counters[TBT_REJECTIONS] == 1 and TBT_REJECTIONS == 'rejections_total{reason="tbt"}'
    assert not engine.requests and engine.pool.num_free == engine.pool.num_blocks


def test_the_sink_lets_a_request_within_the_slo_join_the_batch():
    sink, engine, intake, emitted = make_sink(tbt_slo_s=1.5)
    arrived(engine, "r")
    sink.commit("r", types.SimpleNamespace(first_token=5, extras=b""))
    assert [c.token_ids for c in emitted] == [[5]] and emitted[0].finish_reason is None
    assert engine.requests["r"].state == "running" and not intake.counters[TBT_REJECTIONS]


# ---------------------------------------------------------------- settings


def engine_config(**settings) -> EngineConfig:
    return EngineConfig(**settings)


def test_the_check_is_on_by_default_at_5x_the_unloaded_step_and_the_roofline_of_the_model_predicts_steps():
    config = engine_config()
    assert (config.tbt_slo_s, config.tbt_slo_factor, config.tbt_check) == (0.0, 5.0, True)  # relative (issue 48)
    assert not engine_config(tbt_slo_factor=0.0).tbt_check and engine_config(tbt_slo_s=0.1).tbt_slo_s == 0.1
    assert config.cost_model().source == "roofline:tiny@cpu-2core"


def test_a_relative_slo_never_refuses_a_request_alone_and_refuses_one_past_5x_its_unloaded_step():
    runner = make_runner()
    engine = DecodeEngine(runner, make_pool(runner), cost=PER_SEQUENCE, tbt_slo_factor=5.0)  # 1 s a sequence
    for index in range(5):
        arrived(engine, f"r{index}")
        verdict = engine.check_tbt(f"r{index}")
        assert verdict.accepted and verdict.slo_s == pytest.approx(5.0), index  # 5 x its unloaded 1 s step
        engine.commit_kv(f"r{index}", 5)
    arrived(engine, "sixth")
    assert not engine.check_tbt("sixth").accepted  # 6 s with it in the batch


def test_a_profile_file_gives_the_cost_model(tmp_path):
    path = tmp_path / "profile.json"
    STEP.save(path, hardware="test")
    assert engine_config(tbt_slo_s=0.05, profile=str(path)).cost_model() == STEP


@pytest.mark.parametrize("settings, flag", [
    ({"tbt_slo_s": -0.1}, "--tbt-slo-s"),
    ({"tbt_slo_s": float("nan")}, "--tbt-slo-s"),
    ({"hardware": "abacus"}, "--hardware"),
    ({"profile": "/nonexistent/profile.json"}, "--profile"),
    ({"device": "gpu0"}, "--device"),
])
def test_bad_settings_are_refused_naming_the_flag(settings, flag):
    with pytest.raises(ConfigError, match=flag):
        engine_config(**settings)


def test_a_file_that_is_not_a_cost_model_is_refused_as_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"prefill": [1, 2]}))
    with pytest.raises(ConfigError, match="--profile"):
        engine_config(profile=str(path))


# ---------------------------------------------------------------- the gateway's answer


@pytest.mark.parametrize("status, kind", [(429, "rate_limit_exceeded"), (503, "service_unavailable"),
                                          (500, "server_error")])
def test_an_engine_error_chunk_becomes_the_api_error_of_its_status(status, kind):
    async def chunks():
        yield TokenChunk.failed("r", "rejected by decode for TBT", prompt_tokens=4, status=status)

    async def relay():
        job = Job("r", parse_completion({"prompt": [1, 2, 3, 4]}, "tiny", 258), [1, 2, 3, 4], False, 0.0)
        async for _ in pieces(job, chunks(), lambda: TextStream(ByteTokenizer().stream_decoder()), lambda gap: None):
            pass

    with pytest.raises(ApiError) as raised:
        asyncio.run(relay())
    assert (raised.value.status, raised.value.kind) == (status, kind)
