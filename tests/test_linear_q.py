"""8-bit linears (kernels/linear_q.py): the format's error bound, the Triton kernel (interpreter on CPU) vs the
torch reference, the module swap, streaming while loading, the memory estimate, graphs, LoRA and save."""

import pytest
import torch

import blockpress
from blockpress.kernels import configure
from blockpress.kernels._triton import fp8_usable_on, triton
from blockpress.kernels.linear_q import (QUANTIZED_LINEARS, QuantizedLinear, dequantize_int8_rows, linear_a8,
                                         linear_fp8_scaled_mm, linear_fp8_w8a8_reference, linear_q_triton,
                                         quantize_int8_rows, quantize_linears_)
from blockpress.kernels.quant import quantize_rows_fp8
from blockpress.lab.random_weights import build_model
from kernel_device import COMPILED, DEV, needs_triton


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _tiny(seed=0):
    from blockpress.lab.presets import preset_config

    config, _, _ = preset_config("tiny")
    return build_model(config, torch.device("cpu"), torch.float32, seed=seed, std=0.05)


def test_int8_rows_error_within_half_step_and_full_range():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 1, 24)[:, None]
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and s.shape == (24,) and s.dtype == torch.float32
    deq = dequantize_int8_rows(q, s, torch.float32)
    assert ((deq - w).abs() <= s[:, None] / 2 + 1e-12).all()  # round to nearest: half a step per row
    full = torch.ones(24, dtype=torch.bool)
    full[3] = False
    assert (q[full].abs().amax(-1) == 127).all() and (q[3] == 0).all()


@needs_triton
@pytest.mark.parametrize("spec", ["bm=16,bn=32,bk=16,split=3", "bn=16,bk=32,split=2,warps=2", "bm=32,split=64",
                                  "bn=16,bk=16,swap=1", "bn=32,bk=16,split=3,swap=1"])
@pytest.mark.parametrize("M,I,O", [(1, 64, 80), (40, 112, 48)])
def test_triton_kernel_with_other_tiles_and_a_split_k_equals_the_torch_reference(spec, M, I, O):
    """Other tiles (the `linear_tiles` option): narrower N tiles and K summed by several programs (atomic fp32 adds, then a cast) compute
    the same function; a split larger than K's tiles is clipped (no empty split adds zeros twice or reads past K).
    I = 112 with bk 32: a K tail (not EVEN_K) inside the last split. swap=1: the weight tile as the dot's first
    operand, every row of the call in one block (transposed accumulator, masks and stores)."""
    from blockpress.kernels import linear_q

    g = torch.Generator().manual_seed(M + I)
    lin = torch.nn.Linear(I, O, bias=False)
    lin.weight.copy_(torch.randn(O, I, generator=g) / I ** 0.5)
    m = QuantizedLinear.from_linear(lin.to(DEV), "int8", backend="torch")
    x = torch.randn(M, I, generator=g).to(DEV)
    ref = m(x)
    tiles = linear_q.as_linear_tiles(spec)
    assert linear_q.linear_tiles_spec(tiles) != linear_q.DEFAULT_LINEAR_SPEC
    out = linear_q_triton(x, m.weight_q, m.weight_scale, **tiles)
    assert out.dtype == x.dtype and out.shape == (M, O)
    assert _rel(out, ref) < 1e-5
    m.backend, m.tiles = "triton", tiles  # what kernels.select sets from the option: the module runs them
    again = m(x)  # a split K adds its parts atomically, in whatever order they finish: equal up to that order
    assert torch.equal(again, out) if tiles["split_k"] == 1 else _rel(again, out) < 1e-6


def test_linear_tile_specs_are_checked():
    from blockpress.kernels.linear_q import parse_linear_tiles

    assert parse_linear_tiles("bm=auto,bn=32,split=4") == {"block_m": None, "block_n": 32, "block_k": 64,
                                                            "num_warps": None, "split_k": 4, "swap": False}
    assert parse_linear_tiles("swap=1")["swap"] is True
    for bad, words in [("split=0", "split=0"), ("split=x", "not an integer"), ("bn=48", "powers of two"),
                       ("stages=3", "stages"), ("bx=4", "bad tile setting")]:
        with pytest.raises(ValueError, match=words):
            parse_linear_tiles(bad)


