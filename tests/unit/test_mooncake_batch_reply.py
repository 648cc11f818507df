"""kvs-meta's `GET /batch_query_keys` body in the shape of Mooncake's master: `{"success": true, "data":
{key: {"ok": true, "values": [replica descriptor]} | {"ok": false, "error": "OBJECT_NOT_FOUND"}}}`, each
replica descriptor with the master's `size_`, `buffer_address_`, `protocol_` and `transport_endpoint_`."""

from kvcentric.runtime.kvs_store import mooncake_batch_reply


def test_holders_become_replica_descriptors_and_a_missing_key_is_object_not_found():
    endpoints = {"prefill-0": ("10.0.0.5:7001", 262144)}
    body = mooncake_batch_reply(["k1", "k2"], [["prefill-0:dram", "prefill-0:device"], []], endpoints)
    assert body["success"] is True
    assert body["data"]["k2"] == {"ok": False, "error": "OBJECT_NOT_FOUND"}
    first, second = body["data"]["k1"]["values"]
    assert first == {"size_": 262144, "buffer_address_": 0, "protocol_": "grpc",
                     "transport_endpoint_": "10.0.0.5:7001", "node_id": "prefill-0", "tier": "dram"}
    assert second["tier"] == "device" and body["data"]["k1"]["ok"] is True


def test_a_holder_not_heard_from_yet_has_no_endpoint_or_size():
    body = mooncake_batch_reply(["k"], [["node:with:colons:dram"]])
    assert body["data"]["k"]["values"] == [{"size_": 0, "buffer_address_": 0, "protocol_": "grpc",
                                            "transport_endpoint_": "", "node_id": "node:with:colons",
                                            "tier": "dram"}]
