"""Trainer: exact resume, checkpoints that transformers 5.23 loads with identical logits, the CLIs."""

import json
from pathlib import Path

import pytest
import torch

import blockpress
from blockpress.cli import main as cli_main
from blockpress.kernels import use

TINY = ["--size", "nano", "--batch-size", "4", "--lr", "3e-3", "--warmup", "2", "--log-every", "1",
        "--eval-every", "0", "--threads", "1", "--no-progress", "--blanks", "40", "44"]
FINE_TUNE = [a for a in TINY if a not in ("--size", "nano")]  # --model brings its size
TEXT = [a for a in TINY if a not in ("--blanks", "40", "44")]  # Sudoku's blanks: not a flag of text data



def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r}


@pytest.mark.parametrize("objective", [[], ["--rollout", "0.5", "--swap-rate", "0.2"], ["--grad-accum", "2"]],
                         ids=["spec", "rollout+swap", "grad-accum"])
def test_resume_gives_the_same_next_loss(tmp_path, objective):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*TINY, *objective]
    assert cli_main(["train", "sudoku", "--out", str(full), "--steps", "4", "--save-every", "0", *args]) == 0
    # "killed" after 3 steps (the last checkpoint at step 2, step 3 logged), then resumed in a fresh
    # model/optimizer: it redoes step 3 and the log holds every step once
    assert cli_main(["train", "sudoku", "--out", str(part), "--steps", "4", "--save-every", "2",
                     "--stop-after", "3", *args]) == 0
    assert (part / "latest").read_text() == "checkpoint-0000002" and 3 in _losses(part)
    assert cli_main(["train", "sudoku", "--out", str(part), "--steps", "4", "--save-every", "2",
                     "--resume", *args]) == 0
    a, b = _losses(full), _losses(part)
    steps = [r["step"] for r in map(json.loads, open(part / "metrics.jsonl")) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert a[1] != a[3]  # training moves
    # bit for bit: the resumed run loads with the kernels the run started with (it took load()'s sdpa_gqa, whose
    # gradients round otherwise: grad norms differed in the 7th digit)
    assert a == b, (a, b)
    norms = [{r["step"]: r["grad_norm"] for r in map(json.loads, open(d / "metrics.jsonl")) if "grad_norm" in r}
             for d in (full, part)]
    assert norms[0] == norms[1]
    ck = part / "checkpoint-0000004"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
              "blockpress_task.json", "trainer_state.pt"):
        assert (ck / f).is_file(), f
    assert (part / "loss.png").is_file()
    # the resumed final weights equal the uninterrupted run's
    wa = blockpress.load(full / "checkpoint-0000004", progress=False).module.state_dict()
    wb = blockpress.load(ck, progress=False).module.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_between_two_logged_rows_logs_the_uninterrupted_rows(tmp_path):
    """A checkpoint at step 3 with a row every 2 steps: the resumed run's row at step 4 averages steps 3 and 4,
    as the uninterrupted run's does (the checkpoint keeps the steps not yet logged)."""
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*TINY[:TINY.index("--log-every")], *TINY[TINY.index("--log-every") + 2:], "--log-every", "2",
            "--steps", "4", "--save-every", "3"]
    assert cli_main(["train", "sudoku", "--out", str(full), *args]) == 0
    assert cli_main(["train", "sudoku", "--out", str(part), "--stop-after", "3", *args]) == 0
    assert cli_main(["train", "sudoku", "--out", str(part), "--resume", *args]) == 0
    rows = [[{k: v for k, v in r.items() if k not in ("time", "seconds", "tokens_per_s")}
             for r in map(json.loads, open(d / "metrics.jsonl"))] for d in (full, part)]
    assert [r["step"] for r in rows[0]] == [2, 4]
    assert rows[0] == rows[1]


def test_resumed_run_keeps_the_tokenizer_after_pruning(tmp_path):
    """A resumed run must not take its tokenizer from the checkpoint it resumed from: pruning deletes it."""
    out = tmp_path / "run"
    common = ["train", "sudoku", "--out", str(out), "--steps", "4", "--save-every", "1", "--keep-last", "1", *TINY]
    assert cli_main(common + ["--stop-after", "1"]) == 0
    assert cli_main(common + ["--resume"]) == 0
    cks = sorted(p.name for p in out.glob("checkpoint-*"))
    assert cks == ["checkpoint-0000004"]  # checkpoint-0000001 (resumed from) is gone
    assert (out / cks[0] / "tokenizer.json").is_file()
    assert blockpress.load(out / cks[0], progress=False).tokenizer is not None


def test_trained_checkpoint_loads_in_transformers_with_identical_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    from blockpress.train import objective as obj
    from blockpress.train.sizes import model_config

    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=12), seed=0)
    # a few real optimisation steps so every tensor differs from its init
    cfg = obj.ObjectiveConfig(seed=0)
    opt = torch.optim.AdamW(lm.module.parameters(), lr=1e-2)
    exs = [([2] + [5 + (i + k) % 10 for i in range(9)], [5 + (3 * i + k) % 10 for i in range(6)]) for k in range(4)]
    for s in range(3):
        loss, _ = obj.compute_loss(lm.module, obj.collate(exs, 8, 16, cfg, s), cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.module.eval()
    lm.save(tmp_path / "m")
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "m").eval()
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    bp = blockpress.load(tmp_path / "m", progress=False)
    use(bp.module, attention="eager")
    ids = torch.tensor([e[0] for e in exs])
    canvas = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.text_config)
        hf.model.encoder(input_ids=ids, past_key_values=cache)
        ref = hf(decoder_input_ids=canvas, past_key_values=cache).logits
        ours_cache = bp.module.new_cache(4, 10)
        bp.module.encode(ids, ours_cache)
        got = bp.module.decode(canvas, ours_cache)
    assert (ref - got).abs().max() < 1e-4


