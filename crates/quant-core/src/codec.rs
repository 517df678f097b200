//! The arithmetic of one group: parameters from a range, values to codes, codes to values.
//!
//! [`Codec`] is what every layout of the workspace shares: the offline tensor quantizer of
//! this crate, the streaming cache of `kvq-cache-layout` and the scalar references of the
//! kernels all encode and decode through it, so their codes agree bit for bit.

use crate::codebook::Codebook;
use crate::error::Result;
use crate::format::{CodebookSource, Kind, ParamDtype, QuantSpec};
use crate::fp8::Fp8Format;
use crate::params::{Round, round_param};
use crate::rowkernels::{Linear, RowKernels};

/// Adding 1.5 · 2^23 to an f32 in `[0, 2^22)` rounds it to an integer (ties to even) held in
/// the low mantissa bits: the sum's low byte *is* the rounded value. This converts to codes
/// with plain SSE2/NEON arithmetic, no libm call and no saturating float-to-int cast, so the
/// encoding loops vectorize.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `round(v)` as a byte, for `v` already clamped to `[0, 255]`.
#[inline(always)]
fn round_to_code(v: f32) -> u8 {
    ((v + ROUND_MAGIC).to_bits() & 0xff) as u8
}

/// Clamps to `[lo, hi]` with plain comparisons, which compile to max/min instructions. A NaN
/// (only `±Inf · 0` can make one from finite inputs) becomes `lo`, as x86's `maxps(v, lo)` does
/// in the vector path, so a lane's code never depends on its position in the row.
#[inline(always)]
pub(crate) fn clamp(v: f32, lo: f32, hi: f32) -> f32 {
    let v = if v > lo { v } else { lo };
    if v < hi { v } else { hi }
}

/// `code = round(clamp((x − offset) · inv, lo, hi) + add)` for every element: 16 at a time
/// with `wide` (SSE2/NEON), the rest one by one with exactly the same operations, so every
/// element gets the same code whatever its position. The portable kernel of
/// [`RowKernels`](crate::rowkernels::RowKernels).
pub(crate) fn encode_linear(x: &[f32], l: &Linear, out: &mut [u8]) {
    use wide::{f32x8, i16x8, u8x16};
    let n = x.len().min(out.len());
    let full = n / 16 * 16;
    let (off_v, inv_v, lo_v, hi_v, add_v, magic) = (
        f32x8::splat(l.offset),
        f32x8::splat(l.inv),
        f32x8::splat(l.lo),
        f32x8::splat(l.hi),
        f32x8::splat(l.add),
        f32x8::splat(ROUND_MAGIC),
    );
    let lane = |v: &[f32]| {
        let v = f32x8::from(<[f32; 8]>::try_from(v).expect("8 lanes"));
        let t = ((v - off_v) * inv_v).fast_max(lo_v).fast_min(hi_v) + add_v;
        // Rounded to an integral float in [0, 255], so truncation is exact.
        i16x8::from_i32x8_saturate(((t + magic) - magic).fast_trunc_int())
    };
    for (xs, os) in x[..full].chunks_exact(16).zip(out[..full].chunks_exact_mut(16)) {
        os.copy_from_slice(&u8x16::narrow_i16x8(lane(&xs[..8]), lane(&xs[8..])).to_array());
    }
    for (o, &v) in out[full..n].iter_mut().zip(&x[full..n]) {
        *o = round_to_code(clamp((v - l.offset) * l.inv, l.lo, l.hi) + l.add);
    }
}

/// `1 / scale`; a zero (or subnormal) scale means a constant group: every value maps to the
/// code of the offset, and the reciprocal is kept finite so that 0 · inv is never NaN.
#[inline(always)]
fn inverse(scale: f32) -> f32 {
    if scale > f32::MIN_POSITIVE { 1.0 / scale } else { 0.0 }
}

/// The parameters of one group: `x̂ = decode(code) · scale + offset`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GroupParams {
    /// Step (affine, symmetric) or multiplier (FP8, codebook).
    pub scale: f32,
    /// Affine minimum; 0 for the other kinds.
    pub offset: f32,
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
        Self { math, dtype: spec.param_dtype() }
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
