"""A GGUF byte-level vocabulary splits text as its model's own tokenizer does, chosen by
``tokenizer.ggml.pre``: against transformers' GGUF tokenizers on a vocabulary whose merges
cross every split boundary (so a wrong split gives other tokens), and against the splits
llama.cpp documents where transformers has none."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.unit.gguf_writing import finish
from xlserve.loader.gguf_file import GGUFFile
from xlserve.loader.gguf_pretokenizer import gguf_pre_tokenizer
from xlserve.loader.tokenizer import load_gguf_tokenizer

CORPUS = ["(hello) [world]! 12345 67 8 I'm HERE's YOU'LL don't", "x=3.14159;y=-2e10 //path/to/file\n\n  indented",
          "The QUICK brown fox's den.\r\nNew line  \t tab", "価格は1234円です。漢字かなカナ",
          "CamelCaseWords andMixedCASE"]
PROBES = CORPUS + ["(hello)12345", "I'M here", "a\r\n\n b"]


@pytest.fixture(scope="module")
def vocabulary():
    """Merges learned over whole lines (no split while training): tokens like "(h" and "123"."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.train_from_iterator(CORPUS * 50, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, merges


def _gguf(path, pre: str, vocabulary) -> str:
    import gguf
    tokens, merges = vocabulary
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 8), (w.add_head_count, 1), (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    finish(w)
    return str(path)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "tekken"])
def test_splits_equal_transformers_gguf_tokenizers(tmp_path, vocabulary, pre):
    from transformers import AutoTokenizer
    path = _gguf(tmp_path / f"{pre}.gguf", pre, vocabulary)
    ours = load_gguf_tokenizer(GGUFFile(path).meta)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{pre}.gguf")
    for text in PROBES:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text
    gpt2 = load_gguf_tokenizer({**GGUFFile(path).meta, "tokenizer.ggml.pre": "gpt2"})
    assert any(gpt2.encode(t, add_special_tokens=False) != ours.encode(t, add_special_tokens=False) for t in PROBES)


@pytest.mark.parametrize("pre,text,pieces", [
    ("smollm", "x 12345 apples", ["x", " ", "1", "2", "3", "4", "5", " apples"]),  # every digit alone
    ("deepseek-v3", "(hello) 12345価格", ["(hello", ")", " ", "123", "45", "価格"]),  # 3 digits, Han runs
    ("no-such-pre", "(hello) 12", ["(", "hello", ")", " 12"]),  # GPT-2's, with a warning
])
def test_splits_llama_cpp_documents(pre, text, pieces):
    spelled = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # pieces as the vocabulary spells them
    assert [p for p, _ in gguf_pre_tokenizer(pre).pre_tokenize_str(text)] == [
        spelled.pre_tokenize_str(p)[0][0] for p in pieces]
