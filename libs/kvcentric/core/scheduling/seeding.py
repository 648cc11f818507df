"""How the conductor's local block index comes to life: KV events are buffered while kvs-meta's dump is
paged in, then replayed in arrival order, then applied as they come. It keeps the state and the
bookkeeping; it asks kvs-meta for nothing, reads no clock and never waits.

The shell subscribes to the KV events before it asks for the first page, so no event falls between the
two: an event older than the dump is applied twice (which changes nothing), a newer one corrects the dump.
"""

from __future__ import annotations

from kvcentric.core.protocol import KVEventBatch
from kvcentric.core.scheduling.prefix import HolderIndex


class IndexSeeding:
    """The local index and where it is in its seeding: buffering events, or live."""

    def __init__(self, index: HolderIndex, patience_s: float = 0.0) -> None:
        self.index = index
        self.patience_s = patience_s
        """How long to keep asking for the dump before going live from the events alone."""
        self.pending: list[tuple[float, KVEventBatch]] | None = []
        """Event batches (with their arrival time) that came while seeding; None once live."""
        self.seeded = False
        """Whether the whole dump was applied before going live."""
        self.deadline = float("inf")
        self.cursor = 0
        """Where the next page of the dump starts (0: the first page)."""
        self.dump_blocks = 0
        """Blocks in the pages of the dump applied so far, on this try."""

    @property
    def live(self) -> bool:
        return self.pending is None

    def begin(self, now: float) -> None:
        """Start seeding now; `out_of_patience` turns true `patience_s` later."""
        self.deadline = now + self.patience_s

    def out_of_patience(self, now: float) -> bool:
        return now >= self.deadline

    def on_events(self, batch: KVEventBatch, now: float) -> None:
        """Buffer a batch while seeding; apply it once live."""
        if self.pending is not None:
            self.pending.append((now, batch))
        else:
            self.index.apply(batch.events, now)

    def restart_dump(self) -> None:
        """Ask for the dump from its first page again (after a page did not come)."""
        self.cursor, self.dump_blocks = 0, 0

    def apply_page(self, page_events: list, next_cursor: int, now: float) -> bool:
        """Apply one page of the dump; True when it was the last page."""
        self.index.apply(page_events, now)
        self.dump_blocks += sum(len(event.block_hashes) for event in page_events)
        self.cursor = next_cursor
        return not next_cursor

    def go_live(self, seeded: bool) -> int:
        """Replay the buffered batches, in arrival order, and apply events as they come from now on.
        Returns how many batches were replayed."""
        pending, self.pending = self.pending or [], None
        self.seeded = seeded
        for arrived, batch in pending:
            self.index.apply(batch.events, arrived)
        return len(pending)
