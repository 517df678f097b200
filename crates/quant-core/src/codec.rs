//! The arithmetic of one group: parameters from a range, values to codes, codes to values.
//!
//! [`Codec`] is what every layout of the workspace shares: the offline tensor quantizer of
//! this crate, the streaming cache of `kvq-cache-layout` and the scalar references of the
//! kernels all encode and decode through it, so their codes agree bit for bit.

use crate::codebook::Codebook;
use crate::error::Result;
use crate::format::{CodebookSource, Kind, ParamDtype, QuantSpec, RangeRule};
use crate::fp8::Fp8Format;
use crate::params::{GroupParams, Round, round_param};
use crate::rowkernels::{Linear, LinearLanes, ROUND_MAGIC, RowKernels, clamp, round_to_code};

/// Shrink factors of the range the error-minimizing search starts from (1 is min/max). Spread
/// evenly down to half the range, the point beyond which clipping a Gaussian-like group at 2
/// bits stops paying; the refits move each start to its nearest local optimum.
pub const MSE_SHRINKS: &[f32] = &[1.0, 0.9, 0.8, 0.7, 0.6, 0.5];

/// Alternating assignment/least-squares rounds from each start of the search.
pub const MSE_REFITS: usize = 2;

/// Values per stack chunk in the error-minimizing search.
const FIT_CHUNK: usize = 256;

/// Sums over a group for the least-squares refit: levels `l`, values `x`.
#[derive(Debug, Clone, Copy, Default)]
struct FitSums {
    n: f64,
    l: f64,
    ll: f64,
    x: f64,
    xl: f64,
}

/// [`Codec::fit_error`] for the linear kinds in one pass: each value's code is computed as
/// [`encode_linear`](crate::rowkernels::encode_linear) computes it (`L(code)` is the code less the zero point) and decoded as
/// [`Codec::decode`] does, eight lanes at a time with `wide` (the tail one by one with the same
/// operations), the sums of each chunk of [`FIT_CHUNK`] values added up in f64.
fn fit_error_linear(xs: &[f32], l: &Linear, p: GroupParams) -> (f64, FitSums) {
    use wide::f32x8;
    let linear = LinearLanes::new(l);
    let (scale, offset) = (f32x8::splat(p.scale), f32x8::splat(p.offset));
    let (mut err, mut sums) = (0f64, FitSums::default());
    for chunk in xs.chunks(FIT_CHUNK) {
        // Error², level, level², value, value · level.
        let zero = f32x8::splat(0.0);
        let (mut e2, mut sl, mut sll, mut sx, mut sxl) = (zero, zero, zero, zero, zero);
        let mut lanes = chunk.chunks_exact(8);
        for c in &mut lanes {
            let v = f32x8::from(<[f32; 8]>::try_from(c).expect("8 lanes"));
            let level = linear.code(v) - linear.add;
            let e = v - (level * scale + offset);
            e2 += e * e;
            sl += level;
            sll += level * level;
            sx += v;
            sxl += v * level;
        }
        let total = |a: f32x8| a.to_array().iter().map(|&v| f64::from(v)).sum::<f64>();
        let mut tail = [0f64; 5];
        for &v in lanes.remainder() {
            let t = clamp((v - l.offset) * l.inv, l.lo, l.hi) + l.add;
            let level = ((t + ROUND_MAGIC) - ROUND_MAGIC) - l.add;
            let e = v - (level * p.scale + p.offset);
            let (v, level) = (f64::from(v), f64::from(level));
            tail[0] += f64::from(e * e);
            tail[1] += level;
            tail[2] += level * level;
            tail[3] += v;
            tail[4] += v * level;
        }
        err += total(e2) + tail[0];
        sums.l += total(sl) + tail[1];
        sums.ll += total(sll) + tail[2];
        sums.x += total(sx) + tail[3];
        sums.xl += total(sxl) + tail[4];
        sums.n += chunk.len() as f64;
    }
    (err, sums)
}

/// `1 / scale`; a zero (or subnormal) scale means a constant group: every value maps to the
/// code of the offset, and the reciprocal is kept finite so that 0 · inv is never NaN.
#[inline(always)]
fn inverse(scale: f32) -> f32 {
    if scale > f32::MIN_POSITIVE { 1.0 / scale } else { 0.0 }
}

