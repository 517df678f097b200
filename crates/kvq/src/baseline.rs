//! Decode attention over an unquantized, contiguous f32 or f16 cache, computed the way a good
//! f16 kernel computes it: each K and V row is read once per KV head for its whole GQA group of
//! query heads, f16 rows are widened in registers (F16C; NEON's conversion on aarch64), and the
//! dots and sums run on the kernels' FMA code ([`dense_scores_with`], [`dense_axpy_with`], one
//! generic pair for f32 and f16 rows).
//!
//! This is what kvq's quantized caches are measured against (`kvq bench`, the criterion
//! benches), so that "faster than f16" means faster than something an engine could have, not
//! than a loop that reads each row once per query head. It is also a reference for an engine
//! that keeps some layers unquantized.
//!
//! ```
//! use kvq::baseline::{DenseDims, DenseKv, DenseScratch, dense_attention};
//! use kvq::kernels::dispatch;
//!
//! let dims = DenseDims { q_heads: 4, kv_heads: 2, head_dim: 8, tokens: 5 };
//! let k = vec![0.5f32; 2 * 5 * 8];
//! let v: Vec<f32> = (0..2 * 5 * 8).map(|i| (i % 8) as f32).collect();
//! let q = vec![1f32; 4 * 8];
//! let mut out = vec![0f32; 4 * 8];
//! let mut scratch = DenseScratch::default();
//! dense_attention(dispatch::selected()?, &DenseKv::F32 { k: &k, v: &v }, dims, &q, &mut out, &mut scratch)?;
//! // Equal keys: every token gets the same weight, and the output is the mean value row.
//! assert!((out[3] - 3.0).abs() < 1e-5);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use half::f16;
use kvq_kernels_simd::softmax::exp_sum_with;
use kvq_kernels_simd::{DenseRow, Kernels, dense_axpy_with, dense_scores_with};

use crate::attention::AttentionError;

/// Contiguous K and V, each `[kv_heads, tokens, head_dim]`, row-major.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum DenseKv<'a> {
    /// f32 rows, read in place.
    F32 {
        /// Keys.
        k: &'a [f32],
        /// Values.
        v: &'a [f32],
    },
    /// f16 rows, widened where they are used.
    F16 {
        /// Keys.
        k: &'a [f16],
        /// Values.
        v: &'a [f16],
    },
}

impl DenseKv<'_> {
    /// Bytes of K and V together: what one decode step reads.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32 { k, v } => (k.len() + v.len()) * 4,
            Self::F16 { k, v } => (k.len() + v.len()) * 2,
        }
    }

    fn lens(&self) -> (usize, usize) {
        match self {
            Self::F32 { k, v } => (k.len(), v.len()),
            Self::F16 { k, v } => (k.len(), v.len()),
        }
    }
}

/// The shape of one layer's decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseDims {
    /// Query heads; a multiple of `kv_heads`.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Cached tokens, at least one.
    pub tokens: usize,
}

/// Buffers reused across steps: after the first step of a shape, a step allocates nothing.
#[derive(Debug, Default, Clone)]
pub struct DenseScratch {
    q: Vec<f32>,
    sums: Vec<f32>,
    scores: Vec<f32>,
}

