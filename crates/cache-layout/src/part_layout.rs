//! How the keys (or values) of one block are laid out and encoded.
//!
//! A block's K (or V) region is `[codes][scales][offsets]`: `block_size` packed rows, then the
//! per-block parameters in their storage type, scales first (structure of arrays, for SIMD).
//! Which parameters a block holds depends on the streaming mode of the spec:
//! - **row** (per-token, groups along head_dim): each row's groups, quantized on arrival;
//! - **channel** (per-channel over the block's tokens): one group per channel, written when
//!   the block leaves the residual window;
//! - **static** (per-tensor, per-head, or calibrated per-channel): none in the block; the
//!   calibrated parameters live once in the cache.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kvq_quant_core::pack::{packed_len, unpack_row};
use kvq_quant_core::{
    ChannelBits, ChannelParams, Codec, GRID_BYTES, Granularity, GroupParams, ParamDtype, ParamGrid,
    QuantSpec, RangeRule, RowKernels, encode_row_with, row_params_with,
};

use crate::error::{CacheError, Result};

/// Storage type of the tokens kept out of the quantized blocks (residual tails and attention
/// sinks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum TailDtype {
    /// 2 bytes per value (values are rounded to f16 on arrival).
    F16,
    /// 4 bytes per value (exact).
    F32,
    /// 1 byte per value and an f32 scale per row (`head_dim + 4` bytes a row): each row
    /// rounded symmetrically to 8 bits on arrival, `x̂ = round(x / s) · s` with
    /// `s = max|x| / 127` (see [`crate::Int8Rows`]). Half an f16 window's bytes at head_dim 64
    /// and more; a per-channel block is quantized from these rounded rows.
    Int8,
}

impl TailDtype {
    /// Bytes per value, not counting an [`TailDtype::Int8`] row's scale (see
    /// [`TailDtype::row_bytes`]).
    pub fn size(self) -> usize {
        match self {
            TailDtype::F16 => 2,
            TailDtype::F32 => 4,
            TailDtype::Int8 => 1,
        }
    }

    /// Bytes one row of `dim` values takes, scale included (`None` on overflow).
    pub fn row_bytes(self, dim: usize) -> Option<usize> {
        let scale = if self == TailDtype::Int8 { 4 } else { 0 };
        dim.checked_mul(self.size())?.checked_add(scale)
    }

    /// The name used in config files and on the command line (`f16`, `f32`, `int8`).
    pub fn name(self) -> &'static str {
        match self {
            TailDtype::F16 => "f16",
            TailDtype::F32 => "f32",
            TailDtype::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for TailDtype {
    type Err = CacheError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f16" => Ok(TailDtype::F16),
            "f32" => Ok(TailDtype::F32),
            "int8" => Ok(TailDtype::Int8),
            _ => Err(CacheError::Config(format!("tail dtype {s:?}: expected f16, f32 or int8"))),
        }
    }
}

/// Most sets of per-channel parameters a block holds ([`PartLayout::channel_sets`]):
/// `channel32` in blocks of up to 512 tokens.
pub const MAX_CHANNEL_SETS: usize = 16;

/// How a part's tokens become codes as they stream in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Row-local groups of `seg` channels (`seg = head_dim` for per-token), quantized at once.
    Row {
        /// Channels per group.
        seg: usize,
    },
    /// One group per channel over a block (or over each of its token groups, see
    /// [`PartLayout::channel_sets`]), quantized when the block leaves the residual window.
    Channel,
    /// Calibrated parameters: `seg = head_dim` (one group per row) or 1 (per channel).
    Static {
        /// Channels per group.
        seg: usize,
    },
}

/// The layout of the K or V region of a block.
#[derive(Debug, Clone, PartialEq)]
pub struct PartLayout {
    pub(crate) spec: QuantSpec,
    pub(crate) codec: Codec,
    pub(crate) mode: Mode,
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
    pub(crate) row_bytes: usize,
    /// Parameter groups stored in each block.
    pub(crate) groups: usize,
    /// Per-channel parts: the sets of channel parameters in a block, one per token group
    /// (`channel32` in blocks of 128 tokens: 4); 1 otherwise.
    pub(crate) sets: usize,
    pub(crate) dtype: ParamDtype,
    /// Row parts wait in the residual window ([`PartLayout::with_row_window`]).
    windowed: bool,
    pub(crate) has_offset: bool,
}

