"""Two datacenters on this machine, for the Prefill-as-a-Service live run: two nats-server processes joined
by a NATS gateway (each datacenter its own bus), a PrfaaS cluster (prefill only, its KV push held to the
link's rate with --kv-rate-limit-gbps) on one, and a PD cluster (kvs-meta, the conductor with the
topology, prefill, decode, gateway) on the other. It writes the configs and starts and stops processes;
it sends no requests (bench/papers/prfaas_live.py and the integration test do).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.request

from kvcentric.runtime.security import client_context
from kvcentric.tools.processes import Child, Supervisor, free_port, get_json, nats_server_binary
from kvcentric.tools.secure import SecureFiles, make_secure_files

PD, PRFAAS = "pd", "prfaas"


@dataclasses.dataclass(frozen=True)
class TwoDCConfig:
    model: str = "small"
    threshold: int = 256
    """The conductor's planned t in uncached tokens (scaled to CPU-sized prompts)."""
    link_gbps: float = 0.1
    """The cross-datacenter link: the topology's link and the PrfaaS prefill's KV push rate limit."""
    adjust_s: float = 0.0
    """The conductor's short-term step interval of t (0: t stays at `threshold`)."""
    replan_profile: str = ""
    """The planner's profile (`--replan-profile`): a short-term trigger re-derives t from it (PrfaaS §3.4.3)."""
    pd_prefill: int = 1
    decode: int = 1
    prfaas_prefill: int = 1
    num_kv_blocks: int = 1024
    block_size: int = 16
    log_dir: str = ""
    startup_timeout_s: float = 120.0
    secure: bool = False
    """Every hop secured as `kvcentric up --secure` has it, the NATS gateway between the datacenters over mutual
    TLS too (one CA for both)."""


def nats_gateway_conf(name: str, client_port: int, monitor_port: int, gateways: dict[str, int],
                      secure: SecureFiles | None = None) -> str:
    """nats-server config of one datacenter's server: clients, monitoring, and a gateway to every other; with
    `secure`, the clients' TLS and users of `kvcentric up --secure` and the gateway over mutual TLS."""
    routes = "\n".join(f'    {{name: "{peer}", url: "nats://127.0.0.1:{port}"}}' for peer, port in gateways.items())
    tls = (f'  tls {{\n    cert_file: "{secure.nats_cert}"\n    key_file: "{secure.nats_key}"\n'
           f'    ca_file: "{secure.ca}"\n    verify: true\n    timeout: 5\n  }}\n') if secure else ""
    clients = open(secure.nats_conf).read() if secure else ""
    return (f'server_name: "{name}-nats"\nlisten: "127.0.0.1:{client_port}"\nhttp: "127.0.0.1:{monitor_port}"\n'
            f'gateway {{\n  name: "{name}"\n  listen: "127.0.0.1:{gateways[name]}"\n{tls}'
            f'  gateways: [\n{routes}\n  ]\n}}\n' + clients)


def topology_document(config: TwoDCConfig) -> dict:
    return {"clusters": [{"name": PD, "role": "pd", "instances": config.pd_prefill + config.decode, "hardware": "cpu"},
                         {"name": PRFAAS, "role": "prfaas", "instances": config.prfaas_prefill, "hardware": "cpu"}],
            "links": [{"between": [PRFAAS, PD], "gbps": config.link_gbps}],
            "notes": "written by kvcentric.twodc: two datacenters on one machine"}


