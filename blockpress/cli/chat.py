"""`blockpress chat [MODEL]`: a multi-turn REPL that keeps the KV cache between turns.

`ChatSession` holds the turn logic (testable without a terminal):
- Turn 1 encodes the rendered conversation. After each turn the cache holds everything but the
  last committed canvas (the engine never encodes it).
- Turn k+1 encodes only what the cache lacks: the last canvas trimmed at the end of the reply
  (the first stop id, or the max_new_tokens cut), then `<turn|>\\n` closing the model turn, then
  the new user turn and generation prompt. That suffix is the chat template's own text: the
  conversation rendered with the new message minus the conversation rendered up to the previous
  reply, so any template that renders turns incrementally works.
- The model keeps seeing its raw previous output (reasoning included), not the template's
  re-rendering of the reply. If the template's rendering is not incremental, or after
  `/thinking on|off` (which changes the system turn) the next turn re-encodes the whole
  conversation once (history holds the replies' content).

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

END_OF_TURN = "<turn|>\n"


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
    """Conversation state: messages, the committed KV cache and the tokens it still lacks."""

    def __init__(self, lm, thinking: bool = False, sampling: dict[str, Any] | None = None, seed: int | None = None):
        from ..engine.generate import seeded
        from ..errors import InputError

        if lm.tokenizer is None:
            raise InputError(f"{lm.path} has no tokenizer.json; chat needs one")
        if not lm.tokenizer.is_chat:
            raise InputError(f"{lm.path} is a plain text model (no chat template): chat turns would reach it in a "
                             f"format it never saw; continue text with `blockpress run {lm.path} TEXT`, or add "
                             "chat_template.jinja to its folder")
        self.lm, self.tok = lm, lm.tokenizer
        self.sampling = {**lm.text_defaults(), **(sampling or {})}
        self.cfg = lm.generation_config(**self.sampling)  # validated once
        self.thinking = thinking
        self.generator = seeded(seed, lm.device) if seed is not None else None
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.cache = None
        self.pending: list[int] = []  # committed tokens not yet in the cache
        self.last_reply: Reply | None = None

    def abort_turn(self) -> None:
        """A reply interrupted mid-way: the turn is dropped, and the cache (which the engine may have extended)
        with it; the next turn re-encodes the conversation."""
        self.cache, self.pending = None, []

    def set_thinking(self, on: bool) -> None:
        if on != self.thinking:
            self.thinking = on
            self.cache, self.pending = None, []  # the system turn changes: re-encode next turn

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                            enable_thinking=self.thinking, tokenize=False)

    def prompt_ids(self, text: str) -> list[int]:
        """The tokens this turn must encode (the whole conversation when there is no cache)."""
        convo = self.messages + [{"role": "user", "content": text}]
        full = self._render(convo, True)
        if self.cache is not None:
            base = self._render(self.messages, False)
            if full.startswith(base):
                return self.pending + self.tok.encode(full[len(base):])
            self.cache, self.pending = None, []  # template not incremental: start over
        return self.tok.encode(full)

    def stream(self, text: str, drafts: bool = True) -> Iterator[Any]:
        """Engine events (Draft, Commit, Finished) for one user turn. When Finished is yielded the
        state is already updated and `last_reply` holds the turn's Reply."""
        import blockpress

        ids = self.prompt_ids(text)
        for ev in self.lm.stream([ids], generator=self.generator, cache=self.cache, drafts=drafts, **self.sampling):
            if isinstance(ev, blockpress.Finished):
                self.last_reply = self._finish(text, ids, ev.result)
            yield ev

    def send(self, text: str) -> Reply:
        for _ in self.stream(text, drafts=False):
            pass
        return self.last_reply

    def _finish(self, text: str, ids: list[int], result) -> Reply:
        from ..parsing import parse_reply

        C = self.lm.canvas_length
        new = result.new_tokens[0].tolist()
        tokens, reason = self.cfg.reply(new)
        in_last = len(tokens) - (len(new) - C)  # reply tokens inside the last (unencoded) canvas
        self.cache = result.cache
        self.pending = new[len(new) - C:][:max(in_last, 0)] + self.tok.encode(END_OF_TURN)
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
        except EOFError:
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
