"""The Triton kernels compile for real GPUs (H100 sm_90, RTX 40xx sm_89) and would launch there, checked on a
machine without one: `benchmarks/compile_report.py` runs every launcher on the 26B shapes with Triton's own
ptxas and no driver (blockpress.lab.aot). The agreement tests run the same kernels in the interpreter,
which never builds GPU code; these tests are what catches a kernel that only the GPU compiler rejects."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _ptxas() -> bool:
    """Is Triton's bundled ptxas there? Found without importing triton: an import before blockpress's own (which
    sets TRITON_INTERPRET=1 on a machine without CUDA) would leave this process's kernels uninterpretable."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    return os.access(os.path.join(root, "backends", "nvidia", "bin", "ptxas"), os.X_OK)


needs_ptxas = pytest.mark.skipif(not _ptxas(), reason="needs triton with its bundled ptxas (pip install triton)")


_REPORT: dict = {}  # the compile report's subprocess, its output folder and its log


def start_background(config):
    """Start the compile report (called by conftest when these tests are collected; they run last, so its ~50 s of
    ptxas overlap the rest of the suite): the H100's kernels at batch 1 with the engine's default tiles (8-bit
    projections: int8); with --runslow also the RTX 40xx's, batch 4, fp8 projections, a grid of other tiles (bn 128 /
    256 at bk 128, swap at the defaults' bn and bk) and `blockpress tune`'s attention candidates, ~6 min."""
    if not _ptxas() or _REPORT:
        return
    tmp = Path(tempfile.mkdtemp(prefix="compile-report-"))
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp / "cache"))  # compile for real, not from an old cache
    full = config.getoption("--runslow")
    log = open(tmp / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "compile_report.py"), "--arch",
                             "90,89" if full else "90", "--batch", "1,4" if full else "1",
                             "--linears", "int8,fp8,fp8-a8" if full else "int8,fp8-a8",
                             "--grid", "bn=128,256;bk=128|swap=1" if full else "",
                             "--attention-tiles", "tune" if full else "", "--out", str(tmp / "report.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    _REPORT.update(proc=proc, tmp=tmp, log=log)

    def stop():  # the session ends (also before these tests ran): end the report if it still runs, drop its files
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

    config.add_cleanup(stop)


@pytest.fixture(scope="module")
def report(request):
    """The compile report's exit status, JSON and output (started in the background at collection)."""
    start_background(request.config)
    proc, tmp = _REPORT["proc"], _REPORT["tmp"]
    proc.wait(timeout=900)
    stdout = (tmp / "log.txt").read_text()
    assert (tmp / "report.json").exists(), stdout[-6000:]
    return proc.returncode, json.loads((tmp / "report.json").read_text()), stdout


@needs_ptxas
def test_every_kernel_compiles_and_would_launch(report, request):
    rc, result, stdout = report
    assert rc == 0 and result["failed"] == 0, stdout[-4000:]
    assert "90" in result["archs"]
    for arch in result["archs"]:
        rows = result["archs"][arch]["kernels"]
        split = {"_combine_kernel"} if request.config.getoption("--runslow") else set()  # the split keys' merge
        assert {r["kernel"] for r in rows} == {"_moe_up_kernel", "_moe_down_kernel", "_moe_sum_kernel", "_align_kernel",
                                               "_linear_q_kernel", "_softcap_kernel", "_fused_sampler_kernel",
                                               "_fixed_attention_kernel", "_quant_rows_kernel"} | split
        for r in rows:
            assert not r["problems"] and r["blocks_per_sm"] >= 1 and r["regs"] > 0, r
    labels = [r["label"] for r in result["archs"]["90"]["kernels"]]
    assert any("int4" in x for x in labels) and any("fp8" in x for x in labels) and any("atomic" in x for x in labels)
    # bn=128, bk=128 at a prefill's bm 64 in bf16: 3 pipeline stages would need 240 KB; the launcher fits them
    big = [r for r in result["archs"]["90"]["kernels"] if "bn=128,bk=128" in r["label"] and "native" in r["label"]
           and ("prefill" in r["label"] or "canvas x4" in r["label"]) and r["kernel"] == "_moe_up_kernel"]
    assert all(r["num_stages"] < 3 for r in big) and (big or "bn=128,bk=128" not in " ".join(labels))
    # the weight as the dot's first operand (swap, fp8's default tiles on Hopper): wgmma even for a canvas's 16-32
    # assignment expert blocks, which the other defaults run on mma.sync; the 8-bit projections take a whole canvas
    # per block
    swapped = [r for r in result["archs"]["90"]["kernels"] if "swap" in r["label"] and "canvas x1" in r["label"]
               and r["kernel"] not in ("_align_kernel", "_moe_sum_kernel", "_quant_rows_kernel")]  # no MMA in these
    assert {r["kernel"] for r in swapped} == {"_moe_up_kernel", "_moe_down_kernel", "_linear_q_kernel"}
    assert all(r["mma"] == "wgmma" for r in swapped)
    # the fixed-shape passes' attention: head dims 256 and 512 on wgmma, no spill, in the H100's shared memory; with
    # --runslow also every candidate of `blockpress tune` (kernels of their own: the keys in runs, merged by
    # _combine_kernel; other tiles), none spilling (the 32-row blocks run mma.sync: 4 warps, under a warpgroup's 64)
    from blockpress.lab.tune import ATTENTION_TILES

    attention = [r for r in result["archs"]["90"]["kernels"] if r["kernel"] == "_fixed_attention_kernel"]
    assert all(r["spill"] == 0 for r in attention)
    assert all(r["mma"] == "wgmma" for r in attention if "bm=32" not in r["label"])
    assert sum(":" not in r["label"] for r in attention) == 2  # the defaults (the candidates' labels name a kind)
    assert len(attention) == 2 + (sum(len(v) - 1 for v in ATTENTION_TILES.values()) if split else 0)


def test_pipeline_stages_fit_the_shared_memory(monkeypatch):
    from blockpress.kernels import moe_grouped as mg

    assert mg._stages(4, 10**6) == {"num_stages": 4}  # the tiles' own setting wins
    monkeypatch.setattr(mg, "_smem_limit", lambda: None)  # no GPU: Triton's default
    assert mg._stages(None, 10**6) == {}
    monkeypatch.setattr(mg, "_smem_limit", lambda: 232448)  # H100
    assert mg._stages(None, 20480) == {}  # 3 stages of 20 KB fit
    assert mg._stages(None, 81920, wgmma=True) == {"num_stages": 2}  # wgmma: 3 buffers of 80 KB do not
    assert mg._stages(None, 81920) == {}  # mma.sync: 2 buffers do
    assert mg._stages(None, 135168) == {"num_stages": 2}  # mma.sync, bf16 bm 16 bn 256 bk 128: 2 x 132 KB > 227
    assert mg._stages(None, 98304, fixed=65536, wgmma=True) == {"num_stages": 1}  # fp8 bm 128 bn 256 bk 128
    assert mg._stages(None, 300000) == {"num_stages": 1}
    # a K tile whose single stage does not fit is halved: bf16 bn=256,bk=128 at bm 16 on an RTX 40xx (99 KB)
    monkeypatch.setattr(mg, "_smem_limit", lambda: 101376)
    per_k = 16 * 2 + 2 * 256 * 2
    assert mg._fit_k(None, per_k, 0, False, 128) == ({"num_stages": 2}, 64)  # 2 x 68 KB do not fit, 1 buffer does
    assert mg._fit_k(4, per_k, 0, False, 128) == ({"num_stages": 4}, 128)  # the tiles' own stages: as asked
    monkeypatch.setattr(mg, "_smem_limit", lambda: None)
    assert mg._fit_k(None, per_k, 0, False, 128) == ({}, 128)  # no GPU: nothing to fit


@needs_ptxas
def test_no_kernel_spills_registers(report):
    """No kernel the engine runs, by default or opt-in (`swap=1`), spills registers (its stack frame or local memory:
    cuobjdump's STACK + LOCAL). The --runslow grid's unswapped bk=128 expert tiles are sweep candidates, not
    defaults: at bn=256 their up kernel spills up to ~1 KB a thread on sm_90, which a sweep's timing then shows; they
    are left out here."""
    _, result, _ = report
    spills = [(a, r["kernel"], r["label"], r["spill"]) for a, arch in result["archs"].items()
              for r in arch["kernels"] if r["spill"] and ("bk=128" not in r["label"] or "swap=1" in r["label"])]
    assert not spills


@needs_ptxas
def test_expert_weights_are_loaded_in_vectors(report):
    """No expert kernel loads global memory a byte at a time. The int4 kernels did (each packed byte loaded
    twice, once per nibble, by a per-element gather): 32 one-byte loads per K tile of the up kernel. And the weight
    tiles (every format) reach shared memory by 16-byte cp.async, which Triton's pipeliner issues stages ahead of
    their use: a change that made a weight load an ld.global would wait out its latency in every K tile."""
    _, result, _ = report
    for arch in result["archs"].values():
        for r in arch["kernels"]:
            if r["kernel"] in ("_moe_up_kernel", "_moe_down_kernel", "_linear_q_kernel"):
                assert "1" not in r["loads"], (r["label"], r["loads"])
                assert max(int(w) for w in r["loads"]) >= 8, (r["label"], r["loads"])
                if r["num_stages"] >= 2:  # one stage: nothing to pipeline
                    assert "16" in r["async_loads"], (r["label"], r["async_loads"])
                    # waited for in every K tile: only the int4 scales (2 bytes), never a weight or activation tile
                    assert all(int(w) <= 2 for w in r["loop_plain_loads"]), (r["label"], r["loop_plain_loads"])


@needs_ptxas
def test_int4_dequantisation_stays_cheap(report):
    """The issue model of a step's expert kernels (instructions per weight from the compiled K-tile loop, times the
    M blocks each expert's weights are dequantised in): the int4 experts were 16-20 instructions per weight
    (instruction-bound 3.3x over their bytes on an H100), then 4.2-4.5 with the nibbles interleaved into K order;
    now ~3.4 / 4.0 at BM 32. The M tile counts as much: sized for the mean load (BM 16 at batch 1, 64 at batch 4),
    nearly half the experts took two blocks (1.43 / 1.47 blocks an expert), ~3.2 ms of issue at batch 1 against
    3.6 ms of bytes and 3.75 ms at batch 4 (instruction-bound); bm=auto now sizes it for the routing's spread."""
    _, result, _ = report
    model = {(r["experts"], r["batch"]): r for r in result["archs"]["90"]["issue_model"]}
    batches = {b for _, b in model} | {1}  # batch 4 with --runslow
    assert set(model) == {(e, b) for e in ("native", "fp8", "int4", "fp8-a8") for b in batches}
    # fp8 activations (experts="w8a8"): the dots take the fp8 weights as stored, so the K loops convert nothing:
    # 1.05 / 1.66 instructions per weight against weight-only fp8's 4.13 / 4.61 (2026-11-29; each K tile's sum
    # promoted to full fp32 included)
    a8, w8 = model["fp8-a8", 1], model["fp8", 1]
    assert a8["up_instr_per_weight"] < 0.4 * w8["up_instr_per_weight"]
    assert a8["down_instr_per_weight"] < 0.5 * w8["down_instr_per_weight"]
    one = model["int4", 1]
    assert one["up_instr_per_weight"] < 3.6 and one["down_instr_per_weight"] < 4.2
    assert one["m_blocks_per_expert"] < 1.01
    assert one["issue_ms"] < 0.75 * one["bytes_ms"]  # margin under the bytes
    if 4 in batches:
        four = model["int4", 4]
        assert four["m_blocks_per_expert"] < 1.01 and four["issue_ms"] < four["bytes_ms"]
    assert all(row["bound"] == "memory" for row in model.values())
    # Little's law: each expert kernel keeps more bytes in flight per SM (resident blocks x stages issued ahead)
    # than an H100's bandwidth x loaded latency needs; short of it, no kernel could reach the bandwidth
    for row in model.values():
        assert min(row["in_flight_kb_per_sm"].values()) > row["in_flight_kb_needed"] > 20, row


@needs_ptxas
def test_w8a8_projections_convert_no_weight(report):
    """The fp8 projections with fp8 activations (experts="w8a8"): at a canvas the kernel takes wgmma with both fp8
    tiles from shared memory as loaded, so its K-tile loop holds no conversion: 99 instructions against the int8
    weight-only kernel's 164 at the same tiles (2026-11-29), in fewer registers and shared memory, no spill."""
    _, result, _ = report
    rows = {r["label"]: r for r in result["archs"]["90"]["kernels"] if r["kernel"] == "_linear_q_kernel"}
    canvas = [x for x in rows if x.startswith("linear fp8-a8") and x.endswith("canvas x1")]
    assert canvas, sorted(rows)
    for label in canvas:
        a8, w8 = rows[label], rows[label.replace("fp8-a8", "int8")]
        assert a8["mma"] == w8["mma"] == "wgmma" and a8["spill"] == 0, a8
        assert a8["loop"] < 0.7 * w8["loop"] and a8["regs"] <= w8["regs"] + 8 and a8["shared"] < w8["shared"], (a8, w8)
    assert any(x.startswith("linear fp8-a8") for x in rows) and any(
        r["kernel"] == "_quant_rows_kernel" and "linear fp8-a8" in r["label"] for r in result["archs"]["90"]["kernels"])


def test_compile_only_refuses_interpreted_kernels():
    from blockpress.kernels import _triton

    if _triton.triton is None or not _triton.interpreted():
        pytest.skip("this process's kernels are compiled ones (CUDA or TRITON_INTERPRET=0)")
    from blockpress.lab.aot import compile_only

    with pytest.raises(RuntimeError, match="process of its own"):
        with compile_only(90):
            pass


def test_fp8_kernels_need_ada_or_later(monkeypatch):
    """Triton has no e4m3 before sm_89 (compile_report --arch 86 shows the error): fp8 weights take torch there."""
    from blockpress.kernels import _triton

    monkeypatch.setattr(_triton, "usable_on", lambda device: True)
    for cap, ok in (((8, 6), False), ((8, 0), False), ((8, 9), True), ((9, 0), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert _triton.fp8_usable_on(torch.device("cuda")) is ok
    assert _triton.fp8_usable_on(torch.device("cpu"))  # the interpreter: no such limit


def test_sass_loop_counting_reads_every_branch_form():
    """The largest loop body is found from a backward branch in Hopper's and Blackwell's SASS spellings."""
    from blockpress.lab.aot import sass_counts

    def sass(branch):
        lines = [f"        /*{a:04x}*/                   IADD3 R1, R1, 0x1, RZ ;" for a in range(0, 0x80, 0x10)]
        lines.append(f"        /*0080*/              {branch} ;")
        return "\n".join(lines)

    for branch in ("BRA 0x20", "@P0 BRA 0x20", "BRA.U !UP0, 0x20", "@!P1 BRA `(.L_x_3) 0x20"):
        assert sass_counts(sass(branch)) == (9, 7), branch  # 0x20..0x80: 7 instructions
    assert sass_counts(sass("BRA 0x90")) == (9, 0)  # a forward branch is no loop


def test_ptx_loop_loads_counts_the_plain_loads_of_the_largest_loop():
    """ld.global inside the loop (from LLVM's loop-header label to the last branch back) are counted by width;
    those before it, after it and the cp.async copies are not."""
    from blockpress.lab.aot import ptx_loop_loads

    ptx = """
    ld.global.b64 { %rd1 }, [ %rd2 + 0 ];
$L__BB0_3:                              // =>This Inner Loop Header: Depth=1
    @%p1 ld.global.b16 { %rs1 }, [ %rd3 + 0 ];
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd4 + 0 ];
    cp.async.cg.shared.global [ %r5 + 0 ], [ %rd5 + 0 ], 0x10, %r6;
    @%p2 bra $L__BB0_3;
    bra.uni $L__BB0_4;
$L__BB0_4:
    ld.global.v2.b32 { %r7, %r8 }, [ %rd6 + 0 ];
"""
    assert ptx_loop_loads(ptx) == {"2": 1, "16": 1}
    assert ptx_loop_loads(ptx.replace("Loop Header", "")) == {}
    # LLVM puts the header comment on a line of its own when the label has another comment
    split = ptx.replace("$L__BB0_3:                              // =>This Inner Loop Header: Depth=1",
                        "$L__BB0_3:                              // %__nv_fast_logf.exit\n"
                        "                                        // =>This Inner Loop Header: Depth=1")
    assert split != ptx and ptx_loop_loads(split) == {"2": 1, "16": 1}
