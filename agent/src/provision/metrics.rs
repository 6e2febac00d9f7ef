//! Provisioning's own counters, kept where they happen and rendered with the agent's page
//! ([`crate::reconcile::metrics::Metrics::register`]):
//!
//! | family | counts |
//! |---|---|
//! | `vramguard_provision_timed_out_total` | creations the runtime was answered about at the NRI deadline, without them (it failed those containers) |
//! | `vramguard_provision_timed_out_removed_total{what}` | what such creations had made and the agent removed at once: `ledger`, `mount` (its tmpfs), `record` |
//! | `vramguard_provision_decisions_without_api_total{decision}` | containers decided without an answer from the Kubernetes API (see [`Decision`]) |
//! | `vramguard_provision_refused_total{reason}` | containers with a quota whose creation the agent failed (see [`Refusal`]) |
//! | `vramguard_dra_containers_refused_total{reason}` | containers refused because the runtime's spec names a DRA claim the agent cannot provision them from (see [`super::claim::Refusal`]) |
//! | `vramguard_dra_unprepared_ledgers_total{result}` | DRA claims' ledgers at unprepare: `removed` (no process of the claim's containers left), `kept` (one may still run: the ledger goes with the claim's last container) |
use prometheus::{core::Collector, IntCounter, IntCounterVec, Opts};

/// How a container was decided when the Kubernetes API gave no answer (down, an error, past
/// the lookup deadline, or not knowing the pod), or while the pod cache's watch is broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The node knew the pod and the container's quota (the pod cache, or its last state on
    /// disk): provisioned with it.
    KnownQuota,
    /// The node knew the pod and that the container has no quota: created untouched.
    KnownNoQuota,
    /// The node knew the container has a quota that cannot be provisioned: refused.
    Refused,
    /// A static pod the node knows nothing of: created untouched.
    StaticPod,
    /// A pod the node knows nothing of: created untouched (fail safe).
    Unknown,
}

impl Decision {
    /// The `decision` label.
    pub fn label(self) -> &'static str {
        match self {
            Decision::KnownQuota => "known_quota",
            Decision::KnownNoQuota => "known_no_quota",
            Decision::Refused => "refused",
            Decision::StaticPod => "static_pod",
            Decision::Unknown => "unknown",
        }
    }
}

/// Why the agent failed the creation of a container with a quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The node holds `--max-provisioned-containers` provisioned containers already.
    NodeCap,
    /// The container's pod holds `--max-provisioned-per-pod` already.
    PodCap,
    /// The provisioned ledgers would take more than `--max-ledger-memory`.
    LedgerMemory,
    /// A GPU's quotas would exceed its memory (`--refuse-overcommit`).
    Overcommit,
}

impl Refusal {
    pub const ALL: [Refusal; 4] = [Refusal::NodeCap, Refusal::PodCap, Refusal::LedgerMemory, Refusal::Overcommit];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::NodeCap => "node_cap",
            Refusal::PodCap => "pod_cap",
            Refusal::LedgerMemory => "ledger_memory",
            Refusal::Overcommit => "overcommit",
        }
    }
}

/// What a timed-out creation had made, as it was removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub ledger: bool,
    pub mount: bool,
    pub record: bool,
}

/// Provisioning's counters.
#[derive(Clone)]
pub struct Counters {
    timed_out: IntCounter,
    removed: IntCounterVec,
    without_api: IntCounterVec,
    refused: IntCounterVec,
    claim_refused: IntCounterVec,
    unprepared_ledgers: IntCounterVec,
}

impl Counters {
    pub fn new() -> Result<Counters, prometheus::Error> {
        Ok(Counters {
            timed_out: IntCounter::new(
                "vramguard_provision_timed_out_total",
                "Container creations answered at the NRI deadline without their provisioning (the runtime failed them)",
            )?,
            removed: IntCounterVec::new(
                Opts::new(
                    "vramguard_provision_timed_out_removed_total",
                    "What timed-out creations had made and the agent removed (ledger, mount, record)",
                ),
                &["what"],
            )?,
            without_api: IntCounterVec::new(
                Opts::new(
                    "vramguard_provision_decisions_without_api_total",
                    "Containers decided without an answer from the Kubernetes API, by decision",
                ),
                &["decision"],
            )?,
            refused: {
                let refused = IntCounterVec::new(
                    Opts::new("vramguard_provision_refused_total", "Containers with a quota whose creation the agent failed, by reason"),
                    &["reason"],
                )?;
                // Every reason on the page from the start, at 0.
                for reason in Refusal::ALL {
                    refused.with_label_values(&[reason.label()]);
                }
                refused
            },
            claim_refused: IntCounterVec::new(
                Opts::new(
                    "vramguard_dra_containers_refused_total",
                    "Containers refused because their spec names a DRA claim they cannot be provisioned from, by reason",
                ),
                &["reason"],
            )?,
            unprepared_ledgers: {
                let ledgers = IntCounterVec::new(
                    Opts::new(
                        "vramguard_dra_unprepared_ledgers_total",
                        "DRA claims' ledgers at unprepare: removed (no process of the claim's containers left), kept (one may still run)",
                    ),
                    &["result"],
                )?;
                for result in ["removed", "kept"] {
                    ledgers.with_label_values(&[result]);
                }
                ledgers
            },
        })
    }

    /// The families, for the agent's page.
    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.timed_out.clone()),
            Box::new(self.removed.clone()),
            Box::new(self.without_api.clone()),
            Box::new(self.refused.clone()),
            Box::new(self.claim_refused.clone()),
            Box::new(self.unprepared_ledgers.clone()),
        ]
    }

    pub(super) fn timed_out(&self) {
        self.timed_out.inc();
    }

    pub(super) fn removed(&self, removed: Removed) {
        for (what, was) in [("ledger", removed.ledger), ("mount", removed.mount), ("record", removed.record)] {
            if was {
                self.removed.with_label_values(&[what]).inc();
            }
        }
    }

    pub(super) fn decided(&self, decision: Decision) {
        self.without_api.with_label_values(&[decision.label()]).inc();
    }

    pub(super) fn refused(&self, refusal: Refusal) {
        self.refused.with_label_values(&[refusal.label()]).inc();
    }

    /// Creations refused so far for `refusal`.
    pub fn refused_total(&self, refusal: Refusal) -> u64 {
        self.refused.with_label_values(&[refusal.label()]).get()
    }

    pub(super) fn claim_refused(&self, reason: &str) {
        self.claim_refused.with_label_values(&[reason]).inc();
    }

    /// Containers refused for their DRA claim so far, for `reason`.
    pub fn claim_refused_total(&self, reason: &str) -> u64 {
        self.claim_refused.with_label_values(&[reason]).get()
    }

    pub(super) fn unprepared_ledger(&self, result: &str) {
        self.unprepared_ledgers.with_label_values(&[result]).inc();
    }

    /// DRA claims' ledgers unprepare `removed` or `kept` so far.
    pub fn unprepared_ledgers_total(&self, result: &str) -> u64 {
        self.unprepared_ledgers.with_label_values(&[result]).get()
    }

    /// Timed-out creations so far.
    pub fn timed_out_total(&self) -> u64 {
        self.timed_out.get()
    }

    /// What timed-out creations made and was removed: ledgers, mounts, records.
    pub fn removed_totals(&self) -> [u64; 3] {
        ["ledger", "mount", "record"].map(|what| self.removed.with_label_values(&[what]).get())
    }

    /// Decisions made without the API so far, of `decision`.
    pub fn decided_total(&self, decision: Decision) -> u64 {
        self.without_api.with_label_values(&[decision.label()]).get()
    }
}
