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

use kvq_cache_layout::{BlockView, CacheError, Mode, PagedCache, ParamWidening, Segment, SeqId, TailBuf};
use kvq_kernels_simd::{
    KernelError, Levels, Params, QuantBlock, axpy_in, dense_axpy_with, dense_scores_with, scores_in,
};
use kvq_quant_core::calibration::Part;
use kvq_quant_core::codebook::NF4_LEVELS;
use kvq_quant_core::rotation::unrotate_row;
use kvq_quant_core::{CodebookSource, GroupParams, Kind};
use rayon::prelude::*;

use crate::element::{Element, fits};

/// The kernels' instruction sets, the kernels of one this CPU was found to run
/// ([`AttentionOptions::backend`]: `Kernels::new(Backend::Avx2)?`), and the process's choice
/// among them (`KVQ_FORCE_BACKEND`, else the best the CPU has).
#[doc(no_inline)]
pub use kvq_kernels_simd::dispatch::{Backend, Kernels, selected as selected_backend};

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
    /// An output too large for the output's element type (f16 ends at 65504); `out` is left
    /// as it was.
    #[error("attention output {value} of query row {row}, channel {channel} does not fit in {dtype}")]
    OutputOverflow {
        /// The output value, in f32.
        value: f32,
        /// The query row (token-major, then query head) of the call.
        row: usize,
        /// Its channel.
        channel: usize,
        /// The output type.
        dtype: &'static str,
    },
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
    /// Tokens of a chunk ([`BatchSeq::tokens`] above 1) attend one after another, each with
    /// exactly the arithmetic of a decode step of that token alone, instead of going through
    /// the kernels together: a prompt prefilled in chunks then gives the very outputs of
    /// decoding it token by token, when each chunk stops before a token that completes a
    /// block (the cache a token sees must be the one it saw alone). Slower than together by
    /// the blocks each token decodes for itself; faster than one call per token.
    pub token_by_token: bool,
    /// The tokens of a chunk that bring queries to [`decode_attention`] (the newest cached
    /// ones); `None`: 1, a decode step. [`decode_attention_batch`] takes each sequence's own
    /// count from its [`BatchSeq`] instead.
    pub chunk: Option<usize>,
    /// The kernels to run; `None`: the process's selected backend
    /// ([`kvq_kernels_simd::dispatch::selected`]).
    pub backend: Option<Kernels>,
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

    /// Sets whether a chunk's tokens attend token by token ([`AttentionOptions::token_by_token`]).
    pub fn token_by_token(mut self, yes: bool) -> Self {
        self.token_by_token = yes;
        self
    }

    /// Sets the chunk's token count ([`AttentionOptions::chunk`]).
    pub fn chunk(mut self, tokens: usize) -> Self {
        self.chunk = Some(tokens);
        self
    }

    /// Sets the kernel backend ([`AttentionOptions::backend`]).
    pub fn backend(mut self, backend: Kernels) -> Self {
        self.backend = Some(backend);
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

/// The level table of a part's spec, for the kernels (codebook levels), held inline: a step
/// builds its readers without allocating. FP8 has none: its kernels decode the bits.
fn level_table(kind: &Kind) -> Option<([f32; 256], usize)> {
    let mut t = [0f32; 256];
    let n = match kind {
        Kind::Codebook(CodebookSource::Nf4) => copy_levels(&mut t, &NF4_LEVELS),
        Kind::Codebook(CodebookSource::Fixed(cb)) => copy_levels(&mut t, cb.levels()),
        _ => return None,
    };
    Some((t, n))
}

/// Copies a codebook's levels (at most 2^8 of them: codes are at most 8 bits).
fn copy_levels(t: &mut [f32; 256], levels: &[f32]) -> usize {
    let n = levels.len().min(t.len());
    t[..n].copy_from_slice(&levels[..n]);
    n
}

struct PartReader {
    table: Option<([f32; 256], usize)>,
    fp8: Option<kvq_quant_core::Fp8Format>,
    zero: f32,
    symmetric: bool,
}

impl PartReader {
    fn new(cache: &PagedCache, part: Part) -> Self {
        let spec = cache.part(part).spec();
        let bits = spec.bits();
        let symmetric = matches!(spec.kind(), Kind::Symmetric);
        let fp8 = match spec.kind() {
            Kind::Fp8(f) => Some(*f),
            _ => None,
        };
        Self { table: level_table(spec.kind()), fp8, zero: (1u32 << (bits - 1)) as f32, symmetric }
    }

    fn levels(&self) -> Levels<'_> {
        if let Some(f) = self.fp8 {
            return Levels::Fp8(f);
        }
        match &self.table {
            Some((t, n)) => Levels::Table(&t[..*n]),
            None if self.symmetric => Levels::Symmetric { zero: self.zero },
            None => Levels::Affine,
        }
    }
}

/// A block's parameters widened with the kernels' vector code: f16 with F16C, one-byte grid
/// indices with AVX2, where the CPU has them (the portable conversions' values either way).
struct VectorWidening;

impl ParamWidening for VectorWidening {
    fn f16(&self, bytes: &[u8], out: &mut [f32]) {
        kvq_kernels_simd::widen_f16(bytes, out);
    }

    fn grid(
        &self,
        grid: &kvq_quant_core::ParamGrid,
        mins: &[u8],
        maxs: &[u8],
        levels: f32,
        scales: &mut [f32],
        offsets: &mut [f32],
    ) {
        kvq_kernels_simd::widen_grid(grid, mins, maxs, levels, scales, offsets);
    }
}

