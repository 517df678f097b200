//! The algebra of the integer score path, shared by the AVX2, AVX-512 VNNI and dotprod kernels
//! and by its scalar reference: each query row (per-channel: the query times the channel
//! scales) is rounded to int8 with one scale, an architecture kernel computes the integer dots
//! of the rows' codes with it, and a float epilogue restores the scales and adds the offsets
//! (through the exact float sum of the query).
//!
//! Per-group blocks (`gN`: a scale and offset per `group` values of a row) take the same path
//! with one integer dot per group (a kernel may write them as sums of shorter runs, which the
//! epilogue adds exactly in i32), each scaled by its group's scale, the offsets through the
//! float sum of the query over the group.
//!
//! Blocks of a 16-level table (NF4, 4-bit codebooks) take it too, the table's levels rounded to
//! int8 with one scale ([`table8`]) in place of the codes, that scale joining the query's; and
//! symmetric 4-bit blocks, their levels `c − 8` exact in int8.
//!
//! Everything but the integer dots is this module's code, so every architecture gives the same
//! scores bit for bit as [`crate::scalar::scores_int8`].

use std::ops::Range;

use crate::block::{Levels, Params, QuantBlock};
use crate::wide_backend::{dot_lanes, sum_lanes};

/// Rows handed to an architecture kernel per call: the dots of one call stay in L1 when a
/// block is large (a bench block of millions of rows), and a cache block is one call.
const CHUNK_ROWS: usize = 256;

/// Query rows at a time: every key row is loaded once for up to this many (a GQA group).
pub(crate) const GROUP: usize = 4;

/// The levels of a 16-level table block (4-bit codes) rounded to int8: `round(T[c] / st)` with
/// `st = max|T| / 127` (ties to even), and `st`; symmetric 4-bit levels `c − zero` as they are
/// (`st = 1`, exact); `None` for other blocks. NaN levels give a NaN `st`, which reaches every
/// score.
#[inline]
pub(crate) fn table8(b: &QuantBlock<'_>) -> Option<([i8; 16], f32)> {
    if !has_table8(b) {
        return None;
    }
    let t = match b.levels {
        Levels::Table(t) => t,
        Levels::Symmetric { zero } => return Some((std::array::from_fn(|c| (c as f32 - zero) as i8), 1.0)),
        Levels::Affine | Levels::Fp8(_) => unreachable!("has_table8"),
    };
    let max = t.iter().fold(0f32, |m, &v| if v.abs() > m { v.abs() } else { m });
    let (st, inv) = scale_of(max, t.iter().any(|v| v.is_nan()), 127.0);
    Some((std::array::from_fn(|c| round_code(t[c], inv, 127.0) as i8), st))
}

/// Whether [`table8`] has levels for `b`, without rounding them (the support checks, once per
/// block): 4-bit codes of a 16-level table, or symmetric ones with an integer zero point
/// within the codes' range (which keeps every level an exact int8).
#[inline]
pub(crate) fn has_table8(b: &QuantBlock<'_>) -> bool {
    b.bits == 4
        && match b.levels {
            Levels::Table(t) => t.len() == 16,
            Levels::Symmetric { zero } => zero.fract() == 0.0 && (0.0..=15.0).contains(&zero),
            Levels::Affine | Levels::Fp8(_) => false,
        }
}

/// `max|q| / 127`, returned, and `q / scale` rounded into −127..=127, appended to `out`.
#[inline(always)]
pub(crate) fn quantize_query(q: &[f32], out: &mut Vec<i8>) -> f32 {
    round_symmetric(q, 127.0, out, |v| v as i8)
}

/// `max|x| / limit`, returned, and `x / scale` rounded (ties to even) into `−limit..=limit`,
/// appended to `out` through `cast`; all zeros (scale 0) when `x` is. For limits up to 2^22.
///
/// Decode runs this once per block and row (queries here, weights in [`crate::int_values`]), so it
/// is written to vectorize on baseline SSE2: the maximum in 8 independent lanes, and rounding
/// by adding and subtracting 1.5 · 2^23 rather than through a libm `round` call per value.
#[inline(always)]
pub(crate) fn round_symmetric<T: Copy + Default>(
    x: &[f32],
    limit: f32,
    out: &mut Vec<T>,
    cast: impl Fn(i32) -> T,
) -> f32 {
    let mut lanes = [0f32; 8];
    let mut nan = [false; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for ((m, n), &v) in lanes.iter_mut().zip(&mut nan).zip(c) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
            *n |= v.is_nan();
        }
    }
    let any_nan = nan.contains(&true) || chunks.remainder().iter().any(|v| v.is_nan());
    finish_rounding(x, limit, lane_max(&lanes, chunks.remainder()), any_nan, out, cast)
}

