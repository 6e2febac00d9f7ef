//! The webhook's TLS: its certificate chain and key from two PEM files (the Secret's
//! `tls.crt` and `tls.key`, mounted), served by rustls with ring, and re-read when they change
//! (the kubelet swaps a mounted Secret's files in place; cert-manager renews a certificate
//! that way): every [`RELOAD_EVERY`] the files are read (at most [`MAX_PEM_BYTES`] each) and,
//! if their bytes changed, parsed; a pair that parses and matches is served to every new
//! handshake from then on, one that does not is logged and counted, and the previous pair
//! stays. A start without a valid pair fails. With `--manage-certificate` the pair comes from
//! the Secret instead ([`super::secret`]), given here in memory ([`Certificates::from_pem`],
//! [`Certificates::set`]) and swapped the same way.
use std::{
    fmt,
    io::Read,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError, RwLock},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use rustls::{
    crypto::{ring, CryptoProvider},
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
    ServerConfig,
};
use tracing::{info, warn};

use super::metrics::WebhookMetrics;

/// How often the files are checked for a new pair.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);
/// The most bytes read of either file (a chain of a few certificates is a few KiB).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The served pair, and the files' bytes it was last checked against.
pub struct Certificates {
    /// The files re-read (none: the pair is given in memory).
    files: Option<(PathBuf, PathBuf)>,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
    seen: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Certificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Certificates").field("files", &self.files).finish()
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(PoisonError::into_inner).clone())
    }
}

impl Certificates {
    /// The pair in `cert` and `key`, checked.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<Certificates>> {
        let provider = Arc::new(ring::default_provider());
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        let pair = parse(&cert_pem, &key_pem, &provider).with_context(|| format!("the TLS pair {} and {}", cert.display(), key.display()))?;
        Ok(Arc::new(Certificates {
            files: Some((cert.to_owned(), key.to_owned())),
            provider,
            current: RwLock::new(Arc::new(pair)),
            seen: Mutex::new((cert_pem, key_pem)),
        }))
    }

    /// The pair in the PEM texts `cert` and `key`, checked (re-read from nowhere: [`Self::set`]).
    pub fn from_pem(cert: &[u8], key: &[u8]) -> Result<Arc<Certificates>> {
        let provider = Arc::new(ring::default_provider());
        let pair = parse(cert, key, &provider).context("the TLS pair")?;
        Ok(Arc::new(Certificates { files: None, provider, current: RwLock::new(Arc::new(pair)), seen: Mutex::new((cert.to_vec(), key.to_vec())) }))
    }

    /// Serves the pair in `cert` and `key` to every new handshake if it differs from the one
    /// served and is valid. `Ok(true)`: a new pair is served.
    pub fn set(&self, cert: &[u8], key: &[u8]) -> Result<bool> {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.0 == cert && seen.1 == key {
            return Ok(false);
        }
        let pair = parse(cert, key, &self.provider)?;
        *seen = (cert.to_vec(), key.to_vec());
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(pair);
        Ok(true)
    }

    /// rustls' server configuration, its certificate from here at each handshake; HTTP/1.1
    /// only (what the API server's client falls back to).
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Reads the files; serves their pair from now on if they changed and hold a valid one.
    /// `Ok(true)`: a new pair is served.
    pub fn reload(&self) -> Result<bool> {
        let Some((cert, key)) = &self.files else { return Ok(false) };
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.0 == cert_pem && seen.1 == key_pem {
            return Ok(false);
        }
        // Remembered even if invalid: a bad pair is reported once, not at every check. (A
        // renewal writes the two files one after the other: the half-renewed pair fails, the
        // next check sees both.)
        *seen = (cert_pem, key_pem);
        let pair = parse(&seen.0, &seen.1, &self.provider)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(pair);
        Ok(true)
    }

    /// Reloads every [`RELOAD_EVERY`], for ever.
    pub async fn watch(self: Arc<Self>, metrics: WebhookMetrics) {
        let mut ticks = tokio::time::interval(RELOAD_EVERY);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let this = self.clone();
            match tokio::task::spawn_blocking(move || this.reload()).await {
                Ok(Ok(false)) => {}
                Ok(Ok(true)) => {
                    metrics.reload("loaded");
                    info!(files = ?self.files, "serving the renewed TLS certificate");
                }
                Ok(Err(error)) => {
                    metrics.reload("failed");
                    warn!(error = format!("{error:#}"), "the TLS files changed but hold no valid pair: the previous one is still served");
                }
                Err(error) => warn!(%error, "the TLS reload did not finish"),
            }
        }
    }
}

/// A file's bytes, refused past [`MAX_PEM_BYTES`].
fn read(path: &Path) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES + 1).read_to_end(&mut bytes).with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        bail!("{} is larger than {MAX_PEM_BYTES} bytes", path.display());
    }
    Ok(bytes)
}

/// The chain and key in the PEM texts, the key checked against the chain's first certificate.
fn parse(cert_pem: &[u8], key_pem: &[u8], provider: &CryptoProvider) -> Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("the certificate file: {e}"))?;
    if chain.is_empty() {
        bail!("the certificate file holds no certificate");
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| anyhow::anyhow!("the key file: {e}"))?;
    CertifiedKey::from_der(chain, key, provider).map_err(|e| anyhow::anyhow!("the key and certificate: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()]).expect("params").self_signed(&key).expect("cert");
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn loads_reloads_and_keeps_the_old_pair_on_a_bad_one() {
        let dir = std::env::temp_dir().join(format!("vramguard-webhook-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let (first_cert, first_key) = pair("one.example");
        std::fs::write(&cert, &first_cert).expect("write");
        std::fs::write(&key, &first_key).expect("write");
        let certificates = Certificates::load(&cert, &key).expect("loaded");
        let served = |c: &Certificates| c.current.read().expect("lock").cert[0].clone();
        let first = served(&certificates);
        assert!(!certificates.reload().expect("unchanged"), "same bytes: nothing to do");
        // A key that is not the certificate's: refused, the first pair still served.
        let (_, other_key) = pair("two.example");
        std::fs::write(&key, &other_key).expect("write");
        let error = certificates.reload().expect_err("mismatch");
        assert!(format!("{error:#}").contains("key"), "{error:#}");
        assert_eq!(served(&certificates), first);
        // A new matching pair: served.
        let (second_cert, second_key) = pair("two.example");
        std::fs::write(&cert, &second_cert).expect("write");
        std::fs::write(&key, &second_key).expect("write");
        assert!(certificates.reload().expect("reloaded"));
        assert_ne!(served(&certificates), first);
        // Garbage at the start: no server.
        std::fs::write(&cert, "not a certificate").expect("write");
        assert!(Certificates::load(&cert, &key).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
