"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 / Kimi K2): a
router picks the top-k experts of each token, each expert is a SwiGLU MLP, and a shared
expert (Qwen2-MoE: scaled by its own sigmoid gate; DeepSeek: added as is) sees every token.

Tokens are grouped by expert (sorted once per step) and each active expert runs one
matmul over all of its tokens — never a Python loop over tokens. Experts a checkpoint stores
in a block format (a GGUF file's ``ffn_*_exps``, Kimi K2.5's INT4) stay in it wherever a rank
holds them whole (``kept_experts``): a trillion-parameter MoE is mostly expert weights.
"""

from __future__ import annotations

import torch
from torch import nn

from xlserve.kernels import invariant_linear
from xlserve.layers.activation import sigmoid, silu
from xlserve.layers.linear import Linear, copy_checked
from xlserve.layers.mlp import MLP
from xlserve.layers.quantized import QuantizedExperts, QuantizedWeight
from xlserve.loader.lazy_tensor import whole
from xlserve.models.arch import ModelArch, Router
from xlserve.parallel import expert_exchange, tensor_parallel

# checkpoint expert projection -> (our stacked weight, part): Mixtral's w1/w3/w2, Qwen's names
EXPERT_PARTS = {"w1": ("w_gate_up", "gate"), "w3": ("w_gate_up", "up"), "w2": ("w_down", "down"),
                "gate_proj": ("w_gate_up", "gate"), "up_proj": ("w_gate_up", "up"), "down_proj": ("w_down", "down")}
# a kept expert's part -> (which of its (gate_up, down) weights, first row in expert widths)
KEPT_SLOTS = {"gate": (0, 0), "up": (0, 1), "down": (1, 0)}


class ExpertRouter(nn.Module):
    """Picks each token's ``top_k`` experts and their weights (the checkpoint's ``mlp.gate``).

    Softmax top-k (Mixtral, Qwen): softmax over all experts in float32, the k largest,
    renormalized where the model says so. Llama 4: the k largest logits, weights their sigmoid
    (``SparseMoE`` scales the expert's input by it, not its output). gpt-oss: the k largest
    logits (the router has a bias), softmax over those. Sigmoid grouped (DeepSeek-V3, ``noaux_tc``):
    sigmoid scores; the choice adds ``e_score_correction_bias``, keeps the ``topk_group``
    groups whose two best experts score highest, and takes the k best in them; the weights
    are the unbiased scores, renormalized, times ``routed_scaling_factor``. DeepSeek keeps
    this layer in float32 whatever the model's dtype (``keeps_float32``), as its reference does.
    """

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.kind, self.top_k, self.normalize = arch.router, arch.num_experts_per_tok, arch.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(arch.num_experts), requires_grad=False) if arch.router_bias else None
        self.keeps_float32 = arch.router is Router.SIGMOID_GROUPED
        if self.keeps_float32:
            self.e_score_correction_bias = nn.Parameter(torch.empty(arch.num_experts), requires_grad=False)
            self.n_group, self.topk_group, self.scale = arch.n_group, arch.topk_group, arch.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]); weights in x's dtype (DeepSeek's in float32), as
        the reference implementations round them."""
        return ROUTES[self.kind](self, x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits in x's dtype, on the CPU with one reduction order per row whether
        or not the model is --deterministic: a token's experts must not move with the batch
        (torch's float32 matmul gave 37 of 37 rows other bits alone than in a batch of 37), and
        the router is a small matmul. A MoE file whose other matmuls are kept quantized is then
        batch-invariant without the flag."""
        if invariant_linear.available(x, self.weight):
            return invariant_linear.linear(x, self.weight, self.bias, None)
        return nn.functional.linear(x, self.weight.to(x.dtype), self.bias)

    def _softmax_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self._logits(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _sigmoid_topk_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = self._logits(x).topk(self.top_k, dim=-1)
        return sigmoid(top.float()).to(x.dtype), experts

    def _topk_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = self._logits(x).topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts

    def _sigmoid_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sigmoid(self._logits(x.float()))
        biased = scores + self.e_score_correction_bias
        groups = biased.view(len(x), self.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
        biased = biased.masked_fill(~kept.bool().unsqueeze(-1).expand_as(groups).reshape_as(biased), float("-inf"))
        experts = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts


ROUTES = {Router.SOFTMAX_TOPK: ExpertRouter._softmax_topk, Router.SIGMOID_GROUPED: ExpertRouter._sigmoid_grouped,
          Router.SIGMOID_TOPK_INPUT: ExpertRouter._sigmoid_topk_input, Router.TOPK_SOFTMAX: ExpertRouter._topk_softmax}


class SparseMoE(nn.Module):
    """Routed experts (stacked SwiGLU weights) and an optional shared expert. Under tensor
    parallelism each rank holds every expert's slice of the intermediate columns, or with
    ``--expert-parallel`` whole experts (an equal share of them); either way each rank adds up
    its part of every token's output (the tokens are the same on every rank) and one
    all-reduce per layer combines them, the shared expert's part included. With
    ``--data-parallel-attention`` each rank has its own tokens: they go to the ranks that hold
    their experts and come back (``expert_exchange.py``); the shared expert is whole on every
    rank and nothing is reduced."""

    matmul_stacks = ("w_gate_up", "w_down")  # [experts, N, K]: --deterministic marks them (invariant_linear)

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.tp = tp = tensor_parallel.current()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.size = arch.moe_intermediate_size  # an expert's whole width
        hidden = arch.hidden_size
        self.exchange = exchange = expert_exchange.current()
        by_expert = (tp.expert_parallel and tp.size > 1) or exchange.active
        if exchange.active:
            self.experts = exchange.experts(arch.num_experts)
        else:
            self.experts = tp.span(arch.num_experts, "experts") if by_expert else slice(0, arch.num_experts)
        self.columns = tp.span(self.size, "expert columns") if tp.size > 1 and not by_expert else slice(0, self.size)
        local, width = self.experts.stop - self.experts.start, self.columns.stop - self.columns.start
        self.gate = ExpertRouter(arch)
        self.scale_input = arch.router is Router.SIGMOID_TOPK_INPUT
        self.limit, self.alpha = arch.swiglu_limit, arch.swiglu_alpha
        self.local_experts, self.width, self.hidden = local, width, hidden
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * width, hidden), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(local, hidden, width), requires_grad=False)
        # (gate_up, down) per local expert once a block-format piece arrives; see keeps_quantized
        self.kept_experts: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None
        self._dense_experts = False  # a dense expert weight has landed in w_gate_up / w_down
        self.b_gate_up = self.b_down = None
        if arch.expert_bias:  # gpt-oss
            self.b_gate_up = nn.Parameter(torch.empty(local, 2 * width), requires_grad=False)
            self.b_down = nn.Parameter(torch.empty(local, hidden), requires_grad=False)
        # the down bias once per expert: on its owner, or on rank 0 when every rank has a slice
        self.add_down_bias = by_expert or tp.rank == 0
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden, arch.shared_expert_intermediate_size, reduce=False)
            if arch.shared_expert_gated:
                self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def load(self, shard: tuple, loaded: torch.Tensor) -> set:
        """A checkpoint tensor into this rank's stacked weights (or biases); returns the
        (expert, part) shards it covers. ``shard``: (expert, part) for one expert's projection
        (Mixtral, Qwen, DeepSeek), or (None, part) for every expert's in one tensor:
        "gate_up_proj" and "down_proj" input-major ([E, hidden, 2 x size] gate first,
        [E, size, hidden]: Llama 4, gpt-oss), or GGUF's output-major "gate_exps", "up_exps",
        "down_exps"; a "_bias" part fills the biases the same way (gpt-oss)."""
        expert, part = shard
        if expert is not None and not self.experts.start <= expert < self.experts.stop:
            return {(expert, part)}  # another rank's expert: not even read from the file
        if isinstance(loaded, (QuantizedWeight, QuantizedExperts)):
            return self._keep(expert, part, loaded)
        loaded = whole(loaded)  # experts read whole: their slices are not contiguous rows or columns
        bias = part.endswith("_bias")
        if bias and self.b_gate_up is None:
            raise ValueError(f"experts {part}: this model's experts have no biases")
        if expert is not None:  # [size, hidden] / [hidden, size]
            pieces, experts = {part: loaded.unsqueeze(0)}, [expert]
        else:
            pieces, experts = _every_expert(part.removesuffix("_bias"), loaded, bias), range(self.num_experts)
        for name, tensor in pieces.items():
            self._copy(name, bias, experts, tensor)
        suffix = "_bias" if bias else ""
        return {(e, name + suffix) for e in experts for name in pieces}

    def _copy(self, part: str, bias: bool, experts, tensor: torch.Tensor) -> None:
        """``tensor``: ``experts``' part in the layout gate/up [n, size, hidden] (bias [n, size]),
        down [n, hidden, size] (bias [n, hidden]); this rank keeps its experts and columns."""
        first, local = experts[0], self.experts
        if not bias and self.kept_experts is not None:  # a dense piece beside kept ones: a dense part
            for i, e in enumerate(experts):
                if local.start <= e < local.stop:
                    self._place(e - local.start, part, tensor[i])
            return
        self._dense_experts |= not bias
        keep = [i for i, e in enumerate(experts) if local.start <= e < local.stop]
        if not keep:
            return
        tensor = tensor[keep[0]:keep[-1] + 1]
        rows = slice(experts[keep[0]] - local.start, experts[keep[-1]] - local.start + 1)
        if part != "down":
            tensor = tensor[:, self.columns]
        elif not bias:
            tensor = tensor[:, :, self.columns]
        width = self.columns.stop - self.columns.start
        gate_up, down = (self.b_gate_up, self.b_down) if bias else (self.w_gate_up, self.w_down)
        target = {"gate": gate_up.data[rows, :width], "up": gate_up.data[rows, width:], "down": down.data[rows]}[part]
        copy_checked(target, tensor, f"experts {first}.. {part}{' bias' if bias else ''}")

    def keeps_quantized(self) -> bool:
        """Experts stay in their block format where a rank holds them whole (one rank, or
        expert parallelism; a tensor-parallel slice of a block is refused), unless a dense
        expert weight already went into the stacked tensors."""
        return self.width == self.size and not self._dense_experts

    def _keep(self, expert: int | None, part: str, weight: QuantizedWeight | QuantizedExperts) -> set:
        """A block-format piece: one expert's (``expert``, gate / up / down) or every expert's
        (None, "gate_exps" / "up_exps" / "down_exps")."""
        if self.kept_experts is None:
            device = self.w_down.device
            self.kept_experts = [(QuantizedWeight((2 * self.width, self.hidden), device=device),
                                  QuantizedWeight((self.hidden, self.width), device=device))
                                 for _ in range(self.local_experts)]
            del self._parameters["w_gate_up"], self._parameters["w_down"]  # never touched: nothing resident
        if expert is not None:
            pieces = {(expert, part): weight}
        elif isinstance(weight, QuantizedExperts):
            pieces = {(e, part.removesuffix("_exps")): weight.expert(e) for e in range(self.num_experts)}
        else:
            raise ValueError(f"experts {part}: a block-format weight of {tuple(weight.shape)} for every expert")
        for (e, name), piece in pieces.items():
            if self.experts.start <= e < self.experts.stop:  # another rank's expert: not kept here
                self._place(e - self.experts.start, name, piece)
        return set(pieces)

    def _place(self, expert: int, part: str, weight: QuantizedWeight | torch.Tensor) -> None:
        """This rank's expert ``expert``'s gate / up / down (block format or dense) into its kept weights."""
        which, offset = KEPT_SLOTS[part]
        expected = (self.width, self.hidden) if which == 0 else (self.hidden, self.width)
        if tuple(weight.shape) != expected:
            raise ValueError(f"expert {expert} {part}: a weight of {tuple(weight.shape)} where {expected} belongs")
        self.kept_experts[expert][which].place(offset * self.width, weight)

    def expected_loads(self, prefix: str) -> set:
        """(parameter name, shard) pairs a complete checkpoint fills."""
        parts = {"w_gate_up": ("gate", "up"), "w_down": ("down",)}
        if self.b_gate_up is not None:
            parts.update(b_gate_up=("gate_bias", "up_bias"), b_down=("down_bias",))
        return {(f"{prefix}.{name}", (e, part)) for name, names in parts.items() for part in names
                for e in range(self.num_experts)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._exchanged(x) if self.exchange.active else self._routed(x)
        if self.shared_expert_gate is not None:
            out += sigmoid(self._shared_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out += self.shared_expert(x)
        return self.tp.all_reduce(out)

    def _shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's shared-expert gate, like the router one reduction order per row on the CPU
        (its weight is dense in a GGUF too)."""
        weight = self.shared_expert_gate.weight
        if invariant_linear.available(x, weight):
            return invariant_linear.linear(x, weight, None, None)
        return self.shared_expert_gate(x)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token slots grouped by expert (sorted once): their experts, token rows and weights."""
        if not len(x):  # a rank with no rows of its own still exchanges (the router cannot take none)
            return torch.empty(0, dtype=torch.long, device=x.device), torch.empty(
                0, dtype=torch.long, device=x.device), x.new_empty(0, 1)
        weights, experts = self.gate(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        return flat[order], order // self.top_k, weights.flatten()[order].unsqueeze(1)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' part of every token's output (each active expert one matmul)."""
        experts, tokens, weights = self._route(x)
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            local = expert - self.experts.start
            if count and 0 <= local < self.local_experts:  # another rank's expert: its part, not ours
                rows, weight = tokens[start:start + count], weights[start:start + count]
                y = self.expert(local, x[rows] * weight) if self.scale_input else self.expert(local, x[rows]) * weight
                out.index_add_(0, rows, y.to(x.dtype))
            start += count
        return out

    def _exchanged(self, x: torch.Tensor) -> torch.Tensor:
        """Every token's routed experts, wherever they live: the rows go to their experts' ranks
        (grouped by expert, so by rank), come back in the same order, and are weighed and
        added in expert order, as ``_routed`` adds them on one rank."""
        experts, tokens, weights = self._route(x)
        rows = x[tokens] * weights if self.scale_input else x[tokens]
        exchange = self.exchange
        sending = torch.bincount(experts // self.local_experts, minlength=exchange.size).tolist()
        receiving = exchange.counts(sending, x.device)
        got = exchange.move(rows, sending, receiving)
        got_experts = exchange.move(experts % self.local_experts, sending, receiving)
        y = exchange.move(self._run_local(got, got_experts), receiving, sending)
        if not self.scale_input:
            y = y * weights
        y, out, start = y.to(x.dtype), torch.zeros_like(x), 0
        # one add per expert, as _routed makes them: one index_add_ sums a row's repeats in float32
        # and rounds once, which in bfloat16 moved DeepSeek-V3's logprobs by 2e-3
        for count in torch.bincount(experts, minlength=self.num_experts).tolist():
            if count:
                out.index_add_(0, tokens[start:start + count], y[start:start + count])
                start += count
        return out

    def _run_local(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows that came for this rank's experts (``experts``: local indices), through them."""
        order = experts.argsort(stable=True)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(torch.bincount(experts, minlength=self.local_experts).tolist()):
            if count:
                picked = order[start:start + count]
                out[picked] = self.expert(expert, rows[picked]).to(rows.dtype)
                start += count
        return out

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's expert ``index``'s gated MLP (its columns) over all the rows routed to it:
        SwiGLU, or gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate) with biases."""
        size = self.width
        gate_up = self._project(0, index, x)
        if self.b_gate_up is not None:
            gate_up = gate_up + self.b_gate_up[index]
        gate, up = gate_up[:, :size], gate_up[:, size:]
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            hidden = (up + 1) * (gate * sigmoid(gate * self.alpha))
        else:
            hidden = silu(gate) * up
        out = self._project(1, index, hidden)
        return out if self.b_down is None or not self.add_down_bias else out + self.b_down[index]

    def _project(self, which: int, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s gate/up (``which`` 0) or down (1) projection of ``x``."""
        if self.kept_experts is not None:
            return self.kept_experts[index][which].linear(x)
        stacked = (self.w_gate_up, self.w_down)[which]
        if invariant_linear.applies(x, stacked):  # --deterministic: a row's bits whatever the expert's batch
            return invariant_linear.linear(x, stacked[index], None, None)
        return x @ stacked[index].T


def _every_expert(base: str, loaded: torch.Tensor, bias: bool) -> dict[str, torch.Tensor]:
    """Every expert's projections in one checkpoint tensor, as gate / up / down in ``_copy``'s layout."""
    if base == "gate_up_proj":  # input-major [E, hidden, 2 x size], gate first (bias [E, 2 x size])
        fused = loaded if bias else loaded.transpose(1, 2)
        gate, up = fused.chunk(2, dim=1)
        return {"gate": gate, "up": up}
    if base == "down_proj":  # input-major [E, size, hidden] (bias [E, hidden])
        return {"down": loaded if bias else loaded.transpose(1, 2)}
    return {base.removesuffix("_exps"): loaded}  # GGUF, output-major
