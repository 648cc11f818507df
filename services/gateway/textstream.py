"""Generated token ids to the text a client may see: incremental detokenization plus stop strings.

It holds back text that could be the start of a stop string until it is sure, cuts the output before
the first stop string found, and says so (`stopped`); it knows nothing of HTTP or NATS.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, decoder, stops: tuple[str, ...] = ()) -> None:
        self.decoder = decoder
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def feed(self, token_ids: list[int]) -> str:
        """The text that is safe to send after these tokens ("" once stopped)."""
        if self.stopped:
            return ""
        return self._release(self.held + self.decoder.feed(token_ids))

    def finish(self) -> str:
        """What is left when generation ends: held-back text (decoder flushed), cut at a stop string."""
        if self.stopped:
            return ""
        text = self._release(self.held + self.decoder.flush())
        if self.stopped:
            return text
        text, self.held = text + self.held, ""
        return text

    def _release(self, text: str) -> str:
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that a stop string starts with."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-n:]):
                    longest = n
                    break
        return longest
