"""The closing path of a grammar-constrained walk (engine/constraint.py): a grammar whose soonest-closing token goes
round is still closed in a few tokens (`Constraint._search`), a refusal says what was found, and a long output's walk
costs about a mask a position rather than a closing path made again at each (`Constraint._path_after`). On the tests'
random-weight tiny model and its tokenizer, which write noise: every valid output is the constraint's doing."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from blockpress.errors import InputError

pytest.importorskip("llguidance")

from blockpress.engine.constraint import Constraint, GrammarBudgetError, grammar_for, reply_grammar  # noqa: E402
from test_structured import FAST, _gen, lm  # noqa: E402,F401  (the tiny model, loaded once per module)

LOOPS = [r"[a-z]+x", r"[a-z ]*x", r"[^x]+x", r"[0-9a-f]+g"]  # the closing character is one the loop takes too
PATTERN = {"type": "object", "properties": {"v": {"type": "string", "pattern": "^[a-z]+x$"}}, "required": ["v"],
           "additionalProperties": False}


def _walk_to_the_end(c: Constraint, V: int, seed: int, C: int = 16, steps: int = 2) -> tuple[list[int], list[int]]:
    """Canvas after canvas of noise logits walked by `c`, the last step's walk committed, until the output ends or
    the budget does -> (the tokens, the masks each walk computed)."""
    g = torch.Generator().manual_seed(seed)
    out, masks = [], []
    while not c.ended and len(out) < c.budget:
        for _ in range(steps):
            z = torch.randn(C, V, generator=g) * 4
            before = c.masks
            walked, _, _ = c.walk(z, z.argmax(-1))
            masks.append(c.masks - before)
        c.advance(walked)
        out += walked
    return out, masks


@pytest.mark.parametrize("pattern", LOOPS)
def test_a_grammar_whose_closing_character_the_loop_also_takes_closes_in_a_few_tokens(lm, pattern):
    """The soonest-closing token of `[a-z]+x` is a letter, again and again, and the `x` that closes is a letter
    too, so the greedy path never closed, nor did it with the letters' class put last: these were refused as
    needing more than 4096 tokens, even at max_tokens 64, though two tokens close them. The search finds the `x`."""
    c = Constraint(grammar_for(regex=pattern), lm.tokenizer, [1], lm.config.text.vocab_size, 6)
    assert c.path is not None and len(c.path) <= 2
    for seed in range(3):
        out, text = _gen(lm, seed, regex=pattern, max_new_tokens=6)
        assert re.fullmatch(pattern, text) and 1 in out.new_tokens[0].tolist(), text


def test_a_schema_pattern_that_goes_round_closes_as_a_response_format_and_as_a_tool_parameter(lm):
    """A JSON Schema string with `"pattern": "^[a-z]+x$"`, as the output's schema and as a forced tool call's
    parameter (arguments in JSON: the call notation does not cover patterns), was a 400 at any max_tokens."""
    for seed in range(3):
        _, text = _gen(lm, seed, json_schema=PATTERN, max_new_tokens=16)
        assert re.fullmatch("[a-z]+x", json.loads(text)["v"]), text
    tok = lm.tokenizer
    tools = [{"type": "function", "function": {"name": "f", "parameters": PATTERN}}]
    grammar, _ = reply_grammar(tok, tools, forced="f")
    for seed in range(3):
        out = lm.generate([lm.encode_chat("Hello", chat=False)], generator=torch.Generator().manual_seed(seed),
                          grammar=grammar, max_new_tokens=24, **FAST)
        ids = out.new_tokens[0].tolist()
        text = tok.decode(ids[:ids.index(1)], skip_special_tokens=False)
        call = re.fullmatch(r"<\|tool_call>call:f(\{.*\})<tool_call\|>", text)
        assert call and re.fullmatch("[a-z]+x", json.loads(call[1])["v"]), text


def test_the_search_takes_a_closing_word_the_vocabulary_holds(lm):
    """`([a-z]+ )+end` ends with a word after a space, and every letter of it continues the loop as well: on the
    shipped KJV model's tokenizer, where ` end` is one token, the search closes it in two tokens."""
    from tokenizers import Tokenizer

    from blockpress.loading import SHIPPED_MODELS

    tok = Tokenizer.from_file(str(SHIPPED_MODELS["kjv"] / "tokenizer.json"))
    c = Constraint(grammar_for(regex=r"([a-z]+ )+end"), tok, [1], tok.get_vocab_size(), 4)
    assert re.fullmatch(r"([a-z]+ )+end", tok.decode(c.path)) and len(c.path) <= 2


