//! Decode attention over a paged, quantized cache: for one new token, each query head attends
//! to every cached token of its KV head, reading quantized blocks through the fused kernels
//! of `kvq-kernels-simd` (no f32 copy of the cache is made).
//!
//! Per KV head, the scores of all query heads of its GQA group are computed block by block
//! (each block unpacked once for the whole group), folded into an online softmax (running
//! maximum and sum, earlier output rescaled when the maximum grows), and the values of the
//! same block accumulated at once. Sequences of a batch and KV heads run in parallel with
//! rayon; when a long context has fewer KV heads than threads, one head's blocks are split
//! across threads and the partial results merged by log-sum-exp (flash-decoding).

use half::f16;
use kvq_cache_layout::{BlockView, CacheError, Mode, PagedCache, Segment, SeqId, TailBuf};
use kvq_kernels_simd::{
    Backend, KernelError, Levels, Params, QuantBlock, axpy_int_with, axpy_with, scores_int8_with, scores_with,
};
use kvq_quant_core::calibration::Part;
use kvq_quant_core::{Codebook, CodebookSource, GroupParams, Kind};
use rayon::prelude::*;

/// Why attention could not be computed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttentionError {
    /// `KVQ_FORCE_BACKEND` names a backend that is unknown or that this CPU lacks.
    #[error(transparent)]
    Backend(#[from] kvq_kernels_simd::DispatchError),
    /// The cache refused the lookup (unknown sequence, layer out of range).
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A kernel refused its input.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// Query or output of the wrong size.
    #[error("attention input: {0}")]
    Shape(String),
    /// An [`AttentionOptions`] value out of its range.
    #[error("attention options: {0}")]
    Options(String),
}

/// What varies between model families' attention, beyond the cache itself. The default is
/// plain causal softmax attention over every cached token with scores `q·k / √head_dim` on the
/// float path.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct AttentionOptions {
    /// Float or integer arithmetic ([`ScorePath`]).
    pub path: ScorePath,
    /// The factor of `q·k` before the softmax; `None`: `1 / √head_dim`. (Gemma 2 uses
    /// `1 / √query_pre_attn_scalar`, some models fold the factor into their queries: 1.)
    pub scale: Option<f32>,
    /// Attend only the last `n` cached tokens, the newest included (Mistral, and Gemma 2's
    /// local layers): older tokens, attention sinks among them, get no weight.
    pub sliding_window: Option<usize>,
    /// Logit soft-capping (Gemma 2, Grok): each scaled score `s` becomes `cap · tanh(s / cap)`
    /// before the softmax.
    pub softcap: Option<f32>,
}

impl AttentionOptions {
    /// The options with `path` and every other field at its default.
    pub fn with_path(path: ScorePath) -> Self {
        Self { path, ..Self::default() }
    }

    /// Sets the score scale.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Sets the sliding window, in tokens.
    pub fn sliding_window(mut self, tokens: usize) -> Self {
        self.sliding_window = Some(tokens);
        self
    }

