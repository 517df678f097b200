//! GGML weights repacked for SIMD: eight rows interleaved per block of 32 values, so that one
//! 8-lane integer dot (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`) advances eight rows' sums at
//! once against a broadcast group of four activation codes, with no sum across lanes.
//!
//! [`PackedWeights::new`] takes rows as a GGUF stores them and lays out, for each group of
//! eight rows and each block of 32: the parameters, then the codes in 32-byte runs, run `q`
//! holding bytes `4q..4q + 4` of every row's codes, row after row. For 4-bit codes the low
//! nibbles of run `q` are values `4q..4q + 4` of the eight rows and the high nibbles values
//! `16 + 4q..`; for byte codes run `q` is values `4q..4q + 4`. The parameters:
//! - Q4_0, Q4_1, Q8_0: the eight f16 scales, then (Q4_1) the eight f16 minimums; the bytes per
//!   block are the GGUF's, so the weights take no more memory.
//! - Q5_0, Q5_1: the same parameters, and the 5-bit codes a byte each (Q5_0's centred, `q -
//!   16`, signed): 8.5 and 9 bits per weight against the GGUF's 5.5 and 6.
//! - The K-quants, each super-block of 256 read exactly as eight blocks of 32
//!   (`crate::k_quants`): eight f32 scales, then eight f32 offsets (Q4_K, Q5_K: `-dmin * m`)
//!   or the scales of values 16..32 (Q6_K, whose scales cover 16 values). Q4_K keeps 4-bit
//!   codes (6 bits per weight against the GGUF's 4.5); Q5_K's 5-bit and Q6_K's 6-bit codes
//!   take a byte each (10 bits per weight against 5.5 and 6.56), so that every type runs the
//!   same 8-bit dot products.
//!
//! Rows past the last (to fill a group) are zeros.
//!
//! [`matmul_packed`] computes what [`crate::ggml::matmul_t`] computes for the types it takes
//! (the same integer sums, the float accumulation in another order): the scalar reference
//! unpacks a group's rows and runs the same arithmetic as `ggml::scalar_matmul_t`; the AVX2
//! and AVX-512 VNNI kernels, and on aarch64 the NEON kernels (`sdot` with the dot-product
//! extension, widening products without), take eight weight rows by up to four activation rows
//! per tile.

use std::ops::Range;

use half::f16;

use crate::block::KernelError;
use crate::dispatch::{Backend, Kernels};
use crate::ggml::{Activations, GgmlType, QK};
use crate::k_quants::{self, Block32};

/// Rows interleaved per group.
pub const GROUP: usize = 8;

/// Weight rows of one GGML type, repacked eight rows at a time (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedWeights {
    ty: GgmlType,
    rows: usize,
    k: usize,
    data: Vec<u8>,
}

/// Whether a block's parameters are f32 (the K-quants) rather than f16.
#[inline(always)]
fn f32_params(ty: GgmlType) -> bool {
    ty.is_k_quant()
}

/// Whether codes take a byte each (Q8_0, the 5-bit types, Q6_K) rather than a nibble.
#[inline(always)]
fn byte_codes(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K | GgmlType::Q6K)
}

/// Whether codes are signed bytes (Q8_0, Q5_0's `q - 16`, Q6_K's `q - 32`); the others are
/// unsigned.
#[inline(always)]
fn signed_codes(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q6K)
}

/// Whether a block of 32 has an f16 minimum beside its f16 scale (Q4_1, Q5_1).
#[inline(always)]
fn f16_minimum(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1)
}

/// A Q5_0 or Q5_1 block's codes in value order, a byte each (Q5_0's centred: `q - 16`): the
/// low four bits from the nibbles (values `j` and `16 + j` in byte `j`), the fifth from bit `i`
/// of the little-endian word before them.
fn five_bit_codes(ty: GgmlType, block: &[u8], out: &mut [u8; QK]) {
    let at = if ty == GgmlType::Q5_1 { 4 } else { 2 };
    let high = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    let nibbles = &block[at + 4..at + 4 + QK / 2];
    for (i, c) in out.iter_mut().enumerate() {
        let low = if i < QK / 2 { nibbles[i] & 0x0F } else { nibbles[i - QK / 2] >> 4 };
        let q = low | ((((high >> i) & 1) as u8) << 4);
        *c = if ty == GgmlType::Q5_0 { (q as i8 - 16) as u8 } else { q };
    }
}

/// Whether a block has two scales, for values 0..16 and 16..32 (Q6_K).
#[inline(always)]
fn two_scales(ty: GgmlType) -> bool {
    ty == GgmlType::Q6K
}

/// Bytes of one block of a group: the parameters, then the codes.
fn block_bytes(ty: GgmlType) -> usize {
    header_bytes(ty) + GROUP * code_bytes(ty)
}

/// Where the codes of a block begin.
fn header_bytes(ty: GgmlType) -> usize {
    match ty {
        _ if f16_minimum(ty) => 32,
        _ if f32_params(ty) => 64,
        _ => 16,
    }
}

