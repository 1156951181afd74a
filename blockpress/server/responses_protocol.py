"""Request and response models of OpenAI's Responses API (POST /v1/responses), as pydantic models.

Invariants:
- A Responses request is a chat request in another shape: `to_chat()` turns it into the
  `ChatCompletionRequest` the chat path serves (prompt building, tool_choice, sampling limits),
  so both endpoints generate the same tokens for the same conversation and seed:
  `instructions` -> a leading system message; `input` (a string, or message / function_call /
  function_call_output items) -> messages (function calls join the assistant turn before them,
  outputs become tool messages); function `tools` and `tool_choice` -> their chat forms;
  `max_output_tokens` -> max_completion_tokens; `reasoning.effort` -> reasoning_effort; `text.format` ->
  response_format (json_schema's flattened fields nested as chat nests them); `parallel_tool_calls` as is.
- Refused with a 400 naming the field, rather than answered wrongly: `previous_response_id` and
  `conversation` (the server keeps no responses: send the conversation in `input`), a stored `prompt`, `background`,
  non-function tools, non-text content, and logprobs (`top_logprobs`,
  `include` of logprobs). Reasoning items in `input` are dropped (the template does not show
  earlier thinking to the model). `store` is accepted and answered `false`.
- `truncation: "auto"`: a conversation over the prompt limit loses its oldest whole turns after the system
  messages, as few as make it fit (`ResponsesServing.prompt`); "disabled" (the default): a 400, as chat.
- Errors raised by the chat path name the Responses field (`RESPONSES_FIELDS`; their messages, whole words).
- blockpress extensions as on chat: `seed`, `steps` and the other denoising knobs, and
  `chat_template_kwargs`.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator
from typing_extensions import Annotated

from .protocol import (APIError, ChatCompletionRequest, ChatTemplateKwargs, CompletionTokensDetails, Effort, PosInt,
                       PromptTokensDetails, SeedInt, Usage, _DiffusionKnobs, _Request, _STRICT, _null_is,
                       refusals_as_text)

# chat field -> the Responses field a client sent (an error's param)
RESPONSES_FIELDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                    "messages": "input", "logprobs": "top_logprobs", "reasoning_effort": "reasoning",
                    "response_format": "text"}
# ... and the words of a chat error's message, as whole words: the same, but for "logprobs" (the Responses path
# refuses logprobs itself, in words that already say top_logprobs) and two that read better as words
_MESSAGE_WORDS = {**{k: v for k, v in RESPONSES_FIELDS.items() if k != "logprobs"},
                  "messages": "input items", "response_format": "text.format"}
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _only(kind: str, allowed: tuple[str, ...], hint: str):
    def check(v: Any) -> Any:
        if v not in allowed:
            raise ValueError(f"{kind} {v!r} is not supported; {hint}")
        return v
    return BeforeValidator(check)


# ----------------------------------------------------------------------------- input
class InputText(BaseModel):
    model_config = _STRICT
    type: Annotated[str, _only("content type", ("input_text", "output_text"),
                               "send text as input_text parts (blockpress serves the text model)")]
    text: str


_Content = Union[str, Annotated[list[InputText], Field(max_length=256)]]


class InputMessage(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _Content

    @model_validator(mode="before")
    @classmethod
    def _refusals_are_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "assistant":
            return {**data, "content": refusals_as_text(data.get("content"), "output_text")}
        return data


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field("{}", max_length=65536)


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: _Content


class ReasoningInputItem(BaseModel):
    """An earlier turn's reasoning, sent back by agent SDKs; dropped (the template hides earlier thinking)."""
    model_config = _STRICT
    type: Literal["reasoning"]


def _item_type(v: Any) -> Any:
    kind = v.get("type", "message") if isinstance(v, dict) else None
    if kind is not None and kind not in _ITEM_TYPES:
        raise ValueError(f"input items of type {kind!r} are not supported; send messages, function_call and "
                         "function_call_output items")
    return v


InputItem = Annotated[Union[InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningInputItem],
                      Field(union_mode="left_to_right"), BeforeValidator(_item_type)]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Annotated[str, _only("tool type", ("function",), "blockpress runs no built-in tools: offer function tools "
                                                           "and run them yourself")]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-.]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class ReasoningConfig(BaseModel):
    model_config = _STRICT
    effort: Effort | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: dict[str, Any] | None = None


class _ResponsesFields(_Request):
    """OpenAI's Responses fields that this server uses, in OpenAI's order."""

    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1)]]
    model: str | None = Field(None, description="the served model's id or 'blockpress' (default: the served model)")
    background: bool | None = None
    conversation: Any = None
    include: list[str] | None = None
    instructions: str | None = Field(None, description="a system message put before the input")
    max_output_tokens: PosInt | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: Any = Field(None, description="refused: a prompt template stored at OpenAI")
    reasoning: ReasoningConfig | None = None
    store: bool | None = None
    stream: Annotated[bool, _null_is(False)] = False
    text: TextConfig | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, None] = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = Field(None, max_length=256)