def test_eval_cli_runs_on_a_tiny_sample(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "1", "--save-every", "1", *TINY]) == 0
    ck = out / "checkpoint-0000001"
    res = tmp_path / "r.json"
    assert cli_main(["eval", "sudoku", "--model", str(ck), "--n", "2", "--blanks", "40", "40", "--steps", "1", "2",
                     "--json", str(res)]) == 0
    data = json.loads(res.read_text())
    assert set(data) == {"steps=1", "steps=2"}
    r = data["steps=1"]["per_blanks"]["40"]
    assert r["n"] == 2 and 0 <= r["cell_accuracy"] <= 1 and 0 <= r["clues_kept"] <= 1
    assert data["steps=1"]["overall"]["n"] == 2  # a level given twice is one level (it counted 4 before)
    assert "| 40 | 2 |" in capsys.readouterr().out
    assert cli_main(["eval", "sudoku", "--model", str(ck), "--n", "1", "--blanks", "40", "--ar"]) == 0
    # per-puzzle generators: predictions depend on neither the batch size nor n (n=1 is a prefix of n=3)
    preds = []
    for n, bs in (("3", "3"), ("3", "1"), ("1", "3")):
        assert cli_main(["eval", "sudoku", "--model", str(ck), "--n", n, "--blanks", "40", "--batch-size", bs,
                         "--json", str(res)]) == 0
        preds.append(json.loads(res.read_text())["default"]["per_blanks"]["40"]["predictions"])
    assert len(preds[0]) == 3 and all(len(p) == 81 for p in preds[0])
    assert preds[0] == preds[1] and preds[2] == preds[0][:1]
    assert len(set(preds[0])) > 1  # the untrained model still predicts differently per puzzle
    # --split val: other puzzles (the validation split), recorded as such
    assert cli_main(["eval", "sudoku", "--model", str(ck), "--n", "3", "--blanks", "40", "--split", "val",
                     "--json", str(res)]) == 0
    val = json.loads(res.read_text())["default"]
    assert val["seed"] == "blockpress-sudoku-val" and "val split" in capsys.readouterr().out
    from blockpress.tasks import sudoku as sd

    test_keys = {sd.canonical_key(sol) for _, sol in sd.test_set(40, 3)}
    assert not test_keys & {sd.canonical_key(sol) for _, sol in sd.test_set(40, 3, sd.VAL_SEED)}
    # --samples K: K candidates per puzzle, still independent of batching; named after the flag
    picks = []
    for bs in ("3", "1"):
        assert cli_main(["eval", "sudoku", "--model", str(ck), "--n", "3", "--blanks", "40", "--samples", "2",
                         "--batch-size", bs, "--json", str(res)]) == 0
        data = json.loads(res.read_text())
        assert set(data) == {"default+samples=2"}
        picks.append(data["default+samples=2"]["per_blanks"]["40"]["predictions"])
    assert picks[0] == picks[1]
    for puzzle, pick, first in zip([p for p, _ in sd.test_set(40, 3)], picks[0], preds[0]):
        assert len(sd.broken_cells(puzzle, pick, "cells")) <= len(sd.broken_cells(puzzle, first, "cells"))
    capsys.readouterr()
    assert cli_main(["eval", "sudoku", "--model", str(ck), "--n", "1", "--blanks", "40", "--ar", "--samples", "2"]) == 2
    assert "--samples" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_cli_full_default_sets():
    from blockpress.tasks import sudoku as sd

    if not (sd.DEFAULT_MODEL_PATH / "config.json").is_file():
        pytest.skip("no shipped sudoku model")
    assert cli_main(["eval", "sudoku"]) == 0


def test_chat_rows_train_control_token_text_as_text(tmp_path):
    """A training row's text that spells control tokens (a user asking about `<turn|>`, a reply quoting it) is
    trained as the ordinary tokens that spell it, as inference encodes a request's text; the reply's own markup
    (its end of turn, a tool call) stays control tokens."""
    from blockpress.testing import build_tiny_gemma_tokenizer
    from blockpress.train.data import chat_example

    tok = build_tiny_gemma_tokenizer(tmp_path / "tok")
    said = "a turn ends with <turn|> and a call opens with <|tool_call>"
    row = {"messages": [{"role": "user", "content": f"What does {said} mean?"},
                        {"role": "assistant", "content": f"It means {said}.", "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": {"q": "<turn|>"}}}]}]}
    prompt, resp = chat_example(tok, row)
    assert tok.decode(prompt).count(said) == 1 and tok.decode(resp).count(said) == 1
    end = tok.token_to_id("<turn|>")
    assert (prompt.count(end), resp.count(end)) == (1, 0)  # the user turn's end; the reply ends in a tool response
    assert resp[-1] == tok.token_to_id("<|tool_response>") and tok.token_to_id("<|tool_call>") in resp
    prompt2, resp2 = chat_example(tok, {"prompt": said, "completion": said})
    assert tok.decode(resp2) == said + "<turn|>" and sum(map(tok.is_special, resp2)) == 1


