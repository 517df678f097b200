//! `kvq analyze`: how much each quantization spec damages a model's keys, values and
//! attention, and what it saves.
//!
//! For every layer and every [`KvSpec`] the keys and values are quantized offline, compared
//! element-wise with the originals, and attention is recomputed in f64 with the quantized K
//! and V at a spread of query positions. With [`Options::cache`] they are instead appended
//! token by token to a [`QuantizedKvCache`] (residual window and sinks included), and each
//! query sees the keys and values as the cache held them at its position.

use std::fmt::Write as _;

use kvq_quant_core::calibration::Part;
use kvq_quant_core::io::{TensorFile, TensorFileError};
use kvq_quant_core::metrics::{
    AttentionOutputs, attention, compare_attention, compare_attention_grouped, error_stats,
};
use kvq_quant_core::synth::normal_tensor;
use kvq_quant_core::{
    ChannelBits, Granularity, QuantError, QuantSpec, Rope, RopePairing, Shape, Tensor, quantize,
    quantize_channel_bits,
};
use rayon::prelude::*;

use crate::cache::{
    DEFAULT_BLOCK_SIZE, DEFAULT_RESIDUAL_BLOCKS, DEFAULT_SINK_TOKENS, KvCacheConfig, KvqError,
    QuantizedKvCache,
};
use kvq_cache_layout::TailDtype;

