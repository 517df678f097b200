//! Codebooks: `2^b` sorted levels in `[-1, 1]`, scaled per group by the group's absmax.
//!
//! NF4 (the NormalFloat levels of QLoRA) is built in; [`Codebook::fit_lloyd_max`] fits the
//! levels to data by Lloyd's algorithm (1-D k-means), which minimizes the mean squared error
//! for the sample's own distribution.

use crate::error::{QuantError, Result};

/// The NormalFloat-4 levels published with QLoRA (Dettmers et al., 2023): what
/// [`Codebook::nf4`] holds, without building a codebook.
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// A validated codebook: strictly increasing, finite levels in `[-1, 1]`, a power of two of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    levels: Vec<f32>,
    /// Midpoints between neighbouring levels; a value's code is how many lie below it.
    bounds: Vec<f32>,
}

impl Codebook {
    /// Builds a codebook from explicit levels.
    ///
    /// # Errors
    /// [`QuantError::InvalidSpec`] unless there are 2 to 256 levels, a power of two, all finite,
    /// strictly increasing and within `[-1, 1]`.
    pub fn new(levels: Vec<f32>) -> Result<Self> {
        let n = levels.len();
        if !(2..=256).contains(&n) || !n.is_power_of_two() {
            return Err(QuantError::InvalidSpec(format!(
                "a codebook needs 2^b levels (b in 1..=8), got {n}"
            )));
        }
        if levels.iter().any(|l| !l.is_finite() || l.abs() > 1.0) {
            return Err(QuantError::InvalidSpec("codebook levels must be finite and within [-1, 1]".into()));
        }
        if levels.windows(2).any(|w| w[0] >= w[1]) {
            return Err(QuantError::InvalidSpec("codebook levels must be strictly increasing".into()));
        }
        let bounds = levels.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        Ok(Self { levels, bounds })
    }

    /// The NF4 codebook.
    pub fn nf4() -> Self {
        Self::new(NF4_LEVELS.to_vec()).expect("NF4 levels are valid")
    }

    /// Fits `2^bits` levels to `samples` (values already normalized to `[-1, 1]`) with Lloyd's
    /// algorithm, starting from the sample quantiles. Levels of empty cells are spread so that
    /// the result stays strictly increasing.
    ///
    /// # Errors
    /// [`QuantError::BitsOutOfRange`] outside 1..=8, [`QuantError::InvalidArgument`] for an
    /// empty sample or values outside `[-1, 1]` (NaN included).
    pub fn fit_lloyd_max(samples: &[f32], bits: u8) -> Result<Self> {
        if !(1..=8).contains(&bits) {
            return Err(QuantError::BitsOutOfRange { format: "codebook", bits, min: 1, max: 8 });
        }
        if samples.is_empty() {
            return Err(QuantError::InvalidArgument("no samples to fit a codebook to".into()));
        }
        if samples.iter().any(|s| s.is_nan() || s.abs() > 1.0) {
            return Err(QuantError::InvalidArgument("codebook samples must lie in [-1, 1]".into()));
        }
        let n = 1usize << bits;
        let mut sorted: Vec<f64> = samples.iter().map(|&s| f64::from(s)).collect();
        sorted.sort_by(f64::total_cmp);
        let mut prefix = Vec::with_capacity(sorted.len() + 1);
        prefix.push(0.0);
        for s in &sorted {
            prefix.push(prefix.last().copied().unwrap_or(0.0) + s);
        }
        let len = sorted.len();
        let mut levels: Vec<f64> =
            (0..n).map(|i| sorted[((2 * i + 1) * len / (2 * n)).min(len - 1)]).collect();
        for _ in 0..100 {
            let mut moved = 0.0f64;
            let mut start = 0;
            for i in 0..n {
                let end = if i + 1 == n {
                    len
                } else {
                    let mid = 0.5 * (levels[i] + levels[i + 1]);
                    sorted.partition_point(|&s| s <= mid)
                };
                if end > start {
                    let mean = (prefix[end] - prefix[start]) / (end - start) as f64;
                    moved = moved.max((mean - levels[i]).abs());
                    levels[i] = mean;
                }
                start = end.max(start);
            }
            if moved < 1e-9 {
                break;
            }
        }
        Self::new(spread_strictly(levels))
    }

