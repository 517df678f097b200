//! x86-64 AVX2 + FMA kernels, chosen at run time. Codes are widened and multiplied in
//! registers (no f32 copy of a row): a 16-byte load, a shift and a mask give 16 codes of the
//! bit-plane layout, `vpmovzxbd` and `vcvtdq2ps` make them floats, `vfmadd` accumulates.
//!
//! Covered: affine levels, 2-, 4- and 8-bit codes, rows whose length is a multiple of the
//! chunk (64, 32, 16 codes), per-row and per-channel parameters. Anything else runs the `wide`
//! kernels. Each public function checks the CPU itself, so it is safe to call anywhere.
//!
//! # Platform-specific behavior
//! FMA rounds once per multiply-add and sums run in 8 lanes: results differ from the scalar
//! reference in the last bits, within the crate's stated tolerance.

use std::arch::x86_64::*;

use crate::block::{Levels, Params, QuantBlock};
use crate::int8::{self, IntQuery, quantize_query};
use crate::portable;

fn supported(b: &QuantBlock<'_>) -> bool {
    let chunk = match b.bits {
        8 => 16,
        4 => 32,
        2 => 64,
        _ => return false,
    };
    matches!(b.levels, Levels::Affine) && b.dim.is_multiple_of(chunk) && b.dim > 0 && cpu_ok()
}

fn cpu_ok() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Horizontal sum of 8 lanes.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// The 16 codes of bit-group `k` of a 16-byte chunk of a `bits`-wide plane, as two vectors of
/// 8 floats (codes `16k .. 16k + 8` and `16k + 8 .. 16k + 16` of the chunk).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn codes_f32(chunk: __m128i, bits: u8, k: i32) -> (__m256, __m256) {
    let v = match bits {
        8 => chunk,
        4 => {
            let m = _mm_set1_epi8(0x0f);
            if k == 0 { _mm_and_si128(chunk, m) } else { _mm_and_si128(_mm_srli_epi16(chunk, 4), m) }
        }
        _ => {
            let m = _mm_set1_epi8(0x03);
            let s = match k {
                0 => chunk,
                1 => _mm_srli_epi16(chunk, 2),
                2 => _mm_srli_epi16(chunk, 4),
                _ => _mm_srli_epi16(chunk, 6),
            };
            _mm_and_si128(s, m)
        }
    };
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    (lo, hi)
}

/// `Σ_d qw[d] · code[d]` for one packed row.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `row` holds `qw.len()` codes of `bits` bits and
/// `qw.len()` is a multiple of the chunk (16 codes per 8 bits of width... see `supported`).
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_row(row: &[u8], bits: u8, qw: &[f32]) -> f32 {
    let per_chunk = 128 / bits as usize; // codes per 16-byte chunk
    let groups = per_chunk / 16;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (c, q) in row.chunks_exact(16).zip(qw.chunks_exact(per_chunk)) {
        // SAFETY: `c` is exactly 16 bytes; the unaligned load reads only them.
        let chunk = unsafe { _mm_loadu_si128(c.as_ptr().cast()) };
        for k in 0..groups {
            // SAFETY: AVX2 is enabled by this function's target features.
            let (lo, hi) = unsafe { codes_f32(chunk, bits, k as i32) };
            // SAFETY: `q` has `per_chunk` floats, so 16k + 16 <= q.len().
            let (q0, q1) = unsafe {
                (_mm256_loadu_ps(q.as_ptr().add(16 * k)), _mm256_loadu_ps(q.as_ptr().add(16 * k + 8)))
            };
            acc0 = _mm256_fmadd_ps(lo, q0, acc0);
            acc1 = _mm256_fmadd_ps(hi, q1, acc1);
        }
    }
    // SAFETY: AVX2 is enabled by this function's target features.
    unsafe { hsum(_mm256_add_ps(acc0, acc1)) }
}

