"""`load()`: a local checkpoint folder or a Hub id -> `BlockDiffusionLM`.

Hub ids are fetched with huggingface_hub (config, tokenizer, chat template and safetensors only;
with its progress bars). The module is built on the meta device and every tensor is assigned
once from the memory-mapped safetensors, converted straight to the target device and dtype.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import torch

from .config import GenerationConfig, ModelConfig, _read_json
from .errors import CheckpointError, ConfigError, InputError, SamplingError
from .lm import BlockDiffusionLM
from .model.diffusion_gemma import DiffusionGemmaModel
from .options import DTYPE_NAMES, Options
from .model.prequantized import PREQUANTIZED_FIX, Layout, recipe_fp8_activations, resolve_options, scheme_problem
from .model.weights import find_weight_files, load_weights, read_headers

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
HUB_NOTICE_SECONDS = 15.0  # a Hub fetch still without an answer after this long says so
DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}


ASSETS = Path(__file__).resolve().parent / "assets"
SHIPPED_MODELS = {"sudoku": ASSETS / "sudoku", "kjv": ASSETS / "kjv",  # name -> folder inside the package
                  "assistant": ASSETS / "assistant"}
DEFAULT_CHAT_MODEL = "assistant"  # `blockpress serve` / `blockpress chat` without a model: the shipped chat model


def resolve_path(model: str | Path, progress: bool = True, patterns=None) -> Path:
    """A folder as is (a training run's folder: the checkpoint its `latest` file names, `run_checkpoint`); a shipped
    model's name ('sudoku', 'kjv', 'assistant') when no such folder exists; otherwise a Hub id (owner/name)
    downloaded or found in the local HF cache (the files matching `patterns`, default `HUB_PATTERNS`: a model)."""
    if not isinstance(model, (str, Path)) or not str(model).strip():
        raise InputError(f"model must be a folder, a shipped model's name or a Hub id (a string or Path), got "
                         f"{model!r}")
    p = Path(model).expanduser()
    checkpoint = run_checkpoint(p)
    if checkpoint is not None:
        return checkpoint
    if p.is_dir():
        return p
    s = str(model)
    if p.exists():
        raise CheckpointError(f"{p} is a file; pass the checkpoint folder that holds config.json")
    if s in SHIPPED_MODELS:
        if not (SHIPPED_MODELS[s] / "config.json").is_file():
            raise CheckpointError(f"the shipped model '{s}' is not installed at {SHIPPED_MODELS[s]}; reinstall "
                                  "blockpress or pass a checkpoint folder")
        return SHIPPED_MODELS[s]
    if s.count("/") != 1 or s.startswith((".", "/", "~")):
        raise CheckpointError(f"{s} is neither a folder, a shipped model ({', '.join(SHIPPED_MODELS)}), nor a Hub id "
                              "like 'google/diffusiongemma-26B-A4B-it'")
    # huggingface_hub's first request has no timeout: a proxy or network that never answers waited in silence
    waiting = threading.Timer(HUB_NOTICE_SECONDS, lambda: print(
        f"blockpress: still fetching '{s}' from the Hugging Face Hub after {HUB_NOTICE_SECONDS:g} s (where no download "
        "moves, a network or proxy that does not answer: HF_HUB_OFFLINE=1 uses the local cache only; Ctrl-C stops)",
        file=sys.stderr, flush=True))
    waiting.daemon = True
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        (enable_progress_bars if progress else disable_progress_bars)()
        waiting.start()
        return Path(snapshot_download(s, allow_patterns=patterns or HUB_PATTERNS))
    except Exception as e:  # network, auth, missing repo: one clear line
        if isinstance(e, (NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)):
            raise CheckpointError(f"could not fetch '{s}': the Hugging Face cache cannot be used ({type(e).__name__}: "
                                  f"{e.filename or e}); point HF_HOME (or HF_HUB_CACHE) at a writable folder, or "
                                  "pass a local folder") from None
        if isinstance(e, FileNotFoundError) and getattr(constants, "HF_HUB_OFFLINE", False):  # LocalEntryNotFound
            var = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") or not os.environ.get("TRANSFORMERS_OFFLINE") \
                else "TRANSFORMERS_OFFLINE"
            raise CheckpointError(f"could not fetch '{s}': the Hugging Face Hub is in offline mode ({var}=1) and the "
                                  f"model is not in the local cache; unset {var} to download it, download it first "
                                  f"(hf download {s}), or pass a local folder") from None
        first = str(e).splitlines()[0].split(". ")[0][:200] if str(e) else ""  # its first sentence, whole
        raise CheckpointError(f"could not fetch '{s}' from the Hugging Face Hub ({type(e).__name__}: {first}); "
                              "check the id and network or pass a local folder") from None
    finally:
        waiting.cancel()


CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")  # a training run's checkpoint folders (train/trainer.py)


def run_checkpoint(p: Path) -> Path | None:
    """The checkpoint a training run's folder (or its `latest` file) stands for: the one `latest` names, or where
    there is no `latest` (a run copied without it), the newest `checkpoint-<step>` that holds a model or an adapter.
    None where `p` is not a run folder; CheckpointError where `latest` names a checkpoint that is not there."""
    if not (p.name == "latest" or (p.is_dir() and not (p / "config.json").exists())):
        return None
    run_dir = p if p.is_dir() else p.parent
    saved = [c for c in run_dir.glob("checkpoint-*") if CHECKPOINT_NAME.match(c.name) and c.is_dir()
             and ((c / "config.json").is_file() or (c / "adapter_config.json").is_file())]
    newest = max(saved, key=lambda c: int(CHECKPOINT_NAME.match(c.name).group(1)), default=None)
    latest = run_dir / "latest"
    name = _read_latest(latest) if latest.is_file() else ""
    if not name:
        return newest
    if name != Path(name).name or name in (".", ".."):  # the trainer writes a folder name, never a path
        raise CheckpointError(f"{latest} names {name!r}, not a checkpoint folder of {run_dir}; write the run's newest "
                              "checkpoint folder name into it (e.g. checkpoint-0001000) or pass that folder")
    if (run_dir / name).is_dir():
        return run_dir / name
    raise CheckpointError(f"{latest} names {name}, which is missing from {run_dir}; " + (
        f"pass its newest checkpoint ({newest}) or write {newest.name} into latest" if newest is not None else
        "the run holds no saved checkpoint: pass another folder"))


def _read_latest(latest: Path) -> str:
    """The checkpoint name a training run's `latest` file holds (the trainer writes e.g. 'checkpoint-0001000')."""
    try:
        return latest.read_text().strip()
    except (UnicodeDecodeError, OSError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or str(e)
        raise CheckpointError(f"could not read the checkpoint name in {latest} ({why}); write the run's newest "
                              "checkpoint folder name into it (e.g. checkpoint-0001000) or pass that folder") from None


def parse_device(device: str | torch.device | None) -> torch.device:
    """None -> $BLOCKPRESS_DEVICE when set, else cuda when available, else cpu; a device torch cannot use here is
    an InputError naming why."""
    source = ""
    if device is None:
        device = os.environ.get("BLOCKPRESS_DEVICE") or None
        if device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        source = " (from $BLOCKPRESS_DEVICE)"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}{source}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {str(device)!r}{source} asked for, but torch sees no CUDA GPU here "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); use device 'cpu', "
                             "or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible "
                             "(cuda:0 ...)")
    elif dev.type in ("mps", "xpu"):
        backend = getattr(torch.backends, "mps", None) if dev.type == "mps" else getattr(torch, "xpu", None)
        if backend is None or not backend.is_available():
            raise InputError(f"device {str(device)!r}{source} asked for, but torch sees no {dev.type.upper()} device "
                             f"here (torch {torch.__version__}, torch.{'backends.mps' if dev.type == 'mps' else 'xpu'}"
                             ".is_available() is False); use device 'cpu', or 'cuda' on a machine with a GPU")
    elif dev.type != "cpu":
        raise InputError(f"device {str(device)!r}{source}: blockpress runs on 'cpu' or 'cuda' (a model needs its "
                         "weights; 'meta' holds none)")
    return dev


