"""Test fixtures shared by the test suite: a tiny but real Gemma-4-like tokenizer, and a hand-driven server
worker (`drive_worker`).

Job: `build_tiny_gemma_tokenizer(dir)` writes `tokenizer.json`, `tokenizer_config.json` and
`chat_template.jinja` into a folder and returns the loaded `blockpress.tokenizer.Tokenizer`.

Invariants of the tiny tokenizer:
- Exactly `TINY_VOCAB_SIZE` (512) ids, so tiny test models with vocab_size 512 can use it.
- The Gemma 4 special tokens sit at their real ids (`<pad>`0 `<eos>`1 `<bos>`2 `<unk>`3 `<mask>`4
  `<|tool>`46 ... `<|turn>`105 `<turn|>`106, see `TINY_SPECIAL_TOKENS`), all marked special; "\\n"
  is id 107 as in the real vocabulary. The other ids hold plain tokens.
- Model: BPE with byte fallback (256 `<0xXX>` tokens, printable-ASCII single characters, and
  merges learned in-code from a fixed English text), decoder ByteFallback + Fuse, post-processor
  prepending `<bos>` when special tokens are requested: the same decode path as the real Gemma
  tokenizer. Spaces are kept as literal spaces (no SentencePiece "▁"), so every str round-trips
  exactly: `decode(encode(s)) == s`.
- Deterministic (same bytes on every call) and fast: the JSON is computed once per process.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import Counter
from pathlib import Path

from .chat import DEFAULT_GEMMA4_TEMPLATE
from .tokenizer import GEMMA4_SPECIAL_TOKENS, Tokenizer

__all__ = [
    "TINY_SPECIAL_TOKENS",
    "TINY_VOCAB_SIZE",
    "build_tiny_gemma_tokenizer",
    "cuda_graphs",
    "drive_worker",
    "tiny_tokenizer_json",
]

TINY_VOCAB_SIZE = 512
TINY_SPECIAL_TOKENS: dict[str, int] = {t: i for t, i in GEMMA4_SPECIAL_TOKENS.items() if i < TINY_VOCAB_SIZE}
_NEWLINE_ID = 107

_CORPUS = """
The sky is blue because the air scatters the short blue waves of sunlight more than the long red
ones. When the sun is low in the evening, the light travels through more of the air and the sky
turns red and orange. Water in the sea looks blue for a similar reason, and it also reflects the
color of the sky above it.
A model is a program that reads text and writes the next part of the text. It is trained on a
large amount of data, and then it can answer questions, write code, and call tools when the user
asks for help. The user sends a message, the model thinks about the question, and then it gives
an answer that should be short, clear and correct.
Here is a simple function in Python: def add(a, b): return a + b. It returns the sum of the two
numbers. You can call it with add(2, 3) and the result will be 5. Please tell me the weather in
Paris and in London today, and what time it is in Tokyo.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. There are
many things that we do not know yet, but we can learn them with time, care and good questions.
"""


def _learn_merges(n_new_tokens: int, alphabet: set[str]) -> list[tuple[str, str]]:
    """Greedy BPE on the corpus words (each word but the first carries its leading space)."""
    words: Counter[tuple[str, ...]] = Counter()
    for line in _CORPUS.strip().splitlines():
        for k, word in enumerate(line.split(" ")):
            if word:
                words[tuple((" " + word) if k else word)] += 1
    for w in words:
        assert set(w) <= alphabet, w
    merges: list[tuple[str, str]] = []
    known = set(alphabet)
    while len(merges) < n_new_tokens:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                if a + b not in known:
                    pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties lexicographic
        merges.append(best)
        known.add(best[0] + best[1])
        merged: Counter[tuple[str, ...]] = Counter()
        for w, c in words.items():
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    if len(merges) < n_new_tokens:
        raise RuntimeError("tiny tokenizer corpus too small for the requested vocabulary")
    return merges


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """The tiny tokenizer's tokenizer.json text (deterministic)."""
    chars = [chr(c) for c in range(0x20, 0x7F)]  # printable ASCII incl. space
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_fixed = len(TINY_SPECIAL_TOKENS) + 1 + len(chars) + len(byte_tokens)  # +1: "\n"
    merges = _learn_merges(TINY_VOCAB_SIZE - n_fixed, set(chars))
    plain = chars + byte_tokens + [a + b for a, b in merges]

    by_id = {i: t for t, i in TINY_SPECIAL_TOKENS.items()}
    by_id[_NEWLINE_ID] = "\n"
    vocab: dict[str, int] = {}
    it = iter(plain)
    for i in range(TINY_VOCAB_SIZE):
        vocab[by_id[i] if i in by_id else next(it)] = i
    assert len(vocab) == TINY_VOCAB_SIZE

    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t, i in sorted(TINY_SPECIAL_TOKENS.items(), key=lambda kv: kv[1])
    ]
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<bos>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [TINY_SPECIAL_TOKENS["<bos>"]], "tokens": ["<bos>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }
    return json.dumps(data, ensure_ascii=False, indent=1)


_TOKENIZER_CONFIG = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "padding_side": "left",
    "model_max_length": 1000000,
    "clean_up_tokenization_spaces": False,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def build_tiny_gemma_tokenizer(path_or_dir: str | Path) -> Tokenizer:
    """Write the tiny tokenizer files into a folder and load them.

    `path_or_dir` is a folder (created if missing) or a path ending in `tokenizer.json`, in which
    case its parent folder is used. Writes tokenizer.json, tokenizer_config.json and
    chat_template.jinja (the default Gemma 4 template).
    """
    path = Path(path_or_dir)
    folder = path.parent if path.name.endswith(".json") else path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json(), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG, indent=2), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(DEFAULT_GEMMA4_TEMPLATE, encoding="utf-8")
    return Tokenizer.from_dir(folder)


