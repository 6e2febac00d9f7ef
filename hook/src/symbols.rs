//! Symbol lookups that do not go through `dlsym`: the loaded objects' own dynamic symbol
//! tables, read in memory (ELF, 64-bit), in the order the dynamic linker lists the objects.
//!
//! The hook exports `dlsym` and `dlvsym`, so it cannot reach the C library's own through them;
//! and glibc resolves `RTLD_NEXT` relative to its caller's return address, which for a lookup
//! the hook answers itself is not the application's. This module answers both: the first
//! definition of a name in the objects after a given address's object ([`next_definition`]),
//! as `dlsym(RTLD_NEXT, name)` called from that object finds it: for a caller loaded at
//! start-up, among the objects loaded at start-up (noted when this library is loaded, which
//! is then for a preload); for a `dlopen`ed caller, among every object after it (glibc
//! searches that object's own dependencies only, a subset).
//!
//! The objects are visited with `dl_iterate_phdr`, which holds the dynamic linker's lock, so
//! none is unloaded while its tables are read. Only defined, non-IFUNC symbols count (an
//! IFUNC's value is its resolver, not the function). Without a version asked for (`dlsym`), a
//! hidden (non-default) version is taken only where no default one exists; with one (`dlvsym`),
//! glibc's rule: in an object without version tables any definition matches, in one with them
//! only the definition of exactly that version (hidden or not), so never an unversioned one.
use std::{
    ffi::{c_int, c_void, CStr},
    sync::atomic::{AtomicUsize, Ordering},
};

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_HASH: i64 = 4;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
const DT_VERSYM: i64 = 0x6fff_fff0;
const DT_VERDEF: i64 = 0x6fff_fffc;
const VER_FLG_BASE: u16 = 1;
const STT_GNU_IFUNC: u8 = 10;
const VERSYM_HIDDEN: u16 = 0x8000;

/// `Elf64_Sym`.
#[repr(C)]
struct Sym {
    st_name: u32,
    st_info: u8,
    st_other: u8,
    st_shndx: u16,
    st_value: u64,
    st_size: u64,
}

/// `Elf64_Dyn`.
#[repr(C)]
struct Dyn {
    d_tag: i64,
    d_val: u64,
}

/// `Elf64_Verdef`.
#[repr(C)]
struct Verdef {
    vd_version: u16,
    vd_flags: u16,
    vd_ndx: u16,
    vd_cnt: u16,
    vd_hash: u32,
    vd_aux: u32,
    vd_next: u32,
}

/// `Elf64_Verdaux`.
#[repr(C)]
struct Verdaux {
    vda_name: u32,
    vda_next: u32,
}

/// One loaded object's dynamic symbol table.
struct Image {
    base: usize,
    symtab: *const Sym,
    strtab: *const u8,
    gnu_hash: *const u32,
    hash: *const u32,
    versym: *const u16,
    verdef: *const Verdef,
}

impl Image {
    /// The tables of the object `info` describes, if it has them.
    ///
    /// # Safety
    /// `info` is what `dl_iterate_phdr` handed its callback (the object stays mapped).
    unsafe fn of(info: &libc::dl_phdr_info) -> Option<Image> {
        let base = info.dlpi_addr as usize;
        // SAFETY: the loader's program headers of this object, `dlpi_phnum` of them.
        let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        let dynamic = headers.iter().find(|h| h.p_type == PT_DYNAMIC)?;
        let mut dynamic = (base + dynamic.p_vaddr as usize) as *const Dyn;
        // glibc relocates the table pointers in place (most targets); a value below the
        // object's base is still a file offset.
        let address = |value: u64| if (value as usize) < base { base + value as usize } else { value as usize };
        let mut image = Image {
            base,
            symtab: std::ptr::null(),
            strtab: std::ptr::null(),
            gnu_hash: std::ptr::null(),
            hash: std::ptr::null(),
            versym: std::ptr::null(),
            verdef: std::ptr::null(),
        };
        loop {
            // SAFETY: the dynamic section is an array ended by DT_NULL, mapped with the object.
            let entry = unsafe { &*dynamic };
            match entry.d_tag {
                DT_NULL => break,
                DT_SYMTAB => image.symtab = address(entry.d_val) as *const Sym,
                DT_STRTAB => image.strtab = address(entry.d_val) as *const u8,
                DT_GNU_HASH => image.gnu_hash = address(entry.d_val) as *const u32,
                DT_HASH => image.hash = address(entry.d_val) as *const u32,
                DT_VERSYM => image.versym = address(entry.d_val) as *const u16,
                // glibc leaves this one unrelocated: `address` adds the base.
                DT_VERDEF => image.verdef = address(entry.d_val) as *const Verdef,
                _ => {}
            }
            // SAFETY: not past DT_NULL yet.
            dynamic = unsafe { dynamic.add(1) };
        }
        let hashed = !image.gnu_hash.is_null() || !image.hash.is_null();
        (!image.symtab.is_null() && !image.strtab.is_null() && hashed).then_some(image)
    }

