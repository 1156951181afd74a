"""Data parallel (DDP, gloo on CPU): 2 processes give the 1-process losses and weights on the same global batch."""

import datetime
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

import blockpress
from blockpress.kernels import use
from blockpress.train.data import ListSource
from blockpress.train.sizes import model_config
from blockpress.train.trainer import TrainConfig, Trainer

STEPS = 2


def _examples():
    g = torch.Generator().manual_seed(0)
    # ragged prompts and responses of 1-2 canvases: rows get different left padding per shard
    return [(torch.randint(5, 16, (4 + k % 3,), generator=g).tolist(),
             torch.randint(5, 16, (6 + 5 * (k % 2),), generator=g).tolist()) for k in range(16)]


def _run(rank, world, out, leave=None):
    torch.set_num_threads(1)
    lm = blockpress.from_config(model_config("nano", vocab_size=16, canvas_length=8, context=16), seed=0)
    use(lm.module, attention="eager")
    ddp = None
    if world > 1:
        from blockpress.train import distributed as dist

        dist.setup()
        ddp = dist.wrap(lm.module)
    cfg = TrainConfig(out_dir=str(out), steps=STEPS, batch_size=4, lr=1e-2, warmup=1, eval_every=0,
                      save_every=0, progress=False)
    tr = Trainer(lm, ListSource(_examples(), batch_size=4), cfg, rank=rank, world=world, wrapped=ddp)
    losses, grads, stats = [], [], []
    for _ in range(STEPS):
        stats.append(tr.train_step())
        losses.append(stats[-1]["loss"])
        grads.append({n: p.grad.clone() for n, p in lm.module.named_parameters() if p.grad is not None})
    ev = tr.evaluate()  # a collective: every rank
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "stats": stats, "eval": ev},
                   os.path.join(out, f"w{world}.pt"))
    if world > 1:
        (leave or dist.cleanup)()


def _worker(rank, world, init_file, out):
    # A file rendezvous, not a TCP port picked free beforehand (it can be taken before gloo binds it).
    # With the port the test failed about once in 25 runs on a loaded 2-core machine (a worker exited);
    # the cause was not pinned down. dist.setup() then finds the group initialised.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120))  # a lost peer: an error, no hang
    # Leave with a barrier only: the process group's teardown (destroy_process_group) hung one worker of a CI run
    # on a loaded 2-core machine after both had saved their results; these workers end with os._exit anyway.
    _run(rank, world, out, leave=torch.distributed.barrier)
    # Leave without the interpreter's teardown: in these spawned workers it aborted about once in ten runs on a
    # 2-core VM ("terminate called without an active exception", no Python frame left: a C++ thread object
    # destroyed at exit), after the work and the results were done. The torchrun path users run
    # (test_torchrun_cli_matches_one_process) exits normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_process_ddp_equals_one_process(tmp_path):
    _run(0, 1, str(tmp_path))
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    one, two = torch.load(tmp_path / "w1.pt"), torch.load(tmp_path / "w2.pt")
    assert one["losses"][0] != one["losses"][1]
    # step 1: same weights, same global batch -> same loss and same (all-reduced) gradients
    assert abs(one["losses"][0] - two["losses"][0]) < 1e-6
    g1, g2 = one["grads"][0], two["grads"][0]
    assert set(g1) == set(g2)
    for k in g1:
        assert torch.allclose(g1[k], g2[k], atol=1e-6, rtol=1e-4), k
    # the accuracies count the global batch's positions: pooled over the ranks, not a mean of their ratios
    for k in ("acc", "acc_replaced", "acc_text"):
        assert abs(one["stats"][0][k] - two["stats"][0][k]) < 1e-6, k  # float32 ratios
    # (eval: every rank reads the same fixed eval batches here, so the global numbers are one rank's)
    assert one["eval"].keys() == two["eval"].keys() and "eval_acc" in one["eval"] and "counts" not in one["stats"][0]
    # later steps agree up to float reduction order (Adam amplifies tiny gradient differences)
    assert abs(one["losses"][1] - two["losses"][1]) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_torchrun_cli_matches_one_process(tmp_path, wrapper):
    """The path users run: `torchrun --standalone --nproc-per-node 2 -m blockpress train ... [--fsdp]`
    (dist.setup() reads RANK/WORLD_SIZE/MASTER_ADDR/PORT from torchrun) logs the 1-process loss on the same global
    batch. Slow (two interpreter start-ups) and it binds a local port, so it is opt-in (--runslow)."""
    import json
    import subprocess
    import sys

    args = ["train", "sudoku", "--size", "nano", "--batch-size", "4", "--steps", "2", "--lr", "3e-3",
            "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "0", "--threads", "1",
            "--no-progress", "--blanks", "40", "44", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "blockpress", *args, "--out", str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "blockpress", *args, "--out", str(tmp_path / "two"),
                          *(["--fsdp"] if wrapper == "fsdp" else [])],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    assert f"2 process(es), {'FSDP2-sharded' if wrapper == 'fsdp' else 'DDP'}" in two.stdout + two.stderr

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    a, b = losses("one"), losses("two")
    assert len(a) == len(b) == 2
    assert abs(a[0] - b[0]) < 1e-5 and abs(a[1] - b[1]) < 1e-3
