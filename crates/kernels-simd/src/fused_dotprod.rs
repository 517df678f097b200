//! The fused block kernel of decode's integer path on aarch64 CPUs with the dot-product
//! extension (Armv8.2 and later: Neoverse N1, V1 and V2, Cortex-A76 on, Apple M): one block of
//! INT4 keys per channel and the block of INT4 values per token of the same tokens
//! (KIVI-style), attended by up to four query rows at a time in one call. Without it such a CPU
//! ran the `sdot` scores kernel, the softmax and the float value kernel one after the other.
//!
//! The scores are the integer scores kernel's: the query rows rounded and the epilogue applied
//! by the `int8` module as for every architecture, so the same bits as
//! [`crate::scalar::scores_int8`]; the dots by `sdot`, each key row loaded once for all query
//! rows (`dotprod::dots_4bit`, which the scores kernel runs too). The exponentials are the
//! softmax module's polynomial. The values go through the integer
//! value path's algebra with byte weights, as on x86: `umlal` multiplies sixteen codes of a row
//! (`0..=15`, not centred: unsigned bytes on both sides) by the row's weight (`0..=255`) into
//! u16 sums of up to sixteen rows (at most `16 · 255 · 15 = 61200`), which are widened to i32;
//! the centre's share `8 · Σ weights` is then taken off in integers, so the sums equal those of
//! the centred codes exactly. The results equal [`crate::scalar::attend_int`] to the rounding
//! of float sums taken in another order and of `exp`, not bit for bit.
//!
//! As on x86, values per group (`int4-g32`) take byte weights per query row and group, each
//! rounded with its own scale (a 16-byte chunk of a row, 32 channels, lies inside one group);
//! keys per row or per group (`int4-token`, `int4-g32`) take the `sdot` scores kernel's
//! scores as they are, then the same softmax step and value sums. Keys in channel regions
//! (`-qa`) and keys per channel of other widths than 4 bits (one region) take the region
//! scores of `regions_neon` (bit for bit the reference's); values of 1 to 3 bits per row are
//! unpacked to a code a byte there and summed by `umlal` as INT4 codes are.

use std::arch::aarch64::*;

use crate::block::{Params, QuantBlock};
use crate::dotprod::Sdot;
use crate::int8::{self, GROUP, grown};
use crate::regions::{GroupKeys, Keys};
use crate::{KeyRegion, MAX_GROUPS, Online};
use crate::{regions, regions_neon};

/// Whether [`crate::attend_int_with`] has a fused kernel on the `dotprod` backend for keys
/// `k`, values `v` and `n_q` query rows on this CPU: INT4 affine keys with per-channel
/// parameters and INT4 affine values with per-row parameters, the same tokens (1 to 256) and
/// head_dim (64, 128 or 256), any number of query rows (four at a time), a CPU with the
/// dot-product extension; or such keys with INT4 affine values per group of 32, 64, 128 or
/// 256 values (dividing the head_dim); or INT4 affine keys per row or per group of 32 to 256
/// values with either of those values; any of those keys with values of 1 to 3 bits per row;
/// affine keys per channel of 1 to 8 bits as one region of [`attend_int_regions_supported`].
pub fn attend_int_supported(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    // Keys of other widths go through the region scores, which check the CPU themselves.
    crate::fused_int_layout(k, v, n_q, regions::narrow_values, attend_int_regions_supported)
        && (k.bits != 4 || crate::dotprod::int8_supported(k))
}