    /// Sets the soft cap of the scores.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    fn check(&self) -> Result<(), AttentionError> {
        let bad = |m: String| Err(AttentionError::Options(m));
        if let Some(s) = self.scale
            && !(s.is_finite() && s > 0.0)
        {
            return bad(format!("scale {s} is not a positive finite number"));
        }
        if self.sliding_window == Some(0) {
            return bad("a sliding window of 0 tokens attends nothing".into());
        }
        if let Some(c) = self.softcap
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("softcap {c} is not a positive finite number"));
        }
        Ok(())
    }
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
    bufs: &mut (Vec<f32>, Vec<f32>),
    f: impl FnOnce(&QuantBlock<'_>) -> Result<R, KernelError>,
) -> Result<Option<R>, KernelError> {
    let layout = view.layout;
    let d = layout.head_dim();
    let rows = view.tokens;
    let has_offset = layout.spec().has_offset();
    // Parameters widened into buffers the caller keeps across blocks (no allocation per block).
    let (scale, offset) = bufs;
    let mut collect = |n: usize, get: &dyn Fn(usize) -> GroupParams| {
        scale.clear();
        offset.clear();
        for i in 0..n {
            let p = get(i);
            scale.push(p.scale);
            offset.push(p.offset);
        }
    };
    let per_channel = match layout.mode() {
        Mode::Row { seg } if seg == d => {
            view.params_f32(scale, offset);
            false
        }
        Mode::Row { .. } => return Ok(None),
        Mode::Channel => {
            view.params_f32(scale, offset);
            true
        }
        Mode::Static { seg: 1 } => {
            collect(d, &|c| view.statics[c]);
            true
        }
        Mode::Static { .. } => {
            collect(rows, &|_| view.statics[0]);
            false
        }
    };
    let (scale, offset) = (&*scale, &*offset);
    let offset = has_offset.then_some(offset.as_slice());
    let params =
        if per_channel { Params::PerChannel { scale, offset } } else { Params::PerRow { scale, offset } };
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
    /// The integer paths where the backend has them: scores with the queries rounded to int8
    /// (as llama.cpp does), off by at most `max|q| / 254 · Σ|levels · scale|`; and, where the
    /// backend has an integer value kernel (AVX-512 VNNI, INT4 values), the block's weights
    /// `p · scale` rounded to i16, each output off by at most `max|w| / 65534 · Σ|levels|`.
    /// Faster; the float path equals attention over the dequantized cache within f32 rounding.
    Int8,
}

/// Attention of `q` (`query_heads × head_dim`, head-major) over `layer` of `seq`, into `out`
/// (same shape), with the process's selected kernel backend.
///
/// # Errors
/// [`AttentionError::Shape`] when the query heads are not a multiple of the KV heads or the
/// slices have the wrong length; [`AttentionError::Backend`] for a bad `KVQ_FORCE_BACKEND`;
/// cache and kernel errors.
pub fn decode_attention(
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[f32],
    query_heads: usize,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let backend = kvq_kernels_simd::dispatch::selected()?;
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
    let options = AttentionOptions::with_path(path);
    decode_attention_options(backend, &options, cache, seq, layer, q, query_heads, out)
}

/// [`decode_attention_with`] with [`AttentionOptions`]: score path, scale, sliding window and
/// soft-capping.
///
/// # Errors
/// As [`decode_attention`], and [`AttentionError::Options`] for an option out of range.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_options(
    backend: Backend,
    options: &AttentionOptions,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[f32],
    query_heads: usize,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    decode_attention_chunk(backend, options, cache, seq, layer, q, 1, query_heads, out)
}

