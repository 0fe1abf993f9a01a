#!/usr/bin/python3
"""Writes a random test case for gradsync: a data set file and a matching initial model state.

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage:
  make_case.py --model SPEC --n N --loss ce|mse --seed S --data-out FILE --state-out FILE
               [--valid-min A --valid-max B]   (gpt only)

  --data-out   torch.save({"inputs": X, "targets": Y}) with X float32 [N, IN] ~ N(0, 1) and
               Y int64 [N] uniform in [0, OUT) (ce) or float32 [N, OUT] ~ N(0, 1) (mse);
               drawn from torch.Generator().manual_seed(S).
               gpt:V-T-D-L-H (--loss ce only): N sequences of T tokens, drawn from
               g = torch.Generator().manual_seed(S) in this order: X = randint(0, V, [N, T]) int64;
               c = randint(A, B + 1, [N]) the number of valid targets of each sequence (default A = 0,
               B = T, so sequences with 0 and 1 valid targets occur); Y = randint(0, V, [N, T]) int64
               with Y[i, j] = -100 (not trained on) for j >= c[i]: the valid targets come first.
  --state-out  torch.save(dict(model.state_dict())) of the model built after torch.manual_seed(S)
               (same builder as torch_train.py; gpt: make_gpt, i.e. init_gpt_). Then, from
               g = torch.Generator().manual_seed(S + 1000003), in model.modules() order, parts are made
               non-trivial so that they are tested too. For mlp-bn the BatchNorm parameters and buffers
               (buffer handling): weight ~ 1 + 0.1 N(0,1), bias ~ 0.1 N(0,1), running_mean ~ 0.5 N(0,1),
               running_var ~ U[0.5, 1.5), num_batches_tracked ~ U{1..100}. LayerNorm (res, gpt) weight ~
               1 + 0.1 N(0,1), then bias ~ 0.1 N(0,1). gpt only: every Linear bias ~ 0.02 N(0,1)
               (attn.qkv has none).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import IGNORE, UsageError, build_model, parse_model_spec  # noqa: E402


def make_data(in_size, out_size, n, loss, seed):
    g = torch.Generator()
    g.manual_seed(seed)
    X = torch.randn(n, in_size, generator=g)
    if loss == "ce":
        Y = torch.randint(0, out_size, (n,), generator=g, dtype=torch.int64)
    else:
        Y = torch.randn(n, out_size, generator=g)
    return X, Y


def make_token_data(vocab, context, n, seed, valid_min, valid_max):
    """gpt data: int64 inputs [n, T] and targets [n, T], the first c_i targets valid, the rest -100."""
    g = torch.Generator()
    g.manual_seed(seed)
    X = torch.randint(0, vocab, (n, context), generator=g, dtype=torch.int64)
    counts = torch.randint(valid_min, valid_max + 1, (n,), generator=g, dtype=torch.int64)
    Y = torch.randint(0, vocab, (n, context), generator=g, dtype=torch.int64)
    Y[torch.arange(context).unsqueeze(0) >= counts.unsqueeze(1)] = IGNORE
    return X, Y


def make_state(spec, seed):
    torch.manual_seed(seed)
    model = build_model(spec)
    gpt = parse_model_spec(spec)[0] == "gpt"
    g = torch.Generator()
    g.manual_seed(seed + 1000003)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):  # non-trivial, so norm weights and biases are tested too
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if gpt and isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.02 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.BatchNorm1d):
                c = m.num_features
                m.weight.copy_(1.0 + 0.1 * torch.randn(c, generator=g))
                m.bias.copy_(0.1 * torch.randn(c, generator=g))
                m.running_mean.copy_(0.5 * torch.randn(c, generator=g))
                m.running_var.copy_(0.5 + torch.rand(c, generator=g))
                m.num_batches_tracked.fill_(int(torch.randint(1, 101, (1,), generator=g)))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="make_case.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="mlp:IN-H...-OUT, mlp-bn:..., cnn:C1-C2-OUT, res:IN-H-B-OUT or gpt:V-T-D-L-H")
    p.add_argument("--n", type=int, required=True, help="number of samples (sequences for gpt; > 0)")
    p.add_argument("--loss", choices=["ce", "mse"], required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--data-out", required=True, metavar="FILE")
    p.add_argument("--state-out", required=True, metavar="FILE")
    p.add_argument("--valid-min", type=int, default=None, metavar="A",
                   help="gpt: fewest valid targets per sequence (0)")
    p.add_argument("--valid-max", type=int, default=None, metavar="B",
                   help="gpt: most valid targets per sequence (T)")
    args = p.parse_args(argv)
    if args.n <= 0:
        p.error(f"--n must be > 0, got {args.n}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    try:
        kind, sizes = parse_model_spec(args.model)
    except UsageError as e:
        p.error(str(e))
    if kind == "gpt":
        if args.loss != "ce":
            p.error(f"--loss {args.loss}: gpt models take --loss ce only")
        context = sizes[1]
        lo = 0 if args.valid_min is None else args.valid_min
        hi = context if args.valid_max is None else args.valid_max
        if not 0 <= lo <= hi <= context:
            p.error(f"--valid-min {lo} / --valid-max {hi}: need 0 <= A <= B <= T={context}")
    elif args.valid_min is not None or args.valid_max is not None:
        p.error("--valid-min/--valid-max apply to gpt models only")
    torch.set_num_threads(1)
    if kind == "gpt":
        X, Y = make_token_data(sizes[0], context, args.n, args.seed, lo, hi)
    else:
        X, Y = make_data(sizes[0], sizes[-1], args.n, args.loss, args.seed)
    state = make_state(args.model, args.seed)
    try:
        torch.save({"inputs": X, "targets": Y}, args.data_out)
        torch.save(state, args.state_out)
    except OSError as e:
        p.error(f"cannot write output: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
