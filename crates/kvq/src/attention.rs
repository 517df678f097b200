//! Decode attention over a paged, quantized cache: for one new token, each query head attends
//! to every cached token of its KV head, reading quantized blocks through the fused kernels
//! of `kvq-kernels-simd` (no f32 copy of the cache is made).
//!
//! Per KV head, the scores of all query heads of its GQA group are computed block by block
//! (each block unpacked once for the whole group), softmax runs over them in f32 with the
//! maximum subtracted, and the values are accumulated block by block with the same sharing.
//! Sequences of a batch, and KV heads within a sequence, run in parallel with rayon.

use half::f16;
use kvq_cache_layout::{BlockView, CacheError, Mode, PagedCache, Segment, SeqId, TailBuf};
use kvq_kernels_simd::{
    Backend, KernelError, Levels, Params, QuantBlock, axpy_with, scores_int8_with, scores_with,
};
use kvq_quant_core::calibration::Part;
use kvq_quant_core::{Codebook, CodebookSource, GroupParams, Kind};
use rayon::prelude::*;

/// Why attention could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum AttentionError {
    /// The cache refused the lookup (unknown sequence, layer out of range).
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A kernel refused its input.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// Query or output of the wrong size.
    #[error("attention input: {0}")]
    Shape(String),
}

/// The level table of a part's spec, for the kernels (FP8 decode table, codebook levels).
fn level_table(kind: &Kind) -> Option<Vec<f32>> {
    match kind {
        Kind::Fp8(f) => Some((0..=255u8).map(|c| f.decode(c)).collect()),
        Kind::Codebook(CodebookSource::Nf4) => Some(Codebook::nf4().levels().to_vec()),
        Kind::Codebook(CodebookSource::Fixed(cb)) => Some(cb.levels().to_vec()),
        _ => None,
    }
}

struct PartReader {
    table: Option<Vec<f32>>,
    zero: f32,
    kind: Kind,
}

impl PartReader {
    fn new(cache: &PagedCache, part: Part) -> Self {
        let spec = cache.part(part).spec();
        let bits = spec.bits();
        Self { table: level_table(spec.kind()), zero: (1u32 << (bits - 1)) as f32, kind: spec.kind().clone() }
    }

    fn levels(&self) -> Levels<'_> {
        match (&self.kind, &self.table) {
            (_, Some(t)) => Levels::Table(t),
            (Kind::Symmetric, None) => Levels::Symmetric { zero: self.zero },
            _ => Levels::Affine,
        }
    }
}

/// Parameters of a block view widened to f32, and the kernel block over them; `None` for
/// layouts the kernels do not take (groups smaller than a row), which decode row by row.
fn with_block<R>(
    view: &BlockView<'_>,
    reader: &PartReader,
    f: impl FnOnce(&QuantBlock<'_>) -> Result<R, KernelError>,
) -> Result<Option<R>, KernelError> {
    let layout = view.layout;
    let d = layout.head_dim();
    let rows = view.tokens;
    let has_offset = layout.spec().has_offset();
    let collect = |n: usize, get: &dyn Fn(usize) -> GroupParams| -> (Vec<f32>, Vec<f32>) {
        let ps: Vec<GroupParams> = (0..n).map(get).collect();
        (ps.iter().map(|p| p.scale).collect(), ps.iter().map(|p| p.offset).collect())
    };
    let bulk = || {
        let (mut s, mut o) = (Vec::new(), Vec::new());
        view.params_f32(&mut s, &mut o);
        (s, o)
    };
    let (per_channel, (scale, offset)) = match layout.mode() {
        Mode::Row { seg } if seg == d => (false, bulk()),
        Mode::Row { .. } => return Ok(None),
        Mode::Channel => (true, bulk()),
        Mode::Static { seg: 1 } => (true, collect(d, &|c| view.statics[c])),
        Mode::Static { .. } => (false, collect(rows, &|_| view.statics[0])),
    };
    let offset = has_offset.then_some(offset.as_slice());
    let params = if per_channel {
        Params::PerChannel { scale: &scale, offset }
    } else {
        Params::PerRow { scale: &scale, offset }
    };
    let codes = &view.region[..rows * layout.row_bytes()];
    let block = QuantBlock::new(codes, rows, d, layout.spec().bits(), reader.levels(), params)?;
    f(&block).map(Some)
}

/// Rows `offset / dim ..` of a full-precision segment, widened to f32.
fn full_rows(rows: &TailBuf, offset: usize, tokens: usize, dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(tokens * dim);
    match rows {
        TailBuf::F32(v) => out.extend_from_slice(&v[offset..offset + tokens * dim]),
        TailBuf::F16(v) => out.extend(v[offset..offset + tokens * dim].iter().map(|h: &f16| h.to_f32())),
    }
    out
}

/// How scores against quantized keys are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScorePath {
    /// Float kernels: equal to attention over the dequantized cache within f32 rounding.
    #[default]
    Float,
    /// The integer path where the backend has one (queries rounded to int8, as llama.cpp
    /// does): faster, with scores off by at most `max|q| / 254 · Σ|levels · scale|`.
    Int8,
}

/// Attention of `q` (`query_heads × head_dim`, head-major) over `layer` of `seq`, into `out`
/// (same shape), with the process's selected kernel backend.
///
/// # Errors
/// [`AttentionError::Shape`] when the query heads are not a multiple of the KV heads or the
/// slices have the wrong length; cache and kernel errors.
pub fn decode_attention(
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[f32],
    query_heads: usize,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let backend = kvq_kernels_simd::dispatch::selected().unwrap_or(Backend::Scalar);
    decode_attention_with(backend, cache, seq, layer, q, query_heads, out)
}

