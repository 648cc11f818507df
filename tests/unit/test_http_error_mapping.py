"""What `HttpServer` answers for whatever a handler raised: a dependency down is a 503 with Retry-After, a
true bug a 500, aiohttp's refusals and the handler's own ApiError as they are; all OpenAI error objects."""

from __future__ import annotations

import nats.errors
import pytest
import redis.exceptions
from aiohttp import web

from kvcentric.core.openai_api import ApiError
from kvcentric.runtime.http import error_for


def answer(exc: Exception) -> ApiError:
    return error_for(exc, "GET", "/batch_query_keys", 1 << 20)


@pytest.mark.parametrize("exc, dependency", [
    (redis.exceptions.ConnectionError("Connection refused"), "Redis"),
    (redis.exceptions.BusyLoadingError("loading"), "Redis"),
    (nats.errors.ConnectionDrainingError(), "NATS"),
    (nats.errors.ConnectionClosedError(), "NATS"),
    (nats.errors.NoRespondersError(), "NATS"),
    (ConnectionRefusedError(111, "refused"), "a dependency"),
])
def test_a_dependency_down_is_a_503_with_retry_after(exc, dependency):
    error = answer(exc)
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert error.body()["error"]["type"] == "service_unavailable" and error.message.startswith(dependency)


def test_a_bug_is_a_500_in_json():
    error = answer(KeyError("x"))
    assert error.status == 500 and error.body()["error"]["type"] == "server_error" and "KeyError" in error.message


def test_aiohttps_refusals_and_the_handlers_own_errors_keep_their_meaning():
    assert answer(web.HTTPNotFound()).status == 404
    assert answer(web.HTTPRequestEntityTooLarge(1 << 20, 2 << 20)).body()["error"]["code"] == "request_too_large"
    own = ApiError(408, "slow", code="request_timeout")
    assert answer(own) is own


def test_a_405_says_which_methods_the_path_takes():
    error = answer(web.HTTPMethodNotAllowed("GET", ["POST", "OPTIONS"]))
    assert error.status == 405 and error.headers["Allow"] == "OPTIONS, POST"
    assert error.body()["error"]["code"] == "method_not_allowed"
