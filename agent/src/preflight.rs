//! Checks that the node can run the agent before anything is loaded, each failure with an
//! error that says what is missing and how to fix it: root, BTF, tracefs, uprobes; and
//! whether cgroup ids tell containers apart, which `--enforce signal` needs.
//!
//! The probes know a process's container by its cgroup2 group (`bpf_get_current_cgroup_id`).
//! That separates containers only where the runtime places each container in a cgroup2
//! group of its own. The rule ([`cgroup_layout`], [`allow_signal_enforcement`]):
//!
//! - **unified** (no cgroup v1 hierarchy has a controller; cgroup2 mounted): the runtime can
//!   only place containers in cgroup2. Signal enforcement is allowed.
//! - **hybrid** (controllers on v1 hierarchies, cgroup2 mounted beside them, e.g. at
//!   `/sys/fs/cgroup/unified`): a runtime driving the v1 controllers may leave every container
//!   in the cgroup2 root, where one tenant's limit would signal another's processes. Signal
//!   enforcement is refused unless the operator states otherwise with
//!   `--cgroup2-separates-containers` (a systemd-managed runtime does place each container
//!   in a cgroup2 group of its own).
//! - **legacy** (no cgroup2 hierarchy mounted): every process is in the cgroup2 root; signal
//!   enforcement is refused, whatever the flags.
//!
//! The layout is read from `/proc/self/cgroup` (every v1 hierarchy lists every process, the
//! agent included, so a line other than `0::` means a v1 hierarchy exists) and the mount
//! table. Audit mode works on every layout.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

use crate::cgroup;

const BTF: &str = "/sys/kernel/btf/vmlinux";
const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe/type";
const TRACEFS_MOUNTS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
const EXIT_FORMAT: &str = "events/sched/sched_process_exit/format";
const RMDIR_FORMAT: &str = "events/cgroup/cgroup_rmdir/format";

/// What the checks found that loading needs.
pub struct Platform {
    /// Byte offset of `group_dead` in the `sched_process_exit` record.
    pub group_dead_offset: u32,
    /// Byte offsets of `root` and `id` in the `cgroup_rmdir` record, or why they are
    /// unknown (the agent then deletes removed cgroups' entries in its sweep only).
    pub rmdir_offsets: Result<RmdirOffsets, String>,
}

/// Where the `cgroup:cgroup_rmdir` record holds the hierarchy and the cgroup id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmdirOffsets {
    pub root: u32,
    pub id: u32,
}

/// Runs every check; mounts tracefs if it is not mounted yet.
pub fn check() -> Result<Platform> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "vramguard run must run as root: it loads eBPF programs and attaches uprobes \
             (CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN) and reads /proc of other processes"
        );
    }
    if !Path::new(BTF).exists() {
        bail!("this kernel exposes no BTF ({BTF} is missing): vramguard needs a kernel built with CONFIG_DEBUG_INFO_BTF=y");
    }
    if !Path::new(UPROBE_PMU).exists() {
        bail!("this kernel has no uprobe support ({UPROBE_PMU} is missing): vramguard needs CONFIG_UPROBE_EVENTS=y");
    }
    let tracefs = tracefs()?;
    let group_dead_offset = group_dead_offset(&tracefs.join(EXIT_FORMAT))?;
    let rmdir_offsets = rmdir_offsets(&tracefs.join(RMDIR_FORMAT));
    Ok(Platform { group_dead_offset, rmdir_offsets })
}

/// How the node's cgroups are laid out, as far as telling containers apart goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupLayout {
    /// Every controller on the cgroup2 hierarchy.
    Unified,
    /// These controllers on cgroup v1 hierarchies, cgroup2 mounted beside them.
    Hybrid { v1_controllers: Vec<String> },
    /// No cgroup2 hierarchy mounted.
    Legacy,
}

/// This node's layout, from `/proc/self/cgroup` and the mount table.
pub fn cgroup_layout() -> CgroupLayout {
    let text = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    layout_of(&text, cgroup::cgroup2_mount().is_some())
}

