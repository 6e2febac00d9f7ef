//! Where a provisioned container finds what the agent injected (the NRI adjustment mounts
//! these files; the hook reads them). Shared by the agent and the hook.

/// The container's ledger, created by the agent (bind-mounted read-write, alone: it can be
/// written but neither removed nor replaced from inside the container).
pub const LEDGER: &str = "/run/vramguard/ledger";
/// The agent's copy of the ledger's header (bind-mounted read-only): the limits the hook
/// enforces, whatever the ledger file's own header says.
pub const LIMITS: &str = "/run/vramguard/limits";
/// The hook library (bind-mounted read-only).
pub const HOOK: &str = "/usr/lib/vramguard/libvramguard.so";
/// The loader's preload list naming [`HOOK`] (bind-mounted read-only).
pub const PRELOAD: &str = "/etc/ld.so.preload";
