"""Our hand-written KVChunk wire form is byte-identical to protobuf's, both ways."""

import pytest

from kvcentric.runtime import kvwire
from kvcentric.proto import kv_pb2


@pytest.mark.parametrize("fields", [
    dict(layer=3, token_start=16, token_end=48, key=b"k" * 300, value=b"v" * 300, checksum=123456789),
    dict(layer=0, token_start=0, token_end=1, key=b"\x00" * 70000, value=b"\x01" * 70000, checksum=0),
    dict(layer=0, token_start=0, token_end=0, key=b"", value=b"", checksum=1),
])
def test_layer_chunks_encode_exactly_as_protobuf_and_decode_back(fields):
    generated = kv_pb2.KVChunk(layer=kv_pb2.LayerChunk(**fields)).SerializeToString()
    ours = kvwire.encode(kvwire.LayerData(**fields))
    assert ours == generated
    decoded = kvwire.decode(generated)
    assert isinstance(decoded, kvwire.LayerData)
    assert (decoded.layer, decoded.token_start, decoded.token_end, decoded.checksum) == \
        (fields["layer"], fields["token_start"], fields["token_end"], fields["checksum"])
    assert bytes(decoded.key) == fields["key"] and bytes(decoded.value) == fields["value"]


def test_headers_and_commits_round_trip():
    header = kv_pb2.KVHeader(request_id="r", num_layers=4, num_tokens=9, dtype="float32", token_ids=[1, 2, 3])
    assert kvwire.encode(header) == kv_pb2.KVChunk(header=header).SerializeToString()
    assert kvwire.decode(kvwire.encode(header)) == header
    commit = kv_pb2.KVCommit(first_token=5, total_bytes=10)
    assert kvwire.decode(kv_pb2.KVChunk(commit=commit).SerializeToString()) == commit


@pytest.mark.parametrize("data", [b"", b"\x12", b"\x12\x05ab", b"\x08\x01", b"\x42\x00"])
def test_malformed_chunks_raise_value_error(data):
    with pytest.raises(ValueError):
        kvwire.decode(data)
