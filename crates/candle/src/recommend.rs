//! A cache config searched on the model: the fewest bits whose KL divergence against the f32
//! reference cache stays under a target (`kvq-eval --target-kl`).
//!
//! [`kvq::recommend`] chooses per-layer specs from the attention error of dumped tensors; what a
//! user bounds is what the cache does to the model's next-token distributions. The search
//! measures that on the model itself, with [`evaluate`]:
//!
//! 1. **Rungs.** Each candidate spec pair ([`default_ladder`]) for every layer at once: its
//!    mean KL `U(r)` and its bits per value, window and sinks counted, as `kvq-eval` reports
//!    them.
//! 2. **Layers.** Each layer alone at the probe spec (the cheapest rung by default), every
//!    other layer at the richest rung: the KL that layer adds, `P(l)`. Its share of the sum is
//!    the layer's sensitivity `s(l)` (SmolLM2's first layers and its last take most of it).
//! 3. **Choice.** The KL of a mixed config is predicted as `Σ_l s(l) · U(r_l)` (a uniform
//!    config predicts its own measured KL) and the bits as the mean of the layers' rungs; a
//!    greedy multiple-choice knapsack starts every layer at its cheapest rung and takes the
//!    upgrade with the largest predicted KL reduction per bit until the prediction is under
//!    the target (and the budget, if one is given, still holds).
//! 4. **Checks.** The chosen config is measured. The prediction assumes that a layer's share
//!    is the same at every rung and that layers add up; where it is wrong, the next choice is
//!    made for a target scaled by what the check found (a bisection once one choice met the
//!    target and one did not), up to [`SearchOptions::max_checks`] measurements. The result is
//!    the measured config with the fewest bits that met every bound.
//!
//! Everything is measured on the tokens given: check the result on a text the search did not
//! see (`kvq-eval --skip-tokens` takes the rest of the same file).

use kvq::analysis::KvSpec;
use kvq::attention::ScorePath;
use kvq::cache::{KvCacheConfig, LayerSpecs};

use crate::error::{Error, Result};
use crate::eval::{Candidate, CandidateReport, Protocol, evaluate};
use crate::model::LlamaModel;

/// The rungs searched by default, from the richest: `-p8` pairs (one-byte parameters, the
/// values' window kept) with keys per channel and values per token, rotated and
/// error-minimizing at 4 bits and below, keys a width above their values between whole
/// widths, query-aware bits per key channel (`-qa`, whose maps [`SearchOptions::channel_bits`]
/// must hold; `kvq-eval` fits them on its calibration tokens) at 3 and 2 bits, and INT8 on
/// top for the layers that need it.
pub fn default_ladder() -> Vec<KvSpec> {
    [
        "int8-channel/int8-token",
        "int4-channel-p8/int4-token-p8",
        "int4-channel-p8/int4-token-mse-rot-p8",
        "int4-channel-p8/int3-token-mse-rot-p8",
        "int3-channel-qa/int3-token-mse-rot-p8",
        "int3-channel-p8/int3-token-mse-rot-p8",
        "int4-channel-p8/int2-token-mse-rot-p8",
        "int3-channel-qa/int2-token-mse-rot-p8",
        "int3-channel-p8/int2-token-mse-rot-p8",
        "int2-channel-qa/int2-token-mse-rot-p8",
        "int2-channel-p8/int2-token-mse-rot-p8",
    ]
    .iter()
    .map(|s| KvSpec::parse(s).expect("built-in rungs parse"))
    .collect()
}

/// The bounds a searched config must hold. At least one of them is given.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Target {
    /// Largest mean KL(reference ‖ cache), nats.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_mean: Option<f64>,
    /// Largest 99th-percentile KL, nats.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_p99: Option<f64>,
    /// Largest bits per value (as `kvq-eval` reports them). With a KL bound, the fewest bits
    /// that hold it without passing the budget; alone, the smallest predicted KL within it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_bits: Option<f64>,
}

impl Target {
    /// Whether a measured report holds the KL bounds (the budget is held by construction).
    fn met_by(&self, r: &CandidateReport) -> bool {
        self.kl_mean.is_none_or(|t| r.kl_mean <= t) && self.kl_p99.is_none_or(|t| r.kl_p99 <= t)
    }

    /// How far a report is from the KL bounds: the largest measured/bound ratio (1 on the bound).
    fn ratio(&self, r: &CandidateReport) -> f64 {
        let a = self.kl_mean.map_or(0.0, |t| r.kl_mean / t);
        let b = self.kl_p99.map_or(0.0, |t| r.kl_p99 / t);
        a.max(b)
    }

