//! The high-level cache: per-layer K and V specs, a config that loads from TOML or JSON, and a
//! [`QuantizedKvCache`] that stores a model's layers and answers decode attention.
//!
//! Each layer is a [`PagedCache`] of its own (its own specs and pool), driven in lockstep so
//! that a sequence id means the same sequence in every layer.

use std::path::Path;

use kvq_cache_layout::{CacheConfig, CacheMemory, PagedCache};
use kvq_quant_core::{Calibration, Tensor};

// What a cache's config and calls name, from the crates below, so that a user of the facade
// names them here.
#[doc(no_inline)]
pub use kvq_cache_layout::{CacheError, SeqId, TailDtype};
#[doc(no_inline)]
pub use kvq_quant_core::channel_bits::fit_heads;
#[doc(no_inline)]
pub use kvq_quant_core::{ChannelBits, QuantError, QuantSpec, Rope, RopePairing, Shape};

use crate::attention::{
    AttentionError, AttentionOptions, BatchSeq, DecodeWorkspace, decode_attention, decode_attention_batch,
};
use crate::element::Element;

/// One layer of a [`QuantizedKvCache`] ([`QuantizedKvCache::layer`]): its memory and its
/// contents, read without a layer index, with errors that name the model's layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerCache<'a> {
    paged: &'a PagedCache,
    layer: usize,
}

impl<'a> LayerCache<'a> {
    /// The model's layer this is.
    pub fn index(&self) -> usize {
        self.layer
    }

    /// Tokens of `seq` stored.
    ///
    /// # Errors
    /// [`KvqError::Cache`] for an unknown sequence.
    pub fn len(&self, seq: SeqId) -> Result<usize, KvqError> {
        Ok(self.paged.len(seq, 0).map_err(|e| e.in_layer(self.layer))?)
    }

    /// Exact memory of the layer (codes, parameters, window, sinks; shared blocks once).
    pub fn memory(&self) -> CacheMemory {
        self.paged.memory()
    }

    /// What the layer holds for KV head `head` of `seq`, dequantized (`tokens × head_dim`,
    /// the reference decode: window and sinks as stored, blocks through the codec).
    ///
    /// # Errors
    /// [`KvqError::Cache`] for an unknown sequence or head.
    pub fn dequantize(
        &self,
        seq: SeqId,
        head: usize,
        part: kvq_quant_core::calibration::Part,
    ) -> Result<Vec<f32>, KvqError> {
        Ok(self.paged.dequantize(seq, 0, head, part).map_err(|e| e.in_layer(self.layer))?)
    }

    /// The single-layer paged cache underneath, for the lower-level calls (`segments`,
    /// `save`, decode attention over it): its only layer has index 0.
    pub fn paged(&self) -> &'a PagedCache {
        self.paged
    }
}

/// The version of the config format this build writes and reads.
pub const CONFIG_VERSION: u32 = 1;
/// The magic of [`QuantizedKvCache::export_sequence`]'s files.
const SEQ_MAGIC: &[u8; 8] = b"KVQSEQS\0";
/// Their version.
const SEQ_VERSION: u32 = 1;
/// The container of the per-layer heads of a split sequence.
const SPLIT_MAGIC: &[u8; 8] = b"KVQSPLIT";

