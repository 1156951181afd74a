"""Training data sources: chat JSONL, plain text, and task generators (sudoku).

Every source maps (step, global example index) -> one (prompt ids, response ids) pair,
deterministically, so a resumed run or a data-parallel rank sees exactly the examples it would
have seen in one uninterrupted single-process run. The objective (objective.collate) does the
canvas split, EOS fill and corruption.

- `ChatJsonlSource`: rows `{"messages": [...]}`; everything before the final assistant turn is the
  prompt, rendered with the model's chat template (`add_generation_prompt=True`, so the
  `<|turn>model\\n` header is prompt, never supervised, spec §3); the response is the final assistant
  turn as the model writes it: the content + the turn-close token (`<turn|>` when the tokenizer has it,
  else EOS). A row may declare `tools` and `enable_thinking` (rendered by the template as at inference); the
  final message may carry `reasoning_content` (a thought channel before the content) and `tool_calls`
  (then the turn ends `<|tool_response>`, where the model stops for the tool). Rows may instead give
  `{"prompt": str, "completion": str}`.
- `TextSource`: plain text (a .txt file: one document per blank-line-separated paragraph, or .jsonl
  with a "text" field); prompt = BOS + the first `prompt_tokens` tokens, response = the rest + EOS (the
  document's end is an end of text the model must learn to write, spec §2.4). `prompt_tokens` may be a (lo, hi)
  range: each example then gets its own length, drawn from a seeded RNG, so the model also learns to continue
  short prompts. A document longer than one example (`max_tokens`, and the model's positions) is cut into several
  at whole canvases: a cut gets no EOS and no EOS fill, so the model never learns an end where the text goes on.
- `SudokuSource`: generated puzzles from `blockpress.tasks.sudoku` (never a held-out solution).

Checked when the data is read (the file and line named, one line each): an empty file, a folder given as a file,
text the model's tokenizer mostly cannot read (`<unk>`), and a chat row longer than the model's positions
(`max_position_embeddings`) once cut to `max_prompt` / `max_canvases`.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from ..errors import BlockpressError, InputError
from ..tasks import read_data_file

Example = tuple  # (prompt ids, response ids) or (prompt ids, response ids, held flags per response token)


class Source:
    """Deterministic example index -> (prompt, response)."""

    def example(self, step: int, index: int) -> Example:  # pragma: no cover - interface
        raise NotImplementedError

    def batch(self, step: int, indices: range) -> list[Example]:
        return [self.example(step, i) for i in indices]


class ListSource(Source):
    """A finite list of examples, visited in a seeded permutation per epoch (batch_size fixes the order).

    bucket K > 0: batches of similar lengths. The epoch's permutation is cut into windows of K batches;
    each window is sorted by example length, cut into batches, and the batches are shuffled (seeded).
    A batch is padded to its longest example, so with lengths as varied as chat prompts (one-line
    questions beside tool declarations and earlier turns) this roughly halves the work per step, while
    every example is still seen once per epoch in a seeded random batch order."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int = 0, bucket: int = 0,
                 name: str | None = None):
        """name: what the examples were read from, for the error an empty list is."""
        if not examples:
            raise InputError(f"{name or 'the training data'} is empty; give at least one example")
        self.examples, self.batch_size, self.seed, self.bucket = examples, batch_size, seed, bucket
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            p = list(range(len(self.examples)))
            rng = random.Random(f"{self.seed}/{epoch}")
            rng.shuffle(p)
            if self.bucket:
                B, w = self.batch_size, self.bucket * self.batch_size
                size = lambda i: len(self.examples[i][0]) + len(self.examples[i][1])  # noqa: E731
                out = []
                for s in range(0, len(p), w):
                    window = sorted(p[s:s + w], key=size)
                    batches = [window[j:j + B] for j in range(0, len(window), B)]
                    rng.shuffle(batches)
                    out += [i for b in batches for i in b]
                p = out
            self._perms = {epoch: p}
        return self._perms[epoch]

    def example(self, step: int, index: int) -> Example:
        k = step * self.batch_size + index
        epoch, j = divmod(k, len(self.examples))
        return self.examples[self._perm(epoch)[j]]

    def __len__(self):
        return len(self.examples)