/// The layout a `/proc/<pid>/cgroup` text shows, given whether cgroup2 is mounted.
fn layout_of(proc_cgroup: &str, cgroup2_mounted: bool) -> CgroupLayout {
    if !cgroup2_mounted {
        return CgroupLayout::Legacy;
    }
    // `ID:CONTROLLERS:PATH`; ID 0 is cgroup2; `name=...` hierarchies have no controller.
    let mut v1_controllers: Vec<String> = proc_cgroup
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (id, controllers) = (fields.next()?, fields.next()?);
            (id != "0").then_some(controllers)
        })
        .flat_map(|controllers| controllers.split(','))
        .filter(|controller| !controller.is_empty() && !controller.starts_with("name="))
        .map(String::from)
        .collect();
    v1_controllers.sort();
    v1_controllers.dedup();
    if v1_controllers.is_empty() {
        CgroupLayout::Unified
    } else {
        CgroupLayout::Hybrid { v1_controllers }
    }
}

/// Whether `--enforce signal` may run on this layout; `asserted`: the operator's
/// `--cgroup2-separates-containers`.
pub fn allow_signal_enforcement(layout: &CgroupLayout, asserted: bool) -> Result<()> {
    match layout {
        CgroupLayout::Unified => Ok(()),
        CgroupLayout::Hybrid { v1_controllers } if asserted => {
            tracing::warn!(
                v1_controllers = %v1_controllers.join(","),
                "hybrid cgroups: --enforce signal allowed on the operator's word (--cgroup2-separates-containers) that every container has a cgroup2 group of its own"
            );
            Ok(())
        }
        CgroupLayout::Hybrid { v1_controllers } => bail!(
            "--enforce signal refused: this node's cgroups are hybrid (the {} controllers are on cgroup v1): \
             the probes tell containers apart by their cgroup2 group, and nothing shows that the container \
             runtime gives each container one, so one container's limit could signal another's processes. \
             Use --enforce audit (it works here), move the node to cgroup v2, or, if the runtime does place \
             every container in a cgroup2 group of its own (systemd-managed runtimes do), say so with \
             --cgroup2-separates-containers",
            v1_controllers.join(",")
        ),
        CgroupLayout::Legacy => bail!(
            "--enforce signal refused: no cgroup2 hierarchy is mounted (cgroup v1 only), so every process \
             is in the cgroup2 root and cgroup limits cannot tell containers apart (--cgroup2-separates-containers \
             cannot change that). Use --enforce audit (it works here) or move the node to cgroup v2"
        ),
    }
}

/// The tracefs mount point, mounting it at /sys/kernel/tracing if no mount is found.
fn tracefs() -> Result<PathBuf> {
    for candidate in TRACEFS_MOUNTS {
        if Path::new(candidate).join(EXIT_FORMAT).exists() {
            return Ok(PathBuf::from(candidate));
        }
    }
    let target = TRACEFS_MOUNTS[0];
    nix::mount::mount(
        Some("nodev"),
        target,
        Some("tracefs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .with_context(|| {
        format!(
            "tracefs is not mounted and mounting it at {target} failed: mount it \
             (`mount -t tracefs nodev {target}`) or give the agent's container that mount"
        )
    })?;
    if !Path::new(target).join(EXIT_FORMAT).exists() {
        bail!("tracefs is mounted at {target} but has no sched:sched_process_exit tracepoint");
    }
    Ok(PathBuf::from(target))
}

/// Reads the offset of the `group_dead` field from a tracepoint format file.
fn group_dead_offset(format: &Path) -> Result<u32> {
    let text = fs::read_to_string(format)
        .with_context(|| format!("cannot read the tracepoint format {}", format.display()))?;
    parse_field_offset(&text, "group_dead").with_context(|| {
        format!("{} has no usable `group_dead` field: this kernel's process-exit tracepoint is not supported", format.display())
    })
}

/// Reads the offsets of `root` and `id` from the `cgroup_rmdir` format file.
fn rmdir_offsets(format: &Path) -> Result<RmdirOffsets, String> {
    let text = fs::read_to_string(format).map_err(|error| format!("cannot read {}: {error}", format.display()))?;
    match (parse_field_offset(&text, "root"), parse_field_offset(&text, "id")) {
        (Some(root), Some(id)) => Ok(RmdirOffsets { root, id }),
        _ => Err(format!("{} has no `root` and `id` fields", format.display())),
    }
}

