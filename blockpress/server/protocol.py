"""Request and response models of the OpenAI-compatible API (pydantic), fields in OpenAI's order.

Invariants:
- Requests are validated strictly (JSON types are not coerced: `"5"` is not an int) and unknown
  fields are ignored (OpenAI clients send fields such as `temperature` that a diffusion sampler
  does not use). Every string in a request must be valid Unicode (no lone surrogates).
- `to_sampling(limits, defaults)` is the one place request knobs become engine parameters: it
  applies the server limits and resolves a `GenerationConfig` (which validates the values); any
  problem raises `APIError` (400) naming the request field.
- A missing `model` means the served model, and so does the stable alias `blockpress` (client code
  need not know the folder's name); another name is 404 `model_not_found`.
- A request without max_tokens gets the server's `--max-new-tokens` (`Limits.default_max_tokens`),
  else the checkpoint's default (chat) or OpenAI's 16 (completions), cut to the whole canvases the model's
  positions leave after the prompt (`OpenAIServing._fit`); a max_tokens given that does not fit is a 400.
- A prompt may have at most `--max-prompt-tokens`, and at most what the model's positions leave for one
  canvas (`OpenAIServing.prompt_limit`).
- Every bound is declared in the field's JSON Schema (`minimum`, `maxItems`, ...), so `/openapi.json`
  says what the server accepts: constraints on optional ints sit inside their `Annotated` type
  (pydantic writes a constraint on a union as a non-standard `"ge"`).

blockpress extensions (OpenAI clients pass them with `extra_body=`):
- request knobs: `steps` (exactly N denoising steps per canvas, early stopping off: the
  speed/quality dial; with a stopping knob beside it a 400, `config.steps_sampling`), `max_denoising_steps`,
  `entropy_bound`, `t_min`, `t_max`,
  `stability_threshold`, `confidence_threshold` (omitted = the server default; a knob cannot be
  set to null per request); `chat_template_kwargs: {"enable_thinking": bool}` (or OpenAI's
  `reasoning_effort`: anything but none/minimal turns thinking on).
- `tool_choice` "required" or {"type": "function", "function": {"name"}} is enforced by holding the
  opening of a call (`<|tool_call>call:`, plus `NAME{` when the tool is known) on the first canvas;
  a choice naming no offered tool, or "required" without tools, is a 400. A request that offers no tool (none,
  or tool_choice "none") gets no call: the call's opening token is banned (`parsing.call_ban`).
  `parallel_tool_calls: false` keeps a reply's first call; `parameters` must be an object schema.
- `stream_options: {"include_drafts": true}` adds chunks with `"choices": []` and a `blockpress`
  field: after every denoising step `{"type": "draft", "canvas", "step", "max_steps", "text",
  "tokens": [piece per position], "accepted": [0/1 per position]}`, after every canvas
  `{"type": "commit", "canvas", "steps"}`. Without it the stream is plain OpenAI.
- `usage.denoising_steps` (decoder passes for this request) and `usage.tokens_per_forward`; OpenAI's
  `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the prefix cache held (engine/prefix.py),
  `cache_write_tokens` those the request left there.
- `n` choices (up to `Limits.max_choices`) run as n rows of the batch; with a seed, choice i samples
  with seed + i, so choice 0 is the n=1 answer. Usage counts the prompt once and sums the rest.
- A list of prompts on /v1/completions (strings or token-id lists, up to `Limits.max_prompts`) runs
  as one batch: prompt p's choice i has index p * n + i and the seed of choice i; usage counts each
  prompt once.
- `logit_bias` ({token id: -100..100}) is added to the logits (soft-capped) before the temperature in every
  denoising step, as OpenAI adds it before sampling: -100 bans a token, +100 forces it; a grammar still has the
  last word, and logprobs are those of the biased distribution the step sampled from.
- Ignored OpenAI fields: temperature, top_p, penalties (no meaning for the
  entropy-bounded denoising sampler); a value outside OpenAI's range (temperature 0-2, top_p 0-1, penalties
  -2 to 2) is still a 400, as OpenAI answers it. `temperature: 0` without a seed samples with seed 0: a client
  asking for the same answer every time gets it. Refused with a 400 naming the field rather than silently
  dropped, because a client would read a wrong answer: `best_of` > 1 (but = n), `echo`, image/audio content parts, audio
  output, the deprecated `functions` / `function_call`, `stream_options` without `stream`, a `response_format`
  without a type, and `top_logprobs` > 0 without `logprobs: true` (chat).

Structured output: `response_format` `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}` (chat and completions), or the extensions `regex` / `grammar` (Lark): the output
is constrained during denoising (engine/constraint.py) to parse and validate and to end within `max_tokens`. A
schema or grammar the engine cannot compile is a 400 naming the problem; so is a `max_tokens` too small for the
shortest valid output. In chat the constrained output is the message's `content` (no thinking); beside tools the
reply is calls or that content (constraint.reply_grammar).
vLLM's fields (what code written for it sends) are these grammars under its names (`guided_json`, `guided_regex`,
`guided_choice`: a regex of the strings, `guided_grammar`, `structured_outputs`); `ignore_eos` empties the stop ids;
chat's `continue_final_message` / `add_generation_prompt` shape the prompt as vLLM's do; `min_tokens`,
`include_stop_str_in_output` and a request's `chat_template` are refused. Its other sampling fields (`top_k`,
`min_p`, penalties) are ignored like OpenAI's.

Logprobs (chat `logprobs: true` + `top_logprobs` 0..20; completions `logprobs` 0..5):
- Meaning: a denoised token is not drawn once from a left-to-right distribution. The committed canvas is the
  argmax of the canvas's last executed denoising step, so a token's logprob is log_softmax of that step's
  (temperature-scaled) logits at its position, and the alternatives are that distribution's most likely tokens
  (the first is the token itself, which is the argmax, except where a grammar wrote another token: its logprob is
  then that token's under the same distribution, below the alternatives'; with a bf16 model the logits are the
  bf16 ones the step keeps). The engine computes them once per canvas, only for the requests that asked; the
  tokens are the same bits with or without them.
- Alignment: one entry per token of the returned text, in order. `token` (chat) / `tokens[i]` (completions) is
  the text that token contributes, so the entries' tokens joined are the returned text; an entry may be "" (a
  token holding part of a multi-byte character, whose text goes to the token completing it, or a special
  token a completion does not show). `bytes` is the token's own UTF-8 bytes (a byte token's one byte), so a
  character split over tokens can be rebuilt. Not returned: the stop id, padding after it, tokens past
  `max_tokens`, tokens after a stop string (a token the stop string cuts is returned with the text before the
  cut), insert mode's held suffix. (A forced tool call's held opening is a call's markup; should the call not
  parse, it is kept as content, and its held tokens come with their log-probability, not the likeliest.)
- Chat: `choices[i].logprobs.content` covers the tokens of `content` only. Tokens of `reasoning_content`, of
  tool calls and of the output's markup (channel and turn headers, control tokens) are left out; a token that is
  part markup, part content has its content part as `token`.
- Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, `top_logprobs` a {token: logprob} dict per
  token (tokens with the same text keep the likelier), `text_offset` each token's start in the choice's text.
- Streaming: a chunk carries the entries of the tokens whose text ended in it (a token decided later, e.g. one
  the stop-string check holds back, comes in a later chunk, possibly one with empty text); over the stream they
  are the non-streamed list.
- Values are finite: a log-probability below -9999 is reported as -9999.0.
- /v1/responses still refuses logprobs (`top_logprobs`, the logprobs `include`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator
from typing_extensions import Annotated

from ..config import MAX_SEED, MIN_SEED, REFERENCE_DEFAULTS, GenerationConfig, steps_sampling, torch_seed
from ..errors import InputError, SamplingError

# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ----------------------------------------------------------------------------- limits


@dataclass
class Limits:
    """Server-side caps applied to every request."""

    max_tokens: int = 4096  # cap on max_tokens / max_completion_tokens
    max_messages: int = 256
    max_prompt_tokens: int = 32768
    max_body_bytes: int = 1 << 20
    max_steps: int = 1024
    max_choices: int = 8  # cap on n
    max_prompts: int = 32  # cap on the prompts of one /v1/completions request
    default_max_tokens: int | None = None  # max_tokens of a request that gives none (serve --max-new-tokens)
    body_timeout: float = 30.0  # seconds a client may take to send its request body (408 after)


@dataclass
class Sampling:
    """What a request asks of the engine, validated."""

    cfg: GenerationConfig
    max_tokens: int
    seed: int | None
    budget_field: str | None = None  # the request field that set max_tokens; None: not given (the default, which
    # the server cuts to what the model's positions leave after the prompt, as OpenAI generates into what is left)
    stop: list[str] = field(default_factory=list)
    include_usage: bool = False
    include_drafts: bool = False
    n: int = 1  # choices: choice i samples with seed + i (choice 0 is the n=1 answer)
    logprobs: int | None = None  # alternatives per token with logprobs (0: the token's only); None: not asked
    grammar: str | None = None  # the compiled grammar the output obeys (response_format, regex, grammar, tools that
    # force a call or are strict); None: free
    guarded: tuple[int, ...] = ()  # tokens the grammar writes only where the draft after them fits (Constraint)
    grammar_param: str = "response_format"  # the request field the grammar came from (a 400 names it): or "tools"
    suppress: list[int] | None = None  # token ids the output may not hold where no grammar is given (a chat
    # request that offers no tool: the opening of a tool call, parsing.call_ban)
    one_call: bool = False  # parallel_tool_calls false: a reply's tool calls end after the first
    logit_bias: dict[int, float] | None = None  # added to the logits every step (engine: sampling.bias_vector)
    ignore_eos: bool = False  # vLLM's ignore_eos: no stop id (cfg.eos_token_id is empty)

    def choice_seed(self, i: int) -> int | None:
        if self.seed is None:
            return None
        return self.seed + i if self.seed + i <= MAX_SEED else self.seed - i


# ----------------------------------------------------------------------------- shared pieces

_STRICT = ConfigDict(strict=True, extra="ignore")


def _integral(v: Any) -> Any:
    """JSON Schema integers include 2.0; strings and booleans stay invalid (strict mode)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]
