"""An honest PyTorch job near its quota with the stream-ordered allocator (issue 23's false kill).

Run under libvramguard.so with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (truth.sh):
ROUNDS rounds of filling PEAK bytes in 256 MiB tensors, a synchronize, a hold, freeing them all
and a synchronize, then a hold. PyTorch's async backend sets its pool's release threshold to
the maximum, so the pool keeps what was freed: the driver (NVML) goes on reporting it while
the probes saw it freed. Prints `peak N` and `freed N` lines; exits 0 when every round ran.
"""
import sys
import time

import torch

peak, rounds, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
block = 256 << 20
for n in range(1, rounds + 1):
    blocks = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(peak // block)]
    torch.cuda.synchronize()
    print(f"peak {n} {len(blocks) * block}", flush=True)
    time.sleep(hold)
    del blocks
    torch.cuda.synchronize()
    print(f"freed {n} reserved {torch.cuda.memory_reserved()}", flush=True)
    time.sleep(hold)
print("done", flush=True)
