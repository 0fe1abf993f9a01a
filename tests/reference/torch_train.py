#!/usr/bin/python3
"""Reference trainer for gradsync: real PyTorch (DDP) with the same contract as `gradsync train`.

This is the *reference* the C++ product is tested against, never part of the product. Run it with the build's
reference Python (GRADSYNC_PYTHON: the torch 2.11 virtual environment by default, /usr/bin/python3 with Debian's
python3-torch 1.13 under TORCH=debian).

Usage:
  torch_train.py --model SPEC --data SPEC --global-batch B [--accumulate K] [--world-size N]
                 [--strategy local|ddp|fully-shard|fully-shard-hsdp|fsdp1-grad-op|fsdp1-no-shard]
                 [--wrap none|children|type:T[,U]|list:A[,B]] [--replicas R] [--optimizer sgd|adam] [--lr F] [--momentum F]
                 [--weight-decay F] [--loss ce|mse] [--loss-reduction mean|sum]
                 [--steps S | --epochs E] [--seed S] [--shuffle | --no-shuffle]
                 [--init-state FILE] [--save-state FILE] [--log FILE.jsonl] [--comm-hook none|fp16]
                 [--freeze PREFIX[,PREFIX...]] [--no-decay-1d] [--save-optim FILE] [--dtype fp32|fp64]

  Multi-rank: gradsync launch -n N -- /usr/bin/python3 torch_train.py ...
          or: torchrun --standalone --nproc_per_node N --no_python /usr/bin/python3 torch_train.py ...
  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the environment; gloo backend.)

Model specs:  mlp:IN-H1-...-OUT     Linear, ReLU, ..., Linear
              mlp-bn:IN-H1-...-OUT  Linear, BatchNorm1d, ReLU per hidden layer, final Linear
              cnn:C1-C2-OUT         Unflatten(1,(1,28,28)), Conv2d(1,C1,3,p=1), ReLU, MaxPool2d(2),
                                    Conv2d(C1,C2,3,p=1), ReLU, MaxPool2d(2), Flatten, Linear(C2*49,OUT)
              res:IN-H-B-OUT        Res(IN, H, B, OUT): inp Linear, B Blocks h + fc(relu(norm(h))), out Linear
              gpt:V-T-D-L-H         causal language model (gpt.py): vocabulary V, context T, width D,
                                    L blocks, H heads; all > 0, D divisible by H; built by make_gpt
                                    (init_gpt_ after torch.manual_seed(seed)); takes token data only
Data specs:   fashion-mnist[:train|:test]   ($GRADSYNC_FASHION_MNIST_DIR overrides the directory)
              synthetic:N                    (generator recipe in load_synthetic)
              PATH                           torch.save({"inputs": X, "targets": Y}, PATH)
              fortunes[:train|:test]         gpt only: byte tokens of the fortune files (see Token data)
              text:PATH | text-test:PATH     gpt only: byte tokens of one text file, train / held-out split

Semantics (mirrored by the C++ side):
  * per-rank micro-batch b = B / (N * K); rank r iterates
    DataLoader(TensorDataset, batch_size=b, sampler=DistributedSampler(n, N, r, shuffle, seed,
    drop_last=False)), set_epoch(e) at the start of epoch e;
  * an optimizer step consumes K consecutive micro-batches of the epoch (the last group of an epoch
    may have K' < K); each micro-batch loss is divided by the size of its group; all but the last
    micro-batch of a group run under ddp.no_sync(); then optimizer.step(); optimizer.zero_grad();
  * --steps S crosses epoch boundaries; --epochs E runs whole epochs; default --epochs 1.
  * --strategy local also uses DistributedSampler(num_replicas=1, rank=0) (so shuffling is the
    sampler's permutation seeded with seed + epoch, not a RandomSampler).
  * --comm-hook fp16 (--strategy ddp only) registers torch's
    ddp_comm_hooks.default_hooks.fp16_compress_hook: each gradient bucket (float32, *not* pre-divided
    by N) is cast to float16, divided by N in float16, all-reduced with SUM in float16 and cast back to
    float32 into the gradients. --comm-hook none (default) is DDP's own reduction: each gradient times
    1/N in float32, then a float32 SUM all-reduce. (bf16 is refused: torch 1.13's bf16_compress_hook
    needs CUDA 11+ and NCCL 2.10+, so it cannot run on gloo/CPU.)
  * --strategy fully-shard|fully-shard-hsdp|fsdp1-grad-op|fsdp1-no-shard (torch 2.x): PyTorch's own FSDP on
    CPU with gloo instead of DDP, units chosen by --wrap, hsdp's replica groups by --replicas; the same
    schedule, losses and no-sync accumulation; saved states gathered in full (torch_fsdp.py).
  * --freeze PREFIX: parameters whose state-dict names start with a prefix get requires_grad=False before
    DDP wraps the model (DDP then neither hooks nor reduces them); --no-decay-1d: the optimizer gets two
    parameter groups, the parameters of more than one dimension with --weight-decay, the others (biases,
    norm weights) with weight_decay 0.
  * --save-optim FILE: rank 0 saves optimizer.state_dict() with every parameter id replaced by the
    parameter's state-dict name: {"state": {name: {...}}, "param_groups": [{..., "params": [names]}]},
    the layout of FSDP.full_optim_state_dict.
  * log "loss" = sum over the group of float(loss / K'), all_reduce(SUM) / N in float64 (only done when
    --log is given; every rank takes part); "samples" counts DistributedSampler padding repeats too.
  * --dtype fp32|fp64 (default fp32): after --init-state is loaded (into the float32 model; a state of
    another dtype is cast to float32 by load_state_dict), the whole model is converted with
    model.to(dtype) before DDP wraps it; float data (inputs of non-gpt models, mse targets) is cast to
    that dtype, so the forward pass, the loss and the gradients are in that dtype (DDP all-reduces
    them in it; under --comm-hook fp16 the bucket is cast from that dtype to float16 and back), and the
    saved state and optimizer state are in that dtype. Token ids and class labels stay int64.

Defaults: --strategy ddp, --optimizer sgd, --lr 0.01 (sgd) / 1e-3 (adam), --momentum 0, --weight-decay 0,
--loss ce, --loss-reduction mean, --seed 0, --shuffle, --accumulate 1, --comm-hook none, --dtype fp32.

Data files: inputs of any real dtype, reshaped to float32 [n, IN]. ce: targets must be integer class
labels [n] in [0, OUT). mse: float targets reshaped to [n, OUT], or integer labels [n] which become
one-hot float32 [n, OUT] (as for fashion-mnist). fashion-mnist needs IN=784; labels must be < OUT.

Token data (gpt models only, and gpt models take nothing else; a sample is a sequence):
  * a data file PATH for gpt: {"inputs": int64 [S, L], "targets": int64 [S, L]} with 1 <= L <= T,
    inputs in [0, V), targets in [0, V) or -100 (IGNORE: not trained on). Kept int64.
  * fortunes[:train|:test], text:PATH, text-test:PATH: byte-level tokens, V must be 256. The files:
    fortunes reads the directory $GRADSYNC_FORTUNES_DIR if set and non-empty, else
    /usr/share/games/fortunes, taking the regular files directly in it whose name contains no '.'
    (not *.dat, *.u8, symlinks or subdirectories), sorted by name (byte order); text:PATH reads PATH.
    A file's documents: its bytes split into lines at b'\n' (a final line without '\n' counts, the empty
    remainder after a final '\n' does not); a line exactly b'%' ends the current document; any other
    line adds its bytes plus b'\n' to the current document; the document in progress at the end of the
    file counts too. Documents of fewer than 2 bytes are dropped; the rest are numbered i = 0, 1, ... over
    all files in order: i % 10 == 9 is the held-out split (fortunes:test, text-test:PATH), the others the
    train split (fortunes, fortunes:train, text:PATH). A document d of n bytes gives the sequences
    start = 0, T, 2T, ... while start + 1 < n: chunk = d[start : start + T + 1]; inputs = chunk[:-1]
    right-padded with 0 to T, targets = chunk[1:] right-padded with -100 to T (documents in order, chunks
    in order); inputs and targets int64 [S, T]. tests/reference/text_tokens.py writes them as a data file.
  * loss ce only (--loss mse is an error): F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
    ignore_index=-100, reduction=--loss-reduction) on the micro-batch's logits [b, L, V], i.e. the mean
    over its valid tokens (or their sum), then divided by K' as above. Under --loss-reduction mean a
    micro-batch whose targets are all -100 has the token mean 0/0: every rank checks the whole schedule
    (all ranks' sampler indices, before the process group starts) and the run fails with exit status 2,
    naming the first such step and rank, instead of training on NaN.

A micro-batch of 1 sample through BatchNorm1d in training mode is an error (as in torch); so is, under
--loss-reduction mean, a gpt micro-batch without a valid token (see Token data).
Exit status: 0 success; 2 bad arguments or inputs (message on stderr).
"""
import argparse
import contextlib
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import UsageError, check_gpt_sizes, make_gpt  # noqa: E402  (UsageError is defined in gpt.py)
import torch_fsdp  # noqa: E402

