//! Where the API server is and how the agent proves who it is: the in-cluster service
//! account (`KUBERNETES_SERVICE_HOST`/`PORT`, its token and CA files) or an explicit API URL,
//! token file and CA file (tests, out-of-cluster runs). The token file is re-read when it
//! changes (the kubelet rotates projected tokens by swapping a symlink) and after a `401`.
use std::{
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use hyper::header::HeaderValue;
use rustls::{pki_types::CertificateDer, pki_types::ServerName, ClientConfig, RootCertStore};

use super::KubeError;

/// The service account's files in every pod that mounts its token.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The most bytes read from a token file (a bound token is about 1 KiB).
const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// The most bytes read from a CA bundle.
const MAX_CA_BYTES: u64 = 4 * 1024 * 1024;

/// How to reach the API server.
#[derive(Clone, Debug)]
pub struct KubeConfig {
    pub(crate) endpoint: Endpoint,
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) ca_file: Option<PathBuf>,
}

/// The API server's address, parsed once.
#[derive(Clone, Debug)]
pub(crate) struct Endpoint {
    pub(crate) tls: bool,
    /// The host as it is connected to and verified (no brackets around an IPv6 address).
    pub(crate) host: String,
    pub(crate) port: u16,
    /// `host:port` as the `Host` header carries it.
    pub(crate) authority: String,
}

impl KubeConfig {
    /// The configuration a pod gets from its service account: `https://` to
    /// `KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT`, the token and CA in
    /// [`SERVICE_ACCOUNT_DIR`].
    pub fn in_cluster() -> Result<KubeConfig, KubeError> {
        let var = |name: &str| {
            std::env::var(name)
                .map_err(|_| KubeError::Config(format!("{name} is not set: not in a pod? (give --kube-api)")))
        };
        let (host, port) = (var("KUBERNETES_SERVICE_HOST")?, var("KUBERNETES_SERVICE_PORT")?);
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        KubeConfig::explicit(&format!("https://{host}:{port}"), Some(dir.join("token")), Some(dir.join("ca.crt")))
    }

    /// An API server at `url` (`https://host[:port]`; `http://` only to a loopback address,
    /// for test servers), authenticated by the bearer token in `token_file` if given, its
    /// certificate verified against `ca_file` (PEM; required for `https`).
    pub fn explicit(url: &str, token_file: Option<PathBuf>, ca_file: Option<PathBuf>) -> Result<KubeConfig, KubeError> {
        let endpoint = Endpoint::parse(url)?;
        if endpoint.tls && ca_file.is_none() {
            return Err(KubeError::Config(format!("{url}: a CA file is needed to verify the API server")));
        }
        Ok(KubeConfig { endpoint, token_file, ca_file })
    }

    /// The TLS client configuration trusting only the CA file's certificates (`None` for
    /// plain http).
    pub(crate) fn tls(&self) -> Result<Option<(Arc<ClientConfig>, ServerName<'static>)>, KubeError> {
        let Some(ca_file) = self.ca_file.as_deref().filter(|_| self.endpoint.tls) else {
            return Ok(None);
        };
        let pem = read_bounded(ca_file, MAX_CA_BYTES)?;
        let mut roots = RootCertStore::empty();
        let mut found = 0;
        for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
            let cert: CertificateDer = cert
                .map_err(|e| KubeError::Config(format!("{}: not a PEM certificate bundle: {e}", ca_file.display())))?;
            roots
                .add(cert)
                .map_err(|e| KubeError::Config(format!("{}: a certificate is not usable: {e}", ca_file.display())))?;
            found += 1;
        }
        if found == 0 {
            return Err(KubeError::Config(format!("{}: no certificate in it", ca_file.display())));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| KubeError::Config(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::try_from(self.endpoint.host.clone())
            .map_err(|e| KubeError::Config(format!("{}: not a TLS server name: {e}", self.endpoint.host)))?;
        Ok(Some((Arc::new(config), name)))
    }
}

impl Endpoint {
    fn parse(url: &str) -> Result<Endpoint, KubeError> {
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
        let raw_host = uri.host().ok_or_else(|| bad("no host"))?;
        let host = raw_host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        if !tls && !host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
            return Err(bad("plain http is only allowed to a loopback address (tests)"));
        }
        Ok(Endpoint { tls, authority: format!("{raw_host}:{port}"), host, port })
    }
}