# bounded types: the bound inside the type, so an optional field's schema says `minimum`, not `"ge"`
# (the bound before the validator: it constrains the int schema itself)
PosInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
NonNegInt = Annotated[int, Field(ge=0), BeforeValidator(_integral)]


def _null_is(default):
    """A BeforeValidator: an explicit null means the field's default (OpenAI's nullable fields with defaults)."""
    return BeforeValidator(lambda v: default if v is None else v)
SeedInt = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED), BeforeValidator(_integral), AfterValidator(torch_seed)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


def _check_unicode(value: Any, path: tuple = ()) -> None:
    """Reject strings with lone surrogates anywhere in the request (they cannot be tokenised), naming where."""
    if len(path) > 64:
        raise ValueError("request JSON is nested too deeply (more than 64 levels)")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            where = ".".join(str(p)[:40] for p in path) or "the request"  # (a key may be long)
            raise ValueError(f"{where} holds invalid Unicode (a lone surrogate, {value[e.start]!r}); send valid "
                             "UTF-8 text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, path + ("(a key)",))
            _check_unicode(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, path + (i,))


_IGNORED = "ignored by the denoising sampler (its temperature schedule is t_min / t_max); validated as OpenAI does"
_TEMPERATURE = ("not a sampling temperature (the denoising sampler's schedule is t_min / t_max); 0 asks for a "
                "deterministic answer: without a seed the request samples with seed 0")


class _Request(BaseModel):
    model_config = _STRICT
    # OpenAI's sampling fields, in every endpoint: not used, but a value OpenAI refuses is refused (400 naming it)
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = Field(None, description=_TEMPERATURE)
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(None, description=_IGNORED)
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = Field(None, description=_IGNORED)
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = Field(None, description=_IGNORED)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=1024, description="added to the logits (soft-capped) of these token ids before the "
        "temperature, every denoising step: -100 bans a token, +100 forces it")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    include_drafts: bool = Field(False, description="blockpress: send a `blockpress` draft frame after every "
                                 "denoising step (and a commit frame per canvas)")


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field("{}", max_length=65536)