/// The largest `|v|` of the values not taken into lanes and of the lanes' maxima (NaN skipped).
#[inline(always)]
pub(crate) fn lane_max(lanes: &[f32; 8], rest: &[f32]) -> f32 {
    rest.iter().chain(lanes).fold(0f32, |m, &v| if v.abs() > m { v.abs() } else { m })
}

/// 1.5 · 2^23: for `|v| ≤ 2^22`, the bits of `v + MAGIC` are MAGIC's plus `v` rounded (ties to
/// even), so an integer subtraction reads the rounded value out (no float-to-int conversion
/// with its NaN checks).
pub(crate) const MAGIC: f32 = 12_582_912.0;

/// `v · inv` rounded (ties to even) into `−limit..=limit`, the element step of every rounding.
#[inline(always)]
pub(crate) fn round_code(v: f32, inv: f32, limit: f32) -> i32 {
    let v = (v * inv).clamp(-limit, limit);
    (v + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

/// The scale `max / limit` of a rounding and its inverse (0 for a zero scale); NaN when any
/// value was NaN.
#[inline(always)]
pub(crate) fn scale_of(max: f32, any_nan: bool, limit: f32) -> (f32, f32) {
    let scale = if any_nan {
        f32::NAN
    } else if max > 0.0 {
        max / limit
    } else {
        0.0
    };
    (scale, if scale > 0.0 { 1.0 / scale } else { 0.0 })
}

/// [`scale_of`] of four maxima at once (`max / limit`, NaN where flagged, and the
/// inverse; 0 for a zero maximum): the same IEEE divisions, so the same bits, in two vector
/// instructions (SSE, part of every x86-64) instead of eight dependent scalar ones.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn scales_of4(max: [f32; 4], nan: [bool; 4], limit: f32) -> ([f32; 4], [f32; 4]) {
    let mut scale = [0f32; 4];
    for i in 0..4 {
        scale[i] = if nan[i] {
            f32::NAN
        } else if max[i] > 0.0 {
            max[i]
        } else {
            0.0
        };
    }
    let (mut s, mut inv) = ([0f32; 4], [0f32; 4]);
    // SAFETY: the arrays hold 4 floats.
    unsafe {
        use std::arch::x86_64::*;
        let sv = _mm_div_ps(_mm_loadu_ps(scale.as_ptr()), _mm_set1_ps(limit));
        _mm_storeu_ps(s.as_mut_ptr(), sv);
        _mm_storeu_ps(inv.as_mut_ptr(), _mm_div_ps(_mm_set1_ps(1.0), sv));
    }
    for (x, &s) in inv.iter_mut().zip(&s) {
        if s.is_nan() || s <= 0.0 {
            *x = 0.0;
        }
    }
    (s, inv)
}

/// The scale of [`round_symmetric`] from the largest `|x|`, and the rounding itself. A NaN
/// anywhere in `x` makes the scale NaN, so that it reaches every result computed with it (a
/// NaN would otherwise drop out of the maximum and leave finite, meaningless codes).
#[inline(always)]
fn finish_rounding<T: Copy + Default>(
    x: &[f32],
    limit: f32,
    max: f32,
    any_nan: bool,
    out: &mut Vec<T>,
    cast: impl Fn(i32) -> T,
) -> f32 {
    let (scale, inv) = scale_of(max, any_nan, limit);
    // Into a slice of the final length (not `extend`, which compiles to an out-of-line fold
    // that does not vectorize).
    for (o, &v) in appended(out, x.len()).iter_mut().zip(x) {
        *o = cast(round_code(v, inv, limit));
    }
    scale
}

/// Up to [`GROUP`] query rows rounded for one block: `n` rows of `dim` int8 values in natural
/// order, each row's scale, and what its epilogue adds (`Σ q` per row; `Σ q · offset` per
/// channel; per group, `Σ q` over each group of the row in `group_sums`).
#[derive(Default)]
pub(crate) struct Prepared {
    pub(crate) q8: Vec<i8>,
    pub(crate) scale: [f32; GROUP],
    pub(crate) add: [f32; GROUP],
    qw: Vec<f32>,
    /// Per-group blocks with offsets: `n × dim / group` sums of the query over each group.
    group_sums: Vec<f32>,
    /// Per-group blocks: the epilogue's terms, one per (row, group) of a call.
    terms: Vec<f32>,
    /// Per-group blocks whose kernel sums shorter runs than a group: the groups' dots.
    group_dots: Vec<i32>,
}

impl Prepared {
    /// Rounds the up to [`GROUP`] rows of `q` for block `b` through kernel `K`'s rounding.
    #[inline(always)]
    pub(crate) fn prepare<K: IntKernel>(&mut self, b: &QuantBlock<'_>, q: &[f32]) {
        let d = b.dim;
        self.q8.clear();
        if let Params::PerChannel { scale, offset } = b.params {
            // The rows against the same channel scales: rounded together where a kernel can.
            let n = q.len() / d;
            K::round_queries_scaled(q, scale, &mut self.qw, &mut self.q8, &mut self.scale[..n]);
            for (i, qi) in q.chunks_exact(d).enumerate() {
                self.add[i] = offset.map_or(0.0, |o| K::dot(qi, o));
            }
            return;
        }
        self.group_sums.clear();
        for (i, qi) in q.chunks_exact(d).enumerate() {
            self.scale[i] = K::round_query(qi, &mut self.q8);
            match b.params {
                Params::PerRow { .. } => self.add[i] = K::sum(qi),
                Params::PerGroup { group, offset: Some(_), .. } => {
                    self.group_sums.extend(qi.chunks_exact(group).map(K::sum));
                }
                Params::PerGroup { offset: None, .. } => {}
                Params::PerChannel { .. } => unreachable!("rounded above"),
            }
        }
    }

    /// What a preparation for `b` depends on besides the query rows, when that is not the
    /// block's parameters (per-channel blocks fold their scales into the query).
    #[inline(always)]
    fn reusable<K: IntKernel + 'static>(b: &QuantBlock<'_>) -> Option<Made> {
        let (group, offset) = match b.params {
            Params::PerChannel { .. } => return None,
            Params::PerRow { offset, .. } => (None, offset.is_some()),
            Params::PerGroup { group, offset, .. } => (Some(group), offset.is_some()),
        };
        Some(Made { kernel: std::any::TypeId::of::<K>(), dim: b.dim, bits: b.bits, group, offset })
    }

    /// `out[(i0 + i) · rows + r] = score` for rows `at` of the block, from their integer dots
    /// (`dots[i · at.len() + r − at.start]`; per group, kernel `K`'s [`IntKernel::dots`]).
    #[inline(always)]
    fn epilogue<K: IntKernel>(
        &mut self,
        b: &QuantBlock<'_>,
        i0: usize,
        n: usize,
        at: Range<usize>,
        dots: &[i32],
        out: &mut [f32],
    ) {
        let (m, seg) = (at.len(), K::segment(b));
        // A table's int8 levels carry a scale of their own (1 for codes, which changes no bit).
        let st = table8(b).map_or(1.0, |(_, st)| st);
        if let Params::PerGroup { group, scale, offset } = b.params {
            let (per_row, runs) = (b.dim / group, b.dim / seg);
            let span = at.start * per_row..at.end * per_row;
            for i in 0..n {
                let o = &mut out[(i0 + i) * b.rows + at.start..(i0 + i) * b.rows + at.end];
                let dots = &dots[i * m * runs..(i + 1) * m * runs];
                let dots = if runs == per_row {
                    dots
                } else {
                    // Several runs a group: their sums, exact in i32 (at most 255 · 127 a
                    // value), in row order.
                    let k = runs / per_row;
                    self.group_dots.clear();
                    self.group_dots.extend(dots.chunks_exact(k).map(|c| c.iter().sum::<i32>()));
                    &self.group_dots[..]
                };
                let sums =
                    offset.map(|f| (&f[span.clone()], &self.group_sums[i * per_row..(i + 1) * per_row]));
                group_scores(
                    self.scale[i] * st,
                    &scale[span.clone()],
                    sums,
                    dots,
                    per_row,
                    &mut self.terms,
                    o,
                );
            }
            return;
        }
        for i in 0..n {
            let (qs, add) = (self.scale[i] * st, self.add[i]);
            let o = &mut out[(i0 + i) * b.rows + at.start..(i0 + i) * b.rows + at.end];
            let dots = &dots[i * m..(i + 1) * m];
            match b.params {
                Params::PerRow { scale, offset: Some(off) } => {
                    for (((o, &dot), &s), &f) in
                        o.iter_mut().zip(dots).zip(&scale[at.clone()]).zip(&off[at.clone()])
                    {
                        *o = s * qs * dot as f32 + f * add;
                    }
                }
                Params::PerRow { scale, offset: None } => {
                    for ((o, &dot), &s) in o.iter_mut().zip(dots).zip(&scale[at.clone()]) {
                        *o = s * qs * dot as f32;
                    }
                }
                Params::PerGroup { .. } => unreachable!("scored above"),
                Params::PerChannel { .. } => {
                    for (o, &dot) in o.iter_mut().zip(dots) {
                        *o = qs * dot as f32 + add;
                    }
                }
            }
        }
    }
}

