//! Provisions container ledgers exactly as the agent does at NRI CreateContainer, for the
//! hook's cold-start benchmark (`cargo xtask bench --cold-start-only`): the agent's own
//! [`Store::create`] with its [`Mounter`] (each ledger in a tmpfs of its size in this
//! process's mount namespace, every page allocated, the limits file beside the record), sized
//! by [`Sizing`] as `--max-processes-per-container` sizes it.
//!
//! `provision-ledgers STATE_DIR LEDGER_DIR QUOTA PROCESSES ID...`: creates one provisioned
//! container per ID, each with QUOTA bytes on one GPU, and prints for each
//! `provisioned id=ID ledger=PATH limits=PATH bytes=N ns=T` (T: the time of its
//! `Store::create`); then `ready`, and waits for its standard input to close, when it removes
//! them all as the agent removes a container (the record, then the ledger's tmpfs).
use std::{io::Read as _, path::PathBuf, time::Instant};

use agent::provision::{
    mount::Mounter,
    store::{Sizing, Store},
    Record,
};

fn main() {
    if let Err(error) = run() {
        eprintln!("provision-ledgers: {error}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [state, ledgers, quota, processes, ids @ ..] = args.as_slice() else {
        return Err("usage: provision-ledgers STATE_DIR LEDGER_DIR QUOTA PROCESSES ID...".into());
    };
    let quota: u64 = quota.parse().map_err(|e| format!("QUOTA {quota:?}: {e}"))?;
    let processes: u32 = processes.parse().map_err(|e| format!("PROCESSES {processes:?}: {e}"))?;
    let store = Store::open(&PathBuf::from(state), &PathBuf::from(ledgers), Some(Mounter::new(None)))?
        .sized(Sizing { processes, ..Sizing::default() });
    let mut made = Vec::new();
    let result = (|| {
        for id in ids {
            let start = Instant::now();
            let provisioned = store.create(record(id, quota))?;
            let ns = start.elapsed().as_nanos();
            made.push(id.clone());
            println!(
                "provisioned id={id} ledger={} limits={} bytes={} ns={ns}",
                provisioned.ledger.display(),
                provisioned.limits.display(),
                provisioned.header.total_size
            );
        }
        println!("ready");
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        Ok(())
    })();
    for id in &made {
        if let Err(error) = store.remove(id) {
            eprintln!("provision-ledgers: {error}");
        }
    }
    result
}

/// A container of a pod given `quota` on one GPU by the quota file.
fn record(id: &str, quota: u64) -> Record {
    Record {
        container_id: id.to_string(),
        pod_id: format!("pod-{id}"),
        pod_uid: format!("uid-{id}"),
        namespace: "bench".into(),
        pod: format!("pod-{id}"),
        container: "main".into(),
        cgroups_path: String::new(),
        quota,
        devices: 1,
        gpus: vec![0],
        source: "quota file".into(),
        claim: None,
        quotas: Vec::new(),
    }
}
