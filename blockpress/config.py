"""Configuration dataclasses built from a checkpoint's config.json and generation_config.json.

Invariants (spec section 1):
- Per-layer geometry is resolved once here: `layer_types[i]` is "sliding_attention" or
  "full_attention"; `layer_head_dim(i)` / `layer_kv_heads(i)` give each layer's head dim and KV
  heads (full layers: `global_head_dim`, `num_global_key_value_heads`; k = v, no v_proj).
- Both spellings of the per-layer overrides load: the raw `global_head_dim` /
  `num_global_key_value_heads` keys (released config.json) and an explicit `per_layer_config`
  (what transformers' save_pretrained writes).
- `sliding_window` holds the effective window: halved (W//2 + 1) when
  use_bidirectional_attention == "all"; `to_dict` writes back the stored form.
- Unknown keys are ignored; invalid values raise ConfigError naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, InputError, SamplingError, UnknownParameterError

SLIDING = "sliding_attention"
FULL = "full_attention"

DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}; fix config.json")
    return value


def _number(name: str, value: Any, lo: float = 0.0, hi: float | None = None) -> float:
    """A config field that must be a real number > lo (and <= hi)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > lo
    if not ok or (hi is not None and value > hi):
        bound = f"in ({lo}, {hi}]" if hi is not None else f"> {lo}"
        raise ConfigError(f"config field '{name}' must be a number {bound}, got {value!r}; fix config.json")
    return value


def _token_ids(name: str, value: Any) -> None:
    """A config field holding a token id, a list of them, or null."""
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"config field '{name}' must be a token id (an integer >= 0), a list of them or null, got "
                          f"{value!r}; fix config.json")


SAMPLER_CLASS = "EntropyBoundSamplerConfig"  # generation_config.json's sampler_config._cls_name: the one sampler
MAX_HEAD_DIM = 1 << 16  # a sanity bound for config.json; DiffusionGemma's heads are 256 and 512 wide