def test_a_budget_only_a_shorter_path_fits_is_taken_and_refusals_say_what_was_found(lm):
    """The greedy path of `[a-z]{2,5}(, [0-9]+)*\\.` takes five letters before the dot: a budget of four (`aa.` and
    the stop) was refused; now the search finds the shorter path where the greedy one does not fit. A budget too
    small for every path found names the length found, not a proven minimum; a grammar the search cannot close
    (its closing paths are bounded by CLOSE_LIMIT) is refused as that, not as a budget to raise."""
    tok, V = lm.tokenizer, lm.config.text.vocab_size
    pattern = r"[a-z]{2,5}(, [0-9]+)*\."
    c = Constraint(grammar_for(regex=pattern), tok, [1], V, 4)
    assert re.fullmatch(pattern, tok.decode(c.path)) and len(c.path) <= 3
    _, text = _gen(lm, 0, regex=pattern, max_new_tokens=4)
    assert re.fullmatch(pattern, text), text
    with pytest.raises(GrammarBudgetError, match=r"max_new_tokens=2 is too small .* the shortest output found takes "
                                                 r"\d+ tokens and its stop one more"):
        Constraint(grammar_for(regex=pattern), tok, [1], V, 2)
    with pytest.raises(InputError, match="could not find a way to close this grammar within 4096 tokens") as e:
        Constraint(grammar_for(regex="[a-z]{5000}"), tok, [1], V, 8000)
    assert not isinstance(e.value, GrammarBudgetError)


@pytest.mark.parametrize("spec", [{"regex": "[a-z]{400}"}, {"regex": "[a-z]{50}"},
                                  {"json_schema": {"type": "string", "minLength": 300}}])
def test_a_long_output_costs_a_mask_a_position_not_a_closing_path(lm, spec):
    """A counted repetition's closing path is one token shorter or longer after each token the model writes, so the
    path never applied unchanged and was made again at every position of every step (`[a-z]{400}`: 190 ms a step
    on the KJV model, 1.7 M masks in a generation). The walk now keeps the part of the path the grammar still takes
    after the token: a walk of C positions computes a mask at each and about nothing else."""
    V, C = lm.config.text.vocab_size, 16
    budget = 450 if "json_schema" in spec else int(re.search(r"\d+", spec["regex"])[0]) + 40
    c = Constraint(grammar_for(**spec), lm.tokenizer, [1], V, budget)
    out, masks = _walk_to_the_end(c, V, seed=0, C=C)
    assert max(masks) <= 2 * C, masks
    text = lm.tokenizer.decode(out[:out.index(1)])
    assert (re.fullmatch(spec["regex"], text) if "regex" in spec else len(json.loads(text)) >= 300), text


def _random_regex(rng: random.Random, depth: int = 0) -> str:
    """A small random regular expression in the syntax Python's `re` and llguidance read alike."""
    atoms = ["[a-z]", "[0-9]", "[a-f0-9]", "[a-z ]", "x", "end", "-", r"\.", "(yes|no)"]
    parts = []
    for _ in range(rng.randint(1, 3)):
        atom = rng.choice(atoms) if depth > 1 or rng.random() < 0.7 else f"({_random_regex(rng, depth + 1)})"
        parts.append(atom + rng.choice(["", "", "+", "*", "?", "{2}", "{1,3}"]))
    return "".join(parts) + rng.choice(["", "x", "g", r"\."])


