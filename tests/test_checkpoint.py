"""Loading and saving checkpoints: both directions with transformers, shards, Hub cache, bad files."""

import json
import shutil

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockpress
from blockpress.errors import CheckpointError, ConfigError, InputError
from blockpress.kernels import kernel_names, use
from hf_oracle import build_hf_model, hf_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.no_grad  # inference: conftest runs each test without autograd


def _logits_hf(hf, ids, canvas):
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config.text_config)
    return hf(input_ids=ids, decoder_input_ids=canvas, past_key_values=cache).logits


def _logits_bp(bp, ids, canvas):
    cache = bp.module.new_cache(ids.shape[0], ids.shape[1])
    bp.module.encode(ids, cache)
    return bp.module.decode(canvas, cache)


IDS = torch.randint(5, 512, (2, 12), generator=torch.Generator().manual_seed(0))
CANVAS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))


def test_blockpress_saved_checkpoint_loads_in_transformers(hf_tiny_dir, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    path, hf = hf_tiny_dir
    bp = blockpress.load(path, dtype="float32", progress=False)
    with torch.no_grad():  # make sure we save *our* weights, not a copy of the input
        bp.module.layers[0].encoder_layer_scalar.fill_(1.25)
        bp.module.norm.weight.mul_(1.1)
    out = bp.save(tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    re_hf = DiffusionGemmaForBlockDiffusion.from_pretrained(out, dtype=torch.float32)
    re_hf.set_attn_implementation("eager")
    re_hf.set_experts_implementation("eager")
    re_hf.eval()
    use(bp.module, attention="eager")
    assert (_logits_hf(re_hf, IDS, CANVAS) - _logits_bp(bp, IDS, CANVAS)).abs().max() < 2e-5
    # and it loads back into blockpress identically
    again = blockpress.load(out, dtype="float32", progress=False)
    use(again.module, attention="eager")
    assert torch.equal(_logits_bp(again, IDS, CANVAS), _logits_bp(bp, IDS, CANVAS))
    sharded = bp.save(tmp_path / "sharded", shard_bytes=200_000)  # shards with an index, as the Hub's
    assert (sharded / "model.safetensors.index.json").is_file()
    re_hf = DiffusionGemmaForBlockDiffusion.from_pretrained(sharded, dtype=torch.float32)
    re_hf.set_attn_implementation("eager")
    re_hf.set_experts_implementation("eager")
    assert (_logits_hf(re_hf.eval(), IDS, CANVAS) - _logits_bp(bp, IDS, CANVAS)).abs().max() < 2e-5


def test_sharded_checkpoint_loads(hf_tiny_dir, tmp_path):
    path, hf = hf_tiny_dir
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    a = blockpress.load(tmp_path, dtype="float32", progress=False)
    b = blockpress.load(path, dtype="float32", progress=False)
    assert torch.equal(_logits_bp(a, IDS, CANVAS), _logits_bp(b, IDS, CANVAS))


def test_loads_on_meta_then_assigns_once(hf_tiny_dir):
    path, _ = hf_tiny_dir
    bp = blockpress.load(path, dtype="float32", progress=False)
    tensors = list(bp.module.parameters()) + list(bp.module.buffers())
    assert all(t.device.type == "cpu" and not t.is_meta for t in tensors)
    bf = blockpress.load(path, dtype="bfloat16", progress=False)
    assert bf.module.embed_tokens.weight.dtype == torch.bfloat16


def test_hub_id_from_local_cache(hf_tiny_dir, tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub (offline here: from a populated cache)."""
    path, _ = hf_tiny_dir
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-dg" / "snapshots" / ("a" * 40)
    shutil.copytree(path, snap)
    (cache / "models--acme--tiny-dg" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-dg" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    bp = blockpress.load("acme/tiny-dg", dtype="float32", progress=False)
    assert bp.config.canvas_length == 16
    # offline and not cached: said plainly (the hub's message, cut at 200 characters, ended "set 'HF_HUB_OFFLINE);
    # check the id": the opposite advice)
    with pytest.raises(CheckpointError, match=r"^could not fetch 'acme/missing': the Hugging Face Hub is in offline "
                                              r"mode \(HF_HUB_OFFLINE=1\) and the model is not in the local cache; "
                                              "unset HF_HUB_OFFLINE to download it, download it first"):
        blockpress.load("acme/missing", progress=False)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_clear_errors_for_bad_checkpoints(hf_tiny_dir, tmp_path, capsys):
    path, _ = hf_tiny_dir
    with pytest.raises(CheckpointError, match="neither a folder, a shipped model .*nor a Hub id"):
        blockpress.load(tmp_path / "nope" / "x" / "y")
    from blockpress.loading import SHIPPED_MODELS, resolve_path

    assert resolve_path("sudoku") == SHIPPED_MODELS["sudoku"]  # a shipped model by name
    (tmp_path / "sudoku").mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve_path("sudoku") == Path("sudoku")  # a folder of that name wins
    finally:
        os.chdir(cwd)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json not found"):
        blockpress.load(empty)
    # pickle only
    pk = _copy(path, tmp_path / "pickle")
    (pk / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, pk / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        blockpress.load(pk)
    # truncated safetensors
    tr = _copy(path, tmp_path / "trunc")
    data = (tr / "model.safetensors").read_bytes()
    (tr / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated|re-download"):
        blockpress.load(tr, progress=False)
    # malformed config
    bad = _copy(path, tmp_path / "badcfg")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        blockpress.load(bad)
    # wrong model type
    wt = _copy(path, tmp_path / "wrongtype")
    cfg = json.loads((wt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (wt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        blockpress.load(wt)
    # shape mismatch: names the tensor, expected and found
    sm = _copy(path, tmp_path / "shape")
    sd = load_file(sm / "model.safetensors")
    sd["model.decoder.layers.1.self_attn.q_proj.weight"] = torch.zeros(8, 64)
    save_file(sd, sm / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"q_proj.weight.*\[8, 64\].*\[128, 64\]"):
        blockpress.load(sm, progress=False)
    # missing tensor
    ms = _copy(path, tmp_path / "missing")
    sd = load_file(ms / "model.safetensors")
    del sd["model.decoder.layers.2.mlp.up_proj.weight"]
    save_file(sd, ms / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        blockpress.load(ms, progress=False)
    # missing shard
    sh = tmp_path / "shards"
    build_hf_model(hf_config()).save_pretrained(sh, max_shard_size="200KB")
    next(sh.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard"):
        blockpress.load(sh, progress=False)
    # devices and dtypes torch cannot use here: one line naming why
    with pytest.raises(InputError, match="unknown device 'tpu:0'"):
        blockpress.load(path, device="tpu:0", progress=False)
    for bad in (torch.int8, torch.float8_e4m3fn, "half-ish"):  # an 8-bit float was taken, and failed in torch later
        with pytest.raises(ConfigError, match="is not one the model computes in; use one of"):
            blockpress.load(path, dtype=bad, progress=False)
    import unittest.mock

    with unittest.mock.patch("torch.cuda.is_available", return_value=False):
        with pytest.raises(InputError, match="torch sees no CUDA GPU here"):
            blockpress.load(path, device="cuda", progress=False)
        with pytest.raises(InputError, match="torch sees no CUDA GPU here"):
            blockpress.from_config(json.loads((Path(path) / "config.json").read_text()), device="cuda:1")
    # the default device can be chosen by $BLOCKPRESS_DEVICE (named in its errors)
    from blockpress.loading import parse_device

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("BLOCKPRESS_DEVICE", raising=False)
        assert parse_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
        mp.setenv("BLOCKPRESS_DEVICE", "cpu")
        assert parse_device(None) == torch.device("cpu") and blockpress.load(path, progress=False).device.type == "cpu"
        mp.setenv("BLOCKPRESS_DEVICE", "gpu0")
        with pytest.raises(InputError, match=r"unknown device 'gpu0' \(from \$BLOCKPRESS_DEVICE\)"):
            blockpress.load(path, progress=False)
        assert parse_device("cpu") == torch.device("cpu")  # an explicit device wins
    # a bad generation_config.json is named at load, not blamed on a later generate()
    for i, (text, needle) in enumerate((('{"entropy_bound": -1}', "entropy_bound=-1"),
                                        ('{"eos_token_id": [1, 512]}', r"eos_token_id=512: .*\[0, 512\)"),
                                        ("[1]", "must contain a JSON object"))):
        gc = _copy(path, tmp_path / f"gencfg{i}")
        (gc / "generation_config.json").write_text(text)
        with pytest.raises(ConfigError, match=f"generation_config.json.*{needle}.*delete it"):
            blockpress.load(gc, progress=False)


def test_vision_weights_are_reported_once_not_fatal(hf_tiny_dir, capfd):
    path, _ = hf_tiny_dir
    blockpress.load(path, progress=False)
    err = capfd.readouterr().err
    assert err.count("vision-tower tensors present and unused") == 1


def test_save_is_atomic_on_failure(hf_tiny_dir, tmp_path, monkeypatch):
    path, _ = hf_tiny_dir
    bp = blockpress.load(path, progress=False)
    target = bp.save(tmp_path / "out")
    before = (target / "model.safetensors").read_bytes()
    import safetensors.torch as st

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", boom)
    with pytest.raises(CheckpointError, match="No space left"):
        bp.save(target)
    assert (target / "model.safetensors").read_bytes() == before  # old checkpoint intact
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp leftovers


def test_save_replaces_only_a_checkpoint_and_keeps_what_the_model_is_for(tmp_path, monkeypatch):
    """A save into a folder holding anything but a checkpoint's files (a user's folder) is refused and deletes
    nothing; into a file, refused; into an earlier checkpoint, it replaces it. The Sudoku model's
    blockpress_task.json goes along (without it the saved model is a text model), and the files get the umask's
    modes, not the temp folder's owner-only ones."""
    import os
    import stat

    lm = blockpress.load("sudoku", progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"holds files that are not a checkpoint's \(notes.txt\)"):
        lm.save(mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="it is a file"):
        lm.save(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="holds files that are not"):
        lm.save(".")  # the working folder, by its name
    old = os.umask(0o022)
    try:
        out = lm.save(tmp_path / "sv")
        lm.save(out)  # an earlier checkpoint is replaced
    finally:
        os.umask(old)
    assert sorted(p.name for p in out.iterdir()) == ["blockpress_objective.json", "blockpress_task.json", "config.json",
                                                     "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755 and stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp or old folders left
    from blockpress.tasks import sudoku as su

    su.require_sudoku_model(blockpress.load(out, progress=False), str(out))  # still a Sudoku model


@pytest.mark.parametrize("precision", ["native", "fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_estimate_is_exact(hf_tiny_dir, precision, dtype):
    """The estimate the memory check uses (from the meta-device module, before any weight is read) equals
    the bytes of the loaded weights, quantised experts included."""
    from blockpress.kernels.quant import QuantizedExperts
    from blockpress.loading import estimated_weight_bytes
    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    path, _ = hf_tiny_dir
    lm = blockpress.load(path, progress=False, precision=precision, dtype=dtype, group_size=16)
    real = sum(p.numel() * p.element_size() for p in lm.module.parameters())
    real += sum(b.numel() * b.element_size() for m in lm.module.modules() if isinstance(m, QuantizedExperts)
                for b in m.buffers())
    with torch.device("meta"):
        meta = DiffusionGemmaModel(lm.config)
    assert estimated_weight_bytes(meta, dtype, precision, group_size=16) == real


def test_a_load_that_cannot_fit_is_refused_before_reading_weights(hf_tiny_dir, monkeypatch):
    """A model too big for the free memory is refused up front with what it needs, what is free and the
    precisions that would fit (a 26B model in bf16 on a 24 GB card would otherwise die mid-load)."""
    import blockpress.loading as loading
    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    path, _ = hf_tiny_dir
    cfg = blockpress.config.ModelConfig.from_file(Path(path) / "config.json")
    with torch.device("meta"):
        meta = DiffusionGemmaModel(cfg)
    need = loading.estimated_weight_bytes(meta, torch.float32, "native")
    int4 = loading.estimated_weight_bytes(meta, torch.float32, "int4")
    monkeypatch.setattr(loading, "_free_bytes", lambda device: (need + int4) // 2)  # int4 fits, fp32 does not
    read = []
    monkeypatch.setattr(loading, "load_weights", lambda *a, **k: read.append(1))
    with pytest.raises(InputError, match=r"the weights need ~.* GiB \(float32, precision native, linears native\) "
                                         r"but cpu has .* free; .*precision int4 needs ~.* GiB \(fits\)"):
        blockpress.load(path, progress=False, dtype="float32")
    assert not read  # refused before any weight was read
    monkeypatch.setenv("BLOCKPRESS_SKIP_MEMORY_CHECK", "1")
    blockpress.load(path, progress=False, dtype="float32")
    assert read == [1]


def test_load_picks_the_fast_kernels_and_keeps_the_references_one_flag_away(hf_tiny_dir, monkeypatch):
    """load() configures the fastest kernels that run here (a loaded model is what run/chat/serve use); the
    plain references stay selectable and give the same tokens; an unknown name is refused before any weight
    is read, with the choices."""
    import blockpress.loading as loading

    path, _ = hf_tiny_dir
    fast = blockpress.load(path, progress=False, dtype="float32")
    ref = blockpress.load(path, progress=False, dtype="float32", experts="loop", attention="sdpa")
    names = kernel_names(fast.module), kernel_names(ref.module)
    assert names[0]["experts"] == "grouped" and names[0]["attention"] == "sdpa_gqa"  # CPU: grouped GEMMs
    assert names[1]["experts"] == "loop" and names[1]["attention"] == "sdpa"
    assert {layer.experts.kernel for layer in fast.module.layers} == {fast.module.layers[0].experts.kernel}
    kw = dict(max_new_tokens=32, max_denoising_steps=4, stability_threshold=None, confidence_threshold=None)
    ids = [[2, 17, 99, 5, 64, 8]]
    a = fast.generate(ids, generator=torch.Generator().manual_seed(0), **kw)
    b = ref.generate(ids, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a.sequences, b.sequences)
    read = []
    monkeypatch.setattr(loading, "load_weights", lambda *a, **k: read.append(1))
    with pytest.raises(InputError, match=r"unknown experts backend 'fused'; use one of .*'grouped'.*'loop'"):
        blockpress.load(path, progress=False, experts="fused")
    with pytest.raises(InputError, match=r"unknown attention backend 'flash'; use one of .*'sdpa_gqa'"):
        blockpress.load(path, progress=False, attention="flash")
    assert not read
    q = blockpress.load(hf_tiny_dir[0], progress=False, dtype="float32", precision="int4", experts="loop")
    assert {layer.experts.backend for layer in q.module.layers} == {"torch"}  # the quantised experts' reference
    assert kernel_names(q.module)["experts"] == "torch"


def _set_header_dtype(file: Path, key: str, dtype: str) -> None:
    """Flip one tensor's dtype in a safetensors header in place (same length: the data is read as another type)."""
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode()
    old = json.loads(header)[key]["dtype"]
    at = header.index(f'"{key}"')
    at = header.index(f'"dtype":"{old}"', at)
    new = header[:at] + f'"dtype":"{dtype}"' + header[at + len(f'"dtype":"{old}"'):]
    assert len(new) == len(header)
    raw[8:8 + n] = new.encode()
    file.write_bytes(bytes(raw))


def test_damaged_checkpoints_are_refused_naming_the_tensor(hf_tiny_dir, tmp_path):
    """A weight stored as an integer or bool type (a flipped dtype byte in the header, an int32 or bool tensor)
    was cast and used; a sharded index could name a file outside the folder; a symlink loop read as 'No such
    file or directory'."""
    path, _ = hf_tiny_dir
    key = "model.decoder.layers.1.self_attn.q_proj.weight"
    flipped = _copy(path, tmp_path / "flipped")
    _set_header_dtype(flipped / "model.safetensors", key, "I32")
    with pytest.raises(CheckpointError, match=rf"tensor {key} in model.safetensors is stored as I32, expected a "
                                              "floating-point weight"):
        blockpress.load(flipped, progress=False)
    for dtype, name in ((torch.int32, "I32"), (torch.bool, "BOOL")):
        d = _copy(path, tmp_path / f"as-{name}")
        sd = load_file(d / "model.safetensors")
        sd[key] = sd[key].to(dtype)
        save_file(sd, d / "model.safetensors")
        with pytest.raises(CheckpointError, match=f"stored as {name}"):
            blockpress.load(d, progress=False)
    sh = tmp_path / "shards"
    build_hf_model(hf_config()).save_pretrained(sh, max_shard_size="200KB")
    index = json.loads((sh / "model.safetensors.index.json").read_text())
    for outside in ("../elsewhere.safetensors", "/etc/passwd"):
        index["weight_map"][key] = outside
        (sh / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=f"names the shard '{outside}', outside"):
            blockpress.load(sh, progress=False)
    loop = _copy(path, tmp_path / "loop")
    (loop / "model.safetensors").unlink()
    (loop / "model.safetensors").symlink_to("model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is a symlink loop"):
        blockpress.load(loop, progress=False)


def test_nan_or_inf_weights_are_refused_at_load(hf_tiny_dir, tmp_path, capsys):
    """NaN weights loaded and every generation failed later (22-line traceback from `run`, 500s from `serve`
    while /health said ok): refused at load in one line naming the tensor; an overflow of --dtype float16 names
    the dtype; large finite values load."""
    from blockpress.cli import main as cli

    path, _ = hf_tiny_dir
    key = "model.decoder.layers.2.mlp.down_proj.weight"
    nan = _copy(path, tmp_path / "nan")
    sd = load_file(nan / "model.safetensors")
    sd[key][3, 5] = float("nan")
    save_file(sd, nan / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) hold NaN or Inf values \(first: {key}\); the "
                                              "checkpoint is damaged"):
        blockpress.load(nan, progress=False)
    assert cli(["run", str(nan), "hi", "--no-live"]) == 2
    err = capsys.readouterr().err.strip()
    assert "hold NaN or Inf values" in err and "\n" not in err and "Traceback" not in err
    big = _copy(path, tmp_path / "big")
    sd = load_file(big / "model.safetensors")
    sd[key][0, 0] = 1e6  # fine in float32, inf in float16
    save_file(sd, big / "model.safetensors")
    blockpress.load(big, progress=False)
    huge = _copy(path, tmp_path / "huge")  # finite, but their sum is not: the probe called the file damaged
    sd = load_file(huge / "model.safetensors")
    sd[key][0, :2] = 3e38
    save_file(sd, huge / "model.safetensors")
    blockpress.load(huge, progress=False)
    with pytest.raises(CheckpointError, match="once cast to float16: the values overflow it; load with dtype "
                                              "bfloat16 or float32"):
        blockpress.load(big, dtype="float16", progress=False)


def test_pre_quantised_checkpoints_are_refused_naming_the_method(hf_tiny_dir, tmp_path):
    """A block-wise FP8 / NVFP4 checkpoint (a quantization_config in config.json, ModelOpt's hf_quant_config.json,
    F8 weights, or scale tensors beside the weights, without the one pre-quantised scheme blockpress reads:
    tests/test_prequantized.py) loaded as plain floats without its scales and generated garbage: refused before any
    weight is read, naming the method and blockpress's own precision='fp8' / 'int4'."""
    path, _ = hf_tiny_dir
    key = "model.decoder.layers.1.self_attn.q_proj.weight"
    fix = r"load the model's bf16 checkpoint instead and quantise it at load with precision='fp8' or 'int4'"
    for i, (qc, method) in enumerate(((
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8"),
            ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
             r"compressed-tensors \(nvfp4-pack-quantized\)"))):
        d = _copy(path, tmp_path / f"qc{i}")
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=rf"pre-quantised checkpoint \(config.json has a quantization_config, "
                                                  rf"quant_method {method}\) that blockpress cannot read .*{fix}"):
            blockpress.load(d, progress=False)
    mo = _copy(path, tmp_path / "modelopt")
    (mo / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json, quant_method modelopt \(NVFP4\)"):
        blockpress.load(mo, progress=False)
    # the tensors alone tell, without a quantization_config: an F8 weight, or a scale beside a float weight
    f8 = _copy(path, tmp_path / "f8")
    sd = load_file(f8 / "model.safetensors")
    sd[key] = sd[key].to(torch.float8_e4m3fn)
    save_file(sd, f8 / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"model.safetensors holds pre-quantised weights \({key} is stored as "
                                              rf"F8_E4M3\); .*{fix}"):
        blockpress.load(f8, progress=False)
    sc = _copy(path, tmp_path / "scales")
    sd = load_file(sc / "model.safetensors")
    sd[key + "_scale"] = torch.ones(sd[key].shape[0])
    save_file(sd, sc / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"pre-quantised weights \(quantisation tensor {key}_scale, F32\)"):
        blockpress.load(sc, progress=False)
    assert "router.per_expert_scale" in str(load_file(Path(path) / "model.safetensors").keys())  # a weight, loaded


def test_save_failures_are_one_line_errors_and_keep_the_checkpoint(hf_tiny_dir, tmp_path):
    """A full disk or a file size limit (safetensors' SafetensorError "File too large (os error 27)") and a temp
    folder that cannot be made (tempfile.mkdtemp ran outside the error handling: a raw FileNotFoundError /
    PermissionError) were raw exceptions: one-line CheckpointErrors, the existing checkpoint intact, no temp
    folder left; a path under a file names the file."""
    import subprocess
    import sys

    path, _ = hf_tiny_dir
    target = blockpress.load(path, progress=False).save(tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    code = f"""if True:
        import resource, signal, blockpress
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        lm = blockpress.load({str(path)!r}, progress=False)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        for dst in ({str(target)!r}, {str(tmp_path / "new")!r}):
            try:
                lm.save(dst)
            except blockpress.CheckpointError as e:
                print(e)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr[-2000:]
    for line, dst in zip(lines, (target, tmp_path / "new")):
        assert line.startswith(f"could not write checkpoint to {dst} (File too large); a file is over this process's "
                               "size limit (ulimit -f)")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # the old checkpoint intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp folder, no half checkpoint
    lm = blockpress.load(path, progress=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=f"cannot save to {tmp_path}/afile/sub/ck: {tmp_path}/afile is a file, "
                                              "not a folder; choose another path"):
        lm.save(tmp_path / "afile" / "sub" / "ck")
    if Path("/proc/self").is_dir():  # a folder no one can create a temp folder in (root included): mkdtemp fails
        with pytest.raises(CheckpointError, match=r"could not write checkpoint to /proc/blockpress-ck \(No such file "
                                                  r"or directory\); choose another path"):
            lm.save("/proc/blockpress-ck")


def test_save_into_a_symlinked_checkpoint_writes_the_folder_it_names(hf_tiny_dir, tmp_path):
    """`ln -s real link; lm.save("link")` replaced the link with a folder, left real/ stale and a dangling
    .link.old-<pid> beside them: the save goes into real/, the link stays, nothing else is left."""
    import os

    path, _ = hf_tiny_dir
    lm = blockpress.load(path, progress=False)
    real = lm.save(tmp_path / "real")
    (tmp_path / "link").symlink_to("real")
    with torch.no_grad():
        lm.module.norm.weight.mul_(1.5)
    assert lm.save(tmp_path / "link") == tmp_path / "link"
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == "real"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no .link.old-<pid>, no temp folder
    assert torch.equal(load_file(real / "model.safetensors")["model.decoder.norm.weight"], lm.module.norm.weight)
    (tmp_path / "dangling").symlink_to("later")  # a link to a folder not made yet: made there
    lm.save(tmp_path / "dangling")
    assert (tmp_path / "dangling").is_symlink() and (tmp_path / "later" / "model.safetensors").is_file()
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(CheckpointError, match="loop: it is a symlink loop"):
        lm.save(tmp_path / "loop")


def _unprivileged(code: str):
    """Run `code` in a Python subprocess where file permissions hold: as root, without the capabilities that
    bypass them (setpriv); None where that cannot be done."""
    import os
    import subprocess
    import sys

    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return None
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    r = subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return None if r.stderr.startswith("setpriv:") else r  # setpriv not allowed here (a container without CAP_SETPCAP)


def test_odd_folders_and_options_fail_in_one_line_before_reading_weights(hf_tiny_dir, tmp_path, monkeypatch):
    """Raw tracebacks at load: an index whose weight_map is a list (AttributeError) or not UTF-8
    (UnicodeDecodeError), a run's `latest` file that is not UTF-8, an unreadable config.json (PermissionError),
    int4 on a model with an odd input size (ValueError mid-load), device="mps" on a torch without MPS."""
    import blockpress.loading as loading

    path, _ = hf_tiny_dir
    sh = tmp_path / "shards"
    build_hf_model(hf_config()).save_pretrained(sh, max_shard_size="200KB")
    index = sh / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match=r"index.json is malformed \(its weight_map must map tensor names to "
                                              r"shard file names, got \[\"a\"\]\); re-download the checkpoint"):
        blockpress.load(sh, progress=False)
    index.write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"index.json is malformed \(UnicodeDecodeError"):
        blockpress.load(sh, progress=False)
    run = tmp_path / "run"
    shutil.copytree(path, run / "checkpoint-0000001")
    (run / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"could not read the checkpoint name in .*latest \(not UTF-8 text\); "
                                              "write the run's newest checkpoint folder name into it"):
        blockpress.load(run, progress=False)
    read = []
    monkeypatch.setattr(loading, "load_weights", lambda *a, **k: read.append(1))
    odd = tmp_path / "odd"
    build_hf_model(hf_config(hidden_size=34, moe_intermediate_size=7, intermediate_size=9)).save_pretrained(odd)
    with pytest.raises(InputError, match=r"precision='int4': int4 packs two weights a byte along each weight's "
                                         r"inputs, but this model's moe_intermediate_size 7 is odd; use "
                                         r"precision='fp8' .* instead"):
        blockpress.load(odd, progress=False, precision="int4")
    with pytest.raises(InputError, match=r"linears='int4-mlp': .* intermediate_size 9 is odd; use linears='int8' or "
                                         "'fp8'"):
        blockpress.load(odd, progress=False, linears="int4-mlp")
    if not torch.backends.mps.is_available():
        with pytest.raises(InputError, match=r"device 'mps' asked for, but torch sees no MPS device here"):
            blockpress.load(path, progress=False, device="mps")
    assert not read  # all refused before any weight was read
    unreadable = _copy(path, tmp_path / "unreadable")
    (unreadable / "config.json").chmod(0)
    r = _unprivileged(f"import blockpress\ntry:\n    blockpress.load({str(unreadable)!r}, progress=False)\n"
                      "except blockpress.ConfigError as e:\n    print(e)")
    if r is not None:
        assert r.stdout.strip() == (f"could not read {unreadable}/config.json (Permission denied); make it readable "
                                    "(chmod a+r) or load as its owner"), r.stderr[-2000:]


def test_a_run_folder_loads_its_newest_checkpoint_and_names_a_missing_one(hf_tiny_dir, tmp_path):
    """A training run's folder without `latest` (copied without it) failed with "config.json not found": its newest
    checkpoint-<step> loads (by step, not by name); a `latest` naming a checkpoint that is gone said "config.json not
    found" too: it says which checkpoint is missing and which one is there."""
    path, _ = hf_tiny_dir
    run = tmp_path / "run"
    for name in ("checkpoint-9", "checkpoint-10"):
        shutil.copytree(path, run / name)
    (run / "checkpoint-11").mkdir()  # an interrupted save: no model in it
    assert blockpress.load(run, progress=False).path == run / "checkpoint-10"
    (run / "latest").write_text("checkpoint-12\n")
    with pytest.raises(CheckpointError, match=rf"^{run}/latest names checkpoint-12, which is missing from {run}; pass "
                                              rf"its newest checkpoint \({run}/checkpoint-10\) or write checkpoint-10 "
                                              "into latest$"):
        blockpress.load(run, progress=False)
    (run / "latest").write_text("checkpoint-9")
    assert blockpress.load(run, progress=False).path == run / "checkpoint-9"  # latest, when it names one, wins
    shutil.copytree(path, tmp_path / "elsewhere")
    (run / "latest").write_text("../elsewhere")  # a path, not a folder of the run: it was followed
    with pytest.raises(CheckpointError, match="not a checkpoint folder of"):
        blockpress.load(run, progress=False)


def test_an_adapter_run_folder_resolves_as_a_model_run_folder(tmp_path):
    """A LoRA run's folder resolves by the same rule as a model run's (`loading.run_checkpoint`): without `latest`
    its newest checkpoint (it was the folder itself, which holds no adapter), and a `latest` that is not UTF-8 is a
    one-line CheckpointError (it was a raw UnicodeDecodeError)."""
    from blockpress.train.lora import adapter_folder

    run = tmp_path / "lora-run"
    for name in ("checkpoint-2", "checkpoint-10"):
        (run / name).mkdir(parents=True)
        (run / name / "adapter_config.json").write_text("{}")
    assert adapter_folder(run) == run / "checkpoint-10"
    (run / "latest").write_text("checkpoint-2")
    assert adapter_folder(run) == run / "checkpoint-2"
    (run / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="not UTF-8"):
        adapter_folder(run)


def test_an_unreadable_weights_file_is_named_as_such(hf_tiny_dir, tmp_path):
    """safetensors reports a file it may not open as "No such file or directory", and it read "not a readable
    safetensors file (No such file or directory ...) it may be truncated": the real cause, and its fix."""
    path, _ = hf_tiny_dir
    d = _copy(path, tmp_path / "unreadable")
    (d / "model.safetensors").chmod(0)
    r = _unprivileged(f"import blockpress\ntry:\n    blockpress.load({str(d)!r}, progress=False)\n"
                      "except blockpress.CheckpointError as e:\n    print(e)")
    if r is None:
        pytest.skip("file permissions cannot be made to hold here (root without setpriv)")
    assert r.stdout.strip() == (f"could not read {d}/model.safetensors (Permission denied); make it readable "
                                "(chmod a+r) or load as its owner"), r.stderr[-2000:]
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()  # a folder where the file should be
    with pytest.raises(CheckpointError, match=r"could not read .*model.safetensors \(Is a directory\)"):
        blockpress.load(d, progress=False)


def test_save_writes_the_dtype_of_the_tensors_it_writes(hf_tiny_dir, tmp_path):
    """load(fp32 checkpoint, dtype="bfloat16").save(d) wrote BF16 tensors under a config.json that said float32 (the
    loaded checkpoint's `dtype`, kept as read): transformers' dtype="auto" and blockpress on a GPU read it."""
    path, _ = hf_tiny_dir
    assert json.loads((Path(path) / "config.json").read_text())["dtype"] == "float32"
    out = blockpress.load(path, dtype="bfloat16", progress=False).save(tmp_path / "bf16")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    old = _copy(path, tmp_path / "old-name")  # transformers < 4.56 wrote torch_dtype: it is kept true too
    cfg = json.loads((old / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    (old / "config.json").write_text(json.dumps(cfg))
    out = blockpress.load(old, dtype="bfloat16", progress=False).save(tmp_path / "bf16-old")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"


def test_save_shards_past_the_shard_size_and_loads_back(tmp_path):
    """Past `shard_bytes` the weights go into files of at most that size (a larger tensor alone in one) with an
    index naming each tensor's file, as the Hub's sharded checkpoints are; they load back to the same weights, and a
    later single-file save into the folder replaces the shards."""
    from blockpress.train import sizes

    lm = blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16), seed=0)
    whole = lm.save(tmp_path / "whole")
    limit = 100_000
    out = lm.save(tmp_path / "sharded", shard_bytes=limit)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert [s.name for s in shards] == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    one = load_file(whole / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in one.values())
    parts = {s.name: load_file(s) for s in shards}
    assert index["weight_map"] == {k: name for name, part in parts.items() for k in part}
    assert sorted(index["weight_map"]) == sorted(one)
    for part in parts.values():
        sizes_ = [t.numel() * t.element_size() for t in part.values()]
        assert sum(sizes_) <= limit or len(sizes_) == 1
    back = blockpress.load(out, progress=False)
    sa, sb = back.module.state_dict(), lm.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    back.save(out)  # the default shard size: one file, the shards gone
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_the_loading_bar_is_drawn_on_a_terminal_only(tmp_path, capfd):
    """`blockpress.load(...)` (progress on by default) drew tqdm's bar into logs and pipes: a "\\r loading weights"
    line per redraw. It is tqdm's automatic choice now: a terminal only (here stderr is a pipe)."""
    from blockpress.model.weights import _progress

    bar = _progress(3, "loading weights", True)
    bar.update(3)
    bar.close()
    assert bar.disable and "loading weights" not in capfd.readouterr().err
    assert _progress(3, "x", False).disable


def test_damaged_files_found_by_a_file_audit_are_one_line(tmp_path):
    """One damage at a time to a copy of the shipped KJV model, each a traceback or a silently other model before:
    a tensor in two weight files (the last file won), a tokenizer with ids past the embedding (a server 500), an empty
    chat template (no template to generate_text), a broken link in place of generation_config.json (the reference's
    sampler instead of the checkpoint's), JSON nested too deeply (RecursionError), weights that make NaN logits (a
    RuntimeError from torch at the first draw), chat templates that divide by zero or repeat a string 10^10 times (the
    process was killed), a head_dim of 10^12 (the allocator's 4 TB traceback), a trainer state without its fields.
    An F64 checkpoint was refused as pre-quantised; it loads."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from blockpress.chat import render_chat_template
    from blockpress.errors import BlockpressError, InputError
    from blockpress.loading import SHIPPED_MODELS
    from blockpress.train.trainer import read_state

    src = SHIPPED_MODELS["kjv"]

    def copy(name):
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    def refused(d, needle):
        with pytest.raises(BlockpressError, match=needle) as e:
            blockpress.load(d, progress=False)
        assert "\n" not in str(e.value)

    sd = load_file(str(src / "model.safetensors"))
    key = next(iter(sd))
    d = copy("dup")  # two shards of an index, the tensor in both
    save_file({k: v for k, v in sd.items()}, str(d / "model-00001-of-00002.safetensors"))
    save_file({key: sd[key] + 1}, str(d / "model-00002-of-00002.safetensors"))
    os.remove(d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in sd}, "x": "model-00002-of-00002.safetensors"}}))
    refused(d, f"{key} is in both")
    d = copy("link")
    os.remove(d / "generation_config.json")
    os.symlink(tmp_path / "nowhere", d / "generation_config.json")
    refused(d, "generation_config.json is a broken link")
    d = copy("tokenizer")  # ids past the embedding: the server answered a prompt that used one with a 500
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["<a token the model never saw>"])
    tok.save(str(d / "tokenizer.json"))
    refused(d, "has 2049 ids but the model's vocabulary is 2048")
    d = copy("template")  # generate_text took it for "no template", `chat` for a template that writes nothing
    (d / "chat_template.jinja").write_text("\n")
    refused(d, "chat_template.jinja is empty")
    d = copy("deep")
    (d / "config.json").write_text("[" * 100000 + "]" * 100000)
    refused(d, "config.json is not valid JSON")
    d = copy("f64")
    save_file({k: v.double() for k, v in sd.items()}, str(d / "model.safetensors"))
    assert blockpress.load(d, progress=False, dtype="float32").generate_text("And God said", seed=0, max_new_tokens=8)
    for field, value, needle in (("layer_types", 1.5, "must be a list of"),
                                 ("layer_types", [["x"]] * 4, "must be a list"),
                                 ("head_dim", 10 ** 12, "head_dim 1000000000000 is past any attention head's"),
                                 ("rope_parameters", {"full_attention": {"rope_type": "proportional", "factor": 0}},
                                  "factor' must be a number > 0")):
        d = copy(f"cfg-{field}-{len(str(value))}")
        raw = json.loads((d / "config.json").read_text())
        (raw.get("text_config") or raw)[field] = value
        (d / "config.json").write_text(json.dumps(raw))
        refused(d, needle)
    from blockpress.sampling import sample_tokens  # NaN logits (an overflow, a merged NaN adapter): one line
    with pytest.raises(BlockpressError, match="logits are not finite") as e:
        sample_tokens(torch.full((1, 2, 5), float("nan")), torch.Generator().manual_seed(0))
    assert "in float16 its activations can pass that type's range (load it in bfloat16 or float32)" in str(e.value)
    for template, needle in (("{{ 1/0 }}", "ZeroDivisionError"), ("{{ 'ab' * 10**10 }}", "too long"),
                             ("{{ raise_exception('line one\nline two') }}", "line one;")):
        with pytest.raises(InputError, match=needle) as e:
            render_chat_template(template, [{"role": "user", "content": "hi"}])
        assert "\n" not in str(e.value)
    (tmp_path / "ck").mkdir()
    torch.save({"config": "x", "step": "y"}, tmp_path / "ck" / "trainer_state.pt")
    with pytest.raises(BlockpressError, match="is not a trainer state"):
        read_state(tmp_path / "ck")


def test_a_save_keeps_the_vision_tower_and_the_generation_config_it_does_not_use(hf_tiny_dir, tmp_path):
    """The engine is text-only, but a save (convert, a fine-tune) writes a checkpoint whose config.json still declares
    the vision tower: its tensors go along, in the saved dtype, so transformers finds no weight missing (it made a
    random tower before), and generation_config.json keeps the keys blockpress does not read (bos_token_id)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from blockpress.model.weights import VISION

    path, _ = hf_tiny_dir
    given = {k: v for k, v in load_file(path / "model.safetensors").items() if k.startswith(VISION)}
    assert given
    out = blockpress.load(path, dtype="bfloat16", progress=False).save(tmp_path / "bf16")
    kept = {k: v for k, v in load_file(out / "model.safetensors").items() if k.startswith(VISION)}
    assert kept.keys() == given.keys() and all(torch.equal(kept[k], given[k].to(torch.bfloat16)) for k in given)
    _, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    source = json.loads((path / "generation_config.json").read_text())
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: v for k, v in source.items() if k != "_from_model_config"}.items() <= written.items()
    tuned = blockpress.load(path, progress=False)
    tuned.path = tmp_path / "tokenizer"  # as a training run points it at its tokenizer's snapshot (cli/train.py)
    again = {k for k in load_file(tuned.save(tmp_path / "ck") / "model.safetensors") if k.startswith(VISION)}
    assert again == given.keys()  # a fine-tune's checkpoint keeps the tower too


def test_a_convert_never_replaces_its_input_nor_a_save_the_working_folder(tmp_path, monkeypatch, capsys):
    """`convert MODEL MODEL` (or OUT a link to it) replaced the float checkpoint with the converted one, for good;
    `convert MODEL .` inside a checkpoint folder replaced the shell's folder under it and printed "0.0 MB";
    `save("~/x")` wrote a folder named "~"."""
    from blockpress.cli import main as cli
    from blockpress.loading import resolve_path

    src = shutil.copytree(resolve_path("sudoku"), tmp_path / "sudoku")  # checkpoint files only
    before = (src / "model.safetensors").read_bytes()
    (tmp_path / "link").symlink_to(src)
    for out in (src, tmp_path / "link"):
        assert cli(["convert", str(src), str(out), "--precision", "int4"]) == 2
        assert "is MODEL's own folder" in capsys.readouterr().err
        assert (src / "model.safetensors").read_bytes() == before
    lm = blockpress.load(src, progress=False)
    ck = lm.save(tmp_path / "ck")
    monkeypatch.chdir(ck)
    with pytest.raises(CheckpointError, match="holds the current directory"):
        lm.save(".")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert lm.save("~/x") == tmp_path / "home" / "x" and (tmp_path / "home" / "x" / "model.safetensors").is_file()
    assert not (tmp_path / "~").exists()
    assert lm.save("rel") == tmp_path / "rel"  # where it went, as a path that still names it


def test_a_convert_ended_by_sigterm_leaves_no_temp_folder(tmp_path):
    """`timeout`, systemd and batch schedulers end a job with SIGTERM: the save's temp folder beside OUT (a partial
    copy of the whole checkpoint) is removed on the way out, as after Ctrl-C, and the exit status says SIGTERM."""
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "writing"
    script = f"""
import time, sys
from pathlib import Path
import blockpress.model.weights as w
real = w.weight_files
def slow(sd, shard_bytes=w.SHARD_BYTES):
    files = real(sd, shard_bytes)
    write = files["model.safetensors"]
    def writer(p):
        write(p)
        Path({str(ready)!r}).write_text("x")
        time.sleep(60)
    return {{**files, "model.safetensors": writer}}
w.weight_files = slow
from blockpress.cli import main
sys.exit(main(["convert", "kjv", {str(tmp_path / "out")!r}]))
"""
    p = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), p.stderr.read() if p.poll() is not None else "the write never started"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["writing"]
