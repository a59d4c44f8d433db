"""Where a device's memory goes when it serves a model, and how many tokens of KV cache the
rest holds. ``xlserve plan`` prints it; the engine sizes its pool with ``kv_blocks_for``.

Per device: capacity = runtime (CUDA context, cuBLAS and NCCL buffers, outside torch)
+ weights (by component and format) + activation peak of the largest step (token budget
``max_num_batched_tokens``) + the CUDA-graph pool (decode steps of up to
``cuda_graph_max_batch`` rows) + KV cache. Every term is computed from the model's sizes
except the runtime reserve, a constant stated below. Nothing is a fraction of capacity:
vLLM's default of handing the KV cache whatever remains under 90% of the device leaves
10% unused by design (see docs/capacity.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xlserve.engine.kv_groups import plan_groups
from xlserve.models.arch import ModelArch
from xlserve.planner.hardware import GIB, Hardware
from xlserve.planner.weights import Component, Layout, WeightFormat, bytes_per_device

# Memory the process holds outside torch's allocator on each device: the CUDA context and
# cuBLAS workspaces (about 0.5 GiB on H100-class devices), plus NCCL's buffers when ranks talk.
RUNTIME_GIB, NCCL_GIB = 0.5, 0.5


@dataclass(frozen=True)
class ServingShape:
    """The engine settings memory depends on."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cuda_graph_max_batch: int = 512
    activation_bytes: int = 2  # bf16 activations
    kv_bytes: int = 2  # bf16 KV cache (1: fp8)
    max_model_len: int = 0  # 0: the model's context, at most 131,072


@dataclass(frozen=True)
class KVGroup:
    window: int  # 0: the whole context
    layers: int
    bytes_per_token: int  # on one device


