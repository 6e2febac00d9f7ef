//! The workspace's tests as `cargo xtask test` runs them: one build of every test binary, then
//! the binaries run side by side.
//!
//! [`build`] is one `cargo build --workspace --lib --bins --tests`: one resolution of features
//! for the libraries, the binaries the end-to-end tests run and every test, so nothing is
//! compiled twice (two `cargo test` commands resolve features differently and rebuilt the kube
//! crates and the agent each time). It returns the test binaries cargo made.
//!
//! [`run`] runs them as `cargo test` would (in the package's directory, with cargo's variables
//! and library path; the end-to-end binaries with `--test-threads=1`), [`LANES`] at a time,
//! longest source first. Each run's output is kept and printed whole when it ends, with its
//! time. Every end-to-end binary has a fake driver of its own ([`e2e::fake_driver_dir`]), so
//! its agents see only its own processes' allocations. A test's source says where it cannot
//! share the node, in its file's module doc (`//! ...`) or a test function's (`/// ...`):
//!
//! - `Runs alone: <why>`: after all the others, one at a time, nothing beside it. An agent that
//!   discovers libcuda on the whole node would find the other binaries' fake drivers (the e2e
//!   kit refuses to start one beside others: [`e2e::SHARED_NODE`]).
//! - `Bounds latency: <why>`: beside tests that bound nothing, never beside another that
//!   bounds a latency (a `/healthz` answer within 250 ms under attack): the attacks, not the
//!   neighbours, are what such a test measures.
//!
//! A binary that runs past [`BINARY_LIMIT`] is killed with its process group and counted as
//! failed, so a hang ends the run with its name instead of stalling CI.
use std::{
    collections::VecDeque,
    fs::{self, File},
    io::{BufRead, BufReader},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{mpsc, Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::{cargo, debug_dir, parse_test_result};

/// How many test binaries run at once (besides those that run alone); `VRAMGUARD_TEST_LANES`
/// overrides it. The tests mostly wait (for agents, containerd, timers), not compute.
pub const LANES: usize = 4;

/// How long one test binary may run.
pub const BINARY_LIMIT: Duration = Duration::from_secs(15 * 60);

/// One test binary cargo built.
#[derive(Debug, Clone)]
pub struct Binary {
    /// What cargo prints for it: `tests/accounting.rs`, `unittests src/lib.rs`.
    pub label: String,
    pub package: String,
    pub executable: PathBuf,
    pub manifest_dir: PathBuf,
    /// Where its tests can run.
    pub marks: Marks,
    /// Its source's size: the order it starts in (largest first).
    pub weight: u64,
}

/// Where a test can run, strictest last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Beside anything that is not alone.
    Shared,
    /// `Bounds latency:` beside shared tests only.
    Bounded,
    /// `Runs alone:` with nothing beside it.
    Alone,
}

impl Class {
    /// The class a marker line (`//! ...` or `/// ...`, without its slashes) gives, and why.
    fn of(marker: &str) -> Option<(Class, String)> {
        if let Some(why) = marker.strip_prefix("Runs alone:") {
            Some((Class::Alone, why.trim().to_string()))
        } else {
            marker.strip_prefix("Bounds latency:").map(|why| (Class::Bounded, why.trim().to_string()))
        }
    }
}

/// Where a test binary's tests can run, from its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marks {
    /// The whole file's class (its module doc's strictest marker), and why.
    pub file: (Class, String),
    /// Test functions of a stricter class than the file's, by name.
    pub tests: Vec<(String, Class)>,
}
/// One run of a test binary: all of it, its tests but those of stricter classes, or those.
#[derive(Debug, Clone)]
struct Job {
    binary: Binary,
    class: Class,
    part: Part,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    All,
    Skipping(Vec<String>),
    Only(Vec<String>),
}

/// What one run came to.
struct Outcome {
    job: Job,
    /// Its output.
    log: PathBuf,
    passed: u64,
    failed: u64,
    took: Duration,
    /// Why the binary itself failed beyond its tests (exit status, timeout), if it did.
    broke: Option<String>,
}

