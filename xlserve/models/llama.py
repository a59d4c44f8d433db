"""The Llama family decoder (Llama 2/3, SmolLM2, Mistral); Qwen2/Qwen3 reuse it with flags.

A plain ``nn.Module`` over a flat token batch: ``forward(input_ids, positions, meta)``.
The KV cache is bound once with ``bind_kv_cache``; nothing is global.
"""

from __future__ import annotations

import torch
from torch import nn

from xlserve.kernels import cpu_ops, decode_step, portable_library
from xlserve.layers.activation import silu
from xlserve.layers.attention import AttentionMetadata, DecodePath, Window, get_attention_backend
from xlserve.layers.embedding import Embedding, LMHead
from xlserve.layers.linear import Linear, MergedLinear, Split, copy_checked, linear
from xlserve.layers.mla import LatentAttention
from xlserve.layers.mlp import MLP
from xlserve.layers.moe import SparseMoE
from xlserve.layers.norm import RMSNorm, normalized, rms_norm
from xlserve.layers.quantized import QuantizedWeight
from xlserve.layers.rotary import PositionEncoding, QueryTemperature, RotaryEmbedding
from xlserve.models.arch import ModelArch
from xlserve.models.checkpoint_loading import STACKED_PARAMS, CheckpointLoading
from xlserve.parallel import pipeline_parallel, tensor_parallel
from xlserve.parallel.pipeline_parallel import Elsewhere