PROG = "torch_train.py"
DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
DEFAULT_FORTUNES_DIR = "/usr/share/games/fortunes"
MODEL_SPEC_RE = re.compile(r"^(mlp|mlp-bn|cnn|res|gpt):([0-9]+(?:-[0-9]+)+)$")
IGNORE = -100  # a target that is not trained on (cross_entropy's ignore_index)
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------
def parse_model_spec(spec):
    """'mlp:8-16-4' -> ('mlp', [8, 16, 4]); 'cnn:C1-C2-OUT' -> ('cnn', [784, C1, C2, OUT]);
    'gpt:V-T-D-L-H' -> ('gpt', [V, T, D, L, H]). For every kind but gpt, sizes[0] is the input size IN and
    sizes[-1] the output size OUT (model_io_sizes). Raises UsageError on a malformed spec."""
    m = MODEL_SPEC_RE.match(spec or "")
    if not m:
        raise UsageError(
            f"model spec {spec!r} is malformed; expected mlp:IN-H1-...-OUT, mlp-bn:IN-H1-...-OUT, "
            f"cnn:C1-C2-OUT, res:IN-H-B-OUT or gpt:V-T-D-L-H, all positive integers (e.g. mlp:784-256-10)")
    kind = m.group(1)
    sizes = [int(s) for s in m.group(2).split("-")]
    if kind == "gpt":
        if len(sizes) != 5:
            raise UsageError(f"model spec {spec!r}: gpt takes exactly V-T-D-L-H (vocabulary, context, width, "
                             f"blocks, heads), e.g. gpt:256-64-128-4-4")
        check_gpt_sizes(*sizes, what=f"model spec {spec!r}")
        return kind, sizes
    if any(s <= 0 for s in sizes):
        raise UsageError(f"model spec {spec!r}: every layer size must be > 0, got {sizes}")
    if kind == "cnn":
        if len(sizes) != 3:
            raise UsageError(f"model spec {spec!r}: cnn takes exactly C1-C2-OUT")
        sizes = [28 * 28] + sizes
    if kind == "res" and len(sizes) != 4:
        raise UsageError(f"model spec {spec!r}: res takes exactly IN-H-B-OUT")
    return kind, sizes