/// Whether [`crate::attend_int_regions_with`] has a fused kernel on the `dotprod` backend for
/// these key regions (`-qa` keys) and values: regions as the region scores take them
/// (affine, per channel, 1 to 8 bits, multiples of 8 channels) with the values
/// [`attend_int_supported`] takes under INT4 keys per channel (INT4 affine per row or per
/// group of 32 to 256 values, or of 1 to 3 bits per row; head_dim 64, 128 or 256; 1 to 256
/// rows), at least one query row.
pub fn attend_int_regions_supported(regions: &[KeyRegion<'_>], v: &QuantBlock<'_>, n_q: usize) -> bool {
    regions::fused_values(v, n_q) && regions_neon::supported(regions, v.rows, v.dim)
}

/// The buffers of [`attend_int_in`], grown to the largest block and query group seen, then
/// reused.
#[derive(Default)]
pub(crate) struct FusedScratch {
    prep: int8::Prepared,
    dots: Vec<i32>,
    p: Vec<f32>,
    wb: Vec<u8>,
    acc: Vec<i32>,
    /// A query row's weights `p · scale` of one value group (values per row: the only one).
    pw: Vec<f32>,
    /// Values per group: their scales, then their offsets, by group (rows along).
    vt: Vec<f32>,
    /// Keys per row or group: the scores kernel's scratch.
    int8: int8::Scratch,
    /// Keys in channel regions (`-qa`): their scores kernel's buffers and plans.
    pub(crate) regions: regions::Scratch<regions_neon::Step>,
    /// Values of 1 to 3 bits: their rows unpacked to a code a byte.
    values: regions_neon::Unpacker,
    /// Keys in channel regions: the block's scores of every query row of the call.
    region_scores: Vec<f32>,
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
    let (mut all, mut values) = (std::mem::take(&mut w.region_scores), std::mem::take(&mut w.values));
    if let Keys::Regions(rs) = keys {
        let done =
            regions::scores_in::<regions_neon::Kernel>(rs, q, n_q, grown(&mut all, n_q * n), &mut w.regions);
        debug_assert!(done, "`attend_int_regions_supported` checked the regions");
    }
    let codes: &[u8] = if v.bits == 4 {
        &[]
    } else {
        let (codes, width, _) = regions_neon::unpack(&mut values, &[KeyRegion { first: 0, keys: *v }]);
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

/// The fused kernel for `NQ` query rows, the keys in one part or several, or the group's
/// scores of keys in channel regions; `codes` the rows of narrow values unpacked (empty for
/// INT4 values).
///
/// # Safety
/// The CPU must support the dot-product extension; [`attend_int_parts_supported`] for the
/// parts of `keys` and `v`, or scores of `NQ` rows of `v.rows` with values
/// [`attend_int_regions_supported`] takes; narrow values' `codes` hold `v.rows` rows of
/// `v.dim` codes; every value scale of `v` is `>= 0`; `q` and `o` hold `NQ · dim` values, `m`
/// and `l` `NQ`.
#[target_feature(enable = "neon,dotprod")]
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
    let (vs, vo, group) = match v.params {
        Params::PerRow { scale, offset } => (scale, offset, d),
        Params::PerGroup { group, scale, offset } => (scale, offset, group),
        Params::PerChannel { .. } => unreachable!("checked"),
    };
    let per = d / group;
    assert!(per <= MAX_GROUPS && vs.len() >= n * per && vo.is_none_or(|o| o.len() >= n * per));
    let FusedScratch { prep, dots, p, wb, acc, pw, vt, int8: scratch, .. } = w;
    assert!(q.len() == NQ * d && o.len() == NQ * d && m.len() == NQ && l.len() == NQ, "shapes");

    let p = grown(p, NQ * n);
    let parts = match keys {
        GroupKeys::Parts(parts) => parts,
        GroupKeys::Scores(s) => {
            // 1-2. Keys in channel regions: the region scores kernel's scores, taken before.
            p.copy_from_slice(s);
            &[]
        }
    };
    if let Some(k) = parts.first()
        && matches!(k.params, Params::PerChannel { .. })
    {
        // 1. Per part of the keys, the query rows times its channel scales, rounded to int8 as
        //    the scores kernel rounds them, with what its offsets add (`Σ q · offset`); 2. the
        //    integer dots; the scores (the scores kernel's epilogue) into `p`, the parts side
        //    by side.
        let mut at = 0;
        for k in parts {
            let nk = k.rows;
            prep.prepare::<Sdot>(k, q);
            let dots = grown(dots, NQ * nk);
            // SAFETY: i8 and u8 have one size and alignment, and every byte is a valid u8.
            let q8 = unsafe { std::slice::from_raw_parts(prep.q8.as_ptr().cast::<u8>(), prep.q8.len()) };
            // SAFETY: dotprod (this function's contract); `int8_supported(k)`: 4-bit rows of d
            // codes, d a multiple of 32; `q8` holds NQ rows of d values, `dots` NQ · nk.
            unsafe { crate::dotprod::dots_4bit::<NQ>(k, 0..nk, q8, dots) };
            for i in 0..NQ {
                let (qs, kadd) = (prep.scale[i], prep.add[i]);
                let row = &mut p[i * n + at..i * n + at + nk];
                for (x, &dot) in row.iter_mut().zip(&dots[i * nk..(i + 1) * nk]) {
                    *x = qs * dot as f32 + kadd;
                }
            }
            at += nk;
        }
    } else if let Some(k) = parts.first() {
        // 1-2. Keys per row or per group (one part): the integer scores kernel's scores
        //      themselves (its per-group dots and epilogue), so the same bits as it gives.
        let done = crate::dotprod::scores_int8_in(k, q, NQ, p, scratch);
        debug_assert!(done, "`attend_int_supported` checked `int8_supported(k)`");
    }

    // The values' parameters by group, rows along (values per row: used as they are).
    if per > 1 {
        let vt = grown(vt, 2 * per * n);
        for r in 0..n {
            for g in 0..per {
                vt[g * n + r] = vs[r * per + g];
                vt[(per + g) * n + r] = vo.map_or(0.0, |vo| vo[r * per + g]);
            }
        }
    }
    let params = |g: usize| -> (&[f32], Option<&[f32]>) {
        if per == 1 {
            (vs, vo)
        } else {
            (&vt[g * n..(g + 1) * n], vo.map(|_| &vt[(per + g) * n..(per + g + 1) * n]))
        }
    };

    // 3. Per query row: the scores' maximum with the running one, the rescaling factor, the
    //    exponentials and their sum, then per value group the weights `p · scale` rounded to
    //    bytes (scale max / 255, in row `i · per + g` of `wb`) and what the offsets and the
    //    centre add.
    let wb = grown(wb, NQ * per * n);
    let pw = grown(pw, n);
    let z = f32::from(crate::int_values::center(v.bits));
    let mut factor = [1f32; GROUP];
    let (mut sw, mut vadd) = ([[0f32; MAX_GROUPS]; GROUP], [[0f32; MAX_GROUPS]; GROUP]);
    let mut wsum = [[0i32; MAX_GROUPS]; GROUP];
    let mut live = [false; GROUP];
    for i in 0..NQ {
        let s = &mut p[i * n..(i + 1) * n];
        // NaN scores are skipped by the maximum.
        let top = s.iter().fold(m[i], |a, &x| if x > a { x } else { a });
        if top == f32::NEG_INFINITY {
            // Nothing of this row seen yet: no weight, no change.
            wb[i * per * n..(i + 1) * per * n].fill(0);
            continue;
        }
        live[i] = true;
        factor[i] = (m[i] - top).exp();
        l[i] = l[i] * factor[i] + crate::softmax::exp_sum_wide(s, top);
        m[i] = top;
        for g in 0..per {
            let (scale, offset) = params(g);
            // SAFETY: NEON is part of every aarch64 CPU; `s`, `scale`, `offset` and `pw` hold
            // n values.
            let (wmax, nan, add) = unsafe { weigh(s, scale, offset, z, pw) };
            let (scale, inv) = int8::scale_of(wmax, nan, 255.0);
            let row = &mut wb[(i * per + g) * n..(i * per + g + 1) * n];
            for (b, &x) in row.iter_mut().zip(pw.iter()) {
                *b = int8::round_code(x, inv, 255.0) as u8;
            }
            (sw[i][g], vadd[i][g]) = (scale, add);
            wsum[i][g] = row.iter().map(|&b| i32::from(b)).sum();
        }
    }

    // 4. The integer sums of the value codes under the byte weights, the centre's share taken
    //    off, and the epilogue: `o ← o · factor + (sw · sum + add)`, sw and add those of the
    //    channel's group.
    let acc = grown(acc, NQ * d);
    if v.bits == 4 {
        // SAFETY: NEON; `v` is 4-bit with rows of d / 2 bytes, d a multiple of 32, n >= 1;
        // `wb` holds NQ · per rows of n bytes; `acc` holds NQ · d values; `group` a multiple
        // of 32 dividing d (`lane_groups`, or d itself).
        unsafe { value_sums::<NQ>(v, wb, n, group, acc) };
    } else {
        // Narrow values (per row), unpacked to a code a byte before the groups.
        // SAFETY: NEON; `codes` holds n rows of d codes below 8; `wb` NQ rows of n bytes;
        // `acc` NQ · d values.
        unsafe { byte_value_sums::<NQ>(codes, n, d, wb, acc) };
    }
    let centre = i32::from(crate::int_values::center(v.bits));
    for i in (0..NQ).filter(|&i| live[i]) {
        let f = factor[i];
        for g in 0..per {
            let (s, a, c) = (sw[i][g], vadd[i][g], centre * wsum[i][g]);
            let span = i * d + g * group..i * d + (g + 1) * group;
            for (o, &x) in o[span.clone()].iter_mut().zip(&acc[span]) {
                let old = if f != 1.0 { *o * f } else { *o };
                *o = old + (s * (x - c) as f32 + a);
            }
        }
    }
}

/// The weights `e · scale` of a row's exponentials `e` into `w`; returns their largest,
/// whether one is NaN, and `Σ (z · e · scale + e · offset)`.
///
/// # Safety
/// `scale`, `offset` (if any) and `w` hold `e.len()` values.
#[target_feature(enable = "neon")]
unsafe fn weigh(e: &[f32], scale: &[f32], offset: Option<&[f32]>, z: f32, w: &mut [f32]) -> (f32, bool, f32) {
    let n = e.len();
    assert!(scale.len() >= n && offset.is_none_or(|o| o.len() >= n) && w.len() >= n);
    let (mut mx, mut add, mut nan) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0), vdupq_n_u32(0));
    let zv = vdupq_n_f32(z);
    let mut r = 0;
    while r + 4 <= n {
        // SAFETY: r + 4 <= n: inside `e`, `scale`, `offset` and `w`.
        unsafe {
            let ev = vld1q_f32(e.as_ptr().add(r));
            let wv = vmulq_f32(ev, vld1q_f32(scale.as_ptr().add(r)));
            add = vfmaq_f32(add, zv, wv);
            if let Some(f) = offset {
                add = vfmaq_f32(add, ev, vld1q_f32(f.as_ptr().add(r)));
            }
            // `fmaxnm` skips NaN; a NaN is flagged apart.
            mx = vmaxnmq_f32(mx, wv);
            nan = vorrq_u32(nan, vmvnq_u32(vceqq_f32(wv, wv)));
            vst1q_f32(w.as_mut_ptr().add(r), wv);
        }
        r += 4;
    }
    let (mut wmax, mut any, mut sum) = (vmaxnmvq_f32(mx), vmaxvq_u32(nan) != 0, vaddvq_f32(add));
    for r in r..n {
        let wv = e[r] * scale[r];
        sum += z * wv + offset.map_or(0.0, |f| e[r] * f[r]);
        wmax = wmax.max(wv);
        any |= wv.is_nan();
        w[r] = wv;
    }
    (wmax, any, sum)
}

