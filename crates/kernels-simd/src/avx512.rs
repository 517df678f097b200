//! x86-64 AVX-512 VNNI integer score kernels, chosen at run time: `vpdpbusd` multiplies 64
//! unsigned codes by 64 signed query bytes and adds each group of four products into an i32
//! lane in one instruction, where AVX2 needs `vpmaddubsw`, `vpmaddwd` and an add for 32. One
//! 64-byte load holds a whole 128-value INT4 row.
//!
//! Covered: affine 4-bit rows of a multiple of 128 codes and 8-bit rows of a multiple of 64
//! (u8 codes × i8 query directly: no widening and no shift), and rows of the other widths
//! (1 to 7 bits: INT2, INT3) of a multiple of 128 codes, unpacked 64 at a time in order
//! (`codes64`). Other blocks run the AVX2 integer kernel. The query rounding, the epilogue and so the scores are those of every
//! other integer kernel (the crate's shared `int8` algebra), bit for bit.
//!
//! `attend_int_in` fuses one block of KIVI-style INT4 keys and values (scores, the online
//! softmax step, value sums) for decode's integer path; it follows the same algebra with
//! float sums in other orders, so it matches `scalar::attend_int` to rounding. It also takes
//! INT4 values per group (`int4-g32`, which `kvq recommend` picks for most layers), byte
//! weights rounded per query row and group, each 16-byte lane of a `vpdpbusd` operand (32
//! channels) carrying its group's; four groups of a row (32 of 128) take their weights in the
//! parameters' own layout, 4 rows × 4 groups a register. And INT4 keys per token (`int4-g32`,
//! `int4-token`: parameters per row or per group): the sums of four rows reduced 16-byte lane
//! by lane give 4 rows × 4 runs of 32 channels (at head_dim 64, 8 rows × 2 runs), each run
//! inside one group, scaled by their group's parameters in the same register.
//!
//! The float kernels of the `avx512` backend are the AVX2 ones: on the AMD Zen 4 this crate
//! is measured on, 512-bit float FMAs run as two 256-bit halves, and the float kernels are
//! bound by code unpacking, not by vector width.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::avx2::{by_block_avx2, store_dots};
use crate::block::{Levels, Params, QuantBlock};
use crate::prefetch::Ahead;
use crate::regions::Keys;
use crate::{int_values, int8};

fn cpu_ok() -> bool {
    crate::dispatch::cpu().vnni
}

/// [`cpu_ok`] with VBMI.
fn vbmi_ok() -> bool {
    crate::dispatch::cpu().vbmi && cpu_ok()
}

/// Whether [`scores_int8`] has a VNNI kernel for this block on this CPU: affine codes per row
/// or per channel, 4-bit rows of a multiple of 128 codes, 8-bit rows of a multiple of 64, and
/// rows of the other widths (1 to 7 bits: INT2, INT3) of a multiple of 128 (`vdots_planes`);
/// 4-bit rows of 16-level tables or symmetric levels (`nf4`, `sym4`) per row or per channel,
/// their codes looked up in the table's int8 levels (`vdots_table`).
pub fn int8_supported(b: &QuantBlock<'_>) -> bool {
    let ok_dim = match b.bits {
        4 => b.dim.is_multiple_of(128),
        8 => b.dim.is_multiple_of(64),
        1..=7 => b.dim.is_multiple_of(128),
        _ => false,
    };
    // 16-level tables and symmetric levels: 4-bit codes looked up in their int8 levels.
    let ok_levels = matches!(b.levels, Levels::Affine) || (b.bits == 4 && int8::has_table8(b));
    ok_dim && b.dim > 0 && ok_levels && crate::scalar::integer_params(b) && cpu_ok()
}

/// The 64 codes `64v .. 64v + 64` of a packed row of any width but 4 and 8 bits and a
/// multiple of 128 codes (docs/formats.md, "Codes: bit planes"), one per byte, in order. Over
/// whole chunks of each plane (16 bytes: `16 · 8 / w` codes of `w` bits, byte `j` holding code
/// `j + 16k` in bits `k·w`), the 16 codes `64v + 16λ ..` lie in one 16-byte lane of the plane
/// and one field: lane `v` field `λ` of a 2-bit plane, lane `v / 2` field `4(v % 2) + λ` of a
/// 1-bit one, lanes `2v + λ / 2` field `λ % 2` of a 4-bit one. So each plane gives its bits
/// of all 64 codes in a few instructions (its lane or lanes broadcast, each 16-byte lane
/// shifted by its field with `vpsrlvw`, masked), and the planes or together into the codes.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL; `row` is a whole packed row of `bits`-bit codes
/// (1 to 7) of `64 · (v + 1)` codes or more, a multiple of 128.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn codes64(row: &[u8], d: usize, bits: u8, v: usize) -> __m512i {
    // Each 16-byte lane's field shift: `f(lane)` in each of its eight 16-bit counts.
    let counts = |f: fn(i64) -> i64| {
        let x = |l| f(l) * 0x0001_0001_0001_0001;
        _mm512_set_epi64(x(3), x(3), x(2), x(2), x(1), x(1), x(0), x(0))
    };
    let (mut codes, mut at, mut shift) = (_mm512_setzero_si512(), 0usize, 0u32);
    for &w in kvq_quant_core::pack::planes(bits) {
        let plane = row.as_ptr().wrapping_add(at);
        // SAFETY: every lane read lies inside the plane (`d · w / 8` bytes from `at`, whole
        // 16-byte lanes since d is a multiple of 128).
        let bits_of = unsafe {
            match w {
                1 => {
                    let x = _mm512_broadcast_i32x4(_mm_loadu_si128(plane.add(16 * (v / 2)).cast()));
                    let c = if v.is_multiple_of(2) { counts(|l| l) } else { counts(|l| 4 + l) };
                    _mm512_and_si512(_mm512_srlv_epi16(x, c), _mm512_set1_epi8(0x01))
                }
                2 => {
                    let x = _mm512_broadcast_i32x4(_mm_loadu_si128(plane.add(16 * v).cast()));
                    _mm512_and_si512(_mm512_srlv_epi16(x, counts(|l| 2 * l)), _mm512_set1_epi8(0x03))
                }
                _ => {
                    let x = _mm512_zextsi256_si512(_mm256_loadu_si256(plane.add(32 * v).cast()));
                    let x = _mm512_shuffle_i64x2::<0b01_01_00_00>(x, x);
                    _mm512_and_si512(_mm512_srlv_epi16(x, counts(|l| 4 * (l % 2))), _mm512_set1_epi8(0x0f))
                }
            }
        };
        // The plane's bits under those of the planes before (w + shift <= 8: no bit leaves its
        // byte).
        codes = _mm512_or_si512(codes, _mm512_sll_epi16(bits_of, _mm_cvtsi32_si128(shift as i32)));
        at += d * usize::from(w) / 8;
        shift += u32::from(w);
    }
    codes
}

/// [`vdots`] for rows of 1 to 7 bits (not 4) and a multiple of 128 codes: each 64 codes
/// unpacked in order ([`codes64`]) against the query in natural order, `4 / NQ` rows a
/// reduction.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI; `b.bits` is 1 to 7 and `b.dim` a multiple
/// of 128; `q` holds `NQ` rows of `b.dim` bytes in natural order; `dots` `NQ · rows.len()`
/// values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn vdots_planes<const NQ: usize>(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], dots: &mut [i32]) {
    let (d, m, rr) = (b.dim, rows.len(), 4 / NQ);
    let held = b.rows.checked_mul(b.row_bytes).is_some_and(|n| n <= b.codes.len());
    assert!(
        rows.end <= b.rows
            && held
            && (1..=7).contains(&b.bits)
            && d.is_multiple_of(128)
            && b.row_bytes == d * usize::from(b.bits) / 8
            && q.len() >= NQ * d
            && dots.len() >= NQ * m,
        "whole rows of whole chunks inside the block, the queries and the dots"
    );
    let mut r = 0;
    while r < m {
        let step = if r + rr <= m { rr } else { 1 };
        let mut acc = [_mm512_setzero_si512(); 4];
        for j in 0..step {
            let row = b.row(rows.start + r + j);
            for v in 0..d / 64 {
                // SAFETY: the row is whole (asserted above), 64 · (v + 1) <= d.
                let codes = unsafe { codes64(row, d, b.bits, v) };
                for (i, a) in acc[j * NQ..(j + 1) * NQ].iter_mut().enumerate() {
                    // SAFETY: 64 · v + 64 <= d, inside query row i.
                    let qv = unsafe { _mm512_loadu_si512(q.as_ptr().add(i * d + 64 * v).cast()) };
                    *a = _mm512_dpbusd_epi32(*a, codes, qv);
                }
            }
        }
        // SAFETY: AVX-512 is enabled; r + step <= m and `dots` holds NQ · m values.
        unsafe { store_dots::<NQ>(hsum4_zmm(&acc), step, r, m, dots) };
        r += step;
    }
}

struct Vnni;

impl int8::IntKernel for Vnni {
    fn round_query(q: &[f32], out: &mut Vec<i8>) -> f32 {
        // SAFETY: this kernel is only used by `scores_int8` after `int8_supported` checked
        // AVX2 (with AVX-512).
        unsafe { crate::avx2::round_query(q, out) }
    }

    fn round_query_scaled(q: &[f32], scale: &[f32], _: &mut Vec<f32>, out: &mut Vec<i8>) -> f32 {
        // SAFETY: as above.
        unsafe { crate::avx2::round_query_by::<true>(q, scale, out) }
    }

    fn round_queries_scaled(
        q: &[f32],
        scale: &[f32],
        qw: &mut Vec<f32>,
        out: &mut Vec<i8>,
        scales: &mut [f32],
    ) {
        <crate::avx2::Avx2Int as int8::IntKernel>::round_queries_scaled(q, scale, qw, out, scales)
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        <crate::avx2::Avx2Int as int8::IntKernel>::dot(a, b)
    }

    fn sum(a: &[f32]) -> f32 {
        <crate::avx2::Avx2Int as int8::IntKernel>::sum(a)
    }

    fn arrange(b: &QuantBlock<'_>, q8: &[i8], out: &mut Vec<u8>) {
        if b.bits == 4 { int8::arrange4(q8, 64, out) } else { int8::arrange_natural(q8, out) }
    }

    fn dots(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], n: usize, dots: &mut [i32]) {
        // SAFETY: `int8_supported(b)` (checked by `scores_int8`, the only caller) covers the
        // CPU, the bit width and the row length; the driver passes n arranged rows of `dim`
        // bytes and n · rows.len() dots.
        unsafe {
            match (b.bits, int8::table8(b)) {
                (4, Some((t, _))) => by_group!(vdots_table, n, (b, rows, q, &t, dots)),
                (4 | 8, _) => by_4_or_8_and_group!(vdots, b.bits, n, (b, rows, q, dots)),
                _ => by_group!(vdots_planes, n, (b, rows, q, dots)),
            }
        }
    }
}

/// Adds the integer dots of `NQ` arranged query rows with one row of codes into `acc[..NQ]`,
/// 64 code bytes at a time: 4-bit codes as two planes of nibbles (queries arranged by
/// [`int8::arrange4`] with 64-byte chunks), 8-bit codes as they are. One accumulator per
/// query: the chains are a row long, and the rows of a step are independent. `TABLE` (4-bit
/// codes): each nibble looked up in `tab` (a 16-byte table in every 128-bit lane) instead,
/// levels the caller biased to unsigned bytes.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `BITS` is the row's width, 4 or 8, the row
/// holds `d · BITS / 8` bytes with `d` a multiple of 128 or 64; `q` holds `NQ` rows of `d`
/// bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn vacc<const BITS: u8, const NQ: usize, const TABLE: bool>(
    row: &[u8],
    q: &[u8],
    d: usize,
    tab: __m512i,
    acc: &mut [__m512i],
) {
    let mask = _mm512_set1_epi8(0x0f);
    for (c, code) in row.chunks_exact(64).enumerate() {
        // SAFETY: `code` is 64 bytes; the query bytes of chunk c (128 for 4-bit codes, 64 for
        // 8-bit) lie inside query row i, q[i·d .. (i + 1)·d].
        unsafe {
            let v = _mm512_loadu_si512(code.as_ptr().cast());
            if BITS == 4 {
                let lo = _mm512_and_si512(v, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                let (lo, hi) = if TABLE {
                    (_mm512_shuffle_epi8(tab, lo), _mm512_shuffle_epi8(tab, hi))
                } else {
                    (lo, hi)
                };
                for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                    let p = q.as_ptr().add(i * d + 128 * c);
                    *a = _mm512_dpbusd_epi32(*a, lo, _mm512_loadu_si512(p.cast()));
                    *a = _mm512_dpbusd_epi32(*a, hi, _mm512_loadu_si512(p.add(64).cast()));
                }
            } else {
                for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                    let qv = _mm512_loadu_si512(q.as_ptr().add(i * d + 64 * c).cast());
                    *a = _mm512_dpbusd_epi32(*a, v, qv);
                }
            }
        }
    }
}

/// The sums of the 16 lanes of each of 4 accumulators: pairs interleaved and added (32-bit,
/// then 64-bit unpacks) so that every 128-bit lane holds partial sums of all four, then the
/// four 128-bit lanes added. Nine operations before the final folds, for four sums.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn hsum4_zmm(a: &[__m512i; 4]) -> [i32; 4] {
    let u = lane_sums4(a);
    let y = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64::<1>(u));
    let x = _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256::<1>(y));
    let mut out = [0i32; 4];
    // SAFETY: `out` holds 4 i32.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), x) };
    out
}

/// The permutation that takes element `4k + i` to `4i + k` (a 4 × 4 transpose of 32-bit
/// elements): four rows' results of four query rows, as [`lane_sums4`] leaves them, to each
/// query row's four in order.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn to_rows() -> __m512i {
    _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
}

/// The sums of each 128-bit lane of 4 accumulators: lane `L` of the result holds the sums of
/// lane `L` of `a[0]`, `a[1]`, `a[2]` and `a[3]`, in that order (element `4L + j` from
/// `a[j]`): pairs interleaved and added, 32-bit, then 64-bit unpacks. Callable without
/// `unsafe` from the kernels compiled with these features.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn lane_sums4(a: &[__m512i; 4]) -> __m512i {
    let t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    let t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1))
}

/// The dots of `STEP` rows from `rows.start + r` with `NQ` queries (`STEP · NQ ≤ 4`), reduced
/// together and stored.
///
/// # Safety
/// As [`vdots`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn vdot_step<const BITS: u8, const NQ: usize, const STEP: usize, const TABLE: bool>(
    b: &QuantBlock<'_>,
    rows: &Range<usize>,
    r: usize,
    q: &[u8],
    tab: __m512i,
    dots: &mut [i32],
) {
    let mut acc = [_mm512_setzero_si512(); 4];
    for j in 0..STEP {
        // SAFETY: row rows.start + r + j < rows.end, whose rows `vdots` checked lie in `b`.
        let (row, a) = (unsafe { b.row_unchecked(rows.start + r + j) }, &mut acc[j * NQ..(j + 1) * NQ]);
        // SAFETY: forwarded from the caller.
        unsafe { vacc::<BITS, NQ, TABLE>(row, q, b.dim, tab, a) };
    }
    // SAFETY: AVX-512 is enabled by this function's target features; r + STEP <= rows.len()
    // and `dots` holds NQ · rows.len() values (checked by `vdots`).
    unsafe { store_dots::<NQ>(hsum4_zmm(&acc), STEP, r, rows.len(), dots) };
}

/// Integer dots of `NQ` arranged query rows with rows `rows` of `b`, `4 / NQ` rows at a time
/// (one 4-way reduction for four (row, query) pairs), then single rows.
///
/// # Safety
/// As [`vacc`] for every row, with `BITS == b.bits`; `dots` holds `NQ · rows.len()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn vdots<const BITS: u8, const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    dots: &mut [i32],
) {
    // SAFETY: forwarded.
    unsafe {
        vdots_with::<BITS, NQ, false, false>(b, rows, q, _mm512_setzero_si512(), dots, &mut Ahead::default())
    }
}

/// [`vdots`] of a 4-bit block of 16 levels: `t` its int8 levels ([`int8::table8`]). The
/// levels biased by 128 are unsigned bytes, `vpdpbusd`'s unsigned operand; the bias's share,
/// `128 · Σ q`, is taken off each query row's dots after (exact integers).
///
/// # Safety
/// As [`vdots`], with `b.bits == 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn vdots_table<const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    t: &[i8; 16],
    dots: &mut [i32],
) {
    let (d, m) = (b.dim, rows.len());
    let biased: [u8; 16] = std::array::from_fn(|c| (i16::from(t[c]) + 128) as u8);
    // SAFETY: `biased` holds 16 bytes.
    let tab = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(biased.as_ptr().cast()) });
    // SAFETY: forwarded.
    unsafe { vdots_with::<4, NQ, true, false>(b, rows, q, tab, dots, &mut Ahead::default()) };
    for i in 0..NQ {
        let bias: i32 = 128 * q[i * d..(i + 1) * d].iter().map(|&x| i32::from(x as i8)).sum::<i32>();
        dots[i * m..(i + 1) * m].iter_mut().for_each(|x| *x -= bias);
    }
}

/// [`vdots`], with `TABLE` as [`vacc`]'s, stepping `ahead` every four rows when `STEP` (the
/// fused kernel's queue of the next unit's lines). The scores kernels, which have no queue,
/// pass `false` and compile without the check (a load and a compare every four rows: with
/// it, the INT4 scores of 4096 rows in cache took 6.8-7.4 µs against 6.1-6.7 without).
///
/// # Safety
/// As [`vdots`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn vdots_with<const BITS: u8, const NQ: usize, const TABLE: bool, const STEP: bool>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    tab: __m512i,
    dots: &mut [i32],
    ahead: &mut Ahead,
) {
    let (m, rr) = (rows.len(), 4 / NQ);
    // Once per call, so that the steps read rows and store dots without bounds checks.
    let held = b.rows.checked_mul(b.row_bytes).is_some_and(|n| n <= b.codes.len());
    assert!(rows.end <= b.rows && held && dots.len() >= NQ * m);
    // Blocks streamed from memory: each step's lines asked for `STREAM_AHEAD_FAR` bytes early.
    let far = crate::stream_prefetch(b.rows * b.row_bytes).map(|_| crate::STREAM_AHEAD_FAR);
    let first = b.codes.as_ptr().wrapping_add(rows.start * b.row_bytes);
    let mut r = 0;
    while r + rr <= m {
        if let Some(far) = far {
            crate::prefetch_far(first.wrapping_add(r * b.row_bytes + far), rr * b.row_bytes);
        }
        // rr is 4, 2 or 1: every four rows.
        if STEP && r.is_multiple_of(4) {
            ahead.step();
        }
        match NQ {
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            1 => unsafe { vdot_step::<BITS, NQ, 4, TABLE>(b, &rows, r, q, tab, dots) },
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            2 => unsafe { vdot_step::<BITS, NQ, 2, TABLE>(b, &rows, r, q, tab, dots) },
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            _ => unsafe { vdot_step::<BITS, NQ, 1, TABLE>(b, &rows, r, q, tab, dots) },
        }
        r += rr;
    }
    while r < m {
        // SAFETY: the CPU features and bounds are forwarded from the caller.
        unsafe { vdot_step::<BITS, NQ, 1, TABLE>(b, &rows, r, q, tab, dots) };
        r += 1;
    }
}

