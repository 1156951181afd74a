"""Kernel settings timed on this machine's GPU (`blockpress tune`), used where none are asked for.

Why: how close a denoising step gets to the bandwidth floor depends on the Triton kernels' tiles, and the best tiles
depend on the card. The built-in defaults (`moe_grouped.default_tiles`, `linear_q.DEFAULT_LINEAR_TILES`,
`attention_fixed.tiles_for`) were chosen on one H100 (the fp8 experts' tiles alone took 2.6 ms off its step) or
from compiles alone; on another card, or another model's shapes, they are a guess. `blockpress tune`
(blockpress/lab/tune.py) times the candidates on the user's card for the model's own shapes and keeps the fastest
that agrees with the reference. A tuned setting only ever picks among variants of the same function (tiles, key
runs: the same numbers up to fp32 summation order), never a numeric format, so a tuned model computes what an
untuned one does.

What is kept, per device ("<name> sm_<major><minor>", e.g. "NVIDIA H100 80GB HBM3 sm_90") and per kernel and
shape (`experts_key`, `linears_key`, `attention_key`): the chosen value (a `moe_tiles`, `linear_tiles` or
`attention_tiles` spec), every candidate's time, and the torch / Triton versions and date of the run. Where: one JSON
file, `path()`: $BLOCKPRESS_TUNED, else $XDG_CACHE_HOME/blockpress/tuned.json (~/.cache/blockpress/tuned.json), as
{"blockpress_tuned": FORMAT, "devices": {device: {key: {"value": ..., "times_ms": ..., ...}}}};
BLOCKPRESS_TUNED=off turns the lookup off. `kernels.select.configure` asks `lookup` when an option was not given;
an option given (`moe_tiles=...`, `--moe-tiles`) always wins.

The file is only replaced whole (written beside it, then renamed), so a run cut off or a full disk leaves the old
one. A file not in that form is never overwritten (`store` refuses, naming the fix) and is ignored with a warning by
`lookup`, so a damaged cache cannot stop a model from loading.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from ..errors import InputError

FORMAT = 1  # the file's "blockpress_tuned" version
OFF = "off"


def path() -> Path | None:
    """The tuned-settings file (it may not exist yet); None when BLOCKPRESS_TUNED=off."""
    env = os.environ.get("BLOCKPRESS_TUNED")
    if env is not None and env.strip().lower() == OFF:
        return None
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "blockpress" / "tuned.json"


def device_key(device: torch.device) -> str:
    """The card a setting was timed on: CUDA's device name and compute capability; "cpu" elsewhere (Triton's
    interpreter: tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def experts_key(text, fmt: str, dtype: torch.dtype, group_size: int | None = None, mlp: bool = False) -> str:
    """The expert kernels' shape key: format ("native", "fp8", "fp8-a8" with fp8 activations, "int4" with its scale
    group), E experts, H, the intermediate width, top-k, the activation dtype. mlp: the dense MLP on the experts'
    kernels (`--linears int4-mlp`: one expert every token takes)."""
    E, Im, K = (1, text.intermediate_size, 1) if mlp else \
        (text.num_experts, text.moe_intermediate_size, text.top_k_experts)
    group = f" g={group_size}" if fmt == "int4" and group_size else ""
    return f"{'mlp' if mlp else 'experts'} {fmt}{group} E={E} H={text.hidden_size} I={Im} k={K} {_dtype(dtype)}"


def linears_key(text, fmt: str, dtype: torch.dtype) -> str:
    """The 8-bit projections' shape key: format ("int8", "fp8", "fp8-a8" with fp8 activations), the widths that
    set a pass's projection shapes (hidden, heads x head dims, KV heads, the dense MLP), the activation dtype."""
    dims = sorted({(text.layer_head_dim(i), text.layer_kv_heads(i)) for i in range(text.num_hidden_layers)})
    attn = ",".join(f"D{d}/kv{kv}" for d, kv in dims)
    return f"linears {fmt} H={text.hidden_size} heads={text.num_attention_heads} {attn} I={text.intermediate_size} " \
           f"{_dtype(dtype)}"


