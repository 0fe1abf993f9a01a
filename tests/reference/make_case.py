#!/usr/bin/python3
"""Writes a random test case for gradsync: a data set file and a matching initial model state.

Reference tooling (real PyTorch), never part of the product. Run with /usr/bin/python3.

Usage:
  make_case.py --model SPEC --n N --loss ce|mse --seed S --data-out FILE --state-out FILE

  --data-out   torch.save({"inputs": X, "targets": Y}) with X float32 [N, IN] ~ N(0, 1) and
               Y int64 [N] uniform in [0, OUT) (ce) or float32 [N, OUT] ~ N(0, 1) (mse);
               drawn from torch.Generator().manual_seed(S).
  --state-out  torch.save(dict(model.state_dict())) of the model built after torch.manual_seed(S)
               (same builder as torch_train.py). For mlp-bn the BatchNorm parameters and buffers
               are made non-trivial so that buffer handling is tested: weight ~ 1 + 0.1 N(0,1),
               bias ~ 0.1 N(0,1), running_mean ~ 0.5 N(0,1), running_var ~ U[0.5, 1.5),
               num_batches_tracked ~ U{1..100}. LayerNorm (res) weight ~ 1 + 0.1 N(0,1), bias ~ 0.1 N(0,1).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import UsageError, build_model, parse_model_spec  # noqa: E402


def make_data(in_size, out_size, n, loss, seed):
    g = torch.Generator()
    g.manual_seed(seed)
    X = torch.randn(n, in_size, generator=g)
    if loss == "ce":
        Y = torch.randint(0, out_size, (n,), generator=g, dtype=torch.int64)
    else:
        Y = torch.randn(n, out_size, generator=g)
    return X, Y


def make_state(spec, seed):
    torch.manual_seed(seed)
    model = build_model(spec)
    g = torch.Generator()
    g.manual_seed(seed + 1000003)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):  # non-trivial, so norm weights and biases are tested too
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
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
    p.add_argument("--model", required=True, help="mlp:IN-H...-OUT or mlp-bn:IN-H...-OUT")
    p.add_argument("--n", type=int, required=True, help="number of samples (> 0)")
    p.add_argument("--loss", choices=["ce", "mse"], required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--data-out", required=True, metavar="FILE")
    p.add_argument("--state-out", required=True, metavar="FILE")
    args = p.parse_args(argv)
    if args.n <= 0:
        p.error(f"--n must be > 0, got {args.n}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    try:
        _, sizes = parse_model_spec(args.model)
    except UsageError as e:
        p.error(str(e))
    torch.set_num_threads(1)
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
