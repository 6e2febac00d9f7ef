//! `cargo xtask demo`: the agent against the fake driver, with sample workloads in cgroups of
//! their own (and one under the hook with a quota it tries to exceed); prints what
//! `vramguard audit` shows at each stage, then cleans up everything it made (processes,
//! cgroups, the fake device's state files and the ledger).
use anyhow::{bail, Context, Result};
use e2e::{agent::Agent, cgroup::TestCgroup, FakeNode};

use crate::{build_ebpf, cargo, run, setup};

pub fn demo() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the demo loads eBPF programs and creates cgroups: run it as root");
    }
    setup::setup()?;
    build_ebpf()?;
    run(cargo().args(["build", "-p", "agent", "-p", "fakecuda", "-p", "workload", "-p", "hook"]))?;
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    println!("\n== starting `vramguard run --libcuda {}`", libcuda.display());
    let agent = Agent::start(&libcuda)?;

    let node = FakeNode::new("demo").with_env("FAKECUDA_DEVICE_BYTES", "16g");
    let training = TestCgroup::create("demo-training")?;
    let inference = TestCgroup::create("demo-inference")?;
    println!("== two containers (cgroups): {} and {}", training.path, inference.path);
    let mut trainer = node
        .workload()
        .in_cgroup(&training)
        .steps(["ctx 0", "alloc weights 1g", "alloc activations 512m", "async grads 256m", "checkpoint up", "hold"])
        .spawn()?;
    let mut server = node
        .workload()
        .in_cgroup(&inference)
        .steps(["ctx 0", "vmm cache 2g", "managed staging 64m", "checkpoint up", "free staging", "checkpoint freed"])
        .spawn()?;
    trainer.wait_checkpoint("up")?;
    server.wait_checkpoint("up")?;
    audit(&agent, "both workloads allocated")?;

    server.resume()?;
    server.wait_checkpoint("freed")?;
    audit(&agent, "the inference server freed its managed staging buffer")?;

    println!("\n== a third container under the hook with a 1 GiB quota (CUDA_DEVICE_MEMORY_LIMIT=1g) asks for 2 GiB");
    let quota = TestCgroup::create("demo-quota")?;
    let ledger = node.ledger_path();
    let capped = node
        .hooked(&ledger, 1 << 30)?
        .in_cgroup(&quota)
        .steps(["ctx 0", "meminfo", "alloc fits 512m", "expect-oom alloc toobig 2g", "meminfo"])
        .run()?
        .success()?;
    for line in capped.stdout.iter().map(String::as_str).chain(capped.stderr.lines()) {
        println!("   {line}");
    }

    let trainer_pid = trainer.pid();
    trainer.kill()?;
    audit(&agent, &format!("the trainer (pid {trainer_pid}) was SIGKILLed without freeing"))?;

    server.resume()?;
    server.wait()?;
    println!("== stopping the agent (SIGTERM)");
    agent.stop().context("the agent did not stop cleanly")?;
    println!("== done: probes detached, cgroups and fake device files removed");
    Ok(())
}

fn audit(agent: &Agent, stage: &str) -> Result<()> {
    println!("\n== {stage}: vramguard audit");
    let output = agent.audit_table()?;
    if !output.status.success() {
        bail!("vramguard audit failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    print!("{}", String::from_utf8_lossy(&output.stdout));
    Ok(())
}
