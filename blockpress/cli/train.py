"""`blockpress train DATA`: train from scratch or fine-tune (full or LoRA) with the DiffusionGemma objective.

DATA is `sudoku` (generated puzzles), a chat `.jsonl` file (`messages`, or `prompt`/`completion`), or a
plain-text `.txt` / `.jsonl` (`text`) file. The model is `--model DIR` (a checkpoint to fine-tune),
`--config config.json` or `--size {nano,micro,mini,small}` (from scratch). Checkpoints go to
`--out DIR/checkpoint-<step>` (Hugging Face layout + trainer state); `--resume` continues the newest.
QLoRA: `--model DIR --lora R --precision int4|fp8 [--linears int8|fp8]` loads the base quantised as inference
does and trains adapters beside the frozen quantised weights (saved in PEFT format, for the unquantised base).
`--grad-accum N` cuts each step's batch into N micro-batches (the same step in less activation memory).
Multi-process: `torchrun --nproc_per_node N -m blockpress train ...` (DDP: each process holds the whole model;
gloo on CPU, nccl on GPU); add `--fsdp` to shard weights, gradients and optimizer state across the processes
(FSDP2), for a model that does not fit one device. A sharded run resumes with any number of processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import Terminated
from .run import _float_in, _nonneg_int, _positive_int, _seed

# generation_config.json written with a Sudoku checkpoint: one canvas (81 digits + <eos>), the reference's
# sampler defaults otherwise (blockpress.tasks.sudoku: CANVAS_LEN 82, EOS_ID 1, PAD_ID 0)
SUDOKU_GENERATION = {"max_new_tokens": 82, "max_denoising_steps": 32, "entropy_bound": 0.1, "t_min": 0.4,
                     "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
                     "eos_token_id": [1], "pad_token_id": 0}


# the defaults of flags whose use depends on the setup (`_ignored` tells a given value from its default)
DEFAULTS = {"canvas_length": 64, "context": 512, "prompt_tokens": (16, 16), "infill_span": (1, 8),
            "lora_targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "size": "micro",
            "blanks": (25, 58), "ar_weight": 1.0}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="'sudoku', a chat .jsonl file, or a plain-text .txt/.jsonl file")
    src = p.add_argument_group("model")
    src.add_argument("--model", help="checkpoint folder to fine-tune (default: train from scratch)")
    src.add_argument("--config", help="config.json for a model trained from scratch")
    src.add_argument("--size", default=DEFAULTS["size"], help="named size from scratch: nano, micro, mini, small")
    src.add_argument("--tokenizer", help="folder with tokenizer.json (text/chat from scratch)")
    src.add_argument("--canvas-length", type=_positive_int, default=DEFAULTS["canvas_length"], help="text/chat from scratch: canvas length")
    src.add_argument("--context", type=_positive_int, default=DEFAULTS["context"],
                     help="text/chat from scratch: longest context the sliding window must cover")
    src.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    src.add_argument("--threads", type=_positive_int, default=None, metavar="N", help="torch CPU threads")
    src.add_argument("--experts-backend", default="dense", choices=["loop", "dense"])
    run = p.add_argument_group("run")
    run.add_argument("--out", default=None, help="output folder (default runs/<data>)")
    run.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    run.add_argument("--steps", type=_positive_int, default=1000, help="optimizer steps (default: 1000)")
    run.add_argument("--batch-size", type=_positive_int, default=32,
                     help="examples per optimizer step, all processes and micro-batches together (default: 32)")
    run.add_argument("--grad-accum", type=_positive_int, default=1, metavar="N",
                     help="cut each step's batch into N micro-batches, their gradients summed before one optimizer "
                          "step: the same step (up to fp32 rounding) in 1/N of the activation memory; --batch-size "
                          "must divide by N x processes (default 1)")
    run.add_argument("--lr", type=_float_in(0, strict=True), default=1e-3, help="peak learning rate (default: 1e-3)")
    run.add_argument("--min-lr-ratio", type=float, default=0.1,
                     help="final learning rate of the cosine schedule as a fraction of --lr, in [0, 1] (default 0.1)")
    run.add_argument("--warmup", type=_nonneg_int, default=30, help="linear warmup steps (default: 30)")
    run.add_argument("--weight-decay", type=_float_in(0, strict=False), default=0.01, help="AdamW's (default: 0.01)")
    run.add_argument("--clip", type=_float_in(0, strict=False), default=1.0,
                     help="gradient-norm clip (0: off; default: 1.0)")
    run.add_argument("--seed", type=_seed, default=0, help="(default: 0)")
    run.add_argument("--log-every", type=_positive_int, default=10,
                     help="steps per logged row: the mean over them (default: 10)")
    run.add_argument("--eval-data", default=None,
                     help="text/chat: held-out file for the periodic eval loss (without it the eval loss is measured "
                          "on training examples, with fixed noise: logged as such, not a held-out loss)")
    run.add_argument("--eval-every", type=_nonneg_int, default=200,
                     help="steps between eval losses (0: off; default: 200); Sudoku evaluates on its own stream of "
                          "puzzles")
    run.add_argument("--eval-batches", type=_positive_int, default=2, help="batches per eval loss (default: 2)")
    run.add_argument("--save-every", type=_nonneg_int, default=200,
                     help="steps between checkpoints (0: only the last; default: 200)")
    run.add_argument("--save-minutes", type=_float_in(0, strict=False), default=0.0,
                     help="also save when this many minutes passed since the last checkpoint (0: off, the default)")
    run.add_argument("--keep-last", type=_nonneg_int, default=2, help="checkpoints kept (0: all; default: 2)")
    run.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                     help="recompute the decoder layers and the encoder layers' feed-forward halves in backward "
                          "(less memory, ~1/3 more compute; default: on for QLoRA (--precision / --linears), off "
                          "otherwise)")
    run.add_argument("--fsdp", action="store_true",
                     help="under torchrun: shard parameters, gradients and optimizer state across the processes "
                          "(FSDP2, one shard group per decoder layer) instead of copying the model to each (DDP)")
    run.add_argument("--max-canvases", type=_positive_int, default=None, help="truncate responses to N canvases")
    run.add_argument("--max-prompt", type=_positive_int, default=None, metavar="N",
                     help="chat: keep the last N tokens of each row's prompt (rows longer than the model's positions "
                          "are refused, naming the line)")
    run.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar (nor, off a terminal, its line every --log-every steps); "
                          "metrics.jsonl keeps every row")
    o = p.add_argument_group("objective")
    o.add_argument("--eps", type=float, default=1e-3, help="t ~ U[eps, 1)")
    o.add_argument("--sc-prob", type=float, default=0.5, help="self-conditioning probability")
    o.add_argument("--ar-weight", type=float, default=None,
                   help="encoder next-token loss weight (default: the run's own on --resume, else the one the --model "
                        "was trained with, from its blockpress_objective.json, else 1)")
    o.add_argument("--ar-scope", default="response", choices=["response", "all"])
    o.add_argument("--ar-only", action="store_true", help="autoregressive baseline (encoder only, causal LM)")
    o.add_argument("--prompt-tokens", type=int, nargs=2, default=DEFAULTS["prompt_tokens"], metavar=("LO", "HI"),
                   help="plain text: tokens of each document given as prompt (a per-document draw in [LO, HI])")
    o.add_argument("--blanks", type=int, nargs=2, default=DEFAULTS["blanks"], metavar=("LO", "HI"),
                   help="sudoku: blanks per training puzzle")
    o.add_argument("--swap-rate", type=float, default=0.0, metavar="P",
                   help="also overwrite each uncorrupted canvas position, with prob P, by the token of another "
                        "position of the same clean canvas: plausible wrong tokens that teach the decoder to revise "
                        "what it has written (an addition to the spec objective; default 0)")
    o.add_argument("--rollout", type=float, default=0.0, metavar="P",
                   help="train this fraction of examples on the canvas one step of the model's own sampler makes "
                        "from the noised one (its own confident mistakes, to be taken back; SUNDAE-style unrolled "
                        "denoising, an addition to the spec objective; no extra forward pass; default 0)")
    o.add_argument("--infill-rate", type=float, default=0.0, metavar="P",
                   help="text/chat: train this fraction of examples as infilling (each canvas held as given context "
                        "except one random span, which alone is denoised and scored; default 0)")
    o.add_argument("--infill-span", type=int, nargs=2, default=DEFAULTS["infill_span"], metavar=("LO", "HI"),
                   help="text/chat: length in tokens of the span left free by --infill-rate (default 1 8)")
    o.add_argument("--augment", type=_positive_int, default=1, metavar="K",
                   help="sudoku: show each generated puzzle K times under random symmetries (digit relabelling, "
                        "row/column/band/stack permutations, transposition); data costs K times less, which a "
                        "GPU at batch 256 needs (default 1: every puzzle fresh)")
    o.add_argument("--sudoku-format", default="prompt", choices=["prompt", "inplace"],
                   help="sudoku: 'prompt' (the puzzle is the prompt, the canvas the 81 digits) or 'inplace' "
                        "(the clues are held on the canvas, only the blanks are denoised; solve() then "
                        "holds them with fixed_tokens)")
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--lora", type=_nonneg_int, default=0, metavar="RANK",
                    help="train LoRA adapters of this rank (0: full fine-tuning)")
    lo.add_argument("--lora-alpha", type=_float_in(0, strict=True), default=None, help="default 2*rank")
    lo.add_argument("--lora-targets", default=DEFAULTS["lora_targets"])
    lo.add_argument("--precision", choices=["native", "fp8", "int4"], default="native",
                    help="QLoRA: load --model's experts quantised (fp8 / int4, as `blockpress run --precision` does, "
                         "layer by layer) and train --lora adapters over them; the adapters load on the unquantised "
                         "base (default native)")
    lo.add_argument("--linears", choices=["native", "int8", "fp8"], default="native",
                    help="QLoRA: also load the attention / dense-MLP projections in 8 bits; the adapters run beside "
                         "them (default native)")


def base_dtype(args, lora: bool) -> str:
    """What the loaded model is held in: fp32 where its weights train (full fine-tuning: fp32 parameters, gradients
    and AdamW state; bf16 autocast on a GPU); a LoRA run's frozen base in bf16 on a GPU, as inference holds it (the
    26B model's weights would take twice the memory in fp32), in fp32 on a CPU. Adapters are fp32 either way."""
    import torch

    gpu = torch.device(args.device).type == "cuda" if args.device else torch.cuda.is_available()
    return "bfloat16" if lora and gpu else "float32"


