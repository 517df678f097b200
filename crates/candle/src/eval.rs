//! What a cache does to a model's outputs: the KL divergence of next-token distributions
//! against the f32 reference cache, top-1 agreement and perplexity, in real decode or in
//! llama.cpp's `llama-perplexity --kl-divergence` protocol.
//!
//! The reference and every candidate cache run in lockstep over the same tokens, so each
//! position's distributions are compared as soon as they exist and no logits are stored.

use std::time::{Duration, Instant};

use kvq::attention::ScorePath;
use kvq::cache::KvCacheConfig;

use crate::error::{Error, Result};
use crate::model::LlamaModel;
use crate::store::{KvStore, KvqStore};

/// How the tokens are fed and which positions are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Protocol {
    /// One sequence: a prefill of `prefill` tokens, then one token per decode step; every
    /// prediction from the last prefill position on is scored.
    Decode {
        /// Tokens in the prefill (at least 1).
        prefill: usize,
    },
    /// llama.cpp's perplexity protocol: `chunks` chunks of `ctx` tokens, each from an empty
    /// cache with its first token replaced by BOS when the model adds one, each evaluated in
    /// one prefill; the predictions of the second half of each chunk are scored (positions
    /// `ctx/2 .. ctx-2`, predicting tokens `ctx/2 + 1 .. ctx-1`).
    Chunks {
        /// Tokens per chunk.
        ctx: usize,
        /// Chunks.
        chunks: usize,
    },
}

/// One prediction compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionStats {
    /// KL(reference ‖ candidate) of the next-token distributions, in nats.
    pub kl: f64,
    /// −log p(next token) under the reference.
    pub nll_ref: f64,
    /// −log p(next token) under the candidate.
    pub nll: f64,
    /// Whether both put the same token first.
    pub same_top: bool,
}

/// `log_softmax` of a row of logits, in f64.
fn log_softmax(logits: &[f32], out: &mut Vec<f64>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    out.clear();
    out.extend(logits.iter().map(|&x| x as f64 - lse));
}

/// The index of the largest value (the first of equals; 0 for an empty row).
pub(crate) fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Compares one position: the reference's and the candidate's logits and the token that came
/// next. Non-finite logits give a non-finite KL, never a silent number.
pub fn compare(reference: &[f32], candidate: &[f32], next: u32) -> PositionStats {
    let mut lr = Vec::new();
    log_softmax(reference, &mut lr);
    compare_with(&lr, argmax(reference), candidate, next, &mut Vec::new())
}

/// [`compare`] with the reference's log-probabilities and top token already computed (once
/// per position, whatever the number of candidates); `scratch` holds the candidate's.
fn compare_with(
    lr: &[f64],
    top_ref: usize,
    candidate: &[f32],
    next: u32,
    scratch: &mut Vec<f64>,
) -> PositionStats {
    let t = next as usize;
    // Non-finite logits have no distribution: no KL, no top token to agree on.
    if !candidate.iter().all(|v| v.is_finite()) {
        return PositionStats { kl: f64::NAN, nll_ref: -lr[t], nll: f64::NAN, same_top: false };
    }
    log_softmax(candidate, scratch);
    let kl = lr
        .iter()
        .zip(scratch.iter())
        .map(|(&a, &b)| if a == f64::NEG_INFINITY { 0.0 } else { a.exp() * (a - b) })
        .sum::<f64>();
    PositionStats {
        // Rounding can leave a tiny negative sum for equal rows; NaN stays NaN.
        kl: if kl.is_nan() { kl } else { kl.max(0.0) },
        nll_ref: -lr[t],
        nll: -scratch[t],
        same_top: top_ref == argmax(candidate),
    }
}

/// A cache to evaluate.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Its name in the report (a spec pair, a config file).
    pub name: String,
    /// The cache config (checked against the model).
    pub config: KvCacheConfig,
    /// The score path of its attention.
    pub path: ScorePath,
}