/// Scores through `vpdpbusd`; see [`crate::avx2::scores_int8_in`] for the algebra and the error
/// bound (the scores are the same, bit for bit). Returns `false`, computing nothing, when
/// [`int8_supported`] is false.
pub(crate) fn scores_int8_in(
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut int8::Scratch,
) -> bool {
    if !int8_supported(b) {
        return false;
    }
    // SAFETY: `int8_supported` checked AVX2 and FMA (with AVX-512).
    unsafe { by_block_avx2::<Vnni>(b, q, n_q, out, scratch) };
    true
}

/// Whether [`axpy_int`] has a VNNI kernel for this block on this CPU: affine 4-bit rows of a
/// multiple of 128 codes or 8-bit rows of a multiple of 64.
pub fn axpy_int_supported(b: &QuantBlock<'_>) -> bool {
    let ok_dim = match b.bits {
        4 => b.dim.is_multiple_of(128),
        8 => b.dim.is_multiple_of(64),
        _ => false,
    };
    ok_dim && matches!(b.levels, Levels::Affine) && crate::scalar::integer_params(b) && cpu_ok()
}

struct VnniAxpy;

impl int_values::IntAxpyKernel for VnniAxpy {
    fn sums(b: &QuantBlock<'_>, rows: Range<usize>, w: &[i16], n: usize, acc: &mut [i32]) {
        // SAFETY: `axpy_int_supported(b)` (checked by `axpy_int`, the only caller) covers the
        // CPU, the bit width and the row length; the driver passes n weight rows of
        // rows.len() and n · dim sums.
        let m = rows.len();
        // Weights of 4-bit blocks are rounded into −255..=255 (`int_values::weight_limit`); when none
        // is negative (probabilities times scales) they fit unsigned bytes.
        let bytes = b.bits == 4 && w[..n * m].iter().fold(true, |ok, &x| ok & (x as u16 <= 255));
        // SAFETY: as above; `bytes` checked every weight.
        unsafe {
            if bytes {
                match n {
                    1 => vsums_u8::<1>(b, rows, w, acc),
                    2 => vsums_u8::<2>(b, rows, w, acc),
                    3 => vsums_u8::<3>(b, rows, w, acc),
                    _ => vsums_u8::<4>(b, rows, w, acc),
                }
            } else {
                by_4_or_8_and_group!(vsums, b.bits, n, (b, rows, w, acc))
            }
        }
    }
}

/// Rows of weights packed per call of [`vsums_u8`]'s inner loop (on the stack).
const U8_ROWS: usize = 64;

/// [`vsums`] for 4-bit codes and weights in `0..=255`, four rows at a time through `vpdpbusd`
/// (unsigned bytes × signed bytes, four products into each i32 lane): the weights of rows
/// r..r + 4 as one broadcast dword of bytes, the nibbles of the four rows centred (−8..=7)
/// and interleaved byte by byte (`vpunpck{l,h}bw`) and then in pairs (`vpunpck{l,h}wd`), so
/// that each i32 lane holds one channel of the four rows. Half the multiply instructions of the i16 kernel and a third of
/// its shuffles.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `b.bits == 4` with `b.dim` a multiple of 128;
/// `w` holds `NQ` rows of `rows.len()` weights, each in `0..=255`; `acc` holds `NQ · b.dim`
/// values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn vsums_u8<const NQ: usize>(b: &QuantBlock<'_>, rows: Range<usize>, w: &[i16], acc: &mut [i32]) {
    let m = rows.len();
    if m == 0 {
        // No rows: the sums are written all the same (the driver reads every one).
        acc[..NQ * b.dim].fill(0);
        return;
    }
    let mut j0 = 0;
    while j0 < m {
        let len = (m - j0).min(U8_ROWS);
        // The weights of rows j0..j0 + len as bytes, zero past the end (rows padded to four).
        let mut wb = [0u8; 4 * U8_ROWS];
        for i in 0..NQ {
            for (x, &v) in wb[i * U8_ROWS..].iter_mut().zip(&w[i * m + j0..i * m + j0 + len]) {
                *x = v as u8;
            }
        }
        let at = rows.start + j0..rows.start + j0 + len;
        // SAFETY: forwarded from the caller; `wb` holds NQ rows of U8_ROWS bytes, zero past
        // `len`.
        unsafe { vsums_bytes::<NQ, false>(b, at, &wb, U8_ROWS, j0 > 0, &[], acc, &mut Ahead::default()) };
        j0 += len;
    }
}

/// The sums of [`vsums_u8`] from weights already bytes: query row `i`'s weight of row
/// `rows.start + j` is `wb[i · stride + j]`, and `wb` is zero from `rows.len()` to the next
/// multiple of 4 in each row. Adds to `acc` when `add`, writes it otherwise. With weights per
/// group (`GW`, values per group), the `vpdpbusd` operand of 64-byte chunk `c`, query row `i`
/// and rows `4t .. 4t + 4` is `wx[16 · ((c · NQ + i) · QUADS + t)..][..16]` (each 16-byte
/// lane, 32 channels of one group, with that group's four weights), and `wb` is not read.
///
/// # Safety
/// As [`vsums_u8`], `rows` not empty; `stride >= rows.len()` rounded up to a multiple of 4 and
/// `wb.len() >= NQ · stride`; with `GW`, `rows` starts at 0 and `wx` holds the operands of
/// every chunk, query row and quad of the rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn vsums_bytes<const NQ: usize, const GW: bool>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    wb: &[u8],
    stride: usize,
    add: bool,
    wx: &[i32],
    acc: &mut [i32],
    ahead: &mut Ahead,
) {
    let (d, len) = (b.dim, rows.len());
    let mask = _mm512_set1_epi8(0x0f);
    let centre = _mm512_set1_epi8(int_values::center(4) as i8);
    if GW {
        assert!(rows.start == 0 && wx.len() >= 16 * (d / 128 * NQ * QUADS) && len <= FUSED_ROWS);
    } else {
        assert!(stride >= len.next_multiple_of(4) && wb.len() >= NQ * stride);
    }
    assert!(len > 0 && acc.len() >= NQ * d);
    for c in 0..d / 128 {
        for plane in 0..2 {
            let mut sums = [[_mm512_setzero_si512(); 4]; NQ];
            let mut j = 0;
            while j < len {
                // Rows past the end repeat the last one, under zero weights.
                let row = |k: usize| rows.start + (j + k).min(len - 1);
                let nib = |k: usize| {
                    // SAFETY: chunk c (64 bytes) lies within each row (row_bytes = d / 2).
                    let v = unsafe { _mm512_loadu_si512(b.row(row(k)).as_ptr().add(64 * c).cast()) };
                    let v = if plane == 0 { v } else { _mm512_srli_epi16(v, 4) };
                    _mm512_sub_epi8(_mm512_and_si512(v, mask), centre)
                };
                // x[k]: in 16-byte lane L, channels 32L + 4k .. 32L + 4k + 4 of the plane,
                // one per i32 lane, bytes = rows j .. j + 4.
                let x = interleave4([nib(0), nib(1), nib(2), nib(3)]);
                ahead.step();
                for (i, s) in sums.iter_mut().enumerate() {
                    let wv = if GW {
                        // SAFETY: c < d / 128, i < NQ and j / 4 < QUADS (len <= FUSED_ROWS):
                        // inside `wx` (asserted above).
                        unsafe {
                            _mm512_loadu_si512(wx.as_ptr().add(16 * ((c * NQ + i) * QUADS + j / 4)).cast())
                        }
                    } else {
                        // SAFETY: j is a multiple of 4 below len, so i · stride + j + 4 <=
                        // NQ · stride <= wb.len() (asserted above).
                        let quad = unsafe { wb.as_ptr().add(i * stride + j).cast::<i32>().read_unaligned() };
                        _mm512_set1_epi32(quad)
                    };
                    for (s, &x) in s.iter_mut().zip(&x) {
                        *s = _mm512_dpbusd_epi32(*s, wv, x);
                    }
                }
                j += 4;
            }
            // sums[i][k] lane L holds channels 32L + 4k .. + 4: a 4 × 4 transpose of
            // 16-byte lanes makes lane L's 16 channels one vector.
            let base = 128 * c + 16 * plane;
            for (i, s) in sums.iter().enumerate() {
                let lanes = transpose_lanes(s);
                let out = &mut acc[i * d..(i + 1) * d];
                for (l, v) in lanes.into_iter().enumerate() {
                    let at = base + 32 * l;
                    // SAFETY: at + 16 <= d, inside query row i of `acc`. The first rows
                    // write the sums, later ones add to them.
                    unsafe {
                        let p = out.as_mut_ptr().add(at).cast();
                        let v = if add { _mm512_add_epi32(_mm512_loadu_si512(p), v) } else { v };
                        _mm512_storeu_si512(p, v);
                    }
                }
            }
        }
    }
}

/// `acc[i · dim + c] = Σ_r w_i[r] · (code[r][c] − 2^(BITS − 1))` for rows `rows` of `b`, two
/// rows at a time through `vpdpwssd` (i16 pairs): the codes of rows r and r + 1 interleaved
/// byte by byte (`vpunpcklbw` or `vpunpckhbw`), widened to i16 (`vpmovzxbw`) and centred make
/// one (row r, row r + 1) pair per 32-bit lane, and the weight pair `w[r] | w[r + 1] << 16` is broadcast. One 64-byte
/// chunk, nibble plane (4-bit codes; 8-bit codes have one) and unpack half at a time, so that
/// the sums (2 vectors of 16 channels per query) stay in registers.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `b.bits == BITS`, 4 with `b.dim` a multiple of
/// 128 or 8 with a multiple of 64;
/// `w` holds `NQ` rows of `rows.len()` weights; `acc` holds `NQ · b.dim` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn vsums<const BITS: u8, const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    w: &[i16],
    acc: &mut [i32],
) {
    let (d, m) = (b.dim, rows.len());
    let mask = _mm512_set1_epi8(0x0f);
    let z = _mm512_set1_epi16(i16::from(int_values::center(BITS)));
    // The weight pairs of an odd last row (paired with itself under a zero weight).
    let mut last = [0i32; NQ];
    if m % 2 == 1 {
        for (i, l) in last.iter_mut().enumerate() {
            *l = i32::from(w[i * m + m - 1]) & 0xffff;
        }
    }
    // Channels per 64-byte chunk, and nibble planes.
    let (per_chunk, planes) = if BITS == 4 { (128, 2) } else { (64, 1) };
    for c in 0..d / per_chunk {
        for pass in 0..2 * planes {
            let (plane, half) = (pass / 2, pass % 2);
            let mut sums = [[_mm512_setzero_si512(); 2]; NQ];
            let mut j = 0;
            while j < m {
                let (r, r1) = (rows.start + j, rows.start + (j + 1).min(m - 1));
                // SAFETY: chunk c (64 bytes) lies within each row (row_bytes = d · BITS / 8).
                let (v0, v1) = unsafe {
                    (
                        _mm512_loadu_si512(b.row(r).as_ptr().add(64 * c).cast()),
                        _mm512_loadu_si512(b.row(r1).as_ptr().add(64 * c).cast()),
                    )
                };
                let (p0, p1) = if BITS == 8 {
                    (v0, v1)
                } else if plane == 0 {
                    (_mm512_and_si512(v0, mask), _mm512_and_si512(v1, mask))
                } else {
                    (
                        _mm512_and_si512(_mm512_srli_epi16(v0, 4), mask),
                        _mm512_and_si512(_mm512_srli_epi16(v1, 4), mask),
                    )
                };
                let x = if half == 0 { _mm512_unpacklo_epi8(p0, p1) } else { _mm512_unpackhi_epi8(p0, p1) };
                let lo = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(x)), z);
                let hi = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(x)), z);
                for (i, s) in sums.iter_mut().enumerate() {
                    let pair = if j + 1 < m {
                        // SAFETY: weights j and j + 1 of query row i lie inside `w`; read as
                        // one little-endian i32 they are `w[j] | w[j + 1] << 16`.
                        unsafe { w.as_ptr().add(i * m + j).cast::<i32>().read_unaligned() }
                    } else {
                        last[i]
                    };
                    let wv = _mm512_set1_epi32(pair);
                    s[0] = _mm512_dpwssd_epi32(s[0], lo, wv);
                    s[1] = _mm512_dpwssd_epi32(s[1], hi, wv);
                }
                j += 2;
            }
            // Each 256-bit half of a sum holds 8 consecutive channels. Byte j of 16-byte lane k
            // of the chunk is channel 32k + j of the chunk (4-bit, low plane; the high plane
            // is 16 further on) or 16k + j (8-bit), and an unpack takes bytes 0..8 (low) or
            // 8..16 (high) of each lane: so with `base` the first channel of the chunk's plane
            // and half, `lo` holds lanes k = 0, 1 and `hi` lanes k = 2, 3.
            let lane = if BITS == 4 { 32 } else { 16 };
            let base = per_chunk * c + 16 * plane + 8 * half;
            for (i, s) in sums.iter().enumerate() {
                let row = &mut acc[i * d..(i + 1) * d];
                let parts = [
                    (base, _mm512_castsi512_si256(s[0])),
                    (base + lane, _mm512_extracti64x4_epi64::<1>(s[0])),
                    (base + 2 * lane, _mm512_castsi512_si256(s[1])),
                    (base + 3 * lane, _mm512_extracti64x4_epi64::<1>(s[1])),
                ];
                for (at, v) in parts {
                    // SAFETY: at + 8 <= d, inside query row i of `acc`.
                    unsafe { _mm256_storeu_si256(row.as_mut_ptr().add(at).cast(), v) };
                }
            }
        }
    }
}

/// Four vectors of bytes interleaved byte by byte, then in pairs: in each 16-byte lane,
/// `x[k]` holds bytes `4k .. 4k + 4` of the four inputs' lane, one i32 lane per byte position
/// with the four inputs' bytes in order (`vpunpck{l,h}bw`, then `vpunpck{l,h}wd`). Callable
/// without `unsafe` from the kernels compiled with these features.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn interleave4(p: [__m512i; 4]) -> [__m512i; 4] {
    let (a, b) = (_mm512_unpacklo_epi8(p[0], p[1]), _mm512_unpacklo_epi8(p[2], p[3]));
    let (a_h, b_h) = (_mm512_unpackhi_epi8(p[0], p[1]), _mm512_unpackhi_epi8(p[2], p[3]));
    [
        _mm512_unpacklo_epi16(a, b),
        _mm512_unpackhi_epi16(a, b),
        _mm512_unpacklo_epi16(a_h, b_h),
        _mm512_unpackhi_epi16(a_h, b_h),
    ]
}

/// Value accumulation with the weights rounded to integers: `vpdpbusd` with byte weights for
/// INT4 codes, `vpdpwssd` with i16 weights for INT8 codes and for INT4 blocks with a negative
/// weight (see the `int_values` module for the algebra and the error bound: each output within
/// `sw / 2 · Σ_r |level − centre|`, `sw` the largest `|p · scale|` of the block over 255 or
/// 32767). Equal, bit for bit, to
/// [`crate::scalar::axpy_int`]. Returns `false`, computing nothing, when
/// [`axpy_int_supported`] is false.
pub(crate) fn axpy_int_in(
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut int_values::Scratch,
) -> bool {
    if !axpy_int_supported(b) {
        return false;
    }
    // SAFETY: `axpy_int_supported` checked AVX2 and FMA (with AVX-512).
    unsafe { axpy_block_avx2::<VnniAxpy>(b, p, n_q, out, scratch) };
    true
}

/// [`int_values::axpy_by_block`] compiled with AVX2, as [`by_block_avx2`] (no float operation is
/// reordered or fused, so the outputs equal the baseline build's).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_block_avx2<K: int_values::IntAxpyKernel>(
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut int_values::Scratch,
) {
    int_values::axpy_by_block::<K>(b, p, n_q, out, scratch)
}

use crate::FUSED_ROWS;
/// Largest head_dim that [`attend_int_in`] takes.
const FUSED_DIM: usize = 256;

/// Whether [`crate::attend_int_with`] has a fused kernel for keys `k`, values `v` and `n_q` query rows on
/// this CPU: INT4 affine keys with per-channel parameters and INT4 affine values with per-row
/// parameters (KIVI-style), the same tokens (1 to 256) and head_dim (64, 128 or 256), any
/// number of query rows (four at a time); or such keys with INT4 affine values per group of
/// 32, 64, 128 or 256 values (dividing the head_dim); or INT4 affine keys per row or per
/// group of 32 to 256 values with either of those values; and, with VBMI, any of those keys
/// with INT1 to INT3 affine values per row (unpacked with VBMI); and affine keys per channel
/// of 1 to 8 bits as one region of [`attend_int_regions_supported`] (INT3 and INT2 keys).
pub fn attend_int_supported(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    crate::fused_int_layout(k, v, n_q, narrow_values, attend_int_regions_supported) && cpu_ok()
}

/// Values of 1 to 3 bits per code (`int3-token-mse-rot`, `int2-token`: the narrow values of
/// `kvq recommend`'s candidates), affine with per-row parameters, whole rows in the block;
/// the fused kernel unpacks them with VBMI ([`vsums_codes`]) and weighs them with bytes, as
/// the integer value path rounds weights for codes of up to 4 bits.
fn narrow_values(v: &QuantBlock<'_>) -> bool {
    (1..=3).contains(&v.bits)
        && matches!(v.levels, Levels::Affine)
        && matches!(v.params, Params::PerRow { .. })
        && v.row_bytes == v.dim * usize::from(v.bits) / 8
        && v.rows.checked_mul(v.row_bytes).is_some_and(|n| n <= v.codes.len())
        && vbmi_ok()
}

/// Most value groups of a row the fused kernel takes: groups of 32 along [`FUSED_DIM`].
const MAX_GROUPS: usize = FUSED_DIM / 32;

/// Row quads of a block's weight rows (4 rows' byte weights make one `vpdpbusd` operand).
const QUADS: usize = (FUSED_ROWS + 16) / 4;

/// Groups per quad in [`FusedScratch::wq`]: padded so that the 16 bytes of 4 groups' quads can
/// be loaded from any group.
const QUAD_GROUPS: usize = MAX_GROUPS + 4;

/// The buffers of [`attend_int_in`], grown once to the largest block it takes and then reused
/// (never cleared: the kernel writes what it reads).
#[derive(Default)]
pub(crate) struct FusedScratch {
    q8: Vec<u8>,
    /// The query rows times the channel scales, between the two passes of their rounding.
    qp: Vec<f32>,
    dots: Vec<i32>,
    wb: Vec<u8>,
    p: Vec<f32>,
    acc: Vec<i32>,
    /// Values per group: their scales and offsets by group (row `g` and `MAX_GROUPS + g`, rows
    /// along), the float weights of every (query row, group), the byte weights as quads
    /// (query row, quad, group), and each (chunk, query row, quad)'s `vpdpbusd` operand.
    vt: Vec<f32>,
    wg: Vec<f32>,
    wq: Vec<u32>,
    wx: Vec<i32>,
    /// How to unpack the rows of each layout of key regions met so far (`-qa` keys).
    plans: Vec<HeadPlan>,
    /// How to unpack rows of narrow values, per (head_dim, bits) met so far.
    vplans: Vec<HeadPlan>,
    /// The block's key regions' rows and narrow values' rows unpacked to a code a byte
    /// ([`unpack_rows`]), once per block for every query group.
    ub: Vec<u8>,
    vb: Vec<u8>,
    /// [`region_scores`]' lane scales of each (run, query row): 16 floats each.
    lsq: Vec<f32>,
    /// What a fused call asks for while it computes ([`crate::Scratch::prefetch_next`]): the
    /// row loops of the keys and the values each step it on.
    pub(crate) ahead: Ahead,
}

