"""The Prometheus text exposition: counters with labels, gauges, histograms."""

from __future__ import annotations

import math

import pytest

from kvcentric.core.metrics import Histogram, labelled, render, split_name


def test_a_histogram_counts_values_into_cumulative_buckets_inclusive_of_the_bound():
    histogram = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 7):
        histogram.observe(value)
    lines = histogram.samples("kvc_x", 'role="g"')
    assert lines == ['kvc_x_bucket{role="g",le="0.1"} 2', 'kvc_x_bucket{role="g",le="1.0"} 3',
                     'kvc_x_bucket{role="g",le="+Inf"} 4', 'kvc_x_sum{role="g"} 7.65', 'kvc_x_count{role="g"} 4']


def test_histogram_quantile_is_the_upper_bound_of_its_bucket():
    histogram = Histogram([1, 2, 3])
    assert math.isnan(histogram.quantile(0.5))
    for value in (0.5, 1.5, 1.5, 2.5):
        histogram.observe(value)
    assert histogram.quantile(0.5) == 2 and histogram.quantile(1.0) == 3
    histogram.observe(10)
    assert histogram.quantile(1.0) == math.inf


def test_a_histogram_needs_buckets():
    with pytest.raises(ValueError):
        Histogram([])


def test_labelled_keys_split_back():
    key = labelled("rejections_total", reason="overloaded", code=429)
    assert key == 'rejections_total{code="429",reason="overloaded"}'
    assert split_name(key) == ("rejections_total", 'code="429",reason="overloaded"')
    assert split_name("plain_total") == ("plain_total", "")


def test_render_groups_each_family_under_one_type_line_and_skips_non_numbers():
    counters = {"a_total": 1, labelled("a_total", outcome="200"): 2, "a_total_x": 3}
    gauges = {"kv_blocks_free": 7, "ready": True, "model": "tiny"}
    text = render({"role": "gateway", "instance": "g-1"}, counters, gauges, {"ttft_seconds": Histogram([1])})
    lines = text.splitlines()
    a = lines.index("# TYPE kvc_a_total counter")
    assert lines[a + 1:a + 3] == ['kvc_a_total{role="gateway",instance="g-1"} 1',
                                  'kvc_a_total{role="gateway",instance="g-1",outcome="200"} 2']
    assert 'kvc_ready{role="gateway",instance="g-1"} 1' in lines
    assert "model" not in text
    assert "# TYPE kvc_ttft_seconds histogram" in lines
    assert 'kvc_ttft_seconds_count{role="gateway",instance="g-1"} 0' in lines
    assert text.endswith("\n")


def test_label_values_are_escaped():
    text = render({"role": 'a"b'}, {"x_total": 1}, {}, {})
    assert 'role="a\\"b"' in text


def test_running_totals_reported_as_gauges_are_counters_named_total_and_every_family_has_help():
    gauges = {"tokens_generated": 5, "requests_finished": 2, "kv_blocks_total": 64, "kv_blocks_free": 60,
              "placements_pulling_total": 3.0, "requests_running": 1}
    text = render({"role": "decode"}, {"bus_drops_total": 1}, gauges, {"ttft_seconds": Histogram([1])})
    lines = text.splitlines()
    types = dict(line.split()[2:4] for line in lines if line.startswith("# TYPE"))
    assert types == {"kvc_bus_drops_total": "counter", "kvc_tokens_generated_total": "counter",
                     "kvc_requests_finished_total": "counter", "kvc_kv_blocks_capacity": "gauge",
                     "kvc_kv_blocks_free": "gauge", "kvc_placements_pulling_total": "counter",
                     "kvc_requests_running": "gauge", "kvc_ttft_seconds": "histogram"}
    assert not [name for name, kind in types.items() if kind == "gauge" and name.endswith("_total")]
    helped = {line.split()[2] for line in lines if line.startswith("# HELP") and len(line.split()) > 3}
    assert helped == set(types)
    assert 'kvc_tokens_generated_total{role="decode"} 5' in lines
    for name in types:  # HELP, then TYPE, then the samples
        assert lines[lines.index(f"# TYPE {name} {types[name]}") - 1].startswith(f"# HELP {name} ")


def test_vllm_named_series_carry_the_model_name_beside_ours():
    from kvcentric.runtime.http import Metrics

    metrics = Metrics("decode", "d-0", lambda: {"tokens_generated": 1})
    assert "vllm:" not in metrics.render()
    metrics.vllm_labels = {"model_name": "tiny"}
    metrics.vllm_gauges = lambda: {"num_requests_running": 2, "num_preemptions_total": 0}
    text = metrics.render()
    assert 'vllm:num_requests_running{model_name="tiny",role="decode",instance="d-0"} 2' in text
    assert "# TYPE vllm:num_preemptions_total counter" in text and "# TYPE kvc_tokens_generated_total counter" in text