/// The figures of one candidate.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CandidateReport {
    /// Its name.
    pub name: String,
    /// Perplexity with the candidate cache.
    pub ppl: f64,
    /// `ppl / reference ppl`.
    pub ppl_ratio: f64,
    /// Mean KL(reference ‖ candidate), nats.
    pub kl_mean: f64,
    /// Median KL.
    pub kl_median: f64,
    /// 99th percentile KL.
    pub kl_p99: f64,
    /// 99.9th percentile KL (the tail that breaks tool calls and retrieval; the largest value
    /// when fewer than 1000 positions are scored).
    pub kl_p999: f64,
    /// Largest KL.
    pub kl_max: f64,
    /// Share of positions where both put the same token first.
    pub same_top1: f64,
    /// Bits per cached value from the cache's own memory report (codes, parameters, sinks,
    /// tails), at the longest sequence of the run.
    pub bits_per_value: f64,
    /// Bytes the cache held then.
    pub cache_bytes: usize,
    /// Tokens per second through the model with this cache (decode steps for
    /// [`Protocol::Decode`], prefill for [`Protocol::Chunks`]).
    pub tokens_per_s: f64,
    /// The same for the reference, measured in the same run.
    pub ref_tokens_per_s: f64,
}

/// The whole evaluation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The protocol.
    pub protocol: Protocol,
    /// Predictions scored.
    pub positions: usize,
    /// Perplexity with the f32 reference cache.
    pub ppl_ref: f64,
    /// Bytes the reference cache held at the longest sequence.
    pub ref_cache_bytes: usize,
    /// One entry per candidate.
    pub candidates: Vec<CandidateReport>,
}

struct Running {
    store: Box<dyn KvStore>,
    stats: Vec<PositionStats>,
    time: Duration,
    timed_tokens: usize,
    bytes_at_max: (usize, usize),
}

/// The segments of a protocol: token sequences fed from an empty cache, how many tokens the
/// first forward call takes, and the first scored position.
fn segments(model: &LlamaModel, tokens: &[u32], protocol: Protocol) -> Result<Vec<(Vec<u32>, usize, usize)>> {
    match protocol {
        Protocol::Decode { prefill } => {
            // At least one token is decoded after the prefill: decode is what is timed.
            if prefill == 0 || prefill.saturating_add(1) >= tokens.len() {
                return Err(Error::Eval(format!(
                    "prefill {prefill} of {} tokens: need 1 ≤ prefill < tokens − 1 (one token decoded at least)",
                    tokens.len()
                )));
            }
            Ok(vec![(tokens.to_vec(), prefill, prefill - 1)])
        }
        Protocol::Chunks { ctx, chunks } => {
            if ctx < 4 || chunks == 0 {
                return Err(Error::Eval(format!(
                    "--ctx {ctx} --chunks {chunks}: need ctx ≥ 4 and one chunk or more"
                )));
            }
            let have = tokens.len() / ctx;
            if have < chunks {
                return Err(Error::Eval(format!(
                    "{} tokens hold {have} chunks of {ctx}, not {chunks}",
                    tokens.len()
                )));
            }
            let c = model.config();
            Ok((0..chunks)
                .map(|i| {
                    let mut seg = tokens[i * ctx..(i + 1) * ctx].to_vec();
                    if let (true, Some(b)) = (c.add_bos, c.bos) {
                        seg[0] = b;
                    }
                    (seg, ctx - 1, ctx / 2)
                })
                .collect())
        }
    }
}

