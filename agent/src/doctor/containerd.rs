//! containerd's side: its config file (version 2: containerd 1.7, which 2.x reads too;
//! version 3: containerd 2.x), NRI (off by default in 1.7, on in 2.x) and its socket, CDI
//! (`enable_cdi`, `cdi_spec_dirs`: off by default in 1.7, on in 2.x) and the NVIDIA runtime.
use std::{
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
};

use toml_edit::{DocumentMut, Item};

use super::Check;

pub const CONFIG: &str = "/etc/containerd/config.toml";
/// Where containerd (and CRI-O) put the NRI socket unless told otherwise.
pub const NRI_SOCKET: &str = "/var/run/nri/nri.sock";
/// The NRI plugin's table under `plugins` (the same name in both versions).
const NRI_PLUGIN: &str = "io.containerd.nri.v1.nri";
/// The CRI plugin's table that holds `enable_cdi` and the runtimes: version 2.
const CRI_V2: &str = "io.containerd.grpc.v1.cri";
/// The same for version 3.
const CRI_V3: &str = "io.containerd.cri.v1.runtime";
/// containerd's default `cdi_spec_dirs`.
const CDI_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// What the config file says, as far as the agent cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// `version` (1 where absent, as containerd reads it).
    pub version: i64,
    /// The NRI plugin's `disable`, where set.
    pub nri_disable: Option<bool>,
    /// The NRI plugin's `socket_path`, where set.
    pub nri_socket: Option<String>,
    /// `enable_cdi`, where set.
    pub enable_cdi: Option<bool>,
    /// `cdi_spec_dirs`, where set.
    pub cdi_dirs: Option<Vec<String>>,
    /// The `nvidia` runtime's binary (`options.BinaryName`, else its `runtime_type`), where
    /// the runtime is configured.
    pub nvidia_runtime: Option<String>,
    /// `default_runtime_name`, where set.
    pub default_runtime: Option<String>,
}

impl Config {
    /// The table of the CRI plugin that holds `enable_cdi` and the runtimes, in this version.
    fn cri_table(&self) -> &'static str {
        if self.version >= 3 {
            CRI_V3
        } else {
            CRI_V2
        }
    }
}

/// The config file as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Loaded {
    /// No file: containerd runs on its defaults (or this process does not see the host's).
    Missing,
    Unreadable(String),
    /// Not TOML, or a field of the wrong type (containerd refuses it too).
    Invalid(String),
    Read(Config),
}

/// What a socket path holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Socket {
    Missing,
    NotASocket,
    Socket,
}

/// What the containerd checks read.
#[derive(Clone, Debug)]
pub struct Facts {
    pub config_path: PathBuf,
    pub config: Loaded,
    /// The NRI socket as the host names it (what the config's `socket_path` is compared with).
    pub socket_host: PathBuf,
    /// Where this process sees it.
    pub socket_seen: PathBuf,
    pub socket: Socket,
}

impl Facts {
    pub fn read(config_path: &Path, socket_host: &Path, socket_seen: &Path) -> Facts {
        let config = match std::fs::read_to_string(config_path) {
            Ok(text) => parse(&text).map_or_else(Loaded::Invalid, Loaded::Read),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Loaded::Missing,
            Err(error) => Loaded::Unreadable(error.to_string()),
        };
        let socket = match std::fs::metadata(socket_seen) {
            Ok(meta) if meta.file_type().is_socket() => Socket::Socket,
            Ok(_) => Socket::NotASocket,
            Err(_) => Socket::Missing,
        };
        Facts { config_path: config_path.to_path_buf(), config, socket_host: socket_host.to_path_buf(), socket_seen: socket_seen.to_path_buf(), socket }
    }

    /// The config, where one was read in a version this reads (2 or 3).
    fn known(&self) -> Option<&Config> {
        match &self.config {
            Loaded::Read(config) if matches!(config.version, 2 | 3) => Some(config),
            _ => None,
        }
    }
}

