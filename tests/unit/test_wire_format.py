"""The bytes each message puts on the wire, pinned: a peer built from older code must still read them."""

import pytest

from kvcentric.core.protocol import (BlockEvicted, BlockStored, Cancel, DecodeJob, Dispatch, InstanceInfo,
                                     InstancesQuery, InstancesReply, KVEventBatch, KVSDump, KVSDumpQuery, KVSQuery,
                                     KVSReply, LoadReport, MeasuredCost, Placement, PrefillJob, Rejection,
                                     RequestOutcome, RoleSwitch, SamplingParams, ScheduleRequest, SubmitAck, TokenChunk,
                                     decode, encode)

S = SamplingParams(max_tokens=4, temperature=0.5, seed=7, stop_token_ids=[2])
MESSAGES = {
    "sampling": SamplingParams(),
    "schedule_request": ScheduleRequest(request_id="r1", n_tokens=100, block_hashes=["h0", "h1"], max_tokens=8,
                                        priority=-1, dispatch=Dispatch(token_ids=[1, 2], sampling=S)),
    "placement": Placement(request_id="r1", prefill_id="p0", decode_id="d0", decode_kv_addr="127.0.0.1:1",
                           cached_tokens=64, predicted_ttft_s=0.25, pull_block_hashes=["h0"], dispatched=True),
    "rejection": Rejection(request_id="r1", reason="overloaded", message="busy", retry_after_s=2.5,
                           stage="prefill", load=1.5),
    "instances_reply": InstancesReply(instances=[InstanceInfo(instance_id="p0", role="prefill", cluster="dc1",
                                                              kv_addr="a:1", load=0.5, age_s=1.0)]),
    "outcome": RequestOutcome(request_id="r1", prefill_id="p0", decode_id="d0", finish_reason="length",
                              ttft_s=0.1, e2e_s=0.5, prompt_tokens=100, completion_tokens=8),
    "instances_query": InstancesQuery(role="decode"),
    "prefill_job": PrefillJob(request_id="r1", token_ids=[1, 2, 3], sampling=S, decode_id="d0",
                              decode_kv_addr="a:1", kv_source_addr="b:2", pull_block_hashes=["h0"]),
    "decode_job": DecodeJob(request_id="r1", n_prompt_tokens=3, sampling=S),
    "submit_ack": SubmitAck(ok=False, error="no KV room"),
    "load_report": LoadReport(instance_id="p0", role="prefill", cluster="dc1", kv_addr="a:1", queued_requests=1,
                              queued_tokens=100, running=2, kv_blocks_total=10, kv_blocks_free=5, ts=12.5,
                              link_bandwidth={"b:2": 1e9}, draining=True),
    "measured_cost": MeasuredCost(decode=[0.005, 0.0, 1e-06], decode_error=0.03, decode_samples=40, model="tiny",
                                  device="cpu", dtype="float32", version=3),
    "role_switch": RoleSwitch(role="decode", reason="replan"),
    "token_chunk": TokenChunk(request_id="r1", seq=3, token_ids=[104, 105]),
    "token_chunk_error": TokenChunk(request_id="r1", seq=0, token_ids=[], finish_reason="error", prompt_tokens=5,
                                    error="refused", error_status=503),
    "cancel": Cancel(request_id="r1"),
    "kv_events": KVEventBatch(events=[BlockStored(node_id="p0", block_hashes=["h0"], tier="device"),
                                      BlockEvicted(node_id="p0", block_hashes=["h1"])]),
    "kvs_query": KVSQuery(block_hashes=["h0"]),
    "kvs_reply": KVSReply(holders=[["p0:dram"]], error=""),
    "kvs_dump_query": KVSDumpQuery(cursor=5),
    "kvs_dump": KVSDump(events=[BlockStored(node_id="p0", block_hashes=["h0"])], cursor=0),
}

