"""Parse generated Gemma 4 text into OpenAI-style fields: content, reasoning, tool calls.

Job: the engine decodes the generated ids WITHOUT skipping special tokens; this module splits
that text into `reasoning` (thought channel), `content` and `tool_calls`, either at once
(`parse_output`) or incrementally while streaming (`StreamingParser`).

Grammar handled (Gemma 4 output format):
- `<|channel>NAME\\n ... <channel|>`: a channel block. NAME `thought` (or any name other than
  final/answer/response/content) goes to `reasoning`; the header line is dropped. An unclosed
  block (generation cut by length) is reasoning to the end.
- `<|tool_call>call:NAME{key:value,...}<tool_call|>`: a tool call. Arguments use Gemma's notation
  (bare keys, strings wrapped in `<|"|>`...`<|"|>`, also JSON strings/keys, numbers, true/false/null,
  nested `{}`/`[]`) and are normalised to a JSON object string. A call that does not parse (or is
  unterminated before a stop) is kept as text, minus its control tokens, instead of raising; one the token
  budget cut (finish reason "length") is dropped. Inside the thought channel a call is thought, not called:
  its text stays reasoning (the model calls tools after `<channel|>`).
- Control tokens are read from text decoded with `Tokenizer.decode(marked=True)` (`parse_reply`): there an
  ordinary token's "<" is `TEXT_LT`, so only a control token's own id spells control-token text, and the
  fields come out with "<" again (`unmark`). Plain text works too: then any control-token text counts.
- Stop tokens `<turn|>`, `<eos>`, `<|tool_response>` end the output: anything after the first one
  is dropped (it is padding or hallucinated continuation).
- `<|turn>ROLE\\n` (a hallucinated turn header) is dropped with its role line.
- Every other control token (`<pad>`, `<bos>`, `<|think|>`, `<|tool>`, `<tool|>`,
  `<tool_response|>`, image tokens, stray closers, ...) is removed; a stray `<|"|>` outside a tool
  call becomes a plain `"`. Control-token text therefore never reaches the user.

Invariants:
- `StreamingParser` never emits part of a control token: a tail that could still grow into one is
  held back until it is resolved (or emitted as text by `finish`).
- For any split of a text into deltas, the concatenated streaming deltas (reasoning and content)
  equal the non-streaming `parse_output` fields (`reasoning or ""`), and the tool calls are equal;
  `parse_output` is the streaming parser fed the whole text in one delta.
- Tool calls are reported once, by `finish`; `finish_reason` is "tool_calls" when there is at
  least one call, else the reason passed in ("stop" / "length").
- With `track_sources=True`, `content_sources[k]` is the offset in the fed text of the character that content
  character k came from (a `<|"|>` turned into `"`: the token's start), nondecreasing; `resolved` is the offset
  before which the fed text is decided (what is after it is held back). The server aligns logprobs with it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .tokenizer import GEMMA4_CONTROL_TOKENS, TEXT_LT

__all__ = [
    "ParsedOutput",
    "STOP_TOKENS",
    "StreamDelta",
    "StreamEnd",
    "StreamingParser",
    "ToolCall",
    "parse_gemma_arguments",
    "parse_output",
]

QUOTE = '<|"|>'
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TURN_OPEN = "<|turn>"
STOP_TOKENS: tuple[str, ...] = ("<turn|>", "<eos>", "<|tool_response>")
CONTENT_CHANNELS = frozenset({"final", "answer", "response", "content"})


def unmark(text: str) -> str:
    """Text decoded with `Tokenizer.decode(marked=True)` back to plain text (a no-op on plain text)."""
    return text.replace(TEXT_LT, "<")


def call_ban(tokenizer, tools) -> list[int] | None:
    """The tokens a chat reply may not hold when no tool is offered (`tools` empty or None, as after tool_choice
    "none"): the opening of a tool call, so the model answers instead of calling a tool nobody declared (an
    OpenAI reply has tool_calls only for offered tools). None where tools are offered or the tokenizer has no
    such token. Generation takes it as `suppress_tokens` (engine/constraint.py's TokenBan)."""
    if tools or tokenizer is None:
        return None
    i = tokenizer.token_to_id(CALL_OPEN)
    return None if i is None else [i]


_HEADER_CHARS = re.compile(r"[A-Za-z0-9_\-]*")
_MAX_HEADER = 32
_CALL_RE = re.compile(r"\s*call:\s*([^\s{}<>]+)\s*(\{.*\})\s*", re.DOTALL)
_NUMBER_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _new_call_id(index: int) -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One parsed call; `arguments_json` is a JSON object string."""

    id: str
    name: str
    arguments_json: str

    @property
    def arguments(self) -> dict[str, Any]:
        return json.loads(self.arguments_json)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions `tool_calls[i]` object."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"


@dataclass
class StreamDelta:
    """Text newly available from one `feed` (either part may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass
class StreamEnd:
    """What `finish` returns: the last text deltas plus the tool calls and finish reason."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str


# --------------------------------------------------------------------------- arguments
class _ArgsSyntaxError(ValueError):
    pass


class _ArgParser:
    """Recursive-descent parser for Gemma's argument notation (lenient superset of JSON)."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def fail(self, what: str) -> None:
        raise _ArgsSyntaxError(f"{what} at offset {self.i}")

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def quoted(self) -> str:
        start = self.i + len(QUOTE)
        end = self.s.find(QUOTE, start)
        if end < 0:
            self.fail("unterminated <|\"|> string")
        self.i = end + len(QUOTE)
        return self.s[start:end]

    def json_string(self) -> str:
        try:
            value, end = json.JSONDecoder().raw_decode(self.s, self.i)
        except json.JSONDecodeError:
            self.fail("bad JSON string")
        if not isinstance(value, str):
            self.fail("expected a string")
        self.i = end
        return value

    def value(self) -> Any:
        self.ws()
        if self.s.startswith(QUOTE, self.i):
            return self.quoted()
        c = self.peek()
        if c == '"':
            return self.json_string()
        if c == "{":
            return self.obj()
        if c == "[":
            return self.arr()
        start = self.i
        while self.i < len(self.s) and self.s[self.i] not in ",}]":
            self.i += 1
        raw = self.s[start:self.i].strip()
        if not raw or "<|" in raw or "|>" in raw or any(ch in raw for ch in "{[:"):
            self.i = start
            self.fail("expected a value")
        if raw in ("true", "True"):
            return True
        if raw in ("false", "False"):
            return False
        if raw in ("null", "None"):
            return None
        if _NUMBER_RE.fullmatch(raw):
            return _number(raw)
        return raw  # lenient: an unquoted word is a string

    def key(self) -> str:
        self.ws()
        if self.s.startswith(QUOTE, self.i):
            return self.quoted()
        if self.peek() == '"':
            return self.json_string()
        start = self.i
        while self.i < len(self.s) and self.s[self.i] not in ":,{}[]<>\"":
            self.i += 1
        raw = self.s[start:self.i].strip()
        if not raw:
            self.fail("expected a key")
        return raw

    def obj(self) -> dict[str, Any]:
        self.i += 1  # {
        out: dict[str, Any] = {}
        self.ws()
        if self.peek() == "}":
            self.i += 1
            return out
        while True:
            k = self.key()
            self.ws()
            if self.peek() != ":":
                self.fail("expected ':'")
            self.i += 1
            out[k] = self.value()
            self.ws()
            c = self.peek()
            if c == ",":
                self.i += 1
                self.ws()
                if self.peek() == "}":  # trailing comma
                    self.i += 1
                    return out
            elif c == "}":
                self.i += 1
                return out
            else:
                self.fail("expected ',' or '}'")

    def arr(self) -> list[Any]:
        self.i += 1  # [
        out: list[Any] = []
        self.ws()
        if self.peek() == "]":
            self.i += 1
            return out
        while True:
            out.append(self.value())
            self.ws()
            c = self.peek()
            if c == ",":
                self.i += 1
                self.ws()
                if self.peek() == "]":
                    self.i += 1
                    return out
            elif c == "]":
                self.i += 1
                return out
            else:
                self.fail("expected ',' or ']'")


class _Float(float):
    """A number parsed from a call's arguments, with the text it was written as: a float would turn 1e999 into
    `Infinity` (not JSON) and round 444444444444.44444 to 444444444444.44446."""
    raw: str


def _number(raw: str) -> int | float:
    value = json.loads(raw)
    if isinstance(value, int):  # exact in Python
        return value
    out = _Float(value)
    out.raw = raw
    return out


def arguments_json(value: Any) -> str:
    """JSON text of parsed arguments (`parse_gemma_arguments`), each number as it was written."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {arguments_json(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(arguments_json(v) for v in value) + "]"
    if isinstance(value, _Float):
        return value.raw
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def parse_gemma_arguments(text: str) -> dict[str, Any]:
    """Parse `{key:value,...}` in Gemma notation (or JSON) into a dict; ValueError if malformed."""
    p = _ArgParser(text)
    p.ws()
    if p.peek() != "{":
        p.fail("expected '{'")
    out = p.obj()
    p.ws()
    if p.i != len(p.s):
        p.fail("unexpected text after the arguments")
    return out


def _parse_call_body(body: str) -> tuple[str, str] | None:
    """`call:NAME{...}` -> (name, arguments_json), or None when malformed."""
    m = _CALL_RE.fullmatch(body)
    if m is None:
        return None
    try:
        args = parse_gemma_arguments(m.group(2))
    except ValueError:
        return None
    return m.group(1), arguments_json(args)


# --------------------------------------------------------------------------- streaming parser
_CONTENT, _REASONING, _HEADER, _CALL, _DONE = "content", "reasoning", "header", "call", "done"


class StreamingParser:
    """Incremental parser: `feed(delta) -> StreamDelta`, then `finish(reason) -> StreamEnd`.

    `starts_in_reasoning=True` when the prompt already opened a thought channel.
    `control_tokens` extends the built-in Gemma 4 list (e.g. with `Tokenizer.special_tokens`).
    `make_id(index)` builds tool-call ids (default: random `call_<24 hex>`).
    """

    def __init__(self, *, starts_in_reasoning: bool = False,
                 control_tokens: Iterable[str] | None = None,
                 stop_tokens: Iterable[str] = STOP_TOKENS,
                 make_id: Callable[[int], str] | None = None, track_sources: bool = False) -> None:
        self._stops = frozenset(stop_tokens)
        self._fed = 0  # characters fed so far (`_buf` is always a suffix of them)
        self.content_sources: list[int] | None = [] if track_sources else None
        tokens = set(GEMMA4_CONTROL_TOKENS) | set(control_tokens or ()) | self._stops
        tokens |= {QUOTE, CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, CALL_CLOSE}
        tokens.discard("")
        self._tokens = sorted(tokens, key=len, reverse=True)  # longest match first
        self._prefixes = frozenset(t[:k] for t in tokens for k in range(1, len(t)))
        self._max_len = max(len(t) for t in tokens)
        self._make_id = make_id or _new_call_id
        self._state = _REASONING if starts_in_reasoning else _CONTENT
        self._return = self._state  # state to go back to after a tool call
        self._buf = ""
        self._header = ""
        self._header_turn = False  # header after <|turn> (role line) rather than <|channel>
        self._call = ""
        self._calls: list[ToolCall] = []
        self.call_positions: list[int] = []  # per call: the content characters emitted before it
        self._content_chars = 0
        self._reason = "stop"  # the finish reason `finish` was given
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished: StreamEnd | None = None

    # ---------------------------------------------------------------- public API
    def feed(self, text: str) -> StreamDelta:
        if self._finished is not None:
            raise RuntimeError("StreamingParser.feed called after finish")
        self._buf += text
        self._fed += len(text)
        return self._run(final=False)

    def finish(self, finish_reason: str = "stop") -> StreamEnd:
        if self._finished is None:
            self._reason = finish_reason
            d = self._run(final=True)
            reason = "tool_calls" if self._calls else finish_reason
            self._finished = StreamEnd(d.reasoning, d.content, list(self._calls), reason)
        return self._finished

    @property
    def result(self) -> ParsedOutput:
        """Accumulated output; complete once `finish` has been called."""
        reasoning = "".join(self._reasoning)
        reason = self._finished.finish_reason if self._finished else "stop"
        return ParsedOutput(content="".join(self._content), reasoning=reasoning or None,
                            tool_calls=list(self._calls), finish_reason=reason)

    @property
    def resolved(self) -> int:
        """Offset in the fed text before which every character is decided (emitted, or dropped as markup)."""
        return self._fed - len(self._buf) - len(self._header) - len(self._call)

    # ---------------------------------------------------------------- internals
    def _emit(self, out: StreamDelta, text: str, state: str | None = None, src: int = 0,
              source: str | None = None) -> None:
        """src: offset in the fed text where `text` starts (text copied 1:1), or where `source` starts (text is
        `source` cleaned of control tokens)."""
        if not text:
            return
        text = unmark(text)
        if (state or self._state) == _REASONING:
            out.reasoning += text
            self._reasoning.append(text)
        else:
            out.content += text
            self._content.append(text)
            self._content_chars += len(text)
            if self.content_sources is not None:
                pos = list(range(src, src + len(text))) if source is None else self._clean_sources(source, src)
                pos = (pos + [pos[-1] if pos else src] * len(text))[:len(text)]
                self.content_sources += pos

    def _clean_sources(self, source: str, src: int) -> list[int]:
        """The offset of each character of `_clean(source)` (source starting at offset src)."""
        pos, j = [], 0
        while j < len(source):
            tok = self._match_at(source, j) if source[j] == "<" else None
            if tok is not None:
                if tok == QUOTE:
                    pos.append(src + j)
                j += len(tok)
            else:
                pos.append(src + j)
                j += 1
        return pos

    def _clean(self, text: str) -> str:
        """Text with control tokens removed (quote token -> '"'); used for malformed calls."""
        for t in self._tokens:
            if t in text:
                text = text.replace(t, '"' if t == QUOTE else "")
        return text

    def _match_at(self, s: str, p: int) -> str | None:
        for t in self._tokens:
            if s.startswith(t, p):
                return t
        return None

    def _run(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        while True:
            if self._state == _DONE:
                self._buf = ""
                return out
            if self._state == _HEADER:
                if not self._step_header(out, final):
                    return out
            elif self._state == _CALL:
                if not self._step_call(out, final):
                    return out
            elif not self._step_text(out, final):
                return out

    def _step_text(self, out: StreamDelta, final: bool) -> bool:
        """Content/reasoning: emit text up to the next control token. False = need more input."""
        buf = self._buf
        at = self._fed - len(buf)  # the offset of buf in the fed text
        p = buf.find("<")
        while p >= 0:
            if not final and len(buf) - p < self._max_len and buf[p:] in self._prefixes:
                self._emit(out, buf[:p], src=at)  # hold back: may still grow into a (longer) token
                self._buf = buf[p:]
                return False
            tok = self._match_at(buf, p)
            if tok is not None:
                self._emit(out, buf[:p], src=at)
                self._buf = buf[p + len(tok):]
                self._on_token(out, tok)
                return True
            p = buf.find("<", p + 1)
        self._emit(out, buf, src=at)
        self._buf = ""
        return False

    def _on_token(self, out: StreamDelta, tok: str) -> None:
        if tok in self._stops:
            self._state = _DONE
        elif tok == CHANNEL_OPEN:
            self._state, self._header, self._header_turn = _HEADER, "", False
        elif tok == TURN_OPEN:  # a turn header `ROLE\n` is dropped like the token itself
            self._return, self._state, self._header, self._header_turn = self._state, _HEADER, "", True
        elif tok == CHANNEL_CLOSE:
            if self._state == _REASONING:
                self._state = _CONTENT
        elif tok == CALL_OPEN and self._state != _REASONING:  # a call the model only thinks about stays thought
            self._return, self._state, self._call = self._state, _CALL, ""
        elif tok == QUOTE:
            self._emit(out, '"', src=self._fed - len(self._buf) - len(tok))
        # every other control token is dropped

    def _step_header(self, out: StreamDelta, final: bool) -> bool:
        """After <|channel> / <|turn>: read `NAME\\n`. Anything else means there was no header.

        Channel: NAME picks reasoning or content; without a header line the body is reasoning.
        Turn: the role line is dropped and parsing continues in the state before <|turn>.
        """
        buf = self._buf
        n = _HEADER_CHARS.match(buf).end()
        header = self._header + buf[:n]
        no_header_state = self._return if self._header_turn else _REASONING
        if len(header) > _MAX_HEADER:
            self._state, self._buf, self._header = no_header_state, header + buf[n:], ""
            return True
        if n < len(buf):
            if buf[n] == "\n":
                if self._header_turn:
                    self._state = self._return
                else:
                    self._state = _CONTENT if header.lower() in CONTENT_CHANNELS else _REASONING
                self._buf, self._header = buf[n + 1:], ""
            else:  # no header line: the text belongs to the body
                self._state, self._buf, self._header = no_header_state, header + buf[n:], ""
            return True
        self._header, self._buf = header, ""
        if final:  # cut inside the header line: drop the fragment
            self._state, self._header = no_header_state, ""
            return True
        return False

    def _step_call(self, out: StreamDelta, final: bool) -> bool:
        """Inside <|tool_call>: buffer until <tool_call|> (or a stop token / the end)."""
        start = max(0, len(self._call) - self._max_len)
        self._call += self._buf
        self._buf = ""
        call = self._call
        at = self._fed - len(call)  # the offset of call in the fed text
        end = call.find(CALL_CLOSE, start)
        stop_at, stop_tok = -1, None
        for t in self._stops:
            k = call.find(t, start)
            if k >= 0 and (stop_at < 0 or k < stop_at):
                stop_at, stop_tok = k, t
        if end >= 0 and (stop_at < 0 or end < stop_at):
            body, rest = call[:end], call[end + len(CALL_CLOSE):]
            parsed = _parse_call_body(body)
            self._state = self._return
            if parsed is None:
                self._emit(out, self._clean(body), src=at, source=body)
            else:
                self._calls.append(ToolCall(self._make_id(len(self._calls)), unmark(parsed[0]), unmark(parsed[1])))
                self.call_positions.append(self._content_chars)
            self._call, self._buf = "", rest
            return True
        if stop_at >= 0:  # unterminated call followed by a stop token: keep it as text
            self._state = self._return
            self._emit(out, self._clean(call[:stop_at]), src=at, source=call[:stop_at])
            self._call, self._buf = "", ""
            self._state = _DONE
            return True
        if final:  # unterminated at the end of generation: cut by the token budget it is dropped, half a call's
            self._state = self._return  # markup is no answer; else (the model stopped inside it) kept as text
            if self._reason != "length":
                self._emit(out, self._clean(call), src=at, source=call)
            self._call = ""
            return False
        return False


def parse_output(text: str, finish_reason: str = "stop", *, starts_in_reasoning: bool = False,
                 control_tokens: Iterable[str] | None = None,
                 make_id: Callable[[int], str] | None = None) -> ParsedOutput:
    """Parse a complete generation (decoded with special tokens kept)."""
    parser = StreamingParser(starts_in_reasoning=starts_in_reasoning,
                             control_tokens=control_tokens, make_id=make_id)
    parser.feed(text)
    parser.finish(finish_reason)
    return parser.result


def reply_parser(tokenizer, **kwargs) -> StreamingParser:
    """The parser of a model's reply, fed text decoded with `tokenizer.decode(ids, marked=True)` (or its stream
    decoder's `marked=True`): control tokens are the tokenizer's own special tokens and Gemma 4's."""
    return StreamingParser(control_tokens=tokenizer.special_tokens, **kwargs)


def parse_reply(tokenizer, ids, finish_reason: str = "stop", **kwargs) -> ParsedOutput:
    """A reply's token ids -> content, reasoning and tool calls, as the server reads them. Only the ids of control
    tokens split the reply: ordinary tokens that spell "<turn|>" or "<mask>" stay text."""
    return parse_output(tokenizer.decode(ids, marked=True), finish_reason, control_tokens=tokenizer.special_tokens,
                        **kwargs)
