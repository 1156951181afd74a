"""`blockpress chat [MODEL]`: a multi-turn REPL that keeps the KV cache between turns.

`ChatSession` holds the turn logic (testable without a terminal):
- Every turn's prompt is the whole conversation rendered by the chat template, as the server and `lm.chat` build
  it: the previous replies as their content, without the thought channel and its markers that the model wrote
  after the generation prompt (Gemma 4's model card: a multi-turn history holds the final responses, not past
  thoughts), tokenized afresh. So the model sees what it was trained on and what every other engine sends.
- The cache holds the K/V of the tokens of the last turn's prompt and of its committed canvases but the last (the
  engine never encodes the last one). A turn keeps the longest common prefix of those tokens and its prompt
  (`engine.prefix.common_prefix`), crops the cache there and encodes the rest: the previous reply, re-tokenized
  from its content, the turn end and the new turn (the prefix ends at the previous generation prompt's thought
  block, which the re-rendered history lacks). A cache whose sliding layers' ring no longer holds the window before
  that point starts over, as `/thinking on|off` does (it changes the system turn, the first tokens).

REPL commands: /thinking on|off, /reset, /exit (also Ctrl-D). Ctrl-C during a reply drops that turn
(the next one re-encodes the conversation); at the prompt it ends the chat. A model without a chat
template is refused, as `serve` refuses it chat requests.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from .run import (add_model_args, add_sampling_args, load_model, refuse_task_model, sampling_kwargs,
                  stats_line, stats_of)

@dataclass
class Reply:
    content: str
    reasoning: str | None
    tool_calls: list = field(default_factory=list)
    finish_reason: str = "stop"
    tokens: list[int] = field(default_factory=list)
    encoded: int = 0  # prompt tokens encoded for this turn (the rest came from the cache)
    result: Any = None


class ChatSession:
    """Conversation state: messages, the committed KV cache and the token ids whose K/V it holds."""

    def __init__(self, lm, thinking: bool = False, sampling: dict[str, Any] | None = None, seed: int | None = None):
        from ..engine.generate import seeded
        from ..errors import InputError

        if lm.tokenizer is None:
            raise InputError(f"{lm.path} has no tokenizer.json; chat needs one")
        if not lm.tokenizer.is_chat:
            raise InputError(f"{lm.path} is a plain text model (no chat template): chat turns would reach it in a "
                             f"format it never saw; continue text with `blockpress run {lm.path} TEXT`, or add "
                             "chat_template.jinja to its folder")
        from ..chat import compile_chat_template

        compile_chat_template(lm.tokenizer.chat_template)  # a broken template: refused now, not at the first turn
        self.lm, self.tok = lm, lm.tokenizer
        self.sampling = {**lm.text_defaults(), **(sampling or {})}
        self.cfg = lm.generation_config(**self.sampling)  # validated once
        self.thinking = thinking
        if seed is not None:
            seeded(seed, lm.device)  # a bad seed: refused now, not at the first turn
        self.seed = seed  # each turn draws from it afresh, as each request to the server does
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.cache = None
        self.cached: list[int] = []  # the token ids at the cache's positions [0, cache.length)
        self.last_reply: Reply | None = None

    def abort_turn(self) -> None:
        """A reply interrupted mid-way: the turn is dropped, and the cache (which the engine may have extended)
        with it; the next turn re-encodes the conversation."""
        self.cache, self.cached = None, []

    def set_thinking(self, on: bool) -> None:
        if on != self.thinking:
            self.thinking = on
            self.cache, self.cached = None, []  # the system turn changes: re-encode next turn

    def plan(self, text: str) -> tuple[int, list[int]]:
        """(keep, ids) for a turn with the user message `text`: the prompt is the cache's first `keep` positions
        and then `ids`, the tokens this turn encodes (the whole rendered conversation when nothing is kept)."""
        from ..engine.prefix import common_prefix
        from ..tokenizer import check_text

        check_text(text, "your message")
        convo = self.messages + [{"role": "user", "content": text}]
        full = self.tok.apply_chat_template(convo, add_generation_prompt=True, enable_thinking=self.thinking)
        keep = min(common_prefix(tuple(self.cached), tuple(full)), len(full) - 1) if self.cache is not None else 0
        if keep:
            try:
                self.cache.prefix(keep)  # (what crop would refuse: a ring that no longer holds the window)
            except ValueError:
                keep = 0
        return keep, full[keep:]

    def stream(self, text: str, drafts: bool = True) -> Iterator[Any]:
        """Engine events (Draft, Commit, Finished) for one user turn. When Finished is yielded the
        state is already updated and `last_reply` holds the turn's Reply."""
        import blockpress

        from ..engine.generate import seeded

        keep, ids = self.plan(text)
        cache, kept = (self.cache, self.cached[:keep]) if keep else (None, [])
        if cache is not None:
            cache.crop(keep)
        self.cache, self.cached = None, []  # until the turn ends: an interrupted one leaves nothing to reuse
        generator = seeded(self.seed, self.lm.device) if self.seed is not None else None
        for ev in self.lm.stream([ids], generator=generator, cache=cache, drafts=drafts,
                                 suppress_tokens=self.lm.chat_ban(), **self.sampling):
            if isinstance(ev, blockpress.Finished):
                self.last_reply = self._finish(text, kept, ids, ev.result)
            yield ev

    def send(self, text: str) -> Reply:
        for _ in self.stream(text, drafts=False):
            pass
        return self.last_reply

    def _finish(self, text: str, kept: list[int], ids: list[int], result) -> Reply:
        from ..parsing import parse_reply

        new = result.new_tokens[0].tolist()
        tokens, reason = self.cfg.reply(new)
        self.cache = result.cache
        self.cached = (kept + ids + new)[:result.cache.length]
        parsed = parse_reply(self.tok, tokens, reason)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": parsed.content}]
        return Reply(parsed.content, parsed.reasoning, parsed.tool_calls, parsed.finish_reason, tokens, len(ids),
                     result)


