//! The fused block kernel of decode's integer path for CPUs with AVX2 and FMA but no AVX-512
//! VNNI (AMD Zen 2 and 3, most Intel client CPUs): one block of INT4 keys per channel and the
//! block of INT4 values per token of the same tokens (KIVI-style), attended by up to four
//! query rows at a time in one call. Without it such a CPU ran the integer scores kernel, the
//! softmax and the float value kernel one after the other, and the float value sums (every
//! code widened to a float and multiplied once per query row) took half of a decode step.
//!
//! The scores are the integer scores kernel's ([`crate::avx2::scores_int8`]: the same query
//! rounding, dots and epilogue, so the same bits); the values go through the integer value
//! path's algebra (the `intv` module's) with byte weights: `vpmaddubsw` multiplies the weights of
//! two rows (`0..=255`) by their centred codes (`−8..=7`) interleaved byte by byte, sixteen
//! channels per instruction, and i16 sums of up to sixteen rows (at most `16 · 255 · 8 =
//! 32640`) are widened to i32. The softmax and the weights' rounding are those of the AVX-512
//! kernel (`crate::avx512::attend_int_in`) eight lanes wide, so the results equal
//! [`crate::scalar::attend_int`] to the rounding of float sums taken in another order and of
//! `exp` (the softmax module's polynomial), not bit for bit.

use std::arch::x86_64::*;

use crate::Online;
use crate::avx2;
use crate::block::{Params, QuantBlock};
use crate::int8::{self, grown};
use crate::softmax::x86::exp8;

/// Whether [`crate::attend_int_with`] has a fused AVX2 kernel for keys `k`, values `v` and
/// `n_q` query rows on this CPU: INT4 affine keys with per-channel parameters and INT4 affine
/// values with per-row parameters, the same tokens (1 to 256) and head_dim (64, 128 or 256),
/// any number of query rows (four at a time), a CPU with AVX2, FMA and F16C.
pub fn attend_int_supported(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    crate::fused_layout(k, v, n_q) && avx2::int8_supported(k)
}

/// The buffers of [`attend_int_in`], grown to the largest block and query group seen, then
/// reused.
#[derive(Default)]
pub(crate) struct FusedScratch {
    q8: Vec<i8>,
    arranged: Vec<u8>,
    dots: Vec<i32>,
    p: Vec<f32>,
    wb: Vec<u8>,
    acc: Vec<i32>,
}

/// One block of keys and the block of values of the same tokens attended by `n_q` query rows
/// (`q`, `n_q × dim`, already scaled), the online softmax `state` of the rows updated; see the
/// module. Returns `false`, changing nothing, when [`attend_int_supported`] is false or a value
/// scale is negative or NaN (byte weights need `p · scale ≥ 0`).
pub(crate) fn attend_int_in(
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
    w: &mut FusedScratch,
) -> bool {
    if !attend_int_supported(k, v, n_q) {
        return false;
    }
    crate::fused_groups(v, q, n_q, state, |nq, q, m, l, o| {
        // SAFETY: `attend_int_supported` checked the CPU (AVX2, FMA, F16C), the widths, the
        // layouts and the sizes; `fused_groups` checked the value scales and the shapes.
        unsafe { by_group!(attend, nq, (k, v, q, m, l, o, w)) }
    })
}

/// The sum of the 8 lanes of `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum8(x: __m256) -> f32 {
    let y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let y = _mm_add_ps(y, _mm_movehl_ps(y, y));
    _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)))
}

/// The largest of the 8 lanes of `x` (the kernel's maxima hold no NaN: they skip NaN inputs
/// as they are taken).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax8(x: __m256) -> f32 {
    let y = _mm_max_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let y = _mm_max_ps(_mm_movehl_ps(y, y), y);
    _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(y), y))
}

/// All-ones in lanes `0..len` (a float mask for `blendv`, `and` and `maskload`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn lanes8(len: usize) -> __m256 {
    let len = len.min(8) as i32;
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(len), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
}

