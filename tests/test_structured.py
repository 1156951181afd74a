"""Structured output: every committed canvas obeys a grammar (JSON Schema, any JSON object, a regular expression or
a Lark grammar), on a random-weight tiny model that writes noise, so every valid answer is the constraint's doing."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

import blockpress
from blockpress.errors import InputError
from blockpress.testing import random_schema

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_server import build_tiny_model  # noqa: E402

FAST = {"max_denoising_steps": 3, "stability_threshold": None, "confidence_threshold": None}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield blockpress.load(build_tiny_model(tmp_path_factory.mktemp("structured")), progress=False)
    torch.set_num_threads(n)


def _gen(lm, seed, prompt="Hello", **kw):
    ids = lm.encode_chat(prompt, chat=False)
    out = lm.generate([ids], generator=torch.Generator().manual_seed(seed), **{**FAST, **kw})
    return out, lm.decode_new(out)


@pytest.mark.parametrize("seed", range(10))
def test_random_schemas_give_valid_json(lm, seed):
    """Nested objects, arrays with bounds, enums, bounded numbers, optional fields, anyOf, strings with lengths:
    the output parses and validates (benchmarks/structured_output.py runs 200 of them)."""
    schema = random_schema(random.Random(seed))
    _, text = _gen(lm, seed, json_schema=schema, max_new_tokens=128)
    jsonschema.validate(json.loads(text), schema)


def test_without_the_constraint_the_model_writes_noise(lm):
    """The same seeds unconstrained: not JSON (so the tests above measure the constraint, not the model)."""
    for seed in range(3):
        _, text = _gen(lm, seed, max_new_tokens=32, eos_token_id=[1])
        with pytest.raises(ValueError):
            json.loads(text)


def test_a_tight_budget_still_closes(lm):
    """An unbounded string and a budget a few tokens over the shortest output: the walk closes the string and
    the object in time, and the stop id fits."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["text", "n"], "additionalProperties": False}
    for budget in (21, 24, 40):
        out, text = _gen(lm, budget, json_schema=schema, max_new_tokens=budget)
        jsonschema.validate(json.loads(text), schema)
        assert 1 in out.new_tokens[0].tolist()  # the stop id was written within max_new_tokens


def test_regex_lark_and_json_object(lm):
    _, text = _gen(lm, 0, regex=r"[0-9]{3}-[a-z]{2,4}", max_new_tokens=16)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    _, text = _gen(lm, 1, grammar='start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]+/', max_new_tokens=16)
    assert re.fullmatch(r"yes|no|maybe [0-9]+", text), text
    _, text = _gen(lm, 2, json_object=True, max_new_tokens=48)
    assert isinstance(json.loads(text), dict)
    for seed in range(3):  # the empty schema is any JSON value (it was taken for no schema: free text)
        _, text = _gen(lm, seed, json_schema={}, max_new_tokens=32)
        json.loads(text)


@pytest.mark.parametrize("pattern", [r"[0-9]+ apples", r"[a-z]{2,5}(, [0-9]+)*\.", r"x[0-9]+y[0-9]+z"])
def test_grammars_whose_closest_tokens_go_round_still_close_in_a_small_budget(lm, pattern):
    """Taking the soonest-closing token at each step can go round (a digit, then another, where the pattern ends
    with a word; a comma and a number again and again before the dot): such grammars were refused as needing more
    than 4096 tokens. Where the greedy path goes round, a short one is now searched for (`Constraint._search`;
    tests/test_constraint_path.py)."""
    from blockpress.engine.constraint import Constraint, grammar_for

    c = Constraint(grammar_for(regex=pattern), lm.tokenizer, [1], lm.config.text.vocab_size, 12)
    assert c.path is not None and len(c.path) < 12
    for seed in range(3):
        _, text = _gen(lm, seed, regex=pattern, max_new_tokens=12)
        assert re.fullmatch(pattern, text), text


