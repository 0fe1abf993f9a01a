#!/usr/bin/env python3
"""The fault suite's summary line (ctest label `faults`, run last as Faults.Summary).

Reads the JSON lines the Faults* tests appended to <build>/faults.jsonl (tests/support/fault_record.h), prints
one line with the totals and exits non-zero when anything went wrong: a hang, an orphan process, a half-written
checkpoint, a fault without a clean error, an inexact resume, code run from a file, or no record at all."""
import json
import sys

FIELDS = ["injected", "clean", "hangs", "orphans", "half_written", "resumes", "exact_resumes", "code_executed"]


def main(path):
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        records = []
    total = {k: sum(r[k] for r in records) for k in FIELDS}
    print("fault suite: {} tests, {injected} faults injected, {clean} clean errors naming the right "
          "rank/parameter/file, {hangs} hangs, {orphans} orphans, {half_written} half-written checkpoints, "
          "bit-exact resumes {exact_resumes}/{resumes}, code executed from files: {code_executed}".format(
              len(records), **total))
    for r in records:
        if r["clean"] < r["injected"] or r["exact_resumes"] < r["resumes"]:
            print("  not clean: {}".format(json.dumps(r)))
    bad = (not records or total["hangs"] or total["orphans"] or total["half_written"] or total["code_executed"]
           or total["clean"] < total["injected"] or total["exact_resumes"] < total["resumes"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
