//! Quantizing whole tensors: groups from the granularity, parameters from each group's range,
//! codes packed row by row.
//!
//! Every granularity reduces to one rule: row `r` (a token of a head) reads its parameters
//! from a run of groups starting at `first_group(r)`, element `d` using group
//! `first_group(r) + d / segment`. Per-tensor and per-head rows use one group (`segment =
//! head_dim`), per-token and grouped rows their own groups, per-channel rows one group per
//! channel (`segment = 1`) shared by the tokens of a block.

use crate::codebook::Codebook;
use crate::codec::{ChannelParams, Codec};
use crate::error::{QuantError, Result};
use crate::format::{CodebookSource, Granularity, Kind, ParamDtype, QuantSpec, RangeRule};
use crate::memory::MemoryReport;
use crate::pack::{pack_into, packed_len_unchecked, unpack_into};
use crate::params::{GroupParams, ParamGrid, ParamVec, ROW_SET_TOKENS};
use crate::rowkernels::{RowKernels, row_stats};
use crate::tensor::{Shape, Tensor, check_finite};

/// At most this many normalized values feed a Lloyd-Max fit.
const LLOYD_SAMPLES: usize = 1 << 16;

/// How a tensor's rows map to parameter groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLayout {
    shape: Shape,
    granularity: Granularity,
}

impl GroupLayout {
    /// The layout of `granularity` over `shape` (validated by [`QuantSpec::check_shape`]).
    pub fn new(shape: Shape, granularity: Granularity) -> Self {
        Self { shape, granularity }
    }

    fn channel_blocks(&self) -> (usize, usize) {
        let t = self.shape.tokens;
        let tg = match self.granularity {
            Granularity::PerChannel { token_group: Some(n) } => n.min(t).max(1),
            _ => t.max(1),
        };
        (tg, t.div_ceil(tg))
    }

    /// Number of parameter groups.
    pub fn groups(&self) -> usize {
        let s = self.shape;
        match self.granularity {
            Granularity::PerTensor => 1,
            Granularity::PerHead => s.batch * s.heads,
            Granularity::PerChannel { .. } => s.batch * s.heads * self.channel_blocks().1 * s.head_dim,
            Granularity::PerToken => s.rows(),
            Granularity::Group(g) => s.rows() * (s.head_dim / g),
        }
    }

    /// `(first group, segment length)` of row `row`.
    #[inline]
    pub fn row_groups(&self, row: usize) -> (usize, usize) {
        let s = self.shape;
        let d = s.head_dim;
        match self.granularity {
            Granularity::PerTensor => (0, d),
            Granularity::PerHead => (row / s.tokens, d),
            Granularity::PerChannel { .. } => {
                let (tg, blocks) = self.channel_blocks();
                let (bh, t) = (row / s.tokens, row % s.tokens);
                ((bh * blocks + t / tg) * d, 1)
            }
            Granularity::PerToken => (row, d),
            Granularity::Group(g) => (row * (d / g), g),
        }
    }
}

/// A quantized tensor: packed codes row by row, and the parameters of every group.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    spec: QuantSpec,
    shape: Shape,
    row_bytes: usize,
    codes: Vec<u8>,
    scales: ParamVec,
    offsets: Option<ParamVec>,
    /// Levels of a fitted codebook, which must be stored with the tensor.
    fitted: Option<Codebook>,
}