def _eos(lm) -> int:
    e = lm.config.text.eos_token_id
    return e if isinstance(e, int) else (e or [1])[0]


def _ignored(args, task: bool) -> list[str]:
    """Flags given that this setup would not use (each was accepted and ignored: a run other than the one asked)."""
    given = lambda name: tuple(getattr(args, name)) if isinstance(getattr(args, name), (list, tuple)) \
        else getattr(args, name)  # noqa: E731
    changed = lambda name: given(name) != DEFAULTS[name]  # noqa: E731
    out = []
    if not args.lora and (args.lora_alpha is not None or changed("lora_targets")):
        out.append("--lora-alpha / --lora-targets (they shape LoRA adapters: add --lora RANK)")
    if args.model and (args.tokenizer or changed("canvas_length") or changed("context") or changed("size")
                       or args.config):
        out.append("--tokenizer / --canvas-length / --context / --size / --config (a model trained from scratch; "
                   "--model brings its own)")
    if not task and changed("blanks"):
        out.append("--blanks (Sudoku puzzles' blank cells; this data is not Sudoku)")
    if not task and changed("prompt_tokens") and _is_chat_data(args):
        out.append("--prompt-tokens (plain text's prompts; a chat row's prompt is its conversation)")
    if args.ar_only and args.ar_weight is not None:
        out.append("--ar-weight (--ar-only trains the next-token loss alone)")
    if task and (args.eval_data or changed("prompt_tokens")):
        out.append("--eval-data / --prompt-tokens (text and chat data; Sudoku evaluates on held-out puzzles)")
    if not args.infill_rate and changed("infill_span"):
        out.append("--infill-span (the spans of --infill-rate P: add it)")
    if args.max_prompt is not None and (task or not _is_chat_data(args)):
        out.append("--max-prompt (it cuts chat prompts; plain text takes --prompt-tokens, Sudoku's prompts are fixed)")
    return out


