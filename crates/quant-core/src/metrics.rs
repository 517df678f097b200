//! Fidelity metrics: element-wise errors and the errors quantization causes in attention.
//!
//! All sums run in f64. Attention follows the usual decoder convention: causal, scaled by
//! `1/sqrt(head_dim)`, softmax over the keys `0..=position`; with grouped-query attention,
//! query head `h` reads KV head `h / (query_heads / kv_heads)`.

use crate::error::{QuantError, Result};
use crate::tensor::Tensor;

/// Element-wise error of an approximation.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ErrorStats {
    /// Mean squared error.
    pub mse: f64,
    /// MSE divided by the mean square of the reference (+∞ when the reference is all zeros
    /// and the error is not).
    pub nmse: f64,
    /// Cosine similarity of the flattened tensors (1 when both are all zeros).
    pub cosine: f64,
    /// Largest absolute error.
    pub max_abs: f64,
    /// Signal-to-noise ratio in dB (+∞ for an exact approximation).
    pub snr_db: f64,
}

fn same_len(a: usize, b: usize) -> Result<()> {
    if a != b {
        return Err(QuantError::ShapeMismatch {
            expected: format!("{a} elements"),
            got: format!("{b} elements"),
        });
    }
    if a == 0 {
        return Err(QuantError::InvalidArgument("no elements to compare".into()));
    }
    Ok(())
}

/// Errors of `approx` against `reference`.
///
/// # Errors
/// [`QuantError::ShapeMismatch`] for different lengths, [`QuantError::InvalidArgument`] for
/// empty inputs, [`QuantError::NonFinite`] for NaN or ±Inf in either.
pub fn error_stats(reference: &[f32], approx: &[f32]) -> Result<ErrorStats> {
    same_len(reference.len(), approx.len())?;
    let mut bad = reference.iter().chain(approx).enumerate().filter(|(_, v)| !v.is_finite());
    if let Some((i, &v)) = bad.next() {
        return Err(QuantError::NonFinite { position: [0, 0, 0, i % reference.len()], value: v });
    }
    let (mut err2, mut ref2, mut app2, mut dot, mut max_abs) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for (&r, &a) in reference.iter().zip(approx) {
        let (r, a) = (f64::from(r), f64::from(a));
        let e = a - r;
        err2 += e * e;
        ref2 += r * r;
        app2 += a * a;
        dot += r * a;
        max_abs = max_abs.max(e.abs());
    }
    let n = reference.len() as f64;
    let ratio = |num: f64, den: f64| {
        if num == 0.0 {
            0.0
        } else if den == 0.0 {
            f64::INFINITY
        } else {
            num / den
        }
    };
    let cosine = if ref2 == 0.0 && app2 == 0.0 {
        1.0
    } else if ref2 == 0.0 || app2 == 0.0 {
        0.0
    } else {
        dot / (ref2.sqrt() * app2.sqrt())
    };
    let nmse = ratio(err2, ref2);
    Ok(ErrorStats {
        mse: err2 / n,
        nmse,
        cosine,
        max_abs,
        snr_db: if nmse == 0.0 { f64::INFINITY } else { -10.0 * nmse.log10() },
    })
}

/// Attention outputs and probabilities for chosen query positions, computed in f64.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutputs {
    positions: Vec<usize>,
    batch: usize,
    query_heads: usize,
    head_dim: usize,
    /// `[batch, position index, query head, head_dim]`.
    outputs: Vec<f64>,
    /// For each `(batch, position index, query head)`, the `position + 1` probabilities.
    probs: Vec<Vec<f64>>,
}

impl AttentionOutputs {
    /// The query positions.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Outputs, `[batch, position index, query head, head_dim]`.
    pub fn outputs(&self) -> &[f64] {
        &self.outputs
    }

