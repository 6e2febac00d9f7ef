//! A creation that outlives the runtime's deadline leaves nothing behind (issue 24, item 3,
//! Must show): the agent runs as a real containerd's NRI plugin with a quota file, and the
//! blocking step of provisioning containers named `slow` is delayed 3 s by the test-only
//! fault flag (`--fault delay:create-container.slow:3000`), after it has made the ledger's
//! tmpfs, the ledger and the record. The agent answers CreateContainer at its deadline
//! (1.5 s) with an error, so containerd fails the creation through CRI; when the delayed step
//! ends it finds its creation abandoned and removes what it made: no ledger, no tmpfs in the
//! mount table, no record in the state directory or the agent's provisioned list, each
//! counted in `vramguard_provision_timed_out_removed_total`. The next container, not
//! delayed, is provisioned and held to its quota.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
use std::{
    ffi::{OsStr, OsString},
    path::Path,
};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::{provisioning_args, Agent},
    containerd::{workload_path, ContainerSpec, Containerd},
    http, timeout, wait_for, FakeNode, TempDir, GIB,
};

fn entries(dir: &Path) -> Result<Vec<String>> {
    Ok(std::fs::read_dir(dir)?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
}

#[test]
fn a_creation_answered_past_the_deadline_leaves_no_ledger_mount_or_record() -> Result<()> {
    let dir = TempDir::new("prov-deadline")?;
    let ledgers = dir.path().join("ledgers");
    let records = dir.path().join("state/containers");
    std::fs::create_dir_all(&ledgers)?;
    std::fs::write(dir.path().join("quotas"), "namespace=team-a 1g\n")?;
    let fake = FakeNode::new("prov-deadline").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let args = provisioning_args(&dir.path().join("nri.sock"), &dir.path().join("state"), &dir.path().join("quotas"), "8g")?;
    let fault: [OsString; 2] = ["--fault".into(), "delay:create-container.slow:3000".into()];
    let args: Vec<&OsStr> = args.iter().chain(&fault).map(OsString::as_os_str).collect();
    let agent = Agent::watching(&ledgers, &args)?;
    wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
        .with_context(|| agent.log())?;

    // The delayed creation: containerd is answered at the agent's deadline and fails it.
    let pod = containerd.pod("late", "team-a", "uid-late", &[])?;
    let error = containerd.create_container(&pod, &ContainerSpec::new("slow").fake_driver(&fake)?).expect_err("past the deadline");
    let error = format!("{error:#}");
    ensure!(error.contains("not provisioned within"), "containerd's error carries the agent's: {error}");

    // Once the delayed step ends: its ledger, tmpfs and record are gone, each counted.
    let addr = agent.metrics_addr()?;
    let counted = |what: &str| -> Result<f64> {
        let all = http::fresh_scrape(addr)?;
        Ok(http::metric(&all, "vramguard_provision_timed_out_removed_total", &[("what", what)]).unwrap_or(0.0))
    };
    wait_for(timeout(), "the abandoned creation's ledger, tmpfs and record removed", || {
        Ok(counted("ledger")? == 1.0 && counted("mount")? == 1.0 && counted("record")? == 1.0)
    })
    .with_context(|| agent.log())?;
    let all = http::fresh_scrape(addr)?;
    ensure!(http::metric(&all, "vramguard_provision_timed_out_total", &[]) == Some(1.0), "one creation timed out");
    ensure!(entries(&ledgers)?.is_empty(), "a ledger is left: {:?}", entries(&ledgers)?);
    ensure!(e2e::ledgers::tmpfs_mounts(&ledgers)?.is_empty(), "a ledger tmpfs is left: {:?}", e2e::ledgers::tmpfs_mounts(&ledgers)?);
    ensure!(entries(&records)?.is_empty(), "a record is left: {:?}", entries(&records)?);
    let audit = agent.audit()?;
    ensure!(audit["provisioned"].as_array().is_some_and(Vec::is_empty), "the agent still lists it: {}", audit["provisioned"]);
    ensure!(agent.log().contains("creation abandoned"), "{}", agent.log());

    // The next creation, not delayed, is provisioned and held to its quota.
    let pod = containerd.pod("trainer", "team-a", "uid-trainer", &[])?;
    let main = containerd.run_container(&pod, &ContainerSpec::new("main").fake_driver(&fake)?)?;
    let audit = agent.audit()?;
    let rows = audit["provisioned"].as_array().context("no provisioned list")?;
    ensure!(rows.len() == 1 && rows[0]["container_id"] == main.0.as_str(), "{rows:?}");
    ensure!(ledgers.join(&main.0).join("ledger").is_file() && e2e::ledgers::tmpfs_mounts(&ledgers)?.len() == 1, "{:?}", e2e::ledgers::tmpfs_mounts(&ledgers)?);
    let workload = workload_path();
    let out = containerd.exec_sync(&main, &[&workload, "ctx 0", "alloc a 256m", "expect-oom alloc b 512m"])?;
    ensure!(out.exit_code == 0 && out.stdout.lines().any(|l| l == "oom b"), "past 1 GiB must be refused: {out:?}");
    ensure!(containerd.container_env(&main)?.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT={GIB}")));
    drop(agent);
    fake.cleanup();
    Ok(())
}