@dataclass
class TextConfig:
    """The text stack (encoder and decoder share it). Field names follow the HF config."""

    vocab_size: int = 262144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_ROPE)))
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int = 512
    layer_types: list[str] = field(default_factory=list)
    final_logit_softcapping: float | None = 30.0
    use_bidirectional_attention: str | None = None
    num_experts: int = 8
    top_k_experts: int = 2
    moe_intermediate_size: int = 64
    # resolved per-layer overrides: {layer_index: {"head_dim": .., "num_key_value_heads": ..}}
    per_layer_config: dict[int, dict[str, int]] = field(default_factory=dict)
    # the window as written in config.json (before halving); kept for round-trips
    _stored_sliding_window: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TextConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)} - {"per_layer_config", "_stored_sliding_window"}
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        # explicit nulls that mean something
        for k in ("num_global_key_value_heads", "use_bidirectional_attention", "pad_token_id",
                  "bos_token_id", "eos_token_id"):
            if k in d and d[k] is None:
                kwargs[k] = None
        if d.get("final_logit_softcapping", 30.0) is None:
            kwargs["final_logit_softcapping"] = None
        for k in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if d.get(k) is None and d.get("model_type") in ("diffusion_gemma_text", None) and k not in d:
                pass  # class defaults apply for hand-built configs
        cfg = cls(**kwargs)
        cfg._resolve(d.get("per_layer_config"))
        return cfg

    def _resolve(self, per_layer_config: dict | None) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                     "sliding_window", "num_experts", "top_k_experts", "moe_intermediate_size",
                     "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_global_key_value_heads is not None:
            _positive_int("num_global_key_value_heads", self.num_global_key_value_heads)
        if self.top_k_experts > self.num_experts:
            raise ConfigError(f"config field 'top_k_experts' ({self.top_k_experts}) exceeds 'num_experts' "
                              f"({self.num_experts}); fix config.json")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"config field 'hidden_activation' is {self.hidden_activation!r}; "
                              "DiffusionGemma uses 'gelu_pytorch_tanh'")
        if self.use_bidirectional_attention not in (None, "vision", "all"):
            raise ConfigError("config field 'use_bidirectional_attention' must be null, 'vision' or 'all', "
                              f"got {self.use_bidirectional_attention!r}")
        _number("rms_norm_eps", self.rms_norm_eps)
        if self.final_logit_softcapping is not None:
            _number("final_logit_softcapping", self.final_logit_softcapping)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            _token_ids(name, getattr(self, name))
        if self.attention_bias is not False:
            raise ConfigError(f"config field 'attention_bias' is {self.attention_bias!r}; DiffusionGemma's attention "
                              "has no biases (false)")
        # 1. window halving for fully bidirectional encoders
        self._stored_sliding_window = self.sliding_window
        if self.use_bidirectional_attention == "all":
            self.sliding_window = self.sliding_window // 2 + 1
        # 2. layer pattern; the last layer is always full attention
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        elif not isinstance(self.layer_types, list) or not all(isinstance(t, str) for t in self.layer_types):
            raise ConfigError(f"config field 'layer_types' must be a list of '{SLIDING}' / '{FULL}', one per layer, "
                              f"got {json.dumps(self.layer_types)[:80]}; fix config.json")
        else:
            self.layer_types = list(self.layer_types)
        if len(self.layer_types) != n:
            raise ConfigError(f"config field 'layer_types' has {len(self.layer_types)} entries but "
                              f"num_hidden_layers is {n}; make them agree")
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        if bad:
            raise ConfigError(f"config field 'layer_types' contains {bad}; allowed: '{SLIDING}', '{FULL}'")
        self.layer_types[-1] = FULL
        # 3. rope parameters per layer type
        rope = self.rope_parameters or {}
        if not isinstance(rope, dict) or not all(isinstance(v, dict) for v in rope.values()):
            raise ConfigError("config field 'rope_parameters' must map layer types to dicts; fix config.json")
        merged = json.loads(json.dumps(DEFAULT_ROPE))
        for t in (SLIDING, FULL):
            if t in rope:
                merged[t] = dict(rope[t])
            rt = merged[t].get("rope_type", "default")
            if rt not in ("default", "proportional"):
                raise ConfigError(f"config field 'rope_parameters.{t}.rope_type' is {rt!r}; "
                                  "supported: 'default', 'proportional'")
            _number(f"rope_parameters.{t}.rope_theta", merged[t].get("rope_theta", 10000.0), lo=1.0)
            if merged[t].get("factor") is not None:  # (0 or NaN made every logit NaN at the first draw)
                _number(f"rope_parameters.{t}.factor", merged[t]["factor"])
            if "partial_rotary_factor" in merged[t]:
                _number(f"rope_parameters.{t}.partial_rotary_factor", merged[t]["partial_rotary_factor"], hi=1.0)
                if rt == "default" and merged[t]["partial_rotary_factor"] != 1.0:  # it would be ignored here
                    raise ConfigError(f"config field 'rope_parameters.{t}.partial_rotary_factor' is "
                                      f"{merged[t]['partial_rotary_factor']} on 'default' RoPE, which rotates every "
                                      "dimension; use rope_type 'proportional' for a partial rotation, or drop it")
        self.rope_parameters = merged
        # 4. per-layer overrides: explicit per_layer_config wins; otherwise full layers get globals
        resolved: dict[int, dict[str, int]] = {}
        if per_layer_config is not None and not isinstance(per_layer_config, dict):
            raise ConfigError("config field 'per_layer_config' must map layer indices to dicts, got a "
                              f"{type(per_layer_config).__name__}; fix config.json")
        if per_layer_config is not None:  # given, even empty (transformers saves {} when no layer differs)
            for k, v in per_layer_config.items():
                try:
                    idx = int(k)
                except (TypeError, ValueError):
                    raise ConfigError(f"config field 'per_layer_config' has non-integer key {k!r}") from None
                if not 0 <= idx < n or not isinstance(v, dict):
                    raise ConfigError(f"config field 'per_layer_config.{k}' is invalid; keys must be layer "
                                      f"indices 0..{n - 1} mapping to dicts")
                resolved[idx] = {kk: _positive_int(f"per_layer_config.{k}.{kk}", vv) for kk, vv in v.items()
                                 if kk in ("head_dim", "num_key_value_heads")}
        else:
            for i, t in enumerate(self.layer_types):
                if t == FULL:
                    o = {"head_dim": self.global_head_dim}
                    if self.num_global_key_value_heads is not None:
                        o["num_key_value_heads"] = self.num_global_key_value_heads
                    resolved[i] = o
        self.per_layer_config = resolved
        for i in range(n):
            nh, kv, hd = self.num_attention_heads, self.layer_kv_heads(i), self.layer_head_dim(i)
            if nh % kv:
                raise ConfigError(f"layer {i}: num_attention_heads ({nh}) is not a multiple of its "
                                  f"num_key_value_heads ({kv}); fix config.json")
            if hd % 2:
                raise ConfigError(f"layer {i}: head_dim {hd} must be even for rotary embeddings")
            if hd > MAX_HEAD_DIM:  # (10^12 asked the allocator for 4 TB of rotary frequencies: its traceback)
                raise ConfigError(f"layer {i}: head_dim {hd} is past any attention head's (at most {MAX_HEAD_DIM}); "
                                  "fix config.json")
        # full layers of one model share a geometry (one rope table per layer type)
        for t in (SLIDING, FULL):
            dims = {self.layer_head_dim(i) for i in range(n) if self.layer_types[i] == t}
            if len(dims) > 1:
                raise ConfigError(f"layers of type {t} have different head dims {sorted(dims)}; unsupported")

    # per-layer geometry -------------------------------------------------------------------
    def layer_head_dim(self, i: int) -> int:
        return self.per_layer_config.get(i, {}).get("head_dim", self.head_dim)

    def layer_kv_heads(self, i: int) -> int:
        return self.per_layer_config.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)

    def is_full(self, i: int) -> bool:
        return self.layer_types[i] == FULL

    def type_head_dim(self, layer_type: str) -> int:
        for i, t in enumerate(self.layer_types):
            if t == layer_type:
                return self.layer_head_dim(i)
        return self.global_head_dim if layer_type == FULL else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("per_layer_config", "_stored_sliding_window", "global_head_dim",
                               "num_global_key_value_heads")}
        d["sliding_window"] = self._stored_sliding_window or self.sliding_window
        d["per_layer_config"] = {str(k): v for k, v in sorted(self.per_layer_config.items())}
        d["model_type"] = "diffusion_gemma_text"
        return json.loads(json.dumps(d))


