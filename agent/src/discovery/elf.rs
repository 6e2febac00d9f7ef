//! Reading a library's exported functions from an open descriptor, within fixed bounds of
//! bytes and of time.
//!
//! A file a workload maps is untrusted: it may be huge, truncated while we read it, or crafted
//! to make a parser allocate or loop. So nothing here maps the file (a truncation would kill
//! the agent with SIGBUS) and nothing trusts a size from it: the file's own size is capped,
//! only the ELF header, the section and program header tables, the dynamic symbol table, its
//! string table and its hash table are read (each with a cap, with `pread`, the tables into
//! zeroed buffers of their bounded size), and every offset is checked.
//!
//! Names are looked up as the dynamic loader looks them up, never by scanning: each wanted
//! name is hashed and found through the file's `.gnu.hash` (`SHT_GNU_HASH`), or else its
//! SysV `.hash` (`SHT_HASH`), every bucket and chain index checked against its table and every
//! chain walk capped at [`MAX_CHAIN`] steps; a candidate's name is compared by reading exactly
//! the wanted name's bytes and its NUL at the candidate's string offset (never a search for a
//! NUL: a string table without one cannot make a comparison longer than the name). A file
//! with neither table (no linker of this century makes one) is scanned, but only if it has at
//! most [`MAX_LINEAR_SYMBOLS`] symbols. Whatever the file's shape, its reading stops at
//! [`TIME_BUDGET`] (checked inside every loop): a file over it is refused, as over the agent's
//! time budget. Symbols are resolved to file offsets through the executable `PT_LOAD` segment
//! that holds them (what a uprobe attaches to), once per file.
use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    os::unix::fs::FileExt,
    time::{Duration, Instant},
};

use object::{
    elf,
    read::{
        elf::{FileHeader, ProgramHeader, SectionHeader, Sym},
        ReadCache,
    },
    Endian, Endianness,
};

/// A file larger than this is not read at all (libcuda is about 100 MiB).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// At most this many section headers (a library has about 40).
const MAX_SECTIONS: usize = 1024;
/// At most this many program headers (a library has about 10).
const MAX_SEGMENTS: usize = 64;
/// The dynamic symbol table, its strings and its hash table, each at most this large
/// (libcuda's are well under 1 MiB).
const MAX_TABLE_BYTES: u64 = 4 << 20;
/// The longest hash chain walked for one name. Linkers size the buckets for chains of one to
/// three symbols (glibc's and libcuda's longest are under 20); a longer chain is a crafted
/// table, and the file is refused.
pub const MAX_CHAIN: usize = 4096;
/// The most symbols scanned in a file without a hash table (past it, the file is refused):
/// with about 60 wanted names, a scan of this many costs a few milliseconds.
pub const MAX_LINEAR_SYMBOLS: usize = 65_536;
/// Wall-clock time one file may take to read and look up, from its header to its last
/// lookup. Real libraries take well under a millisecond (libcuda's tables are read once, its
/// lookups are a few hash probes each); a file still being read at this point is refused and
/// remembered, so a crafted file costs the agent at most this much per version of it.
pub const TIME_BUDGET: Duration = Duration::from_millis(200);

