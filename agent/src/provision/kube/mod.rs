//! The Kubernetes API client (work in progress: placeholders until the client lands).

/// A Kubernetes quantity in bytes (placeholder: binary suffixes and plain integers only).
pub fn parse_quantity(text: &str) -> Option<u64> {
    let (digits, shift) = match text.len().checked_sub(2).map(|at| text.split_at(at)) {
        Some((digits, "Ki")) => (digits, 10),
        Some((digits, "Mi")) => (digits, 20),
        Some((digits, "Gi")) => (digits, 30),
        Some((digits, "Ti")) => (digits, 40),
        _ => match text.strip_suffix('G') {
            Some(digits) => return digits.parse::<u64>().ok()?.checked_mul(1_000_000_000),
            None => (text, 0),
        },
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// Pod quotas from the API server (placeholder).
pub struct Quotas;

impl Quotas {
    pub async fn container_quota(&self, _namespace: &str, _pod: &str, _uid: &str, _container: &str) -> Result<Option<u64>, String> {
        Err("not built yet".into())
    }
}