/// Parameters of a block view widened to f32, and the kernel blocks over them: every layout of
/// the cache (per row, per channel, per group of a row, static) has fused kernels. `f` gets
/// one block, or for a block whose per-channel parameters change inside it (`channel32` in
/// blocks of 128 tokens: [`kvq_cache_layout::PartLayout::channel_sets`]) its token groups as
/// kernel blocks of their own, in order.
fn with_parts<R>(
    view: &BlockView<'_>,
    reader: &PartReader,
    bufs: &mut (Vec<f32>, Vec<f32>),
    f: impl FnOnce(&[QuantBlock<'_>]) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    let layout = view.layout();
    let d = layout.head_dim();
    let rows = view.tokens();
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
    // Where the parameters apply: per row, per channel, or per group of `seg` values of a row.
    enum Place {
        Row,
        Channel,
        Group(usize),
    }
    let place = match layout.mode() {
        Mode::Row { seg } => {
            view.params_f32_with(scale, offset, VectorWidening);
            if seg == d { Place::Row } else { Place::Group(seg) }
        }
        Mode::Channel => {
            view.params_f32_with(scale, offset, VectorWidening);
            Place::Channel
        }
        Mode::Static { seg: 1 } => {
            collect(d, &|c| view.statics()[c]);
            Place::Channel
        }
        Mode::Static { .. } => {
            collect(rows, &|_| view.statics()[0]);
            Place::Row
        }
    };
    let (scale, offset) = (&*scale, &*offset);
    let offset = has_offset.then_some(offset.as_slice());
    let params = match place {
        Place::Row => Params::PerRow { scale, offset },
        Place::Channel => Params::PerChannel { scale, offset },
        Place::Group(group) => Params::PerGroup { group, scale, offset },
    };
    let bits = layout.spec().bits();
    let sets = layout.channel_sets();
    if sets == 1 {
        let block = QuantBlock::new(view.codes(), rows, d, bits, reader.levels(), params)?;
        return f(std::slice::from_ref(&block));
    }
    // Token groups of `per` rows, each with its set of channel parameters (`d` scales, then
    // `d` offsets, in the set's order); the cache writes per-channel blocks whole.
    let Params::PerChannel { scale, offset } = params else {
        unreachable!("channel sets belong to per-channel parts")
    };
    let per = layout.block_size() / sets;
    let part = |j: usize| {
        let (codes, rows) = view.set_codes(j).expect("j < channel_sets");
        let set = j * d..(j + 1) * d;
        let params = Params::PerChannel { scale: &scale[set.clone()], offset: offset.map(|o| &o[set]) };
        QuantBlock::new(codes, rows, d, bits, reader.levels(), params)
    };
    let mut parts = [part(0)?; kvq_cache_layout::MAX_CHANNEL_SETS];
    let n = rows.div_ceil(per).clamp(1, sets);
    for (j, x) in parts.iter_mut().enumerate().take(n).skip(1) {
        *x = part(j)?;
    }
    f(&parts[..n])
}

/// Most width regions of a `-qa` key block (one per width, 1 to 8 bits).
const MAX_REGIONS: usize = 8;

/// The width regions of a block of keys with bits per channel (`-qa`) as kernel regions: each
/// region's per-channel parameters widened into its channels of `all`, side by side in the
/// stored channel order, and `f` called with the regions. `None`, calling nothing, for a block
/// without regions, more than [`MAX_REGIONS`] of them, or a region in token groups (the cache
/// refuses both).
fn with_regions<'v, R>(
    view: &BlockView<'v>,
    reader: &PartReader,
    all: &mut (Vec<f32>, Vec<f32>),
    f: impl FnOnce(&[kvq_kernels_simd::KeyRegion<'_>]) -> Result<R, KernelError>,
) -> Result<Option<R>, KernelError> {
    let Some(views) = view.width_views() else { return Ok(None) };
    let has_offset = view.layout().spec().has_offset();
    let d = view.layout().head_dim();
    let (scale, offset) = all;
    // Every value is written below (the regions tile the row, checked as they come).
    scale.resize(d, 0.0);
    offset.resize(d, 0.0);
    // One pass: each region's parameters widened into its channels, which its kernel region
    // then borrows (the rest of the buffers split off for the next ones).
    let (mut scales, mut offsets) = (&mut scale[..], &mut offset[..]);
    let mut regions: [Option<kvq_kernels_simd::KeyRegion<'_>>; MAX_REGIONS] = [None; MAX_REGIONS];
    let mut end = 0;
    for (slot, (first, v)) in regions.iter_mut().zip(views) {
        let c = v.layout().head_dim();
        if v.layout().channel_sets() != 1 || first != end || c > scales.len() || v.param_count() != c {
            return Ok(None);
        }
        let (s, rest) = std::mem::take(&mut scales).split_at_mut(c);
        scales = rest;
        let (o, rest) = std::mem::take(&mut offsets).split_at_mut(c);
        offsets = rest;
        v.params_f32_into(s, o, VectorWidening);
        let params = Params::PerChannel { scale: s, offset: has_offset.then_some(&*o) };
        let keys =
            QuantBlock::new(v.codes(), v.tokens(), c, v.layout().spec().bits(), reader.levels(), params)?;
        *slot = Some(kvq_kernels_simd::KeyRegion { first, keys });
        end += c;
    }
    // Regions short of the row (or more than `MAX_REGIONS` of them): not a layout the cache
    // writes.
    if end != d {
        return Ok(None);
    }
    let Some(head) = regions[0] else { return Ok(None) };
    let count = regions.iter().take_while(|r| r.is_some()).count();
    let regions: [kvq_kernels_simd::KeyRegion<'_>; MAX_REGIONS] =
        std::array::from_fn(|i| regions[i].unwrap_or(head));
    f(&regions[..count]).map(Some)
}

/// How scores against quantized keys are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ScorePath {
    /// Float kernels: equal to attention over the dequantized cache within f32 rounding.
    #[default]
    Float,
    /// The integer paths where the backend has them: scores with the queries rounded to int8
    /// (as llama.cpp does), off by at most `max|q| / 254 · Σ|levels · scale|`, for affine INT4
    /// and INT8 keys per token or per channel (AVX2, AVX-512 VNNI, aarch64 `sdot`; with
    /// AVX-512 VNNI also keys of 1 to 7 bits, INT2 and INT3, at a head_dim that is a multiple
    /// of 128), and with
    /// the AVX2 kernels (x86-64, AVX-512 CPUs included) also INT4 keys per group of a multiple
    /// of 32 values, symmetric INT4 keys, and keys of a 16-level table (NF4, 4-bit
    /// codebooks), whose levels are rounded to int8 as well (half a step of `max|level| / 127`
    /// more a level), and with AVX-512 VBMI keys with bits per channel (`-qa`: each width
    /// region's columns of the query rounded with a scale of their own) and keys per channel
    /// of any width, in the fused kernel under INT4 values or values of 1 to 3 bits per row;
    /// other keys take the float kernels. And, where the backend has an
    /// integer value kernel (AVX-512 VNNI, INT4 and INT8 values, with VBMI in the fused
    /// kernel also values of 1 to 3 bits per row; AVX2, INT4
    /// values per token under INT4 keys per channel, in the fused block kernel; both fused
    /// kernels also INT4 values per group, one scale per group, and INT4 keys per token or
    /// per group), the block's
    /// weights `p · scale` rounded with one scale per block (to 0..=255 for codes of up to 4
    /// bits, summed centred on `2^(bits − 1)`; to ±32767 for INT8, centred on 128), each output off by at most
    /// `max|w| / (2 · W_max) · Σ|levels − centre|` (`W_max` 255 or 32767).
    /// Faster; the float path equals attention over the dequantized cache within f32 rounding.
    Int8,
}

impl ScorePath {
    /// The kernels' name for this arithmetic.
    fn arithmetic(self) -> kvq_kernels_simd::unit::Arithmetic {
        match self {
            ScorePath::Float => kvq_kernels_simd::unit::Arithmetic::Float,
            ScorePath::Int8 => kvq_kernels_simd::unit::Arithmetic::Int8,
        }
    }
}

/// Attention of the newest tokens of `layer` of `seq`, into `out`: the one entry for a
/// sequence. `q` and `out` hold `tokens × query_heads × head_dim` values, token-major and
/// head-major within a token, where `tokens` is [`AttentionOptions::chunk`] (1 by default: a
/// decode step). A chunk's tokens, appended already (the last `tokens` cached), each attend
/// causally to the cache and to the chunk's earlier tokens: chunked prefill, and the
/// verification step of speculative decoding. Each KV head's blocks are read once for the
/// whole chunk. The kernels are those of [`AttentionOptions::backend`], else the process's
/// selected backend.
///
/// A batch of one of [`decode_attention_batch`]: a one-token call reuses a workspace the
/// calling thread keeps, so that after a thread's first step of a shape a step allocates
/// nothing; a longer chunk gets a workspace of its own (allocated per call, so that a thread
/// does not keep a prefill's buffers).
///
/// # Errors
/// [`AttentionError::Shape`] when the query heads are not a multiple of the KV heads, the
/// slices have the wrong length, or the chunk is 0 tokens or more than are cached;
/// [`AttentionError::Options`] for an option out of range; [`AttentionError::Backend`] for a
/// bad `KVQ_FORCE_BACKEND`; cache and kernel errors.
pub fn decode_attention<T: Element>(
    options: &AttentionOptions,
    cache: &PagedCache,
    seq: SeqId,
    layer: usize,
    q: &[T],
    query_heads: usize,
    out: &mut [T],
) -> Result<(), AttentionError> {
    let tokens = options.chunk.unwrap_or(1);
    let batch = [BatchSeq { seq, tokens }];
    let mut run = |ws: &mut DecodeWorkspace| {
        decode_attention_batch(options, cache, layer, &batch, q, query_heads, out, ws)
    };
    if tokens != 1 {
        return run(&mut DecodeWorkspace::new());
    }
    THREAD_WORKSPACE.with(|ws| match ws.try_borrow_mut() {
        Ok(mut ws) => run(&mut ws),
        // In use further up this thread's stack: a rayon worker waiting inside a call took
        // another caller's call from the pool's queue.
        Err(_) => run(&mut DecodeWorkspace::new()),
    })
}

thread_local! {
    /// The workspace of [`decode_attention`]'s one-token calls on this thread: one
    /// token's buffers per (KV head, part of a split context), tens of KiB for a
    /// Llama-shaped layer, kept for the thread's life.
    static THREAD_WORKSPACE: std::cell::RefCell<DecodeWorkspace> =
        std::cell::RefCell::new(DecodeWorkspace::new());
}

/// One sequence of a batch: its id, and how many of its newest cached tokens bring queries
/// in this call (1 when decoding; a prefill chunk or the tokens a speculative decoder
/// verifies attend causally, each up to itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSeq {
    /// The sequence.
    pub seq: SeqId,
    /// Its new tokens, appended to the cache already: at least 1, at most its length.
    pub tokens: usize,
}

impl BatchSeq {
    /// One decode token of `seq`.
    pub fn decode(seq: SeqId) -> Self {
        Self { seq, tokens: 1 }
    }
}

/// Scratch memory of decode attention that the caller keeps across steps: once a step has
/// run, every later step with no more sequences, tokens per sequence, query heads and cached
/// tokens per block than the largest seen performs no heap allocation. One workspace serves
/// every layer of a cache; it holds no reference to it.
#[derive(Default)]
pub struct DecodeWorkspace {
    /// One per (sequence, KV head, part of a split context); only the first ones of a step
    /// are used, the rest keep their buffers for larger steps.
    tasks: Vec<Task>,
    /// Per sequence of the batch: its cached tokens and its first token row in `q`.
    seqs: Vec<(usize, usize)>,
    /// One output row in f32, before it is written in the caller's element type.
    row: Vec<f32>,
}

impl std::fmt::Debug for DecodeWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeWorkspace").field("tasks", &self.tasks.len()).finish_non_exhaustive()
    }
}

impl DecodeWorkspace {
    /// An empty workspace; the first step sizes it.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The work of one (sequence, KV head, part), and the buffers it reuses step after step.
#[derive(Default)]
struct Task {
    entry: usize,
    head: usize,
    part: usize,
    parts: usize,
    /// The sequence's new tokens whose rows this task attends (all of them, but where
    /// [`AttentionOptions::token_by_token`] shares them out).
    tokens: (usize, usize),
    /// The group's query rows, token after token, scaled, in the keys' frame.
    q: Vec<f32>,
    /// One query row, while it is permuted into the keys' channel order.
    row: Vec<f32>,
    /// Per query row, the cached tokens it attends.
    spans: Vec<(usize, usize)>,
    st: Partial,
    /// One token's state under [`AttentionOptions::token_by_token`].
    one: Partial,
    bufs: (Vec<f32>, Vec<f32>),
    /// The value block's parameters where a fused kernel holds both blocks at once.
    vbufs: (Vec<f32>, Vec<f32>),
    /// Scores of units scored here (full-precision rows, keys stored before RoPE).
    s: Vec<f32>,
    /// Keys with bits per channel: every region's parameters, side by side.
    regions: (Vec<f32>, Vec<f32>),
    rope: RopeScratch,
    kernel: kvq_kernels_simd::Scratch,
    attender: kvq_kernels_simd::unit::Attender,
}

/// Each head's context is attended in parts of this many positions (a unit goes to the part
/// its first token falls in), spread across threads and merged in position order
/// (flash-decoding). The split depends on positions only, never on the threads or the rest
/// of the batch, so neither changes a sequence's outputs.
const SPLIT_TOKENS: usize = 1024;

/// Decode attention for a batch of sequences of different lengths in one call (continuous
/// batching). `q` and `out` hold every sequence's token rows in batch order, each row
/// `query_heads × head_dim` (head-major): sequence `i` owns `batch[i].tokens` rows. The work
/// is spread with rayon over (sequence, KV head), and along the context (flash-decoding, the
/// parts merged by log-sum-exp) when there are fewer of those than threads. With a `ws`
/// kept across steps, a step allocates nothing once the workspace has grown to the batch.
///
/// A sequence with no cached tokens and one query token gets zeros. `out` is written only
/// when every sequence succeeded.
///
/// # Errors
/// [`AttentionError::Shape`] when the query heads are not a multiple of the KV heads, `q` or
/// `out` is not the batch's size, or a sequence's `tokens` is 0 or more than it has cached;
/// [`AttentionError::Options`]; cache and kernel errors.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_batch<T: Element>(
    options: &AttentionOptions,
    cache: &PagedCache,
    layer: usize,
    batch: &[BatchSeq],
    q: &[T],
    query_heads: usize,
    out: &mut [T],
    ws: &mut DecodeWorkspace,
) -> Result<(), AttentionError> {
    options.check()?;
    let backend = match options.backend {
        Some(b) => b,
        None => kvq_kernels_simd::dispatch::selected()?,
    };
    let cfg = cache.config();
    let (heads, d) = (cfg.kv_heads, cfg.head_dim);
    let row = query_heads.checked_mul(d);
    if query_heads == 0 || !query_heads.is_multiple_of(heads) || row.is_none() {
        return Err(AttentionError::Shape(format!(
            "{query_heads} query heads over {heads} KV heads: not a whole number of query heads per KV head"
        )));
    }
    let DecodeWorkspace { tasks, seqs, row: out_row } = ws;
    seqs.clear();
    let mut rows = 0usize;
    for e in batch {
        let len = cache.len(e.seq, layer)?;
        if !(len == 0 && e.tokens == 1) && (e.tokens == 0 || e.tokens > len) {
            return Err(AttentionError::Shape(format!(
                "{} new tokens of sequence {:?}, {len} cached: a chunk's tokens are appended before they attend",
                e.tokens, e.seq
            )));
        }
        seqs.push((len, rows));
        rows = rows.saturating_add(e.tokens);
    }
    let want = row.and_then(|r| r.checked_mul(rows));
    if want != Some(q.len()) || want != Some(out.len()) {
        return Err(AttentionError::Shape(format!(
            "{rows} token rows of {query_heads} query heads of {d}: q has {} values, out {}",
            q.len(),
            out.len()
        )));
    }
    let g = query_heads / heads;
    let rotated = cfg.v_spec.rotated();
    let readers = [PartReader::new(cache, Part::K), PartReader::new(cache, Part::V)];
    // Plan: a task per (sequence, head), several per head for long contexts when the pairs
    // would leave threads idle.
    let threads = rayon::current_num_threads();
    let pairs = seqs.iter().filter(|s| s.0 > 0).count() * heads;
    let mut n = 0;
    for (i, &(len, _)) in seqs.iter().enumerate() {
        if len == 0 {
            continue;
        }
        let parts = len.div_ceil(SPLIT_TOKENS);
        // Tokens that attend one by one can be shared out too, when the tasks are few.
        let tokens = batch[i].tokens;
        let slices = if options.token_by_token && tokens > 1 && pairs * parts < 2 * threads {
            (2 * threads).div_ceil(pairs * parts).min(tokens)
        } else {
            1
        };
        for head in 0..heads {
            for slice in 0..slices {
                for part in 0..parts {
                    if n == tasks.len() {
                        tasks.push(Task::default());
                    }
                    let t = &mut tasks[n];
                    (t.entry, t.head, t.part, t.parts) = (i, head, part, parts);
                    t.tokens = (slice * tokens / slices, (slice + 1) * tokens / slices);
                    n += 1;
                }
            }
        }
    }
    let seqs = &*seqs;
    tasks[..n].par_iter_mut().try_for_each(|t| {
        let (len, first) = seqs[t.entry];
        t.run(
            backend,
            options,
            cache,
            layer,
            batch[t.entry],
            len,
            &q[first * query_heads * d..],
            query_heads,
            g,
            &readers,
        )
    })?;
    // Every task succeeded: merge the parts of each head.
    let mut at = 0;
    while at < n {
        let parts = tasks[at].parts;
        let (lead, rest) = tasks[at..at + parts].split_first_mut().expect("a head has a part");
        for other in rest.iter() {
            lead.st.merge_from(&other.st);
        }
        at += parts;
    }
    out_row.resize(d, 0.0);
    // Normalized output rows, unrotated where the cache holds rotated values: `f` sees each
    // row with its index in `out`.
    let mut rows_out = |f: &mut RowSink<'_>| {
        let mut at = 0;
        while at < n {
            let lead = &tasks[at];
            let first = seqs[lead.entry].1;
            let st = &lead.st;
            for r in 0..st.m.len() {
                let (j, i) = (lead.tokens.0 + r / g, r % g);
                let row = (first + j) * query_heads + lead.head * g + i;
                let inv = 1.0 / st.l[r];
                for (y, &x) in out_row.iter_mut().zip(&st.o[r * d..(r + 1) * d]) {
                    *y = x * inv;
                }
                if rotated {
                    // The cache holds rotated value rows: Σ p·Rv = R·Σ p·v, undone once per row.
                    unrotate_row(out_row);
                }
                f(row, out_row)?;
            }
            at += lead.parts;
        }
        Ok(())
    };
    if T::MAX < f32::MAX {
        // A narrow output type: every row must fit before the first is written.
        rows_out(&mut |row, x| match x.iter().position(|&v| !fits::<T>(v)) {
            None => Ok(()),
            Some(c) => Err(AttentionError::OutputOverflow { value: x[c], row, channel: c, dtype: T::NAME }),
        })?;
    }
    for (&(len, first), e) in seqs.iter().zip(batch) {
        if len == 0 {
            out[first * query_heads * d..(first + e.tokens) * query_heads * d].fill(T::ZERO);
        }
    }
    rows_out(&mut |row, x| {
        for (y, &v) in out[row * d..(row + 1) * d].iter_mut().zip(x) {
            *y = T::from_f32(v);
        }
        Ok(())
    })
}

