//! The inner loops of row quantization, as functions a faster backend can replace.
//!
//! Streaming caches quantize one row per token and KV head, so the range scan, the encoding
//! and the packing of a 128-value row decide the cost of an append. This crate holds no
//! architecture-specific code; [`RowKernels::PORTABLE`] uses `wide` (SSE2 on default x86-64
//! builds, NEON on aarch64). `kvq-kernels-simd` supplies AVX2 versions chosen at run time, and
//! a cache takes them through its configuration.
//!
//! **Contract:** every set of kernels returns exactly what the portable one returns, bit for
//! bit, for every input, so that codes never depend on the machine that wrote them. Tests in
//! `kvq-kernels-simd` hold each implementation to it.

use crate::error::Result;

/// The arithmetic of affine and symmetric encoding:
/// `code = round_ties_even(clamp((x − offset) · inv, lo, hi) + add)`, evaluated in f32 in
/// exactly this order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Linear {
    /// Subtracted first (the affine minimum; 0 for symmetric).
    pub offset: f32,
    /// The reciprocal of the step (0 for a constant group).
    pub inv: f32,
    /// Lower clamp before `add`.
    pub lo: f32,
    /// Upper clamp before `add`.
    pub hi: f32,
    /// Added after clamping (the symmetric zero point; 0 for affine).
    pub add: f32,
}

/// Range scan, linear encoding and packing of rows.
#[derive(Clone, Copy)]
pub struct RowKernels {
    name: &'static str,
    stats: fn(&[f32]) -> (f32, f32, bool),
    encode: fn(&[f32], &Linear, &mut [u8]),
    pack: fn(&[u8], u8, &mut [u8]),
    encode_pack: fn(&[f32], &Linear, u8, &mut [u8]) -> bool,
}

/// The portable kernels fuse nothing: [`RowKernels::encode_pack`] falls back to `encode` and
/// `pack` through a scratch row.
fn no_fused(_: &[f32], _: &Linear, _: u8, _: &mut [u8]) -> bool {
    false
}

impl std::fmt::Debug for RowKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RowKernels({})", self.name)
    }
}

/// Kernels are equal when their names are; by the contract above, any two give the same codes.
impl PartialEq for RowKernels {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Default for RowKernels {
    fn default() -> Self {
        Self::PORTABLE
    }
}

impl RowKernels {
    /// The `wide` implementations of this crate.
    pub const PORTABLE: Self = Self {
        name: "portable",
        stats: row_stats,
        encode: encode_linear,
        pack: crate::pack::pack_into,
        encode_pack: no_fused,
    };

    /// Kernels from three functions, which must keep the module's contract:
    /// - `stats(x)` returns `(min, max, finite)` as [`row_stats`] does (a
    ///   zero minimum or maximum as `+0.0`);
    /// - `encode(x, l, out)` writes `min(x.len(), out.len())` codes as [`Linear`] defines;
    /// - `pack(codes, bits, out)` is called with `bits` in `1..=8` and `out` exactly
    ///   [`packed_len`](crate::pack::packed_len) long, and packs as
    ///   [`pack_row`](crate::pack::pack_row) does.
    pub const fn new(
        name: &'static str,
        stats: fn(&[f32]) -> (f32, f32, bool),
        encode: fn(&[f32], &Linear, &mut [u8]),
        pack: fn(&[u8], u8, &mut [u8]),
    ) -> Self {
        Self { name, stats, encode, pack, encode_pack: no_fused }
    }

    /// Adds a fused encode-and-pack kernel: `encode_pack(x, l, bits, out)` either writes
    /// exactly what `encode` followed by `pack` would (codes above `bits` bits cannot occur
    /// when `l.hi + l.add < 2^bits`, which callers ensure) and returns `true`, or writes nothing
    /// and returns `false` for shapes it does not handle.
    pub const fn with_encode_pack(mut self, encode_pack: fn(&[f32], &Linear, u8, &mut [u8]) -> bool) -> Self {
        self.encode_pack = encode_pack;
        self
    }

    /// The implementation's name (`portable`, `avx2`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// `(min, max, all finite)` of `x`.
    #[inline]
    pub fn stats(&self, x: &[f32]) -> (f32, f32, bool) {
        (self.stats)(x)
    }

    /// Encodes `min(x.len(), out.len())` values.
    #[inline]
    pub fn encode(&self, x: &[f32], l: &Linear, out: &mut [u8]) {
        (self.encode)(x, l, out)
    }

    /// Encodes `x` and packs the codes into `out` in one pass, when the kernels have a fused
    /// path for this shape; returns `false` (and writes nothing) otherwise.
    ///
    /// # Errors
    /// As [`RowKernels::pack`], for a wrong `out` length or bits out of range.
    #[inline]
    pub fn encode_pack(&self, x: &[f32], l: &Linear, bits: u8, out: &mut [u8]) -> Result<bool> {
        crate::pack::check_pack(x.len(), bits, out.len())?;
        Ok((self.encode_pack)(x, l, bits, out))
    }

