"""Pre-quantised FP8 checkpoints (model/prequantized.py): the compressed-tensors `float-quantized` layout by output
channel (llm-compressor's FP8-dynamic recipe, the layout of RedHatAI's DiffusionGemma copy), built here from a tiny
random model whose weights fp8 holds exactly, so the fp8 checkpoint and the float one are the same model: loaded, it
must hold the stored bytes, write the tokens blockpress's own fp8 quantisation of the float checkpoint writes, and
refuse what it cannot read with one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockpress
from blockpress.errors import CheckpointError, InputError
from blockpress.kernels.linear_q import QUANTIZED_LINEARS, QuantizedLinear, quantized_linears
from blockpress.kernels.quant import FP8_MAX, QuantizedExperts, quantize_fp8
from blockpress.testing import build_tiny_gemma_tokenizer
from blockpress.train import sizes

pytestmark = pytest.mark.no_grad

# the quantization_config of an llm-compressor FP8-dynamic checkpoint (router, LM head, self-conditioning and vision
# tower stay float)
QC = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "format": "float-quantized", "targets": ["Linear"], "output_activations": None,
    "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float",
                          "group_size": None, "block_structure": None},
    "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True, "type": "float",
                "group_size": None, "block_structure": None, "observer": "memoryless_minmax"}}},
    "ignore": ["lm_head", "re:.*router\\.proj$", "re:.*self_conditioning.*", "re:.*vision.*"], "kv_cache_scheme": None}


def _fp8_exact(w: torch.Tensor) -> torch.Tensor:
    """w moved to the nearest weights that fp8 by output row holds exactly, with bf16 scales: q * s, each row's
    largest |q| 448 (so quantising them again gives the same q and s)."""
    q, s = quantize_fp8(w)
    s = s.to(torch.bfloat16).float()
    q = q.float()
    top = q.abs().argmax(-1, keepdim=True)
    q.scatter_(-1, top, torch.where(q.gather(-1, top) < 0, -FP8_MAX, FP8_MAX))
    return q * s[..., None]


def _split_fp8(sd: dict, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_fp8(sd.pop(key))
    assert torch.equal(s, s.to(torch.bfloat16).float())  # the scale bf16 stores is the one blockpress computes
    return q, s.to(torch.bfloat16)


@pytest.fixture(scope="module")
@torch.no_grad()
def checkpoints(tmp_path_factory):
    """(float folder, fp8 folder) of one model."""
    root = tmp_path_factory.mktemp("prequantized")
    lm = blockpress.from_config(sizes.model_config("nano", vocab_size=512, canvas_length=8, context=16), seed=0)
    for layer in lm.module.layers:
        for p in (layer.experts.gate_up_proj, layer.experts.down_proj):
            p.copy_(_fp8_exact(p))
        for part, names in QUANTIZED_LINEARS.items():
            for name in names:
                lin = getattr(getattr(layer, part), name, None)
                if lin is not None:
                    lin.weight.copy_(_fp8_exact(lin.weight))
    flt = lm.save(root / "float")
    build_tiny_gemma_tokenizer(flt)
    fp8 = root / "fp8"
    shutil.copytree(flt, fp8)
    sd = load_file(fp8 / "model.safetensors")
    for i, layer in enumerate(lm.module.layers):
        im = layer.experts.down_proj.shape[-1]
        pre = f"model.decoder.layers.{i}"
        gu, gu_s = _split_fp8(sd, f"{pre}.experts.gate_up_proj")
        dn, dn_s = _split_fp8(sd, f"{pre}.experts.down_proj")
        for e in range(gu.shape[0]):
            for proj, q, s in (("gate", gu[e, :im], gu_s[e, :im]), ("up", gu[e, im:], gu_s[e, im:]),
                               ("down", dn[e], dn_s[e])):
                sd[f"{pre}.experts.{e}.{proj}_proj.weight"] = q.contiguous()
                sd[f"{pre}.experts.{e}.{proj}_proj.weight_scale"] = s[:, None].contiguous()
        for part, names in QUANTIZED_LINEARS.items():
            for name in names:
                key = f"{pre}.{part}.{name}.weight"
                if key in sd:
                    sd[key], scale = _split_fp8(dict(w=sd[key]), "w")
                    sd[key + "_scale"] = scale[:, None].contiguous()
    save_file(sd, fp8 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": QC}))
    return flt, fp8


def _tokens(lm):
    ids = torch.randint(5, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    gen = [torch.Generator(lm.device).manual_seed(s) for s in (1, 2)]
    return lm.generate(ids, generator=gen, max_new_tokens=16, max_denoising_steps=4).sequences


def test_an_fp8_checkpoint_loads_its_bytes_into_the_fp8_modules(checkpoints):
    flt, fp8 = checkpoints
    lm = blockpress.load(fp8, progress=False)
    assert (lm.options.precision, lm.options.linears) == ("fp8", "fp8")
    stored = load_file(fp8 / "model.safetensors")
    for i, layer in enumerate(lm.module.layers):
        ex = layer.experts
        assert isinstance(ex, QuantizedExperts) and ex.fmt == "fp8" and ex.gate_up_q.device == lm.device
        for e in (0, ex.gate_up_q.shape[0] - 1):
            pre = f"model.decoder.layers.{i}.experts.{e}"
            want_q = torch.cat([stored[f"{pre}.gate_proj.weight"], stored[f"{pre}.up_proj.weight"]])
            assert torch.equal(ex.gate_up_q[e].view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(ex.down_q[e].view(torch.uint8), stored[f"{pre}.down_proj.weight"].view(torch.uint8))
            assert torch.equal(ex.down_scale[e], stored[f"{pre}.down_proj.weight_scale"][:, 0].float())
            assert torch.equal(ex.gate_up_scale[e, ex.inter:], stored[f"{pre}.up_proj.weight_scale"][:, 0].float())
        q = layer.self_attn.q_proj
        assert isinstance(q, QuantizedLinear) and q.fmt == "fp8"
        assert torch.equal(q.weight_q.view(torch.uint8),
                           stored[f"model.decoder.layers.{i}.self_attn.q_proj.weight"].view(torch.uint8))
        assert isinstance(layer.mlp.down_proj, QuantizedLinear)
    assert not isinstance(lm.module.layers[0].router.proj, QuantizedLinear)  # float in the checkpoint


def test_it_writes_the_tokens_of_the_float_checkpoint_quantised_at_load(checkpoints):
    """The same fp8 modules either way (the float weights are fp8-exact), so the same bits, token for token; and the
    fp32 float model itself agrees on the logits (the dequantised weights are its own)."""
    flt, fp8 = checkpoints
    lm = blockpress.load(fp8, progress=False)
    ours = blockpress.load(flt, progress=False, precision="fp8", linears="fp8")
    sa, sb = lm.module.state_dict(), ours.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)
    assert torch.equal(_tokens(lm), _tokens(ours))
    plain = blockpress.load(flt, progress=False)
    ids = torch.randint(5, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    canvas = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(4))

    def logits(model):
        cache = model.module.new_cache(1, 6)
        model.module.encode(ids.to(model.device), cache)
        return model.module.decode(canvas.to(model.device), cache).float().cpu()

    assert (logits(lm) - logits(plain)).abs().max() < 1e-4


def test_save_writes_the_layout_load_reads(checkpoints, tmp_path):
    """A model with fp8 experts and projections saves in the pre-quantised layout: the tensors this test's own writer
    puts in the fp8 checkpoint (scales widened to fp32), and a load of it holds the same bytes and writes the same
    tokens. Quantising the float checkpoint at load and saving that gives a file that loads as stored."""
    flt, fp8 = checkpoints
    lm = blockpress.load(flt, progress=False, precision="fp8", linears="fp8")
    out = lm.save(tmp_path / "saved")
    saved, written = load_file(out / "model.safetensors"), load_file(fp8 / "model.safetensors")
    assert saved.keys() == written.keys()
    for k, v in written.items():
        assert saved[k].shape == v.shape and saved[k].dtype == (torch.float32 if k.endswith("_scale") else v.dtype), k
        assert torch.equal(saved[k].view(torch.uint8), v.view(torch.uint8)) if v.dtype == torch.float8_e4m3fn \
            else torch.equal(saved[k], v.to(saved[k].dtype)), k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float32"
    qc = cfg["quantization_config"]  # every projection in fp8: llm-compressor's own config (targets "Linear")
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert [g["targets"] for g in qc["config_groups"].values()] == [["Linear"]] and qc["ignore"] == QC["ignore"]
    back = blockpress.load(out, progress=False)
    sa, sb = back.module.state_dict(), lm.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)
    assert torch.equal(_tokens(back), _tokens(lm))
    experts_only = blockpress.load(flt, progress=False, precision="fp8").save(tmp_path / "experts")
    again = blockpress.load(experts_only, progress=False)
    assert (again.options.precision, again.options.linears) == ("fp8", "native")
    targets = json.loads((experts_only / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["targets"] for g in targets.values()] == [["re:.*\\.experts\\.\\d+\\.(gate|up)_proj$",
                                                          "re:.*\\.experts\\.\\d+\\.down_proj$"]]
    assert not isinstance(again.module.layers[0].self_attn.q_proj, QuantizedLinear)


def test_a_sharded_fp8_checkpoint_loads(checkpoints, tmp_path):
    """Sharded (an index and two files), each fp8 weight in one file and its scale in the other."""
    fp8 = checkpoints[1]
    sharded = _variant(fp8, tmp_path / "sharded")
    sd = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    keys = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in parts.items():
        save_file({k: sd[k] for k in ks}, sharded / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, ks in parts.items() for k in ks}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = blockpress.load(sharded, progress=False), blockpress.load(fp8, progress=False)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)


def _variant(src, dst, qc=None, edit=None):
    shutil.copytree(src, dst)
    if qc is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    if edit is not None:
        sd = load_file(dst / "model.safetensors")
        edit(sd)
        save_file(sd, dst / "model.safetensors")
    return dst


def _scheme(**weights):
    g = json.loads(json.dumps(QC))
    g["config_groups"]["group_0"]["weights"].update(weights)
    return g


@pytest.mark.parametrize("qc, needle", [
    (_scheme(strategy="tensor"), "stores 8-bit float weights by tensor"),
    (_scheme(num_bits=4, strategy="tensor_group", group_size=16), "stores 4-bit float weights by tensor_group"),
    (_scheme(type="int", num_bits=2, strategy="group", group_size=128), "stores 2-bit int weights by group"),
    (_scheme(type="int", num_bits=4, strategy="group", group_size=128), "quantises activations other than to fp8 per token at run time"),
    (_scheme(strategy="block", block_structure=[128, 128]), "stores 8-bit float weights by block"),
    ({**QC, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "it quantises the KV cache"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "only compressed-tensors checkpoints are read"),
])
def test_other_schemes_are_refused_naming_why(checkpoints, tmp_path, qc, needle):
    with pytest.raises(CheckpointError, match=f"cannot read \\([^)]*{needle}\\); blockpress reads float weights, and "
                                              "pre-quantised ones only as compressed-tensors float-quantized") as e:
        blockpress.load(_variant(checkpoints[1], tmp_path / "v", qc), progress=False)
    assert "\n" not in str(e.value)


def test_damaged_or_mismatched_fp8_checkpoints_are_one_line_errors(checkpoints, tmp_path):
    fp8 = checkpoints[1]
    key = "model.decoder.layers.1.experts.3.up_proj.weight"
    cases = [
        (lambda sd: sd.pop(key), rf"1 quantised tensor\(s\) missing from the checkpoint \(first: {key}\)"),
        (lambda sd: sd.pop(key + "_scale"), rf"missing from the checkpoint \(first: {key}_scale\)"),
        (lambda sd: sd.update({key + "_scale": sd[key + "_scale"][:-1]}), rf"{key}_scale in model.safetensors has "
                                                                          r"shape \[\d+\], expected"),
        (lambda sd: sd.update({key: sd[key].to(torch.float8_e5m2)}), f"{key} is stored as F8_E5M2"),
        (lambda sd: sd.update({"model.decoder.layers.0.router.proj.weight":
                               sd["model.decoder.layers.0.router.proj.weight"].to(torch.float8_e4m3fn)}),
         "router.proj.weight is an fp8 tensor blockpress does not map"),
        (lambda sd: sd.update({key + "_scale": sd[key + "_scale"].to(torch.float8_e4m3fn)}),
         f"{key}_scale is an fp8 tensor blockpress does not map"),
        (lambda sd: sd.update({key + "_scale": sd[key + "_scale"].to(torch.int32)}),
         f"{key}_scale in model.safetensors is stored as torch.int32, expected a float scale"),
    ]
    for i, (edit, needle) in enumerate(cases):
        with pytest.raises(CheckpointError, match=needle) as e:
            blockpress.load(_variant(fp8, tmp_path / f"d{i}", edit=edit), progress=False)
        assert "\n" not in str(e.value)
    deep = "model.decoder.layers.9.mlp.up_proj.weight"  # a layer config.json does not have
    with pytest.raises(CheckpointError, match="quantised weights of layer 9, but config.json describes 2 layers"):
        blockpress.load(_variant(fp8, tmp_path / "deep", edit=lambda sd: sd.update(
            {deep: sd["model.decoder.layers.1.mlp.up_proj.weight"].clone()})), progress=False)
    nan = _variant(fp8, tmp_path / "nan", edit=lambda sd: sd[key + "_scale"].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=rf"hold NaN or Inf values \(first: {key}_scale\)"):
        blockpress.load(nan, progress=False)
    for byte in (0x7F, 0xFF):  # e4m3fn's NaNs (it has no Inf), found from the bytes
        bad = _variant(fp8, tmp_path / f"nan{byte}", edit=lambda sd: sd[key].view(torch.uint8)[2, 3].fill_(byte))
        with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) hold NaN or Inf values \(first: {key}\); the "
                                                  "checkpoint is damaged"):
            blockpress.load(bad, progress=False)
    with pytest.raises(InputError, match="stores its expert weights in fp8, and precision='int4' needs float ones"):
        blockpress.load(fp8, progress=False, precision="int4")
    with pytest.raises(InputError, match="stores its projection weights in fp8, and linears='int8' needs float"):
        blockpress.load(fp8, progress=False, linears="int8")


def test_convert_writes_an_fp8_checkpoint_and_other_dtypes(checkpoints, tmp_path, capsys):
    from blockpress.cli import main as cli

    flt = checkpoints[0]
    assert cli(["convert", str(flt), str(tmp_path / "fp8"), "--precision", "fp8", "--linears", "fp8"]) == 0
    assert "wrote" in capsys.readouterr().err
    got, want = blockpress.load(tmp_path / "fp8", progress=False), blockpress.load(flt, progress=False,
                                                                                 precision="fp8", linears="fp8")
    sa, sb = got.module.state_dict(), want.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)
    assert (tmp_path / "fp8" / "tokenizer.json").is_file()
    assert cli(["convert", str(flt), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert load_file(tmp_path / "bf16" / "model.safetensors")["model.decoder.embed_tokens.weight"].dtype == \
        torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    bare = _variant(flt, tmp_path / "bare")  # a config.json that names no dtype: the stored one is kept
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}))
    assert cli(["convert", str(bare), str(tmp_path / "same")]) == 0
    assert load_file(tmp_path / "same" / "model.safetensors")["model.decoder.embed_tokens.weight"].dtype == torch.float32
    assert cli(["convert", str(flt), str(tmp_path / "int4"), "--precision", "int4", "--group-size", "32",
                "--linears", "int8"]) == 0
    got, want = blockpress.load(tmp_path / "int4", progress=False), blockpress.load(flt, progress=False,
                                                                                  precision="int4", group_size=32,
                                                                                  linears="int8")
    assert (got.options.precision, got.options.group_size, got.options.linears) == ("int4", 32, "int8")
    sa, sb = got.module.state_dict(), want.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(SystemExit) as e:  # argparse: not a choice
        cli(["convert", str(flt), str(tmp_path / "no"), "--precision", "int8"])
    assert e.value.code == 2
    capsys.readouterr()
    assert cli(["convert", str(flt), str(tmp_path / "no"), "--embeddings", "int8"]) == 2
    assert "no checkpoint format blockpress writes holds an int8 embedding table" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_the_command_line_runs_an_fp8_checkpoint(checkpoints, capsys):
    from blockpress.cli import main as cli

    assert cli(["run", str(checkpoints[1]), "hi", "--no-live", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "fp8" in err  # what ran: the stored precision
    assert "its recipe also quantises the activations to fp8 per token, which --fp8-activations" in err  # FP8-dynamic
    assert cli(["run", str(checkpoints[1]), "hi", "--no-live", "--max-new-tokens", "8", "--fp8-activations"]) == 0
    err = capsys.readouterr().err
    assert "loaded as stored" in err and "--fp8-activations" not in err  # asked for: nothing to suggest
    # the recipe's activations: fp8 for every stored fp8 weight, the experts and the projections
    lm = blockpress.load(checkpoints[1], progress=False, experts="w8a8")
    qs = quantized_linears(lm.module)
    assert qs and all(q.fmt == "fp8" and q.backend == "w8a8" for q in qs)
    assert all(layer.experts.backend == "w8a8" for layer in lm.module.layers)


def test_training_an_fp8_checkpoint_takes_adapters_not_full_fine_tuning(tmp_path, capsys):
    """Full fine-tuning would update only the float weights around the frozen fp8 ones: refused; LoRA over them runs."""
    from blockpress.cli import main as cli
    from blockpress.tasks import sudoku as sd

    base = tmp_path / "base"
    blockpress.from_config(sizes.model_config("nano", vocab_size=len(sd.VOCAB), canvas_length=sd.CANVAS_LEN,
                                              context=sd.PROMPT_LEN), seed=0).save(base)
    sd.build_tokenizer().save(str(base / "tokenizer.json"))
    (base / "blockpress_task.json").write_text('{"task": "sudoku"}')
    assert cli(["convert", str(base), str(tmp_path / "fp8"), "--precision", "fp8", "--linears", "fp8"]) == 0
    run = ["train", "sudoku", "--model", str(tmp_path / "fp8"), "--batch-size", "4", "--steps", "2", "--warmup", "1",
           "--save-every", "0", "--no-progress"]
    capsys.readouterr()
    assert cli([*run, "--out", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stores fp8 weights (a pre-quantised checkpoint), which full fine-tuning cannot update" in err
    assert cli([*run, "--lora", "4", "--out", str(tmp_path / "lora")]) == 0
    assert (tmp_path / "lora" / "checkpoint-0000002" / "adapter_config.json").is_file()


# ------------------------------------------------------------------------------------ packed int4 / int8

def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' packing, written out: signed b-bit values [O, I] -> int32 words [O, I*b/32], value k of a
    word (+ 2^(b-1)) at bits k*b and up."""
    per = 32 // bits
    u = (values.to(torch.int64) + (1 << (bits - 1))).reshape(values.shape[0], -1, per)
    words = (u << (torch.arange(per) * bits)).sum(-1)
    return (((words + 2 ** 31) % 2 ** 32) - 2 ** 31).to(torch.int32)


