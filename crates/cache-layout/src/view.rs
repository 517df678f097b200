//! Reading the cache: ordered segments of a (sequence, layer, head) for the kernels, a
//! reference dequantization, memory accounting and block-table dumps.

use std::fmt::Write as _;

use kvq_quant_core::GroupParams;
use kvq_quant_core::calibration::Part;

use crate::cache::{LayerSeq, PagedCache, SeqId};
use crate::error::Result;
use crate::part_layout::{HeadSegments, Mode, PartLayout, TailBuf};
use crate::pool::BlockId;

/// A run of consecutive tokens of one (sequence, layer, KV head), for K or V.
#[derive(Debug, Clone, Copy)]
pub enum Segment<'a> {
    /// Tokens held in full precision (attention sinks, or the residual window): `rows` holds
    /// `tokens × head_dim` values.
    Full {
        /// Position of the first token.
        first_token: usize,
        /// Tokens in the run.
        tokens: usize,
        /// The values, in the tail's storage type.
        rows: &'a TailBuf,
        /// Offset of the first value in `rows`.
        offset: usize,
    },
    /// Tokens quantized in a block.
    Quantized(BlockView<'a>),
}

/// The segments of one `(sequence, layer, KV head)` and part in token order, from
/// [`PagedCache::segment_iter`]: sinks, quantized blocks, then the full-precision tail.
#[derive(Clone)]
pub struct Segments<'a> {
    cache: &'a PagedCache,
    ls: &'a LayerSeq,
    part: Part,
    /// The part's index (0: K, 1: V).
    i: usize,
    layer: usize,
    head: usize,
    /// 0: the sinks; `1..=blocks`: block `next − 1`; `blocks + 1`: the tail; then done.
    next: usize,
    blocks: usize,
}

impl std::fmt::Debug for Segments<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segments")
            .field("part", &self.part)
            .field("layer", &self.layer)
            .field("head", &self.head)
            .field("remaining", &self.len())
            .finish()
    }
}

impl Segments<'_> {
    /// The segments without those that end at or before token `token` (the sinks and whole
    /// blocks; the tail is kept): a walk that starts at a position without stepping through
    /// every block before it.
    pub fn skip_ending_by(mut self, token: usize) -> Self {
        let cfg = &self.cache.config;
        if token >= cfg.sink_tokens.min(self.ls.len) {
            let block = token.saturating_sub(cfg.sink_tokens) / cfg.block_size;
            self.next = self.next.max(1 + block.min(self.blocks));
        }
        self
    }

    fn has_sinks(&self) -> bool {
        self.ls.len.min(self.cache.config.sink_tokens) > 0
    }

    fn has_tail(&self) -> bool {
        !self.ls.tails[self.i][self.head].is_empty()
    }
}

impl<'a> Iterator for Segments<'a> {
    type Item = Segment<'a>;

