#!/usr/bin/python3
"""Prints the indices real torch.utils.data.DistributedSampler gives every rank.

Reference tooling (real PyTorch), never part of the product. Run with /usr/bin/python3.

Usage:
  sampler_reference.py --n N --replicas R --seed S --epoch E [--no-shuffle] [--drop-last]

Output: one JSON object {"rank_indices": [[indices of rank 0], ..., [indices of rank R-1]]}, from
DistributedSampler(range-like dataset of length N, num_replicas=R, rank=r, shuffle=not --no-shuffle,
seed=S, drop_last=--drop-last) after set_epoch(E).
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="sampler_reference.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, required=True, help="dataset length (>= 0)")
    p.add_argument("--replicas", type=int, required=True, help="number of ranks (> 0)")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    args = p.parse_args(argv)
    if args.n < 0:
        p.error(f"--n must be >= 0, got {args.n}")
    if args.replicas <= 0:
        p.error(f"--replicas must be > 0, got {args.replicas}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.epoch < 0:
        p.error(f"--epoch must be >= 0, got {args.epoch}")
    torch.set_num_threads(1)
    ds = _Range(args.n)
    out = []
    for r in range(args.replicas):
        s = DistributedSampler(ds, num_replicas=args.replicas, rank=r, shuffle=not args.no_shuffle,
                               seed=args.seed, drop_last=args.drop_last)
        s.set_epoch(args.epoch)
        out.append([int(i) for i in s])
    print(json.dumps({"rank_indices": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
