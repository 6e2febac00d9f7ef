"""CuPy under libvramguard.so: the quota as CuPy sees it, and refusal past it, with CuPy's
default memory pool and with its stream-ordered pool (`cupy.cuda.MemoryAsyncPool`, which
allocates through cuMemAllocFromPoolAsync). Prints one JSON line per pool; exit status 0 when
every check held. Run with LD_PRELOAD and CUDA_DEVICE_MEMORY_LIMIT set (see run.sh).
"""
import json
import sys

import cupy

limit = int(sys.argv[1])
failed = False
for name in ("default", "async"):
    if name == "async":
        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    free, total = cupy.cuda.runtime.memGetInfo()
    checks = {"total_is_quota": total == limit}
    blocks = []
    result = {"pool": name, "limit": limit, "mem_get_info": [free, total]}
    try:
        while len(blocks) * (64 << 20) <= 2 * limit:
            blocks.append(cupy.empty(64 << 20, dtype=cupy.uint8))
        checks["refused_past_quota"] = False
    except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError) as error:
        # The async pool reports the driver's refusal as cudaErrorMemoryAllocation.
        text = str(error)
        checks["refused_past_quota"] = "out of memory" in text.lower() or "MemoryAllocation" in text
        result["refused_after_bytes"] = len(blocks) * (64 << 20)
        result["error"] = str(error).splitlines()[0]
    del blocks
    cupy.get_default_memory_pool().free_all_blocks()
    result["checks"] = checks
    print(json.dumps(result), flush=True)
    failed = failed or not all(checks.values())
sys.exit(1 if failed else 0)