/// Quantizes `tensor` with `spec`, taking each group's range from the data (dynamic ranges).
///
/// # Errors
/// [`QuantError::EmptyTensor`], [`QuantError::NonFinite`] (naming the first bad element),
/// [`QuantError::GroupSize`] and [`QuantError::ParamOverflow`].
///
/// # Example
/// ```
/// use kvq_quant_core::{quantize, QuantSpec, Shape, Tensor};
/// let x = Tensor::new(Shape::new(1, 2, 4), vec![0.0, 1.0, 2.0, 3.0, -1.0, 0.5, 0.25, 1.0]).unwrap();
/// let spec: QuantSpec = "int4-token-f32".parse().unwrap();
/// let q = quantize(&x, &spec).unwrap();
/// let y = q.dequantize();
/// assert!((y.data()[3] - 3.0).abs() < 1e-6);
/// assert_eq!(q.memory().code_bytes, 4); // 8 codes of 4 bits
/// ```
pub fn quantize(tensor: &Tensor, spec: &QuantSpec) -> Result<QuantizedTensor> {
    let shape = tensor.shape();
    spec.check_shape(shape)?;
    needs_no_map(spec)?;
    let layout = GroupLayout::new(shape, spec.granularity());
    let rotated = rotated_copy(tensor, spec)?;
    let tensor = rotated.as_ref().unwrap_or(tensor);
    let (mins, maxs) = group_ranges(tensor, &layout)?;
    encode_tensor(tensor, spec, &layout, &mins, &maxs, true)
}

/// Refuses a `-qa` spec (its widths come from a map, [`crate::channel_bits`]) and a
/// `-prerope` one (its rows must first be taken out of RoPE, [`crate::rope::Rope::undo`]).
fn needs_no_map(spec: &QuantSpec) -> Result<()> {
    if spec.channel_bits() {
        return Err(QuantError::InvalidSpec(format!(
            "{spec}: bits per channel need a fitted map (quantize_channel_bits)"
        )));
    }
    refuse_pre_rope(spec)
}

/// Refuses a `-prerope` spec: quantizing it needs the model's RoPE frequencies.
pub(crate) fn refuse_pre_rope(spec: &QuantSpec) -> Result<()> {
    if spec.pre_rope() {
        return Err(QuantError::InvalidSpec(format!(
            "{spec}: keys quantized before RoPE need the model's frequencies: undo RoPE (Rope::undo), quantize with the spec without -prerope, and apply it again after decoding"
        )));
    }
    Ok(())
}

/// The tensor with every row rotated, for a `-rot` spec (after the values are checked finite:
/// a rotation would turn a NaN into a row of them).
fn rotated_copy(tensor: &Tensor, spec: &QuantSpec) -> Result<Option<Tensor>> {
    if !spec.rotated() {
        return Ok(None);
    }
    check_finite(tensor.shape(), tensor.data())?;
    let mut data = tensor.data().to_vec();
    crate::rotation::rotate_rows(&mut data, tensor.shape().head_dim);
    Ok(Some(Tensor::new(tensor.shape(), data)?))
}

/// Quantizes `tensor` with ranges given per group (e.g. from a static calibration), in the
/// order of [`GroupLayout`]. Values outside their group's range saturate. The ranges are used
/// as given, whatever the spec's [`RangeRule`]; for a `-rot` spec they are ranges of the
/// rotated rows.
///
/// # Errors
/// As [`quantize`], and [`QuantError::ShapeMismatch`] when the range vectors do not have one
/// entry per group, [`QuantError::InvalidArgument`] for a non-finite or inverted range.
pub fn quantize_with_ranges(
    tensor: &Tensor,
    spec: &QuantSpec,
    mins: &[f32],
    maxs: &[f32],
) -> Result<QuantizedTensor> {
    let shape = tensor.shape();
    spec.check_shape(shape)?;
    needs_no_map(spec)?;
    check_finite(shape, tensor.data())?;
    let layout = GroupLayout::new(shape, spec.granularity());
    let rotated = rotated_copy(tensor, spec)?;
    let tensor = rotated.as_ref().unwrap_or(tensor);
    let groups = layout.groups();
    if mins.len() != groups || maxs.len() != groups {
        return Err(QuantError::ShapeMismatch {
            expected: format!("{groups} ranges for {} over {shape}", spec),
            got: format!("{} minima and {} maxima", mins.len(), maxs.len()),
        });
    }
    if let Some(i) =
        (0..groups).find(|&i| !(mins[i].is_finite() && maxs[i].is_finite() && mins[i] <= maxs[i]))
    {
        return Err(QuantError::InvalidArgument(format!("group {i} has range [{}, {}]", mins[i], maxs[i])));
    }
    encode_tensor(tensor, spec, &layout, mins, maxs, false)
}

