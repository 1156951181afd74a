"""The shipped chat model (blockpress/assets/assistant) and its closed world: the generated conversations are
exactly what the repository's Gemma 4 chat template renders, the tokenizer holds every Gemma 4 special token and
round-trips, the eval scores replies as documented, the held-out questions never occur in training, and the
shipped model loads by name, reproduces its published eval and comes back with a parsed tool call, and README's
Python and server examples run as written."""

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
import torch

import blockpress
from blockpress.chat import DEFAULT_GEMMA4_TEMPLATE, render_chat_template
from blockpress.loading import DEFAULT_CHAT_MODEL, SHIPPED_MODELS
from blockpress.parsing import parse_output
from blockpress.tasks import assistant
from blockpress.tasks.assistant import dialogs, evaluate, skills
from blockpress.tokenizer import GEMMA4_CONTROL_TOKENS, GEMMA4_SPECIAL_TOKENS
from blockpress.train.data import chat_example

pytestmark = pytest.mark.no_grad
ASSET = SHIPPED_MODELS["assistant"]
KINDS = list(dialogs.KINDS) + ["smalltalk"]  # small talk: asked by drill sets only


@pytest.fixture(scope="module")
def lm():
    return blockpress.load("assistant", progress=False)


@pytest.fixture(scope="module")
def tok(lm):
    return lm.tokenizer


def _render(d, messages, gen):
    return render_chat_template(DEFAULT_GEMMA4_TEMPLATE, messages, add_generation_prompt=gen,
                                enable_thinking=d.thinking, tools=d.tools)


@pytest.mark.parametrize("kind", KINDS)
def test_training_rows_are_what_the_gemma4_template_renders(tok, kind):
    """prompt = the template's generation prompt for the history; prompt minus its generation suffix, then the
    supervised turn without its thought block and stop token, then `<turn|>\\n` = the template's rendering of
    the whole conversation; and the parser reads the supervised turn back into the final message."""
    assert tok.chat_template == DEFAULT_GEMMA4_TEMPLATE
    for i in range(12):
        d = dialogs.conversation(random.Random(f"test/{kind}/{i}"), kind)
        prompt, response = chat_example(tok, d.row())
        gen = _render(d, d.messages[:-1], True)
        assert tok.decode(prompt) == gen
        text = tok.decode(response)
        final = d.messages[-1]
        thought = f"<|channel>thought\n{final['reasoning_content']}<channel|>" if "reasoning_content" in final else ""
        stop = "<|tool_response>" if final.get("tool_calls") else "<turn|>"
        assert text.startswith(thought) and text.endswith(stop)
        body = text[len(thought):-len(stop)]
        fresh = gen.endswith("<|turn>model\n") or gen.endswith("<|turn>model\n<|channel>thought\n<channel|>")
        head = gen[:gen.rindex("<|turn>model\n")] + "<|turn>model\n" if fresh else gen
        assert head + body + "<turn|>\n" == _render(d, d.messages, False)
        p = parse_output(text)
        assert p.content == final["content"] and p.reasoning == final.get("reasoning_content")
        assert [(c.name, c.arguments) for c in p.tool_calls] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in final.get("tool_calls", [])]


def test_tokenizer_holds_every_gemma4_special_token_and_round_trips(tok, lm):
    assert tok.vocab_size == lm.config.text.vocab_size <= 4096
    for t in GEMMA4_CONTROL_TOKENS:
        i = tok.token_to_id(t)
        assert i is not None and tok.is_special(i) and tok.decode([i]) == t
        if GEMMA4_SPECIAL_TOKENS.get(t, 1 << 30) < tok.vocab_size:
            assert i == GEMMA4_SPECIAL_TOKENS[t]  # the real Gemma 4 id where it fits
    for d in assistant.heldout(1):
        text = _render(d, d.messages, False)
        assert tok.decode(tok.encode(text)) == text
    assert [tok.decode([i]) for i in tok.encode("4821")] == list("4821")  # digits one per token
    assert tok.decode(tok.encode("naïve café, 18°C × 3")) == "naïve café, 18°C × 3"


