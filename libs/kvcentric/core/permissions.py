"""Who may publish and subscribe to what on the bus: one NATS user per kind of service, its subjects derived from
`Subjects`, so that only conductors hand jobs to engines, only engines (and a conductor failing a request) publish
tokens and load, and the gateway reads only tokens, load and conductor heartbeats. It decides the table; writing
it into a server's config is `kvcentric.tools.secure`'s, enforcing it is nats-server's.

NATS matches whole subject tokens, so a user is held to a kind of subject, never to one request: any gateway may
read any request's tokens, any engine take any engine's jobs. Replies go to the asker's inbox, which a user
publishes to only in answer to a request it received (`allow_responses`); each user's inbox subjects start with
`_INBOX.<user>`, so no other user can read its replies.
"""

from __future__ import annotations

import dataclasses

from kvcentric.core.protocol import Subjects

ENGINE_ROLES = ("prefill", "decode", "colocated")
"""The engine roles: one `engine` user for all, since an engine changes role in its process."""


@dataclasses.dataclass(frozen=True)
class Permissions:
    """What one NATS user may do: subjects it may publish and subscribe to (wildcards as NATS reads them)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False
    """It answers requests (a reply goes to the asker's inbox, allowed only as an answer)."""


def inbox_prefix(user: str) -> str:
    """The prefix of `user`'s reply subjects; `_INBOX` (nats-py's own) for a connection without a user."""
    return f"_INBOX.{user}" if user else "_INBOX"


def _all_roles(subject_of) -> tuple[str, ...]:
    return tuple(subject_of(role, "*") for role in ENGINE_ROLES)


JOBS = _all_roles(Subjects.submit)
TOKENS = Subjects.out("*")
CANCELS = Subjects.CANCEL_ALL


def _table() -> dict[str, Permissions]:
    return {
        "conductor": Permissions(
            publish=(*JOBS, Subjects.CONDUCTORS, CANCELS, TOKENS, Subjects.KVS_QUERY, Subjects.KVS_DUMP,
                     Subjects.KV_RESYNC, Subjects.control("*")),
            subscribe=(Subjects.KV_EVENTS_ALL, Subjects.LOAD_ALL, Subjects.SCHEDULE, Subjects.schedule_at("*"),
                       Subjects.OUTCOME, Subjects.FIRST_TOKEN, Subjects.INSTANCES, Subjects.CONDUCTORS),
            responds=True),
        "gateway": Permissions(
            publish=(Subjects.SCHEDULE, Subjects.schedule_at("*"), Subjects.INSTANCES, Subjects.OUTCOME,
                     Subjects.FIRST_TOKEN, CANCELS),
            subscribe=(Subjects.CONDUCTORS, TOKENS, Subjects.LOAD_ALL)),
        "engine": Permissions(
            publish=(Subjects.LOAD_ALL, Subjects.kv_events("*"), Subjects.kv_digest("*"), TOKENS),
            subscribe=(*JOBS, CANCELS, Subjects.control("*"), Subjects.KV_RESYNC, Subjects.kv_snapshot("*")),
            responds=True),
        "kvs-meta": Permissions(
            publish=(Subjects.KV_RESYNC, Subjects.kv_snapshot("*"), Subjects.kv_events("*")),
            subscribe=(Subjects.KV_EVENTS_ALL, Subjects.KVS_QUERY, Subjects.KVS_DUMP, Subjects.LOAD_ALL,
                       Subjects.KV_DIGEST_ALL),
            responds=True),
        "messenger": Permissions(publish=(), subscribe=()),
        "admin": Permissions(publish=(Subjects.control("*"),), subscribe=()),
    }


ROLES: dict[str, Permissions] = _table()
"""Each NATS user and what it may do; `admin` is `kvcentric role` (switching an engine's role by hand)."""


def user_of(service: str) -> str:
    """The NATS user a service of this kind connects as (`kvcentric up --secure`, the deploy manifests)."""
    return "engine" if service in ENGINE_ROLES else service


def permissions(user: str) -> Permissions:
    """`user`'s permissions, its own inbox added to what it may subscribe to."""
    granted = ROLES[user]
    return dataclasses.replace(granted, subscribe=(*granted.subscribe, inbox_prefix(user) + ".>"))