def check_vocabulary(examples: list[Example], tokenizer, name) -> None:
    """Refuse data that the model's tokenizer mostly reads as <unk> (English text on the Sudoku model): every such
    token is the same id, and training on it teaches nothing but <unk>."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    total = sum(len(ex[0]) + len(ex[1]) for ex in examples)
    n = sum(ex[0].count(unk) + ex[1].count(unk) for ex in examples)
    if total and 2 * n > total:
        raise InputError(f"{name}: {100 * n / total:.0f} % of its tokens are unknown to the model's tokenizer "
                         f"(<unk>): the text is not in the model's vocabulary; train a model whose tokenizer covers "
                         "it (another --model, or --tokenizer from scratch)")


def trained_length(prompt: list, response: list, canvas_length: int, max_canvases: int | None = None) -> int:
    """Positions one example takes in training: its prompt, then its response in whole canvases (the last one
    EOS-filled, at most `max_canvases`)."""
    n = -(-len(response) // canvas_length)
    return len(prompt) + min(n, max_canvases or n) * canvas_length


JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # (datasets' `to_json` writes JSON Lines as .json)
TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow", ".xlsx")


def is_jsonl(path: str | Path) -> bool:
    """Whether a data file is read as JSON Lines (.jsonl, .json, .ndjson, in any case) rather than as plain text; a
    table format is refused (it was read as plain text: the model trained on its raw lines)."""
    suffix = Path(path).suffix.lower()
    if suffix in TABLE_SUFFIXES:
        raise InputError(f"{path}: train reads JSON Lines (.jsonl, one JSON object per line) or plain text (.txt), not "
                         f"{suffix[1:]}; convert it (e.g. datasets: Dataset.from_csv(path).to_json('data.jsonl'))")
    return suffix in JSONL_SUFFIXES


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    """[(where, row)]: `where` is "path:line" for error messages; every row must be a JSON object."""
    rows = []
    for n, line in enumerate(read_data_file(path).splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise InputError(f"{path}:{n} is not valid JSON ({getattr(e, 'msg', 'nested too deeply')}); one JSON "
                                 "object per line") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{n} is a JSON {type(row).__name__}, not an object; one JSON object "
                                 "per line")
            rows.append((f"{path}:{n}", row))
    return rows


def _message(m, where: str) -> dict:
    content_types = (str, list, type(None), dict) if isinstance(m, dict) and m.get("role") == "tool" \
        else (str, list, type(None))  # a tool's response may be a JSON object, as the template renders it
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), content_types):
        raise InputError(f"{where}: each message must be an object with a string 'role' and a 'content' (a string "
                         f"or a list of parts), got {json.dumps(m)[:80]}")
    return m


def _check_openai_fields(row: dict, msgs: list, where: str) -> None:
    """OpenAI fine-tuning fields that would train something else than the row says: refused in one line (they were
    dropped: a legacy function call trained an empty reply)."""
    if row.get("functions") is not None or any(m.get("function_call") is not None for m in msgs):
        raise InputError(f"{where}: 'functions' / 'function_call' (OpenAI's deprecated function calling) are not read; "
                         "give the functions as 'tools' and the call as the assistant message's 'tool_calls'")
    final = msgs[-1]
    if final.get("weight", 1) == 0:
        raise InputError(f"{where}: the final assistant message has weight 0 (not to be trained), and a row trains "
                         "its final assistant message alone: drop the row, or end it at the turn to train")
    if not _text(final.get("content")).strip() and not final.get("tool_calls") and not final.get("reasoning_content"):
        raise InputError(f"{where}: the final assistant message has no text and no tool calls: it would teach the "
                         "model to answer nothing; give the reply, or drop the row")


def chat_example(tokenizer, row: dict, where: str = "a chat row") -> Example:
    """One chat row -> (prompt ids via the chat template, final assistant turn ids as the model writes it).

    The row may declare `tools` (OpenAI function declarations, rendered in the system turn) and
    `enable_thinking`; the final assistant message may carry `reasoning_content` (thinking rows only) and
    `tool_calls`. See `assistant_turn_text` for the supervised text. What the template or the text checks refuse is
    named with `where` (the file and line), and the final message by its index in the row."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list):
            raise InputError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        msgs = [_message(m, where) for m in msgs]
        if not msgs or msgs[-1].get("role") != "assistant":
            raise InputError(f"{where}: a chat row must end with an assistant message (the supervised turn)")
        _check_openai_fields(row, msgs, where)
        tools, thinking = row.get("tools"), bool(row.get("enable_thinking", False))
        try:
            prompt = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True,
                                                   enable_thinking=thinking, tools=tools)
        except BlockpressError as e:
            raise InputError(f"{where}: {e}") from None
        final = tokenizer.literal(msgs[-1])  # its text stays text, as the prompt's does (Tokenizer.literal)
        last = f"messages[{len(msgs) - 1}]"  # (the final message is rendered alone: its errors say messages[0])
        try:
            if tokenizer.token_to_id("<turn|>") is None:  # not the Gemma 4 turn format: the content + EOS
                if final.get("tool_calls") or final.get("reasoning_content"):
                    raise InputError("tool calls and reasoning need a Gemma 4 tokenizer (<turn|>, <|tool_call>)")
                return list(prompt), tokenizer.encode_marked(_text(final.get("content"))) + _close(tokenizer)
            return list(prompt), tokenizer.encode_marked(assistant_turn_text(tokenizer.chat_template, final,
                                                                             thinking, last))
        except BlockpressError as e:
            message = str(e).replace("messages[0]", last)
            raise InputError(message if message.startswith(where) else f"{where}: {message}") from None
    if "prompt" in row and "completion" in row:
        answer = row["completion"]
        if not isinstance(answer, str) or not isinstance(row["prompt"], str):
            raise InputError(f"{where}: 'prompt' and 'completion' must be strings")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                               add_generation_prompt=True, tokenize=True)
        return list(prompt), tokenizer.encode_marked(tokenizer.literal(answer)) + _close(tokenizer)
    raise InputError(f"{where}: a JSONL row needs 'messages' (chat) or 'prompt' + 'completion'")


