"""kernels/compiled.py: the opt-in torch.compile of the decoder blocks computes what the eager blocks compute, as one
graph per block (the kernels are custom ops: kernels/library.py, quant.py, linear_q.py)."""

import copy

import pytest
import torch

from blockpress import kernels
from blockpress.lab.presets import preset_config
from blockpress.config import GenerationConfig
from blockpress.engine import generate as engine
from blockpress.kernels.library import experts_op, float_experts
from blockpress.kernels.linear_q import linear_q_op, quantize_int8_rows
from blockpress.kernels.moe_grouped import experts_grouped
from blockpress.kernels.quant import dequantize_int4, quantize_int4, quantized_experts_op
from blockpress.lab.random_weights import build_model
from blockpress.model.moe import experts_loop

from kernel_device import DEV, needs_triton

import torch._dynamo  # noqa: E402  (after blockpress: it sets Triton's mode before torch's compiler imports Triton)
from torch._dynamo.utils import counters  # noqa: E402

pytestmark = pytest.mark.no_grad


def _model(linears="native", precision="native", experts="grouped", layers=2, dev=torch.device("cpu")):
    cfg = copy.deepcopy(preset_config("tiny")[0])
    cfg["text_config"].update(num_hidden_layers=layers,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    m = build_model(cfg, dev, torch.float32, "native", 0, 0.02, 64)
    kernels.configure(m, experts=experts, attention="sdpa_gqa", linears=linears, precision=precision, group_size=32)
    return m


def _inputs(m):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, m.text.vocab_size, (2, 21), generator=g)  # a sliding window of 8: the ring wraps
    x = torch.randint(0, m.text.vocab_size, (2, m.config.canvas_length), generator=g)
    return ids.to(m.device), x.to(m.device)


def _steps(m, ids, x, fused=False):
    """Denoising steps with and without self-conditioning after an (eager) prompt pass; with fused, a commit fused
    into the next step too."""
    C = m.config.canvas_length
    cache = m.new_cache(ids.shape[0], ids.shape[1] + 3 * C)
    m.encode(ids, cache)
    z = m.decode(x, cache)
    out = [z, m.decode(x.flip(-1), cache, z)]
    if fused:
        out.append(m.encode_decode(x, x.flip(-1), cache, sc_logits=out[1]))
    return out


def _close(got, want):
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # fp32 reassociation only


def test_compiled_blocks_equal_the_eager_blocks_and_unwrap_bit_for_bit():
    m = _model()
    ids, x = _inputs(m)
    want = _steps(m, ids, x)
    assert kernels.configure(m, experts="grouped", attention="sdpa_gqa", compile=True)["compiled_blocks"]
    assert m.ops.block is not None
    _close(_steps(m, ids, x), want)
    kernels.configure(m, experts="grouped", attention="sdpa_gqa")
    assert m.ops.block is None
    assert not any("forward" in vars(mod) for layer in m.layers for mod in layer.modules())  # nothing replaced
    assert all(torch.equal(a, b) for a, b in zip(_steps(m, ids, x), want))  # eager again


@pytest.mark.slow
def test_compiled_blocks_through_a_generation_the_fused_commit_and_the_profiler():
    """Prefill, steps and commits of a generation (more shapes: more compiles, ~1-2 min on 2 cores), the fused
    commit pass, and the profiler's ranges, which must leave the experts outside the compiled graph."""
    from blockpress.lab.profile import profile_steps

    m = _model(linears="int8")  # 8-bit projections: a custom op in the graph, like the experts
    ids, x = _inputs(m)
    want = _steps(m, ids, x, fused=True)
    kernels.configure(m, experts="grouped", attention="sdpa_gqa", linears="int8", compile=True)
    _close(_steps(m, ids, x, fused=True), want)
    cfg = GenerationConfig(max_new_tokens=2 * m.config.canvas_length, max_denoising_steps=3,
                           stability_threshold=None, confidence_threshold=None)
    res = engine.generate(m, ids, cfg, m.config.canvas_length, generator=torch.Generator().manual_seed(1))
    assert res.sequences.shape == (2, ids.shape[1] + 2 * m.config.canvas_length)
    p = profile_steps(m, ids, cfg, m.config.canvas_length)
    assert p["steps_profiled"] == 2 and not any("forward" in vars(layer.experts) for layer in m.layers)
    # the ranges inside a compiled block are traced away: the parts come from the kernels' classes instead
    assert p["by_part_ms"]["experts"] == p["by_class_ms"]["experts"] > 0