    fn check(&self) -> Result<()> {
        let bad = |what: &str, v: f64| Error::Eval(format!("{what} {v}: need a positive finite number"));
        for (what, v) in
            [("target KL", self.kl_mean), ("target p99 KL", self.kl_p99), ("budget bits", self.budget_bits)]
        {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return Err(bad(what, v));
            }
        }
        if self.kl_mean.is_none() && self.kl_p99.is_none() && self.budget_bits.is_none() {
            return Err(Error::Eval("a search needs a target KL, a target p99 KL or a bit budget".into()));
        }
        Ok(())
    }
}

/// How to search.
#[derive(Debug, Clone)]
pub struct SearchOptions {
    /// The bounds.
    pub target: Target,
    /// The spec pairs a layer may take (at least two; any order).
    pub ladder: Vec<KvSpec>,
    /// The spec pair whose per-layer KL measures each layer's sensitivity (`None`: the
    /// ladder's cheapest rung, whose KL stands furthest above the noise).
    pub probe: Option<KvSpec>,
    /// Everything but the specs (block size, window, sinks, tails, blocks): the specs of its
    /// layers are replaced. Sized for the protocol's longest sequence.
    pub base: KvCacheConfig,
    /// The score path of attention.
    pub path: ScorePath,
    /// The tokens and positions measured.
    pub protocol: Protocol,
    /// Measurements of chosen configs at most (at least 1).
    pub max_checks: usize,
    /// For `-qa` rungs, the per-layer bits per key channel fitted on calibration tokens
    /// ([`crate::calibrate::channel_bits`]), one entry per rung of [`Self::ladder`] (`None`
    /// for the others); empty when no rung has `-qa`.
    pub channel_bits: Vec<Option<Vec<Vec<kvq::cache::ChannelBits>>>>,
}

/// What a rung did with every layer on it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Rung {
    /// `KSPEC/VSPEC`.
    pub spec: String,
    /// Bits per value as measured.
    pub bits: f64,
    /// Mean KL as measured.
    pub kl_mean: f64,
    /// 99th-percentile KL as measured.
    pub kl_p99: f64,
}

/// One measured choice.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    /// The KL bound the choice was made for (the target scaled by the checks before it).
    pub aimed_kl: f64,
    /// The mean KL the model predicted for it.
    pub predicted_kl: f64,
    /// Per layer, the index of its rung.
    pub rungs: Vec<usize>,
    /// What was measured.
    pub report: CandidateReport,
    /// Whether it held every bound.
    pub met: bool,
}

/// The outcome of a search.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Search {
    /// The bounds.
    pub target: Target,
    /// The rungs, as measured uniformly.
    pub rungs: Vec<Rung>,
    /// The rung that measured the layers.
    pub probe: String,
    /// Per layer, the KL it added alone at the probe (floored at 0).
    pub layer_kl: Vec<f64>,
    /// Per layer, its share of the summed [`Self::layer_kl`].
    pub sensitivity: Vec<f64>,
    /// The measured choices, in order.
    pub checks: Vec<Check>,
    /// The index in [`Self::checks`] of the result: the fewest bits that met every bound, or
    /// (none did) the smallest distance to them.
    pub chosen: usize,
    /// Whether the result met every bound.
    pub met: bool,
    /// The result's config.
    #[serde(skip)]
    pub config: KvCacheConfig,
}

impl Search {
    /// The result's measured figures.
    pub fn result(&self) -> &CandidateReport {
        &self.checks[self.chosen].report
    }

    /// The result's spec pair of each layer.
    pub fn layer_specs(&self) -> Vec<&str> {
        self.checks[self.chosen].rungs.iter().map(|&r| self.rungs[r].spec.as_str()).collect()
    }
}

/// The search's stages, for progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// Every rung on every layer, and every layer alone at the probe, in one pass.
    Measure,
    /// Check `n` (0-based) of a chosen config.
    Check(usize),
}

