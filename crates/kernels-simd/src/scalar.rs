//! The scalar reference: every value decoded one by one, sums accumulated in f64. Slow and
//! obviously right; every other backend is tested against it.

use kvq_quant_core::pack::unpack_row;

use crate::block::{Params, QuantBlock};

/// Whether the integer value paths and the fused kernels take `b`'s parameters (per row or per
/// channel; a per-group block has several scales per row, which one integer sum per row or
/// channel cannot carry). The integer score path takes per-group blocks too: one dot per group.
pub(crate) fn integer_params(b: &QuantBlock<'_>) -> bool {
    !matches!(b.params, Params::PerGroup { .. })
}

/// Decodes row `r` into `out` (`dim` values) exactly as quant-core's codec does.
pub fn decode_row(b: &QuantBlock<'_>, r: usize, out: &mut [f32]) {
    let mut codes = vec![0u8; b.dim];
    unpack_row(b.row(r), b.bits, &mut codes).expect("QuantBlock::new checked the lengths");
    for (d, (o, &c)) in out.iter_mut().zip(&codes).enumerate() {
        let (scale, offset) = b.params.at(r, d, b.dim);
        *o = b.level(c) * scale + offset;
    }
}

/// `out[r · dim + d] = x̂[r][d]`.
pub fn dequantize(b: &QuantBlock<'_>, out: &mut [f32]) {
    for (r, o) in out.chunks_exact_mut(b.dim).take(b.rows).enumerate() {
        decode_row(b, r, o);
    }
}

/// `out[i · rows + r] = Σ_d q[i · dim + d] · x̂[r][d]` for `n_q` query rows.
pub fn scores(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) {
    let mut row = vec![0f32; b.dim];
    for r in 0..b.rows {
        decode_row(b, r, &mut row);
        for i in 0..n_q {
            let qi = &q[i * b.dim..(i + 1) * b.dim];
            out[i * b.rows + r] =
                qi.iter().zip(&row).map(|(&a, &x)| f64::from(a) * f64::from(x)).sum::<f64>() as f32;
        }
    }
}

