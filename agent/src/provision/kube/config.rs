//! Where the API server is and how the agent proves who it is, as a `kube::Config`: the
//! in-cluster service account (`KUBERNETES_SERVICE_HOST`/`PORT`, the token and CA files of a
//! service account directory), a kubeconfig file, or an explicit API URL, token file and CA
//! file (tests, out-of-cluster runs). kube re-reads the token and CA files by itself (once
//! its copy is a minute old), so the kubelet's rotation of projected tokens is followed.
//!
//! The in-cluster configuration is built here rather than by `kube::Config::incluster`,
//! which reads its files from the fixed path only: the same code then serves a pod and a
//! test that points `--kube-service-account-dir` at its own files.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use kube::config::{KubeConfigOptions, Kubeconfig};
use rustls::pki_types::{pem::PemObject, CertificateDer};

use super::KubeError;

/// The service account's files in every pod that mounts its token.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// How long an answer may keep the client waiting between two reads (a watch lasts 290 s at
/// most, with bookmarks in it).
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);
/// The most bytes of a token file (a bound token is about 1 KiB).
const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// The most bytes read from a CA bundle.
const MAX_CA_BYTES: u64 = 4 * 1024 * 1024;

/// How to reach the API server: kube's configuration, checked.
#[derive(Clone, Debug)]
pub struct KubeConfig {
    pub(crate) config: kube::Config,
}

impl KubeConfig {
    /// The configuration a pod gets from its service account: `https://` to
    /// `KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT`, the token, CA and namespace in `dir`
    /// ([`SERVICE_ACCOUNT_DIR`] in a pod).
    pub fn in_cluster(dir: &Path) -> Result<KubeConfig, KubeError> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| {
                KubeError::Config(format!("{name} is not set: not in a pod? (give --kube-api or --kubeconfig)"))
            })
        };
        let (host, port) = (var("KUBERNETES_SERVICE_HOST")?, var("KUBERNETES_SERVICE_PORT")?);
        let port: u16 = port.parse().map_err(|_| KubeError::Config(format!("KUBERNETES_SERVICE_PORT={port:?} is not a port")))?;
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        let mut config = KubeConfig::explicit(
            &format!("https://{host}:{port}"),
            Some(dir.join("token")),
            Some(dir.join("ca.crt")),
        )?;
        // Only the namespace a client defaults to: every request here names its own.
        if let Ok(namespace) = std::fs::read_to_string(dir.join("namespace")) {
            config.config.default_namespace = namespace.trim().to_owned();
        }
        Ok(config)
    }

    /// The current context of the kubeconfig file at `path`, as kube reads it (exec and
    /// token-file credentials included).
    pub async fn kubeconfig(path: &Path) -> Result<KubeConfig, KubeError> {
        let bad = |e: &dyn std::fmt::Display| KubeError::Config(format!("kubeconfig {}: {e}", path.display()));
        let file = Kubeconfig::read_from(path).map_err(|e| bad(&e))?;
        let mut config = kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
            .await
            .map_err(|e| bad(&e))?;
        config.read_timeout = Some(READ_TIMEOUT);
        config.reset_reader_on_write = true;
        Ok(KubeConfig { config })
    }

    /// An API server at `url` (`https://host[:port]`; `http://` only to a loopback address,
    /// for test servers), authenticated by the bearer token in `token_file` if given, its
    /// certificate verified against `ca_file` (PEM; required for `https`).
    pub fn explicit(url: &str, token_file: Option<PathBuf>, ca_file: Option<PathBuf>) -> Result<KubeConfig, KubeError> {
        let bad = |why: &str| KubeError::Config(format!("API URL {url:?}: {why}"));
        let uri: hyper::Uri = url.parse().map_err(|e| bad(&format!("{e}")))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(bad("the scheme must be https (or http to a loopback address)")),
        };
        if uri.path_and_query().is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty()) {
            return Err(bad("a path is not supported (give the server's root)"));
        }
        let host = uri.host().ok_or_else(|| bad("no host"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if !tls && !host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
            return Err(bad("plain http is only allowed to a loopback address (tests)"));
        }
        let mut config = kube::Config::new(uri);
        // kube sets no read timeout (its watcher has its own idle timeout, for watches only):
        // a list the server never answers is cut after this, longer than a watch lasts.
        config.read_timeout = Some(READ_TIMEOUT);
        config.reset_reader_on_write = true;
        if tls {
            let ca_file = ca_file.ok_or_else(|| bad("a CA file is needed to verify the API server"))?;
            config.root_cert = Some(read_certificates(&ca_file)?);
            config.root_cert_file = Some(ca_file);
        }
        if let Some(path) = &token_file {
            check_token(path)?;
        }
        config.auth_info.token_file = token_file.map(|path| path.to_string_lossy().into_owned());
        Ok(KubeConfig { config })
    }

    /// kube's client for this configuration.
    pub fn client(&self) -> Result<kube::Client, KubeError> {
        kube::Client::try_from(self.config.clone()).map_err(|e| KubeError::from_kube("building the API client", e))
    }
}

