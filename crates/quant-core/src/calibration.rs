//! Static calibration: value ranges gathered once from representative tensors, stored in a
//! file, and used instead of dynamic ranges (for per-tensor and per-head specs, whose ranges
//! cannot be known while tokens stream in, or for per-channel specs without a residual window).
//!
//! Ranges are kept per (layer, KV head, channel) for keys and values; coarser groups take the
//! union. Optional percentile clipping ignores the most extreme values, trading a few clamped
//! outliers for a finer step everywhere else.
//!
//! Serialization goes through a private wire struct and is validated on load: a wrong format
//! version, inconsistent lengths, non-finite or inverted ranges are errors.

use crate::error::{QuantError, Result};
use crate::format::Granularity;
use crate::tensor::Tensor;

/// The version written by this crate and the only one it reads.
pub const CALIBRATION_VERSION: u32 = 1;
const FORMAT_TAG: &str = "kvq-calibration";

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// Keys.
    K,
    /// Values.
    V,
}

/// Per-channel ranges of one layer: `[heads, head_dim]`, row-major.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRanges {
    /// Minimum per (head, channel).
    pub min: Vec<f32>,
    /// Maximum per (head, channel).
    pub max: Vec<f32>,
}

/// Validated static ranges for every layer, KV head and channel of a model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "CalibrationWire", into = "CalibrationWire")]
pub struct Calibration {
    heads: usize,
    head_dim: usize,
    percentile: Option<f64>,
    k: Vec<LayerRanges>,
    v: Vec<LayerRanges>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CalibrationWire {
    format: String,
    version: u32,
    heads: usize,
    head_dim: usize,
    percentile: Option<f64>,
    k: Vec<LayerRanges>,
    v: Vec<LayerRanges>,
}

impl TryFrom<CalibrationWire> for Calibration {
    type Error = QuantError;

    fn try_from(w: CalibrationWire) -> Result<Self> {
        if w.format != FORMAT_TAG {
            return Err(QuantError::InvalidArgument(format!(
                "not a calibration file (format {:?})",
                w.format
            )));
        }
        if w.version != CALIBRATION_VERSION {
            return Err(QuantError::InvalidArgument(format!(
                "calibration version {} is not supported (this build reads version {CALIBRATION_VERSION})",
                w.version
            )));
        }
        let c =
            Calibration { heads: w.heads, head_dim: w.head_dim, percentile: w.percentile, k: w.k, v: w.v };
        c.validate()?;
        Ok(c)
    }
}

impl From<Calibration> for CalibrationWire {
    fn from(c: Calibration) -> Self {
        CalibrationWire {
            format: FORMAT_TAG.into(),
            version: CALIBRATION_VERSION,
            heads: c.heads,
            head_dim: c.head_dim,
            percentile: c.percentile,
            k: c.k,
            v: c.v,
        }
    }
}

impl Calibration {
    /// Gathers ranges from sample keys and values, one tensor of each per layer, each shaped
    /// `[batch, kv heads, tokens, head_dim]`. With `percentile = Some(p)` (50 < p ≤ 100) each
    /// channel's range runs from its `100 − p` to its `p` percentile instead of min to max.
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] for no layers, a different number of K and V tensors or
    /// a percentile out of range; [`QuantError::ShapeMismatch`] for tensors of different heads
    /// or head_dim; [`QuantError::EmptyTensor`] and [`QuantError::NonFinite`] for bad data.
    pub fn from_tensors(k: &[Tensor], v: &[Tensor], percentile: Option<f64>) -> Result<Self> {
        if k.is_empty() || k.len() != v.len() {
            return Err(QuantError::InvalidArgument(format!(
                "calibration needs one K and one V tensor per layer, got {} and {}",
                k.len(),
                v.len()
            )));
        }
        if let Some(p) = percentile
            && !(p > 50.0 && p <= 100.0)
        {
            return Err(QuantError::InvalidArgument(format!("percentile {p} is not in (50, 100]")));
        }
        let s0 = k[0].shape();
        for t in k.iter().chain(v) {
            let s = t.shape();
            if s.heads != s0.heads || s.head_dim != s0.head_dim {
                return Err(QuantError::ShapeMismatch {
                    expected: format!("{} heads of {} channels", s0.heads, s0.head_dim),
                    got: s.to_string(),
                });
            }
            t.validate()?;
        }
        let ranges = |t: &Tensor| channel_ranges(t, percentile);
        Ok(Self {
            heads: s0.heads,
            head_dim: s0.head_dim,
            percentile,
            k: k.iter().map(ranges).collect(),
            v: v.iter().map(ranges).collect(),
        })
    }

