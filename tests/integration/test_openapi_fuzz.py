"""Schemathesis fuzzes the gateway from its own /openapi.json, on a real cluster: no answer is a 5xx, every
answer has a documented status, content type and shape, and whatever the schema forbids is refused."""

from __future__ import annotations

import os
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
BUDGET_S = float(os.environ.get("KVC_FUZZ_BUDGET_S", "50"))
"""What the whole fuzzing may take; once spent, the remaining examples are skipped."""
EXAMPLES = int(os.environ.get("KVC_FUZZ_EXAMPLES", "40"))
"""Generated requests per operation that takes a body (a quarter of it per bodiless GET). A long run, say
KVC_FUZZ_EXAMPLES=1000 KVC_FUZZ_BUDGET_S=1200, makes several thousand."""
MAX_GENERATED = 8
"""Completion budget given to generated requests that ask for more (or name none): the tiny model on a CPU
takes seconds for the 2047 tokens the schema allows."""


MAX_BATCH = 4
"""Prompts kept of a generated batch (each runs as a request of its own)."""


def bound_generation(body, valid: bool) -> None:
    """Cap the completion budget and the batch of a generated valid request (smaller ones are as valid). An
    invalid one is left as it is: capping a budget beyond the context, or cutting a batch, could make it valid,
    and the server refuses it before generating anything."""
    if not isinstance(body, dict) or not valid:
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > MAX_GENERATED:
            body[name] = MAX_GENERATED
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_GENERATED
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:MAX_BATCH]


def fuzz(operation, mode: GenerationMode, examples: int, deadline: float) -> int:
    """Run up to `examples` generated requests against the operation until `deadline`; how many ran."""
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case) -> None:
        nonlocal calls
        if time.monotonic() > deadline:
            return
        bound_generation(case.body, mode == GenerationMode.POSITIVE)
        case.call_and_validate(checks=CHECKS, timeout=60)
        calls += 1
    run()
    return calls


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_gateway_does_what_its_openapi_document_says(cluster, mode):
    schema = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    deadline = time.monotonic() + BUDGET_S / 2
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}"}
    calls = {}
    for operation in operations:
        takes_a_body = operation.method.upper() == "POST"
        if takes_a_body or mode == GenerationMode.POSITIVE:  # a bodiless GET has no invalid input to make
            calls[operation.path] = fuzz(operation, mode, EXAMPLES if takes_a_body else EXAMPLES // 4, deadline)
    print(mode, calls)
    assert calls["/v1/completions"] >= 20 and calls["/v1/chat/completions"] >= 10


def test_without_a_key_the_document_asks_for_none(cluster):
    document = schemathesis.openapi.from_url(cluster.url + "/openapi.json").raw_schema
    assert "components" not in document
    assert all("security" not in operation for path in document["paths"].values() for operation in path.values())
