//! One import for the common types: `use kvq::prelude::*;`. Each name links to where it is
//! documented (`no_inline`: the reference lists every type once).

#[doc(no_inline)]
pub use crate::attention::{AttentionOptions, BatchSeq, DecodeWorkspace, ScorePath, decode_attention};
#[doc(no_inline)]
pub use crate::cache::{KvCacheConfig, KvqError, LayerSpecs, QuantizedKvCache};
#[doc(no_inline)]
pub use crate::element::Element;
#[doc(no_inline)]
pub use kvq_cache_layout::{SeqId, TailDtype};
#[doc(no_inline)]
pub use kvq_quant_core::calibration::Part;
#[doc(no_inline)]
pub use kvq_quant_core::io::TensorFile;
#[doc(no_inline)]
pub use kvq_quant_core::metrics::error_stats;
#[doc(no_inline)]
pub use kvq_quant_core::{Calibration, ChannelBits, QuantSpec, Shape, Tensor, quantize};
