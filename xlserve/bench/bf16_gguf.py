"""Write a BF16 GGUF of a model's weights so llama.cpp runs the same numbers we do.

The default model ships as Q4_1; comparing our bf16 engine against llama.cpp on that file
would compare different bit widths. This dequantizes every tensor to bf16 (norms stay
f32, as llama.cpp's converter keeps them) and copies all metadata unchanged.
"""

from __future__ import annotations

import os

import numpy as np

SKIP_KEYS = ("GGUF.", "general.file_type")


def write_bf16_gguf(src: str, dst: str) -> str:
    import gguf
    from gguf.quants import dequantize, quantize
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith(SKIP_KEYS) or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if data.ndim == 1:
            writer.add_tensor(t.name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(t.name, quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def cached_bf16_gguf(src: str) -> str:
    """The BF16 GGUF of ``src``, written once into the user's cache."""
    cache = os.path.expanduser("~/.cache/xlserve/bench")
    os.makedirs(cache, exist_ok=True)
    dst = os.path.join(cache, os.path.basename(src).replace(".gguf", "") + ".BF16.gguf")
    return dst if os.path.exists(dst) else write_bf16_gguf(src, dst)
