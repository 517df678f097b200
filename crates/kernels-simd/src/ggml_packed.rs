//! GGML weights repacked for SIMD: eight rows interleaved per block of 32 values, so that one
//! 8-lane integer dot (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`) advances eight rows' sums at
//! once against a broadcast group of four activation codes, with no sum across lanes.
//!
//! [`PackedWeights::new`] takes rows as a GGUF stores them (Q4_0, Q4_1, Q8_0) and lays out, for
//! each group of eight rows and each block: the eight f16 scales, the eight f16 minimums
//! (Q4_1), then the codes in 32-byte runs, run `q` holding bytes `4q..4q + 4` of every row's
//! codes, row after row. For Q4 the low nibbles of run `q` are values `4q..4q + 4` of the
//! eight rows and the high nibbles values `16 + 4q..`; for Q8_0 run `q` is values `4q..4q + 4`.
//! The bytes per block are the GGUF's, so the weights take no more memory; rows past the last
//! (to fill a group) are zeros.
//!
//! [`matmul_packed`] computes what [`crate::ggml::matmul_t`] computes (the same integer sums,
//! the float accumulation in another order): the scalar reference unpacks a group's rows and
//! runs the same arithmetic as `ggml::scalar_matmul_t`; the AVX2 and AVX-512 VNNI kernels, and
//! on aarch64 the NEON kernels (`sdot` with the dot-product extension, widening products
//! without), take eight weight rows by up to four activation rows per tile.

use std::ops::Range;

use half::f16;

use crate::block::KernelError;
use crate::dispatch::Backend;
use crate::ggml::{Activations, GgmlType, QK};

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

/// Bytes of one block of a group: the scales (and minimums), then the codes.
fn block_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 => 16 + 128,
        GgmlType::Q4_1 => 32 + 128,
        GgmlType::Q8_0 => 16 + 256,
    }
}

/// Where the codes of a block begin.
fn header_bytes(ty: GgmlType) -> usize {
    if ty == GgmlType::Q4_1 { 32 } else { 16 }
}

/// Bytes of one row's codes in a GGML block.
fn code_bytes(ty: GgmlType) -> usize {
    if ty == GgmlType::Q8_0 { QK } else { QK / 2 }
}

