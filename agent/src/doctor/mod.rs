//! `vramguard doctor`: the node's preconditions, one line each, `ok`, `warn` or `fail`, with
//! what to change and where `docs/operations.md` says more. Run on a node (the DaemonSet's pod
//! or the host); exits non-zero when a check fails (`warn` alone exits 0).
//!
//! Each group reads what it needs once ([`host`]: the kernel's files, [`containerd`]: the
//! runtime's config and NRI socket, [`gpu`]: NVML and the device files, [`kube`]: the API
//! server with `--kube`) and judges it with pure functions, which the unit tests feed with
//! text and fixtures. Host paths are read under `--root` (the host's file system as this
//! process sees it), and each one the tests move has a flag of its own.
pub mod containerd;
pub mod gpu;
pub mod host;
pub mod kube;

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::provision::kube::ApiArgs;

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, with less than it could (or not known here): the line says what is missing.
    Warn,
    /// The agent cannot do its work on this node as it is.
    Fail,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One precondition's line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// The check's name (see [`DOCS`]).
    pub check: &'static str,
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to change, where the status is not `ok`.
    pub fix: Option<String>,
    /// Where the documentation says more: `docs/operations.md#anchor`.
    pub docs: String,
}

/// Each check and the section of `docs/operations.md` that explains its lines.
pub const DOCS: &[(&str, &str)] = &[
    ("kernel", "doctor-kernel-btf-uprobes-cgroups"),
    ("btf", "doctor-kernel-btf-uprobes-cgroups"),
    ("uprobes", "doctor-kernel-btf-uprobes-cgroups"),
    ("tracefs", "doctor-kernel-btf-uprobes-cgroups"),
    ("cgroups", "doctor-kernel-btf-uprobes-cgroups"),
    ("cgroup-namespace", "doctor-kernel-btf-uprobes-cgroups"),
    ("containerd-config", "doctor-containerd-nri-cdi-nvidia-runtime"),
    ("nri", "doctor-containerd-nri-cdi-nvidia-runtime"),
    ("cdi", "doctor-containerd-nri-cdi-nvidia-runtime"),
    ("nvidia-runtime", "doctor-containerd-nri-cdi-nvidia-runtime"),
    ("nvml", "doctor-nvml-the-driver-and-the-device-files"),
    ("driver-limits", "doctor-nvml-the-driver-and-the-device-files"),
    ("mig", "doctor-nvml-the-driver-and-the-device-files"),
    ("device-files", "doctor-nvml-the-driver-and-the-device-files"),
    ("kube-api", "doctor-the-kubernetes-api---kube"),
    ("kube-rbac", "doctor-the-kubernetes-api---kube"),
    ("device-plugin", "doctor-the-kubernetes-api---kube"),
    ("dra-drivers", "doctor-the-kubernetes-api---kube"),
    ("dra-gate", "doctor-the-kubernetes-api---kube"),
];

impl Check {
    fn new(check: &'static str, status: Status, detail: impl Into<String>, fix: Option<String>) -> Check {
        let anchor = DOCS.iter().find(|(name, _)| *name == check).map_or("vramguard-doctor", |(_, anchor)| anchor);
        Check { check, status, detail: detail.into(), fix, docs: format!("docs/operations.md#{anchor}") }
    }

    pub fn ok(check: &'static str, detail: impl Into<String>) -> Check {
        Check::new(check, Status::Ok, detail, None)
    }

    pub fn warn(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check::new(check, Status::Warn, detail, Some(fix.into()))
    }

    pub fn fail(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check::new(check, Status::Fail, detail, Some(fix.into()))
    }
}

/// `vramguard doctor`'s flags.
#[derive(clap::Args, Clone, Debug)]
pub struct DoctorArgs {
    /// Print the checks as JSON (an array of {check, status, detail, fix, docs}).
    #[arg(long)]
    pub json: bool,
    /// The host's file system as this process sees it: /proc, /sys, /dev, /etc/containerd and
    /// /var/run/nri are read under it.
    #[arg(long, default_value = "/", value_name = "DIR")]
    pub root: PathBuf,
    /// containerd's configuration file [default: ROOT/etc/containerd/config.toml].
    #[arg(long, value_name = "PATH")]
    pub containerd_config: Option<PathBuf>,
    /// The NRI socket the agent dials (`run --nri-socket`) [default: ROOT/var/run/nri/nri.sock].
    #[arg(long, value_name = "PATH")]
    pub nri_socket: Option<PathBuf>,
    /// Where the GPUs' device files are (`nvidia<minor>`, `nvidiactl`, `nvidia-uvm`)
    /// [default: ROOT/dev].
    #[arg(long, value_name = "DIR")]
    pub dev_dir: Option<PathBuf>,
    /// Where `run --dra` writes the prepared claims' CDI specs (`run --cdi-dir`): containerd
    /// must read specs from there.
    #[arg(long, default_value = "/var/run/cdi", value_name = "DIR")]
    pub cdi_dir: PathBuf,
    /// A libcuda file, as given to `run` (NVML is looked for beside it).
    #[arg(long = "libcuda", value_name = "PATH")]
    pub libcuda: Vec<PathBuf>,
    /// The NVML library, as given to `run`.
    #[arg(long, value_name = "PATH")]
    pub nvml: Option<PathBuf>,
    /// Check the Kubernetes API too: reachable, the agent's RBAC, NVIDIA's device plugin and
    /// DRA drivers on this node, the DRAConsumableCapacity gate. Reached as `run --kube` does.
    #[arg(long)]
    pub kube: bool,
    #[command(flatten)]
    pub api: ApiArgs,
    /// This node's name, as the API server knows it.
    #[arg(long, visible_alias = "node-name", env = "NODE_NAME", value_name = "NAME")]
    pub node: Option<String>,
}

