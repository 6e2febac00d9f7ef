//! `cargo xtask setup`'s containerd part: fetches the Debian packages the end-to-end tests
//! run a real containerd from (`e2e::containerd::PACKAGES`: containerd 1.7 with NRI, runc,
//! busybox) and keeps their binaries in `target/containerd/`, so the tests run offline; and
//! containerd 2 (`e2e::containerd::PACKAGES_2`: Debian unstable's daemon, shim and `ctr`) in
//! `target/containerd-2/`, which the tests' containerd 2 runs with the first cache's runc.
//!
//! Nothing is installed on the system: `apt-get` runs with a private state, cache and source
//! list (the suites the packages come from, signed by the keys of Debian's archive keyring)
//! under `target/containerd.fetch/`, `apt-get download` fetches the packages and `dpkg-deb -x`
//! unpacks them there; the binaries named in `PACKAGES` are moved into a fresh cache, which
//! replaces any old one whole once its `VERSIONS` file (package and version per line) is
//! written. A complete cache is left alone ("present"). [`setup_set`] does the same for another
//! set of packages into another cache (`target/prometheus/`: [`crate::prometheus`]).
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};
use e2e::containerd::{cached_name, Cache, Package, Version, PACKAGES, VERSIONS_FILE};

/// Debian's archive, as the machine's own apt sources name it.
const ARCHIVE: &str = "http://deb.debian.org/debian";
/// The keyring apt checks the suites' signatures with (package `debian-archive-keyring`;
/// bookworm's holds trixie's keys too).
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

pub(crate) fn target() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| crate::root().join("target"))
}

/// Fills `target/containerd/` and `target/containerd-2/` unless they are complete.
pub fn setup() -> Result<()> {
    // runc from bookworm links the host's libseccomp: it must run here.
    setup_set("containerd", PACKAGES, &Cache::dir_in(&target()), &["containerd", "runc"])?;
    // Unstable moves: whatever it has now must still be a containerd 2.
    let dir = Version::V2.cache_dir_in(&target());
    setup_set("containerd 2", Version::V2.packages(), &dir, &["containerd", "ctr"])?;
    let cache = Cache::open_set(&dir, Version::V2.packages())?;
    let said = output(Command::new(cache.bin("containerd")).arg("--version"))?;
    let version = said.split_whitespace().nth(2).unwrap_or_default();
    if !Version::V2.answers(version) {
        bail!(
            "{} says {:?}: Debian unstable's containerd is no longer a 2.x; remove {} and pin another suite in \
             e2e::containerd::PACKAGES_2",
            cache.bin("containerd").display(),
            said.trim(),
            dir.display()
        );
    }
    Ok(())
}

/// Fills the cache `dir` (named `what` in messages) with the files of `packages` unless it is
/// complete; the cached binaries named in `check` must answer `--version` on this machine.
pub fn setup_set(what: &str, packages: &'static [Package], dir: &Path, check: &[&str]) -> Result<()> {
    if let Ok(cache) = Cache::open_set(dir, packages) {
        println!("setup: {what} for the e2e tests in {}: present ({})", dir.display(), one_line(cache.versions()));
        return Ok(());
    }
    let start = Instant::now();
    let work = dir.with_extension("fetch");
    let _ = fs::remove_dir_all(&work);
    let result = fetch(&work, dir, packages, check);
    let _ = fs::remove_dir_all(&work);
    let versions = result?;
    println!("setup: {what} for the e2e tests: fetched {} into {} in {:.1?}", one_line(&versions), dir.display(), start.elapsed());
    Ok(())
}

pub(crate) fn one_line(versions: &str) -> String {
    versions.lines().collect::<Vec<_>>().join(", ")
}

/// Downloads and unpacks `packages` in `work`, fills the cache `dir`; the versions.
fn fetch(work: &Path, dir: &Path, packages: &'static [Package], check: &[&str]) -> Result<String> {
    let names: Vec<&str> = packages.iter().map(|p| p.name).collect();
    let names = names.join(", ");
    for tool in ["apt-get", "dpkg-deb"] {
        if Command::new(tool).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
            bail!("`{tool}` is not installed: fetching {names} for the e2e tests needs Debian's apt and dpkg");
        }
    }
    if !Path::new(KEYRING).is_file() {
        bail!("{KEYRING} is missing: install the package debian-archive-keyring (apt checks the suites' signatures with it)");
    }
    let mut suites: Vec<&str> = packages.iter().map(|p| p.suite).collect();
    suites.sort_unstable();
    suites.dedup();
    let apt = Apt::new(work, &suites)?;
    println!("setup: fetching {names} from Debian's archive (private apt state in {})", work.display());
    apt.run("update", &[], work).context("cannot read the package lists of Debian's archive (is the network down?)")?;
    let downloads = work.join("downloads");
    fs::create_dir_all(&downloads)?;
    let wanted: Vec<String> = packages.iter().map(|p| format!("{}/{}", p.name, p.suite)).collect();
    let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
    apt.run("download", &wanted, &downloads).with_context(|| format!("cannot download {}", wanted.join(" ")))?;

    let fresh = dir.with_extension("new");
    let _ = fs::remove_dir_all(&fresh);
    fs::create_dir_all(fresh.join("bin")).with_context(|| format!("cannot create {}", fresh.join("bin").display()))?;
    let mut versions = String::new();
    for package in packages {
        let deb = find_deb(&downloads, package.name)?;
        let unpacked = work.join("unpacked").join(package.name);
        fs::create_dir_all(&unpacked).with_context(|| format!("cannot create {}", unpacked.display()))?;
        crate::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))
            .with_context(|| format!("cannot unpack {}", deb.display()))?;
        let version = output(Command::new("dpkg-deb").args(["--showformat=${Version}", "--show"]).arg(&deb))?;
        versions.push_str(&format!("{} {} ({})\n", package.name, version.trim(), package.suite));
        for file in package.files {
            let from = unpacked.join(file);
            fs::rename(&from, fresh.join("bin").join(cached_name(file)))
                .with_context(|| format!("{} has no {file} (package layout changed?)", deb.display()))?;
        }
    }
    for &name in check {
        output(Command::new(fresh.join("bin").join(name)).arg("--version"))
            .with_context(|| format!("the fetched {name} does not run on this machine"))?;
    }
    fs::write(fresh.join(VERSIONS_FILE), &versions)?;
    let _ = fs::remove_dir_all(dir);
    fs::rename(&fresh, dir).with_context(|| format!("cannot move {} to {}", fresh.display(), dir.display()))?;
    Cache::open_set(dir, packages)?;
    Ok(versions)
}

