//! What a quantization *spec* is: the format of one group (kind, bits, parameter storage)
//! and the granularity that decides which elements share a group.
//!
//! Specs have a short textual form used by the CLI and config files, parsed by
//! [`QuantSpec::from_str`](std::str::FromStr) and printed by `Display`:
//!
//! ```text
//! spec  := kind [ "-" granularity ] [ "-mse" ] [ "-rot" ] [ "-qa" ] [ "-prerope" ] [ "-f32" | "-p8" ]
//! kind  := "int" BITS        affine (asymmetric min/max), 1..=8 bits
//!        | "sym" BITS        symmetric (absmax, zero point 0), 2..=8 bits
//!        | "fp8e4m3" | "fp8e5m2"
//!        | "nf4"             NormalFloat-4 codebook (QLoRA levels), absmax scale
//!        | "lloyd" BITS      Lloyd-Max codebook fitted to the data, 1..=8 bits
//! granularity := "tensor" | "head" | "channel" | "channel" N | "token" | "g" N
//! ```
//! The default granularity is `token` and parameters are stored as f16 unless `-f32` is given:
//! `int4-channel`, `int2-g32`, `fp8e4m3-token`, `int8-tensor-f32`. A group's parameters come
//! from its minimum and maximum unless `-mse` asks for the range that minimizes the group's
//! squared error ([`RangeRule::Mse`]): `int2-channel-mse`, `int3-token-mse-f32`. `-rot`
//! quantizes each row after a fixed randomized Hadamard rotation
//! ([`rotation`](crate::rotation)): `int2-token-mse-rot`. `-qa` gives each key channel its
//! own width ([`QuantSpec::with_channel_bits`]); `-prerope` quantizes keys in their frame
//! before RoPE ([`QuantSpec::with_pre_rope`]); `-p8` stores the parameters of affine groups
//! in one byte each on a grid per block ([`ParamDtype::U8`]).

use std::fmt;
use std::str::FromStr;

use crate::codebook::Codebook;
use crate::error::{QuantError, Result};
use crate::fp8::Fp8Format;
use crate::tensor::Shape;

/// How the values of one group map to codes.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Kind {
    /// Asymmetric min/max: `q = round((x - min) / (max - min) * (2^b - 1))`.
    Affine,
    /// Symmetric absmax: `scale = absmax / (2^(b-1) - 1)`, zero point 0.
    Symmetric,
    /// An 8-bit float with a per-group scale (`scale = absmax / format max`).
    Fp8(Fp8Format),
    /// A table of `2^b` levels in `[-1, 1]`, scaled by the group's absmax.
    Codebook(CodebookSource),
}

/// Where a codebook's levels come from.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum CodebookSource {
    /// The 16 NormalFloat-4 levels of QLoRA (4 bits only).
    Nf4,
    /// A Lloyd-Max (1-D k-means) codebook fitted to the tensor being quantized.
    LloydMax,
    /// Levels given by the caller (e.g. fitted on a calibration set).
    Fixed(Codebook),
}

/// Storage type of the per-group parameters (scale and, for affine, offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamDtype {
    /// IEEE half precision: 2 bytes per parameter.
    F16,
    /// IEEE single precision: 4 bytes per parameter.
    F32,
    /// One byte per parameter (`-p8`), for affine groups per channel, per token or of `N`
    /// channels: the groups of one head over one block of tokens (a *set*: one cache block;
    /// offline, one token group of a per-channel spec, or [`ROW_SET_TOKENS`] rows of a row
    /// spec) store their minimum and maximum as the nearest points of a 255-step grid
    /// between the set's f16 minimum and maximum (4 bytes per set); see
    /// [`ParamGrid`](crate::params::ParamGrid). Half the bytes of f16 parameters.
    ///
    /// [`ROW_SET_TOKENS`]: crate::params::ROW_SET_TOKENS
    U8,
}

impl ParamDtype {
    /// Bytes one parameter occupies.
    pub const fn size(self) -> usize {
        match self {
            ParamDtype::F16 => 2,
            ParamDtype::F32 => 4,
            ParamDtype::U8 => 1,
        }
    }

    /// Lower-case name (`"f16"`, `"f32"`, `"u8"`).
    pub const fn name(self) -> &'static str {
        match self {
            ParamDtype::F16 => "f16",
            ParamDtype::F32 => "f32",
            ParamDtype::U8 => "u8",
        }
    }
}

