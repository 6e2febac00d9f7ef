"""An honest job at its quota on three streams and in a CUDA graph (truth.sh `streams` part).

Run under libvramguard.so with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync. It warms up
a training step (cuBLAS's handle and workspace made, as a real job makes them first) and
captures it in a CUDA graph, then fills its quota from three streams in 32, 64 and 96 MiB
blocks until the hook refuses one, frees every other block (the pool's free part then lies in pieces no larger than 96 MiB), and asks for
512 MiB on the first stream: no piece holds it, so the pool would grow past the quota and the
hook gives the growth back (docs/gpu.md). Whether that is granted or refused is printed. Then it
gives back half of what it holds and replays the graph on the three streams, each replay beside
a block from the pool, for SECONDS.

Prints `filled`, `big granted|refused`, `training`, `done N`. Exit 0: done; 4: a step was
refused while it trained (torch.OutOfMemoryError, or a graph launch out of memory: the graph's
outputs, freed outside it, take new memory at each replay, which the default pool's reserve may
not leave room for, on a device of the quota's size as under the hook). The agent must never
stop it (137), and the driver must never hold more for it than its quota (truth.sh checks NVML).
"""
import sys
import time

import torch

seconds = float(sys.argv[1])
MIB = 1 << 20
streams = [torch.cuda.Stream() for _ in range(3)]
sizes = [32 * MIB, 64 * MIB, 96 * MIB]
model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 2048, device="cuda")

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with torch.cuda.graph(graph):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
graph.replay()
torch.cuda.synchronize()

held = []
try:
    while True:
        with torch.cuda.stream(streams[len(held) % 3]):
            held.append(torch.empty(sizes[len(held) % 3], dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    pass
filled = sum(t.numel() for t in held)
held = held[1::2]
torch.cuda.synchronize()
print(f"filled {filled // MIB} MiB in {len(held) * 2} blocks, kept {sum(t.numel() for t in held) // MIB} MiB, reserved {torch.cuda.memory_reserved() // MIB} MiB", flush=True)
try:
    with torch.cuda.stream(streams[0]):
        big = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print(f"big granted reserved {torch.cuda.memory_reserved() // MIB} MiB", flush=True)
    del big
except torch.OutOfMemoryError as error:
    print(f"big refused reserved {torch.cuda.memory_reserved() // MIB} MiB: {str(error).splitlines()[0][:120]}", flush=True)
del held[: len(held) // 2]
torch.cuda.synchronize()
print(f"training reserved {torch.cuda.memory_reserved() // MIB} MiB", flush=True)
steps, end = 0, time.time() + seconds
try:
    while time.time() < end:
        stream = streams[steps % 3]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.replay()
            scratch = torch.empty(sizes[steps % 3], dtype=torch.uint8, device="cuda")
            del scratch
        torch.cuda.current_stream().wait_stream(stream)
        steps += 1
    torch.cuda.synchronize()
except RuntimeError as error:  # torch.OutOfMemoryError, or a graph launch's CUDA error
    if "out of memory" not in str(error):
        raise
    reason = str(error).splitlines()[0][:120]
    # What the hook shows free of the quota (cuMemGetInfo_v2: the quota less what its ledger
    # holds): a refusal at the quota leaves little.
    free = torch.cuda.mem_get_info()[0]
    print(f"refused after {steps} steps: reserved={torch.cuda.memory_reserved() // MIB} MiB quota_free={free // MIB} MiB: {reason}", flush=True)
    sys.exit(4)
print(f"done {steps}", flush=True)
