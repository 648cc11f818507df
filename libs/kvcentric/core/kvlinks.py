"""Which KV transport a link between two engines uses (`--kv-transport`): from the transport asked for and the
facts each side advertises of itself (its host's boot id and name, its GPUs, the transports it takes), a
value naming the transport and why; it reads no files and opens nothing (the runtime gathers the facts).

`auto` picks per link: the same host and a GPU on both sides that the receiver takes CUDA IPC pushes on →
`cuda-ipc`; the same host → `shm`; Mooncake's Transfer Engine on both sides → `mooncake`; else `grpc`. A
transport asked for by name that the link cannot use falls back to `grpc`, and the reason says why.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

KVTransportName = Literal["auto", "grpc", "shm", "cuda-ipc", "mooncake"]
KV_TRANSPORTS: tuple[str, ...] = get_args(KVTransportName)
WIRE_TRANSPORTS = ("grpc", "shm", "cuda-ipc", "mooncake")
"""What a link can use (`auto` is a way of choosing, not a transport)."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What one side of a link says of itself: `host` is its boot id and hostname ("" when unknown), `gpus`
    the UUIDs of the GPUs it computes on, `transports` those it takes pushes over."""

    host: str = ""
    gpus: tuple[str, ...] = ()
    transports: tuple[str, ...] = ("grpc",)

    def takes(self, transport: str) -> bool:
        return transport in self.transports


@dataclasses.dataclass(frozen=True)
class LinkChoice:
    """The transport of one link, and the facts that chose it (logged once, shown in /health)."""

    transport: str
    reason: str


def same_host(here: Endpoint, peer: Endpoint) -> bool:
    """Both sides named their host, and it is the same one (same boot of the same machine)."""
    return bool(here.host) and here.host == peer.host


def possible(transport: str, here: Endpoint, peer: Endpoint) -> str:
    """Why `transport` cannot carry this link ("" when it can)."""
    if transport == "grpc":
        return ""
    if not peer.takes(transport):
        return f"the peer does not take {transport} pushes"
    if not here.takes(transport):
        return f"this engine cannot send over {transport}"
    if transport in ("shm", "cuda-ipc") and not same_host(here, peer):
        return "the peer is on another host" if here.host and peer.host else "the peer's host is unknown"
    if transport == "cuda-ipc" and not (here.gpus and peer.gpus):
        return "one side computes on no GPU"
    return ""


def choose(wanted: str, here: Endpoint, peer: Endpoint | None) -> LinkChoice:
    """The transport for a push from `here` to `peer` (None: the peer said nothing of itself)."""
    if wanted not in KV_TRANSPORTS:
        raise ValueError(f"unknown KV transport {wanted!r}: choose one of {', '.join(KV_TRANSPORTS)}")
    if peer is None:
        return LinkChoice("grpc", "the peer advertised nothing of itself")
    if wanted != "auto":
        why_not = possible(wanted, here, peer)
        if why_not:
            return LinkChoice("grpc", f"{wanted} asked for, but {why_not}")
        return LinkChoice(wanted, "asked for")
    for transport, reason in (("cuda-ipc", "same host, GPUs on both sides"), ("shm", "same host"),
                              ("mooncake", "another host, Mooncake's Transfer Engine on both sides")):
        if not possible(transport, here, peer):
            return LinkChoice(transport, reason)
    return LinkChoice("grpc", f"no other transport fits: {possible('shm', here, peer)}")
