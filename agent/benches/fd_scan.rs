//! One scan of every process's descriptors for a GPU's device file (issue 23, Numbers: "the
//! cost of one fd scan of /proc at 1,000 processes"), as the driver view makes it to find who
//! holds a GPU's memory no listed process explains and to prove a driver row's process
//! ([`agent::driver::holders::scan`]). The machine is brought to 1,000 processes by `sleep`
//! children of the benchmark (each with its three standard descriptors; one in ten holds the
//! stand-in device file as its stdin); the scan reads every process's `/proc/<pid>/fd`.
//! Run with `cargo bench -p agent --bench fd_scan` (or `cargo xtask bench`).
use std::{
    hint::black_box,
    process::{Child, Command, Stdio},
    time::Duration,
};

use agent::driver::holders::{key_of, scan};
use criterion::{criterion_group, Criterion};

/// Processes on the machine while the scan is measured.
const PROCESSES: usize = 1000;

fn processes_now() -> usize {
    std::fs::read_dir("/proc").map(|d| d.flatten().filter(|e| e.file_name().to_str().is_some_and(|n| n.parse::<u32>().is_ok())).count()).unwrap_or(0)
}

fn bench(c: &mut Criterion) {
    let device = std::env::temp_dir().join(format!("vramguard-bench-fdscan-{}", std::process::id()));
    std::fs::write(&device, b"gpu").expect("write the stand-in device file");
    let key = key_of(&device).expect("key");
    let missing = PROCESSES.saturating_sub(processes_now());
    let mut children: Vec<Child> = Vec::new();
    for i in 0..missing {
        let stdin = if i % 10 == 0 { Stdio::from(std::fs::File::open(&device).expect("open")) } else { Stdio::null() };
        children.push(Command::new("sleep").arg("600").stdin(stdin).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn sleep"));
    }
    let seen = processes_now();
    let found = scan(&[key], 0, Duration::from_secs(60));
    eprintln!("fd_scan: {seen} processes on the machine; one scan read {} of them, {} hold the file", found.processes, found.holders.len());
    c.bench_function(&format!("fd_scan/{seen}_processes"), |b| b.iter(|| black_box(scan(black_box(&[key]), 0, Duration::from_secs(60)))));
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_file(&device);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(10));
    targets = bench
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