@pytest.mark.slow
def test_compiled_blocks_under_the_graphs_fixed_shape_passes_give_the_eager_tokens():
    """The fixed-shape passes CUDA graphs capture (run here without capture) on compiled blocks: a seeded generation
    gives the tokens of the eager model (fp32 differences of ~1e-6 leave the draws alone on this model)."""
    from blockpress.engine.graphs import GraphedPasses

    m = _model()
    ids, _ = _inputs(m)
    cfg = GenerationConfig(max_new_tokens=2 * m.config.canvas_length, max_denoising_steps=3,
                           stability_threshold=None, confidence_threshold=None)
    want = engine.generate(m, ids, cfg, m.config.canvas_length, generator=torch.Generator().manual_seed(1))
    kernels.configure(m, experts="grouped", attention="sdpa_gqa", compile=True)
    graphs = GraphedPasses(m, capture=False, copy_outputs=False)
    got = engine.generate(m, ids, cfg, m.config.canvas_length, generator=torch.Generator().manual_seed(1),
                          passes=graphs)
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("precision,linears,experts", [("native", "native", "grouped"), ("fp8", "fp8", "w8a8"),
                                                       pytest.param("int4", "int8", "triton",
                                                                    marks=[needs_triton, pytest.mark.slow])])
def test_a_compiled_block_is_one_graph_without_breaks_in_the_fixed_shape_pass(precision, linears, experts):
    """The fixed-shape denoising pass (what CUDA graphs capture) on compiled blocks: one graph per kind of layer
    (sliding, full) however many layers there are (no recompile per layer: the 26B model has 30), no graph break
    (the experts and 8-bit projections are custom ops, not skipped frames), and the eager logits."""
    m = _model(linears, precision, experts, layers=4, dev=DEV if experts == "triton" else torch.device("cpu"))
    routing = "triton" if experts == "triton" else "torch"  # the routing kernel (a GPU's choice) as well
    kernels.use(m, routing=routing)
    ids, x = _inputs(m)
    cache = m.new_cache(ids.shape[0], ids.shape[1] + 2 * m.config.canvas_length)
    m.encode(ids, cache)  # eager: the span passes' host-position attention breaks graphs by design
    start = torch.tensor(cache.length, device=m.device)
    want = m.decode(x, cache, start=start)
    kernels.configure(m, experts=experts, attention="sdpa_gqa", linears=linears, precision=precision, compile=True)
    kernels.use(m, routing=routing)
    assert kernels.kernel_names(m)["routing"] == routing
    torch._dynamo.reset()
    counters.clear()
    got = m.decode(x, cache, start=start)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # Block.forward for a sliding and a full layer, 4 layers
    _close([got], [want])


def test_a_compiled_block_starts_with_its_projection_its_input_norm_made_by_the_block_before():
    """Each block's input norm is computed by the block before it (the first's before the loop, the final norm by
    the last block), in the kernel that makes the residual it normalises: a compiled block's first launch is its
    q/k/v projection, with no norm kernel of its own before it (30 launches fewer a pass on the 26B model). Still
    one graph per kind of layer, and the eager numbers: a canvas's logits, a fused commit's, and the K/V an
    encoder pass that stops at the last layer writes with the norm handed to it."""
    from torch._inductor.utils import run_and_get_code

    m = _model(layers=4)
    ids, x = _inputs(m)
    C = m.config.canvas_length
    cache = m.new_cache(ids.shape[0], ids.shape[1] + 3 * C)
    m.encode(ids, cache)
    T = cache.length
    start = torch.tensor(T, device=m.device)
    want = [m.decode(x, cache, start=start), m.encode_decode(x, x.flip(-1), cache, start=start)]
    m.encode(x, cache, start=start, output=False)
    want_kv = [k[:, :, T:T + C].clone() for k in cache.keys]
    kernels.configure(m, experts="grouped", attention="sdpa_gqa", compile=True)
    torch._dynamo.reset()
    counters.clear()
    got, code = run_and_get_code(lambda: m.decode(x, cache, start=start))
    assert counters["stats"]["unique_graphs"] == 2  # sliding and full: not one more for the first or last block
    for call in (c[c.index("def call("):] for c in code):
        first_mm = call.index("extern_kernels.mm(")
        assert "cpp_fused" in call[first_mm:] and "cpp_fused" not in call[:first_mm]
    torch._dynamo.reset()
    _close([got, m.encode_decode(x, x.flip(-1), cache, start=start)], want)
    for k in cache.keys:
        k[:, :, T:T + C] = 0.0
    assert m.encode(x, cache, start=start, output=False) is None
    _close([k[:, :, T:T + C] for k in cache.keys], want_kv)


def _routing(N=6, E=4, K=2, H=32, Im=16, seed=0, dev=torch.device("cpu")):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g)
    out = x, w / w.sum(-1, keepdim=True), idx, torch.randn(E, 2 * Im, H, generator=g) / 8, \
        torch.randn(E, H, Im, generator=g) / 8
    return tuple(t.to(dev) for t in out)


