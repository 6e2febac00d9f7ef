//! The agent's NRI plugin (`agent::provision::nri`) against a real containerd (1.7, NRI 0.6)
//! driven through CRI: it registers and is synchronized with the pods and containers already
//! there; a container created through CRI gets the handler's environment (replacing the pod's
//! own value) and a read-only single-file bind mount, seen from inside with exec; a handler
//! error, or a handler past the plugin's deadline, fails the creation and the plugin stays; removals reach the handler; after containerd
//! restarts, the plugin is back by itself. Needs root and the cache `cargo xtask setup` fills.
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use agent::provision::nri::{Adjustment, Container, Handler, Mount, Pod};
use e2e::containerd::{ContainerSpec, Containerd};
use e2e::TempDir;

mod nri_thread;

/// Where the test handler mounts its limits file.
const LIMITS: &str = "/run/vramguard/limits";
/// The annotation that makes the test handler refuse a container.
const REFUSE: &str = "vramguard.test/refuse";
const REFUSAL: &str = "refused by the test handler";
/// The annotation that makes the test handler take an hour.
const STALL: &str = "vramguard.test/stall";

/// What the test handler was called with (a few records: their size does not matter).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Seen {
    Sync(Vec<Pod>, Vec<Container>),
    Create(Pod, Container),
    RemoveContainer(String),
    RemovePod(String),
}

/// Mounts `limits` read-only and sets two variables in containers named `provisioned*`;
/// refuses those annotated [`REFUSE`], stalls on those annotated [`STALL`]; leaves the others
/// alone.
struct TestHandler {
    seen: Mutex<mpsc::Sender<Seen>>,
    limits: PathBuf,
}

impl TestHandler {
    fn record(&self, seen: Seen) {
        if let Ok(tx) = self.seen.lock() {
            let _ = tx.send(seen);
        }
    }
}

impl Handler for TestHandler {
    async fn synchronize(&self, pods: Vec<Pod>, containers: Vec<Container>) {
        self.record(Seen::Sync(pods, containers));
    }

    async fn create_container(&self, pod: Pod, container: Container) -> Result<Adjustment, String> {
        self.record(Seen::Create(pod.clone(), container.clone()));
        if container.annotations.contains_key(REFUSE) {
            return Err(REFUSAL.into());
        }
        if container.annotations.contains_key(STALL) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        if !container.name.starts_with("provisioned") {
            return Ok(Adjustment::default());
        }
        Ok(Adjustment {
            mounts: vec![Mount { source: self.limits.clone(), destination: LIMITS.into(), read_only: true }],
            env: vec![("CUDA_DEVICE_MEMORY_LIMIT".into(), "1g".into()), ("POD_NAME".into(), pod.name)],
        })
    }

    async fn remove_container(&self, _pod: Pod, container: Container) {
        self.record(Seen::RemoveContainer(container.id));
    }

    async fn remove_pod(&self, pod: Pod) {
        self.record(Seen::RemovePod(pod.id));
    }
}

/// The plugin, on a thread of its own with a current-thread runtime as in the agent.
type Plugin = nri_thread::Plugin<Seen>;

/// The test handler as plugin `vramguard` on `socket`, injecting `limits`.
fn start(socket: &Path, limits: &Path) -> Plugin {
    let (tx, seen) = mpsc::channel();
    Plugin::start(socket, "vramguard", TestHandler { seen: Mutex::new(tx), limits: limits.to_path_buf() }, seen)
}

/// A containerd with its NRI socket in `dir`, and a limits file in `dir`.
fn setup(dir: &TempDir) -> (Containerd, PathBuf) {
    let limits = dir.path().join("limits");
    std::fs::write(&limits, "gpu0 1073741824\n").unwrap();
    let containerd = Containerd::start(&dir.path().join("nri.sock")).expect("start containerd");
    (containerd, limits)
}

fn env_of(containerd: &Containerd, container: &e2e::containerd::ContainerId) -> Vec<String> {
    let out = containerd.exec_sync(container, &["env"]).expect("exec env");
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    out.stdout.lines().map(str::to_owned).collect()
}

