//! # kvq-cache-layout
//!
//! The storage of a quantized KV cache while a model decodes: a fixed pool of blocks, a
//! block table per sequence and layer, streaming quantization as tokens arrive, copy-on-write
//! forks, truncation, exact memory accounting and offload to files. It builds on
//! `kvq-quant-core` and knows nothing about SIMD: kernels read [`Segment`]s.
//!
//! - Per-token (and grouped) specs quantize each token as it arrives.
//! - Per-channel specs keep tokens in a full-precision tail until a block of `block_size`
//!   tokens (plus `residual_blocks` more) has gathered, then quantize the block with one
//!   group per channel (KIVI's residual window).
//! - Per-tensor and per-head specs quantize with a static [`Calibration`] and count the
//!   values they clamp.
//!
//! ```
//! use kvq_cache_layout::{CacheConfig, PagedCache};
//! use kvq_quant_core::calibration::Part;
//!
//! // 2 layers, 2 KV heads of 8 channels, room for 16 blocks of 4 tokens.
//! let config = CacheConfig::new(2, 2, 8, 16).with_block_size(4);
//! let mut cache = PagedCache::new(config)?;
//! let seq = cache.create();
//! for t in 0..6 {
//!     let row: Vec<f32> = (0..16).map(|i| (i * t) as f32 * 0.1).collect();
//!     cache.append(seq, 0, &row, &row)?;
//! }
//! assert_eq!(cache.len(seq, 0)?, 6);
//! let keys = cache.dequantize(seq, 0, 1, Part::K)?;
//! assert_eq!(keys.len(), 6 * 8);
//! # Ok::<(), kvq_cache_layout::CacheError>(())
//! ```
//!
//! [`Calibration`]: kvq_quant_core::Calibration

pub mod cache;
pub mod config;
pub mod error;
pub mod offload;
pub mod part_layout;
pub mod pool;
pub mod reserve;
pub mod view;

pub use cache::Reservation;
pub use cache::{CacheStats, PagedCache, SeqId};
pub use config::{CacheConfig, TailDtype};
pub use error::{CacheError, Result};
pub use part_layout::{INT8_ROWS_ZERO, Int8Rows, MAX_CHANNEL_SETS, Mode, PartLayout, TailBuf};
pub use pool::{BlockId, BlockPool};
pub use view::{BlockView, CacheMemory, LayerMemory, ParamWidening, Segment, Segments};