/// What receives each finished output row (its index among the call's rows, its values).
type RowSink<'a> = dyn FnMut(usize, &[f32]) -> Result<(), AttentionError> + 'a;

impl Task {
    /// Attends this task's part of the head's cached tokens with the group's query rows of
    /// every new token of the sequence; `q` starts at the sequence's first token row.
    #[allow(clippy::too_many_arguments)]
    fn run<T: Element>(
        &mut self,
        backend: Kernels,
        options: &AttentionOptions,
        cache: &PagedCache,
        layer: usize,
        e: BatchSeq,
        len: usize,
        q: &[T],
        query_heads: usize,
        g: usize,
        readers: &[PartReader; 2],
    ) -> Result<(), AttentionError> {
        let d = cache.config().head_dim;
        let h = self.head;
        let scale = options.scale.unwrap_or(1.0 / (d as f32).sqrt());
        // Only this task's tokens' rows.
        let (from, to) = self.tokens;
        // The group's rows of those tokens, scaled, in the frame the head's keys are stored in.
        self.q.clear();
        for j in from..to {
            let at = (j * query_heads + h * g) * d;
            self.q.extend(q[at..at + g * d].iter().map(|x| x.to_f32() * scale));
        }
        cache.queries_to_key_frame(layer, h, &mut self.q, &mut self.row)?;
        let rows = (to - from) * g;
        let window = |end: usize| options.sliding_window.map_or(0, |w| end.saturating_sub(w));
        let ks = cache.segment_iter(e.seq, layer, h, Part::K)?;
        let vs = cache.segment_iter(e.seq, layer, h, Part::V)?;
        self.st.reset(rows, d);
        let rope = cache.config().rope.as_ref().map(|r| (r, cache.config().block_size));
        let part = self.part;
        let mut scratch = Scratch {
            bufs: &mut self.bufs,
            vbufs: &mut self.vbufs,
            s: &mut self.s,
            regions: &mut self.regions,
            rope: &mut self.rope,
            kernel: &mut self.kernel,
            attender: &mut self.attender,
        };
        // This task's units of those that end after `first` and start before `end`, as a
        // decode step at `end` sees them: a unit that runs past `end` (the full-precision
        // tail, or a block of rows quantized one by one as they came) cut there, where that
        // step's cache ended.
        // Of those, the ones that start in this task's part of the positions.
        let (lo, hi) = (part * SPLIT_TOKENS, (part + 1) * SPLIT_TOKENS);
        let mine = |first: usize, end: usize| {
            Units::starting_at(ks.clone(), vs.clone(), d, lo.max(first))
                .skip_while(move |u| u.start < lo)
                .filter(move |u| u.end > first)
                .take_while(move |u| u.start < end.min(hi))
                .map(
                    move |u| {
                        if u.end <= end { u } else { Unit { end, k: u.k.cut(end), v: u.v.cut(end), ..u } }
                    },
                )
        };
        if options.token_by_token && e.tokens > 1 {
            // Each token alone: its group's rows, its span, its own state, as its decode step.
            for j in from..to {
                let end = len - e.tokens + j + 1;
                self.spans.clear();
                self.spans.resize(g, (window(end), end));
                self.one.reset(g, d);
                let r = j - from;
                let q = &self.q[r * g * d..(r + 1) * g * d];
                attend(
                    backend,
                    options,
                    readers,
                    rope,
                    mine(window(end), end),
                    q,
                    g,
                    d,
                    &self.spans,
                    &mut self.one,
                    &mut scratch,
                )?;
                self.st.m[r * g..(r + 1) * g].copy_from_slice(&self.one.m);
                self.st.l[r * g..(r + 1) * g].copy_from_slice(&self.one.l);
                self.st.o[r * g * d..(r + 1) * g * d].copy_from_slice(&self.one.o);
            }
            return Ok(());
        }
        self.spans.clear();
        self.spans.extend((0..rows).map(|r| {
            let end = len - e.tokens + r / g + 1;
            (window(end), end)
        }));
        // Units before every row's window are never read.
        let first = self.spans.iter().map(|s| s.0).min().unwrap_or(0);
        attend(
            backend,
            options,
            readers,
            rope,
            mine(first, len),
            &self.q,
            rows,
            d,
            &self.spans,
            &mut self.st,
            &mut scratch,
        )
    }
}