/// The scores of `o.len()` rows of a per-group block from their groups' integer `dots` (`per_row`
/// a row, row-major like `scale`): row `r`'s score is the sum over its groups `g`, in order, of
/// `scale[r, g] · qs · dot[r, g] + offset[r, g] · Σq[g]` (`sums`: the offsets and the query's
/// sum over each group). The terms are taken eight rows at a time against the group sums
/// repeated eight times, so that both loops vectorize whatever the number of groups.
#[inline(always)]
fn group_scores(
    qs: f32,
    scale: &[f32],
    sums: Option<(&[f32], &[f32])>,
    dots: &[i32],
    per_row: usize,
    terms: &mut Vec<f32>,
    o: &mut [f32],
) {
    let len = o.len() * per_row;
    let t = grown(terms, len);
    match sums {
        Some((offset, qsum)) => {
            // Eight rows of terms at a time against the group sums repeated eight times (a
            // fixed pattern, so the loop vectorizes), when that fits the pattern.
            let span = 8 * per_row;
            let mut pattern = [0f32; 64];
            if span <= pattern.len() {
                for p in pattern[..span].chunks_exact_mut(per_row) {
                    p.copy_from_slice(qsum);
                }
            }
            let pattern = if span <= pattern.len() { &pattern[..span] } else { qsum };
            let span = pattern.len();
            for (((t, d), s), f) in
                t.chunks_mut(span).zip(dots.chunks(span)).zip(scale.chunks(span)).zip(offset.chunks(span))
            {
                for ((((t, &d), &s), &f), &g) in t.iter_mut().zip(d).zip(s).zip(f).zip(pattern) {
                    *t = s * qs * d as f32 + f * g;
                }
            }
        }
        None => {
            for ((t, &d), &s) in t.iter_mut().zip(dots).zip(scale) {
                *t = s * qs * d as f32;
            }
        }
    }
    match per_row {
        1 => o.copy_from_slice(&t[..o.len()]),
        2 => add_groups::<2>(t, o),
        4 => add_groups::<4>(t, o),
        8 => add_groups::<8>(t, o),
        _ => {
            for (o, t) in o.iter_mut().zip(t.chunks_exact(per_row)) {
                *o = t[1..].iter().fold(t[0], |a, &x| a + x);
            }
        }
    }
}

