"""The demo's and benchmarks' load generator reads SSE the way the protocol defines lines."""

from __future__ import annotations

import httpx

from llmd_timeslice.demo.loadgen import sse_lines


async def test_sse_lines_split_on_newline_only_not_on_unicode_line_separators():
    """vLLM leaves U+2028 / U+0085 raw inside JSON strings; httpx's aiter_lines splits there (seen once in the
    1,000-switch soak as a 'truncated' event)."""
    body = 'data: {"choices":[{"text":"a\u2028b\x85c"}]}\r\n\r\ndata: [DONE]\n\n'.encode()
    transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body))
    async with httpx.AsyncClient(transport=transport) as c, c.stream("GET", "http://x/") as r:
        lines = [line async for line in sse_lines(r)]
    assert lines == ['data: {"choices":[{"text":"a\u2028b\x85c"}]}', "", "data: [DONE]", ""]
