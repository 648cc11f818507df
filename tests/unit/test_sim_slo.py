"""Relative SLOs (Mooncake §2, §8.1): thresholds from an unloaded run's P90s, normalised P90s, and the
`--slo-reference` flag of `kvcentric sim` end to end."""

import json
import subprocess
import sys

import pytest

from kvcentric.core.sim.slo import Slos, load_reference, normalised_p90s, relative_slos


def test_relative_slos_are_ten_and_five_times_the_unloaded_p90s():
    slos = relative_slos({"ttft_p90_s": 0.8, "tbt_p90_s": 0.02})
    assert slos.ttft_s == pytest.approx(8.0) and slos.tbt_s == pytest.approx(0.1)
    assert (slos.unloaded_ttft_s, slos.unloaded_tbt_s, slos.ttft_factor, slos.tbt_factor) == (0.8, 0.02, 10.0, 5.0)


def test_relative_slos_take_other_factors():
    slos = relative_slos({"ttft_p90_s": 2.0, "tbt_p90_s": 0.05}, ttft_factor=4, tbt_factor=2)
    assert (slos.ttft_s, slos.tbt_s) == (8.0, 0.1)


def test_a_reference_without_tbt_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="no positive P90"):
        relative_slos({"ttft_p90_s": 1.0, "tbt_p90_s": 0.0})
    with pytest.raises(ValueError, match="factors must be positive"):
        relative_slos({"ttft_p90_s": 1.0, "tbt_p90_s": 0.1}, ttft_factor=0)


def test_normalised_p90s_put_the_limit_at_one():
    slos = Slos(ttft_s=10.0, tbt_s=0.1)
    met = normalised_p90s({"ttft_p90_s": 5.0, "tbt_p90_s": 0.1, "completed": 3}, slos)
    assert met == {"ttft_p90_normalised": 0.5, "tbt_p90_normalised": pytest.approx(1.0), "p90_slos_met": True}
    over = normalised_p90s({"ttft_p90_s": 12.0, "tbt_p90_s": 0.05, "completed": 3}, slos)
    assert over["ttft_p90_normalised"] == pytest.approx(1.2) and not over["p90_slos_met"]
    assert not normalised_p90s({"ttft_p90_s": 0.0, "tbt_p90_s": 0.0, "completed": 0}, slos)["p90_slos_met"]


def test_load_reference_reads_a_file_or_its_folder(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"ttft_p90_s": 1.5, "tbt_p90_s": 0.03}))
    assert load_reference(tmp_path) == load_reference(tmp_path / "summary.json") == {"ttft_p90_s": 1.5,
                                                                                        "tbt_p90_s": 0.03}


def sim(*args: str) -> subprocess.CompletedProcess:
    base = ["--workload", "poisson", "--num-requests", "20", "--input-len", "4096", "--output-len", "32",
            "--prefill", "1", "--decode", "1", "--no-plots", "--no-progress", "--rejection", "never"]
    return subprocess.run([sys.executable, "-m", "kvcentric", "sim", *base, *args], capture_output=True, text=True,
                          timeout=120)


def test_sim_with_a_reference_uses_the_relative_slos(tmp_path):
    unloaded, loaded = tmp_path / "unloaded", tmp_path / "loaded"
    assert sim("--rps", "0.05", "--out", str(unloaded)).returncode == 0
    reference = json.loads((unloaded / "summary.json").read_text())
    result = sim("--rps", "4", "--out", str(loaded), "--slo-reference", str(unloaded))
    assert result.returncode == 0, result.stderr
    summary = json.loads((loaded / "summary.json").read_text())
    assert summary["slos"]["ttft_s"] == pytest.approx(10 * reference["ttft_p90_s"], rel=1e-4)
    assert summary["slos"]["tbt_s"] == pytest.approx(5 * reference["tbt_p90_s"], rel=1e-4)
    assert summary["config"]["ttft_slo_s"] == pytest.approx(summary["slos"]["ttft_s"], rel=1e-4)
    assert summary["ttft_p90_normalised"] == pytest.approx(summary["ttft_p90_s"] / summary["slos"]["ttft_s"],
                                                           rel=1e-3)
    assert summary["ttft_p90_normalised"] > 0.1  # the unloaded run itself sits at 1/10 of its own TTFT SLO


def test_sim_names_a_missing_reference(tmp_path):
    result = sim("--out", str(tmp_path / "out"), "--slo-reference", str(tmp_path / "nothing.json"))
    assert result.returncode == 1 and "nothing.json" in result.stderr


def test_replay_with_a_reference_replaces_its_slos(tmp_path):
    from kvcentric.tools.replay import ReplayConfig, with_slos
    (tmp_path / "summary.json").write_text(json.dumps({"ttft_p90_s": 2.0, "tbt_p90_s": 0.04}))
    config, slos = with_slos(ReplayConfig(slo_reference=str(tmp_path), tbt_slo_factor=4))
    assert (config.ttft_slo_s, config.tbt_slo_s) == pytest.approx((20.0, 0.16)) == (slos.ttft_s, slos.tbt_s)
    fixed, same = with_slos(ReplayConfig(ttft_slo_s=7.0))
    assert fixed.ttft_slo_s == same.ttft_s == 7.0 and same.unloaded_ttft_s == 0.0