PINNED = {
    "sampling": (
        "de0010aa6d61785f746f6b656e7310ab74656d7065726174757265cb0000000000000000a5746f705f70cb3ff0000000"
        "000000a473656564c0ae73746f705f746f6b656e5f69647390aa69676e6f72655f656f73c2a5746f705f6b00a86c6f67"
        "70726f6273c0af70726f6d70745f6c6f6770726f6273c0b270726f6365737365645f6c6f6770726f6273c2b070726573"
        "656e63655f70656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000"
        "b272657065746974696f6e5f70656e616c7479cb3ff0000000000000aa6d696e5f746f6b656e7300aa6c6f6769745f62"
        "69617380a16e01"),
    "schedule_request": (
        "86aa726571756573745f6964a27231a86e5f746f6b656e7364ac626c6f636b5f68617368657392a26830a26831aa6d61"
        "785f746f6b656e7308a87072696f72697479ffa8646973706174636882a9746f6b656e5f696473920102a873616d706c"
        "696e67de0010aa6d61785f746f6b656e7304ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff0"
        "000000000000a47365656407ae73746f705f746f6b656e5f6964739102aa69676e6f72655f656f73c2a5746f705f6b00"
        "a86c6f6770726f6273c0af70726f6d70745f6c6f6770726f6273c0b270726f6365737365645f6c6f6770726f6273c2b0"
        "70726573656e63655f70656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb00000000"
        "00000000b272657065746974696f6e5f70656e616c7479cb3ff0000000000000aa6d696e5f746f6b656e7300aa6c6f67"
        "69745f6269617380a16e01"),
    "placement": (
        "8da474797065a9706c6163656d656e74aa726571756573745f6964a27231aa70726566696c6c5f6964a27030a9646563"
        "6f64655f6964a26430ae6465636f64655f6b765f61646472ab3132372e302e302e313a31ad6361636865645f746f6b65"
        "6e7340b07072656469637465645f747466745f73cb3fd0000000000000af7072656469637465645f7462745f73cb0000"
        "000000000000ac6b765f736f757263655f6964a0ae6b765f736f757263655f61646472a0b170756c6c5f626c6f636b5f"
        "68617368657391a26830aa64697370617463686564c3ae706970656c696e655f616464727390"),
    "rejection": (
        "87a474797065a972656a656374696f6eaa726571756573745f6964a27231a6726561736f6eaa6f7665726c6f61646564"
        "a76d657373616765a462757379ad72657472795f61667465725f73cb4004000000000000a57374616765a77072656669"
        "6c6ca46c6f6164cb3ff8000000000000"),
    "instances_reply": (
        "81a9696e7374616e6365739187ab696e7374616e63655f6964a27030a4726f6c65a770726566696c6ca7636c75737465"
        "72a3646331a76b765f61646472a3613a31a46c6f6164cb3fe0000000000000a56167655f73cb3ff0000000000000a662"
        "7573795f73cb0000000000000000"),
    "outcome": (
        "89aa726571756573745f6964a27231aa70726566696c6c5f6964a27030a96465636f64655f6964a26430ad66696e6973"
        "685f726561736f6ea66c656e677468a6747466745f73cb3fb999999999999aa56532655f73cb3fe0000000000000ad70"
        "726f6d70745f746f6b656e7364b1636f6d706c6574696f6e5f746f6b656e7308b07072656469637465645f747466745f"
        "73cb0000000000000000"),
    "instances_query": "81a4726f6c65a66465636f6465",
    "prefill_job": (
        "88aa726571756573745f6964a27231a9746f6b656e5f69647393010203a873616d706c696e67de0010aa6d61785f746f"
        "6b656e7304ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff0000000000000a47365656407ae"
        "73746f705f746f6b656e5f6964739102aa69676e6f72655f656f73c2a5746f705f6b00a86c6f6770726f6273c0af7072"
        "6f6d70745f6c6f6770726f6273c0b270726f6365737365645f6c6f6770726f6273c2b070726573656e63655f70656e61"
        "6c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000b27265706574697469"
        "6f6e5f70656e616c7479cb3ff0000000000000aa6d696e5f746f6b656e7300aa6c6f6769745f6269617380a16e01a964"
        "65636f64655f6964a26430ae6465636f64655f6b765f61646472a3613a31ae6b765f736f757263655f61646472a3623a"
        "32b170756c6c5f626c6f636b5f68617368657391a26830ae706970656c696e655f616464727390"),
    "decode_job": (
        "84aa726571756573745f6964a27231af6e5f70726f6d70745f746f6b656e7303a873616d706c696e67de0010aa6d6178"
        "5f746f6b656e7304ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff0000000000000a4736565"
        "6407ae73746f705f746f6b656e5f6964739102aa69676e6f72655f656f73c2a5746f705f6b00a86c6f6770726f6273c0"
        "af70726f6d70745f6c6f6770726f6273c0b270726f6365737365645f6c6f6770726f6273c2b070726573656e63655f70"
        "656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000b27265706574"
        "6974696f6e5f70656e616c7479cb3ff0000000000000aa6d696e5f746f6b656e7300aa6c6f6769745f6269617380a16e"
        "01a96b765f776169745f73cb403e000000000000"),
    "submit_ack": "82a26f6bc2a56572726f72aa6e6f204b5620726f6f6d",
    "load_report": (
        "de0016ab696e7374616e63655f6964a27030a4726f6c65a770726566696c6ca7636c7573746572a3646331a76b765f61"
        "646472a3613a31af7175657565645f726571756573747301ad7175657565645f746f6b656e7364a772756e6e696e6702"
        "af6b765f626c6f636b735f746f74616c0aae6b765f626c6f636b735f6672656505a27473cb4029000000000000ab6573"
        "745f71756575655f73cbbff0000000000000ae6c696e6b5f62616e64776964746881a3623a32cb41cdcd6500000000ad"
        "6b765f62797465735f73656e7400a8647261696e696e67c3a373657100a6726570656174c2aa6c6f61645f6167655f73"
        "cb0000000000000000a4636f7374c0b66b765f73746167696e675f626c6f636b735f6672656500ae706970656c696e65"
        "5f67726f7570a0a5737461676500a673746167657301"),
    "measured_cost": (
        "8ea770726566696c6c90a66465636f646593cb3f747ae147ae147bcb0000000000000000cb3eb0c6f7a0b5ed8dad7072"
        "6566696c6c5f6572726f72cbbff0000000000000ac6465636f64655f6572726f72cb3f9eb851eb851eb8af7072656669"
        "6c6c5f73616d706c657300ae6465636f64655f73616d706c657328ac6c6173745f70726566696c6c90ab6c6173745f64"
        "65636f646590ad70726566696c6c5f6368756e6b00b26b765f62797465735f7065725f746f6b656e00a56d6f64656ca4"
        "74696e79a6646576696365a3637075a56474797065a7666c6f61743332a776657273696f6e03"),
    "role_switch": "82a4726f6c65a66465636f6465a6726561736f6ea67265706c616e",
    "token_chunk": (
        "8baa726571756573745f6964a27231a373657103a9746f6b656e5f696473926869ad66696e6973685f726561736f6ec0"
        "ad70726f6d70745f746f6b656e7300b1636f6d706c6574696f6e5f746f6b656e7300a56572726f72a0ac6572726f725f"
        "737461747573cd01f4a86c6f6770726f627390af70726f6d70745f6c6f6770726f627390a5696e64657800"),
    "token_chunk_error": (
        "8baa726571756573745f6964a27231a373657100a9746f6b656e5f69647390ad66696e6973685f726561736f6ea56572"
        "726f72ad70726f6d70745f746f6b656e7305b1636f6d706c6574696f6e5f746f6b656e7300a56572726f72a772656675"
        "736564ac6572726f725f737461747573cd01f7a86c6f6770726f627390af70726f6d70745f6c6f6770726f627390a569"
        "6e64657800"),
    "cancel": "82aa726571756573745f6964a27231a6726561736f6eb3636c69656e7420646973636f6e6e6563746564",
    "kv_events": (
        "81a66576656e74739284a474797065a673746f726564a76e6f64655f6964a27030ac626c6f636b5f68617368657391a2"
        "6830a474696572a664657669636584a474797065a765766963746564a76e6f64655f6964a27030ac626c6f636b5f6861"
        "7368657391a26831a474696572a46472616d"),
    "kvs_query": "81ac626c6f636b5f68617368657391a26830",
    "kvs_reply": "82a7686f6c646572739191a770303a6472616da56572726f72a0",
    "kvs_dump_query": "82a6637572736f7205a5636f756e74cd07d0",
    "kvs_dump": (
        "82a66576656e74739184a474797065a673746f726564a76e6f64655f6964a27030ac626c6f636b5f68617368657391a2"
        "6830a474696572a46472616da6637572736f7200"),
}

