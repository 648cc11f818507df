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
    status, _, body = call(cluster.url + "/v1/completions")  # GET on a POST route
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


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
