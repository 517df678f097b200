//! AVX-512 kernels for FP8 blocks: OCP e4m3 or e5m2 codes with one scale (and optionally one
//! offset) per row, `fp8e4m3-token` and `fp8e5m2-token`, the FP8 formats GPU engines ship.
//! The AVX2 kernels decode them eight lanes at a time; these take sixteen, for the scores,
//! the value sums, and a fused kernel that attends one block of FP8 keys and the block of FP8
//! values of the same tokens in one call (scores, online softmax step and value sums, the
//! block's scores and weights in one small buffer), as decode's float path would with the
//! three kernels one after the other.
//!
//! The levels are decoded from their bits as the AVX2 kernels decode them (`avx2.rs`,
//! `fp8_halves`): 32 codes widened to 16-bit lanes (`vpmovsxbw`/`vpmovzxbw`), moved into f16
//! bits (an e5m2 code is the high byte of an f16; an e4m3 code's magnitude bits shifted into
//! an f16 are its value / 2^8, subnormals included) and widened to floats with F16C
//! (`vcvtph2ps`, 16 at a time); the 2^8 goes into each row's scale. e4m3 blocks holding the NaN
//! code (which no quantizer writes), looked for once per block (per 256 rows in the separate
//! kernels, so that a long block is read from memory once), take a variant that keeps it a
//! NaN. Every product and sum is an f32 operation on the exact levels: the results are those
//! of the scalar references to the rounding of float sums taken in another order (and, in the
//! fused kernel, of `exp`, the softmax module's polynomial).

use std::arch::x86_64::*;

use kvq_quant_core::fp8::Fp8Format;

use crate::block::{Levels, Params, QuantBlock};
use crate::{FUSED_ROWS, Online};

/// e4m3 codes, the block without the NaN code.
const E4M3: u8 = 0;
/// e4m3 codes that may hold the NaN code (magnitude bits `0x7f`).
const E4M3_ANY: u8 = 1;
/// e5m2 codes.
const E5M2: u8 = 2;

/// Whether these kernels take `b` on this CPU: FP8 levels (8-bit codes) with per-row
/// parameters, rows of a multiple of 32 codes.
pub fn supported(b: &QuantBlock<'_>) -> bool {
    matches!(b.levels, Levels::Fp8(_))
        && b.bits == 8
        && matches!(b.params, Params::PerRow { .. })
        && b.dim > 0
        && b.dim.is_multiple_of(32)
        && crate::dispatch::cpu().avx512
}

/// Whether the fused kernel of [`crate::attend_float_with`] takes keys `k` and values `v` with
/// `n_q` query rows on this CPU: both blocks as [`supported`] takes them, the same rows (1 to
/// 256) and head_dim, at least one query row.
pub fn attend_supported(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    n_q >= 1
        && k.rows == v.rows
        && k.dim == v.dim
        && (1..=FUSED_ROWS).contains(&k.rows)
        && supported(k)
        && supported(v)
}

/// The decoding variant of a block [`supported`] takes.
fn kind_of(b: &QuantBlock<'_>) -> u8 {
    match b.levels {
        Levels::Fp8(Fp8Format::E5M2) => E5M2,
        // SAFETY: `supported` checked AVX2 (with AVX-512); the block holds `rows · row_bytes`
        // code bytes.
        _ if unsafe { crate::avx2::holds_e4m3_nan(&b.codes[..b.rows * b.row_bytes]) } => E4M3_ANY,
        _ => E4M3,
    }
}

/// What the decoded levels of kind `K` are multiplied by to be the codes' values: 2^8 for
/// e4m3 (exact, put into the scales).
fn unit(k: u8) -> f32 {
    if k == E5M2 { 1.0 } else { 256.0 }
}

