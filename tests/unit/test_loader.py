"""Loading: bad model paths, unsupported architectures, damaged weight files, GGUF round trip."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.loader.gguf_file import GGUFFile
from xlserve.models.arch import ModelArch


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found: give 'default'"):
        LLM("/no/such/model/dir")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported(tiny_llama_dir, tmp_path):
    path = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: .*LlamaForCausalLM"):
        LLM(str(path))


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    path = tmp_path / "trunc"
    shutil.copytree(tiny_llama_dir, path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(path))


def test_corrupt_and_truncated_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(bad))
    from xlserve.loader.model_source import default_model_path
    data = open(default_model_path(), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(cut))


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(f))


def _write_gguf(hf_dir: str, out: str, quantize: bool):
    """Write a llama GGUF from a tiny HF llama the way llama.cpp's converter does
    (query/key rows permuted for its rope layout)."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(ModelArch.from_hf_config(cfg).rope_theta)
    w.add_tokenizer_model("gpt2")
    tokens = [f"<t{i}>" for i in range(cfg["vocab_size"])]
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in state.items():
        arr = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            base = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{parts[base]}.weight"
            heads = cfg["num_attention_heads"] if "q_proj" in base else cfg["num_key_value_heads"]
            if "q_proj" in base or "k_proj" in base:
                arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, arr.shape[1]).swapaxes(1, 2).reshape(arr.shape)
        else:
            gname = names[name]
        if quantize and arr.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("quantize", [False, True])
def test_gguf_matches_safetensors_of_the_same_weights(tiny_llama_dir, tmp_path, quantize):
    out = str(tmp_path / "tiny.gguf")
    _write_gguf(tiny_llama_dir, out, quantize)
    assert GGUFFile(out).hf_config()["architectures"] == ["LlamaForCausalLM"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = list(range(10, 40))
    a = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    b = LLM(out, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    if quantize:  # Q8_0 rounding: the same tokens for most of the run
        same = sum(x == y for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
        assert same >= 8
    else:
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