/// `o[d] += a · code[d] + c` for one packed row.
///
/// # Safety
/// As [`dot_row`], with `o.len()` codes in `row`.
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_row(row: &[u8], bits: u8, a: f32, c: f32, o: &mut [f32]) {
    let per_chunk = 128 / bits as usize;
    let groups = per_chunk / 16;
    let (av, cv) = (_mm256_set1_ps(a), _mm256_set1_ps(c));
    for (ch, out) in row.chunks_exact(16).zip(o.chunks_exact_mut(per_chunk)) {
        // SAFETY: `ch` is exactly 16 bytes.
        let chunk = unsafe { _mm_loadu_si128(ch.as_ptr().cast()) };
        for k in 0..groups {
            // SAFETY: AVX2 is enabled by this function's target features.
            let (lo, hi) = unsafe { codes_f32(chunk, bits, k as i32) };
            let p = out.as_mut_ptr();
            // SAFETY: `out` has `per_chunk` floats, so 16k + 16 <= out.len(); unaligned
            // loads and stores touch only them.
            unsafe {
                let o0 = _mm256_loadu_ps(p.add(16 * k));
                let o1 = _mm256_loadu_ps(p.add(16 * k + 8));
                _mm256_storeu_ps(p.add(16 * k), _mm256_add_ps(_mm256_fmadd_ps(lo, av, o0), cv));
                _mm256_storeu_ps(p.add(16 * k + 8), _mm256_add_ps(_mm256_fmadd_ps(hi, av, o1), cv));
            }
        }
    }
}

/// Unpacks one row's codes to floats, for rows shared by several query heads.
///
/// # Safety
/// As [`dot_row`], with `out.len()` codes in `row`.
#[target_feature(enable = "avx2,fma")]
unsafe fn unpack_row(row: &[u8], bits: u8, out: &mut [f32]) {
    let per_chunk = 128 / bits as usize;
    for (ch, o) in row.chunks_exact(16).zip(out.chunks_exact_mut(per_chunk)) {
        // SAFETY: `ch` is exactly 16 bytes; `o` holds `per_chunk` floats, 16 per group k.
        unsafe {
            let chunk = _mm_loadu_si128(ch.as_ptr().cast());
            for k in 0..per_chunk / 16 {
                let (lo, hi) = codes_f32(chunk, bits, k as i32);
                _mm256_storeu_ps(o.as_mut_ptr().add(16 * k), lo);
                _mm256_storeu_ps(o.as_mut_ptr().add(16 * k + 8), hi);
            }
        }
    }
}

/// `Σ a·b` over equal-length slices whose length is a multiple of 16.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        // SAFETY: both chunks hold 16 floats.
        unsafe {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(8)), _mm256_loadu_ps(y.as_ptr().add(8)), s1);
        }
    }
    // SAFETY: AVX2 is enabled by this function's target features.
    unsafe { hsum(_mm256_add_ps(s0, s1)) }
}

/// `o += a · x + c` over equal-length slices whose length is a multiple of 8.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn axpb_f32(o: &mut [f32], a: f32, x: &[f32], c: f32) {
    let (av, cv) = (_mm256_set1_ps(a), _mm256_set1_ps(c));
    for (os, xs) in o.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
        // SAFETY: both chunks hold 8 floats.
        unsafe {
            let v = _mm256_fmadd_ps(_mm256_loadu_ps(xs.as_ptr()), av, _mm256_loadu_ps(os.as_ptr()));
            _mm256_storeu_ps(os.as_mut_ptr(), _mm256_add_ps(v, cv));
        }
    }
}

/// Runs `f` on each row's levels: fused from the packed bytes for one query row, unpacked
/// once into a buffer when several query rows (a GQA group) share it.
fn for_rows(b: &QuantBlock<'_>, n_q: usize, mut f: impl FnMut(usize, RowLevels<'_>)) {
    let mut buf = vec![0f32; if n_q > 1 { b.dim } else { 0 }];
    for r in 0..b.rows {
        if n_q > 1 {
            // SAFETY: callers checked `supported(b)`: AVX2/FMA, bit width, row length.
            unsafe { unpack_row(b.row(r), b.bits, &mut buf) };
            f(r, RowLevels::Unpacked(&buf));
        } else {
            f(r, RowLevels::Packed(b.row(r)));
        }
    }
}

