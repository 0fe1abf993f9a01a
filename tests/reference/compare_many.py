#!/usr/bin/python3
"""Runs many compare_states.py and compare_optim_states.py checks in one process: the parity suites check every
strategy and backend against one PyTorch run, and a python3 process per check spent most of its time importing
torch.

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage: compare_many.py JOBS.json
  JOBS.json: [{"tool": "states" | "optim", "args": [the tool's own arguments]}, ...]
Prints one JSON line per job, in order: {"job": i, "status": the tool's exit status, "output": what it printed}.
Exit status: 0 if every job's status is 0, 1 otherwise, 2 when JOBS.json cannot be read.
"""
import contextlib
import io
import json
import sys
import traceback

import compare_optim_states
import compare_states

TOOLS = {"states": compare_states.main, "optim": compare_optim_states.main}


def run(job):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = TOOLS[job["tool"]](job["args"])
        except SystemExit as e:  # argparse's errors, as the tool alone would exit
            status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001  e.g. torch.load of a missing file: this check fails, the others run
            traceback.print_exc(file=out)
            status = 1
    return status, out.getvalue()


def main(argv):
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            jobs = json.load(f)
        unknown = [j.get("tool") for j in jobs if j.get("tool") not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; allowed: {sorted(TOOLS)}")
    except (OSError, ValueError, AttributeError) as e:
        print(f"compare_many.py: cannot read jobs from {argv[0]!r}: {e}", file=sys.stderr)
        return 2
    failed = 0
    for i, job in enumerate(jobs):
        status, output = run(job)
        failed += status != 0
        print(json.dumps({"job": i, "status": status, "output": output}), flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
