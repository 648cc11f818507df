"""Bursts are queued, overload is refused (issue 48), on a real small cluster (`kvcentric up`, 1 prefill + 1 decode of
`small`, one conductor, every default): 32 streamed requests of 500-token prompts sent at once, once both engines
have measured themselves (so admission judges on a measurement, not a guess). The last of them waits for 31 prefills,
several times its relative TTFT SLO (10x its unloaded prefill, at least 1 s) on any machine; the deployment clears the
burst in seconds, so every one is queued, none refused, at the conductor or by the decode instance after its prefill;
each stream's status and headers come when it is placed, before its first token; and the conductor counts the
requests it queued past their SLO."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import aiohttp

from harness import UpProcess
from test_overload_admission import model_sources
from waiting import eventually

BURST = 32
PROMPT_TOKENS = 500


async def one(session: aiohttp.ClientSession, url: str, index: int) -> dict:
    body = {"model": "small", "prompt": f"{index:04d} " + "queued " * (PROMPT_TOKENS // 7), "max_tokens": 8,
            "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as response:
        headers_s, first_data_s, text = time.monotonic() - sent, None, []
        async for line in response.content:
            if first_data_s is None and line.startswith(b"data: {"):
                first_data_s = time.monotonic() - sent
            text.append(line.decode())
        whole = "".join(text)
        return {"status": response.status, "headers_s": headers_s, "first_data_s": first_data_s,
                "predicted_ttft_s": float(response.headers.get("x-kvcentric-predicted-ttft-s", "-1")),
                "ttft_slo_s": float(response.headers.get("x-kvcentric-ttft-slo-s", "-1")),
                "done": "[DONE]" in whole and '"error"' not in whole, "text": whole[-300:]}


async def burst(url: str) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        return await asyncio.gather(*(one(session, url, i) for i in range(BURST)))


def metric(up: UpProcess, service: str, name: str) -> float:
    """A metric's value (summed over its label sets), 0 when it has none yet."""
    url = up.reload()["services"][service]["health_url"].replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"kvc_{name} ") or line.startswith(f"kvc_{name}{{"))


def test_with_defaults_a_burst_of_32_is_queued_and_every_request_completes(tmp_path):
    up = UpProcess(str(tmp_path), "--prefill", "1", "--decode", "1", "--model", "small", "--conductors", "1",
                   timeout_s=240.0)
    try:
        assert up.health("conductor-0")["burst_s"] == 60.0
        eventually(lambda: model_sources(up), "both engines measured (not a busy machine's guess)", timeout_s=120,
                   every_s=0.5, until=lambda sources: sources == {"prefill-0": {"prefill": "measured"},
                                                                  "decode-0": {"decode": "measured"}})
        answers = asyncio.run(burst(up.url))
        refused = [a for a in answers if a["status"] != 200 or not a["done"]]
        assert not refused, (len(refused), refused[:2])
        assert all(a["first_data_s"] is not None and a["headers_s"] <= a["first_data_s"] for a in answers)
        # the queued ones knew at once that they were admitted: headers well before their first token
        assert max(a["first_data_s"] - a["headers_s"] for a in answers) > 0.3, answers
        beyond = [a for a in answers if a["predicted_ttft_s"] > a["ttft_slo_s"] > 0]
        assert beyond, "no request of the burst was predicted past its SLO: the burst tested nothing"
        assert metric(up, "conductor-0", "burst_queued_total") > 0
        assert metric(up, "conductor-0", "rejections_prefill_total") == 0
        assert metric(up, "decode-0", "rejections_total") == 0  # nothing computed was refused
    finally:
        up.stop()
