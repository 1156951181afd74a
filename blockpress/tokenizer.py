"""Tokenizer: a thin wrapper around a `tokenizers.Tokenizer` loaded from a checkpoint folder.

Job: text <-> ids for the engine, chat-template application, and incremental (streaming)
detokenisation.

Invariants:
- `tokenizer.json` is required; `tokenizer_config.json` and `special_tokens_map.json` are read when
  present for bos/eos/pad/unk tokens and `chat_template`; a `chat_template.jinja` file in the
  folder takes precedence over any template in `tokenizer_config.json`; without either, the
  built-in `chat.DEFAULT_GEMMA4_TEMPLATE` is used (`chat_template_source == "default"`).
- `encode` never adds special tokens unless asked: chat templates already write `<bos>`, and
  special-token text in the input (e.g. `<|turn>`) is matched to its id, as in Hugging Face: a plain prompt
  may spell a turn by hand.
- Text inside chat messages and tool declarations never becomes a control token: `apply_chat_template` marks
  each special-token string in them (`literal`: its first character becomes `TEXT_LT`, as the output side marks
  text) and `encode_marked` encodes a marked string as the ordinary tokens that spell it (Hugging Face's
  `split_special_tokens`), so a user's or a tool's text cannot close its turn or forge a system turn, a tool call
  or a tool response. The template's own markup stays control tokens; a conversation without such text is
  encoded exactly as `encode` encodes its rendered text.
- `decode` keeps special tokens by default (the output parser needs `<|channel>`, `<|tool_call>`,
  `<turn|>`, ... to split reasoning / tool calls / content).
- `decode(marked=True)` is the text the output parser reads: the plain text with each "<" that an ordinary token
  wrote replaced by `TEXT_LT`, so only a control token's own id spells control-token text (same length).
- `StreamDecoder` emits text deltas whose concatenation equals `decode(all ids)` (given the same
  `skip_special_tokens` and `marked`); it never emits a partial multi-byte character: text whose tail decodes
  to U+FFFD is held back until the following ids complete it or `flush()` is called.
- Gemma 4 special-token ids are listed in `GEMMA4_SPECIAL_TOKENS`.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .errors import CheckpointError, InputError

__all__ = [
    "GEMMA4_SPECIAL_TOKENS",
    "GEMMA4_CONTROL_TOKENS",
    "StreamDecoder",
    "TEXT_LT",
    "Tokenizer",
]

TEXT_LT = "\ufdd0"  # a "<" written by ordinary tokens, in text decoded for the output parser (`decode(marked=True)`)

# Gemma 4 special tokens and their ids in the released vocabulary.
GEMMA4_SPECIAL_TOKENS: dict[str, int] = {
    "<pad>": 0,
    "<eos>": 1,
    "<bos>": 2,
    "<unk>": 3,
    "<mask>": 4,
    "<|tool>": 46,
    "<tool|>": 47,
    "<|tool_call>": 48,
    "<tool_call|>": 49,
    "<|tool_response>": 50,
    "<tool_response|>": 51,
    '<|"|>': 52,
    "<|think|>": 98,
    "<|channel>": 100,
    "<channel|>": 101,
    "<|turn>": 105,
    "<turn|>": 106,
    "<|image>": 255999,
    "<|image|>": 258880,
    "<image|>": 258882,
}

# Every special-token string the output parser treats as control text (never shown to users).
GEMMA4_CONTROL_TOKENS: tuple[str, ...] = tuple(GEMMA4_SPECIAL_TOKENS) + (
    "<|audio>", "<|audio|>", "<audio|>", "<|video|>",
)

_REPLACEMENT = "\ufffd"


def _token_content(value: Any) -> str | None:
    """tokenizer_config values are either "<bos>" or {"content": "<bos>", ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-download the checkpoint file") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object; re-download the checkpoint file")
    return data


