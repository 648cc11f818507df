"""`kvcentric up` passes --prefill-chunk, --max-batch, --device and --tbt-slo-s through to the engines it
starts: the argv it builds for each instance parses, with the engines' own parser, to those values."""

from __future__ import annotations

import argparse

import pytest

from kvcentric.cli import build_parser
from kvcentric.config import ConfigError, add_arguments, from_namespace
from kvcentric.engine.config import EngineConfig
from kvcentric.tools.up import UpConfig


def up_config(*argv: str) -> UpConfig:
    return from_namespace(UpConfig, build_parser().parse_args(["up", *argv]))


def engine_config(flags: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    return from_namespace(EngineConfig, parser.parse_args(flags))


def test_each_engine_gets_prefill_chunk_max_batch_and_device_and_decode_the_tbt_slo(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text('{"cost_model": {"prefill": [0, 0, 0, 0], "decode": [0.01, 0, 0], "kv_bytes_per_token": 1}}')
    config = up_config("--prefill-chunk", "128", "--max-batch", "8", "--device", "cpu", "--tbt-slo-s", "0.05",
                       "--profile", str(profile))
    for command in ("prefill", "decode"):
        engine = engine_config(config.engine_flags(command, threads=2))
        assert (engine.prefill_chunk, engine.max_batch, engine.device, engine.torch_threads) == (128, 8, "cpu", 2)
    decode = engine_config(config.engine_flags("decode", threads=2))
    assert decode.tbt_slo_s == 0.05 and decode.profile == str(profile)
    assert decode.cost_model().decode == (0.01, 0.0, 0.0)
    assert "--tbt-slo-s" not in config.engine_flags("prefill", threads=2)  # only decode checks
    assert config.conductor_flags()[-2:] == ["--tbt-slo-s", "0.05"]  # one SLO for the cluster


def test_a_cuda_device_reaches_the_engines():
    config = up_config("--device", "cuda:1")
    assert engine_config(config.engine_flags("colocated", threads=1)).device == "cuda:1"


def test_by_default_the_engines_keep_their_defaults_and_decode_double_checks_tbt_relative_to_its_speed():
    """Mooncake §7's TBT double-check is on by default, at 5x the unloaded step (issue 48: an absolute 0.1 s fits
    `small` only), and the conductor's SLOs are relative too."""
    config = up_config()
    defaults = EngineConfig()
    for command in ("prefill", "decode", "colocated"):
        flags = config.engine_flags(command, threads=1)
        assert ("--tbt-slo-s" in flags) == (command == "decode")
        engine = engine_config(flags)
        assert (engine.prefill_chunk, engine.max_batch, engine.device) == \
               (defaults.prefill_chunk, defaults.max_batch, defaults.device)
    decode = engine_config(config.engine_flags("decode", threads=1))
    assert decode.tbt_slo_s == 0.0 == defaults.tbt_slo_s and decode.tbt_slo_factor == 5.0 and decode.tbt_check
    assert "--tbt-slo-s" not in config.conductor_flags()


def test_a_tbt_slo_of_0_makes_the_double_check_relative_and_leaves_the_conductors_slo_alone():
    config = up_config("--tbt-slo-s", "0")
    assert engine_config(config.engine_flags("decode", threads=1)).tbt_slo_s == 0.0
    assert "--tbt-slo-s" not in config.conductor_flags()


def test_environment_variables_reach_the_engines_through_up(monkeypatch):
    monkeypatch.setenv("KVC_MAX_BATCH", "1")
    monkeypatch.setenv("KVC_PREFILL_CHUNK", "32")
    engine = engine_config(up_config().engine_flags("decode", threads=1))
    assert (engine.max_batch, engine.prefill_chunk) == (1, 32)


def test_layerkv_reaches_the_prefill_instances_and_prefill_kv_blocks_only_them():
    config = up_config("--prefill", "1", "--decode", "1", "--layerkv", "--num-kv-blocks", "64",
                       "--prefill-kv-blocks", "8")
    prefill = engine_config(config.engine_flags("prefill", threads=1))
    decode = engine_config(config.engine_flags("decode", threads=1))
    assert (prefill.layerkv, prefill.num_kv_blocks) == (True, 8)
    assert (decode.layerkv, decode.num_kv_blocks) == (False, 64)
    assert engine_config(up_config().engine_flags("prefill", threads=1)).num_kv_blocks == 2048


@pytest.mark.parametrize("argv, flag", [
    (["--layerkv", "--prefill-pipeline", "2"], "--layerkv"),
    (["--prefill-kv-blocks", "-1"], "--prefill-kv-blocks"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--max-batch", "0"], "--max-batch"),
    (["--device", "tpu"], "--device"),
    (["--tbt-slo-s", "-1"], "--tbt-slo-s"),
    (["--tbt-slo-s", "inf"], "--tbt-slo-s"),
    (["--port", "70000"], "--port"),
    (["--conductors", "0"], "--conductors"),
    (["--lend-pace-s", "-0.1"], "--lend-pace-s"),
    (["--lend-pace-s", "2"], "--lend-pace-s"),
])
def test_bad_up_flags_are_refused_naming_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        up_config(*argv)


def test_two_conductor_replicas_and_restarts_by_default_named_as_the_cluster_json_lists_them():
    config = up_config()
    assert (config.conductors, config.restart) == (2, "on-failure")
    assert config.conductor_names == ["conductor-0", "conductor-1"]
    assert up_config("--conductors", "3", "--restart", "never").conductor_names[-1] == "conductor-2"


def test_cuda_spreads_the_engines_over_the_visible_gpus_and_cuda_n_keeps_them_together():
    from kvcentric.tools.up import engine_devices

    assert engine_devices("cuda", 3, 2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert engine_devices("cuda", 2, 8) == ["cuda:0", "cuda:1"]
    assert engine_devices("cuda", 2, 1) == ["cuda", "cuda"]  # one GPU: both on it
    assert engine_devices("cuda:3", 2, 8) == ["cuda:3", "cuda:3"]
    assert engine_devices("cpu", 2, 8) == ["cpu", "cpu"]
    config = up_config("--device", "cuda", "--prefill", "1", "--decode", "1")
    flags = config.engine_flags("decode", threads=1, device="cuda:1")
    assert engine_config(flags).device == "cuda:1"
    assert engine_config(config.engine_flags("prefill", threads=1)).device == "cuda"


def test_several_cpu_engines_lend_each_other_cores_and_the_decode_paces_itself_by_default():
    config = up_config("--prefill", "1", "--decode", "1")
    assert config.lends_cores
    decode = engine_config(config.engine_flags("decode", threads=1, core_share_dir="/dev/shm/kvc-cores-x"))
    prefill = engine_config(config.engine_flags("prefill", threads=1, core_share_dir="/dev/shm/kvc-cores-x"))
    assert decode.core_share_dir == prefill.core_share_dir == "/dev/shm/kvc-cores-x"
    assert decode.lend_pace_s == 0.08 and prefill.lend_pace_s == 0.0  # only a decode paces itself
    assert engine_config(config.engine_flags("decode", threads=1)).core_share_dir == ""


def test_one_engine_a_gpu_or_no_lend_cores_lends_nothing():
    assert not up_config("--colocated", "1").lends_cores
    assert up_config("--colocated", "2").lends_cores
    assert not up_config("--no-lend-cores").lends_cores
    assert not up_config("--device", "cuda").lends_cores
    cuda = up_config("--device", "cuda:0").engine_flags("decode", threads=1, core_share_dir="/tmp/x")
    assert "--core-share-dir" not in cuda


def test_a_share_directory_a_killed_up_left_is_removed_and_a_live_one_kept(tmp_path):
    import os
    import subprocess
    import sys

    from kvcentric.engine.service.coreshare import SLOT, CoreShare
    from kvcentric.tools.up import remove_stale_shares

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)
    stale, live, other = tmp_path / "kvc-cores-stale", tmp_path / "kvc-cores-live", tmp_path / "not-ours"
    for directory in (stale, other):
        directory.mkdir()
        (directory / "decode-0.cores").write_bytes(SLOT.pack(dead_pid, 1, 0, 0, 1, 0, 0, 0))
    share = CoreShare(live, "prefill-0", 1)
    try:
        assert remove_stale_shares(str(tmp_path)) == [str(stale)]
        assert sorted(os.listdir(tmp_path)) == ["kvc-cores-live", "not-ours"]
    finally:
        share.close()


def test_a_decode_paces_itself_within_four_fifths_of_the_tbt_slo():
    def pace(*flags: str) -> float:
        config = up_config("--prefill", "1", "--decode", "1", *flags)
        flags = config.engine_flags("decode", threads=1, core_share_dir="/dev/shm/kvc-cores-x")
        return engine_config(flags).lend_pace_s

    assert pace("--tbt-slo-s", "0.05") == pytest.approx(0.04)  # the default 80 ms would miss a 50 ms SLO
    assert pace("--tbt-slo-s", "0.5", "--lend-pace-s", "0.2") == 0.2
    assert pace("--tbt-slo-s", "0", "--lend-pace-s", "0.2") == 0.2  # no SLO: the pace as given
