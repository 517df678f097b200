//! The fused block kernel of decode's integer path for CPUs with AVX2 and FMA but no AVX-512
//! VNNI (AMD Zen 2 and 3, most Intel client CPUs): one block of INT4 keys per channel and the
//! block of INT4 values per token of the same tokens (KIVI-style), attended by up to four
//! query rows at a time in one call. Without it such a CPU ran the integer scores kernel, the
//! softmax and the float value kernel one after the other, and the float value sums (every
//! code widened to a float and multiplied once per query row) took half of a decode step.
//!
//! The scores are the integer scores kernel's ([`crate::avx2::scores_int8_in`]: the same query
//! rounding, dots and epilogue, so the same bits); the values go through the integer value
//! path's algebra (the `int_values` module's) with byte weights: `vpmaddubsw` multiplies the weights of
//! two rows (`0..=255`) by their centred codes (`−8..=7`) interleaved byte by byte, sixteen
//! channels per instruction, and i16 sums of up to sixteen rows (at most `16 · 255 · 8 =
//! 32640`) are widened to i32. The softmax and the weights' rounding are those of the AVX-512
//! kernel (`crate::avx512::attend_int_in`) eight lanes wide, so the results equal
//! [`crate::scalar::attend_int`] to the rounding of float sums taken in another order and of
//! `exp` (the softmax module's polynomial), not bit for bit.
//!
//! Values per group (`int4-g32`, which `kvq recommend` picks for most layers) take the same
//! path with byte weights per query row and group, each rounded with its own scale: a 16-byte
//! lane of a row (32 channels) lies inside one group, so the value loop reads that group's
//! weights. Keys per row or per group (`int4-token`, `int4-g32`) take the integer scores
//! kernel's scores as they are (its per-group dots and epilogue), then the same softmax step
//! and value sums. Keys in channel regions (`-qa`) and keys per channel of other widths than
//! 4 bits (one region) take the region scores of `regions_avx2` (bit for bit the
//! reference's); values of 1 to 3 bits per row are unpacked to a code a byte there and summed
//! against the same byte weights.

use std::arch::x86_64::*;

use crate::avx2;
use crate::block::{Params, QuantBlock};
use crate::int8::{self, grown};
use crate::prefetch::Ahead;
use crate::regions::{GroupKeys, Keys};
use crate::softmax::x86::exp8;
use crate::{KeyRegion, MAX_GROUPS, Online};
use crate::{regions, regions_avx2};

/// Whether [`crate::attend_int_with`] has a fused AVX2 kernel for keys `k`, values `v` and
/// `n_q` query rows on this CPU: INT4 affine keys with per-channel parameters and INT4 affine
/// values with per-row parameters, the same tokens (1 to 256) and head_dim (64, 128 or 256),
/// any number of query rows (four at a time), a CPU with AVX2, FMA and F16C; or such keys
/// with INT4 affine values per group of 32, 64, 128 or 256 values (dividing the head_dim); or
/// INT4 affine keys per row or per group of 32 to 256 values with either of those values;
/// any of those keys with values of 1 to 3 bits per row; affine keys per channel of 1 to 8
/// bits as one region of [`attend_int_regions_supported`].
pub fn attend_int_supported(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    // Keys of other widths go through the region scores, which check the CPU themselves.
    crate::fused_int_layout(k, v, n_q, regions::narrow_values, attend_int_regions_supported)
        && (k.bits != 4 || avx2::int8_supported(k))
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
    /// Values per group: their scales and offsets by group (rows along), and the float
    /// weights of every (query row, group).
    vt: Vec<f32>,
    pw: Vec<f32>,
    /// Keys per row or group: the scores kernel's scratch, and its scores.
    int8: int8::Scratch,
    scores: Vec<f32>,
    /// Keys in channel regions (`-qa`): their scores kernel's buffers and plans.
    pub(crate) regions: regions::Scratch<regions_avx2::Step>,
    /// Values of 1 to 3 bits: their rows unpacked to a code a byte.
    values: regions_avx2::Unpacker,
    /// Keys in channel regions: the block's scores of every query row of the call.
    region_scores: Vec<f32>,
    /// What a fused call asks for while it computes ([`crate::Scratch::prefetch_next`]): the
    /// key dots step it on every four rows, the value sums every sixteen rows of a lane.
    pub(crate) ahead: Ahead,
}