/// Attention of a chunk of `tokens` new tokens, already appended to `layer` of `seq` (the
/// last `tokens` cached tokens), each attending causally to the cache and to the chunk's
/// earlier tokens: chunked prefill, and the verification step of speculative decoding. `q`
/// and `out` are `tokens × query_heads × head_dim`, token-major. Each KV head's blocks are
/// read once for the whole chunk.
///
/// # Errors
/// As [`decode_attention_options`], and [`AttentionError::Shape`] when `tokens` is 0 or more
/// than the cached tokens.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_chunk(
    backend: Backend,
    options: &AttentionOptions,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[f32],
    tokens: usize,
    query_heads: usize,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    options.check()?;
    let cfg = cache.config();
    let (heads, d) = (cfg.kv_heads, cfg.head_dim);
    let want = query_heads.checked_mul(d).and_then(|n| n.checked_mul(tokens));
    if query_heads == 0
        || !query_heads.is_multiple_of(heads)
        || want != Some(q.len())
        || want != Some(out.len())
    {
        return Err(AttentionError::Shape(format!(
            "{tokens} tokens of {query_heads} query heads over {heads} KV heads of {d}: q has {} values, out {}",
            q.len(),
            out.len()
        )));
    }
    let len = cache.len(seq, layer)?;
    if len == 0 && tokens == 1 {
        // One query over an empty sequence attends nothing: zeros, as decode always gave.
        out.fill(0.0);
        return Ok(());
    }
    if tokens == 0 || tokens > len {
        return Err(AttentionError::Shape(format!(
            "a chunk of {tokens} tokens, {len} cached: the chunk's tokens are appended before they attend"
        )));
    }
    let g = query_heads / heads;
    let readers = [PartReader::new(cache, Part::K), PartReader::new(cache, Part::V)];
    let head = |h: usize, q_rows: &[f32], o: &mut [f32]| {
        head_attention(backend, options, cache, seq, layer, h, q_rows, g, tokens, len, &readers, o)
    };
    if tokens == 1 {
        // One token: a KV head's query rows and outputs are contiguous already.
        return out
            .par_chunks_mut(g * d)
            .enumerate()
            .try_for_each(|(h, o)| head(h, &q[h * g * d..(h + 1) * g * d], o));
    }
    // Rows of KV head h: token j's query heads h·g .. (h + 1)·g, token after token.
    let rows = |x: &[f32], h: usize| -> Vec<f32> {
        (0..tokens)
            .flat_map(|j| {
                x[(j * query_heads + h * g) * d..(j * query_heads + (h + 1) * g) * d].iter().copied()
            })
            .collect()
    };
    let per_head = (0..heads)
        .into_par_iter()
        .map(|h| {
            let mut o = vec![0f32; tokens * g * d];
            head(h, &rows(q, h), &mut o).map(|()| o)
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (h, o) in per_head.iter().enumerate() {
        for j in 0..tokens {
            let at = (j * query_heads + h * g) * d;
            out[at..at + g * d].copy_from_slice(&o[j * g * d..(j + 1) * g * d]);
        }
    }
    Ok(())
}

/// One run of tokens of one part: a slice of full-precision rows, or a whole quantized block.
enum Run<'a> {
    Full(Vec<f32>),
    Block(BlockView<'a>),
}

/// The runs of K and V for every grid unit (sinks, then `block_size` tokens at a time): K and
/// V segments start on the same grid, so each unit lies inside one segment of each.
fn units<'a>(k: &[Segment<'a>], v: &[Segment<'a>], d: usize) -> Vec<(usize, usize, Run<'a>, Run<'a>)> {
    let mut bounds: Vec<usize> = Vec::new();
    for s in k.iter().chain(v) {
        match s {
            Segment::Full { first_token, tokens, .. } => {
                bounds.push(*first_token);
                bounds.push(first_token + tokens);
            }
            Segment::Quantized(b) => {
                bounds.push(b.first_token);
                bounds.push(b.first_token + b.tokens);
            }
        }
    }
    bounds.sort_unstable();
    bounds.dedup();
    // Segments come in token order, so one cursor per part walks them once (a search per unit
    // would be quadratic in the context length).
    fn span(s: &Segment<'_>) -> (usize, usize) {
        match *s {
            Segment::Full { first_token, tokens, .. } => (first_token, first_token + tokens),
            Segment::Quantized(b) => (b.first_token, b.first_token + b.tokens),
        }
    }
    let run = |segs: &[Segment<'a>], at: &mut usize, a: usize, b: usize| -> Run<'a> {
        while span(&segs[*at]).1 <= a {
            *at += 1;
        }
        match segs[*at] {
            Segment::Full { first_token, rows, offset, .. } => {
                Run::Full(full_rows(rows, offset + (a - first_token) * d, b - a, d))
            }
            Segment::Quantized(view) => {
                debug_assert!(a == view.first_token && b == view.first_token + view.tokens);
                Run::Block(view)
            }
        }
    };
    let (mut ki, mut vi) = (0, 0);
    bounds
        .windows(2)
        .map(|w| (w[0], w[1], run(k, &mut ki, w[0], w[1]), run(v, &mut vi, w[0], w[1])))
        .collect()
}

/// Online-softmax state of the g query heads of a group: running max, running sum, and the
/// unnormalized output.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl Partial {
    fn new(g: usize, d: usize) -> Self {
        Self { m: vec![f32::NEG_INFINITY; g], l: vec![0.0; g], o: vec![0.0; g * d] }
    }

    /// Merges another partial over disjoint tokens (log-sum-exp), as flash-decoding does.
    fn merge(mut self, other: Partial) -> Partial {
        let d = self.o.len() / self.m.len().max(1);
        for i in 0..self.m.len() {
            let m = self.m[i].max(other.m[i]);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let (a, b) = ((self.m[i] - m).exp(), (other.m[i] - m).exp());
            self.l[i] = self.l[i] * a + other.l[i] * b;
            for (x, &y) in self.o[i * d..(i + 1) * d].iter_mut().zip(&other.o[i * d..(i + 1) * d]) {
                *x = *x * a + y * b;
            }
            self.m[i] = m;
        }
        self
    }
}