def test_same_seed_same_output_streamed_batched_and_across_canvases(lm):
    """Reproducible per seed; streaming gives generate's tokens; a constrained row gives the same tokens alone
    and beside another row (per-row generators and grammar states); the grammar state carries across canvases
    (C = 16 here). Alone against beside is compared in float64: in fp32, torch's grouped GEMM on an AVX-512 CPU
    rounds an expert's rows differently when it gets 1-2 tokens than when it gets more, which flipped a token of
    this random model's near-flat constrained logits on such a machine. That is the BLAS's rounding, not the
    engine's per-row state, which is what this checks."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 8,
              "maxItems": 12}
    kw = dict(json_schema=schema, max_new_tokens=64, **FAST)
    a = lm.encode_chat("Numbers:", chat=False)
    b = lm.encode_chat("Some other prompt", chat=False)
    exact = blockpress.load(lm.path, dtype=torch.float64, progress=False)
    alone64 = exact.generate([a], generator=[torch.Generator().manual_seed(3)], **kw)
    both = exact.generate([a, b], generator=[torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)],
                          **kw)
    assert torch.equal(both.new_tokens[0], alone64.new_tokens[0])
    jsonschema.validate(json.loads(exact.decode_new(both, 1)), schema)
    alone = lm.generate([a], generator=[torch.Generator().manual_seed(3)], **kw)
    events = list(lm.stream([a], generator=[torch.Generator().manual_seed(3)], **kw))
    streamed = torch.cat([e.tokens for e in events if isinstance(e, blockpress.Commit)], dim=-1)
    assert torch.equal(streamed[0, :64], alone.new_tokens[0])
    toks = alone.new_tokens[0].tolist()
    assert (toks.index(1) if 1 in toks else len(toks)) > 16  # the output spans two canvases or more
    jsonschema.validate(json.loads(lm.decode_new(alone)), schema)


def test_a_clone_starts_where_its_constraint_is_and_keeps_its_own_state(lm):
    """A request's rows share one compile: `clone` copies the grammar state. The clone of a fresh constraint walks
    as a newly compiled one does, and tokens committed to one of the two leave the other where it was."""
    from blockpress.engine.constraint import Constraint, grammar_for

    spec = grammar_for(json_schema={"type": "array", "items": {"type": "integer"}, "minItems": 2})
    made = lambda: Constraint(spec, lm.tokenizer, [1], lm.config.text.vocab_size, 64)  # noqa: E731
    first, fresh = made(), made()
    twin = first.clone()
    z = torch.randn(8, lm.config.text.vocab_size, generator=torch.Generator().manual_seed(0))
    y = z.argmax(-1)
    walked = fresh.walk(z, y)
    assert twin.walk(z, y) == walked
    first.advance(walked[0][:3])
    assert twin.written == 0 and first.written == 3
    assert twin.walk(z, y) == walked and first.walk(z, y) != walked


def _spelled(V: int, ids: list[int], C: int, stop: int = 1) -> torch.Tensor:
    """Logits [C, V] whose argmax spells `ids`, then the stop id."""
    z = torch.zeros(C, V)
    for j, t in enumerate(ids + [stop] * (C - len(ids))):
        z[j, t] = 10.0
    return z


def test_a_walk_keeps_the_argmax_where_the_grammar_allows_it_numbers_included(lm):
    """Where the model's argmax is a valid output (the schema's properties in its order) and the budget is ample,
    the walk changes nothing: multi-digit numbers included. (Digits once ranked as closing sooner than a comma, so
    the closing path from inside a number that a comma must follow was digits without end; every such number was
    cut to the grammar's first digit, "value": 0.)"""
    from blockpress.engine.constraint import Constraint, grammar_for

    tok, V = lm.tokenizer, lm.config.text.vocab_size
    schema = {"type": "object", "properties": {"value": {"type": "integer"}, "unit": {"type": "string"},
                                               "rate": {"type": "number"}, "n": {"type": "array", "items": {
                                                   "type": "integer"}}}, "required": ["value", "unit"]}
    for text in ['{"value": 3000, "unit": "m"}', '{"value": 19, "unit": "km", "rate": -0.25, "n": [12, 345]}',
                 '{"value": 7, "unit": ""}']:
        ids = tok.encode(text)
        c = Constraint(grammar_for(json_schema=schema), tok, [1], V, 96)
        z = _spelled(V, ids, len(ids) + 6)
        walked, drawn, _ = c.walk(z, z.argmax(-1))
        assert walked == drawn == ids + [1] * 6, tok.decode(walked)


def test_the_closing_path_is_valid_kept_across_commits_and_fits_the_budget(lm):
    """Any draft, any budget the grammar can close in: the walked canvases always close with their stop within
    max_new_tokens and parse; the path kept at a commit is the one its walk ended on, and it closes the grammar."""
    from blockpress.engine.constraint import Constraint, grammar_for

    tok, V = lm.tokenizer, lm.config.text.vocab_size
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6},
                                               "c": {"type": "array", "items": {"type": "number"}}},
              "required": ["a", "b", "c"]}
    g = torch.Generator().manual_seed(0)
    for budget in (27, 31, 40, 64):  # 27: the shortest output and its stop
        for trial in range(3):
            c = Constraint(grammar_for(json_schema=schema), tok, [1], V, budget)
            out = []
            while not c.ended and len(out) < budget:
                z = torch.randn(16, V, generator=g) * 4
                z[:, torch.randint(3, V, (1,), generator=g)] += 2  # a token the draft favours everywhere
                for _ in range(3):  # three steps of one canvas, the last one committed
                    walked, _, _ = c.walk(z, z.argmax(-1))
                    z = z + torch.randn(16, V, generator=g)
                c.advance(walked)
                out += walked
                if not c.ended:
                    m = c.matcher.deep_copy()
                    assert c.path is not None and m.consume_tokens(c.path) and m.is_accepting()
            text = tok.decode([t for t in out[:out.index(1)]] if 1 in out else out)
            assert 1 in out[:budget], (budget, text)
            parsed = json.loads(text)
            assert {"a", "b", "c"} <= set(parsed) and isinstance(parsed["a"], int), text


