"""`kvcentric up`: run a whole cluster on this machine as child processes, keep it running, and stop it
cleanly.

It starts nats-server and redis-server on loopback ports (unless --nats-url / --redis-url name running
ones), then kvs-meta, --conductors conductors (replicas answering from one NATS queue group), N prefill and
M decode instances (each with its in-process messenger) and the gateway; waits until every one answers
/health and every conductor sees all engines; prints the URL and a sample request. A child that dies
afterwards is started again after a backoff (--restart on-failure) and `up` says so; a crash loop, or with
--restart never any death, stops everything. SIGINT or SIGTERM stops every child within a few seconds,
and each child also gets SIGTERM from the kernel if this process dies (PR_SET_PDEATHSIG). `up` is the
subreaper of everything it started (PR_SET_CHILD_SUBREAPER): a child's own children come back to it, and it exits
only once every descendant has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import ssl
import sys
import tempfile
import time
from typing import Literal

from kvcentric.config import LogLevel, require, setting
from kvcentric.core.kvlinks import KVTransportName
from kvcentric.core.scheduling.slo import PACE_OF_SLO
from kvcentric.engine.config import DEVICE
from kvcentric.model.config import PRESETS
from kvcentric.registry import ENGINE_ROLES
from kvcentric.runtime.security import client_context
from kvcentric.tools import forking
from kvcentric.tools.processes import Child, Supervisor, become_subreaper, end_the_rest, get_json, reap_zombies
from kvcentric.tools.secure import SecureFiles, make_secure_files

Restart = Literal["on-failure", "never"]
SpawnHow = Literal["fork", "exec"]
REAP_EVERY_S = 2.0
"""How often a running `up` reaps the exited orphans handed back to it (a scan of /proc)."""


@dataclasses.dataclass(frozen=True)
class UpConfig:
    host: str = setting("127.0.0.1", "address the gateway binds to")
    port: int = setting(8000, "gateway HTTP port")
    prefill: int = setting(1, "number of prefill instances")
    decode: int = setting(1, "number of decode instances")
    prefill_pipeline: int = setting(1, "stages of each prefill instance: with X > 1 each of the --prefill "
                                       "instances is a pipelined prefill group of X processes, each holding 1/X "
                                       "of the layers (Mooncake §5.1, chunked pipeline parallelism)")
    conductors: int = setting(2, "conductor replicas; they answer kvc.conductor.schedule from one NATS queue "
                                 "group, so one may die without an outage")
    colocated: int = setting(0, "run this many colocated instances (prefill and decode in one, the "
                                "vLLM-style baseline) instead of separate prefill and decode ones")
    model: str = setting("tiny", "model preset served: " + ", ".join(PRESETS))
    seed: int = setting(0, "seed of the model's random weights")
    nats_url: str = setting("", "use this NATS server instead of starting one")
    redis_url: str = setting("", "use this Redis instead of starting one")
    cluster: str = setting("local", "cluster name of every service")
    profile: str = setting("", "cost model from `kvcentric profile` for the conductor and the decode instances' TBT "
                               "double-check (default: a roofline of the model on this machine, which the "
                               "engines' measured models replace)")
    num_kv_blocks: int = setting(2048, "KV blocks per engine instance")
    prefill_kv_blocks: int = setting(0, "device KV blocks per prefill instance (0: --num-kv-blocks)")
    block_size: int = setting(16, "tokens per KV block")
    prefill_chunk: int = setting(512, "prompt tokens an engine computes per prefill step (chunked prefill)")
    max_batch: int = setting(64, "most sequences in one decode step of an engine")
    device: str = setting("cpu", "torch device of the engines: cpu; cuda (spread over the visible GPUs, engine i "
                                 "on GPU i mod their count); cuda:N (every engine on GPU N)")
    torch_threads: int = setting(0, "torch threads of each engine (0: this machine's cores shared evenly)")
    lend_cores: bool = setting(True, "CPU, several engines: each model call of an engine also runs on the threads "
                                     "of the engines that are idle, and a prefill instance takes them within a "
                                     "call (engine/service/coreshare.py; 1P+1D on 2 cores: docs/performance.md); "
                                     "--no-lend-cores: each engine keeps to its --torch-threads")
    lend_pace_s: float = setting(0.08, "with --lend-cores: while a prefill instance computes with 2 or more prompts "
                                       "queued (a burst), a decode instance starts its steps at most this often "
                                       "and lends its core between them, at most 0.8 x --tbt-slo-s (0: steps "
                                       "back to back)")
    tbt_slo_s: float = setting(0.0, "TBT SLO in seconds: the conductor admits by it, and with KVC_REJECTION=none "
                                    "the decode instances double-check it when a request's KV has arrived "
                                    "(rejected with 429 when the predicted step exceeds it; Mooncake §7); 0: "
                                    "relative, 5x the unloaded step each measures (and the conductor's TTFT SLO "
                                    "10x the unloaded prefill, unless KVC_TTFT_SLO_S is set), so a slow model on "
                                    "slow hardware still serves")
    layerkv: bool = setting(False, "colocated instances run LayerKV (layer-wise KV offloading, SLO-aware admission); "
                                   "without --colocated, the prefill instances do (layer-wise KV offloading)")
    layerkv_tpot_slo_s: float = setting(0.2, "with --layerkv: the TPOT SLO prompts are admitted by, seconds")
    kv_transport: KVTransportName = setting("auto", "the engines' --kv-transport: how KV moves between them "
                                                    "(auto: per link, shm between engines of this host; grpc, shm, "
                                                    "cuda-ipc, mooncake)")
    log_dir: str = setting("", "where each service writes its log (default: a new temp dir)")
    startup_timeout_s: float = setting(120.0, "give up if the cluster is not healthy after this long")
    log_level: LogLevel = setting("info", "log level of the services")
    secure: bool = setting(False, "run the cluster secured: a throwaway CA and certificates, NATS over TLS with one "
                                  "user (and its permissions) per kind of service, the KV transfer over mutual TLS, "
                                  "Redis with a password, the gateway on HTTPS with an API key; every secret in a "
                                  "file of --secure-dir, never on a command line")
    secure_dir: str = setting("", "with --secure: where the CA, certificates, passwords and API key are written "
                                  "(default: <log dir>/secure; owner only)")
    spawn: SpawnHow = setting("fork", "fork: up imports the services once and starts each as a fork of itself "
                                      "(a cluster ready sooner on about half the CPU, a killed engine back 2.5-4x "
                                      "sooner; an engine on a GPU is still started as a new interpreter); exec: "
                                      "each service a new `python -m kvcentric` process")
    restart: Restart = setting("on-failure", "on-failure: a child that dies after start-up is started again "
                                             "(backoff from 0.5 s, doubling; up gives up after 5 crashes in a "
                                             "row within 10 s of a start); never: any death stops the cluster "
                                             "and up exits 1 (fail fast, for CI)")

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, "port", "must be 0..65535")
        require(self.prefill_chunk >= 1, "prefill_chunk", "must be at least 1")
        require(self.max_batch >= 1, "max_batch", "must be at least 1")
        require(DEVICE.fullmatch(self.device) is not None, "device",
                f"expected cpu, cuda or cuda:N, got {self.device!r}")
        require(math.isfinite(self.tbt_slo_s) and self.tbt_slo_s >= 0, "tbt_slo_s", "must be 0 (relative) or positive")
        require(self.colocated >= 0, "colocated", "must be 0 or more")
        require(self.prefill_pipeline >= 1, "prefill_pipeline", "must be at least 1")
        require(self.conductors >= 1, "conductors", "need at least one conductor")
        require(math.isfinite(self.lend_pace_s) and 0 <= self.lend_pace_s < 1, "lend_pace_s",
                "must be 0 (off) or a fraction of a second")
        require(not (self.layerkv and self.prefill_pipeline > 1 and not self.colocated), "layerkv",
                "pipelined prefill stages do not run LayerKV: use --prefill-pipeline 1")
        require(self.prefill_kv_blocks >= 0, "prefill_kv_blocks", "must be 0 (--num-kv-blocks) or positive")
        require(self.colocated > 0 or self.prefill >= 1, "prefill", "need at least one prefill instance")
        require(self.colocated > 0 or self.decode >= 1, "decode", "need at least one decode instance")
        require(not (self.secure and (self.nats_url or self.redis_url)), "secure",
                "--secure starts its own NATS and Redis: leave out --nats-url and --redis-url")
        require(self.secure or not self.secure_dir, "secure_dir", "only with --secure")

    @property
    def lends_cores(self) -> bool:
        """Whether the engines lend each other cores: --lend-cores, on the CPU, with more than one engine."""
        return self.lend_cores and self.device == "cpu" and len(self.engines) > 1

    @property
    def engines(self) -> list[tuple[str, str]]:
        """(name, subcommand) of every engine instance to start."""
        if self.colocated:
            return [(f"colocated-{i}", "colocated") for i in range(self.colocated)]
        return [(name, "prefill") for i in range(self.prefill) for name in self.stage_names(i)] + \
               [(f"decode-{i}", "decode") for i in range(self.decode)]

    def stage_names(self, group: int) -> list[str]:
        """Instance ids of prefill instance `group`: `prefill-<i>`, or its stages `prefill-<i>-s<j>`."""
        if self.prefill_pipeline == 1:
            return [f"prefill-{group}"]
        return [f"prefill-{group}-s{stage}" for stage in range(self.prefill_pipeline)]

    def stage_flags(self, name: str) -> list[str]:
        """--pipeline-group and --stage of a prefill stage named by `stage_names`; none for a whole instance."""
        if self.prefill_pipeline == 1 or not name.startswith("prefill-"):
            return []
        group, stage = name.rsplit("-s", 1)
        return ["--pipeline-group", group, "--stage", f"{stage}/{self.prefill_pipeline}"]

    @property
    def decode_pace_s(self) -> float:
        """A decode instance's --lend-pace-s: --lend-pace-s, within 0.8 of the TBT SLO (a token every pace during a
        burst keeps that margin under it)."""
        return min(self.lend_pace_s, PACE_OF_SLO * self.tbt_slo_s) if self.tbt_slo_s > 0 else self.lend_pace_s

    def engine_flags(self, command: str, threads: int, device: str = "", core_share_dir: str = "") -> list[str]:
        """The flags of one engine instance (`command`: prefill, decode or colocated) on `device` (default:
        --device); `core_share_dir`: the directory its engines lend each other cores in ("": they do not)."""
        blocks = self.prefill_kv_blocks if command == "prefill" and self.prefill_kv_blocks else self.num_kv_blocks
        flags = ["--model", self.model, "--seed", str(self.seed), "--num-kv-blocks", str(blocks),
                 "--kv-transport", self.kv_transport,
                 "--block-size", str(self.block_size), "--torch-threads", str(threads), "--prefill-chunk",
                 str(self.prefill_chunk), "--max-batch", str(self.max_batch), "--device", device or self.device]
        if command in ("colocated", "prefill") and self.layerkv:
            flags += ["--layerkv", "--layerkv-tpot-slo-s", str(self.layerkv_tpot_slo_s)]
        if core_share_dir and (device or self.device) == "cpu":
            flags += ["--core-share-dir", core_share_dir]
            flags += ["--lend-pace-s", str(self.decode_pace_s)] if command == "decode" else []
        if command == "decode":  # its cost model is the conductor's; 0: 5x its own unloaded step
            flags += ["--tbt-slo-s", str(self.tbt_slo_s)]
            flags += ["--profile", self.profile] if self.profile else []
        return flags

    def conductor_flags(self) -> list[str]:
        return ["--model", self.model, "--block-size", str(self.block_size),
                *(["--profile", self.profile] if self.profile else []),
                *(["--tbt-slo-s", str(self.tbt_slo_s)] if self.tbt_slo_s > 0 else [])]

    @property
    def conductor_names(self) -> list[str]:
        """Names (and instance ids) of the conductors: `conductor-0`, `conductor-1`, ..."""
        return [f"conductor-{i}" for i in range(self.conductors)]

    @property
    def expected_alive(self) -> tuple[int, int]:
        """Prefill and decode instances the conductor must see before the cluster counts as up."""
        return (self.colocated, self.colocated) if self.colocated else \
            (self.prefill * self.prefill_pipeline, self.decode)


def engine_devices(device: str, count: int, gpus: int) -> list[str]:
    """The device of each of `count` engines: `cuda` spreads them over `gpus` visible GPUs (engine i on
    cuda:i mod gpus, as a serving stack gives each worker its own GPU); cpu and cuda:N put every engine there."""
    if device != "cuda" or gpus <= 1:
        return [device] * count
    return [f"cuda:{index % gpus}" for index in range(count)]


def share_dir() -> str:
    """A new directory for the engines' core-share slot files, in shared memory where there is some; those a
    killed `up` left behind (no live instance in them) are removed first."""
    shm = "/dev/shm"
    parent = shm if os.access(shm, os.W_OK) else tempfile.gettempdir()
    remove_stale_shares(parent)
    return tempfile.mkdtemp(prefix="kvc-cores-", dir=parent)


def remove_stale_shares(parent: str) -> list[str]:
    """Remove the `kvc-cores-*` directories under `parent` in which no instance's process is alive; returns them."""
    # the slot format is the engines'; up itself imports no torch
    from kvcentric.engine.service.coreshare import live_slots

    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith("kvc-cores-") and os.path.isdir(path) and not live_slots(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def visible_gpus() -> int:
    """GPUs this process sees (CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    import torch  # only for --device cuda: `up` itself needs no torch otherwise

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Cluster:
    """The processes of one `kvcentric up`: which services, with which flags, in which order; its
    `Supervisor` starts them, watches them and stops them in reverse."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.processes = Supervisor(config.log_dir, fork=self.forks)
        self.preloaded: set[str] = set()
        """The `kvcentric` commands this process has imported, whose services it forks."""
        self.nats_url = config.nats_url
        self.redis_url = config.redis_url
        self.manifest: dict = {}
        self.core_share_dir = ""
        """The directory the engines lend each other cores in (made at start, removed at stop; "": none)."""
        self.secure: SecureFiles | None = None
        """The CA, certificates and secrets of a --secure cluster (made at start)."""
        self.tls: ssl.SSLContext | None = None
        """How `up` checks the gateway's HTTPS (--secure)."""
        self.reap_at = 0.0
        """When `tend` next reaps the orphans handed back to `up` (monotonic time)."""

    @property
    def log_dir(self) -> str:
        return self.processes.log_dir

    def service(self, name: str, command: str, *flags: str, port: int | None = None) -> Child:
        host = self.config.host if command == "gateway" else "127.0.0.1"
        secured = self.secure.service_flags(command) if self.secure else []
        return self.processes.start_service(name, command, self.nats_url, self.config.cluster, "--log-level",
                                            self.config.log_level, *secured, *flags, port=port,
                                            health_host=_client_host(host),
                                            tls=self.tls if command == "gateway" else None)

    def start_servers(self) -> None:
        """nats-server and redis-server, unless --nats-url / --redis-url name running ones; with --secure their
        secured configs, the material made first."""
        if self.config.secure:
            folder = self.config.secure_dir or os.path.join(self.log_dir, "secure")
            self.secure = make_secure_files(folder, [self.config.host])
            self.tls = client_context(self.secure.ca)
            with open(self.secure.redis_password) as secret:
                password = secret.read().strip()
            self.nats_url = self.processes.start_nats(self.secure.nats_conf)
            self.redis_url = self.processes.start_redis(self.secure.redis_conf, password)
            return
        self.nats_url = self.nats_url or self.processes.start_nats()
        self.redis_url = self.redis_url or self.processes.start_redis()

    def forks(self, argv: list[str]) -> bool:
        """Whether this `kvcentric` service is started as a fork of `up` (`kvcentric.tools.forking`)."""
        return forking.forks(argv) and argv[3] in self.preloaded

    def preload(self, commands: list[str]) -> None:
        """With --spawn fork: import these services (an engine's torch too, on the CPU), so that each is forked ready
        to run. An engine on a GPU is not: a fork must not carry CUDA's state."""
        if self.config.spawn != "fork":
            return
        if self.config.device != "cpu":
            commands = [command for command in commands if command not in ENGINE_ROLES]
        self.preloaded.update(forking.preload(commands))

    def start(self) -> None:
        """The servers, then the control plane, then the engines (the control plane forked before `up` imports
        torch, so that it carries none of its pages)."""
        self.start_servers()
        self.preload(list(forking.CONTROL_PLANE))
        c = self.config
        self.service("kvs-meta", "kvs-meta", "--redis-url", self.redis_url)
        for name in c.conductor_names:
            self.service(name, "conductor", "--instance-id", name, *c.conductor_flags())
        self.service("gateway", "gateway", "--host", c.host, "--model", c.model, "--block-size",
                     str(c.block_size), port=c.port or None)
        threads = c.torch_threads or max(1, (os.cpu_count() or 1) // len(c.engines))
        gpus = visible_gpus() if c.device == "cuda" else 0  # (torch imported after the control plane is forked)
        devices = engine_devices(c.device, len(c.engines), gpus)
        crowded = {device: devices.count(device) for device in devices
                   if device.startswith("cuda") and devices.count(device) > 1}
        if crowded:
            print("kvcentric: note: " + ", ".join(f"{n} engine instances share {d}" for d, n in crowded.items())
                  + ": they time-share it, and a KV push crosses the host (docs/performance.md, "
                    "\"Disaggregated vs single process\"); give each instance a GPU of its own, or run "
                    "--colocated", flush=True)
        self.preload(sorted({command for _, command in c.engines}))
        self.core_share_dir = self.core_share_dir or (share_dir() if c.lends_cores else "")
        for (name, command), device in zip(c.engines, devices):
            self.service(name, command, "--instance-id", name,
                         *c.engine_flags(command, threads, device, self.core_share_dir), *c.stage_flags(name))
        self.write_manifest()

    def write_manifest(self) -> None:
        """cluster.json in the log dir: every child's pid, health URL and log, for tools and tests; written
        again whenever that changes (a child restarted, a restarted service bound its port), aside and then
        renamed, so a reader never sees half of it."""
        manifest = {"nats_url": self.nats_url, "redis_url": self.redis_url, "core_share_dir": self.core_share_dir,
                    "secure_dir": self.secure.folder if self.secure else "",
                    "services": {c.name: {"pid": c.process.pid, "health_url": c.health_url, "log": c.log_path}
                                 for c in self.processes.children}}
        if manifest == self.manifest:
            return
        self.manifest = manifest
        path = os.path.join(self.log_dir, "cluster.json")
        with open(path + ".tmp", "w") as out:
            json.dump(manifest, out, indent=2)
        os.replace(path + ".tmp", path)

    def wait_healthy(self) -> None:
        self.processes.wait_healthy(self.config.startup_timeout_s, self.engines_seen,
                                    "the conductors' view of the engines")
        self.write_manifest()  # every health URL is known now

    def engines_seen(self) -> bool:
        """Every conductor sees every engine, and the gateway says it can serve (GET /ready)."""
        prefill, decode = self.config.expected_alive
        for name in self.config.conductor_names:
            body = _health(self.processes.child(name).health_url)
            if body is None or body.get("prefill_alive", 0) < prefill or body.get("decode_alive", 0) < decode:
                return False
        gateway = self.processes.child("gateway").health_url
        return gateway is not None and _health(gateway.replace("/health", "/ready"), self.tls) is not None

    def slos(self) -> str:
        """The SLOs in force, as the first conductor describes them ("" when it does not say)."""
        from kvcentric.core.scheduling.slo import summary  # pure: no torch, no I/O

        body = _health(self.processes.child(self.config.conductor_names[0]).health_url)
        try:
            return summary(body["slos"]) if body else ""
        except (KeyError, TypeError):
            return ""

    def tend(self) -> None:
        """Restart dead children (or, with --restart never, fail on the first death); say what was done."""
        if self.config.restart == "never":
            self.processes.check_alive()
            return
        for line in self.processes.tend(time.monotonic()):
            print(f"kvcentric: {line}", flush=True)
        self.write_manifest()
        if time.monotonic() >= self.reap_at:  # orphans of the children's own children that came back to `up`
            reap_zombies({child.process.pid for child in self.processes.children})
            self.reap_at = time.monotonic() + REAP_EVERY_S

    def secured_note(self) -> str:
        """What `ready at` adds for a --secure cluster: where its CA and secrets are (never a secret itself)."""
        if self.secure is None:
            return ""
        return (f"secured: CA {self.secure.ca}; API key in {self.secure.api_keys}; NATS users' passwords in "
                f"{self.secure.folder}/nats-<user>.password\n")

    def curl_flags(self) -> str:
        """The curl flags of the sample request: the CA and the API key, read from its file by the shell."""
        if self.secure is None:
            return ""
        return f"\\\n    --cacert {self.secure.ca} -H \"Authorization: Bearer $(head -1 {self.secure.api_keys})\" "

    @property
    def gateway_port(self) -> int:
        """The gateway's port: --port, or the one it bound with --port 0."""
        url = self.processes.child("gateway").health_url or ""
        return int(url.rsplit(":", 1)[1].split("/")[0]) if url else self.config.port

    def stop(self, grace_s: float = 3.0) -> None:
        self.processes.stop(grace_s)
        if self.core_share_dir:
            shutil.rmtree(self.core_share_dir, ignore_errors=True)
            self.core_share_dir = ""


def _health(url: str | None, tls: ssl.SSLContext | None = None) -> dict | None:
    """The body of a 200 answer from `url` (HTTPS checked with `tls`); None for anything else."""
    if url is None:
        return None
    try:
        status, body = get_json(url, context=tls)
    except (OSError, ValueError):
        return None
    return body if status == 200 else None


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop


def run_up(config: UpConfig) -> int:
    """Run until SIGINT/SIGTERM, or until a child dies for good; returns the exit code."""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    become_subreaper()
    cluster = Cluster(config)
    try:
        engines = f"{config.colocated} colocated" if config.colocated else \
            f"{config.prefill} prefill + {config.decode} decode"
        print(f"kvcentric: starting {engines} instances of '{config.model}'; logs in {cluster.log_dir}", flush=True)
        cluster.start()
        cluster.wait_healthy()
        url = f"{'https' if config.secure else 'http'}://{_client_host(config.host)}:{cluster.gateway_port}"
        slos = cluster.slos()
        print(f"kvcentric: ready at {url}  (NATS {cluster.nats_url}, Redis {cluster.redis_url})"
              + (f"  SLOs: {slos}" if slos else "") + "\n" + cluster.secured_note() +
              f"try:\n  curl {url}/v1/completions -H 'Content-Type: application/json' {cluster.curl_flags()}\\\n"
              f"    -d '{{\"model\": \"{config.model}\", \"prompt\": \"Hello\", \"max_tokens\": 8, "
              f"\"temperature\": 0}}'\nCtrl-C stops everything.", flush=True)
        while True:
            cluster.tend()
            time.sleep(0.2)
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
        end_the_rest(grace_s=3.0)  # the children's children (and a child started as the stop came) too