fused_entries!();

/// The fused kernel on query groups of up to four rows (`false`, changing nothing, where a
/// value scale is negative or NaN).
///
/// # Safety
/// [`attend_int_parts_supported`] for the parts of `keys`, or
/// [`attend_int_regions_supported`] for its regions, with `v` and `n_q`.
unsafe fn run(
    keys: Keys<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
    w: &mut FusedScratch,
) -> bool {
    // What does not depend on the query group, once for the block: the key regions' scores of
    // every query row (their rows unpacked once), the narrow values' rows unpacked.
    let n = v.rows;
    // The queued lines spread over the row loops of every query group: the dots of keys per
    // channel (a step every four rows) and the value sums (a step every sixteen rows of a
    // 32-channel lane).
    let key_steps = match keys {
        Keys::Parts(parts) if matches!(parts[0].params, Params::PerChannel { .. }) => n.div_ceil(4),
        _ => 0,
    };
    w.ahead.pace(n_q.div_ceil(int8::GROUP) * (key_steps + v.dim / 32 * n.div_ceil(16)));
    let (mut all, mut values) = (std::mem::take(&mut w.region_scores), std::mem::take(&mut w.values));
    if let Keys::Regions(rs) = keys {
        let done =
            regions::scores_in::<regions_avx2::Kernel>(rs, q, n_q, grown(&mut all, n_q * n), &mut w.regions);
        debug_assert!(done, "`attend_int_regions_supported` checked the regions");
    }
    let codes: &[u8] = if v.bits == 4 {
        &[]
    } else {
        // SAFETY: AVX2 (this function's contract); `narrow_values` checked the rows.
        let (codes, width, _) =
            unsafe { regions_avx2::unpack(&mut values, &[KeyRegion { first: 0, keys: *v }]) };
        debug_assert!(width == v.dim, "a head_dim of 64, 128 or 256 needs no padding");
        codes
    };
    let done = regions::by_query_group(keys, &all, v, q, n_q, state, |keys, nq, q, m, l, o| {
        // SAFETY: the keys and values as this function's contract says (the group's scores
        // from them); `fused_groups` checked the value scales and the shapes.
        unsafe { by_group!(attend, nq, (keys, codes, v, q, m, l, o, w)) }
    });
    (w.region_scores, w.values) = (all, values);
    done
}