/// The bearer token, re-read when its file changes.
#[derive(Debug)]
pub(crate) struct Token {
    path: PathBuf,
    cached: Mutex<Option<(FileStamp, HeaderValue)>>,
}

/// What tells that a file was replaced or rewritten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl Token {
    pub(crate) fn new(path: PathBuf) -> Token {
        Token { path, cached: Mutex::new(None) }
    }

    /// The `Authorization` header's value, from the cache unless the file changed since it
    /// was read (or `reread`: the server refused the cached one).
    pub(crate) fn header(&self, reread: bool) -> Result<HeaderValue, KubeError> {
        let meta = std::fs::metadata(&self.path).map_err(|source| KubeError::Read { path: self.path.clone(), source })?;
        let stamp = FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        };
        let mut cached = self.cached.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((seen, value)) = cached.as_ref() {
            if *seen == stamp && !reread {
                return Ok(value.clone());
            }
        }
        let bytes = read_bounded(&self.path, MAX_TOKEN_BYTES)?;
        let token = std::str::from_utf8(&bytes).map(str::trim).unwrap_or_default();
        if token.is_empty() {
            return Err(KubeError::Config(format!("{}: empty or not text", self.path.display())));
        }
        let mut value = HeaderValue::try_from(format!("Bearer {token}"))
            .map_err(|_| KubeError::Config(format!("{}: not a token (bytes a header cannot carry)", self.path.display())))?;
        value.set_sensitive(true);
        *cached = Some((stamp, value.clone()));
        Ok(value)
    }
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, KubeError> {
    use std::io::Read;
    let read_err = |source| KubeError::Read { path: path.to_owned(), source };
    let file = std::fs::File::open(path).map_err(read_err)?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(read_err)?;
    if bytes.len() as u64 > max {
        return Err(KubeError::Config(format!("{}: larger than {max} bytes", path.display())));
    }
    Ok(bytes)
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
    fn https_needs_a_ca_and_parses_hosts() {
        assert!(KubeConfig::explicit("https://10.96.0.1", None, None).is_err());
        let config = KubeConfig::explicit("https://[fd00::1]:6443", None, Some("/ca".into())).expect("v6");
        assert_eq!(config.endpoint.host, "fd00::1");
        assert_eq!(config.endpoint.authority, "[fd00::1]:6443");
        let config = KubeConfig::explicit("https://10.96.0.1", None, Some("/ca".into())).expect("default port");
        assert_eq!((config.endpoint.port, config.endpoint.authority.as_str()), (443, "10.96.0.1:443"));
        assert!(KubeConfig::explicit("https://10.96.0.1/api", None, Some("/ca".into())).is_err());
        assert!(KubeConfig::explicit("ftp://10.96.0.1", None, Some("/ca".into())).is_err());
    }

    #[test]
    fn the_token_is_reread_when_its_file_is_replaced() {
        let dir = std::env::temp_dir().join(format!("vramguard-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("token");
        std::fs::write(&path, "first\n").expect("write");
        let token = Token::new(path.clone());
        assert_eq!(token.header(false).expect("read").to_str().ok(), Some("Bearer first"));
        let next = dir.join("token.next");
        std::fs::write(&next, "second").expect("write");
        std::fs::rename(&next, &path).expect("rename");
        assert_eq!(token.header(false).expect("reread").to_str().ok(), Some("Bearer second"));
        std::fs::write(&path, "").expect("write");
        assert!(token.header(false).is_err(), "an empty token is refused");
        std::fs::remove_dir_all(&dir).ok();
    }
}
