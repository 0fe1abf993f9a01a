#!/usr/bin/python3
"""Reference for gradsync's uneven-input join: real PyTorch DDP inside torch.distributed.algorithms.join.Join.

Reference tooling (real PyTorch), never part of the product. Run with the build's reference Python (GRADSYNC_PYTHON).

Usage:
  join_reference.py --model SPEC --data FILE --init-state FILE --batches C0,C1,...,C{N-1}
                    --batch-size B [--lr F] [--momentum F] [--divide-by-initial-world-size 1|0]
                    [--save-state PATH]

  Multi-rank: gradsync launch -n N -- /usr/bin/python3 join_reference.py ...
          or by hand: one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (gloo).
  Without RANK in the environment it runs a 1-rank world on a FileStore (then --batches has one entry).

  --model       mlp:IN-H1-...-OUT or mlp-bn:IN-H1-...-OUT, built exactly as torch_train.py builds it.
  --data        torch.save({"inputs": X, "targets": Y}) as written by make_case.py --loss ce: inputs of
                any real dtype reshaped to float32 [n, IN], targets integer class labels [n] in [0, OUT).
  --init-state  state dict loaded (strict) into the model before it is wrapped in DDP.
  --batches     one batch count per rank (integers >= 0); exactly WORLD_SIZE entries.
  --batch-size  rows per batch (> 0; >= 2 for mlp-bn, BatchNorm1d needs more than one row).
  --lr          SGD learning rate (default 0.01).  --momentum  SGD momentum (default 0).
  --divide-by-initial-world-size  1 (default) or 0, passed to Join(...) as the DDP join-hook option.
  --save-state  after the Join block, torch.save(dict(ddp.module.state_dict())) (detached copies). If PATH
                contains "{rank}" every rank writes its own file with "{rank}" replaced by its rank;
                otherwise only rank 0 writes PATH.

Semantics (mirrored by the C++ side). N = WORLD_SIZE, c_r = batches[r], off_r = c_0 + ... + c_{r-1}:
  * Data: the rows are cut contiguously into batches of B rows; global batch g is rows [g*B, (g+1)*B).
    Rank r's j-th batch (j = 0 .. c_r - 1) is global batch off_r + j. Rows from sum(c)*B on are unused;
    fewer than sum(c)*B rows is an error.
  * Model: every rank builds the model, loads --init-state, wraps it as DistributedDataParallel(model)
    with default options (gloo, broadcast_buffers=True, find_unused_parameters=False, bucket_cap_mb=25;
    construction broadcasts rank 0's parameters and buffers). Optimizer: torch.optim.SGD(
    ddp.parameters(), lr, momentum), one per rank, weight decay 0.
  * Loop, on every rank:
        with Join([ddp], divide_by_initial_world_size=flag):
            for each of my c_r batches (x, y):
                opt.zero_grad(); loss = F.cross_entropy(ddp(x), y)  # mean over the B rows
                loss.backward(); opt.step()
    Iteration t (t = 0 .. max(c) - 1) has the active ranks A_t = {r : c_r > t}, a_t = |A_t|; a rank with
    c_r <= t has joined and only shadows the collectives (its parameters, buffers and optimizer state do
    not change while it waits).
  * Gradients at iteration t: every active rank r computes its local gradient g_r of the mean loss over its
    batch; DDP multiplies it by 1/d_t (float32) and all-reduces with SUM, joined ranks contributing zeros,
    so every active rank gets  sum_{r in A_t} g_r * (1/d_t)  with  d_t = N if flag else a_t.
    Then each active rank takes its SGD step.
  * Buffers (mlp-bn only: BatchNorm running_mean, running_var, num_batches_tracked): before each forward
    inside Join, DDP broadcasts the buffers from rank max(A_t), the highest-ranked active rank (not rank 0);
    BatchNorm then updates them with the batch statistics of each rank's own batch.
  * Final sync when every rank has joined: the authoritative rank is the highest rank among those with the
    most batches, R* = max{r : c_r = max(c)}; DDP broadcasts R*'s parameters and buffers to every rank.
    Every rank therefore saves the same state, R*'s. (If every c_r is 0, nothing trains and R* = N - 1.)

Output: rank 0 prints one JSON line at the end:
  {"steps": [c_0, ..., c_{N-1}], "divide_by_initial_world_size": true|false}
Exit status: 0 success; 2 bad arguments or inputs (message on stderr, detected before the process group
starts, so every rank fails the same way).
"""
import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import (UsageError, build_model, env_world_size, exit_without_destructors,  # noqa: E402
                         load_dataset_file, load_init_state, model_io_sizes, parse_model_spec, set_up_torch)

