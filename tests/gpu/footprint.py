"""What a PyTorch job holds on the GPU beyond its context and its allocator's reserve.

No hook, no agent. After each step, one JSON line: NVML's figure for this process, PyTorch's
reserved memory (what the probes and the ledger see of it: the caching allocator's segments,
or the stream-ordered pool's reserve) and the difference less the 518 MiB context, the memory
that the agent's context allowance (`--context-allowance`, 1 GiB a device) must cover for an
honest job not to be taken for one that escaped: module images (the kernels it loaded),
local memory, cuBLAS and cuDNN handles. The allocator comes from PYTORCH_CUDA_ALLOC_CONF and
the loading from CUDA_MODULE_LOADING, as the caller sets them.
"""
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F

MIB = 1 << 20
CONTEXT = 518 * MIB
me = os.getpid()
try:  # NVML's row in bytes where pynvml is installed, else nvidia-smi's in MiB
    import pynvml
    pynvml.nvmlInit()
    device = pynvml.nvmlDeviceGetHandleByIndex(0)
except ImportError:
    pynvml = None


def row():
    if pynvml is None:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            pid, used = (field.strip() for field in line.split(","))
            if pid == str(me):
                return int(used) * MIB
        return None
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(device):
        if proc.pid == me:
            return proc.usedGpuMemory
    return None


def say(step):
    torch.cuda.synchronize()
    time.sleep(0.2)
    used, reserved = row(), torch.cuda.memory_reserved()
    beyond = None if used is None else round((used - reserved - CONTEXT) / MIB, 1)
    print(json.dumps({
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
        "step": step, "nvml_mib": None if used is None else round(used / MIB, 1), "reserved_mib": round(reserved / MIB, 1),
        "beyond_context_and_reserve_mib": beyond,
    }), flush=True)


torch.empty(1, device="cuda")
say("context and one tensor")
x = torch.randn(4096, 4096, device="cuda")
y = (x * 2 + 1).relu().sum() + torch.softmax(x, dim=-1).mean() + F.layer_norm(x, (4096,)).mean()
say("elementwise, softmax, layer norm")
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    a = x.to(dtype)
    b = a @ a
say("matmul fp32, bf16, fp16 (cuBLAS)")
img = torch.randn(16, 64, 128, 128, device="cuda", requires_grad=True)
weight = torch.randn(128, 64, 3, 3, device="cuda", requires_grad=True)
F.conv2d(img, weight, padding=1).square().mean().backward()
say("conv2d forward and backward (cuDNN)")
q = torch.randn(8, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
F.scaled_dot_product_attention(q, q, q, is_causal=True)
say("scaled dot product attention, bf16")
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True), 4).cuda()
opt = torch.optim.AdamW(model.parameters())
tokens = torch.randn(8, 512, 1024, device="cuda")
for _ in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
say("transformer encoder, 3 training steps with AdamW under autocast")
del a, b, img, weight, q, model, opt, tokens, x, y
torch.cuda.empty_cache()
say("tensors freed, cache emptied")
