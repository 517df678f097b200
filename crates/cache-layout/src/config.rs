//! What a cache holds and how: model shape, K and V specs, block size, residual window,
//! attention sinks, tail precision, capacity and calibration.

use kvq_quant_core::{
    Calibration, ChannelBits, CodebookSource, Granularity, Kind, QuantSpec, Rope, RowKernels,
};

use crate::error::{CacheError, Result};
/// The storage of the tails a config names; the type lives with the tails, in `part_layout`.
pub use crate::part_layout::TailDtype;

/// The most layers a cache can have.
pub const MAX_LAYERS: usize = 1 << 16;
/// The most values a block of one layer can hold (`head_dim × block_size × kv_heads`).
pub const MAX_BLOCK_VALUES: usize = 1 << 30;
/// The most tokens of the full-precision window (`(residual_blocks + 1) × block_size`) and of
/// the attention sinks.
pub const MAX_WINDOW_TOKENS: usize = 1 << 24;

/// A cache's configuration. Build one with [`CacheConfig::new`] and the `with_*` methods.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Spec of the keys.
    pub k_spec: QuantSpec,
    /// Spec of the values.
    pub v_spec: QuantSpec,
    /// Complete blocks kept in full precision, besides the one being filled, for specs
    /// grouped over tokens (per-channel): KIVI's residual window is `(residual_blocks + 1)
    /// × block_size` tokens at most.
    pub residual_blocks: usize,
    /// The first tokens of every sequence kept in full precision (attention sinks).
    pub sink_tokens: usize,
    /// Storage type of the tokens kept out of the blocks (residual window and sinks): of the
    /// keys, and of the values unless [`CacheConfig::value_tail_dtype`] says otherwise.
    pub tail_dtype: TailDtype,
    /// Storage type of the values' window and sinks when it differs from
    /// [`CacheConfig::tail_dtype`]. Values take 8 bits ([`TailDtype::Int8`]) with no error
    /// measurable on the shared capture, keys' outlier channels do not (docs/formats.md).
    pub value_tail_dtype: Option<TailDtype>,
    /// Blocks in the pool (one block: `block_size` tokens of one layer and KV head, K and V).
    pub capacity_blocks: usize,
    /// Static ranges for per-tensor and per-head specs (and per-channel specs that should
    /// quantize at once instead of through the residual window).
    pub calibration: Option<Calibration>,
    /// Bits per key channel for a `-qa` K spec: one map per layer and KV head, entry
    /// `layer · kv_heads + head` ([`kvq_quant_core::channel_bits`]). Key rows are stored with
    /// their channels in the map's [`ChannelBits::permutation`] order, each width's channels
    /// a per-channel region of its own in the block.
    pub channel_bits: Option<Vec<ChannelBits>>,
    /// The model's RoPE, for a `-prerope` K spec: a block's keys are taken out of RoPE
    /// (token at sequence position `p` turned back by `p`) when the block is quantized, so its
    /// codes and parameters are those of the keys before RoPE. Readers turn decoded rows of
    /// quantized blocks forward again; sinks and the residual window hold the keys as given.
    pub rope: Option<Rope>,
    /// Row specs (per-token, `gN`) wait in the full-precision tail until their block leaves
    /// the residual window, as per-channel specs do, instead of being quantized as they
    /// arrive: the latest tokens' values (and per-token keys) stay exact, as in KIVI, for the
    /// tail's bytes. Always so for row specs with one-byte parameters (`-p8`), whose block
    /// shares a grid. Default off.
    pub row_window: bool,
    /// The range scan, encoding and packing used to quantize rows as they arrive. All
    /// implementations give the same codes; `kvq-kernels-simd`'s `row_kernels()` returns the
    /// fastest for the CPU (the `kvq` facade sets it), the default is the portable one.
    pub row_kernels: RowKernels,
}

