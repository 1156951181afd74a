"""Infilling / editing in place: fixed canvas tokens (engine), the `[MASK:n]` template API and CLI."""

import json
import re

import numpy as np
import pytest
import torch

import blockpress
from blockpress.cli import main as cli_main
from blockpress.errors import InputError
from blockpress.infill import parse_template
from blockpress.kernels import use

pytestmark = pytest.mark.no_grad  # inference: conftest runs each test without autograd
KW = dict(max_new_tokens=32, max_denoising_steps=6, eos_token_id=[1], pad_token_id=0)  # 2 canvases of 16


@pytest.fixture(scope="module")
def bp(hf_tiny_dir, tmp_path_factory):
    from blockpress.testing import build_tiny_gemma_tokenizer

    path, _ = hf_tiny_dir
    m = blockpress.load(path, dtype="float32", progress=False)
    use(m.module, attention="eager")
    m.tokenizer = build_tiny_gemma_tokenizer(tmp_path_factory.mktemp("tok"))
    return m


def prompt(seed=0, T=12):
    return torch.randint(5, 512, (1, T), generator=torch.Generator().manual_seed(seed))


def test_tokens_per_forward_counts_the_tokens_the_model_chose(bp):
    """Held and discarded positions of `fixed_tokens` are not the model's tokens: a canvas of 16 with 2 free
    positions wrote 2 tokens, whatever it held (it counted 16: an all-fixed canvas reported 16 tokens a pass)."""
    kw = dict(KW, max_new_tokens=16, eos_token_id=None)
    free = bp.generate(prompt(), generator=torch.Generator().manual_seed(1), **kw)
    held = torch.tensor([[7] * 5 + [-1, -1] + [-2] * 9])
    out = bp.generate(prompt(), generator=torch.Generator().manual_seed(1), fixed_tokens=held, **kw)
    assert float(out.tokens_per_forward[0] * out.forward_passes[0]) == 2.0
    assert float(free.tokens_per_forward[0] * free.forward_passes[0]) == 16.0  # nothing held: every token


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_fixing_nothing_changes_nothing(bp, sampler):
    a = bp.generate(prompt(), generator=torch.Generator().manual_seed(1), sampler=sampler, **KW)
    free = torch.full((1, 20), -1)
    b = bp.generate(prompt(), generator=torch.Generator().manual_seed(1), sampler=sampler, fixed_tokens=free, **KW)
    assert torch.equal(a.sequences, b.sequences)


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_fixed_tokens_hold_on_every_draft_and_change_the_free_ones(bp, sampler):
    C = bp.canvas_length
    fixed = torch.full((1, 2 * C), -1)
    pos = torch.tensor([0, 3, 4, 9, C - 1, C + 2, 2 * C - 1])  # both canvases, edges included
    fixed[0, pos] = torch.randint(5, 512, (len(pos),), generator=torch.Generator().manual_seed(7))
    events = list(bp.stream(prompt(), generator=torch.Generator().manual_seed(1), sampler=sampler,
                            fixed_tokens=fixed, **{**KW, "eos_token_id": None}))
    mask = fixed[0] >= 0
    for ev in events:
        if isinstance(ev, blockpress.Draft):
            cols = fixed[0, ev.canvas_index * C:(ev.canvas_index + 1) * C]
            assert torch.equal(ev.tokens[0][cols >= 0], cols[cols >= 0])
    out = events[-1].result.new_tokens[0]
    assert torch.equal(out[mask], fixed[0, mask])
    plain = bp.generate(prompt(), generator=torch.Generator().manual_seed(1), sampler=sampler,
                        **{**KW, "eos_token_id": None}).new_tokens[0]
    assert not torch.equal(out[~mask], plain[~mask])  # the model saw the fixed tokens


