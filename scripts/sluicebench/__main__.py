"""python3 -m sluicebench bench|bench-state|bench-latency|bench-tunnel|bench-idle-memory|profile|build-pgo|perf-split|bench-dwell [ARGS...]
(with scripts/ on sys.path). The scripts of those names call this with their own command name.
"""

from __future__ import annotations

import subprocess
import sys

from .procs import Failure, install_signal_handlers, log

COMMANDS = {"bench": "bench", "bench-state": "state", "bench-latency": "latency", "bench-tunnel": "tunnel",
            "bench-idle-memory": "idle_memory", "profile": "profile",
            "build-pgo": "pgo", "perf-split": "split", "bench-dwell": "dwell"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python3 -m sluicebench {{{'|'.join(COMMANDS)}}} [ARGS...]", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    module = __import__(f"sluicebench.{COMMANDS[name]}", fromlist=["main"])
    install_signal_handlers()
    try:
        return module.main(args)
    except Failure as e:
        log(name, f"error: {e}")
        return 1
    except subprocess.CalledProcessError as e:
        log(name, f"error: {' '.join(map(str, e.cmd))} exited with {e.returncode}")
        return 1
    except KeyboardInterrupt:
        log(name, "interrupted; everything it started is stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
