//! Query-aware bits per key channel (`-qa` specs).
//!
//! A key enters attention only through `q · k`, so an error in channel `c` costs in
//! proportion to `E[q_c²]`: a channel the queries barely read can take fewer bits than one
//! they read strongly, and a channel whose values vary little over a block needs fewer bits
//! than one that swings. A [`ChannelBits`] map gives each channel of a head its own width,
//! with the widths summing to the spec's average times `head_dim`, so the memory is that of
//! the uniform spec (plus the map, counted). [`ChannelBits::fit`] chooses the map from
//! calibration keys and the query energy per channel: it measures, per channel and width, the
//! squared error of the spec's own per-channel quantizer on the calibration keys, weights it
//! by the query energy, and hands out bits greedily where they remove the most weighted error.
//!
//! Widths go to whole units of [`UNIT`] channels, so every width holds a multiple of 8
//! channels: its codes are whole bytes per row and its channel count fits the kernels' 8-lane
//! steps. With a [`RopePairing`], the two channels of a RoPE pair (which rotate into each other
//! with the position) always share a width, a unit being four pairs.
//!
//! [`quantize_channel_bits`] quantizes a key tensor with one map per head: the channels of each
//! width are quantized together as a per-channel tensor of that width (the permutation that
//! sorts channels by width is [`ChannelBits::permutation`]), each with its own per-channel
//! parameters.

use crate::error::{QuantError, Result};
use crate::format::{Granularity, QuantSpec};
use crate::memory::MemoryReport;
use crate::quantize::{QuantizedTensor, quantize};
use crate::rope::RopePairing;
use crate::tensor::{Shape, Tensor};

/// Channels that share a width in a fitted map: 8 (four RoPE pairs).
pub const UNIT: usize = 8;

/// The narrowest and widest width a channel can take.
const WIDTHS: std::ops::RangeInclusive<u8> = 1..=8;

/// One head's bits per channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelBits {
    widths: Vec<u8>,
}