/// One query token's attention (`q`: `[q_heads, head_dim]`) over `kv`, softmax of
/// `q·k / √head_dim`, written to `out` (`[q_heads, head_dim]`).
///
/// # Errors
/// [`AttentionError::Shape`] when the sizes disagree with `dims` (or overflow), when
/// `q_heads` is not a positive multiple of `kv_heads`, or when there are no tokens;
/// [`AttentionError::Kernel`] should a kernel refuse its input.
pub fn dense_attention(
    backend: Kernels,
    kv: &DenseKv<'_>,
    dims: DenseDims,
    q: &[f32],
    out: &mut [f32],
    scratch: &mut DenseScratch,
) -> Result<(), AttentionError> {
    let DenseDims { q_heads, kv_heads, head_dim: d, tokens } = dims;
    let shape = |what: String| AttentionError::Shape(format!("dense attention: {what}"));
    if kv_heads == 0 || q_heads == 0 || q_heads % kv_heads != 0 || d == 0 || tokens == 0 {
        return Err(shape(format!(
            "{q_heads} query heads over {kv_heads} KV heads of {d} channels and {tokens} tokens"
        )));
    }
    let cache_len = kv_heads.checked_mul(tokens).and_then(|n| n.checked_mul(d));
    let (k_len, v_len) = kv.lens();
    if cache_len != Some(k_len) || cache_len != Some(v_len) {
        return Err(shape(format!("K has {k_len} and V {v_len} values, not {kv_heads} × {tokens} × {d}")));
    }
    let q_len = q_heads.checked_mul(d).ok_or_else(|| shape(format!("{q_heads} × {d} query values")))?;
    if q.len() != q_len || out.len() != q_len {
        return Err(shape(format!("query of {} and output of {} values, not {q_len}", q.len(), out.len())));
    }
    let g = q_heads / kv_heads;
    let scores_len = g.checked_mul(tokens).ok_or_else(|| shape(format!("{g} × {tokens} scores")))?;
    scratch.scores.resize(scores_len, 0.0);
    // The softmax scale folded into the query once.
    let scale = 1.0 / (d as f32).sqrt();
    scratch.q.clear();
    scratch.q.extend(q.iter().map(|&x| x * scale));
    scratch.sums.resize(g, 0.0);
    out.fill(0.0);
    match kv {
        DenseKv::F32 { k, v } => heads(backend, k, v, dims, scratch, out)?,
        DenseKv::F16 { k, v } => heads(backend, k, v, dims, scratch, out)?,
    }
    Ok(())
}

/// The body of [`dense_attention`] for one element type, the query already scaled in
/// `scratch.q` and the buffers sized.
fn heads<T: DenseRow>(
    backend: Kernels,
    k: &[T],
    v: &[T],
    dims: DenseDims,
    scratch: &mut DenseScratch,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let DenseDims { q_heads, kv_heads, head_dim: d, tokens } = dims;
    let g = q_heads / kv_heads;
    for h in 0..kv_heads {
        let qg = &scratch.q[h * g * d..(h + 1) * g * d];
        let og = &mut out[h * g * d..(h + 1) * g * d];
        let head = h * tokens * d..(h + 1) * tokens * d;
        let s = &mut scratch.scores;
        dense_scores_with(backend, &k[head.clone()], tokens, d, qg, g, s)?;
        // Unnormalized weights; each output row is divided by its sum at the end.
        for (i, si) in s.chunks_exact_mut(tokens).enumerate() {
            let m = si.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            scratch.sums[i] = exp_sum_with(backend, si, m);
        }
        dense_axpy_with(backend, &v[head], tokens, d, s, g, og)?;
        for (o, &sum) in og.chunks_exact_mut(d).zip(&scratch.sums) {
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|x| *x *= inv);
        }
    }
    Ok(())
}

/// Reads every byte of `data` once, as fast as one thread can (eight independent 64-bit sums,
/// which the compiler vectorizes), and returns a checksum so that the reads cannot be dropped.
/// Timing it over a buffer far larger than the caches gives the machine's one-thread DRAM read
/// rate: the floor of a decode step is the bytes it reads divided by that rate.
pub fn stream_read(data: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = data.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(x);
        }
    }
    tail.iter().chain(&acc).fold(0u64, |s, &x| s.wrapping_add(x))
}

/// The buffer [`read_rate`] reads in `kvq bench` and `kvq-serve --read-rate`: far larger than
/// any L3.
pub const STREAM_BYTES: usize = 256 << 20;

/// This machine's one-thread read rate from memory in bytes per second: [`stream_read`] over a
/// fresh buffer of `bytes` (written first, so that every page is there), best of `tries`. Over
/// a buffer far larger than the caches ([`STREAM_BYTES`])
/// it is the DRAM rate a decode step's floor is set against.
pub fn read_rate(bytes: usize, tries: usize) -> f64 {
    let stream: Vec<u64> = vec![1; (bytes / 8).max(1)];
    let mut best = f64::INFINITY;
    for _ in 0..tries.max(1) {
        let start = std::time::Instant::now();
        std::hint::black_box(stream_read(std::hint::black_box(&stream)));
        best = best.min(start.elapsed().as_secs_f64());
    }
    (stream.len() * 8) as f64 / best.max(1e-9)
}