def test_fixed_positions_do_not_spend_the_entropy_budget(bp):
    """All but one position fixed: the free one is accepted on every step. Were the fixed positions' entropies
    (random weights: about log V each) counted, the bound would admit only the single lowest-entropy position."""
    C = bp.canvas_length
    fixed = torch.randint(5, 512, (1, C), generator=torch.Generator().manual_seed(3))
    free = 5
    fixed[0, free] = -1
    kw = {**KW, "max_new_tokens": C, "eos_token_id": None, "stability_threshold": None,
          "confidence_threshold": None}
    drafts = [e for e in bp.stream(prompt(), generator=torch.Generator().manual_seed(0), fixed_tokens=fixed, **kw)
              if isinstance(e, blockpress.Draft)]
    assert len(drafts) == KW["max_denoising_steps"]
    assert all(bool(d.accepted[0, free]) for d in drafts)


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_discarded_positions_do_not_hold_up_adaptive_stopping(bp, sampler):
    """Adaptive stopping looks only at the free positions whose tokens are kept (-1), not at fixed ones or
    discarded ones (-2). All positions fixed but three: marked -2 nothing is left to wait for and the canvas
    stops after its first step; marked -1 the three noisy free positions keep it going."""
    C = bp.canvas_length
    base = torch.randint(5, 512, (1, C), generator=torch.Generator().manual_seed(4))
    kw = {**KW, "max_new_tokens": C, "eos_token_id": None, "max_denoising_steps": 12, "stability_threshold": 1,
          "confidence_threshold": 1e9}
    steps = {}
    for mark in (-1, -2):
        fixed = base.clone()
        fixed[0, -3:] = mark
        r = bp.generate(prompt(), generator=torch.Generator().manual_seed(0), sampler=sampler, fixed_tokens=fixed, **kw)
        steps[mark] = r.steps_per_canvas[0]
    assert steps[-2] == 1 and steps[-1] > 2


def test_fixed_tokens_errors(bp):
    C = bp.canvas_length
    with pytest.raises(InputError, match="spans"):
        bp.generate(prompt(), fixed_tokens=torch.full((1, 2 * C + 1), -1), **KW)
    with pytest.raises(InputError, match=r"\[batch=1"):
        bp.generate(prompt(), fixed_tokens=torch.full((2, 4), -1), **KW)
    with pytest.raises(InputError, match="ids in"):
        bp.generate(prompt(), fixed_tokens=torch.tensor([[10**6]]), **KW)


@pytest.mark.parametrize("fixed, words", [
    (torch.tensor([[5.7, -1.0]]), "integer token ids .* got dtype float32"),  # was truncated to id 5
    ([[7.0, -1]], "got dtype float32"),
    (torch.tensor([[True, False]]), "got dtype bool"),  # a mask was read as ids 1 and 0
    ([[1, 2], [3]], "lists of equal length"),  # ragged: torch's ValueError
    ("abc", "got a str that is not"),  # torch's TypeError
    ([["a", "b"]], "got a list that is not"),
])
def test_fixed_tokens_must_be_integer_ids(bp, fixed, words):
    B = 2 if isinstance(fixed, list) and len(fixed) == 2 else 1
    with pytest.raises(InputError, match=words) as e:
        bp.generate(prompt().repeat(B, 1), fixed_tokens=fixed, **KW)
    assert "\n" not in str(e.value)
    for ok in (torch.tensor([[7, -1]], dtype=torch.int32), [[7, -1]], np.array([[7, -1]], dtype=np.int16)):
        assert int(bp.generate(prompt(), fixed_tokens=ok, **KW).new_tokens[0, 0]) == 7
    for nothing in (torch.empty(1, 0, dtype=torch.long), [[]]):  # no ids: nothing held, whatever the dtype
        bp.generate(prompt(), fixed_tokens=nothing, **KW)


def test_parse_template():
    t = parse_template("a [MASK] b[MASK:3][MASK:2] c")
    assert t.prefix == "a" and t.pieces == [1, " b", 3, 2, " c"] and t.holes == [1, 3, 2]
    assert t.outside == ["a ", " b", "", " c"] and t.spaced == [True, False, False]  # the template's own text
    assert t.text(["X", "Y", "Z"]) == "a X bYZ c"
    assert parse_template("x  [MASK] y [MASK]").pieces == [1, " y", 1]  # one space moves into the hole, not two
    assert parse_template("[MASK:4]").prefix == ""
    assert parse_template("x [MASK:02]").holes == [2]
    for bad, msg in [("no holes here", "no hole"), ("x [MASK:0]", "1.."), ("x [MASK:99999]", "1.."),
                     ("x [MASK:" + "9" * 5000 + "]", r"hole \[MASK:999999\.\.\.\] must hold 1\.\.4096")]:
        with pytest.raises(InputError, match=msg):  # 5000 digits: int() refused them with a ValueError traceback
            parse_template(bad)
    # only ASCII digits count, and only the ASCII letters of "mask" start a marker ("\u017f" is read as "s" by an
    # IGNORECASE pattern: the text was refused as a malformed "[MASK]"); Arabic-Indic 3 was a hole of 3
    assert parse_template("x [MA\u017fK] [MASK]").outside == ["x [MA\u017fK] ", ""]
    with pytest.raises(InputError, match="malformed hole marker"):
        parse_template("x [MASK:\u0663]")


