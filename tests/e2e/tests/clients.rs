//! Real CUDA clients over the fake driver, with and without the hook: NVIDIA's
//! `cuda-bindings` (cuMemAlloc, stream-ordered allocation from the default pool and from a
//! created pool with its attributes, VMM, managed memory the host reads back), `numba-cuda`
//! (device and managed arrays), `nvidia-ml-py` (memory and per-process views) and `nvitop`'s
//! one-shot output. The scripts are `tests/clients/*.py`; the clients are the pinned
//! releases `cargo xtask setup` installs into `target/pyenv` (a missing one fails the test
//! with that advice, never skips it).
//!
//! Needs `cargo build -p fakecuda -p workload -p hook` first (same profile).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use e2e::{field, holding, target_dir, FakeNode, Workload, GIB, MIB};

/// The project's Python environment (`target/pyenv`), with every client importable.
fn pyenv() -> Result<PathBuf> {
    let profile = target_dir()?;
    let target = profile.parent().context("target/<profile> has no parent")?;
    let env = target.join("pyenv");
    let check = "import cuda.bindings.driver, numba_cuda, pynvml, nvitop";
    let ok = Command::new(env.join("bin/python")).args(["-c", check]).output().is_ok_and(|o| o.status.success());
    if !ok {
        bail!("the CUDA clients (cuda-bindings, numba-cuda, nvidia-ml-py, nvitop) are not installed in {}: run `cargo xtask setup`", env.display());
    }
    Ok(env)
}

/// `python tests/clients/<script>` as a workload of `base` (the node's environment, and the
/// hook's where `base` is hooked).
fn client(base: Workload, script: &str) -> Result<Workload> {
    let scripts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../clients");
    Ok(base.program(pyenv()?.join("bin/python")).arg(scripts.join(script)))
}

const QUOTA: u64 = GIB;

#[test]
fn cuda_bindings_gets_cuda_h_entry_points_and_every_allocation_family_works() -> Result<()> {
    let node = FakeNode::new("cb-plain");
    let total = node.devstat(0)?.1;
    let steps = [
        "meminfo", "alloc 1g", "async 1g", "pool 100m", "vmm 1g", "managed 4m", "alloc 64g",
        "calls cuCtxCreate_v4", "calls cuCtxCreate_v2", "calls cuMemAllocFromPoolAsync",
    ];
    let out = client(node.workload(), "cuda_bindings_client.py")?.steps(steps).run()?.success()?;
    // cuda-bindings asks for cuCtxCreate at 12050: the _v4 entry point, not _v2's arguments.
    assert_eq!(out.line("calls cuCtxCreate_v4")?, "calls cuCtxCreate_v4 1");
    assert_eq!(out.line("calls cuCtxCreate_v2")?, "calls cuCtxCreate_v2 0");
    assert_eq!(out.line("calls cuMemAllocFromPoolAsync")?, "calls cuMemAllocFromPoolAsync 1");
    assert_eq!(field(out.line("meminfo ")?, "total")?, total, "the device's size without the hook");
    for step in ["alloc 1g", "async 1g", "pool 100m", "vmm 1g"] {
        assert_eq!(out.line(&format!("{step} "))?, format!("{step} CUDA_SUCCESS"));
    }
    assert_eq!(out.line("alloc 64g")?, "alloc 64g CUDA_ERROR_OUT_OF_MEMORY", "past the device itself");
    assert_eq!(out.line("managed 4m")?, "managed 4m CUDA_SUCCESS host-readback=0x5a,0xa5", "the host wrote and read managed memory");
    // A created pool: reserve follows use, stays after the free, goes at the synchronization
    // (release threshold 0); the high-water mark stays.
    let mb100 = 100 * MIB;
    let attrs = |label: &str| -> Result<[u64; 4]> {
        let l = out.line(&format!("pool-attrs {label} "))?;
        Ok([field(l, "reserved")?, field(l, "used")?, field(l, "reserved_high")?, field(l, "threshold")?])
    };
    assert_eq!(attrs("held")?, [mb100, mb100, mb100, 0]);
    assert_eq!(attrs("freed")?, [mb100, 0, mb100, 0]);
    assert_eq!(attrs("synced")?, [0, 0, mb100, 0]);
    Ok(())
}