PROG = "join_reference.py"


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="mlp:IN-H...-OUT or mlp-bn:IN-H...-OUT")
    p.add_argument("--data", required=True, metavar="FILE", help='torch.save({"inputs", "targets"}) file')
    p.add_argument("--init-state", required=True, metavar="FILE", help="state dict to start from")
    p.add_argument("--batches", required=True, metavar="C0,C1,...", help="batch count per rank")
    p.add_argument("--batch-size", type=int, required=True, metavar="B", help="rows per batch")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (0.01)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (0)")
    p.add_argument("--divide-by-initial-world-size", type=int, choices=[0, 1], default=1, metavar="1|0",
                   help="Join's DDP option: divide by the initial world size (1, default) or by the "
                        "number of active ranks (0)")
    p.add_argument("--save-state", metavar="PATH", help='final state dict; "{rank}" -> one file per rank')
    return p


def parse_batches(text):
    parts = text.split(",")
    try:
        counts = [int(s) for s in parts]
    except ValueError:
        raise UsageError(f"--batches {text!r} must be a comma-separated list of integers, e.g. 3,5,7")
    if any(c < 0 for c in counts):
        raise UsageError(f"--batches {text!r}: every count must be >= 0")
    return counts


def validate(args, world):
    """Checks everything that does not need files; returns the batch counts. Raises UsageError."""
    kind, _ = parse_model_spec(args.model)
    if kind == "gpt":
        raise UsageError(f"--model {args.model}: join_reference.py takes feature models (mlp, mlp-bn, cnn, "
                         f"res), not gpt")
    batch_norm = kind == "mlp-bn"
    counts = parse_batches(args.batches)
    if len(counts) != world:
        raise UsageError(f"--batches has {len(counts)} entries but the world size is {world}; give one "
                         f"count per rank")
    if args.batch_size <= 0:
        raise UsageError(f"--batch-size must be > 0, got {args.batch_size}")
    if batch_norm and args.batch_size == 1 and any(counts):
        raise UsageError("--batch-size 1 with an mlp-bn model: BatchNorm1d in training mode needs more "
                         "than 1 row per batch")
    if not args.lr >= 0.0:
        raise UsageError(f"--lr must be >= 0, got {args.lr}")
    if not args.momentum >= 0.0:
        raise UsageError(f"--momentum must be >= 0, got {args.momentum}")
    if args.save_state:
        parent = os.path.dirname(args.save_state) or "."
        if not os.path.isdir(parent):
            raise UsageError(f"--save-state {args.save_state!r}: directory {parent!r} does not exist")
    return counts


def load_inputs(args, counts):
    in_size, out_size = model_io_sizes(args.model)
    X, Y = load_dataset_file(args.data, in_size, out_size, "ce")
    need = sum(counts) * args.batch_size
    if X.shape[0] < need:
        raise UsageError(f"data {args.data!r} has {X.shape[0]} rows but --batches {args.batches} x "
                         f"--batch-size {args.batch_size} needs {need}")
    module = build_model(args.model)
    load_init_state(module, args.init_state, args.model)
    return X, Y, module


def run(args, counts, X, Y, module, tmpdir):
    # The process group starts only after every input was validated.
    if "RANK" in os.environ:
        dist.init_process_group("gloo")  # env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    else:
        store = dist.FileStore(os.path.join(tmpdir, "filestore"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rank = dist.get_rank()
    assert dist.get_world_size() == len(counts), (dist.get_world_size(), len(counts))

    ddp = DistributedDataParallel(module)
    ddp.train()
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    B = args.batch_size
    offset = sum(counts[:rank])
    flag = bool(args.divide_by_initial_world_size)
    with Join([ddp], divide_by_initial_world_size=flag):
        for j in range(counts[rank]):
            g = offset + j
            x, y = X[g * B:(g + 1) * B], Y[g * B:(g + 1) * B]
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()

    save_error = None
    if args.save_state and ("{rank}" in args.save_state or rank == 0):
        path = args.save_state.replace("{rank}", str(rank))
        try:
            torch.save({k: v.detach().clone() for k, v in ddp.module.state_dict().items()}, path)
        except (OSError, RuntimeError) as e:  # torch.save reports a missing directory as RuntimeError
            save_error = f"rank {rank} cannot write --save-state {path!r}: {e}"
    dist.barrier()  # a failed write on one rank must not leave the others waiting
    dist.destroy_process_group()
    if save_error:
        raise UsageError(save_error)
    if rank == 0:
        print(json.dumps({"steps": counts, "divide_by_initial_world_size": flag}), flush=True)
    exit_without_destructors(tmpdir)  # Join's pending work


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    set_up_torch()
    try:
        env_world = env_world_size()
        counts = validate(args, 1 if env_world is None else env_world)
    except UsageError as e:
        parser.error(str(e))  # prints the usage too
    try:
        X, Y, module = load_inputs(args, counts)
        with tempfile.TemporaryDirectory(prefix="join_reference_") as tmpdir:
            run(args, counts, X, Y, module, tmpdir)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