/// Which elements of a `[batch, heads, tokens, head_dim]` tensor share one set of parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Granularity {
    /// One group for the whole tensor.
    PerTensor,
    /// One group per (sequence, head).
    PerHead,
    /// One group per channel (head_dim index) over a block of tokens: `token_group` tokens
    /// (the last block of a head may be shorter), or all tokens of the head when `None`.
    PerChannel {
        /// Tokens per block; `None` for the whole sequence.
        token_group: Option<usize>,
    },
    /// One group per token (row of `head_dim` values).
    PerToken,
    /// Groups of `G` consecutive channels within a token; `G` divides `head_dim`.
    Group(usize),
}

/// How a group's parameters follow from its values (when they are not calibrated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum RangeRule {
    /// The group's minimum and maximum (absmax for the symmetric kinds): no value clips.
    #[default]
    MinMax,
    /// The parameters that minimize the group's squared reconstruction error, found by a
    /// short search: ranges shrunk from min/max, each refined by alternating nearest-code
    /// assignment and a least-squares refit of scale (and offset). Outliers clip to the
    /// extreme codes when that lowers the error of the rest; never worse than
    /// [`RangeRule::MinMax`] on the group's own values. Decoding is unchanged, so every kernel
    /// of the kind applies; the cost is at quantization time (see `docs/formats.md`).
    Mse,
}

/// Refuses zero group and token-group sizes.
fn check_granularity(granularity: Granularity) -> Result<()> {
    match granularity {
        Granularity::Group(0) | Granularity::PerChannel { token_group: Some(0) } => {
            Err(QuantError::GroupSize { group: 0, head_dim: 0 })
        }
        _ => Ok(()),
    }
}

/// Refuses one-byte parameters (`-p8`) outside affine groups per channel, per token or of
/// `N` channels, and with bits per channel (whose width regions hold their parameters apart).
fn check_param_dtype(
    kind: &Kind,
    granularity: Granularity,
    dtype: ParamDtype,
    channel_bits: bool,
) -> Result<()> {
    let grouped =
        matches!(granularity, Granularity::PerChannel { .. } | Granularity::PerToken | Granularity::Group(_));
    if dtype == ParamDtype::U8 && (!matches!(kind, Kind::Affine) || !grouped || channel_bits) {
        return Err(QuantError::InvalidSpec(
            "one-byte parameters (-p8) apply to affine per-channel, per-token and gN specs without -qa"
                .into(),
        ));
    }
    Ok(())
}

/// A full quantization spec: format kind, bit width, granularity and parameter storage.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantSpec {
    kind: Kind,
    bits: u8,
    granularity: Granularity,
    param_dtype: ParamDtype,
    ranges: RangeRule,
    rotated: bool,
    channel_bits: bool,
    pre_rope: bool,
}

impl QuantSpec {
    /// Builds and validates a spec.
    ///
    /// # Errors
    /// [`QuantError::BitsOutOfRange`] for a width the kind does not support (affine and
    /// Lloyd-Max 1..=8, symmetric 2..=8, FP8 exactly 8, NF4 exactly 4),
    /// [`QuantError::InvalidSpec`] for a fixed codebook whose size is not `2^bits`, and
    /// [`QuantError::GroupSize`] for a zero group or token-group size.
    pub fn new(kind: Kind, bits: u8, granularity: Granularity, param_dtype: ParamDtype) -> Result<Self> {
        let (name, min, max) = match &kind {
            Kind::Affine => ("affine", 1, 8),
            Kind::Symmetric => ("symmetric", 2, 8),
            Kind::Fp8(_) => ("fp8", 8, 8),
            Kind::Codebook(CodebookSource::Nf4) => ("nf4", 4, 4),
            Kind::Codebook(_) => ("codebook", 1, 8),
        };
        if bits < min || bits > max {
            return Err(QuantError::BitsOutOfRange { format: name, bits, min, max });
        }
        if let Kind::Codebook(CodebookSource::Fixed(cb)) = &kind
            && cb.levels().len() != 1 << bits
        {
            return Err(QuantError::InvalidSpec(format!(
                "a {bits}-bit codebook needs {} levels, got {}",
                1 << bits,
                cb.levels().len()
            )));
        }
        check_granularity(granularity)?;
        check_param_dtype(&kind, granularity, param_dtype, false)?;
        Ok(Self {
            kind,
            bits,
            granularity,
            param_dtype,
            ranges: RangeRule::MinMax,
            rotated: false,
            channel_bits: false,
            pre_rope: false,
        })
    }