/// One block of keys and the block of values of the same tokens attended by `n_q` query rows
/// (`q`, `n_q × dim`, already scaled) in one call, the online softmax
/// `state` of the rows updated: the integer paths of [`scores_int8`] and [`axpy_int`] with the softmax
/// between them, every intermediate in registers or in `w`. The algebra is theirs (the
/// query rows times the channel scales rounded to int8, `vpdpbusd` dots, the weights
/// `p · scale` rounded to bytes, `vpdpbusd` sums of the centred codes); sums of floats are
/// taken in other orders and `exp` is the softmax module's polynomial, so the results are
/// those of [`crate::scalar::attend_int`] to rounding, not bit for bit. Returns `false`,
/// changing nothing, when [`attend_int_supported`] is false or a value scale is negative or
/// NaN (byte weights need `p · scale ≥ 0`).
pub(crate) fn attend_int_in(
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
    w: &mut FusedScratch,
) -> bool {
    if !attend_int_parts_supported(parts, v, n_q) {
        return false;
    }
    let k = &parts[0];
    if k.bits != 4 {
        // One block of keys per channel of another width: a region of the whole row, which
        // `attend_int_supported` checked as such.
        // SAFETY: that check is `attend_int_regions_supported` of this region.
        return unsafe { regions_run(&[crate::KeyRegion { first: 0, keys: *k }], v, q, n_q, state, w) };
    }
    grow(w);
    if v.bits != 4 {
        first_plan(&mut w.vplans, std::iter::once((v.dim, v.bits)));
    }
    let grouped_keys = matches!(k.params, Params::PerGroup { .. } | Params::PerRow { .. });
    // SAFETY: `parts_supported` checked the parts with `attend_int_supported`; grown above.
    unsafe { fused_run(Keys::Parts(parts), grouped_keys, v, q, n_q, state, w) }
}