@dataclass
class ModelConfig:
    """Top-level `diffusion_gemma` config: the text config plus canvas length and extras."""

    text: TextConfig
    canvas_length: int = 256
    tie_word_embeddings: bool = True
    eos_token_id: list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict)  # the original dict (vision config etc.)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must contain a JSON object")
        mt = d.get("model_type")
        if mt != "diffusion_gemma":
            raise ConfigError(f"config.json has model_type {mt!r}; blockpress loads 'diffusion_gemma' "
                              "checkpoints (e.g. google/diffusiongemma-26B-A4B-it)")
        tc = d.get("text_config")
        if tc is None:
            tc = {}
        if not isinstance(tc, dict):
            raise ConfigError("config field 'text_config' must be an object; fix config.json")
        text = TextConfig.from_dict(tc)
        canvas = _positive_int("canvas_length", d.get("canvas_length", 256))
        tie = d.get("tie_word_embeddings", True)
        if tie is False:
            raise ConfigError("config field 'tie_word_embeddings' is false; blockpress supports only tied "
                              "embeddings (as released)")
        eos = d.get("eos_token_id")
        return cls(text=text, canvas_length=canvas, tie_word_embeddings=True,
                   eos_token_id=_as_list(eos), raw=d)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(_read_json(Path(path), "config.json"))

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.raw.items() if k not in ("text_config",)}
        d.update({
            "model_type": "diffusion_gemma",
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "canvas_length": self.canvas_length,
            "tie_word_embeddings": True,
            "text_config": self.text.to_dict(),
        })
        if self.eos_token_id is not None:
            d["eos_token_id"] = self.eos_token_id
        d.setdefault("vision_config", None)
        return d


def _as_list(x) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, bool):
        raise ConfigError(f"token id must be an integer, got {x!r}")
    if isinstance(x, int):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        return list(x)
    raise ConfigError(f"token id field must be an int or a list of ints, got {x!r}")


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{what} not found at {path.absolute()}; point blockpress at a DiffusionGemma checkpoint "
                          "folder")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download or fix the file") from None
    except OSError as e:  # no permission, a disk error
        fix = "make it readable (chmod a+r) or load as its owner" if isinstance(e, PermissionError) else \
            "copy or download the checkpoint again"
        raise ConfigError(f"could not read {path} ({e.strerror or e}); {fix}") from None


# Generation parameters ---------------------------------------------------------------------------

# The smallest positive t_min / t_max: the step divides the logits by the temperature in fp32, and a smaller one
# (with the schedule's n / N on top) leaves fp32's range, so the probabilities become inf / nan. 1e-6 is already an
# argmax for any logit gap over ~1e-4.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest finite number: a temperature past it is inf there

