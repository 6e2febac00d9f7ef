//! The certificates of `--manage-certificate` ([`super::secret`]), the pure part: a CA and a
//! serving pair signed by it (ECDSA P-256, by rcgen), and the check of a pair read back from
//! the Secret (what is wrong with it, or how soon it must be renewed).
//!
//! A [`Bundle`] is the Secret's four keys: `ca.crt` (the CA that signs, first, then any older
//! CA still trusted while a new one takes over: the whole file is the webhook configuration's
//! `caBundle`), `ca.key`, `tls.crt` and `tls.key`. [`check`] verifies the CA's key against its
//! certificate and its dates, the serving key against its certificate, and the serving
//! certificate as the API server will: a chain to the CA for every one of the Service's DNS
//! names (rustls' WebPKI verifier), now and [`Lifetimes::serving_renew_before`] from now.
use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::{
    client::{danger::ServerCertVerifier, WebPkiServerVerifier},
    crypto::{ring, CryptoProvider},
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName, UnixTime},
    sign::CertifiedKey,
    RootCertStore,
};

/// The CA's common name (the issuer's name in every serving certificate it signs).
pub const CA_NAME: &str = "vramguard-webhook-ca";
/// How far back a new certificate's `notBefore` is set (clocks of the cluster that run behind).
const BACKDATE: Duration = Duration::from_secs(3600);

/// How long the certificates live and how long before their end they are replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetimes {
    pub ca: Duration,
    pub ca_renew_before: Duration,
    pub serving: Duration,
    pub serving_renew_before: Duration,
}

const DAY: u64 = 24 * 3600;

impl Default for Lifetimes {
    /// A CA of 10 years replaced 2 years before its end (longer than a serving certificate
    /// lives: none outlives its CA), a serving pair of a year renewed 30 days before its end.
    fn default() -> Self {
        Lifetimes {
            ca: Duration::from_secs(3650 * DAY),
            ca_renew_before: Duration::from_secs(730 * DAY),
            serving: Duration::from_secs(365 * DAY),
            serving_renew_before: Duration::from_secs(30 * DAY),
        }
    }
}

impl Lifetimes {
    /// Refuses lifetimes that would renew at every pass: a renewal window as long as the life,
    /// or a CA replaced later than its serving pairs are renewed (a pair never outlives its CA,
    /// so one cut short by its CA's end would be due again at once).
    pub fn check(&self) -> Result<()> {
        if self.serving_renew_before >= self.serving || self.ca_renew_before >= self.ca {
            bail!("a certificate's renewal window must be shorter than its life: {self:?}");
        }
        if self.ca_renew_before < self.serving_renew_before {
            bail!("the CA must be replaced at least as early before its end as the serving pair is renewed: {self:?}");
        }
        Ok(())
    }
}

/// The Secret's four keys, PEM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bundle {
    pub ca_crt: Vec<u8>,
    pub ca_key: Vec<u8>,
    pub tls_crt: Vec<u8>,
    pub tls_key: Vec<u8>,
}

/// What [`check`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Valid, and not due.
    Good,
    /// The serving pair must be replaced (signed by the same CA): `expiring`, or broken.
    Serving { why: String, expiring: bool },
    /// The CA must be replaced (and the serving pair with it): `expiring` (the old CA stays
    /// trusted beside the new one), or broken (dropped).
    Ca { why: String, expiring: bool },
}

/// The DNS names of `service` in `namespace`, as a client of the cluster may name it.
pub fn dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

fn unix(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

fn date(seconds: i64) -> Result<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp(seconds).map_err(|e| anyhow!("a certificate date: {e}"))
}

/// The CA's parameters: what a serving certificate's issuer is made of (its name and key use).
fn ca_params() -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, CA_NAME);
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

/// A new CA valid from `now` for `lifetimes.ca`: (certificate, key), PEM.
pub fn new_ca(lifetimes: &Lifetimes, now: SystemTime) -> Result<(String, String)> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = ca_params()?;
    params.not_before = date(unix(now) - BACKDATE.as_secs() as i64)?;
    params.not_after = date(unix(now) + lifetimes.ca.as_secs() as i64)?;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A new serving pair for `names`, signed by the CA `ca_crt` (its first certificate, PEM)
