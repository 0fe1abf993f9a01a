#!/usr/bin/python3
"""Compares two saved state dicts (torch.save of a dict of tensors) key by key.

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage:
  compare_states.py A B [--rtol 1e-5] [--atol 1e-7] [--expect-different]

Checks that A and B have the same keys, shapes and dtypes, then for every tensor prints
  max_abs = max|a-b|, max_rel = max|a-b| / max(max|b|, tiny), and torch.allclose(a, b, rtol, atol)
(first mismatching indices are shown). The last line is JSON:
  {"max_rel": x, "worst_key": k, "ok": verdict, "within_tolerance": bool, "structure_ok": bool}
Exit status: 0 if every tensor is within tolerance (with --expect-different: if at least one is NOT,
i.e. a negative control), 1 otherwise, 2 for usage errors or unreadable files. Key, shape or dtype
mismatches always fail (exit 1), even with --expect-different, because they indicate a broken setup
rather than a numeric difference. Non-finite numbers appear in the JSON as strings ("inf", "nan").
"""
import argparse
import json
import math
import sys

import torch

TINY = 1e-30
MAX_SHOWN = 5


def _num(x):
    return x if math.isfinite(x) else str(x)


def compare_tensor(key, a, b, rtol, atol):
    """Returns (max_rel, within_tolerance, lines)."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a.numel() == 0:
        return 0.0, True, [f"{key}: shape {tuple(a.shape)} {a.dtype}: empty, OK"]
    diff = (a64 - b64).abs()
    nan_mismatch = a64.isnan() != b64.isnan()
    diff = torch.where(a64.isnan() & b64.isnan(), torch.zeros_like(diff), diff)
    diff = torch.where(nan_mismatch, torch.full_like(diff, math.inf), diff)
    max_abs = float(diff.max())
    denom = max(float(b64.abs().nan_to_num(nan=0.0).max()), TINY)
    max_rel = max_abs / denom if math.isfinite(max_abs) else math.inf
    close = torch.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
    ok = bool(close.all())
    lines = [f"{key}: shape {tuple(a.shape)} {a.dtype}: max_abs {max_abs:.3e} max_rel {max_rel:.3e} "
             f"{'OK' if ok else 'MISMATCH'}"]
    if not ok:
        bad = (~close).nonzero()
        lines.append(f"  {bad.shape[0]} of {a.numel()} elements differ; first:")
        for idx in bad[:MAX_SHOWN].tolist():
            i = tuple(idx)
            lines.append(f"    [{', '.join(map(str, i))}] a={a64[i].item()!r} b={b64[i].item()!r}")
    return max_rel, ok, lines


def load(path, parser):
    try:
        obj = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        parser.error(f"cannot load {path!r} with torch.load: {e}")
    if not isinstance(obj, dict):
        parser.error(f"{path!r} holds a {type(obj).__name__}, expected a state dict")
    return obj


def main(argv=None):
    p = argparse.ArgumentParser(prog="compare_states.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A", help="state dict file (the one under test)")
    p.add_argument("b", metavar="B", help="state dict file (the reference; scales max_rel)")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-7)
    p.add_argument("--expect-different", action="store_true",
                   help="negative control: succeed only if some tensor is outside tolerance")
    args = p.parse_args(argv)
    if not (args.rtol >= 0 and args.atol >= 0):
        p.error(f"--rtol and --atol must be >= 0, got {args.rtol}, {args.atol}")
    A, B = load(args.a, p), load(args.b, p)

    structure_ok, within = True, True
    missing = [k for k in B if k not in A]
    extra = [k for k in A if k not in B]
    if missing:
        structure_ok = False
        print(f"keys missing from A (present in B): {missing}")
    if extra:
        structure_ok = False
        print(f"extra keys in A (absent from B): {extra}")

    worst_key, worst = None, -1.0
    for key in [k for k in A if k in B]:
        a, b = A[key], B[key]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            same = type(a) is type(b) and a == b
            print(f"{key}: non-tensor values {a!r} vs {b!r}: {'OK' if same else 'MISMATCH'}")
            structure_ok &= bool(same)
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            structure_ok = False
            print(f"{key}: MISMATCH shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            continue
        rel, ok, lines = compare_tensor(key, a, b, args.rtol, args.atol)
        print("\n".join(lines))
        within &= ok
        if rel > worst or worst_key is None:
            worst, worst_key = rel, key

    verdict = structure_ok and (within != args.expect_different)
    print(json.dumps({"max_rel": _num(max(worst, 0.0)), "worst_key": worst_key, "ok": verdict,
                      "within_tolerance": structure_ok and within, "structure_ok": structure_ok}))
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
