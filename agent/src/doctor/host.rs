//! The kernel's side: its version (the eBPF programs need 5.12), BTF, uprobes, tracefs (the
//! process-exit tracepoint) and the cgroup layout, from files under `--root`.
use std::path::Path;

use super::{under, Check};

/// The oldest kernel the eBPF programs load on (BPF ISA v3's atomic fetch-add and
/// compare-and-swap; README, "Quick start").
pub const MIN_KERNEL: (u32, u32) = (5, 12);

pub const OSRELEASE: &str = "/proc/sys/kernel/osrelease";
pub const BTF: &str = "/sys/kernel/btf/vmlinux";
pub const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe/type";
/// tracefs where it is usually mounted; `uprobe_events` and the exit tracepoint under it.
pub const TRACEFS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
const EXIT_FORMAT: &str = "events/sched/sched_process_exit/format";
/// The host's mount table (the first process's: the host's with `hostPID`), else this
/// process's own.
pub const MOUNTINFO: [&str; 2] = ["/proc/1/mountinfo", "/proc/self/mountinfo"];

/// The first process's cgroups (the host's init with `hostPID`).
pub const INIT_CGROUP: &str = "/proc/1/cgroup";

/// The cgroup v1 controllers (a v1 hierarchy with one of these is a controller hierarchy; a
/// `name=` one is not).
const V1_CONTROLLERS: [&str; 14] =
    ["cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio", "blkio", "perf_event", "hugetlb", "pids", "rdma", "misc"];

/// What the host checks read.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The kernel's release (`6.8.0-45-generic`), or why it could not be read.
    pub release: Result<String, String>,
    pub btf: bool,
    pub uprobe_pmu: bool,
    /// tracefs's `uprobe_events` exists (uprobes in the kernel even where the PMU is not seen).
    pub uprobe_events: bool,
    /// Where tracefs with the process-exit tracepoint is, if anywhere.
    pub tracefs: Option<String>,
    /// The mount table's text, or why it could not be read.
    pub mountinfo: Result<String, String>,
    /// The first process's `/proc/1/cgroup` as this process sees it, where readable.
    pub init_cgroup: Option<String>,
}

impl Facts {
    pub fn read(root: &Path) -> Facts {
        let exists = |path: &str| under(root, path).exists();
        let release = std::fs::read_to_string(under(root, OSRELEASE))
            .map(|text| text.trim().to_owned())
            .map_err(|error| format!("cannot read {}: {error}", under(root, OSRELEASE).display()));
        let mountinfo = MOUNTINFO
            .iter()
            .find_map(|path| std::fs::read_to_string(under(root, path)).ok())
            .ok_or_else(|| format!("cannot read {} or {}", under(root, MOUNTINFO[0]).display(), under(root, MOUNTINFO[1]).display()));
        Facts {
            release,
            btf: exists(BTF),
            uprobe_pmu: exists(UPROBE_PMU),
            uprobe_events: TRACEFS.iter().any(|dir| under(root, dir).join("uprobe_events").exists()),
            tracefs: TRACEFS.iter().find(|dir| under(root, dir).join(EXIT_FORMAT).exists()).map(|dir| dir.to_string()),
            mountinfo,
            init_cgroup: std::fs::read_to_string(under(root, INIT_CGROUP)).ok(),
        }
    }
}

pub fn checks(facts: &Facts) -> Vec<Check> {
    vec![
        kernel(&facts.release),
        btf(facts.btf),
        uprobes(facts.uprobe_pmu, facts.uprobe_events),
        tracefs(facts.tracefs.as_deref()),
        cgroups(&facts.mountinfo),
        cgroup_namespace(facts.init_cgroup.as_deref()),
    ]
}

/// Whether this process sees the host's cgroup2 tree: in a cgroup namespace of its own, the
/// first process's cgroup (the host's init, with `hostPID`) is outside it, and its path reads
/// `/..`; the containers' cgroups are then not under this process's `/sys/fs/cgroup`, and the
/// agent cannot name them (their probe limits, the driver's limits).
pub fn cgroup_namespace(init_cgroup: Option<&str>) -> Check {
    let Some(text) = init_cgroup else {
        return Check::warn("cgroup-namespace", "cannot read /proc/1/cgroup", "run the doctor as root with the host's pid namespace (hostPID in the agent's pod)");
    };
    let unified = text.lines().find_map(|line| line.strip_prefix("0::"));
    match unified {
        Some(path) if path.starts_with("/..") => Check::warn(
            "cgroup-namespace",
            format!("a cgroup namespace of its own: the host's init is at {path} from here, so the containers' cgroups are not under this process's /sys/fs/cgroup; their probe limits and the driver's limits (r615+) cannot be set, the hook alone holds provisioned containers"),
            "run the agent in the host's cgroup namespace (a host cgroup2 tree mounted at /sys/fs/cgroup, or a runtime that keeps the host's namespace for privileged pods)",
        ),
        Some(path) => Check::ok("cgroup-namespace", format!("the host's cgroup tree (the host's init at {})", if path.is_empty() { "/" } else { path })),
        None => Check::ok("cgroup-namespace", "no cgroup2 line for the host's init (cgroup v1): nothing to see"),
    }
}