def _text(content) -> str:
    """Message content as text: a string, or the text parts of a list, in order."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def _close(tokenizer) -> list[int]:
    close = tokenizer.token_to_id("<turn|>")
    close = close if close is not None else tokenizer.eos_token_id
    return [close] if close is not None else []


def assistant_turn_text(chat_template: str, message: dict, thinking: bool = False, where: str = "a chat row") -> str:
    """The final assistant turn as the model writes it after the generation prompt, special tokens as text:
    `[<|channel>thought\\nREASONING<channel|>]CONTENT[TOOL CALLS]` + `<turn|>`, or + `<|tool_response>` when
    the turn ends in tool calls (the model stops there; the tool's answer is appended to the open turn).
    Content and calls are rendered by the model's chat template (the message alone, its
    `<|turn>model\\n` header and closing `<turn|>\\n` cut off), so calls use the template's argument notation."""
    from ..chat import render_chat_template

    content = _text(message.get("content"))
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning and not thinking:
        raise InputError(f"{where}: the final assistant message has reasoning_content but the row does not set "
                         "\"enable_thinking\": true; set it (or drop the reasoning)")
    head, tail = "<|turn>model\n", "<turn|>\n"
    body = render_chat_template(chat_template, [{**message, "content": content}],
                                add_generation_prompt=False, bos_token="")
    if not (body.startswith(head) and body.endswith(tail)):
        raise InputError(f"{where}: the chat template does not render an assistant turn as {head!r} ... {tail!r}; "
                         "tool calls and reasoning need the Gemma 4 turn format")
    body = body[len(head):-len(tail)]
    thought = f"<|channel>thought\n{reasoning.strip()}<channel|>" if reasoning else ""
    return thought + body + ("<|tool_response>" if message.get("tool_calls") else "<turn|>")


