#!/usr/bin/env bash
# GPU checks for vramguard: see README.md. Usage: run.sh DIR_WITH_RELEASE_BUILDS
set -u
bin=${1:?usage: run.sh target/release}
here=$(cd "$(dirname "$0")" && pwd)
hook="$bin/libvramguard.so"
agent="$bin/vramguard"
limit=$((4 << 30))
failed=0
echo "date: $(date -u +%F) gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

for mode in "" "expandable_segments:True" "backend:cudaMallocAsync"; do
  ledger=$(mktemp -u /tmp/vramguard-gpu.XXXXXX)
  PYTORCH_CUDA_ALLOC_CONF=$mode LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$limit VRAMGUARD_LEDGER=$ledger \
    python3 "$here/hook_pytorch.py" $limit || failed=1
  rm -f "$ledger"
done

# 8 processes started together; sample the footprint nvidia-smi reports for them.
ledger=$(mktemp -u /tmp/vramguard-gpu.XXXXXX)
pids=()
for i in $(seq 8); do
  LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$limit VRAMGUARD_LEDGER=$ledger python3 "$here/fill_hold.py" 15 &
  pids+=($!)
done
peak=0
for s in $(seq 60); do
  used=0
  for p in "${pids[@]}"; do
    mib=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', ' -v p=$p '$1==p {print $2}')
    used=$((used + ${mib:-0}))
  done
  [ $used -gt $peak ] && peak=$used
  sleep 0.25
done
wait
echo "8 processes: peak footprint ${peak} MiB, quota $((limit >> 20)) MiB"
[ $peak -le $((limit >> 20)) ] || { echo "FAILED: footprint over quota"; failed=1; }
rm -f "$ledger"

# Graph memory from stream capture and child graphs: refused past the quota before launch.
ledger=$(mktemp -u /tmp/vramguard-gpu.XXXXXX)
LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$limit VRAMGUARD_LEDGER=$ledger python3 "$here/hook_graphs.py" $limit || failed=1
python3 "$here/hook_graphs.py" $limit --control || failed=1
rm -f "$ledger"

# eBPF accounting against the real libcuda.
libcuda=$(ldconfig -p | awk '/libcuda.so.1 / {print $NF; exit}')
libcuda=${libcuda:-/usr/local/nvidia/lib64/libcuda.so.1}
sock=/tmp/vramguard-gpu.sock
"$agent" run --libcuda "$libcuda" --no-discover --socket $sock &
agent_pid=$!
sleep 2
python3 -c "import torch,time; x=torch.empty(1<<30,dtype=torch.uint8,device='cuda'); torch.cuda.synchronize(); time.sleep(3)" &
sleep 2
"$agent" audit --socket $sock
wait $!
kill -TERM $agent_pid; wait $agent_pid || failed=1
exit $failed
