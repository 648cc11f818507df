"""How a layer is placed in a push's segment (and kept inline when it does not
fit), that a shared-memory layer chunk is protobuf's own encoding, and the deadline of a computed push."""

from kvcentric.proto import kv_pb2
from kvcentric.runtime import kvwire
from kvcentric.runtime.shm import AttachedSegments, SegmentPool, SegmentWriter, push_bytes, segment_prefix
from kvcentric.runtime.transfer import DRAIN_FLOOR_S, drain_deadline_s


def test_a_segment_is_named_after_the_process_that_made_it():
    pool = SegmentPool()
    segment = pool.acquire(10)
    try:
        assert segment.name.startswith(segment_prefix())
    finally:
        pool.release(segment)
        pool.close()


def test_layers_go_into_the_segment_one_after_another_and_read_back_from_another_mapping():
    pool, attached = SegmentPool(), AttachedSegments()
    header = kv_pb2.KVHeader(num_layers=2, num_tokens=3, num_kv_heads=1, head_dim=2, dtype="float16")
    assert push_bytes(header) == 2 * 3 * 2 * 1 * 2 * 2
    segment = pool.acquire(push_bytes(header))
    try:
        writer = SegmentWriter(segment)
        first = writer.put(kvwire.LayerData(0, 0, 3, b"k" * 12, b"v" * 12, 7))
        second = writer.put(kvwire.LayerData(1, 0, 3, b"K" * 12, b"V" * 12, 8))
        assert (first.key, first.shm_offset, first.shm_bytes, second.shm_offset) == (b"", 0, 12, 24)
        read = attached.resolve(segment.name, kvwire.decode(kvwire.encode(second)))
        assert (bytes(read.key), bytes(read.value), read.checksum, read.nbytes) == (b"K" * 12, b"V" * 12, 8, 24)
        too_big = kvwire.LayerData(2, 0, 1, b"x" * segment.size, b"y" * segment.size, 9)
        assert writer.put(too_big) is too_big  # sent inline
        del read
    finally:
        attached.close()
        pool.release(segment)
        pool.close()


def test_a_shared_memory_layer_chunk_is_encoded_as_protobuf_would():
    layer = kvwire.LayerData(3, 16, 32, b"", b"", 12345, shm_offset=1 << 33, shm_bytes=4096)
    generated = kv_pb2.KVChunk(layer=kv_pb2.LayerChunk(layer=3, token_start=16, token_end=32, checksum=12345,
                                                       shm_offset=1 << 33, shm_bytes=4096))
    assert kvwire.encode(layer) == generated.SerializeToString()
    assert kvwire.decode(generated.SerializeToString()) == layer


def test_a_computed_push_gets_seconds_from_its_bytes_and_the_measured_bandwidth():
    assert drain_deadline_s(0, None) == DRAIN_FLOOR_S
    assert drain_deadline_s(1_000_000_000, 1e9) == DRAIN_FLOOR_S + 4.0
    assert drain_deadline_s(1_000_000_000, None) > drain_deadline_s(1_000_000_000, 1e9)  # unmeasured: the prior
