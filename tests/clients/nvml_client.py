"""Reads NVML through nvidia-ml-py (pynvml), as monitoring tools do, and prints one line per
device for the e2e test (tests/e2e/tests/clients.rs) to assert: index, name, memory
(total/used/free) and the compute processes with their memory.
"""
import pynvml as n


def text(v):
    return v.decode() if isinstance(v, bytes) else v


def main():
    n.nvmlInitWithFlags(0)
    print(f"driver {text(n.nvmlSystemGetDriverVersion())}", flush=True)
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        procs = n.nvmlDeviceGetComputeRunningProcesses(h)
        listed = ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs)
        print(
            f"device index={n.nvmlDeviceGetIndex(h)} name={text(n.nvmlDeviceGetName(h)).replace(' ', '_')} "
            f"total={mem.total} used={mem.used} free={mem.free} processes={listed}",
            flush=True,
        )
    n.nvmlShutdown()


if __name__ == "__main__":
    main()
