"""Synthetic tokens for nanoGPT's --dataset=synthetic, written where nanoGPT reads a
dataset: data/synthetic/{train,val}.bin (uint16 tokens) and meta.pkl (vocab_size), under
the current folder — as nanoGPT's data/*/prepare.py scripts do for real text. Not from
upstream: this repo's, for the tests and the CI's `faultkit certify` of the port.

    python prepare_synthetic.py [--vocab 64]
"""

import argparse
import os
import pickle

import numpy as np

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--vocab", type=int, default=64, help="vocabulary size")
args = ap.parse_args()
data = os.path.join("data", "synthetic")
os.makedirs(data, exist_ok=True)
rng = np.random.default_rng(0)
for split, n in (("train", 4096), ("val", 1024)):
    rng.integers(0, args.vocab, n, dtype=np.uint16).tofile(os.path.join(data, f"{split}.bin"))
with open(os.path.join(data, "meta.pkl"), "wb") as f:
    pickle.dump({"vocab_size": args.vocab}, f)