    fn next(&mut self) -> Option<Segment<'a>> {
        let cfg = &self.cache.config;
        let (bs, d, sinks) = (cfg.block_size, cfg.head_dim, cfg.sink_tokens);
        loop {
            let at = self.next;
            if at > self.blocks + 1 {
                return None;
            }
            self.next += 1;
            if at == 0 {
                if self.has_sinks() {
                    let rows = &self.ls.sinks[self.i][self.head];
                    return Some(Segment::Full {
                        first_token: 0,
                        tokens: self.ls.len.min(sinks),
                        rows,
                        offset: 0,
                    });
                }
            } else if at <= self.blocks {
                let b = at - 1;
                let id = self.ls.blocks[b * cfg.kv_heads + self.head];
                return Some(Segment::Quantized(BlockView::new(
                    sinks + b * bs,
                    (self.ls.done[self.i] - b * bs).min(bs),
                    id,
                    self.cache.region(id, self.part),
                    &self.cache.parts[self.i],
                    self.cache.static_params(self.part, self.layer, self.head),
                    if self.i == 0 { self.cache.key_segments(self.layer, self.head) } else { None },
                )));
            } else if self.has_tail() {
                let tail = &self.ls.tails[self.i][self.head];
                return Some(Segment::Full {
                    first_token: sinks + self.ls.done[self.i],
                    tokens: tail.len() / d,
                    rows: tail,
                    offset: 0,
                });
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let sinks = usize::from(self.next == 0 && self.has_sinks());
        let blocks = (self.blocks + 1).saturating_sub(self.next.max(1));
        let tail = usize::from(self.next <= self.blocks + 1 && self.has_tail());
        let n = sinks + blocks + tail;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Segments<'_> {}

/// The K or V region of one block, ready for a kernel: packed rows and parameters, no copy.
///
/// This crate is the one owner of a block's bytes: a view is made only here, from a region
/// of the [`PartLayout`]'s size and at most `block_size` valid rows (checked once, when it is
/// made), and it hands readers the codes of its rows ([`BlockView::codes`], per token group of
/// a channel-set block [`BlockView::set_codes`], per width region of `-qa` keys
/// [`BlockView::width_views`]) and its parameters widened ([`BlockView::params_f32_with`]):
/// nothing above it computes an offset.
#[derive(Debug, Clone, Copy)]
pub struct BlockView<'a> {
    first_token: usize,
    tokens: usize,
    block: BlockId,
    /// `block_size` packed rows, then the parameters.
    region: &'a [u8],
    layout: &'a PartLayout,
    statics: &'a [GroupParams],
    widths: Option<&'a HeadSegments>,
}

impl<'a> BlockView<'a> {
    /// A view of `region` laid out by `layout`, its first `tokens` rows valid.
    fn new(
        first_token: usize,
        tokens: usize,
        block: BlockId,
        region: &'a [u8],
        layout: &'a PartLayout,
        statics: &'a [GroupParams],
        widths: Option<&'a HeadSegments>,
    ) -> Self {
        assert!(
            region.len() == layout.bytes() && tokens <= layout.block_size(),
            "a block view of {} bytes and {tokens} rows for a layout of {} bytes and {} rows",
            region.len(),
            layout.bytes(),
            layout.block_size()
        );
        Self { first_token, tokens, block, region, layout, statics, widths }
    }

    /// Position of the first token.
    pub fn first_token(&self) -> usize {
        self.first_token
    }

    /// Valid rows (a block being filled has fewer than `block_size`).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The pool block.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// How the region is laid out and decoded.
    pub fn layout(&self) -> &'a PartLayout {
        self.layout
    }

    /// Calibrated parameters (static parts only; empty otherwise).
    pub fn statics(&self) -> &'a [GroupParams] {
        self.statics
    }

