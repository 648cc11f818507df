"""What the HTTP layer refuses is an OpenAI error object too, through a real `kvcentric up` cluster: an unknown
path (404), a wrong method (405), a body over the limit (400 request_too_large, not aiohttp's plain 413);
`GET /v1/models/{id}` answers with the official `openai` client; the client's X-Request-ID comes back."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest


def call(url: str, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.load(response)
    except urllib.error.HTTPError as exc:
        assert exc.headers.get_content_type() == "application/json", exc.read()[:200]
        return exc.code, dict(exc.headers), json.load(exc)


def test_an_unknown_path_and_a_wrong_method_are_openai_errors(cluster):
    status, _, body = call(cluster.url + "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, headers, body = call(cluster.url + "/v1/completions")  # GET on a POST route
    assert status == 405 and body["error"]["code"] == "method_not_allowed" and headers["Allow"] == "POST"


def test_a_body_over_the_limit_is_a_400_request_too_large(cluster):
    big = json.dumps({"model": "tiny", "prompt": "x" * (2 << 20), "max_tokens": 1}).encode()
    status, _, body = call(cluster.url + "/v1/completions", "POST", big)
    assert status == 400 and body["error"]["code"] == "request_too_large"


def test_models_retrieve_with_the_openai_client(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none")
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    assert raised.value.body["code"] == "model_not_found"


def test_the_clients_request_id_is_kept(cluster):
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    status, headers, _ = call(cluster.url + "/v1/completions", "POST", body, {"X-Request-ID": "client-abc-123"})
    assert status == 200 and headers["x-request-id"] == "client-abc-123"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": 2 ** 63}, "seed"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": -(2 ** 63) - 1}, "seed"),
])
def test_a_seed_beyond_64_bits_is_a_400_naming_it(cluster, body, param):
    status, _, answer = call(cluster.url + "/v1/completions", "POST", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == param


def test_a_temperature_too_small_to_divide_by_is_greedy(cluster):
    base = {"model": "tiny", "prompt": "greedy, please", "max_tokens": 6, "ignore_eos": True}
    tiny = call(cluster.url + "/v1/completions", "POST", json.dumps({**base, "temperature": 1e-39}).encode())
    greedy = call(cluster.url + "/v1/completions", "POST", json.dumps({**base, "temperature": 0}).encode())
    assert tiny[0] == greedy[0] == 200
    assert tiny[2]["choices"][0]["text"] == greedy[2]["choices"][0]["text"]


def test_a_bogus_charset_and_deep_nesting_are_400s_in_json(cluster):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
    status, _, answer = call(cluster.url + "/v1/completions", "POST", body,
                             {"Content-Type": "application/json; charset=bogus"})
    assert status == 400 and "charset" in answer["error"]["message"]
    deep = b"[" * 100_000 + b"]" * 100_000
    status, _, answer = call(cluster.url + "/v1/completions", "POST", deep)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