@pytest.mark.parametrize("bad", ["[MASK:-1]", "[MASK: 2]", "[mask]", "[MASK:3", "[Mask:2]", "[MASKED]", "[MASK:1.5]"])
def test_malformed_hole_markers_are_named_not_kept_as_text(bad):
    """A marker that is not [MASK] / [MASK:n] was kept as literal text when another hole made the template valid."""
    for tpl in (f"A {bad} B [MASK] C", f"A [MASK] B {bad}"):
        with pytest.raises(InputError, match=f"malformed hole marker '{re.escape(bad)}'") as e:
            parse_template(tpl)
        assert "\\[MASK" in str(e.value) and "\n" not in str(e.value)


def test_an_escaped_marker_is_text():
    t = parse_template(r"say \[MASK] and \[MASK:2] then [MASK:2] end")
    assert t.holes == [2] and t.outside == ["say [MASK] and [MASK:2] then ", " end"]
    assert t.prefix == "say [MASK] and [MASK:2] then"
    with pytest.raises(InputError, match="no hole"):
        parse_template(r"only \[MASK] here")


def test_infill_keeps_the_text_and_fills_every_hole(bp):
    tpl = "The cat [MASK:3] on the [MASK] mat, and then[MASK:2][MASK:4] slept."
    r = bp.infill(tpl, seed=0, max_denoising_steps=4)
    tok = bp.tokenizer
    assert len(r.fills) == 4 and len(r.region_ids) == len(r.hole_mask)
    assert sum(r.hole_mask) == 3 + 1 + 2 + 4
    # every given token is where the template put it, every fill is what the model chose there
    expected = []
    for piece in [3, " on the", 1, " mat, and then", 2, 4, " slept."]:
        expected += [None] * piece if isinstance(piece, int) else tok.encode(piece)
    assert [t if e is None else e for t, e in zip(r.region_ids, expected)] == r.region_ids
    assert r.prompt_ids == [tok.bos_token_id] + tok.encode("The cat")
    f = r.fills
    assert r.text == f"The cat {f[0]} on the {f[1]} mat, and then{f[2]}{f[3]} slept."  # the template's bytes kept
    stops = {tok.eos_token_id}
    at = 0
    for n, fill, spaced in zip([3, 1, 2, 4], f, [True, True, False, False]):  # its hole's tokens up to end-of-text
        at = r.hole_mask.index(True, at)
        ids = r.region_ids[at:at + n]
        cut = next((j for j, t in enumerate(ids) if t in stops), n)
        text = tok.decode(ids[:cut], skip_special_tokens=True)
        assert fill == (text[1:] if spaced and text.startswith(" ") else text)  # the template's space, not twice
        at += n
    again = bp.infill(tpl, seed=0, max_denoising_steps=4)
    assert again.region_ids == r.region_ids  # seeded
    with pytest.raises(InputError, match="max_new_tokens"):
        bp.infill(tpl, max_new_tokens=8)