class ToolCallIn(BaseModel):
    model_config = _STRICT
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


def _text_part_type(v: Any) -> Any:
    if v != "text":
        raise ValueError(f"only text content parts are supported (got {v!r}): blockpress serves the text model; "
                         "send images or audio as text, or leave them out")
    return v


class TextPart(BaseModel):
    model_config = _STRICT
    type: Annotated[str, BeforeValidator(_text_part_type)]
    text: str


def refusals_as_text(content: Any, text_type: str) -> Any:
    """An assistant turn's content parts with each `refusal` part (OpenAI's, in a replayed conversation) as a text
    part of `text_type`: what the assistant said."""
    if not isinstance(content, list):
        return content
    return [{"type": text_type, "text": p["refusal"]} if isinstance(p, dict) and p.get("type") == "refusal"
            and isinstance(p.get("refusal"), str) else p for p in content]


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=256)
    refusal: str | None = Field(None, description="an earlier assistant turn's refusal: read as its content, when "
                                "it has no other")

    @model_validator(mode="before")
    @classmethod
    def _refusals_are_text(cls, data: Any) -> Any:
        """An assistant turn replayed from OpenAI may hold its refusal as a `refusal` part (or field): what it said,
        so its text (it was a 400 that spoke of images)."""
        if not isinstance(data, dict) or data.get("role") != "assistant":
            return data
        content = refusals_as_text(data.get("content"), "text")
        if content is None and isinstance(data.get("refusal"), str) and not data.get("tool_calls"):
            content = data["refusal"]
        return {**data, "content": content, "refusal": None}

    @model_validator(mode="after")
    def _has_content(self):
        """Only an assistant turn may leave out its content (a turn of tool calls), as OpenAI requires."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (text or text parts)")
        return self


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-.]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="the model's calls of this tool have arguments valid against "
                                "`parameters` (a grammar while the reply is denoised; needs the structured extra)")

    @model_validator(mode="after")
    def _object_parameters(self):
        """A call's arguments are an object (OpenAI: `parameters` is a JSON Schema object); a schema of another
        type would make a forced call write what no call can hold."""
        kind = (self.parameters or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"a function's parameters must be a JSON Schema of type \"object\" (its arguments are an "
                             f"object), got type {kind!r}; put the value under a property")
        return self


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    function: FunctionDef


# vLLM's structured-output fields -> the `grammar_for` keyword each means ("choice": a regex of the strings)
VLLM_GRAMMARS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structured_outputs": None}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                      "json_object": "json_object"}


def _regex_literal(text: str) -> str:
    """A regex that matches `text` only: every character but ASCII letters and digits as a \\x{..} escape."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