/// Why an analysis could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnalyzeError {
    /// The tensor file could not be read.
    #[error(transparent)]
    File(#[from] TensorFileError),
    /// The file has no `layer{L}.q/.k/.v` triple.
    #[error("{0}: no layers found (expected tensors named layer<L>.q, layer<L>.k and layer<L>.v)")]
    NoLayers(String),
    /// A layer's tensors cannot be analyzed (bad shapes, NaN, ...).
    #[error("{layer}: {source}")]
    Layer {
        /// The layer.
        layer: String,
        /// What went wrong.
        source: QuantError,
    },
    /// A spec cannot quantize a layer.
    #[error("{layer}, spec {spec}: {source}")]
    Spec {
        /// The layer.
        layer: String,
        /// The spec.
        spec: String,
        /// What went wrong.
        source: QuantError,
    },
    /// The cache refused a spec or its data ([`Options::cache`]).
    #[error("{layer}, spec {spec}: {source}")]
    Cache {
        /// The layer.
        layer: String,
        /// The spec.
        spec: String,
        /// What went wrong.
        source: KvqError,
    },
    /// A spec string could not be parsed.
    #[error(transparent)]
    Parse(#[from] QuantError),
}

/// Specs for keys and values, which may differ (mixed precision, per-channel K with per-token V).
#[derive(Debug, Clone, PartialEq)]
pub struct KvSpec {
    /// Spec for the keys.
    pub k: QuantSpec,
    /// Spec for the values.
    pub v: QuantSpec,
}

impl KvSpec {
    /// The same spec for K and V.
    pub fn same(spec: QuantSpec) -> Self {
        Self { k: spec.clone(), v: spec }
    }

    /// Parses `SPEC` (both) or `KSPEC/VSPEC`, e.g. `int4-channel/int4-token`.
    ///
    /// # Errors
    /// [`QuantError::InvalidSpec`] for either half.
    pub fn parse(s: &str) -> Result<Self, QuantError> {
        match s.split_once('/') {
            Some((k, v)) => Ok(Self { k: k.parse()?, v: v.parse()? }),
            None => Ok(Self::same(s.parse()?)),
        }
    }

    /// The specs with whole-sequence per-channel groups (`channel`) made `channel{block}`:
    /// the paged cache groups a channel over one block of tokens, so that is what `channel`
    /// means in a cache with blocks of `block` tokens.
    pub fn for_block(&self, block: usize) -> Self {
        let f = |s: &QuantSpec| match s.granularity() {
            Granularity::PerChannel { token_group: None } => s
                .clone()
                .with_granularity(Granularity::PerChannel { token_group: Some(block.max(1)) })
                .expect("a positive token group"),
            _ => s.clone(),
        };
        Self { k: f(&self.k), v: f(&self.v) }
    }

    /// `KSPEC/VSPEC`, or one spec when both are the same.
    pub fn name(&self) -> String {
        if self.k == self.v { self.k.to_string() } else { format!("{}/{}", self.k, self.v) }
    }
}

/// The default comparison: INT8, INT4 and INT2 per tensor, per head, per-channel keys with
/// per-token values (INT4 and INT2 also with rotated values in error-minimizing ranges, then
/// with one-byte parameters, `-p8`, and with query-aware bits per key channel, `-qa`),
/// and groups of 32; query-aware INT3 keys with rotated INT3 values; `-p8` keys one width
/// above their values (INT4/INT3, INT3/INT2); FP8 e4m3 and NF4 per token. Per-channel keys group over the cache's block
/// ([`Options::block_size`]).
pub fn default_specs() -> Vec<KvSpec> {
    let mut out = Vec::new();
    for bits in [8, 4, 2] {
        let mut forms = vec!["tensor", "head", "channel/int{b}-token"];
        if bits < 8 {
            forms.push("channel/int{b}-token-mse-rot");
            forms.push("channel-p8/int{b}-token-mse-rot-p8");
            forms.push("channel-qa/int{b}-token-mse-rot");
        }
        forms.push("g32");
        for s in forms {
            let text = format!("int{bits}-{}", s.replace("{b}", &bits.to_string()));
            out.push(KvSpec::parse(&text).expect("built-in specs parse"));
        }
    }
    // Between INT4 and INT2: query-aware INT3 keys with rotated INT3 values, the best of the
    // real-model evaluations at about 4.3 bits (docs/quality.md).
    out.push(KvSpec::parse("int3-channel-qa/int3-token-mse-rot").expect("built-in spec"));
    // Keys a width above their values: the keys alone set the attention KL, and on the real
    // model these halve it against the values a width above the keys (docs/quality.md).
    out.push(KvSpec::parse("int4-channel-p8/int3-token-mse-rot-p8").expect("built-in spec"));
    out.push(KvSpec::parse("int3-channel-p8/int2-token-mse-rot-p8").expect("built-in spec"));
    out.push(KvSpec::parse("fp8e4m3-token").expect("built-in spec"));
    out.push(KvSpec::parse("nf4-token").expect("built-in spec"));
    out
}

/// Keeps the specs of `specs` that can quantize every layer of `layers` (a group of 32 does
/// not divide a head_dim of 16, say), and returns the others with the reason: a built-in list
/// then applies to any model instead of failing as a whole.
pub fn applicable_specs(
    layers: &[LayerInput],
    specs: Vec<KvSpec>,
) -> (Vec<KvSpec>, Vec<(KvSpec, QuantError)>) {
    let (kept, skipped) = applicable_with(layers, specs, &Options::default());
    let skipped = skipped
        .into_iter()
        .map(|(s, why)| match why {
            AnalyzeError::Spec { source, .. } | AnalyzeError::Layer { source, .. } => (s, source),
            other => (s, QuantError::InvalidArgument(other.to_string())),
        })
        .collect();
    (kept, skipped)
}

/// Like [`applicable_specs`], for the analysis that `options` asks for: with
/// [`Options::cache`], a spec the cache cannot hold (per-tensor ranges without a calibration,
/// a fitted codebook, per-channel groups other than the block) is skipped too, with the
/// cache's reason.
pub fn applicable_with(
    layers: &[LayerInput],
    specs: Vec<KvSpec>,
    options: &Options,
) -> (Vec<KvSpec>, Vec<(KvSpec, AnalyzeError)>) {
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for spec in specs {
        let blocked = spec.for_block(options.block_size);
        let problem = layers.iter().find_map(|l| {
            let spec_err = |source| AnalyzeError::Spec { layer: l.name.clone(), spec: spec.name(), source };
            if let Err(e) = blocked
                .k
                .check_shape(l.k.shape())
                .and_then(|()| blocked.v.check_shape(l.v.shape()))
                .and_then(|()| check_channel_bits(l, &blocked.k, options.positions))
            {
                return Some(spec_err(e));
            }
            let run = options.cache?;
            let config = run.config(l, &blocked, options.block_size, None, options.rope.as_ref());
            config.err().map(|source| AnalyzeError::Cache {
                layer: l.name.clone(),
                spec: spec.name(),
                source,
            })
        });
        match problem {
            Some(e) => skipped.push((spec, e)),
            None => kept.push(spec),
        }
    }
    (kept, skipped)
}

/// A shape in reports: `{batch, heads, tokens, head_dim}` (the report's wire form; `Shape`
/// itself carries no serde, so that its layout is no file format).
fn shape_wire<S: serde::Serializer>(shape: &Shape, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeStruct;
    let mut st = s.serialize_struct("Shape", 4)?;
    st.serialize_field("batch", &shape.batch)?;
    st.serialize_field("heads", &shape.heads)?;
    st.serialize_field("tokens", &shape.tokens)?;
    st.serialize_field("head_dim", &shape.head_dim)?;
    st.end()
}

/// The Q, K and V of one layer.
#[derive(Debug, Clone)]
pub struct LayerInput {
    /// Layer name (`layer9`).
    pub name: String,
    /// Queries `[batch, query heads, tokens, head_dim]`.
    pub q: Tensor,
    /// Keys `[batch, kv heads, tokens, head_dim]`.
    pub k: Tensor,
    /// Values, shaped like the keys.
    pub v: Tensor,
}

/// Every `layer{L}` with `.q`, `.k` and `.v` tensors in `file`, ordered by `L`.
///
/// # Errors
/// [`AnalyzeError::File`] for unreadable tensors, [`AnalyzeError::NoLayers`] when none match.
pub fn layers_from_file(file: &TensorFile) -> Result<Vec<LayerInput>, AnalyzeError> {
    let mut ids: Vec<u64> = file
        .list()
        .iter()
        .filter_map(|t| t.name.strip_prefix("layer")?.strip_suffix(".k")?.parse().ok())
        .collect();
    ids.sort_unstable();
    let mut layers = Vec::new();
    for id in ids {
        let name = format!("layer{id}");
        if !file.contains(&format!("{name}.q")) || !file.contains(&format!("{name}.v")) {
            continue;
        }
        let read = |suffix: &str| file.read(&format!("{name}.{suffix}"));
        layers.push(LayerInput { q: read("q")?, k: read("k")?, v: read("v")?, name });
    }
    if layers.is_empty() {
        return Err(AnalyzeError::NoLayers(file.label().to_string()));
    }
    Ok(layers)
}

/// The seed's synthetic benchmark: standard normal K, V and Q shaped `[1, 32, 512, 128]`
/// (MHA), from fixed seeds.
pub fn synthetic_layer() -> LayerInput {
    let shape = Shape::with_batch(1, 32, 512, 128);
    LayerInput {
        name: "synthetic".into(),
        k: normal_tensor(shape, 1),
        v: normal_tensor(shape, 2),
        q: normal_tensor(shape, 3),
    }
}

/// Analysis settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Number of query positions at which attention is compared, spread evenly over the second
    /// half of the sequence (the last position included).
    pub positions: usize,
    /// Also measure every KV head on its own ([`Row::heads`]).
    pub per_head: bool,
    /// Bins of the error histograms kept per row ([`Row::k_hist`]); 0 keeps none.
    pub histogram_bins: usize,
    /// Tokens per block of the cache being predicted: per-channel specs without a token group
    /// (`int4-channel`) are analyzed as `channel{block_size}`, as the cache stores them
    /// ([`KvSpec::for_block`]). The default is the cache's default block,
    /// [`KvCacheConfig::builder`]'s 32.
    pub block_size: usize,
    /// Run the data through a [`QuantizedKvCache`] with blocks of [`Options::block_size`]
    /// tokens instead of quantizing whole tensors offline; `None` (the default) quantizes
    /// offline.
    pub cache: Option<CacheRun>,
    /// Which key channels rotate together under RoPE, for specs with bits per channel
    /// (`-qa`): both channels of a pair get the same width. The default, rotate-half, is the
    /// layout of Hugging Face checkpoints and of dumps taken from them (the snippet in docs/guide.md);
    /// `None` treats every channel on its own.
    pub rope_pairing: Option<RopePairing>,
    /// The model's RoPE, for key specs quantized before it (`-prerope`): the keys are taken
    /// out of RoPE (token `j` at position `j`), quantized, and rotated back. `kvq analyze`
    /// reads it from the file's `rope.inv_freq` or builds it from `--rope-theta`; without it
    /// such specs are an error.
    pub rope: Option<Rope>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            positions: 32,
            per_head: false,
            histogram_bins: 0,
            block_size: DEFAULT_BLOCK_SIZE,
            cache: None,
            rope_pairing: Some(RopePairing::Half),
            rope: None,
        }
    }
}