/// Parameters from validated ranges (`dynamic`: the data's own, which the spec's range rule
/// may refine; otherwise calibrated ones, used as given), then codes row by row.
fn encode_tensor(
    tensor: &Tensor,
    spec: &QuantSpec,
    layout: &GroupLayout,
    mins: &[f32],
    maxs: &[f32],
    dynamic: bool,
) -> Result<QuantizedTensor> {
    let shape = tensor.shape();
    let groups = layout.groups();
    let plain = Codec::new(spec, None);
    let mut params = Vec::with_capacity(groups);
    for (&lo, &hi) in mins.iter().zip(maxs) {
        params.push(plain.params(lo, hi)?);
    }
    let fitted = match spec.kind() {
        Kind::Codebook(CodebookSource::LloydMax) => {
            Some(Codebook::fit_lloyd_max(&normalized_sample(tensor, layout, &params), spec.bits())?)
        }
        _ => None,
    };
    let codec = if fitted.is_some() { Codec::new(spec, fitted.as_ref()) } else { plain };
    if dynamic && spec.ranges() != RangeRule::MinMax {
        let (starts, members) = group_members(tensor, layout);
        for (g, p) in params.iter_mut().enumerate() {
            *p = codec.group_params(&members[starts[g]..starts[g + 1]], mins[g], maxs[g])?;
        }
    }

    let d = shape.head_dim;
    // One-byte parameters: each set snapped onto its grid before any code is chosen. Groups
    // are in `layout`'s order: per channel, the channels of one head over one token group
    // (sets of `d`); per row, the rows of one head together, taken `ROW_SET_TOKENS` at a time.
    let mut sets = 0;
    if spec.param_dtype() == ParamDtype::U8 {
        let levels = codec.affine_levels().expect("one-byte parameters are affine (checked by the spec)");
        let (per_head, set_len) = match spec.granularity() {
            Granularity::PerChannel { .. } => (params.len(), d),
            _ => {
                let per_row = d / layout.row_groups(0).1;
                (shape.tokens * per_row, ROW_SET_TOKENS * per_row)
            }
        };
        let mut indices = Vec::new();
        for head in params.chunks_mut(per_head) {
            for set in head.chunks_mut(set_len) {
                ParamGrid::snap_set(set, levels, &mut indices)?;
                sets += 1;
            }
        }
    }
    let row_bytes = packed_len_unchecked(d, spec.bits());
    let mut codes = vec![0u8; row_bytes * shape.rows()];
    let mut row_codes = vec![0u8; d];
    let mut channels = (usize::MAX, ChannelParams::default());
    for (r, (x, out)) in tensor.data().chunks_exact(d).zip(codes.chunks_exact_mut(row_bytes)).enumerate() {
        let (first, seg) = layout.row_groups(r);
        if seg == 1 {
            if channels.0 != first {
                channels = (first, ChannelParams::new(&params[first..first + d]));
            }
            codec.encode_channels(x, &channels.1, &mut row_codes);
        } else {
            for (g, (xs, cs)) in x.chunks(seg).zip(row_codes.chunks_mut(seg)).enumerate() {
                codec.encode(xs, params[first + g], cs);
            }
        }
        pack_into(&row_codes, spec.bits(), out);
    }

    let dtype = spec.param_dtype();
    let store = |values: Vec<f32>| match dtype {
        ParamDtype::U8 => ParamVec::U8 { values, sets },
        _ => ParamVec::from_rounded(dtype, &values),
    };
    let scales: Vec<f32> = params.iter().map(|p| p.scale).collect();
    let offsets = spec.has_offset().then(|| store(params.iter().map(|p| p.offset).collect()));
    Ok(QuantizedTensor {
        spec: spec.clone(),
        shape,
        row_bytes,
        codes,
        scales: store(scales),
        offsets,
        fitted,
    })
}

