"""The benchmark harness: roofline arithmetic on the real architecture (meta device), the CLI end to
end on the tiny preset (table + ONE JSON line), and the transformers twin getting our exact weights
(same seed -> same tokens)."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import blockpress

from blockpress.cli import main as cli_main
from blockpress.lab.presets import PRESETS, preset_config
from blockpress.config import ModelConfig
from blockpress.kernels.quant import QuantizedExperts
from blockpress.lab.roofline import (ar_token_bytes, expected_hit_fraction, generation_floor_seconds,
                                         step_bytes, weight_groups)
from blockpress.model.diffusion_gemma import DiffusionGemmaModel

ROOT = Path(__file__).resolve().parents[1]
H100_BPS = 3.35e12
# fp32 also where a GPU is (gpu_session.sh check runs this file there): token agreement with transformers is a
# check of fp32 arithmetic; in bf16 two engines' sums in another order may flip a near-tie
FAST = ["--preset", "tiny", "--prompt-tokens", "8", "--new-tokens", "32", "--steps", "3", "--warmup", "0",
        "--threads", "1", "--bandwidth-gbs", "10", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def real_meta():
    config, _, _ = preset_config("real-26b")
    with torch.device("meta"):
        return DiffusionGemmaModel(ModelConfig.from_dict(config)).to(torch.bfloat16)


def _quantized_copy(module, fmt):
    t = module.text
    with torch.device("meta"):
        for layer in module.layers:
            layer.experts = QuantizedExperts(t.num_experts, t.hidden_size, t.moe_intermediate_size, fmt, 64,
                                             dtype=torch.bfloat16)
    return module


def test_roofline_of_the_real_model(real_meta):
    g = weight_groups(real_meta)
    assert g["experts"] == 22_837_985_280 * 2  # spec 1.6 expert parameters, bf16
    assert g["embedding"] == 738_197_504 * 2
    assert expected_hit_fraction(128, 8, 256) > 1 - 1e-6  # one canvas hits every expert
    bf16 = step_bytes(real_meta, 1, 256, 1408)["total"]
    assert 52.0e9 < bf16 < 53.5e9 and 15.5 < bf16 / H100_BPS * 1e3 < 16.0  # issue #4: ~52.5 GB, ~16 ms
    fp8 = step_bytes(_quantized_copy(real_meta, "fp8"), 1, 256, 1408)["total"]
    int4 = step_bytes(_quantized_copy(real_meta, "int4"), 1, 256, 1408)["total"]
    assert 29e9 < fp8 < 31e9 and 18.5e9 < int4 < 19.5e9
    assert step_bytes(real_meta, 1, 256, 1408, native=True)["total"] == bf16  # the transformers twin's bytes
    # whole generation (P=1024, N=1024, 16 steps) in tokens/s at the H100 floor, and the AR bound
    tok_s = 1024 / generation_floor_seconds(real_meta, 1, 1024, 1024, 256, 16, H100_BPS)
    assert 2400 < tok_s < 2800  # int4 experts (the module was swapped last)
    assert H100_BPS / ar_token_bytes(real_meta, 1, 1536) < 600


def test_roofline_counting_math_too(real_meta):
    """pass_parts splits a pass into kernel groups whose bytes add up to step_bytes / encode_bytes and whose FLOPs
    add up to step_flops; with math counted the floor can only rise, stays the byte floor with an infinite peak,
    and at batch 4 the 26B step is compute-bound (its projections, experts and LM head at 1,024 rows)."""
    from blockpress.lab.roofline import (encode_bytes, floor_seconds, pass_parts, peak_bf16_flops, step_flops)

    m = _quantized_copy(real_meta, "int4")
    for B in (1, 4):
        step = pass_parts(m, B, 256, 1408)
        assert sum(b for b, _ in step.values()) == step_bytes(m, B, 256, 1408)["total"]
        assert sum(f for _, f in step.values()) == step_flops(m, B, 256, 1408)
        enc = pass_parts(m, B, 256, 1024, decoder=False)
        assert sum(b for b, _ in enc.values()) == encode_bytes(m, B, 256, 1024)
    bytes_only = generation_floor_seconds(m, 1, 1024, 1024, 256, 16, H100_BPS)
    old_formula = (encode_bytes(m, 1, 1024, 0) + sum(encode_bytes(m, 1, 256, 1024 + (c - 1) * 256) for c in range(1, 4))
                   + 16 * sum(step_bytes(m, 1, 256, 1024 + c * 256)["total"] for c in range(4))) / H100_BPS
    assert bytes_only == pytest.approx(old_formula, rel=1e-12)
    for fuse in (False, True):
        a = generation_floor_seconds(m, 1, 1024, 1024, 256, 16, H100_BPS, fuse_commit=fuse)
        assert generation_floor_seconds(m, 1, 1024, 1024, 256, 16, H100_BPS, fuse_commit=fuse, peak_flops=1e30) == \
            pytest.approx(a, rel=1e-12)
        assert generation_floor_seconds(m, 1, 1024, 1024, 256, 16, H100_BPS, fuse_commit=fuse, peak_flops=989e12) > a
    one = floor_seconds(pass_parts(m, 1, 256, 1408), H100_BPS, 989e12)
    four = floor_seconds(pass_parts(m, 4, 256, 1408), H100_BPS, 989e12)
    assert step_bytes(m, 1, 256, 1408)["total"] / H100_BPS < one < 1.03 * step_bytes(m, 1, 256, 1408)["total"] / H100_BPS
    assert four > 1.5 * step_bytes(m, 4, 256, 1408)["total"] / H100_BPS  # batch 4: math, not bytes
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12 and peak_bf16_flops("Some New GPU") is None


def test_a_profiles_kernel_classes_carry_the_steps_floor(real_meta):
    """Each kernel class of a step profile has the floor of the pass parts it runs (`class_floors_ms`): they add up
    to the step's floor, bytes only or with math; the 26B fp8 step's experts carry most of it (22.9 GB at 3.35 TB/s);
    a part no class carries is an error, not a floor left out."""
    from blockpress.lab.roofline import class_floors_ms, floor_seconds, pass_parts

    m = _quantized_copy(real_meta, "fp8")
    parts = pass_parts(m, 1, 256, 1024)
    for peak in (None, 989e12):
        floors = class_floors_ms(parts, H100_BPS, peak)
        assert set(floors) == {"experts", "dense GEMM", "attention", "sampler"}
        assert sum(floors.values()) == pytest.approx(floor_seconds(parts, H100_BPS, peak) * 1e3, rel=1e-12)
    assert 6.5 < floors["experts"] < 7.2 and floors["experts"] > 2 * floors["dense GEMM"] > 0
    with pytest.raises(ValueError, match="no kernel class.*'something new'"):
        class_floors_ms({**parts, "something new": (1, 0)}, H100_BPS, None)


def test_presets_are_valid_configs():
    for name in PRESETS:
        config, prompt, new = preset_config(name)
        cfg = ModelConfig.from_dict(config)
        assert cfg.text.layer_types[-1] == "full_attention" and prompt > 0 and new > 0


def _strict(constant):
    raise ValueError(f"{constant} is not JSON")


def test_bench_without_transformers_measures_ours_and_says_why_not_theirs(capsys, monkeypatch):
    """A plain `pip install` has no transformers: the bench runs ours, then names the missing package and the flag,
    instead of a traceback after the timing."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        find(name, *a))
    assert cli_main(["bench", *FAST, "--modes", "fixed", "--repeats", "1", "--no-ar"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert {r["engine"] for r in result["runs"]} == {"blockpress"}
    assert "not installed" in result["reference_skipped"] and "--no-reference" in captured.err


def test_cli_bench_tiny_with_reference_and_ar(capsys):
    assert cli_main(["bench", *FAST, "--modes", "fixed,adaptive", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1], parse_constant=_strict)  # ends with ONE JSON line, strict JSON (no NaN)
    assert not any(line.startswith("{") for line in out[:-1])
    engines = {(r["engine"], r["mode"]) for r in result["runs"]}
    assert engines == {("blockpress", "fixed"), ("blockpress", "adaptive"), ("blockpress-ar", "greedy"),
                       ("transformers", "fixed"), ("transformers", "adaptive")}
    # same config, same weights (per-name fill), same seed and settings: transformers makes our tokens
    assert result["token_agreement_vs_transformers"] == {"B1-fixed": 1.0, "B1-adaptive": 1.0}
    ours = next(r for r in result["runs"] if r["engine"] == "blockpress" and r["mode"] == "fixed")
    for key in ("tok_s", "tok_s_excl_prompt", "ms_per_step", "ms_per_commit", "first_commit_ms", "prefill_ms",
                "peak_mem_bytes", "bytes_per_step", "floor_fraction", "gen_floor_tok_s"):
        assert ours[key] is not None and ours[key] > 0, key
    assert result["fuse_commit"] is False  # a CPU's default: a pass of its own per commit (reference parity)
    assert ours["steps_per_canvas"] == 3 and ours["first_commit_ms"] < ours["total_ms"]
    assert ours["tok_s_excl_prompt"] >= ours["tok_s"]
    assert set(result["ratios"]) == {"vs_transformers_fixed", "vs_transformers_adaptive", "vs_ar"}
    ref = next(r for r in result["runs"] if r["engine"] == "transformers")
    assert ref["first_commit_ms"] is None  # not observable from outside transformers' generate
    # its steps, timed from the decoder's call to the LM head's (transformers 5.23's generate calls the top
    # module's forward past its hooks: 0.0 steps a canvas and no ms a step before)
    assert ref["steps_per_canvas"] == 3 and ref["ms_per_step"] > 0 and ref["floor_fraction"] > 0


@pytest.mark.parametrize("flags,message", [
    (["--group-size", "7"], "--group-size: expected a power of two >= 16"),  # was gcd(H, 7) = 1: a scale per weight
    (["--group-size", "8"], "--group-size: expected a power of two >= 16"),
    (["--modes", "fixed,greedy"], "--modes: expected fixed and/or adaptive"),  # was run as if it were a mode
    (["--bandwidth-gbs", "-1"], "--bandwidth-gbs: expected a positive number"),  # was a ZeroDivisionError
    (["--peak-tflops", "0"], "--peak-tflops: expected a positive number"),
])
def test_bench_refuses_bad_flags_with_the_rule(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", *FAST, *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_int4_group_size_is_checked_where_it_enters():
    from blockpress.kernels.quant import QuantizedExperts, group_for, quantize_int4

    assert group_for(2816, 64) == 64 and group_for(704, 128) == 64 and group_for(24, 16) == 8
    for bad in (7, 8, 0, -16, 48, 64.0, True):
        with pytest.raises(blockpress.InputError, match="power of two >= 16"):
            quantize_int4(torch.randn(2, 4, 64), group_size=bad)
    with pytest.raises(blockpress.InputError, match="power of two >= 16"):
        QuantizedExperts(4, 64, 32, "int4", group_size=12)
    with pytest.raises(blockpress.InputError, match="got 7"):  # before any file is touched
        blockpress.load("/nonexistent", precision="int4", group_size=7)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bench_scripts_run_quantised_batched_and_fast(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_generate.py", *FAST, "--no-reference", "--no-ar", "--modes", "fixed",
                                      "--precision", "int4", "--group-size", "16", "--batch", "1,2",
                                      "--sampler", "fast", "--linears", "int8", "--peak-tflops", "0.001"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / "bench_generate.py"), run_name="__main__")
    assert e.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in result["runs"]] == [1, 2] and result["precision"] == "int4"
    assert result["sampler"] == "fast" and "reference_skipped" not in result
    assert result["linears"] == "int8" and result["backends"]["linears"].startswith("int8")
    for r in result["runs"]:  # a 1 GFLOP/s "GPU": the floors that count math are far above the byte floors
        assert r["step_floor_ms_roofline"] > 10 * r["step_floor_ms"]
        assert r["gen_floor_tok_s_roofline"] < r["gen_floor_tok_s"] / 10
        assert r["floor_fraction_roofline"] == pytest.approx(r["step_floor_ms_roofline"] / r["ms_per_step"])

    monkeypatch.setattr(sys, "argv", ["bench_cpu.py", *FAST, "--no-reference", "--batch", "1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / "bench_cpu.py"), run_name="__main__")
    assert e.value.code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "cpu" and [r["sampler"] for r in line["runs"]] == ["exact", "fast"]
    assert "fast_vs_exact_sampler" in line


def test_quality_guard_tiny(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["quality_guard.py", "--preset", "tiny", "--batch", "1", "--steps", "2",
                                      "--prompt-tokens", "8", "--group-size", "16"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / "quality_guard.py"), run_name="__main__")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["format"]: r for r in result["results"]}
    assert set(rows) == {"bf16", "fp8", "int4", "int8-linears", "fp8-linears", "fp8-linears-a8", "int4-mlp",
                         "fp8+int8-linears", "int4+int8-linears", "int4+int4-mlp", "int8-embeddings",
                         "int4+int8-embeddings", "fp8-a8"}
    # the int8 embedding table: the logits move (KL > 0) with no expert or projection output changed
    emb = rows["int8-embeddings"]
    assert emb["experts_rel_err"] == 0 == emb["linears_rel_err"] and 0 < emb["mean_kl"] < rows["int4"]["mean_kl"]
    assert rows["int4+int8-embeddings"]["experts_rel_err"] == rows["int4"]["experts_rel_err"]
    assert rows["bf16"]["experts_rel_err"] < rows["fp8"]["experts_rel_err"] < rows["int4"]["experts_rel_err"]
    assert rows["int8-linears"]["experts_rel_err"] == 0 == rows["int4"]["linears_rel_err"]  # each swaps only its part
    assert 0 < rows["int8-linears"]["linears_rel_err"] == rows["int4+int8-linears"]["linears_rel_err"] < 0.02
    assert rows["int4+int8-linears"]["experts_rel_err"] == rows["int4"]["experts_rel_err"]
    # the dense MLP alone in int4: its own error (each MLP's output), about int4's on the experts; nothing else moves
    assert rows["int4-mlp"]["experts_rel_err"] == 0 < rows["int4-mlp"]["linears_rel_err"] < 0.25
    assert rows["int4+int4-mlp"]["linears_rel_err"] == rows["int4-mlp"]["linears_rel_err"]
    # int8 keeps ~7 bits of a row's bulk, fp8 3; fp8 activations add their own rounding
    assert rows["int8-linears"]["linears_rel_err"] < rows["fp8-linears"]["linears_rel_err"] \
        < rows["fp8-linears-a8"]["linears_rel_err"] < 0.1
    # fp8 activations on fp8 experts (experts="w8a8"): the experts' own rounding grows, nothing else moves
    assert rows["fp8"]["experts_rel_err"] < rows["fp8-a8"]["experts_rel_err"] < 0.1
    assert rows["fp8-a8"]["linears_rel_err"] == 0
    assert e.value.code == 0 and all(r["pass"] for r in rows.values())


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_bench_a_checkpoint_with_a_text_prompt_against_its_transformers_twin(tmp_path, capsys):
    """--model: the checkpoint's own weights in both engines (transformers loads it with from_pretrained);
    --prompt: real text through the model's tokenizer. Same seed, same tokens."""
    from blockpress.testing import build_tiny_gemma_tokenizer
    from blockpress.train import sizes

    model = tmp_path / "m"
    blockpress.from_config(sizes.model_config("nano", vocab_size=512, canvas_length=8, context=32), seed=0).save(model)
    build_tiny_gemma_tokenizer(model)
    assert cli_main(["bench", "--model", str(model), "--prompt", "The sky is blue because", "--new-tokens", "16",
                     "--steps", "3", "--modes", "fixed", "--threads", "1", "--no-ar", "--dtype", "fp32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["token_agreement_vs_transformers"] == {"B1-fixed": 1.0}
    assert result["prompt_tokens"] == len(blockpress.load(model, progress=False).encode_chat("The sky is blue because",
                                                                                             chat=False))
    assert cli_main(["bench", "--prompt", "hi"]) == 2
    assert "--prompt needs --model" in capsys.readouterr().err
    # a shipped model by name: transformers loads the folder it names (it went to the Hub with the name: OSError)
    assert cli_main(["bench", "--model", "sudoku", "--new-tokens", "32", "--steps", "2", "--modes", "fixed",
                     "--threads", "1", "--no-ar", "--repeats", "1", "--warmup", "0"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_agreement_vs_transformers"] == \
        {"B1-fixed": 1.0}


def test_bench_fuse_commit_times_the_fused_pass_and_keeps_the_tokens(capsys):
    """--fuse-commit: the same tokens as transformers, the fused pass timed, no separate commit passes, and a
    lower floor (the commits' weight reads are gone)."""
    assert cli_main(["bench", *FAST, "--modes", "fixed", "--repeats", "1", "--no-ar", "--fuse-commit"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["fuse_commit"] is True
    assert result["token_agreement_vs_transformers"] == {"B1-fixed": 1.0}
    ours = next(r for r in result["runs"] if r["engine"] == "blockpress")
    assert ours["ms_per_fused_commit_step"] > 0 and ours["ms_per_commit"] is None
    config, _, _ = preset_config("tiny")
    module = DiffusionGemmaModel(ModelConfig.from_dict(config))
    plain = generation_floor_seconds(module, 1, 8, 32, 16, 3, 1e10)
    fused = generation_floor_seconds(module, 1, 8, 32, 16, 3, 1e10, fuse_commit=True)
    assert fused < plain


def test_bench_prefill_chunk_keeps_the_references_tokens(capsys):
    """--prefill-chunk 3: the 8-token prompt encoded 3 tokens at a time, the same tokens as transformers (which
    encodes it whole); recorded in the JSON's backends."""
    assert cli_main(["bench", *FAST, "--modes", "fixed", "--no-ar", "--prefill-chunk", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["backends"]["prefill_chunk"] == 3 and result["token_agreement_vs_transformers"] == {"B1-fixed": 1.0}


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_bench_moe_sum_atomic_keeps_the_references_tokens(capsys):
    """--moe-sum atomic (the Triton experts' K-sum by fp32 atomics in the down kernel; the interpreter on CPU): the
    same tokens as transformers, recorded in the JSON."""
    from blockpress.kernels import moe_grouped

    if moe_grouped.triton is None:
        pytest.skip("triton not installed")
    assert cli_main(["bench", *FAST, "--modes", "fixed", "--no-ar", "--experts", "triton",
                     "--moe-sum", "atomic", "--new-tokens", "16"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["backends"]["moe_sum"] == "atomic" and result["backends"]["experts"] == "triton"
    assert result["token_agreement_vs_transformers"] == {"B1-fixed": 1.0}


def test_bench_compact_rows_keeps_the_references_tokens(capsys):
    """--compact-rows (adaptive, batch 2): the decoder skips stopped rows, the sampler draws for all, so the tokens
    stay transformers'; it is recorded in the JSON, and refused with --cuda-graphs."""
    assert cli_main(["bench", *FAST, "--modes", "adaptive", "--batch", "2", "--reference-batch", "2", "--no-ar",
                     "--compact-rows"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["compact_rows"] is True and result["token_agreement_vs_transformers"] == {"B2-adaptive": 1.0}
    assert cli_main(["bench", *FAST, "--compact-rows", "--cuda-graphs"]) == 2
    assert "--compact-rows cannot run on CUDA graphs" in capsys.readouterr().err


def test_bench_profile_splits_a_step_by_kernel_class(capsys):
    """--profile: the steps after the first of one canvas, at the first batch size; the classes add up to the
    busy time, the exact sampler's draws and the GEMMs are where they belong, the top list is sorted."""
    assert cli_main(["bench", *FAST, "--modes", "fixed", "--no-reference", "--no-ar", "--batch", "2,1",
                     "--profile"]) == 0
    out = capsys.readouterr().out
    p = json.loads(out.strip().splitlines()[-1])["profile"]
    assert "step profile" in out and p["batch"] == 2 and p["steps_profiled"] == 2  # --steps 3, the first left out
    assert sum(p["by_class_ms"].values()) == pytest.approx(p["busy_ms_per_step"])
    assert p["by_class_ms"]["dense GEMM"] > 0 and p["by_class_ms"]["sampler"] > 0
    # the code ranges: experts and attention inside the decoder pass, the sampler outside it; they add up
    total = p["busy_ms_per_step"] if p["parts_add_up_to"] == "busy" else p["wall_ms_per_step"]
    assert sum(p["by_part_ms"].values()) == pytest.approx(total, rel=1e-6)
    assert all(p["by_part_ms"][part] > 0 for part in ("experts", "attention", "decoder, rest", "sampler"))
    assert p["experts_achieved_gbs"] > 0
    # each class beside its floor (the profiled steps' own: a canvas after the prompt), in the table too
    assert set(p["floor_ms_by_class"]) == {"experts", "dense GEMM", "attention", "sampler"}
    assert all(v > 0 for v in p["floor_ms_by_class"].values()) and "x floor" in out
    assert p["wall_ms_per_step"] >= p["busy_ms_per_step"] * 0.5
    assert p["kernels_per_step"] >= sum(k["calls_per_step"] for k in p["top"]) > len(p["top"])  # counts launches
    times = [k["ms_per_step"] for k in p["top"]]
    assert times == sorted(times, reverse=True) and len(times) <= 12
    assert cli_main(["bench", *FAST, "--steps", "1", "--no-reference", "--no-ar", "--profile"]) == 2
    assert "--steps 2 or more" in capsys.readouterr().err


def test_kernel_classes_of_hopper_kernel_names():
    from blockpress.lab.profile import kernel_class

    assert kernel_class("_moe_up_kernel") == "experts"
    assert kernel_class("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::"
                        "GroupProblemShape<...>>>") == "experts"  # torch._grouped_mm
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1") == \
        "dense GEMM"
    assert kernel_class("nvjet_hsh_192x192_64x3_2x1_v_bz_coopA_TNT") == "dense GEMM"
    assert kernel_class("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>") == "attention"
    assert kernel_class("_fused_sampler_kernel") == "sampler"
    assert kernel_class("_linear_q_kernel") == "dense GEMM"  # the 8-bit projections (kernels/linear_q.py)
    assert kernel_class("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>") == "other"
    assert kernel_class("aten::_fused_rms_norm") == "norm"


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_moe_tile_sweep_on_cpu_checks_every_setting_against_torch(capsys, monkeypatch):
    """benchmarks/sweep_moe_tiles.py through the Triton interpreter: the defaults come first and agree with the
    plain-torch experts, every grid setting agrees with them, and the JSON names a best spec per precision."""
    from blockpress.kernels._triton import triton, usable_on

    if triton is None or not usable_on(torch.device("cpu")):
        pytest.skip("triton not installed (pip install triton), or TRITON_INTERPRET is off")
    monkeypatch.setattr(sys, "argv", ["sweep_moe_tiles.py", "--preset", "tiny", "--device", "cpu", "--precision",
                                      "native,int4,fp8-a8", "--grid", "bm=16;bn=16,32;bk=16", "--repeats", "1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / "sweep_moe_tiles.py"), run_name="__main__")
    assert e.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["best"]) == {"native", "int4", "fp8-a8"}  # fp8-a8: the w8a8 kernels against their reference
    assert all(v < 1e-4 for v in result["rel_err_vs_torch"].values())
    rows = result["results"]
    assert [r["spec"] for r in rows if r["precision"] == "native"] == \
        ["bm=auto,bn=128,bk=64", "bm=16,bn=16,bk=16", "bm=16,bn=32,bk=16"]
    assert all(r["ok"] and r["ms"] > 0 for r in rows)
    assert all(v["speedup_vs_default"] > 0 for v in result["best"].values())
    # the dense MLP as --linears int4-mlp runs it: one expert of the MLP's width that every token takes
    monkeypatch.setattr(sys, "argv", ["sweep_moe_tiles.py", "--preset", "tiny", "--device", "cpu", "--precision",
                                      "int4", "--mlp", "--grid", "bm=16;bn=32;bk=32", "--repeats", "1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / "sweep_moe_tiles.py"), run_name="__main__")
    assert e.value.code == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["mlp"] and result["rel_err_vs_torch"]["int4"] < 1e-4
    text = preset_config("tiny")[0]["text_config"]
    assert f"E=1 H={text['hidden_size']} Im={text['intermediate_size']} top-1" in out
    assert [r["spec"] for r in result["results"]] == ["bm=auto,bn=128,bk=64", "bm=16,bn=32,bk=32"]


def test_moe_tiles_setting_reaches_the_kernel_launch(monkeypatch):
    """The `moe_tiles` option / --moe-tiles: the configured tiles are what experts_triton launches with (bad specs are
    refused with the rule), and explicit block_* arguments still win."""
    from blockpress.kernels import moe_grouped

    with pytest.raises(ValueError, match="powers of two"):
        moe_grouped.parse_tiles("bn=48")
    with pytest.raises(ValueError, match="key=value"):
        moe_grouped.parse_tiles("tile=64")
    with pytest.raises(ValueError, match="use 0 or 1"):
        moe_grouped.parse_tiles("swap=2")
    assert moe_grouped.parse_tiles("bm=auto,bn=128,bk=64,warps=8,stages=4").spec() == \
        "bm=auto,bn=128,bk=64,warps=8,stages=4"
    assert moe_grouped.parse_tiles("swap=1,bn=64").spec() == "bm=auto,bn=64,bk=64,swap=1"
    assert moe_grouped.parse_tiles("swap=0").spec() == moe_grouped.DEFAULT_TILES.spec()
    seen = []

    class Launch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((self.name, kw["BM"], kw["BN"], kw["BK"], kw.get("num_warps")))

    monkeypatch.setattr(moe_grouped, "_moe_up_kernel", Launch("up"), raising=False)
    monkeypatch.setattr(moe_grouped, "_moe_down_kernel", Launch("down"), raising=False)
    monkeypatch.setattr(moe_grouped, "triton", moe_grouped.triton or __import__("types").SimpleNamespace(
        next_power_of_2=lambda n: 1 << (n - 1).bit_length(), cdiv=lambda a, b: -(-a // b)))
    x, idx = torch.randn(8, 256), torch.randint(0, 4, (8, 2))  # H 256, Im 128
    w, gu, dn = torch.rand(8, 2), torch.randn(4, 256, 256), torch.randn(4, 256, 128)
    xs, gus, dns = torch.randn(8, 64), torch.randn(4, 64, 64), torch.randn(4, 64, 32)  # H 64, Im 32
    tiles = moe_grouped.as_tiles("bm=32,bn=128,bk=64,warps=8")
    moe_grouped.experts_triton(x, w, idx, gu, dn, tiles=tiles)
    moe_grouped.experts_triton(x, w, idx, gu, dn, block_n=16, tiles=tiles)
    moe_grouped.experts_triton(xs, w, idx, gus, dns, tiles=tiles)  # BN capped at each output's width (Im 32, H 64)
    assert seen == [("up", 32, 128, 64, 8), ("down", 32, 128, 64, 8), ("up", 32, 16, 64, 8), ("down", 32, 16, 64, 8),
                    ("up", 32, 32, 64, 8), ("down", 32, 64, 64, 8)]
    seen.clear()  # through the one place that sets them: a model's experts kernel, from its options
    from blockpress.kernels import configure
    from blockpress.lab.random_weights import build_model

    m = build_model(preset_config("tiny")[0], torch.device("cpu"), torch.float32)
    configure(m, experts="triton", moe_tiles="bm=32,bn=128,bk=64,warps=8")
    ex = m.layers[0].experts
    ex(xs, w, idx % 4)
    through_model = list(seen)
    seen.clear()
    moe_grouped.experts_triton(xs, w, idx % 4, ex.gate_up_proj, ex.down_proj, tiles=tiles)
    assert through_model == seen and seen[0][1] == 32 and seen[0][3:] == (64, 8)


def test_auto_m_tile_is_sized_for_the_spread_of_the_routing_and_grows_to_128_on_hopper_only(monkeypatch):
    """bm=auto: the smallest M tile (16..64, up to 128 where tl.dot is Hopper's warpgroup MMA) that holds a busy
    expert's assignments in one block but for ~10 % extra blocks in expectation, launched with 8 warps at 128 unless
    the tiles name a count; before sm_90 (mma.sync) it stays at 64. A canvas of 256 tokens with top-8 of 128
    averages 16 assignments an expert, yet BM 16 would split nearly half the experts in two."""
    from blockpress.kernels import moe_grouped

    assert not moe_grouped._wgmma_target() or torch.cuda.is_available()  # the interpreter: never
    E = 128
    for tokens, want, want_hopper in ((1, 16, 16), (256, 32, 32), (512, 64, 64), (1024, 64, 128), (2048, 64, 128),
                                      (16384, 64, 128)):
        assert moe_grouped.auto_block_m(tokens, 8, E) == want, tokens
        assert moe_grouped.auto_block_m(tokens, 8, E, wgmma=True) == want_hopper, tokens
    # swapped tiles (the activations on the MMA's N side): a looser split budget, timed at batch 1 (bm 16 at 1.43
    # blocks per busy expert beat bm 32); a larger batch still grows the tile
    assert moe_grouped.auto_block_m(256, 8, E, wgmma=True, swap=True) == 16
    assert moe_grouped.auto_block_m(1024, 8, E, wgmma=True, swap=True) > 32
    seen = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["BM"], kw.get("num_warps")))

    monkeypatch.setattr(moe_grouped, "_moe_up_kernel", Launch(), raising=False)
    monkeypatch.setattr(moe_grouped, "_moe_down_kernel", Launch(), raising=False)
    monkeypatch.setattr(moe_grouped, "triton", moe_grouped.triton or __import__("types").SimpleNamespace(
        next_power_of_2=lambda n: 1 << (n - 1).bit_length(), cdiv=lambda a, b: -(-a // b)))
    x, idx = torch.randn(512, 64), torch.randint(0, 4, (512, 2))  # 256 assignments per expert
    w, gu, dn = torch.rand(512, 2), torch.randn(4, 64, 64), torch.randn(4, 64, 32)
    for hopper, tiles, want in ((False, None, (64, None)), (True, None, (128, 8)),
                                (True, "bm=auto,warps=4", (128, 4)), (True, "bm=32", (32, None))):
        monkeypatch.setattr(moe_grouped, "_wgmma_target", lambda device=None, hopper=hopper: hopper)
        seen.clear()
        moe_grouped.experts_triton(x, w, idx, gu, dn, tiles=moe_grouped.as_tiles(tiles))
        assert seen == [want, want], (hopper, tiles)


def test_fp8_experts_take_the_swapped_tiles_on_hopper_by_default(monkeypatch):
    """The experts' default tiles by weight format and GPU (`default_tiles`, what `configure` applies when no
    moe_tiles are asked for): fp8 on a wgmma target takes the weight as the register operand (timed on an H100:
    0.377 against 0.440 ms a layer); int4, bf16 and every format elsewhere keep DEFAULT_TILES; asked tiles win."""
    from blockpress.kernels import moe_grouped, select

    assert moe_grouped.default_tiles("fp8", True).spec() == "bm=auto,bn=64,bk=128,swap=1"
    for precision, wgmma in (("fp8", False), ("int4", True), ("native", True), ("int4", False)):
        assert moe_grouped.default_tiles(precision, wgmma) is moe_grouped.DEFAULT_TILES
    config, _, _ = preset_config("tiny")
    m = DiffusionGemmaModel(ModelConfig.from_dict(config))
    assert select.configure(m, experts="torch", precision="fp8")["moe_tiles"] == moe_grouped.DEFAULT_TILES.spec()
    monkeypatch.setattr(select, "_wgmma_target", lambda device=None: True)  # as on an H100
    assert select.configure(m, experts="torch", precision="fp8")["moe_tiles"] == "bm=auto,bn=64,bk=128,swap=1"
    assert m.layers[0].experts.tiles is moe_grouped.FP8_WGMMA_TILES
    assert select.configure(m, experts="torch", precision="fp8", moe_tiles="bm=16,swap=1")["moe_tiles"] == \
        "bm=16,bn=128,bk=64,swap=1"
    m = DiffusionGemmaModel(ModelConfig.from_dict(config))
    assert select.configure(m, experts="torch", precision="int4")["moe_tiles"] == moe_grouped.DEFAULT_TILES.spec()
    # an int4 MLP beside fp8 experts keeps int4's defaults (swapped tiles were slower for int4), unless asked
    m = DiffusionGemmaModel(ModelConfig.from_dict(config))
    select.configure(m, experts="torch", precision="fp8", linears="int4-mlp")
    assert m.layers[0].experts.tiles is moe_grouped.FP8_WGMMA_TILES
    assert m.layers[0].mlp.experts.tiles is moe_grouped.DEFAULT_TILES
    select.use(m, experts="torch")  # a kernel change keeps each holder's tiles
    assert m.layers[0].mlp.experts.tiles is moe_grouped.DEFAULT_TILES
    select.configure(m, experts="torch", precision="fp8", linears="int4-mlp", moe_tiles="bm=16,swap=1")
    assert m.layers[0].mlp.experts.tiles.spec() == "bm=16,bn=128,bk=64,swap=1"


def test_expected_m_blocks_matches_the_blocks_align_blocks_makes_for_random_routing():
    """expected_m_blocks (the binomial sum bm=auto and compile_report.py's issue model use) against the M blocks
    `align_blocks` actually allots (blocks with an expert) for random top-K routing, averaged over draws."""
    from blockpress.kernels import moe_grouped

    g = torch.Generator().manual_seed(0)
    for tokens, K, E, bm in ((256, 8, 128, 16), (256, 8, 128, 32), (64, 2, 8, 16), (1000, 4, 16, 64)):
        used = []
        for _ in range(40):
            idx = torch.rand(tokens, E, generator=g).topk(K, dim=-1).indices
            _, block_expert = moe_grouped.align_blocks(idx, E, bm)
            used.append(int((block_expert >= 0).sum()))
        measured = sum(used) / len(used) / E
        want = moe_grouped.expected_m_blocks(tokens, K, E, bm)
        assert abs(measured - want) < 0.03 * want + 0.01, (tokens, K, E, bm, measured, want)
    assert moe_grouped.expected_m_blocks(256, 8, 128, 16) > 1.4  # the split the old mean-sized tile paid
    assert moe_grouped.expected_m_blocks(256, 8, 128, 32) < 1.001


@pytest.mark.parametrize("fuse", [False, True])
def test_bench_runs_replay_graphed_passes_after_the_warmup(fuse):
    """The bench's --cuda-graphs bookkeeping, with the graph wrapper's plumbing run without capture (CPU): the
    timed runs (diffusion and the AR baseline) reuse the warm-up's pooled cache and captured passes, so they
    report 0 captures, and give the same tokens as the eager engine."""
    import argparse

    from blockpress.cli.bench import add_parser
    from blockpress.lab.bench import run_ar, run_blockpress
    from blockpress.engine.graphs import GraphedPasses
    from blockpress.lab.random_weights import build_model

    p = argparse.ArgumentParser()
    add_parser(p)
    args = p.parse_args([*FAST[2:], "--warmup", "1", "--repeats", "2", "--ar-tokens", "6"]
                        + (["--fuse-commit"] if fuse else ["--no-fuse-commit"]))
    args.prompt_tokens = 8
    module = build_model(preset_config("tiny")[0], torch.device("cpu"), torch.float32)
    ids = torch.randint(5, module.text.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    eager, eager_seqs = run_blockpress(module, ids, "fixed", args)
    eager_ar = run_ar(module, ids, args)
    graphs = GraphedPasses(module, capture=False, copy_outputs=False)  # what load(cuda_graphs=True) runs
    s, seqs = run_blockpress(module, ids, "fixed", args, passes=graphs)
    ar = run_ar(module, ids, args, graphs)
    passes = {k[:2] for k in graphs.captured}  # (pass, shapes), without the cache's capacity
    assert torch.equal(seqs, eager_seqs)
    assert s["graph_captures_timed"] == 0 and ar["graph_captures_timed"] == 0
    assert "graph_captures_timed" not in eager and "graph_captures_timed" not in eager_ar
    # commit: encode without output; fused, the commit is a canvas's first step, which has no self-conditioning
    # logits (a pass of its own, "_nosc", as the first canvas's first step)
    commit = ("encode_decode_nosc", ((1, 16), (1, 16))) if fuse else ("commit", (1, 16))
    assert passes == {("decode", (1, 16)), ("decode_nosc", (1, 16)), commit, ("encode", (1, 1))}  # AR: (1, 1)
    assert graphs.captures == 4


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_linear_kernel_bench_checks_every_projection_shape(capsys):
    """bench_linears.py enumerates the real model's projections (their bytes are the roofline's 3.29 GB) and
    runs, checks and times the 8-bit paths (a CPU: Triton's interpreter and _scaled_mm; a GPU: compiled) with a
    JSON line at the end."""
    mod = runpy.run_path(str(ROOT / "benchmarks" / "bench_linears.py"))
    from blockpress.config import ModelConfig
    from blockpress.lab.roofline import weight_groups
    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    text = ModelConfig.from_dict(preset_config("real-26b")[0]).text
    shapes = mod["projection_shapes"](text)
    with torch.device("meta"):
        g = weight_groups(DiffusionGemmaModel(ModelConfig.from_dict(preset_config("real-26b")[0])).to(torch.bfloat16))
    assert 2 * sum(i * o * n for (i, o), n in shapes.items()) == g["attention"] + g["dense_mlp"]
    assert sum(shapes.values()) == 7 * 30 - 5  # q k v o gate up down per layer; the 5 full layers have no v
    fused = mod["projection_shapes"](text, fused=True)
    assert sum(fused.values()) == 4 * 30  # qkv, o, gate|up, down
    assert sum(i * o * n for (i, o), n in fused.items()) == sum(i * o * n for (i, o), n in shapes.items())
    from kernel_device import COMPILED, DEV

    # where the Triton kernel runs: the interpreter on CPU (fp32), compiled on a GPU (bf16 activations there)
    assert mod["main"](["--preset", "tiny", "--rows", "1,5", "--repeats", "1", "--device", DEV.type]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["ok"] and {r["rows"] for r in line["results"]} == {1, 5}
    int8 = [v for v in line["variants"] if v.startswith("int8 ")]
    assert len(int8) >= 2 and any("split=" in v for v in int8)  # the kernel's tile variants, each a valid spec
    best = line["best_int8_spec"]
    assert set(best) == {"1", "5"} and all(f"int8 {sp}" in int8 for sp in best.values())
    a8 = not COMPILED or torch.cuda.get_device_capability() >= (8, 9)  # fp8 tensor cores (a CPU: the interpreter)
    assert line["variants"][len(int8):] == ["fp8"] + (
        ["fp8-a8 bm=auto,bn=64,bk=64", "fp8-a8 bm=auto,bn=64,bk=128", "fp8-a8 bm=128,bn=64,bk=128",
         "fp8-a8 scaled_mm"] if a8 else [])
    assert set(line["best_a8_spec"]) == ({"1", "5"} if a8 else set())  # our w8a8 kernel's faster tiles per row count
    assert max(max(r["rel_err"].values()) for r in line["results"]) < (2e-2 if COMPILED else 1e-5)


def test_serving_bench_counts_every_request_and_reports_graph_captures(capsys):
    """bench_serve.py: closed-loop load on the server's scheduler, levels 1 and 3 (a finished request is replaced at
    once, so requests join a running batch). Every timed request's tokens are counted, the rates follow from them,
    and with the CUDA-graph plumbing installed (capture off on CPU) each level reports its captures in the timed part;
    without it, none. A bad flag combination is refused with exit code 2."""
    import argparse

    from blockpress.lab.random_weights import build_model
    from blockpress.lm import BlockDiffusionLM
    from blockpress.options import Options

    mod = runpy.run_path(str(ROOT / "benchmarks" / "bench_serve.py"))
    p = argparse.ArgumentParser()
    mod["add_parser"](p)
    args = p.parse_args(["--preset", "tiny", "--concurrency", "1,3", "--requests", "4", "--prompt-tokens", "8",
                         "--new-tokens", "32", "--steps", "2", "--mode", "adaptive", "--device", "cpu"])
    module = build_model(preset_config("tiny")[0], torch.device("cpu"), torch.float32)
    plain = mod["run"](args, BlockDiffusionLM(module, module.config, {}))
    # the graphs' plumbing on fixed buffers, as load(cuda_graphs=True) gives (a CPU: no capture)
    graphed = mod["run"](args, BlockDiffusionLM(module, module.config, {}, options=Options(cuda_graphs=True)))
    for result, graphs in ((plain, False), (graphed, True)):
        assert result["cuda_graphs"] is graphs and [lv["concurrency"] for lv in result["levels"]] == [1, 3]
        for lv in result["levels"]:
            assert lv["requests"] == 4 and lv["tokens"] == 4 * 32
            assert lv["tok_s"] == pytest.approx(lv["tokens"] / lv["wall_s"])
            assert 1 <= lv["rows_per_step"] <= lv["concurrency"] and lv["batched_steps"] >= 2 * 2 * 4 / 3
            assert lv["first_commit_ms_p50"] <= lv["first_commit_ms_p95"] <= 1e3 * lv["wall_s"]
            assert ("graph_captures_timed" in lv) == graphs
    assert graphed["levels"][0]["graph_captures_timed"] == 0  # one row, one shape: the warm-up captured it all
    assert mod["main"](["--preset", "tiny", "--device", "cpu", "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("script,flags,message", [
    ("peak_memory.py", ["--batch", "0"], "--batch: expected a positive integer"),
    ("peak_memory.py", ["--budget-gb", "-3"], "--budget-gb: expected a positive number"),
    ("bench_linears.py", ["--rows", "1,x"], "--rows: expected a positive integer"),
    ("quality_guard.py", ["--steps", "0"], "--steps: expected a positive integer"),  # was a SamplingError traceback
    ("quality_guard.py", ["--group-size", "7"], "--group-size: expected a power of two >= 16"),
    ("sweep_moe_tiles.py", ["--group-size", "24"], "--group-size: expected a power of two >= 16"),
    ("bench_sudoku_cpu.py", ["--blanks", "99"], "--blanks: expected an integer in 0..64"),  # was a ValueError
    ("sudoku_samples.py", ["--samples", "0"], "--samples: expected a positive integer"),
    ("sudoku_ar_vs_diffusion.py", ["--repair", "-1"], "--repair: expected an integer >= 0"),
])
def test_benchmark_scripts_refuse_bad_flags_before_any_work(script, flags, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_refuses_random_weights_that_cannot_fit_before_allocating(monkeypatch, capsys):
    """The real 26B preset in fp32 on a CPU is ~94 GiB: refused with what would fit, before any weight exists
    (was an allocation that the OOM killer ends, or a CUDA out-of-memory traceback on a small card)."""
    import blockpress.loading as loading

    monkeypatch.setattr(loading, "_free_bytes", lambda device: 20 * 2 ** 30)
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("allocated before the check"))
    assert cli_main(["bench", "--preset", "real-26b", "--device", "cpu", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "the weights need ~94.1 GiB (float32" in err and "precision int4 with int8 linears needs" in err


def test_l2_bandwidth_kernel_reads_what_it_counts(capsys):
    """benchmarks/l2_bandwidth.py (the L2 rate the compile report's L2 traffic is to be read against): in the
    interpreter its re-read sums equal torch's, so the bytes it counts were read; a JSON line ends it."""
    from blockpress.kernels._triton import triton, usable_on

    if triton is None or not usable_on(torch.device("cpu")):
        pytest.skip("triton not installed (pip install triton), or TRITON_INTERPRET is off")
    mod = runpy.run_path(str(ROOT / "benchmarks" / "l2_bandwidth.py"))
    x = torch.randn(8 * mod["CHUNK"])
    got, want = mod["reread"](x, 5, 3), mod["reread_reference"](x, 5, 3)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, mod["reread_reference"](x, 5, 2))  # a missed read would show
    assert mod["main"](["--device", "cpu", "--l2-mb", "1", "--dram-mb", "2", "--reps", "3", "--programs", "4",
                        "--repeats", "1"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["ok"] and line["l2"]["bytes_read"] == 4 * 3 * mod["CHUNK"] * 4 and line["dram"]["buffer_mb"] == 2


def test_profile_parts_follow_the_gpu_timeline_so_triton_kernels_count_where_they_ran():
    """parts_by_gpu_spans: a kernel belongs to the innermost span (experts / attention inside a decoder pass) that
    holds it on the GPU's timeline, whatever launched it; kernels outside every decoder pass are the sampler's.
    (On an H200 with torch 2.11, the CPU ranges' device time missed the Triton experts kernels entirely.)"""
    from blockpress.lab.profile import parts_by_gpu_spans

    spans = {"decode": [(0, 100), (200, 300)], "experts": [(10, 40), (210, 240)], "attention": [(50, 60)]}
    kernels = [(12, 20, 8.0), (21, 39, 18.0),  # two expert kernels of pass 1 (a Triton launch and a sort, say)
               (212, 238, 26.0),  # pass 2's
               (51, 59, 8.0),  # attention
               (70, 80, 10.0), (250, 260, 10.0),  # the rest of each pass
               (120, 150, 30.0), (99, 102, 3.0)]  # the sampler between passes; a kernel straddling a pass's end
    got = parts_by_gpu_spans(kernels, spans)
    assert got == {"experts": 52.0, "attention": 8.0, "decode": 20.0, "outside": 33.0}
    assert sum(got.values()) == sum(k[2] for k in kernels)


def test_transformers_twin_loads_quietly_and_refuses_missing_text_weights(tmp_path):
    """The shipped models have no vision tower: transformers' table of its missing weights is not printed (text
    generation never reads them); a checkpoint missing a text weight is refused (its twin would be random there)."""
    from safetensors.torch import load_file, save_file

    from blockpress.errors import InputError
    import shutil

    from blockpress.lab.random_weights import load_reference
    from blockpress.loading import resolve_path

    model = shutil.copytree(resolve_path("kjv", progress=False), tmp_path / "m")
    # a process of its own: transformers' log handler holds the stderr it found when first imported
    code = ("import sys, torch; from blockpress.lab.random_weights import load_reference; "
            "load_reference(sys.argv[1], torch.device('cpu'), torch.float32); print('loaded')")
    done = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "loaded", done.stderr
    assert "MISSING" not in done.stderr and "vision" not in done.stderr, done.stderr
    (shard,) = model.glob("*.safetensors")
    tensors = load_file(shard)
    gone = next(k for k in tensors if "layers.0" in k and "proj" in k)
    del tensors[gone]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(InputError, match="uninitialised .*--no-reference"):
        load_reference(model, torch.device("cpu"), torch.float32)