/// The host path `path` (absolute) as seen under `root`.
pub fn under(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// Runs every check and prints them; `Ok(false)` when one failed.
pub fn run(args: DoctorArgs) -> anyhow::Result<bool> {
    let checks = checks(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        print!("{}", render(&checks));
    }
    Ok(passed(&checks))
}

/// Every check, in the order they are printed.
pub fn checks(args: &DoctorArgs) -> anyhow::Result<Vec<Check>> {
    let mut checks = host::checks(&host::Facts::read(&args.root));
    let config = args.containerd_config.clone().unwrap_or_else(|| under(&args.root, containerd::CONFIG));
    let (socket_host, socket_seen) = match &args.nri_socket {
        Some(path) => (path.clone(), path.clone()),
        None => (PathBuf::from(containerd::NRI_SOCKET), under(&args.root, containerd::NRI_SOCKET)),
    };
    checks.extend(containerd::checks(&containerd::Facts::read(&config, &socket_host, &socket_seen), &args.cdi_dir));
    let dev_dir = args.dev_dir.clone().unwrap_or_else(|| under(&args.root, "/dev"));
    checks.extend(gpu::checks(&gpu::Facts::read(args.nvml.as_deref(), &args.libcuda, &args.root, &dev_dir)));
    if args.kube {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        checks.extend(runtime.block_on(kube::checks(&args.api, args.node.as_deref())));
    }
    Ok(checks)
}

/// Whether no check failed.
pub fn passed(checks: &[Check]) -> bool {
    checks.iter().all(|c| c.status != Status::Fail)
}

/// The text form: a line per check (`STATUS CHECK DETAIL`, then, where something is to be
/// changed, `-> FIX (see DOCS)`), and a count.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.check.len()).max().unwrap_or(0);
    let mut out = String::new();
    for check in checks {
        out.push_str(&format!("{:<4}  {:<width$}  {}", check.status.name(), check.check, check.detail));
        if let Some(fix) = &check.fix {
            out.push_str(&format!(" -> {fix} (see {})", check.docs));
        }
        out.push('\n');
    }
    let count = |status| checks.iter().filter(|c| c.status == status).count();
    out.push_str(&format!("{} ok, {} warn, {} fail\n", count(Status::Ok), count(Status::Warn), count(Status::Fail)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GitHub's anchor of a heading: lowercased, spaces to `-`, other punctuation dropped.
    fn anchor(heading: &str) -> String {
        heading
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn every_check_points_at_a_section_that_exists() {
        let docs = include_str!("../../../docs/operations.md");
        let anchors: Vec<String> = docs.lines().filter_map(|l| l.strip_prefix('#')).map(|l| anchor(l.trim_start_matches('#'))).collect();
        assert!(anchors.iter().any(|a| a == "vramguard-doctor"), "{anchors:?}");
        for (check, section) in DOCS {
            assert!(anchors.iter().any(|a| a == section), "{check}: no heading with the anchor {section}");
        }
        assert_eq!(Check::ok("nri", "x").docs, "docs/operations.md#doctor-containerd-nri-cdi-nvidia-runtime");
    }

    #[test]
    fn a_fail_fails_the_run_and_warnings_do_not() {
        let mut checks = vec![Check::ok("kernel", "6.8"), Check::warn("mig", "unread", "look")];
        assert!(passed(&checks));
        checks.push(Check::fail("nri", "off", "turn it on"));
        assert!(!passed(&checks));
        let text = render(&checks);
        assert!(text.contains("fail  nri     off -> turn it on (see docs/operations.md#doctor-containerd-nri-cdi-nvidia-runtime)"), "{text}");
        assert!(text.starts_with("ok    kernel  6.8\n"), "{text}");
        assert!(text.ends_with("1 ok, 1 warn, 1 fail\n"), "{text}");
        let json = serde_json::to_value(&checks).expect("json");
        assert_eq!(json[2]["status"], "fail");
        assert_eq!(json[0]["fix"], serde_json::Value::Null);
        assert_eq!(json[1]["check"], "mig");
    }
}
