"""``xlserve bench parallel``: tensor and pipeline parallelism on this machine, one rank
beside several. A layout is ``TPxPP``: tensor-parallel ranks per stage x pipeline stages,
and for a MoE model (``--moe``: a DeepSeek-V3-shaped one) ``TPxPPep`` (experts split over
the tensor-parallel ranks, one all-reduce per layer) or ``TPxPPdp`` (data-parallel
attention: each rank its own requests, tokens sent to their experts by all-to-all).

- Load: seconds from ``LLM(...)`` to ready (the other ranks started, each reading only its
  slices of the memory-mapped safetensors), beside the time one process takes to read the
  checkpoint's files whole (warm page cache, as every load after the first sees them).
- Steps: a 512-token prefill (shorter where the context is), batch-1 and batch-8 decode —
  seconds per engine step, and the share rank 0 spent in collectives and transfers
  (all-reduce, all-gather, receiving from another stage; waiting for the slowest rank included).

Setups alternate within each repeat; medians and the spread (min-max) are reported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from statistics import median

# a Llama-shaped model of ~0.2B parameters with random weights (16 heads, 8 KV heads: splits
# over 2, 4 or 8 ranks), when no --model is given
SYNTHETIC = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)

# a DeepSeek-V3-shaped MoE of ~0.3B parameters (latent attention, 16 routed experts of which
# each token takes 4, one shared expert, the first layer dense), for --moe
SYNTHETIC_MOE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, moe_intermediate_size=512, n_routed_experts=16,
                     n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                     kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
MODES = {"": {}, "ep": {"expert_parallel": True},
         "dp": {"expert_parallel": True, "data_parallel_attention": True}}


@dataclass(frozen=True)
class ParallelBenchOptions:
    model: str = ""  # a Hugging Face directory; empty: the synthetic model, written under workdir
    moe: bool = False  # the synthetic model: the MoE one
    layouts: tuple[str, ...] = ("1x1", "2x1", "1x2")  # TPxPP
    repeats: int = 3
    dtype: str = "auto"
    workdir: str = ".bench-parallel"


def synthetic_model(workdir: str, moe: bool = False) -> str:
    path = os.path.join(workdir, "deepseek-0.3b-random" if moe else "llama-0.2b-random")
    if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
        import torch
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**SYNTHETIC_MOE)) if moe else \
            LlamaForCausalLM(LlamaConfig(**SYNTHETIC))
        model.to(torch.bfloat16).save_pretrained(path)
    return path


def raw_read_seconds(path: str) -> float:
    """One process reading every safetensors file whole, after a first read warms the page cache."""
    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    seconds = 0.0
    for warm in (True, False):
        started = time.perf_counter()
        for name in files:
            with open(name, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass
        seconds = 0.0 if warm else time.perf_counter() - started
    return seconds


def _steps(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, float]]:
    """(seconds, seconds in collectives) of each engine step until every prompt is answered."""
    from xlserve.parallel.tensor_parallel import COLLECTIVES
    from xlserve.sampling_params import SamplingParams
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", ids,
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        waited, started = COLLECTIVES.seconds, time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - started, COLLECTIVES.seconds - waited))
    return steps


def parse_layout(layout: str) -> tuple[int, int, dict]:
    """``"2x1"`` -> (tensor-parallel size, pipeline stages, options); ``"2x1dp"``: with
    data-parallel attention, ``"2x1ep"``: with expert parallelism."""
    text = layout.lower()
    mode = text[-2:] if text[-2:] in MODES else ""
    try:
        tp, pp = (int(x) for x in text.removesuffix(mode).split("x"))
    except ValueError:
        raise ValueError(f"a layout is TPxPP, e.g. 2x1 or 1x2, or 2x1ep or 2x1dp for a MoE; got {layout!r}") from None
    return tp, pp, MODES[mode]


def measure(path: str, layout: str, dtype: str) -> dict:
    import random

    from xlserve import LLM
    tp, pp, options = parse_layout(layout)
    rng = random.Random(layout)
    started = time.perf_counter()
    llm = LLM(path, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_tokens=8192,
              max_num_batched_tokens=1024, **options)
    load = time.perf_counter() - started
    try:
        vocab = llm.engine.loaded.arch.vocab_size
        # the distinct tokens the worker's pools hold per GiB of one rank's pool: split KV heads
        # and data-parallel attention raise it, a latent copied on every rank does not
        kv_tokens_per_gib = llm.engine.kv.num_blocks * llm.engine.block_size / (llm.engine.runner.kv_bytes / 2**30)

        def ids(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]
        _steps(llm.engine, [ids(16)], 4)  # warm-up
        prefill_tokens = min(512, llm.engine.max_model_len - 1)
        prefill = _steps(llm.engine, [ids(prefill_tokens)], 1)[0]
        b1 = _steps(llm.engine, [ids(64)], 33)[1:]
        b8 = _steps(llm.engine, [ids(64) for _ in range(8)], 33)[1:]
    finally:
        llm.close()

    def row(steps: list[tuple[float, float]]) -> dict:
        return {"step_s": median(s for s, _ in steps), "collective_share": sum(c for _, c in steps) / sum(
            s for s, _ in steps)}
    return {"layout": layout, "ranks": tp * pp, "load_s": load, "kv_tokens_per_gib": kv_tokens_per_gib,
            "prefill_tokens": prefill_tokens,
            "prefill": row([prefill]), "decode_b1": row(b1), "decode_b8": row(b8)}


def run_parallel_bench(opts: ParallelBenchOptions) -> dict:
    path = opts.model or synthetic_model(opts.workdir, opts.moe)
    for layout in opts.layouts:  # a typo fails before any run
        parse_layout(layout)
    runs: dict[str, list[dict]] = {layout: [] for layout in opts.layouts}
    for _ in range(opts.repeats):  # interleaved: a drifting machine hits every setup alike
        for layout in opts.layouts:
            runs[layout].append(measure(path, layout, opts.dtype))
    return {"model": path, "cpu_count": os.cpu_count(), "raw_read_s": raw_read_seconds(path),
            "file_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                              if f.endswith(".safetensors")),
            "repeats": opts.repeats, "runs": runs, "summary": {layout: summarize(r) for layout, r in runs.items()}}


def summarize(runs: list[dict]) -> dict:
    def spread(values: list[float]) -> dict:
        return {"median": median(values), "min": min(values), "max": max(values)}
    out = {"load_s": spread([r["load_s"] for r in runs]), "kv_tokens_per_gib": runs[0].get("kv_tokens_per_gib", 0)}
    for phase in ("prefill", "decode_b1", "decode_b8"):
        out[phase] = {"step_s": spread([r[phase]["step_s"] for r in runs]),
                      "collective_share": median(r[phase]["collective_share"] for r in runs)}
    return out


def parallel_table(results: dict) -> str:
    lines = [f"{'TPxPP':>7}  {'load s':>14}  {'prefill s':>20}  {'decode b1 ms/step':>22}  "
             f"{'decode b8 ms/step':>22}  {'KV tokens/GiB':>13}"]
    for size, s in results["summary"].items():
        cells = [f"{s['load_s']['median']:.2f} ({s['load_s']['min']:.2f}-{s['load_s']['max']:.2f})"]
        for phase, scale in (("prefill", 1), ("decode_b1", 1000), ("decode_b8", 1000)):
            p = s[phase]
            cells.append(f"{p['step_s']['median'] * scale:.3g} ({p['step_s']['min'] * scale:.3g}-"
                         f"{p['step_s']['max'] * scale:.3g}) {p['collective_share']:.0%}c")
        lines.append(f"{size:>7}  {cells[0]:>14}  {cells[1]:>20}  {cells[2]:>22}  {cells[3]:>22}  "
                     f"{s['kv_tokens_per_gib']:>13,.0f}")
    tokens = next(iter(results["runs"].values()))[0]["prefill_tokens"]
    lines.append(f"prefill: one {tokens}-token prompt; raw read of the files (one process, warm cache): "
                 f"{results['raw_read_s']:.2f} s for {results['file_bytes'] / 2**20:.0f} MiB; c: share of the step "
                 "rank 0 spent in collectives and transfers; KV tokens/GiB: the distinct tokens the worker's KV "
                 "pools hold per GiB of one rank's pool")
    return "\n".join(lines)