class TwoDatacenters:
    """The processes of both datacenters; `start` brings them up, `stop` ends them in reverse order."""

    def __init__(self, config: TwoDCConfig) -> None:
        self.config = config
        self.processes = Supervisor(config.log_dir, prefix="kvcentric-2dc-")
        self.nats_urls: dict[str, str] = {}
        self.monitor_urls: dict[str, str] = {}
        self.port = free_port()
        self.secure = make_secure_files(os.path.join(self.log_dir, "secure")) if config.secure else None
        self.tls = client_context(self.secure.ca) if self.secure else None
        """How the secured gateway's HTTPS is checked."""
        self.url = f"{'https' if self.secure else 'http'}://127.0.0.1:{self.port}"

    @property
    def log_dir(self) -> str:
        return self.processes.log_dir

    # ---------------------------------------------------------------- servers

    def start_nats(self) -> None:
        gateways = {PD: free_port(), PRFAAS: free_port()}
        for name in (PD, PRFAAS):
            client, monitor = free_port(), free_port()
            path = os.path.join(self.log_dir, f"nats-{name}.conf")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
                out.write(nats_gateway_conf(name, client, monitor, gateways, self.secure))
            self.processes.start_server(f"nats-{name}", [nats_server_binary(), "-c", path], client)
            self.nats_urls[name] = f"{'tls' if self.secure else 'nats'}://127.0.0.1:{client}"
            self.monitor_urls[name] = f"http://127.0.0.1:{monitor}"

    def gateways_connected(self) -> bool:
        """Each server has an outbound gateway connection to the other datacenter (NATS /gatewayz)."""
        for name, other in ((PD, PRFAAS), (PRFAAS, PD)):
            try:
                body = get_json(f"{self.monitor_urls[name]}/gatewayz")[1]
            except (OSError, ValueError):
                return False
            if other not in body.get("outbound_gateways", {}):
                return False
        return True

    def wait_gateways(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.gateways_connected():
            if time.monotonic() > deadline:
                raise TimeoutError("the two nats-server processes did not connect their gateways")
            time.sleep(0.1)

    # ---------------------------------------------------------------- services

    def service(self, name: str, command: str, cluster: str, *flags: str, port: int | None = None) -> Child:
        secured = self.secure.service_flags(command) if self.secure else []
        return self.processes.start_service(name, command, self.nats_urls[cluster], cluster, *secured, *flags,
                                            port=port, tls=self.tls if command == "gateway" else None)

    def engine_flags(self, name: str) -> list[str]:
        c = self.config
        return ["--instance-id", name, "--model", c.model, "--num-kv-blocks", str(c.num_kv_blocks),
                "--block-size", str(c.block_size), "--torch-threads", "1"]

    def start(self) -> None:
        c = self.config
        self.start_nats()
        if self.secure:
            with open(self.secure.redis_password) as secret:
                redis_url = self.processes.start_redis(self.secure.redis_conf, secret.read().strip())
        else:
            redis_url = self.processes.start_redis()
        self.topology_path = os.path.join(self.log_dir, "topology.json")
        with open(self.topology_path, "w") as out:
            json.dump(topology_document(c), out, indent=2)
        self.wait_gateways()
        self.service("kvs-meta", "kvs-meta", PD, "--redis-url", redis_url)
        self.service("conductor", "conductor", PD, "--model", c.model, "--block-size", str(c.block_size),
                     "--topology", self.topology_path, "--prfaas-threshold", str(c.threshold),
                     "--prfaas-adjust-s", str(c.adjust_s), "--rejection", "never",
                     *(["--replan-profile", c.replan_profile] if c.replan_profile else []))
        for i in range(c.prfaas_prefill):
            self.service(f"prefill-prfaas-{i}", "prefill", PRFAAS, *self.engine_flags(f"prefill-prfaas-{i}"),
                         "--kv-rate-limit-gbps", str(c.link_gbps))
        for i in range(c.pd_prefill):
            self.service(f"prefill-pd-{i}", "prefill", PD, *self.engine_flags(f"prefill-pd-{i}"))
        for i in range(c.decode):
            self.service(f"decode-pd-{i}", "decode", PD, *self.engine_flags(f"decode-pd-{i}"))
        self.service("gateway", "gateway", PD, "--model", c.model, "--block-size", str(c.block_size),
                     port=self.port)

    def health(self, name: str) -> dict:
        return get_json(self.processes.child(name).health_url, timeout_s=5.0)[1]

    def metric(self, name: str, series: str) -> float | None:
        """The value of `kvc_<series>` (its first sample, labelled or not) on service `name`'s /metrics; None when
        it exposes no such series."""
        url = self.processes.child(name).health_url.replace("/health", "/metrics")
        with urllib.request.urlopen(url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith((f"kvc_{series} ", f"kvc_{series}{{")):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def engines_seen(self) -> bool:
        """The conductor sees every prefill instance of both datacenters and every decode instance."""
        body = self.health("conductor")
        c = self.config
        return (body.get("prefill_alive", 0) >= c.pd_prefill + c.prfaas_prefill
                and body.get("decode_alive", 0) >= c.decode)

    def wait_ready(self) -> None:
        self.processes.wait_healthy(self.config.startup_timeout_s, self.engines_seen,
                                    "the conductor's view of both datacenters")

    def stop(self, grace_s: float = 5.0) -> None:
        self.processes.stop(grace_s)

    def __enter__(self) -> TwoDatacenters:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
