"""The tokenizer of the built-in dummy models: one token per UTF-8 byte, plus BOS and EOS, and for presets
with a larger vocabulary (the 32K and 128K of Llama shapes) one synthetic word per id above those, so that
every id a random-weight model samples decodes to visible text.

It encodes text to byte ids (it never produces a word id) and decodes ids back to text incrementally (a
multi-byte character split across two tokens comes out once complete).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable

BYTE_VOCAB = 258
"""256 bytes, BOS and EOS: the ids every dummy model has."""

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def synthetic_word(token_id: int) -> str:
    """The text of a word id (>= BYTE_VOCAB): a space and consonant-vowel syllables, distinct per id."""
    n, syllables = token_id - BYTE_VOCAB, []
    while True:
        n, digit = divmod(n, len(_CONSONANTS) * len(_VOWELS))
        syllables.append(_CONSONANTS[digit // len(_VOWELS)] + _VOWELS[digit % len(_VOWELS)])
        if n == 0:
            return " " + "".join(reversed(syllables))


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int = BYTE_VOCAB) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        decoder = self.stream_decoder()
        return decoder.feed(token_ids) + decoder.flush()

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.vocab_size)

    def token_str(self, token_id: int) -> str:
        """The token as the vocabulary spells it (vLLM's `token_strs`): its text, a byte on its own as U+FFFD
        when it is not ASCII."""
        return self.decode([token_id])


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete characters; word ids come out
    whole, after any bytes before them."""

    def __init__(self, vocab_size: int = BYTE_VOCAB) -> None:
        self.vocab_size = vocab_size
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        pieces, pending = [], bytearray()
        for token in token_ids:
            if 0 <= token < 256:
                pending.append(token)
            elif BYTE_VOCAB <= token < self.vocab_size:
                pieces.append(self._utf8.decode(bytes(pending), final=True) + synthetic_word(token))
                pending.clear()
        return "".join(pieces) + self._utf8.decode(bytes(pending))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


SIMPLE_CHAT_TEMPLATE = "{role}: {content}\n"
"""How dummy models render chat messages: one "role: content" line each, then "assistant: "; a request's tools
first, as one line `tools: [...]` (OpenAI's declarations as JSON). A message's
`name` (or a tool message's `tool_call_id`) follows its role in parentheses, and an assistant's tool calls
follow its content, each as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`."""


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its own `raise_exception`, or a Jinja error): the client's
    messages break what the template expects, such as alternating roles."""


def simple_chat_line(message: dict) -> str:
    """One message in the simple template."""
    tag = message.get("name") or message.get("tool_call_id")
    role = f"{message['role']} ({tag})" if tag else message["role"]
    calls = "".join(f"<tool_call>{json.dumps(call['function'])}</tool_call>" for call in message.get("tool_calls", ()))
    return SIMPLE_CHAT_TEMPLATE.format(role=role, content=message["content"] + calls)


class ByteChat:
    """The documented simple chat template of the dummy models."""

    chat_template = None
    encode: Callable[..., list[int]]  # the tokenizer this is mixed into

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        shown = f"tools: {json.dumps(tools)}\n" if tools else ""
        lines = "".join(simple_chat_line(m) for m in messages)
        return shown + lines + ("assistant: " if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered conversation, ready for generation (BOS included once)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_bos=True)


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

    def token_str(self, token_id: int) -> str:
        """The token as the vocabulary spells it (vLLM's `token_strs`, such as "Ġhello")."""
        return self._tokenizer.id_to_token(token_id) or ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render with the checkpoint's Jinja chat template (special tokens as text, as HF does); `tools` as
        OpenAI declares them, for a template that shows them to the model."""
        if not self.chat_template:
            return ByteChat().apply_chat_template(messages, add_generation_prompt, tools)
        import jinja2

        def raise_exception(message: str):
            raise ChatTemplateError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)  # a template that does not compile is the server's fault
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "", tools=tools or None)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered conversation; a template writes its own BOS, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_bos=not self.chat_template)


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
        return DummyTokenizer(PRESETS[model].vocab_size)
    return HFTokenizer(model)