/// Why a file's exports could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("the file is {0} bytes, over the agent's limit of {MAX_FILE_BYTES}")]
    TooLarge(u64),
    #[error("not a 64-bit ELF file ({0})")]
    NotElf(object::read::Error),
    #[error("malformed ELF: {0}")]
    Malformed(object::read::Error),
    #[error("malformed ELF: {0}")]
    Invalid(&'static str),
    #[error("its {what} is {size} bytes or entries, over the agent's limit of {limit}")]
    Bound { what: &'static str, size: u64, limit: u64 },
    #[error("reading its exports went over the agent's time budget of {} ms per file", TIME_BUDGET.as_millis())]
    OverTime,
}

type Result<T> = std::result::Result<T, ElfError>;

/// The time a file's reading may take, checked inside every loop.
struct Deadline(Instant);

impl Deadline {
    fn check(&self) -> Result<()> {
        if Instant::now() > self.0 {
            return Err(ElfError::OverTime);
        }
        Ok(())
    }
}

/// The file offsets of the functions in `wanted` that `file` (of `size` bytes, from the
/// caller's `fstat`) exports: defined, global or weak `STT_FUNC` symbols of its dynamic
/// symbol table that lie in an executable segment. A name defined twice keeps its first
/// definition (lowest symbol index).
pub fn exported(file: &File, size: u64, wanted: &[&'static str]) -> Result<BTreeMap<&'static str, u64>> {
    exported_within(file, size, wanted, TIME_BUDGET)
}

fn exported_within(file: &File, size: u64, wanted: &[&'static str], budget: Duration) -> Result<BTreeMap<&'static str, u64>> {
    let deadline = Deadline(Instant::now() + budget);
    if size > MAX_FILE_BYTES {
        return Err(ElfError::TooLarge(size));
    }
    let data = ReadCache::new(file);
    let data = &data;
    let header = elf::FileHeader64::<Endianness>::parse(data).map_err(ElfError::NotElf)?;
    let endian = header.endian().map_err(ElfError::NotElf)?;
    // Extended numbering (counts kept in section 0) is never used by a library: refused, so
    // that no count read from the file goes unchecked.
    let sections = header.e_shnum(endian) as usize;
    if sections == 0 || header.e_phnum(endian) == elf::PN_XNUM {
        return Err(ElfError::Invalid("no section headers, or extended numbering"));
    }
    bound("section header table", sections as u64, MAX_SECTIONS as u64)?;
    bound("program header table", header.e_phnum(endian) as u64, MAX_SEGMENTS as u64)?;
    let sections = header.section_headers(endian, data).map_err(ElfError::Malformed)?;
    let segments = header.program_headers(endian, data).map_err(ElfError::Malformed)?;
    let Some(dynsym_index) = sections.iter().position(|s| s.sh_type(endian) == elf::SHT_DYNSYM) else {
        return Ok(BTreeMap::new());
    };
    let dynsym = &sections[dynsym_index];
    bound("dynamic symbol table", dynsym.sh_size(endian), MAX_TABLE_BYTES)?;
    let strings = sections
        .get(dynsym.sh_link(endian) as usize)
        .filter(|s| s.sh_type(endian) == elf::SHT_STRTAB)
        .ok_or(ElfError::Invalid("the dynamic symbol table links no string table"))?;
    bound("dynamic string table", strings.sh_size(endian), MAX_TABLE_BYTES)?;
    // The hash table of the dynamic symbols: .gnu.hash if there is one, else .hash.
    let linked = |kind: u32| {
        sections.iter().find(|s| s.sh_type(endian) == kind && s.sh_link(endian) as usize == dynsym_index)
    };
    let hash = match (linked(elf::SHT_GNU_HASH), linked(elf::SHT_HASH)) {
        (Some(gnu), _) => Some((true, gnu)),
        (None, Some(sysv)) => Some((false, sysv)),
        (None, None) => None,
    };
    let symbols = read_table(file, size, endian, dynsym)?;
    deadline.check()?;
    let symbols: &[elf::Sym64<Endianness>] = object::pod::slice_from_all_bytes(&symbols)
        .map_err(|()| ElfError::Invalid("the dynamic symbol table is not a whole number of symbols"))?;
    let names = read_table(file, size, endian, strings)?;
    let names = &names[..];
    deadline.check()?;
    let table = Symbols {
        endian,
        symbols,
        names,
        executable: segments
            .iter()
            .filter(|p| p.p_type(endian) == elf::PT_LOAD && p.p_flags(endian) & elf::PF_X != 0)
            .map(|p| (p.p_vaddr(endian), p.p_filesz(endian), p.p_offset(endian)))
            .collect(),
        deadline,
    };
    let mut found = BTreeMap::new();
    match hash {
        Some((gnu, section)) => {
            bound(if gnu { ".gnu.hash table" } else { ".hash table" }, section.sh_size(endian), MAX_TABLE_BYTES)?;
            let bytes = read_table(file, size, endian, section)?;
            table.deadline.check()?;
            let words = Words { endian, bytes: &bytes };
            for &name in wanted {
                let offset = if gnu { table.gnu_lookup(&words, name)? } else { table.sysv_lookup(&words, name)? };
                if let Some(offset) = offset {
                    found.insert(name, offset);
                }
            }
        }
        None => {
            bound("dynamic symbol table without a hash table", symbols.len() as u64, MAX_LINEAR_SYMBOLS as u64)?;
            // A symbol's name is looked for among the wanted ones only if a NUL ends it
            // within the longest wanted name's length: no scan past that.
            let by_name: HashMap<&[u8], &'static str> = wanted.iter().map(|w| (w.as_bytes(), *w)).collect();
            let longest = wanted.iter().map(|w| w.len()).max().unwrap_or(0);
            for (index, symbol) in symbols.iter().enumerate() {
                if index % 1024 == 0 {
                    table.deadline.check()?;
                }
                let start = symbol.st_name(endian) as usize;
                let Some(window) = names.get(start..names.len().min(start.saturating_add(longest + 1))) else { continue };
                let Some(length) = window.iter().position(|&b| b == 0) else { continue };
                let Some(&name) = by_name.get(&window[..length]) else { continue };
                if let Some(offset) = table.offset_of(symbol) {
                    found.entry(name).or_insert(offset);
                }
            }
        }
    }
    Ok(found)
}

/// The dynamic symbols of a file, their string table and its executable segments.
struct Symbols<'a> {
    endian: Endianness,
    symbols: &'a [elf::Sym64<Endianness>],
    names: &'a [u8],
    /// (vaddr, filesz, offset) of each executable `PT_LOAD`.
    executable: Vec<(u64, u64, u64)>,
    deadline: Deadline,
}

impl Symbols<'_> {
    /// The file offset of `symbol` if it is an exported function: defined, global or weak,
    /// `STT_FUNC`, within an executable segment.
    fn offset_of(&self, symbol: &elf::Sym64<Endianness>) -> Option<u64> {
        let global = matches!(symbol.st_bind(), elf::STB_GLOBAL | elf::STB_WEAK);
        if !global || symbol.st_type() != elf::STT_FUNC || symbol.st_shndx(self.endian) == elf::SHN_UNDEF {
            return None;
        }
        let address = symbol.st_value(self.endian);
        self.executable.iter().find_map(|&(vaddr, filesz, offset)| {
            let within = address.checked_sub(vaddr).filter(|relative| *relative < filesz)?;
            offset.checked_add(within)
        })
    }

    /// Whether `symbol`'s name is `name`: the name's bytes and a NUL at its string offset,
    /// read exactly (no search for the NUL).
    fn named(&self, symbol: &elf::Sym64<Endianness>, name: &str) -> bool {
        let start = symbol.st_name(self.endian) as usize;
        let Some(end) = start.checked_add(name.len()) else { return false };
        self.names.get(start..end) == Some(name.as_bytes()) && self.names.get(end) == Some(&0)
    }

    /// Symbol `index` if it is `name` and an exported function: its file offset.
    fn candidate(&self, index: usize, name: &str) -> Result<Option<u64>> {
        let symbol = self.symbols.get(index).ok_or(ElfError::Invalid("a hash table names a symbol past the symbol table"))?;
        Ok(if self.named(symbol, name) { self.offset_of(symbol) } else { None })
    }

    /// Looks `name` up in a `.gnu.hash`: `nbuckets, symoffset, bloom_size, bloom_shift`,
    /// `bloom_size` 64-bit bloom words, `nbuckets` bucket words (the first symbol index of
    /// the bucket's chain, 0 for none), then one word per symbol from `symoffset` on (the
    /// symbol's hash with its low bit replaced by "last of its chain"). The bloom filter is
    /// an optimisation for misses and is not consulted.
    fn gnu_lookup(&self, words: &Words<'_>, name: &str) -> Result<Option<u64>> {
        let (nbuckets, symoffset, bloom_words) = (words.get(0)?, words.get(1)?, words.get(2)?);
        if nbuckets == 0 {
            return Err(ElfError::Invalid("its .gnu.hash has no buckets"));
        }
        // Header, 64-bit bloom words, buckets: sums of u32s, no overflow in u64.
        let buckets_at = 4 + 2 * bloom_words as u64;
        let chains_at = buckets_at + nbuckets as u64;
        if chains_at > words.len() {
            return Err(ElfError::Invalid("its .gnu.hash does not fit its section"));
        }
        let hash = gnu_hash(name.as_bytes());
        let first = words.get(buckets_at + (hash % nbuckets) as u64)?;
        if first == 0 {
            return Ok(None);
        }
        let start = first.checked_sub(symoffset).ok_or(ElfError::Invalid("a .gnu.hash bucket points below its first symbol"))? as u64;
        // A chain is consecutive entries from the bucket's first until one marked last.
        for index in (start..).take(MAX_CHAIN) {
            self.deadline.check()?;
            let entry = words.get(chains_at + index).map_err(|_| ElfError::Invalid("a .gnu.hash chain runs past its table"))?;
            if entry | 1 == hash | 1 {
                if let Some(offset) = self.candidate(symoffset as usize + index as usize, name)? {
                    return Ok(Some(offset));
                }
            }
            if entry & 1 == 1 {
                return Ok(None);
            }
        }
        Err(ElfError::Bound { what: ".gnu.hash chain", size: MAX_CHAIN as u64 + 1, limit: MAX_CHAIN as u64 })
    }

    /// Looks `name` up in a SysV `.hash`: `nbucket, nchain`, `nbucket` bucket words, `nchain`
    /// chain words (bucket and chain entries are symbol indexes, 0 ends a chain). Chains are
    /// in no order, so the whole (capped) chain is walked for the lowest matching index.
    fn sysv_lookup(&self, words: &Words<'_>, name: &str) -> Result<Option<u64>> {
        let (nbucket, nchain) = (words.get(0)?, words.get(1)?);
        if nbucket == 0 || 2 + nbucket as u64 + nchain as u64 > words.len() {
            return Err(ElfError::Invalid("its .hash has no buckets or does not fit its section"));
        }
        let chain_at = 2 + nbucket as u64;
        let mut index = words.get(2 + (sysv_hash(name.as_bytes()) % nbucket) as u64)?;
        let mut best: Option<(u32, u64)> = None;
        for _ in 0..MAX_CHAIN {
            self.deadline.check()?;
            if index == 0 {
                return Ok(best.map(|(_, offset)| offset));
            }
            if index >= nchain {
                return Err(ElfError::Invalid("a .hash chain runs past its table"));
            }
            if best.is_none_or(|(lowest, _)| index < lowest) {
                if let Some(offset) = self.candidate(index as usize, name)? {
                    best = Some((index, offset));
                }
            }
            index = words.get(chain_at + index as u64)?;
        }
        Err(ElfError::Bound { what: ".hash chain", size: MAX_CHAIN as u64 + 1, limit: MAX_CHAIN as u64 })
    }
}

/// A hash section as 32-bit words in the file's byte order, every read bounds-checked.
struct Words<'a> {
    endian: Endianness,
    bytes: &'a [u8],
}

impl Words<'_> {
    fn len(&self) -> u64 {
        self.bytes.len() as u64 / 4
    }

    fn get(&self, index: u64) -> Result<u32> {
        let at = usize::try_from(index).ok().and_then(|i| i.checked_mul(4));
        let word = at.and_then(|at| self.bytes.get(at..at.checked_add(4)?));
        let word: [u8; 4] = word.and_then(|w| w.try_into().ok()).ok_or(ElfError::Invalid("a hash table index runs past its section"))?;
        Ok(self.endian.read_u32(word))
    }
}

/// The hash of `.gnu.hash` (Bernstein's, 32 bits).
fn gnu_hash(name: &[u8]) -> u32 {
    name.iter().fold(5381u32, |h, &c| h.wrapping_mul(33).wrapping_add(c as u32))
}

/// The hash of SysV `.hash` (the System V ABI's `elf_hash`).
fn sysv_hash(name: &[u8]) -> u32 {
    name.iter().fold(0u32, |h, &c| {
        let h = (h << 4).wrapping_add(c as u32);
        let g = h & 0xf000_0000;
        (h ^ (g >> 24)) & !g
    })
}

/// The bytes of `section` (its size already bounded by the caller), read with `pread` into
/// zeroed memory the agent owns; fails unless they lie within the file's `size` bytes.
fn read_table(file: &File, size: u64, endian: Endianness, section: &elf::SectionHeader64<Endianness>) -> Result<Vec<u8>> {
    let (offset, length) = (section.sh_offset(endian), section.sh_size(endian));
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(ElfError::Invalid("a table lies past the end of the file"));
    }
    let mut bytes = vec![0; length as usize];
    file.read_exact_at(&mut bytes, offset).map_err(|_| ElfError::Invalid("a table could not be read whole (the file shrank?)"))?;
    Ok(bytes)
}