/// [`decode_attention`] with an explicit kernel backend.
///
/// # Errors
/// As [`decode_attention`].
pub fn decode_attention_with(
    backend: Backend,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[f32],
    query_heads: usize,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    decode_attention_path(backend, ScorePath::Float, cache, seq, layer, q, query_heads, out)
}

/// [`decode_attention_with`] with a choice of score path.
///
/// # Errors
/// As [`decode_attention`].
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_path(
    backend: Backend,
    path: ScorePath,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[f32],
    query_heads: usize,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let cfg = cache.config();
    let (heads, d) = (cfg.kv_heads, cfg.head_dim);
    if query_heads == 0
        || !query_heads.is_multiple_of(heads)
        || q.len() != query_heads * d
        || out.len() != query_heads * d
    {
        return Err(AttentionError::Shape(format!(
            "{query_heads} query heads over {heads} KV heads of {d}: q has {} values, out {}",
            q.len(),
            out.len()
        )));
    }
    let len = cache.len(seq, layer)?;
    let g = query_heads / heads;
    let readers = [PartReader::new(cache, Part::K), PartReader::new(cache, Part::V)];
    out.par_chunks_mut(g * d).enumerate().try_for_each(|(h, o)| {
        head_attention(
            backend,
            path,
            cache,
            seq,
            layer,
            h,
            &q[h * g * d..(h + 1) * g * d],
            g,
            len,
            &readers,
            o,
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn head_attention(
    backend: Backend,
    path: ScorePath,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    head: usize,
    q: &[f32],
    g: usize,
    len: usize,
    readers: &[PartReader; 2],
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let d = cache.config().head_dim;
    out.fill(0.0);
    if len == 0 {
        return Ok(());
    }
    // Scores of the g query heads, [g, len], scaled by 1/sqrt(d).
    let scale = 1.0 / (d as f32).sqrt();
    let qs: Vec<f32> = q.iter().map(|x| x * scale).collect();
    let mut s = vec![0f32; g * len];
    let mut part = Vec::new();
    for seg in cache.segments(seq, layer, head, Part::K)? {
        match seg {
            Segment::Full { first_token, tokens, rows, offset } => {
                let x = full_rows(rows, offset, tokens, d);
                for i in 0..g {
                    for t in 0..tokens {
                        s[i * len + first_token + t] = qs[i * d..(i + 1) * d]
                            .iter()
                            .zip(&x[t * d..(t + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum();
                    }
                }
            }
            Segment::Quantized(view) => {
                let n = view.tokens;
                part.resize(g * n, 0.0);
                let done = with_block(&view, &readers[0], |b| match path {
                    ScorePath::Float => scores_with(backend, b, &qs, g, &mut part),
                    ScorePath::Int8 => scores_int8_with(backend, b, &qs, g, &mut part).map(|_| ()),
                })?;
                if done.is_none() {
                    let mut row = vec![0f32; d];
                    for t in 0..n {
                        view.decode_row(t, &mut row);
                        for i in 0..g {
                            part[i * n + t] =
                                qs[i * d..(i + 1) * d].iter().zip(&row).map(|(a, b)| a * b).sum();
                        }
                    }
                }
                for i in 0..g {
                    s[i * len + view.first_token..i * len + view.first_token + n]
                        .copy_from_slice(&part[i * n..(i + 1) * n]);
                }
            }
        }
    }
    for i in 0..g {
        let row = &mut s[i * len..(i + 1) * len];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|x| *x *= inv);
    }
    for seg in cache.segments(seq, layer, head, Part::V)? {
        match seg {
            Segment::Full { first_token, tokens, rows, offset } => {
                let x = full_rows(rows, offset, tokens, d);
                for i in 0..g {
                    for t in 0..tokens {
                        let w = s[i * len + first_token + t];
                        for (o, &v) in out[i * d..(i + 1) * d].iter_mut().zip(&x[t * d..(t + 1) * d]) {
                            *o += w * v;
                        }
                    }
                }
            }
            Segment::Quantized(view) => {
                let n = view.tokens;
                part.clear();
                for i in 0..g {
                    part.extend_from_slice(&s[i * len + view.first_token..i * len + view.first_token + n]);
                }
                let done = with_block(&view, &readers[1], |b| axpy_with(backend, b, &part, g, out))?;
                if done.is_none() {
                    let mut row = vec![0f32; d];
                    for t in 0..n {
                        view.decode_row(t, &mut row);
                        for i in 0..g {
                            let w = part[i * n + t];
                            for (o, &v) in out[i * d..(i + 1) * d].iter_mut().zip(&row) {
                                *o += w * v;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Decode attention for many sequences at once (continuous batching): `queries[i]` belongs to
/// `seqs[i]`; results go to `outs[i]`. Sequences run in parallel.
///
/// # Errors
/// The first error of any sequence.
pub fn decode_attention_batch(
    cache: &PagedCache,
    layer: usize,
    seqs: &[SeqId],
    queries: &[&[f32]],
    query_heads: usize,
    outs: &mut [Vec<f32>],
) -> Result<(), AttentionError> {
    if seqs.len() != queries.len() || seqs.len() != outs.len() {
        return Err(AttentionError::Shape(format!(
            "{} sequences, {} queries, {} outputs",
            seqs.len(),
            queries.len(),
            outs.len()
        )));
    }
    outs.par_iter_mut()
        .zip(seqs.par_iter().zip(queries.par_iter()))
        .try_for_each(|(o, (&seq, q))| decode_attention(cache, seq, layer, q, query_heads, o))
}
