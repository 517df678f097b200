//! The integer value path's algebra, shared by its kernels and its scalar reference: each row
//! of weights (per row: the probability times the row's scale; per channel: the probability)
//! is rounded to integers with one scale per block, a kernel sums `W[r] · code[r][c]` exactly
//! in i32, and a float epilogue restores the scale and adds the offsets' term (through exact
//! float sums of the probabilities).
//!
//! `o[c] += Σ_r p[r] · (s[r] · L[r][c] + f[r])` becomes
//! `sw · Σ_r W[r] · (L[r][c] − z) + Σ_r p[r] · (f[r] + z · s[r])` with `W[r] = round(p[r] · s[r] / sw)`,
//! `sw = max_r |p[r] · s[r]| / W_max` and the centre `z = 2^(bits − 1)`: each weight is off by
//! at most `sw / 2`, so each output by at most `sw / 2 · Σ_r |L[r][c] − z|` (per channel, times
//! `|s[c]|`). `W_max` ([`weight_limit`]) is 255 for codes of up to 4 bits, whose own rounding
//! (a step of 1/15 of a row's range at 4 bits) dwarfs a weight's (1/510 of the block's largest
//! weight): non-negative weights (probabilities times scales) then fit one unsigned byte, and
//! a kernel multiplies four rows per instruction (`vpdpbusd`); 32767 for wider codes. The
//! centre keeps the weights' rounding errors from adding up over the codes' mean: on real
//! layers of SmolLM2 (two KV heads side by side as one of 128 channels, INT4 keys per channel
//! and values per token), the integer path's attention output differed from the float path's
//! by 0.02-1.0% of its norm with 16-bit weights, 0.02-3.0% with uncentred 8-bit ones and
//! 0.02-1.1% with centred 8-bit ones (the keys' int8 query gives most of it).
//! Everything but the integer sums is this module's code, so every kernel gives the same
//! outputs bit for bit as [`crate::scalar::axpy_int`].

use std::ops::Range;

use crate::block::{Params, QuantBlock};
use crate::int8::GROUP;
use crate::wide_backend::{dot_lanes, sum_lanes};

/// The largest rounded weight for `bits`-wide codes: 255 up to 4 bits, 32767 above.
pub(crate) fn weight_limit(bits: u8) -> i16 {
    if bits <= 4 { 255 } else { 32767 }
}

/// The code the kernels' sums are centred on: `2^(bits − 1)`.
pub(crate) fn center(bits: u8) -> u8 {
    1 << (bits - 1)
}

/// Rows per kernel call for `bits`-wide codes: the most whose sums cannot overflow i32
/// (`rows · W_max · (2^bits − 1) < 2^31`), and at most 4096.
fn chunk_rows(bits: u8) -> usize {
    let per_row = weight_limit(bits) as u64 * ((1u64 << bits) - 1);
    ((i32::MAX as u64 / per_row) as usize).clamp(1, 4096)
}

/// `w / scale` rounded (ties to even) into `−limit..=limit`, appended to `out`, and the scale
/// `max|w| / limit` returned (zero weights: scale 0, all zero).
#[inline(always)]
fn round_weights(w: &[f32], limit: i16, out: &mut Vec<i16>) -> f32 {
    crate::int8::round_symmetric(w, f32::from(limit), out, |v| v as i16)
}