/// Whether [`crate::attend_int_parts_with`] runs this kernel for keys in `parts` with the
/// values `v`: one part as [`attend_int_supported`] takes it; several (per-channel keys whose
/// parameters change every few rows) only of INT4 keys, the first with the values of its rows
/// as [`attend_int_supported`] takes it, the others in its layout, covering the values' rows.
pub fn attend_int_parts_supported(parts: &[QuantBlock<'_>], v: &QuantBlock<'_>, n_q: usize) -> bool {
    crate::parts_supported_int4(parts, v, |k, v| attend_int_supported(k, v, n_q))
}

/// The buffers of the fused kernel grown to the largest block it takes (once; never shrunk).
fn grow(w: &mut FusedScratch) {
    let g = int8::GROUP;
    if w.acc.len() < g * FUSED_DIM {
        w.q8.resize(g * FUSED_DIM, 0);
        w.qp.resize(g * FUSED_DIM, 0.0);
        w.dots.resize(g * FUSED_ROWS, 0);
        w.wb.resize(g * (FUSED_ROWS + 16), 0);
        w.p.resize(g * (FUSED_ROWS + 16).max(FUSED_DIM), 0.0);
        w.acc.resize(g * FUSED_DIM, 0);
        let pr = FUSED_ROWS + 16;
        w.vt.resize(2 * MAX_GROUPS * pr, 0.0);
        w.wg.resize(g * MAX_GROUPS * pr, 0.0);
        w.wq.resize(g * QUADS * QUAD_GROUPS, 0);
        w.wx.resize(FUSED_DIM / 128 * g * QUADS * 16, 0);
        w.ub.resize(UNPACKED, 0);
        w.vb.resize(UNPACKED, 0);
        w.lsq.resize(FUSED_DIM / 16 * g * 16, 0.0);
    }
}

/// Bytes of an unpacked block: [`FUSED_ROWS`] rows (and the zero rows up to a multiple of 8)
/// of up to [`FUSED_DIM`] codes.
const UNPACKED: usize = (FUSED_ROWS + 8) * FUSED_DIM;

/// Whether [`crate::attend_int_regions_with`] has a kernel for these key regions and values on this
/// CPU: regions of affine codes of 1 to 8 bits with per-channel parameters, a multiple of 8
/// channels each, at most 16 of them, tiling the row; values as [`attend_int_supported`]
/// takes them under INT4 keys (INT4 affine, per row or per group of 32 to 256 values,
/// head_dim 64, 128 or 256, 1 to 256 rows); at least one query row; AVX-512 VBMI besides
/// VNNI (`vpermb` and `vpmultishiftqb` unpack the codes).
pub fn attend_int_regions_supported(
    regions: &[crate::KeyRegion<'_>],
    v: &QuantBlock<'_>,
    n_q: usize,
) -> bool {
    let values_ok = (v.bits == 4
        && matches!(v.levels, Levels::Affine)
        && (matches!(v.params, Params::PerRow { .. }) || crate::lane_groups(v))
        || narrow_values(v))
        && (1..=FUSED_ROWS).contains(&v.rows);
    n_q >= 1 && values_ok && regions_supported(regions, v.rows, v.dim)
}

/// The keys' part of [`attend_int_regions_supported`]: `regions` of `rows` (1 to 256) rows
/// tile a row of `dim` channels (64, 128 or 256), each affine with per-channel parameters,
/// 1 to 8 bits and a multiple of 8 channels, at most 16 of them; the CPU has VBMI.
fn regions_supported(regions: &[crate::KeyRegion<'_>], rows: usize, dim: usize) -> bool {
    matches!(dim, 64 | 128 | 256)
        && (1..=FUSED_ROWS).contains(&rows)
        && regions.len() <= MAX_REGIONS
        && crate::regions_tile(regions, rows, dim)
        && regions.iter().all(crate::regions::region_codes_ok)
        && vbmi_ok()
}

/// The scores of [`crate::scores_int8_regions_with`] by the fused kernel's first steps
/// ([`region_scores`]), four query rows at a time. Returns `false`, computing nothing, where
/// the regions are not as [`attend_int_regions_supported`] takes them.
pub(crate) fn scores_int8_regions_in(
    regions: &[crate::KeyRegion<'_>],
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    w: &mut FusedScratch,
) -> bool {
    let d: usize = regions.iter().map(|r| r.keys.dim).sum();
    let n = regions.first().map_or(0, |r| r.keys.rows);
    if !regions_supported(regions, n, d) || q.len() != n_q * d || out.len() < n_q * n {
        return false;
    }
    grow(w);
    plan_first(regions, w);
    let pr = FUSED_ROWS + 16;
    let FusedScratch { q8, qp, p, plans, ub, lsq, ahead, .. } = w;
    // SAFETY: `regions_supported` checked the CPU and the regions; `ub` is grown above; the
    // plan is the regions'.
    unsafe { unpack_regions::<true>(regions, &plans[0], ub) };
    let mut i0 = 0;
    while i0 < n_q {
        let nq = (n_q - i0).min(int8::GROUP);
        let q = &q[i0 * d..(i0 + nq) * d];
        // SAFETY: `regions_supported` checked the CPU and the regions; grown above, with the
        // regions' plan first and their rows unpacked; `q` holds nq rows of d.
        unsafe {
            match (nq, d) {
                (1, 64) => region_scores::<1, 64>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (2, 64) => region_scores::<2, 64>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (3, 64) => region_scores::<3, 64>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (_, 64) => region_scores::<4, 64>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (1, 128) => region_scores::<1, 128>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (2, 128) => region_scores::<2, 128>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (3, 128) => region_scores::<3, 128>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (_, 128) => region_scores::<4, 128>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (1, _) => region_scores::<1, 256>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (2, _) => region_scores::<2, 256>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (3, _) => region_scores::<3, 256>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
                (_, _) => region_scores::<4, 256>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead),
            }
        }
        for i in 0..nq {
            out[(i0 + i) * n..(i0 + i + 1) * n].copy_from_slice(&p[i * pr..i * pr + n]);
        }
        i0 += nq;
    }
    true
}

/// Puts the plan of `regions`' layout first in `w.plans`, made if new (a head's blocks share
/// one layout, so it is usually first already).
fn plan_first(regions: &[crate::KeyRegion<'_>], w: &mut FusedScratch) {
    first_plan(&mut w.plans, regions.iter().map(|r| (r.keys.dim, r.keys.bits)));
}

/// Puts the plan of rows of these `(channels, bits)` regions first in `plans`, made if new.
fn first_plan(plans: &mut Vec<HeadPlan>, shapes: impl Iterator<Item = (usize, u8)> + Clone) {
    match plans.iter().position(|p| p.shapes.iter().copied().eq(shapes.clone())) {
        Some(0) => {}
        Some(j) => plans.swap(0, j),
        None => plans.insert(0, HeadPlan::new(&shapes.collect::<Vec<_>>())),
    }
}

/// Most key regions a fused call takes.
const MAX_REGIONS: usize = 16;

/// The fused kernel of [`crate::attend_int_regions_with`]: keys in channel regions (`-qa`),
/// each region's rows unpacked to one code a byte (`vpermb` and `vpmultishiftqb`, as the
/// regions' [`HeadPlan`] says) and dotted with its columns of the query rounded to int8 with a scale
/// of its own, the regions' scores added, then the softmax step and the value sum of
/// [`attend_int_in`]. Returns `false`, changing nothing, when [`attend_int_regions_supported`]
/// is false or a value scale is negative or NaN.
pub(crate) fn attend_int_regions_in(
    regions: &[crate::KeyRegion<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
    w: &mut FusedScratch,
) -> bool {
    if !attend_int_regions_supported(regions, v, n_q) {
        return false;
    }
    // SAFETY: checked above.
    unsafe { regions_run(regions, v, q, n_q, state, w) }
}

/// [`attend_int_regions_in`] once its regions are checked: the buffers grown, the plans put
/// first, the fused kernel run.
///
/// # Safety
/// [`attend_int_regions_supported`]`(regions, v, n_q)`.
unsafe fn regions_run(
    regions: &[crate::KeyRegion<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
    w: &mut FusedScratch,
) -> bool {
    grow(w);
    plan_first(regions, w);
    if v.bits != 4 {
        first_plan(&mut w.vplans, std::iter::once((v.dim, v.bits)));
    }
    // SAFETY: checked by the caller; grown above, with the regions' plan first (and the
    // values').
    unsafe { fused_run(Keys::Regions(regions), false, v, q, n_q, state, w) }
}

/// One plane's bits of some codes of a region's row, placed in the bytes of their channels
/// among 64: the row's bytes at `at ..` loaded under `mask`, byte `idx[k]` of them moved to
/// byte `k` (`vpermb`), the 8 bits from `ctrl[k]` of its 64-bit lane taken
/// (`vpmultishiftqb`, so that the code's field lands at the plane's shift), `keep[k]` of them
/// kept (zero in the bytes of other pieces).
#[derive(Clone)]
struct PlanePiece {
    region: usize,
    at: usize,
    mask: u64,
    idx: [u8; 64],
    ctrl: [u8; 64],
    keep: [u8; 64],
}

/// How to unpack a row of keys in channel regions of these shapes (`(channels, bits)` each,
/// in order) to a code a byte, 64 channels at a time: the pieces of channels `64v ..` are
/// `pieces[starts[v]..starts[v + 1]]`, or-ed together. `runs` cuts the row into runs of
/// 16-channel blocks whose 4-channel quarters lie in the same regions: `(first block, end
/// block, lanes)`, lane `4k + j` naming the region of quarter `j` of each block (regions are
/// whole multiples of 8 channels).
#[derive(Clone)]
struct HeadPlan {
    shapes: Vec<(usize, u8)>,
    pieces: Vec<PlanePiece>,
    starts: Vec<usize>,
    runs: Vec<(usize, usize, [i32; 16])>,
}

impl HeadPlan {
    /// The plan of the layout `kvq_quant_core::pack` writes: a plane of width `w < 8` in
    /// chunks of `16 · 8 / w` codes filling 16 bytes, byte `j` holding code `j + 16 f` in field
    /// `f` (bits `f · w ..`); a last, shorter chunk of `r` codes in `s = ⌈r w / 8⌉` bytes with
    /// stride `s`. A piece's bytes span at most 64 (split where they would not).
    fn new(shapes: &[(usize, u8)]) -> Self {
        let d: usize = shapes.iter().map(|s| s.0).sum();
        let chunks = d.div_ceil(64);
        let mut by_chunk: Vec<Vec<PlanePiece>> = vec![Vec::new(); chunks];
        // The region of each 4-channel quarter.
        let mut quarter = vec![0i32; d.div_ceil(4)];
        let mut first = 0;
        for (region, &(dim, bits)) in shapes.iter().enumerate() {
            quarter[first / 4..(first + dim) / 4].fill(region as i32);
            let (mut base, mut shift) = (0usize, 0usize);
            for &w in kvq_quant_core::pack::planes(bits) {
                let w = usize::from(w);
                // Byte and bit of code `i` in the plane.
                let loc = |i: usize| crate::regions::plane_loc(dim, w, i);
                // The plane's codes in groups: a new group at each 64 channels, or where its
                // bytes would span more than 64.
                let mut group: Vec<(usize, usize, usize)> = Vec::new();
                let mut close = |group: &mut Vec<(usize, usize, usize)>| {
                    let Some(&(a0, _, _)) = group.first() else { return };
                    let lo = group.iter().map(|g| g.1).min().unwrap_or(0);
                    let hi = group.iter().map(|g| g.1).max().unwrap_or(0);
                    let len = hi + 1 - lo;
                    let mut pc = PlanePiece {
                        region,
                        at: base + lo,
                        mask: if len >= 64 { u64::MAX } else { (1u64 << len) - 1 },
                        idx: [0; 64],
                        ctrl: [0; 64],
                        keep: [0; 64],
                    };
                    for &(a, byte, bit) in group.iter() {
                        let k = a % 64;
                        pc.idx[k] = (byte - lo) as u8;
                        // The field's bits from bit `shift` of byte k (wrapping in its 64-bit lane).
                        pc.ctrl[k] = ((8 * (k % 8) + bit + 64 - shift) % 64) as u8;
                        pc.keep[k] = (((1u32 << w) - 1) << shift) as u8;
                    }
                    by_chunk[a0 / 64].push(pc);
                    group.clear();
                };
                for i in 0..dim {
                    let (a, (byte, bit)) = (first + i, loc(i));
                    if let Some(&(a0, _, _)) = group.first() {
                        let lo = group.iter().map(|g| g.1).min().unwrap_or(byte).min(byte);
                        let hi = group.iter().map(|g| g.1).max().unwrap_or(byte).max(byte);
                        if a0 / 64 != a / 64 || hi - lo >= 64 {
                            close(&mut group);
                        }
                    }
                    group.push((a, byte, bit));
                }
                close(&mut group);
                base += dim * w / 8;
                shift += w;
            }
            first += dim;
        }
        let mut starts = vec![0];
        let mut pieces = Vec::new();
        for chunk in by_chunk {
            pieces.extend(chunk);
            starts.push(pieces.len());
        }
        let mut runs: Vec<(usize, usize, [i32; 16])> = Vec::new();
        for (m, q) in quarter.chunks(4).enumerate() {
            let lanes = std::array::from_fn(|l| q.get(l % 4).copied().unwrap_or(0));
            match runs.last_mut() {
                Some(run) if run.2 == lanes => run.1 = m + 1,
                _ => runs.push((m, m + 1, lanes)),
            }
        }
        Self { shapes: shapes.to_vec(), pieces, starts, runs }
    }
}

/// The fused kernel's monomorphizations, by query group size, head_dim and layouts.
///
/// # Safety
/// [`attend_int_supported`] for the parts of `keys` as [`crate::parts_supported`] checks
/// them, or [`attend_int_regions_supported`] for its regions; `grouped_keys` exactly when the
/// parts are per row or per group; `w` grown by [`grow`], the regions' plan first in
/// `w.plans` and, for values of other than 4 bits, theirs first in `w.vplans`.
unsafe fn fused_run(
    keys: Keys<'_>,
    grouped_keys: bool,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
    w: &mut FusedScratch,
) -> bool {
    let d = v.dim;
    let grouped = matches!(v.params, Params::PerGroup { .. });
    // The queued lines spread over the row loops: four rows a step, keys then values, of
    // every query group.
    w.ahead.pace(n_q.div_ceil(int8::GROUP) * 2 * v.rows.div_ceil(4));
    let mut first = true;
    crate::fused_groups(v, q, n_q, state, |nq, q, m, l, o| {
        // SAFETY: the callers checked the CPU, the widths, the layouts and the sizes against
        // the buffers' (grown to the largest block); `fused_groups` checked the value scales
        // and the shapes.
        unsafe {
            // The block's key regions and narrow values unpacked once, for every group.
            if std::mem::take(&mut first) {
                if let Keys::Regions(regions) = keys {
                    unpack_regions::<true>(regions, &w.plans[0], &mut w.ub);
                }
                if v.bits != 4 {
                    unpack_rows::<false>(&w.vplans[0], &[(v.codes.as_ptr(), v.row_bytes)], v.rows, &mut w.vb);
                }
            }
            // One monomorphization per query group size, head_dim (64, 128, else 256) and
            // layout of the keys' and the values' parameters (per channel, or per row or
            // group; per row or group).
            macro_rules! by_shape {
                ($gk:literal, $gv:literal) => {
                    match (nq, d) {
                        (1, 64) => attend4::<1, 64, $gk, $gv>(keys, v, q, m, l, o, w),
                        (2, 64) => attend4::<2, 64, $gk, $gv>(keys, v, q, m, l, o, w),
                        (3, 64) => attend4::<3, 64, $gk, $gv>(keys, v, q, m, l, o, w),
                        (_, 64) => attend4::<4, 64, $gk, $gv>(keys, v, q, m, l, o, w),
                        (1, 128) => attend4::<1, 128, $gk, $gv>(keys, v, q, m, l, o, w),
                        (2, 128) => attend4::<2, 128, $gk, $gv>(keys, v, q, m, l, o, w),
                        (3, 128) => attend4::<3, 128, $gk, $gv>(keys, v, q, m, l, o, w),
                        (_, 128) => attend4::<4, 128, $gk, $gv>(keys, v, q, m, l, o, w),
                        (1, _) => attend4::<1, 256, $gk, $gv>(keys, v, q, m, l, o, w),
                        (2, _) => attend4::<2, 256, $gk, $gv>(keys, v, q, m, l, o, w),
                        (3, _) => attend4::<3, 256, $gk, $gv>(keys, v, q, m, l, o, w),
                        (_, _) => attend4::<4, 256, $gk, $gv>(keys, v, q, m, l, o, w),
                    }
                };
            }
            match (grouped_keys, grouped) {
                (false, false) => by_shape!(false, false),
                (false, true) => by_shape!(false, true),
                (true, false) => by_shape!(true, false),
                (true, true) => by_shape!(true, true),
            }
        }
    })
}

/// Lanes `0..len` (at most 16) of a 16-lane vector.
#[inline(always)]
pub(crate) fn lanes(len: usize) -> __mmask16 {
    if len >= 16 { 0xffff } else { ((1u32 << len) - 1) as __mmask16 }
}

/// The fused kernel of [`attend_int_in`] for `NQ` query rows, keys per channel or, `GK`, per
/// group or per row ([`grouped_key_scores`], [`grouped_key_scores64`]), values per row or,
/// `GV`, per group ([`grouped_values`]).
///
/// # Safety
/// [`attend_int_supported`]`(k, v, NQ)`; every value scale of `v` is `>= 0`; `q` and `o` hold
/// `NQ · dim` values, `m` and `l` `NQ`; the buffers of `w` are grown to the largest block;
/// `GK` exactly when `k` is per group, `GV` exactly when `v` is.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn attend4<const NQ: usize, const D: usize, const GK: bool, const GV: bool>(
    keys: Keys<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
    w: &mut FusedScratch,
) {
    let FusedScratch { q8, qp, dots, wb, p, acc, vt, wg, wq, wx, plans, ub, vb, lsq, ahead, .. } = w;
    let n = v.rows;

    // 1-2. The query rows rounded to int8 against each part of the keys, the integer dots of
    //      its rows, and their scores into `p`, the parts' side by side (keys per group or
    //      row: one part, scored as their dots are reduced).
    let pr = FUSED_ROWS + 16;
    // Each query row's running maximum with its scores (NaN scores skipped: the second
    // operand is returned), taken as keys per channel are scored; keys per group or row
    // in step 3.
    let mut mx = [_mm512_setzero_ps(); int8::GROUP];
    for (x, &m) in mx.iter_mut().zip(m.iter()).take(NQ) {
        *x = _mm512_set1_ps(m);
    }
    // Keys per group or row, and key regions: the maxima are taken from `p` in step 3.
    let late_max = GK || matches!(keys, Keys::Regions(_));
    if let Keys::Regions(regions) = keys {
        // SAFETY: `attend_int_regions_supported` checked VBMI and the regions; the buffers
        // are grown, the regions' plan is the first and their rows are unpacked into `ub`
        // (`fused_run`); `p`'s rows are `FUSED_ROWS + 16` apart.
        unsafe { region_scores::<NQ, D>(regions, ub, lsq, q, q8, qp, p, &plans[0], ahead) };
    } else if GK {
        let Keys::Parts(parts) = keys else { unreachable!("parts") };
        let k = &parts[0];
        let (sq, _, lane_sums) = round_query::<NQ, D, GK>(k, q, q8, qp);
        // SAFETY: `k` is 4-bit per row or per group (groups of a power of two multiple of 32)
        // with rows of D / 2 bytes; `q8` holds NQ arranged rows of D bytes; row i of `p` (at
        // i · pr) has room for n rounded up to 8; the CPU features are this function's.
        unsafe {
            if D == 64 {
                grouped_key_scores64::<NQ>(k, &q8[..NQ * D], &sq, &lane_sums, p, ahead)
            } else {
                grouped_key_scores::<NQ, D>(k, &q8[..NQ * D], &sq, &lane_sums, p, ahead)
            }
        };
    } else if let Keys::Parts(parts) = keys {
        let mut at = 0;
        for k in parts {
            let nk = k.rows;
            let (sq, kadd, _) = round_query::<NQ, D, GK>(k, q, q8, qp);
            // `dots` holds GROUP · FUSED_ROWS values.
            channel_dots::<NQ, D>(k, &q8[..NQ * D], &mut dots[..NQ * nk], ahead);
            // The scores `sq · dot + kadd` (the scores kernel's epilogue) and their maxima.
            for (i, mx) in mx.iter_mut().enumerate().take(NQ) {
                let (sqv, addv) = (_mm512_set1_ps(sq[i]), _mm512_set1_ps(kadd[i]));
                for r in (0..nk.div_ceil(16)).map(|j| 16 * j) {
                    // SAFETY: the masked lanes lie inside row i of the part's dots and, at
                    // `at + r`, inside row i of `p` (at + nk <= n <= FUSED_ROWS).
                    unsafe {
                        let mask = lanes(nk - r);
                        let dv = _mm512_maskz_loadu_epi32(mask, dots.as_ptr().add(i * nk + r));
                        let x = _mm512_add_ps(_mm512_mul_ps(sqv, _mm512_cvtepi32_ps(dv)), addv);
                        _mm512_mask_storeu_ps(p.as_mut_ptr().add(i * pr + at + r), mask, x);
                        *mx = _mm512_mask_max_ps(*mx, mask, x, *mx);
                    }
                }
            }
            at += nk;
        }
    }

    // 3. The scores of every query row and their maxima with the running ones; the rescaling
    //    factors `e^(m − m')`, four rows in one vector; the exponentials, their sums and the
    //    weights `p · scale`, rounded to bytes (scale max / 255), zero past the block's rows
    //    up to the stride. `p` holds row i's values at i · (FUSED_ROWS + 16).
    let stride = n.next_multiple_of(8);
    let mut top = [f32::NEG_INFINITY; int8::GROUP];
    for (i, mx) in mx.iter_mut().enumerate().take(NQ) {
        if late_max {
            for r in (0..n.div_ceil(16)).map(|j| 16 * j) {
                let mask = lanes(n - r);
                // SAFETY: row i of `p` has 16 values of room past n.
                let s = unsafe { _mm512_loadu_ps(p.as_ptr().add(i * pr + r)) };
                *mx = _mm512_mask_max_ps(*mx, mask, s, *mx);
            }
        }
        top[i] = _mm512_reduce_max_ps(*mx);
    }
    let mut factor = [1f32; int8::GROUP];
    {
        let mut t = [0f32; 16];
        for i in 0..NQ {
            t[i] = m[i] - top[i];
        }
        let mut f = [0f32; 16];
        // SAFETY: `t` and `f` hold 16 floats; AVX-512 F is enabled.
        unsafe { _mm512_storeu_ps(f.as_mut_ptr(), crate::softmax::x86::exp16(_mm512_loadu_ps(t.as_ptr()))) };
        factor[..NQ].copy_from_slice(&f[..NQ]);
    }
    if GV {
        let bufs = Grouped { p, vt, wg, wq, wx, acc, ahead };
        // SAFETY: forwarded from this function's contract (values per group, `GV`).
        unsafe { grouped_values::<NQ, D>(v, &top, &mut factor, m, l, o, bufs) };
        return;
    }
    // SAFETY: forwarded from this function's contract (values per row); `p`, `wb`, `m` and
    // `l` as `row_weights` asks.
    let (sw, vadd) = unsafe { row_weights::<NQ>(v, p, &top, &mut factor, m, l, wb) };

    // 4. The integer sums of the centred value codes under the byte weights, and the epilogue:
    //    `o ← o · factor + (sw · sum + add)`.
    // SAFETY: `v` is 4-bit with d a multiple of 128 and n >= 1 rows; `wb` holds NQ rows of
    // `stride` bytes, zero from n to the stride (each row's bytes are written in chunks of 16
    // past n, zero weights there); `acc` NQ · d values.
    unsafe {
        if v.bits != 4 {
            // Narrow values (checked by `narrow_values`): unpacked into `vb` by `fused_run`.
            vsums_codes::<NQ>(v, n, wb, stride, vb, acc, ahead)
        } else if D == 64 {
            vsums_bytes64::<NQ, false>(v, n, wb, stride, &[], acc, ahead)
        } else {
            vsums_bytes::<NQ, false>(v, 0..n, wb, stride, false, &[], acc, ahead)
        }
    };
    rescale_add::<NQ, D>(o, acc, &factor, &sw, &vadd);
}

/// Step 1 of [`attend4`] for the keys `k`: each query row times the channel scales (keys per
/// row or group, `GK`: the query row as it is), rounded to int8 into `q8`; `qp` holds the
/// products between the two passes. Returns the query rows' int8 scales, what the keys'
/// offsets add (keys per channel) and each row's sums over every 32 channels (keys per row or
/// group with offsets).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
fn round_query<const NQ: usize, const D: usize, const GK: bool>(
    k: &QuantBlock<'_>,
    q: &[f32],
    q8: &mut [u8],
    qp: &mut [f32],
) -> ([f32; int8::GROUP], [f32; int8::GROUP], [[f32; FUSED_DIM / 32]; int8::GROUP]) {
    use int8::MAGIC;
    let d = D;
    let (magic, magic_bits) = (_mm512_set1_ps(MAGIC), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    assert!(q.len() >= NQ * D && q8.len() >= NQ * D && qp.len() >= NQ * D && k.dim == D, "shapes");
    // 1. Each query row times the channel scales (keys per group: the query row as it is),
    //    rounded to int8 with the scale max / 127, stored in the order `vacc` reads a 4-bit
    //    row (`int8::arrange4` with 64-byte chunks: 16-value piece w of each 128 goes to slot
    //    4 · (w % 2) + w / 2); what the keys' offsets add, `Σ q · offset` (per group: the
    //    query's sums over each 32 channels, `lane_sums`).
    let mut kadd = [0f32; int8::GROUP];
    let mut lane_sums = [[0f32; FUSED_DIM / 32]; int8::GROUP];
    let (mut qmax, mut qnan) = ([0f32; int8::GROUP], [false; int8::GROUP]);
    let mut ksv = [_mm512_set1_ps(1.0); FUSED_DIM / 16];
    let ko = match k.params {
        Params::PerChannel { scale: ks, offset } => {
            for (j, x) in ksv.iter_mut().enumerate().take(D / 16) {
                // SAFETY: 16 · j + 16 <= d, inside the scales.
                *x = unsafe { _mm512_loadu_ps(ks.as_ptr().add(16 * j)) };
            }
            offset
        }
        Params::PerGroup { offset, .. } | Params::PerRow { offset, .. } => {
            if offset.is_some() {
                for (i, sums) in lane_sums.iter_mut().enumerate().take(NQ) {
                    for (t, x) in sums.iter_mut().enumerate().take(D / 32) {
                        // SAFETY: 32 · t + 32 <= d, inside query row i.
                        *x = unsafe {
                            let at = q.as_ptr().add(i * d + 32 * t);
                            _mm512_reduce_add_ps(_mm512_add_ps(
                                _mm512_loadu_ps(at),
                                _mm512_loadu_ps(at.add(16)),
                            ))
                        };
                    }
                }
            }
            None
        }
    };
    for i in 0..NQ {
        let qi = &q[i * d..(i + 1) * d];
        let (mut mx, mut any, mut dot) = (_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps());
        for (j, &s) in ksv.iter().enumerate().take(D / 16) {
            // SAFETY: 16 · j + 16 <= d, inside the query row and the offsets; `qp` holds
            // GROUP · FUSED_DIM values.
            unsafe {
                let x = _mm512_loadu_ps(qi.as_ptr().add(16 * j));
                // Keys per row or group: the query as it is (`ksv` stays 1).
                let y = if GK { x } else { _mm512_mul_ps(x, s) };
                _mm512_storeu_ps(qp.as_mut_ptr().add(i * d + 16 * j), y);
                // A NaN is skipped by the maximum (the second operand is returned) and makes
                // the sum `any` NaN.
                mx = _mm512_max_ps(_mm512_abs_ps(y), mx);
                any = _mm512_add_ps(any, y);
                if let Some(ko) = ko {
                    dot = _mm512_fmadd_ps(x, _mm512_loadu_ps(ko.as_ptr().add(16 * j)), dot);
                }
            }
        }
        kadd[i] = _mm512_reduce_add_ps(dot);
        qmax[i] = _mm512_reduce_max_ps(mx);
        qnan[i] = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(any, any) != 0;
    }
    let (sq, qinv) = int8::scales_of4(qmax, qnan, 127.0);
    for (i, &inv) in qinv.iter().enumerate().take(NQ) {
        let (invv, lo, hi) = (_mm512_set1_ps(inv), _mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for j in 0..D / 16 {
            // Rows of 64 values are read as 32-byte chunks (`int8::arrange4` with 32: the low
            // nibbles' values 0..16 and 32..48, then the high nibbles' 16..32 and 48..64).
            let slot = if D == 64 {
                16 * (2 * (j % 2) + j / 2)
            } else {
                128 * (j / 8) + 16 * (4 * (j % 2) + (j % 8) / 2)
            };
            // SAFETY: the products of row i lie in `qp` (stored above); the slot lies inside
            // row i of `q8` (d <= FUSED_DIM).
            unsafe {
                let y = _mm512_loadu_ps(qp.as_ptr().add(i * d + 16 * j));
                let y = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(y, invv), hi), lo);
                let r = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, magic)), magic_bits);
                _mm_storeu_si128(q8.as_mut_ptr().add(i * d + slot).cast(), _mm512_cvtepi32_epi8(r));
            }
        }
    }

    (sq, kadd, lane_sums)
}

/// Step 2 of [`attend4`] for keys per channel: the integer dots of every row of `k` with the rounded
/// query rows (`q8`, as [`round_query`] leaves them) into `dots` (`NQ` rows of `k.rows`):
/// four rows' bytes held in registers, one row of codes at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
fn channel_dots<const NQ: usize, const D: usize>(
    k: &QuantBlock<'_>,
    q8: &[u8],
    dots: &mut [i32],
    ahead: &mut Ahead,
) {
    let (d, n) = (D, k.rows);
    assert!(k.dim == D && k.bits == 4 && q8.len() >= NQ * D && dots.len() >= NQ * n, "shapes");
    if D == 64 {
        // SAFETY: the block is 4-bit with rows of 32 bytes; `q8` holds NQ rows of 64 bytes,
        // `dots` NQ · n values; the CPU features are this function's.
        unsafe { dots64::<NQ>(k, &q8[..NQ * 64], &mut dots[..NQ * n], ahead) };
    } else if NQ == 4 {
        let mask = _mm512_set1_epi8(0x0f);
        let per = 2 * D / 128;
        let mut qr = [_mm512_setzero_si512(); 2 * int8::GROUP * FUSED_DIM / 128];
        for (t, x) in qr.iter_mut().enumerate().take(NQ * per) {
            // SAFETY: 64 · t + 64 <= NQ · d, inside `q8`.
            *x = unsafe { _mm512_loadu_si512(q8.as_ptr().add(64 * t).cast()) };
        }
        // Four rows at a time, their 16-byte lanes regrouped (`vshufi64x2`, a 4 × 4
        // transpose of lanes): vector m of chunk c holds lane m of each row (lane k = row
        // r + k), so its low nibbles meet the query's 16 bytes of lane m of `qr[2c]` and its
        // high nibbles those of `qr[2c + 1]`, broadcast, and each 32-bit lane of a query
        // row's sums adds four channels of one row: the rows' dots are the sums of each
        // 128-bit lane, the four query rows' reduced together (`lane_sums4`).
        let to_rows = to_rows();
        let mut r = 0;
        while r + 4 <= n {
            ahead.step();
            let mut sums = [_mm512_setzero_si512(); 4];
            for c in 0..D / 128 {
                // SAFETY: chunk c (64 bytes) lies within row r + j (row_bytes = d / 2).
                let row = |j: usize| unsafe { _mm512_loadu_si512(k.row(r + j).as_ptr().add(64 * c).cast()) };
                let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
                let (a, b) = (
                    _mm512_shuffle_i64x2::<0b01_00_01_00>(r0, r1),
                    _mm512_shuffle_i64x2::<0b01_00_01_00>(r2, r3),
                );
                let (e, f) = (
                    _mm512_shuffle_i64x2::<0b11_10_11_10>(r0, r1),
                    _mm512_shuffle_i64x2::<0b11_10_11_10>(r2, r3),
                );
                let lanes = [
                    _mm512_shuffle_i64x2::<0b10_00_10_00>(a, b),
                    _mm512_shuffle_i64x2::<0b11_01_11_01>(a, b),
                    _mm512_shuffle_i64x2::<0b10_00_10_00>(e, f),
                    _mm512_shuffle_i64x2::<0b11_01_11_01>(e, f),
                ];
                for (m, &t) in lanes.iter().enumerate() {
                    let (lo, hi) =
                        (_mm512_and_si512(t, mask), _mm512_and_si512(_mm512_srli_epi16(t, 4), mask));
                    for (i, a) in sums.iter_mut().enumerate() {
                        // SAFETY: lane m of rows i · per + 2c and + 1 of `qr` (64 bytes each)
                        // lies in `q8` (NQ · D bytes).
                        let (ql, qh) = unsafe {
                            let at = q8.as_ptr().add(64 * (i * per + 2 * c) + 16 * m);
                            (
                                _mm512_broadcast_i32x4(_mm_loadu_si128(at.cast())),
                                _mm512_broadcast_i32x4(_mm_loadu_si128(at.add(64).cast())),
                            )
                        };
                        *a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*a, lo, ql), hi, qh);
                    }
                }
            }
            // Element 4k + i: row r + k, query row i; then 4i + k.
            let t = _mm512_permutexvar_epi32(to_rows, lane_sums4(&sums));
            // SAFETY: r + 4 <= n: inside row i of `dots` (NQ · n values).
            unsafe {
                let base = dots.as_mut_ptr().add(r);
                let at = |i: usize| base.add(i * n).cast();
                _mm_storeu_si128(at(0), _mm512_castsi512_si128(t));
                _mm_storeu_si128(at(1), _mm512_extracti32x4_epi32::<1>(t));
                _mm_storeu_si128(at(2), _mm512_extracti32x4_epi32::<2>(t));
                _mm_storeu_si128(at(3), _mm512_extracti32x4_epi32::<3>(t));
            }
            r += 4;
        }
        while r < n {
            let row = k.row(r);
            let mut sums = [_mm512_setzero_si512(); 4];
            for c in 0..D / 128 {
                // SAFETY: chunk c (64 bytes) lies within the row (row_bytes = d / 2).
                let v = unsafe { _mm512_loadu_si512(row.as_ptr().add(64 * c).cast()) };
                let (lo, hi) = (_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
                for (i, a) in sums.iter_mut().enumerate() {
                    *a = _mm512_dpbusd_epi32(*a, lo, qr[i * per + 2 * c]);
                    *a = _mm512_dpbusd_epi32(*a, hi, qr[i * per + 2 * c + 1]);
                }
            }
            // SAFETY: AVX-512 is enabled by this function's target features.
            let t = unsafe { hsum4_zmm(&sums) };
            for (i, &x) in t.iter().enumerate() {
                dots[i * n + r] = x;
            }
            r += 1;
        }
    } else {
        // SAFETY: the block is 4-bit with d a multiple of 128 (checked by the caller); `q8`
        // holds NQ rows of d bytes, `dots` NQ · n values.
        unsafe {
            vdots_with::<4, NQ, false, true>(
                k,
                0..n,
                &q8[..NQ * d],
                _mm512_setzero_si512(),
                &mut dots[..NQ * n],
                ahead,
            )
        };
    }
}

/// Step 3 of [`attend4`] for values per row: each query row's exponentials `e^(s − top)`
/// from its scores in `p` (row `i` at `i · (FUSED_ROWS + 16)`), their sum into `l` (the old
/// sum rescaled by `factor`), `top` into `m`, the weights `e · scale` rounded to bytes (scale
/// max / 255) into `wb` (`NQ` rows of the block's rows rounded up to 8, zero past them), and
/// what the offsets and the codes' centre add. Rows with nothing seen (`top` = −∞) keep their
/// state (`factor` 1) and get zero weights. Returns the weights' scales and those additions.
///
/// # Safety
/// `v` is per row with `1..=FUSED_ROWS` rows; `p` holds `NQ` rows `FUSED_ROWS + 16` apart, each
/// with 16 values of room past the block's rows; `wb` holds `NQ` rows of the rows rounded up to
/// 8 and 16 bytes more; `m` and `l` hold `NQ` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn row_weights<const NQ: usize>(
    v: &QuantBlock<'_>,
    p: &mut [f32],
    top: &[f32; int8::GROUP],
    factor: &mut [f32; int8::GROUP],
    m: &mut [f32],
    l: &mut [f32],
    wb: &mut [u8],
) -> ([f32; int8::GROUP], [f32; int8::GROUP]) {
    use int8::MAGIC;
    let (magic, magic_bits) = (_mm512_set1_ps(MAGIC), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    let (n, pr) = (v.rows, FUSED_ROWS + 16);
    let stride = n.next_multiple_of(8);
    let z = f32::from(int_values::center(v.bits));
    let Params::PerRow { scale: vs, offset: vo } = v.params else { unreachable!("checked") };
    let (mut wmax, mut wnan, mut vadd) = ([0f32; int8::GROUP], [false; int8::GROUP], [0f32; int8::GROUP]);
    for i in 0..NQ {
        if top[i] == f32::NEG_INFINITY {
            // Nothing of this row seen yet: no weight, no change.
            factor[i] = 1.0;
            continue;
        }
        let mv = _mm512_set1_ps(top[i]);
        let (mut sum, mut add) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (mut mx, mut any) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let zv = _mm512_set1_ps(z);
        for r in (0..n.div_ceil(16)).map(|j| 16 * j) {
            let mask = lanes(n - r);
            // SAFETY: row i of `p` has 16 values of room past n; the masked lanes lie inside
            // the value scales and offsets.
            unsafe {
                let at = p.as_mut_ptr().add(i * pr + r);
                let e = _mm512_maskz_mov_ps(
                    mask,
                    crate::softmax::x86::exp16(_mm512_sub_ps(_mm512_loadu_ps(at), mv)),
                );
                sum = _mm512_add_ps(sum, e);
                let w = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(mask, vs.as_ptr().add(r)));
                // What the offsets and the centre add: Σ p · offset + z · Σ w.
                add = _mm512_fmadd_ps(zv, w, add);
                if let Some(vo) = vo {
                    add = _mm512_fmadd_ps(e, _mm512_maskz_loadu_ps(mask, vo.as_ptr().add(r)), add);
                }
                mx = _mm512_max_ps(w, mx);
                any = _mm512_add_ps(any, w);
                _mm512_storeu_ps(at, w);
            }
        }
        l[i] = l[i] * factor[i] + _mm512_reduce_add_ps(sum);
        m[i] = top[i];
        wmax[i] = _mm512_reduce_max_ps(mx);
        wnan[i] = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(any, any) != 0;
        vadd[i] = _mm512_reduce_add_ps(add);
    }
    let (sw, winv) = int8::scales_of4(wmax, wnan, 255.0);
    for i in 0..NQ {
        if top[i] == f32::NEG_INFINITY {
            wb[i * stride..(i + 1) * stride].fill(0);
            continue;
        }
        let (invv, hi) = (_mm512_set1_ps(winv[i]), _mm512_set1_ps(255.0));
        for r in (0..n.div_ceil(16)).map(|j| 16 * j) {
            // SAFETY: row i of `p` has 16 values of room past n (zero weights past n); `wb`
            // has 16 bytes of room past NQ rows of `stride`, and later rows are written after
            // this one.
            unsafe {
                let y = _mm512_min_ps(_mm512_mul_ps(_mm512_loadu_ps(p.as_ptr().add(i * pr + r)), invv), hi);
                let code = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, magic)), magic_bits);
                _mm_storeu_si128(wb.as_mut_ptr().add(i * stride + r).cast(), _mm512_cvtepi32_epi8(code));
            }
        }
    }
    (sw, vadd)
}

