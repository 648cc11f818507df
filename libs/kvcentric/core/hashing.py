"""Chained prefix block hashing of token ids (vLLM-compatible ``sha256_cbor`` plus two faster binary
variants); it only computes hashes and does not store, look up or evict blocks."""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from itertools import accumulate
from operator import index
from typing import Literal, get_args

import numpy as np
import xxhash

HashAlgo = Literal["sha256_cbor", "sha256_hex", "xxhash"]
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)

_sha256 = hashlib.sha256
_xxh3_128 = xxhash.xxh3_128_digest
_NUMPY_MIN_TOKENS = 512  # below this, per-token Python encoding beats numpy's fixed overhead (measured crossover ~500)


# ---------------------------------------------------------------- canonical CBOR (RFC 8949)
def _head(major: int, n: int) -> bytes:
    """Shortest CBOR head for major type ``major`` and argument ``n`` (0 <= n < 2**64)."""
    mt = major << 5
    if n < 24:
        return bytes((mt | n,))
    for info, fmt, limit in ((24, ">B", 1 << 8), (25, ">H", 1 << 16), (26, ">I", 1 << 32)):
        if n < limit:
            return bytes((mt | info,)) + struct.pack(fmt, n)
    return bytes((mt | 27,)) + struct.pack(">Q", n)


def _cbor_int(n: int) -> bytes:
    """Canonical CBOR integer; values beyond 64 bits become bignums (tags 2/3) like cbor2."""
    major, n = (0, n) if n >= 0 else (1, -1 - n)
    if n < 1 << 64:
        return _head(major, n)
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((0xC2 + major,)) + _head(2, len(raw)) + raw


def cbor_encode(obj: object) -> bytes:
    """Canonical CBOR for None, bool, int, str, bytes and (nested) lists/tuples."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_int(obj)
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _head(3, len(raw)) + raw
    if isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        return _head(2, len(raw)) + raw
    if isinstance(obj, (list, tuple)):
        return _head(4, len(obj)) + b"".join(map(cbor_encode, obj))
    raise TypeError(f"cannot CBOR-encode extra key of type {type(obj).__name__}")


def _token_cbor(tok: int) -> bytes:
    n = index(tok)
    if n < 0:
        raise ValueError(f"token ids must be non-negative, got {n}")
    return _cbor_int(n)


_SMALL_UINT = [_head(0, i) for i in range(256)]
_SMALL_UINT += [b"\x19" + i.to_bytes(2, "big") for i in range(256, 1 << 16)]


def _cbor_tokens_py(token_ids: Sequence[int]) -> list[bytes]:
    """Per-token CBOR encodings (precomputed table for ids < 65536)."""
    if min(token_ids) >= 0 and max(token_ids) < len(_SMALL_UINT):
        return list(map(_SMALL_UINT.__getitem__, token_ids))
    return list(map(_token_cbor, token_ids))


_UINT_LIMITS = np.array([24, 1 << 8, 1 << 16, 1 << 32], dtype=np.uint64)
_UINT_EXTRA = np.array([0, 1, 2, 4, 8])  # payload bytes after the head byte, per size class
_UINT_INFO = np.array([0, 24, 25, 26, 27], dtype=np.uint8)


def _cbor_tokens(token_ids: Sequence[int]) -> tuple[bytes, list[int]]:
    """Concatenated CBOR encodings of the token ids and the offset where each ends (prefixed by 0)."""
    arr = np.asarray(token_ids) if len(token_ids) >= _NUMPY_MIN_TOKENS else None
    if arr is not None and arr.dtype.kind in "iu" and arr.ndim == 1:
        return _cbor_tokens_np(arr)
    # short input, ids >= 2**63 (numpy gives float/object) or non-int input: per-token path validates
    encs = _cbor_tokens_py(token_ids) if len(token_ids) else []
    return b"".join(encs), list(accumulate(map(len, encs), initial=0))


def _cbor_tokens_np(arr: np.ndarray) -> tuple[bytes, list[int]]:
    """Vectorised ``_cbor_tokens`` for a 1-D integer array."""
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise ValueError(f"token ids must be non-negative, got {arr.min()}")
    v = arr.astype(np.uint64)
    cls = np.searchsorted(_UINT_LIMITS, v, side="right")
    extra = _UINT_EXTRA[cls]
    # row i = [head byte, 8 big-endian value bytes]; keep the head and the last extra[i] value bytes
    rows = np.empty((v.size, 9), dtype=np.uint8)
    rows[:, 0] = np.where(cls == 0, v, _UINT_INFO[cls])
    rows[:, 1:] = v.astype(">u8").view(np.uint8).reshape(-1, 8)
    keep = np.arange(9) >= (9 - extra)[:, None]
    keep[:, 0] = True
    return rows[keep].tobytes(), [0, *np.cumsum(extra + 1).tolist()]


_CBOR_PARENT_32 = b"\x83" + _head(2, 32)  # array(3) head + byte-string head for a 32-byte parent


def _cbor_parent(parent: bytes) -> bytes:
    """CBOR array(3) head followed by ``parent`` as a CBOR byte string."""
    pre = _CBOR_PARENT_32 if len(parent) == 32 else b"\x83" + _head(2, len(parent))
    return pre + parent


NONE_HASH: bytes = _sha256(cbor_encode("vllm-none-hash")).digest()


# ---------------------------------------------------------------- binary encoding (sha256_hex / xxhash)
_U32 = "I" if array("I").itemsize == 4 else "L"
_LITTLE = struct.pack("=H", 1) == b"\x01\x00"


def _u32le(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError if any id is outside [0, 2**32)."""
    try:
        arr = array(_U32, token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32) for sha256_hex/xxhash") from None
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _extra_bytes(extra_keys: tuple | None) -> bytes:
    return b"" if extra_keys is None else b"\x00" + repr(extra_keys).encode("utf-8")