class ChatJsonlSource(ListSource):
    """Chat rows (`chat_example`), batched by length (`ListSource` bucket, 16 batches a window by default).

    max_prompt: keep the last N prompt tokens of each row. canvas_length + max_positions (the model's
    max_position_embeddings): a row that would train on more positions (`trained_length`, with `max_canvases`) is
    refused, naming its path:line."""

    def __init__(self, path: str | Path, tokenizer, batch_size: int, seed: int = 0, max_prompt: int | None = None,
                 bucket: int = 16, canvas_length: int | None = None, max_positions: int | None = None,
                 max_canvases: int | None = None):
        if tokenizer is None:
            raise InputError("chat JSONL training needs a tokenizer (tokenizer.json in the model folder)")
        exs = []
        for where, r in _read_jsonl(Path(path)):
            p, resp = chat_example(tokenizer, r, where)
            p = p[-max_prompt:] if max_prompt else p
            if canvas_length and max_positions:
                _check_fits(where, p, resp, canvas_length, max_positions, max_canvases)
            exs.append((p, resp))
        check_vocabulary(exs, tokenizer, path)
        super().__init__(exs, batch_size, seed, bucket, name=str(path))


def _check_fits(where: str, prompt: list, response: list, C: int, limit: int, max_canvases: int | None) -> None:
    n = trained_length(prompt, response, C, max_canvases)
    if n <= limit:
        return
    canvases = (n - len(prompt)) // C
    fix = f"--max-prompt {limit - canvases * C} (keep the prompt's last tokens)" if limit - canvases * C > 0 else ""
    if limit - len(prompt) >= C:
        fix += (" or " if fix else "") + f"--max-canvases {(limit - len(prompt)) // C}"
    raise InputError(f"{where}: prompt {len(prompt)} + {canvases} canvas(es) of {C} = {n} tokens, more than the "
                     f"model's {limit} positions (max_position_embeddings); shorten the row"
                     + (f", or cut it with {fix}" if fix else ""))


