"""A stand-in node for the stopping-order test: it writes its ready file at once and, on SIGTERM, notes the signal
in a shared file, takes half a second (as a worker withdrawing its records does), notes its exit and exits.

Usage: python -m tests.doubles.stop_recorder COMMAND NAME LOG --data-dir D --ready-file F
(COMMAND is the `moeswarm` command it stands in for: the swarm helper orders stops by it.)
"""

import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    _, name, log = argv[:3]
    ready = Path(argv[argv.index("--ready-file") + 1])

    def note(what: str) -> None:
        with open(log, "a") as f:
            f.write(f"{name} {what}\n")

    def on_term(*_: object) -> None:
        note("term")
        time.sleep(0.5)
        note("exit")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    ready.write_text("{}")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1:])
