"""An honest training job at its quota (run under libvramguard.so by truth.sh, `train` part).

A transformer encoder and a convolution trained in bf16 autocast with AdamW (cuBLAS, cuDNN and
attention kernels loaded, as a real job loads them); after two steps (the second measured:
what a step takes beyond what the job holds between steps) it takes 64 MiB blocks until the
hook refuses one (the quota reached), gives back to the allocator a step's need and a quarter
more, and trains on for SECONDS. Prints `training` when it starts to, `done N` after N
steps. Exit 0: done; 4: a step was refused (torch.OutOfMemoryError) while it trained, with
what the allocator held from the driver then.
"""
import sys
import time

import torch
import torch.nn.functional as F

seconds = float(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True), 4).cuda()
conv = torch.nn.Conv2d(64, 128, 3, padding=1).cuda()
opt = torch.optim.AdamW(list(model.parameters()) + list(conv.parameters()))
tokens = torch.randn(8, 512, 1024, device="cuda")
images = torch.randn(16, 64, 128, 128, device="cuda")


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens).float().square().mean() + conv(images).float().square().mean()
        loss = loss + F.scaled_dot_product_attention(tokens[:, None], tokens[:, None], tokens[:, None]).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
torch.cuda.synchronize()
try:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    need = torch.cuda.max_memory_allocated() - base
except RuntimeError:  # an allocator that keeps no such figures
    need = 2 << 30
block = 64 << 20
give_back = -(-(need + need // 4) // block)
blocks = []
try:
    while True:
        blocks.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    pass
del blocks[-give_back:]
torch.cuda.synchronize()
print(f"training filled={len(blocks) * 64} MiB step_needs={need >> 20} MiB gave_back={give_back * 64} MiB reserved={torch.cuda.memory_reserved() >> 20} MiB", flush=True)
steps, end = 0, time.time() + seconds
try:
    while time.time() < end:
        step()
        steps += 1
    torch.cuda.synchronize()
except torch.OutOfMemoryError as error:
    # What the allocator holds from the driver when refused (a stream-ordered pool's reserve,
    # free pieces included): at the quota, the refusal is the quota's, as on a device its size.
    reason = str(error).splitlines()[0][:120]
    print(f"refused after {steps} steps: reserved={torch.cuda.memory_reserved() >> 20} MiB allocated={torch.cuda.memory_allocated() >> 20} MiB: {reason}", flush=True)
    sys.exit(4)
print(f"done {steps}", flush=True)
