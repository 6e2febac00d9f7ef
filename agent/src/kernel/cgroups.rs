//! The cgroup2 tree as the kernel side sees it change, and removed cgroups' map entries.
//!
//! [`watch_tree`] attaches `cgroup_tree_changed` to the `cgroup:cgroup_mkdir` and
//! `cgroup:cgroup_rename` tracepoints; with `cgroup_rmdir` they count the tree's changes in
//! `CGROUP_TREE`, which the agent's [`CgroupNames`] read to walk the tree only when it changed
//! (`crate::cgroup`): the limits file's patterns are resolved against a new cgroup at the next
//! limits push after its `mkdir` (every `--rescan-ms`), and nothing is walked while the tree
//! stays as it is.
//!
//! The `cgroup_rmdir` tracepoint deletes a cgroup's `CGROUP_USAGE` and `CGROUP_LIMITS` entries
//! when it goes; [`sweep`] (at the `--sweep-ms` tick, when the tree changed since the last
//! one, and every [`crate::cgroup::SAFETY_WALK`]; at every tick on a kernel without the
//! tracepoints) deletes those it missed (an agent started after the removal, a kernel without
//! the tracepoint, a limit pushed while the cgroup was going).
use std::collections::BTreeSet;

use aya::{
    maps::{Array, MapData},
    programs::TracePoint,
    Ebpf,
};
use common::names;

use super::{accounting::Accounting, enforce::Limits};
use crate::cgroup::{CgroupNames, TreeWatch};

/// Loads and attaches the program that counts the cgroup2 tree's changes, and returns the
/// watch that reads the count: one that watches nothing (the names then walk whenever asked)
/// if the `cgroup_rmdir` program is not attached (`rmdir_attached`: it counts removals) or the
/// kernel refuses, said in the log.
pub fn watch_tree(ebpf: &mut Ebpf, rmdir_attached: bool) -> TreeWatch {
    if !rmdir_attached {
        return TreeWatch::default();
    }
    match attach_tree_watch(ebpf) {
        Ok(count) => TreeWatch::new(move || count.get(&0, 0).ok()),
        Err(error) => {
            tracing::warn!(error = %format!("{error:#}"), "cannot watch the cgroup tree's changes: it is walked at every limits push and sweep instead");
            TreeWatch::default()
        }
    }
}

fn attach_tree_watch(ebpf: &mut Ebpf) -> anyhow::Result<Array<MapData, u64>> {
    use anyhow::Context;
    let program: &mut TracePoint = ebpf
        .program_mut(names::CGROUP_TREE_CHANGED)
        .with_context(|| format!("the embedded eBPF object has no `{}` program", names::CGROUP_TREE_CHANGED))?
        .try_into()?;
    program.load().context("the kernel refused the cgroup-tree program")?;
    for event in ["cgroup_mkdir", "cgroup_rename"] {
        program.attach("cgroup", event).with_context(|| format!("cannot attach to the cgroup:{event} tracepoint"))?;
    }
    super::accounting::take(ebpf, names::CGROUP_TREE)
}

/// Of `ids`, those no cgroup2 cgroup has: absent from a walk during which the tree did not
/// change (watched names), or from two walks (unwatched ones), so that a cgroup renamed during
/// a walk is not taken for gone. Empty if the tree cannot be walked.
pub fn gone(ids: BTreeSet<u64>, names: &mut CgroupNames) -> BTreeSet<u64> {
    let mut candidates = ids;
    for _ in 0..2 {
        if candidates.is_empty() {
            break;
        }
        let existing = names.all();
        if existing.is_empty() {
            // No cgroup2 mount: the root itself would be listed otherwise.
            return BTreeSet::new();
        }
        candidates.retain(|id| !existing.contains_key(id));
    }
    candidates
}

/// Deletes the entries of removed cgroups from `CGROUP_USAGE` and (if the agent pushes
/// limits) `CGROUP_LIMITS`; returns how many entries went. Does nothing while the tree is
/// watched and unchanged since the last sweep (for up to [`crate::cgroup::SAFETY_WALK`]).
pub fn sweep(accounting: &mut Accounting, limits: Option<&mut Limits>, names: &mut CgroupNames) -> usize {
    if !accounting.cgroup_sweep_due(names.tree_changes()) {
        return 0;
    }
    // The maps are listed before the tree is walked: a cgroup made after the walk cannot be
    // among the candidates.
    let mut ids: BTreeSet<u64> = accounting.cgroup_ids().into_iter().collect();
    if let Some(limits) = limits.as_ref() {
        ids.extend(limits.ids());
        ids.extend(limits.pushed());
    }
    let dead: Vec<u64> = gone(ids, names).into_iter().collect();
    if dead.is_empty() {
        return 0;
    }
    let mut removed = accounting.forget_cgroups(&dead);
    if let Some(limits) = limits {
        removed += limits.forget(&dead);
    }
    accounting.swept_cgroup_entries(removed);
    if removed > 0 {
        tracing::info!(entries = removed, cgroups = dead.len(), "deleted the map entries of removed cgroups");
    }
    removed
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn only_ids_no_cgroup_has_are_gone() {
        let Some(root) = crate::cgroup::cgroup2_mount() else { return };
        let root_id = std::fs::metadata(&root).expect("the cgroup2 root").ino();
        let mut names = CgroupNames::new();
        // Inode numbers of kernfs stay far below these.
        let gone = gone(BTreeSet::from([root_id, u64::MAX - 1, u64::MAX]), &mut names);
        assert_eq!(gone, BTreeSet::from([u64::MAX - 1, u64::MAX]));
    }
}
