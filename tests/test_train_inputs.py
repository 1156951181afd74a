"""What `blockpress train` reads: data files, flags and the run folder it resumes. Bad input is one line (the file,
line or flag, and the fix), before any work, and leaves a run's checkpoints as they were."""

import json
from pathlib import Path

import pytest
import torch

import blockpress
from blockpress.cli import main as cli_main
from blockpress.errors import InputError

TINY = ["--size", "nano", "--batch-size", "4", "--lr", "3e-3", "--warmup", "2", "--log-every", "1",
        "--eval-every", "0", "--threads", "1", "--no-progress", "--blanks", "40", "44"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def _word_tokenizer(folder: Path, n_words: int = 300):
    """A word-level tokenizer (one token per word w0..wN, <unk> <bos> <eos> <pad> = 0..3): token counts are word
    counts."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    from blockpress.tokenizer import Tokenizer

    hf = HFTokenizer(models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator([" ".join(f"w{i}" for i in range(n_words))], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<bos>", "<eos>", "<pad>"]))
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return Tokenizer.from_dir(folder)


# ----------------------------------------------------------------------------- flags (finding: weights unchecked)
@pytest.mark.parametrize("flags, needle", [
    (["--ar-weight", "nan"], "--ar-weight must be a finite number >= 0, got nan"),
    (["--ar-weight", "inf"], "--ar-weight must be a finite number >= 0, got inf"),
    (["--ar-weight", "-1"], "--ar-weight must be a finite number >= 0, got -1.0"),
    (["--min-lr-ratio", "3"], "--min-lr-ratio must be in [0, 1]"),
    (["--min-lr-ratio", "nan"], "--min-lr-ratio must be in [0, 1]"),
    (["--grad-accum", "3"], "--batch-size 4 must be divisible by the number of processes (1) x --grad-accum (3)"),
])
def test_bad_objective_and_schedule_values_are_refused(tmp_path, capsys, flags, needle):
    out = tmp_path / "run"
    assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "1", *TINY, *flags]) == 2
    assert needle in _one_line(capsys)
    assert not (out / "checkpoint-0000001").exists()


def test_the_configs_validate_themselves_for_the_python_api():
    from blockpress.train.objective import ObjectiveConfig
    from blockpress.train.trainer import TrainConfig

    with pytest.raises(ValueError, match="min_lr_ratio must be in"):
        TrainConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="grad_accum must be an integer >= 1"):
        TrainConfig(grad_accum=0)
    with pytest.raises(ValueError, match="both 0"):
        ObjectiveConfig(ar_weight=0, diffusion_weight=0)
    ObjectiveConfig(ar_weight=0, diffusion_weight=0, ar_only=True)  # the AR baseline takes its loss unweighted
    TrainConfig(min_lr_ratio=0.0), TrainConfig(min_lr_ratio=1.0)


# ----------------------------------------------------------------------------- plain text: the end of a document
def test_text_ends_each_document_with_eos_and_cuts_long_ones_at_whole_canvases(tmp_path):
    """Spec §2.4: the EOS after a response is how the model learns to stop. A response of whole canvases had no
    end marker at all; a document cut into 1,024-token examples got an EOS fill at every cut, where the text goes
    on. Now: EOS at the document's true end only, cuts on whole canvases (nothing to fill), nothing lost."""
    from blockpress.train.data import TextSource, trained_length
    from blockpress.train.objective import split_canvases

    tok = _word_tokenizer(tmp_path / "tok")
    C, eos = 8, tok.eos_token_id
    exact = " ".join(f"w{i}" for i in range(4 + 2 * C))  # 4 prompt tokens + a response of exactly 2 canvases
    (tmp_path / "exact.txt").write_text(exact)
    (p, r), = TextSource(tmp_path / "exact.txt", tok, 1, prompt_tokens=4, canvas_length=C).examples
    canvases = split_canvases(r, C, eos)
    assert len(canvases) == 3 and canvases[-1] == [eos] * C  # the end is written and supervised

    words = [f"w{i % 300}" for i in range(2500)]
    (tmp_path / "long.txt").write_text(" ".join(words))
    for limit in (None, 100):  # the example size (1,024), or the model's positions when they are fewer
        src = TextSource(tmp_path / "long.txt", tok, 1, prompt_tokens=(1, 5), canvas_length=C, max_positions=limit)
        *cuts, last = src.examples
        assert len(cuts) >= 2
        for p, r in cuts:
            assert len(r) % C == 0 and eos not in r  # whole canvases: no EOS, and no EOS fill in any canvas
            assert all(eos not in c for c in split_canvases(r, C, eos))
        assert last[1][-1] == eos and eos not in last[1][:-1]
        assert [t for p, r in src.examples for t in p[1:] + r][:-1] == tok.encode(" ".join(words))  # nothing lost
        assert max(trained_length(p, r, C) for p, r in src.examples) <= (limit or 1024)


# ----------------------------------------------------------------------------- chat rows longer than the model
def test_a_chat_row_longer_than_the_models_positions_is_refused_or_cut_with_max_prompt(tmp_path, capsys):
    """A row far past max_position_embeddings trained silently (one step of 20 GB); it is refused naming its line,
    and --max-prompt N (keep the last N prompt tokens) makes it fit."""
    from blockpress.testing import build_tiny_gemma_tokenizer
    from blockpress.train.data import ChatJsonlSource

    tok = build_tiny_gemma_tokenizer(tmp_path / "tok")
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    long = {"messages": [{"role": "user", "content": "word5 " * 1100}, {"role": "assistant", "content": "yo"}]}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ok) + "\n" + json.dumps(long) + "\n")
    with pytest.raises(InputError, match=r"rows.jsonl:2: prompt \d+ \+ 1 canvas\(es\) of 8 = \d+ tokens, more than "
                                         r"the model's 512 positions .*--max-prompt 504"):
        ChatJsonlSource(data, tok, 2, canvas_length=8, max_positions=512)
    src = ChatJsonlSource(data, tok, 2, canvas_length=8, max_positions=512, max_prompt=504)
    assert max(len(p) for p, _ in src.examples) == 504
    # the CLI: a model from scratch has 4,096 positions
    base = ["train", str(data), "--tokenizer", str(tmp_path / "tok"), "--size", "nano", "--canvas-length", "8",
            "--context", "16", "--steps", "1", "--batch-size", "2", "--eval-every", "0", "--no-progress",
            "--threads", "1"]
    assert cli_main([*base, "--out", str(tmp_path / "a")]) == 2
    err = _one_line(capsys)
    assert f"{data}:2: prompt" in err and "4096 positions" in err and "--max-prompt" in err
    assert not (tmp_path / "a").exists()
    assert cli_main([*base, "--out", str(tmp_path / "b"), "--max-prompt", "64"]) == 0
    capsys.readouterr()
    assert cli_main(["train", "sudoku", "--out", str(tmp_path / "c"), "--max-prompt", "64", *TINY]) == 2
    assert "--max-prompt (it cuts chat prompts" in _one_line(capsys)


