#!/usr/bin/env bash
# Issue 23's checks on a real driver (see README.md): what NVML reports for each kind of
# memory (nvml_truth.py), and the agent's one figure against it: an honest PyTorch job with the
# stream-ordered allocator near its quota under `--enforce signal` (not stopped) beside an
# un-hooked process in its cgroup taking memory (stopped), and a forked child holding its dead
# parent's memory (the slot kept, the quota held, released when the child goes; the child not
# stopped), a stream-ordered pool's release under the hook (`release`: what the hook refused
# is granted once the driver gave the pool's memory back) and a process whose main thread
# exited while another holds its memory (`leader`: its slot kept, the quota held, it is not
# stopped), a training job at its quota in each allocator mode and with eager loading (`train`)
# and a stream-ordered job on three streams and in a CUDA graph (`streams`): never stopped, never
# past the quota on the driver. Usage: truth.sh DIR_WITH_RELEASE_BUILDS [DIR_FOR_LOGS]; the `release` and `leader`
# parts run `fakecuda-workload` (tests/workload: it dlopens libcuda.so.1) from that directory.
set -u
bin=$(cd "${1:?usage: truth.sh target/release [logs]}" && pwd)
out=${2:-/tmp}
here=$(cd "$(dirname "$0")" && pwd)
hook="$bin/libvramguard.so"
agent="$bin/vramguard"
workload="$bin/fakecuda-workload"
parts=${TRUTH_PARTS:-facts release pool fork leader many train streams}  # which parts run
part() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }
failed=0
fail() { echo "FAILED: $*"; failed=1; }
echo "date: $(date -u +%FT%TZ) gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) kernel: $(uname -r)"
libcuda=${LIBCUDA:-$(ldconfig -p | awk '/libcuda.so.1 / {print $NF; exit}')}
libcuda=${libcuda:-/usr/local/nvidia/lib64/libcuda.so.1}

