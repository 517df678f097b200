//! The algebra of the integer score path, shared by the AVX2 and dotprod kernels: each query
//! row (per-channel: the query times the channel scales) is rounded to int8 with one scale,
//! an architecture kernel computes the integer dot with a row's codes, and one float multiply
//! restores the scale. Offsets use the exact float sum of the query.

use crate::block::{Params, QuantBlock};

/// A query row prepared for an architecture's integer dot product.
pub(crate) trait IntQuery {
    /// Rounds `q` to int8 with one scale (`max|q| / 127`).
    fn prepare(q: &[f32]) -> Self;
    /// The scale that turns integer dots back into floats.
    fn scale(&self) -> f32;
}

/// `max|q| / 127`, and `q / scale` rounded into −127..=127.
pub(crate) fn quantize_query(q: &[f32]) -> (f32, Vec<i8>) {
    let max = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = if max > 0.0 { max / 127.0 } else { 0.0 };
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    (scale, q.iter().map(|&x| (x * inv).round().clamp(-127.0, 127.0) as i8).collect())
}

/// Scores of `n_q` query rows against a block, with the integer dots of a whole block from one
/// call, `idots(block, prepared query, dots)` (one per row), so that an architecture kernel
/// keeps its loop over rows inside its target-feature code (a call per row costs about as much
/// as a short row's dot).
pub(crate) fn scores_by_block<Q: IntQuery>(
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    idots: impl Fn(&QuantBlock<'_>, &Q, &mut [i32]),
) {
    let d = b.dim;
    let mut dots = vec![0i32; b.rows];
    for i in 0..n_q {
        let qi = &q[i * d..(i + 1) * d];
        match b.params {
            Params::PerRow { scale, offset } => {
                let q8 = Q::prepare(qi);
                let qsum: f32 = qi.iter().sum();
                idots(b, &q8, &mut dots);
                for (r, &dot) in dots.iter().enumerate() {
                    let off = offset.map_or(0.0, |o| o[r]);
                    out[i * b.rows + r] = scale[r] * q8.scale() * dot as f32 + off * qsum;
                }
            }
            Params::PerChannel { scale, offset } => {
                let qw: Vec<f32> = qi.iter().zip(scale).map(|(x, s)| x * s).collect();
                let q8 = Q::prepare(&qw);
                let cst: f32 = offset.map_or(0.0, |o| qi.iter().zip(o).map(|(a, b)| a * b).sum());
                idots(b, &q8, &mut dots);
                for (r, &dot) in dots.iter().enumerate() {
                    out[i * b.rows + r] = q8.scale() * dot as f32 + cst;
                }
            }
        }
    }
}