/// `acc[i · d + c] = Σ_r wb[(i · d / group + c / group) · stride + r] · code[r][c]` (codes
/// `0..=15`, not centred) for every row of the 4-bit block `v` and `NQ` rows of byte weights
/// per group of `group` channels (a multiple of 32; values per row: `d`), channels in natural
/// order. Per
/// 16-byte chunk of the rows (32 channels) and batch of sixteen rows: per row the chunk's
/// nibbles split, then per query row four `umlal` into u16 sums against the row's weight
/// broadcast; each batch's sums widened into `acc` (the first batch writes it, later ones add).
///
/// # Safety
/// `v.bits == 4`, `v.dim` a multiple of 32, `v.rows >= 1`; each of the `NQ · dim / group`
/// rows of `wb` holds `stride >= v.rows` bytes; `acc` holds `NQ · v.dim` values.
#[target_feature(enable = "neon")]
unsafe fn value_sums<const NQ: usize>(
    v: &QuantBlock<'_>,
    wb: &[u8],
    stride: usize,
    group: usize,
    acc: &mut [i32],
) {
    let (d, n) = (v.dim, v.rows);
    let per = d / group;
    assert!(
        v.bits == 4 && d.is_multiple_of(32) && n >= 1 && group.is_multiple_of(32) && d.is_multiple_of(group)
    );
    assert!(wb.len() >= NQ * per * stride && stride >= n && acc.len() >= NQ * d);
    assert!(v.codes.len() >= n * v.row_bytes && v.row_bytes == d / 2);
    let (codes, w) = (v.codes.as_ptr(), wb.as_ptr());
    let mask = vdupq_n_u8(0x0f);
    for j in 0..d / 32 {
        // The chunk's 32 channels lie in one group: its weight rows.
        let g = 32 * j / group;
        for batch in 0..n.div_ceil(16) {
            let mut s = [[vdupq_n_u16(0); 4]; GROUP];
            for r in 16 * batch..(16 * batch + 16).min(n) {
                // SAFETY: bytes 16j..16j + 16 of row r lie inside the codes (rows of d / 2
                // bytes); weight r of row i · per + g inside `wb` (rows of `stride >= n` bytes).
                unsafe {
                    let x = vld1q_u8(codes.add(r * v.row_bytes + 16 * j));
                    let (lo, hi) = (vandq_u8(x, mask), vshrq_n_u8::<4>(x));
                    for (i, si) in s.iter_mut().enumerate().take(NQ) {
                        let wr = vld1q_dup_u8(w.add((i * per + g) * stride + r));
                        si[0] = vmlal_u8(si[0], vget_low_u8(lo), vget_low_u8(wr));
                        si[1] = vmlal_high_u8(si[1], lo, wr);
                        si[2] = vmlal_u8(si[2], vget_low_u8(hi), vget_low_u8(wr));
                        si[3] = vmlal_high_u8(si[3], hi, wr);
                    }
                }
            }
            for (i, si) in s.iter().enumerate().take(NQ) {
                for (h, &part) in si.iter().enumerate() {
                    // SAFETY: channels 32j + 8h .. 32j + 8h + 8 of row i lie inside `acc`.
                    unsafe { widen_into(acc.as_mut_ptr().add(i * d + 32 * j + 8 * h), part, batch == 0) };
                }
            }
        }
    }
}