def _is_chat_data(args) -> bool:
    return _is_chat(args.data)


def _flag_error(e: ValueError):
    """A config's ValueError ("field_name message") as the flag's one-line InputError ("--field-name message")."""
    from blockpress.errors import InputError

    field, _, rest = str(e).partition(" ")
    return InputError(f"--{field.replace('_', '-')} {rest}")


def build(args, world: int = 1):
    """-> (lm, source, eval_source, TrainConfig, lora spec, extra files). world: the number of processes (a sharded
    run's processes load the model into host memory; FSDP2 moves each layer to its GPU as it shards it, so no GPU
    ever holds the whole model)."""
    import torch

    import blockpress
    from blockpress.errors import InputError
    from blockpress.kernels import use
    from blockpress.train import objective as obj
    from blockpress.train import sizes
    from blockpress.train.data import SudokuSource, build_source
    from blockpress.config import ModelConfig, _read_json
    from blockpress.train.trainer import (TrainConfig, check_batch, check_resume, latest_checkpoint,
                                          writing_run_folder)
    from blockpress.tasks import task_info

    out = Path(args.out or f"runs/{Path(args.data).stem}")
    task = args.data == "sudoku"
    ignored = _ignored(args, task)
    if ignored:
        raise InputError(f"{'; '.join(ignored)}: not used by this run; drop them")
    if task and args.infill_rate:
        raise InputError("--infill-rate is for text and chat data; for Sudoku use --sudoku-format inplace")
    if not task and (args.augment != 1 or args.sudoku_format != "prompt"):
        raise InputError("--augment and --sudoku-format apply to `blockpress train sudoku` only")
    quantized = args.precision != "native" or args.linears != "native"
    resume_ck = latest_checkpoint(out) if args.resume and out.is_dir() else None
    ar_weight, ar_note = _ar_weight(args, resume_ck)  # (its errors are its own lines, not a flag's: outside the try)
    try:  # validated here, before any work (and the same way for the Python API: the dataclasses check themselves)
        ocfg = obj.ObjectiveConfig(eps=args.eps, sc_prob=args.sc_prob, ar_weight=ar_weight,
                                   ar_scope=args.ar_scope, seed=args.seed, ar_only=args.ar_only,
                                   swap_rate=args.swap_rate, rollout=args.rollout)
        tcfg = TrainConfig(out_dir=str(out), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                           min_lr_ratio=args.min_lr_ratio, warmup=args.warmup, weight_decay=args.weight_decay,
                           clip=args.clip, log_every=args.log_every, eval_every=args.eval_every,
                           eval_batches=args.eval_batches, save_every=args.save_every, save_minutes=args.save_minutes,
                           keep_last=args.keep_last,
                           grad_checkpointing=quantized if args.grad_checkpointing is None else args.grad_checkpointing,
                           max_canvases=args.max_canvases, stop_after=args.stop_after,
                           progress=not args.no_progress, grad_accum=args.grad_accum, objective=ocfg,
                           inputs=_inputs(args))
    except ValueError as e:  # name the flag, not the dataclass field
        raise _flag_error(e) from None
    check_batch(tcfg, world)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a folder for the run's checkpoints")
    if (out / "config.json").is_file():  # (loading that folder would still give its model, not the run's)
        raise InputError(f"--out {out} holds a model (config.json); a run writes its checkpoint-* folders and "
                         "`latest` into a folder of its own: give another --out")
    if not args.resume and out.is_dir() and any(p.is_dir() for p in out.glob("checkpoint-*")):
        raise InputError(f"{out} already holds a training run's checkpoints, which this run would overwrite; continue "
                         "it with --resume, or give another --out (or delete that folder to start over)")
    if args.resume and resume_ck is None:
        if out.is_dir() and any(p.is_dir() for p in out.glob("checkpoint-*")):
            raise InputError(f"{out} holds checkpoint folders, but none with its trainer state (trainer_state.pt): "
                             "nothing a resume can continue, and starting over would overwrite them; give another "
                             "--out (or delete them to start over)")
        print(f"blockpress train: nothing to resume in {out} (no complete checkpoint there): starting from step 0",
              file=sys.stderr)
    elif resume_ck is not None and (out / "latest").is_file() and \
            (out / "latest").read_text().strip() != resume_ck.name:
        print(f"blockpress train: {out / 'latest'} names {(out / 'latest').read_text().strip()!r}, not a complete "
              f"checkpoint: resuming from {resume_ck.name}, the newest complete one", file=sys.stderr)
    if quantized and not args.lora:
        raise InputError("--precision / --linears train LoRA adapters over frozen quantised weights (QLoRA); full "
                         "fine-tuning of quantised weights is not supported: add --lora RANK, or drop --precision / "
                         "--linears")
    if quantized and not args.model:
        raise InputError("--precision / --linears quantise a base checkpoint for LoRA: give it with --model DIR (a model "
                         "trained from scratch has nothing to quantise)")
    extra = {obj.OBJECTIVE_FILE: obj.objective_record(ocfg)}  # what `--model CHECKPOINT` fine-tunes read back
    lora = None
    if args.lora:
        from blockpress.train.lora import PROJ, LoraSpec

        bad = [t for t in args.lora_targets.split(",") if t not in PROJ]
        if bad:
            raise InputError(f"--lora-targets: unknown projection(s) {bad}; choose from {','.join(PROJ)}")
        lora = LoraSpec(rank=args.lora, alpha=args.lora_alpha or 2.0 * args.lora,
                        targets=tuple(args.lora_targets.split(",")),
                        base_model=str(Path(args.model).resolve()) if args.model and Path(args.model).is_dir()
                        else args.model)
    if resume_ck is not None:  # the run's settings and adapters (or none), before the model is loaded
        from blockpress.train.lora import check_resume_adapters

        check_resume(resume_ck, tcfg)
        check_resume_adapters(lora, resume_ck)
    device = "cpu" if args.fsdp and world > 1 else args.device
    if args.model:
        q = dict(precision=args.precision, linears=args.linears) if quantized else {}
        lm = blockpress.load(resume_ck if (resume_ck and lora is None) else args.model, device=device,
                             dtype=base_dtype(args, lora is not None), progress=False, **q)
        if lora is None and (lm.options.precision, lm.options.linears) != ("native", "native"):
            kinds = sorted({k for k in (lm.options.precision, lm.options.linears) if k != "native"})
            raise InputError(f"--model {args.model} stores {' and '.join(kinds)} weights (a pre-quantised checkpoint), "
                             "which full "
                             "fine-tuning cannot update: add --lora RANK to train adapters over them (QLoRA), or "
                             "fine-tune the model's float checkpoint")
    elif resume_ck is not None:  # a run from scratch: the kernels it started with (load() would pick sdpa_gqa,
        # whose gradients round otherwise)
        from blockpress.loading import SCRATCH_KERNELS

        lm = blockpress.load(resume_ck, device=device, dtype="float32", progress=False, **SCRATCH_KERNELS)
    else:
        if task:
            from blockpress.tasks import sudoku as sd

            cfg = _read_json(Path(args.config), "--config") if args.config else \
                sizes.model_config(args.size, vocab_size=len(sd.VOCAB), canvas_length=sd.CANVAS_LEN,
                                   context=sd.PROMPT_LEN if args.sudoku_format == "prompt" else 1)
            vocab = ModelConfig.from_dict(cfg).text.vocab_size  # (its default where the file gives none)
            if vocab < len(sd.VOCAB):
                raise InputError(f"--config: a Sudoku model needs vocab_size >= {len(sd.VOCAB)} (its tokens), got "
                                 f"{vocab}")
        else:
            if not Path(args.data).is_file():  # (a typo of `sudoku` named as such, not as a missing --tokenizer)
                from blockpress.tasks import read_data_file

                read_data_file(Path(args.data))  # (its one-line error)
            if not args.tokenizer and not args.config:
                raise InputError("training text/chat from scratch needs --tokenizer DIR (tokenizer.json)")
            from blockpress.tokenizer import Tokenizer

            tok = Tokenizer.from_dir(args.tokenizer)
            ids = {"pad_id": tok.pad_token_id, "eos_id": tok.eos_token_id, "bos_id": tok.bos_token_id}
            cfg = _read_json(Path(args.config), "--config") if args.config else \
                sizes.model_config(args.size, vocab_size=tok.vocab_size, canvas_length=args.canvas_length,
                                   context=args.context,  # the tokenizer's own special ids, where it has them
                                   **{k: v for k, v in ids.items() if v is not None})
        lm = blockpress.from_config(cfg, device=device, seed=args.seed, scaled_qk=True)  # training from scratch
        if not task and args.tokenizer:
            lm.path = Path(args.tokenizer)
            from blockpress.tokenizer import Tokenizer

            lm.tokenizer = Tokenizer.from_dir(args.tokenizer)
    if task and (args.model or resume_ck is not None):
        from blockpress.tasks import sudoku as sd

        if args.model and task_info(lm).get("task") != "sudoku":
            raise InputError(f"--model {args.model} is not a Sudoku model (its blockpress_task.json does not say task "
                             "sudoku); fine-tune a Sudoku model, or train one from scratch (no --model)")
        if sd.model_format(lm) != args.sudoku_format:
            raise InputError(f"the model was trained with --sudoku-format {sd.model_format(lm)}; continue it with "
                             f"that format (got {args.sudoku_format})")
    if task:
        lm.generation_defaults = {**SUDOKU_GENERATION, **lm.generation_defaults}
        # what the base model's file says beyond these (the shipped model's "samples") is kept
        extra["blockpress_task.json"] = json.dumps({**(task_info(lm) if args.model or resume_ck else {}),
                                                    "task": "sudoku", "format": args.sudoku_format})
    elif lm.tokenizer is not None:  # checkpoints stop at the tokenizer's end of text, as the data was written
        tok = lm.tokenizer
        # the end of text, then what ends a chat turn (<turn|>; <|tool_response> after a turn of tool calls)
        from blockpress.parsing import STOP_TOKENS

        ends = [i for i in [tok.eos_token_id] + [tok.token_to_id(s) for s in STOP_TOKENS if s != "<eos>"]
                if i is not None]
        stop = {"eos_token_id": ends or None, "pad_token_id": tok.pad_token_id}
        lm.generation_defaults = {**{k: v for k, v in stop.items() if v is not None}, **lm.generation_defaults}
    use(lm.module, experts=args.experts_backend)  # autograd runs through the reference kernels
    # (quantised experts / projections switch to their differentiable torch path whenever a gradient is needed)
    if lora is not None:
        from blockpress.train.lora import add_lora, load_adapter_weights

        add_lora(lm.module, lora, seed=args.seed)
        if resume_ck is not None:
            load_adapter_weights(lm.module, resume_ck)
    if task:
        lo, hi = args.blanks
        if not 0 <= lo <= hi <= 64:
            raise InputError(f"--blanks {lo} {hi}: give LO <= HI in 0..64 (a unique puzzle keeps >= 17 clues)")
        source = SudokuSource(tuple(args.blanks), args.seed, "train", format=args.sudoku_format, augment=args.augment)
        eval_source = SudokuSource(tuple(args.blanks), args.seed, "eval", format=args.sudoku_format)
    else:
        # every example must fit the model's positions: chat rows are checked (path:line), text is cut to fit
        fit = dict(prompt_tokens=tuple(args.prompt_tokens), eos_id=_eos(lm), canvas_length=lm.canvas_length,
                   max_positions=lm.config.text.max_position_embeddings, max_canvases=args.max_canvases,
                   max_prompt=args.max_prompt)
        source = build_source("chat" if _is_chat_data(args) else "text", args.data, lm.tokenizer, args.batch_size,
                              args.seed, **fit)
        eval_source = None
        if args.eval_data:
            eval_source = build_source("chat" if _is_chat(args.eval_data)
                                       else "text", args.eval_data, lm.tokenizer, args.batch_size, args.seed, **fit)
        if args.infill_rate:
            from blockpress.train.data import InfillSource

            source = InfillSource(source, lm.canvas_length, args.infill_rate, tuple(args.infill_span), args.seed)
    # Checkpoints copy the tokenizer files from lm.path. Keep a snapshot in the run folder and point there:
    # a resumed run's lm.path is the checkpoint it resumed from, which keep_last pruning deletes later.
    # Done last, after the data is read, so that a bad data file leaves no run folder behind.
    tokdir = out / "tokenizer"
    with writing_run_folder(out):  # a read-only or full disk, a path through a file: one line
        if task:
            from blockpress.tasks import sudoku as sd

            tokdir.mkdir(parents=True, exist_ok=True)
            try:
                sd.build_tokenizer().save(str(tokdir / "tokenizer.json"))
            except Exception as e:  # tokenizers raises a bare Exception (a full disk, a read-only folder)
                raise OSError(f"{tokdir / 'tokenizer.json'}: {e}") from None
            lm.path = tokdir
        elif lm.path is not None and Path(lm.path).resolve() != tokdir.resolve():
            from blockpress.model.weights import TOKENIZER_FILES

            names = [n for n in TOKENIZER_FILES if (Path(lm.path) / n).is_file()]
            if names:
                tokdir.mkdir(parents=True, exist_ok=True)
                for n in names:
                    (tokdir / n).write_bytes((Path(lm.path) / n).read_bytes())
                lm.path = tokdir
    if ar_note:
        print(ar_note, file=sys.stderr)
    return lm, source, eval_source, tcfg, lora, extra, resume_ck


