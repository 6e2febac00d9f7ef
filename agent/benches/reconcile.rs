//! The agent's reconcile pass (issue "The agent", Measure: a pass over 100 ledgers x 1024
//! slots, target under 10 ms). 100 ledger files of 1024 slots each, with every slot live
//! (102,400 processes: the worst case) or 8 per ledger (800 processes), each slot with one
//! allocation, and an eBPF view with one process per live slot (each in its container's
//! cgroup): the pass joins every slot with its process, judges every process and sums what
//! each container holds outside its ledger. The processes are not real, so their identities are
//! given to the reconciler as its /proc look-ups would have found them (a running agent reads
//! each once per process, see `reconcile`'s module doc); what is measured is the steady
//! state: the ledgers read under their locks, the join, the judging.
//! The metrics page the event loop renders for `--metrics-addr` (when a scrape finds it older
//! than the last pass: at most once per pass) is measured on the 800-process node: the
//! families rebuilt from the ledgers, the eBPF rows and the verdicts, then encoded.
//! Run with `cargo bench -p agent` (or `cargo xtask bench`).
use std::{hint::black_box, path::PathBuf};

use agent::{
    ledgers::Ledgers,
    reconcile::metrics::Metrics,
    reconcile::{Config, EbpfProcess, Reconciler},
    snapshot::{ProcessRow, Snapshot},
};
use criterion::{criterion_group, Criterion};
use ledger::{layout::CREATOR_AGENT, Charge, DeviceConfig, Geometry, Ledger, ProcessIdentity};

const LEDGERS: u32 = 100;
const SLOTS: u32 = 1024;
const MIB: u64 = 1 << 20;

struct Node {
    dir: PathBuf,
    ledgers: Ledgers,
    ebpf: Vec<EbpfProcess>,
    identities: Vec<(u32, ProcessIdentity)>,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn node(live: u32) -> Node {
    let dir = std::env::temp_dir().join(format!("vramguard-bench-reconcile-{}-{live}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let geometry = Geometry {
        slots: SLOTS,
        records: 2 * SLOTS,
        devices: vec![DeviceConfig { limit: 80 << 30, chunk: 2 * MIB, context_reserve: 0, ..Default::default() }],
    };
    let (mut ebpf, mut identities) = (Vec::new(), Vec::new());
    for container in 0..LEDGERS {
        let path = dir.join(format!("pod-{container}/ledger"));
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        let ledger = Ledger::create(&path, &geometry, CREATOR_AGENT).expect("create");
        for index in 0..live {
            let identity = ProcessIdentity { pid: index + 1, pidns: 4_000_000 + u64::from(container), start_time: 1 };
            let slot = ledger.register(identity).expect("register");
            let bytes = 2 * MIB + u64::from(index % 32) * 2 * MIB;
            ledger.reserve(slot, 0, Charge::Device(bytes), 0x1000).expect("reserve");
            let host_pid = 10_000_000 + container * SLOTS + index;
            ledger.set_host_pid(slot, host_pid);
            ebpf.push(EbpfProcess { pid: host_pid, generation: 1, cgroup_id: 1_000 + u64::from(container), bytes, pool_kept: 0 });
            identities.push((host_pid, identity));
        }
    }
    let mut ledgers = Ledgers::new(dir.clone());
    ledgers.scan();
    assert_eq!(ledgers.len(), LEDGERS as usize);
    Node { dir, ledgers, ebpf, identities }
}

fn reconcile_pass(c: &mut Criterion) {
    let mut group = c.benchmark_group("reconcile");
    group.sample_size(20);
    for live in [SLOTS, 8] {
        let node = node(live);
        let mut reconciler = Reconciler::new(Config::default());
        for (pid, identity) in &node.identities {
            reconciler.know(*pid, 1, *identity);
        }
        reconciler.pass(Some(&node.ledgers), &node.ebpf);
        let joined = reconciler.verdicts().iter().filter(|v| v.ledger.is_some() && v.ebpf_bytes > 0).count();
        assert_eq!(joined, (LEDGERS * live) as usize, "every slot joined with its process");
        let name = format!("pass, {LEDGERS} ledgers x {SLOTS} slots, {} processes", LEDGERS * live);
        group.bench_function(name, |b| {
            b.iter(|| {
                reconciler.pass(Some(&node.ledgers), black_box(&node.ebpf));
                black_box(reconciler.unaccounted_by_ledger());
            })
        });
    }
    group.finish();
}

fn metrics_page(c: &mut Criterion) {
    let node = node(8);
    let mut reconciler = Reconciler::new(Config::default());
    for (pid, identity) in &node.identities {
        reconciler.know(*pid, 1, *identity);
    }
    reconciler.pass(Some(&node.ledgers), &node.ebpf);
    let snapshot = Snapshot {
        processes: node
            .ebpf
            .iter()
            .map(|p| ProcessRow { pid: p.pid, cgroup: format!("/kubepods/pod-{}", p.cgroup_id), total_bytes: p.bytes, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let mut metrics = Metrics::new(false).expect("metrics");
    let charged = Default::default();
    c.bench_function(&format!("metrics page, {LEDGERS} ledgers, {} processes", node.ebpf.len()), |b| {
        b.iter(|| {
            metrics.refresh(Some(&node.ledgers), black_box(&snapshot), &reconciler, &charged);
            black_box(metrics.encode().expect("encode").len())
        })
    });
}

criterion_group!(benches, reconcile_pass, metrics_page);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
