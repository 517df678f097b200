//! Storage of per-group parameters (scales and offsets) as f16, f32, or one byte each on a
//! grid per set of groups ([`ParamGrid`]).

use half::f16;

use crate::error::{QuantError, Result};
use crate::format::ParamDtype;

/// The parameters of one group: `x̂ = decode(code) · scale + offset`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GroupParams {
    /// Step (affine, symmetric) or multiplier (FP8, codebook).
    pub scale: f32,
    /// Affine minimum; 0 for the other kinds.
    pub offset: f32,
}

/// Bytes a set of one-byte parameters ([`ParamDtype::U8`]) adds: its grid's two f16 ends.
pub const GRID_BYTES: usize = 4;

/// Rows of one head that share a grid when [`quantize`](crate::quantize::quantize) stores the
/// one-byte parameters of a per-token or `gN` spec: a cache block of the default size (a
/// cache's set is its block, of whatever size).
pub const ROW_SET_TOKENS: usize = 32;

/// The grid of one set of affine groups with one-byte parameters ([`ParamDtype::U8`]): 256
/// points from `lo` to `hi` (both f16), 255 steps apart. Each group stores two grid indices,
/// the points nearest to its minimum and to its maximum ([`ParamGrid::snap`]); its offset and
/// scale are [`ParamGrid::params`] of them, computed the same way (in f32, unfused) by the
/// quantizer and by every reader, so that the codes were chosen with the parameters the
/// readers see. Each end of a group's range moves by at most half a step, `(hi − lo) / 510`:
/// for per-channel keys, whose channels span a set's range together, a small part of a
/// channel's own step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamGrid {
    lo: f16,
    hi: f16,
}

impl ParamGrid {
    /// The grid spanning the ranges `(min, max)` of a set: its minimum rounded down and its
    /// maximum rounded up to f16.
    ///
    /// # Errors
    /// [`QuantError::ParamOverflow`] when an end is not finite or beyond f16, and
    /// [`QuantError::InvalidArgument`] for an empty set or a range with min > max.
    pub fn fit(ranges: impl IntoIterator<Item = (f32, f32)>) -> Result<Self> {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for (a, b) in ranges {
            if a.is_nan() || b.is_nan() || a > b {
                return Err(QuantError::InvalidArgument(format!(
                    "a group's range [{a}, {b}] is not ordered"
                )));
            }
            lo = lo.min(a);
            hi = hi.max(b);
        }
        if lo > hi {
            return Err(QuantError::InvalidArgument("a parameter grid needs at least one group".into()));
        }
        let lo = round_param(lo, ParamDtype::F16, Round::Down)?;
        let hi = round_param(hi, ParamDtype::F16, Round::Up)?;
        Ok(Self { lo: f16::from_f32(lo), hi: f16::from_f32(hi) })
    }

