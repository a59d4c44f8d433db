"""A matmul weight kept in the block format its file stores (``--quantization auto``).

A GGUF Q4_1 weight takes 5 bits per value where a dequantized bf16 copy takes 16 and float32
32, and decode on a CPU is bounded by the bytes of weight it reads per token. The weight is
one or more *parts*, each a run of consecutive output rows in one format: a fused q/k/v
projection whose tensors were stored in different types keeps each as stored.

On an x86 CPU the C kernel (``kernels/gemm_quant.c``) multiplies; on other devices the part is
dequantized by torch (``kernels/gguf_blocks.py``) just before its matmul, so CUDA and CPUs
without a compiler compute the same values at the cost of a transient dequantized copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from xlserve.kernels import gguf_blocks, portable_library, quant_ops
from xlserve.kernels.gguf_blocks import BlockType

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """Output rows ``start .. start + rows`` of a weight: ``data`` is uint8 [rows, row bytes] of
    ``qtype`` blocks, or, with ``qtype`` None, a dense float tensor [rows, K]."""
    start: int
    qtype: BlockType | None
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def dense(self, k: int) -> torch.Tensor:
        return self.data.float() if self.qtype is None else gguf_blocks.dequantize(self.qtype, self.data, k)

    def dense_rows(self, local: torch.Tensor, k: int) -> torch.Tensor:
        """Rows ``local`` of this part dequantized by torch: [len(local), K]. Interleaved data
        (``X16``) holds 16 rows per group, so the groups holding them are taken whole."""
        if self.qtype is None or not self.qtype & gguf_blocks.X16:
            return Part(0, self.qtype, self.data[local]).dense(k)
        groups, inverse = torch.unique(local // 16, return_inverse=True)
        held = self.data.view(-1, 16, self.data.shape[1])[groups].reshape(-1, self.data.shape[1])
        return Part(0, self.qtype, held).dense(k).view(-1, 16, k)[inverse, local % 16]


class QuantizedWeight:
    """A [N, K] weight as parts covering its rows (filled by ``place`` while loading)."""

    def __init__(self, shape: tuple[int, int], parts: list[Part] | None = None,
                 device: torch.device | str | None = None):
        self.shape = torch.Size(shape)
        self.parts: list[Part] = sorted(parts or [], key=lambda p: p.start)
        self._device = torch.device(device or (self.parts[0].data.device if self.parts else "cpu"))
        self._kernel_calls: list[tuple[int, int, int, int, int]] = []  # see linear
        self.eight_bit_activations = False  # set_activation_bits

    @classmethod
    def from_blocks(cls, qtype: int, data: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
        qtype = BlockType(qtype)
        n, k = shape
        if tuple(data.shape) != (n, gguf_blocks.row_bytes(qtype, k)):
            raise ValueError(f"{qtype.name} data of shape {tuple(data.shape)} is not a [{n}, {k}] weight")
        return cls(shape, [Part(0, qtype, data)])

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The storage's (a weight that is not a plain tensor: no kernel reads it as one)."""
        return torch.uint8

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.parts)

    def take_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Rows reordered (``order[i]`` becomes row i); a weight of one part, rows as stored."""
        if len(self.parts) != 1 or self.parts[0].qtype & gguf_blocks.X16:
            raise ValueError("only a weight of one part, rows as stored, can be reordered")
        part = self.parts[0]
        return QuantizedWeight(self.shape, [Part(0, part.qtype, part.data[order].contiguous())])

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.shape, [Part(p.start, p.qtype, p.data.to(device)) for p in self.parts], device)

    def place(self, start: int, other: QuantizedWeight | torch.Tensor) -> None:
        """Put ``other`` (quantized, or a dense tensor) at output rows ``start ..``. Neighbouring
        parts of one format join, so a fused projection whose pieces share a format (in
        whatever order they arrive) is one kernel call."""
        pieces = other.parts if isinstance(other, QuantizedWeight) else [Part(0, None, other.detach())]
        self.parts += [Part(start + p.start, p.qtype, p.data.to(self.device)) for p in pieces]
        self.parts.sort(key=lambda p: p.start)
        joined = [self.parts[0]]
        for part in self.parts[1:]:
            last = joined[-1]
            if (last.start + last.rows == part.start and last.qtype == part.qtype
                    and last.data.dtype == part.data.dtype):
                joined[-1] = Part(last.start, last.qtype, torch.cat((last.data, part.data)))
            else:
                joined.append(part)
        self.parts, self._kernel_calls = joined, []

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        for p in self.parts:
            out[p.start:p.start + p.rows] = p.dense(self.shape[1])
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias) (+ residual)`` in float32, rounded to ``x``'s dtype."""
        n, k = self.shape
        rows = quant_ops.fp32_rows(x, k)
        out = torch.empty(rows.shape[0], n, dtype=torch.float32, device=x.device)
        lib = portable_library.kernels() if x.device.type == "cpu" else None
        if lib is not None:  # a decode step makes ~120 of these calls: their arguments are prepared once
            calls = self._kernel_calls or self._prepare_kernel_calls()
            for qtype, data, row_bytes, count, start in calls:
                lib.xl_linear_quant(qtype, rows.data_ptr(), data, row_bytes, out.data_ptr() + 4 * start,
                                    rows.shape[0], count, k, n, self.eight_bit_activations, torch.get_num_threads())
        for p in self.parts:
            if lib is None or p.qtype is None:
                torch.matmul(rows, p.dense(k).T, out=out[:, p.start:p.start + p.rows])
        return quant_ops.finish(out, x, bias, residual)

    def _prepare_kernel_calls(self) -> list[tuple[int, int, int, int, int]]:
        self._kernel_calls = [(int(p.qtype), p.data.data_ptr(), p.data.shape[1], p.rows, p.start)
                              for p in self.parts if p.qtype is not None]
        return self._kernel_calls

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantized to float32: [*ids.shape, K]."""
        k = self.shape[1]
        flat = ids.reshape(-1)
        lib = portable_library.kernels() if ids.device.type == "cpu" else None
        whole = self.parts[0]
        if lib is not None and len(self.parts) == 1 and whole.start == 0 and whole.qtype is not None and flat.numel():
            # every id in the one part: no masks, a decode step's token in 4 torch calls, not 12
            lowest, highest = torch.aminmax(flat)
            if 0 <= int(lowest) and int(highest) < whole.rows:
                return quant_ops.dequantize_rows(lib, whole.qtype, whole.data, flat, k).reshape(*ids.shape, k)
        out = torch.empty(flat.numel(), k, dtype=torch.float32, device=ids.device)
        for p in self.parts:
            inside = (flat >= p.start) & (flat < p.start + p.rows)
            local = flat[inside] - p.start
            if lib is not None and p.qtype is not None:
                out[inside] = quant_ops.dequantize_rows(lib, p.qtype, p.data, local, k)
            else:
                out[inside] = p.dense_rows(local, k)
        return out.reshape(*ids.shape, k)


class QuantizedExperts:
    """Every expert's [N, K] weight of one stacked tensor [E, N, K] in one block format (a GGUF
    file's ``ffn_*_exps``): ``data`` uint8 [E, N, row bytes]."""

    def __init__(self, qtype: int, data: torch.Tensor, shape: tuple[int, int, int]):
        self.qtype, self.shape = BlockType(qtype), torch.Size(shape)
        if tuple(data.shape) != (shape[0], shape[1], gguf_blocks.row_bytes(self.qtype, shape[2])):
            raise ValueError(f"{self.qtype.name} data of shape {tuple(data.shape)} is not a {list(shape)} weight")
        self.data = data

    def expert(self, index: int) -> QuantizedWeight:
        """Expert ``index``'s weight, sharing this tensor's storage."""
        return QuantizedWeight(self.shape[1:], [Part(0, self.qtype, self.data[index])])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        e, n, k = self.shape
        return gguf_blocks.dequantize(self.qtype, self.data.reshape(e * n, -1), k).reshape(e, n, k).to(dtype)