/// `o[r] = t[G·r] + t[G·r + 1] + …` in that order, `G` known so that the sums unroll and the
/// loop vectorizes over rows.
#[inline(always)]
fn add_groups<const G: usize>(t: &[f32], o: &mut [f32]) {
    for (o, t) in o.iter_mut().zip(t.chunks_exact(G)) {
        let mut a = t[0];
        for &x in &t[1..G] {
            a += x;
        }
        *o = a;
    }
}

/// Buffers of the integer score path, kept per thread by each architecture module so that a
/// decode step does not allocate per block.
#[derive(Default)]
pub(crate) struct Scratch {
    prep: Prepared,
    arranged: Vec<u8>,
    dots: Vec<i32>,
    /// The blocks `prep` and `arranged` serve when they do not depend on a block's
    /// parameters (see [`Prepared::reusable`]), and the query rows they were made from (kept
    /// allocated whatever the blocks, so that no step allocates).
    made: Option<Made>,
    made_from: Vec<f32>,
}

/// The blocks a prepared query serves: the kernel (its arrangement), the row length and width,
/// and the parameters' layout (per row, or per group of this size) and whether they have
/// offsets (which decide the sums the preparation took).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Made {
    kernel: std::any::TypeId,
    dim: usize,
    bits: u8,
    group: Option<usize>,
    offset: bool,
}