    fn validate(&self) -> Result<()> {
        if self.k.is_empty() || self.k.len() != self.v.len() || self.heads == 0 || self.head_dim == 0 {
            return Err(QuantError::InvalidArgument("calibration has no layers, heads or channels".into()));
        }
        let n = self.heads.checked_mul(self.head_dim).ok_or_else(|| {
            QuantError::InvalidArgument(format!(
                "calibration of {} heads × {} channels overflows",
                self.heads, self.head_dim
            ))
        })?;
        for (i, r) in self.k.iter().chain(&self.v).enumerate() {
            if r.min.len() != n || r.max.len() != n {
                return Err(QuantError::ShapeMismatch {
                    expected: format!("{n} ranges per layer ({} heads × {})", self.heads, self.head_dim),
                    got: format!("{} minima and {} maxima in entry {i}", r.min.len(), r.max.len()),
                });
            }
            if r.min.iter().zip(&r.max).any(|(a, b)| !(a.is_finite() && b.is_finite() && a <= b)) {
                return Err(QuantError::InvalidArgument(format!(
                    "entry {i} has a non-finite or inverted range"
                )));
            }
        }
        Ok(())
    }

    /// Layers covered.
    pub fn layers(&self) -> usize {
        self.k.len()
    }

    /// KV heads per layer.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The clipping percentile, if any.
    pub fn percentile(&self) -> Option<f64> {
        self.percentile
    }

    /// The calibration of one layer alone (for a cache that holds that layer only).
    ///
    /// # Panics
    /// When `layer` is out of range (callers check against [`Calibration::layers`]).
    pub fn layer_subset(&self, layer: usize) -> Calibration {
        Calibration {
            heads: self.heads,
            head_dim: self.head_dim,
            percentile: self.percentile,
            k: vec![self.k[layer].clone()],
            v: vec![self.v[layer].clone()],
        }
    }

    /// Per-channel ranges of `part` in `layer`.
    pub fn layer(&self, part: Part, layer: usize) -> Option<&LayerRanges> {
        match part {
            Part::K => self.k.get(layer),
            Part::V => self.v.get(layer),
        }
    }

    /// The static `(min, max)` of each group a row of `head` uses under `granularity`:
    /// one for per-tensor (the whole layer) and per-head, `head_dim` for per-channel.
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] for a layer or head out of range or a granularity that
    /// has no static form (per-token, groups: their ranges are the data's own).
    pub fn group_ranges(
        &self,
        part: Part,
        layer: usize,
        head: usize,
        granularity: Granularity,
    ) -> Result<Vec<(f32, f32)>> {
        let r = self.layer(part, layer).filter(|_| head < self.heads).ok_or_else(|| {
            QuantError::InvalidArgument(format!("no calibration for layer {layer}, head {head}"))
        })?;
        let d = self.head_dim;
        let union = |lo: &[f32], hi: &[f32]| {
            (
                lo.iter().copied().fold(f32::INFINITY, f32::min),
                hi.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            )
        };
        let head_slice = head * d..(head + 1) * d;
        Ok(match granularity {
            Granularity::PerTensor => vec![union(&r.min, &r.max)],
            Granularity::PerHead => vec![union(&r.min[head_slice.clone()], &r.max[head_slice])],
            Granularity::PerChannel { .. } => {
                r.min[head_slice.clone()].iter().copied().zip(r.max[head_slice].iter().copied()).collect()
            }
            Granularity::PerToken | Granularity::Group(_) => {
                return Err(QuantError::InvalidArgument(format!(
                    "{granularity:?} ranges come from the data, not a calibration"
                )));
            }
        })
    }
}