def test_heldout_questions_never_occur_in_training():
    held, more = assistant.heldout(3), assistant.heldout(5)
    assert held == assistant.heldout(3) and held[:3] == more[:3]  # deterministic; each stratum's first n
    keys = assistant.heldout_keys(5)
    assert {k for d in held for k in d.keys} <= keys
    train = list(assistant.train_dialogs(300, exclude=keys))
    assert not any(k in keys for d in train for k in d.keys)
    assert {d.expect["row"] for d in train} >= {"conversion", "follow-up", "tool call", "no tool fits", "json"}
    val = assistant.heldout_keys(5, assistant.VAL_SEED)  # prepare_chat --holdout-val: the validation split too
    assert {k for d in assistant.heldout(5, assistant.VAL_SEED) for k in d.keys} == val and val - keys
    mix = list(assistant.drilled_dialogs(300, 1, 0.75, keys | val, drills="factors"))
    assert not any(k in keys | val for d in mix for k in d.keys)


@pytest.mark.parametrize("drills", sorted(assistant.DRILLS))
def test_drill_mixes_keep_out_heldout_questions_and_ask_their_rows(drills):
    keys = assistant.heldout_keys(5)
    mix = list(assistant.drilled_dialogs(300, 1, 0.75, exclude=keys, drills=drills))
    assert len(mix) == 300 and not any(k in keys for d in mix for k in d.keys)
    rows = [d.expect["row"] for d in mix]
    assert rows.count("conversion") >= 20  # every mix drills conversions (1 in 4 of its drills or more)
    if drills == "conversions":  # products by the factors that are not a shift of digits
        products = [k[2:] for d in mix for k in d.keys if k[:2] == ("arith", "mul")]
        by_factor = [p for p in products if set(p) & set(assistant.CONVERSION_FACTORS) and min(p) <= 30]
        assert len(by_factor) >= 0.6 * len(products) and len(by_factor) >= 15
    if drills == "factors":  # conversions by 7, 12, 24, 60 weighted up: most of the mix's conversions
        factors = [skills.CONVERSIONS[k[1]][4] for d in mix for k in d.keys if k[0] == "conv"]
        hard = [f for f in factors if f in assistant.CONVERSION_FACTORS]
        assert len(hard) >= 0.7 * len(factors) and len(hard) >= 60
    if drills == "wide":  # the same factors, their multipliers past the 30 a question asks; powers of ten kept
        conv = [(skills.CONVERSIONS[k[1]][4], k[3]) for d in mix for k in d.keys if k[0] == "conv"]
        multipliers = [k for f, k in conv if f in assistant.CONVERSION_FACTORS]
        assert len(multipliers) >= 0.6 * len(conv) and max(multipliers) > 60
        assert sum(k > 30 for k in multipliers) >= 0.5 * len(multipliers)
        assert any(f not in assistant.CONVERSION_FACTORS for f, _ in conv)
    if drills == "products":  # the same, denser: 6 in 10 drills; with the normal stream ~55 % of this mix (wide: ~35 %)
        hard = [k[3] for d in mix for k in d.keys if k[0] == "conv" and
                skills.CONVERSIONS[k[1]][4] in assistant.CONVERSION_FACTORS]
        assert 0.45 * len(mix) <= len(hard) <= 0.65 * len(mix) and sum(k > 30 for k in hard) >= 0.5 * len(hard)
    if drills == "tables":  # the one-digit facts, 1 in 5 drills: ~15 % of this mix, sums and products alike
        facts = [k for d in mix for k in d.keys if k in assistant.TABLES]
        assert 0.08 * len(mix) <= len(facts) <= 0.25 * len(mix) and {k[1] for k in facts} == {"add", "mul"}
    # the differences of the 2-digit subtractions asked, and the requests no declared tool fits while others are
    subs = [k[2] - k[3] for d in mix for k in d.keys if k[:2] == ("arith", "sub") and 10 <= k[3] <= k[2] <= 99]
    offered = [d for d in mix if d.expect["kind"] == "no_call" and d.tools]
    if drills == "subtraction":  # 2-digit subtraction, 35 in 100 drills, 15 of them with a one-digit difference
        assert len(subs) >= 0.25 * len(mix) and sum(s < 10 for s in subs) >= 0.3 * len(subs)
    if drills == "refusals":  # requests no declared tool fits while others are declared, 1 in 4 drills; calls too
        assert len(offered) >= 0.18 * len(mix) and rows.count("tool call") >= 0.18 * len(mix)
    if drills == "smalltalk":  # greetings, thanks, ... 8 in 100 drills (~6 % of the mix), every kind of them
        talk = [d for d in mix if d.expect["row"] == "small talk"]
        assert 0.03 * len(mix) <= len(talk) <= 0.1 * len(mix)
        assert {d.expect["answer"] for d in talk} == {reply for _, reply, _ in dialogs.TALK.values()}
    if drills == "sub-refusals":  # both: 2-digit subtraction 2 in 10 drills (half with a one-digit difference),
        assert len(subs) >= 0.12 * len(mix) and sum(s < 10 for s in subs) >= 0.3 * len(subs)
        assert len(offered) >= 0.12 * len(mix) and rows.count("tool call") >= 0.1 * len(mix)  # refusals 2 in 10


