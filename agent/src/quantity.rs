//! Kubernetes resource quantities (`8Gi`, `1.5G`, `1e9`, `8589934592`) as whole bytes.
//!
//! The grammar is the API's (`k8s.io/apimachinery/pkg/api/resource`): an optional sign, a
//! decimal number (`12`, `1.5`, `1.`, `.5`), then one suffix: binary SI (`Ki` `Mi` `Gi` `Ti`
//! `Pi` `Ei`), decimal SI (`m` `k` `M` `G` `T` `P` `E`, or none) or a decimal exponent (`e3`,
//! `E-3`, `e+6`). The value is computed exactly (no floating point); it must come to a whole,
//! non-negative number of bytes that fits in a `u64`.

/// The value of `text` in bytes, or `None` when it is not a quantity, is negative, is not a
/// whole number of bytes (`0.5`, `1500m`) or does not fit in a `u64`.
pub fn parse_quantity(text: &str) -> Option<u64> {
    let bytes = text.as_bytes();
    let (negative, rest) = match bytes.first()? {
        b'+' => (false, &bytes[1..]),
        b'-' => (true, &bytes[1..]),
        _ => (false, bytes),
    };
    let int_len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let (int_digits, rest) = rest.split_at(int_len);
    let (frac_digits, suffix) = match rest.first() {
        Some(b'.') => {
            let rest = &rest[1..];
            let frac_len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            rest.split_at(frac_len)
        }
        _ => (&rest[..0], rest),
    };
    if int_digits.is_empty() && frac_digits.is_empty() {
        return None;
    }
    let (binary_shift, mut exponent) = suffix_scale(suffix)?;
    // The digits as one integer, with the fraction's length moved into the exponent. Zeros
    // are trimmed first so that `0000000000000000000000000000000000000001` or a long run of
    // trailing fractional zeros does not overflow.
    let frac_digits = trim_end_zeros(frac_digits);
    let mut digits: Vec<u8> = int_digits.iter().chain(frac_digits).copied().collect();
    exponent = exponent.checked_sub(i64::try_from(frac_digits.len()).ok()?)?;
    let first = digits.iter().position(|&d| d != b'0').unwrap_or(digits.len());
    digits.drain(..first);
    if digits.is_empty() {
        return Some(0);
    }
    if negative {
        return None;
    }
    // Trailing zeros of the integer move into the exponent too (keeps `1000000e-6` exact).
    while digits.len() > 1 && digits.last() == Some(&b'0') {
        digits.pop();
        exponent = exponent.checked_add(1)?;
    }
    if digits.len() > 38 {
        return None; // past u128, far past u64
    }
    let mantissa = digits.iter().try_fold(0u128, |acc, &d| acc.checked_mul(10)?.checked_add(u128::from(d - b'0')))?;
    let mut value = mantissa.checked_shl(binary_shift).filter(|v| v >> binary_shift == mantissa)?;
    if exponent >= 0 {
        value = value.checked_mul(10u128.checked_pow(u32::try_from(exponent).ok()?)?)?;
    } else {
        let divisor = 10u128.checked_pow(u32::try_from(exponent.unsigned_abs()).ok()?)?;
        if value % divisor != 0 {
            return None;
        }
        value /= divisor;
    }
    u64::try_from(value).ok()
}

/// The suffix as (binary shift, decimal exponent); `None` for anything else.
fn suffix_scale(suffix: &[u8]) -> Option<(u32, i64)> {
    Some(match suffix {
        b"" => (0, 0),
        b"Ki" => (10, 0),
        b"Mi" => (20, 0),
        b"Gi" => (30, 0),
        b"Ti" => (40, 0),
        b"Pi" => (50, 0),
        b"Ei" => (60, 0),
        b"m" => (0, -3),
        b"k" => (0, 3),
        b"M" => (0, 6),
        b"G" => (0, 9),
        b"T" => (0, 12),
        b"P" => (0, 15),
        b"E" => (0, 18),
        [b'e' | b'E', exponent @ ..] => (0, parse_exponent(exponent)?),
        _ => return None,
    })
}