/// A key's value of the type `get` takes, `None` where absent, an error where of another type.
fn typed<T>(table: Option<&Item>, path: &str, key: &str, get: impl Fn(&Item) -> Option<T>) -> Result<Option<T>, String> {
    match table.and_then(|t| t.get(key)) {
        None => Ok(None),
        Some(item) => get(item).map(Some).ok_or_else(|| format!("{path}.{key} has the wrong type")),
    }
}

/// Reads what the checks need from a config file's text.
pub fn parse(text: &str) -> Result<Config, String> {
    let document: DocumentMut = text.parse().map_err(|error| format!("not valid TOML: {error}"))?;
    let root = Some(document.as_item());
    let version = typed(root, "", "version", Item::as_integer)?.unwrap_or(1);
    let plugins = document.get("plugins");
    let nri = plugins.and_then(|p| p.get(NRI_PLUGIN));
    let nri_path = format!("plugins.\"{NRI_PLUGIN}\"");
    let mut config = Config { version, ..Config::default() };
    let cri_name = config.cri_table();
    let cri = plugins.and_then(|p| p.get(cri_name));
    let cri_path = format!("plugins.\"{cri_name}\"");
    let containerd = cri.and_then(|c| c.get("containerd"));
    let nvidia = containerd.and_then(|c| c.get("runtimes")).and_then(|r| r.get("nvidia"));
    let nvidia_path = format!("{cri_path}.containerd.runtimes.nvidia");
    let strings = |item: &Item| item.as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect::<Vec<_>>());
    config.nri_disable = typed(nri, &nri_path, "disable", Item::as_bool)?;
    config.nri_socket = typed(nri, &nri_path, "socket_path", |i| i.as_str().map(str::to_owned))?;
    config.enable_cdi = typed(cri, &cri_path, "enable_cdi", Item::as_bool)?;
    config.cdi_dirs = typed(cri, &cri_path, "cdi_spec_dirs", strings)?;
    config.default_runtime = typed(containerd, &format!("{cri_path}.containerd"), "default_runtime_name", |i| i.as_str().map(str::to_owned))?;
    if nvidia.is_some() {
        let binary = typed(nvidia.and_then(|n| n.get("options")), &format!("{nvidia_path}.options"), "BinaryName", |i| i.as_str().map(str::to_owned))?;
        let kind = typed(nvidia, &nvidia_path, "runtime_type", |i| i.as_str().map(str::to_owned))?;
        config.nvidia_runtime = Some(binary.or(kind).unwrap_or_default());
    }
    Ok(config)
}

/// A path with `/var/run` written as `/run` (one directory on every current distribution).
fn same_path(a: &str, b: &str) -> bool {
    let plain = |p: &str| p.strip_prefix("/var/run/").map_or_else(|| p.trim_end_matches('/').to_owned(), |rest| format!("/run/{}", rest.trim_end_matches('/')));
    plain(a) == plain(b)
}

pub fn checks(facts: &Facts, cdi_dir: &Path) -> Vec<Check> {
    vec![config(facts), nri(facts), cdi(facts, cdi_dir), nvidia_runtime(facts)]
}

pub fn config(facts: &Facts) -> Check {
    let path = facts.config_path.display();
    match &facts.config {
        Loaded::Missing => Check::warn(
            "containerd-config",
            format!("{path} not found: containerd runs on its defaults (NRI and CDI off in 1.7, on in 2.x), or this process does not see the host's /etc/containerd"),
            "run `vramguard doctor` on the host, or give --root or --containerd-config",
        ),
        Loaded::Unreadable(error) => Check::warn("containerd-config", format!("cannot read {path}: {error}"), "run `vramguard doctor` as root on the host"),
        Loaded::Invalid(error) => Check::fail("containerd-config", format!("{path}: {error}"), "fix the file: containerd refuses it as well"),
        Loaded::Read(config) => match config.version {
            2 => Check::ok("containerd-config", format!("{path}: version 2 (containerd 1.7; 2.x reads it too)")),
            3 => Check::ok("containerd-config", format!("{path}: version 3 (containerd 2.x)")),
            version => Check::warn(
                "containerd-config",
                format!("{path}: version {version}, a format this check does not read (NRI, CDI and the runtimes are not checked)"),
                "move to a version 2 (containerd 1.7) or version 3 (`containerd config migrate`, containerd 2.x) config",
            ),
        },
    }
}

