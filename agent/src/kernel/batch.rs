//! Whole-map reads of the probes' hash maps in a few system calls: `BPF_MAP_LOOKUP_BATCH`
//! hands out a chunk of entries per call (one call for the maps of an idle node), where aya's
//! iterator makes two per entry (the next key, then its value). A kernel or map type without
//! the command gets aya's iterator. Either is a view of a map the probes change meanwhile: an
//! entry added or removed during the read may or may not be in it, as before.
use std::{
    mem::size_of,
    os::fd::{AsFd, AsRawFd},
};

use aya::{
    maps::{HashMap, IterableMap, MapData},
    Pod,
};

/// `BPF_MAP_LOOKUP_BATCH` of `enum bpf_cmd` (`linux/bpf.h`).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Entries asked for per call.
const CHUNK: u32 = 256;


/// The `batch` member of `union bpf_attr` (`linux/bpf.h`): the fields the command reads, in
/// their order; the kernel takes the rest of the union as zero.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every entry of `map`: in chunks of [`CHUNK`] where the kernel can, else through aya's
/// iterator (entries it cannot read skipped, as before).
pub fn entries<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> Vec<(K, V)> {
    lookup_batch(map.map()).unwrap_or_else(|| map.iter().filter_map(Result::ok).collect())
}

/// The entries of the hash map `map` by `BPF_MAP_LOOKUP_BATCH`; `None` if the kernel refuses
/// the command (too old, another map type) or a read does not end.
fn lookup_batch<K: Pod, V: Pod>(map: &MapData) -> Option<Vec<(K, V)>> {
    let fd = u32::try_from(map.fd().as_fd().as_raw_fd()).ok()?;
    // Each call that is not the last moves past at least one of the map's buckets (a power of
    // two at least its `max_entries`): more calls than that, the read does not end.
    let buckets = map.info().ok()?.max_entries().max(1).checked_next_power_of_two()? as usize;
    let mut keys = vec![0u8; CHUNK as usize * size_of::<K>()];
    let mut values = vec![0u8; CHUNK as usize * size_of::<V>()];
    // The kernel's position in the map between calls (a bucket index for hash maps).
    let (mut position, mut next) = (0u64, 0u64);
    let mut entries = Vec::new();
    for call in 0..=buckets {
        let mut attr = BatchAttr {
            in_batch: if call == 0 { 0 } else { std::ptr::addr_of!(position) as u64 },
            out_batch: std::ptr::addr_of_mut!(next) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK,
            map_fd: fd,
            ..BatchAttr::default()
        };
        // SAFETY: `attr` is a `bpf_attr` prefix for this command, its size passed with it; the
        // kernel writes at most `count` keys and values into `keys` and `values` (each
        // `CHUNK` entries long), one token into `next`, and `count` back into `attr`, all of
        // which live across the call.
        let result = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_BATCH, &mut attr as *mut BatchAttr, size_of::<BatchAttr>()) };
        let error = (result != 0).then(std::io::Error::last_os_error);
        // Past the end (ENOENT) the count says what the last call still handed out.
        if error.as_ref().is_some_and(|error| error.raw_os_error() != Some(libc::ENOENT)) {
            return None;
        }
        let count = (attr.count as usize).min(CHUNK as usize);
        for index in 0..count {
            // SAFETY: the kernel wrote `count` whole keys and values at these offsets, inside
            // the buffers; `Pod` types hold any bytes, and the reads are unaligned ones.
            let (key, value) = unsafe {
                (
                    std::ptr::read_unaligned(keys.as_ptr().add(index * size_of::<K>()).cast::<K>()),
                    std::ptr::read_unaligned(values.as_ptr().add(index * size_of::<V>()).cast::<V>()),
                )
            };
            entries.push((key, value));
        }
        if error.is_some() {
            return Some(entries);
        }
        position = next;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_read_holds_what_the_iterator_reads() {
        let mut map = match HashMap::<MapData, u32, [u64; 5]>::create(4096, 0) {
            Ok(map) => map,
            Err(error) => panic!("cannot create a BPF hash map (the tests run as root with BPF): {error}"),
        };
        assert!(entries(&map).is_empty(), "an empty map");
        // More entries than a chunk, so that the read takes several calls.
        for key in 0..1000u32 {
            map.insert(key, [u64::from(key); 5], 0).expect("insert");
        }
        let mut batched = lookup_batch::<u32, [u64; 5]>(map.map()).expect("this kernel batches hash maps");
        let mut iterated: Vec<(u32, [u64; 5])> = map.iter().filter_map(Result::ok).collect();
        batched.sort_by_key(|(key, _)| *key);
        iterated.sort_by_key(|(key, _)| *key);
        assert_eq!(batched.len(), 1000);
        assert_eq!(batched, iterated);
        assert!(batched.iter().all(|(key, value)| *value == [u64::from(*key); 5]));
    }
}
