"""A tokenizer and a text dataset for torchtitan's debug models, made locally (no hub,
no download): ``python examples/titan/assets.py DIR`` writes ``DIR/tokenizer``
(``--hf_assets_path``) and ``DIR/data/data.json`` (``--dataloader.dataset_path``).

The tokenizer maps each byte to its own id (256 ids, then BOS and EOS: 258 < the debug
models' 2,048); the text is 400 documents of pseudo-random words, the same bytes on every
machine (a seeded generator), so two runs read the same tokens."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write(out: Path, documents: int = 400, seed: int = 0) -> None:
    from tokenizers import Tokenizer, models

    tok_dir, data_dir = out / "tokenizer", out / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {BOS: 256, EOS: 257}
    # No merges: every character falls back to its UTF-8 bytes.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    r = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(r.choice(letters) for _ in range(r.randint(2, 8))) for _ in range(500)]
    with open(data_dir / "data.json", "w") as f:
        for _ in range(documents):
            text = " ".join(r.choice(words) for _ in range(r.randint(50, 400)))
            f.write(json.dumps({"text": text}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/titan/assets.py DIR")
    write(Path(sys.argv[1]))
