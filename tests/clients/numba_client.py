"""Drives numba-cuda over the (fake) driver, one step per argument, printing one line per
step for the e2e test (tests/e2e/tests/clients.rs) to assert.

Steps: `meminfo` (the current context's free and total memory); `array SIZE` (a device
array of SIZE bytes: `cuda.device_array`; over the quota numba raises, and the line names the
exception and its CUDA error); `managed SIZE` (`cuda.managed_array`, filled and summed by
the host). SIZE takes k/m/g suffixes. Arrays stay held until the process exits.
"""
import sys

import numpy as np
from numba import cuda

UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
held = []


def size(text):
    if text[-1] in UNITS:
        return int(text[:-1]) * UNITS[text[-1]]
    return int(text)


def main(steps):
    dev = cuda.get_current_device()
    print(f"device {dev.name.decode() if isinstance(dev.name, bytes) else dev.name} cc={dev.compute_capability[0]}.{dev.compute_capability[1]}", flush=True)
    for step in steps:
        op, _, arg = step.partition(" ")
        if op == "meminfo":
            free, total = cuda.current_context().get_memory_info()
            print(f"meminfo free={free} total={total}", flush=True)
        elif op == "array":
            try:
                held.append(cuda.device_array(size(arg), dtype=np.uint8))
                print(f"array {arg} ok", flush=True)
            except Exception as e:  # the test asserts which exception and error
                print(f"array {arg} error {type(e).__name__}: {e}", flush=True)
        elif op == "managed":
            n = size(arg)
            m = cuda.managed_array(n, dtype=np.uint8)
            m[:] = 2
            held.append(m)
            print(f"managed {arg} sum={int(m.sum())}", flush=True)
        else:
            raise SystemExit(f"unknown step {step!r}")


if __name__ == "__main__":
    # The e2e kit passes `-- STEP...`.
    main([a for a in sys.argv[1:] if a != "--"])
