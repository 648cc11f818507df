"""Hot-spot replication on real servers: a prefix computed on prefill node A is pulled over gRPC by node B,
which then computes only the rest; the tokens equal a run without any cache, and kvs-meta lists both."""

from __future__ import annotations

import json
import urllib.request

import nats
import pytest

from factories import make_pool, make_runner
from kvcentric.engine.model.local import generate
from kvcentric.core.hashing import BlockHasher, to_hex
from harness import UpProcess
from waiting import eventually
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.core.protocol import (DecodeJob, PrefillJob, SamplingParams, SubmitAck, Subjects, TokenChunk, decode,
                                encode)

PROMPT = "Hot-spot replication copies popular prefix blocks to the prefill node that needs them. " * 2
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-pull")), "--prefill", "2", "--decode", "1")
    try:
        yield up
    finally:
        up.stop()


def complete(url: str) -> tuple[str, str]:
    body = {"prompt": PROMPT, "max_tokens": PARAMS.max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.headers["x-kvcentric-prefill"], json.load(response)["choices"][0]["text"]


async def prefill_on(nats_url: str, prefill_id: str, token_ids: list[int], source_addr: str,
                     hashes: list[str], decode_addr: str) -> list[int]:
    """Send the request straight to one prefill instance, as a placement with a pull would."""
    nc = await nats.connect(nats_url)
    try:
        outputs = await nc.subscribe(Subjects.out("pulled"))
        decode_job = DecodeJob(request_id="pulled", n_prompt_tokens=len(token_ids), sampling=PARAMS)
        prefill_job = PrefillJob(request_id="pulled", token_ids=token_ids, sampling=PARAMS, decode_id="decode-0",
                                 decode_kv_addr=decode_addr, kv_source_addr=source_addr, pull_block_hashes=hashes)
        for subject, job in ((Subjects.submit("decode", "decode-0"), decode_job),
                             (Subjects.submit("prefill", prefill_id), prefill_job)):
            assert decode((await nc.request(subject, encode(job), timeout=10)).data, SubmitAck).ok
        tokens = []
        while True:
            chunk = decode((await outputs.next_msg(timeout=60)).data, TokenChunk)
            assert chunk.finish_reason != "error", chunk.error
            tokens += chunk.token_ids
            if chunk.finish_reason:
                return tokens
    finally:
        await nc.close()


async def test_node_b_pulls_the_prefix_from_node_a_and_generates_the_same_tokens(two_prefills):
    holder, text = complete(two_prefills.url)
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    token_ids = ByteTokenizer().encode(PROMPT)
    hashes = [to_hex(h) for h in BlockHasher(block_size=16).hash_blocks(token_ids)]
    # A's blocks enter its host pool behind the compute (write-behind): pull once they are there, else B rightly
    # computes the prefix itself
    a = eventually(lambda: two_prefills.health(holder), "node A's host pool holds the prefix",
                   until=lambda health: health["stats"]["host_blocks"] >= len(hashes), timeout_s=10)
    b = two_prefills.health(other)
    tokens = await prefill_on(two_prefills.manifest["nats_url"], other, token_ids, a["kv_addr"], hashes,
                              two_prefills.health("decode-0")["kv_addr"])
    runner = make_runner(num_blocks=64, block_size=16)
    assert tokens == generate(runner, make_pool(runner), token_ids, PARAMS)[0]  # no cache anywhere
    assert ByteTokenizer().decode(tokens) == text
    pulled_tokens = len(hashes) * 16
    before = b["stats"].get("prefill_tokens_from_host", 0)
    after = eventually(lambda: two_prefills.health(other)["stats"], "node B's stats count the prefix it loaded",
                       until=lambda stats: stats["prefill_tokens_from_host"] > before, timeout_s=10)  # a snapshot
    assert after["prefill_tokens_from_host"] - before == pulled_tokens
    assert after["prefill_tokens_computed"] - b["stats"].get("prefill_tokens_computed", 0) == \
        len(token_ids) - pulled_tokens
    assert two_prefills.health(holder)["stats"]["blocks_served"] == len(hashes)
    url = two_prefills.manifest["services"]["kvs-meta"]["health_url"].replace("/health", "/batch_query_keys")


    def holders() -> list[set[str]]:
        with urllib.request.urlopen(f"{url}?keys={','.join(hashes)}") as response:
            data = json.load(response)["data"]
        return [{v["node_id"] for v in data[h].get("values", [])} for h in hashes]
    nodes = eventually(holders, f"kvs-meta lists {holder} and {other} for every block",
                       until=lambda nodes: all({holder, other} <= n for n in nodes), every_s=0.1)
    assert all({holder, other} <= n for n in nodes), nodes