impl PartLayout {
    pub(crate) fn new(
        spec: &QuantSpec,
        head_dim: usize,
        block_size: usize,
        calibrated: bool,
    ) -> Result<Self> {
        let mode = match spec.granularity() {
            Granularity::PerToken => Mode::Row { seg: head_dim },
            Granularity::Group(g) => Mode::Row { seg: g },
            Granularity::PerChannel { .. } if calibrated => Mode::Static { seg: 1 },
            Granularity::PerChannel { .. } => Mode::Channel,
            Granularity::PerTensor | Granularity::PerHead => Mode::Static { seg: head_dim },
            other => {
                return Err(crate::error::CacheError::Config(format!(
                    "the paged cache has no layout for {other:?} groups"
                )));
            }
        };
        // Per-channel groups of fewer tokens than a block: a set of channel parameters per
        // token group (the configuration checks that the group divides the block).
        let sets = match spec.granularity() {
            Granularity::PerChannel { token_group: Some(n) } if mode == Mode::Channel && n < block_size => {
                if n == 0 || !block_size.is_multiple_of(n) || block_size / n > MAX_CHANNEL_SETS {
                    return Err(crate::error::CacheError::Config(format!(
                        "spec {spec}: per-channel groups of {n} tokens do not divide blocks of {block_size} in at most {MAX_CHANNEL_SETS}"
                    )));
                }
                block_size / n
            }
            _ => 1,
        };
        let groups = match mode {
            Mode::Row { seg } => block_size * (head_dim / seg),
            Mode::Channel => head_dim * sets,
            Mode::Static { .. } => 0,
        };
        Ok(Self {
            spec: spec.clone(),
            codec: Codec::new(spec, None),
            mode,
            head_dim,
            block_size,
            row_bytes: packed_len(head_dim, spec.bits())?,
            groups,
            sets,
            dtype: spec.param_dtype(),
            has_offset: spec.has_offset(),
            windowed: false,
        })
    }

    /// Bytes of packed codes in a block.
    pub fn code_bytes(&self) -> usize {
        self.block_size * self.row_bytes
    }

    /// Bytes of parameters in a block.
    pub fn param_bytes(&self) -> usize {
        let grid = if self.dtype == ParamDtype::U8 { GRID_BYTES } else { 0 };
        self.groups * self.dtype.size() * if self.has_offset { 2 } else { 1 } + grid
    }

    /// Bytes of the whole region.
    pub fn bytes(&self) -> usize {
        self.code_bytes() + self.param_bytes()
    }

    /// The spec.
    pub fn spec(&self) -> &QuantSpec {
        &self.spec
    }

    /// The streaming mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Values per row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The sets of per-channel parameters in a block of a per-channel part: one per token group
    /// of the spec (`int4-channel32` in blocks of 128 tokens: 4, set `j` for rows `32j ..
    /// 32j + 32`), stored one after the other (`head_dim` scales each, then the offsets the
    /// same way); 1 for a group of the whole block and for every other part.
    pub fn channel_sets(&self) -> usize {
        self.sets
    }

    /// Bytes of one packed row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The codec of the spec.
    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    /// Whether tokens wait in a full-precision tail before they are quantized.
    pub fn has_tail(&self) -> bool {
        // Row parts wait for their block too when it shares a grid (one-byte parameters) or
        // when the cache keeps them in the residual window.
        self.mode == Mode::Channel
            || (matches!(self.mode, Mode::Row { .. }) && (self.dtype == ParamDtype::U8 || self.windowed))
    }

    /// The same layout for a cache that keeps row parts in the residual window
    /// ([`crate::CacheConfig::row_window`]).
    pub fn with_row_window(mut self, on: bool) -> Self {
        self.windowed = on;
        self
    }