def model_io_sizes(spec):
    """(IN, OUT) of a non-gpt model spec; UsageError for gpt, whose data are tokens, not feature vectors."""
    kind, sizes = parse_model_spec(spec)
    if kind == "gpt":
        raise UsageError(f"model spec {spec!r}: a gpt model has no IN/OUT feature sizes; it takes token data")
    return sizes[0], sizes[-1]


def build_cnn(c1, c2, out):
    """cnn:C1-C2-OUT on flattened 28x28 single-channel images (keys 1.*, 4.*, 8.*)."""
    return nn.Sequential(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(c2 * 7 * 7, out))


class Block(nn.Module):
    def __init__(self, h):
        super().__init__(); self.norm = nn.LayerNorm(h); self.fc = nn.Linear(h, h)

    def forward(self, h):
        return h + self.fc(torch.relu(self.norm(h)))


class Res(nn.Module):
    """res:IN-H-B-OUT, not a Sequential (keys inp.*, blocks.<i>.norm.*, blocks.<i>.fc.*, out.*)."""

    def __init__(self, din, h, nblocks, dout):
        super().__init__()
        self.inp = nn.Linear(din, h)
        self.blocks = nn.ModuleList([Block(h) for _ in range(nblocks)])
        self.out = nn.Linear(h, dout)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def build_model(spec):
    """nn.Sequential with state-dict keys '0.weight', '1.running_mean', ..., Res or Gpt (module docstring).
    gpt models are initialised by make_gpt with the global RNG."""
    kind, sizes = parse_model_spec(spec)
    batch_norm = kind == "mlp-bn"
    if kind == "cnn":
        return build_cnn(*sizes[1:])
    if kind == "res":
        return Res(*sizes)
    if kind == "gpt":
        return make_gpt(*sizes)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:  # hidden layer
            if batch_norm:
                layers.append(nn.BatchNorm1d(sizes[i + 1]))
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------
def load_synthetic(n, in_size, out_size, loss, seed):
    g = torch.Generator()
    g.manual_seed(seed)
    X = torch.randn(n, in_size, generator=g)
    W = torch.randn(in_size, out_size, generator=g)
    logits = X @ W
    if loss == "ce":
        Y = logits.argmax(dim=1)
    else:
        Y = logits / math.sqrt(in_size)
    return X, Y


