"""Low-precision experts: formats (pack / error bounds), the QuantizedExperts paths vs the
dequantised reference (torch and Triton-interpreter), the module swap, the quantised random build,
and the quality numbers the guard reports."""

import pytest
import torch

from blockpress.kernels import use
from blockpress.lab.presets import preset_config
from blockpress.kernels._triton import fp8_usable_on, triton
from blockpress.kernels.quant import (QuantizedExperts, compare_logits, dequantize_fp8, dequantize_int4,
                                      experts_weight_bytes, group_for, pack_int4, quantize_experts_, quantize_fp8,
                                      quantize_int4, unpack_int4)
from blockpress.lab.random_weights import build_model
from blockpress.model.moe import experts_loop
from kernel_device import DEV, needs_triton

pytestmark = pytest.mark.no_grad  # inference: conftest runs each test without autograd


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_int4_pack_roundtrip_every_value():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # [3, 32]
    q = q[:, torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    p = pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (3, 16)
    assert torch.equal(unpack_int4(p), q)
    assert int(p[0, 0]) == ((int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4))  # even column = low nibble


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_error_within_half_step(dtype):
    w = torch.randn(2, 12, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    p, s = quantize_int4(w, group_size=32, scale_dtype=dtype)
    assert s.shape == (2, 12, 3) and s.dtype == dtype
    deq = dequantize_int4(p, s, torch.float32)
    step = s.float().repeat_interleave(32, -1)
    # clipping search may clip a group's largest values, never by more than 20% of its range
    inside = w.float().abs() <= 7 * step
    assert ((deq - w.float()).abs()[inside] <= step[inside] / 2 + 1e-6).all()
    assert ((deq - w.float()).abs() <= 0.25 * w.float().abs().amax(-1, keepdim=True)).all()
    assert _rel(deq, w) < 0.12


def test_fp8_error_bound():
    w = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 16)[:, None]
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 16)
    deq = dequantize_fp8(q, s, torch.float32)
    # e4m3: 3 mantissa bits (<= 2^-4 relative), subnormal step 2^-9 of the row scale
    assert ((deq - w).abs() <= 2 ** -4 * w.abs() + 2 ** -10 * s[..., None] + 1e-12).all()
    assert torch.allclose(q.float().abs().amax(-1), torch.full((3, 16), 448.0))  # full range used


def test_group_for_real_sizes():
    assert group_for(2816, 64) == 64 and group_for(704, 64) == 64  # the released model: 4.25 bits/weight
    assert group_for(704, 128) == 64 and group_for(24, 64) == 8