pub fn nri(facts: &Facts) -> Check {
    let (host, seen) = (facts.socket_host.display(), facts.socket_seen.display());
    let config = facts.known();
    let path = facts.config_path.display();
    let enable = format!("set `disable = false` under [plugins.\"{NRI_PLUGIN}\"] in {path} and restart containerd");
    if let Some(wanted) = config.and_then(|c| c.nri_socket.as_deref()).filter(|wanted| !same_path(wanted, &host.to_string())) {
        return Check::fail(
            "nri",
            format!("containerd's NRI socket is {wanted} ({path}), the agent dials {host}"),
            format!("give `run --nri-socket {wanted}` and mount its directory into the agent's pod, or set socket_path to {host}"),
        );
    }
    let disabled = config.and_then(|c| c.nri_disable) == Some(true);
    match facts.socket {
        Socket::Socket if disabled => Check::warn(
            "nri",
            format!("the socket is at {seen}, but {path} disables NRI: it goes at containerd's next restart (or containerd reads another file)"),
            enable,
        ),
        Socket::Socket => {
            let why = match config {
                Some(c) if c.nri_disable == Some(false) => "enabled in the config",
                Some(c) if c.version == 2 => "on by default: containerd 2.x with a version 2 config",
                _ => "NRI is on",
            };
            Check::ok("nri", format!("socket at {seen} ({why})"))
        }
        Socket::NotASocket => Check::fail("nri", format!("{seen} exists but is not a socket"), format!("remove it and restart containerd; {enable}")),
        Socket::Missing if disabled => Check::fail("nri", format!("NRI is disabled in {path} (disable = true), and no socket at {seen}"), enable),
        Socket::Missing if config.is_some_and(|c| c.version == 2 && c.nri_disable.is_none()) => Check::fail(
            "nri",
            format!("no socket at {seen}: NRI is off (containerd 1.7 turns it on only when asked; {path} does not)"),
            format!("add [plugins.\"{NRI_PLUGIN}\"] with `disable = false` to {path} and restart containerd (or move to containerd 2.x)"),
        ),
        Socket::Missing => Check::fail(
            "nri",
            format!("no socket at {seen}: containerd is not running, was not restarted since NRI was enabled, or the socket's directory is not mounted here"),
            format!("restart containerd; in the pod, keep the DaemonSet's `nri` volume; {enable} if it is off"),
        ),
    }
}

pub fn cdi(facts: &Facts, cdi_dir: &Path) -> Check {
    let Some(config) = facts.known() else {
        return Check::warn("cdi", "not checked: no version 2 or 3 config read", "run `vramguard doctor` where containerd's config is (see the containerd-config line)");
    };
    let path = facts.config_path.display();
    let table = config.cri_table();
    let dirs: Vec<String> = config.cdi_dirs.clone().unwrap_or_else(|| CDI_DIRS.map(str::to_owned).to_vec());
    let turn_on = format!("set `enable_cdi = true` under [plugins.\"{table}\"] in {path} and restart containerd");
    match config.enable_cdi {
        Some(false) => Check::warn("cdi", "CDI off (enable_cdi = false): `run --dra` gives claims to containers through CDI specs", turn_on),
        None if config.version == 2 => Check::warn(
            "cdi",
            "enable_cdi not set: CDI is off in containerd 1.7 (on in 2.x); `run --dra` gives claims to containers through CDI specs",
            turn_on,
        ),
        _ if !dirs.iter().any(|d| same_path(d, &cdi_dir.display().to_string())) => Check::warn(
            "cdi",
            format!("CDI on, specs read from {}; `run --dra` writes them to {}", dirs.join(", "), cdi_dir.display()),
            format!("add {} to cdi_spec_dirs under [plugins.\"{table}\"], or give `run --cdi-dir` one of those", cdi_dir.display()),
        ),
        _ => Check::ok("cdi", format!("CDI on, specs read from {}", dirs.join(", "))),
    }
}

