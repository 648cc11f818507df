"""`kvcentric up` with one prefill and one decode instance on the CPU lends cores between them
(`kvcentric.engine.service.coreshare`): both keep a slot in the cluster's directory, the prefill computes prompts on the
decode's idle core, a burst is served in full through the openai client, and the directory goes with the
cluster."""

from __future__ import annotations

import concurrent.futures
import os
import signal

from pathlib import Path

import openai

from kvcentric.engine.service.coreshare import PID, Slot

from conftest import start_up
from waiting import eventually


def test_a_prefill_computes_on_the_idle_decode_core_and_every_request_of_a_burst_ends(tmp_path):
    cluster = start_up(tmp_path, "--prefill", "1", "--decode", "1", "--conductors", "1")
    try:
        share = cluster.manifest["core_share_dir"]
        assert sorted(os.listdir(share)) == ["decode-0.cores", "prefill-0.cores"]
        with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            def complete(i: int) -> int:
                reply = client.completions.create(model="tiny", prompt=f"prompt {i} " * 40, max_tokens=12,
                                                  temperature=0, extra_body={"ignore_eos": True})
                return reply.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                assert list(pool.map(complete, range(16))) == [12] * 16
        prefill = cluster.health("prefill-0")["stats"]
        decode = cluster.health("decode-0")["stats"]
        assert prefill["model_calls_on_lent_cores"] >= 1  # the first prompt found the decode idle
        assert decode["torch_threads_now"] in (1, 2)

        said = len(cluster.said)
        os.kill(cluster.manifest["services"]["decode-0"]["pid"], signal.SIGKILL)  # up starts it again
        restarted = int(cluster.wait_said(r"decode-0 restarted \(pid \d+\)", timeout_s=30, after=said)
                        .strip().rsplit("pid ", 1)[1].rstrip(")"))
        eventually(lambda: Slot(Path(share) / "decode-0.cores").read()[PID], "the new decode's slot",
                   until=lambda pid: pid == restarted, timeout_s=120, every_s=0.2)
        with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=2, timeout=60) as client:
            eventually(lambda: client.completions.create(model="tiny", prompt="after", max_tokens=4).usage,
                       "a request served after the restart", until=lambda usage: usage.completion_tokens >= 1,
                       timeout_s=120, every_s=1.0, ignoring=(openai.InternalServerError,))  # 503 until it reports
    finally:
        cluster.stop()
    assert not os.path.exists(share)