def _int4_values(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed values [O, I], scales [O, I/group]) of blockpress's own int4 quantisation of w, in fp32."""
    from blockpress.kernels.quant import quantize_int4, unpack_int4

    packed, scale = quantize_int4(w[None], group, torch.float32)
    return unpack_int4(packed[0]), scale[0]


def _int_checkpoint(flt, dst, expert_groups=(32, 32), linears="int8", attention=True, qc=None):
    """The float checkpoint `flt` written as an llm-compressor W4A16 / W8A16 one by this test's own writer: experts in
    int4 (gate / up by groups of expert_groups[0], down of [1]), the attention and MLP projections in int8 by channel
    (linears "int8"), all of them in int4 by groups of 32 ("int4"), or the dense MLP alone ("int4-mlp")."""
    from blockpress.kernels.linear_q import quantize_int8_rows

    shutil.copytree(flt, dst)
    sd = load_file(dst / "model.safetensors")
    n_layers = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith("model.decoder.layers."))

    def put(prefix, w, bits, group):
        if bits == 4:
            v, s = _int4_values(w, group)
        else:
            v, s = quantize_int8_rows(w)
            s = s[:, None]
        sd[f"{prefix}.weight_packed"] = _words(v, bits)
        sd[f"{prefix}.weight_scale"] = s.contiguous()
        sd[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))

    for i in range(n_layers):
        pre = f"model.decoder.layers.{i}"
        gu, dn = sd.pop(f"{pre}.experts.gate_up_proj"), sd.pop(f"{pre}.experts.down_proj")
        im = dn.shape[-1]
        for e in range(gu.shape[0]):
            put(f"{pre}.experts.{e}.gate_proj", gu[e, :im], 4, expert_groups[0])
            put(f"{pre}.experts.{e}.up_proj", gu[e, im:], 4, expert_groups[0])
            put(f"{pre}.experts.{e}.down_proj", dn[e], 4, expert_groups[1])
        for part, names in QUANTIZED_LINEARS.items():
            if part == "self_attn" and not attention:
                continue
            for name in names:
                key = f"{pre}.{part}.{name}.weight"
                if key in sd and (linears in ("int8", "int4") or (linears == "int4-mlp" and part == "mlp")):
                    put(key.removesuffix(".weight"), sd.pop(key), 8 if linears == "int8" else 4, 32)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, "dynamic": False}
    w8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
    qc = qc or {"quant_method": "compressed-tensors", "format": "pack-quantized", "kv_cache_scheme": None,
                "ignore": ["lm_head"], "config_groups": {
                    "group_0": {"targets": ["re:.*experts.*"], "weights": w4, "input_activations": None},
                    "group_1": {"targets": ["Linear"], "weights": w8 if linears == "int8" else w4,
                                "input_activations": None}}}
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst


