//! Fixed-point amounts ([`Millionths`]) and the exact decimals ([`Decimal`]) they are made from.
//!
//! **Rounding.** A number from the config or from an answer is taken at its shortest decimal
//! form (what was written: `0.0000025`, not the binary double nearest to it), multiplied
//! exactly by its factor, and the product is rounded *up* to the next millionth. So
//! `1000 × 0.0000025` is exactly 2500 millionths, and any nonzero product, however small,
//! charges at least one millionth: a window never undercounts.

use std::fmt;

/// An amount in millionths of a unit (a token, a dollar): `Millionths(1_500_000)` is 1.5.
///
/// Every amount the quotas hold is one of these, so that fractional dollars add up exactly,
/// in the memory store and in Redis's Lua alike. An amount is at most [`Millionths::MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Millionths(pub u64);

impl Millionths {
    /// Nothing: what a request that never reached a member settles to.
    pub const ZERO: Millionths = Millionths(0);
    /// Millionths in one unit.
    pub const PER_UNIT: u64 = 1_000_000;
    /// The largest amount: 2^53 − 1 millionths (about nine billion units). Redis scripts do
    /// arithmetic in doubles, which hold every integer up to here exactly; an answer claiming
    /// more is malformed, and a sum stops here.
    pub const MAX: Millionths = Millionths((1 << 53) - 1);

    /// `units` whole units; `None` past [`Millionths::MAX`].
    pub fn from_units(units: u64) -> Option<Millionths> {
        units
            .checked_mul(Self::PER_UNIT)
            .filter(|m| *m <= Self::MAX.0)
            .map(Millionths)
    }

    /// The sum, or `None` past [`Millionths::MAX`].
    pub fn checked_add(self, other: Millionths) -> Option<Millionths> {
        self.0
            .checked_add(other.0)
            .filter(|m| *m <= Self::MAX.0)
            .map(Millionths)
    }

    /// The sum, held at [`Millionths::MAX`].
    pub fn saturating_add(self, other: Millionths) -> Millionths {
        self.checked_add(other).unwrap_or(Self::MAX)
    }

    /// Whole units, rounded down (what remains of a window, as a header shows it).
    pub fn units_floor(self) -> u64 {
        self.0 / Self::PER_UNIT
    }

    /// Whole units, rounded up (what a request takes, as a header shows it).
    pub fn units_ceil(self) -> u64 {
        self.0.div_ceil(Self::PER_UNIT)
    }
}

/// In units, with as many decimals as it needs: `12`, `0.5`, `0.000001`.
impl fmt::Display for Millionths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let whole = self.0 / Self::PER_UNIT;
        let frac = self.0 % Self::PER_UNIT;
        if frac == 0 {
            return write!(f, "{whole}");
        }
        let mut digits = format!("{frac:06}");
        while digits.ends_with('0') {
            digits.pop();
        }
        write!(f, "{whole}.{digits}")
    }
}

/// A non-negative decimal exactly as written: `digits × 10^exp`.
///
/// Config numbers (`times`, `default`, `value`) and numbers read from answers are kept in this
/// form, so that multiplying them is exact and only the final product is rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decimal {
    digits: u64,
    exp: i32,
}

impl Decimal {
    /// 1, the factor of an amount with no `times`.
    pub const ONE: Decimal = Decimal { digits: 1, exp: 0 };
    /// 0.
    pub const ZERO: Decimal = Decimal { digits: 0, exp: 0 };

    /// An integer, exactly.
    pub fn from_u64(n: u64) -> Decimal {
        Decimal { digits: n, exp: 0 }
    }

    /// The shortest decimal that reads back as `x`, which is what was written for any number
    /// of up to 17 significant digits. `None` when `x` is negative, NaN or infinite.
    pub fn from_f64(x: f64) -> Option<Decimal> {
        if !x.is_finite() || x < 0.0 {
            return None;
        }
        if x == 0.0 {
            // Also -0.0, whose text would carry a sign.
            return Some(Decimal::ZERO);
        }
        // Rust prints a double's shortest round-trip digits; `{:e}` gives `d.ddde±N`. At most
        // 17 digits plus sign, point and exponent: a fixed buffer, no allocation.
        let mut buf = StackText::default();
        fmt::write(&mut buf, format_args!("{x:e}")).ok()?;
        let text = buf.as_str();
        let (mantissa, exp) = text.split_once('e')?;
        let exp: i32 = exp.parse().ok()?;
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let mut digits: u64 = 0;
        for b in int.bytes().chain(frac.bytes()) {
            digits = digits
                .checked_mul(10)?
                .checked_add(u64::from(b.checked_sub(b'0')?))?;
        }
        Some(Decimal {
            digits,
            exp: exp - i32::try_from(frac.len()).ok()?,
        })
    }

    /// Reads a plain decimal number as a header carries it: `123`, `0.25`, `1e3`, spaces
    /// around it allowed. `None` for anything else, a negative number included.
    pub fn parse(text: &str) -> Option<Decimal> {
        let text = text.trim();
        let valid = !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
            && text.as_bytes()[0].is_ascii_digit();
        if !valid {
            return None;
        }
        if let Ok(n) = text.parse::<u64>() {
            return Some(Decimal::from_u64(n));
        }
        Decimal::from_f64(text.parse::<f64>().ok()?)
    }