# ----------------------------------------------------------------------------- data files: messages that fit
def test_empty_folder_and_unreadable_data_are_named(tmp_path, capsys):
    """An empty --eval-data file was "the training data is empty"; a folder was "not found"; text the model's
    tokenizer reads as <unk> (English on the Sudoku model) trained silently."""
    from blockpress.testing import build_tiny_gemma_tokenizer

    build_tiny_gemma_tokenizer(tmp_path / "tok")
    data = tmp_path / "notes.txt"
    data.write_text("\n\n".join("the cat sat on the mat and then it sat again " * 3 for _ in range(4)))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "adir.txt").mkdir()
    scratch = ["--tokenizer", str(tmp_path / "tok"), "--size", "nano", "--canvas-length", "8", "--context", "16",
               "--steps", "1", "--batch-size", "2", "--eval-every", "1", "--no-progress", "--threads", "1"]
    cases = [
        (["train", str(data), *scratch, "--eval-data", str(tmp_path / "empty.txt")], f"{tmp_path / 'empty.txt'} is "
         "empty; give at least one example"),
        (["train", str(tmp_path / "adir.txt"), *scratch], f"{tmp_path / 'adir.txt'} is a folder, not a data file"),
        (["train", str(data), *scratch, "--eval-data", str(tmp_path / "adir.txt")], "adir.txt is a folder"),
        (["train", str(data), "--model", "sudoku", "--steps", "1", "--batch-size", "2", "--no-progress",
          "--threads", "1"], "notes.txt: 99 % of its tokens are unknown to the model's tokenizer (<unk>)"),
    ]
    for i, (argv, needle) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert cli_main([*argv, "--out", str(out)]) == 2, argv
        assert needle in _one_line(capsys), argv
        assert not out.exists()
    # the one reader of data files: eval's passages say the same
    assert cli_main(["eval", "infill", "--model", "kjv", "--data", str(tmp_path / "adir.txt")]) == 2
    assert "adir.txt is a folder, not a data file" in _one_line(capsys)