/// Which kernels decode runs on a sequence's quantized blocks ([`decode_kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecodeKernel {
    /// One kernel takes a whole block of keys and values with the online-softmax step.
    FusedBlock,
    /// The scores kernel, the softmax step here, then the value kernel.
    SeparateKernels,
}

impl DecodeKernel {
    /// `"fused block"` or `"separate kernels"`.
    pub fn name(self) -> &'static str {
        match self {
            DecodeKernel::FusedBlock => "fused block",
            DecodeKernel::SeparateKernels => "separate kernels",
        }
    }
}

impl std::fmt::Display for DecodeKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernels that decode's integer path ([`ScorePath::Int8`]) runs on the quantized blocks
/// of `seq` on `backend` with `query_rows` query rows per KV head: [`decode_kernel`] on that
/// path.
///
/// # Errors
/// As [`decode_kernel`].
pub fn integer_decode_kernel(
    backend: Kernels,
    cache: &PagedCache,
    seq: SeqId,
    query_rows: usize,
) -> Result<Option<DecodeKernel>, AttentionError> {
    decode_kernel(backend, ScorePath::Int8, cache, seq, query_rows)
}

/// The kernels that decode on `path` runs on the quantized blocks of `seq` on `backend` with
/// `query_rows` query rows per KV head: [`DecodeKernel::FusedBlock`] where one kernel takes a
/// whole block of keys and values, [`DecodeKernel::SeparateKernels`] otherwise; judged from the first quantized unit of
/// layer 0, KV head 0. `None` when that head holds no quantized block yet.
///
/// The integer path's fused kernels (AVX-512 VNNI, AVX2 or aarch64 `sdot`) take KIVI-style
/// INT4 (the keys' channel groups the block or token groups inside it, see
/// [`kvq_kernels_simd::attend_int_parts_with`]; on x86-64 also INT4 values per group, see
/// [`kvq_kernels_simd::attend_int_with`]; on AVX-512 with VBMI also keys with bits per channel,
/// `-qa`, see [`kvq_kernels_simd::attend_int_regions_with`], keys per channel of any width
/// and values of 1 to 3 bits per row). On both paths the AVX-512 backend fuses FP8 keys and
/// values with one scale per row (`fp8e4m3-token`, `fp8e5m2-token`, see
/// [`kvq_kernels_simd::attend_float_with`]). Units near a sliding window's start or a chunk's
/// causal end, and soft-capped attention, take the separate kernels either way.
///
/// # Errors
/// [`AttentionError::Cache`] for an unknown sequence; kernel errors for a corrupt block.
pub fn decode_kernel(
    backend: Kernels,
    path: ScorePath,
    cache: &PagedCache,
    seq: SeqId,
    query_rows: usize,
) -> Result<Option<DecodeKernel>, AttentionError> {
    let d = cache.config().head_dim;
    let ks = cache.segment_iter(seq, 0, 0, Part::K)?;
    let vs = cache.segment_iter(seq, 0, 0, Part::V)?;
    let readers = [PartReader::new(cache, Part::K), PartReader::new(cache, Part::V)];
    let (mut kb, mut vb, mut all) = Default::default();
    let attender = kvq_kernels_simd::unit::Attender::new(backend, path.arithmetic());
    for u in Units::starting_at(ks, vs, d, 0) {
        if let (Run::Block(kv), Run::Block(vv)) = (u.k, u.v) {
            // Keys stored before RoPE are scored block by block with their turn.
            let fused = cache.config().rope.is_none()
                && with_keys(&kv, &readers, &mut kb, &mut all, |keys| {
                    with_parts(&vv, &readers[1], &mut vb, |vs| {
                        Ok(attender.plan(keys, vs, query_rows).is_fused())
                    })
                })?;
            return Ok(Some(if fused { DecodeKernel::FusedBlock } else { DecodeKernel::SeparateKernels }));
        }
    }
    Ok(None)
}