enum RowLevels<'a> {
    Packed(&'a [u8]),
    Unpacked(&'a [f32]),
}

impl RowLevels<'_> {
    fn dot(&self, bits: u8, q: &[f32]) -> f32 {
        match self {
            // SAFETY (both): callers checked `supported`; lengths match the row.
            RowLevels::Packed(row) => unsafe { dot_row(row, bits, q) },
            RowLevels::Unpacked(l) => unsafe { dot_f32(q, l) },
        }
    }

    fn axpb(&self, bits: u8, o: &mut [f32], a: f32, c: f32) {
        match self {
            // SAFETY (both): callers checked `supported`; lengths match the row.
            RowLevels::Packed(row) => unsafe { axpy_row(row, bits, a, c, o) },
            RowLevels::Unpacked(l) => unsafe { axpb_f32(o, a, l, c) },
        }
    }
}

/// See [`crate::scalar::scores`]. Falls back to the `wide` kernels for layouts it does not cover.
pub fn scores(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) {
    if !supported(b) {
        return portable::scores(b, q, n_q, out);
    }
    let d = b.dim;
    match b.params {
        Params::PerRow { scale, offset } => {
            let qsum: Vec<f32> = q.chunks_exact(d).map(|qi| qi.iter().sum()).collect();
            for_rows(b, n_q, |r, levels| {
                let off = offset.map_or(0.0, |o| o[r]);
                for i in 0..n_q {
                    out[i * b.rows + r] =
                        scale[r] * levels.dot(b.bits, &q[i * d..(i + 1) * d]) + off * qsum[i];
                }
            });
        }
        Params::PerChannel { scale, offset } => {
            let (qw, cst) = portable::fold_channels(q, n_q, scale, offset);
            for_rows(b, n_q, |r, levels| {
                for i in 0..n_q {
                    out[i * b.rows + r] = levels.dot(b.bits, &qw[i * d..(i + 1) * d]) + cst[i];
                }
            });
        }
    }
}

/// See [`crate::scalar::axpy`]. Falls back to the `wide` kernels for layouts it does not cover.
pub fn axpy(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32]) {
    if !supported(b) {
        return portable::axpy(b, p, n_q, out);
    }
    let d = b.dim;
    match b.params {
        Params::PerRow { scale, offset } => {
            for_rows(b, n_q, |r, levels| {
                let off = offset.map_or(0.0, |o| o[r]);
                for i in 0..n_q {
                    let w = p[i * b.rows + r];
                    levels.axpb(b.bits, &mut out[i * d..(i + 1) * d], w * scale[r], w * off);
                }
            });
        }
        Params::PerChannel { scale, offset } => {
            let mut acc = vec![0f32; n_q * d];
            for_rows(b, n_q, |r, levels| {
                for i in 0..n_q {
                    levels.axpb(b.bits, &mut acc[i * d..(i + 1) * d], p[i * b.rows + r], 0.0);
                }
            });
            for i in 0..n_q {
                let psum: f32 = p[i * b.rows..(i + 1) * b.rows].iter().sum();
                for (k, (o, &a)) in
                    out[i * d..(i + 1) * d].iter_mut().zip(&acc[i * d..(i + 1) * d]).enumerate()
                {
                    *o += a * scale[k] + offset.map_or(0.0, |x| x[k]) * psum;
                }
            }
        }
    }
}

/// A query row quantized to int8 for the integer score path (as llama.cpp's q8 queries):
/// `q ≈ scale · q8`, `scale = max|q| / 127`, with `q8` laid out in the order the 4-bit
/// unpacking produces codes, and widened to i16 for 8-bit codes.
struct Q8 {
    scale: f32,
    /// 4-bit order: per 64 codes, [0..16, 32..48] then [16..32, 48..64].
    perm4: Vec<i8>,
    /// Natural order, widened.
    wide16: Vec<i16>,
}

