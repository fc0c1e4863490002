"""Two torchtitan runs, bit for bit: ``python compare.py DIR_A DIR_B`` (each a
``--job.dump_folder``) compares the newest checkpoint's every entry — parameters,
optimizer state, LR schedulers, data loader position, train state — and every step's
losses and gradient norm in the TensorBoard log (float32, as logged). Prints the first
difference and exits 1, or prints EXACT."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

TAGS = (
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "n_tokens_seen",
)


def checkpoint(dump: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    steps = sorted((dump / "checkpoint").glob("step-*"), key=lambda p: int(p.name[5:]))
    if not steps:
        raise FileNotFoundError(f"{dump / 'checkpoint'}: no step-* checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(steps[-1], Path(tmp) / "ckpt.pt")
        return {"step": steps[-1].name, **torch.load(Path(tmp) / "ckpt.pt", weights_only=False)}


def scalars(dump: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((dump / "tb").iterdir())
    if not runs:
        raise FileNotFoundError(f"{dump / 'tb'}: no TensorBoard run")
    ea = EventAccumulator(str(runs[-1]))
    ea.Reload()
    return {t: [(s.step, s.value) for s in ea.Scalars(t)] for t in TAGS}


def first_difference(a, b, path: str = "") -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: a tensor on one side only"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        x, y = (t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
        if not torch.equal(x, y):
            return f"{path}: bytes differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:4]} on one side only"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def compare(dir_a: Path, dir_b: Path) -> str | None:
    """The first difference between two runs' checkpoints and logs, or None."""
    return first_difference(scalars(dir_a), scalars(dir_b), "tensorboard") or first_difference(
        checkpoint(dir_a), checkpoint(dir_b), "checkpoint"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python compare.py DUMP_FOLDER_A DUMP_FOLDER_B")
    diff = compare(Path(sys.argv[1]), Path(sys.argv[2]))
    print(diff or "EXACT")
    sys.exit(1 if diff else 0)
