"""Serving logic without HTTP: requests -> prompt ids -> the worker's engine -> OpenAI responses / SSE chunks.

Invariants:
- Streaming and non-streaming responses are assembled by the same `OutputAssembler` from the same
  committed canvases, so for one seed they carry the same text, reasoning and tool calls.
- Generated text is decoded with special tokens kept and split by `blockpress.parsing` into
  `content`, `reasoning_content` and `tool_calls`; every special token of the tokenizer is a
  control token for the parser, so none reaches `content`. Completions decode without specials.
- A completion ends at the first stop id (counted in completion_tokens, never shown), at
  `max_tokens` tokens (canvases are cut there: finish_reason "length"), or at a stop string
  (excluded from the text). When the client goes away or a stop string ends it early, the
  request's handle is cancelled and the engine frees its row at the next canvas boundary.
- Usage: prompt/completion/total tokens plus `denoising_steps` (decoder passes for this request)
  and `tokens_per_forward` (completion tokens per pass).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from ..engine.rows import positions_needed
from ..engine.scheduler import TooManyRows
from ..errors import BlockpressError, InputError, SamplingError
from ..infill import unspaced, whole_canvases
from ..parsing import ToolCall, call_ban, reply_parser
from .budget import encode_within
from .protocol import (APIError, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                       CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       CompletionTokensDetails, FunctionCall, Limits, ModelCard, ModelList, PromptTokensDetails,
                       ResponseMessage, ResponseToolCall, Sampling, Usage)
from .worker import Handle, Job, QueueFull, RowCommit, RowDraft, RowError, ShuttingDown, Worker

Disconnected = Callable[[], Awaitable[bool]]
DISCONNECT_POLL = 0.5  # seconds between checks that a request's client is still there
LOGPROB_FLOOR = -9999.0  # what a -inf (or a lower) log-probability is reported as: JSON has no infinities


def _logprob(v: float) -> float:
    return v if math.isfinite(v) and v > LOGPROB_FLOOR else LOGPROB_FLOOR
MODEL_ALIAS = "blockpress"  # a request's `model` may always say this: client code need not know the folder name


# ----------------------------------------------------------------------------- text assembly


class StopStrings:
    """Cut text before the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if self.hit or not self.stops:
            return "" if self.hit else text
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        keep = len(self.buf) - self.hold
        out, self.buf = (self.buf[:keep], self.buf[keep:]) if keep > 0 else ("", self.buf)
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit else self.buf), ""
        return out


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    logprobs: list["TokenLogprob"] = field(default_factory=list)  # entries of the tokens whose text ended here


@dataclass
class TokenLogprob:
    """One returned token's log-probability: `text` is what it contributes to the returned text (content), so the
    entries' texts joined are the text; `offset` where that starts in it."""

    id: int
    logprob: float
    top: list[tuple[int, float]]
    text: str
    offset: int


class LogprobAligner:
    """Aligns committed tokens (with their log-probabilities) with the returned text.

    Each token owns a span [off, off + len) of the decoded text (`StreamDecoder.feed_ends`; an incomplete UTF-8
    character: an empty span, the character going to the token that completes it). The returned text (content) is made of that text: in completions character for character, in chat what
    the parser keeps as content (`StreamingParser.content_sources` gives each content character's offset), both
    cut by a stop string. A token is returned when some of its characters are content before the cut (its text:
    those characters); tokens of an empty span go with the next token that has text (completions: also the
    trailing ones, when no stop string cut the text). Reasoning, markup and tool-call tokens are not returned."""

    def __init__(self, completion: bool):
        self.completion = completion
        self.ids: list[int] = []
        self.values: list[tuple[float, list]] = []
        self.offs: list[int] = []
        self.lens: list[int] = []
        self.c0: list[int | None] = []  # per token: its first and past-last content character (None: none)
        self.c1: list[int | None] = []
        self.decoded = 0  # characters decoded so far
        self.content = ""  # the content stream before the stop-string cut
        self.next = 0  # the first token not yet decided
        self.entries: list[TokenLogprob] = []

    def token(self, t: int, value, end: int) -> None:
        """The next token: its (logprob, alternatives) and where its span of the decoded text ends."""
        self.ids.append(t)
        self.values.append(value if value is not None else (float("nan"), []))
        self.offs.append(self.decoded)
        self.lens.append(end - self.decoded)
        self.c0.append(None)
        self.c1.append(None)
        self.decoded = end

    def tail(self, text: str) -> None:
        """Text the decoder emits at the end (held bytes): the last token's."""
        self.decoded += len(text)
        if self.ids:
            self.lens[-1] = self.decoded - self.offs[-1]

    def content_from(self, text: str, sources) -> None:
        """New content characters (before the stop-string cut) and the decoded offset each came from."""
        for ch, src in zip(text, sources):
            i = bisect.bisect_right(self.offs, src) - 1
            k = len(self.content)
            self.content += ch
            if i >= 0:
                self.c0[i] = k if self.c0[i] is None else self.c0[i]
                self.c1[i] = k + 1

    def release(self, resolved: int, released: int, cut: int | None, final: bool) -> list[TokenLogprob]:
        """Entries decided since the last call: `resolved` decoded characters are decided by the parser,
        `released` content characters were sent, `cut` the content's length where a stop string ended it."""
        final = final or cut is not None
        out = []
        n = len(self.ids)
        while self.next < n:
            j = self.next
            while j < n and self.lens[j] == 0:
                j += 1
            group = range(self.next, min(j + 1, n))
            if j == n:  # only empty spans left: returned with a completion's text when nothing cut it
                if not final:
                    break
                if self.completion and (cut is None or self.decoded < cut):
                    out += [self._entry(i, "", self.decoded) for i in group]
                self.next = n
                break
            if not final and self.offs[j] + self.lens[j] > resolved:
                break
            c0, c1 = self.c0[j], self.c1[j]
            if c0 is not None and cut is not None and c0 >= cut:
                self.next = n  # everything after the cut is not returned
                break
            if c0 is not None and not final and c1 > released:
                break  # the stop-string check still holds its text back
            if c0 is not None:
                end = c1 if cut is None else min(c1, cut)
                out += [self._entry(i, "", c0) for i in group[:-1]]
                out.append(self._entry(j, self.content[c0:end], c0))
            self.next = j + 1
        self.entries += out
        return out

    def _entry(self, i: int, text: str, offset: int) -> TokenLogprob:
        lp, top = self.values[i]
        return TokenLogprob(self.ids[i], lp, top, text, offset)


