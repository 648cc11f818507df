"""Structured output on an engine: the token mask each sampling step of a guided sequence applies.

A sequence's grammar state is a function of its output so far, so it is kept nowhere but here, and rebuilt by
replaying that output wherever the sequence goes: the prefill's first token, each decode step (colocated and
mixed steps alike), each of n sequences (its own state), a preempted sequence when it resumes, and a migrated
one on its new instances (its output is in `history`). A matcher is cached per sequence and fed only the
tokens it has not seen; the cache is bounded, and a sequence pushed out of it is replayed again. A batch's masks
are computed together, into one bitmask unpacked once, and may be computed on a worker thread (`start`) while the
step's forward pass runs: a row's mask depends only on its output so far, known before the forward. It decides no
token: `kvcentric.engine.model.sampling` samples under the mask.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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

GuideRow = tuple[str, str, Sequence[int]]
"""A guided sequence in a batch: its key, its grammar and its output so far."""


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
        self._busy = threading.Lock()
        """Held while matchers are fed and asked for masks: a matcher is used by one thread at a time."""
        self._worker: ThreadPoolExecutor | None = None

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
        allowed = self.masks([(key, grammar, output)])[0]
        assert allowed is not None
        return allowed

    def masks(self, rows: Sequence[GuideRow | None]) -> list[torch.Tensor | None]:
        """`allowed` of each guided row of a batch (None for a row that is not guided), the same masks as row by
        row: every matcher fed, then each writes its row of one bitmask, which is unpacked once."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        guided = [(index, row) for index, row in enumerate(rows) if row is not None]
        if not guided:
            return out
        words = (self.vocab_size + 31) // 32
        bitmask = np.zeros((len(guided), words), dtype=np.int32)
        with self._busy:
            for slot, (_, (key, grammar, output)) in enumerate(guided):
                matcher = self.matcher(key, grammar, output)
                if not matcher.is_error():  # (one in error would allow EOS alone; `allowed` says so below)
                    matcher.unsafe_compute_mask_ptr(bitmask[slot].ctypes.data, words * 4)
        bits = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size,
                                              bitorder="little").view(np.bool_))
        ends = ~bits.any(dim=1)
        if bool(ends.any()):
            bits[ends] = self.only_eos()
        for slot, (index, _) in enumerate(guided):
            out[index] = bits[slot]
        return out

    def start(self, rows: Sequence[GuideRow | None]) -> Future[list[torch.Tensor | None]] | None:
        """`masks(rows)` begun on this engine's worker thread (llguidance computes without the GIL, so the model's
        forward pass runs on meanwhile); None when no row is guided."""
        if all(row is None for row in rows):
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="guides")
        return self._worker.submit(self.masks, list(rows))

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