def decoder_logits_gap_vs_transformers(folder, ids, canvas) -> float:
    """Max |logit difference| between transformers 5.23 and blockpress (both fp32, eager) for one decoder pass
    over `canvas` [B,C] after encoding `ids` [B,S], both loading the checkpoint `folder`. Test helper."""
    import torch
    import transformers

    import blockpress

    from .kernels import use

    hf = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder)).eval()
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    bp = blockpress.load(folder, progress=False)
    use(bp.module, attention="eager")
    with torch.no_grad():
        cache = transformers.DynamicCache(config=hf.config.text_config)
        hf.model.encoder(input_ids=ids, past_key_values=cache)
        ref = hf(decoder_input_ids=canvas, past_key_values=cache).logits
        ours = bp.module.new_cache(ids.shape[0], ids.shape[1])
        bp.module.encode(ids, ours)
        got = bp.module.decode(canvas, ours)
    assert ref.shape == got.shape, (ref.shape, got.shape)
    return float((ref - got).abs().max())


def drive_worker(w, plan: dict) -> list[list[int]]:
    """Run a `blockpress.server.worker.Worker`'s loop by hand (no thread, so the schedule is deterministic):
    the jobs of plan[k] are submitted before canvas boundary k. Returns each job's generated tokens, in submission
    order; a job that does not end with RowDone fails the assertion with its last event."""
    import torch

    from .server.worker import RowCommit, RowDone

    handles, k = [], 0
    while k <= max(plan) or w.busy:
        handles += [w.submit(j) for j in plan.get(k, [])]
        with torch.no_grad():
            w.canvas()
        k += 1
    out = []
    for h in handles:
        events = h.drain()
        assert events and isinstance(events[-1], RowDone), events[-1:]
        out.append([t for e in events if isinstance(e, RowCommit) for t in e.tokens])
    return out


def count_logits_copies(monkeypatch) -> list:
    """Patch the CUDA-graph plumbing (`engine.graphs._set`) to record the shape of every [B, C, V] tensor copied into
    a captured pass's input buffer (the self-conditioning logits), leaving out a buffer handed back to itself (what
    `GraphedPasses.sc_buffer` is for). Returns the list it appends to."""
    import torch

    from .engine import graphs

    copies, real_set = [], graphs._set

    def counting_set(buf, value):
        if isinstance(value, torch.Tensor) and value.dim() == 3 and not (
                value.data_ptr() == buf.data_ptr() and value.shape == buf.shape):
            copies.append(tuple(value.shape))
        real_set(buf, value)

    monkeypatch.setattr(graphs, "_set", counting_set)
    return copies


def count_host_reads(monkeypatch, fn) -> int:
    """Calls that make a GPU's host wait for the device (a device value read on the host) or copy host data to it
    (torch.tensor), made while fn runs: counted on any device, so a CPU test can check a loop's synchronisation."""
    import torch

    count = {"n": 0}
    for name in ("__bool__", "__int__", "__float__", "item", "tolist", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            count["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    orig_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: count.__setitem__("n", count["n"] + 1) or orig_tensor(*a, **k))
    try:
        fn()
    finally:
        monkeypatch.undo()
    return count["n"]



@contextlib.contextmanager
def cuda_graphs(lm):
    """`lm` with CUDA graphs on for the block (on a CPU: the same passes and plumbing, without capture), then as it
    was; yields the graphed passes."""
    before = lm.options.cuda_graphs
    lm.configure(cuda_graphs=True)
    try:
        yield lm.passes
    finally:
        lm.configure(cuda_graphs=before)


def random_schema(rng, depth: int = 0) -> dict:
    """A random JSON Schema of the kinds structured output must handle: objects with required and optional
    properties (nested), arrays with length bounds, enums, integers and numbers with bounds, booleans, nulls,
    strings with length bounds, anyOf. `rng` is a `random.Random`; the same seed gives the same schema."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array", "anyOf"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 8)}
    if kind in ("integer", "number"):
        lo = rng.randint(-50, 50)
        return {"type": kind, "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "boolean":
        return {"type": rng.choice(["boolean", "null"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None, "a b"], rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "age", "tags", "score", "ok", "kind", "items", "meta", "note"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
