"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a softmax router picks
the top-k experts of each token, each expert is a SwiGLU MLP, and a shared expert (Qwen2-MoE),
scaled by its own sigmoid gate, sees every token.

Tokens are grouped by expert (sorted once per step) and each active expert runs one
matmul over all of its tokens — never a Python loop over tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from xlserve.layers.linear import Linear, copy_checked
from xlserve.layers.mlp import MLP
from xlserve.models.arch import ModelArch

# checkpoint expert projection -> (our stacked weight, part): Mixtral's w1/w3/w2, Qwen's names
EXPERT_PARTS = {"w1": ("w_gate_up", "gate"), "w3": ("w_gate_up", "up"), "w2": ("w_down", "down"),
                "gate_proj": ("w_gate_up", "gate"), "up_proj": ("w_gate_up", "up"), "down_proj": ("w_down", "down")}


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.normalize = arch.norm_topk_prob
        size, hidden = arch.moe_intermediate_size, arch.hidden_size
        self.gate = Linear(hidden, arch.num_experts, bias=False)  # the router
        self.w_gate_up = nn.Parameter(torch.empty(arch.num_experts, 2 * size, hidden), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(arch.num_experts, hidden, size), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden, arch.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def load_expert(self, expert: int, part: str, loaded: torch.Tensor) -> None:
        """One expert's projection from the checkpoint into the stacked weights."""
        size = self.w_down.shape[2]
        target = {"gate": self.w_gate_up.data[expert, :size], "up": self.w_gate_up.data[expert, size:],
                  "down": self.w_down.data[expert]}[part]
        copy_checked(target, loaded, f"expert {expert} {part}")

    def expected_loads(self, prefix: str) -> set:
        """(parameter name, shard) pairs a complete checkpoint fills."""
        parts = {"w_gate_up": ("gate", "up"), "w_down": ("down",)}
        return {(f"{prefix}.{name}", (e, part)) for name, names in parts.items() for part in names
                for e in range(self.num_experts)}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]): softmax over all experts in float32,
        the top k, renormalized to sum to 1 where the model says so."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # token slots grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start:start + count]
            y = self.expert(expert, x[rows]) * weights.flatten()[order[start:start + count]].unsqueeze(1)
            out.index_add_(0, rows, y)
            start += count
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s SwiGLU MLP over all the rows routed to it."""
        size = self.w_down.shape[2]
        gate_up = x @ self.w_gate_up[index].T
        return (nn.functional.silu(gate_up[:, :size]) * gate_up[:, size:]) @ self.w_down[index].T
