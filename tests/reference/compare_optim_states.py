#!/usr/bin/python3
"""Compares two optimizer state files keyed by parameter names (gradsync train --save-optim, torch_train.py
--save-optim): the same parameters with state, the same state names, steps equal, tensors within --rtol of the
larger |entry| (plus --atol), and the same parameter groups (the same names, in any order, and equal
hyperparameters where both files have them). Prints one JSON line; exit status 0 when they agree, 1 otherwise.

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage: compare_optim_states.py OURS THEIRS [--rtol R] [--atol A]
"""
import argparse
import json
import sys

import torch


def as_number(v):
    return float(v) if torch.is_tensor(v) else v


def compare(a, b, rtol, atol):
    problems, worst = [], 0.0
    if set(a["state"]) != set(b["state"]):
        problems.append(f"parameters with state differ: {sorted(set(a['state']) ^ set(b['state']))}")
    for name in sorted(set(a["state"]) & set(b["state"])):
        sa, sb = a["state"][name], b["state"][name]
        if set(sa) != set(sb):
            problems.append(f"{name}: state names {sorted(sa)} vs {sorted(sb)}")
            continue
        for key in sa:
            x, y = sa[key], sb[key]
            if key == "step":
                if as_number(x) != as_number(y):
                    problems.append(f"{name}: step {as_number(x)} vs {as_number(y)}")
                continue
            if x.shape != y.shape:
                problems.append(f"{name}.{key}: shape {list(x.shape)} vs {list(y.shape)}")
                continue
            scale = max(float(y.abs().max()) if y.numel() else 0.0, 1e-30)
            diff = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
            worst = max(worst, diff / scale)
            if diff > rtol * scale + atol:
                problems.append(f"{name}.{key}: max |diff| {diff:.3g} (largest entry {scale:.3g})")
    ga, gb = a["param_groups"], b["param_groups"]
    if len(ga) != len(gb):
        problems.append(f"{len(ga)} vs {len(gb)} parameter groups")
    for i, (x, y) in enumerate(zip(ga, gb)):
        if sorted(x["params"]) != sorted(y["params"]):
            problems.append(f"group {i}: params {sorted(x['params'])} vs {sorted(y['params'])}")
        for key in set(x) & set(y) - {"params"}:
            vx, vy = x[key], y[key]
            if isinstance(vx, (tuple, list)):
                vx, vy = list(vx), list(vy)
            if vx != vy:
                problems.append(f"group {i}: {key} {vx} vs {vy}")
    return problems, worst


def main(argv=None):
    p = argparse.ArgumentParser(prog="compare_optim_states.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ours")
    p.add_argument("theirs")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-8)
    args = p.parse_args(argv)
    ours = torch.load(args.ours)  # torch 1.13's weights_only reader has no floats (lr), for Python's own files too
    theirs = torch.load(args.theirs)
    problems, worst = compare(ours, theirs, args.rtol, args.atol)
    print(json.dumps({"ok": not problems, "max_rel": worst, "parameters": len(ours["state"]), "problems": problems}))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
