"""The one-call RMSNorm and the folded-sign RoPE against their plain references (bit for bit on CPU),
and the memoised rotary tables (same tables as made fresh; dropped when the module moves)."""

import pytest
import torch

import blockpress
from blockpress.config import FULL, SLIDING, ModelConfig
from blockpress.model.diffusion_gemma import DiffusionGemmaModel
from blockpress.model.layers import (apply_rope, apply_rope_reference, rms_norm, rms_norm_reference, rope_cos_sin,
                                     rope_cos_sin_reference, rope_inv_freq)
from hf_oracle import TINY_TEXT, TINY_VISION

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32, 128), (3, 7, 96), (2, 5, 4, 16)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_is_the_reference_bit_for_bit(dtype, shape, with_weight):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype) if with_weight else None
    fast, ref = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert fast.dtype == ref.dtype == dtype
    assert torch.equal(fast, ref)


def test_rms_norm_with_a_weight_of_another_dtype_takes_the_reference():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.randn(64)  # fp32 weight on bf16 activations: the reference multiplies in fp32
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_rms_norm_gradients_match_the_reference():
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(3, 9, 64, generator=g), torch.randn(64, generator=g)
    grads = []
    for fn in (rms_norm, rms_norm_reference):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.enable_grad():  # another test module may have switched grad off for the session
            (fn(x, w, 1e-6) * torch.arange(64.0)).sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,params", [
    (32, {"rope_type": "default", "rope_theta": 10000.0}),
    (64, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}),  # zero frequencies
])
def test_rope_is_the_reference_bit_for_bit(dtype, head_dim, params):
    g = torch.Generator().manual_seed(head_dim)
    inv = rope_inv_freq(head_dim, params)
    pos = torch.arange(1000, 1037)
    x = (torch.randn(2, 3, 37, head_dim, generator=g) * 3).to(dtype)
    cos, sin = rope_cos_sin_reference(inv, pos, dtype)
    cos_f, sin_signed = rope_cos_sin(inv, pos, dtype)
    assert torch.equal(cos_f, cos)
    assert torch.equal(sin_signed.abs(), sin.abs())
    ref = apply_rope_reference(x, cos, sin)
    fast = apply_rope(x, cos_f, sin_signed)
    assert torch.equal(fast, ref)
    assert torch.equal(torch.signbit(fast), torch.signbit(ref))  # -0.0 where the reference has -0.0


def test_rotary_tables_are_memoised_per_span_and_dropped_when_the_module_moves():
    m = DiffusionGemmaModel(ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": dict(TINY_TEXT),
                                                   "vision_config": dict(TINY_VISION)}))
    a = m._rope(40, 8, torch.float32, "cpu")
    assert m._rope(40, 8, torch.float32, "cpu") is a  # every step of a canvas: the same tables
    for t in (SLIDING, FULL):  # and they are the tables made from scratch
        fresh = rope_cos_sin(getattr(m, f"inv_freq_{t}"), torch.arange(40, 48), torch.float32)
        assert all(torch.equal(u, v) for u, v in zip(a[t], fresh))
    assert m._rope(41, 8, torch.float32, "cpu") is not a
    for start in range(20):  # bounded: a long generation does not keep every span
        m._rope(start, 8, torch.float32, "cpu")
    assert len(m._rope_memo) <= 8
    m.to(torch.float64)
    assert not m._rope_memo
    b = m._rope(40, 8, torch.float64, "cpu")
    assert b[SLIDING][0].dtype == torch.float64


# ---------------------------------------------------------------------------------------------- memory cuts
# The 26B model's [B, C, V] tensors are 268 MB each in fp32; these paths hold fewer of them at once and must
# compute exactly what the one-shot forms compute (the peak itself: tests/test_memory.py).

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_rows_in_chunks_is_the_one_shot_softmax_bit_for_bit(dtype, monkeypatch):
    import blockpress.model.layers as layers

    z = (torch.randn(2, 13, 300, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    want = torch.softmax(z.float(), dim=-1).to(torch.bfloat16)
    monkeypatch.setattr(layers, "SOFTMAX_CHUNK", 4 * 300)  # 4 rows per chunk: 7 chunks, the last one short
    assert torch.equal(layers.softmax_rows(z, torch.bfloat16), want)
    zg = z.float().requires_grad_()
    assert torch.equal(layers.softmax_rows(zg, torch.bfloat16), want)  # autograd: the one-shot form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_out_and_soft_embedding_equal_the_plain_products(dtype):
    """lm_logits(out=) (the CUDA graphs' shared logits buffer) writes the plain product's soft-capped values into
    the buffer, with and without a cap; soft_embedding is softmax(z) @ E; out= refuses autograd."""
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": dict(TINY_TEXT, final_logit_softcapping=30.0),
                                 "vision_config": TINY_VISION})
    torch.manual_seed(0)
    m = DiffusionGemmaModel(cfg).to(dtype)
    V = cfg.text.vocab_size
    h = (torch.randn(2, 9, cfg.text.hidden_size) * 3).to(dtype)
    z = (torch.randn(2, 9, V) * 4).to(dtype)
    w = m.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(m.soft_embedding(z), torch.softmax(z.float(), -1).to(dtype) @ w)
        for cap in (30.0, None):
            m.text.final_logit_softcapping = cap
            want = (h @ w.t()).float()
            want = want.div(cap).tanh().mul(cap) if cap else want
            into = torch.full((2, 9, V), float("nan"))
            assert m.lm_logits(h, out=into) is into and torch.equal(into, want) and torch.equal(m.lm_logits(h), want)
    with torch.enable_grad(), pytest.raises(ValueError, match="torch.no_grad"):  # out= records no gradient
        m.lm_logits(h, out=torch.empty(2, 9, V))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype_kernel", [False, True])