/// Per-channel parameters with their reciprocals computed once, for encoding many rows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChannelParams {
    params: Vec<GroupParams>,
    offset: Vec<f32>,
    inv: Vec<f32>,
}

impl ChannelParams {
    /// Prepares `params` (one per channel).
    pub fn new(params: &[GroupParams]) -> Self {
        Self {
            params: params.to_vec(),
            offset: params.iter().map(|p| p.offset).collect(),
            inv: params
                .iter()
                .map(|p| if p.scale > f32::MIN_POSITIVE { 1.0 / p.scale } else { 0.0 })
                .collect(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &[GroupParams] {
        &self.params
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Math {
    Affine { levels: f32 },
    Symmetric { qmax: f32, zero: f32 },
    Fp8(Fp8Format),
    Codebook(Codebook),
}

/// Encoder and decoder of one spec's groups.
#[derive(Debug, Clone, PartialEq)]
pub struct Codec {
    math: Math,
    dtype: ParamDtype,
    ranges: RangeRule,
}

impl Codec {
    /// The codec of `spec`. A Lloyd-Max spec has no levels until fitted: pass them as
    /// `fitted` (ignored by every other kind); without them NF4 levels are used.
    pub fn new(spec: &QuantSpec, fitted: Option<&Codebook>) -> Self {
        let bits = spec.bits();
        let math = match spec.kind() {
            Kind::Affine => Math::Affine { levels: ((1u32 << bits) - 1) as f32 },
            Kind::Symmetric => {
                let half = (1u32 << (bits - 1)) as f32;
                Math::Symmetric { qmax: half - 1.0, zero: half }
            }
            Kind::Fp8(f) => Math::Fp8(*f),
            Kind::Codebook(CodebookSource::Fixed(cb)) => Math::Codebook(cb.clone()),
            Kind::Codebook(CodebookSource::Nf4) => Math::Codebook(Codebook::nf4()),
            Kind::Codebook(CodebookSource::LloydMax) => {
                Math::Codebook(fitted.cloned().unwrap_or_else(Codebook::nf4))
            }
        };
        Self { math, dtype: spec.param_dtype(), ranges: spec.ranges() }
    }

    /// The highest affine code, `2^b − 1` (what one-byte parameter grids divide a range by);
    /// `None` for the other kinds.
    pub fn affine_levels(&self) -> Option<f32> {
        match self.math {
            Math::Affine { levels } => Some(levels),
            _ => None,
        }
    }

    /// The parameters of a group holding `xs`, whose minimum and maximum are `min` and `max`
    /// (finite), by the spec's [`RangeRule`]: [`Codec::params`] for min/max ranges, the
    /// search of [`Codec::fit_mse`] for error-minimizing ones. Every layout calls this, so
    /// the offline quantizer and the streaming cache choose the same parameters.
    ///
    /// # Errors
    /// As [`Codec::params`].
    #[inline]
    pub fn group_params(&self, xs: &[f32], min: f32, max: f32) -> Result<GroupParams> {
        match self.ranges {
            RangeRule::MinMax => self.params(min, max),
            RangeRule::Mse => self.fit_mse(xs, min, max),
        }
    }

    /// The parameters that minimize the squared error of `xs` (minimum `min`, maximum `max`,
    /// all finite), among those a short deterministic search visits: the min/max parameters;
    /// ranges shrunk about the centre (affine) or about zero (the other kinds) by each factor
    /// of [`MSE_SHRINKS`]; and from each of those, [`MSE_REFITS`] rounds of nearest-code
    /// assignment followed by the least-squares scale (and offset) for those codes. Every
    /// candidate is rounded to the storage type before its error is measured, so the result
    /// is never worse than min/max on `xs`. Allocates nothing.
    ///
    /// # Errors
    /// As [`Codec::params`].
    pub fn fit_mse(&self, xs: &[f32], min: f32, max: f32) -> Result<GroupParams> {
        let first = self.params(min, max)?;
        if xs.is_empty() || min >= max {
            return Ok(first);
        }
        let start = self.fit_error(xs, first);
        let mut best = (start.0, first);
        let affine = matches!(self.math, Math::Affine { .. });
        let (centre, half) =
            if affine { (0.5 * (min + max), 0.5 * (max - min)) } else { (0.0, min.abs().max(max.abs())) };
        for &shrink in MSE_SHRINKS {
            let (mut p, mut fit) = if shrink >= 1.0 {
                (first, start)
            } else {
                let Ok(p) = self.params(centre - half * shrink, centre + half * shrink) else { continue };
                (p, self.fit_error(xs, p))
            };
            for round in 0..=MSE_REFITS {
                if fit.0 < best.0 {
                    best = (fit.0, p);
                }
                if round == MSE_REFITS {
                    break;
                }
                let Some(next) = self.refit(&fit.1) else { break };
                let next_fit = self.fit_error(xs, next);
                if next_fit.0 >= fit.0 {
                    break;
                }
                (p, fit) = (next, next_fit);
            }
        }
        Ok(best.1)
    }

    /// `(Σ (x − x̂)², the fit statistics)` of `xs` quantized with `p`, in chunks on the stack.
    fn fit_error(&self, xs: &[f32], p: GroupParams) -> (f64, FitSums) {
        if let Some(l) = self.linear(p) {
            return fit_error_linear(xs, &l, p);
        }
        let mut codes = [0u8; FIT_CHUNK];
        let mut decoded = [0f32; FIT_CHUNK];
        let mut levels = [0f32; FIT_CHUNK];
        let unit = GroupParams { scale: 1.0, offset: 0.0 };
        let (mut err, mut sums) = (0f64, FitSums::default());
        for x in xs.chunks(FIT_CHUNK) {
            let n = x.len();
            self.encode(x, p, &mut codes[..n]);
            self.decode(&codes[..n], p, &mut decoded[..n]);
            self.decode(&codes[..n], unit, &mut levels[..n]);
            for ((&v, &y), &l) in x.iter().zip(&decoded[..n]).zip(&levels[..n]) {
                let (v, l) = (f64::from(v), f64::from(l));
                err += (v - f64::from(y)).powi(2);
                sums.l += l;
                sums.ll += l * l;
                sums.x += v;
                sums.xl += v * l;
            }
            sums.n += n as f64;
        }
        (err, sums)
    }

    /// The least-squares parameters for the codes whose sums are `s`: `x ≈ scale · L(code) +
    /// offset` (affine) or `x ≈ scale · L(code)`, rounded to the storage type. `None` when the
    /// codes cannot determine them (one code for the whole group, a non-positive scale).
    fn refit(&self, s: &FitSums) -> Option<GroupParams> {
        let (scale, offset) = if matches!(self.math, Math::Affine { .. }) {
            let var = s.ll - s.l * s.l / s.n;
            let scale = (s.xl - s.x * s.l / s.n) / var;
            (scale, (s.x - scale * s.l) / s.n)
        } else {
            (s.xl / s.ll, 0.0)
        };
        if !(scale.is_finite() && offset.is_finite() && scale > 0.0) {
            return None;
        }
        let scale = round_param(scale as f32, self.dtype, Round::Up).ok()?;
        let offset =
            if offset == 0.0 { 0.0 } else { round_param(offset as f32, self.dtype, Round::Down).ok()? };
        (scale > 0.0).then_some(GroupParams { scale, offset })
    }

    /// Parameters for a group whose values span `[min, max]` (finite, `min <= max`), rounded
    /// to the storage type so that the whole range stays representable.
    ///
    /// # Errors
    /// [`QuantError::ParamOverflow`](crate::QuantError::ParamOverflow) when a parameter does not
    /// fit the storage type.
    #[inline]
    pub fn params(&self, min: f32, max: f32) -> Result<GroupParams> {
        let absmax = min.abs().max(max.abs());
        let (scale, offset) = match &self.math {
            Math::Affine { levels } => {
                let offset = round_param(min, self.dtype, Round::Down)?;
                let scale = round_param((max - offset) / levels, self.dtype, Round::Up)?;
                (scale, offset)
            }
            Math::Symmetric { qmax, .. } => (round_param(absmax / qmax, self.dtype, Round::Up)?, 0.0),
            Math::Fp8(f) => (round_param(absmax / f.max_value(), self.dtype, Round::Up)?, 0.0),
            Math::Codebook(_) => (round_param(absmax, self.dtype, Round::Up)?, 0.0),
        };
        Ok(GroupParams { scale, offset })
    }

    /// Encodes `x` with parameters `p` into `out` (same length). Values outside the range
    /// the parameters cover saturate to the extreme codes.
    #[inline]
    pub fn encode(&self, x: &[f32], p: GroupParams, out: &mut [u8]) {
        self.encode_with(&RowKernels::PORTABLE, x, p, out)
    }

    /// [`Codec::encode`] with the linear (affine and symmetric) encoding done by `kernels`;
    /// the codes are the same.
    #[inline]
    pub fn encode_with(&self, kernels: &RowKernels, x: &[f32], p: GroupParams, out: &mut [u8]) {
        if let Some(l) = self.linear(p) {
            return kernels.encode(x, &l, out);
        }
        let inv = inverse(p.scale);
        match &self.math {
            Math::Affine { .. } | Math::Symmetric { .. } => unreachable!("linear kinds handled above"),
            Math::Fp8(f) => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = f.encode(v * inv);
                }
            }
            Math::Codebook(cb) => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = cb.encode(v * inv);
                }
            }
        }
    }

    /// The encoding arithmetic of affine and symmetric kinds for parameters `p` (`None` for FP8
    /// and codebooks, which encode through a table).
    #[inline]
    pub fn linear(&self, p: GroupParams) -> Option<Linear> {
        let inv = inverse(p.scale);
        match &self.math {
            Math::Affine { levels } => Some(Linear { offset: p.offset, inv, lo: 0.0, hi: *levels, add: 0.0 }),
            // The zero point 2^(b-1) is even for b >= 2, so rounding after the shift rounds
            // ties exactly as rounding before it would.
            Math::Symmetric { qmax, zero } => {
                Some(Linear { offset: 0.0, inv, lo: -qmax, hi: *qmax, add: *zero })
            }
            Math::Fp8(_) | Math::Codebook(_) => None,
        }
    }

    /// Decodes `codes` with parameters `p` into `out` (same length).
    #[inline]
    pub fn decode(&self, codes: &[u8], p: GroupParams, out: &mut [f32]) {
        match &self.math {
            Math::Affine { .. } => {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = f32::from(c) * p.scale + p.offset;
                }
            }
            Math::Symmetric { zero, .. } => {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = (f32::from(c) - zero) * p.scale;
                }
            }
            Math::Fp8(f) => {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = f.decode(c) * p.scale;
                }
            }
            Math::Codebook(cb) => {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = cb.decode(c) * p.scale;
                }
            }
        }
    }

    /// Encodes `x` with one set of parameters per element (`params[i]` for `x[i]`), as
    /// per-channel groups need. Each element is encoded exactly as [`Codec::encode`] would.
    /// Encoding many rows with the same parameters is faster through [`ChannelParams`].
    pub fn encode_per_element(&self, x: &[f32], params: &[GroupParams], out: &mut [u8]) {
        self.encode_channels(x, &ChannelParams::new(params), out);
    }

    /// Encodes one row with per-channel parameters prepared once for many rows.
    pub fn encode_channels(&self, x: &[f32], channels: &ChannelParams, out: &mut [u8]) {
        if let Math::Affine { levels } = &self.math {
            let levels = *levels;
            let lanes = out.iter_mut().zip(x).zip(channels.offset.iter().zip(&channels.inv));
            for ((o, &v), (&off, &inv)) in lanes {
                *o = round_to_code(clamp((v - off) * inv, 0.0, levels) + 0.0);
            }
            return;
        }
        for ((o, v), p) in out.iter_mut().zip(x).zip(&channels.params) {
            self.encode(std::slice::from_ref(v), *p, std::slice::from_mut(o));
        }
    }

    /// Decodes `codes` with one set of parameters per element.
    pub fn decode_per_element(&self, codes: &[u8], params: &[GroupParams], out: &mut [f32]) {
        for ((o, c), p) in out.iter_mut().zip(codes).zip(params) {
            self.decode(std::slice::from_ref(c), *p, std::slice::from_mut(o));
        }
    }

    /// The codebook levels, for codebook kinds.
    pub fn codebook(&self) -> Option<&Codebook> {
        match &self.math {
            Math::Codebook(cb) => Some(cb),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Rng;

    fn sse(codec: &Codec, xs: &[f32], p: GroupParams) -> f64 {
        let mut codes = vec![0u8; xs.len()];
        let mut y = vec![0f32; xs.len()];
        codec.encode(xs, p, &mut codes);
        codec.decode(&codes, p, &mut y);
        xs.iter().zip(&y).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum()
    }

    fn min_max(xs: &[f32]) -> (f32, f32) {
        xs.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)))
    }

    /// Groups of several shapes: Gaussian, one outlier, skewed, two values, constant, tiny.
    fn groups() -> Vec<Vec<f32>> {
        let mut rng = Rng::new(7);
        let mut out = Vec::new();
        for n in [1usize, 2, 3, 16, 64, 300] {
            let gauss: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let mut outlier = gauss.clone();
            outlier[n / 2] = 40.0;
            let skewed: Vec<f32> = gauss.iter().map(|v| v.exp() - 0.3).collect();
            let two: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { -1.5 } else { 0.25 }).collect();
            out.extend([gauss, outlier, skewed, two, vec![0.7; n]]);
            out.push((0..n).map(|_| 1e-6 * rng.normal() as f32).collect());
        }
        out
    }

    fn specs() -> Vec<QuantSpec> {
        let mut out = Vec::new();
        for b in 1..=8 {
            out.push(format!("int{b}-token-mse"));
            out.push(format!("int{b}-token-mse-f32"));
        }
        for b in 2..=8 {
            out.push(format!("sym{b}-token-mse"));
        }
        out.extend(["fp8e4m3-token-mse", "fp8e5m2-token-mse", "nf4-token-mse"].map(String::from));
        out.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn error_minimizing_ranges_are_never_worse_than_min_max() {
        for spec in specs() {
            let codec = Codec::new(&spec, None);
            for xs in groups() {
                let (lo, hi) = min_max(&xs);
                let plain = codec.params(lo, hi).unwrap();
                let fitted = codec.group_params(&xs, lo, hi).unwrap();
                let (a, b) = (sse(&codec, &xs, plain), sse(&codec, &xs, fitted));
                assert!(b <= a, "{spec}, {} values: {b} > {a}", xs.len());
                assert!(fitted.scale.is_finite() && fitted.offset.is_finite() && fitted.scale >= 0.0);
                // Representable in the storage type, as every stored parameter must be.
                if spec.param_dtype() == ParamDtype::F16 {
                    for v in [fitted.scale, fitted.offset] {
                        assert_eq!(half::f16::from_f32(v).to_f32(), v, "{spec}");
                    }
                }
                assert_eq!(fitted, codec.group_params(&xs, lo, hi).unwrap(), "deterministic");
            }
        }
    }

    #[test]
    fn error_minimizing_ranges_clip_gaussian_tails_at_low_bits() {
        // A uniform 2-bit grid fitted to a Gaussian spans about ±2σ, while the min/max of 4096
        // samples spans about ±3.5σ: clipping should lower the error by a wide margin, and the
        // fitted range should cover less than the data's.
        let mut rng = Rng::new(11);
        let xs: Vec<f32> = (0..4096).map(|_| rng.normal() as f32).collect();
        let (lo, hi) = min_max(&xs);
        for (spec, gain) in [("int2-token-mse", 0.6), ("sym3-token-mse", 0.8), ("int4-token-mse", 0.8)] {
            let spec: QuantSpec = spec.parse().unwrap();
            let codec = Codec::new(&spec, None);
            let plain = codec.params(lo, hi).unwrap();
            let fitted = codec.group_params(&xs, lo, hi).unwrap();
            let (a, b) = (sse(&codec, &xs, plain), sse(&codec, &xs, fitted));
            assert!(b < gain * a, "{spec}: {b} vs {a}");
            assert!(fitted.scale < plain.scale, "{spec}: the range shrinks");
        }
        // Min/max specs are untouched by the search.
        let spec: QuantSpec = "int2-token".parse().unwrap();
        let codec = Codec::new(&spec, None);
        assert_eq!(codec.group_params(&xs, lo, hi).unwrap(), codec.params(lo, hi).unwrap());
    }
}