/// Quantizes one row with row-local groups of `seg` channels (per-token: `seg = x.len()`):
/// each group's range, its parameters (written to `params`, one per group), codes (through
/// `scratch`, `x.len()` bytes) and the packed row (`packed`, [`packed_len`] bytes). This is
/// the streaming path of a cache; it allocates nothing and gives the codes [`quantize`] gives.
///
/// [`packed_len`]: crate::pack::packed_len
///
/// # Errors
/// [`QuantError::GroupSize`], [`QuantError::ShapeMismatch`] for buffers of the wrong length,
/// [`QuantError::NonFinite`], [`QuantError::ParamOverflow`].
pub fn quantize_row(
    codec: &Codec,
    bits: u8,
    x: &[f32],
    seg: usize,
    params: &mut [GroupParams],
    scratch: &mut [u8],
    packed: &mut [u8],
) -> Result<()> {
    quantize_row_with(&RowKernels::PORTABLE, codec, bits, x, seg, params, scratch, packed)
}

/// [`quantize_row`] with its range scan, encoding and packing done by `kernels` (for example
/// `kvq-kernels-simd`'s AVX2 ones); the results are the same bit for bit.
///
/// # Errors
/// As [`quantize_row`].
#[allow(clippy::too_many_arguments)]
pub fn quantize_row_with(
    kernels: &RowKernels,
    codec: &Codec,
    bits: u8,
    x: &[f32],
    seg: usize,
    params: &mut [GroupParams],
    scratch: &mut [u8],
    packed: &mut [u8],
) -> Result<()> {
    row_params_with(kernels, codec, x, seg, params)?;
    encode_row_with(kernels, codec, bits, x, seg, params, scratch, packed)
}

/// The first half of [`quantize_row_with`]: the parameters of each group of `seg` channels of
/// `x`, into `params`. Computing the parameters of several rows before encoding any lets the
/// CPU overlap their dependency chains (range → parameters → reciprocal), which a streaming
/// cache does for the KV heads of a token.
///
/// # Errors
/// [`QuantError::GroupSize`], [`QuantError::ShapeMismatch`] for a wrong `params` length,
/// [`QuantError::NonFinite`], [`QuantError::ParamOverflow`].
#[inline]
pub fn row_params_with(
    kernels: &RowKernels,
    codec: &Codec,
    x: &[f32],
    seg: usize,
    params: &mut [GroupParams],
) -> Result<()> {
    let n = x.len();
    if seg == n && n > 0 && params.len() == 1 {
        // One group per row (per-token), the common streaming case.
        let (lo, hi, finite) = kernels.stats(x);
        if !finite {
            check_finite(Shape::new(1, 1, n), x)?;
        }
        params[0] = codec.group_params(x, lo, hi)?;
        return Ok(());
    }
    check_row(n, seg, params.len(), n)?;
    for (xs, p) in x.chunks_exact(seg).zip(params.iter_mut()) {
        let (lo, hi, finite) = kernels.stats(xs);
        if !finite {
            check_finite(Shape::new(1, 1, n), x)?;
        }
        *p = codec.group_params(xs, lo, hi)?;
    }
    Ok(())
}

