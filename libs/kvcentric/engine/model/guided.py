"""Structured output on an engine: the token mask each sampling step of a guided sequence applies.

A sequence's grammar state is a function of its output so far, so it is kept nowhere but here, and rebuilt by
replaying that output wherever the sequence goes: the prefill's first token, each decode step (colocated and
mixed steps alike), each of n sequences (its own state), a preempted sequence when it resumes, and a migrated
one on its new instances (its output is in `history`). A matcher is cached per sequence and fed only the
tokens it has not seen; the cache is bounded, and a sequence pushed out of it is replayed again. It decides no
token: `kvcentric.engine.model.sampling` samples under the mask.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from kvcentric.core.protocol import SamplingParams

from kvcentric.model.config import ModelConfig
from kvcentric.model.tokenizer import BYTE_VOCAB, ByteTokenizer, synthetic_word

MAX_SEQUENCES_KEPT = 4096
"""Matchers kept (one per guided sequence); past this the least recently used is dropped and rebuilt later."""
SPECIAL = b"\xff"
"""llguidance's mark of a special token: its bytes start with 0xFF (never in UTF-8 text)."""


class ByteVocabulary:
    """The dummy models' vocabulary as llguidance reads one: each token's bytes, BOS and EOS marked special."""

    def __init__(self, vocab_size: int) -> None:
        tokenizer = ByteTokenizer(vocab_size)
        self.encoder = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = [self.bos_token_id, self.eos_token_id]
        self.tokens = [bytes([i]) for i in range(256)] + [SPECIAL + b"<s>", SPECIAL + b"</s>"]
        self.tokens += [synthetic_word(i).encode() for i in range(BYTE_VOCAB, vocab_size)]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def llg_tokenizer(model: ModelConfig) -> LLTokenizer:
    """The model's tokenizer for llguidance: the byte vocabulary of a preset, else the checkpoint's
    tokenizer.json; a mask row per logit, the model's EOS ids ending a sequence."""
    eos = sorted(model.eos_token_ids)
    if not model.path:
        return LLTokenizer(TokenizerWrapper(ByteVocabulary(model.vocab_size)), n_vocab=model.vocab_size,
                           eos_token=eos)
    return LLTokenizer((Path(model.path) / "tokenizer.json").read_text(), n_vocab=model.vocab_size, eos_token=eos)


class Guides:
    """The matchers of the guided sequences an engine samples for, and the masks they give."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self._tokenizer: LLTokenizer | None = None
        self.matchers: collections.OrderedDict[str, tuple[LLMatcher, int]] = collections.OrderedDict()

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def eos_ids(self) -> list[int]:
        return sorted(self.model.eos_token_ids)

    @property
    def tokenizer(self) -> LLTokenizer:
        """Built on the first guided request (a preset's in milliseconds, a large vocabulary's in a fraction of a
        second), so an engine that serves none pays nothing."""
        if self._tokenizer is None:
            self._tokenizer = llg_tokenizer(self.model)
        return self._tokenizer

    def mask(self, key: str, sampling: SamplingParams, output: Sequence[int]) -> torch.Tensor | None:
        """The allowed tokens of a guided sequence (None when the request is not guided)."""
        return self.allowed(key, sampling.guide, output) if sampling.guide else None

    def allowed(self, key: str, grammar: str, output: Sequence[int]) -> torch.Tensor:
        """The tokens the grammar allows after `output` (a bool row of the vocabulary). A sequence whose output
        the grammar refuses (it cannot, sampled under these masks) may only end."""
        matcher = self.matcher(key, grammar, output)
        if matcher.is_error():
            return self.only_eos()
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[:self.vocab_size].astype(bool))
        return allowed if bool(allowed.any()) else self.only_eos()

    def matcher(self, key: str, grammar: str, output: Sequence[int]) -> LLMatcher:
        """The sequence's matcher, fed the output it has not seen yet (made and fed from the start if none is
        kept, or if the output is not the one it has seen)."""
        kept = self.matchers.pop(key, None)
        matcher, seen = kept if kept is not None and kept[1] <= len(output) else (self.new_matcher(grammar), 0)
        if seen < len(output):
            matcher.consume_tokens(list(output[seen:]))
        self.matchers[key] = (matcher, len(output))
        while len(self.matchers) > MAX_SEQUENCES_KEPT:
            self.matchers.popitem(last=False)
        return matcher

    def new_matcher(self, grammar: str) -> LLMatcher:
        """A matcher at the grammar's start. One whose grammar does not build (the gateway checked it, so this
        is not expected) is in its error state, and `allowed` lets its sequence only end."""
        return LLMatcher(self.tokenizer, grammar)

    def forget(self, key: str) -> None:
        self.matchers.pop(key, None)

    def only_eos(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.eos_ids] = True
        return allowed
