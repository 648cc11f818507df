"""Tiny random Hugging Face checkpoints, built locally with `transformers` (no download), with a
byte-level BPE tokenizer trained on a few sentences and a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = ["The KVCache-centric architecture separates prefill and decode.",
          "Mooncake schedules requests by prefix cache hits, queue time and transfer time.",
          "Layer-wise streaming overlaps the KV transfer with the prefill of later layers."] * 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def hf_config(architecture: str, **overrides):
    import transformers

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if architecture == "llama":
        return transformers.LlamaConfig(**{**common, "attention_bias": True, **overrides})
    if architecture == "mistral":
        return transformers.MistralConfig(**{**common, "sliding_window": 24, **overrides})
    if architecture == "qwen2":
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    raise ValueError(architecture)


def build_checkpoint(directory: Path, architecture: str, seed: int = 0, **overrides) -> Path:
    """Save a random model of `architecture` (llama | mistral | qwen2) with a tokenizer to `directory`."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(architecture, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases start at zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))


def hf_model(directory: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
