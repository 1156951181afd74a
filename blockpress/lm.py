"""`BlockDiffusionLM`: what `blockpress.load()` returns — the module, its tokenizer, defaults and options.

It owns no math: generation is `engine.generate.stream` over `self.module`; generation
parameters resolve as keyword arguments > the checkpoint's generation_config.json > the
reference defaults, validated once into a `GenerationConfig`. How it runs (sampler, fused
commits, row compaction, CUDA graphs, compile, kernels) is `self.options`, set at load or by `configure`.
"""

from __future__ import annotations

import json
import numbers
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from .config import SAMPLER_CLASS, GenerationConfig, ModelConfig
from .engine import generate as engine
from .errors import ConfigError, InputError
from .options import Options

# files of a checkpoint folder that belong to its tokenizer


class BlockDiffusionLM:
    def __init__(self, module, config: ModelConfig, generation_defaults: dict[str, Any] | None = None,
                 tokenizer=None, path: Path | None = None, options: Options | None = None):
        self.module = module
        self.config = config
        self.generation_defaults = dict(generation_defaults or {})
        self.tokenizer = tokenizer
        self.path = path  # the folder whose tokenizer and task files a save copies (a training run points it elsewhere)
        self.weights_path = path  # the checkpoint the weights came from: what a save reads the unused tensors from
        self.options = Options()
        self.passes = module  # what the engine runs: the module's passes, or their CUDA graphs (`configure`)
        self._apply(None, (options or Options()).validate())

    def configure(self, **changes) -> Options:
        """Change how this model runs: the engine's options (sampler, fuse_commit, compact_rows, cuda_graphs,
        compile) and the kernels' (experts, attention, attention_kernel, attention_tiles, attention_split, sc_topk,
        moe_tiles, moe_sum, linear_tiles, merge_projections); see `blockpress.options`. Validated once, here. The
        storage precision (precision, group_size, linears, embeddings: `options.STORAGE_FIELDS`) is chosen at load:
        changing it here is an InputError (quantising is not undone, and the options would describe weights the model
        does not hold).
        Returns the new options."""
        from .options import STORAGE_FIELDS

        storage = {k: v for k, v in changes.items() if k in STORAGE_FIELDS and v != getattr(self.options, k)}
        if storage:
            asked = ", ".join(f"{k}={v!r}" for k, v in storage.items())
            raise InputError(f"configure({asked}): the storage precision is chosen at load; load the model again with "
                             f"{asked}")
        new = self.options.replace(**changes)
        self._apply(self.options, new)
        return new

    def _apply(self, old: Options | None, new: Options) -> None:
        from .engine.graphs import passes_for
        from .kernels.select import apply, host_syncs

        chosen = apply(self.module, old, new)
        changed = chosen is not None
        if old is None and changed and chosen.get("tuned"):  # at load: say where the settings come from, once
            from .kernels.tuned import path

            print(f"blockpress: kernel settings tuned on this device ({path()}): "
                  + ", ".join(f"{k} {v or '(the built-in ones)'}" for k, v in chosen["tuned"].items()),
                  file=sys.stderr)
        graphs = new.graphs_on(self.module.device, not host_syncs(self.module))
        try:
            self.passes = passes_for(self.module, self.passes, graphs, new.compile, changed)
        except ValueError as e:  # experts that read the host cannot be captured
            raise InputError(f"cuda_graphs: {e}. With the default kernels this means Triton is missing (pip "
                             "install triton), or the reference kernels were asked for: drop one of them") from None
        self.options = new

    # ------------------------------------------------------------------------------- properties
    @property
    def canvas_length(self) -> int:
        return self.config.canvas_length

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    def to(self, device=None, dtype=None) -> "BlockDiffusionLM":
        """Move the model to `device` and/or cast it to `dtype`. What `load` decides from the device and dtype is
        decided again: the kernels (`experts="auto"` and the rest) and the CUDA-graphs default; passes captured or
        buffers held for the old ones are dropped. Quantized weights keep their format, so a model loaded with
        precision, linears or embeddings other than "native" refuses a new dtype (load it again with that dtype)."""
        from .loading import compute_dtype, parse_device

        device = None if device is None else parse_device(device)  # one that torch cannot use here: InputError
        try:
            dtype = None if dtype is None else compute_dtype(dtype)
        except ConfigError as e:
            raise InputError(f"to(dtype={dtype!r}): {e}") from None
        quantized = [f"{k}={getattr(self.options, k)!r}" for k in ("precision", "linears", "embeddings")
                     if getattr(self.options, k) != "native"]
        if dtype is not None and dtype != self.dtype and quantized:
            raise InputError(f"to(dtype={dtype}): this model holds quantized weights ({', '.join(quantized)}), "
                             f"which a cast would corrupt; load it again with dtype={str(dtype)[6:]!r}")
        self.module.to(device=device, dtype=dtype)
        self.passes = self.module  # graphs and buffers of the old device or dtype are not reused
        self._apply(None, self.options)
        return self

    def generation_config(self, **overrides) -> GenerationConfig:
        """Keywords > the checkpoint's generation_config.json > the reference's defaults, validated (SamplingError)."""
        return GenerationConfig.resolve(self.generation_defaults, **overrides)

    def stop_ids(self) -> list[int]:
        """The checkpoint's eos ids, else the tokenizer's <eos> and end-of-turn <turn|>."""
        eos = self.generation_defaults.get("eos_token_id") or self.config.eos_token_id
        if eos:
            return [eos] if isinstance(eos, int) else list(eos)
        tok = self.tokenizer
        ids = [tok.eos_token_id, tok.token_to_id("<turn|>")] if tok is not None else []
        return [i for i in ids if i is not None]

    def text_defaults(self) -> dict[str, Any]:
        """Stop and pad ids for text generation (the CLI, the server) where the checkpoint does not set them."""
        out: dict[str, Any] = {}
        if not self.generation_defaults.get("eos_token_id"):
            out["eos_token_id"] = self.stop_ids() or None
        if self.generation_defaults.get("pad_token_id") is None:
            pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
            out["pad_token_id"] = pad if pad is not None else 0
        return out

    def chat_ban(self, tools=None) -> list[int] | None:
        """The tokens a chat turn that offers no tool may not write (`parsing.call_ban`: the opening of a tool call),
        as `suppress_tokens`; None for a plain text model or where tools are offered. One rule for `chat`,
        `generate_text`, `blockpress chat` and `blockpress run`, so a seeded turn is the server's."""
        from .parsing import call_ban

        return call_ban(self.tokenizer, tools) if self.tokenizer is not None and self.tokenizer.is_chat else None

    # ------------------------------------------------------------------------------- token API
    def _prepare(self, input_ids, attention_mask):
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise InputError(f"input_ids must hold integer token ids, got a {ids.dtype} tensor; tokenize the "
                                 "text (model.tokenizer.encode) or pass a torch.long tensor")
            if ids.dim() == 1:
                ids = ids[None]
            if ids.dim() != 2 or ids.shape[1] == 0:
                raise InputError(f"input_ids must be [batch, length] (or [length]) with at least one token, got shape "
                                 f"{list(input_ids.shape)}")
            return ids.long(), attention_mask
        if not input_ids:
            raise InputError("input_ids is empty; give at least one token")
        rows = [input_ids] if isinstance(input_ids[0], int) else list(input_ids)
        if any(len(r) == 0 for r in rows):
            raise InputError("a prompt in the batch is empty; give at least one token per row")
        bad = next((t for r in rows for t in r if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise InputError(f"input_ids must be integer token ids, got {bad!r}; tokenize the text "
                             "(model.tokenizer.encode) or pass lists of ints")
        width = max(len(r) for r in rows)
        pad = self.generation_defaults.get("pad_token_id", 0) or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):  # left padding, as the reference expects
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = True
        return ids, (mask if not bool(mask.all()) else attention_mask)

    def stream(self, input_ids, attention_mask=None, generator=None,
               cache=None, decoder_input_ids=None, self_conditioning_logits=None, drafts: bool = True,
               sampler: str | None = None, fixed_tokens=None, fuse_commit: bool | None = None,
               compact_rows: bool | None = None, json_schema=None, json_object: bool = False,
               regex: str | None = None, grammar: str | None = None, suppress_tokens=None, guarded_tokens=(),
               logit_bias: dict | list | None = None,
               **sampling) -> Iterator[engine.Draft | engine.Commit | engine.Finished]:
        """Yield a Draft after every denoising step, a Commit per canvas and a final Finished.
        fixed_tokens [B, L]: new-token positions held at given ids (-1 = free), see engine.stream.
        json_schema (a dict or JSON text) / json_object / regex / grammar (Lark): every row's new tokens form one
        valid output that ends with a stop id within max_new_tokens (engine/constraint.py; needs the
        `structured` extra). guarded_tokens: tokens a grammar writes only where the model's draft after them
        still fits it (engine/constraint.py Constraint).
        suppress_tokens: token ids no row's new tokens may hold (engine/constraint.py's TokenBan), where no grammar
        is given (a grammar allows only its own tokens).
        logit_bias: {token id: value} added to a row's logits (soft-capped) before the temperature, in every
        denoising step, as OpenAI's `logit_bias`: -100 bans a token, +100 forces it (a grammar still has the last
        word). One dict for every row, or a list with one (or None) per row.
        sampler / fuse_commit / compact_rows: this call's engine options (None: `self.options`'), see
        `blockpress.options` and engine.stream."""
        from .engine.constraint import grammar_kinds

        cfg = self.generation_config(**sampling)
        grammar = dict(json_schema=json_schema, json_object=json_object, regex=regex, grammar=grammar)
        if grammar_kinds(**grammar) and not cfg.eos_token_id:  # a grammar's output ends with a stop id
            eos = self._need_tokenizer().eos_token_id
            if eos is None:
                raise InputError("structured output needs a stop id: give eos_token_id=")
            cfg = self.generation_config(**{**sampling, "eos_token_id": [eos]})
        ids, mask = self._prepare(input_ids, attention_mask)
        call = {k: v for k, v in (("sampler", sampler), ("fuse_commit", fuse_commit),
                                  ("compact_rows", compact_rows)) if v is not None}
        options = self.options.replace(**call) if call else self.options
        return engine.stream(self.module, ids, cfg, self.canvas_length, attention_mask=mask, generator=generator,
                             cache=cache, decoder_input_ids=decoder_input_ids,
                             self_conditioning_logits=self_conditioning_logits, drafts=drafts,
                             fixed_tokens=fixed_tokens, options=options, passes=self.passes,
                             constraints=self.constraints(cfg, ids.shape[0], suppress_tokens, guarded_tokens,
                                                          **grammar), logit_bias=logit_bias)

    def constraints(self, cfg, rows: int, suppress_tokens=None, guarded=(), **grammar) -> list | None:
        """One fresh grammar state per row for `grammar` (json_schema / json_object / regex / grammar, see
        `stream`); else the ban of `suppress_tokens` for every row; None when neither is given."""
        from .engine.constraint import Constraint, TokenBan, grammar_for

        spec = grammar_for(**grammar)
        if spec is None and not suppress_tokens:
            return None
        first = TokenBan(suppress_tokens, self.module.text.vocab_size) if spec is None else \
            Constraint(spec, self._need_tokenizer(), cfg.eos_token_id, self.module.text.vocab_size,
                       cfg.max_new_tokens, guarded)
        return [first] + [first.clone() for _ in range(rows - 1)]  # compiled once; the other rows start from copies

    def generate(self, input_ids, attention_mask=None, generator=None, cache=None,
                 decoder_input_ids=None, self_conditioning_logits=None, sampler: str | None = None,
                 fixed_tokens=None, fuse_commit: bool | None = None, compact_rows: bool | None = None,
                 json_schema=None, json_object: bool = False, regex: str | None = None, grammar: str | None = None,
                 suppress_tokens=None, guarded_tokens=(), logit_bias: dict | list | None = None,
                 **sampling) -> engine.GenerationResult:
        """Generate canvases after `input_ids`. Keyword names and defaults follow the reference:
        max_new_tokens, max_denoising_steps, entropy_bound, t_min, t_max, stability_threshold,
        confidence_threshold, eos_token_id, pad_token_id. `generator`: None (torch's global RNG, the
        reference's draw order), a torch.Generator, or a list with one generator per row."""
        for ev in self.stream(input_ids, attention_mask, generator, cache, decoder_input_ids,
                              self_conditioning_logits, drafts=False, sampler=sampler, fixed_tokens=fixed_tokens,
                              fuse_commit=fuse_commit, compact_rows=compact_rows, json_schema=json_schema,
                              json_object=json_object, regex=regex, grammar=grammar,
                              suppress_tokens=suppress_tokens, guarded_tokens=guarded_tokens,
                              logit_bias=logit_bias, **sampling):
            if isinstance(ev, engine.Finished):
                return ev.result
        raise RuntimeError("generation ended without a result")  # unreachable

    # ------------------------------------------------------------------------------- text API
    def encode_chat(self, messages_or_prompt, enable_thinking: bool = False, tools=None,
                    chat: bool | None = None) -> list[int]:
        tok = self._need_tokenizer()
        if isinstance(messages_or_prompt, str):
            if chat is False or not getattr(tok, "chat_template", None) or (chat is None and not tok.is_chat):
                ids = tok.encode(messages_or_prompt)
                bos = tok.bos_token_id
                return ([bos] if bos is not None else []) + ids
            messages_or_prompt = [{"role": "user", "content": messages_or_prompt}]
        if not tok.is_chat:
            raise InputError("this model has no chat template (a plain text model); give a plain prompt string, "
                             "or add chat_template.jinja to its folder")
        return tok.apply_chat_template(messages_or_prompt, add_generation_prompt=True,
                                       enable_thinking=enable_thinking, tools=tools, tokenize=True)

    def decode_new(self, result: engine.GenerationResult, row: int = 0, skip_special_tokens: bool = True) -> str:
        """The text of row `row`'s reply: its new tokens up to the first stop id, at most max_new_tokens (the
        generation's own, `result.config`: a generation runs whole canvases)."""
        ids, _ = self._reply_ids(result, row)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _reply_ids(self, result: engine.GenerationResult, row: int = 0) -> tuple[list[int], str]:
        """(ids, finish reason) of row `row`'s reply (`GenerationConfig.reply`), padding dropped."""
        rows = result.new_tokens.shape[0]
        if isinstance(row, bool) or not isinstance(row, numbers.Integral) or not -rows <= row < rows:
            raise InputError(f"row {row!r} is not a row of this result (it has {rows}: 0 to {rows - 1})")
        self._need_tokenizer()
        cfg = result.config or self.generation_config()
        ids, reason = cfg.reply([int(i) for i in result.new_tokens[row].tolist()])
        return [t for t in ids if t != cfg.pad_token_id], reason

    def generate_text(self, messages_or_prompt, enable_thinking: bool = False, tools=None, seed: int | None = None,
                      **sampling) -> str:
        """Chat messages (or a plain prompt, rendered as one user turn when a chat template exists) -> text
        (special tokens dropped, so a thought channel runs into the answer: `chat` keeps them apart). `seed=` or
        `generator=` (not both) gives a private random stream."""
        return self.decode_new(self._reply(messages_or_prompt, enable_thinking, tools, seed, sampling))

    def chat(self, messages_or_prompt, enable_thinking: bool = False, tools=None, seed: int | None = None,
             **sampling):
        """Like `generate_text`, the reply read as the server reads it: a `parsing.ParsedOutput` with `.content`,
        `.reasoning` (the thought channel, or None), `.tool_calls` (`.name`, `.arguments`) and `.finish_reason`
        ("stop", "tool_calls", or "length" when no stop token came within max_new_tokens). Given no `tools`, the
        reply holds no tool call, as the server's (`parsing.call_ban`; suppress_tokens=None lifts the ban). Where a
        tool is `"strict": True` (OpenAI's field), the reply's calls name offered tools and a strict tool's
        arguments are valid against its parameters (engine/constraint.py `reply_grammar`; the structured extra); with
        an output grammar beside tools (json_schema=, regex=...), the reply is calls or an answer in that grammar."""
        from .parsing import parse_reply

        result = self._reply(messages_or_prompt, enable_thinking, tools, seed, sampling)
        return parse_reply(self.tokenizer, *self._reply_ids(result))

    def _reply(self, messages_or_prompt, enable_thinking, tools, seed, sampling) -> engine.GenerationResult:
        ids = self.encode_chat(messages_or_prompt, enable_thinking=enable_thinking, tools=tools)
        sampling = dict(sampling)
        gen = engine.seed_or_generator(seed, sampling.pop("generator", None), self.device)
        sampling = {**self.text_defaults(), **sampling}  # stop and pad ids where the checkpoint lacks them (as the CLI)
        if "suppress_tokens" not in sampling:  # a chat turn: no tool offered, no call
            sampling = {**sampling, "suppress_tokens": self.chat_ban(tools)}
        if self.tokenizer.is_chat:
            from .engine.constraint import grammar_for, reply_grammar

            asked = {k: sampling.pop(k) for k in ("json_schema", "json_object", "regex", "grammar") if k in sampling}
            output = grammar_for(**asked)
            rule = reply_grammar(self.tokenizer, tools, output_grammar=output)  # calls name offered tools
            sampling["grammar"], sampling["guarded_tokens"] = (output, ()) if rule is None else rule
        return self.generate([ids], generator=gen, **sampling)

    def infill(self, template: str, seed: int | None = None, **sampling):
        """Fill `[MASK]` (one token) / `[MASK:n]` holes in `template`, seeing the text on both sides; `seed=` or
        `generator=`, not both. Returns an `infill.InfillResult` (.text, .fills); see blockpress/infill.py."""
        from .infill import infill

        return infill(self, template, seed=seed, **sampling)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer (no tokenizer.json in its folder); pass token ids instead")
        return self.tokenizer

    # ------------------------------------------------------------------------------- saving
    def save(self, path: str | Path, tensors: dict | None = None, shard_bytes: int | None = None) -> Path:
        """Write a checkpoint transformers can load: config.json (its `dtype` the tensors' own), generation_config.json,
        the weights under checkpoint key names (model.safetensors, or shards with an index past `shard_bytes`), and
        the tokenizer files and blockpress_task.json of the folder it was loaded from, if any. A model with quantised
        experts or projections (fp8, int4, int8) is written in the pre-quantised layout that `load` reads back byte
        for byte (compressed-tensors' fp8 by output channel and packed int, model/prequantized.py). Atomic; an
        existing `path` is replaced only where it holds nothing but a checkpoint's files (else CheckpointError,
        nothing written).
        The float weights keep the tensors it loaded but does not run (a vision tower: read again from that folder),
        and generation_config.json that folder's keys, with this model's defaults over them. Attached LoRA adapters
        are saved folded into the weights (as `merge_lora` folds them; the model keeps them attached).
        tensors: the weights by module name when the module holds only a shard of them (a sharded training run).
        shard_bytes: past this many bytes of weights (default 5 GB, the Hub's convention), they go into files of at
        most that size with an index (model-0000i-of-0000n.safetensors, model.safetensors.index.json)."""
        from .model.prequantized import quantization_config
        from .model.weights import (FOLDER_FILES, SHARD_BYTES, state_dict_for_checkpoint, stored_dtype,
                                     vision_tensors, weight_files, write_atomic)
        from .train.lora import folded_tensors

        if isinstance(shard_bytes, float) and shard_bytes.is_integer():  # 5e9: a whole number, written as a float
            shard_bytes = int(shard_bytes)
        if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, numbers.Integral)
                                        or shard_bytes < 1):
            raise InputError(f"shard_bytes must be a whole number of bytes >= 1 (e.g. 5 * 10**9), got {shard_bytes!r}")
        path = Path(path).expanduser().absolute()
        source = Path(self.weights_path).resolve() if self.weights_path is not None else None
        if self.module.quantized_table is not None:
            raise InputError("this model holds its embedding table in int8 (embeddings='int8'), which no checkpoint "
                             "format blockpress writes holds; load it with embeddings='native' to save it (the "
                             "experts and projections may stay quantised)")
        sd = state_dict_for_checkpoint(self.module, tensors if tensors is not None else folded_tensors(self.module))
        if source is not None:
            sd.update(vision_tensors(source, self.module.dtype))
        config = self.config.to_dict()
        qc = quantization_config(self.module)
        if qc is not None:  # quantised experts / projections: the pre-quantised layout load reads back
            config["quantization_config"] = qc
        dtype = stored_dtype(sd)
        if dtype is not None:  # the tensors written, not the dtype of the checkpoint loaded (load(dtype=...) casts)
            config["dtype"] = dtype
            if "torch_dtype" in config:  # (transformers < 4.56's name)
                config["torch_dtype"] = dtype
        gen = {**_json_object(source / "generation_config.json" if source is not None else None),
               "_from_model_config": False, **self.generation_defaults}
        if "entropy_bound" in gen:
            gen["sampler_config"] = {"_cls_name": SAMPLER_CLASS, "entropy_bound": gen.pop("entropy_bound")}
        files: dict[str, Any] = {
            "config.json": json.dumps(config, indent=2),
            "generation_config.json": json.dumps(gen, indent=2),
            **weight_files(sd, shard_bytes or SHARD_BYTES),
        }
        if self.path is not None:
            for name in FOLDER_FILES:
                src = Path(self.path) / name
                if src.is_file():
                    files[name] = src.read_bytes()
        write_atomic(path, files)
        return path


def _json_object(path: Path | None) -> dict[str, Any]:
    """A JSON file's object, or {} where there is none to read (no file, not an object: `load` read it already)."""
    try:
        value = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
