"""Plays one side (prefill or decode) of a recorded disaggregated exchange of another engine
(vLLM, SGLang: the recordings beside this file say where each came from), as a real HTTP
server on 127.0.0.1. It checks each request against what the recording expects of it (a
mismatch is a 400 naming the field, so the router's test fails on it), keeps what it was
sent (GET /_received), and answers the recorded body or event stream.

    python tests/peers/replay_server.py --recording vllm_pd.json --role decode --port P [--fail 1]

``--fail N``: the first N generation requests get a 500 (a server that breaks after the prefill).
``--endless-line``: a stream whose first event never ends its line (a server gone wrong).
``--oversized chunked|announced|gzip``: a JSON answer of 65 MiB, sent in chunks, with its length
announced first, or gzip-compressed to ~65 KiB whatever the request accepts (a server gone wrong).
"""

import argparse
import asyncio
import gzip
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


def mismatch(expected: dict, got: dict, keys: list[str], forbidden: list[str]) -> str | None:
    for key, value in expected.items():
        if got.get(key) != value:
            return f"{key}: expected {value!r}, got {got.get(key)!r}"
    for key in keys:
        if key not in got:
            return f"{key} missing"
    for key in forbidden:
        if key in got:
            return f"{key} must not be sent to this side"
    return None


async def endless_line():
    yield "data: {\"text\": \""
    while True:
        yield "x" * 65536
        await asyncio.sleep(0)


OVERSIZED = 65 * 1024 * 1024


async def oversized_body():
    yield '{"text": "'
    for _ in range(OVERSIZED // 65536):
        yield "x" * 65536
    yield '"}'


def build(recording: dict, role: str, fail: int, endless: bool = False, oversized: str = "") -> FastAPI:
    app = FastAPI()
    side, received = recording[role], []
    failures = {"left": fail}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": recording["model"], "object": "model", "max_model_len": 4096}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(recording.get("cache_config_info", "") + "\n")

    @app.get("/get_server_info")
    async def server_info():
        if "server_info" not in recording:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return recording["server_info"]

    @app.get("/_received")
    async def sent():
        return received

    async def generate(request: Request):
        body = await request.json()
        received.append(body)
        if failures["left"] > 0:
            failures["left"] -= 1
            return JSONResponse({"error": {"message": "CUDA error: an illegal memory access was encountered",
                                           "type": "InternalServerError", "code": 500}}, status_code=500)
        if oversized == "chunked":
            return StreamingResponse(oversized_body(), media_type="application/json")
        if oversized == "gzip":
            bomb = gzip.compress(b'{"text": "' + b"x" * OVERSIZED + b'"}')
            return Response(bomb, media_type="application/json", headers={"content-encoding": "gzip"})
        if oversized == "announced":
            return StreamingResponse(oversized_body(), media_type="application/json",
                                     headers={"content-length": str(OVERSIZED + len('{"text": ""}'))})
        wrong = mismatch(side.get("expect", {}), body, side.get("expect_keys", []), side.get("forbid", []))
        if wrong:
            return JSONResponse({"error": {"message": wrong, "type": "BadRequestError", "code": 400}}, status_code=400)
        if not body.get("stream"):
            return side["json"]
        if endless:
            return StreamingResponse(endless_line(), media_type="text/event-stream")

        async def events():
            for event in side["events"]:
                yield f"data: {json.dumps(event)}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
    app.add_api_route("/v1/completions", generate, methods=["POST"])
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recording", required=True)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail", type=int, default=0)
    parser.add_argument("--endless-line", action="store_true")
    parser.add_argument("--oversized", choices=("chunked", "announced", "gzip"), default="")
    args = parser.parse_args()
    with open(args.recording) as f:
        recording = json.load(f)
    app = build(recording, args.role, args.fail, args.endless_line, args.oversized)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