/// How the analysis runs data through a [`QuantizedKvCache`] ([`Options::cache`]): what
/// the cache keeps in full precision (f16), which the numbers then include, errors and bits
/// alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CacheRun {
    /// Full-precision blocks kept after the quantized ones (KIVI's residual window), as
    /// [`KvCacheConfig::residual_blocks`].
    pub residual_blocks: usize,
    /// Leading tokens kept in full precision, as [`KvCacheConfig::sink_tokens`].
    pub sink_tokens: usize,
    /// Per-token and `gN` specs keep the residual window too, as [`KvCacheConfig::row_window`].
    pub row_window: bool,
    /// Storage type of the window and sinks, as [`KvCacheConfig::tail_dtype`].
    pub tail_dtype: TailDtype,
    /// The values' own, as [`KvCacheConfig::value_tail_dtype`].
    pub value_tail_dtype: Option<TailDtype>,
}

impl Default for CacheRun {
    /// The cache's defaults ([`KvCacheConfig::builder`]): one residual block, 4 sinks, row
    /// specs quantized as they arrive; but the window and sinks in f16 for values too (the
    /// builder keeps the values' in 8 bits), as the measurements in docs/ were taken.
    fn default() -> Self {
        Self {
            residual_blocks: DEFAULT_RESIDUAL_BLOCKS,
            sink_tokens: DEFAULT_SINK_TOKENS,
            row_window: false,
            tail_dtype: TailDtype::F16,
            value_tail_dtype: None,
        }
    }
}

impl CacheRun {
    /// A one-layer cache config for `layer` under `spec` with room for every batch entry's
    /// whole sequence; a `-qa` key spec takes `maps` (uniform widths when `None`: enough to
    /// check that the cache can hold the spec).
    fn config(
        &self,
        layer: &LayerInput,
        spec: &KvSpec,
        block_size: usize,
        maps: Option<Vec<ChannelBits>>,
        rope: Option<&Rope>,
    ) -> Result<KvCacheConfig, KvqError> {
        let (ks, qs) = (layer.k.shape(), layer.q.shape());
        // Blocks hold one head's tokens.
        let per_seq = ks.tokens.div_ceil(block_size.max(1)) + self.residual_blocks + 1;
        let mut builder = KvCacheConfig::builder(1, ks.heads, qs.heads, ks.head_dim)
            .specs(spec.k.clone(), spec.v.clone())
            .block_size(block_size)
            .residual_blocks(self.residual_blocks)
            .sink_tokens(self.sink_tokens)
            .row_window(self.row_window)
            .tail_dtypes(self.tail_dtype, self.value_tail_dtype)
            .blocks_per_layer(per_seq.saturating_mul(ks.batch).saturating_mul(ks.heads));
        if spec.k.channel_bits() {
            let maps = match maps {
                Some(m) => m,
                None => (0..ks.heads)
                    .map(|_| ChannelBits::uniform(ks.head_dim, spec.k.bits()))
                    .collect::<Result<_, _>>()
                    .map_err(|e| KvqError::Config(e.to_string()))?,
            };
            builder = builder.channel_bits(0, maps);
        }
        if let (true, Some(rope)) = (spec.k.pre_rope(), rope) {
            builder = builder.rope(rope.clone());
        }
        builder.build()
    }
}

