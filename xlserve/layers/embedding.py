"""Token embedding and LM head, each split by vocabulary over tensor-parallel ranks (one
rank: the whole vocabulary). Every rank holds ``ceil(vocab / ranks)`` rows, the last one
padded with zeros, so a tied head can share the embedding's slice."""

from __future__ import annotations

import torch
from torch import nn

from xlserve.layers.linear import copy_checked, linear_float32
from xlserve.layers.quantized import HoldsQuantized, QuantizedWeight
from xlserve.parallel import tensor_parallel


def _rows(vocab: int) -> int:
    return -(-vocab // tensor_parallel.current().size)


class VocabularySlice(HoldsQuantized):
    """A layer holding rows ``start ..`` of the vocabulary (``tp``, ``start``: set by the layer)."""

    def load_whole(self, param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
        """This rank's rows of the checkpoint's whole vocabulary (zeros past its end)."""
        if isinstance(loaded, QuantizedWeight):
            return self.hold(loaded)
        if self.tp.size == 1:
            return copy_checked(param, loaded, what)
        piece = loaded[self.start:self.start + param.shape[0]]
        param.data[piece.shape[0]:].zero_()
        if piece.shape[1:] != param.shape[1:]:
            raise ValueError(f"weight {what}: expected rows of {tuple(param.shape[1:])}, checkpoint has "
                             f"{tuple(loaded.shape[1:])}")
        copy_checked(param.data[:piece.shape[0]], piece, what)


class Embedding(VocabularySlice, nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        self.tp = tensor_parallel.current()
        rows = _rows(vocab_size)
        self.start = self.tp.rank * rows
        super().__init__(rows, hidden_size)

    def reset_parameters(self) -> None:
        # No random init: every weight is loaded (load_weights checks), and init on the meta
        # device pulls in torch's compiler stack, a second of every cold start.
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.embedding(ids).to(self.compute_dtype)
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start  # ids of other ranks' rows look up row 0 and are zeroed
        outside = (local < 0) | (local >= self.num_embeddings)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(VocabularySlice, nn.Module):
    """Logits of every token: each rank its vocabulary rows, gathered in rank order."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.tp = tensor_parallel.current()
        self.vocab_size = vocab_size
        rows = _rows(vocab_size)
        self.start = self.tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, whatever the model's dtype (``linear_float32``)."""
        return self.tp.all_gather(linear_float32(hidden, self.weight))[..., :self.vocab_size]
