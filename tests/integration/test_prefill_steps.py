"""A prefill instance with --prefill-step-tokens computes chunks of several queued prompts in one pass, on real
NATS, Redis and gRPC: every concurrent request still gets the tokens single-process generation gives, and the
instance took fewer passes than chunks."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

from factories import make_pool, make_runner
from harness import UpProcess
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
from kvcentric.model.tokenizer import ByteTokenizer


def complete(url: str, token_ids: list[int], max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]


def reference(token_ids: list[int], max_tokens: int) -> str:
    runner = make_runner(num_blocks=64, block_size=16, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ByteTokenizer().decode(generate(runner, make_pool(runner), token_ids, params)[0])


def test_concurrent_prompts_share_passes_and_get_the_reference_tokens(tmp_path):
    prompts = [[1] + [(17 * i + 5 * j) % 250 + 3 for j in range(90 + 13 * i)] for i in range(6)]
    up = UpProcess(str(tmp_path), env={"KVC_PREFILL_STEP_TOKENS": "256", "KVC_PREFILL_CHUNK": "32"})
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda p: complete(up.url, p, 6), prompts))
        stats = up.health("prefill-0")["stats"]
    finally:
        up.stop()
    assert outputs == [reference(p, 6) for p in prompts]
    assert stats["prefill_chunks"] == sum(-(-len(p) // 32) for p in prompts)
    assert stats["prefill_passes"] < stats["prefill_chunks"]  # some passes computed several prompts