@pytest.mark.gpu
def test_a_walk_over_logits_on_the_gpu_is_the_walk_on_the_cpu(lm):
    """The step's logits live on the device: the walk's masked argmax (where none of the top candidates is allowed,
    as letters where a number must start) reads them there, and walks as it does over the same logits on the CPU."""
    from blockpress.engine.constraint import Constraint, grammar_for

    tok, V = lm.tokenizer, lm.config.text.vocab_size
    spec = grammar_for(json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    z = torch.randn(24, V, generator=torch.Generator().manual_seed(3))
    z[:, [t for t in range(V) if tok.decode([t]).strip().isdigit()]] -= 20  # no digit among the candidates
    walks = [Constraint(spec, tok, [1], V, 64).walk(x, x.argmax(-1)) for x in (z, z.cuda())]
    assert walks[0] == walks[1]
    assert isinstance(json.loads(tok.decode(walks[0][0][:walks[0][0].index(1)]))["n"], int)


def test_closest_is_the_first_token_in_closing_order_the_mask_allows(lm):
    """`Vocabulary.closest` (a few tokens tested bit by bit, else the set bytes of the mask read) gives what
    `closest_reference` (the tokens in closing order, one by one) gives, in every state along random walks of a
    JSON Schema, a regular expression, a Lark grammar and a strict tools grammar."""
    from blockpress.engine.constraint import Constraint, grammar_for, reply_grammar

    tok, V = lm.tokenizer, lm.config.text.vocab_size
    specs = [grammar_for(json_schema={"type": "object", "properties": {"k": {"type": "array", "items": {
                 "type": "number"}}, "s": {"type": "string"}}, "required": ["k"]}),
             grammar_for(regex=r"[a-z]{2,5}(, [0-9]+)*\."), grammar_for(grammar='start: "x" NUM+ "y"\nNUM: /[0-9]/'),
             reply_grammar(tok, STRICT_TOOLS)[0]]
    g = torch.Generator().manual_seed(1)
    stops = [1, tok.token_to_id("<turn|>")]
    for spec in specs:
        c = Constraint(spec, tok, stops, V, 64)
        vocab = c.vocab
        for _ in range(6):
            m = c.matcher.deep_copy()
            for _ in range(12):
                bits = m.compute_bitmask()
                allowed = [t for t in range(V) if (bits[t >> 3] >> (t & 7)) & 1]
                if not allowed or m.is_accepting() and torch.rand(1, generator=g) < 0.3:
                    break
                assert vocab.closest(bits) == vocab.closest_reference(bits)
                t = allowed[int(torch.randint(len(allowed), (1,), generator=g))]
                if t in stops:
                    break
                m.consume_token(t)


def test_errors_name_the_problem(lm):
    with pytest.raises(InputError, match="Unknown format"):
        _gen(lm, 0, json_schema={"type": "string", "format": "no-such-format"}, max_new_tokens=16)
    with pytest.raises(InputError, match="look-around"):
        _gen(lm, 0, regex="(?<=a)b", max_new_tokens=16)
    with pytest.raises(InputError, match="one of json_schema, json_object, regex, grammar"):
        _gen(lm, 0, regex="a", json_object=True, max_new_tokens=16)
    with pytest.raises(InputError, match="max_new_tokens=4 is too small"):
        _gen(lm, 0, json_schema={"type": "object", "properties": {"abc": {"type": "string", "minLength": 5}},
                                 "required": ["abc"]}, max_new_tokens=4)
    with pytest.raises(InputError, match="not valid JSON"):
        _gen(lm, 0, json_schema="{oops", max_new_tokens=16)
    with pytest.raises(InputError, match="json_schema must be a JSON Schema"):
        _gen(lm, 0, json_schema=5, max_new_tokens=16)  # a ValueError from the grammar compiler before
    with pytest.raises(InputError, match="regex must be a non-empty string"):
        _gen(lm, 0, regex="", max_new_tokens=16)  # free text before
    with pytest.raises(InputError, match="fixed_tokens"):
        ids = lm.encode_chat("Hello", chat=False)
        lm.generate([ids], regex="[a-z]+", fixed_tokens=[[-1, -1]], max_new_tokens=16)


def test_forced_call_grammar_writes_the_arguments_as_the_chat_template_renders_them(lm):
    """The grammar of a forced tool call (tool_choice) takes the arguments in Gemma's notation, exactly as the chat
    template renders a call (keys sorted and bare, strings between <|"|> tokens), and nothing that breaks the
    schema; a schema the notation's translation does not cover (anyOf) falls back to JSON arguments."""
    import llguidance

    from blockpress.engine.constraint import Constraint, call_grammar

    tok = lm.tokenizer
    schema = {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7},
        "units": {"type": "string", "enum": ["c", "f"]}, "hours": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}}}}}
    loose = {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}
    grammar = call_grammar(tok.token_to_id("<|tool_call>"), tok.token_to_id("<tool_call|>"),
                           {"get_weather": schema, "f": loose}, tok.token_to_id('<|"|>'))

    def accepted(text: str) -> bool:
        m = llguidance.LLMatcher(Constraint(grammar, tok, [1], lm.config.text.vocab_size, 64).vocab.llg, grammar)
        return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()

    def rendered(name: str, args: dict) -> str:
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}]}], tokenize=False)
        return text[text.index("<|tool_call>"):text.index("<tool_call|>") + len("<tool_call|>")]

    for args in [{"city": "Paris"}, {"city": "Oslo", "days": 3, "units": "f"}, {"hours": [1, 20], "city": "Rome"},
                 {"city": "Lima", "where": {"ok": True, "lat": -12.5}}, {"city": "Lima", "where": {}}]:
        assert accepted(rendered("get_weather", args)), rendered("get_weather", args)
    for args in [{"city": "P"}, {"days": 3}, {"city": "Paris", "days": 9}, {"city": "Paris", "units": "k"},
                 {"city": "Paris", "hours": ["x"]}]:
        assert not accepted(rendered("get_weather", args)), args
    assert not accepted('<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>')  # JSON: not the notation
    assert not accepted('<|tool_call>call:get_weather{days:3,city:<|"|>Paris<|"|>}<tool_call|>')  # keys unsorted
    assert accepted('<|tool_call>call:f{"x": 2}<tool_call|>')  # anyOf: JSON arguments


