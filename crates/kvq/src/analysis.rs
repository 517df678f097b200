//! `kvq analyze`: how much each quantization spec damages a model's keys, values and
//! attention, and what it saves.
//!
//! For every layer and every [`KvSpec`] the keys and values are quantized offline, compared
//! element-wise with the originals, and attention is recomputed in f64 with the quantized K
//! and V at a spread of query positions.

use std::fmt::Write as _;

use kvq_quant_core::io::{TensorFile, TensorFileError};
use kvq_quant_core::metrics::{
    AttentionOutputs, attention, compare_attention, compare_attention_grouped, error_stats,
};
use kvq_quant_core::synth::normal_tensor;
use kvq_quant_core::{Granularity, QuantError, QuantSpec, Shape, Tensor, quantize};
use rayon::prelude::*;

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
/// per-token values (INT4 and INT2 also with rotated values in error-minimizing ranges), and groups of
/// 32; FP8 e4m3 and NF4 per token. Per-channel keys group over the cache's block
/// ([`Options::block_size`]).
pub fn default_specs() -> Vec<KvSpec> {
    let mut out = Vec::new();
    for bits in [8, 4, 2] {
        let mut forms = vec!["tensor", "head", "channel/int{b}-token"];
        if bits < 8 {
            forms.push("channel/int{b}-token-mse-rot");
        }
        forms.push("g32");
        for s in forms {
            let text = format!("int{bits}-{}", s.replace("{b}", &bits.to_string()));
            out.push(KvSpec::parse(&text).expect("built-in specs parse"));
        }
    }
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
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for spec in specs {
        let problem = layers.iter().find_map(|l| {
            spec.k.check_shape(l.k.shape()).and_then(|()| spec.v.check_shape(l.v.shape())).err()
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
    /// [`KvCacheConfig::builder`](crate::cache::KvCacheConfig::builder)'s 32.
    pub block_size: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self { positions: 32, per_head: false, histogram_bins: 0, block_size: 32 }
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
    Ok(Report { source: source.to_string(), layers: out })
}

fn analyze_layer(
    layer: &LayerInput,
    specs: &[KvSpec],
    options: &Options,
) -> Result<LayerReport, AnalyzeError> {
    let layer_err = |source| AnalyzeError::Layer { layer: layer.name.clone(), source };
    let positions = query_positions(layer.k.shape().tokens, options.positions);
    let reference = attention(&layer.q, &layer.k, &layer.v, &positions).map_err(layer_err)?;
    let rows =
        specs
            .par_iter()
            .map(|spec| {
                analyze_spec(layer, spec, &positions, &reference, options).map_err(|source| {
                    AnalyzeError::Spec { layer: layer.name.clone(), spec: spec.name(), source }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
    Ok(LayerReport {
        layer: layer.name.clone(),
        kv_shape: layer.k.shape(),
        query_heads: layer.q.shape().heads,
        positions,
        rows,
    })
}

fn analyze_spec(
    layer: &LayerInput,
    spec: &KvSpec,
    positions: &[usize],
    reference: &AttentionOutputs,
    options: &Options,
) -> Result<Row, QuantError> {
    let qk = quantize(&layer.k, &spec.k)?;
    let qv = quantize(&layer.v, &spec.v)?;
    let (k_hat, v_hat) = (qk.dequantize(), qv.dequantize());
    let ke = error_stats(layer.k.data(), k_hat.data())?;
    let ve = error_stats(layer.v.data(), v_hat.data())?;
    let approx = attention(&layer.q, &k_hat, &v_hat, positions)?;
    let ae = compare_attention(reference, &approx)?;
    let memory = qk.memory().combine(&qv.memory());
    let heads =
        if options.per_head { per_head(layer, &k_hat, &v_hat, reference, &approx)? } else { Vec::new() };
    let hist = |r: &Tensor, a: &Tensor| {
        (options.histogram_bins > 0).then(|| Histogram::of_errors(r.data(), a.data(), options.histogram_bins))
    };
    Ok(Row {
        spec: spec.name(),
        bits_per_element: memory.bits_per_element(),
        k_mse: ke.mse,
        v_mse: ve.mse,
        k_cosine: ke.cosine,
        attn_rel_err: ae.output_rel_l2,
        attn_kl: ae.kl_mean,
        ratio_vs_f16: memory.ratio_vs_f16(),
        heads,
        k_hist: hist(&layer.k, &k_hat),
        v_hist: hist(&layer.v, &v_hat),
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

    #[test]
    fn kv_spec_names_round_trip() {
        for s in ["int4-channel/int4-token", "int8-tensor", "fp8e4m3-token", "nf4-token"] {
            assert_eq!(KvSpec::parse(s).unwrap().name(), s);
        }
        assert_eq!(default_specs().len(), 16);
        let whole = KvSpec::parse("int4-channel-mse/int2-channel-rot").unwrap();
        assert_eq!(whole.for_block(64).name(), "int4-channel64-mse/int2-channel64-rot");
        let fixed = KvSpec::parse("int4-channel16/int4-token").unwrap();
        assert_eq!(fixed.for_block(64), fixed);
    }
}
