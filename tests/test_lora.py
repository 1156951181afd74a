"""LoRA: PEFT-format adapters that PEFT loads on transformers' model with our logits; merge once."""

import json

import pytest
import torch

import blockpress
from blockpress.kernels import use
from blockpress.train import lora as L

pytest.importorskip("peft")



def _randomise_adapters(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in L.lora_state(module).items():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _bp_logits(bp, ids, canvas):
    with torch.no_grad():
        cache = bp.module.new_cache(ids.shape[0], ids.shape[1])
        h = bp.module.encode(ids, cache)
        return bp.module.lm_logits(h), bp.module.decode(canvas, cache)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, hf_tiny_dir):
    path, _ = hf_tiny_dir
    bp = blockpress.load(path, progress=False)
    use(bp.module, attention="eager")
    spec = L.LoraSpec(rank=4, alpha=8.0)
    names = L.add_lora(bp.module, spec)
    assert all(not p.requires_grad for n, p in bp.module.named_parameters() if "lora_" not in n)
    _randomise_adapters(bp.module)
    out = tmp_path_factory.mktemp("adapter")
    L.save_adapter(bp.module, out, spec, base_model=str(path))
    return path, bp, out, names


def test_adapter_files_use_peft_names(adapter):
    _, _, out, names = adapter
    from safetensors.torch import load_file

    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    keys = set(load_file(str(out / "adapter_model.safetensors")))
    assert "base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.encoder.language_model.layers.0.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 4 * len(names)  # A and B, decoder and encoder trees


def test_peft_on_transformers_matches_blockpress(adapter):
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    path, bp, out, names = adapter
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    ids = torch.randint(5, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    canvas = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.text_config)
        hf.model.encoder(input_ids=ids, past_key_values=cache)
        base_ref = hf(decoder_input_ids=canvas, past_key_values=cache).logits
    peft = PeftModel.from_pretrained(hf, str(out)).eval()
    n_adapted = sum(1 for n, _ in peft.named_modules() if n.endswith(".lora_A"))
    assert n_adapted == 2 * len(names)  # encoder and decoder trees, nothing in the vision tower
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.text_config)
        enc = peft.base_model.model.model.encoder(input_ids=ids, past_key_values=cache)
        ref = peft.base_model.model(decoder_input_ids=canvas, past_key_values=cache).logits
    enc_logits, dec_logits = _bp_logits(bp, ids, canvas)
    assert (ref - dec_logits).abs().max() < 1e-4
    assert (ref - base_ref).abs().max() > 1e-3  # the adapter matters: the check can fail
    ref_enc = bp.module.lm_logits(enc.last_hidden_state)
    assert (ref_enc - enc_logits).abs().max() < 1e-4


def test_apply_and_merge_once(adapter):
    path, bp, out, _ = adapter
    ids = torch.randint(5, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    canvas = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    want = _bp_logits(bp, ids, canvas)
    fresh = blockpress.load(path, progress=False)
    use(fresh.module, attention="eager")
    base = _bp_logits(fresh, ids, canvas)
    L.apply_adapter(fresh, out)  # unmerged
    got = _bp_logits(fresh, ids, canvas)
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(want, got))
    assert L.merge_lora(fresh.module) > 0
    merged = _bp_logits(fresh, ids, canvas)
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(want, merged))
    assert not any("lora" in n for n, _ in fresh.module.named_parameters())
    other = blockpress.load(path, progress=False)
    use(other.module, attention="eager")
    L.apply_adapter(other, out, merge=True)  # merge straight from the folder: the delta is added once
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(want, _bp_logits(other, ids, canvas)))
    assert (base[1] - merged[1]).abs().max() > 1e-3


def test_saving_an_adapted_model_writes_the_adapter_folded_in(adapter, tmp_path):
    """lm.save of a model with an adapter attached wrote the adapter under names nothing reads: the checkpoint loaded
    as the base model. It now writes the weights merge_lora would make (the same bits), keeps the adapter attached in
    memory, and refuses where the adapter sits beside 8-bit weights; `convert --adapter` writes the same checkpoint."""
    from safetensors.torch import load_file

    from blockpress.cli import main as cli
    from blockpress.errors import InputError

    path, _, out, _ = adapter
    attached = blockpress.load(path, progress=False)
    L.apply_adapter(attached, out)
    saved = attached.save(tmp_path / "attached")
    assert any(".lora_A." in n for n, _ in attached.module.named_parameters())  # still attached
    merged = blockpress.load(path, progress=False)
    L.apply_adapter(merged, out, merge=True)
    want = load_file(merged.save(tmp_path / "merged") / "model.safetensors")
    got = load_file(saved / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    base = load_file(blockpress.load(path, progress=False).save(tmp_path / "base") / "model.safetensors")
    assert not all(torch.equal(got[k], base[k]) for k in base)
    assert cli(["convert", str(path), str(tmp_path / "convert"), "--adapter", str(out), "--dtype", "float32"]) == 0
    converted = load_file(tmp_path / "convert" / "model.safetensors")
    assert all(torch.equal(converted[k], want[k]) for k in want)
    eight = blockpress.load(path, progress=False, linears="int8")
    L.apply_adapter(eight, out)
    with pytest.raises(InputError, match="8-bit weights .* with a LoRA adapter beside them"):
        eight.save(tmp_path / "eight")
    assert not (tmp_path / "eight").exists()
    assert cli(["convert", str(path), str(tmp_path / "no"), "--adapter", str(out), "--linears", "int8"]) == 2


def test_lora_training_updates_only_adapters(tmp_path):
    from blockpress.train import objective as obj
    from blockpress.train.sizes import model_config

    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=8), seed=0)
    before = {k: v.clone() for k, v in lm.module.state_dict().items()}
    L.add_lora(lm.module, L.LoraSpec(rank=2, alpha=4))
    cfg = obj.ObjectiveConfig(seed=0)
    b = obj.collate([([2, 5, 6], [7, 8, 9, 10])] * 4, 8, 16, cfg, 0)
    opt = torch.optim.AdamW([p for p in lm.module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss, _ = obj.compute_loss(lm.module, b, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    sd = lm.module.state_dict()
    assert all(torch.equal(before[k], sd[k]) for k in before)
    assert any(v.abs().sum() > 0 for k, v in sd.items() if "lora_B" in k)
    with pytest.raises(Exception):
        L.apply_adapter(lm, tmp_path)  # not an adapter folder


def test_cli_lora_run_saves_peft_adapters_and_resumes(tmp_path):
    from blockpress.cli import main as cli_main

    common = ["--size", "nano", "--batch-size", "2", "--eval-every", "0", "--no-progress", "--threads", "1",
              "--blanks", "40", "42", "--log-every", "1"]
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "base"), "--steps", "1", "--save-every", "1", *common]) == 0
    base = tmp_path / "base" / "checkpoint-0000001"
    lora = ["train", "sudoku", "--model", str(base), "--lora", "2", "--out", str(tmp_path / "lora"), "--steps", "3",
            "--save-every", "1", *common[2:]]  # (--model brings its size)
    assert cli_main(lora + ["--stop-after", "2"]) == 0
    ck = tmp_path / "lora" / "checkpoint-0000002"
    assert (ck / "adapter_config.json").is_file() and not (ck / "model.safetensors").exists()
    assert cli_main(lora + ["--resume"]) == 0
    rows = [json.loads(l) for l in open(tmp_path / "lora" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    # the adapters' initial draw is seeded (not torch's global RNG): an uninterrupted run gives the same losses
    whole = [a if a != str(tmp_path / "lora") else str(tmp_path / "whole") for a in lora]
    assert cli_main(whole) == 0
    again = [json.loads(l) for l in open(tmp_path / "whole" / "metrics.jsonl")]
    assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in again if "loss" in r]
    lm = blockpress.load(base, progress=False)
    assert len(L.apply_adapter(lm, tmp_path / "lora" / "checkpoint-0000003")) > 0


def test_cli_run_with_adapter_attached_or_merged(tmp_path, capsys):
    """`blockpress run BASE --adapter DIR` (and --merge-adapter) generates with the adapter applied."""
    from blockpress.cli import main as cli_main
    from blockpress.tasks import sudoku as sd
    from blockpress.train.sizes import model_config

    base = tmp_path / "base"
    lm = blockpress.from_config(model_config("nano", vocab_size=len(sd.VOCAB), canvas_length=sd.CANVAS_LEN,
                                             context=sd.PROMPT_LEN), seed=0)
    lm.save(base)
    sd.build_tokenizer().save(str(base / "tokenizer.json"))
    (base / "blockpress_task.json").write_text('{"task": "sudoku"}')
    L.add_lora(lm.module, L.LoraSpec(rank=2, alpha=4))
    with torch.no_grad():  # a non-trivial adapter (B starts at zero)
        for n, p in lm.module.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.5)
    L.save_adapter(lm.module, tmp_path / "adapter", L.LoraSpec(rank=2, alpha=4))

    def run(*extra):
        puzzle = sd.test_set(35, 1)[0][0]
        code = cli_main(["run", str(base), puzzle, "--json", "--seed", "0", "--steps", "4", *extra])
        out = capsys.readouterr()
        return code, (json.loads(out.out)["token_ids"] if code == 0 else out.err)

    plain, attached = run()[1], run("--adapter", str(tmp_path / "adapter"))[1]
    merged = run("--adapter", str(tmp_path / "adapter"), "--merge-adapter")[1]
    assert attached == merged and attached != plain
    code, err = run("--merge-adapter")
    assert code == 2 and "--merge-adapter needs --adapter" in err
    code, err = run("--adapter", str(tmp_path))
    assert code == 2 and "not a LoRA adapter folder" in err


