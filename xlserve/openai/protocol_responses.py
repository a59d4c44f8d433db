"""Request model of the Responses API (``POST /v1/responses``), the OpenAI Agents SDK's
default: input items (messages, function calls and their outputs), flat function tools,
``previous_response_id``. It becomes a chat request (``to_chat_messages`` +
``chat_fields``), so tools, grammars and sampling behave exactly as in chat completions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from xlserve.openai.protocol import MAX_MESSAGES, MAX_TOOLS, SEED_RANGE, Strict


class ContentPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, value):
        for part in value if isinstance(value, list) else ():
            if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text", "text"):
                raise ValueError(f"content part type {part.get('type')!r} is not supported; only text parts are")
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(Strict):
    """Sent back by agents as they received it; the model's reasoning is not re-fed."""
    type: Literal["reasoning"]


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                      Field(discriminator="type")]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop old turns) is not offered

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, data):
        if isinstance(data, dict):
            if data.get("background"):
                raise ValueError("background responses are not supported")
            for tool in data.get("tools") or ():
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise ValueError(f"tool type {tool.get('type')!r} is not supported; only function tools are")
            if isinstance(data.get("input"), list):  # a bare {"role", "content"} is a message item
                data = {**data, "input": [{"type": "message", **i} if isinstance(i, dict) and "type" not in i
                                          else i for i in data["input"]]}
        return data

    def input_messages(self) -> list[dict]:
        """This request's input as chat messages (``instructions`` not included)."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages: list[dict] = []
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def chat_fields(self, messages: list[dict]) -> dict:
        """A chat completion request body for ``messages`` with this request's settings."""
        body: dict = {"model": self.model, "messages": messages, "stream": self.stream,
                      "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                      "seed": self.seed, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"},
                                                                            exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_ or {"type": "object"}, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        return {k: v for k, v in body.items() if v is not None}