    /// Attention probabilities for `(batch, position index, query head)`.
    pub fn probs(&self, batch: usize, pos_index: usize, head: usize) -> &[f64] {
        &self.probs[(batch * self.positions.len() + pos_index) * self.query_heads + head]
    }

    /// Output vector for `(batch, position index, query head)`.
    pub fn output(&self, batch: usize, pos_index: usize, head: usize) -> &[f64] {
        let i = ((batch * self.positions.len() + pos_index) * self.query_heads + head) * self.head_dim;
        &self.outputs[i..i + self.head_dim]
    }

    /// The attention of `parts`, one after another, as if computed in one call at all their
    /// positions: how a streaming cache is compared, where the keys and values that a query
    /// sees depend on how far the cache had got (each part computed against the cache as it
    /// stood at its positions).
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] for no parts; [`QuantError::ShapeMismatch`] when the
    /// parts differ in batch, query heads or head_dim.
    pub fn concat(parts: &[AttentionOutputs]) -> Result<AttentionOutputs> {
        let first =
            parts.first().ok_or_else(|| QuantError::InvalidArgument("no attention to join".into()))?;
        let (batch, heads, d) = (first.batch, first.query_heads, first.head_dim);
        if let Some(p) = parts.iter().find(|p| (p.batch, p.query_heads, p.head_dim) != (batch, heads, d)) {
            return Err(QuantError::ShapeMismatch {
                expected: format!("batch {batch}, {heads} query heads, head_dim {d}"),
                got: format!("batch {}, {} query heads, head_dim {}", p.batch, p.query_heads, p.head_dim),
            });
        }
        let mut out = AttentionOutputs {
            positions: parts.iter().flat_map(|p| p.positions.iter().copied()).collect(),
            batch,
            query_heads: heads,
            head_dim: d,
            outputs: Vec::with_capacity(parts.iter().map(|p| p.outputs.len()).sum()),
            probs: Vec::with_capacity(parts.iter().map(|p| p.probs.len()).sum()),
        };
        // Layout `[batch, position, head, ...]`: batch entries are outermost, so each part
        // contributes one run of rows per batch entry.
        for b in 0..batch {
            for p in parts {
                let rows = p.positions.len() * heads;
                out.outputs.extend_from_slice(&p.outputs[b * rows * d..(b + 1) * rows * d]);
                out.probs.extend(p.probs[b * rows..(b + 1) * rows].iter().cloned());
            }
        }
        Ok(out)
    }
}