/// Appends the 4-bit query `q8` (natural order) in the order an architecture unpacks a chunk of
/// `chunk` code bytes: per 16-byte lane `k` of the chunk, its low nibbles hold codes
/// `32k .. 32k + 16` and its high nibbles `32k + 16 .. 32k + 32` (quant-core's bit-plane
/// layout), and a kernel multiplies all low nibbles of the chunk, then all high ones.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline]
pub(crate) fn arrange4(q8: &[i8], chunk: usize, out: &mut Vec<u8>) {
    for g in q8.chunks_exact(2 * chunk) {
        for half in [0, 16] {
            for lane in g.chunks_exact(32) {
                out.extend(lane[half..half + 16].iter().map(|&x| x as u8));
            }
        }
    }
}

/// Appends `q8` as it is (its bytes).
#[inline]
pub(crate) fn arrange_natural(q8: &[i8], out: &mut Vec<u8>) {
    out.extend(q8.iter().map(|&x| x as u8));
}

/// Appends `q8` widened to little-endian i16.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline]
pub(crate) fn arrange_i16(q8: &[i8], out: &mut Vec<u8>) {
    out.extend(q8.iter().flat_map(|&x| i16::from(x).to_le_bytes()));
}

/// The first `len` values of `buf`, grown with zeros when shorter, otherwise holding what the
/// last call left (garbage in debug builds): for outputs that a kernel writes in full.
#[inline]
pub(crate) fn fresh(buf: &mut Vec<i32>, len: usize) -> &mut [i32] {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    let out = &mut buf[..len];
    if cfg!(debug_assertions) {
        out.fill(0x5a5a_5a5a);
    }
    out
}

/// `len` new elements (zeros) at the end of `out`, as a slice for a kernel to write: the
/// roundings' outputs, appended row after row.
#[inline]
pub(crate) fn appended<T: Copy + Default>(out: &mut Vec<T>, len: usize) -> &mut [T] {
    let start = out.len();
    out.resize(start + len, T::default());
    &mut out[start..]
}

/// `buf` grown to at least `len` elements (never shrunk, never cleared): the fused kernels'
/// buffers, each written before it is read.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
#[inline]
pub(crate) fn grown<T: Copy + Default>(buf: &mut Vec<T>, len: usize) -> &mut [T] {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    &mut buf[..len]
}

/// An architecture's part of the integer path.
pub(crate) trait IntKernel {
    /// Appends one query row (`dim` int8 values, natural order) in the kernel's layout.
    fn arrange(b: &QuantBlock<'_>, q8: &[i8], out: &mut Vec<u8>);
    /// `dots[i · rows.len() + r − rows.start] = Σ_d q_i[d] · code[r][d]` for the `n ≤ GROUP`
    /// arranged query rows of `q` (equal lengths, back to back); for a 16-level table, its
    /// [`table8`] level of each code in place of the code. Per-group blocks: one dot per
    /// run of [`IntKernel::segment`] values, `dots[(i · rows.len() + r − rows.start) · dim /
    /// seg + s]` the dot of run `s` of row `r`.
    fn dots(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], n: usize, dots: &mut [i32]);

    /// Values a dot of [`IntKernel::dots`] spans for block `b`: its rows, or for per-group
    /// blocks a divisor of the group (the whole group by default).
    #[inline(always)]
    fn segment(b: &QuantBlock<'_>) -> usize {
        match b.params {
            Params::PerGroup { group, .. } => group,
            _ => b.dim,
        }
    }

