#!/usr/bin/python3
"""Writes the byte-level token data set of a text data spec as a data file, for comparing gradsync's C++
tokeniser with the reference bit for bit.

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage:
  text_tokens.py --data SPEC --context T --out FILE

  --data      fortunes | fortunes:train | fortunes:test | text:PATH | text-test:PATH
              (fortunes reads $GRADSYNC_FORTUNES_DIR if set and non-empty, else /usr/share/games/fortunes)
  --context   T > 0, the sequence length (a gpt model's context)
  --out       torch.save({"inputs": int64 [S, T], "targets": int64 [S, T]}), exactly the tensors that
              torch_train.py --data SPEC trains a gpt:256-T-D-L-H model on (torch_train.load_text_tokens;
              the recipe is in torch_train.py's docstring, "Token data"): inputs padded with 0, targets
              padded with -100.

Prints one JSON line: {"data": SPEC, "context": T, "sequences": S, "valid_targets": number of targets
that are not -100}. Exit status: 0 success; 2 bad arguments or inputs (message on stderr).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import IGNORE, UsageError, is_token_spec, load_text_tokens  # noqa: E402

PROG = "text_tokens.py"


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, metavar="SPEC",
                   help="fortunes[:train|:test] | text:PATH | text-test:PATH")
    p.add_argument("--context", type=int, required=True, metavar="T", help="sequence length (> 0)")
    p.add_argument("--out", required=True, metavar="FILE", help="data file to write")
    args = p.parse_args(argv)
    if args.context <= 0:
        p.error(f"--context must be > 0, got {args.context}")
    if not is_token_spec(args.data):
        p.error(f"--data {args.data!r} is not a text spec; expected fortunes[:train|:test], text:PATH or "
                f"text-test:PATH")
    try:
        X, Y = load_text_tokens(args.data, 256, args.context)
        try:
            torch.save({"inputs": X, "targets": Y}, args.out)
        except (OSError, RuntimeError) as e:  # torch.save reports a missing directory as RuntimeError
            raise UsageError(f"cannot write --out {args.out!r}: {e}")
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"data": args.data, "context": args.context, "sequences": int(X.shape[0]),
                      "valid_targets": int((Y != IGNORE).sum())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