    /// Packs `codes` of `bits` bits into `out`.
    ///
    /// # Errors
    /// As [`pack_row`](crate::pack::pack_row): bits out of range or a wrong `out` length.
    #[inline]
    pub fn pack(&self, codes: &[u8], bits: u8, out: &mut [u8]) -> Result<()> {
        crate::pack::check_pack(codes.len(), bits, out.len())?;
        (self.pack)(codes, bits, out);
        Ok(())
    }
}

/// Adding 1.5 · 2^23 to an f32 in `[0, 2^22)` rounds it to an integer (ties to even) held in
/// the low mantissa bits: the sum's low byte *is* the rounded value. This converts to codes
/// with plain SSE2/NEON arithmetic, no libm call and no saturating float-to-int cast, so the
/// encoding loops vectorize.
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0;

/// `round(v)` as a byte, for `v` already clamped to `[0, 255]`.
#[inline(always)]
pub(crate) fn round_to_code(v: f32) -> u8 {
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
/// element gets the same code whatever its position. The portable kernel of [`RowKernels`].
pub(crate) fn encode_linear(x: &[f32], l: &Linear, out: &mut [u8]) {
    use wide::{f32x8, i16x8, u8x16};
    let n = x.len().min(out.len());
    let full = n / 16 * 16;
    let lanes = LinearLanes::new(l);
    let lane = |v: &[f32]| {
        let v = f32x8::from(<[f32; 8]>::try_from(v).expect("8 lanes"));
        // Rounded to an integral float in [0, 255], so truncation is exact.
        i16x8::from_i32x8_saturate(lanes.code(v).fast_trunc_int())
    };
    for (xs, os) in x[..full].chunks_exact(16).zip(out[..full].chunks_exact_mut(16)) {
        os.copy_from_slice(&u8x16::narrow_i16x8(lane(&xs[..8]), lane(&xs[8..])).to_array());
    }
    for (o, &v) in out[full..n].iter_mut().zip(&x[full..n]) {
        *o = round_to_code(clamp((v - l.offset) * l.inv, l.lo, l.hi) + l.add);
    }
}

/// [`Linear`] in eight lanes.
pub(crate) struct LinearLanes {
    offset: wide::f32x8,
    inv: wide::f32x8,
    lo: wide::f32x8,
    hi: wide::f32x8,
    pub(crate) add: wide::f32x8,
}

impl LinearLanes {
    pub(crate) fn new(l: &Linear) -> Self {
        use wide::f32x8;
        Self {
            offset: f32x8::splat(l.offset),
            inv: f32x8::splat(l.inv),
            lo: f32x8::splat(l.lo),
            hi: f32x8::splat(l.hi),
            add: f32x8::splat(l.add),
        }
    }

    /// The codes of `v` as integral floats: `round(clamp((v − offset) · inv, lo, hi) + add)`.
    #[inline(always)]
    pub(crate) fn code(&self, v: wide::f32x8) -> wide::f32x8 {
        let magic = wide::f32x8::splat(ROUND_MAGIC);
        let t = ((v - self.offset) * self.inv).fast_max(self.lo).fast_min(self.hi) + self.add;
        (t + magic) - magic
    }
}

/// Minimum, maximum and whether every value is finite, eight lanes at a time (`wide`, so
/// SSE2 or NEON with no target flags). Infinities show in the extremes; NaN is tracked by an
/// unordered self-compare, because min/max instructions drop it. An empty slice gives
/// `(+∞, −∞, true)`.
#[inline]
pub fn row_stats(xs: &[f32]) -> (f32, f32, bool) {
    use wide::f32x8;
    let mut lo = f32x8::splat(f32::INFINITY);
    let mut hi = f32x8::splat(f32::NEG_INFINITY);
    let mut nan = f32x8::splat(0.0);
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        let v = f32x8::from(<[f32; 8]>::try_from(c).expect("8 lanes"));
        lo = lo.fast_min(v);
        hi = hi.fast_max(v);
        nan |= v.is_nan();
    }
    let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut any_nan = nan.any();
    for (&l, &h) in lo.to_array().iter().zip(&hi.to_array()) {
        min = min.min(l);
        max = max.max(h);
    }
    for &v in chunks.remainder() {
        any_nan |= v.is_nan();
        min = min.min(v);
        max = max.max(v);
    }
    let finite = !any_nan && min.is_finite() && max.is_finite() || xs.is_empty();
    // `min`/`max` instructions pick either zero of a ±0 tie depending on operand order;
    // adding +0 turns −0 into +0 (and changes nothing else), so the result does not depend on
    // how a backend orders its reduction.
    (min + 0.0, max + 0.0, finite)
}