class ResponsesRequest(_DiffusionKnobs, _ResponsesFields):
    """POST /v1/responses: OpenAI's fields, then the blockpress extensions."""

    seed: SeedInt | None = Field(None, description="blockpress: same seed, same text")
    chat_template_kwargs: ChatTemplateKwargs | None = None

    def _refuse(self) -> None:
        if self.prompt is not None:  # (ignored, the reply ran without the template's instructions and variables)
            raise APIError(400, "prompt (a prompt template stored at OpenAI) is not supported: this server keeps no "
                           "prompts; send its text as `instructions` and `input`", param="prompt",
                           code="unsupported_value")
        if self.previous_response_id is not None or self.conversation is not None:
            param = "previous_response_id" if self.previous_response_id is not None else "conversation"
            raise APIError(400, f"{param} is not supported: this server keeps no responses; send the conversation "
                           "so far in `input` (earlier output items included)", param=param, code="unsupported_value")
        if self.background:
            raise APIError(400, "background responses are not supported: the server keeps no responses to poll; "
                           "use stream=true for a long generation", param="background", code="unsupported_value")
        if self.top_logprobs or any("logprobs" in i for i in self.include or []):
            raise APIError(400, "logprobs are not supported on /v1/responses yet; leave top_logprobs and the "
                           "logprobs include unset", param="top_logprobs", code="unsupported_value")

    def chat_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format` (the same constrained decoding): the Responses API flattens
        json_schema's fields ({"type", "name", "schema", "strict"}), chat nests them under "json_schema"."""
        fmt = (self.text.format if self.text else None) or {"type": "text"}
        if fmt.get("type") != "json_schema":
            return fmt
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, 'text.format json_schema needs {"type": "json_schema", "name": ..., "schema": {...}}',
                           param="text.format", code="invalid_value")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        names: dict[str, str] = {}  # call_id -> function name, for the tool messages
        for i, item in enumerate(self.input):
            if isinstance(item, InputMessage):
                out.append({"role": item.role, "content": _content(item.content)})
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":  # calls join the assistant turn before them
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in names:  # (OpenAI: "No tool call found for function call output")
                    raise APIError(400, f"input.{i}: no function_call with call_id {item.call_id!r} comes before this "
                                   "function_call_output; send the function_call item it answers first",
                                   param=f"input.{i}.call_id", code="invalid_value")
                out.append({"role": "tool", "tool_call_id": item.call_id, "name": names[item.call_id],
                            "content": _content(item.output)})
        return out

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that serves this one (see the module docstring)."""
        self._refuse()
        choice = self.tool_choice
        knobs = self.model_dump(include=set(_DiffusionKnobs.model_fields), exclude_none=True)
        fields = {"name", "description", "parameters", "strict"}
        tools = [{"type": "function", "function": t.model_dump(include=fields, exclude_none=True)}
                 for t in self.tools or []]
        body = {
            "messages": self.messages(), "model": self.model, "max_completion_tokens": self.max_output_tokens,
            "seed": self.seed, "temperature": self.temperature, "stream": self.stream, "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.chat_format(),
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "tools": tools or None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, ToolChoiceFunction) else choice,
            "chat_template_kwargs": self.chat_template_kwargs.model_dump() if self.chat_template_kwargs else None,
            **knobs,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:  # the Responses models check the same bounds: this names what slipped through
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise APIError(400, f"input: {where}: {err.get('msg')}", param="input", code="invalid_value") from None


def _content(content: Any) -> str | list[dict[str, str]]:
    """A chat message's content: a string, or text parts that the chat template renders one by one."""
    return content if isinstance(content, str) else [{"type": "text", "text": p.text} for p in content]


def responses_error(e: APIError) -> APIError:
    """An error of the chat path, naming the Responses field the client sent."""
    param = RESPONSES_FIELDS.get(e.param or "", e.param)
    message = e.message
    for chat_name, name in _MESSAGE_WORDS.items():
        message = re.sub(rf"\b{chat_name}\b", name, message)
    return APIError(e.status, message, e.type, param, e.code)


# ----------------------------------------------------------------------------- output
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallOut(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[ReasoningItem, OutputMessage, FunctionCallOut]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    output_tokens: int
    output_tokens_details: CompletionTokensDetails
    total_tokens: int
    denoising_steps: int = Field(description="blockpress: decoder passes spent on this request")
    tokens_per_forward: float = Field(description="blockpress: output tokens per decoder pass")

    @classmethod
    def of(cls, usage: Usage) -> "ResponseUsage":
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   input_tokens_details=usage.prompt_tokens_details,
                   output_tokens_details=usage.completion_tokens_details,
                   total_tokens=usage.total_tokens, denoising_steps=usage.denoising_steps,
                   tokens_per_forward=usage.tokens_per_forward)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: ReasoningConfig | None = None
    store: bool = False
    temperature: float | None = Field(None, description="the request's, as sent (the denoising sampler keeps its "
                                      "own temperature schedule; 0 fixes the seed)")
    text: TextConfig = Field(default_factory=lambda: TextConfig(format={"type": "text"}))
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction] = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    top_p: float | None = Field(None, description="the request's, as sent (not used by the sampler)")
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


STREAM_EVENTS = ("response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done",
                 "response.output_item.done", "response.completed", "response.incomplete", "response.failed")


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response (`event: TYPE`, `data: <event>`): the fields its type has."""
    type: Literal[STREAM_EVENTS]
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: Union[OutputText, ReasoningText, None] = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None
