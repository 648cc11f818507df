"""PrfaaS §3.4.3 role change on a running `kvcentric up`: `kvcentric role <id> <role>` drains an engine
(a request it is decoding finishes), and the same process serves on, under the same id, in the other
role; the conductor places by the new roles and the tokens stay those of the model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.request

import nats
import pytest

from harness import UpProcess
from waiting import eventually
from kvcentric.core.protocol import InstancesQuery, InstancesReply, RoleSwitch, Subjects, SubmitAck, decode, encode

PROMPT = "A prefill instance becomes a decode instance when decode is the bottleneck. "


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-roles")), "--prefill", "1", "--decode", "2")
    try:
        yield up
    finally:
        up.stop()


def complete(url: str, max_tokens: int = 8) -> tuple[dict, str]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return dict(response.headers), json.load(response)["choices"][0]["text"]


def roles(nats_url: str) -> dict[str, set[str]]:
    async def ask():
        nc = await nats.connect(nats_url)
        try:
            reply = await nc.request(Subjects.INSTANCES, encode(InstancesQuery()), timeout=2)
            return decode(reply.data, InstancesReply).instances
        finally:
            await nc.close()
    found: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for instance in asyncio.run(ask()):
        found[instance.role].add(instance.instance_id)
    return found


def wait_for_roles(nats_url: str, prefill: set[str], decode_: set[str], timeout_s: float = 30.0) -> None:
    want = {"prefill": prefill, "decode": decode_}
    eventually(lambda: roles(nats_url), f"roles {want}", until=lambda seen: seen == want, timeout_s=timeout_s,
               every_s=0.2)


def switch(nats_url: str, instance_id: str, role: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcentric", "role", instance_id, role, "--nats-url", nats_url],
                          capture_output=True, text=True, timeout=30)


def test_engines_switch_roles_after_draining_and_serve_the_same_tokens(cluster):
    nats_url = cluster.manifest["nats_url"]
    wait_for_roles(nats_url, {"prefill-0"}, {"decode-0", "decode-1"})
    _, reference = complete(cluster.url)

    # A long request is decoding when its decode instance is told to switch: it still finishes.
    def committed(name: str) -> int:
        return cluster.health(name)["stats"].get("kv_streams_committed", 0)

    results, before = {}, {name: committed(name) for name in ("decode-0", "decode-1")}
    long_request = threading.Thread(target=lambda: results.update(long=complete(cluster.url, max_tokens=96)))
    long_request.start()
    busy = eventually(lambda: next((name for name in before if committed(name) > before[name]), None),
                      "the long request reached a decode instance", timeout_s=30, every_s=0.02)
    assert busy is not None, "the long request never reached a decode instance"
    done = switch(nats_url, busy, "prefill")
    assert done.returncode == 0, done.stderr
    long_request.join(60)
    headers, text = results["long"]
    assert headers["x-kvcentric-decode"] == busy and len(text) > 0
    other = ({"decode-0", "decode-1"} - {busy}).pop()
    wait_for_roles(nats_url, {"prefill-0", busy}, {other})

    # Then the original prefill instance becomes a decode one: the switched instance is the only prefill.
    assert switch(nats_url, "prefill-0", "decode").returncode == 0
    wait_for_roles(nats_url, {busy}, {other, "prefill-0"})
    headers, text = complete(cluster.url)
    assert headers["x-kvcentric-prefill"] == busy and text == reference


def test_role_commands_are_validated(cluster):
    nats_url = cluster.manifest["nats_url"]
    nobody = switch(nats_url, "no-such-instance", "decode")
    assert nobody.returncode == 1 and "no engine" in nobody.stderr

    target = sorted(roles(nats_url)["decode"])[0]

    async def raw(payload: bytes) -> SubmitAck:
        nc = await nats.connect(nats_url)
        try:
            return decode((await nc.request(Subjects.control(target), payload, timeout=5)).data, SubmitAck)
        finally:
            await nc.close()

    bad = asyncio.run(raw(b"\x93not a role switch"))
    assert not bad.ok and bad.error
    bad_role = asyncio.run(raw(encode({"role": "gateway"})))
    assert not bad_role.ok
    assert asyncio.run(raw(encode(RoleSwitch(role="decode")))).ok  # already decode: nothing to do


def test_the_conductor_switches_an_idle_prefill_instance_when_decode_is_the_bottleneck(tmp_path):
    """--replan-interval-s on: decode holds one sequence at a time (--max-batch 1) and a burst queues
    behind it while both prefill instances idle, so the conductor turns one prefill into decode."""
    env = {"KVC_REPLAN_INTERVAL_S": "0.2", "KVC_REPLAN_WINDOW_S": "2", "KVC_REPLAN_BS_MAX": "1",
           "KVC_DECODE_TIME_S": "2", "KVC_MAX_BATCH": "1"}
    up = UpProcess(str(tmp_path), "--prefill", "2", "--decode", "1", env=env)
    try:
        nats_url = up.manifest["nats_url"]
        wait_for_roles(nats_url, {"prefill-0", "prefill-1"}, {"decode-0"})
        results = []
        burst = [threading.Thread(target=lambda: results.append(complete(up.url, max_tokens=64))) for _ in range(6)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(120)
        assert len(results) == 6 and all(text for _, text in results)  # nothing lost to the switch
        seen = eventually(lambda: roles(nats_url), "one prefill and two decode instances",
                          until=lambda seen: len(seen["prefill"]) == 1 and len(seen["decode"]) == 2, timeout_s=30,
                          every_s=0.2)
        assert len(seen["prefill"]) == 1 and seen["decode"] >= {"decode-0"}, seen
        replan = up.health("conductor-0")["replan"]  # the leader (lowest id) decides switches
        assert replan["switches"] and replan["switches"][0]["to"] == "decode" and replan["switches"][0]["ok"]
        assert "decode is the bottleneck" in replan["switches"][0]["reason"]
        _, text = complete(up.url)  # and the new split serves
        assert text
    finally:
        up.stop()
