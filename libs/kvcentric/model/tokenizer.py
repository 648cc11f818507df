"""The byte-level tokenizer of the built-in dummy models: one token per UTF-8 byte, plus BOS and EOS.

It encodes text to ids and decodes ids back to text incrementally (a multi-byte character split
across two tokens comes out once complete); ids that are not bytes decode to nothing.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()


class StreamDecoder:
    """Turns a stream of byte-token ids into text pieces, holding back incomplete characters."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        return self._utf8.decode(bytes(t for t in token_ids if 0 <= t < 256))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


SIMPLE_CHAT_TEMPLATE = "{role}: {content}\n"
"""How dummy models render chat messages: one "role: content" line each, then "assistant: "."""


class ByteChat:
    """The documented simple chat template of the dummy models."""

    chat_template = None
    encode: Callable[..., list[int]]  # the tokenizer this is mixed into

    def apply_chat_template(self, messages: list[dict]) -> str:
        lines = "".join(SIMPLE_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
        return lines + "assistant: "

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered conversation, ready for generation (BOS included once)."""
        return self.encode(self.apply_chat_template(messages), add_bos=True)


class DummyTokenizer(ByteTokenizer, ByteChat):
    """Byte tokenizer plus the simple chat template: what a preset model speaks."""


class HFTokenizer:
    """A checkpoint's tokenizer.json (via `tokenizers`) with the special tokens and chat template of its
    tokenizer_config.json. Encoding adds BOS the way the checkpoint's post-processor does."""

    def __init__(self, directory: str) -> None:
        import json
        from pathlib import Path

        from tokenizers import Tokenizer

        root = Path(directory)
        if not (root / "tokenizer.json").exists():
            raise ValueError(f"{directory} has no tokenizer.json")
        self._tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.chat_template = config.get("chat_template")
        self.bos_token = self._content(config.get("bos_token"))
        self.eos_token = self._content(config.get("eos_token"))
        self.bos_token_id = self._token_id(self.bos_token)
        self.eos_token_id = self._token_id(self.eos_token)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _content(token) -> str | None:
        return token.get("content") if isinstance(token, dict) else token

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_bos).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render with the checkpoint's Jinja chat template (special tokens as text, as HF does)."""
        if not self.chat_template:
            return ByteChat().apply_chat_template(messages)
        import jinja2

        def raise_exception(message: str):
            raise ValueError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered conversation; a template writes its own BOS, so none is added."""
        if not self.chat_template:
            return self.encode(self.apply_chat_template(messages), add_bos=True)
        return self.encode(self.apply_chat_template(messages), add_bos=False)


class HFStreamDecoder:
    """Incremental detokenization: decode the whole output so far and emit what grew, holding back an
    incomplete UTF-8 character (shown as U+FFFD at the end)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer, self.sent = tokenizer, 0
        self.ids: list[int] = []

    def feed(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.sent = text[self.sent:], len(text)
        return piece


def load_tokenizer(model: str):
    """The tokenizer a model speaks: the checkpoint's when `model` is a directory, else the byte tokenizer."""
    from kvcentric.model.config import PRESETS

    if model in PRESETS:
        return DummyTokenizer()
    return HFTokenizer(model)
