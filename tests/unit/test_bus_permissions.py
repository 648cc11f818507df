"""The NATS users of a secured cluster and what each may do: only conductors hand jobs to engines, only engines
and conductors put tokens on a request's output, only engines report load, the gateway reads only tokens, load and
conductor heartbeats; and the config written for nats-server is one the real server accepts."""

from __future__ import annotations

import subprocess

from kvcentric.core.permissions import ROLES, inbox_prefix, permissions, user_of
from kvcentric.core.protocol import Subjects
from kvcentric.tools.processes import nats_server_binary
from kvcentric.tools.secure import make_secure_files, nats_conf


def may(user: str, direction: str, subject: str) -> bool:
    """Whether `subject` matches one of `user`'s patterns, as NATS matches them (token by token)."""
    def matches(pattern: str) -> bool:
        wanted, got = pattern.split("."), subject.split(".")
        for index, token in enumerate(wanted):
            if token == ">":
                return len(got) > index
            if index >= len(got) or (token != "*" and token != got[index]):
                return False
        return len(wanted) == len(got)
    return any(matches(pattern) for pattern in getattr(permissions(user), direction))


def test_only_conductors_publish_jobs():
    for role in ("prefill", "decode", "colocated"):
        job = Subjects.submit(role, "x-1")
        assert [user for user in ROLES if may(user, "publish", job)] == ["conductor"]
        assert [user for user in ROLES if may(user, "subscribe", job)] == ["engine"]


def test_tokens_and_load_come_only_from_engines_and_a_conductor_failing_a_request():
    assert sorted(user for user in ROLES if may(user, "publish", Subjects.out("r1"))) == ["conductor", "engine"]
    assert [user for user in ROLES if may(user, "publish", Subjects.load("decode", "d-0"))] == ["engine"]
    assert [user for user in ROLES if may(user, "subscribe", Subjects.out("r1"))] == ["gateway"]


def test_the_gateway_reads_only_tokens_load_conductor_heartbeats_and_its_own_inbox():
    gateway = permissions("gateway")
    assert set(gateway.subscribe) == {Subjects.out("*"), Subjects.LOAD_ALL, Subjects.CONDUCTORS, "_INBOX.gateway.>"}
    assert not gateway.responds
    for subject in (Subjects.submit("prefill", "p"), Subjects.kv_events("n"), Subjects.KVS_QUERY,
                    Subjects.control("d-0"), "_INBOX.conductor.abc.1"):
        assert not may("gateway", "subscribe", subject) and not may("gateway", "publish", subject), subject


def test_each_user_reads_replies_only_in_its_own_inbox():
    for user in ROLES:
        inboxes = [pattern for pattern in permissions(user).subscribe if pattern.startswith("_INBOX")]
        assert inboxes == [inbox_prefix(user) + ".>"]
    assert inbox_prefix("") == "_INBOX"  # a connection without a user keeps nats-py's own


def test_every_engine_role_connects_as_the_engine_user():
    assert {user_of(role) for role in ("prefill", "decode", "colocated")} == {"engine"}
    assert user_of("gateway") == "gateway" and user_of("kvs-meta") == "kvs-meta"


def test_the_secured_nats_config_is_one_nats_server_accepts(tmp_path):
    files = make_secure_files(str(tmp_path / "s"))
    check = subprocess.run([nats_server_binary(), "-t", "-c", files.nats_conf], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    text = nats_conf("ca.pem", "c.pem", "k.pem", {"messenger": "pw"})
    assert 'publish: {deny: [">"]}' in text and "verify: true" in text
