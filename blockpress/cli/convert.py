"""`blockpress convert MODEL OUT`: write a checkpoint in another storage: quantised experts and projections, or
another dtype.

`--precision fp8|int4` (experts) and `--linears fp8|int8|int4-mlp` (attention and dense-MLP projections) quantise
while loading (one layer at a time, as `load` does) and write the pre-quantised layout that `load` reads back byte for
byte (compressed-tensors: fp8 by output channel, packed int4 by group and int8 by channel;
blockpress/model/prequantized.py). The 26B-A4B model's 52 GB become ~27 GB in fp8 and ~15 GB with int4 experts and
int8 projections, and later loads skip the quantisation. `--dtype` sets the float weights' type (default: the
checkpoint's own, not the CPU's float32). The tokenizer files and generation_config.json come along, and so does a
vision tower (the engine is text-only, but the checkpoint keeps its image input for transformers and vLLM).
`--adapter DIR` folds a LoRA adapter (a `blockpress train --lora` checkpoint, or any PEFT one) into the weights: one
checkpoint to serve anywhere. OUT is replaced only when it holds nothing but a checkpoint's files, and never when it
is MODEL's own folder.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..options import DTYPE_NAMES
from .run import add_storage_args, storage_options


def add_parser(p) -> None:
    p.add_argument("model", metavar="MODEL", help="a checkpoint folder, a shipped model's name or a Hub id")
    p.add_argument("out", metavar="OUT", help="the folder to write")
    add_storage_args(p)
    p.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default=None,
                   help="the float weights' type (default: the checkpoint's own)")
    p.add_argument("--adapter", metavar="DIR",
                   help="a LoRA adapter folder (PEFT format) to fold into the weights before they are written")
    p.add_argument("--device", default=None,
                   help="where to quantise (default: $BLOCKPRESS_DEVICE, else a CUDA GPU when there is one, else cpu)")


def main(args) -> int:
    import blockpress

    from ..config import ModelConfig
    from ..loading import resolve_path
    from ..model.weights import find_weight_files, headers_dtype, read_headers

    if args.embeddings != "native":  # (before loading anything: save would refuse it at the end)
        from ..errors import InputError

        raise InputError("convert --embeddings int8: no checkpoint format blockpress writes holds an int8 embedding "
                         "table; drop --embeddings (load the converted model with --embeddings int8 instead)")
    if args.adapter and args.linears != "native":
        from ..errors import InputError

        raise InputError(f"convert --adapter with --linears {args.linears}: an adapter folds into float projections "
                         "only; convert with --adapter first, then convert that folder with --linears")
    t0 = time.perf_counter()
    folder = resolve_path(args.model, progress=True)
    if Path(args.out).expanduser().resolve() == folder.resolve():
        from ..errors import InputError

        raise InputError(f"OUT ({args.out}) is MODEL's own folder, which the conversion would replace for good; "
                         "convert into a new folder (then move it over MODEL if that is what you want)")
    raw = ModelConfig.from_file(folder / "config.json").raw
    dtype = args.dtype or raw.get("dtype") or raw.get("torch_dtype") or \
        headers_dtype(read_headers(find_weight_files(folder))) or "bfloat16"
    lm = blockpress.load(folder, device=args.device, dtype=dtype, **storage_options(args))
    if args.adapter:
        from ..train.lora import apply_adapter

        apply_adapter(lm, args.adapter, merge=True)
    out = lm.save(args.out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    amount = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    print(f"wrote {out} ({amount}: {dtype}, experts {lm.options.precision}, projections "
          f"{lm.options.linears}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
