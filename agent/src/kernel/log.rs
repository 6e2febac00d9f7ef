//! The eBPF programs' log (aya-log's `AYA_LOGS` ring buffer) forwarded into the agent's
//! tracing log under the target `vramguard::kernel`. The programs rate-limit their lines in
//! the kernel (`common::trouble::LINES_PER_SECOND` per kind); a line past the limit is only
//! counted (`log_lines_suppressed`).
use anyhow::{anyhow, Result};
use aya::Ebpf;
use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;

/// Forwards aya-log records to `tracing` at their level.
pub struct KernelLog;

impl log::Log for KernelLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        let message = record.args();
        match record.level() {
            log::Level::Error => tracing::error!(target: "vramguard::kernel", "{message}"),
            log::Level::Warn => tracing::warn!(target: "vramguard::kernel", "{message}"),
            log::Level::Info => tracing::info!(target: "vramguard::kernel", "{message}"),
            log::Level::Debug => tracing::debug!(target: "vramguard::kernel", "{message}"),
            log::Level::Trace => tracing::trace!(target: "vramguard::kernel", "{message}"),
        }
    }

    fn flush(&self) {}
}

/// The programs' log, ready to be polled: call [`EbpfLogger::flush`] when it is readable.
pub type Logger = AsyncFd<EbpfLogger<KernelLog>>;

/// Takes the log ring buffer out of the loaded object (before any program is attached, so no
/// line is lost).
pub fn init(ebpf: &mut Ebpf) -> Result<Logger> {
    let logger = EbpfLogger::init_with_logger(ebpf, KernelLog)
        .map_err(|error| anyhow!("cannot read the eBPF programs' log: {error}"))?;
    // SAFETY: the logger owns the ring buffer and its map fd, which stays open and unchanged
    // until the AsyncFd (which owns the logger) is dropped.
    unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) }
        .map_err(|error| anyhow!("cannot poll the eBPF programs' log: {error}"))
}
