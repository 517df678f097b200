//! The `wide` backend: 8-lane f32 vectors whose instruction set is fixed at compile time
//! (SSE2 on a default x86-64 build, NEON on aarch64).
//!
//! The algebra follows the design notes: per-row parameters factor out of the dot product
//! (`s = scale · Σ q·level + offset · Σ q`); per-channel scales fold into the query once per
//! block (`q'_d = q_d · scale_d`) and offsets into a constant, so the inner loop is always
//! levels × floats. Levels are unpacked once per row and shared by every query head of a
//! GQA group. On aarch64 the levels of codebook (up to 16 levels) and FP8 rows come from
//! the `neon` module's in-register lookups; elsewhere from one table read per code.
//!
//! # Platform-specific behavior
//! Sums run in 8 lanes and are reduced at the end, so they round differently from the scalar
//! reference; `mul_add` is fused on NEON and AVX-with-FMA builds and not on SSE2. Results agree
//! with the reference to a relative 1e-5 of `Σ |q · x̂|` (tested).

use kvq_quant_core::pack::unpack_row;
use wide::{f32x8, i16x8, i32x8, u8x16};

use crate::block::{Levels, Params, QuantBlock};

/// 16 bytes to 16 f32 lanes (zero-extended).
#[inline(always)]
fn widen(b: u8x16) -> [f32x8; 2] {
    let lo = f32x8::from_i32x8(i32x8::from_i16x8(i16x8::from_u8x16_low(b)));
    let hi = f32x8::from_i32x8(i32x8::from_i16x8(i16x8::from_u8x16_high(b)));
    [lo, hi]
}

#[inline(always)]
fn load16(s: &[u8]) -> u8x16 {
    u8x16::from(<[u8; 16]>::try_from(s).expect("16 bytes"))
}

#[inline(always)]
fn store8(v: f32x8, out: &mut [f32]) {
    out.copy_from_slice(&v.to_array());
}

/// Codes of row `r` as f32 (before levels), in natural order.
fn unpack_codes_f32(b: &QuantBlock<'_>, r: usize, out: &mut [f32], codes: &mut Vec<u8>) {
    let row = b.row(r);
    let d = b.dim;
    match b.bits {
        8 if d.is_multiple_of(16) => {
            for (src, dst) in row.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                let [lo, hi] = widen(load16(src));
                store8(lo, &mut dst[..8]);
                store8(hi, &mut dst[8..]);
            }
        }
        4 if d.is_multiple_of(32) => {
            let mask = u8x16::splat(0x0f);
            for (src, dst) in row.chunks_exact(16).zip(out.chunks_exact_mut(32)) {
                let v = load16(src);
                // Byte j holds code j (low nibble) and code j + 16 (high nibble).
                let [a, bb] = widen(v & mask);
                let [c, e] = widen(v >> 4);
                store8(a, &mut dst[..8]);
                store8(bb, &mut dst[8..16]);
                store8(c, &mut dst[16..24]);
                store8(e, &mut dst[24..]);
            }
        }
        2 if d.is_multiple_of(64) => {
            let mask = u8x16::splat(0x03);
            for (src, dst) in row.chunks_exact(16).zip(out.chunks_exact_mut(64)) {
                let v = load16(src);
                // Byte j holds codes j, j + 16, j + 32, j + 48 in bit pairs 0, 2, 4, 6.
                for (k, part) in dst.chunks_exact_mut(16).enumerate() {
                    let [x, y] = widen((v >> (2 * k as u32)) & mask);
                    store8(x, &mut part[..8]);
                    store8(y, &mut part[8..]);
                }
            }
        }
        _ => {
            codes.resize(d, 0);
            unpack_row(row, b.bits, codes).expect("QuantBlock::new checked the lengths");
            for (o, &c) in out.iter_mut().zip(codes.iter()) {
                *o = f32::from(c);
            }
        }
    }
}

/// Levels of row `r` as f32; `codes` is scratch for layouts unpacked through bytes.
fn unpack_levels(b: &QuantBlock<'_>, r: usize, out: &mut [f32], codes: &mut Vec<u8>) {
    match b.levels {
        Levels::Affine => unpack_codes_f32(b, r, out, codes),
        Levels::Symmetric { zero } => {
            unpack_codes_f32(b, r, out, codes);
            for v in out.iter_mut() {
                *v -= zero;
            }
        }
        Levels::Table(_) | Levels::Fp8(_) => {
            // NEON looks tables of up to 16 levels and FP8 up in registers.
            #[cfg(target_arch = "aarch64")]
            if crate::neon::table_row(b, r, out, codes) {
                return;
            }
            let t = b.levels.table().expect("a table");
            codes.resize(b.dim, 0);
            unpack_row(b.row(r), b.bits, codes).expect("QuantBlock::new checked the lengths");
            for (o, &c) in out.iter_mut().zip(codes.iter()) {
                *o = t[c as usize];
            }
        }
    }
}

