"""Heartbeats on internal answers: sent while the engine is alive and the answer is not ready,
never after it or while the engine is not, and the outcome is the body's one JSON value."""

import asyncio
import json

from fastapi.responses import JSONResponse

from xlserve.openai.engine_client import EngineBusy
from xlserve.worker.heartbeat import SSE_HEARTBEAT, json_with_heartbeats, with_heartbeats

EVERY = 0.02


async def _slow_lines(delays):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield f"data: {i}\n\n"


async def _collect(lines):
    return [line async for line in lines]


def test_a_silent_stream_gets_heartbeats_between_its_lines_and_none_after():
    out = asyncio.run(_collect(with_heartbeats(_slow_lines([0.0, 0.15, 0.0]), lambda: True, EVERY)))
    assert out[0] == "data: 0\n\n" and out[-2:] == ["data: 1\n\n", "data: 2\n\n"]
    beats = out[1:-2]
    assert len(beats) >= 3 and set(beats) == {SSE_HEARTBEAT}


def test_no_heartbeat_while_the_engine_is_not_alive():
    out = asyncio.run(_collect(with_heartbeats(_slow_lines([0.15]), lambda: False, EVERY)))
    assert out == ["data: 0\n\n"]


def test_closing_the_stream_closes_its_source():
    closed = []

    async def source():
        try:
            yield "data: 0\n\n"
            await asyncio.sleep(10)
            yield "data: never\n\n"
        finally:
            closed.append(True)

    async def read_one():
        lines = with_heartbeats(source(), lambda: True, EVERY)
        first = await anext(lines)
        await anext(lines)  # a heartbeat while the source sleeps
        await lines.aclose()
        return first
    assert asyncio.run(read_one()) == "data: 0\n\n" and closed == [True]


async def _body_of(response) -> tuple[int, str]:
    if isinstance(response, JSONResponse):
        return response.status_code, response.body.decode()
    return response.status_code, "".join([chunk async for chunk in response.body_iterator])


def _answer(work, alive=lambda: True):
    async def run():
        response = await json_with_heartbeats(work, alive, lambda e: {"error": {"message": str(e), "code": 429}}, EVERY)
        return await _body_of(response)
    return asyncio.run(run())


async def _after(seconds, value=None, error=None):
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return value


def test_a_quick_json_answer_is_plain_json_and_its_error_raises():
    assert _answer(_after(0, {"a": 1})) == (200, '{"a":1}')
    try:
        _answer(_after(0, error=EngineBusy("full")))
    except EngineBusy as e:
        assert str(e) == "full"
    else:
        raise AssertionError("a quick error must raise (its status code stays the handler's)")


def test_a_slow_json_answer_sends_spaces_then_its_value_or_its_error():
    status, body = _answer(_after(0.15, {"a": 1}))
    assert status == 200 and body.startswith("  ") and json.loads(body) == {"a": 1}
    status, body = _answer(_after(0.15, error=EngineBusy("full")))
    assert status == 200 and json.loads(body) == {"error": {"message": "full", "code": 429}}
    status, body = _answer(_after(0.15, {"a": 1}), alive=lambda: False)
    assert body == '{"a": 1}'  # no heartbeat from an engine that is not alive


def test_a_client_that_leaves_cancels_the_work():
    cancelled = []

    async def work():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def leave():
        response = await json_with_heartbeats(work(), lambda: True, lambda e: {}, EVERY)
        body = response.body_iterator
        assert await anext(body) == " "
        await body.aclose()
    asyncio.run(leave())
    assert cancelled == [True]
