//! 8-bit floats (OCP FP8): e4m3 ("FN": no infinities, 448 max) and e5m2 (IEEE-like, 57344 max).
//!
//! Encoding rounds to nearest, ties to even, and saturates at the largest finite value: a
//! quantizer that scales its group to the format's range never produces NaN or infinity.

/// One of the two OCP 8-bit float formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits; no infinities; max 448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits; max finite 57344.
    E5M2,
}

/// Non-negative finite values of a format, indexed by code (codes 0..=max_code).
struct Table {
    values: [f32; 128],
    max_code: u8,
}

const fn pow2(k: i32) -> f32 {
    // Normal f32 powers of two only; both formats stay far inside f32's normal range.
    f32::from_bits(((k + 127) as u32) << 23)
}

const fn build(exp_bits: u32, man_bits: u32, max_code: u8) -> Table {
    let bias = (1i32 << (exp_bits - 1)) - 1;
    let mut values = [0.0f32; 128];
    let mut c = 0u32;
    while c <= max_code as u32 {
        let e = (c >> man_bits) as i32;
        let m = (c & ((1 << man_bits) - 1)) as f32;
        let frac = m * pow2(-(man_bits as i32));
        values[c as usize] = if e == 0 { frac * pow2(1 - bias) } else { (1.0 + frac) * pow2(e - bias) };
        c += 1;
    }
    Table { values, max_code }
}

static E4M3: Table = build(4, 3, 0x7e);
static E5M2: Table = build(5, 2, 0x7b);

/// Every code's value (what [`Fp8Format::decode`] returns), for table lookups.
const fn build_levels(t: &Table, e5m2: bool) -> [f32; 256] {
    let mut out = [0f32; 256];
    let mut c = 0usize;
    while c < 256 {
        let mag = c & 0x7f;
        let v = if mag <= t.max_code as usize {
            t.values[mag]
        } else if e5m2 && mag == 0x7c {
            f32::INFINITY
        } else {
            f32::NAN
        };
        out[c] = if c & 0x80 != 0 { -v } else { v };
        c += 1;
    }
    out
}

static E4M3_LEVELS: [f32; 256] = build_levels(&E4M3, false);
static E5M2_LEVELS: [f32; 256] = build_levels(&E5M2, true);

