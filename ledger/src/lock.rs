//! The ledger's lock: a process-shared, robust pthread mutex that lives inside the file.
//!
//! Robust means a holder that dies does not wedge anyone: the kernel hands the mutex to the
//! next waiter at once with `EOWNERDEAD`, who must repair what the dead holder may have left
//! half-done and then mark the mutex consistent. There is no timeout anywhere on this path
//! (HAMi-core's 10 s x 30 retries is the failure this replaces).
use std::{cell::UnsafeCell, io};

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
        let acquired = match code {
            0 => Acquired::Clean,
            libc::EOWNERDEAD => Acquired::OwnerDied,
            other => return Err(LockError(io::Error::from_raw_os_error(other))),
        };
        Ok(LockGuard { mutex: self, acquired, consistent: acquired == Acquired::Clean })
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
