"""Quantized safetensors checkpoints: kept in a block format the kernels read, or dequantized
to the model's dtype as they load.

The published weights of the largest families are quantized: DeepSeek-V3 and Kimi K2 in FP8
with a float32 scale per 128 x 128 block, gpt-oss's experts in MXFP4, Kimi K2.5's experts in
INT4 (compressed-tensors "pack-quantized", a bf16 scale per 32 inputs). The config's
``quantization_config.quant_method`` picks one ``CheckpointQuantization``; each quantized tensor
becomes the plain weight the model's loader expects, under the plain weight's name, unless the
format maps exactly onto a block format of ``kernels/gguf_blocks.py`` and the user keeps
weights as stored (``--quantization auto``): symmetric INT4 / INT8 groups are Q4_0 / Q8_0
blocks, a float16 scale per 32 values, so Kimi K2.5's experts stay at 4.5 bits a weight.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Callable

import torch

from xlserve.kernels.gguf_blocks import SYMMETRIC_BLOCKS, blocks_from_symmetric, blocks_from_zero_point
from xlserve.layers.quantized import QuantizedWeight

Fetch = Callable[[str], torch.Tensor]  # reads any tensor of the checkpoint by name
log = logging.getLogger(__name__)


class CheckpointQuantization(ABC):
    """Invariants: ``companion(name)`` is true exactly for the tensors that only serve another
    (scales, shapes) and are never model weights themselves; ``dequantize`` returns
    (plain weight name, floating tensor) for a quantized tensor and None for any other."""

    @abstractmethod
    def companion(self, name: str) -> bool: ...

    @abstractmethod
    def dequantize(self, name: str, tensor: torch.Tensor, fetch: Fetch) -> tuple[str, torch.Tensor] | None: ...

    def keep(self, name: str, tensor: torch.Tensor, fetch: Fetch) -> tuple[str, QuantizedWeight] | None:
        """(plain weight name, the same values in a kept block format), or None where the
        format has none that holds them exactly (the caller dequantizes)."""
        return None


class Fp8Blocks(CheckpointQuantization):
    """float8 weights times ``weight_scale_inv``: one float32 scale per ``weight_block_size``
    block (DeepSeek-V3, Kimi K2, Qwen3 FP8), or one per tensor without a block size."""

    def __init__(self, config: dict):
        block = config.get("weight_block_size")
        self.block = tuple(int(b) for b in block) if block else None

    def companion(self, name: str) -> bool:
        return name.endswith((".weight_scale_inv", ".input_scale"))

    def dequantize(self, name, tensor, fetch):
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return None
        scale = fetch(name + "_scale_inv").float()
        weight = tensor.float()
        if scale.numel() > 1:
            if weight.dim() != 2 or self.block is None:
                raise ValueError(f"{name}: FP8 block scales {tuple(scale.shape)} for a weight of shape "
                                 f"{tuple(weight.shape)} without a 2-D weight_block_size")
            rows, cols = weight.shape
            expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
            if tuple(scale.shape) != expected:
                raise ValueError(f"{name}: FP8 scales of shape {tuple(scale.shape)}, expected {expected} for "
                                 f"{tuple(weight.shape)} in blocks of {self.block}")
            scale = scale.repeat_interleave(self.block[0], 0)[:rows].repeat_interleave(self.block[1], 1)[:, :cols]
        return name, weight * scale


# the sixteen values of an FP4 (e2m1) code: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4(CheckpointQuantization):
    """gpt-oss's experts: ``X_blocks`` [experts, rows, groups, 16] bytes, two FP4 codes each
    (low nibble first), and ``X_scales`` [experts, rows, groups], a power-of-two exponent per 32
    values (e8m0, bias 127). The plain tensor is the checkpoint's [experts, inputs, outputs]."""

    def __init__(self, config: dict):
        pass

    def companion(self, name: str) -> bool:
        return name.endswith("_scales")

    def dequantize(self, name, tensor, fetch):
        if not name.endswith("_blocks"):
            return None
        base = name.removesuffix("_blocks")
        exponents = fetch(base + "_scales").to(torch.int32) - 127
        if tensor.dtype != torch.uint8 or tensor.shape[:-1] != exponents.shape:
            raise ValueError(f"{name}: MXFP4 blocks {tuple(tensor.shape)} {tensor.dtype} do not match their scales "
                             f"{tuple(exponents.shape)}")
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        out = torch.empty(*exponents.shape[:-1], exponents.shape[-1] * 32)
        for i in range(tensor.shape[0]):  # one expert at a time: the codes take 8 bytes per value
            codes = torch.stack((tensor[i] & 0x0F, tensor[i] >> 4), dim=-1).long()  # [rows, groups, 16, 2]
            out[i] = torch.ldexp(lut[codes].flatten(-3), exponents[i].repeat_interleave(32, dim=-1))
        return base, out.transpose(-1, -2)