/// Builds the workspace's libraries, binaries and tests in one cargo command; the test binaries.
pub fn build() -> Result<Vec<Binary>> {
    let mut command = cargo();
    command
        .args(["build", "--workspace", "--lib", "--bins", "--tests", "--message-format=json-render-diagnostics"])
        .stdout(Stdio::piped());
    let mut child = command.spawn().with_context(|| format!("cannot start {command:?}"))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let mut binaries = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            println!("{line}");
            continue;
        };
        if let Some(binary) = test_binary(&message)? {
            binaries.push(binary);
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(binaries)
}

/// The test binary a cargo `compiler-artifact` message names, if it names one.
fn test_binary(message: &Value) -> Result<Option<Binary>> {
    if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
        return Ok(None);
    }
    let Some(executable) = message["executable"].as_str() else { return Ok(None) };
    let target = &message["target"];
    let src = PathBuf::from(target["src_path"].as_str().context("an artifact without src_path")?);
    let manifest = PathBuf::from(message["manifest_path"].as_str().context("an artifact without manifest_path")?);
    let manifest_dir = manifest.parent().context("a manifest path without a directory")?.to_path_buf();
    let package = package_name(message["package_id"].as_str().context("an artifact without package_id")?);
    let relative = src.strip_prefix(&manifest_dir).unwrap_or(&src).display().to_string();
    let integration = target["kind"].as_array().is_some_and(|kinds| kinds.iter().any(|k| k == "test"));
    let label = if integration { relative } else { format!("unittests {relative}") };
    let source = fs::read_to_string(&src).with_context(|| format!("cannot read {}", src.display()))?;
    Ok(Some(Binary {
        label,
        package,
        executable: PathBuf::from(executable),
        manifest_dir,
        marks: marks(&source),
        weight: source.len() as u64,
    }))
}

/// The package's name in a package id: `path+file:///w/tests/e2e#0.1.0` (named as its
/// directory) or `path+file:///w/tests/fake#fakecuda@0.1.0`.
fn package_name(id: &str) -> String {
    let (url, fragment) = id.rsplit_once('#').unwrap_or((id, ""));
    match fragment.split_once('@') {
        Some((name, _)) => name.to_string(),
        None => url.rsplit('/').next().unwrap_or(url).to_string(),
    }
}

/// Where a test's source says its tests can run: its module doc's markers for the file, a
/// test function doc's for that test.
fn marks(source: &str) -> Marks {
    let mut file = (Class::Shared, String::new());
    let mut tests = Vec::new();
    let mut pending: Option<Class> = None;
    for line in source.lines().map(str::trim) {
        if let Some((class, why)) = line.strip_prefix("//!").and_then(|doc| Class::of(doc.trim())) {
            if class > file.0 {
                file = (class, why);
            }
        } else if let Some((class, _)) = line.strip_prefix("///").and_then(|doc| Class::of(doc.trim())) {
            pending = pending.max(Some(class));
        } else if let Some(rest) = ["fn ", "pub fn ", "async fn "].iter().find_map(|item| line.strip_prefix(item)) {
            if let Some(class) = pending.take() {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                tests.push((name, class));
            }
        } else if !(line.starts_with("///") || line.starts_with("#[") || line.starts_with("//") || line.is_empty()) {
            // A marker belongs to the function its doc is on, not to the next one.
            pending = None;
        }
    }
    tests.retain(|(_, class)| *class > file.0);
    Marks { file, tests }
}

/// The runs of `binaries`: one for each class a binary's tests have.
fn jobs(binaries: Vec<Binary>) -> Vec<Job> {
    let mut jobs = Vec::new();
    for binary in binaries {
        let file = binary.marks.file.0;
        let marked: Vec<String> = binary.marks.tests.iter().map(|(name, _)| name.clone()).collect();
        let part = if marked.is_empty() { Part::All } else { Part::Skipping(marked) };
        for class in [Class::Bounded, Class::Alone] {
            let names: Vec<String> = binary.marks.tests.iter().filter(|(_, c)| *c == class).map(|(name, _)| name.clone()).collect();
            if !names.is_empty() {
                jobs.push(Job { binary: binary.clone(), class, part: Part::Only(names) });
            }
        }
        jobs.push(Job { binary, class: file, part });
    }
    jobs
}

