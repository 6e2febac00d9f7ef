//! Ledger benchmarks (issue "The ledger", Measure): the buddy allocator's fragmentation
//! scenarios at 4 GiB with 4 KiB chunks, random mixed reserve/release at 50 % and 90 %
//! occupancy of a 79 GiB space with 2 MiB chunks, and the uncontended and 8-process lock +
//! reserve + release round trip. Run with `cargo bench -p ledger` (or `cargo xtask bench`).
use std::{
    hint::black_box,
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use criterion::{criterion_group, Criterion, Throughput};
use ledger::{
    buddy::{AllocFlags, BuddySpace},
    layout::CREATOR_AGENT,
    Charge, DeviceConfig, Geometry, Ledger, ProcessIdentity, RecordId,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// (a) 65,536 allocations of 8 KiB with 64 KiB alignment, free every other one, then
/// 64 KiB allocations until the space is full.
fn fragmentation_aligned() -> usize {
    let mut space = BuddySpace::new(4 * GIB, 4 * KIB).expect("space");
    let mut held = Vec::with_capacity(65_536);
    for _ in 0..65_536 {
        held.push(space.alloc_blocks(0, 4 * GIB, 8 * KIB, 64 * KIB, AllocFlags::NONE, 0).expect("8 KiB"));
    }
    for blocks in held.iter().step_by(2) {
        space.free_blocks(blocks).expect("free");
    }
    let mut big = 0;
    while big < 65_536 && space.alloc_blocks(0, 4 * GIB, 64 * KIB, 64 * KIB, AllocFlags::NONE, 0).is_ok() {
        big += 1;
    }
    big
}

/// (b) fill the space with single chunks, free every other block, then the rest in reverse.
fn fragmentation_fill_free() -> u64 {
    let mut space = BuddySpace::new(4 * GIB, 4 * KIB).expect("space");
    let mut held = Vec::with_capacity(1 << 20);
    while let Ok(blocks) = space.alloc_blocks(0, 4 * GIB, 4 * KIB, 4 * KIB, AllocFlags::NONE, 0) {
        held.push(blocks);
    }
    for blocks in held.iter().step_by(2) {
        space.free_blocks(blocks).expect("free");
    }
    for blocks in held.iter().skip(1).step_by(2).rev() {
        space.free_blocks(blocks).expect("free");
    }
    space.avail()
}

fn buddy(c: &mut Criterion) {
    let mut group = c.benchmark_group("buddy 4 GiB / 4 KiB");
    group.sample_size(10);
    group.bench_function("fragmentation: 8 KiB @ 64 KiB, free half, 64 KiB", |b| b.iter(|| black_box(fragmentation_aligned())));
    group.bench_function("fill, free every other, free the rest in reverse", |b| b.iter(|| black_box(fragmentation_fill_free())));
    group.finish();
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let path = dir.join(format!("ledger-bench-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        Scratch(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn big_ledger(path: &Path) -> Ledger {
    let geometry = Geometry {
        slots: 64,
        records: 1 << 20,
        devices: vec![DeviceConfig { limit: 79 * GIB, chunk: 2 * MIB, context_reserve: 0, ..Default::default() }],
    };
    Ledger::create(path, &geometry, CREATOR_AGENT).expect("ledger")
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn mixed(c: &mut Criterion) {
    let mut group = c.benchmark_group("ledger 79 GiB / 2 MiB random reserve+release");
    group.throughput(Throughput::Elements(1));
    for occupancy in [50u64, 90] {
        let scratch = Scratch::new(&format!("mixed{occupancy}"));
        let ledger = big_ledger(&scratch.0);
        let slot = ledger.register(ProcessIdentity { pid: 1, pidns: 1, start_time: 1 }).expect("slot");
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ occupancy);
        let target = 79 * GIB * occupancy / 100;
        let mut live: Vec<(RecordId, u64)> = Vec::new();
        let mut used = 0;
        while used < target {
            let size = (1 + rng.next() % 32) * 2 * MIB;
            let record = ledger.reserve(slot, 0, Charge::Device(size), 0).expect("fill");
            live.push((record, size));
            used += size;
        }
        group.bench_function(format!("{occupancy}% occupancy (one op)"), |b| {
            b.iter(|| {
                // Keep occupancy steady: release one, reserve one of a random size.
                if rng.next().is_multiple_of(2) && !live.is_empty() {
                    let index = (rng.next() % live.len() as u64) as usize;
                    let (record, size) = live.swap_remove(index);
                    ledger.release(slot, record).expect("release");
                    used -= size;
                } else {
                    let size = (1 + rng.next() % 32) * 2 * MIB;
                    match ledger.reserve(slot, 0, Charge::Device(size), 0) {
                        Ok(record) if used + size <= target + 64 * MIB => {
                            live.push((record, size));
                            used += size;
                        }
                        Ok(record) => ledger.release(slot, record).expect("release"),
                        Err(_) => {}
                    }
                }
            })
        });
    }
    group.finish();
}

/// Child mode: contend on the ledger at `path` until killed.
fn contend(path: &Path) -> ! {
    let ledger = Ledger::open(path).expect("open");
    let slot = ledger.register(ProcessIdentity::current().expect("identity")).expect("slot");
    loop {
        let record = ledger.reserve(slot, 0, Charge::Device(2 * MIB), 0).expect("reserve");
        ledger.release(slot, record).expect("release");
    }
}

fn round_trip(c: &mut Criterion) {
    let mut group = c.benchmark_group("lock + reserve + release round trip");
    let scratch = Scratch::new("roundtrip");
    let ledger = big_ledger(&scratch.0);
    let slot = ledger.register(ProcessIdentity { pid: 1, pidns: 1, start_time: 1 }).expect("slot");
    group.bench_function("uncontended", |b| {
        b.iter(|| {
            let record = ledger.reserve(slot, 0, Charge::Device(2 * MIB), 0).expect("reserve");
            ledger.release(slot, record).expect("release");
        })
    });
    let exe = std::env::current_exe().expect("bench executable");
    let mut others: Vec<Child> = (0..7)
        .map(|_| Command::new(&exe).env("LEDGER_BENCH_CONTEND", &scratch.0).spawn().expect("contender"))
        .collect();
    // Let the contenders start.
    let start = Instant::now();
    while ledger.slots().expect("slots").len() < 8 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    group.bench_function("8 processes contending", |b| {
        b.iter(|| {
            let record = ledger.reserve(slot, 0, Charge::Device(2 * MIB), 0).expect("reserve");
            ledger.release(slot, record).expect("release");
        })
    });
    for child in &mut others {
        let _ = child.kill();
        let _ = child.wait();
    }
    group.finish();
}

criterion_group!(benches, buddy, mixed, round_trip);

fn main() {
    if let Some(path) = std::env::var_os("LEDGER_BENCH_CONTEND") {
        contend(Path::new(&path));
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
