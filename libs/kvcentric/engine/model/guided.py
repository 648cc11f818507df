"""Structured output on an engine: the token mask each sampling step of a guided sequence applies.

A sequence's grammar state is a function of its output so far, so it is kept nowhere but here, and rebuilt by
replaying that output wherever the sequence goes: the prefill's first token, each decode step (colocated and
mixed steps alike), each of n sequences (its own state), a preempted sequence when it resumes, and a migrated
one on its new instances (its output is in `history`). A matcher is cached per sequence and fed only the
tokens it has not seen; the cache is bounded, and a sequence pushed out of it is replayed again. A sequence's
matcher is a copy of its grammar's prototype (compiled once; the copies share its lexer's states, so what one
sequence's masks computed the others reuse). A batch's masks are computed together, into one bitmask the engine
keeps from step to step and the batch's `BatchMasks` reads packed (a CPU sampler applies it so, in one C++ call;
elsewhere it is unpacked once into the batch's rows); where the forward pass leaves the
CPU free (a GPU's), on a worker thread while it runs (`start`): a row's mask depends only on its output so far,
known before the forward. It decides no token: `kvcentric.engine.model.sampling` samples under the mask.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from collections.abc import Iterator, Sequence
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
MAX_GRAMMARS_KEPT = 64
"""Grammars whose prototype is kept; past this the least recently used is dropped and compiled again later."""
COPIES_PER_PROTOTYPE = 64
"""Sequences one prototype starts before it is compiled again: its copies share its lexer, whose states (and their
memory, and llguidance's bound on their number) grow with what they all explore; this bounds how many do."""
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

    def __init__(self, model: ModelConfig, overlap: bool = False) -> None:
        """`overlap`: `start` computes a batch's masks on a worker thread, to overlap a forward pass that leaves the
        CPU free (off the CPU); on the CPU the forward's threads take every core, and a worker beside them slows
        it by more than it saves (measured: docs/performance-notebook.md), so the masks are computed after it."""
        self.model, self.overlap = model, overlap
        self._tokenizer: LLTokenizer | None = None
        self.matchers: collections.OrderedDict[str, tuple[LLMatcher, int, bool]] = collections.OrderedDict()
        """Each guided sequence's matcher, the length of the output it has seen, and whether it is a prototype's
        copy (shares its lexer)."""
        self.prototypes: collections.OrderedDict[str, tuple[LLMatcher, int]] = collections.OrderedDict()
        """Each grammar's matcher at its start, and the copies made of it."""
        self._busy = threading.Lock()
        """Held while matchers are fed and asked for masks: a matcher is used by one thread at a time."""
        self._worker: ThreadPoolExecutor | None = None
        self._words = (model.vocab_size + 31) // 32
        self._buffer = np.zeros((0, self._words), dtype=np.int32)
        """The bitmask the matchers write their masks into, a row each (used under `_busy`)."""
        self._address = self._buffer.ctypes.data
        self._lent: weakref.ref[BatchMasks] | None = None
        """The masks the last call returned, which read their rows of the bitmask in place until the next call."""

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

    def masks(self, rows: Sequence[GuideRow | None], forced: bool = True) -> BatchMasks:
        """`allowed` of each guided row of a batch (None for a row that is not guided), the same masks as row by
        row: every matcher fed and writing its row of one bitmask (this engine's, kept from call to call), which the
        returned `BatchMasks` reads in place, packed, until the next call. `forced`: also name the rows whose mask
        allows one token (`BatchMasks.forced`; a sampler that draws every row anyway asks not to, it costs a few
        calls)."""
        guided = [index for index, row in enumerate(rows) if row is not None]
        if not guided:
            return BatchMasks(len(rows))
        with self._busy:
            lent = self._lent() if self._lent is not None else None
            if lent is not None:  # the last call's masks, still held: they keep a copy of their rows
                lent.detach()
            self._reserve(len(guided))
            for slot, index in enumerate(guided):
                self._fill(slot, *rows[index])  # type: ignore[misc]
            alone = self._forced(guided) if forced else {}
            masks = BatchMasks(len(rows), guided, forced=alone, bitmask=self._buffer, address=self._address,
                               vocab=self.vocab_size)
            self._lent = weakref.ref(masks)
        if self.overlap:  # a GPU's sampler applies them unpacked: unpacked here, on the worker, beside the forward
            masks.unpack()
        return masks

    def _forced(self, guided: Sequence[int]) -> dict[int, int]:
        """Row -> the one token its mask allows, for each guided row whose mask allows exactly one (a grammar's
        literal: a JSON key, a closing quote), found on the bitmask's words: one set bit in all the row's words,
        counted in one array op (the array ops it took per row cost a quarter of the masks' time at batch 8:
        docs/performance-notebook.md)."""
        words = self._buffer[:len(guided)]
        forced = {}
        for slot, bits in enumerate(np.bitwise_count(words.view(np.uint32)).sum(axis=1).tolist()):
            if bits == 1:
                index = int(words[slot].nonzero()[0][0])
                token = index * 32 + (int(words[slot, index]) & 0xFFFFFFFF).bit_length() - 1
                if token < self.vocab_size:
                    forced[guided[slot]] = token
        return forced

    def _reserve(self, rows: int) -> None:
        """Room for `rows` rows in the engine's bitmask (grown, never shrunk, as batches grow); each is written whole
        by `_fill`."""
        if len(self._buffer) < rows:
            self._buffer = np.zeros((max(rows, 2 * len(self._buffer)), self._words), dtype=np.int32)
            self._address = self._buffer.ctypes.data

    def _fill(self, slot: int, key: str, grammar: str, output: Sequence[int]) -> None:
        """Row `slot` of the bitmask: the mask of the sequence's matcher, fed its output. llguidance's mask allows
        EOS alone where the grammar allows nothing more (stopped, or refusing the output); a matcher in error (asked
        once, after its mask: each call into llguidance costs a few µs a row) gets every EOS id of the model."""
        matcher, shared = self.fed(key, grammar, output)
        row_bytes = self._words * 4
        matcher.unsafe_compute_mask_ptr(self._address + slot * row_bytes, row_bytes)
        if not matcher.is_error():
            return
        if shared:  # a prototype's copy: replayed on a matcher of its own
            matcher = self.unshare(key, grammar, output)
            if not matcher.is_error():
                matcher.unsafe_compute_mask_ptr(self._address + slot * row_bytes, row_bytes)
                return
        self._buffer[slot] = self._only_eos_words

    def start(self, rows: Sequence[GuideRow | None], forced: bool = True) -> Future[BatchMasks] | None:
        """`masks(rows)` begun on this engine's worker thread, where `overlap` says to (llguidance computes
        without the GIL, so the forward pass runs on meanwhile); None when not, or when no row is guided."""
        if not self.overlap or all(row is None for row in rows):
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="guides")
        return self._worker.submit(self.masks, list(rows), forced)

    def matcher(self, key: str, grammar: str, output: Sequence[int]) -> LLMatcher:
        """The sequence's matcher, fed the output it has not seen yet (a new copy of the grammar's prototype fed
        from the start if none is kept, or if the output is not the one it has seen)."""
        return self.fed(key, grammar, output)[0]

    def fed(self, key: str, grammar: str, output: Sequence[int]) -> tuple[LLMatcher, bool]:
        """`matcher`, and whether it is a prototype's copy."""
        kept = self.matchers.pop(key, None)
        if kept is not None and kept[1] <= len(output):
            matcher, seen, shared = kept
        else:
            (matcher, shared), seen = self.new_matcher(grammar), 0
        if seen == len(output) - 1:
            matcher.consume_token(output[-1])
        elif seen < len(output):
            matcher.consume_tokens(list(output[seen:]))
        self.matchers[key] = (matcher, len(output), shared)
        while len(self.matchers) > MAX_SEQUENCES_KEPT:
            self.matchers.popitem(last=False)
        return matcher, shared

    def new_matcher(self, grammar: str) -> tuple[LLMatcher, bool]:
        """A matcher at the grammar's start, a copy of its prototype (True) unless the grammar does not build: then
        it is in its error state (the gateway checked it, so this is not expected), and its sequence may only end."""
        prototype, copies = self.prototypes.pop(grammar, (None, 0))
        if prototype is None or copies >= COPIES_PER_PROTOTYPE:
            prototype, copies = LLMatcher(self.tokenizer, grammar), 0
        if prototype.is_error():
            return prototype, False
        self.prototypes[grammar] = (prototype, copies + 1)
        while len(self.prototypes) > MAX_GRAMMARS_KEPT:
            self.prototypes.popitem(last=False)
        return prototype.deep_copy(), True

    def unshare(self, key: str, grammar: str, output: Sequence[int]) -> LLMatcher:
        """A prototype's copy fell into its error state: so that sharing the lexer (its bound on states) is never
        what ends a sequence, the sequence is replayed on a matcher of its own, and the prototype compiled again."""
        self.prototypes.pop(grammar, None)
        matcher = LLMatcher(self.tokenizer, grammar)
        matcher.consume_tokens(list(output))
        self.matchers[key] = (matcher, len(output), False)
        return matcher

    def forget(self, key: str) -> None:
        self.matchers.pop(key, None)

    def only_eos(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.eos_ids] = True
        return allowed

    @functools.cached_property
    def _only_eos_words(self) -> np.ndarray:
        """`only_eos` as a row of the bitmask."""
        words = np.zeros(self._words * 4, dtype=np.uint8)
        packed = np.packbits(self.only_eos().numpy(), bitorder="little")
        words[:len(packed)] = packed
        return words.view(np.int32)


