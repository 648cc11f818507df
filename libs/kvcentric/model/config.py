"""Model shapes: a frozen config, the named presets, and the memory estimate that guards loading.

It describes shapes and sizes only; building weights is `kvcentric.engine.model.llama`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    """Context length: the longest prompt plus output the model serves."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int = 256
    eos_token_id: int = 257
    rope_scaling: tuple[tuple[str, float | str], ...] = ()
    """RoPE scaling as sorted (key, value) pairs: rope_type "linear" (factor) or "llama3" (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings); empty for none."""
    path: str = ""
    """The checkpoint directory, or "" for a preset with random weights."""
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None
    """Mistral: a query attends to at most this many most recent positions (itself included)."""
    extra_eos_token_ids: tuple[int, ...] = ()
    """More ids that end a sequence besides eos_token_id (Llama 3 lists <|eot_id|> too), from config.json's
    and generation_config.json's eos_token_id lists."""

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a sequence (empty when the model has none)."""
        return frozenset(i for i in (self.eos_token_id, *self.extra_eos_token_ids) if i >= 0)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    @property
    def o_proj_bias(self) -> bool:
        """LLaMA's attention_bias covers o_proj too; Qwen2's q/k/v bias does not."""
        return self.attention_bias and self.architecture == "LlamaForCausalLM"

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def kv_bytes_per_token(self, dtype_size: int = 4) -> int:
        """Key and value bytes one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_size


PRESETS: dict[str, ModelConfig] = {
    config.name: config
    for config in (
        # Byte-level vocabularies (256 bytes + BOS + EOS).
        ModelConfig("tiny", 258, 64, 128, 4, 4, 2, 16, 2048),
        ModelConfig("small", 258, 512, 1408, 8, 8, 4, 64, 4096),
        # A second CPU shape of another width and head count (136 M parameters), so that no CPU figure is
        # taken on one shape alone.
        ModelConfig("medium", 258, 1024, 2816, 12, 16, 4, 64, 4096),
        # `small` with room for 16K-token prompts (bench/serving/bench_cpp.py, chunked pipeline parallelism).
        ModelConfig("small-32k", 258, 512, 1408, 8, 8, 4, 64, 32768),
        # The shapes of the models the Mooncake paper serves (§8), random weights ("dummy" models).
        ModelConfig("llama2-7b", 32000, 4096, 11008, 32, 32, 32, 128, 4096),
        ModelConfig("llama2-70b", 32000, 8192, 28672, 80, 64, 8, 128, 4096),
        # The shape people serve today (GQA, 128K vocabulary); ids above the bytes decode to synthetic words.
        ModelConfig("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 8192, rope_theta=500000.0),
    )
}


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def from_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face checkpoint directory (its config.json)."""
    directory = Path(path)
    try:
        hf = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{directory} has no config.json; give a checkpoint directory or a preset "
                         f"({', '.join(PRESETS)})") from None
    architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{directory}: architecture {architecture} is not supported ({', '.join(ARCHITECTURES)})")
    heads = hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = () if rope_type in ("default", None) else tuple(sorted(
        (k, v) for k, v in {**rope, "rope_type": rope_type}.items()
        if k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
    eos = _eos_ids(hf, directory)
    return ModelConfig(
        name=directory.name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position=hf.get("max_position_embeddings", 2048), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        bos_token_id=_first(hf.get("bos_token_id"), -1), eos_token_id=eos[0] if eos else -1,
        rope_scaling=scaling, path=str(directory.resolve()), architecture=architecture,
        sliding_window=_sliding_window(hf, architecture), extra_eos_token_ids=tuple(eos[1:]))


def _sliding_window(hf: dict, architecture: str) -> int | None:
    if architecture == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window") if architecture != "LlamaForCausalLM" else None


def _eos_ids(hf: dict, directory: Path) -> list[int]:
    """config.json's eos_token_id (one id or a list), then any more that generation_config.json lists, as
    transformers' generate stops on all of them."""
    ids = []
    try:
        generation = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        generation = {}
    if not isinstance(generation, dict):
        generation = {}
    for value in (hf.get("eos_token_id"), generation.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token >= 0 and token not in ids:
                ids.append(token)
    return ids


def _first(value, default: int) -> int:
    if isinstance(value, list):
        return value[0] if value else default
    return default if value is None else int(value)


def load_model_config(model: str) -> ModelConfig:
    """A preset name or a checkpoint directory (anything with a path separator or that exists)."""
    if model in PRESETS:
        return PRESETS[model]
    if os.sep in model or os.path.isdir(model):
        return from_hf_config(model)
    raise ValueError(f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}) or a checkpoint directory")


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to physical pages where that is missing)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(config: ModelConfig, kv_bytes: int, dtype_size: int, available: int, weight_copies: int = 1) -> None:
    """Refuse, with the numbers, a model whose weights (`weight_copies` layouts of them) plus KV pool would not fit
    in memory."""
    weights = config.num_params * dtype_size * weight_copies
    needed = weights + kv_bytes
    if needed > available:
        raise MemoryError(
            f"model {config.name!r} needs {needed / 2**30:.1f} GiB (weights "
            f"{weights / 2**30:.1f} GiB + KV pool {kv_bytes / 2**30:.1f} GiB) "
            f"but only {available / 2**30:.1f} GiB is available; use a smaller preset "
            f"(--model tiny or small) or fewer --num-kv-blocks")