@needs_triton
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("M,I,O", [(1, 64, 80), (17, 96, 130), (100, 128, 64), (256, 72, 200)])
def test_triton_kernel_equals_the_torch_reference(fmt, dtype, tol, M, I, O):
    """Odd sizes on purpose: partial M, N and K tiles, a one-token row (the AR step)."""
    if fmt == "fp8" and not fp8_usable_on(DEV):
        pytest.skip("fp8 Triton kernels need sm_89+; fp8 linears take the torch path here")
    g = torch.Generator().manual_seed(M + I + O)
    lin = torch.nn.Linear(I, O, bias=False)
    lin.weight.copy_(torch.randn(O, I, generator=g) / I ** 0.5)
    lin = lin.to(DEV, dtype)
    m = QuantizedLinear.from_linear(lin, fmt, backend="torch")
    x = torch.randn(M, I, generator=g).to(DEV, dtype)
    ref = m(x)
    torch.testing.assert_close(ref, torch.nn.functional.linear(x, m.dequantize(dtype)))
    assert _rel(linear_q_triton(x, m.weight_q, m.weight_scale), ref) < tol
    m.backend = "triton"
    assert m.resolved_backend(x) == "triton"
    x3 = torch.randn(2, 5, 2 * I, generator=g).to(DEV, dtype)[..., ::2]  # 3-d, non-contiguous rows
    m.backend = "torch"
    ref3 = m(x3)
    m.backend = "triton"
    out3 = m(x3)
    assert out3.shape == (2, 5, O) and _rel(out3, ref3) < tol
    # the format's own error against the float layer, bounded
    assert _rel(ref, lin(x)) < {"int8": 1e-2, "fp8": 5e-2}[fmt] + (0 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fp8_w8a8_scaled_mm_equals_its_arithmetic(dtype, tol):
    """The scaled_mm backend (fp8 activations per row x fp8 weights) is the w8a8 arithmetic done in fp32 torch
    (torch._scaled_mm runs on a CPU too), and it is further from the float layer than weight-only fp8."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(96, 48, bias=False)
    lin.weight.copy_(torch.randn(48, 96, generator=g) / 10)
    m = QuantizedLinear.from_linear(lin.to(dtype), "fp8", backend="scaled_mm")
    x = torch.randn(3, 7, 96, generator=g).to(dtype)
    assert m.resolved_backend(x) == "scaled_mm"
    out = m(x)
    assert out.shape == (3, 7, 48) and out.dtype == dtype
    assert _rel(out, linear_fp8_w8a8_reference(x, m.weight_q, m.weight_scale)) < tol
    assert torch.equal(out, linear_fp8_scaled_mm(x, m.weight_q, m.weight_scale))
    m.backend = "torch"
    weight_only = m(x)
    assert _rel(weight_only, lin(x)) < _rel(out, lin(x)) < 0.08
    int8 = QuantizedLinear.from_linear(lin, "int8", backend="scaled_mm")
    assert int8.resolved_backend(x) == "torch"  # w8a8 needs fp8 weights: int8 keeps its weight-only paths


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("M,I,O,tiles", [(1, 64, 80, {}), (17, 96, 130, {}), (100, 128, 64, {"swap": True}),
                                         (40, 160, 72, {"split_k": 2}), (256, 72, 200, {"block_m": 128})])
def test_w8a8_kernel_equals_its_reference(dtype, tol, M, I, O, tiles):
    """The "w8a8" backend's kernel (each row quantised to fp8 by the experts' row kernel, then fp8 x fp8 dots, both
    scales on the fp32 accumulator) computes `linear_fp8_w8a8_reference` (fp32: up to the order of the sums; bf16:
    Triton's interpreter truncates the output cast), which torch._scaled_mm computes too; odd sizes on purpose."""
    if not fp8_usable_on(DEV):
        pytest.skip("fp8 Triton kernels need sm_89+; fp8 linears take the torch path here")
    g = torch.Generator().manual_seed(M + I + O)
    lin = torch.nn.Linear(I, O, bias=False)
    lin.weight.copy_(torch.randn(O, I, generator=g) / I ** 0.5)
    m = QuantizedLinear.from_linear(lin.to(DEV, dtype), "fp8", backend="w8a8")
    x = (torch.randn(M, I, generator=g) * torch.rand(M, 1, generator=g) * 4).to(DEV, dtype)  # rows of other scales
    ref = linear_fp8_w8a8_reference(x, m.weight_q, m.weight_scale)
    assert _rel(linear_fp8_scaled_mm(x, m.weight_q, m.weight_scale), ref) < max(tol, 1e-5)
    out = linear_q_triton(x, m.weight_q, m.weight_scale, act8=True, **tiles)
    assert _rel(out, ref) < tol
    # rows quantised already (a compiled block's path, `linear_a8`): the same kernel without its quantising launch
    xq, xs = quantize_rows_fp8(x)
    pre = linear_q_triton(xq, m.weight_q, m.weight_scale, x_scale=xs, out_dtype=dtype, **tiles)
    assert pre.dtype == dtype and torch.equal(pre, out)
    assert torch.equal(linear_a8(xq, xs, m.weight_q, m.weight_scale, dtype, "triton-a8", tiles, ""), pre)
    assert torch.equal(linear_a8(xq, xs, m.weight_q, m.weight_scale, dtype, "torch-a8", tiles, ""),
                       ref.reshape(M, O))
    with pytest.raises(ValueError, match="fp8 rows come with their scales"):
        linear_q_triton(xq, m.weight_q, m.weight_scale, out_dtype=dtype)
    assert m.resolved_backend(x) == ("triton-a8" if x.is_cuda else "torch-a8")
    if not x.is_cuda:  # a CPU runs the reference itself
        assert torch.equal(m(x), ref)
    m.backend = "triton-a8"  # the kernel by name: anywhere Triton runs
    x3 = torch.randn(2, 5, 2 * I, generator=g).to(DEV, dtype)[..., ::2]  # 3-d, non-contiguous rows
    out3 = m(x3)
    assert out3.shape == (2, 5, O) and _rel(out3, linear_fp8_w8a8_reference(x3, m.weight_q, m.weight_scale)) < tol
    m.backend = "torch"  # weight-only fp8 is closer to the float layer than fp8 activations
    assert _rel(m(x), lin.to(DEV, dtype)(x)) < _rel(ref, lin(x)) < 0.1
    int8 = QuantizedLinear.from_linear(lin, "int8", backend="w8a8")
    assert int8.resolved_backend(x) == int8.resolved_backend(x.new_empty(0)) == ("triton" if x.is_cuda else "torch")
    with pytest.raises(ValueError, match="fp8 activations.*needs fp8 weights"):
        linear_q_triton(x, int8.weight_q, int8.weight_scale, act8=True)


def test_fp8_activations_reach_fp8_projections_beside_any_experts():
    """experts="w8a8" means fp8 activations wherever the weights are fp8: fp8 experts and fp8 projections take them,
    int8 projections and int4 / float experts keep their weight-only kernels; without any fp8 weight it is refused."""
    m = _tiny()
    choice = configure(m, experts="w8a8", precision="fp8", linears="fp8")
    assert choice["experts"] == "torch-a8" and choice["linears"] == "fp8 torch-a8"
    assert all(q.backend == "w8a8" for q in m.modules() if isinstance(q, QuantizedLinear))
    m4 = _tiny()
    choice = configure(m4, experts="w8a8", precision="int4", group_size=32, linears="fp8")
    assert choice["linears"] == "fp8 torch-a8" and "a8" not in choice["experts"]
    assert {m4.layers[0].experts.backend} == {"auto"}
    from blockpress.kernels import use

    use(m4, experts="w8a8")  # changing the experts' kernel by name resolves it as configure does
    assert m4.layers[0].experts.backend == "auto"
    choice = configure(_tiny(), experts="w8a8", linears="fp8")  # float experts: their "auto" kernel
    assert choice["linears"] == "fp8 torch-a8" and choice["experts"] in ("grouped", "dense")
    with pytest.raises(ValueError, match="need fp8 weights; add --precision fp8 and / or --linears fp8"):
        configure(_tiny(), experts="w8a8", precision="int4", group_size=32, linears="int8")
    with pytest.raises(ValueError, match="need fp8 weights"):
        configure(_tiny(), experts="w8a8")
    m8 = _tiny()
    assert configure(m8, experts="w8a8", precision="fp8", linears="int8")["linears"] == "int8 torch"


@needs_triton
def test_a_decoder_pass_with_the_w8a8_linear_kernel_equals_its_reference():
    """fp32: a prompt encoded and a canvas decoded with fp8 projections and fp8 activations through the Triton kernel
    (the interpreter on a CPU) give the logits of the same arithmetic in torch ("torch-a8") up to the order of the
    fp32 sums: a last-bit difference can move an activation across an fp8 rounding boundary, one quantum of 2^-3,
    so the bound is relative to what fp8 activations change against weight-only fp8, not bit for bit (seeded
    generations of the tiny model drift apart after a few steps for that reason)."""
    if not fp8_usable_on(DEV):
        pytest.skip("fp8 Triton kernels need sm_89+")
    m = _tiny(seed=3).to(DEV)
    configure(m, experts="grouped" if DEV.type == "cpu" else "auto", linears="fp8")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 512, (2, 12), generator=g).to(DEV)
    canvas = torch.randint(5, 512, (2, 16), generator=g).to(DEV)

    def logits(backend):
        for mod in m.modules():
            if isinstance(mod, QuantizedLinear):
                mod.backend = backend
        cache = m.new_cache(2, 64)
        m.encode(ids, cache, output=False)
        return m.decode(canvas, cache)

    ref, kernel, weight_only = logits("torch-a8"), logits("triton-a8"), logits("torch")
    assert _rel(kernel, ref) < 1e-3 < _rel(weight_only, ref)
    assert _rel(kernel, ref) < _rel(weight_only, ref) / 20


