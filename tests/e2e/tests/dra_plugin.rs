//! The DRA driver's kubelet plugin, end to end (issue 25, item 2): the real agent with `--dra
//! --kube`, the tests' API server (`kube_api/`) serving ResourceClaims as the scheduler left
//! them, and a test kubelet (`dra/kubelet.rs`) that finds the plugin in its registry
//! directory, registers it and prepares and unprepares claims through its DRA socket.
//!
//! Shown: the registration (type, name, the DRA socket's absolute path, `v1.DRAPlugin`, and
//! the kubelet's word counted); a prepared claim answers its CDI device and its spec gives the
//! container the allocated GPU's device node; a second prepare answers the same devices
//! without asking the API server again; in the same call, a claim whose UID changed, one not
//! allocated and one that would over-commit a GPU fail each with its own clear error; the
//! spec and the checkpoint each synced before their rename and their directory after it (the
//! agent's syscalls, from the kernel's tracepoints: `e2e::ftrace`), the driver's state
//! directory 0700; an
//! agent restarted after the claim is gone from the API server unprepares it from its
//! checkpoint (the spec removed), and an unknown claim unprepares as success. The devices'
//! health (item 4) through the same socket: healthy while the fake's NVML answers, unhealthy
//! on the agent whose NVML fails. A panic in the plugin's task ends the agent naming it, and the
//! next agent replaces the sockets it left behind.
//!
//! Needs root (the agent loads its eBPF programs) and the built binaries.
use std::{
    ffi::{OsStr, OsString},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use anyhow::{ensure, Context, Result};
use e2e::{agent::Agent, containerd::Containerd, http, timeout, wait_for, FakeNode, TempDir};
use serde_json::Value;

mod dra;
mod kube_api;

use agent::dra::proto::health::{HealthStatus, NodeWatchResourcesResponse};
use dra::kubelet::{claim, Kubelet};
use kube_api::{resource, ApiServer, NODE};

const DRIVER: &str = "gpu.vramguard.io";
const TRAIN_UID: &str = "5b0e1f2a-7c3d-4e8f-9a1b-2c3d4e5f6a70";
const SHARE: &str = "0c6f7a1e-2b3c-4d5e-8f90-a1b2c3d4e5f6";

/// The agent on the fake driver as the DaemonSet runs it with `--dra`: two GPUs of 16 GiB, its
/// state, the kubelet's directories and the CDI directory under `dir`.
fn start_agent(api: &ApiServer, dir: &Path, account: &Path, fake: &FakeNode, more: &[&str]) -> Result<Agent> {
    // With --nri (--dra refuses to start without it) on the runtime at `<dir>/nri.sock`
    // ([`runtime`]) where there is one: no claim is prepared until the agent is connected.
    std::fs::create_dir_all(dir.join("ledgers"))?;
    let mut args = e2e::agent::kube_node_args(dir, "16Gi,16Gi")?;
    args.extend::<[OsString; _]>([
        "--dra".into(),
        // Each GPU's whole memory is the devices' capacity.
        "--dra-memory-reserve".into(),
        "0".into(),
        "--kubelet-registry-dir".into(),
        dir.join("registry").into(),
        "--kubelet-plugins-dir".into(),
        dir.join("plugins").into(),
        "--cdi-dir".into(),
        dir.join("cdi").into(),
    ]);
    args.extend(more.iter().map(OsString::from));
    let mut env = api.pod_env(account);
    // The fake's NVML (beside its libcuda) sees the node's devices.
    env.extend(fake.env().iter().cloned());
    let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    let agent = Agent::start_with_env(&args, &env)?;
    if dir.join("nri.sock").exists() {
        wait_for(timeout(), "the agent connected to the runtime's NRI", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
    }
    Ok(agent)
}

/// A containerd whose NRI socket is `<dir>/nri.sock`, where [`start_agent`]'s agent connects.
fn runtime(dir: &Path) -> Result<Containerd> {
    Containerd::start(&dir.join("nri.sock"))
}

/// The claim `team-a/<name>`'s GETs the API server answered.
fn gets(api: &ApiServer, name: &str) -> usize {
    let path = format!("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/{name}");
    api.seen().iter().filter(|r| r.method == "GET" && r.target.starts_with(&path)).count()
}

/// Waits until the agent's page shows `name{labels}` at `value`.
fn wait_metric(agent: &Agent, name: &str, labels: &[(&str, &str)], value: f64) -> Result<()> {
    let addr = agent.metrics_addr()?;
    wait_for(timeout(), &format!("{name}{labels:?} at {value}"), || Ok(http::metric(&http::scrape(addr)?, name, labels) == Some(value)))
        .with_context(|| agent.log())?;
    Ok(())
}

/// The API server, a directory of the test's own and the service account's files in it.
fn scene(tag: &str) -> Result<(ApiServer, TempDir, PathBuf)> {
    let api = ApiServer::start()?;
    let dir = TempDir::new(tag)?;
    let account = dir.path().join("serviceaccount");
    api.service_account(&account)?;
    Ok((api, dir, account))
}

#[test]
fn the_kubelet_registers_the_plugin_and_prepares_and_unprepares_claims_across_a_restart() -> Result<()> {
    let (api, dir, account) = scene("dra-plugin")?;
    let _runtime = runtime(dir.path())?;
    // An 8 GiB share of GPU 1, as the scheduler allocated it.
    let train = [(DRIVER, NODE, "gpu-1", Some("8Gi"), SHARE)];
    api.put_claim(resource::claim("team-a", "train", TRAIN_UID, "8Gi", Some(&train)));
    // Deleted and re-created under the same name since the kubelet saw it.
    let moved = [(DRIVER, NODE, "gpu-0", Some("1Gi"), "0c6f7a1e-0000-4000-8000-000000000002")];
    api.put_claim(resource::claim("team-a", "moved", "uid-moved-new", "1Gi", Some(&moved)));
    // Not allocated yet.
    api.put_claim(resource::claim("team-a", "pending", "uid-pending", "1Gi", None));
    // 20 GiB on a 16 GiB GPU: the scheduler over-committed it.
    let big = [(DRIVER, NODE, "gpu-0", Some("20Gi"), "0c6f7a1e-0000-4000-8000-000000000003")];
    api.put_claim(resource::claim("team-a", "big", "uid-big", "20Gi", Some(&big)));

    let fake = FakeNode::new("dra-plugin").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "16g");
    let agent = start_agent(&api, dir.path(), &account, &fake, &[])?;
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    let dra_socket = dir.path().join("plugins").join(DRIVER).join("dra.sock");
    ensure!(plugin.socket == dir.path().join("registry").join(format!("{DRIVER}-reg.sock")), "{:?}", plugin.socket);
    ensure!(plugin.info.r#type == "DRAPlugin" && plugin.info.name == DRIVER, "{:?}", plugin.info);
    ensure!(Path::new(&plugin.info.endpoint) == dra_socket, "the endpoint is the DRA socket's absolute path: {:?}", plugin.info);
    for socket in [&plugin.socket, &dra_socket] {
        let mode = std::fs::metadata(socket)?.permissions().mode() & 0o777;
        ensure!(mode == 0o600, "{} is the kubelet's alone: {mode:o}", socket.display());
    }
    ensure!(plugin.info.supported_versions == ["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"], "{:?}", plugin.info);
    wait_metric(&agent, "vramguard_dra_registered", &[], 1.0)?;
    wait_metric(&agent, "vramguard_dra_registration_notifications_total", &[("result", "registered")], 1.0)?;

    // NVML answers: both GPUs of the node's pool are healthy.
    let mut health = kubelet.watch_health(&plugin)?;
    let healthy = kubelet.health_until(&mut health, timeout(), |m| all(m, HealthStatus::Healthy)).with_context(|| agent.log())?;
    let names: Vec<(&str, &str)> = healthy.devices.iter().filter_map(|d| d.device.as_ref()).map(|d| (d.pool_name.as_str(), d.device_name.as_str())).collect();
    ensure!(names == [(NODE, "gpu-0"), (NODE, "gpu-1")], "{healthy:?}");
    drop(health);

    // One call, four claims: one prepared, three refused, each with its own error. The
    // agent's syscalls meanwhile, from the kernel's tracepoints: what it writes is made
    // durable (below).
    let durable = ["fsync", "fdatasync", "rename", "renameat", "renameat2"];
    let trace = e2e::ftrace::SyscallTrace::start(agent.pid(), &durable)?;
    let answer = kubelet.prepare(
        &plugin,
        vec![
            claim("team-a", "train", TRAIN_UID),
            claim("team-a", "moved", "uid-moved-old"),
            claim("team-a", "pending", "uid-pending"),
            claim("team-a", "big", "uid-big"),
        ],
    )?;
    ensure!(answer.claims.len() == 4, "an answer per claim: {answer:?}");
    let prepared = &answer.claims[TRAIN_UID];
    ensure!(prepared.error.is_empty(), "{prepared:?}\n{}", agent.log());
    let cdi_device = format!("{DRIVER}/claim={TRAIN_UID}-gpu-1");
    ensure!(prepared.devices.len() == 1, "{prepared:?}");
    let device = &prepared.devices[0];
    ensure!(device.request_names == ["gpu"] && device.pool_name == NODE && device.device_name == "gpu-1", "{device:?}");
    ensure!(device.cdi_device_ids == [cdi_device.clone()] && device.share_id.as_deref() == Some(SHARE), "{device:?}");
    let error = |uid: &str| answer.claims.get(uid).map(|c| (c.error.clone(), c.devices.len()));
    let (moved_error, devices) = error("uid-moved-old").context("no answer for the moved claim")?;
    ensure!(devices == 0 && moved_error.contains(r#"claim team-a/moved has UID "uid-moved-new", the kubelet asked for "uid-moved-old""#), "{moved_error}");
    let (pending_error, devices) = error("uid-pending").context("no answer for the pending claim")?;
    ensure!(devices == 0 && pending_error.contains("claim team-a/pending (UID uid-pending) is not allocated"), "{pending_error}");
    let (big_error, devices) = error("uid-big").context("no answer for the big claim")?;
    ensure!(devices == 0 && big_error.contains("over its 17179869184 bytes") && big_error.contains("over-commits the GPU"), "{big_error}");

    // The spec: the claim's device, GPU 1's device node, the claim's identity.
    let spec_path = dir.path().join("cdi").join(format!("{DRIVER}-{TRAIN_UID}.json"));
    let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).context("the CDI spec")?)?;
    ensure!(spec["kind"] == "gpu.vramguard.io/claim" && spec["cdiVersion"] == "0.3.0", "{spec}");
    ensure!(spec["devices"][0]["name"] == format!("{TRAIN_UID}-gpu-1"), "{spec}");
    ensure!(spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia1", "{spec}");
    ensure!(!dir.path().join("cdi").join(format!("{DRIVER}-uid-big.json")).exists(), "no spec for a refused claim");
    // Crash safety: the spec and the checkpoint each written to a temporary file synced before
    // it is renamed into place, and the directory synced after: F R F, F R F (renames of
    // nothing else, syncs of nothing else happen here).
    let calls = trace.calls()?;
    drop(trace);
    let renames: Vec<usize> = calls.iter().enumerate().filter(|(_, c)| c.starts_with("rename")).map(|(i, _)| i).collect();
    let syncs = |from: usize, to: usize| calls[from..to].iter().filter(|c| c.ends_with("sync")).count();
    ensure!(renames.len() == 2, "the spec and the checkpoint renamed into place: {calls:?}");
    ensure!(syncs(0, renames[0]) >= 1, "the spec's file synced before its rename: {calls:?}");
    ensure!(syncs(renames[0] + 1, renames[1]) >= 2, "the CDI directory synced after the spec's rename, the checkpoint's file before its own: {calls:?}");
    ensure!(syncs(renames[1] + 1, calls.len()) >= 1, "the state directory synced after the checkpoint's rename: {calls:?}");
    // The driver's state is the agent's alone.
    let mode = std::fs::metadata(dir.path().join("state/dra"))?.permissions().mode() & 0o777;
    ensure!(mode == 0o700, "state/dra is {mode:o}, not 0700");
    for refused in ["moved", "pending", "big"] {
        ensure!(gets(&api, refused) == 1, "{refused}: one GET");
    }

    // Again: the same devices, from the checkpoint.
    ensure!(gets(&api, "train") == 1, "one GET of the claim");
    let again = kubelet.prepare(&plugin, vec![claim("team-a", "train", TRAIN_UID)])?;
    ensure!(again.claims[TRAIN_UID] == *prepared, "the same devices: {again:?}");
    ensure!(gets(&api, "train") == 1, "the second prepare did not ask the API server");
    wait_metric(&agent, "vramguard_dra_prepares_total", &[("result", "prepared")], 1.0)?;
    wait_metric(&agent, "vramguard_dra_prepares_total", &[("result", "repeated")], 1.0)?;
    wait_metric(&agent, "vramguard_dra_prepares_total", &[("result", "refused")], 3.0)?;
    for reason in ["uid_changed", "not_allocated", "over_capacity"] {
        wait_metric(&agent, "vramguard_dra_prepare_refusals_total", &[("reason", reason)], 1.0)?;
    }
    wait_metric(&agent, "vramguard_dra_prepared_claims", &[], 1.0)?;

    // The agent stops (its sockets go with it); the claim is deleted from the API server; a new
    // agent unprepares it from the checkpoint alone.
    agent.stop()?;
    ensure!(!plugin.socket.exists() && !dra_socket.exists(), "the sockets are removed at the stop");
    api.delete_claim("team-a", "train");
    // This time NVML fails (every call after init): the GPUs are unhealthy.
    let failing = FakeNode::new("dra-plugin-nvml").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_NVML", "fail");
    let agent = start_agent(&api, dir.path(), &account, &failing, &[])?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    let mut health = kubelet.watch_health(&plugin)?;
    let unhealthy = kubelet.health_until(&mut health, timeout(), |m| all(m, HealthStatus::Unhealthy)).with_context(|| agent.log())?;
    ensure!(unhealthy.devices.len() == 2 && unhealthy.devices[0].message.starts_with("NVML is failing: "), "{unhealthy:?}");
    drop(health);
    wait_metric(&agent, "vramguard_dra_prepared_claims", &[], 1.0)?;
    let gone = kubelet.unprepare(&plugin, vec![claim("team-a", "train", TRAIN_UID), claim("team-a", "never", "uid-never-prepared")])?;
    ensure!(gone.claims.len() == 2 && gone.claims.values().all(|c| c.error.is_empty()), "{gone:?}\n{}", agent.log());
    ensure!(!spec_path.exists(), "the spec is removed");
    let checkpoint = std::fs::read_to_string(dir.path().join("state/dra/checkpoint.json"))?;
    ensure!(!checkpoint.contains(TRAIN_UID), "the checkpoint forgot the claim: {checkpoint}");
    wait_metric(&agent, "vramguard_dra_unprepares_total", &[("result", "unprepared")], 1.0)?;
    wait_metric(&agent, "vramguard_dra_unprepares_total", &[("result", "not_prepared")], 1.0)?;
    wait_metric(&agent, "vramguard_dra_prepared_claims", &[], 0.0)?;
    ensure!(gets(&api, "train") == 1, "unprepare needs no API server");
    agent.stop()?;
    fake.cleanup();
    failing.cleanup();
    Ok(())
}

#[test]
fn a_panic_in_the_plugin_ends_the_agent_naming_it_and_the_next_agent_replaces_its_stale_sockets() -> Result<()> {
    let (api, dir, account) = scene("dra-plugin-panic")?;
    let _runtime = runtime(dir.path())?;
    let fake = FakeNode::new("dra-plugin-panic").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let trigger = dir.path().join("panic-now");
    let fault = format!("panic:dra-plugin:{}", trigger.display());
    let mut agent = start_agent(&api, dir.path(), &account, &fake, &["--fault", &fault])?;
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    std::fs::write(&trigger, b"now")?;
    let (status, _) = agent.wait_exit(timeout())?;
    let log = agent.log();
    ensure!(!status.success(), "the agent exits non-zero: {log}");
    ensure!(log.contains("the dra-plugin task failed: it panicked: fault injected"), "the agent names the task: {log}");
    // The panic left the sockets behind: the next agent removes them and serves again.
    ensure!(plugin.socket.exists(), "a stale registration socket");
    drop(agent);
    std::fs::remove_file(&trigger)?;
    let agent = start_agent(&api, dir.path(), &account, &fake, &[])?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    let answer = kubelet.unprepare(&plugin, vec![claim("team-a", "none", "uid-none")])?;
    ensure!(answer.claims["uid-none"].error.is_empty(), "{answer:?}");
    ensure!(agent.log().contains("removed a stale socket"), "{}", agent.log());
    agent.stop()?;
    fake.cleanup();
    Ok(())
}

/// Whether the message has every GPU of the node (two) at `health`.
fn all(message: &NodeWatchResourcesResponse, health: HealthStatus) -> bool {
    message.devices.len() == 2 && message.devices.iter().all(|d| d.health == health as i32)
}

/// What is on the node of claim `TRAIN_UID`: its spec, its directory, its checkpoint entry.
fn on_disk(dir: &Path) -> Result<(bool, bool, bool)> {
    let spec = dir.join("cdi").join(format!("{DRIVER}-{TRAIN_UID}.json")).exists();
    let claim_dir = dir.join("state/dra/claims").join(TRAIN_UID).exists();
    let checkpoint = std::fs::read_to_string(dir.join("state/dra/checkpoint.json")).unwrap_or_default().contains(TRAIN_UID);
    Ok((spec, claim_dir, checkpoint))
}

#[test]
fn a_kill_at_each_step_of_prepare_and_unprepare_leaves_what_a_restarted_agent_completes_or_undoes() -> Result<()> {
    let (api, dir, account) = scene("dra-plugin-crash")?;
    let _runtime = runtime(dir.path())?;
    let train = [(DRIVER, NODE, "gpu-1", Some("8Gi"), SHARE)];
    api.put_claim(resource::claim("team-a", "train", TRAIN_UID, "8Gi", Some(&train)));
    let fake = FakeNode::new("dra-plugin-crash").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "16g");
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;
    let prepare = |plugin: &dra::kubelet::Plugin| kubelet.prepare(plugin, vec![claim("team-a", "train", TRAIN_UID)]);
    let unprepare = |plugin: &dra::kubelet::Plugin| kubelet.unprepare(plugin, vec![claim("team-a", "train", TRAIN_UID)]);
    // (step, whether the claim is prepared before the call, what a kill there leaves on disk:
    // spec, directory, checkpoint entry).
    let steps = [
        ("prepare-spec", false, (true, true, false)),
        ("prepare-recorded", false, (true, true, true)),
        ("unprepare-spec", true, (false, false, true)),
        ("unprepare-forgotten", true, (false, false, false)),
    ];
    for (step, prepared_before, left) in steps {
        if prepared_before {
            let agent = start_agent(&api, dir.path(), &account, &fake, &[])?;
            let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
            ensure!(prepare(&plugin)?.claims[TRAIN_UID].error.is_empty(), "{step}: prepared first\n{}", agent.log());
            agent.stop()?;
        }
        let fault = format!("die:{step}");
        let mut agent = start_agent(&api, dir.path(), &account, &fake, &["--fault", &fault])?;
        let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
        let call = if prepared_before { unprepare(&plugin).map(|_| ()) } else { prepare(&plugin).map(|_| ()) };
        ensure!(call.is_err(), "{step}: the agent died inside the call");
        let (status, _) = agent.wait_exit(timeout())?;
        ensure!(std::os::unix::process::ExitStatusExt::signal(&status) == Some(9), "{step}: killed: {status:?}");
        ensure!(on_disk(dir.path())? == left, "{step}: left {:?}", on_disk(dir.path())?);
        drop(agent);

        // The next agent, and the kubelet asking again.
        let agent = start_agent(&api, dir.path(), &account, &fake, &[])?;
        let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
        let at_start = on_disk(dir.path())?;
        if prepared_before {
            // A recorded claim's spec is there again at start; the retry undoes it all.
            ensure!(at_start == (left.2, left.2, left.2), "{step}: at start {at_start:?}\n{}", agent.log());
            ensure!(unprepare(&plugin)?.claims[TRAIN_UID].error.is_empty(), "{step}: the retry");
            ensure!(on_disk(dir.path())? == (false, false, false), "{step}: undone {:?}", on_disk(dir.path())?);
        } else {
            // An unrecorded claim's spec is removed at start; a recorded one's kept.
            ensure!(at_start == (left.2, left.2, left.2), "{step}: at start {at_start:?}\n{}", agent.log());
            ensure!(prepare(&plugin)?.claims[TRAIN_UID].error.is_empty(), "{step}: the retry\n{}", agent.log());
            ensure!(on_disk(dir.path())? == (true, true, true), "{step}: completed {:?}", on_disk(dir.path())?);
            ensure!(unprepare(&plugin)?.claims[TRAIN_UID].error.is_empty(), "{step}: cleaned for the next step");
        }
        agent.stop()?;
    }
    fake.cleanup();
    Ok(())
}

#[test]
fn a_prepared_claim_deleted_from_the_api_server_stops_holding_its_share_after_the_window() -> Result<()> {
    let (api, dir, account) = scene("dra-plugin-stale")?;
    let _runtime = runtime(dir.path())?;
    let fake = FakeNode::new("dra-plugin-stale").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "16g");
    let big = [(DRIVER, NODE, "gpu-0", Some("12Gi"), SHARE)];
    api.put_claim(resource::claim("team-a", "big", "uid-stale-big", "12Gi", Some(&big)));
    let next = [(DRIVER, NODE, "gpu-0", Some("8Gi"), "0c6f7a1e-0000-4000-8000-0000000000b2")];
    api.put_claim(resource::claim("team-a", "next", "uid-stale-next", "8Gi", Some(&next)));
    // A window of 0 s, looked at each second.
    let agent = start_agent(&api, dir.path(), &account, &fake, &["--dra-stale-after-s", "0", "--dra-stale-every-s", "1"])?;
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    ensure!(kubelet.prepare(&plugin, vec![claim("team-a", "big", "uid-stale-big")])?.claims["uid-stale-big"].error.is_empty(), "{}", agent.log());
    let refused = kubelet.prepare(&plugin, vec![claim("team-a", "next", "uid-stale-next")])?;
    ensure!(refused.claims["uid-stale-next"].error.contains("over-commits the GPU"), "12 + 8 GiB on a 16 GiB GPU: {refused:?}");
    // Still there: kept, whatever the sweeps.
    std::thread::sleep(std::time::Duration::from_secs(2));
    ensure!(dir.path().join("cdi").join(format!("{DRIVER}-uid-stale-big.json")).exists(), "a claim still in the API server is kept");
    // Deleted from the API server, never unprepared by the kubelet: dropped, its share free.
    api.delete_claim("team-a", "big");
    wait_metric(&agent, "vramguard_dra_stale_claims_dropped_total", &[], 1.0)?;
    ensure!(!dir.path().join("cdi").join(format!("{DRIVER}-uid-stale-big.json")).exists(), "its spec removed");
    wait_metric(&agent, "vramguard_dra_prepared_claims", &[], 0.0)?;
    let prepared = kubelet.prepare(&plugin, vec![claim("team-a", "next", "uid-stale-next")])?;
    ensure!(prepared.claims["uid-stale-next"].error.is_empty(), "{prepared:?}\n{}", agent.log());
    ensure!(agent.log().contains("dropped a prepared claim the API server no longer has"), "{}", agent.log());
    agent.stop()?;
    fake.cleanup();
    Ok(())
}

#[test]
fn dra_without_nri_refuses_to_start_and_hands_out_nothing() -> Result<()> {
    let (api, dir, account) = scene("dra-plugin-no-nri")?;
    let fake = FakeNode::new("dra-plugin-no-nri").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let mut env = api.pod_env(&account);
    env.extend(fake.env().iter().cloned());
    let out = std::process::Command::new(e2e::agent::agent_bin()?)
        .arg("run")
        .arg("--socket")
        .arg(dir.path().join("agent.sock"))
        .arg("--libcuda")
        .arg(&libcuda)
        .args(["--no-discover", "--kube", "--dra", "--kubelet-registry-dir"])
        .arg(dir.path().join("registry"))
        .arg("--kubelet-plugins-dir")
        .arg(dir.path().join("plugins"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "the agent must not start: {stderr}");
    ensure!(stderr.contains("--dra needs --nri") && stderr.contains("nothing behind their claim"), "it says why: {stderr}");
    ensure!(!dir.path().join("registry").join(format!("{DRIVER}-reg.sock")).exists(), "no plugin registered");
    ensure!(api.with(|s| s.resource.slices.is_empty()), "no slice published");
    fake.cleanup();
    Ok(())
}

#[test]
fn while_the_agent_is_not_connected_to_the_runtime_s_nri_no_claim_is_prepared() -> Result<()> {
    let (api, dir, account) = scene("dra-plugin-nri-down")?;
    let fake = FakeNode::new("dra-plugin-nri-down").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "16g");
    let train = [(DRIVER, NODE, "gpu-1", Some("8Gi"), SHARE)];
    api.put_claim(resource::claim("team-a", "train", TRAIN_UID, "8Gi", Some(&train)));
    // No runtime yet (NRI off in containerd 1.7's configuration looks the same to the agent).
    let agent = start_agent(&api, dir.path(), &account, &fake, &[])?;
    let kubelet = Kubelet::new(&dir.path().join("registry"))?;
    let plugin = kubelet.register(DRIVER, timeout()).with_context(|| agent.log())?;
    let refused = kubelet.prepare(&plugin, vec![claim("team-a", "train", TRAIN_UID)])?;
    let error = &refused.claims[TRAIN_UID].error;
    ensure!(error.contains("not connected to the container runtime's NRI") && refused.claims[TRAIN_UID].devices.is_empty(), "{refused:?}");
    ensure!(!dir.path().join("cdi").join(format!("{DRIVER}-{TRAIN_UID}.json")).exists(), "no spec");
    wait_metric(&agent, "vramguard_dra_prepare_refusals_total", &[("reason", "nri_down")], 1.0)?;
    // The runtime comes: the kubelet's next try is prepared.
    let _runtime = runtime(dir.path())?;
    wait_for(timeout(), "the agent connected to the runtime's NRI", || Ok(agent.audit()?["nri_connected"] == true)).with_context(|| agent.log())?;
    let prepared = kubelet.prepare(&plugin, vec![claim("team-a", "train", TRAIN_UID)])?;
    ensure!(prepared.claims[TRAIN_UID].error.is_empty(), "{prepared:?}\n{}", agent.log());
    agent.stop()?;
    fake.cleanup();
    Ok(())
}