def test_soft_embedding_into_the_logits_buffer_is_the_same_bit_for_bit(dtype, in_dtype_kernel, monkeypatch):
    """The self-conditioning probabilities written into a free buffer (a pass's own fp32 logits buffer, which
    `decode(out=)` and `encode_decode(out=)` hand over: the CUDA graphs' shared one) instead of a new tensor: the same
    soft embedding bit for bit, in row chunks and in one softmax in the input's dtype (a GPU's form, forced here on
    the CPU by calling the kernel it picks); the buffer is only a scratch. Under autograd, or with a buffer too
    small, no scratch is used. A whole decoder pass into `out` gives the plain pass's logits."""
    import blockpress.model.layers as layers

    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TINY_TEXT,
                                 "vision_config": TINY_VISION})
    torch.manual_seed(0)
    m = DiffusionGemmaModel(cfg).to(dtype)
    V = cfg.text.vocab_size
    z = (torch.randn(2, 9, V) * 4).to(dtype)
    monkeypatch.setattr(layers, "SOFTMAX_CHUNK", 4 * V)  # 4 rows a chunk: 5 chunks, the last one short
    if in_dtype_kernel:  # what softmax_rows runs on a GPU when z has the weights' dtype
        monkeypatch.setattr(layers, "SOFTMAX_IN_DTYPE_ON_CUDA", True)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    with torch.no_grad():
        want = m.soft_embedding(z)
        scratch = torch.full((2, 9, V), float("nan"))  # fp32, as the logits buffer
        got = m.soft_embedding(z, scratch)
        assert torch.equal(got, want) and not scratch.isnan().all()  # the probabilities went there
        small = torch.full((2, 9, V // 4), float("nan"))  # too small for them (bf16: half the bytes of fp32)
        assert torch.equal(m.soft_embedding(z, small), want) and small.isnan().all()
        alias = z.clone()  # the input itself (an fp32 model's logits held as its self-conditioning): not a scratch
        assert torch.equal(m.soft_embedding(alias, alias), want) and torch.equal(alias, z)
    if in_dtype_kernel:
        return
    m = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": TINY_TEXT, "canvas_length": 8},
                               seed=0).module.to(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    canvas = torch.randint(0, V, (2, 8), generator=g)
    sc = (torch.randn(2, 8, V, generator=g) * 3).to(dtype)
    with torch.no_grad():
        c1, c2 = m.new_cache(2, 64), m.new_cache(2, 64)
        m.encode(ids, c1), m.encode(ids, c2)
        want = m.decode(canvas, c1, sc)
        out = torch.full_like(want, float("nan"))
        assert m.decode(canvas, c2, sc, out=out) is out and torch.equal(out, want)


def test_in_place_softcap_and_entropy_equal_the_autograd_forms():
    """No-grad passes cap the logits and compute the entropy in place; with autograd they keep the plain form.
    Both give the same bits."""
    from blockpress.sampling import token_entropy

    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": dict(TINY_TEXT, final_logit_softcapping=30.0),
                                 "vision_config": TINY_VISION})
    torch.manual_seed(0)
    m = DiffusionGemmaModel(cfg)
    with torch.no_grad():
        m.embed_tokens.weight.normal_(0, 2.0)  # logits beyond the cap, so tanh bends them
    h = torch.randn(2, 5, cfg.text.hidden_size) * 3
    with torch.no_grad():
        fast = m.lm_logits(h)
    with torch.enable_grad():
        slow = m.lm_logits(h.requires_grad_())
    assert slow.requires_grad and torch.equal(fast, slow.detach()) and fast.abs().max() > 20
    with torch.no_grad():  # out= (the CUDA graphs' shared logits buffer): the same bits, written into it
        into = torch.full_like(fast, float("nan"))
        assert m.lm_logits(h, out=into) is into and torch.equal(into, fast)
        m.text.final_logit_softcapping = None
        into = torch.full_like(fast, float("nan"))
        assert m.lm_logits(h, out=into) is into and torch.equal(into, m.lm_logits(h))
    z = fast * 0.7
    z[0, 0, :] = float("-inf")  # 0 * log 0 = 0: a fully masked row keeps its finite answer
    z[0, 0, 3] = 1.0
    with torch.no_grad():
        e_fast = token_entropy(z)
    with torch.enable_grad():
        e_slow = token_entropy(z.clone().requires_grad_())
    assert torch.equal(e_fast, e_slow.detach()) and torch.isfinite(e_fast).all()