/// [`value_sums`] for values unpacked to a code a byte (values of 1 to 3 bits, per row):
/// `acc[i · d + c] = Σ_r wb[i · n + r] · codes[r · d + c]` (not centred). Per 16 channels and
/// batch of sixteen rows: per query row two `umlal` of the row's codes against its weight
/// broadcast into u16 sums (at most `16 · 255 · 7`), widened into `acc`.
///
/// # Safety
/// `codes` holds `n` rows of `d` codes below 8 (`d` a multiple of 16); `wb` `NQ` rows of `n`
/// bytes; `acc` `NQ · d` values.
#[target_feature(enable = "neon")]
unsafe fn byte_value_sums<const NQ: usize>(codes: &[u8], n: usize, d: usize, wb: &[u8], acc: &mut [i32]) {
    assert!(d.is_multiple_of(16) && codes.len() >= n * d && wb.len() >= NQ * n && acc.len() >= NQ * d);
    let (u, w) = (codes.as_ptr(), wb.as_ptr());
    for j in 0..d / 16 {
        for batch in 0..n.div_ceil(16) {
            let mut s = [[vdupq_n_u16(0); 2]; GROUP];
            for r in 16 * batch..(16 * batch + 16).min(n) {
                // SAFETY: channels 16j.. of row r < n lie inside `codes`; weight r of row i
                // inside `wb`.
                unsafe {
                    let x = vld1q_u8(u.add(r * d + 16 * j));
                    for (i, si) in s.iter_mut().enumerate().take(NQ) {
                        let wr = vld1q_dup_u8(w.add(i * n + r));
                        si[0] = vmlal_u8(si[0], vget_low_u8(x), vget_low_u8(wr));
                        si[1] = vmlal_high_u8(si[1], x, wr);
                    }
                }
            }
            for (i, si) in s.iter().enumerate().take(NQ) {
                for (h, &part) in si.iter().enumerate() {
                    // SAFETY: channels 16j + 8h .. + 8 of row i lie inside `acc`.
                    unsafe { widen_into(acc.as_mut_ptr().add(i * d + 16 * j + 8 * h), part, batch == 0) };
                }
            }
        }
    }
}

/// Eight u16 sums widened to i32 into `at .. at + 8`: written (`first`) or added.
///
/// # Safety
/// `at` points at 8 writable i32.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn widen_into(at: *mut i32, part: uint16x8_t, first: bool) {
    let lo = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(part)));
    let hi = vreinterpretq_s32_u32(vmovl_high_u16(part));
    // SAFETY: as this function's.
    unsafe {
        if first {
            vst1q_s32(at, lo);
            vst1q_s32(at.add(4), hi);
        } else {
            vst1q_s32(at, vaddq_s32(vld1q_s32(at), lo));
            vst1q_s32(at.add(4), vaddq_s32(vld1q_s32(at.add(4)), hi));
        }
    }
}
