"""``python -m leto.titan.train``: torchtitan's entry point (``torchtitan.train.main``)
with ``LetoTrainer``, run under ``leto run`` in place of ``torchrun -m torchtitan.train``;
every torchtitan flag and ``--job.config_file`` work as there."""

from __future__ import annotations


def main() -> None:
    from torchtitan.train import main as titan_main

    from leto.titan.trainer import LetoTrainer

    titan_main(LetoTrainer)


if __name__ == "__main__":
    main()