    /// Writes group `g`'s parameters (f16 or f32; one-byte parameters are written a block at
    /// a time by [`PartLayout::write_block`]).
    fn write_param(&self, region: &mut [u8], g: usize, p: GroupParams) {
        let base = self.code_bytes();
        let size = self.dtype.size();
        let put = |region: &mut [u8], at: usize, v: f32| match self.dtype {
            ParamDtype::F16 => region[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
            ParamDtype::F32 => region[at..at + 4].copy_from_slice(&v.to_le_bytes()),
            ParamDtype::U8 => unreachable!("one-byte parameters are written per block"),
        };
        put(region, base + g * size, p.scale);
        if self.has_offset {
            put(region, base + (self.groups + g) * size, p.offset);
        }
    }

    /// Parameters of group `g` of a block region.
    pub fn read_param(&self, region: &[u8], g: usize) -> GroupParams {
        let area = &region[self.code_bytes()..];
        if self.dtype == ParamDtype::U8 {
            let (grid, levels) = (self.grid(area), self.levels());
            return grid.params(area[GRID_BYTES + g], area[GRID_BYTES + self.groups + g], levels);
        }
        read_params(area, self.dtype, self.groups, self.has_offset, g)
    }

    /// Affine levels `2^b − 1` of the spec (one-byte parameters are affine only).
    pub(crate) fn levels(&self) -> f32 {
        self.codec.affine_levels().expect("one-byte parameters are affine (checked by the spec)")
    }

    /// The grid stored at the start of a block's parameter area (`[grid; 4][minimum indices;
    /// groups][maximum indices; groups]`).
    fn stored_grid(area: &[u8]) -> kvq_quant_core::Result<ParamGrid> {
        ParamGrid::from_bytes([area[0], area[1], area[2], area[3]])
    }

    /// The grid of a block's one-byte parameters, from the start of its parameter area. The
    /// cache wrote it ([`ParamGrid::fit`] checks the ends) and imports check every block's
    /// grid ([`PartLayout::check_block`]), so it is a range here.
    pub(crate) fn grid(&self, area: &[u8]) -> ParamGrid {
        Self::stored_grid(area).unwrap_or_else(|_| {
            // Unreachable for blocks this crate wrote or imported; an empty grid decodes to
            // constant groups rather than propagating NaN.
            ParamGrid::fit([(0.0, 0.0)]).expect("a zero range fits")
        })
    }

    /// Checks a block region read from outside (an offload file): the grid of one-byte
    /// parameters must be a range.
    ///
    /// # Errors
    /// [`kvq_quant_core::QuantError::InvalidArgument`] for a grid that is not.
    pub(crate) fn check_block(&self, region: &[u8]) -> kvq_quant_core::Result<()> {
        if self.dtype == ParamDtype::U8 {
            Self::stored_grid(&region[self.code_bytes()..])?;
        }
        Ok(())
    }

    /// The parameters of one row of a row-mode part (`head_dim / seg` groups) into `params`.
    pub(crate) fn row_params(
        &self,
        kernels: &RowKernels,
        x: &[f32],
        params: &mut [GroupParams],
    ) -> Result<()> {
        let Mode::Row { seg } = self.mode else { unreachable!("row_params on a {:?} part", self.mode) };
        Ok(row_params_with(kernels, &self.codec, x, seg, params)?)
    }

    /// Encodes one row of a row-mode part with its parameters (from [`PartLayout::row_params`])
    /// into row `row` of `region`.
    pub(crate) fn encode_row(
        &self,
        kernels: &RowKernels,
        x: &[f32],
        params: &[GroupParams],
        region: &mut [u8],
        row: usize,
        scratch: &mut [u8],
    ) -> Result<()> {
        let Mode::Row { seg } = self.mode else { unreachable!("encode_row on a {:?} part", self.mode) };
        let codes = row * self.row_bytes..(row + 1) * self.row_bytes;
        encode_row_with(kernels, &self.codec, self.spec.bits(), x, seg, params, scratch, &mut region[codes])?;
        let per_row = self.head_dim / seg;
        for (g, &p) in params.iter().enumerate() {
            self.write_param(region, row * per_row + g, p);
        }
        Ok(())
    }

    /// Encodes one row with calibrated parameters; returns how many values fell outside
    /// their calibrated range (and were clamped).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode_static(
        &self,
        kernels: &RowKernels,
        x: &[f32],
        params: &[GroupParams],
        ranges: &[(f32, f32)],
        region: &mut [u8],
        row: usize,
        scratch: &mut [u8],
    ) -> Result<u64> {
        let Mode::Static { seg } = self.mode else { unreachable!("encode_static on a {:?} part", self.mode) };
        let mut clamped = 0u64;
        if seg == 1 {
            self.codec.encode_per_element(x, params, scratch);
            for (&v, &(lo, hi)) in x.iter().zip(ranges) {
                clamped += u64::from(v < lo || v > hi);
            }
        } else {
            self.codec.encode_with(kernels, x, params[0], scratch);
            let (lo, hi) = ranges[0];
            clamped += x.iter().filter(|&&v| v < lo || v > hi).count() as u64;
        }
        kernels.pack(
            scratch,
            self.spec.bits(),
            &mut region[row * self.row_bytes..(row + 1) * self.row_bytes],
        )?;
        Ok(clamped)
    }

