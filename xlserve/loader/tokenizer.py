"""Tokenizer: a ``tokenizers.Tokenizer`` plus the facts generation needs (bos/eos, template).

Built from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or rebuilt
from GGUF metadata (tokens, merges, token types, bos/eos, add_bos).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from xlserve.loader.chat_template import ChatTemplate, read_chat_template
from xlserve.loader.gguf_pretokenizer import gguf_pre_tokenizer

GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4


class Tokenizer:
    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: set[int],
                 add_bos: bool, chat_template: str | None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF); HF post-processors do it already
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        bos = backend.id_to_token(bos_token_id) if bos_token_id is not None else ""
        eos = backend.id_to_token(min(eos_token_ids)) if eos_token_ids else ""
        self.chat_template = ChatTemplate(chat_template, bos or "", eos or "")

    @functools.cached_property
    def special_token_ids(self) -> dict[str, int]:
        """Special (control) tokens by text: they have no spelling in ordinary tokens."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def use_chat_template(self, path: str) -> None:
        """Replace the model's chat template with the Jinja file at ``path`` (``--chat-template``)."""
        self.chat_template = ChatTemplate(read_chat_template(path), self.chat_template.bos_token,
                                          self.chat_template.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL (encode holds it: 8.7 s of a stalled event loop
        # for a 7 MB prompt) and skips offsets we never read (4.6 s instead of 8.7 s).
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **extra) -> str:
        return self.chat_template.render(messages, add_generation_prompt, tools, **extra)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **extra) -> list[int]:
        # Templates spell out BOS themselves, so the text is tokenized without adding it again.
        return self.encode(self.apply_chat_template(messages, True, tools, **extra),
                           add_special_tokens=False)


def prompt_token_ids(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """A prompt as token ids: text is encoded, ids pass through (their range is checked
    where the model is known). Empty prompts are refused."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    return ids


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_hf_tokenizer(model_dir: str, model_config: dict) -> Tokenizer | None:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    backend = HFTokenizer.from_file(path)
    cfg = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    eos_ids = set(_as_list(model_config.get("eos_token_id")))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos_ids |= set(_as_list(json.load(f).get("eos_token_id")))
    eos_tok = _token_content(cfg.get("eos_token"))
    if eos_tok is not None and backend.token_to_id(eos_tok) is not None:
        eos_ids.add(backend.token_to_id(eos_tok))
    bos_tok = _token_content(cfg.get("bos_token"))
    bos_id = backend.token_to_id(bos_tok) if bos_tok else model_config.get("bos_token_id")
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids, add_bos=False,
                     chat_template=template)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def load_gguf_tokenizer(meta: dict) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' "
                         "(byte-level BPE). Use the model's Hugging Face directory instead.")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    added = [AddedToken(tokens[i], special=(t == GGUF_TOKEN_CONTROL), normalized=False)
             for i, t in enumerate(types) if t in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)]
    backend.add_tokens(added)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = set(_as_list(eos))
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    return Tokenizer(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=eos_ids,
                     add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=meta.get("tokenizer.chat_template"))


def load_model_tokenizer(model: str, chat_template: str = "") -> Tokenizer | None:
    """Only the tokenizer (and chat template, or the one in the file ``chat_template``) of
    ``--model``, without its weights and without torch (the router needs nothing more)."""
    tokenizer = _load_model_tokenizer(model)
    if chat_template and tokenizer is not None:
        tokenizer.use_chat_template(chat_template)
    return tokenizer


def _load_model_tokenizer(model: str) -> Tokenizer | None:
    from xlserve.loader.gguf_container import read_gguf
    from xlserve.loader.model_source import resolve_model
    source = resolve_model(model)
    if source.kind == "gguf":
        meta, _, _ = read_gguf(source.path)
        return load_gguf_tokenizer(meta)
    try:
        with open(os.path.join(source.path, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read config.json in {source.path!r}: {e}") from e
    return load_hf_tokenizer(source.path, config)