    /// [`quantize_query`], or an implementation that gives the same bytes and scale.
    #[inline(always)]
    fn round_query(q: &[f32], out: &mut Vec<i8>) -> f32 {
        quantize_query(q, out)
    }

    /// [`IntKernel::round_query`] of the products `q[d] · scale[d]` (per-channel keys fold
    /// the block's scales into the query), `qw` room for them; kernels may skip storing them.
    #[inline(always)]
    fn round_query_scaled(q: &[f32], scale: &[f32], qw: &mut Vec<f32>, out: &mut Vec<i8>) -> f32 {
        qw.clear();
        qw.extend(q.iter().zip(scale).map(|(x, s)| x * s));
        Self::round_query(qw, out)
    }

    /// [`IntKernel::round_query_scaled`] of each row of `q` (rows as long as `scale`, at most
    /// [`GROUP`]), appended row after row, the scales into `scales`; kernels may round the
    /// rows together.
    #[inline(always)]
    fn round_queries_scaled(
        q: &[f32],
        scale: &[f32],
        qw: &mut Vec<f32>,
        out: &mut Vec<i8>,
        scales: &mut [f32],
    ) {
        for (s, qi) in scales.iter_mut().zip(q.chunks_exact(scale.len().max(1))) {
            *s = Self::round_query_scaled(qi, scale, qw, out);
        }
    }

    /// [`dot_lanes`], or an implementation that gives the same bits.
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot_lanes(a, b)
    }

    /// [`sum_lanes`], or an implementation that gives the same bits.
    #[inline(always)]
    fn sum(a: &[f32]) -> f32 {
        sum_lanes(a)
    }
}

/// The integer scores of `n_q` query rows against block `b`, through kernel `K`.
#[inline(always)]
pub(crate) fn scores_by_block<K: IntKernel + 'static>(
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let d = b.dim;
    let Scratch { prep, arranged, dots, made, made_from } = scratch;
    let seg = K::segment(b);
    let runs = d / seg;
    // Decode scores every block of a sequence's KV head with the same query rows: where the
    // rounding does not depend on the block's parameters, the last block's serves.
    let key = Prepared::reusable::<K>(b).filter(|_| n_q <= GROUP);
    // A block streamed from memory (see `stream_prefetch`): each chunk's row parameters,
    // which the epilogue reads after the chunk's dots, are asked for before them.
    #[cfg(target_arch = "x86_64")]
    let stream = crate::stream_prefetch(b.rows * b.row_bytes).is_some();
    #[cfg(not(target_arch = "x86_64"))]
    let stream = false;
    let again = key.is_some() && *made == key && same_bits(made_from, q);
    let mut i0 = 0;
    while i0 < n_q {
        let n = (n_q - i0).min(GROUP);
        if !again {
            prep.prepare::<K>(b, &q[i0 * d..(i0 + n) * d]);
            arranged.clear();
            for qi in prep.q8.chunks_exact(d) {
                K::arrange(b, qi, arranged);
            }
            *made = key;
            if key.is_some() {
                made_from.clear();
                made_from.extend_from_slice(q);
            }
        }
        let mut r0 = 0;
        while r0 < b.rows {
            let at = r0..(r0 + CHUNK_ROWS).min(b.rows);
            if stream {
                prefetch_params(b, at.clone());
            }
            // The kernels write every dot (no zeroing needed: it cost 3% of an integer
            // decode step); debug builds fill the buffer with garbage so that a kernel that
            // adds instead fails the tests.
            let dots = fresh(dots, n * at.len() * runs);
            K::dots(b, at.clone(), arranged, n, dots);
            prep.epilogue::<K>(b, i0, n, at.clone(), dots, out);
            r0 = at.end;
        }
        i0 += n;
    }
}