class TextSource(ListSource):
    """Plain-text documents (see the module docstring). canvas_length: the model's (cuts fall on whole canvases);
    eos_id: the end of text appended at each document's end (default the tokenizer's); an example takes at most
    `max_tokens` positions (and `max_positions`, the model's max_position_embeddings, when given)."""

    def __init__(self, path: str | Path, tokenizer, batch_size: int, seed: int = 0,
                 prompt_tokens: int | tuple[int, int] = 16, max_tokens: int = 1024, *, canvas_length: int,
                 eos_id: int | None = None, max_positions: int | None = None):
        if tokenizer is None:
            raise InputError("text training needs a tokenizer (tokenizer.json in the model folder)")
        path = Path(path)
        if is_jsonl(path):
            docs = []
            for where, r in _read_jsonl(path):
                if "text" not in r:  # dropped without a word before (the file's kind is its first row's)
                    raise InputError(f"{where}: no 'text' field; a text .jsonl holds {{\"text\": ...}} rows, a chat "
                                     "file 'messages' (OpenAI's format; ShareGPT's 'conversations' is not read: "
                                     "convert it) or 'prompt' + 'completion', from its first row")
                if not isinstance(r["text"], str):
                    raise InputError(f"{where}: 'text' must be a string")
                if r["text"]:
                    docs.append(r["text"])
        else:
            docs = [d.strip() for d in read_data_file(path).split("\n\n") if d.strip()]
        lo, hi = (prompt_tokens, prompt_tokens) if isinstance(prompt_tokens, int) else tuple(prompt_tokens)
        if not 0 <= lo <= hi:
            raise InputError(f"prompt_tokens range ({lo}, {hi}) must satisfy 0 <= lo <= hi")
        eos = tokenizer.eos_token_id if eos_id is None else eos_id
        if eos is None:
            raise InputError("text training needs an end-of-text token: the tokenizer has no eos_token")
        C = int(canvas_length)
        budget = min(max_tokens, max_positions or max_tokens)  # positions of one example, BOS included
        rng = random.Random(f"text-prompt/{seed}")
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        if len(bos) + lo + C > budget:  # not even a canvas after the prompt part fits one example
            raise InputError(f"{path}: one example holds {budget} positions, fewer than a prompt part of {lo} tokens"
                             f"{' and BOS' if bos else ''} plus one canvas of {C}: lower --canvas-length or "
                             "--prompt-tokens")
        exs, short = [], 0
        for d in docs:
            whole = tokenizer.encode(d)
            start, before = 0, len(exs)
            while start < len(whole):
                k = rng.randint(lo, hi)
                rest = whole[start:]
                if start and len(rest) <= k:  # a document's tail shorter than the prompt part: still its end
                    k = len(rest) - 1
                # the document's end fits: its response ends in EOS, the last canvas EOS-filled after it
                if len(bos) + k + C * math.ceil((len(rest) - k + 1) / C) <= budget:
                    if len(rest) > k and (k > 0 or bos):
                        exs.append((bos + rest[:k], rest[k:] + [eos]))
                    break
                r = (budget - len(bos) - k) // C * C  # a cut: whole canvases, no end of text, no fill
                if len(rest) - k - r < 1:  # the text ends right at the cut: leave its end (and EOS) a canvas
                    r -= C
                if r < C:
                    raise InputError(f"{path}: a document longer than one example ({budget} positions) cannot be cut "
                                     f"into a prompt of {k} tokens and whole canvases of {C}; lower --prompt-tokens")
                exs.append((bos + rest[:k], rest[k:k + r]))
                start += k + r
            short += len(exs) == before  # no response left after its prompt part: nothing of it trains
        if docs and not exs:
            raise InputError(f"none of the {len(docs)} document(s) in {path} is longer than its prompt part "
                             f"(--prompt-tokens {lo} {hi}); give longer documents (separated by blank lines) "
                             "or lower --prompt-tokens")
        if short:  # left out without a word before
            span = f"{lo}" if lo == hi else f"{lo} {hi}"
            print(f"blockpress train: warning: {short} of {len(docs)} document(s) in {path} are no longer than their "
                  f"prompt part (--prompt-tokens {span}), so nothing of them trains; lower --prompt-tokens, or join "
                  "short paragraphs (documents are separated by blank lines)", file=sys.stderr)
        check_vocabulary(exs, tokenizer, path)
        super().__init__(exs, batch_size, seed, name=str(path))