/// `Σ a·b` in 8 independent lanes, then the lanes in order: vectorizes on baseline SSE2 (a
/// plain `.sum()` is one serial chain of adds, 128 of them per query row and block).
#[inline(always)]
pub(crate) fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (mut ac, mut bc) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ac).zip(&mut bc) {
        for ((l, &x), &y) in lanes.iter_mut().zip(x).zip(y) {
            *l += x * y;
        }
    }
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// `Σ a` in 8 lanes, as [`dot_lanes`].
#[inline(always)]
pub(crate) fn sum_lanes(a: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut ac = a.chunks_exact(8);
    for x in &mut ac {
        for (l, &x) in lanes.iter_mut().zip(x) {
            *l += x;
        }
    }
    lanes.iter().sum::<f32>() + ac.remainder().iter().sum::<f32>()
}

/// `Σ a·b` in 16 lanes (two accumulators hide the add latency).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len()) / 16 * 16;
    let (mut s0, mut s1) = (f32x8::ZERO, f32x8::ZERO);
    for (x, y) in a[..n].chunks_exact(16).zip(b[..n].chunks_exact(16)) {
        let lane = |s: &[f32]| f32x8::from(<[f32; 8]>::try_from(s).expect("8 lanes"));
        s0 = lane(&x[..8]).mul_add(lane(&y[..8]), s0);
        s1 = lane(&x[8..]).mul_add(lane(&y[8..]), s1);
    }
    let tail: f32 = a[n..].iter().zip(&b[n..]).map(|(x, y)| x * y).sum();
    (s0 + s1).reduce_add() + tail
}

/// `o += a · x + c` lane-wise.
#[inline]
fn axpb(o: &mut [f32], a: f32, x: &[f32], c: f32) {
    let n = o.len().min(x.len()) / 8 * 8;
    let (av, cv) = (f32x8::splat(a), f32x8::splat(c));
    for (os, xs) in o[..n].chunks_exact_mut(8).zip(x[..n].chunks_exact(8)) {
        let ov = f32x8::from(<[f32; 8]>::try_from(&*os).expect("8 lanes"));
        let xv = f32x8::from(<[f32; 8]>::try_from(xs).expect("8 lanes"));
        os.copy_from_slice(&(xv.mul_add(av, ov) + cv).to_array());
    }
    for (o, &xv) in o[n..].iter_mut().zip(&x[n..]) {
        *o += a * xv + c;
    }
}

/// Row `r` of a per-group block from its levels, in place: `x = level · scale_g + offset_g`
/// (unfused, as the reference rounds it: dequantize is bit-exact).
#[inline]
fn apply_groups(x: &mut [f32], r: usize, group: usize, scale: &[f32], offset: Option<&[f32]>) {
    let per_row = x.len() / group;
    let at = r * per_row..(r + 1) * per_row;
    match offset {
        Some(o) => {
            for ((xs, &s), &f) in x.chunks_exact_mut(group).zip(&scale[at.clone()]).zip(&o[at]) {
                xs.iter_mut().for_each(|v| *v = *v * s + f);
            }
        }
        None => {
            for (xs, &s) in x.chunks_exact_mut(group).zip(&scale[at]) {
                // `+ 0.0` as the reference computes it: a zero scale gives +0, not −0.
                xs.iter_mut().for_each(|v| *v = *v * s + 0.0);
            }
        }
    }
}

/// Per-channel scores: the scales folded into each query row (`q'_d = q_d · scale_d`) and
/// the offsets into one constant per row (`Σ q_d · offset_d`), once per block.
pub(crate) fn fold_channels(
    q: &[f32],
    n_q: usize,
    scale: &[f32],
    offset: Option<&[f32]>,
    qw: &mut Vec<f32>,
    cst: &mut Vec<f32>,
) {
    let d = scale.len();
    qw.resize(n_q * d, 0.0);
    cst.resize(n_q, 0.0);
    for i in 0..n_q {
        let qi = &q[i * d..(i + 1) * d];
        for ((w, &x), &s) in qw[i * d..(i + 1) * d].iter_mut().zip(qi).zip(scale) {
            *w = x * s;
        }
        cst[i] = offset.map_or(0.0, |o| dot(qi, o));
    }
}

