#!/usr/bin/python3
"""Prints the indices real torch.utils.data.DistributedSampler gives every rank (optionally batched by a
real torch.utils.data.DataLoader).

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage:
  sampler_reference.py --n N --replicas R --seed S --epoch E [--no-shuffle] [--drop-last]
  sampler_reference.py --n N --replicas R --seed S --batch-size B --epochs E [--no-shuffle] [--drop-last]
                       [--loader-drop-last]
  sampler_reference.py --cases JSON

Index mode (--epoch): one JSON object {"rank_indices": [[indices of rank 0], ..., [indices of rank R-1]]},
from DistributedSampler(range-like dataset of length N, num_replicas=R, rank=r, shuffle=not --no-shuffle,
seed=S, drop_last=--drop-last) after set_epoch(E).

DataLoader mode (--batch-size with --epochs): one JSON object
  {"rank_epochs": [[[batch, ...] for epoch 0, ..., for epoch E-1] for rank 0, ..., for rank R-1]}
where rank_epochs[r][e] is the list of batches (each a list of ints) that
  DataLoader(ds, batch_size=B, sampler=DistributedSampler(ds, R, r, shuffle, S, drop_last),
             drop_last=--loader-drop-last)
yields in epoch e after sampler.set_epoch(e), for e = 0 .. E-1 (one sampler and one loader per rank; ds is
the range-like dataset whose item i is i). So the last batch of an epoch is short unless B divides the
rank's share or --loader-drop-last drops it; --drop-last is the sampler's own drop_last. --epoch is for
the index mode only, --loader-drop-last for the DataLoader mode only. B > 0, E >= 0 (E = 0 gives R empty
lists).

Batch mode (--cases, so that a test starts Python once for many cases): JSON is a list of objects, each
  {"n": N, "replicas": R, "seed": S, "epoch": E, "shuffle": bool, "drop_last": bool}           (index), or
  {"n": N, "replicas": R, "seed": S, "batch_size": B, "epochs": E, "shuffle": bool, "drop_last": bool,
   "loader_drop_last": bool}                                                                 (DataLoader)
("shuffle" defaults to true, "drop_last" and "loader_drop_last" to false; a case has either "epoch" or
"batch_size" with "epochs"); the output is one JSON object {"cases": [{"rank_indices": ...} or
{"rank_epochs": ...}, ...]}, one entry per case, in order, each shaped as in the matching single-case mode.
--cases cannot be combined with the single-case options.
"""
import argparse
import json
import sys

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


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


def _rank_epochs(n, replicas, seed, batch_size, epochs, shuffle, drop_last, loader_drop_last):
    ds = _Range(n)
    out = []
    for r in range(replicas):
        s = DistributedSampler(ds, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
        loader = DataLoader(ds, batch_size=batch_size, sampler=s, drop_last=loader_drop_last)
        per_epoch = []
        for e in range(epochs):
            s.set_epoch(e)
            per_epoch.append([[int(i) for i in batch] for batch in loader])
        out.append(per_epoch)
    return out


def _check_loader(batch_size, epochs, fail, prefix, batch_name="batch_size"):
    if batch_size <= 0:
        fail(f"{prefix}{batch_name} must be > 0, got {batch_size}")
    if epochs < 0:
        fail(f"{prefix}epochs must be >= 0, got {epochs}")


def _parse_cases(text, fail):
    try:
        cases = json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"--cases is not valid JSON: {e}")
    if not isinstance(cases, list):
        fail("--cases must be a JSON list of objects")
    allowed = {"n", "replicas", "seed", "epoch", "shuffle", "drop_last", "batch_size", "epochs",
               "loader_drop_last"}
    parsed = []
    for i, c in enumerate(cases):
        prefix = f"--cases[{i}]: "
        if not isinstance(c, dict):
            fail(f"{prefix}expected an object, got {c!r}")
        unknown = sorted(set(c) - allowed)
        if unknown:
            fail(f"{prefix}unknown keys {unknown}; allowed: {sorted(allowed)}")
        loader = "batch_size" in c or "epochs" in c or "loader_drop_last" in c
        if loader and "epoch" in c:
            fail(f"{prefix}'epoch' (index mode) cannot be combined with 'batch_size'/'epochs'/"
                 f"'loader_drop_last' (DataLoader mode)")
        ints = ("n", "replicas", "seed") + (("batch_size", "epochs") if loader else ("epoch",))
        for key in ints:
            if key not in c:
                fail(f"{prefix}missing key '{key}'")
            if not isinstance(c[key], int) or isinstance(c[key], bool):
                fail(f"{prefix}'{key}' must be an integer, got {c[key]!r}")
        for key in ("shuffle", "drop_last", "loader_drop_last"):
            if key in c and not isinstance(c[key], bool):
                fail(f"{prefix}'{key}' must be true or false, got {c[key]!r}")
        if loader:
            _check(c["n"], c["replicas"], c["seed"], 0, fail, prefix)
            _check_loader(c["batch_size"], c["epochs"], fail, prefix)
            parsed.append(("rank_epochs", (c["n"], c["replicas"], c["seed"], c["batch_size"], c["epochs"],
                                           c.get("shuffle", True), c.get("drop_last", False),
                                           c.get("loader_drop_last", False))))
        else:
            _check(c["n"], c["replicas"], c["seed"], c["epoch"], fail, prefix)
            parsed.append(("rank_indices", (c["n"], c["replicas"], c["seed"], c["epoch"],
                                            c.get("shuffle", True), c.get("drop_last", False))))
    return parsed


