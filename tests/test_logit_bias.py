"""`logit_bias` (OpenAI's field; `generate(logit_bias=...)`): added to a row's soft-capped logits before the
temperature in every denoising step. On the random-weight tiny model of the server tests (noise, so the bias is what
moves a token) and through the server."""

from __future__ import annotations

import collections

import openai
import pytest
import torch

from blockpress.errors import InputError, SamplingError

from test_server import FAST_KW, MSG, client, lm, model_dir, server  # noqa: F401 (fixtures: the tiny model, one thread)

KW = {**FAST_KW, "max_new_tokens": 32}


def _rows(lm, seeds, shared: bool = False, **kw):
    """The new tokens of one prompt in len(seeds) rows: a stream per row, or one for the batch (seeded seeds[0])."""
    ids = lm.encode_chat("Hello", chat=False)
    gen = torch.Generator().manual_seed(seeds[0]) if shared else [torch.Generator().manual_seed(s) for s in seeds]
    out = lm.generate([ids] * len(seeds), generator=gen, **KW, **kw)
    return [r.tolist() for r in out.new_tokens]


def _plain(lm, free):
    """The commonest tokens of `free` that are no stop or pad id (a forced one would end the reply)."""
    cfg = lm.generation_config()
    special = set(cfg.eos_token_id or []) | {cfg.pad_token_id} | lm.tokenizer.special_ids
    plain = [t for t, _ in collections.Counter(t for r in free for t in r).most_common() if t not in special
             and lm.tokenizer.decode([t]).strip()]
    return plain[:3]


@pytest.mark.parametrize("sampler", ["exact", "fast"])
@pytest.mark.parametrize("shared", [False, True], ids=["stream per row", "one stream"])
def test_minus_100_bans_and_plus_100_forces(lm, sampler, shared):
    free = _rows(lm, range(3), shared, sampler=sampler)
    common = _plain(lm, free)
    banned = _rows(lm, range(3), shared, sampler=sampler, logit_bias={t: -100 for t in common})
    assert not set(common) & {t for r in banned for t in r} and banned != free
    forced = _rows(lm, range(3), shared, sampler=sampler, logit_bias={common[0]: 100.0})
    assert forced == [[common[0]] * KW["max_new_tokens"]] * 3


def test_zero_bias_and_rows_without_one_keep_their_tokens(lm):
    free = _rows(lm, range(3))
    assert _rows(lm, range(3), logit_bias={5: 0.0}) == free  # + 0: the same bits
    assert _rows(lm, range(3), logit_bias={}) == free
    common = _plain(lm, free)
    alone = _rows(lm, range(3), logit_bias={common[0]: -100})
    for sampler in ("exact", "fast"):  # a row beside biased ones writes what it writes alone, and they do
        free_s = free if sampler == "exact" else _rows(lm, range(3), sampler=sampler)
        alone_s = alone if sampler == "exact" else _rows(lm, range(3), sampler=sampler, logit_bias={common[0]: -100})
        mixed = _rows(lm, range(3), sampler=sampler, logit_bias=[{common[0]: -100}, None, {common[0]: -100}])
        assert mixed == [alone_s[0], free_s[1], alone_s[2]]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("shared", [False, True], ids=["stream per row", "one stream"])
def test_the_fused_kernel_applies_the_bias_in_the_engine(lm, shared, monkeypatch):
    """The fast sampler as a GPU runs it: the Triton pass (the interpreter here) caps, biases and samples in one read
    of the LM head's product; -100 bans, +100 forces, and in a mixed batch the rows without a bias write what they
    write alone."""
    from blockpress.engine import step
    from blockpress.kernels._triton import usable_on
    from blockpress.kernels.sampler_fused import fused_sample

    if not usable_on(torch.device("cpu")):
        pytest.skip("triton not installed (pip install triton), or TRITON_INTERPRET=0 without CUDA")
    monkeypatch.setattr(step, "fused_sample", lambda *a, **kw: fused_sample(*a, backend="triton", **kw))
    free = _rows(lm, range(3), shared, sampler="fast")
    common = _plain(lm, free)
    banned = _rows(lm, range(3), shared, sampler="fast", logit_bias={t: -100 for t in common})
    assert not set(common) & {t for r in banned for t in r} and banned != free
    forced = _rows(lm, range(3), shared, sampler="fast", logit_bias={common[0]: 100.0})
    assert forced == [[common[0]] * KW["max_new_tokens"]] * 3
    if shared:  # one pass over the batch: each row reads its own bias
        each = _rows(lm, range(3), shared, sampler="fast", logit_bias=[{common[0]: 100}, None, {common[1]: 100}])
        assert each[0] == [common[0]] * KW["max_new_tokens"] and each[2] == [common[1]] * KW["max_new_tokens"]
        assert each[1] != each[0] and each[1] != each[2]
    else:  # (a row's draws depend on the batch's in one stream, so only a stream per row can compare to alone)
        mixed = _rows(lm, range(3), sampler="fast", logit_bias=[None, {common[0]: -100}, None])
        assert [mixed[0], mixed[2]] == [free[0], free[2]] and common[0] not in mixed[1]


