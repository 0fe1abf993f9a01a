#!/usr/bin/python3
"""Prints the indices real torch.utils.data.DistributedSampler gives every rank.

Reference tooling (real PyTorch), never part of the product. Run with /usr/bin/python3.

Usage:
  sampler_reference.py --n N --replicas R --seed S --epoch E [--no-shuffle] [--drop-last]
  sampler_reference.py --cases JSON

Output (single case): one JSON object {"rank_indices": [[indices of rank 0], ..., [indices of rank R-1]]},
from DistributedSampler(range-like dataset of length N, num_replicas=R, rank=r, shuffle=not --no-shuffle,
seed=S, drop_last=--drop-last) after set_epoch(E).

Batch mode (--cases, so that a test starts Python once for many cases): JSON is a list of objects
{"n": N, "replicas": R, "seed": S, "epoch": E, "shuffle": bool, "drop_last": bool} ("shuffle" defaults to
true, "drop_last" to false); the output is one JSON object {"cases": [{"rank_indices": ...}, ...]}, one
entry per case, in order. --cases cannot be combined with the single-case options.
"""
import argparse
import json
import sys

import torch
from torch.utils.data import Dataset, DistributedSampler


class _Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _check(n, replicas, seed, epoch, fail, prefix):
    if n < 0:
        fail(f"{prefix}n must be >= 0, got {n}")
    if replicas <= 0:
        fail(f"{prefix}replicas must be > 0, got {replicas}")
    if seed < 0:
        fail(f"{prefix}seed must be >= 0, got {seed}")
    if epoch < 0:
        fail(f"{prefix}epoch must be >= 0, got {epoch}")


def _rank_indices(n, replicas, seed, epoch, shuffle, drop_last):
    ds = _Range(n)
    out = []
    for r in range(replicas):
        s = DistributedSampler(ds, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
        s.set_epoch(epoch)
        out.append([int(i) for i in s])
    return out


def _parse_cases(text, fail):
    try:
        cases = json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"--cases is not valid JSON: {e}")
    if not isinstance(cases, list):
        fail("--cases must be a JSON list of objects")
    allowed = {"n", "replicas", "seed", "epoch", "shuffle", "drop_last"}
    parsed = []
    for i, c in enumerate(cases):
        prefix = f"--cases[{i}]: "
        if not isinstance(c, dict):
            fail(f"{prefix}expected an object, got {c!r}")
        unknown = sorted(set(c) - allowed)
        if unknown:
            fail(f"{prefix}unknown keys {unknown}; allowed: {sorted(allowed)}")
        for key in ("n", "replicas", "seed", "epoch"):
            if key not in c:
                fail(f"{prefix}missing key '{key}'")
            if not isinstance(c[key], int) or isinstance(c[key], bool):
                fail(f"{prefix}'{key}' must be an integer, got {c[key]!r}")
        for key in ("shuffle", "drop_last"):
            if key in c and not isinstance(c[key], bool):
                fail(f"{prefix}'{key}' must be true or false, got {c[key]!r}")
        _check(c["n"], c["replicas"], c["seed"], c["epoch"], fail, prefix)
        parsed.append((c["n"], c["replicas"], c["seed"], c["epoch"], c.get("shuffle", True),
                       c.get("drop_last", False)))
    return parsed


def main(argv=None):
    p = argparse.ArgumentParser(prog="sampler_reference.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, help="dataset length (>= 0)")
    p.add_argument("--replicas", type=int, help="number of ranks (> 0)")
    p.add_argument("--seed", type=int)
    p.add_argument("--epoch", type=int)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--cases", metavar="JSON",
                   help="batch mode: a JSON list of case objects (see above)")
    args = p.parse_args(argv)
    single = {"--n": args.n, "--replicas": args.replicas, "--seed": args.seed, "--epoch": args.epoch}
    if args.cases is not None:
        given = [k for k, v in single.items() if v is not None]
        if args.no_shuffle:
            given.append("--no-shuffle")
        if args.drop_last:
            given.append("--drop-last")
        if given:
            p.error(f"--cases cannot be combined with {', '.join(given)}")
        cases = _parse_cases(args.cases, p.error)
        torch.set_num_threads(1)
        print(json.dumps({"cases": [{"rank_indices": _rank_indices(*c)} for c in cases]}))
        return 0
    missing = [k for k, v in single.items() if v is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)} (or --cases)")
    _check(args.n, args.replicas, args.seed, args.epoch, p.error, "--")
    torch.set_num_threads(1)
    print(json.dumps({"rank_indices": _rank_indices(args.n, args.replicas, args.seed, args.epoch,
                                                    not args.no_shuffle, args.drop_last)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
