"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the paged cache.

Keys and values come from one compressed latent per token (``kv_lora_rank`` wide, 512 in
DeepSeek-V3) plus one rotary key shared by all heads (``qk_rope_head_dim``, 64): that is
all the cache keeps, one [1, kv_lora_rank + rope_dim] entry per token and layer — 576
values where full K/V of 128 heads would take 128 x (192 + 128) = 40,960.

- Prefill chunks expand the latent of their context into per-head keys and values
  (``kv_b_proj``) and attend as ordinary attention: the expansion is paid once per
  context token, and the chunk's many queries share it.
- Decode rows never expand the context. ``kv_b_proj`` is split per head into W_uk (latent
  -> key) and W_uv (latent -> value); q·k = (q W_uk)·latent, so each query is absorbed into
  latent space, attends to the cached entries as one shared KV head, and its latent output
  is mapped to values by W_uv afterwards: per decode token the work is O(context x latent),
  not O(context x heads x head_dim).
- Under ``--deterministic`` every row, prefill or decode, takes the absorbed form through
  the batch-invariant paged kernel, the latent as one KV head, and each head's absorption
  and value map through the invariant matmul: a token's bits do not depend on whether it was
  prefilled or decoded, nor on the batch. Prefill pays the latent width per key (~3x the
  expanded form's attention work).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlserve.kernels import attention_ops, invariant_linear
from xlserve.layers.attention import AttentionMetadata, PrefillChunk, additive_mask
from xlserve.layers.linear import Linear, Split
from xlserve.layers.norm import RMSNorm
from xlserve.layers.rotary import PositionEncoding, yarn_mscale
from xlserve.models.arch import ModelArch
from xlserve.parallel import tensor_parallel


def softmax_scale(arch: ModelArch) -> float:
    """1/sqrt(query head size), times YaRN's mscale(factor, mscale_all_dim)^2 where the
    checkpoint sets it (DeepSeek-V3: factor 40 gives 1.37^2)."""
    scale = (arch.qk_nope_head_dim + arch.head_dim) ** -0.5
    scaling = arch.rope_scaling_dict
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


class LatentAttention(nn.Module):
    def __init__(self, arch: ModelArch, positional: PositionEncoding):
        super().__init__()
        # tensor parallel: each rank its heads (their query, key/value expansion and output
        # columns); the two down-projections, their norms and the latent cache are whole on every rank
        self.num_heads = tensor_parallel.current().part(arch.num_heads, "attention heads")
        self.rank, self.rope_dim = arch.kv_lora_rank, arch.head_dim
        self.nope_dim, self.v_dim = arch.qk_nope_head_dim, arch.v_head_dim
        q_size = arch.num_heads * (self.nope_dim + self.rope_dim)
        self.low_rank_q = arch.q_lora_rank > 0
        # the two latent norms use the reference's default eps, not the config's rms_norm_eps
        if self.low_rank_q:
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, 1e-6)
            self.q_a_proj = Linear(arch.hidden_size, arch.q_lora_rank, bias=arch.attention_bias)
            self.q_b_proj = Linear(arch.q_lora_rank, q_size, bias=False, split=Split.COLUMN)
        else:
            self.q_proj = Linear(arch.hidden_size, q_size, bias=False, split=Split.COLUMN)
        self.kv_a_proj_with_mqa = Linear(arch.hidden_size, self.rank + self.rope_dim, bias=arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, arch.num_heads * (self.nope_dim + self.v_dim), bias=False,
                                split=Split.COLUMN)
        self.kv_b_proj.quantizable = False  # decode reads it split per head, as a tensor
        self.o_proj = Linear(arch.num_heads * self.v_dim, arch.hidden_size, bias=arch.attention_bias,
                             split=Split.ROW)
        self.positional = positional
        self.scale = softmax_scale(arch)
        self.kv_cache: tuple[torch.Tensor] | None = None  # ([slots, 1, rank + rope_dim],)
        self._w_uk_rows: torch.Tensor | None = None  # --deterministic: each head's W_uk as [rank, nope] rows

    def forward(self, tables, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = self._queries(x).view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope_dim), dim=-1)
        q_rope, k_rope = self.positional(tables, q_rope, k_rope.unsqueeze(1))
        entries = torch.cat((self.kv_a_layernorm(latent), k_rope.squeeze(1)), dim=-1)  # [n, rank + rope]
        cache = self.kv_cache[0]
        cache.index_copy_(0, meta.slot_mapping, entries.unsqueeze(1))
        lib = attention_ops.kernel_for(cache, cache)  # an absorbed query is an entry's width, one KV head
        if lib is not None and invariant_linear.applies(x, self.kv_b_proj.weight):  # --deterministic
            return self.o_proj(self._absorbed_rows(lib, q_nope, q_rope, cache, meta).view(n, -1))
        out = x.new_empty(n, self.num_heads, self.v_dim)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            out[rows] = self._decode(q_nope[rows], q_rope[rows], cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.end)
            context = entries[rows] if chunk.context_slots is None else cache[chunk.context_slots].squeeze(1)
            out[rows] = self._prefill(q_nope[rows], q_rope[rows], context, chunk)
        return self.o_proj(out.view(n, -1))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def _prefill(self, q_nope, q_rope, context: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """A chunk's n queries over its C context entries, the latents expanded to keys and values."""
        n, c = q_nope.shape[0], context.shape[0]
        kv = self.kv_b_proj(context[:, :self.rank]).view(c, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k = torch.cat((k_nope, context[:, None, self.rank:].expand(c, self.num_heads, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        mask = None
        if c > n:  # row i sees the prefix and the chunk up to itself
            mask = additive_mask(torch.ones(n, c, dtype=torch.bool, device=q.device).tril(c - n), q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out.transpose(0, 1)

    def _decode(self, q_nope, q_rope, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per row, absorbed into latent space; the context is read as stored."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope_dim], w[:, self.nope_dim:]
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        q = torch.cat((q_latent, q_rope), dim=-1).unsqueeze(2)  # [B, H, 1, rank + rope]
        context = cache[meta.decode_slots].transpose(1, 2)  # [B, 1, L, rank + rope]
        out = F.scaled_dot_product_attention(q, context, context[..., :self.rank], attn_mask=meta.decode_mask,
                                             scale=self.scale, enable_gqa=True)
        return torch.einsum("bhr,hvr->bhv", out.squeeze(2), w_uv)

    def _absorbed_rows(self, lib, q_nope, q_rope, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every row in the absorbed form on the invariant kernels: [n, heads, v_dim]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        if self._w_uk_rows is None:  # made once, from the loaded weight
            self._w_uk_rows = w[:, :self.nope_dim].transpose(1, 2).contiguous()
        heads = range(self.num_heads)
        q_latent = torch.stack([invariant_linear.linear(q_nope[:, h], self._w_uk_rows[h], None, None)
                                for h in heads], dim=1)
        q = torch.cat((q_latent, q_rope), dim=-1)  # [n, H, rank + rope]
        table, row_seq, row_len, _, _ = meta.context_tables(q.shape[0])
        # the latent is the values too: the rope part of each output is computed and dropped
        latent = attention_ops.paged_attention(lib, q, cache, cache, table, row_seq, row_len, self.scale)
        return torch.stack([invariant_linear.linear(latent[:, h, :self.rank], w[h, self.nope_dim:], None, None)
                            for h in heads], dim=1)