    /// The parameters of a whole block of `block_size` rows (row-major in `rows`) of a part
    /// that waits for its blocks ([`PartLayout::has_tail`]): per channel, as
    /// [`kvq_quant_core::quantize`] finds them with `channel{block_size}`, or per row group
    /// (one-byte parameters of a row part), each row's as [`PartLayout::row_params`] finds
    /// them; with one-byte parameters, snapped onto the block's grid.
    pub(crate) fn block_params(&self, kernels: &RowKernels, rows: &[f32]) -> Result<BlockParams> {
        if let Mode::Row { seg } = self.mode {
            let per_row = self.head_dim / seg;
            let mut params = vec![GroupParams::default(); self.groups];
            for (x, p) in rows.chunks_exact(self.head_dim).zip(params.chunks_exact_mut(per_row)) {
                row_params_with(kernels, &self.codec, x, seg, p)?;
            }
            return self.on_grid(params);
        }
        let d = self.head_dim;
        let mut params = Vec::with_capacity(self.groups);
        // Each token group's channels (the whole block's, one set).
        let per_set = rows.len() / self.sets;
        for rows in rows.chunks_exact(per_set.max(1)) {
            let mut lo = vec![f32::INFINITY; d];
            let mut hi = vec![f32::NEG_INFINITY; d];
            for x in rows.chunks_exact(d) {
                for ((l, h), &v) in lo.iter_mut().zip(hi.iter_mut()).zip(x) {
                    *l = if v < *l { v } else { *l };
                    *h = if v > *h { v } else { *h };
                }
            }
            if self.spec.ranges() == RangeRule::MinMax {
                for (&l, &h) in lo.iter().zip(&hi) {
                    params.push(self.codec.params(l, h)?);
                }
            } else {
                let mut channel = Vec::with_capacity(rows.len() / d);
                for (c, (&l, &h)) in lo.iter().zip(&hi).enumerate() {
                    channel.clear();
                    channel.extend(rows.chunks_exact(d).map(|x| x[c]));
                    params.push(self.codec.group_params(&channel, l, h)?);
                }
            }
        }
        self.on_grid(params)
    }

    /// A block's parameters, snapped onto one grid when they are one-byte ones (as `quantize`
    /// snaps a set).
    fn on_grid(&self, mut params: Vec<GroupParams>) -> Result<BlockParams> {
        let grid = if self.dtype == ParamDtype::U8 {
            let mut indices = Vec::with_capacity(params.len());
            Some((ParamGrid::snap_set(&mut params, self.levels(), &mut indices)?, indices))
        } else {
            None
        };
        Ok(BlockParams { params, grid })
    }

    /// Writes a block quantized with [`PartLayout::block_params`]'s parameters; it cannot
    /// fail, so a caller that found every head's parameters changes all heads or none.
    pub(crate) fn write_block(
        &self,
        kernels: &RowKernels,
        rows: &[f32],
        params: &[GroupParams],
        grid: Option<&GridIndices>,
        region: &mut [u8],
        scratch: &mut [u8],
    ) {
        let d = self.head_dim;
        match grid {
            Some((grid, indices)) => {
                let base = self.code_bytes();
                region[base..base + GRID_BYTES].copy_from_slice(&grid.to_bytes());
                for (g, &(a, b)) in indices.iter().enumerate() {
                    region[base + GRID_BYTES + g] = a;
                    region[base + GRID_BYTES + self.groups + g] = b;
                }
            }
            None => {
                for (g, &p) in params.iter().enumerate() {
                    self.write_param(region, g, p);
                }
            }
        }
        if let Mode::Row { seg } = self.mode {
            let per_row = d / seg;
            for (r, (x, p)) in rows.chunks_exact(d).zip(params.chunks_exact(per_row)).enumerate() {
                let packed = &mut region[r * self.row_bytes..(r + 1) * self.row_bytes];
                encode_row_with(kernels, &self.codec, self.spec.bits(), x, seg, p, scratch, packed)
                    .expect("a block region holds whole rows of head_dim codes");
            }
            return;
        }
        // Each token group's rows with its set of channel parameters.
        let per_set = self.block_size / self.sets;
        for (j, set) in params.chunks_exact(d).enumerate() {
            let channels = ChannelParams::new(set);
            for (r, x) in rows.chunks_exact(d).enumerate().skip(j * per_set).take(per_set) {
                self.codec.encode_channels(x, &channels, scratch);
                kernels
                    .pack(
                        scratch,
                        self.spec.bits(),
                        &mut region[r * self.row_bytes..(r + 1) * self.row_bytes],
                    )
                    .expect("a block region holds whole rows of head_dim codes");
            }
        }
    }