impl Fp8Format {
    fn table(self) -> &'static Table {
        match self {
            Fp8Format::E4M3 => &E4M3,
            Fp8Format::E5M2 => &E5M2,
        }
    }

    /// The value of every code, indexed by code: [`Fp8Format::decode`] as a table.
    pub fn levels(self) -> &'static [f32; 256] {
        match self {
            Fp8Format::E4M3 => &E4M3_LEVELS,
            Fp8Format::E5M2 => &E5M2_LEVELS,
        }
    }

    /// Largest finite value (448 for e4m3, 57344 for e5m2).
    pub fn max_value(self) -> f32 {
        let t = self.table();
        t.values[t.max_code as usize]
    }

    /// Smallest positive (subnormal) value.
    pub fn min_positive(self) -> f32 {
        self.table().values[1]
    }

    /// Decodes a code. NaN codes decode to NaN and e5m2's infinity codes to ±Inf; the
    /// quantizers of this crate never produce them.
    pub fn decode(self, code: u8) -> f32 {
        let t = self.table();
        let mag = code & 0x7f;
        let v = if mag <= t.max_code {
            t.values[mag as usize]
        } else if self == Fp8Format::E5M2 && mag == 0x7c {
            f32::INFINITY
        } else {
            f32::NAN
        };
        if code & 0x80 != 0 { -v } else { v }
    }

    /// Encodes a finite value: round to nearest, ties to even, saturating at ±max.
    /// NaN encodes as 0 (callers reject NaN before they get here).
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        let (man_bits, bias, max_code) = match self {
            Fp8Format::E4M3 => (3u32, 7i32, 0x7eu32),
            Fp8Format::E5M2 => (2, 15, 0x7b),
        };
        let a = x.abs();
        let code = if a.is_nan() {
            0
        } else if a < f32::from_bits(((1 - bias + 127) as u32) << 23) {
            // Subnormal range: a multiple of the smallest step; 2^(M) steps reach the
            // smallest normal, whose code follows on continuously.
            let steps = a * f32::from_bits(((bias - 1 + man_bits as i32 + 127) as u32) << 23);
            ((steps + 12_582_912.0) - 12_582_912.0) as u32
        } else {
            // Round the f32 mantissa to `man_bits` bits, ties to even, by integer arithmetic
            // on the bits; a carry moves into the exponent as it should.
            let shift = 23 - man_bits;
            let bits = a.to_bits();
            let rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift;
            rounded.saturating_sub(((127 - bias) as u32) << man_bits).min(max_code)
        };
        code as u8 | if x.is_sign_negative() && code != 0 { 0x80 } else { 0 }
    }

    /// The reference encoder: nearest entry of the decode table, ties to the even code.
    pub fn encode_reference(self, x: f32) -> u8 {
        let t = self.table();
        let a = x.abs();
        let top = t.max_code as usize;
        let code = if a.is_nan() {
            0
        } else if a >= t.values[top] {
            top
        } else {
            // `values` is increasing on 0..=top, so this is the last code not above `a`.
            let lo = t.values[..=top].partition_point(|&v| v <= a) - 1;
            // Both differences are exact (Sterbenz), so the tie test is exact too.
            let below = a - t.values[lo];
            let above = t.values[lo + 1] - a;
            if below < above || (below == above && lo % 2 == 0) { lo } else { lo + 1 }
        };
        code as u8 | if x.is_sign_negative() && code != 0 { 0x80 } else { 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(Fp8Format::E4M3.max_value(), 448.0);
        assert_eq!(Fp8Format::E5M2.max_value(), 57344.0);
        assert_eq!(Fp8Format::E4M3.min_positive(), 2f32.powi(-9));
        assert_eq!(Fp8Format::E5M2.min_positive(), 2f32.powi(-16));
        assert_eq!(Fp8Format::E4M3.encode(1.0), 0x38);
        assert_eq!(Fp8Format::E5M2.encode(1.0), 0x3c);
        assert_eq!(Fp8Format::E4M3.encode(-448.0), 0xfe);
        assert!(Fp8Format::E4M3.decode(0x7f).is_nan());
        assert_eq!(Fp8Format::E5M2.decode(0x7c), f32::INFINITY);
    }

    #[test]
    fn saturates_and_rounds_ties_to_even() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            assert_eq!(f.decode(f.encode(1e9)), f.max_value());
            assert_eq!(f.decode(f.encode(-1e9)), -f.max_value());
        }
        // e4m3 near 1: spacing 1/8. 1 + 1/16 is a tie between 1 (even mantissa 0) and 1.125.
        assert_eq!(Fp8Format::E4M3.decode(Fp8Format::E4M3.encode(1.0625)), 1.0);
        // 1.125 + 1/16 ties between 1.125 (odd) and 1.25 (even).
        assert_eq!(Fp8Format::E4M3.decode(Fp8Format::E4M3.encode(1.1875)), 1.25);
        // Half the smallest subnormal ties to zero; just above it rounds up.
        let tiny = Fp8Format::E4M3.min_positive();
        assert_eq!(Fp8Format::E4M3.encode(tiny / 2.0), 0);
        assert_eq!(Fp8Format::E4M3.encode(tiny * 0.51), 1);
    }

    #[test]
    fn fast_encoder_matches_the_reference() {
        // Every f32 bit pattern with a stride, plus every midpoint between neighbouring codes.
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for bits in (0..=0x7f80_0000u32).step_by(997) {
                let x = f32::from_bits(bits);
                assert_eq!(f.encode(x), f.encode_reference(x), "{f:?} {x:e}");
                assert_eq!(f.encode(-x), f.encode_reference(-x), "{f:?} {:e}", -x);
            }
            for c in 0..0x7eu8 {
                let (a, b) = (f.decode(c), f.decode(c + 1));
                if b.is_finite() {
                    for x in [0.5 * (a + b), a + (b - a) * 0.4999, a + (b - a) * 0.5001] {
                        assert_eq!(f.encode(x), f.encode_reference(x), "{f:?} {x:e}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_level_tables_are_decode() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for c in 0..=255u8 {
                assert_eq!(f.levels()[c as usize].to_bits(), f.decode(c).to_bits(), "{f:?} {c:#x}");
            }
        }
    }

    #[test]
    fn every_code_round_trips() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for c in 0..=255u8 {
                let v = f.decode(c);
                if v.is_finite() && c != 0x80 {
                    assert_eq!(f.encode(v), c, "{f:?} code {c:#x} value {v}");
                }
            }
        }
    }
}
