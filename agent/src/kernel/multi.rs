//! uprobe_multi links (Linux 6.6 and later): the uprobe programs loaded a second time, for
//! links that put one program on many offsets of a file ([`MultiPrograms`]), and those links
//! made ([`MultiPrograms::attach`]).
//!
//! Why: a perf-event uprobe is removed under the kernel's event mutex, each with a grace period
//! of its own (about 110 ms on 6.18: a libcuda's 28 probes took 3 s to detach, and agents
//! stopping at once queued behind each other's), while a multi link waits for one grace period
//! for all its offsets, outside that mutex, so links closed at once share it. Measured on this
//! project's machines (2 cores, Linux 6.18, the fake libcuda's 17 symbols, nop programs): 28
//! perf events closed in 3.05 s; 10 multi links over the same points in 0.43 s one after
//! another, 0.08 s closed at once ([`super::probes::detach_all`] closes them at once).
//!
//! aya 0.14 loads a uprobe program for perf events only (no expected attach type), so the
//! programs are loaded here from the same object with aya's own object crate, relocated against
//! the maps aya created (the relocations name their descriptors): both forms share every map.
//! A kernel without these links gets perf events. Before 6.6 the kernel loads such programs
//! (it does not check a kprobe program's expected attach type) but refuses their links, so
//! whether it has them is settled by the first link: a refusal where perf events then attach
//! turns the links off for the agent's life ([`MultiPrograms::refused`]); once one link was
//! made, a refusal fails that file like any other failed attach ([`super::probes`]).
use std::{
    collections::HashMap,
    ffi::CStr,
    io,
    mem::size_of,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Map, MapData},
    Ebpf,
};
use aya_obj::{
    generated::{bpf_attach_type, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_type, BPF_F_SLEEPABLE, BPF_F_UPROBE_MULTI_RETURN},
    Object, ProgramSection,
};

/// The verifier's log kept when the kernel refuses a program (its last part is the reason).
const VERIFIER_LOG_BYTES: usize = 256 * 1024;

/// The uprobe programs, loaded for uprobe_multi links.
pub struct MultiPrograms {
    programs: HashMap<&'static str, Loaded>,
    support: Support,
}

/// What the kernel showed of these links.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Support {
    /// Nothing yet.
    Unknown,
    /// It made one: it has them.
    Works,
    /// It refused them where perf events attached: it has none (not tried again).
    Refused,
}

struct Loaded {
    fd: OwnedFd,
    /// A return probe (the link is made with `BPF_F_UPROBE_MULTI_RETURN`).
    returns: bool,
}