    /// The name of the version this object defines at index `index` (not its base version,
    /// the object's own name, which glibc does not count as a version).
    fn version_name(&self, index: u16) -> Option<&CStr> {
        let mut entry = self.verdef;
        while !entry.is_null() {
            // SAFETY: DT_VERDEF is a chain of entries linked by byte offsets, ended by 0.
            let definition = unsafe { &*entry };
            if definition.vd_flags & VER_FLG_BASE == 0 && definition.vd_ndx & !VERSYM_HIDDEN == index && definition.vd_cnt > 0 {
                // SAFETY: an entry's first auxiliary entry (its name) is vd_aux bytes on; the
                // name is an offset into this object's string table.
                return Some(unsafe {
                    let aux = &*entry.cast::<u8>().add(definition.vd_aux as usize).cast::<Verdaux>();
                    CStr::from_ptr(self.strtab.add(aux.vda_name as usize).cast())
                });
            }
            if definition.vd_next == 0 {
                break;
            }
            // SAFETY: as above.
            entry = unsafe { entry.cast::<u8>().add(definition.vd_next as usize).cast() };
        }
        None
    }

    /// The address `name` is defined at in this object; with `version`, the definition of
    /// that version, as glibc's `dlvsym` matches it (see the module's note).
    fn lookup(&self, name: &CStr, version: Option<&CStr>) -> Option<usize> {
        let mut hidden = None;
        let mut visit = |index: u32| -> Option<usize> {
            // SAFETY: indexes come from this object's hash table, so they are in its symbol table.
            let sym = unsafe { &*self.symtab.add(index as usize) };
            if sym.st_shndx == 0 || sym.st_info & 0xf == STT_GNU_IFUNC {
                return None;
            }
            // SAFETY: st_name is an offset into this object's string table (NUL-terminated).
            let symbol = unsafe { CStr::from_ptr(self.strtab.add(sym.st_name as usize).cast()) };
            if symbol != name {
                return None;
            }
            let address = self.base + sym.st_value as usize;
            // SAFETY: DT_VERSYM has one entry per symbol-table entry.
            let index = (!self.versym.is_null()).then(|| unsafe { *self.versym.add(index as usize) });
            if let Some(wanted) = version {
                let matches = index.is_none_or(|index| self.version_name(index & !VERSYM_HIDDEN) == Some(wanted));
                return matches.then_some(address);
            }
            if index.is_some_and(|v| v & VERSYM_HIDDEN != 0) {
                hidden.get_or_insert(address);
                return None;
            }
            Some(address)
        };
        let found = if self.gnu_hash.is_null() {
            // SAFETY: this object's DT_HASH table.
            unsafe { sysv_candidates(self.hash, name, &mut visit) }
        } else {
            // SAFETY: this object's DT_GNU_HASH table.
            unsafe { gnu_candidates(self.gnu_hash, name, &mut visit) }
        };
        found.or(hidden)
    }

    /// Whether `address` lies in one of this object's loaded segments.
    fn contains(info: &libc::dl_phdr_info, address: usize) -> bool {
        // SAFETY: as in `Image::of`.
        let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        headers.iter().filter(|h| h.p_type == PT_LOAD).any(|h| {
            let start = info.dlpi_addr as usize + h.p_vaddr as usize;
            (start..start + h.p_memsz as usize).contains(&address)
        })
    }
}