def _dequantized(stored: dict, prefix: str) -> torch.Tensor:
    """The fp32 weight a packed int4 checkpoint stores under `prefix`: each word's eight 4-bit values (less 8) times
    the scale of its group."""
    words = stored[f"{prefix}.weight_packed"]
    values = torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], -1).flatten(-2) - 8
    scale = stored[f"{prefix}.weight_scale"].float()
    return (values.float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)


def _same_state(a, b) -> bool:
    sa, sb = a.module.state_dict(), b.module.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8),
                                                                                     sb[k].view(torch.uint8))
                                          for k in sa)


def test_an_int4_checkpoint_loads_the_modules_blockpress_quantises_at_load(checkpoints, tmp_path):
    """int4 experts by groups of 32 and int8 projections by channel, written by the test's own packer: the same bytes
    and scales as blockpress's own quantisation of the float checkpoint at load, and the same tokens."""
    flt = checkpoints[0]
    lm = blockpress.load(_int_checkpoint(flt, tmp_path / "w4a16"), progress=False)
    assert (lm.options.precision, lm.options.group_size, lm.options.linears) == ("int4", 32, "int8")
    ex = lm.module.layers[1].experts
    assert isinstance(ex, QuantizedExperts) and ex.fmt == "int4" and ex.groups == (32, 32)
    assert lm.module.layers[0].self_attn.q_proj.fmt == "int8"
    ours = blockpress.load(flt, progress=False, precision="int4", group_size=32, linears="int8")
    assert _same_state(lm, ours)
    assert torch.equal(_tokens(lm), _tokens(ours))