# ----------------------------------------------------------------------------- the run folder
def test_an_unwritable_out_is_one_line(tmp_path, capsys):
    """--out that cannot be created (here under a file; a read-only disk raises the same OSError) was a traceback,
    from the tokenizer snapshot, the copy of a model's tokenizer files or the trainer's own mkdir."""
    from blockpress.errors import CheckpointError
    from blockpress.train.data import ListSource
    from blockpress.train.sizes import model_config
    from blockpress.train.trainer import TrainConfig, Trainer

    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "run"
    assert cli_main(["train", "sudoku", "--out", str(bad), "--steps", "1", *TINY]) == 2
    assert f"could not write the run folder {bad} (NotADirectoryError" in _one_line(capsys)
    (tmp_path / "notes.txt").write_text("In the beginning God created the heaven and the earth " * 4)
    assert cli_main(["train", str(tmp_path / "notes.txt"), "--model", "kjv", "--out", str(bad), "--steps", "1",
                     "--batch-size", "1", "--no-progress", "--threads", "1"]) == 2
    assert "could not write the run folder" in _one_line(capsys)
    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=8), seed=0)
    tr = Trainer(lm, ListSource([([2, 5], [6, 7])], batch_size=1), TrainConfig(out_dir=str(bad), steps=1,
                                                                               batch_size=1, progress=False))
    with pytest.raises(CheckpointError, match="could not write the run folder"):
        tr.train()