/// Buffers [`attend`] reuses across units.
struct Scratch<'w> {
    bufs: &'w mut (Vec<f32>, Vec<f32>),
    vbufs: &'w mut (Vec<f32>, Vec<f32>),
    s: &'w mut Vec<f32>,
    /// Keys with bits per channel: every region's parameters, side by side.
    regions: &'w mut (Vec<f32>, Vec<f32>),
    rope: &'w mut RopeScratch,
    kernel: &'w mut kvq_kernels_simd::Scratch,
    attender: &'w mut kvq_kernels_simd::unit::Attender,
}

/// What scoring keys stored before RoPE (`-prerope`) keeps across blocks.
#[derive(Default)]
struct RopeScratch {
    /// The frequencies and pairing `table` is for.
    freq: Vec<f64>,
    pairing: Option<kvq_quant_core::RopePairing>,
    /// Per offset `τ` in a block: every channel's `cos(τ θ)`, then its `± sin(τ θ)`.
    table: Vec<f32>,
    /// The turn of the last block's first position `p`, per pair: `(cos, sin)` of `−p θ_i`,
    /// and that position.
    base: Vec<(f64, f64)>,
    base_at: Option<usize>,
    /// `(cos, sin)` of `−block_size · θ_i`: from one block's turn to the next one's.
    step: Vec<(f64, f64)>,
    /// The group's queries turned back by the block's first position, and that turn in f32.
    q: Vec<f32>,
    qturn: Vec<f32>,
}