def _routing(N, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    w, idx = torch.topk(torch.rand(N, E, generator=g), K)
    return w / w.sum(-1, keepdim=True), idx


def _quantized(fmt, dtype, E=8, H=64, Im=32, group=32, seed=3):
    g = torch.Generator().manual_seed(seed)
    gu, dn = torch.randn(E, 2 * Im, H, generator=g) / 8, torch.randn(E, H, Im, generator=g) / 6
    q = QuantizedExperts(E, H, Im, fmt, group, dtype=dtype).load_float_(gu.to(dtype), dn.to(dtype), chunk=3)
    return q, gu, dn


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_dequantised_reference(fmt, dtype):
    q, gu, dn = _quantized(fmt, dtype)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    w, idx = _routing(30, 8, 3, 5)
    q.backend = "torch"
    ref = experts_loop(x, w, idx, q.dequantize("gate_up"), q.dequantize("down"))
    assert _rel(q(x, w, idx), ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    full = experts_loop(x.float(), w, idx, gu, dn)
    assert _rel(ref, full) < (0.08 if fmt == "fp8" else 0.25)  # the format's own error, bounded


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("moe_sum,swap", [("kernel", False), ("atomic", False), ("kernel", True)])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_path_equals_torch_path(fmt, dtype, tol, moe_sum, swap):
    """The Triton kernels against the torch path; swap: the weight tile as the dot's first operand (tiles swap=1),
    the transposed accumulators' epilogues included."""
    from blockpress.kernels import moe_grouped

    dev = DEV  # CPU: the interpreter; a GPU: the compiled kernels
    if fmt == "fp8" and not fp8_usable_on(dev):
        pytest.skip("fp8 Triton kernels need sm_89+; fp8 experts take the torch path here")
    q, _, _ = _quantized(fmt, dtype)
    q = q.to(dev)
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(6)).to(dev, dtype)
    w, idx = (t.to(dev) for t in _routing(21, 8, 3, 7))
    q.backend = "torch"
    ref = q(x, w, idx)
    q.backend = "triton"
    assert q.resolved_backend(x) == "triton"
    q.moe_sum = moe_sum  # the K-sum by a third kernel, or by the down kernel's atomics
    q.tiles = moe_grouped.parse_tiles("swap=1" if swap else "")
    assert _rel(q(x, w, idx), ref) < tol


def test_weight_bytes_of_the_real_model_on_meta():
    E, H, Im = 128, 2816, 704
    fp8 = QuantizedExperts(E, H, Im, "fp8", dtype=torch.bfloat16, device="meta")
    int4 = QuantizedExperts(E, H, Im, "int4", 64, dtype=torch.bfloat16, device="meta")
    weights = E * 3 * Im * H
    assert fp8.weight_bytes() == weights + E * (2 * Im + H) * 4
    assert int4.weight_bytes() == weights // 2 + (weights // 64) * 2  # 4 bits + a bf16 scale per 64
    assert 30 * int4.weight_bytes() / 1e9 == pytest.approx(12.13, abs=0.01)


def test_module_swap_keeps_everything_else_and_generates():
    config, _, _ = preset_config("tiny")
    m = build_model(config, torch.device("cpu"), torch.float32, seed=1, std=0.05)
    before = {n: p.clone() for n, p in m.named_parameters() if ".experts." not in n}
    native_bytes = experts_weight_bytes(m)
    quantize_experts_(m, "int4", group_size=16)
    after = dict(m.named_parameters())
    assert set(after) == set(before)  # embeddings, attention, router, self-conditioning untouched
    assert all(torch.equal(before[n], after[n]) and after[n].dtype == torch.float32 for n in before)
    assert all(isinstance(layer.experts, QuantizedExperts) for layer in m.layers)
    assert experts_weight_bytes(m) < native_bytes / 5  # fp32 -> 4 bits + an fp32 scale per 16
    use(m, experts="grouped")  # the engine's switch must not break swapped experts
    from blockpress.config import GenerationConfig
    from blockpress.engine.generate import generate

    cfg = GenerationConfig.resolve(max_new_tokens=16, max_denoising_steps=2, stability_threshold=None,
                                   confidence_threshold=None)
    out = generate(m, torch.randint(5, 512, (1, 8)), cfg, m.config.canvas_length)
    assert out.sequences.shape == (1, 24)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantised_random_build_equals_quantising_the_float_build(fmt):
    """The benchmark fills fp8/int4 experts on the device chunk by chunk; the result must be
    exactly the quantised float twin (same seeds), so precisions compare the same model."""
    config, _, _ = preset_config("tiny")
    direct = build_model(config, torch.device("cpu"), torch.float32, precision=fmt, seed=2, group_size=16)
    twin = quantize_experts_(build_model(config, torch.device("cpu"), torch.float32, seed=2), fmt, 16)
    for a, b in zip(direct.layers, twin.layers):
        for name in ("gate_up_q", "gate_up_scale", "down_q", "down_scale"):
            assert torch.equal(getattr(a.experts, name).view(torch.uint8) if fmt == "fp8" and name.endswith("_q")
                               else getattr(a.experts, name),
                               getattr(b.experts, name).view(torch.uint8) if fmt == "fp8" and name.endswith("_q")
                               else getattr(b.experts, name))


def test_compare_logits_metrics():
    ref = torch.randn(2, 4, 50)
    same = compare_logits(ref, ref.clone())
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-7) and same["top1_agreement"] == 1.0
    worse = compare_logits(ref, ref + 0.5 * torch.randn(2, 4, 50))
    assert worse["mean_kl"] > 1e-3 and worse["max_kl"] >= worse["mean_kl"]


