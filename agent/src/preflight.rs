//! Checks that the node can run the agent before anything is loaded, each failure with an
//! error that says what is missing and how to fix it: root, BTF, tracefs, uprobes.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

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
    use super::parse_field_offset;

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