/// `out[i · dim + d] += Σ_r p[i · rows + r] · x̂[r][d]` for `n_q` weight rows.
pub fn axpy(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32]) {
    let mut acc = vec![0f64; n_q * b.dim];
    let mut row = vec![0f32; b.dim];
    for r in 0..b.rows {
        decode_row(b, r, &mut row);
        for i in 0..n_q {
            let w = f64::from(p[i * b.rows + r]);
            for (a, &x) in acc[i * b.dim..(i + 1) * b.dim].iter_mut().zip(&row) {
                *a += w * f64::from(x);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = (f64::from(*o) + a) as f32;
    }
}

/// The integer score path's reference: each query row (per-channel: times the scales) rounded
/// to int8 as every integer kernel rounds it, plain integer dots with the codes (per group for
/// per-group parameters; a 16-level table's levels rounded to int8, or 4-bit symmetric levels,
/// in place of the codes), and the shared float epilogue. Every integer kernel equals it bit
/// for bit. Returns `false`, computing nothing, for other levels (wider symmetric codes, FP8,
/// wider tables).
pub fn scores_int8(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    if !matches!(b.levels, crate::block::Levels::Affine) && !crate::int8::has_table8(b) {
        return false;
    }
    let mut scratch = crate::int8::Scratch::default();
    crate::int8::scores_by_block::<crate::int8::Reference>(b, q, n_q, out, &mut scratch);
    true
}

/// The integer value path's reference: weights rounded per block as every integer value
/// kernel rounds them (8 bits for codes of up to 4 bits, 16 above), exact integer sums with
/// the centred codes, and the shared float epilogue (see
/// [`crate::axpy_int_with`]). Every integer value kernel equals it bit for bit.
/// Returns `false`, computing nothing, for levels that are not the codes themselves and for
/// per-group parameters.
pub fn axpy_int(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    if !matches!(b.levels, crate::block::Levels::Affine) || !integer_params(b) {
        return false;
    }
    let mut scratch = crate::int_values::Scratch::default();
    crate::int_values::axpy_by_block::<crate::int_values::Reference>(b, p, n_q, out, &mut scratch);
    true
}

/// The reference of `kvq_kernels_simd::attend_int_with`: [`scores_int8`] of the block's keys,
/// the online softmax step of each query row (maximum skipping NaN scores, `f32::exp`, sums in
/// order) and [`axpy_int`] of the values, as decode runs them one after the other; values per
/// group (which [`axpy_int`] refuses) take the same algebra one group of channels at a time,
/// each with its own weight scale per query row (keys per group take [`scores_int8`]'s
/// per-group epilogue). Returns `false`, changing nothing, where the integer paths do not
/// apply (levels that are not affine).
pub fn attend_int(
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
) -> bool {
    attend_int_parts(std::slice::from_ref(k), v, q, n_q, state)
}

/// The reference of `kvq_kernels_simd::attend_int_parts_with`: [`attend_int`] with the keys
/// in parts, consecutive blocks of their own parameters (per-channel keys whose parameters
/// change every few tokens of a longer block of values): the scores of each part by
/// [`scores_int8`], side by side, then one online softmax step and one value sum over all
/// the rows, as [`attend_int`] takes one block. Returns `false`, changing nothing, where the
/// integer paths do not apply (levels that are not affine) or the parts' rows do not add up
/// to the values' (or differ from them in head_dim).
pub fn attend_int_parts(
    ks: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
) -> bool {
    let crate::Online { m, l, o } = state;
    let affine = |b: &QuantBlock<'_>| matches!(b.levels, crate::block::Levels::Affine);
    let rows: usize = ks.iter().map(|k| k.rows).sum();
    if ks.is_empty() || ks.iter().any(|k| !affine(k) || k.dim != v.dim) || !affine(v) || rows != v.rows {
        return false;
    }
    let n = v.rows;
    let mut s = vec![0f32; n_q * n];
    let mut part = Vec::new();
    let mut at = 0;
    for k in ks {
        part.resize(n_q * k.rows, 0.0);
        scores_int8(k, q, n_q, &mut part);
        for i in 0..n_q {
            s[i * n + at..i * n + at + k.rows].copy_from_slice(&part[i * k.rows..(i + 1) * k.rows]);
        }
        at += k.rows;
    }
    softmax_values(s, v, n_q, crate::Online { m, l, o })
}

/// The reference of `kvq_kernels_simd::attend_int_regions_with`: [`attend_int`] with the keys
/// in channel regions (`-qa` keys: each width's channels a per-channel block of their own,
/// side by side along the row): each region scored by [`scores_int8`] with its columns of the
/// query rows, the regions' scores added in order (as decode's separate kernels add them),
/// then one online softmax step and one value sum. Returns `false`, changing nothing, where
/// the integer paths do not apply (levels that are not affine) or the regions do not tile the
/// values' head_dim in order with the values' rows.
pub fn attend_int_regions(
    regions: &[crate::KeyRegion<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
) -> bool {
    if !crate::regions_tile(regions, v.rows, v.dim) || !matches!(v.levels, crate::block::Levels::Affine) {
        return false;
    }
    let mut s = vec![0f32; n_q * v.rows];
    scores_int8_regions(regions, q, n_q, &mut s) && softmax_values(s, v, n_q, state)
}

/// The reference of `kvq_kernels_simd::scores_int8_regions_with`: each region's
/// [`scores_int8`] with its columns of the query rows (`q`, `n_q` rows of the regions'
/// channels together), added in order into `out[i · rows + r]`, written from zero. Returns
/// `false`, computing nothing, for regions that are not affine or do not tile a row in order
/// with the same rows, or an `out` too short.
pub fn scores_int8_regions(regions: &[crate::KeyRegion<'_>], q: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    let d: usize = regions.iter().map(|r| r.keys.dim).sum();
    let n = regions.first().map_or(0, |r| r.keys.rows);
    let affine = |b: &QuantBlock<'_>| matches!(b.levels, crate::block::Levels::Affine);
    if !crate::regions_tile(regions, n, d)
        || regions.iter().any(|r| !affine(&r.keys))
        || q.len() != n_q * d
        || out.len() < n_q * n
    {
        return false;
    }
    let out = &mut out[..n_q * n];
    out.fill(0.0);
    let (mut qr, mut part) = (Vec::new(), vec![0f32; n_q * n]);
    for r in regions {
        let c = r.keys.dim;
        qr.clear();
        for row in q.chunks_exact(d) {
            qr.extend_from_slice(&row[r.first..r.first + c]);
        }
        scores_int8(&r.keys, &qr, n_q, &mut part);
        out.iter_mut().zip(&part).for_each(|(x, y)| *x += y);
    }
    true
}

/// The online softmax step over `s` (`n_q` rows of the block's scores) and the integer sum
/// of the values `v` of [`attend_int_parts`].
fn softmax_values(mut s: Vec<f32>, v: &QuantBlock<'_>, n_q: usize, state: crate::Online<'_>) -> bool {
    let crate::Online { m, l, o } = state;
    softmax_step(&mut s, v.rows, v.dim, m, l, o);
    if matches!(v.params, Params::PerGroup { .. }) {
        crate::int_values::axpy_grouped_reference(v, &s, n_q, o);
        return true;
    }
    axpy_int(v, &s, n_q, o)
}

/// The reference of `kvq_kernels_simd::attend_float_with`: the scores of the keys `k` by
/// [`scores`], the online softmax step over them (as decode's float path takes it: each
/// row's maximum with the running one, NaN scores skipped; a row whose maximum stays −∞ gets
/// zero weights), and the sum of the values `v` under the weights by [`axpy`]. Returns
/// `false`, changing nothing, when the blocks differ in rows or head_dim.
pub fn attend_float(
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
) -> bool {
    if k.rows != v.rows || k.dim != v.dim {
        return false;
    }
    let crate::Online { m, l, o } = state;
    let mut s = vec![0f32; n_q * k.rows];
    scores(k, q, n_q, &mut s);
    softmax_step(&mut s, v.rows, v.dim, m, l, o);
    axpy(v, &s, n_q, o);
    true
}

/// The online softmax step over the scores `s` (rows of `n`), replaced by their weights,
/// for the state `m`, `l` and `o` (rows of `d`).
fn softmax_step(s: &mut [f32], n: usize, d: usize, m: &mut [f32], l: &mut [f32], o: &mut [f32]) {
    for i in 0..m.len() {
        let row = &mut s[i * n..(i + 1) * n];
        let top = row.iter().fold(m[i], |a, &x| if x > a { x } else { a });
        if top == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let f = (m[i] - top).exp();
        let mut sum = 0f32;
        for x in row.iter_mut() {
            *x = (*x - top).exp();
            sum += *x;
        }
        l[i] = l[i] * f + sum;
        m[i] = top;
        if f != 1.0 {
            o[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= f);
        }
    }
}

/// Scores against full-precision rows (the cache's f32 tails and sinks):
/// `out[i · rows + r] = Σ_d q[i · dim + d] · x[r · dim + d]`, summed in f64.
pub fn dense_scores(x: &[f32], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        for i in 0..n_q {
            let qi = &q[i * dim..(i + 1) * dim];
            out[i * rows + r] =
                qi.iter().zip(xr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32;
        }
    }
}

/// [`dense_scores`] over f16 rows, each value widened exactly.
pub fn dense_scores_f16(x: &[half::f16], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        for i in 0..n_q {
            let qi = &q[i * dim..(i + 1) * dim];
            out[i * rows + r] =
                qi.iter().zip(xr).map(|(&a, b)| f64::from(a) * f64::from(b.to_f32())).sum::<f64>() as f32;
        }
    }
}

/// [`dense_axpy`] over f16 rows, each value widened exactly.
pub fn dense_axpy_f16(x: &[half::f16], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
    for i in 0..n_q {
        for (d, o) in out[i * dim..(i + 1) * dim].iter_mut().enumerate() {
            let sum: f64 =
                (0..rows).map(|r| f64::from(p[i * rows + r]) * f64::from(x[r * dim + d].to_f32())).sum();
            *o = (f64::from(*o) + sum) as f32;
        }
    }
}

/// Values from full-precision rows: `out[i · dim + d] += Σ_r p[i · rows + r] · x[r · dim + d]`,
/// summed in f64.
pub fn dense_axpy(x: &[f32], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
    for i in 0..n_q {
        for (d, o) in out[i * dim..(i + 1) * dim].iter_mut().enumerate() {
            let sum: f64 = (0..rows).map(|r| f64::from(p[i * rows + r]) * f64::from(x[r * dim + d])).sum();
            *o = (f64::from(*o) + sum) as f32;
        }
    }
}

/// One row of `t` decoded and turned in f64, the reference of [`crate::decode_turn_with`].
fn turned_row(t: &crate::TurnRows<'_>, r: usize, codes: &mut [u8], row: &mut [f64]) {
    let d = t.dim;
    t.unpack(r, codes);
    let x = |k: usize| f64::from(codes[k]) * f64::from(t.scale[k]) + f64::from(t.offset[k]);
    let tab = &t.table[r * 2 * d..(r + 1) * 2 * d];
    for i in 0..d / 2 {
        let (a, b) = t.pairing.channels(i, d);
        row[a] = x(a) * f64::from(tab[a]) + x(b) * f64::from(tab[d + a]);
        row[b] = x(b) * f64::from(tab[b]) + x(a) * f64::from(tab[d + b]);
    }
}

/// Reference of [`crate::decode_turn_with`], in f64 (one rounding to f32 per output).
pub fn decode_turn(t: &crate::TurnRows<'_>, out: &mut [f32]) {
    let d = t.dim;
    let (mut codes, mut row) = (vec![0u8; d], vec![0f64; d]);
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        turned_row(t, r, &mut codes, &mut row);
        o.iter_mut().zip(&row).for_each(|(o, &v)| *o = v as f32);
    }
}

/// Reference of [`crate::scores_turn_with`]: the rows of [`decode_turn`] kept in f64 and
/// dotted in f64.
pub fn scores_turn(t: &crate::TurnRows<'_>, q: &[f32], n_q: usize, out: &mut [f32]) {
    let (d, n) = (t.dim, t.rows());
    let (mut codes, mut row) = (vec![0u8; d], vec![0f64; d]);
    for r in 0..n {
        turned_row(t, r, &mut codes, &mut row);
        for i in 0..n_q {
            let qi = &q[i * d..(i + 1) * d];
            out[i * n + r] = qi.iter().zip(&row).map(|(&w, &v)| f64::from(w) * v).sum::<f64>() as f32;
        }
    }
}

/// Reference of [`crate::widen_f16`]: `out[i]` is the little-endian f16 at `bytes[2i..]`,
/// through `half`.
pub fn widen_f16(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}
