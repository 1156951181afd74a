"""kernels/compiled.py: the opt-in torch.compile of the decoder blocks computes what the eager blocks compute."""

import copy

import pytest
import torch

from blockpress import kernels
from blockpress.lab.presets import preset_config
from blockpress.config import GenerationConfig
from blockpress.engine import generate as engine
from blockpress.lab.random_weights import build_model

pytestmark = pytest.mark.no_grad


def _model(linears="native"):
    cfg = copy.deepcopy(preset_config("tiny")[0])
    cfg["text_config"].update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    m = build_model(cfg, torch.device("cpu"), torch.float32, "native", 0, 0.02, 64)
    kernels.configure(m, experts="grouped", attention="sdpa_gqa", linears=linears)
    return m


def _inputs(m):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, m.text.vocab_size, (2, 21), generator=g)  # a sliding window of 8: the ring wraps
    return ids, torch.randint(0, m.text.vocab_size, (2, m.config.canvas_length), generator=g)


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

    m = _model(linears="int8")  # 8-bit projections stay outside the graph, like the experts
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