def check_text(text: Any, what: str = "the text to encode") -> None:
    """InputError (one line, the fix) for what the tokenizer cannot take: not a string, or not Unicode text (a lone
    surrogate: a byte that was not UTF-8, kept by Python's surrogateescape when it read a file or stdin)."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, got {type(text).__name__}; pass str")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        what_it_is = f"the byte 0x{ord(bad) - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= ord(bad) <= 0xDCFF \
            else f"a lone surrogate U+{ord(bad):04X}"
        raise InputError(f"{what} is not valid Unicode: character {e.start} is {what_it_is}; convert the input to "
                         "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token's piece


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's alphabet (GPT-2's): each byte as a printable character. The printable Latin-1 bytes stand
    for themselves; the others (controls, space, the soft hyphen...) take the characters from U+0100 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


class Tokenizer:
    """Checkpoint tokenizer: encode/decode, special ids, chat template, streaming decode."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token: str | None = "<bos>",
                 eos_token: str | None = "<eos>", pad_token: str | None = "<pad>",
                 unk_token: str | None = "<unk>", chat_template: str | None = None,
                 chat_template_source: str = "default", path: Path | None = None) -> None:
        self._tok = tok
        self.path = path
        self.bos_token = bos_token if bos_token is not None and tok.token_to_id(bos_token) is not None else None
        self.eos_token = eos_token if eos_token is not None and tok.token_to_id(eos_token) is not None else None
        self.pad_token = pad_token if pad_token is not None and tok.token_to_id(pad_token) is not None else None
        self.unk_token = unk_token if unk_token is not None and tok.token_to_id(unk_token) is not None else None
        if chat_template is None:
            from .chat import DEFAULT_GEMMA4_TEMPLATE
            chat_template, chat_template_source = DEFAULT_GEMMA4_TEMPLATE, "default"
        self.chat_template: str = chat_template
        self.chat_template_source: str = chat_template_source
        added = tok.get_added_tokens_decoder()
        self._special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._special_tokens: tuple[str, ...] = tuple(added[i].content for i in sorted(self._special_ids))
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}  # atomic: decoded as their text

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint folder (or a path to its tokenizer.json)."""
        path = Path(path)
        if path.is_file() and path.name.endswith(".json"):
            folder, tok_file = path.parent, path
        else:
            folder, tok_file = path, path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(f"tokenizer file {tok_file} not found; put the checkpoint's tokenizer.json in {folder}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception on bad files
            raise CheckpointError(f"cannot read {tok_file} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); re-download tokenizer.json") from None

        fields: dict[str, Any] = {}
        template: str | None = None
        source = "default"
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later file wins
            file = folder / name
            if not file.is_file():
                continue
            data = _read_json(file)
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                content = _token_content(data.get(key))
                if content is not None:
                    fields[key] = content
            if name == "tokenizer_config.json":
                ct = data.get("chat_template")
                if isinstance(ct, list):  # [{"name": "default", "template": ...}, ...]
                    named = {d.get("name"): d.get("template") for d in ct if isinstance(d, dict)}
                    ct = named.get("default") or next(iter(named.values()), None)
                if isinstance(ct, str) and ct.strip():
                    template, source = ct, "tokenizer_config.json"
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template, source = jinja_file.read_text(encoding="utf-8"), "chat_template.jinja"
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"cannot read {jinja_file} ({exc}); fix or delete the file") from None
            if not template.strip():  # a cut copy or download: read as "no template", it gave some paths raw text
                raise CheckpointError(f"{jinja_file} is empty; restore it from the model's source, or delete it "
                                      "(the model then has no chat template of its own)")
        return cls(tok, bos_token=fields.get("bos_token", "<bos>"),
                   eos_token=fields.get("eos_token", "<eos>"),
                   pad_token=fields.get("pad_token", "<pad>"),
                   unk_token=fields.get("unk_token", "<unk>"),
                   chat_template=template, chat_template_source=source, path=folder)

    # ------------------------------------------------------------------ basics
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._tok.token_to_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self._tok.token_to_id(self.unk_token)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Strings of all special (added, special=True) tokens, by id."""
        return self._special_tokens

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def is_chat(self) -> bool:
        """A chat model: its own template, or Gemma's turn tokens for the built-in default one. A plain text
        model (no template, no `<|turn>`) gets its prompt as is: the default template would be noise to it."""
        return self.chat_template_source != "default" or self.token_to_id("<|turn>") is not None

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def byte_ids(self) -> frozenset[int]:
        """The byte-fallback tokens (`<0x23>`): a run of them decodes together, each byte of an invalid run to U+FFFD,
        so one such token's text is not known until the run ends (made once)."""
        if getattr(self, "_byte_ids", None) is None:
            self._byte_ids = frozenset(i for t, i in self._tok.get_vocab(with_added_tokens=False).items()
                                       if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))
        return self._byte_ids

    # ------------------------------------------------------------------ the bytes a token writes
    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """Byte-level BPE (GPT-2's alphabet: every byte a printable character): piece character -> its byte; None
        for other decoders (a SentencePiece-style one, with byte-fallback tokens `<0xE6>`)."""
        dec = self._tok.decoder
        spec = json.loads(dec.__getstate__()) if dec is not None else {}
        if "ByteLevel" not in [d.get("type") for d in spec.get("decoders", [spec])]:
            return None
        return {c: b for b, c in _byte_alphabet().items()}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` writes: a token holding part of a multi-byte character gives that part (a
        byte-fallback token its one byte, a byte-level token its bytes), so a run of tokens' bytes is the UTF-8
        of their text; a special token, its string."""
        t = int(token_id)
        piece = self._tok.id_to_token(t)
        if piece is None or t in self._added:
            return self.decode([t]).encode("utf-8")
        if _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        alphabet = self._byte_level
        if alphabet is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return self.decode([t]).encode("utf-8")

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One string per id whose concatenation is the ids' text (each invalid byte run U+FFFD): a character
        written by several tokens shows at the token that completes it, the tokens before it give "". A canvas as
        text per position (the live view, draft frames), where decoding each id alone shows every part of a
        multi-byte character as U+FFFD."""
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        out = [utf8.decode(self.token_bytes(t)) for t in ids]
        if out:
            out[-1] += utf8.decode(b"", final=True)
        return out

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        check_text(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        for t in texts:
            check_text(t, "each of the texts to encode")
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    # ------------------------------------------------------------------ message text that stays text
    @functools.cached_property
    def _specials(self) -> tuple[re.Pattern | None, re.Pattern | None, dict[str, str]]:
        """(the special-token strings, longest first; their marked forms; marked form -> the string), made once."""
        toks = sorted({t for t in self._special_tokens if t}, key=len, reverse=True)
        if not toks:
            return None, None, {}
        back = {}
        for t in toks:
            back.setdefault(TEXT_LT + t[1:], t)
        return (re.compile("|".join(map(re.escape, toks))), re.compile("|".join(map(re.escape, back))), back)

    @functools.cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that encodes special-token strings as the ordinary tokens spelling them."""
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def literal(self, value: Any) -> Any:
        """`value` (a string, or dicts and lists of them: messages, tools) with every special-token string in its
        text (keys included) marked: its first character replaced by `TEXT_LT`. Rendered by a template and encoded by
        `encode_marked`, the marked strings are the ordinary tokens that spell them. Other values as they are; a
        value with no such string is returned unchanged."""
        pattern = self._specials[0]
        if pattern is None:
            return value
        if isinstance(value, str):
            return pattern.sub(lambda m: TEXT_LT + m.group()[1:], value) if pattern.search(value) else value
        if isinstance(value, Mapping):
            return {self.literal(k): self.literal(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.literal(v) for v in value]
        return value

    def encode_marked(self, text: str) -> list[int]:
        """The ids of text rendered from `literal` values: special-token strings as their ids where the text spells
        them (the template's markup), marked ones as the ordinary tokens that spell them. Text without a mark:
        exactly `encode(text)`. Like the tokenizer, it splits the text at its special tokens and encodes each piece
        between them alone, so the pieces without marks get the ids `encode` gives them."""
        if TEXT_LT not in text:
            return self.encode(text)
        split, marks, back = self._specials
        ids: list[int] = []
        pos = 0
        for m in [*split.finditer(text), None]:
            piece = text[pos:m.start() if m else len(text)]
            if piece:
                restored = marks.sub(lambda x: back[x.group()], piece)
                ids += self.encode(piece) if restored == piece else \
                    self._literal_backend.encode(restored, add_special_tokens=False).ids
            if m:
                ids.append(self._tok.token_to_id(m.group()))
                pos = m.end()
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False, marked: bool = False) -> str:
        """marked: the text the output parser reads (`parsing`), where only a control token's own id spells
        control-token text: every "<" that ordinary tokens wrote is `TEXT_LT` (a Unicode noncharacter, one
        character, so offsets are those of the plain text), and a `TEXT_LT` they wrote is U+FFFD. Ordinary tokens
        that spell "<turn|>" are then text, not the end of a turn. `parsing.unmark` gives the plain text back."""
        ids = [int(i) for i in ids]
        vocab = self.vocab_size  # (a call into the tokenizer: once, not per id)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(i for i in ids if i < 0 or i >= vocab)
            raise InputError(f"token id {bad} is outside the vocabulary (size {vocab}); check the model/tokenizer pairing")
        plain = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if not marked:
            return plain
        if self._added.keys().isdisjoint(ids):  # ordinary tokens only
            return plain.replace(TEXT_LT, "\ufffd").replace("<", TEXT_LT)
        parts, run = [], []
        for i in ids + [-1]:
            if skip_special_tokens and i in self._special_ids:
                continue  # dropped before decoding, as the plain decode drops it: the ids around it are one run
            if i in self._added or i < 0:
                if run:
                    parts.append(self._tok.decode(run).replace(TEXT_LT, "\ufffd").replace("<", TEXT_LT))
                    run = []
                if i >= 0:
                    parts.append(self._added[i])
            else:
                run.append(i)
        text = "".join(parts)
        plain = plain.replace(TEXT_LT, "\ufffd")
        # a decoder that reads across an added token (one stripping a run's leading space) gives other text: then
        # the plain text, where control-token text is read as control tokens
        return text if text.replace(TEXT_LT, "<") == plain else plain

    def decode_prefixes(self, ids: Sequence[int], first: int, skip_special_tokens: bool = False) -> list[str]:
        """[decode(ids[:k]) for k in first + 1 .. len(ids)] (plain text) in one call into the tokenizer, which decodes
        them outside the GIL; ids already checked by a `decode` of them all."""
        ids = [int(i) for i in ids]
        return self._tok.decode_batch([ids[:k] for k in range(first + 1, len(ids) + 1)],
                                      skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False, marked: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens, marked=marked)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            enable_thinking: bool = False, tools: Any = None,
                            tokenize: bool = True, marked: bool | None = None,
                            **template_kwargs: Any) -> list[int] | str:
        """Render the chat template; ids (default) or the prompt text (`tokenize=False`).

        The messages' and tools' text never becomes control tokens (module docstring): the ids encode it as text.
        `tokenize=False, marked=True` gives the text `encode_marked` takes to those ids (for a caller that encodes
        it in its own way); `tokenize=False` alone the plain text, to read.

        Extra keyword arguments become template variables (e.g. `empty_thought_block=False`), except
        `continue_final_message=True`: the prompt ends inside the last message, for the model to continue it
        (`chat.render_chat_template`). The template writes `<bos>` itself, so ids are encoded without extra
        special tokens.
        """
        from .chat import render_chat_template
        if tokenize if marked is None else marked:
            messages, tools = self.literal(messages), self.literal(tools)
        text = render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            **{"pad_token": self.pad_token or "", "unk_token": self.unk_token or "", **template_kwargs})
        return self.encode_marked(text) if tokenize else text


class StreamDecoder:
    """Incremental detokeniser: `feed(new_ids)` returns the newly completed text.

    Uses a small window of already-emitted ids as left context, so decoders that treat the
    start of a sequence specially (leading-space stripping) and byte-fallback tokens that
    complete a character only together produce the same text as one full `decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, marked: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._marked = marked  # `Tokenizer.decode(marked=True)`: the output parser's text
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0    # ids before this index have been emitted
        self._extra = 0   # chars past decode(ids[prefix:read]) already emitted (partial tail)
        self._end = 0     # ids before this are not held (the last feed's; a byte run after it waits)
        self._pending = 0  # ids at the end whose text ends `feed_ends` has not given yet
        self._last_end = 0  # the last end it gave
        self.text = ""    # everything emitted so far

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, marked=self._marked)

    def feed(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the text they complete ("" while nothing new is complete). A run of byte-fallback
        ids at the end (with skipped special ids inside it) waits for the id after it: the run decodes as a whole
        (`Tokenizer.byte_ids`), so "#" as a byte is "#" alone but U+FFFD before an invalid continuation byte."""
        self._ids.extend(int(i) for i in new_ids)
        end, tok = len(self._ids), self._tokenizer
        while end > self._read and (self._ids[end - 1] in tok.byte_ids
                                    or self._skip and self._ids[end - 1] in tok.special_ids):  # (skipped: no text)
            end -= 1
        self._end = max(end, self._read)
        if self._read >= end:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:end])
        if not full_text.startswith(prefix_text):
            # the new ids changed text already emitted (a tokenizer whose decoding looks further back than byte
            # runs): what was emitted stands, and decoding goes on from the first id not emitted
            self._prefix, self._extra = self._read, 0
            prefix_text, full_text = "", self._decode(self._ids[self._read:end])
        done = len(prefix_text) + self._extra  # chars of full_text already emitted
        if full_text.endswith(_REPLACEMENT):
            # a multi-byte character may still be incomplete: emit only what precedes it
            stable = full_text.rstrip(_REPLACEMENT)
            delta = stable[done:] if len(stable) > done else ""
            self._extra += len(delta)
        else:
            delta = full_text[done:]
            self._prefix, self._read, self._extra = self._read, end, 0
        self.text += delta
        return delta

    def feed_ends(self, new_ids: Iterable[int]) -> tuple[str, list[int]]:
        """`feed`, and where the text of each id decided now ends in `text`: the ids held at the last call, then the
        new ones, up to a byte run still held at the end (those come with a later call, or `flush_ends`). An id owns
        the characters that decoding it, after the ids before it, adds for good (a byte that only completes a
        character with the next id owns none; the next one owns the character)."""
        window = self._window()
        delta = self.feed(new_ids)
        return delta, self._ends(*window, self._end)

    def _window(self) -> tuple[int, int, int]:
        """Before a feed or flush: (the window's first id, its text position, the first id without a text end)."""
        done = len(self._decode(self._ids[self._prefix:self._read])) + self._extra  # window characters emitted
        return self._prefix, len(self.text) - done, len(self._ids) - self._pending

    def _ends(self, start: int, base: int, first: int, stop: int) -> list[int]:
        """The text ends of ids [first, stop), decoding from id `start` (at text position `base`). Plain text: the
        marked text has the same length (`Tokenizer.decode`), so the same ends."""
        tok, window = self._tokenizer, self._ids[start:stop]
        full = tok.decode(window, skip_special_tokens=self._skip)
        parts = tok.decode_prefixes(window, first - start, skip_special_tokens=self._skip) if first < stop else []
        ends, last = [], self._last_end
        for i, part in zip(range(first, stop), parts):
            k = len(part) if full.startswith(part) else len(os.path.commonprefix([part, full]))
            if i + 1 < stop and part.endswith(_REPLACEMENT):  # an incomplete character: not owned yet
                k = min(k, len(part.rstrip(_REPLACEMENT)))
            last = min(max(last, base + k), len(self.text))
            ends.append(last)
        self._pending = len(self._ids) - stop
        self._last_end = last
        return ends

    def flush_ends(self) -> tuple[str, list[int]]:
        """`flush`, and the text ends of the ids not yet given one (the held byte run at the end)."""
        window = self._window()
        delta = self.flush()
        return delta, self._ends(*window, len(self._ids))

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if full_text.startswith(prefix_text):
            delta = full_text[len(prefix_text) + self._extra:]
        else:  # pathological: fall back to the whole text
            whole = self._decode(self._ids)
            delta = whole[len(self.text):] if whole.startswith(self.text) else ""
        self._prefix, self._read, self._extra = self._read, len(self._ids), 0
        self.text += delta
        return delta