def test_module_swap_touches_only_the_projections_and_counts_bytes():
    m = _tiny()
    before = {n: p.clone() for n, p in m.named_parameters()}
    configure(m, experts="loop", linears="int8")
    swapped = {n for n, mod in m.named_modules() if isinstance(mod, QuantizedLinear)}
    want = {f"layers.{i}.{part}.{name}" for i, layer in enumerate(m.layers) for part, names in QUANTIZED_LINEARS.items()
            for name in names if getattr(getattr(layer, part), name, None) is not None}
    assert swapped == want and len(want) > 0
    assert any(getattr(layer.self_attn, "v_proj") is None for layer in m.layers)  # full layers: k = v, nothing to swap
    after = dict(m.named_parameters())
    for n, p in after.items():  # router, embeddings, norms, experts, self-conditioning untouched
        assert torch.equal(p, before[n]), n
    assert set(before) - set(after) == {f"{n}.weight" for n in want}
    assert all(mod.backend == "torch" for mod in m.modules() if isinstance(mod, QuantizedLinear))  # "loop": references
    from blockpress.lab.roofline import weight_groups
    from blockpress.loading import estimated_weight_bytes

    g = weight_groups(m)
    with torch.device("meta"):
        meta = type(m)(m.config)
    q_bytes = sum(mod.weight_bytes() for mod in m.modules() if isinstance(mod, QuantizedLinear))
    assert estimated_weight_bytes(meta, torch.float32, linears="int8") == q_bytes + sum(
        p.numel() * p.element_size() for p in m.parameters())
    assert g["attention"] + g["dense_mlp"] == q_bytes + sum(
        p.numel() * 4 for n, p in m.named_parameters() if ".self_attn." in n and not n.endswith("norm.weight"))