/// whose key is `ca_key` (PEM), valid from `now` for `lifetimes.serving` but not past the CA's
/// end: (certificate, key), PEM.
pub fn new_serving(ca_crt: &[u8], ca_key: &[u8], names: &[String], lifetimes: &Lifetimes, now: SystemTime) -> Result<(String, String)> {
    let ca_end = certificates(ca_crt).ok().and_then(|certs| validity(&certs[0])).map_or(i64::MAX, |(_, end)| end);
    let ca_key = KeyPair::from_pem(std::str::from_utf8(ca_key).context("ca.key is not text")?).context("ca.key")?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::new(names.to_vec())?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, names.get(2).or(names.first()).cloned().unwrap_or_default());
    params.distinguished_name = name;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = date(unix(now) - BACKDATE.as_secs() as i64)?;
    params.not_after = date((unix(now) + lifetimes.serving.as_secs() as i64).min(ca_end))?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A whole new bundle: a new CA (with `trusted`, the older CAs kept in `ca.crt` after it) and
/// a serving pair it signed.
pub fn new_bundle(trusted: &[u8], names: &[String], lifetimes: &Lifetimes, now: SystemTime) -> Result<Bundle> {
    let (ca_crt, ca_key) = new_ca(lifetimes, now)?;
    let (tls_crt, tls_key) = new_serving(ca_crt.as_bytes(), ca_key.as_bytes(), names, lifetimes, now)?;
    let mut ca_crt = ca_crt.into_bytes();
    ca_crt.extend_from_slice(trusted);
    Ok(Bundle { ca_crt, ca_key: ca_key.into_bytes(), tls_crt: tls_crt.into_bytes(), tls_key: tls_key.into_bytes() })
}

/// The bundle with a new serving pair from its CA (the CAs after the first kept while valid).
pub fn renew_serving(bundle: &Bundle, names: &[String], lifetimes: &Lifetimes, now: SystemTime) -> Result<Bundle> {
    let (tls_crt, tls_key) = new_serving(&bundle.ca_crt, &bundle.ca_key, names, lifetimes, now)?;
    let certs = certificates(&bundle.ca_crt)?;
    let mut ca_crt = pem(&certs[..1]);
    ca_crt.extend_from_slice(&still_valid(&certs[1..], now));
    Ok(Bundle { ca_crt, ca_key: bundle.ca_key.clone(), tls_crt: tls_crt.into_bytes(), tls_key: tls_key.into_bytes() })
}

/// `ca.crt`'s certificates that are still valid at `now`, PEM: kept beside a new CA.
pub fn still_valid_pem(ca_crt: &[u8], now: SystemTime) -> Vec<u8> {
    certificates(ca_crt).map(|certs| still_valid(&certs, now)).unwrap_or_default()
}

