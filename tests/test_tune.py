"""`blockpress tune` (lab/tune.py, cli/tune.py) and the tuned-settings file it keeps (kernels/tuned.py): the fastest
setting that agrees is kept, per device and shape; `configure` uses it where no setting is asked for; a damaged or
unwritable file never stops a load and is never overwritten."""

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from blockpress import kernels
from blockpress.errors import InputError
from blockpress.kernels import tuned
from blockpress.lab import tune
from blockpress.lab.presets import preset_config
from blockpress.lab.random_weights import build_model
from blockpress.config import ModelConfig

from kernel_device import DEV, needs_triton

pytestmark = pytest.mark.no_grad
TEXT = ModelConfig.from_dict(preset_config("tiny")[0]).text
CPU = torch.device("cpu")


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    p = tmp_path / "cache" / "tuned.json"
    monkeypatch.setenv("BLOCKPRESS_TUNED", str(p))
    tuned._WARNED.clear()
    return p


def test_a_setting_is_kept_per_device_and_shape_and_replaced_by_a_newer_one(tuned_file):
    fp8, int4 = tuned.experts_key(TEXT, "fp8", torch.bfloat16), tuned.experts_key(TEXT, "int4", torch.bfloat16, 64)
    assert len({fp8, int4, tuned.experts_key(TEXT, "fp8-a8", torch.bfloat16),
                tuned.experts_key(TEXT, "int4", torch.bfloat16, 32), tuned.experts_key(TEXT, "fp8", torch.float32),
                tuned.experts_key(TEXT, "int4", torch.bfloat16, 64, mlp=True)}) == 6
    assert tuned.lookup(CPU, fp8) is None  # no file yet
    where = tuned.store(CPU, fp8, "bm=16,bn=64,bk=128,swap=1", {"bm=16,bn=64,bk=128,swap=1": 0.3}, tokens=256)
    assert where == tuned_file and tuned_file.is_file()
    tuned.store(CPU, int4, "bm=32", {"bm=32": 0.5})
    assert tuned.lookup(CPU, fp8) == "bm=16,bn=64,bk=128,swap=1" and tuned.lookup(CPU, int4) == "bm=32"
    assert tuned.lookup(torch.device("meta"), fp8) is None  # another device: its own settings
    tuned.store(CPU, fp8, "bm=32,bn=64", {"bm=32,bn=64": 0.2})
    data = json.loads(tuned_file.read_text())
    entry = data["devices"]["cpu"][fp8]
    assert data["blockpress_tuned"] == tuned.FORMAT and entry["value"] == "bm=32,bn=64"
    assert entry["times_ms"] == {"bm=32,bn=64": 0.2} and entry["torch"] == torch.__version__ and "date" in entry
    assert tuned.lookup(CPU, int4) == "bm=32"  # the other entry stays
    assert [p.name for p in tuned_file.parent.iterdir()] == ["tuned.json"]  # no temporary file left


def test_the_file_is_found_by_the_environment_and_lookups_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv("BLOCKPRESS_TUNED")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuned.path() == tmp_path / "blockpress" / "tuned.json"
    monkeypatch.setenv("BLOCKPRESS_TUNED", " OFF ")
    assert tuned.path() is None and tuned.lookup(CPU, "any") is None
    with pytest.raises(InputError, match="BLOCKPRESS_TUNED=off: nothing is kept"):
        tuned.store(CPU, "any", 1, {})


@pytest.mark.parametrize("content,words", [("{not json", "not readable JSON"),
                                           ('{"devices": {}}', "not a blockpress tuned-settings file"),
                                           ('{"blockpress_tuned": 1, "devices": {"cpu": {"k": {}}}}',
                                            "not a blockpress tuned-settings file")])