def test_fp8_linears_through_configure_and_the_reference_flag():
    m = _tiny()
    choice = configure(m, experts="loop", linears="fp8")
    qs = [mod for mod in m.modules() if isinstance(mod, QuantizedLinear)]
    assert qs and all(q.fmt == "fp8" and q.weight_q.dtype == torch.float8_e4m3fn and q.backend == "torch" for q in qs)
    assert choice["linears"] == "fp8 torch"
    assert configure(m, linears="int8")["linears"] == "fp8 torch"  # a module that holds 8-bit linears keeps them
    assert all(q.backend == "auto" for q in qs)  # "auto": the Triton kernel on a GPU, the reference here
    with pytest.raises(ValueError, match="unknown linears format 'int4'"):
        configure(m, linears="int4")


def test_estimate_of_the_real_model():
    from blockpress.lab.presets import preset_config
    from blockpress.config import ModelConfig
    from blockpress.loading import estimated_weight_bytes
    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    with torch.device("meta"):
        m = DiffusionGemmaModel(ModelConfig.from_dict(preset_config("real-26b")[0]))
    native = estimated_weight_bytes(m, torch.bfloat16, "int4")
    int8 = estimated_weight_bytes(m, torch.bfloat16, "int4", linears="int8")
    assert native / 1e9 == pytest.approx(16.96, abs=0.01)
    assert (native - int8) / 1e9 == pytest.approx(1.64, abs=0.01)  # 3.29 GB of bf16 projections, halved


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_generation_with_the_kernel_equals_the_reference_and_graph_plumbing():
    """fp32, seeded: the Triton int8 linears (the interpreter on CPU, compiled on a GPU) give the reference's tokens,
    also through the fixed-shape passes CUDA graphs capture (no capture here)."""
    from blockpress.config import GenerationConfig
    from blockpress.engine.generate import generate
    from blockpress.engine.graphs import GraphedPasses

    m = _tiny(seed=3).to(DEV)
    configure(m, experts="grouped", linears="int8")
    ids = torch.randint(5, 512, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEV)
    cfg = GenerationConfig.resolve(max_new_tokens=32, max_denoising_steps=3, stability_threshold=None,
                                   confidence_threshold=None)

    def tokens(passes=None):
        torch.manual_seed(0)
        return generate(m, ids, cfg, m.config.canvas_length, passes=passes).sequences

    for mod in m.modules():
        if isinstance(mod, QuantizedLinear):
            mod.backend = "torch"
    ref = tokens()
    for mod in m.modules():
        if isinstance(mod, QuantizedLinear):
            mod.backend = "triton"
            assert mod.resolved_backend(ids) == "triton"

    def same(seq):  # a GPU's fp32 kernel may sum in another order than cuBLAS: a near-tie may go the other way
        return torch.equal(seq, ref) if not COMPILED else float((seq == ref).float().mean()) >= 0.95

    assert same(tokens())
    assert same(tokens(GraphedPasses(m, capture=False)))