/// Per-layer parts, each with its length, behind `magic`, the version and the layer count,
/// with a CRC-32 of everything.
fn container(magic: &[u8; 8], parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = magic.to_vec();
    out.extend_from_slice(&SEQ_VERSION.to_le_bytes());
    out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn offload(message: String) -> KvqError {
    KvqError::Cache(CacheError::Offload(message))
}

/// The most values one token's queries can have (`query_heads × head_dim`).
pub const MAX_QUERY_VALUES: usize = 1 << 24;
/// The largest config file [`KvCacheConfig::load`] reads (a calibration of a large model
/// inside it stays far below).
pub const MAX_CONFIG_BYTES: u64 = 1 << 30;

/// Why the high-level cache refused a call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvqError {
    /// `KVQ_FORCE_BACKEND` names a backend that is unknown or that this CPU lacks: an error
    /// rather than a silent fall back to code 50–100× slower.
    #[error(transparent)]
    Backend(#[from] kvq_kernels_simd::DispatchError),
    /// The config is invalid or could not be parsed.
    #[error("config: {0}")]
    Config(String),
    /// A layer's cache refused the call; nothing was changed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// Attention could not be computed.
    #[error(transparent)]
    Attention(#[from] AttentionError),
    /// A config file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Tokens per block of a [`KvCacheConfig::builder`] config.
pub const DEFAULT_BLOCK_SIZE: usize = 32;
/// Full-precision residual blocks of a [`KvCacheConfig::builder`] config.
pub const DEFAULT_RESIDUAL_BLOCKS: usize = 1;
/// Full-precision leading (sink) tokens of a [`KvCacheConfig::builder`] config.
pub const DEFAULT_SINK_TOKENS: usize = 4;

/// The K and V specs of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpecs {
    /// Keys.
    pub k: QuantSpec,
    /// Values.
    pub v: QuantSpec,
    /// For a `-qa` key spec, the bits of each key channel: one map per KV head
    /// ([`KvCacheConfigBuilder::channel_bits`]).
    pub k_channel_bits: Option<Vec<ChannelBits>>,
}

/// Everything a [`QuantizedKvCache`] needs. Build with [`KvCacheConfig::builder`].
#[derive(Debug, Clone, PartialEq)]
pub struct KvCacheConfig {
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub query_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Extra full-precision blocks for per-channel specs (KIVI's residual window).
    pub residual_blocks: usize,
    /// Leading tokens kept in full precision.
    pub sink_tokens: usize,
    /// Storage of the tokens kept out of the blocks (window and sinks): of the keys, and of
    /// the values unless `value_tail_dtype` is set.
    pub tail_dtype: TailDtype,
    /// Storage of the values' window and sinks when it differs
    /// ([`KvCacheConfigBuilder::value_tail_dtype`]).
    pub value_tail_dtype: Option<TailDtype>,
    /// Blocks in each layer's pool.
    pub blocks_per_layer: usize,
    /// One entry per layer.
    pub layers: Vec<LayerSpecs>,
    /// Static ranges, for per-tensor and per-head specs.
    pub calibration: Option<Calibration>,
    /// Which channels of the cached keys rotate together under RoPE, when known (the model
    /// that writes the keys sets it: GGUF Llama weights pair `(2i, 2i + 1)`, Hugging Face
    /// checkpoints `(i, i + d/2)`). Recorded for quantizers that work on RoPE pairs.
    pub rope_pairing: Option<RopePairing>,
    /// The model's RoPE (frequencies and pairing), which layers with a `-prerope` K spec need:
    /// their key blocks are quantized in the frame before RoPE, token positions being the
    /// positions in the sequence ([`KvCacheConfigBuilder::rope`]).
    pub rope: Option<Rope>,
    /// Per-token and `gN` specs (values, usually) keep the residual window too: their tokens
    /// are quantized when their block leaves it, not as they arrive
    /// ([`KvCacheConfigBuilder::row_window`]). Off by default.
    pub row_window: bool,
}

/// Builds a [`KvCacheConfig`] with sensible defaults: INT4 per-channel keys and INT4 per-token
/// values with one-byte parameters (`int4-channel-p8` / `int4-token-p8`), blocks of 32 tokens,
/// one residual block for both (as KIVI keeps), 4 sink tokens; the window and sinks in f16 for
/// keys, in 8 bits for values ([`KvCacheConfigBuilder::value_tail_dtype`]).
///
/// On SmolLM2-135M (docs/quality.md, *Botchan* in 512-token chunks) these defaults give a
/// mean KL of 1.40e-3 at 5.92 bits per value, against 7.16e-3 at 5.82 for the f16-parameter
/// pair without a window for values (`int4-channel` / `int4-token`, the default before); at
/// 2048 tokens they take 4.78 bits. `-p8` specs take no calibration: set specs of your own
/// with [`KvCacheConfigBuilder::specs`] to use one.
#[derive(Debug, Clone)]
pub struct KvCacheConfigBuilder {
    config: KvCacheConfig,
    error: Option<String>,
}

impl KvCacheConfig {
    /// A builder for `layers` layers of `kv_heads` KV heads (and `query_heads` query heads) of
    /// `head_dim` channels.
    pub fn builder(
        layers: usize,
        kv_heads: usize,
        query_heads: usize,
        head_dim: usize,
    ) -> KvCacheConfigBuilder {
        let k: QuantSpec = "int4-channel-p8".parse().expect("built-in spec");
        let v: QuantSpec = "int4-token-p8".parse().expect("built-in spec");
        KvCacheConfigBuilder {
            config: KvCacheConfig {
                kv_heads,
                query_heads,
                head_dim,
                block_size: DEFAULT_BLOCK_SIZE,
                residual_blocks: DEFAULT_RESIDUAL_BLOCKS,
                sink_tokens: DEFAULT_SINK_TOKENS,
                tail_dtype: TailDtype::F16,
                value_tail_dtype: Some(TailDtype::Int8),
                blocks_per_layer: 1024,
                layers: vec![LayerSpecs { k, v, k_channel_bits: None }; layers],
                calibration: None,
                rope_pairing: None,
                rope: None,
                row_window: false,
            },
            error: None,
        }
    }

    fn layer_config(&self, l: usize) -> CacheConfig {
        let specs = &self.layers[l];
        let mut c = CacheConfig::new(1, self.kv_heads, self.head_dim, self.blocks_per_layer)
            .with_specs(specs.k.clone(), specs.v.clone())
            .with_block_size(self.block_size)
            .with_residual_blocks(self.residual_blocks)
            .with_sink_tokens(self.sink_tokens)
            .with_tail_dtype(self.tail_dtype)
            .with_row_window(self.row_window);
        c.value_tail_dtype = self.value_tail_dtype;
        if let Some(cal) = &self.calibration {
            c = c.with_calibration(cal.layer_subset(l));
        }
        if let Some(maps) = &specs.k_channel_bits {
            c = c.with_channel_bits(maps.clone());
        }
        if let (true, Some(rope)) = (specs.k.pre_rope(), &self.rope) {
            c = c.with_rope(rope.clone());
        }
        c
    }

    /// Checks the config.
    ///
    /// # Errors
    /// [`KvqError::Config`] naming the first problem.
    pub fn validate(&self) -> Result<(), KvqError> {
        if self.layers.is_empty() {
            return Err(KvqError::Config("no layers".into()));
        }
        if self.kv_heads == 0 || self.query_heads == 0 || !self.query_heads.is_multiple_of(self.kv_heads) {
            return Err(KvqError::Config(format!(
                "{} query heads cannot share {} KV heads evenly",
                self.query_heads, self.kv_heads
            )));
        }
        if self.query_heads.checked_mul(self.head_dim).is_none_or(|n| n > MAX_QUERY_VALUES) {
            return Err(KvqError::Config(format!(
                "query_heads {} × head_dim {} is over the limit of {MAX_QUERY_VALUES} values per query",
                self.query_heads, self.head_dim
            )));
        }
        if let Some(cal) = &self.calibration
            && cal.layers() != self.layers.len()
        {
            return Err(KvqError::Config(format!(
                "calibration covers {} layers, the config {}",
                cal.layers(),
                self.layers.len()
            )));
        }
        if let (Some(rope), Some(p)) = (&self.rope, self.rope_pairing)
            && rope.pairing() != p
        {
            return Err(KvqError::Config(format!(
                "the RoPE pairs channels {}, rope_pairing says {}",
                rope.pairing().name(),
                p.name()
            )));
        }
        for l in 0..self.layers.len() {
            self.layer_config(l).validate().map_err(|e| KvqError::Config(format!("layer {l}: {e}")))?;
        }
        Ok(())
    }

    /// Average bits per cached value over K and V of all layers (codes and per-block
    /// parameters; tails, sinks and tables excluded), for a full block.
    pub fn bits_per_value(&self) -> f64 {
        let total: f64 = (0..self.layers.len())
            .map(|l| {
                let c = PagedCache::new(CacheConfig { capacity_blocks: 0, ..self.layer_config(l) });
                c.map_or(f64::NAN, |c| {
                    let block = c.part(kvq_quant_core::calibration::Part::K).bytes()
                        + c.part(kvq_quant_core::calibration::Part::V).bytes();
                    block as f64 * 8.0 / (2 * self.block_size * self.head_dim) as f64
                })
            })
            .sum();
        total / self.layers.len() as f64
    }

    /// Pool blocks that one sequence of `tokens` tokens holds in each layer (one per KV head
    /// and block of quantized tokens): what to size `blocks_per_layer` by. Tokens that wait in
    /// the full-precision window of every part (the sinks, the residual window and the block
    /// being filled, with the builder's default specs) hold none, so this is below
    /// `tokens / block_size · kv_heads` by the window's blocks (2 per head at 4096 tokens
    /// below).
    ///
    /// ```
    /// use kvq::prelude::*;
    ///
    /// // 8 KV heads, blocks of 32, one residual block and 4 sinks (the default).
    /// let config = KvCacheConfig::builder(2, 8, 32, 128).build()?;
    /// // 4096 tokens: 4092 after the sinks, of which the last 60 wait in the window.
    /// assert_eq!(config.blocks_for_tokens(4096)?, [8 * 126, 8 * 126]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`KvqError::Config`] for a config that [`KvCacheConfig::validate`] refuses.
    pub fn blocks_for_tokens(&self, tokens: usize) -> Result<Vec<usize>, KvqError> {
        self.validate()?;
        (0..self.layers.len())
            .map(|l| {
                // A pool without blocks: a sequence needs none to be created, and
                // `blocks_needed` counts what its appends would take.
                let mut c = PagedCache::new(CacheConfig { capacity_blocks: 0, ..self.layer_config(l) })?;
                let seq = c.create();
                Ok(c.blocks_needed(seq, 0, tokens)?)
            })
            .collect()
    }

    /// Parses and validates a TOML config.
    ///
    /// # Errors
    /// [`KvqError::Config`].
    pub fn from_toml(text: &str) -> Result<Self, KvqError> {
        let wire: Wire = toml::from_str(text).map_err(|e| KvqError::Config(e.to_string()))?;
        Self::try_from(wire)
    }

    /// Parses and validates a JSON config.
    ///
    /// # Errors
    /// [`KvqError::Config`].
    pub fn from_json(text: &str) -> Result<Self, KvqError> {
        let wire: Wire = serde_json::from_str(text).map_err(|e| KvqError::Config(e.to_string()))?;
        Self::try_from(wire)
    }

    /// The config as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&Wire::from(self)).expect("a config always serializes")
    }

    /// The config as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(&Wire::from(self)).expect("a config always serializes")
    }

    /// The config as [`KvCacheConfig::save`] writes it to `path`: JSON for a `.json` name, TOML
    /// otherwise.
    pub fn to_text_for(&self, path: &Path) -> String {
        if path.extension().is_some_and(|e| e == "json") { self.to_json() } else { self.to_toml() }
    }

    /// Writes the config to `path`, as JSON for a `.json` name and TOML otherwise, atomically
    /// (a temporary file in the same directory, flushed, then renamed over `path`).
    ///
    /// # Errors
    /// [`KvqError::Io`]; `path` is unchanged then.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), KvqError> {
        let path = path.as_ref();
        kvq_quant_core::io::write_atomic(path, self.to_text_for(path).as_bytes())
            .map_err(|source| KvqError::Io { path: path.display().to_string(), source })
    }

    /// Loads a config file, TOML or JSON by its extension (`.json` is JSON, anything else TOML).
    /// Only a regular file of at most [`MAX_CONFIG_BYTES`] is read.
    ///
    /// # Errors
    /// [`KvqError::Io`], [`KvqError::Config`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self, KvqError> {
        let path = path.as_ref();
        let io = |source| KvqError::Io { path: path.display().to_string(), source };
        let bytes = kvq_quant_core::io::read_regular_file(path, MAX_CONFIG_BYTES).map_err(io)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| io(std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text")))?;
        let parsed = if path.extension().is_some_and(|e| e == "json") {
            Self::from_json(&text)
        } else {
            Self::from_toml(&text)
        };
        parsed.map_err(|e| KvqError::Config(format!("{}: {e}", path.display())))
    }
}

