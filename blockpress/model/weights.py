"""Checkpoint tensors <-> module parameters: one declarative name map, safetensors only.

Checkpoint layout (released and transformers-saved alike):
- `model.decoder.<name>`                               -> `<name>` (embeddings, norms, layers, self-conditioning)
- `model.encoder.language_model.layers.<i>.layer_scalar` -> `layers.<i>.encoder_layer_scalar`
- tied copies (`lm_head.weight`, other `model.encoder.language_model.*`) are skipped;
- vision tensors (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) are not used yet.

Loading builds the module on the meta device and assigns each tensor once, read through
safetensors' memory map and converted straight to the target device/dtype, so weights are never
materialised twice. Pickle checkpoints are refused.

Damaged checkpoints are refused with the tensor's name, never loaded silently wrong: a weight stored
as an integer or bool type (a flipped dtype in the header), NaN or Inf values (one fp32 sum per
tensor, checked with one device sync at the end), a sharded index naming a file outside the
checkpoint folder, a symlink loop. So are pre-quantised checkpoints (NVFP4, GPTQ / AWQ, block-wise FP8: 8- or 4-bit
weights with scale tensors beside them), read from the headers before any tensor: their weights would load as plain
floats without their scales. The pre-quantised layouts read are compressed-tensors' fp8 by output channel and its
packed int4 / int8 (model/prequantized.py), copied into the quantised modules as stored.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path, PurePosixPath

import torch

from ..errors import CheckpointError
from .prequantized import PREQUANTIZED_FIX, checkpoint_entries, finite_probe, loaded_tensor

ENCODER_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
DECODER_PREFIX = "model.decoder."
IGNORED_TIED = ("lm_head.weight", "model.encoder.language_model.")
VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "model.vision", "model.encoder.multi_modal")
SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FLOAT_DTYPES = set(SAFETENSORS_FLOATS)  # safetensors' names of the float types a float checkpoint holds
# what only a pre-quantised checkpoint holds: 8-, 6- or 4-bit float weights (safetensors' F8_E4M3, F8_E5M2, F4, ...)
# and, beside its weights, the scales, zero points and packed values of its quantiser (FP8: weight_scale(_inv),
# input_scale; NVFP4 / compressed-tensors: weight_packed, weight_global_scale, weight_scale_2; GPTQ / AWQ: qweight,
# qzeros, scales, g_idx; k_scale / v_scale of an fp8 KV cache)
LOW_BIT_FLOAT = re.compile(r"^F([468]$|[468]_)")  # F4, F6_E3M2, F8_E4M3, ...; not F64 (a float format this loads)
QUANT_COMPANION = re.compile(r"(_scale|_scale_inv|_scale_2|_global_scale|weight_packed|_zero_point|weight_shape|"
                             r"\.qweight|\.qzeros|\.scales|g_idx)$")


def checkpoint_to_module_name(key: str) -> str | None:
    """Map a checkpoint key to our parameter name; None for keys we skip on purpose."""
    m = ENCODER_SCALAR.match(key)
    if m:
        return f"layers.{m.group(1)}.encoder_layer_scalar"
    if key.startswith(DECODER_PREFIX):
        return key[len(DECODER_PREFIX):]
    return None


def module_to_checkpoint_name(name: str) -> str:
    m = re.match(r"^layers\.(\d+)\.encoder_layer_scalar$", name)
    if m:
        return f"model.encoder.language_model.layers.{m.group(1)}.layer_scalar"
    return DECODER_PREFIX + name


def find_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded via the index, or single)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
            why = str(e).splitlines()[0][:200] if str(e) else ""
            raise CheckpointError(f"{index} is malformed ({type(e).__name__}: {why}); re-download the "
                                  "checkpoint") from None
        except OSError as e:
            raise CheckpointError(f"could not read {index} ({e.strerror or e}); "
                                  f"{_READ_FIX.get(e.errno, 're-download the checkpoint')}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} is malformed (its weight_map must map tensor names to shard file names, got "
                                  f"{json.dumps(weight_map)[:80]}); re-download the checkpoint")
        files = sorted(set(weight_map.values()))
        for f in files:
            if PurePosixPath(f).is_absolute() or ".." in PurePosixPath(f).parts:
                raise CheckpointError(f"{index} names the shard {f!r}, outside {folder}; a checkpoint's shards sit in "
                                      "its own folder: the index is damaged (re-download it)")
        for f in files:
            _check_link(folder / f)
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{len(missing)} shard(s) listed in {index.name} are missing from {folder} "
                                  f"(first: {missing[0]}); finish the download")
        return [folder / f for f in files]
    single = folder / "model.safetensors"
    _check_link(single)
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    for p in others:
        _check_link(p)
    if others:
        return others
    pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles:
        raise CheckpointError(f"{folder} holds only pickle weights ({pickles[0]}); blockpress reads safetensors only "
                              "(pickle can run code). Convert with transformers: "
                              "model.save_pretrained(dir, safe_serialization=True)")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}; "
                          "point blockpress at a complete checkpoint folder")


# errno -> what to do about a checkpoint file that cannot be read
_READ_FIX = {errno.EACCES: "make it readable (chmod a+r) or load as its owner", errno.EPERM: "make it readable "
             "(chmod a+r) or load as its owner", errno.EIO: "the disk failed to read it: copy the checkpoint again"}


def _check_link(path: Path) -> None:
    """A symlink that loops (a -> b -> a) would read as "No such file": say what it is."""
    if not path.is_symlink():
        return
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        return  # dangling: "missing" is the right word, said by the caller
    except (RuntimeError, OSError) as e:  # RuntimeError: Python < 3.13's "Symlink loop"
        if isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP:
            raise CheckpointError(f"{path} is a symlink loop ({path.name} -> {os.readlink(path)} -> ...); point it "
                                  "at the real file, or re-download the checkpoint") from None
        raise


def vision_tensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The vision tower's tensors (VISION) in the checkpoint in `folder`, which the text-only engine leaves unloaded,
    the float ones in `dtype`: a save carries them, so that what it writes still holds the image input its
    config.json declares (transformers and vLLM would otherwise make a random tower)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    if not ((folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()):
        return out  # (a model built in memory, its `path` the tokenizer's folder: train/cli)
    for f in find_weight_files(folder):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for key in h.keys():
                    if key.startswith(VISION):
                        t = h.get_tensor(key)
                        out[key] = t.to(dtype) if t.is_floating_point() else t
        except (SafetensorError, OSError, ValueError) as e:
            raise _open_error(f, e) from None
    return out


def _open_error(f: Path, e: BaseException) -> CheckpointError:
    """Why safetensors could not open `f`: it reports every failure to open the file as "No such file or directory",
    so the file is opened here to name the real cause (no permission, a folder, a disk error); where it opens, it is
    not a valid safetensors file (truncated, a damaged header)."""
    try:
        with open(f, "rb"):
            pass
    except OSError as os_error:
        return CheckpointError(f"could not read {f} ({os_error.strerror or os_error}); "
                               f"{_READ_FIX.get(os_error.errno, 're-download the checkpoint')}")
    return CheckpointError(f"{f} is not a readable safetensors file ({e}); it may be truncated: re-download it")


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with huggingface_hub
        return None
    # disable=None: tqdm's own rule, drawn only on a terminal (a log or a pipe got every redraw's \r line)
    return tqdm(total=total, desc=desc, unit="tensor", disable=None if enabled else True, file=sys.stderr,
                leave=False)


def read_headers(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's stored dtype (safetensors' name: "BF16", "F8_E4M3", ...) and shape, from the headers of
    `files` (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                out.update({key: (h.get_slice(key).get_dtype(), h.get_slice(key).get_shape()) for key in h.keys()})
        except (SafetensorError, OSError, ValueError) as e:
            raise _open_error(f, e) from None
    return out


def load_weights(module: torch.nn.Module, files: list[Path], device, dtype, progress: bool = True,
                 on_loaded=None, layout=None) -> dict:
    """Assign every tensor of `files` into `module` (built on meta). Returns a small report.
    on_loaded(name): called after each tensor is in place (streaming quantisation hooks in here).
    layout: a pre-quantised checkpoint's quantised parts (model/prequantized.py `Layout`, already `prepare`d on the
    module): their tensors are copied into the quantised modules' buffers as stored."""
    from safetensors import safe_open
    from safetensors import SafetensorError

    expected = dict(module.named_parameters())
    expected.update({n: b for n, b in module.named_buffers() if not n.split(".")[-1].startswith("inv_freq")})
    loaded: set[str] = set()
    skipped_vision = 0
    unexpected: list[str] = []
    keys_per_file = []
    sums: list[tuple[str, torch.Tensor]] = []  # (key, fp32 sum): NaN or Inf when the tensor holds one
    seen_quantized: set[str] = set()
    first_file: dict[str, Path] = {}  # a tensor in two files: which one would win is an accident of their order
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                keys_per_file.append((f, list(h.keys())))
                for key in keys_per_file[-1][1]:
                    if first_file.setdefault(key, f) != f:
                        raise CheckpointError(f"{key} is in both {first_file[key].name} and {f.name}; a checkpoint "
                                              "holds each tensor once: remove the stray weight file (or "
                                              "re-download the checkpoint)")
                _refuse_prequantized(f, h, expected, layout.wanted if layout is not None else ())
        except (SafetensorError, OSError, ValueError) as e:
            raise _open_error(f, e) from None
    bar = _progress(sum(len(k) for _, k in keys_per_file), "loading weights", progress)
    for f, keys in keys_per_file:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for key in keys:
                    if bar is not None:
                        bar.update(1)
                    into = layout.target(key, module) if layout is not None else None
                    if into is not None:
                        name, index = into
                        seen_quantized.add(key)
                        if name is None:  # a packed weight's recorded [O, I]: checked, not stored
                            layout.check_shape(key, h.get_tensor(key), f.name)
                            continue
                        if expected[name].is_meta:  # a quantised buffer's first part: made once on the device
                            buf = torch.empty(expected[name].shape, dtype=expected[name].dtype, device=device)
                            _assign(module, name, buf)
                            expected[name] = buf
                        part = expected[name][index]
                        part.copy_(loaded_tensor(h.get_tensor(key), key, part, f.name))
                        sums.append((key, finite_probe(part)))
                        loaded.add(name)
                        continue
                    name = checkpoint_to_module_name(key)
                    if name is None:
                        if key.startswith(VISION):
                            skipped_vision += 1
                        elif not key.startswith(IGNORED_TIED):
                            unexpected.append(key)
                        continue
                    if name not in expected:
                        unexpected.append(key)
                        continue
                    target = expected[name]
                    shape = tuple(h.get_slice(key).get_shape())
                    if shape != tuple(target.shape):
                        raise CheckpointError(f"tensor {key} in {f.name} has shape {list(shape)}, expected "
                                              f"{list(target.shape)} from config.json; the config and weights "
                                              "do not belong together")
                    stored = h.get_slice(key).get_dtype()
                    if target.dtype.is_floating_point and stored not in FLOAT_DTYPES:
                        raise CheckpointError(f"tensor {key} in {f.name} is stored as {stored}, expected a "
                                              f"floating-point weight ({', '.join(sorted(FLOAT_DTYPES))}); the "
                                              "file is damaged (its header says an integer or bool type): "
                                              "re-download it")
                    t = h.get_tensor(key).to(device=device, dtype=dtype)
                    if t.is_floating_point():
                        sums.append((key, finite_probe(t)))
                    _assign(module, name, t)
                    loaded.add(name)
                    del t
                    if on_loaded is not None:
                        on_loaded(name)
        except SafetensorError as e:
            raise CheckpointError(f"{f.name} could not be read ({e}); the file may be truncated: re-download it") from None
    if bar is not None:
        bar.close()
    if layout is not None and layout.missing(seen_quantized):
        absent = layout.missing(seen_quantized)
        raise CheckpointError(f"{len(absent)} quantised tensor(s) missing from the checkpoint (first: {absent[0]}); "
                              "the download is incomplete or the experts are not stored one per expert")
    _check_finite(sums, files, dtype)
    missing = [n for n in expected if n not in loaded]
    # encoder layer scalars default to the decoder's copies (converters treat them as duplicates)
    fallback = [n for n in missing if n.endswith("encoder_layer_scalar") and n.replace("encoder_", "") in loaded]
    for n in fallback:
        _assign(module, n, dict(module.named_buffers())[n.replace("encoder_", "")].detach().clone())
    missing = [n for n in missing if n not in fallback]
    if missing:
        raise CheckpointError(f"{len(missing)} tensor(s) missing from the checkpoint (first: "
                              f"{module_to_checkpoint_name(missing[0])}); the download is incomplete or the "
                              "checkpoint is not a DiffusionGemma text model")
    if unexpected:
        print(f"blockpress: ignoring {len(unexpected)} unexpected tensor(s) (first: {unexpected[0]})", file=sys.stderr)
    if skipped_vision:
        print(f"blockpress: {skipped_vision} vision-tower tensors present and unused (text-only engine)",
              file=sys.stderr)
    return {"loaded": len(loaded), "vision_skipped": skipped_vision, "unexpected": unexpected,
            "encoder_scalars_from_decoder": len(fallback)}


