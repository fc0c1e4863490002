"""The verifiers as a Leto plugin: ``leto run --verify`` (or ``LETO_PLUGINS`` naming
this module) makes every trainer record the verifiers' trace — each iteration's loss
and a digest of every retained tensor — through ``leto.plugins``' iteration observer,
so Leto never imports the verifiers. ``LETO_VERIFY_KEEP_TENSORS=1`` also saves the
tensors (a divergence then names its byte offset)."""

from __future__ import annotations

import os

from leto import plugins
from verifiers.recorder import ENV_KEEP, Recorder


def _observer(rank: int, out_dir):
    return Recorder(out_dir, rank, keep_tensors=os.environ.get(ENV_KEEP) == "1").record


plugins.install_iteration_observer(_observer)
