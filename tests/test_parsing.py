"""Output parsing: reasoning / content / tool calls, control-token stripping, streaming."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockpress.chat import DEFAULT_GEMMA4_TEMPLATE, render_chat_template
from blockpress.parsing import StreamingParser, ToolCall, parse_gemma_arguments, parse_output
from blockpress.tokenizer import GEMMA4_CONTROL_TOKENS

Q = '<|"|>'


def ids(i: int) -> str:
    return f"call_{i}"


def parse(text, reason="stop", **kw):
    return parse_output(text, reason, make_id=ids, **kw)


# ----------------------------------------------------------------------------- reasoning / content
def test_plain_content():
    r = parse("Hello world.<turn|>")
    assert (r.content, r.reasoning, r.tool_calls, r.finish_reason) == ("Hello world.", None, [], "stop")


def test_reasoning_then_answer():
    r = parse("<|channel>thought\nThe sky scatters blue light.<channel|>Rayleigh scattering.<turn|>")
    assert r.reasoning == "The sky scatters blue light."
    assert r.content == "Rayleigh scattering."


def test_empty_thought_block_and_unclosed_reasoning():
    r = parse("<|channel>thought\n<channel|>Answer")
    assert (r.reasoning, r.content) == (None, "Answer")
    r = parse("<|channel>thought\nstill thinking about it", "length")
    assert (r.reasoning, r.content, r.finish_reason) == ("still thinking about it", "", "length")
    r = parse("<|channel>thou", "length")  # cut inside the header line
    assert (r.reasoning, r.content) == (None, "")


def test_starts_in_reasoning_and_other_channels():
    r = parse("more thoughts<channel|>Done", starts_in_reasoning=True)
    assert (r.reasoning, r.content) == ("more thoughts", "Done")
    r = parse("<|channel>final\nThe answer<channel|>")
    assert (r.reasoning, r.content) == (None, "The answer")
    r = parse("<|channel>no header here<channel|>ok")  # no NAME\n line: whole body is reasoning
    assert (r.reasoning, r.content) == ("no header here", "ok")


def test_control_tokens_never_leak():
    text = ("<bos><|turn>model\n<|think|>Hi<pad> there<|tool><tool|><tool_response|><|image><image|>"
            "<channel|><tool_call|>!<turn|>\n<|turn>user\nignored<pad><pad>")
    r = parse(text)
    assert r.content == "Hi there!"
    assert r.reasoning is None
    r = parse('He said <|"|>hi<|"|>.<eos><pad>')
    assert r.content == 'He said "hi".'


def test_stop_tokens_end_output():
    for stop in ("<turn|>", "<eos>", "<|tool_response>"):
        r = parse(f"answer{stop}garbage <|channel>thought\nx<channel|>")
        assert (r.content, r.reasoning) == ("answer", None)


def test_text_that_only_looks_like_control_tokens_is_kept():
    for text in ["a < b and c > d", "<html><body>", "x <|not_a_token|> y", "<|tur", "<turn", "1 <", "<"]:
        r = parse(text)
        assert r.content == text, text


# ----------------------------------------------------------------------------- tool calls
def test_single_tool_call_with_gemma_strings():
    text = (f"Let me check.<|tool_call>call:get_weather{{location:{Q}Paris, {{FR}} [x]{Q},"
            f"days:3,temp:-1.5e2,ok:true,none:null,tags:[{Q}a{Q},{Q}b:c{Q}],"
            f"opts:{{unit:{Q}c{Q},nested:{{deep:[1,{{k:false}}]}}}}}}<tool_call|><|tool_response>")
    r = parse(text)
    assert r.content == "Let me check."
    assert r.finish_reason == "tool_calls"
    assert len(r.tool_calls) == 1
    call = r.tool_calls[0]
    assert (call.id, call.name) == ("call_0", "get_weather")
    assert json.loads(call.arguments_json) == {
        "location": "Paris, {FR} [x]", "days": 3, "temp": -150.0, "ok": True, "none": None,
        "tags": ["a", "b:c"], "opts": {"unit": "c", "nested": {"deep": [1, {"k": False}]}}}
    assert call.to_openai() == {"id": "call_0", "type": "function",
                                "function": {"name": "get_weather", "arguments": call.arguments_json}}


def test_multiple_calls_and_json_style_arguments():
    text = (f"<|tool_call>call:a{{x:1}}<tool_call|><|tool_call>call:ns.tool-b{{\"q\": \"say \\\"hi\\\"\", "
            f"{Q}weird key{Q}: {Q}v{Q}}}<tool_call|><|tool_call>call:c{{}}<tool_call|>")
    r = parse(text, "length")
    assert [c.name for c in r.tool_calls] == ["a", "ns.tool-b", "c"]
    assert [c.id for c in r.tool_calls] == ["call_0", "call_1", "call_2"]
    assert [c.arguments for c in r.tool_calls] == [{"x": 1}, {"q": 'say "hi"', "weird key": "v"}, {}]
    assert r.content == "" and r.finish_reason == "tool_calls"


def test_call_arguments_are_json_with_every_number_as_written():
    """A number past a double's range came back as `Infinity` (not JSON: JSON.parse and strict parsers refuse the
    call), and a long decimal was rounded (444444444444.44444 -> ...44446): the arguments JSON keeps each number as
    the model wrote it; the parsed dict holds Python numbers."""
    r = parse(f"<|tool_call>call:f{{lat:1e999,lon:444444444444.44444,n:12,l:[1.50,-0.0],s:{Q}a{Q}}}<tool_call|>",
              "stop")
    text = r.tool_calls[0].arguments_json

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    json.loads(text, parse_constant=refuse)  # no Infinity / NaN
    assert text == '{"lat": 1e999, "lon": 444444444444.44444, "n": 12, "l": [1.50, -0.0], "s": "a"}'
    assert r.tool_calls[0].arguments == {"lat": float("inf"), "lon": 444444444444.44444, "n": 12, "l": [1.5, -0.0],
                                         "s": "a"}


def test_default_ids_are_unique():
    r = parse_output("<|tool_call>call:a{}<tool_call|><|tool_call>call:a{}<tool_call|>")
    assert len({c.id for c in r.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in r.tool_calls)


@pytest.mark.parametrize("body, kept", [
    ("call:f{a:", "call:f{a:"),                       # unbalanced
    ("f{a:1}", "f{a:1}"),                             # missing call: prefix
    (f"call:f{{a:{Q}open}}", 'call:f{a:"open}'),      # unterminated string
    ("call:bad name{a:1}", "call:bad name{a:1}"),      # space in the name
    ("call:f{a:1} trailing", "call:f{a:1} trailing"),  # text after the arguments
    ("call:f{a:{b}}", "call:f{a:{b}}"),                # key without a value
])
def test_malformed_calls_stay_in_content(body, kept):
    r = parse(f"before <|tool_call>{body}<tool_call|> after<turn|>")
    assert r.tool_calls == [] and r.finish_reason == "stop"
    assert r.content == f"before {kept} after"


def test_unterminated_call_at_end_or_before_stop():
    # cut by the token budget: half a call is dropped, not shown as its markup
    r = parse(f"x<|tool_call>call:f{{a:{Q}v{Q}", "length")
    assert (r.content, r.tool_calls, r.finish_reason) == ("x", [], "length")
    r = parse(f"x<|tool_call>call:f{{a:{Q}v{Q}", "stop")  # the model stopped inside it: its text is kept
    assert (r.content, r.tool_calls, r.finish_reason) == ('xcall:f{a:"v"', [], "stop")
    r = parse("x<|tool_call>call:f{a:1<turn|>ignored")
    assert (r.content, r.tool_calls) == ("xcall:f{a:1", [])


def test_parse_gemma_arguments():
    assert parse_gemma_arguments(f"{{a:{Q}1{Q}, b : [ 1 , 2 ], c:True,d:None,e:word}}") == {
        "a": "1", "b": [1, 2], "c": True, "d": None, "e": "word"}
    assert parse_gemma_arguments('{"a": {"b": [true, 1.5]}}') == {"a": {"b": [True, 1.5]}}
    assert parse_gemma_arguments("{a:1,}") == {"a": 1}
    for bad in ["", "[1]", "{a}", "{a:1", "{a:1}}", f"{{a:{Q}x}}", "{:1}"]:
        with pytest.raises(ValueError):
            parse_gemma_arguments(bad)


def test_template_tool_call_round_trip():
    """A call rendered by our chat template parses back to the same arguments."""
    args = {"city": "Paris", "n": 2, "flags": [True, None], "o": {"k": "v w", "x": 1.25}}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "function": {"name": "weather", "arguments": json.dumps(args)}}]}]
    text = render_chat_template(DEFAULT_GEMMA4_TEMPLATE, msgs, add_generation_prompt=False)
    generated = text[text.index("<|tool_call>"):]
    r = parse(generated)
    assert r.tool_calls[0].name == "weather" and r.tool_calls[0].arguments == args


def test_a_call_inside_the_thought_channel_is_thought():
    r = parse(f"<|channel>thought\nmaybe <|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|> hmm<channel|>ans<turn|>")
    assert (r.reasoning, r.content, r.tool_calls, r.finish_reason) == ('maybe call:f{a:"x"} hmm', "ans", [], "stop")


def test_reasoning_then_tool_call():
    r = parse(f"<|channel>thought\nneed weather<channel|><|tool_call>call:w{{c:{Q}P{Q}}}<tool_call|><|tool_response>")
    assert (r.reasoning, r.content, r.finish_reason) == ("need weather", "", "tool_calls")
    assert r.tool_calls[0].arguments == {"c": "P"}


# ----------------------------------------------------------------------------- streaming
CORPUS = [
    "<|channel>thought\nThe sky scatters blue light.<channel|>Rayleigh scattering.<turn|>",
    f"Let me check.<|tool_call>call:get_weather{{location:{Q}Paris{Q},days:3}}<tool_call|><|tool_response>",
    f"<|channel>thought\nhmm <b> 1<2<channel|>He said {Q}hi{Q}<|tool_call>call:bad{{<tool_call|> ok<eos><pad>",
    "<bos><|turn>model\nHi<pad> there<|tool><tool|> a < b <|nope|> <|tur<turn|>x",
    "<|channel>no header<channel|><|channel>final\nfinal text<channel|>tail",
    f"<|tool_call>call:a{{x:1}}<tool_call|>mid<|tool_call>call:b{{y:[{Q}z{Q}]}}<tool_call|>",
    f"text<|tool_call>call:f{{a:{Q}v{Q}",
    "<|channel>thoughtthoughtthoughtthoughtthoughtthoughtthought\nlong header<channel|>c",
    "<|channel>thou",
    "emoji 😀 and <unk><mask> and <|image|> done",
]

SAMPLE_PIECES = list(GEMMA4_CONTROL_TOKENS) + ["<|channel>thought\n", "<|channel>final\n", "call:f{a:1}", "call:g{",
                                               f"k:{Q}v{Q}", "}", "{", "<", "|", ">", "<|", "|>", "\n", "text ", "é"]


def _random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _stream(chunks, reason="stop", **kw):
    p = StreamingParser(make_id=ids, **kw)
    reasoning, content = [], []
    for c in chunks:
        d = p.feed(c)
        reasoning.append(d.reasoning)
        content.append(d.content)
    end = p.finish(reason)
    reasoning.append(end.reasoning)
    content.append(end.content)
    return reasoning, content, end, p.result


def _check_stream_equals_batch(text, chunks, reason="stop", **kw):
    batch = parse(text, reason, **kw)
    reasoning, content, end, result = _stream(chunks, reason, **kw)
    assert "".join(reasoning) == (batch.reasoning or "")
    assert "".join(content) == batch.content
    assert end.tool_calls == batch.tool_calls == result.tool_calls
    assert end.finish_reason == batch.finish_reason == result.finish_reason
    assert result == batch
    return reasoning, content


def test_streaming_equals_batch_random_splits():
    rng = random.Random(1234)
    for text in CORPUS:
        for _ in range(60):
            _check_stream_equals_batch(text, _random_splits(text, rng))
        _check_stream_equals_batch(text, list(text))  # one character at a time


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.one_of(st.sampled_from(SAMPLE_PIECES), st.text(max_size=6)), max_size=14),
       cuts=st.lists(st.integers(0, 200), max_size=10), reason=st.sampled_from(["stop", "length"]),
       in_reasoning=st.booleans())
def test_streaming_equals_batch_hypothesis(pieces, cuts, reason, in_reasoning):
    text = "".join(pieces)
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    _check_stream_equals_batch(text, chunks, reason, starts_in_reasoning=in_reasoning)


def test_streaming_never_emits_part_of_a_control_token():
    text = ("<|channel>thought\nabc<channel|>Hello<|tool_call>call:f{a:1}<tool_call|> "
            "world<|image>!<|\"|>q<|\"|><turn|>")
    p = StreamingParser(make_id=ids)
    emitted = []
    for ch in text:  # worst case: one character per delta
        d = p.feed(ch)
        emitted += [d.reasoning, d.content]
    end = p.finish()
    emitted += [end.reasoning, end.content]
    assert "".join(emitted) == 'abcHello world!"q"'
    assert not any("<" in e or "|" in e for e in emitted)
    assert [c.name for c in end.tool_calls] == ["f"]


def test_streaming_emits_text_promptly():
    p = StreamingParser()
    assert p.feed("Hello ").content == "Hello "
    assert p.feed("wor").content == "wor"
    assert p.feed("ld <|tu").content == "ld "  # possible control-token prefix held back
    assert p.feed("rn>").content == ""          # it was <|turn>: dropped
    assert p.feed("<|tu").content == ""
    end = p.finish("length")
    assert end.content == "<|tu" and end.finish_reason == "length"  # never completed: plain text
    with pytest.raises(RuntimeError):
        p.feed("more")


def test_tool_calls_reported_only_at_finish():
    p = StreamingParser(make_id=ids)
    d = p.feed("<|tool_call>call:f{a:1}<tool_call|>")
    assert not d
    end = p.finish()
    assert end.tool_calls == [ToolCall("call_0", "f", '{"a": 1}')]
    assert end.finish_reason == "tool_calls"
