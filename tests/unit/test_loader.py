"""Loading: bad model paths, unsupported architectures, damaged weight files, GGUF round trip."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.unit.gguf_writing import add_header, finish, gguf_writer, llama3_rope_factors
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
    (query/key rows permuted for its rope layout; Llama 3 rope scaling as a rope_freqs tensor)."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf_writer(out, "llama", cfg["vocab_size"])
    arch = ModelArch.from_hf_config(cfg)
    add_header(w, cfg, rope_freq_base=arch.rope_theta, eos_token_id=2)
    if arch.rope_scaling_dict.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(arch.rope_scaling_dict, arch.head_dim, arch.rope_theta))
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
    finish(w)


def _write_moe_gguf(hf_dir: str, out: str, arch: str):
    """A MoE GGUF as llama.cpp's converter writes one: experts stacked per layer, a dense
    layer without router, the norm_topk_prob flag as expert_weights_norm; Mixtral as "llama"
    with its query/key rows permuted."""
    from safetensors.torch import load_file
    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf_writer(out, arch, cfg["vocab_size"])
    add_header(w, cfg, key_length=cfg["head_dim"], value_length=cfg["head_dim"],
               expert_count=cfg["num_local_experts"], expert_used_count=cfg["num_experts_per_tok"],
               expert_feed_forward_length=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
               expert_weights_norm=cfg.get("norm_topk_prob", True),
               rope_freq_base=ModelArch.from_hf_config(cfg).rope_theta)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    experts: dict[tuple, dict] = {}
    mixtral = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, t in state.items():
        arr = t.float().numpy()
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            _, _, layer, _, _, e, proj, _ = name.split(".")
            experts.setdefault((layer, mixtral.get(proj, proj)), {})[int(e)] = arr
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            base = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{parts[base]}.weight"
            if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if "q_proj" in base else cfg["num_key_value_heads"]
                arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, arr.shape[1]).swapaxes(1, 2).reshape(arr.shape)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gname, np.ascontiguousarray(arr))
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        w.add_tensor(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", np.ascontiguousarray(stacked))
    finish(w)


@pytest.mark.parametrize("name,arch,expected,dense", [("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM", [1]),
                                                     ("mixtral", "llama", "MixtralForCausalLM", [])])
def test_moe_gguf_matches_safetensors_of_the_same_weights(tiny_model_dirs, tmp_path, name, arch, expected, dense):
    out = str(tmp_path / "tiny-moe.gguf")
    _write_moe_gguf(tiny_model_dirs[name], out, arch)
    cfg = GGUFFile(out).hf_config()
    assert cfg["architectures"] == [expected] and cfg["mlp_only_layers"] == dense
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = list(range(10, 40))
    a = LLM(tiny_model_dirs[name], dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    b = LLM(out, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("name,quantize", [("llama", False), ("llama", True), ("llama3", False)])
def test_gguf_matches_safetensors_of_the_same_weights(tiny_model_dirs, tmp_path, name, quantize):
    """Also Llama 3.1's long-context rope, which llama.cpp stores as each frequency's divisor."""
    tiny_llama_dir = tiny_model_dirs[name]
    out = str(tmp_path / "tiny.gguf")
    _write_gguf(tiny_llama_dir, out, quantize)
    cfg = GGUFFile(out).hf_config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg.get("rope_scaling", {}).get("rope_type") == "freq_factors") == (name == "llama3")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = list(range(10, 40))
    a = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    b = LLM(out, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    if quantize:  # Q8_0 rounding: the same tokens for most of the run
        same = sum(x == y for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
        assert same >= 8
    else:
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_sharded_hf_dir_with_tokenizer_files(tmp_path):
    """A Hugging Face directory: sharded safetensors + index, tokenizer.json and
    tokenizer_config.json with a chat template; loads and matches the single-file model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from xlserve.loader.model_source import default_model_path
    from xlserve.loader.tokenizer import load_gguf_tokenizer
    gguf_tok = load_gguf_tokenizer(GGUFFile(default_model_path()).meta)
    cfg = LlamaConfig(vocab_size=gguf_tok.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": gguf_tok.chat_template.source, "eos_token": "<|im_end|>", "bos_token": None}))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_tokens=512)
    tok = llm.tokenizer
    text = "Hello world, naïve café 12345"
    assert tok.encode(text) == gguf_tok.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(chat) == gguf_tok.encode_chat(chat)
    assert tok.eos_token_ids == {2}
    out = llm.chat(chat, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_bfloat16_matches_float32_greedy_mostly(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(20, 50))
    a = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=512).generate(prompt, params)[0]
    b = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_tokens=512).generate(prompt, params)[0]
    assert a.outputs[0].token_ids[:2] == b.outputs[0].token_ids[:2]