def test_teach_tables_leaves_in_only_the_one_digit_facts():
    """prepare_chat.py --teach-tables: the held-out one-digit sums and products may be asked, nothing else held out."""
    keys = assistant.heldout_keys()
    assert assistant.mix_exclude() == keys
    assert assistant.mix_exclude(val=True) == keys | assistant.heldout_keys(seed=assistant.VAL_SEED)
    one_digit = {k for d in assistant.heldout(200) if d.expect["row"] in ("add 1-digit", "mul 1x1-digit")
                 for k in d.keys if k[0] == "arith" and max(k[2:]) < 10}  # (earlier turns ask other things)
    assert len(one_digit) > 150 and one_digit <= assistant.TABLES and len(assistant.TABLES) == 200
    taught = assistant.mix_exclude(tables=True)
    assert taught == keys - assistant.TABLES
    mix = list(assistant.drilled_dialogs(200, 3, 0.75, taught, drills="tables"))
    asked = {k for d in mix for k in d.keys}
    assert asked & one_digit and not asked & taught


def _earlier_exchanges(d) -> int:
    """The exchanges before a conversation's last question (its final user turn and what follows it left out)."""
    last = max(i for i, m in enumerate(d.messages) if m["role"] == "user")
    return sum(m["role"] == "user" for m in d.messages[:last])


def test_history_opens_conversations_with_several_earlier_exchanges_and_leaves_the_default_stream():
    """prepare_chat.py --history K (dialogs.HISTORY): 1 to K earlier exchanges in about two thirds of the
    conversations, about half of them small talk, so that a chat of several turns is what the model saw (stage 29);
    the default, 1, keeps every stage's stream: the same conversations, draw for draw."""
    talk = {reply for _, reply, _ in dialogs.TALK.values()}
    plain = list(assistant.drilled_dialogs(400, 29, 0.75, drills="smalltalk-more"))
    token = dialogs.HISTORY.set(4)
    try:
        long = list(assistant.drilled_dialogs(400, 29, 0.75, drills="smalltalk-more"))
    finally:
        dialogs.HISTORY.reset(token)
    again = list(assistant.drilled_dialogs(400, 29, 0.75, drills="smalltalk-more"))
    assert [d.messages for d in again] == [d.messages for d in plain]  # the setting does not leak
    skills_only = [d for d in plain if d.expect["kind"] == "answer" and d.expect["row"] != "follow-up"]
    assert max(_earlier_exchanges(d) for d in skills_only) == 1
    opened = [d for d in long if d.expect["kind"] == "answer" and d.expect["row"] != "follow-up"]
    counts = [_earlier_exchanges(d) for d in opened]
    assert max(counts) == 4 and 0.55 <= sum(c > 0 for c in counts) / len(counts) <= 0.8
    earlier = [m["content"] for d in opened for m in d.messages[:-2] if m["role"] == "assistant"]
    assert 0.35 <= sum(c in talk for c in earlier) / len(earlier) <= 0.65
    keys = assistant.heldout_keys()  # (the held-out set is the default stream's, even where a mix asks for more)
    assert not any(k in keys for d in long for k in d.keys)  # the earlier questions are kept out too
    token = dialogs.HISTORY.set(4)
    try:
        assert assistant.heldout_keys() == keys
    finally:
        dialogs.HISTORY.reset(token)


