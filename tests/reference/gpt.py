#!/usr/bin/python3
"""The reference GPT language model for gradsync's `gpt:V-T-D-L-H` model spec, in real PyTorch.

Reference tooling (python3-torch 1.13), never part of the product. Imported by torch_train.py and
make_case.py; run it directly (/usr/bin/python3 gpt.py --help) only to print this contract, or with
`--keys V-T-D-L-H` to print the state-dict keys and shapes of a model, one per line.

Model gpt:V-T-D-L-H: vocabulary V, context T, width D, L blocks, H heads (all > 0, D % H == 0).
  Attention(D, H)   qkv = Linear(D, 3D, bias=False), proj = Linear(D, D); causal self-attention written
                    out: q, k, v = qkv(x).split(D, dim=2), each viewed [B, T, H, D/H] and transposed to
                    [B, H, T, D/H]; att = (q @ k^T) * (1 / sqrt(D/H)), entries above the diagonal set to
                    -inf, softmax over the last dimension; proj((att @ v) transposed back to [B, T, D]).
  Mlp(D)            fc = Linear(D, 4D), exact (erf) GELU, proj = Linear(4D, D).
  Block(D, H)       ln1 = LayerNorm(D), attn, ln2 = LayerNorm(D), mlp;
                    x = x + attn(ln1(x)); x = x + mlp(ln2(x)).
  Gpt(V, T, D, L, H) wte = Embedding(V, D), wpe = Embedding(T, D), blocks = ModuleList of L Blocks,
                    ln_f = LayerNorm(D); forward(idx [B, L'], L' <= T) -> logits [B, L', V]:
                    x = wte(idx) + wpe(arange(L')); x = block(x) for each block;
                    logits = ln_f(x) @ wte.weight^T (the output layer is wte itself, tied).
  LayerNorm eps is the default 1e-5.

State-dict keys, in this order: wte.weight, wpe.weight, then per block i = 0 .. L-1:
  blocks.<i>.ln1.weight, blocks.<i>.ln1.bias, blocks.<i>.attn.qkv.weight, blocks.<i>.attn.proj.weight,
  blocks.<i>.attn.proj.bias, blocks.<i>.ln2.weight, blocks.<i>.ln2.bias, blocks.<i>.mlp.fc.weight,
  blocks.<i>.mlp.fc.bias, blocks.<i>.mlp.proj.weight, blocks.<i>.mlp.proj.bias;
then ln_f.weight, ln_f.bias. (No buffers; the causal mask is built in forward.)

Initialisation, init_gpt_(model), after construction: for every module in model.modules() order, an
nn.Linear or nn.Embedding weight ~ normal(0, 0.02) drawn from the global torch RNG (weights only, in that
order), nn.Linear biases 0, nn.LayerNorm weight 1 and bias 0. make_gpt(V, T, D, L, H) builds and
initialises one (the caller seeds the global RNG first; torch_train.py uses torch.manual_seed(--seed)).
The C++ side uses the same scheme but its random bits differ: parity tests start both from --init-state.
"""
import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class UsageError(Exception):
    """A bad argument or input; reported as `<prog>: error: ...` with exit status 2.

    Defined here (torch_train.py imports it from this module) so that every reference script raises and
    catches the one class without gpt.py importing torch_train.py."""


class Attention(nn.Module):
    """Causal self-attention, written out (keys qkv.weight, proj.weight, proj.bias)."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // self.h))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, D))


class Mlp(nn.Module):
    """fc = Linear(d, 4d), exact (erf) GELU, proj = Linear(4d, d)."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))  # approximate='none': the erf GELU


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, h)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    """gpt:V-T-D-L-H; forward(idx int64 [B, L'], L' <= T) -> logits [B, L', V] (output layer tied to wte)."""

    def __init__(self, vocab, context, d, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


def init_gpt_(model):
    """Linear/Embedding weights ~ N(0, 0.02) from the global RNG in model.modules() order; Linear biases 0;
    LayerNorm weight 1, bias 0. Returns the model."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
    return model


def check_gpt_sizes(vocab, context, d, layers, heads, what="gpt"):
    """UsageError unless every size is > 0 and D is divisible by H."""
    sizes = [vocab, context, d, layers, heads]
    if any(s <= 0 for s in sizes):
        raise UsageError(f"{what}: V, T, D, L and H must all be > 0, got {'-'.join(map(str, sizes))}")
    if d % heads != 0:
        raise UsageError(f"{what}: width D={d} is not divisible by the number of heads H={heads}")


def make_gpt(vocab, context, d, layers, heads):
    """Gpt(V, T, D, L, H) initialised by init_gpt_ (global RNG); UsageError for bad sizes."""
    check_gpt_sizes(vocab, context, d, layers, heads, f"gpt:{vocab}-{context}-{d}-{layers}-{heads}")
    return init_gpt_(Gpt(vocab, context, d, layers, heads))


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpt.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", metavar="V-T-D-L-H", help="print the state-dict keys and shapes of that model")
    args = p.parse_args(argv)
    if args.keys is None:
        p.print_help()
        return 0
    try:
        sizes = [int(s) for s in args.keys.split("-")]
    except ValueError:
        sizes = []
    if len(sizes) != 5:
        p.error(f"--keys {args.keys!r}: expected V-T-D-L-H, five integers")
    try:
        model = make_gpt(*sizes)
    except UsageError as e:
        p.error(str(e))
    for k, v in model.state_dict().items():
        print(k, list(v.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
