"""The router reads workers' and peers' event streams line by line where the SSE format ends
a line, not where ``str.splitlines`` would: a model's text may hold U+2028, U+2029 or U+0085
raw inside an event's JSON."""

import asyncio
import json

import httpx
import pytest

from xlserve.router.connections import sse_lines
from xlserve.router.faults import WorkerFailed

TEXTS = ["a\u2028b", "c\u2029d", "e\x85f", "plain"]


def _lines(chunks, **bound) -> list[str]:
    async def body():
        for chunk in chunks:
            yield chunk

    async def read():
        response = httpx.Response(200, content=body(), request=httpx.Request("POST", "http://127.0.0.1:1/x"))
        return [line async for line in sse_lines(response, **bound)]
    return asyncio.run(read())


def test_an_event_whose_text_holds_a_unicode_line_separator_stays_whole():
    stream = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\n\n" for t in TEXTS).encode()
    lines = _lines([stream[i:i + 7] for i in range(0, len(stream), 7)])  # chunks cut anywhere, mid-character too
    assert [json.loads(line[6:])["text"] for line in lines if line] == TEXTS
    assert lines.count("") == len(TEXTS)  # the blank line after each event


def test_crlf_cr_and_lf_end_lines_even_split_across_chunks_and_a_last_line_without_one():
    assert _lines([b"data: 1\r", b"\ndata: 2\rdata: 3\n", b"\r\ndata: 4"]) == \
        ["data: 1", "data: 2", "data: 3", "", "data: 4"]


def test_a_peer_that_streams_without_ending_a_line_fails_once_the_line_passes_the_bound():
    sent = []

    def endless():
        while True:
            sent.append(b"x" * 1000)
            yield sent[-1]
    with pytest.raises(WorkerFailed, match="over 10000 bytes"):
        _lines(endless(), max_line_bytes=10_000)
    assert len(sent) == 11  # it stopped reading at the first chunk past the bound


def test_lines_up_to_the_bound_pass_and_one_past_it_fails_wherever_the_chunks_cut():
    line = b"data: " + b"y" * 94  # 100 bytes
    assert _lines([line + b"\r", b"\n" + line + b"\n"], max_line_bytes=100) == [line.decode()] * 2
    with pytest.raises(WorkerFailed):
        _lines([b"z" + line + b"\n"], max_line_bytes=100)  # whole in one chunk
    with pytest.raises(WorkerFailed):
        _lines([line[:50], line[50:] + b"z"], max_line_bytes=100)  # never ended