/// Finds `offset:N;` on the line declaring `field`.
fn parse_field_offset(format: &str, field: &str) -> Option<u32> {
    format.lines().find_map(|line| {
        let declaration = line.trim().strip_prefix("field:")?;
        let (declaration, rest) = declaration.split_once(';')?;
        let name = declaration.split_whitespace().last()?;
        if name != field {
            return None;
        }
        let offset = rest.trim().strip_prefix("offset:")?.split(';').next()?;
        offset.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::{allow_signal_enforcement, layout_of, parse_field_offset, CgroupLayout};

    /// This development machine's /proc/self/cgroup (cgroup2 at /sys/fs/cgroup/unified).
    const HYBRID: &str = "9:name=systemd:/\n8:pids:/\n4:memory:/x\n3:cpuset:/\n2:cpuacct:/\n1:cpu:/\n0::/\n";
    /// A pure cgroup v2 node.
    const UNIFIED: &str = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-1.scope\n";
    /// cgroup v2 with a controller-less v1 hierarchy kept for old tools.
    const UNIFIED_NAMED: &str = "1:name=systemd:/\n0::/system.slice/vramguard.service\n";

    #[test]
    fn tells_the_cgroup_layouts_apart() {
        assert_eq!(layout_of(UNIFIED, true), CgroupLayout::Unified);
        assert_eq!(layout_of(UNIFIED_NAMED, true), CgroupLayout::Unified);
        let hybrid = layout_of(HYBRID, true);
        assert_eq!(
            hybrid,
            CgroupLayout::Hybrid { v1_controllers: ["cpu", "cpuacct", "cpuset", "memory", "pids"].map(String::from).to_vec() }
        );
        assert_eq!(layout_of(HYBRID, false), CgroupLayout::Legacy);
        assert_eq!(layout_of("", false), CgroupLayout::Legacy);
    }

    #[test]
    fn signal_enforcement_needs_cgroup2_to_separate_containers() {
        assert!(allow_signal_enforcement(&CgroupLayout::Unified, false).is_ok());
        let hybrid = layout_of(HYBRID, true);
        let refusal = allow_signal_enforcement(&hybrid, false).expect_err("hybrid without the operator's word");
        let refusal = format!("{refusal:#}");
        assert!(refusal.contains("hybrid") && refusal.contains("--cgroup2-separates-containers"), "{refusal}");
        assert!(allow_signal_enforcement(&hybrid, true).is_ok(), "hybrid with the operator's word");
        for asserted in [false, true] {
            let refusal = allow_signal_enforcement(&CgroupLayout::Legacy, asserted).expect_err("legacy");
            assert!(format!("{refusal:#}").contains("no cgroup2 hierarchy"), "{refusal:#}");
        }
    }

    const FORMAT: &str = "name: sched_process_exit\nID: 369\nformat:\n\
        \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
        \tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
        \tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\
        \tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n";

    #[test]
    fn finds_the_cgroup_rmdir_fields() {
        let format = "name: cgroup_rmdir\nformat:\n\
            \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
            \tfield:int root;\toffset:8;\tsize:4;\tsigned:1;\n\
            \tfield:int level;\toffset:12;\tsize:4;\tsigned:1;\n\
            \tfield:u64 id;\toffset:16;\tsize:8;\tsigned:0;\n\
            \tfield:__data_loc char[] path;\toffset:24;\tsize:4;\tsigned:0;\n";
        assert_eq!(parse_field_offset(format, "root"), Some(8));
        assert_eq!(parse_field_offset(format, "id"), Some(16));
        assert_eq!(parse_field_offset(format, "path"), Some(24));
    }

    #[test]
    fn finds_group_dead() {
        assert_eq!(parse_field_offset(FORMAT, "group_dead"), Some(32));
        assert_eq!(parse_field_offset(FORMAT, "pid"), Some(24));
        assert_eq!(parse_field_offset(FORMAT, "missing"), None);
    }
}