/// Calls `visit` on the symbol indexes of the GNU hash chain of `name`, until it answers.
///
/// # Safety
/// `table` is a live DT_GNU_HASH table.
unsafe fn gnu_candidates(table: *const u32, name: &CStr, visit: &mut impl FnMut(u32) -> Option<usize>) -> Option<usize> {
    let hash = name.to_bytes().iter().fold(5381u32, |h, &c| h.wrapping_mul(33).wrapping_add(u32::from(c)));
    // SAFETY: the table's header, bloom filter, buckets and chains, as the ELF gABI's GNU
    // extension lays them out (the bloom words are 64-bit on ELF64).
    unsafe {
        let (buckets_count, symoffset, bloom_size) = (*table, *table.add(1), *table.add(2));
        if buckets_count == 0 {
            return None;
        }
        let buckets = table.add(4).cast::<u64>().add(bloom_size as usize).cast::<u32>();
        let chains = buckets.add(buckets_count as usize);
        let mut index = *buckets.add((hash % buckets_count) as usize);
        if index < symoffset {
            return None;
        }
        loop {
            let chained = *chains.add((index - symoffset) as usize);
            if chained | 1 == hash | 1 {
                if let Some(found) = visit(index) {
                    return Some(found);
                }
            }
            if chained & 1 != 0 {
                return None;
            }
            index += 1;
        }
    }
}

/// Calls `visit` on the symbol indexes of the System V hash chain of `name`, until it answers.
///
/// # Safety
/// `table` is a live DT_HASH table.
unsafe fn sysv_candidates(table: *const u32, name: &CStr, visit: &mut impl FnMut(u32) -> Option<usize>) -> Option<usize> {
    let hash = name.to_bytes().iter().fold(0u32, |h, &c| {
        let h = (h << 4).wrapping_add(u32::from(c));
        (h ^ ((h & 0xf000_0000) >> 24)) & 0x0fff_ffff
    });
    // SAFETY: nbucket, nchain, then the buckets and chains (ELF gABI).
    unsafe {
        let (buckets_count, chains_count) = (*table, *table.add(1));
        if buckets_count == 0 {
            return None;
        }
        let buckets = table.add(2);
        let chains = buckets.add(buckets_count as usize);
        let mut index = *buckets.add((hash % buckets_count) as usize);
        let mut steps = 0;
        while index != 0 && index < chains_count && steps < chains_count {
            if let Some(found) = visit(index) {
                return Some(found);
            }
            index = *chains.add(index as usize);
            steps += 1;
        }
        None
    }
}

/// The dynamic sections of the objects loaded before this library's initialisers ran: for a
/// preload, the program's start-up objects, which glibc's `RTLD_NEXT` searches.
static INITIAL: [AtomicUsize; 512] = [const { AtomicUsize::new(0) }; 512];

#[used]
#[link_section = ".init_array"]
static NOTE_INITIAL: extern "C" fn() = note_initial;

extern "C" fn note_initial() {
    unsafe extern "C" fn note(info: *mut libc::dl_phdr_info, _size: libc::size_t, data: *mut c_void) -> c_int {
        // SAFETY: dl_iterate_phdr's live object, and the counter given below.
        let (info, count) = unsafe { (&*info, &mut *data.cast::<usize>()) };
        if let (Some(key), Some(slot)) = (dynamic_of(info), INITIAL.get(*count)) {
            slot.store(key, Ordering::Relaxed);
            *count += 1;
        }
        0
    }
    let mut count = 0usize;
    // SAFETY: the callback only reads the objects' headers and writes `count` and INITIAL.
    unsafe { libc::dl_iterate_phdr(Some(note), std::ptr::addr_of_mut!(count).cast()) };
}

/// The address of an object's dynamic section: what identifies it here.
fn dynamic_of(info: &libc::dl_phdr_info) -> Option<usize> {
    // SAFETY: as in `Image::of`.
    let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    headers.iter().find(|h| h.p_type == PT_DYNAMIC).map(|h| info.dlpi_addr as usize + h.p_vaddr as usize)
}

fn initial(info: &libc::dl_phdr_info) -> bool {
    dynamic_of(info).is_some_and(|key| INITIAL.iter().take_while(|k| k.load(Ordering::Relaxed) != 0).any(|k| k.load(Ordering::Relaxed) == key))
}