/// Reads the quantized blocks of `layer` of `seq` once, in the order decode reads them (KV head
/// by KV head, each block's keys then its values) with the next block's regions prefetched
/// while one is read (decode asks for them too, spread over its kernels' row loops; with
/// nothing to compute here, one burst is the fastest), and returns a checksum and the bytes
/// read.
///
/// Timed, it gives the rate at which the memory delivers the cache's own blocks. They are
/// scattered through the pool (a head's consecutive blocks lie a block per KV head, or per
/// layer and KV head, apart), and the hardware prefetchers that make [`stream_read`] fast do
/// not follow them, so this rate can be well below the stream's (`docs/performance.md` has
/// figures). A decode step cannot take less than its blocks at this rate, whatever its
/// kernels; `kvq bench` shows each step against both floors.
///
/// # Errors
/// [`AttentionError::Cache`] for an unknown sequence or layer.
pub fn paged_read(
    cache: &kvq_cache_layout::PagedCache,
    seq: kvq_cache_layout::SeqId,
    layer: usize,
) -> Result<(u64, usize), AttentionError> {
    use kvq_cache_layout::Segment;
    use kvq_quant_core::calibration::Part;
    fn region<'a>(s: Segment<'a>) -> Option<&'a [u8]> {
        match s {
            Segment::Quantized(b) => Some(b.bytes()),
            Segment::Full { .. } => None,
        }
    }
    let (mut sum, mut bytes) = (0u64, 0usize);
    for h in 0..cache.config().kv_heads {
        // A head's key and value blocks side by side (the last block of one part may still be
        // in the full-precision tail while the other's is quantized).
        let mut ks = cache.segment_iter(seq, layer, h, Part::K)?.filter_map(region).peekable();
        let mut vs = cache.segment_iter(seq, layer, h, Part::V)?.filter_map(region).peekable();
        loop {
            let (k, v) = (ks.next(), vs.next());
            if k.is_none() && v.is_none() {
                break;
            }
            for next in [ks.peek(), vs.peek()].into_iter().flatten() {
                kvq_kernels_simd::prefetch(next);
            }
            for r in [k, v].into_iter().flatten() {
                sum = sum.wrapping_add(read_bytes(r));
                bytes += r.len();
            }
        }
    }
    Ok((sum, bytes))
}

