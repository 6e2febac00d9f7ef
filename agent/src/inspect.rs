//! `vramguard inspect <ledger>` (what a ledger file holds, and whether its invariants hold)
//! and `vramguard reclaim <ledger>` (free the slots of processes that are gone; never those of
//! a live process).
use std::{fmt::Write as _, path::Path};

use anyhow::{bail, Context, Result};
use ledger::{layout::KINDS, Kind, Ledger};
use serde::Serialize;

use crate::{
    identity,
    ledgers::{open_no_follow, LedgerHandle, Limits},
    snapshot::human,
};

#[derive(Serialize)]
struct Report {
    path: String,
    version: u32,
    creator: &'static str,
    created_unix_secs: u64,
    slot_capacity: u32,
    record_capacity: u32,
    repairs: u64,
    devices: Vec<DeviceReport>,
    slots: Vec<SlotReport>,
    records: Vec<RecordReport>,
    /// Invariant violations found by `check()`; empty when the ledger is sound.
    violations: Vec<String>,
}

#[derive(Serialize)]
struct DeviceReport {
    index: usize,
    uuid: String,
    limit_bytes: u64,
    chunk_bytes: u64,
    context_reserve_bytes: u64,
    used_bytes: u64,
    rejections: u64,
}

#[derive(Serialize)]
struct SlotReport {
    slot: u32,
    pid: u32,
    pid_namespace: u64,
    start_time: u64,
    /// The process's pid on this host, `None` when it is gone.
    host_pid: Option<u32>,
    allocs: u64,
    frees: u64,
    rejections: u64,
    /// Per device: live bytes and charged bytes by kind.
    devices: Vec<SlotDeviceReport>,
}

#[derive(Serialize)]
struct SlotDeviceReport {
    device: usize,
    bytes: std::collections::BTreeMap<&'static str, u64>,
    charged_bytes: std::collections::BTreeMap<&'static str, u64>,
}

#[derive(Serialize)]
struct RecordReport {
    record: u32,
    slot: u32,
    device: u32,
    kind: &'static str,
    pool: bool,
    ptr: String,
    bytes: u64,
    charged_bytes: u64,
}

fn report(path: &Path) -> Result<Report> {
    // A private copy: the file is its workload's to write while this (root) command reads it.
    let file = open_no_follow(path, false).with_context(|| format!("cannot open the ledger {}", path.display()))?;
    if !file.metadata()?.is_file() {
        bail!("{} is not a regular file", path.display());
    }
    let ledger = Ledger::private_copy(&file, path, crate::ledgers::Limits::default().max_bytes)
        .with_context(|| format!("cannot read the ledger {}", path.display()))?;
    let header = *ledger.header();
    let usage = ledger.device_usage()?;
    let devices = (0..header.device_count as usize)
        .map(|index| {
            let config = header.devices[index];
            DeviceReport {
                index,
                uuid: uuid_text(&config.uuid),
                limit_bytes: config.limit,
                chunk_bytes: config.chunk,
                context_reserve_bytes: config.context_reserve,
                used_bytes: usage[index].used_chunks * config.chunk,
                rejections: usage[index].rejections,
            }
        })
        .collect();
    let slots = ledger
        .slots()?
        .into_iter()
        .map(|view| {
            let slot = view.slot;
            let devices = (0..header.device_count as usize)
                .filter(|&d| slot.devices[d].bytes.iter().chain(&slot.devices[d].chunks).any(|&v| v != 0))
                .map(|d| {
                    let per = &slot.devices[d];
                    let chunk = header.devices[d].chunk;
                    SlotDeviceReport {
                        device: d,
                        bytes: (0..KINDS).map(|k| (Kind::ALL[k].name(), per.bytes[k])).collect(),
                        charged_bytes: (0..KINDS).map(|k| (Kind::ALL[k].name(), per.chunks[k] * chunk)).collect(),
                    }
                })
                .collect();
            SlotReport {
                slot: view.id,
                pid: slot.pid,
                pid_namespace: slot.pidns,
                start_time: slot.start_time,
                host_pid: identity::host_pid(&slot),
                allocs: slot.allocs,
                frees: slot.frees,
                rejections: slot.rejections,
                devices,
            }
        })
        .collect();
    let records = ledger
        .records()?
        .into_iter()
        .map(|(id, record)| RecordReport {
            record: id,
            slot: record.slot,
            device: record.device,
            kind: Kind::from_u32(record.kind).map_or("unknown", Kind::name),
            pool: record.state == ledger::layout::RECORD_POOL,
            ptr: format!("{:#x}", record.ptr),
            bytes: record.bytes,
            charged_bytes: header.devices.get(record.device as usize).map_or(0, |d| record.chunks * d.chunk),
        })
        .collect();
    Ok(Report {
        path: path.display().to_string(),
        version: header.version,
        creator: match header.creator {
            ledger::layout::CREATOR_AGENT => "agent",
            ledger::layout::CREATOR_HOOK => "hook",
            _ => "unknown",
        },
        created_unix_secs: header.created_unix_secs,
        slot_capacity: header.slot_count,
        record_capacity: header.record_count,
        repairs: ledger.repairs()?,
        devices,
        slots,
        records,
        violations: ledger.check()?,
    })
}

