"""POST /tokenize and /detokenize (vLLM's shapes): what a prompt costs in tokens before
sending it, with this server's tokenizer and chat template."""

from __future__ import annotations

from xlserve.openai.conversation import chat_prompt_ids
from xlserve.openai.errors import ApiError
from xlserve.openai.protocol import DetokenizeRequest, TokenizeRequest
from xlserve.openai.serving_common import WorkerState


class TokenHandler:
    """``prepare`` does the work (on the preprocessor's threads); ``complete`` answers."""

    def __init__(self, state: WorkerState):
        self.state = state

    def _tokenizer(self, model: str | None):
        self.state.check_model(model)
        if self.state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return self.state.tokenizer

    def prepare(self, req: TokenizeRequest | DetokenizeRequest) -> dict:
        tokenizer = self._tokenizer(req.model)
        if isinstance(req, DetokenizeRequest):
            bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise ApiError(400, f"token ids outside the vocabulary (0..{tokenizer.vocab_size - 1}): {bad[:8]}",
                               "tokens")
            return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
        try:
            ids = (tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt is not None
                   else chat_prompt_ids(tokenizer, req.messages, req.tools))
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from e
        out = {"count": len(ids), "max_model_len": self.state.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tokenizer.backend.id_to_token(i) for i in ids]
        return out

    async def complete(self, req, prepared: dict) -> dict:
        return prepared
