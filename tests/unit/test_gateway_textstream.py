"""Stop strings in the detokenized stream: held back while ambiguous, cut at the first match."""

from __future__ import annotations

from kvc_gateway.textstream import TextStream
from kvcentric.model.tokenizer import ByteTokenizer


def run(text_pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    stream = TextStream(ByteTokenizer().stream_decoder(), stops)
    out = [stream.feed(list(piece.encode())) for piece in text_pieces]
    out.append(stream.finish())
    return out, stream.stopped


def test_without_stops_text_passes_through():
    out, stopped = run(["ab", "c"], ())
    assert out == ["ab", "c", ""] and not stopped


def test_a_stop_string_across_chunks_is_held_back_then_cut():
    out, stopped = run(["hello EN", "D world"], ("END",))
    assert "".join(out) == "hello " and stopped
    assert out[0] == "hello "  # "EN" held back until it is known


def test_held_text_that_turns_out_not_to_stop_is_released():
    out, stopped = run(["abE", "Nx", "y"], ("END",))
    assert out == ["ab", "ENx", "y", ""] and not stopped


def test_the_earliest_of_several_stops_wins_and_later_text_is_dropped():
    out, stopped = run(["one\ntwo.", " three"], (".", "\n"))
    assert "".join(out) == "one" and stopped


def test_a_partial_stop_at_the_end_of_generation_is_sent():
    out, stopped = run(["tail EN"], ("END",))
    assert "".join(out) == "tail EN" and not stopped


def test_multibyte_characters_split_across_tokens_still_match():
    stream = TextStream(ByteTokenizer().stream_decoder(), ("é",))
    data = "café".encode()
    assert stream.feed(list(data[:-1])) == "caf"
    assert stream.feed(list(data[-1:])) == "" and stream.stopped
