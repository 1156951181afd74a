"""`blockpress tune [MODEL]`: time the GPU kernels' settings on this card for a model's shapes and keep the fastest.

What it tunes (blockpress/lab/tune.py): the expert kernels' tiles for the storage given (`--precision`,
`--group-size`, `--fp8-activations`; `--linears int4-mlp` adds the dense MLP's), and the attention kernel's key runs.
Each candidate is checked against the reference and the default; one that fails or disagrees is never kept. The
winners go to the tuned-settings file (blockpress/kernels/tuned.py: ~/.cache/blockpress/tuned.json, or
$BLOCKPRESS_TUNED), which every later `load` / `run` / `serve` / `bench` on this card reads when no `--moe-tiles` or
`--attention-split` is given. Only MODEL's config.json is read (a Hub id fetches that file alone): the kernels run on
random weights of its shapes. Tune with the storage flags you load with: a setting is kept per format and shape.
"""

from __future__ import annotations

import json
import sys

from .run import _group_size, _int_in, _positive_int

PRESETS = ("tiny", "small", "real-26b")


def add_parser(p) -> None:
    from ..options import LINEAR_FORMATS

    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a checkpoint folder, a shipped model's name or a Hub id; only its config.json is read "
                        "(default: the 26B-A4B model's shapes, --preset real-26b)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="a built-in config instead of MODEL")
    p.add_argument("--precision", choices=["native", "fp8", "int4"], default="native",
                   help="the expert weights' format you load with (a pre-quantised checkpoint: its own)")
    p.add_argument("--group-size", type=_group_size, default=64, help="int4: input columns per scale (default 64)")
    p.add_argument("--linears", choices=LINEAR_FORMATS, default="native",
                   help="int4-mlp: tune the dense MLP's int4 kernels too")
    p.add_argument("--fp8-activations", action="store_true",
                   help="with --precision fp8: tune the fp8 x fp8 expert kernels (what --fp8-activations runs)")
    p.add_argument("--batch", type=_int_in(1, 64), default=1, help="canvases per pass to tune for (default 1)")
    p.add_argument("--context", type=_positive_int, default=2048,
                   help="cached tokens before the canvas, for the attention kernel (default 2048)")
    p.add_argument("--quick", action="store_true", help="8 tile settings instead of ~30 (a minute, not several)")
    p.add_argument("--grid", default=None, help="the tile settings to try, e.g. 'bm=auto,16;bn=64,128;bk=128;swap=1' "
                                                "(';' between keys, ',' between values, '|' between grids)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="CPU interpreter only: best of this many runs")
    p.add_argument("--device", default=None, help="the CUDA GPU to tune (default: the first); a CPU runs Triton's "
                                                  "interpreter only when TRITON_INTERPRET=1 (tests: its times mean "
                                                  "nothing for a GPU)")
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
    from ..kernels._triton import interpreted, usable_on
    from ..lab import tune
    from ..loading import parse_device

    device = parse_device(args.device)
    if not usable_on(device):
        raise InputError(f"tune times the Triton kernels, which run on a CUDA GPU ({device} here: it runs the torch "
                         "kernels, which have no settings to tune); on a GPU machine: pip install "
                         "'blockpress[gpu]'")
    if args.fp8_activations and args.precision != "fp8":
        raise InputError("--fp8-activations tunes the fp8 x fp8 expert kernels: add --precision fp8")
    if args.grid is not None and args.quick:
        raise InputError("give --grid or --quick, not both")
    grid = args.grid or (tune.QUICK_GRID if args.quick else tune.DEFAULT_GRID)
    try:
        tune.parse_grid(grid)
    except ValueError as e:
        raise InputError(f"--grid: {e}") from None
    cfg, source = _config(args)
    text, C = cfg.text, cfg.canvas_length
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = tuned.device_key(device)
    fmt = "fp8-a8" if args.fp8_activations else args.precision
    jobs = [("experts", fmt, False)] + ([("mlp", "int4", True)] if args.linears == "int4-mlp" else [])
    print(f"blockpress tune: {card}{' (Triton interpreter: times mean nothing for a GPU)' if interpreted() else ''}, "
          f"{source}, batch {args.batch} x canvas {C}, {str(dtype).removeprefix('torch.')}", file=sys.stderr)

    def report(what):
        def show(row, i, n):
            name = row.get("spec", f"split={row.get('split')}")
            status = row.get("failed") or (f"{row['ms']:.3f} ms" + ("" if row["ok"] else
                                                                    f"  DISAGREES ({row['rel_err_vs_first']:.1e})"))
            print(f"  [{what} {i}/{n}] {name:<40} {status}", file=sys.stderr, flush=True)
        return show

    kept, summary = {}, {"device": card, "source": source, "batch": args.batch, "results": {}}
    for kind, f, mlp in jobs:
        key = tuned.experts_key(text, f, dtype, args.group_size, mlp=mlp)
        res = tune.tune_experts(text, C, f, device, dtype, args.group_size, args.batch, grid, args.repeats,
                                mlp=mlp, report=report(f"{kind} {f}"))
        summary["results"][key] = res
        if res["best"] is None:
            print(f"  {key}: no setting ran and agreed with the reference; nothing kept", file=sys.stderr)
            continue
        times = {r["spec"]: r["ms"] for r in res["rows"] if r.get("ok")}
        kept[key] = (res["best"], times, {"tokens": res["tokens"], "default": res["default"]})
        print(f"  {key}: {res['best']} ({times[res['default']] / times[res['best']]:.2f}x the default "
              f"{res['default']})" if res["default"] in times else f"  {key}: {res['best']}", file=sys.stderr)
    key = tuned.attention_key(text, dtype)
    res = tune.tune_attention(text, C, device, dtype, args.batch, args.context, repeats=args.repeats,
                              report=report("attention"))
    summary["results"][key] = res
    if res["best"] is not None:
        times = {str(r["split"]): r["ms"] for r in res["rows"] if r.get("ok")}
        kept[key] = (res["best"], times, {"context": args.context, "batch": args.batch})
        print(f"  {key}: {res['best']} key run(s) per row block"
              + (f" ({times['1'] / times[str(res['best'])]:.2f}x one)" if "1" in times else ""), file=sys.stderr)
    if args.dry_run or not kept:
        summary["kept"] = None
    else:
        for key, (value, times, facts) in kept.items():
            where = tuned.store(device, key, value, times, **facts)
        summary["kept"] = str(where)
        print(f"kept in {where}: later loads on this card use them unless --moe-tiles / --attention-split are given",
              file=sys.stderr)
    print(json.dumps(summary))
    return 0 if kept else 1