/// Per-(head, channel) ranges over all batches and tokens.
fn channel_ranges(t: &Tensor, percentile: Option<f64>) -> LayerRanges {
    let s = t.shape();
    let d = s.head_dim;
    let mut min = vec![f32::INFINITY; s.heads * d];
    let mut max = vec![f32::NEG_INFINITY; s.heads * d];
    let mut column = Vec::with_capacity(s.batch * s.tokens);
    for h in 0..s.heads {
        for c in 0..d {
            column.clear();
            for b in 0..s.batch {
                column.extend((0..s.tokens).map(|tok| t.row(b, h, tok)[c]));
            }
            let (lo, hi) = match percentile {
                None => {
                    column.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)))
                }
                Some(p) => {
                    column.sort_by(f32::total_cmp);
                    let at = |q: f64| column[((q / 100.0) * (column.len() - 1) as f64).round() as usize];
                    (at(100.0 - p), at(p))
                }
            };
            min[h * d + c] = lo;
            max[h * d + c] = hi;
        }
    }
    LayerRanges { min, max }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    fn sample() -> (Tensor, Tensor) {
        let s = Shape::new(2, 101, 4);
        let k = Tensor::new(s, (0..s.len()).map(|i| (i % 101) as f32 - 50.0 + (i / 404) as f32).collect())
            .unwrap();
        let v = Tensor::new(s, (0..s.len()).map(|i| ((i * 7) % 13) as f32).collect()).unwrap();
        (k, v)
    }

    #[test]
    fn ranges_and_groups() {
        let (k, v) = sample();
        let c = Calibration::from_tensors(std::slice::from_ref(&k), std::slice::from_ref(&v), None).unwrap();
        let ch = c.group_ranges(Part::K, 0, 1, Granularity::PerChannel { token_group: None }).unwrap();
        assert_eq!(ch.len(), 4);
        let head = c.group_ranges(Part::K, 0, 1, Granularity::PerHead).unwrap();
        let tensor = c.group_ranges(Part::K, 0, 0, Granularity::PerTensor).unwrap();
        assert!(tensor[0].0 <= head[0].0 && tensor[0].1 >= head[0].1);
        assert!(c.group_ranges(Part::V, 0, 0, Granularity::PerToken).is_err());
        assert!(c.group_ranges(Part::V, 1, 0, Granularity::PerHead).is_err());
        assert!(c.group_ranges(Part::V, 0, 2, Granularity::PerHead).is_err());

        let clipped = Calibration::from_tensors(&[k], &[v], Some(90.0)).unwrap();
        let cr = clipped.group_ranges(Part::K, 0, 0, Granularity::PerChannel { token_group: None }).unwrap();
        let full = c.group_ranges(Part::K, 0, 0, Granularity::PerChannel { token_group: None }).unwrap();
        assert!(cr[0].1 < full[0].1 && cr[0].0 > full[0].0);
    }

    #[test]
    fn serde_round_trip_and_validation() {
        let (k, v) = sample();
        let c = Calibration::from_tensors(&[k], &[v], Some(99.0)).unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains("\"format\":\"kvq-calibration\"") && json.contains("\"version\":1"));
        assert_eq!(serde_json::from_str::<Calibration>(&json).unwrap(), c);
        for (from, to) in [
            ("\"version\":1", "\"version\":2"),
            ("\"heads\":2", "\"heads\":3"),
            ("\"kvq-calibration\"", "\"other\""),
        ] {
            let bad = json.replacen(from, to, 1);
            assert!(serde_json::from_str::<Calibration>(&bad).is_err(), "{to}");
        }
        let truncated = &json[..json.len() / 2];
        assert!(serde_json::from_str::<Calibration>(truncated).is_err());
    }

    #[test]
    fn bad_inputs() {
        let (k, v) = sample();
        assert!(Calibration::from_tensors(&[], &[], None).is_err());
        assert!(Calibration::from_tensors(std::slice::from_ref(&k), &[], None).is_err());
        assert!(
            Calibration::from_tensors(std::slice::from_ref(&k), std::slice::from_ref(&v), Some(30.0))
                .is_err()
        );
        let other = Tensor::new(Shape::new(3, 1, 4), vec![0.0; 12]).unwrap();
        assert!(Calibration::from_tensors(std::slice::from_ref(&k), &[other], None).is_err());
        let mut data = v.data().to_vec();
        data[5] = f32::NAN;
        let nan = Tensor::new(v.shape(), data).unwrap();
        assert!(matches!(Calibration::from_tensors(&[k], &[nan], None), Err(QuantError::NonFinite { .. })));
    }
}
