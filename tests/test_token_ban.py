"""Banned tokens (`suppress_tokens`, engine/constraint.py's TokenBan): a chat turn that offers no tool writes no tool
call. On a random-weight tiny model (noise, so the ban is what keeps a token out) and on the shipped assistant."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import random

import pytest
import torch

import blockpress
from blockpress.engine import generate as engine
from blockpress.engine.constraint import TokenBan
from blockpress.errors import InputError
from blockpress.parsing import CALL_OPEN, call_ban

from test_server import lm, model_dir  # noqa: F401 (fixtures: the random tiny model, one thread)

FAST = {"max_denoising_steps": 3, "stability_threshold": None, "confidence_threshold": None, "max_new_tokens": 32}


def test_walk_replaces_only_banned_argmax_and_draws():
    z = torch.tensor([[5.0, 1.0, 0.0, 2.0], [0.0, 3.0, 9.0, 1.0], [1.0, 0.0, 0.0, 7.0]])
    a, y = z.argmax(-1), torch.tensor([2, 2, 3])
    wa, wy, n = TokenBan([2], 4).walk(z, y, a)
    assert wa.tolist() == [0, 1, 3] and wy.tolist() == [0, 1, 3] and n == 0  # row 1: 2 banned -> 1, the next best
    wa, wy, _ = TokenBan([2, 1], 4).walk(z, y, a)
    assert wa.tolist() == [0, 3, 3] and wy.tolist() == [0, 3, 3]
    wa, wy, _ = TokenBan([3], 4).walk(z, torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2]))  # 3 not there: as is
    assert wa.tolist() == [0, 2, 2] and wy.tolist() == [0, 1, 2]
    for bad in ([], [-1], [4]):
        with pytest.raises(InputError, match="suppress_tokens must be token ids"):
            TokenBan(bad, 4)
    with pytest.raises(InputError, match="bans every one of the 4 tokens"):  # was a RuntimeError in the first step
        TokenBan([0, 1, 2, 3], 4)


def _rows(lm, seeds, **kw):
    ids = lm.encode_chat("Hello", chat=False)
    out = lm.generate([ids] * len(seeds), generator=[torch.Generator().manual_seed(s) for s in seeds], **FAST, **kw)
    return [r.tolist() for r in out.new_tokens]


def test_banned_tokens_never_appear_and_other_rows_are_untouched(lm):
    free = _rows(lm, range(4))
    common = [t for t, _ in collections.Counter(t for r in free for t in r).most_common(3)]
    banned = _rows(lm, range(4), suppress_tokens=common)
    assert not set(common) & {t for r in banned for t in r}
    assert banned != free
    # a row without the ban, batched beside one with it, writes what it writes alone
    ids = lm.encode_chat("Hello", chat=False)
    cfg = lm.generation_config(**FAST)
    events = engine.stream(lm.module, torch.tensor([ids, ids]), cfg, lm.canvas_length, drafts=False,
                           generator=[torch.Generator().manual_seed(s) for s in (0, 1)], passes=lm.passes,
                           constraints=[TokenBan(common, lm.module.text.vocab_size), None], options=lm.options)
    mixed = [ev for ev in events if isinstance(ev, engine.Finished)][0].result
    assert mixed.new_tokens[0].tolist() == banned[0] and mixed.new_tokens[1].tolist() == free[1]


def test_call_ban_only_where_no_tool_is_offered(lm):
    tok = lm.tokenizer
    assert call_ban(tok, None) == call_ban(tok, []) == [tok.token_to_id(CALL_OPEN)]
    assert call_ban(tok, [{"type": "function", "function": {"name": "f"}}]) is None


@functools.lru_cache(maxsize=1)
def assistant_calling_unoffered():
    """The shipped assistant (loaded), a conversation asking for what a tool would do with no tool offered that it
    answers with a tool call when nothing bans it (the eval's draw), that conversation's eval reply (banned), and a
    `chat` seed that calls unbanned: (lm, reply, (messages, enable_thinking, seed)). Cached: the README server test
    uses it too."""
    from blockpress.tasks.assistant import dialogs, evaluate

    chat_lm = blockpress.load("assistant", progress=False)
    call, stops = chat_lm.tokenizer.token_to_id(CALL_OPEN), evaluate.stop_ids(chat_lm.tokenizer)
    # requests a tool would answer, with their tools taken away (the shipped model refuses those its drills asked
    # without tools, so the conversations it still calls in are tool-call ones stripped of their declarations)
    convs = (dataclasses.replace(dialogs.conversation(random.Random(f"ban/{i}"), "call"), tools=None) for i in range(400))
    while batch := list(itertools.islice(convs, 16)):
        prompts = [evaluate.prompt_ids(chat_lm.tokenizer, d) for d in batch]
        free = chat_lm.generate(prompts, max_new_tokens=96, eos_token_id=stops,  # what `replies` draws, unbanned
                                generator=[torch.Generator().manual_seed(evaluate.case_seed(0, p)) for p in prompts])
        called = [d for d, r in zip(batch, free.new_tokens.tolist()) if call in r]
        if called:
            break
    assert called, "the ban test needs a conversation the model answers with a call"
    d = called[0]
    seed = next(s for s in range(20) if chat_lm.chat(d.messages[:-1], enable_thinking=d.thinking, seed=s,
                                                     max_new_tokens=96, suppress_tokens=None).tool_calls)
    return chat_lm, evaluate.replies(chat_lm, [d])[0], (d.messages[:-1], d.thinking, seed)


def test_assistant_offered_no_tool_calls_none():
    """The shipped assistant, asked for what a tool would do with no tool offered: unbanned it calls one in some of
    these conversations; the eval (as the server, `test_chat_model`'s README server test) and `lm.chat` never do."""
    chat_lm, text, (messages, thinking, seed) = assistant_calling_unoffered()
    assert CALL_OPEN not in text
    reply = chat_lm.chat(messages, enable_thinking=thinking, seed=seed, max_new_tokens=96)
    assert not reply.tool_calls and reply.finish_reason != "tool_calls"