/// Searches per-layer spec pairs for `model` on `tokens` (see the module's description).
/// `progress(stage, done, total)` follows each pass over the tokens.
///
/// # Errors
/// [`Error::Eval`] for bounds that are not positive finite numbers, a ladder of fewer than two
/// rungs, a probe or channel-bit list that does not match, a budget below the cheapest rung;
/// what [`evaluate`] returns.
pub fn search(
    model: &LlamaModel,
    tokens: &[u32],
    options: &SearchOptions,
    mut progress: impl FnMut(Stage, usize, usize),
) -> Result<Search> {
    let SearchOptions { target, ladder, channel_bits, .. } = options;
    target.check()?;
    if ladder.len() < 2 {
        return Err(Error::Eval(format!("a ladder of {} rungs: give two or more", ladder.len())));
    }
    if !channel_bits.is_empty() && channel_bits.len() != ladder.len() {
        return Err(Error::Eval(format!(
            "{} channel-bit entries for {} rungs",
            channel_bits.len(),
            ladder.len()
        )));
    }
    let measured = measure(model, tokens, options, &mut progress)?;
    if let Some(b) = target.budget_bits {
        let cheapest = measured.rungs.iter().map(|r| r.bits).fold(f64::INFINITY, f64::min);
        if cheapest > b {
            return Err(Error::Eval(format!(
                "budget {b} bits: the cheapest rung takes {cheapest:.3} bits per value at this length"
            )));
        }
    }
    let checks = refine(model, tokens, options, &measured, &mut progress)?;
    let chosen = checks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.met)
        .min_by(|a, b| a.1.report.bits_per_value.total_cmp(&b.1.report.bits_per_value))
        .or_else(|| {
            checks
                .iter()
                .enumerate()
                .min_by(|a, b| target.ratio(&a.1.report).total_cmp(&target.ratio(&b.1.report)))
        })
        .map(|(i, _)| i)
        .ok_or_else(|| Error::Eval("no config was measured".into()))?;
    let Measured { rungs, layer_kl, sensitivity, probe } = measured;
    Ok(Search {
        target: *target,
        probe: ladder[probe].name(),
        met: checks[chosen].met,
        rungs,
        layer_kl,
        sensitivity,
        config: options.config(&checks[chosen].rungs)?,
        checks,
        chosen,
    })
}

impl SearchOptions {
    /// The base config with layer `l` on rung `rungs[l]`, validated.
    fn config(&self, rungs: &[usize]) -> Result<KvCacheConfig> {
        let mut c = self.base.clone();
        for (l, &r) in rungs.iter().enumerate() {
            let s = self.ladder[r].for_block(self.base.block_size);
            let maps = self.channel_bits.get(r).and_then(|m| m.as_ref()).map(|m| m[l].clone());
            if s.k.channel_bits() && maps.is_none() {
                return Err(Error::Eval(format!(
                    "rung {}: -qa keys need fitted bits per channel",
                    self.ladder[r].name()
                )));
            }
            c.layers[l] = LayerSpecs { k: s.k, v: s.v, k_channel_bits: maps };
        }
        c.validate()?;
        Ok(c)
    }
}

/// What the first pass found: each rung uniformly, each layer's KL alone and its share.
struct Measured {
    rungs: Vec<Rung>,
    layer_kl: Vec<f64>,
    sensitivity: Vec<f64>,
    /// The probe's rung.
    probe: usize,
}

/// Pass 1: every rung uniformly, and every layer alone at the probe over the richest rung,
/// in one evaluation. The richest rung is known from the specs' own bits (window and sinks
/// are the same for every rung); the uniform runs measure the bits that count.
fn measure(
    model: &LlamaModel,
    tokens: &[u32],
    options: &SearchOptions,
    progress: &mut impl FnMut(Stage, usize, usize),
) -> Result<Measured> {
    let SearchOptions { ladder, probe, base, path, protocol, .. } = options;
    let layers = base.layers.len();
    let uniform: Vec<KvCacheConfig> =
        (0..ladder.len()).map(|r| options.config(&vec![r; layers])).collect::<Result<_>>()?;
    let nominal: Vec<f64> = uniform.iter().map(KvCacheConfig::bits_per_value).collect();
    let richest = argmax_by(&nominal, |a, b| a.total_cmp(b));
    let probe = match probe {
        Some(p) => ladder
            .iter()
            .position(|s| s == p)
            .ok_or_else(|| Error::Eval(format!("probe {} is not one of the ladder's rungs", p.name())))?,
        None => argmax_by(&nominal, |a, b| b.total_cmp(a)),
    };
    if probe == richest {
        return Err(Error::Eval(format!(
            "probe {}: the richest rung measures nothing",
            ladder[probe].name()
        )));
    }
    let mut candidates = Vec::with_capacity(ladder.len() + layers);
    for (spec, config) in ladder.iter().zip(uniform) {
        candidates.push(Candidate { name: spec.name(), config, path: *path });
    }
    for l in 0..layers {
        let mut rungs = vec![richest; layers];
        rungs[l] = probe;
        candidates.push(Candidate {
            name: format!("layer {l}"),
            config: options.config(&rungs)?,
            path: *path,
        });
    }
    let report = evaluate(model, tokens, *protocol, &candidates, |d, t| progress(Stage::Measure, d, t))?;
    let (uniform, alone) = report.candidates.split_at(ladder.len());
    let rungs: Vec<Rung> = uniform
        .iter()
        .map(|c| Rung { spec: c.name.clone(), bits: c.bits_per_value, kl_mean: c.kl_mean, kl_p99: c.kl_p99 })
        .collect();
    // What a layer adds alone: its run's KL less the richest rung's share of the others.
    let floor = rungs[richest].kl_mean * (layers - 1) as f64 / layers as f64;
    let layer_kl: Vec<f64> = alone.iter().map(|c| (c.kl_mean - floor).max(0.0)).collect();
    let sum: f64 = layer_kl.iter().sum();
    let sensitivity: Vec<f64> = if sum > 0.0 {
        layer_kl.iter().map(|k| k / sum).collect()
    } else {
        vec![1.0 / layers as f64; layers]
    };
    Ok(Measured { rungs, layer_kl, sensitivity, probe })
}

