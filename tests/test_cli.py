"""`blockpress run` / `blockpress chat` in process: text and stats output, --json, --steps, flag
errors, the Sudoku grid mode, stdin prompts, and ChatSession's KV-cache prefix reuse."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

import blockpress
from blockpress.cli import main as cli
from blockpress.cli import run as run_cmd
from blockpress.cli.chat import ChatSession

from blockpress.testing import build_tiny_gemma_tokenizer
from hf_oracle import TINY_TEXT


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CPU
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cli")
    cfg = {"model_type": "diffusion_gemma", "canvas_length": 16, "text_config": dict(TINY_TEXT)}
    blockpress.from_config(cfg, seed=0).save(path)
    build_tiny_gemma_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def sudoku_dir(tmp_path_factory):
    from blockpress.tasks import sudoku as su

    path = tmp_path_factory.mktemp("tiny_sudoku")
    cfg = {"model_type": "diffusion_gemma", "canvas_length": su.CANVAS_LEN,
           "text_config": dict(TINY_TEXT, vocab_size=len(su.VOCAB))}
    blockpress.from_config(cfg, seed=0).save(path)
    (path / "blockpress_task.json").write_text(json.dumps({"task": "sudoku"}))
    return path


def run_json(capsys, *argv):
    assert cli(["run", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


STATS = re.compile(r"\d+ tokens in [\d.]+s · [\d.]+ tokens/s · [\d.]+ tokens/forward · [\d.]+ steps/canvas "
                   r"\(\d+ canvases\) · first commit \d+ ms( · CPU shared: other processes kept [\d.]+ of \d+ cores "
                   r"busy; \d+ threads? \(--threads N to choose\))?")


def test_run_prints_text_and_stats_line(model_dir, capsys):
    assert cli(["run", str(model_dir), "Why is the sky blue?", "--max-new-tokens", "20", "--steps", "3",
                "--seed", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert STATS.fullmatch(out[-1]), out[-2:]
    assert "".join(out[:-1]).strip()  # some text before the stats line


def test_run_json_matches_reference_generate(model_dir, capsys):
    r = run_json(capsys, str(model_dir), "Why is the sky blue?", "--max-new-tokens", "40", "--steps", "4",
                 "--seed", "3")
    assert set(r) >= {"text", "token_ids", "prompt_ids", "stats", "finish_reason"}
    lm = blockpress.load(model_dir, progress=False)
    ref = lm.generate([r["prompt_ids"]], generator=torch.Generator().manual_seed(3), max_new_tokens=40,
                      max_denoising_steps=4, stability_threshold=None, confidence_threshold=None,
                      eos_token_id=[1, 106], pad_token_id=0)
    n = len(r["token_ids"])
    assert r["token_ids"] == ref.new_tokens[0].tolist()[:n]
    assert r["finish_reason"] == "length" and n == 40  # a random model does not stop
    assert r["stats"]["tokens"] == 40 and r["stats"]["forward_passes"] == 3 * 4


def test_reference_kernels_flag_gives_the_same_tokens(model_dir, capsys, monkeypatch):
    """--reference-kernels loads the plain PyTorch references; the tokens are those of the fast kernels."""
    from blockpress.kernels import kernel_names

    loaded, real_load = [], blockpress.load

    def spy(*a, **k):
        lm = real_load(*a, **k)
        names = kernel_names(lm.module)
        loaded.append((names["experts"], names["attention"]))
        return lm

    monkeypatch.setattr(blockpress, "load", spy)
    argv = [str(model_dir), "Why is the sky blue?", "--max-new-tokens", "32", "--steps", "4", "--seed", "5"]
    assert run_json(capsys, *argv)["token_ids"] == run_json(capsys, *argv, "--reference-kernels")["token_ids"]
    assert loaded == [("grouped", "sdpa_gqa"), ("loop", "sdpa")]


def test_compile_flag_compiles_the_loaded_blocks_and_refuses_the_references(model_dir):
    """--compile (run, chat, infill, serve) runs compiled blocks after load (their tokens: test_compiled); with
    --reference-kernels it is refused in one line."""
    import argparse

    from blockpress.cli.run import add_model_args, load_model

    p = argparse.ArgumentParser()
    add_model_args(p)
    lm = load_model(p.parse_args([str(model_dir), "--compile"]))
    assert lm.options.compile and lm.module.ops.block is not None
    assert load_model(p.parse_args([str(model_dir)])).module.ops.block is None
    with pytest.raises(blockpress.InputError, match="compile and the reference kernels"):
        load_model(p.parse_args([str(model_dir), "--compile", "--reference-kernels"]))


def test_fp8_activations_flag_runs_the_w8a8_experts(model_dir, capsys):
    """--fp8-activations (run, chat, infill, eval, serve) loads the w8a8 backend (fp8 activations for the fp8 experts
    and fp8 projections; on a CPU its torch reference), which generates; without fp8 weights, or with
    --reference-kernels, it is refused in one line before any weight is read."""
    import argparse

    from blockpress.cli.run import add_model_args, load_model

    p = argparse.ArgumentParser()
    add_model_args(p)
    lm = load_model(p.parse_args([str(model_dir), "--precision", "fp8", "--fp8-activations"]))
    assert lm.options.experts == "w8a8"
    assert all(layer.experts.backend == "w8a8" for layer in lm.module.layers)
    with pytest.raises(blockpress.InputError, match="need fp8 weights; add --precision fp8 and / or --linears fp8"):
        load_model(p.parse_args([str(model_dir), "--fp8-activations"]))
    lm = load_model(p.parse_args([str(model_dir), "--precision", "fp8", "--linears", "fp8", "--fp8-activations"]))
    from blockpress.kernels.linear_q import quantized_linears

    qs = quantized_linears(lm.module)  # fp8 projections take fp8 activations too
    assert qs and all(q.backend == "w8a8" and q.resolved_backend(torch.empty(0)) == "torch-a8" for q in qs)
    with pytest.raises(blockpress.InputError, match="--fp8-activations and --reference-kernels"):
        load_model(p.parse_args([str(model_dir), "--precision", "fp8", "--fp8-activations", "--reference-kernels"]))
    r = run_json(capsys, str(model_dir), "Why is the sky blue?", "--max-new-tokens", "16", "--steps", "3", "--seed",
                 "2", "--precision", "fp8", "--fp8-activations")
    assert len(r["token_ids"]) == 16


def test_eval_takes_fp8_activations(monkeypatch, tmp_path):
    """`eval` judges a format by the task: --fp8-activations reaches its load (the same mapping as the other
    commands, `experts_option`)."""
    asked, real_load = [], blockpress.load

    def spy(*a, **k):
        asked.append(k.get("experts"))
        return real_load(*a, **k)

    monkeypatch.setattr(blockpress, "load", spy)
    assert cli(["eval", "sudoku", "--n", "1", "--blanks", "45", "--precision", "fp8", "--fp8-activations",
                "--json", str(tmp_path / "e.json")]) == 0
    assert asked == ["w8a8"]


def test_extra_candidates_run_on_the_fixed_shape_passes_and_parse_no_cuda_graphs():
    """`run sudoku`'s extra candidates (rows > 1, one generator) asked for row compaction whenever the
    `cuda_graphs` option was off, which the fixed-shape passes refuse with one generator: under --compile (those
    passes, graphs off) a puzzle whose first candidate broke a rule failed. The CLI now asks for compaction only on
    the module's own passes: the candidates on the compiled blocks' passes give the eager ones' tokens.
    --cuda-graphs / --no-cuda-graphs set the option; neither leaves it automatic (on a CUDA GPU only)."""
    import argparse

    from blockpress.cli.run import _generate, add_model_args
    from blockpress.cli.view import CanvasView, TextRenderer
    from blockpress.engine.graphs import passes_for
    from rich.console import Console

    lm = blockpress.load("sudoku", progress=False)
    ids = lm.tokenizer.encode("hi")
    kw = dict(max_new_tokens=16, max_denoising_steps=4)

    def candidates():
        view = CanvasView(TextRenderer(lm.tokenizer), Console(file=io.StringIO()), False)
        return _generate(lm, ids, kw, torch.Generator().manual_seed(3), view, decode=False, rows=3).sequences

    want = candidates()
    lm.passes = passes_for(lm.module, lm.passes, False, True, True)  # what compile=True runs (its blocks eager)
    assert lm.passes is not lm.module and not lm.options.cuda_graphs
    assert torch.equal(candidates(), want)
    p = argparse.ArgumentParser()
    add_model_args(p)
    assert [p.parse_args(a).cuda_graphs for a in ([], ["--cuda-graphs"], ["--no-cuda-graphs"])] == [None, True, False]


def test_steps_fixes_steps_per_canvas(model_dir, capsys):
    fixed = run_json(capsys, str(model_dir), "hello", "--max-new-tokens", "48", "--steps", "4")
    assert fixed["stats"]["steps_per_canvas"] == [4, 4, 4]
    assert fixed["stats"]["tokens_per_forward"] == pytest.approx(48 / 12, abs=1e-3)
    # without --steps the reference's adaptive rule runs up to 48 steps (a random model is never confident)
    adaptive = run_json(capsys, str(model_dir), "hello", "--max-new-tokens", "16", "--max-denoising-steps", "7")
    assert adaptive["stats"]["steps_per_canvas"] == [7]


@pytest.mark.parametrize("flags,needle", [
    (["--steps", "0"], "--steps"),
    (["--steps", "x"], "--steps"),
    (["--entropy-bound", "-1"], "--entropy-bound"),
    (["--t-min", "abc"], "--t-min"),
    (["--max-new-tokens", "1.5"], "--max-new-tokens"),
    (["--stability-threshold", "-2"], "--stability-threshold"),
    (["--steps", "3", "--max-denoising-steps", "5"], "not allowed with argument"),
    (["--dtype", "int3"], "--dtype"),
    (["--threads", "0"], "--threads"),
])
def test_bad_flags_exit_2_naming_the_flag(model_dir, capsys, flags, needle):
    """One line, as every other error of the CLI (argparse printed its usage block first: 9 lines for `run`)."""
    with pytest.raises(SystemExit) as e:
        cli(["run", str(model_dir), "hi", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and err.startswith("blockpress run: error: "), err
    assert err.rstrip().endswith("(see `blockpress run --help`)"), err


@pytest.mark.parametrize("command", [["eval", "sudoku"], ["bench"], ["train"], ["serve"], ["chat"]])
def test_threads_must_be_a_positive_integer_everywhere(command, capsys):
    """--threads -1 once reached torch.set_num_threads (a traceback) and --threads 0 was ignored."""
    for bad in ("-1", "0", "x"):
        with pytest.raises(SystemExit) as e:
            cli([*command, "--threads", bad])
        assert e.value.code == 2 and "--threads: expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["eval", "sudoku", "--n", "0"], "--n: expected a positive integer"),
    (["eval", "sudoku", "--blanks", "40", "99"], "--blanks: expected an integer in 0..64, got 99"),
    (["eval", "sudoku", "--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["eval", "sudoku", "--repair", "-1"], "--repair: expected an integer >= 0"),
    (["bench", "--batch", "1,0"], "--batch: expected a positive integer, got 0"),
    (["bench", "--batch", "1,x"], "--batch: expected a positive integer, got 'x'"),
    (["bench", "--repeats", "0"], "--repeats: expected a positive integer"),
    (["bench", "--new-tokens", "0"], "--new-tokens: expected a positive integer"),
    (["bench", "--attention-split", "0"], "--attention-split: expected an integer in 1..16, got 0"),
    (["bench", "--attention-tiles", "middle:bm=32"], "--attention-tiles: unknown kind of layer 'middle'"),
    (["run", "kjv", "x", "--seed", "99999999999999999999"],
     "--seed: expected a seed in -9223372036854775808..18446744073709551615"),
    (["eval", "sudoku", "--seed", "-9223372036854775809"], "--seed: expected a seed in -9223372036854775808.."),
    (["eval", "sudoku", "--json", "/no-such-folder/x.json"], "--json: the folder /no-such-folder does not exist"),
    (["bench", "--out", "/"], "--out: / is a folder; give a file path"),
])
def test_numeric_flags_are_checked_before_any_work(argv, needle, capsys):
    """Each of these was a traceback (ValueError, IndexError, RuntimeError, OverflowError), a silent nonsense run,
    or (an output file in no folder) a traceback after the whole run, its results lost."""
    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_run_threads_sets_torch_threads(model_dir, capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cli(["run", str(model_dir), "hi", "--max-new-tokens", "8", "--steps", "2", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_invalid_sampling_values_are_one_line_errors(model_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli(["run", str(model_dir), "hi", "--t-min", "0.9", "--t-max", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blockpress run: error:") and "t_max" in err and "\n" not in err
    monkeypatch.setattr(run_cmd, "DEFAULT_MODEL", tmp_path / "missing")
    assert cli(["run"]) == 2
    assert "pass MODEL" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("flag", ["--cuda-graphs", "--attention-kernel"])  # (the kernel's flag was ignored)
def test_cuda_only_flags_are_refused_without_a_gpu(model_dir, capsys, flag):
    for cmd in (["run", str(model_dir), "hi"], ["chat", str(model_dir)], ["infill", str(model_dir), "a [MASK] b"],
                ["serve", str(model_dir), "--port", "0"]):
        assert cli([*cmd, flag]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{flag} needs a CUDA GPU and the model would run on cpu" in err and "\n" not in err


def test_prompt_from_stdin(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("The sky"))
    r = run_json(capsys, str(model_dir), "-", "--raw", "--max-new-tokens", "8", "--steps", "2")
    lm = blockpress.load(model_dir, progress=False)
    assert r["prompt_ids"] == [lm.tokenizer.bos_token_id] + lm.tokenizer.encode("The sky")


def test_sudoku_model_renders_grids(sudoku_dir, capsys, monkeypatch):
    from blockpress.tasks import sudoku as su

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no puzzle given: the built-in example

    r = run_json(capsys, str(sudoku_dir), "--steps", "2", "--seed", "0")
    assert r["puzzle"] == su.parse_grid(run_cmd.EXAMPLE_SUDOKU) and r["solution"] == su.solve_exact(r["puzzle"])
    assert r["answer"] == su.read_answer(r["puzzle"], r["token_ids"]) and r["stats"]["steps_per_canvas"] == [2]
    assert cli(["run", str(sudoku_dir), run_cmd.EXAMPLE_SUDOKU.replace("0", "."), "--steps", "2", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("------+-------+------") == 4  # the puzzle grid and the answer grid
    assert "puzzle:" in out and "answer (red: wrong or blank):" in out and "cell accuracy" in out
    assert cli(["run", str(sudoku_dir), "123"]) == 2  # not a grid: one-line error
    assert "81" in capsys.readouterr().err


# ----------------------------------------------------------------------------- chat
def test_chat_session_encodes_only_new_tokens(model_dir):
    """Turn 2's prompt is the conversation as the chat template renders it (the reply as its content, without the
    thought block the generation prompt opened, as the server and `lm.chat` send it), and only what the cache
    lacks of it is encoded: the cache is cropped where the two part. The old session kept the model's raw output
    in the history, which the shipped chat model answered worse ("You're welco!" for "Thanks!" in 5 of 30 seeded
    chats)."""
    lm = blockpress.load(model_dir, progress=False)
    encoded: list[int] = []
    real_encode, real_fused = lm.module.encode, lm.module.encode_decode

    def spy(ids, cache, *args, **kwargs):
        encoded.append(ids.shape[1])
        return real_encode(ids, cache, *args, **kwargs)

    def spy_fused(committed, canvas, cache, *args, **kwargs):  # a commit inside the next canvas's first step
        encoded.append(committed.shape[1])
        return real_fused(committed, canvas, cache, *args, **kwargs)

    lm.module.encode, lm.module.encode_decode = spy, spy_fused
    C = lm.canvas_length
    s = ChatSession(lm, sampling={"max_new_tokens": 40, "max_denoising_steps": 3}, seed=0)
    first = s.send("Why is the sky blue?")
    prompt1 = lm.encode_chat("Why is the sky blue?")
    assert encoded == [len(prompt1), C, C] and first.encoded == len(prompt1)
    assert s.cache.length == len(prompt1) + 2 * C  # all but the last canvas
    convo = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": first.content},
             {"role": "user", "content": "And the sea?"}]
    full = lm.encode_chat(convo)  # what the server would be sent, rendered and tokenized
    thought = lm.tokenizer.encode("<|channel>thought\n<channel|>")
    assert prompt1[-len(thought):] == thought and full[:len(prompt1) - len(thought)] == prompt1[:-len(thought)]
    encoded.clear()
    second = s.send("And the sea?")
    assert encoded[0] == second.encoded == len(full) - (len(prompt1) - len(thought))  # the cache kept up to there
    assert s.cached[:len(full)] == full  # the history the model saw is the template's
    # and the reply is what a from-scratch run over the rendered conversation gives with the seed (each turn draws
    # from it afresh, as each request to the server does), no tool call offered
    lm.module.encode, lm.module.encode_decode = real_encode, real_fused
    ref = lm.generate([full], generator=torch.Generator().manual_seed(0), max_new_tokens=40, max_denoising_steps=3,
                      eos_token_id=[1, 106], pad_token_id=0, suppress_tokens=lm.chat_ban())
    assert second.tokens == ref.new_tokens[0].tolist()[:len(second.tokens)]


def test_chat_session_starts_over_where_the_ring_lost_the_window_it_would_keep(model_dir, monkeypatch):
    """Prompts encoded 8 tokens at a time, so the sliding layers keep a ring of their window + 32 positions: after a
    reply of four canvases, the window before turn 1's generation prompt is gone from the ring, so the cache cannot
    be cropped back there (`KVCache.crop` refuses) and turn 2 encodes the whole conversation, with the reply a run
    from scratch gives."""
    lm = blockpress.load(model_dir, progress=False)
    monkeypatch.setattr(lm.module, "prefill_chunk", 8)
    kw = {"max_new_tokens": 64, "max_denoising_steps": 2, "stability_threshold": None, "confidence_threshold": None,
          "eos_token_id": [], "pad_token_id": 0}  # four whole canvases: no stop
    s = ChatSession(lm, sampling=kw, seed=0)
    first = s.send("Why is the sky blue?")
    assert s.cache.ring is not None and s.cache.length > s.cache.ring
    convo = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": first.content},
             {"role": "user", "content": "And the sea?"}]
    full = lm.encode_chat(convo)
    second = s.send("And the sea?")
    assert second.encoded == len(full)
    ref = lm.generate([full], generator=torch.Generator().manual_seed(0), suppress_tokens=lm.chat_ban(), **kw)
    assert second.tokens == ref.new_tokens[0].tolist()[:len(second.tokens)]


def test_chat_and_run_ban_the_call_opening_as_the_server_does(model_dir, monkeypatch, capsys):
    """A chat turn that offers no tool may not open a tool call (`lm.chat` and the server ban the token): `blockpress
    chat` and `run` did not, so where the model drew it they gave another reply for the same seed, with markup for
    a call no one declared."""
    from blockpress.lm import BlockDiffusionLM as LM

    bans, real = [], LM.stream

    def spy(self, *args, **kwargs):  # the engine's call, as the commands make it
        bans.append(kwargs.get("suppress_tokens"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LM, "stream", spy)
    lm = blockpress.load(model_dir, progress=False)
    call = [lm.tokenizer.token_to_id("<|tool_call>")]
    ChatSession(lm, sampling={"max_new_tokens": 8, "max_denoising_steps": 2}, seed=0).send("hi")
    assert cli(["run", str(model_dir), "hi", "--no-live", "--threads", "1", "--max-new-tokens", "8"]) == 0
    assert cli(["run", str(model_dir), "hi", "--raw", "--no-live", "--threads", "1", "--max-new-tokens", "8"]) == 0
    capsys.readouterr()
    assert bans == [call, call, None] and lm.chat_ban() == call and lm.chat_ban(tools=[{"name": "f"}]) is None


def test_chat_thinking_toggle_and_reset_reencode(model_dir):
    lm = blockpress.load(model_dir, progress=False)
    s = ChatSession(lm, sampling={"max_new_tokens": 16, "max_denoising_steps": 2}, seed=1)
    hi = s.send("hi").tokens
    assert s.cache is not None
    s.set_thinking(True)
    keep, ids = s.plan("again")
    want = lm.tokenizer.encode("<bos><|turn>system\n<|think|>")  # the whole conversation, re-rendered
    assert s.cache is None and keep == 0 and ids[:len(want)] == want
    s.send("again")
    s.reset()
    assert s.messages == [] and s.cache is None
    s.set_thinking(False)
    assert s.send("hi").tokens == hi  # a new conversation with the seed: its first reply again (the session's one
    # random stream went on, so /reset then the same message gave another reply)


def test_chat_repl_commands(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/thinking on\nagain\n/bogus\n/reset\n/exit\nignored\n"))
    assert cli(["chat", str(model_dir), "--max-new-tokens", "16", "--steps", "2", "--no-live"]) == 0
    out = capsys.readouterr().out
    assert "(thinking on)" in out and "(conversation cleared)" in out and "commands:" in out
    assert len(re.findall(r"tokens/forward", out)) == 2  # two turns ran; the line after /exit did not


def test_sudoku_run_repair_rounds(sudoku_dir, capsys, monkeypatch):
    """`run --repair R` re-denoises the broken cells: each round is reported and the clues stay."""
    from blockpress.tasks import sudoku as su

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no puzzle given: the built-in example
    r = run_json(capsys, str(sudoku_dir), "--steps", "2", "--seed", "0", "--repair", "2")
    assert r["answer"] == su.read_answer(r["puzzle"], r["token_ids"]) and len(r["repaired_cells"]) <= 2
    assert r["repaired_cells"] and all(0 < k <= 81 for k in r["repaired_cells"])  # a random model breaks rules
    # the last round held the clues on the canvas (position i is cell i)
    assert all(r["token_ids"][i] == su.DIGIT_ID0 + int(ch) for i, ch in enumerate(r["puzzle"]) if ch != "0")
    assert cli(["run", str(sudoku_dir), "--steps", "2", "--seed", "0", "--repair", "1", "--no-live"]) == 0
    assert "repair 1:" in capsys.readouterr().out


def test_sudoku_run_samples_keeps_the_fewest_broken_candidate(sudoku_dir, capsys, monkeypatch):
    """`run --samples K` denoises K candidates side by side and keeps the one with the fewest broken cells:
    the same seed's K rows, scored by the rules, give the printed answer."""
    import torch

    from blockpress.tasks import sudoku as su

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    r = run_json(capsys, str(sudoku_dir), "--steps", "2", "--seed", "3", "--samples", "3")
    assert r["stats"]["candidates"] == 3 and r["answer"] == su.read_answer(r["puzzle"], r["token_ids"])
    lm = blockpress.load(sudoku_dir, progress=False)
    gen = torch.Generator().manual_seed(3)
    kw = dict(generator=gen, max_new_tokens=su.CANVAS_LEN, max_denoising_steps=2, stability_threshold=None,
              eos_token_id=[su.EOS_ID], pad_token_id=su.PAD_ID)
    first = lm.generate([su.encode_prompt(r["puzzle"])], **kw).new_tokens  # candidate 1 (breaks rules: random)
    more = lm.generate([su.encode_prompt(r["puzzle"])] * 2, **kw).new_tokens  # then 2 more, the same generator
    cands = [su.decode_answer(row.tolist()) for row in [*first, *more]]
    assert su.broken_cells(r["puzzle"], cands[0]) and len(set(cands)) == 3
    assert r["answer"] == su.pick_candidate(r["puzzle"], cands)
    assert r["stats"]["candidates_breaking_no_rule"] == sum(not su.broken_cells(r["puzzle"], c, "cells")
                                                            for c in cands)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli(["run", str(sudoku_dir), "--steps", "2", "--seed", "3", "--samples", "2", "--no-live"]) == 0
    assert "2 candidates:" in capsys.readouterr().out


