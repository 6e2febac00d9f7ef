//! Sizes as the fake's `FAKECUDA_*_BYTES` variables and the workload's steps write them: plain
//! bytes, or a whole number with a `k`/`m`/`g`/`t` suffix (either case, 1024-based).

/// Parses `123`, `4k`, `16M`, `2g`, `1t` (1024-based), ignoring blanks around it. `None` for
/// anything else (no digits, a sign, a fraction, inner blanks, another suffix) or when the
/// value does not fit in a `u64`.
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'k' | 'K') => (&text[..i], 10),
        (i, 'm' | 'M') => (&text[..i], 20),
        (i, 'g' | 'G') => (&text[..i], 30),
        (i, 't' | 'T') => (&text[..i], 40),
        _ => (text, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn plain_bytes_and_suffixes() {
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("3M"), Some(3 << 20));
        assert_eq!(parse_size("4m"), Some(4 << 20));
        assert_eq!(parse_size("16g"), Some(16 << 30));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("1t"), Some(1 << 40));
        assert_eq!(parse_size(" 64m\n"), Some(64 << 20), "blanks around are ignored");
        assert_eq!(parse_size("18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_size("16777215t"), Some(16_777_215 << 40));
    }

    #[test]
    fn rejects_everything_else() {
        for bad in ["", " ", "k", "12q", "-1", "+1", "1.5g", "1 g", "0x10", "4kb", "1é", "99999999999999999999", "16777216t"] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
    }
}