def test_the_grammars_forced_opening_is_accepted_at_the_first_step(lm):
    """Tokens the grammar forces from the row's state (here a fixed opening before a free number) are written at
    the canvas's first positions and accepted in the first step, so the next pass reads them; on the
    random-weight model, whose entropies are high everywhere, plain entropy-bound acceptance would keep few of
    them. Across canvases the forced run starts from the committed state."""
    opening = "The answer, as a number with no unit, is "
    grammar = f'start: {json.dumps(opening)} NUMBER "."\nNUMBER: /[0-9]{{1,3}}/'
    ids = lm.encode_chat("Hello", chat=False)
    events = list(lm.stream([ids], generator=[torch.Generator().manual_seed(0)], grammar=grammar,
                            max_new_tokens=48, entropy_bound=0.1, **FAST))
    first = next(e for e in events if isinstance(e, blockpress.Draft))
    n = len(lm.tokenizer.encode(opening))
    forced = first.tokens[0, :n].tolist()
    assert lm.tokenizer.decode(forced) == opening[:len(lm.tokenizer.decode(forced))] and len(forced) >= 4
    assert bool(first.accepted[0, :n - 1].all())  # (the last piece may merge with what follows: not forced)
    text = lm.decode_new(events[-1].result)
    assert re.fullmatch(re.escape(opening) + r"[0-9]{1,3}\.", text), text