def test_repair_flag_on_a_text_model_is_a_clear_error(model_dir, capsys):
    assert cli(["run", str(model_dir), "hi", "--repair", "2"]) == 2
    err = capsys.readouterr().err
    assert "--repair" in err and "Sudoku" in err
    assert cli(["run", str(model_dir), "hi", "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "--samples" in err and "Sudoku" in err


@pytest.mark.timeout(120)  # without the check, serve would start serving and chat would wait for input
@pytest.mark.parametrize("command", [["serve"], ["chat"], ["infill", "In the [MASK] beginning"]])
def test_text_commands_refuse_a_sudoku_model(sudoku_dir, command, capsys):
    """serve / chat / infill speak text; a Sudoku model would answer typed text with noise: one-line error
    that names the Sudoku entry points."""
    argv = [command[0], str(sudoku_dir)] + command[1:]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "is a Sudoku model" in err and "blockpress run sudoku" in err and "Traceback" not in err


def test_eval_refuses_a_model_of_the_other_task(capsys, tmp_path):
    """eval sudoku on a text model reported 0 % solved; eval infill on the Sudoku model blamed missing
    passages; a non-UTF-8 passage file was a UnicodeDecodeError traceback."""
    assert cli(["eval", "sudoku", "--model", "kjv", "--n", "1", "--blanks", "40"]) == 2
    assert "kjv is not a Sudoku model" in capsys.readouterr().err
    assert cli(["eval", "infill", "--model", "sudoku", "--n", "1"]) == 2
    assert "is a Sudoku model: `blockpress eval infill` speaks text" in capsys.readouterr().err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n\nmore text here for a passage\n")
    assert cli(["eval", "infill", "--data", str(bad), "--n", "1"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_serve_checks_its_address_before_loading_the_model(capsys, monkeypatch):
    """A port in use was reported by uvicorn only after the model had loaded (minutes for a big one)."""
    import socket

    import blockpress.cli.serve as serve_mod

    monkeypatch.setattr(serve_mod, "load_model", lambda args: pytest.fail("the model loaded first"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli(["serve", "kjv", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "pick another --port" in err


# ----------------------------------------------------------------------------- issue 31: a new user's first hour
def test_help_imports_no_torch():
    """`blockpress --help` took seconds: it imported torch (and every command module) to list the commands."""
    import subprocess
    import sys

    code = ("import sys\nfrom blockpress.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'blockpress.cli.bench' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "run" in out and "serve" in out and out.strip().splitlines()[-1] == "False False"


def test_run_works_with_only_the_core_dependencies(tmp_path):
    """`pip install blockpress` (no extras) then `blockpress run` crashed: rich was an extra. Here every package
    outside the core dependencies (pyproject's [project].dependencies and what they need) cannot be imported."""
    import importlib.metadata as md
    import re as _re
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    def norm(name):
        return _re.sub(r"[-_.]+", "-", name).lower()

    def name_of(req):
        return norm(_re.match(r"[A-Za-z0-9_.\-]+", req).group(0))

    root = Path(__file__).resolve().parent.parent
    todo = [name_of(r) for r in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]]
    allowed = set()
    while todo:  # the core dependencies' closure, from the installed metadata (extras' requirements left out)
        name = todo.pop()
        if name in allowed:
            continue
        allowed.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [name_of(r) for r in reqs if "extra ==" not in r and "extra==" not in r]
    blocked = sorted({top for top, dists in md.packages_distributions().items()
                      if top.isidentifier() and not any(norm(d) in allowed | {"blockpress"} for d in dists)})
    assert "rich" not in blocked and "fastapi" in blocked
    # None in sys.modules: `import x` fails and importlib.util.find_spec("x") says absent, as if not installed
    code = (f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
            "from blockpress.cli import main\n"
            "sys.exit(main(['run', '--no-live', '--steps', '2', '--seed', '0']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "answer (red: wrong or blank):" in r.stdout
    serve = code.replace("['run', '--no-live', '--steps', '2', '--seed', '0']", "['serve', 'kjv']")
    r = subprocess.run([sys.executable, "-c", serve], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().endswith("pip install 'blockpress[server]'"), r.stderr[-2000:]
    assert "\n" not in r.stderr.strip()


def test_speed_flags_reach_run_chat_and_infill(model_dir, capsys):
    """The speed options the README lists (`--sampler`, `--fuse-commit`, `--merge-projections`,
    `--attention-kernel`) are flags of run, chat and infill as of serve (only serve had them)."""
    base = [str(model_dir), "The sky is", "--raw", "--max-new-tokens", "32", "--steps", "2", "--seed", "0"]
    exact = run_json(capsys, *base)["token_ids"]
    fast = [run_json(capsys, *base, "--sampler", "fast", "--no-merge-projections", "--no-fuse-commit",
                     "--no-attention-kernel")["token_ids"] for _ in range(2)]
    assert fast[0] == fast[1] != exact  # another random stream, seeded
    for command in (["infill", str(model_dir), "A [MASK:3] B"], ["chat", str(model_dir)]):
        assert "--sampler" in _help(capsys, command[0])
        if command[0] == "infill":
            assert cli([*command, "--sampler", "fast", "--seed", "0", "--threads", "1"]) == 0


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit):
        cli([command, "--help"])
    return capsys.readouterr().out


def test_run_output_is_not_hard_wrapped(model_dir, capsys):
    """`blockpress run ... > out.txt` wrapped the text at 80 columns (rich's width without a terminal)."""
    # (seed 1: this random model's reply holds no half tool call, which a reply cut by the budget drops)
    argv = [str(model_dir), "The sky is", "--raw", "--max-new-tokens", "64", "--steps", "2", "--seed", "1"]
    text = run_json(capsys, *argv)["text"]
    assert len(text) > 80 and "\n" not in text
    assert cli(["run", *argv]) == 0
    assert capsys.readouterr().out.startswith(text + "\n")


def test_piped_prompt_drops_its_trailing_newline(model_dir, capsys, monkeypatch):
    """`echo TEXT | blockpress run` kept echo's newline as a prompt token: other text than `run TEXT`, same seed."""
    argv = [str(model_dir), "--raw", "--max-new-tokens", "16", "--steps", "2", "--seed", "4"]
    direct = run_json(capsys, *argv[:1], "The sky", *argv[1:])
    monkeypatch.setattr("sys.stdin", io.StringIO("The sky\n"))
    piped = run_json(capsys, *argv[:1], "-", *argv[1:])
    assert piped["prompt_ids"] == direct["prompt_ids"] and piped["token_ids"] == direct["token_ids"]


@pytest.mark.timeout(60)  # unbounded, the run would denoise 100000 steps per canvas
@pytest.mark.parametrize("flag", ["--steps", "--max-denoising-steps"])
def test_steps_are_bounded_as_the_server_bounds_them(model_dir, capsys, flag):
    """--steps 100000 was accepted silently (hours of denoising); the server's limit is 1024 per canvas."""
    with pytest.raises(SystemExit) as e:
        cli(["run", str(model_dir), "hi", flag, "100000"])
    assert e.value.code == 2 and f"{flag}: expected an integer in 1..1024, got 100000" in capsys.readouterr().err
    if flag == "--steps":  # eval's budgets too (unbounded before)
        with pytest.raises(SystemExit) as e:
            cli(["eval", "sudoku", "--steps", "4", "100000"])
        assert e.value.code == 2 and "--steps: expected an integer in 1..1024, got 100000" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_chat_refuses_a_model_without_a_chat_template(capsys, monkeypatch):
    """`blockpress chat kjv` wrapped the turns in a built-in template the model never saw; serve refuses it."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert cli(["chat", "kjv", "--no-live"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a plain text model (no chat template)" in err and "blockpress run" in err and "\n" not in err


def test_ctrl_c_during_a_reply_ends_the_turn_not_the_chat(model_dir, capsys, monkeypatch):
    """Ctrl-C while the model writes dropped out of the whole chat (exit 130); now it drops that reply and the
    next turn runs, re-encoding the conversation (the interrupted turn is not part of it)."""
    real_stream, calls = blockpress.BlockDiffusionLM.stream, []

    def stream(self, *a, **k):
        calls.append(1)
        for i, ev in enumerate(real_stream(self, *a, **k)):
            if len(calls) == 1 and i == 1:
                raise KeyboardInterrupt  # the user pressed Ctrl-C after the first denoising step
            yield ev

    monkeypatch.setattr(blockpress.BlockDiffusionLM, "stream", stream)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n/exit\n"))
    assert cli(["chat", str(model_dir), "--max-new-tokens", "16", "--steps", "2", "--no-live"]) == 0
    out = capsys.readouterr().out
    assert "(reply interrupted and dropped" in out and len(re.findall("tokens/forward", out)) == 1
    lm = blockpress.load(model_dir, progress=False)
    assert f"encoded {len(lm.encode_chat('again'))} prompt tokens" in out  # the conversation is only "again"


def test_a_turn_past_the_context_is_refused_and_the_chat_goes_on(model_dir, capsys, monkeypatch):
    """A turn whose conversation no longer fits the model's positions ended the chat (exit 2, the conversation
    lost); now that turn is refused in one line that names /reset, and the next, shorter one is answered."""
    monkeypatch.setattr("sys.stdin", io.StringIO("word " * 5000 + "\nagain\n"))
    assert cli(["chat", str(model_dir), "--max-new-tokens", "16", "--steps", "2", "--no-live"]) == 0
    out = capsys.readouterr().out
    assert "exceeds max_position_embeddings" in out and "/reset starts a new conversation" in out
    assert len(re.findall("tokens/forward", out)) == 1  # "again" was answered


@pytest.mark.parametrize("argv,needle", [
    (["run", "kjv", "x", "--steps", "2", "--stability-threshold", "1"], "--steps N runs exactly N steps a canvas"),
    (["eval", "chat", "--blanks", "40", "--repair", "1"], "--blanks (sudoku), --repair (sudoku): not a flag of"),
    (["eval", "sudoku", "--compare-ar", "x"], "--compare-ar (chat): not a flag of `blockpress eval sudoku`"),
    (["eval", "infill", "--ar"], "--ar (sudoku, chat): not a flag of `blockpress eval infill`"),
    (["run", "--thinking"], "--thinking applies to text models"),
    (["run", "--max-new-tokens", "5"], "--max-new-tokens applies to text models"),
    (["run", "kjv", "And God", "--thinking"], "--thinking turns on a chat model's thought channel"),
    (["run", "assistant", "Hi", "--raw", "--thinking"], "which a plain prompt does not have (--raw)"),
])
def test_flags_that_would_be_ignored_are_refused(argv, needle, capsys, monkeypatch):
    """Each of these ran, the flag silently ignored (or overridden by --steps): numbers or text other than asked."""
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli([*argv, "--threads", "1"]) == 2
    assert needle in capsys.readouterr().err


def test_bench_config_must_be_a_readable_file(capsys, tmp_path):
    assert cli(["bench", "--config", str(tmp_path / "missing.json")]) == 2
    assert "--config not found" in capsys.readouterr().err


def test_adapter_takes_a_lora_run_folder(sudoku_dir, tmp_path, capsys, monkeypatch):
    """--adapter RUN (a LoRA training run's folder) was refused ('not a LoRA adapter folder'), and RUN as the
    MODEL said 'config.json not found'; now --adapter takes the run's latest checkpoint, and MODEL=RUN says to
    pass it as --adapter with its base model."""
    run = tmp_path / "lora"
    assert cli(["train", "sudoku", "--model", str(sudoku_dir), "--lora", "2", "--steps", "1", "--batch-size", "2",
                "--out", str(run), "--threads", "1", "--no-progress", "--eval-every", "0", "--warmup", "1"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    argv = [str(sudoku_dir), "--steps", "2", "--seed", "0"]
    via_run = run_json(capsys, *argv, "--adapter", str(run))["token_ids"]
    assert via_run == run_json(capsys, *argv, "--adapter", str(run / "checkpoint-0000001"))["token_ids"]
    assert cli(["run", str(run), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "holds a LoRA adapter (adapter_config.json), not a model" in err
    assert f"blockpress run {sudoku_dir} --adapter {run}" in err


def test_infill_help_names_its_own_default_model(capsys):
    """`infill --help` said the default MODEL was the Sudoku model; infill's default is the text model, kjv."""
    with pytest.raises(SystemExit):
        cli(["infill", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: the shipped text model, kjv" in out and "Sudoku" not in out


def test_infill_reads_one_argument_that_names_no_model_as_the_template(capsys, monkeypatch):
    """`blockpress infill 日本` (no hole, no space) was taken for a model's name and said "no TEMPLATE given"; an
    argument that is no shipped name, folder or org/name Hub id is the template, and its real problem is named."""
    assert cli(["infill", "日本", "--threads", "1"]) == 2
    assert "the template has no hole" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # (an empty pipe)
    assert cli(["infill", "kjv", "--threads", "1"]) == 2  # a model's name alone: no template
    assert "no TEMPLATE given" in capsys.readouterr().err


def test_every_command_takes_every_dtype_name(capsys):
    """`run --dtype bf16` and `bench --dtype bfloat16` were argparse errors: each command spelled dtypes its own way,
    and load(dtype=) took both. One table (options.DTYPE_NAMES) now gives every command's choices."""
    from blockpress.cli import build_parser
    from blockpress.options import DTYPE_NAMES

    assert cli(["run", "kjv", "x", "--dtype", "bf16", "--max-new-tokens", "4", "--no-live", "--threads", "1"]) == 0
    for command in ("run", "serve", "chat", "infill", "bench", "convert", "eval"):
        actions = [a for a in build_parser(command)._subparsers._group_actions[0].choices[command]._actions
                   if "--dtype" in a.option_strings]
        assert actions and set(DTYPE_NAMES) <= set(actions[0].choices), command
    capsys.readouterr()


def test_default_threads_follow_the_free_cores(model_dir, capsys):
    """The default thread count was one per core even with another busy process on them (~10x slower than
    --threads 1): it is the cores left free, and the stats line says when other processes competed."""
    import subprocess
    import sys

    from blockpress.cli.threads import CpuLoad, CpuWatch, default_threads

    assert default_threads(CpuLoad(cores=2, others=1.0)) == 1 and default_threads(CpuLoad(cores=2, others=0.1)) == 2
    assert default_threads(CpuLoad(cores=4, others=3.9)) == 1 and default_threads(None) is None
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        watch = CpuWatch()
        load = watch.load(min_seconds=1.0)
        assert load is not None and load.others >= 0.4, load  # the spinning process (and anything else running)
        assert cli(["run", str(model_dir), "hi", "--max-new-tokens", "32", "--steps", "4", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert stats["cpu"]["threads"] <= max(1, stats["cpu"]["cores"] - 1) or stats["cpu"]["others_busy"] < 0.5
        assert stats["cpu"]["others_busy"] < 0.5 or "CPU shared: other processes kept" in stats["cpu_note"]
    finally:
        spin.kill()
        spin.wait()


@pytest.mark.parametrize("flag", ["merge-projections", "attention-kernel"])
def test_the_engine_flags_reach_load_from_serve_bench_and_bench_serve(flag):
    """--merge-projections / --attention-kernel and their --no- forms: serve's options for load (run.model_options),
    bench's and bench_serve.py's; no flag: None (the option's default rule, `Options.merges` /
    `Options.attention_kernel_on`)."""
    import argparse
    import runpy
    from pathlib import Path

    from blockpress.cli import bench, serve
    from blockpress.cli.run import model_options

    name = flag.replace("-", "_")
    for add in (serve.add_parser, bench.add_parser,
                runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_serve.py"))["add_parser"]):
        p = argparse.ArgumentParser()
        add(p)
        model = ["m"] if add is serve.add_parser else []
        assert getattr(p.parse_args(model), name) is None
        assert getattr(p.parse_args([*model, f"--{flag}"]), name) is True
        assert getattr(p.parse_args([*model, f"--no-{flag}"]), name) is False
    p = argparse.ArgumentParser()
    serve.add_parser(p)
    assert model_options(p.parse_args(["m", f"--no-{flag}"]))[name] is False
    assert name not in model_options(p.parse_args(["m"]))


def test_a_damaged_task_file_is_an_error_not_a_text_model(tmp_path, capsys):
    """A blockpress_task.json that is not JSON, not an object, or names an unknown task was ignored: the Sudoku
    model became a text model and `run` said "no PROMPT given". Each is now one line naming the file."""
    import shutil
    from pathlib import Path

    folder = tmp_path / "m"
    shutil.copytree(Path(blockpress.__file__).parent / "assets" / "sudoku", folder)
    for text, needle in [("{bad", "is not valid JSON"), ("[1]", "must be a JSON object"),
                         ('{"task": "chess"}', "names the task 'chess', which blockpress does not know")]:
        (folder / "blockpress_task.json").write_text(text)
        assert cli(["run", str(folder), "." * 81, "--no-live", "--threads", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and str(folder / "blockpress_task.json") in err and "\n" not in err, err


def test_more_threads_than_cpus_gets_a_note(capsys):
    """`--threads 999` on two cores ran 40x slower without a word; now stderr says why (the count is still set,
    as asked)."""
    import os

    from blockpress.cli.threads import set_threads

    n, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    try:
        set_threads(cores)
        assert capsys.readouterr().err == ""
        set_threads(cores + 1)
        assert torch.get_num_threads() == cores + 1
        assert f"--threads {cores + 1} is more than the {cores} CPU" in capsys.readouterr().err
    finally:
        torch.set_num_threads(n)


def test_a_dash_alone_is_the_prompt_from_stdin(monkeypatch, capsys):
    """`echo PUZZLE | blockpress run -` and `... | blockpress infill -` took "-" for the model's name ("- is neither a
    folder, a shipped model ..."), although the help says "-" reads stdin."""
    import sys

    puzzle = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
    monkeypatch.setattr(sys, "stdin", io.StringIO(puzzle + "\n"))
    assert cli(["run", "-", "--no-live", "--threads", "1", "--seed", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["puzzle"] == puzzle.replace(".", "0")
    monkeypatch.setattr(sys, "stdin", io.StringIO("And God [MASK] the light\n"))
    assert cli(["infill", "-", "--no-live", "--threads", "1", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("And God ")


def test_chat_refuses_a_broken_template_before_the_first_turn(tmp_path, capsys):
    """A chat_template.jinja with a syntax error let `blockpress chat` start and then ended the whole chat at the
    first message (with `< /dev/null`: exit 0, nothing said)."""
    import shutil
    from pathlib import Path

    folder = tmp_path / "a"
    shutil.copytree(Path(blockpress.__file__).parent / "assets" / "assistant", folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    assert cli(["chat", str(folder), "--no-live", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "chat template has a syntax error at line 1" in err and "\n" not in err


def test_chat_drops_a_turn_that_is_not_utf8_and_goes_on(monkeypatch, capsys):
    """`printf 'Hi\\n\\xff\\nThanks!\\n' | blockpress chat`: the bad line ended the chat with a traceback; now that turn
    is dropped with one line saying why, and the next is answered."""
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\udcff\udcfe bad\nThanks!\n"))
    assert cli(["chat", "--no-live", "--threads", "1", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "your message is not valid Unicode: character 0 is the byte 0xff" in out
    assert out.count("tokens/s") == 2  # the two other turns were answered


def test_stdin_that_is_not_utf8_is_named_under_a_strict_locale(monkeypatch, capsys):
    """Under en_US.UTF-8 Python reads stdin strictly: invalid bytes were a UnicodeDecodeError traceback in `run -`
    and ended `chat`. The commands now read them as surrogate escapes, which the text checks name in one line."""
    import sys

    def strict(data: bytes):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="strict"))

    strict(b"Hi\n\xff bad\nThanks!\n")
    assert cli(["chat", "--no-live", "--threads", "1", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "your message is not valid Unicode: character 0 is the byte 0xff" in out and out.count("tokens/s") == 2
    strict(b"And God \xff said")
    assert cli(["run", "kjv", "-", "--no-live", "--threads", "1", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "character 8 is the byte 0xff, which is not UTF-8" in err and err.count("\n") == 1


def test_eval_chat_applies_its_adapter(tmp_path, capsys):
    """`eval chat --adapter DIR` never applied DIR: a folder that does not exist ran, and a chat LoRA's table was the
    base model's. It goes through the adapter loader now, as `eval sudoku` / `eval infill` do."""
    assert cli(["eval", "chat", "--n", "1", "--threads", "1", "--adapter", str(tmp_path / "none")]) == 2
    assert "is not a LoRA adapter folder" in capsys.readouterr().err


def test_eval_chat_refuses_a_text_model(capsys):
    """`eval chat --model kjv` (no chat template) printed a table of scores for a model that cannot chat."""
    assert cli(["eval", "chat", "--model", "kjv", "--n", "1", "--threads", "1"]) == 2
    assert "is a plain text model (no chat template)" in capsys.readouterr().err


def test_first_use_problems_found_by_a_packaging_audit_are_one_line(monkeypatch, capsys, tmp_path):
    """From an install audit: experts="triton" where Triton cannot run loaded, then failed at the first pass in a
    RuntimeError traceback; a Hub fetch that got no answer waited in silence (400 s and counting); an unusable
    Hugging Face cache was blamed on the network; an ASCII stdout ended `run` in a UnicodeEncodeError."""
    import os
    import subprocess
    import sys
    import time

    import blockpress.kernels.select as select
    from blockpress import loading
    from blockpress.errors import CheckpointError, InputError

    with monkeypatch.context() as m:
        m.setattr(select, "triton", None)
        m.setattr(select, "usable_on", lambda device: False)
        with pytest.raises(InputError, match=r"need Triton \(pip install 'blockpress\[gpu\]'\)"):
            blockpress.load("kjv", experts="triton", progress=False)
    import huggingface_hub

    def silent(*args, **kwargs):
        time.sleep(0.5)
        raise ConnectionError("no answer")

    monkeypatch.setattr(loading, "HUB_NOTICE_SECONDS", 0.1)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", silent)
    with pytest.raises(CheckpointError, match="could not fetch 'someone/model'"):
        loading.resolve_path("someone/model", progress=False)
    assert "still fetching 'someone/model' from the Hugging Face Hub" in capsys.readouterr().err

    def unusable(*args, **kwargs):
        raise NotADirectoryError(20, "Not a directory", "/dev/null/x/.cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unusable)
    with pytest.raises(CheckpointError, match="the Hugging Face cache cannot be used .*/dev/null/x/.cache.*HF_HOME"):
        loading.resolve_path("someone/model", progress=False)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "blockpress", "run", "kjv", "And God said", "--no-live",
                           "--max-new-tokens", "8", "--threads", "1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