/// Runs every binary (the shared and bounded runs [`LANES`] at a time, one bounded at most,
/// then those alone, one by one); the (passed, failed) totals. Fails if any run failed.
pub fn run(binaries: Vec<Binary>) -> Result<(u64, u64)> {
    let lanes = std::env::var("VRAMGUARD_TEST_LANES").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0).unwrap_or(LANES);
    let logs = debug_dir().join("test-logs");
    fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let mut jobs = jobs(binaries);
    // The bounded ones first (they run one after another), then the largest sources.
    jobs.sort_by(|a, b| b.class.cmp(&a.class).then(b.binary.weight.cmp(&a.binary.weight)).then_with(|| a.binary.label.cmp(&b.binary.label)));
    let (alone, beside): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|job| job.class == Class::Alone);
    println!("\nrunning {} test runs, {lanes} at a time, then {} alone", beside.len(), alone.len());
    let started = Instant::now();
    let mut outcomes = run_lanes(beside, lanes, &logs)?;
    println!("\n== {} runs side by side: {:.1?}", outcomes.len(), started.elapsed());
    let alone_started = Instant::now();
    for job in alone {
        let outcome = run_one(job, &logs);
        report(&outcome);
        outcomes.push(outcome);
    }
    println!("\n== the runs alone: {:.1?}; all tests: {:.1?}", alone_started.elapsed(), started.elapsed());
    let passed = outcomes.iter().map(|o| o.passed).sum();
    let failed: u64 = outcomes.iter().map(|o| o.failed + u64::from(o.broke.is_some() && o.failed == 0)).sum();
    let broken: Vec<String> = outcomes
        .iter()
        .filter(|o| o.failed > 0 || o.broke.is_some())
        .map(|o| format!("{} ({})", o.job.binary.label, o.broke.clone().unwrap_or_else(|| format!("{} failed", o.failed))))
        .collect();
    if !broken.is_empty() {
        println!("{passed} passed, {failed} failed");
        bail!("test binaries failed: {}", broken.join(", "));
    }
    Ok((passed, failed))
}

/// Runs `jobs` on `lanes` threads, each taking the first job it may start when its last one
/// ends: one whose binary is not running already (two runs of one binary would share its fake
/// driver), shared, or bounded while no other bounded one runs.
fn run_lanes(jobs: Vec<Job>, lanes: usize, logs: &Path) -> Result<Vec<Outcome>> {
    let count = jobs.len();
    let queue = Arc::new(Lanes { queue: Mutex::new(Queue { jobs: VecDeque::from(jobs), running: Vec::new() }), changed: Condvar::new() });
    let (done, outcomes) = mpsc::channel();
    let mut workers = Vec::new();
    for _ in 0..lanes.min(count) {
        let queue = Arc::clone(&queue);
        let done = done.clone();
        let logs = logs.to_path_buf();
        workers.push(std::thread::spawn(move || {
            while let Some(started) = queue.next() {
                if done.send(run_one(started.job.clone(), &logs)).is_err() {
                    break;
                }
            }
        }));
    }
    drop(done);
    let mut all = Vec::with_capacity(count);
    for outcome in outcomes {
        report(&outcome);
        all.push(outcome);
    }
    for worker in workers {
        if worker.join().is_err() {
            bail!("a test lane panicked");
        }
    }
    Ok(all)
}

/// The jobs waiting for a lane, and the running ones' binaries and classes.
struct Queue {
    jobs: VecDeque<Job>,
    running: Vec<(PathBuf, Class)>,
}

struct Lanes {
    queue: Mutex<Queue>,
    changed: Condvar,
}

