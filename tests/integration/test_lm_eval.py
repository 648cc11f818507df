"""lm-evaluation-harness (`lm-eval`) scores a multiple-choice task defined in a local file with its
`local-completions` model against the gateway serving a locally built Llama checkpoint (no downloads), four
prompts to a request (`batch_size=4`: batched prompts of token ids, each answered at its index): every
loglikelihood equals the one transformers computes on the same checkpoint and tokens, to 1e-3."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import build_checkpoint, hf_model
from harness import UpProcess
from kvcentric.tools.processes import get_json

DOCS = [{"context": "Mooncake schedules requests by", "choices": [" prefix cache hits", " the weather"], "answer": 0},
        {"context": "Layer-wise streaming overlaps the KV", "choices": [" transfer", " cake", " prefill"],
         "answer": 0},
        {"context": "The KVCache-centric architecture separates", "choices": [" prefill and decode", " nothing"],
         "answer": 0}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-lm-eval"), "llama", seed=3)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-lm-eval")), "--model", str(checkpoint))
    try:
        yield up
    finally:
        up.stop()


def write_task(directory) -> str:
    """A multiple-choice task whose documents are a local JSON-lines file."""
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / "kvc_tiny_choice.yaml").write_text(
        "task: kvc_tiny_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    return "kvc_tiny_choice"


def test_lm_eval_loglikelihoods_through_the_gateway_equal_transformers(checkpoint, served, tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = get_json(served.url + "/v1/models")[1]["data"][0]["id"]
    args = (f"model={model},base_url={served.url}/v1/completions,tokenizer={checkpoint},"
            f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,batch_size=4")
    task = write_task(tmp_path)
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                                      task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                      log_samples=True)  # the built-in tasks are not indexed: about 30 s
    samples = results["samples"][task]
    assert len(samples) == len(DOCS)
    lm = lm_eval.api.registry.get_model("local-completions").create_from_arg_string(args)
    reference = hf_model(checkpoint)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = torch.tensor([context_ids + continuation_ids])
            with torch.no_grad():
                logprobs = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
            expected = sum(float(logprobs[len(context_ids) + i - 1, token]) for i, token in enumerate(continuation_ids))
            assert float(response[0][0]) == pytest.approx(expected, abs=1e-3)