/// A decimal exponent's signed integer (`3`, `+3`, `-3`); bounded so that no arithmetic on it
/// overflows (anything past a few dozen makes the value overflow or vanish anyway).
fn parse_exponent(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text.first()? {
        b'+' => (false, &text[1..]),
        b'-' => (true, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || digits.len() > 6 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let magnitude = digits.iter().fold(0i64, |acc, &d| acc * 10 + i64::from(d - b'0'));
    Some(if negative { -magnitude } else { magnitude })
}

fn trim_end_zeros(digits: &[u8]) -> &[u8] {
    let keep = digits.iter().rposition(|&d| d != b'0').map_or(0, |last| last + 1);
    &digits[..keep]
}

#[cfg(test)]
mod tests {
    use super::parse_quantity;

    #[test]
    fn plain_integers() {
        assert_eq!(parse_quantity("0"), Some(0));
        assert_eq!(parse_quantity("1"), Some(1));
        assert_eq!(parse_quantity("8589934592"), Some(8 << 30));
        assert_eq!(parse_quantity("+42"), Some(42));
        assert_eq!(parse_quantity("0007"), Some(7));
        assert_eq!(parse_quantity("18446744073709551615"), Some(u64::MAX));
    }

    #[test]
    fn binary_suffixes() {
        assert_eq!(parse_quantity("1Ki"), Some(1024));
        assert_eq!(parse_quantity("3Mi"), Some(3 << 20));
        assert_eq!(parse_quantity("8Gi"), Some(8 << 30));
        assert_eq!(parse_quantity("2Ti"), Some(2 << 40));
        assert_eq!(parse_quantity("1Pi"), Some(1 << 50));
        assert_eq!(parse_quantity("15Ei"), Some(15 << 60));
    }

    #[test]
    fn decimal_suffixes() {
        assert_eq!(parse_quantity("1k"), Some(1000));
        assert_eq!(parse_quantity("80G"), Some(80_000_000_000));
        assert_eq!(parse_quantity("2M"), Some(2_000_000));
        assert_eq!(parse_quantity("1T"), Some(1_000_000_000_000));
        assert_eq!(parse_quantity("1P"), Some(1_000_000_000_000_000));
        assert_eq!(parse_quantity("18E"), Some(18_000_000_000_000_000_000));
        assert_eq!(parse_quantity("5000m"), Some(5));
    }

    #[test]
    fn decimal_exponents() {
        assert_eq!(parse_quantity("1e9"), Some(1_000_000_000));
        assert_eq!(parse_quantity("1E9"), Some(1_000_000_000));
        assert_eq!(parse_quantity("12e+3"), Some(12_000));
        assert_eq!(parse_quantity("1000000e-6"), Some(1));
        assert_eq!(parse_quantity("1.5e3"), Some(1500));
        assert_eq!(parse_quantity("0e999999"), Some(0));
    }

    #[test]
    fn fractions_that_come_to_whole_bytes() {
        assert_eq!(parse_quantity("1.5Gi"), Some(3 << 29));
        assert_eq!(parse_quantity("0.5Ki"), Some(512));
        assert_eq!(parse_quantity(".5Ki"), Some(512));
        assert_eq!(parse_quantity("2.Gi"), Some(2 << 30));
        assert_eq!(parse_quantity("2.50000000000000000000000000000000000000000000G"), Some(2_500_000_000));
        assert_eq!(parse_quantity("0.001k"), Some(1));
    }

    #[test]
    fn fractions_of_a_byte_are_refused() {
        assert_eq!(parse_quantity("0.5"), None);
        assert_eq!(parse_quantity("1500m"), None);
        assert_eq!(parse_quantity("1e-3"), None);
        assert_eq!(parse_quantity("0.1Ki"), None); // 102.4 bytes
        assert_eq!(parse_quantity("1m"), None);
    }

    #[test]
    fn negatives_are_refused() {
        assert_eq!(parse_quantity("-1"), None);
        assert_eq!(parse_quantity("-8Gi"), None);
        assert_eq!(parse_quantity("-0.5Ki"), None);
        assert_eq!(parse_quantity("-0"), Some(0), "zero is not negative");
    }

    #[test]
    fn overflow_is_refused() {
        assert_eq!(parse_quantity("18446744073709551616"), None);
        assert_eq!(parse_quantity("16Ei"), None);
        assert_eq!(parse_quantity("19E"), None);
        assert_eq!(parse_quantity("1e20"), None);
        assert_eq!(parse_quantity("1e999999"), None);
        assert_eq!(parse_quantity("99999999999999999999999999999999999999999999Gi"), None);
        assert_eq!(parse_quantity("1e9999999"), None, "exponents past six digits");
    }

    #[test]
    fn garbage_is_refused() {
        for text in [
            "", "+", "-", ".", "Gi", "1 Gi", " 1", "1 ", "1gi", "1GI", "1Gb", "1K", "1ki", "1.2.3", "1e", "1e+", "1ee3",
            "1e3Gi", "1Gi3", "0x10", "1_000", "١", "1\0", "e3", "1Gii", "1.5.Gi", "++1", "1e3.5",
        ] {
            assert_eq!(parse_quantity(text), None, "{text:?}");
        }
    }
}
