"""`kvcentric profile` times the real model and writes a cost model the conductor can load."""

import json
import subprocess
import sys

from kvcentric.core.costmodel import CostModel


def test_profile_writes_a_loadable_cost_model_with_its_samples_and_fit_error(tmp_path):
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, "-m", "kvcentric", "profile", "--model", "tiny", "--out", str(out),
                             "--max-tokens", "128", "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "T_prefill(n, c)" in result.stdout and "fit error" in result.stdout
    profile = json.loads(out.read_text())
    model = CostModel.load(out)
    assert len(profile["samples"]["prefill"]) >= 4 and len(profile["samples"]["decode"]) >= 4
    assert {"prefill", "decode"} <= set(profile["fit_error"])
    assert model.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4  # tiny: layers x (k, v) x kv_heads x head_dim x fp32
    assert model.t_prefill(128, 0) > 0 and model.t_decode(4, 256) > 0


def test_profile_refuses_a_bad_setting_naming_the_flag(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvcentric", "profile", "--max-tokens", "8"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--max-tokens" in result.stderr
