//! The confinement of a ledger worker ([`super::worker`]), applied by the worker to itself
//! before it touches anything of the ledger: no capabilities, an unprivileged uid, no new
//! privileges, resource limits, and a seccomp filter that allows only what operating on a
//! mapped file and answering on its socket needs. What a workload can make a worker do by
//! corrupting its ledger stays inside that process: it cannot open a file, start a process,
//! signal another, trace one, or reach the network. Its address space and CPU time limits
//! (`RLIMIT_AS`, `RLIMIT_CPU`) are set by the agent before the worker's program starts
//! ([`super::worker::WorkerLimits`]); this confinement takes away the means to raise them.
use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// The uid and gid a worker runs as (`nobody`).
pub const WORKER_ID: u32 = 65534;

/// Why a worker could not confine itself (it then refuses to run).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot {what}: {source}")]
    Call { what: &'static str, source: std::io::Error },
    #[error("the seccomp filter: {0}")]
    Seccomp(#[from] seccompiler::Error),
    #[error("the seccomp filter: {0}")]
    SeccompRules(#[from] seccompiler::BackendError),
    #[error("still holds capabilities after dropping them (effective {effective:#x}, permitted {permitted:#x})")]
    CapabilitiesLeft { effective: u64, permitted: u64 },
}

/// Confines the calling process (single-threaded: the worker starts no threads).
pub fn confine() -> Result<(), SandboxError> {
    limit(libc::RLIMIT_CORE, 0, "disable core dumps")?;
    limit(libc::RLIMIT_NOFILE, 8, "limit open files")?;
    limit(libc::RLIMIT_FSIZE, 0, "forbid growing files")?;
    // SAFETY: plain system calls on integers.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "drop supplementary groups")?;
    check(unsafe { libc::setresgid(WORKER_ID, WORKER_ID, WORKER_ID) }, "switch to the worker's gid")?;
    // Leaving uid 0 clears every capability (no SECBIT_KEEP_CAPS is set).
    check(unsafe { libc::setresuid(WORKER_ID, WORKER_ID, WORKER_ID) }, "switch to the worker's uid")?;
    limit(libc::RLIMIT_NPROC, 0, "forbid new processes")?;
    let (effective, permitted) = capabilities()?;
    if effective != 0 || permitted != 0 {
        return Err(SandboxError::CapabilitiesLeft { effective, permitted });
    }
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, "set no_new_privs")?;
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }, "make the process non-dumpable")?;
    let program: BpfProgram = filter()?.try_into()?;
    seccompiler::apply_filter(&program)?;
    Ok(())
}

/// The system calls a worker may make: reading and answering on its socket, receiving the
/// ledger's descriptor, mapping and reading it, the lock's futex, memory, time, and its own
/// exit or abort. Anything else fails with `EPERM`.
fn filter() -> Result<SeccompFilter, SandboxError> {
    let allowed = [
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_recvmsg,
        libc::SYS_pread64,
        libc::SYS_fstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_lseek,
        libc::SYS_close,
        libc::SYS_mmap,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_madvise,
        libc::SYS_brk,
        libc::SYS_futex,
        libc::SYS_clock_gettime,
        libc::SYS_sched_yield,
        libc::SYS_getrandom,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigaction,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_exit,
        libc::SYS_exit_group,
    ];
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = allowed.iter().map(|&call| (call, Vec::new())).collect();
    // An abort signals the worker itself, never another process of its uid.
    let own = u64::from(std::process::id());
    let to_self = |call| -> Result<(i64, Vec<SeccompRule>), SandboxError> {
        let condition = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, own)?;
        Ok((call, vec![SeccompRule::new(vec![condition])?]))
    };
    rules.extend([to_self(libc::SYS_tgkill)?, to_self(libc::SYS_kill)?]);
    // The standard library checks a descriptor before closing it (F_GETFD) in debug builds.
    let getfd = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::F_GETFD as u64)?;
    rules.insert(libc::SYS_fcntl, vec![SeccompRule::new(vec![getfd])?]);
    let arch = if cfg!(target_arch = "aarch64") { TargetArch::aarch64 } else { TargetArch::x86_64 };
    Ok(SeccompFilter::new(rules, SeccompAction::Errno(libc::EPERM as u32), SeccompAction::Allow, arch)?)
}

fn limit(resource: libc::__rlimit_resource_t, value: libc::rlim_t, what: &'static str) -> Result<(), SandboxError> {
    let limit = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: `limit` is a valid rlimit for the call's duration.
    check(unsafe { libc::setrlimit(resource, &limit) }, what)
}

/// The effective and permitted capability sets of the calling process.
fn capabilities() -> Result<(u64, u64), SandboxError> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|source| SandboxError::Call { what: "read /proc/self/status", source })?;
    let set = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .unwrap_or(u64::MAX)
    };
    Ok((set("CapEff:"), set("CapPrm:")))
}

fn check(code: libc::c_int, what: &'static str) -> Result<(), SandboxError> {
    if code == 0 {
        Ok(())
    } else {
        Err(SandboxError::Call { what, source: std::io::Error::last_os_error() })
    }
}