/// Bytes of one row's codes in a block of 32.
fn code_bytes(ty: GgmlType) -> usize {
    if byte_codes(ty) { QK } else { QK / 2 }
}

/// Writes one row's codes of a block (`cb` bytes as a GGUF block of 32 holds them) into the
/// block's runs, as row `i` of its group.
fn put_codes(dst: &mut [u8], hb: usize, i: usize, codes: &[u8]) {
    for (q, four) in codes.chunks_exact(4).enumerate() {
        let at = hb + q * 4 * GROUP + 4 * i;
        dst[at..at + 4].copy_from_slice(four);
    }
}

impl PackedWeights {
    /// Repacks `rows` rows of `k` values of type `ty`, as a GGUF stores them.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `k` is not a positive multiple of the type's block
    /// ([`GgmlType::block_values`]: 32, or 256 for the K-quants) or `weights` is not `rows`
    /// such rows, or a scale or minimum is not finite (it would make every product with its
    /// row NaN).
    pub fn new(ty: GgmlType, weights: &[u8], rows: usize, k: usize) -> Result<Self, KernelError> {
        let row_bytes = ty.row_bytes(k);
        if k == 0
            || !k.is_multiple_of(ty.block_values())
            || rows.checked_mul(row_bytes) != Some(weights.len())
        {
            return Err(KernelError::Shape(format!(
                "{} bytes for {rows} rows of {k} values of {ty:?}",
                weights.len()
            )));
        }
        let (blocks, groups) = (k / QK, rows.div_ceil(GROUP));
        let (bb, hb, cb) = (block_bytes(ty), header_bytes(ty), code_bytes(ty));
        let mut data = vec![0u8; groups * blocks * bb];
        let mut sub = [Block32::default(); k_quants::BLOCKS];
        let mut nibbles = [0u8; QK / 2];
        for (r, row) in weights.chunks_exact(row_bytes).enumerate() {
            let (g, i) = (r / GROUP, r % GROUP);
            for (b, src) in row.chunks_exact(ty.block_bytes()).enumerate() {
                if !ty.is_k_quant() {
                    let params = if f16_minimum(ty) { 2 } else { 1 };
                    if src[..2 * params]
                        .chunks_exact(2)
                        .any(|h| !f16::from_le_bytes([h[0], h[1]]).is_finite())
                    {
                        return Err(KernelError::Shape(format!(
                            "row {r}, values {}..: a {ty:?} scale is not finite",
                            b * QK
                        )));
                    }
                    let dst = &mut data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
                    dst[2 * i..2 * i + 2].copy_from_slice(&src[..2]);
                    if f16_minimum(ty) {
                        dst[16 + 2 * i..16 + 2 * i + 2].copy_from_slice(&src[2..4]);
                    }
                    if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
                        let mut codes = [0u8; QK];
                        five_bit_codes(ty, src, &mut codes);
                        put_codes(dst, hb, i, &codes);
                    } else {
                        put_codes(dst, hb, i, &src[ty.block_bytes() - cb..]);
                    }
                    continue;
                }
                k_quants::decode(ty, src, &mut sub);
                for (j, block) in sub.iter().enumerate() {
                    if !block.params.iter().all(|p| p.is_finite()) {
                        return Err(KernelError::Shape(format!(
                            "row {r}, values {}..: a {ty:?} scale is not finite",
                            (b * k_quants::BLOCKS + j) * QK
                        )));
                    }
                    let at = (g * blocks + b * k_quants::BLOCKS + j) * bb;
                    let dst = &mut data[at..at + bb];
                    dst[4 * i..4 * i + 4].copy_from_slice(&block.params[0].to_le_bytes());
                    dst[32 + 4 * i..32 + 4 * i + 4].copy_from_slice(&block.params[1].to_le_bytes());
                    if byte_codes(ty) {
                        put_codes(dst, hb, i, &block.codes);
                    } else {
                        for (l, n) in nibbles.iter_mut().enumerate() {
                            *n = block.codes[l] | (block.codes[l + QK / 2] << 4);
                        }
                        put_codes(dst, hb, i, &nibbles);
                    }
                }
            }
        }
        Ok(Self { ty, rows, k, data })
    }

    /// The weight type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Groups of [`GROUP`] rows (the last one may be partial).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Row `i` of group `g` as codes, a byte each in value order (4-bit: 0..16; Q5_1 and Q5_K:
    /// 0..32; Q8_0, Q5_0 and Q6_K: the signed byte), with each block's parameters (`d`: the
    /// scale; `m`: the minimum or offset, or Q6_K's second scale; 0 for Q4_0, Q8_0 and Q5_0):
    /// the inverse of the packing.
    fn unpack_row(&self, g: usize, i: usize, codes: &mut [u8], d: &mut [f32], m: &mut [f32]) {
        let (ty, blocks) = (self.ty, self.k / QK);
        let (bb, hb, cb) = (block_bytes(ty), header_bytes(ty), code_bytes(ty));
        for b in 0..blocks {
            let src = &self.data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
            let f32_at = |at: usize| f32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]);
            let f16_at = |at: usize| f16::from_le_bytes([src[at], src[at + 1]]).to_f32();
            (d[b], m[b]) = match ty {
                _ if f32_params(ty) => (f32_at(4 * i), f32_at(32 + 4 * i)),
                _ if f16_minimum(ty) => (f16_at(2 * i), f16_at(16 + 2 * i)),
                _ => (f16_at(2 * i), 0.0),
            };
            let out = &mut codes[b * QK..(b + 1) * QK];
            for q in 0..cb / 4 {
                for j in 0..4 {
                    let byte = src[hb + q * 4 * GROUP + 4 * i + j];
                    if byte_codes(ty) {
                        out[4 * q + j] = byte;
                    } else {
                        out[4 * q + j] = byte & 0x0F;
                        out[QK / 2 + 4 * q + j] = byte >> 4;
                    }
                }
            }
        }
    }
}