impl KvCacheConfigBuilder {
    /// The same specs for every layer.
    pub fn specs(mut self, k: QuantSpec, v: QuantSpec) -> Self {
        for l in &mut self.config.layers {
            *l = LayerSpecs { k: k.clone(), v: v.clone(), k_channel_bits: None };
        }
        self
    }

    /// The specs of one layer (a layer out of range is reported by [`Self::build`]).
    pub fn layer_specs(mut self, layer: usize, k: QuantSpec, v: QuantSpec) -> Self {
        let n = self.config.layers.len();
        match self.config.layers.get_mut(layer) {
            Some(l) => *l = LayerSpecs { k, v, k_channel_bits: None },
            None => self.error = Some(format!("layer_specs for layer {layer} of {n}")),
        }
        self
    }

    /// Tokens per block (32 by default): decode's unit of work. Per-channel key groups
    /// (`channel`) span a block unless the spec names a token group that divides it:
    /// `int4-channel32` in blocks of 128 keeps KIVI's 32-token groups (four sets of channel
    /// parameters a block, the same codes as blocks of 32) while decode pays a block's fixed
    /// work once per 128 tokens (13% faster at 4k, 15% at 32k on an Intel Xeon; see
    /// docs/performance.md), at the price of a full-precision tail of up to a block more.
    pub fn block_size(mut self, n: usize) -> Self {
        self.config.block_size = n;
        self
    }

    /// Extra full-precision blocks.
    pub fn residual_blocks(mut self, n: usize) -> Self {
        self.config.residual_blocks = n;
        self
    }

    /// Whether per-token and `gN` specs keep the residual window too
    /// ([`KvCacheConfig::row_window`]): as KIVI does for values, the latest tokens stay exact
    /// until their block leaves the window. On the real model this lowered the mean KL of an
    /// INT4 cache by 74% for 0.23 more bits at 2048 tokens (`docs/quality.md`).
    pub fn row_window(mut self, on: bool) -> Self {
        self.config.row_window = on;
        self
    }