/// Step 4's epilogue of [`attend4`]: `o ← o · factor + (sw · acc + add)` for each of the `NQ`
/// query rows (`o` and `acc` rows of `D` values).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
fn rescale_add<const NQ: usize, const D: usize>(
    o: &mut [f32],
    acc: &[i32],
    factor: &[f32; int8::GROUP],
    sw: &[f32; int8::GROUP],
    vadd: &[f32; int8::GROUP],
) {
    assert!(o.len() >= NQ * D && acc.len() >= NQ * D, "shapes");
    let d = D;
    for i in 0..NQ {
        let (f, s, a) = (_mm512_set1_ps(factor[i]), _mm512_set1_ps(sw[i]), _mm512_set1_ps(vadd[i]));
        for c in (0..D / 16).map(|j| 16 * j) {
            // SAFETY: c + 16 <= d, inside row i of `o` and `acc`.
            unsafe {
                let at = o.as_mut_ptr().add(i * d + c);
                let x = _mm512_add_ps(
                    _mm512_mul_ps(
                        s,
                        _mm512_cvtepi32_ps(_mm512_loadu_si512(acc.as_ptr().add(i * d + c).cast())),
                    ),
                    a,
                );
                let old = _mm512_loadu_ps(at);
                let old = if factor[i] != 1.0 { _mm512_mul_ps(old, f) } else { old };
                _mm512_storeu_ps(at, _mm512_add_ps(old, x));
            }
        }
    }
}

/// Steps 1-2 of [`attend4`] for keys in channel regions: each region's columns of the `NQ`
/// query rows times its channel scales, rounded to int8 with a scale of its own (`sq`, one
/// per region and query row) into one row of bytes in the keys' channel order; then four key
/// rows at a time from `ub` (unpacked by [`unpack_regions`], each 16-channel block of the four
/// rows in one vector: lane `4k + j` holds row k's quarter j), each block dotted with the
/// query's block broadcast (`vpdpbusd`), the integer sums kept over a run of blocks whose
/// quarters lie in the same regions ([`HeadPlan`]'s `runs`) and then scaled by each lane's
/// region `sq` in floats; the four query rows' sums reduced together (each lane's quarters)
/// into the scores `Σ sq · dot + Σ kadd`, into `p` (row `i` at `i · (FUSED_ROWS + 16)`).
/// Compiled with VBMI, which the other fused kernels do not need.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI and VBMI; [`attend_int_regions_supported`]
/// for `regions` with values of `D` channels; `ub` holds their rows unpacked by
/// [`unpack_regions`]; `q` holds `NQ` rows of `D`; the buffers are grown by [`grow`]; `plan`
/// is the [`HeadPlan`] of the regions' shapes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn region_scores<const NQ: usize, const D: usize>(
    regions: &[crate::KeyRegion<'_>],
    ub: &[u8],
    lsq: &mut [f32],
    q: &[f32],
    q8: &mut [u8],
    qp: &mut [f32],
    p: &mut [f32],
    plan: &HeadPlan,
    ahead: &mut Ahead,
) {
    let pr = FUSED_ROWS + 16;
    let n = regions[0].keys.rows;
    assert!(
        q.len() >= NQ * D
            && q8.len() >= NQ * D
            && qp.len() >= NQ * D
            && p.len() >= NQ * pr
            && n + 4 <= pr
            && ub.len() >= n.next_multiple_of(8) * D
            && plan.starts.len() == D / 64 + 1
            && regions.len() <= 16
            && plan.runs.iter().all(|r| r.1 <= D / 16)
            && plan.runs.len() * int8::GROUP * 16 <= lsq.len()
            && plan.pieces.iter().all(|pc| pc.region < regions.len()),
        "the query rows, the grown buffers and the plan"
    );
    // 1. Each region's query columns times its channel scales, rounded.
    let (sqs, kadd) = round_region_queries::<NQ, D>(regions, q, q8, qp);
    // Each (run, query row)'s lane scales: lane 4k + j takes the `sq` of the region of
    // quarter j of the run's blocks.
    // In `lsq` (a stack array of every run's would be zeroed at each call), 16 floats per
    // (run, query row).
    for (run, (_, _, at)) in lsq.chunks_exact_mut(int8::GROUP * 16).zip(&plan.runs) {
        // SAFETY: `at` holds 16 i32 (regions < 16).
        let at = unsafe { _mm512_loadu_si512(at.as_ptr().cast()) };
        for (x, sq) in run.chunks_exact_mut(16).zip(&sqs).take(NQ) {
            // SAFETY: `sq` and `x` hold 16 floats.
            unsafe {
                _mm512_storeu_ps(x.as_mut_ptr(), _mm512_permutexvar_ps(at, _mm512_loadu_ps(sq.as_ptr())))
            };
        }
    }
    let lsq = &*lsq;
    // Lane 4i + k of the reduced sums (lane 4k + i, below) and the offsets' terms there.
    let to_rows = to_rows();
    // SAFETY: `kadd` holds 4 floats.
    let kaddv = unsafe {
        _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            _mm512_castps128_ps512(_mm_loadu_ps(kadd.as_ptr())),
        )
    };
    // 2. Four rows at a time: per run, the integer dots of each query row with the rows'
    //    quarters, scaled into float sums; the sums' quarters reduced and the four rows'
    //    scores of each query row stored (one 16-byte store).
    let zero = _mm512_setzero_si512();
    let runs = &plan.runs[..plan.runs.len().min(FUSED_DIM / 16)];
    let mut r0 = 0;
    while r0 < n {
        ahead.step();
        let mut acc = [_mm512_setzero_ps(); int8::GROUP];
        for ((m0, m1, _), lsq) in runs.iter().zip(lsq.chunks_exact(int8::GROUP * 16)) {
            let mut dots = [zero; int8::GROUP];
            for m in *m0..*m1 {
                // SAFETY: block m of rows r0 .. r0 + 4 lies in `ub` (rows up to n rounded to
                // 8, m < D / 16: asserted).
                let codes = unsafe { _mm512_loadu_si512(ub.as_ptr().add(r0 * D + 64 * m).cast()) };
                for (i, x) in dots.iter_mut().enumerate().take(NQ) {
                    // SAFETY: block m of query row i lies in `q8` (16 · m + 16 <= D).
                    let qb = unsafe {
                        _mm512_broadcast_i32x4(_mm_loadu_si128(q8.as_ptr().add(i * D + 16 * m).cast()))
                    };
                    *x = _mm512_dpbusd_epi32(*x, codes, qb);
                }
            }
            for ((a, &x), s) in acc.iter_mut().zip(&dots).zip(lsq.chunks_exact(16)).take(NQ) {
                // SAFETY: `s` holds 16 floats.
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), unsafe { _mm512_loadu_ps(s.as_ptr()) }, *a);
            }
        }
        // Lane 4k + j of acc[i] → lane 4k + i of the sums over j, then lane 4i + k.
        let t01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
        let t23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
        let (t01, t23) = (_mm512_castps_pd(t01), _mm512_castps_pd(t23));
        let u = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(t01, t23)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(t01, t23)),
        );
        let mut sums = [0f32; 16];
        // SAFETY: `sums` holds 16 floats.
        unsafe {
            _mm512_storeu_ps(sums.as_mut_ptr(), _mm512_add_ps(_mm512_permutexvar_ps(to_rows, u), kaddv))
        };
        for i in 0..NQ {
            // SAFETY: r0 + 4 <= n + 3 < pr: inside row i of `p` (16 values of room past n).
            unsafe { _mm_storeu_ps(p.as_mut_ptr().add(i * pr + r0), _mm_loadu_ps(sums.as_ptr().add(4 * i))) };
        }
        r0 += 4;
    }
}

/// Step 1 of [`region_scores`]: each region's columns of the `NQ` query rows times its channel
/// scales, rounded to int8 with a scale of its own (`round_query`'s algebra per region) into
/// `q8` in the keys' channel order, `qp` holding the products between the passes. Returns
/// each query row's scale of each region (lane = region) and what all the regions' offsets
/// add to each row's scores.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
fn round_region_queries<const NQ: usize, const D: usize>(
    regions: &[crate::KeyRegion<'_>],
    q: &[f32],
    q8: &mut [u8],
    qp: &mut [f32],
) -> ([[f32; 16]; int8::GROUP], [f32; 4]) {
    use int8::MAGIC;
    assert!(
        q.len() >= NQ * D
            && q8.len() >= NQ * D
            && qp.len() >= NQ * D
            && regions.len() <= 16
            && regions
                .iter()
                .all(|r| r.first + r.keys.dim <= D && matches!(r.keys.params, Params::PerChannel { .. })),
        "the query rows and the regions"
    );
    let (magic, magic_bits) = (_mm512_set1_ps(MAGIC), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    let mut sqs = [[0f32; 16]; int8::GROUP];
    // What the offsets add, per query row over every region: reduced once, after them.
    let mut dots = [_mm512_setzero_ps(); int8::GROUP];
    for (j, r) in regions.iter().enumerate() {
        let k = &r.keys;
        let Params::PerChannel { scale, offset } = k.params else { unreachable!("checked") };
        let c = k.dim;
        let mut qnan = [false; int8::GROUP];
        let mut mxs = [_mm512_setzero_ps(); int8::GROUP];
        for (i, (dot, mx)) in dots.iter_mut().zip(mxs.iter_mut()).enumerate().take(NQ) {
            let mut any = _mm512_setzero_ps();
            for t in (0..c.div_ceil(16)).map(|j| 16 * j) {
                let mask = lanes(c - t);
                // SAFETY: the masked lanes lie inside the region's columns of query row i
                // (first + c <= D), its scales and offsets, and row i of `qp`.
                unsafe {
                    let x = _mm512_maskz_loadu_ps(mask, q.as_ptr().add(i * D + r.first + t));
                    let y = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(mask, scale.as_ptr().add(t)));
                    _mm512_mask_storeu_ps(qp.as_mut_ptr().add(i * D + r.first + t), mask, y);
                    *mx = _mm512_max_ps(_mm512_abs_ps(y), *mx);
                    any = _mm512_add_ps(any, y);
                    if let Some(ko) = offset {
                        *dot = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(mask, ko.as_ptr().add(t)), *dot);
                    }
                }
            }
            qnan[i] = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(any, any) != 0;
        }
        // The four rows' maxima in one reduction (rows past NQ: zero).
        let mut qmax = [0f32; 4];
        // SAFETY: `qmax` holds 4 floats.
        unsafe { _mm_storeu_ps(qmax.as_mut_ptr(), fold4_ps::<true>(&mxs)) };
        let (sq, qinv) = int8::scales_of4(qmax, qnan, 127.0);
        for (i, &inv) in qinv.iter().enumerate().take(NQ) {
            sqs[i][j] = sq[i];
            let (invv, lo, hi) = (_mm512_set1_ps(inv), _mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
            for t in (0..c.div_ceil(16)).map(|j| 16 * j) {
                let mask = lanes(c - t);
                // SAFETY: the masked lanes lie in the region's columns of row i of `qp`
                // (written above) and of `q8` (NQ rows of D bytes).
                unsafe {
                    let at = i * D + r.first + t;
                    let y = _mm512_maskz_loadu_ps(mask, qp.as_ptr().add(at));
                    let y = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(y, invv), hi), lo);
                    let x = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, magic)), magic_bits);
                    _mm_mask_storeu_epi8(q8.as_mut_ptr().add(at).cast(), mask, _mm512_cvtepi32_epi8(x));
                }
            }
        }
    }
    let mut kadd = [0f32; 4];
    // SAFETY: `kadd` holds 4 floats.
    unsafe { _mm_storeu_ps(kadd.as_mut_ptr(), fold4_ps::<false>(&dots)) };
    (sqs, kadd)
}

/// Step 4 of [`attend4`] for narrow values ([`narrow_values`]): the integer sums of every
/// query row's byte weights times the centred codes of rows `0..n` of `v`, as
/// [`vsums_bytes`] takes them for INT4 codes, into `acc` (`NQ` rows of the head_dim,
/// written): each row's codes (unpacked to a byte each in `vb` by [`unpack_rows`]), centred,
/// four rows interleaved into bytes against four broadcast byte weights (`vpdpbusd`).
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI and VBMI; [`narrow_values`]`(v)` with a
/// head_dim that is a multiple of 64; `1 <= n <= v.rows`; `wb` holds `NQ` rows of `stride >=
/// n` rounded up to 4 bytes, zero from `n` to the stride; `acc` holds `NQ · dim` values;
/// `vb` holds the rows of `v` unpacked by the plan of `[(v.dim, v.bits)]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn vsums_codes<const NQ: usize>(
    v: &QuantBlock<'_>,
    n: usize,
    wb: &[u8],
    stride: usize,
    vb: &[u8],
    acc: &mut [i32],
    ahead: &mut Ahead,
) {
    let d = v.dim;
    assert!(
        (1..=v.rows).contains(&n)
            && stride >= n.next_multiple_of(4)
            && wb.len() >= NQ * stride
            && acc.len() >= NQ * d
            && d.is_multiple_of(64)
            && vb.len() >= n.next_multiple_of(4) * d,
        "the rows, the weights, the sums and the unpacked codes"
    );
    let centre = _mm512_set1_epi8(int_values::center(v.bits) as i8);
    for c in 0..d / 64 {
        let mut sums = [[_mm512_setzero_si512(); 4]; NQ];
        let mut j = 0;
        while j < n {
            // Rows past the end (zero codes, or the block's rows past n) meet zero weights.
            let code = |k: usize| {
                // SAFETY: j + k < n rounded up to 4, rows of `vb` (asserted).
                let codes = unsafe { _mm512_loadu_si512(vb.as_ptr().add((j + k) * d + 64 * c).cast()) };
                _mm512_sub_epi8(codes, centre)
            };
            // x[k]: in 16-byte lane L, channels 64c + 16L + 4k .. + 4, one per i32 lane, bytes =
            // rows j .. j + 4.
            let x = interleave4([code(0), code(1), code(2), code(3)]);
            ahead.step();
            for (i, s) in sums.iter_mut().enumerate() {
                // SAFETY: j is a multiple of 4 below n, so i · stride + j + 4 <= NQ · stride
                // <= wb.len() (asserted above).
                let quad = unsafe { wb.as_ptr().add(i * stride + j).cast::<i32>().read_unaligned() };
                let wv = _mm512_set1_epi32(quad);
                for (s, &x) in s.iter_mut().zip(&x) {
                    *s = _mm512_dpbusd_epi32(*s, wv, x);
                }
            }
            j += 4;
        }
        for (i, s) in sums.iter().enumerate() {
            for (l, x) in transpose_lanes(s).into_iter().enumerate() {
                // SAFETY: 64c + 16l + 16 <= d, inside query row i of `acc`.
                unsafe { _mm512_storeu_si512(acc.as_mut_ptr().add(i * d + 64 * c + 16 * l).cast(), x) };
            }
        }
    }
}

/// Rows `0..n` of codes in regions (`bases[r]`: region r's codes and row bytes) unpacked by
/// `plan` to a code a byte, row r at `out[r · width..]` (`width`: the plan's channels rounded
/// up to 64, zero past them), and rows `n..` up to a multiple of 8 zero: per 64 channels and
/// 8 rows, each piece of the plan (its tables loaded once) over the 8 rows (the row's bytes at
/// `at` under its mask, moved by `vpermb`, the fields brought into place by
/// `vpmultishiftqb`, kept and or-ed in). `T` (transposed): each four rows' 16-channel blocks
/// side by side instead, block m of rows `4g ..` at `out[4g · width + 64m..]` (row `4g + k`'s
/// 16 bytes at `16k` in it), as [`region_scores`] reads them. Returns `width`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VBMI; `plan` is the [`HeadPlan`] of regions whose
/// rows `0..n` lie whole in their codes at `bases`, each piece's bytes inside its row; `out`
/// holds `n` rounded up to 8 rows of `width`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn unpack_rows<const T: bool>(
    plan: &HeadPlan,
    bases: &[(*const u8, usize)],
    n: usize,
    out: &mut [u8],
) -> usize {
    let width = 64 * (plan.starts.len() - 1);
    assert!(
        n >= 1
            && out.len() >= n.next_multiple_of(8) * width
            && plan.pieces.iter().all(|pc| pc.region < bases.len()),
        "the rows, the buffer and the plan"
    );
    for v in 0..width / 64 {
        let pieces = &plan.pieces[plan.starts[v]..plan.starts[v + 1]];
        for r0 in (0..n).step_by(8) {
            let mut codes = [_mm512_setzero_si512(); 8];
            for pc in pieces {
                let (base, rb) = bases[pc.region];
                // SAFETY: the piece's tables hold 64 bytes each.
                let (idx, ctrl, keep) = unsafe {
                    (
                        _mm512_loadu_si512(pc.idx.as_ptr().cast()),
                        _mm512_loadu_si512(pc.ctrl.as_ptr().cast()),
                        _mm512_loadu_si512(pc.keep.as_ptr().cast()),
                    )
                };
                let unpack = |c: &mut __m512i, row: usize, mask: u64| {
                    // SAFETY: row < n, whose bytes under the piece's mask lie in its region's
                    // codes (the caller's contract).
                    let x = unsafe { _mm512_maskz_loadu_epi8(mask, base.add(row * rb + pc.at).cast()) };
                    let x = _mm512_multishift_epi64_epi8(ctrl, _mm512_permutexvar_epi8(idx, x));
                    *c = _mm512_ternarylogic_epi64::<0xf8>(*c, x, keep);
                };
                if r0 + 8 <= n {
                    for (k, c) in codes.iter_mut().enumerate() {
                        unpack(c, r0 + k, pc.mask);
                    }
                } else {
                    for (k, c) in codes.iter_mut().enumerate() {
                        // Rows past n: nothing loaded (an empty mask, at the last row's address).
                        let (row, mask) = if r0 + k < n { (r0 + k, pc.mask) } else { (n - 1, 0) };
                        unpack(c, row, mask);
                    }
                }
            }
            if T {
                for (h, four) in codes.chunks_exact(4).enumerate() {
                    let four = transpose_lanes(&[four[0], four[1], four[2], four[3]]);
                    for (l, c) in four.iter().enumerate() {
                        let at = (r0 + 4 * h) * width + 64 * (4 * v + l);
                        // SAFETY: rows r0 + 4h .. + 4 < n rounded up to 8, block 4v + l of
                        // them inside `out`.
                        unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(at).cast(), *c) };
                    }
                }
            } else {
                for (k, c) in codes.iter().enumerate() {
                    // SAFETY: row r0 + k < n rounded up to 8, chunk v of it inside `out`.
                    unsafe {
                        _mm512_storeu_si512(out.as_mut_ptr().add((r0 + k) * width + 64 * v).cast(), *c)
                    };
                }
            }
        }
    }
    width
}