struct Search<'a> {
    name: &'a CStr,
    version: Option<&'a CStr>,
    /// The object whose successors are searched (`None`: every object but `skip`'s).
    after: Option<usize>,
    /// An object never searched (the one containing this address).
    skip: usize,
    passed: bool,
    /// The caller was loaded at start-up: only start-up objects are searched.
    initial_only: bool,
    found: Option<usize>,
}

unsafe extern "C" fn visit_object(info: *mut libc::dl_phdr_info, _size: libc::size_t, data: *mut c_void) -> c_int {
    // SAFETY: dl_iterate_phdr passes the `Search` given to it below and a live object's info.
    let (search, info) = unsafe { (&mut *data.cast::<Search<'_>>(), &*info) };
    if Image::contains(info, search.skip) {
        if search.after.is_some_and(|after| after == search.skip) {
            search.passed = true;
            search.initial_only = initial(info);
        }
        return 0;
    }
    if let Some(after) = search.after {
        if !search.passed {
            search.passed = Image::contains(info, after);
            search.initial_only = search.passed && initial(info);
            return 0;
        }
    }
    if search.initial_only && !initial(info) {
        return 0;
    }
    // SAFETY: the object stays mapped while dl_iterate_phdr holds the loader's lock.
    search.found = unsafe { Image::of(info) }.and_then(|image| image.lookup(search.name, search.version));
    c_int::from(search.found.is_some())
}

fn search(name: &CStr, version: Option<&CStr>, after: Option<usize>, skip: usize) -> Option<usize> {
    let mut search = Search { name, version, after, skip, passed: false, initial_only: false, found: None };
    // SAFETY: the callback only reads the objects' tables and writes `search`, which outlives
    // the call.
    unsafe { libc::dl_iterate_phdr(Some(visit_object), std::ptr::addr_of_mut!(search).cast()) };
    search.found
}

/// The first definition of `name` (of `version`, if given) in the objects listed after the one
/// containing `caller`: what `dlsym(RTLD_NEXT, name)` (`dlvsym(RTLD_NEXT, name, version)`)
/// called from there finds (see the module's note).
pub fn next_definition(caller: usize, name: &CStr, version: Option<&CStr>) -> Option<usize> {
    search(name, version, Some(caller), caller)
}

/// The definition of `name` the C library's own functions would be reached by from this
/// library: the next one after this library, else (when the hook was `dlopen`ed after the C
/// library) the first one in any other object.
pub fn next_after_this_library(name: &CStr) -> Option<usize> {
    let here = next_after_this_library as *const () as usize;
    next_definition(here, name, None).or_else(|| search(name, None, None, here))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dlvsym(RTLD_NEXT, name, version)` called from this test's object (not a tail call).
    #[inline(never)]
    fn glibc_next(name: &CStr, version: &CStr) -> usize {
        // SAFETY: NUL-terminated name and version.
        let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, name.as_ptr(), version.as_ptr()) };
        std::hint::black_box(found) as usize
    }

    /// x86_64 only: the versions named are the C library's there.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn versioned_next_definitions_are_glibcs() {
        let here = versioned_next_definitions_are_glibcs as *const () as usize;
        let cases = [
            // Two versions of one name in the C library: the old (hidden) one and the default.
            (c"realpath", c"GLIBC_2.2.5", true),
            (c"realpath", c"GLIBC_2.3", true),
            (c"sched_setaffinity", c"GLIBC_2.3.3", true),
            (c"sched_setaffinity", c"GLIBC_2.3.4", true),
            // A version the name does not have, and one no object defines.
            (c"realpath", c"GLIBC_2.3.4", false),
            (c"getpid", c"VRAMGUARD_9", false),
        ];
        for (name, version, exists) in cases {
            let ours = next_definition(here, name, Some(version)).unwrap_or(0);
            assert_eq!(ours, glibc_next(name, version), "{name:?} {version:?}");
            assert_eq!(ours != 0, exists, "{name:?} {version:?}");
        }
        // The two versions of realpath are two functions; without a version, the default one.
        let old = next_definition(here, c"realpath", Some(c"GLIBC_2.2.5"));
        let new = next_definition(here, c"realpath", Some(c"GLIBC_2.3"));
        assert_ne!(old, new);
        assert_eq!(next_definition(here, c"realpath", None), new);
    }
}
