"""``xlserve plan``: a model (preset name, ``config.json`` or model directory) on a set of
devices, printed as a table or as JSON."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources

from xlserve.config import option
from xlserve.models.arch import ModelArch
from xlserve.planner.hardware import GIB, parse_gpus
from xlserve.planner.memory_plan import MemoryPlan, ServingShape, plan_memory
from xlserve.planner.weights import Layout, formats_from_config

PRESETS = sorted(p.name.removesuffix(".json") for p in resources.files("xlserve.planner.presets").iterdir()
                 if p.name.endswith(".json"))


@dataclass(frozen=True)
class PlanConfig:
    model: str = option("", f"A preset ({', '.join(PRESETS)}), a config.json, or a model directory.")
    gpus: str = option("", "Devices: COUNTxGPU (2xH200, 8xH100) or COUNTxSIZE (4x96GiB).")
    tp: int = option(0, "Tensor-parallel ranks; 0: every device (divided by --pp).")
    pp: int = option(1, "Pipeline stages.")
    data_parallel_attention: bool = option(False, "The --tp ranks split only the routed experts; each keeps "
                                           "attention, dense layers, shared experts, embedding and head whole and "
                                           "its own requests' KV (xlserve's --data-parallel-attention).")
    dtype: str = option("bfloat16", "Format of the weights the checkpoint does not quantize.",
                        choices=("bfloat16", "float16", "float32"))
    kv_dtype: str = option("bfloat16", "KV-cache element type.", choices=("bfloat16", "fp8"))
    max_num_batched_tokens: int = option(8192, "Token budget of one step (sizes the activation peak).")
    max_num_seqs: int = option(256, "Most sequences in one step (sizes the logits).")
    cuda_graph_max_batch: int = option(512, "Largest decode batch captured as a CUDA graph.")
    max_model_len: int = option(0, "Context one request must fit for the plan to fit; 0: the model's, "
                                 "at most 131072.")
    json: bool = option(False, "Print JSON instead of a table.")

    def __post_init__(self):
        if not self.model or not self.gpus:
            raise ValueError("xlserve plan needs --model and --gpus")


def load_config(model: str) -> tuple[str, dict]:
    """(name, HF config dict) of a preset, a config.json file or a model directory."""
    if model in PRESETS:
        text = resources.files("xlserve.planner.presets").joinpath(f"{model}.json").read_text()
        return model, json.loads(text)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                         "or a directory with one")
    with open(path) as f:
        return os.path.basename(os.path.dirname(os.path.abspath(path))), json.load(f)


def make_plan(config: PlanConfig) -> MemoryPlan:
    name, cfg = load_config(config.model)
    hardware = parse_gpus(config.gpus)
    if hardware.count % config.pp:
        raise ValueError(f"--pp {config.pp} does not divide {hardware.count} devices")
    layout = Layout(config.tp or hardware.count // config.pp, config.pp, config.data_parallel_attention)
    shape = ServingShape(config.max_num_batched_tokens, config.max_num_seqs, config.cuda_graph_max_batch,
                         activation_bytes=4 if config.dtype == "float32" else 2,
                         kv_bytes={"bfloat16": 2, "fp8": 1}[config.kv_dtype], max_model_len=config.max_model_len)
    arch = ModelArch.from_hf_config(cfg)
    return plan_memory(arch, name, hardware, layout, formats_from_config(cfg, config.dtype), shape)


def to_json(plan: MemoryPlan) -> dict:
    gib = lambda b: round(b / GIB, 2)  # noqa: E731
    return {
        "model": plan.model, "gpus": str(plan.hardware), "tp": plan.layout.tp, "pp": plan.layout.pp,
        "data_parallel_attention": plan.layout.dp_attention,
        "gib_per_gpu": gib(plan.hardware.bytes_per_device),
        "weights_gib_per_gpu": gib(plan.weights_per_device),
        "weights_gib_per_gpu_by_format": {k: gib(v) for k, v in plan.weights_by_format().items()},
        "weights_gib_per_gpu_by_component": {c.value: gib(v) for c, v in plan.weights.items() if v},
        "activation_peak_gib_per_gpu": gib(plan.activation_peak),
        "cuda_graph_pool_gib_per_gpu": gib(plan.cuda_graph_pool), "runtime_gib_per_gpu": gib(plan.runtime),
        "kv_free_gib": gib(plan.kv_free_total),
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_groups": [{"window": g.window, "layers": g.layers, "bytes_per_token_per_gpu": g.bytes_per_token}
                      for g in plan.kv_groups],
        "kv_tokens": plan.kv_tokens, "kv_tokens_all_ranks": plan.kv_tokens_all_ranks,
        "kv_tokens_in_windows": plan.kv_tokens_in_windows,
        "max_model_len": plan.max_model_len, "fits": plan.fits,
        "kv_free_gib_at_vllm_default_fraction": gib(plan.kv_free_at_fraction(0.9)), "notes": plan.notes,
    }


def to_table(plan: MemoryPlan) -> str:
    d = to_json(plan)
    groups = ", ".join(f"{g['layers']} layers {'window ' + str(g['window']) if g['window'] else 'full'}: "
                       f"{g['bytes_per_token_per_gpu']:,} B" for g in d["kv_groups"])
    lines = [f"{plan.model} on {d['gpus']}, tp={d['tp']} pp={d['pp']}"
             + (" (data-parallel attention)" if d["data_parallel_attention"] else ""),
             f"  weights per GPU        {d['weights_gib_per_gpu']:8.2f} GiB  "
             + ", ".join(f"{k} {v:.2f}" for k, v in d["weights_gib_per_gpu_by_format"].items()),
             *(f"    {c:<20} {v:8.2f} GiB" for c, v in d["weights_gib_per_gpu_by_component"].items()),
             f"  activation peak        {d['activation_peak_gib_per_gpu']:8.2f} GiB",
             f"  CUDA-graph pool        {d['cuda_graph_pool_gib_per_gpu']:8.2f} GiB",
             f"  runtime (non-torch)    {d['runtime_gib_per_gpu']:8.2f} GiB",
             f"  KV cache, all GPUs     {d['kv_free_gib']:8.2f} GiB",
             f"  KV per token per GPU   {groups}",
             f"  KV per token, all GPUs {d['kv_bytes_per_token']:,} B (layers that keep every token)",
             f"  KV capacity            {d['kv_tokens']:,} tokens of long context; "
             f"{d['kv_tokens_in_windows']:,} when every sequence fits in the windows"
             + (f"; {d['kv_tokens_all_ranks']:,} over all ranks" if d["data_parallel_attention"] else ""),
             f"  fits                   {'yes' if d['fits'] else 'no'} (one {d['max_model_len']:,}-token request)",
             f"  vLLM's 0.9 fraction    {d['kv_free_gib_at_vllm_default_fraction']:8.2f} GiB of KV cache "
             "(negative: does not load)"]
    lines += [f"  note: {n}" for n in d["notes"]]
    return "\n".join(lines)