/// [`unpack_rows`] of key regions (at most [`MAX_REGIONS`]) into `ub`, transposed (`T`) as
/// [`region_scores`] reads them; returns the rows' width.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VBMI; the regions' rows lie whole in their codes
/// (as [`crate::regions::region_codes_ok`] checks) and `plan` is their [`HeadPlan`]; `ub`
/// holds their rows rounded up to 8 of their channels rounded up to 64.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn unpack_regions<const T: bool>(
    regions: &[crate::KeyRegion<'_>],
    plan: &HeadPlan,
    ub: &mut [u8],
) -> usize {
    let mut bases = [(std::ptr::null(), 0); MAX_REGIONS];
    for (b, r) in bases.iter_mut().zip(regions) {
        *b = (r.keys.codes.as_ptr(), r.keys.row_bytes);
    }
    // SAFETY: forwarded (the plan's pieces lie in the rows: `HeadPlan::new`).
    unsafe { unpack_rows::<T>(plan, &bases[..regions.len().min(MAX_REGIONS)], regions[0].keys.rows, ub) }
}

/// A 4 × 4 transpose of 16-byte lanes: lane `k` of result `l` is lane `l` of `s[k]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn transpose_lanes(s: &[__m512i; 4]) -> [__m512i; 4] {
    let t0 = _mm512_shuffle_i64x2::<0x44>(s[0], s[1]);
    let t1 = _mm512_shuffle_i64x2::<0x44>(s[2], s[3]);
    let t2 = _mm512_shuffle_i64x2::<0xEE>(s[0], s[1]);
    let t3 = _mm512_shuffle_i64x2::<0xEE>(s[2], s[3]);
    [
        _mm512_shuffle_i64x2::<0x88>(t0, t1),
        _mm512_shuffle_i64x2::<0xDD>(t0, t1),
        _mm512_shuffle_i64x2::<0x88>(t2, t3),
        _mm512_shuffle_i64x2::<0xDD>(t2, t3),
    ]
}

/// The sums (`MAX`: the maxima; no NaN) of the 16 lanes of each of 4 vectors, in order:
/// pairs interleaved and combined ([`lane_sums4`]'s order on floats), then the four 128-bit
/// lanes.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
pub(crate) fn fold4_ps<const MAX: bool>(a: &[__m512; 4]) -> __m128 {
    let f512 = |x, y| if MAX { _mm512_max_ps(x, y) } else { _mm512_add_ps(x, y) };
    let t0 = f512(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    let t1 = f512(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    let (t0, t1) = (_mm512_castps_pd(t0), _mm512_castps_pd(t1));
    let u = f512(_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)), _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1)));
    let (lo, hi) =
        (_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(u))));
    let y = if MAX { _mm256_max_ps(lo, hi) } else { _mm256_add_ps(lo, hi) };
    let (lo, hi) = (_mm256_castps256_ps128(y), _mm256_extractf128_ps::<1>(y));
    if MAX { _mm_max_ps(lo, hi) } else { _mm_add_ps(lo, hi) }
}

/// Step 2 of [`attend4`] for INT4 keys per group (`int4-g32`) or per row (`int4-token`, one
/// group of `D`): the scores themselves, query row `i`'s into `p[i · (FUSED_ROWS + 16)..]`,
/// four rows at a time and up to n rounded up to 4 (zero past n). Each 16-byte lane of a 64-byte chunk of codes holds 32 consecutive
/// channels (`int8::arrange4`'s order), inside one group, so the `vpdpbusd` sums of four rows
/// reduced lane by lane ([`lane_sums4`]) are the dots of 4 rows × 4 runs of 32 channels; one
/// permute of the quad's parameters puts each run's group scale and offset beside its dot, and
/// the score is `sq · Σ_runs scale · dot + Σ_runs offset · Σq`, the query's sum over the run
/// (`lane_sums`) in place of the group's (their sum): the algebra of the integer score path's
/// per-group epilogue with float sums in another order.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI; `k` is 4-bit per row or per group with
/// groups of a power of two multiple of 32 values, `D` (128 or 256) values a row and 1 to
/// [`FUSED_ROWS`] rows; `q8` holds `NQ` rows of `D` bytes arranged as [`vacc`] reads them;
/// `sq` and `lane_sums` hold the rows' scales and sums over each 32 channels; `p` holds `NQ`
/// rows of `FUSED_ROWS + 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn grouped_key_scores<const NQ: usize, const D: usize>(
    k: &QuantBlock<'_>,
    q8: &[u8],
    sq: &[f32; int8::GROUP],
    lane_sums: &[[f32; FUSED_DIM / 32]; int8::GROUP],
    p: &mut [f32],
    ahead: &mut Ahead,
) {
    let (group, ks, ko) = row_key_params(k);
    let (n, pr, rb) = (k.rows, FUSED_ROWS + 16, D / 2);
    let (per, lanes_per_group) = (D / group, group / 32);
    let held = n.checked_mul(rb).is_some_and(|b| b <= k.codes.len());
    assert!(
        (1..=FUSED_ROWS).contains(&n)
            && (D == 128 || D == 256)
            && k.dim == D
            && k.bits == 4
            && group.is_multiple_of(32)
            && per * group == D
            && k.row_bytes == rb
            && held
            && ks.len() >= n * per
            && ko.is_none_or(|o| o.len() >= n * per)
            && q8.len() >= NQ * D
            && p.len() >= NQ * pr,
        "a 4-bit block per group of whole lanes, its parameters, the queries and the scores"
    );
    let mask = _mm512_set1_epi8(0x0f);
    // Element 4L + j (lane L of chunk c, row j of the quad) takes the quad's parameter
    // j · per + (4c + L) / lanes_per_group; each query's sums over 32 channels, lane L of
    // chunk c holding run 4c + L's.
    let (mut idx, mut spread) = ([_mm512_setzero_si512(); FUSED_DIM / 128], [0i32; 16]);
    for (c, x) in idx.iter_mut().enumerate().take(D / 128) {
        let mut t = [0i32; 16];
        for (e, t) in t.iter_mut().enumerate() {
            *t = ((e % 4) * per + (4 * c + e / 4) / lanes_per_group) as i32;
        }
        // SAFETY: `t` holds 16 i32.
        *x = unsafe { _mm512_loadu_si512(t.as_ptr().cast()) };
    }
    let mut spreads = [_mm512_setzero_si512(); FUSED_DIM / 128];
    for (c, x) in spreads.iter_mut().enumerate().take(D / 128) {
        for (e, t) in spread.iter_mut().enumerate() {
            *t = (4 * c + e / 4) as i32;
        }
        // SAFETY: `spread` holds 16 i32.
        *x = unsafe { _mm512_loadu_si512(spread.as_ptr().cast()) };
    }
    let mut qs = [[_mm512_setzero_ps(); FUSED_DIM / 128]; int8::GROUP];
    if ko.is_some() {
        for (i, q) in qs.iter_mut().enumerate().take(NQ) {
            // SAFETY: row i of `lane_sums` holds FUSED_DIM / 32 = 8 floats (the masked lanes).
            let sums = unsafe { _mm512_maskz_loadu_ps(0xff, lane_sums[i].as_ptr()) };
            for (x, &sp) in q.iter_mut().zip(&spreads).take(D / 128) {
                *x = _mm512_permutexvar_ps(sp, sums);
            }
        }
    }
    let mut qr = [[_mm512_setzero_si512(); 2 * FUSED_DIM / 128]; int8::GROUP];
    for (i, x) in qr.iter_mut().enumerate().take(NQ) {
        for (t, x) in x.iter_mut().enumerate().take(2 * D / 128) {
            // SAFETY: 64 · t + 64 <= D, inside row i of `q8`.
            *x = unsafe { _mm512_loadu_si512(q8.as_ptr().add(i * D + 64 * t).cast()) };
        }
    }
    let sqv: [__m512; int8::GROUP] = std::array::from_fn(|i| _mm512_set1_ps(sq[i]));
    let mut r = 0;
    while r < n {
        ahead.step();
        let valid = (n - r).min(4);
        // The quad's parameters, row-major (`per` a row): 4 · per <= 32 values.
        let (m0, m1) = (lanes(valid * per), lanes((valid * per).saturating_sub(16)));
        // SAFETY: the masked lanes lie inside rows r .. r + valid of the parameters.
        let (s0, s1, f0, f1) = unsafe {
            let at = r * per;
            let s1 = if per > 4 {
                _mm512_maskz_loadu_ps(m1, ks.as_ptr().add(at + 16))
            } else {
                _mm512_setzero_ps()
            };
            let (f0, f1) = match ko {
                Some(f) if per > 4 => (
                    _mm512_maskz_loadu_ps(m0, f.as_ptr().add(at)),
                    _mm512_maskz_loadu_ps(m1, f.as_ptr().add(at + 16)),
                ),
                Some(f) => (_mm512_maskz_loadu_ps(m0, f.as_ptr().add(at)), _mm512_setzero_ps()),
                None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
            };
            (_mm512_maskz_loadu_ps(m0, ks.as_ptr().add(at)), s1, f0, f1)
        };
        let mut t = [_mm512_setzero_ps(); int8::GROUP];
        for c in 0..D / 128 {
            let mut acc = [[_mm512_setzero_si512(); 4]; int8::GROUP];
            for j in 0..4 {
                let v = if j < valid {
                    // SAFETY: row r + j < n lies in the codes (`held`); chunk c in the row.
                    unsafe { _mm512_loadu_si512(k.codes.as_ptr().add((r + j) * rb + 64 * c).cast()) }
                } else {
                    _mm512_setzero_si512()
                };
                let (lo, hi) = (_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
                for (a, q) in acc.iter_mut().zip(&qr).take(NQ) {
                    a[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[j], lo, q[2 * c]), hi, q[2 * c + 1]);
                }
            }
            let sc = _mm512_permutex2var_ps(s0, idx[c], s1);
            let fc = _mm512_permutex2var_ps(f0, idx[c], f1);
            for i in 0..NQ {
                let dots = _mm512_cvtepi32_ps(lane_sums4(&acc[i]));
                t[i] = _mm512_fmadd_ps(_mm512_mul_ps(sc, sqv[i]), dots, t[i]);
                if ko.is_some() {
                    t[i] = _mm512_fmadd_ps(fc, qs[i][c], t[i]);
                }
            }
        }
        for (i, t) in t.iter().enumerate().take(NQ) {
            // The four lanes (runs) of each row added: rows r .. r + 4.
            let h = _mm256_add_ps(
                _mm512_castps512_ps256(*t),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*t))),
            );
            let x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            // SAFETY: r + 4 <= n + 3 < pr, inside row i of `p`.
            unsafe { _mm_storeu_ps(p.as_mut_ptr().add(i * pr + r), x) };
        }
        r += 4;
    }
}

/// The group size, scales and offsets of keys per row (one group of a row) or per group.
///
/// # Panics
/// When `k` is per channel (the callers take keys per row or group only).
fn row_key_params<'a>(k: &QuantBlock<'a>) -> (usize, &'a [f32], Option<&'a [f32]>) {
    match k.params {
        Params::PerGroup { group, scale, offset } => (group, scale, offset),
        Params::PerRow { scale, offset } => (k.dim, scale, offset),
        Params::PerChannel { .. } => unreachable!("keys per row or group"),
    }
}

/// [`grouped_key_scores`] at head_dim 64 (rows of 32 bytes, two runs of 32 channels, one or
/// two groups): as [`dots64`], two rows side by side in a register against the query's nibble
/// planes repeated in both halves, four registers (eight rows) reduced lane by lane
/// ([`lane_sums4`]): element `4L + j` is row `2j + L / 2`'s run `L % 2`. The runs of each row
/// added, the scores of rows `r .. r + 8` come out as two vectors of alternate rows,
/// interleaved back into order.
///
/// # Safety
/// As [`grouped_key_scores`], with rows of 64 values; `p`'s rows have room for n rounded up
/// to 8.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn grouped_key_scores64<const NQ: usize>(
    k: &QuantBlock<'_>,
    q8: &[u8],
    sq: &[f32; int8::GROUP],
    lane_sums: &[[f32; FUSED_DIM / 32]; int8::GROUP],
    p: &mut [f32],
    ahead: &mut Ahead,
) {
    let (group, ks, ko) = row_key_params(k);
    let (n, pr) = (k.rows, FUSED_ROWS + 16);
    let (per, lanes_per_group) = (64 / group, group / 32);
    let held = n.checked_mul(32).is_some_and(|b| b <= k.codes.len());
    assert!(
        (1..=FUSED_ROWS).contains(&n)
            && k.dim == 64
            && k.bits == 4
            && (group == 32 || group == 64)
            && k.row_bytes == 32
            && held
            && ks.len() >= n * per
            && ko.is_none_or(|o| o.len() >= n * per)
            && q8.len() >= NQ * 64
            && p.len() >= NQ * pr,
        "a 4-bit block of 64 values per row or group of 32, its parameters, the queries and the scores"
    );
    let mask = _mm512_set1_epi8(0x0f);
    // Element 4L + j: row 2j + L / 2 of the eight, run L % 2; its parameter in the eight
    // rows' (per ≤ 2 a row: at most 16).
    let (mut idx, mut spread) = ([0i32; 16], [0i32; 16]);
    for (e, (x, y)) in idx.iter_mut().zip(spread.iter_mut()).enumerate() {
        let (lane, j) = (e / 4, e % 4);
        *x = ((2 * j + lane / 2) * per + (lane % 2) / lanes_per_group) as i32;
        *y = (lane % 2) as i32;
    }
    // SAFETY: both arrays hold 16 i32.
    let (idx, spread) =
        unsafe { (_mm512_loadu_si512(idx.as_ptr().cast()), _mm512_loadu_si512(spread.as_ptr().cast())) };
    let mut qs = [_mm512_setzero_ps(); int8::GROUP];
    let (mut ql, mut qh) = ([_mm512_setzero_si512(); int8::GROUP], [_mm512_setzero_si512(); int8::GROUP]);
    for i in 0..NQ {
        // SAFETY: row i of `q8` is 64 bytes; row i of `lane_sums` holds 8 floats (the masked
        // lanes).
        unsafe {
            ql[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(q8.as_ptr().add(64 * i).cast()));
            qh[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(q8.as_ptr().add(64 * i + 32).cast()));
            if ko.is_some() {
                qs[i] = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(0x03, lane_sums[i].as_ptr()));
            }
        }
    }
    let sqv: [__m512; int8::GROUP] = std::array::from_fn(|i| _mm512_set1_ps(sq[i]));
    let codes = &k.codes[..n * 32];
    let mut r = 0;
    while r < n {
        // Eight rows: two steps.
        ahead.step();
        ahead.step();
        let valid = (n - r).min(8);
        let pm = lanes(valid * per);
        // SAFETY: the masked lanes lie inside rows r .. r + valid of the parameters.
        let (sc, fc) = unsafe {
            let s = _mm512_maskz_loadu_ps(pm, ks.as_ptr().add(r * per));
            let f = ko.map_or(_mm512_setzero_ps(), |f| _mm512_maskz_loadu_ps(pm, f.as_ptr().add(r * per)));
            (_mm512_permutexvar_ps(idx, s), _mm512_permutexvar_ps(idx, f))
        };
        let mut acc = [[_mm512_setzero_si512(); 4]; int8::GROUP];
        for j in 0..4 {
            let v = if 2 * j + 2 <= valid {
                // SAFETY: rows r + 2j and r + 2j + 1 are the 64 bytes from 32 · (r + 2j).
                unsafe { _mm512_loadu_si512(codes.as_ptr().add(32 * (r + 2 * j)).cast()) }
            } else if 2 * j < valid {
                // SAFETY: the last row is the 32 bytes from 32 · (r + 2j); the upper half
                // stays zero.
                unsafe {
                    _mm512_zextsi256_si512(_mm256_loadu_si256(codes.as_ptr().add(32 * (r + 2 * j)).cast()))
                }
            } else {
                _mm512_setzero_si512()
            };
            let (lo, hi) = (_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
            for ((a, &l), &h) in acc.iter_mut().zip(&ql).zip(&qh).take(NQ) {
                a[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[j], lo, l), hi, h);
            }
        }
        for i in 0..NQ {
            let dots = _mm512_cvtepi32_ps(lane_sums4(&acc[i]));
            let mut t = _mm512_mul_ps(_mm512_mul_ps(sc, sqv[i]), dots);
            if ko.is_some() {
                t = _mm512_fmadd_ps(fc, qs[i], t);
            }
            // Lanes 0 + 1: rows r, r + 2, r + 4, r + 6; lanes 2 + 3: the rows between.
            let even = _mm_add_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps::<1>(t));
            let odd = _mm_add_ps(_mm512_extractf32x4_ps::<2>(t), _mm512_extractf32x4_ps::<3>(t));
            // SAFETY: r + 8 <= n + 7 < pr, inside row i of `p`.
            unsafe {
                let at = p.as_mut_ptr().add(i * pr + r);
                _mm_storeu_ps(at, _mm_unpacklo_ps(even, odd));
                _mm_storeu_ps(at.add(4), _mm_unpackhi_ps(even, odd));
            }
        }
        r += 8;
    }
}

/// The buffers [`grouped_values`] works in (see [`FusedScratch`]).
struct Grouped<'a> {
    p: &'a mut [f32],
    vt: &'a mut [f32],
    wg: &'a mut [f32],
    wq: &'a mut [u32],
    wx: &'a mut [i32],
    acc: &'a mut [i32],
    ahead: &'a mut Ahead,
}

