"""Load a model replica: resolve the source, build the architecture, stream in the weights."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from xlserve.config import ModelConfig
from xlserve.kernels import cpu_ops, invariant_linear, portable_library
from xlserve.kernels.cpu_isa import cpu_flags as _cpu_flags
from xlserve.layers.quantized import describe as describe_quantized
from xlserve.layers.quantized import set_activation_bits
from xlserve.loader.gguf_file import GGUFFile
from xlserve.loader.model_source import ModelSource, resolve_model
from xlserve.loader.safetensors_dir import SafetensorsDir
from xlserve.loader.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer, load_model_tokenizer
from xlserve.models.arch import ModelArch
from xlserve.models.registry import build_model, model_class
from xlserve.parallel import expert_exchange, pipeline_parallel, tensor_parallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    source: ModelSource
    arch: ModelArch
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    device: torch.device
    deterministic: bool = False  # --deterministic: invariant kernels only, no fused decode paths


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available; use cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 where the hardware has bf16 math (CUDA, CPUs with AVX512-BF16 / AMX);
        # elsewhere float32, which older CPUs run faster than emulated bf16.
        fast_bf16 = device.type == "cuda" or torch.backends.cpu.get_cpu_capability() == "AVX512" and \
            "avx512_bf16" in _cpu_flags()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return DTYPES[name]


def keeps_bf16(keep: bool, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 weights stay bf16 though the model computes in float32: on a CPU without
    bf16 math (``resolve_dtype``) whose C kernels widen them in registers, exactly, as they
    read them. Half the bytes of a float32 copy, read once per decoded token: the default
    model's BF16 GGUF at float32 on a 2-core Zen 4, 90.0 against 21.0 tok/s dequantized
    (``docs/quantization.md``)."""
    return keep and dtype == torch.float32 and device.type == "cpu" and portable_library.kernels() is not None


def load_model(config: ModelConfig) -> LoadedModel:
    source = resolve_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if source.kind == "gguf":
        reader = GGUFFile(source.path)
        hf_config = reader.hf_config()
        tokenizer = load_gguf_tokenizer(reader.meta)
    else:
        reader = SafetensorsDir(source.path)
        hf_config = reader.config
        tokenizer = load_hf_tokenizer(source.path, hf_config)
    arch = ModelArch.from_hf_config(hf_config)
    model_class(arch.architecture)  # refuse unsupported architectures before reading weights
    pipeline_parallel.place(arch)  # this rank's layers: the model builds and reads only those
    with torch.device("meta"):
        model = build_model(arch).to(dtype)  # free on meta; the storage is allocated once, in dtype
        for module in model.modules():
            if getattr(module, "keeps_float32", False):  # e.g. DeepSeek's router, float32 in its reference
                module.float()
    materialize(model, device)
    model.tie_weights()
    tp, stage = tensor_parallel.current(), pipeline_parallel.current()
    # tensor / pipeline / expert parallel: each rank reads only its slices of the (memory-mapped) safetensors
    sliced = (tp.size > 1 or stage.count > 1 or expert_exchange.current().active) and source.kind != "gguf"
    keep = config.quantization == "auto"
    weights = (reader.weights(dtype, lazy=True, keep_quantized=keep) if sliced
               else reader.weights(dtype, keep_quantized=keep, keep_bf16=keeps_bf16(keep, dtype, device)))
    bar = tqdm(weights, total=reader.num_tensors, desc=f"Loading {source.name}",
               unit="tensor", leave=False, disable=None)  # None: only on a terminal
    started = time.perf_counter()
    model.load_weights(bar)
    model.tie_weights()  # again: a head tied to an embedding kept quantized shares its blocks
    set_activation_bits(model, config.int8_activations, dtype)
    if config.deterministic:
        counts = invariant_linear.mark(model, dtype)
        log.info("deterministic: dense weights on the batch-invariant kernels: %s (amx: the tiles' order, %s)",
                 ", ".join(f"{count} on {kernel.value}" for kernel, count in counts.items()),
                 "on the tiles" if cpu_ops.amx_ready() else "in their twin's FMAs")
    if sliced:
        seconds = time.perf_counter() - started
        log.info("rank %d read %.1f MiB of the checkpoint's %.1f MiB in %.2f s (%.0f MiB/s)", stage.rank,
                 reader.read.bytes / 2**20, reader.file_bytes / 2**20, seconds, reader.read.bytes / 2**20 / seconds)
    model.eval()
    if config.prepack_weights and device.type == "cpu":
        from xlserve.layers.linear import prepack_linear_weights
        log.info("prepacked %d linear weights for batched CPU matmuls", prepack_linear_weights(model))
    return_freed_memory()
    log.info("loaded %s (%s, %s, %s) on %s; %s", source.name, arch.architecture, source.kind,
             str(dtype).removeprefix("torch."), device, describe_quantized(model))
    return LoadedModel(source, arch, model, tokenizer, dtype, device, config.deterministic)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on ``device`` (the loader
    fills it). ``Module.to_empty`` does the same but imports torch's symbolic-shape
    machinery (sympy: ~25 MiB and a fraction of a second of cold start)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                              requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def return_freed_memory() -> None:
    """Hand the heap pages that loading freed (dequantization scratch) back to the OS:
    glibc keeps them otherwise, and they would count in the process's RSS for its life."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def load_tokenizer(model: str) -> Tokenizer | None:
    """Only the tokenizer (and chat template) of a model, without its weights."""
    return load_model_tokenizer(model)