@pytest.mark.parametrize("groups", [(64, 32), (32, 16)])
def test_coarser_stored_groups_load_exactly_into_finer_ones(checkpoints, tmp_path, groups):
    """gate / up by channel (64: one scale for the 64 columns) or groups of 32, down by finer groups: the modules take
    down's group and repeat each coarser scale over the groups it spans; the dequantised weights are the stored
    values times their scales."""
    from blockpress.kernels.quant import dequantize_int4

    flt = checkpoints[0]
    w4c = {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": True}
    w4g = {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g0": {"targets": ["re:.*experts.*(gate|up)_proj$"], "weights": w4c if groups[0] == 64 else
               {**w4g, "group_size": groups[0]}},
        "g1": {"targets": ["re:.*experts.*down_proj$"], "weights": {**w4g, "group_size": groups[1]}}}}
    d = _int_checkpoint(flt, tmp_path / "coarse", expert_groups=groups, linears="native", qc=qc)
    lm = blockpress.load(d, progress=False)
    assert (lm.options.precision, lm.options.group_size, lm.options.linears) == ("int4", groups[1], "native")
    stored = load_file(d / "model.safetensors")
    ex = lm.module.layers[0].experts
    assert ex.groups == (groups[1], groups[1]) and ex.gate_up_scale.shape[-1] == 64 // groups[1]
    for e in range(ex.gate_up_q.shape[0]):
        for proj, rows, which in (("gate", slice(0, ex.inter), "gate_up"), ("up", slice(ex.inter, None), "gate_up"),
                                  ("down", slice(None), "down")):
            want = _dequantized(stored, f"model.decoder.layers.0.experts.{e}.{proj}_proj")
            got = dequantize_int4(getattr(ex, f"{which}_q")[e, rows], getattr(ex, f"{which}_scale")[e, rows],
                                  torch.float32)
            assert torch.equal(got, want), (e, proj)