@pytest.mark.parametrize("kernel", ["grouped", pytest.param("triton", marks=needs_triton)])
def test_the_experts_op_is_its_kernel_and_passes_opcheck(kernel):
    """The custom op a compiled block calls gives its kernel's numbers bit for bit, the reference's up to fp32
    summation order; opcheck: schema, fake tensor (shape, dtype) and the traced op agree with the real one."""
    args = _routing(dev=DEV if kernel == "triton" else torch.device("cpu"))  # compiled Triton: CUDA tensors
    got = experts_op(*args, kernel=kernel, tiles="bm=16", moe_sum="kernel")
    fn = float_experts(kernel, "bm=16")
    assert torch.equal(got, fn(*args))
    torch.testing.assert_close(got, experts_loop(*args), rtol=1e-5, atol=1e-5)
    assert torch.equal(experts_op(*args, kernel="grouped", tiles="", moe_sum="kernel"), experts_grouped(*args))
    torch.library.opcheck(experts_op, (*args, kernel, "bm=16", "kernel"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_the_quantized_ops_are_their_modules_and_pass_opcheck():
    x, w, idx, gu, dn = _routing()
    (gq, gs), (dq, ds) = quantize_int4(gu, 16), quantize_int4(dn, 16)  # (opcheck's schema check cannot read fp8)
    qargs = (x, w, idx, gq, gs, dq, ds, "int4", torch.float32, [16, 16], "torch", "bm=auto", "kernel")
    ref = experts_loop(x, w, idx, dequantize_int4(gq, gs, torch.float32), dequantize_int4(dq, ds, torch.float32))
    torch.testing.assert_close(quantized_experts_op(*qargs), ref, rtol=1e-5, atol=1e-5)
    q, s = quantize_int8_rows(gu[0])
    largs = (x[None], q, s, "int8", "torch", "bm=auto,bn=64,bk=64")
    assert torch.equal(linear_q_op(*largs), torch.nn.functional.linear(x[None], q.float() * s[:, None]))
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(quantized_experts_op, qargs, test_utils=tests)
    torch.library.opcheck(linear_q_op, largs, test_utils=tests)


def test_w8a8_projections_quantise_their_rows_inside_the_compiled_kernels():
    """Compiled, the fp8 projections and experts with fp8 activations (experts="w8a8") quantise their rows in traced
    torch and call their ops (`linear_a8_op`, `quantized_experts_op` with the tokens' scales) on them: the compiler
    folds the quantisation into the kernels that made the rows (the norms, the MLP's activation), so a block has no
    more kernels than with weight-only fp8, no quantising launch of its own per projection; the logits are the eager
    ones (the eager path quantises the same way)."""
    from torch._inductor.utils import run_and_get_code

    from blockpress.kernels.linear_q import linear_a8_op, w8a8_product
    from blockpress.kernels.quant import quantize_rows_fp8

    code, logits = {}, {}
    for experts in ("grouped", "w8a8"):
        m = _model("fp8", "fp8", experts)
        ids, x = _inputs(m)
        cache = m.new_cache(ids.shape[0], ids.shape[1] + 2 * m.config.canvas_length)
        m.encode(ids, cache)
        start = torch.tensor(cache.length, device=m.device)
        want = m.decode(x, cache, start=start)
        kernels.configure(m, experts=experts, attention="sdpa_gqa", linears="fp8", precision="fp8", compile=True)
        torch._dynamo.reset()
        logits[experts], code[experts] = run_and_get_code(lambda: m.decode(x, cache, start=start))
        _close([logits[experts]], [want])
    a8, w8 = "\n".join(code["w8a8"]), "\n".join(code["grouped"])
    assert "blockpress.linear_a8" in a8 and "blockpress.linear_q" not in a8 and "blockpress.linear_q" in w8
    # no more kernels than weight-only fp8 (fewer here: the experts' quantised tokens replace the norm's output)
    assert 0 < a8.count("async_compile.cpp_pybinding") <= w8.count("async_compile.cpp_pybinding")
    assert "blockpress.quantized_experts" in a8
    # the op: the product of the rows it is given; its fake gives the shape and dtype (fp8 inputs: opcheck's schema
    # test cannot run, it multiplies them on a CPU)
    g = torch.Generator().manual_seed(0)
    xq, xs = quantize_rows_fp8(torch.randn(5, 32, generator=g))
    q, s = quantize_rows_fp8(torch.randn(16, 32, generator=g))
    args = (xq, xs, q, s, torch.float32, "w8a8", "bm=auto,bn=64,bk=64")
    assert torch.equal(linear_a8_op(*args), w8a8_product(xq, xs, q, s, torch.float32))
    torch.library.opcheck(linear_a8_op, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_a_span_pass_refuses_to_be_traced():
    """Span passes (host positions) stay eager: traced, they gave wrong numbers in torch 2.13, so `Spans` raises
    under torch.compile instead of computing."""
    m = _model()
    ids, _ = _inputs(m)
    cache = m.new_cache(ids.shape[0], ids.shape[1] + m.config.canvas_length)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="span pass"):
        torch.compile(lambda i: m.encode(i, cache), backend="eager", fullgraph=True)(ids)
    torch._dynamo.reset()


def test_block_kernels_counts_the_launches_a_gpu_would_run():
    """benchmarks/block_kernels.py (in its own process: it writes Triton for a GPU, which the interpreter mode of
    this one would not): each compiled block graph's launches, read from the Triton code inductor generates, start
    with the q/k/v projection (the input norm carried in from the block before) and hold the block's five GEMMs and
    three custom ops."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "block_kernels.py"
    r = subprocess.run([sys.executable, str(script), "--preset", "tiny"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    graphs = json.loads(r.stdout.strip().splitlines()[-1])["graphs"]
    assert len(graphs) == 2  # a sliding and a full layer
    for ls in graphs:
        assert ls[0] == "extern_kernels.mm" and ls.count("extern_kernels.mm") == 5
        assert sorted(x for x in ls if x.startswith("torch.ops")) == [
            "torch.ops.blockpress.fixed_attention", "torch.ops.blockpress.quantized_experts", "torch.ops.blockpress.route"]
        assert 0 < sum(x.startswith("triton_") for x in ls) <= 5


_PROBE = '''
import sys, torch
if sys.argv[1] == "before":
    @torch.library.custom_op("bp_probe::f", mutates_args=())
    def f(x: torch.Tensor, split: int = 1) -> torch.Tensor:
        return x * 2
else:  # an upgrade changed the op's arguments (as the attention op's split became tiles)
    @torch.library.custom_op("bp_probe::f", mutates_args=())
    def f(x: torch.Tensor, tiles: str = "") -> torch.Tensor:
        return x * 2
f.register_fake(lambda x, *a: torch.empty_like(x))
if sys.argv[2] == "tagged":
    from blockpress.kernels.compiled import ops_cache_tag, tag_compile_cache
    tag_compile_cache(ops_cache_tag("bp_probe"))
print(torch.compile(lambda x: f(x + 1) * 3)(torch.ones(4)).sum().item())
'''


@pytest.mark.slow
@pytest.mark.parametrize("tagged", [False, True])
def test_an_op_whose_arguments_changed_compiles_again_rather_than_running_stale_code(tmp_path, tagged):
    """torch.compile's disk cache, shared by two processes: the first compiles a graph calling an op at its default
    argument, the second has the op with another argument. Untagged, the second reuses the first's code, which names
    the old argument: it fails (the bug `compiled_block`'s tag fixes). Tagged with the ops' schemas, it compiles again
    (~40 s: four processes, two compiles)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    runs = [subprocess.run([sys.executable, str(script), version, "tagged" if tagged else "plain"], env=env,
                           capture_output=True, text=True, timeout=300) for version in ("before", "after")]
    assert runs[0].returncode == 0 and runs[0].stdout.strip() == "48.0", runs[0].stderr[-2000:]
    if tagged:
        assert runs[1].returncode == 0 and runs[1].stdout.strip() == "48.0", runs[1].stderr[-2000:]
    else:
        assert runs[1].returncode != 0 and "Unknown keyword argument 'split'" in runs[1].stderr


def test_the_compile_cache_is_keyed_by_the_ops_schemas():
    """`compiled_block` adds a hash of blockpress's op schemas to torch.compile's cache key, beside a tag the caller
    set; the hash changes when an op's schema does (here: an op added to a namespace) and only then."""
    from blockpress.kernels.compiled import compiled_block, ops_cache_tag, tag_compile_cache

    old = torch.compiler.config.cache_key_tag
    try:
        torch.compiler.config.cache_key_tag = "mine"
        compiled_block.cache_clear()
        compiled_block()
        assert torch.compiler.config.cache_key_tag == f"mine+{ops_cache_tag()}"
        tag_compile_cache(ops_cache_tag())  # once only
        assert torch.compiler.config.cache_key_tag == f"mine+{ops_cache_tag()}"
    finally:
        torch.compiler.config.cache_key_tag = old
    lib = torch.library.Library("bp_tag_test", "FRAGMENT")
    lib.define("a(Tensor x) -> Tensor")
    one = ops_cache_tag("bp_tag_test")
    assert one == ops_cache_tag("bp_tag_test") and one.startswith("bp_tag_test-ops-")
    lib.define("b(Tensor x, int split=1) -> Tensor")
    assert ops_cache_tag("bp_tag_test") != one
