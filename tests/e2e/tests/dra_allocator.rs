//! The tests' scheduler stand-in (`tests/allocator/`) against the slices the agent publishes
//! (issue 25: "the allocator fills 4 fake GPUs of 80 GiB with claims of mixed sizes"): every
//! claim lands on a GPU with room, no GPU's allocated sum exceeds its capacity, a claim too big
//! for any GPU is unschedulable and nothing is over-committed, over random sequences of claims
//! and releases (proptest). The rounding is checked against the published policy's numbers
//! computed here, not through the function the allocator shares with the agent.
use std::collections::{BTreeMap, BTreeSet};

use agent::{
    dra::{policy::Settings, slices::build},
    inventory::from_flag,
};
mod allocator;

use allocator::{claim, Allocator, Refused};
use proptest::prelude::*;
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// Each fake GPU's memory, all of it shareable (no reserve).
const GPU: u64 = 80 * GIB;

/// The agent's pool for four 80 GiB GPUs, as JSON on the wire.
fn published() -> Vec<Value> {
    let (slices, _) = build("node-a", &from_flag(&[GPU; 4], 0), &Settings::default(), 1);
    slices.iter().map(|s| serde_json::to_value(s).expect("json")).collect()
}

/// The default policy's rounding, from its numbers: min 1 GiB, step 256 MiB, default the GPU.
fn expected(request: Option<u64>) -> Option<u64> {
    let value = match request {
        None => GPU,
        Some(r) if r <= GIB => GIB,
        Some(r) => GIB + (r - GIB).div_ceil(256 * MIB) * 256 * MIB,
    };
    (value <= GPU).then_some(value)
}

fn consumer(uid: &str) -> Value {
    json!({"resource": "pods", "name": format!("pod-{uid}"), "uid": format!("pod-{uid}")})
}