class _DiffusionKnobs(_Request):
    """blockpress sampling extensions shared by both endpoints."""

    steps: PosInt | None = Field(None, description="blockpress: exactly this many denoising steps per canvas "
                                 "(early stopping off); the speed/quality dial")
    max_denoising_steps: PosInt | None = None
    entropy_bound: PosFloat | None = None
    t_min: NonNegFloat | None = None
    t_max: NonNegFloat | None = None
    stability_threshold: NonNegInt | None = None
    confidence_threshold: PosFloat | None = None
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", '
        '"schema", "strict"}}: the output is constrained during denoising to parse (and validate)')
    regex: str | None = Field(None, max_length=4096, description="blockpress: the output matches this regular "
                              "expression (constrained during denoising)")
    grammar: str | None = Field(None, max_length=65536, description="blockpress: the output follows this Lark "
                                "grammar (constrained during denoising)")
    # vLLM's extensions, as code written for vLLM sends them: its structured-output fields are the ones above under
    # other names; the others would change what its client reads, so each is honoured or refused, never dropped
    guided_json: Union[dict[str, Any], str, None] = Field(None, description="vLLM: a JSON Schema the output follows")
    guided_regex: str | None = Field(None, max_length=4096, description="vLLM: `regex`")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                             Field(min_length=1, max_length=256)] | None = Field(
        None, description="vLLM: the output is one of these strings")
    guided_grammar: str | None = Field(None, max_length=65536, description="vLLM: `grammar` (Lark)")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM: one of json, regex, choice, grammar, "
                                                      "json_object, as the guided_ fields")
    ignore_eos: bool | None = Field(None, description="vLLM: no stop id ends the output; it runs to max_tokens")
    min_tokens: NonNegInt | None = Field(None, description="vLLM: refused (but 0): no stop id is held back")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM: refused when true; stop strings are "
                                                    "cut from the text, as OpenAI cuts them")

    def _vllm_grammar(self) -> tuple[dict[str, Any], str | None]:
        """vLLM's structured-output fields as this server's (json_schema / json_object / regex / grammar keywords of
        `grammar_for`) and the field they came from; ({}, None) without one."""
        given = [(k, v) for k in VLLM_GRAMMARS if (v := getattr(self, k)) is not None]
        if not given:
            return {}, None
        if len(given) > 1:
            raise APIError(400, f"give one of {' and '.join(k for k, _ in given)}", param=given[1][0],
                           code="invalid_value")
        name, value = given[0]
        if name == "structured_outputs":
            if value.get("structural_tag") is not None:
                raise APIError(400, "structured_outputs.structural_tag is not supported; use json, regex, choice or "
                               "grammar", param="structured_outputs.structural_tag", code="unsupported_value")
            kinds = [k for k in STRUCTURED_OUTPUTS if value.get(k) is not None and value.get(k) is not False]
            if len(kinds) != 1:
                raise APIError(400, f"structured_outputs needs one of {', '.join(STRUCTURED_OUTPUTS)} (got "
                               f"{', '.join(kinds) or 'none'})", param="structured_outputs", code="invalid_value")
            name, value = f"structured_outputs.{kinds[0]}", value[kinds[0]]
        kind = VLLM_GRAMMARS.get(name) or STRUCTURED_OUTPUTS[name.partition(".")[2]]
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                raise APIError(400, f"{name} must be a list of non-empty strings", param=name, code="invalid_value")
            kind, value = "regex", "|".join(map(_regex_literal, value))
        return {kind: value}, name

    def _refuse_vllm(self) -> None:
        if self.min_tokens:
            raise APIError(400, "min_tokens is not supported: a canvas may end at its first stop id; leave it out",
                           param="min_tokens", code="unsupported_value")
        if self.include_stop_str_in_output:
            raise APIError(400, "include_stop_str_in_output is not supported: stop strings are cut from the text, as "
                           "OpenAI cuts them; add it back yourself", param="include_stop_str_in_output",
                           code="unsupported_value")

    def output_grammar(self) -> str | None:
        """The compiled grammar of response_format / regex / grammar or vLLM's fields (at most one), or None for free
        text."""
        from ..engine.constraint import grammar_for, grammar_kinds

        fmt = self.response_format or {"type": "text"}
        if "type" not in fmt:
            raise APIError(400, 'response_format needs a type: {"type": "text" | "json_object" | "json_schema", ...}',
                           param="response_format.type", code="missing_required_parameter")
        kind = fmt["type"]
        schema, json_object = None, False
        if kind == "json_object":
            json_object = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                               param="response_format", code="invalid_value")
        elif kind != "text":
            raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                           param="response_format", code="invalid_value")
        asked = dict(json_schema=schema, json_object=json_object, regex=self.regex, grammar=self.grammar)
        vllm, name = self._vllm_grammar()
        if vllm and grammar_kinds(**asked):
            raise APIError(400, f"{name} and {self._own_grammar_field()} both constrain the output; give one",
                           param=name, code="invalid_value")
        try:
            return grammar_for(**(vllm or asked))
        except InputError as e:
            raise APIError(400, str(e), param=self.grammar_field(), code="invalid_value") from None

    def grammar_field(self) -> str:
        """The request field the output grammar comes from (what a 400 about it names)."""
        if self.regex is not None or self.grammar is not None:
            return self._own_grammar_field()
        return next((k for k in VLLM_GRAMMARS if getattr(self, k) is not None), "response_format")

    def _own_grammar_field(self) -> str:
        """This server's own field of the output grammar: regex, grammar, else response_format."""
        return "regex" if self.regex is not None else "grammar" if self.grammar is not None else "response_format"

    def _resolve(self, limits: Limits, defaults: dict[str, Any], max_tokens: int | None, max_tokens_field: str,
                 default_max_tokens: int, seed: int | None, stop, stream_options) -> Sampling:
        self._refuse_vllm()
        if stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true; drop it or stream the response",
                           param="stream_options", code="invalid_value")
        if seed is None and self.temperature == 0:
            seed = 0  # temperature 0 asks for the same answer every time: the seed fixes it (see _IGNORED)
        n = default_max_tokens if max_tokens is None else max_tokens
        if n > limits.max_tokens:
            raise APIError(400, f"{max_tokens_field}={n} exceeds this server's limit of {limits.max_tokens}; "
                           "lower it", param=max_tokens_field, code="invalid_value")
        kw: dict[str, Any] = {"max_new_tokens": n}
        if self.ignore_eos:  # no stop id: the output runs to max_tokens
            kw["eos_token_id"] = []
        names = {"max_new_tokens": max_tokens_field}
        for k in ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                  "confidence_threshold"):
            v = getattr(self, k)
            if v is not None:
                kw[k] = v
        if self.steps is not None:
            if self.max_denoising_steps is not None and self.max_denoising_steps != self.steps:
                raise APIError(400, "give either steps or max_denoising_steps, not both", param="steps")
            try:
                kw.update(steps_sampling(self.steps, kw))
            except InputError as e:
                raise APIError(400, str(e), param="steps", code="invalid_value") from None
            names["max_denoising_steps"] = "steps"
        if kw.get("max_denoising_steps", 0) > limits.max_steps:
            raise APIError(400, f"{names.get('max_denoising_steps', 'max_denoising_steps')} exceeds this "
                           f"server's limit of {limits.max_steps} steps per canvas",
                           param=names.get("max_denoising_steps", "max_denoising_steps"), code="invalid_value")
        try:
            cfg = GenerationConfig.resolve(defaults, **kw)
        except SamplingError as e:
            m = re.search(r"invalid (\w+)", str(e))
            param = names.get(m.group(1), m.group(1)) if m else None
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return Sampling(cfg=cfg, max_tokens=n, seed=seed, stop=stops,
                        budget_field=None if max_tokens is None else max_tokens_field,
                        include_usage=bool(stream_options and stream_options.include_usage),
                        include_drafts=bool(stream_options and stream_options.include_drafts), n=self.n,
                        logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                        ignore_eos=bool(self.ignore_eos))