echo "== who holds the GPU's device files before any workload (nvidia-persistenced, monitors)"
for fd in /proc/[0-9]*/fd/*; do
  case $(readlink "$fd" 2>/dev/null) in /dev/nvidia*) pid=${fd#/proc/}; pid=${pid%%/*}; echo "pid $pid $(cat /proc/$pid/comm 2>/dev/null) $(readlink "$fd")";; esac
done | sort -u
pgrep -a nvidia-persiste || echo "no nvidia-persistenced"

if part facts; then
  echo "== what NVML reports (no hook, no agent)"
  python3 "$here/nvml_truth.py" facts || fail "nvml_truth.py facts"
  python3 "$here/nvml_truth.py" fork || fail "nvml_truth.py fork"
  python3 "$here/nvml_truth.py" fork exec || fail "nvml_truth.py fork exec"
fi

if part release; then
  # The hook charges a pool's reserved memory and settles that charge at a synchronize, and
  # again before a refusal is final (docs/gpu.md, "Stream-ordered pools"). Quota: the context
  # reserve + 1 GiB, so 700 MiB in the pool and a 700 MiB cuMemAlloc do not fit together:
  # each cuMemAlloc below is granted only if the pool's 700 MiB went back (pool-stat says
  # what the driver kept); with the release threshold at 1 GiB it is refused until a trim.
  echo "== a stream-ordered pool's release under the hook (quota: 518 MiB + 1 GiB)"
  ledger=$(mktemp -u /tmp/vramguard-release.XXXXXX)
  LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$(((518 + 1024) << 20)) VRAMGUARD_LEDGER=$ledger "$workload" "ctx 0" \
    "pool-threshold 0" "async a 700m" "free-async a" "sync" "pool-stat" "alloc b 700m" "free b" \
    "async c 700m" "free-async c" "ctx-sync" "pool-stat" "alloc d 700m" "free d" \
    "async e 700m" "free-async e" "event-sync" "pool-stat" "alloc f 700m" "free f" \
    "pool-threshold 1g" "async g 700m" "free-async g" "sync" "pool-stat" "expect-oom alloc h 700m" \
    "trim 0" "pool-stat" "alloc i 700m" "free i" > "$out/release.out" 2>&1 || fail "the pool's release under the hook"
  sed 's/^/  /' "$out/release.out"
  rm -f "$ledger"
  # Across processes of one ledger (quota: two contexts + 1 GiB): one process's pool keeps
  # 700 MiB (threshold 1 GiB), so another's 700 MiB is refused; once the first trims its pool
  # (pool-stat: the driver gave it back), the other's 700 MiB is granted.
  echo "== a pool's release seen by another process of the ledger (quota: 2 x 518 MiB + 1 GiB)"
  ledger=$(mktemp -u /tmp/vramguard-release.XXXXXX)
  quota=$(((2 * 518 + 1024) << 20))
  LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota VRAMGUARD_LEDGER=$ledger "$workload" "ctx 0" \
    "pool-threshold 1g" "async a 700m" "free-async a" "sync" "pool-stat" "sleep 3000" "trim 0" "pool-stat" "sleep 4000" > "$out/release-keeper.out" 2>&1 &
  keeper=$!
  sleep 1.5
  LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota VRAMGUARD_LEDGER=$ledger "$workload" "ctx 0" \
    "expect-oom alloc b 700m" "sleep 3000" "alloc c 700m" "free c" > "$out/release-other.out" 2>&1 ||
    fail "another process was not granted what the pool gave back: $(tail -2 "$out/release-other.out")"
  wait $keeper || fail "the process keeping a pool failed: $(tail -2 "$out/release-keeper.out")"
  sed 's/^/  keeper: /' "$out/release-keeper.out"; sed 's/^/  other: /' "$out/release-other.out"
  rm -f "$ledger"
fi

echo "== the agent on the real driver, --enforce signal"
cg2=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
if [ -z "$cg2" ]; then cg2=/tmp/vramguard-cg2; mkdir -p $cg2; mount -t cgroup2 none $cg2 || fail "no cgroup2"; fi
for c in honest fork leader many train streams; do mkdir -p "$cg2/vramguard-gpu-$c"; done
ledgers=$(mktemp -d /tmp/vramguard-ledgers.XXXXXX)
mkdir -p "$ledgers/honest" "$ledgers/fork" "$ledgers/leader" "$ledgers/many" "$ledgers/train" "$ledgers/streams"
sock=/tmp/vramguard-truth.sock
"$agent" run --libcuda "$libcuda" --no-discover --socket $sock --ledger-dir "$ledgers" \
  --enforce signal --cgroup2-separates-containers --metrics-addr 127.0.0.1:9477 > "$out/truth-agent.log" 2>&1 &
agent_pid=$!
sleep 3
kill -0 $agent_pid 2>/dev/null || { fail "the agent did not start: $(grep -v '^ ' "$out/truth-agent.log" | tail -5)"; exit 1; }
# Run in a subshell: `(in_cgroup NAME cmd...)`; the command then has the subshell's pid.
in_cgroup() { local c=$1; shift; echo $BASHPID > "$cg2/vramguard-gpu-$c/cgroup.procs" && exec "$@"; }
audit() { "$agent" audit --socket $sock --json > "$out/audit-$1.json" 2>>"$out/truth-agent.log" || echo "audit $1 failed"; }
rows() {  # the audit's rows for the given pids
  python3 - "$out/audit-$1.json" "${@:2}" <<'PY'
import json, sys
audit = json.load(open(sys.argv[1]))
keys = ("state", "total_bytes", "ledger_bytes", "driver_bytes", "pool_kept_bytes", "held_bytes", "escaped_bytes")
for row in audit["processes"]:
    if str(row["pid"]) in sys.argv[2:]:
        print(f"  pid {row['pid']} {row['comm']}: " + ", ".join(f"{k} {row.get(k)}" for k in keys))
print("  signals sent:", audit.get("stats", {}).get("signals_sent"), "cgroup limits:", audit.get("stats", {}).get("cgroup_limits"))
PY
}

# An honest job near its quota (4 GiB: 518 MiB of context, 3 GiB peak), the pool keeping what
# it freed, and an un-hooked process in its cgroup taking 256 MiB blocks up to 6 GiB.
if part pool; then
quota=$((4 << 30))
rm -f "$out/grab.go"
(in_cgroup honest env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota \
  VRAMGUARD_LEDGER="$ledgers/honest/ledger" python3 "$here/pool_honest.py" $((3 << 30)) 4 3) > "$out/honest.out" 2>&1 &
honest=$!
(in_cgroup honest python3 "$here/grab.py" $((6 << 30)) "$out/grab.go") > "$out/grab.out" 2>&1 &
grab=$!
for _ in $(seq 160); do grep -q "^freed 1" "$out/honest.out" && break; sleep 0.25; done
sleep 1.5  # a reconcile pass and an NVML read with the pool holding what the job freed
audit honest-freed
echo "honest job (pid $honest) after freeing its 3 GiB, the pool keeping it:"; rows honest-freed $honest
for _ in $(seq 160); do grep -q "^peak 2" "$out/honest.out" && break; sleep 0.1; done
grep -q "^ready" "$out/grab.out" || fail "the un-hooked process was not ready: $(tail -2 "$out/grab.out")"
touch "$out/grab.go"  # it allocates while the honest job holds its peak
wait $grab; grab_status=$?
echo "un-hooked process (pid $grab) in the honest job's cgroup: exit status $grab_status, last: $(tail -1 "$out/grab.out")"
[ $grab_status = 137 ] || fail "the un-hooked process was not stopped by SIGKILL"
sleep 0.5
audit honest-peak
echo "honest job at its peak, after the un-hooked process was stopped:"; rows honest-peak $honest $grab
wait $honest; honest_status=$?
echo "honest job: exit status $honest_status, last: $(tail -1 "$out/honest.out")"
[ $honest_status = 0 ] && grep -q '^done' "$out/honest.out" || fail "the honest job was stopped"
fi

if part fork; then
# A forked child holding its dead parent's 900 MiB: quota 518 MiB + 1.5 GiB, so a second
# process's 900 MiB fits only once the parent's slot is free.
quota=$(((518 + 1536) << 20))
hooked() { (in_cgroup fork env LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota VRAMGUARD_LEDGER="$ledgers/fork/ledger" python3 "$here/nvml_truth.py" hold $((900 << 20)) "$@"); }
rm -f "$out/forkchild" "$out/forkchild.done"
hooked 8 "$out/forkchild" > "$out/forkparent.out" 2>&1
parent=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["pid"])' "$out/forkparent.out" 2>/dev/null)
child=$(cat "$out/forkchild" 2>/dev/null)
sleep 1.5
audit fork-child
echo "parent $parent exited, child $child holds its device files:"; rows fork-child $parent $child
echo "  NVML: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
hooked 1 > "$out/fork-second.out" 2>&1; second=$?
echo "a second process's 900 MiB while the child lives: exit $second ($(head -1 "$out/fork-second.out"))"
[ $second = 3 ] || fail "the second process was not refused while the child held the parent's memory"
while kill -0 "$child" 2>/dev/null; do sleep 0.2; done
sleep 1.5
[ -e "$out/forkchild.done" ] || fail "the forked child was stopped"
hooked 1 > "$out/fork-third.out" 2>&1; third=$?
echo "a third process's 900 MiB after the child exited: exit $third ($(head -1 "$out/fork-third.out"))"
[ $third = 0 ] || fail "the parent's slot was not freed after the child exited"
fi
if part leader; then
# A process whose main thread exited (exit(2) of the leader alone) while another thread holds
# its 900 MiB: /proc shows its leader a zombie, its pidfd is not readable. Quota 518 MiB +
# 1.5 GiB: a second process's 900 MiB is refused while it runs, granted after it is killed.
quota=$(((518 + 1536) << 20))
leader() { (in_cgroup leader env LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota VRAMGUARD_LEDGER="$ledgers/leader/ledger" "$workload" "$@"); }
(in_cgroup leader env LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota VRAMGUARD_LEDGER="$ledgers/leader/ledger" \
  "$workload" "ctx 0" "alloc a 900m" "leader-exit") > "$out/leader.out" 2>&1 &
holder=$!
for _ in $(seq 100); do grep -q "^leader-exit" "$out/leader.out" && break; sleep 0.1; done
joined() {  # the audit's row of the holder: state ok, with the driver's figure
  python3 -c 'import json, sys; rows = [r for r in json.load(open(sys.argv[1]))["processes"] if r["pid"] == int(sys.argv[2])]; sys.exit(0 if rows and rows[0]["state"] == "ok" and rows[0]["driver_bytes"] else 1)' "$out/audit-leader.json" "$holder"
}
for _ in $(seq 20); do sleep 0.5; audit leader; joined && break; done
echo "a process (pid $holder) whose main thread exited, another thread holding 900 MiB (state $(awk '{print $3}' /proc/$holder/stat 2>/dev/null)):"; rows leader $holder
echo "  NVML: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
joined || fail "the process whose main thread exited is not joined with its slot and its driver row"
leader "ctx 0" "expect-oom alloc b 900m" > "$out/leader-second.out" 2>&1
echo "a second process's 900 MiB while it runs: $(grep -E '^(oom|ok)' "$out/leader-second.out" | tail -1)"
grep -q "^oom b" "$out/leader-second.out" || fail "the second process was not refused while the first held its memory"
kill -0 $holder 2>/dev/null || fail "the process whose main thread exited was stopped"
kill -KILL $holder; wait $holder
sleep 1.5
leader "ctx 0" "alloc c 900m" > "$out/leader-third.out" 2>&1 || fail "the killed process's slot was not freed: $(tail -1 "$out/leader-third.out")"
echo "a third process's 900 MiB after it was killed: $(grep -E '^ok' "$out/leader-third.out" | tail -1)"
fi
if part many; then
# 16 hooked processes of one container, 256 MiB each: the driver's memory beside each NVML row
# (driver::gap::PER_PROCESS allows 16 MiB a row) must not be reported as the GPU's gap, nor
# charged to anyone, and no process is stopped.
quota=$((16 * (518 + 512) << 20))
pids=""
for i in $(seq 16); do
  (in_cgroup many env LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$quota VRAMGUARD_LEDGER="$ledgers/many/ledger" \
    "$workload" "ctx 0" "alloc a 256m" "sleep 9000") > "$out/many-$i.out" 2>&1 &
  pids="$pids $!"
done
sleep 6
audit many
echo "16 processes of 256 MiB each:"; rows many $pids
echo "  NVML: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
echo "  device used (v2): $(nvidia-smi --query-gpu=memory.used,memory.reserved --format=csv,noheader)"
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9477/metrics').read().decode())" > "$out/metrics-many.txt" || fail "no /metrics"
grep -E '^vramguard_(device_unexplained_bytes|device_driver_reserve_bytes|driver_unattributed)' "$out/metrics-many.txt" | sed 's/^/  /'
if grep -E '^vramguard_device_unexplained_bytes' "$out/metrics-many.txt" | awk '$NF > 0 {found=1} END {exit !found}'; then
  fail "16 honest processes were reported as the GPU's gap"
fi
i=0; for pid in $pids; do i=$((i + 1)); wait $pid || fail "process $i of 16 (pid $pid, exit $?): $(tail -1 "$out/many-$i.out")"; done
fi
slack=$((1024 - 518))  # what the 1 GiB allowance leaves uncharged beside the 518 MiB context (docs/security.md)
nvml_peak() {  # PID FILE: the most NVML reports for PID, in MiB, polled until PID ends
  local peak=0 used
  while kill -0 "$1" 2>/dev/null; do
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', ' -v p="$1" '$1 == p {print $2}')
    [ "${used:-0}" -le $peak ] || { peak=$used; echo $peak > "$2"; }
    sleep 0.3
  done
}
ended() {  # NAME QUOTA_MIB WHAT: waits for $job and its $peaker (output, NVML peak in $out/NAME.*); sets status, peak
  wait $job; status=$?
  wait $peaker
  peak=$(cat "$out/$1.peak" 2>/dev/null)
  echo "  exit status $status, NVML peak ${peak:-?} MiB, last: $(grep -E '^(done|refused after)' "$out/$1.out" | tail -1)"
  [ $status != 137 ] || fail "the honest $3 was stopped by SIGKILL"
  [ "${peak:-0}" -le $(($2 + slack)) ] || fail "the $3 held ${peak} MiB on the driver, past its $2 MiB quota and the $slack MiB left uncharged"
}
if part train; then
# An honest training job (cuBLAS, cuDNN, attention kernels loaded) filled to its 6 GiB quota
# under --enforce signal, in each allocator mode and with eager module loading (1.5 GiB of
# kernels beyond the context: past the 1 GiB allowance, so charged): never stopped by the agent,
# and never holding more on the driver than its quota and what the allowance leaves uncharged
# beside the context the hook charges (the slack below).
for mode in default async eager; do
  case $mode in
    default) env=(PYTORCH_CUDA_ALLOC_CONF=);;
    async) env=(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync);;
    eager) env=(PYTORCH_CUDA_ALLOC_CONF= CUDA_MODULE_LOADING=EAGER);;
  esac
  (in_cgroup train env "${env[@]}" LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$((6 << 30)) \
    VRAMGUARD_LEDGER="$ledgers/train/ledger" python3 "$here/train_near_limit.py" 12) > "$out/train.out" 2>&1 &
  job=$!
  rm -f "$out/train.peak"; nvml_peak $job "$out/train.peak" & peaker=$!
  for _ in $(seq 600); do grep -qE "^training|Error" "$out/train.out" && break; sleep 0.1; done
  sleep 4
  audit "train-$mode"
  echo "a training job at its quota ($mode, pid $job): $(grep ^training "$out/train.out")"; rows "train-$mode" $job
  echo "  NVML: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
  ended train 6144 "training job ($mode)"
  if [ $status = 4 ] && [ $mode = async ]; then
    # A stream-ordered pool's free part in pieces (docs/gpu.md): refused only with the pool's
    # reserve at the quota (6 GiB less the 518 MiB context, within 256 MiB), never past it.
    reserved=$(sed -n 's/^refused after .* reserved=\([0-9]*\) MiB.*/\1/p' "$out/train.out")
    echo "  refused with the pool holding ${reserved:-?} MiB of the $((6144 - 518)) MiB the quota leaves it"
    [ "${reserved:-0}" -ge $((6144 - 518 - 256)) ] && [ "${reserved:-0}" -le $((6144 - 518)) ] ||
      fail "the honest training job ($mode) was refused below its quota, or its pool passed it"
  else
    [ $status = 0 ] || fail "the honest training job ($mode) did not finish: $(tail -3 "$out/train.out")"
  fi
  cp "$out/train.out" "$out/train-$mode.out"
