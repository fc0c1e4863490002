"""Entry point of the state-manager process.

    LETO_POOL_TOKEN=... python -m leto.memory.state_manager --socket-dir DIR --config JSON

The token comes from the environment, never from argv (argv is world-readable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from leto.memory.config import ENV_POOL_TOKEN, PoolConfig
from leto.memory.state_manager.server import StateManager


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m leto.memory.state_manager", description="Leto state manager"
    )
    ap.add_argument(
        "--socket-dir", required=True, help="private directory (mode 0700) for the socket"
    )
    ap.add_argument("--config", default="{}", help="PoolConfig fields as JSON")
    args = ap.parse_args(argv)
    token = os.environ.get(ENV_POOL_TOKEN)
    if not token:
        print(
            f"state manager: {ENV_POOL_TOKEN} is not set; refusing to start without a job token",
            file=sys.stderr,
        )
        return 2
    manager = StateManager(
        PoolConfig.from_dict(json.loads(args.config)), Path(args.socket_dir), token
    )
    print("READY", flush=True)  # the launcher waits for this line
    manager.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