def test_load_quantises_while_loading_and_refuses_what_it_cannot_do(tmp_path):
    from blockpress.train import sizes

    folder = tmp_path / "m"
    blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0).save(folder)
    streamed = blockpress.load(folder, progress=False, precision="int4", group_size=16, linears="int8")
    after = blockpress.load(folder, progress=False, precision="int4", group_size=16)
    quantize_linears_(after.module)
    sa, sb = streamed.module.state_dict(), after.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(k.endswith("q_proj.weight_q") for k in sa)
    ids = torch.randint(5, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, max_denoising_steps=3)
    gen = torch.Generator(streamed.device)
    assert torch.equal(streamed.generate(ids, generator=gen.manual_seed(1), **kw).sequences,
                       after.generate(ids, generator=gen.manual_seed(1), **kw).sequences)
    with pytest.raises(blockpress.InputError, match="unknown linears format 'int4'"):
        blockpress.load(folder, progress=False, linears="int4")


def test_memory_refusal_offers_int8_linears(tmp_path, monkeypatch):
    from blockpress import loading
    from blockpress.train import sizes

    folder = tmp_path / "m"
    blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0).save(folder)
    monkeypatch.setattr(loading, "_free_bytes", lambda device: 1000)
    with pytest.raises(blockpress.InputError, match="precision int4 with int8 linears needs") as e:
        blockpress.load(folder, progress=False)
    assert "--linears" in str(e.value)