    /// Keys with bits per channel (`-qa`): the head's width regions. The region is then not
    /// one layout's but one per width ([`BlockView::width_views`]); rows hold the head's
    /// channels in its permuted order.
    pub fn widths(&self) -> Option<&'a HeadSegments> {
        self.widths
    }

    /// The whole region as bytes (codes of every row slot, then the parameters): for a
    /// prefetch or a read of the pool's memory, not for decoding.
    pub fn bytes(&self) -> &'a [u8] {
        self.region
    }

    /// The packed codes of the valid rows, `tokens × row_bytes` bytes (of a block without
    /// channel sets; see [`BlockView::set_codes`]).
    pub fn codes(&self) -> &'a [u8] {
        &self.region[..self.tokens * self.layout.row_bytes]
    }

    /// For a per-channel block with several channel sets, token group `j` (`block_size /
    /// channel_sets` rows with a set of parameters of their own): its valid rows' codes and
    /// how many rows that is; `None` for a group past the sets.
    pub fn set_codes(&self, j: usize) -> Option<(&'a [u8], usize)> {
        let sets = self.layout.channel_sets();
        if j >= sets {
            return None;
        }
        let (per, rb) = (self.layout.block_size() / sets, self.layout.row_bytes);
        let rows = per.min(self.tokens.saturating_sub(j * per));
        Some((&self.region[j * per * rb..(j * per + rows) * rb], rows))
    }

    /// The view of its first `tokens` rows (all of them when it has fewer).
    pub fn first_rows(&self, tokens: usize) -> Self {
        Self { tokens: tokens.min(self.tokens), ..*self }
    }

    /// For keys with bits per channel, each width's region as a view of its own (a plain
    /// per-channel block of that width's channels) with the first stored channel it holds;
    /// `None` for every other block.
    pub fn width_views(&self) -> Option<impl Iterator<Item = (usize, BlockView<'a>)> + 'a> {
        let (region, widths, base) = (self.region, self.widths?, *self);
        Some(widths.segments.iter().map(move |s| {
            let bytes = &region[s.byte_offset..s.byte_offset + s.layout.bytes()];
            let view = BlockView::new(base.first_token, base.tokens, base.block, bytes, &s.layout, &[], None);
            (s.first_channel, view)
        }))
    }

    /// Packed codes of row `r`.
    pub fn row_codes(&self, r: usize) -> &[u8] {
        &self.region[r * self.layout.row_bytes..(r + 1) * self.layout.row_bytes]
    }

    /// Parameters of group `g` stored in the block (row parts: `row × groups_per_row + group`;
    /// channel parts: the channel).
    pub fn params(&self, g: usize) -> GroupParams {
        self.layout.read_param(self.region, g)
    }

    /// All parameters stored in the block, widened to f32 in bulk (scales, then offsets;
    /// offsets stay empty for formats without them). Row parts store `tokens × groups per
    /// row` groups, channel parts `head_dim`; static parts store none (see `statics`).
    pub fn params_f32(&self, scales: &mut Vec<f32>, offsets: &mut Vec<f32>) {
        self.params_f32_with(scales, offsets, widen_f16)
    }

    /// [`BlockView::params_f32`] with the caller's widening ([`ParamWidening`]; a closure
    /// `widen(bytes, out)` widens f16 parameters and leaves one-byte ones to
    /// [`ParamGrid::widen`](kvq_quant_core::ParamGrid::widen)): decode passes kernels that
    /// convert with the CPU's instructions, once per block it reads; this crate has no
    /// CPU-specific code.
    pub fn params_f32_with(&self, scales: &mut Vec<f32>, offsets: &mut Vec<f32>, widen: impl ParamWidening) {
        let n = self.param_count();
        // Into slices of the final length (not `extend`), so the loops vectorize; every value
        // is written, so a buffer of this length already is not cleared (a memset per block
        // and part otherwise).
        scales.resize(n, 0.0);
        let grid = self.layout.spec().param_dtype() == kvq_quant_core::ParamDtype::U8;
        offsets.resize(if grid || self.layout.spec().has_offset() { n } else { 0 }, 0.0);
        self.params_f32_into(scales, offsets, widen);
    }

    /// How many parameters the block stores: `tokens × groups per row` for row parts, one per
    /// channel for channel parts, none for static parts (see `statics`).
    pub fn param_count(&self) -> usize {
        let l = self.layout;
        match l.mode() {
            crate::part_layout::Mode::Row { seg } => self.tokens * (l.head_dim() / seg),
            crate::part_layout::Mode::Channel => l.groups,
            crate::part_layout::Mode::Static { .. } => 0,
        }
    }

    /// [`BlockView::params_f32_with`] into the first [`BlockView::param_count`] values of
    /// `scales` and `offsets` (offsets left as they are for formats without them; one-byte
    /// parameters always give both), so that a caller can widen several views into one buffer.
    ///
    /// # Panics
    /// When `scales` (or `offsets`, where written) holds fewer values.
    pub fn params_f32_into(&self, scales: &mut [f32], offsets: &mut [f32], widen: impl ParamWidening) {
        let l = self.layout;
        let n = self.param_count();
        let area = &self.region[l.code_bytes()..];
        if l.spec().param_dtype() == kvq_quant_core::ParamDtype::U8 {
            // One-byte parameters: the grid's offset and scale of each channel's indices.
            let (grid, levels) = (l.grid(area), l.levels());
            let (lo, hi) = area[kvq_quant_core::GRID_BYTES..].split_at(l.groups);
            widen.grid(&grid, &lo[..n], &hi[..n], levels, &mut scales[..n], &mut offsets[..n]);
            return;
        }
        let widen = |from: usize, out: &mut [f32]| match l.spec().param_dtype() {
            kvq_quant_core::ParamDtype::F16 => widen.f16(&area[2 * from..2 * (from + n)], out),
            kvq_quant_core::ParamDtype::U8 => unreachable!("read above"),
            kvq_quant_core::ParamDtype::F32 => {
                for (o, b) in out.iter_mut().zip(area[4 * from..4 * (from + n)].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        };
        widen(0, &mut scales[..n]);
        if l.spec().has_offset() {
            widen(l.groups, &mut offsets[..n]);
        }
    }

    /// Decodes row `r` to f32 (reference path).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        self.decode_row_with(r, out, &mut Vec::new());
    }

    /// [`BlockView::decode_row`] with the caller's buffer for the unpacked codes, which a
    /// loop over rows reuses instead of allocating per row.
    pub fn decode_row_with(&self, r: usize, out: &mut [f32], codes: &mut Vec<u8>) {
        if let Some(views) = self.width_views() {
            // Stored (permuted) channel order, as the block holds them.
            for (first, v) in views {
                let n = v.layout.head_dim;
                v.decode_row_with(r, &mut out[first..first + n], codes);
            }
            return;
        }
        codes.resize(self.layout.head_dim, 0);
        self.layout.decode_row(self.region, r, self.statics, out, codes);
    }
}

/// How [`BlockView::params_f32_with`] widens a block's stored parameters to f32. Both methods
/// must give the values of the portable conversions (the f16 values exactly; the grid's as
/// [`ParamGrid::widen`](kvq_quant_core::ParamGrid::widen)): decode passes vector kernels,
/// tests the portable ones. Every `Fn(&[u8], &mut [f32])` is one, widening f16 bytes and
/// leaving one-byte parameters to `ParamGrid::widen`.
pub trait ParamWidening {
    /// Little-endian f16 `bytes` (any alignment) into `out`: `out.len()` values from
    /// `2 · out.len()` bytes.
    fn f16(&self, bytes: &[u8], out: &mut [f32]);

    /// One-byte parameters: the grid indices `(mins[i], maxs[i])` of each group to its scale
    /// and offset (four slices of one length), as `ParamGrid::widen`, which is the default.
    fn grid(
        &self,
        grid: &kvq_quant_core::ParamGrid,
        mins: &[u8],
        maxs: &[u8],
        levels: f32,
        scales: &mut [f32],
        offsets: &mut [f32],
    ) {
        grid.widen(mins, maxs, levels, scales, offsets);
    }
}

impl<F: Fn(&[u8], &mut [f32])> ParamWidening for F {
    fn f16(&self, bytes: &[u8], out: &mut [f32]) {
        self(bytes, out)
    }
}

/// Little-endian f16 values to f32. Where they are 2-byte aligned (every block whose codes
/// take an even number of bytes), `half` converts them with F16C when the CPU has it: decode
/// does this for every block it reads.
fn widen_f16(bytes: &[u8], out: &mut [f32]) {
    if cfg!(target_endian = "little")
        && let Ok(h) = bytemuck::try_cast_slice::<u8, half::f16>(bytes)
    {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(h, out);
    } else {
        widen_f16_portable(bytes, out);
    }
}

/// [`widen_f16`] for any alignment: eight at a time with a fixed trip count, which the
/// compiler turns into vector code, then the rest.
fn widen_f16_portable(bytes: &[u8], out: &mut [f32]) {
    let full = out.len() / 8 * 8;
    for (o, b) in out[..full].chunks_exact_mut(8).zip(bytes.chunks_exact(16)) {
        let b: &[u8; 16] = b.try_into().expect("16 bytes");
        let h: [u16; 8] = std::array::from_fn(|j| u16::from_le_bytes([b[2 * j], b[2 * j + 1]]));
        let o: &mut [f32; 8] = o.try_into().expect("8 lanes");
        *o = h.map(f16_to_f32);
    }
    for (o, b) in out[full..].iter_mut().zip(bytes[2 * full..].chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Widens a finite f16 (parameters are always finite) with plain arithmetic: the 15 low bits
/// moved into an f32's exponent and mantissa, times 2^112, are the value for normal and
/// subnormal halves alike. Branch-free, so widening a block's parameters vectorizes.
#[inline]
fn f16_to_f32(h: u16) -> f32 {
    const TWO_POW_112: f32 = 5.192_297e33;
    let h = u32::from(h);
    let magnitude = f32::from_bits((h & 0x7fff) << 13) * TWO_POW_112;
    f32::from_bits(magnitude.to_bits() | ((h & 0x8000) << 16))
}

/// Bytes of one layer of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct LayerMemory {
    /// Packed codes of the blocks this layer holds (every block counted once, shared or not).
    pub code_bytes: usize,
    /// Parameters stored in those blocks.
    pub param_bytes: usize,
    /// Calibrated parameters of static parts, and the channel bit maps of `-qa` keys (4 bits
    /// per channel): held once per layer and head.
    pub static_param_bytes: usize,
    /// Residual tails (the window), in their storage type (an 8-bit row's scale included).
    pub tail_bytes: usize,
    /// Attention sinks, likewise.
    pub sink_bytes: usize,
    /// Block tables (4 bytes per entry).
    pub table_bytes: usize,
    /// Blocks held.
    pub blocks: usize,
}

impl LayerMemory {
    /// All bytes.
    pub fn total(&self) -> usize {
        self.code_bytes
            + self.param_bytes
            + self.static_param_bytes
            + self.tail_bytes
            + self.sink_bytes
            + self.table_bytes
    }
}

/// Exact memory of the cache.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CacheMemory {
    /// One entry per layer.
    pub layers: Vec<LayerMemory>,
    /// Blocks free in the pool.
    pub free_blocks: usize,
    /// Bytes of the free blocks.
    pub free_bytes: usize,
    /// Bytes of one block.
    pub block_bytes: usize,
}

impl CacheMemory {
    /// Bytes in use (everything but free blocks).
    pub fn used_bytes(&self) -> usize {
        self.layers.iter().map(LayerMemory::total).sum()
    }
}

impl PagedCache {
    fn part_of(&self, part: Part) -> usize {
        match part {
            Part::K => 0,
            Part::V => 1,
        }
    }

    /// The ordered segments of K or V of `(seq, layer, head)`: sinks, quantized blocks, then
    /// the full-precision tail.
    ///
    /// # Errors
    /// [`crate::CacheError::UnknownSequence`], [`crate::CacheError::Layer`], or
    /// [`crate::CacheError::Shape`] for a head out of range.
    pub fn segments(&self, seq: SeqId, layer: usize, head: usize, part: Part) -> Result<Vec<Segment<'_>>> {
        Ok(self.segment_iter(seq, layer, head, part)?.collect())
    }

    /// [`PagedCache::segments`] as an iterator, which allocates nothing: what decode walks
    /// on every step.
    ///
    /// # Errors
    /// As [`PagedCache::segments`].
    pub fn segment_iter(&self, seq: SeqId, layer: usize, head: usize, part: Part) -> Result<Segments<'_>> {
        let ls = self.layer_seq(seq, layer)?;
        let heads = self.config.kv_heads;
        if head >= heads {
            return Err(crate::CacheError::Shape {
                expected: format!("a head below {heads}"),
                got: head.to_string(),
            });
        }
        let i = self.part_of(part);
        let blocks = ls.done[i].div_ceil(self.config.block_size);
        Ok(Segments { cache: self, ls, part, i, layer, head, next: 0, blocks })
    }

    /// K or V of `(seq, layer, head)` decoded to f32, `tokens × head_dim` (reference path),
    /// unrotated for a `-rot` spec, in the model's channel order for a `-qa` one and turned
    /// back into RoPE for a `-prerope` one: the values as appended, up to quantization. (Segments and block views give the stored rows,
    /// rotated or permuted.)
    ///
    /// # Errors
    /// As [`PagedCache::segments`].
    pub fn dequantize(&self, seq: SeqId, layer: usize, head: usize, part: Part) -> Result<Vec<f32>> {
        let d = self.config.head_dim;
        let mut out = Vec::with_capacity(self.len(seq, layer)? * d);
        for s in self.segments(seq, layer, head, part)? {
            match s {
                Segment::Full { tokens, rows, offset, .. } => {
                    rows.extend_f32(offset..offset + tokens * d, &mut out)
                }
                Segment::Quantized(b) => {
                    let mut row = vec![0f32; d];
                    let at = out.len();
                    for r in 0..b.tokens {
                        b.decode_row(r, &mut row);
                        out.extend_from_slice(&row);
                    }
                    if let (Part::K, Some(rope)) = (part, &self.config.rope) {
                        // Keys stored before RoPE: turned forward to their positions.
                        rope.apply_rows(&mut out[at..], b.first_token);
                    }
                }
            }
        }
        if self.parts[self.part_of(part)].spec.rotated() {
            kvq_quant_core::rotation::unrotate_rows(&mut out, d);
        }
        if let (Part::K, Some(seg)) = (part, self.key_segments(layer, head)) {
            let mut row = vec![0f32; d];
            for stored in out.chunks_exact_mut(d) {
                for (&c, &x) in seg.permutation.iter().zip(stored.iter()) {
                    row[c] = x;
                }
                stored.copy_from_slice(&row);
            }
        }
        Ok(out)
    }

    /// Exact memory, per layer; shared blocks are counted once.
    pub fn memory(&self) -> CacheMemory {
        let heads = self.config.kv_heads;
        let mut seen = vec![false; self.pool.capacity()];
        let mut layers = vec![LayerMemory::default(); self.config.layers];
        let block_codes = self.parts[0].code_bytes() + self.parts[1].code_bytes();
        let block_params = self.parts[0].param_bytes() + self.parts[1].param_bytes();
        for s in self.seqs.values() {
            for (l, ls) in s.layers.iter().enumerate() {
                let m = &mut layers[l];
                for &id in &ls.blocks {
                    if !std::mem::replace(&mut seen[id as usize], true) {
                        m.blocks += 1;
                        m.code_bytes += block_codes;
                        m.param_bytes += block_params;
                    }
                }
                m.table_bytes += ls.blocks.len() * std::mem::size_of::<BlockId>();
                m.tail_bytes += ls.tails.iter().flatten().map(TailBuf::bytes).sum::<usize>();
                m.sink_bytes += ls.sinks.iter().flatten().map(TailBuf::bytes).sum::<usize>();
            }
        }
        for (i, layout) in self.parts.iter().enumerate() {
            if let Mode::Static { .. } = layout.mode {
                let per_group = layout.dtype.size() * if layout.has_offset { 2 } else { 1 };
                for (l, m) in layers.iter_mut().enumerate() {
                    m.static_param_bytes +=
                        (0..heads).map(|h| self.statics[i][l * heads + h].len() * per_group).sum::<usize>();
                }
            }
        }
        if !self.k_segments.is_empty() {
            let per_head = self.config.head_dim.div_ceil(2);
            for m in &mut layers {
                m.static_param_bytes += heads * per_head;
            }
        }
        CacheMemory {
            layers,
            free_blocks: self.pool.free_blocks(),
            free_bytes: self.pool.free_blocks() * self.pool.block_bytes(),
            block_bytes: self.pool.block_bytes(),
        }
    }

    /// A plain-text dump of every sequence's block tables, for debugging and snapshots.
    pub fn dump_tables(&self) -> String {
        let heads = self.config.kv_heads;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "pool: {} blocks, {} free, {} bytes each",
            self.pool.capacity(),
            self.pool.free_blocks(),
            self.pool.block_bytes()
        );
        for (id, seq) in &self.seqs {
            let _ = writeln!(s, "seq {}:", id.0);
            for (l, ls) in seq.layers.iter().enumerate() {
                let _ = write!(
                    s,
                    "  layer {l}: len {}, quantized K {} V {}, blocks",
                    ls.len, ls.done[0], ls.done[1]
                );
                for chunk in ls.blocks.chunks(heads) {
                    let ids: Vec<String> = chunk
                        .iter()
                        .map(|&b| {
                            let rc = self.pool.refcount(b);
                            if rc > 1 { format!("{b}(x{rc})") } else { b.to_string() }
                        })
                        .collect();
                    let _ = write!(s, " [{}]", ids.join(" "));
                }
                let _ = writeln!(s);
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn f16_widening_matches_half_for_every_finite_value() {
        for bits in 0..=u16::MAX {
            let h = half::f16::from_bits(bits);
            if h.is_finite() {
                assert_eq!(super::f16_to_f32(bits).to_bits(), h.to_f32().to_bits(), "{bits:#x}");
            }
        }
    }

    #[test]
    fn aligned_and_unaligned_f16_parameters_widen_alike() {
        // Every finite f16, as little-endian bytes, at an even and at an odd address.
        let values: Vec<u16> = (0..=u16::MAX).filter(|&b| half::f16::from_bits(b).is_finite()).collect();
        let mut bytes = vec![0u8];
        for v in &values {
            bytes.extend(v.to_le_bytes());
        }
        for n in [values.len(), 1, 7, 8, 9, 131] {
            let mut want = vec![0f32; n];
            super::widen_f16_portable(&bytes[1..1 + 2 * n], &mut want);
            // Either start may be the aligned one: copy so that each alignment occurs.
            for pad in 0..2 {
                let mut buf = vec![0u8; pad];
                buf.extend_from_slice(&bytes[1..1 + 2 * n]);
                let mut got = vec![0f32; n];
                super::widen_f16(&buf[pad..], &mut got);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "n {n} pad {pad}");
            }
        }
    }
}