def _as_list(token_ids: Sequence[int]) -> Sequence[int]:
    """numpy arrays / tensors -> list of Python ints (much faster to iterate)."""
    tolist = getattr(token_ids, "tolist", None)
    return tolist() if tolist is not None else token_ids


def _sha256_digest(data: bytes) -> bytes:
    return _sha256(data).digest()


# ---------------------------------------------------------------- public API
class BlockHasher:
    """Hashes full blocks of token ids into a chain: hash_i = H(hash_{i-1}, tokens of block i, extra_keys).

    * ``sha256_cbor``: sha256(canonical CBOR of ``[parent, [token ids], extra_keys or null]``),
      byte-identical to vLLM's ``sha256_cbor`` prefix-cache hashes. With ``seed=None`` the root is
      ``NONE_HASH``; with a seed it is ``sha256_cbor(str(seed))``, i.e. vLLM's root when
      ``PYTHONHASHSEED=str(seed)``.
    * ``sha256_hex`` / ``xxhash``: sha256 (32 bytes) / xxh3_128 seeded by ``seed or 0`` (16 bytes)
      over ``parent + u32le(len(block)) + u32le(token ids) [+ b"\\0" + repr(extra_keys)]``;
      token ids must be < 2**32.
    """

    def __init__(self, algo: HashAlgo = "sha256_cbor", block_size: int = 16, seed: int | None = None):
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash algo {algo!r}; valid choices: {', '.join(HASH_ALGOS)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.algo = algo
        self.block_size = block_size
        self.seed = None if seed is None else index(seed)
        self._xxh_seed = (self.seed or 0) % (1 << 64)
        self._digest = self._xxh_digest if algo == "xxhash" else _sha256_digest
        self._root = self._make_root()

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self.algo!r}, block_size={self.block_size}, seed={self.seed!r})"

    @property
    def root(self) -> bytes:
        """Parent hash of the first block of every chain."""
        return self._root

    def _make_root(self) -> bytes:
        if self.algo == "sha256_cbor":
            return NONE_HASH if self.seed is None else _sha256_digest(cbor_encode(str(self.seed)))
        return self._digest(f"kvcentric/{self.algo}/root/{self.seed!r}".encode())

    def _xxh_digest(self, data: bytes) -> bytes:
        return _xxh3_128(data, self._xxh_seed)

    def hash_block(self, parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """Hash one block (of any length) given its parent's hash."""
        token_ids = _as_list(token_ids)
        n = len(token_ids)
        if self.algo == "sha256_cbor":
            tokens = _cbor_tokens(token_ids)[0]
            return _sha256(_cbor_parent(parent) + _head(4, n) + tokens + cbor_encode(extra_keys)).digest()
        return self._digest(parent + struct.pack("<I", n) + _u32le(token_ids) + _extra_bytes(extra_keys))

    def hash_blocks(
        self, token_ids: Sequence[int], parent: bytes | None = None, extra_keys: tuple | None = None
    ) -> list[bytes]:
        """Hashes of the ``len(token_ids) // block_size`` full blocks; a trailing partial block is ignored."""
        token_ids = _as_list(token_ids)
        n = len(token_ids) // self.block_size * self.block_size
        if n == 0:
            return []
        parent = self._root if parent is None else parent
        chain = self._chain_cbor if self.algo == "sha256_cbor" else self._chain_binary
        return chain(parent, token_ids[:n], extra_keys)

    def prefix_keys(self, token_ids: Sequence[int], unfull_chunk: bool = False) -> list[bytes]:
        """The keys a prompt is looked up by: its full blocks' hashes and, with `unfull_chunk` (Llumnix's
        --kvs-enable-save-unfull-chunk), the hash of its trailing partial block chained after them."""
        token_ids = _as_list(token_ids)
        keys = self.hash_blocks(token_ids)
        rest = len(token_ids) % self.block_size
        if unfull_chunk and rest:
            keys.append(self.hash_block(keys[-1] if keys else self._root, token_ids[len(token_ids) - rest:]))
        return keys

    def _chain_cbor(self, parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None) -> list[bytes]:
        bs = self.block_size
        buf, ends = _cbor_tokens(token_ids)
        arr_head, tail = _head(4, bs), cbor_encode(extra_keys)
        out: list[bytes] = []
        for start, end in zip(ends[0:-1:bs], ends[bs::bs]):
            parent = _sha256(_cbor_parent(parent) + arr_head + buf[start:end] + tail).digest()
            out.append(parent)
        return out

    def _chain_binary(self, parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None) -> list[bytes]:
        buf, width, digest = _u32le(token_ids), 4 * self.block_size, self._digest
        count, tail = struct.pack("<I", self.block_size), _extra_bytes(extra_keys)
        out: list[bytes] = []
        for off in range(0, len(buf), width):
            parent = digest(parent + count + buf[off : off + width] + tail)
            out.append(parent)
        return out


def parse_seed(text: str) -> int | None:
    """A hash seed setting: "" is no seed (vLLM's root without PYTHONHASHSEED), else an integer (Llumnix's
    GO_HASH_SEED, "0" there by default); ValueError otherwise."""
    text = text.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"a hash seed is an integer or empty, got {text!r}") from None


def to_hex(h: bytes) -> str:
    """Lower-case hex string of a block hash."""
    return h.hex()