def _is_chat(path: str) -> bool:
    """Whether a data file is JSON Lines (`data.is_jsonl`) holding chat rows (its first row has 'messages' or
    'prompt'); a broken file is left to the data reader, which names the line."""
    from blockpress.tasks import read_data_file
    from blockpress.train.data import is_jsonl

    if not is_jsonl(path):
        return False

    for line in read_data_file(Path(path)).splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                return True
            return isinstance(row, dict) and ("messages" in row or "prompt" in row)
    return False


def _ar_weight(args, resume_ck) -> tuple[float, str | None]:
    """--ar-weight; else the resumed run's own; else the one the --model was trained with (its
    blockpress_objective.json: the shipped Sudoku and KJV models trained with the loss off, and turning it on for a
    fine-tune trains an encoder head that never learned, whose loss then leads the update); else 1. With the line
    that says so where the model's weight is not the default (printed once the run's setup is checked)."""
    from blockpress.loading import resolve_path
    from blockpress.train.objective import OBJECTIVE_FILE, trained_ar_weight
    from blockpress.train.trainer import read_state

    if args.ar_weight is not None:
        return args.ar_weight, None
    if resume_ck is not None:
        config = read_state(resume_ck).get("config")
        saved = config.get("objective", {}).get("ar_weight") if isinstance(config, dict) else None
        return (DEFAULTS["ar_weight"] if saved is None else saved), None
    w = trained_ar_weight(resolve_path(args.model, progress=False)) if args.model and not args.ar_only else None
    if w is None or w == DEFAULTS["ar_weight"]:
        return DEFAULTS["ar_weight"], None
    return w, (f"blockpress train: --ar-weight {w:g}, the weight {args.model} was trained with (its {OBJECTIVE_FILE}); "
               "give --ar-weight to choose another")


