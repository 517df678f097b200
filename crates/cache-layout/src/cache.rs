//! The paged cache: sequences of tokens per layer, stored in blocks of the pool.
//!
//! Each sequence has, per layer, a block table (logical block `b` of KV head `h` is
//! `blocks[b · heads + h]`), full-precision attention sinks, and for per-channel parts a
//! full-precision tail (KIVI's residual window). A block holds `block_size` tokens of one
//! layer and one KV head: its K region, then its V region (see [`crate::part_layout`]).
//!
//! Every mutating call validates its input and reserves the blocks it needs before it
//! changes anything, so a failed call leaves every sequence and the pool as they were.

use std::collections::BTreeMap;

use kvq_quant_core::calibration::Part;
use kvq_quant_core::{GroupParams, ParamDtype, Tensor};

use crate::config::CacheConfig;
use crate::error::{CacheError, Result};
use crate::part_layout::{BlockParams, HeadSegments, Mode, PartLayout, TailBuf};
use crate::pool::{BlockId, BlockPool};

/// Identifies a sequence of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

/// Per-sequence, per-layer state.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LayerSeq {
    /// Tokens stored for this layer.
    pub(crate) len: usize,
    /// Logical block `b` of head `h` is `blocks[b * heads + h]`.
    pub(crate) blocks: Vec<BlockId>,
    /// Full-precision sink tokens, per head, `[K, V]`.
    pub(crate) sinks: [Vec<TailBuf>; 2],
    /// Per part `[K, V]`: tokens after the sinks already quantized into blocks (row and
    /// static parts: all of them).
    pub(crate) done: [usize; 2],
    /// Per part, per head: full-precision rows of tokens `done..` (channel parts only).
    pub(crate) tails: [Vec<TailBuf>; 2],
    /// Blocks held for this layer's next tokens ([`crate::reserve`]).
    pub(crate) reserved: Reservation,
}

/// One sequence: a [`LayerSeq`] per layer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sequence {
    pub(crate) layers: Vec<LayerSeq>,
}

/// Counters of what streaming did to the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Values outside their calibrated range, clamped to it.
    pub clamped_values: u64,
    /// Blocks copied because a shared block was written (copy-on-write).
    pub copied_blocks: u64,
}

/// What one `(sequence, layer)` holds in reserve (see [`crate::reserve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reservation {
    /// Tokens still covered.
    pub tokens: usize,
    /// Blocks held for them.
    pub blocks: usize,
}

/// A paged, streaming, quantized KV cache.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedCache {
    pub(crate) config: CacheConfig,
    pub(crate) parts: [PartLayout; 2],
    /// Calibrated parameters and ranges of static parts: `[part][layer * heads + head]`.
    pub(crate) statics: [Vec<Vec<GroupParams>>; 2],
    pub(crate) static_ranges: [Vec<Vec<(f32, f32)>>; 2],
    pub(crate) pool: BlockPool,
    pub(crate) seqs: BTreeMap<SeqId, Sequence>,
    pub(crate) next_id: u64,
    pub(crate) stats: CacheStats,
    /// Blocks held by every reservation (at most the free blocks).
    pub(crate) reserved: usize,
    /// For a `-qa` K spec, per `layer · kv_heads + head`: the head's channel order and width
    /// regions (empty otherwise).
    pub(crate) k_segments: Vec<HeadSegments>,
    /// Buffers of an append, kept so that appends allocate nothing once warm.
    pub(crate) scratch: AppendScratch,
}

/// The buffers [`PagedCache::append`] reuses from call to call. Not part of a cache's value:
/// any two compare equal.
#[derive(Debug, Clone, Default)]
pub(crate) struct AppendScratch {
    bytes: Vec<u8>,
    params: Vec<GroupParams>,
    rows: Vec<f32>,
    columns: Vec<f32>,
}

impl PartialEq for AppendScratch {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

const PARTS: [Part; 2] = [Part::K, Part::V];

/// The largest next sequence id a cache accepts from a file: ids then stay far from
/// `u64::MAX` (2^62 more sequences would have to be created to reach it), so they never wrap.
pub const MAX_SEQ_ID: u64 = 1 << 62;

/// The largest magnitude a value may have so that it survives storage in `part_layout`: a tail or
/// sink of f16 holds at most 65504, and parameters of f16 (f32) must not overflow when the
/// value is quantized (the bounds under which no format's scale or offset can).
pub(crate) fn value_limit(
    layout: &PartLayout,
    tail: crate::part_layout::TailDtype,
    stored_as_tail: bool,
) -> f32 {
    let params: f32 = match layout.dtype {
        // One-byte parameters sit on a grid between f16 ends.
        ParamDtype::F16 | ParamDtype::U8 => 32752.0,
        ParamDtype::F32 => 1e37,
    };
    if stored_as_tail && tail == crate::part_layout::TailDtype::F16 { params.min(65504.0) } else { params }
}

fn part_index(part: Part) -> usize {
    match part {
        Part::K => 0,
        Part::V => 1,
    }
}

impl PagedCache {
    /// Replaces the row quantization kernels (see [`CacheConfig::row_kernels`]); stored data is
    /// unaffected, since every implementation writes the same codes.
    pub fn set_row_kernels(&mut self, kernels: kvq_quant_core::RowKernels) {
        self.config.row_kernels = kernels;
    }

