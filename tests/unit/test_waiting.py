"""The tests' waiting helpers: they return what they waited for, and when it never comes they say what was
awaited and the last thing seen, at the deadline or at the end of a stream, never later."""

import asyncio
import io

import pytest

from waiting import NeverHappened, eventually, eventually_async, read_until, read_until_async


def counter():
    calls = iter(range(100))
    return lambda: next(calls)


def test_eventually_returns_the_first_value_that_satisfies_the_condition():
    assert eventually(counter(), "three calls", until=lambda n: n >= 3, every_s=0) == 3


def test_a_wait_that_runs_out_names_what_it_awaited_and_the_last_value():
    with pytest.raises(NeverHappened, match=r"never happened: the moon \(waited 0.05 s\); last seen: \[1, 2\]"):
        eventually(lambda: [1, 2], "the moon", until=lambda seen: seen == [3], timeout_s=0.05, every_s=0.01)


def test_ignored_exceptions_count_as_not_yet_and_show_as_the_last_value():
    def refuses():
        raise ConnectionRefusedError("not up")
    with pytest.raises(NeverHappened, match="last seen: ConnectionRefusedError"):
        eventually(refuses, "a server", timeout_s=0.05, every_s=0.01, ignoring=(ConnectionRefusedError,))
    with pytest.raises(ConnectionRefusedError):
        eventually(refuses, "a server", timeout_s=0.05)


def test_a_long_last_value_is_cut_short():
    with pytest.raises(NeverHappened) as caught:
        eventually(lambda: "x" * 10_000, "nothing", until=lambda _: False, timeout_s=0)
    assert len(str(caught.value)) < 2200 and "(10002 characters)" in str(caught.value)


async def test_eventually_async_awaits_a_probe_that_returns_an_awaitable():
    calls = counter()

    async def probe():
        await asyncio.sleep(0)
        return calls()
    assert await eventually_async(probe, "two calls", until=lambda n: n == 2, every_s=0) == 2
    assert await eventually_async(counter(), "a plain probe", until=lambda n: n == 1, every_s=0) == 1
    with pytest.raises(NeverHappened, match="last seen: 0"):
        await eventually_async(lambda: 0, "a truthy value", timeout_s=0.05)


def test_read_until_stops_at_the_end_of_the_stream():
    assert read_until(io.StringIO("a\nsent 3\nb\n"), "sent 3", "the fourth layer") == "sent 3\n"
    with pytest.raises(NeverHappened, match=r"the fourth layer \(the stream ended first\); last seen: 'sent 2\\n'"):
        read_until(io.StringIO("sent 1\nsent 2\n"), "sent 3", "the fourth layer")


async def test_read_until_async_stops_at_the_end_of_the_stream():
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.1 200 OK\r\n\r\n")
    reader.feed_eof()
    with pytest.raises(NeverHappened, match="the stream ended first"):
        await read_until_async(reader, b"data: ", "the first event")