    /// The bits of each key channel of `layer`, one map per KV head, for its `-qa` key spec
    /// (fit them with [`ChannelBits::fit`] on calibration keys and queries; a layer out of
    /// range is reported by [`Self::build`], maps that do not fit the spec by its
    /// validation).
    pub fn channel_bits(mut self, layer: usize, maps: Vec<ChannelBits>) -> Self {
        let n = self.config.layers.len();
        match self.config.layers.get_mut(layer) {
            Some(l) => l.k_channel_bits = Some(maps),
            None => self.error = Some(format!("channel_bits for layer {layer} of {n}")),
        }
        self
    }

    /// Leading full-precision tokens.
    pub fn sink_tokens(mut self, n: usize) -> Self {
        self.config.sink_tokens = n;
        self
    }

    /// Storage of the window and sinks of keys and values alike (replacing the default's 8-bit
    /// values; set theirs after this with [`KvCacheConfigBuilder::value_tail_dtype`]).
    pub fn tail_dtype(mut self, t: TailDtype) -> Self {
        self.config.tail_dtype = t;
        self.config.value_tail_dtype = None;
        self
    }

    /// Storage of the values' window and sinks alone (the default: `TailDtype::Int8`). 8 bits
    /// halve their bytes at head_dim 64 with no error measurable on the shared capture for
    /// rotated values (`int4-channel-p8/int3-token-mse-rot-p8`: 0.12 fewer bits at 2048 tokens
    /// for the same attention error) and little for others, where 8-bit keys raise the
    /// attention KL by up to a quarter (docs/formats.md).
    pub fn value_tail_dtype(mut self, t: TailDtype) -> Self {
        self.config.value_tail_dtype = Some(t);
        self
    }

    /// Both storages at once: the keys' (and the values' unless `v` gives their own), the
    /// pair [`parse_tail_dtypes`] reads from the command line.
    pub fn tail_dtypes(mut self, k: TailDtype, v: Option<TailDtype>) -> Self {
        self.config.tail_dtype = k;
        self.config.value_tail_dtype = v;
        self
    }

    /// Blocks in each layer's pool.
    pub fn blocks_per_layer(mut self, n: usize) -> Self {
        self.config.blocks_per_layer = n;
        self
    }

    /// Static ranges.
    pub fn calibration(mut self, c: Calibration) -> Self {
        self.config.calibration = Some(c);
        self
    }

    /// The RoPE channel pairing of the keys that will be cached.
    pub fn rope_pairing(mut self, p: RopePairing) -> Self {
        self.config.rope_pairing = Some(p);
        self
    }

    /// The model's RoPE, for layers whose K spec is quantized before it (`-prerope`); sets the
    /// pairing too.
    pub fn rope(mut self, rope: Rope) -> Self {
        self.config.rope_pairing = Some(rope.pairing());
        self.config.rope = Some(rope);
        self
    }

