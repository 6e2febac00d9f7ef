//! Reading a library's exported functions from an open descriptor, within fixed bounds.
//!
//! A file a workload maps is untrusted: it may be huge, truncated while we read it, or crafted
//! to make a parser allocate or loop. So nothing here maps the file (a truncation would kill
//! the agent with SIGBUS) and nothing trusts a size from it: the file's own size is capped,
//! only the ELF header, the section and program header tables, the dynamic symbol table and
//! its string table are read (each with a cap, with `pread`), and every offset is checked by
//! `object`. Symbols are resolved to file offsets through the executable `PT_LOAD` segment
//! that holds them (what a uprobe attaches to), once per file.
use std::{collections::BTreeMap, fs::File};

use object::{
    elf,
    read::{
        elf::{FileHeader, ProgramHeader, SectionHeader, Sym},
        ReadCache, StringTable,
    },
    Endianness,
};

/// A file larger than this is not read at all (libcuda is about 100 MiB).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// At most this many section headers (a library has about 40).
const MAX_SECTIONS: usize = 1024;
/// At most this many program headers (a library has about 10).
const MAX_SEGMENTS: usize = 64;
/// The dynamic symbol table and its strings, each at most this large (libcuda's are well
/// under 1 MiB).
const MAX_TABLE_BYTES: u64 = 4 << 20;

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
}

type Result<T> = std::result::Result<T, ElfError>;

/// The file offsets of the functions in `wanted` that `file` (of `size` bytes, from the
/// caller's `fstat`) exports: defined, global or weak `STT_FUNC` symbols of its dynamic
/// symbol table that lie in an executable segment. A name defined twice keeps its first
/// definition.
pub fn exported(file: &File, size: u64, wanted: &[&'static str]) -> Result<BTreeMap<&'static str, u64>> {
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
    let Some(dynsym) = sections.iter().find(|s| s.sh_type(endian) == elf::SHT_DYNSYM) else {
        return Ok(BTreeMap::new());
    };
    bound("dynamic symbol table", dynsym.sh_size(endian), MAX_TABLE_BYTES)?;
    let strings = sections
        .get(dynsym.sh_link(endian) as usize)
        .filter(|s| s.sh_type(endian) == elf::SHT_STRTAB)
        .ok_or(ElfError::Invalid("the dynamic symbol table links no string table"))?;
    bound("dynamic string table", strings.sh_size(endian), MAX_TABLE_BYTES)?;
    let symbols: &[elf::Sym64<Endianness>] =
        dynsym.data_as_array(endian, data).map_err(ElfError::Malformed)?;
    // One read of the whole string table, then every name is looked up in memory.
    let names = strings.data(endian, data).map_err(ElfError::Malformed)?;
    let names = StringTable::new(names, 0, names.len() as u64);
    let executable: Vec<_> = segments
        .iter()
        .filter(|p| p.p_type(endian) == elf::PT_LOAD && p.p_flags(endian) & elf::PF_X != 0)
        .map(|p| (p.p_vaddr(endian), p.p_filesz(endian), p.p_offset(endian)))
        .collect();
    let mut found = BTreeMap::new();
    for symbol in symbols {
        let global = matches!(symbol.st_bind(), elf::STB_GLOBAL | elf::STB_WEAK);
        if !global || symbol.st_type() != elf::STT_FUNC || symbol.st_shndx(endian) == elf::SHN_UNDEF {
            continue;
        }
        let Ok(name) = symbol.name(endian, names) else { continue };
        let Some(&wanted) = wanted.iter().find(|w| w.as_bytes() == name) else { continue };
        if found.contains_key(wanted) {
            continue;
        }
        let address = symbol.st_value(endian);
        let offset = executable.iter().find_map(|&(vaddr, filesz, offset)| {
            let within = address.checked_sub(vaddr).filter(|relative| *relative < filesz)?;
            offset.checked_add(within)
        });
        if let Some(offset) = offset {
            found.insert(wanted, offset);
        }
    }
    Ok(found)
}

fn bound(what: &'static str, size: u64, limit: u64) -> Result<()> {
    if size > limit {
        return Err(ElfError::Bound { what, size, limit });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{io::Write, os::unix::fs::FileExt, path::{Path, PathBuf}, process::Command};

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