impl PackedWeights {
    /// Repacks `rows` rows of `k` values of type `ty`, as a GGUF stores them.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `k` is not a positive multiple of 32 or `weights` is not
    /// `rows` such rows.
    pub fn new(ty: GgmlType, weights: &[u8], rows: usize, k: usize) -> Result<Self, KernelError> {
        let row_bytes = ty.row_bytes(k);
        if k == 0 || !k.is_multiple_of(QK) || rows.checked_mul(row_bytes) != Some(weights.len()) {
            return Err(KernelError::Shape(format!(
                "{} bytes for {rows} rows of {k} values of {ty:?}",
                weights.len()
            )));
        }
        let (blocks, groups) = (k / QK, rows.div_ceil(GROUP));
        let (bb, hb, cb) = (block_bytes(ty), header_bytes(ty), code_bytes(ty));
        let mut data = vec![0u8; groups * blocks * bb];
        for (r, row) in weights.chunks_exact(row_bytes).enumerate() {
            let (g, i) = (r / GROUP, r % GROUP);
            for (b, src) in row.chunks_exact(ty.block_bytes()).enumerate() {
                let dst = &mut data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
                dst[2 * i..2 * i + 2].copy_from_slice(&src[..2]);
                if ty == GgmlType::Q4_1 {
                    dst[16 + 2 * i..16 + 2 * i + 2].copy_from_slice(&src[2..4]);
                }
                let codes = &src[ty.block_bytes() - cb..];
                for q in 0..cb / 4 {
                    let at = hb + q * 4 * GROUP + 4 * i;
                    dst[at..at + 4].copy_from_slice(&codes[4 * q..4 * q + 4]);
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

    /// Row `i` of group `g` as GGML codes, a byte each in value order (Q4: 0..16; Q8_0: the
    /// signed byte), with its scales and minimums: the inverse of the packing.
    fn unpack_row(&self, g: usize, i: usize, codes: &mut [u8], d: &mut [f32], m: &mut [f32]) {
        let (ty, blocks) = (self.ty, self.k / QK);
        let (bb, hb, cb) = (block_bytes(ty), header_bytes(ty), code_bytes(ty));
        for b in 0..blocks {
            let src = &self.data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
            d[b] = f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32();
            m[b] = if ty == GgmlType::Q4_1 {
                f16::from_le_bytes([src[16 + 2 * i], src[16 + 2 * i + 1]]).to_f32()
            } else {
                0.0
            };
            let out = &mut codes[b * QK..(b + 1) * QK];
            for q in 0..cb / 4 {
                for j in 0..4 {
                    let byte = src[hb + q * 4 * GROUP + 4 * i + j];
                    if ty == GgmlType::Q8_0 {
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
pub fn implementation(backend: Backend) -> Backend {
    #[cfg(target_arch = "aarch64")]
    match backend {
        Backend::Dotprod if backend.is_available() => return Backend::Dotprod,
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
    backend: Backend,
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
/// block after block in order.
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
                let (dot, sum, da) = act.block_dot(w.ty, t, b, &codes[b * QK..(b + 1) * QK]);
                acc += crate::ggml::block_value(w.ty, dot, sum, d[b], m[b], da);
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

/// Where run `q` of a block's codes meets the activation's values: values `4q..` for Q8_0; for
/// Q4, runs 0..4 are the low nibbles (values `4q..`) and runs 4..8 the high ones (values
/// `16 + 4(q − 4)..`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn run_start(ty: GgmlType, q: usize) -> usize {
    if ty == GgmlType::Q8_0 || q < 4 { 4 * q } else { 16 + 4 * (q - 4) }
}

/// A kernel's entry for one instruction set: [`tiles`] over its tile function `$tile`, whose
/// const parameter is the number of activation rows (1 to 4) a tile takes.
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
                    match tn {
                        1 => $tile::<1>(w, g, act, t),
                        2 => $tile::<2>(w, g, act, t),
                        3 => $tile::<3>(w, g, act, t),
                        _ => $tile::<4>(w, g, act, t),
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

    use super::{PackedWeights, block_bytes, header_bytes};
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
            /// As the kernel, `t0` a multiple of 4, `t0 + TN <= act.rows()`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tile<const TN: usize>(
                w: &PackedWeights,
                g: usize,
                act: &Activations,
                t0: usize,
            ) -> [[f32; 8]; 4] {
                let ty = w.ty;
                let blocks = w.k / QK;
                let (bb, hb) = (block_bytes(ty), header_bytes(ty));
                let padded = act.rows().next_multiple_of(4);
                let (codes, scales, scaled_sums) = act.parts();
                let low = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); TN];
                let mut wr = [_mm256_setzero_si256(); 8];
                for b in 0..blocks {
                    let blk = &w.data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
                    // SAFETY: a packed block holds its scales (16 bytes), Q4_1's minimums (16),
                    // then 128 (Q4) or 256 (Q8_0) code bytes.
                    let (dw, c) = unsafe {
                        let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().cast()));
                        let c = match ty {
                            GgmlType::Q4_0 => _mm256_mul_ps(dw, _mm256_set1_ps(-8.0)),
                            GgmlType::Q4_1 => _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().add(16).cast())),
                            GgmlType::Q8_0 => _mm256_setzero_ps(),
                        };
                        if ty == GgmlType::Q8_0 {
                            for (q, r) in wr.iter_mut().enumerate() {
                                *r = _mm256_loadu_si256(blk.as_ptr().add(hb + 32 * q).cast());
                            }
                        } else {
                            for q in 0..4 {
                                let x = _mm256_loadu_si256(blk.as_ptr().add(hb + 32 * q).cast());
                                wr[q] = _mm256_and_si256(x, low);
                                wr[q + 4] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
                            }
                        }
                        (dw, c)
                    };
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let ab = (t0 + j) * blocks + b;
                        let a = &codes[ab * QK..(ab + 1) * QK];
                        let mut dot = _mm256_setzero_si256();
                        for (q, &wq) in wr.iter().enumerate() {
                            let av = _mm256_set1_epi32(super::four_codes(a, super::run_start(ty, q)));
                            dot = if ty == GgmlType::Q8_0 {
                                // Signed codes: |w| against a with w's sign.
                                $dot(dot, _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(av, wq))
                            } else {
                                $dot(dot, wq, av)
                            };
                        }
                        let at = b * padded + t0 + j;
                        let da = _mm256_set1_ps(scales[at]);
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, da), *acc);
                        if ty != GgmlType::Q8_0 {
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

    use super::{PackedWeights, block_bytes, header_bytes};
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
            /// As the kernel, `t0 + TN <= act.rows()`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tile<const TN: usize>(
                w: &PackedWeights,
                g: usize,
                act: &Activations,
                t0: usize,
            ) -> [[f32; 8]; 4] {
                let ty = w.ty;
                let blocks = w.k / QK;
                let (bb, hb) = (block_bytes(ty), header_bytes(ty));
                let padded = act.rows().next_multiple_of(4);
                let (codes, scales, scaled_sums) = act.parts();
                let low = vdupq_n_u8(0x0F);
                let zero = vdupq_n_f32(0.0);
                let mut acc = [[zero; 2]; TN];
                let mut wr = [[vdupq_n_s8(0); 2]; 8];
                for b in 0..blocks {
                    let blk = &w.data[(g * blocks + b) * bb..(g * blocks + b + 1) * bb];
                    // SAFETY: a packed block holds its scales (16 bytes), Q4_1's minimums (16),
                    // then 128 (Q4) or 256 (Q8_0) code bytes.
                    let (dw, c) = unsafe {
                        let p = blk.as_ptr();
                        let dw = halves(p);
                        let c = match ty {
                            GgmlType::Q4_0 => [vmulq_n_f32(dw[0], -8.0), vmulq_n_f32(dw[1], -8.0)],
                            GgmlType::Q4_1 => halves(p.add(16)),
                            GgmlType::Q8_0 => [zero; 2],
                        };
                        if ty == GgmlType::Q8_0 {
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
                        (dw, c)
                    };
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let ab = (t0 + j) * blocks + b;
                        let a = &codes[ab * QK..(ab + 1) * QK];
                        let (mut d0, mut d1) = (vdupq_n_s32(0), vdupq_n_s32(0));
                        for (q, wq) in wr.iter().enumerate() {
                            let av = vreinterpretq_s8_s32(vdupq_n_s32(super::four_codes(
                                a,
                                super::run_start(ty, q),
                            )));
                            d0 = $dot(d0, wq[0], av);
                            d1 = $dot(d1, wq[1], av);
                        }
                        let at = b * padded + t0 + j;
                        let da = scales[at];
                        acc[0] = vfmaq_f32(acc[0], vcvtq_f32_s32(d0), vmulq_n_f32(dw[0], da));
                        acc[1] = vfmaq_f32(acc[1], vcvtq_f32_s32(d1), vmulq_n_f32(dw[1], da));
                        if ty != GgmlType::Q8_0 {
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
    use crate::ggml::tests::weights;
    use crate::ggml::{matmul_t, scalar_matmul_t};

    fn activations(n: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n * k)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = (s % 20_001) as f32 / 10_000.0 - 1.0;
                if i % 97 == 0 { v * 40.0 } else { v }
            })
            .collect()
    }

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
        let backend = Backend::Scalar;
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