/// Steps 3 and 4 of [`attend4`] for values per group (`int4-g32`, the values `kvq recommend`
/// picks for most layers), after the scores (`p`, query row `i` at `i · (FUSED_ROWS + 16)`),
/// their maxima `top` and the rescaling `factor` of the running state: the exponentials and
/// their sums, then per query row and group the weights `p · scale` rounded to bytes with
/// their own scale (the per-row algebra of the `int_values` module, one group of channels at a time,
/// as `int_values::axpy_grouped_reference`), and the sums through `vpdpbusd` as for values per row,
/// each 16-byte lane of an operand (32 channels, inside one group) carrying its group's
/// weights.
///
/// # Safety
/// As [`attend4`], `v` per group with groups of a multiple of 32 and `D` 64, 128 or 256
/// ([`crate::fused_layout_grouped`]); `top` and `factor` as [`attend4`] computed them.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn grouped_values<const NQ: usize, const D: usize>(
    v: &QuantBlock<'_>,
    top: &[f32; int8::GROUP],
    factor: &mut [f32; int8::GROUP],
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
    w: Grouped<'_>,
) {
    use int8::MAGIC;
    let Grouped { p, vt, wg, wq, wx, acc, ahead } = w;
    let Params::PerGroup { group, scale: vs, offset: vo } = v.params else { unreachable!("checked") };
    let (n, per, pr) = (v.rows, D / group, FUSED_ROWS + 16);
    assert!(
        (1..=FUSED_ROWS).contains(&n)
            && per <= MAX_GROUPS
            && p.len() >= NQ * pr
            && vt.len() >= 2 * MAX_GROUPS * pr
            && wg.len() >= NQ * MAX_GROUPS * pr
            && wq.len() >= NQ * QUADS * QUAD_GROUPS
            && wx.len() >= D.div_ceil(128) * NQ * QUADS * 16
            && acc.len() >= NQ * D
    );
    let (magic, magic_bits) = (_mm512_set1_ps(MAGIC), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    let z = _mm512_set1_ps(f32::from(int_values::center(4)));
    // The parameters by group, rows along (one vector load per 16 rows). (Indexed, the bounds
    // checks took most of this loop's time.)
    assert!(vs.len() >= n * per && vo.is_none_or(|o| o.len() >= n * per));
    // Four groups (32 of 128 values) take their parameters as they lie (`four_groups`): no
    // rows to transpose.
    let transposed = if per == 4 { 0 } else { n };
    for r in 0..transposed {
        for g in 0..per {
            // SAFETY: r < n and g < per: inside the parameters (asserted above) and inside
            // `vt`, whose rows hold pr > n values (asserted at the top).
            unsafe {
                *vt.get_unchecked_mut(g * pr + r) = *vs.get_unchecked(r * per + g);
                if let Some(vo) = vo {
                    *vt.get_unchecked_mut((MAX_GROUPS + g) * pr + r) = *vo.get_unchecked(r * per + g);
                }
            }
        }
    }
    let (mut gsw, mut gadd) = ([[0f32; MAX_GROUPS]; int8::GROUP], [[0f32; MAX_GROUPS]; int8::GROUP]);
    for i in 0..NQ {
        let quad_row = &mut wq[i * QUADS * QUAD_GROUPS..(i + 1) * QUADS * QUAD_GROUPS];
        if top[i] == f32::NEG_INFINITY {
            // Nothing of this row seen yet: no change. Its weight scales stay 0, which zeroes
            // whatever integer sums its (stale) byte weights give.
            factor[i] = 1.0;
            continue;
        }
        let (mv, pi) = (_mm512_set1_ps(top[i]), &mut p[i * pr..(i + 1) * pr]);
        let mut sum = _mm512_setzero_ps();
        for r in (0..n.div_ceil(16)).map(|j| 16 * j) {
            // SAFETY: r + 16 <= n + 15 < pr, inside row i of `p`.
            unsafe {
                let at = pi.as_mut_ptr().add(r);
                let e = _mm512_maskz_mov_ps(
                    lanes(n - r),
                    crate::softmax::x86::exp16(_mm512_sub_ps(_mm512_loadu_ps(at), mv)),
                );
                sum = _mm512_add_ps(sum, e);
                _mm512_storeu_ps(at, e);
            }
        }
        l[i] = l[i] * factor[i] + _mm512_reduce_add_ps(sum);
        m[i] = top[i];
        if per == 4 {
            let wrow = &mut wg[i * MAX_GROUPS * pr..(i + 1) * MAX_GROUPS * pr];
            // SAFETY: as this function's (AVX-512 F/BW/VL, n <= FUSED_ROWS, 4n parameters);
            // row i of `p` holds the exponentials, zero past n; `wrow` and `quad_row` are this
            // query row's.
            unsafe { four_groups(n, vs, vo, pi, wrow, quad_row, &mut gsw[i], &mut gadd[i]) };
            continue;
        }
        let (mut gmax, mut gnan) = ([0f32; MAX_GROUPS], [false; MAX_GROUPS]);
        for g in 0..per {
            let (mut mx, mut add) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let wrow = &mut wg[(i * MAX_GROUPS + g) * pr..(i * MAX_GROUPS + g + 1) * pr];
            for r in (0..n.div_ceil(16)).map(|j| 16 * j) {
                let mask = lanes(n - r);
                // SAFETY: r + 16 < pr: inside row i of `p`, the group's rows of `vt` and its
                // row of `wg`.
                unsafe {
                    let e = _mm512_loadu_ps(pi.as_ptr().add(r));
                    let wv = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(mask, vt.as_ptr().add(g * pr + r)));
                    // What the offsets and the centre add: Σ p · offset + z · Σ w.
                    add = _mm512_fmadd_ps(z, wv, add);
                    if vo.is_some() {
                        let f = _mm512_maskz_loadu_ps(mask, vt.as_ptr().add((MAX_GROUPS + g) * pr + r));
                        add = _mm512_fmadd_ps(e, f, add);
                    }
                    mx = _mm512_max_ps(wv, mx);
                    _mm512_storeu_ps(wrow.as_mut_ptr().add(r), wv);
                }
            }
            gmax[g] = _mm512_reduce_max_ps(mx);
            gadd[i][g] = _mm512_reduce_add_ps(add);
            // A NaN weight makes `add` NaN (z ≠ 0), and the maximum skips it: the group's scale
            // becomes NaN, so do its outputs. (`add` NaN without one: the outputs are NaN
            // through it anyway.)
            gnan[g] = gadd[i][g].is_nan();
        }
        let mut ginv = [0f32; MAX_GROUPS];
        for g4 in (0..per).step_by(4) {
            let four = |x: &[f32]| [x[g4], x[g4 + 1], x[g4 + 2], x[g4 + 3]];
            let (s, inv) =
                int8::scales_of4(four(&gmax), [gnan[g4], gnan[g4 + 1], gnan[g4 + 2], gnan[g4 + 3]], 255.0);
            gsw[i][g4..g4 + 4].copy_from_slice(&s);
            ginv[g4..g4 + 4].copy_from_slice(&inv);
        }
        for g in 0..per {
            let (invv, hi) = (_mm512_set1_ps(ginv[g]), _mm512_set1_ps(255.0));
            for r in (0..n.div_ceil(16)).map(|j| 16 * j) {
                // SAFETY: r + 16 < pr, inside the group's row of `wg` (zero weights past n).
                let bytes = unsafe {
                    let y = _mm512_min_ps(
                        _mm512_mul_ps(_mm512_loadu_ps(wg.as_ptr().add((i * MAX_GROUPS + g) * pr + r)), invv),
                        hi,
                    );
                    let code = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, magic)), magic_bits);
                    let mut b = [0u32; 4];
                    _mm_storeu_si128(b.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(code));
                    b
                };
                // Quads past the block's rows land in the padding (r + 16 <= pr = 4 · QUADS).
                for (t, &b) in bytes.iter().enumerate() {
                    quad_row[(r / 4 + t) * QUAD_GROUPS + g] = b;
                }
            }
        }
    }
    // SAFETY: `wq` holds the quads' weights of every query row (written above for the rows
    // seen), `wx` room for every operand (asserted at the top); n <= FUSED_ROWS.
    unsafe { group_operands::<NQ, D>(n, group, wq, wx) };
    if D == 64 {
        // SAFETY: `v` is 4-bit with rows of 64 codes and n rows; `wx` holds the operands of
        // every query row and 8 rows; `acc` NQ · 64 values.
        unsafe { vsums_bytes64::<NQ, true>(v, n, &[], 0, wx, acc, ahead) };
    } else {
        // SAFETY: `v` is 4-bit with D a multiple of 128 and 1..=FUSED_ROWS rows; `wx` holds
        // the operands of every chunk, query row and quad of the rows; `acc` NQ · D values.
        unsafe { vsums_bytes::<NQ, true>(v, 0..n, &[], 0, false, wx, acc, ahead) };
    }
    rescale_add_grouped::<NQ, D>(o, acc, factor, group, &gsw, &gadd);
}

/// [`grouped_values`]' operands of `vpdpbusd` from the byte weights of each quad's groups
/// (`wq`) into `wx`: for rows of a multiple of 128 codes, per chunk, query row and quad of rows
/// the weights of the groups of each 16-byte lane (32 channels) repeated over the lane; for
/// rows of 64 codes, per 8 rows, as [`vsums_bytes64`] reads them.
///
/// # Safety
/// `n <= FUSED_ROWS`; `group` divides `D` (64, 128 or 256) and is a multiple of 32; `wq` holds
/// `NQ · QUADS · QUAD_GROUPS` values and `wx` `D.div_ceil(128) · NQ · QUADS · 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn group_operands<const NQ: usize, const D: usize>(
    n: usize,
    group: usize,
    wq: &[u32],
    wx: &mut [i32],
) {
    let quads = n.div_ceil(4);
    // Each (chunk, query row, quad)'s operand: 16-byte lane L holds channels 128c + 32L ..
    // + 32, of group (128c + 32L) / group; its four weights repeated over the lane's 4 i32s.
    for c in 0..D / 128 {
        let g0 = 128 * c / group;
        let mut ix = [0i32; 16];
        for (k, x) in ix.iter_mut().enumerate() {
            *x = ((128 * c + 32 * (k / 4)) / group - g0) as i32;
        }
        // SAFETY: `ix` holds 16 values.
        let idx = unsafe { _mm512_loadu_si512(ix.as_ptr().cast()) };
        for i in 0..NQ {
            for t in 0..quads {
                // SAFETY: g0 + 4 <= per + 3 < QUAD_GROUPS, so the 16 bytes lie in quad t's
                // groups of row i of `wq`; the operand lies inside `wx` (t < QUADS).
                unsafe {
                    let src = _mm_loadu_si128(wq.as_ptr().add((i * QUADS + t) * QUAD_GROUPS + g0).cast());
                    let x = _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(src));
                    _mm512_storeu_si512(wx.as_mut_ptr().add(16 * ((c * NQ + i) * QUADS + t)).cast(), x);
                }
            }
        }
    }
    if D == 64 {
        // Rows of 64 codes ([`vsums_bytes64`]): lane L of the operand of query row i and rows
        // 8t .. 8t + 8 holds channels 32 (L % 2) .. + 32 of rows 8t + 4 (L / 2) .. + 4, so
        // quad 2t + L / 2 of group 32 (L % 2) / group; from the quads' first two groups.
        let mut ix = [0i32; 16];
        for (k, x) in ix.iter_mut().enumerate() {
            let lane = k / 4;
            *x = (2 * (lane / 2) + 32 * (lane % 2) / group) as i32;
        }
        // SAFETY: `ix` holds 16 values.
        let idx = unsafe { _mm512_loadu_si512(ix.as_ptr().cast()) };
        for i in 0..NQ {
            for t in 0..n.div_ceil(8) {
                let q = (i * QUADS + 2 * t) * QUAD_GROUPS;
                // SAFETY: 2t + 1 < QUADS (n <= FUSED_ROWS), so both quads' first two groups
                // lie in row i of `wq`; the operand lies inside `wx`.
                unsafe {
                    let src = _mm_unpacklo_epi64(
                        _mm_loadl_epi64(wq.as_ptr().add(q).cast()),
                        _mm_loadl_epi64(wq.as_ptr().add(q + QUAD_GROUPS).cast()),
                    );
                    let x = _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(src));
                    _mm512_storeu_si512(wx.as_mut_ptr().add(16 * (i * QUADS + t)).cast(), x);
                }
            }
        }
    }
}

/// The epilogue of [`grouped_values`]: `o ← o · factor + (sw · acc + add)` for each of the `NQ`
/// query rows, `sw` and `add` those of each channel's group.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
fn rescale_add_grouped<const NQ: usize, const D: usize>(
    o: &mut [f32],
    acc: &[i32],
    factor: &[f32; int8::GROUP],
    group: usize,
    gsw: &[[f32; MAX_GROUPS]; int8::GROUP],
    gadd: &[[f32; MAX_GROUPS]; int8::GROUP],
) {
    assert!(
        o.len() >= NQ * D && acc.len() >= NQ * D && group.is_power_of_two() && D / group <= MAX_GROUPS,
        "shapes"
    );
    for i in 0..NQ {
        let f = _mm512_set1_ps(factor[i]);
        for c in (0..D / 16).map(|j| 16 * j) {
            // A shift: groups are 32, 64, 128 or 256 values (they divide D).
            let g = c >> group.trailing_zeros();
            let (s, a) = (_mm512_set1_ps(gsw[i][g]), _mm512_set1_ps(gadd[i][g]));
            // SAFETY: c + 16 <= D, inside row i of `o` and `acc`.
            unsafe {
                let at = o.as_mut_ptr().add(i * D + c);
                let x = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc.as_ptr().add(i * D + c).cast()));
                let old = _mm512_loadu_ps(at);
                let old = if factor[i] != 1.0 { _mm512_mul_ps(old, f) } else { old };
                _mm512_storeu_ps(at, _mm512_add_ps(old, _mm512_add_ps(_mm512_mul_ps(s, x), a)));
            }
        }
    }
}

/// [`grouped_values`]' weights of one query row for four groups (32 channels each of 128), in
/// the parameters' own layout: 16 lanes are 4 rows × 4 groups, each row's exponential spread
/// over its 4 lanes by one permute, the groups' maxima and sums taken by two lane folds, and
/// each 4 rows' 16 byte weights turned into the 4 groups' quads by one `vpshufb`, stored as
/// one row of `wq` (no transposition of the parameters, no pass per group).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL; `n <= FUSED_ROWS`; `vs` (and `vo`) hold `4n`
/// values; `e` holds the row's exponentials, zero from n to a multiple of 16; `w` holds
/// `4 · (n rounded up to 16)` floats; `quads` holds the row's `QUADS · QUAD_GROUPS`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn four_groups(
    n: usize,
    vs: &[f32],
    vo: Option<&[f32]>,
    e: &[f32],
    w: &mut [f32],
    quads: &mut [u32],
    gsw: &mut [f32; MAX_GROUPS],
    gadd: &mut [f32; MAX_GROUPS],
) {
    use int8::MAGIC;
    let rows16 = n.next_multiple_of(16);
    assert!(n <= FUSED_ROWS && vs.len() >= 4 * n && vo.is_none_or(|o| o.len() >= 4 * n));
    assert!(e.len() >= rows16 && w.len() >= 4 * rows16 && quads.len() >= QUADS * QUAD_GROUPS);
    let z = _mm512_set1_ps(f32::from(int_values::center(4)));
    let (mut mx, mut add) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    // Lane k of sub-chunk s: row 4s + k / 4 of the 16 rows, group k % 4.
    let spread: [__m512i; 4] = std::array::from_fn(|s| {
        let ix: [i32; 16] = std::array::from_fn(|k| (4 * s + k / 4) as i32);
        // SAFETY: `ix` holds 16 values.
        unsafe { _mm512_loadu_si512(ix.as_ptr().cast()) }
    });
    for r16 in (0..rows16).step_by(16) {
        // SAFETY: r16 + 16 <= rows16 <= e.len().
        let e16 = unsafe { _mm512_loadu_ps(e.as_ptr().add(r16)) };
        for (s, idx) in spread.iter().enumerate() {
            let r = r16 + 4 * s;
            // The lanes of rows below n (parameters past them are not read).
            let mask = lanes(4 * n.saturating_sub(r));
            let ee = _mm512_permutexvar_ps(*idx, e16);
            // SAFETY: the masked lanes lie inside the parameters (rows below n); `w` holds
            // 4 · rows16 > 4r + 15 floats.
            unsafe {
                let wv = _mm512_mul_ps(ee, _mm512_maskz_loadu_ps(mask, vs.as_ptr().add(4 * r.min(n))));
                add = _mm512_fmadd_ps(z, wv, add);
                if let Some(vo) = vo {
                    add =
                        _mm512_fmadd_ps(ee, _mm512_maskz_loadu_ps(mask, vo.as_ptr().add(4 * r.min(n))), add);
                }
                // A NaN weight is skipped here (the second operand is returned) and makes
                // its group's `add` NaN.
                mx = _mm512_max_ps(wv, mx);
                _mm512_storeu_ps(w.as_mut_ptr().add(4 * r), wv);
            }
        }
    }
    // Lanes k, k + 4, k + 8, k + 12 hold group k: fold the 256-bit halves, then the 128-bit
    // lanes of each half.
    let fold = |x: __m512, max: bool| {
        let op = |a, b| if max { _mm512_max_ps(a, b) } else { _mm512_add_ps(a, b) };
        let x = op(x, _mm512_shuffle_f32x4::<0x4E>(x, x));
        op(x, _mm512_shuffle_f32x4::<0xB1>(x, x))
    };
    let (mut gm, mut ga) = ([0f32; 16], [0f32; 16]);
    // SAFETY: both hold 16 floats.
    unsafe {
        _mm512_storeu_ps(gm.as_mut_ptr(), fold(mx, true));
        _mm512_storeu_ps(ga.as_mut_ptr(), fold(add, false));
    }
    let four = |x: &[f32; 16]| [x[0], x[1], x[2], x[3]];
    // A NaN weight makes its group's `add` NaN (z ≠ 0): the scale becomes NaN, so do the
    // group's outputs.
    let (sw, inv) = int8::scales_of4(four(&gm), four(&ga).map(f32::is_nan), 255.0);
    gsw[..4].copy_from_slice(&sw);
    gadd[..4].copy_from_slice(&four(&ga));
    // SAFETY: `inv` holds 4 floats.
    let invv = _mm512_broadcast_f32x4(unsafe { _mm_loadu_ps(inv.as_ptr()) });
    let (hi, magic, magic_bits) =
        (_mm512_set1_ps(255.0), _mm512_set1_ps(MAGIC), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    // Bytes (row, group) of 4 rows to quads (group, row).
    let turn = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for q in 0..n.div_ceil(4) {
        // SAFETY: 4q + 4 <= rows16: inside `w` (zero weights past n); quad row q < QUADS.
        unsafe {
            let y = _mm512_min_ps(_mm512_mul_ps(_mm512_loadu_ps(w.as_ptr().add(16 * q)), invv), hi);
            let code = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, magic)), magic_bits);
            let b = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(code), turn);
            _mm_storeu_si128(quads.as_mut_ptr().add(q * QUAD_GROUPS).cast(), b);
        }
    }
}

/// The sums of [`hsum4_zmm`] taken separately over the low and the high 256 bits of each of the
/// four accumulators (two rows of 64 codes side by side in one register).
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn hsum4_halves(a: &[__m512i; 4]) -> ([i32; 4], [i32; 4]) {
    let u = lane_sums4(a);
    let fold = |y: __m256i| _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256::<1>(y));
    let (lo, hi) = (fold(_mm512_castsi512_si256(u)), fold(_mm512_extracti64x4_epi64::<1>(u)));
    let (mut a, mut b) = ([0i32; 4], [0i32; 4]);
    // SAFETY: each array holds 4 i32.
    unsafe {
        _mm_storeu_si128(a.as_mut_ptr().cast(), lo);
        _mm_storeu_si128(b.as_mut_ptr().cast(), hi);
    }
    (a, b)
}