impl CacheConfig {
    /// A config with KIVI-style defaults: INT4 per-channel keys and INT4 per-token values,
    /// blocks of 32 tokens, no extra residual blocks, no sinks, f16 tails.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, capacity_blocks: usize) -> Self {
        Self {
            layers,
            kv_heads,
            head_dim,
            block_size: 32,
            k_spec: QuantSpec::affine(4, Granularity::PerChannel { token_group: None }).expect("valid spec"),
            v_spec: QuantSpec::affine(4, Granularity::PerToken).expect("valid spec"),
            residual_blocks: 0,
            sink_tokens: 0,
            tail_dtype: TailDtype::F16,
            value_tail_dtype: None,
            capacity_blocks,
            calibration: None,
            channel_bits: None,
            rope: None,
            row_window: false,
            row_kernels: RowKernels::PORTABLE,
        }
    }

    /// Sets [`CacheConfig::row_window`]: row specs keep the residual window too.
    pub fn with_row_window(mut self, on: bool) -> Self {
        self.row_window = on;
        self
    }

    /// Sets the row quantization kernels (see [`CacheConfig::row_kernels`]).
    pub fn with_row_kernels(mut self, kernels: RowKernels) -> Self {
        self.row_kernels = kernels;
        self
    }

    /// Sets the K and V specs.
    pub fn with_specs(mut self, k: QuantSpec, v: QuantSpec) -> Self {
        self.k_spec = k;
        self.v_spec = v;
        self
    }

    /// Sets the block size.
    pub fn with_block_size(mut self, block_size: usize) -> Self {
        self.block_size = block_size;
        self
    }

    /// Sets the number of extra full-precision blocks.
    pub fn with_residual_blocks(mut self, n: usize) -> Self {
        self.residual_blocks = n;
        self
    }

    /// Sets the number of attention-sink tokens.
    pub fn with_sink_tokens(mut self, n: usize) -> Self {
        self.sink_tokens = n;
        self
    }

    /// Sets the storage type of the window and sinks of keys and values alike (clearing a
    /// values' own: set it after this with [`CacheConfig::with_value_tail_dtype`]).
    pub fn with_tail_dtype(mut self, dtype: TailDtype) -> Self {
        self.tail_dtype = dtype;
        self.value_tail_dtype = None;
        self
    }

    /// Sets the storage type of the values' window and sinks alone.
    pub fn with_value_tail_dtype(mut self, dtype: TailDtype) -> Self {
        self.value_tail_dtype = Some(dtype);
        self
    }

    /// The storage types of the window and sinks, `[keys, values]`.
    pub fn tail_dtypes(&self) -> [TailDtype; 2] {
        [self.tail_dtype, self.value_tail_dtype.unwrap_or(self.tail_dtype)]
    }

    /// Sets the calibration.
    pub fn with_calibration(mut self, calibration: Calibration) -> Self {
        self.calibration = Some(calibration);
        self
    }

    /// Sets the bits per key channel of a `-qa` K spec (see [`CacheConfig::channel_bits`]).
    pub fn with_channel_bits(mut self, maps: Vec<ChannelBits>) -> Self {
        self.channel_bits = Some(maps);
        self
    }

    /// Sets the model's RoPE for a `-prerope` K spec (see [`CacheConfig::rope`]).
    pub fn with_rope(mut self, rope: Rope) -> Self {
        self.rope = Some(rope);
        self
    }

    /// Checks a `-prerope` K spec and its RoPE: per-channel keys quantized as blocks leave the
    /// window, the model's frequencies for this head_dim.
    fn check_pre_rope(&self) -> Result<()> {
        let bad = |m: String| Err(CacheError::Config(m));
        if self.v_spec.pre_rope() {
            return bad(format!("V spec {}: values do not go through RoPE", self.v_spec));
        }
        let k = &self.k_spec;
        let Some(rope) = &self.rope else {
            if k.pre_rope() {
                return bad(format!("K spec {k}: keys quantized before RoPE need the model's RoPE"));
            }
            return Ok(());
        };
        if !k.pre_rope() {
            return bad(format!("a RoPE is given but K spec {k} has no -prerope"));
        }
        if !matches!(k.granularity(), Granularity::PerChannel { .. }) || self.calibration.is_some() {
            return bad(format!(
                "K spec {k}: keys are taken out of RoPE for per-channel groups over a block, with ranges from the data (no calibration)"
            ));
        }
        if k.channel_bits() || k.rotated() {
            return bad(format!("K spec {k}: -prerope with -qa or -rot is measured by `kvq analyze` only"));
        }
        if rope.head_dim() != self.head_dim {
            return bad(format!(
                "RoPE of {} frequencies turns {} channels, head_dim is {}",
                rope.inv_freq().len(),
                rope.head_dim(),
                self.head_dim
            ));
        }
        Ok(())
    }

    /// Checks the maps of a `-qa` K spec: one per layer and head, `head_dim` channels, summing
    /// to the spec's bits per channel, each width a whole number of 8-channel units.
    fn check_channel_bits(&self) -> Result<()> {
        let bad = |m: String| Err(CacheError::Config(m));
        if self.v_spec.channel_bits() {
            return bad(format!("V spec {}: bits per channel (-qa) are for keys", self.v_spec));
        }
        let Some(maps) = &self.channel_bits else {
            if self.k_spec.channel_bits() {
                return bad(format!(
                    "K spec {}: bits per channel need a map per layer and head",
                    self.k_spec
                ));
            }
            return Ok(());
        };
        if !self.k_spec.channel_bits() {
            return bad(format!("channel bit maps are given but K spec {} has no -qa", self.k_spec));
        }
        if self.calibration.is_some() {
            return bad(format!(
                "K spec {}: bits per channel take their ranges from the data, not a calibration",
                self.k_spec
            ));
        }
        let want = self.layers.checked_mul(self.kv_heads);
        if want != Some(maps.len()) {
            return bad(format!(
                "{} channel bit maps for {} layers × {} KV heads",
                maps.len(),
                self.layers,
                self.kv_heads
            ));
        }
        for (i, map) in maps.iter().enumerate() {
            let at = format!("channel bit map {i} (layer {}, head {})", i / self.kv_heads, i % self.kv_heads);
            if map.head_dim() != self.head_dim {
                return bad(format!("{at}: {} channels, head_dim is {}", map.head_dim(), self.head_dim));
            }
            let total = usize::from(self.k_spec.bits()) * self.head_dim;
            if map.total_bits() != total {
                return bad(format!("{at}: widths sum to {} bits, not {total}", map.total_bits()));
            }
            let unit = kvq_quant_core::channel_bits::UNIT;
            if let Some((w, c)) = map.segments().into_iter().find(|(_, c)| !c.len().is_multiple_of(unit)) {
                return bad(format!("{at}: {} channels at {w} bits, not a multiple of {unit}", c.len()));
            }
        }
        Ok(())
    }

    /// Checks the config.
    ///
    /// # Errors
    /// [`CacheError::Config`] naming the first problem.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CacheError::Config(m));
        if self.layers == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.block_size == 0 {
            return bad("layers, kv_heads, head_dim and block_size must be positive".into());
        }
        if self.layers > MAX_LAYERS {
            return bad(format!("layers {} is over the limit of {MAX_LAYERS}", self.layers));
        }
        let values = self.head_dim.checked_mul(self.block_size).and_then(|n| n.checked_mul(self.kv_heads));
        if values.is_none_or(|n| n > MAX_BLOCK_VALUES) {
            return bad(format!(
                "head_dim {} × block_size {} × kv_heads {} is over the limit of 2^30 values per block and layer",
                self.head_dim, self.block_size, self.kv_heads
            ));
        }
        let window = self.residual_blocks.checked_add(1).and_then(|n| n.checked_mul(self.block_size));
        if window.is_none_or(|n| n > MAX_WINDOW_TOKENS) {
            return bad(format!(
                "residual_blocks {} + 1 blocks of {} tokens is over the limit of {MAX_WINDOW_TOKENS} window tokens",
                self.residual_blocks, self.block_size
            ));
        }
        if self.sink_tokens > MAX_WINDOW_TOKENS {
            return bad(format!("sink_tokens {} is over the limit of {MAX_WINDOW_TOKENS}", self.sink_tokens));
        }

        self.check_channel_bits()?;
        self.check_pre_rope()?;
        for (name, spec) in [("K", &self.k_spec), ("V", &self.v_spec)] {
            // Rotated keys are stored rotated, tails and sinks too, and attention rotates each
            // query row the same way once: the rotation is orthogonal, so scores are unchanged.
            // (The spec grammar already keeps -rot from -qa, whose maps name channels as given.)
            if spec.rotated() {
                if !kvq_quant_core::rotation::rotatable(self.head_dim) {
                    return bad(format!(
                        "{name} spec {spec}: rotation needs a power-of-two head_dim, got {}",
                        self.head_dim
                    ));
                }
                if self.calibration.is_some()
                    && !matches!(spec.granularity(), Granularity::PerToken | Granularity::Group(_))
                {
                    return bad(format!(
                        "{name} spec {spec}: calibrated ranges are ranges of the rows as given; a rotated spec takes its ranges from the data"
                    ));
                }
            }
            if let Err(e) = spec.check_shape(kvq_quant_core::Shape::new(1, 1, self.head_dim)) {
                return bad(format!("{name} spec {spec}: {e}"));
            }
            if spec.param_dtype() == kvq_quant_core::ParamDtype::U8 && self.calibration.is_some() {
                return bad(format!(
                    "{name} spec {spec}: one-byte parameters (-p8) are a block's own, calibrated ranges are held once per cache: give a calibration with specs without -p8"
                ));
            }
            if let Kind::Codebook(CodebookSource::LloydMax) = spec.kind() {
                return bad(format!(
                    "{name} spec {spec}: a streaming cache needs fixed codebook levels (fit them on a calibration set and pass a fixed codebook)"
                ));
            }
            match spec.granularity() {
                Granularity::Group(g) if g == 0 || !self.head_dim.is_multiple_of(g) => {
                    return bad(format!(
                        "{name} spec {spec}: group {g} does not divide head_dim {}",
                        self.head_dim
                    ));
                }
                Granularity::PerChannel { token_group: Some(n) }
                    if (n == 0
                        || !self.block_size.is_multiple_of(n)
                        || self.block_size / n > crate::part_layout::MAX_CHANNEL_SETS)
                        && self.calibration.is_none() =>
                {
                    return bad(format!(
                        "{name} spec {spec}: per-channel groups stream a block at a time, in token groups that divide it (at most {} a block); use `channel`, `channel{}` or a divisor of {}",
                        crate::part_layout::MAX_CHANNEL_SETS,
                        self.block_size,
                        self.block_size
                    ));
                }
                Granularity::PerChannel { token_group: Some(n) }
                    if n < self.block_size
                        && self.calibration.is_none()
                        && (spec.channel_bits() || spec.pre_rope()) =>
                {
                    return bad(format!(
                        "{name} spec {spec}: -qa and -prerope keys take per-channel groups of the whole block; use `channel` or `channel{}`",
                        self.block_size
                    ));
                }
                Granularity::PerTensor | Granularity::PerHead if self.calibration.is_none() => {
                    return bad(format!(
                        "{name} spec {spec}: per-tensor and per-head ranges change as tokens stream in; give a calibration"
                    ));
                }
                _ => {}
            }
        }
        let calibrated = self.calibration.is_some();
        let block_bytes =
            crate::part_layout::PartLayout::new(&self.k_spec, self.head_dim, self.block_size, calibrated)?
                .bytes()
                + crate::part_layout::PartLayout::new(
                    &self.v_spec,
                    self.head_dim,
                    self.block_size,
                    calibrated,
                )?
                .bytes();
        crate::pool::arena_bytes(self.capacity_blocks, block_bytes)?;
        if let Some(c) = &self.calibration
            && (c.layers() != self.layers || c.heads() != self.kv_heads || c.head_dim() != self.head_dim)
        {
            return bad(format!(
                "calibration is for {} layers × {} heads × {} channels, the cache for {} × {} × {}",
                c.layers(),
                c.heads(),
                c.head_dim(),
                self.layers,
                self.kv_heads,
                self.head_dim
            ));
        }
        Ok(())
    }
}
