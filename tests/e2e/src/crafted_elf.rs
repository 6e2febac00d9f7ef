//! Crafted ELF64 shared objects, as a hostile tenant would make them to cost the agent's
//! discovery time: tens of thousands of dynamic symbols, a dynamic string table without a NUL
//! byte, `.gnu.hash` / `.hash` tables whose chains never end, point out of their table or
//! claim huge bucket counts. Each file passes the checks of an ELF reader that bounds sizes
//! (header, section and program headers, table sizes): only the way names are looked up
//! decides what it costs.
//!
//! Used by the e2e tests (`e2e::crafted_elf`) and, through `#[path]`, by the agent's unit
//! tests of `discovery/elf.rs`, so that it depends on `std` only.

/// How the dynamic string table is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// Every symbol's name, NUL-terminated.
    Proper,
    /// 4 MiB without a NUL byte; every symbol's name starts somewhere in it (a reader that
    /// looks for the terminating NUL scans to the end of the table for each name).
    WithoutNul,
}

/// Which hash table the file carries, and its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    /// No hash table: a reader can only scan the symbols.
    None,
    /// A `.gnu.hash` as a linker makes it.
    Gnu,
    /// A `.gnu.hash` whose one bucket holds every symbol, every one with the hash of the
    /// first exported name and no chain end: one lookup walks every symbol.
    GnuOneChain,
    /// A `.gnu.hash` whose buckets point past the end of its chain array.
    GnuOutOfRange,
    /// A `.gnu.hash` that claims 2^32-1 buckets in a table of a few bytes.
    GnuHugeBuckets,
    /// A SysV `.hash` as a linker makes it.
    Sysv,
    /// A SysV `.hash` whose every chain entry points to itself.
    SysvLoop,
    /// A SysV `.hash` that claims 2^32-1 buckets.
    SysvHugeBuckets,
}

/// A crafted shared object: `symbols` defined `STT_FUNC` dynamic symbols, the first ones
/// named `exports`, the rest `f<N>`.
#[derive(Clone, Debug)]
pub struct Crafted {
    pub symbols: u32,
    pub exports: Vec<String>,
    pub names: Names,
    pub hash: Hash,
}

const SHT_STRTAB: u32 = 3;
const SHT_HASH: u32 = 5;
const SHT_DYNSYM: u32 = 11;
const SHT_GNU_HASH: u32 = 0x6fff_fff6;
/// Where the (fake) code lies: every symbol's address is in [TEXT, TEXT + 256).
const TEXT: u64 = 0x1000;
/// A string table without NUL: the figure.
const NO_NUL_BYTES: usize = 4 << 20;
/// The most symbols a dynamic symbol table of 4 MiB holds (with the null symbol: the issue's
/// 174,762 entries), the agent's bound on its size.
pub const MOST_SYMBOLS: u32 = (4 << 20) / 24 - 1;

/// The hash `.gnu.hash` uses (Bernstein's, 32 bits).
pub fn gnu_hash(name: &[u8]) -> u32 {
    name.iter().fold(5381u32, |h, &c| h.wrapping_mul(33).wrapping_add(c as u32))
}

/// The hash SysV `.hash` uses.
pub fn sysv_hash(name: &[u8]) -> u32 {
    name.iter().fold(0u32, |h, &c| {
        let h = (h << 4).wrapping_add(c as u32);
        let g = h & 0xf000_0000;
        (h ^ (g >> 24)) & !g
    })
}

impl Crafted {
    /// The libcuda-like exports of the agent's identification, in a file of `symbols` symbols.
    pub fn new(symbols: u32, names: Names, hash: Hash) -> Crafted {
        let exports = ["cuInit", "cuMemAlloc_v2", "cuMemFree_v2"].map(String::from).to_vec();
        Crafted { symbols, exports, names, hash }
    }

    fn name(&self, index: u32) -> String {
        match self.exports.get(index as usize) {
            Some(name) => name.clone(),
            None => format!("f{index}"),
        }
    }

    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let count = self.symbols as usize;
        // Symbol order: a .gnu.hash needs the symbols of a bucket to be adjacent.
        let mut order: Vec<u32> = (0..self.symbols).collect();
        let buckets = (count / 4).max(1) as u32;
        if self.hash == Hash::Gnu {
            order.sort_by_key(|&i| gnu_hash(self.name(i).as_bytes()) % buckets);
        }
        // The string table and each symbol's name offset.
        let (strings, name_at): (Vec<u8>, Vec<u32>) = match self.names {
            Names::Proper => {
                let mut table = vec![0u8];
                let mut at = Vec::with_capacity(count);
                for &i in &order {
                    at.push(table.len() as u32);
                    table.extend_from_slice(self.name(i).as_bytes());
                    table.push(0);
                }
                (table, at)
            }
            Names::WithoutNul => {
                let table: Vec<u8> = (0..NO_NUL_BYTES).map(|i| b'a' + (i % 26) as u8).collect();
                (table, order.iter().map(|&i| (i as usize * 24 % NO_NUL_BYTES) as u32).collect())
            }
        };
        let hash = self.hash_table(&order, buckets);

        // Layout: header, one program header, text, dynsym, dynstr, hash, section headers.
        let dynsym_at = align(TEXT + 256, 8);
        let dynsym_size = (count as u64 + 1) * 24;
        let dynstr_at = dynsym_at + dynsym_size;
        let hash_at = align(dynstr_at + strings.len() as u64, 8);
        let shdr_at = align(hash_at + hash.len() as u64, 8);
        let sections: u16 = if hash.is_empty() { 3 } else { 4 };
        let end = shdr_at + sections as u64 * 64;