/// Runs the reference and every candidate over `tokens` and compares them.
/// `progress(done, total)` is called after every forward step of the reference.
///
/// # Errors
/// [`Error::Eval`] for too few tokens; [`Error::ConfigMismatch`] for a config that does not
/// fit the model; model and cache errors.
pub fn evaluate(
    model: &LlamaModel,
    tokens: &[u32],
    protocol: Protocol,
    candidates: &[Candidate],
    mut progress: impl FnMut(usize, usize),
) -> Result<Report> {
    let vocab = model.config().vocab;
    if let Some((position, &token)) = tokens.iter().enumerate().find(|&(_, &t)| t as usize >= vocab) {
        return Err(Error::Token { token, position, vocab });
    }
    let segs = segments(model, tokens, protocol)?;
    let mut runs = Vec::with_capacity(candidates.len() + 1);
    runs.push(Running::new(Box::new(model.f32_cache()?)));
    for c in candidates {
        model.config().check_cache(&c.config).map_err(|e| match e {
            Error::ConfigMismatch(m) => Error::ConfigMismatch(format!("{}: {m}", c.name)),
            other => other,
        })?;
        runs.push(Running::new(Box::new(KvqStore::new(c.config.clone(), c.path)?)));
    }
    let total: usize = segs.iter().map(|(s, first, _)| 1 + (s.len() - 1 - first)).sum();
    let mut done = 0;
    let (mut lr, mut scratch) = (Vec::new(), Vec::new());
    for (seg, first_len, score_from) in &segs {
        for r in &mut runs {
            r.store.reset()?;
        }
        // The steps: one prefill of `first_len` tokens, then one token at a time. The last
        // token is never fed: nothing follows it to predict.
        let mut steps = vec![(0, *first_len)];
        steps.extend((*first_len..seg.len() - 1).map(|t| (t, t + 1)));
        for (i, &(a, b)) in steps.iter().enumerate() {
            let timed = matches!(protocol, Protocol::Chunks { .. }) || i > 0;
            let mut rows: Vec<Vec<f32>> = Vec::with_capacity(runs.len());
            for r in &mut runs {
                let t0 = Instant::now();
                let logits = model.forward(r.store.as_mut(), &seg[a..b])?;
                if timed {
                    r.time += t0.elapsed();
                    r.timed_tokens += b - a;
                }
                let keep = (*score_from).max(a);
                rows.push(if keep < b {
                    logits.narrow(0, keep - a, b - keep)?.flatten_all()?.to_vec1()?
                } else {
                    Vec::new()
                });
                let len = r.store.len(0);
                if len >= r.bytes_at_max.0 {
                    r.bytes_at_max = (len, r.store.used_bytes());
                }
            }
            let keep = (*score_from).max(a);
            if keep < b {
                let (reference, rest) = rows.split_first().expect("the reference runs first");
                for (p, pos) in (keep..b).enumerate() {
                    let next = seg[pos + 1];
                    let rr = &reference[p * vocab..(p + 1) * vocab];
                    log_softmax(rr, &mut lr);
                    let top_ref = argmax(rr);
                    for (r, row) in runs[1..].iter_mut().zip(rest) {
                        r.stats.push(compare_with(
                            &lr,
                            top_ref,
                            &row[p * vocab..(p + 1) * vocab],
                            next,
                            &mut scratch,
                        ));
                    }
                    runs[0].stats.push(PositionStats {
                        kl: 0.0,
                        nll_ref: 0.0,
                        nll: -lr[next as usize],
                        same_top: true,
                    });
                }
            }
            done += 1;
            progress(done, total);
        }
    }
    let c = model.config();
    let per_token_values = (c.layers * c.kv_heads * c.head_dim * 2) as f64;
    let reference = &runs[0];
    let ppl_ref = mean(reference.stats.iter().map(|s| s.nll)).exp();
    let ref_tps = rate(reference.timed_tokens, reference.time);
    let reports: Vec<CandidateReport> = candidates
        .iter()
        .zip(&runs[1..])
        .map(|(c, r)| {
            let mut kls: Vec<f64> = r.stats.iter().map(|s| s.kl).collect();
            kls.sort_by(f64::total_cmp);
            let ppl = mean(r.stats.iter().map(|s| s.nll)).exp();
            CandidateReport {
                name: c.name.clone(),
                ppl,
                ppl_ratio: ppl / ppl_ref,
                kl_mean: mean(kls.iter().copied()),
                kl_median: quantile(&kls, 0.5),
                kl_p99: quantile(&kls, 0.99),
                kl_p999: quantile(&kls, 0.999),
                kl_max: kls.last().copied().unwrap_or(f64::NAN),
                same_top1: r.stats.iter().filter(|s| s.same_top).count() as f64 / r.stats.len().max(1) as f64,
                bits_per_value: r.bytes_at_max.1 as f64 * 8.0 / (r.bytes_at_max.0 as f64 * per_token_values),
                cache_bytes: r.bytes_at_max.1,
                tokens_per_s: rate(r.timed_tokens, r.time),
                ref_tokens_per_s: ref_tps,
            }
        })
        .collect();
    // Figures are finite or the run is an error (the forward already stops on non-finite
    // logits; this holds the report itself to it).
    if reference.stats.is_empty() {
        return Err(Error::Eval("no position was scored".into()));
    }
    let bad = reports.iter().find(|c: &&CandidateReport| {
        ![c.ppl, c.kl_mean, c.kl_median, c.kl_p99, c.kl_p999, c.kl_max, c.same_top1, c.bits_per_value]
            .iter()
            .chain([c.tokens_per_s, c.ref_tokens_per_s].iter())
            .all(|v| v.is_finite())
    });
    if let Some(c) = bad {
        return Err(Error::Eval(format!(
            "{}: non-finite figures (perplexity {}, mean KL {}, {} tokens/s)",
            c.name, c.ppl, c.kl_mean, c.tokens_per_s
        )));
    }
    if !ppl_ref.is_finite() {
        return Err(Error::Eval(format!("the reference's perplexity is {ppl_ref}")));
    }
    Ok(Report {
        protocol,
        positions: reference.stats.len(),
        ppl_ref,
        ref_cache_bytes: reference.bytes_at_max.1,
        candidates: reports,
    })
}