def test_working_matches_the_answer():
    rng = random.Random(0)
    for _ in range(300):
        it = skills.arithmetic(rng)
        assert it.working.endswith(it.answer)
    assert skills.add_working(47, 38) == "7 + 8 = 15, carry 1. 4 + 3 + 1 = 8. So 47 + 38 = 85."
    assert skills.sub_working(47, 38) == "17 - 8 = 9, borrow 1. 4 - 1 - 3 = 0. So 47 - 38 = 9."
    assert skills.mul_working(47, 38) == "47 × 30 = 1410. 47 × 8 = 376. 1410 + 376 = 1786. So 47 × 38 = 1786."


def test_sub_working_zeros_names_the_columns_the_difference_lacks():
    """--sub-working zeros: each top column whose 0 the difference does not write says so; nothing else changes."""
    token = skills.SUB_WORKING.set("zeros")
    try:
        assert skills.sub_working(47, 38) == "17 - 8 = 9, borrow 1. 4 - 1 - 3 = 0, no tens left. So 47 - 38 = 9."
        assert skills.sub_working(305, 299) == ("15 - 9 = 6, borrow 1. 10 - 1 - 9 = 0, borrow 1, no tens left. "
                                                "3 - 1 - 2 = 0, no hundreds left. So 305 - 299 = 6.")
        rng = random.Random(1)
        for _ in range(300):
            a, b = sorted(rng.sample(range(1000), 2), reverse=True)
            zeros = skills.sub_working(a, b)
            skills.SUB_WORKING.set("columns")
            columns = skills.sub_working(a, b)
            skills.SUB_WORKING.set("zeros")
            named = [f"no {p} left" for p in skills.PLACES[len(str(a - b)):len(str(a))]]
            assert [ln for ln in named if ln in zeros] == named and zeros.endswith(f"So {a} - {b} = {a - b}.")
            assert re.sub(r", no [a-z ]+ left", "", zeros) == columns
    finally:
        skills.SUB_WORKING.reset(token)


@pytest.mark.parametrize("style", skills.CONVERSION_WORKINGS)
def test_conversion_workings_are_right_and_the_default_is_the_shipped_models(style):
    """Every sum a "steps" working writes holds and its last number is the answer's; "product" (the default, what
    the shipped model was trained on) writes the product in one line; "digits" answers with the working, every
    step of it right, for products (quotients stay plain), and its plain form stays an accepted answer; the
    style changes neither the question nor the key, nor the answer but in "digits", and it is reset after the
    stretch that set it."""
    cases = [(i, i % len(skills.CONVERSIONS), None if i % 3 else 50 + i % 70) for i in range(600)]  # k past 30 too
    token = skills.CONVERSION_WORKING.set(style)
    try:
        items = [skills.conversion(random.Random(i), index, k) for i, index, k in cases]
    finally:
        skills.CONVERSION_WORKING.reset(token)
    for (i, index, k), it in zip(cases, items):
        plain = skills.conversion(random.Random(i), index, k)
        assert dataclasses.replace(plain, working=it.working, answer=it.answer) == it
        index, reverse, k = it.key[1:]
        f = skills.CONVERSIONS[index][4]
        n = it.extra["value"]
        hard = f in skills.CONVERSION_FACTORS
        assert ("answers" in it.extra) == (hard and k <= 99 and not reverse)
        if "answers" in it.extra:
            assert it.extra["answers"][0] == plain.answer
            assert it.answer == it.extra["answers"][style == "digits"]
            _check_digits_answer(it.extra["answers"][1], plain.answer, k, f)
        else:
            assert it.answer == plain.answer
        if style == "product" or not hard:
            sign = "÷" if reverse else "×"
            assert f"= {k * f if reverse else k} {sign} {f} = {n} " in it.working
        elif reverse:
            assert it.working.endswith(f"so divide {k * f} by {f}.")
        elif style in ("method", "digits"):
            assert it.working.endswith(f"so multiply {k} by {f}.")
        else:
            sums = re.findall(r"(\d+) ([+×]) (\d+) = (\d+)\.", it.working.split(". ", 1)[1])
            assert len(sums) >= 2 and sums[0][:3] == (str(k), "+", str(k))
            for a, op, b, c in sums:
                assert (int(a) + int(b) if op == "+" else int(a) * int(b)) == int(c)
            assert int(sums[-1][3]) == n == k * f
    assert skills.CONVERSION_WORKING.get() == "product"