/// The levels of the 32 codes at `p`, as two vectors of 16 floats (codes 0..16 and 16..32);
/// e4m3 levels are their values / 2^8.
///
/// # Safety
/// The CPU must support AVX-512 F and BW and F16C; `p` points at 32 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn levels32<const K: u8>(p: *const u8) -> (__m512, __m512) {
    // SAFETY: as this function's.
    let c = unsafe { _mm256_loadu_si256(p.cast()) };
    let h = if K == E5M2 {
        _mm512_slli_epi16::<8>(_mm512_cvtepu8_epi16(c))
    } else {
        // Sign-extended, the sign fills bits 15..7 and the magnitude `eeee mmm` bits 6..0;
        // shifted by 7 and bit 14 cleared: the sign at 15, the magnitude at 13..7.
        let bits = _mm512_and_si512(
            _mm512_slli_epi16::<7>(_mm512_cvtepi8_epi16(c)),
            _mm512_set1_epi16(0xbf80u16 as i16),
        );
        if K == E4M3_ANY {
            // Magnitude 0x7f: bit 14 set too, an f16 NaN (exponent all ones, mantissa not 0).
            let mag = _mm512_set1_epi16(0x3f80);
            let nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(bits, mag), mag);
            _mm512_mask_blend_epi16(nan, bits, _mm512_or_si512(bits, _mm512_set1_epi16(0x4000)))
        } else {
            bits
        }
    };
    (_mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)))
}

/// `out[i · stride + r] = scale_r · Σ_d q_i[d] · level[r][d] + offset_r · Σ_d q_i[d]` for
/// the `NQ ≤ 4` query rows of `q` (`NQ × dim`) against every row of `b`: four rows at a time,
/// each row's codes decoded once for every query row, sixteen independent sums reduced
/// together.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL, FMA and F16C; [`supported`]`(b)`, `K` its
/// [`kind_of`]; `q` holds `NQ` rows of `b.dim`; `out` is valid for writes at `i · stride + r`
/// for every `i < NQ` and `r < b.rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores4<const NQ: usize, const K: u8>(b: &QuantBlock<'_>, q: &[f32], out: *mut f32, stride: usize) {
    let (d, n) = (b.dim, b.rows);
    let Params::PerRow { scale, offset } = b.params else { unreachable!("supported") };
    let mut qsum = [0f32; 4];
    if offset.is_some() {
        for (i, s) in qsum.iter_mut().enumerate().take(NQ) {
            let mut acc = _mm512_setzero_ps();
            for c in (0..d).step_by(16) {
                // SAFETY: c + 16 <= d, inside query row i.
                acc = _mm512_add_ps(acc, unsafe { _mm512_loadu_ps(q.as_ptr().add(i * d + c)) });
            }
            *s = _mm512_reduce_add_ps(acc);
        }
    }
    let unit = _mm_set1_ps(unit(K));
    let mut r = 0;
    while r < n {
        // The last quad repeats the last row where the block ends; only real rows are stored.
        let rows: [usize; 4] = std::array::from_fn(|j| (r + j).min(n - 1));
        let mut acc = [[_mm512_setzero_ps(); 4]; NQ];
        for c in (0..d).step_by(32) {
            for (j, &row) in rows.iter().enumerate() {
                // SAFETY: c + 32 <= d = row_bytes, inside row `row < n` of the codes.
                let (lo, hi) = unsafe { levels32::<K>(b.codes.as_ptr().add(row * b.row_bytes + c)) };
                for (i, a) in acc.iter_mut().enumerate() {
                    // SAFETY: c + 32 <= d, inside query row i.
                    unsafe {
                        let qp = q.as_ptr().add(i * d + c);
                        a[j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(qp), a[j]);
                        a[j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(qp.add(16)), a[j]);
                    }
                }
            }
        }
        let take = (n - r).min(4);
        let mask = ((1u32 << take) - 1) as __mmask8;
        // SAFETY: the masked lanes are rows r..r + take < n, inside the scales and offsets.
        let (sv, ov) = unsafe {
            (
                _mm_mul_ps(_mm_maskz_loadu_ps(mask, scale.as_ptr().add(r)), unit),
                offset.map(|o| _mm_maskz_loadu_ps(mask, o.as_ptr().add(r))),
            )
        };
        for (i, a) in acc.iter().enumerate() {
            let dots = crate::avx512::fold4_ps::<false>(a);
            let mut x = _mm_mul_ps(dots, sv);
            if let Some(ov) = ov {
                x = _mm_fmadd_ps(ov, _mm_set1_ps(qsum[i]), x);
            }
            // SAFETY: the masked lanes are rows r..r + take of query row i (this function's
            // contract).
            unsafe { _mm_mask_storeu_ps(out.add(i * stride + r), mask, x) };
        }
        r += 4;
    }
}