def test_chat_jsonl_supervises_only_the_final_assistant_turn(tmp_path):
    from blockpress.testing import build_tiny_gemma_tokenizer
    from blockpress.train.data import ChatJsonlSource, chat_example

    tok = build_tiny_gemma_tokenizer(tmp_path / "tok")
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                          {"role": "user", "content": "and again?"}, {"role": "assistant", "content": "yes again"}]},
            {"prompt": "2+2?", "completion": "4"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    prompt, resp = chat_example(tok, rows[0])
    assert prompt == tok.apply_chat_template(rows[0]["messages"][:-1], add_generation_prompt=True, tokenize=True)
    # the model header (and the empty thought block of thinking-off) is context, exactly as at inference
    assert "and again?<turn|>\n<|turn>model\n" in tok.decode(prompt)
    assert tok.decode(resp) == "yes again<turn|>"
    assert "hello there" in tok.decode(prompt)  # earlier turns are history
    parts = {"messages": [*rows[0]["messages"][:-1], {"role": "assistant", "content": [
        {"type": "text", "text": "yes "}, {"type": "text", "text": "again"}]}]}
    assert chat_example(tok, parts) == (prompt, resp)  # content parts read as their text, in order
    src = ChatJsonlSource(data, tok, batch_size=2)
    assert sorted(map(len, (src.example(0, 0)[1], src.example(0, 1)[1]))) == sorted([len(resp), len(tok.encode("4")) + 1])
    assert cli_main(["train", str(data), "--tokenizer", str(tmp_path / "tok"), "--size", "nano", "--steps", "2",
                     "--batch-size", "2", "--out", str(tmp_path / "run"), "--save-every", "2", "--eval-every", "0",
                     "--no-progress", "--threads", "1"]) == 0
    lm = blockpress.load(tmp_path / "run" / "checkpoint-0000002", progress=False)
    assert lm.tokenizer is not None and (tmp_path / "run" / "checkpoint-0000002" / "chat_template.jinja").is_file()
    assert lm.generation_config().eos_token_id == [tok.eos_token_id, tok.token_to_id("<turn|>"),
                                                   tok.token_to_id("<|tool_response>")]  # a turn ends


def test_plain_text_training_splits_documents_and_runs_from_the_cli(tmp_path):
    """Plain text: one document per blank-line paragraph, prompt = BOS + a per-document seeded number of
    tokens in [lo, hi], response = the rest + EOS (the end of text); `blockpress train file.txt` runs with a held-out
    eval file."""
    from blockpress.testing import build_tiny_gemma_tokenizer
    from blockpress.train.data import TextSource

    tok = build_tiny_gemma_tokenizer(tmp_path / "tok")
    docs = [" ".join(f"word{i} and{j}" for j in range(12)) for i in range(20)]
    data = tmp_path / "train.txt"
    data.write_text("\n\n".join(docs) + "\n")
    (tmp_path / "held.txt").write_text(docs[0] + "\n\n" + docs[1])
    src = TextSource(data, tok, batch_size=4, prompt_tokens=(1, 5), canvas_length=8)
    lengths = set()
    for i, doc in enumerate(docs):
        prompt, response = src.examples[i]
        assert prompt[0] == tok.bos_token_id and 1 <= len(prompt) - 1 <= 5
        assert prompt[1:] + response[:-1] == tok.encode(doc)  # nothing lost or duplicated at the split
        assert response[-1] == tok.eos_token_id  # the document's end
        lengths.add(len(prompt))
    assert len(lengths) > 1  # the split point varies between documents
    again = TextSource(data, tok, batch_size=4, prompt_tokens=(1, 5), canvas_length=8)
    assert again.examples == src.examples  # seeded: a resumed run sees the same examples
    with pytest.raises(blockpress.errors.InputError, match="prompt_tokens"):
        TextSource(data, tok, batch_size=4, prompt_tokens=(5, 1), canvas_length=8)
    out = tmp_path / "run"
    assert cli_main(["train", str(data), "--tokenizer", str(tmp_path / "tok"), "--size", "nano", "--steps", "2",
                     "--batch-size", "4", "--canvas-length", "8", "--context", "32", "--prompt-tokens", "1", "5",
                     "--out", str(out), "--save-every", "2", "--eval-every", "2", "--eval-data",
                     str(tmp_path / "held.txt"), "--no-progress", "--threads", "1", "--infill-rate", "0.5"]) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert any("eval_loss" in r for r in rows)
    lm = blockpress.load(out / "checkpoint-0000002", progress=False)
    assert lm.canvas_length == 8 and lm.tokenizer is not None
    gen = lm.generation_config()  # stops where the training data's responses stopped
    assert gen.eos_token_id[0] == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id
    assert not (out / "checkpoint-0000002" / "blockpress_task.json").exists()  # a text model, not a task model
    from blockpress.loading import resolve_path

    assert resolve_path(out) == resolve_path(out / "latest") == out / "checkpoint-0000002"  # a run folder: its newest


def test_loss_plot_draws_only_informative_curves(tmp_path):
    from blockpress.train.plot import plot_history

    hist = [{"step": s, "loss": 3.0 - s / 10, "diff": 3.0 - s / 10, "ar": 0.0} for s in range(5)]
    hist += [{"step": 4, "eval_loss": 2.8, "eval_diff": 2.8, "eval_ar": 0.0}]
    assert plot_history(hist, tmp_path / "a.png") == ["train loss", "eval loss"]  # AR off: loss is the diffusion term
    both = [{**h, "ar": 1.0, "loss": h["diff"] + 1.0} for h in hist[:5]]
    assert plot_history(both, tmp_path / "b.png") == ["train loss", "train diff", "train ar"]
    assert (tmp_path / "a.png").stat().st_size > 5000


def test_inplace_sudoku_model_trains_and_solve_holds_the_clues(tmp_path, capsys):
    """--sudoku-format inplace: the folder says so, solve()/run hold the clues on the canvas, and the prompt is <bos>
    alone. An untrained prompt-format model's canvas does not keep them; its answers get them written in."""
    from blockpress.tasks import sudoku as sd

    out = tmp_path / "inpl"
    assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "2", "--save-every", "2",
                     "--sudoku-format", "inplace", *TINY]) == 0
    ck = out / "checkpoint-0000002"
    assert json.loads((ck / "blockpress_task.json").read_text()) == {"task": "sudoku", "format": "inplace"}
    lm = blockpress.load(ck, progress=False)
    assert sd.model_format(lm) == "inplace"
    pairs = sd.test_set(40, 3)
    preds = sd.solve_batch([p for p, _ in pairs], lm, generator=torch.Generator().manual_seed(0))
    scores = [sd.check(p, pr, s) for (p, s), pr in zip(pairs, preds)]
    assert all(r["clues_kept"] == 1.0 and r["well_formed"] for r in scores)
    capsys.readouterr()
    assert cli_main(["run", str(ck), pairs[0][0], "--json", "--seed", "0"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["format"] == "inplace" and res["clues_kept"] == 1.0 and res["token_ids"][81] == sd.EOS_ID
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "mixed"), "--model", str(ck), "--steps", "1",
                     *FINE_TUNE]) == 2  # an inplace model continued in the prompt format: refused
    assert "trained with --sudoku-format inplace" in capsys.readouterr().err
    prompt_run = tmp_path / "prompt"
    assert cli_main(["train", "sudoku", "--out", str(prompt_run), "--steps", "1", "--save-every", "1", *TINY]) == 0
    untrained = blockpress.load(prompt_run / "checkpoint-0000001", progress=False)
    assert sd.model_format(untrained) == "prompt"
    answers = sd.solve_batch([p for p, _ in pairs], untrained, generator=torch.Generator().manual_seed(0))
    assert all(sd.check(p, pr)["clues_kept"] == 1.0 for (p, _), pr in zip(pairs, answers))
    raw = untrained.generate([sd.encode_prompt(p) for p, _ in pairs], max_new_tokens=sd.CANVAS_LEN,
                             eos_token_id=[sd.EOS_ID], pad_token_id=sd.PAD_ID, generator=torch.Generator().manual_seed(0))
    canvases = [sd.decode_answer(t.tolist()).ljust(81, "0") for t in raw.new_tokens]
    assert min(sd.check(p, c)["clues_kept"] for (p, _), c in zip(pairs, canvases)) < 1.0


