import argparse

import pytest

from kvcentric.config import BusConfig, ConfigError, add_arguments, from_namespace
from kvcentric.engine.config import EngineConfig
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.core.protocol import (BadMessage, Placement, Rejection, ScheduleReply, ScheduleRequest, TokenChunk,
                                decode, encode)


def test_messages_round_trip_and_unions_pick_the_tagged_type():
    placement = Placement(request_id="r", prefill_id="p0", decode_id="d0", decode_kv_addr="127.0.0.1:1")
    assert decode(encode(placement), ScheduleReply) == placement
    rejection = Rejection.overloaded("r", "busy", retry_after_s=2.0)
    assert decode(encode(rejection), ScheduleReply) == rejection


@pytest.mark.parametrize("data", [b"", b"\xc1", encode(TokenChunk(request_id="r", seq=0, token_ids=[1]))])
def test_bytes_that_do_not_fit_the_schema_raise_bad_message(data):
    with pytest.raises(BadMessage):
        decode(data, ScheduleRequest)


def parse(cls, argv, monkeypatch=None, env=None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return from_namespace(cls, parser.parse_args(argv))


def test_flags_beat_environment_variables_which_beat_defaults(monkeypatch):
    assert parse(BusConfig, []).nats_url == "nats://127.0.0.1:4222"
    config = parse(BusConfig, [], monkeypatch, {"KVC_NATS_URL": "nats://10.0.0.1:4222", "KVC_CLUSTER": "dc2"})
    assert config.nats_url == "nats://10.0.0.1:4222" and config.cluster == "dc2"
    assert parse(BusConfig, ["--cluster", "dc3"]).cluster == "dc3"


def test_bad_settings_name_the_flag():
    with pytest.raises(ConfigError, match="--nats-url"):
        parse(BusConfig, ["--nats-url", "localhost:4222"])
    with pytest.raises(ConfigError, match="--model"):
        parse(EngineConfig, ["--model", "gpt-17"])
    with pytest.raises(ConfigError, match="--instance-id"):
        parse(BusConfig, ["--instance-id", "a.b"])


def test_byte_tokenizer_round_trips_text_and_streams_split_characters():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo ✓")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == "héllo ✓"
    stream = tokenizer.stream_decoder()
    pieces = [stream.feed([t]) for t in ids[1:]]
    assert "".join(pieces) + stream.flush() == "héllo ✓"
    assert "" in pieces  # the multi-byte characters waited for their last byte
