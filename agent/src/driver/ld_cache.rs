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

/// The paths the cache `bytes` gives for the library `name` (`libcuda.so.1`), in its order
/// (the dynamic linker takes the first that suits it).
pub fn paths_of(bytes: &[u8], name: &str) -> Vec<String> {
    let word = |at: usize| bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes).map(|w| w as usize);
    if !bytes.starts_with(MAGIC) {
        return Vec::new();
    }
    let Some(entries) = word(MAGIC.len()) else { return Vec::new() };
    let string = |at: usize| -> Option<&str> {
        let rest = bytes.get(at..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&rest[..end]).ok()
    };
    let table: Range<usize> = HEADER..HEADER.saturating_add(entries.saturating_mul(ENTRY));
    if table.end > bytes.len() {
        return Vec::new();
    }
    table
        .step_by(ENTRY)
        .filter_map(|entry| {
            let (key, value) = (word(entry + 4)?, word(entry + 8)?);
            (string(key)? == name).then(|| string(value).map(str::to_owned)).flatten()
        })
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
            for word in [0x303u32, key as u32, value as u32, 0] {
                table.extend_from_slice(&word.to_le_bytes());
            }
            table.extend_from_slice(&0u64.to_le_bytes());
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
