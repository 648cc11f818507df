"""The KV transport of a link (`--kv-transport`), chosen from what each side advertises of itself: auto picks
cuda-ipc, shm, mooncake or grpc from the facts; a transport asked for by name that the link cannot use falls
back to grpc with the reason."""

import pytest

from kvcentric.core.kvlinks import Endpoint, choose

HOST_A, HOST_B = "boot-1@node-a", "boot-2@node-b"
CPU_A = Endpoint(HOST_A, (), ("grpc", "shm"))


@pytest.mark.parametrize("peer, transport", [
    (Endpoint(HOST_A, (), ("grpc", "shm")), "shm"),
    (Endpoint(HOST_B, (), ("grpc", "shm")), "grpc"),
    (Endpoint("", (), ("grpc", "shm")), "grpc"),
    (Endpoint(HOST_A, (), ("grpc",)), "grpc"),
])
def test_auto_shares_memory_only_with_a_peer_that_advertises_this_host(peer, transport):
    assert choose("auto", CPU_A, peer).transport == transport


def test_auto_picks_cuda_ipc_for_a_peer_on_this_hosts_gpus_that_takes_it_and_else_shm():
    here = Endpoint(HOST_A, ("GPU-0",), ("grpc", "shm", "cuda-ipc"))
    assert choose("auto", here, Endpoint(HOST_A, ("GPU-1",), ("grpc", "shm", "cuda-ipc"))).transport == "cuda-ipc"
    assert choose("auto", here, Endpoint(HOST_A, (), ("grpc", "shm", "cuda-ipc"))).transport == "shm"
    assert choose("auto", here, Endpoint(HOST_A, ("GPU-1",), ("grpc", "shm"))).transport == "shm"


def test_auto_takes_mooncake_across_hosts_only_when_both_sides_have_it():
    here = Endpoint(HOST_A, (), ("grpc", "shm", "mooncake"))
    assert choose("auto", here, Endpoint(HOST_B, (), ("grpc", "shm", "mooncake"))).transport == "mooncake"
    assert choose("auto", CPU_A, Endpoint(HOST_B, (), ("grpc", "shm", "mooncake"))).transport == "grpc"
    assert choose("auto", here, Endpoint(HOST_A, (), ("grpc", "shm", "mooncake"))).transport == "shm"


def test_a_transport_asked_for_that_the_link_cannot_use_falls_back_to_grpc_saying_why():
    other = Endpoint(HOST_B, (), ("grpc", "shm"))
    choice = choose("shm", CPU_A, other)
    assert (choice.transport, choice.reason) == ("grpc", "shm asked for, but the peer is on another host")
    assert choose("cuda-ipc", CPU_A, Endpoint(HOST_A, (), ("grpc", "shm"))).reason == \
        "cuda-ipc asked for, but the peer does not take cuda-ipc pushes"
    assert choose("mooncake", CPU_A, Endpoint(HOST_B, (), ("grpc", "mooncake"))).reason == \
        "mooncake asked for, but this engine cannot send over mooncake"
    assert choose("shm", CPU_A, Endpoint(HOST_A, (), ("grpc", "shm"))).transport == "shm"
    assert choose("grpc", CPU_A, Endpoint(HOST_A, (), ("grpc", "shm"))).transport == "grpc"


def test_a_peer_that_said_nothing_gets_grpc_and_an_unknown_transport_is_refused():
    assert choose("shm", CPU_A, None).transport == "grpc"
    with pytest.raises(ValueError, match="unknown KV transport"):
        choose("rdma", CPU_A, CPU_A)