fn still_valid(certs: &[CertificateDer<'static>], now: SystemTime) -> Vec<u8> {
    let valid: Vec<CertificateDer<'static>> = certs.iter().filter(|c| validity(c).is_some_and(|(_, end)| end > unix(now))).cloned().collect();
    pem(&valid)
}

fn pem(certs: &[CertificateDer<'_>]) -> Vec<u8> {
    let mut out = String::new();
    for cert in certs {
        let text = base64::engine::general_purpose::STANDARD.encode(cert);
        out.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in text.as_bytes().chunks(64) {
            out.push_str(&String::from_utf8_lossy(line));
            out.push('\n');
        }
        out.push_str("-----END CERTIFICATE-----\n");
    }
    out.into_bytes()
}

/// The certificates of a PEM text (at least one).
fn certificates(text: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(text).collect::<Result<_, _>>().map_err(|e| anyhow!("{e}"))?;
    if certs.is_empty() {
        bail!("no certificate");
    }
    Ok(certs)
}

/// `cert` and `key` (PEM) as rustls loads them, the key checked against the certificate.
fn pair(cert: &CertificateDer<'static>, key: &[u8], provider: &CryptoProvider) -> Result<CertifiedKey> {
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| anyhow!("{e}"))?;
    CertifiedKey::from_der(vec![cert.clone()], key, provider).map_err(|e| anyhow!("{e}"))
}

/// What is wrong with `bundle` for `names` at `now`, or when it is due.
pub fn check(bundle: &Bundle, names: &[String], lifetimes: &Lifetimes, now: SystemTime) -> Verdict {
    let provider = ring::default_provider();
    let broken_ca = |why: String| Verdict::Ca { why, expiring: false };
    let ca = match certificates(&bundle.ca_crt) {
        Ok(certs) => certs[0].clone(),
        Err(e) => return broken_ca(format!("ca.crt: {e}")),
    };
    if let Err(e) = pair(&ca, &bundle.ca_key, &provider) {
        return broken_ca(format!("ca.key and ca.crt: {e}"));
    }
    let Some((_, ca_end)) = validity(&ca) else { return broken_ca("ca.crt: its validity cannot be read".into()) };
    if ca_end <= unix(now) + lifetimes.ca_renew_before.as_secs() as i64 {
        let expiring = ca_end > unix(now);
        return Verdict::Ca { why: format!("the CA ends at {} (unix time), within {:?}", ca_end, lifetimes.ca_renew_before), expiring };
    }
    let broken = |why: String| Verdict::Serving { why, expiring: false };
    let serving = match certificates(&bundle.tls_crt) {
        Ok(certs) => certs[0].clone(),
        Err(e) => return broken(format!("tls.crt: {e}")),
    };
    if let Err(e) = pair(&serving, &bundle.tls_key, &provider) {
        return broken(format!("tls.key and tls.crt: {e}"));
    }
    let mut roots = RootCertStore::empty();
    if let Err(e) = roots.add(ca.clone()) {
        return broken_ca(format!("ca.crt as a trust anchor: {e}"));
    }
    let verifier = match WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::new(provider)).build() {
        Ok(verifier) => verifier,
        Err(e) => return broken_ca(format!("ca.crt as a trust anchor: {e}")),
    };
    let verify = |name: &str, at: i64| -> Result<()> {
        let server = ServerName::try_from(name.to_owned()).map_err(|e| anyhow!("{name}: {e}"))?;
        let at = UnixTime::since_unix_epoch(Duration::from_secs(at.max(0) as u64));
        verifier.verify_server_cert(&serving, &[], &server, &[], at).map(|_| ()).map_err(|e| anyhow!("{e}"))
    };
    for name in names {
        if let Err(e) = verify(name, unix(now)) {
            return broken(format!("tls.crt for {name}: {e}"));
        }
    }
    let due = unix(now) + lifetimes.serving_renew_before.as_secs() as i64;
    let Some((_, serving_end)) = validity(&serving) else { return broken("tls.crt: its validity cannot be read".into()) };
    if serving_end <= due {
        return Verdict::Serving { why: format!("tls.crt ends at {serving_end} (unix time), within {:?}", lifetimes.serving_renew_before), expiring: true };
    }
    Verdict::Good
}

/// One DER element at the start of `bytes`: (tag, contents, what follows).
fn element(bytes: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = bytes.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (length, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        (rest[..count].iter().fold(0usize, |n, b| (n << 8) | usize::from(*b)), &rest[count..])
    };
    (rest.len() >= length).then(|| (tag, &rest[..length], &rest[length..]))
}

/// A certificate's validity (`notBefore`, `notAfter`) in seconds since the epoch, read from its
/// DER (RFC 5280: Certificate, TBSCertificate, [0] version, serial, signature, issuer,
/// validity).
pub fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (0x30, certificate, _) = element(der)? else { return None };
    let (0x30, mut tbs, _) = element(certificate)? else { return None };
    if tbs.first() == Some(&0xa0) {
        tbs = element(tbs)?.2;
    }
    for _ in 0..3 {
        tbs = element(tbs)?.2;
    }
    let (0x30, validity, _) = element(tbs)? else { return None };
    let (before_tag, before, rest) = element(validity)?;
    let (after_tag, after, _) = element(rest)?;
    Some((time_of(before_tag, before)?, time_of(after_tag, after)?))
}

