"""Overload control that bites early, on a real small cluster (`kvcentric up`, 1 prefill + 1 decode of `small`, one
conductor, the default SLOs: TTFT 10x the unloaded prefill of the prompt, TBT 5x the unloaded step, so the burst
overloads whatever this machine's speed, and `--burst-s 0`: every request held to its SLO, as the paper's admission,
where by default a burst the prefill clears within 60 s is queued, test_burst_queued.py): a burst far beyond what the
prefill can compute within the SLO is admitted only up to it, once both engines have measured themselves (a
calibration timed while the machine was busy is a guess, which admission does not refuse work on, until the engine
measured itself again). The prefill reports its T_queue (the sum of its queued prefills' predicted times, Mooncake
§6.1), the requests it holds and the tokens it still has to compute; the conductor counts every placement until a
report lists it; every request is answered 200 (completed) or 429 with Retry-After at once, none 5xx; every admitted
one was predicted within the SLO it was admitted under; and once the burst is over no placement is left counted in
flight."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import nats

from harness import UpProcess
from kvcentric.core.protocol import LoadReport, decode
from waiting import eventually

BURST = 60
PROMPT_TOKENS = 600  # 60 of them take 60 unloaded prefills: 6x the default TTFT SLO of 10, on any machine


async def one(session: aiohttp.ClientSession, url: str, index: int) -> dict:
    body = {"model": "small", "prompt": f"{index:04d} " + "overload " * (PROMPT_TOKENS // 9), "max_tokens": 8,
            "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as response:
        text = await response.text()
        return {"status": response.status, "answered_s": time.monotonic() - sent,
                "retry_after": response.headers.get("Retry-After", ""),
                "predicted_ttft_s": float(response.headers.get("x-kvcentric-predicted-ttft-s", "-1")),
                "ttft_slo_s": float(response.headers.get("x-kvcentric-ttft-slo-s", "-1")),
                "done": "[DONE]" in text and '"error"' not in text, "text": text[-300:]}


async def burst_watching_reports(up: UpProcess) -> tuple[list[dict], list[LoadReport]]:
    """The burst's answers, and the prefill load reports seen while it ran."""
    reports: list[LoadReport] = []
    connection = await nats.connect(up.manifest["nats_url"])

    async def on_report(message) -> None:
        reports.append(decode(message.data, LoadReport))
    await connection.subscribe("kvc.load.prefill.>", cb=on_report)
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            answers = await asyncio.gather(*(one(session, up.url, i) for i in range(BURST)))
    finally:
        await connection.close()
    return answers, reports


def conductor_gauge(up: UpProcess, name: str) -> float:
    import urllib.request
    url = up.reload()["services"]["conductor-0"]["health_url"].replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"kvc_{name}{{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no gauge {name}")


def model_sources(up: UpProcess) -> dict:
    """instance -> role -> where the conductor's model of it comes from ("measured" once it may refuse work)."""
    return {instance: view["model_source"] for instance, view in up.health("conductor-0")["instances"].items()}


def test_a_burst_is_admitted_up_to_the_ttft_slo_and_the_rest_get_429_at_once(tmp_path):
    up = UpProcess(str(tmp_path), "--prefill", "1", "--decode", "1", "--model", "small", "--conductors", "1",
                   timeout_s=240.0, env={"KVC_BURST_S": "0"})
    try:
        eventually(lambda: model_sources(up), "both engines measured (not a busy machine's guess)", timeout_s=120,
                   every_s=0.5, until=lambda sources: sources == {"prefill-0": {"prefill": "measured"},
                                                                  "decode-0": {"decode": "measured"}})
        answers, reports = asyncio.run(burst_watching_reports(up))
        statuses = [a["status"] for a in answers]
        assert set(statuses) <= {200, 429}, [a for a in answers if a["status"] not in (200, 429)][:3]
        admitted = [a for a in answers if a["status"] == 200]
        rejected = [a for a in answers if a["status"] == 429]
        assert admitted and rejected, (statuses, rejected[:1])
        assert all(a["done"] for a in admitted), [a["text"] for a in admitted if not a["done"]][:3]
        assert all(0 < a["predicted_ttft_s"] <= a["ttft_slo_s"] + 1e-6 for a in admitted), admitted
        assert all(float(a["retry_after"]) >= 1 for a in rejected), rejected[:3]
        # rejected before any prefill was spent on them: answered while the admitted ones still waited
        assert min(a["answered_s"] for a in rejected) < max(a["answered_s"] for a in admitted)
        busy = [r for r in reports if not r.repeat and r.prefill_ids]
        assert busy, "no prefill report listed its requests"
        assert all(r.est_queue_s > 0 and r.queued_uncached_tokens > 0 for r in busy), busy[:3]
        assert max(len(r.prefill_ids or []) for r in busy) <= len(admitted)
        eventually(lambda: conductor_gauge(up, "placements_in_flight"), "no placement left in flight",
                   until=lambda left: left == 0, timeout_s=30)
    finally:
        up.stop()