#[test]
fn cuda_bindings_under_the_hook_sees_the_quota_and_is_refused_past_it() -> Result<()> {
    let node = FakeNode::new("cb-hooked");
    let steps = [
        "meminfo", "alloc 256m", "async 256m", "pool 100m", "vmm 64m", "managed 4m",
        "alloc 1g", "async 1g", "pool 1g", "vmm 1g", "managed 1g",
    ];
    let hooked = node.hooked(&node.ledger_path(), QUOTA)?;
    let out = client(hooked, "cuda_bindings_client.py")?.steps(steps).run()?.success()?;
    assert_eq!(field(out.line("meminfo ")?, "total")?, QUOTA, "cuMemGetInfo shows the quota");
    for step in ["alloc 256m", "async 256m", "pool 100m", "vmm 64m"] {
        assert_eq!(out.line(&format!("{step} "))?, format!("{step} CUDA_SUCCESS"), "under the quota");
    }
    assert!(out.line("managed 4m ")?.starts_with("managed 4m CUDA_SUCCESS host-readback=0x5a,0xa5"));
    for step in ["alloc 1g", "async 1g", "pool 1g", "vmm 1g", "managed 1g"] {
        assert_eq!(out.line(&format!("{step} "))?, format!("{step} CUDA_ERROR_OUT_OF_MEMORY"), "past the quota");
    }
    ensure!(out.stderr.contains("quota exceeded"), "the hook says why: {:?}", out.stderr);
    Ok(())
}

#[test]
fn numba_cuda_arrays_without_and_with_the_hook() -> Result<()> {
    let node = FakeNode::new("numba");
    let total = node.devstat(0)?.1;
    let steps = ["meminfo", "array 1g", "managed 1m"];
    let plain = client(node.workload(), "numba_client.py")?.steps(steps).run()?.success()?;
    ensure!(plain.line("device ")?.ends_with("cc=9.0"), "compute capability from cuDeviceGetAttribute: {:?}", plain.stdout);
    assert_eq!(field(plain.line("meminfo ")?, "total")?, total);
    assert_eq!(plain.line("array 1g")?, "array 1g ok");
    assert_eq!(plain.line("managed 1m")?, format!("managed 1m sum={}", 2 * MIB), "host-filled managed array");

    let steps = ["meminfo", "array 256m", "array 1g"];
    let hooked = client(node.hooked(&node.ledger_path(), QUOTA)?, "numba_client.py")?.steps(steps).run()?.success()?;
    assert_eq!(field(hooked.line("meminfo ")?, "total")?, QUOTA, "numba sees the quota");
    assert_eq!(hooked.line("array 256m")?, "array 256m ok");
    let refused = hooked.line("array 1g")?;
    ensure!(
        refused.starts_with("array 1g error CudaAPIError") && refused.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "numba's error for an allocation past the quota: {refused:?}"
    );
    Ok(())
}

#[test]
fn nvml_views_name_the_device_its_memory_and_processes() -> Result<()> {
    let node = FakeNode::new("nvml");
    // A CUDA process of the container under the hook: it holds memory, and its ledger says
    // the quota (which NVML-only processes of the container read).
    let held = holding(node.hooked(&node.ledger_path(), QUOTA)?, &["ctx 0", "alloc a 512m"])?;
    let (used, total) = node.devstat(0)?;
    ensure!(used > 512 * MIB, "the holder's memory is on the device: {used}");

    let out = client(node.workload(), "nvml_client.py")?.run()?.success()?;
    assert_eq!(out.line("driver ")?, "driver 580.65.06");
    let dev = out.line("device ")?;
    ensure!(dev.contains("index=0 name=NVIDIA_H100_80GB_HBM3 "), "{dev}");
    assert_eq!((field(dev, "total")?, field(dev, "used")?, field(dev, "free")?), (total, used, total - used));
    ensure!(dev.ends_with(&format!("processes={}:{used}", held.pid())), "the holder and its memory: {dev}");

    // Under the hook, NVML's memory is the quota's.
    let hooked = client(node.hooked(&node.ledger_path(), QUOTA)?, "nvml_client.py")?.run()?.success()?;
    assert_eq!(field(hooked.line("device ")?, "total")?, QUOTA, "NVML under the hook shows the quota");

    // nvitop's one-shot view: the device's name, driver and memory, and the holder.
    // (Through sh: nvitop refuses the `--` the kit puts before the steps.)
    let nvitop = node.workload().program("/bin/sh").arg("-c").arg("exec \"$0\" --once").arg(pyenv()?.join("bin/nvitop"));
    let nvitop = nvitop.run()?.success()?;
    let text = nvitop.stdout.join("\n");
    ensure!(text.contains("H100 80GB HBM3"), "nvitop names the device: {text}");
    ensure!(text.contains("Driver Version: 580.65.06"), "nvitop shows the driver: {text}");
    ensure!(text.contains(&format!("/ {}MiB", total / MIB)), "nvitop shows the memory: {text}");
    ensure!(text.contains(&held.pid().to_string()), "nvitop lists the holder: {text}");
    drop(held);
    Ok(())
}