def test_broken_or_foreign_adapters_are_clear_errors(adapter, tmp_path):
    """A config whose r disagrees with the weights, a truncated safetensors, invalid JSON, or an adapter
    trained on a model with another vocabulary (same layer shapes: it would load and write noise) is a
    CheckpointError naming the problem, and the model is left untouched."""
    import shutil

    path, _, out, _ = adapter
    cases = {}
    d = cases["rank"] = tmp_path / "rank"
    shutil.copytree(out, d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    d = cases["truncated"] = tmp_path / "truncated"
    shutil.copytree(out, d)
    data = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(data[:100])
    d = cases["json"] = tmp_path / "json"
    shutil.copytree(out, d)
    (d / "adapter_config.json").write_text("{r: 4")
    d = cases["vocab"] = tmp_path / "vocab"
    shutil.copytree(out, d)
    other = tmp_path / "other_base"
    other.mkdir()
    base_cfg = json.loads((path / "config.json").read_text())
    base_cfg["text_config"]["vocab_size"] = 1024
    (other / "config.json").write_text(json.dumps(base_cfg))
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(other)}))
    from safetensors.torch import load_file, save_file

    d = cases["late"] = tmp_path / "late"  # only the last layer is wrong: nothing may be merged before the check
    shutil.copytree(out, d)
    sd = load_file(d / "adapter_model.safetensors")
    last = sorted(k for k in sd if "lora_A" in k and k.startswith(L.DEC))[-1]
    sd[last] = torch.zeros(sd[last].shape[0], sd[last].shape[1] + 1)
    save_file(sd, d / "adapter_model.safetensors")
    needles = {"rank": "says r=8 but the weights for .* have rank 4", "truncated": "not a readable safetensors",
               "late": "features, this model's layer maps",
               "json": "not valid JSON", "vocab": "trained on .*other_base \\(vocabulary 1024\\).* is 512"}
    fresh = blockpress.load(path, progress=False)
    before = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    for name, folder in cases.items():
        with pytest.raises(blockpress.CheckpointError, match=needles[name]):
            L.apply_adapter(fresh, folder, merge=True)
    after = fresh.module.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_resuming_with_other_lora_flags_names_the_flag_to_change(tmp_path, capsys):
    """--lora 8 on a rank-2 run was a RuntimeError traceback, other --lora-targets an AttributeError, another
    --lora-alpha trained on silently; resuming a LoRA run without --lora offered `blockpress run --adapter`, a full run
    resumed with --lora was not named. Each is one line naming the flag and the run's value; the run is untouched."""
    from blockpress.cli import main as cli_main

    common = ["--size", "nano", "--batch-size", "2", "--eval-every", "0", "--no-progress", "--threads", "1",
              "--blanks", "40", "42", "--steps", "2", "--save-every", "1", "--stop-after", "1"]
    full = tmp_path / "full"
    assert cli_main(["train", "sudoku", "--out", str(full), *common]) == 0
    base = full / "checkpoint-0000001"
    run = tmp_path / "lora"
    lora = ["train", "sudoku", "--model", str(base), "--out", str(run), *[a for a in common if a not in ("--size",
                                                                                                          "nano")]]
    assert cli_main([*lora, "--lora", "2"]) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cases = [(["--lora", "8"], "--lora 8 differs from the run being resumed (rank 2, in checkpoint-0000001/"
                               "adapter_config.json); resume with --lora 2"),
             (["--lora", "2", "--lora-alpha", "3"], "--lora-alpha 3 differs from the run being resumed (alpha 4, "
                                                    "in checkpoint-0000001/adapter_config.json); resume with "
                                                    "--lora-alpha 4"),
             (["--lora", "2", "--lora-targets", "q_proj"], "--lora-targets q_proj differs from the run being resumed "
                                                           "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
             ([], "the run being resumed trains LoRA adapters of rank 2 (checkpoint-0000001/adapter_config.json); "
                  "add --lora 2 to resume it")]
    for flags, needle in cases:
        capsys.readouterr()
        assert cli_main([*lora, "--resume", *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, (flags, err)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert cli_main(["train", "sudoku", "--out", str(full), *common, "--resume", "--lora", "2"]) == 2
    assert "fine-tunes every weight (checkpoint-0000001 has no adapter_config.json); drop --lora 2" in \
        capsys.readouterr().err
    assert cli_main([*lora, "--resume", "--lora", "2", "--lora-alpha", "4"]) == 0  # alpha 2 x rank, as started


def test_a_damaged_adapter_is_one_line_and_leaves_the_model_usable(adapter, tmp_path):
    """A file audit damaged adapters one field at a time: r 0 / "abc" / null, lora_alpha "abc" / NaN, a lora_B
    missing, NaN weights and a nested-too-deep config each reached int()/float(), a KeyError, or NaN logits at
    generate (a torch RuntimeError). PEFT options blockpress does not implement (trained biases, saved modules,
    per-module alphas, transposed weights), tensors it would drop and integer weights loaded as another model.
    Each is a CheckpointError naming the problem; the model is unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    from blockpress.errors import CheckpointError

    path, _, out, _ = adapter
    lm = blockpress.load(path, progress=False)
    ids = torch.tensor([[5, 6, 7]])
    before = lm.generate(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(0)).sequences
    cfg = json.loads((out / "adapter_config.json").read_text())
    tensors = load_file(str(out / "adapter_model.safetensors"))
    a_key = next(k for k in tensors if k.endswith("lora_A.weight") and ".decoder." in k)
    cases = [({"r": 0}, None, "r is 0"), ({"r": "abc"}, None, "r is 'abc'"), ({"r": None}, None, "r is None"),
             ({"lora_alpha": "abc"}, None, "lora_alpha is 'abc'"),
             ({"lora_alpha": float("nan")}, None, "lora_alpha is nan"),
             ({}, {k: v for k, v in tensors.items() if k != a_key.replace("lora_A", "lora_B")}, "but not its lora_B"),
             ({}, {**tensors, a_key: torch.full_like(tensors[a_key], float("nan"))}, "hold NaN or inf"),
             ({"bias": "all"}, None, "bias is 'all': the adapter uses trained bias terms"),
             ({"modules_to_save": ["lm_head"]}, None, "modules_to_save is \\['lm_head'\\]"),
             ({"alpha_pattern": {"q_proj": 64}}, None, "alpha_pattern is"), ({"use_dora": True}, None, "DoRA"),
             ({"fan_in_fan_out": True}, None, "fan_in_fan_out is True"),
             ({}, {**tensors, a_key.replace("lora_A.weight", "lora_B.bias"): torch.zeros(4)}, "lora_B.bias, which is"),
             ({}, {**tensors, a_key: tensors[a_key].to(torch.int32)}, "is int32, not floating point"),
             ("[" * 100000 + "]" * 100000, None, "not valid JSON")]
    for i, (change, weights, needle) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(out, bad)
        text = change if isinstance(change, str) else json.dumps({**cfg, **change})
        (bad / "adapter_config.json").write_text(text)
        if weights is not None:
            save_file(weights, str(bad / "adapter_model.safetensors"))
        with pytest.raises(CheckpointError, match=needle) as e:
            L.apply_adapter(lm, bad)
        assert "\n" not in str(e.value)
    after = lm.generate(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(0)).sequences
    assert torch.equal(before, after)