def test_lora_adapter_runs_beside_int8_linears_and_merge_is_refused(tmp_path):
    from blockpress.train import lora as L
    from blockpress.train import sizes

    folder = tmp_path / "m"
    lm = blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0)
    lm.save(folder)
    L.add_lora(lm.module, L.LoraSpec(rank=2, alpha=4))
    for n, p in lm.module.named_parameters():
        if "lora_B" in n:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.5)
    L.save_adapter(lm.module, tmp_path / "adapter", L.LoraSpec(rank=2, alpha=4))
    ids = torch.randint(5, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    canvas = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))

    def logits(model):  # on the model's device (load's default: a GPU where there is one)
        cache = model.module.new_cache(1, 6)
        model.module.encode(ids.to(model.device), cache)
        return model.module.decode(canvas.to(model.device), cache).cpu()

    base = blockpress.load(folder, progress=False, linears="int8")
    plain = logits(base)
    names = L.apply_adapter(base, tmp_path / "adapter")
    assert names and all(isinstance(base.module.get_submodule(n), QuantizedLinear) for n in names)
    with_adapter = logits(base)
    float_base = blockpress.load(folder, progress=False)
    L.apply_adapter(float_base, tmp_path / "adapter")
    want = logits(float_base)
    assert _rel(with_adapter, want) < _rel(plain, want) / 10  # the adapter's effect is there, int8 error aside
    again = blockpress.load(folder, progress=False, linears="int8")
    with pytest.raises(blockpress.InputError, match="cannot be merged"):
        L.apply_adapter(again, tmp_path / "adapter", merge=True)
    assert not any(hasattr(mod, "lora_A") for mod in again.module.modules())  # refused before any change
    mlp4 = blockpress.load(folder, progress=False, linears="int4-mlp", group_size=16)  # no MLP projections left
    with pytest.raises(blockpress.InputError, match="dense MLP in int4 .* --linears native or int8"):
        L.apply_adapter(mlp4, tmp_path / "adapter")
    assert not any(hasattr(mod, "lora_A") for mod in mlp4.module.modules())
    # training adapters beside the 8-bit projections (QLoRA, tests/test_qlora.py) attaches them, unmerged
    added = L.add_lora(again.module, L.LoraSpec(rank=2, alpha=4))
    assert added and all(isinstance(again.module.get_submodule(n), QuantizedLinear) for n in added)


def test_cli_run_with_int8_linears_and_int4_experts(capsys):
    import json

    from blockpress.cli import main as cli_main
    from blockpress.cli.run import EXAMPLE_SUDOKU

    assert cli_main(["run", "sudoku", EXAMPLE_SUDOKU, "--precision", "int4", "--linears", "int8", "--json",
                     "--seed", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clues_kept"] == 1.0 and len(out["answer"]) == 81


@pytest.mark.gpu
def test_int8_linear_kernel_compiled_on_cuda():
    if triton is None:
        pytest.skip("needs triton")
    g = torch.Generator().manual_seed(0)
    for fmt in ("int8", "fp8"):
        for M, I, O in ((1, 2816, 4096), (256, 2816, 2112), (512, 2112, 2816), (1024, 4096, 2816)):
            lin = torch.nn.Linear(I, O, bias=False)
            lin.weight.copy_(torch.randn(O, I, generator=g) / I ** 0.5)
            m = QuantizedLinear.from_linear(lin.cuda().bfloat16(), fmt, backend="torch")
            x = torch.randn(M, I, generator=g).cuda().bfloat16()
            assert _rel(linear_q_triton(x, m.weight_q, m.weight_scale), m(x)) < 1e-2
            if fmt == "fp8" and torch.cuda.get_device_capability() >= (8, 9):  # fp8 tensor cores: w8a8
                w8a8 = linear_fp8_scaled_mm(x, m.weight_q, m.weight_scale)
                assert _rel(w8a8, linear_fp8_w8a8_reference(x, m.weight_q, m.weight_scale)) < 1e-2


# ------------------------------------------------------------------------------------ the int8 embedding table

def _nano_folder(tmp_path):
    from blockpress.train import sizes

    return blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16),
                                  seed=0).save(tmp_path / "m")


