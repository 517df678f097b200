//! Which channels of a head rotate together under rotary position embeddings (RoPE).
//!
//! After RoPE, channels `a` and `b` of a pair are the two coordinates of one rotating 2-D
//! vector: a quantizer that works on pairs (bits per frequency, 2-D codebooks) must know which
//! channels those are. Checkpoints differ: Hugging Face Llama checkpoints (and the shared
//! captures of this project) rotate the halves of a head, `(i, i + d/2)`; GGUF Llama weights
//! are permuted for llama.cpp's interleaved pairs, `(2i, 2i + 1)`.
//!
//! [`Rope`] holds a model's frequencies as well and applies or undoes the rotation of whole
//! tensors, for keys quantized in their frame before RoPE (`-prerope` specs).

use crate::error::{QuantError, Result};
use crate::tensor::Tensor;

/// How a head's channels pair under RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RopePairing {
    /// Pair `i` is channels `(2i, 2i + 1)` (llama.cpp's "normal" RoPE, GGUF Llama weights).
    Interleaved,
    /// Pair `i` is channels `(i, i + d/2)` (rotate-half, "NeoX"; Hugging Face checkpoints).
    Half,
}

impl RopePairing {
    /// The two channels of pair `i` in a head of `head_dim` channels (`i < head_dim / 2`).
    pub fn channels(self, i: usize, head_dim: usize) -> (usize, usize) {
        match self {
            RopePairing::Interleaved => (2 * i, 2 * i + 1),
            RopePairing::Half => (i, i + head_dim / 2),
        }
    }

    /// The lower-case name used in configs (`"interleaved"`, `"half"`).
    pub fn name(self) -> &'static str {
        match self {
            RopePairing::Interleaved => "interleaved",
            RopePairing::Half => "half",
        }
    }
}

/// A model's rotary position embedding: pair `i` of a head (channels
/// [`RopePairing::channels`]) rotates by `position · inv_freq[i]` radians, `(a, b)` becoming
/// `(a cos − b sin, b cos + a sin)`. Angles are computed in f64; the rotation is orthonormal,
/// so [`Rope::undo`] followed by [`Rope::apply`] gives a tensor back to f32 rounding.
///
/// Serialized (cache configs, offload headers) as `{ "inv_freq": [...], "pairing": "half" }`,
/// checked as [`Rope::new`] checks it when read.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "RopeWire", into = "RopeWire")]
pub struct Rope {
    inv_freq: Vec<f64>,
    pairing: RopePairing,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RopeWire {
    inv_freq: Vec<f64>,
    pairing: RopePairing,
}

impl TryFrom<RopeWire> for Rope {
    type Error = QuantError;

    fn try_from(w: RopeWire) -> Result<Self> {
        Rope::from_f64(w.inv_freq, w.pairing)
    }
}

impl From<Rope> for RopeWire {
    fn from(r: Rope) -> Self {
        RopeWire { inv_freq: r.inv_freq, pairing: r.pairing }
    }
}

impl Rope {
    /// RoPE with the given inverse frequency of each pair (a head of `2 · inv_freq.len()`
    /// channels), as models store them (`rope.inv_freq` in the shared captures; Llama 3's
    /// scaled frequencies are given this way too).
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] for no frequency, or one that is negative, NaN or
    /// infinite.
    pub fn new(inv_freq: &[f32], pairing: RopePairing) -> Result<Self> {
        Self::from_f64(inv_freq.iter().map(|&f| f64::from(f)).collect(), pairing)
    }

    /// [`Rope::new`] with f64 frequencies.
    ///
    /// # Errors
    /// As [`Rope::new`], and for more than 2^15 frequencies.
    pub fn from_f64(inv_freq: Vec<f64>, pairing: RopePairing) -> Result<Self> {
        if inv_freq.is_empty() || inv_freq.len() > 1 << 15 {
            return Err(QuantError::InvalidArgument(format!(
                "RoPE needs 1 to 32768 frequencies, got {}",
                inv_freq.len()
            )));
        }
        if let Some((i, f)) = inv_freq.iter().enumerate().find(|(_, f)| !f.is_finite() || **f < 0.0) {
            return Err(QuantError::InvalidArgument(format!(
                "RoPE frequency {i} is {f}: frequencies are finite and not negative"
            )));
        }
        Ok(Self { inv_freq, pairing })
    }

