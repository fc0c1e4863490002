"""The verifiers as a Leto plugin: ``leto run --verify`` (or ``LETO_PLUGINS`` naming
this module) makes every trainer record the verifiers' trace — each iteration's loss
and a digest of every retained tensor — through ``leto.plugins``' iteration observer,
so Leto never imports the verifiers. ``LETO_VERIFY_KEEP_TENSORS=1`` also saves the
tensors (a divergence then names its byte offset); ``LETO_VERIFY_SAVE_STATE=1`` saves
each rank's final state (full parameters, its optimizer shard) to
``rank{r}.state.pt`` when the loop is over (tests compare ZeRO-1 shards with it). A
restore from a checkpoint is marked (``EVENT_ROLLED_BACK``): records it superseded may
differ from the redone ones without counting as non-determinism."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from leto import plugins
from verifiers import digest
from verifiers.recorder import ENV_KEEP, ENV_SAVE_STATE, Recorder
from verifiers.trace import EVENT_ROLLED_BACK


class _Observer:
    def __init__(self, rank: int, out_dir):
        self.rank, self.out = rank, Path(out_dir)
        self.rec = Recorder(out_dir, rank, keep_tensors=os.environ.get(ENV_KEEP) == "1")
        if os.environ.get(ENV_SAVE_STATE) == "1":
            # Only then: Leto builds the final state (a CPU copy of every retained byte,
            # 80 GB and tens of seconds at 5 B parameters) for an observer with `final`.
            self.final = self._save_final

    def __call__(self, iteration, loss, tensors) -> None:
        self.rec.record(iteration, loss, tensors)

    def restored(self, iteration: int) -> None:
        self.rec.mark(EVENT_ROLLED_BACK, iteration)

    def _save_final(self, state: dict) -> None:
        tmp = self.out / f".rank{self.rank}.state.pt.tmp"
        torch.save(state, tmp)
        tmp.rename(self.out / f"rank{self.rank}.state.pt")  # whole, or not there


plugins.install_iteration_observer(_Observer)
# A promoted shadow's first record would otherwise allocate the pinned staging buffers
# (~0.3 s on the H200) inside the recovery being measured.
plugins.install_shadow_warmup(digest.prepare)