impl RopeScratch {
    /// The offset table and block step for `rope` and blocks of `bs` tokens (kept while they
    /// stay the same).
    fn prepare(&mut self, rope: &kvq_quant_core::Rope, bs: usize) {
        let pairs = rope.inv_freq().len();
        if self.freq == rope.inv_freq()
            && self.pairing == Some(rope.pairing())
            && self.table.len() == bs * 4 * pairs
        {
            return;
        }
        self.pairing = Some(rope.pairing());
        self.freq.clear();
        self.freq.extend_from_slice(rope.inv_freq());
        // Per offset, in the channel form `decode_turn_with` takes: each channel's cosine,
        // then its sine, negative on the first channel of a pair.
        let d = 2 * pairs;
        self.table.clear();
        self.table.resize(bs * 2 * d, 0.0);
        // Offset after offset by one complex product per pair (a sin_cos per entry would cost
        // more than the block's scores when a step starts with a fresh workspace); f64 keeps
        // the drift over 4096 offsets near 1e-13.
        for (i, &f) in rope.inv_freq().iter().enumerate() {
            let (a, b) = rope.pairing().channels(i, d);
            let (ss, sc) = f.sin_cos();
            let (mut cos, mut sin) = (1f64, 0f64);
            for t in self.table.chunks_exact_mut(2 * d) {
                (t[a], t[b], t[d + a], t[d + b]) = (cos as f32, cos as f32, -sin as f32, sin as f32);
                (cos, sin) = (cos * sc - sin * ss, sin * sc + cos * ss);
            }
        }
        self.step.clear();
        self.step.extend(rope.inv_freq().iter().map(|&f| (-(bs as f64) * f).sin_cos()).map(|(s, c)| (c, s)));
        self.base_at = None;
    }

    /// `(cos, sin)` of `−p θ_i` for block start `p`: one complex product per pair from the
    /// previous block's, a direct `sin_cos` when blocks are not consecutive (and every 64
    /// blocks, so that rounding cannot drift).
    fn turn_to(&mut self, rope: &kvq_quant_core::Rope, p: usize, bs: usize) {
        let next = self.base_at.and_then(|b| b.checked_add(bs)) == Some(p) && !(p / bs).is_multiple_of(64);
        if next {
            for (b, &(sc, ss)) in self.base.iter_mut().zip(&self.step) {
                *b = (b.0 * sc - b.1 * ss, b.1 * sc + b.0 * ss);
            }
        } else {
            self.base.clear();
            self.base
                .extend(rope.inv_freq().iter().map(|&f| (-(p as f64) * f).sin_cos()).map(|(s, c)| (c, s)));
        }
        self.base_at = Some(p);
    }
}