/// A job a lane runs; its end (even by a panic) lets the jobs it held back start.
struct Started<'a> {
    lanes: &'a Lanes,
    job: Job,
}

impl Lanes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next job a lane may start, waiting while none may; `None` once none is left.
    fn next(&self) -> Option<Started<'_>> {
        let mut queue = self.lock();
        loop {
            let may_start = |job: &Job| {
                !queue.running.iter().any(|(binary, class)| *binary == job.binary.executable || (*class == Class::Bounded && job.class == Class::Bounded))
            };
            if let Some(at) = queue.jobs.iter().position(may_start) {
                let job = queue.jobs.remove(at)?;
                queue.running.push((job.binary.executable.clone(), job.class));
                return Some(Started { lanes: self, job });
            }
            if queue.jobs.is_empty() {
                return None;
            }
            queue = self.changed.wait(queue).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

impl Drop for Started<'_> {
    fn drop(&mut self) {
        let mut queue = self.lanes.lock();
        if let Some(at) = queue.running.iter().position(|(binary, class)| *binary == self.job.binary.executable && *class == self.job.class) {
            queue.running.remove(at);
        }
        drop(queue);
        self.lanes.changed.notify_all();
    }
}

/// Runs one job with its output in `logs`; what it came to.
fn run_one(job: Job, logs: &Path) -> Outcome {
    let started = Instant::now();
    let name = job.binary.executable.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let suffix = match (&job.part, job.class) {
        (Part::Only(_), Class::Alone) => ".alone",
        (Part::Only(_), _) => ".bounded",
        _ => "",
    };
    let log = logs.join(format!("{name}{suffix}.log"));
    let _ = fs::remove_file(&log);
    let mut broke = match spawn_and_wait(&job, &log) {
        Ok(None) => None,
        Ok(Some(why)) => Some(why),
        Err(error) => Some(format!("{error:#}")),
    };
    let (passed, failed) = fs::read_to_string(&log)
        .map(|text| text.lines().filter_map(parse_test_result).fold((0, 0), |(p, f), (passed, failed)| (p + passed, f + failed)))
        .unwrap_or((0, 0));
    // A name that matches no test (a test in a module, a typo) would run it nowhere.
    if let Part::Only(names) = &job.part {
        if broke.is_none() && passed + failed != names.len() as u64 {
            broke = Some(format!("{} tests are marked {:?} ({}) but {} ran", names.len(), job.class, names.join(", "), passed + failed));
        }
    }
    Outcome { job, log, passed, failed, took: started.elapsed(), broke }
}