def _refuse_unsupported(req, limits: Limits) -> None:
    if req.n > limits.max_choices:
        raise APIError(400, f"n={req.n} exceeds this server's limit of {limits.max_choices} choices per request",
                       param="n", code="invalid_value")


_StopStr = Annotated[str, Field(min_length=1, max_length=256)]
_Stop = Union[_StopStr, Annotated[list[_StopStr], Field(max_length=4)], None]


def _stop_field():
    return Field(None, description="up to 4 strings; generation ends before the first one")


# ----------------------------------------------------------------------------- chat completions


class ChatTemplateKwargs(BaseModel):
    model_config = _STRICT
    enable_thinking: bool | None = None


# OpenAI's reasoning effort levels (its client's `ReasoningEffort`); anything but none / minimal turns thinking on
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class _ChatFields(_Request):
    """OpenAI's chat-completions fields that this server uses, in OpenAI's order."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = Field(None, description="the served model's id (default: the served model)")
    max_completion_tokens: PosInt | None = None
    max_tokens: PosInt | None = None
    n: Annotated[PosInt, _null_is(1)] = Field(1, description="choices; choice i samples with seed + i")
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)] | None = None
    reasoning_effort: Effort | None = None
    seed: SeedInt | None = None
    stop: _Stop = _stop_field()
    stream: Annotated[bool, _null_is(False)] = False
    parallel_tool_calls: bool | None = Field(None, description="false: the reply holds at most one tool call (the "
                                             "first)")
    stream_options: StreamOptions | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    tools: list[Tool] | None = Field(None, max_length=128)
    user: str | None = Field(None, max_length=256)
    # refused with a 400 naming them (a client that sends them expects what this server does not do)
    functions: list[Any] | None = Field(None, description="refused: OpenAI's deprecated form of tools")
    function_call: Any = Field(None, description="refused: OpenAI's deprecated form of tool_choice")
    modalities: list[str] | None = Field(None, description='["text"] only')
    audio: dict[str, Any] | None = Field(None, description="refused: text output only")


class ChatCompletionRequest(_DiffusionKnobs, _ChatFields):
    """POST /v1/chat/completions: OpenAI's fields, then the blockpress extensions."""

    chat_template_kwargs: ChatTemplateKwargs | None = None
    # vLLM's prompt fields: the last message continued (a prefilled reply), or no generation prompt at all
    continue_final_message: bool = Field(False, description="vLLM: the prompt ends inside the last message, which "
                                         "the reply continues (leave add_generation_prompt out or false)")
    add_generation_prompt: bool | None = Field(None, description="vLLM: false renders no opening of the reply's turn")
    chat_template: str | None = Field(None, description="vLLM: refused; the server renders the model's own template")

    @property
    def generation_prompt(self) -> bool:
        """Whether the prompt ends with the opening of the reply's turn (not where the last message is continued)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: the prompt "
                           "either continues the last message or opens a new turn", param="add_generation_prompt",
                           code="invalid_value")
        return not self.continue_final_message and self.add_generation_prompt is not False

    @property
    def enable_thinking(self) -> bool:
        if self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking is not None:
            return self.chat_template_kwargs.enable_thinking
        return self.reasoning_effort not in (None, "none", "minimal")

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call, as the chat template declares them: none when tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        names = [t.function.name for t in self.tools]
        twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
        if twice is not None:  # a call names its tool: which of the two would it call?
            first, second = [k for k, n in enumerate(names) if n == twice][:2]
            raise APIError(400, f"tools {first} and {second} are both named {twice!r}: a call names the tool it "
                           "calls; give each tool its own name", param=f"tools.{second}.function.name",
                           code="invalid_value")
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forced_tool(self) -> str | None:
        """The tool call `tool_choice` demands: None (the model decides), "" (any tool: "required", or the
        only tool), or a tool's name (a named choice). A choice that names no offered tool is a 400."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise APIError(400, f"tool_choice {json.dumps(choice)} needs tools; offer at least one in 'tools'",
                           param="tool_choice", code="invalid_value")
        if choice == "required":
            return names[0] if len(names) == 1 else ""
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}', param="tool_choice", code="invalid_value")
        if name not in names:
            raise APIError(400, f"tool_choice names the tool {name!r}, which is not in tools ({', '.join(names)})",
                           param="tool_choice", code="invalid_value")
        return name

    def to_sampling(self, limits: Limits, defaults: dict[str, Any]) -> Sampling:
        _ = self.forced_tool  # validate tool_choice against tools before any work
        if len(self.messages) > limits.max_messages:
            raise APIError(400, f"{len(self.messages)} messages exceed this server's limit of {limits.max_messages}; "
                           "drop older turns", param="messages", code="too_many_messages")
        _refuse_unsupported(self, limits)
        if self.chat_template is not None:  # (a template from the request would change the prompt, so not dropped)
            raise APIError(400, "chat_template is not supported: the server renders the model's own template; leave "
                           "it out", param="chat_template", code="unsupported_value")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} (OpenAI's deprecated form) is not supported; send the functions as "
                               "tools (and function_call as tool_choice)", param=name, code="unsupported_parameter")
        if self.audio is not None or any(m != "text" for m in self.modalities or []):
            raise APIError(400, 'only text output is supported: drop audio and ask for modalities ["text"]',
                           param="audio" if self.audio is not None else "modalities", code="unsupported_value")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true (the alternatives come with each token's own "
                           "log-probability)", param="top_logprobs", code="invalid_value")
        field_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        n = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        default = limits.default_max_tokens or min(limits.max_tokens, defaults.get("max_new_tokens")
                                                   or REFERENCE_DEFAULTS["max_new_tokens"])
        sampling = self._resolve(limits, defaults, n, field_name, default, self.seed, self.stop, self.stream_options)
        sampling.logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling.one_call = self.parallel_tool_calls is False
        # (beside tools that ask for a grammar: serving.tool_call_grammar)
        sampling.grammar, sampling.grammar_param = self.output_grammar(), self.grammar_field()
        return sampling


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = Field(None, description="absent when the model called no tool")

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler):
        out = handler(self)
        if self.tool_calls is None:  # as OpenAI: no `tool_calls` key (clients branch on its presence)
            out.pop("tool_calls", None)
        return out


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str = Field(description="the text this token contributes to `content` (joined: the content)")
    logprob: float
    bytes: list[int] | None = Field(None, description="the token's own UTF-8 bytes")
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """With `logprobs: true`: one entry per token of `content` (see the module docstring for what they mean)."""
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens whose keys and values the prefix cache held (not encoded)")
    cache_write_tokens: int = Field(0, description="prompt tokens this request put in the prefix cache")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(0, description="tokens of the reasoning text (its re-encoded length)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)
    denoising_steps: int = Field(description="blockpress: decoder passes spent on this request")
    tokens_per_forward: float = Field(description="blockpress: completion tokens per decoder pass")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkToolCall(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`data: <chunk>`)."""
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = Field(None, description="the last chunk, with stream_options.include_usage")
    blockpress: dict[str, Any] | None = Field(None, description="blockpress: a draft or commit frame, with "
                                              "stream_options.include_drafts (choices is empty then)")


# ----------------------------------------------------------------------------- completions


_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]
# one prompt may be "" (insert mode fills the text before the suffix; to_sampling refuses it without a suffix)
_Prompt = Union[str, _TokenIds, Annotated[list[_Text], Field(min_length=1)],
                Annotated[list[_TokenIds], Field(min_length=1)]]


class _CompletionFields(_Request):
    """OpenAI's (legacy) completions fields that this server uses, in OpenAI's order."""

    model: str | None = Field(None, description="the served model's id (default: the served model)")
    prompt: _Prompt = Field(description="text, token ids, or a list of either (a batch: one choice per prompt)")
    suffix: str | None = Field(None, max_length=65536,
                               description="insert mode: the text after the completion; the model fills the "
                                           "max_tokens-token hole between prompt and suffix, seeing both")
    max_tokens: PosInt | None = Field(None, description="default: the server's --max-new-tokens, else 16")
    n: Annotated[PosInt, _null_is(1)] = Field(1, description="choices per prompt; choice i samples with seed + i")
    best_of: PosInt | None = None
    echo: Annotated[bool, _null_is(False)] = False
    logprobs: Annotated[int, Field(ge=0, le=5), BeforeValidator(_integral)] | None = None
    seed: SeedInt | None = None
    stop: _Stop = _stop_field()
    stream: Annotated[bool, _null_is(False)] = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)


class CompletionRequest(_DiffusionKnobs, _CompletionFields):
    """POST /v1/completions: OpenAI's fields, then the blockpress extensions."""

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or the batch it lists."""
        p = self.prompt
        return p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def to_sampling(self, limits: Limits, defaults: dict[str, Any]) -> Sampling:
        _refuse_unsupported(self, limits)
        if len(self.prompts) > limits.max_prompts:
            raise APIError(400, f"{len(self.prompts)} prompts exceed this server's limit of {limits.max_prompts} per "
                           "request; split the batch", param="prompt", code="invalid_value")
        if self.best_of not in (None, 1, self.n):  # (best_of = n: all the n choices there are)
            raise APIError(400, f"best_of={self.best_of} is not supported (but equal to n): the server returns every "
                           "choice it generates, unranked; ask for n choices", param="best_of",
                           code="unsupported_value")
        if self.echo:
            raise APIError(400, "echo is not supported: the prompt is not repeated in the completion; prepend it "
                           "yourself", param="echo", code="unsupported_value")
        if self.prompt == "" and not self.suffix:
            raise APIError(400, "prompt is empty; give text to continue, or a suffix to fill the text before it "
                           "(insert mode)", param="prompt", code="invalid_value")
        default = limits.default_max_tokens or 16  # OpenAI's default for completions
        sampling = self._resolve(limits, defaults, self.max_tokens, "max_tokens", default, self.seed, self.stop,
                                 self.stream_options)
        sampling.logprobs = self.logprobs
        sampling.grammar, sampling.grammar_param = self.output_grammar(), self.grammar_field()
        if sampling.grammar is not None and self.suffix:
            raise APIError(400, "response_format (or regex / grammar) and suffix (insert mode) cannot be combined",
                           param="response_format", code="invalid_value")
        return sampling


class CompletionLogprobs(BaseModel):
    """With `logprobs: k`: one entry per token of `text` (see the module docstring for what they mean)."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (`data: <chunk>`)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="the last chunk, with stream_options.include_usage")
    blockpress: dict[str, Any] | None = Field(None, description="blockpress: a draft or commit frame, with "
                                              "stream_options.include_drafts (choices is empty then)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ----------------------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(0, description="when the server loaded the model (Unix seconds)")
    owned_by: str = "blockpress"
    max_model_len: int | None = Field(None, description="positions a request may use, prompt and output together "
                                      "(vLLM's field)")
    canvas_length: int = Field(description="blockpress: tokens per canvas")
    chat: bool = Field(True, description="blockpress: the model has its own chat template (else: a text model, "
                                         "use /v1/completions)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