    /// The same spec with another granularity (everything else kept).
    ///
    /// # Errors
    /// [`QuantError::GroupSize`] for a zero group or token-group size.
    pub fn with_granularity(mut self, granularity: Granularity) -> Result<Self> {
        check_granularity(granularity)?;
        check_param_dtype(&self.kind, granularity, self.param_dtype, self.channel_bits)?;
        self.granularity = granularity;
        Ok(self)
    }

    /// Affine (asymmetric) spec with f16 parameters.
    pub fn affine(bits: u8, granularity: Granularity) -> Result<Self> {
        Self::new(Kind::Affine, bits, granularity, ParamDtype::F16)
    }

    /// Symmetric spec with f16 parameters.
    pub fn symmetric(bits: u8, granularity: Granularity) -> Result<Self> {
        Self::new(Kind::Symmetric, bits, granularity, ParamDtype::F16)
    }

    /// FP8 spec with f16 scales.
    pub fn fp8(format: Fp8Format, granularity: Granularity) -> Result<Self> {
        Self::new(Kind::Fp8(format), 8, granularity, ParamDtype::F16)
    }

    /// The same spec with parameters stored as `dtype`. [`ParamDtype::U8`] on a spec other than
    /// affine per-channel is refused when the spec is used ([`QuantSpec::check_shape`]).
    pub fn with_param_dtype(mut self, dtype: ParamDtype) -> Self {
        self.param_dtype = dtype;
        self
    }

    /// The same spec with its dynamic ranges chosen by `rule`.
    pub fn with_ranges(mut self, rule: RangeRule) -> Self {
        self.ranges = rule;
        self
    }

    /// How dynamic ranges are chosen.
    pub fn ranges(&self) -> RangeRule {
        self.ranges
    }

    /// The same spec quantizing rotated rows (`rotated`) or the rows as they are.
    pub fn with_rotation(mut self, rotated: bool) -> Self {
        self.rotated = rotated;
        self
    }

    /// Whether each row is rotated ([`rotate_row`](crate::rotation::rotate_row)) before it is
    /// quantized, and unrotated after decoding. Needs a power-of-two head_dim.
    pub fn rotated(&self) -> bool {
        self.rotated
    }

    /// The same spec with query-aware bits per channel (`-qa`) on or off: `bits` becomes the
    /// average width, and each channel of a head takes its own width from a
    /// [`ChannelBits`](crate::channel_bits::ChannelBits) map fitted to calibration keys and
    /// queries (see [`quantize_channel_bits`](crate::channel_bits::quantize_channel_bits)).
    ///
    /// # Errors
    /// [`QuantError::InvalidSpec`] unless the spec is affine, per channel and not rotated.
    pub fn with_channel_bits(mut self, on: bool) -> Result<Self> {
        if on
            && (!matches!(self.kind, Kind::Affine)
                || !matches!(self.granularity, Granularity::PerChannel { .. })
                || self.rotated)
        {
            return Err(QuantError::InvalidSpec(format!(
                "{self}: bits per channel (-qa) apply to affine per-channel specs without rotation"
            )));
        }
        check_param_dtype(&self.kind, self.granularity, self.param_dtype, on)?;
        self.channel_bits = on;
        Ok(self)
    }

    /// Whether each channel takes its own width from a fitted map (`-qa`); [`Self::bits`] is
    /// then the average.
    pub fn channel_bits(&self) -> bool {
        self.channel_bits
    }

    /// The same spec for keys quantized in their frame before RoPE (`-prerope`) or as given.
    /// Keys arrive after RoPE; such a spec undoes the rotation of each token by its position
    /// ([`Rope::undo`](crate::rope::Rope::undo)) before quantizing and applies it again after
    /// decoding. A channel's constant offset before RoPE, which RoPE turns into an oscillation
    /// that per-channel groups must span, then stays constant within a group. The codes and
    /// parameters take the bytes of the spec without it; quantizing needs the model's
    /// frequencies, so [`quantize`](crate::quantize::quantize) refuses it and the caller undoes
    /// and reapplies the rotation around it.
    pub fn with_pre_rope(mut self, on: bool) -> Self {
        self.pre_rope = on;
        self
    }

