"""Chat-template rendering (jinja2, sandboxed) and the built-in Gemma 4 chat template.

Job: turn OpenAI-style `messages` (+ optional `tools`) into the prompt text a checkpoint expects.

Invariants:
- Templates run in an immutable sandboxed jinja2 environment configured like Hugging Face's
  `apply_chat_template`: `trim_blocks`, `lstrip_blocks`, the loop-controls extension, a `tojson`
  filter (non-ASCII kept), and the globals `raise_exception(msg)` and `strftime_now(fmt)`.
- Variables passed to every template: `messages`, `tools` (None when absent),
  `add_generation_prompt`, `enable_thinking`, `bos_token`, `eos_token`, plus any extra keyword
  arguments of `render_chat_template` (e.g. `empty_thought_block`).
- Messages are normalised before rendering: `content` given as a list of `{"type": "text"}` parts
  stays a list of plain text parts (the template renders each), `None` becomes "", `developer` is treated as
  `system`, and
  `tool_calls[*].function.arguments` given as a JSON string is parsed into a mapping (the Gemma 4
  format writes arguments in its own notation, which a template can only produce from a mapping).
  Bad input raises `InputError`; a template that fails to compile raises `CheckpointError`; a
  template that calls `raise_exception` raises `InputError` with the template's message.
- `DEFAULT_GEMMA4_TEMPLATE` is our own template text. The exact Hub `chat_template.jinja` of
  google/diffusiongemma-26B-A4B-it was not available to us; this template reproduces the
  documented Gemma 4 turn format and the publicly documented
  Gemma 4 tool notation. A checkpoint's own `chat_template.jinja` is always preferred over it.

Default template output (`Q` = the quote token `<|"|>`):

    <bos>[<|turn>system\\n[<|think|>\\n]SYSTEM TEXT[<|tool>declaration:NAME{...}<tool|>...]<turn|>\\n]
    <|turn>user\\nTEXT<turn|>\\n
    <|turn>model\\nTEXT[<|tool_call>call:NAME{key:value,...}<tool_call|>...]
        [<|tool_response>response:NAME{value:Q...Q}<tool_response|>...]...<turn|>\\n
    <|turn>model\\n[<|channel>thought\\n<channel|>]          (generation prompt)

- The system turn appears when there is a leading system message, tools, or thinking is on.
- Argument values use the Gemma notation: strings `Q...Q`, booleans `true`/`false`, `null`,
  numbers bare, mappings `{key:value,...}` with bare keys in sorted order, lists `[a,b]`.
- Tool declarations use the same notation over the OpenAI function schema (`description`,
  `parameters` with sorted `properties`, `required`, upper-cased `type`).
- A model turn that ends in tool calls stays open: the tool results are appended to it and the
  next assistant message continues it; the turn is closed by the next user/system message, by
  the end of the conversation when `add_generation_prompt` is false, and is left open (the model
  continues after the tool results) when `add_generation_prompt` is true.
- The generation prompt ends with the empty, closed thought block `<|channel>thought\\n<channel|>`
  when thinking is disabled and the template variable `empty_thought_block` is true (the default;
  this reproduces the Hub revision tested by lablup/mlxcel). Pass `empty_thought_block=False`
  to reproduce the later revision that no longer appends it.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import CheckpointError, InputError

__all__ = [
    "DEFAULT_GEMMA4_TEMPLATE",
    "compile_chat_template",
    "normalize_messages",
    "normalize_tools",
    "render_chat_template",
]

# Our own template (see module docstring). Kept as compact one-statement lines so that
# trim_blocks / lstrip_blocks cannot introduce stray whitespace.
DEFAULT_GEMMA4_TEMPLATE = r"""{#- blockpress default Gemma 4 chat template (reproduces the documented format) -#}
{%- macro gvalue(v) -%}
{%- if v is none -%}null
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is mapping -%}{{ '{' }}{%- for k, item in v | dictsort -%}{{ ',' if not loop.first else '' }}{{ k }}:{{ gvalue(item) }}{%- endfor -%}{{ '}' }}
{%- elif v is iterable -%}[{%- for item in v -%}{{ ',' if not loop.first else '' }}{{ gvalue(item) }}{%- endfor -%}]
{%- else -%}{{ v }}
{%- endif -%}
{%- endmacro -%}
{%- macro gtype(t) -%}
{%- if t is string -%}<|"|>{{ t | upper }}<|"|>
{%- elif t is iterable -%}[{%- for x in t -%}{{ ',' if not loop.first else '' }}<|"|>{{ x | upper }}<|"|>{%- endfor -%}]
{%- else -%}{{ gvalue(t) }}
{%- endif -%}
{%- endmacro -%}
{%- macro gschema(s) -%}
{%- set parts = [] -%}
{%- if s.description is defined and s.description -%}{%- set parts = parts + ['description:' ~ gvalue(s.description)] -%}{%- endif -%}
{%- if s.enum is defined and s.enum -%}{%- set parts = parts + ['enum:' ~ gvalue(s.enum)] -%}{%- endif -%}
{%- if 'items' in s and s['items'] is mapping -%}{%- set parts = parts + ['items:' ~ gschema(s['items'])] -%}{%- endif -%}
{%- if s.nullable is defined and s.nullable -%}{%- set parts = parts + ['nullable:true'] -%}{%- endif -%}
{%- if s.properties is defined and s.properties is mapping -%}{%- set parts = parts + ['properties:' ~ gprops(s.properties)] -%}{%- endif -%}
{%- if s.required is defined and s.required -%}{%- set parts = parts + ['required:' ~ gvalue(s.required)] -%}{%- endif -%}
{%- if s.type is defined and s.type -%}{%- set parts = parts + ['type:' ~ gtype(s.type)] -%}{%- endif -%}
{{ '{' }}{{ parts | join(',') }}{{ '}' }}
{%- endmacro -%}
{%- macro gprops(props) -%}
{{ '{' }}{%- for k, p in props | dictsort -%}{{ ',' if not loop.first else '' }}{{ k }}:{{ gschema(p) if p is mapping else gvalue(p) }}{%- endfor -%}{{ '}' }}
{%- endmacro -%}
{%- macro gdeclaration(tool) -%}
{%- set f = tool.function if tool.function is defined else tool -%}
{%- set parts = ['description:' ~ gvalue(f.description if f.description is defined and f.description else '')] -%}
{%- if f.parameters is defined and f.parameters -%}{%- set parts = parts + ['parameters:' ~ gschema(f.parameters)] -%}{%- endif -%}
<|tool>declaration:{{ f.name }}{{ '{' }}{{ parts | join(',') }}{{ '}' }}<tool|>
{%- endmacro -%}
{%- macro gtext(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content | trim }}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text | trim }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set add_empty_thought = empty_thought_block is not defined or empty_thought_block -%}
{{ bos_token }}
{%- set first_is_system = messages | length > 0 and messages[0].role in ['system', 'developer'] -%}
{%- if first_is_system or thinking or tools -%}
<|turn>system{{ '\n' }}
{%- if thinking -%}<|think|>{{ '\n' }}{%- endif -%}
{%- if first_is_system -%}{{ gtext(messages[0].content) }}{%- endif -%}
{%- if tools -%}{%- for tool in tools -%}{{ gdeclaration(tool) }}{%- endfor -%}{%- endif -%}
<turn|>{{ '\n' }}
{%- endif -%}
{%- set ns = namespace(open=false, calls=[], n_resp=0) -%}
{%- for message in messages -%}
{%- if loop.first and first_is_system -%}
{%- elif message.role == 'assistant' -%}
{%- if not ns.open -%}<|turn>model{{ '\n' }}{%- endif -%}
{{ gtext(message.content) }}
{%- if message.tool_calls is defined and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
<|tool_call>call:{{ fn.name }}{{ gvalue(fn.arguments) if fn.arguments is mapping else (fn.arguments if fn.arguments is defined and fn.arguments else '{}') }}<tool_call|>
{%- endfor -%}
{%- set ns.open = true -%}{%- set ns.calls = message.tool_calls -%}{%- set ns.n_resp = 0 -%}
{%- else -%}
<turn|>{{ '\n' }}
{%- set ns.open = false -%}
{%- endif -%}
{%- elif message.role == 'tool' -%}
{%- if not ns.open -%}<|turn>model{{ '\n' }}{%- set ns.open = true -%}{%- endif -%}
{%- set rs = namespace(name=message.name if message.name is defined and message.name else '') -%}
{%- if not rs.name -%}
{%- for call in ns.calls -%}
{%- if message.tool_call_id is defined and call.id is defined and call.id == message.tool_call_id -%}{%- set rs.name = (call.function if call.function is defined else call).name -%}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if not rs.name and ns.n_resp < ns.calls | length -%}{%- set rs.name = (ns.calls[ns.n_resp].function if ns.calls[ns.n_resp].function is defined else ns.calls[ns.n_resp]).name -%}{%- endif -%}
<|tool_response>response:{{ rs.name }}{{ gvalue(message.content) if message.content is mapping else '{value:' ~ gvalue(gtext(message.content)) ~ '}' }}<tool_response|>
{%- set ns.n_resp = ns.n_resp + 1 -%}
{%- else -%}
{%- if ns.open -%}<turn|>{{ '\n' }}{%- set ns.open = false -%}{%- endif -%}
<|turn>{{ 'system' if message.role == 'developer' else message.role }}{{ '\n' }}{{ gtext(message.content) }}<turn|>{{ '\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{%- if not ns.open -%}
<|turn>model{{ '\n' }}
{%- if not thinking and add_empty_thought -%}<|channel>thought{{ '\n' }}<channel|>{%- endif -%}
{%- endif -%}
{%- elif ns.open -%}
<turn|>{{ '\n' }}
{%- endif -%}
"""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' mark of the assistant's tokens (for training
    masks), rendered here as its body, so templates that use it work."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox, also bounding what `*` and `**` make: `'x' * 10**10` in a damaged template took the process's
    memory (the sandbox bounds `range` alone)."""

    intercepted_binops = frozenset({"*", "**"})
    LIMIT = 10 ** 7  # items of a repeated string or list; digits of a power, roughly

    def call_binop(self, context, operator, left, right):
        seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
        if operator == "*" and isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > self.LIMIT:
            raise jinja2.sandbox.SecurityError(f"a repeat of {len(seq) * n} items is too long for a prompt")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                right * max(abs(left), 2).bit_length() > 4 * self.LIMIT:
            raise jinja2.sandbox.SecurityError("a power too large for a prompt")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile (and cache) a chat template; a syntax error raises CheckpointError."""
    if not isinstance(template, str) or not template.strip():
        raise CheckpointError("chat template is empty; put a valid chat_template.jinja in the checkpoint folder")
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise CheckpointError(
            f"chat template has a syntax error at line {exc.lineno}: {exc.message}; "
            "fix or remove chat_template.jinja") from None


def _plain(obj: Any) -> Any:
    """Pydantic models and other objects with model_dump() become plain dicts."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    return obj


def _text_content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A string (None: ""), or a list of text parts as plain `{"type": "text", "text": ...}` dicts: a template
    renders each part itself (the built-in one trims each), as under transformers."""
    content = _plain(content)
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            part = _plain(part)
            if isinstance(part, str):
                texts.append({"type": "text", "text": part})
                continue
            if not isinstance(part, Mapping):
                raise InputError(f"{where} has a content part of type {type(part).__name__}; send text parts as {{\"type\": \"text\", \"text\": ...}}")
            if part.get("type", "text") != "text":
                raise InputError(f"{where} has a '{part.get('type')}' content part; this engine accepts text only, remove it")
            texts.append({"type": "text", "text": str(part.get("text") or "")})
        return texts
    raise InputError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}; send a string")


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"{text} is out of range")
    return value


def _parse_arguments(arguments: Any, where: str) -> Any:
    arguments = _plain(arguments)
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:  # NaN / Infinity are Python's, not JSON; an integer past 4300 digits is a ValueError of its own
            value = json.loads(arguments, parse_constant=_not_json, parse_float=_finite)
            json.dumps(value, ensure_ascii=False).encode()  # a lone surrogate written as an escape ("\\ud800")
        except UnicodeEncodeError:
            raise InputError(f"{where}.function.arguments holds a lone surrogate (an escape such as \\ud800 without "
                             "its pair); send valid Unicode") from None
        except (ValueError, RecursionError):
            raise InputError(f"{where}.function.arguments is not valid JSON; send the arguments as a JSON object string") from None
        if not isinstance(value, dict):
            raise InputError(f"{where}.function.arguments must encode a JSON object, got {type(value).__name__}; wrap the values in an object")
        return value
    raise InputError(f"{where}.function.arguments must be a JSON object string, got {type(arguments).__name__}; send a JSON string")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages and return plain dicts ready for a template.

    Raises InputError naming the offending message for anything a template cannot render.
    """
    messages = _plain(messages)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError("messages must be a list of {\"role\": ..., \"content\": ...} objects; wrap the prompt in a list")
    if not messages:
        raise InputError("messages is empty; give at least one message")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        msg = _plain(raw)
        if not isinstance(msg, Mapping):
            raise InputError(f"{where} must be an object with 'role' and 'content', got {type(msg).__name__}; fix the request")
        role = msg.get("role")
        if role not in _ROLES:
            raise InputError(f"{where}.role is {role!r}; use one of {', '.join(_ROLES)}")
        norm: dict[str, Any] = {k: _plain(v) for k, v in msg.items()}
        norm["role"] = "system" if role == "developer" else role
        content = msg.get("content")
        if role == "tool" and isinstance(_plain(content), Mapping):
            norm["content"] = dict(_plain(content))
        else:
            norm["content"] = _text_content(content, where)
        calls = msg.get("tool_calls")
        if calls:
            if role != "assistant":
                raise InputError(f"{where} has tool_calls but role {role!r}; only assistant messages carry tool_calls")
            norm_calls = []
            for j, call in enumerate(_plain(calls)):
                cwhere = f"{where}.tool_calls[{j}]"
                call = _plain(call)
                if not isinstance(call, Mapping):
                    raise InputError(f"{cwhere} must be an object with 'function'; fix the request")
                fn = _plain(call.get("function", call))
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
                    raise InputError(f"{cwhere}.function.name is missing; give every tool call a function name")
                norm_call = {k: _plain(v) for k, v in call.items()}
                norm_call["type"] = call.get("type", "function")
                norm_call["function"] = {"name": fn["name"], "arguments": _parse_arguments(fn.get("arguments"), cwhere)}
                norm_calls.append(norm_call)
            norm["tool_calls"] = norm_calls
        else:
            norm.pop("tool_calls", None)
        out.append(norm)
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Validate OpenAI tools; bare function schemas are wrapped as {"type": "function", ...}."""
    tools = _plain(tools)
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InputError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects; wrap them in a list")
    out = []
    for i, tool in enumerate(tools):
        tool = _plain(tool)
        if not isinstance(tool, Mapping):
            raise InputError(f"tools[{i}] must be an object; send {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = _plain(tool.get("function")) if "function" in tool else tool
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
            raise InputError(f"tools[{i}].function.name is missing; give every tool a name")
        fn = {k: _plain(v) for k, v in fn.items()}
        out.append({"type": tool.get("type", "function"), "function": fn})
    return out or None


def render_chat_template(template: str, messages: Any, *, add_generation_prompt: bool = True,
                         enable_thinking: bool = False, tools: Any = None,
                         bos_token: str = "<bos>", eos_token: str = "<eos>",
                         continue_final_message: bool = False, **template_kwargs: Any) -> str:
    """Render `template` for `messages`; returns the prompt text (special tokens as text).

    Extra keyword arguments become template variables (e.g. `empty_thought_block=False`; the tokenizer passes
    its `pad_token` and `unk_token` too). continue_final_message: the text ends where the last message's text
    ends, without the generation prompt, so the model continues that message (a reply started for it); as
    transformers does, the last text is found in the rendering with its edges trimmed.
    """
    compiled = compile_chat_template(template)
    variables = dict(template_kwargs)
    normalized = normalize_messages(messages)
    variables.update(
        messages=normalized,
        tools=normalize_tools(tools),
        add_generation_prompt=bool(add_generation_prompt) and not continue_final_message,
        enable_thinking=bool(enable_thinking),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        text = compiled.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise InputError(f"chat template rejected the conversation: {_first_line(exc)}; fix the messages") from None
    except Exception as exc:  # noqa: BLE001 - whatever the template's code raised (ZeroDivisionError, a recursion,
        # the sandbox's OverflowError for a huge range): one line, as every error from rendering
        raise InputError(f"chat template failed on this conversation ({type(exc).__name__}: {_first_line(exc)}); "
                         "check the message fields the template expects, or fix the template") from None
    return _continued(text, normalized[-1]) if continue_final_message else text


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def _continued(text: str, last: dict[str, Any]) -> str:
    """The rendering cut after the last message's text (its last text part), edges trimmed."""
    content = last.get("content")
    if not isinstance(content, str):
        content = next((p["text"] for p in reversed(content or []) if isinstance(p, Mapping) and "text" in p), "")
    final = content.strip()
    if not final or final not in text:
        raise InputError("continue_final_message: the last message's text is not in the rendered prompt (or it is "
                         "empty); end the conversation with the message to continue, with text in it")
    return text[:text.rindex(final) + len(final)]