/// Counts of `x̂ − x` in equal bins over `[-limit, limit]`, where `limit` is the largest absolute
/// error (so every element lands in a bin).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Histogram {
    /// Half-width of the binned range.
    pub limit: f64,
    /// Elements per bin, from `-limit` up.
    pub counts: Vec<u64>,
}

impl Histogram {
    /// The histogram of `approx − reference` in `bins` bins.
    pub fn of_errors(reference: &[f32], approx: &[f32], bins: usize) -> Self {
        let limit =
            reference.iter().zip(approx).map(|(&r, &a)| (a as f64 - r as f64).abs()).fold(0.0, f64::max);
        let mut counts = vec![0u64; bins.max(1)];
        let n = counts.len();
        for (&r, &a) in reference.iter().zip(approx) {
            let e = a as f64 - r as f64;
            let i = if limit > 0.0 { ((e + limit) / (2.0 * limit) * n as f64) as usize } else { n / 2 };
            counts[i.min(n - 1)] += 1;
        }
        Self { limit, counts }
    }
}

/// One KV head of a layer under one spec.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HeadRow {
    /// The KV head.
    pub kv_head: usize,
    /// MSE of this head's keys.
    pub k_mse: f64,
    /// MSE of this head's values.
    pub v_mse: f64,
    /// Relative L2 attention-output error of the query heads that read this KV head.
    pub attn_rel_err: f64,
    /// Their mean KL divergence (nats).
    pub attn_kl: f64,
}

/// `n` query positions spread evenly over the second half of `tokens`, ending at the last.
pub fn query_positions(tokens: usize, n: usize) -> Vec<usize> {
    if tokens == 0 || n == 0 {
        return Vec::new();
    }
    let first = tokens / 2;
    let span = tokens - 1 - first;
    let n = n.min(span + 1);
    if n == 1 {
        return vec![tokens - 1];
    }
    (0..n).map(|i| first + i * span / (n - 1)).collect()
}

/// One line of the table: a spec on a layer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    /// The spec's name (`KSPEC/VSPEC` when they differ).
    pub spec: String,
    /// Bits per element of K and V together, parameters included.
    pub bits_per_element: f64,
    /// MSE of the keys.
    pub k_mse: f64,
    /// MSE of the values.
    pub v_mse: f64,
    /// Cosine similarity of the keys.
    pub k_cosine: f64,
    /// Relative L2 error of the attention outputs with quantized K and V.
    pub attn_rel_err: f64,
    /// Mean KL divergence of the attention probabilities (nats).
    pub attn_kl: f64,
    /// Bytes of K and V in f16 divided by their quantized bytes.
    pub ratio_vs_f16: f64,
    /// Per KV head, when [`Options::per_head`] is set.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub heads: Vec<HeadRow>,
    /// Histogram of the key errors, when [`Options::histogram_bins`] is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k_hist: Option<Histogram>,
    /// Histogram of the value errors, likewise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub v_hist: Option<Histogram>,
}

/// The rows of one layer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LayerReport {
    /// Layer name.
    pub layer: String,
    /// Shape of K (and V).
    #[serde(serialize_with = "shape_wire")]
    pub kv_shape: Shape,
    /// Query heads.
    pub query_heads: usize,
    /// Query positions of the attention comparison.
    pub positions: Vec<usize>,
    /// One row per spec.
    pub rows: Vec<Row>,
}

/// The analysis of a file (or the synthetic benchmark).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// What was analyzed.
    pub source: String,
    /// Tokens per cache block ([`Options::block_size`]): the group of `channel` specs.
    pub block_size: usize,
    /// How the data went through a cache ([`Options::cache`]); `None` for offline
    /// quantization.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheRun>,
    /// One entry per layer.
    pub layers: Vec<LayerReport>,
}

/// Analyzes every layer with every spec. `progress` is called after each layer with
/// `(layers done, layers in all)`.
///
/// # Errors
/// [`AnalyzeError::Layer`] when a layer's tensors cannot be compared, [`AnalyzeError::Spec`]
/// when a spec cannot quantize them.
pub fn analyze(
    source: &str,
    layers: &[LayerInput],
    specs: &[KvSpec],
    options: &Options,
    mut progress: impl FnMut(usize, usize),
) -> Result<Report, AnalyzeError> {
    let specs: Vec<KvSpec> = specs.iter().map(|s| s.for_block(options.block_size)).collect();
    let mut out = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        out.push(analyze_layer(layer, &specs, options)?);
        progress(i + 1, layers.len());
    }
    Ok(Report {
        source: source.to_string(),
        block_size: options.block_size,
        cache: options.cache,
        layers: out,
    })
}

fn analyze_layer(
    layer: &LayerInput,
    specs: &[KvSpec],
    options: &Options,
) -> Result<LayerReport, AnalyzeError> {
    let layer_err = |source| AnalyzeError::Layer { layer: layer.name.clone(), source };
    let positions = query_positions(layer.k.shape().tokens, options.positions);
    let reference = attention(&layer.q, &layer.k, &layer.v, &positions).map_err(layer_err)?;
    let rows = specs
        .par_iter()
        .map(|spec| analyze_spec(layer, spec, &positions, &reference, options))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(LayerReport {
        layer: layer.name.clone(),
        kv_shape: layer.k.shape(),
        query_heads: layer.q.shape().heads,
        positions,
        rows,
    })
}