def _refuse_prequantized(f: Path, h, expected: dict, layout_keys=()) -> None:
    """CheckpointError naming the first tensor of `f` (an open safetensors file) that only a pre-quantised checkpoint
    holds: a low-bit float weight, or a quantiser's scale / zero point / packed weight beside a weight (a name the
    model does not have: the router's own `scale` and `per_expert_scale` are weights). Tensors that are never read
    (tied copies, the vision tower) are not looked at; nor are `layout_keys`, the keys a pre-quantised layout reads."""
    for key in h.keys():
        name = checkpoint_to_module_name(key)
        if name is None or key in layout_keys:  # tied copies and the vision tower: never read; a layout's own tensors
            continue
        stored = h.get_slice(key).get_dtype()
        if LOW_BIT_FLOAT.match(stored):
            raise CheckpointError(f"{f.name} holds pre-quantised weights ({key} is stored as {stored}); "
                                  f"{PREQUANTIZED_FIX}")
        if QUANT_COMPANION.search(key) and name not in expected:
            raise CheckpointError(f"{f.name} holds pre-quantised weights (quantisation tensor {key}, {stored}); "
                                  f"{PREQUANTIZED_FIX}")


def _check_finite(sums: list[tuple[str, torch.Tensor]], files: list[Path], dtype) -> None:
    """Refuse weights with NaN or Inf values (a sum is finite only when every value is): they would make every
    generation fail later, far from the cause. One device sync for all tensors."""
    if not sums:
        return
    finite = torch.isfinite(torch.stack([s for _, s in sums])).tolist()
    bad = [key for (key, _), ok in zip(sums, finite) if not ok]
    if not bad:
        return
    from safetensors import safe_open

    stored_finite = True  # the value in the file itself, to tell a damaged file from an overflow of --dtype
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            if bad[0] in h.keys():
                stored_finite = bool(torch.isfinite(finite_probe(h.get_tensor(bad[0]))))
    what = f"{len(bad)} tensor(s) hold NaN or Inf values (first: {bad[0]})"
    if stored_finite:
        raise CheckpointError(f"{what} once cast to {str(dtype).removeprefix('torch.')}: the values overflow it; "
                              "load with dtype bfloat16 or float32 (--dtype)")
    raise CheckpointError(f"{what}; the checkpoint is damaged (a diverged training run, or a corrupt file): "
                          "re-download it, or resume training from an earlier checkpoint")