impl IntQuery for Q8 {
    fn prepare(q: &[f32]) -> Self {
        let (scale, q8) = quantize_query(q);
        let mut perm4 = Vec::with_capacity(q8.len());
        for g in q8.chunks_exact(64) {
            perm4.extend_from_slice(&g[..16]);
            perm4.extend_from_slice(&g[32..48]);
            perm4.extend_from_slice(&g[16..32]);
            perm4.extend_from_slice(&g[48..]);
        }
        Self { scale, perm4, wide16: q8.iter().map(|&x| i16::from(x)).collect() }
    }

    fn scale(&self) -> f32 {
        self.scale
    }
}

/// `Σ_d q8[d] · code[d]` for a 4-bit row of a multiple of 64 codes.
///
/// # Safety
/// The CPU must support AVX2; `row.len() · 2 == q.perm4.len()`, a multiple of 64.
#[target_feature(enable = "avx2,fma")]
unsafe fn idot4(row: &[u8], q: &Q8) -> i32 {
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_si256();
    for (c, qp) in row.chunks_exact(32).zip(q.perm4.chunks_exact(64)) {
        // SAFETY: `c` is 32 bytes and `qp` 64: every load reads inside them.
        unsafe {
            let v = _mm256_loadu_si256(c.as_ptr().cast());
            let lo = _mm256_and_si256(v, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            let qlo = _mm256_loadu_si256(qp.as_ptr().cast());
            let qhi = _mm256_loadu_si256(qp.as_ptr().add(32).cast());
            // u8 codes (≤ 15) × i8 queries, pairs summed: |sum| ≤ 2 · 15 · 127, no saturation.
            let a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, qlo), ones);
            let b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, qhi), ones);
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(a, b));
        }
    }
    // SAFETY: AVX2 is enabled by this function's target features.
    unsafe { hsum_i32(acc) }
}

/// `Σ_d q8[d] · code[d]` for an 8-bit row of a multiple of 16 codes (i16 products, i32 sums).
///
/// # Safety
/// The CPU must support AVX2; `row.len() == q.wide16.len()`, a multiple of 16.
#[target_feature(enable = "avx2,fma")]
unsafe fn idot8(row: &[u8], q: &Q8) -> i32 {
    let mut acc = _mm256_setzero_si256();
    for (c, qw) in row.chunks_exact(16).zip(q.wide16.chunks_exact(16)) {
        // SAFETY: `c` is 16 bytes and `qw` 16 i16 (32 bytes).
        unsafe {
            let codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(c.as_ptr().cast()));
            let qv = _mm256_loadu_si256(qw.as_ptr().cast());
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(codes, qv));
        }
    }
    // SAFETY: AVX2 is enabled by this function's target features.
    unsafe { hsum_i32(acc) }
}

/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Whether [`scores_int8`] has an integer kernel for this block.
pub fn int8_supported(b: &QuantBlock<'_>) -> bool {
    let ok_dim = match b.bits {
        4 => b.dim.is_multiple_of(64),
        8 => b.dim.is_multiple_of(16),
        _ => false,
    };
    ok_dim && b.dim > 0 && matches!(b.levels, Levels::Affine) && cpu_ok()
}

/// Scores through the integer path: the query (per-channel: the query times the scales) is
/// quantized to int8 per row, codes and query meet in `vpmaddubsw`/`vpmaddwd`, and one float
/// multiply per row restores the scale. Offsets use the exact float sum of the query.
///
/// Tolerance: each score is off by at most `scale_q / 2 · Σ_d |level_d| · scale` (the query's
/// rounding), `scale_q = max|q| / 127`. Returns `false`, computing nothing, when
/// [`int8_supported`] is false.
pub fn scores_int8(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    if !int8_supported(b) {
        return false;
    }
    // SAFETY: `int8_supported` checked AVX2, the bit width and the row length.
    let idot =
        |row: &[u8], q8: &Q8| if b.bits == 4 { unsafe { idot4(row, q8) } } else { unsafe { idot8(row, q8) } };
    int8::scores(b, q, n_q, out, idot);
    true
}