/// Scores of the `g` query rows `qs` against a block of keys stored before RoPE (`rs`
/// prepared for `rope` by the caller): `q · R(p + τ)
/// k̂ = (R(−p) q) · (R(τ) k̂)` for the block's first position `p`: each query is turned back
/// once per block, each key row decoded and turned by its offset `τ` from a table and dotted
/// in registers (`scores_turn_with`).
#[allow(clippy::too_many_arguments)]
fn pre_rope_scores(
    backend: Kernels,
    (rope, bs): (&kvq_quant_core::Rope, usize),
    view: &BlockView<'_>,
    params: &mut (Vec<f32>, Vec<f32>),
    (rs, kernel): (&mut RopeScratch, &mut kvq_kernels_simd::Scratch),
    qs: &[f32],
    g: usize,
    d: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    rs.turn_to(rope, view.first_token(), bs);
    let (scale, offset) = params;
    view.params_f32_with(scale, offset, VectorWidening);
    let pairing = rope.pairing();
    // The queries turned back by the block's first position, in f32 from the f64 turn (in
    // the table's channel form: cosines, then signed sines).
    rs.qturn.resize(2 * d, 0.0);
    let (cos, sin) = rs.qturn.split_at_mut(d);
    for (i, &(c, s)) in rs.base.iter().enumerate() {
        let (a, b) = pairing.channels(i, d);
        (cos[a], cos[b], sin[a], sin[b]) = (c as f32, c as f32, -s as f32, s as f32);
    }
    rs.q.resize(g * d, 0.0);
    let h = d / 2;
    for (row, src) in rs.q.chunks_exact_mut(d).zip(qs.chunks_exact(d)) {
        match pairing {
            kvq_quant_core::RopePairing::Half => {
                for j in 0..h {
                    row[j] = src[j] * cos[j] + src[h + j] * sin[j];
                    row[h + j] = src[h + j] * cos[h + j] + src[j] * sin[h + j];
                }
            }
            kvq_quant_core::RopePairing::Interleaved => {
                for j in (0..d).step_by(2) {
                    row[j] = src[j] * cos[j] + src[j + 1] * sin[j];
                    row[j + 1] = src[j + 1] * cos[j + 1] + src[j] * sin[j + 1];
                }
            }
        }
    }
    // Each key row decoded from where it is packed, turned by its offset in the block, and
    // scored.
    let rows = kvq_kernels_simd::TurnRows {
        codes: view.codes(),
        bits: view.layout().spec().bits(),
        scale,
        offset,
        table: &rs.table,
        pairing,
        dim: d,
    };
    kvq_kernels_simd::scores_turn_in(backend, kernel, &rows, &rs.q, g, out)
}

/// One run of tokens of one part: full-precision rows, or a whole quantized block.
#[derive(Clone, Copy)]
enum Run<'a> {
    /// `offset` is the first value's index in `rows`.
    Full {
        rows: &'a TailBuf,
        offset: usize,
    },
    Block(BlockView<'a>),
}

/// Scores (`scores = true`) or values of a run of tail or sink rows: f32 rows read in place
/// and f16 rows widened in registers by the dense kernels; 8-bit rows through the quantized
/// kernels, as a symmetric 8-bit block with a scale per row.
#[allow(clippy::too_many_arguments)]
fn dense_run(
    backend: Kernels,
    kernel: &mut kvq_kernels_simd::Scratch,
    scores: bool,
    rows: &TailBuf,
    offset: usize,
    n: usize,
    d: usize,
    w: &[f32],
    g: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    fn run<T: kvq_kernels_simd::DenseRow>(
        backend: Kernels,
        scores: bool,
        x: &[T],
        (n, d, w, g): (usize, usize, &[f32], usize),
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        if scores {
            dense_scores_with(backend, x, n, d, w, g, out)
        } else {
            dense_axpy_with(backend, x, n, d, w, g, out)
        }
    }
    let range = offset..offset + n * d;
    match rows {
        TailBuf::F32(v) => run(backend, scores, &v[range], (n, d, w, g), out),
        TailBuf::F16(v) => run(backend, scores, &v[range], (n, d, w, g), out),
        TailBuf::Int8(r) => {
            let rows = offset / d..offset / d + n;
            let zero = f32::from(kvq_cache_layout::INT8_ROWS_ZERO);
            let params = Params::PerRow { scale: r.scales(rows.clone()), offset: None };
            let block = QuantBlock::new(r.codes(rows), n, d, 8, Levels::Symmetric { zero }, params)?;
            if scores {
                scores_in(backend, kernel, &block, w, g, out)
            } else {
                axpy_in(backend, kernel, &block, w, g, out)
            }
        }
    }
}

/// A grid unit (the sinks, then `block_size` tokens at a time): tokens `start..end`, with
/// their K and V runs.
#[derive(Clone, Copy)]
struct Unit<'a> {
    start: usize,
    end: usize,
    k: Run<'a>,
    v: Run<'a>,
}

/// The units of a head, walking its K and V segments together: they start on the same grid,
/// so each unit lies inside one segment of each.
#[derive(Clone)]
struct Units<'a> {
    k: std::iter::Peekable<kvq_cache_layout::Segments<'a>>,
    v: std::iter::Peekable<kvq_cache_layout::Segments<'a>>,
    at: usize,
    d: usize,
}

impl<'a> Units<'a> {
    /// The units from the one that holds token `token` on (or a few before it: those that
    /// start where the later of its K and V segments starts).
    fn starting_at(
        k: kvq_cache_layout::Segments<'a>,
        v: kvq_cache_layout::Segments<'a>,
        d: usize,
        token: usize,
    ) -> Self {
        let (mut k, mut v) = (k.skip_ending_by(token).peekable(), v.skip_ending_by(token).peekable());
        let at = match (k.peek(), v.peek()) {
            (Some(a), Some(b)) => span(a).0.max(span(b).0),
            _ => 0,
        };
        Self { k, v, at, d }
    }
}

impl Run<'_> {
    /// The run without its tokens from `end` on (a block's rows are quantized one by one
    /// where a block is still being filled).
    fn cut(self, end: usize) -> Self {
        match self {
            Run::Block(view) if view.first_token() + view.tokens() > end => {
                Run::Block(view.first_rows(end.saturating_sub(view.first_token())))
            }
            r => r,
        }
    }
}

fn span(s: &Segment<'_>) -> (usize, usize) {
    match *s {
        Segment::Full { first_token, tokens, .. } => (first_token, first_token + tokens),
        Segment::Quantized(b) => (b.first_token(), b.first_token() + b.tokens()),
    }
}

impl<'a> Iterator for Units<'a> {
    type Item = Unit<'a>;

    fn next(&mut self) -> Option<Unit<'a>> {
        let at = self.at;
        // Drop the segments that end at or before the cursor.
        while self.k.peek().is_some_and(|s| span(s).1 <= at) {
            self.k.next();
        }
        while self.v.peek().is_some_and(|s| span(s).1 <= at) {
            self.v.next();
        }
        let (ks, vs) = (*self.k.peek()?, *self.v.peek()?);
        let end = span(&ks).1.min(span(&vs).1);
        let d = self.d;
        let run = |s: Segment<'a>| match s {
            Segment::Full { first_token, rows, offset, .. } => {
                Run::Full { rows, offset: offset + (at - first_token) * d }
            }
            Segment::Quantized(view) => {
                debug_assert!(at == view.first_token() && end == view.first_token() + view.tokens());
                Run::Block(view)
            }
        };
        self.at = end;
        Some(Unit { start: at, end, k: run(ks), v: run(vs) })
    }
}