/// Starts the job's binary in a process group of its own, its output to `log`, and waits up to
/// [`BINARY_LIMIT`]: `Some(why)` when it did not exit successfully.
fn spawn_and_wait(job: &Job, log: &Path) -> Result<Option<String>> {
    let binary = &job.binary;
    let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut command = Command::new(&binary.executable);
    if binary.package == "e2e" {
        // Within one binary, one test at a time: its tests share its fake driver and agents.
        command.arg("--test-threads=1");
    }
    match &job.part {
        Part::All => {}
        Part::Skipping(names) => {
            command.arg("--exact");
            for name in names {
                command.args(["--skip", name]);
            }
        }
        Part::Only(names) => {
            command.arg("--exact").args(names);
        }
    }
    if job.class != Class::Alone {
        // The e2e kit refuses to start an agent that discovers libcuda on the whole node here.
        command.env(e2e::SHARED_NODE, "1");
    }
    let debug = debug_dir();
    let mut library_path = std::env::join_paths([debug.clone(), debug.join("deps")])?;
    if let Some(inherited) = std::env::var_os("LD_LIBRARY_PATH") {
        library_path.push(":");
        library_path.push(inherited);
    }
    command
        .current_dir(&binary.manifest_dir)
        .env("CARGO_MANIFEST_DIR", &binary.manifest_dir)
        .env("CARGO_PKG_NAME", &binary.package)
        .env("LD_LIBRARY_PATH", library_path)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0);
    let mut child = command.spawn().with_context(|| format!("cannot start {}", binary.executable.display()))?;
    let deadline = Instant::now() + BINARY_LIMIT;
    loop {
        if let Some(status) = child.try_wait()? {
            // What it left running in its group (a leaked agent or workload) goes with it.
            // SAFETY: kill(2) on the process group the child led (made by process_group(0)).
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            return Ok((!status.success()).then(|| format!("exited {status}")));
        }
        if Instant::now() >= deadline {
            // SAFETY: kill(2) on the process group the child leads (made by process_group(0)).
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            return Ok(Some(format!("killed after {BINARY_LIMIT:?}")));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Prints a run's output whole, after a line that says what it was and how long it took.
fn report(outcome: &Outcome) {
    let text = fs::read_to_string(&outcome.log).unwrap_or_else(|error| format!("(cannot read {}: {error})\n", outcome.log.display()));
    let status = match (&outcome.broke, outcome.failed) {
        (None, 0) => "ok".to_string(),
        (Some(why), _) => format!("FAILED: {why}"),
        (None, failed) => format!("FAILED: {failed} failed"),
    };
    let binary = &outcome.job.binary;
    let part = match &outcome.job.part {
        Part::All if outcome.job.class == Class::Shared => String::new(),
        Part::All => format!(", {:?}: {}", outcome.job.class, binary.marks.file.1),
        Part::Only(names) => format!(", {:?}: {}", outcome.job.class, names.join(", ")),
        Part::Skipping(names) => format!(", but {}", names.join(", ")),
    };
    println!(
        "     Running {} {} ({}{part}) [{:.1?}, {status}]\n{}",
        binary.package,
        binary.label,
        binary.executable.display(),
        outcome.took,
        text.trim_end()
    );
}

#[cfg(test)]
mod tests {
    use super::{marks, package_name, Class, Marks};

    #[test]
    fn a_package_is_named_from_its_id() {
        assert_eq!(package_name("path+file:///w/tests/e2e#0.1.0"), "e2e");
        assert_eq!(package_name("path+file:///w/tests/fake#fakecuda@0.1.0"), "fakecuda");
        assert_eq!(package_name("registry+https://github.com/rust-lang/crates.io-index#serde@1.0.0"), "serde");
    }

    #[test]
    fn a_test_says_where_it_runs_in_its_module_or_function_doc() {
        let all = "//! The discovery's tests.\n//!\n//! Runs alone: its agents discover libcuda.\nuse e2e;\n/// Bounds latency: x\n#[test]\nfn a() {}\n";
        assert_eq!(marks(all), Marks { file: (Class::Alone, "its agents discover libcuda.".into()), tests: vec![] });
        let some = "//! Mostly shares.\n/// A test.\n/// Bounds latency: /healthz.\n#[test]\nfn bounded() -> Result<()> {}\n\n#[test]\nfn other() {}\n/// Runs alone: discovery.\n/// Bounds latency: too.\n#[test]\npub fn third_one() {}\n";
        assert_eq!(
            marks(some),
            Marks { file: (Class::Shared, String::new()), tests: vec![("bounded".into(), Class::Bounded), ("third_one".into(), Class::Alone)] }
        );
        let bounded = "//! Bounds latency: attacks.\n/// Bounds latency: also.\n#[test]\nfn a() {}\n/// Runs alone: discovery.\n#[test]\nfn b() {}\n";
        assert_eq!(marks(bounded), Marks { file: (Class::Bounded, "attacks.".into()), tests: vec![("b".into(), Class::Alone)] });
        assert_eq!(marks("//! Shares the node.\nfn main() {}\n"), Marks { file: (Class::Shared, String::new()), tests: vec![] });
        // A marker on something else is not the next function's; `async fn` is a function.
        let stray = "/// Runs alone: a struct's.\nstruct S;\nfn a() {}\n/// Bounds latency: x\n#[tokio::test]\nasync fn b() {}\n";
        assert_eq!(marks(stray), Marks { file: (Class::Shared, String::new()), tests: vec![("b".into(), Class::Bounded)] });
    }
}