def _check_digits_answer(worked: str, plain: str, k: int, f: int):
    """A "digits" answer: the plain answer's two sides around a working whose every number is right."""
    src, dst = plain.rstrip(".").split(" = ")
    assert worked.startswith(src + " = ") and worked.endswith(" " + dst + ".")
    if k < 10:
        assert worked == f"{src} = {k} × {f} = {dst}."
    else:
        t, f1, u, f2, tf, uf, n = map(int, re.fullmatch(
            rf"{k} × {f} = (\d+)0 × (\d+) \+ (\d+) × (\d+) = (\d+)0 \+ (\d+) = (\d+) .*", worked[len(src) + 3:]
        ).groups())
        assert t * 10 + u == k and f1 == f2 == f and (tf, uf) == (t * f, u * f) and n == tf * 10 + uf == k * f


def test_score_reads_replies_as_the_server_does():
    rng = random.Random(1)
    ans = dialogs.conversation(rng, "skill", skills.arithmetic_item("add", 47, 38, rng))
    r = evaluate.score(ans, "47 + 38 = 85.<turn|>")
    assert r["exact"] and r["no call when no tool fits"] and r["thinking off: well-formed"] != ans.thinking
    assert not evaluate.score(ans, "47 + 38 = 86.<turn|>")["exact"]
    conv = dialogs.conversation(rng, "skill", skills.conversion(rng, 7, 16, False))  # 16 days, × 24
    for reply, right in [("16 days = 384 hours.", True), ("16 days = 16 × 24 = 10 × 24 + 6 × 24 = 240 + 144 = 384 "
                          "hours.", True), ("16 days = 374 hours.", False), ("16 days = 16 × 24 = 10 × 24 + 6 × 24 "
                          "= 240 + 144 = 374 hours.", False)]:
        assert evaluate.score(conv, reply + "<turn|>")["exact"] == right
    call = next(d for i in range(50) if (d := dialogs.conversation(random.Random(i), "call")).expect["calls"][0][0]
                == "set_timer" and not d.thinking and len(d.expect["calls"]) == 1)
    m = call.expect["calls"][0][1]["minutes"]
    ok = evaluate.score(call, f"<|tool_call>call:set_timer{{minutes:{m}}}<tool_call|><|tool_response>")
    assert ok["tool call, valid args"] and ok["tool call, right args"] and ok["thinking off: well-formed"]
    bad = evaluate.score(call, "<|tool_call>call:set_timer{minutes:<|\"|>five<|\"|>}<tool_call|><|tool_response>")
    assert not bad["tool call, valid args"] and not bad["tool call, right args"]
    assert "no call, request no tool fits" not in r | ok  # only the "no tool fits" row has it
    refuse = dialogs.conversation(random.Random(4), "no_call")
    r = evaluate.score(refuse, refuse.expect["answer"] + "<turn|>")
    assert r["exact"] and r["no call, request no tool fits"] and r["no call when no tool fits"]
    r = evaluate.score(refuse, "<|tool_call>call:get_weather{city:<|\"|>Lima<|\"|>}<tool_call|><|tool_response>")
    assert not r["exact"] and not r["no call, request no tool fits"] and not r["no call when no tool fits"]
    think = dialogs.conversation(random.Random(3), "skill", skills.arithmetic_item("add", 2, 3, rng))
    think.expect["thought"] = True
    assert evaluate.score(think, "<|channel>thought\n2 + 3 = 5.<channel|>2 + 3 = 5.<turn|>")["thinking on: well-formed"]
    assert not evaluate.score(think, "<|channel>thought\n2 + 3 = 5.<turn|>")["thinking on: well-formed"]