    /// Creates an empty cache; the pool is allocated at full capacity.
    ///
    /// # Errors
    /// [`CacheError::Config`] when the config does not validate.
    pub fn new(config: CacheConfig) -> Result<Self> {
        let mut cache = Self::unallocated(config)?;
        cache.pool = BlockPool::new(cache.config.capacity_blocks, cache.pool.block_bytes())?;
        Ok(cache)
    }

    /// The cache of `config` with a pool of no blocks (of the right block size): what a loader
    /// needs to check a file against before it allocates the real pool.
    pub(crate) fn unallocated(config: CacheConfig) -> Result<Self> {
        config.validate()?;
        let calibrated = config.calibration.is_some();
        let make = |spec| {
            PartLayout::new(spec, config.head_dim, config.block_size, calibrated)
                .map(|l| l.with_row_window(config.row_window))
        };
        let parts = [make(&config.k_spec)?, make(&config.v_spec)?];
        let mut statics: [Vec<Vec<GroupParams>>; 2] = Default::default();
        let mut static_ranges: [Vec<Vec<(f32, f32)>>; 2] = Default::default();
        for (i, layout) in parts.iter().enumerate() {
            if let (Mode::Static { .. }, Some(cal)) = (layout.mode, &config.calibration) {
                for layer in 0..config.layers {
                    for head in 0..config.kv_heads {
                        let ranges = cal.group_ranges(PARTS[i], layer, head, layout.spec.granularity())?;
                        let params = ranges
                            .iter()
                            .map(|&(lo, hi)| layout.codec.params(lo, hi))
                            .collect::<Result<_, _>>()?;
                        statics[i].push(params);
                        static_ranges[i].push(ranges);
                    }
                }
            }
        }
        let k_segments = match &config.channel_bits {
            Some(maps) => maps
                .iter()
                .map(|m| HeadSegments::new(m, &config.k_spec, config.block_size, &parts[0]))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let pool = BlockPool::new(0, parts[0].bytes() + parts[1].bytes())?;
        Ok(Self {
            config,
            parts,
            statics,
            static_ranges,
            pool,
            seqs: BTreeMap::new(),
            next_id: 0,
            stats: CacheStats::default(),
            reserved: 0,
            k_segments,
            scratch: AppendScratch::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The layout of the K or V region of a block.
    pub fn part(&self, part: Part) -> &PartLayout {
        &self.parts[part_index(part)]
    }

    /// How the keys of `(layer, head)` are stored under a `-qa` K spec (channel order and
    /// width regions); `None` for other specs or out-of-range indices.
    pub fn key_segments(&self, layer: usize, head: usize) -> Option<&HeadSegments> {
        if head >= self.config.kv_heads {
            return None;
        }
        self.k_segments.get(layer.checked_mul(self.config.kv_heads)?.checked_add(head)?)
    }

    /// Turns query rows (`head_dim` values each, in the model's channel order) into the frame
    /// the keys of `(layer, head)` are stored in, in place, so that a row's dot product with a
    /// stored key is its score: channels permuted as the head's `-qa` keys are
    /// ([`HeadSegments::permutation`]), rows rotated as `-rot` keys are, others unchanged.
    /// `tmp` is a buffer the caller keeps (one row).
    ///
    /// # Errors
    /// [`CacheError::Shape`] when `rows` is not whole rows of `head_dim`.
    pub fn queries_to_key_frame(
        &self,
        layer: usize,
        head: usize,
        rows: &mut [f32],
        tmp: &mut Vec<f32>,
    ) -> Result<()> {
        let d = self.config.head_dim;
        if d == 0 || !rows.len().is_multiple_of(d) {
            return Err(CacheError::Shape {
                expected: format!("query rows of {d} values"),
                got: format!("{} values", rows.len()),
            });
        }
        if let Some(seg) = self.key_segments(layer, head) {
            for row in rows.chunks_exact_mut(d) {
                tmp.clear();
                tmp.extend_from_slice(row);
                for (x, &c) in row.iter_mut().zip(&seg.permutation) {
                    *x = tmp[c];
                }
            }
        } else if self.config.k_spec.rotated() {
            // The rotation is orthogonal: every score stays the same.
            kvq_quant_core::rotation::rotate_rows(rows, d);
        }
        Ok(())
    }

    /// The block pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Streaming counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Live sequences, in id order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Tokens stored for `layer` of `seq`.
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Layer`].
    pub fn len(&self, seq: SeqId, layer: usize) -> Result<usize> {
        Ok(self.layer_seq(seq, layer)?.len)
    }

    /// The block table of `layer` of `seq`: logical block `b` of KV head `h` is entry
    /// `b · kv_heads + h`.
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Layer`].
    pub fn block_table(&self, seq: SeqId, layer: usize) -> Result<&[BlockId]> {
        Ok(&self.layer_seq(seq, layer)?.blocks)
    }

    pub(crate) fn layer_seq(&self, seq: SeqId, layer: usize) -> Result<&LayerSeq> {
        self.check_layer(layer)?;
        Ok(&self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))?.layers[layer])
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.config.layers {
            Ok(())
        } else {
            Err(CacheError::Layer { layer, layers: self.config.layers })
        }
    }

    fn empty_layer(&self) -> LayerSeq {
        let heads = self.config.kv_heads;
        let bufs = |t| (0..heads).map(|_| TailBuf::new(t, self.config.head_dim)).collect::<Vec<_>>();
        let [kt, vt] = self.config.tail_dtypes();
        LayerSeq {
            len: 0,
            blocks: Vec::new(),
            sinks: [bufs(kt), bufs(vt)],
            done: [0, 0],
            tails: [bufs(kt), bufs(vt)],
            reserved: Reservation::default(),
        }
    }

    /// The id of the next sequence. A cache starts at 0 and a file can set at most
    /// [`MAX_SEQ_ID`], so the counter cannot reach `u64::MAX` in any run.
    pub(crate) fn take_seq_id(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id = self.next_id.checked_add(1).expect("ids start at most 2^62 below u64::MAX");
        id
    }

    /// Starts an empty sequence.
    pub fn create(&mut self) -> SeqId {
        let id = self.take_seq_id();
        let layers = (0..self.config.layers).map(|_| self.empty_layer()).collect();
        self.seqs.insert(id, Sequence { layers });
        id
    }

    /// Appends one token to `layer`: `k` and `v` hold `kv_heads × head_dim` values, head-major.
    ///
    /// # Errors
    /// [`CacheError::Shape`], [`CacheError::NonFinite`], [`CacheError::Quant`] (a value too
    /// large for the parameter type), [`CacheError::PoolExhausted`]; nothing changes on error.
    pub fn append(&mut self, seq: SeqId, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_token_shape(k, v)?;
        let d = self.config.head_dim;
        self.extend_with(seq, layer, 1, |part, h, _| {
            let x = if part == 0 { k } else { v };
            &x[h * d..(h + 1) * d]
        })
    }

    /// Whether [`PagedCache::append`] of this token would succeed, without changing anything:
    /// the same checks of shape, values and free blocks, so that a caller appending to several
    /// caches (a model's layers) can check them all before it writes any.
    ///
    /// # Errors
    /// As [`PagedCache::append`].
    pub fn check_append(&self, seq: SeqId, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_token_shape(k, v)?;
        let d = self.config.head_dim;
        let row = |part: usize, h: usize, _| {
            let x = if part == 0 { k } else { v };
            &x[h * d..(h + 1) * d]
        };
        match self.rotated_rows(seq, layer, 1, &row)? {
            None => self.validate(seq, layer, 1, row)?,
            Some(bufs) => self.validate(seq, layer, 1, rotated_view(&bufs, self.config.kv_heads, d, &row))?,
        }
        self.check_available(seq, layer, self.blocks_needed(seq, layer, 1)?)
    }

    fn check_token_shape(&self, k: &[f32], v: &[f32]) -> Result<()> {
        let hd = self.config.kv_heads * self.config.head_dim;
        for (name, x) in [("K", k), ("V", v)] {
            if x.len() != hd {
                return Err(CacheError::Shape {
                    expected: format!("{name} of {hd} values (kv_heads × head_dim)"),
                    got: format!("{} values", x.len()),
                });
            }
        }
        Ok(())
    }

    /// Appends one token to every layer: `k` and `v` hold `layers × kv_heads × head_dim`
    /// values. All layers are checked, and blocks reserved, before any is written.
    ///
    /// # Errors
    /// As [`PagedCache::append`].
    pub fn append_all_layers(&mut self, seq: SeqId, k: &[f32], v: &[f32]) -> Result<()> {
        let per_layer = self.config.kv_heads * self.config.head_dim;
        let n = self.config.layers * per_layer;
        if k.len() != n || v.len() != n {
            return Err(CacheError::Shape {
                expected: format!("{n} values for K and V (layers × kv_heads × head_dim)"),
                got: format!("{} and {}", k.len(), v.len()),
            });
        }
        // Each layer draws on its own reservation first, then on the unreserved blocks.
        let (mut needed, mut own, mut beyond) = (0, 0, 0);
        for l in 0..self.config.layers {
            let (n, held) = (self.blocks_needed(seq, l, 1)?, self.layer_seq(seq, l)?.reserved.blocks);
            needed += n;
            own += n.min(held);
            beyond += n.saturating_sub(held);
        }
        if beyond > self.unreserved_blocks() {
            return Err(CacheError::PoolExhausted { needed, free: self.unreserved_blocks() + own });
        }
        for l in 0..self.config.layers {
            let range = l * per_layer..(l + 1) * per_layer;
            self.validate(seq, l, 1, |part, h, _| {
                let x = if part == 0 { &k[range.clone()] } else { &v[range.clone()] };
                &x[h * self.config.head_dim..(h + 1) * self.config.head_dim]
            })?;
        }
        for l in 0..self.config.layers {
            let range = l * per_layer..(l + 1) * per_layer;
            self.append(seq, l, &k[range.clone()], &v[range])?;
        }
        Ok(())
    }

    /// Appends many tokens to `layer` (prefill): `k` and `v` are `[1, kv_heads, tokens,
    /// head_dim]` tensors.
    ///
    /// # Errors
    /// As [`PagedCache::append`].
    pub fn extend(&mut self, seq: SeqId, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (ks, vs) = (k.shape(), v.shape());
        if ks != vs
            || ks.batch != 1
            || ks.heads != self.config.kv_heads
            || ks.head_dim != self.config.head_dim
        {
            return Err(CacheError::Shape {
                expected: format!("K and V of [{}, tokens, {}]", self.config.kv_heads, self.config.head_dim),
                got: format!("K {ks}, V {vs}"),
            });
        }
        self.extend_with(
            seq,
            layer,
            ks.tokens,
            |part, h, t| if part == 0 { k.row(0, h, t) } else { v.row(0, h, t) },
        )
    }

    /// Blocks an extension of `layer` of `seq` by `n` tokens needs from the pool: new blocks
    /// plus copies of shared blocks it would write. An engine compares it with
    /// `pool().free_blocks()` to schedule work that cannot fail for lack of blocks.
    ///
    /// # Errors
    /// [`crate::CacheError::UnknownSequence`], [`crate::CacheError::Layer`].
    pub fn blocks_needed(&self, seq: SeqId, layer: usize, n: usize) -> Result<usize> {
        Ok(self.needed_for(self.layer_seq(seq, layer)?, n, false))
    }

    /// Checks values (finite, and small enough for the parameter type) before any write.
    fn validate<'a>(
        &self,
        seq: SeqId,
        layer: usize,
        n: usize,
        row: impl Fn(usize, usize, usize) -> &'a [f32],
    ) -> Result<()> {
        let ls = self.layer_seq(seq, layer)?;
        let (start, sinks, d) = (ls.len, self.config.sink_tokens, self.config.head_dim);
        // The tails that this call quantizes (when a block leaves the residual window) must be
        // quantizable too. The cache only ever stores such values, and a loader checks them, so
        // this guards the "a failed call changes nothing" promise rather than real data.
        let p1 = (start + n).saturating_sub(sinks);
        let window = (self.config.residual_blocks + 1) * self.config.block_size;
        for (i, layout) in self.parts.iter().enumerate() {
            if !layout.has_tail() || p1 - ls.done[i] < window {
                continue;
            }
            let limit = value_limit(layout, self.config.tail_dtypes()[i], true);
            for (h, tail) in ls.tails[i].iter().enumerate() {
                if let Some((at, value)) = tail.first_beyond(limit) {
                    return Err(CacheError::NonFinite {
                        part: if i == 0 { "key" } else { "value" },
                        layer,
                        head: h,
                        token: sinks + ls.done[i] + at / d,
                        channel: at % d,
                        value,
                    });
                }
            }
        }
        let tail_dtypes = self.config.tail_dtypes();
        for (i, layout) in self.parts.iter().enumerate() {
            for h in 0..self.config.kv_heads {
                for t in 0..n {
                    let limit = value_limit(layout, tail_dtypes[i], start + t < sinks || layout.has_tail());
                    let x = row(i, h, t);
                    let (lo, hi, finite) = self.config.row_kernels.stats(x);
                    if finite && lo.abs().max(hi.abs()) <= limit {
                        continue;
                    }
                    if let Some(c) = x.iter().position(|v| !v.is_finite()) {
                        return Err(CacheError::NonFinite {
                            part: if i == 0 { "key" } else { "value" },
                            layer,
                            head: h,
                            token: start + t,
                            channel: c,
                            value: x[c],
                        });
                    }
                    if let Some(&big) = x.iter().find(|v| v.abs() > limit) {
                        let dtype = if limit == 65504.0 { "f16 tail" } else { layout.dtype.name() };
                        return Err(CacheError::Quant(kvq_quant_core::QuantError::ParamOverflow {
                            value: big,
                            dtype,
                        }));
                    }
                }
            }
        }
        Ok(())
    }