def _inputs(args) -> dict:
    """What decides a run's examples beyond its TrainConfig (a resume refuses a change: `check_resume`): the data (a
    file by its name and size, so the run folder may move with it), the model trained from (a folder by its resolved
    path), the infill and prompt flags."""
    from blockpress.loading import resolve_path

    data = args.data
    if data != "sudoku" and Path(data).is_file():
        data = f"{Path(data).name} ({Path(data).stat().st_size} bytes)"
    model = str(resolve_path(args.model, progress=False).resolve()) if args.model else None
    return {"data": data, "--model": model, "--infill-rate": args.infill_rate,
            "--infill-span": list(args.infill_span) if args.infill_rate else None, "--max-prompt": args.max_prompt,
            "--prompt-tokens": list(args.prompt_tokens)}


def resume_command(args) -> str:
    """The command line that continues this run: as typed, with --resume."""
    import shlex

    argv = getattr(args, "_argv", None) or ["train", args.data, "--out", args.out or f"runs/{Path(args.data).stem}"]
    return shlex.join(["blockpress", *argv, *([] if "--resume" in argv else ["--resume"])])


def main(args) -> int:
    import torch

    from blockpress.train import distributed as dist
    from blockpress.train.trainer import Trainer, clean_stale

    if args.threads:
        from .threads import set_threads

        set_threads(args.threads)
    rank, world = dist.setup()
    lm, source, eval_source, tcfg, lora, extra, resume_ck = build(args, world)
    if args.warmup > args.steps and rank == 0:  # after build: a bad flag or file stays a one-line error
        print(f"blockpress train: warning: --warmup {args.warmup} is longer than --steps {args.steps}: the learning "
              f"rate never reaches --lr (it peaks at {100 * args.steps / args.warmup:.0f} % of it); lower --warmup",
              file=sys.stderr)
    if args.fsdp and world == 1 and rank == 0:
        print("blockpress train: --fsdp with one process: nothing to shard, training the whole model here (start it "
              "with torchrun --nproc_per_node N to shard it)", file=sys.stderr)
    wrapped = dist.wrap(lm.module, fsdp=args.fsdp) if world > 1 else None
    trainer = Trainer(lm, source, tcfg, eval_source, lora=lora, rank=rank, world=world, wrapped=wrapped,
                      extra_files=extra, resume_command=resume_command(args))
    if resume_ck is not None:
        if rank == 0:
            removed = clean_stale(tcfg.out_dir)
            if removed:
                print(f"removed what an interrupted save left: {', '.join(removed)}")
        trainer.load_state(resume_ck)
        if rank == 0:
            print(f"resumed from {resume_ck} at step {trainer.step}")
    if rank == 0:
        n = sum(p.numel() for p in lm.module.parameters() if p.requires_grad)  # whole, not this rank's shard
        how = f", {'FSDP2-sharded' if trainer.sharded else 'DDP'}" if world > 1 else ""
        print(f"training {n / 1e6:.2f}M parameters on {lm.device} ({world} process(es){how}), out: {tcfg.out_dir}")
    try:
        trainer.train()
    except (KeyboardInterrupt, Terminated):  # Ctrl-C, SIGTERM: where the run stands and how to go on (the
        # checkpoints are whole)
        if rank == 0:
            from blockpress.train.trainer import latest_checkpoint

            last = latest_checkpoint(tcfg.out_dir)
            print(f"\nblockpress train: interrupted at step {trainer.step}; "
                  + (f"the last complete checkpoint is {last.name}: continue with {resume_command(args)}"
                     if last is not None else "no checkpoint was saved yet (a new run starts over)"), file=sys.stderr)
        raise
    dist.cleanup()
    return 0