/// Whether [`crate::attend_int_regions_with`] has a fused AVX2 kernel for these key regions
/// (`-qa` keys) and values on this CPU: regions as the AVX2 region scores take them
/// (affine, per channel, 1 to 8 bits, multiples of 8 channels, head_dim 64, 128 or 256) with
/// the values [`attend_int_supported`] takes under INT4 keys per channel (INT4 affine, per
/// row or per group of 32 to 256 values, or of 1 to 3 bits per row; 1 to 256 rows), at least
/// one query row.
pub fn attend_int_regions_supported(regions: &[KeyRegion<'_>], v: &QuantBlock<'_>, n_q: usize) -> bool {
    regions::fused_values(v, n_q) && regions_avx2::supported(regions, v.rows, v.dim)
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
pub(crate) fn offset_dots<const NQ: usize>(q: &[f32], offset: &[f32]) -> [f32; int8::GROUP] {
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

/// The fused kernel for `NQ` query rows, the keys in one part or several (per channel), or
/// the group's scores of keys in channel regions; `codes` the rows of narrow values unpacked
/// (empty for INT4 values).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; [`crate::parts_supported`] with
/// [`attend_int_supported`]`(k, v, NQ)` for the parts of `keys` and `v`, or scores of `NQ`
/// rows of `v.rows` with values [`attend_int_regions_supported`] takes; narrow values'
/// `codes` hold `v.rows + 1` rows of `v.dim` codes (the last zero); every value scale of `v`
/// is `>= 0`; `q` and `o` hold `NQ · dim` values, `m` and `l` `NQ`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend<const NQ: usize>(
    keys: GroupKeys<'_>,
    codes: &[u8],
    v: &QuantBlock<'_>,
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
    w: &mut FusedScratch,
) {
    let (d, n) = (v.dim, v.rows);
    let FusedScratch { q8, arranged, dots, p, wb, acc, vt, pw, int8: scratch, scores, ahead, .. } = w;
    let parts = match keys {
        GroupKeys::Parts(parts) => parts,
        // 1-2. Keys in channel regions: the region scores kernel's scores, taken before.
        GroupKeys::Scores(_) => &[],
    };
    if let Some(k) = parts.first()
        && matches!(k.params, Params::PerChannel { .. })
    {
        // SAFETY: as this function's: the parts are 4-bit per channel with rows of d codes (a
        // multiple of 64), their rows n in all.
        unsafe { channel_scores::<NQ>(parts, q, n, grown(scores, NQ * n), q8, arranged, dots, ahead) };
    } else if let Some(k) = parts.first() {
        // 1-2. Keys per row or per group: the integer scores kernel's scores themselves (its
        //      per-group dots and epilogue), so the same bits as it gives.
        let done = avx2::scores_int8_in(k, q, NQ, grown(scores, NQ * n), scratch);
        debug_assert!(done, "`attend_int_supported` checked `int8_supported(k)`");
    }
    let scores: &[f32] = match keys {
        GroupKeys::Scores(s) => s,
        GroupKeys::Parts(_) => &scores[..NQ * n],
    };

    // 3. The scores' maxima with the running ones, the rescaling factors, the exponentials,
    //    their sums and the weights `p · scale` rounded to bytes (scale max / 255), zero from n
    //    to the stride. Every loop runs over the rows with the query rows inside, so that their
    //    chains overlap.
    let stride = n.next_multiple_of(8);
    let p = grown(p, NQ * stride);
    let mut mx = [_mm256_setzero_ps(); int8::GROUP];
    for i in 0..NQ {
        mx[i] = _mm256_set1_ps(m[i]);
    }
    for r in (0..stride).step_by(8) {
        let keep = lanes8(n - r);
        for (i, mx) in mx.iter_mut().enumerate().take(NQ) {
            // SAFETY: the lanes in `keep` lie inside row i of `scores` (n values); row i of
            // `p` holds `stride` values.
            unsafe {
                let s = _mm256_maskload_ps(scores.as_ptr().add(i * n + r), _mm256_castps_si256(keep));
                _mm256_storeu_ps(p.as_mut_ptr().add(i * stride + r), s);
                // NaN scores are skipped by the maximum (the second operand is returned).
                *mx = _mm256_blendv_ps(*mx, _mm256_max_ps(s, *mx), keep);
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
    let mut sums = [0f32; int8::GROUP];
    // Each query row's weight scale and what the offsets and the centre add, per value group
    // (values per row: one group of d channels).
    let (mut gsw, mut gadd) = ([[0f32; MAX_GROUPS]; int8::GROUP], [[0f32; MAX_GROUPS]; int8::GROUP]);
    let group = match v.params {
        Params::PerRow { scale: vs, offset: vo } => {
            let wb = grown(wb, NQ * stride);
            // SAFETY: as this function's; `p` and `wb` hold NQ rows of `stride`.
            let (sw, vadd) =
                unsafe { row_weights::<NQ>(v.bits, n, stride, vs, vo, &live, &top, p, wb, &mut sums) };
            for i in 0..NQ {
                (gsw[i][0], gadd[i][0]) = (sw[i], vadd[i]);
            }
            d
        }
        Params::PerGroup { group, scale: vs, offset: vo } => {
            let per = d / group;
            let wb = grown(wb, NQ * per * stride);
            let (vt, pw) = (grown(vt, 2 * per * stride), grown(pw, NQ * per * stride));
            // SAFETY: as this function's; `p` holds NQ rows of `stride` scores.
            unsafe { exponentials::<NQ>(n, stride, &live, &top, p, &mut sums) };
            // SAFETY: as this function's; the buffers are sized as `group_weights` asks.
            unsafe {
                group_weights::<NQ>(n, stride, group, d, vs, vo, &live, p, vt, pw, wb, &mut gsw, &mut gadd)
            };
            group
        }
        Params::PerChannel { .. } => unreachable!("checked"),
    };
    for i in 0..NQ {
        if live[i] {
            l[i] = l[i] * factor[i] + sums[i];
            m[i] = top[i];
        } else {
            factor[i] = 1.0;
        }
    }

    // 4. The integer sums of the centred value codes under the byte weights, and the epilogue:
    //    `o ← o · factor + (sw · sum + add)`, sw and add those of the channel's group.
    let acc = grown(acc, NQ * d);
    if v.bits == 4 {
        // SAFETY: `v` is 4-bit with rows of d / 2 bytes, d a multiple of 32 and n >= 1 rows;
        // `wb` holds NQ · (d / group) rows of `stride >= n` bytes, zero from n; `acc` NQ · d
        // values.
        unsafe { value_sums::<NQ>(v, wb, stride, group, acc, ahead) };
    } else {
        // Narrow values (per row), unpacked to a code a byte before the groups.
        // SAFETY: `codes` holds n + 1 rows of d codes below 2^bits (the last zero); `wb` NQ
        // rows of `stride >= n + 1` rounded to even bytes, zero from n; `acc` NQ · d values.
        unsafe {
            byte_value_sums::<NQ>(codes, n, d, crate::int_values::center(v.bits), wb, stride, acc, ahead)
        };
    }
    rescale_add::<NQ>(o, acc, d, group, &factor, &gsw, &gadd);
}

/// Steps 1-2 of [`attend`] for keys per channel, in one part or several: each part's query
/// rows times its channel scales, rounded to int8 and arranged as the scores kernel does, the
/// integer dots of its rows, and its scores (the scores kernel's epilogue) into `scores`
/// (`NQ` rows of `n`), the parts side by side.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every part is 4-bit per channel with rows of `d`
/// codes, `d` a multiple of 64 (`avx2::int8_supported`), their rows adding up to `n`; `q`
/// holds `NQ` rows of `d` values and `scores` `NQ · n`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn channel_scores<const NQ: usize>(
    parts: &[QuantBlock<'_>],
    q: &[f32],
    n: usize,
    scores: &mut [f32],
    q8: &mut Vec<i8>,
    arranged: &mut Vec<u8>,
    dots: &mut Vec<i32>,
    ahead: &mut Ahead,
) {
    let d = parts.first().map_or(0, |k| k.dim);
    let mut at = 0;
    for k in parts {
        let Params::PerChannel { scale: ks, offset: ko } = k.params else { unreachable!("checked") };
        let nk = k.rows;
        let mut sq = [0f32; int8::GROUP];
        // 1. The query rows times the channel scales, rounded to int8 and arranged as the
        //    scores kernel rounds and arranges them; what the keys' offsets add, `Σ q · offset`.
        // Written in full by the two calls (d is a multiple of 64), so only grown, never cleared.
        let (q8, arranged) = (grown(q8, NQ * d), grown(arranged, NQ * d));
        // SAFETY: AVX2 (this function's contract); q holds NQ rows of d (a multiple of 8) values.
        unsafe { avx2::round_queries_by::<NQ>(q, ks, q8, &mut sq) };
        // SAFETY: AVX2 (this function's contract).
        unsafe { avx2::arrange4_32(q8, arranged) };
        let kadd = match ko {
            Some(ko) => offset_dots::<NQ>(q, ko),
            None => [0.0; int8::GROUP],
        };

        // 2. The integer dots of every row of the part with the rounded query rows.
        let dots = grown(dots, NQ * nk);
        // SAFETY: `int8_supported(k)` (checked by the caller): 4-bit rows of d codes, d a
        // multiple of 64; `arranged` holds NQ rows of d bytes, `dots` NQ · nk values.
        unsafe { avx2::int_dots_4bit::<NQ>(k, arranged, dots, ahead) };
        // The part's scores (the scores kernel's epilogue), the parts side by side.
        for i in 0..NQ {
            let row = &mut scores[i * n + at..i * n + at + nk];
            for (x, &dot) in row.iter_mut().zip(&dots[i * nk..(i + 1) * nk]) {
                *x = sq[i] * dot as f32 + kadd[i];
            }
        }
        at += nk;
    }
}

/// The epilogue of [`attend`]: `o ← o · factor + (sw · acc + add)` for each of the `NQ` query
/// rows of `d` values, `sw` and `add` those of each channel's group (values per row: one
/// group of `d` channels).
#[target_feature(enable = "avx2,fma,f16c")]
fn rescale_add<const NQ: usize>(
    o: &mut [f32],
    acc: &[i32],
    d: usize,
    group: usize,
    factor: &[f32; 8],
    gsw: &[[f32; MAX_GROUPS]; int8::GROUP],
    gadd: &[[f32; MAX_GROUPS]; int8::GROUP],
) {
    assert!(
        o.len() >= NQ * d
            && acc.len() >= NQ * d
            && group > 0
            && group.is_multiple_of(8)
            && d.is_multiple_of(group)
            && d / group <= MAX_GROUPS,
        "shapes"
    );
    for i in 0..NQ {
        let f = _mm256_set1_ps(factor[i]);
        // Group by group (values per row: one group of d channels).
        for (g, start) in (0..d).step_by(group).enumerate() {
            let (s, a) = (_mm256_set1_ps(gsw[i][g]), _mm256_set1_ps(gadd[i][g]));
            for c in (start..start + group).step_by(8) {
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
}

/// The exponentials `e^(s − top)` of the scores in `p` (in place, zero from n to the stride)
/// and their sums, for the rows that saw something (`live`).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `p` holds `NQ` rows of `stride >= n`, a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn exponentials<const NQ: usize>(
    n: usize,
    stride: usize,
    live: &[bool; int8::GROUP],
    top: &[f32; int8::GROUP],
    p: &mut [f32],
    sums: &mut [f32; int8::GROUP],
) {
    assert!(p.len() >= NQ * stride && stride >= n && stride.is_multiple_of(8));
    let mut sum = [_mm256_setzero_ps(); int8::GROUP];
    for r in (0..stride).step_by(8) {
        let keep = lanes8(n - r);
        for i in (0..NQ).filter(|&i| live[i]) {
            // SAFETY: r + 8 <= stride: inside row i of `p`.
            unsafe {
                let at = p.as_mut_ptr().add(i * stride + r);
                let e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(at), _mm256_set1_ps(top[i]))), keep);
                sum[i] = _mm256_add_ps(sum[i], e);
                _mm256_storeu_ps(at, e);
            }
        }
    }
    for i in (0..NQ).filter(|&i| live[i]) {
        sums[i] = hsum8(sum[i]);
    }
}

/// The values' weights of a block per row: the exponentials `e^(s − top)` of the scores in
/// `p` and their sums (into `sums`), in the same pass the weights `p · scale` (into `p`),
/// rounded to bytes in `wb` with one scale per query row (max / 255), zero from n to the
/// stride and for rows that saw nothing; returns each row's weight scale and
/// `Σ p · offset + z · Σ w` (`z` the centre of `bits`-wide codes).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `p` and `wb` hold `NQ` rows of `stride >= n` (a multiple
/// of 8), `p` the scores; `vs` and `vo` hold n values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn row_weights<const NQ: usize>(
    bits: u8,
    n: usize,
    stride: usize,
    vs: &[f32],
    vo: Option<&[f32]>,
    live: &[bool; int8::GROUP],
    top: &[f32; int8::GROUP],
    p: &mut [f32],
    wb: &mut [u8],
    sums: &mut [f32; int8::GROUP],
) -> ([f32; 4], [f32; int8::GROUP]) {
    assert!(
        vs.len() >= n && vo.is_none_or(|o| o.len() >= n) && p.len() >= NQ * stride && wb.len() >= NQ * stride
    );
    let z = _mm256_set1_ps(f32::from(crate::int_values::center(bits)));
    let zero = _mm256_setzero_ps();
    let (mut add, mut wmx, mut any) = ([zero; int8::GROUP], [zero; int8::GROUP], [zero; int8::GROUP]);
    let mut sum = [zero; int8::GROUP];
    let mv: [__m256; int8::GROUP] = std::array::from_fn(|i| _mm256_set1_ps(top[i]));
    for r in (0..stride).step_by(8) {
        let keep = lanes8(n - r);
        let km = _mm256_castps_si256(keep);
        // SAFETY: the lanes in `km` lie inside the value scales and offsets (n of each).
        let (vsr, vor) = unsafe {
            // A `match`, not `Option::map`: the intrinsic stays in this function's AVX2 code.
            #[allow(clippy::manual_map)]
            let vor = match vo {
                Some(vo) => Some(_mm256_maskload_ps(vo.as_ptr().add(r), km)),
                None => None,
            };
            (_mm256_maskload_ps(vs.as_ptr().add(r), km), vor)
        };
        for i in (0..NQ).filter(|&i| live[i]) {
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
    for i in (0..NQ).filter(|&i| live[i]) {
        sums[i] = hsum8(sum[i]);
        vadd[i] = hsum8(add[i]);
        wmax[i] = hmax8(wmx[i]);
        wnan[i] = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(any[i], any[i])) != 0;
    }
    let (sw, winv) = crate::int8::scales_of4(wmax, wnan, 255.0);
    for i in 0..NQ {
        let row = &mut wb[i * stride..(i + 1) * stride];
        if live[i] {
            // SAFETY: row i of `p` holds `stride` weights (zero past n), `row` stride bytes.
            unsafe { to_bytes(&p[i * stride..(i + 1) * stride], winv[i], row) };
        } else {
            // A row that saw nothing gets zero weights (its `p` holds scores, not weights).
            row.fill(0);
        }
    }
    (sw, vadd)
}

/// [`row_weights`] for values per group of `group` channels: each (query row, group)'s
/// weights `p · scale` rounded to bytes with their own scale, in row `i · (d / group) + g` of
/// `wb` (`pw` the float weights, `vt` the parameters by group); each one's scale and
/// `Σ p · offset + z · Σ w` in `gsw` and `gadd`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `p` holds `NQ` rows of `stride >= n` (a multiple of 8)
/// exponentials, zero past n; `vs` and `vo` `n · d / group` values; `vt` `2 · d / group`
/// rows of `stride`, `pw` and `wb` `NQ · d / group`; `d / group <= MAX_GROUPS`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn group_weights<const NQ: usize>(
    n: usize,
    stride: usize,
    group: usize,
    d: usize,
    vs: &[f32],
    vo: Option<&[f32]>,
    live: &[bool; int8::GROUP],
    p: &[f32],
    vt: &mut [f32],
    pw: &mut [f32],
    wb: &mut [u8],
    gsw: &mut [[f32; MAX_GROUPS]; int8::GROUP],
    gadd: &mut [[f32; MAX_GROUPS]; int8::GROUP],
) {
    let per = d / group;
    assert!(per <= MAX_GROUPS && vs.len() >= n * per && vo.is_none_or(|o| o.len() >= n * per));
    assert!(p.len() >= NQ * stride && vt.len() >= 2 * per * stride && pw.len() >= NQ * per * stride);
    assert!(wb.len() >= NQ * per * stride && stride >= n && stride.is_multiple_of(8));
    // The parameters by group, rows along, zero past n.
    for g in 0..per {
        for r in 0..stride {
            let at = r.min(n - 1) * per + g;
            vt[g * stride + r] = if r < n { vs[at] } else { 0.0 };
            vt[(per + g) * stride + r] = match vo {
                Some(vo) if r < n => vo[at],
                _ => 0.0,
            };
        }
    }
    let z = _mm256_set1_ps(f32::from(crate::int_values::center(4)));
    let zero = _mm256_setzero_ps();
    for g in 0..per {
        let (mut add, mut wmx, mut any) = ([zero; int8::GROUP], [zero; int8::GROUP], [zero; int8::GROUP]);
        for r in (0..stride).step_by(8) {
            // SAFETY: r + 8 <= stride: inside the group's rows of `vt`.
            let (sv, ov) = unsafe {
                (
                    _mm256_loadu_ps(vt.as_ptr().add(g * stride + r)),
                    _mm256_loadu_ps(vt.as_ptr().add((per + g) * stride + r)),
                )
            };
            for i in (0..NQ).filter(|&i| live[i]) {
                // SAFETY: r + 8 <= stride: inside row i of `p` and row i · per + g of `pw`.
                unsafe {
                    let e = _mm256_loadu_ps(p.as_ptr().add(i * stride + r));
                    let wv = _mm256_mul_ps(e, sv);
                    add[i] = _mm256_fmadd_ps(z, wv, add[i]);
                    if vo.is_some() {
                        add[i] = _mm256_fmadd_ps(e, ov, add[i]);
                    }
                    wmx[i] = _mm256_max_ps(wv, wmx[i]);
                    any[i] = _mm256_add_ps(any[i], wv);
                    _mm256_storeu_ps(pw.as_mut_ptr().add((i * per + g) * stride + r), wv);
                }
            }
        }
        let (mut wmax, mut wnan) = ([0f32; 4], [false; 4]);
        for i in (0..NQ).filter(|&i| live[i]) {
            gadd[i][g] = hsum8(add[i]);
            wmax[i] = hmax8(wmx[i]);
            wnan[i] = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(any[i], any[i])) != 0;
        }
        let (sw, winv) = crate::int8::scales_of4(wmax, wnan, 255.0);
        for i in 0..NQ {
            gsw[i][g] = sw[i];
            let row = &mut wb[(i * per + g) * stride..(i * per + g + 1) * stride];
            if live[i] {
                let at = (i * per + g) * stride;
                // SAFETY: row i · per + g of `pw` holds `stride` weights (zero past n).
                unsafe { to_bytes(&pw[at..at + stride], winv[i], row) };
            } else {
                row.fill(0);
            }
        }
    }
}

/// `w · inv` rounded (to nearest, ties to even, as the reference's `int8::MAGIC` addition) to
/// bytes, at most 255, 8 at a time.
///
/// # Safety
/// The CPU must support AVX2; `w` and `out` hold the same multiple of 8 values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn to_bytes(w: &[f32], inv: f32, out: &mut [u8]) {
    assert!(w.len() == out.len() && w.len().is_multiple_of(8));
    let (hi, order) = (_mm256_set1_ps(255.0), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    let inv = _mm256_set1_ps(inv);
    for r in (0..w.len()).step_by(8) {
        // SAFETY: r + 8 <= len: inside `w` and `out`.
        unsafe {
            let y = _mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(w.as_ptr().add(r)), inv), hi);
            let code = _mm256_cvtps_epi32(y);
            // Eight i32 in 0..=255 to bytes: two saturating packs (per 128-bit lane), then the
            // two lanes' first four bytes side by side.
            let b = _mm256_packus_epi16(_mm256_packus_epi32(code, code), _mm256_setzero_si256());
            let b = _mm256_permutevar8x32_epi32(b, order);
            _mm_storel_epi64(out.as_mut_ptr().add(r).cast(), _mm256_castsi256_si128(b));
        }
    }
}

