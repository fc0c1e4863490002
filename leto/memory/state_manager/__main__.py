"""Entry point of the state-manager process.

    LETO_POOL_TOKEN=... python -m leto.memory.state_manager --socket-dir DIR --config JSON

The token comes from the environment, never from argv (argv is world-readable).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    ap.add_argument(
        "--lifeline-fd",
        type=int,
        help="read end of a pipe the launcher holds: EOF (the launcher died) stops the manager",
    )
    ap.add_argument(
        "--owns-dir",
        action="store_true",
        help="the socket directory was made for this manager: removed when it stops",
    )
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
    try:
        manager.serve(args.lifeline_fd)
    finally:
        if args.owns_dir:  # the launcher may be gone: nothing else would remove it
            shutil.rmtree(args.socket_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