/// What a spec made of a layer: the keys and values given back (as the quantizer or the
/// cache holds them once every token is in), the attention at the query positions, and the
/// memory they took.
struct Reconstruction {
    k_hat: Tensor,
    v_hat: Tensor,
    approx: AttentionOutputs,
    bits_per_element: f64,
    ratio_vs_f16: f64,
}

fn offline(
    layer: &LayerInput,
    spec: &KvSpec,
    positions: &[usize],
    options: &Options,
) -> Result<Reconstruction, QuantError> {
    if spec.v.pre_rope() {
        return Err(QuantError::InvalidSpec(format!("V spec {}: values do not go through RoPE", spec.v)));
    }
    // Keys quantized before RoPE: the same quantizer on the keys taken out of it (and, for the
    // query energy that `-qa` weights channels by, the queries too).
    let pre = if spec.k.pre_rope() {
        let rope = options.rope.as_ref().ok_or_else(|| {
            QuantError::InvalidArgument(format!(
                "{}: keys quantized before RoPE need the model's frequencies and channel pairs (a rope.inv_freq tensor in the file or --rope-theta, and --rope-pairing half or interleaved)",
                spec.k
            ))
        })?;
        let (k, q) = (rope.undo(&layer.k, 0)?, rope.undo(&layer.q, 0)?);
        Some((LayerInput { k, q, ..layer.clone() }, rope))
    } else {
        None
    };
    let (keys, k_spec) = match &pre {
        Some((l, _)) => (l, spec.k.clone().with_pre_rope(false)),
        None => (layer, spec.k.clone()),
    };
    let (k_hat, k_memory) = if k_spec.channel_bits() {
        let maps = fit_channel_bits(keys, &k_spec, positions, options.rope_pairing)?;
        let qk = quantize_channel_bits(&keys.k, &k_spec, &maps)?;
        (qk.dequantize(), qk.memory())
    } else {
        let qk = quantize(&keys.k, &k_spec)?;
        (qk.dequantize(), qk.memory())
    };
    let k_hat = match &pre {
        Some((_, rope)) => rope.apply(&k_hat, 0)?,
        None => k_hat,
    };
    let qv = quantize(&layer.v, &spec.v)?;
    let v_hat = qv.dequantize();
    let approx = attention(&layer.q, &k_hat, &v_hat, positions)?;
    let memory = k_memory.combine(&qv.memory());
    Ok(Reconstruction {
        k_hat,
        v_hat,
        approx,
        bits_per_element: memory.bits_per_element(),
        ratio_vs_f16: memory.ratio_vs_f16(),
    })
}

/// Whether a `-qa` key spec can be fitted on `layer` (a `head_dim` of whole 8-channel units,
/// a prefix before the first of `positions` query positions holding a whole token group);
/// `Ok` for any other spec.
fn check_channel_bits(layer: &LayerInput, spec: &QuantSpec, positions: usize) -> Result<(), QuantError> {
    if !spec.channel_bits() {
        return Ok(());
    }
    let s = layer.k.shape();
    if !s.head_dim.is_multiple_of(kvq_quant_core::channel_bits::UNIT) {
        return Err(QuantError::InvalidArgument(format!(
            "{spec}: bits per channel go to units of {} channels; head_dim {} is not a multiple",
            kvq_quant_core::channel_bits::UNIT,
            s.head_dim
        )));
    }
    let prefix = query_positions(s.tokens, positions).first().copied().unwrap_or(0);
    let group = match spec.granularity() {
        Granularity::PerChannel { token_group: Some(n) } => n,
        _ => s.tokens,
    };
    if prefix < group {
        return Err(QuantError::InvalidArgument(format!(
            "{spec}: the {prefix} tokens before the first query position hold no whole group of {group} to fit the bits on"
        )));
    }
    Ok(())
}

/// One bit map per KV head for a `-qa` key spec, fitted on the tokens before the first query
/// position (the first half of the sequence with [`query_positions`]): those tokens' keys, and
/// the mean squared query per channel over the query heads that read the head. No token whose
/// attention is measured takes part in the fit.
///
/// # Errors
/// [`QuantError::InvalidArgument`] when the prefix holds no whole token group, and the errors
/// of [`ChannelBits::fit`].
pub fn fit_channel_bits(
    layer: &LayerInput,
    spec: &QuantSpec,
    positions: &[usize],
    pairing: Option<RopePairing>,
) -> Result<Vec<ChannelBits>, QuantError> {
    let tokens = layer.k.shape().tokens;
    let prefix = positions.first().copied().unwrap_or(tokens).min(tokens);
    kvq_quant_core::channel_bits::fit_heads(&layer.k.prefix(prefix)?, &layer.q.prefix(prefix)?, spec, pairing)
}

