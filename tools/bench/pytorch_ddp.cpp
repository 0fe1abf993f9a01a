// The python3-torch side of `gradsync bench --compare-pytorch` (see bench.h): PyTorch's DDP recipe, or for
// fsdp-full its FSDP2 `fully_shard` on the same units (torch 2.x), on the same model, per-rank batch, threads and
// world size, each step timed as `gradsync train` times its steps (forward, backward, optimizer step, zero_grad, the
// loss read back). python3-torch is a reference, never a dependency: only this flag runs it.
#include "bench/bench.h"

namespace gradsync::cli {

namespace {

// Data, not logic: the program's text, written to a temp file by bench_step.cpp.
constexpr const char* kProgram = R"py(
import argparse, json, math, os, time
import torch, torch.nn as nn, torch.distributed as dist

def wchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return -1

def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1

class Block(nn.Module):
    def __init__(self, h):
        super().__init__(); self.norm = nn.LayerNorm(h); self.fc = nn.Linear(h, h)
    def forward(self, h):
        return h + self.fc(torch.relu(self.norm(h)))

class Res(nn.Module):
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

class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__(); self.h = h; self.qkv = nn.Linear(d, 3 * d, bias=False); self.proj = nn.Linear(d, d)
    def forward(self, x):
        B, T, D = x.shape; q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // self.h))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, D))

class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__(); self.fc = nn.Linear(d, 4 * d); self.proj = nn.Linear(4 * d, d)
    def forward(self, x):
        return self.proj(nn.functional.gelu(self.fc(x)))

class GptBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d); self.attn = Attention(d, h); self.ln2 = nn.LayerNorm(d); self.mlp = Mlp(d)
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

class Gpt(nn.Module):
    def __init__(self, v, t, d, l, h):
        super().__init__()
        self.wte = nn.Embedding(v, d); self.wpe = nn.Embedding(t, d)
        self.blocks = nn.ModuleList([GptBlock(d, h) for _ in range(l)]); self.ln_f = nn.LayerNorm(d)
    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()

def build(spec):
    kind, sizes = spec.split(":")
    sizes = [int(s) for s in sizes.split("-")]
    if kind == "gpt":
        return Gpt(*sizes), sizes
    if kind == "cnn":
        c1, c2, out = sizes
        return nn.Sequential(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(c2 * 7 * 7, out)), [784, out]
    if kind == "res":
        return Res(*sizes), [sizes[0], sizes[-1]]
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            if kind == "mlp-bn":
                layers.append(nn.BatchNorm1d(sizes[i + 1]))
            layers.append(nn.ReLU())
    return nn.Sequential(*layers), sizes

def units(model, spec):
    """The submodules fully_shard wraps before the root, by gradsync's --wrap names (children, type:, list:)."""
    trainable = lambda m: any(q.requires_grad for q in m.parameters())
    if spec == "none":
        return []
    if spec == "children":
        def elements(m, prefix):
            if isinstance(m, (nn.Sequential, nn.ModuleList)):
                return list(m.children())
            return [e for c in m.children() for e in elements(c, prefix)]
        return [m for m in (elements(model, "") or list(model.children())) if trainable(m)]
    kind, _, names = spec.partition(":")
    wanted = set(names.split(","))
    if kind == "type":
        def typed(m):
            return [c for c in m.children() for c in ([c] if type(c).__name__ in wanted else typed(c))]
        return [m for m in typed(model) if trainable(m)]
    if kind == "list":
        return [m for n, m in model.named_modules() if n in wanted]
    raise SystemExit(f"pytorch_ddp.py: --fully-shard {spec!r}: expected none, children, type:T[,U] or list:A[,B]")

def fully_shard_model(model, spec):
    if int(torch.__version__.split(".")[0]) < 2:
        raise SystemExit(f"pytorch_ddp.py: fully_shard on CPU needs torch 2.x, this is torch {torch.__version__}")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in reversed(units(model, spec)):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)

def main():
    p = argparse.ArgumentParser()
    for name in ("--model", "--out"):
        p.add_argument(name, required=True)
    for name in ("--per-rank-batch", "--steps", "--warmup", "--threads"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--fully-shard", metavar="UNITS", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, sizes = build(a.model)
    rank = 0
    if a.ddp or a.fully_shard is not None:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if a.fully_shard is not None:
            model = fully_shard_model(model, a.fully_shard)
        else:
            model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    gpt = a.model.startswith("gpt:")
    if gpt:  # every position a target: sequences of the context's length (V, T = sizes[0], sizes[1])
        x = torch.randint(0, sizes[0], (a.per_rank_batch, sizes[1]), generator=g)
        y = torch.randint(0, sizes[0], (a.per_rank_batch, sizes[1]), generator=g)
    else:
        x = torch.randn(a.per_rank_batch, sizes[0], generator=g)
        y = torch.randint(0, sizes[-1], (a.per_rank_batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    times, sent = [], []
    for step in range(a.warmup + a.steps):
        w0, t0 = wchar(), time.perf_counter()
        out = model(x)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if gpt else loss_fn(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        float(loss)
        t = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(t)
            sent.append(wchar() - w0)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_seconds": times, "sent": sent, "rss_peak": peak_rss()}, f)
    if a.ddp or a.fully_shard is not None:
        dist.barrier()
        dist.destroy_process_group()

main()
)py";

}  // namespace

const char* pytorch_ddp_program() { return kProgram; }

}  // namespace gradsync::cli