BEFORE_HEARTBEATS = {
    # The bytes of an engine and a conductor from before the heartbeat fields (seq, repeat, load_age_s; busy_s).
    "instances_reply": (
        "81a9696e7374616e6365739186ab696e7374616e63655f6964a27030a4726f6c65a770726566696c6ca7636c75737465"
        "72a3646331a76b765f61646472a3613a31a46c6f6164cb3fe0000000000000a56167655f73cb3ff0000000000000"),
    "load_report": (
        "8eab696e7374616e63655f6964a27030a4726f6c65a770726566696c6ca7636c7573746572a3646331a76b765f616464"
        "72a3613a31af7175657565645f726571756573747301ad7175657565645f746f6b656e7364a772756e6e696e6702af6b"
        "765f626c6f636b735f746f74616c0aae6b765f626c6f636b735f6672656505a27473cb4029000000000000ab6573745f"
        "71756575655f73cbbff0000000000000ae6c696e6b5f62616e64776964746881a3623a32cb41cdcd6500000000ad6b76"
        "5f62797465735f73656e7400a8647261696e696e67c3"),
}


@pytest.mark.parametrize("name", sorted(BEFORE_HEARTBEATS))
def test_bytes_from_before_the_heartbeat_fields_still_decode_to_the_same_message(name):
    message = MESSAGES[name]
    assert decode(bytes.fromhex(BEFORE_HEARTBEATS[name]), type(message)) == message


