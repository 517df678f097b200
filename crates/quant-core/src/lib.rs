//! # kvq-quant-core
//!
//! The numerical core of kvq: quantization formats for KV-cache tensors, dense bit packing,
//! exact memory accounting, fidelity metrics and safetensors input. It depends on no other
//! crate of the workspace.
//!
//! - [`QuantSpec`]: a format (affine, symmetric, FP8 e4m3/e5m2, NF4 or Lloyd-Max codebook;
//!   1 to 8 bits) and a [`Granularity`] (per tensor, head, channel, token, or groups of G).
//! - [`quantize()`] turns a [`Tensor`] shaped `[batch, heads, tokens, head_dim]` into a
//!   [`QuantizedTensor`] of packed codes and parameters; [`QuantizedTensor::memory`] counts
//!   every byte.
//! - [`metrics`] measures the damage: MSE, cosine, SNR, and errors of attention outputs.
//!
//! ```
//! use kvq_quant_core::{metrics::error_stats, quantize, synth::normal_tensor, QuantSpec, Shape};
//!
//! let keys = normal_tensor(Shape::new(4, 256, 128), 7);
//! let spec: QuantSpec = "int4-head".parse()?;
//! let q = quantize(&keys, &spec)?;
//! let err = error_stats(keys.data(), q.dequantize().data())?;
//! assert!(err.cosine > 0.98);
//! // Two codes per byte plus one f16 scale and one f16 minimum per head.
//! assert_eq!(q.memory().total_bytes(), 4 * 256 * 128 / 2 + 4 * 4);
//! assert!((q.memory().ratio_vs_f16() - 4.0).abs() < 0.01);
//! # Ok::<(), kvq_quant_core::QuantError>(())
//! ```

pub mod calibration;
pub mod channel_bits;
pub mod codebook;
pub mod codec;
pub mod error;
pub mod format;
pub mod fp8;
pub mod io;
pub mod memory;
pub mod metrics;
pub mod pack;
pub mod params;
pub mod quantize;
pub mod rope;
pub mod rotation;
pub mod rowkernels;
pub mod synth;
pub mod tensor;

pub use calibration::{Calibration, Part};
pub use channel_bits::{ChannelBits, ChannelBitsTensor, quantize_channel_bits};
pub use codebook::Codebook;
pub use codec::{ChannelParams, Codec};
pub use error::{QuantError, Result};
pub use format::{CodebookSource, Granularity, Kind, ParamDtype, QuantSpec, RangeRule};
pub use fp8::Fp8Format;
pub use memory::MemoryReport;
pub use params::{GRID_BYTES, GroupParams, ParamGrid, ParamVec, ROW_SET_TOKENS};
pub use quantize::{
    GroupLayout, QuantizedTensor, encode_row_with, quantize, quantize_row, quantize_row_with,
    quantize_with_ranges, row_params_with,
};
pub use rope::{Rope, RopePairing};
pub use rowkernels::{Linear, RowKernels, row_stats};
pub use tensor::{Shape, Tensor};