@pytest.mark.gpu
def test_fp8_scaled_mm_on_hopper():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("fp8 grouped GEMM needs Hopper")
    q, gu, dn = _quantized("fp8", torch.bfloat16, E=8, H=128, Im=64)
    q = q.cuda()
    x = torch.randn(64, 128, device="cuda").bfloat16()
    w, idx = _routing(64, 8, 2, 8)
    w, idx = w.cuda(), idx.cuda()
    q.backend = "torch"
    ref = q(x, w, idx)
    q.backend = "scaled_mm"
    assert _rel(q(x, w, idx), ref) < 0.08  # w8a8: activations quantised too


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_load_quantises_layer_by_layer_while_loading(tmp_path, fmt):
    """load(precision=...) quantises each layer as soon as its two float expert tensors are in: the same weights
    as quantising a natively loaded model afterwards (the tested path), while no more than one layer's float
    experts exist at a time."""
    import blockpress
    from blockpress.kernels import quant
    from blockpress.train import sizes

    folder = tmp_path / "m"
    blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0).save(folder)
    live, peak = set(), [0]
    real = quant._quantize_layer_

    def spy(layer, *a, **k):  # count layers whose float experts are materialised when one is quantised
        live.update(i for i, lay in enumerate(module_ref[0].layers) if not isinstance(lay.experts, quant.QuantizedExperts)
                    and not lay.experts.gate_up_proj.is_meta)
        peak[0] = max(peak[0], len(live))
        live.clear()
        return real(layer, *a, **k)

    module_ref = [None]
    orig_stream = quant.streaming_quantizer

    def capture(module, *a, **k):
        module_ref[0] = module
        return orig_stream(module, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_quantize_layer_", spy)
        mp.setattr(quant, "streaming_quantizer", capture)
        streamed = blockpress.load(folder, progress=False, precision=fmt, group_size=16)
    assert all(isinstance(layer.experts, quant.QuantizedExperts) for layer in streamed.module.layers)
    assert peak[0] == 1
    after = blockpress.load(folder, progress=False)
    quant.quantize_experts_(after.module, fmt, 16)
    for a, b in zip(streamed.module.state_dict().items(), after.module.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    ids = torch.randint(5, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, max_denoising_steps=3)
    gen = torch.Generator(streamed.device)
    assert torch.equal(streamed.generate(ids, generator=gen.manual_seed(1), **kw).sequences,
                       after.generate(ids, generator=gen.manual_seed(1), **kw).sequences)
    with pytest.raises(blockpress.InputError, match="unknown precision"):
        blockpress.load(folder, progress=False, precision="int3")


def test_cli_runs_the_shipped_model_with_int4_experts(capsys):
    import json

    from blockpress.cli import main as cli_main

    from blockpress.cli.run import EXAMPLE_SUDOKU

    assert cli_main(["run", "sudoku", EXAMPLE_SUDOKU, "--precision", "int4", "--json", "--seed", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clues_kept"] == 1.0 and len(out["answer"]) == 81


def test_scaled_mm_backend_is_refused_where_it_cannot_run():
    """torch._scaled_grouped_mm exists only on fp8-capable GPUs: asking for it elsewhere, or for non-fp8
    experts, is a one-line error naming the fix, not a NotImplementedError from inside the first pass."""
    from blockpress.kernels import configure

    cfg, _, _ = preset_config("tiny")
    module = build_model(cfg, device="cpu", dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="needs fp8 experts; add --precision fp8"):
        configure(module, experts="scaled_mm")
    with pytest.raises(ValueError, match="needs a CUDA GPU with fp8 matmuls"):
        configure(module, experts="scaled_mm", precision="fp8")


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i = byte sel.nibble[i] of the 8 bytes b:a (a is bytes 0-3)."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result = bit (a_i b_i c_i) of the truth table, a = 0xF0, b = 0xCC, c = 0xAA."""
    return sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i for i in range(32))


@pytest.mark.parametrize("magic,dtype,base", [("0x43004300", torch.bfloat16, 128), ("0x64006400", torch.float16, 1024)])
def test_int4_nibble_asm_gives_magic_plus_nibble(magic, dtype, base):
    """The GPU's int4 experts turn 4 packed bytes into 8 16-bit floats with moe_grouped.NIBBLE_ASM (inline PTX: the
    interpreter does not run it). Emulated here with PTX's definitions of prmt / lop3 / shr on the asm's own
    constants: every byte gives base + low nibble and base + high nibble in element order, and subtracting
    base + 8 gives the format's n - 8 (the torch reference's value)."""
    import re

    from blockpress.kernels import moe_grouped

    src = moe_grouped.NIBBLE_ASM.format(magic=magic)
    if triton is not None:  # the kernels' asm is this template
        assert (moe_grouped.NIBBLE_ASM_BF16 if dtype == torch.bfloat16 else moe_grouped.NIBBLE_ASM_F16).value == src
    sel = dict(re.findall(r"prmt\.b32 (t[01]), \$4, z, (0x[0-9a-fA-F]+);", src))
    lops = re.findall(r"lop3\.b32 \$(\d), (t[01]), (0x[0-9a-fA-F]+), (0x[0-9a-fA-F]+), (0x[0-9a-fA-F]+);", src)
    assert set(sel) == {"t0", "t1"} and len(lops) == 4 and src.count("shr.u32") == 2
    g = torch.Generator().manual_seed(0)
    words = [int(w) for w in torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64)] + [0, 0xFFFFFFFF]
    for w in words:
        t = {name: _prmt(w, 0, int(c, 16)) for name, c in sel.items()}
        regs = {}
        for i, (reg, tname, b, c, lut) in enumerate(lops):  # the last two lop3s read t0, t1 after `shr 4`
            regs[int(reg)] = _lop3(t[tname] >> (4 if i >= 2 else 0), int(b, 16), int(c, 16), int(lut, 16))
        halves = torch.tensor([(regs[r] >> sh) & 0xFFFF for r in range(4) for sh in (0, 16)], dtype=torch.int32)
        vals = halves.to(torch.int16).view(dtype).float().tolist()
        lo, hi = vals[:4], vals[4:]  # outputs 0, 1: low nibbles of bytes 0..3; outputs 2, 3: high nibbles
        for i in range(4):
            byte = (w >> (8 * i)) & 0xFF
            assert lo[i] == base + (byte & 0xF) and hi[i] == base + (byte >> 4)
            assert lo[i] - base - 8 == unpack_int4(torch.tensor([[byte]], dtype=torch.uint8))[0, 0].item()


def test_int4_kernel_k_tiles_hold_two_dots_of_16():
    """The int4 kernels dot a K tile's even and odd columns apart, each at least tl.dot's 16: K tiles of >= 32 in
    one scale group; group 16 (allowed, for accuracy) takes the torch path instead of a kernel that would not
    compile on a GPU."""
    from blockpress.kernels import moe_grouped as mg

    assert mg.int4_block_k(64, (64, 64)) == 64 and mg.int4_block_k(128, (64, 64)) == 64
    assert mg.int4_block_k(16, (64, 64)) == 32 and mg.int4_block_k(64, (32, 32)) == 32
    x = torch.empty(2, 64)
    assert mg.triton_supported(x, mg.FMT_INT4, (32, 32)) == (triton is not None and mg.usable_on(x.device))
    assert not mg.triton_supported(x, mg.FMT_INT4, (16, 32))
    q = QuantizedExperts(4, 64, 32, "int4", 16, dtype=torch.float32)
    q.backend = "triton"
    assert q.groups == (16, 16) and q.resolved_backend(x) == "torch"


def test_int4_mlp_is_the_float_mlp_on_its_dequantised_weights():
    """linears="int4-mlp": the dense MLP as one int4 expert every token takes with weight 1: the float MLP's
    arithmetic on the dequantised weights (fp32), through the torch reference and the Triton kernels (the
    interpreter on a CPU), and within int4's own error of the float MLP."""
    import torch.nn.functional as F

    from blockpress.kernels.quant import QuantizedMLP
    from blockpress.model.layers import gelu_tanh

    config, _, _ = preset_config("tiny")
    m = build_model(config, torch.device("cpu"), torch.float32, seed=1, std=0.05)
    mlp = m.layers[0].mlp
    inter = mlp.gate_proj.weight.shape[0]
    q = QuantizedMLP.from_mlp(mlp, group_size=32)
    x = torch.randn(2, 7, mlp.gate_proj.weight.shape[1], generator=torch.Generator().manual_seed(3))
    gu, dn = q.experts.dequantize("gate_up")[0], q.experts.dequantize("down")[0]
    ref = F.linear(gelu_tanh(F.linear(x, gu[:inter])) * F.linear(x, gu[inter:]), dn)
    q.experts.backend = "torch"
    out = q(x)
    assert out.shape == x.shape and _rel(out, ref) < 1e-6
    assert 0 < _rel(out, mlp(x)) < 0.25  # the format's error, bounded
    if triton is not None:
        q.experts.backend = "triton"
        q.experts.to(DEV)
        assert _rel(q(x.to(DEV)).cpu(), ref) < 1e-5


def test_int4_mlp_through_load_configure_and_the_byte_estimate(tmp_path):
    """Loading with linears="int4-mlp" quantises each layer's MLP as its weights arrive, the same model as
    quantising after; the weight-byte estimate (the memory check) counts it; saved, it loads back as stored."""
    import blockpress
    from blockpress import kernels
    from blockpress.kernels.quant import QuantizedMLP, quantize_mlp_
    from blockpress.loading import estimated_weight_bytes
    from blockpress.train import sizes

    folder = tmp_path / "m"
    blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0).save(folder)
    streamed = blockpress.load(folder, progress=False, precision="int4", group_size=16, linears="int4-mlp")
    after = blockpress.load(folder, progress=False, precision="int4", group_size=16)
    quantize_mlp_(after.module, group_size=16)
    assert all(isinstance(layer.mlp, QuantizedMLP) for layer in streamed.module.layers)
    sa, sb = streamed.module.state_dict(), after.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.device("meta"):
        meta = type(streamed.module)(streamed.module.config)
    held = sum(t.numel() * t.element_size() for t in [*streamed.module.parameters(), *streamed.module.buffers()]
               if t.device.type != "meta")
    buffers = sum(b.numel() * b.element_size() for n, b in meta.named_buffers())
    assert estimated_weight_bytes(meta, torch.float32, "int4", 16, linears="int4-mlp") + buffers == held
    assert kernels.configure(streamed.module, precision="int4", group_size=16, linears="int4-mlp")["linears"] == \
        "int4-mlp torch"  # a CPU: the torch reference (Triton only where it compiles)
    ids = torch.randint(5, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    res = streamed.generate(ids, max_new_tokens=8, max_denoising_steps=3, generator=torch.Generator().manual_seed(1))
    assert res.sequences.shape == (1, 14)
    back = blockpress.load(streamed.save(tmp_path / "copy"), progress=False)  # the pre-quantised layout, as stored
    assert (back.options.precision, back.options.group_size, back.options.linears) == ("int4", 16, "int4-mlp")
    sc = back.module.state_dict()
    assert sc.keys() == sa.keys() and all(torch.equal(sa[k], sc[k]) for k in sa)


# ------------------------------------------------------------------------------------ w8a8 experts


def _e4m3_edges() -> torch.Tensor:
    """Every finite e4m3 magnitude's midpoint with its neighbour (the ties), a hair either side of each, and the
    values themselves, with both signs: where rounding to fp8 can go wrong."""
    vals = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()  # 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    near = torch.cat([mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), vals])
    return torch.cat([near, -near])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_rows_kernel_is_quantize_rows_fp8_byte_for_byte(dtype):
    """The w8a8 experts' row quantiser (Triton) writes `quantize_rows_fp8`'s bytes and scales: rows of random
    values, a zero row, and a row whose scale is 1 holding every e4m3 rounding tie and its neighbours (ties to
    even; Triton's interpreter casts some of these wrongly itself, which `_fp8_nearest` avoids). Rows whose id
    marks expert-block padding are left unwritten."""
    from blockpress.kernels.moe_grouped import _quant_rows
    from blockpress.kernels.quant import quantize_rows_fp8

    edges = _e4m3_edges()
    x = torch.randn(6, edges.numel(), generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [1.0, 1e-3, 1e4, 0.0, 1.0, 1.0])[:, None]
    x[4] = edges
    x[4, 0] = 448.0  # amax 448: scale 1, the row's values are rounded as they are
    x = x.to(dtype)
    q, s = _quant_rows(x.to(DEV))
    rq, rs = quantize_rows_fp8(x)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    ids = torch.tensor([0, 5, 1, 5, 2, 5], device=DEV)  # A = 5: rows 1, 3 and 5 are padding
    q2 = torch.full_like(q, 7.0)
    s2 = torch.full_like(s, -1.0)
    from blockpress.kernels import moe_grouped

    moe_grouped._quant_rows_kernel[(6,)](x.to(DEV), q2, s2, ids, 5, x.shape[1], x.stride(0), q2.stride(0),
                                         BLOCK=triton.next_power_of_2(x.shape[1]), IDS=True)
    kept = torch.tensor([0, 2, 4])
    assert torch.equal(q2.cpu()[kept].view(torch.uint8), rq[kept].view(torch.uint8))
    assert (q2.cpu()[[1, 3, 5]].float() == 7.0).all() and (s2.cpu()[[1, 3, 5]] == -1.0).all()


def test_w8a8_reference_is_torch_fp8_matmuls():
    """`experts_w8a8_torch` is the arithmetic of torch's own fp8 x fp8 matmul (`torch._scaled_mm`, per-row scales on
    both sides) run expert by expert, in fp32; and it is a different function from weight-only fp8 (the activations
    really are quantised), within fp8's error of the float experts."""
    from blockpress.kernels.linear_q import linear_fp8_scaled_mm
    from blockpress.kernels.quant import experts_w8a8_torch
    from blockpress.model.layers import gelu_tanh

    q, gu, dn = _quantized("fp8", torch.float32)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(4))
    w, idx = _routing(30, 8, 3, 5)
    out = experts_w8a8_torch(x, w, idx, *q._weights())
    want = torch.zeros_like(x)
    for t in range(30):
        for k in range(3):
            e = int(idx[t, k])
            u = linear_fp8_scaled_mm(x[t:t + 1], q.gate_up_q[e], q.gate_up_scale[e])
            a = gelu_tanh(u[:, :32]) * u[:, 32:]
            want[t] += w[t, k] * linear_fp8_scaled_mm(a, q.down_q[e], q.down_scale[e])[0]
    assert _rel(out, want) < 1e-5
    q.backend = "torch"
    weight_only = q(x, w, idx)
    assert _rel(out, weight_only) > 1e-3
    assert _rel(out, experts_loop(x, w, idx, gu, dn)) < 0.1


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("moe_sum,swap", [("kernel", False), ("atomic", False), ("kernel", True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_w8a8_kernel_equals_its_reference(dtype, tol, moe_sum, swap):
    """The Triton experts with fp8 activations (act8: fp8 x fp8 dots, both scales on the accumulator) against
    `experts_w8a8_torch`; the module's "w8a8" backend resolves to the kernel where it compiles and to the reference
    on a CPU. (bf16 in the interpreter: Triton's interpreter truncates fp32 -> bf16 casts, hence the wider bound.)"""
    from blockpress.kernels import moe_grouped

    dev = DEV
    if not fp8_usable_on(dev):
        pytest.skip("fp8 Triton kernels need sm_89+")
    q, _, _ = _quantized("fp8", dtype)
    q = q.to(dev)
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(6)).to(dev, dtype)
    w, idx = (t.to(dev) for t in _routing(21, 8, 3, 7))
    q.backend = "w8a8"
    assert q.resolved_backend(x) == ("triton-a8" if dev.type == "cuda" else "torch-a8")
    from blockpress.kernels.quant import experts_w8a8_torch

    ref = experts_w8a8_torch(x, w, idx, *q._weights())
    if dev.type == "cpu":
        assert torch.equal(q(x, w, idx), ref)
    q.backend, q.moe_sum = "triton-a8", moe_sum
    q.tiles = moe_grouped.parse_tiles("swap=1" if swap else "")
    assert q.resolved_backend(x) == "triton-a8"
    out = q(x, w, idx)
    assert _rel(out, ref) < tol
    # tokens quantised already (a compiled block's path): the same numbers without the first quantising launch
    from blockpress.kernels.quant import experts_quantized, quantize_rows_fp8

    xq, xs = quantize_rows_fp8(x)
    args = (xq, w, idx, *q._weights(), "fp8", dtype, q.groups)
    pre = experts_quantized(*args, "triton-a8", q.tiles, moe_sum, xs)
    assert pre.dtype == dtype and torch.equal(pre, out)
    assert torch.equal(experts_quantized(*args, "w8a8", q.tiles, moe_sum, xs), ref if dev.type == "cpu" else pre)
    with pytest.raises(ValueError, match="tokens quantised to fp8 need the w8a8 experts backend"):
        experts_quantized(*args, "torch", q.tiles, moe_sum, xs)
    q.backend = "torch"
    assert _rel(q(x, w, idx), ref) > 1e-3  # not weight-only fp8 by another name


def test_w8a8_backend_through_load_and_configure_needs_fp8(tmp_path, monkeypatch):
    """`experts="w8a8"`: refused without fp8 experts (one line naming the fix); with them every layer takes it, its
    kernels hold no host sync (CUDA graphs may capture them), a compiled block's custom op computes the same, and
    generation runs (a CPU: the torch reference)."""
    import blockpress
    from blockpress.errors import InputError
    from blockpress.kernels import configure
    from blockpress.kernels.select import host_syncs
    from blockpress.train import sizes

    folder = tmp_path / "m"
    blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0).save(folder)
    import blockpress.loading

    def no_weights(*a, **k):
        raise AssertionError("a weight was read before the refusal")

    with monkeypatch.context() as m:  # the refusal comes before any weight is read
        m.setattr(blockpress.loading, "load_weights", no_weights)
        with pytest.raises(InputError, match="fp8 activations .* need fp8 weights; add --precision fp8 and / or"):
            blockpress.load(folder, progress=False, experts="w8a8")
    lm = blockpress.load(folder, progress=False, precision="fp8", experts="w8a8")
    module = lm.module
    assert all(layer.experts.backend == "w8a8" for layer in module.layers)
    assert host_syncs(module) == []
    ids = torch.randint(5, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    res = lm.generate(ids, max_new_tokens=8, max_denoising_steps=3, generator=torch.Generator().manual_seed(1))
    assert res.sequences.shape == (1, 14)
    chosen = configure(module, experts="w8a8", precision="fp8")
    assert chosen["experts"] == "torch-a8" and chosen["linears"] == "native"
    cfg = module.config
    from blockpress.kernels.quant import experts_quantized, quantized_experts_op

    ex = module.layers[0].experts
    x = torch.randn(10, cfg.text.hidden_size)
    w, idx = _routing(10, cfg.text.num_experts, cfg.text.top_k_experts, 1)
    eager = experts_quantized(x, w, idx, *ex._weights(), ex.fmt, ex.dtype, ex.groups, ex.backend, ex.tiles,
                              ex.moe_sum)
    op = quantized_experts_op(x, w, idx, *ex._weights(), ex.fmt, ex.dtype, list(ex.groups), ex.backend,
                              ex.tiles.spec(), ex.moe_sum)
    assert torch.equal(eager, op)
    ex.backend = "torch"
    assert not torch.equal(eager, ex(x, w, idx))