        let mut out = Vec::with_capacity(end as usize);
        // ELF header.
        out.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
        out.extend_from_slice(&[0; 8]);
        out.extend_from_slice(&3u16.to_le_bytes()); // ET_DYN
        out.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&TEXT.to_le_bytes()); // e_entry
        out.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
        out.extend_from_slice(&shdr_at.to_le_bytes()); // e_shoff
        out.extend_from_slice(&0u32.to_le_bytes()); // e_flags
        for half in [64u16, 56, 1, 64, sections, 0] {
            // e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
            out.extend_from_slice(&half.to_le_bytes());
        }
        // PT_LOAD, R+X, the whole file.
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&5u32.to_le_bytes());
        for word in [0u64, 0, 0, end, end, 0x1000] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.resize(TEXT as usize, 0);
        out.resize((TEXT + 256) as usize, 0xc3); // ret
        out.resize(dynsym_at as usize, 0);
        // Symbol 0 is the null symbol.
        out.extend_from_slice(&[0; 24]);
        for (slot, _) in order.iter().enumerate() {
            out.extend_from_slice(&name_at[slot].to_le_bytes());
            out.push(0x12); // STB_GLOBAL, STT_FUNC
            out.push(0);
            out.extend_from_slice(&1u16.to_le_bytes()); // defined (any section but 0)
            out.extend_from_slice(&(TEXT + (slot as u64 % 16) * 16).to_le_bytes());
            out.extend_from_slice(&16u64.to_le_bytes());
        }
        out.extend_from_slice(&strings);
        out.resize(hash_at as usize, 0);
        out.extend_from_slice(&hash);
        out.resize(shdr_at as usize, 0);
        // Section headers: null, .dynsym (links .dynstr), .dynstr, the hash (links .dynsym).
        out.extend_from_slice(&[0; 64]);
        section(&mut out, SHT_DYNSYM, dynsym_at, dynsym_size, 2, 1, 24);
        section(&mut out, SHT_STRTAB, dynstr_at, strings.len() as u64, 0, 0, 0);
        if !hash.is_empty() {
            let kind = if matches!(self.hash, Hash::Sysv | Hash::SysvLoop | Hash::SysvHugeBuckets) { SHT_HASH } else { SHT_GNU_HASH };
            section(&mut out, kind, hash_at, hash.len() as u64, 1, 0, 4);
        }
        out
    }

    /// The hash section's bytes for symbols in `order` (table index = position + 1).
    fn hash_table(&self, order: &[u32], buckets: u32) -> Vec<u8> {
        let count = order.len() as u32;
        let names: Vec<String> = order.iter().map(|&i| self.name(i)).collect();
        let mut words: Vec<u32> = Vec::new();
        let bloom = |words: &mut Vec<u32>, nbuckets: u32| {
            // nbuckets, symoffset 1, one bloom word (all ones: it never says no), shift 6.
            words.extend([nbuckets, 1, 1, 6, u32::MAX, u32::MAX]);
        };
        match self.hash {
            Hash::None => return Vec::new(),
            Hash::Gnu => {
                bloom(&mut words, buckets);
                let bucket_of = |n: &String| gnu_hash(n.as_bytes()) % buckets;
                let mut heads = vec![0u32; buckets as usize];
                for (slot, name) in names.iter().enumerate().rev() {
                    heads[bucket_of(name) as usize] = slot as u32 + 1;
                }
                words.extend(&heads);
                for (slot, name) in names.iter().enumerate() {
                    let last = names.get(slot + 1).is_none_or(|next| bucket_of(next) != bucket_of(name));
                    words.push((gnu_hash(name.as_bytes()) & !1) | last as u32);
                }
            }
            Hash::GnuOneChain => {
                bloom(&mut words, 1);
                words.push(1);
                let first = self.exports.first().map_or(0, |n| gnu_hash(n.as_bytes()));
                words.extend((0..count).map(|_| first & !1));
            }
            Hash::GnuOutOfRange => {
                bloom(&mut words, 4);
                // Every bucket is past the chain array (one entry: symbol 1's).
                words.extend([count + 100, u32::MAX, count + 7, 2]);
                words.push(0);
            }
            Hash::GnuHugeBuckets => bloom(&mut words, u32::MAX),
            Hash::Sysv => {
                let nchain = count + 1;
                words.extend([buckets, nchain]);
                let mut heads = vec![0u32; buckets as usize];
                let mut chain = vec![0u32; nchain as usize];
                for (slot, name) in names.iter().enumerate() {
                    let bucket = (sysv_hash(name.as_bytes()) % buckets) as usize;
                    chain[slot + 1] = heads[bucket];
                    heads[bucket] = slot as u32 + 1;
                }
                words.extend(heads);
                words.extend(chain);
            }
            Hash::SysvLoop => {
                words.extend([1, count + 1, 1, 0]);
                words.extend(1..=count);
            }
            Hash::SysvHugeBuckets => words.extend([u32::MAX, count + 1, 1]),
        }
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

fn align(at: u64, to: u64) -> u64 {
    at.div_ceil(to) * to
}

fn section(out: &mut Vec<u8>, kind: u32, offset: u64, size: u64, link: u32, info: u32, entsize: u64) {
    out.extend_from_slice(&0u32.to_le_bytes()); // sh_name
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&2u64.to_le_bytes()); // SHF_ALLOC
    out.extend_from_slice(&offset.to_le_bytes()); // sh_addr (= offset: one segment at 0)
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(&link.to_le_bytes());
    out.extend_from_slice(&info.to_le_bytes());
    out.extend_from_slice(&8u64.to_le_bytes()); // sh_addralign
    out.extend_from_slice(&entsize.to_le_bytes());
}
