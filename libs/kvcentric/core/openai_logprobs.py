"""Token logprobs in OpenAI's two shapes: the completions one (parallel lists, with text offsets) and the
chat one (a list of token objects). It names tokens through a function it is given; it computes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvcentric.core.protocol import TokenLogprob

TokenText = Callable[[int], str]
"""A token id to the text that stands for it in a logprobs answer."""


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], text_of: TokenText,
                        start_offset: int = 0) -> dict[str, Any]:
    """The `logprobs` of a completions choice: `tokens`, `token_logprobs`, `top_logprobs` (token text to
    logprob) and `text_offset`. An entry None (the prompt's first token, with echo) is null in both lists."""
    tokens = [text_of(token) for token in token_ids]
    offsets, offset = [], start_offset
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if e is None else finite(e.logprob) for e in entries],
            "top_logprobs": [None if e is None else _top_map(e, text_of) for e in entries], "text_offset": offsets}


def _top_map(entry: TokenLogprob, text_of: TokenText) -> dict[str, float]:
    """The likeliest tokens and the chosen one (OpenAI lists it too), by text; when two ids share a text,
    the likelier one's logprob stays."""
    pairs = [*zip(entry.top_ids, entry.top_logprobs), (entry.token_id, entry.logprob)]
    top: dict[str, float] = {}
    for token, logprob in pairs:
        text = text_of(token)
        top[text] = max(finite(logprob), top.get(text, LOWEST))
    return top


LOWEST = -9999.0
"""What a logprob of -inf (a token masked out) is written as: JSON has no infinity, OpenAI writes this."""


def finite(logprob: float) -> float:
    return max(logprob, LOWEST)


def chat_logprobs(entries: Sequence[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """The `logprobs` of a chat choice: {"content": [token objects], "refusal": None}."""
    return {"content": [_chat_token(e, text_of) for e in entries], "refusal": None}


def _chat_token(entry: TokenLogprob, text_of: TokenText) -> dict[str, Any]:
    top = [_token_object(token, logprob, text_of) for token, logprob in zip(entry.top_ids, entry.top_logprobs)]
    return {**_token_object(entry.token_id, entry.logprob, text_of), "top_logprobs": top}


def _token_object(token: int, logprob: float, text_of: TokenText) -> dict[str, Any]:
    text = text_of(token)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The pieces' completions logprobs joined into one (the whole answer's), or None when there are none."""
    if not parts:
        return None
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}
