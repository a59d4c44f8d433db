"""An EAGLE-style draft head: one decoder layer that reads the target's own hidden state at
position j and the token at j + 1, and predicts the target's hidden state at j + 1 and, through
the target's output rows for a small draft vocabulary, the token at j + 2. Fed its own predicted
state and its own guess, it goes on guessing (``speculative/eagle.py``).

Why a head and not a draft model: the target's last hidden state already says most of what
comes next, so one layer (3.3 M weights for the default model, against 135 M) guesses about as
well as a small model would, at a fraction of its cost; and its draft vocabulary (the 8,192
tokens the target writes most often, EAGLE-3's reduction) keeps the output projection, the
costliest part of a guess, 6x smaller than the target's.

The file is safetensors: the head's weights, ``draft_to_target`` (the draft vocabulary's ids in
the target's), and the config as JSON metadata. The output rows are not stored: they are the
target's, taken at load (``bind_target``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from xlserve.layers.linear import linear, linear_float32
from xlserve.layers.norm import RMSNorm, normalized
from xlserve.layers.quantized import dense_float32
from xlserve.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class EagleHeadConfig:
    target: str  # the model it was trained on (its source name), checked loosely at load
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    max_positions: int
    rms_norm_eps: float
    target_vocab: int
    draft_vocab: int

    @classmethod
    def for_target(cls, arch, target: str, draft_vocab: int, intermediate_size: int = 1024) -> EagleHeadConfig:
        """A head shaped like one of the target's attention layers (its heads and rotary), with a
        narrower MLP."""
        return cls(target, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, intermediate_size,
                   arch.rope_theta, arch.max_position_embeddings, arch.rms_norm_eps, arch.vocab_size,
                   min(draft_vocab, arch.vocab_size))

    def check_target(self, arch) -> None:
        """A ValueError unless the head's inputs and outputs have the target's shapes."""
        theirs = (arch.hidden_size, arch.vocab_size)
        if (self.hidden_size, self.target_vocab) != theirs:
            raise ValueError(f"the EAGLE head was trained for hidden size {self.hidden_size} and a vocabulary of "
                             f"{self.target_vocab} ({self.target}); this model has {theirs[0]} and {theirs[1]}")


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        self.config = c = config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.embed_norm, self.feature_norm = HeadNorm(h, eps), HeadNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attn_norm, self.mlp_norm, self.out_norm = HeadNorm(h, eps), HeadNorm(h, eps), HeadNorm(h, eps)
        self.q_proj = nn.Linear(h, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        self.rotary = RotaryEmbedding(c.head_dim, c.max_positions, c.rope_theta, {})
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab), persistent=True)
        self.register_buffer("output_rows", torch.zeros(c.draft_vocab, h), persistent=False)

    # -- the layer in pieces: the proposer runs attention over its own caches ----------
    def inputs(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The layer's input at j from the target's state at j and the embedded token at j + 1."""
        return _linear(torch.cat((self.embed_norm(embeds), self.feature_norm(features)), dim=-1), self.fc)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated queries [T, Hq, D], keys and values [T, Hkv, D]."""
        c, h = self.config, self.attn_norm(x)
        q = _linear(h, self.q_proj).view(-1, c.num_heads, c.head_dim)
        k = _linear(h, self.k_proj).view(-1, c.num_kv_heads, c.head_dim)
        v = _linear(h, self.v_proj).view(-1, c.num_kv_heads, c.head_dim)
        q, k = self.rotary(self.rotary.tables(positions, x.dtype), q, k)
        return q, k, v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The predicted target state at j + 1 (normed, as the target's final norm leaves it)."""
        x = _linear(attended.reshape(x.shape[0], -1), self.o_proj, x)
        gate, up = _linear(self.mlp_norm(x), self.gate_up).chunk(2, dim=-1)
        return self.out_norm(_linear(F.silu(gate) * up, self.down, x))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary."""
        return linear_float32(state, self.output_rows)

    # -- training: every position at once, ``steps`` guesses deep -----------------------
    def unrolled(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                 sequence: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Predicted states of guess 1..``steps`` at every position of packed sequences, each
        guess attending as it will when proposing (EAGLE-3's training-time test): guess s at
        j reads guess 1's keys up to j - s + 1 (the target's true states) and guess r's key
        at j - s + r, and takes guess s - 1's state at j - 1 as its input."""
        outputs, keys, values = [], [], []
        state = features
        for s in range(1, steps + 1):
            x = self.inputs(state, embeds)
            q, k, v = self.qkv(x, positions)
            keys.append(k)
            values.append(v)
            mask = _guess_mask(positions, sequence, s)
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1), torch.cat(keys).transpose(0, 1), torch.cat(values).transpose(0, 1),
                attn_mask=mask, enable_gqa=True).transpose(0, 1)
            out = self.finish(x, attended)
            outputs.append(out)
            # the next guess's input at j is this one's prediction at j - 1 (zero at a sequence's start)
            state = torch.cat((out[:1] * 0, out[:-1]))
            state = state.masked_fill((positions == 0).unsqueeze(-1), 0)
        return outputs

    # -- the file ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        from safetensors.torch import save_file
        tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in self.state_dict().items()
                   if name != "draft_to_target"}
        tensors["draft_to_target"] = self.draft_to_target.to(torch.int64).contiguous()
        save_file(tensors, path, metadata={"eagle_head": json.dumps(dataclasses.asdict(self.config))})

    @classmethod
    def load(cls, path: str, dtype: torch.dtype, device: torch.device) -> EagleHead:
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            meta = (f.metadata() or {}).get("eagle_head")
            if meta is None:
                raise ValueError(f"{path} is not an EAGLE head (no 'eagle_head' metadata)")
            head = cls(EagleHeadConfig(**json.loads(meta)))
            state = {name: f.get_tensor(name) for name in f.keys()}
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: EAGLE head tensors missing {missing}, unexpected {unexpected}")
        head.draft_to_target = head.draft_to_target.long()
        return head.to(device=device, dtype=dtype).eval()

    def bind_target(self, model: nn.Module) -> None:
        """Take the target's output rows of the draft vocabulary (dequantized if stored in blocks)."""
        dense = dense_float32(model.lm_head.weight)
        rows = dense[self.draft_to_target.to(dense.device)]
        self.output_rows = rows.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)


class HeadNorm(RMSNorm):
    """The engine's RMSNorm (one kernel call a row), autograd's formula while training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.weight * normalized(x, self.eps).to(x.dtype)
        return super().forward(x)


def _linear(x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's matmul (a guess is a row or a few: bf16 weights take the bandwidth kernel,
    with the norms and attention, 1.4 -> 0.5 ms a guess on the default model's head), autograd's while training."""
    if torch.is_grad_enabled():
        out = layer(x)
        return out if residual is None else residual + out
    return linear(x, layer.weight, None, residual)


def _guess_mask(positions: torch.Tensor, sequence: torch.Tensor, s: int) -> torch.Tensor:
    """[T, s * T] which keys guess ``s``'s queries read (``EagleHead.unrolled``)."""
    same = sequence.unsqueeze(1) == sequence.unsqueeze(0)
    offset = positions.unsqueeze(0) - positions.unsqueeze(1)  # key position - query position
    blocks = [same & (offset <= -(s - 1))]
    blocks += [same & (offset == r - s) for r in range(2, s + 1)]
    return torch.cat(blocks, dim=1)