class BatchMasks:
    """The masks of a batch's rows, indexed by row: `allowed[slot]` the tokens row `rows[slot]` may take (a bool
    row of the vocabulary), for each guided row in the batch's order; a row not guided has none (None). Kept as
    llguidance wrote them, packed (`words`: a row of 32-bit words each, bit t of a row set where token t is allowed,
    at `address`), and unpacked into `allowed` only where it is read: a CPU sampler applies the packed rows in one
    call (`kernels.CpuMasks`). The packed rows are the guides' bitmask itself, read in place (a copy and its address
    cost 20 us of a decode step: docs/performance-notebook.md) until the guides' next call; that call first has the
    masks of the call before copy their rows out (`detach`) if anything still holds them."""

    def __init__(self, size: int, rows: Sequence[int] = (), allowed: torch.Tensor | None = None,
                 forced: dict[int, int] | None = None, bitmask: np.ndarray | None = None, address: int = 0,
                 vocab: int = 0) -> None:
        self.size, self.rows, self.vocab, self.address = size, list(rows), vocab, address
        self._bitmask, self._allowed, self._own = bitmask, allowed, False
        self.words_per_row = 0 if bitmask is None else bitmask.shape[1]
        """Of `words` (0: the masks were given unpacked)."""
        self.forced = forced or {}
        """Row -> the one token its mask allows, for the rows whose mask allows one alone."""
        self._slots: dict[int, int] | None = None

    @property
    def words(self) -> np.ndarray | None:
        """The guided rows' masks packed, a row of int32 words each (None where they were given unpacked)."""
        return None if self._bitmask is None else self._bitmask[:len(self.rows)]

    def detach(self) -> None:
        """Keep a copy of the packed rows, so that the bitmask they were read from may be written again."""
        words = self.words
        if words is not None and not self._own:
            self._bitmask, self._own = words.copy(), True
            self.address = self._bitmask.ctypes.data

    @property
    def allowed(self) -> torch.Tensor | None:
        """The guided rows' masks as one bool tensor (rows x vocabulary), unpacked from `words` on first use."""
        return self.unpack()

    def unpack(self) -> torch.Tensor | None:
        """`allowed`, unpacked now if it was not."""
        words = self.words
        if self._allowed is None and words is not None:
            bits = np.unpackbits(words.view(np.uint8), axis=1, count=self.vocab, bitorder="little")
            self._allowed = torch.from_numpy(bits.view(np.bool_))
        return self._allowed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, row: int) -> torch.Tensor | None:
        if not 0 <= row < self.size:
            raise IndexError(row)
        slot = self.slots().get(row)
        return None if slot is None or self.allowed is None else self.allowed[slot]

    def slots(self) -> dict[int, int]:
        """Row -> its slot in `allowed`, for the guided rows."""
        if self._slots is None:
            self._slots = {guided: slot for slot, guided in enumerate(self.rows)}
        return self._slots

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return (self[row] for row in range(self.size))
