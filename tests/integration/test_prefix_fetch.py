"""A prefix pull over real gRPC (`transfer.fetch_blocks` against a messenger on a free loopback port) while the
holder's blocks are still on their way into its host pool: an instance announces a block from its device cache as
soon as it is computed, and its messenger serves it only once the write-behind copy is collected, so a pull sent in
between finds it missing and asks again; a holder that never gets the block fails the pull with a TransferError."""

from __future__ import annotations

import pytest

from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, TransferError, fetch_blocks, start_server

pytestmark = pytest.mark.integration

HASHES = ["hash-0", "hash-1", "hash-2"]


class NoSink:
    async def begin(self, header): ...
    def write(self, request_id, chunk): ...
    def commit(self, request_id, commit): ...
    def abort(self, request_id, reason, retryable=False): ...


class Arriving:
    """A host pool that holds only the first block for the first `missing_calls` pulls (the others' copies are in
    flight), then all of them; `held` blocks at most, ever."""

    def __init__(self, missing_calls: int, held: int = len(HASHES)) -> None:
        self.missing_calls, self.held, self.calls = missing_calls, held, 0

    def read_blocks(self, block_hashes, dtype, block_size):
        self.calls += 1
        held = 1 if self.calls <= self.missing_calls else self.held
        for index, block_hash in enumerate(block_hashes):
            data = bytes([index]) * 32 if index < held else None
            yield block_hash, data
            if data is None:
                return


async def pulled(source: Arriving, retries_s: tuple[float, ...]) -> list[bytes]:
    server, port = await start_server(KVTransferServicer(NoSink(), source), "127.0.0.1", 0)
    pusher = KVPusher()
    try:
        return await fetch_blocks(pusher, f"127.0.0.1:{port}", HASHES, "float32", 16, timeout_s=10,
                                  retries_s=retries_s)
    finally:
        await pusher.close()
        await server.stop(None)


async def test_a_pull_that_finds_blocks_still_being_written_asks_again_and_gets_them_all():
    source = Arriving(missing_calls=2)
    blocks = await pulled(source, (0.01, 0.01, 0.01))
    assert blocks == [bytes([index]) * 32 for index in range(3)]
    assert source.calls == 3  # two answers short, the third whole


async def test_a_holder_that_never_gets_the_blocks_fails_the_pull_once_its_retries_are_spent():
    source = Arriving(missing_calls=0, held=2)
    with pytest.raises(TransferError, match="holds 2 of the 3 prefix blocks"):
        await pulled(source, (0.01, 0.01))
    assert source.calls == 3
