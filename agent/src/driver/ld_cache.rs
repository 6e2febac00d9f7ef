//! The host's dynamic linker cache (`/etc/ld.so.cache`, written by `ldconfig`), read for the
//! paths it gives a library's name: where a driver installed in no known directory (a
//! distribution's own layout) can still be found, as the dynamic linker would find it. Only
//! glibc's format since 2.32 is read ("glibc-ld.so.cache1.1" at the start: a header, 24-byte
//! entries, string offsets from the file's start); an older or damaged file gives nothing.
use std::ops::Range;

/// The format's magic and version.
const MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
/// The header: the magic, the number of entries, the strings' length, flags and padding, the
/// extension's offset, three unused words.
const HEADER: usize = 48;
/// One entry: flags, the name's offset, the path's offset, an unused word, the hwcaps.
const ENTRY: usize = 24;

/// An entry's flags for a library of this machine's own kind (`FLAG_ELF_LIBC6` with the
/// architecture's 64-bit flag, as glibc's `ldconfig` writes them): a 32-bit library of the same
/// name (i386's `libcuda.so.1`) has others. `None`: any (an architecture this does not name).
#[cfg(target_arch = "x86_64")]
const OWN_FLAGS: Option<u32> = Some(0x0303);
#[cfg(target_arch = "aarch64")]
const OWN_FLAGS: Option<u32> = Some(0x0a03);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const OWN_FLAGS: Option<u32> = None;

/// The longest path taken from the cache (`PATH_MAX`).
const PATH_MAX: usize = 4096;

/// The most paths one name is given.
const MAX_PATHS: usize = 16;

/// The paths the cache `bytes` gives for the library `name` (`libcuda.so.1`), in its order
/// (the dynamic linker takes the first that suits it): entries of this machine's own kind
/// only ([`OWN_FLAGS`]), none of the `glibc-hwcaps` subdirectories' (a non-zero hwcap, which
/// the linker uses only on CPUs that have them), each path at most [`PATH_MAX`] bytes, at most
/// [`MAX_PATHS`] of them. Each name is compared in place, so a damaged file costs one pass.
pub fn paths_of(bytes: &[u8], name: &str) -> Vec<String> {
    let word = |at: usize| bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes).map(|w| w as usize);
    let hwcap = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    if !bytes.starts_with(MAGIC) {
        return Vec::new();
    }
    let Some(entries) = word(MAGIC.len()) else { return Vec::new() };
    let wanted: Vec<u8> = name.bytes().chain([0]).collect();
    let path = |at: usize| -> Option<String> {
        let rest = bytes.get(at..)?;
        let end = rest.iter().take(PATH_MAX + 1).position(|&b| b == 0)?;
        std::str::from_utf8(&rest[..end]).ok().map(str::to_owned)
    };
    let table: Range<usize> = HEADER..HEADER.saturating_add(entries.saturating_mul(ENTRY));
    if table.end > bytes.len() {
        return Vec::new();
    }
    table
        .step_by(ENTRY)
        .filter(|&entry| OWN_FLAGS.is_none_or(|own| word(entry) == Some(own as usize)) && hwcap(entry + 16) == Some(0))
        .filter(|&entry| word(entry + 4).and_then(|key| bytes.get(key..key.saturating_add(wanted.len()))) == Some(&wanted[..]))
        .filter_map(|entry| path(word(entry + 8)?))
        .take(MAX_PATHS)
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A cache of `entries` (name, path) in the format's layout.
    pub(crate) fn cache(entries: &[(&str, &str)]) -> Vec<u8> {
        let mut bytes = MAGIC.to_vec();
        let strings_at = HEADER + entries.len() * ENTRY;
        let mut strings = Vec::new();
        let mut table = Vec::new();
        for (name, path) in entries {
            let key = strings_at + strings.len();
            strings.extend_from_slice(name.as_bytes());
            strings.push(0);
            let value = strings_at + strings.len();
            strings.extend_from_slice(path.as_bytes());
            strings.push(0);
            let (flags, hwcap) = match *name {
                // Markers the tests use for a 32-bit library and a glibc-hwcaps one.
                _ if path.contains("/i386-") => (0x0003u32, 0u64),
                _ if path.contains("/glibc-hwcaps/") => (OWN_FLAGS.unwrap_or(0x0303), 1u64 << 62),
                _ => (OWN_FLAGS.unwrap_or(0x0303), 0),
            };
            for word in [flags, key as u32, value as u32, 0] {
                table.extend_from_slice(&word.to_le_bytes());
            }
            table.extend_from_slice(&hwcap.to_le_bytes());
        }
        bytes.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        bytes.resize(HEADER, 0);
        bytes.extend(table);
        bytes.extend(strings);
        bytes
    }


    #[test]
    fn a_name_s_paths_come_in_the_cache_s_order() {
        let bytes = cache(&[
            ("libcuda.so.1", "/usr/lib64/nvidia/tesla/580.65.06/libcuda.so.1"),
            ("libc.so.6", "/lib64/libc.so.6"),
            ("libcuda.so.1", "/usr/lib/libcuda.so.1"),
        ]);
        assert_eq!(paths_of(&bytes, "libcuda.so.1"), ["/usr/lib64/nvidia/tesla/580.65.06/libcuda.so.1", "/usr/lib/libcuda.so.1"]);
        assert!(paths_of(&bytes, "libnvidia-ml.so.1").is_empty());
    }

    #[test]
    fn a_32_bit_library_and_a_hwcaps_one_are_not_this_machine_s() {
        let bytes = cache(&[
            ("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1"),
            ("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/glibc-hwcaps/x86-64-v3/libcuda.so.1"),
            ("libcuda.so.1.bak", "/usr/lib/libcuda.so.1.bak"),
            ("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        ]);
        assert_eq!(paths_of(&bytes, "libcuda.so.1"), ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]);
    }

    #[test]
    fn a_damaged_or_old_cache_gives_nothing_and_never_panics() {
        let good = cache(&[("libcuda.so.1", "/usr/lib/libcuda.so.1")]);
        for cut in 0..good.len() {
            let _ = paths_of(&good[..cut], "libcuda.so.1");
        }
        let mut huge = good.clone();
        huge[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(paths_of(&huge, "libcuda.so.1").is_empty(), "more entries than the file holds");
        let mut wild = good.clone();
        wild[HEADER + 8..HEADER + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(paths_of(&wild, "libcuda.so.1").is_empty(), "a path's offset past the end");
        assert!(paths_of(b"ld.so-1.7.0\0\0\0\0\0", "libcuda.so.1").is_empty(), "glibc's old format");
    }

    #[test]
    fn this_machine_s_own_cache_is_read() {
        // The format as glibc writes it here (Debian's 2.36): the C library is in it.
        let bytes = std::fs::read("/etc/ld.so.cache").expect("this machine's ld.so.cache");
        let found = paths_of(&bytes, "libc.so.6");
        assert!(found.iter().any(|path| path.starts_with('/') && path.ends_with("/libc.so.6")), "{found:?}");
    }
}
