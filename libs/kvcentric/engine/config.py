"""The config of an engine instance (prefill or decode): model, KV cache, messenger, load reports, and the
decode's TBT double-check with the cost model it predicts steps with."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from kvcentric.config import BusConfig, ConfigError, require, setting
from kvcentric.core.costmodel import HARDWARE, CostModel, load_cost_model
from kvcentric.core.hashing import HASH_ALGOS, BlockHasher, HashAlgo, parse_seed
from kvcentric.core.kvlinks import KV_TRANSPORTS, KVTransportName
from kvcentric.core.pipeline import StagePosition, parse_stage
from kvcentric.core.scheduling.eviction import EVICTION_POLICIES, EvictionName
from kvcentric.model.config import PRESETS, load_model_config

DEVICE = re.compile(r"cpu|cuda(:\d+)?")
"""The torch devices an engine runs on."""


@dataclasses.dataclass(frozen=True)
class EngineConfig(BusConfig):
    model: str = setting("tiny", "a checkpoint directory (LLaMA, Mistral, Qwen2), or a preset with random weights: "
                                 + ", ".join(PRESETS))
    seed: int = setting(0, "seed of the model's random weights; every instance must use the same")
    dtype: Literal["float32", "float16", "bfloat16"] = setting("float32", "weights and KV dtype (fp32 on CPU)")
    onednn: bool = setting(True, "fp32 on the CPU: the layers' projections run through oneDNN's GEMM, their "
                                 "weights packed in its layout at load (faster than torch's default GEMM on the "
                                 "CPUs measured, docs/performance.md); --no-onednn: torch's default")
    cpu_kernels: bool = setting(True, "CPU, fp32/bf16: attention runs through C++ kernels built on first use with "
                                      "the machine's compiler (cached in $KVC_KERNEL_CACHE or "
                                      "~/.cache/kvcentric/kernels): decode rows read the paged KV cache in place, "
                                      "whole prompts attend in one flash-style pass (docs/performance.md); "
                                      "without a compiler, or --no-cpu-kernels: torch's SDPA over a gathered copy")
    gpu_kernels: bool = setting(True, "CUDA: decode attention reads the paged KV cache in place through a Triton "
                                      "kernel (--no-gpu-kernels: torch's SDPA over a gathered copy)")
    cuda_graphs: bool = setting(True, "CUDA, decode and colocated: decode steps are captured as CUDA graphs per "
                                      "batch-size bucket at load and replayed (needs the Triton kernel); "
                                      "--no-cuda-graphs: every step launched eagerly")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:N")
    torch_threads: int = setting(0, "torch intra-op threads (0: torch's default)")
    core_share_dir: str = setting("", "CPU: a directory the engine instances of this machine share; each model call "
                                      "then also runs on the torch threads of the instances that are idle (a "
                                      "prefill instance takes an idle decode instance's core: "
                                      "engine/service/coreshare.py). "
                                      "kvcentric up sets it when it starts several CPU engines; empty: off")
    lend_pace_s: float = setting(0.0, "decode, with --core-share-dir: while a prefill instance beside it computes with "
                                      "2 or more prompts queued, decode steps start at most this often and the "
                                      "core is lent between them (0: steps back to back)")
    block_size: int = setting(16, "tokens per KV block")
    num_kv_blocks: int = setting(2048, "KV blocks preallocated in the cache")
    hash_algo: HashAlgo = setting("sha256_cbor", f"prefix block hash: {', '.join(HASH_ALGOS)}")
    hash_seed: str = setting("", "prefix block hash seed, shared by every service that hashes (gateway and "
                                 "engines): an integer, or empty for none (Llumnix GO_HASH_SEED; vLLM PYTHONHASHSEED)")
    kv_host: str = setting("127.0.0.1", "address the messenger's gRPC server binds to")
    kv_port: int = setting(0, "gRPC port of the messenger (0: pick a free port)")
    kv_advertise: str = setting("", "host:port peers use to reach the messenger (default: kv-host:kv-port; for a "
                                    "wildcard kv-host such as 0.0.0.0, this machine's own address)")
    load_interval_s: float = setting(0.1, "seconds between load reports on kvc.load.<role>.<id>")
    kv_digest_every_s: float = setting(10.0, "seconds between digests of the blocks this engine holds, on "
                                             "kvc.kv.digest.<id> (kvs-meta heals its index when they differ)")
    max_batch: int = setting(64, "most sequences in one decode step")
    prefill_chunk: int = setting(512, "prompt tokens computed per prefill step (chunked prefill)")
    kv_stripes: int = setting(1, "concurrent gRPC connections one request's KV push is striped over")
    kv_rate_limit_gbps: float = setting(0.0, "cap each peer's KV push bandwidth, Gbit/s (0: none); emulates "
                                             "a cross-datacenter link")
    kv_transport: KVTransportName = setting(
        "auto", "how this engine's KV pushes travel: grpc (bytes on the gRPC stream), shm (a peer on this host: "
                "through a shared-memory segment), cuda-ipc (a peer on this host's GPUs: not wired into the engines "
                "yet, so it falls back to grpc), mooncake (Mooncake's Transfer Engine, the optional [mooncake] "
                "extra); auto: per link, from the host, GPUs and transports the peer advertises: same GPU host → "
                "cuda-ipc, same host → shm, else mooncake where both have it, else grpc. A transport a link cannot "
                "use falls back to grpc; /health's kv_links says what each peer got and why")
    kv_mooncake_mb: int = setting(256, "with Mooncake's Transfer Engine importable and --kv-transport auto or "
                                       "mooncake: host memory registered once with it on each side (layers being "
                                       "pushed, layers being read), MiB; 0: no Mooncake transport")
    kv_mooncake_protocol: Literal["tcp", "rdma"] = setting("tcp", "the Transfer Engine's transport: tcp, or rdma "
                                                                  "(with --kv-mooncake-device)")
    kv_mooncake_device: str = setting("", "with --kv-mooncake-protocol rdma: the RDMA device(s), e.g. mlx5_0")
    host_pool_layout: Literal["auto", "block", "layer"] = setting(
        "auto", "how the host pool lays out its blocks: block (a block's layers together, as the wire and pulls "
                "carry it) or layer (one layer of every block together, so a layer-wise prefix load copies "
                "contiguous ranges per layer instead of gathering a slice of each block); auto: layer where "
                "--layerwise-load is on, else block")
    host_pool_mb: int = setting(256, "host-memory KV block pool of this node (prefill, colocated), MiB; 0: none")
    kv_staging_mb: int = setting(1024, "decode: host memory that KV arriving at a full KV cache waits in until "
                                       "blocks free, MiB (0: refused at once, 429)")
    host_pool_policy: EvictionName = setting("lru", "eviction policy of the host pool")
    layerwise_load: Literal["auto", "on", "off"] = setting(
        "auto", "prefill, colocated: a prefix found in the host pool loads into the KV cache layer by layer while "
                "the prompt's layers compute (Mooncake §5.2), or whole before the first chunk (off); auto: on for "
                "CPU engines, off on CUDA, where the host-side gather of each layer measured slower than a whole "
                "load (docs/performance.md)")
    layerwise_store: bool = setting(True, "prefill, colocated: a prefill chunk's new full blocks go into the host "
                                          "pool layer by layer as each layer is computed (Mooncake §5.2); false: "
                                          "a prompt's blocks go whole when it ends")
    kv_retries: int = setting(2, "resend a request's KV this many times when the receiver finds it corrupt")
    kv_write_back: bool = setting(True, "decode: each block filled with the KV of generated tokens goes into the "
                                        "host pool of the prefill instance that sent the prompt, so a request "
                                        "migrated after this instance dies computes only its last partial block")
    kv_keep_s: float = setting(30.0, "decode: when a prompt's KV push breaks off (its prefill instance died "
                                     "mid-prompt), the blocks whose every layer arrived stay findable this long, "
                                     "announced to kvs-meta and served to the prefill instance that pulls them, so "
                                     "the request's continuation computes only the rest of the prompt (free blocks, "
                                     "reused last); 0: dropped at once")
    tbt_slo_s: float = setting(0.0, "decode: TBT SLO, seconds; a request whose KV has all arrived is rejected "
                                    "(429, its prefill wasted) when the predicted decode step with it in the "
                                    "batch exceeds this (Mooncake §7's double-check, asked for by a conductor with "
                                    "--rejection none only: the others judged decode load at placement); 0: "
                                    "relative, --tbt-slo-factor "
                                    "x this instance's unloaded step for that request (one sequence, its context), "
                                    "so a request alone is never refused")
    tbt_slo_factor: float = setting(5.0, "decode with --tbt-slo-s 0: the TBT SLO is this x the unloaded step (the "
                                         "papers' 5x; 0: no double-check)")
    profile: str = setting("", "decode with --tbt-slo-s: cost model JSON written by `kvcentric profile` that "
                               "predicts the step time instead of this instance's own measured model (default: "
                               "the measured model; until there is one, no request is rejected)")
    hardware: str = setting("cpu-2core", f"decode with --tbt-slo-s: hardware preset of the roofline that the "
                                         f"measured decode model is laid over: {', '.join(HARDWARE)}")
    slow_step_s: float = setting(0.0, "testing: while --slow-while-file exists, every timed model call (calibration, "
                                      "colocated steps) and every prefill step takes this many seconds more, as "
                                      "on a machine busy with other work (0: never)")
    slow_while_file: str = setting("", "testing: the file whose existence makes --slow-step-s apply")
    calibrate: bool = setting(True, "time a few prefill and decode shapes at start, so the first load report "
                                    "carries this instance's measured cost model (--no-calibrate: it is learned "
                                    "from the work served)")
    pipeline_group: str = setting("", "prefill: run as one stage of this pipelined prefill group (Mooncake §5.1, "
                                      "chunked pipeline parallelism; \"\": a whole instance)")
    stage: str = setting("0/1", "prefill with --pipeline-group: i/X, this instance is stage i (from 0) of X and holds "
                                "only its slice of the layers")
    kv_wait_s: float = setting(300.0, "decode: the longest a request waits for its KV after its job or its latest "
                                      "layer (the job asks for max(30 s, 3 x its predicted TTFT)); then it fails "
                                      "with a 503 ('KV did not arrive in time')")
    layerkv: bool = setting(False, "colocated or prefill: LayerKV (arXiv 2410.00428): allocate KV blocks per layer, "
                                   "keep only some layers of a prompt on the device and the rest in host memory "
                                   "(moved layer by layer beside the compute), and (colocated) admit prompts by the "
                                   "decoding requests' TPOT SLO (no prefix caching, no host block pool)")
    layerkv_tpot_slo_s: float = setting(0.2, "with --layerkv: TPOT SLO, seconds, the SLO-aware scheduler admits "
                                             "prompts by (0: admit whenever the blocks fit)")
    layerkv_offload_threshold: float = setting(0.1, "with --layerkv: share of device layer blocks kept free; when "
                                                    "the forecast (eq. 5) dips below it, the newest requests' "
                                                    "device layers go to host memory")
    layerkv_host_mb: int = setting(1024, "with --layerkv: host memory for offloaded layers, MiB")
    layerkv_decode: Literal["swap", "stream"] = setting(
        "swap", "with --layerkv, colocated: a decoding request with layers in host memory waits out of the batch "
                "until they are swapped back into device blocks, as the paper's vLLM base does (swap; the oldest "
                "decodes anyway when every request waits), or decodes at once, reading them every step (stream)")
    step_tokens: int = setting(2048, "colocated: token budget of a mixed step, one forward pass over the decode "
                                     "batch's tokens and prompt chunks of as many prompts as fit (0: split steps, "
                                     "one prompt chunk and the decode batch as two passes; --layerkv always runs "
                                     "split steps)")
    prefill_step_tokens: int = setting(0, "prefill: token budget of one forward pass over chunks (each at most "
                                          "--prefill-chunk) of as many queued prompts as fit; 0: one prompt's "
                                          "chunk per pass. Off by default: on a CPU core a GEMM is no faster on "
                                          "more rows, and the first prompts wait for the whole pass "
                                          "(docs/performance-notebook.md); "
                                          "--layerkv and pipeline stages always compute one chunk per pass")
    prefill_lanes: int = setting(2, "prefill on the CPU with cores lent (--core-share-dir): with a core lent and two "
                                    "prompts queued, compute one on each of two model threads of one torch thread "
                                    "at once rather than one on a 2-thread team; colocated on the CPU (2 threads "
                                    "or more, no core share): while more prompt tokens wait than the next mixed "
                                    "step takes, a lane computes them beside it (docs/performance.md, \"What "
                                    "serving adds to a prompt's prefill\"); 1: always the team")
    decode_attention: Literal["padded", "slices"] = setting("padded", "colocated with --step-tokens: decode rows "
                                                            "attend through one padded block-table gather per "
                                                            "layer (padded) or one sequence at a time over its "
                                                            "own slots (slices)")

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            load_model_config(self.model)
        except ValueError as exc:
            raise ConfigError(f"--model: {exc}") from None
        require(self.hash_algo in HASH_ALGOS, "hash_algo", f"choose one of {', '.join(HASH_ALGOS)}")
        try:
            parse_seed(self.hash_seed)
        except ValueError as exc:
            require(False, "hash_seed", str(exc))
        require(self.block_size >= 1, "block_size", "must be at least 1")
        require(self.num_kv_blocks >= 1, "num_kv_blocks", "must be at least 1")
        require(self.kv_staging_mb >= 0, "kv_staging_mb", "must be 0 (none) or positive")
        require(self.host_pool_mb >= 0, "host_pool_mb", "must be 0 (none) or positive")
        require(self.host_pool_policy in EVICTION_POLICIES, "host_pool_policy",
                f"choose one of {', '.join(EVICTION_POLICIES)}")
        require(self.kv_stripes >= 1, "kv_stripes", "must be at least 1")
        require(self.kv_transport in KV_TRANSPORTS, "kv_transport", f"choose one of {', '.join(KV_TRANSPORTS)}")
        require(self.kv_mooncake_mb >= 0, "kv_mooncake_mb", "must be 0 (none) or positive")
        require(self.kv_rate_limit_gbps >= 0, "kv_rate_limit_gbps", "must be 0 (none) or positive")
        require(self.kv_retries >= 0, "kv_retries", "must be 0 or more")
        require(self.prefill_chunk >= 1, "prefill_chunk", "must be at least 1")
        require(self.max_batch >= 1, "max_batch", "must be at least 1")
        require(self.step_tokens >= 0, "step_tokens", "must be 0 (split steps) or positive")
        require(self.prefill_lanes in (1, 2), "prefill_lanes", "must be 1 (a team) or 2 (two lanes)")
        require(self.prefill_step_tokens >= 0, "prefill_step_tokens", "must be 0 (one chunk per pass) or positive")
        require(not (self.layerkv and self.pipeline_group), "layerkv",
                "a prefill stage (--pipeline-group) does not run LayerKV: drop one of the two")
        require(self.torch_threads >= 0, "torch_threads", "must be 0 or more")
        require(self.load_interval_s > 0, "load_interval_s", "must be positive")
        require(self.kv_digest_every_s > 0, "kv_digest_every_s", "must be positive")
        require(self.kv_wait_s > 0, "kv_wait_s", "must be positive")
        require(self.kv_keep_s >= 0, "kv_keep_s", "must not be negative")
        require(math.isfinite(self.layerkv_tpot_slo_s) and self.layerkv_tpot_slo_s >= 0, "layerkv_tpot_slo_s",
                "must be 0 (off) or positive")
        require(0 <= self.layerkv_offload_threshold <= 1, "layerkv_offload_threshold", "must be in [0, 1]")
        require(self.layerkv_host_mb >= 1, "layerkv_host_mb", "must be at least 1")
        require(0 <= self.kv_port < 65536, "kv_port", "must be 0..65535")
        require(DEVICE.fullmatch(self.device) is not None, "device",
                f"expected cpu, cuda or cuda:N, got {self.device!r}")
        require(math.isfinite(self.tbt_slo_s) and self.tbt_slo_s >= 0, "tbt_slo_s", "must be 0 (relative) or positive")
        require(math.isfinite(self.tbt_slo_factor) and self.tbt_slo_factor >= 0, "tbt_slo_factor",
                "must be 0 (off) or positive")
        require(math.isfinite(self.slow_step_s) and self.slow_step_s >= 0, "slow_step_s", "must be 0 or more")
        self._check_stage()
        require(self.hardware in HARDWARE, "hardware", f"choose a preset: {', '.join(HARDWARE)}")
        if self.profile:
            try:
                CostModel.load(self.profile)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--profile: {exc}") from None

    def hasher(self) -> BlockHasher:
        """The prefix block hasher every instance must share (algorithm, block size, seed)."""
        return BlockHasher(self.hash_algo, self.block_size, parse_seed(self.hash_seed))

    def _check_stage(self) -> None:
        try:
            index, stages = parse_stage(self.stage)
        except ValueError as exc:
            raise ConfigError(f"--stage: {exc}") from None
        layers = load_model_config(self.model).num_layers
        require(stages <= layers, "stage", f"{stages} stages but the model has {layers} layers")
        require(stages == 1 or bool(self.pipeline_group), "stage", "a stage of several needs --pipeline-group")

    @property
    def layerwise_prefix_load(self) -> bool:
        """--layerwise-load resolved for this engine's device."""
        if self.layerwise_load == "auto":
            return not self.device.startswith("cuda")
        return self.layerwise_load == "on"

    @property
    def host_layer_major(self) -> bool:
        """--host-pool-layout resolved: whether the host pool keeps one layer of its blocks together."""
        if self.host_pool_layout == "auto":
            return self.layerwise_prefix_load
        return self.host_pool_layout == "layer"

    @property
    def stage_position(self) -> StagePosition | None:
        """Where this instance sits in its prefill group (None: a whole instance)."""
        if not self.pipeline_group:
            return None
        index, stages = parse_stage(self.stage)
        return StagePosition(self.pipeline_group, index, stages)

    @property
    def tbt_check(self) -> bool:
        """Whether decode double-checks TBT: an absolute SLO, or a relative one with a factor."""
        return self.tbt_slo_s > 0 or self.tbt_slo_factor > 0

    def cost_model(self) -> CostModel:
        """What predicts a decode step: the --profile file, else the roofline of --model on --hardware."""
        return load_cost_model(self.profile, self.model, self.hardware)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    model: str = setting("tiny", "checkpoint directory or preset to profile")
    out: str = setting("profile.json", "where to write the samples and the fitted cost model")
    cpu_kernels: bool = setting(True, "time steps with the CPU attention kernels, as the engines run them "
                                      "(--no-cpu-kernels: torch's SDPA)")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:N")
    dtype: Literal["float32", "float16", "bfloat16"] = setting("float32", "weights and KV dtype")
    torch_threads: int = setting(0, "torch intra-op threads (0: torch's default)")
    max_tokens: int = setting(2048, "largest new + cached tokens timed (capped by the model's context)")
    repeat: int = setting(3, "timings per grid point (the median is kept)")
    block_size: int = setting(16, "tokens per KV block")

    def __post_init__(self) -> None:
        require(self.max_tokens >= 64, "max_tokens", "must be at least 64")
        require(self.repeat >= 1, "repeat", "must be at least 1")
