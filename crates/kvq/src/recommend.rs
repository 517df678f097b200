//! `kvq recommend`: per-layer K and V specs that minimize attention error under an average
//! bit budget, metadata counted.
//!
//! Every candidate is measured on every layer (bits per value of K and V together, and the
//! relative error of attention outputs, as `kvq analyze` reports them). The choice starts from
//! each layer's cheapest candidate and repeatedly takes the upgrade with the largest error
//! reduction per extra bit that still fits the budget (a greedy multiple-choice knapsack).
//! Candidates stream in a paged cache with blocks of 32 tokens: per-channel keys are grouped
//! per 32-token block, exactly as the cache will store them. With [`Options::cache`] the
//! candidates are measured through the cache itself, so the bits include its residual
//! window and sinks (write the config with [`config_with`] and the same [`CacheRun`]).
//!
//! Candidates with bits per key channel (`-qa`) are measured with maps fitted on the tokens
//! before the first measured query position, as `kvq analyze` does; the written config
//! carries maps fitted on all of a dumped layer's tokens for that layer, and gives the model
//! layers the dump does not hold the same spec without `-qa` (same bits; a map is fitted to
//! one layer's keys and queries, and nothing was measured there).

use kvq_quant_core::RopePairing;
use kvq_quant_core::channel_bits::fit_heads;

use crate::analysis::{AnalyzeError, CacheRun, KvSpec, LayerInput, Options, analyze};
use crate::cache::{KvCacheConfig, KvqError};

/// Tokens per block of the configs `recommend` writes (per-channel groups match it).
pub const BLOCK_SIZE: usize = 32;

/// Candidate spec pairs: uniform and mixed precision, all streamable without calibration
/// (the `-qa` ones fit their maps to the dump itself; keys and values a bit apart fill the
/// budgets between whole widths).
pub fn default_candidates() -> Vec<KvSpec> {
    [
        "int8-token",
        "int8-channel32/int8-token",
        "int8-channel32/int4-token",
        "int4-channel32/int8-token",
        "int4-channel32/int4-token",
        "int4-channel32/int4-g32",
        "int4-channel32/int2-token",
        "int2-channel32/int4-token",
        "int2-channel32/int2-token",
        "int3-channel32/int3-token",
        "int4-channel32/int4-token-mse-rot",
        "int4-channel32/int2-token-mse-rot",
        "int2-channel32/int2-token-mse-rot",
        "int3-channel32/int3-token-mse-rot",
        "int4-channel32-p8/int4-token-mse-rot-p8",
        "int3-channel32-p8/int3-token-mse-rot-p8",
        "int2-channel32-p8/int2-token-mse-rot-p8",
        "int4-channel32-p8/int3-token-mse-rot-p8",
        "int3-channel32-p8/int2-token-mse-rot-p8",
        "int4-channel32-p8/int2-token-mse-rot-p8",
        "int4-channel32-p8/int4-g32-mse-rot-p8",
        "int4-channel32-qa/int4-token-mse-rot",
        "int3-channel32-qa/int3-token-mse-rot",
        "int2-channel32-qa/int2-token-mse-rot",
        "int4-channel32-qa/int3-token-mse-rot",
        "int3-channel32-qa/int4-token-mse-rot",
        "int3-channel32-qa/int2-token-mse-rot",
        "int2-channel32-qa/int3-token-mse-rot",
        "nf4-token",
        "fp8e4m3-token",
    ]
    .iter()
    .map(|s| KvSpec::parse(s).expect("built-in candidates parse"))
    .collect()
}

/// The chosen spec of one layer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Choice {
    /// Layer name.
    pub layer: String,
    /// Chosen specs (`KSPEC/VSPEC`).
    pub spec: String,
    /// Bits per value, K and V together.
    pub bits: f64,
    /// Relative error of attention outputs.
    pub attn_rel_err: f64,
}

/// A recommendation.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Recommendation {
    /// The budget asked for.
    pub budget_bits: f64,
    /// Average bits per value of the choice.
    pub average_bits: f64,
    /// One choice per layer.
    pub layers: Vec<Choice>,
}