impl MultiPrograms {
    /// Loads the programs `names` of `object` (the object `ebpf` was loaded from, before any of
    /// its maps is taken out of it) for uprobe_multi links.
    pub fn load(object: &[u8], ebpf: &Ebpf, names: &[&'static str]) -> Result<MultiPrograms> {
        let mut obj = Object::parse(object).context("cannot parse the embedded eBPF object")?;
        // aya's loader relocates against the kernel's BTF first; an object without BTF
        // relocations (this one) needs none, and one with them is refused rather than half done.
        if obj.has_btf_relocations() {
            bail!("the eBPF object has BTF relocations, which the uprobe_multi loader does not apply");
        }
        let parsed = obj.maps.clone();
        // Every map of the object, each with aya's descriptor: a relocation whose map were
        // missing would fall back to another map of its section (aya-obj checks that only in
        // debug builds), so a map taken out of `ebpf` is an error here.
        let mut maps = Vec::new();
        for (name, map) in ebpf.maps() {
            let parsed = parsed.get(name).ok_or_else(|| anyhow!("the eBPF object has no map `{name}`, which aya created"))?;
            maps.push((name, map_data(map).fd().as_fd().as_raw_fd(), parsed));
        }
        if let Some(missing) = parsed.keys().find(|name| !maps.iter().any(|(have, _, _)| have == name)) {
            bail!("the eBPF map `{missing}` is no longer in the loader (taken out before the uprobe_multi programs were loaded)");
        }
        let text_sections = obj.functions.keys().map(|(section, _)| *section).collect();
        obj.relocate_maps(maps.into_iter(), &text_sections).context("cannot relocate the eBPF object's maps")?;
        obj.relocate_calls(&text_sections).context("cannot relocate the eBPF object's calls")?;
        obj.sanitize_functions(aya::features());
        let mut programs = HashMap::new();
        for &name in names {
            let program = obj.programs.get(name).ok_or_else(|| anyhow!("the embedded eBPF object has no program `{name}`"))?;
            let (returns, sleepable) = match program.section {
                ProgramSection::UProbe { sleepable } => (false, sleepable),
                ProgramSection::URetProbe { sleepable } => (true, sleepable),
                _ => bail!("eBPF program `{name}` is not a uprobe"),
            };
            let function = obj.functions.get(&program.function_key()).ok_or_else(|| anyhow!("eBPF program `{name}` has no code"))?;
            let fd = load_program(name, &function.instructions, &program.license, if sleepable { BPF_F_SLEEPABLE } else { 0 })?;
            programs.insert(name, Loaded { fd, returns });
        }
        Ok(MultiPrograms { programs, support: Support::Unknown })
    }

    /// Whether these links are to be tried (the kernel did not refuse them where perf events
    /// attached).
    pub fn usable(&self) -> bool {
        self.support != Support::Refused
    }

    /// Whether a refusal of these links is the file's (once one was made) rather than the kernel's.
    pub fn known_to_work(&self) -> bool {
        self.support == Support::Works
    }

    /// A link was made: the kernel has them.
    pub fn made(&mut self) {
        self.support = Support::Works;
    }

    /// The kernel refused the links of a file whose perf events then attached: it has none
    /// (unless one was made before); they are not tried again.
    pub fn refused(&mut self) {
        if self.support == Support::Unknown {
            self.support = Support::Refused;
        }
    }

    /// Puts `program` on `offsets` of the file `target` names (for every process), as one link.
    pub fn attach(&self, program: &str, target: &CStr, offsets: &[u64]) -> io::Result<OwnedFd> {
        let loaded = self.programs.get(program).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no program `{program}` loaded for uprobe_multi links")))?;
        let cnt = u32::try_from(offsets.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: bpf_attr is a union of structs of integers, for which all zeros is valid;
        // the fields are written in place (a copied struct's padding need not stay zero, and the
        // kernel refuses an attribute whose bytes past what it knows are not).
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the union's link_create member, every bit pattern of which is valid.
        let create = unsafe { &mut attr.link_create };
        create.__bindgen_anon_1.prog_fd = loaded.fd.as_raw_fd() as u32;
        create.attach_type = bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32;
        // SAFETY: as above, its uprobe_multi member.
        let multi = unsafe { &mut create.__bindgen_anon_3.uprobe_multi };
        multi.path = target.as_ptr() as u64;
        multi.offsets = offsets.as_ptr() as u64;
        multi.cnt = cnt;
        multi.flags = if loaded.returns { BPF_F_UPROBE_MULTI_RETURN } else { 0 };
        // `target` and `offsets` outlive the call, which copies them.
        bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)
    }
}

/// Loads one program for uprobe_multi links; a refusal says the verifier's reason.
fn load_program(name: &str, instructions: &[bpf_insn], license: &CStr, flags: u32) -> Result<OwnedFd> {
    let attempt = |log: &mut [u8]| {
        // SAFETY: bpf_attr is a union of structs of integers, for which all zeros is valid;
        // the fields are written in place (see `attach`).
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the union's program-load member, every bit pattern of which is valid.
        let load = unsafe { &mut attr.__bindgen_anon_3 };
        load.prog_type = bpf_prog_type::BPF_PROG_TYPE_KPROBE as u32;
        load.expected_attach_type = bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32;
        load.insn_cnt = instructions.len() as u32;
        load.insns = instructions.as_ptr() as u64;
        load.license = license.as_ptr() as u64;
        load.prog_flags = flags;
        for (to, from) in load.prog_name.iter_mut().zip(name.bytes().take(15)) {
            *to = from as std::ffi::c_char;
        }
        if !log.is_empty() {
            load.log_level = 1;
            load.log_buf = log.as_mut_ptr() as u64;
            load.log_size = log.len() as u32;
        }
        // The instructions, the license and the log outlive the call.
        bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    };
    match attempt(&mut []) {
        Ok(fd) => Ok(fd),
        Err(error) => {
            let mut log = vec![0u8; VERIFIER_LOG_BYTES];
            if let Ok(fd) = attempt(&mut log) {
                return Ok(fd);
            }
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let tail: Vec<&str> = text.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect();
            Err(anyhow!("the kernel refused to load the eBPF program `{name}` for uprobe_multi links: {error}; the verifier's last lines: {}", tail.join(" | ")))
        }
    }
}

/// The bpf(2) system call `cmd` with `attr`; a new descriptor.
fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a valid bpf_attr of the size given, which the kernel reads (and for
    // some commands writes) only during the call; what its pointers name the caller keeps alive.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd as libc::c_long, attr as *mut bpf_attr, size_of::<bpf_attr>() as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel returned a new descriptor, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The map's data (its descriptor), whatever its type.
fn map_data(map: &Map) -> &MapData {
    match map {
        Map::Array(data)
        | Map::ArrayOfMaps(data)
        | Map::BloomFilter(data)
        | Map::CgroupArray(data)
        | Map::CgroupStorage(data)
        | Map::CgrpStorage(data)
        | Map::CpuMap(data)
        | Map::DevMap(data)
        | Map::DevMapHash(data)
        | Map::HashMap(data)
        | Map::HashOfMaps(data)
        | Map::InodeStorage(data)
        | Map::LpmTrie(data)
        | Map::LruHashMap(data)
        | Map::PerCpuArray(data)
        | Map::PerCpuCgroupStorage(data)
        | Map::PerCpuHashMap(data)
        | Map::PerCpuLruHashMap(data)
        | Map::PerfEventArray(data)
        | Map::ProgramArray(data)
        | Map::Queue(data)
        | Map::ReusePortSockArray(data)
        | Map::RingBuf(data)
        | Map::SockHash(data)
        | Map::SockMap(data)
        | Map::SkStorage(data)
        | Map::Stack(data)
        | Map::StackTraceMap(data)
        | Map::Unsupported(data)
        | Map::XskMap(data) => data,
    }
}