/// The second half of [`quantize_row_with`]: codes for `x` with the given parameters (one
/// per group of `seg`), packed into `packed` ([`packed_len`](crate::pack::packed_len) bytes),
/// through `scratch` (`x.len()` bytes) unless the kernels encode and pack in one pass.
///
/// # Errors
/// [`QuantError::GroupSize`], [`QuantError::ShapeMismatch`] for buffers of the wrong length.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn encode_row_with(
    kernels: &RowKernels,
    codec: &Codec,
    bits: u8,
    x: &[f32],
    seg: usize,
    params: &[GroupParams],
    scratch: &mut [u8],
    packed: &mut [u8],
) -> Result<()> {
    let n = x.len();
    if seg == n && n > 0 && params.len() == 1 && scratch.len() == n {
        if let Some(l) = codec.linear(params[0])
            && kernels.encode_pack(x, &l, bits, packed)?
        {
            return Ok(());
        }
        codec.encode_with(kernels, x, params[0], scratch);
        return kernels.pack(scratch, bits, packed);
    }
    check_row(n, seg, params.len(), scratch.len())?;
    for ((xs, cs), p) in x.chunks_exact(seg).zip(scratch.chunks_exact_mut(seg)).zip(params) {
        codec.encode_with(kernels, xs, *p, cs);
    }
    kernels.pack(scratch, bits, packed)
}

fn check_row(n: usize, seg: usize, params: usize, scratch: usize) -> Result<()> {
    if seg == 0 || !n.is_multiple_of(seg) {
        return Err(QuantError::GroupSize { group: seg, head_dim: n });
    }
    if params != n / seg || scratch != n {
        return Err(QuantError::ShapeMismatch {
            expected: format!("{} parameter slots and {n} scratch bytes", n / seg),
            got: format!("{params} and {scratch}"),
        });
    }
    Ok(())
}

/// Minimum and maximum of every group of `layout` over `tensor`.
///
/// # Errors
/// [`QuantError::NonFinite`] naming the first NaN or ±Inf (found in the same pass).
pub fn group_ranges(tensor: &Tensor, layout: &GroupLayout) -> Result<(Vec<f32>, Vec<f32>)> {
    let groups = layout.groups();
    let mut mins = vec![f32::INFINITY; groups];
    let mut maxs = vec![f32::NEG_INFINITY; groups];
    let d = tensor.shape().head_dim;
    let mut finite = true;
    for (r, x) in tensor.data().chunks_exact(d).enumerate() {
        let (first, seg) = layout.row_groups(r);
        if seg == 1 {
            for ((lo, hi), &v) in mins[first..first + d].iter_mut().zip(&mut maxs[first..first + d]).zip(x) {
                *lo = if v < *lo { v } else { *lo };
                *hi = if v > *hi { v } else { *hi };
            }
            finite &= all_finite(x);
        } else {
            for (g, xs) in x.chunks_exact(seg).enumerate() {
                let (lo, hi, ok) = row_stats(xs);
                finite &= ok;
                mins[first + g] = mins[first + g].min(lo);
                maxs[first + g] = maxs[first + g].max(hi);
            }
        }
    }
    if !finite {
        check_finite(tensor.shape(), tensor.data())?;
    }
    Ok((mins, maxs))
}

/// Every group's values, in row order within the group: `members[starts[g]..starts[g + 1]]`
/// for group `g` (a counting sort of the elements by group).
fn group_members(tensor: &Tensor, layout: &GroupLayout) -> (Vec<usize>, Vec<f32>) {
    let d = tensor.shape().head_dim;
    let mut starts = vec![0usize; layout.groups() + 1];
    let rows = tensor.data().chunks_exact(d).enumerate();
    for (r, _) in rows.clone() {
        let (first, seg) = layout.row_groups(r);
        for g in 0..d / seg {
            starts[first + g + 1] += seg;
        }
    }
    for g in 1..starts.len() {
        starts[g] += starts[g - 1];
    }
    let mut next = starts.clone();
    let mut members = vec![0f32; tensor.data().len()];
    for (r, x) in rows {
        let (first, seg) = layout.row_groups(r);
        for (g, xs) in x.chunks_exact(seg).enumerate() {
            let at = next[first + g];
            members[at..at + seg].copy_from_slice(xs);
            next[first + g] += seg;
        }
    }
    (starts, members)
}

fn all_finite(xs: &[f32]) -> bool {
    row_stats(xs).2
}