    /// Validates and returns the config.
    ///
    /// # Errors
    /// [`KvqError::Config`].
    pub fn build(self) -> Result<KvCacheConfig, KvqError> {
        if let Some(e) = self.error {
            return Err(KvqError::Config(e));
        }
        self.config.validate()?;
        Ok(self.config)
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WireLayer {
    k: String,
    v: String,
    /// Widths of the key channels, one list per KV head (`-qa` key specs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    k_channel_bits: Option<Vec<Vec<u8>>>,
    /// The levels of a fixed-codebook key spec (`codebookB-...`, whose text names none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    k_levels: Option<Vec<f32>>,
    /// The same for the value spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    v_levels: Option<Vec<f32>>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    version: u32,
    kv_heads: usize,
    query_heads: usize,
    head_dim: usize,
    block_size: usize,
    residual_blocks: usize,
    sink_tokens: usize,
    tail_dtype: TailDtype,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value_tail_dtype: Option<TailDtype>,
    blocks_per_layer: usize,
    layers: Vec<WireLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    calibration: Option<Calibration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_pairing: Option<RopePairing>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope: Option<Rope>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    row_window: bool,
}

impl From<&KvCacheConfig> for Wire {
    fn from(c: &KvCacheConfig) -> Self {
        Wire {
            version: CONFIG_VERSION,
            kv_heads: c.kv_heads,
            query_heads: c.query_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            residual_blocks: c.residual_blocks,
            sink_tokens: c.sink_tokens,
            tail_dtype: c.tail_dtype,
            value_tail_dtype: c.value_tail_dtype,
            blocks_per_layer: c.blocks_per_layer,
            layers: c
                .layers
                .iter()
                .map(|l| WireLayer {
                    k: l.k.to_string(),
                    v: l.v.to_string(),
                    k_channel_bits: l
                        .k_channel_bits
                        .as_ref()
                        .map(|m| m.iter().map(|b| b.widths().to_vec()).collect()),
                    k_levels: l.k.fixed_levels().map(<[f32]>::to_vec),
                    v_levels: l.v.fixed_levels().map(<[f32]>::to_vec),
                })
                .collect(),
            calibration: c.calibration.clone(),
            rope_pairing: c.rope_pairing,
            rope: c.rope.clone(),
            row_window: c.row_window,
        }
    }
}

impl TryFrom<Wire> for KvCacheConfig {
    type Error = KvqError;

    fn try_from(w: Wire) -> Result<Self, KvqError> {
        if w.version != CONFIG_VERSION {
            return Err(KvqError::Config(format!(
                "config version {} (this build reads {CONFIG_VERSION})",
                w.version
            )));
        }
        let spec = |s: &str, levels: &Option<Vec<f32>>| {
            QuantSpec::parse_with_levels(s, levels.clone()).map_err(|e| KvqError::Config(e.to_string()))
        };
        let layers = w
            .layers
            .iter()
            .map(|l| {
                let k_channel_bits = l
                    .k_channel_bits
                    .as_ref()
                    .map(|maps| {
                        maps.iter().map(|w| ChannelBits::new(w.clone())).collect::<Result<Vec<_>, _>>()
                    })
                    .transpose()
                    .map_err(|e| KvqError::Config(format!("channel bit map: {e}")))?;
                Ok(LayerSpecs { k: spec(&l.k, &l.k_levels)?, v: spec(&l.v, &l.v_levels)?, k_channel_bits })
            })
            .collect::<Result<_, KvqError>>()?;
        let c = KvCacheConfig {
            kv_heads: w.kv_heads,
            query_heads: w.query_heads,
            head_dim: w.head_dim,
            block_size: w.block_size,
            residual_blocks: w.residual_blocks,
            sink_tokens: w.sink_tokens,
            tail_dtype: w.tail_dtype,
            value_tail_dtype: w.value_tail_dtype,
            blocks_per_layer: w.blocks_per_layer,
            layers,
            calibration: w.calibration,
            rope_pairing: w.rope_pairing,
            rope: w.rope,
            row_window: w.row_window,
        };
        c.validate()?;
        Ok(c)
    }
}

/// Reads the command-line form of the window's storage: `DTYPE` for keys and values, or
/// `KDTYPE/VDTYPE` (`f16/int8`: keys in f16, values in 8 bits); each of `f16`, `f32`,
/// `int8`. Returns the keys' (and values' unless they differ: `None`) storage.
///
/// # Errors
/// [`KvqError::Config`] for another name.
pub fn parse_tail_dtypes(s: &str) -> Result<(TailDtype, Option<TailDtype>), KvqError> {
    let one = |t: &str| t.parse::<TailDtype>().map_err(|e| KvqError::Config(e.to_string()));
    match s.split_once('/') {
        None => Ok((one(s)?, None)),
        Some((k, v)) => {
            let (k, v) = (one(k)?, one(v)?);
            Ok((k, (v != k).then_some(v)))
        }
    }
}

/// The command-line form of the window's storage ([`parse_tail_dtypes`] reads it back):
/// `f16`, or `f16/int8` when the values' differs.
pub fn tail_dtypes_text(k: TailDtype, v: Option<TailDtype>) -> String {
    match v {
        Some(v) if v != k => format!("{}/{}", k.name(), v.name()),
        _ => k.name().to_string(),
    }
}

/// A model's quantized KV cache: one [`PagedCache`] per layer, sequences shared across them.
#[derive(Debug, Clone)]
pub struct QuantizedKvCache {
    config: KvCacheConfig,
    layers: Vec<PagedCache>,
}

impl QuantizedKvCache {
    /// Allocates every layer's pool.
    ///
    /// # Errors
    /// [`KvqError::Config`]; [`KvqError::Cache`] with [`CacheError::Alloc`] when a pool's
    /// memory cannot be had; [`KvqError::Backend`] for a bad `KVQ_FORCE_BACKEND`.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvqError> {
        config.validate()?;
        // The fastest row quantizer for this CPU (the same codes as the portable one).
        let rows = kvq_kernels_simd::row_kernels()?;
        let layers = (0..config.layers.len())
            .map(|l| {
                let cache =
                    PagedCache::new(config.layer_config(l).with_row_kernels(rows)).map_err(|e| match e {
                        CacheError::Config(m) => KvqError::Config(format!("layer {l}: {m}")),
                        other => KvqError::Cache(other),
                    })?;
                // Before any block is written, so that the pool is backed by 2 MiB pages from
                // the start where the system allows it (decode reads blocks scattered over it).
                kvq_kernels_simd::advise_huge_pages(cache.pool().arena());
                Ok(cache)
            })
            .collect::<Result<_, KvqError>>()?;
        Ok(Self { config, layers })
    }

    /// The config.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The cache of one layer of the model, `None` past the last.
    pub fn layer(&self, layer: usize) -> Option<LayerCache<'_>> {
        self.layers.get(layer).map(|paged| LayerCache { paged, layer })
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut PagedCache, KvqError> {
        let n = self.layers.len();
        self.layers.get_mut(layer).ok_or(KvqError::Cache(CacheError::Layer { layer, layers: n }))
    }

    /// Starts a sequence in every layer.
    pub fn create(&mut self) -> SeqId {
        let ids: Vec<SeqId> = self.layers.iter_mut().map(PagedCache::create).collect();
        debug_assert!(ids.windows(2).all(|w| w[0] == w[1]), "layers out of step");
        ids[0]
    }

    /// Appends one token's keys and values (`kv_heads × head_dim` each, f32, f16 or bf16) to
    /// `layer`.
    ///
    /// # Errors
    /// [`KvqError::Cache`]; nothing changes on error.
    pub fn append<T: Element>(&mut self, seq: SeqId, layer: usize, k: &[T], v: &[T]) -> Result<(), KvqError> {
        let (k, v) = (T::widen(k), T::widen(v));
        Ok(self.layer_mut(layer)?.append(seq, 0, &k, &v).map_err(|e| e.in_layer(layer))?)
    }

    /// Appends one token to every layer: `k` and `v` hold `layers × kv_heads × head_dim`
    /// values (layer-major). Every layer is checked (shape, values, free blocks) before any is
    /// written, so the call appends to all layers or to none.
    ///
    /// # Errors
    /// [`KvqError::Cache`] naming the first layer's problem; nothing changes on error.
    pub fn append_all_layers<T: Element>(&mut self, seq: SeqId, k: &[T], v: &[T]) -> Result<(), KvqError> {
        let per_layer = self.config.kv_heads * self.config.head_dim;
        let n = self.layers.len() * per_layer;
        if k.len() != n || v.len() != n {
            return Err(KvqError::Cache(CacheError::Shape {
                expected: format!("{n} values for K and V (layers × kv_heads × head_dim)"),
                got: format!("{} and {}", k.len(), v.len()),
            }));
        }
        let (k, v) = (T::widen(k), T::widen(v));
        let layer = |l: usize| l * per_layer..(l + 1) * per_layer;
        for (l, c) in self.layers.iter().enumerate() {
            c.check_append(seq, 0, &k[layer(l)], &v[layer(l)]).map_err(|e| e.in_layer(l))?;
        }
        for (l, c) in self.layers.iter_mut().enumerate() {
            c.append(seq, 0, &k[layer(l)], &v[layer(l)]).map_err(|e| e.in_layer(l))?;
        }
        Ok(())
    }

    /// Blocks that appending `tokens` tokens of `seq` would take from each layer's pool (new
    /// blocks plus copies of shared blocks written), in layer order: what a scheduler compares
    /// with each pool's free blocks before it admits work.
    ///
    /// # Errors
    /// [`KvqError::Cache`] for an unknown sequence.
    pub fn blocks_needed(&self, seq: SeqId, tokens: usize) -> Result<Vec<usize>, KvqError> {
        self.layers.iter().map(|c| c.blocks_needed(seq, 0, tokens).map_err(KvqError::from)).collect()
    }

    /// Free blocks of each layer's pool, in layer order (reserved ones included).
    pub fn free_blocks(&self) -> Vec<usize> {
        self.layers.iter().map(|c| c.pool().free_blocks()).collect()
    }

    /// Free blocks of each layer's pool that no reservation holds, in layer order: what new
    /// work can take.
    pub fn unreserved_blocks(&self) -> Vec<usize> {
        self.layers.iter().map(PagedCache::unreserved_blocks).collect()
    }

    /// Holds, in every layer, the blocks that the next `tokens` tokens of `seq` need (new
    /// blocks and the copies of shared blocks they write), so that appending them cannot fail
    /// for lack of blocks whatever other sequences do meanwhile: a scheduler reserves what
    /// it admits. Replaces `seq`'s reservation; `tokens = 0` releases it. Appends of `seq` use
    /// it up token by token; [`QuantizedKvCache::free`] returns what is left. A fork of `seq`
    /// reserves the copies its appends will then make, a truncation what the remaining tokens
    /// need from the new length; either fails rather than break the promise.
    ///
    /// ```
    /// use kvq::prelude::*;
    ///
    /// // 2 layers, 1 KV head, 1 query head, head_dim 32; 4 blocks of 32 tokens per layer.
    /// let config = KvCacheConfig::builder(2, 1, 1, 32).blocks_per_layer(4).sink_tokens(0).build()?;
    /// let mut cache = QuantizedKvCache::new(config)?;
    /// let (a, b) = (cache.create(), cache.create());
    /// // The default window (the last 32 to 63 tokens, in full precision) holds no block:
    /// // 96 tokens quantize two blocks, at the 64th token and at the 96th.
    /// cache.reserve(a, 96)?;
    /// assert_eq!(cache.unreserved_blocks(), [2, 2]);
    /// let kv = vec![0.5f32; 2 * 32];
    /// while cache.append_all_layers(b, &kv, &kv).is_ok() {}
    /// assert_eq!(cache.len(b, 0)?, 127); // the 128th token would need a third block
    /// for _ in 0..96 {
    ///     cache.append_all_layers(a, &kv, &kv)?; // cannot fail: held for a
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`KvqError::Cache`]: an unknown sequence, or [`CacheError::PoolExhausted`] naming the
    /// first layer whose unreserved blocks are too few; nothing changes on error.
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvqError> {
        for c in &self.layers {
            c.check_reserve(seq, 0, tokens)?;
        }
        for c in &mut self.layers {
            c.reserve(seq, 0, tokens)?;
        }
        Ok(())
    }