/// The code that [`matmul_packed`] runs for `backend`: on x86-64 as
/// [`crate::ggml::implementation`] (AVX-512 VNNI, AVX2, else the scalar reference); on aarch64
/// the NEON kernel with `sdot` for the dotprod backend where the CPU has it, the NEON kernel
/// with widening products for the `wide` backend (and dotprod on a CPU without it).
pub fn implementation(backend: Kernels) -> Backend {
    #[cfg(target_arch = "aarch64")]
    match backend.backend() {
        Backend::Dotprod if backend.cpu().dotprod => return Backend::Dotprod,
        Backend::Wide | Backend::Dotprod => return Backend::Wide,
        _ => {}
    }
    crate::ggml::implementation(backend)
}

/// `out[r * n + t]` = weight row `r` · activation row `t` for the rows of the groups `groups`
/// of `w` (`r` counted from the first of them) and the `n = act.rows()` activation rows.
///
/// # Errors
/// [`KernelError::Shape`] when the activations' row length is not the weights', the groups
/// are out of range, or `out` is not the rows of those groups times `n` long.
pub fn matmul_packed(
    backend: Kernels,
    w: &PackedWeights,
    groups: Range<usize>,
    act: &Activations,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if act.k() != w.k || groups.start > groups.end || groups.end > w.groups() {
        return Err(KernelError::Shape(format!(
            "activations of {} values against rows of {}, groups {groups:?} of {}",
            act.k(),
            w.k,
            w.groups()
        )));
    }
    let rows = (groups.end * GROUP).min(w.rows).saturating_sub(groups.start * GROUP);
    if out.len() != rows * act.rows() {
        return Err(KernelError::Shape(format!("out has {} values, not {rows} × {}", out.len(), act.rows())));
    }
    match implementation(backend) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `implementation` returns Avx2 only where AVX2, FMA and F16C are available.
        Backend::Avx2 => unsafe { x86::matmul_avx2(w, groups, act, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `implementation` returns Avx512 only where AVX-512 (F, BW, VL), VNNI, AVX2,
        // FMA and F16C are available.
        Backend::Avx512 => unsafe { x86::matmul_vnni(w, groups, act, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU.
        Backend::Wide => unsafe { arm::matmul_neon(w, groups, act, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: `implementation` returns Dotprod only where the CPU has the extension.
        Backend::Dotprod => unsafe { arm::matmul_dotprod(w, groups, act, out) },
        _ => scalar_matmul_packed(w, groups, act, out),
    }
    Ok(())
}

/// The reference: each row of the groups unpacked, then `ggml::scalar_matmul_t`'s arithmetic,
/// block after block in order (for Q6_K, each half block's dot scaled by its own scale).
pub fn scalar_matmul_packed(w: &PackedWeights, groups: Range<usize>, act: &Activations, out: &mut [f32]) {
    let (k, n) = (w.k, act.rows());
    let blocks = k / QK;
    let mut codes = vec![0u8; k];
    let (mut d, mut m) = (vec![0f32; blocks], vec![0f32; blocks]);
    let first = groups.start * GROUP;
    for r in first..(groups.end * GROUP).min(w.rows) {
        w.unpack_row(r / GROUP, r % GROUP, &mut codes, &mut d, &mut m);
        for t in 0..n {
            let mut acc = 0f32;
            for b in 0..blocks {
                let block = &codes[b * QK..(b + 1) * QK];
                if two_scales(w.ty) {
                    let (a, da) = act.block_codes(t, b);
                    let half = QK / 2;
                    let dot = |h: usize| {
                        crate::ggml::block_dot(w.ty, &block[h * half..], &a[h * half..(h + 1) * half])
                    };
                    acc += d[b] * da * dot(0) as f32 + m[b] * da * dot(1) as f32;
                } else {
                    let (dot, sum, da) = act.block_dot(w.ty, t, b, block);
                    acc += crate::ggml::block_value(w.ty, dot, sum, d[b], m[b], da);
                }
            }
            out[(r - first) * n + t] = acc;
        }
    }
}

/// The SIMD kernels' walk over tiles of a group's eight rows by up to four activation rows:
/// `tile(g, t, tn)` gives `[activation row t + j][weight row i]` for `j < tn`, written into
/// `out` for the group's live rows.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn tiles(
    w: &PackedWeights,
    groups: Range<usize>,
    act: &Activations,
    out: &mut [f32],
    mut tile: impl FnMut(usize, usize, usize) -> [[f32; 8]; 4],
) {
    let n = act.rows();
    let first = groups.start * GROUP;
    for g in groups {
        let live = (w.rows - g * GROUP).min(GROUP);
        for t in (0..n).step_by(4) {
            let tn = (n - t).min(4);
            let acc = tile(g, t, tn);
            for (j, rows) in acc.iter().enumerate().take(tn) {
                for (i, &v) in rows.iter().enumerate().take(live) {
                    out[(g * GROUP + i - first) * n + t + j] = v;
                }
            }
        }
    }
}

/// The activation codes at `at..at + 4` of a block, as one little-endian word (broadcast to
/// every lane, one word per weight row).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn four_codes(a: &[i8], at: usize) -> i32 {
    i32::from_le_bytes([a[at] as u8, a[at + 1] as u8, a[at + 2] as u8, a[at + 3] as u8])
}

/// Where run `q` of a block's codes meets the activation's values: values `4q..` for byte
/// codes; for 4-bit codes, runs 0..4 are the low nibbles (values `4q..`) and runs 4..8 the high
/// ones (values `16 + 4(q − 4)..`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn run_start(ty: GgmlType, q: usize) -> usize {
    if byte_codes(ty) || q < 4 { 4 * q } else { 16 + 4 * (q - 4) }
}

/// A kernel's entry for one instruction set: [`tiles`] over its tile function `$tile`, whose
/// const parameters are the number of activation rows (1 to 4) a tile takes and whether a
/// block has two scales (Q6_K; a parameter so that the other types' loops carry no test).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! tiled_matmul {
    ($matmul:ident, $tile:ident, $features:literal) => {
        /// [`super::scalar_matmul_packed`] with this module's tiles.
        ///
        /// # Safety
        /// The CPU must have the function's target features; the arguments must pass
        /// [`super::matmul_packed`]'s checks.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $matmul(
            w: &PackedWeights,
            groups: Range<usize>,
            act: &Activations,
            out: &mut [f32],
        ) {
            super::tiles(w, groups, act, out, |g, t, tn| {
                // SAFETY: the same contract, passed on; `t + tn <= act.rows()`.
                unsafe {
                    match (tn, super::two_scales(w.ty)) {
                        (1, false) => $tile::<1, false>(w, g, act, t),
                        (2, false) => $tile::<2, false>(w, g, act, t),
                        (3, false) => $tile::<3, false>(w, g, act, t),
                        (_, false) => $tile::<4, false>(w, g, act, t),
                        (1, true) => $tile::<1, true>(w, g, act, t),
                        (2, true) => $tile::<2, true>(w, g, act, t),
                        (3, true) => $tile::<3, true>(w, g, act, t),
                        (_, true) => $tile::<4, true>(w, g, act, t),
                    }
                }
            });
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{PackedWeights, block_bytes, byte_codes, f32_params, header_bytes, signed_codes};
    use crate::ggml::{Activations, GgmlType, QK};

    /// Eight rows' dots of Q4 codes: `vpmaddubsw` + `vpmaddwd` (15 · 127 · 2 cannot saturate).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)))
    }

    /// [`dot_avx2`] in one `vpdpbusd`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni,avx512vl,avx2")]
    fn dot_vnni(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, w, a)
    }

    /// The kernel for one instruction set: tiles of a group's eight rows by up to four
    /// activation rows; per block, the eight code registers are unpacked once and dotted with
    /// each activation row's broadcast groups of four codes.
    macro_rules! kernel {
        ($matmul:ident, $tile:ident, $features:literal, $dot:ident) => {
            tiled_matmul!($matmul, $tile, $features);

            /// Group `g` against activation rows `t0..t0 + TN`: `[row t][weight row i]`.
            ///
            /// # Safety
            /// As the kernel, `t0` a multiple of 4, `t0 + TN <= act.rows()`, `TWO` the
            /// type's [`super::two_scales`].
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tile<const TN: usize, const TWO: bool>(
                w: &PackedWeights,
                g: usize,
                act: &Activations,
                t0: usize,
            ) -> [[f32; 8]; 4] {
                let ty = w.ty;
                let blocks = w.k / QK;
                let (bb, hb) = (block_bytes(ty), header_bytes(ty));
                let (bytes, signed, halves) = (byte_codes(ty), signed_codes(ty), TWO);
                let offset = !signed;
                let padded = act.rows().next_multiple_of(4);
                let (codes, scales, scaled_sums) = act.parts();
                let low = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); TN];
                let mut wr = [_mm256_setzero_si256(); 8];
                for b in 0..blocks {
                    let blk = &w.data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
                    // SAFETY: a packed block holds its parameters (`hb` bytes: eight f16 scales,
                    // Q4_1's eight f16 minimums, or two runs of eight f32), then 128 (4-bit) or
                    // 256 (byte) code bytes.
                    let (dw, c, dw2) = unsafe {
                        let p = blk.as_ptr();
                        let (dw, c, dw2) = if f32_params(ty) {
                            let (first, second) =
                                (_mm256_loadu_ps(p.cast()), _mm256_loadu_ps(p.add(32).cast()));
                            if halves { (first, _mm256_setzero_ps(), second) } else { (first, second, first) }
                        } else {
                            let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
                            let c = match ty {
                                GgmlType::Q4_0 => _mm256_mul_ps(dw, _mm256_set1_ps(-8.0)),
                                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()))
                                }
                                _ => _mm256_setzero_ps(),
                            };
                            (dw, c, dw)
                        };
                        if bytes {
                            for (q, r) in wr.iter_mut().enumerate() {
                                *r = _mm256_loadu_si256(p.add(hb + 32 * q).cast());
                            }
                        } else {
                            for q in 0..4 {
                                let x = _mm256_loadu_si256(p.add(hb + 32 * q).cast());
                                wr[q] = _mm256_and_si256(x, low);
                                wr[q + 4] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
                            }
                        }
                        (dw, c, dw2)
                    };
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let ab = (t0 + j) * blocks + b;
                        let a = &codes[ab * QK..(ab + 1) * QK];
                        let at = b * padded + t0 + j;
                        let da = _mm256_set1_ps(scales[at]);
                        let mut dot = _mm256_setzero_si256();
                        for (q, &wq) in wr.iter().enumerate() {
                            let av = _mm256_set1_epi32(super::four_codes(a, super::run_start(ty, q)));
                            dot = if signed {
                                // Signed codes: |w| against a with w's sign.
                                $dot(dot, _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(av, wq))
                            } else {
                                $dot(dot, wq, av)
                            };
                            if halves && q == 3 {
                                // Q6_K: values 0..16 have a scale of their own.
                                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, da), *acc);
                                dot = _mm256_setzero_si256();
                            }
                        }
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw2, da), *acc);
                        if offset {
                            *acc = _mm256_fmadd_ps(c, _mm256_set1_ps(scaled_sums[at]), *acc);
                        }
                    }
                }
                let mut out = [[0f32; 8]; 4];
                for (o, a) in out.iter_mut().zip(&acc) {
                    // SAFETY: each row holds eight f32.
                    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
                }
                out
            }
        };
    }

    kernel!(matmul_avx2, tile_avx2, "avx2,fma,f16c", dot_avx2);
    kernel!(matmul_vnni, tile_vnni, "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c", dot_vnni);
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;
    use std::arch::asm;
    use std::ops::Range;

    use super::{PackedWeights, block_bytes, byte_codes, f32_params, header_bytes, signed_codes};
    use crate::ggml::{Activations, GgmlType, QK};

    /// Eight f16 values at `p` as two vectors of f32 (`fcvtl`, `fcvtl2`: base NEON; the
    /// intrinsics' f16 vector type is not stable in Rust).
    ///
    /// # Safety
    /// `p` must point at 16 readable bytes.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn halves(p: *const u8) -> [float32x4_t; 2] {
        let (lo, hi): (float32x4_t, float32x4_t);
        // SAFETY: 16 bytes at `p` (the caller's contract); the conversions read one register
        // and write two others (`out`, so never the input's), touching no memory.
        unsafe {
            let h = vld1q_u16(p.cast());
            asm!(
                "fcvtl {lo:v}.4s, {h:v}.4h",
                "fcvtl2 {hi:v}.4s, {h:v}.8h",
                h = in(vreg) h,
                lo = out(vreg) lo,
                hi = out(vreg) hi,
                options(pure, nomem, nostack)
            );
        }
        [lo, hi]
    }

    /// Four rows' dots of four signed bytes each without the dot-product extension: widening
    /// products (at most 128 · 127 in magnitude, inside i16), then pairwise sums.
    #[inline]
    #[target_feature(enable = "neon")]
    fn dot_neon(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        let lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
        let hi = vpaddlq_s16(vmull_high_s8(w, a));
        vaddq_s32(acc, vpaddq_s32(lo, hi))
    }

    /// [`dot_neon`] in one `sdot`.
    #[inline]
    #[target_feature(enable = "neon,dotprod")]
    fn dot_sdot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: this function's target features include dotprod.
        unsafe { crate::dotprod::sdot(acc, w, a) }
    }

    /// The kernel for one instruction set: as the x86 one, with each 32-byte run of a block
    /// (four code bytes of each of eight rows) in two registers of four rows.
    macro_rules! kernel {
        ($matmul:ident, $tile:ident, $features:literal, $dot:ident) => {
            tiled_matmul!($matmul, $tile, $features);

            /// Group `g` against activation rows `t0..t0 + TN`: `[row t][weight row i]`.
            ///
            /// # Safety
            /// As the kernel, `t0 + TN <= act.rows()`, `TWO` the type's [`super::two_scales`].
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tile<const TN: usize, const TWO: bool>(
                w: &PackedWeights,
                g: usize,
                act: &Activations,
                t0: usize,
            ) -> [[f32; 8]; 4] {
                let ty = w.ty;
                let blocks = w.k / QK;
                let (bb, hb) = (block_bytes(ty), header_bytes(ty));
                let (bytes, two, offset) = (byte_codes(ty), TWO, !signed_codes(ty));
                let padded = act.rows().next_multiple_of(4);
                let (codes, scales, scaled_sums) = act.parts();
                let low = vdupq_n_u8(0x0F);
                let zero = vdupq_n_f32(0.0);
                let mut acc = [[zero; 2]; TN];
                let mut wr = [[vdupq_n_s8(0); 2]; 8];
                for b in 0..blocks {
                    let blk = &w.data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
                    // SAFETY: a packed block holds its parameters (`hb` bytes: eight f16 scales,
                    // Q4_1's eight f16 minimums, or two runs of eight f32), then 128 (4-bit) or
                    // 256 (byte) code bytes.
                    let (dw, c, dw2) = unsafe {
                        let p = blk.as_ptr();
                        let (dw, c, dw2) = if f32_params(ty) {
                            let f =
                                |at: usize| [vld1q_f32(p.add(at).cast()), vld1q_f32(p.add(at + 16).cast())];
                            let (first, second) = (f(0), f(32));
                            if two { (first, [zero; 2], second) } else { (first, second, first) }
                        } else {
                            let dw = halves(p);
                            let c = match ty {
                                GgmlType::Q4_0 => [vmulq_n_f32(dw[0], -8.0), vmulq_n_f32(dw[1], -8.0)],
                                GgmlType::Q4_1 | GgmlType::Q5_1 => halves(p.add(16)),
                                _ => [zero; 2],
                            };
                            (dw, c, dw)
                        };
                        if bytes {
                            for (q, r) in wr.iter_mut().enumerate() {
                                *r = [
                                    vld1q_s8(p.add(hb + 32 * q).cast()),
                                    vld1q_s8(p.add(hb + 32 * q + 16).cast()),
                                ];
                            }
                        } else {
                            for q in 0..4 {
                                for h in 0..2 {
                                    let x = vld1q_u8(p.add(hb + 32 * q + 16 * h));
                                    wr[q][h] = vreinterpretq_s8_u8(vandq_u8(x, low));
                                    wr[q + 4][h] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(x));
                                }
                            }
                        }
                        (dw, c, dw2)
                    };
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let ab = (t0 + j) * blocks + b;
                        let a = &codes[ab * QK..(ab + 1) * QK];
                        let at = b * padded + t0 + j;
                        let da = scales[at];
                        let (mut d0, mut d1) = (vdupq_n_s32(0), vdupq_n_s32(0));
                        for (q, wq) in wr.iter().enumerate() {
                            let av = vreinterpretq_s8_s32(vdupq_n_s32(super::four_codes(
                                a,
                                super::run_start(ty, q),
                            )));
                            d0 = $dot(d0, wq[0], av);
                            d1 = $dot(d1, wq[1], av);
                            if two && q == 3 {
                                // Q6_K: values 0..16 have a scale of their own.
                                acc[0] = vfmaq_f32(acc[0], vcvtq_f32_s32(d0), vmulq_n_f32(dw[0], da));
                                acc[1] = vfmaq_f32(acc[1], vcvtq_f32_s32(d1), vmulq_n_f32(dw[1], da));
                                (d0, d1) = (vdupq_n_s32(0), vdupq_n_s32(0));
                            }
                        }
                        acc[0] = vfmaq_f32(acc[0], vcvtq_f32_s32(d0), vmulq_n_f32(dw2[0], da));
                        acc[1] = vfmaq_f32(acc[1], vcvtq_f32_s32(d1), vmulq_n_f32(dw2[1], da));
                        if offset {
                            let s = vdupq_n_f32(scaled_sums[at]);
                            acc[0] = vfmaq_f32(acc[0], c[0], s);
                            acc[1] = vfmaq_f32(acc[1], c[1], s);
                        }
                    }
                }
                let mut out = [[0f32; 8]; 4];
                for (o, a) in out.iter_mut().zip(&acc) {
                    // SAFETY: each row holds eight f32.
                    unsafe {
                        vst1q_f32(o.as_mut_ptr(), a[0]);
                        vst1q_f32(o.as_mut_ptr().add(4), a[1]);
                    }
                }
                out
            }
        };
    }

    kernel!(matmul_neon, tile_neon, "neon", dot_neon);
    kernel!(matmul_dotprod, tile_dotprod, "neon,dotprod", dot_sdot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::tests::{activations, weights};
    use crate::ggml::{matmul_t, scalar_matmul_t};

    #[test]
    fn packing_keeps_every_row_and_the_reference_equals_the_unpacked_one() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, k, n) in [(1, 32, 1), (8, 64, 3), (13, 96, 5), (17, 576, 4), (24, 128, 9)] {
                let raw = weights(ty, rows, k, (rows * 31 + k) as u64, false);
                let w = PackedWeights::new(ty, &raw, rows, k).unwrap();
                assert_eq!(w.bytes(), rows.div_ceil(GROUP) * (k / QK) * block_bytes(ty));
                let mut act = Activations::new();
                act.quantize(&activations(n, k, 5), k).unwrap();
                let mut want = vec![0f32; rows * n];
                scalar_matmul_t(ty, &raw, &act, &mut want);
                let mut got = vec![f32::NAN; rows * n];
                scalar_matmul_packed(&w, 0..w.groups(), &act, &mut got);
                // The same rows, the same arithmetic in the same order: the same bits.
                assert_eq!(got, want, "{ty:?} {rows}x{k}");
            }
        }
    }

    #[test]
    fn every_backend_matches_the_reference_on_every_group_range() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, k, n) in
                [(1, 32, 1), (8, 64, 4), (13, 96, 5), (17, 576, 7), (30, 1536, 2), (9, 4096, 1)]
            {
                for extreme in [false, true] {
                    let raw = weights(ty, rows, k, (rows * 7 + n) as u64, extreme);
                    let w = PackedWeights::new(ty, &raw, rows, k).unwrap();
                    let mut act = Activations::new();
                    act.quantize(&activations(n, k, k as u64), k).unwrap();
                    let mut want = vec![0f32; rows * n];
                    scalar_matmul_t(ty, &raw, &act, &mut want);
                    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                    for backend in crate::dispatch::available() {
                        let groups = w.groups();
                        for range in [0..groups, 0..groups.div_ceil(2), groups / 2..groups] {
                            let first = range.start * GROUP;
                            let end = (range.end * GROUP).min(rows);
                            let mut got = vec![f32::NAN; (end - first) * n];
                            matmul_packed(backend, &w, range.clone(), &act, &mut got).unwrap();
                            for (i, (&g, &e)) in got.iter().zip(&want[first * n..end * n]).enumerate() {
                                assert!(
                                    (g - e).abs() <= 1e-5 * scale,
                                    "{ty:?} {backend} {rows}x{k} n {n} groups {range:?} [{i}]: {g} vs {e}"
                                );
                            }
                        }
                        // And the unpacked kernels agree.
                        let mut raw_out = vec![f32::NAN; rows * n];
                        matmul_t(backend, ty, &raw, &act, &mut raw_out).unwrap();
                        for (&g, &e) in raw_out.iter().zip(&want) {
                            assert!((g - e).abs() <= 1e-5 * scale);
                        }
                    }
                }
            }
        }
    }

    /// The types multiplied only repacked: the 5-bit blocks of 32 and the K-quants.
    const REPACKED_ONLY: [GgmlType; 5] =
        [GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

    /// `rows` rows of `k` values of such a type, and the same weights dequantized by ggml's
    /// loops (written separately from the packing).
    fn rows_and_values(ty: GgmlType, rows: usize, k: usize, seed: u64, extreme: bool) -> (Vec<u8>, Vec<f64>) {
        let raw = if ty.is_k_quant() {
            crate::k_quants::tests::superblocks(ty, rows * k / 256, seed, extreme)
        } else {
            weights(ty, rows, k, seed, extreme)
        };
        let values = raw
            .chunks_exact(ty.block_bytes())
            .flat_map(|b| {
                if ty.is_k_quant() {
                    crate::k_quants::tests::dequantize(ty, b)
                } else {
                    crate::ggml::tests::dequantize_q5(ty, b)
                }
            })
            .collect();
        (raw, values)
    }

    #[test]
    fn repacked_only_types_keep_their_values_and_the_reference_is_their_product() {
        for ty in REPACKED_ONLY {
            for (rows, k, n) in [(1, 256, 1), (8, 512, 3), (13, 256, 5), (17, 1536, 4)] {
                for extreme in [false, true] {
                    let (raw, values) = rows_and_values(ty, rows, k, (rows * 31 + k + n) as u64, extreme);
                    let w = PackedWeights::new(ty, &raw, rows, k).unwrap();
                    // Bits per weight, times 2.
                    let per_weight = match ty {
                        GgmlType::Q4K => 12,
                        GgmlType::Q5_0 => 17,
                        GgmlType::Q5_1 => 18,
                        _ => 20,
                    };
                    assert_eq!(w.bytes(), rows.div_ceil(GROUP) * GROUP * k * per_weight / 16, "{ty:?}");
                    let x = activations(n, k, 5 + n as u64);
                    let mut act = Activations::new();
                    act.quantize(&x, k).unwrap();
                    let mut got = vec![f32::NAN; rows * n];
                    scalar_matmul_packed(&w, 0..w.groups(), &act, &mut got);
                    // Against the product of ggml's dequantized weights with the rounded
                    // activations, exact in f64: only f32's rounding apart.
                    let mut exact = vec![0f64; rows * n];
                    for (r, row) in values.chunks_exact(k).enumerate() {
                        for t in 0..n {
                            exact[r * n + t] = (0..k)
                                .map(|i| {
                                    let (a, da) = act.block_codes(t, i / QK);
                                    row[i] * f64::from(a[i % QK]) * f64::from(da)
                                })
                                .sum();
                        }
                    }
                    let norm = exact.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
                    let err =
                        got.iter().zip(&exact).map(|(&a, b)| (f64::from(a) - b).powi(2)).sum::<f64>().sqrt();
                    assert!(err / norm < 1e-5, "{ty:?} {rows}x{k} n {n} extreme {extreme}: {}", err / norm);
                    for backend in crate::dispatch::available() {
                        let groups = w.groups();
                        let scale = got.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                        for range in [0..groups, groups / 2..groups] {
                            let (first, end) = (range.start * GROUP, (range.end * GROUP).min(rows));
                            let mut simd = vec![f32::NAN; (end - first) * n];
                            matmul_packed(backend, &w, range.clone(), &act, &mut simd).unwrap();
                            for (i, (&g, &e)) in simd.iter().zip(&got[first * n..end * n]).enumerate() {
                                assert!(
                                    (g - e).abs() <= 1e-5 * scale,
                                    "{ty:?} {backend} {rows}x{k} n {n} groups {range:?} [{i}]: {g} vs {e}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn k_quants_need_whole_super_blocks_and_finite_scales() {
        let (raw, _) = rows_and_values(GgmlType::Q4K, 1, 256, 3, false);
        assert!(PackedWeights::new(GgmlType::Q4K, &raw, 1, 256).is_ok());
        assert!(PackedWeights::new(GgmlType::Q4K, &raw[..144], 2, 128).is_err());
        assert!(PackedWeights::new(GgmlType::Q4K, &raw[..143], 1, 256).is_err());
        for (ty, at) in [(GgmlType::Q4K, 0), (GgmlType::Q5K, 2), (GgmlType::Q6K, 208)] {
            let (mut raw, _) = rows_and_values(ty, 2, 256, 4, false);
            let bad = ty.block_bytes() + at;
            raw[bad..bad + 2].copy_from_slice(&f16::INFINITY.to_le_bytes());
            let e = PackedWeights::new(ty, &raw, 2, 256).unwrap_err();
            assert!(e.to_string().contains("row 1") && e.to_string().contains("not finite"), "{e}");
        }
        let mut q8 = weights(GgmlType::Q8_0, 1, 64, 1, false);
        q8[34..36].copy_from_slice(&f16::NAN.to_le_bytes());
        let e = PackedWeights::new(GgmlType::Q8_0, &q8, 1, 64).unwrap_err();
        assert!(e.to_string().contains("values 32.."), "{e}");
        // The unpacked product takes blocks of 32 only.
        let mut act = Activations::new();
        act.quantize(&[1.0; 256], 256).unwrap();
        assert!(crate::ggml::matmul_t(Kernels::SCALAR, GgmlType::Q4K, &raw, &act, &mut [0.0; 1]).is_err());
    }

    #[test]
    fn every_simd_backend_has_a_kernel_of_its_own() {
        // Only `wide` on x86-64 (SSE2) runs the reference; aarch64's NEON is a kernel.
        for backend in crate::dispatch::available() {
            let simd =
                backend != Backend::Scalar && (cfg!(target_arch = "aarch64") || backend != Backend::Wide);
            assert_eq!(implementation(backend) != Backend::Scalar, simd, "{backend}");
            let rounds = crate::ggml::quantize_implementation(backend) != Backend::Scalar;
            assert_eq!(rounds, simd, "{backend}: activation rounding");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(PackedWeights::new(GgmlType::Q4_1, &[0; 19], 1, 32).is_err());
        assert!(PackedWeights::new(GgmlType::Q4_1, &[0; 20], 1, 40).is_err());
        assert!(PackedWeights::new(GgmlType::Q4_1, &[0; 20], 2, 32).is_err());
        let w = PackedWeights::new(GgmlType::Q4_1, &[0; 40], 2, 32).unwrap();
        let mut act = Activations::new();
        act.quantize(&[1.0; 64], 32).unwrap();
        let backend = Kernels::SCALAR;
        assert!(matmul_packed(backend, &w, 0..2, &act, &mut [0.0; 4]).is_err());
        assert!(matmul_packed(backend, &w, 0..1, &act, &mut [0.0; 3]).is_err());
        let mut out = [f32::NAN; 4];
        matmul_packed(backend, &w, 0..1, &act, &mut out).unwrap();
        assert_eq!(out, [0.0; 4]);
        let mut act64 = Activations::new();
        act64.quantize(&[1.0; 64], 64).unwrap();
        assert!(matmul_packed(backend, &w, 0..1, &act64, &mut [0.0; 2]).is_err());
    }
}