    /// Whether keys are quantized in their frame before RoPE (`-prerope`).
    pub fn pre_rope(&self) -> bool {
        self.pre_rope
    }

    /// The format kind.
    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    /// Bits per code.
    pub fn bits(&self) -> u8 {
        self.bits
    }

    /// Which elements share parameters.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// Storage type of the parameters.
    pub fn param_dtype(&self) -> ParamDtype {
        self.param_dtype
    }

    /// Whether each group stores an offset (the affine minimum) besides its scale.
    pub fn has_offset(&self) -> bool {
        matches!(self.kind, Kind::Affine)
    }

    /// Checks that the spec can quantize a tensor of `shape`.
    ///
    /// # Errors
    /// [`QuantError::EmptyTensor`] and [`QuantError::GroupSize`] (a group that does not divide
    /// `head_dim`).
    pub fn check_shape(&self, shape: Shape) -> Result<()> {
        if shape.checked_len().is_none_or(|n| n == 0) {
            return Err(QuantError::EmptyTensor(shape));
        }
        check_param_dtype(&self.kind, self.granularity, self.param_dtype, self.channel_bits)?;
        if self.rotated && !crate::rotation::rotatable(shape.head_dim) {
            return Err(QuantError::InvalidSpec(format!(
                "{self}: rotation needs a power-of-two head_dim, got {}",
                shape.head_dim
            )));
        }
        if let Granularity::Group(g) = self.granularity
            && (g == 0 || !shape.head_dim.is_multiple_of(g))
        {
            return Err(QuantError::GroupSize { group: g, head_dim: shape.head_dim });
        }
        Ok(())
    }
}

impl fmt::Display for QuantSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Affine => write!(f, "int{}", self.bits)?,
            Kind::Symmetric => write!(f, "sym{}", self.bits)?,
            Kind::Fp8(Fp8Format::E4M3) => f.write_str("fp8e4m3")?,
            Kind::Fp8(Fp8Format::E5M2) => f.write_str("fp8e5m2")?,
            Kind::Codebook(CodebookSource::Nf4) => f.write_str("nf4")?,
            Kind::Codebook(CodebookSource::LloydMax) => write!(f, "lloyd{}", self.bits)?,
            Kind::Codebook(CodebookSource::Fixed(_)) => write!(f, "codebook{}", self.bits)?,
        }
        match self.granularity {
            Granularity::PerTensor => f.write_str("-tensor")?,
            Granularity::PerHead => f.write_str("-head")?,
            Granularity::PerChannel { token_group: None } => f.write_str("-channel")?,
            Granularity::PerChannel { token_group: Some(n) } => write!(f, "-channel{n}")?,
            Granularity::PerToken => f.write_str("-token")?,
            Granularity::Group(g) => write!(f, "-g{g}")?,
        }
        if self.ranges == RangeRule::Mse {
            f.write_str("-mse")?;
        }
        if self.rotated {
            f.write_str("-rot")?;
        }
        if self.channel_bits {
            f.write_str("-qa")?;
        }
        if self.pre_rope {
            f.write_str("-prerope")?;
        }
        match self.param_dtype {
            ParamDtype::F16 => {}
            ParamDtype::F32 => f.write_str("-f32")?,
            ParamDtype::U8 => f.write_str("-p8")?,
        }
        Ok(())
    }
}

impl QuantSpec {
    /// The levels of a fixed codebook (`codebookB-...`, whose text names the width, not the
    /// levels); `None` for every other kind. Files that store a spec as text store these
    /// beside it, and [`QuantSpec::parse_with_levels`] reads both back.
    pub fn fixed_levels(&self) -> Option<&[f32]> {
        match &self.kind {
            Kind::Codebook(CodebookSource::Fixed(cb)) => Some(cb.levels()),
            _ => None,
        }
    }