/// Checks the token file once at the start: kube sends its bytes as they are in every
/// request's `Authorization` header (client-go trims them; kube does not), so a token with
/// whitespace around it would fail every request later; it is refused now, with the reason.
fn check_token(path: &Path) -> Result<(), KubeError> {
    use std::io::Read;
    let read_err = |source| KubeError::Read { path: path.to_owned(), source };
    let mut token = Vec::new();
    std::fs::File::open(path).map_err(read_err)?.take(MAX_TOKEN_BYTES + 1).read_to_end(&mut token).map_err(read_err)?;
    let refuse = |why: &str| Err(KubeError::Config(format!("token file {}: {why}", path.display())));
    if token.len() as u64 > MAX_TOKEN_BYTES {
        return refuse(&format!("larger than {MAX_TOKEN_BYTES} bytes"));
    }
    if token.is_empty() {
        return refuse("empty");
    }
    if token.first().is_some_and(u8::is_ascii_whitespace) || token.last().is_some_and(u8::is_ascii_whitespace) {
        return refuse("whitespace around the token (kube would send it as it is): write the token alone");
    }
    if !token.iter().all(|b| b.is_ascii_graphic()) {
        return refuse("bytes a bearer token cannot have");
    }
    Ok(())
}

/// The DER certificates of a PEM bundle; an empty one or one that is not PEM is refused.
fn read_certificates(path: &Path) -> Result<Vec<Vec<u8>>, KubeError> {
    use std::io::Read;
    let read_err = |source| KubeError::Read { path: path.to_owned(), source };
    let mut pem = Vec::new();
    std::fs::File::open(path).map_err(read_err)?.take(MAX_CA_BYTES + 1).read_to_end(&mut pem).map_err(read_err)?;
    if pem.len() as u64 > MAX_CA_BYTES {
        return Err(KubeError::Config(format!("{}: larger than {MAX_CA_BYTES} bytes", path.display())));
    }
    let certs = CertificateDer::pem_slice_iter(&pem)
        .map(|cert| cert.map(|c| c.as_ref().to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| KubeError::Config(format!("{}: not a PEM certificate bundle: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(KubeError::Config(format!("{}: no certificate in it", path.display())));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_only_to_loopback() {
        assert!(KubeConfig::explicit("http://127.0.0.1:8080", None, None).is_ok());
        assert!(KubeConfig::explicit("http://[::1]:8080", None, None).is_ok());
        for url in ["http://10.0.0.1:8080", "http://localhost:8080", "http://kubernetes.default.svc"] {
            let err = KubeConfig::explicit(url, None, None).expect_err(url);
            assert!(err.to_string().contains("loopback"), "{url}: {err}");
        }
    }

    #[test]
    fn https_needs_a_readable_ca_and_no_path() {
        assert!(KubeConfig::explicit("https://10.96.0.1", None, None).is_err());
        let missing = KubeConfig::explicit("https://[fd00::1]:6443", None, Some("/nonexistent/ca".into()));
        assert!(matches!(missing, Err(KubeError::Read { .. })), "{missing:?}");
        assert!(KubeConfig::explicit("https://10.96.0.1/api", None, Some("/ca".into())).is_err());
        assert!(KubeConfig::explicit("ftp://10.96.0.1", None, Some("/ca".into())).is_err());
        let dir = std::env::temp_dir().join(format!("vramguard-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let not_pem = dir.join("ca.crt");
        std::fs::write(&not_pem, "not a certificate\n").expect("write");
        let refused = KubeConfig::explicit("https://10.96.0.1", None, Some(not_pem));
        assert!(refused.expect_err("no certificate").to_string().contains("no certificate"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_token_file_is_checked_then_kubes_to_read() {
        let dir = std::env::temp_dir().join(format!("vramguard-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let token = dir.join("token");
        let explicit = || KubeConfig::explicit("http://127.0.0.1:1", Some(token.clone()), None);
        assert!(matches!(explicit(), Err(KubeError::Read { .. })), "a missing file");
        for bad in ["", "tok\n", " tok", "to\tk", "tök"] {
            std::fs::write(&token, bad).expect("write");
            assert!(matches!(explicit(), Err(KubeError::Config(_))), "{bad:?}");
        }
        std::fs::write(&token, "eyJhbGciOi.x-y_z").expect("write");
        let config = explicit().expect("config");
        assert_eq!(config.config.auth_info.token_file.as_deref(), token.to_str());
        assert_eq!(config.config.cluster_url.to_string(), "http://127.0.0.1:1/");
        std::fs::remove_dir_all(&dir).ok();
    }
}
