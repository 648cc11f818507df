"""The checkpoint both sides of `bench/serving/bench_vs_vllm.py` serve: random Llama weights of a preset's shape
(`small`, `medium`)
saved as a Hugging Face directory, with a byte-level tokenizer.json whose ids are kvcentric's byte ids (0..255
the bytes, 256 BOS, 257 EOS). It builds files only; it starts no server.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcentric.model.config import preset


def byte_alphabet() -> list[str]:
    """The printable character that byte-level BPE writes for each byte 0..255 (GPT-2's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def save_byte_tokenizer(directory: Path) -> None:
    """tokenizer.json: one token per byte (no merges), BOS added in front, as kvcentric's ByteTokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": preset("small").max_position}))  # every CPU preset's


def build_small_checkpoint(directory: Path, seed: int = 0) -> Path:
    """`build_checkpoint` of the `small` preset."""
    return build_checkpoint(directory, "small", seed)


def build_checkpoint(directory: Path, shape_name: str, seed: int = 0) -> Path:
    """Random weights (normal, std 0.02; norms 1) in a preset's shape, saved with the byte tokenizer; an existing
    complete directory is kept as it is."""
    if (directory / "model.safetensors").exists() and (directory / "tokenizer.json").exists():
        return directory
    import transformers

    shape = preset(shape_name)
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, max_position_embeddings=shape.max_position,
        rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta, bos_token_id=shape.bos_token_id,
        eos_token_id=shape.eos_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_byte_tokenizer(directory)
    return directory