# ----------------------------------------------------------------------------- REPL
def add_parser(p) -> None:
    add_model_args(p, default="the shipped chat model, assistant")
    add_sampling_args(p)
    p.add_argument("--thinking", action="store_true", help="start with thinking on (toggle with /thinking on|off)")
    p.add_argument("--no-live", action="store_true", help="do not draw the canvas while it denoises")


HELP = "commands: /thinking on|off · /reset · /exit"


def main(args) -> int:
    import blockpress
    from rich.console import Console

    from .view import CanvasView, TextRenderer
    from ..errors import InputError
    from ..loading import DEFAULT_CHAT_MODEL

    args.model = args.model or DEFAULT_CHAT_MODEL  # chat is what these commands are for: the shipped chat model
    lm = load_model(args)
    refuse_task_model(lm, "chat")
    session = ChatSession(lm, thinking=args.thinking, sampling=sampling_kwargs(args), seed=args.seed)
    console = Console(highlight=False, soft_wrap=True)  # text is never hard-wrapped (a pipe or a file gets it whole)
    interactive = sys.stdin.isatty()
    if interactive:
        console.print(f"blockpress chat · {lm.path} · {HELP}", style="cyan", markup=False)
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: the chat ends, on a line of its own
            if interactive:
                console.print()
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                console.print("(conversation cleared)", style="cyan")
            elif cmd == "/thinking" and arg.strip() in ("on", "off"):
                session.set_thinking(arg.strip() == "on")
                console.print(f"(thinking {arg.strip()})", style="cyan")
            else:
                console.print(HELP, style="yellow", markup=False)
            continue
        decoder = session.tok.stream_decoder(skip_special_tokens=True)
        try:
            with CanvasView(TextRenderer(session.tok), console, live=not args.no_live) as view:
                for ev in session.stream(text, drafts=view.live_on):
                    if isinstance(ev, blockpress.Draft):
                        view.draft(ev.canvas_index, ev.step, ev.max_steps, ev.tokens[0].tolist(),
                                   ev.accepted[0].tolist())
                    elif isinstance(ev, blockpress.Commit):
                        view.commit(decoder.feed(ev.tokens[0].tolist()))
        except KeyboardInterrupt:  # ends this reply, not the chat
            session.abort_turn()
            console.print("(reply interrupted and dropped; /exit or Ctrl-D ends the chat)", style="yellow")
            continue
        except InputError as e:  # a turn the model cannot take (the conversation outgrew its context): the chat goes on
            session.abort_turn()
            console.print(f"error: {e} (this turn was dropped; /reset starts a new conversation)", style="red",
                          markup=False)
            continue
        reply = session.last_reply
        if reply.reasoning:
            console.print(reply.reasoning.strip(), style="dim italic", markup=False)
        console.print(("model> " if interactive else "") + reply.content, markup=False)
        for c in reply.tool_calls:
            console.print(f"[tool call] {c.name}({c.arguments_json})", style="magenta", markup=False)
        stats = stats_of(reply.result, len(reply.tokens))
        console.print(f"{stats_line(stats)} · encoded {reply.encoded} prompt tokens", style="cyan", markup=False)
    return 0