/// A device UUID as `nvidia-smi` prints it; empty when the ledger does not know it (zero).
pub(crate) fn uuid_text(uuid: &[u8; 16]) -> String {
    if uuid == &[0; 16] {
        return String::new();
    }
    cuda_abi::gpu_uuid_text(uuid)
}

/// `vramguard inspect`.
pub fn inspect(path: &Path, json: bool) -> Result<()> {
    let report = report(path)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    if !report.violations.is_empty() {
        bail!("the ledger {} violates {} invariant(s)", path.display(), report.violations.len());
    }
    Ok(())
}

fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ledger {} (layout v{}, created by the {}, {} slots, {} records, {} repairs)",
        report.path, report.version, report.creator, report.slot_capacity, report.record_capacity, report.repairs
    );
    for d in &report.devices {
        let _ = writeln!(
            out,
            "device {} {}: {} of {} used (chunk {}, context reserve {}), {} refused",
            d.index,
            d.uuid,
            human(d.used_bytes),
            human(d.limit_bytes),
            human(d.chunk_bytes),
            human(d.context_reserve_bytes),
            d.rejections
        );
    }
    let _ = writeln!(out, "{:>5} {:>8} {:>9} {:>7} {:>7} {:>8}  charged", "SLOT", "PID", "HOST PID", "ALLOCS", "FREES", "REFUSED");
    for s in &report.slots {
        let charged: u64 = s.devices.iter().flat_map(|d| d.charged_bytes.values()).sum();
        let host = s.host_pid.map_or("gone".to_string(), |p| p.to_string());
        let _ = writeln!(out, "{:>5} {:>8} {:>9} {:>7} {:>7} {:>8}  {}", s.slot, s.pid, host, s.allocs, s.frees, s.rejections, human(charged));
    }
    let _ = writeln!(out, "{} live records", report.records.len());
    if report.violations.is_empty() {
        let _ = writeln!(out, "check: ok");
    } else {
        for v in &report.violations {
            let _ = writeln!(out, "check: VIOLATION: {v}");
        }
    }
    out
}

/// `vramguard reclaim`: frees the slots whose processes are gone (or only `only`, which
/// must then be gone).
pub fn reclaim(path: &Path, only: Option<u32>) -> Result<()> {
    if !identity::in_initial_pid_namespace() {
        bail!(
            "vramguard reclaim must run in the host's pid namespace (as the agent does, hostPID): \
             from here a running process of another namespace looks dead, and its slot would be freed"
        );
    }
    // The locked part runs in a confined worker, as in the agent.
    let ledger = LedgerHandle::open(path, &Limits::default()).map_err(|reason| anyhow::anyhow!("{} is not a ledger this tool works on: {reason}", path.display()))?;
    let slots = ledger.slots()?;
    if let Some(wanted) = only {
        let Some(view) = slots.iter().find(|v| v.id == wanted) else {
            bail!("slot {wanted} is not a live slot of {}", path.display());
        };
        if let Some(host) = identity::host_pid(&view.slot) {
            bail!("slot {wanted} belongs to a running process (host pid {host}): refusing to reclaim it");
        }
    }
    let mut reclaimed = 0;
    for view in slots.iter().filter(|v| only.is_none_or(|w| w == v.id)) {
        if identity::host_pid(&view.slot).is_some() {
            continue; // alive: never reclaimed
        }
        let process = view.slot.process();
        // Only if the slot still describes the process judged dead (checked under the lock).
        let Some(chunks) = ledger.reclaim_process(view.id, process)? else { continue };
        println!("reclaimed slot {} (pid {} in its namespace): {} chunks", view.id, view.slot.pid, chunks);
        reclaimed += 1;
    }
    println!("{reclaimed} slot(s) reclaimed from {}", path.display());
    Ok(())
}
