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
        stats: crate::quantize::row_stats,
        encode: crate::codec::encode_linear,
        pack: crate::pack::pack_into,
        encode_pack: no_fused,
    };

    /// Kernels from three functions, which must keep the module's contract:
    /// - `stats(x)` returns `(min, max, finite)` as [`row_stats`](crate::row_stats) does (a
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