/// `Σ q · offset` of each of the `NQ` query rows of `q` (each `offset.len()` long, a multiple
/// of 8), as [`avx2::dot_lanes`] sums it (8 lanes, multiply then add, the lanes summed in
/// order), so the same bits as the scores kernel's; the rows' chains side by side.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn offset_dots<const NQ: usize>(q: &[f32], offset: &[f32]) -> [f32; int8::GROUP] {
    let d = offset.len();
    assert!(q.len() >= NQ * d && d.is_multiple_of(8), "NQ rows of whole lanes");
    let mut acc = [_mm256_setzero_ps(); int8::GROUP];
    for c in (0..d).step_by(8) {
        // SAFETY: c + 8 <= d: inside `offset` and inside each query row.
        unsafe {
            let f = _mm256_loadu_ps(offset.as_ptr().add(c));
            for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(i * d + c)), f));
            }
        }
    }
    let mut out = [0f32; int8::GROUP];
    for (o, a) in out.iter_mut().zip(&acc).take(NQ) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
        // `dot_lanes` adds its (empty) tail's sum, −0.0, which changes no value.
        *o = lanes.iter().sum::<f32>();
    }
    out
}

/// The fused kernel for `NQ` query rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; [`attend_int_supported`]`(k, v, NQ)`; every value
/// scale of `v` is `>= 0`; `q` and `o` hold `NQ · dim` values, `m` and `l` `NQ`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend<const NQ: usize>(
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
    w: &mut FusedScratch,
) {
    let (d, n) = (k.dim, k.rows);
    let Params::PerChannel { scale: ks, offset: ko } = k.params else { unreachable!("checked") };
    let Params::PerRow { scale: vs, offset: vo } = v.params else { unreachable!("checked") };
    let FusedScratch { q8, arranged, dots, p, wb, acc } = w;

    // 1. The query rows times the channel scales, rounded to int8 and arranged as the scores
    //    kernel rounds and arranges them; what the keys' offsets add, `Σ q · offset`.
    let mut sq = [0f32; int8::GROUP];
    // Written in full by the two calls (d is a multiple of 64), so only grown, never cleared.
    let (q8, arranged) = (grown(q8, NQ * d), grown(arranged, NQ * d));
    // SAFETY: AVX2 (this function's contract); q holds NQ rows of d (a multiple of 8) values.
    unsafe { avx2::round_queries_by::<NQ>(q, ks, q8, &mut sq) };
    // SAFETY: AVX2 (this function's contract).
    unsafe { avx2::arrange4_32(q8, arranged) };
    let kadd = match ko {
        Some(ko) => offset_dots::<NQ>(q, ko),
        None => [0f32; int8::GROUP],
    };

    // 2. The integer dots of every row with the rounded query rows.
    let dots = grown(dots, NQ * n);
    // SAFETY: `int8_supported(k)` (checked by the caller): 4-bit rows of d codes, d a
    // multiple of 64; `arranged` holds NQ rows of d bytes, `dots` NQ · n values.
    unsafe { avx2::int_dots_4bit::<NQ>(k, arranged, dots) };

    // 3. The scores (`sq · dot + kadd`, the scores kernel's epilogue), their maxima with the
    //    running ones, the rescaling factors, the exponentials, their sums and the weights
    //    `p · scale` rounded to bytes (scale max / 255), zero from n to the stride. Every loop
    //    runs over the rows with the query rows inside, so that their chains overlap.
    let stride = n.next_multiple_of(8);
    let p = grown(p, NQ * stride);
    let wb = grown(wb, NQ * stride);
    let mut mx = [_mm256_setzero_ps(); int8::GROUP];
    for i in 0..NQ {
        mx[i] = _mm256_set1_ps(m[i]);
    }
    for r in (0..stride).step_by(8) {
        let keep = lanes8(n - r);
        for i in 0..NQ {
            // SAFETY: the lanes in `keep` lie inside row i of `dots` (n values); row i of `p`
            // holds `stride` values.
            unsafe {
                let dv = _mm256_maskload_epi32(dots.as_ptr().add(i * n + r), _mm256_castps_si256(keep));
                let s = _mm256_add_ps(
                    _mm256_mul_ps(_mm256_set1_ps(sq[i]), _mm256_cvtepi32_ps(dv)),
                    _mm256_set1_ps(kadd[i]),
                );
                _mm256_storeu_ps(p.as_mut_ptr().add(i * stride + r), s);
                // NaN scores are skipped by the maximum (the second operand is returned).
                mx[i] = _mm256_blendv_ps(mx[i], _mm256_max_ps(s, mx[i]), keep);
            }
        }
    }
    let mut top = [f32::NEG_INFINITY; int8::GROUP];
    let mut t = [0f32; 8];
    for i in 0..NQ {
        top[i] = hmax8(mx[i]);
        t[i] = m[i] - top[i];
    }
    // The rescaling factors `e^(m − m')` of all rows in one vector.
    let mut factor = [1f32; 8];
    // SAFETY: `t` and `factor` hold 8 floats; AVX2 and FMA are enabled.
    unsafe { _mm256_storeu_ps(factor.as_mut_ptr(), exp8(_mm256_loadu_ps(t.as_ptr()))) };
    // A row whose maximum is still −∞ has seen nothing: no weight, no change (its byte
    // weights are zeroed below).
    let live: [bool; int8::GROUP] = std::array::from_fn(|i| i < NQ && top[i] != f32::NEG_INFINITY);
    let z = _mm256_set1_ps(f32::from(crate::intv::center(4)));
    let zero = _mm256_setzero_ps();
    let (mut sum, mut add, mut wmx, mut any) =
        ([zero; int8::GROUP], [zero; int8::GROUP], [zero; int8::GROUP], [zero; int8::GROUP]);
    let mv: [__m256; int8::GROUP] =
        std::array::from_fn(|i| _mm256_set1_ps(if live[i] { top[i] } else { 0.0 }));
    for r in (0..stride).step_by(8) {
        let keep = lanes8(n - r);
        let km = _mm256_castps_si256(keep);
        // SAFETY: the lanes in `keep` lie inside the value scales and offsets (n of each).
        let (vsr, vor) = unsafe {
            // A `match`, not `Option::map`: the intrinsic stays in this function's AVX2 code.
            #[allow(clippy::manual_map)]
            let vor = match vo {
                Some(vo) => Some(_mm256_maskload_ps(vo.as_ptr().add(r), km)),
                None => None,
            };
            (_mm256_maskload_ps(vs.as_ptr().add(r), km), vor)
        };
        for i in 0..NQ {
            if !live[i] {
                continue;
            }
            // SAFETY: row i of `p` holds `stride` values.
            unsafe {
                let at = p.as_mut_ptr().add(i * stride + r);
                let e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(at), mv[i])), keep);
                sum[i] = _mm256_add_ps(sum[i], e);
                let wv = _mm256_mul_ps(e, vsr);
                // What the offsets and the centre add: Σ p · offset + z · Σ w.
                add[i] = _mm256_fmadd_ps(z, wv, add[i]);
                if let Some(vor) = vor {
                    add[i] = _mm256_fmadd_ps(e, vor, add[i]);
                }
                wmx[i] = _mm256_max_ps(wv, wmx[i]);
                any[i] = _mm256_add_ps(any[i], wv);
                _mm256_storeu_ps(at, wv);
            }
        }
    }
    let (mut wmax, mut wnan, mut vadd) = ([0f32; 4], [false; 4], [0f32; int8::GROUP]);
    for i in 0..NQ {
        if !live[i] {
            factor[i] = 1.0;
            continue;
        }
        l[i] = l[i] * factor[i] + hsum8(sum[i]);
        m[i] = top[i];
        vadd[i] = hsum8(add[i]);
        wmax[i] = hmax8(wmx[i]);
        wnan[i] = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(any[i], any[i])) != 0;
    }
    let (sw, winv) = crate::int8::scales_of4(wmax, wnan, 255.0);
    let (hi, order) = (_mm256_set1_ps(255.0), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    for i in 0..NQ {
        if !live[i] {
            // A row that saw nothing gets zero weights (its `p` holds scores, not weights).
            wb[i * stride..(i + 1) * stride].fill(0);
        }
    }
    for r in (0..stride).step_by(8) {
        for i in (0..NQ).filter(|&i| live[i]) {
            let inv = _mm256_set1_ps(winv[i]);
            // SAFETY: row i of `p` and of `wb` hold `stride` values (zero weights past n).
            unsafe {
                let y =
                    _mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(p.as_ptr().add(i * stride + r)), inv), hi);
                // Rounded to nearest, ties to even, as the reference's `int8::MAGIC` addition.
                let code = _mm256_cvtps_epi32(y);
                // Eight i32 in 0..=255 to bytes: two saturating packs (per 128-bit lane), then
                // the two lanes' first four bytes side by side.
                let b = _mm256_packus_epi16(_mm256_packus_epi32(code, code), _mm256_setzero_si256());
                let b = _mm256_permutevar8x32_epi32(b, order);
                _mm_storel_epi64(wb.as_mut_ptr().add(i * stride + r).cast(), _mm256_castsi256_si128(b));
            }
        }
    }

    // 4. The integer sums of the centred value codes under the byte weights, and the epilogue:
    //    `o ← o · factor + (sw · sum + add)`.
    let acc = grown(acc, NQ * d);
    // SAFETY: `v` is 4-bit with rows of d / 2 bytes, d a multiple of 32 and n >= 1 rows; row
    // i of `wb` holds `stride >= n` bytes, zero from n; `acc` NQ · d values.
    unsafe { value_sums::<NQ>(v, wb, stride, acc) };
    for i in 0..NQ {
        let (f, s, a) = (_mm256_set1_ps(factor[i]), _mm256_set1_ps(sw[i]), _mm256_set1_ps(vadd[i]));
        for c in (0..d).step_by(8) {
            // SAFETY: c + 8 <= d, inside row i of `o` and `acc`.
            unsafe {
                let at = o.as_mut_ptr().add(i * d + c);
                let x = _mm256_cvtepi32_ps(_mm256_loadu_si256(acc.as_ptr().add(i * d + c).cast()));
                let x = _mm256_add_ps(_mm256_mul_ps(s, x), a);
                let old = _mm256_loadu_ps(at);
                let old = if factor[i] != 1.0 { _mm256_mul_ps(old, f) } else { old };
                _mm256_storeu_ps(at, _mm256_add_ps(old, x));
            }
        }
    }
}

