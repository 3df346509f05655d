"""zero1_overlapped's buckets in flight together, step after step, beside another collective:
the pattern in which gloo's coalesced all-gathers corrupted the heap (run by
tests/test_zero_overlap_stress.py under torchrun on 2 CPU ranks; a corrupted heap aborts
the process)."""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

import functopt
from functopt.distributed import zero1_overlapped


def main(steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(n).to(torch.bfloat16)
              for i, n in enumerate([256, 64, 1000, 7, 300, 33, 128, 90])}
    opt = zero1_overlapped(functopt.sgd(1e-3), bucket_bytes=256)
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    grads = {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}
    for _ in range(steps):
        pending, state = opt.step(grads, state, params)
        other = torch.ones(1)
        dist.all_reduce(other)  # while the buckets are on the wire
        params = pending.wait()
    total = torch.stack([p.float().sum() for p in params.values()]).sum().reshape(1)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    if rank == 0:
        print(f"steps {steps}, ranks agree: {all(torch.equal(x, gathered[0]) for x in gathered)}")


def teardown() -> None:
    """With ``main``'s optimizer, state and handles gone (it returned), free any cycle among
    them, let every rank leave the last collective, then destroy the group: left to
    interpreter shutdown, gloo's worker threads can outlive what they use and abort."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
    teardown()
