//! Removed cgroups' map entries: the `cgroup_rmdir` tracepoint deletes a cgroup's
//! `CGROUP_USAGE` and `CGROUP_LIMITS` entries when it goes; this sweep (every `--sweep-ms`)
//! deletes those it missed (an agent started after the removal, a kernel without the
//! tracepoint, a limit pushed while the cgroup was going).
use std::collections::BTreeSet;

use super::{accounting::Accounting, enforce::Limits};
use crate::cgroup::CgroupNames;

/// Of `ids`, those no cgroup2 cgroup has: absent from two walks of the tree, so that a cgroup
/// renamed during one walk is not taken for gone. Empty if the tree cannot be walked.
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
/// limits) `CGROUP_LIMITS`; returns how many entries went.
pub fn sweep(accounting: &mut Accounting, limits: Option<&mut Limits>, names: &mut CgroupNames) -> usize {
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
