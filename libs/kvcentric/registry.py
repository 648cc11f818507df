"""Which package serves each `kvcentric` subcommand, found through the `kvcentric.services` and
`kvcentric.configs` entry points that pyproject.toml declares.

The library never imports a service package by name: the services sit above it, and this lookup is how
the CLI (and an engine changing its role) reaches them. It does not start anything.
"""

from __future__ import annotations

from importlib.metadata import entry_points

DESCRIPTIONS = {
    "gateway": "OpenAI-compatible HTTP API: validates, tokenizes, asks the conductor, relays tokens",
    "conductor": "global scheduler: tracks instances from load reports, places each request",
    "prefill": "prefill engine: computes prompts and streams their KV layer by layer to decode",
    "decode": "decode engine: takes KV in over gRPC and generates tokens in a continuous batch",
    "colocated": "colocated engine (the vLLM-style baseline): prefill and decode in one instance and KV pool",
    "kvs-meta": "KV block location metadata in Redis; NATS queries and GET /batch_query_keys",
    "messenger": "a node's host-memory KV store and gRPC KV transfer endpoint",
}
"""One line per service subcommand, for `kvcentric --help` (no service is imported to print it)."""

ENGINE_ROLES = ("prefill", "decode", "colocated")


def _load(group: str, name: str) -> type:
    found = entry_points(group=group, name=name)
    if not found:
        raise LookupError(f"no {group} entry point named {name!r}: is kvcentric installed (pip install -e .)?")
    return next(iter(found)).load()


def service_class(name: str) -> type:
    """The service class of a subcommand (`gateway`, `prefill`, ...)."""
    return _load("kvcentric.services", name)


def config_class(name: str) -> type:
    """The frozen config dataclass of a subcommand; its fields are the subcommand's flags."""
    return _load("kvcentric.configs", name)