@dataclass
class MemoryPlan:
    model: str
    hardware: Hardware
    layout: Layout
    formats: dict[Component, WeightFormat]
    weights: dict[Component, float]  # bytes on the busiest device
    activation_peak: float
    cuda_graph_pool: float
    runtime: float
    kv_groups: list[KVGroup]
    max_model_len: int
    notes: list[str] = field(default_factory=list)

    @property
    def weights_per_device(self) -> float:
        return sum(self.weights.values())

    @property
    def kv_free_per_device(self) -> float:
        return (self.hardware.bytes_per_device - self.runtime - self.weights_per_device - self.activation_peak
                - self.cuda_graph_pool)

    @property
    def kv_free_total(self) -> float:
        return max(self.kv_free_per_device, 0.0) * self.layout.devices

    def kv_free_at_fraction(self, fraction: float = 0.9) -> float:
        """KV memory (all devices) as vLLM sizes it: ``fraction`` (its default
        gpu_memory_utilization 0.9) of each device, less weights, the profiled activation peak
        and non-torch memory; CUDA graphs are captured afterwards in the remaining tenth.
        Negative: the model does not load under that fraction."""
        per_device = (self.hardware.bytes_per_device * fraction - self.runtime - self.weights_per_device
                      - self.activation_peak)
        return per_device * self.layout.devices

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token of context beyond every window, all devices together (under
        data-parallel attention a token's KV is on one rank)."""
        return sum(g.bytes_per_token for g in self.kv_groups if g.window == 0) * self.layout.attention_tp

    @property
    def kv_tokens(self) -> int:
        """Tokens of context the pool holds for long sequences (beyond every window)."""
        return kv_tokens_for(self.kv_free_per_device, self.kv_groups)

    @property
    def kv_tokens_all_ranks(self) -> int:
        """Distinct tokens the worker holds: ``kv_tokens``, times the ranks under data-parallel
        attention (each its own requests')."""
        return self.kv_tokens * (self.layout.tp // self.layout.attention_tp)

    @property
    def kv_tokens_in_windows(self) -> int:
        """Tokens the pool holds when every sequence is shorter than every window."""
        per_token = sum(g.bytes_per_token for g in self.kv_groups)
        return max(int(self.kv_free_per_device // per_token), 0)

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.max_model_len

    def weights_by_format(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for component, size in self.weights.items():
            name = self.formats[component].name
            out[name] = out.get(name, 0.0) + size
        return out


def kv_tokens_for(free_bytes: float, groups: list[KVGroup]) -> int:
    """Tokens of one long context that ``free_bytes`` hold: windowed groups keep at most
    their window (one chunk: the same bound), the others every token."""
    full = sum(g.bytes_per_token for g in groups if g.window == 0)
    windowed = sum(g.bytes_per_token * g.window for g in groups if g.window)
    if full == 0:
        return max(int(free_bytes // sum(g.bytes_per_token for g in groups)), 0)
    return max(int((free_bytes - windowed) // full), 0)


def pool_bytes_per_token(arch: ModelArch, itemsize: int) -> int:
    """Bytes per token slot of one engine's pool (one device): a block holds the layers of one
    KV layer group (all layers without windows; else as many as keep every token, windowed
    groups drawing blocks from the same pool). The engine sizes its pool by this."""
    spec = arch.kv_cache_spec
    return plan_groups(arch).width * spec.parts * spec.heads * spec.dim * itemsize


def kv_groups(arch: ModelArch, layout: Layout, kv_bytes: int) -> list[KVGroup]:
    """KV bytes per token and device of each layer group. Tensor parallelism splits key/value
    heads (a rank keeps at least one); MLA's latent is the same on every rank."""
    spec = arch.kv_cache_spec
    heads = spec.heads if arch.kv_lora_rank else max(spec.heads // layout.attention_tp, 1)
    per_layer = spec.parts * heads * spec.dim * kv_bytes
    return [KVGroup(window, -(-layers // layout.pp), -(-layers // layout.pp) * per_layer)
            for window, layers in arch.kv_groups()]


def activation_peak(arch: ModelArch, tp: int, tokens: int, rows: int, act: int) -> float:
    """Largest live activations of one step of ``tokens`` tokens sampling ``rows`` rows, on
    one device: the residual stream and its normed copy, plus the widest of attention, the
    MLP or MoE, and the logits (float32, gathered over the vocabulary)."""
    h = arch.hidden_size
    stream = 2 * tokens * h * act
    if arch.kv_lora_rank:  # prefill expands the chunk's latents into per-head keys and values
        heads = arch.num_heads / tp
        attention = tokens * (heads * (2 * (arch.qk_nope_head_dim + arch.head_dim) + 2 * arch.v_head_dim)
                              + arch.kv_lora_rank + arch.head_dim) * act
    else:
        attention = tokens * (2 * arch.num_heads + 2 * max(arch.num_kv_heads // tp, 1)) * arch.head_dim / tp * act
    mlp = tokens * 3 * arch.intermediate_size / tp * act
    if arch.num_experts:  # gathered rows, gate/up and product per (token, expert), router in float32
        k = arch.num_experts_per_tok
        moe = tokens * (k * (h + 3 * arch.moe_intermediate_size / tp) * act + arch.num_experts * 4
                        + 3 * arch.shared_expert_intermediate_size / tp * act + h * 4)
        mlp = max(mlp, moe)
    logits = rows * arch.vocab_size * (act / tp + 4)
    return stream + max(attention, mlp, logits)


def plan_memory(arch: ModelArch, name: str, hardware: Hardware, layout: Layout,
                formats: dict[Component, WeightFormat], shape: ServingShape = ServingShape()) -> MemoryPlan:
    if hardware.count != layout.devices:
        raise ValueError(f"the layout tp={layout.tp} x pp={layout.pp} needs {layout.devices} devices; "
                         f"--gpus gives {hardware.count}")
    notes = []
    if arch.num_kv_heads < layout.attention_tp and not arch.kv_lora_rank:
        notes.append(f"{arch.num_kv_heads} KV heads over {layout.tp} ranks: each rank keeps a copy of one head")
    if arch.kv_lora_rank and layout.attention_tp > 1:
        notes.append("MLA: every tensor-parallel rank keeps the whole latent cache")
    if layout.dp_attention:
        notes.append(f"data-parallel attention: each of {layout.tp} ranks holds its own requests' KV, so the "
                     f"worker holds {layout.tp} times the tokens of one rank's pool (one request fits in one rank)")
    rows = min(shape.max_num_seqs, shape.max_num_batched_tokens)
    graph_rows = min(shape.cuda_graph_max_batch, shape.max_num_seqs)
    return MemoryPlan(
        model=name, hardware=hardware, layout=layout, formats=formats,
        weights=bytes_per_device(arch, formats, layout),
        activation_peak=activation_peak(arch, layout.attention_tp, shape.max_num_batched_tokens, rows,
                                        shape.activation_bytes),
        cuda_graph_pool=activation_peak(arch, layout.attention_tp, graph_rows, graph_rows, shape.activation_bytes),
        runtime=(RUNTIME_GIB + (NCCL_GIB if layout.devices > 1 else 0.0)) * GIB,
        kv_groups=kv_groups(arch, layout, shape.kv_bytes),
        max_model_len=shape.max_model_len or min(arch.max_position_embeddings, 131072), notes=notes)