def test_infill_source_leaves_one_span_per_canvas_free(tmp_path, capsys):
    """--infill-rate: the chosen examples hold every canvas except one span; the others pass through."""
    from blockpress.errors import InputError
    from blockpress.train.data import InfillSource, ListSource

    C = 8
    inner = ListSource([([2], list(range(10, 10 + n))) for n in (5, 8, 19)], batch_size=3)
    src = InfillSource(inner, C, rate=0.5, span=(2, 3), seed=1)
    held_any = plain = 0
    for step in range(40):
        for i in range(3):
            ex = src.example(step, i)
            assert ex[:2] == inner.example(step, i)[:2]
            if len(ex) == 2:
                plain += 1
                continue
            held_any += 1
            resp, held = ex[1], ex[2]
            for start in range(0, len(resp), C):
                free = [j for j in range(start, min(start + C, len(resp))) if not held[j]]
                assert 2 <= len(free) <= 3 and free == list(range(free[0], free[0] + len(free)))
            assert src.example(step, i) == ex  # deterministic
    assert held_any > 20 and plain > 20
    with pytest.raises(InputError, match="infill-rate must be in"):
        InfillSource(inner, C, rate=1.5)
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "x"), "--infill-rate", "0.5", *TINY]) == 2
    assert "for Sudoku use --sudoku-format inplace" in capsys.readouterr().err
    assert cli_main(["train", str(tmp_path / "t.txt"), "--augment", "4", *TEXT]) == 2
    assert "apply to `blockpress train sudoku` only" in capsys.readouterr().err
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "y"), "--swap-rate", "1.5", *TINY]) == 2
    assert "--swap-rate must be in [0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "z"), "--rollout", "1.5", *TINY]) == 2
    assert "--rollout must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_bad_training_data_and_flags_are_one_line_errors(tmp_path, capsys):
    """Broken data files and out-of-range flags exit 2 with the file, line and fix, before any output."""
    from blockpress.testing import build_tiny_gemma_tokenizer

    build_tiny_gemma_tokenizer(tmp_path / "tok")
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    cases = {
        "missing.jsonl": (None, "data file .*missing.jsonl not found"),
        "array.jsonl": ("[1, 2]\n", r"array.jsonl:1 is a JSON list, not an object"),
        "msgs.jsonl": (json.dumps(ok) + '\n{"messages": "nope"}\n', r"msgs.jsonl:2: 'messages' must be a list"),
        "role.jsonl": (json.dumps({"messages": [{"content": "x"}, ok["messages"][1]]}) + "\n",
                       r"role.jsonl:1: each message must be an object with a string 'role'"),
        "pc.jsonl": ('{"prompt": "a", "completion": 5}\n', r"pc.jsonl:1: 'prompt' and 'completion' must be strings"),
        "text.jsonl": ('{"text": ["a"]}\n', r"text.jsonl:1: 'text' must be a string"),
        # a row without "text" in a text file was dropped without a word (the kind is the first row's)
        "mixed.jsonl": ('{"text": "a b c d e f"}\n' + json.dumps(ok) + "\n", r"mixed.jsonl:2: no 'text' field"),
        "latin1.txt": (b"caf\xe9 au lait\n", r"latin1.txt is not UTF-8 text"),
    }
    import re

    for name, (content, needle) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        out = tmp_path / ("out-" + name)
        assert cli_main(["train", str(path), "--tokenizer", str(tmp_path / "tok"), *TEXT, "--steps", "1",
                         "--out", str(out)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert re.search(needle, err) and "\n" not in err and "Traceback" not in err, (name, err)
        assert not out.exists(), name  # nothing written
    for flags, needle in ((["--steps", "0"], "--steps: expected a positive integer"),
                          (["--lr", "-1"], "--lr: expected a finite number > 0"),
                          (["--batch-size", "0"], "--batch-size: expected a positive integer"),
                          (["--lora", "-1"], "--lora: expected an integer >= 0")):
        with pytest.raises(SystemExit) as e:
            cli_main(["train", "sudoku", *TINY, *flags, "--out", str(tmp_path / "f")])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert cli_main(["train", "sudoku", "--size", "huge", "--out", str(tmp_path / "h")]) == 2
    assert "unknown model size 'huge'; choose one of" in capsys.readouterr().err
    # each of these was a traceback (ValueError, IndexError) or, for --model kjv, a text model trained on puzzles
    (tmp_path / "small.json").write_text(json.dumps({"model_type": "diffusion_gemma", "text_config": {"vocab_size": 512}}))
    for flags, needle in ((["--lora", "4", "--lora-targets", "q_proj,bogus"], "--lora-targets: unknown projection"),
                          (["--blanks", "10", "5"], "--blanks 10 5: give LO <= HI in 0..64"),
                          (["--config", str(tmp_path / "small.json")], "needs vocab_size >= "),
                          (["--model", "kjv"], "is not a Sudoku model"),
                          # accepted and ignored before: a run other than the one asked for
                          (["--lora-alpha", "3"], "--lora-alpha / --lora-targets (they shape LoRA adapters"),
                          (["--eval-data", "x.txt"], "--eval-data / --prompt-tokens (text and chat data"),
                          (["--infill-span", "2", "4"], "--infill-span (the spans of --infill-rate P")):
        out = tmp_path / "x"
        base = FINE_TUNE if "--model" in flags else TINY
        assert cli_main(["train", "sudoku", *base, "--steps", "1", *flags, "--out", str(out)]) == 2, flags
        assert needle in capsys.readouterr().err, flags
        assert not out.exists(), flags
    # accepted and ignored before: a from-scratch size beside --model, Sudoku's blanks on text, prompt flags on chat
    (tmp_path / "c.jsonl").write_text(json.dumps(ok) + "\n")
    for argv, needle in ((["sudoku", "--model", "sudoku", "--size", "mini"], "--size / --config (a model trained "
                                                                              "from scratch"),
                         (["sudoku", "--ar-only", "--ar-weight", "0"], "--ar-weight (--ar-only trains the next-token"),
                         ([str(tmp_path / "c.jsonl"), "--model", "assistant", "--blanks", "3", "9"], "--blanks (Sudoku"),
                         ([str(tmp_path / "c.jsonl"), "--model", "assistant", "--prompt-tokens", "4", "8"],
                          "--prompt-tokens (plain text's prompts")):
        assert cli_main(["train", *argv, "--steps", "1", "--out", str(tmp_path / "y")]) == 2, argv
        assert needle in capsys.readouterr().err, argv


def test_training_from_scratch_takes_the_tokenizers_special_ids_and_whole_documents(tmp_path):
    """A tokenizer whose special ids are not 0/1/2 (<unk> <bos> <eos> <pad>): the model's config took pad 0, eos 1,
    bos 2 from the size presets, so canvases were filled with "<bos>" as their end. A document longer than the
    1,024-token example limit kept its head only (95 % of one long file dropped without a word); it is cut into
    examples. A byte-order mark no longer makes a .jsonl unreadable. The logged lr is the one the step ran at."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    from blockpress.tokenizer import Tokenizer
    from blockpress.train.data import TextSource

    words = [f"w{i}" for i in range(300)]
    hf = HFTokenizer(models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<bos>", "<eos>", "<pad>"]))
    (tmp_path / "tok").mkdir()
    hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    long_doc = " ".join(words[i % 300] for i in range(2500))
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"text": long_doc}) + "\n").encode())
    src = TextSource(data, tok, batch_size=2, prompt_tokens=(1, 4), canvas_length=8)
    assert len(src.examples) == 3 and sum(len(p) - 1 + len(r) for p, r in src.examples) == 2500 + 1  # + its EOS
    out = tmp_path / "run"
    assert cli_main(["train", str(data), "--tokenizer", str(tmp_path / "tok"), "--size", "nano", "--steps", "2",
                     "--batch-size", "2", "--canvas-length", "8", "--context", "16", "--warmup", "2", "--log-every",
                     "1", "--out", str(out), "--save-every", "2", "--eval-every", "0", "--no-progress",
                     "--threads", "1"]) == 0
    text = json.loads((out / "checkpoint-0000002" / "config.json").read_text())["text_config"]
    assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (1, 2, 3)
    lrs = [r["lr"] for r in map(json.loads, open(out / "metrics.jsonl")) if "lr" in r]
    assert lrs == pytest.approx([5e-4, 1e-3])  # warmup 2 at --lr 1e-3: steps 1 and 2 ran at these


def test_full_disk_at_a_checkpoint_keeps_the_last_one_and_resumes(tmp_path, capsys, monkeypatch):
    """A checkpoint write that fails (ENOSPC) is a one-line error naming --resume and the last complete
    checkpoint; the half-written folder is removed, `latest` still points at the previous checkpoint,
    and --resume from it finishes the run."""
    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    real_save = torch.save
    calls = []

    def flaky_save(obj, f, *a, **k):
        if isinstance(f, (str, Path)) and "checkpoint-0000004" in str(f):  # its trainer state, written last
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", flaky_save)
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "No space left on device" in err and "continue from checkpoint-0000002: blockpress train sudoku" in err
    assert err.endswith("--resume") and "\n" not in err
    assert not (out / "checkpoint-0000004").exists()
    assert (out / "latest").read_text() == "checkpoint-0000002"
    monkeypatch.setattr(torch, "save", real_save)
    assert cli_main([*args, "--resume"]) == 0
    assert (out / "latest").read_text() == "checkpoint-0000004"
    assert (out / "checkpoint-0000004" / "trainer_state.pt").is_file()


def _full_disk_cases():
    """(what raises, how): the exception types a full disk really produces in each writer."""
    from safetensors import SafetensorError

    enospc = ("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on "
              "device\" })")
    return {
        "torch.save": (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 0"),
                       "RuntimeError"),
        "safetensors": (SafetensorError(enospc), "SafetensorError"),
        "oserror": (OSError(28, "No space left on device"), "No space left on device"),
    }


@pytest.mark.parametrize("case", ["torch.save", "safetensors", "oserror"])
def test_every_save_failure_keeps_latest_and_says_how_to_resume(tmp_path, capsys, monkeypatch, case):
    """A full disk at a checkpoint: whatever the writer raises, the half-written checkpoint (or the atomic
    write's temp folder) is removed, `latest` still names the last complete checkpoint, and one line gives the
    cause and the command that resumes (only OSError was caught: a traceback and a half folder stayed)."""
    import safetensors.torch

    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    error, needle = _full_disk_cases()[case]
    target, name = (torch, "save") if case in ("torch.save", "oserror") else (safetensors.torch, "save_file")
    real = getattr(target, name)

    def flaky(*a, **k):  # torch.save: the optimizer's shards (the first write of checkpoint-4 it makes)
        if any(out.glob("*checkpoint-0000004*")):  # the second checkpoint (or its atomic write's temp folder)
            raise error
        return real(*a, **k)

    monkeypatch.setattr(target, name, flaky)
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err
    assert f"continue from checkpoint-0000002: blockpress train sudoku --out {out}" in err and err.endswith(" --resume")
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-0000002"]
    assert (out / "latest").read_text() == "checkpoint-0000002"


def test_resume_cleans_what_an_interrupted_save_left(tmp_path, capsys):
    """--resume removes temp folders of atomic writes and checkpoint folders without a trainer state (a kill
    between the weights and the state), and metrics.jsonl restarts at the resumed step; --resume with nothing
    to resume says so."""
    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    assert cli_main([*args, "--stop-after", "3"]) == 0  # killed after step 3: checkpoint-2 is the latest
    (out / ".checkpoint-0000004.x1y2").mkdir()
    (out / ".checkpoint-0000004.x1y2" / "model.safetensors").write_bytes(b"half")
    (out / "checkpoint-0000006").mkdir()  # weights written, then killed before the trainer state
    (out / "latest.tmp").write_text("checkpoint-0000006")
    assert [json.loads(r)["step"] for r in open(out / "metrics.jsonl")] == [1, 2, 3]
    capsys.readouterr()
    assert cli_main([*args, "--resume"]) == 0
    assert "removed what an interrupted save left: .checkpoint-0000004.x1y2, checkpoint-0000006, latest.tmp" in \
        capsys.readouterr().out
    left = sorted(p.name for p in out.iterdir() if "checkpoint" in p.name)
    assert left == ["checkpoint-0000002", "checkpoint-0000004"]
    assert [json.loads(r)["step"] for r in open(out / "metrics.jsonl")] == [1, 2, 3, 4]  # row 3 once, not twice
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "fresh"), "--steps", "1", *TINY, "--resume"]) == 0
    assert "nothing to resume in" in capsys.readouterr().err


def test_tokenizer_save_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """tokenizers raises a bare Exception when it cannot write (a full disk): one line, not a traceback."""
    from blockpress.tasks import sudoku as sd

    class Full:
        def save(self, path):
            raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(sd, "build_tokenizer", lambda: Full())
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "run"), "--steps", "2", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert "could not write" in err and "No space left on device" in err and "\n" not in err


def test_warmup_longer_than_steps_warns(tmp_path, capsys):
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "run"), *TINY, "--steps", "1", "--warmup", "4"]) == 0
    assert "--warmup 4 is longer than --steps 1: the learning rate never reaches --lr (it peaks at 25 % of it)" in \
        capsys.readouterr().err


def test_a_new_run_into_a_run_folder_is_refused(tmp_path, capsys):
    """Training into a folder that holds a run's checkpoints, without --resume, overwrote them silently (the old
    run's checkpoint-2 replaced, `latest` moved, metrics.jsonl mixing two runs); it is refused in one line. An --out
    that is a file is refused the same way (it was a NotADirectoryError)."""
    out = tmp_path / "run"
    assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "2", "--save-every", "2", *TINY]) == 0
    before = (out / "checkpoint-0000002" / "model.safetensors").read_bytes()
    assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "2", "--seed", "1", *TINY]) == 2
    assert "already holds a training run's checkpoints" in capsys.readouterr().err
    assert (out / "checkpoint-0000002" / "model.safetensors").read_bytes() == before
    (tmp_path / "file").write_text("x")
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "file"), "--steps", "1", *TINY]) == 2
    assert "is a file" in capsys.readouterr().err


def test_fine_tuning_keeps_the_task_file_and_a_save_replaces_a_whole_checkpoint(tmp_path):
    """A Sudoku fine-tune wrote {"task", "format"} only: the base model's "samples" (the shipped model's 8
    candidates) was dropped, and the fine-tune scored lower with unchanged weights. Resuming from a checkpoint older
    than a complete one (a run killed between its trainer state and `latest`) saves that newer step again: the
    save refused the folder ("optimizer" is not a checkpoint file) and the failure handler deleted it."""
    base = tmp_path / "base"
    assert cli_main(["train", "sudoku", "--out", str(base), "--steps", "1", "--save-every", "1", *TINY]) == 0
    ck = base / "checkpoint-0000001"
    task = json.loads((ck / "blockpress_task.json").read_text())
    (ck / "blockpress_task.json").write_text(json.dumps({**task, "samples": 3}))
    tuned = tmp_path / "tuned"
    assert cli_main(["train", "sudoku", "--model", str(ck), "--out", str(tuned), "--steps", "2", "--save-every", "1",
                     *[a for a in TINY if a not in ("--size", "nano")]]) == 0
    assert json.loads((tuned / "checkpoint-0000002" / "blockpress_task.json").read_text())["samples"] == 3
    (tuned / "latest").write_text("checkpoint-0000001")  # killed after step 2's state, before `latest` moved
    assert cli_main(["train", "sudoku", "--model", str(ck), "--out", str(tuned), "--steps", "2", "--save-every", "1",
                     "--resume", *[a for a in TINY if a not in ("--size", "nano")]]) == 0
    assert (tuned / "latest").read_text() == "checkpoint-0000002"
    assert (tuned / "checkpoint-0000002" / "optimizer").is_dir()


def _rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_a_diverged_run_stops_before_it_saves_and_continues_at_a_lower_lr(tmp_path, capsys):
    """--lr 1e4 --clip 0: the loss is NaN from step 4. It trained on, wrote NaN checkpoints and pruned the finite ones
    (--keep-last 1), leaving nothing to resume. It stops at the first log step after it, with one line naming the
    last good checkpoint; that checkpoint is kept, and a resume with a lower --lr goes on from it at that rate."""
    from blockpress.train.trainer import TrainConfig, lr_lambda

    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--size", "nano", "--batch-size", "2", "--threads", "1",
            "--no-progress", "--eval-every", "0", "--warmup", "1", "--log-every", "1", "--save-every", "2",
            "--keep-last", "1", "--steps", "6", "--clip", "0"]
    assert cli_main([*args, "--lr", "1e4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "training diverged at step 4: the loss or the gradient norm is not finite" in err, err
    assert "lower --lr (now 10000)" in err
    assert f"continue from checkpoint-0000002, e.g. blockpress train sudoku --out {out}" in err
    assert err.endswith("--lr 1000 --resume"), err  # a tenth of the rate that diverged, not that rate again
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-0000002"]
    assert (out / "latest").read_text() == "checkpoint-0000002"
    assert all(torch.isfinite(t).all() for t in blockpress.load(out, progress=False).module.state_dict().values())
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]  # no NaN row
    assert cli_main([*args, "--lr", "1e-3", "--resume"]) == 0
    f = lr_lambda(TrainConfig(steps=6, warmup=1, lr=1e-3))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["loss"] == r["loss"] for r in rows)
    assert [r["lr"] for r in rows[2:]] == [1e-3 * f(s) for s in range(2, 6)]  # the new rate, on the old schedule


def test_divergence_is_checked_on_the_device_and_read_at_log_steps(tmp_path):
    """The flag costs no host sync per step: it is a device tensor holding the first non-finite step, read at log
    steps, before an eval and before a save (where values are read back anyway). A non-finite weight stops a save
    too."""
    from blockpress.errors import BlockpressError
    from blockpress.train.data import ListSource
    from blockpress.train.sizes import model_config
    from blockpress.train.trainer import DivergedError, TrainConfig, Trainer

    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=8), seed=0)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), steps=3, batch_size=2, log_every=3, eval_every=0, save_every=0,
                      progress=False)
    tr = Trainer(lm, ListSource([([2, 5, 6], [7, 8, 9])] * 2, batch_size=2), cfg)
    tr.train_step()
    assert isinstance(tr.diverged_at, torch.Tensor) and int(tr.diverged_at) == 0
    with torch.no_grad():
        next(p for p in lm.module.parameters() if p.dim() == 2).view(-1)[0] = float("inf")
    with pytest.raises(DivergedError, match="at step 1: the weights are not finite") as e:
        tr.save()
    assert isinstance(e.value, BlockpressError) and not (tmp_path / "run" / "checkpoint-0000001").exists()
    tr.train_step()  # the loss of a model holding inf
    assert int(tr.diverged_at) == 2
    tr.train_step()
    assert int(tr.diverged_at) == 2  # the first one is kept
    with pytest.raises(DivergedError, match="at step 2: the loss or the gradient norm"):
        tr.check_finite()


def test_a_full_disk_between_checkpoints_is_one_line_naming_the_last_checkpoint(tmp_path):
    """metrics.jsonl is appended at every log step; a disk that filled up since the last checkpoint raised OSError
    with a traceback. Here the log is on /dev/full (every write: ENOSPC)."""
    import os

    from blockpress.errors import CheckpointError
    from blockpress.train.data import ListSource
    from blockpress.train.sizes import model_config
    from blockpress.train.trainer import TrainConfig, Trainer

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    out = tmp_path / "run"
    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=8), seed=0)
    cfg = TrainConfig(out_dir=str(out), steps=4, batch_size=2, log_every=1, eval_every=0, save_every=2,
                      stop_after=2, progress=False)
    tr = Trainer(lm, ListSource([([2, 5, 6], [7, 8, 9])] * 2, batch_size=2), cfg, resume_command="RESUME")
    tr.train()
    assert (out / "latest").read_text() == "checkpoint-0000002"
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to("/dev/full")
    cfg.stop_after = None
    with pytest.raises(CheckpointError) as e:
        tr.train()
    msg = str(e.value)
    assert f"could not write {out / 'metrics.jsonl'} (OSError: No space left on device)" in msg and "\n" not in msg
    assert msg.endswith("free disk space, then continue from checkpoint-0000002: RESUME")


def test_grad_norm_is_logged_unclipped_and_the_plain_progress_line_follows_log_every(tmp_path, capsys):
    """--clip 0 logged grad_norm 0.0; the plain progress line came every 10 steps whatever --log-every said; the eval
    loss on training examples (no --eval-data) was labelled as a held-out one."""
    from blockpress.testing import build_tiny_gemma_tokenizer

    runs = {}
    for clip in ("0", "1e9"):  # 1e9: the norm is computed and nothing is clipped
        out = tmp_path / f"clip{clip}"
        assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "2", *TINY, "--clip", clip]) == 0
        runs[clip] = [r["grad_norm"] for r in _rows(out)]
    assert runs["0"] == runs["1e9"] and min(runs["0"]) > 0
    plain = [a for a in TINY if a != "--no-progress"]
    capsys.readouterr()
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "p"), "--steps", "4", *plain, "--log-every", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["2/4", "4/4"]
    build_tiny_gemma_tokenizer(tmp_path / "tok")
    (tmp_path / "t.txt").write_text("\n\n".join("the cat sat on the mat and then it sat again" for _ in range(4)))
    text = ["train", str(tmp_path / "t.txt"), "--tokenizer", str(tmp_path / "tok"), "--size", "nano",
            "--canvas-length", "8", "--context", "16", "--steps", "1", "--batch-size", "2", "--threads", "1",
            "--eval-every", "1", "--eval-batches", "1"]
    assert cli_main([*text, "--out", str(tmp_path / "t1")]) == 0
    assert "step 1: eval loss (training examples)" in capsys.readouterr().out
    assert cli_main([*text, "--out", str(tmp_path / "t2"), "--eval-data", str(tmp_path / "t.txt")]) == 0
    assert "step 1: eval loss " in (o := capsys.readouterr().out) and "training examples" not in o


def test_grad_accum_gives_the_gradients_of_the_whole_batch(tmp_path):
    """N micro-batches of b: the same examples and noise as one batch of N*b, each loss scaled by 1/N, so the same
    gradients (up to fp32 summation order), loss and grad norm; eval in micro-batches gives the same eval loss."""
    from blockpress.train.data import ListSource
    from blockpress.train.sizes import model_config
    from blockpress.train.trainer import TrainConfig, Trainer

    g = torch.Generator().manual_seed(0)
    exs = [(torch.randint(5, 16, (3 + k % 4,), generator=g).tolist(),
            torch.randint(5, 16, (4 + 5 * (k % 3),), generator=g).tolist()) for k in range(8)]
    got = {}
    for n in (1, 4):
        lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=16), seed=0)
        use(lm.module, attention="eager")
        cfg = TrainConfig(out_dir=str(tmp_path / f"n{n}"), steps=2, batch_size=8, grad_accum=n, clip=0.0,
                          eval_every=0, progress=False)
        tr = Trainer(lm, ListSource(exs, batch_size=8), cfg)
        stats = tr.train_step()
        grads = {k: p.grad.clone() for k, p in lm.module.named_parameters() if p.grad is not None}
        got[n] = stats, grads, tr.evaluate(), lm.module.state_dict()
    (s1, g1, e1, w1), (s4, g4, e4, w4) = got[1], got[4]
    assert set(g1) == set(g4)
    for k in g1:  # fp32 rounding of another summation order: ~1e-7 of the gradient's norm
        assert (g1[k] - g4[k]).norm() <= 1e-5 * g1[k].norm() + 1e-8, (k, (g1[k] - g4[k]).norm() / g1[k].norm())
    for key in ("loss", "diff", "ar", "acc", "grad_norm"):
        assert s1[key] == pytest.approx(s4[key], rel=1e-5), key
    assert e1["eval_loss"] == pytest.approx(e4["eval_loss"], rel=1e-5)
    assert all(torch.allclose(w1[k], w4[k], atol=1e-6) for k in w1)


def _accum_worker(rank, world, init_file, out, fsdp):
    """One process of a 2-process DDP (no_sync on the first micro-batch) or FSDP2 run with --grad-accum 2; see
    test_distributed.py for why a file rendezvous and os._exit."""
    import datetime
    import os
    import sys

    from blockpress.train import distributed as dist
    from blockpress.train.data import ListSource
    from blockpress.train.sizes import model_config
    from blockpress.train.trainer import TrainConfig, Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120))
    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=16), seed=0)
    use(lm.module, attention="eager")
    cfg = TrainConfig(out_dir=out, steps=1, batch_size=8, grad_accum=2, clip=0.0, eval_every=0, progress=False)
    tr = Trainer(lm, ListSource(_accum_examples(), batch_size=8), cfg, rank=rank, world=world,
                 wrapped=dist.wrap(lm.module, fsdp=fsdp))
    stats = tr.train_step()
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)  # FSDP2: gathered, a collective
             for k, p in lm.module.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"stats": stats, "grads": grads}, os.path.join(out, "two.pt"))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def _accum_examples():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(5, 16, (3 + k % 4,), generator=g).tolist(),
             torch.randint(5, 16, (4 + 5 * (k % 3),), generator=g).tolist()) for k in range(8)]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_grad_accum_under_ddp_or_fsdp_equals_one_process(tmp_path, wrapper):
    """2 processes x 2 micro-batches of 2 (DDP: the first under no_sync; FSDP2: each reduce-scattered into the shards,
    the backward in two parts scaled by 1/2): one process's batch of 8."""
    import torch.multiprocessing as mp

    from blockpress.train.data import ListSource
    from blockpress.train.sizes import model_config
    from blockpress.train.trainer import TrainConfig, Trainer

    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=16), seed=0)
    use(lm.module, attention="eager")
    tr = Trainer(lm, ListSource(_accum_examples(), batch_size=8),
                 TrainConfig(out_dir=str(tmp_path), steps=1, batch_size=8, clip=0.0, eval_every=0, progress=False))
    one = tr.train_step()
    mp.spawn(_accum_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path), wrapper == "fsdp"), nprocs=2,
             join=True)
    two = torch.load(tmp_path / "two.pt")
    assert two["stats"]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["stats"]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for k, p in lm.module.named_parameters():
        if p.grad is not None:
            assert (p.grad - two["grads"][k]).norm() <= 1e-5 * p.grad.norm() + 1e-8, k


