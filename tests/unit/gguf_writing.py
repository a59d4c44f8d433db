"""Writing GGUF files in tests the way llama.cpp's converter lays them out."""

import math

import numpy as np


def gguf_writer(out: str, arch: str, vocab_size: int):
    """A GGUF writer with a stand-in tokenizer of ``vocab_size`` tokens "<t0>", "<t1>"..."""
    import gguf
    w = gguf.GGUFWriter(out, arch)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(vocab_size)])
    w.add_token_types([1] * vocab_size)
    w.add_token_merges([])
    return w


def add_header(w, cfg: dict, **values) -> None:
    """The architecture keys every llama.cpp converter writes, from a Hugging Face config;
    ``values``: more keys (written by ``w.add_<key>``), or other values for these."""
    keys = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "head_count": cfg["num_attention_heads"], "head_count_kv": cfg["num_key_value_heads"],
            "layer_norm_rms_eps": cfg["rms_norm_eps"]}
    for key, value in {**keys, **values}.items():
        getattr(w, f"add_{key}")(value)


def finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3 scaling: each
    frequency's divisor."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
