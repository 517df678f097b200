//! Offload: a whole cache, or one sequence, to a versioned binary file with a checksum, and
//! back, bit for bit.
//!
//! Layout (all integers little-endian):
//! ```text
//! magic "KVQCACHE" | version u32 | kind u8 (0 cache, 1 sequence) | header length u32 |
//! header (JSON: the cache config) | body | CRC-32 of everything before it (u32)
//! ```
//! The checksum is verified and the whole file parsed and checked for consistency before the
//! pool is allocated: every count is checked against the bytes that are left before it sizes
//! anything, every full-precision value is checked to be finite and within what its part can
//! quantize, and a corrupt, truncated or crafted file is an error that changes nothing.

use std::collections::BTreeMap;
use std::path::Path;

use kvq_quant_core::{Calibration, QuantSpec};

use crate::cache::{CacheStats, LayerSeq, MAX_SEQ_ID, PagedCache, SeqId, Sequence, value_limit};
use crate::config::{CacheConfig, TailDtype};
use crate::error::{CacheError, Result};
use crate::part_layout::TailBuf;
use crate::pool::{BlockId, BlockPool, arena_bytes, zeroed};

const MAGIC: &[u8; 8] = b"KVQCACHE";
/// The offload format version this build writes and reads.
pub const OFFLOAD_VERSION: u32 = 1;
const KIND_CACHE: u8 = 0;
const KIND_SEQUENCE: u8 = 1;
const KIND_SPLIT: u8 = 2;
/// The largest offload file [`PagedCache::load`] reads (a pool of 2^32 blocks could not be
/// described in less, but no machine holds such a pool in memory either).
pub const MAX_FILE_BYTES: u64 = 1 << 40;

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigWire {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    k_spec: String,
    v_spec: String,
    /// The levels of a fixed-codebook K spec, whose text (`codebookB-...`) names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    k_levels: Option<Vec<f32>>,
    /// The same for the V spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    v_levels: Option<Vec<f32>>,
    residual_blocks: usize,
    sink_tokens: usize,
    tail_dtype: TailDtype,
    /// The values' own (absent when they share `tail_dtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value_tail_dtype: Option<TailDtype>,
    capacity_blocks: usize,
    calibration: Option<Calibration>,
    /// Widths per key channel, per layer and head (`-qa` K specs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    channel_bits: Option<Vec<Vec<u8>>>,
    /// The model's RoPE (`-prerope` K specs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope: Option<kvq_quant_core::Rope>,
    /// Row specs keep the residual window (absent in files of caches without it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    row_window: bool,
}

/// A spec's text and, for a fixed codebook, its levels: checked to read back as the spec.
fn spec_to_wire(s: &QuantSpec) -> Result<(String, Option<Vec<f32>>)> {
    let (text, levels) = (s.to_string(), s.fixed_levels().map(<[f32]>::to_vec));
    match QuantSpec::parse_with_levels(&text, levels.clone()) {
        Ok(back) if &back == s => Ok((text, levels)),
        _ => Err(CacheError::Offload(format!("spec {text} has no text form that reads back"))),
    }
}

fn spec_from_wire(text: &str, levels: Option<Vec<f32>>) -> Result<QuantSpec> {
    QuantSpec::parse_with_levels(text, levels).map_err(|e| CacheError::Offload(format!("spec {text:?}: {e}")))
}

fn to_wire(c: &CacheConfig) -> Result<ConfigWire> {
    let (k_spec, k_levels) = spec_to_wire(&c.k_spec)?;
    let (v_spec, v_levels) = spec_to_wire(&c.v_spec)?;
    Ok(ConfigWire {
        layers: c.layers,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        block_size: c.block_size,
        k_spec,
        v_spec,
        k_levels,
        v_levels,
        residual_blocks: c.residual_blocks,
        sink_tokens: c.sink_tokens,
        tail_dtype: c.tail_dtype,
        value_tail_dtype: c.value_tail_dtype,
        capacity_blocks: c.capacity_blocks,
        calibration: c.calibration.clone(),
        channel_bits: c.channel_bits.as_ref().map(|m| m.iter().map(|b| b.widths().to_vec()).collect()),
        rope: c.rope.clone(),
        row_window: c.row_window,
    })
}