def _read_idx_gz(path, magic, ndim):
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"cannot read Fashion-MNIST file {path}: {e}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"Fashion-MNIST file {path} is truncated (no IDX header)")
    got_magic = int.from_bytes(raw[0:4], "big")
    if got_magic != magic:
        raise UsageError(f"Fashion-MNIST file {path}: IDX magic {got_magic}, expected {magic}")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    count = int(np.prod(dims))
    if len(raw) - header != count:
        raise UsageError(f"Fashion-MNIST file {path}: {len(raw) - header} data bytes, "
                         f"header dims {dims} need {count}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load_fashion_mnist(split, in_size, out_size, loss):
    d = os.environ.get("GRADSYNC_FASHION_MNIST_DIR") or DEFAULT_FASHION_MNIST_DIR
    prefix = "train" if split == "train" else "t10k"
    images = _read_idx_gz(os.path.join(d, f"{prefix}-images-idx3-ubyte.gz"), 2051, 3)
    labels = _read_idx_gz(os.path.join(d, f"{prefix}-labels-idx1-ubyte.gz"), 2049, 1)
    if images.shape[0] != labels.shape[0]:
        raise UsageError(f"Fashion-MNIST in {d}: {images.shape[0]} images but {labels.shape[0]} labels")
    X = torch.from_numpy(images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(255.0))
    if X.shape[1] != in_size:
        raise UsageError(f"data 'fashion-mnist' has {X.shape[1]} inputs per sample but the model "
                         f"expects IN={in_size} (use e.g. mlp:784-256-10)")
    Y = torch.from_numpy(labels.astype(np.int64))
    return X, _labels_for_loss(Y, out_size, loss, "fashion-mnist")


def _labels_for_loss(Y, out_size, loss, what):
    """int64 class labels [n] -> themselves (ce) or one-hot float32 [n, OUT] (mse)."""
    if Y.numel() and (int(Y.min()) < 0 or int(Y.max()) >= out_size):
        raise UsageError(f"data {what!r}: class labels span [{int(Y.min())}, {int(Y.max())}] but the "
                         f"model has OUT={out_size} outputs (labels must be in [0, {out_size}))")
    if loss == "ce":
        return Y
    return torch.nn.functional.one_hot(Y, out_size).to(torch.float32)


def _load_data_dict(path, what):
    """torch.load of a data file holding {"inputs": ..., "targets": ...}; UsageError otherwise."""
    if not os.path.isfile(path):
        raise UsageError(f"data {path!r} is neither {what} nor an existing file")
    try:
        obj = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad input
        raise UsageError(f"cannot load data file {path!r} with torch.load: {e}")
    if not isinstance(obj, dict) or "inputs" not in obj or "targets" not in obj:
        raise UsageError(f"data file {path!r} must hold a dict with keys 'inputs' and 'targets'")
    return obj


def load_dataset_file(path, in_size, out_size, loss):
    obj = _load_data_dict(path, "'fashion-mnist', 'synthetic:N'")
    X, Y = torch.as_tensor(obj["inputs"]), torch.as_tensor(obj["targets"])
    if X.dim() < 1:
        raise UsageError(f"data file {path!r}: 'inputs' must have a sample dimension, got a scalar")
    n = X.shape[0]
    if X.is_complex() or X.dtype == torch.bool:
        raise UsageError(f"data file {path!r}: 'inputs' dtype {X.dtype} is not a real number type")
    X = X.reshape(n, -1).to(torch.float32).contiguous()
    if X.shape[1] != in_size:
        raise UsageError(f"data file {path!r}: {X.shape[1]} inputs per sample, model expects IN={in_size}")
    if Y.dim() < 1 or Y.shape[0] != n:
        raise UsageError(f"data file {path!r}: 'targets' has shape {tuple(Y.shape)}, expected {n} rows "
                         f"like 'inputs'")
    if loss == "ce":
        if Y.dim() != 1 or Y.is_floating_point() or Y.is_complex() or Y.dtype == torch.bool:
            raise UsageError(f"data file {path!r}: loss ce needs integer class labels of shape [{n}], "
                             f"got {Y.dtype} {tuple(Y.shape)}")
        return X, _labels_for_loss(Y.to(torch.int64), out_size, loss, path)
    # mse
    if Y.dim() == 1 and not (Y.is_floating_point() or Y.is_complex()) and Y.dtype != torch.bool:
        return X, _labels_for_loss(Y.to(torch.int64), out_size, loss, path)  # labels -> one-hot
    if not Y.is_floating_point():
        raise UsageError(f"data file {path!r}: loss mse needs float targets [{n}, {out_size}] "
                         f"(or integer labels [{n}]), got {Y.dtype} {tuple(Y.shape)}")
    Y = Y.reshape(n, -1)
    if Y.shape[1] != out_size:
        raise UsageError(f"data file {path!r}: targets have {Y.shape[1]} values per sample, model has "
                         f"OUT={out_size}")
    return X, Y.to(torch.float32).contiguous()


def load_dataset(spec, in_size, out_size, loss, seed):
    """Feature data (X float32 [n, IN], Y) for the non-gpt models."""
    if is_token_spec(spec):
        raise UsageError(f"data {spec!r} is token data, for gpt:V-T-D-L-H models only")
    if spec in ("fashion-mnist", "fashion-mnist:train", "fashion-mnist:test"):
        return load_fashion_mnist("test" if spec.endswith(":test") else "train", in_size, out_size, loss)
    if spec.startswith("synthetic:"):
        s = spec[len("synthetic:"):]
        if not s.isdigit() or int(s) <= 0:
            raise UsageError(f"data spec {spec!r}: N in synthetic:N must be a positive integer")
        return load_synthetic(int(s), in_size, out_size, loss, seed)
    return load_dataset_file(spec, in_size, out_size, loss)


# Token data (gpt models) --------------------------------------------------------------------------
def is_token_spec(spec):
    """fortunes[:train|:test], text:PATH or text-test:PATH (byte-level text)."""
    return spec in ("fortunes", "fortunes:train", "fortunes:test") or spec.startswith(("text:", "text-test:"))


def fortune_files():
    """The fortune files: regular files directly in $GRADSYNC_FORTUNES_DIR (if set and non-empty) or
    /usr/share/games/fortunes whose name has no '.', no symlinks or directories, sorted by name bytes."""
    d = os.environ.get("GRADSYNC_FORTUNES_DIR") or DEFAULT_FORTUNES_DIR
    try:
        with os.scandir(d) as it:
            names = sorted(os.fsencode(e.name) for e in it
                           if "." not in e.name and e.is_file(follow_symlinks=False))
    except OSError as e:
        raise UsageError(f"cannot read the fortunes directory {d!r}: {e} (install the fortune files, e.g. "
                         f"`apt-get install fortunes-min`, or set $GRADSYNC_FORTUNES_DIR)")
    if not names:
        raise UsageError(f"the fortunes directory {d!r} has no fortune files (regular files whose name has "
                         f"no '.')")
    return [os.path.join(os.fsencode(d), n) for n in names]


def text_documents(data):
    """One file's bytes -> its documents (bytes), short ones included: lines split at b'\n' (a final line
    without '\n' counts, the empty remainder after a final '\n' does not); a line equal to b'%' ends the
    current document, any other line adds itself plus b'\n'; the document in progress at the end counts."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the empty remainder after a final '\n' (or an empty file) is not a line
    docs, doc = [], bytearray()
    for line in lines:
        if line == b"%":
            docs.append(bytes(doc))
            doc = bytearray()
        else:
            doc += line + b"\n"
    docs.append(bytes(doc))
    return docs


def document_sequences(docs, context):
    """Documents -> (inputs, targets) int64 [S, T]: a document d of n bytes gives, for start = 0, T, 2T, ...
    while start + 1 < n, chunk = d[start:start+T+1], inputs chunk[:-1] padded with 0, targets chunk[1:]
    padded with -100 to T. (Chunk k's inputs are d[:-1][kT:kT+T] and its targets d[1:][kT:kT+T].)"""
    T = context
    xs, ys = [], []
    for d in docs:
        a = np.frombuffer(d, dtype=np.uint8).astype(np.int64)
        n = a.shape[0]
        if n < 2:
            continue
        c = (n - 1 + T - 1) // T  # number of starts kT with kT + 1 < n
        x = np.zeros(c * T, dtype=np.int64)
        y = np.full(c * T, IGNORE, dtype=np.int64)
        x[:n - 1], y[:n - 1] = a[:-1], a[1:]
        xs.append(x.reshape(c, T))
        ys.append(y.reshape(c, T))
    if not xs:
        return torch.zeros((0, T), dtype=torch.int64), torch.zeros((0, T), dtype=torch.int64)
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def load_text_tokens(spec, vocab, context):
    """fortunes[:train|:test] / text:PATH / text-test:PATH -> byte tokens (module docstring, Token data)."""
    if vocab != 256:
        raise UsageError(f"data {spec!r} is byte-level text (256 token ids) but the model has V={vocab}; "
                         f"use a gpt:256-T-D-L-H model")
    if spec.startswith("fortunes"):
        paths, test = fortune_files(), spec == "fortunes:test"
    else:
        test = spec.startswith("text-test:")
        path = spec.split(":", 1)[1]
        if not path:
            raise UsageError(f"data spec {spec!r}: PATH is empty (text:PATH or text-test:PATH)")
        if not os.path.isfile(path):
            raise UsageError(f"data spec {spec!r}: {path!r} is not an existing file")
        paths = [path]
    docs = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UsageError(f"data {spec!r}: cannot read {os.fsdecode(path)!r}: {e}")
        docs.extend(d for d in text_documents(data) if len(d) >= 2)
    return document_sequences([d for i, d in enumerate(docs) if (i % 10 == 9) == test], context)


def load_token_file(path, vocab, context):
    """A gpt data file: {"inputs": int64 [S, L], "targets": int64 [S, L]}, 1 <= L <= T, inputs in [0, V),
    targets in [0, V) or -100. UsageError naming the key and what is wrong."""
    obj = _load_data_dict(path, "'fortunes[:train|:test]', 'text:PATH', 'text-test:PATH'")
    out = {}
    for key in ("inputs", "targets"):
        t = obj[key]
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"data file {path!r}: {key!r} is a {type(t).__name__}, expected an int64 tensor "
                             f"[S, L] of token ids")
        if t.dtype != torch.int64:
            raise UsageError(f"data file {path!r}: {key!r} has dtype {t.dtype}; a gpt model needs int64 token "
                             f"ids [S, L]")
        if t.dim() != 2:
            raise UsageError(f"data file {path!r}: {key!r} has shape {list(t.shape)}; a gpt model needs "
                             f"[S, L] (S sequences of L tokens, 1 <= L <= T={context})")
        out[key] = t.contiguous()
    X, Y = out["inputs"], out["targets"]
    if X.shape != Y.shape:
        raise UsageError(f"data file {path!r}: 'targets' has shape {list(Y.shape)} but 'inputs' "
                         f"{list(X.shape)}; they must be equal")
    if not 1 <= X.shape[1] <= context:
        raise UsageError(f"data file {path!r}: sequences of length L={X.shape[1]} ('inputs' {list(X.shape)}), "
                         f"but the model's context allows 1 <= L <= T={context}")
    for key, t, bad, allowed in (("inputs", X, (X < 0) | (X >= vocab), f"a token id in [0, V={vocab})"),
                                 ("targets", Y, ((Y < 0) | (Y >= vocab)) & (Y != IGNORE),
                                  f"a token id in [0, V={vocab}) or {IGNORE} (not trained on)")):
        if bool(bad.any()):
            i, j = bad.nonzero()[0].tolist()
            raise UsageError(f"data file {path!r}: {key}[{i}, {j}] = {int(t[i, j])} is not {allowed}")
    return X, Y


def load_tokens(spec, vocab, context):
    """Token data (X, Y) int64 [S, L] for a gpt model with vocabulary V and context T."""
    if spec in ("fashion-mnist", "fashion-mnist:train", "fashion-mnist:test") or spec.startswith("synthetic:"):
        raise UsageError(f"data {spec!r} is feature data; a gpt model takes token data: fortunes[:train|:test], "
                         f"text:PATH, text-test:PATH or a data file of int64 'inputs'/'targets' [S, L]")
    if is_token_spec(spec):
        return load_text_tokens(spec, vocab, context)
    return load_token_file(spec, vocab, context)


def load_model_data(data_spec, model_spec, loss, seed, dtype=torch.float32):
    """(X, Y) for a model: int64 tokens for gpt; otherwise load_dataset with the model's IN and OUT, the
    float tensors (inputs, mse targets) cast to dtype."""
    kind, sizes = parse_model_spec(model_spec)
    if kind == "gpt":
        if loss != "ce":
            raise UsageError(f"--loss {loss} does not apply to gpt models; they train with --loss ce")
        return load_tokens(data_spec, sizes[0], sizes[1])
    X, Y = load_dataset(data_spec, sizes[0], sizes[-1], loss, seed)
    return X.to(dtype), (Y.to(dtype) if Y.is_floating_point() else Y)


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description="Reference PyTorch trainer (see module docstring).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="mlp:IN-H...-OUT, mlp-bn:..., cnn:C1-C2-OUT, res:IN-H-B-OUT or gpt:V-T-D-L-H")
    p.add_argument("--data", required=True,
                   help="fashion-mnist | synthetic:N | PATH; gpt: fortunes[:train|:test] | text:PATH | "
                        "text-test:PATH | PATH")
    p.add_argument("--global-batch", type=int, required=True, metavar="B",
                   help="samples per optimizer step over all ranks and micro-steps")
    p.add_argument("--accumulate", type=int, default=1, metavar="K", help="micro-batches per step (1)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="expected world size; must equal $WORLD_SIZE")
    p.add_argument("--strategy", choices=["local", "ddp", *torch_fsdp.STRATEGIES], default="ddp",
                   help="local, ddp (DistributedDataParallel) or PyTorch's FSDP (torch_fsdp.py; torch 2.x)")
    p.add_argument("--wrap", default="none", metavar="SPEC",
                   help="FSDP units: none (default), children, type:T[,U] or list:A[,B] (torch_fsdp.py)")
    p.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="fully-shard-hsdp: replica groups of N/R shards each (1)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=None, help="learning rate (sgd 0.01, adam 1e-3)")
    p.add_argument("--momentum", type=float, default=None, help="SGD momentum (0)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--no-decay-1d", action="store_true",
                   help="no weight decay on parameters of one dimension (a second parameter group)")
    p.add_argument("--freeze", default="", metavar="PREFIX[,PREFIX...]",
                   help="freeze the parameters whose names start with a prefix")
    p.add_argument("--loss", choices=["ce", "mse"], default="ce")
    p.add_argument("--loss-reduction", choices=["mean", "sum"], default="mean")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, metavar="S", help="optimizer steps in total")
    g.add_argument("--epochs", type=int, default=None, metavar="E", help="whole epochs (default 1)")
    p.add_argument("--seed", type=int, default=0, help="model init, synthetic data and sampler seed (0)")
    p.add_argument("--shuffle", dest="shuffle", action="store_true", default=True,
                   help="DistributedSampler shuffle (default)")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    p.add_argument("--init-state", metavar="FILE", help="state dict (torch.save of a dict) to start from")
    p.add_argument("--save-state", metavar="FILE", help="rank 0 saves the final state dict here")
    p.add_argument("--save-optim", metavar="FILE", help="rank 0 saves the optimizer state keyed by parameter names")
    p.add_argument("--log", metavar="FILE.jsonl", help="rank 0 writes one JSON line per step")
    p.add_argument("--reduce-dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="fully-shard*: the gradient reduction dtype (MixedPrecisionPolicy(reduce_dtype=...)); "
                        "default the parameters'")
    p.add_argument("--comm-hook", default="none", metavar="none|fp16",
                   help="DDP gradient communication hook: none (default) or fp16 (fp16_compress_hook)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="model, float data and loss dtype (fp32)")
    return p


def validate(args, env_world):
    """Checks everything that does not need data; raises UsageError."""
    kind, _ = parse_model_spec(args.model)
    if kind == "gpt" and args.loss != "ce":
        raise UsageError(f"--loss {args.loss} does not apply to gpt models; they train with --loss ce "
                         f"(token cross-entropy)")
    if args.global_batch <= 0:
        raise UsageError(f"--global-batch must be > 0, got {args.global_batch}")
    if args.accumulate <= 0:
        raise UsageError(f"--accumulate must be > 0, got {args.accumulate}")
    if args.world_size is not None and args.world_size <= 0:
        raise UsageError(f"--world-size must be > 0, got {args.world_size}")
    if args.steps is not None and args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")
    if args.epochs is not None and args.epochs < 0:
        raise UsageError(f"--epochs must be >= 0, got {args.epochs}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.optimizer == "adam" and args.momentum is not None:
        raise UsageError("--momentum applies to --optimizer sgd only (Adam has betas), remove it")
    if args.lr is not None and not args.lr >= 0.0:
        raise UsageError(f"--lr must be >= 0, got {args.lr}")
    if args.momentum is not None and not args.momentum >= 0.0:
        raise UsageError(f"--momentum must be >= 0, got {args.momentum}")
    if not args.weight_decay >= 0.0:
        raise UsageError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.comm_hook == "bf16":
        raise UsageError("--comm-hook bf16 is not available: torch 1.13's bf16_compress_hook requires CUDA "
                         "11+ and NCCL 2.10+ and cannot run on the gloo/CPU backend; use none or fp16")
    if args.comm_hook not in ("none", "fp16"):
        raise UsageError(f"--comm-hook must be none or fp16, got {args.comm_hook!r}")
    if args.comm_hook != "none" and args.strategy != "ddp":
        raise UsageError(f"--comm-hook {args.comm_hook} applies to --strategy ddp only")
    fsdp = args.strategy in torch_fsdp.STRATEGIES
    if fsdp and int(torch.__version__.split(".")[0]) < 2:
        raise UsageError(f"--strategy {args.strategy} is PyTorch's FSDP on CPU, which needs torch 2.x; this "
                         f"Python has torch {torch.__version__}")
    if not fsdp and args.wrap != "none":
        raise UsageError(f"--wrap {args.wrap} applies to the FSDP strategies {', '.join(torch_fsdp.STRATEGIES)}")
    if args.reduce_dtype is not None and not args.strategy.startswith("fully-shard"):
        raise UsageError(f"--reduce-dtype {args.reduce_dtype} applies to --strategy fully-shard and fully-shard-hsdp")
    if args.replicas != 1 and args.strategy != "fully-shard-hsdp":
        raise UsageError(f"--replicas {args.replicas} applies to --strategy fully-shard-hsdp only")
    if args.strategy == "local":
        if args.world_size is not None and args.world_size != 1:
            raise UsageError(f"--strategy local is single-process; --world-size {args.world_size} "
                             f"needs --strategy ddp")
        if env_world is not None and env_world != 1:
            raise UsageError(f"--strategy local is single-process but was launched with WORLD_SIZE="
                             f"{env_world}; use --strategy ddp")
        world = 1
    else:
        world = env_world if env_world is not None else 1
        if args.world_size is not None and args.world_size != world:
            if env_world is None:
                raise UsageError(f"--world-size {args.world_size} but RANK/WORLD_SIZE are not set; launch "
                                 f"with `gradsync launch -n {args.world_size}` or torchrun")
            raise UsageError(f"--world-size {args.world_size} does not match WORLD_SIZE={env_world} "
                             f"from the launcher")
    if args.global_batch % (world * args.accumulate) != 0:
        raise UsageError(f"--global-batch {args.global_batch} is not divisible by world size {world} x "
                         f"--accumulate {args.accumulate} = {world * args.accumulate}")
    return world


def env_world_size():
    if "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        raise UsageError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                         f"from the environment are not integers")
    if world <= 0 or not 0 <= rank < world:
        raise UsageError(f"environment RANK={rank} WORLD_SIZE={world} is inconsistent")
    return world


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------
def make_optimizer(args, module):
    params = [p for p in module.parameters() if p.requires_grad]
    if args.no_decay_1d:
        params = [{"params": [p for p in params if p.dim() > 1]},
                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.01 if args.lr is None else args.lr,
                               momentum=args.momentum or 0.0, weight_decay=args.weight_decay)
    return torch.optim.Adam(params, lr=1e-3 if args.lr is None else args.lr,
                            weight_decay=args.weight_decay)


def named_optim_state(module, optimizer):
    """optimizer.state_dict() keyed by parameter names instead of ids (FSDP.full_optim_state_dict's layout)."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    state = {order[i]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    groups = [dict(g, params=[order[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def freeze(module, prefixes):
    for prefix in filter(None, prefixes.split(",")):
        hits = [p for n, p in module.named_parameters() if n.startswith(prefix)]
        if not hits:
            raise UsageError(f"--freeze {prefix}: no parameter name starts with it")
        for p in hits:
            p.requires_grad_(False)


def no_token_message(rank, step, epoch, j, group, count):
    return (f"rank {rank}, step {step} (epoch {epoch}): micro-batch {j + 1} of {group} has no valid token (all "
            f"{count} targets are {IGNORE}), so its token mean is 0/0 under --loss-reduction mean; use "
            f"--loss-reduction sum, or gradsync's --reduction global-mean")


def check_token_means(Y, world, shuffle, seed, b, K, micro_per_epoch, steps_per_epoch, total_steps):
    """--loss-reduction mean on token data: UsageError naming the first step (then the lowest rank) at which
    some rank's micro-batch has no target other than -100. Every rank runs the same check over every rank's
    DistributedSampler indices, so all ranks fail alike before the process group starts."""
    valid = (Y != IGNORE).reshape(Y.shape[0], -1).any(dim=1)
    if bool(valid.all()) or total_steps == 0:
        return
    n = Y.shape[0]
    for epoch in range((total_steps + steps_per_epoch - 1) // steps_per_epoch):
        steps_here = min(steps_per_epoch, total_steps - epoch * steps_per_epoch)
        micro_here = min(micro_per_epoch, steps_here * K)
        found = []
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                         drop_last=False)
            sampler.set_epoch(epoch)
            idx = torch.tensor(list(sampler), dtype=torch.int64)
            for m in range(micro_here):
                chunk = idx[m * b:(m + 1) * b]
                if not bool(valid[chunk].any()):
                    found.append((epoch * steps_per_epoch + m // K, rank, m % K, chunk.numel() * Y.shape[1]))
                    break
        if found:
            step, rank, j, count = min(found)
            group = min(K, micro_per_epoch - (step - epoch * steps_per_epoch) * K)
            raise UsageError(no_token_message(rank, step, epoch, j, group, count))


def train(args, world, X, Y, tmpdir):
    ddp = args.strategy == "ddp"
    fsdp = args.strategy in torch_fsdp.STRATEGIES
    distributed = ddp or fsdp
    gpt = parse_model_spec(args.model)[0] == "gpt"
    torch.manual_seed(args.seed)
    module = build_model(args.model)
    if args.init_state:
        load_init_state(module, args.init_state, args.model)
    module.to(DTYPES[args.dtype])
    freeze(module, args.freeze)

    K = args.accumulate
    b = args.global_batch // (world * K)
    dataset = TensorDataset(X, Y)
    n = len(dataset)
    per_rank = (n + world - 1) // world  # DistributedSampler(drop_last=False) pads to ceil(n / N) per rank
    micro_per_epoch = (per_rank + b - 1) // b  # DataLoader(drop_last=False) batches: len(loader)
    steps_per_epoch = (micro_per_epoch + K - 1) // K
    if args.steps is not None:
        total_steps = args.steps
    else:
        total_steps = (1 if args.epochs is None else args.epochs) * steps_per_epoch
    if gpt and args.loss_reduction == "mean":
        check_token_means(Y, world, args.shuffle, args.seed, b, K, micro_per_epoch, steps_per_epoch, total_steps)

    units = []
    if fsdp:
        try:
            units = torch_fsdp.units(module, args.wrap)
            torch_fsdp.check_replicas(args.strategy, world, args.replicas)
        except torch_fsdp.WrapError as e:
            raise UsageError(str(e))

    # The process group starts only after every input was validated, so bad inputs fail fast on all ranks.
    rank = 0
    if distributed:
        if "RANK" in os.environ:
            dist.init_process_group("gloo")  # env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
        else:
            store = dist.FileStore(os.path.join(tmpdir, "filestore"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        rank = dist.get_rank()
        assert dist.get_world_size() == world, (dist.get_world_size(), world)
    model = DistributedDataParallel(module) if ddp else module
    if fsdp:
        model = torch_fsdp.wrap(module, args.strategy, units, world, args.replicas, args.reduce_dtype)

    def no_sync(m):
        return torch_fsdp.without_reduction(m, args.strategy) if fsdp else m.no_sync()
    if ddp and args.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    model.train()

    optimizer = make_optimizer(args, module)
    if gpt:  # token cross-entropy over the micro-batch's valid targets
        def criterion(logits, y):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE,
                                   reduction=args.loss_reduction)
    else:
        criterion = (nn.CrossEntropyLoss if args.loss == "ce" else nn.MSELoss)(reduction=args.loss_reduction)

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=args.shuffle,
                                 seed=args.seed, drop_last=False)
    loader = DataLoader(dataset, batch_size=b, sampler=sampler, shuffle=False, drop_last=False)
    assert len(loader) == micro_per_epoch, (len(loader), micro_per_epoch)

    log = open(args.log, "w") if (args.log and rank == 0) else None
    step, epoch = 0, 0
    try:
        while step < total_steps:
            sampler.set_epoch(epoch)
            it = iter(loader)
            done = 0  # micro-batches consumed in this epoch
            while done < micro_per_epoch and step < total_steps:
                t0 = time.perf_counter()
                group = min(K, micro_per_epoch - done)
                loss_sum, samples = 0.0, 0
                for j in range(group):
                    x, y = next(it)
                    sync = (not distributed) or j == group - 1
                    with (contextlib.nullcontext() if sync else no_sync(model)):
                        try:
                            out = model(x)
                        except ValueError as e:
                            if "Expected more than 1 value per channel" not in str(e):
                                raise
                            raise UsageError(
                                f"step {step} (epoch {epoch}): a micro-batch of {x.shape[0]} sample reaches "
                                f"BatchNorm1d in training mode, which needs more than 1 value per channel "
                                f"(torch: {e}); change --global-batch/--accumulate/--world-size or the data "
                                f"size so no rank's micro-batch has a single sample")
                        if gpt and args.loss_reduction == "mean" and not bool((y != IGNORE).any()):
                            # check_token_means() rules this out before training; kept as a guard
                            raise UsageError(no_token_message(rank, step, epoch, j, group, y.numel()))
                        loss = criterion(out, y) / group
                        loss.backward()
                    loss_sum += float(loss.detach())
                    samples += x.shape[0]
                optimizer.step()
                optimizer.zero_grad()
                done += group
                if args.log:
                    if distributed:
                        t = torch.tensor([loss_sum, float(samples)], dtype=torch.float64)
                        dist.all_reduce(t, op=dist.ReduceOp.SUM)
                        loss_sum, samples = float(t[0]) / world, int(round(float(t[1])))
                    if log is not None:
                        rec = {"step": step, "epoch": epoch, "loss": loss_sum, "samples": samples,
                               "seconds": time.perf_counter() - t0}
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                step += 1
            epoch += 1
    finally:
        if log is not None:
            log.close()

    save_results(args, rank, module, model, optimizer)
    if distributed:
        dist.barrier()  # every rank has written what it writes
        # No teardown at all: torch 1.13's can deadlock (below), also without a comm hook when the machine is busy.
        exit_without_destructors(tmpdir)


def save_results(args, rank, module, model, optimizer):
    """--save-state and --save-optim on rank 0; under FSDP every rank takes part in gathering them."""
    if args.strategy in torch_fsdp.STRATEGIES:
        state = torch_fsdp.full_state(model) if args.save_state else None
        optim = torch_fsdp.full_optim_state(model, optimizer) if args.save_optim else None
    else:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()} if args.save_state else None
        optim = named_optim_state(module, optimizer) if args.save_optim and rank == 0 else None
    if state is not None and rank == 0:
        torch.save(state, args.save_state)
    if optim is not None and rank == 0:
        torch.save(optim, args.save_optim)


def load_init_state(module, path, model):
    """--init-state: a state dict that fits `module` exactly (UsageError naming the file otherwise)."""
    try:
        state = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad input
        raise UsageError(f"cannot load --init-state {path!r}: {e}")
    if not isinstance(state, dict):
        raise UsageError(f"--init-state {path!r} holds a {type(state).__name__}, expected a state dict")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise UsageError(f"--init-state {path!r} does not fit model {model!r}: {e}")


def exit_without_destructors(tmpdir):
    """Leaves the process once everything is written, without running destructors: torch 1.13 can deadlock
    when the DDP Reducer is destroyed at exit (~ProcessGroupGloo joins a Gloo thread that waits for the GIL the
    destroying main thread holds; seen under load with a Python comm hook, with Join's pending work, and once in
    a plain DDP run on a busy machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    shutil.rmtree(tmpdir, ignore_errors=True)
    os._exit(0)


def set_up_torch():
    """OMP_NUM_THREADS torch threads (1 when unset or invalid) and deterministic algorithms."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else 1)
    torch.use_deterministic_algorithms(True)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    set_up_torch()
    try:
        world = validate(args, env_world_size())
    except UsageError as e:
        parser.error(str(e))  # prints the usage too
    try:
        X, Y = load_model_data(args.data, args.model, args.loss, args.seed, DTYPES[args.dtype])
        if X.shape[0] == 0:
            raise UsageError(f"data {args.data!r} has no samples")
        with tempfile.TemporaryDirectory(prefix="torch_train_") as tmpdir:
            train(args, world, X, Y, tmpdir)
    except UsageError as e:  # bad data/state files or a run the configuration cannot do
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