def test_a_damaged_file_is_ignored_by_lookups_and_never_overwritten(tuned_file, content, words):
    tuned_file.parent.mkdir(parents=True)
    tuned_file.write_text(content)
    with pytest.warns(UserWarning, match=words):
        assert tuned.lookup(CPU, "k") is None
    with pytest.raises(InputError, match=f"{words}.*delete it") as e:
        tuned.store(CPU, "k", 1, {})
    assert "\n" not in str(e.value) and str(tuned_file) in str(e.value)
    assert tuned_file.read_text() == content


def test_a_failed_write_leaves_the_old_file_as_it_was(tuned_file, monkeypatch):
    tuned.store(CPU, "k", 1, {"1": 1.0})
    before = tuned_file.read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuned.os, "replace", full_disk)
    with pytest.raises(InputError, match="No space left on device.*the old file is unchanged"):
        tuned.store(CPU, "k", 2, {"2": 0.5})
    assert tuned_file.read_bytes() == before
    assert [p.name for p in tuned_file.parent.iterdir()] == ["tuned.json"]


def _model(precision="fp8", linears="native"):
    cfg = copy.deepcopy(preset_config("tiny")[0])
    m = build_model(cfg, DEV, torch.float32, "native", 0, 0.02, 64)
    kernels.configure(m, precision=precision, linears=linears, group_size=32)
    return m


@needs_triton
def test_configure_runs_the_tuned_tiles_unless_tiles_are_asked_for(tuned_file):
    """Where the Triton kernels run: the experts take the tiles kept for their format and shapes, fp8 weight-only and
    fp8 x fp8 each their own, an int4 MLP its own; a `moe_tiles` given wins; "tuned" says what came from the file."""
    m = _model("fp8")
    key = tuned.experts_key(m.text, "fp8", torch.float32)
    tuned.store(DEV, key, "bm=16,bn=32,bk=32", {"bm=16,bn=32,bk=32": 1.0})
    got = kernels.configure(m, precision="fp8", group_size=32, experts="triton")
    assert got["moe_tiles"] == m.layers[0].experts.tiles.spec() == "bm=16,bn=32,bk=32"
    assert got["tuned"] == {"moe_tiles": "bm=16,bn=32,bk=32"}
    # a kernel with no tiles (the torch reference): they are set but not reported as in use
    assert "tuned" not in kernels.configure(m, precision="fp8", group_size=32, experts="torch")
    got = kernels.configure(m, precision="fp8", group_size=32, moe_tiles="bm=32")
    assert got["moe_tiles"] == m.layers[0].experts.tiles.spec() == "bm=32,bn=128,bk=64" and "tuned" not in got
    default = kernels.configure(m, precision="fp8", group_size=32, experts="w8a8")  # fp8 x fp8: nothing kept yet
    assert "tuned" not in default and default["moe_tiles"] != "bm=16,bn=32,bk=32"
    tuned.store(DEV, tuned.experts_key(m.text, "fp8-a8", torch.float32), "bm=16,bn=64,bk=64", {})
    assert kernels.configure(m, precision="fp8", group_size=32, experts="w8a8")["moe_tiles"] == "bm=16,bn=64,bk=64"
    m4 = _model("int4", "int4-mlp")
    mlp_key = tuned.experts_key(m4.text, "int4", torch.float32, 32, mlp=True)
    tuned.store(DEV, mlp_key, "bm=16,bn=32,bk=32", {})
    got = kernels.configure(m4, precision="int4", linears="int4-mlp", group_size=32)
    mlp = m4.layers[0].mlp.experts
    assert mlp.tiles.spec() == "bm=16,bn=32,bk=32"
    # named as in use where the MLP runs its Triton kernel ("auto": on a GPU; a CPU runs its torch path)
    runs = "triton" in mlp.resolved_backend(torch.empty(0, device=DEV))
    assert got.get("tuned", {}).get("mlp_tiles") == ("bm=16,bn=32,bk=32" if runs else None)
    assert m4.layers[0].experts.tiles.spec() == got["moe_tiles"] != "bm=16,bn=32,bk=32"  # int4 experts: defaults