    /// The inverse frequency of each pair.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// The standard frequencies of a base `theta`: `inv_freq[i] = theta^(-2i / head_dim)`.
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] for an odd or zero `head_dim`, or a `theta` that is not
    /// finite and above 1.
    pub fn from_theta(theta: f64, head_dim: usize, pairing: RopePairing) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(QuantError::InvalidArgument(format!(
                "RoPE rotates channel pairs: head_dim {head_dim} is not a positive even number"
            )));
        }
        if !theta.is_finite() || theta <= 1.0 {
            return Err(QuantError::InvalidArgument(format!(
                "RoPE base {theta}: expected a finite number above 1"
            )));
        }
        let inv_freq = (0..head_dim / 2).map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64)).collect();
        Ok(Self { inv_freq, pairing })
    }

    /// The channels of a head this RoPE rotates.
    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Which channels pair.
    pub fn pairing(&self) -> RopePairing {
        self.pairing
    }

    /// Rotates every row of `t` by its position, token `j` of each head being at position
    /// `first_position + j`: pre-RoPE keys become what attention reads.
    ///
    /// # Errors
    /// [`QuantError::ShapeMismatch`] when `t`'s head_dim is not [`Rope::head_dim`].
    pub fn apply(&self, t: &Tensor, first_position: usize) -> Result<Tensor> {
        self.rotate(t, first_position, 1.0)
    }

    /// Undoes [`Rope::apply`]: keys after RoPE back in their frame before it.
    ///
    /// # Errors
    /// As [`Rope::apply`].
    pub fn undo(&self, t: &Tensor, first_position: usize) -> Result<Tensor> {
        self.rotate(t, first_position, -1.0)
    }

    fn rotate(&self, t: &Tensor, first_position: usize, sign: f64) -> Result<Tensor> {
        let s = t.shape();
        let d = self.head_dim();
        if s.head_dim != d {
            return Err(QuantError::ShapeMismatch {
                expected: format!("rows of {d} channels (the RoPE's {} frequencies)", self.inv_freq.len()),
                got: format!("head_dim {}", s.head_dim),
            });
        }
        let mut data = t.data().to_vec();
        if s.tokens == 0 {
            return Tensor::new(s, data);
        }
        // Each head's run of tokens starts again at `first_position`.
        for run in data.chunks_exact_mut(s.tokens * d) {
            self.turn(run, first_position, sign);
        }
        Tensor::new(s, data)
    }

    /// Applies RoPE in place to consecutive rows of [`Rope::head_dim`] values, row `r` at
    /// position `first_position + r` (a trailing partial row is left alone).
    pub fn apply_rows(&self, rows: &mut [f32], first_position: usize) {
        self.turn(rows, first_position, 1.0);
    }

    /// Undoes [`Rope::apply_rows`].
    pub fn undo_rows(&self, rows: &mut [f32], first_position: usize) {
        self.turn(rows, first_position, -1.0);
    }

    fn turn(&self, rows: &mut [f32], first_position: usize, sign: f64) {
        let d = self.head_dim();
        // Each pair's angle steps by its frequency from row to row: one complex product per
        // pair and row, re-anchored on a direct sin_cos every 64 rows (f64 keeps the drift
        // far below f32 rounding).
        let mut turn: Vec<(f64, f64)> = vec![(1.0, 0.0); self.inv_freq.len()];
        let step: Vec<(f64, f64)> =
            self.inv_freq.iter().map(|&f| (sign * f).sin_cos()).map(|(s, c)| (c, s)).collect();
        for (r, row) in rows.chunks_exact_mut(d).enumerate() {
            let pos = (first_position + r) as f64;
            for (i, ((c, s), &(sc, ss))) in turn.iter_mut().zip(&step).enumerate() {
                (*c, *s) = if r % 64 == 0 {
                    let (sin, cos) = (sign * pos * self.inv_freq[i]).sin_cos();
                    (cos, sin)
                } else {
                    (*c * sc - *s * ss, *s * sc + *c * ss)
                };
                let (a, b) = self.pairing.channels(i, d);
                let (x, y) = (f64::from(row[a]), f64::from(row[b]));
                row[a] = (x * *c - y * *s) as f32;
                row[b] = (y * *c + x * *s) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Shape;

    #[test]
    fn rope_rotates_pairs_by_position_and_undo_inverts_it() {
        let rope = Rope::new(&[1.0, 0.5], RopePairing::Half).unwrap();
        // Two tokens of one head: positions 3 and 4 with first_position 3.
        let t = Tensor::new(Shape::new(1, 2, 4), vec![1.0, 0.0, 0.0, 2.0, 0.5, -1.0, 3.0, 0.25]).unwrap();
        let r = rope.apply(&t, 3).unwrap();
        // Token 0, pair 0 = channels (0, 2) = (1, 0) turned by 3 rad.
        assert!((r.data()[0] - 3f32.cos()).abs() < 1e-6 && (r.data()[2] - 3f32.sin()).abs() < 1e-6);
        // Token 1, pair 1 = channels (1, 3) = (-1, 0.25) turned by 4 · 0.5 rad.
        let (s, c) = 2f64.sin_cos();
        assert!((f64::from(r.data()[5]) - (-c - 0.25 * s)).abs() < 1e-6);
        assert!((f64::from(r.data()[7]) - (0.25 * c - s)).abs() < 1e-6);
        let norm = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>();
        assert!((norm(r.data()) - norm(t.data())).abs() < 1e-5);
        let back = rope.undo(&r, 3).unwrap();
        assert!(back.data().iter().zip(t.data()).all(|(a, b)| (a - b).abs() < 1e-6));
        let i = Rope::new(&[1.0, 0.5], RopePairing::Interleaved).unwrap().apply(&t, 3).unwrap();
        assert!((i.data()[1] - 3f32.sin()).abs() < 1e-6, "pair 0 is channels (0, 1)");
    }

    #[test]
    fn pre_rope_specs_parse_print_and_are_refused_by_the_plain_quantizers() {
        use crate::format::QuantSpec;
        let spec: QuantSpec = "int3-channel32-qa-prerope".parse().unwrap();
        assert!(spec.pre_rope() && spec.channel_bits());
        assert_eq!(spec.to_string(), "int3-channel32-qa-prerope");
        assert!(!"int3-channel32".parse::<QuantSpec>().unwrap().pre_rope());
        let k = Tensor::new(Shape::new(1, 32, 8), (0..256).map(|i| i as f32 / 7.0).collect()).unwrap();
        let plain: QuantSpec = "int4-channel32-prerope".parse().unwrap();
        assert!(matches!(crate::quantize::quantize(&k, &plain), Err(QuantError::InvalidSpec(_))));
        let (lo, hi) = (vec![0.0; 8], vec![40.0; 8]);
        assert!(crate::quantize::quantize_with_ranges(&k, &plain, &lo, &hi).is_err());
        let map = crate::channel_bits::ChannelBits::uniform(8, 3).unwrap();
        let e = crate::channel_bits::quantize_channel_bits(&k, &spec, &[map]).unwrap_err();
        assert!(e.to_string().contains("before RoPE"), "{e}");
    }

    #[test]
    fn stepped_turns_match_direct_ones_far_out() {
        // 200 rows from position 10^6 (three re-anchors): each value as a direct sin_cos of its
        // own angle gives it, to f32 rounding.
        let rope = Rope::from_theta(500_000.0, 128, RopePairing::Interleaved).unwrap();
        let rows: Vec<f32> = (0..200 * 128).map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0).collect();
        let mut stepped = rows.clone();
        rope.apply_rows(&mut stepped, 1_000_000);
        for (r, (row, got)) in rows.chunks_exact(128).zip(stepped.chunks_exact(128)).enumerate() {
            let pos = (1_000_000 + r) as f64;
            for (i, &f) in rope.inv_freq().iter().enumerate() {
                let (sin, cos) = (pos * f).sin_cos();
                let (x, y) = (f64::from(row[2 * i]), f64::from(row[2 * i + 1]));
                let (a, b) = ((x * cos - y * sin) as f32, (y * cos + x * sin) as f32);
                assert!(
                    (got[2 * i] - a).abs() <= 1e-5 && (got[2 * i + 1] - b).abs() <= 1e-5,
                    "row {r} pair {i}"
                );
            }
        }
    }

    #[test]
    fn rope_frequencies_and_shapes_are_checked() {
        assert!(Rope::new(&[], RopePairing::Half).is_err());
        assert!(Rope::new(&[1.0, f32::NAN], RopePairing::Half).is_err());
        assert!(Rope::new(&[-1.0], RopePairing::Half).is_err());
        assert!(Rope::from_theta(10000.0, 63, RopePairing::Half).is_err());
        assert!(Rope::from_theta(f64::INFINITY, 64, RopePairing::Half).is_err());
        let rope = Rope::from_theta(10000.0, 64, RopePairing::Half).unwrap();
        assert_eq!(rope.head_dim(), 64);
        assert_eq!(rope.inv_freq[0], 1.0);
        assert!((rope.inv_freq[16] - 0.01).abs() < 1e-12, "10000^(-1/2)");
        let t = Tensor::new(Shape::new(1, 1, 4), vec![0.0; 4]).unwrap();
        assert!(matches!(rope.apply(&t, 0), Err(QuantError::ShapeMismatch { .. })));
        // Serialized with its frequencies, checked when read back.
        let json = serde_json::to_string(&rope).unwrap();
        assert_eq!(serde_json::from_str::<Rope>(&json).unwrap(), rope);
        for bad in [r#"{"inv_freq":[1.0,-2.0],"pairing":"half"}"#, r#"{"inv_freq":[],"pairing":"half"}"#] {
            assert!(serde_json::from_str::<Rope>(bad).is_err(), "{bad}");
        }
        // Rows in place: undo after apply gives them back; a partial row is left alone.
        let mut rows: Vec<f32> = (0..64 * 3 + 5).map(|i| (i as f32 * 0.37).sin()).collect();
        let before = rows.clone();
        rope.apply_rows(&mut rows, 1000);
        assert!(rows[64..128] != before[64..128] && rows[192..] == before[192..]);
        rope.undo_rows(&mut rows, 1000);
        assert!(rows.iter().zip(&before).all(|(a, b)| (a - b).abs() < 1e-5));
    }

    #[test]
    fn pairs_cover_every_channel_once() {
        for pairing in [RopePairing::Interleaved, RopePairing::Half] {
            let mut seen = [0u8; 64];
            for i in 0..32 {
                let (a, b) = pairing.channels(i, 64);
                seen[a] += 1;
                seen[b] += 1;
            }
            assert!(seen.iter().all(|&n| n == 1), "{pairing:?}");
        }
        assert_eq!(RopePairing::Half.channels(3, 64), (3, 35));
        assert_eq!(RopePairing::Interleaved.channels(3, 64), (6, 7));
    }
}