# ----------------------------------------------------------------------------- resuming another run
def test_resume_refuses_flags_that_change_the_examples_or_the_loss(tmp_path, capsys):
    """trainer_state.pt keeps the run's config; a resume with another --batch-size, --seed or objective flag was
    accepted silently (a run that is neither the old one nor a new one). The run folder is left as it was."""
    out = tmp_path / "run"
    args = ["train", "sudoku", "--out", str(out), "--steps", "3", "--save-every", "2", *TINY]
    assert cli_main([*args, "--stop-after", "2"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for flags, needle in ((["--batch-size", "2"], "--batch-size 2 differs from the run being resumed (--batch-size 4"),
                          (["--seed", "7"], "--seed 7 differs from the run being resumed (--seed 0"),
                          (["--swap-rate", "0.2"], "--swap-rate 0.2 differs from the run being resumed (--swap-rate "
                                                   "0.0"),
                          (["--ar-only"], "--ar-only on differs from the run being resumed (--ar-only off")):
        assert cli_main([*args, "--resume", *flags]) == 2, flags
        err = _one_line(capsys)
        assert needle in err and "checkpoint-0000002/trainer_state.pt" in err, err
        after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert after == before
    assert cli_main([*args, "--resume", "--grad-accum", "2"]) == 0  # the same steps, summed in two parts


def test_resume_refuses_other_data_another_model_or_other_prompt_flags(tmp_path, capsys):
    """Another data file, another --model (the assistant's weights went on training on KJV text), --infill-rate,
    --max-prompt or --prompt-tokens were accepted by a resume; each decides the examples, so each is refused now,
    one line naming the flag and both values, the run folder as it was. The same data file moved elsewhere is the
    same data."""
    import shutil

    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(f"In the beginning was paragraph {i}, and it was long enough to learn from."
                                for i in range(40)))
    other = tmp_path / "other.txt"
    other.write_text(text.read_text() + "\n\nOne more.")
    out = tmp_path / "run"
    args = ["--out", str(out), "--steps", "3", "--save-every", "2", "--model", "kjv", "--batch-size", "4",
            "--warmup", "1", "--eval-every", "0", "--threads", "1", "--no-progress"]
    assert cli_main(["train", str(text), *args, "--stop-after", "2"]) == 0
    capsys.readouterr()  # (its note: the AR weight kjv was trained with)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assistant = [a if a != "kjv" else "assistant" for a in args]
    for data, given, needle in (
            (other, args, "the data (other.txt ("),
            (text, assistant, "--model "),
            (text, [*args, "--infill-rate", "0.3"], "--infill-rate 0.3 differs from the run being resumed "
                                                    "(--infill-rate "),
            (text, [*args, "--prompt-tokens", "4", "8"], "--prompt-tokens 4 8 differs from the run being resumed "
                                                         "(--prompt-tokens 16 16")):
        assert cli_main(["train", str(data), *given, "--resume"]) == 2, given
        err = _one_line(capsys)
        assert needle in err and "checkpoint-0000002/trainer_state.pt" in err, err
        assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    moved = tmp_path / "elsewhere" / "notes.txt"
    moved.parent.mkdir()
    shutil.copy(text, moved)
    assert cli_main(["train", str(moved), *args, "--resume"]) == 0


def test_a_fine_tune_trains_with_the_objective_its_model_was_trained_with(tmp_path, capsys):
    """The shipped KJV and Sudoku models trained with the encoder's AR loss off; `train --model kjv` turned it on
    (the default weight 1), and that untrained head's loss led the update (Sudoku: 10 of 10 puzzles solved -> 5 after
    20 steps). A fine-tune now takes the weight its model was trained with (the folder's blockpress_objective.json,
    which every checkpoint the trainer writes carries), says so, and --ar-weight still decides; a resume keeps its
    run's own weight; a damaged file is one line."""
    import shutil

    from blockpress.train.trainer import read_state

    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(f"In the beginning was paragraph {i}, and it was long enough to learn from."
                                for i in range(40)))
    common = ["--steps", "2", "--save-every", "2", "--batch-size", "4", "--warmup", "1", "--eval-every", "0",
              "--threads", "1", "--no-progress"]

    def weight(run: Path) -> float:
        return read_state(run / "checkpoint-0000002")["config"]["objective"]["ar_weight"]

    assert cli_main(["train", str(text), "--model", "kjv", "--out", str(tmp_path / "a"), *common]) == 0
    assert "--ar-weight 0, the weight kjv was trained with" in capsys.readouterr().err
    assert weight(tmp_path / "a") == 0.0
    written = json.loads((tmp_path / "a" / "checkpoint-0000002" / "blockpress_objective.json").read_text())
    assert written["ar_weight"] == 0.0 and "seed" not in written
    # a fine-tune of that checkpoint reads the file the trainer wrote
    assert cli_main(["train", str(text), "--model", str(tmp_path / "a" / "checkpoint-0000002"),
                     "--out", str(tmp_path / "b"), *common]) == 0
    assert weight(tmp_path / "b") == 0.0 and "checkpoint-0000002 was trained with" in capsys.readouterr().err
    # the flag decides over the file, silently
    assert cli_main(["train", str(text), "--model", "kjv", "--ar-weight", "1", "--out", str(tmp_path / "c"),
                     *common]) == 0
    assert "was trained with" not in capsys.readouterr().err
    assert weight(tmp_path / "c") == 1.0
    # a resume continues its run's weight (from scratch with --ar-weight 0: the default 1 was refused before)
    scratch = ["train", "sudoku", "--out", str(tmp_path / "d"), "--steps", "3", "--save-every", "2", *TINY]
    assert cli_main([*scratch, "--ar-weight", "0", "--stop-after", "2"]) == 0
    assert cli_main([*scratch, "--resume"]) == 0
    assert read_state(tmp_path / "d" / "checkpoint-0000003")["config"]["objective"]["ar_weight"] == 0.0
    # lm.save (convert) keeps the record with the weights
    model = blockpress.load("kjv", device="cpu", progress=False)
    model.save(tmp_path / "kjv-copy")
    assert json.loads((tmp_path / "kjv-copy" / "blockpress_objective.json").read_text())["ar_weight"] == 0.0
    # a damaged record is one line naming it
    (tmp_path / "kjv-copy" / "blockpress_objective.json").write_text('{"ar_weight": "off"}')
    capsys.readouterr()
    assert cli_main(["train", str(text), "--model", str(tmp_path / "kjv-copy"), "--out", str(tmp_path / "e"),
                     *common]) == 2
    err = _one_line(capsys)
    assert "kjv-copy/blockpress_objective.json must be a JSON object" in err and "--ar-weight" in err, err
    assert not (tmp_path / "e").exists()
    shutil.rmtree(tmp_path / "kjv-copy")