    /// The grid stored as `lo`, `hi` (little-endian f16 bytes, as [`ParamGrid::to_bytes`]).
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] when an end is not finite or `lo > hi` (a corrupt
    /// block).
    pub fn from_bytes(bytes: [u8; GRID_BYTES]) -> Result<Self> {
        let lo = f16::from_le_bytes([bytes[0], bytes[1]]);
        let hi = f16::from_le_bytes([bytes[2], bytes[3]]);
        if !lo.is_finite() || !hi.is_finite() || lo > hi {
            return Err(QuantError::InvalidArgument(format!("parameter grid [{lo}, {hi}] is not a range")));
        }
        Ok(Self { lo, hi })
    }

    /// The two ends as little-endian f16 bytes.
    pub fn to_bytes(&self) -> [u8; GRID_BYTES] {
        let (a, b) = (self.lo.to_le_bytes(), self.hi.to_le_bytes());
        [a[0], a[1], b[0], b[1]]
    }

    /// The ends as f32 (exact). Converted in plain code: `half`'s `to_f32` checks the CPU on
    /// every call, and decode asks for a block's grid once per block it reads.
    #[inline]
    pub fn ends(&self) -> (f32, f32) {
        (self.lo.to_f32_const(), self.hi.to_f32_const())
    }

    /// Distance between grid points.
    #[inline]
    pub fn step(&self) -> f32 {
        self.origin_step().1
    }

    /// The first grid point and the distance between points, from one conversion of the ends
    /// (what widening a block's indices needs).
    #[inline]
    pub fn origin_step(&self) -> (f32, f32) {
        let (lo, hi) = self.ends();
        (lo, (hi - lo) / 255.0)
    }

    /// The grid indices of a group with range `[min, max]` (inside the grid): the points
    /// nearest to `min` and to `max`. Rounding both ends outward instead (so that no value
    /// clips) widened every range by a grid step on average and raised the keys' attention KL
    /// by up to 7% on the shared capture; to the nearest point it is within 2% of f16
    /// parameters, and a value beyond its group's rounded range, by at most half a grid step,
    /// takes the end code.
    pub fn snap(&self, min: f32, max: f32) -> (u8, u8) {
        let (lo, step) = self.origin_step();
        if step == 0.0 || !step.is_finite() {
            return (0, 0);
        }
        let index = |x: f32| ((x - lo) / step).round_ties_even().clamp(0.0, 255.0) as u8;
        let a = index(min);
        (a, index(max).max(a))
    }

    /// Offset and scale of the group with grid indices `a` (minimum) and `b` (maximum):
    /// `offset = lo + step · a`, `scale = (b − a) · (step / levels)`.
    #[inline]
    pub fn params(&self, a: u8, b: u8, levels: f32) -> GroupParams {
        let (lo, step) = self.origin_step();
        GroupParams {
            offset: lo + step * f32::from(a),
            scale: f32::from(b.saturating_sub(a)) * (step / levels),
        }
    }

    /// [`ParamGrid::params`] of every pair `(mins[i], maxs[i])` into `scales` and `offsets`
    /// (the same values, with the grid's constants computed once: a block's parameters in a
    /// loop that vectorizes).
    ///
    /// # Panics
    /// When the four slices differ in length.
    pub fn widen(&self, mins: &[u8], maxs: &[u8], levels: f32, scales: &mut [f32], offsets: &mut [f32]) {
        assert!(
            mins.len() == maxs.len() && scales.len() == mins.len() && offsets.len() == mins.len(),
            "one scale and offset per pair of indices"
        );
        let (lo, step) = self.origin_step();
        let unit = step / levels;
        for (((s, o), &a), &b) in scales.iter_mut().zip(offsets.iter_mut()).zip(mins).zip(maxs) {
            *o = lo + step * f32::from(a);
            *s = f32::from(b.saturating_sub(a)) * unit;
        }
    }

    /// Snaps the affine parameters of one set onto its grid: each group's range
    /// `[offset, offset + scale · levels]` moved to the nearest grid points, the parameters
    /// replaced by the grid's, and the indices (minimum, maximum) written to `codes`.
    ///
    /// # Errors
    /// As [`ParamGrid::fit`].
    pub fn snap_set(params: &mut [GroupParams], levels: f32, codes: &mut Vec<(u8, u8)>) -> Result<Self> {
        let grid = Self::fit(params.iter().map(|p| (p.offset, p.offset + p.scale * levels)))?;
        codes.clear();
        for p in params.iter_mut() {
            let (a, b) = grid.snap(p.offset, p.offset + p.scale * levels);
            codes.push((a, b));
            *p = grid.params(a, b, levels);
        }
        Ok(grid)
    }
}

/// A vector of parameters held in their storage type, so that byte counts are real.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamVec {
    /// Half-precision parameters.
    F16(Vec<f16>),
    /// Single-precision parameters.
    F32(Vec<f32>),
    /// One-byte parameters ([`ParamDtype::U8`]), held decoded; `sets` grids of
    /// [`GRID_BYTES`] are counted, half with the scales and half with the offsets.
    U8 {
        /// The parameters as decoded from their grid indices.
        values: Vec<f32>,
        /// Sets (grids) the parameters belong to.
        sets: usize,
    },
}

impl ParamVec {
    /// Stores `values`, which must already be representable in `dtype` (see [`round_param`]).
    pub(crate) fn from_rounded(dtype: ParamDtype, values: &[f32]) -> Self {
        match dtype {
            ParamDtype::F16 => ParamVec::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            ParamDtype::F32 => ParamVec::F32(values.to_vec()),
            // Callers with one-byte parameters build the variant with its set count.
            ParamDtype::U8 => ParamVec::U8 { values: values.to_vec(), sets: 0 },
        }
    }