/// Appends the layer's tokens to a [`QuantizedKvCache`] one batch entry per sequence, and
/// computes each query position's attention from what the cache holds once that token is in
/// (its residual window and sinks still full precision). Memory is everything the cache
/// holds at the end: codes, parameters, full-precision tails and sinks, block tables.
fn through_cache(
    layer: &LayerInput,
    spec: &KvSpec,
    positions: &[usize],
    options: &Options,
    run: &CacheRun,
) -> Result<Reconstruction, AnalyzeError> {
    let cache_err = |source| AnalyzeError::Cache { layer: layer.name.clone(), spec: spec.name(), source };
    let spec_err = |source| AnalyzeError::Spec { layer: layer.name.clone(), spec: spec.name(), source };
    let maps = if spec.k.channel_bits() {
        Some(fit_channel_bits(layer, &spec.k, positions, options.rope_pairing).map_err(spec_err)?)
    } else {
        None
    };
    let config =
        run.config(layer, spec, options.block_size, maps, options.rope.as_ref()).map_err(cache_err)?;
    let mut cache = QuantizedKvCache::new(config).map_err(cache_err)?;
    let s = layer.k.shape();
    let seqs: Vec<_> = (0..s.batch).map(|_| cache.create()).collect();
    let tokens_of = |t: &Tensor, b: usize, from: usize, to: usize| {
        let mut data = Vec::with_capacity(s.heads * (to - from) * s.head_dim);
        for h in 0..s.heads {
            for tok in from..to {
                data.extend_from_slice(t.row(b, h, tok));
            }
        }
        Tensor::new(Shape::new(s.heads, to - from, s.head_dim), data)
    };
    let fill = |cache: &mut QuantizedKvCache, from: usize, to: usize| -> Result<(), AnalyzeError> {
        if to > from {
            for (b, &seq) in seqs.iter().enumerate() {
                let k = tokens_of(&layer.k, b, from, to).map_err(spec_err)?;
                let v = tokens_of(&layer.v, b, from, to).map_err(spec_err)?;
                cache.extend(seq, 0, &k, &v).map_err(cache_err)?;
            }
        }
        Ok(())
    };
    let mut done = 0;
    let held = |cache: &QuantizedKvCache, part: Part| -> Result<Tensor, AnalyzeError> {
        let paged = cache.layer(0).expect("a one-layer cache");
        let mut data = Vec::new();
        let mut len = 0;
        for &seq in &seqs {
            for h in 0..s.heads {
                let rows = paged.dequantize(seq, h, part).map_err(cache_err)?;
                len = rows.len() / s.head_dim.max(1);
                data.extend_from_slice(&rows);
            }
        }
        Tensor::new(Shape::with_batch(s.batch, s.heads, len, s.head_dim), data).map_err(spec_err)
    };
    let mut parts = Vec::with_capacity(positions.len());
    for &p in positions {
        if p < done {
            // The cache cannot go back: positions must ascend (query_positions' do).
            return Err(spec_err(QuantError::InvalidArgument(format!("query position {p} after {done}"))));
        }
        fill(&mut cache, done, p + 1)?;
        done = p + 1;
        let (k_hat, v_hat) = (held(&cache, Part::K)?, held(&cache, Part::V)?);
        let q = layer.q.prefix(p + 1).map_err(spec_err)?;
        parts.push(attention(&q, &k_hat, &v_hat, &[p]).map_err(spec_err)?);
    }
    fill(&mut cache, done, s.tokens)?;
    let (k_hat, v_hat) = (held(&cache, Part::K)?, held(&cache, Part::V)?);
    let approx = AttentionOutputs::concat(&parts).map_err(spec_err)?;
    let used = cache.used_bytes() as f64;
    let values = 2.0 * layer.k.data().len() as f64;
    Ok(Reconstruction {
        k_hat,
        v_hat,
        approx,
        bits_per_element: used * 8.0 / values,
        ratio_vs_f16: values * 2.0 / used,
    })
}

fn analyze_spec(
    layer: &LayerInput,
    spec: &KvSpec,
    positions: &[usize],
    reference: &AttentionOutputs,
    options: &Options,
) -> Result<Row, AnalyzeError> {
    let spec_err = |source| AnalyzeError::Spec { layer: layer.name.clone(), spec: spec.name(), source };
    let r = match &options.cache {
        None => offline(layer, spec, positions, options).map_err(spec_err)?,
        Some(run) => through_cache(layer, spec, positions, options, run)?,
    };
    let ke = error_stats(layer.k.data(), r.k_hat.data()).map_err(spec_err)?;
    let ve = error_stats(layer.v.data(), r.v_hat.data()).map_err(spec_err)?;
    let ae = compare_attention(reference, &r.approx).map_err(spec_err)?;
    let heads = if options.per_head {
        per_head(layer, &r.k_hat, &r.v_hat, reference, &r.approx).map_err(spec_err)?
    } else {
        Vec::new()
    };
    let hist = |x: &Tensor, a: &Tensor| {
        (options.histogram_bins > 0).then(|| Histogram::of_errors(x.data(), a.data(), options.histogram_bins))
    };
    Ok(Row {
        spec: spec.name(),
        bits_per_element: r.bits_per_element,
        k_mse: ke.mse,
        v_mse: ve.mse,
        k_cosine: ke.cosine,
        attn_rel_err: ae.output_rel_l2,
        attn_kl: ae.kl_mean,
        ratio_vs_f16: r.ratio_vs_f16,
        heads,
        k_hist: hist(&layer.k, &r.k_hat),
        v_hist: hist(&layer.v, &r.v_hat),
    })
}