def test_asset_files_size_and_default_for_chat_commands(lm):
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "README.md"):
        assert (ASSET / f).is_file(), f"missing {f} in {ASSET}"
    assert sum(p.stat().st_size for p in ASSET.rglob("*") if p.is_file()) <= 20 * 2**20
    assert DEFAULT_CHAT_MODEL == "assistant" and lm.tokenizer.is_chat
    stops = lm.generation_config().eos_token_id
    assert {lm.tokenizer.token_to_id(t) for t in evaluate.STOP_TOKENS} <= set(stops)


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_serve_and_chat_without_a_model_load_the_chat_model(command, monkeypatch):
    import importlib

    from blockpress.cli import main as cli_main
    from blockpress.errors import InputError

    mod = importlib.import_module(f"blockpress.cli.{command}")
    seen = []

    def fake_load(args):
        seen.append(args.model)
        raise InputError("stop here")
    monkeypatch.setattr(mod, "load_model", fake_load)
    assert cli_main([command] + (["--port", "0"] if command == "serve" else [])) == 2
    assert seen == ["assistant"]


PUBLISHED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "assistant-eval.json"


@pytest.fixture(scope="module")
def eval_n1(tmp_path_factory):
    """`blockpress eval chat --n 1 --steps 4 --json F` (each stratum's first held-out conversation): (stdout, F)."""
    import contextlib
    import io

    from blockpress.cli import main as cli_main

    out, buf = tmp_path_factory.mktemp("eval") / "chat.json", io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["eval", "chat", "--n", "1", "--steps", "4", "--threads", "1", "--json", str(out)]) == 0
    return buf.getvalue(), json.loads(out.read_text())