impl ChannelBits {
    /// A map from explicit widths, one per channel.
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] for an empty map or a width outside `1..=8`.
    pub fn new(widths: Vec<u8>) -> Result<Self> {
        if widths.is_empty() {
            return Err(QuantError::InvalidArgument("a channel bit map needs at least one channel".into()));
        }
        if let Some((c, w)) = widths.iter().enumerate().find(|(_, w)| !WIDTHS.contains(w)) {
            return Err(QuantError::InvalidArgument(format!("channel {c}: width {w} is outside 1..=8")));
        }
        Ok(Self { widths })
    }

    /// Every channel at `bits`.
    ///
    /// # Errors
    /// As [`ChannelBits::new`].
    pub fn uniform(head_dim: usize, bits: u8) -> Result<Self> {
        Self::new(vec![bits; head_dim])
    }

    /// A fixed map of three widths around `bits`, shaped as maps fitted to real layers are: a
    /// quarter of the channels one bit under, a quarter one over, interleaved through the head
    /// (channel `c` by `c mod 4`), so that the stored order is a real permutation; uniform at
    /// 1 and 8 bits. For benchmarks, whose random keys have nothing to fit.
    ///
    /// # Errors
    /// As [`ChannelBits::new`] (a `bits` outside 1..=8, an empty head).
    pub fn spread(head_dim: usize, bits: u8) -> Result<Self> {
        let width = |c: usize| match (c % 4, bits) {
            (_, 1 | 8) => bits,
            (0, _) => bits - 1,
            (1, _) => bits + 1,
            _ => bits,
        };
        if !WIDTHS.contains(&bits) {
            return Err(QuantError::InvalidArgument(format!("average width {bits} is outside 1..=8")));
        }
        Self::new((0..head_dim).map(width).collect())
    }

    /// The width of each channel.
    pub fn widths(&self) -> &[u8] {
        &self.widths
    }

    /// Channels in the map.
    pub fn head_dim(&self) -> usize {
        self.widths.len()
    }

    /// The sum of the widths: the code bits of one row.
    pub fn total_bits(&self) -> usize {
        self.widths.iter().map(|&w| usize::from(w)).sum()
    }

    /// The channels of each width present, narrowest first, each list ascending.
    pub fn segments(&self) -> Vec<(u8, Vec<usize>)> {
        WIDTHS
            .filter_map(|w| {
                let channels: Vec<usize> = (0..self.widths.len()).filter(|&c| self.widths[c] == w).collect();
                (!channels.is_empty()).then_some((w, channels))
            })
            .collect()
    }

    /// The channel order that makes each width contiguous: the segments' channels in turn.
    pub fn permutation(&self) -> Vec<usize> {
        self.segments().into_iter().flat_map(|(_, c)| c).collect()
    }

    /// Bytes the map takes where it is stored: a 4-bit width code per channel.
    pub fn map_bytes(&self) -> usize {
        self.widths.len().div_ceil(2)
    }

    /// Fits one head's map for `spec` (affine, per channel, `bits` the average) to calibration
    /// keys of that head (`keys`, shape `[1, tokens, head_dim]`) and the mean squared query of
    /// each channel over the query heads that read it (`query_energy`, `head_dim` values).
    ///
    /// Per channel and width the calibration keys are quantized with the spec at that width
    /// (its grouping, range rule and parameter type), and the squared error of every whole
    /// token group is summed and multiplied by the channel's query energy. All units start at
    /// 1 bit; one bit at a time goes to the unit whose weighted error it lowers most, until the
    /// widths sum to `bits · head_dim`. Units are [`UNIT`] channels of similar error at the
    /// average width; with `pairing`, both channels of a RoPE pair are in the same unit.
    ///
    /// # Errors
    /// [`QuantError::InvalidSpec`] for a spec that is not affine per channel,
    /// [`QuantError::InvalidArgument`] for a `head_dim` that is not a multiple of [`UNIT`],
    /// calibration keys shorter than one token group, more than one batch entry or head, or
    /// a negative or non-finite query energy, [`QuantError::ShapeMismatch`] when
    /// `query_energy` does not have `head_dim` values, and the errors of [`quantize`]
    /// (non-finite keys).
    pub fn fit(
        keys: &Tensor,
        query_energy: &[f32],
        spec: &QuantSpec,
        pairing: Option<RopePairing>,
    ) -> Result<Self> {
        check_spec(spec)?;
        let s = keys.shape();
        if s.batch != 1 || s.heads != 1 {
            return Err(QuantError::InvalidArgument(format!(
                "calibration keys of one head are [1, tokens, head_dim], got {s}"
            )));
        }
        let d = s.head_dim;
        if d == 0 || !d.is_multiple_of(UNIT) {
            return Err(QuantError::InvalidArgument(format!(
                "bits per channel go to units of {UNIT} channels; head_dim {d} is not a multiple"
            )));
        }
        if query_energy.len() != d {
            return Err(QuantError::ShapeMismatch {
                expected: format!("{d} query energies"),
                got: format!("{}", query_energy.len()),
            });
        }
        if let Some(e) = query_energy.iter().find(|e| !e.is_finite() || **e < 0.0) {
            return Err(QuantError::InvalidArgument(format!(
                "query energy {e} is not a finite non-negative value"
            )));
        }
        let group = match spec.granularity() {
            Granularity::PerChannel { token_group: Some(n) } => n,
            _ => s.tokens,
        };
        let whole = s.tokens / group.max(1) * group;
        if whole == 0 {
            return Err(QuantError::InvalidArgument(format!(
                "{} calibration tokens hold no whole group of {group}",
                s.tokens
            )));
        }
        let keys = keys.prefix(whole)?;
        // err[c][w]: the weighted squared error of channel c at width w.
        let mut err = vec![[0f64; 9]; d];
        for w in WIDTHS {
            let back = quantize(&keys, &width_spec(spec, w)?)?.dequantize();
            for (row, orig) in back.data().chunks_exact(d).zip(keys.data().chunks_exact(d)) {
                for c in 0..d {
                    let e = f64::from(row[c]) - f64::from(orig[c]);
                    err[c][usize::from(w)] += e * e;
                }
            }
        }
        for (e, &q) in err.iter_mut().zip(query_energy) {
            e.iter_mut().for_each(|x| *x *= f64::from(q));
        }
        let units = units(&err, d, spec.bits(), pairing);
        let unit_err: Vec<[f64; 9]> = units
            .iter()
            .map(|u| {
                let mut s = [0f64; 9];
                for &c in u {
                    (0..9).for_each(|w| s[w] += err[c][w]);
                }
                s
            })
            .collect();
        let mut width = vec![*WIDTHS.start(); units.len()];
        let mut left = (usize::from(spec.bits()) - usize::from(*WIDTHS.start())) * units.len();
        while left > 0 {
            let best = (0..units.len())
                .filter(|&i| width[i] < *WIDTHS.end())
                .max_by(|&a, &b| {
                    let gain = |i: usize| {
                        unit_err[i][usize::from(width[i])] - unit_err[i][usize::from(width[i]) + 1]
                    };
                    gain(a).total_cmp(&gain(b)).then(b.cmp(&a))
                })
                .expect("the average is at most the widest width");
            width[best] += 1;
            left -= 1;
        }
        let mut widths = vec![0u8; d];
        for (u, &w) in units.iter().zip(&width) {
            u.iter().for_each(|&c| widths[c] = w);
        }
        Self::new(widths)
    }
}