def test_serving_path_stays_off_torch_compile_machinery(tiny_llama_dir):
    """Loading a model and running a step imports neither torch._dynamo nor sympy: together
    they add over a second of cold start and tens of MiB of memory."""
    import subprocess
    import sys
    code = ("import sys; from xlserve import LLM, SamplingParams; "
            f"LLM({tiny_llama_dir!r}, dtype='bfloat16').generate([list(range(5, 60))], "
            "SamplingParams(max_tokens=3, temperature=0)); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_gemma3_gguf_matches_safetensors_of_the_same_weights(tmp_path):
    """A Gemma 3 GGUF as llama.cpp writes it: norms stored as 1 + weight, the pre-MLP norm as
    ffn_norm, the layer pattern (every sixth global), local rotary base and query scale left
    to the reader."""
    import gguf
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=8, max_position_embeddings=512, eos_token_id=2,
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:  # norm offsets, zero at init
                p.normal_(0.0, 0.2)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    out = str(tmp_path / "gemma3.gguf")
    w = gguf_writer(out, "gemma3", 320)
    add_header(w, cfg.to_dict(), key_length=16, value_length=16, rope_freq_base=1000000.0, sliding_window=8)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        arr = t.float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{parts[rest.rsplit('.', 1)[0]]}.weight"
        elif name == "lm_head.weight":
            continue  # tied
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        w.add_tensor(gname, np.ascontiguousarray(arr))
    finish(w)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = list(range(10, 40))  # several windows of 8
    a = LLM(str(hf_dir), dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    b = LLM(out, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def _write_gpt_oss_gguf(hf_dir: str, out: str, mxfp4: bool) -> dict:
    """A gpt-oss GGUF as llama.cpp writes one: experts' alternating gate/up split into
    output-major gate/up/down tensors with biases (MXFP4 when asked), sinks, biased router."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    rope = cfg["rope_parameters"]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf_writer(out, "gpt-oss", cfg["vocab_size"])
    add_header(w, cfg, key_length=cfg["head_dim"], value_length=cfg["head_dim"],
               expert_count=cfg["num_local_experts"], expert_used_count=cfg["num_experts_per_tok"],
               expert_feed_forward_length=cfg["intermediate_size"], sliding_window=cfg["sliding_window"],
               rope_freq_base=rope["rope_theta"], rope_scaling_factor=rope["factor"],
               rope_scaling_orig_ctx_len=rope["original_max_position_embeddings"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn": "attn", "mlp.router": "ffn_gate_inp"}
    written = {}
    for name, t in state.items():
        arr = t.float().numpy()
        if not name.startswith("model.layers."):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
            w.add_tensor(gname, np.ascontiguousarray(arr))
            continue
        _, _, layer, rest = name.split(".", 3)
        base, kind = rest.rsplit(".", 1)
        if base == "mlp.experts":  # gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H], biases
            bias = kind.endswith("_bias")
            if kind.startswith("gate_up"):
                pieces = {"gate": arr[..., ::2], "up": arr[..., 1::2]}
            else:
                pieces = {"down": arr}
            for proj, piece in pieces.items():
                piece = piece if bias else np.ascontiguousarray(piece.swapaxes(1, 2))  # output-major
                gname = f"blk.{layer}.ffn_{proj}_exps.{'bias' if bias else 'weight'}"
                if mxfp4 and not bias:
                    q = gguf.quants.quantize(piece, gguf.GGMLQuantizationType.MXFP4)
                    written[gname] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)
                    w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                else:
                    w.add_tensor(gname, np.ascontiguousarray(piece))
            continue
        gname = "attn_sinks.weight" if kind == "sinks" else f"{parts[base]}.{kind}"
        w.add_tensor(f"blk.{layer}.{gname}", np.ascontiguousarray(arr))
    finish(w)
    return written


def test_gpt_oss_gguf_matches_safetensors_and_dequantizes_mxfp4_experts(tiny_model_dirs, tmp_path):
    """llama.cpp keeps gpt-oss's SwiGLU limit (7) in code, not in the file: the reference
    here is the same weights with that limit."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_model_dirs["gpt_oss"], hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": 7.0}))
    plain, quantized = str(tmp_path / "oss.gguf"), str(tmp_path / "oss-mxfp4.gguf")
    _write_gpt_oss_gguf(str(hf_dir), plain, mxfp4=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = list(range(10, 40))  # several windows of 8
    a = LLM(str(hf_dir), dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    b = LLM(plain, dtype="float32", kv_cache_tokens=1024).generate(prompt, params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    expected = _write_gpt_oss_gguf(str(hf_dir), quantized, mxfp4=True)
    moe = LLM(quantized, dtype="float32", kv_cache_tokens=1024).engine.runner.model.model.layers[1].mlp
    size = moe.w_down.shape[2]
    assert torch.equal(moe.w_gate_up[:, :size], torch.from_numpy(expected["blk.1.ffn_gate_exps.weight"]))
    assert torch.equal(moe.w_down, torch.from_numpy(expected["blk.1.ffn_down_exps.weight"]))
