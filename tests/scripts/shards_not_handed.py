"""``examples/porting/shards_leto.py`` with the one porting mistake ``faultkit certify``
must name: its hand-written loader not handed to ``leto.Run`` (no ``data=``), so a
recovered rank reads from shard 0 again."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "porting"))

from shards_leto import main  # noqa: E402

if __name__ == "__main__":
    main(hand_over=False)