def _decode_logits(lm, ids, canvas):
    cache = lm.module.new_cache(ids.shape[0], ids.shape[1])
    lm.module.encode(ids, cache)
    return lm.module.decode(canvas, cache).float()


def test_int8_embeddings_are_the_model_with_the_dequantised_table(tmp_path, monkeypatch):
    """embeddings="int8": the lookup, the LM head and the self-conditioning soft embedding all read the int8 table
    (QuantizedEmbedding), and together compute what the float model computes with that table dequantised: the same
    logits up to fp32 rounding (the soft embedding applies each row's scale to its probability), the same tokens. Streaming it while loading gives the table quantising after gives; the weight estimate counts
    it; saving and sc_topk are refused with one line each."""
    from blockpress.kernels.linear_q import QuantizedEmbedding, quantize_embeddings_
    from blockpress.loading import estimated_weight_bytes

    folder = _nano_folder(tmp_path)
    q = blockpress.load(folder, progress=False, embeddings="int8")
    table = q.module.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.weight_q.dtype == torch.int8
    assert q.options.embeddings == "int8" and q.module.dtype == torch.float32
    ref = blockpress.load(folder, progress=False)
    ref.module.embed_tokens.weight.copy_(table.dequantize(torch.float32))
    ids = torch.randint(5, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    canvas = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_decode_logits(q, ids, canvas), _decode_logits(ref, ids, canvas), rtol=1e-5,
                               atol=1e-5)
    kw = dict(max_new_tokens=16, max_denoising_steps=4)
    heads = []
    monkeypatch.setattr(QuantizedEmbedding, "head", lambda self, h, rows=slice(None): heads.append(rows) or
                        self.linear_with(h, self.weight_q[rows], self.weight_scale[rows]))
    for engine, part_bytes in (({}, None), (dict(sampler="fast", cuda_graphs=True, fuse_commit=True), None),
                               (dict(sampler="exact", cuda_graphs=True), 4096)):
        if part_bytes:  # the LM head into the graphs' logits buffer in vocabulary slices, as on the 26B model
            monkeypatch.setattr("blockpress.model.diffusion_gemma.LM_HEAD_PART_BYTES", part_bytes)
        q.configure(**engine)
        ref.configure(**engine)
        assert torch.equal(q.generate(ids, generator=torch.Generator().manual_seed(2), **kw).sequences,
                           ref.generate(ids, generator=torch.Generator().manual_seed(2), **kw).sequences), engine
    assert slice(None) in heads and any(r.start for r in heads)  # whole products and slices both ran
    after = quantize_embeddings_(blockpress.load(folder, progress=False).module)
    sa, sb = q.module.state_dict(), after.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.device("meta"):
        meta = type(q.module)(q.module.config)
    held = sum(t.numel() * t.element_size() for t in [*q.module.parameters(), *q.module.buffers()]
               if t.device.type != "meta")
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    assert estimated_weight_bytes(meta, torch.float32, embeddings="int8") + buffers == held
    with pytest.raises(blockpress.InputError, match="holds its embedding table in int8"):
        q.save(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    with pytest.raises(blockpress.InputError, match="sc_topk .* with embeddings='int8' use exact"):
        blockpress.load(folder, progress=False, embeddings="int8", sc_topk=8)
    with pytest.raises(blockpress.InputError, match=r"configure\(embeddings='native'\): the storage precision is "
                                                    "chosen at load"):
        q.configure(embeddings="native")  # (the table stays int8: the options would say otherwise)
    with pytest.raises(blockpress.InputError, match="unknown embeddings format 'int4'"):
        blockpress.load(folder, progress=False, embeddings="int4")


def test_the_soft_embedding_in_table_slices_sums_their_products(monkeypatch):
    """A table larger than a slice: its products over vocabulary slices, summed in fp32, are the one product."""
    from blockpress.kernels import linear_q
    from blockpress.kernels.linear_q import QuantizedEmbedding

    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Embedding(1000, 48)
    emb.weight.copy_(torch.randn(1000, 48, generator=g))
    table = QuantizedEmbedding.from_embedding(emb)
    probs = torch.softmax(torch.randn(3, 5, 1000, generator=g) * 3, -1)
    whole = probs @ table.dequantize(torch.float32)
    monkeypatch.setattr(linear_q, "SOFT_SLICE_BYTES", 48 * 4 * 128)  # 128 rows a slice: 8 slices
    sliced = table.soft(probs)
    assert sliced.shape == (3, 5, 48) and not torch.equal(sliced, whole)  # summed otherwise...
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-6)  # ...the same product
    lookup = table(torch.tensor([[0, 999], [5, 5]]))
    assert torch.equal(lookup, table.dequantize(torch.float32)[torch.tensor([[0, 999], [5, 5]])])


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_int8_lm_head_through_the_triton_kernel_equals_the_torch_reference(dtype, tol):
    """The LM head of an int8 table is the int8 linear kernel over a slice of the vocabulary."""
    from blockpress.kernels.linear_q import QuantizedEmbedding

    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(300, 64).to(DEV, dtype)
    emb.weight.copy_(torch.randn(300, 64, generator=g).to(DEV, dtype))
    table = QuantizedEmbedding.from_embedding(emb)
    h = torch.randn(2, 9, 64, generator=g).to(DEV, dtype)
    table.backend = "torch"
    ref = table.head(h, slice(40, 290))
    torch.testing.assert_close(ref, torch.nn.functional.linear(h, table.dequantize(dtype)[40:290]))
    table.backend = "triton"
    assert table.resolved_backend(h) == "triton" and _rel(table.head(h, slice(40, 290)), ref) < tol


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("V,H,rows", [(300, 72, 9), (1000, 48, 40)])
def test_the_int8_soft_embedding_through_the_triton_kernel_equals_the_reference(dtype, tol, V, H, rows):
    """The soft embedding on a GPU: the int8 kernel reading the table down its columns (a transposed view) with each
    token's scale on its probability, against the torch reference in table slices."""
    from blockpress.kernels.linear_q import QuantizedEmbedding

    g = torch.Generator().manual_seed(V + H)
    emb = torch.nn.Embedding(V, H)
    emb.weight.copy_(torch.randn(V, H, generator=g) * torch.logspace(-2, 1, V)[:, None])
    table = QuantizedEmbedding.from_embedding(emb.to(DEV, dtype))
    probs = torch.softmax(torch.randn(rows, V, generator=g) * 4, -1).to(DEV, dtype)
    ref = table.soft_slices(probs)
    torch.testing.assert_close(ref.float(), (probs.float() @ table.dequantize(torch.float32)),
                               rtol=tol, atol=tol * float(ref.abs().max()))
    table.backend = "triton"
    out = table.soft(probs)
    assert out.shape == (rows, H) and out.dtype == dtype and _rel(out, ref) < tol
    with torch.enable_grad():  # a gradient through the probabilities: the reference (the kernel has no backward)
        p = probs.clone().requires_grad_()
        table.soft(p).float().sum().backward()
    assert p.grad is not None and p.grad.shape == probs.shape