/// `acc[i · d + c] = Σ_r wb[(i · d / group + c / group) · stride + r] · (code[r][c] − 8)` for
/// every row of the 4-bit block `v` and `NQ` rows of byte weights per group of `group`
/// channels (a multiple of 32; values per row: `d`), channels in natural order. Per 16-byte lane of the rows
/// (low nibbles: 16 channels, high nibbles: the next 16) and pair of rows: the two rows' bytes
/// interleaved in one register (each lane broadcast to both halves, two in-lane `vpshufb`),
/// nibbles split and centred, then per query one `vpmaddubsw` per nibble plane against the
/// pair's two weights broadcast; the i16 sums are widened into `acc` every eight pairs. An odd
/// last row is paired with itself under a zero weight.
///
/// `ahead` is stepped at each batch of sixteen rows of a 32-channel lane.
///
/// # Safety
/// The CPU must support AVX2; `v.bits == 4`, `v.dim` a multiple of 32, `v.rows >= 1`; each of
/// the `NQ · dim / group` rows of `wb` holds `stride > v.rows` rounded down to even bytes, zero
/// from `v.rows`; `acc` holds `NQ · v.dim` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_sums<const NQ: usize>(
    v: &QuantBlock<'_>,
    wb: &[u8],
    stride: usize,
    group: usize,
    acc: &mut [i32],
    ahead: &mut Ahead,
) {
    let (d, n, rb) = (v.dim, v.rows, v.row_bytes);
    let per = d / group;
    assert!(group.is_multiple_of(32) && d.is_multiple_of(group));
    assert!(wb.len() >= NQ * per * stride && stride >= n.next_multiple_of(2) && acc.len() >= NQ * d);
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
        // The lane's 32 channels lie in one group: its weight rows.
        let g = 32 * lane / group;
        // Sixteen rows (eight pairs) at a time, then the widening into `acc`: the first batch
        // writes it, later ones add.
        for batch in 0..n.div_ceil(16) {
            ahead.step();
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
                    // SAFETY: bytes r and r + 1 of weight row i · per + g lie inside it (r + 1 <
                    // stride), inside `wb` (asserted above).
                    let pair =
                        unsafe { weights.add((i * per + g) * stride + r).cast::<i16>().read_unaligned() };
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

/// [`value_sums`] for values unpacked to a code a byte (values of 1 to 3 bits, per row):
/// `acc[i · d + c] = Σ_r wb[i · stride + r] · (codes[r · d + c] − centre)`. Per 32 channels
/// and pair of rows: the two rows' bytes interleaved (`vpunpcklbw`/`vpunpckhbw`: channels
/// `0..8 | 16..24` and `8..16 | 24..32`), centred, then per query one `vpmaddubsw` per half
/// against the pair's two weights broadcast; i16 sums of sixteen rows (at most `16 · 255 · 4`)
/// widened into `acc`. An odd last row pairs with the zero row after it under a zero weight.
///
/// `ahead` is stepped at each batch of sixteen rows of a 32-channel lane.
///
/// # Safety
/// The CPU must support AVX2; `codes` holds `n + 1` rows of `d` codes (a multiple of 32),
/// each below `2 · centre <= 8`; `wb` `NQ` rows of `stride >= n` rounded up to even bytes,
/// zero from n; `acc` `NQ · d` values.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn byte_value_sums<const NQ: usize>(
    codes: &[u8],
    n: usize,
    d: usize,
    centre: u8,
    wb: &[u8],
    stride: usize,
    acc: &mut [i32],
    ahead: &mut Ahead,
) {
    assert!(d.is_multiple_of(32) && codes.len() >= (n + 1) * d && centre <= 4);
    assert!(wb.len() >= NQ * stride && stride >= n.next_multiple_of(2) && acc.len() >= NQ * d);
    let (u, weights) = (codes.as_ptr(), wb.as_ptr());
    let z = _mm256_set1_epi8(centre as i8);
    for lane in 0..d / 32 {
        for batch in 0..n.div_ceil(16) {
            ahead.step();
            let mut s = [[_mm256_setzero_si256(); 2]; int8::GROUP];
            let (mut r, end) = (16 * batch, (16 * batch + 16).min(n));
            while r < end {
                // SAFETY: rows r and r + 1 <= n of `codes` hold d bytes each; lane `lane` of
                // them lies inside.
                let (a, b) = unsafe {
                    (
                        _mm256_loadu_si256(u.add(r * d + 32 * lane).cast()),
                        _mm256_loadu_si256(u.add((r + 1) * d + 32 * lane).cast()),
                    )
                };
                let halves = [
                    _mm256_sub_epi8(_mm256_unpacklo_epi8(a, b), z),
                    _mm256_sub_epi8(_mm256_unpackhi_epi8(a, b), z),
                ];
                for (i, s) in s.iter_mut().enumerate().take(NQ) {
                    // SAFETY: bytes r and r + 1 of weight row i lie inside it (r + 1 < stride).
                    let pair = unsafe { weights.add(i * stride + r).cast::<i16>().read_unaligned() };
                    let wv = _mm256_set1_epi16(pair);
                    s[0] = _mm256_add_epi16(s[0], _mm256_maddubs_epi16(wv, halves[0]));
                    s[1] = _mm256_add_epi16(s[1], _mm256_maddubs_epi16(wv, halves[1]));
                }
                r += 2;
            }
            for (i, s) in s.iter().enumerate().take(NQ) {
                // Half h's i16 lanes are channels 8h + 0..8 (low) and 16 + 8h + 0..8 (high).
                for (h, x) in s.iter().enumerate() {
                    let lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(*x));
                    let hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(*x));
                    for (part, at) in [(lo, i * d + 32 * lane + 8 * h), (hi, i * d + 32 * lane + 16 + 8 * h)]
                    {
                        // SAFETY: at + 8 <= NQ · d, inside `acc`.
                        unsafe {
                            let p = acc.as_mut_ptr().add(at);
                            let old = if batch == 0 {
                                _mm256_setzero_si256()
                            } else {
                                _mm256_loadu_si256(p.cast())
                            };
                            _mm256_storeu_si256(p.cast(), _mm256_add_epi32(old, part));
                        }
                    }
                }
            }
        }
    }
}
