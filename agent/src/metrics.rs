//! The agent's Prometheus metrics (served on `--metrics-addr` by [`crate::http`]).
//!
//! Per ledger and device (labels `ledger`, the file's path, `device_index`, `device_uuid`,
//! empty when the ledger does not know it): `vramguard_container_memory_used_bytes` (what the
//! ledger charges, by `kind`: data, small, context, managed; the kinds sum to the device's
//! usage) and `vramguard_container_memory_limit_bytes`. From the eBPF view:
//! `vramguard_ebpf_process_memory_bytes{pid,cgroup}`. From [`crate::reconcile`]:
//! `vramguard_process_state{pid,state}` (one series per state, 1 for the process's current
//! one), `vramguard_unhooked_processes`, `vramguard_container_ebpf_memory_bytes{ledger}` (the
//! eBPF bytes of the ledger's processes, comparable with the ledger's data, small and managed
//! bytes) and `vramguard_container_rejections_total{ledger,device_index}` (the ledger's own
//! count of refused reservations). Of the agent itself:
//! `vramguard_reclaims_total`, `vramguard_reclaim_latency_seconds`,
//! `vramguard_events_lost_total`, `vramguard_over_limit_allocations_total`,
//! `vramguard_enforcement_signals_total`, `vramguard_probes_attached{libcuda}`, `vramguard_ledgers`,
//! `vramguard_ledgers_skipped`. Gauges are rebuilt from the current state at every scrape.
use std::{collections::BTreeSet, time::Duration};

use anyhow::{Context, Result};
use ledger::{layout::KINDS, Kind};
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use tracing::warn;

use crate::{
    inspect::uuid_text,
    ledgers::Ledgers,
    probes::AttachReport,
    reconcile::{Reconciler, State},
    snapshot::Snapshot,
};

/// Latency buckets of a reclaim, in seconds (1 ms to 5 s).
const LATENCY_BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

pub struct Metrics {
    registry: Registry,
    used: IntGaugeVec,
    limit: IntGaugeVec,
    ebpf_process: IntGaugeVec,
    reclaims: IntCounter,
    latency: Histogram,
    events_lost: IntCounter,
    over_limit: IntCounter,
    signals: IntCounter,
    probes: IntGaugeVec,
    ledgers: IntGauge,
    ledgers_skipped: IntGauge,
    process_state: IntGaugeVec,
    unhooked: IntGauge,
    container_ebpf: IntGaugeVec,
    rejections: IntCounterVec,
    /// The (ledger, device index) label pairs `rejections` has series for.
    rejection_series: BTreeSet<(String, String)>,
}

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec> {
    let gauge = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(gauge.clone())).with_context(|| format!("registering {name}"))?;
    Ok(gauge)
}

