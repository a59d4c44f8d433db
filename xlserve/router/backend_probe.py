"""What a foreign server says about itself: its model id, context, and how many tokens its
prefix cache holds (the router ages its predictions for that server to that size).

Each server says it its own way, so each probe asks one server's endpoint and returns None
where that endpoint is not there; the first answer wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

from xlserve.router.faults import WorkerFailed


@dataclass(frozen=True)
class BackendInfo:
    """What the router learns from a server when it comes up."""
    model: str  # the id the server wants in "model"
    max_model_len: int | None = None
    cache_tokens: int | None = None  # how many tokens its prefix cache holds, to age the router's index
    bootstrap_port: int | None = None  # SGLang prefill servers: where decode servers meet them


async def _get_json(http: httpx.AsyncClient, url: str, headers: dict):
    try:
        r = await http.get(url, headers=headers, timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def llama_server_cache(http, url, headers) -> int | None:
    """llama-server: every slot keeps its last prompt (``/props``: slots x context per slot)."""
    props = await _get_json(http, f"{url}/props", headers)
    try:
        return int(props["default_generation_settings"]["n_ctx"]) * int(props.get("total_slots", 1))
    except (TypeError, KeyError, ValueError):
        return None


_VLLM_CACHE = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)


async def vllm_cache(http, url, headers) -> int | None:
    """vLLM: ``vllm:cache_config_info`` on /metrics names its GPU blocks and block size."""
    try:
        r = await http.get(f"{url}/metrics", headers=headers, timeout=5)
    except httpx.HTTPError:
        return None
    match = _VLLM_CACHE.search(r.text) if r.status_code == 200 else None
    if match is None:
        return None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


async def sglang_cache(http, url, headers) -> int | None:
    """SGLang: ``max_total_num_tokens`` of /get_server_info is its KV pool."""
    info = await _get_json(http, f"{url}/get_server_info", headers)
    value = info.get("max_total_num_tokens") if isinstance(info, dict) else None
    return int(value) if isinstance(value, int) else None


CACHE_PROBES = (llama_server_cache, vllm_cache, sglang_cache)


def model_card(models: dict) -> tuple[str, int | None]:
    """The served model's id and context from a ``/v1/models`` answer (vLLM puts
    ``max_model_len`` on the card, llama-server ``meta.n_ctx_train``); ``KeyError``,
    ``IndexError`` or ``TypeError`` when it names no model."""
    card = models["data"][0]
    value = card.get("max_model_len") or (card.get("meta") or {}).get("n_ctx_train")
    return str(card["id"]), int(value) if isinstance(value, int) else None


async def probe_backend(http: httpx.AsyncClient, url: str, headers: dict) -> BackendInfo:
    try:
        model, context = model_card(await _get_json(http, f"{url}/v1/models", headers))
    except (TypeError, KeyError, IndexError) as e:
        raise WorkerFailed(f"{url}/v1/models names no model") from e
    cache = None
    for probe in CACHE_PROBES:
        cache = await probe(http, url, headers)
        if cache:
            break
    return BackendInfo(model, context, cache)
