"""An independent PyTorch DDP step timing, to cross-check `gradsync bench --compare-pytorch` (docs/performance.md).

Written apart from the bench's embedded program and run under torchrun instead of `gradsync launch`:
  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 --redirects 1 --tee 1 bench/torch_ddp_step.py
Prints rank 0's median step time (forward, backward, SGD step, zero_grad) over 3 x 20 steps after 5 warm-up.
"""
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WIDTHS = [1024, 1024, 1024, 1024, 1024, 10]
PER_RANK_BATCH = 64


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layers = []
    for i in range(len(WIDTHS) - 1):
        layers.append(nn.Linear(WIDTHS[i], WIDTHS[i + 1]))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(PER_RANK_BATCH, WIDTHS[0])
    y = torch.randint(0, WIDTHS[-1], (PER_RANK_BATCH,))
    times = []
    for step in range(5 + 60):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        if step >= 5:
            times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"torch DDP step median {statistics.median(times) * 1e3:.2f} ms over {len(times)} steps")
    dist.destroy_process_group()


main()
