"""The HTTP floor of the gateway benchmark: an aiohttp server that answers every POST with one SSE event
and `data: [DONE]` at once, in one write, on uvloop like the gateway. What the same client measures against it is the
cost of HTTP, SSE and the client itself on this machine, without NATS, the conductor or any engine.

Usage: .venv/bin/python -m bench.serving.sse_floor PORT
"""

from __future__ import annotations

import sys

from aiohttp import web

EVENT = (b'data: {"id":"floor","object":"text_completion","choices":[{"index":0,"text":"A",'
         b'"finish_reason":"length"}]}\n\n')


class EventStream(web.StreamResponse):
    _send_headers_immediately = False  # headers go out with the body, as the gateway sends them


async def complete(request: web.Request) -> web.StreamResponse:
    """Headers, the event, [DONE] and the end of the chunked body in one write: the least any SSE server
    on aiohttp can do for a one-token answer."""
    await request.json()
    response = EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write_eof(EVENT + b"data: [DONE]\n\n")
    return response


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, loop=loop)


if __name__ == "__main__":
    main()