@needs_triton
def test_configure_runs_the_tuned_projection_tiles_for_their_format(tuned_file):
    """8-bit projections: the tiles kept for int8, fp8 weight-only and fp8 x fp8 are three settings; a
    `linear_tiles` given wins."""
    m = _model("native", "fp8")
    for fmt, spec in (("fp8", "bm=auto,bn=32,bk=64"), ("fp8-a8", "bm=auto,bn=64,bk=128")):
        tuned.store(DEV, tuned.linears_key(m.text, fmt, torch.float32), spec, {})
    lin = kernels.quantized_linears(m)
    got = kernels.configure(m, linears="fp8", experts="triton")
    assert got["linear_tiles"] == got["tuned"]["linear_tiles"] == "bm=auto,bn=32,bk=64"
    assert {q.tiles_spec for q in lin} == {"bm=auto,bn=32,bk=64"}
    got = kernels.configure(m, linears="fp8", experts="w8a8")
    assert got["linear_tiles"] == "bm=auto,bn=64,bk=128" and {q.tiles_spec for q in lin} == {"bm=auto,bn=64,bk=128"}
    assert "tuned" not in kernels.configure(m, linears="fp8", experts="torch")  # the reference: tiles unused
    got = kernels.configure(m, linears="fp8", linear_tiles="bm=auto,bn=64,bk=64,split=2")
    assert "tuned" not in got and {q.tiles_spec for q in lin} == {"bm=auto,bn=64,bk=64,split=2"}
    m8 = _model("native", "int8")
    assert "tuned" not in kernels.configure(m8, linears="int8")  # int8: nothing kept


@needs_triton
def test_the_attention_kernel_runs_the_tuned_tiles_unless_tiles_are_asked_for(tuned_file):
    """The attention kernel (on a GPU, where configure selects it): the tiles kept for the model's shapes, an asked
    spec instead, an asked `attention_split` over either; a kept value that is not a tiles spec is ignored with a
    warning."""
    from blockpress.kernels.select import _attention_tiles

    def tiles(asked=None, split=None):
        noted = {}
        return _attention_tiles(DEV, TEXT, torch.float32, asked, split, noted), noted.get("attention_tiles")

    assert tiles() == ("", None)  # nothing kept: the defaults
    tuned.store(DEV, tuned.attention_key(TEXT, torch.float32), "sliding:bm=32,split=2", {})
    assert tiles() == ("sliding:bm=32,split=2", "sliding:bm=32,split=2")
    assert tiles(split=3) == ("sliding:bm=32,split=3;full:split=3", "sliding:bm=32,split=2")
    assert tiles("full:dv=16") == ("full:dv=16", None)
    tuned.store(DEV, tuned.attention_key(TEXT, torch.float32), 2, {})  # what the first tuner kept: a count of runs
    with pytest.warns(UserWarning, match="attention tiles spec is a string"):
        assert tiles() == ("", None)


@needs_triton
def test_a_load_says_in_one_line_which_settings_came_from_the_file(tuned_file, capsys):
    import blockpress

    cfg = preset_config("tiny")[0]
    blockpress.from_config(cfg, device=DEV, precision="fp8", experts="triton")
    assert "tuned" not in capsys.readouterr().err  # nothing kept yet
    text = ModelConfig.from_dict(cfg).text
    tuned.store(DEV, tuned.experts_key(text, "fp8", torch.float32, 64), "bm=16,bn=32,bk=32", {})
    lm = blockpress.from_config(cfg, device=DEV, precision="fp8", experts="triton")
    err = capsys.readouterr().err
    assert err == f"blockpress: kernel settings tuned on this device ({tuned_file}): moe_tiles bm=16,bn=32,bk=32\n"
    assert lm.module.layers[0].experts.tiles.spec() == "bm=16,bn=32,bk=32"
    lm.configure(sampler="fast")  # a change of options later: no line again
    blockpress.from_config(cfg, device=DEV, precision="fp8", experts="triton", moe_tiles="bm=32")  # asked: no file
    assert capsys.readouterr().err == ""


