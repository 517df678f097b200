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
/// # Errors
/// [`QuantError::ParamOverflow`] when the result does not fit (|x| beyond 65504 for f16).
pub(crate) fn round_param(x: f32, dtype: ParamDtype, dir: Round) -> Result<f32> {
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