    fn extend_with<'a>(
        &mut self,
        seq: SeqId,
        layer: usize,
        n: usize,
        row: impl Fn(usize, usize, usize) -> &'a [f32],
    ) -> Result<()> {
        match self.rotated_rows(seq, layer, n, &row)? {
            None => self.extend_rows(seq, layer, n, row),
            Some(bufs) => {
                let (heads, d) = (self.config.kv_heads, self.config.head_dim);
                self.extend_rows(seq, layer, n, rotated_view(&bufs, heads, d, &row))
            }
        }
    }

    /// For a layout with a rotated (`-rot`) part or keys with bits per channel (`-qa`): the
    /// input checked as given (so that a NaN is named where the caller put it), then that
    /// part's rows rotated (or the keys' channels permuted), `[t][head]` order. `None` when
    /// rows are stored as given.
    fn rotated_rows<'a>(
        &self,
        seq: SeqId,
        layer: usize,
        n: usize,
        row: &impl Fn(usize, usize, usize) -> &'a [f32],
    ) -> Result<Option<[Option<Vec<f32>>; 2]>> {
        if !self.parts.iter().any(|p| p.spec.rotated()) && self.k_segments.is_empty() {
            return Ok(None);
        }
        self.validate(seq, layer, n, row)?;
        let (heads, d) = (self.config.kv_heads, self.config.head_dim);
        let rotate = |i: usize| {
            self.parts[i].spec.rotated().then(|| {
                let mut b = Vec::with_capacity(n * heads * d);
                for t in 0..n {
                    for h in 0..heads {
                        b.extend_from_slice(row(i, h, t));
                    }
                }
                kvq_quant_core::rotation::rotate_rows(&mut b, d);
                b
            })
        };
        // Keys of a `-qa` spec: each head's channels in its map's order.
        let permuted = (!self.k_segments.is_empty()).then(|| {
            let mut b = Vec::with_capacity(n * heads * d);
            for t in 0..n {
                for h in 0..heads {
                    let x = row(0, h, t);
                    b.extend(self.k_segments[layer * heads + h].permutation.iter().map(|&c| x[c]));
                }
            }
            b
        });
        Ok(Some([permuted.or_else(|| rotate(0)), rotate(1)]))
    }

    /// [`PagedCache::extend_with`] once any rotation is done: checks, then writes.
    fn extend_rows<'a>(
        &mut self,
        seq: SeqId,
        layer: usize,
        n: usize,
        row: impl Fn(usize, usize, usize) -> &'a [f32],
    ) -> Result<()> {
        self.validate(seq, layer, n, &row)?;
        let needed = self.blocks_needed(seq, layer, n)?;
        self.check_available(seq, layer, needed)?;
        if n == 0 {
            return Ok(());
        }
        let (bs, heads, sinks, d) =
            (self.config.block_size, self.config.kv_heads, self.config.sink_tokens, self.config.head_dim);
        let Self {
            parts,
            statics,
            static_ranges,
            pool,
            seqs,
            stats,
            config,
            reserved,
            k_segments,
            scratch,
            ..
        } = self;
        let ls = &mut seqs.get_mut(&seq).expect("checked by blocks_needed").layers[layer];
        // The blocks come from the layer's reservation first; its tokens are used up.
        let r = &mut ls.reserved;
        let drawn = needed.min(r.blocks);
        r.blocks -= drawn;
        r.tokens = r.tokens.saturating_sub(n);
        let released = if r.tokens == 0 { std::mem::take(&mut r.blocks) } else { 0 };
        *reserved -= drawn + released;

        // Copy-on-write every shared block this call writes, then add the new blocks.
        let plan = WritePlan::new(config, parts, ls, n);
        for i in plan.first_written * heads..plan.have * heads {
            if pool.refcount(ls.blocks[i]) > 1 {
                ls.blocks[i] = pool.copy_on_write(ls.blocks[i]);
                stats.copied_blocks = stats.copied_blocks.saturating_add(1);
            }
        }
        for _ in plan.have * heads..plan.want * heads {
            ls.blocks.push(pool.alloc().expect("blocks reserved above"));
        }

        let k_bytes = parts[0].bytes();
        let AppendScratch { bytes: scratch, params, rows, columns } = &mut *scratch;
        scratch.resize(d, 0);
        params.resize(heads * d, GroupParams::default());
        let segments = |i: usize, h: usize| if i == 0 { k_segments.get(layer * heads + h) } else { None };
        for t in 0..n {
            let pos = ls.len + t;
            if pos < sinks {
                for (i, sink) in ls.sinks.iter_mut().enumerate() {
                    for (h, buf) in sink.iter_mut().enumerate() {
                        buf.push(row(i, h, t));
                    }
                }
                continue;
            }
            let p = pos - sinks;
            let (b, r) = (p / bs, p % bs);
            for (i, layout) in parts.iter().enumerate() {
                let span = if i == 0 { 0..k_bytes } else { k_bytes..k_bytes + layout.bytes() };
                match layout.mode {
                    Mode::Row { seg } if !layout.has_tail() => {
                        // Every head's parameters first, then every head's codes: the heads'
                        // range → parameters → reciprocal chains overlap instead of queueing.
                        let per_row = d / seg;
                        let params = &mut params[..heads * per_row];
                        for (h, p) in params.chunks_exact_mut(per_row).enumerate() {
                            layout.row_params(&config.row_kernels, row(i, h, t), p)?;
                        }
                        for (h, p) in params.chunks_exact(per_row).enumerate() {
                            let id = ls.blocks[b * heads + h];
                            layout.encode_row(
                                &config.row_kernels,
                                row(i, h, t),
                                p,
                                &mut pool.block_mut(id)[span.clone()],
                                r,
                                scratch,
                            )?;
                        }
                        ls.done[i] = p + 1;
                    }
                    Mode::Static { .. } => {
                        for h in 0..heads {
                            let id = ls.blocks[b * heads + h];
                            let g = layer * heads + h;
                            let clamped = layout.encode_static(
                                &config.row_kernels,
                                row(i, h, t),
                                &statics[i][g],
                                &static_ranges[i][g],
                                &mut pool.block_mut(id)[span.clone()],
                                r,
                                scratch,
                            )?;
                            stats.clamped_values = stats.clamped_values.saturating_add(clamped);
                        }
                        ls.done[i] = p + 1;
                    }
                    // Parts that wait in a tail until a block leaves the residual window:
                    // per-channel ones, and row ones with one-byte parameters (a grid per block) or
                    // in a cache that keeps them in the window (`row_window`).
                    Mode::Channel | Mode::Row { .. } => {
                        for (h, tail) in ls.tails[i].iter_mut().enumerate() {
                            tail.push(row(i, h, t));
                        }
                        if p + 1 - ls.done[i] >= (config.residual_blocks + 1) * bs {
                            flush_tail_block(
                                config,
                                layout,
                                i,
                                span.clone(),
                                |h| segments(i, h),
                                ls,
                                pool,
                                (rows, columns, scratch),
                            )?;
                        }
                    }
                }
            }
        }
        ls.len += n;
        Ok(())
    }

    /// A new sequence sharing every block of `seq` (copy-on-write); tails and sinks are copied.
    /// The fork has no reservation; a reservation of `seq` grows by the copies its appends
    /// will now make ([`crate::reserve`]).
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`]; [`CacheError::PoolExhausted`] when `seq` holds a
    /// reservation and the pool cannot cover those copies; nothing changes on error.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let extra = self.plan_fork(seq)?;
        let mut copy = self.seqs[&seq].clone();
        let source = self.seqs.get_mut(&seq).expect("checked above");
        for (ls, extra) in source.layers.iter_mut().zip(extra) {
            ls.reserved.blocks += extra;
            self.reserved += extra;
        }
        for ls in &mut copy.layers {
            ls.reserved = Reservation::default();
            for &id in &ls.blocks {
                self.pool.retain(id);
            }
        }
        let id = self.take_seq_id();
        self.seqs.insert(id, copy);
        Ok(id)
    }

    /// Whether [`PagedCache::truncate`] to `len` would succeed, without changing anything
    /// (so that a caller truncating several caches can check them all first).
    ///
    /// # Errors
    /// As [`PagedCache::truncate`].
    pub fn check_truncate(&self, seq: SeqId, len: usize) -> Result<()> {
        self.plan_truncate(seq, len).map(|_| ())
    }

    /// The checks of a truncation; for a sequence holding a reservation, the blocks each layer's
    /// reservation must hold afterwards (`None` without one: nothing to recompute).
    fn plan_truncate(&self, seq: SeqId, len: usize) -> Result<Option<Vec<usize>>> {
        let (bs, sinks) = (self.config.block_size, self.config.sink_tokens);
        let s = self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        let p_new = len.saturating_sub(sinks);
        for (layer, ls) in s.layers.iter().enumerate() {
            for (i, layout) in self.parts.iter().enumerate() {
                if layout.has_tail() && len < ls.len && p_new < ls.done[i] && !p_new.is_multiple_of(bs) {
                    return Err(CacheError::TruncateIntoBlock {
                        layer,
                        len,
                        quantized_from: sinks + p_new / bs * bs,
                        quantized_until: sinks + ls.done[i],
                    });
                }
            }
        }
        if s.layers.iter().all(|ls| ls.reserved.tokens == 0) {
            return Ok(None);
        }
        // What the reserved tokens need from the new length: on a copy of the layers.
        let mut layers = s.layers.clone();
        let mut freed = 0;
        for ls in &mut layers {
            freed += self.freed_by_release(&cut_layer(&self.config, &self.parts, ls, len));
        }
        self.check_truncate_reservations(seq, &layers, freed).map(Some)
    }

    /// Shortens every layer of `seq` to at most `len` tokens (rollback after speculative
    /// decoding). Per-channel keys already quantized over a block can only be cut at a block
    /// boundary; tokens still in the full-precision window can be cut anywhere. A reservation
    /// keeps its tokens and holds what they need from the new length.
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::TruncateIntoBlock`];
    /// [`CacheError::PoolExhausted`] when a reservation's tokens would need more blocks from
    /// the new length (cut back into a block shared with a fork) than the pool has; nothing
    /// changes on error.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let hold = self.plan_truncate(seq, len)?;
        let Self { config, parts, pool, seqs, reserved, .. } = self;
        let s = seqs.get_mut(&seq).expect("checked above");
        for (l, ls) in s.layers.iter_mut().enumerate() {
            for id in cut_layer(config, parts, ls, len) {
                pool.release(id);
            }
            if let Some(hold) = &hold {
                *reserved = *reserved - ls.reserved.blocks + hold[l];
                ls.reserved.blocks = hold[l];
            }
        }
        Ok(())
    }

    /// Ends `seq`, returning its blocks to the pool (shared blocks stay with their other owners).
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`].
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.remove(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        for ls in &s.layers {
            self.reserved -= ls.reserved.blocks;
            for &id in &ls.blocks {
                self.pool.release(id);
            }
        }
        Ok(())
    }

    /// The K or V region of block `id`.
    pub fn region(&self, id: BlockId, part: Part) -> &[u8] {
        let k = self.parts[0].bytes();
        let block = self.pool.block(id);
        match part {
            Part::K => &block[..k],
            Part::V => &block[k..],
        }
    }

    /// Calibrated parameters of a static part for `(layer, head)` (empty for other modes).
    pub fn static_params(&self, part: Part, layer: usize, head: usize) -> &[GroupParams] {
        self.statics[part_index(part)].get(layer * self.config.kv_heads + head).map_or(&[], Vec::as_slice)
    }
}

/// Cuts one layer's state to `len` tokens; the blocks it no longer uses, for the caller to
/// release.
fn cut_layer(config: &CacheConfig, parts: &[PartLayout; 2], ls: &mut LayerSeq, len: usize) -> Vec<BlockId> {
    let (bs, heads, sinks, d) = (config.block_size, config.kv_heads, config.sink_tokens, config.head_dim);
    if len >= ls.len {
        return Vec::new();
    }
    let p_new = len.saturating_sub(sinks);
    for sink in &mut ls.sinks {
        for buf in sink.iter_mut() {
            buf.truncate(len.min(sinks) * d);
        }
    }
    for (i, layout) in parts.iter().enumerate() {
        if layout.has_tail() {
            if p_new >= ls.done[i] {
                for tail in &mut ls.tails[i] {
                    tail.truncate((p_new - ls.done[i]) * d);
                }
            } else {
                ls.done[i] = p_new;
                for tail in &mut ls.tails[i] {
                    tail.truncate(0);
                }
            }
        } else {
            ls.done[i] = p_new;
        }
    }
    let keep = held_blocks(bs, ls.done) * heads;
    ls.len = len;
    ls.blocks.split_off(keep.min(ls.blocks.len()))
}

/// Which blocks an extension by `n` tokens touches: logical blocks `first_written..have`
/// already exist and are written; `have..want` are new.
pub(crate) struct WritePlan {
    pub(crate) first_written: usize,
    pub(crate) have: usize,
    pub(crate) want: usize,
}

impl WritePlan {
    pub(crate) fn new(config: &CacheConfig, parts: &[PartLayout; 2], ls: &LayerSeq, n: usize) -> Self {
        let (bs, heads, sinks) = (config.block_size, config.kv_heads, config.sink_tokens);
        let p0 = ls.len.saturating_sub(sinks);
        let p1 = (ls.len + n).saturating_sub(sinks);
        let have = ls.blocks.len() / heads;
        let mut first_written = have;
        let mut done_after = [0; 2];
        for (i, layout) in parts.iter().enumerate() {
            if layout.has_tail() {
                // A part that waits in a tail writes blocks when tokens leave its residual
                // window: from its first unwritten block on, if the call flushes any.
                done_after[i] = done_after_append(config, ls.done[i], p0, p1);
                if done_after[i] > ls.done[i] {
                    first_written = first_written.min(ls.done[i] / bs);
                }
            } else {
                if p1 > p0 {
                    first_written = first_written.min(p0 / bs);
                }
                done_after[i] = p1;
            }
        }
        Self { first_written, have, want: held_blocks(bs, done_after).max(have) }
    }
}

/// Quantizes the oldest block of part `i`'s tail (it left the residual window) into the
/// block's `span` of every head: every head's parameters first, so that a head that cannot
/// be quantized leaves the block and every tail as they were; `-prerope` keys turned back by
/// their positions first, `-qa` keys (`segments(h)`) written as their width regions.
#[allow(clippy::too_many_arguments)]
fn flush_tail_block<'s>(
    config: &CacheConfig,
    layout: &PartLayout,
    i: usize,
    span: std::ops::Range<usize>,
    segments: impl Fn(usize) -> Option<&'s HeadSegments>,
    ls: &mut LayerSeq,
    pool: &mut BlockPool,
    (rows, columns, scratch): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<u8>),
) -> Result<()> {
    let (bs, heads, d) = (config.block_size, config.kv_heads, config.head_dim);
    let fb = ls.done[i] / bs;
    rows.clear();
    for tail in &ls.tails[i] {
        tail.extend_f32(0..bs * d, rows);
    }
    if let (0, Some(rope)) = (i, &config.rope) {
        // `-prerope` keys: the block's tokens turned back by their positions, quantized in
        // the frame before RoPE.
        for block in rows.chunks_exact_mut(bs * d) {
            rope.undo_rows(block, config.sink_tokens + fb * bs);
        }
    }
    let params = rows
        .chunks_exact(bs * d)
        .enumerate()
        .map(|(h, block)| match segments(h) {
            Some(seg) => {
                seg.channel_block_params(block, columns).map(|params| BlockParams { params, grid: None })
            }
            None => layout.block_params(&config.row_kernels, block),
        })
        .collect::<Result<Vec<_>>>()?;
    for (h, (block, params)) in rows.chunks_exact(bs * d).zip(&params).enumerate() {
        let id = ls.blocks[fb * heads + h];
        let region = &mut pool.block_mut(id)[span.clone()];
        match segments(h) {
            Some(seg) => {
                seg.write_channel_block(&config.row_kernels, block, &params.params, region, columns, scratch)
            }
            None => layout.write_block(
                &config.row_kernels,
                block,
                &params.params,
                params.grid.as_ref(),
                region,
                scratch,
            ),
        }
        ls.tails[i][h].drain_front(bs * d);
    }
    ls.done[i] += bs;
    Ok(())
}

/// Logical blocks a layer of a sequence needs when its parts have quantized `done` tokens
/// each (after the sinks): a block is taken from the pool when the first of its rows is
/// written, so while every part waits in its full-precision tail (per-channel keys, values
/// with one-byte parameters or a residual window) the tokens of the window hold no block.
pub(crate) fn held_blocks(block_size: usize, done: [usize; 2]) -> usize {
    done[0].max(done[1]).div_ceil(block_size)
}

/// The quantized tokens of a part that waits in a tail (`done` before) once the positions
/// after the sinks grow from `p0` to `p1`: as [`PagedCache::append`] flushes them, one block
/// whenever a token brings the tail to the residual window plus one block.
fn done_after_append(config: &CacheConfig, mut done: usize, p0: usize, p1: usize) -> usize {
    let (bs, window) = (config.block_size, (config.residual_blocks + 1) * config.block_size);
    // One flush per token at most: the token count at which the next one happens.
    let mut at = p0;
    loop {
        let next = (at + 1).max(done + window);
        if next > p1 {
            return done;
        }
        done += bs;
        at = next;
    }
}

/// Rows from the rotated buffers of [`PagedCache::rotated_rows`] for the parts that rotate,
/// from `row` for the others.
fn rotated_view<'a: 'b, 'b, F: Fn(usize, usize, usize) -> &'a [f32] + 'b>(
    bufs: &'b [Option<Vec<f32>>; 2],
    heads: usize,
    d: usize,
    row: &'b F,
) -> impl Fn(usize, usize, usize) -> &'b [f32] + 'b {
    move |i, h, t| match &bufs[i] {
        Some(b) => &b[(t * heads + h) * d..(t * heads + h + 1) * d],
        None => row(i, h, t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flush that cannot quantize one head changes no head: the others keep their tails and
    /// their blocks, and the next appends neither fail differently nor panic. (Loading now
    /// refuses such tails; this holds the flush to its own promise.)
    #[test]
    fn a_failed_flush_changes_no_head() {
        let config = CacheConfig::new(1, 3, 8, 32).with_block_size(4).with_tail_dtype(crate::TailDtype::F32);
        let mut cache = PagedCache::new(config).unwrap();
        let seq = cache.create();
        let row = vec![0.5f32; 24];
        for _ in 0..3 {
            cache.append(seq, 0, &row, &row).unwrap();
        }
        // Head 1's key tail holds a value no parameter can represent.
        let ls = &mut cache.seqs.get_mut(&seq).unwrap().layers[0];
        let TailBuf::F32(t) = &mut ls.tails[0][1] else { unreachable!("f32 tails") };
        t[5] = f32::INFINITY;
        let before = cache.clone();
        for _ in 0..4 {
            assert!(cache.append(seq, 0, &row, &row).is_err());
            assert_eq!(cache, before, "a failed flush changed the cache");
        }
    }
}
