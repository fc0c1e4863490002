"""``examples/porting/shards_leto.py`` with two of llm.c's porting traps: its hand-written
loader not handed to ``leto.Run`` (no ``data=``), so a recovered rank reads from shard 0
again — the divergence ``faultkit certify`` must name — and its log opened with ``"w"``
once its set-up begins, as llm.c's ``train_gpt.py`` does, which a promoted trainer's
set-up empties: certify must list the file."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "porting"))

from shards_leto import main  # noqa: E402

import leto  # noqa: E402

_init = leto.init


def _init_then_log(*args, **kwargs):
    ctx = _init(*args, **kwargs)
    with open(f"train{ctx.rank}.log", "w") as log:  # llm.c: open(args.output_dir/..., "w")
        log.write(f"rank {ctx.rank}: training starts\n")
    return ctx


leto.init = _init_then_log

if __name__ == "__main__":
    main(hand_over=False)
