"""The training loop: AdamW, warmup + cosine, clipping, eval, checkpoints, exact resume.

Invariants:
- Step s consumes global examples [0, batch_size) of step s from the source and noise from
  (seed, s, example index) (objective.collate), so a run resumed from a checkpoint at step s gives
  exactly the losses an uninterrupted run would (same weights, optimizer, schedule, data, noise).
- Data parallel: rank r of W takes examples [r*B/W, (r+1)*B/W) of each global batch; DDP or FSDP2 averages
  the gradients of the per-rank means, which equals the single-process mean over the global batch
  (all ranks hold the same number of examples).
- Checkpoints: `out_dir/checkpoint-<step>/` in the Hugging Face layout (model.save, atomic; a sharded run's
  weights are gathered onto rank 0 for it), or the PEFT adapter files for LoRA runs; `optimizer/`, the
  optimizer state by parameter name in torch.distributed.checkpoint's format (each rank writes its own shard,
  and a run with another number of processes, or one process, reads it back re-split); `trainer_state.pt`
  (scheduler, step, history, RNG), written last. `out_dir/latest` names the newest complete checkpoint and is
  replaced atomically after it is written.
- A save that fails, whatever raised (OSError, torch's RuntimeError, safetensors' SafetensorError, ...),
  removes what it wrote, leaves `latest` where it was and raises one CheckpointError line with the cause and
  the command that resumes. A resumed run first removes what an interrupted save left (`clean_stale`), and
  `metrics.jsonl` restarts at the checkpoint's step.
- Logs: `out_dir/metrics.jsonl` (one JSON object per logged step / eval) and `out_dir/loss.png`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError, InputError
from . import objective as obj
from .data import Source
from .distributed import reduce_stats


@dataclass
class TrainConfig:
    out_dir: str = "runs/train"
    steps: int = 1000
    batch_size: int = 32  # global batch (all ranks together)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.99)
    clip: float = 1.0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 2
    save_every: int = 200
    save_minutes: float = 0.0  # also save when this many minutes passed since the last save (0: off)
    keep_last: int = 2
    grad_checkpointing: bool = False
    max_canvases: int | None = None
    stop_after: int | None = None  # stop (as if killed) after this many steps of this invocation
    progress: bool = True
    objective: obj.ObjectiveConfig = field(default_factory=obj.ObjectiveConfig)


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    p = Path(out_dir) / "latest"
    if not p.is_file():
        return None
    ck = Path(out_dir) / p.read_text().strip()
    return ck if (ck / "trainer_state.pt").is_file() else None


def clean_stale(out_dir: str | Path) -> list[str]:
    """Remove what interrupted saves left in a run folder: temp folders of atomic writes (`.checkpoint-*`),
    temp files, and checkpoint folders without a trainer state (other than the one `latest` names).
    Returns the names removed."""
    out = Path(out_dir)
    keep = latest_checkpoint(out)
    stale = [p for p in out.glob(".checkpoint-*")] + [p for p in (out / "latest.tmp", out / "metrics.jsonl.tmp")
                                                       if p.exists()]
    stale += [p for p in out.glob("checkpoint-*") if p.is_dir() and not (p / "trainer_state.pt").is_file()
              and (keep is None or p.resolve() != keep.resolve())]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


class Trainer:
    def __init__(self, lm, source: Source, cfg: TrainConfig, eval_source: Source | None = None,
                 lora=None, rank: int = 0, world: int = 1, wrapped=None, extra_files: dict | None = None,
                 resume_command: str | None = None):
        """lm: BlockDiffusionLM being trained (lm.module). lora: a lora.LoraSpec when training adapters
        (the module must already carry them). wrapped: lm.module's objective wrapped by distributed.wrap (DDP or
        FSDP2; made before this, as FSDP2 replaces the parameters the optimizer is given).
        resume_command: what a failed save tells the user to run (default: "--resume")."""
        from .distributed import is_sharded

        self.lm, self.source, self.cfg, self.eval_source = lm, source, cfg, eval_source
        self.resume_command = resume_command or "the same command with --resume"
        self.lora, self.rank, self.world = lora, rank, world
        self.model = wrapped if wrapped is not None else lm.module
        self.sharded = wrapped is not None and is_sharded(wrapped)
        self.extra_files = extra_files or {}
        if cfg.batch_size % world:
            raise InputError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({world}): "
                             "each takes an equal share")
        params = [p for p in lm.module.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=cfg.betas, eps=1e-8)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.step = 0
        self.history: list[dict] = []
        self.window: list[dict] = []  # the steps since the last logged row (a checkpoint keeps them for a resume)
        self.out = Path(cfg.out_dir)
        lm.module.gradient_checkpointing = cfg.grad_checkpointing
        self.device = lm.device
        self.autocast = self.device.type == "cuda" and lm.dtype == torch.float32

    # ----------------------------------------------------------------------------- one step
    def _batch(self, step: int, source: Source, stream: str = "train") -> obj.TrainBatch:
        per = self.cfg.batch_size // self.world
        lo = self.rank * per
        exs = source.batch(step, range(lo, lo + per))
        V = self.lm.config.text.vocab_size
        eos = (self.lm.config.text.eos_token_id if isinstance(self.lm.config.text.eos_token_id, int)
               else (self.lm.config.text.eos_token_id or [1])[0])
        pad = self.lm.config.text.pad_token_id or 0
        return obj.collate(exs, self.lm.canvas_length, V, self.cfg.objective, step, lo, eos_id=eos, pad_id=pad,
                           max_canvases=self.cfg.max_canvases, stream=stream).to(self.device)

    def _loss(self, batch: obj.TrainBatch, split: bool = False):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.world > 1 and (self.lm.module.training or self.sharded):  # FSDP2 gathers weights in eval too
                # DDP / FSDP2 (ObjectiveModule): gradients averaged
                return self.model(batch, self.cfg.objective, **({"split": True} if split else {}))
            return obj.compute_loss(self.lm.module, batch, self.cfg.objective)

    @torch.enable_grad()
    def train_step(self) -> dict:
        self.lm.module.train()
        batch = self._batch(self.step, self.source)
        t0 = time.perf_counter()
        loss, stats, *two = self._loss(batch, split=self.sharded)
        self.opt.zero_grad(set_to_none=True)
        if self.sharded:  # the decoder's backward, then the encoder's: each gradient sharded as soon as it is made
            from .distributed import backward

            backward(self.model, two[0])
        else:
            loss.backward()
        params = [p for p in self.lm.module.parameters() if p.requires_grad]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.clip) if self.cfg.clip else torch.tensor(0.0)
        if hasattr(gnorm, "full_tensor"):  # FSDP2: the norm of the sharded gradients, a DTensor
            gnorm = gnorm.full_tensor()
        lr = self.sched.get_last_lr()[0]  # the rate this step ran at (after sched.step() it is the next one's)
        self.opt.step()
        self.sched.step()
        dt = time.perf_counter() - t0
        stats = reduce_stats([stats], obj.COUNTS)  # the global batch's numbers, not rank 0's share
        stats.update(step=self.step, lr=lr, grad_norm=float(gnorm), seconds=dt,
                     tokens_per_s=batch.n_tokens * self.world / dt)
        self.step += 1
        return stats

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss on fixed eval examples with fixed noise (stream 'eval'): comparable across steps."""
        src = self.eval_source or self.source
        self.lm.module.eval()
        rows = []
        for k in range(self.cfg.eval_batches):
            batch = self._batch(10**9 + k, src, stream="eval")
            rows.append(self._loss(batch)[1])
        self.lm.module.train()
        return {f"eval_{k}": v for k, v in reduce_stats(rows, obj.COUNTS).items()}

    # ----------------------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        return {"step": self.step, "scheduler": self.sched.state_dict(), "history": self.history,
                "window": self.window,
                "config": _jsonable(asdict(self.cfg)), "torch_rng": torch.get_rng_state()}

    def save(self) -> Path:
        """Write checkpoint-<step> (weights or adapter, optimizer, trainer state), then point `latest` at it. A
        write that fails on any rank (a full disk) removes the half-written checkpoint, leaves `latest` on the last
        complete one, and says so on every rank."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from .distributed import all_ok, full_tensors

        path = self.out / f"checkpoint-{self.step:07d}"
        # collectives under FSDP2 (every rank takes part): the weights rank 0 writes, each rank's optimizer shard
        tensors = full_tensors(self.lm.module, trainable_only=self.lora is not None) if self.sharded else None
        optim = get_optimizer_state_dict(self.lm.module, self.opt)
        phases = ((lambda: self._write_weights(path, tensors), False),
                  (lambda: _save_sharded({"optimizer": optim}, path / "optimizer"), True),  # every rank its shard
                  (lambda: self._write_state(path), False))
        for write, every_rank in phases:
            error = None
            if every_rank or self.rank == 0:
                try:
                    write()
                except (Exception, CheckpointException) as e:  # a full disk raises OSError, RuntimeError (torch),
                    error = e  # SafetensorError, Exception (tokenizers); torch.distributed.checkpoint a BaseException
            if not all_ok(error is None):
                self._failed(path, error)
        if self.rank == 0:
            self._prune()
            self.plot()
        return path

    def _failed(self, path: Path, error: BaseException | None):
        last = latest_checkpoint(self.out)
        if self.rank == 0:
            if last is None or last.resolve() != path.resolve():
                shutil.rmtree(path, ignore_errors=True)
            clean_stale(self.out)
        cause = _cause(error) if error is not None else "another process could not write its part"
        raise CheckpointError(
            f"could not write {path} ({cause}); free disk space, then continue "
            + (f"from {last.name}" if last is not None else "(no complete checkpoint yet: it starts over)")
            + f": {self.resume_command}") from None

    def _write_weights(self, path: Path, tensors: dict | None) -> None:
        if self.lora is not None:
            from .lora import save_adapter

            save_adapter(self.lm.module, path, self.lora, tensors=tensors)
        else:
            self.lm.save(path, tensors)
        for rel, data in self.extra_files.items():
            (path / rel).write_bytes(data if isinstance(data, bytes) else data.encode())

    def _write_state(self, path: Path) -> None:
        tmp = path / "trainer_state.pt.tmp"
        torch.save(self.state(), tmp)
        os.replace(tmp, path / "trainer_state.pt")
        latest_tmp = self.out / "latest.tmp"
        latest_tmp.write_text(path.name)
        os.replace(latest_tmp, self.out / "latest")

    def _prune(self) -> None:
        cks = sorted(p for p in self.out.glob("checkpoint-*") if p.is_dir())
        for p in cks[:-self.cfg.keep_last] if self.cfg.keep_last > 0 else []:
            shutil.rmtree(p, ignore_errors=True)

    def load_state(self, ckpt: Path) -> None:
        """Restore optimizer, scheduler, step and history (weights are loaded by the caller)."""
        st = torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False)
        if "optimizer" in st:  # a checkpoint written before the optimizer moved to optimizer/
            self.opt.load_state_dict(st["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            optim = get_optimizer_state_dict(self.lm.module, self.opt)  # this run's layout: shapes and shards
            _load_sharded({"optimizer": optim}, Path(ckpt) / "optimizer")
            set_optimizer_state_dict(self.lm.module, self.opt, optim)
        self.sched.load_state_dict(st["scheduler"])
        self.step, self.history, self.window = st["step"], st["history"], st.get("window", [])
        torch.set_rng_state(st["torch_rng"])
        if self.rank == 0:  # the log restarts at the checkpoint: drop rows a killed run wrote after it
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / "metrics.jsonl.tmp"
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.history))
            os.replace(tmp, self.out / "metrics.jsonl")

    # ----------------------------------------------------------------------------- loop
    def log(self, row: dict) -> None:
        self.history.append(row)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def plot(self) -> None:
        from .plot import plot_history

        if not any("loss" in h or "eval_loss" in h for h in self.history):
            return  # a save before the first logged step: nothing to draw (an empty plot and a warning before)
        try:
            plot_history(self.history, self.out / "loss.png")
        except Exception as e:  # a plotting problem must never kill a run
            print(f"blockpress train: could not plot losses ({e})")

    def train(self) -> list[dict]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        bar = _Progress(cfg.steps, self.step, enabled=cfg.progress and self.rank == 0)
        last_save = time.time()
        done_here = 0
        with bar:
            while self.step < cfg.steps:
                stats = self.train_step()
                self.window.append(stats)
                done_here += 1
                bar.update(self.step, stats)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    row = {k: sum(w[k] for w in self.window) / len(self.window) for k in self.window[0]}
                    row["step"] = self.step
                    row["time"] = time.time()
                    self.log(row)
                    self.window = []
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    ev = self.evaluate()
                    self.log({"step": self.step, "time": time.time(), **ev})
                    bar.note(f"step {self.step}: eval loss {ev['eval_loss']:.4f}")
                due = (cfg.save_every and self.step % cfg.save_every == 0) or \
                      (cfg.save_minutes and time.time() - last_save > 60 * cfg.save_minutes)
                if due or self.step == cfg.steps:
                    self.save()
                    last_save = time.time()
                if cfg.stop_after is not None and done_here >= cfg.stop_after:
                    break
        return self.history


def _save_sharded(state: dict, folder: Path) -> None:
    """torch.distributed.checkpoint's save: each rank writes its shards, rank 0 the index; one process without a
    process group writes it all."""
    import torch.distributed.checkpoint as dcp

    with _one_process_is_fine():
        dcp.save(state, checkpoint_id=str(folder), no_dist=not torch.distributed.is_initialized())


def _load_sharded(state: dict, folder: Path) -> None:
    """Fill `state` (this run's tensors, sharded or whole) in place from a `_save_sharded` folder, whatever the
    number of processes that wrote it."""
    import torch.distributed.checkpoint as dcp

    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{folder} has no optimizer state (.metadata missing): the checkpoint is incomplete; "
                              "resume from an earlier one or start over without --resume")
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not torch.distributed.is_initialized())


@contextlib.contextmanager
def _one_process_is_fine():
    """Silence torch.distributed.checkpoint's warning that it assumes one process (it is what it was asked)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _cause(e: BaseException) -> str:
    """The first line of what went wrong, under the wrappers (CheckpointError over OSError; the CheckpointException
    of torch.distributed.checkpoint over each failed rank's exception)."""
    inner = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ is not None else e
    if isinstance(inner, CheckpointException) and inner.failures:
        inner = next(iter(inner.failures.values()))[0]  # (exception, traceback) of the first rank that failed
    lines = str(inner).strip().splitlines()
    text = getattr(inner, "strerror", None) or (lines[0] if lines else "")
    return f"{type(inner).__name__}: {text[:200]}" if text else type(inner).__name__


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


class _Progress:
    """A rich progress bar (loss, tokens/s, ETA) on a terminal; one plain line per log step otherwise."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.rich = None
        self.t0, self.s0 = time.time(), start
        if enabled and os.isatty(2):
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.rich = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.rich.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        if self.rich:
            self.rich.__enter__()
        return self

    def __exit__(self, *a):
        if self.rich:
            self.rich.__exit__(*a)

    def update(self, step: int, s: dict) -> None:
        if not self.enabled:
            return
        info = f"loss {s['loss']:.4f}  {s['tokens_per_s']:.0f} tok/s"
        if self.rich:
            self.rich.update(self.task, completed=step, info=info)
        elif step % 10 == 0 or step == self.total:
            rate = (step - self.s0) / max(1e-9, time.time() - self.t0)
            eta = (self.total - step) / max(rate, 1e-9)
            print(f"step {step}/{self.total}  {info}  lr {s['lr']:.2e}  eta {eta / 60:.1f} min", flush=True)

    def note(self, msg: str) -> None:
        if not self.enabled:
            return
        (self.rich.console.print if self.rich else print)(msg)