@dataclass
class Final:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    completion_tokens: int
    last: Delta = field(default_factory=Delta)
    logprobs: list[TokenLogprob] | None = None  # every returned token's (None: not asked)


class OutputAssembler:
    """Committed token canvases -> text deltas -> final OpenAI fields. `chat=False`: plain text."""

    def __init__(self, tokenizer, stop_ids, max_tokens: int, stop: list[str] | None = None, chat: bool = True,
                 logprobs: bool = False, one_call: bool = False, drop_space: bool = False):
        """logprobs: align the tokens' log-probabilities (`feed(canvas, logprobs)`) with the text: each Delta
        carries the entries of the tokens whose text ended in it, `Final.logprobs` all of them. one_call: keep
        the reply's first tool call only (`parallel_tool_calls: false`). drop_space (plain text): the text does
        not begin with a space (insert mode: the prompt's own, laid out in the hole)."""
        self.drop_space = drop_space
        self._decoded = 0  # plain text: characters decoded so far (a dropped space is not returned)
        self.one_call = one_call
        self.stop_ids = set(stop_ids or ())
        self.max_tokens = max_tokens
        self.chat = chat
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=not chat, marked=chat)  # chat: the parser's text
        self.parser = reply_parser(tokenizer, track_sources=logprobs) if chat else None
        self.aligner = LogprobAligner(completion=not chat) if logprobs else None
        self._waiting: list = []  # (token, logprob) fed, its span not yet decided (a byte run the decoder holds)
        self._released = 0  # content characters sent
        self.stopper = StopStrings(stop or [])
        self.tokens: list[int] = []
        self.done = False
        self.cut = False  # a grammar closed the output early for max_tokens: it finishes with "length"
        self.finish_reason = "length"
        self.content: list[str] = []
        self._final: Final | None = None

    def feed(self, canvas: list[int], logprobs: list | None = None) -> Delta:
        """One committed canvas (in order), with its tokens' log-probabilities (per position, as
        `RowCommit.logprobs`) when the assembler aligns them. Returns the new text; sets `done` at a stop.
        With stop strings the tokens go in one at a time, so that the reply (and `completion_tokens`) ends at the
        token that completes a stop string, not at the canvas's end."""
        if not self.stopper.stops or len(canvas) <= 1:
            return self._feed(canvas, logprobs)
        out = Delta()
        for k, t in enumerate(canvas):
            if self.done:
                break
            d = self._feed([t], None if logprobs is None else logprobs[k:k + 1])
            out.reasoning, out.content = out.reasoning + d.reasoning, out.content + d.content
            out.logprobs += d.logprobs
        return out

    def _feed(self, canvas: list[int], logprobs: list | None) -> Delta:
        take: list[int] = []
        for t in canvas:
            if self.done:
                break
            self.tokens.append(t)
            if t in self.stop_ids:
                self.done, self.finish_reason = True, "stop"
                break
            take.append(t)
            if len(self.tokens) >= self.max_tokens:
                self.done = True
        if self.aligner is None:
            return self._text(self.decoder.feed(take))
        self._waiting += [(t, logprobs[k] if logprobs is not None else None) for k, t in enumerate(take)]
        text, ends = self.decoder.feed_ends(take)  # the same text, and the span of each token decided now
        self._align(ends)
        return self._text(text)

    def _align(self, ends: list[int]) -> None:
        """The tokens whose spans the decoder decided (the first len(ends) waiting) to the aligner."""
        for (t, value), end in zip(self._waiting, ends):
            self.aligner.token(t, value, end)
        del self._waiting[:len(ends)]

    def _text(self, text: str, final: bool = False) -> Delta:
        if self.parser is None:
            d = Delta(content=unspaced(text, self.drop_space and self._decoded == 0))  # (the first text only)
            skip = len(text) - len(d.content)
            if self.aligner is not None:
                self.aligner.content_from(d.content, range(self._decoded + skip, self._decoded + len(text)))
            self._decoded += len(text)
        else:
            n = len(self.parser.content_sources or ())
            p = self.parser.feed(text)
            d = Delta(p.reasoning, p.content)
            if self.aligner is not None:
                self.aligner.content_from(p.content, self.parser.content_sources[n:])
        d.content = self.stopper.feed(d.content)
        if self.stopper.hit:
            self.done, self.finish_reason = True, "stop"
        self.content.append(d.content)
        self._released += len(d.content)
        self._release(d, final)
        return d

    def _release(self, d: Delta, final: bool) -> None:
        if self.aligner is not None:
            resolved = self.aligner.decoded if self.parser is None else self.parser.resolved
            d.logprobs += self.aligner.release(resolved, self._released,
                                               self._released if self.stopper.hit else None, final)

    def finish(self) -> Final:
        """Flush held-back text and parse tool calls; idempotent."""
        if self._final is not None:
            return self._final
        self.done = True
        if self.aligner is None:
            flushed = self.decoder.flush()
        else:
            flushed, ends = self.decoder.flush_ends()
            self._align(ends)
            self.aligner.tail(self.decoder.text[self.aligner.decoded:])  # an incomplete character: the last token's
        last = self._text(flushed)
        calls: list[ToolCall] = []
        reasoning = None
        if self.parser is not None:
            n = len(self.parser.content_sources or ())
            end = self.parser.finish(self.finish_reason)
            if self.aligner is not None:
                self.aligner.content_from(end.content, self.parser.content_sources[n:])
            tail = self.stopper.feed(end.content)
            last.reasoning += end.reasoning
            last.content += tail
            self.content.append(tail)
            self._released += len(tail)
            # a stop string cuts the calls after it, not those before it
            calls = [c for c, at in zip(end.tool_calls, self.parser.call_positions)
                     if not self.stopper.hit or at <= self._released]
            calls = calls[:1] if self.one_call else calls
            reasoning = self.parser.result.reasoning
        tail = self.stopper.flush()
        last.content += tail
        self.content.append(tail)
        self._released += len(tail)
        self._release(last, final=True)
        # the budget ended the reply (a grammar closed early for it, or max_tokens ran out, after a call too: its
        # next call may be cut): "length", as OpenAI says whenever the limit ended generation; a stop string after a
        # call keeps "tool_calls"
        budget = self.cut or (self.finish_reason == "length" and not self.stopper.hit)
        reason = "length" if budget else "tool_calls" if calls else "stop" if self.stopper.hit else self.finish_reason
        self._final = Final("".join(self.content), reasoning, calls, reason, len(self.tokens), last,
                            None if self.aligner is None else self.aligner.entries)
        return self._final