/// Tokens per second (a clock that read no time between two calls counts a nanosecond).
fn rate(tokens: usize, time: Duration) -> f64 {
    tokens as f64 / time.as_secs_f64().max(1e-9)
}

impl Running {
    fn new(store: Box<dyn KvStore>) -> Self {
        Self { store, stats: Vec::new(), time: Duration::ZERO, timed_tokens: 0, bytes_at_max: (0, 0) }
    }
}

fn mean(x: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = x.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

/// The `q` quantile of sorted values (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// The token ids of a safetensors file's `input_ids` tensor (I32, I64 or U32, one sequence:
/// at most one axis longer than 1), each checked to fit a `u32`.
///
/// # Errors
/// A message saying what is wrong: not safetensors, no `input_ids`, several sequences, a
/// non-integer type, or an id out of range.
pub fn input_ids(bytes: &[u8]) -> std::result::Result<Vec<u32>, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let t = st.tensor("input_ids").map_err(|_| "no input_ids tensor".to_string())?;
    if t.shape().iter().filter(|&&d| d != 1).count() > 1 {
        return Err(format!("input_ids shaped {:?}: one sequence expected", t.shape()));
    }
    let data = t.data();
    let ids: Vec<i64> = match t.dtype() {
        safetensors::Dtype::I32 => {
            data.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")).into()).collect()
        }
        safetensors::Dtype::I64 => {
            data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
        }
        safetensors::Dtype::U32 => {
            data.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")).into()).collect()
        }
        other => return Err(format!("input_ids of {other:?}: integers expected")),
    };
    ids.iter()
        .enumerate()
        .map(|(i, &id)| u32::try_from(id).map_err(|_| format!("input_ids[{i}] = {id}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_logits_agree_on_nothing() {
        let a = [1.0f32, 2.0, 3.0, -1.0];
        for bad in [[f32::NAN, 2.0, 3.0, -1.0], [1.0, 2.0, f32::INFINITY, -1.0], [f32::NEG_INFINITY; 4]] {
            let s = compare(&a, &bad, 2);
            assert!(s.kl.is_nan() && s.nll.is_nan(), "{bad:?}");
            assert!(!s.same_top, "{bad:?}: a top token over non-finite logits");
        }
    }

    #[test]
    fn kl_of_equal_rows_is_zero_and_grows_with_difference() {
        let a = [1.0f32, 2.0, 3.0, -1.0];
        let s = compare(&a, &a, 2);
        assert_eq!(s.kl, 0.0);
        assert!(s.same_top);
        assert!((s.nll - s.nll_ref).abs() < 1e-12);
        let b = [1.0f32, 2.0, 2.5, -1.0];
        let c = [1.0f32, 3.5, 2.5, -1.0];
        let (sb, sc) = (compare(&a, &b, 2), compare(&a, &c, 2));
        assert!(sb.kl > 0.0 && sc.kl > sb.kl, "{} {}", sb.kl, sc.kl);
        assert!(sb.same_top && !sc.same_top);
        // KL by hand for the two-token case: p = softmax(0, 0) vs q = softmax(0, ln 3).
        let s = compare(&[0.0, 0.0], &[0.0, 3f32.ln()], 0);
        let expect = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
        assert!((s.kl - expect).abs() < 1e-7, "{} vs {expect}", s.kl);
    }

    #[test]
    fn non_finite_logits_are_not_hidden() {
        let s = compare(&[0.0, 1.0], &[f32::NAN, 1.0], 0);
        assert!(s.kl.is_nan());
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 0.999), 100.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