/// Pass 2: choose a mix for an aimed KL, measure it, move the aim by what it found (between
/// the highest aim that met the bounds and the lowest that missed them), until they meet,
/// the knapsack has nothing new, or the checks run out.
fn refine(
    model: &LlamaModel,
    tokens: &[u32],
    options: &SearchOptions,
    measured: &Measured,
    progress: &mut impl FnMut(Stage, usize, usize),
) -> Result<Vec<Check>> {
    let SearchOptions { target, path, protocol, max_checks, .. } = options;
    let Measured { rungs, sensitivity, .. } = measured;
    // Only a p99 bound: aim the mean at it scaled by the rungs' own mean/p99 ratio.
    let start = target.kl_mean.unwrap_or_else(|| {
        let k = target.kl_p99.unwrap_or(0.0);
        let ratio = rungs.iter().map(|r| r.kl_mean / r.kl_p99.max(f64::MIN_POSITIVE)).sum::<f64>()
            / rungs.len() as f64;
        k * ratio
    });
    let budget = target.budget_bits.unwrap_or(f64::INFINITY);
    let kl_bounded = target.kl_mean.is_some() || target.kl_p99.is_some();
    let mut checks: Vec<Check> = Vec::new();
    let (mut aim, mut met_at, mut missed_at) = (start, None::<f64>, None::<f64>);
    for n in 0..(*max_checks).max(1) {
        let picks = choose(rungs, sensitivity, if kl_bounded { aim } else { 0.0 }, budget);
        if let Some(same) = checks.iter().find(|c| c.rungs == picks) {
            // The knapsack gave a choice already measured: move the aim past it, or stop
            // when there is nowhere left to go.
            let (lo, hi) = (met_at.unwrap_or(0.0), missed_at.unwrap_or(f64::INFINITY));
            if !kl_bounded || hi / lo.max(f64::MIN_POSITIVE) < 1.02 || n + 1 == *max_checks {
                break;
            }
            aim = if same.met { aim * 1.5 } else { aim / 1.5 };
            continue;
        }
        let c = Candidate { name: format!("check {n}"), config: options.config(&picks)?, path: *path };
        let r = evaluate(model, tokens, *protocol, &[c], |d, t| progress(Stage::Check(n), d, t))?
            .candidates
            .remove(0);
        let met = target.met_by(&r);
        let ratio = target.ratio(&r);
        checks.push(Check {
            aimed_kl: aim,
            predicted_kl: predicted_kl(rungs, sensitivity, &picks),
            rungs: picks,
            report: r,
            met,
        });
        if !kl_bounded {
            break;
        }
        if met {
            met_at = Some(met_at.map_or(aim, |m: f64| m.max(aim)));
        } else {
            missed_at = Some(missed_at.map_or(aim, |m: f64| m.min(aim)));
        }
        aim = match (met_at, missed_at) {
            (Some(lo), Some(hi)) => {
                if hi / lo < 1.05 {
                    break;
                }
                (lo * hi).sqrt()
            }
            // Scale by what the check found: a little past the bound, never more than 4x.
            _ => aim / ratio.clamp(0.25, 4.0) * if met { 1.0 } else { 0.9 },
        };
        if !aim.is_finite() || aim <= 0.0 {
            break;
        }
    }
    Ok(checks)
}

