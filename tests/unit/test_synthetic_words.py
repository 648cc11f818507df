"""Presets that speak: a dummy model with a big vocabulary decodes every id to text (bytes as bytes, every id
above BOS/EOS as a synthetic word of its own), streamed or not; the Llama-3-8B preset has the served shape."""

from __future__ import annotations

from kvcentric.model.config import preset
from kvcentric.model.tokenizer import BYTE_VOCAB, ByteTokenizer, load_tokenizer, synthetic_word


def test_every_id_of_a_128k_vocabulary_decodes_to_a_distinct_visible_word():
    tokenizer = load_tokenizer("llama3-8b")
    words = [tokenizer.decode([token]) for token in range(BYTE_VOCAB, tokenizer.vocab_size)]
    assert all(word.startswith(" ") and len(word) > 1 and word.isprintable() for word in words)
    assert len(set(words)) == len(words) == 128256 - BYTE_VOCAB


def test_streamed_pieces_join_to_the_whole_decode_and_hold_back_a_split_character():
    tokenizer = load_tokenizer("llama2-7b")
    ids = [*"Hé".encode(), 300, *"€".encode(), 31999, 104]
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed([token]) for token in ids] + [decoder.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == "Hé" + synthetic_word(300) + "€" + synthetic_word(31999) + "h"
    assert pieces[1] == "" and pieces[2] == "é"  # the two bytes of é come out together


def test_byte_level_presets_and_special_ids_decode_as_before():
    assert load_tokenizer("tiny").vocab_size == BYTE_VOCAB
    assert ByteTokenizer().decode([256, *b"ok", 257, 300]) == "ok"  # BOS, EOS and ids beyond the vocabulary: nothing


def test_the_llama3_8b_preset_has_the_shape_people_serve():
    config = preset("llama3-8b")
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.intermediate_size,
            config.vocab_size, config.rope_theta) == (32, 4096, 32, 8, 14336, 128256, 500000.0)