def test_a_resume_never_starts_over_on_top_of_complete_checkpoints(tmp_path, capsys):
    """`latest` gone, or naming a checkpoint that is not there: --resume said "nothing to resume", trained from step 0
    and overwrote (then pruned) the run's complete checkpoints. Now it continues from the newest complete one, and a
    folder of checkpoints none of which can be continued is refused; a damaged trainer_state.pt is one line."""
    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "6", "--save-every", "2", *TINY]
    assert cli_main([*args, "--stop-after", "4"]) == 0
    ck4 = (out / "checkpoint-0000004" / "model.safetensors").read_bytes()
    (out / "latest").write_text("checkpoint-0000099")
    capsys.readouterr()
    assert cli_main([*args, "--resume"]) == 0
    assert "names 'checkpoint-0000099', not a complete checkpoint: resuming from checkpoint-0000004" in \
        capsys.readouterr().err
    assert (out / "checkpoint-0000004" / "model.safetensors").read_bytes() == ck4  # not trained over from step 0
    assert [json.loads(r)["step"] for r in open(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    (out / "latest").unlink()  # no latest at all: the newest complete checkpoint, which is the run's end
    ck6 = (out / "checkpoint-0000006" / "model.safetensors").read_bytes()
    assert cli_main([*args, "--resume"]) == 0  # nothing left to train, nothing overwritten
    assert (out / "checkpoint-0000006" / "model.safetensors").read_bytes() == ck6
    assert [json.loads(r)["step"] for r in open(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    for ck in out.glob("checkpoint-*"):
        (ck / "trainer_state.pt").unlink()
    capsys.readouterr()
    assert cli_main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds checkpoint folders, but none with its trainer state" in err and "\n" not in err
    damaged = tmp_path / "damaged"
    assert cli_main(["train", "sudoku", "--out", str(damaged), "--steps", "2", "--save-every", "2", *TINY]) == 0
    state = damaged / "checkpoint-0000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    capsys.readouterr()
    assert cli_main(["train", "sudoku", "--out", str(damaged), "--steps", "4", "--save-every", "2", *TINY,
                     "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{state} is damaged" in err and "\n" not in err


def test_a_save_into_a_runs_checkpoint_is_refused(tmp_path, capsys):
    """`blockpress convert kjv RUN/checkpoint-N` (or `lm.save` there) replaced the checkpoint and deleted its
    optimizer state and trainer_state.pt without a word: the run could no longer be resumed from it. Now it is
    refused, nothing written; the trainer itself still writes a step of its own run again (a resume from an
    earlier checkpoint)."""
    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    assert cli_main(args) == 0
    ck = out / "checkpoint-0000004"
    before = sorted(p.name for p in ck.iterdir())
    assert cli_main(["convert", "sudoku", str(ck), "--precision", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a training run's checkpoint (trainer_state.pt and optimizer)" in err and "\n" not in err
    assert sorted(p.name for p in ck.iterdir()) == before
    (out / "latest").write_text("checkpoint-0000002")  # back to step 2: the resume writes step 4 again
    assert cli_main([*args, "--resume"]) == 0 and (ck / "trainer_state.pt").is_file()


def test_ctrl_c_says_where_the_run_stands_and_how_to_go_on(tmp_path, capsys, monkeypatch):
    """Ctrl-C ended a run with no word of its last checkpoint or how to resume; now it says both (the exit code
    stays 130)."""
    from blockpress.train.trainer import Trainer

    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    assert cli_main([*args, "--stop-after", "2"]) == 0

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", interrupted)
    capsys.readouterr()
    assert cli_main([*args, "--resume"]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 2; the last complete checkpoint is checkpoint-0000002: continue with blockpress " \
           "train sudoku" in err and "--resume" in err