/// Buffers the kernels of this backend reuse (part of [`crate::Scratch`]): decode calls them
/// once per block and must not allocate on every call.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) codes: Vec<u8>,
    pub(crate) levels: Vec<f32>,
    pub(crate) qw: Vec<f32>,
    pub(crate) cst: Vec<f32>,
    pub(crate) acc: Vec<f32>,
    /// Query rows in a packed row's bit order (the AVX2 any-width score kernels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) arranged: Arranged,
}

/// Query rows in the bit order of packed rows, and the code of each field per row length and
/// width (computed once per shape: the width regions of `-qa` keys alternate block by block).
#[derive(Default)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Arranged {
    pub(crate) q: Vec<f32>,
    pub(crate) codes: Vec<((usize, u8), Vec<u32>)>,
}

/// See [`crate::scalar::dequantize`].
pub fn dequantize(b: &QuantBlock<'_>, out: &mut [f32]) {
    crate::with_scratch(|w| dequantize_in(b, out, &mut w.wide.codes))
}

fn dequantize_in(b: &QuantBlock<'_>, out: &mut [f32], codes: &mut Vec<u8>) {
    let d = b.dim;
    for (r, o) in out.chunks_exact_mut(d).take(b.rows).enumerate() {
        unpack_levels(b, r, o, codes);
        match b.params {
            Params::PerRow { scale, offset } => {
                let (s, off) = (scale[r], offset.map_or(0.0, |x| x[r]));
                for v in o.iter_mut() {
                    *v = *v * s + off;
                }
            }
            Params::PerChannel { scale, offset } => {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = *v * scale[i] + offset.map_or(0.0, |x| x[i]);
                }
            }
            Params::PerGroup { group, scale, offset } => apply_groups(o, r, group, scale, offset),
        }
    }
}

/// See [`crate::decode_turn_with`]: each row unpacked into this thread's scratch, then f32
/// loops that the compiler vectorizes for the target.
pub fn decode_turn(t: &crate::TurnRows<'_>, out: &mut [f32]) {
    crate::with_scratch(|w| decode_turn_in(t, out, &mut w.wide.codes));
}

pub(crate) fn decode_turn_in(t: &crate::TurnRows<'_>, out: &mut [f32], c: &mut Vec<u8>) {
    let (d, h) = (t.dim, t.dim / 2);
    let (scale, offset) = (&t.scale[..d], &t.offset[..d]);
    c.resize(d, 0);
    for (r, y) in out.chunks_exact_mut(d).enumerate() {
        t.unpack(r, c);
        let (cos, sin) = t.table[r * 2 * d..(r + 1) * 2 * d].split_at(d);
        let x = |k: usize| f32::from(c[k]) * scale[k] + offset[k];
        match t.pairing {
            kvq_quant_core::RopePairing::Half => {
                let (yl, yh) = y.split_at_mut(h);
                for j in 0..h {
                    let (lo, hi) = (x(j), x(h + j));
                    yl[j] = lo * cos[j] + hi * sin[j];
                    yh[j] = hi * cos[h + j] + lo * sin[h + j];
                }
            }
            kvq_quant_core::RopePairing::Interleaved => {
                for (j, pair) in y.chunks_exact_mut(2).enumerate() {
                    let (a, b) = (2 * j, 2 * j + 1);
                    let (xa, xb) = (x(a), x(b));
                    pair[0] = xa * cos[a] + xb * sin[a];
                    pair[1] = xb * cos[b] + xa * sin[b];
                }
            }
        }
    }
}

/// See [`crate::scalar::scores`].
pub(crate) fn scores_in(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32], w: &mut Scratch) {
    let d = b.dim;
    let Scratch { codes, levels, qw, cst, .. } = w;
    levels.resize(d, 0.0);
    match b.params {
        Params::PerRow { scale, offset } => {
            // Σ q per query row, kept in `cst`.
            cst.clear();
            cst.extend(q.chunks_exact(d).take(n_q).map(|qi| qi.iter().sum::<f32>()));
            for r in 0..b.rows {
                unpack_levels(b, r, levels, codes);
                let off = offset.map_or(0.0, |o| o[r]);
                for i in 0..n_q {
                    out[i * b.rows + r] = scale[r] * dot(&q[i * d..(i + 1) * d], levels) + off * cst[i];
                }
            }
        }
        Params::PerChannel { scale, offset } => {
            fold_channels(q, n_q, scale, offset, qw, cst);
            for r in 0..b.rows {
                unpack_levels(b, r, levels, codes);
                for i in 0..n_q {
                    out[i * b.rows + r] = dot(&qw[i * d..(i + 1) * d], levels) + cst[i];
                }
            }
        }
        // Several scales per row: the row is decoded once (shared by the query group), then
        // dotted with each query.
        Params::PerGroup { group, scale, offset } => {
            for r in 0..b.rows {
                unpack_levels(b, r, levels, codes);
                apply_groups(levels, r, group, scale, offset);
                for i in 0..n_q {
                    out[i * b.rows + r] = dot(&q[i * d..(i + 1) * d], levels);
                }
            }
        }
    }
}