/// (device, bytes) of an allocated claim's single result, checked for its shape.
fn result_of(claim: &Value, uid: &str) -> (String, u64) {
    let results = claim["status"]["allocation"]["devices"]["results"].as_array().expect("results");
    assert_eq!(results.len(), 1, "{claim}");
    let r = &results[0];
    assert_eq!(r["request"], "gpu");
    assert_eq!(r["driver"], "gpu.vramguard.io");
    assert_eq!(r["pool"], "node-a");
    let share = r["shareID"].as_str().expect("shareID");
    assert!(share.len() == 36 && share.chars().filter(|c| *c == '-').count() == 4 && share.as_bytes()[14] == b'4', "{share}");
    assert_eq!(claim["status"]["reservedFor"], json!([consumer(uid)]));
    assert_eq!(claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"], json!(["node-a"]));
    let bytes = agent::provision::kube::parse_quantity(r["consumedCapacity"]["memory"].as_str().expect("consumed")).expect("bytes");
    (r["device"].as_str().expect("device").to_owned(), bytes)
}

#[test]
fn claims_of_mixed_sizes_fill_four_gpus_and_the_one_too_many_is_unschedulable() {
    let mut allocator = Allocator::new(&published()).expect("the pool");
    assert_eq!(allocator.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    let mut on: BTreeMap<String, u64> = BTreeMap::new();
    // Per GPU: 30 + 30 + 12 + 7.9 (→ 8) = 80 GiB, exactly full.
    let sizes = ["30Gi", "30Gi", "12Gi", "8089Mi"];
    for gpu in 0..4 {
        for (k, size) in sizes.iter().enumerate() {
            let uid = format!("c{gpu}-{k}");
            let allocated = allocator.allocate(&claim("ns", &uid, &uid, Some(size)), &consumer(&uid)).expect("valid").expect("room");
            let (device, bytes) = result_of(&allocated, &uid);
            *on.entry(device).or_default() += bytes;
        }
    }
    assert_eq!(on.values().copied().collect::<Vec<_>>(), [GPU; 4], "{on:?}");
    // Full: even the smallest share is refused, and nothing is recorded for it.
    let refused = allocator.allocate(&claim("ns", "late", "late", Some("1")), &consumer("late")).expect("valid");
    assert_eq!(refused, Err(Refused::Unschedulable { request: "gpu".into() }));
    // A release frees its share for the next claim, on that GPU.
    assert!(allocator.release("c2-2"));
    let next = allocator.allocate(&claim("ns", "next", "next", Some("12Gi")), &consumer("next")).expect("valid").expect("room");
    assert_eq!(result_of(&next, "next"), ("gpu-2".into(), 12 * GIB));
    // Bigger than any GPU: never, even on an empty node.
    let mut empty = Allocator::new(&published()).expect("the pool");
    let huge = empty.allocate(&claim("ns", "huge", "huge", Some("81Gi")), &consumer("huge")).expect("valid");
    assert!(huge.is_err(), "{huge:?}");
    // No request: the default, the whole GPU.
    let whole = empty.allocate(&claim("ns", "whole", "whole", None), &consumer("whole")).expect("valid").expect("room");
    assert_eq!(result_of(&whole, "whole"), ("gpu-0".into(), GPU));
}

#[test]
fn only_a_pools_complete_current_generation_counts() {
    let mut slices = published();
    let mut older = slices[0].clone();
    older["metadata"]["name"] = json!("old");
    older["spec"]["pool"]["generation"] = json!(0);
    older["spec"]["devices"] = json!([{"name": "gpu-9", "allowMultipleAllocations": true, "capacity": {"memory": {"value": "1Ti"}}}]);
    slices.push(older);
    let allocator = Allocator::new(&slices).expect("the pool");
    assert_eq!(allocator.devices.len(), 4, "the older generation's device is not used");
    // A pool whose slice count says two, with one there: not used yet.
    let mut incomplete = published();
    incomplete[0]["spec"]["pool"]["resourceSliceCount"] = json!(2);
    assert!(Allocator::new(&incomplete).expect("the pool").devices.is_empty());
}

#[derive(Clone, Debug)]
enum Op {
    /// A claim asking this many bytes (`None`: no request).
    Claim(Option<u64>),
    /// Release the n-th live claim (modulo their number).
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => (1u64..=8 * 1024).prop_map(|mib| Some(mib * MIB)),
        3 => (8 * 1024u64..=40 * 1024).prop_map(|mib| Some(mib * MIB)),
        1 => (40 * GIB..=GPU).prop_map(Some),
        1 => (GPU + 1..=200 * GIB).prop_map(Some),
        1 => Just(None),
    ];
    prop_oneof![4 => size.prop_map(Op::Claim), 1 => any::<usize>().prop_map(Op::Release)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn never_over_committed(ops in prop::collection::vec(op(), 1..80)) {
        let mut allocator = Allocator::new(&published()).expect("the pool");
        // What the live claims' statuses say (the allocator's book is not trusted here).
        let mut live: BTreeMap<String, (String, u64)> = BTreeMap::new();
        let mut shares = BTreeSet::new();
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Release(k) => {
                    if live.is_empty() {
                        continue;
                    }
                    let uid = live.keys().nth(k % live.len()).cloned().expect("a live claim");
                    prop_assert!(allocator.release(&uid));
                    live.remove(&uid);
                }
                Op::Claim(request) => {
                    let uid = format!("claim-{n}");
                    // Asked in bytes, or in Mi where it is a whole number of them.
                    let quantity = request.map(|r| if r % MIB == 0 { format!("{}Mi", r / MIB) } else { r.to_string() });
                    let got = allocator.allocate(&claim("ns", &uid, &uid, quantity.as_deref()), &consumer(&uid)).expect("valid");
                    let used = |device: &str| live.values().filter(|(d, _)| d == device).map(|(_, b)| b).sum::<u64>();
                    let rounded = expected(request);
                    match got {
                        Ok(claim) => {
                            let (device, bytes) = result_of(&claim, &uid);
                            prop_assert_eq!(Some(bytes), rounded, "the policy's rounding");
                            prop_assert!(request.is_none_or(|r| bytes >= r), "never less than asked");
                            prop_assert!(used(&device) + bytes <= GPU, "{} over-committed", device);
                            let share = claim["status"]["allocation"]["devices"]["results"][0]["shareID"].as_str().unwrap_or_default().to_owned();
                            prop_assert!(shares.insert(share), "a fresh shareID");
                            live.insert(uid.clone(), (device, bytes));
                        }
                        Err(Refused::Unschedulable { .. }) => {
                            // Refused only when no GPU had room (or it is past every GPU).
                            if let Some(rounded) = rounded {
                                for gpu in ["gpu-0", "gpu-1", "gpu-2", "gpu-3"] {
                                    prop_assert!(used(gpu) + rounded > GPU, "{} had room for {} bytes", gpu, rounded);
                                }
                            }
                        }
                    }
                    if request.is_some_and(|r| r > GPU) {
                        prop_assert!(!live.contains_key(&uid), "a claim bigger than any GPU was allocated");
                    }
                }
            }
            for gpu in ["gpu-0", "gpu-1", "gpu-2", "gpu-3"] {
                let sum: u64 = live.values().filter(|(d, _)| d == gpu).map(|(_, b)| b).sum();
                prop_assert!(sum <= GPU, "{} holds {} bytes", gpu, sum);
            }
        }
    }
}