/// The index of the largest element under `cmp` (the first of equals).
fn argmax_by(x: &[f64], cmp: impl Fn(&f64, &f64) -> std::cmp::Ordering) -> usize {
    let mut best = 0;
    for i in 1..x.len() {
        if cmp(&x[i], &x[best]) == std::cmp::Ordering::Greater {
            best = i;
        }
    }
    best
}

/// The mean KL predicted for a choice of rungs: each layer's share of its rung's uniform KL.
fn predicted_kl(rungs: &[Rung], sensitivity: &[f64], picks: &[usize]) -> f64 {
    picks.iter().zip(sensitivity).map(|(&r, s)| s * rungs[r].kl_mean).sum()
}

/// The greedy multiple-choice knapsack: every layer on its cheapest rung, then the upgrade
/// with the largest predicted KL reduction per extra bit, while the predicted KL is above
/// `aim` and an upgrade fits the `budget` (mean bits over layers).
fn choose(rungs: &[Rung], sensitivity: &[f64], aim: f64, budget: f64) -> Vec<usize> {
    let layers = sensitivity.len();
    let cheapest = argmax_by(&rungs.iter().map(|r| r.bits).collect::<Vec<_>>(), |a, b| b.total_cmp(a));
    let mut picks = vec![cheapest; layers];
    let bits = |picks: &[usize]| picks.iter().map(|&r| rungs[r].bits).sum::<f64>() / layers as f64;
    while predicted_kl(rungs, sensitivity, &picks) > aim {
        let used = bits(&picks);
        let mut best: Option<(f64, usize, usize)> = None;
        for (l, &p) in picks.iter().enumerate() {
            for (j, r) in rungs.iter().enumerate() {
                let extra = r.bits - rungs[p].bits;
                let gain = sensitivity[l] * (rungs[p].kl_mean - r.kl_mean);
                if gain <= 0.0 || used + extra / layers as f64 > budget + 1e-12 {
                    continue;
                }
                let per_bit = gain / extra.max(1e-9);
                if best.is_none_or(|(g, ..)| per_bit > g) {
                    best = Some((per_bit, l, j));
                }
            }
        }
        match best {
            Some((_, l, j)) => picks[l] = j,
            None => break,
        }
    }
    picks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rung(bits: f64, kl: f64) -> Rung {
        Rung { spec: format!("{bits}"), bits, kl_mean: kl, kl_p99: 10.0 * kl }
    }

    #[test]
    fn the_knapsack_upgrades_sensitive_layers_first_and_holds_the_budget() {
        let rungs = [rung(9.0, 1e-5), rung(5.0, 1e-3), rung(3.0, 1e-1)];
        // Layer 0 takes 70% of the KL, the other three 10% each.
        let s = [0.7, 0.1, 0.1, 0.1];
        // Everything at 3 bits predicts 0.1; 0.04 needs layer 0 upgraded first.
        let p = choose(&rungs, &s, 0.04, f64::INFINITY);
        assert_eq!(p, [1, 2, 2, 2]);
        assert!(s.iter().zip(&p).map(|(s, &r)| s * rungs[r].kl_mean).sum::<f64>() <= 0.04);
        // A target nothing below INT8 everywhere reaches.
        assert_eq!(choose(&rungs, &s, 1e-6, f64::INFINITY), [0, 0, 0, 0]);
        // A budget of 4 bits on average (16 over four layers): two layers move from 3 to 5
        // bits, the most sensitive first.
        let p = choose(&rungs, &s, 0.0, 4.0);
        assert_eq!(p.iter().map(|&r| rungs[r].bits).sum::<f64>(), 16.0);
        assert_eq!(p[0], 1);
        // A target already met takes the cheapest rung everywhere.
        assert_eq!(choose(&rungs, &s, 1.0, f64::INFINITY), [2, 2, 2, 2]);
    }

    #[test]
    fn bounds_must_be_positive_and_one_given() {
        for t in [
            Target::default(),
            Target { kl_mean: Some(0.0), ..Target::default() },
            Target { kl_mean: Some(f64::NAN), ..Target::default() },
            Target { kl_p99: Some(-1.0), ..Target::default() },
            Target { budget_bits: Some(f64::INFINITY), ..Target::default() },
        ] {
            assert!(matches!(t.check(), Err(Error::Eval(_))), "{t:?}");
        }
        assert!(Target { kl_p99: Some(0.1), ..Target::default() }.check().is_ok());
    }
}