class HoldsQuantized:
    """A layer whose ``weight`` may be a ``QuantizedWeight``: on one rank (a tensor-parallel
    slice of a block format is refused, and dequantized instead), unless the layer reads its
    weight as a tensor (``quantizable = False``: MLA's ``kv_b_proj``, split per head)."""
    quantizable = True

    def keeps_quantized(self) -> bool:
        return self.quantizable and self.tp.size == 1

    def hold(self, weight: QuantizedWeight) -> None:
        """Replace the float parameter by ``weight``, on the parameter's device; the layer keeps
        the parameter's dtype as the one it computes in (``compute_dtype``)."""
        current = self.weight
        if isinstance(current, torch.Tensor):
            if tuple(weight.shape) != tuple(current.shape):
                raise ValueError(f"quantized weight of shape {tuple(weight.shape)} where {tuple(current.shape)} "
                                 "belongs")
            self.compute_dtype = current.dtype
            weight = weight.to(current.device)
            del self._parameters["weight"]  # its storage was never touched (or is copied out): freed
        self.weight = weight


def dense_float32(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """A weight as float32 rows, dequantized if kept in blocks (for code that reads the values
    outside the matmul paths: an EAGLE head taking the model's embedding and output rows)."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(torch.float32)
    return weight.detach().float()


def set_activation_bits(model: torch.nn.Module, eight_bit: bool, dtype: torch.dtype = torch.float32) -> None:
    """Every kept weight of the model in Q4_0, Q4_1 or Q8_0 multiplies 8-bit activations (as
    llama.cpp does: about twice the matmul speed on a CPU, results within bf16's error of the
    dequantized weights'), or fp32 ones (the dequantized weights' results). CPU kernel only:
    torch's path always computes in fp32. Called once, as the model loads.

    With 8-bit activations the layers' weights (not the experts', which are views of one
    stacked tensor) are interleaved 16 rows at a time for the kernel that multiplies 16 rows
    at once (8 without AVX512-VNNI; ``dot_q8_x16.c``), as llama.cpp repacks them. Without, a
    model that computes in bfloat16 interleaves its Q4_0, Q4_1 and Q8_0 weights the same way
    for the tile kernel (``gemm_amx_quant.c`` on a CPU with AMX; elsewhere on AVX-512 its twin
    in FMAs, ``gemm_tile_order.c``, with the same bits), whose activations are the model's
    bfloat16 values."""
    lib = portable_library.kernels()
    for weight in kept_weights(model):
        weight.eight_bit_activations = eight_bit
    if lib is None:
        return
    if eight_bit:
        interleave16(layer_weights(model))
    elif dtype == torch.bfloat16 and lib.xl_tile_order_ready():
        # K a multiple of 64: the tile kernel takes blocks in pairs
        parts = interleave16(layer_weights(model), k_multiple=64)
        where = "the AMX tiles" if lib.xl_amx_quant_ready() else "their twin in FMAs (the same bits)"
        log.info("%d Q4_0 / Q4_1 / Q8_0 weight parts on %s, bfloat16 activations", parts, where)


def interleave16(weights: list[QuantizedWeight], k_multiple: int = 32) -> int:
    """Their Q4_0, Q4_1 and Q8_0 parts (``gguf_blocks.INTERLEAVABLE``) of whole 16-row groups
    and a width of ``k_multiple``, on the CPU, in the interleaved layout of the 8-bit and the
    AMX kernels (``gguf_blocks.interleave16``): the same bytes. Data that
    several weights hold (a tied embedding and head) is interleaved once and stays shared;
    each part's old bytes are freed as soon as no weight holds them, so loading peaks at one
    part's bytes above the weights'. Returns how many parts it interleaved."""
    holders: dict[tuple[int, torch.Size], list[tuple[QuantizedWeight, int]]] = {}
    for weight in {id(w): w for w in weights}.values():
        for i, p in enumerate(weight.parts):
            if (p.qtype in gguf_blocks.INTERLEAVABLE and p.rows % 16 == 0 and weight.shape[1] % k_multiple == 0
                    and p.data.device.type == "cpu"):
                holders.setdefault((p.data.data_ptr(), p.data.shape), []).append((weight, i))
    for users in holders.values():
        first = users[0][0].parts[users[0][1]]
        packed = gguf_blocks.interleave16(first.qtype, first.data)
        for weight, i in users:
            part = weight.parts[i]
            weight.parts[i] = Part(part.start, gguf_blocks.INTERLEAVABLE[part.qtype], packed)
            weight._kernel_calls = []
    return sum(len(users) for users in holders.values())


def layer_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The weights of the model's layers kept in a block format (``kept_weights`` without the
    experts')."""
    return [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)]


def kept_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """Every weight of the model kept in a block format: layers' and experts' (``kept_experts``)."""
    experts = [w for m in model.modules() for pair in (getattr(m, "kept_experts", None) or ()) for w in pair]
    return layer_weights(model) + experts


def describe(model: torch.nn.Module) -> str:
    """'N weights kept quantized (X MiB)', for the load log."""
    held = kept_weights(model)
    unique = {tuple(p.data.data_ptr() for p in w.parts): w for w in held}.values()  # a tied head shares its data
    return f"{len(held)} weights kept quantized ({sum(w.nbytes for w in unique) / 2**20:.1f} MiB)"