    /// Decodes row `row` of a block region into `out` (`head_dim` values). `statics` are the
    /// calibrated parameters of static parts.
    pub fn decode_row(
        &self,
        region: &[u8],
        row: usize,
        statics: &[GroupParams],
        out: &mut [f32],
        scratch: &mut [u8],
    ) {
        unpack_row(&region[row * self.row_bytes..(row + 1) * self.row_bytes], self.spec.bits(), scratch)
            .expect("block regions hold whole rows");
        match self.mode {
            Mode::Row { seg } => {
                let per_row = self.head_dim / seg;
                for (g, (cs, os)) in scratch.chunks_exact(seg).zip(out.chunks_exact_mut(seg)).enumerate() {
                    self.codec.decode(cs, self.read_param(region, row * per_row + g), os);
                }
            }
            Mode::Channel => {
                let set = row / (self.block_size / self.sets) * self.head_dim;
                let params: Vec<GroupParams> =
                    (set..set + self.head_dim).map(|g| self.read_param(region, g)).collect();
                self.codec.decode_per_element(scratch, &params, out);
            }
            Mode::Static { seg: 1 } => self.codec.decode_per_element(scratch, statics, out),
            Mode::Static { .. } => self.codec.decode(scratch, statics[0], out),
        }
    }
}

/// One-byte parameters of a block: its grid and each group's (minimum, maximum) indices.
pub(crate) type GridIndices = (ParamGrid, Vec<(u8, u8)>);

/// The parameters of one block of a part that waits for its blocks, found before anything is
/// written.
pub(crate) struct BlockParams {
    /// One per group (channel, or row group), as the codes are chosen with them.
    pub(crate) params: Vec<GroupParams>,
    /// With one-byte parameters, where they sit on the block's grid.
    pub(crate) grid: Option<GridIndices>,
}

/// Reads group `g` from a parameter area laid out as `[scales; groups][offsets; groups]`.
pub(crate) fn read_params(
    area: &[u8],
    dtype: ParamDtype,
    groups: usize,
    has_offset: bool,
    g: usize,
) -> GroupParams {
    let get = |i: usize| match dtype {
        ParamDtype::U8 => unreachable!("one-byte parameters are read with their grid"),
        ParamDtype::F16 => f16::from_le_bytes([area[2 * i], area[2 * i + 1]]).to_f32(),
        ParamDtype::F32 => {
            f32::from_le_bytes([area[4 * i], area[4 * i + 1], area[4 * i + 2], area[4 * i + 3]])
        }
    };
    GroupParams { scale: get(g), offset: if has_offset { get(groups + g) } else { 0.0 } }
}

/// Rows of a tail or sink rounded to 8 bits ([`TailDtype::Int8`]): per row of `dim` values
/// one f32 scale `s = max|x| / 127` and `dim` codes `round(x / s) + 128` (a zero row: scale 0,
/// codes 128), read back as `(code − 128) · s`. The quantized kernels read them as a
/// symmetric 8-bit block with per-row scales.
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Rows {
    dim: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
}

/// The zero point of [`Int8Rows`] codes.
pub const INT8_ROWS_ZERO: u8 = 128;