/// Up to [`LLOYD_SAMPLES`] values, evenly strided, each divided by its group's scale.
fn normalized_sample(tensor: &Tensor, layout: &GroupLayout, params: &[GroupParams]) -> Vec<f32> {
    let data = tensor.data();
    let d = tensor.shape().head_dim;
    let stride = data.len().div_ceil(LLOYD_SAMPLES).max(1);
    (0..data.len())
        .step_by(stride)
        .map(|i| {
            let (first, seg) = layout.row_groups(i / d);
            let p = params[first + (i % d) / seg];
            if p.scale > 0.0 { (data[i] / p.scale).clamp(-1.0, 1.0) } else { 0.0 }
        })
        .collect()
}

impl QuantizedTensor {
    /// The spec it was quantized with.
    pub fn spec(&self) -> &QuantSpec {
        &self.spec
    }

    /// The shape of the original tensor.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Bytes of one packed row (`head_dim` codes).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All packed codes, row after row.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// Packed codes of row `row` (`(batch · heads + head) · tokens + token`).
    pub fn row_codes(&self, row: usize) -> &[u8] {
        &self.codes[row * self.row_bytes..(row + 1) * self.row_bytes]
    }

    /// Per-group scales.
    pub fn scales(&self) -> &ParamVec {
        &self.scales
    }

    /// Per-group offsets (affine only).
    pub fn offsets(&self) -> Option<&ParamVec> {
        self.offsets.as_ref()
    }

    /// The fitted codebook stored with the tensor (Lloyd-Max only).
    pub fn fitted_codebook(&self) -> Option<&Codebook> {
        self.fitted.as_ref()
    }

    /// The group layout of the tensor.
    pub fn layout(&self) -> GroupLayout {
        GroupLayout::new(self.shape, self.spec.granularity())
    }

    /// The parameters of group `g`.
    pub fn group_params(&self, g: usize) -> GroupParams {
        GroupParams { scale: self.scales.get(g), offset: self.offsets.as_ref().map_or(0.0, |o| o.get(g)) }
    }

    /// The codec that decodes this tensor's codes.
    pub fn codec(&self) -> Codec {
        Codec::new(&self.spec, self.fitted.as_ref())
    }

    /// Unpacked codes of the whole tensor, one byte each (for inspection and tests).
    pub fn unpacked_codes(&self) -> Vec<u8> {
        let d = self.shape.head_dim;
        let mut out = vec![0u8; self.shape.rows() * d];
        for (r, o) in out.chunks_exact_mut(d).enumerate() {
            unpack_into(self.row_codes(r), self.spec.bits(), o);
        }
        out
    }

    /// Decodes the whole tensor to f32 (unrotating the rows of a `-rot` spec; the codes and
    /// group parameters are those of the rotated rows).
    pub fn dequantize(&self) -> Tensor {
        let d = self.shape.head_dim;
        let codec = self.codec();
        let layout = self.layout();
        let mut data = vec![0f32; self.shape.rows() * d];
        let mut row_codes = vec![0u8; d];
        for (r, out) in data.chunks_exact_mut(d).enumerate() {
            unpack_into(self.row_codes(r), self.spec.bits(), &mut row_codes);
            let (first, seg) = layout.row_groups(r);
            for (g, (cs, os)) in row_codes.chunks(seg).zip(out.chunks_mut(seg)).enumerate() {
                codec.decode(cs, self.group_params(first + g), os);
            }
        }
        if self.spec.rotated() {
            crate::rotation::unrotate_rows(&mut data, d);
        }
        Tensor::new(self.shape, data).expect("a quantized tensor decodes to its own shape")
    }

    /// Exact bytes of codes and parameters.
    pub fn memory(&self) -> MemoryReport {
        MemoryReport {
            elements: self.shape.len(),
            code_bytes: self.codes.len(),
            param_bytes: self.scales.bytes() + self.offsets.as_ref().map_or(0, ParamVec::bytes),
            codebook_bytes: self.fitted.as_ref().map_or(0, |cb| cb.levels().len() * 4),
        }
    }
}