class PackedInt4(CheckpointQuantization):
    """compressed-tensors "pack-quantized" integer weights (Kimi K2.5's experts): ``weight_packed``
    int32 holding 32 / bits values each from the lowest bits up, offset by 2^(bits-1);
    ``weight_scale`` one scale per ``group_size`` inputs; ``weight_shape`` the plain shape.
    Symmetric only (no zero point). The unpacking is written here rather than imported from
    the ``compressed-tensors`` package, which would add transformers to the runtime
    dependencies; the tests hold it to that package's packing."""

    def __init__(self, config: dict):
        if config.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format {config.get('format')!r} is not supported; supported: "
                             "pack-quantized")
        schemes = [group["weights"] for group in (config.get("config_groups") or {}).values() if group.get("weights")]
        for scheme in schemes:
            if scheme.get("type") != "int" or not scheme.get("symmetric", True) or scheme.get("strategy") != "group":
                raise ValueError(f"compressed-tensors weights {scheme} are not supported; supported: symmetric "
                                 "integer weights with one scale per group")
        self.bits = {int(s["num_bits"]) for s in schemes}
        if len(self.bits) != 1 or not self.bits <= {4, 8}:
            raise ValueError(f"compressed-tensors weights of {sorted(self.bits)} bits are not supported; supported: "
                             "one width, 4 or 8 bits")
        self.bits = self.bits.pop()

    def companion(self, name: str) -> bool:
        return name.endswith((".weight_scale", ".weight_shape"))

    def dequantize(self, name, tensor, fetch):
        unpacked = self._unpack(name, tensor, fetch)
        if unpacked is None:
            return None
        base, values, scale = unpacked
        return base, values.float() * scale.float().repeat_interleave(values.shape[1] // scale.shape[1], dim=1)

    def keep(self, name, tensor, fetch):
        unpacked = self._unpack(name, tensor, fetch)
        if unpacked is None:
            return None
        base, values, scale = unpacked
        blocks = blocks_from_symmetric(values, scale, self.bits)
        if blocks is None:
            return None
        return base, QuantizedWeight.from_blocks(SYMMETRIC_BLOCKS[self.bits], blocks, tuple(values.shape))

    def _unpack(self, name: str, tensor: torch.Tensor, fetch: Fetch
                ) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """(plain name, integer values [rows, cols], scales [rows, groups]) of a packed weight."""
        if not name.endswith(".weight_packed"):
            return None
        base = name.removesuffix("_packed")
        rows, cols = (int(v) for v in fetch(base + "_shape").tolist())
        scale = fetch(base + "_scale")
        per_word = 32 // self.bits
        shifts = torch.arange(per_word, dtype=torch.int32) * self.bits
        codes = (tensor.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)
        values = codes.flatten(-2)[..., :cols] - (1 << (self.bits - 1))
        if values.shape != (rows, cols) or cols % scale.shape[-1] or scale.shape[0] != rows:
            raise ValueError(f"{name}: packed weight {tuple(values.shape)} with scales {tuple(scale.shape)} does not "
                             f"make a ({rows}, {cols}) weight")
        return base, values, scale


class ZeroPointInt(CheckpointQuantization):
    """GPTQ and AWQ linear weights: ``qweight`` int32 words of unsigned ``bits``-bit codes,
    ``scales`` [groups, outputs] and ``qzeros`` (codes again, packed along the outputs), the
    weight ``scale * (code - zero)`` of each input's group. Subclasses read the word layouts.
    Kept as stored where ``gguf_blocks.blocks_from_zero_point`` holds the values exactly and
    every block of 32 inputs lies in one group; otherwise dequantized, with a log line."""

    bits_supported = (2, 4, 8)

    def __init__(self, config: dict):
        self.bits = int(config.get("bits", 4))
        if self.bits not in self.bits_supported:
            raise ValueError(f"{config.get('quant_method')} weights of {self.bits} bits are not supported; "
                             f"supported: {', '.join(map(str, self.bits_supported))}")
        self.group_size = int(config.get("group_size", 128))  # -1: one group per output
        self.per_word = 32 // self.bits
        self._said: set[str] = set()

    def companion(self, name: str) -> bool:
        return name.endswith((".qzeros", ".scales", ".g_idx"))

    def dequantize(self, name, tensor, fetch):
        unpacked = self._unpack(name, tensor, fetch)
        if unpacked is None:
            return None
        base, codes, scales, zeros, group = unpacked
        return base, scales.float()[:, group] * (codes - zeros[:, group]).float()

    def keep(self, name, tensor, fetch):
        unpacked = self._unpack(name, tensor, fetch)
        if unpacked is None:
            return None
        base, codes, scales, zeros, group = unpacked
        k = codes.shape[1]
        per_block = group[::32] if k % 32 == 0 else None
        if per_block is None or not torch.equal(per_block.repeat_interleave(32), group):
            return self._dequantized_because(name, "groups that do not cover whole blocks of 32 inputs "
                                                   "(act-order or a group size off 32)")
        kept = blocks_from_zero_point(codes, scales[:, per_block], zeros[:, per_block])
        if kept is None:
            return self._dequantized_because(name, "values no block type holds exactly (scales outside "
                                                   "float16, or 8-bit codes minus zero points past 8 bits)")
        qtype, blocks = kept
        return base, QuantizedWeight.from_blocks(qtype, blocks, tuple(codes.shape))

    def _dequantized_because(self, name: str, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            log.info("%s dequantized, as is every later weight like it: %s", name, why)
        return None

    def _codes(self, words: torch.Tensor, dim: int) -> torch.Tensor:
        """The codes of int32 ``words``, each word's lowest bits first, unpacked along ``dim``."""
        shifts = torch.arange(self.per_word, dtype=torch.int32) * self.bits
        codes = (words.to(torch.int32).unsqueeze(dim + 1) >> shifts.reshape([-1] + [1] * (words.dim() - 1 - dim)))
        return (codes & ((1 << self.bits) - 1)).flatten(dim, dim + 1)

    def _unpack(self, name: str, tensor: torch.Tensor, fetch: Fetch
                ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(plain name, codes [N, K], scales [N, groups], zero points [N, groups], each input's
        group [K]) of a packed weight; None for any other tensor."""
        if not name.endswith(".qweight"):
            return None
        base = name.removesuffix(".qweight")
        codes, zeros = self.layout(tensor, fetch(base + ".qzeros"))
        scales = fetch(base + ".scales").T
        n, k = codes.shape
        group = self.groups(base, k, fetch)
        if zeros.shape != scales.shape or scales.shape[0] != n or group.shape != (k,) or \
                int(group.max()) >= scales.shape[1] or int(group.min()) < 0:
            raise ValueError(f"{name}: codes {tuple(codes.shape)}, zero points {tuple(zeros.shape)} and scales "
                             f"{tuple(scales.shape)} do not make one weight in groups of {self.group_size}")
        return base + ".weight", codes, scales, zeros, group

    def groups(self, base: str, k: int, fetch: Fetch) -> torch.Tensor:
        size = k if self.group_size == -1 else self.group_size
        return torch.arange(k) // size

    @abstractmethod
    def layout(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [outputs, inputs], zero points [outputs, groups]) from the stored words."""


class Gptq(ZeroPointInt):
    """GPTQ (AutoGPTQ, GPTQModel): ``qweight`` [inputs / per_word, outputs], codes packed along
    the inputs; ``qzeros`` [groups, outputs / per_word]; ``g_idx`` each input's group (act-order
    permutes it). ``checkpoint_format`` "gptq" (v1, the common one) stores each zero point
    minus one, "gptq_v2" as it is."""

    def __init__(self, config: dict):
        super().__init__(config)
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        self.zero_offset = 1 if fmt == "gptq" else 0

    def layout(self, qweight, qzeros):
        return self._codes(qweight, 0).T, self._codes(qzeros, 1).T + self.zero_offset

    def groups(self, base, k, fetch):
        try:
            return fetch(base + ".g_idx").long()
        except (KeyError, ValueError):  # checkpoints without act-order may leave g_idx out
            return super().groups(base, k, fetch)


# AutoAWQ's GEMM layout interleaves the eight codes of a word: the code of output j (of each
# eight) sits at nibble AWQ_NIBBLE[j]
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


class Awq(ZeroPointInt):
    """AWQ in AutoAWQ's GEMM layout: ``qweight`` [inputs, outputs / 8] and ``qzeros`` [groups,
    outputs / 8], codes packed along the outputs, nibbles interleaved (``AWQ_NIBBLE``)."""

    bits_supported = (4,)

    def __init__(self, config: dict):
        super().__init__(config)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm" or not config.get("zero_point", True):
            raise ValueError(f"AWQ version {version!r} (zero_point={config.get('zero_point', True)}) is not "
                             "supported; supported: the GEMM layout with zero points")

    def _outputs(self, words: torch.Tensor) -> torch.Tensor:
        codes = self._codes(words, 1).reshape(words.shape[0], -1, self.per_word)
        return codes[..., list(AWQ_NIBBLE)].flatten(1)

    def layout(self, qweight, qzeros):
        return self._outputs(qweight).T, self._outputs(qzeros).T


FORMATS: dict[str, type[CheckpointQuantization]] = {
    "fp8": Fp8Blocks, "mxfp4": Mxfp4, "compressed-tensors": PackedInt4, "gptq": Gptq, "awq": Awq}


def checkpoint_quantization(config: dict) -> CheckpointQuantization | None:
    """The config's quantization (of the language model where the config wraps one), or None."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in FORMATS:
        raise ValueError(f"checkpoint quantization {method!r} is not supported; supported: {', '.join(FORMATS)} "
                         "(or an unquantized checkpoint, or a GGUF file)")
    return FORMATS[method](q)