class SudokuSource(Source):
    """Fresh unique-solution puzzles; example (step, i) comes from its own seeded RNG.

    augment K > 1: generating a unique puzzle costs ~2-60 ms of Python, which would starve a GPU at
    batch 256. So example (step, i) is then base puzzle (step // K, i) under a random symmetry drawn
    from (step, i) (`sudoku.random_symmetry`: band/row/stack/column permutations, transposition, digit
    relabelling): each generated puzzle is seen K times, as K different-looking puzzles, and data costs
    K times less. A transformed solution whose canonical key is held out is redrawn, so the held-out
    split stays unseen under the larger symmetry group too. K = 1 gives the plain stream."""

    def __init__(self, blanks_range: tuple[int, int] = (25, 58), seed: int = 0, stream: str = "train",
                 exclude_keys=None, format: str = "prompt", augment: int = 1):
        from ..tasks import sudoku

        if format not in sudoku.FORMATS:
            raise InputError(f"unknown sudoku format {format!r}; use one of {sudoku.FORMATS}")
        if isinstance(augment, bool) or not isinstance(augment, int) or augment < 1:
            raise InputError(f"augment must be an integer >= 1 (1 = no augmentation), got {augment!r}")
        self.sudoku, self.format, self.augment = sudoku, format, augment
        self.blanks_range, self.seed, self.stream = tuple(blanks_range), seed, stream
        self.exclude = frozenset(sudoku.heldout_keys() if exclude_keys is None else exclude_keys)
        self._bases: dict[tuple[int, int], tuple[str, str]] = {}

    def _puzzle(self, step: int, index: int) -> tuple[str, str]:
        sd = self.sudoku
        if self.augment == 1:
            rng = random.Random(f"sudoku/{self.stream}/{self.seed}/{step}/{index}")
            return next(sd.TrainStream(rng, self.blanks_range, self.exclude))
        key = (step // self.augment, index)
        base = self._bases.get(key)
        if base is None:
            if len(self._bases) > 4096:  # keep the current window's bases only
                self._bases = {k: v for k, v in self._bases.items() if k[0] == key[0]}
            rng = random.Random(f"sudoku/{self.stream}/{self.seed}/base{self.augment}/{key[0]}/{index}")
            base = self._bases[key] = next(sd.TrainStream(rng, self.blanks_range, self.exclude))
        rng = random.Random(f"sudoku/{self.stream}/{self.seed}/sym/{step}/{index}")
        while True:
            sym = sd.random_symmetry(rng)
            solution = sd.apply_symmetry(base[1], sym)
            if sd.canonical_key(solution) not in self.exclude:
                return sd.apply_symmetry(base[0], sym), solution

    def example(self, step: int, index: int) -> Example:
        sd = self.sudoku
        puzzle, solution = self._puzzle(step, index)
        if self.format == "inplace":  # clues held on the canvas, only the blanks are denoised and scored
            prompt, fixed, response = sd.encode_inplace(puzzle, solution)
            return prompt, response, [f >= 0 for f in fixed]
        return sd.encode_prompt(puzzle), sd.encode_target(solution)


class InfillSource(Source):
    """Infill training over another source: with probability `rate` an example holds its whole canvas
    as given context except one random span per canvas, which is denoised and scored alone (the
    `held` flags of objective.collate), as `lm.infill` and the server's insert mode present a gap at
    inference. Other examples pass through unchanged. Deterministic in (seed, step, index)."""

    def __init__(self, inner: Source, canvas_length: int, rate: float, span: tuple[int, int] = (1, 8),
                 seed: int = 0):
        lo, hi = (int(v) for v in span)
        if not 0.0 <= rate <= 1.0:
            raise InputError(f"--infill-rate must be in [0, 1], got {rate}")
        if not 1 <= lo <= hi:
            raise InputError(f"--infill-span ({lo}, {hi}) must satisfy 1 <= lo <= hi")
        self.inner, self.C, self.rate, self.span, self.seed = inner, int(canvas_length), float(rate), (lo, hi), seed

    def example(self, step: int, index: int) -> Example:
        ex = self.inner.example(step, index)
        rng = random.Random(f"infill/{self.seed}/{step}/{index}")
        if rng.random() >= self.rate:
            return ex
        prompt, response = ex[0], ex[1]
        held = list(ex[2]) if len(ex) > 2 else [False] * len(response)
        for start in range(0, len(response), self.C):
            n = min(self.C, len(response) - start)
            size = min(rng.randint(*self.span), n)
            gap = start + rng.randint(0, n - size)
            for j in range(start, start + n):
                held[j] = held[j] or not gap <= j < gap + size
        return prompt, response, held


def build_source(kind: str, path: str | None, tokenizer, batch_size: int, seed: int, **kw) -> Source:
    """kw: sudoku's blanks_range, stream, format, augment; chat's max_prompt; text's prompt_tokens and eos_id; the
    model's canvas_length and max_positions (and max_canvases) for both files."""
    if kind == "sudoku":
        return SudokuSource(kw.get("blanks_range", (25, 58)), seed, kw.get("stream", "train"),
                            format=kw.get("format", "prompt"), augment=kw.get("augment", 1))
    if path is None:
        raise InputError(f"--data {kind} needs a file path")
    fit = {k: kw.get(k) for k in ("canvas_length", "max_positions")}
    if kind == "chat":
        return ChatJsonlSource(path, tokenizer, batch_size, seed, max_prompt=kw.get("max_prompt"),
                               max_canvases=kw.get("max_canvases"), **fit)
    if kind == "text":
        return TextSource(path, tokenizer, batch_size, seed, prompt_tokens=kw.get("prompt_tokens", 16),
                          eos_id=kw.get("eos_id"), **fit)
    raise InputError(f"unknown data kind {kind!r}; use a .jsonl chat file, a .txt file, or 'sudoku'")