/// An architecture's integer value kernel.
pub(crate) trait IntAxpyKernel {
    /// `acc[i · dim + c] = Σ_r w[i · m + r − rows.start] · code[r][c]` for rows `rows` of `b`
    /// (`m = rows.len()`) and the `n ≤ GROUP` rounded weight rows of `w`, channels in natural
    /// order.
    fn sums(b: &QuantBlock<'_>, rows: Range<usize>, w: &[i16], n: usize, acc: &mut [i32]);
}

/// Buffers of the integer value path, kept per thread by a kernel's module.
#[derive(Default)]
pub(crate) struct Scratch {
    wf: Vec<f32>,
    w: Vec<i16>,
    acc: Vec<i32>,
}

/// `out[i · dim + c] += Σ_r p[i · rows + r] · x̂[r][c]` through kernel `K`, `GROUP` weight rows
/// and at most [`chunk_rows`] rows at a time.
#[inline(always)]
pub(crate) fn axpy_by_block<K: IntAxpyKernel>(
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let (d, rows) = (b.dim, b.rows);
    let Scratch { wf, w, acc } = scratch;
    let (step, limit) = (chunk_rows(b.bits), weight_limit(b.bits));
    let z = f32::from(center(b.bits));
    let mut r0 = 0;
    while r0 < rows {
        let at = r0..(r0 + step).min(rows);
        let mut i0 = 0;
        while i0 < n_q {
            let n = (n_q - i0).min(GROUP);
            let mut scale = [0f32; GROUP];
            let mut add = [0f32; GROUP];
            w.clear();
            for i in 0..n {
                let pi = &p[(i0 + i) * rows + at.start..(i0 + i) * rows + at.end];
                wf.clear();
                match b.params {
                    Params::PerRow { scale: s, offset } => {
                        wf.extend(pi.iter().zip(&s[at.clone()]).map(|(p, s)| p * s));
                        add[i] = offset.map_or(0.0, |o| dot_lanes(pi, &o[at.clone()])) + z * sum_lanes(wf);
                    }
                    Params::PerGroup { .. } => unreachable!("the integer paths refuse per-group blocks"),
                    Params::PerChannel { .. } => {
                        wf.extend_from_slice(pi);
                        add[i] = sum_lanes(pi);
                    }
                }
                scale[i] = round_weights(wf, limit, w);
            }
            // Written in full by the kernel (see `int8::fresh`).
            let acc = crate::int8::fresh(acc, n * d);
            K::sums(b, at.clone(), w, n, acc);
            for i in 0..n {
                let (sw, add, a) = (scale[i], add[i], &acc[i * d..(i + 1) * d]);
                let o = &mut out[(i0 + i) * d..(i0 + i + 1) * d];
                match b.params {
                    Params::PerGroup { .. } => unreachable!("the integer paths refuse per-group blocks"),
                    Params::PerRow { .. } => {
                        for (o, &a) in o.iter_mut().zip(a) {
                            *o += sw * a as f32 + add;
                        }
                    }
                    Params::PerChannel { scale: s, offset } => {
                        for (c, (o, &a)) in o.iter_mut().zip(a).enumerate() {
                            *o += s[c] * (sw * a as f32) + (offset.map_or(0.0, |f| f[c]) + z * s[c]) * add;
                        }
                    }
                }
            }
            i0 += n;
        }
        r0 = at.end;
    }
}

/// The reference of the fused kernels' values per group (the separate integer value path
/// refuses per-group blocks): each group of channels is a block of its own with per-row
/// parameters, `o[c] += sw_g · Σ_r W_g[r] · (L[r][c] − z) + Σ_r p[r] · (f[r][g] + z · s[r][g])`
/// for the channels `c` of group `g`, `W_g[r] = round(p[r] · s[r][g] / sw_g)` and
/// `sw_g = max_r |p[r] · s[r][g]| / W_max`: the per-row algebra above, one weight scale per
/// query row and group.
///
/// # Panics
/// When `b` is not per group or the shapes differ from `n_q` rows of weights and outputs.
pub(crate) fn axpy_grouped_reference(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32]) {
    let Params::PerGroup { group, scale, offset } = b.params else { panic!("a per-group block") };
    let (d, rows, per) = (b.dim, b.rows, b.dim / group);
    assert!(p.len() == n_q * rows && out.len() == n_q * d, "shapes");
    let (limit, z) = (weight_limit(b.bits), i32::from(center(b.bits)));
    let mut codes = vec![0u8; rows * d];
    for (r, c) in codes.chunks_exact_mut(d).enumerate() {
        kvq_quant_core::pack::unpack_row(b.row(r), b.bits, c).expect("QuantBlock::new checked the lengths");
    }
    let (mut wf, mut w) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for i in 0..n_q {
        let pi = &p[i * rows..(i + 1) * rows];
        for g in 0..per {
            wf.clear();
            wf.extend((0..rows).map(|r| pi[r] * scale[r * per + g]));
            let add = offset.map_or(0.0, |f| (0..rows).map(|r| pi[r] * f[r * per + g]).sum::<f32>())
                + z as f32 * wf.iter().sum::<f32>();
            w.clear();
            let sw = round_weights(&wf, limit, &mut w);
            for c in g * group..(g + 1) * group {
                let a: i32 = (0..rows).map(|r| i32::from(w[r]) * (i32::from(codes[r * d + c]) - z)).sum();
                out[i * d + c] += sw * a as f32 + add;
            }
        }
    }
}

/// The reference integer kernel: codes unpacked and summed one by one.
pub(crate) struct Reference;

impl IntAxpyKernel for Reference {
    fn sums(b: &QuantBlock<'_>, rows: Range<usize>, w: &[i16], n: usize, acc: &mut [i32]) {
        let (d, m) = (b.dim, rows.len());
        let mut codes = vec![0u8; d];
        acc[..n * d].fill(0);
        let z = i32::from(center(b.bits));
        for r in rows.clone() {
            kvq_quant_core::pack::unpack_row(b.row(r), b.bits, &mut codes)
                .expect("QuantBlock::new checked the lengths");
            for i in 0..n {
                let wr = i32::from(w[i * m + r - rows.start]);
                for (a, &c) in acc[i * d..(i + 1) * d].iter_mut().zip(&codes) {
                    *a += wr * (i32::from(c) - z);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{chunk_rows, round_weights};

    #[test]
    fn weight_rounding_and_chunks() {
        let mut out = Vec::new();
        let s = round_weights(&[0.5, -1.0, 0.25, 0.0, 1.0e-9], 32767, &mut out);
        assert_eq!(s, 1.0 / 32767.0);
        assert_eq!(out, vec![16384, -32767, 8192, 0, 0]);
        out.clear();
        let s = round_weights(&[0.4, 1.0, 0.25, 0.0, 1.0e-3], 255, &mut out);
        assert_eq!(s, 1.0 / 255.0);
        assert_eq!(out, vec![102, 255, 64, 0, 0]);
        out.clear();
        assert_eq!(round_weights(&[0.0; 3], 255, &mut out), 0.0);
        assert_eq!(out, vec![0; 3]);
        // The sums of a chunk never overflow.
        for bits in 1..=8u8 {
            let rows = chunk_rows(bits) as u64;
            let limit = super::weight_limit(bits) as u64;
            assert!(rows * limit * ((1 << bits) - 1) <= i32::MAX as u64, "{bits}");
        }
        assert_eq!(chunk_rows(8), 257);
        assert_eq!(chunk_rows(4), 4096);
    }
}
