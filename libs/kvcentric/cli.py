"""The `kvcentric` command: one subcommand per service, plus `up`, which runs a whole cluster here.

Every service flag has an environment variable (`--nats-url` / `KVC_NATS_URL`); `kvcentric <cmd> --help`
lists them. Services are imported only when their subcommand runs, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Literal

from kvcentric.config import ConfigError, add_arguments, env_name, flag_name, from_namespace
from kvcentric.registry import DESCRIPTIONS, config_class, service_class

SERVICES = DESCRIPTIONS
"""Service subcommand -> one-line description."""


def _config_class(command: str) -> type:
    return config_class(command)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole `kvcentric` parser; with `command` (a subcommand's name), one holding that subcommand alone, which
    parses its command lines the same (a service process need not import every other one's config to start)."""
    parser = argparse.ArgumentParser(
        prog="kvcentric",
        description="KVCache-centric, prefill/decode-disaggregated LLM serving. "
                    "`kvcentric up` runs everything on this machine; each other subcommand runs one service.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def wanted(name: str) -> bool:
        return command is None or command == name

    if wanted("up"):
        add_up(commands)
    if wanted("profile"):
        add_profile(commands)
    if wanted("plan"):
        add_plan(commands)
    if command is None:
        add_helps(commands)
    if wanted("role"):
        add_role(commands)
    for name, description in SERVICES.items():
        if wanted(name):
            sub = commands.add_parser(name, help=description, description=description)
            add_arguments(sub, _config_class(name))
    return parser


def add_up(commands: argparse._SubParsersAction) -> None:
    from kvcentric.tools.up import UpConfig
    up = commands.add_parser("up", help="run a whole cluster on this machine (servers included)",
                             description="Start nats-server, redis-server, kvs-meta, conductor, the gateway and "
                                         "prefill/decode instances; wait until healthy; stop all on Ctrl-C.")
    add_arguments(up, UpConfig)


def add_profile(commands: argparse._SubParsersAction) -> None:
    from kvcentric.engine.config import ProfileConfig
    profile = commands.add_parser("profile", help="time the model here and fit the conductor's cost model",
                                  description="Time prefill over (new x cached tokens) and decode steps over "
                                              "(batch x context), fit T_prefill and T_decode, write JSON.")
    add_arguments(profile, ProfileConfig)


def add_plan(commands: argparse._SubParsersAction) -> None:
    from kvcentric.tools.plan import PlanConfig
    plan = commands.add_parser("plan", help="PrfaaS planner: threshold t and N_p/N_d from a profile and a workload",
                               description="Prefill-as-a-Service throughput model (§3.4, eqs 3-8): grid search "
                                           "over t and N_p/N_d; prints the optimum as Table 6, writes JSON + PNGs.")
    add_arguments(plan, PlanConfig)


def add_helps(commands: argparse._SubParsersAction) -> None:
    """The subcommands with parsers of their own (`main` hands them their arguments), for --help's list."""
    commands.add_parser("bench", help="benchmarks against a running cluster: `kvcentric bench replay TRACE --url ...` "
                                      "sends a Mooncake trace or a Poisson workload as real requests",
                        add_help=False)
    commands.add_parser("certs", help="write a deployment's CA, certificates, NATS and Redis passwords and API key "
                                      "to a folder (`kvcentric certs --help`), for compose and Kubernetes",
                        add_help=False)
    commands.add_parser("sim", help="simulate a cluster replaying a trace with the conductor's core "
                                    "(`kvcentric sim --help`; `kvcentric sim cache` for pool hit ratios)",
                        add_help=False)


def add_role(commands: argparse._SubParsersAction) -> None:
    role = commands.add_parser("role", help="switch an engine instance between prefill and decode (it drains first)",
                               description="Send a RoleSwitch on kvc.control.<id>: the instance finishes its work, "
                                           "takes no new, and serves on in the other role (PrfaaS §3.4.3).")
    role.add_argument("instance_id", help="the engine instance (its --instance-id)")
    role.add_argument("to_role", choices=["prefill", "decode"], help="the role it serves next")
    role.add_argument("--nats-url", default=os.environ.get("KVC_NATS_URL", "nats://127.0.0.1:4222"),
                      help="NATS server (env KVC_NATS_URL)")
    role.add_argument("--reason", default="by hand", help="logged by the instance")
    for name, what in (("tls_ca", "the deployment's CA, to check a TLS NATS server"),
                       ("tls_cert", "certificate to present to NATS"), ("tls_key", "its private key"),
                       ("nats_user", "NATS user (`admin` in `kvcentric up --secure`)"),
                       ("nats_password_file", "file holding its password (else KVC_NATS_PASSWORD)")):
        role.add_argument(flag_name(name), default=os.environ.get(env_name(name), ""),
                          help=f"{what} (env {env_name(name)})")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:  # its own parser, with a `cache` subcommand
        from kvcentric.tools.sim import main as sim_main
        sys.exit(sim_main(argv[1:]))
    if argv[:1] == ["certs"]:  # the material of a secured deployment, its own parser
        from kvcentric.tools.secure import main as certs_main
        sys.exit(certs_main(argv[1:]))
    if argv[:1] == ["bench"]:  # `kvcentric bench replay TRACE ...`, its own parser
        from kvcentric.tools.replay import bench_main
        sys.exit(bench_main(argv[1:]))
    known = ("up", "profile", "plan", "role", *SERVICES)
    parser = build_parser(argv[0] if argv[:1] and argv[0] in known else None)
    try:
        args = parser.parse_args(argv)
        if args.command == "profile":
            from kvcentric.engine.config import ProfileConfig
            from kvcentric.engine.model.profile import main as profile_main
            sys.exit(profile_main(from_namespace(ProfileConfig, args)))
        if args.command == "plan":
            from kvcentric.tools.plan import PlanConfig, main as plan_main
            sys.exit(plan_main(from_namespace(PlanConfig, args)))
        if args.command == "role":
            from kvcentric.runtime.security import NatsAccess, secret_from
            password = secret_from(args.nats_password_file, "nats_password_file", "KVC_NATS_PASSWORD")
            access = NatsAccess(args.nats_url, args.nats_user, password, args.tls_ca, args.tls_cert, args.tls_key)
            sys.exit(switch_role(access, args.instance_id, args.to_role, args.reason))
        if args.command == "up":
            from kvcentric.tools.up import UpConfig, run_up
            sys.exit(run_up(from_namespace(UpConfig, args)))
        config = from_namespace(_config_class(args.command), args)
        from kvcentric.runtime.security import check_files
        check_files(config)  # a missing or bad certificate, key or password file names its flag now
    except ConfigError as exc:
        parser.exit(2, f"kvcentric: error: {exc}\n")
    from kvcentric.runtime.service import Service, run_service
    try:
        service: type[Service] = service_class(args.command)
        run_service(service(service.prepare_process(config)))
    except (MemoryError, ConnectionError, OSError) as exc:
        parser.exit(1, f"kvcentric {args.command}: {exc}\n")


def switch_role(access, instance_id: str, role: Literal["prefill", "decode"], reason: str,
                timeout_s: float = 5.0) -> int:
    """`kvcentric role`: ask one engine to drain and switch (`access`: a NATS URL, or a NatsAccess with
    credentials); 0 when it agreed."""
    import nats
    import nats.errors

    from kvcentric.core.protocol import RoleSwitch, Subjects, SubmitAck, decode, encode
    from kvcentric.runtime.security import NatsAccess

    access = NatsAccess(access) if isinstance(access, str) else access
    nats_url = access.url

    async def ask() -> SubmitAck:
        nc = await nats.connect(nats_url, connect_timeout=timeout_s, allow_reconnect=False, max_reconnect_attempts=0,
                                **access.options())
        try:
            switch = encode(RoleSwitch(role=role, reason=reason))
            reply = await nc.request(Subjects.control(instance_id), switch, timeout_s)
            return decode(reply.data, SubmitAck)
        finally:
            await nc.close()

    try:
        ack = asyncio.run(ask())
    except nats.errors.NoRespondersError:
        print(f"kvcentric role: no engine {instance_id!r} listens on {nats_url}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        print(f"kvcentric role: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not ack.ok:
        print(f"kvcentric role: {instance_id} refused: {ack.error}", file=sys.stderr)
        return 1
    print(f"{instance_id}: {ack.error or f'draining, then serving as {role}'}")
    return 0