/// Asks for the parameters of rows `at` of `b` (per row or per group; per-channel ones are
/// read once per block) into L1: a hint, no effect on results.
#[inline(always)]
fn prefetch_params(b: &QuantBlock<'_>, at: Range<usize>) {
    let (scale, offset, per) = match b.params {
        Params::PerRow { scale, offset } => (scale, offset, 1),
        Params::PerGroup { group, scale, offset } => (scale, offset, b.dim / group),
        Params::PerChannel { .. } => return,
    };
    let span = at.start * per..at.end * per;
    for p in [Some(scale), offset].into_iter().flatten() {
        let p = p.get(span.clone()).unwrap_or(&[]);
        #[cfg(target_arch = "x86_64")]
        crate::prefetch_l1(p.as_ptr().cast(), std::mem::size_of_val(p));
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// Whether `a` and `b` hold the same floats, bit for bit (NaN payloads and the sign of zero
/// included), without an early exit so that the comparison vectorizes.
#[inline(always)]
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u32, |d, (x, y)| d | (x.to_bits() ^ y.to_bits())) == 0
}

/// The reference integer kernel: plain integer arithmetic on natural-order queries.
pub(crate) struct Reference;

impl IntKernel for Reference {
    fn arrange(_: &QuantBlock<'_>, q8: &[i8], out: &mut Vec<u8>) {
        arrange_natural(q8, out);
    }

    fn dots(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], n: usize, dots: &mut [i32]) {
        let d = b.dim;
        let seg = Self::segment(b);
        let runs = d / seg;
        let mut codes = vec![0u8; d];
        let m = rows.len();
        let table = table8(b);
        let level = |c: u8| table.map_or(i32::from(c), |(t, _)| i32::from(t[usize::from(c)]));
        for r in rows.clone() {
            kvq_quant_core::pack::unpack_row(b.row(r), b.bits, &mut codes)
                .expect("QuantBlock::new checked the lengths");
            for i in 0..n {
                let qi = &q[i * d..(i + 1) * d];
                for (s, (c, x)) in codes.chunks_exact(seg).zip(qi.chunks_exact(seg)).enumerate() {
                    dots[(i * m + r - rows.start) * runs + s] =
                        c.iter().zip(x).map(|(&c, &x)| level(c) * i32::from(x as i8)).sum();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{arrange4, quantize_query};

    #[test]
    fn query_rounding_is_ties_to_even_within_range() {
        let mut rng = kvq_quant_core::synth::Rng::new(5);
        let mut out = Vec::new();
        for n in [1usize, 7, 8, 9, 64, 128, 130] {
            let mut q: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            // Exact ties after scaling: with max|q| = 127 the scale is 1.
            q[0] = 127.0;
            if n > 3 {
                q[1] = 2.5;
                q[2] = -3.5;
                q[3] = -127.0;
            }
            out.clear();
            let scale = quantize_query(&q, &mut out);
            assert_eq!(scale, 1.0);
            for (&x, &c) in q.iter().zip(&out) {
                assert_eq!(i32::from(c), x.clamp(-127.0, 127.0).round_ties_even() as i32, "{x}");
            }
        }
        out.clear();
        assert_eq!(quantize_query(&[0.0; 5], &mut out), 0.0);
        assert_eq!(out, vec![0i8; 5]);
        // A general scale: every code within half a step of the value.
        let q: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.37).collect();
        out.clear();
        let scale = quantize_query(&q, &mut out);
        for (&x, &c) in q.iter().zip(&out) {
            assert!((f32::from(c) * scale - x).abs() <= 0.5 * scale * 1.0001, "{x}");
        }
    }

    #[test]
    fn arrangement_follows_the_nibble_planes() {
        let q: Vec<i8> = (0..128).map(|i| i as i8).collect();
        // 16-byte chunks: low nibbles are codes 0..16, high 16..32, i.e. natural order.
        let mut out = Vec::new();
        arrange4(&q, 16, &mut out);
        assert_eq!(out, (0..128u8).collect::<Vec<_>>());
        // 32-byte chunks (AVX2): low nibbles of both lanes, then high nibbles.
        out.clear();
        arrange4(&q[..64], 32, &mut out);
        let want: Vec<u8> = (0..16).chain(32..48).chain(16..32).chain(48..64).collect();
        assert_eq!(out, want);
        // 64-byte chunks (AVX-512): four lanes.
        out.clear();
        arrange4(&q, 64, &mut out);
        let want: Vec<u8> = [0, 32, 64, 96, 16, 48, 80, 112].iter().flat_map(|&s| s..s + 16).collect();
        assert_eq!(out, want);
    }
}