    /// `self × factor` in millionths, rounded up; `None` past [`Millionths::MAX`].
    pub fn times(self, factor: Decimal) -> Option<Millionths> {
        let product = u128::from(self.digits) * u128::from(factor.digits);
        if product == 0 {
            return Some(Millionths::ZERO);
        }
        // Millionths are the product scaled by 10^6.
        let exp = i64::from(self.exp) + i64::from(factor.exp) + 6;
        let scaled = if exp >= 0 {
            let pow = 10u128.checked_pow(u32::try_from(exp).ok()?)?;
            product.checked_mul(pow)?
        } else {
            match 10u128.checked_pow(u32::try_from(-exp).ok()?) {
                Some(pow) => product.div_ceil(pow),
                // 10^39 and beyond exceed any u128 product: a positive sliver, one millionth.
                None => 1,
            }
        };
        u64::try_from(scaled)
            .ok()
            .filter(|m| *m <= Millionths::MAX.0)
            .map(Millionths)
    }

    /// This number as an amount (`times 1`).
    pub fn to_millionths(self) -> Option<Millionths> {
        self.times(Decimal::ONE)
    }
}

/// Text of at most 64 bytes, formatted without touching the heap.
struct StackText {
    buf: [u8; 64],
    len: usize,
}

impl Default for StackText {
    fn default() -> Self {
        StackText {
            buf: [0; 64],
            len: 0,
        }
    }
}

impl StackText {
    fn as_str(&self) -> &str {
        // Only whole `&str`s are ever copied in.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

impl fmt::Write for StackText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        if end > self.buf.len() {
            return Err(fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dec(x: f64) -> Decimal {
        Decimal::from_f64(x).unwrap()
    }

    #[test]
    fn prices_multiply_exactly_as_written() {
        // In doubles, 3.0 * 0.1 * 1e6 is 300000.00000000006, which a plain ceil would charge
        // as 300001.
        assert_eq!(
            Decimal::from_u64(1000).times(dec(0.0000025)),
            Some(Millionths(2500))
        );
        assert_eq!(
            Decimal::from_u64(3).times(dec(0.1)),
            Some(Millionths(300_000))
        );
        assert_eq!(dec(0.1).to_millionths(), Some(Millionths(100_000)));
        assert_eq!(
            Decimal::from_u64(7).times(dec(0.25)),
            Some(Millionths(1_750_000))
        );
        assert_eq!(dec(1e-300).to_millionths(), Some(Millionths(1)));
    }

    #[test]
    fn fractions_of_a_millionth_round_up() {
        assert_eq!(dec(0.0000001).to_millionths(), Some(Millionths(1)));
        assert_eq!(dec(1.0000001).to_millionths(), Some(Millionths(1_000_001)));
        assert_eq!(
            Decimal::from_u64(1).times(dec(0.0000025)),
            Some(Millionths(3))
        );
        assert_eq!(Decimal::ZERO.times(dec(5.0)), Some(Millionths::ZERO));
        assert_eq!(dec(-0.0).to_millionths(), Some(Millionths::ZERO));
    }

    #[test]
    fn past_the_largest_amount_is_none() {
        assert_eq!(
            Decimal::from_u64(9_007_199_254).to_millionths(),
            Some(Millionths(9_007_199_254_000_000))
        );
        assert_eq!(Decimal::from_u64(9_007_199_255).to_millionths(), None);
        assert_eq!(dec(1e300).to_millionths(), None);
        assert_eq!(
            Decimal::from_u64(u64::MAX).times(Decimal::from_u64(u64::MAX)),
            None
        );
        assert_eq!(Millionths::from_units(9_007_199_255), None);
        assert_eq!(Millionths::MAX.checked_add(Millionths(1)), None);
        assert_eq!(
            Millionths::MAX.saturating_add(Millionths(5)),
            Millionths::MAX
        );
    }

    #[test]
    fn negative_nan_and_infinite_are_not_numbers() {
        assert_eq!(Decimal::from_f64(-1.0), None);
        assert_eq!(Decimal::from_f64(f64::NAN), None);
        assert_eq!(Decimal::from_f64(f64::INFINITY), None);
        assert_eq!(Decimal::parse("-3"), None);
        assert_eq!(Decimal::parse("NaN"), None);
        assert_eq!(Decimal::parse("inf"), None);
        assert_eq!(Decimal::parse(""), None);
        assert_eq!(Decimal::parse(" 42 "), Some(Decimal::from_u64(42)));
        assert_eq!(
            Decimal::parse("0.25").and_then(Decimal::to_millionths),
            Some(Millionths(250_000))
        );
        assert_eq!(
            Decimal::parse("1e3").and_then(Decimal::to_millionths),
            Some(Millionths(1_000_000_000))
        );
    }

    #[test]
    fn display_is_in_units() {
        assert_eq!(Millionths(12_000_000).to_string(), "12");
        assert_eq!(Millionths(500_000).to_string(), "0.5");
        assert_eq!(Millionths(1).to_string(), "0.000001");
        assert_eq!(Millionths(1_250_000).units_floor(), 1);
        assert_eq!(Millionths(1_250_000).units_ceil(), 2);
    }

    proptest! {
        /// Integers times decimal factors agree with exact rational arithmetic.
        #[test]
        fn times_is_the_exact_product_rounded_up(n in 0u64..1_000_000_000, num in 0u64..1_000_000, scale in 0u32..9) {
            let factor_text = format!("{}e-{}", num, scale);
            let factor = Decimal::parse(&factor_text).unwrap();
            // n × num / 10^scale × 10^6, rounded up, in exact integers.
            let exact = (u128::from(n) * u128::from(num) * 1_000_000).div_ceil(10u128.pow(scale));
            let got = Decimal::from_u64(n).times(factor);
            if exact <= u128::from(Millionths::MAX.0) {
                prop_assert_eq!(got, Some(Millionths(exact as u64)));
            } else {
                prop_assert_eq!(got, None);
            }
        }
    }
}