def main(argv=None):
    p = argparse.ArgumentParser(prog="sampler_reference.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, help="dataset length (>= 0)")
    p.add_argument("--replicas", type=int, help="number of ranks (> 0)")
    p.add_argument("--seed", type=int)
    p.add_argument("--epoch", type=int, help="index mode: the epoch passed to set_epoch")
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--drop-last", action="store_true", help="DistributedSampler's drop_last")
    p.add_argument("--batch-size", type=int, metavar="B", help="DataLoader mode: batch size (> 0)")
    p.add_argument("--epochs", type=int, metavar="E", help="DataLoader mode: epochs 0 .. E-1 (>= 0)")
    p.add_argument("--loader-drop-last", action="store_true",
                   help="DataLoader mode: the DataLoader's own drop_last (default false)")
    p.add_argument("--cases", metavar="JSON",
                   help="batch mode: a JSON list of case objects (see above)")
    args = p.parse_args(argv)
    single = {"--n": args.n, "--replicas": args.replicas, "--seed": args.seed, "--epoch": args.epoch,
              "--batch-size": args.batch_size, "--epochs": args.epochs}
    flags = {"--no-shuffle": args.no_shuffle, "--drop-last": args.drop_last,
             "--loader-drop-last": args.loader_drop_last}
    if args.cases is not None:
        given = [k for k, v in single.items() if v is not None] + [k for k, v in flags.items() if v]
        if given:
            p.error(f"--cases cannot be combined with {', '.join(given)}")
        cases = _parse_cases(args.cases, p.error)
        torch.set_num_threads(1)
        results = []
        for key, c in cases:
            results.append({key: (_rank_epochs if key == "rank_epochs" else _rank_indices)(*c)})
        print(json.dumps({"cases": results}))
        return 0
    loader = args.batch_size is not None or args.epochs is not None or args.loader_drop_last
    if loader and args.epoch is not None:
        p.error("--epoch (index mode) cannot be combined with --batch-size/--epochs/--loader-drop-last "
                "(DataLoader mode)")
    required = ["--n", "--replicas", "--seed"] + (["--batch-size", "--epochs"] if loader else ["--epoch"])
    missing = [k for k in required if single[k] is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)} (or --cases)")
    torch.set_num_threads(1)
    if loader:
        _check(args.n, args.replicas, args.seed, 0, p.error, "--")
        _check_loader(args.batch_size, args.epochs, p.error, "--", "batch-size")
        print(json.dumps({"rank_epochs": _rank_epochs(args.n, args.replicas, args.seed, args.batch_size,
                                                      args.epochs, not args.no_shuffle, args.drop_last,
                                                      args.loader_drop_last)}))
        return 0
    _check(args.n, args.replicas, args.seed, args.epoch, p.error, "--")
    print(json.dumps({"rank_indices": _rank_indices(args.n, args.replicas, args.seed, args.epoch,
                                                    not args.no_shuffle, args.drop_last)}))
    return 0

if __name__ == "__main__":
    sys.exit(main())