/// `MAJOR.MINOR` of a kernel release.
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

pub fn kernel(release: &Result<String, String>) -> Check {
    let (major, minor) = MIN_KERNEL;
    let release = match release {
        Ok(release) => release,
        Err(error) => return Check::warn("kernel", error.clone(), format!("check by hand that the kernel is {major}.{minor} or later (`uname -r`)")),
    };
    match kernel_version(release) {
        Some(version) if version >= MIN_KERNEL => Check::ok("kernel", format!("{release} ({major}.{minor} or later needed)")),
        Some(_) => Check::fail(
            "kernel",
            format!("{release}: the eBPF programs need {major}.{minor} or later (atomic fetch-add and compare-and-swap)"),
            format!("upgrade the node's kernel to {major}.{minor} or later"),
        ),
        None => Check::warn("kernel", format!("cannot tell the version of release {release:?}"), format!("check by hand that the kernel is {major}.{minor} or later")),
    }
}

pub fn btf(present: bool) -> Check {
    if present {
        Check::ok("btf", format!("{BTF} present"))
    } else {
        Check::fail(
            "btf",
            format!("{BTF} is missing: the kernel exposes no BTF, or /sys/kernel/btf is not mounted here"),
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y; in the pod, keep the DaemonSet's `btf` volume",
        )
    }
}

pub fn uprobes(pmu: bool, events: bool) -> Check {
    match (pmu, events) {
        (true, _) => Check::ok("uprobes", format!("{UPROBE_PMU} present")),
        (false, true) => Check::fail(
            "uprobes",
            format!("tracefs has uprobe_events, but {UPROBE_PMU} is missing: `vramguard run` attaches through the uprobe PMU and stops at start without it"),
            "give this process the host's /sys (the PMU is there on every kernel with uprobes since 4.17)",
        ),
        (false, false) => Check::fail("uprobes", format!("{UPROBE_PMU} is missing: no uprobe support"), "use a kernel built with CONFIG_UPROBE_EVENTS=y"),
    }
}

pub fn tracefs(found: Option<&str>) -> Check {
    match found {
        Some(dir) => Check::ok("tracefs", format!("mounted at {dir} with sched:sched_process_exit")),
        None => Check::warn(
            "tracefs",
            format!("no tracefs with sched:sched_process_exit at {}: `vramguard run` mounts it itself at start", TRACEFS.join(" or ")),
            "in the pod, keep the `tracefs` volume, CAP_SYS_ADMIN and the Unconfined AppArmor profile (mount -t tracefs nodev /sys/kernel/tracing on the host)",
        ),
    }
}

/// The cgroup2 mount point and the v1 controllers mounted, from a mount table's text.
pub fn cgroup_mounts(mountinfo: &str) -> (Option<String>, Vec<String>) {
    let mut cgroup2 = None;
    let mut controllers = Vec::new();
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional...] - fstype source super-options
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let mut right = right.split_whitespace();
        let (Some(fstype), Some(_source), options) = (right.next(), right.next(), right.next().unwrap_or_default()) else { continue };
        match fstype {
            "cgroup2" => {
                cgroup2.get_or_insert_with(|| left.split_whitespace().nth(4).unwrap_or_default().to_owned());
            }
            "cgroup" => controllers.extend(options.split(',').filter(|o| V1_CONTROLLERS.contains(o)).map(str::to_owned)),
            _ => {}
        }
    }
    controllers.sort();
    controllers.dedup();
    (cgroup2, controllers)
}