    /// Reads a spec's text as [`FromStr`] does, where `levels` (from
    /// [`QuantSpec::fixed_levels`]) gives the levels of a `codebookB` kind.
    ///
    /// # Errors
    /// As [`FromStr`] and [`Codebook::new`], and [`QuantError::InvalidSpec`] when levels are
    /// given for another kind or width, or missing for a fixed codebook.
    pub fn parse_with_levels(s: &str, levels: Option<Vec<f32>>) -> Result<Self> {
        parse_spec(s, levels.map(Codebook::new).transpose()?)
    }
}

impl FromStr for QuantSpec {
    type Err = QuantError;

    fn from_str(s: &str) -> Result<Self> {
        parse_spec(s, None)
    }
}

/// [`FromStr`] of a spec, where `fixed` gives the levels of a `codebookB` kind.
fn parse_spec(s: &str, fixed: Option<Codebook>) -> Result<QuantSpec> {
    let bad = |why: &str| QuantError::InvalidSpec(format!("{s:?}: {why}"));
    let mut parts = s.trim().split('-');
    let head = parts.next().unwrap_or_default().to_ascii_lowercase();
    let number = |text: &str| text.parse::<u8>().map_err(|_| bad("expected a bit width after the kind"));
    let (kind, bits) = if let Some(b) = head.strip_prefix("int") {
        (Kind::Affine, number(b)?)
    } else if let Some(b) = head.strip_prefix("sym") {
        (Kind::Symmetric, number(b)?)
    } else if head == "fp8e4m3" {
        (Kind::Fp8(Fp8Format::E4M3), 8)
    } else if head == "fp8e5m2" {
        (Kind::Fp8(Fp8Format::E5M2), 8)
    } else if head == "nf4" {
        (Kind::Codebook(CodebookSource::Nf4), 4)
    } else if let Some(b) = head.strip_prefix("lloyd") {
        (Kind::Codebook(CodebookSource::LloydMax), number(b)?)
    } else if let (Some(b), Some(cb)) = (head.strip_prefix("codebook"), &fixed) {
        let bits = number(b)?;
        if bits != cb.bits() {
            return Err(bad(&format!("a {bits}-bit codebook with {} levels", cb.levels().len())));
        }
        (Kind::Codebook(CodebookSource::Fixed(cb.clone())), bits)
    } else {
        return Err(bad("unknown kind (int, sym, fp8e4m3, fp8e5m2, nf4, lloyd)"));
    };
    if fixed.is_some() && !matches!(kind, Kind::Codebook(CodebookSource::Fixed(_))) {
        return Err(bad("codebook levels given for a spec of another kind"));
    }
    let mut granularity = Granularity::PerToken;
    let mut dtype = ParamDtype::F16;
    let mut ranges = RangeRule::MinMax;
    let mut rotated = false;
    let mut channel_bits = false;
    let mut pre_rope = false;
    for part in parts {
        let part = part.to_ascii_lowercase();
        let size = |text: &str| text.parse::<usize>().map_err(|_| bad("expected a size"));
        granularity = match part.as_str() {
            "f32" => {
                dtype = ParamDtype::F32;
                continue;
            }
            "f16" => {
                dtype = ParamDtype::F16;
                continue;
            }
            "p8" => {
                dtype = ParamDtype::U8;
                continue;
            }
            "mse" => {
                ranges = RangeRule::Mse;
                continue;
            }
            "minmax" => {
                ranges = RangeRule::MinMax;
                continue;
            }
            "rot" => {
                rotated = true;
                continue;
            }
            "qa" => {
                channel_bits = true;
                continue;
            }
            "prerope" => {
                pre_rope = true;
                continue;
            }
            "tensor" => Granularity::PerTensor,
            "head" => Granularity::PerHead,
            "channel" => Granularity::PerChannel { token_group: None },
            "token" => Granularity::PerToken,
            p if p.starts_with("channel") => Granularity::PerChannel { token_group: Some(size(&p[7..])?) },
            p if p.starts_with('g') => Granularity::Group(size(&p[1..])?),
            _ => {
                return Err(bad(
                    "unknown granularity (tensor, head, channel[N], token, gN) or option (mse, rot, qa, prerope, f32, p8)",
                ));
            }
        };
    }
    QuantSpec::new(kind, bits, granularity, dtype)?
        .with_ranges(ranges)
        .with_rotation(rotated)
        .with_channel_bits(channel_bits)
        .map(|spec| spec.with_pre_rope(pre_rope))
}