/// Online-softmax state of a group's query rows: running max, running sum, and the
/// unnormalized output.
#[derive(Default)]
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl Partial {
    /// The empty state of `rows` rows of `d` values, in the buffers already held.
    fn reset(&mut self, rows: usize, d: usize) {
        self.m.clear();
        self.m.resize(rows, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(rows, 0.0);
        self.o.clear();
        self.o.resize(rows * d, 0.0);
    }

    /// Merges another partial over disjoint tokens (log-sum-exp), as flash-decoding does. A
    /// row that saw nothing on one side takes the other's as it is, so a part beyond a row's
    /// end changes none of its bits.
    fn merge_from(&mut self, other: &Partial) {
        let d = self.o.len() / self.m.len().max(1);
        for i in 0..self.m.len() {
            if other.m[i] == f32::NEG_INFINITY {
                continue;
            }
            if self.m[i] == f32::NEG_INFINITY {
                (self.m[i], self.l[i]) = (other.m[i], other.l[i]);
                self.o[i * d..(i + 1) * d].copy_from_slice(&other.o[i * d..(i + 1) * d]);
                continue;
            }
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
    }
}

/// Attends the g query rows `qs` (already scaled) over `units` into `st`; row `i` sees
/// tokens `spans[i].0 .. spans[i].1` only (its sliding window and its causal end), the
/// others get no weight. A unit of quantized keys and values (not turned by RoPE) goes to the
/// kernels' [`Attender`](kvq_kernels_simd::unit::Attender), which owns the order of fused and
/// separate kernels; the others (full-precision rows, keys stored before RoPE) are scored
/// here and finished by the kernels' softmax step and value sum.
#[allow(clippy::too_many_arguments)]
fn attend<'a>(
    backend: Kernels,
    options: &AttentionOptions,
    readers: &[PartReader; 2],
    rope: Option<(&kvq_quant_core::Rope, usize)>,
    units: impl Iterator<Item = Unit<'a>>,
    qs: &[f32],
    g: usize,
    d: usize,
    spans: &[(usize, usize)],
    st: &mut Partial,
    w: &mut Scratch<'_>,
) -> Result<(), AttentionError> {
    let latest_start = spans.iter().map(|s| s.0).max().unwrap_or(0);
    let earliest_end = spans.iter().map(|s| s.1).min().unwrap_or(usize::MAX);
    let Scratch { bufs, vbufs, s, regions, rope: rs, kernel, attender } = w;
    attender.begin(backend, options.path.arithmetic());
    // The offset table of keys stored before RoPE: checked once per call, not per block.
    if let Some((rope, bs)) = rope {
        rs.prepare(rope, bs);
    }
    let mut units = units.peekable();
    while let Some(Unit { start: a, end: b, k, v }) = units.next() {
        // Start loading the next unit's blocks while this one computes: block regions are
        // scattered in the pool, so the hardware prefetcher cannot guess them. Queued for the
        // kernel, which asks for them a few lines at a time from its row loops (a burst of
        // prefetches before it would stall it, `kvq_kernels_simd::Scratch::prefetch_next`);
        // the paths that do not take the queue prefetch it before they compute.
        if let Some(next) = units.peek() {
            for run in [next.k, next.v] {
                if let Run::Block(view) = run {
                    kernel.prefetch_next(view.bytes());
                }
            }
        }
        // Most units lie inside every row's span.
        let mask = (a < latest_start || b > earliest_end).then_some((a, spans));
        let unit_options = kvq_kernels_simd::unit::UnitOptions { softcap: options.softcap, mask };
        let state = kvq_kernels_simd::Online { m: &mut st.m, l: &mut st.l, o: &mut st.o };
        if let (Run::Block(kv), Run::Block(vv), None) = (&k, &v, rope) {
            with_keys(kv, readers, bufs, regions, |keys| {
                with_parts(vv, &readers[1], vbufs, |vs| {
                    attender.attend(kernel, keys, vs, qs, g, state, &unit_options).map(|_| ())
                })
            })?;
            continue;
        }
        kernel.prefetch_queued();
        let n = b - a;
        kvq_kernels_simd::unit::size_scores(s, g, n)?;
        match (k, rope) {
            (Run::Full { rows, offset }, _) => {
                dense_run(backend, kernel, true, rows, offset, n, d, qs, g, s)?
            }
            // Keys stored before RoPE (the cache holds them so only as per-channel blocks).
            (Run::Block(view), Some(rope)) => {
                pre_rope_scores(backend, rope, &view, bufs, (rs, kernel), qs, g, d, s)?
            }
            (Run::Block(view), None) => {
                with_keys(&view, readers, bufs, regions, |keys| attender.scores(kernel, keys, qs, g, s))?
            }
        }
        let mut state = state;
        kvq_kernels_simd::unit::absorb(backend, s, n, &unit_options, &mut state);
        match v {
            Run::Full { rows, offset } => {
                dense_run(backend, kernel, false, rows, offset, n, d, s, g, state.o)?
            }
            Run::Block(view) => {
                with_parts(&view, &readers[1], vbufs, |vs| attender.add_values(kernel, vs, s, g, state.o))?
            }
        }
    }
    Ok(())
}

/// A block of keys as the kernels take it: its width regions for keys with bits per channel
/// (`-qa`), else the block or its token groups ([`with_parts`]).
fn with_keys<R>(
    view: &BlockView<'_>,
    readers: &[PartReader; 2],
    bufs: &mut (Vec<f32>, Vec<f32>),
    regions: &mut (Vec<f32>, Vec<f32>),
    f: impl FnOnce(kvq_kernels_simd::unit::Keys<'_>) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    use kvq_kernels_simd::unit::Keys;
    if view.width_views().is_none() {
        return with_parts(view, &readers[0], bufs, |ks| f(Keys::Parts(ks)));
    }
    with_regions(view, &readers[0], regions, |rs| f(Keys::Regions(rs)))?.ok_or_else(|| {
        // More regions than widths, regions in token groups, or regions short of the row:
        // layouts the cache refuses to write.
        KernelError::Shape("a -qa key block whose width regions the kernels cannot take".into())
    })
}