#[test]
fn plugin_is_synchronized_and_adjusts_containers_created_through_cri() {
    let dir = TempDir::new("nri-plugin").unwrap();
    let (containerd, limits) = setup(&dir);
    // Made before the plugin exists: Synchronize must name it; nothing is injected into it.
    let early_pod = containerd.pod("early", "team-a", "uid-early", &[]).unwrap();
    let early = containerd.run_container(&early_pod, &ContainerSpec::new("early")).unwrap();

    let plugin = start(containerd.nri_socket(), &limits);
    let took = plugin.wait_connected();
    eprintln!("plugin registered and synchronized {took:?} after start");
    let Seen::Sync(pods, containers) = plugin.next() else { panic!("Synchronize first") };
    let pod = pods.iter().find(|p| p.id == early_pod.0).expect("the early pod synchronized");
    assert_eq!((pod.name.as_str(), pod.namespace.as_str(), pod.uid.as_str()), ("early", "team-a", "uid-early"));
    let synced = containers.iter().find(|c| c.id == early.0).expect("the early container synchronized");
    assert_eq!((synced.name.as_str(), synced.pod_id.as_str()), ("early", early_pod.0.as_str()));
    assert_eq!(synced.pid, Some(containerd.container_pid(&early).unwrap()));

    let pod_id = containerd.pod("web", "team-a", "uid-web", &[]).unwrap();
    let spec = ContainerSpec::new("provisioned").env("CUDA_DEVICE_MEMORY_LIMIT", "64g").env("KEEP", "me");
    let container = containerd.run_container(&pod_id, &spec).unwrap();
    let Seen::Create(pod, created) = plugin.next() else { panic!("CreateContainer") };
    assert_eq!((pod.id.as_str(), pod.name.as_str(), pod.uid.as_str()), (pod_id.0.as_str(), "web", "uid-web"));
    assert_eq!((created.id.as_str(), created.name.as_str()), (container.0.as_str(), "provisioned"));
    // The handler sees the container's own environment, before the adjustment.
    assert!(created.env.contains(&("CUDA_DEVICE_MEMORY_LIMIT".into(), "64g".into())), "{:?}", created.env);
    assert_eq!(created.cgroups_path, containerd.container_cgroup_path(&container).unwrap());

    // Inside: the handler's value replaced the pod's, the rest of the pod's env is there.
    let env = env_of(&containerd, &container);
    let limit: Vec<_> = env.iter().filter(|l| l.starts_with("CUDA_DEVICE_MEMORY_LIMIT=")).collect();
    assert_eq!(limit, ["CUDA_DEVICE_MEMORY_LIMIT=1g"], "{env:?}");
    assert!(env.contains(&"POD_NAME=web".to_string()) && env.contains(&"KEEP=me".to_string()), "{env:?}");
    // The file is mounted, read-only.
    let out = containerd.exec_sync(&container, &["cat", LIMITS]).unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "gpu0 1073741824\n"), "{}", out.stderr);
    let out = containerd.exec_sync(&container, &["sh", "-c", &format!("echo 8g > {LIMITS}")]).unwrap();
    assert_ne!(out.exit_code, 0, "the limits file is writable from the container");
    assert!(out.stderr.contains("Read-only"), "{}", out.stderr);
    assert_eq!(std::fs::read_to_string(&limits).unwrap(), "gpu0 1073741824\n");
    let mounts = containerd.container_mounts(&container).unwrap();
    let mount = mounts.iter().find(|(dest, _, _)| dest == LIMITS).expect("the mount in runc's spec");
    assert_eq!(Path::new(&mount.1), limits);
    assert!(mount.2.contains(&"ro".to_string()), "{mount:?}");

    // Control: the container made before the plugin, and one it leaves alone, have none of it.
    for (control, name) in [(&early, "early"), (&containerd.run_container(&pod_id, &ContainerSpec::new("plain")).unwrap(), "plain")] {
        assert_eq!(containerd.exec_sync(control, &["cat", LIMITS]).unwrap().exit_code, 1, "{name}");
        assert!(!env_of(&containerd, control).iter().any(|l| l.starts_with("CUDA_DEVICE_MEMORY_LIMIT=")), "{name}");
    }
    assert!(matches!(plugin.next(), Seen::Create(_, c) if c.name == "plain"));

    // Removals reach the handler.
    containerd.remove_container(&container).unwrap();
    assert!(matches!(plugin.next(), Seen::RemoveContainer(id) if id == container.0));
    containerd.remove_pod(&pod_id).unwrap();
    loop {
        match plugin.next() {
            Seen::RemovePod(id) => break assert_eq!(id, pod_id.0),
            Seen::RemoveContainer(_) => {} // the "plain" container goes with its pod
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_handler_error_fails_the_creation_and_the_plugin_stays() {
    let dir = TempDir::new("nri-refuse").unwrap();
    let (containerd, limits) = setup(&dir);
    let plugin = start(containerd.nri_socket(), &limits);
    plugin.wait_connected();
    assert!(matches!(plugin.next(), Seen::Sync(..)));

    let pod = containerd.pod("web", "team-a", "uid-refuse", &[]).unwrap();
    let spec = ContainerSpec::new("provisioned").annotation(REFUSE, "yes");
    let error = containerd.create_container(&pod, &spec).expect_err("the handler refuses it");
    assert!(format!("{error:#}").contains(REFUSAL), "{error:#}");
    let Seen::Create(_, refused) = plugin.next() else { panic!("CreateContainer") };
    assert!(refused.annotations.contains_key(REFUSE));
    // containerd undoes the creation, and tells the plugins.
    assert!(matches!(plugin.next(), Seen::RemoveContainer(id) if id == refused.id));

    // A handler slower than the runtime's 2 s: the plugin answers an error at its deadline
    // (1.5 s), so the creation fails and the runtime keeps the plugin.
    let spec = ContainerSpec::new("provisioned-slow").annotation(STALL, "yes");
    let error = containerd.create_container(&pod, &spec).expect_err("the plugin gives up on it");
    assert!(format!("{error:#}").contains("not provisioned within"), "{error:#}");
    let Seen::Create(_, stalled) = plugin.next() else { panic!("CreateContainer") };
    assert!(matches!(plugin.next(), Seen::RemoveContainer(id) if id == stalled.id));

    // The plugin is still registered (no new Synchronize came): the next container gets its
    // adjustment.
    let container = containerd.run_container(&pod, &ContainerSpec::new("provisioned-2")).unwrap();
    let next = plugin.next();
    assert!(matches!(&next, Seen::Create(_, c) if c.id == container.0), "{next:?}");
    assert!(env_of(&containerd, &container).contains(&"CUDA_DEVICE_MEMORY_LIMIT=1g".to_string()));
    assert!(*plugin.connected.borrow());
}

#[test]
fn the_plugin_is_back_after_containerd_restarts() {
    let dir = TempDir::new("nri-restart").unwrap();
    let (mut containerd, limits) = setup(&dir);
    let plugin = start(containerd.nri_socket(), &limits);
    plugin.wait_connected();
    assert!(matches!(plugin.next(), Seen::Sync(..)));
    let pod = containerd.pod("web", "team-a", "uid-restart", &[]).unwrap();
    let before = containerd.run_container(&pod, &ContainerSpec::new("provisioned-before")).unwrap();
    assert!(matches!(plugin.next(), Seen::Create(..)));

    containerd.restart().expect("restart containerd");
    let back = Instant::now();
    // A new connection's Synchronize, naming what survived the restart.
    let Seen::Sync(_, containers) = plugin.next() else { panic!("Synchronize after the restart") };
    eprintln!("plugin synchronized again {:?} after containerd answered CRI", back.elapsed());
    assert!(containers.iter().any(|c| c.id == before.0), "{containers:?}");
    plugin.wait_connected();

    let after = containerd.run_container(&pod, &ContainerSpec::new("provisioned-after")).unwrap();
    assert!(matches!(plugin.next(), Seen::Create(_, c) if c.id == after.0));
    assert!(env_of(&containerd, &after).contains(&"CUDA_DEVICE_MEMORY_LIMIT=1g".to_string()));
}
