"""One system under test per process: xlserve or transformers (llama.cpp: ``llama_cpp_peer``).

Each ``System`` answers the same questions on the same token ids: time to first token
of a prompt, decode speed, the cached-prefix case. ``engine_runner`` runs one of them in
a fresh process, so memory and cold-start figures are the system's own.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod


class System(ABC):
    name: str
    pid: int | None = None  # the process that holds the model, where it is not this one (a server)

    @abstractmethod
    def prefill(self, ids: list[int]) -> float:
        """Seconds to compute a prompt no earlier prompt shares, up to its first token."""

    @abstractmethod
    def decode(self, ids: list[int], new_tokens: int) -> float:
        """Decode tokens per second after the first token of ``ids``, greedy, one sequence."""

    def decode_batch(self, prompts: list[list[int]], new_tokens: int) -> float | None:
        """Aggregate decode tokens per second over concurrent sequences; None if unsupported."""
        return None

    @abstractmethod
    def cached_ttft(self, first: list[int], second: list[int]) -> float:
        """Run ``first``; then seconds to the first token of ``second``, which shares its prefix."""

    def weights_bytes(self) -> int:
        return 0

    def kv_bytes(self) -> int:
        return 0

    def close(self) -> None:  # noqa: B027 (most systems start nothing to stop)
        """Stop what the system started (a server process)."""

    def peak_gpu_bytes(self) -> int:
        """GPU memory the system's allocator reserved at its peak; 0 on the CPU."""
        torch = sys.modules.get("torch")  # not imported where the system does not use it
        return torch.cuda.max_memory_reserved() if torch is not None and torch.cuda.is_initialized() else 0


class XlserveSystem(System):
    name = "xlserve"

    def __init__(self, model: str, dtype: str, threads: int, kv_tokens: int, budget: int, device: str = "auto",
                 **engine_options):
        """``engine_options``: further ``EngineConfig`` fields (prepack_weights, cuda_graphs)."""
        import torch

        from xlserve.config import EngineConfig
        from xlserve.engine.llm_engine import LLMEngine
        torch.set_num_threads(threads)
        cfg = EngineConfig.from_kwargs(model=model, dtype=dtype, device=device, kv_cache_tokens=kv_tokens,
                                       max_num_batched_tokens=budget, max_num_seqs=64, **engine_options)
        self.engine = LLMEngine(cfg)
        for layer in self.engine.runner.kv_caches:  # fault the pool in: RSS then counts all of it
            for part in layer:
                part.zero_()
        self._ids = 0

    def _params(self, n: int):
        from xlserve import SamplingParams
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def _add(self, ids: list[int], n: int) -> str:
        self._ids += 1
        request_id = f"bench-{self._ids}"
        self.engine.add_request(request_id, ids, self._params(n))
        return request_id

    def _run(self, request_ids: set[str]) -> dict[str, list[float]]:
        """Step until the requests finish; per request, the time of each token."""
        times: dict[str, list[float]] = {r: [] for r in request_ids}
        while any(r in self.engine.scheduler.requests for r in request_ids):
            for out in self.engine.step():
                if out.request_id in times:
                    times[out.request_id].append(time.perf_counter())
        return times

    def prefill(self, ids):
        start = time.perf_counter()
        rid = self._add(ids, 1)
        return self._run({rid})[rid][0] - start

    def decode(self, ids, new_tokens):
        rid = self._add(ids, new_tokens)
        t = self._run({rid})[rid]
        return (len(t) - 1) / (t[-1] - t[0])

    def decode_batch(self, prompts, new_tokens):
        rids = {self._add(p, new_tokens) for p in prompts}
        times = self._run(rids)
        all_first = max(t[0] for t in times.values())
        end = max(t[-1] for t in times.values())
        tokens = sum(sum(1 for x in t if x > all_first) for t in times.values())
        return tokens / (end - all_first)

    def cached_ttft(self, first, second):
        self.prefill(first)
        return self.prefill(second)

    def weights_bytes(self):
        params = {id(p): p for p in self.engine.runner.model.parameters()}
        return sum(p.numel() * p.element_size() for p in params.values())

    def kv_bytes(self):
        return self.engine.runner.kv_bytes


class TransformersSystem(System):
    name = "transformers"

    def __init__(self, model_path: str, threads: int, device: str = "auto", dtype: str = "auto"):
        import os

        import torch
        from transformers import AutoModelForCausalLM

        from xlserve.loader.model_loader import resolve_dtype
        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)
        # xlserve's dtype, the faster one on this hardware ("auto": float32 on CPUs without bf16
        # math, where torch's bf16 matmuls are emulated), and its fastest attention (SDPA)
        self.dtype = resolve_dtype(dtype, self.device)
        where = {"gguf_file": os.path.basename(model_path)} if model_path.endswith(".gguf") else {}
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path) if where else model_path, dtype=self.dtype, attn_implementation="sdpa",
            **where).to(self.device).eval()
        # its KV cache grows with what it holds: the overhead figure subtracts the most it held,
        # as it subtracts xlserve's pool and llama.cpp's context
        cfg = self.model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * self.dtype.itemsize
        self.most_tokens_held = 0

    def _held(self, sequences: int, tokens: int) -> None:
        self.most_tokens_held = max(self.most_tokens_held, sequences * tokens)

    def _ids(self, ids_batch):
        return self.torch.tensor(ids_batch, device=self.device)

    def _now(self) -> float:
        """The time once the device has finished what was queued."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def prefill(self, ids):
        with self.torch.inference_mode():
            start = self._now()
            # logits of the last position only, as a server computes them (not the whole prompt's)
            self.model(self._ids([ids]), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
            self._held(1, len(ids))
            return self._now() - start

    def _greedy(self, ids_batch, new_tokens):
        torch = self.torch
        stamps = []
        with torch.inference_mode():
            out = self.model(self._ids(ids_batch), use_cache=True, logits_to_keep=1)
            for _ in range(new_tokens):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                stamps.append(self._now())
                out = self.model(nxt, past_key_values=out.past_key_values, use_cache=True)
        self._held(len(ids_batch), len(ids_batch[0]) + new_tokens)
        return stamps

    def decode(self, ids, new_tokens):
        stamps = self._greedy([ids], new_tokens)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def decode_batch(self, prompts, new_tokens):
        stamps = self._greedy(prompts, new_tokens)  # equal-length prompts: no padding needed
        return len(prompts) * (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def cached_ttft(self, first, second):
        torch = self.torch
        with torch.inference_mode():
            cache = self.model(self._ids([first]), use_cache=True, logits_to_keep=1).past_key_values
            self._held(1, max(len(first), len(second)))
            shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), len(first))
            start = self._now()
            cache.crop(shared - len(first))  # drop the unshared tail
            self.model(self._ids([second[shared:]]), past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1].argmax(-1)
            return self._now() - start

    def weights_bytes(self):
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_bytes(self):
        return self.kv_token_bytes * self.most_tokens_held