REFERENCE_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 256,
    "max_denoising_steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "eos_token_id": None,
    "pad_token_id": None,
}


MAX_SEED = 2 ** 64 - 1  # the largest seed torch.Generator.manual_seed takes
MIN_SEED = -(2 ** 63)  # the smallest: torch reads a negative seed as seed + 2**64 (`torch_seed`)


def torch_seed(seed: int) -> int:
    """The seed in 0..MAX_SEED that `seed` (MIN_SEED..MAX_SEED) stands for: a negative one is seed + 2**64, as
    torch.Generator.manual_seed reads it. The server's choices count from it (choice i: seed + i), and the Python
    API and the CLI take the same range, so a seed a client sent replays anywhere."""
    return seed % (MAX_SEED + 1)


def reply_tokens(new_tokens: list[int], stop_ids, limit: int) -> tuple[list[int], str]:
    """What a generation returns as its reply: the new tokens up to (not including) the first stop id, at most
    `limit` of them (a generation runs whole canvases); and the finish reason, "stop" or "length"."""
    stops = set(stop_ids or ())
    for j, t in enumerate(new_tokens[:limit]):
        if t in stops:
            return new_tokens[:j], "stop"
    return new_tokens[:limit], "length"


# other libraries' names (OpenAI's, transformers' autoregressive ones) for what a generation here takes
OTHER_NAMES = {"steps": "max_denoising_steps (with stability_threshold=None, confidence_threshold=None: fixed steps)",
               "max_tokens": "max_new_tokens", "max_length": "max_new_tokens",
               "temperature": "the schedule t_min / t_max", "stop": "eos_token_id (token ids)"}


def fixed_steps(steps: int) -> dict[str, Any]:
    """The sampling keywords of the fixed-step mode (the CLI's and the API's `steps`, the chat eval's step columns):
    `steps` denoising passes every canvas, adaptive stopping off."""
    return {"max_denoising_steps": steps, "stability_threshold": None, "confidence_threshold": None}


STOPPING_KNOBS = ("stability_threshold", "confidence_threshold")  # what adaptive stopping reads; `steps` turns it off


def steps_sampling(steps: int, given, name=lambda k: k, steps_name: str = "steps") -> dict:
    """The sampling keywords of `steps` (`config.fixed_steps`: exactly that many steps a canvas, adaptive stopping
    off) for a call (the CLI's --steps, the server's `steps`) that also gave the knobs in `given`; one of
    `STOPPING_KNOBS` among them is an InputError, as `steps` would silently override it. `name` spells a knob
    as the caller's user wrote it."""
    clash = [name(k) for k in STOPPING_KNOBS if k in given]
    if clash:
        raise InputError(f"{steps_name} N runs exactly N steps a canvas (adaptive stopping off), which "
                         f"{' and '.join(clash)} would set; give one or the other")
    return fixed_steps(steps)