# ----------------------------------------------------------------------------- the serving object


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _Run:
    """A submitted request: its handle, prompt size and the pass count so far."""

    handle: Handle
    prompt_tokens: int
    passes: int = 0
    complete: bool = False  # the engine finished the row (no cancel needed)
    gone: bool = False  # its client hung up before the reply was complete


class ClientGone(Exception):
    """A non-streaming request's client hung up: there is no reply to send (the app answers 499, nginx's "client
    closed request", which only the metrics see)."""


class Stream:
    """A streamed reply's SSE lines (`gen`, an async generator over `runs`) that frees its runs however it ends:
    `release()` (also `aclose()`) cancels the runs its generator did not finish or free, as abandoned. A generator
    frees its runs in its own `finally`, but one never started has none to run: a client gone before the server
    began the response (Starlette then cancels it unstarted) left its rows queued, to run to the end for nobody."""

    def __init__(self, gen: AsyncIterator[str], runs: list[_Run]):
        self.gen, self.runs = gen, runs

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        return await self.gen.__anext__()

    async def aclose(self) -> None:
        await self.gen.aclose()
        self.release()

    def release(self) -> None:
        for run in self.runs:
            if not run.handle.cancelled:
                OpenAIServing._release(run, abandoned=True)


def _check_tool_replies(messages: list[dict]) -> None:
    """A tool message answers a call of the assistant message with `tool_calls` before it (only tool messages
    between), and its `tool_call_id`, where given, is one of those calls' ids: OpenAI's rule. Otherwise the prompt
    would hold a tool response naming no function, or another call's. (Without an id, the n-th reply answers the
    n-th call, as the chat template reads it.)"""
    ids: list[str] | None = None  # the calls of the assistant turn the tool messages answer, by id
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            ids = [c["id"] for c in calls if c.get("id")] if calls else None
        elif m["role"] == "tool":
            if ids is None:
                raise APIError(400, f"messages.{i}: a tool message must answer a call of an assistant message with "
                               "tool_calls before it (only tool messages between); send that assistant message "
                               "first", param=f"messages.{i}", code="invalid_value")
            cid = m.get("tool_call_id")
            if cid is not None and ids and cid not in ids:
                raise APIError(400, f"messages.{i}.tool_call_id: {cid!r} is not the id of a call in the assistant "
                               f"message before it ({', '.join(map(repr, ids))}); send the id of the call it answers",
                               param=f"messages.{i}.tool_call_id", code="invalid_value")
        else:
            ids = None


