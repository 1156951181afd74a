"""Corpus and tokenizer for the shipped text model: the King James Bible from Debian's `bible-kjv`.

    sudo apt-get install bible-kjv          # public-domain text (1611) + the `bible` reader
    python scripts/prepare_kjv.py --out runs/kjv

Writes, under --out:
  train.txt        documents separated by blank lines (runs of consecutive verses of one chapter,
                   <= --doc-words words), the verse references stripped
  heldout.txt      every 50th document (never trained on; the infill eval reads it)
  tokenizer/       tokenizer.json (byte-level BPE, --vocab ids, trained on train.txt only) and
                   tokenizer_config.json (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, as blockpress
                   and transformers expect)

Then train (see blockpress/assets/README.md for the exact recipe of the shipped model):
    blockpress train runs/kjv/train.txt --tokenizer runs/kjv/tokenizer --size micro --out runs/kjv-model ...
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
HELDOUT_EVERY = 50


def read_verses(bible: str = "bible") -> list[tuple[str, str]]:
    """[(chapter key, verse text)] for Genesis 1:1 .. Revelation 22:21, via Debian's `bible` reader."""
    if shutil.which(bible) is None:
        sys.exit("the `bible` program is missing: install Debian's bible-kjv package "
                 "(apt-get install bible-kjv), or pass --bible PATH")
    out = subprocess.run([bible, "-f", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    verses = []
    for line in out.splitlines():
        m = re.match(r"^(\S+?\d+):(\d+) (.*)$", line)
        if m:
            verses.append((m.group(1), m.group(3).strip()))
    if len(verses) < 31000:
        sys.exit(f"expected the whole KJV (31,102 verses), read {len(verses)}; is bible-kjv-text installed?")
    return verses


def documents(verses: list[tuple[str, str]], max_words: int) -> list[str]:
    """Greedy runs of consecutive verses of one chapter, each at most max_words words (a longer verse alone)."""
    docs, cur, key, words = [], [], None, 0
    for k, v in verses:
        n = len(v.split())
        if cur and (k != key or words + n > max_words):
            docs.append(" ".join(cur))
            cur, words = [], 0
        cur.append(v)
        key, words = k, words + n
    if cur:
        docs.append(" ".join(cur))
    return docs


def train_tokenizer(texts: list[str], vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>",
        "mask_token": "<mask>", "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/kjv")
    ap.add_argument("--doc-words", type=int, default=80, help="words per training document (at most)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--bible", default="bible", help="path of Debian's `bible` reader")
    args = ap.parse_args(argv)
    out = Path(args.out)
    verses = read_verses(args.bible)
    docs = documents(verses, args.doc_words)
    held = docs[HELDOUT_EVERY - 1::HELDOUT_EVERY]
    train = [d for i, d in enumerate(docs) if (i + 1) % HELDOUT_EVERY]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n\n".join(train) + "\n")
    (out / "heldout.txt").write_text("\n\n".join(held) + "\n")
    train_tokenizer(train, args.vocab, out / "tokenizer")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    n_tok = sum(len(tok.encode(d).ids) for d in train)
    print(f"{len(verses)} verses -> {len(train)} training documents ({n_tok:,} tokens, "
          f"{n_tok / len(train):.0f} per document) + {len(held)} held out; vocab {tok.get_vocab_size()}; "
          f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
