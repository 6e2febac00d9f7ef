//! The ledger's lock: a process-shared, robust pthread mutex that lives inside the file.
//!
//! Robust means a holder that dies does not wedge anyone: the kernel hands the mutex to the
//! next waiter at once with `EOWNERDEAD`, who must repair what the dead holder may have left
//! half-done and then mark the mutex consistent. There is no timeout on the workloads' path
//! (HAMi-core's 10 s x 30 retries is the failure this replaces); only the node agent, which
//! must not hang on a lock a workload controls, waits with a deadline ([`RobustMutex::lock_within`]).
use std::{cell::UnsafeCell, io, time::Duration};

/// A `pthread_mutex_t` set up process-shared and robust, padded to its own cache line.
#[repr(C, align(64))]
pub struct RobustMutex {
    raw: UnsafeCell<libc::pthread_mutex_t>,
}

/// How a lock was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// The usual case.
    Clean,
    /// The previous holder died holding it: the protected state may be half-updated and must
    /// be repaired before [`LockGuard::mark_consistent`] (or the guard's drop) releases it.
    OwnerDied,
}

/// The lock cannot be used any more: a previous recovery released it without marking the
/// state consistent. Only re-creating the ledger helps.
#[derive(Debug, thiserror::Error)]
#[error("the ledger lock is unrecoverable (a repair was abandoned): {0}")]
pub struct LockError(#[source] pub io::Error);

impl RobustMutex {
    /// Initialises the mutex in place.
    ///
    /// # Safety
    /// `this` must point to writable memory for a `RobustMutex` that no other thread or
    /// process is using yet (the ledger calls this while creating a file nobody else sees).
    pub unsafe fn init(this: *mut RobustMutex) -> io::Result<()> {
        let mut attr = std::mem::MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
        // SAFETY: the attribute object is initialised by pthread_mutexattr_init before any
        // other use and destroyed at the end; `this` is valid per the caller's contract.
        unsafe {
            check(libc::pthread_mutexattr_init(attr.as_mut_ptr()))?;
            let result = (|| {
                check(libc::pthread_mutexattr_setpshared(attr.as_mut_ptr(), libc::PTHREAD_PROCESS_SHARED))?;
                check(libc::pthread_mutexattr_setrobust(attr.as_mut_ptr(), libc::PTHREAD_MUTEX_ROBUST))?;
                check(libc::pthread_mutex_init((*this).raw.get(), attr.as_ptr()))
            })();
            libc::pthread_mutexattr_destroy(attr.as_mut_ptr());
            result
        }
    }

    /// Blocks until the mutex is held by this thread.
    pub fn lock(&self) -> Result<LockGuard<'_>, LockError> {
        // SAFETY: the mutex was initialised by `init` (the ledger validates the file before
        // handing out a reference) and lives in a shared mapping for as long as `self`.
        let code = unsafe { libc::pthread_mutex_lock(self.raw.get()) };
        self.guard(code)?.ok_or_else(|| LockError(io::Error::from_raw_os_error(libc::ETIMEDOUT)))
    }

    /// Waits at most `timeout` for the mutex: `None` if another holder kept it that long (a
    /// process stopped or hung inside the lock). For a caller that must not hang on a lock
    /// other processes control (the node agent); a workload's hook waits with [`Self::lock`].
    pub fn lock_within(&self, timeout: Duration) -> Result<Option<LockGuard<'_>>, LockError> {
        let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `now` is a valid out-pointer; CLOCK_REALTIME is the clock
        // pthread_mutex_timedlock measures its deadline with.
        check(unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) }).map_err(LockError)?;
        let nanos = now.tv_nsec as u64 + u64::from(timeout.subsec_nanos());
        let deadline = libc::timespec {
            tv_sec: now.tv_sec.saturating_add(timeout.as_secs() as libc::time_t).saturating_add((nanos / 1_000_000_000) as libc::time_t),
            tv_nsec: (nanos % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: as in `lock`; `deadline` is a valid timespec.
        let code = unsafe { libc::pthread_mutex_timedlock(self.raw.get(), &deadline) };
        self.guard(code)
    }

    /// The guard for a lock call's result `code` (`None`: timed out).
    fn guard(&self, code: libc::c_int) -> Result<Option<LockGuard<'_>>, LockError> {
        let acquired = match code {
            0 => Acquired::Clean,
            libc::EOWNERDEAD => Acquired::OwnerDied,
            libc::ETIMEDOUT => return Ok(None),
            other => return Err(LockError(io::Error::from_raw_os_error(other))),
        };
        Ok(Some(LockGuard { mutex: self, acquired, consistent: acquired == Acquired::Clean }))
    }
}

// SAFETY: a pthread mutex is designed to be shared between threads (and, set up with
// PTHREAD_PROCESS_SHARED, between processes); all access goes through pthread calls.
unsafe impl Sync for RobustMutex {}
// SAFETY: as above; the mutex has no thread affinity until locked.
unsafe impl Send for RobustMutex {}

/// Holds the lock; releases it on drop.
pub struct LockGuard<'a> {
    mutex: &'a RobustMutex,
    acquired: Acquired,
    consistent: bool,
}

impl LockGuard<'_> {
    /// Whether the previous holder died (the caller must repair before going on).
    pub fn acquired(&self) -> Acquired {
        self.acquired
    }

    /// Declares the protected state repaired after an [`Acquired::OwnerDied`].
    pub fn mark_consistent(&mut self) {
        if !self.consistent {
            // SAFETY: this thread holds the mutex (we are inside its guard).
            unsafe { libc::pthread_mutex_consistent(self.mutex.raw.get()) };
            self.consistent = true;
        }
    }
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        // A guard dropped before repair finished (a panic in the repair) still marks the
        // mutex consistent: leaving it unrecoverable would wedge every process for good,
        // while the next lock holder's invariant check will see any damage.
        self.mark_consistent();
        // SAFETY: this thread holds the mutex.
        unsafe { libc::pthread_mutex_unlock(self.mutex.raw.get()) };
    }
}

fn check(code: libc::c_int) -> io::Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(code))
    }
}
