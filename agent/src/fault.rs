//! Faults injected on purpose, for the tests that show what the agent does when one of its own
//! parts fails (a task that panics or stops answering, a scan that panics on one file, a
//! provisioning step that outlives the runtime's deadline). Set once at start from the hidden
//! `--fault` arguments of `vramguard run` (the operator's command line, never a tenant's
//! input); with none given, every point below is a load of an empty list and does nothing.
//!
//! A fault is `KIND:WHERE`, `panic:TASK:FILE` or `park:TASK:FILE` (armed once FILE exists), or
//! `delay:WHERE:MS`:
//!
//! | kind | at | does |
//! |---|---|---|
//! | `panic` | a task's name | the task panics ([`armed`], which every supervised task is raced with) |
//! | `park` | a task's name | the task is never polled again, and so ignores the stop ([`armed`]) |
//! | `panic-file` | a file name | discovery panics while reading a file of that name ([`panics_on_file`]) |
//! | `deaf` | a command name | discovery ignores the kernel's word on new mappings of processes of that name (`/proc/<pid>/comm`), as if their events were missed ([`deaf_to`]) |
//! | `delay` | a step's name | the step sleeps that long first ([`delay`]) |
//! | `die` | a step's name | the agent kills itself (SIGKILL) at that step, as a crash or a `kill -9` there would ([`die_at`]) |
//! | `refuse` | `uprobe-multi` | the kernel refuses every uprobe_multi link of a file but its first, as one without them does (the first is made, to be removed again: [`refused`]) |
//!
//! Steps that can be delayed: `create-container` (every provisioning's blocking step, after
//! the ledger's tmpfs, the ledger and the record are made, before the container is recorded
//! as provisioned: [`crate::provision`]) and `create-container.<name>` (the same, for
//! containers of that name only); `reclaim-scan` (the reclaim task's periodic step, in the
//! blocking pool, before it lists the ledger directory: [`crate::ledgers::task`]).
//!
//! Steps to die at (the DRA driver's, [`crate::dra::prepare`]): `prepare-spec` (a claim's CDI
//! spec on disk, its checkpoint entry not), `prepare-recorded` (both, the kubelet not
//! answered), `unprepare-spec` (the spec removed, the entry not), `unprepare-forgotten` (the
//! entry removed, the claim's ledger not released).
use std::{path::PathBuf, sync::OnceLock, time::Duration};

/// One injected fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The task, once the file (if any) exists.
    Panic(String, Option<PathBuf>),
    Park(String, Option<PathBuf>),
    PanicOnFile(String),
    Deaf(String),
    Delay(String, Duration),
    Refuse(String),
    Die(String),
}

static FAULTS: OnceLock<Vec<Fault>> = OnceLock::new();

/// Parses one `--fault` value.
pub fn parse(text: &str) -> Result<Fault, String> {
    let mut parts = text.splitn(3, ':');
    let (kind, at) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if at.is_empty() {
        return Err(format!("{text:?}: expected KIND:WHERE (panic, park, panic-file, deaf, refuse, die) or delay:WHERE:MS"));
    }
    let fault = match (kind, parts.next()) {
        ("panic", when) => Fault::Panic(at.into(), when.map(PathBuf::from)),
        ("park", when) => Fault::Park(at.into(), when.map(PathBuf::from)),
        ("panic-file", None) => Fault::PanicOnFile(at.into()),
        ("deaf", None) => Fault::Deaf(at.into()),
        ("refuse", None) => Fault::Refuse(at.into()),
        ("die", None) => Fault::Die(at.into()),
        ("delay", Some(ms)) => {
            let ms: u64 = ms.parse().map_err(|_| format!("{text:?}: {ms:?} is not a number of milliseconds"))?;
            Fault::Delay(at.into(), Duration::from_millis(ms))
        }
        _ => return Err(format!("{text:?}: unknown fault (panic:TASK[:FILE], park:TASK[:FILE], panic-file:NAME, deaf:COMMAND, delay:STEP:MS, refuse:uprobe-multi, die:STEP)")),
    };
    Ok(fault)
}

/// Arms the faults (once; later calls change nothing).
pub fn arm(faults: Vec<Fault>) {
    if !faults.is_empty() {
        tracing::warn!(?faults, "faults injected (--fault): this agent is under test");
    }
    let _ = FAULTS.set(faults);
}

fn faults() -> &'static [Fault] {
    FAULTS.get().map_or(&[], Vec::as_slice)
}

/// What [`armed`] injects into a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injected {
    Panic,
    Park,
}

/// Resolves when a `panic` or `park` fault naming `task` is due (at once, or once its file
/// exists, looked for every 20 ms); never, without one.
pub async fn armed(task: &str) -> Injected {
    let due = faults().iter().find_map(|fault| match fault {
        Fault::Panic(name, when) if name == task => Some((Injected::Panic, when.clone())),
        Fault::Park(name, when) if name == task => Some((Injected::Park, when.clone())),
        _ => None,
    });
    let Some((injected, when)) = due else { return std::future::pending().await };
    if let Some(file) = when {
        while !file.exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    injected
}

/// Whether discovery is to panic while reading the file shown as `path`.
pub fn panics_on_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    faults().iter().any(|fault| matches!(fault, Fault::PanicOnFile(file) if file == name))
}

/// Whether discovery is to ignore the kernel's word on process `pid`'s new mappings.
pub fn deaf_to(pid: u32) -> bool {
    let mut deaf = faults().iter().filter_map(|fault| match fault {
        Fault::Deaf(name) => Some(name),
        _ => None,
    });
    let Some(first) = deaf.next() else {
        return false;
    };
    let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
        return false;
    };
    let comm = comm.trim_end();
    comm == first || deaf.any(|name| name == comm)
}

/// Whether the kernel is to refuse `call` (as if it had no such call).
pub fn refused(call: &str) -> bool {
    faults().iter().any(|fault| matches!(fault, Fault::Refuse(name) if name == call))
}

/// Kills the agent with SIGKILL if a `die` fault names `step` (nothing runs after it: no
/// destructor, no flush, as after a `kill -9`).
pub fn die_at(step: &str) {
    if faults().iter().any(|fault| matches!(fault, Fault::Die(name) if name == step)) {
        tracing::warn!(step, "fault injected: the agent kills itself here");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        std::process::abort();
    }
}

/// How long the step `step` is to be delayed, if at all.
pub fn delay(step: &str) -> Option<Duration> {
    faults().iter().find_map(|fault| match fault {
        Fault::Delay(name, by) if name == step => Some(*by),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kind_and_refuses_the_rest() {
        assert_eq!(parse("panic:kernel"), Ok(Fault::Panic("kernel".into(), None)));
        assert_eq!(parse("park:reconcile:/run/go"), Ok(Fault::Park("reconcile".into(), Some("/run/go".into()))));
        assert_eq!(parse("die:prepare-spec"), Ok(Fault::Die("prepare-spec".into())));
        assert_eq!(parse("panic-file:libcuda.so.1"), Ok(Fault::PanicOnFile("libcuda.so.1".into())));
        assert_eq!(parse("deaf:fakecuda-worklo"), Ok(Fault::Deaf("fakecuda-worklo".into())));
        assert_eq!(parse("delay:create-container:3000"), Ok(Fault::Delay("create-container".into(), Duration::from_secs(3))));
        assert_eq!(parse("refuse:uprobe-multi"), Ok(Fault::Refuse("uprobe-multi".into())));
        assert!(parse("panic").is_err());
        assert!(parse("explode:kernel").is_err());
        assert!(parse("delay:x:soon").is_err());
    }
}
