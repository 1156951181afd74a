"""Structured output: a grammar (JSON Schema, any JSON object, a regular expression or a Lark grammar) that every
committed canvas obeys; and its simplest case without a grammar engine, tokens a row may not hold (`TokenBan`).

Shape legend: C canvas length, V vocab, k candidates per position.

The grammar engine is llguidance (`pip install blockpress[structured]`): it compiles the grammar for the model's
tokenizer and, in any state, gives the set of tokens that keep the text a prefix of a valid output (the mask),
with the stop ids allowed exactly where the output may end.

How a denoising step obeys it (`Constraint.walk`, once per step for each constrained row): the row's canvas is
read left to right from the grammar state after its committed tokens. At each position the step's argmax is
replaced by the most likely allowed token (the first of the position's top-k candidates the mask allows, else
the masked argmax over the whole vocabulary); then the state advances by that token. A drawn token the mask
does not allow is replaced by the walked one. So the argmax canvas, which is what a commit writes, is always a
valid prefix, and accepted tokens are consistent with it. The tokens the grammar forces from the row's state
(`compute_ff_tokens`: a forced tool call's `<|tool_call>call:NAME{key:`, a schema's `{"key":`) are written at the
canvas's first positions and count as certain, so the step accepts them at once (as infilling holds its given
tokens) and the model reads them from the next pass on, instead of denoising an answer the grammar then overrides.

The budget: the output has to close, and its stop id be written, within `max_new_tokens`. The walk carries a closing
path for its state: tokens after which the grammar may end. At each position it asks whether, after the chosen
token, a closing path still fits in the positions left; if not, it writes the first token of the current path
instead, and so on to the stop. The path after a token is a part of the current one wherever the grammar takes that
part after the token and may end there (`_rest`: its rest where the token is its first; the part after the tokens
whose text the token's spans, in a counted repetition; all of it, inside a string or a number; its head, where the
token wrote some of the rest); else that after up to three greedy tokens (a UTF-8 character's bytes, a bracket
closed); else it is made again from that state, looking no further than the positions left (`closing_path`: the
greedy path, forced tokens first, else the allowed token that closes soonest: quotes and closing brackets, then
commas, digits, letters, and last anything that opens a new structure; where that goes round, as in `[a-z]+x`, a
bounded search for a short path, `_search`). The commit keeps the path of the walk that wrote the canvas. A budget
too small for the shortest closing path found is refused up front, and so is a grammar for which none is found.

Cost, on the host, per position walked: one mask (the candidates tested against its bits in place; the whole
mask unpacked only where none is allowed) and a few validations of the closing path after the chosen token (no
mask); rarely a mask for each greedy token of a repair, or of a path made again. `Constraint.masks` counts them.
One host read per step of the top-k candidates; nothing for rows without a constraint. Across canvases the state
continues from the committed tokens (`advance`).
"""

from __future__ import annotations

import copy
import heapq
import importlib.util
import itertools
import json
import re
from functools import lru_cache
from itertools import takewhile

import torch

from ..errors import InputError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # one line, as json.dumps
TOP_K = 16  # candidates per position read from the device each step; the masked argmax covers the rest
_OPEN, _OTHER = 8, 9  # ranks of tokens that open a structure and of everything else (see _rank)


def structured_extra() -> bool:
    """Whether llguidance (the `structured` extra, the grammar engine) is installed: the one check of it."""
    return importlib.util.find_spec("llguidance") is not None


def _llguidance(need: str = "structured output needs", hint: str = ""):
    """The llguidance module, or an InputError "NEED llguidance: pip install ...HINT"."""
    if not structured_extra():
        raise InputError(f"{need} llguidance: pip install 'blockpress[structured]'{hint}")
    import llguidance

    return llguidance


def grammar_kinds(json_schema=None, json_object: bool = False, regex=None, grammar=None) -> list[str]:
    """Which of the output grammars are asked for (`{}`, the empty schema, is: any JSON value)."""
    return [n for n, v in (("json_schema", json_schema), ("json_object", json_object), ("regex", regex),
                           ("grammar", grammar)) if v is not None and v is not False]


def grammar_for(json_schema=None, json_object: bool = False, regex: str | None = None,
                grammar: str | None = None) -> str | None:
    """The llguidance grammar of one of: a JSON Schema (dict or JSON text), any JSON object, a regular expression,
    a Lark grammar. None when none is given; InputError when more than one is."""
    for name, v in (("regex", regex), ("grammar", grammar)):
        if v is not None and not (isinstance(v, str) and v.strip()):
            raise InputError(f"{name} must be a non-empty string, got {v!r}; leave it out for free text")
    given = grammar_kinds(json_schema, json_object, regex, grammar)
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give one of json_schema, json_object, regex, grammar (got {', '.join(given)})")
    llg = _llguidance()
    if json_object:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if json_schema is not None:
        if not isinstance(json_schema, (dict, str)):
            raise InputError(f"json_schema must be a JSON Schema (a dict or its JSON text), got "
                             f"{type(json_schema).__name__}")
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        try:
            parsed = json.loads(text)
        except ValueError as e:
            raise InputError(f"json_schema is not valid JSON ({e}); give a JSON Schema object") from None
        if not isinstance(parsed, (dict, bool)):
            raise InputError(f"json_schema must be a JSON Schema object, got {text[:60]}")
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    if regex is not None:
        return llg.LLMatcher.grammar_from_regex(regex)
    return llg.LLMatcher.grammar_from_lark(grammar)