/// `o[i · dim + c] += Σ_r w[i · stride + r] · level[r][c] + add[i]` for `NQ ≤ 4` weight rows
/// (the weights already times each row's scale and the unit; `add` what the offsets add): 64
/// channels at a time, every query row's sums in registers across all rows, each row's codes
/// decoded once for every query row.
///
/// # Safety
/// As [`scores4`] for `b`; `w` is valid for reads at `i · stride + r` for every `i < NQ` and
/// `r < b.rows`; `o` holds `NQ` rows of `b.dim`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn sums4<const NQ: usize, const K: u8>(
    b: &QuantBlock<'_>,
    w: *const f32,
    stride: usize,
    add: &[f32; 4],
    o: &mut [f32],
) {
    let (d, n) = (b.dim, b.rows);
    let mut c = 0;
    while c < d {
        // 64 channels, or the last 32 of a row of an odd number of 32s.
        let wide = c + 64 <= d;
        let mut acc = [[_mm512_setzero_ps(); 4]; NQ];
        for r in 0..n {
            // SAFETY: c + 32 (c + 64 when `wide`) <= d = row_bytes, inside row r.
            let x = unsafe {
                let p = b.codes.as_ptr().add(r * b.row_bytes + c);
                let (a, b2) = levels32::<K>(p);
                let (c2, d2) = if wide { levels32::<K>(p.add(32)) } else { (a, b2) };
                [a, b2, c2, d2]
            };
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: as this function's contract.
                let wv = unsafe { _mm512_set1_ps(*w.add(i * stride + r)) };
                for (s, &xv) in a.iter_mut().zip(&x).take(if wide { 4 } else { 2 }) {
                    *s = _mm512_fmadd_ps(xv, wv, *s);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            let addv = _mm512_set1_ps(add[i]);
            for (t, &s) in a.iter().enumerate().take(if wide { 4 } else { 2 }) {
                // SAFETY: c + 16t + 16 <= d, inside row i of `o`.
                unsafe {
                    let at = o.as_mut_ptr().add(i * d + c + 16 * t);
                    _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), _mm512_add_ps(s, addv)));
                }
            }
        }
        c += if wide { 64 } else { 32 };
    }
}

/// `scores4::<nq, kind>` or `sums4::<nq, kind>` with the arguments.
macro_rules! by_kind {
    ($f:ident, $nq:expr, $k:expr, ($($arg:expr),*)) => {
        match ($nq, $k) {
            (1, E4M3) => $f::<1, E4M3>($($arg),*),
            (2, E4M3) => $f::<2, E4M3>($($arg),*),
            (3, E4M3) => $f::<3, E4M3>($($arg),*),
            (_, E4M3) => $f::<4, E4M3>($($arg),*),
            (1, E4M3_ANY) => $f::<1, E4M3_ANY>($($arg),*),
            (2, E4M3_ANY) => $f::<2, E4M3_ANY>($($arg),*),
            (3, E4M3_ANY) => $f::<3, E4M3_ANY>($($arg),*),
            (_, E4M3_ANY) => $f::<4, E4M3_ANY>($($arg),*),
            (1, _) => $f::<1, E5M2>($($arg),*),
            (2, _) => $f::<2, E5M2>($($arg),*),
            (3, _) => $f::<3, E5M2>($($arg),*),
            (_, _) => $f::<4, E5M2>($($arg),*),
        }
    };
}