def _linear_targets() -> list[str]:
    """The targets naming each attention and MLP projection by its name's end."""
    return [f"re:.*\\.{p}\\.{n}$" for p, names in QUANTIZED_LINEARS.items() for n in names]


def test_int4_attention_projections_load_as_their_float_weights(checkpoints, tmp_path):
    """Every projection in int4 (llm-compressor's W4A16 of all Linears): the experts and the dense MLP load as stored;
    the attention projections, which no int4 kernel runs, become float nn.Linear weights equal to their stored values
    times their scales. The same model, and tokens, as the float checkpoint quantised at load with those attention
    weights put in."""
    flt = checkpoints[0]
    d = _int_checkpoint(flt, tmp_path / "w4a16", linears="int4")
    lm = blockpress.load(d, progress=False)
    assert (lm.options.precision, lm.options.group_size, lm.options.linears) == ("int4", 32, "int4-mlp")
    stored = load_file(d / "model.safetensors")
    ref = blockpress.load(flt, progress=False, precision="int4", group_size=32, linears="int4-mlp")
    widened = 0
    for i, layer in enumerate(ref.module.layers):
        for name in QUANTIZED_LINEARS["self_attn"]:
            if getattr(layer.self_attn, name, None) is None:
                continue
            w = _dequantized(stored, f"model.decoder.layers.{i}.self_attn.{name}")
            got = getattr(lm.module.layers[i].self_attn, name)
            assert type(got) is torch.nn.Linear and got.weight.dtype == torch.float32 and torch.equal(got.weight, w)
            getattr(layer.self_attn, name).weight.copy_(w)
            widened += 1
    assert widened == 7
    assert _same_state(lm, ref) and torch.equal(_tokens(lm), _tokens(ref))
    bf16 = blockpress.load(d, progress=False, dtype="bfloat16")  # dequantised in the activation dtype
    assert bf16.module.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_save_writes_the_int_layout_load_reads(checkpoints, tmp_path):
    """int4 experts and int8 projections save as the test's own writer writes them (a config group per kind and group
    size, its targets naming what holds it); an fp8-experts model with its dense MLP in int4 round-trips too."""
    from blockpress.model.prequantized import scheme_problem

    flt = checkpoints[0]
    lm = blockpress.load(flt, progress=False, precision="int4", group_size=32, linears="int8")
    out = lm.save(tmp_path / "saved")
    saved = load_file(out / "model.safetensors")
    written = load_file(_int_checkpoint(flt, tmp_path / "written") / "model.safetensors")
    assert saved.keys() == written.keys()
    for k, v in written.items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert scheme_problem(qc) is None and qc["format"] == "pack-quantized"
    kinds = {(g["weights"]["num_bits"], g["weights"]["strategy"], g["weights"]["group_size"]): g["targets"]
             for g in qc["config_groups"].values()}
    assert kinds == {(4, "group", 32): ["re:.*\\.experts\\.\\d+\\.(gate|up)_proj$", "re:.*\\.experts\\.\\d+\\.down_proj$"],
                     (8, "channel", None): sorted(_linear_targets())}
    back = blockpress.load(out, progress=False)
    assert _same_state(back, lm) and torch.equal(_tokens(back), _tokens(lm))
    mixed = blockpress.load(flt, progress=False, precision="fp8", linears="int4-mlp", group_size=16)
    again = blockpress.load(mixed.save(tmp_path / "mlp"), progress=False)
    assert (again.options.precision, again.options.linears, again.options.group_size) == ("fp8", "int4-mlp", 16)
    assert _same_state(again, mixed) and torch.equal(_tokens(again), _tokens(mixed))
    keys = load_file(tmp_path / "mlp" / "model.safetensors").keys()
    assert "model.decoder.layers.1.mlp.up_proj.weight_packed" in keys and \
        "model.decoder.layers.1.self_attn.q_proj.weight" in keys
    part = blockpress.load(flt, progress=False, precision="int4", group_size=32)  # layer 0's experts float again
    part.module.layers[0].experts = blockpress.load(flt, progress=False).module.layers[0].experts
    qc = json.loads((part.save(tmp_path / "part") / "config.json").read_text())["quantization_config"]
    assert [g["targets"] for g in qc["config_groups"].values()] == [
        ["re:.*\\.layers\\.(1)\\.experts\\.\\d+\\.(gate|up)_proj$", "re:.*\\.layers\\.(1)\\.experts\\.\\d+\\.down_proj$"]]
    again = blockpress.load(tmp_path / "part", progress=False)
    assert not isinstance(again.module.layers[0].experts, QuantizedExperts) and _same_state(again, part)


