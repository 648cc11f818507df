"""Every service and the simulator choose their cost model the same way: the --profile file when one is
given, else the roofline of --model on --hardware."""

from __future__ import annotations

import pytest

from kvcentric.core.costmodel import CostModel, load_cost_model
from kvcentric.engine.config import EngineConfig
from kvcentric.tools.sim import SimConfig, build
from kvc_conductor.config import ConductorConfig

PROFILED = CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 1e-3, 0.0), 1000, "test")


def test_without_a_profile_it_is_the_roofline_of_the_model_on_the_hardware():
    assert load_cost_model("", "tiny", "cpu-2core").source == "roofline:tiny@cpu-2core"


def test_a_profile_file_wins_over_the_roofline(tmp_path):
    path = tmp_path / "profile.json"
    PROFILED.save(path)
    assert load_cost_model(str(path), "no-such-model", "no-such-hardware") == PROFILED


def test_an_unknown_model_or_hardware_is_an_error():
    with pytest.raises(ValueError, match="no-such-model"):
        load_cost_model("", "no-such-model", "cpu-2core")
    with pytest.raises(ValueError, match="no-such-hardware"):
        load_cost_model("", "tiny", "no-such-hardware")


def test_the_conductor_and_the_decode_engine_predict_with_the_same_model(tmp_path):
    assert ConductorConfig(model="small").cost_model() == EngineConfig(model="small").cost_model()
    path = tmp_path / "profile.json"
    PROFILED.save(path)
    assert ConductorConfig(profile=str(path)).cost_model() == EngineConfig(profile=str(path)).cost_model() == PROFILED


def test_the_simulator_chooses_the_same_way():
    _, about = build(SimConfig(model="llama2-7b", hardware="8xA800-800gbps", plots=False, progress=False))
    assert about["cost_model"]["source"] == "roofline:llama2-7b@8xA800-800gbps"