# ----------------------------------------------------------------------------- data a user brings (audit 8)
def test_user_data_that_trained_the_wrong_thing_is_read_right_or_refused_by_its_line(tmp_path, capsys):
    """Found by a fine-tuning audit, each trained silently on something else than the data said: a chat file saved as
    .json (datasets' to_json) or .JSONL read as plain text; a .csv read as text; OpenAI's legacy functions /
    function_call, an empty final assistant message and `weight: 0` trained an empty reply or the unwanted turn.
    The template's own refusals named no file:line, and the final message as messages[0]."""
    from blockpress.testing import build_tiny_gemma_tokenizer
    from blockpress.train.data import ChatJsonlSource, TextSource, build_source

    tok = build_tiny_gemma_tokenizer(tmp_path / "tok")
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    for name in ("hf.json", "UPPER.JSONL", "rows.ndjson"):
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    base = ["--tokenizer", str(tmp_path / "tok"), "--size", "nano", "--canvas-length", "8", "--context", "16",
            "--steps", "1", "--batch-size", "2", "--eval-every", "0", "--no-progress", "--threads", "1"]
    from blockpress.cli.train import _is_chat

    assert all(_is_chat(str(tmp_path / n)) for n in ("hf.json", "UPPER.JSONL", "rows.ndjson"))
    want = ChatJsonlSource(tmp_path / "hf.json", tok, 1, canvas_length=8).examples
    assert want == ChatJsonlSource(tmp_path / "UPPER.JSONL", tok, 1, canvas_length=8).examples
    (tmp_path / "data.csv").write_text("prompt,completion\nhi,yo\n")
    assert cli_main(["train", str(tmp_path / "data.csv"), *base, "--out", str(tmp_path / "o")]) == 2
    assert "not csv; convert it" in _one_line(capsys)
    with pytest.raises(InputError, match="not csv"):
        build_source("text", str(tmp_path / "data.csv"), tok, 1, 0, canvas_length=8)

    def refused(bad: dict, needle: str):
        data = tmp_path / "bad.jsonl"
        data.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(InputError) as e:
            ChatJsonlSource(data, tok, 1, canvas_length=8)
        assert str(e.value).startswith(f"{data}:2: ") and needle in str(e.value), str(e.value)

    user = {"role": "user", "content": "hi"}
    refused({"messages": [user, {"role": "assistant", "content": None, "function_call": {"name": "f",
                                                                                         "arguments": "{}"}}]},
            "'functions' / 'function_call'")
    refused({**row, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, "deprecated function calling")
    refused({"messages": [user, {"role": "assistant", "content": ""}]}, "no text and no tool calls")
    refused({"messages": [user, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "no text and no tool calls")
    refused({"messages": [user, {"role": "assistant", "content": "no", "weight": 0}]}, "weight 0")
    refused({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            "messages[0].role is 'human'")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    refused({"messages": [user, {"role": "assistant", "content": None, "tool_calls": [call]}]},
            "messages[1].tool_calls[0].function.arguments")
    tool_row = {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "f", "arguments": "{}"}}]}]}
    (tmp_path / "ok.jsonl").write_text(json.dumps(tool_row) + "\n")  # a call with no text is a reply
    assert len(ChatJsonlSource(tmp_path / "ok.jsonl", tok, 1, canvas_length=8).examples) == 1
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    with pytest.raises(InputError, match="ShareGPT's 'conversations' is not read"):
        TextSource(tmp_path / "sharegpt.jsonl", tok, 1, canvas_length=8)