    /// Tokens of `seq` still covered by its reservation (the same in every layer when the
    /// model appends to every layer).
    ///
    /// # Errors
    /// [`KvqError::Cache`] for an unknown sequence.
    pub fn reserved_tokens(&self, seq: SeqId) -> Result<usize, KvqError> {
        let mut tokens = 0;
        for c in &self.layers {
            tokens = tokens.max(c.reservation(seq, 0)?.tokens);
        }
        Ok(tokens)
    }

    /// One sequence of every layer, with the contents of its blocks, as bytes (to offload it
    /// while others keep decoding): a container of each layer's one-sequence offload file,
    /// with a checksum. The sequence stays in the cache; free it to reclaim its blocks.
    ///
    /// # Errors
    /// [`KvqError::Cache`]: an unknown sequence.
    pub fn export_sequence(&self, seq: SeqId) -> Result<Vec<u8>, KvqError> {
        let parts = self.layers.iter().map(|c| c.export_sequence(seq)).collect::<Result<Vec<_>, _>>()?;
        Ok(container(SEQ_MAGIC, &parts))
    }

    /// Brings back a sequence written by [`QuantizedKvCache::export_sequence`] as a new
    /// sequence of every layer. Every layer's part is checked (format, config, values, free
    /// blocks) before any layer changes.
    ///
    /// # Errors
    /// [`KvqError::Cache`] with [`CacheError::Offload`] for a bad file or one written by a
    /// cache of another config, [`CacheError::PoolExhausted`]; nothing changes on error.
    pub fn import_sequence(&mut self, bytes: &[u8]) -> Result<SeqId, KvqError> {
        let parts = self.open_container(SEQ_MAGIC, bytes)?;
        self.import_layers(|c, l| c.check_import(parts[l]), |c, l| c.import_sequence(parts[l]))
    }

    /// Bytes of one block of tokens of [`QuantizedKvCache::export_split`]: every layer's.
    pub fn split_block_bytes(&self) -> usize {
        self.layers.iter().map(PagedCache::split_block_bytes).sum()
    }

    /// The blocks of tokens of `seq` that no later token changes, in every layer.
    ///
    /// # Errors
    /// [`KvqError::Cache`]: an unknown sequence.
    pub fn final_blocks(&self, seq: SeqId) -> Result<usize, KvqError> {
        let mut n = usize::MAX;
        for c in &self.layers {
            n = n.min(c.final_blocks(seq)?);
        }
        Ok(if self.layers.is_empty() { 0 } else { n })
    }

    /// `seq` split for a block store shared by prefix ([`PagedCache::export_split`] in every
    /// layer): its first `blocks` blocks of tokens (at most [`QuantizedKvCache::final_blocks`]),
    /// each [`QuantizedKvCache::split_block_bytes`] bytes of every layer's quantized rows
    /// exactly as the cache holds them, and a checksummed head with the rest. Sequences with the
    /// same tokens (and the same model and config) have the same blocks of tokens; the head
    /// belongs to one length.
    ///
    /// # Errors
    /// [`KvqError::Cache`]: an unknown sequence, a spec without a text form, too many blocks.
    pub fn export_split(&self, seq: SeqId, blocks: usize) -> Result<(Vec<u8>, Vec<Vec<u8>>), KvqError> {
        let mut heads = Vec::with_capacity(self.layers.len());
        let mut out = vec![Vec::with_capacity(self.split_block_bytes()); blocks];
        for (l, c) in self.layers.iter().enumerate() {
            let (head, parts) = c.export_split(seq, blocks).map_err(|e| e.in_layer(l))?;
            heads.push(head);
            for (o, p) in out.iter_mut().zip(parts) {
                o.extend_from_slice(&p);
            }
        }
        Ok((container(SPLIT_MAGIC, &heads), out))
    }