impl Int8Rows {
    fn new(dim: usize) -> Self {
        Self { dim: dim.max(1), codes: Vec::new(), scales: Vec::new() }
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The codes of rows `rows` (`dim` bytes a row).
    pub fn codes(&self, rows: std::ops::Range<usize>) -> &[u8] {
        &self.codes[rows.start * self.dim..rows.end * self.dim]
    }

    /// The scales of rows `rows`.
    pub fn scales(&self, rows: std::ops::Range<usize>) -> &[f32] {
        &self.scales[rows]
    }

    /// Rounds one row of finite values (the cache checks them first) and appends it.
    fn push_row(&mut self, x: &[f32]) {
        let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = m / 127.0;
        self.scales.push(scale);
        let zero = f32::from(INT8_ROWS_ZERO);
        if scale > 0.0 {
            // |x / scale| ≤ 127 (up to rounding, which the clamp absorbs): codes 1..=255.
            self.codes
                .extend(x.iter().map(|&v| ((v / scale).round_ties_even().clamp(-127.0, 127.0) + zero) as u8));
        } else {
            self.codes.extend(std::iter::repeat_n(INT8_ROWS_ZERO, x.len()));
        }
    }

    fn value(&self, i: usize) -> f32 {
        (f32::from(self.codes[i]) - f32::from(INT8_ROWS_ZERO)) * self.scales[i / self.dim]
    }
}

/// Rows kept out of the quantized blocks (tails and sinks) in their storage type.
#[derive(Debug, Clone, PartialEq)]
pub enum TailBuf {
    /// Half precision.
    F16(Vec<f16>),
    /// Single precision.
    F32(Vec<f32>),
    /// Symmetric 8-bit rows with a scale each.
    Int8(Int8Rows),
}

impl TailBuf {
    /// An empty buffer of rows of `dim` values.
    pub(crate) fn new(dtype: TailDtype, dim: usize) -> Self {
        match dtype {
            TailDtype::F16 => TailBuf::F16(Vec::new()),
            TailDtype::F32 => TailBuf::F32(Vec::new()),
            TailDtype::Int8 => TailBuf::Int8(Int8Rows::new(dim)),
        }
    }

    /// Appends whole rows (`x.len()` a multiple of the row length).
    pub(crate) fn push(&mut self, x: &[f32]) {
        match self {
            TailBuf::F16(v) => {
                // Slice conversion: one feature check, then F16C/NEON for the whole row.
                let start = v.len();
                v.resize(start + x.len(), f16::ZERO);
                v[start..].convert_from_f32_slice(x);
            }
            TailBuf::F32(v) => v.extend_from_slice(x),
            TailBuf::Int8(r) => {
                let dim = r.dim;
                x.chunks(dim).for_each(|row| r.push_row(row));
            }
        }
    }

