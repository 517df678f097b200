//! One import for the common types: `use kvq::prelude::*;`.

pub use crate::attention::{AttentionOptions, BatchSeq, DecodeWorkspace, ScorePath, decode_attention};
pub use crate::cache::{KvCacheConfig, KvqError, LayerSpecs, QuantizedKvCache};
pub use crate::element::Element;
pub use kvq_cache_layout::{SeqId, TailDtype};
pub use kvq_quant_core::calibration::Part;
pub use kvq_quant_core::io::TensorFile;
pub use kvq_quant_core::metrics::error_stats;
pub use kvq_quant_core::{Calibration, ChannelBits, QuantSpec, Shape, Tensor, quantize};