def attention_key(text, dtype: torch.dtype) -> str:
    """The attention kernel's shape key: per kind of layer its head dim, KV heads and count; query heads, window,
    dtype; its value is an attention tiles spec."""
    kinds = []
    for kind in ("sliding_attention", "full_attention"):
        ids = [i for i, t in enumerate(text.layer_types) if t == kind]
        if ids:
            kinds.append(f"{kind.split('_')[0]}=D{text.layer_head_dim(ids[0])}/kv{text.layer_kv_heads(ids[0])}"
                         f"x{len(ids)}")
    return f"attention-tiles heads={text.num_attention_heads} {' '.join(kinds)} window={text.sliding_window} " \
           f"{_dtype(dtype)}"


_CACHE: dict = {}  # path -> (mtime_ns, size, devices): the file read once per change


def _read(p: Path) -> dict:
    """{device: {key: entry}} of the file at p ({} when it does not exist); InputError naming the file and the fix
    when it is not a tuned-settings file."""
    try:
        st = p.stat()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise InputError(f"cannot read the tuned settings {p}: {e.strerror or e}") from None
    hit = _CACHE.get(p)
    if hit is not None and hit[:2] == (st.st_mtime_ns, st.st_size):
        return hit[2]
    fix = "delete it (blockpress tune writes it again) or set BLOCKPRESS_TUNED to another file"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"the tuned settings {p} are not readable JSON ({type(e).__name__}): {fix}") from None
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("blockpress_tuned") != FORMAT or not isinstance(devices, dict) or \
            not all(isinstance(v, dict) and all(isinstance(e, dict) and "value" in e for e in v.values())
                    for v in devices.values()):
        raise InputError(f"{p} is not a blockpress tuned-settings file (format {FORMAT}): {fix}")
    _CACHE[p] = (st.st_mtime_ns, st.st_size, devices)
    return devices


_WARNED: set = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"ignoring tuned kernel settings: {message}", stacklevel=3)


def lookup(device: torch.device, key: str, check=None):
    """The value tuned for `key` on this device, or None (none tuned, lookups off, or an unreadable file or a value
    `check` refuses with a ValueError / TypeError: warned once, then ignored)."""
    p = path()
    if p is None:
        return None
    try:
        devices = _read(p)
    except InputError as e:
        _warn_once(str(p), str(e))
        return None
    entry = devices.get(device_key(device), {}).get(key)
    if entry is None:
        return None
    if check is not None:
        try:
            check(entry["value"])
        except (ValueError, TypeError) as e:
            _warn_once(f"{p} {key}", f"{p} holds {entry['value']!r} for {key!r}: {e}; run blockpress tune again")
            return None
    return entry["value"]


def writable() -> Path:
    """The file `store` writes to, where it can: InputError (one line, the fix) when lookups are off or the file
    there is not a tuned-settings file (what `store` would refuse, asked before a long run)."""
    p = path()
    if p is None:
        raise InputError("BLOCKPRESS_TUNED=off: nothing is kept; unset it (or point it at a file) to keep tuned "
                         "settings")
    _read(p)
    return p


def store(device: torch.device, key: str, value, times: dict, **facts) -> Path:
    """Keep `value` (with every candidate's time in ms, `times`, and `facts`: what was measured) as this device's
    setting for `key`, replacing an older one; the other entries stay. Returns the file. InputError (one line) when
    lookups are off, the file is not a tuned-settings file, or it cannot be written; the old file is then as it
    was."""
    p = writable()
    devices = _read(p)
    entry = {"value": value, "times_ms": times, "torch": torch.__version__, **facts,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        from triton import __version__ as triton_version

        entry["triton"] = triton_version
    except ImportError:
        pass
    devices = {**devices, device_key(device): {**devices.get(device_key(device), {}), key: entry}}
    text = json.dumps({"blockpress_tuned": FORMAT, "devices": devices}, indent=1, sort_keys=True) + "\n"
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise InputError(f"cannot write the tuned settings {p}: {e.strerror or e} (the old file is unchanged)") \
            from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _CACHE.pop(p, None)
    return p
