"""Fills what the quota allows in 64 MiB blocks, then holds for a while (run.sh starts 8)."""
import sys
import time

import torch

blocks = []
try:
    while True:
        blocks.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    pass
print(f"held {len(blocks) * 64} MiB", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 10)