    /// Number of values held.
    pub fn len(&self) -> usize {
        match self {
            TailBuf::F16(v) => v.len(),
            TailBuf::F32(v) => v.len(),
            TailBuf::Int8(r) => r.codes.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The index and value of the first value that is not finite or whose magnitude is over
    /// `limit`, if any.
    pub(crate) fn first_beyond(&self, limit: f32) -> Option<(usize, f32)> {
        let bad = |x: &f32| !x.is_finite() || x.abs() > limit;
        match self {
            TailBuf::F16(v) => v.iter().map(|h| h.to_f32()).enumerate().find(|(_, x)| bad(x)),
            TailBuf::F32(v) => v.iter().copied().enumerate().find(|(_, x)| bad(x)),
            TailBuf::Int8(r) => (0..r.codes.len()).map(|i| (i, r.value(i))).find(|(_, x)| bad(x)),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            TailBuf::F16(v) => v.len() * 2,
            TailBuf::F32(v) => v.len() * 4,
            TailBuf::Int8(r) => r.codes.len() + r.scales.len() * 4,
        }
    }

    /// Values `range` widened to f32, appended to `out`.
    pub fn extend_f32(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        match self {
            TailBuf::F16(v) => {
                let start = out.len();
                out.resize(start + range.len(), 0.0);
                v[range].convert_to_f32_slice(&mut out[start..]);
            }
            TailBuf::F32(v) => out.extend_from_slice(&v[range]),
            TailBuf::Int8(r) => out.extend(range.map(|i| r.value(i))),
        }
    }

    /// Keeps the first `n` values (whole rows).
    pub(crate) fn truncate(&mut self, n: usize) {
        match self {
            TailBuf::F16(v) => v.truncate(n),
            TailBuf::F32(v) => v.truncate(n),
            TailBuf::Int8(r) => {
                r.codes.truncate(n);
                r.scales.truncate(n / r.dim);
            }
        }
    }

    /// Drops the first `n` values (whole rows).
    pub(crate) fn drain_front(&mut self, n: usize) {
        match self {
            TailBuf::F16(v) => {
                v.drain(..n);
            }
            TailBuf::F32(v) => {
                v.drain(..n);
            }
            TailBuf::Int8(r) => {
                r.codes.drain(..n);
                r.scales.drain(..n / r.dim);
            }
        }
    }

    /// The stored bytes: values in little-endian order; for [`TailBuf::Int8`] each row's
    /// scale, then its codes.
    pub(crate) fn to_le_bytes(&self, out: &mut Vec<u8>) {
        match self {
            TailBuf::F16(v) => v.iter().for_each(|h| out.extend_from_slice(&h.to_le_bytes())),
            TailBuf::F32(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            TailBuf::Int8(r) => {
                for (scale, codes) in r.scales.iter().zip(r.codes.chunks_exact(r.dim)) {
                    out.extend_from_slice(&scale.to_le_bytes());
                    out.extend_from_slice(codes);
                }
            }
        }
    }

    /// Reads what [`TailBuf::to_le_bytes`] wrote; `bytes` must be whole rows of `dim` values
    /// ([`TailDtype::row_bytes`]), which the caller checks.
    pub(crate) fn from_le_bytes(dtype: TailDtype, dim: usize, bytes: &[u8]) -> Self {
        match dtype {
            TailDtype::F16 => {
                TailBuf::F16(bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect())
            }
            TailDtype::F32 => TailBuf::F32(
                bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            ),
            TailDtype::Int8 => {
                let mut r = Int8Rows::new(dim);
                for row in bytes.chunks_exact(dim.max(1) + 4) {
                    r.scales.push(f32::from_le_bytes([row[0], row[1], row[2], row[3]]));
                    r.codes.extend_from_slice(&row[4..]);
                }
                TailBuf::Int8(r)
            }
        }
    }
}

/// One width of a `-qa` key head: a per-channel region of its own inside the block's K region,
/// for the stored channels `first_channel..first_channel + layout.head_dim()` (in the head's
/// permuted order).
#[derive(Debug, Clone, PartialEq)]
pub struct WidthSegment {
    /// The region's layout: per channel over the block, `head_dim` = the width's channels,
    /// bits = the width.
    pub layout: PartLayout,
    /// The first of the segment's channels in stored (permuted) order.
    pub first_channel: usize,
    /// Where the segment's region starts in the block's K region.
    pub byte_offset: usize,
}

/// How a `-qa` key head is stored: its channels permuted so that each width's are contiguous
/// ([`ChannelBits::permutation`]), and one per-channel region per width, narrowest first.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadSegments {
    /// Stored channel `i` is the model's channel `permutation[i]`.
    pub permutation: Vec<usize>,
    /// The widths' regions, in stored channel order.
    pub segments: Vec<WidthSegment>,
}

impl HeadSegments {
    /// The regions of `map` under `spec` (affine, per channel over the block, `-qa`), which
    /// together take exactly the bytes of `whole`, the K region of the spec's average width.
    pub(crate) fn new(
        map: &ChannelBits,
        spec: &QuantSpec,
        block_size: usize,
        whole: &PartLayout,
    ) -> Result<Self> {
        let mut segments = Vec::new();
        let (mut first_channel, mut byte_offset) = (0, 0);
        for (w, channels) in map.segments() {
            let layout = PartLayout::new(
                &kvq_quant_core::channel_bits::width_spec(spec, w)?,
                channels.len(),
                block_size,
                false,
            )?;
            let bytes = layout.bytes();
            segments.push(WidthSegment { layout, first_channel, byte_offset });
            first_channel += channels.len();
            byte_offset += bytes;
        }
        if byte_offset != whole.bytes() || whole.mode != Mode::Channel {
            return Err(crate::error::CacheError::Config(format!(
                "the width regions of a channel bit map take {byte_offset} bytes, the K region {}",
                whole.bytes()
            )));
        }
        Ok(Self { permutation: map.permutation(), segments })
    }

    /// The per-channel parameters of a whole block (rows of the head's stored, permuted
    /// channels, row-major), in stored channel order: each width's as its region finds them.
    pub(crate) fn channel_block_params(&self, rows: &[f32], buf: &mut Vec<f32>) -> Result<Vec<GroupParams>> {
        let mut params = Vec::with_capacity(self.permutation.len());
        for s in &self.segments {
            gather_columns(rows, self.permutation.len(), s.first_channel, s.layout.head_dim, buf);
            params.extend(s.layout.block_params(&RowKernels::PORTABLE, buf)?.params);
        }
        Ok(params)
    }

    /// Writes a block with [`HeadSegments::channel_block_params`]'s parameters into the K
    /// region `region`, each width into its own region.
    pub(crate) fn write_channel_block(
        &self,
        kernels: &RowKernels,
        rows: &[f32],
        params: &[GroupParams],
        region: &mut [u8],
        buf: &mut Vec<f32>,
        scratch: &mut [u8],
    ) {
        for s in &self.segments {
            let n = s.layout.head_dim;
            gather_columns(rows, self.permutation.len(), s.first_channel, n, buf);
            s.layout.write_block(
                kernels,
                buf,
                &params[s.first_channel..s.first_channel + n],
                None,
                &mut region[s.byte_offset..s.byte_offset + s.layout.bytes()],
                &mut scratch[..n],
            );
        }
    }
}

/// Columns `first..first + n` of the rows of `d` values in `rows`, row-major, into `out`.
fn gather_columns(rows: &[f32], d: usize, first: usize, n: usize, out: &mut Vec<f32>) {
    out.clear();
    for row in rows.chunks_exact(d) {
        out.extend_from_slice(&row[first..first + n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut rng = kvq_quant_core::synth::Rng::new(seed);
        (0..n * d).map(|i| rng.normal() as f32 * if i % d == 3 { 40.0 } else { 1.0 }).collect()
    }

    #[test]
    fn int8_rows_round_within_half_a_step_and_keep_their_rows() {
        let d = 24;
        let x = rows(5, d, 1);
        let mut t = TailBuf::new(TailDtype::Int8, d);
        t.push(&x[..d]);
        t.push(&x[d..]);
        let zero = vec![0.0; d];
        t.push(&zero);
        assert_eq!((t.len(), t.bytes()), (6 * d, 6 * (d + 4)));
        let mut back = Vec::new();
        t.extend_f32(0..6 * d, &mut back);
        for (r, (row, got)) in x.chunks(d).chain([zero.as_slice()]).zip(back.chunks(d)).enumerate() {
            let step = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in row.iter().zip(got) {
                assert!((a - b).abs() <= step * 0.5 * (1.0 + 1e-6), "row {r}: {a} -> {b}, step {step}");
            }
        }
        let TailBuf::Int8(r) = &t else { unreachable!("int8 rows") };
        assert_eq!(r.codes(5..6), &[INT8_ROWS_ZERO; 24][..]);
        assert_eq!(r.scales(5..6), &[0.0]);
        // The largest value of a row takes the extreme code.
        assert!(r.codes(0..1).iter().any(|&c| c == 1 || c == 255));

        // Bytes round trip, then the same rows after dropping the first and the last.
        let mut bytes = Vec::new();
        t.to_le_bytes(&mut bytes);
        assert_eq!(bytes.len(), t.bytes());
        let mut u = TailBuf::from_le_bytes(TailDtype::Int8, d, &bytes);
        assert_eq!(u, t);
        u.drain_front(d);
        u.truncate(4 * d);
        let mut mid = Vec::new();
        u.extend_f32(0..4 * d, &mut mid);
        assert_eq!(mid, back[d..5 * d]);
        assert_eq!(u.bytes(), 4 * (d + 4));
        assert_eq!(u.first_beyond(f32::MAX), None);
        assert!(u.first_beyond(1.0).is_some());
    }

    #[test]
    fn tail_dtype_names_and_row_bytes() {
        for t in [TailDtype::F16, TailDtype::F32, TailDtype::Int8] {
            assert_eq!(t.name().parse::<TailDtype>().unwrap(), t);
        }
        assert!("f8".parse::<TailDtype>().is_err());
        assert_eq!(TailDtype::Int8.row_bytes(64), Some(68));
        assert_eq!(TailDtype::F16.row_bytes(64), Some(128));
        assert_eq!(TailDtype::F32.row_bytes(usize::MAX), None);
    }
}