/// Splits the channels into units of [`UNIT`]: pairs (or single channels) sorted by their
/// weighted error at the average width, largest first, taken in turn.
fn units(err: &[[f64; 9]], d: usize, bits: u8, pairing: Option<RopePairing>) -> Vec<Vec<usize>> {
    let members: Vec<Vec<usize>> = match pairing {
        Some(p) => (0..d / 2)
            .map(|i| {
                let (a, b) = p.channels(i, d);
                vec![a, b]
            })
            .collect(),
        None => (0..d).map(|c| vec![c]).collect(),
    };
    let score = |m: &Vec<usize>| m.iter().map(|&c| err[c][usize::from(bits)]).sum::<f64>();
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by(|&a, &b| score(&members[b]).total_cmp(&score(&members[a])).then(a.cmp(&b)));
    let per = UNIT / members[0].len();
    order.chunks(per).map(|chunk| chunk.iter().flat_map(|&m| members[m].iter().copied()).collect()).collect()
}

/// Refuses specs that cannot have bits per channel (the rule of
/// [`QuantSpec::with_channel_bits`]).
fn check_spec(spec: &QuantSpec) -> Result<()> {
    crate::quantize::refuse_pre_rope(spec)?;
    spec.clone().with_channel_bits(true).map(|_| ())
}

/// The spec one width's channels are quantized with: `spec` at `w` bits (its kind, grouping,
/// range rule and parameter type), without bits per channel.
///
/// # Errors
/// [`QuantError::BitsOutOfRange`] for a width the kind does not support.
pub fn width_spec(spec: &QuantSpec, w: u8) -> Result<QuantSpec> {
    Ok(QuantSpec::new(spec.kind().clone(), w, spec.granularity(), spec.param_dtype())?
        .with_ranges(spec.ranges()))
}

/// One map per KV head of a GQA layer, fitted with [`ChannelBits::fit`] on every token of
/// `keys` (`[batch, kv_heads, tokens, head_dim]`) and the mean squared query per channel over
/// the query heads that read each KV head (`queries`, `[batch, query_heads, tokens, head_dim]`,
/// query head `h` reading KV head `h / (query_heads / kv_heads)`). The batch entries' tokens
/// are taken one after the other.
///
/// # Errors
/// [`QuantError::ShapeMismatch`] when the shapes do not agree (batch, tokens, head_dim, query
/// heads a multiple of KV heads); those of [`ChannelBits::fit`].
pub fn fit_heads(
    keys: &Tensor,
    queries: &Tensor,
    spec: &QuantSpec,
    pairing: Option<RopePairing>,
) -> Result<Vec<ChannelBits>> {
    let (ks, qs) = (keys.shape(), queries.shape());
    if ks.heads == 0
        || !qs.heads.is_multiple_of(ks.heads)
        || (qs.batch, qs.tokens, qs.head_dim) != (ks.batch, ks.tokens, ks.head_dim)
    {
        return Err(QuantError::ShapeMismatch {
            expected: format!("queries of keys {ks}: the same batch, tokens and head_dim, whole GQA groups"),
            got: format!("{qs}"),
        });
    }
    let (group, d, n) = (qs.heads / ks.heads, ks.head_dim, ks.batch * ks.tokens);
    (0..ks.heads)
        .map(|h| {
            let mut rows = Vec::with_capacity(n * d);
            let mut energy = vec![0f64; d];
            for b in 0..ks.batch {
                for t in 0..ks.tokens {
                    rows.extend_from_slice(keys.row(b, h, t));
                    for qh in h * group..(h + 1) * group {
                        for (e, &x) in energy.iter_mut().zip(queries.row(b, qh, t)) {
                            *e += f64::from(x) * f64::from(x);
                        }
                    }
                }
            }
            let count = (n * group).max(1) as f64;
            let energy: Vec<f32> = energy.iter().map(|e| (e / count) as f32).collect();
            ChannelBits::fit(&Tensor::new(Shape::new(1, n, d), rows)?, &energy, spec, pairing)
        })
        .collect()
}