@dataclass
class GenerationConfig:
    """Sampling parameters of the denoising loop, validated once.

    t_min/t_max None → no temperature scaling; stability_threshold or confidence_threshold None →
    no adaptive stopping (always max_denoising_steps steps).
    """

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float | None = 0.4
    t_max: float | None = 0.8
    stability_threshold: int | None = 1
    confidence_threshold: float | None = 0.005
    eos_token_id: list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_checkpoint_dict(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Extract the diffusion parameters present (non-null) in a generation_config.json."""
        out: dict[str, Any] = {}
        for k in ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                  "confidence_threshold", "eos_token_id", "pad_token_id"):
            if d.get(k) is not None:
                out[k] = d[k]
        sc = d.get("sampler_config")
        if sc is not None and (not isinstance(sc, dict) or sc.get("_cls_name", SAMPLER_CLASS) != SAMPLER_CLASS):
            shown = sc.get("_cls_name") if isinstance(sc, dict) else sc
            raise ConfigError(f"generation_config.json's sampler_config is {shown!r}; blockpress runs the "
                              f"reference's one sampler, {SAMPLER_CLASS} (a dict with _cls_name and entropy_bound): "
                              "fix the file or delete it to use the reference defaults")
        if isinstance(sc, dict) and sc.get("entropy_bound") is not None:
            out["entropy_bound"] = sc["entropy_bound"]
        elif d.get("entropy_bound") is not None:
            out["entropy_bound"] = d["entropy_bound"]
        return out

    @classmethod
    def resolve(cls, checkpoint: dict[str, Any] | None = None, **overrides) -> "GenerationConfig":
        """Keyword overrides > checkpoint generation_config.json > reference defaults."""
        unknown = set(overrides) - set(REFERENCE_DEFAULTS)
        if unknown:
            hints = [f"{k!r} is {OTHER_NAMES[k]} here" for k in sorted(unknown) if k in OTHER_NAMES]
            raise UnknownParameterError(f"unknown generation parameter(s) {sorted(unknown)}"
                                        + (f" ({'; '.join(hints)})" if hints else "")
                                        + f"; valid: {sorted(REFERENCE_DEFAULTS)}")
        vals = dict(REFERENCE_DEFAULTS)
        vals.update(checkpoint or {})
        vals.update(overrides)
        cfg = cls(**vals)
        cfg.validate()
        return cfg

    def reply(self, new_tokens: list[int]) -> tuple[list[int], str]:
        """This generation's reply in `new_tokens` and its finish reason (`reply_tokens`: up to the first stop id,
        at most max_new_tokens)."""
        return reply_tokens(new_tokens, self.eos_token_id, self.max_new_tokens)

    def validate(self) -> None:
        def bad(name, rng, v):
            raise SamplingError(f"invalid {name}={v!r}: must be {rng}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            bad("max_new_tokens", "a positive integer", self.max_new_tokens)
        if isinstance(self.max_denoising_steps, bool) or not isinstance(self.max_denoising_steps, int) \
                or self.max_denoising_steps <= 0:
            bad("max_denoising_steps", "a positive integer", self.max_denoising_steps)
        if isinstance(self.entropy_bound, bool) or not isinstance(self.entropy_bound, (int, float)) \
                or not math.isfinite(self.entropy_bound) or self.entropy_bound <= 0:
            bad("entropy_bound", "a finite number > 0", self.entropy_bound)
        self.entropy_bound = float(self.entropy_bound)
        for name in ("t_min", "t_max"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                bad(name, "a finite number >= 0 (or None for no temperature schedule)", v)
            if v is not None and v > MAX_TEMPERATURE:
                bad(name, f"at most {MAX_TEMPERATURE:g}, fp32's largest number (past it the step's logits divide to "
                    "nan); a large temperature already draws uniformly", v)
            if v is not None and 0 < v < MIN_TEMPERATURE:
                bad(name, f"0 or at least {MIN_TEMPERATURE:g} (a smaller temperature divides the logits past fp32's "
                    f"range; {MIN_TEMPERATURE:g} already takes the argmax)", v)
        if (self.t_min is None) != (self.t_max is None):  # one None turned the whole schedule off, silently
            none, other = ("t_min", "t_max") if self.t_min is None else ("t_max", "t_min")
            raise SamplingError(f"invalid {none}=None with {other}={getattr(self, other)!r}: a temperature schedule "
                                f"needs both; give both numbers, or both None for no schedule")
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            bad("t_max", f"greater than t_min={self.t_min}", self.t_max)
        if self.t_min is not None and self.t_max is not None and self.t_min == 0 and self.t_max == 0:
            bad("t_max", "> 0", self.t_max)
        st = self.stability_threshold
        if st is not None and (isinstance(st, bool) or not isinstance(st, int) or st < 0):
            bad("stability_threshold", "an integer >= 0 (or None to disable early stopping)", st)
        ct = self.confidence_threshold
        if ct is not None and (isinstance(ct, bool) or not isinstance(ct, (int, float)) or not math.isfinite(ct) or ct <= 0):
            bad("confidence_threshold", "a number > 0 (or None to disable early stopping)", ct)
        try:
            self.eos_token_id = _as_list(self.eos_token_id)
        except ConfigError as e:
            raise SamplingError(f"invalid eos_token_id: {e}") from None
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
            bad("pad_token_id", "a non-negative integer or None", pad)

    def check_vocab(self, vocab_size: int) -> None:
        """eos/pad ids must be tokens of the model's vocabulary (an id past it never matches, and a pad id
        past it would be written into the sequence)."""
        from .errors import SamplingError

        for name, ids in (("eos_token_id", self.eos_token_id or []),
                          ("pad_token_id", [] if self.pad_token_id is None else [self.pad_token_id])):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise SamplingError(f"invalid {name}={bad[0]}: must be a token id in this model's vocabulary "
                                    f"[0, {vocab_size}) (or None)")

    @property
    def adaptive(self) -> bool:
        return self.stability_threshold is not None and self.confidence_threshold is not None
