//! `hostile-attacker KIND LEDGER`: a hostile workload's process for the adversarial suite
//! (`tests/hostile_ledger.rs`), working on the ledger file `LEDGER` until it is killed (or for
//! two minutes, or, for `cut` and `hold`, until it has done its one move). A helper binary of
//! the e2e crate, not a test. `KIND`:
//! - `lock`: rewrites the lock's owner word and robust-list pointers, and the `dirty` flag;
//! - `random`: random bytes at random offsets over the whole file, header included;
//! - `dirty`: holds the `dirty` flag raised;
//! - `cut`: holds the ledger's lock (as a process of the container may) until another process
//!   waits for it (the waiters bit of the lock word: the agent's worker, asked to reclaim a
//!   slot), then cuts the file after its state page and lets the lock go: the worker gets the
//!   lock with the ledger mapped and finds the pages it needs cut away (SIGBUS);
//! - `hold`: the same without the cut (the control: the waiting worker carries on).
//!
//! Prints `holding` once it holds the lock (`cut`, `hold`) and `done` after its move.
use std::{
    fs::OpenOptions,
    io::Write,
    os::unix::fs::FileExt,
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use ledger::{
    layout::{align_up, State, PAGE},
    Ledger,
};

/// glibc's `FUTEX_WAITERS` in a mutex's lock word: a thread sleeps on it.
const FUTEX_WAITERS: u32 = 0x8000_0000;

fn main() -> Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(kind), Some(path)) = (args.next(), args.next()) else { bail!("usage: hostile-attacker KIND LEDGER") };
    let kind = kind.to_str().context("KIND is not UTF-8")?.to_string();
    // Never outlives the test that started it.
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let path = Path::new(&path);
    match kind.as_str() {
        "cut" => under_lock(path, true),
        "hold" => under_lock(path, false),
        _ => overwrite(&kind, path),
    }
}

/// The `lock`, `random` and `dirty` attacks: `pwrite` in a loop, for two minutes at most.
fn overwrite(kind: &str, path: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    let size = file.metadata()?.len();
    let state = PAGE;
    let dirty = state + std::mem::offset_of!(State, dirty) as u64;
    let mut seed = u64::from(std::process::id()) | 1;
    let mut next = move || {
        // xorshift64
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    while Instant::now() < deadline {
        match kind {
            "lock" => {
                // glibc's x86-64 pthread_mutex_t: owner tid at 8, robust list prev/next at 24/32.
                let _ = file.write_all_at(&(next() as u32).to_ne_bytes(), state + 8);
                let _ = file.write_all_at(&0x4141_4141_4141_4141u64.to_ne_bytes(), state + 24);
                let _ = file.write_all_at(&next().to_ne_bytes(), state + 32);
                let _ = file.write_all_at(&1u32.to_ne_bytes(), dirty);
            }
            "random" => {
                let offset = next() % size;
                let _ = file.write_all_at(&next().to_ne_bytes()[..(1 + next() % 8) as usize], offset);
            }
            "dirty" => {
                let _ = file.write_all_at(&1u32.to_ne_bytes(), dirty);
            }
            other => bail!("unknown attack {other}"),
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// The `cut` and `hold` moves (see the module doc).
fn under_lock(path: &Path, cut: bool) -> Result<()> {
    let ledger = Ledger::open(path)?;
    let header = *ledger.header();
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    // The lock word is the first of the mutex, the first field of the state.
    let lock_word = || -> Result<u32> {
        let mut word = [0u8; 4];
        file.read_exact_at(&mut word, header.state_offset)?;
        Ok(u32::from_ne_bytes(word))
    };
    // What stays: the header and the state page (the lock, which both sides still use).
    let keep = align_up(header.state_offset + std::mem::size_of::<State>() as u64, PAGE);
    if keep >= header.total_size {
        bail!("nothing to cut: the ledger is {} bytes, its state ends at {keep}", header.total_size);
    }
    let released = AtomicBool::new(false);
    std::thread::scope(|scope| -> Result<()> {
        // Holds the lock in 20 ms turns (well within the worker's 50 ms wait) until the move
        // is made: a waiter always finds it held, and gets it at the end of the turn.
        let holder = scope.spawn(|| -> Result<()> {
            while !released.load(Ordering::SeqCst) {
                ledger.hold_lock_for(Duration::from_millis(20))?;
            }
            Ok(())
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut announced = false;
        let outcome = loop {
            let word = lock_word()?;
            if !announced && word != 0 {
                println!("holding");
                std::io::stdout().flush()?;
                announced = true;
            }
            if word & FUTEX_WAITERS != 0 {
                if cut {
                    file.set_len(keep)?;
                }
                break Ok(());
            }
            if Instant::now() > deadline {
                break Err(anyhow::anyhow!("nobody waited for the lock in two minutes"));
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        released.store(true, Ordering::SeqCst);
        holder.join().map_err(|_| anyhow::anyhow!("the holder panicked"))??;
        outcome
    })?;
    println!("done");
    std::io::stdout().flush()?;
    Ok(())
}