def call_grammar(open_id: int, close_id: int, tools: dict[str, dict | None], quote_id: int | None = None,
                 answer: bool = False, more: bool = False, output: str | None = None) -> str:
    """The grammar of a tool call in Gemma's format, `<|tool_call>call:NAME{...}<tool_call|>` (the markers are token
    ids), NAME one of `tools` and its arguments valid against that tool's parameters schema (an object; a tool
    mapped to None, in a reply: any object in that notation). answer False: exactly one call (a forced call), or
    with `more` one or more (tool_choice "required" with parallel calls). answer True: a whole reply whose calls
    obey that: any text without the call markers, then any number of calls (OpenAI's `strict` tools under
    tool_choice "auto"). The arguments are written in Gemma's own notation, as the
    chat template renders a call and the model learned it: keys bare and in sorted order, strings between `<|"|>`
    tokens (`quote_id`), numbers, booleans, null, lists and objects as in JSON, no spaces
    (`{city:<|"|>Paris<|"|>,days:3}`). A schema that notation's translation does not cover (see
    `_gemma_value`), or no `quote_id`, gets JSON arguments instead, which the parser reads too. output (with
    `answer`): a grammar (`grammar_for`'s) the reply's text obeys where it makes no call, as OpenAI answers an output
    format beside tools: either one or more calls, or the final answer in that format."""
    llg = _llguidance()
    alts, rules = [], []
    for name, params in tools.items():
        if params is None and answer and quote_id is not None:  # not strict: any object in the notation
            if not any(r.startswith("gobj:") for r in rules):
                rules.append(_any_gemma_object(quote_id))
            alts.append(f"{json.dumps(name)} gobj")
            continue
        schema = params or {"type": "object"}
        value = _gemma_value(schema, quote_id, rules) if quote_id is not None else None
        alts.append(f"{json.dumps(name)} " + (value or f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"))
    call = f'<[{open_id}]> "call:" ({" | ".join(alts)}) <[{close_id}]>'
    start = f"start: <[^{open_id},{close_id}]>* ({call})*" if answer else f"start: ({call})+" if more else \
        f"start: {call}"
    if output is not None:
        start = f"start: @{OUTPUT} | ({call})+"
    lark = llg.LLMatcher.grammar_from_lark("\n".join([start] + rules) + "\n")
    return lark if output is None else _with_subgrammar(lark, output)


OUTPUT = "output"  # the name a reply's grammar gives the output format's grammar within it


def _with_subgrammar(lark: str, sub: str) -> str:
    """A top-level grammar: `lark` first (the start), then `sub` (a `grammar_for` result: llguidance's top-level JSON,
    or Lark text) under the name `OUTPUT`, which `lark` refers to as @output."""
    inner = json.loads(sub)["grammars"] if sub.lstrip().startswith("{") else [{"lark_grammar": sub}]
    return json.dumps({"grammars": [{"name": "reply", "lark_grammar": lark}, {**inner[0], "name": OUTPUT},
                                    *inner[1:]]})


def _any_gemma_object(quote: int) -> str:
    """Lark rules for any object in Gemma's argument notation (the arguments of a tool that is not strict)."""
    q = f"<[{quote}]>"
    return "\n".join([
        'gobj: "{" (GKEY ":" gval ("," GKEY ":" gval)*)? "}"',
        f'gval: {q} GSTR? {q} | GNUM | "true" | "false" | "null" | "[" (gval ("," gval)*)? "]" | gobj',
        "GKEY: /[A-Za-z_][A-Za-z0-9_]*/",
        "GSTR: /(?s:.+)/",
        "GNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/"])


def reply_grammar(tokenizer, tools: list[dict] | None, forced: str | None = None,
                  output_grammar: str | None = None, parallel: bool = False) -> tuple[str, tuple[int, ...]] | None:
    """What a chat reply offered `tools` (OpenAI tool dicts) must obey, as (grammar, guarded tokens) for
    `Constraint`; None for a free reply (or one that obeys `output_grammar` alone: no tool offered). forced ""
    (any offered tool) or a tool's name: exactly one call of it, its arguments valid against its parameters schema;
    with `parallel` (tool_choice "required", parallel calls allowed) one or more such calls; the output grammar is
    then for a later turn's answer. Else, where any offered tool is `strict`, or an output grammar is asked (a
    `grammar_for` result: JSON, regex, Lark): the whole reply, whose calls name offered tools only, with a strict
    tool's arguments valid (OpenAI's guarantee for strict tools), and a call's opening guarded: it is not written
    where the model's draft after it names no offered tool; with an output grammar, the reply is either calls or
    an answer in that grammar (OpenAI's tools beside response_format: an agent's tool loop with a typed final
    answer). Needs llguidance. This is the one place these rules live."""
    tools = [t.get("function", t) for t in tools or []]
    if not tools or forced is None and output_grammar is None and not any(f.get("strict") for f in tools):
        return None
    if forced is None:
        _llguidance("strict tools need", " (or send the tools without strict)")
    ids = {m: tokenizer.token_to_id(m) for m in ("<|tool_call>", "<tool_call|>", '<|"|>')}
    if ids["<|tool_call>"] is None or ids["<tool_call|>"] is None:
        raise InputError("this model's tokenizer has no tool-call tokens (<|tool_call>, <tool_call|>): it cannot "
                         "call tools; leave out tools")
    if forced is not None:
        schemas = {f["name"]: f.get("parameters") for f in tools if not forced or f["name"] == forced}
        return call_grammar(ids["<|tool_call>"], ids["<tool_call|>"], schemas, ids['<|"|>'], more=parallel), ()
    schemas = {f["name"]: (f.get("parameters") or {"type": "object"}) if f.get("strict") else None for f in tools}
    return call_grammar(ids["<|tool_call>"], ids["<tool_call|>"], schemas, ids['<|"|>'], answer=True,
                        output=output_grammar), (ids["<|tool_call>"],)


_NOTATION_KEYS = {"type", "properties", "required", "additionalProperties", "items", "enum", "minLength", "maxLength",
                  "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "description", "title", "default"}


def _gemma_value(schema, quote: int, rules: list[str]) -> str | None:
    """A Lark expression for one value of `schema` in Gemma's argument notation, new rules appended to `rules`;
    None where the schema uses what the translation does not cover (anyOf, $ref, pattern, format, a list of
    types, array bounds...), so the caller falls back to JSON. Numbers, booleans and null read the same in both
    notations, so their schemas (ranges included) go to llguidance's JSON Schema support as they are."""
    if not isinstance(schema, dict) or set(schema) - _NOTATION_KEYS:
        return None
    q = f"<[{quote}]>"
    if "enum" in schema:
        alts = []
        for v in schema["enum"]:
            if isinstance(v, str):
                alts.append(f"{q} {json.dumps(v)} {q}" if v else f"{q} {q}")
            elif v is None or isinstance(v, (bool, int, float)):
                alts.append(json.dumps(json.dumps(v)))
            else:
                return None
        return "(" + " | ".join(alts) + ")" if alts else None
    kind = schema.get("type")
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if hi == 0:
            return f"{q} {q}"
        name = f"STR{len(rules)}"
        rules.append(f"{name}: /(?s:.{{{max(lo, 1)},{'' if hi is None else hi}}})/")
        return f"{q} {name} {q}" if lo > 0 else f"{q} {name}? {q}"
    if kind in ("integer", "number", "boolean", "null"):
        return f"%json {json.dumps({k: v for k, v in schema.items() if k not in ('description', 'title', 'default')})}"
    if kind == "array":
        item = _gemma_value(schema.get("items", {"type": "string"}), quote, rules)
        return None if item is None else f'"[" ({item} ("," {item})*)? "]"'
    if kind == "object":
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        if required - set(props):
            return None
        keys = sorted(props)
        values = [_gemma_value(props[k], quote, rules) for k in keys]
        if any(v is None for v in values):
            return None
        if not keys:
            return '"{}"'
        obj = len(rules)
        rules.append("")  # a placeholder keeps this object's rule names unique while its members add theirs

        def rule(i: int, started: bool) -> str:  # the members from keys[i] on, with or without one written before
            return f"obj{obj}_{i}_{int(started)}"

        body = []
        for i, (k, v) in enumerate(zip(keys, values)):
            for started in (False, True):
                this = ('"," ' if started else "") + f"{json.dumps(k + ':')} {v}"
                this += f" {rule(i + 1, True)}" if i + 1 < len(keys) else ""
                if k in required:
                    body.append(f"{rule(i, started)}: {this}")
                elif i + 1 < len(keys):
                    body.append(f"{rule(i, started)}: {this} | {rule(i + 1, started)}")
                else:
                    body.append(f"{rule(i, started)}: ({this})?")
        rules[obj] = "\n".join(body)
        return f'"{{" {rule(0, False)} "}}"'
    return None


class Vocabulary:
    """The grammar engine's view of one tokenizer with one set of stop ids, and each token's closing rank.
    Built once per (tokenizer, stop ids, vocab size) and cached."""

    HEAD = 64  # the soonest-closing tokens `closest` tests one by one before reading the whole mask

    def __init__(self, tokenizer, stop_ids: tuple[int, ...], vocab_size: int):
        llg = _llguidance()
        raw = tokenizer._tok if hasattr(tokenizer, "_tok") else tokenizer
        self.llg = _text_tokenizer(llg, raw, vocab_size, list(stop_ids))
        self.stop_ids, self.V = stop_ids, vocab_size
        n = min(raw.get_vocab_size(), vocab_size)
        pieces = [raw.id_to_token(i) for i in range(n)]
        texts = [raw.decode([i], skip_special_tokens=False) for i in range(n)]
        self.rank = torch.tensor([_rank(p, t) for p, t in zip(pieces, texts)] + [10**6] * (vocab_size - n),
                                 dtype=torch.long)
        self.rank[list(stop_ids)] = 10**6  # stopping is decided by the grammar's accepting state, not ranked
        self.by_rank = torch.argsort(self.rank, stable=True)  # token ids, soonest-closing first (ties: lower id)
        self.order = torch.empty_like(self.by_rank)  # token id -> its place in by_rank
        self.order[self.by_rank] = torch.arange(len(self.by_rank))
        self.head = self.by_rank[:self.HEAD].tolist()
        self.kind = self.rank // 1000  # a token's class (what its text begins with: `_rank`)
        self.kinds = self.kind.tolist()
        self.width = [len(t) for t in texts] + [0] * (vocab_size - n)  # characters (`Constraint._rest`)
        firsts, leads = set(), []  # per first character, its soonest-closing token; a special token is its own
        self.lead_class = {}  # a lead -> its character's class for the coarse search (`allowed_classes`): digits,
        # lower-case letters, upper-case letters, white space; any other character (a special token) its own; a
        # byte-fallback token (`<0x41>`, a lead of its own) its byte's character's
        for t in self.by_rank.tolist():
            if t >= n or t in stop_ids or not texts[t]:
                continue
            first = ("special", t) if _special(pieces[t]) else texts[t][0]
            if first not in firsts:
                firsts.add(first)
                leads.append(t)
                c = texts[t][0] if _BYTE.fullmatch(pieces[t] or "") else first  # a byte token: its character's
                self.lead_class[t] = c if not isinstance(c, str) else "digit" if c.isdigit() else \
                    "lower" if c.islower() else "upper" if c.isupper() else "space" if c.isspace() else c
        self.leads = torch.tensor(leads, dtype=torch.long)  # in closing order: the steps `Constraint._search` takes
        self._lead_at, self._lead_bit = self.leads >> 3, (self.leads & 7).to(torch.uint8)
        self._shifts = torch.arange(8, dtype=torch.uint8)

    def unpack(self, bits: bytes, device=None) -> torch.Tensor:
        """The matcher's bitmask (one bit per token, little-endian) as [V] bool, on `device` (the packed bytes go
        there, an eighth of the mask)."""
        raw = torch.frombuffer(bytearray(bits), dtype=torch.uint8).to(device)
        return ((raw[:, None] >> self._shifts.to(raw.device)) & 1).flatten()[:self.V].bool()

    def closest(self, bits: bytes, demoted: frozenset = frozenset()) -> int:
        """The allowed token (by the matcher's bitmask) that closes soonest: the first of `by_rank` whose bit is
        set, tokens of a `demoted` class after all others (`closest_reference`). Inside an open value one of the
        first `HEAD` nearly always is (a quote, a bracket), tested bit by bit; else the allowed tokens are read
        from the mask's set bytes (few, where a value must go on with a `,` or a `:`) and the earliest taken."""
        if not demoted:
            for t in self.head:
                if (bits[t >> 3] >> (t & 7)) & 1:
                    return t
        raw = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
        at = raw.nonzero()[:, 0]
        ids = (at[:, None] * 8 + self._shifts).flatten()[((raw[at, None] >> self._shifts) & 1).flatten().bool()]
        ids = ids[ids < self.V]
        if not len(ids):
            return self.stop_ids[0]  # none: the grammar is done
        key = self.order[ids]
        if demoted:
            key = key + self.V * torch.isin(self.kind[ids], torch.tensor(sorted(demoted)))
        return int(ids[key.argmin()])

    def allowed_leads(self, bits: bytes) -> list[int]:
        """The `leads` the mask allows, in closing order: one token per first character the grammar takes here
        (where a character's single-character token exists, it is its lead, and allowed wherever a longer token
        that starts with that character is)."""
        raw = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
        return self.leads[((raw[self._lead_at] >> self._lead_bit) & 1).bool()].tolist()

    def allowed_classes(self, bits: bytes) -> list[int]:
        """`allowed_leads` with one lead per character class (`lead_class`: the first, in closing order)."""
        seen, out = set(), []
        for t in self.allowed_leads(bits):
            if self.lead_class[t] not in seen:
                seen.add(self.lead_class[t])
                out.append(t)
        return out

    def allowed(self, bits: bytes, limit: int) -> list[int]:
        """The first `limit` tokens the mask allows, in closing order."""
        return self.by_rank[self.unpack(bits)[self.by_rank]][:limit].tolist()

    def closest_reference(self, bits: bytes, demoted: frozenset = frozenset()) -> int:
        """`closest`, read plainly: the tokens in closing order (a demoted class's last), the first whose bit is
        set (the stop id if none is)."""
        order = sorted(self.by_rank.tolist(), key=lambda t: self.kinds[t] in demoted)  # stable: by_rank within
        return next((t for t in order if (bits[t >> 3] >> (t & 7)) & 1), self.stop_ids[0])


def _text_tokenizer(llg, raw, vocab_size: int, stop_ids: list[int]):
    """llguidance's tokenizer for `raw` (a `tokenizers.Tokenizer`) that writes a grammar's text as text: the
    forced tokens of a regex's `x<mask>y` are the ordinary tokens that spell `<mask>`, as a prompt's text is encoded
    (`Tokenizer.literal`). Built from the tokenizer file, llguidance splits such text into the control token's id,
    which its grammar then refuses (a committed token broke the grammar), or, for a stop id such as `<eos>`, ends
    the output there. So the tokens' bytes and which are special are the file's, and only the encoding of forced
    text comes from a copy that reads special-token strings as text (`encode_special_tokens`)."""
    ll = llg.LLTokenizer(raw.to_str(), n_vocab=vocab_size, eos_token=stop_ids)
    text = raw.__class__.from_str(raw.to_str())
    text.encode_special_tokens = True

    class Encoder:  # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id = stop_ids[0], None
        tokens = [ll.decode_bytes([i]) for i in range(vocab_size)]
        special_token_ids = [i for i in range(vocab_size) if ll.is_special_token(i)]

        def __call__(self, s: str) -> list[int]:
            return text.encode(s, add_special_tokens=False).ids

    return llg.LLTokenizer(llg.TokenizerWrapper(Encoder()), n_vocab=vocab_size, eos_token=stop_ids)


def _rank(piece: str | None, text: str) -> int:
    """Closing rank: lower closes sooner. By the first character of the token's text, then its length; Gemma's
    string quote `<|"|>` (tool-call arguments) closes like `"`. A `,` goes before digits: where both may follow
    (inside a number a member is still required after), a digit only makes the number longer, and a path that
    always takes one never closes."""
    if piece == '<|"|>':
        return 0  # before `"` (rank 1), which would only extend such a string
    if not text or _special(piece):
        return 10**6  # special tokens and empty pieces never close anything
    c = text[0]
    cls = 0 if c in "\"}]" else 1 if c == "," else 2 if c.isdigit() else 3 if c.isalpha() else \
        _OPEN if c in "{[" else 4 if c in ":-." else _OTHER
    return cls * 1000 + len(text)


_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token's piece


def _special(piece: str | None) -> bool:
    """Whether a token is a special one (`<...>`), or has no piece."""
    return piece is None or (piece.startswith("<") and piece.endswith(">") and len(piece) > 2)


@lru_cache(maxsize=8)
def _vocabulary(tokenizer, stop_ids: tuple[int, ...], vocab_size: int) -> Vocabulary:
    return Vocabulary(tokenizer, stop_ids, vocab_size)


def one_line(error: str) -> str:
    """llguidance's error text in one line: its first line, with the `error: ...` detail of the lines under it
    (a regex's parse error); the source listing it draws (`1 | start: ...`, a caret under it) dropped, since it shows
    the grammar compiled from the request, not what the client wrote."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    detail = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
    return lines[0].rstrip(":") + (f": {detail[0]}" if detail else "")


class GrammarBudgetError(InputError):
    """The shortest output found for the grammar does not fit in max_new_tokens (the fix is the budget, not the
    grammar)."""


class Constraint:
    """One row's grammar and its state after the row's committed tokens."""

    CLOSE_LIMIT = 4096  # tokens a closing path may take before the grammar counts as unclosable
    LOOP, DEMOTE = 32, 3  # `closing_path`: choices a path may make before it is made again, and how many times
    NODES, TRIES, WORDS = 128, 16384, 64  # `_search`: masks it may compute, tokens it may try as a path's last,
    # and words of the grammar's text it takes as steps
    DEEP_NODES = 512  # `_search(deep=True)`'s masks: the last resort, after the greedy paths' (up to `cap` each)
    NOVEL = 256  # `_novel`: tokens its path may take
    REPAIR = 3  # `_path_after`: greedy steps after a token before the path carried so far is made again (the
    # continuation bytes of a 4-byte UTF-8 character)

    LOOKAHEAD = 8  # drafted positions a guarded token's check reads: a call's opening, "call:" and a name

    def __init__(self, grammar: str, tokenizer, stop_ids, vocab_size: int, max_new_tokens: int,
                 guarded: tuple[int, ...] = ()):
        """guarded: tokens written only where the grammar also accepts the model's draft (its argmax) of the
        next `LOOKAHEAD` positions after them (up to a stop or the canvas's end); elsewhere the next allowed token
        in the model's order is taken. A diffusion canvas drafts every position at once, so the check sees where
        the text a token starts is going: a reply's call opening whose drafted name is no offered tool is not
        written (`reply_grammar`)."""
        llg = _llguidance()
        stop_ids = tuple(int(s) for s in (stop_ids or ()))
        if not stop_ids:
            raise InputError("structured output needs a stop id (eos_token_id) to end the output")
        self.vocab = _vocabulary(tokenizer, stop_ids, vocab_size)
        self.matcher = llg.LLMatcher(self.vocab.llg, grammar)
        if self.matcher.is_error():
            raise InputError(f"the grammar cannot be used: {one_line(self.matcher.get_error())}")
        self.budget, self.written, self.ended = max_new_tokens, 0, False
        self.cut = False  # the budget closed the output early: a committed canvas's walk put its closing path in
        # place of what the model chose (a finish "length", though the output is complete and valid)
        self.guarded = frozenset(int(t) for t in guarded)
        self.masks = 0  # grammar masks computed so far: the host cost of the walk and its closing paths
        words = dict.fromkeys(re.findall(r"[A-Za-z0-9_]{2,}", grammar))  # the literals a closing path may need
        self._words = [w for w in (self.vocab.llg.tokenize_str(w) for w in list(words)[:self.WORDS]) if w]
        self.path = self.closing_path(self.matcher, max_new_tokens - 1)  # how the committed state closes (tokens)
        self._walked: dict = {}  # the tokens each walk since the last commit took -> (the closing path it ended on,
        # whether the budget made it close)
        if self.path is None:
            raise InputError(f"could not find a way to close this grammar within {self.CLOSE_LIMIT} tokens (the "
                             "search for one is bounded, so it may still have valid outputs); simplify the grammar")
        if len(self.path) + 1 > max_new_tokens:
            raise GrammarBudgetError(f"max_new_tokens={max_new_tokens} is too small for this grammar: the shortest "
                                     f"output found takes {len(self.path)} tokens and its stop one more; raise "
                                     "max_new_tokens")

    def clone(self) -> "Constraint":
        """Another row's constraint in this one's state, without compiling the grammar again (a request's n choices
        share one compile)."""
        out = copy.copy(self)
        out.matcher, out._walked = self.matcher.deep_copy(), {}
        return out

    def _draft_fits(self, m, t: int, draft: list[int]) -> bool:
        """Whether the grammar, after t, takes every token of the draft."""
        return m.validate_tokens([t, *draft]) == len(draft) + 1

    def closing_path(self, m, within: int | None = None, cap: int | None = None) -> list[int] | None:
        """The tokens of a short closing path from matcher `m`, which is left as it is (its stop not included; None:
        none found of at most `cap` tokens, CLOSE_LIMIT by default). First the greedy one: forced tokens where the
        grammar forces some, else the allowed token that closes soonest (`Vocabulary.closest`), within `LOOP`
        choices. Where that goes round (`[a-z]+x`: a letter, then another, and the `x` that closes is a letter too),
        or is longer than `within`, `_search` looks for a shorter one. Where that finds none either (a long minimum
        length, `[a-z]{400}`), the greedy path is made again with the class it chose most put last in the order (up
        to `DEMOTE` classes: `[a-z]{40}(, [0-9]+)*\\.`), then in the plain order, to `cap` tokens. Where that does
        not close either, last `_novel`: the characters each state newly allows first (`[a-z0-9._]+@...`, an e-mail
        address, whose `@` the search met too late among the 38 characters of its loop); then `_search` with one
        step per character class (`[A-Za-z0-9_]+\\([a-z, ]*\\)`, whose `,` `_novel` takes again and again: 4
        steps a state, not 63); then that search depth first (the e-mail address
        `[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}`, whose `.` is also a character of the repetition before it,
        so no state newly allows it)."""
        cap = self.CLOSE_LIMIT if cap is None else cap
        path, kinds = self._greedy(m, frozenset(), self.LOOP, cap)
        if path is not None and (within is None or len(path) <= within):
            return path
        found = self._search(m, cap if path is None else len(path) - 1)
        if found is not None or path is not None or len(kinds) < self.LOOP:  # (fewer: it stopped at `cap`)
            return path if found is None else found
        demoted: frozenset = frozenset()
        for _ in range(self.DEMOTE - 1):
            if not kinds:
                break
            demoted |= {max(set(kinds), key=lambda k: (kinds.count(k), -k))}
            path, kinds = self._greedy(m, demoted, self.LOOP, cap)
            if path is not None:
                return path
        path = self._greedy(m, frozenset(), None, cap)[0]
        if path is None:
            path = self._novel(m, min(cap, self.NOVEL))
        if path is None:
            path = self._search(m, cap, coarse=True)
        return path if path is not None else self._search(m, cap, coarse=True, deep=True)

    def _novel(self, m, cap: int) -> list[int] | None:
        """A closing path from `m` of at most `cap` tokens that takes, at each choice, the soonest-closing of the
        characters the grammar allows there and did not allow at the choice before (`Vocabulary.allowed_leads`: the
        way out of a repetition, which opens where the repetition may end: the `@` after a character of
        `[a-z0-9._]+`), else the soonest-closing allowed token; None where it does not close."""
        trial, out, before = m.deep_copy(), [], None
        while not (trial.is_accepting() or trial.is_stopped()):
            if len(out) >= cap:
                return None
            step = trial.compute_ff_tokens()
            if not step:
                self.masks += 1
                bits = trial.compute_bitmask()
                leads = self.vocab.allowed_leads(bits)
                new = [t for t in leads if before is not None and t not in before]
                step, before = [new[0] if new else self.vocab.closest(bits)], set(leads)
            trial.consume_tokens(step)
            out += step
        return out

    def _greedy(self, m, demoted: frozenset, choices: int | None, cap: int) -> tuple[list[int] | None, list[int]]:
        """The greedy closing path from `m` (forced tokens, else the soonest-closing allowed token, a `demoted`
        class's last), and the classes of the tokens it chose; None for the path where it made `choices` choices
        (None: no bound) or took `cap` tokens without closing."""
        trial, out, kinds = m.deep_copy(), [], []
        while True:
            if trial.is_accepting() or trial.is_stopped():
                return out, kinds
            if len(out) >= cap:
                return None, kinds
            forced = trial.compute_ff_tokens()
            if not forced:
                if choices is not None and len(kinds) >= choices:
                    return None, kinds
                self.masks += 1
                forced = [self.vocab.closest(trial.compute_bitmask(), demoted)]
                kinds.append(self.vocab.kinds[forced[0]])
            trial.consume_tokens(forced)
            out += forced

    def _search(self, m, limit: int, coarse: bool = False, deep: bool = False) -> list[int] | None:
        r"""The shortest closing path from `m` of at most `limit` tokens that a bounded best-first search finds, or
        None. From each state it reaches, fewest tokens first, the search tries the allowed tokens in closing order,
        and the words of the grammar's text, as the path's last (the first after which the grammar may end closes
        it), and goes on with one token per first character the grammar takes there (`Vocabulary.allowed_leads`:
        the `x` of `[a-z]+x` as well as the `a`), the words it takes, or the forced tokens. The words find a
        closing literal whose letters each also continue a loop (`([a-z]+ )+end` where `end` is three tokens):
        the masks on the way to it are the loop's, so nothing else tells those letters from any others.
        llguidance exposes no state to key on, only the mask, which states that differ further on can share
        (`[a-z]+x` before a letter and after one): so a state is dropped only where its text from `m` was reached
        already, and one whose mask was seen, with what follows it, waits until no state after a new mask is left
        (after `{"v": "a` of a `^[a-z]+x$` string, `ax` goes first: the quote it allows is new). Bounded by the
        masks it computes (`NODES`; deep, `DEEP_NODES`) and the tokens it tries as a path's last (`TRIES`).
        coarse: one step per character class the grammar takes there (`Vocabulary.allowed_classes`), not per
        character: fewer states a level, blind to a way out that is one letter among others (`[a-z]+x`). deep: a
        state after more new masks goes first, however many tokens it took: depth first through the grammar's parts,
        which finds longer paths than breadth first, and finds them sooner (in an e-mail address's
        `[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}` no mask is new after the `@`, and the `0@0.a` that closes is five levels of
        four to nine classes down, past the budget breadth first; inside a JSON string, whose closing quote must
        follow, one level more)."""
        stop, vocab = self.vocab.stop_ids[0], self.vocab
        order = itertools.count()
        queues: tuple[list, list] = ([(0, 0, next(order), [], m, [], None)], [])  # after new masks, after seen ones
        reached, seen = {b""}, set()
        best, masks, tries, nodes = None, 0, self.TRIES, self.DEEP_NODES if deep else self.NODES
        while (queues[0] or queues[1]) and masks < nodes:
            late = not queues[0]
            rank, cost, _, path, node, step, bits = heapq.heappop(queues[late])  # rank: minus the new masks (deep)
            if cost >= limit or best is not None and cost + 1 >= len(best):
                continue
            if step:  # made when first taken from a queue: most states queued never are
                node = node.deep_copy()
                node.consume_tokens(step)
                if node.is_accepting() or node.is_stopped():  # (past the tokens tried as a path's last)
                    best = path
                    continue
            forced = node.compute_ff_tokens()
            if not forced and bits is None:
                masks += 1
                bits = node.compute_bitmask()
                if bits in seen and not late:
                    heapq.heappush(queues[1], (rank, cost, next(order), path, node, [], bits))
                    continue
                late = bits in seen
                if not late and deep:
                    rank -= 1
                seen.add(bits)
            ends, steps = [forced] if forced else [], [forced] if forced else []
            if not forced:
                ends = [[t] for t in vocab.allowed(bits, tries)]
                tries -= len(ends)
                steps = [[t] for t in (vocab.allowed_classes(bits) if coarse else vocab.allowed_leads(bits))]
                for w in self._words:
                    if node.validate_tokens(w) == len(w):
                        ends.append(w)
                        steps.append(w)
            last = next((e for e in ends if node.validate_tokens([*e, stop]) == len(e) + 1), None)
            if last is not None and cost + len(last) <= limit and (best is None or cost + len(last) < len(best)):
                best = path + last
            for step in steps:
                n, text = cost + len(step), vocab.llg.decode_bytes(path + step)
                if n < limit and (best is None or n + 1 < len(best)) and text not in reached:
                    reached.add(text)
                    heapq.heappush(queues[late], (rank, n, next(order), path + step, node, step, None))
        self.masks += masks
        return best

    def _path_after(self, m, path: list[int] | None, t: int, cap: int) -> list[int] | None:
        """A closing path for the state m reaches with t, given `path`, m's own. Where the grammar takes a part of
        it after t and may end there (`_rest`), that part: nearly always, without a mask. Else up to `REPAIR`
        greedy tokens and then such a part (t a byte that a UTF-8 character needs more of, a bracket opened: a
        mask each). Else `closing_path` from that state, which looks no further than `cap` tokens (the room left:
        a longer path would not be used)."""
        if path is not None:
            if path and path[0] == t:
                return path[1:]
            after, head = None, []
            for k in range(self.REPAIR + 1):
                rest = self._rest(m, [t, *head], path)
                if rest is not None:
                    return head + rest
                if k == self.REPAIR:
                    break
                if after is None:
                    after = m.deep_copy()
                    after.consume_token(t)
                if after.is_accepting() or after.is_stopped():
                    return head
                step = after.compute_ff_tokens()
                if not step:
                    self.masks += 1
                    step = [self.vocab.closest(after.compute_bitmask())]
                after.consume_tokens(step)
                head += step
        after = m.deep_copy()
        after.consume_token(t)
        return self.closing_path(after, cap=cap)

    def _rest(self, m, took: list[int], path: list[int]) -> list[int] | None:
        """The part of `path` that closes the grammar after `took` from matcher m (validated, not consumed), or None:
        the part after the tokens whose text `took`'s spans (a counted repetition, `[a-z]{400}`: a 3-letter token in
        place of 3 letters); else the part the grammar takes (all of it inside a string or a number; its head,
        where `took` wrote some of the rest)."""
        stop, width = self.vocab.stop_ids[0], self.vocab.width
        w, i = sum(width[t] for t in took), 0
        while i < len(path) and w > 0:
            w, i = w - width[path[i]], i + 1
        if i and m.validate_tokens([*took, *path[i:], stop]) == len(took) + len(path) - i + 1:
            return path[i:]
        n = m.validate_tokens([*took, *path]) - len(took)
        if n >= 0 and m.validate_tokens([*took, *path[:n], stop]) == len(took) + n + 1:
            return path[:n]
        return None

    def walk(self, z: torch.Tensor, y: torch.Tensor, a: torch.Tensor | None = None) -> tuple[list[int], list[int], int]:
        """z [C, V] the step's logits, y [C] its draws (a, the step's argmax, is the walk's own) -> the walked
        argmax and draws (lists) and n, the number of leading positions that hold the grammar's forced tokens
        (certain: the step accepts them)."""
        C = z.shape[0]
        stop = self.vocab.stop_ids[0]
        if self.ended:
            return [stop] * C, [stop] * C, 0
        cand = z.topk(min(TOP_K, z.shape[-1]), dim=-1).indices.tolist()
        drawn = y.tolist()
        m, path, took, cut = self.matcher.deep_copy(), self.path, [], False
        forced = [] if m.is_accepting() else takewhile(lambda t: t not in self.vocab.stop_ids, m.compute_ff_tokens())
        lead = list(forced)[:max(0, min(C, self.budget - self.written - 1))]  # a stop is the walk's to decide
        out_a, out_y, ended = [], [], False
        for j in range(C):
            left = self.budget - self.written - j
            if ended or left <= 0:
                out_a.append(stop)
                out_y.append(stop)
                continue
            if j < len(lead):  # forced by the grammar: the token, drawn or not
                out_a.append(lead[j])
                out_y.append(lead[j])
                path = self._path_after(m, path, lead[j], max(left - 2, 0))
                m.consume_token(lead[j])
                took.append(lead[j])
                continue
            self.masks += 1
            bits = m.compute_bitmask()  # one bit per token: tested in place for the candidates
            ok = lambda t, b=bits: (b[t >> 3] >> (t & 7)) & 1  # noqa: E731
            if self.guarded:
                draft = list(takewhile(lambda d: d not in self.vocab.stop_ids,
                                       (c[0] for c in cand[j + 1:j + 1 + self.LOOKAHEAD])))
                fits: dict[int, bool] = {}  # a guarded token's check, once per position (argmax and draw alike)

                def ok(t, a=ok, d=draft, fits=fits, m=m):
                    if not a(t):
                        return False
                    if t not in self.guarded:
                        return True
                    if t not in fits:
                        fits[t] = self._draft_fits(m, t, d)
                    return fits[t]
            t = next((c for c in cand[j] if ok(c)), None)
            if t is None:  # none of the candidates: the masked argmax
                t = int(torch.where(self.vocab.unpack(bits, z.device), z[j], float("-inf")).argmax())
            nxt = None
            if t not in self.vocab.stop_ids:
                nxt = self._path_after(m, path, t, max(left - 2, 0))
                if nxt is None or len(nxt) + 2 > left:  # t, its closing path and a stop do not fit: close now
                    t, nxt = (path[0], path[1:]) if path else (stop, None) if path is not None else \
                        ((m.compute_ff_tokens() or [self.vocab.closest(bits)])[0], None)
                    cut = True
            out_a.append(t)
            out_y.append(drawn[j] if ok(drawn[j]) else t)
            if t in self.vocab.stop_ids:
                ended = True
            else:
                m.consume_token(t)
                took.append(t)
                path = nxt
        self._walked[tuple(took)] = (path, cut)
        return out_a, out_y, len(lead)

    def advance(self, tokens: list[int]) -> None:
        """The committed canvas's tokens (up to and including the first stop id) enter the state."""
        took: list[int] = []
        walked, self._walked = self._walked, {}
        for t in tokens:
            if self.ended:
                return
            if t in self.vocab.stop_ids:
                self.ended = True
                self.cut = self.cut or walked.get(tuple(took), (None, False))[1]
                return
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"a committed token broke the grammar: {self.matcher.get_error()}")
            self.written += 1
            took.append(int(t))
        else:  # the walk that wrote these tokens knows how they close (it kept room for that path)
            entry = walked.get(tuple(took))
            self.path, cut = entry if entry is not None else (self.closing_path(self.matcher), False)
            self.cut = self.cut or cut


class TokenBan:
    """A row's constraint without a grammar: the tokens `banned` never enter its canvas (the opening of a tool call
    where no tool is offered: `parsing.call_ban`). Where the step's argmax is banned it becomes the most likely token
    that is not; a banned draw becomes that argmax. Nothing is forced, and a row whose argmax and draws hold no
    banned token keeps them as they are (the same tokens as without the ban). All on the device: no host read."""

    def __init__(self, banned, vocab_size: int):
        ids = sorted({int(t) for t in banned})
        if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
            bad = "none" if not ids else ids[0] if ids[0] < 0 else ids[-1]
            raise InputError(f"suppress_tokens must be token ids in [0, {vocab_size}) (got {bad})")
        if len(ids) == vocab_size:
            raise InputError(f"suppress_tokens bans every one of the {vocab_size} tokens; leave the model at least one "
                             "to write")
        self.banned = torch.tensor(ids, dtype=torch.long)
        self._on: dict = {}  # device -> the ids there (copied once)

    def walk(self, z: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """z [C, V] the step's logits, y [C] its draws, a [C] its argmax -> the argmax and draws without a banned
        token, and 0 forced positions."""
        banned = self._on.get(z.device)
        if banned is None:
            banned = self._on[z.device] = self.banned.to(z.device)
        cand = z.topk(len(banned) + 1, dim=-1).indices  # one of these is allowed
        alt = cand.gather(-1, (~torch.isin(cand, banned)).float().argmax(-1, keepdim=True))[:, 0]
        a = torch.where(torch.isin(a, banned), alt, a)
        return a, torch.where(torch.isin(y, banned), a, y), 0

    def clone(self) -> "TokenBan":
        """Stateless: one ban serves every row."""
        return self

    def advance(self, tokens: list[int]) -> None:
        """Nothing to carry from one canvas to the next."""


def constrain(cv, idx: list[int], a: torch.Tensor, y: torch.Tensor, z: torch.Tensor):
    """The step's argmax `a` and draws `y` [k, C] of the rows `idx` (z [k, C, V] their logits), with every
    constrained row walked through its grammar, and `forced` [k, C] bool, the positions that hold a grammar's
    forced tokens (new tensors; the same a and y, and forced None, when no row is constrained)."""
    rows = [(i, cv.rows[r].constraint) for i, r in enumerate(idx) if cv.rows[r].constraint is not None]
    if not rows:
        return a, y, None
    a, y = a.clone(), y.clone()
    forced = torch.zeros(a.shape, dtype=torch.bool)
    for i, c in rows:
        wa, wy, n = c.walk(z[i], y[i], a[i])
        a[i] = torch.as_tensor(wa, dtype=a.dtype, device=a.device)
        y[i] = torch.as_tensor(wy, dtype=y.dtype, device=y.device)
        forced[i, :n] = True
    return a, y, forced.to(a.device)