    /// Parameter `i` as f32 (exact: f16 widens losslessly).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            ParamVec::F16(v) => v[i].to_f32(),
            ParamVec::F32(v) | ParamVec::U8 { values: v, .. } => v[i],
        }
    }

    /// All parameters widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            ParamVec::F16(v) => v.iter().map(|h| h.to_f32()).collect(),
            ParamVec::F32(v) | ParamVec::U8 { values: v, .. } => v.clone(),
        }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        match self {
            ParamVec::F16(v) => v.len(),
            ParamVec::F32(v) | ParamVec::U8 { values: v, .. } => v.len(),
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
            ParamVec::U8 { values, sets } => values.len() + sets * GRID_BYTES / 2,
        }
    }

    /// The storage type.
    pub fn dtype(&self) -> ParamDtype {
        match self {
            ParamVec::F16(_) => ParamDtype::F16,
            ParamVec::F32(_) => ParamDtype::F32,
            ParamVec::U8 { .. } => ParamDtype::U8,
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
    // One-byte parameters are snapped to their set's grid afterwards ([`ParamGrid::snap_set`]).
    if matches!(dtype, ParamDtype::F32 | ParamDtype::U8) || x == 0.0 {
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
        ParamDtype::F32 | ParamDtype::U8 => x.is_finite().then_some(x).ok_or_else(overflow),
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
    fn grid_parameters_cover_each_range_and_read_back() {
        let mut rng = crate::synth::Rng::new(17);
        for levels in [1.0f32, 3.0, 15.0, 255.0] {
            for scale in [1e-3f64, 1.0, 30.0, 1e3] {
                // Channels with a large constant offset and a small spread, as keys have.
                let ranges: Vec<(f32, f32)> = (0..64)
                    .map(|c| {
                        let mid = scale * rng.normal() * if c % 9 == 0 { 8.0 } else { 1.0 };
                        let half = (scale * 0.3 * rng.normal().abs()) as f32;
                        (mid as f32 - half, mid as f32 + half)
                    })
                    .collect();
                let mut params: Vec<GroupParams> =
                    ranges.iter().map(|&(a, b)| GroupParams { offset: a, scale: (b - a) / levels }).collect();
                let mut codes = Vec::new();
                let grid = ParamGrid::snap_set(&mut params, levels, &mut codes).unwrap();
                let back = ParamGrid::from_bytes(grid.to_bytes()).unwrap();
                assert_eq!(back, grid);
                let (lo, hi) = grid.ends();
                // Each end within half a grid step (and f32 rounding) of the group's own.
                let slack = 0.5 * grid.step() * 1.0001 + 1e-6 * (hi - lo);
                for ((&(a, b), p), &(i, j)) in ranges.iter().zip(&params).zip(&codes) {
                    let top = p.offset + p.scale * levels;
                    assert!(
                        (p.offset - a).abs() <= slack,
                        "{levels}: minimum {a} on the grid as {}",
                        p.offset
                    );
                    assert!((top - b).abs() <= slack, "{levels}: maximum {b} on the grid as {top}");
                    assert_eq!(back.params(i, j, levels), *p);
                }
                let (mins, maxs): (Vec<u8>, Vec<u8>) = codes.iter().copied().unzip();
                let (mut s, mut o) = (vec![0f32; mins.len()], vec![0f32; mins.len()]);
                grid.widen(&mins, &maxs, levels, &mut s, &mut o);
                for ((p, s), o) in params.iter().zip(&s).zip(&o) {
                    assert_eq!((p.scale.to_bits(), p.offset.to_bits()), (s.to_bits(), o.to_bits()));
                }
            }
        }
        // A constant set: step 0, every group its value.
        let mut params = vec![GroupParams { offset: 2.5, scale: 0.0 }; 3];
        let grid = ParamGrid::snap_set(&mut params, 15.0, &mut Vec::new()).unwrap();
        assert_eq!(grid.step(), 0.0);
        assert!(params.iter().all(|p| p.offset == 2.5 && p.scale == 0.0));
    }

    #[test]
    fn bad_grids_are_errors() {
        assert!(ParamGrid::fit([(f32::NAN, 1.0)]).is_err());
        assert!(ParamGrid::fit([(2.0, 1.0)]).is_err());
        assert!(ParamGrid::fit([(0.0, 70000.0)]).is_err());
        assert!(ParamGrid::fit(std::iter::empty()).is_err());
        let (one, two) = (f16::from_f32(1.0).to_le_bytes(), f16::from_f32(2.0).to_le_bytes());
        assert!(ParamGrid::from_bytes([two[0], two[1], one[0], one[1]]).is_err());
        let nan = f16::NAN.to_le_bytes();
        assert!(ParamGrid::from_bytes([nan[0], nan[1], one[0], one[1]]).is_err());
        assert!(ParamGrid::from_bytes([one[0], one[1], two[0], two[1]]).is_ok());
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
