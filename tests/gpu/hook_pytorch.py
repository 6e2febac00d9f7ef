"""One PyTorch process under libvramguard.so: the quota as PyTorch sees it, and refusal past it.

Prints one JSON line. Exit status 0 when every check held. Run with LD_PRELOAD and
CUDA_DEVICE_MEMORY_LIMIT set (see run.sh); PYTORCH_CUDA_ALLOC_CONF selects the allocator mode.
"""
import json
import os
import sys

import torch

limit = int(sys.argv[1])
mode = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
result = {"mode": mode, "limit": limit}
free, total = torch.cuda.mem_get_info()
result["mem_get_info"] = [free, total]
checks = {"total_is_quota": total == limit}
blocks = []
try:
    while True:
        blocks.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
        if len(blocks) * (64 << 20) > 2 * limit:
            break
    checks["refused_past_quota"] = False
except torch.OutOfMemoryError as error:
    checks["refused_past_quota"] = True
    result["refused_after_bytes"] = len(blocks) * (64 << 20)
    result["error"] = str(error).splitlines()[0]
result["checks"] = checks
print(json.dumps(result))
sys.exit(0 if all(checks.values()) else 1)
