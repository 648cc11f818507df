"""Settings of the gateway service (flags and KVC_* environment variables)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from kvcentric.config import BusConfig, require, setting
from kvcentric.core.hashing import HASH_ALGOS, BlockHasher, HashAlgo, parse_seed
from kvcentric.model.config import ModelConfig, load_model_config
from kvcentric.runtime.connections import HttpLimits


@dataclasses.dataclass(frozen=True)
class GatewayConfig(BusConfig):
    port: int = setting(8000, "HTTP port of the OpenAI-compatible API")
    model: str = setting("tiny", "model the engines serve: a preset name or a checkpoint directory; sets the "
                                 "tokenizer, chat template and context length")
    block_size: int = setting(16, "tokens per KV block (must match the engines)")
    hash_algo: HashAlgo = setting("sha256_cbor", "prefix block hash (must match the engines)")
    kvs_enable_save_unfull_chunk: bool = setting(
        False, "also look a prompt's trailing partial block up, by its chained hash (Llumnix's flag of that name; "
               "the engines here cache full blocks only, so it hits only in a store that saves partial ones)")
    hash_seed: str = setting("", "prefix block hash seed, shared by every service that hashes (gateway and "
                                 "engines): an integer, or empty for none (Llumnix GO_HASH_SEED; vLLM PYTHONHASHSEED)")
    request_timeout_s: float = setting(120.0, "a request that makes no progress for this long gets 504: no token came "
                                              "(before its first token: none this long past its placement plus "
                                              "its predicted TTFT); a request whose tokens keep coming, or that is "
                                              "queued within its predicted time, is never cut however long it runs")
    keepalive_s: float = setting(10.0, "a streamed request (its status and headers sent once it is placed) with "
                                       "nothing to send for this long gets an SSE comment (': keep-alive'), and "
                                       "again this often while it waits (0: none)")
    bus_timeout_s: float = setting(5.0, "how long to wait for the conductor and engines to answer")
    dispatch: Literal["conductor", "gateway"] = setting(
        "conductor", "who hands a placed request to the prefill and decode instances: conductor (it sends the "
                     "jobs as it answers, one bus round trip fewer before the first token) or gateway (after "
                     "the conductor's answer, as DESIGN.md first had it)")
    api_key: str = setting("", "if set, /v1/* requires the header 'Authorization: Bearer <key>' (else 401); a key on "
                               "a command line is visible to every user of the machine: prefer --api-keys-file")
    api_keys_file: str = setting("", "file of API keys, one a line (blank lines and # comments skipped): /v1/* "
                                     "requires 'Authorization: Bearer <one of them>' (else 401); with --api-key, "
                                     "either is taken")
    https_cert: str = setting("", "PEM certificate (chain) to serve HTTPS with, instead of HTTP")
    https_key: str = setting("", "PEM private key of --https-cert")
    header_timeout_s: float = setting(15.0, "a connection that has not sent a whole request head this long after "
                                            "it opened or after its last answer is closed")
    body_timeout_s: float = setting(30.0, "a request body not all arrived this long after its head gets 408")
    max_migrations: int = setting(2, "times one request may be migrated when an instance serving it goes silent "
                                     "or fails it (re-placed with the tokens already streamed kept); 0: never, "
                                     "such a request ends with a 503")
    silent_after_s: float = setting(1.5, "an engine with no load report for this long is taken for dead by the "
                                         "gateway: the requests waiting on it are migrated")
    max_connections: int = setting(4096, "most client connections open at once (at most the open-file limit "
                                         "less 128): the oldest idle one is closed to make room, else a 503")

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            _ = self.model_config  # resolving the model validates it
        except ValueError as exc:
            require(False, "model", str(exc))
        require(self.hash_algo in HASH_ALGOS, "hash_algo", f"choose one of {', '.join(HASH_ALGOS)}")
        try:
            parse_seed(self.hash_seed)
        except ValueError as exc:
            require(False, "hash_seed", str(exc))
        require(self.block_size >= 1, "block_size", "must be at least 1")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be positive")
        require(self.bus_timeout_s > 0, "bus_timeout_s", "must be positive")
        require(self.keepalive_s >= 0, "keepalive_s", "must be 0 (none) or positive")
        require(self.header_timeout_s > 0, "header_timeout_s", "must be positive")
        require(self.body_timeout_s > 0, "body_timeout_s", "must be positive")
        require(self.max_migrations >= 0, "max_migrations", "must be >= 0 (0: never migrate)")
        require(self.silent_after_s > 0, "silent_after_s", "must be positive")
        require(self.max_connections >= 1, "max_connections", "must be at least 1")
        require(bool(self.https_cert) == bool(self.https_key), "https_key" if self.https_cert else "https_cert",
                "--https-cert and --https-key go together")

    def hasher(self) -> BlockHasher:
        """The prefix block hasher of the engines (algorithm, block size, seed)."""
        return BlockHasher(self.hash_algo, self.block_size, parse_seed(self.hash_seed))

    @property
    def requires_key(self) -> bool:
        """Whether /v1/* asks for an API key (--api-key or --api-keys-file)."""
        return bool(self.api_key or self.api_keys_file)

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.header_timeout_s, self.body_timeout_s, self.max_connections)

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return load_model_config(self.model)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The name /v1/models lists first, then the other names a request may use for it."""
        names = (self.model_config.name, self.model)
        return tuple(dict.fromkeys(names))
