"""The assistant's own small tokenizer: byte-level BPE with every Gemma 4 special token.

Invariants:
- Every string of `GEMMA4_CONTROL_TOKENS` is an added special token (so the chat template's markers are
  single ids, never split); those with a real Gemma 4 id below the vocabulary size sit at that id
  (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4, `<|tool>` 46 ... `<|turn>` 105, `<turn|>` 106);
  the image / audio / video ones take the lowest free ids.
- Digits are split one per token (`Digits(individual_digits=True)` before the byte-level split), so
  numbers are written digit by digit: arithmetic and copying numbers do not depend on learned merges.
- Byte-level: `decode(encode(s)) == s` for any text (special-token text included).
- The merges are learned from the training conversations with the special tokens removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ...chat import DEFAULT_GEMMA4_TEMPLATE
from ...tokenizer import GEMMA4_CONTROL_TOKENS, GEMMA4_SPECIAL_TOKENS

TOKENIZER_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                    "mask_token": "<mask>", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
                    "tokenizer_class": "PreTrainedTokenizerFast"}


def special_ids(vocab_size: int) -> dict[str, int]:
    """Special token -> id: the real Gemma 4 id when it fits, else the lowest id not taken."""
    fixed = {t: i for t, i in GEMMA4_SPECIAL_TOKENS.items() if i < vocab_size}
    free = (i for i in range(vocab_size) if i not in fixed.values())
    return {t: fixed[t] if t in fixed else next(free) for t in GEMMA4_CONTROL_TOKENS}


def _strip_specials(text: str) -> str:
    for t in sorted(GEMMA4_CONTROL_TOKENS, key=len, reverse=True):
        text = text.replace(t, "\n")
    return text


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path) -> None:
    """Learn the BPE on `texts` and write tokenizer.json, tokenizer_config.json, chat_template.jinja to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = special_ids(vocab_size)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((_strip_specials(t) for t in texts), trainer)
    data = json.loads(tok.to_str())
    # move the special tokens to their ids: the trainer put them first, in list order
    vocab = data["model"]["vocab"]
    plain = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in specials]
    taken = set(specials.values())
    free = (i for i in range(len(vocab)) if i not in taken)
    data["model"]["vocab"] = {**{t: specials[t] for t in specials}, **{t: next(free) for t in plain}}
    for a in data["added_tokens"]:
        a["id"] = specials[a["content"]]
    data["added_tokens"].sort(key=lambda a: a["id"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(DEFAULT_GEMMA4_TEMPLATE, encoding="utf-8")
    check = Tokenizer.from_file(str(out / "tokenizer.json"))
    for t, i in specials.items():
        assert check.token_to_id(t) == i, (t, check.token_to_id(t), i)