@needs_triton
def test_a_tuned_value_the_engine_refuses_is_ignored_with_a_warning(tuned_file):
    m = _model("fp8")
    tuned.store(DEV, tuned.experts_key(m.text, "fp8", torch.float32), "bn=48", {})
    with pytest.warns(UserWarning, match="bn=48.*powers of two.*run blockpress tune again"):
        got = kernels.configure(m, precision="fp8", group_size=32)
    assert "tuned" not in got and got["moe_tiles"] == m.layers[0].experts.tiles.spec()


def test_the_fastest_setting_that_agrees_is_chosen_never_a_wrong_one():
    """A wrong candidate is never kept however fast it is; the first is checked against the reference itself."""
    x = torch.randn(8, 4)
    right = lambda x, w, idx: x * 2  # noqa: E731

    def call(x, w, idx, tiles):
        if tiles.block_m == 16:
            return x * 2.1  # fast and wrong
        time.sleep(0.02 if tiles.block_m == 32 else 0.0)
        return x * 2 * (1 + 1e-7)

    rows, vs_torch = tune.sweep_tiles(call, right, x, None, None, ["bm=32", "bm=16", "bm=64"], CPU, repeats=1)
    assert vs_torch < 1e-6 and [r["ok"] for r in rows] == [True, False, True]
    assert rows[1]["rel_err_vs_first"] > 0.04 and tune.fastest(rows)["spec"].startswith("bm=64")
    rows, vs_torch = tune.sweep_tiles(lambda *a: a[0] * 3, right, x, None, None, ["bm=32"], CPU, repeats=1)
    assert vs_torch > 0.4 and tune.fastest(rows) is None  # the first disagrees with the reference: nothing
    broken = tune.sweep_tiles(lambda *a: 1 / 0, right, x, None, None, ["bm=32"], CPU, repeats=1)[0]
    assert broken[0]["failed"].startswith("ZeroDivisionError") and tune.fastest(broken) is None