/// A byte count as a gauge value.
fn value(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn new() -> Result<Metrics> {
        let registry = Registry::new();
        let used = gauge_vec(
            &registry,
            "vramguard_container_memory_used_bytes",
            "GPU memory a container's ledger charges, by kind",
            &["ledger", "device_index", "device_uuid", "kind"],
        )?;
        let limit = gauge_vec(
            &registry,
            "vramguard_container_memory_limit_bytes",
            "GPU memory quota of a container's ledger",
            &["ledger", "device_index", "device_uuid"],
        )?;
        let ebpf_process = gauge_vec(
            &registry,
            "vramguard_ebpf_process_memory_bytes",
            "GPU memory a process holds as the eBPF probes saw it",
            &["pid", "cgroup"],
        )?;
        let probes = gauge_vec(&registry, "vramguard_probes_attached", "Probes attached per libcuda file", &["libcuda"])?;
        let reclaims = IntCounter::new("vramguard_reclaims_total", "Ledger slots of dead processes reclaimed")?;
        registry.register(Box::new(reclaims.clone()))?;
        let latency = Histogram::with_opts(
            HistogramOpts::new(
                "vramguard_reclaim_latency_seconds",
                "From a process's exit event (or the sweep that found it dead) to its slot reclaimed",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        registry.register(Box::new(latency.clone()))?;
        let events_lost = IntCounter::new("vramguard_events_lost_total", "eBPF events lost to a full ring buffer")?;
        registry.register(Box::new(events_lost.clone()))?;
        let over_limit = IntCounter::new(
            "vramguard_over_limit_allocations_total",
            "Allocations by un-hooked workloads that would pass their cgroup's limit (limits file)",
        )?;
        registry.register(Box::new(over_limit.clone()))?;
        let signals = IntCounter::new("vramguard_enforcement_signals_total", "Signals sent to stop allocations over a cgroup's limit")?;
        registry.register(Box::new(signals.clone()))?;
        let ledgers = IntGauge::new("vramguard_ledgers", "Ledgers watched under --ledger-dir")?;
        registry.register(Box::new(ledgers.clone()))?;
        let ledgers_skipped =
            IntGauge::new("vramguard_ledgers_skipped", "Files under --ledger-dir skipped as invalid ledgers")?;
        registry.register(Box::new(ledgers_skipped.clone()))?;
        let process_state = gauge_vec(
            &registry,
            "vramguard_process_state",
            "Reconciliation state of a process (1 for its current state): ok, drift, unhooked, stale, tampered",
            &["pid", "state"],
        )?;
        let unhooked = IntGauge::new("vramguard_unhooked_processes", "Processes holding GPU memory without a ledger slot")?;
        registry.register(Box::new(unhooked.clone()))?;
        let container_ebpf = gauge_vec(
            &registry,
            "vramguard_container_ebpf_memory_bytes",
            "GPU memory the eBPF probes saw a container's (ledger's) processes hold",
            &["ledger"],
        )?;
        let rejections = IntCounterVec::new(
            Opts::new("vramguard_container_rejections_total", "Reservations a container's ledger refused"),
            &["ledger", "device_index"],
        )?;
        registry.register(Box::new(rejections.clone()))?;
        Ok(Metrics {
            registry,
            used,
            limit,
            ebpf_process,
            reclaims,
            latency,
            events_lost,
            over_limit,
            signals,
            probes,
            ledgers,
            ledgers_skipped,
            process_state,
            unhooked,
            container_ebpf,
            rejections,
            rejection_series: BTreeSet::new(),
        })
    }

    /// Counts one reclaim.
    pub fn reclaimed(&self, latency: Duration) {
        self.reclaims.inc();
        self.latency.observe(latency.as_secs_f64());
    }

    /// Rebuilds the gauges from the current state.
    pub fn refresh(&mut self, ledgers: Option<&Ledgers>, snapshot: &Snapshot, probes: &[AttachReport], reconciler: &Reconciler) {
        self.used.reset();
        self.limit.reset();
        self.container_ebpf.reset();
        let ebpf_by_ledger = reconciler.ebpf_bytes_by_ledger();
        let mut rejection_series = BTreeSet::new();
        if let Some(ledgers) = ledgers {
            self.ledgers.set(ledgers.len() as i64);
            self.ledgers_skipped.set(ledgers.skipped() as i64);
            for (path, ledger) in ledgers.iter() {
                let header = ledger.header();
                let slots = match ledger.slots() {
                    Ok(slots) => slots,
                    Err(error) => {
                        warn!(ledger = %path.display(), %error, "cannot read the ledger for metrics");
                        continue;
                    }
                };
                let path = path.display().to_string();
                self.container_ebpf
                    .with_label_values(&[path.as_str()])
                    .set(value(ebpf_by_ledger.get(path.as_str()).copied().unwrap_or(0)));
                match ledger.device_usage() {
                    Ok(usage) => {
                        for (index, device) in usage.iter().enumerate() {
                            let key = (path.clone(), index.to_string());
                            self.set_rejections(&key, device.rejections);
                            rejection_series.insert(key);
                        }
                    }
                    Err(error) => warn!(ledger = %path, %error, "cannot read the ledger's device usage for metrics"),
                }
                for (index, device) in header.devices[..header.device_count as usize].iter().enumerate() {
                    let index_text = index.to_string();
                    let uuid = uuid_text(&device.uuid);
                    self.limit.with_label_values(&[path.as_str(), &index_text, &uuid]).set(value(device.limit));
                    let mut chunks = [0u64; KINDS];
                    for view in &slots {
                        for (sum, charged) in chunks.iter_mut().zip(view.slot.devices[index].chunks) {
                            *sum = sum.saturating_add(charged);
                        }
                    }
                    for kind in Kind::ALL {
                        let bytes = chunks[kind as usize].saturating_mul(device.chunk);
                        self.used.with_label_values(&[path.as_str(), &index_text, &uuid, kind.name()]).set(value(bytes));
                    }
                }
            }
        }
        for (ledger, index) in self.rejection_series.difference(&rejection_series) {
            let _ = self.rejections.remove_label_values(&[ledger.as_str(), index.as_str()]);
        }
        self.rejection_series = rejection_series;
        self.process_state.reset();
        for verdict in reconciler.verdicts() {
            let pid = verdict.pid.to_string();
            for state in State::ALL {
                self.process_state.with_label_values(&[pid.as_str(), state.name()]).set(i64::from(state == verdict.state));
            }
        }
        self.unhooked.set(reconciler.verdicts().iter().filter(|v| v.state == State::Unhooked).count() as i64);
        self.ebpf_process.reset();
        for row in &snapshot.processes {
            self.ebpf_process.with_label_values(&[row.pid.to_string().as_str(), &row.cgroup]).set(value(row.total_bytes));
        }
        // The kernel keeps these counts; the counters catch up with them.
        for (counter, total) in [
            (&self.events_lost, snapshot.stats.events_lost),
            (&self.over_limit, snapshot.stats.over_limit),
            (&self.signals, snapshot.stats.signals_sent),
        ] {
            let counted = counter.get();
            if total > counted {
                counter.inc_by(total - counted);
            }
        }
        self.probes.reset();
        for report in probes {
            self.probes.with_label_values(&[report.path.as_str()]).set(report.attached.len() as i64);
        }
    }

    /// Brings the rejection counter of (ledger, device index) to the ledger's count (a
    /// ledger replaced at the same path may count from lower: its series starts over).
    fn set_rejections(&self, (ledger, index): &(String, String), total: u64) {
        let labels = [ledger.as_str(), index.as_str()];
        let counted = self.rejections.with_label_values(&labels).get();
        if total < counted {
            let _ = self.rejections.remove_label_values(&labels);
            self.rejections.with_label_values(&labels).inc_by(total);
        } else {
            self.rejections.with_label_values(&labels).inc_by(total - counted);
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> Result<String> {
        Ok(TextEncoder::new().encode_to_string(&self.registry.gather())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::Observation;

    #[test]
    fn encodes_every_family() {
        let mut metrics = Metrics::new().expect("metrics");
        metrics.reclaimed(Duration::from_millis(3));
        let probes = [AttachReport { path: "/lib/libcuda.so.1".into(), attached: vec!["a".into(), "b".into()], ..Default::default() }];
        let mut reconciler = Reconciler::new(Default::default());
        let seen = |pid, ebpf_bytes| Observation { pid, ledger: None, ledger_bytes: None, ebpf_bytes, gone: false };
        reconciler.judge(vec![seen(41, 1 << 20), seen(42, 0)], std::time::Instant::now());
        metrics.refresh(None, &Snapshot::default(), &probes, &reconciler);
        let text = metrics.encode().expect("encode");
        assert!(text.contains("vramguard_reclaims_total 1"), "{text}");
        assert!(text.contains("vramguard_reclaim_latency_seconds_bucket{le=\"0.005\"} 1"), "{text}");
        assert!(text.contains("vramguard_probes_attached{libcuda=\"/lib/libcuda.so.1\"} 2"), "{text}");
        assert!(text.contains("vramguard_events_lost_total 0"), "{text}");
        assert!(text.contains("vramguard_process_state{pid=\"41\",state=\"unhooked\"} 1"), "{text}");
        assert!(text.contains("vramguard_process_state{pid=\"41\",state=\"ok\"} 0"), "{text}");
        assert!(text.contains("vramguard_process_state{pid=\"42\",state=\"ok\"} 1"), "{text}");
        assert!(text.contains("vramguard_unhooked_processes 1"), "{text}");
    }
}