pub fn cgroups(mountinfo: &Result<String, String>) -> Check {
    let text = match mountinfo {
        Ok(text) => text,
        Err(error) => return Check::warn("cgroups", error.clone(), "check by hand that cgroup2 is mounted (`mount -t cgroup2`)"),
    };
    match cgroup_mounts(text) {
        (Some(at), v1) if v1.is_empty() => Check::ok("cgroups", format!("cgroup v2 (unified) at {at}")),
        (Some(at), v1) => Check::warn(
            "cgroups",
            format!("hybrid: cgroup2 at {at}, the {} controllers on cgroup v1; `--enforce audit` works, `--enforce signal` is refused unless the runtime gives each container a cgroup2 group", v1.join(",")),
            "move the node to cgroup v2 (systemd.unified_cgroup_hierarchy=1), or add --cgroup2-separates-containers to `run` where the runtime is systemd-managed",
        ),
        (None, _) => Check::fail(
            "cgroups",
            "no cgroup2 hierarchy mounted (cgroup v1 only): the probes and the driver's limits cannot tell containers apart",
            "move the node to cgroup v2, or at least mount cgroup2 beside v1 (hybrid)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    const UNIFIED: &str = "25 1 0:23 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
        30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
    const HYBRID: &str = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
        32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n\
        35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
        40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd\n\
        41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw\n";
    const LEGACY: &str = "32 31 0:29 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n";

    #[test]
    fn the_kernel_must_be_5_12_or_later() {
        assert_eq!(kernel_version("6.8.0-45-generic"), Some((6, 8)));
        assert_eq!(kernel_version("5.15.153.1-microsoft-standard-WSL2"), Some((5, 15)));
        assert_eq!(kernel(&Ok("5.12.0".into())).status, Status::Ok);
        let old = kernel(&Ok("5.10.0-28-amd64".into()));
        assert_eq!(old.status, Status::Fail);
        assert!(old.detail.contains("5.12"), "{old:?}");
        assert_eq!(kernel(&Ok("weird".into())).status, Status::Warn);
        assert_eq!(kernel(&Err("cannot read".into())).status, Status::Warn);
    }

    #[test]
    fn btf_and_uprobes_are_required() {
        assert_eq!(btf(true).status, Status::Ok);
        assert_eq!(btf(false).status, Status::Fail);
        assert_eq!(uprobes(true, false).status, Status::Ok);
        let only_tracefs = uprobes(false, true);
        assert_eq!(only_tracefs.status, Status::Fail);
        assert!(only_tracefs.detail.contains("uprobe_events"), "{only_tracefs:?}");
        assert_eq!(uprobes(false, false).status, Status::Fail);
        assert_eq!(tracefs(Some("/sys/kernel/tracing")).status, Status::Ok);
        assert_eq!(tracefs(None).status, Status::Warn);
    }

    #[test]
    fn cgroups_unified_hybrid_and_legacy() {
        assert_eq!(cgroup_mounts(UNIFIED), (Some("/sys/fs/cgroup".into()), vec![]));
        assert_eq!(cgroup_mounts(HYBRID), (Some("/sys/fs/cgroup/unified".into()), vec!["cpu".into(), "cpuacct".into(), "memory".into()]));
        assert_eq!(cgroups(&Ok(UNIFIED.into())).status, Status::Ok);
        let hybrid = cgroups(&Ok(HYBRID.into()));
        assert_eq!(hybrid.status, Status::Warn);
        assert!(hybrid.detail.contains("cpu,cpuacct,memory") && hybrid.fix.as_deref().unwrap_or_default().contains("--cgroup2-separates-containers"), "{hybrid:?}");
        assert_eq!(cgroups(&Ok(LEGACY.into())).status, Status::Fail);
        assert_eq!(cgroups(&Err("unreadable".into())).status, Status::Warn);
    }

    #[test]
    fn a_cgroup_namespace_of_its_own_is_said() {
        assert_eq!(cgroup_namespace(Some("0::/init.scope\n")).status, Status::Ok);
        let private = cgroup_namespace(Some("0::/../../init.scope\n"));
        assert_eq!(private.status, Status::Warn);
        assert!(private.detail.contains("driver's limits"), "{private:?}");
        assert_eq!(cgroup_namespace(None).status, Status::Warn);
    }

    #[test]
    fn reads_a_root_of_files() {
        let dir = std::env::temp_dir().join(format!("vramguard-doctor-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in [(OSRELEASE, "4.19.0\n"), (UPROBE_PMU, "7\n"), ("/proc/self/mountinfo", UNIFIED), (INIT_CGROUP, "0::/../../init.scope\n")] {
            let path = under(&dir, path);
            std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
        let facts = Facts::read(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let got: Vec<(&str, Status)> = checks(&facts).iter().map(|c| (c.check, c.status)).collect();
        assert_eq!(
            got,
            [
                ("kernel", Status::Fail),
                ("btf", Status::Fail),
                ("uprobes", Status::Ok),
                ("tracefs", Status::Warn),
                ("cgroups", Status::Ok),
                ("cgroup-namespace", Status::Warn)
            ]
        );
    }
}