/// A key tensor quantized with bits per channel: per (batch entry, head), one per-channel
/// quantized tensor per width.
#[derive(Debug, Clone)]
pub struct ChannelBitsTensor {
    shape: Shape,
    maps: Vec<ChannelBits>,
    /// Per (batch, head) in row order, per segment of the head's map: its quantized channels.
    parts: Vec<Vec<QuantizedTensor>>,
}

impl ChannelBitsTensor {
    /// The shape of the tensor quantized.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The map of each head.
    pub fn maps(&self) -> &[ChannelBits] {
        &self.maps
    }

    /// The values the codes stand for, in the original channel order.
    pub fn dequantize(&self) -> Tensor {
        let s = self.shape;
        let mut data = vec![0f32; s.len()];
        let per_head = s.tokens * s.head_dim;
        for (bh, parts) in self.parts.iter().enumerate() {
            let map = &self.maps[bh % s.heads];
            let out = &mut data[bh * per_head..(bh + 1) * per_head];
            for ((_, channels), part) in map.segments().iter().zip(parts) {
                let back = part.dequantize();
                for (t, row) in back.data().chunks_exact(channels.len()).enumerate() {
                    for (&c, &x) in channels.iter().zip(row) {
                        out[t * s.head_dim + c] = x;
                    }
                }
            }
        }
        Tensor::new(s, data).expect("the shape's own element count")
    }

    /// Code, parameter and map bytes: every width's codes and per-channel parameters, and
    /// each head's map once ([`ChannelBits::map_bytes`], counted with the parameters).
    pub fn memory(&self) -> MemoryReport {
        let mut m = MemoryReport { elements: self.shape.len(), ..MemoryReport::default() };
        for part in self.parts.iter().flatten() {
            let p = part.memory();
            m.code_bytes += p.code_bytes;
            m.param_bytes += p.param_bytes;
            m.codebook_bytes += p.codebook_bytes;
        }
        m.param_bytes += self.maps.iter().map(ChannelBits::map_bytes).sum::<usize>();
        m
    }
}