def _assign(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    owner = module
    for p in path:
        owner = getattr(owner, p)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=owner._parameters[leaf].requires_grad)
    else:
        owner._buffers[leaf] = tensor


def is_adapter_tensor(name: str) -> bool:
    """A LoRA adapter's parameter (train/lora.py attaches `lora_A` / `lora_B` to a projection), not the model's."""
    return ".lora_A." in name or ".lora_B." in name


def state_dict_for_checkpoint(module: torch.nn.Module, tensors: dict | None = None) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers under the checkpoint's names, on the CPU. tensors: the same names' values
    gathered elsewhere (a sharded training run's, train/distributed.py `full_tensors`) instead of the module's.
    Attached LoRA adapters' tensors are not the model's: `lm.save` passes their weights folded in as `tensors`."""
    named = {name: (tensors[name] if tensors is not None else t).detach()
             for name, t in list(module.named_parameters()) + list(module.named_buffers())
             if not name.split(".")[-1].startswith("inv_freq") and not is_adapter_tensor(name)}
    out = {}
    for name, t in named.items():
        quantized = checkpoint_entries(name, t, named.get(name.removesuffix("scale") + "q"))
        if quantized is not None:  # a quantised module's weight or scale: the pre-quantised layout (prequantized.py)
            out.update({k: v.cpu() for k, v in quantized.items()})
        else:
            out[module_to_checkpoint_name(name)] = t.contiguous().cpu()
    return out


def stored_dtype(sd: dict[str, torch.Tensor]) -> str | None:
    """The float type most of a state dict's values are stored in, as config.json's `dtype` names it ("bfloat16");
    None without float tensors."""
    return _most_elements((t.dtype, t.numel()) for t in sd.values())


def headers_dtype(headers: dict[str, tuple[str, list[int]]]) -> str | None:
    """`stored_dtype` of a checkpoint from its headers (`read_headers`), before any tensor is read."""
    return _most_elements((SAFETENSORS_FLOATS[d], math.prod(shape)) for d, shape in headers.values()
                          if d in SAFETENSORS_FLOATS)


def _most_elements(pairs) -> str | None:
    """The float dtype with the most elements among (dtype, elements) pairs; fp8 weights do not count (they are stored
    as such, not in the model's dtype)."""
    counts: dict[torch.dtype, int] = {}
    for dtype, n in pairs:
        if dtype.is_floating_point and dtype.itemsize > 1:
            counts[dtype] = counts.get(dtype, 0) + n
    return str(max(counts, key=counts.get)).removeprefix("torch.") if counts else None


# what a checkpoint or adapter folder holds (these files and sharded weights): an existing folder holding only such
# files is replaced by a save into it; one holding anything else (a model card a person wrote, too) is refused
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# what a save copies from the folder the model was loaded from: the tokenizer, what the model is for (a Sudoku
# model's blockpress_task.json) and the objective it was trained with (the trainer's blockpress_objective.json)
FOLDER_FILES = TOKENIZER_FILES + ("blockpress_task.json", "blockpress_objective.json")
CHECKPOINT_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json", *FOLDER_FILES,
    "adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "optimizer"})  # (a training checkpoint's)
_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")


SHARD_BYTES = 5 * 10 ** 9  # the Hub's convention (and under its 50 GB per-file limit): the 26B model in 11 bf16 files


def weight_files(sd: dict[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> dict:
    """The files that hold a state dict (checkpoint names, CPU tensors), for `write_atomic`: model.safetensors, or,
    past `shard_bytes`, shards of at most that many bytes (a tensor larger than that alone in one) named
    model-0000i-of-0000n.safetensors with model.safetensors.index.json mapping each tensor to its file."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n

    def writer(part):
        return lambda p: save_file(part, str(p), metadata={"format": "pt"})

    if len(shards) == 1:
        return {"model.safetensors": writer(shards[0])}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": {key: name for name, part in zip(names, shards) for key in part}}
    return {"model.safetensors.index.json": json.dumps(index, indent=2),
            **{name: writer(part) for name, part in zip(names, shards)}}


def _refuse_to_replace(folder: Path, files: dict) -> None:
    """CheckpointError unless `folder` is absent, or a folder that holds only checkpoint files (CHECKPOINT_FILES,
    weight shards, the files being written): a save must not delete a user's other files."""
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise CheckpointError(f"cannot save to {folder}: it is a file, not a folder; choose a new folder path "
                              "(nothing was written)")
    state = [n for n in ("trainer_state.pt", "optimizer") if (folder / n).exists()]
    if state:  # (the trainer clears a checkpoint of its own run before it writes that step again)
        raise CheckpointError(f"cannot save to {folder}: it is a training run's checkpoint ({' and '.join(state)}), "
                              "which a save there would leave without its training state (a resume would start "
                              "over); choose a new folder (nothing was written)")
    mine = {Path(rel).parts[0] for rel in files}
    other = sorted(p.name for p in folder.iterdir()
                   if p.name not in CHECKPOINT_FILES and p.name not in mine and not _SHARD.match(p.name))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise CheckpointError(f"cannot save to {folder}: it holds files that are not a checkpoint's ({shown}), which "
                              "saving there would delete; choose a new or empty folder (nothing was written)")
    try:
        here = Path.cwd().resolve()
    except OSError:  # the current directory was removed
        here = None
    if here is not None and (here == folder.resolve() or folder.resolve() in here.parents):
        raise CheckpointError(f"cannot save to {folder}: it holds the current directory, which the save would replace "
                              "(a shell there would be left in a removed folder); choose another folder (nothing was "
                              "written)")


def _readable(tmp: Path) -> None:
    """Give a written checkpoint the modes new files get (the umask), not the temp dir's owner-only 0700."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [tmp, *tmp.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def write_atomic(folder: Path, files: dict) -> None:
    """Write files into `folder` via a temp dir (`.NAME.*` beside it) + rename, so a failure never leaves a half
    checkpoint: the temp dir is removed whatever the failure. An existing `folder` is replaced only where it holds
    nothing but checkpoint files (`_refuse_to_replace`); a `folder` that is a symlink is written through: the folder
    it names is replaced, the link kept. A failure to write (no permission, a full disk, a file size
    limit) is a one-line CheckpointError, the existing checkpoint intact."""
    from safetensors import SafetensorError

    folder = Path(folder).expanduser().absolute()  # "." has a name to put the temp dir beside
    if folder.is_symlink():  # a link to a checkpoint folder: write into the folder it names, and keep the link
        try:
            folder = folder.resolve()
        except (RuntimeError, OSError):  # RuntimeError: Python < 3.13's "Symlink loop"
            raise CheckpointError(f"cannot save to {folder}: it is a symlink loop ({folder.name} -> "
                                  f"{os.readlink(folder)} -> ...); point it at a folder or remove it") from None
    _refuse_to_replace(folder, files)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as e:
        raise _write_error(folder, e) from e  # (the cause: train/trainer.py names it)
    try:
        for rel, data in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if callable(data):  # a writer that streams to the path (large tensors)
                data(p)
            elif isinstance(data, str):
                p.write_text(data)
            else:
                p.write_bytes(data)
        _readable(tmp)
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            os.replace(folder, old)
            try:
                os.replace(tmp, folder)
            except BaseException:
                os.replace(old, folder)  # the old checkpoint back under its name
                raise
            _rmtree(old)
        else:
            os.replace(tmp, folder)
    except BaseException as e:  # any writer's failure (torch: RuntimeError, safetensors: SafetensorError), Ctrl-C
        _rmtree(tmp)
        if isinstance(e, (OSError, SafetensorError)):
            raise _write_error(folder, e) from e
        raise


# errno -> what to do about it, for a failed write
_WRITE_FIX = {errno.ENOSPC: "free disk space or choose another path", errno.EDQUOT: "free disk space (a quota is "
              "full) or choose another path", errno.EFBIG: "a file is over this process's size limit (ulimit -f) or the "
              "file system's: raise the limit or choose another path", errno.EACCES: "choose a folder you can write to",
              errno.EPERM: "choose a folder you can write to", errno.EROFS: "the file system is read-only: choose "
              "another path"}


def _write_error(folder: Path, e: BaseException) -> CheckpointError:
    """The one-line CheckpointError for an OSError or a safetensors I/O error (which carries its errno only in its
    text) while saving to `folder`: what failed and what to do."""
    code = getattr(e, "errno", None)
    if code is None:
        m = re.search(r"\(os error (\d+)\)|\bcode: (\d+)", str(e))  # "... (os error 28)", older "Os { code: 28, ..."
        code = int(m.group(1) or m.group(2)) if m else None
    why = getattr(e, "strerror", None) or (os.strerror(code) if code is not None else
                                                  (str(e).splitlines() or [type(e).__name__])[0])
    if code in (errno.ENOTDIR, errno.EEXIST, errno.ENOENT):  # an ancestor is a file, or is not there
        above = next((p for p in folder.parents if p.exists() or p.is_symlink()), None)
        if above is not None and not above.is_dir():
            return CheckpointError(f"cannot save to {folder}: {above} is a file, not a folder; choose another path "
                                   "(nothing was written)")
    fix = _WRITE_FIX.get(code, "choose another path")
    return CheckpointError(f"could not write checkpoint to {folder} ({why}); {fix}; nothing was overwritten")


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)