def layer_window(arch: ModelArch, index: int) -> Window | None:
    size = arch.layer_windows[index] if arch.layer_windows else 0
    return Window(size, arch.chunked_attention) if size else None


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, positional: PositionEncoding, qkv_bias: bool, qk_norm: bool, index: int = 0):
        super().__init__()
        self.tp = tensor_parallel.current()  # this rank's heads: the model's divided over the ranks
        self.num_heads = self.tp.part(arch.num_heads, "attention heads")
        self.num_kv_heads = self.tp.part(arch.num_kv_heads, "key/value heads")
        self.head_dim = arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(arch.hidden_size, {"q": arch.num_heads * self.head_dim,
                                                        "k": arch.num_kv_heads * self.head_dim,
                                                        "v": arch.num_kv_heads * self.head_dim}, qkv_bias)
        self.o_proj = Linear(arch.num_heads * self.head_dim, arch.hidden_size, bias=arch.attention_bias,
                             split=Split.ROW)
        self.q_norm = rms_norm(self.head_dim, arch.rms_norm_eps, arch.gemma_norms) if qk_norm else None
        self.k_norm = rms_norm(self.head_dim, arch.rms_norm_eps, arch.gemma_norms) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if arch.attention_sinks else None
        self.positional = positional
        # Llama 4's rotary layers: queries and keys L2-normed (no weight) after the rotation
        self.l2_norm = arch.qk_l2_norm and isinstance(positional, RotaryEmbedding)
        # the C kernel rotates in place the rotate-half way, before nothing else touches q and k
        self.rope_in_kernel = (isinstance(positional, RotaryEmbedding) and not positional.interleave
                               and not qk_norm and not self.l2_norm)
        self.window = layer_window(arch, index)
        self.scale = arch.attention_scale or None
        self.eps = arch.rms_norm_eps
        self.kv_group = 0  # its KV layer group (bind_kv_cache): which block table it reads
        self.backend = get_attention_backend()
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.split = (q_size, kv_size, kv_size)

    def forward(self, tables, x: torch.Tensor, meta: AttentionMetadata,
                project_out: bool = True) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        fused_rope = self.rope_in_kernel and meta.cpu_kernels
        if fused_rope:  # rotate in place, same rounding as eager; q and k below are views of the buffer
            cpu_ops.rope_(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *tables)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not fused_rope:
            q, k = self.positional(tables, q, k)
        if self.l2_norm:
            q, k = normalized(q, self.eps).to(q.dtype), normalized(k, self.eps).to(k.dtype)
        meta = meta.groups.get(self.kv_group, meta)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.window, self.scale, self.sinks).reshape(n, -1)
        return self.o_proj(out) if project_out else out

    def load_whole(self, param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
        """The sinks: one per head, this rank's heads."""
        copy_checked(param, loaded[self.tp.span(loaded.shape[0], what)], what)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, positional: PositionEncoding, qkv_bias: bool, qk_norm: bool,
                 index: int = 0):
        super().__init__()
        self.input_layernorm = rms_norm(arch.hidden_size, arch.rms_norm_eps, weight_float32=arch.norm_weight_float32)
        self.self_attn = LatentAttention(arch, positional) if arch.kv_lora_rank else \
            Attention(arch, positional, qkv_bias, qk_norm, index)
        self.post_attention_layernorm = rms_norm(arch.hidden_size, arch.rms_norm_eps,
                                                 weight_float32=arch.norm_weight_float32)
        self.mlp = SparseMoE(arch) if arch.sparse_layer(index) else \
            MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)

    def forward(self, tables, x, meta):
        if meta.decode_path is DecodePath.FUSED_LAYERS:
            return self._forward_fused(tables, x, meta)
        x = x + self.self_attn(tables, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def one_call_fits(self, rows: int) -> bool:
        """The decode-layer kernel takes ``rows`` rows of this layer: bf16 weights, and 1-4
        rows (the row kernel), up to ``cpu_ops.AMX_MAX_ROWS`` where every projection fits
        AMX, or up to ``cpu_ops.BF16_DOT_MAX_ROWS`` on the row kernel's batched blocks where
        the CPU has AVX512-BF16 without AMX (the features it implements:
        ``engine/decode_plan.py``)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP) or attn.o_proj.bias is not None:
            return False  # (the C layer adds the q/k/v bias only)
        weights = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        if any(not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 for w in weights) \
                or not cpu_ops.usable(attn.qkv_proj.weight):  # kept-quantized weights: their own kernel
            return False
        if rows <= cpu_ops.LINEAR_MAX_ROWS or (rows <= cpu_ops.BF16_DOT_MAX_ROWS and cpu_ops.batched_rows()):
            return True
        return rows <= cpu_ops.AMX_MAX_ROWS and cpu_ops.amx_ready() and cpu_ops.amx_shapes(*weights)

    def kernel_addresses(self) -> list[int]:
        """This layer's weight and KV-cache addresses in ``cpu_ops.decode_layers_``'s order."""
        attn, mlp = self.self_attn, self.mlp
        tensors = (self.input_layernorm.weight, self.post_attention_layernorm.weight, attn.qkv_proj.weight,
                   attn.qkv_proj.bias, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                   *attn.kv_cache)
        return [t.data_ptr() if t is not None else 0 for t in tensors]

    def step_entry(self) -> list[int] | None:
        """This layer's row of the portable decode step's table (``kernels/decode_step.py``), or
        None where that step would not compute what the eager path does."""
        attn, mlp, norms = self.self_attn, self.mlp, (self.input_layernorm, self.post_attention_layernorm)
        if not (isinstance(attn, Attention) and isinstance(mlp, MLP) and all(type(n) is RMSNorm for n in norms)
                and attn.rope_in_kernel and attn.window is None and attn.sinks is None and attn.kv_group == 0
                and mlp.act is silu and attn.head_dim <= decode_step.MAX_HEAD_DIM):
            return None
        dtype = norms[0].weight.dtype
        if any(c.dtype != dtype or not c.is_contiguous() for c in attn.kv_cache):
            return None
        tensors = [decode_step.tensor_address(t, dtype) for t in (*(n.weight for n in norms), attn.qkv_proj.bias,
                                                                  attn.o_proj.bias, *attn.kv_cache)]
        projections = [decode_step.projection_entry(m.weight, dtype)
                       for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if None in tensors or None in projections:
            return None
        return tensors + [value for entry in projections for value in entry]

    def _forward_fused(self, tables, x, meta):
        """The same layer on the fused decode kernels, a dozen calls instead of ~35 ops (more
        rows than the one-call path takes, or QK norms)."""
        attn, mlp = self.self_attn, self.mlp
        h = cpu_ops.rmsnorm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        x = linear(attn(tables, h, meta, project_out=False), attn.o_proj.weight, None, residual=x)
        h = cpu_ops.rmsnorm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        gate, up = linear(h, mlp.gate_up_proj.weight, None).chunk(2, dim=-1)
        # torch's vectorized SiLU beats the scalar kernel once there are several rows
        return linear(nn.functional.silu(gate) * up, mlp.down_proj.weight, None, residual=x)


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, qkv_bias: bool, qk_norm: bool, layer_class: type = None):
        super().__init__()
        # pipeline parallel: this stage's layers only (the others are ``Elsewhere``), the
        # embedding on the first stage, the final norm on the last
        self.stage = stage = pipeline_parallel.current()
        encodings = self._position_encodings(arch)
        self.rotary = encodings[0]
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size) \
            if stage.holds_embedding(arch.tie_word_embeddings) else None
        self.embed_scale = arch.hidden_size ** 0.5 if arch.gemma_norms else None
        self.layers = nn.ModuleList((layer_class or DecoderLayer)(arch, encodings[i], qkv_bias, qk_norm, i)
                                    if stage.holds(i) else Elsewhere() for i in range(arch.num_layers))
        self.held = [layer for layer in self.layers if not isinstance(layer, Elsewhere)]
        # each computes its tables once a step
        self.encodings = list({id(encodings[i]): encodings[i] for i in range(arch.num_layers)
                               if stage.holds(i)}.values())
        self.norm = rms_norm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norms, arch.norm_weight_float32) \
            if stage.last else None
        # [layers, 9] addresses for the one-call decode; bind_kv_cache resets them
        self.layer_addresses: torch.Tensor | None = None
        self._step_table: torch.Tensor | bool | None = None  # the portable step's; False: a layer it cannot take

    @staticmethod
    def _position_encodings(arch: ModelArch) -> list[PositionEncoding]:
        """Each layer's: the model's rotary; Gemma 3's windowed layers their own base, unscaled;
        Llama 4's global layers no rotary, a query temperature instead."""
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                 arch.rope_scaling_dict, arch.rope_interleave)
        local = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.local_rope_theta, {}) \
            if arch.local_rope_theta else rotary
        nope = QueryTemperature(arch.nope_floor_scale, arch.nope_attn_scale)
        return [nope if i in arch.nope_layers else local if layer_window(arch, i) else rotary
                for i in range(arch.num_layers)]

    def forward(self, input_ids, positions, meta, hidden=None):
        """The final hidden states; a stage before the last returns its layers' output
        unnormed, and a stage after the first starts from ``hidden`` (the previous stage's)."""
        x = hidden if hidden is not None else self.embed(input_ids)
        tables = {id(e): e.tables(positions, x.dtype) for e in self.encodings}
        if meta.decode_path is DecodePath.ONE_CALL:
            return self.norm(self._decode_in_one_call(tables[id(self.rotary)], x, meta))
        if meta.decode_path is DecodePath.PORTABLE_ONE_CALL:
            return self.norm(self._decode_portable(tables[id(self.rotary)], x, meta))
        for layer in self.held:
            x = layer(tables[id(layer.self_attn.positional)], x, meta)
        return self.norm(x) if self.norm is not None else x

    def embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: rounded to the activations' dtype first, as its reference
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def _decode_in_one_call(self, cos_sin, x, meta):
        """Every layer of a decode step in one C call: the per-layer kernel chained in C, so
        Python runs once per step instead of once per layer. ``x``, the embedding's fresh
        output, is updated in place (as ``_decode_portable`` does)."""
        if self.layer_addresses is None:
            self.layer_addresses = torch.tensor([layer.kernel_addresses() for layer in self.layers],
                                                dtype=torch.int64)
        first = self.layers[0]
        attn = first.self_attn
        x = x.contiguous()
        cpu_ops.decode_layers_(x, self.layer_addresses, first.input_layernorm.eps, attn.num_heads,
                               attn.num_kv_heads, attn.head_dim, first.mlp.down_proj.weight.shape[1], *cos_sin,
                               meta.slot_mapping, meta.decode_slots, meta.decode_lens)
        return x

    def step_table(self) -> torch.Tensor | None:
        """[layers, fields] int64 for the portable one-call decode step, built on first use
        (``bind_kv_cache`` resets it); None when a layer is one it cannot take."""
        if self._step_table is None:
            rows = [layer.step_entry() for layer in self.layers] if self.stage.count == 1 else [None]
            self._step_table = torch.tensor(rows, dtype=torch.int64) if None not in rows else False
        return self._step_table if self._step_table is not False else None

    def _decode_portable(self, cos_sin, x, meta):
        """Every layer of a decode step in one call of the portable kernels (``decode_step.c``):
        the eager path's bits, without ~120 kernel calls from Python per token. ``x``, the
        embedding's fresh output, is updated in place."""
        first = self.layers[0]
        attn = first.self_attn
        x = x.contiguous()
        decode_step.decode_step_(portable_library.kernels(), x, self.step_table(), first.input_layernorm.eps,
                                 attn.num_heads, attn.num_kv_heads, attn.head_dim, first.mlp.down_proj.weight.shape[1],
                                 *cos_sin, meta.slot_mapping, meta.decode_slots, meta.decode_lens,
                                 attn.scale or attn.head_dim ** -0.5)
        return x


