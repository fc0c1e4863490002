"""torchtitan's Llama 3 debug model as a job faultkit strikes and the tests compare:
``debug_job.py --iterations N --seed S --out DIR [--plain] [torchtitan flags]``.

Under ``leto run`` it is torchtitan's entry point with ``LetoTrainer`` (as
``-m leto.titan.train``); ``--plain`` runs torchtitan's own ``Trainer`` (the torchrun
reference). The flags it adds: the local tokenizer and text of ``assets.py`` (made in
DIR), ``--training.steps N``, ``--debug.seed S`` with deterministic algorithms, a short
sequence, the loss logged every step to TensorBoard, and torchtitan's checkpoint of the
model and optimizer after the last step (DIR/titan/checkpoint/step-N): what the tests
compare, bit for bit. Later flags override these. On a machine without a GPU torchtitan
is shown the CPU as its device (``cpu.py``)."""

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def titan_flags(iterations: int, seed: int, out: Path) -> list[str]:
    return [
        "--model.hf_assets_path", str(out / "assets" / "tokenizer"),
        "--training.dataset_path", str(out / "assets" / "data"),
        "--training.steps", str(iterations),
        "--training.seq_len", "64" if not torch.cuda.is_available() else "512",
        "--training.local_batch_size", "2",
        "--lr_scheduler.warmup_steps", "2",
        "--debug.seed", str(seed), "--debug.deterministic",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
        "--checkpoint.enable", "--checkpoint.interval", str(iterations),
        "--checkpoint.no-last_save_model_only",
        "--job.dump_folder", str(out / "titan"),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out")
    ap.add_argument("--plain", action="store_true", help="torchtitan's Trainer (torchrun)")
    ap.add_argument(
        "--print-flags",
        action="store_true",
        help="make the assets, print the torchtitan flags (for -m torchtitan.train / "
        "-m leto.titan.train) and exit",
    )
    args, rest = ap.parse_known_args()
    out = Path(args.out).resolve()
    sys.path.insert(0, str(HERE))
    if not (out / "assets").exists():
        import assets  # the same bytes from any rank: the first to finish renames its own

        tmp = out / f"assets.{os.getpid()}"
        assets.write(tmp)
        try:
            tmp.rename(out / "assets")
        except OSError:
            shutil.rmtree(tmp)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files: no hub
    if args.print_flags:
        print(" ".join(titan_flags(args.iterations, args.seed, out)))
        return
    if not torch.cuda.is_available():
        import cpu  # noqa: F401  (before torchtitan)
    # torchtitan's parse_args() reads sys.argv[1:] as it was when torchtitan was imported.
    sys.argv = [sys.argv[0], *titan_flags(args.iterations, args.seed, out), *rest]
    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    if not args.plain:
        from leto.titan.trainer import LetoTrainer as Trainer
    titan_main(Trainer)


if __name__ == "__main__":
    main()