done
fi
if part streams; then
# An honest stream-ordered job at its 4 GiB quota on three streams, its pool's free part in
# pieces, then a training step captured in a CUDA graph replayed on the three streams
# (streams_near_limit.py): never stopped, never past its quota (and the slack above) on the driver.
(in_cgroup streams env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync LD_PRELOAD=$hook CUDA_DEVICE_MEMORY_LIMIT=$((4 << 30)) \
  VRAMGUARD_LEDGER="$ledgers/streams/ledger" python3 "$here/streams_near_limit.py" 10) > "$out/streams.out" 2>&1 &
job=$!
rm -f "$out/streams.peak"; nvml_peak $job "$out/streams.peak" & peaker=$!
for _ in $(seq 600); do grep -qE "^training|Error" "$out/streams.out" && break; sleep 0.1; done
sleep 3
audit streams
echo "a job on three streams and a graph at its quota (pid $job):"; grep -E '^(filled|big|training)' "$out/streams.out" | sed 's/^/  /'; rows streams $job
ended streams 4096 "job on three streams"
if [ $status = 4 ]; then  # refused only with less than 256 MiB of its quota free (the hook's cuMemGetInfo then)
  free=$(sed -n 's/^refused after .* quota_free=\([0-9]*\) MiB.*/\1/p' "$out/streams.out")
  echo "  refused with ${free:-?} MiB of its quota free"
  [ -n "$free" ] && [ "$free" -lt 256 ] || fail "the job on three streams was refused below its quota: $(grep '^refused after' "$out/streams.out")"
else
  [ $status = 0 ] || fail "the job on three streams failed: $(grep -v Warning "$out/streams.out" | tail -3)"
fi
fi
audit end
kill -TERM $agent_pid; wait $agent_pid || fail "the agent's exit"
grep -iE "signal|escap|kill" "$out/truth-agent.log" | head -20
rm -rf "$ledgers"
for c in honest fork leader many train streams; do rmdir "$cg2/vramguard-gpu-$c" 2>/dev/null; done
echo "truth.sh: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed
