//! The criterion benchmarks of the other crates (`cargo bench -p ledger`, `cargo bench -p
//! agent`), run with short warm-up and measurement times and folded into the report: each
//! known benchmark becomes a row against the target its issue set.
use anyhow::{bail, Context, Result};

use super::Row;
use crate::cargo;

/// A benchmark's name as criterion prints it, its row's name, the unit to show it in (with
/// that unit's size in seconds), and its target in that unit (`None`: reported only).
struct Known {
    id: &'static str,
    name: &'static str,
    unit: &'static str,
    unit_seconds: f64,
    target: Option<(f64, &'static str)>,
}

const NS: f64 = 1e-9;
const MS: f64 = 1e-3;

const KNOWN: [Known; 8] = [
    Known {
        id: "buddy 4 GiB / 4 KiB/fragmentation: 8 KiB @ 64 KiB, free half, 64 KiB",
        name: "ledger: buddy 4 GiB / 4 KiB, 65,536 x 8 KiB at 64 KiB alignment, free every other, 64 KiB until full",
        unit: "ms",
        unit_seconds: MS,
        target: Some((18.6, "ms, target (10x the kernel's 186 ms)")),
    },
    Known {
        id: "buddy 4 GiB / 4 KiB/fill, free every other, free the rest in reverse",
        name: "ledger: buddy 4 GiB / 4 KiB, fill with single chunks, free every other, free the rest in reverse",
        unit: "ms",
        unit_seconds: MS,
        target: Some((11.4, "ms, target (10x the kernel's 114 ms)")),
    },
    Known {
        id: "ledger 79 GiB / 2 MiB random reserve+release/50% occupancy (one op)",
        name: "ledger: 79 GiB / 2 MiB, random reserve or release at 50 % occupancy",
        unit: "ns per op",
        unit_seconds: NS,
        target: Some((200.0, "ns per op, target (5 M ops/s)")),
    },
    Known {
        id: "ledger 79 GiB / 2 MiB random reserve+release/90% occupancy (one op)",
        name: "ledger: 79 GiB / 2 MiB, random reserve or release at 90 % occupancy",
        unit: "ns per op",
        unit_seconds: NS,
        target: Some((200.0, "ns per op, target (5 M ops/s)")),
    },
    Known {
        id: "lock + reserve + release round trip/uncontended",
        name: "ledger: lock + reserve + release round trip, uncontended",
        unit: "ns",
        unit_seconds: NS,
        target: Some((200.0, "ns, target")),
    },
    Known {
        id: "lock + reserve + release round trip/8 processes contending",
        name: "ledger: lock + reserve + release round trip, 8 processes contending",
        unit: "ns",
        unit_seconds: NS,
        target: None,
    },
    Known {
        id: "reconcile/pass, 100 ledgers x 1024 slots, 102400 processes",
        name: "agent: reconcile pass, 100 ledgers x 1024 slots, every slot live (102,400 processes)",
        unit: "ms",
        unit_seconds: MS,
        target: Some((10.0, "ms, target")),
    },
    Known {
        id: "reconcile/pass, 100 ledgers x 1024 slots, 800 processes",
        name: "agent: reconcile pass, 100 ledgers x 1024 slots, 8 live per ledger (800 processes)",
        unit: "ms",
        unit_seconds: MS,
        target: Some((10.0, "ms, target")),
    },
];

/// Runs the criterion benchmarks and adds a row for each known one.
pub fn criterion_rows(rows: &mut Vec<Row>) -> Result<()> {
    let output = cargo()
        .args(["bench", "-p", "ledger", "-p", "agent", "--bench", "ledger", "--bench", "reconcile", "--"])
        .args(["--warm-up-time", "1", "--measurement-time", "3"])
        .output()
        .context("cannot run cargo bench")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    if !output.status.success() {
        bail!("cargo bench failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let measured = parse(&stdout);
    for known in &KNOWN {
        let Some(&(_, seconds)) = measured.iter().find(|(id, _)| id == known.id) else {
            bail!("criterion reported no benchmark `{}` (renamed?)", known.id);
        };
        let figure = seconds / known.unit_seconds;
        rows.push(match known.target {
            Some((target, target_unit)) => Row::target(known.name, figure, known.unit, 1, target, target_unit),
            None => Row::reported(known.name, figure, known.unit, 1),
        });
    }
    Ok(())
}

/// (benchmark id, median estimate in seconds) of each `time:` line of criterion's output: the
/// id is the line before it, or the same line when criterion fits both on one.
fn parse(stdout: &str) -> Vec<(String, f64)> {
    let mut found = Vec::new();
    let mut previous = "";
    for line in stdout.lines() {
        if let Some((head, times)) = line.split_once("time:") {
            let id = if head.trim().is_empty() { previous.trim() } else { head.trim() };
            // [low unit median unit high unit]
            let fields: Vec<&str> = times.trim().trim_start_matches('[').trim_end_matches(']').split_whitespace().collect();
            if let (Some(value), Some(unit)) = (fields.get(2).and_then(|v| v.parse::<f64>().ok()), fields.get(3)) {
                let scale = match *unit {
                    "ps" => 1e-12,
                    "ns" => 1e-9,
                    "µs" | "us" => 1e-6,
                    "ms" => 1e-3,
                    "s" => 1.0,
                    _ => continue,
                };
                found.push((id.to_string(), value * scale));
            }
        }
        previous = line;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn reads_criterion_estimates() {
        let text = "Benchmarking reconcile/pass, 800 processes: Analyzing\nreconcile/pass, 800 processes\n                        time:   [187.97 µs 188.41 µs 188.89 µs]\n                        change: [−1% 0% 1%]\nshort/name              time:   [2.0 ns 3.5 ns 4.0 ns]\n";
        let found = parse(text);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].0, "reconcile/pass, 800 processes");
        assert!((found[0].1 - 188.41e-6).abs() < 1e-12);
        assert_eq!(found[1].0, "short/name");
        assert!((found[1].1 - 3.5e-9).abs() < 1e-15);
    }
}