def test_eval_cli_reproduces_the_published_replies(eval_n1):
    """The eval of each stratum's first conversation writes exactly the replies of the published eval (40 per
    stratum) and scores them the same: each conversation samples from a generator seeded by its prompt, so the
    shipped model, the engine and the eval still give what the model card reports."""
    mine = eval_n1[1]["diffusion, default sampler"]["cases"]
    theirs = json.loads(PUBLISHED.read_text())["diffusion, default sampler"]["cases"]
    theirs = theirs[::len(theirs) // len(assistant.strata())]  # each stratum's first (the strata in order)
    assert len(mine) == len(theirs) == len(assistant.strata())
    assert [c["text"] for c in mine] == [c["text"] for c in theirs]
    assert mine == theirs


def test_eval_cli_sampler_flags_reach_every_diffusion_column(tmp_path, lm):
    """`eval chat --entropy-bound/--t-max` replace the model's own settings: the CLI's replies are the library's
    with those settings, and not the default sampler's."""
    import contextlib
    import io

    from blockpress.cli import main as cli_main

    out = tmp_path / "chat.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["eval", "chat", "--n", "1", "--threads", "1", "--entropy-bound", "2", "--t-max", "1.5",
                         "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert list(saved) == ["diffusion, entropy bound 2.0, t max 1.5"]  # the column says which sampler ran
    mine = [c["text"] for c in saved["diffusion, entropy bound 2.0, t max 1.5"]["cases"]]
    direct = evaluate.evaluate(lm, assistant.heldout(1), entropy_bound=2.0, t_max=1.5)
    assert mine == [c["text"] for c in direct["cases"]]
    theirs = json.loads(PUBLISHED.read_text())["diffusion, default sampler"]["cases"]
    assert mine != [c["text"] for c in theirs[::len(theirs) // len(assistant.strata())]]


def test_tool_call_comes_back_parsed(lm):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    tools = [dialogs.TOOLS["get_weather"], dialogs.TOOLS["get_time"]]
    ids = lm.encode_chat(msgs, tools=tools)
    res = lm.generate([ids], generator=torch.Generator().manual_seed(0))
    p = parse_output(lm.decode_new(res, skip_special_tokens=False))
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert p.finish_reason == "tool_calls"


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_strict_tools_keep_the_chat_model_from_calling_undeclared_ones(lm):
    """Requests no declared tool fits (the validation split's): free, the shipped model calls a tool nobody
    declared in some (so the test can fail); with the tools `strict`, `model.chat` calls only declared tools, with
    valid arguments (engine/constraint.py reply_grammar)."""
    pytest.importorskip("llguidance")
    asked = [d for d in assistant.heldout(160, assistant.VAL_SEED) if d.expect["kind"] == "no_call" and d.tools]
    undeclared = {"free": 0, "strict": 0}
    for d in asked:
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in d.tools}
        strict = [{**t, "function": {**t["function"], "strict": True}} for t in d.tools]
        for mode, tools in (("free", d.tools), ("strict", strict)):
            seed = evaluate.case_seed(0, evaluate.prompt_ids(lm.tokenizer, d))  # the eval's seeds
            reply = lm.chat(d.messages[:-1], enable_thinking=d.thinking, tools=tools, seed=seed, max_new_tokens=96)
            for call in reply.tool_calls:
                if call.name not in declared:
                    undeclared[mode] += 1
                elif mode == "strict":
                    assert evaluate.schema_valid(call.arguments, declared[call.name]), call
    assert undeclared["free"] > 0 and undeclared["strict"] == 0, undeclared


def readme_example(start: str) -> str:
    """The README's python block that starts with `start`, as a user would paste it."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if b.startswith(start)]
    assert len(found) == 1, f"README.md should hold one python block starting {start!r}"
    return found[0]


def test_readme_python_example_runs_as_written(tmp_path, monkeypatch):
    """README's Python API example, as written: the shipped chat model answers (thinking off and on), generates
    and streams at token level, the shipped text model infills, and the saved checkpoint loads again."""
    import contextlib
    import io

    monkeypatch.chdir(tmp_path)
    code = readme_example("import blockpress, torch\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[0].strip() and "<" not in lines[0], lines[:2]  # an answer, no special-token text
    thought, _, answer = lines[1].partition(" -> ")  # chat(): the thought channel apart from the answer
    assert thought.strip() and thought != "None" and answer.strip() and "<" not in lines[1], lines[1]
    assert len(lines) > 3  # the drafts of the stream
    saved = blockpress.load(tmp_path / "my-checkpoint", progress=False)
    assert saved.tokenizer.is_chat


def test_readme_server_example_runs_against_blockpress_serve_without_a_model(tmp_path):
    """README's server example, run as written (only the port differs) against `blockpress serve` with no model:
    the shipped chat model answers, streams the same text, thinks into reasoning_content, calls the tool it is
    told to with valid arguments and answers from the tool's response."""
    import contextlib
    import io
    import os
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("openai")
    from test_server import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "blockpress", "serve", "--port", str(port), "--threads", "1",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        code = readme_example("# blockpress serve ")
        assert "127.0.0.1:8000" in code
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), "README.md", "exec"), {})
        lines = out.getvalue().splitlines()
        assert len(lines) == 5, lines
        answer, streamed, thought, call, final = lines
        assert answer.startswith(streamed + " CompletionUsage(") and streamed, (answer, streamed)
        assert thought.strip() and thought != "None"
        same = blockpress.load("assistant", progress=False).chat(  # the Python API, same seed: the same reply
            [{"role": "user", "content": "Convert 3 km to m."}], enable_thinking=True, seed=0)
        assert same.reasoning == thought, (same, thought)
        name, args = call.split(" ", 1)
        assert name == "get_weather" and json.loads(args) == {"city": "Paris"}
        assert "21" in final, final
        # a request that offers no tool gets no tool call, where the model unbanned writes one (test_token_ban)
        from test_token_ban import assistant_calling_unoffered

        chat_lm, _, (messages, thinking, seed) = assistant_calling_unoffered()
        for choice in ({}, {"tools": list(dialogs.TOOLS.values()), "tool_choice": "none"}):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
                "messages": messages, "seed": seed, "max_tokens": 96, **choice,
                "chat_template_kwargs": {"enable_thinking": thinking}}).json()["choices"][0]
            assert r["finish_reason"] != "tool_calls" and not r["message"].get("tool_calls"), r
            same = chat_lm.chat(messages, enable_thinking=thinking, seed=seed, max_new_tokens=96)
            assert r["message"]["content"] == same.content, (r, same)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_eval_scores_the_supervised_turns_full_marks():
    """The eval against its own labels: every held-out conversation's supervised turn, as the model would write
    it (thought channel, content or calls, stop token), scores 100 % on every row; and the arithmetic rows hold
    the operand sizes they are named for, with the right result. (Without a model: a 0 % row is the model's.)"""
    import re

    from blockpress.train.data import assistant_turn_text

    held = assistant.heldout(6)
    texts = [assistant_turn_text(DEFAULT_GEMMA4_TEMPLATE, d.messages[-1], d.thinking) for d in held]
    rows = evaluate.summarize(held, texts)["rows"]
    assert set(evaluate.SKILL_ROWS) <= set(rows) and set(evaluate.TOOL_ROWS) <= set(rows)
    assert {r: h for r, h in rows.items() if h[0] != h[1]} == {}
    sizes = {"1-digit": [1, 1], "2-digit": [2, 2], "3-digit": [3, 3], "1x1-digit": [1, 1], "2x1-digit": [2, 1],
             "2x2-digit": [2, 2]}
    for d in held:
        op, _, size = d.expect["row"].partition(" ")
        if op in ("add", "sub", "mul"):
            a, b = map(int, re.findall(r"\d+", d.messages[-1]["content"])[:2])
            assert sorted([len(str(a)), len(str(b))], reverse=True) == sizes[size], d.messages[-2]
            c = {"add": a + b, "sub": a - b, "mul": a * b}[op]
            assert d.expect["answer"] == f"{a} {skills.SYMBOL[op]} {b} = {c}."