/// What the offsets of `b` add to the sums of weight row `p`: `Σ_r p_r · offset_r` (0
/// without offsets).
fn offsets_add(b: &QuantBlock<'_>, p: &[f32]) -> f32 {
    match b.params {
        Params::PerRow { offset: Some(o), .. } => p.iter().zip(o).map(|(&x, &y)| x * y).sum(),
        _ => 0.0,
    }
}

/// Rows the separate kernels take at a time: the e4m3 NaN scan of a chunk leaves its codes
/// in L1 (32 KiB at head_dim 128) for the kernel, so that a block streamed from memory is read
/// from it once.
const CHUNK: usize = 256;

/// The scores kernel (`scores_with`'s contract) for a block [`supported`] takes; the caller
/// checked the shapes.
pub(crate) fn scores_in(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) {
    assert!(supported(b) && q.len() == n_q * b.dim && out.len() == n_q * b.rows, "shapes");
    let (d, n) = (b.dim, b.rows);
    for r0 in (0..n).step_by(CHUNK) {
        let c = b.sub_rows(r0..(r0 + CHUNK).min(n));
        let k = kind_of(&c);
        for i0 in (0..n_q).step_by(4) {
            let nq = (n_q - i0).min(4);
            let q = &q[i0 * d..(i0 + nq) * d];
            // Row i of the chunk's scores at out[(i0 + i) · n + r0 ..].
            let out = out[i0 * n + r0..].as_mut_ptr();
            // SAFETY: `supported` checked the CPU and the block (so the chunk), `k` is the
            // chunk's kind; `q` holds nq rows; row i < nq of the chunk's scores ends at
            // (i0 + i) · n + r0 + c.rows <= (i0 + nq) · n, inside `out`.
            unsafe { by_kind!(scores4, nq, k, (&c, q, out, n)) };
        }
    }
}

/// The value kernel (`axpy_with`'s contract) for a block [`supported`] takes, through `w` (a
/// buffer for the weights times the scales); the caller checked the shapes.
pub(crate) fn axpy_in(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32], w: &mut Vec<f32>) {
    assert!(supported(b) && p.len() == n_q * b.rows && out.len() == n_q * b.dim, "shapes");
    let (d, n) = (b.dim, b.rows);
    for r0 in (0..n).step_by(CHUNK) {
        let c = b.sub_rows(r0..(r0 + CHUNK).min(n));
        let (k, m) = (kind_of(&c), c.rows);
        let Params::PerRow { scale, .. } = c.params else { unreachable!("supported") };
        let u = unit(k);
        w.clear();
        for row in p.chunks_exact(n) {
            w.extend(row[r0..r0 + m].iter().zip(scale).map(|(&x, &s)| x * (s * u)));
        }
        for i0 in (0..n_q).step_by(4) {
            let nq = (n_q - i0).min(4);
            let mut add = [0f32; 4];
            for (i, a) in add.iter_mut().enumerate().take(nq) {
                *a = offsets_add(&c, &p[(i0 + i) * n + r0..(i0 + i) * n + r0 + m]);
            }
            let (w, o) = (w[i0 * m..(i0 + nq) * m].as_ptr(), &mut out[i0 * d..(i0 + nq) * d]);
            // SAFETY: as in `scores_in`; `w` holds nq rows of the chunk's m weights, `o` nq
            // rows of d.
            unsafe { by_kind!(sums4, nq, k, (&c, w, m, &add, o)) };
        }
    }
}

/// Row stride of the fused kernel's scores and weights.
const PR: usize = FUSED_ROWS + 16;

