#!/usr/bin/env python3
"""One process trained on exactly the global batches that N data-parallel ranks form — the reference for
gradsync's GlobalMean reduction, in real PyTorch.

Reference tooling (python3-torch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

    torch_global_batches.py --model SPEC --data FILE --global-batch B --ranks N [--accumulate K] [--no-pad]
                            [--optimizer sgd|adam] [--lr F] [--momentum F] [--loss ce|mse]
                            [--steps S | --epochs E] [--seed S] [--no-shuffle] [--dtype fp32|fp64]
                            --init-state FILE --save-state FILE

Rank r's stream in epoch e is DistributedSampler(n, N, r, shuffle, seed, drop_last=False) after set_epoch(e)
(or, with --no-pad, the same permutation without wrap-around padding: positions r, r+N, ... of it), cut into
micro-batches of b = B/(N*K); optimizer step s of the epoch takes micro-batches s*K .. s*K+K-1 of every rank
(fewer, or none, at the end of an epoch). The step's loss is the per-sample mean loss over the concatenation of
all those micro-batches: the gradient of the mean over every sample of the step, whatever the per-rank counts.
For a gpt:V-T-D-L-H model on token data (torch_train.py's token specs and files) it is the mean over every valid
token (targets != -100) of the step's sequences; a step without one is an error (its mean is 0/0). --dtype: the
model after --init-state, float data and the loss, as torch_train.py.
"""
import argparse
import math
import sys

import torch
from torch.utils.data import DistributedSampler

sys.path.insert(0, __import__("os").path.dirname(__file__))
from torch_train import build_model, load_model_data, parse_model_spec  # noqa: E402


def rank_indices(n, ranks, rank, shuffle, seed, epoch, pad):
    if pad:
        sampler = DistributedSampler(list(range(n)), num_replicas=ranks, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=False)
        sampler.set_epoch(epoch)
        return list(sampler)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    return order[rank::ranks]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--no-pad", action="store_true")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--loss", choices=["ce", "mse"], default="ce")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--epochs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", default=True)
    p.add_argument("--init-state", required=True)
    p.add_argument("--save-state", required=True)
    p.add_argument("--dtype", choices=["fp32", "fp64"], default="fp32")
    a = p.parse_args()
    torch.set_num_threads(1)

    kind, _ = parse_model_spec(a.model)
    dtype = torch.float64 if a.dtype == "fp64" else torch.float32
    X, Y = load_model_data(a.data, a.model, a.loss, a.seed, dtype)
    n, N, K = X.shape[0], a.ranks, a.accumulate
    if a.global_batch % (N * K):
        p.error(f"--global-batch {a.global_batch} is not divisible by ranks x accumulate = {N * K}")
    b = a.global_batch // (N * K)
    torch.manual_seed(a.seed)
    model = build_model(a.model)
    model.load_state_dict(torch.load(a.init_state), strict=True)
    model.to(dtype)
    model.train()
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01 if a.lr is None else a.lr, momentum=a.momentum)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3 if a.lr is None else a.lr)
    if kind == "gpt":  # the mean over the valid tokens of the step (cross_entropy's ignore_index)
        def criterion(logits, targets):
            if not bool((targets != -100).any()):
                sys.exit(f"{sys.argv[0]}: a step without a valid token has no token mean (0/0)")
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     ignore_index=-100)
    else:
        criterion = torch.nn.CrossEntropyLoss() if a.loss == "ce" else torch.nn.MSELoss()

    def micro_batches(epoch):
        per_rank = []
        for r in range(N):
            idx = rank_indices(n, N, r, a.shuffle, a.seed, epoch, not a.no_pad)
            per_rank.append([idx[i:i + b] for i in range(0, len(idx), b)])
        return per_rank

    steps_per_epoch = math.ceil(max(len(m) for m in micro_batches(0)) / K)
    total = a.steps if a.steps is not None else (a.epochs or 1) * steps_per_epoch
    step, epoch = 0, 0
    while step < total:
        per_rank = micro_batches(epoch)
        for s in range(steps_per_epoch):
            if step >= total:
                break
            batch = [i for rank in per_rank for micro in rank[s * K:(s + 1) * K] for i in micro]
            if batch:
                idx = torch.tensor(batch)
                criterion(model(X[idx]), Y[idx]).backward()
                opt.step()
                opt.zero_grad()
            step += 1
        epoch += 1
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.save_state)


if __name__ == "__main__":
    main()