/// The integer dots of `NQ` query rows of 64 rounded values (in the order of
/// `int8::arrange4` with 32-byte chunks) with every row of the 4-bit block `k` of 64 codes:
/// two consecutive rows (64 contiguous bytes) in one register against the query's 32 bytes
/// of each nibble plane repeated in both halves, the halves reduced apart.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI; `k.bits == 4`, `k.dim == 64`; `q8` holds
/// `NQ` rows of 64 bytes, `dots` `NQ · k.rows` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn dots64<const NQ: usize>(k: &QuantBlock<'_>, q8: &[u8], dots: &mut [i32], ahead: &mut Ahead) {
    let n = k.rows;
    let mask = _mm512_set1_epi8(0x0f);
    assert!(k.dim == 64 && q8.len() >= NQ * 64 && dots.len() >= NQ * n);
    let mut ql = [_mm512_setzero_si512(); int8::GROUP];
    let mut qh = [_mm512_setzero_si512(); int8::GROUP];
    for i in 0..NQ {
        // SAFETY: row i of `q8` is 64 bytes.
        unsafe {
            ql[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(q8.as_ptr().add(64 * i).cast()));
            qh[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(q8.as_ptr().add(64 * i + 32).cast()));
        }
    }
    let codes = &k.codes[..n * 32];
    let mut r = 0;
    while r + 2 <= n {
        if r % 4 == 0 {
            ahead.step();
        }
        // SAFETY: rows r and r + 1 are the 64 bytes from 32 · r.
        let v = unsafe { _mm512_loadu_si512(codes.as_ptr().add(32 * r).cast()) };
        let (lo, hi) = (_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
        let mut acc = [_mm512_setzero_si512(); 4];
        for i in 0..NQ {
            acc[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i], lo, ql[i]), hi, qh[i]);
        }
        // SAFETY: AVX-512 is enabled by this function's target features.
        let (a, b) = unsafe { hsum4_halves(&acc) };
        for i in 0..NQ {
            dots[i * n + r] = a[i];
            dots[i * n + r + 1] = b[i];
        }
        r += 2;
    }
    if r < n {
        // SAFETY: the last row is the 32 bytes from 32 · r; the upper half stays zero.
        let v = unsafe { _mm512_zextsi256_si512(_mm256_loadu_si256(codes.as_ptr().add(32 * r).cast())) };
        let (lo, hi) = (_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
        let mut acc = [_mm512_setzero_si512(); 4];
        for i in 0..NQ {
            acc[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i], lo, ql[i]), hi, qh[i]);
        }
        // SAFETY: AVX-512 is enabled by this function's target features.
        let (a, _) = unsafe { hsum4_halves(&acc) };
        for i in 0..NQ {
            dots[i * n + r] = a[i];
        }
    }
}

/// [`vsums_bytes`] for rows of 64 codes, written (not added): eight rows at a time, rows
/// `j .. j + 4` in the low 256 bits of each register and rows `j + 4 .. j + 8` in the high
/// ones against their own four byte weights, the two halves added at the end. With weights
/// per group (`GW`), the operand of query row `i` and rows `j .. j + 8` is
/// `wx[16 · (i · QUADS + j / 8)..][..16]`, and `wb` is not read.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI; `v.bits == 4`, `v.dim == 64`, `n ==
/// v.rows >= 1`; `stride >= n` rounded up to a multiple of 8, `wb` holds `NQ · stride` bytes,
/// zero from `n` to the stride in each row (`GW`: `wx` holds the operands of every query row
/// and 8 rows instead); `acc` holds `NQ · 64` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c")]
unsafe fn vsums_bytes64<const NQ: usize, const GW: bool>(
    v: &QuantBlock<'_>,
    n: usize,
    wb: &[u8],
    stride: usize,
    wx: &[i32],
    acc: &mut [i32],
    ahead: &mut Ahead,
) {
    let mask = _mm512_set1_epi8(0x0f);
    let centre = _mm512_set1_epi8(int_values::center(4) as i8);
    assert!(v.dim == 64 && n >= 1 && n <= v.rows && n <= FUSED_ROWS);
    if GW {
        assert!(wx.len() >= 16 * NQ * QUADS);
    } else {
        assert!(stride >= n.next_multiple_of(8) && wb.len() >= NQ * stride);
    }
    assert!(acc.len() >= NQ * 64);
    let row = |r: usize| -> __m256i {
        // SAFETY: row min(r, n − 1) is 32 bytes of the block.
        unsafe { _mm256_loadu_si256(v.row(r.min(n - 1)).as_ptr().cast()) }
    };
    for plane in 0..2 {
        let mut sums = [[_mm512_setzero_si512(); 4]; NQ];
        let mut j = 0;
        while j < n {
            // Rows past the end repeat the last one, under zero weights.
            let nib = |kk: usize| {
                let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(row(j + kk)), row(j + 4 + kk));
                let x = if plane == 0 { x } else { _mm512_srli_epi16(x, 4) };
                _mm512_sub_epi8(_mm512_and_si512(x, mask), centre)
            };
            // As in `vsums_bytes`: x[k] in 16-byte lane L holds channels 32 (L % 2) + 4k .. + 4
            // of the plane, bytes = rows j .. j + 4 (L < 2) or j + 4 .. j + 8 (L >= 2).
            let x = interleave4([nib(0), nib(1), nib(2), nib(3)]);
            ahead.step();
            ahead.step();
            for (i, s) in sums.iter_mut().enumerate() {
                let wv = if GW {
                    // SAFETY: j / 8 < QUADS (n <= FUSED_ROWS): inside `wx` (asserted above).
                    unsafe { _mm512_loadu_si512(wx.as_ptr().add(16 * (i * QUADS + j / 8)).cast()) }
                } else {
                    // SAFETY: j is a multiple of 8 below n, so i · stride + j + 8 <= NQ · stride.
                    let (w0, w1) = unsafe {
                        let p = wb.as_ptr().add(i * stride + j);
                        (p.cast::<i32>().read_unaligned(), p.add(4).cast::<i32>().read_unaligned())
                    };
                    _mm512_inserti64x4::<1>(_mm512_set1_epi32(w0), _mm256_set1_epi32(w1))
                };
                for (s, &x) in s.iter_mut().zip(&x) {
                    *s = _mm512_dpbusd_epi32(*s, wv, x);
                }
            }
            j += 8;
        }
        for (i, s) in sums.iter().enumerate() {
            let h = s.map(|x| _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64::<1>(x)));
            let out = &mut acc[i * 64..(i + 1) * 64];
            let parts = [
                (16 * plane, _mm256_permute2x128_si256::<0x20>(h[0], h[1])),
                (16 * plane + 8, _mm256_permute2x128_si256::<0x20>(h[2], h[3])),
                (32 + 16 * plane, _mm256_permute2x128_si256::<0x31>(h[0], h[1])),
                (32 + 16 * plane + 8, _mm256_permute2x128_si256::<0x31>(h[2], h[3])),
            ];
            for (at, x) in parts {
                // SAFETY: at + 8 <= 64, inside query row i of `acc`.
                unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(at).cast(), x) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::HeadPlan;

    /// The AVX-512 and AVX2 fused kernels ask for the queue of `Scratch::prefetch_next` from
    /// their row loops (at least half of it before they return, for keys per channel, per
    /// group and per row, key regions, INT4 and narrow values, head_dims 64 to 256, one to two
    /// query groups), leave it empty, and return what they return without it, bit for bit.
    #[test]
    fn fused_kernels_step_the_queued_prefetch() {
        for backend in [crate::Backend::Avx512, crate::Backend::Avx2] {
            step_the_queued_prefetch(backend);
        }
    }

    /// The per-channel INT4 dots of one to three query rows (`vdots_with`, the fused kernel's
    /// keys for GQA groups under four and multi-head attention) ask for the queue every four
    /// rows, whatever the number of query rows, and return the dots they return without one.
    #[test]
    fn per_channel_dots_step_the_queue_every_four_rows() {
        use super::{_mm512_setzero_si512, Ahead, vdots_with};
        use crate::{Params, QuantBlock};
        if !super::cpu_ok() {
            return;
        }
        let next = vec![3u8; 64 * 80];
        for (n, d) in [(128usize, 128usize), (37, 256), (4, 128), (3, 128)] {
            let codes: Vec<u8> = (0..n * d / 2).map(|i| (i * 37 % 251) as u8).collect();
            let (scale, offset) = (vec![0.02f32; d], vec![-0.1f32; d]);
            let params = Params::PerChannel { scale: &scale, offset: Some(&offset) };
            let b = QuantBlock::new(&codes, n, d, 4, crate::Levels::Affine, params).unwrap();
            let q: Vec<u8> = (0..4 * d).map(|i| (i * 11 % 256) as u8).collect();
            let run = |nq: usize, ahead: &mut Ahead| -> Vec<i32> {
                let mut dots = vec![0i32; nq * n];
                // SAFETY: AVX-512 VNNI (checked above); 4-bit rows of d (a multiple of 128)
                // codes; `q` holds nq rows of d bytes and `dots` nq · n values.
                unsafe {
                    let z = _mm512_setzero_si512();
                    match nq {
                        1 => vdots_with::<4, 1, false, true>(&b, 0..n, &q[..d], z, &mut dots, ahead),
                        2 => vdots_with::<4, 2, false, true>(&b, 0..n, &q[..2 * d], z, &mut dots, ahead),
                        _ => vdots_with::<4, 3, false, true>(&b, 0..n, &q[..3 * d], z, &mut dots, ahead),
                    }
                }
                dots
            };
            for nq in 1..=3 {
                // One line a step: the lines asked for count the steps.
                let mut ahead = Ahead::default();
                ahead.push(&next);
                let lines = ahead.lines();
                ahead.pace(lines);
                let dots = run(nq, &mut ahead);
                assert_eq!(dots, run(nq, &mut Ahead::default()), "{n} x {d}, {nq} query rows");
                // A step at each row r = 0, 4, 8, ... that starts a step of the loop (4 / nq
                // rows; the last rows, fewer, go one by one without one).
                let per = 4 / nq;
                let steps = if n >= per { (n - per) / 4 + 1 } else { 0 };
                assert_eq!(ahead.stepped, steps.min(lines), "{n} x {d}, {nq} query rows: steps");
            }
        }
    }

    fn step_the_queued_prefetch(backend: crate::Backend) {
        use crate::{Backend, Online, Params, QuantBlock, Scratch};
        let Ok(backend) = crate::Kernels::new(backend) else { return };
        let vbmi = super::vbmi_ok();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // What the caller would read next: a unit of two blocks (gone by the time it is asked
        // for does not matter: a hint).
        let (next_keys, next_values) = (vec![1u8; 9000], vec![2u8; 8500]);
        let n = 128;
        // (key bits, key parameters, value bits, value parameters, head_dim): 'c' per
        // channel, 'r' per row, 'g' per group of 32.
        for (kb, kp, vb, vp, d) in [
            (4, 'c', 4, 'r', 128),
            (4, 'c', 4, 'r', 64),
            (4, 'c', 4, 'r', 256),
            (4, 'g', 4, 'g', 128),
            (4, 'r', 4, 'g', 64),
            (4, 'g', 4, 'r', 256),
            (3, 'c', 2, 'r', 128),
            (4, 'c', 3, 'r', 64),
        ] {
            let codes = |bits: u8, next: &mut dyn FnMut() -> u64| -> Vec<u8> {
                let len = n * kvq_quant_core::pack::packed_len(d, bits).unwrap();
                (0..len).map(|_| next() as u8).collect()
            };
            let floats = |len: usize, base: f32, next: &mut dyn FnMut() -> u64| -> Vec<f32> {
                (0..len).map(|_| base + (next() % 1000) as f32 / 4000.0).collect()
            };
            let (kc, vc) = (codes(kb, &mut next), codes(vb, &mut next));
            let count = |p: char| match p {
                'c' => d,
                'r' => n,
                _ => n * d / 32,
            };
            let (ks, ko) = (floats(count(kp), 0.01, &mut next), floats(count(kp), -0.3, &mut next));
            let (vs, vo) = (floats(count(vp), 0.01, &mut next), floats(count(vp), -0.3, &mut next));
            let params = |p: char, scale: &'static [f32], offset: &'static [f32]| match p {
                'c' => Params::PerChannel { scale, offset: Some(offset) },
                'r' => Params::PerRow { scale, offset: Some(offset) },
                _ => Params::PerGroup { group: 32, scale, offset: Some(offset) },
            };
            let leak = |v: Vec<f32>| -> &'static [f32] { Vec::leak(v) };
            let (ks, ko, vs, vo) = (leak(ks), leak(ko), leak(vs), leak(vo));
            let k = QuantBlock::new(&kc, n, d, kb, crate::Levels::Affine, params(kp, ks, ko)).unwrap();
            let v = QuantBlock::new(&vc, n, d, vb, crate::Levels::Affine, params(vp, vs, vo)).unwrap();
            let stepped = if backend == Backend::Avx512 {
                super::attend_int_parts_supported(&[k], &v, 4) && (kb == 4 || vbmi) && (vb == 4 || vbmi)
            } else {
                crate::fused_avx2::attend_int_parts_supported(&[k], &v, 4)
            };
            for n_q in [1, 2, 3, 4, 8] {
                let q: Vec<f32> = (0..n_q * d).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
                let run = |scratch: &mut Scratch| {
                    let (mut m, mut l, mut o) =
                        (vec![f32::NEG_INFINITY; n_q], vec![0f32; n_q], vec![0f32; n_q * d]);
                    let state = Online { m: &mut m, l: &mut l, o: &mut o };
                    let ran = crate::attend_int_parts_in(backend, scratch, &[k], &v, &q, n_q, state).unwrap();
                    assert!(ran, "{backend} {kb}{kp} {vb}{vp} {d} {n_q}: a fused kernel");
                    (m, l, o)
                };
                let plain = run(&mut Scratch::default());
                let mut scratch = Scratch::default();
                scratch.prefetch_next(&next_keys);
                scratch.prefetch_next(&next_values);
                let queued = scratch.ahead.lines();
                let got = run(&mut scratch);
                let bits = |x: &(Vec<f32>, Vec<f32>, Vec<f32>)| -> Vec<u32> {
                    x.0.iter().chain(&x.1).chain(&x.2).map(|f| f.to_bits()).collect()
                };
                assert_eq!(bits(&got), bits(&plain), "{kb}{kp} {vb}{vp} {d} {n_q}");
                let slot =
                    if backend == Backend::Avx512 { &scratch.fused.ahead } else { &scratch.fused_avx2.ahead };
                assert_eq!((scratch.ahead.lines(), slot.lines()), (0, 0));
                if stepped {
                    let asked = slot.stepped;
                    assert!(
                        2 * asked >= queued,
                        "{backend} {kb}{kp} {vb}{vp} {d} {n_q}: {asked} of {queued} lines stepped"
                    );
                }
            }
        }
    }

    /// Rows of every width and multiple of 8 codes, whose codes end where an unreadable page
    /// begins, come back from `unpack_rows` as quant-core packed them, padded to 64.
    #[cfg(target_os = "linux")]
    #[test]
    fn unpacked_rows_are_the_packed_codes() {
        if !super::vbmi_ok() {
            return;
        }
        let mut ub = vec![0u8; super::UNPACKED];
        crate::region_tests::check_unpacking(64, |regions| {
            let plan = HeadPlan::new(&[(regions[0].keys.dim, regions[0].keys.bits)]);
            // SAFETY: AVX-512 with VBMI (checked above); one region of whole rows; `ub` holds
            // 264 rows of 256.
            let width = unsafe { super::unpack_regions::<false>(regions, &plan, &mut ub) };
            let rows = regions[0].keys.rows.next_multiple_of(8);
            let want = ub[..rows * width].to_vec();
            // The same rows transposed: each four rows' 16-channel blocks side by side.
            // SAFETY: as above.
            unsafe { super::unpack_regions::<true>(regions, &plan, &mut ub) };
            for (r, row) in want.chunks_exact(width).enumerate() {
                for (m, block) in row.chunks_exact(16).enumerate() {
                    let at = r / 4 * 4 * width + 64 * m + 16 * (r % 4);
                    assert_eq!(&ub[at..at + 16], block, "row {r} block {m}");
                }
            }
            (want, width)
        });
    }

    /// What the pieces of chunk `v` of `plan` give for the packed rows `rows` (one per region),
    /// the instructions emulated: `vpermb` of the loaded bytes, `vpmultishiftqb`, the mask.
    fn unpack(plan: &HeadPlan, rows: &[Vec<u8>], v: usize) -> [u8; 64] {
        let mut codes = [0u8; 64];
        for pc in &plan.pieces[plan.starts[v]..plan.starts[v + 1]] {
            let row = &rows[pc.region];
            let window: Vec<u8> =
                (0..64).map(|j| if pc.mask >> j & 1 == 1 { row[pc.at + j] } else { 0 }).collect();
            let moved: Vec<u8> = pc.idx.iter().map(|&i| window[usize::from(i) & 63]).collect();
            for k in 0..64 {
                let lane = u64::from_le_bytes(moved[k / 8 * 8..k / 8 * 8 + 8].try_into().unwrap());
                let picked = lane.rotate_right(u32::from(pc.ctrl[k] & 63)) as u8;
                codes[k] |= picked & pc.keep[k];
            }
        }
        codes
    }

    /// Every layout of regions the fused kernel takes unpacks to the codes `pack` stored: each
    /// width 1 to 8 at every multiple of 8 channels up to 256 and every start that leaves room,
    /// beside a region of 8-bit codes before and after it; the lanes name their regions.
    #[test]
    fn head_plans_unpack_every_region_layout() {
        let mut rng = kvq_quant_core::synth::Rng::new(7);
        for bits in 1..=8u8 {
            for dim in (8..=256).step_by(8) {
                for first in (0..=256 - dim).step_by(8) {
                    let rest = 256 - dim - first;
                    let mut shapes = Vec::new();
                    if first > 0 {
                        shapes.push((first, 8u8));
                    }
                    shapes.push((dim, bits));
                    if rest > 0 {
                        shapes.push((rest, 3u8));
                    }
                    let plan = HeadPlan::new(&shapes);
                    let mut want = Vec::new();
                    let rows: Vec<Vec<u8>> = shapes
                        .iter()
                        .map(|&(c, b)| {
                            let codes: Vec<u8> = (0..c).map(|_| rng.below(1u64 << b) as u8).collect();
                            want.extend_from_slice(&codes);
                            kvq_quant_core::pack::pack(&codes, b).unwrap()
                        })
                        .collect();
                    for v in 0..4 {
                        let got = unpack(&plan, &rows, v);
                        assert_eq!(got[..], want[64 * v..64 * v + 64], "{shapes:?} chunk {v}");
                    }
                    // The runs cover the blocks in order, their lanes naming each quarter's region.
                    let mut region = Vec::new();
                    for (j, &(c, _)) in shapes.iter().enumerate() {
                        region.extend(std::iter::repeat_n(j as i32, c / 4));
                    }
                    let mut end = 0;
                    for (i, &(m0, m1, lanes)) in plan.runs.iter().enumerate() {
                        assert!(m0 == end && m1 > m0, "{shapes:?}");
                        for m in m0..m1 {
                            for l in 0..16 {
                                assert_eq!(lanes[l], region[4 * m + l % 4], "{shapes:?}");
                            }
                        }
                        // Runs end where the quarters' regions change.
                        if let Some(next) = plan.runs.get(i + 1) {
                            assert_ne!(next.2, lanes, "{shapes:?}");
                        }
                        end = m1;
                    }
                    assert_eq!(end, 16, "{shapes:?}");
                }
            }
        }
    }
}