PINNED_BEFORE_LOGPROBS = {
    "decode_job": (
        "84aa726571756573745f6964a27231af6e5f70726f6d70745f746f6b656e7303a873616d706c696e6787aa6d61785f74"
        "6f6b656e7304ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff0000000000000a47365656407"
        "ae73746f705f746f6b656e5f6964739102aa69676e6f72655f656f73c2a5746f705f6b00a96b765f776169745f73cb40"
        "3e000000000000"),
    "prefill_job": (
        "87aa726571756573745f6964a27231a9746f6b656e5f69647393010203a873616d706c696e6787aa6d61785f746f6b65"
        "6e7304ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff0000000000000a47365656407ae7374"
        "6f705f746f6b656e5f6964739102aa69676e6f72655f656f73c2a5746f705f6b00a96465636f64655f6964a26430ae64"
        "65636f64655f6b765f61646472a3613a31ae6b765f736f757263655f61646472a3623a32b170756c6c5f626c6f636b5f"
        "68617368657391a26830"),
    "sampling": (
        "87aa6d61785f746f6b656e7310ab74656d7065726174757265cb0000000000000000a5746f705f70cb3ff00000000000"
        "00a473656564c0ae73746f705f746f6b656e5f69647390aa69676e6f72655f656f73c2a5746f705f6b00"),
    "schedule_request": (
        "86aa726571756573745f6964a27231a86e5f746f6b656e7364ac626c6f636b5f68617368657392a26830a26831aa6d61"
        "785f746f6b656e7308a87072696f72697479ffa8646973706174636882a9746f6b656e5f696473920102a873616d706c"
        "696e6787aa6d61785f746f6b656e7304ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff00000"
        "00000000a47365656407ae73746f705f746f6b656e5f6964739102aa69676e6f72655f656f73c2a5746f705f6b00"),
    "token_chunk": (
        "88aa726571756573745f6964a27231a373657103a9746f6b656e5f696473926869ad66696e6973685f726561736f6ec0"
        "ad70726f6d70745f746f6b656e7300b1636f6d706c6574696f6e5f746f6b656e7300a56572726f72a0ac6572726f725f"
        "737461747573cd01f4"),
    "token_chunk_error": (
        "88aa726571756573745f6964a27231a373657100a9746f6b656e5f69647390ad66696e6973685f726561736f6ea56572"
        "726f72ad70726f6d70745f746f6b656e7305b1636f6d706c6574696f6e5f746f6b656e7300a56572726f72a772656675"
        "736564ac6572726f725f737461747573cd01f7"),
}
"""What these messages were before the logprob, penalty and n fields: older peers send them, and they still read."""


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_messages_encode_to_the_pinned_bytes_and_decode_back(name):
    message = MESSAGES[name]
    assert encode(message).hex() == PINNED[name]
    assert decode(bytes.fromhex(PINNED[name]), type(message)) == message


def test_named_constructors_build_the_messages_they_name():
    assert encode(TokenChunk.failed("r1", "refused", prompt_tokens=5, status=503)).hex() == PINNED["token_chunk_error"]
    assert TokenChunk.final("r1", "length", seq=1, token_ids=[105], prompt_tokens=3, completion_tokens=2) == \
        TokenChunk(request_id="r1", seq=1, token_ids=[105], finish_reason="length", prompt_tokens=3,
                   completion_tokens=2)
    assert encode(SubmitAck.refused("no KV room")).hex() == PINNED["submit_ack"]
    assert SubmitAck.accepted() == SubmitAck(ok=True, error="")
    assert Rejection.overloaded("r1", "busy", retry_after_s=2.5, stage="prefill", load=1.5) == MESSAGES["rejection"]
    assert Rejection.bad_request("r1", "bad").retry_after_s == 0.0
    assert Rejection.no_instance("r1", "none").reason == "no_instance"


def test_messages_are_built_by_field_name_only():
    with pytest.raises(TypeError):
        TokenChunk("r1", 0, [1])


@pytest.mark.parametrize("name", sorted(PINNED_BEFORE_LOGPROBS))
def test_bytes_from_before_the_sampling_fields_decode_to_the_same_message(name):
    message = MESSAGES[name]
    assert decode(bytes.fromhex(PINNED_BEFORE_LOGPROBS[name]), type(message)) == message