/// A UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) in seconds since the epoch.
fn time_of(tag: u8, text: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    let (year, rest) = match (tag, text.len()) {
        (0x17, 12) => {
            let yy: i64 = text[..2].parse().ok()?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (0x18, 14) => (text[..4].parse().ok()?, &text[4..]),
        _ => return None,
    };
    if !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let field = |i: usize| rest[i..i + 2].parse::<i64>().ok();
    let (month, day, hour, minute, second) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    // Days from the civil date (the proleptic Gregorian calendar), March-based years.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some(days * 86_400 + hour * 3600 + minute * 60 + second)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        dns_names("vramguard-webhook", "vramguard-system")
    }

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds)
    }

    const NOW: u64 = 1_795_996_800; // 2026-11-30

    #[test]
    fn names_of_the_service() {
        assert_eq!(
            names(),
            ["vramguard-webhook", "vramguard-webhook.vramguard-system", "vramguard-webhook.vramguard-system.svc", "vramguard-webhook.vramguard-system.svc.cluster.local"]
        );
    }

    #[test]
    fn lifetimes_that_would_renew_for_ever_are_refused() {
        assert!(Lifetimes::default().check().is_ok());
        let short = |serving, serving_renew_before, ca, ca_renew_before| {
            Lifetimes { serving: Duration::from_secs(serving), serving_renew_before: Duration::from_secs(serving_renew_before), ca: Duration::from_secs(ca), ca_renew_before: Duration::from_secs(ca_renew_before) }.check()
        };
        assert!(short(20, 15, 3600, 60).is_ok());
        assert!(short(20, 20, 3600, 60).is_err());
        assert!(short(20, 15, 60, 60).is_err());
        assert!(short(3600, 600, 7200, 60).is_err(), "the CA replaced after its pairs are due");
    }

    #[test]
    fn reads_the_dates_it_wrote() {
        let lifetimes = Lifetimes::default();
        let (ca, _) = new_ca(&lifetimes, at(NOW)).expect("ca");
        let der = certificates(ca.as_bytes()).expect("pem")[0].clone();
        assert_eq!(validity(&der), Some((NOW as i64 - 3600, NOW as i64 + 3650 * 86_400)));
        // UTCTime and GeneralizedTime (past 2049).
        assert_eq!(time_of(0x17, b"700101000000Z"), Some(0));
        assert_eq!(time_of(0x17, b"261130000000Z"), Some(1_795_996_800));
        assert_eq!(time_of(0x17, b"261130010203Z"), Some(1_795_996_800 + 3723));
        assert_eq!(time_of(0x18, b"20500101000000Z"), Some(2_524_608_000));
        assert_eq!(time_of(0x18, b"2050010100000Z"), None);
        assert_eq!(validity(b"\x30\x03\x02\x01\x00"), None);
    }

    #[test]
    fn a_new_bundle_is_good_until_due() {
        let lifetimes = Lifetimes::default();
        let bundle = new_bundle(&[], &names(), &lifetimes, at(NOW)).expect("bundle");
        assert_eq!(check(&bundle, &names(), &lifetimes, at(NOW)), Verdict::Good);
        assert!(String::from_utf8_lossy(&bundle.ca_key).contains("PRIVATE KEY"));
        // 336 days on: within 30 days of its end, the serving pair is due; the CA is not.
        let later = at(NOW + 336 * 86_400);
        assert!(matches!(check(&bundle, &names(), &lifetimes, later), Verdict::Serving { expiring: true, .. }), "{:?}", check(&bundle, &names(), &lifetimes, later));
        let renewed = renew_serving(&bundle, &names(), &lifetimes, later).expect("renewed");
        assert_eq!(renewed.ca_crt, bundle.ca_crt);
        assert_ne!(renewed.tls_crt, bundle.tls_crt);
        assert_eq!(check(&renewed, &names(), &lifetimes, later), Verdict::Good);
        // Past its end, it is broken, not due.
        assert!(matches!(check(&bundle, &names(), &lifetimes, at(NOW + 366 * 86_400)), Verdict::Serving { expiring: false, .. }));
        // 8 years on: the CA is due; the new bundle keeps the old CA after the new one.
        let late = at(NOW + 8 * 366 * 86_400 + 86_400);
        assert!(matches!(check(&renewed, &names(), &lifetimes, late), Verdict::Ca { expiring: true, .. }));
        let rotated = new_bundle(&still_valid_pem(&renewed.ca_crt, late), &names(), &lifetimes, late).expect("rotated");
        assert_eq!(certificates(&rotated.ca_crt).expect("two").len(), 2);
        assert_eq!(certificates(&rotated.ca_crt).expect("two")[1], certificates(&bundle.ca_crt).expect("one")[0]);
        assert_eq!(check(&rotated, &names(), &lifetimes, late), Verdict::Good);
        // Once the old CA has ended, a renewal drops it.
        let end = at(NOW + 3651 * 86_400);
        assert_eq!(certificates(&renew_serving(&rotated, &names(), &lifetimes, end).expect("renewed").ca_crt).expect("one").len(), 1);
    }

    #[test]
    fn finds_what_is_broken() {
        let lifetimes = Lifetimes::default();
        let bundle = new_bundle(&[], &names(), &lifetimes, at(NOW)).expect("bundle");
        let other = new_bundle(&[], &names(), &lifetimes, at(NOW)).expect("other");
        let verdict = |b: &Bundle| check(b, &names(), &lifetimes, at(NOW));
        let serving_broken = |v: Verdict| matches!(v, Verdict::Serving { expiring: false, .. });
        let ca_broken = |v: Verdict| matches!(v, Verdict::Ca { expiring: false, .. });
        assert!(ca_broken(verdict(&Bundle::default())));
        assert!(ca_broken(verdict(&Bundle { ca_crt: b"garbage".to_vec(), ..bundle.clone() })));
        assert!(ca_broken(verdict(&Bundle { ca_key: other.ca_key.clone(), ..bundle.clone() })), "a CA key that is not the CA's");
        assert!(serving_broken(verdict(&Bundle { tls_crt: b"garbage".to_vec(), ..bundle.clone() })));
        assert!(serving_broken(verdict(&Bundle { tls_key: other.tls_key.clone(), ..bundle.clone() })), "a key that is not the certificate's");
        let foreign = Bundle { tls_crt: other.tls_crt.clone(), tls_key: other.tls_key.clone(), ..bundle.clone() };
        assert!(serving_broken(verdict(&foreign)), "signed by another CA");
        // Signed by the CA but for other names.
        let (crt, key) = new_serving(&bundle.ca_crt, &bundle.ca_key, &dns_names("other", "vramguard-system"), &lifetimes, at(NOW)).expect("other names");
        let wrong = Bundle { tls_crt: crt.into_bytes(), tls_key: key.into_bytes(), ..bundle.clone() };
        match verdict(&wrong) {
            Verdict::Serving { why, expiring: false } => assert!(why.contains("vramguard-webhook"), "{why}"),
            v => panic!("{v:?}"),
        }
        // A serving pair never outlives its CA.
        let brief = Lifetimes { ca: Duration::from_secs(600), ..lifetimes };
        let capped = new_bundle(&[], &names(), &brief, at(NOW)).expect("capped");
        let ends = |pem: &[u8]| validity(&certificates(pem).expect("pem")[0]).expect("dates").1;
        assert_eq!(ends(&capped.tls_crt), ends(&capped.ca_crt));
        assert_eq!(ends(&capped.ca_crt), NOW as i64 + 600);
        // A short life: due once within its renewal window.
        let short = Lifetimes { serving: Duration::from_secs(60), serving_renew_before: Duration::from_secs(30), ..lifetimes };
        let soon = new_bundle(&[], &names(), &short, at(NOW)).expect("short");
        assert_eq!(check(&soon, &names(), &short, at(NOW)), Verdict::Good);
        assert!(matches!(check(&soon, &names(), &short, at(NOW + 31)), Verdict::Serving { expiring: true, .. }));
    }
}