/// Element and attention errors of each KV head on its own.
fn per_head(
    layer: &LayerInput,
    k_hat: &Tensor,
    v_hat: &Tensor,
    reference: &AttentionOutputs,
    approx: &AttentionOutputs,
) -> Result<Vec<HeadRow>, QuantError> {
    let s = layer.k.shape();
    let group = layer.q.shape().heads / s.heads;
    let attn = compare_attention_grouped(reference, approx, group)?;
    let head_mse = |x: &Tensor, y: &Tensor, h: usize| {
        let span = s.tokens * s.head_dim;
        let (mut e2, mut n) = (0f64, 0usize);
        for b in 0..s.batch {
            let at = (b * s.heads + h) * span;
            for (&r, &a) in x.data()[at..at + span].iter().zip(&y.data()[at..at + span]) {
                e2 += (a as f64 - r as f64).powi(2);
                n += 1;
            }
        }
        e2 / n.max(1) as f64
    };
    Ok(attn
        .into_iter()
        .enumerate()
        .map(|(h, a)| HeadRow {
            kv_head: h,
            k_mse: head_mse(&layer.k, k_hat, h),
            v_mse: head_mse(&layer.v, v_hat, h),
            attn_rel_err: a.output_rel_l2,
            attn_kl: a.kl_mean,
        })
        .collect())
}