/// `acc[i · d + c] = Σ_r wb[i · stride + r] · (code[r][c] − 8)` for every row of the 4-bit block
/// `v` and `NQ` rows of byte weights, channels in natural order. Per 16-byte lane of the rows
/// (low nibbles: 16 channels, high nibbles: the next 16) and pair of rows: the two rows' bytes
/// interleaved in one register (each lane broadcast to both halves, two in-lane `vpshufb`),
/// nibbles split and centred, then per query one `vpmaddubsw` per nibble plane against the
/// pair's two weights broadcast; the i16 sums are widened into `acc` every eight pairs. An odd
/// last row is paired with itself under a zero weight.
///
/// # Safety
/// The CPU must support AVX2; `v.bits == 4`, `v.dim` a multiple of 32, `v.rows >= 1`; each row
/// of `wb` holds `stride > v.rows` rounded down to even bytes, zero from `v.rows`; `acc` holds
/// `NQ · v.dim` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_sums<const NQ: usize>(v: &QuantBlock<'_>, wb: &[u8], stride: usize, acc: &mut [i32]) {
    let (d, n, rb) = (v.dim, v.rows, v.row_bytes);
    assert!(wb.len() >= NQ * stride && stride >= n.next_multiple_of(2) && acc.len() >= NQ * d);
    // What `QuantBlock::new` checked, restated for the reads below through a pointer: n rows
    // of d / 2 bytes (slicing each row cost a third of the loop's instructions).
    assert!(rb == d / 2 && n.checked_mul(rb).is_some_and(|len| len <= v.codes.len()));
    let (codes, weights) = (v.codes.as_ptr(), wb.as_ptr());
    let (mask, eight) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(8));
    // Byte j of a row to byte 2j (first row) or 2j + 1 (second) of its half, bytes 0..8 in the
    // low half and 8..16 in the high; the other byte zeroed (-1: the top bit set).
    // Opaque to the compiler: it would turn the constant shuffles of broadcasts into the
    // lane-crossing `vpermq` again (two µops each on Zen 3, the loop's limit being its vector
    // µops).
    let spread = std::hint::black_box([
        _mm256_setr_epi8(
            0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13,
            -1, 14, -1, 15, -1,
        ),
        _mm256_setr_epi8(
            -1, 0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1,
            13, -1, 14, -1, 15,
        ),
    ]);
    for lane in 0..d / 32 {
        // Sixteen rows (eight pairs) at a time, then the widening into `acc`: the first batch
        // writes it, later ones add.
        for batch in 0..n.div_ceil(16) {
            let mut s = [[_mm256_setzero_si256(); 2]; int8::GROUP];
            let (mut r, end) = (16 * batch, (16 * batch + 16).min(n));
            // Lane `lane` of row r, moved on by two rows a pair (no multiply per pair).
            // SAFETY: r < n and 16-byte lane `lane` lies inside a row (16 · lane + 16 <= d / 2
            // = rb): inside the n · rb bytes of `codes`.
            let mut at = unsafe { codes.add(r * rb + 16 * lane) };
            while r < end {
                // An odd last row pairs with itself under the zero weight at n.
                let next = if r + 1 < n { rb } else { 0 };
                // Both rows' lanes in both halves (`vbroadcasti128`, a load without a vector
                // µop), their bytes interleaved: bytes 0..8 of the two rows in the low half,
                // 8..16 in the high. Two in-lane shuffles and an or: Zen 3 splits the
                // lane-crossing `vpermq` of an insert-and-interleave in two µops.
                // SAFETY: `at` is lane `lane` of row r < n, `at + next` of row r + 1 < n or of
                // row r again: 16 bytes inside `codes` each.
                let x = unsafe {
                    let a = avx2::load_pair(at);
                    let b = avx2::load_pair(at.add(next));
                    _mm256_or_si256(_mm256_shuffle_epi8(a, spread[0]), _mm256_shuffle_epi8(b, spread[1]))
                };
                // Two rows on, for the next pair (past the codes after the last one: never
                // read, so `wrapping_add`).
                at = at.wrapping_add(2 * rb);
                // Split into nibble planes (low: channels 32 · lane + 0..16, high: the next 16,
                // eight a half) and centred.
                let planes = [
                    _mm256_sub_epi8(_mm256_and_si256(x, mask), eight),
                    _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), mask), eight),
                ];
                for (i, s) in s.iter_mut().enumerate().take(NQ) {
                    // SAFETY: bytes r and r + 1 of weight row i lie inside it (r + 1 < stride).
                    let pair = unsafe { weights.add(i * stride + r).cast::<i16>().read_unaligned() };
                    let wv = _mm256_set1_epi16(pair);
                    s[0] = _mm256_add_epi16(s[0], _mm256_maddubs_epi16(wv, planes[0]));
                    s[1] = _mm256_add_epi16(s[1], _mm256_maddubs_epi16(wv, planes[1]));
                }
                r += 2;
            }
            // At most sixteen rows of |w · (c − 8)| ≤ 255 · 8: each i16 within 32640.
            for (i, s) in s.iter().enumerate().take(NQ) {
                for (h, x) in s.iter().enumerate() {
                    let at = i * d + 32 * lane + 16 * h;
                    let lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(*x));
                    let hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(*x));
                    // SAFETY: at + 16 <= NQ · d, inside `acc`.
                    unsafe {
                        let p = acc.as_mut_ptr().add(at);
                        if batch == 0 {
                            _mm256_storeu_si256(p.cast(), lo);
                            _mm256_storeu_si256(p.add(8).cast(), hi);
                        } else {
                            _mm256_storeu_si256(p.cast(), _mm256_add_epi32(_mm256_loadu_si256(p.cast()), lo));
                            let p = p.add(8);
                            _mm256_storeu_si256(p.cast(), _mm256_add_epi32(_mm256_loadu_si256(p.cast()), hi));
                        }
                    }
                }
            }
        }
    }
}