def test_infill_cli_json(bp, tmp_path, capsys):
    from blockpress.testing import build_tiny_gemma_tokenizer

    bp.save(tmp_path / "m")
    build_tiny_gemma_tokenizer(tmp_path / "m")
    assert cli_main(["infill", str(tmp_path / "m"), "Once [MASK:2] a time", "--seed", "1", "--json",
                     "--steps", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith("Once") and out["text"].endswith(" a time") and len(out["fills"]) == 1
    assert cli_main(["infill", str(tmp_path / "m"), "no hole"]) == 2
    assert "no hole" in capsys.readouterr().err
    # one argument of words and no hole is a template (it was read as MODEL: "no TEMPLATE given")
    assert cli_main(["infill", "no hole here"]) == 2
    assert "the template has no hole" in capsys.readouterr().err
    # holes past the model's positions name the holes (it said "lower max_new_tokens", which infill refuses)
    assert cli_main(["infill", str(tmp_path / "m"), "Once [MASK:4096]"]) == 2
    assert "shorten the holes or the text" in capsys.readouterr().err


def test_infill_help_does_not_offer_max_new_tokens(capsys):
    """`blockpress infill --help` listed --max-new-tokens, which infill always refuses (the holes set it); it is
    hidden, and given anyway it is still refused with the reason."""
    with pytest.raises(SystemExit):
        cli_main(["infill", "--help"])
    out = capsys.readouterr().out
    assert "--max-new-tokens" not in out and "--steps" in out
    assert cli_main(["infill", "A [MASK] B", "--max-new-tokens", "5", "--threads", "1"]) == 2
    assert "infill sets max_new_tokens from the template" in capsys.readouterr().err


def test_word_infill_eval_examples_and_cli(bp, tmp_path, capsys):
    from blockpress.tasks import text_infill as ti
    from blockpress.testing import build_tiny_gemma_tokenizer

    passages = [f"Passage {i} says that the quick brown fox jumps over the lazy dog {i} times today." for i in range(6)]
    exs = ti.make_examples(passages, 4, seed=1)
    assert len(exs) == 4 and exs == ti.make_examples(passages, 4, seed=1)
    for ex, p in zip(exs, passages):
        assert ex.prefix + ex.word + ex.suffix == p and ex.word.startswith(" ") and ex.word[1:].isalpha()
    assert len({ex.word for ex in ti.make_examples(passages * 5, 30, seed=2)}) > 3  # the hidden word varies
    (tmp_path / "held.txt").write_text("\n\n".join(passages))
    bp.save(tmp_path / "m")
    build_tiny_gemma_tokenizer(tmp_path / "m")
    assert cli_main(["eval", "infill", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "held.txt"), "--n", "2",
                     "--steps", "2", "--json", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())["steps=2"]
    assert set(res["summary"]) == {"both sides", "left only"} and res["summary"]["both sides"]["n"] == 2
    assert [r["word"] for r in res["rows"]["left only"]] == [ex.word.strip() for ex in ti.make_examples(passages, 2)]
    assert "exact match" in capsys.readouterr().out


@pytest.fixture(scope="module")
def kjv():
    return blockpress.load("kjv", progress=False)


@pytest.mark.parametrize("template", ["A [MASK:10] B", "In the beginning God [MASK] the heaven and the earth.",
                                      "And God said [MASK:4]", "x  [MASK:3]  y\n\tz ", "[MASK:3] rest",
                                      r"a \[MASK] b [MASK:2] c"])
def test_infill_keeps_every_byte_outside_the_holes(kjv, template):
    """The text is the template with each marker replaced by its fill. A single space before a hole is laid out in
    the hole; a fill the model did not begin with a space lost that space ('A [MASK:10] B' -> 'Aullik: ... B')."""
    r = kjv.infill(template, seed=0)
    parts = re.split(r"(?<!\\)\[MASK(?::\d+)?\]", template)
    assert r.text == "".join(t.replace("\\[MASK", "[MASK") + f for t, f in zip(parts, [*r.fills, ""]))
    if template == "A [MASK:10] B":
        assert not kjv.tokenizer.decode(r.region_ids[:10]).startswith(" ")  # the case that lost the space
        assert r.text.startswith("A " + r.fills[0]) and r.text.endswith(" B")


def test_infill_refuses_eos_token_id_and_seed_with_a_generator(kjv):
    """eos_token_id was overwritten (ignored) and seed ignored beside a generator; both are refused, as
    max_new_tokens is. generate_text / chat take generator= too (a TypeError before), with the same rule."""
    tpl = "And God [MASK:2] the light"
    with pytest.raises(InputError, match="drop eos_token_id"):
        kjv.infill(tpl, eos_token_id=5)
    with pytest.raises(blockpress.errors.SamplingError, match="seed or generator, not both"):
        kjv.infill(tpl, seed=7, generator=torch.Generator().manual_seed(5))
    assert kjv.infill(tpl, generator=torch.Generator().manual_seed(7)).fills == kjv.infill(tpl, seed=7).fills
    for f in (kjv.generate_text, kjv.chat):
        assert f("And God", max_new_tokens=8, generator=torch.Generator().manual_seed(3)) == \
            f("And God", max_new_tokens=8, seed=3)
        with pytest.raises(blockpress.errors.SamplingError, match="not both"):
            f("And God", max_new_tokens=8, seed=3, generator=torch.Generator().manual_seed(3))