impl Report {
    /// The report as a plain-text table, one block per layer.
    pub fn to_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "source: {}", self.source);
        if let Some(run) = self.cache {
            let block = self.block_size;
            let _ = writeln!(
                s,
                "through QuantizedKvCache: blocks of {block} tokens, {} residual block(s){}, {} sink token(s) in {} (counted in bits)",
                run.residual_blocks,
                if run.row_window { " for every part" } else { "" },
                run.sink_tokens,
                crate::cache::tail_dtypes_text(run.tail_dtype, run.value_tail_dtype)
            );
        }
        for layer in &self.layers {
            let _ = writeln!(
                s,
                "\n{}: K/V {}, {} query heads, attention at {} positions ({}..={})",
                layer.layer,
                layer.kv_shape,
                layer.query_heads,
                layer.positions.len(),
                layer.positions.first().copied().unwrap_or(0),
                layer.positions.last().copied().unwrap_or(0),
            );
            let w = layer.rows.iter().map(|r| r.spec.len()).max().unwrap_or(0).max(26);
            let _ = writeln!(
                s,
                "{:<w$} {:>6} {:>10} {:>10} {:>9} {:>10} {:>10} {:>7}",
                "spec", "bits", "K MSE", "V MSE", "K cos", "attn err", "attn KL", "vs f16"
            );
            for r in &layer.rows {
                let _ = writeln!(
                    s,
                    "{:<w$} {:>6.3} {:>10.3e} {:>10.3e} {:>9.6} {:>10.3e} {:>10.3e} {:>6.2}x",
                    r.spec,
                    r.bits_per_element,
                    r.k_mse,
                    r.v_mse,
                    r.k_cosine,
                    r.attn_rel_err,
                    r.attn_kl,
                    r.ratio_vs_f16
                );
                for h in &r.heads {
                    let _ = writeln!(
                        s,
                        "{:<w$} {:>6} {:>10.3e} {:>10.3e} {:>9} {:>10.3e} {:>10.3e}",
                        format!("  kv head {}", h.kv_head),
                        "",
                        h.k_mse,
                        h.v_mse,
                        "",
                        h.attn_rel_err,
                        h.attn_kl,
                    );
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_cover_the_second_half() {
        assert_eq!(query_positions(10, 3), vec![5, 7, 9]);
        assert_eq!(query_positions(10, 100), vec![5, 6, 7, 8, 9]);
        assert_eq!(query_positions(1, 4), vec![0]);
        assert_eq!(query_positions(0, 4), Vec::<usize>::new());
    }

    fn sample_layer0() -> LayerInput {
        let file = TensorFile::from_bytes("sample", crate::SAMPLE.to_vec()).unwrap();
        layers_from_file(&file).unwrap().remove(0)
    }

    fn one_row(layer: &LayerInput, spec: &str, options: &Options) -> Row {
        let spec = KvSpec::parse(spec).unwrap();
        let mut report = analyze("sample", std::slice::from_ref(layer), &[spec], options, |_, _| {}).unwrap();
        report.layers.remove(0).rows.remove(0)
    }

    #[test]
    fn a_cache_holding_every_token_in_f16_is_exact() {
        // The sample is f16 data, which the cache's f16 sinks hold exactly; their bytes count.
        let layer = sample_layer0();
        let run = CacheRun { residual_blocks: 0, sink_tokens: layer.k.shape().tokens, ..CacheRun::default() };
        let options = Options { positions: 5, cache: Some(run), ..Options::default() };
        let row = one_row(&layer, "int2-channel/int2-token", &options);
        assert_eq!((row.k_mse, row.v_mse, row.attn_rel_err, row.attn_kl), (0.0, 0.0, 0.0, 0.0));
        assert!(row.bits_per_element >= 16.0 && row.ratio_vs_f16 <= 1.0, "{row:?}");
    }

    #[test]
    fn a_cache_without_full_precision_tokens_holds_what_the_quantizer_gives() {
        // 256 tokens are 8 full blocks: with no residual window and no sinks the cache ends up
        // holding exactly the offline codes, and the last position (its block just full)
        // sees them; only the block tables add bytes.
        let layer = sample_layer0();
        let offline = Options { positions: 1, ..Options::default() };
        let cached = Options {
            cache: Some(CacheRun { residual_blocks: 0, sink_tokens: 0, ..CacheRun::default() }),
            ..offline.clone()
        };
        for spec in ["int4-channel/int4-token", "int2-channel-mse/int3-token-mse-rot", "int4-g16"] {
            let (a, b) = (one_row(&layer, spec, &offline), one_row(&layer, spec, &cached));
            assert_eq!(
                (a.k_mse, a.v_mse, a.attn_rel_err, a.attn_kl),
                (b.k_mse, b.v_mse, b.attn_rel_err, b.attn_kl)
            );
            assert!(
                b.bits_per_element > a.bits_per_element && b.bits_per_element < a.bits_per_element + 0.01
            );
        }
        // With the defaults the sinks and recent tokens are exact: less key error, more bits.
        let options = Options { positions: 8, cache: Some(CacheRun::default()), ..Options::default() };
        let (a, b) = (
            one_row(&layer, "int2-channel/int2-token", &Options { positions: 8, ..offline }),
            one_row(&layer, "int2-channel/int2-token", &options),
        );
        assert!(b.k_mse < a.k_mse && b.bits_per_element > a.bits_per_element + 0.5, "{a:?} {b:?}");
    }

    #[test]
    fn specs_the_cache_cannot_hold_are_skipped_with_its_reason() {
        let layers = [sample_layer0()];
        let options = Options { cache: Some(CacheRun::default()), ..Options::default() };
        let (kept, skipped) = applicable_with(&layers, default_specs(), &options);
        assert_eq!(kept.len() + skipped.len(), default_specs().len());
        assert!(
            skipped.iter().all(|(s, e)| {
                let static_ranges =
                    s.k.to_string().ends_with("-tensor") || s.k.to_string().ends_with("-head");
                static_ranges && matches!(e, AnalyzeError::Cache { .. })
            }),
            "{skipped:?}"
        );
        assert_eq!(skipped.len(), 6);
        let (all, none) = applicable_with(&layers, default_specs(), &Options::default());
        assert_eq!((all.len(), none.len()), (default_specs().len(), 0));
        let spec = KvSpec::parse("int4-tensor").unwrap();
        let err = analyze("sample", &layers, &[spec], &options, |_, _| {}).unwrap_err();
        assert!(
            matches!(err, AnalyzeError::Cache { .. }) && err.to_string().contains("calibration"),
            "{err}"
        );
    }

    #[test]
    fn keys_before_rope_need_the_models_rope_and_are_measured_at_the_same_bits() {
        let layer = sample_layer0();
        let err = |spec: &str, options: &Options| {
            let spec = KvSpec::parse(spec).unwrap();
            analyze("sample", std::slice::from_ref(&layer), &[spec], options, |_, _| {}).unwrap_err()
        };
        let e = err("int4-channel-prerope/int4-token", &Options::default());
        assert!(matches!(e, AnalyzeError::Spec { .. }) && e.to_string().contains("frequencies"), "{e}");
        let d = layer.k.shape().head_dim;
        let rope = Rope::from_theta(100_000.0, d, RopePairing::Half).unwrap();
        let options = Options { positions: 8, rope: Some(rope), ..Options::default() };
        let e = err("int4-channel/int4-token-prerope", &options);
        assert!(e.to_string().contains("values do not go through RoPE"), "{e}");
        let plain = one_row(&layer, "int2-channel/int8-token", &options);
        let pre = one_row(&layer, "int2-channel-prerope/int8-token", &options);
        assert_eq!(pre.bits_per_element, plain.bits_per_element);
        assert!(pre.attn_kl != plain.attn_kl && pre.attn_kl.is_finite(), "{pre:?}");
        // Through the cache, with its residual window and sinks: the same bits as the plain
        // keys there, and an error that is not the plain keys' error.
        let cached = Options { cache: Some(CacheRun::default()), ..options };
        let plain = one_row(&layer, "int2-channel/int8-token", &cached);
        let pre = one_row(&layer, "int2-channel-prerope/int8-token", &cached);
        assert_eq!(pre.bits_per_element, plain.bits_per_element);
        assert!(pre.attn_kl != plain.attn_kl && pre.attn_kl.is_finite(), "{pre:?}");
        // Without the frequencies the cache refuses them, with its reason.
        let blind = Options { rope: None, ..cached };
        assert!(matches!(err("int4-channel-prerope/int4-token", &blind), AnalyzeError::Cache { .. }));
    }

    #[test]
    fn kv_spec_names_round_trip() {
        for s in ["int4-channel/int4-token", "int8-tensor", "fp8e4m3-token", "nf4-token"] {
            assert_eq!(KvSpec::parse(s).unwrap().name(), s);
        }
        assert_eq!(default_specs().len(), 23);
        let p8 = KvSpec::parse("int4-channel-p8/int4-token").unwrap();
        assert_eq!(p8.for_block(32).name(), "int4-channel32-p8/int4-token");
        let whole = KvSpec::parse("int4-channel-mse/int2-channel-rot").unwrap();
        assert_eq!(whole.for_block(64).name(), "int4-channel64-mse/int2-channel64-rot");
        let fixed = KvSpec::parse("int4-channel16/int4-token").unwrap();
        assert_eq!(fixed.for_block(64), fixed);
    }
}