/// Causal softmax attention of `q` against `k`/`v` at `positions`.
///
/// # Errors
/// [`QuantError::ShapeMismatch`] when batch, tokens or head_dim disagree, K and V have
/// different heads, or the query heads are not a multiple of the KV heads;
/// [`QuantError::InvalidArgument`] for no positions or a position past the end;
/// [`QuantError::EmptyTensor`] / [`QuantError::NonFinite`] for bad data.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, positions: &[usize]) -> Result<AttentionOutputs> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if ks != vs {
        return Err(QuantError::ShapeMismatch {
            expected: format!("V shaped like K {ks}"),
            got: vs.to_string(),
        });
    }
    if qs.batch != ks.batch
        || qs.tokens != ks.tokens
        || qs.head_dim != ks.head_dim
        || ks.heads == 0
        || qs.heads % ks.heads != 0
    {
        return Err(QuantError::ShapeMismatch {
            expected: format!("Q with the batch, tokens and head_dim of K {ks} and a multiple of its heads"),
            got: qs.to_string(),
        });
    }
    if positions.is_empty() {
        return Err(QuantError::InvalidArgument("no query positions".into()));
    }
    if let Some(&p) = positions.iter().find(|&&p| p >= ks.tokens) {
        return Err(QuantError::InvalidArgument(format!("query position {p} past the {} tokens", ks.tokens)));
    }
    for t in [q, k, v] {
        t.validate()?;
    }
    let d = ks.head_dim;
    let group = qs.heads / ks.heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut outputs = Vec::with_capacity(qs.batch * positions.len() * qs.heads * d);
    let mut probs = Vec::with_capacity(qs.batch * positions.len() * qs.heads);
    for b in 0..qs.batch {
        for &p in positions {
            for h in 0..qs.heads {
                let kv = h / group;
                let qrow: Vec<f64> = q.row(b, h, p).iter().map(|&x| f64::from(x)).collect();
                let mut s: Vec<f64> = (0..=p)
                    .map(|t| {
                        k.row(b, kv, t).iter().zip(&qrow).map(|(&kk, &qq)| f64::from(kk) * qq).sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let mut sum = 0.0;
                for x in &mut s {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let mut out = vec![0f64; d];
                for (t, x) in s.iter_mut().enumerate() {
                    *x /= sum;
                    for (o, &vv) in out.iter_mut().zip(v.row(b, kv, t)) {
                        *o += *x * f64::from(vv);
                    }
                }
                outputs.extend_from_slice(&out);
                probs.push(s);
            }
        }
    }
    Ok(AttentionOutputs {
        positions: positions.to_vec(),
        batch: qs.batch,
        query_heads: qs.heads,
        head_dim: d,
        outputs,
        probs,
    })
}

/// How far approximate attention is from a reference.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct AttentionError {
    /// `‖o − ô‖ / ‖o‖` over all positions and heads.
    pub output_rel_l2: f64,
    /// Mean over positions and heads of `KL(p ‖ p̂)` (nats).
    pub kl_mean: f64,
    /// Largest `KL(p ‖ p̂)` of any position and head (nats).
    pub kl_max: f64,
}

/// Compares attention computed with quantized K and/or V against the reference.
///
/// # Errors
/// [`QuantError::ShapeMismatch`] when the two were computed for different shapes or positions.
pub fn compare_attention(reference: &AttentionOutputs, approx: &AttentionOutputs) -> Result<AttentionError> {
    let heads = reference.query_heads;
    Ok(compare_attention_grouped(reference, approx, heads.max(1))?.pop().unwrap_or(AttentionError {
        output_rel_l2: 0.0,
        kl_mean: 0.0,
        kl_max: 0.0,
    }))
}

/// Like [`compare_attention`], but one result per group of `group` consecutive query heads
/// (pass `query_heads / kv_heads` for one result per KV head of a GQA layer, `1` for one per
/// query head). Each result pools its heads' outputs and probabilities over every batch entry
/// and position.
///
/// # Errors
/// [`QuantError::ShapeMismatch`] as for [`compare_attention`];
/// [`QuantError::InvalidArgument`] when `group` is zero or does not divide the query heads.
pub fn compare_attention_grouped(
    reference: &AttentionOutputs,
    approx: &AttentionOutputs,
    group: usize,
) -> Result<Vec<AttentionError>> {
    if reference.positions != approx.positions
        || reference.batch != approx.batch
        || reference.query_heads != approx.query_heads
        || reference.head_dim != approx.head_dim
    {
        return Err(QuantError::ShapeMismatch {
            expected: "attention at the same positions and shape".into(),
            got: "different positions or shape".into(),
        });
    }
    let heads = reference.query_heads;
    if group == 0 || !heads.is_multiple_of(group) {
        return Err(QuantError::InvalidArgument(format!(
            "a group of {group} query heads does not divide {heads} heads"
        )));
    }
    let groups = heads / group;
    // Per group: squared error, squared reference, KL sum, KL max, probability rows.
    let mut acc = vec![(0f64, 0f64, 0f64, 0f64, 0usize); groups];
    let d = reference.head_dim;
    let rows = reference.outputs.len() / d.max(1);
    for row in 0..rows {
        let a = &mut acc[(row % heads) / group];
        let (r, x) = (&reference.outputs[row * d..(row + 1) * d], &approx.outputs[row * d..(row + 1) * d]);
        for (&r, &x) in r.iter().zip(x) {
            a.0 += (x - r) * (x - r);
            a.1 += r * r;
        }
        // Terms with p = 0 contribute nothing; p̂ underflowing to 0 where p > 0 is capped at
        // the smallest positive f64 so that the divergence stays finite.
        let kl: f64 = reference.probs[row]
            .iter()
            .zip(&approx.probs[row])
            .filter(|(pi, _)| **pi > 0.0)
            .map(|(&pi, &qi)| pi * (pi / qi.max(f64::MIN_POSITIVE)).ln())
            .sum();
        let kl = kl.max(0.0);
        a.2 += kl;
        a.3 = a.3.max(kl);
        a.4 += 1;
    }
    Ok(acc
        .into_iter()
        .map(|(e2, r2, kl_sum, kl_max, n)| AttentionError {
            output_rel_l2: if e2 == 0.0 {
                0.0
            } else if r2 == 0.0 {
                f64::INFINITY
            } else {
                (e2 / r2).sqrt()
            },
            kl_mean: kl_sum / n.max(1) as f64,
            kl_max,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    #[test]
    fn error_stats_basics() {
        let e = error_stats(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!((e.mse, e.cosine, e.max_abs, e.nmse), (0.0, 1.0, 0.0, 0.0));
        assert_eq!(e.snr_db, f64::INFINITY);
        let e = error_stats(&[1.0, -1.0], &[1.5, -1.0]).unwrap();
        assert!((e.mse - 0.125).abs() < 1e-12);
        assert!((e.nmse - 0.125).abs() < 1e-12);
        assert!((e.max_abs - 0.5).abs() < 1e-12);
        assert!((e.snr_db - 9.0309).abs() < 1e-3);
        let z = error_stats(&[0.0, 0.0], &[0.0, 0.0]).unwrap();
        assert_eq!(z.cosine, 1.0);
        assert!(error_stats(&[1.0], &[1.0, 2.0]).is_err());
        assert!(error_stats(&[], &[]).is_err());
        assert!(matches!(error_stats(&[1.0, f32::NAN], &[1.0, 1.0]), Err(QuantError::NonFinite { .. })));
    }

    #[test]
    fn attention_of_one_token_is_its_value() {
        let q = Tensor::new(Shape::new(2, 1, 2), vec![1.0, 0.0, 0.0, 1.0]).unwrap();
        let k = Tensor::new(Shape::new(1, 1, 2), vec![3.0, 4.0]).unwrap();
        let v = Tensor::new(Shape::new(1, 1, 2), vec![5.0, -6.0]).unwrap();
        let a = attention(&q, &k, &v, &[0]).unwrap();
        assert_eq!(a.output(0, 0, 0), &[5.0, -6.0]);
        assert_eq!(a.output(0, 0, 1), &[5.0, -6.0]);
        assert_eq!(a.probs(0, 0, 1), &[1.0]);
    }

    #[test]
    fn grouped_comparison_separates_kv_heads() {
        // Four query heads over two KV heads; only KV head 1's values are perturbed, so the
        // first group is exact and the second carries all of the error.
        let shape = Shape::new(2, 6, 4);
        let q = crate::synth::normal_tensor(Shape::new(4, 6, 4), 7);
        let k = crate::synth::normal_tensor(shape, 8);
        let v = crate::synth::normal_tensor(shape, 9);
        let mut v2 = v.clone().into_data();
        for x in &mut v2[24..] {
            *x += 0.25;
        }
        let v2 = Tensor::new(shape, v2).unwrap();
        let r = attention(&q, &k, &v, &[3, 5]).unwrap();
        let a = attention(&q, &k, &v2, &[3, 5]).unwrap();
        let per_kv = compare_attention_grouped(&r, &a, 2).unwrap();
        assert_eq!(per_kv.len(), 2);
        assert_eq!(per_kv[0].output_rel_l2, 0.0);
        assert!(per_kv[1].output_rel_l2 > 0.01);
        let all = compare_attention(&r, &a).unwrap();
        assert!(all.output_rel_l2 > 0.0 && all.output_rel_l2 < per_kv[1].output_rel_l2);
        assert_eq!(compare_attention_grouped(&r, &a, 4).unwrap(), vec![all]);
        assert_eq!(compare_attention_grouped(&r, &a, 1).unwrap().len(), 4);
        assert!(compare_attention_grouped(&r, &a, 3).is_err());
        assert!(compare_attention_grouped(&r, &a, 0).is_err());
    }

    #[test]
    fn joined_parts_equal_one_call() {
        // Batch 2, so that the join must interleave the parts per batch entry; each part is
        // computed on the prefix a streaming cache would hold at its position.
        let q = crate::synth::normal_tensor(Shape::with_batch(2, 4, 7, 4), 1);
        let k = crate::synth::normal_tensor(Shape::with_batch(2, 2, 7, 4), 2);
        let v = crate::synth::normal_tensor(Shape::with_batch(2, 2, 7, 4), 3);
        let whole = attention(&q, &k, &v, &[2, 4, 6]).unwrap();
        let parts: Vec<_> = [2usize, 4, 6]
            .iter()
            .map(|&p| {
                let at = |t: &Tensor| t.prefix(p + 1).unwrap();
                attention(&at(&q), &at(&k), &at(&v), &[p]).unwrap()
            })
            .collect();
        assert_eq!(AttentionOutputs::concat(&parts).unwrap(), whole);
        assert!(AttentionOutputs::concat(&[]).is_err());
        let other = attention(&q.prefix(3).unwrap(), &k.prefix(3).unwrap(), &v.prefix(3).unwrap(), &[2]);
        let one_batch = |t: &Tensor| {
            let s = t.shape();
            Tensor::new(Shape::new(s.heads, s.tokens, s.head_dim), t.data()[..t.data().len() / 2].to_vec())
                .unwrap()
        };
        let single = attention(&one_batch(&q), &one_batch(&k), &one_batch(&v), &[2]).unwrap();
        assert!(matches!(
            AttentionOutputs::concat(&[other.unwrap(), single]),
            Err(QuantError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn attention_weights_follow_scores() {
        // Two keys; the query aligns with the second: p = softmax([0, 2] / sqrt(2)).
        let q = Tensor::new(Shape::new(1, 2, 2), vec![0.0, 0.0, 0.0, 2.0]).unwrap();
        let k = Tensor::new(Shape::new(1, 2, 2), vec![1.0, 0.0, 0.0, 1.0]).unwrap();
        let v = Tensor::new(Shape::new(1, 2, 2), vec![1.0, 0.0, 0.0, 1.0]).unwrap();
        let a = attention(&q, &k, &v, &[1]).unwrap();
        let e = (2.0f64 / 2f64.sqrt()).exp();
        let p1 = e / (1.0 + e);
        assert!((a.probs(0, 0, 0)[1] - p1).abs() < 1e-12);
        assert!((a.output(0, 0, 0)[1] - p1).abs() < 1e-12);
        let same = compare_attention(&a, &a).unwrap();
        assert_eq!((same.output_rel_l2, same.kl_mean), (0.0, 0.0));
    }

    #[test]
    fn attention_rejects_bad_shapes() {
        let t = |h, n| Tensor::new(Shape::new(h, n, 2), vec![0.5; h * n * 2]).unwrap();
        assert!(attention(&t(3, 4), &t(2, 4), &t(2, 4), &[0]).is_err());
        assert!(attention(&t(2, 4), &t(2, 4), &t(1, 4), &[0]).is_err());
        assert!(attention(&t(2, 4), &t(2, 4), &t(2, 4), &[4]).is_err());
        assert!(attention(&t(2, 4), &t(2, 4), &t(2, 4), &[]).is_err());
    }
}