def test_short_documents_are_counted_a_typo_is_named_and_out_is_never_a_model(tmp_path, capsys):
    """Documents no longer than their prompt part were left out without a word (3 of 5 paragraphs of a notes
    file); a canvas longer than an example was diagnosed as a long document; `train sudokuu` asked for --tokenizer;
    --out could be a model folder (its own --model), which then still loaded as the base model."""
    from blockpress.train.data import TextSource

    tok = _word_tokenizer(tmp_path / "tok")
    long = " ".join(f"w{i}" for i in range(40))
    (tmp_path / "notes.txt").write_text("\n\n".join([long, "w1 w2", long, "w3", "w4 w5 w6"]))
    assert len(TextSource(tmp_path / "notes.txt", tok, 1, prompt_tokens=4, canvas_length=8).examples) == 2
    err = capsys.readouterr().err
    assert "3 of 5 document(s)" in err and "no longer than their prompt part (--prompt-tokens 4)" in err, err
    with pytest.raises(InputError, match="fewer than a prompt part of 4 tokens and BOS plus one canvas of 2000"):
        TextSource(tmp_path / "notes.txt", tok, 1, prompt_tokens=4, canvas_length=2000)
    assert cli_main(["train", "sudokuu", "--size", "nano", "--out", str(tmp_path / "t")]) == 2
    assert "data file sudokuu not found" in _one_line(capsys)
    model = tmp_path / "model"
    blockpress.load("sudoku", progress=False).save(model)
    assert cli_main(["train", "sudoku", "--model", str(model), "--out", str(model), "--steps", "1", *TINY[2:]]) == 2
    assert "holds a model (config.json)" in _one_line(capsys)
    assert not (model / "latest").exists()


def test_the_logged_line_is_the_windows_mean_as_the_metrics_file(tmp_path, capsys):
    """The printed line showed the last step's loss and lr, metrics.jsonl (and loss.png) the window's mean: two
    numbers for one step. The plot's eval curve says what it ran on without eval data."""
    out = tmp_path / "run"
    assert cli_main(["train", "sudoku", "--out", str(out), "--steps", "4", "--size", "nano", "--batch-size", "4",
                     "--lr", "3e-3", "--warmup", "2", "--log-every", "2", "--eval-every", "0", "--threads", "1",
                     "--blanks", "40", "44"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert len(printed) == len(logged) == 2
    for line, r in zip(printed, logged):
        assert f"loss {r['loss']:.4f}" in line, (line, r)
    from blockpress.train.plot import plot_history

    pytest.importorskip("matplotlib")
    assert plot_history([{"step": 1, "loss": 1.0}, {"step": 1, "eval_loss": 1.2}], tmp_path / "p.png",
                        eval_on="training examples") == ["train loss", "eval loss (training examples)"]
