//! Storage of per-group parameters (scales and offsets) as f16 or f32.

use half::f16;

use crate::error::{QuantError, Result};
use crate::format::ParamDtype;

/// A vector of parameters held in their storage type, so that byte counts are real.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamVec {
    /// Half-precision parameters.
    F16(Vec<f16>),
    /// Single-precision parameters.
    F32(Vec<f32>),
}

impl ParamVec {
    /// Stores `values`, which must already be representable in `dtype` (see [`round_param`]).
    pub(crate) fn from_rounded(dtype: ParamDtype, values: &[f32]) -> Self {
        match dtype {
            ParamDtype::F16 => ParamVec::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            ParamDtype::F32 => ParamVec::F32(values.to_vec()),
        }
    }

    /// Parameter `i` as f32 (exact: f16 widens losslessly).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            ParamVec::F16(v) => v[i].to_f32(),
            ParamVec::F32(v) => v[i],
        }
    }

    /// All parameters widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            ParamVec::F16(v) => v.iter().map(|h| h.to_f32()).collect(),
            ParamVec::F32(v) => v.clone(),
        }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        match self {
            ParamVec::F16(v) => v.len(),
            ParamVec::F32(v) => v.len(),
        }
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        match self {
            ParamVec::F16(v) => v.len() * 2,
            ParamVec::F32(v) => v.len() * 4,
        }
    }

    /// The storage type.
    pub fn dtype(&self) -> ParamDtype {
        match self {
            ParamVec::F16(_) => ParamDtype::F16,
            ParamVec::F32(_) => ParamDtype::F32,
        }
    }
}

/// Which way a parameter may be rounded to its storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    /// To the largest representable value not above `x` (offsets: the range stays covered).
    Down,
    /// To the smallest representable value not below `x` (scales: no code overflows).
    Up,
}

/// Rounds `x` to a value `dtype` represents, in direction `dir`.
///
/// The f16 case works on the f32 bits (truncate the mantissa to f16's 10 bits, or to f16's
/// subnormal step, then step up if needed): no conversion calls on the streaming hot path.
/// [`round_param_reference`] is the obvious version through `half`; tests compare the two.
///
/// # Errors
/// [`QuantError::ParamOverflow`] when the result does not fit (|x| beyond 65504 for f16).
#[inline]
pub(crate) fn round_param(x: f32, dtype: ParamDtype, dir: Round) -> Result<f32> {
    let overflow = || QuantError::ParamOverflow { value: x, dtype: dtype.name() };
    if !x.is_finite() {
        return Err(overflow());
    }
    if dtype == ParamDtype::F32 || x == 0.0 {
        return Ok(x);
    }
    const F16_MAX: f32 = 65504.0;
    const MIN_NORMAL: f32 = 6.103_515_6e-5; // 2^-14
    const SUB_STEP: f32 = 5.960_464_5e-8; // 2^-24
    let a = x.abs();
    // Rounding down a positive value, or up a negative one, shrinks the magnitude.
    let toward_zero = (dir == Round::Down) == (x > 0.0);
    let (floor, step) = if a >= MIN_NORMAL {
        let bits = a.to_bits();
        let step = f32::from_bits(((bits >> 23) - 10) << 23);
        (f32::from_bits(bits & !((1 << 13) - 1)), step)
    } else {
        (((a / SUB_STEP) as u32) as f32 * SUB_STEP, SUB_STEP)
    };
    let magnitude = if toward_zero {
        floor.min(F16_MAX)
    } else if floor < a {
        floor + step
    } else {
        floor
    };
    if magnitude > F16_MAX {
        return Err(overflow());
    }
    Ok(magnitude.copysign(x))
}

/// [`round_param`] through `half`'s conversions: round to nearest, then step one f16 ulp if
/// that landed on the wrong side. The reference the fast version is tested against.
#[cfg(test)]
pub(crate) fn round_param_reference(x: f32, dtype: ParamDtype, dir: Round) -> Result<f32> {
    let overflow = || QuantError::ParamOverflow { value: x, dtype: dtype.name() };
    match dtype {
        ParamDtype::F32 => x.is_finite().then_some(x).ok_or_else(overflow),
        ParamDtype::F16 => {
            let h = f16::from_f32(x);
            let v = h.to_f32();
            let stepped = match dir {
                Round::Down if v > x => step(h, false),
                Round::Up if v < x => step(h, true),
                _ => h,
            };
            stepped.is_finite().then(|| stepped.to_f32()).ok_or_else(overflow)
        }
    }
}

/// The next f16 towards +∞ (`up`) or −∞.
#[cfg(test)]
fn step(h: f16, up: bool) -> f16 {
    let bits = h.to_bits();
    let magnitude = bits & 0x7fff;
    let negative = bits & 0x8000 != 0;
    if magnitude == 0 {
        return f16::from_bits(if up { 0x0001 } else { 0x8001 });
    }
    // Moving away from zero increases the magnitude bits, towards zero decreases them.
    if up != negative { f16::from_bits(bits + 1) } else { f16::from_bits(bits - 1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_rounding_matches_the_reference() {
        for bits in (0..0x7f80_0000u32).step_by(331) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                for dir in [Round::Down, Round::Up] {
                    let (fast, slow) = (
                        round_param(x, ParamDtype::F16, dir),
                        round_param_reference(x, ParamDtype::F16, dir),
                    );
                    match (fast, slow) {
                        (Ok(a), Ok(b)) => assert!(a == b, "{x:e} {dir:?}: {a:e} vs {b:e}"),
                        (Err(_), Err(_)) => {}
                        (a, b) => panic!("{x:e} {dir:?}: {a:?} vs {b:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn directed_rounding() {
        for x in [0.1f32, -0.1, 1.0 / 3.0, -7.77, 1e-6, -1e-6, 0.0, 1000.3] {
            let d = round_param(x, ParamDtype::F16, Round::Down).unwrap();
            let u = round_param(x, ParamDtype::F16, Round::Up).unwrap();
            assert!(d <= x && x <= u, "{x}: {d} {u}");
            assert_eq!(f16::from_f32(d).to_f32(), d);
            assert_eq!(f16::from_f32(u).to_f32(), u);
        }
        assert!(round_param(70000.0, ParamDtype::F16, Round::Up).is_err());
        assert!(round_param(65504.0, ParamDtype::F16, Round::Up).is_ok());
        assert_eq!(round_param(0.1, ParamDtype::F32, Round::Up).unwrap(), 0.1);
    }
}