/// Quantizes `tensor` (keys, `[batch, heads, tokens, head_dim]`) with `spec` and one map per
/// head (shared by the batch entries): the channels of each width are quantized together as a
/// per-channel tensor at that width.
///
/// # Errors
/// [`QuantError::InvalidSpec`] for a spec that is not affine per channel (or is rotated);
/// [`QuantError::ShapeMismatch`] when there is not one map per head or a map's length is not
/// `head_dim`; [`QuantError::InvalidArgument`] when a map's widths do not sum to
/// `spec.bits() · head_dim`; the errors of [`quantize`] (empty tensors, non-finite values,
/// parameter overflow).
pub fn quantize_channel_bits(
    tensor: &Tensor,
    spec: &QuantSpec,
    maps: &[ChannelBits],
) -> Result<ChannelBitsTensor> {
    check_spec(spec)?;
    let s = tensor.shape();
    if s.checked_len().is_none_or(|n| n == 0) {
        return Err(QuantError::EmptyTensor(s));
    }
    if maps.len() != s.heads {
        return Err(QuantError::ShapeMismatch {
            expected: format!("one channel bit map per head ({})", s.heads),
            got: format!("{} maps", maps.len()),
        });
    }
    for (h, map) in maps.iter().enumerate() {
        if map.head_dim() != s.head_dim {
            return Err(QuantError::ShapeMismatch {
                expected: format!("head {h}: a map of {} channels", s.head_dim),
                got: format!("{} channels", map.head_dim()),
            });
        }
        let want = usize::from(spec.bits()) * s.head_dim;
        if map.total_bits() != want {
            return Err(QuantError::InvalidArgument(format!(
                "head {h}: the map's widths sum to {} bits, the spec's average of {} over {} channels is {want}",
                map.total_bits(),
                spec.bits(),
                s.head_dim
            )));
        }
    }
    let mut parts = Vec::with_capacity(s.batch * s.heads);
    for bh in 0..s.batch * s.heads {
        let (b, h) = (bh / s.heads, bh % s.heads);
        let mut head = Vec::new();
        for (w, channels) in maps[h].segments() {
            let mut data = Vec::with_capacity(s.tokens * channels.len());
            for t in 0..s.tokens {
                let row = tensor.row(b, h, t);
                data.extend(channels.iter().map(|&c| row[c]));
            }
            let sub = Tensor::new(Shape::new(1, s.tokens, channels.len()), data)?;
            head.push(quantize(&sub, &width_spec(spec, w)?)?);
        }
        parts.push(head);
    }
    Ok(ChannelBitsTensor { shape: s, maps: maps.to_vec(), parts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Rng;

    fn keys(tokens: usize, d: usize, seed: u64) -> Tensor {
        let mut rng = Rng::new(seed);
        // Channel c has spread 1 + c: the wide channels need the bits.
        let data = (0..tokens * d).map(|i| (rng.normal() * (1 + i % d) as f64) as f32).collect();
        Tensor::new(Shape::new(1, tokens, d), data).unwrap()
    }

    fn spec(text: &str) -> QuantSpec {
        text.parse().unwrap()
    }

    #[test]
    fn qa_specs_parse_and_print() {
        let s = spec("int3-channel32-qa");
        assert!(s.channel_bits());
        assert_eq!(s.to_string(), "int3-channel32-qa");
        for bad in ["int3-token-qa", "sym3-channel-qa", "int3-channel-rot-qa", "nf4-channel-qa"] {
            assert!(matches!(bad.parse::<QuantSpec>(), Err(QuantError::InvalidSpec(_))), "{bad}");
        }
    }

    #[test]
    fn plain_quantize_refuses_a_spec_that_needs_a_map() {
        let k = keys(64, 16, 1);
        assert!(matches!(quantize(&k, &spec("int3-channel32-qa")), Err(QuantError::InvalidSpec(_))));
    }

    #[test]
    fn a_spread_map_keeps_the_average_in_whole_units() {
        for bits in 1..=8u8 {
            let m = ChannelBits::spread(128, bits).unwrap();
            assert_eq!(m.total_bits(), 128 * usize::from(bits));
            assert!(m.segments().iter().all(|(_, c)| c.len().is_multiple_of(UNIT)));
            assert_eq!(m.segments().len(), if bits == 1 || bits == 8 { 1 } else { 3 });
        }
        assert!(ChannelBits::spread(64, 0).is_err() && ChannelBits::spread(64, 9).is_err());
        assert!(ChannelBits::spread(0, 3).is_err());
    }

    #[test]
    fn bad_maps_are_typed_errors() {
        assert!(ChannelBits::new(vec![]).is_err());
        assert!(matches!(ChannelBits::new(vec![3, 0, 3]), Err(QuantError::InvalidArgument(_))));
        assert!(matches!(ChannelBits::new(vec![3, 9]), Err(QuantError::InvalidArgument(_))));
        let k = keys(64, 16, 2);
        let s = spec("int3-channel32-qa");
        let short = ChannelBits::uniform(8, 3).unwrap();
        assert!(matches!(quantize_channel_bits(&k, &s, &[short]), Err(QuantError::ShapeMismatch { .. })));
        let mut w = vec![3u8; 16];
        w[0] = 4; // sums to 49, not 48
        let off = ChannelBits::new(w).unwrap();
        assert!(matches!(quantize_channel_bits(&k, &s, &[off]), Err(QuantError::InvalidArgument(_))));
        assert!(matches!(quantize_channel_bits(&k, &s, &[]), Err(QuantError::ShapeMismatch { .. })));
        assert!(matches!(
            quantize_channel_bits(&k, &spec("int3-token"), &[ChannelBits::uniform(16, 3).unwrap()]),
            Err(QuantError::InvalidSpec(_))
        ));
    }

    #[test]
    fn bad_fit_inputs_are_typed_errors() {
        let s = spec("int3-channel32-qa");
        let k = keys(64, 16, 3);
        assert!(matches!(ChannelBits::fit(&k, &[1.0; 15], &s, None), Err(QuantError::ShapeMismatch { .. })));
        let mut e = [1.0f32; 16];
        e[3] = f32::NAN;
        assert!(matches!(ChannelBits::fit(&k, &e, &s, None), Err(QuantError::InvalidArgument(_))));
        e[3] = -1.0;
        assert!(matches!(ChannelBits::fit(&k, &e, &s, None), Err(QuantError::InvalidArgument(_))));
        let few = keys(16, 16, 4);
        assert!(matches!(ChannelBits::fit(&few, &[1.0; 16], &s, None), Err(QuantError::InvalidArgument(_))));
        let odd = keys(64, 12, 5);
        assert!(matches!(ChannelBits::fit(&odd, &[1.0; 12], &s, None), Err(QuantError::InvalidArgument(_))));
        let mut bad = keys(64, 16, 6).into_data();
        bad[7] = f32::INFINITY;
        let bad = Tensor::new(Shape::new(1, 64, 16), bad).unwrap();
        assert!(matches!(ChannelBits::fit(&bad, &[1.0; 16], &s, None), Err(QuantError::NonFinite { .. })));
    }

    #[test]
    fn a_fitted_map_keeps_the_average_and_pairs_and_favours_wide_channels() {
        let d = 32;
        let k = keys(256, d, 7);
        let s = spec("int3-channel32-qa");
        for pairing in [None, Some(RopePairing::Half), Some(RopePairing::Interleaved)] {
            let map = ChannelBits::fit(&k, &[1.0; 32], &s, pairing).unwrap();
            assert_eq!(map.total_bits(), 3 * d);
            for (w, channels) in map.segments() {
                assert!(channels.len().is_multiple_of(UNIT), "width {w}: {channels:?}");
            }
            if let Some(p) = pairing {
                for i in 0..d / 2 {
                    let (a, b) = p.channels(i, d);
                    assert_eq!(map.widths()[a], map.widths()[b], "{p:?} pair {i}");
                }
            }
            // With equal query energy the channels of large spread (high index, without
            // pairing) get at least the bits of the narrow ones.
            if pairing.is_none() {
                assert!(map.widths()[d - 1] > map.widths()[0], "{:?}", map.widths());
            }
        }
        // A channel no query reads gets the fewest bits.
        let mut e = [1.0f32; 32];
        e[31] = 0.0;
        let map = ChannelBits::fit(&k, &e, &s, None).unwrap();
        assert_eq!(map.widths()[31], *map.widths().iter().min().unwrap());
    }

    #[test]
    fn a_uniform_map_is_the_plain_spec_and_a_fitted_one_lowers_weighted_error() {
        let (d, tokens) = (32, 256);
        let k = keys(tokens, d, 8);
        let s = spec("int3-channel32-qa");
        let plain = quantize(&k, &spec("int3-channel32")).unwrap();
        let uniform = quantize_channel_bits(&k, &s, &[ChannelBits::uniform(d, 3).unwrap()]).unwrap();
        assert_eq!(uniform.dequantize(), plain.dequantize());
        let m = uniform.memory();
        assert_eq!(m.code_bytes, plain.memory().code_bytes);
        assert_eq!(m.param_bytes, plain.memory().param_bytes + d / 2);
        // Query energy grows with the channel index, as the spread does: the map follows both.
        let energy: Vec<f32> = (0..d).map(|c| (1 + c) as f32).collect();
        let fit = ChannelBits::fit(&k.prefix(128).unwrap(), &energy, &s, None).unwrap();
        let fitted = quantize_channel_bits(&k, &s, &[fit]).unwrap();
        assert_eq!(fitted.memory().total_bytes(), m.total_bytes());
        let weighted = |t: &Tensor| -> f64 {
            t.data()
                .iter()
                .zip(k.data())
                .enumerate()
                .map(|(i, (a, b))| f64::from(energy[i % d]) * f64::from(a - b).powi(2))
                .sum()
        };
        let (u, f) = (weighted(&uniform.dequantize()), weighted(&fitted.dequantize()));
        assert!(f < 0.8 * u, "fitted {f} vs uniform {u}");
    }
}