fn from_wire(w: ConfigWire) -> Result<CacheConfig> {
    let channel_bits = w
        .channel_bits
        .map(|maps| maps.into_iter().map(kvq_quant_core::ChannelBits::new).collect::<Result<Vec<_>, _>>())
        .transpose()
        .map_err(|e| CacheError::Offload(format!("channel bit map: {e}")))?;
    let c = CacheConfig {
        layers: w.layers,
        kv_heads: w.kv_heads,
        head_dim: w.head_dim,
        block_size: w.block_size,
        k_spec: spec_from_wire(&w.k_spec, w.k_levels)?,
        v_spec: spec_from_wire(&w.v_spec, w.v_levels)?,
        residual_blocks: w.residual_blocks,
        sink_tokens: w.sink_tokens,
        tail_dtype: w.tail_dtype,
        value_tail_dtype: w.value_tail_dtype,
        capacity_blocks: w.capacity_blocks,
        calibration: w.calibration,
        channel_bits,
        rope: w.rope,
        row_window: w.row_window,
        // Not stored: every implementation writes the same codes. A loaded cache can take
        // faster ones with `PagedCache::set_row_kernels`.
        row_kernels: kvq_quant_core::RowKernels::PORTABLE,
    };
    c.validate().map_err(|e| CacheError::Offload(format!("config: {e}")))?;
    Ok(c)
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn tail(&mut self, t: &TailBuf) {
        let mut b = Vec::with_capacity(t.bytes());
        t.to_le_bytes(&mut b);
        self.bytes(&b);
    }
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end =
            self.at.checked_add(n).filter(|&e| e <= self.data.len()).ok_or_else(|| truncated(self.at))?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?)
            .map_err(|_| CacheError::Offload("length does not fit this machine".into()))
    }
    fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.usize()?;
        self.take(n)
    }
    /// Bytes not yet read.
    fn left(&self) -> usize {
        self.data.len() - self.at
    }
    /// A count of items of at least `item_bytes` bytes each that are still to be read: more
    /// than the bytes left can hold is an error before anything is sized by it.
    fn count(&mut self, item_bytes: usize, what: &str) -> Result<usize> {
        let n = self.usize()?;
        if n.checked_mul(item_bytes).is_none_or(|b| b > self.left()) {
            return Err(CacheError::Offload(format!(
                "{what} {n} needs more than the {} bytes left",
                self.left()
            )));
        }
        Ok(n)
    }
    fn tail(&mut self, dtype: TailDtype, dim: usize) -> Result<TailBuf> {
        let b = self.bytes()?;
        let row =
            dtype.row_bytes(dim).filter(|&r| r > 0).ok_or_else(|| CacheError::Offload("tail rows".into()))?;
        if !b.len().is_multiple_of(row) {
            return Err(CacheError::Offload("tail of a partial row".into()));
        }
        Ok(TailBuf::from_le_bytes(dtype, dim, b))
    }
}

fn truncated(at: usize) -> CacheError {
    CacheError::Offload(format!("truncated at byte {at}"))
}

fn seal(mut w: Writer) -> Vec<u8> {
    let crc = crc32fast::hash(&w.0);
    w.u32(crc);
    w.0
}