pub fn nvidia_runtime(facts: &Facts) -> Check {
    let Some(config) = facts.known() else {
        return Check::warn("nvidia-runtime", "not checked: no version 2 or 3 config read", "run `vramguard doctor` where containerd's config is (see the containerd-config line)");
    };
    let default = config.default_runtime.as_deref().map(|name| format!("; default runtime {name}")).unwrap_or_default();
    match &config.nvidia_runtime {
        Some(binary) if binary.is_empty() => Check::ok("nvidia-runtime", format!("runtime `nvidia` configured{default}")),
        Some(binary) => Check::ok("nvidia-runtime", format!("runtime `nvidia` ({binary}){default}")),
        None => Check::warn(
            "nvidia-runtime",
            format!("no `nvidia` runtime in {}: the DaemonSet's `runtimeClassName: nvidia` cannot start the agent's pod (it gets NVML and the device files through it)", facts.config_path.display()),
            "`nvidia-ctk runtime configure --runtime=containerd` and restart containerd, or give the agent's pod the GPUs through CDI (deploy/kubernetes/daemonset.yaml)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    /// containerd 1.7's config as `containerd config default` writes it, cut to what matters:
    /// NRI's table with `disable = true`, no CDI.
    const V2_NRI_OFF: &str = r#"
version = 2
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    enable_cdi = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
  [plugins."io.containerd.nri.v1.nri"]
    disable = true
    socket_path = "/var/run/nri/nri.sock"
"#;
    /// A 1.7 node set up for the agent by hand: NRI and CDI on, the NVIDIA runtime.
    const V2_READY: &str = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/run/cdi"]
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/bin/nvidia-container-runtime"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
"#;
    /// containerd 2.x's: nothing said of NRI or CDI (both on), no NVIDIA runtime.
    const V3_DEFAULTS: &str = "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd]\n  default_runtime_name = 'runc'\n";

    fn facts(config: Loaded, socket: Socket) -> Facts {
        Facts { config_path: CONFIG.into(), config, socket_host: NRI_SOCKET.into(), socket_seen: NRI_SOCKET.into(), socket }
    }

    fn read(text: &str) -> Loaded {
        Loaded::Read(parse(text).expect("parses"))
    }

    #[test]
    fn reads_both_versions() {
        let off = parse(V2_NRI_OFF).expect("v2");
        assert_eq!((off.version, off.nri_disable, off.enable_cdi, off.nvidia_runtime.as_deref()), (2, Some(true), Some(false), None));
        assert_eq!(off.default_runtime.as_deref(), Some("runc"));
        let ready = parse(V2_READY).expect("v2");
        assert_eq!(ready.nvidia_runtime.as_deref(), Some("/usr/bin/nvidia-container-runtime"));
        assert_eq!(ready.cdi_dirs, Some(vec!["/etc/cdi".to_owned(), "/run/cdi".to_owned()]));
        let v3 = parse(V3_DEFAULTS).expect("v3");
        assert_eq!((v3.version, v3.nri_disable, v3.enable_cdi), (3, None, None));
        assert_eq!(parse("").expect("empty").version, 1);
        assert!(parse("version = 2\n[plugins.\"io.containerd.nri.v1.nri\"]\ndisable = \"no\"\n").expect_err("a string").contains("disable"));
        assert!(parse("version = [").expect_err("not TOML").contains("TOML"));
    }

    #[test]
    fn the_config_file() {
        assert_eq!(config(&facts(read(V2_READY), Socket::Socket)).status, Status::Ok);
        assert_eq!(config(&facts(read(V3_DEFAULTS), Socket::Socket)).status, Status::Ok);
        assert_eq!(config(&facts(Loaded::Missing, Socket::Socket)).status, Status::Warn);
        assert_eq!(config(&facts(read("root = '/x'"), Socket::Socket)).status, Status::Warn, "version 1");
        assert_eq!(config(&facts(Loaded::Invalid("bad".into()), Socket::Socket)).status, Status::Fail);
    }

    #[test]
    fn nri_off_in_a_1_7_config_fails() {
        // Version 2 with nothing about NRI and no socket: containerd 1.7's default.
        let check = nri(&facts(read("version = 2\n"), Socket::Missing));
        assert_eq!(check.status, Status::Fail);
        assert!(check.detail.contains("NRI is off") && check.fix.as_deref().unwrap_or_default().contains("disable = false"), "{check:?}");
        // The same config read by containerd 2.x: the socket is there.
        assert_eq!(nri(&facts(read("version = 2\n"), Socket::Socket)).status, Status::Ok);
        // Disabled outright.
        assert_eq!(nri(&facts(read(V2_NRI_OFF), Socket::Missing)).status, Status::Fail);
        assert_eq!(nri(&facts(read(V2_NRI_OFF), Socket::Socket)).status, Status::Warn, "off at the next restart");
        assert_eq!(nri(&facts(read(V2_READY), Socket::Socket)).status, Status::Ok);
        assert_eq!(nri(&facts(read(V3_DEFAULTS), Socket::Missing)).status, Status::Fail);
        assert_eq!(nri(&facts(read(V3_DEFAULTS), Socket::NotASocket)).status, Status::Fail);
        assert_eq!(nri(&facts(Loaded::Missing, Socket::Socket)).status, Status::Ok);
    }

    #[test]
    fn nri_on_another_socket_fails() {
        let elsewhere = read("version = 3\n[plugins.'io.containerd.nri.v1.nri']\nsocket_path = '/run/containerd/nri.sock'\n");
        let check = nri(&facts(elsewhere, Socket::Socket));
        assert_eq!(check.status, Status::Fail);
        assert!(check.fix.as_deref().unwrap_or_default().contains("--nri-socket /run/containerd/nri.sock"), "{check:?}");
        // /run and /var/run are one directory.
        let same = read("version = 3\n[plugins.'io.containerd.nri.v1.nri']\nsocket_path = '/run/nri/nri.sock'\n");
        assert_eq!(nri(&facts(same, Socket::Socket)).status, Status::Ok);
    }

    #[test]
    fn cdi_on_and_where() {
        let dir = Path::new("/var/run/cdi");
        let check = cdi(&facts(read(V2_READY), Socket::Socket), dir);
        assert_eq!(check.status, Status::Ok);
        assert!(check.detail.contains("/etc/cdi, /run/cdi"), "{check:?}");
        assert_eq!(cdi(&facts(read(V3_DEFAULTS), Socket::Socket), dir).status, Status::Ok, "on by default in 2.x");
        let unset = cdi(&facts(read("version = 2\n"), Socket::Socket), dir);
        assert_eq!(unset.status, Status::Warn);
        assert!(unset.fix.as_deref().unwrap_or_default().contains("io.containerd.grpc.v1.cri"), "{unset:?}");
        assert_eq!(cdi(&facts(read(V2_NRI_OFF), Socket::Socket), dir).status, Status::Warn);
        assert_eq!(cdi(&facts(read(V2_READY), Socket::Socket), Path::new("/opt/cdi")).status, Status::Warn, "another directory");
        assert_eq!(cdi(&facts(Loaded::Missing, Socket::Socket), dir).status, Status::Warn);
    }

    #[test]
    fn the_nvidia_runtime() {
        let check = nvidia_runtime(&facts(read(V2_READY), Socket::Socket));
        assert_eq!(check.status, Status::Ok);
        assert!(check.detail.contains("nvidia-container-runtime"), "{check:?}");
        let missing = nvidia_runtime(&facts(read(V3_DEFAULTS), Socket::Socket));
        assert_eq!(missing.status, Status::Warn);
        assert!(missing.fix.as_deref().unwrap_or_default().contains("nvidia-ctk"), "{missing:?}");
        let v3 = read("version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]\nruntime_type = 'io.containerd.runc.v2'\n");
        assert_eq!(nvidia_runtime(&facts(v3, Socket::Socket)).status, Status::Ok);
    }
}
