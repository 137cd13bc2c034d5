"""Run a command beside CPU-bound processes, as CI's shared machines run it (issue 41).

    python scripts/beside_busy.py [--busy 2] [--runs 3] [--out FILE.json] -- make test

Starts ``--busy`` processes that each spin one core (pure Python, no threads of their own), runs the
command ``--runs`` times in a row while they spin (their pids in ``BESIDE_BUSY_PIDS``), stops them
(also on Ctrl-C or an error) and writes one JSON row per run: its exit status and wall time. Exits with the
first failing run's status, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SPIN = "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) % 2147483648\n"


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` spinning interpreters, each in a process group of its own."""
    return [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the command (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="times to run the command in a row (default 3)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here too")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        print("beside_busy: no command given: put it after --, e.g. -- make test", file=sys.stderr)
        return 2
    if args.busy < 0 or args.runs < 1:
        print(f"beside_busy: --busy {args.busy} / --runs {args.runs}: give --busy >= 0 and --runs >= 1",
              file=sys.stderr)
        return 2
    busy = start_busy(args.busy)
    env = dict(os.environ, BESIDE_BUSY_PIDS=",".join(str(p.pid) for p in busy))
    rows, status = [], 0
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            rc = subprocess.call(cmd, env=env)
            rows.append({"run": i, "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "busy": args.busy,
                         "command": " ".join(cmd)})
            print(f"[beside_busy] run {i}/{args.runs}: exit {rc} in {rows[-1]['wall_s']} s beside {args.busy} "
                  f"busy processes", flush=True)
            status = status or rc
    finally:
        stop_busy(busy)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