STRICT_TOOLS = [
    {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "calculate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def test_a_strict_reply_calls_offered_tools_only_with_valid_arguments(lm):
    """`strict` tools under tool_choice "auto" (engine/constraint.py reply_grammar): any text that opens no call,
    then calls of offered tools; a strict tool's arguments valid, a tool without strict any arguments. Without a
    strict tool (and no forced call) the reply is free."""
    import llguidance

    from blockpress.engine.constraint import Constraint, reply_grammar

    tok = lm.tokenizer
    assert reply_grammar(tok, [{**t, "function": {**t["function"], "strict": False}} for t in STRICT_TOOLS]) is None
    grammar, guarded = reply_grammar(tok, STRICT_TOOLS)
    assert guarded == (tok.token_to_id("<|tool_call>"),)

    def accepted(text: str) -> bool:
        m = llguidance.LLMatcher(Constraint(grammar, tok, [1], lm.config.text.vocab_size, 64).vocab.llg, grammar)
        return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()

    call = '<|tool_call>call:get_time{city:<|"|>Oslo<|"|>}<tool_call|>'
    assert accepted("I can't check the weather: I have no weather tool here.")
    assert accepted("<|channel>thought\nThe time in Oslo, so I call get_time.<channel|>" + call)
    assert accepted(call + '<|tool_call>call:calculate{x:[1,-2.5e3,true],y:{z:<|"|>a b<|"|>}}<tool_call|>')
    assert not accepted("<|tool_call>call:calculate{anything goes}<tool_call|>")  # not strict: any object
    assert not accepted('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>')  # not offered
    assert not accepted("<|tool_call>call:get_time{}<tool_call|>")  # a strict tool's required argument missing
    assert not accepted('<|tool_call>call:get_time{city:3}<tool_call|>')
    assert not accepted(call + "and then some text")
    assert not accepted("call:get_weather{}<tool_call|>")  # a call's closing marker is no text either


def test_a_required_call_may_come_with_more_a_named_one_alone(lm):
    """tool_choice "required" allowed exactly one call (the weather in Paris and in Rome got one); OpenAI's
    "required" is one or more. With `parallel` the grammar takes one or more calls of offered tools, never none;
    without it (a named tool, or parallel_tool_calls false) exactly one."""
    import llguidance

    from blockpress.engine.constraint import Constraint, reply_grammar

    tok = lm.tokenizer
    paris, rome = ('<|tool_call>call:get_time{city:<|"|>' + c + '<|"|>}<tool_call|>' for c in ("Paris", "Rome"))

    def accepted(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(Constraint(grammar, tok, [1], lm.config.text.vocab_size, 64).vocab.llg, grammar)
        return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()

    some = reply_grammar(tok, STRICT_TOOLS, forced="", parallel=True)[0]
    one = reply_grammar(tok, STRICT_TOOLS, forced="")[0]
    named = reply_grammar(tok, STRICT_TOOLS, forced="get_time")[0]
    for grammar, two in ((some, True), (one, False), (named, False)):
        assert accepted(grammar, paris) and accepted(grammar, paris + rome) == two
        assert not accepted(grammar, "") and not accepted(grammar, "It is noon.")


def test_tools_beside_an_output_grammar_give_calls_or_an_answer_in_that_grammar(lm):
    """OpenAI's tools beside response_format (an agent's tool loop with a typed final answer, the Agents SDK's
    `output_type` with tools): the reply is one or more calls of offered tools, or an answer in the output grammar.
    It was refused beside strict tools (a 400 on the server), and beside other tools the grammar covered the whole
    reply, so no tool could ever be called. A forced call is the whole reply (the answer comes on a later turn)."""
    import llguidance

    from blockpress.engine.constraint import Constraint, grammar_for, reply_grammar

    tok = lm.tokenizer
    schema = {"type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}
    output = grammar_for(json_schema=schema)
    loose = [{**t, "function": {**t["function"], "strict": False}} for t in STRICT_TOOLS]
    call = '<|tool_call>call:get_time{city:<|"|>Oslo<|"|>}<tool_call|>'
    for tools in (STRICT_TOOLS, loose):
        grammar, guarded = reply_grammar(tok, tools, output_grammar=output)
        assert guarded == (tok.token_to_id("<|tool_call>"),)

        def accepted(text: str) -> bool:
            m = llguidance.LLMatcher(Constraint(grammar, tok, [1], lm.config.text.vocab_size, 64).vocab.llg,
                                     grammar)
            return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()

        assert accepted('{"hour": 12}') and accepted(call) and accepted(call + call)
        assert not accepted("It is noon.") and not accepted('{"minute": 3}') and not accepted('{"hour": 12}' + call)
        assert not accepted('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>')  # not offered
        assert accepted("<|tool_call>call:get_time{}<tool_call|>") == (tools is loose)  # strict: city required
    forced = reply_grammar(tok, STRICT_TOOLS, forced="get_time", output_grammar=output)
    assert forced == reply_grammar(tok, STRICT_TOOLS, forced="get_time")
    assert reply_grammar(tok, None, output_grammar=output) is None  # no tools: the output grammar alone
    assert reply_grammar(tok, loose) is None  # neither: a free reply
    seen = set()
    for seed in range(6):  # the Python API: each reply is calls or the answer, whichever the model drafts
        reply = lm.chat("What time is it in Oslo?", tools=STRICT_TOOLS, json_schema=schema, max_new_tokens=48,
                        seed=seed)
        if reply.tool_calls:
            assert not reply.content and {c.name for c in reply.tool_calls} <= {"get_time", "calculate"}
            seen.add("calls")
        else:
            assert isinstance(json.loads(reply.content)["hour"], int)
            seen.add("answer")
    assert seen == {"calls", "answer"}, seen  # (this model drafts both, across these seeds)


def test_a_guarded_opening_is_not_written_where_the_drafted_name_is_not_offered(lm):
    """Synthetic logits: the model's best token at position 0 opens a call, and its draft of the next positions
    names a tool nobody offered. Unguarded, the grammar takes the opening (and would then force an offered name);
    guarded (a strict reply's call opening), the second-best token, text. A draft that names an offered tool keeps
    the opening."""
    from blockpress.engine.constraint import Constraint, reply_grammar

    tok = lm.tokenizer
    grammar, guarded = reply_grammar(tok, STRICT_TOOLS)
    draft = tok.encode("<|tool_call>call:get_weather{city:")
    text = tok.encode("I")[0]
    V = lm.config.text.vocab_size
    z = torch.zeros(len(draft), V)
    for j, t in enumerate(draft):
        z[j, t] = 10.0
    z[0, text] = 9.0
    for offered in ("get_time", "calculate"):  # the draft fits neither
        assert tok.encode("call:" + offered)[:len(draft) - 1] != draft[1:]
    y = z.argmax(-1)
    a_plain, _, _ = Constraint(grammar, tok, [1], V, 64).walk(z, y)
    a_ahead, y_ahead, _ = Constraint(grammar, tok, [1], V, 64, guarded).walk(z, y)
    assert a_plain[0] == draft[0]
    assert a_ahead[0] == text and y_ahead[0] == text
    offered = tok.encode("<|tool_call>call:get_time{city:")
    z = torch.zeros(len(offered), V)
    for j, t in enumerate(offered):
        z[j, t] = 10.0
    z[0, text] = 9.0
    assert Constraint(grammar, tok, [1], V, 64, guarded).walk(z, z.argmax(-1))[0][:len(offered)] == offered


def test_a_constrained_request_cancelled_before_its_canvas_runs_leaves_the_batch_alone(lm):
    """A constrained request cancelled between a boundary and its canvas's first step (a client that disconnects,
    or a stop string met, while another request joins) is frozen with the canvas it started from: noise its grammar
    never walked. The commit fed that noise to its grammar, which raised, and the worker failed every request in the
    batch with the exception's text, which quoted the cancelled request's tokens and schema. Now nothing continues
    from a cancelled row's canvas: the other request gets the commits it gets alone."""
    from blockpress.engine.constraint import Constraint, grammar_for
    from blockpress.server.worker import Job, RowCommit, RowDone, RowError, Worker

    C, V = lm.canvas_length, lm.config.text.vocab_size
    resolve = blockpress.config.GenerationConfig.resolve
    cfg = resolve(max_new_tokens=3 * C, eos_token_id=[1], pad_token_id=0, **FAST)
    spec = grammar_for(json_schema={"type": "string", "minLength": 2 * C})

    def other():
        return Job([7, 8, 9, 11], resolve(max_new_tokens=C, eos_token_id=None, pad_token_id=None, **FAST), seed=1)

    def run(s, first=None):
        h = s.submit(other())
        while s.busy:
            with torch.no_grad():
                s.canvas()
        events = h.drain()
        return [e.tokens for e in events if isinstance(e, RowCommit)], events

    alone, _ = run(Worker(lm, max_batch=3))
    s = Worker(lm, max_batch=3)
    first = s.submit(Job([7, 8, 9, 10], cfg, seed=0, constraint=Constraint(spec, lm.tokenizer, [1], V, 3 * C)))
    with torch.no_grad():
        s.canvas()  # its first canvas, walked by its grammar
    admit = s.scheduler.admit

    def admit_and_disconnect(*args):  # the cancel lands while the other request is admitted
        first.cancel()
        return admit(*args)

    s.scheduler.admit = admit_and_disconnect
    got, events = run(s)
    assert not [e for e in events if isinstance(e, RowError)] and isinstance(events[-1], RowDone)
    assert got == alone


def test_an_output_the_budget_closed_finishes_with_length(lm):
    """Where the walk writes the closing path in place of the model's token because max_tokens would not hold more
    (`Constraint.cut`), the reply is complete and valid but cut short: the worker's commit says so and the server's
    answer finishes with "length" (it said "stop", so a client could not tell). A grammar the model closes well
    inside its budget is not cut."""
    from blockpress.server.serving import OutputAssembler
    from blockpress.server.worker import Job, RowCommit, Worker

    C, V = lm.canvas_length, lm.config.text.vocab_size
    resolve = blockpress.config.GenerationConfig.resolve

    def commits(spec, budget):
        cfg = resolve(max_new_tokens=budget, eos_token_id=[1], pad_token_id=0, **FAST)
        s = Worker(lm, max_batch=2)
        h = s.submit(Job([7, 8, 9, 10], cfg, seed=0, constraint=Constraint(spec, lm.tokenizer, [1], V, budget)))
        while s.busy:
            with torch.no_grad():
                s.canvas()
        return [e for e in h.drain() if isinstance(e, RowCommit)]

    from blockpress.engine.constraint import Constraint, grammar_for

    long = commits(grammar_for(json_schema={"type": "string"}), C)  # noise: a string that never ends, cut
    short = commits(grammar_for(regex="a"), C)
    assert long[-1].cut and not short[-1].cut
    for events, want in ((long, "length"), (short, "stop")):
        asm = OutputAssembler(lm.tokenizer, [1], C, chat=False)
        for e in events:
            asm.cut = asm.cut or e.cut  # what OpenAIServing._events does
            asm.feed(e.tokens)
        assert asm.finish().finish_reason == want


@pytest.mark.parametrize("pattern", ["x<mask>y", "said <eos> to", r"see <turn\|> here"])
def test_a_grammar_whose_text_spells_a_control_token_writes_that_text(lm, pattern):
    """A grammar's text is text: `<mask>` in a regex is written as the ordinary tokens that spell it, as a prompt's
    text is encoded. The grammar engine's tokenizer split such text into the control token's id, so the forced
    tokens held an id the grammar refuses: `<mask>` broke the grammar (a RuntimeError, a 500 on the server) and
    `<eos>` / `<turn|>` ended the output early as if it were done."""
    for seed in range(2):
        out, text = _gen(lm, seed, regex=pattern, max_new_tokens=24)
        assert re.fullmatch(pattern, text), text
        control = {lm.tokenizer.token_to_id(s) for s in ("<mask>", "<eos>", "<turn|>")} - {None}
        new = out.new_tokens[0].tolist()
        assert not control & set(new[:new.index(1) if 1 in new else len(new)])  # as text, not as control ids
