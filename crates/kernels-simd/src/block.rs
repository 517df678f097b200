//! What a kernel reads: one block of packed rows and its parameters, as plain slices.

use kvq_quant_core::fp8::Fp8Format;
use kvq_quant_core::pack::packed_len;

/// How a code maps to a level before scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Levels<'a> {
    /// Affine: the level is the code.
    Affine,
    /// Symmetric: the level is `code − zero` (`zero = 2^(bits−1)`).
    Symmetric {
        /// The zero point.
        zero: f32,
    },
    /// A table of `2^bits` levels (codebook levels).
    Table(&'a [f32]),
    /// The 256 values of an OCP FP8 format (8-bit codes): fast paths decode the bits in
    /// registers instead of looking a table up. NaN codes (and e5m2's infinities), which no
    /// quantizer writes, decode as [`Fp8Format::decode`] says on every path.
    Fp8(Fp8Format),
}

impl<'a> Levels<'a> {
    /// The table of levels, for table and FP8 levels.
    pub fn table(&self) -> Option<&'a [f32]> {
        match *self {
            Levels::Table(t) => Some(t),
            Levels::Fp8(f) => Some(f.levels()),
            _ => None,
        }
    }
}

/// Where the scales and offsets of a block apply.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Params<'a> {
    /// One scale (and offset) per row: per-token quantization.
    PerRow {
        /// `rows` scales.
        scale: &'a [f32],
        /// `rows` offsets, or `None` for formats without one.
        offset: Option<&'a [f32]>,
    },
    /// One scale (and offset) per channel, shared by the block's rows: per-channel keys.
    PerChannel {
        /// `dim` scales.
        scale: &'a [f32],
        /// `dim` offsets, or `None`.
        offset: Option<&'a [f32]>,
    },
    /// One scale (and offset) per `group` consecutive values of a row (`gN` specs): row `r`'s
    /// values `g · group .. (g + 1) · group` share entry `r · dim / group + g`.
    PerGroup {
        /// Values per group; divides `dim`.
        group: usize,
        /// `rows · dim / group` scales, row-major.
        scale: &'a [f32],
        /// As many offsets, or `None`.
        offset: Option<&'a [f32]>,
    },
}

impl Params<'_> {
    /// The scale and offset of value `k` of row `r`.
    #[inline]
    pub(crate) fn at(&self, r: usize, k: usize, dim: usize) -> (f32, f32) {
        let (i, scale, offset) = match *self {
            Params::PerRow { scale, offset } => (r, scale, offset),
            Params::PerChannel { scale, offset } => (k, scale, offset),
            Params::PerGroup { group, scale, offset } => (r * (dim / group) + k / group, scale, offset),
        };
        (scale[i], offset.map_or(0.0, |o| o[i]))
    }
}

/// A block of `rows` packed rows of `dim` codes of `bits` bits (quant-core's bit-plane
/// layout), with their levels and parameters: `x̂[r][d] = level(c[r][d]) · scale + offset`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantBlock<'a> {
    /// At least `rows · row_bytes` bytes: an invariant the kernels' unchecked row reads rely on.
    pub(crate) codes: &'a [u8],
    pub(crate) rows: usize,
    pub(crate) dim: usize,
    pub(crate) bits: u8,
    pub(crate) row_bytes: usize,
    pub(crate) levels: Levels<'a>,
    pub(crate) params: Params<'a>,
}

/// Why a block or a kernel call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// Slices of the wrong length, or a bit width out of range.
    #[error("kernel input: {0}")]
    Shape(String),
}

impl<'a> QuantBlock<'a> {
    /// Checks the slices against each other.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `codes` is shorter than `rows` packed rows, a parameter slice
    /// has the wrong length, the table does not have `2^bits` entries, or `bits` is not 1..=8.
    pub fn new(
        codes: &'a [u8],
        rows: usize,
        dim: usize,
        bits: u8,
        levels: Levels<'a>,
        params: Params<'a>,
    ) -> Result<Self, KernelError> {
        let bad = |m: String| Err(KernelError::Shape(m));
        let row_bytes = packed_len(dim, bits).map_err(|e| KernelError::Shape(e.to_string()))?;
        if codes.len() < rows * row_bytes {
            return bad(format!("{} code bytes for {rows} rows of {row_bytes}", codes.len()));
        }
        if let Some(t) = levels.table()
            && t.len() != 1 << bits
        {
            return bad(format!("a level table of {} entries for {bits}-bit codes", t.len()));
        }
        let (want, scale, offset) = match params {
            Params::PerRow { scale, offset } => (rows, scale, offset),
            Params::PerChannel { scale, offset } => (dim, scale, offset),
            Params::PerGroup { group, scale, offset } => {
                if group == 0 || !dim.is_multiple_of(group) {
                    return bad(format!("a group of {group} values does not divide rows of {dim}"));
                }
                (rows * (dim / group), scale, offset)
            }
        };
        if scale.len() != want || offset.is_some_and(|o| o.len() != want) {
            return bad(format!("parameters for {want} groups, got {} scales", scale.len()));
        }
        Ok(Self { codes, rows, dim, bits, row_bytes, levels, params })
    }

    /// Rows in the block.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows `r` of the block as a block of their own (their codes and, per row, their
    /// parameters).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn sub_rows(&self, r: std::ops::Range<usize>) -> QuantBlock<'a> {
        let params = match self.params {
            Params::PerRow { scale, offset } => {
                Params::PerRow { scale: &scale[r.clone()], offset: offset.map(|o| &o[r.clone()]) }
            }
            Params::PerGroup { group, scale, offset } => {
                let per_row = self.dim / group;
                let at = r.start * per_row..r.end * per_row;
                Params::PerGroup { group, scale: &scale[at.clone()], offset: offset.map(|o| &o[at]) }
            }
            channel => channel,
        };
        let codes = &self.codes[r.start * self.row_bytes..r.end * self.row_bytes];
        QuantBlock { codes, rows: r.len(), params, ..*self }
    }

    /// Packed codes of row `r`.
    pub(crate) fn row(&self, r: usize) -> &'a [u8] {
        &self.codes[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// [`QuantBlock::row`] without the bounds check, for the integer dots' row loop (the check
    /// and its multiplications were a fifth of its instructions).
    ///
    /// # Safety
    /// `r < rows`: every block holds `rows · row_bytes` code bytes ([`QuantBlock::new`] checks
    /// it, [`QuantBlock::sub_rows`] keeps it).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline]
    pub(crate) unsafe fn row_unchecked(&self, r: usize) -> &'a [u8] {
        // SAFETY: the range lies inside `codes` (this function's contract).
        unsafe { self.codes.get_unchecked(r * self.row_bytes..(r + 1) * self.row_bytes) }
    }

    /// The level of code `c`.
    #[inline]
    pub(crate) fn level(&self, c: u8) -> f32 {
        match self.levels {
            Levels::Affine => f32::from(c),
            Levels::Symmetric { zero } => f32::from(c) - zero,
            Levels::Table(t) => t[c as usize],
            Levels::Fp8(f) => f.levels()[c as usize],
        }
    }
}