/// Attends the g query rows `qs` (already scaled) over `units`; row `i` sees tokens
/// `spans[i].0 .. spans[i].1` only (its sliding window and its causal end), the others get no
/// weight.
#[allow(clippy::too_many_arguments)]
fn attend(
    backend: Backend,
    options: &AttentionOptions,
    readers: &[PartReader; 2],
    units: &[(usize, usize, Run<'_>, Run<'_>)],
    qs: &[f32],
    g: usize,
    d: usize,
    spans: &[(usize, usize)],
) -> Result<Partial, AttentionError> {
    let latest_start = spans.iter().map(|s| s.0).max().unwrap_or(0);
    let earliest_end = spans.iter().map(|s| s.1).min().unwrap_or(usize::MAX);
    let path = options.path;
    let mut st = Partial::new(g, d);
    let mut bufs = (Vec::new(), Vec::new());
    let mut s = Vec::new();
    let mut row = vec![0f32; d];
    for (u, (a, b, k, v)) in units.iter().enumerate() {
        // Start loading the next unit's blocks while this one computes: block regions are
        // scattered in the pool, so the hardware prefetcher cannot guess them.
        if let Some((_, _, nk, nv)) = units.get(u + 1) {
            for run in [nk, nv] {
                if let Run::Block(view) = run {
                    kvq_kernels_simd::prefetch(view.region);
                }
            }
        }
        let n = b - a;
        s.resize(g * n, 0.0);
        match k {
            Run::Full(x) => {
                for i in 0..g {
                    for t in 0..n {
                        s[i * n + t] = qs[i * d..(i + 1) * d]
                            .iter()
                            .zip(&x[t * d..(t + 1) * d])
                            .map(|(p, q)| p * q)
                            .sum();
                    }
                }
            }
            Run::Block(view) => {
                let done = with_block(view, &readers[0], &mut bufs, |blk| match path {
                    ScorePath::Float => scores_with(backend, blk, qs, g, &mut s),
                    ScorePath::Int8 => scores_int8_with(backend, blk, qs, g, &mut s).map(|_| ()),
                })?;
                if done.is_none() {
                    for t in 0..n {
                        view.decode_row(t, &mut row);
                        for i in 0..g {
                            s[i * n + t] = qs[i * d..(i + 1) * d].iter().zip(&row).map(|(p, q)| p * q).sum();
                        }
                    }
                }
            }
        }
        if let Some(cap) = options.softcap {
            let inv = 1.0 / cap;
            s.iter_mut().for_each(|x| *x = cap * (*x * inv).tanh());
        }
        // Tokens outside a row's span (before its window, after its own position) get no
        // weight; most units lie inside every span.
        if *a < latest_start || *b > earliest_end {
            for (i, &(lo, hi)) in spans.iter().enumerate() {
                let row = &mut s[i * n..(i + 1) * n];
                row[..lo.saturating_sub(*a).min(n)].fill(f32::NEG_INFINITY);
                row[hi.saturating_sub(*a).min(n)..].fill(f32::NEG_INFINITY);
            }
        }
        // Online softmax: rescale what was accumulated when the running maximum grows.
        for i in 0..g {
            let scores = &mut s[i * n..(i + 1) * n];
            let m = scores.iter().copied().fold(st.m[i], f32::max);
            if m == f32::NEG_INFINITY {
                // Nothing of this row seen yet: no weight, and no 0 · ∞ in the rescaling.
                scores.fill(0.0);
                continue;
            }
            let factor = (st.m[i] - m).exp();
            let sum = kvq_kernels_simd::softmax::exp_sum_with(backend, scores, m);
            st.l[i] = st.l[i] * factor + sum;
            st.m[i] = m;
            if factor != 1.0 {
                st.o[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= factor);
            }
        }
        match v {
            Run::Full(x) => {
                for i in 0..g {
                    for t in 0..n {
                        let w = s[i * n + t];
                        for (o, &vv) in st.o[i * d..(i + 1) * d].iter_mut().zip(&x[t * d..(t + 1) * d]) {
                            *o += w * vv;
                        }
                    }
                }
            }
            Run::Block(view) => {
                let done = with_block(view, &readers[1], &mut bufs, |blk| match path {
                    ScorePath::Float => axpy_with(backend, blk, &s, g, &mut st.o),
                    ScorePath::Int8 => axpy_int_with(backend, blk, &s, g, &mut st.o).map(|_| ()),
                })?;
                if done.is_none() {
                    for t in 0..n {
                        view.decode_row(t, &mut row);
                        for i in 0..g {
                            let w = s[i * n + t];
                            for (o, &vv) in st.o[i * d..(i + 1) * d].iter_mut().zip(&row) {
                                *o += w * vv;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(st)
}

/// Contexts longer than this split one head's blocks across threads (flash-decoding) when
/// there are fewer KV heads than threads.
const SPLIT_TOKENS: usize = 2048;

/// The attention of one KV head's query rows: `tokens × g` rows (token after token), where
/// token `j` is cached token `len − tokens + j` and attends up to itself.
#[allow(clippy::too_many_arguments)]
fn head_attention(
    backend: Backend,
    options: &AttentionOptions,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    head: usize,
    q: &[f32],
    g: usize,
    tokens: usize,
    len: usize,
    readers: &[PartReader; 2],
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let d = cache.config().head_dim;
    out.fill(0.0);
    if len == 0 {
        return Ok(());
    }
    let rows = tokens * g;
    let scale = options.scale.unwrap_or(1.0 / (d as f32).sqrt());
    let qs: Vec<f32> = q.iter().map(|x| x * scale).collect();
    let spans: Vec<(usize, usize)> = (0..rows)
        .map(|r| {
            let end = len - tokens + r / g + 1;
            (options.sliding_window.map_or(0, |w| end.saturating_sub(w)), end)
        })
        .collect();
    let ks = cache.segments(seq, layer, head, Part::K)?;
    let vs = cache.segments(seq, layer, head, Part::V)?;
    let mut all = units(&ks, &vs, d);
    // Units before every row's window are never read.
    let first = spans.iter().map(|s| s.0).min().unwrap_or(0);
    all.retain(|(_, b, _, _)| *b > first);
    let threads = rayon::current_num_threads();
    let st = if len > SPLIT_TOKENS && cache.config().kv_heads < threads && all.len() > 1 {
        let per = all.len().div_ceil(threads);
        all.par_chunks(per)
            .map(|part| attend(backend, options, readers, part, &qs, rows, d, &spans))
            .try_reduce(|| Partial::new(rows, d), |a, b| Ok(a.merge(b)))?
    } else {
        attend(backend, options, readers, &all, &qs, rows, d, &spans)?
    };
    for i in 0..rows {
        let inv = 1.0 / st.l[i];
        for (o, &x) in out[i * d..(i + 1) * d].iter_mut().zip(&st.o[i * d..(i + 1) * d]) {
            *o = x * inv;
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