def test_the_attention_candidates_start_with_the_defaults_and_quick_ones_are_among_them():
    """Each head dim's candidates start with the built-in tiles (the reference point of the others) and hold no
    setting twice; `--quick`'s are a subset, so the compile test's check for spills (`--runslow`: every candidate)
    covers them; other head dims take the key runs."""
    from blockpress.kernels.attention_fixed import parse_attention_tiles

    for D in (256, 512):
        full, quick = tune.attention_candidates(D), tune.attention_candidates(D, quick=True)
        assert full[0] == quick[0] == "" and len(set(full)) == len(full) and set(quick) < set(full)
        assert len({str(parse_attention_tiles(s)) for s in full}) == len(full)  # distinct settings, each valid
    assert tune.attention_candidates(32) == tune.attention_candidates(32, quick=True) == list(tune.SPLITS)


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
@needs_triton
def test_tune_keeps_the_fastest_agreeing_settings_and_a_dry_run_keeps_nothing(tuned_file, capsys):
    from blockpress.cli import main

    argv = ["tune", "--preset", "tiny", "--device", str(DEV), "--grid", "bm=16;bn=16,32;bk=16", "--repeats", "1",
            "--context", "24"]
    assert main(argv + ["--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kept"] is None and not tuned_file.exists()
    assert main(argv + ["--precision", "int4", "--linears", "int4-mlp", "--group-size", "32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kept"] == str(tuned_file)
    kept = json.loads(tuned_file.read_text())["devices"][tuned.device_key(DEV)]
    results = out["results"]
    assert set(kept) == set(results) and len(kept) == 3  # the experts, the int4 MLP, the attention
    for key, res in results.items():
        rows = res["rows"]
        assert all(r["ok"] for r in rows)
        if key.startswith(("experts", "mlp")):
            assert kept[key]["value"] == min(rows, key=lambda r: r["ms"])["spec"]
            assert [r["spec"] for r in rows] == [res["default"], "bm=16,bn=16,bk=16", "bm=16,bn=32,bk=16"]
            assert kept[key]["times_ms"] == {r["spec"]: r["ms"] for r in rows}
            assert all(r["gbs"] > 0 for r in rows)  # the expert bytes the tokens hit, over the time
        else:  # the attention: each kind of layer's fastest, kept as one spec (the tiny model's head dims: key runs)
            assert [(r["kind"], r["spec"]) for r in rows] == [(k, s) for k in ("sliding", "full") for s in tune.SPLITS]
            best = {k: min((r for r in rows if r["kind"] == k), key=lambda r: r["ms"])["spec"] for k in ("sliding",
                                                                                                         "full")}
            assert kept[key]["value"] == res["best"] == ";".join(f"{k}:{v}" for k, v in best.items() if v)
            assert kept[key]["times_ms"] == {f"{r['kind']}:{r['spec']}": r["ms"] for r in rows}
            assert res["rel_err_vs_torch"] < 1e-4 and res["best_ms"] <= res["default_ms"]
    assert "experts int4 g=32" in " ".join(kept) and "mlp int4 g=32" in " ".join(kept)
    # fp8 weights with fp8 activations: the w8a8 experts' tiles and the projections' (the kernel's three candidates
    # after its default), checked against the fp8 x fp8 reference
    assert main(argv + ["--precision", "fp8", "--linears", "fp8", "--fp8-activations"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept = json.loads(tuned_file.read_text())["devices"][tuned.device_key(DEV)]
    lin = out["results"][tuned.linears_key(TEXT, "fp8-a8", torch.float32)]
    assert [r["spec"] for r in lin["rows"]] == tune.LINEAR_SPECS["fp8-a8"] and lin["rel_err_vs_torch"] < 1e-4
    assert kept[tuned.linears_key(TEXT, "fp8-a8", torch.float32)]["value"] == min(
        lin["rows"], key=lambda r: r["ms"])["spec"]
    assert tuned.experts_key(TEXT, "fp8-a8", torch.float32) in kept and len(kept) == 5


@needs_triton
def test_tune_refuses_a_file_it_cannot_replace_before_timing_anything(tuned_file, capsys):
    from blockpress.cli import main

    tuned_file.parent.mkdir(parents=True)
    tuned_file.write_text("[]")
    assert main(["tune", "--preset", "tiny", "--device", str(DEV)]) == 2
    captured = capsys.readouterr()
    assert "is not a blockpress tuned-settings file" in captured.err and "[experts" not in captured.err
    assert tuned_file.read_text() == "[]"


@pytest.mark.parametrize("argv,words", [
    (["--fp8-activations"], "--fp8-activations tunes the fp8 x fp8 kernels of fp8 weights: add --precision fp8 and / "
                            "or --linears fp8"),
    (["--quick", "--grid", "bm=16"], "give --grid or --quick, not both"),
    (["--grid", "bm=17"], "--grid: bm=17: tile sizes must be powers of two"),
    (["kjv", "--preset", "tiny"], "give MODEL or --preset, not both"),
])
@needs_triton
def test_tune_refuses_bad_flags_in_one_line(argv, words, capsys, tuned_file):
    from blockpress.cli import main

    assert main(["tune", "--device", str(DEV)] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and not tuned_file.exists()


@pytest.mark.parametrize("interpreter,argv", [("0", ["--device", "cpu"]), ("1", [])])
def test_tune_without_a_gpu_says_what_it_needs(interpreter, argv):
    """No CUDA GPU: refused in one line, also where Triton's interpreter could run unless --device cpu asks for it
    (a user's CPU would otherwise spend hours interpreting the 26B shapes)."""
    env = {**os.environ, "TRITON_INTERPRET": interpreter, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("BLOCKPRESS_DEVICE", None)
    r = subprocess.run([sys.executable, "-m", "blockpress", "tune", "--preset", "tiny"] + argv, capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("blockpress tune: error: tune times the Triton kernels, which run on a CUDA GPU (cpu "
                                "here: it runs the torch kernels, which have no settings to tune); on a GPU machine: "
                                "pip install 'blockpress[gpu]'")
