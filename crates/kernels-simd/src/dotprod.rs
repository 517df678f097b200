//! aarch64 integer score path with the dot-product extension: `sdot` multiplies 16 signed bytes
//! by 16 signed bytes into 4 i32 lanes. `vdotq_s32` is still unstable in Rust, so the
//! instruction is issued with `asm!` inside a `#[target_feature(enable = "dotprod")]` function,
//! chosen at run time when detection finds the extension (`crate::dispatch`).
//!
//! Covered: affine 4-bit rows of a multiple of 32 codes and 8-bit rows of a multiple of 16,
//! with parameters per row or per channel; 4-bit rows per group of a multiple of 32 codes (one
//! dot per group, `int4-g32`); 4-bit rows of a 16-level table or symmetric levels (`nf4`,
//! `sym4`: each code looked up in the table's int8 levels with `tbl`, `int8::table8`), per
//! row, channel or group. 4-bit codes (0..=15) are valid signed bytes; 8-bit codes are shifted
//! by −128 and the shift is added back as `128 · Σ q8`. Same query rounding and error bound as
//! the AVX2 path.

use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

use crate::block::{Levels, Params, QuantBlock};
use crate::int8;

pub(crate) fn cpu_ok() -> bool {
    crate::dispatch::cpu().dotprod
}

/// Whether [`scores_int8_in`] has a kernel for this block on this CPU.
pub fn int8_supported(b: &QuantBlock<'_>) -> bool {
    let ok_dim = match b.bits {
        4 => b.dim.is_multiple_of(32),
        8 => b.dim.is_multiple_of(16),
        _ => false,
    };
    // Per group: 4-bit codes in whole 16-byte chunks a group. 8-bit groups keep the float
    // kernels, as on x86 (the query's int8 rounding would cost them most of their precision).
    let ok_params = match b.params {
        Params::PerGroup { group, .. } => b.bits == 4 && group.is_multiple_of(32),
        _ => true,
    };
    let ok_levels = matches!(b.levels, Levels::Affine) || int8::has_table8(b);
    ok_dim && ok_params && ok_levels && b.dim > 0 && cpu_ok()
}

/// `acc += sdot(a, b)`.
///
/// # Safety
/// The CPU must support the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
#[inline]
pub(crate) unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads two vector registers and accumulates into a third; it touches no
    // memory and no flags, and the CPU supports it (this function's target features).
    unsafe {
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, options(pure, nomem, nostack));
    }
    acc
}

/// `dots[r − rows.start] = Σ_d q[d] · code[r][d]` for rows `rows` of the 8-bit block `b` (the
/// loop over rows inside the target-feature code, so that the row's kernel inlines into it).
///
/// # Safety
/// The CPU must support dotprod; `q` holds `b.dim` int8 values (as bytes); the block is an 8-bit
/// one [`int8_supported`] accepts; `dots` holds `rows.len()` values.
#[target_feature(enable = "neon,dotprod")]
unsafe fn idot_rows_8bit(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], dots: &mut [i32]) {
    // The 8-bit codes are shifted into i8 by −128; the shift comes back as 128 · Σ q.
    let shift_back: i32 = 128 * q.iter().map(|&x| i32::from(x as i8)).sum::<i32>();
    for (o, r) in dots.iter_mut().zip(rows) {
        let row = b.row(r);
        // SAFETY: every load reads 16 bytes inside `row` or `q`; sdot is enabled.
        *o = unsafe {
            let mut acc = vdupq_n_s32(0);
            let shift = vdupq_n_u8(128);
            for (c, qs) in row.chunks_exact(16).zip(q.chunks_exact(16)) {
                let v = vreinterpretq_s8_u8(vsubq_u8(vld1q_u8(c.as_ptr()), shift));
                acc = sdot(acc, v, vld1q_s8(qs.as_ptr().cast()));
            }
            vaddvq_s32(acc) + shift_back
        };
    }
}

/// `dots[i · m + r − rows.start] = Σ_c q[i · dim + c] · code[r][c]` (`m = rows.len()`) for rows
/// `rows` of the 4-bit block `b` and `NQ` query rows of int8 values (as bytes) in natural order
/// (the order the nibble planes of 16-byte chunks produce): per 16-byte chunk of a row (low
/// nibbles: 16 channels, high nibbles: the next 16) one `sdot` per nibble plane and query row,
/// each row loaded once for all query rows. The scores kernel and the fused block kernel
/// (`crate::fused_dotprod`) both run it. A block of 16 levels (`int8::table8`) is dotted with
/// its int8 levels in place of the codes (`tab`, looked up with `tbl`).
///
/// # Safety
/// The CPU must support dotprod; `b.bits == 4`, `b.dim` a multiple of 32, `rows` inside the
/// block; `q` holds `NQ · b.dim` values, `dots` `NQ · rows.len()`.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn dots_4bit<const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    dots: &mut [i32],
) {
    // SAFETY: forwarded.
    unsafe {
        match int8::table8(b) {
            None => dots4::<NQ, false>(b, rows, q, vdupq_n_s8(0), dots),
            Some((t, _)) => dots4::<NQ, true>(b, rows, q, vld1q_s8(t.as_ptr()), dots),
        }
    }
}