@pytest.mark.parametrize("seed", range(4))
def test_random_regexes_close_within_any_budget_the_path_found_fits(lm, seed):
    """Property: for random regular expressions, a budget that holds the closing path found (and its stop) is never
    refused, and the walk over noise closes with its stop within it and matches; the walk is deterministic. (A
    pattern whose closing path the bounded search does not find, as a nested repetition that returns to the mask
    it started from, is refused as that, and skipped.)"""
    tok, V = lm.tokenizer, lm.config.text.vocab_size
    rng = random.Random(seed)
    for _ in range(6):
        pattern, extra = _random_regex(rng), rng.choice([0, 1, 3, 12])
        try:
            need = len(Constraint(grammar_for(regex=pattern), tok, [1], V, 10**4).path) + 1
        except InputError as e:
            assert not isinstance(e, GrammarBudgetError) and "could not find a way to close" in str(e)
            continue
        budget = need + extra
        runs = [_walk_to_the_end(Constraint(grammar_for(regex=pattern), tok, [1], V, budget), V, seed)[0]
                for _ in range(2)]
        assert runs[0] == runs[1], pattern
        out = runs[0]
        assert 1 in out[:budget], (pattern, budget, tok.decode(out))
        text = tok.decode(out[:out.index(1)])
        assert re.fullmatch(pattern, text), (pattern, budget, text)


@pytest.mark.parametrize("pattern", [r"[a-z0-9._]+@[a-z0-9]+\.[a-z]{2,3}", r"[a-z0-9.-]+:[0-9]{2,5}",
                                     r"[A-Za-z0-9_]+\([a-z, ]*\)", r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"])
def test_a_separator_the_repetition_before_it_does_not_take_is_found(lm, pattern):
    """An e-mail address, a host:port and a call: the repetition's class (38-63 characters, most of the tiny
    tokenizer's pieces) hides its way out, the `@`, `:` or `(` it newly allows, from the greedy path (a digit, again
    and again) and from the bounded search (one mask for each of its characters, level after level). They were
    refused as needing more than 4096 tokens. `_novel` takes the newly allowed character (the call's `,` inside its
    parentheses again and again, so there the search by character class finds `0()`). The common e-mail regex's `.`
    is a character of the repetition before it too, so no state newly allows it and every state after the `@` has one
    mask: the search by class finds `0@0.he` going depth first, where more masks were new (it failed breadth
    first), with the tiny tokenizer's byte tokens (`<0x41>`) classed by their characters (it failed with each its
    own class, 62 steps a state). A budget that holds the path closes, matched."""
    V = lm.config.text.vocab_size
    need = len(Constraint(grammar_for(regex=pattern), lm.tokenizer, [1], V, 10**4).path) + 1
    assert need <= 8
    for seed in range(2):
        out, _ = _walk_to_the_end(Constraint(grammar_for(regex=pattern), lm.tokenizer, [1], V, need + 6), V, seed)
        assert 1 in out
        text = lm.tokenizer.decode(out[:out.index(1)])
        assert re.fullmatch(pattern, text), text


def test_a_byte_token_is_classed_by_its_character_for_the_search_by_class(lm):
    """The tiny tokenizer has a token per byte (`<0x30>`) beside the characters' own: each is a lead of its own (a
    special-looking piece), and the search by character class took every one as a class of its own."""
    c = Constraint(grammar_for(regex="[a-z0-9]+"), lm.tokenizer, [1], lm.config.text.vocab_size, 8)
    raw = lm.tokenizer._tok if hasattr(lm.tokenizer, "_tok") else lm.tokenizer
    vocab, bits = c.vocab, c.matcher.compute_bitmask()
    byte_leads = [t for t in vocab.allowed_leads(bits) if re.fullmatch(r"<0x[0-9A-F]{2}>", raw.id_to_token(t) or "")]
    assert byte_leads  # the regression needs them: the allowed byte tokens of digits and letters are leads
    assert {vocab.lead_class[t] for t in byte_leads} <= {"digit", "lower"}
    assert len(vocab.allowed_classes(bits)) == 2


def test_an_email_pattern_inside_a_json_schema_closes(lm):
    """The common e-mail regex as a JSON Schema string's `pattern` (where pydantic-style schemas put it): the
    closing quote and brace follow the address, one level deeper than the regex alone, and the search by class
    found no path in 128 masks depth first, nor breadth first; it has `DEEP_NODES` (it was a 400 at any max_tokens)."""
    email = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"
    schema = {"type": "object", "properties": {"email": {"type": "string", "pattern": f"^{email}$"}},
              "required": ["email"], "additionalProperties": False}
    for seed in range(2):
        _, text = _gen(lm, seed, json_schema=schema, max_new_tokens=40)
        assert re.fullmatch(email, json.loads(text)["email"]), text