/// Checks magic, version, kind and checksum; returns the config and a reader at the body.
fn open(bytes: &[u8], kind: u8) -> Result<(CacheConfig, Reader<'_>)> {
    if bytes.len() < MAGIC.len() + 4 + 1 + 4 + 4 {
        return Err(truncated(bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err(CacheError::Offload("not a kvq cache file (bad magic)".into()));
    }
    let (content, crc) = bytes.split_at(bytes.len() - 4);
    let mut r = Reader { data: content, at: 8 };
    let version = r.u32()?;
    if version != OFFLOAD_VERSION {
        return Err(CacheError::Offload(format!(
            "version {version} is not supported (this build reads {OFFLOAD_VERSION})"
        )));
    }
    if crc32fast::hash(content) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(CacheError::Offload("checksum mismatch: the file is corrupt or truncated".into()));
    }
    let k = r.u8()?;
    if k != kind {
        let what = |k| match k {
            KIND_CACHE => "a whole cache",
            KIND_SEQUENCE => "one sequence",
            KIND_SPLIT => "the head of a split sequence",
            _ => "an unknown kind of contents",
        };
        return Err(CacheError::Offload(format!("the file holds {}, not {}", what(k), what(kind))));
    }
    let header_len = r.u32()? as usize;
    let header = r.take(header_len)?;
    let wire: ConfigWire =
        serde_json::from_slice(header).map_err(|e| CacheError::Offload(format!("header: {e}")))?;
    Ok((from_wire(wire)?, r))
}

fn start(config: &CacheConfig, kind: u8) -> Result<Writer> {
    let mut w = Writer(Vec::new());
    w.0.extend_from_slice(MAGIC);
    w.u32(OFFLOAD_VERSION);
    w.u8(kind);
    let header = serde_json::to_vec(&to_wire(config)?).map_err(|e| CacheError::Offload(e.to_string()))?;
    w.u32(header.len() as u32);
    w.0.extend_from_slice(&header);
    Ok(w)
}

impl PagedCache {
    /// One layer's state; block contents in the file from index `with_blocks` of its table
    /// (`usize::MAX`: only the ids; `0`: all of them).
    fn write_layer(&self, w: &mut Writer, ls: &LayerSeq, with_blocks: usize) {
        w.u64(ls.len as u64);
        w.u64(ls.done[0] as u64);
        w.u64(ls.done[1] as u64);
        w.u64(ls.blocks.len() as u64);
        for (i, &id) in ls.blocks.iter().enumerate() {
            if i >= with_blocks {
                w.bytes(self.pool.block(id));
            } else if with_blocks == usize::MAX {
                w.u32(id);
            }
        }
        for bufs in ls.sinks.iter().chain(&ls.tails) {
            for t in bufs {
                w.tail(t);
            }
        }
    }

    /// A block's contents from a file: what the readers assume of its bytes (the grid of
    /// one-byte parameters is a range), checked before the block is used.
    fn check_block_bytes(&self, block: &[u8]) -> Result<()> {
        let k_bytes = self.parts[0].bytes();
        for (layout, region) in self.parts.iter().zip([&block[..k_bytes], &block[k_bytes..]]) {
            layout.check_block(region).map_err(|e| CacheError::Offload(format!("block contents: {e}")))?;
        }
        Ok(())
    }

    /// Reads one layer; `blocks(r, i)` makes the id of its table's block `i`, of which the
    /// first `given_blocks` are not in the file.
    fn read_layer<'a>(
        &self,
        r: &mut Reader<'a>,
        given_blocks: usize,
        blocks: &mut dyn FnMut(&mut Reader<'a>, usize) -> Result<BlockId>,
    ) -> Result<LayerSeq> {
        let c = &self.config;
        let (len, done_k, done_v) = (r.usize()?, r.usize()?, r.usize()?);
        // Every block costs at least 4 bytes of the file (an id, or a length and contents),
        // but for those of a split sequence given beside it.
        let n_blocks = match given_blocks {
            0 => r.count(4, "block count")?,
            given => {
                let n = r.usize()?;
                if n < given || (n - given).checked_mul(4).is_none_or(|b| b > r.left()) {
                    return Err(CacheError::Offload(format!(
                        "{n} blocks, {given} of them given apart, do not fit the bytes left"
                    )));
                }
                n
            }
        };
        // The blocks that the quantized tokens need (the done counts are checked against the
        // length once the layer is read).
        let needed = crate::cache::held_blocks(c.block_size, [done_k, done_v]).checked_mul(c.kv_heads);
        if needed.is_none_or(|b| n_blocks < b) {
            return Err(CacheError::Offload(format!("{n_blocks} blocks cannot hold {len} tokens")));
        }
        if n_blocks > c.capacity_blocks {
            return Err(CacheError::Offload(format!("{n_blocks} blocks exceed the pool")));
        }
        let mut ids = Vec::with_capacity(n_blocks);
        for i in 0..n_blocks {
            ids.push(blocks(r, i)?);
        }
        let [kt, vt] = c.tail_dtypes();
        let read_bufs = |r: &mut Reader<'a>, t| -> Result<Vec<TailBuf>> {
            (0..c.kv_heads).map(|_| r.tail(t, c.head_dim)).collect()
        };
        let sinks = [read_bufs(r, kt)?, read_bufs(r, vt)?];
        let tails = [read_bufs(r, kt)?, read_bufs(r, vt)?];
        let ls =
            LayerSeq { len, blocks: ids, sinks, done: [done_k, done_v], tails, reserved: Default::default() };
        self.check_layer_state(&ls)?;
        Ok(ls)
    }

    /// Consistency of a layer read from a file: lengths of sinks and tails, done counters, and
    /// full-precision values that the cache itself could have stored (finite, and within what
    /// their part quantizes without overflow), so that later appends cannot fail on them.
    fn check_layer_state(&self, ls: &LayerSeq) -> Result<()> {
        let c = &self.config;
        let d = c.head_dim;
        let p = ls.len.saturating_sub(c.sink_tokens);
        let bad = |m: &str| Err(CacheError::Offload(format!("inconsistent sequence: {m}")));
        if ls.sinks.iter().flatten().any(|s| s.len() != ls.len.min(c.sink_tokens) * d) {
            return bad("sink lengths");
        }
        for (i, layout) in self.parts.iter().enumerate() {
            let limit = value_limit(layout, c.tail_dtypes()[i], true);
            for buf in ls.sinks[i].iter().chain(&ls.tails[i]) {
                if let Some((_, v)) = buf.first_beyond(limit) {
                    return Err(CacheError::Offload(format!(
                        "inconsistent sequence: full-precision {} value {v} (finite values of magnitude at most {limit} only)",
                        if i == 0 { "key" } else { "value" }
                    )));
                }
            }
        }
        if ls.blocks.len() < crate::cache::held_blocks(c.block_size, ls.done) * c.kv_heads
            || !ls.blocks.len().is_multiple_of(c.kv_heads)
        {
            return bad("block count");
        }
        for (i, layout) in self.parts.iter().enumerate() {
            let done = ls.done[i];
            let ok = if layout.has_tail() {
                done <= p
                    && done.is_multiple_of(c.block_size)
                    // Checked: the length is bounded by the tails read from the file, not by
                    // the blocks (the window's tokens hold none).
                    && ls.tails[i].iter().all(|t| (p - done).checked_mul(d) == Some(t.len()))
            } else {
                done == p && ls.tails[i].iter().all(TailBuf::is_empty)
            };
            if !ok {
                return bad("quantized and tail lengths");
            }
        }
        Ok(())
    }

    /// The whole cache as bytes: config, pool, every sequence, statistics.
    ///
    /// # Errors
    /// [`CacheError::Offload`] when a spec cannot be written;
    /// [`CacheError::SequenceIds`] when the next sequence id is over [`MAX_SEQ_ID`], which no
    /// file could then hold.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        // What the loader refuses is not written: a cache whose ids went past the bound (only
        // one loaded from a crafted file near it can) would not read back.
        if self.next_id > MAX_SEQ_ID {
            return Err(CacheError::SequenceIds(self.next_id));
        }
        let mut w = start(&self.config, KIND_CACHE)?;
        w.u64(self.next_id);
        w.u64(self.stats.clamped_values);
        w.u64(self.stats.copied_blocks);
        let cap = self.pool.capacity();
        for id in 0..cap as BlockId {
            w.u32(self.pool.refcount(id));
        }
        w.u64(self.pool.free_list().len() as u64);
        for &id in self.pool.free_list() {
            w.u32(id);
        }
        for id in 0..cap as BlockId {
            if self.pool.refcount(id) > 0 {
                w.0.extend_from_slice(self.pool.block(id));
            }
        }
        w.u64(self.seqs.len() as u64);
        for (id, s) in &self.seqs {
            w.u64(id.0);
            for ls in &s.layers {
                self.write_layer(&mut w, ls, usize::MAX);
            }
        }
        Ok(seal(w))
    }

    /// Rebuilds a cache written by [`PagedCache::to_bytes`].
    ///
    /// # Errors
    /// [`CacheError::Offload`] for a file that is corrupt, truncated, of another version or
    /// inconsistent.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let (config, mut r) = open(bytes, KIND_CACHE)?;
        // The layouts, without the pool: nothing is sized from the header until the body has
        // been checked against it.
        let mut cache = PagedCache::unallocated(config)?;
        let next_id = r.u64()?;
        if next_id > MAX_SEQ_ID {
            return Err(CacheError::Offload(format!("next sequence id {next_id} is over {MAX_SEQ_ID}")));
        }
        let stats = CacheStats { clamped_values: r.u64()?, copied_blocks: r.u64()? };
        let cap = cache.config.capacity_blocks;
        let bb = cache.pool.block_bytes();
        let arena_len = arena_bytes(cap, bb).map_err(|e| CacheError::Offload(e.to_string()))?;
        if cap.checked_mul(4).is_none_or(|n| n > r.left()) {
            return Err(CacheError::Offload(format!(
                "a pool of {cap} blocks needs more than the {} bytes left",
                r.left()
            )));
        }
        let refcount = (0..cap).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
        let n_free = r.count(4, "free list length")?;
        if n_free > cap {
            return Err(CacheError::Offload("free list longer than the pool".into()));
        }
        let free = (0..n_free).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
        let live = refcount.iter().filter(|&&rc| rc > 0).count();
        if live.checked_mul(bb).is_none_or(|n| n > r.left()) {
            return Err(CacheError::Offload(format!("{live} live blocks need more than the bytes left")));
        }
        let mut arena: Vec<u8> = zeroed(arena_len, "the block pool's arena")?;
        for (id, &rc) in refcount.iter().enumerate() {
            if rc > 0 {
                let block = r.take(bb)?;
                cache.check_block_bytes(block)?;
                arena[id * bb..(id + 1) * bb].copy_from_slice(block);
            }
        }
        // A sequence costs at least its id and four counters per layer.
        let n_seqs = r.count(8, "sequence count")?;
        let mut seqs = BTreeMap::new();
        let mut refs = vec![0u32; cap];
        for _ in 0..n_seqs {
            let id = SeqId(r.u64()?);
            let mut layers = Vec::new();
            for _ in 0..cache.config.layers {
                let ls = cache.read_layer(&mut r, 0, &mut |r, _| {
                    let b = r.u32()?;
                    if b as usize >= cap {
                        return Err(CacheError::Offload(format!("block id {b} outside the pool")));
                    }
                    Ok(b)
                })?;
                for &b in &ls.blocks {
                    refs[b as usize] = refs[b as usize]
                        .checked_add(1)
                        .ok_or_else(|| CacheError::Offload(format!("block {b} is referenced too often")))?;
                }
                layers.push(ls);
            }
            if id.0 >= next_id || seqs.insert(id, Sequence { layers }).is_some() {
                return Err(CacheError::Offload(format!(
                    "sequence id {} repeated or beyond the next id",
                    id.0
                )));
            }
        }
        if r.at != r.data.len() {
            return Err(CacheError::Offload("trailing bytes after the last sequence".into()));
        }
        let mut free_sorted = free.clone();
        free_sorted.sort_unstable();
        free_sorted.dedup();
        let expect_free: Vec<BlockId> = (0..cap as BlockId).filter(|&b| refcount[b as usize] == 0).collect();
        if refs != refcount || free_sorted != expect_free || free_sorted.len() != free.len() {
            return Err(CacheError::Offload(
                "reference counts or free list disagree with the block tables".into(),
            ));
        }
        cache.pool = BlockPool::from_parts(bb, arena, refcount, free);
        cache.seqs = seqs;
        cache.next_id = next_id;
        cache.stats = stats;
        Ok(cache)
    }

    /// Writes the whole cache to `path`, atomically: the bytes go to a temporary file in the
    /// same directory, are flushed to disk, and replace `path` in one rename, so a crash or a
    /// full disk leaves either the old file or the new one, never a torn one.
    ///
    /// # Errors
    /// As [`PagedCache::to_bytes`], and I/O errors.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        kvq_quant_core::io::write_atomic(path.as_ref(), &self.to_bytes()?)?;
        Ok(())
    }

    /// Reads a cache written by [`PagedCache::save`].
    ///
    /// # Errors
    /// As [`PagedCache::from_bytes`], and I/O errors.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_bytes(&kvq_quant_core::io::read_regular_file(path.as_ref(), MAX_FILE_BYTES)?)
    }

    /// One sequence, with the contents of its blocks, as bytes (for offloading it while other
    /// sequences keep decoding). The sequence stays in the cache; free it to reclaim its blocks.
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Offload`] (a spec that cannot be written).
    pub fn export_sequence(&self, seq: SeqId) -> Result<Vec<u8>> {
        let s = self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        let mut w = start(&self.config, KIND_SEQUENCE)?;
        for ls in &s.layers {
            self.write_layer(&mut w, ls, 0);
        }
        Ok(seal(w))
    }

    /// Reads a one-sequence file into its layers (block ids still placeholders) and the
    /// contents of its blocks, checking everything but the free blocks.
    fn parse_sequence<'a>(&self, bytes: &'a [u8]) -> Result<(Vec<LayerSeq>, Vec<&'a [u8]>)> {
        self.parse_layers(bytes, KIND_SEQUENCE, &[])
    }

    /// Reads the layers of a sequence file (`KIND_SEQUENCE`) or of a split head
    /// (`KIND_SPLIT`, whose first blocks are `given`: one slice per block of tokens, every
    /// layer's heads in order) written by a cache of this config, and the contents of every
    /// block, in the order of the layers' tables.
    fn parse_layers<'a>(
        &self,
        bytes: &'a [u8],
        kind: u8,
        given: &[&'a [u8]],
    ) -> Result<(Vec<LayerSeq>, Vec<&'a [u8]>)> {
        let (config, mut r) = open(bytes, kind)?;
        let config = CacheConfig {
            capacity_blocks: self.config.capacity_blocks,
            row_kernels: self.config.row_kernels,
            ..config
        };
        if config != self.config {
            return Err(CacheError::Offload(
                "the sequence was written by a cache of another configuration".into(),
            ));
        }
        let bb = self.pool.block_bytes();
        let heads = self.config.kv_heads;
        let given_tokens = if kind == KIND_SPLIT { r.usize()? } else { 0 };
        if given_tokens != given.len() {
            return Err(CacheError::Offload(format!(
                "the head is for {given_tokens} stored blocks of tokens, {} given",
                given.len()
            )));
        }
        let split_bytes = self.split_block_bytes();
        if let Some(b) = given.iter().find(|b| b.len() != split_bytes) {
            return Err(CacheError::Offload(format!(
                "a stored block of tokens of {} bytes, expected {split_bytes}",
                b.len()
            )));
        }
        let mut contents: Vec<&[u8]> = Vec::new();
        let mut layers = Vec::with_capacity(self.config.layers);
        for l in 0..self.config.layers {
            let ls = self.read_layer(&mut r, given.len() * heads, &mut |r, i| {
                let b = match given.get(i / heads) {
                    Some(g) => &g[(l * heads + i % heads) * bb..][..bb],
                    None => r.bytes()?,
                };
                if b.len() != bb {
                    return Err(CacheError::Offload(format!("block of {} bytes, expected {bb}", b.len())));
                }
                self.check_block_bytes(b)?;
                contents.push(b);
                // A placeholder: real ids are allocated once the whole file has been read.
                Ok(0)
            })?;
            // What is given apart must be blocks that no later token changes.
            if given.len() * self.config.block_size > ls.done[0].min(ls.done[1]) {
                return Err(CacheError::Offload(format!(
                    "{} stored blocks of tokens, but only {} tokens of layer {l} are quantized",
                    given.len(),
                    ls.done[0].min(ls.done[1])
                )));
            }
            layers.push(ls);
        }
        if r.at != r.data.len() {
            return Err(CacheError::Offload("trailing bytes after the last layer".into()));
        }
        Ok((layers, contents))
    }

    /// Bytes of one block of tokens of a split sequence ([`PagedCache::export_split`]): a pool
    /// block for every layer and KV head.
    pub fn split_block_bytes(&self) -> usize {
        self.config.layers * self.config.kv_heads * self.pool.block_bytes()
    }

    /// The blocks of tokens of `seq` that are final: quantized in every layer, keys and
    /// values, so that no later token changes their bytes.
    pub fn final_blocks(&self, seq: SeqId) -> Result<usize> {
        let s = self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        let done = s.layers.iter().map(|ls| ls.done[0].min(ls.done[1])).min().unwrap_or(0);
        Ok(done / self.config.block_size)
    }

    /// `seq` split for a store of blocks shared by prefix: its first `blocks` blocks of tokens
    /// (at most its [`PagedCache::final_blocks`]), each as [`PagedCache::split_block_bytes`] bytes (every
    /// layer's pool block of every KV head, in that order, as the cache holds them), and a
    /// head with everything else (the config, lengths, the blocks not yet final, sinks and
    /// full-precision tails), checksummed. A block of tokens depends only on the tokens up to
    /// its end, so sequences that share a prefix share its blocks; the head belongs to one
    /// length. [`PagedCache::import_split`] puts them together again, bit for bit.
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Offload`] (more blocks than are final).
    pub fn export_split(&self, seq: SeqId, blocks: usize) -> Result<(Vec<u8>, Vec<Vec<u8>>)> {
        let n = blocks;
        let last = self.final_blocks(seq)?;
        if n > last {
            return Err(CacheError::Offload(format!("{n} blocks of tokens asked for, {last} are final")));
        }
        let s = &self.seqs[&seq];
        let heads = self.config.kv_heads;
        let mut w = start(&self.config, KIND_SPLIT)?;
        w.u64(n as u64);
        for ls in &s.layers {
            self.write_layer(&mut w, ls, n * heads);
        }
        let mut contents = vec![Vec::with_capacity(self.split_block_bytes()); n];
        for ls in &s.layers {
            for (j, out) in contents.iter_mut().enumerate() {
                for &id in &ls.blocks[j * heads..(j + 1) * heads] {
                    out.extend_from_slice(self.pool.block(id));
                }
            }
        }
        Ok((seal(w), contents))
    }

    /// Whether [`PagedCache::import_split`] would succeed, changing nothing.
    ///
    /// # Errors
    /// As [`PagedCache::import_split`].
    pub fn check_import_split(&self, head: &[u8], blocks: &[&[u8]]) -> Result<()> {
        let (_, contents) = self.parse_layers(head, KIND_SPLIT, blocks)?;
        if contents.len() > self.unreserved_blocks() {
            return Err(CacheError::PoolExhausted { needed: contents.len(), free: self.unreserved_blocks() });
        }
        Ok(())
    }

    /// A new sequence from a head and the blocks of tokens of [`PagedCache::export_split`]
    /// (possibly of another process running the same config), in fresh blocks; every block
    /// is checked as a file's would be.
    ///
    /// # Errors
    /// [`CacheError::Offload`] for bad bytes, a head and blocks that do not go together, or
    /// another cache config; [`CacheError::PoolExhausted`]; nothing changes on error.
    pub fn import_split(&mut self, head: &[u8], blocks: &[&[u8]]) -> Result<SeqId> {
        let (layers, contents) = self.parse_layers(head, KIND_SPLIT, blocks)?;
        self.import_parsed(layers, contents)
    }

    fn import_parsed(&mut self, mut layers: Vec<LayerSeq>, contents: Vec<&[u8]>) -> Result<SeqId> {
        let needed = contents.len();
        if needed > self.unreserved_blocks() {
            return Err(CacheError::PoolExhausted { needed, free: self.unreserved_blocks() });
        }
        let mut it = contents.into_iter();
        for ls in &mut layers {
            for id in &mut ls.blocks {
                *id = self.pool.alloc().expect("reserved above");
                self.pool.block_mut(*id).copy_from_slice(it.next().expect("one content per block"));
            }
        }
        let id = self.take_seq_id();
        self.seqs.insert(id, Sequence { layers });
        Ok(id)
    }

    /// Whether [`PagedCache::import_sequence`] of `bytes` would succeed, without changing
    /// anything (every check, free blocks included), so that a caller importing into several
    /// caches can check them all first.
    ///
    /// # Errors
    /// As [`PagedCache::import_sequence`].
    pub fn check_import(&self, bytes: &[u8]) -> Result<()> {
        let (_, contents) = self.parse_sequence(bytes)?;
        if contents.len() > self.unreserved_blocks() {
            return Err(CacheError::PoolExhausted { needed: contents.len(), free: self.unreserved_blocks() });
        }
        Ok(())
    }

    /// Brings back a sequence written by [`PagedCache::export_sequence`] as a new sequence,
    /// in fresh blocks.
    ///
    /// # Errors
    /// [`CacheError::Offload`] for a bad file or a different cache config,
    /// [`CacheError::PoolExhausted`]; nothing changes on error.
    pub fn import_sequence(&mut self, bytes: &[u8]) -> Result<SeqId> {
        let (layers, contents) = self.parse_sequence(bytes)?;
        self.import_parsed(layers, contents)
    }
}