def test_eval_chat_command_prints_one_table_for_every_column(eval_n1):
    """`blockpress eval chat`: the shipped model by default, a column for its own sampler and one per --steps,
    every stratum a row, the same percentages in the table, the final JSON line and the --json file."""
    text, saved = eval_n1
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == "| | n | diffusion, default sampler | diffusion, 4 steps |"
    summary = json.loads(text.strip().splitlines()[-1])
    assert list(summary) == list(saved) == ["diffusion, default sampler", "diffusion, 4 steps"]
    assert summary == {name: r["summary"] for name, r in saved.items()}
    rows = {}
    for line in table[1:-1]:  # header ... seconds (the separator starts "|-")
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[2:]
    strata = {d.expect["row"] for d in assistant.heldout(1)} - {"tool call"}  # (its metrics are rows of their own)
    assert strata <= set(rows) and "tool call, valid args" in rows
    for row, cells in rows.items():
        assert cells == [f"{summary[c][row]:.1f} %" if row in summary[c] else "-" for c in summary], (row, cells)


def test_text_replies_end_at_the_calls_token_limit_and_stop_ids(lm):
    """A generation runs whole canvases; `chat`, `generate_text` and `decode_new` return the reply the call asked
    for: at most its max_new_tokens (finish "length") and up to its own eos_token_id (finish "stop"), not the
    checkpoint's limit and stop ids. Before, a 3-token limit gave a whole reply and a caller's stop id came back
    as text with finish "length"."""
    from blockpress.engine.generate import seeded

    ids = lm.encode_chat("Convert 3 km to m.")
    free = lm.generate([ids], generator=seeded(0, lm.device), suppress_tokens=None)
    new = free.new_tokens[0].tolist()
    reply, reason = free.config.reply(new)
    assert reason == "stop" and len(reply) > 4  # the model's own answer, several tokens

    short = lm.chat("Convert 3 km to m.", seed=0, suppress_tokens=None, max_new_tokens=3)
    assert short.finish_reason == "length" and short.content == lm.tokenizer.decode(new[:3])
    assert lm.generate_text("Convert 3 km to m.", seed=0, suppress_tokens=None, max_new_tokens=3) == short.content
    stop = new[2]  # the caller's stop id: the reply ends before it
    cut = lm.chat("Convert 3 km to m.", seed=0, suppress_tokens=None, eos_token_id=[stop])
    assert cut.finish_reason == "stop" and cut.content == lm.tokenizer.decode(new[:new.index(stop)])
    with pytest.raises(blockpress.errors.SamplingError, match="seed must be a whole number"):
        lm.chat("hi", seed=2 ** 64)
