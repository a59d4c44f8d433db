"""How a GGUF byte-level BPE vocabulary splits text before merging: by the name the file
stores in ``tokenizer.ggml.pre`` (the regexes are not in the file; llama.cpp compiles them in,
from each model's ``tokenizer.json``). Merges were learned inside these pieces, so another
split gives other tokens than the model was trained on: Llama 3 keeps "(hello" and at most
three digits together, GPT-2's regex does neither.

Each entry is the model's own sequence of splits (Hugging Face ``Split`` regexes, each
applied to the pieces of the one before); an unknown name falls back to GPT-2's, with a
warning.
"""

from __future__ import annotations

import logging

from tokenizers import Regex, pre_tokenizers

log = logging.getLogger(__name__)

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo", "jais"), (GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), (r"\p{N}", GPT2)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "pixtral"), (LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), (QWEN2,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (GPT4O,)),
    "tekken": (TEKKEN,),
    "deepseek-v3": DEEPSEEK3,
}


def gguf_pre_tokenizer(name: str | None):
    """The ``tokenizers`` pre-tokenizer for a GGUF file's ``tokenizer.ggml.pre``."""
    splits = SPLITS.get(name or "default")
    if splits is None:
        log.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does (known: %s)", name,
                    ", ".join(sorted(SPLITS)))
        splits = (GPT2,)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
