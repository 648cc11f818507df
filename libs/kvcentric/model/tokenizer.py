"""The byte-level tokenizer of the built-in dummy models: one token per UTF-8 byte, plus BOS and EOS.

It encodes text to ids and decodes ids back to text incrementally (a multi-byte character split
across two tokens comes out once complete); ids that are not bytes decode to nothing.
"""

from __future__ import annotations

import codecs


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder()


class StreamDecoder:
    """Turns a stream of byte-token ids into text pieces, holding back incomplete characters."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        return self._utf8.decode(bytes(t for t in token_ids if 0 <= t < 256))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
