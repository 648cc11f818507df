"""`bench/serving/bench_vs_vllm.py` compares each deployment's greedy answers with vLLM's by token ids, and keeps
where a differing answer parts from vLLM's (the position and both tokens), so a near-tie can be looked at later."""

from bench.serving.bench_vs_vllm import compare_outputs, first_difference


def test_a_differing_answer_is_kept_with_where_it_parts_and_each_servers_token_there():
    outputs = {"vLLM": {"p0": {"ids": [1, 2, 3], "text": "abc"}, "p1": {"ids": [5, 6], "text": "ef"},
                        "p2": {"ids": [7], "text": "g"}},
               "ours": {"p0": {"ids": [1, 9, 3], "text": "a?c"}, "p1": {"ids": [5, 6], "text": "ef"}}}
    compared = compare_outputs(outputs)["ours"]
    assert compared == {"same": 1, "prompts": 3, "same_text": 1, "differing": ["p0"], "missing": 1,
                        "first_differences": {"p0": {"position": 1, "ours": 9, "vllm": 2}}}


def test_an_answer_that_stops_early_parts_where_it_ends():
    assert first_difference([4, 5], [4, 5, 6]) == {"position": 2, "ours": None, "vllm": 6}
    assert first_difference([4, 5, 6], [4]) == {"position": 1, "ours": 5, "vllm": None}
