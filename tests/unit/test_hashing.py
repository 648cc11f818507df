"""Tests for kvcentric.core.hashing: vLLM sha256_cbor compatibility, chain semantics, validation."""

import hashlib
import random

import cbor2
import numpy as np
import pytest

from kvcentric.core.hashing import HASH_ALGOS, NONE_HASH, BlockHasher, cbor_encode, to_hex

VLLM_BLOCK0 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
VLLM_BLOCK1 = "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c"
EXTRA_KEYS = [
    None,
    (),
    ("lora-a",),
    ("mm-hash-0123", 7, b"\x00\xff" * 20, "caché-salt"),
    (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, 2**80),
    (-1, -24, -25, -(2**64), -(2**64) - 1, True, False, None, ["nested", (1, 2)], "x" * 300),
]


def cbor2_chain(token_ids, block_size, parent=NONE_HASH, extra_keys=None):
    """Reference: vLLM's hash_block_tokens with sha256_cbor, built on cbor2."""
    out = []
    for i in range(0, len(token_ids) // block_size * block_size, block_size):
        payload = (parent, tuple(token_ids[i : i + block_size]), extra_keys)
        parent = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
        out.append(parent)
    return out


def random_tokens(rng, n, max_id):
    return [rng.randrange(max_id) for _ in range(n)]


def test_hash_algos_lists_the_three_algorithms():
    assert HASH_ALGOS == ("sha256_cbor", "sha256_hex", "xxhash")


def test_none_hash_is_sha256_of_cbor_text_vllm_none_hash():
    expected = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    assert NONE_HASH == bytes.fromhex(expected)
    assert NONE_HASH == hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    assert BlockHasher().root == NONE_HASH


def test_sha256_cbor_matches_vllm_vectors():
    hasher = BlockHasher("sha256_cbor", block_size=16)
    assert [to_hex(h) for h in hasher.hash_blocks(list(range(32)))] == [VLLM_BLOCK0, VLLM_BLOCK1]
    first = hasher.hash_block(NONE_HASH, list(range(16)))
    assert to_hex(first) == VLLM_BLOCK0
    assert to_hex(hasher.hash_block(first, list(range(16, 32)))) == VLLM_BLOCK1
    assert [to_hex(h) for h in hasher.hash_blocks(list(range(16, 32)), parent=first)] == [VLLM_BLOCK1]


@pytest.mark.parametrize("n_tokens", [1, 16, 31, 33, 100, 1000, 4099])
@pytest.mark.parametrize("max_id", [24, 256, 65536, 200_000, 2**32 + 5, 2**40])
@pytest.mark.parametrize("block_size", [1, 16, 17])
def test_sha256_cbor_matches_cbor2_reference_for_random_tokens(n_tokens, max_id, block_size):
    rng = random.Random(n_tokens * 31 + max_id + block_size)
    tokens = random_tokens(rng, n_tokens, max_id)
    assert BlockHasher(block_size=block_size).hash_blocks(tokens) == cbor2_chain(tokens, block_size)


@pytest.mark.parametrize("n_tokens", [16, 160, 600])
def test_sha256_cbor_matches_cbor2_reference_for_ids_beyond_64_bits(n_tokens):
    rng = random.Random(n_tokens)
    starts = [0, 2**63, 2**64]  # small ids, ids numpy cannot hold as int64, CBOR bignums
    tokens = [rng.choice(starts) + rng.randrange(2**16) for _ in range(n_tokens)]
    assert BlockHasher().hash_blocks(tokens) == cbor2_chain(tokens, 16)


@pytest.mark.parametrize("extra_keys", EXTRA_KEYS)
@pytest.mark.parametrize("n_tokens", [16, 96])
def test_sha256_cbor_extra_keys_match_cbor2_reference(extra_keys, n_tokens):
    tokens = random_tokens(random.Random(7), n_tokens, 150_000)
    hasher = BlockHasher()
    assert hasher.hash_blocks(tokens, extra_keys=extra_keys) == cbor2_chain(tokens, 16, extra_keys=extra_keys)
    single = hashlib.sha256(cbor2.dumps((NONE_HASH, tuple(tokens[:5]), extra_keys), canonical=True)).digest()
    assert hasher.hash_block(NONE_HASH, tokens[:5], extra_keys) == single


CBOR_VALUES = [*EXTRA_KEYS, "", b"", [], 2**200, -(2**200), "ü" * 70000, list(range(30))]


@pytest.mark.parametrize("value", CBOR_VALUES)
def test_cbor_encode_matches_cbor2_canonical(value):
    assert cbor_encode(value) == cbor2.dumps(value, canonical=True)


def test_cbor_encode_rejects_unsupported_types():
    with pytest.raises(TypeError):
        cbor_encode({"a": 1})


def test_sha256_cbor_accepts_numpy_arrays_and_tuples():
    tokens = random_tokens(random.Random(3), 200, 100_000)
    expected = cbor2_chain(tokens, 16)
    hasher = BlockHasher()
    assert hasher.hash_blocks(np.array(tokens, dtype=np.int64)) == expected
    assert hasher.hash_blocks(np.array(tokens, dtype=np.uint32)) == expected
    assert hasher.hash_blocks(tuple(tokens)) == expected


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_blocks_equals_repeated_hash_block(algo):
    hasher = BlockHasher(algo, block_size=8)
    tokens = random_tokens(random.Random(5), 80, 50_000)
    for extra_keys in (None, ("salt", 3)):
        parent, expected = hasher.root, []
        for i in range(0, 80, 8):
            parent = hasher.hash_block(parent, tokens[i : i + 8], extra_keys)
            expected.append(parent)
        assert hasher.hash_blocks(tokens, extra_keys=extra_keys) == expected


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_same_prefix_gives_same_leading_hashes(algo):
    hasher = BlockHasher(algo, block_size=16)
    rng = random.Random(11)
    prefix = random_tokens(rng, 64, 32_000)
    a = hasher.hash_blocks(prefix + random_tokens(rng, 48, 32_000))
    b = hasher.hash_blocks(prefix + random_tokens(rng, 80, 32_000))
    assert a[:4] == b[:4] == hasher.hash_blocks(prefix)
    assert len(set(a[4:]) & set(b[4:])) == 0


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("changed_block", [0, 3, 7])
def test_changing_a_token_in_block_k_changes_hashes_from_k_on(algo, changed_block):
    hasher = BlockHasher(algo, block_size=16)
    tokens = random_tokens(random.Random(13), 128, 32_000)
    changed = list(tokens)
    changed[changed_block * 16 + 5] += 1
    a, b = hasher.hash_blocks(tokens), hasher.hash_blocks(changed)
    assert a[:changed_block] == b[:changed_block]
    assert all(x != y for x, y in zip(a[changed_block:], b[changed_block:]))


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_partial_trailing_block_is_not_hashed(algo):
    hasher = BlockHasher(algo, block_size=16)
    tokens = list(range(100))
    hashes = hasher.hash_blocks(tokens)
    assert len(hashes) == 6
    assert hashes == hasher.hash_blocks(tokens[:96]) == hasher.hash_blocks(tokens[:96] + [1, 2, 3])
    assert hasher.hash_blocks(tokens[:15]) == []
    assert hasher.hash_blocks([]) == []


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_seed_changes_root_and_all_hashes(algo):
    tokens = list(range(64))
    unseeded, seeded = BlockHasher(algo), BlockHasher(algo, seed=1234)
    assert unseeded.root != seeded.root
    assert BlockHasher(algo, seed=1234).root == seeded.root
    assert all(x != y for x, y in zip(unseeded.hash_blocks(tokens), seeded.hash_blocks(tokens)))
    assert seeded.hash_blocks(tokens) == BlockHasher(algo, seed=1234).hash_blocks(tokens)
    assert BlockHasher(algo, seed=1).root != BlockHasher(algo, seed=2).root


def test_sha256_cbor_seeded_root_matches_vllm_pythonhashseed():
    # vLLM: NONE_HASH = sha256_cbor(os.getenv("PYTHONHASHSEED")) when the variable is set
    assert BlockHasher(seed=42).root == hashlib.sha256(cbor2.dumps("42", canonical=True)).digest()


@pytest.mark.parametrize("algo", ["sha256_hex", "xxhash"])
def test_binary_algos_are_deterministic_with_expected_digest_sizes(algo):
    tokens = random_tokens(random.Random(17), 4096 + 7, 2**32)
    a = BlockHasher(algo, block_size=16).hash_blocks(tokens)
    b = BlockHasher(algo, block_size=16).hash_blocks(list(tokens))
    assert a == b and len(a) == 256 and len(set(a)) == 256
    assert {len(h) for h in a} == {32 if algo == "sha256_hex" else 16}
    assert BlockHasher(algo).hash_blocks(np.array(tokens, dtype=np.uint32)) == a


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_extra_keys_change_hashes(algo):
    hasher = BlockHasher(algo)
    tokens = list(range(32))
    plain = hasher.hash_blocks(tokens)
    salted = hasher.hash_blocks(tokens, extra_keys=("salt",))
    assert all(x != y for x, y in zip(plain, salted))
    assert salted != hasher.hash_blocks(tokens, extra_keys=("other",))


def test_algorithms_produce_different_hashes():
    tokens = list(range(32))
    assert len({tuple(BlockHasher(a).hash_blocks(tokens)) for a in HASH_ALGOS}) == 3


def test_unknown_algo_raises_value_error_naming_valid_choices():
    with pytest.raises(ValueError, match="sha256_cbor.*sha256_hex.*xxhash"):
        BlockHasher("md5")


@pytest.mark.parametrize("block_size", [0, -1, 1.5, True])
def test_bad_block_size_raises_value_error(block_size):
    with pytest.raises(ValueError):
        BlockHasher(block_size=block_size)


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("n_tokens", [16, 512])
def test_negative_token_id_raises_value_error(algo, n_tokens):
    tokens = list(range(n_tokens))
    tokens[n_tokens // 2] = -3
    hasher = BlockHasher(algo)
    with pytest.raises(ValueError):
        hasher.hash_blocks(tokens)
    with pytest.raises(ValueError):
        hasher.hash_block(hasher.root, tokens[n_tokens // 2 - 8 : n_tokens // 2 + 8])


@pytest.mark.parametrize("algo", ["sha256_hex", "xxhash"])
def test_binary_algos_reject_token_ids_beyond_uint32(algo):
    with pytest.raises(ValueError):
        BlockHasher(algo).hash_blocks([2**32] * 16)


def test_to_hex_returns_lowercase_hex():
    assert to_hex(b"\x00\xab\xff") == "00abff"
    assert to_hex(NONE_HASH) == NONE_HASH.hex()


def test_the_unfull_chunk_option_adds_the_trailing_partial_blocks_chained_hash():
    """Llumnix's --kvs-enable-save-unfull-chunk: keys of full blocks, then the partial block's, chained."""
    from kvcentric.core.hashing import BlockHasher
    hasher = BlockHasher("sha256_hex", 4)
    tokens = list(range(10))
    full = hasher.hash_blocks(tokens)
    assert hasher.prefix_keys(tokens) == full and len(full) == 2
    keys = hasher.prefix_keys(tokens, unfull_chunk=True)
    assert keys[:2] == full and keys[2] == hasher.hash_block(full[-1], [8, 9])
    assert hasher.prefix_keys(tokens[:8], unfull_chunk=True) == full  # no partial block: nothing added
    assert hasher.prefix_keys([1, 2], unfull_chunk=True) == [hasher.hash_block(hasher.root, [1, 2])]


def test_a_hash_seed_setting_is_an_integer_or_empty_and_changes_every_key():
    from kvcentric.core.hashing import BlockHasher, parse_seed
    assert parse_seed("") is None and parse_seed(" 0 ") == 0 and parse_seed("-3") == -3
    with pytest.raises(ValueError, match="integer or empty"):
        parse_seed("abc")
    tokens = list(range(32))
    assert BlockHasher(seed=parse_seed("0")).hash_blocks(tokens) != BlockHasher().hash_blocks(tokens)
    assert BlockHasher(seed=0).hash_blocks(tokens) == BlockHasher(seed=parse_seed("0")).hash_blocks(tokens)


def test_the_gateway_and_engine_configs_build_the_same_seeded_hasher():
    from kvc_gateway.config import GatewayConfig
    from kvcentric.config import ConfigError
    from kvcentric.engine.config import EngineConfig
    gateway, engine = GatewayConfig(hash_seed="7"), EngineConfig(hash_seed="7")
    assert gateway.hasher().hash_blocks(list(range(16))) == engine.hasher().hash_blocks(list(range(16)))
    assert gateway.hasher().seed == 7 and EngineConfig().hasher().seed is None
    with pytest.raises(ConfigError, match="--hash-seed"):
        EngineConfig(hash_seed="x")
