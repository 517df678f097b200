//! The algebra of the integer score path, shared by the AVX2 and dotprod kernels: each query
//! row (per-channel: the query times the channel scales) is rounded to int8 with one scale,
//! an architecture kernel computes the integer dot with a row's codes, and one float multiply
//! restores the scale. Offsets use the exact float sum of the query.

use crate::block::{Params, QuantBlock};

/// A query row prepared for an architecture's integer dot product. Its buffers are reused
/// from one block to the next (decode calls this once per block and query row).
pub(crate) trait IntQuery: Default {
    /// Rounds `q` to int8 with one scale (`max|q| / 127`), replacing what was held.
    fn prepare(&mut self, q: &[f32]);
    /// The scale that turns integer dots back into floats.
    fn scale(&self) -> f32;
}

/// `max|q| / 127`, returned, and `q / scale` rounded into −127..=127, into `out`.
///
/// Decode runs this once per block and query row, so it is written to vectorize on baseline
/// SSE2: the maximum in 8 independent lanes, and rounding (ties to even) by adding and
/// subtracting 1.5 · 2^23 rather than through a libm `round` call per value.
pub(crate) fn quantize_query(q: &[f32], out: &mut Vec<i8>) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    let mut lanes = [0f32; 8];
    let mut chunks = q.chunks_exact(8);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            let a = x.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let max =
        chunks.remainder().iter().chain(&lanes).fold(0f32, |m, &x| if x.abs() > m { x.abs() } else { m });
    let scale = if max > 0.0 { max / 127.0 } else { 0.0 };
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    out.clear();
    // For |v| ≤ 127 the sum's bits are MAGIC's plus the rounded value, so an integer
    // subtraction reads it out (no float-to-int conversion with its NaN checks).
    let magic_bits = MAGIC.to_bits() as i32;
    out.extend(q.iter().map(|&x| {
        let v = (x * inv).clamp(-127.0, 127.0);
        ((v + MAGIC).to_bits() as i32 - magic_bits) as i8
    }));
    scale
}

/// Buffers of the integer score path, kept per thread by each architecture module so that a
/// decode step does not allocate per block.
#[derive(Default)]
pub(crate) struct Scratch<Q> {
    q8: Q,
    dots: Vec<i32>,
    qw: Vec<f32>,
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
    scratch: &mut Scratch<Q>,
    idots: impl Fn(&QuantBlock<'_>, &Q, &mut [i32]),
) {
    let d = b.dim;
    let Scratch { q8, dots, qw } = scratch;
    dots.clear();
    dots.resize(b.rows, 0);
    for i in 0..n_q {
        let qi = &q[i * d..(i + 1) * d];
        match b.params {
            Params::PerRow { scale, offset } => {
                q8.prepare(qi);
                let qsum: f32 = qi.iter().sum();
                idots(b, q8, dots);
                for (r, &dot) in dots.iter().enumerate() {
                    let off = offset.map_or(0.0, |o| o[r]);
                    out[i * b.rows + r] = scale[r] * q8.scale() * dot as f32 + off * qsum;
                }
            }
            Params::PerChannel { scale, offset } => {
                qw.clear();
                qw.extend(qi.iter().zip(scale).map(|(x, s)| x * s));
                q8.prepare(qw);
                let cst: f32 = offset.map_or(0.0, |o| qi.iter().zip(o).map(|(a, b)| a * b).sum());
                idots(b, q8, dots);
                for (r, &dot) in dots.iter().enumerate() {
                    out[i * b.rows + r] = q8.scale() * dot as f32 + cst;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::quantize_query;

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
            let scale = quantize_query(&q, &mut out);
            assert_eq!(scale, 1.0);
            for (&x, &c) in q.iter().zip(&out) {
                assert_eq!(i32::from(c), x.clamp(-127.0, 127.0).round_ties_even() as i32, "{x}");
            }
        }
        assert_eq!(quantize_query(&[0.0; 5], &mut out), 0.0);
        assert_eq!(out, vec![0i8; 5]);
        // A general scale: every code within half a step of the value.
        let q: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.37).collect();
        let scale = quantize_query(&q, &mut out);
        for (&x, &c) in q.iter().zip(&out) {
            assert!((f32::from(c) * scale - x).abs() <= 0.5 * scale * 1.0001, "{x}");
        }
    }
}