    /// A new sequence from a head and blocks of tokens of [`QuantizedKvCache::export_split`],
    /// possibly written by another process. Every layer's part is checked before any layer
    /// changes.
    ///
    /// # Errors
    /// [`KvqError::Cache`] with [`CacheError::Offload`] for bad bytes, pieces that do not go
    /// together, another config; [`CacheError::PoolExhausted`]; nothing changes on error.
    pub fn import_split(&mut self, head: &[u8], blocks: &[&[u8]]) -> Result<SeqId, KvqError> {
        let heads = self.open_container(SPLIT_MAGIC, head)?;
        let total = self.split_block_bytes();
        if let Some(b) = blocks.iter().find(|b| b.len() != total) {
            return Err(offload(format!("a block of tokens of {} bytes, expected {total}", b.len())));
        }
        // Each layer's slice of every block of tokens.
        let mut per_layer: Vec<Vec<&[u8]>> = vec![Vec::with_capacity(blocks.len()); self.layers.len()];
        let mut at = 0;
        for (c, slices) in self.layers.iter().zip(&mut per_layer) {
            let n = c.split_block_bytes();
            slices.extend(blocks.iter().map(|b| &b[at..at + n]));
            at += n;
        }
        self.import_layers(
            |c, l| c.check_import_split(heads[l], &per_layer[l]),
            |c, l| c.import_split(heads[l], &per_layer[l]),
        )
    }

    /// Checks every layer's import (`check(layer's cache, l)`), then imports into every layer.
    fn import_layers(
        &mut self,
        check: impl Fn(&PagedCache, usize) -> Result<(), CacheError>,
        import: impl Fn(&mut PagedCache, usize) -> Result<SeqId, CacheError>,
    ) -> Result<SeqId, KvqError> {
        for (l, c) in self.layers.iter().enumerate() {
            check(c, l).map_err(|e| match e {
                CacheError::Offload(m) => offload(format!("layer {l}: {m}")),
                other => KvqError::Cache(other),
            })?;
        }
        let ids =
            self.layers.iter_mut().enumerate().map(|(l, c)| import(c, l)).collect::<Result<Vec<_>, _>>()?;
        debug_assert!(ids.windows(2).all(|w| w[0] == w[1]), "layers out of step");
        ids.first().copied().ok_or_else(|| offload("a cache of no layers".into()))
    }

