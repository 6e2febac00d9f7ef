"""An un-hooked PyTorch process taking 256 MiB blocks until LIMIT bytes (or it is stopped).

truth.sh runs it in the cgroup of a hooked job: the probes must stop it (SIGKILL under
`--enforce signal`) before its allocations take the cgroup past the ledger's limit. Prints
the bytes it holds after each block. With GO, it makes its context, prints `ready`, and waits
for the file GO before it allocates.
"""
import os
import sys
import time

import torch

limit = int(sys.argv[1])
torch.cuda.init()
torch.empty(1, device="cuda")
print(f"ready {os.getpid()}", flush=True)
while len(sys.argv) > 2 and not os.path.exists(sys.argv[2]):
    time.sleep(0.02)
blocks = []
while len(blocks) * (256 << 20) < limit:
    blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    print(f"holds {len(blocks) * (256 << 20)}", flush=True)
print("not stopped", flush=True)