/// One block of FP8 keys `k` and the block of FP8 values `v` of the same tokens attended by
/// `n_q` query rows `q` (`n_q × dim`, already scaled), the online softmax `state` updated as
/// decode's float path updates it with the scores kernel, the softmax step and the value
/// kernel: for each row, the scores, their maximum `m'` with the running `m` (NaN scores
/// skipped), `l ← l · e^(m − m') + Σ e^(s − m')`, `o ← o · e^(m − m') + Σ_r e^(s_r − m') ·
/// v̂_r`; a row whose maximum stays −∞ gets zero weights. Four query rows at a time, their
/// scores and weights in a buffer on the stack. Returns `false`, changing nothing, where
/// [`attend_supported`] is false.
///
/// # Panics
/// When `q` and `state` do not hold `n_q` rows of the blocks' head_dim (the callers check).
pub(crate) fn attend_in(
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> bool {
    if !attend_supported(k, v, n_q) {
        return false;
    }
    let (d, n, Online { m, l, o }) = (k.dim, k.rows, state);
    assert!(q.len() == n_q * d && m.len() == n_q && l.len() == n_q && o.len() == n_q * d, "shapes");
    let (kk, kv) = (kind_of(k), kind_of(v));
    let Params::PerRow { scale: vs, .. } = v.params else { unreachable!("supported") };
    let vu = unit(kv);
    let mut p = [0f32; 4 * PR];
    for i0 in (0..n_q).step_by(4) {
        let nq = (n_q - i0).min(4);
        let (q, o) = (&q[i0 * d..(i0 + nq) * d], &mut o[i0 * d..(i0 + nq) * d]);
        // SAFETY: `attend_supported` checked the CPU and both blocks, `kk` is the keys' kind;
        // `q` holds nq rows; row i of the scores at i · PR, n <= FUSED_ROWS < PR.
        unsafe { by_kind!(scores4, nq, kk, (k, q, p.as_mut_ptr(), PR)) };
        let mut add = [0f32; 4];
        for i in 0..nq {
            let row = &mut p[i * PR..i * PR + n];
            // SAFETY: the CPU features were checked by `attend_supported`.
            unsafe { softmax_step(row, &mut m[i0 + i], &mut l[i0 + i], &mut o[i * d..(i + 1) * d]) };
            add[i] = offsets_add(v, row);
            row.iter_mut().zip(vs).for_each(|(x, &s)| *x *= s * vu);
        }
        // SAFETY: as above for the values, `kv` their kind; the weights of row i at i · PR.
        unsafe { by_kind!(sums4, nq, kv, (v, p.as_ptr(), PR, &add, o)) };
    }
    true
}

/// The online softmax step of one query row over its scores `s` (replaced by their weights
/// `e^(s − m')`): the running maximum `m` and sum `l` updated and the row's sums `o` rescaled
/// where the maximum grows; all weights 0 where it stays −∞.
///
/// # Safety
/// The CPU must support AVX-512 F, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn softmax_step(s: &mut [f32], m: &mut f32, l: &mut f32, o: &mut [f32]) {
    let mut mx = _mm512_set1_ps(*m);
    let chunks = s.len().div_ceil(16);
    for j in 0..chunks {
        let mask = crate::avx512::lanes(s.len() - 16 * j);
        // SAFETY: the masked lanes lie inside `s`.
        let x = unsafe { _mm512_maskz_loadu_ps(mask, s.as_ptr().add(16 * j)) };
        // NaN scores are skipped (the second operand is returned).
        mx = _mm512_mask_max_ps(mx, mask, x, mx);
    }
    let top = _mm512_reduce_max_ps(mx);
    if top == f32::NEG_INFINITY {
        s.fill(0.0);
        return;
    }
    let (tv, mut sum) = (_mm512_set1_ps(top), _mm512_setzero_ps());
    for j in 0..chunks {
        let mask = crate::avx512::lanes(s.len() - 16 * j);
        // SAFETY: the masked lanes lie inside `s`.
        unsafe {
            let at = s.as_mut_ptr().add(16 * j);
            let e = crate::softmax::x86::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, at), tv));
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
            _mm512_mask_storeu_ps(at, mask, e);
        }
    }
    let f = (*m - top).exp();
    *l = *l * f + _mm512_reduce_add_ps(sum);
    *m = top;
    if f != 1.0 {
        o.iter_mut().for_each(|x| *x *= f);
    }
}
