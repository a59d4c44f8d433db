"""Model families served by real processes: a tiny DeepSeek-V3 (latent attention + routed and
shared experts) and a tiny Llama 4 (chunked-attention layer groups + experts) split over
prefill and decode workers answer exactly as one worker does."""

import json
import shutil

import pytest
from openai import OpenAI

from tests.e2e.server_process import metric, running_server


def _with_word_tokenizer(model_dir: str, dest) -> str:
    """A copy of a tiny tokenizer-less model with a word-level tokenizer ("t0" .. "t319"), so
    the OpenAI text API can drive it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    shutil.copytree(model_dir, dest)
    with open(dest / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    return str(dest)


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama4"])
def test_disaggregated_equals_colocated(tiny_model_dirs, tmp_path, arch):
    model = _with_word_tokenizer(tiny_model_dirs[arch], tmp_path / arch)
    prompts = [" ".join(f"t{i}" for i in range(start, start + 70)) for start in (20, 100, 200)]
    common = ("--model", model, "--log-level", "warning")
    answers = {}
    with running_server(*common, command="serve") as pd, running_server(*common) as colocated:
        for name, url in (("pd", pd), ("colocated", colocated)):
            client = OpenAI(base_url=f"{url}/v1", api_key="unused")
            answers[name] = [client.completions.create(model=client.models.list().data[0].id, prompt=p,
                                                       max_tokens=24, temperature=0,
                                                       extra_body={"ignore_eos": True}).choices[0].text
                             for p in prompts]
        assert metric(pd, "xlserve_kv_transfer_bytes_total") > 0  # the decode worker pulled the blocks
    assert answers["pd"] == answers["colocated"]
    assert all(len(text.split()) == 24 for text in answers["pd"])