/// See [`crate::scalar::axpy`].
pub(crate) fn axpy_in(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32], w: &mut Scratch) {
    let d = b.dim;
    let Scratch { codes, levels, acc, .. } = w;
    levels.resize(d, 0.0);
    match b.params {
        Params::PerRow { scale, offset } => {
            for r in 0..b.rows {
                unpack_levels(b, r, levels, codes);
                let off = offset.map_or(0.0, |o| o[r]);
                for i in 0..n_q {
                    let w = p[i * b.rows + r];
                    axpb(&mut out[i * d..(i + 1) * d], w * scale[r], levels, w * off);
                }
            }
        }
        Params::PerChannel { scale, offset } => {
            // Σ_r p_r (L_r · s + o) = s · Σ_r p_r L_r + o · Σ_r p_r.
            acc.clear();
            acc.resize(n_q * d, 0.0);
            for r in 0..b.rows {
                unpack_levels(b, r, levels, codes);
                for i in 0..n_q {
                    axpb(&mut acc[i * d..(i + 1) * d], p[i * b.rows + r], levels, 0.0);
                }
            }
            for i in 0..n_q {
                let psum: f32 = p[i * b.rows..(i + 1) * b.rows].iter().sum();
                let o = &mut out[i * d..(i + 1) * d];
                for (k, (ov, &a)) in o.iter_mut().zip(&acc[i * d..(i + 1) * d]).enumerate() {
                    *ov += a * scale[k] + offset.map_or(0.0, |x| x[k]) * psum;
                }
            }
        }
        Params::PerGroup { group, scale, offset } => {
            for r in 0..b.rows {
                unpack_levels(b, r, levels, codes);
                apply_groups(levels, r, group, scale, offset);
                for i in 0..n_q {
                    axpb(&mut out[i * d..(i + 1) * d], p[i * b.rows + r], levels, 0.0);
                }
            }
        }
    }
}

/// See [`crate::scalar::dense_scores`]: each row dotted with every query in 16 lanes.
pub fn dense_scores(x: &[f32], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        for i in 0..n_q {
            out[i * rows + r] = dot(&q[i * dim..(i + 1) * dim], xr);
        }
    }
}

/// See [`crate::scalar::dense_axpy`]: each row added into every query's output, 8 lanes.
pub fn dense_axpy(x: &[f32], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        for i in 0..n_q {
            axpb(&mut out[i * dim..(i + 1) * dim], p[i * rows + r], xr, 0.0);
        }
    }
}

/// Values of an f16 row widened per piece into a stack buffer (no allocation, any length).
const F16_PIECE: usize = 256;

/// See [`crate::scalar::dense_scores_f16`]: each row widened a piece at a time with `half`'s
/// slice conversion (F16C, NEON), dotted with every query's matching piece.
pub fn dense_scores_f16(x: &[half::f16], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut buf = [0f32; F16_PIECE];
    for r in 0..rows {
        for i in 0..n_q {
            out[i * rows + r] = 0.0;
        }
        for c0 in (0..dim).step_by(F16_PIECE) {
            let n = F16_PIECE.min(dim - c0);
            x[r * dim + c0..r * dim + c0 + n].convert_to_f32_slice(&mut buf[..n]);
            for i in 0..n_q {
                out[i * rows + r] += dot(&q[i * dim + c0..i * dim + c0 + n], &buf[..n]);
            }
        }
    }
}

/// See [`crate::scalar::dense_axpy_f16`]: each row widened a piece at a time, as in
/// [`dense_scores_f16`].
pub fn dense_axpy_f16(x: &[half::f16], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut buf = [0f32; F16_PIECE];
    for r in 0..rows {
        for c0 in (0..dim).step_by(F16_PIECE) {
            let n = F16_PIECE.min(dim - c0);
            x[r * dim + c0..r * dim + c0 + n].convert_to_f32_slice(&mut buf[..n]);
            for i in 0..n_q {
                axpb(&mut out[i * dim + c0..i * dim + c0 + n], p[i * rows + r], &buf[..n], 0.0);
            }
        }
    }
}
