"""The router reads workers' and peers' event streams line by line where the SSE format ends
a line, not where ``str.splitlines`` would: a model's text may hold U+2028, U+2029 or U+0085
raw inside an event's JSON."""

import asyncio
import json

import httpx

from xlserve.router.connections import sse_lines

TEXTS = ["a\u2028b", "c\u2029d", "e\x85f", "plain"]


def _lines(chunks: list[bytes]) -> list[str]:
    async def body():
        for chunk in chunks:
            yield chunk

    async def read():
        return [line async for line in sse_lines(httpx.Response(200, content=body()))]
    return asyncio.run(read())


def test_an_event_whose_text_holds_a_unicode_line_separator_stays_whole():
    stream = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\n\n" for t in TEXTS).encode()
    lines = _lines([stream[i:i + 7] for i in range(0, len(stream), 7)])  # chunks cut anywhere, mid-character too
    assert [json.loads(line[6:])["text"] for line in lines if line] == TEXTS
    assert lines.count("") == len(TEXTS)  # the blank line after each event


def test_crlf_cr_and_lf_end_lines_even_split_across_chunks_and_a_last_line_without_one():
    assert _lines([b"data: 1\r", b"\ndata: 2\rdata: 3\n", b"\r\ndata: 4"]) == \
        ["data: 1", "data: 2", "data: 3", "", "data: 4"]
