"""`blockpress tune [MODEL]`: time the GPU kernels' settings on this card for a model's shapes and keep the fastest.

What it tunes (blockpress/lab/tune.py), for the storage flags given (those of `run`: `--precision`, `--group-size`,
`--linears`, and `--fp8-activations`): the expert kernels' tiles, the 8-bit projections' tiles (`--linears
int8|fp8`; `int4-mlp`: the dense MLP's int4 kernels' tiles), and the attention kernel's tiles and key runs per
kind of layer.
Each candidate is checked against the reference and the default; one that fails or disagrees is never kept. The
winners go to the tuned-settings file (blockpress/kernels/tuned.py: ~/.cache/blockpress/tuned.json, or
$BLOCKPRESS_TUNED), which every later `load` / `run` / `serve` / `bench` on this card reads where no `--moe-tiles`,
`--linear-tiles` or `--attention-tiles` is given. Only MODEL's config.json is read (a Hub id fetches that file
alone): the kernels run on random weights of its shapes. Tune with the storage flags you load with: a setting is kept
per format and shape.
"""

from __future__ import annotations

import functools
import json
import sys

from .run import _int_in, _positive_int, add_fp8_activations_arg, add_storage_args

PRESETS = ("tiny", "small", "real-26b")


def add_parser(p) -> None:
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a checkpoint folder, a shipped model's name or a Hub id; only its config.json is read "
                        "(default: the 26B-A4B model's shapes, --preset real-26b)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="a built-in config instead of MODEL")
    add_storage_args(p)  # the storage you load with: a setting is kept per format and shape
    add_fp8_activations_arg(p)
    p.add_argument("--batch", type=_int_in(1, 64), default=1, help="canvases per pass to tune for (default 1)")
    p.add_argument("--context", type=_positive_int, default=2048,
                   help="cached tokens before the canvas, for the attention kernel (default 2048)")
    p.add_argument("--quick", action="store_true", help="8 expert tile settings instead of ~30 and 5 attention settings "
                                                        "a kind of layer instead of 10 (a minute, not several)")
    p.add_argument("--grid", default=None, help="the tile settings to try, e.g. 'bm=auto,16;bn=64,128;bk=128;swap=1' "
                                                "(';' between keys, ',' between values, '|' between grids)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="CPU interpreter only: best of this many runs")
    p.add_argument("--device", default=None, help="the CUDA GPU to tune (default: the first); --device cpu runs "
                                                  "Triton's CPU interpreter, for tests: its times mean nothing for a "
                                                  "GPU")
    p.add_argument("--dry-run", action="store_true", help="time and print, keep nothing")


def _config(args):
    """(ModelConfig, where it came from)."""
    from ..config import ModelConfig
    from ..errors import InputError

    if args.model and args.preset:
        raise InputError("give MODEL or --preset, not both")
    if args.model:
        from ..loading import resolve_path

        folder = resolve_path(args.model, patterns=["config.json"])
        return ModelConfig.from_file(folder / "config.json"), str(args.model)
    from ..lab.presets import preset_config

    preset = args.preset or "real-26b"
    return ModelConfig.from_dict(preset_config(preset)[0]), f"preset {preset}"


def main(args) -> int:
    import torch

    from ..errors import InputError
    from ..kernels import tuned
    from ..kernels._triton import fp8_usable_on, interpreted, usable_on
    from ..kernels.quant import expert_format, run_format
    from ..lab import tune
    from ..lab.roofline import measure_bandwidth
    from ..loading import parse_device

    device = parse_device(args.device)
    if not usable_on(device) or (device.type != "cuda" and args.device is None):  # (the interpreter: asked by name)
        raise InputError(f"tune times the Triton kernels, which run on a CUDA GPU ({device} here: it runs the torch "
                         "kernels, which have no settings to tune); on a GPU machine: pip install "
                         "'blockpress[gpu]'")
    if args.fp8_activations and "fp8" not in (args.precision, args.linears):
        raise InputError("--fp8-activations tunes the fp8 x fp8 kernels of fp8 weights: add --precision fp8 and / or "
                         "--linears fp8")
    if args.grid is not None and args.quick:
        raise InputError("give --grid or --quick, not both")
    grid = args.grid or (tune.QUICK_GRID if args.quick else tune.DEFAULT_GRID)
    try:
        tune.parse_grid(grid)
    except ValueError as e:
        raise InputError(f"--grid: {e}") from None
    if not args.dry_run:
        tuned.writable()  # before timing anything: a file it would refuse to replace, or BLOCKPRESS_TUNED=off
    cfg, source = _config(args)
    text, C = cfg.text, cfg.canvas_length
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = tuned.device_key(device)
    option = "w8a8" if args.fp8_activations else "auto"  # the experts option those flags load with
    experts, linears = run_format(args.precision, option), run_format(args.linears, option)
    print(f"blockpress tune: {card}{' (Triton interpreter: times mean nothing for a GPU)' if interpreted() else ''}, "
          f"{source}, batch {args.batch} x canvas {C}, {str(dtype).removeprefix('torch.')}", file=sys.stderr)

    def report(what):
        def show(row, i, n):
            label = f"{row['kind']}:{row['spec'] or 'default'}" if "kind" in row else row["spec"]
            speed = "".join([f"  {row['gbs']:,.0f} GB/s" if "gbs" in row else "",
                             f" ({row['floor_fraction']:.0%} of copy)" if "floor_fraction" in row else ""])
            status = row.get("failed") or (f"{row['ms']:.3f} ms{speed}" + (
                "" if row["ok"] else f"  DISAGREES ({row['rel_err_vs_first']:.1e})"))
            print(f"  [{what} {i}/{n}] {label:<40} {status}", file=sys.stderr, flush=True)
        return show

    common = dict(device=device, dtype=dtype, batch=args.batch, repeats=args.repeats, canvas=C)
    bandwidth = measure_bandwidth(device) if device.type == "cuda" else None  # for the experts' share of it
    jobs = [(tuned.experts_key(text, experts, dtype, args.group_size), f"experts {experts}", experts,
             lambda r: tune.tune_experts(text, fmt=experts, group_size=args.group_size, grid=grid, report=r,
                                         bandwidth=bandwidth, **common))]
    if args.linears == "int4-mlp":
        jobs.append((tuned.experts_key(text, "int4", dtype, args.group_size, mlp=True), "mlp int4", "int4",
                     lambda r: tune.tune_experts(text, fmt="int4", group_size=args.group_size, grid=grid, mlp=True,
                                                 report=r, bandwidth=bandwidth, **common)))
    elif args.linears != "native":
        jobs.append((tuned.linears_key(text, linears, dtype), f"linears {linears}", linears,
                     lambda r: tune.tune_linears(text, fmt=linears, report=r, **common)))
    if not fp8_usable_on(device):  # fp8 weights run the torch path there (Triton has no e4m3 before sm_89)
        for key, _, fmt, _ in jobs:
            if expert_format(fmt)[0] == "fp8":
                print(f"  {key}: skipped, the fp8 kernels do not run on this GPU (before sm_89: its torch path has "
                      "no tiles)", file=sys.stderr)
        jobs = [j for j in jobs if expert_format(j[2])[0] != "fp8"]
    # the attention first: its tiles were never timed (the experts' defaults were, on an H100), so a run cut short
    # (a lease's deadline) still keeps them
    candidates = functools.partial(tune.attention_candidates, quick=args.quick)
    jobs.insert(0, (tuned.attention_key(text, dtype), "attention", None,
                    lambda r: tune.tune_attention(text, context=args.context, report=r, candidates=candidates,
                                                  **common)))
    kept, summary = {}, {"device": card, "source": source, "batch": args.batch, "results": {}}

    def name(row) -> str:  # a candidate: a tiles spec (attention: per kind of layer)
        return f"{row['kind']}:{row['spec']}" if "kind" in row else row["spec"]

    where = None
    for key, what, _, run in jobs:  # each kept as soon as it is timed: an interrupted run keeps the finished ones
        res = summary["results"][key] = run(report(what))
        if res["best"] is None:
            print(f"  {key}: no setting ran and agreed with the reference; nothing kept", file=sys.stderr)
            continue
        times = {name(r): r["ms"] for r in res["rows"] if r.get("ok")}
        default = res["default"]
        facts = {"tokens": args.batch * C, "default": default,
                 **({"context": args.context} if what == "attention" else {})}
        kept[key] = res["best"]
        was, now = (res.get("default_ms"), res.get("best_ms")) if "default_ms" in res else \
            (times.get(default), times.get(res["best"]))
        gain = " (the default)" if res["best"] == default else \
            f" ({was / now:.2f}x the default {default or 'tiles'})" if was and now else ""
        print(f"  {key}: {res['best'] or 'the built-in tiles'}{gain}", file=sys.stderr)
        if not args.dry_run:
            where = tuned.store(device, key, res["best"], times, **facts)
    summary["kept"] = None if where is None else str(where)
    if where is not None:
        print(f"kept in {where}: later loads on this card use them where no --moe-tiles / --linear-tiles / "
              "--attention-tiles is given", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if kept else 1