/// Why no recommendation could be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecommendError {
    /// Measuring the candidates failed.
    #[error(transparent)]
    Analyze(#[from] AnalyzeError),
    /// Even the cheapest candidates exceed the budget.
    #[error("the cheapest candidates need {needed:.3} bits per value on average; the budget is {budget}")]
    Budget {
        /// Smallest achievable average.
        needed: f64,
        /// The budget.
        budget: f64,
    },
    /// The budget is not a positive finite number of bits.
    #[error("budget {0} bits per value is not a positive finite number")]
    BadBudget(f64),
    /// The dump's layers do not map onto the model's.
    #[error("layers: {0}")]
    Layers(String),
    /// The chosen specs do not make a valid cache config.
    #[error(transparent)]
    Config(#[from] KvqError),
}

/// Chooses per-layer specs from `candidates` under `budget_bits` on average over `layers`,
/// each counted once. A dump of some of a model's layers should weigh each by the model
/// layers it stands for: [`recommend_weighted`] with [`layer_weights`].
///
/// # Errors
/// [`RecommendError::BadBudget`] for a NaN, infinite or non-positive budget (checked before
/// anything is measured), [`RecommendError::Analyze`], [`RecommendError::Budget`].
pub fn recommend(
    layers: &[LayerInput],
    candidates: &[KvSpec],
    budget_bits: f64,
    options: &Options,
    progress: impl FnMut(usize, usize),
) -> Result<(Recommendation, Vec<KvSpec>), RecommendError> {
    recommend_weighted(layers, candidates, budget_bits, &vec![1.0; layers.len()], options, progress)
}

/// How many model layers each dumped layer stands for in the config that [`config_with`]
/// writes for `model_layers` (each model layer takes the specs of the nearest dumped layer):
/// the weights under which [`recommend_weighted`]'s budget is the written config's.
///
/// # Errors
/// As [`config_for`]: names that are not `layer{L}`, repeated layers, a layer past the model.
pub fn layer_weights(layers: &[LayerInput], model_layers: Option<usize>) -> Result<Vec<f64>, RecommendError> {
    let (ids, source) = sources(layers, model_layers)?;
    Ok(ids.iter().map(|id| source.iter().filter(|&&s| s == *id).count() as f64).collect())
}

/// The model layer of each dumped layer, and for each model layer the dumped layer whose
/// specs it takes (the nearest; the lower one on a tie).
fn sources(
    layers: &[LayerInput],
    model_layers: Option<usize>,
) -> Result<(Vec<usize>, Vec<usize>), RecommendError> {
    let bad = |why: String| RecommendError::Layers(why);
    let mut ids = Vec::with_capacity(layers.len());
    for l in layers {
        let id = model_layer(&l.name).ok_or_else(|| bad(format!("{}: not named layer<L>", l.name)))?;
        if ids.contains(&id) {
            return Err(bad(format!("layer {id} appears twice")));
        }
        ids.push(id);
    }
    let Some(&highest) = ids.iter().max() else { return Err(bad("no layers".into())) };
    let n = model_layers.unwrap_or(highest + 1);
    if highest >= n {
        return Err(bad(format!("the dump holds layer {highest}, the model has {n} layers")));
    }
    let source: Vec<usize> = (0..n)
        .map(|m| *ids.iter().min_by_key(|&&id| (id.abs_diff(m), id)).expect("at least one layer"))
        .collect();
    Ok((ids, source))
}

/// [`recommend`] with layer `l` counted `weights[l]` times in the average (and in the error
/// the choice reduces): the model's layers, when the dump holds some of them.
///
/// # Errors
/// As [`recommend`], and [`RecommendError::Layers`] for weights that are not one finite,
/// positive number per layer.
pub fn recommend_weighted(
    layers: &[LayerInput],
    candidates: &[KvSpec],
    budget_bits: f64,
    weights: &[f64],
    options: &Options,
    progress: impl FnMut(usize, usize),
) -> Result<(Recommendation, Vec<KvSpec>), RecommendError> {
    if !(budget_bits.is_finite() && budget_bits > 0.0) {
        return Err(RecommendError::BadBudget(budget_bits));
    }
    if weights.len() != layers.len() || !weights.iter().all(|w| w.is_finite() && *w > 0.0) {
        return Err(RecommendError::Layers(format!("{} weights for {} layers", weights.len(), layers.len())));
    }
    let report = analyze("recommend", layers, candidates, options, progress)?;
    let n = report.layers.len();
    let total_weight: f64 = weights.iter().sum();
    // Per layer, the candidates sorted by bits.
    let options_per_layer: Vec<Vec<(f64, f64, usize)>> = report
        .layers
        .iter()
        .map(|l| {
            let mut v: Vec<(f64, f64, usize)> =
                l.rows.iter().enumerate().map(|(i, r)| (r.bits_per_element, r.attn_rel_err, i)).collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            v
        })
        .collect();
    let mut pick: Vec<usize> = vec![0; n];
    let total_bits = |pick: &[usize], opts: &[Vec<(f64, f64, usize)>]| -> f64 {
        pick.iter().zip(opts).zip(weights).map(|((&p, o), w)| o[p].0 * w).sum()
    };
    let needed = total_bits(&pick, &options_per_layer) / total_weight;
    if needed > budget_bits {
        return Err(RecommendError::Budget { needed, budget: budget_bits });
    }
    loop {
        let used = total_bits(&pick, &options_per_layer);
        let mut best: Option<(f64, usize, usize)> = None;
        for (l, opts) in options_per_layer.iter().enumerate() {
            let (b0, e0, _) = opts[pick[l]];
            for (j, &(b, e, _)) in opts.iter().enumerate() {
                let extra = b - b0;
                if e >= e0 || (used + extra * weights[l]) / total_weight > budget_bits + 1e-12 {
                    continue;
                }
                let gain = (e0 - e) / extra.max(1e-9);
                if best.is_none_or(|(g, ..)| gain > g) {
                    best = Some((gain, l, j));
                }
            }
        }
        match best {
            Some((_, l, j)) => pick[l] = j,
            None => break,
        }
    }
    let mut chosen = Vec::with_capacity(n);
    let mut specs = Vec::with_capacity(n);
    for (l, layer) in report.layers.iter().enumerate() {
        let (_, _, idx) = options_per_layer[l][pick[l]];
        let row = &layer.rows[idx];
        chosen.push(Choice {
            layer: layer.layer.clone(),
            spec: row.spec.clone(),
            bits: row.bits_per_element,
            attn_rel_err: row.attn_rel_err,
        });
        specs.push(candidates[idx].clone());
    }
    let average_bits = chosen.iter().zip(weights).map(|(c, w)| c.bits * w).sum::<f64>() / total_weight;
    Ok((Recommendation { budget_bits, average_bits, layers: chosen }, specs))
}

/// The model layer a dumped layer's name (`layer9`) stands for.
pub fn model_layer(name: &str) -> Option<usize> {
    name.strip_prefix("layer")?.parse().ok()
}

/// A cache config with the chosen specs for the model the dump `layers` came from.
///
/// Each dumped layer (`layer{L}`, as [`layers_from_file`](crate::analysis::layers_from_file)
/// names them) sets the specs of model layer `L`; a dump of layers 0, 9 and 29 describes a
/// model of at least 30 layers, not one of three. The config has `model_layers` layers (by
/// default one past the highest dumped layer), and every layer the dump does not hold takes
/// the specs of the nearest dumped layer (the lower one on a tie). The second value gives,
/// for each model layer, the dumped layer whose specs it took.
///
/// # Errors
/// [`RecommendError::Layers`] for a name that is not `layer{L}`, a repeated layer, or a layer
/// at or past `model_layers`; [`RecommendError::Config`] when the specs cannot stream.
pub fn config_for(
    layers: &[LayerInput],
    specs: &[KvSpec],
    model_layers: Option<usize>,
) -> Result<(KvCacheConfig, Vec<usize>), RecommendError> {
    config_with(layers, specs, model_layers, CacheRun::default(), Some(RopePairing::Half))
}

/// Like [`config_for`], with the residual window and sinks of `run` (the config that a
/// recommendation measured with [`Options::cache`] set to `run` was measured on) and the RoPE
/// pairing that the maps of `-qa` key specs keep together ([`Options::rope_pairing`]).
///
/// A dumped layer with a `-qa` key spec gets maps fitted on all its tokens (each KV head's
/// keys, weighted by its query heads' mean squared queries); model layers that take its specs
/// without being in the dump get the spec without `-qa`.
///
/// # Errors
/// As [`config_for`], and [`RecommendError::Config`] when a map cannot be fitted.
pub fn config_with(
    layers: &[LayerInput],
    specs: &[KvSpec],
    model_layers: Option<usize>,
    run: CacheRun,
    pairing: Option<RopePairing>,
) -> Result<(KvCacheConfig, Vec<usize>), RecommendError> {
    let (ids, source) = sources(layers, model_layers)?;
    let n = source.len();
    if specs.len() != ids.len() {
        return Err(RecommendError::Layers(format!("{} specs for {} layers", specs.len(), ids.len())));
    }
    let (k, q) = (layers[0].k.shape(), layers[0].q.shape());
    let mut b = KvCacheConfig::builder(n, k.heads, q.heads, k.head_dim)
        .block_size(BLOCK_SIZE)
        .residual_blocks(run.residual_blocks)
        .sink_tokens(run.sink_tokens)
        .row_window(run.row_window)
        .tail_dtypes(run.tail_dtype, run.value_tail_dtype);
    let config_err = |e: kvq_quant_core::QuantError| RecommendError::Config(KvqError::Config(e.to_string()));
    for (m, &from) in source.iter().enumerate() {
        let at = ids.iter().position(|&id| id == from).expect("a dumped layer");
        let s = &specs[at];
        if !s.k.channel_bits() {
            b = b.layer_specs(m, s.k.clone(), s.v.clone());
        } else if m == from {
            let maps = fit_heads(&layers[at].k, &layers[at].q, &s.k, pairing).map_err(config_err)?;
            b = b.layer_specs(m, s.k.clone(), s.v.clone()).channel_bits(m, maps);
        } else {
            let plain = s.k.clone().with_channel_bits(false).map_err(config_err)?;
            b = b.layer_specs(m, plain, s.v.clone());
        }
    }
    let config = b.build()?;
    debug_assert_eq!(config.layers.len(), n);
    Ok((config, source))
}