/// The `.deb` of `package` that `apt-get download` left in `dir` (`<name>_<version>_<arch>.deb`).
pub(crate) fn find_deb(dir: &Path, package: &str) -> Result<PathBuf> {
    let prefix = format!("{package}_");
    for entry in fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(entry.path());
        }
    }
    bail!("apt-get download left no {package}_*.deb in {}", dir.display())
}

/// `apt-get` on a private state directory whose sources are the given suites of Debian's
/// archive (also used by [`crate::image`]).
pub(crate) struct Apt {
    options: Vec<String>,
}

impl Apt {
    pub(crate) fn new(work: &Path, suites: &[&str]) -> Result<Apt> {
        let state = work.join("state");
        let cache = work.join("cache");
        let etc = work.join("etc");
        for dir in [state.join("lists/partial"), cache.join("archives/partial"), etc.join("sources.list.d"), etc.join("preferences.d")] {
            fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        fs::write(state.join("status"), "")?;
        let sources: String = suites.iter().map(|suite| format!("deb [signed-by={KEYRING}] {ARCHIVE} {suite} main\n")).collect();
        fs::write(etc.join("sources.list"), sources)?;
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        let options = [
            ("Dir::State", path(state.clone())),
            ("Dir::State::status", path(state.join("status"))),
            ("Dir::Cache", path(cache)),
            ("Dir::Etc::SourceList", path(etc.join("sources.list"))),
            ("Dir::Etc::SourceParts", path(etc.join("sources.list.d"))),
            ("Dir::Etc::Preferences", path(etc.join("preferences"))),
            ("Dir::Etc::PreferencesParts", path(etc.join("preferences.d"))),
            // Only the package lists: no translations, no AppStream metadata.
            ("Acquire::Languages", "none".into()),
            ("Acquire::IndexTargets::deb::DEP-11::DefaultEnabled", "false".into()),
            ("Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled", "false".into()),
            ("Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled", "false".into()),
            ("Acquire::IndexTargets::deb::DEP-11-icons-hidpi::DefaultEnabled", "false".into()),
            ("Acquire::IndexTargets::deb::CNF::DefaultEnabled", "false".into()),
            // The downloads land in target/, which the sandbox user `_apt` may not write.
            ("APT::Sandbox::User", "root".into()),
        ];
        Ok(Apt { options: options.iter().flat_map(|(k, v)| ["-o".to_string(), format!("{k}={v}")]).collect() })
    }

    /// `apt-get -q <options> <verb> <args>` in `cwd`; fails with apt's own error lines.
    pub(crate) fn run(&self, verb: &str, args: &[&str], cwd: &Path) -> Result<()> {
        let mut command = Command::new("apt-get");
        command.arg("-q").args(&self.options).arg(verb);
        if verb == "update" {
            // Without it, an index that cannot be fetched is only a warning.
            command.arg("--error-on=any");
        }
        let out = command.args(args).current_dir(cwd).stdin(Stdio::null()).output().context("cannot run apt-get")?;
        if out.status.success() {
            return Ok(());
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // `Err:` lines (stdout) name what failed and, on the next line, why.
        let mut lines: Vec<&str> = Vec::new();
        let mut after_err = false;
        for line in stdout.lines() {
            if line.starts_with("Err:") || (after_err && line.starts_with(' ')) {
                lines.push(line);
                after_err = true;
            } else {
                after_err = false;
            }
        }
        lines.extend(stderr.lines().filter(|l| l.starts_with("E:") || l.starts_with("W:")));
        let hint = if stderr.contains("NO_PUBKEY") {
            format!("\n(hint: {KEYRING} lacks a suite's signing key: upgrade debian-archive-keyring)")
        } else {
            String::new()
        };
        bail!("apt-get {verb} failed ({}):\n{}{hint}", out.status, lines.join("\n"))
    }
}

/// A command's stdout; fails with its stderr.
pub(crate) fn output(command: &mut Command) -> Result<String> {
    let out: Output = command.stdin(Stdio::null()).output().with_context(|| format!("cannot start {command:?}"))?;
    if !out.status.success() {
        bail!("{command:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim_end());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
