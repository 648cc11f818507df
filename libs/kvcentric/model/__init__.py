"""The LLaMA-family model: its config and presets, the torch module, and the byte-level tokenizer."""