def test_the_bias_is_added_to_the_capped_logits_before_the_temperature(lm, monkeypatch):
    """The same tokens as a decoder whose logits carry the bias (the exact sampler reads the capped logits)."""
    schedule = {"t_min": 0.4, "t_max": 0.8}  # (a bias added after the temperature would then differ)
    free = _rows(lm, range(2), **schedule)
    bias = {t: v for t, v in zip(_plain(lm, free), (0.4, -0.3, 0.2))}  # small: it moves some tokens, not all
    biased = _rows(lm, range(2), logit_bias=bias, **schedule)
    assert biased != free
    vec = torch.zeros(lm.module.text.vocab_size)
    vec[list(bias)] = torch.tensor(list(bias.values()))
    decode = lm.module.decode

    def decode_with_bias(*args, **kw):
        assert kw.get("capped", True)  # the exact sampler's logits: soft-capped
        return decode(*args, **kw) + vec

    monkeypatch.setattr(lm.module, "decode", decode_with_bias)
    assert lm.passes is None or lm.passes is lm.module
    assert _rows(lm, range(2), **schedule) == biased


def test_infill_takes_a_bias_for_its_holes():
    import blockpress

    kjv = blockpress.load("kjv", progress=False)
    a = kjv.tokenizer.encode(" light")[-1]
    free = kjv.infill("And God [MASK:3] the light.", seed=0)
    forced = kjv.infill("And God [MASK:3] the light.", seed=0, logit_bias={a: 100})
    assert forced.fills == [kjv.tokenizer.decode([a] * 3).strip()] != free.fills
    assert forced.text.startswith("And God ") and forced.text.endswith(" the light.")


@pytest.mark.parametrize("bias, needle", [
    ({-1: 1.0}, "-1 is not a token id in"), ({10**6: 1.0}, "is not a token id in"), ({"5": 1.0}, "'5' is not a token"),
    ({5: float("nan")}, "is not a finite number"), ({5: float("inf")}, "is not a finite number"),
    ({5: "1"}, "is not a finite number"), ([{5: 1.0}], "logit biases for a batch of 2"), ("x", "must be a dict"),
])
def test_bad_biases_are_one_line_errors(lm, bias, needle):
    with pytest.raises((SamplingError, InputError), match=needle) as e:
        _rows(lm, range(2), logit_bias=bias)
    assert "\n" not in str(e.value)


def test_the_server_applies_logit_bias(client, lm):
    ids = lm.encode_chat("Hello", chat=False)
    free = lm.generate([ids], generator=torch.Generator().manual_seed(0), **KW).new_tokens[0].tolist()
    t = _plain(lm, [free])[0]

    def chat(**kw):
        r = client.chat.completions.create(model=client.model_id, messages=MSG, max_tokens=16, seed=3,
                                           extra_body={"steps": 3}, **kw)
        return r.choices[0].message.content

    assert chat(logit_bias={str(t): 100}) == lm.tokenizer.decode([t] * 16)  # every token forced (none ends it)
    assert chat(logit_bias={}) == chat()
    with pytest.raises(openai.BadRequestError) as e:
        chat(logit_bias={str(lm.module.text.vocab_size): 5})
    assert e.value.body["param"] == "logit_bias" and "is not a token id" in e.value.body["message"]