    /// The per-layer parts of a container written by [`container`], checked against this
    /// cache's layer count.
    fn open_container<'a>(&self, magic: &[u8; 8], bytes: &'a [u8]) -> Result<Vec<&'a [u8]>, KvqError> {
        let head = magic.len() + 8;
        if bytes.len() < head + 4 || bytes[..magic.len()] != magic[..] {
            return Err(offload("not a kvq sequence file of this kind (bad magic or truncated)".into()));
        }
        let (content, crc) = bytes.split_at(bytes.len() - 4);
        if crc32fast::hash(content) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(offload("checksum mismatch: the file is corrupt or truncated".into()));
        }
        let word = |at: usize| u32::from_le_bytes(content[at..at + 4].try_into().expect("4 bytes"));
        let (version, layers) = (word(magic.len()), word(magic.len() + 4) as usize);
        if version != SEQ_VERSION {
            return Err(offload(format!("sequence file version {version} (this build reads {SEQ_VERSION})")));
        }
        if layers != self.layers.len() {
            return Err(offload(format!("the file has {layers} layers, the cache {}", self.layers.len())));
        }
        let mut parts = Vec::with_capacity(layers);
        let mut at = head;
        for l in 0..layers {
            let len = content
                .get(at..at + 8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n <= content.len() - at - 8)
                .ok_or_else(|| offload(format!("layer {l}: truncated")))?;
            parts.push(&content[at + 8..at + 8 + len]);
            at += 8 + len;
        }
        if at != content.len() {
            return Err(offload("trailing bytes after the last layer".into()));
        }
        Ok(parts)
    }

    /// Appends many tokens (`[kv_heads, tokens, head_dim]` tensors) to `layer`.
    ///
    /// # Errors
    /// [`KvqError::Cache`]; nothing changes on error.
    pub fn extend(&mut self, seq: SeqId, layer: usize, k: &Tensor, v: &Tensor) -> Result<(), KvqError> {
        Ok(self.layer_mut(layer)?.extend(seq, 0, k, v).map_err(|e| e.in_layer(layer))?)
    }

    /// Checks that `tokens` more tokens of `seq` fit in every layer's pool now (its reservations
    /// and the unreserved free blocks), without changing anything. Other sequences may take
    /// the blocks before they are appended: [`QuantizedKvCache::reserve`] holds them.
    ///
    /// # Errors
    /// [`KvqError::Cache`]: [`CacheError::PoolExhausted`] naming the first layer's shortfall,
    /// or an unknown sequence.
    pub fn check_capacity(&self, seq: SeqId, tokens: usize) -> Result<(), KvqError> {
        for c in &self.layers {
            let needed = c.blocks_needed(seq, 0, tokens)?;
            let free = c.available_blocks(seq, 0)?;
            if needed > free {
                return Err(KvqError::Cache(CacheError::PoolExhausted { needed, free }));
            }
        }
        Ok(())
    }

    /// A copy-on-write fork of `seq` in every layer. The fork has no reservation; one of `seq`
    /// grows by the copies its appends will now make.
    ///
    /// # Errors
    /// [`KvqError::Cache`] for an unknown sequence, or [`CacheError::PoolExhausted`] when `seq`
    /// holds a reservation and those copies do not fit; nothing changes on error.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, KvqError> {
        self.layers[0].len(seq, 0)?;
        for c in &self.layers {
            c.check_fork(seq)?;
        }
        let ids = self.layers.iter_mut().map(|c| c.fork(seq)).collect::<Result<Vec<_>, _>>()?;
        Ok(ids[0])
    }

    /// Shortens `seq` to `len` tokens in every layer; all layers are checked first.
    ///
    /// # Errors
    /// [`KvqError::Cache`]; nothing changes on error.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), KvqError> {
        for (l, c) in self.layers.iter().enumerate() {
            c.check_truncate(seq, len).map_err(|e| e.in_layer(l))?;
        }
        for (l, c) in self.layers.iter_mut().enumerate() {
            c.truncate(seq, len).map_err(|e| e.in_layer(l))?;
        }
        Ok(())
    }

    /// Ends `seq` in every layer.
    ///
    /// # Errors
    /// [`KvqError::Cache`] for an unknown sequence.
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvqError> {
        self.layers[0].len(seq, 0)?;
        for c in &mut self.layers {
            c.free(seq)?;
        }
        Ok(())
    }

    /// Tokens of `seq` stored in `layer`.
    ///
    /// # Errors
    /// [`KvqError::Cache`].
    pub fn len(&self, seq: SeqId, layer: usize) -> Result<usize, KvqError> {
        let n = self.layers.len();
        Ok(self.layers.get(layer).ok_or(CacheError::Layer { layer, layers: n })?.len(seq, 0)?)
    }

    /// Attention of the newest tokens of `seq` in `layer` (appended already), into `out`:
    /// one decode token by default, the last [`AttentionOptions::chunk`] tokens of a prefill
    /// chunk or of a speculative decoder's verification, each attending causally up to
    /// itself. `q` and `out` are `tokens × query_heads × head_dim`, token-major. The options
    /// choose the arithmetic ([`ScorePath::Int8`](crate::attention::ScorePath::Int8) takes the
    /// integer kernels where the CPU has them, faster within the error bounds
    /// [`ScorePath`](crate::attention::ScorePath) states), scale, sliding window and
    /// logit soft-capping, for the model families that need them. The buffers of a decode
    /// step are kept per thread: after a thread's first step, steps no larger allocate
    /// nothing (for many sequences at once, see [`QuantizedKvCache::attention_batch`]).
    ///
    /// ```
    /// use kvq::prelude::*;
    ///
    /// let config = KvCacheConfig::builder(1, 2, 4, 64).build()?;
    /// let mut cache = QuantizedKvCache::new(config)?;
    /// let seq = cache.create();
    /// let kv = vec![0.25f32; 2 * 64];
    /// cache.append(seq, 0, &kv, &kv)?;
    /// let q = vec![0.5f32; 4 * 64];
    /// let mut out = vec![0f32; q.len()];
    /// cache.attention(&AttentionOptions::default(), seq, 0, &q, &mut out)?;
    /// cache.attention(&AttentionOptions::with_path(ScorePath::Int8), seq, 0, &q, &mut out)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`KvqError::Attention`] (shapes, an option out of range, a chunk of 0 tokens or of more
    /// than are cached), [`KvqError::Cache`] (an unknown sequence or layer),
    /// [`KvqError::Backend`].
    pub fn attention<T: Element>(
        &self,
        options: &AttentionOptions,
        seq: SeqId,
        layer: usize,
        q: &[T],
        out: &mut [T],
    ) -> Result<(), KvqError> {
        let n = self.layers.len();
        let cache = self.layers.get(layer).ok_or(CacheError::Layer { layer, layers: n })?;
        Ok(decode_attention(options, cache, seq, 0, q, self.config.query_heads, out)?)
    }

    /// Decode attention of a whole batch of sequences over `layer` in one call (continuous
    /// batching): `batch[i]` brings `tokens` query rows (1 to decode, more for a prefill
    /// chunk or speculative verification, each attending causally up to itself), stacked in
    /// batch order in `q` and `out`, each row `query_heads × head_dim`. Parallel over
    /// (sequence, KV head) with rayon, and along long contexts when those are fewer than the
    /// threads. Keep one [`DecodeWorkspace`] per decoding thread across steps and layers:
    /// after the first step, steps no larger allocate nothing.
    ///
    /// ```
    /// use kvq::prelude::*;
    ///
    /// // 2 layers, 2 KV heads, 4 query heads, head_dim 64.
    /// let spec: QuantSpec = "int4-token".parse()?;
    /// let config = KvCacheConfig::builder(2, 2, 4, 64).specs(spec.clone(), spec).build()?;
    /// let mut cache = QuantizedKvCache::new(config)?;
    /// let (a, b) = (cache.create(), cache.create());
    /// for (seq, tokens) in [(a, 40), (b, 3)] {
    ///     for t in 0..tokens {
    ///         let kv: Vec<f32> = (0..2 * 64).map(|i| ((i + t) as f32 * 0.1).sin()).collect();
    ///         cache.append_all_layers(seq, &kv.repeat(2), &kv.repeat(2))?;
    ///     }
    /// }
    /// let batch = [BatchSeq::decode(a), BatchSeq::decode(b)];
    /// let q = vec![0.5f32; 2 * 4 * 64];
    /// let mut out = vec![0f32; q.len()];
    /// let mut ws = DecodeWorkspace::new();
    /// for layer in 0..2 {
    ///     cache.attention_batch(&AttentionOptions::default(), layer, &batch, &q, &mut out, &mut ws)?;
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`KvqError::Attention`] (shapes, options, a sequence's token count), [`KvqError::Cache`]
    /// (an unknown sequence or layer), [`KvqError::Backend`]. `out` is left as it was.
    pub fn attention_batch<T: Element>(
        &self,
        options: &AttentionOptions,
        layer: usize,
        batch: &[BatchSeq],
        q: &[T],
        out: &mut [T],
        ws: &mut DecodeWorkspace,
    ) -> Result<(), KvqError> {
        let n = self.layers.len();
        let cache = self.layers.get(layer).ok_or(CacheError::Layer { layer, layers: n })?;
        let qh = self.config.query_heads;
        Ok(decode_attention_batch(options, cache, 0, batch, q, qh, out, ws)?)
    }

    /// Exact memory of every layer.
    pub fn memory(&self) -> Vec<CacheMemory> {
        self.layers.iter().map(PagedCache::memory).collect()
    }

    /// Bytes in use over all layers.
    pub fn used_bytes(&self) -> usize {
        self.layers.iter().map(|c| c.memory().used_bytes()).sum()
    }
}