    /// The levels, increasing.
    pub fn levels(&self) -> &[f32] {
        &self.levels
    }

    /// Bits per code (`log2` of the number of levels).
    pub fn bits(&self) -> u8 {
        self.levels.len().trailing_zeros() as u8
    }

    /// The code of the level nearest to `v` (ties to the lower level).
    #[inline]
    pub fn encode(&self, v: f32) -> u8 {
        self.bounds.partition_point(|&b| b < v) as u8
    }

    /// The level of `code` (codes past the end saturate to the top level).
    #[inline]
    pub fn decode(&self, code: u8) -> f32 {
        self.levels[(code as usize).min(self.levels.len() - 1)]
    }
}

/// Rounds fitted levels to f32 and nudges equal neighbours apart (few distinct samples can
/// give duplicate levels), keeping them within `[-1, 1]`.
fn spread_strictly(levels: Vec<f64>) -> Vec<f32> {
    let n = levels.len();
    let mut out: Vec<f32> = levels.iter().map(|&l| (l as f32).clamp(-1.0, 1.0)).collect();
    for i in 1..n {
        if out[i] <= out[i - 1] {
            out[i] = next_up(out[i - 1]);
        }
    }
    // If nudging pushed the top past 1, walk back down from the top.
    if out[n - 1] > 1.0 {
        out[n - 1] = 1.0;
        for i in (0..n - 1).rev() {
            if out[i] >= out[i + 1] {
                out[i] = next_down(out[i + 1]);
            }
        }
    }
    out
}

fn next_up(x: f32) -> f32 {
    if x == 0.0 {
        f32::from_bits(1)
    } else if x > 0.0 {
        f32::from_bits(x.to_bits() + 1)
    } else {
        f32::from_bits(x.to_bits() - 1)
    }
}

fn next_down(x: f32) -> f32 {
    -next_up(-x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nf4_encodes_to_nearest() {
        let cb = Codebook::nf4();
        assert_eq!(cb.bits(), 4);
        for (i, &l) in cb.levels().iter().enumerate() {
            assert_eq!(cb.encode(l), i as u8);
        }
        assert_eq!(cb.encode(-5.0), 0);
        assert_eq!(cb.encode(5.0), 15);
        assert_eq!(cb.decode(cb.encode(0.01)), 0.0);
    }

    #[test]
    fn lloyd_max_fits_clusters() {
        let mut samples = Vec::new();
        for c in [-0.9f32, -0.3, 0.2, 0.8] {
            samples.extend((0..50).map(|i| c + (i as f32 - 25.0) * 1e-4));
        }
        let cb = Codebook::fit_lloyd_max(&samples, 2).unwrap();
        for (l, c) in cb.levels().iter().zip([-0.9f32, -0.3, 0.2, 0.8]) {
            assert!((l - c).abs() < 1e-3, "{:?}", cb.levels());
        }
    }

    #[test]
    fn lloyd_max_survives_degenerate_samples() {
        let cb = Codebook::fit_lloyd_max(&[0.5; 10], 3).unwrap();
        assert_eq!(cb.levels().len(), 8);
        assert!(cb.levels().windows(2).all(|w| w[0] < w[1]));
        assert!(Codebook::fit_lloyd_max(&[], 3).is_err());
        assert!(Codebook::fit_lloyd_max(&[f32::NAN], 3).is_err());
        assert!(Codebook::fit_lloyd_max(&[0.1], 9).is_err());
    }

    #[test]
    fn rejects_bad_levels() {
        assert!(Codebook::new(vec![0.0, 0.5, 0.2, 1.0]).is_err());
        assert!(Codebook::new(vec![0.0, 0.5, 1.0]).is_err());
        assert!(Codebook::new(vec![0.0, 2.0]).is_err());
        assert!(Codebook::new(vec![0.0, f32::NAN]).is_err());
    }
}