/// [`stream_read`] of bytes at any alignment: eight little-endian words at a time (vectorized
/// loads), the tail byte by byte.
fn read_bytes(data: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = data.chunks_exact(64);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, w) in acc.iter_mut().zip(c.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]));
        }
    }
    tail.iter().map(|&b| u64::from(b)).chain(acc).fold(0u64, u64::wrapping_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_quant_core::synth::normal_tensor;
    use kvq_quant_core::{Shape, Tensor};

    /// Straight from the definition, in f64, per query head.
    fn reference(k: &[f32], v: &[f32], dims: DenseDims, q: &[f32]) -> Vec<f32> {
        let DenseDims { q_heads, kv_heads, head_dim: d, tokens } = dims;
        let g = q_heads / kv_heads;
        let mut out = vec![0f32; q_heads * d];
        for h in 0..q_heads {
            let kv = h / g;
            let qh = &q[h * d..(h + 1) * d];
            let row = |x: &[f32], t: usize| x[(kv * tokens + t) * d..(kv * tokens + t + 1) * d].to_vec();
            let s: Vec<f64> = (0..tokens)
                .map(|t| {
                    row(k, t).iter().zip(qh).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..d {
                let acc: f64 = (0..tokens).map(|t| e[t] / z * f64::from(row(v, t)[c])).sum();
                out[h * d + c] = acc as f32;
            }
        }
        out
    }

    fn data(dims: DenseDims) -> (Tensor, Tensor, Vec<f32>) {
        let shape = Shape::new(dims.kv_heads, dims.tokens, dims.head_dim);
        let q = normal_tensor(Shape::new(1, 1, dims.q_heads * dims.head_dim), 7).into_data();
        (normal_tensor(shape, 5), normal_tensor(shape, 6), q)
    }

    #[test]
    fn matches_the_definition_for_f32_and_f16_on_every_backend() {
        // Token counts below, at and across the widening block; one and several heads a group.
        for (q_heads, kv_heads, head_dim, tokens) in
            [(4, 2, 16, 1), (8, 2, 64, 33), (2, 2, 24, 70), (6, 1, 128, 32)]
        {
            let dims = DenseDims { q_heads, kv_heads, head_dim, tokens };
            let (k, v, q) = data(dims);
            let want = reference(k.data(), v.data(), dims, &q);
            let (k16, v16): (Vec<f16>, Vec<f16>) = (
                k.data().iter().map(|&x| f16::from_f32(x)).collect(),
                v.data().iter().map(|&x| f16::from_f32(x)).collect(),
            );
            let widen = |x: &[f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let want16 = reference(&widen(&k16), &widen(&v16), dims, &q);
            let mut scratch = DenseScratch::default();
            for backend in kvq_kernels_simd::dispatch::available() {
                for (kv, want) in [
                    (DenseKv::F32 { k: k.data(), v: v.data() }, &want),
                    (DenseKv::F16 { k: &k16, v: &v16 }, &want16),
                ] {
                    let mut out = vec![f32::NAN; q_heads * head_dim];
                    dense_attention(backend, &kv, dims, &q, &mut out, &mut scratch).unwrap();
                    let err = out.iter().zip(want.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(err < 1e-4, "{backend} {dims:?} {}: max error {err}", kv.bytes());
                }
            }
        }
    }

    #[test]
    fn paged_read_reads_every_block_once() {
        use kvq_cache_layout::{CacheConfig, PagedCache, Segment};
        use kvq_quant_core::QuantSpec;
        use kvq_quant_core::calibration::Part;
        let (heads, d, tokens) = (2, 64, 70);
        let (k, v): (QuantSpec, QuantSpec) =
            ("int4-channel-p8".parse().unwrap(), "int4-token".parse().unwrap());
        let config =
            CacheConfig::new(1, heads, d, 16).with_specs(k, v).with_block_size(32).with_residual_blocks(0);
        let mut cache = PagedCache::new(config).unwrap();
        let seq = cache.create();
        let x = normal_tensor(Shape::new(heads, tokens, d), 5);
        cache.extend(seq, 0, &x, &x).unwrap();
        // Every quantized block's regions: words of whole 64-byte chunks, then tail bytes.
        let (mut want, mut want_bytes, mut blocks) = (0u64, 0usize, 0);
        for h in 0..heads {
            for part in [Part::K, Part::V] {
                for s in cache.segment_iter(seq, 0, h, part).unwrap() {
                    if let Segment::Quantized(b) = s {
                        let (r, whole) = (b.bytes(), b.bytes().len() / 64 * 64);
                        for w in r[..whole].chunks_exact(8) {
                            want = want.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
                        }
                        want = r[whole..].iter().fold(want, |a, &x| a.wrapping_add(u64::from(x)));
                        want_bytes += r.len();
                        blocks += 1;
                    }
                }
            }
        }
        assert!(blocks >= 2 * heads * (tokens / 32), "the cache holds quantized blocks");
        assert_eq!(paged_read(&cache, seq, 0).unwrap(), (want, want_bytes));
        assert!(paged_read(&cache, seq, 1).is_err(), "a layer the cache does not have");
        assert_eq!(read_bytes(&[1, 2, 3]), 6);
    }

    #[test]
    fn stream_read_sums_every_word() {
        for n in [0usize, 1, 7, 8, 9, 100] {
            let data: Vec<u64> = (1..=n as u64).collect();
            assert_eq!(stream_read(&data), (n as u64) * (n as u64 + 1) / 2, "{n}");
        }
        assert_eq!(stream_read(&[u64::MAX, 2]), 1);
    }

    #[test]
    fn refuses_shapes_that_disagree() {
        let dims = DenseDims { q_heads: 4, kv_heads: 2, head_dim: 8, tokens: 3 };
        let (k, v, q) = data(dims);
        let kv = DenseKv::F32 { k: k.data(), v: v.data() };
        let mut out = vec![0f32; 32];
        let mut scratch = DenseScratch::default();
        let b = Kernels::SCALAR;
        for bad in [
            DenseDims { tokens: 0, ..dims },
            DenseDims { tokens: 4, ..dims },
            DenseDims { q_heads: 3, ..dims },
            DenseDims { kv_heads: 0, ..dims },
            DenseDims { tokens: usize::MAX, ..dims },
            DenseDims { q_heads: usize::MAX - 1, kv_heads: 1, ..dims },
        ] {
            let e = dense_attention(b, &kv, bad, &q, &mut out, &mut scratch).unwrap_err();
            assert!(matches!(e, AttentionError::Shape(_)), "{bad:?}: {e}");
        }
        let e = dense_attention(b, &kv, dims, &q[1..], &mut out, &mut scratch).unwrap_err();
        assert!(matches!(e, AttentionError::Shape(_)), "{e}");
        let e = dense_attention(b, &kv, dims, &q, &mut out[1..], &mut scratch).unwrap_err();
        assert!(matches!(e, AttentionError::Shape(_)), "{e}");
    }
}