# the language model inside a multimodal checkpoint (Gemma 3, Llama 4): its names, and the
# towers it skips when serving text
LANGUAGE_MODEL_RENAMES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                          "model.language_model.": "model."}
TOWERS = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.", "model.vision_model.",
          "model.multi_modal_projector.")


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    qkv_bias = False
    qk_norm = False
    layer_class = DecoderLayer
    stacked_params = STACKED_PARAMS  # checkpoint projections fused into one of our modules
    renames: dict[str, str] = {".block_sparse_moe.": ".mlp."}  # checkpoint name part -> ours

    @property
    def features(self) -> frozenset[str]:
        """The model features this instance uses (which decode paths may run it)."""
        return self.arch.features(self.qkv_bias, self.qk_norm)

    def one_call_fits(self, rows: int) -> bool:
        return self.model.stage.count == 1 and self.model.layers[0].one_call_fits(rows)

    def step_fits(self) -> bool:
        """The portable one-call decode step takes every layer (``DecoderModel.step_table``)."""
        return self.model.step_table() is not None

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, self.qkv_bias or arch.attention_bias, self.qk_norm, self.layer_class)
        self.lm_head = LMHead(arch.hidden_size, arch.vocab_size) if self.model.stage.last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings and self.lm_head is not None:
            shared = self.model.embed_tokens.weight
            if isinstance(shared, QuantizedWeight):
                self.lm_head.hold(shared)
            else:
                self.lm_head.weight = shared

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, ...]], groups: list[int] | None = None) -> None:
        """Each layer's cache tensors (``ModelArch.kv_cache_spec``: K and V, or MLA's latent)
        and KV layer group (``engine/kv_groups.py``; default: all in group 0)."""
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches, strict=True)):
            if isinstance(layer, Elsewhere):
                continue
            layer.self_attn.kv_cache = cache
            layer.self_attn.kv_group = groups[i] if groups else 0
        self.model.layer_addresses = None  # the addresses include the caches: rebuilt on next use
        self.model._step_table = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


