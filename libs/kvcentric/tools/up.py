"""`kvcentric up`: run a whole cluster on this machine as child processes, and stop it cleanly.

It starts nats-server and redis-server on free loopback ports (unless --nats-url / --redis-url name
running ones), then kvs-meta, the conductor, N prefill and M decode instances (each with its in-process
messenger) and the gateway; waits until every one answers /health and the conductor sees all engines;
prints the URL and a sample request. SIGINT or SIGTERM stops every child within a few seconds, and
each child also gets SIGTERM from the kernel if this process dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time

from kvcentric.config import LogLevel, require, setting
from kvcentric.engine.config import DEVICE
from kvcentric.model.config import PRESETS
from kvcentric.tools.processes import Child, Supervisor, get_json


@dataclasses.dataclass(frozen=True)
class UpConfig:
    host: str = setting("127.0.0.1", "address the gateway binds to")
    port: int = setting(8000, "gateway HTTP port")
    prefill: int = setting(1, "number of prefill instances")
    decode: int = setting(1, "number of decode instances")
    colocated: int = setting(0, "run this many colocated instances (prefill and decode in one, the "
                                "vLLM-style baseline) instead of separate prefill and decode ones")
    model: str = setting("tiny", "model preset served: " + ", ".join(PRESETS))
    seed: int = setting(0, "seed of the model's random weights")
    nats_url: str = setting("", "use this NATS server instead of starting one")
    redis_url: str = setting("", "use this Redis instead of starting one")
    cluster: str = setting("local", "cluster name of every service")
    profile: str = setting("", "cost model from `kvcentric profile` for the conductor and, with --tbt-slo-s, the "
                               "decode instances (default: a roofline of the model on this machine)")
    num_kv_blocks: int = setting(2048, "KV blocks per engine instance")
    block_size: int = setting(16, "tokens per KV block")
    prefill_chunk: int = setting(512, "prompt tokens an engine computes per prefill step (chunked prefill)")
    max_batch: int = setting(64, "most sequences in one decode step of an engine")
    device: str = setting("cpu", "torch device of every engine: cpu, cuda, cuda:N")
    tbt_slo_s: float = setting(0.0, "TBT SLO the decode instances double-check when a request's KV has arrived "
                                    "(rejected with 429 when the predicted step exceeds it; 0: off); also the "
                                    "conductor's --tbt-slo-s when set")
    log_dir: str = setting("", "where each service writes its log (default: a new temp dir)")
    startup_timeout_s: float = setting(120.0, "give up if the cluster is not healthy after this long")
    log_level: LogLevel = setting("info", "log level of the services")

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, "port", "must be 0..65535")
        require(self.prefill_chunk >= 1, "prefill_chunk", "must be at least 1")
        require(self.max_batch >= 1, "max_batch", "must be at least 1")
        require(DEVICE.fullmatch(self.device) is not None, "device",
                f"expected cpu, cuda or cuda:N, got {self.device!r}")
        require(math.isfinite(self.tbt_slo_s) and self.tbt_slo_s >= 0, "tbt_slo_s", "must be 0 (off) or positive")
        require(self.colocated >= 0, "colocated", "must be 0 or more")
        require(self.colocated > 0 or self.prefill >= 1, "prefill", "need at least one prefill instance")
        require(self.colocated > 0 or self.decode >= 1, "decode", "need at least one decode instance")

    @property
    def engines(self) -> list[tuple[str, str]]:
        """(name, subcommand) of every engine instance to start."""
        if self.colocated:
            return [(f"colocated-{i}", "colocated") for i in range(self.colocated)]
        return [(f"prefill-{i}", "prefill") for i in range(self.prefill)] + \
               [(f"decode-{i}", "decode") for i in range(self.decode)]

    def engine_flags(self, command: str, threads: int) -> list[str]:
        """The flags of one engine instance (`command`: prefill, decode or colocated)."""
        flags = ["--model", self.model, "--seed", str(self.seed), "--num-kv-blocks", str(self.num_kv_blocks),
                 "--block-size", str(self.block_size), "--torch-threads", str(threads), "--prefill-chunk",
                 str(self.prefill_chunk), "--max-batch", str(self.max_batch), "--device", self.device]
        if command == "decode" and self.tbt_slo_s > 0:  # its cost model is the conductor's
            flags += ["--tbt-slo-s", str(self.tbt_slo_s), *(["--profile", self.profile] if self.profile else [])]
        return flags

    def conductor_flags(self) -> list[str]:
        return ["--model", self.model, "--block-size", str(self.block_size),
                *(["--profile", self.profile] if self.profile else []),
                *(["--tbt-slo-s", str(self.tbt_slo_s)] if self.tbt_slo_s > 0 else [])]

    @property
    def expected_alive(self) -> tuple[int, int]:
        """Prefill and decode instances the conductor must see before the cluster counts as up."""
        return (self.colocated, self.colocated) if self.colocated else (self.prefill, self.decode)


class Cluster:
    """The processes of one `kvcentric up`: which services, with which flags, in which order; its
    `Supervisor` starts them, watches them and stops them in reverse."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.processes = Supervisor(config.log_dir)
        self.nats_url = config.nats_url
        self.redis_url = config.redis_url

    @property
    def log_dir(self) -> str:
        return self.processes.log_dir

    def service(self, name: str, command: str, *flags: str, port: int | None = None) -> Child:
        host = self.config.host if command == "gateway" else "127.0.0.1"
        return self.processes.start_service(name, command, self.nats_url, self.config.cluster, "--log-level",
                                            self.config.log_level, *flags, port=port,
                                            health_host=_client_host(host))

    def start(self) -> None:
        self.nats_url = self.nats_url or self.processes.start_nats()
        self.redis_url = self.redis_url or self.processes.start_redis()
        c = self.config
        threads = max(1, (os.cpu_count() or 1) // len(c.engines))
        self.service("kvs-meta", "kvs-meta", "--redis-url", self.redis_url)
        self.service("conductor", "conductor", *c.conductor_flags())
        for name, command in c.engines:
            self.service(name, command, "--instance-id", name, *c.engine_flags(command, threads))
        self.service("gateway", "gateway", "--host", c.host, "--model", c.model, "--block-size",
                     str(c.block_size), port=c.port)
        self.write_manifest()

    def write_manifest(self) -> None:
        """cluster.json in the log dir: every child's pid, health URL and log, for tools and tests."""
        manifest = {"nats_url": self.nats_url, "redis_url": self.redis_url,
                    "services": {c.name: {"pid": c.process.pid, "health_url": c.health_url, "log": c.log_path}
                                 for c in self.processes.children}}
        with open(os.path.join(self.log_dir, "cluster.json"), "w") as out:
            json.dump(manifest, out, indent=2)

    def wait_healthy(self) -> None:
        self.processes.wait_healthy(self.config.startup_timeout_s, self.engines_seen,
                                    "the conductor's view of the engines")

    def engines_seen(self) -> bool:
        url = self.processes.child("gateway").health_url
        if url is None:
            return False
        try:
            status, body = get_json(url)
        except (OSError, ValueError):
            return False
        prefill, decode = self.config.expected_alive
        if status != 200 or body.get("prefill_alive", 0) < prefill or body.get("decode_alive", 0) < decode:
            return False
        try:  # and the gateway says it can serve (GET /ready)
            return get_json(url.replace("/health", "/ready"))[0] == 200
        except (OSError, ValueError):
            return False

    def check_alive(self) -> None:
        self.processes.check_alive()

    def stop(self, grace_s: float = 3.0) -> None:
        self.processes.stop(grace_s)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop


def run_up(config: UpConfig) -> int:
    """Run until SIGINT/SIGTERM or until a child dies; returns the exit code."""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    cluster = Cluster(config)
    try:
        engines = f"{config.colocated} colocated" if config.colocated else \
            f"{config.prefill} prefill + {config.decode} decode"
        print(f"kvcentric: starting {engines} instances of '{config.model}'; logs in {cluster.log_dir}", flush=True)
        cluster.start()
        cluster.wait_healthy()
        url = f"http://{_client_host(config.host)}:{config.port}"
        print(f"kvcentric: ready at {url}  (NATS {cluster.nats_url}, Redis {cluster.redis_url})\n"
              f"try:\n  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{config.model}\", \"prompt\": \"Hello\", \"max_tokens\": 8, "
              f"\"temperature\": 0}}'\nCtrl-C stops everything.", flush=True)
        while True:
            cluster.check_alive()
            time.sleep(0.5)
    except _Stop:
        print("kvcentric: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"kvcentric: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