class OpenAIServing:
    """Turns validated requests into engine jobs and engine events into OpenAI responses."""

    def __init__(self, lm, worker: Worker, model_name: str, limits: Limits | None = None,
                 defaults: dict[str, Any] | None = None, metrics=None):
        """defaults: server-wide sampling overrides (reference names) over the checkpoint's; stop and
        pad ids default to the checkpoint's, else the tokenizer's <eos>/<turn|> and <pad>."""
        if lm.tokenizer is None:
            raise BlockpressError("this model has no tokenizer.json; the server needs one to read and write text")
        self.lm, self.tok, self.worker = lm, lm.tokenizer, worker
        self.model_name = model_name
        self.created = int(time.time())  # the model cards' `created`: when this server loaded it
        self.limits = limits or Limits()
        self.metrics = metrics
        self.defaults = {**lm.generation_defaults, **lm.text_defaults(), **(defaults or {})}
        lm.generation_config(**self.defaults)  # validate the server-wide defaults once, at startup
        self._pieces: dict[int, str] = {}
        self.engine_error: str | None = None  # why the last generation failed (/health); None after a success

    # ---------------------------------------------------------------- requests -> jobs
    def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    def model(self, name: str) -> ModelCard:
        """GET /v1/models/{name}: the served model's card (by its id or the alias), else 404."""
        self._check_model(name)
        return self._card()

    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, canvas_length=self.lm.canvas_length,
                         chat=self.tok.is_chat, max_model_len=self.lm.config.text.max_position_embeddings)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, MODEL_ALIAS):
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}' "
                           f"(also answering to '{MODEL_ALIAS}')", param="model", code="model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not self.tok.is_chat:
            raise APIError(400, f"'{self.model_name}' is a plain text model (no chat template); use /v1/completions",
                           param="messages", code="model_not_chat")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        _check_tool_replies(messages)
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=req.generation_prompt,
                                                continue_final_message=req.continue_final_message,
                                                enable_thinking=req.enable_thinking, tools=req.offered_tools,
                                                tokenize=False, marked=True)  # messages' text stays text
        except BlockpressError as e:  # a message the template cannot take: named by its path ("messages[1]...")
            where = re.match(r"messages(\[\d+\]|\.\w+)*", str(e))
            raise APIError(400, str(e), param=re.sub(r"\[(\d+)\]", r".\1", where.group()) if where else "messages",
                           code="invalid_value") from None
        return self._encode_within_limit(text, "messages", self.tok.encode_marked)

    @property
    def prompt_limit(self) -> int:
        """The most tokens a prompt may have: this server's `--max-prompt-tokens`, and what the model's positions
        leave for the one canvas a reply needs at least."""
        return min(self.limits.max_prompt_tokens, self.worker.scheduler.max_positions - self.lm.canvas_length)

    def _over_limit(self, what: str, param: str) -> APIError:
        """The 400 of a prompt over `prompt_limit` (`what`: its size, e.g. "more than 4064")."""
        P, C = self.worker.scheduler.max_positions, self.lm.canvas_length
        why = "this server's limit (--max-prompt-tokens)" if self.limits.max_prompt_tokens <= P - C else \
            f"what the model's {P} positions leave for a reply's first canvas of {C}"
        fix = "shorten the messages or the tool schemas" if param == "messages" else "shorten the prompt"
        return APIError(400, f"the prompt has {what} tokens; at most {self.prompt_limit} fit, {why}: {fix}",
                        param=param, code="context_length_exceeded")

    def _encode_within_limit(self, text: str, param: str, encode=None) -> list[int]:
        """The prompt's ids (`encode`, default the tokenizer's); a prompt surely over `prompt_limit` is refused
        after counting about that many tokens."""
        ids = encode_within(encode or self.tok.encode, text, self.prompt_limit)
        if ids is None:
            raise self._over_limit(f"more than {self.prompt_limit}", param)
        return ids

    def _fit(self, prompts: list[list[int]], sampling: Sampling, prompt_field: str) -> None:
        """Check that the prompts fit the model's positions with the reply's canvases. A budget the request did not
        give (`sampling.budget_field` None) is cut to the whole canvases the longest prompt leaves, in place (as
        OpenAI generates into what is left of the context); a prompt over `prompt_limit`, or a budget the request
        gave that does not fit, is a 400 naming its field and the most that fits."""
        k, longest = max(enumerate(map(len, prompts)), key=lambda kv: kv[1])
        if longest > self.prompt_limit:
            raise self._over_limit(str(longest), prompt_field if len(prompts) == 1 else f"{prompt_field}.{k}")
        P, C = self.worker.scheduler.max_positions, self.lm.canvas_length
        need = positions_needed(longest, sampling.cfg.max_new_tokens, C)
        if need <= P:
            return
        room = (P - longest) // C * C  # >= C: the prompt is within prompt_limit
        if sampling.budget_field is None:
            sampling.cfg = dataclasses.replace(sampling.cfg, max_new_tokens=room)
            sampling.max_tokens = min(sampling.max_tokens, room)
            return
        name = sampling.budget_field
        suffix = sampling.cfg.max_new_tokens > sampling.max_tokens  # insert mode: the suffix is laid out after it
        most = room - (sampling.cfg.max_new_tokens - sampling.max_tokens)  # (insert mode: less the suffix's part)
        shorten = "shorten the prompt or the suffix" if suffix else "shorten the prompt"
        fix = f"lower {name} to at most {most} or {shorten}" if most > 0 else shorten
        what = f"{name}={sampling.max_tokens} and the suffix after it" if suffix else f"{name}={sampling.max_tokens}"
        raise APIError(400, f"the prompt's {longest} tokens, {what} need {need} positions (whole canvases of {C}); "
                       f"the model has {P}: {fix}", param=name, code="context_length_exceeded")

    def prompt_room(self, sampling: Sampling) -> int:
        """The most prompt tokens that fit with `sampling`'s budget (`_fit`'s rule; a default budget shrinks, so
        only `prompt_limit` bounds it): what truncation aims at."""
        if sampling.budget_field is None:
            return self.prompt_limit
        P, C = self.worker.scheduler.max_positions, self.lm.canvas_length
        return min(self.prompt_limit, P - positions_needed(0, sampling.cfg.max_new_tokens, C))

    def completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[bool]]:
        """The ids of each prompt of the request (token ids as given; text after <bos>), and per prompt whether
        insert mode lays its one trailing space out in the hole, as an infill template does (`infill.space_in_hole`:
        the hole's first token carries it; the returned text then drops a space it begins with)."""
        from ..infill import space_in_hole

        V, bos = self.lm.config.text.vocab_size, self.tok.bos_token_id
        out, spaced = [], []
        for k, prompt in enumerate(req.prompts):
            spaced.append(bool(req.suffix) and isinstance(prompt, str) and space_in_hole(prompt))
            prompt = prompt[:-1] if spaced[-1] else prompt
            where = "prompt" if len(req.prompts) == 1 else f"prompt.{k}"
            if isinstance(prompt, list):
                if max(prompt) >= V:
                    raise APIError(400, f"{where}: token id {max(prompt)} is outside the vocabulary [0, {V})",
                                   param=where, code="invalid_value")
                out.append(list(prompt))
            else:
                out.append(([bos] if bos is not None else []) + self._encode_within_limit(prompt, where))
        return out, spaced

    def _jobs(self, ids: list[int], sampling: Sampling, fixed_tokens: list[int] | None = None) -> list[Job]:
        """The n choices of one prompt as worker jobs (choice i seeded with seed + i; the callers check the prompt,
        and cut a default budget, with `_fit` first); a grammar compiled once, cloned per choice."""
        constraint = self._constraint(sampling)
        return [Job(ids, sampling.cfg, seed=sampling.choice_seed(i), drafts=sampling.include_drafts,
                    fixed_tokens=fixed_tokens, logprobs=sampling.logprobs,
                    constraint=constraint if i == 0 or constraint is None else constraint.clone(),
                    logit_bias=sampling.logit_bias) for i in range(sampling.n)]

    def _submit(self, jobs: list[Job]) -> list[_Run]:
        """A request's rows for the worker, queued at once (all or none): they join the batch at the same canvas
        boundary, so a choice's padding (and its last bits) do not depend on when the worker looked."""
        try:
            handles = self.worker.submit_together(jobs, loop=asyncio.get_running_loop())
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None  # (a place frees at a canvas boundary)
        except ShuttingDown as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except TooManyRows as e:
            raise APIError(400, str(e), param="n", code="invalid_value") from None
        except SamplingError as e:  # (the one sampling setting only the model can check: logit_bias's token ids)
            raise APIError(400, str(e), param="logit_bias", code="invalid_value") from None
        except BlockpressError as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(j.prompt_ids) for j in jobs))
        return [_Run(h, len(j.prompt_ids)) for h, j in zip(handles, jobs)]

    def _constraint(self, sampling: Sampling):
        """The grammar state of a request with structured output (compiled once; each choice runs a `clone`); else
        the ban of `sampling.suppress`; or None. A grammar that cannot be used is a 400 naming its field."""
        from ..engine.constraint import Constraint, GrammarBudgetError, TokenBan

        if sampling.grammar is None:
            return TokenBan(sampling.suppress, self.lm.config.text.vocab_size) if sampling.suppress else None
        if sampling.ignore_eos:
            raise APIError(400, f"ignore_eos and {sampling.grammar_param} cannot be combined: a constrained output "
                           "ends with a stop id", param="ignore_eos", code="invalid_value")
        try:
            return Constraint(sampling.grammar, self.tok, sampling.cfg.eos_token_id, self.lm.config.text.vocab_size,
                              sampling.cfg.max_new_tokens, sampling.guarded)
        except GrammarBudgetError as e:
            name = sampling.budget_field or "max_tokens"
            raise APIError(400, str(e).replace("max_new_tokens", name), param=name, code="invalid_value") from None
        except (ValueError, BlockpressError) as e:
            message = str(e)
            if sampling.grammar_param != "grammar":  # a place in the grammar compiled from the field, not in it
                message = re.sub(r": at \d+\(\d+\): ", ": ", message)
            if sampling.grammar_param == "tools":
                raise APIError(400, "a tool's parameters schema cannot be used: "
                               f"{message.removeprefix('the grammar cannot be used: ')}", param="tools",
                               code="invalid_value") from None
            raise APIError(400, message, param=sampling.grammar_param, code="invalid_value") from None

    async def _events(self, run: _Run, asm: OutputAssembler, disconnected: Disconnected | None):
        """Engine events for one request until it is complete or the text is done (stop string,
        max_tokens) or the client went away. Callers release the run in a `finally`. The connection is polled
        every DISCONNECT_POLL seconds, whether events keep coming or not (a canvas may commit faster than that)."""
        polled = time.monotonic()
        while True:
            if disconnected is None:
                ev = await run.handle.aget()
            else:
                try:
                    ev = await asyncio.wait_for(run.handle.aget(), timeout=DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    ev = None
                if ev is None or time.monotonic() - polled >= DISCONNECT_POLL:
                    polled = time.monotonic()
                    if await disconnected():
                        run.gone = True
                        return
                if ev is None:
                    continue
            if isinstance(ev, RowError):
                run.complete = True
                if ev.shutdown:
                    raise APIError(503, ev.message, type="server_error", code="shutting_down")
                self.engine_error = ev.message
                raise APIError(500, ev.message, type="server_error")
            if isinstance(ev, RowCommit):
                run.passes += ev.steps
                run.complete = ev.finished
                asm.cut = asm.cut or ev.cut
            yield ev
            if run.complete or asm.done:
                return

    @staticmethod
    def _release(run: _Run, abandoned: bool) -> None:
        """Free the batch row of a request that ended early: abandoned (its client went away: counted as cancelled),
        or not (its reply complete at a stop string; a request refused while its choices were submitted)."""
        if not run.complete:
            run.handle.cancel(abandoned=abandoned)

    def _usage(self, run: _Run, final: Final) -> Usage:
        n, passes = final.completion_tokens, max(run.passes, 1)
        self.engine_error = None
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(n)
            self.metrics.forward_passes.inc(run.passes)
            self.metrics.tokens_per_forward.observe(n / passes)
        row = run.handle.row  # (its prefix-cache counts were set at admission, before any event of it)
        reasoning = len(self.tok.encode(final.reasoning)) if final.reasoning else 0
        return Usage(prompt_tokens=run.prompt_tokens, completion_tokens=n, total_tokens=run.prompt_tokens + n,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=row.cached_tokens,
                                                               cache_write_tokens=row.cache_write_tokens),
                     completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning),
                     denoising_steps=run.passes, tokens_per_forward=round(n / passes, 4))

    def _piece(self, t: int) -> str:
        p = self._pieces.get(t)
        if p is None:
            p = self._pieces[t] = self.tok.decode([t])
        return p

    def _bytes(self, t: int) -> list[int]:
        """A token's own bytes (`Tokenizer.token_bytes`: a token holding part of a character, that part)."""
        return list(self.tok.token_bytes(t))

    def _chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """Entries -> a chat choice's `logprobs` ({"content": [...]}); None when not asked."""
        if entries is None:
            return None
        return {"content": [{"token": e.text, "logprob": _logprob(e.logprob), "bytes": self._bytes(e.id),
                             "top_logprobs": [{"token": self._piece(t), "logprob": _logprob(v),
                                               "bytes": self._bytes(t)} for t, v in e.top]} for e in entries]}

    def _completion_logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """Entries -> a completion choice's `logprobs` (OpenAI's legacy lists); None when not asked."""
        if entries is None:
            return None
        tops = []
        for e in entries:
            top: dict[str, float] = {}
            for t, v in e.top:
                top.setdefault(self._piece(t), _logprob(v))  # same text: the likelier one (listed first)
            tops.append(top)
        return {"tokens": [e.text for e in entries], "token_logprobs": [_logprob(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": [e.offset for e in entries]}

    def _draft_frame(self, ev: RowDraft) -> dict[str, Any]:
        pieces = self.tok.pieces(ev.tokens)  # a character at the token completing it (one token alone: U+FFFD)
        return {"type": "draft", "canvas": ev.canvas, "step": ev.step, "max_steps": ev.max_steps,
                "text": "".join(pieces), "tokens": pieces, "accepted": [int(a) for a in ev.accepted]}

    # ---------------------------------------------------------------- several choices
    def _submit_choices(self, ids: list[int], sampling: Sampling, fixed_tokens: list[int] | None = None,
                        prompt_field: str = "messages") -> list[_Run]:
        """One run per choice (`n`), choice i seeded with seed + i; all or none are admitted."""
        self._fit([ids], sampling, prompt_field)
        return self._submit(self._jobs(ids, sampling, fixed_tokens))

    async def _collect(self, run: _Run, asm: OutputAssembler, disconnected: Disconnected | None,
                       tokens_of: Callable[[RowCommit], tuple[list[int], list | None]],
                       on_delta: Callable[[Delta], None] | None = None) -> Final:
        """Run to the end; `on_delta` sees each canvas's text as a stream would (the Responses builder)."""
        try:
            async for ev in self._events(run, asm, disconnected):
                if isinstance(ev, RowCommit):
                    d = asm.feed(*tokens_of(ev))
                    if on_delta is not None:
                        on_delta(d)
        finally:
            self._release(run, not asm.done)
        if run.gone:  # no reply to build: its tokens are not counted as returned, nor is it a success
            raise ClientGone()
        return asm.finish()

    async def _collect_all(self, runs: list[_Run], asms: list[OutputAssembler], disconnected: Disconnected | None,
                           tokens_of: Callable[[RowCommit], tuple[list[int], list | None]]) -> list[Final]:
        disconnected = _shared(disconnected, len(runs))
        tasks = [asyncio.ensure_future(self._collect(r, a, disconnected, tokens_of)) for r, a in zip(runs, asms)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one choice failed or the request was cancelled: stop the others too
                t.cancel()

    def _usage_all(self, runs: list[_Run], finals: list[Final], per_prompt: int | None = None) -> Usage:
        """Usage of all choices: each prompt once (runs come in groups of `per_prompt` choices of one prompt;
        default: all of one prompt), completion tokens and decoder passes summed."""
        us = [self._usage(r, f) for r, f in zip(runs, finals)]
        if len(us) == 1:
            return us[0]
        firsts = us[::per_prompt or len(us)]  # each prompt's first choice: its prompt counted once
        prompt = sum(u.prompt_tokens for u in firsts)
        n, passes = sum(u.completion_tokens for u in us), sum(u.denoising_steps for u in us)
        cached = PromptTokensDetails(**{k: sum(getattr(u.prompt_tokens_details, k) for u in us)
                                        for k in PromptTokensDetails.model_fields})
        reasoning = sum(u.completion_tokens_details.reasoning_tokens for u in us)
        return Usage(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n, prompt_tokens_details=cached,
                     completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning),
                     denoising_steps=passes, tokens_per_forward=round(n / max(passes, 1), 4))

    def _frame(self, frame: dict[str, Any], index: int, n: int) -> dict[str, Any]:
        return {**frame, "index": index} if n > 1 else frame

    # ---------------------------------------------------------------- chat completions
    async def chat(self, req: ChatCompletionRequest, disconnected: Disconnected | None = None):
        """A ChatCompletionResponse, or (stream=True) an async iterator of SSE strings."""
        self._check_model(req.model)
        sampling = req.to_sampling(self.limits, self.defaults)
        ids = await asyncio.to_thread(self.chat_prompt, req)  # templating + BPE off the event loop
        sampling, fixed = self.forced_call(req, sampling)
        runs = self._submit_choices(ids, sampling, fixed_tokens=fixed)
        return await self.chat_response(runs, sampling, req.stream, disconnected)

    def forced_call(self, req: ChatCompletionRequest, sampling: Sampling) -> tuple[Sampling, list[int] | None]:
        """What the request's tools ask of the engine. A forced tool call (tool_choice "required" or named) is made
        with a grammar on the whole answer when the structured extra is installed, else with the call's opening
        held on the canvas; `strict` tools under tool_choice "auto" get a grammar on the whole reply (calls name
        offered tools, strict tools' arguments valid; engine/constraint.py `reply_grammar`); where no tool is
        offered (none, or tool_choice "none"), no call can be written (`parsing.call_ban`). Returns the sampling
        and the held tokens (or None)."""
        if req.offered_tools is None:
            return dataclasses.replace(sampling, suppress=call_ban(self.tok, None)), None
        rule = self.tool_call_grammar(req, sampling)
        if rule is not None:
            return dataclasses.replace(sampling, grammar=rule[0], guarded=rule[1], grammar_param="tools"), None
        return sampling, self.tool_call_prefix(req.forced_tool)

    def tool_call_grammar(self, req: ChatCompletionRequest, sampling: Sampling) -> tuple[str, tuple[int, ...]] | None:
        """The grammar (and its guarded tokens) of the reply's tool calls: tool_choice "required" / named with the
        structured extra installed, one or more calls of offered tools ("required"; one with parallel_tool_calls
        false) or exactly one call of the named one, their arguments valid against the tool's parameters schema;
        `strict` tools under "auto", the reply's calls valid (a 400 without the structured extra); tools beside an
        output format (response_format, regex, grammar): calls, or an answer in that format. Constrained while it is
        denoised (engine/constraint.py; a
        schema it cannot use is a 400 naming `tools` when the request is submitted). None for a free reply, or a
        forced call without llguidance."""
        from ..engine.constraint import reply_grammar, structured_extra

        if req.forced_tool is not None and not structured_extra():
            return None  # the call's opening is held instead (tool_call_prefix)
        try:
            return reply_grammar(self.tok, req.offered_tools, req.forced_tool, sampling.grammar,
                                 parallel=req.tool_choice == "required" and not sampling.one_call)
        except InputError as e:  # strict tools without llguidance, a model without tool-call tokens
            raise APIError(400, str(e), param="tools", code="invalid_value") from None

    def tool_call_prefix(self, tool: str | None) -> list[int] | None:
        """tool_choice "required" / named without the structured extra, done the diffusion way: the opening of a
        call, `<|tool_call>call:` (+ `NAME{` for a named tool), is held on the first canvas (as insert mode holds a
        suffix) and the model denoises the rest around it, arguments included. The call then starts the answer,
        so a thinking turn is skipped."""
        if tool is None:
            return None
        return self.tok.encode("<|tool_call>call:" + (tool + "{" if tool else ""))

    def _new_assembler(self, sampling: Sampling, chat: bool, drop_space: bool = False) -> OutputAssembler:
        return OutputAssembler(self.tok, sampling.cfg.eos_token_id, sampling.max_tokens, sampling.stop, chat=chat,
                               logprobs=sampling.logprobs is not None, one_call=sampling.one_call,
                               drop_space=drop_space)

    async def chat_response(self, runs: _Run | list[_Run], sampling: Sampling, stream: bool,
                            disconnected: Disconnected | None = None):
        """Engine events of submitted runs (one per choice) -> ChatCompletionResponse or SSE iterator."""
        runs = [runs] if isinstance(runs, _Run) else runs
        asms = [self._new_assembler(sampling, chat=True) for _ in runs]
        rid = "chatcmpl-" + secrets.token_hex(12)
        if stream:
            return Stream(self._chat_stream(rid, runs, asms, sampling, disconnected), runs)
        finals = await self._collect_all(runs, asms, disconnected, lambda ev: (ev.tokens, ev.logprobs))
        choices = []
        for i, final in enumerate(finals):
            msg = ResponseMessage(content=None if final.tool_calls and not final.content else final.content,
                                  reasoning_content=final.reasoning,
                                  tool_calls=[ResponseToolCall(id=c.id, function=FunctionCall(
                                      name=c.name, arguments=c.arguments_json)) for c in final.tool_calls] or None)
            lp = self._chat_logprobs(final.logprobs)
            choices.append(ChatChoice(index=i, message=msg, finish_reason=final.finish_reason,
                                      logprobs=None if lp is None else ChatLogprobs(**lp)))
        return ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                      usage=self._usage_all(runs, finals))

    async def _chat_stream(self, rid: str, runs: list[_Run], asms: list[OutputAssembler], sampling: Sampling,
                           disconnected: Disconnected | None) -> AsyncIterator[str]:
        created, n = int(time.time()), len(runs)
        finals: list[Final | None] = [None] * n
        disconnected = _shared(disconnected, n)
        null_usage = {"usage": None} if sampling.include_usage else {}  # OpenAI: every chunk before the last

        def chunk(i: int, delta: dict | None = None, finish: str | None = None, logprobs=None, **extra) -> str:
            choices = [] if delta is None else [{"index": i, "delta": delta, "logprobs": logprobs,
                                                 "finish_reason": finish}]
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": self.model_name, "choices": choices, **null_usage, **extra})

        def text_chunks(i: int, d: Delta):
            if d.reasoning:
                yield chunk(i, {"reasoning_content": d.reasoning})
            if d.content or d.logprobs:
                yield chunk(i, {"content": d.content}, logprobs=self._chat_logprobs(d.logprobs)
                            if sampling.logprobs is not None else None)

        async def choice(i: int):
            run, asm = runs[i], asms[i]
            try:
                yield chunk(i, {"role": "assistant", "content": ""})
                async for ev in self._events(run, asm, disconnected):
                    if isinstance(ev, RowDraft):
                        yield chunk(i, None, blockpress=self._frame(self._draft_frame(ev), i, n))
                    elif isinstance(ev, RowCommit):
                        for c in text_chunks(i, asm.feed(ev.tokens, ev.logprobs)):
                            yield c
                        if sampling.include_drafts:
                            yield chunk(i, None, blockpress=self._frame(
                                {"type": "commit", "canvas": ev.canvas, "steps": ev.steps}, i, n))
                final = finals[i] = asm.finish()
                for c in text_chunks(i, final.last):
                    yield c
                if final.tool_calls:
                    yield chunk(i, {"tool_calls": [{"index": k, **c.to_openai()}
                                                   for k, c in enumerate(final.tool_calls)]})
                yield chunk(i, {}, final.finish_reason)
            finally:
                self._release(run, not asm.done)

        merged = _merge([choice(i) for i in range(n)])
        try:
            async for c in merged:
                yield c
            usage = self._usage_all(runs, finals)
            if sampling.include_usage:
                yield chunk(0, None, usage=usage.model_dump())
        except APIError as e:
            yield _sse(e.body())
        finally:
            await merged.aclose()  # the client went away: free every choice's run now
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------- completions (the same, per prompt)
    def _hole_tokens(self, ev: RowCommit, holes: list[int] | None) -> tuple[list[int], list | None]:
        """A committed canvas's tokens that belong to the completion (insert mode: the hole's only), and their
        log-probabilities (None: not asked)."""
        if holes is None:
            return ev.tokens, ev.logprobs
        base = ev.canvas * self.lm.canvas_length
        keep = [j for j in range(len(ev.tokens)) if base + j < len(holes) and holes[base + j] == -1]
        return [ev.tokens[j] for j in keep], None if ev.logprobs is None else [ev.logprobs[j] for j in keep]

    async def completion(self, req: CompletionRequest, disconnected: Disconnected | None = None):
        self._check_model(req.model)
        sampling = req.to_sampling(self.limits, self.defaults)
        prompts, spaced = await asyncio.to_thread(self.completion_prompts, req)
        holes = None
        if req.suffix:  # insert mode: the hole (max_tokens) then the suffix, held fixed on the canvas
            region = [-1] * sampling.max_tokens + await asyncio.to_thread(self.tok.encode, req.suffix)
            if len(region) > self.limits.max_tokens:
                raise APIError(400, f"max_tokens + the suffix's {len(region) - sampling.max_tokens} tokens exceed "
                               f"this server's limit of {self.limits.max_tokens}; shorten the suffix",
                               param="suffix", code="context_length_exceeded")
            n_new, holes = whole_canvases(region, self.lm.canvas_length)  # past the suffix: -2, discarded
            sampling.cfg = dataclasses.replace(sampling.cfg, max_new_tokens=n_new)
            sampling.budget_field = "max_tokens"  # the hole's size: never cut (the suffix is laid out after it)
        runs = self._submit_batch(prompts, sampling, fixed_tokens=holes)
        asms = [self._new_assembler(sampling, chat=False, drop_space=spaced[k // sampling.n])
                for k in range(len(runs))]  # run k is prompt k // n's
        rid = "cmpl-" + secrets.token_hex(12)
        if req.stream:
            return Stream(self._completion_stream(rid, runs, asms, sampling, disconnected, holes), runs)
        finals = await self._collect_all(runs, asms, disconnected, lambda ev: self._hole_tokens(ev, holes))
        return CompletionResponse(id=rid, model=self.model_name,
                                  choices=[CompletionChoice(index=i, text=f.content, finish_reason=f.finish_reason,
                                                            logprobs=self._completion_logprobs(f.logprobs))
                                           for i, f in enumerate(finals)],
                                  usage=self._usage_all(runs, finals, sampling.n))

    def _submit_batch(self, prompts: list[list[int]], sampling: Sampling,
                      fixed_tokens: list[int] | None = None) -> list[_Run]:
        """n runs per prompt, in order (prompt p's choice i is run p * n + i); all or none are admitted. A default
        budget is cut for the longest prompt, so every prompt's choices write the same number of tokens."""
        self._fit(prompts, sampling, "prompt")
        return self._submit([job for ids in prompts for job in self._jobs(ids, sampling, fixed_tokens)])

    async def _completion_stream(self, rid: str, runs: list[_Run], asms: list[OutputAssembler], sampling: Sampling,
                                 disconnected: Disconnected | None,
                                 holes: list[int] | None = None) -> AsyncIterator[str]:
        created, n = int(time.time()), len(runs)
        finals: list[Final | None] = [None] * n
        disconnected = _shared(disconnected, n)
        null_usage = {"usage": None} if sampling.include_usage else {}  # OpenAI: every chunk before the last

        def chunk(i: int, text: str | None, finish: str | None = None, logprobs=None, **extra) -> str:
            choices = [] if text is None else [{"index": i, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish}]
            return _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                         "choices": choices, **null_usage, **extra})

        def lps(d: Delta):
            return self._completion_logprobs(d.logprobs) if sampling.logprobs is not None else None

        async def choice(i: int):
            run, asm = runs[i], asms[i]
            try:
                async for ev in self._events(run, asm, disconnected):
                    if isinstance(ev, RowDraft):
                        yield chunk(i, None, blockpress=self._frame(self._draft_frame(ev), i, n))
                    elif isinstance(ev, RowCommit):
                        d = asm.feed(*self._hole_tokens(ev, holes))
                        if d.content or d.logprobs:
                            yield chunk(i, d.content, logprobs=lps(d))
                        if sampling.include_drafts:
                            yield chunk(i, None, blockpress=self._frame(
                                {"type": "commit", "canvas": ev.canvas, "steps": ev.steps}, i, n))
                final = finals[i] = asm.finish()
                if final.last.content or final.last.logprobs:
                    yield chunk(i, final.last.content, logprobs=lps(final.last))
                yield chunk(i, "", final.finish_reason)
            finally:
                self._release(run, not asm.done)

        merged = _merge([choice(i) for i in range(n)])
        try:
            async for c in merged:
                yield c
            usage = self._usage_all(runs, finals, sampling.n)
            if sampling.include_usage:
                yield chunk(0, None, usage=usage.model_dump())
        except APIError as e:
            yield _sse(e.body())
        finally:
            await merged.aclose()  # the client went away: free every choice's run now
        yield "data: [DONE]\n\n"


def _shared(disconnected: Disconnected | None, n: int) -> Disconnected | None:
    """With several choices, one client connection is polled by several tasks: poll it under a lock and
    remember a disconnect, so the ASGI receive channel is never read concurrently."""
    if disconnected is None or n == 1:
        return disconnected
    lock, gone = asyncio.Lock(), [False]

    async def check() -> bool:
        async with lock:
            if not gone[0]:
                gone[0] = await disconnected()
            return gone[0]
    return check


async def _merge(gens: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """Items of several async generators as they come (one choice's chunks stay in order). An exception
    in one is raised here; closing this generator closes them all (their `finally` frees their runs)."""
    if len(gens) == 1:
        g = gens[0]
        try:
            async for item in g:
                yield item
        finally:
            await g.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(g):
        try:
            async for item in g:
                await queue.put(item)
            await queue.put(end)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(e)
        finally:
            await g.aclose()

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