fn bound(what: &'static str, size: u64, limit: u64) -> Result<()> {
    if size > limit {
        return Err(ElfError::Bound { what, size, limit });
    }
    Ok(())
}

/// The crafted files of the e2e tests (`e2e::crafted_elf`), for the tests below.
#[cfg(test)]
#[path = "../../../tests/e2e/src/crafted_elf.rs"]
mod crafted;

#[cfg(test)]
pub(crate) mod tests {
    use std::{io::Write, os::unix::fs::FileExt, path::{Path, PathBuf}, process::Command, time::Instant};

    use super::*;

    /// A directory of its own for one test, removed on drop.
    pub struct Scratch(pub PathBuf);

    impl Scratch {
        pub fn new(tag: &str) -> Scratch {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("vramguard-elf-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("mkdir");
            Scratch(dir)
        }

        /// A shared library named `name` whose functions are `functions`, built with `cc`.
        pub fn library(&self, name: &str, functions: &[&str]) -> PathBuf {
            let source = self.0.join(format!("{name}.c"));
            let mut text = String::from("int cuda_data = 1;\n");
            for function in functions {
                text.push_str(&format!("int {function}(void) {{ return cuda_data + {}; }}\n", function.len()));
            }
            std::fs::write(&source, text).expect("write the source");
            let library = self.0.join(name);
            let status = Command::new("cc")
                .args(["-shared", "-fPIC", "-O0", "-o"])
                .arg(&library)
                .arg(&source)
                .status()
                .expect("these tests build small libraries with `cc`: install a C compiler");
            assert!(status.success(), "cc failed for {name}");
            library
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub const LIBCUDA_LIKE: [&str; 4] = ["cuInit", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemCreate"];

    fn read(path: &Path, wanted: &[&'static str]) -> Result<BTreeMap<&'static str, u64>> {
        let file = File::open(path).expect("open");
        let size = file.metadata().expect("fstat").len();
        exported(&file, size, wanted)
    }

    /// The file offset `nm` gives for `symbol`, through the segment that holds it.
    fn offset_by_readelf(path: &Path, symbol: &str) -> u64 {
        let output = Command::new("nm").arg("-D").arg("--defined-only").arg(path).output().expect("nm");
        let text = String::from_utf8_lossy(&output.stdout);
        let address = text
            .lines()
            .find(|l| l.ends_with(&format!(" {symbol}")))
            .and_then(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
            .expect("nm lists the symbol");
        let output = Command::new("readelf").args(["-lW"]).arg(path).output().expect("readelf");
        let text = String::from_utf8_lossy(&output.stdout);
        text.lines()
            .filter(|l| l.trim_start().starts_with("LOAD") && l.contains(" R E "))
            .find_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
                let (offset, vaddr, filesz) = (hex(w[1])?, hex(w[2])?, hex(w[4])?);
                (address >= vaddr && address < vaddr + filesz).then(|| address - vaddr + offset)
            })
            .expect("an executable segment holds the symbol")
    }

    #[test]
    fn finds_exported_functions_at_their_file_offsets() {
        let scratch = Scratch::new("exports");
        let library = scratch.library("libsomething.so", &LIBCUDA_LIKE);
        let found = read(&library, &["cuInit", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemRelease"]).expect("parsed");
        assert_eq!(found.keys().copied().collect::<Vec<_>>(), vec!["cuInit", "cuMemAlloc_v2", "cuMemFree_v2"]);
        for (symbol, offset) in &found {
            assert_eq!(*offset, offset_by_readelf(&library, symbol), "{symbol}");
        }
        // Data and undefined symbols are not functions it exports.
        assert!(read(&library, &["cuda_data", "printf"]).expect("parsed").is_empty());
    }

    /// `library` built by `cc` with `-Wl,--hash-style=<style>`: which hash sections it has.
    fn hash_sections(path: &Path) -> (bool, bool) {
        let output = Command::new("readelf").arg("-SW").arg(path).output().expect("readelf");
        let text = String::from_utf8_lossy(&output.stdout);
        (text.contains(" .gnu.hash "), text.contains(" .hash "))
    }

    #[test]
    fn finds_exports_through_either_hash_table_as_linkers_make_them() {
        let scratch = Scratch::new("styles");
        for (style, want) in [("gnu", (true, false)), ("sysv", (false, true)), ("both", (true, true))] {
            let name = format!("lib{style}.so");
            scratch.library(&name, &LIBCUDA_LIKE);
            let library = scratch.0.join(format!("linked-{style}.so"));
            let status = Command::new("cc")
                .args(["-shared", "-fPIC", "-O0", &format!("-Wl,--hash-style={style}"), "-o"])
                .arg(&library)
                .arg(scratch.0.join(format!("{name}.c")))
                .status()
                .expect("cc");
            assert!(status.success(), "cc --hash-style={style}");
            assert_eq!(hash_sections(&library), want, "{style}: the hash sections the test means to exercise");
            let found = read(&library, &["cuInit", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemRelease", "cuda_data"]).expect("parsed");
            assert_eq!(found.keys().copied().collect::<Vec<_>>(), vec!["cuInit", "cuMemAlloc_v2", "cuMemFree_v2"], "{style}");
            for (symbol, offset) in &found {
                assert_eq!(*offset, offset_by_readelf(&library, symbol), "{style}: {symbol}");
            }
        }
    }

    fn crafted(scratch: &Scratch, name: &str, file: &super::crafted::Crafted) -> PathBuf {
        let path = scratch.0.join(name);
        std::fs::write(&path, file.bytes()).expect("write the crafted file");
        path
    }

    /// The crafted file and its variants: tens of thousands of symbols, a string
    /// table without NUL, hash tables that loop, point out of range or claim 2^32 buckets.
    /// Each is answered or refused, within the time budget (an answer past it would be
    /// `OverTime`).
    #[test]
    fn crafted_files_are_answered_or_refused_within_the_budget() {
        use super::crafted::{Crafted, Hash, Names};
        let scratch = Scratch::new("crafted");
        let many = super::crafted::MOST_SYMBOLS;
        let wanted: Vec<&'static str> = crate::kernel::probes::PROBES.iter().map(|p| p.symbol).chain(LIBCUDA_LIKE).collect();
        let check = |name: &str, file: Crafted| {
            let path = crafted(&scratch, name, &file);
            let started = Instant::now();
            let answer = read(&path, &wanted);
            eprintln!("{name}: {:?} in {:?}", answer.as_ref().map(|found| found.len()), started.elapsed());
            answer
        };

        // Positive controls: found through either table among 174,762 symbols, at the
        // addresses the file gives them (its one segment maps file offset = address).
        for hash in [Hash::Gnu, Hash::Sysv] {
            let found = check("proper.so", Crafted::new(many, Names::Proper, hash)).expect("a well-formed file");
            assert_eq!(found.keys().copied().collect::<Vec<_>>(), vec!["cuInit", "cuMemAlloc_v2", "cuMemFree_v2"], "{hash:?}");
            assert!(found.values().all(|offset| (0x1000..0x1100).contains(offset)), "{hash:?}: {found:?}");
        }
        // No NUL in 4 MiB of names: a lookup compares a name's length, finds nothing.
        for hash in [Hash::Gnu, Hash::Sysv] {
            let found = check("nonul.so", Crafted::new(many, Names::WithoutNul, hash)).expect("answered");
            assert!(found.is_empty(), "{hash:?}: {found:?}");
        }
        // Without a hash table: scanned up to the cap, refused past it.
        let found = check("nohash-small.so", Crafted::new(MAX_LINEAR_SYMBOLS as u32 - 1, Names::WithoutNul, Hash::None)).expect("scanned");
        assert!(found.is_empty(), "{found:?}");
        let found = check("nohash-proper.so", Crafted::new(MAX_LINEAR_SYMBOLS as u32 - 1, Names::Proper, Hash::None)).expect("scanned");
        assert_eq!(found.len(), 3, "{found:?}");
        let refused = check("nohash.so", Crafted::new(many, Names::WithoutNul, Hash::None));
        assert!(
            matches!(refused, Err(ElfError::Bound { what: "dynamic symbol table without a hash table", .. })),
            "{refused:?}"
        );
        // Crafted hash tables.
        for (name, hash, want) in [
            ("onechain.so", Hash::GnuOneChain, ".gnu.hash chain"),
            ("loop.so", Hash::SysvLoop, ".hash chain"),
        ] {
            let refused = check(name, Crafted::new(many, Names::Proper, hash));
            assert!(matches!(refused, Err(ElfError::Bound { what, .. }) if what == want), "{name}: {refused:?}");
        }
        for (name, hash) in [
            ("outofrange.so", Hash::GnuOutOfRange),
            ("hugebuckets.so", Hash::GnuHugeBuckets),
            ("sysvhuge.so", Hash::SysvHugeBuckets),
        ] {
            let refused = check(name, Crafted::new(many, Names::Proper, hash));
            assert!(matches!(refused, Err(ElfError::Invalid(_))), "{name}: {refused:?}");
        }
    }

    #[test]
    fn a_file_over_the_time_budget_is_refused_with_that_reason() {
        use super::crafted::{Crafted, Hash, Names};
        let scratch = Scratch::new("budget");
        let path = crafted(&scratch, "slow.so", &Crafted::new(1000, Names::Proper, Hash::Gnu));
        let file = File::open(&path).expect("open");
        let size = file.metadata().expect("fstat").len();
        assert_eq!(exported_within(&file, size, &LIBCUDA_LIKE, TIME_BUDGET).expect("in time").len(), 3, "control");
        let error = exported_within(&file, size, &LIBCUDA_LIKE, Duration::ZERO).expect_err("no time at all");
        assert!(matches!(error, ElfError::OverTime), "{error:?}");
        assert!(error.to_string().contains("over the agent's time budget"), "{error}");
    }

    #[test]
    fn refuses_what_is_not_a_bounded_elf_library() {
        let scratch = Scratch::new("refuse");
        let junk = scratch.0.join("libcuda.so.1");
        std::fs::write(&junk, vec![0x5a; 8192]).expect("write");
        assert!(matches!(read(&junk, &LIBCUDA_LIKE), Err(ElfError::NotElf(_))), "non-ELF bytes");

        let library = scratch.library("libx.so", &LIBCUDA_LIKE);
        let bytes = std::fs::read(&library).expect("read");
        let truncated = scratch.0.join("truncated.so");
        std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("write");
        assert!(read(&truncated, &LIBCUDA_LIKE).is_err(), "a truncated library (section headers gone)");

        // e_shnum (offset 60) claiming 60000 sections.
        let many = scratch.0.join("many.so");
        let mut patched = bytes.clone();
        patched[60..62].copy_from_slice(&60000u16.to_le_bytes());
        std::fs::write(&many, &patched).expect("write");
        assert!(matches!(read(&many, &LIBCUDA_LIKE), Err(ElfError::Bound { .. })), "too many sections");

        // A dynamic symbol table claiming 1 GiB.
        let huge = scratch.0.join("huge.so");
        let file = File::open(&library).expect("open");
        let mut patched = bytes.clone();
        let header = elf::FileHeader64::<Endianness>::parse(&bytes[..]).expect("header");
        let endian = header.endian().expect("endian");
        let sections = header.section_headers(endian, &bytes[..]).expect("sections");
        let index = sections.iter().position(|s| s.sh_type(endian) == elf::SHT_DYNSYM).expect("dynsym");
        let at = header.e_shoff(endian) as usize + index * 64 + 32; // sh_size
        patched[at..at + 8].copy_from_slice(&(1u64 << 30).to_le_bytes());
        drop(file);
        std::fs::write(&huge, &patched).expect("write");
        assert!(matches!(read(&huge, &LIBCUDA_LIKE), Err(ElfError::Bound { .. })), "a huge symbol table");

        // A (sparse) file over the size cap is not read at all.
        let large = scratch.0.join("large.so");
        let file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&large).expect("create");
        (&file).write_all(&bytes).expect("write");
        file.set_len(MAX_FILE_BYTES + 1).expect("extend");
        file.write_at(&[0], MAX_FILE_BYTES).expect("write");
        assert!(matches!(read(&large, &LIBCUDA_LIKE), Err(ElfError::TooLarge(_))));
    }
}