/// The chunk `x` of 4-bit codes split into its nibble planes, as signed bytes: the codes
/// (`0..=15`), or with `TABLE` their levels in `tab`.
#[target_feature(enable = "neon,dotprod")]
#[inline]
fn planes<const TABLE: bool>(x: uint8x16_t, tab: int8x16_t) -> [int8x16_t; 2] {
    let (lo, hi) = (vandq_u8(x, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(x));
    if TABLE {
        [vqtbl1q_s8(tab, lo), vqtbl1q_s8(tab, hi)]
    } else {
        [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)]
    }
}

/// `acc[i] += ` the `sdot` dots of 16-byte chunk `j` of row `r` of the 4-bit block `b` (its two
/// nibble planes, [`planes`]) with values `32j .. 32j + 32` of each of the `NQ` query rows
/// of `q` (`b.dim` values each).
///
/// # Safety
/// The CPU must support dotprod; `r < b.rows`, `j < b.dim / 32`, rows of `b.dim / 2` bytes
/// inside the codes; `q` holds `NQ · b.dim` values.
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn chunk_dots<const NQ: usize, const TABLE: bool>(
    b: &QuantBlock<'_>,
    r: usize,
    j: usize,
    q: &[u8],
    tab: int8x16_t,
    acc: &mut [int32x4_t; int8::GROUP],
) {
    // SAFETY: bytes 16j..16j + 16 of row r lie inside the codes; values 32j..32j + 32 inside
    // each query row (this function's contract).
    unsafe {
        let [lo, hi] = planes::<TABLE>(vld1q_u8(b.codes.as_ptr().add(r * b.row_bytes + 16 * j)), tab);
        for (i, a) in acc.iter_mut().enumerate().take(NQ) {
            let at = q.as_ptr().add(i * b.dim + 32 * j).cast::<i8>();
            *a = sdot(*a, lo, vld1q_s8(at));
            *a = sdot(*a, hi, vld1q_s8(at.add(16)));
        }
    }
}

/// [`dots_4bit`] with the table (`TABLE`) known.
///
/// # Safety
/// As [`dots_4bit`].
#[target_feature(enable = "neon,dotprod")]
unsafe fn dots4<const NQ: usize, const TABLE: bool>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    tab: int8x16_t,
    dots: &mut [i32],
) {
    let (d, m) = (b.dim, rows.len());
    assert!(b.bits == 4 && d.is_multiple_of(32) && q.len() >= NQ * d && dots.len() >= NQ * m);
    assert!(rows.end <= b.rows && b.codes.len() >= b.rows * b.row_bytes && b.row_bytes == d / 2);
    for r in rows.clone() {
        let mut acc = [vdupq_n_s32(0); int8::GROUP];
        for j in 0..d / 32 {
            // SAFETY: chunk j < d / 32 of row r < b.rows (asserted above); sdot is enabled.
            unsafe { chunk_dots::<NQ, TABLE>(b, r, j, q, tab, &mut acc) };
        }
        for (i, a) in acc.iter().enumerate().take(NQ) {
            dots[i * m + r - rows.start] = vaddvq_s32(*a);
        }
    }
}