def parse_dtype(dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32  # bf16 matmuls are slow on most CPUs
        stored = config.raw.get("dtype") or config.raw.get("torch_dtype") or "bfloat16"
        return DTYPES.get(str(stored), torch.bfloat16)
    return compute_dtype(dtype)


def compute_dtype(dtype) -> torch.dtype:
    """A dtype the model may compute in, given as a torch dtype or a name of `DTYPES` (load's dtype=, `to`, the
    CLI's --dtype); else a ConfigError. An 8-bit float (float8_e4m3fn) is a floating-point torch dtype but no
    compute type: it passed, and generating failed in torch ("mul_cpu_reduced_float not implemented")."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype {dtype!r} is not one the model computes in; use one of {sorted(DTYPES)} (8-bit weights: "
                      "precision='fp8' or 'int4', linears='int8')")


def _checkpoint_generation_defaults(path: Path, vocab_size: int) -> dict:
    """The sampler defaults a checkpoint's generation_config.json sets, validated once here so that a bad
    file is named at load time, not blamed on a later generate() call."""
    raw = _read_json(path, "generation_config.json")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must contain a JSON object; fix it or delete it to use the reference defaults")
    defaults = GenerationConfig.from_checkpoint_dict(raw)
    try:
        GenerationConfig.resolve(defaults).check_vocab(vocab_size)
    except SamplingError as e:
        raise ConfigError(f"{path}: {e}; fix it or delete it to use the reference defaults") from None
    return defaults


def estimated_weight_bytes(module, dtype: torch.dtype, precision: str = "native", group_size: int = 64,
                           linears: str = "native", embeddings: str = "native") -> int:
    """Bytes the weights of a (meta-device) module will take once loaded: expert tensors in fp8 (1 byte
    per weight + an fp32 scale per output row) or int4 (half a byte + a `dtype` scale per group, as
    kernels/quant.py stores them), attention / dense-MLP projections in 8 bits with linears="int8" / "fp8"
    (1 byte + an fp32 scale per row, kernels/linear_q.py), the dense MLP in int4 with linears="int4-mlp" (as the
    experts' int4), the embedding table in int8 with embeddings="int8" (1 byte + an fp32 scale per token),
    everything else in `dtype`."""
    from .kernels.linear_q import LINEAR_WEIGHT, QUANTIZED_LINEARS
    from .kernels.quant import group_for

    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, p in module.named_parameters():
        m = LINEAR_WEIGHT.search(name)
        if precision != "native" and ".experts." in name and p.dim() == 3:
            E, O, I = p.shape
            total += p.numel() + E * O * 4 if precision == "fp8" else \
                p.numel() // 2 + E * O * (I // group_for(I, group_size)) * item
        elif linears == "int4-mlp" and m is not None and m.group(2) == "mlp":
            O, I = p.shape
            total += p.numel() // 2 + O * (I // group_for(I, group_size)) * item
        elif linears not in ("native", "int4-mlp") and m is not None and m.group(3) in QUANTIZED_LINEARS[m.group(2)]:
            total += p.numel() + p.shape[0] * 4
        elif embeddings == "int8" and name == "embed_tokens.weight":
            total += p.numel() + p.shape[0] * 4
        else:
            total += p.numel() * item
    return total


def _free_bytes(device: torch.device) -> int | None:
    """Memory free for the weights on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def check_memory(module, device: torch.device, dtype: torch.dtype, precision: str, group_size: int,
                 linears: str = "native", embeddings: str = "native") -> None:
    """Refuse, before reading any weight, a load that cannot fit: name what it needs, what is free, and
    the precisions that would fit. BLOCKPRESS_SKIP_MEMORY_CHECK=1 skips it (e.g. with swap)."""
    if os.environ.get("BLOCKPRESS_SKIP_MEMORY_CHECK") == "1":
        return
    free = _free_bytes(device)
    need = estimated_weight_bytes(module, dtype, precision, group_size, linears, embeddings)
    if free is None or need <= free:
        return
    gib = 2 ** 30
    options = []
    for prec, lin in (("fp8", linears), ("int4", linears), ("int4", "int8")):
        if (prec, lin) != (precision, linears):
            n = estimated_weight_bytes(module, dtype, prec, group_size, lin, embeddings)
            options.append(f"precision {prec}" + (f" with {lin} linears" if lin != "native" else "")
                           + f" needs ~{n / gib:.1f} GiB" + (" (fits)" if n <= free else ""))
    if dtype.itemsize > 2:
        n = estimated_weight_bytes(module, torch.bfloat16, precision, group_size, linears, embeddings)
        options.append(f"dtype bfloat16 needs ~{n / gib:.1f} GiB" + (" (fits)" if n <= free else ""))
    raise InputError(f"the weights need ~{need / gib:.1f} GiB ({str(dtype).removeprefix('torch.')}, precision "
                     f"{precision}, linears {linears}) but {device} has {free / gib:.1f} GiB free; " + "; ".join(options)
                     + " (--precision / --linears / --dtype on the command line; BLOCKPRESS_SKIP_MEMORY_CHECK=1 to "
                     "try anyway)")


def load(model: str | Path, device: str | torch.device | None = None, dtype=None, progress: bool = True,
         tokenizer: bool = True, **options) -> BlockDiffusionLM:
    """Load a DiffusionGemma checkpoint (folder or Hub id) for generation.

    device: "cpu", "cuda", ... (default: $BLOCKPRESS_DEVICE, else cuda when available). dtype: "bfloat16",
    "float32", ... (default: float32 on CPU, the checkpoint's dtype on GPU).
    options (`blockpress.options.Options`, validated before any weight is read):
    - precision: "native", or "fp8" / "int4" expert weights (per-channel fp8; 4-bit with a scale per `group_size`
      inputs), quantised layer by layer while loading, so the float experts never exist all at once; attention,
      router, embeddings and norms stay in `dtype`. linears: "native", or "int8" / "fp8": the attention and
      dense-MLP projections in 8 bits (a scale per output row), quantised as each is read; with precision="int4"
      the 26B-A4B weights take ~15.3 GB, not ~17. int8 is the more accurate; fp8 can also run with fp8
      activations (experts="scaled_mm", Hopper / Ada). experts="w8a8" runs every fp8 weight (experts, projections)
      with fp8 activations in the Triton kernels (it needs one of them in fp8). embeddings: "native", or "int8":
      the embedding table (also the LM head) with a scale per token, 0.74 GB less on the 26B-A4B model.
    - experts / attention: the kernels. "auto" picks the fastest path that runs here (experts: the Triton kernel
      on a CUDA GPU, grouped GEMMs on a CPU; attention: SDPA with the KV heads grouped inside the kernel);
      "loop" / "sdpa" or "eager" are the plain references (the same function up to fp32 summation order).
    - cuda_graphs, compile, sampler, fuse_commit, compact_rows, sc_topk, moe_tiles, moe_sum, linear_tiles,
      merge_projections, attention_kernel, attention_tiles, attention_split: how generation runs (see
      blockpress/options.py); `lm.configure(...)` changes them later.
    """
    from .kernels import check_names
    from .kernels.quant import check_experts_precision, check_group_size, check_int4_sizes

    opts = Options().replace(**options)
    if opts.precision == "int4":
        check_group_size(opts.group_size)
    try:
        check_names(opts.experts, opts.attention, opts.linears)
    except ValueError as e:
        raise InputError(str(e)) from None
    folder = resolve_path(model, progress)
    _refuse_adapter_folder(folder, model)
    _refuse_unreadable_side_files(folder)
    config = ModelConfig.from_file(folder / "config.json")
    prequantized = _prequantized(folder, config.raw)
    files = find_weight_files(folder)
    with torch.device("meta"):
        module = DiffusionGemmaModel(config)
    layout = Layout()
    if prequantized:
        layout = Layout.read(read_headers(files), module)
        opts = opts.replace(**resolve_options(layout, opts))
    check_int4_sizes(config.text, opts.precision, opts.linears)
    try:
        check_experts_precision(opts.experts, opts.precision, opts.linears)
    except ValueError as e:
        raise InputError(str(e)) from None
    gen_path = folder / "generation_config.json"
    gen_defaults = _checkpoint_generation_defaults(gen_path, config.text.vocab_size) if gen_path.is_file() else {}
    tok = _read_tokenizer(folder, config.text.vocab_size) if tokenizer else None
    dev = parse_device(device)
    dt = parse_dtype(dtype, config, dev)
    check_memory(module, dev, dt, opts.precision, opts.group_size, opts.linears, opts.embeddings)
    if layout:
        layout.prepare(module, dt)
        hint = "; its recipe also quantises the activations to fp8 per token, which --fp8-activations (experts=" \
            "'w8a8') does for its fp8 experts and projections" \
            if recipe_fp8_activations(prequantized) and opts.experts != "w8a8" else ""
        print(f"blockpress: a pre-quantised checkpoint: {layout.describe()}, loaded as stored{hint}", file=sys.stderr)
    hooks = []
    if opts.precision != "native" and not layout.experts:
        from .kernels.quant import streaming_quantizer

        hooks.append(streaming_quantizer(module, opts.precision, opts.group_size))
    if opts.linears == "int4-mlp" and not layout.mlps:
        from .kernels.quant import mlp_streaming_quantizer

        hooks.append(mlp_streaming_quantizer(module, opts.group_size))
    elif opts.linears not in ("native", "int4-mlp") and not layout.linears:
        from .kernels.linear_q import linear_streaming_quantizer

        hooks.append(linear_streaming_quantizer(module, opts.linears))
    if opts.embeddings == "int8":
        from .kernels.linear_q import embedding_streaming_quantizer

        hooks.append(embedding_streaming_quantizer(module))
    on_loaded = None if not hooks else lambda name: [h(name) for h in hooks]
    load_weights(module, files, dev, dt, progress=progress, on_loaded=on_loaded, layout=layout or None)
    layout.finish(module)
    module.materialize_buffers(dev)
    module.eval()
    return BlockDiffusionLM(module, config, gen_defaults, tok, folder, options=opts)


def _read_tokenizer(folder: Path, vocab_size: int):
    """The folder's tokenizer (None without tokenizer.json), read before the weights; refused when it has ids past
    the model's embedding, which would fail in the middle of a generation."""
    if not (folder / "tokenizer.json").is_file():
        return None
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    if tok.vocab_size > vocab_size:
        raise CheckpointError(f"{folder / 'tokenizer.json'} has {tok.vocab_size} ids but the model's vocabulary is "
                              f"{vocab_size} (text_config.vocab_size); pair the weights with their own tokenizer")
    return tok


def _quant_method(qc) -> str:
    """A quantization_config's method as its file names it: 'fp8', 'compressed-tensors (nvfp4-pack-quantized)',
    'modelopt (NVFP4)', ..."""
    if not isinstance(qc, dict):
        return repr(qc)
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}  # ModelOpt's own file
    method = str(qc.get("quant_method") or "unnamed")
    detail = qc.get("quant_algo") or inner.get("quant_algo") or qc.get("format")
    return method + (f" ({detail})" if detail and str(detail) != method else "")


def _prequantized(folder: Path, raw: dict) -> dict | None:
    """config.json's (or its text_config's) quantization_config where it is a pre-quantised scheme blockpress reads
    (compressed-tensors fp8 by output channel, packed int4 / int8: model/prequantized.py), else None. CheckpointError
    before any weight is read for another scheme, or when the folder holds ModelOpt's hf_quant_config.json (the
    tensors' own check is in model/weights.py `load_weights`)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    qc = raw.get("quantization_config") or text.get("quantization_config")
    where = "config.json has a quantization_config"
    if not qc and (folder / "hf_quant_config.json").is_file():
        try:
            qc = _read_json(folder / "hf_quant_config.json", "hf_quant_config.json")
        except ConfigError:
            qc = {}
        qc = {"quant_method": "modelopt", **(qc if isinstance(qc, dict) else {})}
        where = "the folder holds hf_quant_config.json"
    if not qc:
        return None
    why = scheme_problem(qc)
    if why:
        raise CheckpointError(f"{folder} is a pre-quantised checkpoint ({where}, quant_method "
                              f"{_quant_method(qc)}) that blockpress cannot read ({why}); {PREQUANTIZED_FIX}")
    return qc


def _refuse_unreadable_side_files(folder: Path) -> None:
    """A file the folder may hold that is there but cannot be read (a broken link, as a Hub cache's missing blob
    leaves; a folder in its place) was read as absent: the reference's sampler instead of the checkpoint's, the
    built-in chat template instead of its own. CheckpointError naming it."""
    from .model.weights import FOLDER_FILES

    for name in ("generation_config.json", *FOLDER_FILES):
        f = folder / name
        if (f.exists() or f.is_symlink()) and not f.is_file():
            why = "a folder" if f.is_dir() else "a broken link"
            raise CheckpointError(f"{f} is {why}, not a file; restore it (re-download the checkpoint) or delete it")


def _refuse_adapter_folder(folder: Path, model) -> None:
    """A LoRA adapter (or a LoRA run's checkpoint) holds no model: say which flag takes it."""
    if (folder / "config.json").is_file() or not (folder / "adapter_config.json").is_file():
        return
    try:
        cfg = _read_json(folder / "adapter_config.json", "adapter_config.json")
    except ConfigError:
        cfg = {}
    base = (cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None) or "BASE_MODEL"
    raise CheckpointError(f"{model} holds a LoRA adapter (adapter_config.json), not a model; load its base model "
                          f"with the adapter: blockpress run {base} --adapter {model} (Python: "
                          "blockpress.train.lora.apply_adapter(lm, folder))")


# the kernels a model made from a config runs (training from scratch: autograd goes through the references), and
# what a resumed from-scratch run loads with, so its gradients are the uninterrupted run's bit for bit
SCRATCH_KERNELS = {"experts": "loop", "attention": "sdpa"}


def from_config(config: ModelConfig | dict, device="cpu", dtype=torch.float32, seed: int | None = None,
                init_std: float | None = None, scaled_qk: bool = False, **options) -> BlockDiffusionLM:
    """A randomly initialised model of a given architecture (training from scratch, benchmarks). It runs the
    reference kernels (experts "loop", attention "sdpa": autograd goes through them) unless options say otherwise.
    scaled_qk: start the query/key norm scales at D^-1/4 (`reset_parameters`; `blockpress train` does)."""
    if isinstance(config, dict):
        config = ModelConfig.from_dict(config)
    if seed is not None:
        torch.manual_seed(seed)
    device = parse_device(device)
    with torch.device(device):
        module = DiffusionGemmaModel(config).to(dtype)
    module.reset_parameters(init_std if init_std is not None else config.text.initializer_range, scaled_qk)
    module.eval()
    return BlockDiffusionLM(module, config, {}, options=Options(**SCRATCH_KERNELS).replace(**options))


__all__ = ["load", "from_config", "resolve_path"]
