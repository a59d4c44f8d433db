"""OpenAI-compatible request models.

Fields that change the answer are honoured or refused, never dropped (``REFUSED``; the
legacy ``functions`` / ``function_call`` become tools); fields that do not (``user``,
``metadata``, ``store``...) are accepted and ignored, as OpenAI-compatible servers do.
Wrong types are refused (strict mode: no silent "5" -> 5). Every size a client controls
has a bound. docs/api-fields.md lists every field and what xlserve does with it.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xlserve.sampling_params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_STOP_STRINGS,
    MIN_REPETITION_PENALTY,
    SEED_RANGE,
    GuidedSpec,
    SamplingParams,
)

MAX_N = 16
MAX_MESSAGES = 2048
MAX_PROMPTS = 64
MAX_TOOLS = 128
MAX_CHOICES = 256


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str = "{}"


class ToolCall(Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value):
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") != "text":
                    raise ValueError(f"content part type {part.get('type')!r} is not supported; "
                                     "only 'text' parts are")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: dict[str, str]


class JsonSchemaFormat(Strict):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guided(self) -> GuidedSpec | None:
        if self.type == "json_object":
            return GuidedSpec("json_schema", '{"type": "object"}')
        if self.type == "json_schema":
            schema = self.json_schema.schema_ if self.json_schema else {"type": "object"}
            return GuidedSpec("json_schema", json.dumps(schema))
        return None


class StructuredOutputs(Strict):
    """A constraint beyond response_format (vLLM's ``structured_outputs``; its older
    ``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice`` fields map
    here): a JSON schema, a regular expression, a Lark grammar, or one of a list of strings."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)

    def spec(self) -> GuidedSpec | None:
        given = [name for name in ("json_", "regex", "grammar", "choice") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"one constraint at a time; got {', '.join(n.rstrip('_') for n in given)}")
        if self.json_ is not None:
            return GuidedSpec("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if self.regex is not None:
            return GuidedSpec("regex", self.regex)
        if self.grammar is not None:
            return GuidedSpec("lark", self.grammar)
        if self.choice is not None:
            return GuidedSpec("lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice))
        return None


class StreamOptions(Strict):
    include_usage: bool = False


# Fields that would change the answer in ways this server cannot honour: a 400, not a
# silently different answer.
REFUSED = {"audio": "audio output is not supported", "web_search_options": "web search is not supported",
           "suffix": "suffix (fill in the middle) is not supported"}


class SamplingFields(Strict):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = Field(default=None)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=10)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # lower leaves the queue first
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    guided_grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_cannot_be_honoured(cls, data):
        if isinstance(data, dict):
            for name, why in REFUSED.items():
                if data.get(name) is not None:
                    raise ValueError(f"{name}: {why}")
            if data.get("modalities") not in (None, ["text"]):
                raise ValueError("modalities: only ['text'] is supported")
            if data.get("best_of") not in (None, 1):
                raise ValueError("best_of: only 1 is supported; use n for several choices")
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        if value and not all(k.isdigit() for k in value):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        return value

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > 256 for s in stops):
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings of at most 256 characters")
        return value

    def constraint(self) -> GuidedSpec | None:
        """The constraint sent as ``structured_outputs`` or as a ``guided_*`` field."""
        legacy = {"json": self.guided_json, "regex": self.guided_regex, "grammar": self.guided_grammar,
                  "choice": self.guided_choice}
        legacy = {k: v for k, v in legacy.items() if v is not None}
        if legacy and self.structured_outputs is not None:
            raise ValueError("send structured_outputs or guided_* fields, not both")
        chosen = self.structured_outputs or (StructuredOutputs.model_validate(legacy) if legacy else None)
        return chosen.spec() if chosen is not None else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed_offset: int = 0,
                        guided: GuidedSpec | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + seed_offset,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=tuple(s for s in stop if s), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, guided=guided,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, priority=self.priority)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Forced calls are single unless parallel calls are asked for explicitly: small models
    # otherwise repeat the call until max_tokens.
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # legacy (before tools): mapped onto tools / tool_choice, answered as message.function_call
    functions: list[FunctionDef] | None = Field(default=None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | dict[str, str] | None = None

    @model_validator(mode="after")
    def _functions_as_tools(self):
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("send functions/function_call or tools/tool_choice, not both")
        self.tools = [Tool(type="function", function=f) for f in self.functions or []]
        if isinstance(self.function_call, dict):
            self.tool_choice = NamedToolChoice(type="function", function=self.function_call)
        else:
            self.tool_choice = self.function_call
        return self

    @property
    def legacy_functions(self) -> bool:
        return self.functions is not None

    def forced_tool(self) -> tuple[bool, str | None]:
        """(a tool call is required, the function it must call or None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.get("name")
        return self.tool_choice == "required", None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field()
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _bound_prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt is an empty list")
            if isinstance(value[0], (str, list)) and len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return value

    def prompts(self) -> list[str | list[int]]:
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [value]
        return list(value)


class TokenizeRequest(Strict):
    """``POST /tokenize``: a prompt, or chat messages rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_special_tokens: bool = True
    return_token_strs: bool = False
    stream: ClassVar[bool] = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    """``POST /detokenize``: token ids back to text."""
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
    stream: ClassVar[bool] = False
