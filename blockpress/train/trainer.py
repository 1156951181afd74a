"""The training loop: AdamW, warmup + cosine, clipping, eval, checkpoints, exact resume.

Invariants:
- Step s consumes global examples [0, batch_size) of step s from the source and noise from
  (seed, s, example index) (objective.collate), so a run resumed from a checkpoint at step s gives
  exactly the losses an uninterrupted run would (same weights, optimizer, schedule, data, noise).
  A resume that changes what the examples or the loss are (batch size, seed, objective, max canvases) is refused
  (`check_resume`); the learning-rate schedule, clipping and weight decay may change (a diverged run continues at a
  lower --lr).
- Gradient accumulation (`grad_accum` N): each process's share of step s is cut into N equal micro-batches (the
  same examples, the same noise), each one's loss scaled by 1/N, their gradients summed before one optimizer step:
  the gradient of the whole batch's per-example mean, up to fp32 summation order, in 1/N of the activation memory.
  DDP all-reduces only after the last micro-batch (`no_sync`); FSDP2 reduce-scatters each into the shards. `step`
  counts optimizer steps (logs, checkpoints, the schedule, resume).
- Divergence: a step whose loss or gradient norm is not finite sets a flag on the device (no host sync per step);
  it is read where values are read back anyway, at log steps, before an eval and before every save, and stops the
  run with one DivergedError line naming the last good checkpoint. A non-finite state is never saved, so it never
  prunes a good checkpoint.
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
- Logs: `out_dir/metrics.jsonl` (one JSON object per logged step / eval) and `out_dir/loss.png`. A write that fails
  (a full disk between checkpoints) is one CheckpointError line naming the last complete checkpoint, as a failed save.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import BlockpressError, CheckpointError, InputError
from . import objective as obj
from .data import Source
from .distributed import all_ok, reduce_stats


class DivergedError(BlockpressError):
    """The loss or the gradient norm stopped being finite: the run stops before it saves anything."""


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
    grad_accum: int = 1  # micro-batches per optimizer step (each process's share of batch_size cut in N)
    objective: obj.ObjectiveConfig = field(default_factory=obj.ObjectiveConfig)
    inputs: dict = field(default_factory=dict)  # what else decides the examples (the CLI's: the data file's name and
    # size, the model trained from, the infill and prompt flags), flag -> value; a resume refuses a change

    def __post_init__(self):
        # messages start with the field's name: the CLI turns it into the flag's
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be an integer >= 1 (micro-batches per step), got {self.grad_accum!r}")
        r = self.min_lr_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and 0.0 <= r <= 1.0):
            raise ValueError(f"min_lr_ratio must be in [0, 1] (the final learning rate as a fraction of lr), got {r}")


# what a resumed run must share with the run it continues: the examples each step takes and the loss on them
# (TrainConfig fields, then ObjectiveConfig's; grad_accum only changes the summation order, so it may change)
SAME_RUN = ("batch_size", "max_canvases")


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def check_batch(cfg: TrainConfig, world: int) -> None:
    """Every process, and every micro-batch of it, takes an equal share of the global batch."""
    if cfg.batch_size % (world * cfg.grad_accum):
        raise InputError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({world}) "
                         f"x --grad-accum ({cfg.grad_accum}): each micro-batch takes an equal share")


def _with_flag(command: str, flag: str, value: str) -> str:
    """A command line (shlex-quoted) with `flag value` in place of the one it gives, or added."""
    import shlex

    try:
        argv = shlex.split(command)
    except ValueError:
        return f"{command} {flag} {value}"
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return shlex.join([*argv[:i + 1], value, *argv[i + 2:]])
        if a.startswith(flag + "="):
            return shlex.join([*argv[:i], f"{flag}={value}", *argv[i + 1:]])
    return f"{command} {flag} {value}"


def read_state(ckpt: str | Path) -> dict:
    """A checkpoint's trainer_state.pt; a file torch cannot read (truncated by a crash or a copy) is one
    CheckpointError line naming it and the way on, not a traceback."""
    f = Path(ckpt) / "trainer_state.pt"
    try:
        state = torch.load(f, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, ImportError, AttributeError) as e:
        raise CheckpointError(f"{f} is damaged ({str(e).splitlines()[0] if str(e) else type(e).__name__}); resume "
                              f"from an earlier checkpoint (write its folder name into {Path(ckpt).parent / 'latest'}) "
                              "or start over with another --out") from None
    missing = [k for k in ("step", "scheduler") if k not in state] if isinstance(state, dict) else None
    if not isinstance(state, dict) or missing or not isinstance(state["step"], int):
        what = f"a {type(state).__name__}" if not isinstance(state, dict) else \
            f"no {missing[0]}" if missing else f"step {state['step']!r}"
        raise CheckpointError(f"{f} is not a trainer state ({what}); resume from an earlier checkpoint (write its "
                              f"folder name into {Path(ckpt).parent / 'latest'}) or start over with another --out")
    return state


def check_resume(ckpt: str | Path, cfg: TrainConfig, state: dict | None = None) -> None:
    """Refuse to continue a run (the config in its checkpoint's trainer_state.pt; `state`: that file, already read)
    with settings that change which examples a step takes or the loss on them: the resumed run would be neither the
    old one nor a new one. One line naming the flag and both values. The CLI calls it before loading the model."""
    if state is None:
        state = read_state(ckpt)
    saved, where = state.get("config"), f"{Path(ckpt).name}/trainer_state.pt"
    if not isinstance(saved, dict):
        return
    now = _jsonable(asdict(cfg))
    pairs = [("--" + k.replace("_", "-"), saved.get(k), now[k]) for k in SAME_RUN if k in saved]
    pairs += [("--" + k.replace("_", "-"), saved["objective"].get(k), v) for k, v in now["objective"].items()
              if k in saved.get("objective", {})]
    pairs += [(k, saved["inputs"].get(k), v) for k, v in now["inputs"].items() if k in saved.get("inputs", {})]
    for flag, was, new in pairs:
        if was != new:
            if flag == "data":
                raise InputError(f"the data ({_shown(new)}) is not the run's ({_shown(was)}, in {where}): a resume "
                                 "continues the same examples; resume with that data, or start a new run with "
                                 "another --out")
            raise InputError(f"{flag} {_shown(new)} differs from the run being resumed ({flag} {_shown(was)}, in "
                             f"{where}); resume with {flag} {_shown(was)}, or start a new run with another --out")


def _shown(v) -> str:
    if isinstance(v, (list, tuple)):
        return " ".join(map(str, v))
    return {True: "on", False: "off", None: "unset"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)


@contextlib.contextmanager
def writing_run_folder(out: str | Path):
    """Creating the run folder and its first files (the tokenizer snapshot): an OSError (a read-only or full disk, a
    path through a file) is one CheckpointError line, not a traceback."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"could not write the run folder {out} ({_cause(e)}); give a writable --out (or free "
                              "disk space)") from None


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint a resume continues: the one `latest` names where it is complete (it holds trainer_state.pt),
    else the newest complete `checkpoint-<step>` (a `latest` lost, stale or edited: a resume from step 0 over the
    run's checkpoints would have overwritten them); None where the folder holds no complete checkpoint."""
    out = Path(out_dir)
    p = out / "latest"
    if p.is_file():
        name = p.read_bytes().decode("utf-8", "replace").strip()  # a damaged one names no checkpoint: the newest then
        if name and name == Path(name).name and (out / name / "trainer_state.pt").is_file():
            return out / name
    from ..loading import CHECKPOINT_NAME

    complete = [c for c in out.glob("checkpoint-*") if CHECKPOINT_NAME.match(c.name)
                and (c / "trainer_state.pt").is_file()]
    return max(complete, key=lambda c: int(CHECKPOINT_NAME.match(c.name).group(1)), default=None)


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
        check_batch(cfg, world)
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
        # the first step (1-based) whose loss or gradient norm was not finite, 0: none; on the device, read only
        # where values are read back anyway (`check_finite`)
        self.diverged_at = torch.zeros((), dtype=torch.long, device=self.device)

    # ----------------------------------------------------------------------------- one step
    def _micro_batches(self, step: int, source: Source, stream: str = "train") -> list[obj.TrainBatch]:
        """This process's share of step `step`'s global batch, as `grad_accum` micro-batches (on the host: small
        index tensors). Micro-batch m of rank r holds global examples [r*B/W + m*B/(W*N), ...), with their own
        noise: together, exactly the examples of one whole batch."""
        per = self.cfg.batch_size // self.world
        micro = per // self.cfg.grad_accum
        V = self.lm.config.text.vocab_size
        eos = (self.lm.config.text.eos_token_id if isinstance(self.lm.config.text.eos_token_id, int)
               else (self.lm.config.text.eos_token_id or [1])[0])
        pad = self.lm.config.text.pad_token_id or 0
        return [obj.collate(source.batch(step, range(lo, lo + micro)), self.lm.canvas_length, V, self.cfg.objective,
                            step, lo, eos_id=eos, pad_id=pad, max_canvases=self.cfg.max_canvases, stream=stream)
                for lo in range(self.rank * per, (self.rank + 1) * per, micro)]

    def _loss(self, batch: obj.TrainBatch, split: bool = False):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.world > 1 and (self.lm.module.training or self.sharded):  # FSDP2 gathers weights in eval too
                # DDP / FSDP2 (ObjectiveModule): gradients averaged
                return self.model(batch, self.cfg.objective, **({"split": True} if split else {}))
            return obj.compute_loss(self.lm.module, batch, self.cfg.objective)

    def _sync(self, last: bool):
        """DDP all-reduces the gradients after the last micro-batch of a step only (they are summed locally before)."""
        if last or self.world == 1 or self.sharded:
            return contextlib.nullcontext()
        return self.model.no_sync()

    @torch.enable_grad()
    def train_step(self) -> dict:
        self.lm.module.train()
        micro = self._micro_batches(self.step, self.source)
        tokens = sum(b.n_tokens for b in micro)  # counted on the host: no device sync
        t0 = time.perf_counter()
        n = len(micro)
        rows, finite = [], None
        for m, batch in enumerate(micro):
            with self._sync(last=m == n - 1):
                loss, stats, *two = self._loss(batch.to(self.device), split=self.sharded)
                if m == 0:  # where it always was (benchmarks/train_memory.py traces it there): after the forward
                    self.opt.zero_grad(set_to_none=True)
                # each micro-batch's per-example mean weighs 1/N: the sum is the whole batch's mean (equal shares)
                if self.sharded:  # the decoder's backward, then the encoder's: each gradient sharded as it is made
                    from .distributed import backward

                    backward(self.model, two[0] if n == 1 else two[0].scaled(1.0 / n))
                else:
                    (loss if n == 1 else loss / n).backward()
            ok = torch.isfinite(loss.detach())
            finite = ok if finite is None else finite & ok
            rows.append(stats)
        params = [p for p in self.lm.module.parameters() if p.requires_grad]
        if self.cfg.clip:
            gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.clip)
        else:  # not clipped, but the norm is still logged (and checked)
            gnorm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(gnorm, "full_tensor"):  # FSDP2: the norm of the sharded gradients, a DTensor
            gnorm = gnorm.full_tensor()
        finite = finite & torch.isfinite(gnorm.to(finite.device))
        self.diverged_at = torch.where((self.diverged_at == 0) & ~finite.to(self.device), self.step + 1,
                                       self.diverged_at)
        lr = self.sched.get_last_lr()[0]  # the rate this step ran at (after sched.step() it is the next one's)
        self.opt.step()
        self.sched.step()
        dt = time.perf_counter() - t0
        stats = reduce_stats(rows, obj.COUNTS)  # the global batch's numbers (all micro-batches, all ranks)
        stats.update(step=self.step, lr=lr, grad_norm=float(gnorm), seconds=dt, tokens_per_s=tokens * self.world / dt)
        self.step += 1
        return stats

    def check_finite(self, weights: bool = False) -> None:
        """Stop a diverged run (any rank's flag) before it logs, evaluates or saves: one line naming the step, the
        last good checkpoint and what to change. weights: also the trained weights themselves (before a save: a
        finite step can still overflow them). A collective under torchrun: every rank calls it at the same step."""
        flag = self.diverged_at
        if weights:
            bad = torch.zeros((), dtype=torch.bool, device=self.device)
            for p in self.lm.module.parameters():
                if p.requires_grad:  # a sharded parameter: this rank's shard
                    local = p.to_local() if hasattr(p, "to_local") else p
                    bad = bad | ~torch.isfinite(local.detach()).all().to(self.device)
            flag = torch.where((flag == 0) & bad, -1, flag)
        at = int(flag)  # a read-back where the trainer reads values back anyway
        if all_ok(at == 0):
            return
        what = {0: "on another process", -1: f"at step {self.step}: the weights are not finite"}.get(
            at, f"at step {at}: the loss or the gradient norm is not finite")
        last = latest_checkpoint(self.out)
        cont = f"continue from {last.name}" if last is not None else "start over (no checkpoint yet)"
        lower = f"{self.cfg.lr / 10:g}"  # a tenth, in the command that continues (it repeated the rate that diverged)
        raise DivergedError(
            f"training diverged {what} (nothing was saved after it); lower --lr (now {self.cfg.lr:g}) or clip the "
            f"gradient norm (--clip, now {f'{self.cfg.clip:g}' if self.cfg.clip else 'off'}) and {cont}, e.g. "
            f"{_with_flag(self.resume_command, '--lr', lower)}")

    @property
    def eval_on(self) -> str | None:
        """What the eval loss is of, where it is not held-out data: without its own eval data, the training
        examples' (fixed noise)."""
        return None if self.eval_source is not None else "training examples"

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss on fixed eval examples with fixed noise (stream 'eval'): comparable across steps."""
        src = self.eval_source or self.source
        self.lm.module.eval()
        rows = []
        for k in range(self.cfg.eval_batches):  # in micro-batches, as training: no more memory than a step
            for batch in self._micro_batches(10**9 + k, src, stream="eval"):
                rows.append(self._loss(batch.to(self.device))[1])
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

        from .distributed import full_tensors

        self.check_finite(weights=True)  # a diverged state is never written, so it never prunes a good checkpoint
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
        raise self._write_error(path, error) from None

    def _write_error(self, path: Path, error: BaseException | None) -> CheckpointError:
        """What a write in the run folder that failed (a checkpoint, the metrics log) tells the user: the cause, and
        the command that continues from the last complete checkpoint."""
        last = latest_checkpoint(self.out)
        cause = _cause(error) if error is not None else "another process could not write its part"
        return CheckpointError(
            f"could not write {path} ({cause}); free disk space, then continue "
            + (f"from {last.name}" if last is not None else "(no complete checkpoint yet: it starts over)")
            + f": {self.resume_command}")

    def _write_weights(self, path: Path, tensors: dict | None) -> None:
        if path.is_dir():  # this run's own checkpoint of this step (a resume from an earlier one): written again
            shutil.rmtree(path)
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
        """Restore optimizer, scheduler, step and history (weights are loaded by the caller). Refuses a config that
        changes the run's examples or loss (`check_resume`); this config's learning rate, schedule, weight decay
        and betas apply from here on."""
        st = read_state(ckpt)
        check_resume(ckpt, self.cfg, st)
        if "optimizer" in st:  # a checkpoint written before the optimizer moved to optimizer/
            self.opt.load_state_dict(st["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            optim = get_optimizer_state_dict(self.lm.module, self.opt)  # this run's layout: shapes and shards
            _load_sharded({"optimizer": optim}, Path(ckpt) / "optimizer")
            set_optimizer_state_dict(self.lm.module, self.opt, optim)
        self.sched.load_state_dict(st["scheduler"])
        self.step, self.history, self.window = st["step"], st["history"], st.get("window", [])
        self._apply_hyperparameters()
        torch.set_rng_state(st["torch_rng"])
        if self.rank == 0:  # the log restarts at the checkpoint: drop rows a killed run wrote after it
            with writing_run_folder(self.out):
                self.out.mkdir(parents=True, exist_ok=True)
                tmp = self.out / "metrics.jsonl.tmp"
                tmp.write_text("".join(json.dumps(row) + "\n" for row in self.history))
                os.replace(tmp, self.out / "metrics.jsonl")

    def _apply_hyperparameters(self) -> None:
        """After a resume: this config's lr, schedule, weight decay and betas (the restored optimizer and scheduler
        carry the checkpoint's). Unchanged values give the very numbers restored (the scheduler's own formula)."""
        f = lr_lambda(self.cfg)
        groups = self.opt.param_groups
        self.sched.base_lrs = [self.cfg.lr for _ in groups]
        for i, g in enumerate(groups):
            g["initial_lr"] = self.cfg.lr
            g["lr"] = self.cfg.lr * f(self.sched.last_epoch)
            g["betas"] = tuple(self.cfg.betas)
            g["weight_decay"] = self.cfg.weight_decay if i == 0 else 0.0  # __init__: matrices, then the rest
        self.sched._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports for the next step

    # ----------------------------------------------------------------------------- loop
    def log(self, row: dict) -> None:
        self.history.append(row)
        if self.rank == 0:
            path = self.out / "metrics.jsonl"
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:  # a disk that filled up between checkpoints
                raise self._write_error(path, e) from None

    def plot(self) -> None:
        from .plot import plot_history

        if not any("loss" in h or "eval_loss" in h for h in self.history):
            return  # a save before the first logged step: nothing to draw (an empty plot and a warning before)
        try:
            plot_history(self.history, self.out / "loss.png", eval_on=self.eval_on)
        except ModuleNotFoundError as e:
            print(f"blockpress train: could not plot losses ({e.name} is not installed: pip install "
                  "'blockpress[train]')")
        except Exception as e:  # a plotting problem must never kill a run
            print(f"blockpress train: could not plot losses ({e})")

    def train(self) -> list[dict]:
        cfg = self.cfg
        with writing_run_folder(self.out):
            self.out.mkdir(parents=True, exist_ok=True)
        bar = _Progress(cfg.steps, self.step, enabled=cfg.progress and self.rank == 0)
        last_save = time.time()
        done_here = 0
        label = "eval loss" + (f" ({self.eval_on})" if self.eval_on else "")
        with bar:
            while self.step < cfg.steps:
                stats = self.train_step()
                self.window.append(stats)
                done_here += 1
                logs = self.step % cfg.log_every == 0 or self.step == cfg.steps
                evals = cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps)
                if logs or evals:
                    self.check_finite()
                row = {k: sum(w[k] for w in self.window) / len(self.window) for k in self.window[0]} if logs else None
                bar.update(self.step, row or stats, line=logs)  # a logged line: the window's mean, as metrics.jsonl
                if logs:
                    row["step"] = self.step
                    row["time"] = time.time()
                    self.log(row)
                    self.window = []
                if evals:
                    ev = self.evaluate()
                    self.log({"step": self.step, "time": time.time(), **ev})
                    bar.note(f"step {self.step}: {label} {ev['eval_loss']:.4f}")
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

    def update(self, step: int, s: dict, line: bool = True) -> None:
        """line: this is a log step (the plain output prints one line per log step, the bar moves every step)."""
        if not self.enabled:
            return
        info = f"loss {s['loss']:.4f}  {s['tokens_per_s']:.0f} tok/s"
        if self.rich:
            self.rich.update(self.task, completed=step, info=info)
        elif line:
            rate = (step - self.s0) / max(1e-9, time.time() - self.t0)
            eta = (self.total - step) / max(rate, 1e-9)
            print(f"step {step}/{self.total}  {info}  lr {s['lr']:.2e}  eta {eta / 60:.1f} min", flush=True)

    def note(self, msg: str) -> None:
        if not self.enabled:
            return
        (self.rich.console.print if self.rich else print)(msg)
