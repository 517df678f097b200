//! Errors of the cache. A failed call leaves the cache exactly as it was.

use kvq_quant_core::QuantError;

use crate::SeqId;

/// Why a cache operation was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// The configuration cannot describe a cache.
    #[error("invalid cache config: {0}")]
    Config(String),
    /// Not enough free blocks; nothing was changed.
    #[error("block pool exhausted: the operation needs {needed} blocks, {free} are free to it")]
    PoolExhausted {
        /// Blocks the operation needed.
        needed: usize,
        /// Blocks it could take: free and not reserved for other sequences.
        free: usize,
    },
    /// No live sequence has this id.
    #[error("unknown sequence {0:?}")]
    UnknownSequence(SeqId),
    /// Input of the wrong size or layer.
    #[error("shape mismatch: expected {expected}, got {got}")]
    Shape {
        /// What the call needed.
        expected: String,
        /// What it was given.
        got: String,
    },
    /// NaN or ±Inf in appended data.
    #[error(
        "non-finite {part} value {value} at layer {layer}, head {head}, token {token}, channel {channel}"
    )]
    NonFinite {
        /// "key" or "value".
        part: &'static str,
        /// Layer.
        layer: usize,
        /// KV head.
        head: usize,
        /// Token position in the sequence.
        token: usize,
        /// Channel.
        channel: usize,
        /// The value.
        value: f32,
    },
    /// Truncating would cut into a block whose keys were already quantized with parameters
    /// over the whole block; the full-precision tokens needed to re-group them are gone.
    #[error(
        "cannot truncate layer {layer} to {len} tokens: tokens {quantized_from}.. are quantized per channel in whole blocks; truncate to a block boundary or to at least {quantized_until}"
    )]
    TruncateIntoBlock {
        /// Layer.
        layer: usize,
        /// Requested length.
        len: usize,
        /// Start of the block that would be cut.
        quantized_from: usize,
        /// End of the quantized tokens.
        quantized_until: usize,
    },
    /// A layer index past the model's layers.
    #[error("layer {layer} out of range ({layers} layers)")]
    Layer {
        /// Requested layer.
        layer: usize,
        /// Layers in the cache.
        layers: usize,
    },
    /// Quantization refused the data (e.g. a parameter overflowing f16).
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// Memory for the cache could not be allocated; nothing was changed.
    #[error("cannot allocate {bytes} bytes for {what}")]
    Alloc {
        /// What the memory was for.
        what: &'static str,
        /// How much was asked for.
        bytes: usize,
    },
    /// The next sequence id is past the largest a file may hold (`MAX_SEQ_ID`, 2^62): only a
    /// cache loaded from a file with its counter at that bound gets there, and it can no longer
    /// be written whole (single sequences still can).
    #[error("sequence id {0} is over the 2^62 that an offload file may hold")]
    SequenceIds(u64),
    /// An offload file could not be read back; the cache is unchanged.
    #[error("offload file: {0}")]
    Offload(String),
    /// An offload file was written or read with an I/O error.
    #[error("offload file: {0}")]
    Io(#[from] std::io::Error),
}

/// Shorthand for results of this crate.
pub type Result<T, E = CacheError> = std::result::Result<T, E>;

impl CacheError {
    /// This error as one of layer `layer` of a model whose layers are each a single-layer
    /// cache (which reports its only layer as 0): the layer fields say `layer`.
    pub fn in_layer(self, layer: usize) -> Self {
        match self {
            CacheError::NonFinite { part, layer: 0, head, token, channel, value } => {
                CacheError::NonFinite { part, layer, head, token, channel, value }
            }
            CacheError::TruncateIntoBlock { layer: 0, len, quantized_from, quantized_until } => {
                CacheError::TruncateIntoBlock { layer, len, quantized_from, quantized_until }
            }
            other => other,
        }
    }
}