/// [`dots_4bit`] of a block per group (`group` a multiple of 32 dividing `b.dim`): one dot per
/// group, `dots[(i · m + r − rows.start) · G + g]` (`G = dim / group` groups a row) the dot of
/// group `g` of row `r` with query row `i`. Four groups' accumulators are reduced together
/// (two pairwise adds), their dots stored side by side.
///
/// # Safety
/// As [`dots_4bit`], with `b` per group of a multiple of 32 values and `dots` holding
/// `NQ · rows.len() · G` values.
#[target_feature(enable = "neon,dotprod")]
unsafe fn group_dots<const NQ: usize, const TABLE: bool>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    tab: int8x16_t,
    dots: &mut [i32],
) {
    let Params::PerGroup { group, .. } = b.params else { unreachable!("per group (the caller's contract)") };
    let (d, m) = (b.dim, rows.len());
    let per = d / group;
    assert!(b.bits == 4 && group.is_multiple_of(32) && d.is_multiple_of(group) && per >= 1);
    assert!(q.len() >= NQ * d && dots.len() >= NQ * m * per);
    assert!(rows.end <= b.rows && b.codes.len() >= b.rows * b.row_bytes && b.row_bytes == d / 2);
    let chunks = group / 32;
    for r in rows.clone() {
        // Groups four at a time (the last quad may hold fewer).
        for g0 in (0..per).step_by(4) {
            let take = (per - g0).min(4);
            let mut acc = [[vdupq_n_s32(0); int8::GROUP]; 4];
            for (k, a) in acc.iter_mut().enumerate().take(take) {
                for j in (g0 + k) * chunks..(g0 + k + 1) * chunks {
                    // SAFETY: chunk j < d / 32 of row r < b.rows (asserted above); sdot is
                    // enabled.
                    unsafe { chunk_dots::<NQ, TABLE>(b, r, j, q, tab, a) };
                }
            }
            for i in 0..NQ {
                // Lane k: the sum of group g0 + k's accumulator (integers: exact in any order).
                let sums = vpaddq_s32(vpaddq_s32(acc[0][i], acc[1][i]), vpaddq_s32(acc[2][i], acc[3][i]));
                let at = (i * m + r - rows.start) * per + g0;
                if take == 4 {
                    // SAFETY: at + 4 <= (i · m + r − rows.start + 1) · per: inside `dots`.
                    unsafe { vst1q_s32(dots.as_mut_ptr().add(at), sums) };
                } else {
                    let mut lanes = [0i32; 4];
                    // SAFETY: `lanes` holds four values.
                    unsafe { vst1q_s32(lanes.as_mut_ptr(), sums) };
                    dots[at..at + take].copy_from_slice(&lanes[..take]);
                }
            }
        }
    }
}

/// [`group_dots`] of affine codes (`by_group!` takes one const parameter).
///
/// # Safety
/// As [`group_dots`].
#[target_feature(enable = "neon,dotprod")]
unsafe fn group_dots_plain<const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    dots: &mut [i32],
) {
    // SAFETY: forwarded.
    unsafe { group_dots::<NQ, false>(b, rows, q, vdupq_n_s8(0), dots) }
}

/// [`group_dots`] of a 16-level table's codes, `tab` its int8 levels.
///
/// # Safety
/// As [`group_dots`].
#[target_feature(enable = "neon,dotprod")]
unsafe fn group_dots_table<const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    tab: int8x16_t,
    dots: &mut [i32],
) {
    // SAFETY: forwarded.
    unsafe { group_dots::<NQ, true>(b, rows, q, tab, dots) }
}

pub(crate) struct Sdot;

impl int8::IntKernel for Sdot {
    fn arrange(_: &QuantBlock<'_>, q8: &[i8], out: &mut Vec<u8>) {
        int8::arrange_natural(q8, out);
    }

    fn dots(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], n: usize, dots: &mut [i32]) {
        let (d, m) = (b.dim, rows.len());
        if matches!(b.params, Params::PerGroup { .. }) {
            // SAFETY: `int8_supported(b)` (checked by `scores_int8`, the only caller): 4-bit
            // rows per group of a multiple of 32 codes, the CPU; `q` holds `n <= GROUP` rows of
            // `d` values, `dots` `n · m · d / group` (the default `segment`, the group).
            unsafe {
                match int8::table8(b) {
                    None => by_group!(group_dots_plain, n, (b, rows, q, dots)),
                    Some((t, _)) => by_group!(group_dots_table, n, (b, rows, q, vld1q_s8(t.as_ptr()), dots)),
                }
            }
            return;
        }
        if b.bits == 4 {
            // SAFETY: `int8_supported(b)` (checked by `scores_int8`, the only caller) covers
            // the CPU and the row length; `q` holds `n <= GROUP` rows of `d` values, `dots`
            // `n · m`.
            unsafe { by_group!(dots_4bit, n, (b, rows, q, dots)) };
            return;
        }
        for (i, qi) in q.chunks_exact(d).take(n).enumerate() {
            // SAFETY: as above, for an 8-bit block; `qi` holds `d` values.
            unsafe { idot_rows_8bit(b, rows.clone(), qi, &mut dots[i * m..(i + 1) * m]) };
        }
    }
}

/// Scores through `sdot`; see [`crate::scores_int8_with`] for the algebra and error bound
/// (the scores equal [`crate::scalar::scores_int8`] bit for bit). Returns `false`, computing
/// nothing, when [`int8_supported`] is false.
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
    int8::scores_by_block::<Sdot>(b, q, n_q, out, scratch);
    true
}