@pytest.mark.parametrize("weights, activations, needle", [
    (dict(symmetric=False), None, "asymmetric"),
    (dict(actorder="group"), None, "activation-ordered"),
    (dict(num_bits=8, strategy="group", group_size=32), None, "stores 8-bit int weights by group"),
    ({}, {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}, "quantises activations other than"),
])
def test_other_int_schemes_are_refused_naming_why(checkpoints, tmp_path, weights, activations, needle):
    w = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, **weights}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": activations}}}
    with pytest.raises(CheckpointError, match=f"cannot read \\([^)]*{needle}") as e:
        blockpress.load(_variant(checkpoints[0], tmp_path / "v", qc), progress=False)
    assert "\n" not in str(e.value)


def test_damaged_or_unmapped_int_checkpoints_are_one_line_errors(checkpoints, tmp_path):
    flt = checkpoints[0]
    good = _int_checkpoint(flt, tmp_path / "good")
    ex = "model.decoder.layers.1.experts.2.down_proj"
    q = "model.decoder.layers.0.self_attn.q_proj"
    cases = [
        (lambda sd: sd.update({f"{ex}.weight_shape": torch.tensor([64, 65])}), f"{ex}.weight_shape in "
         r"model.safetensors records the shape \[64, 65\], expected \[64, 64\]"),
        (lambda sd: sd.pop(f"{ex}.weight_shape"), rf"1 quantised tensor\(s\) missing .*first: {ex}.weight_shape"),
        (lambda sd: sd.update({f"{ex}.weight_packed": sd[f"{ex}.weight_packed"].to(torch.int64)}),
         f"{ex}.weight_packed is stored as I64, expected I32"),
        (lambda sd: sd.update({f"{ex}.weight_packed": sd[f"{ex}.weight_packed"][:, :-1].contiguous()}),
         "int32 words a row do not pack 64 columns"),
        (lambda sd: sd.update({f"{ex}.weight_scale": sd[f"{ex}.weight_scale"][:, :1].repeat(1, 8).contiguous()}),
         "needs groups that are multiples of 16"),
        (lambda sd: sd.update({f"{ex}.weight_scale": sd[f"{ex}.weight_scale"][:, :1].repeat(1, 3).contiguous()}),
         "its groups do not divide the weight's 64 columns"),
        (lambda sd: sd.update({f"{q}.weight_scale": sd[f"{q}.weight_scale"].repeat(1, 2)}),
         "8-bit int weights by group"),
        (lambda sd: sd.update({f"{ex}.weight_packed": sd[f"{ex}.weight_packed"].repeat(1, 2),
                               f"{ex}.weight_scale": sd[f"{ex}.weight_scale"][:, :1].contiguous()}),
         "holds 8-bit int expert weights"),
        (lambda sd: sd.update({"model.decoder.layers.0.router.proj.weight_packed": sd[f"{q}.weight_packed"].clone()}),
         "router.proj.weight_packed is a packed int tensor blockpress does not map"),
    ]
    for i, (edit, needle) in enumerate(cases):
        with pytest.raises(CheckpointError, match=needle) as e:
            blockpress.load(_variant(good, tmp_path / f"d{i}", edit=edit), progress=False)
        assert "\n" not in str(e.value)
    mlp4 = _int_checkpoint(flt, tmp_path / "mlp4", linears="int4-mlp", attention=False)
    assert blockpress.load(mlp4, progress=False).options.linears == "int4-mlp"
    up = "model.decoder.layers.1.mlp.up_proj"
    with pytest.raises(CheckpointError, match="layer 1's dense MLP stores some projections in int4 but not up_proj"):
        blockpress.load(_variant(mlp4, tmp_path / "half", edit=lambda sd: [sd.pop(f"{up}.{p}") for p in (
            "weight_packed", "weight_scale", "weight_shape")] and sd.update({f"{up}.weight": torch.zeros(128, 64)})),
            progress=False)
    mixed = _int_checkpoint(flt, tmp_path / "mixed", linears="int4-mlp")  # attention native: now int8 attention
    with pytest.raises(CheckpointError, match="the checkpoint's projections mix int4 and int8"):
        blockpress.load(_variant(mixed, tmp_path / "mixed2", edit=lambda sd: _put_int8(
            sd, "model.decoder.layers.0.self_attn.q_proj")), progress=False)
    with pytest.raises(InputError, match="stores its expert weights in int4, and precision='fp8' needs float ones"):
        blockpress.load(good, progress=False, precision="fp8")
    with pytest.raises(InputError, match="stores its projection weights in int8, and linears='fp8' needs float"):
        blockpress.load(good, progress=False, linears="fp8")


def _put_int8(sd, prefix):
    from blockpress.kernels.linear_q import quantize_int8_rows

    v, s = quantize_int8_rows(sd.pop(f"{prefix}.weight"))
    sd.update({f"{prefix}.weight_packed": _words(v, 8), f"{prefix}.weight_scale": s[:, None].contiguous(),
               f"{prefix}.weight_shape": torch.tensor(list(v.shape))})
