//! # kvq-kernels-simd
//!
//! Kernels that read a quantized KV cache without materializing it. This crate is the only
//! one of the workspace allowed `unsafe` (for `std::arch` intrinsics); every `unsafe` block
//! carries a `// SAFETY:` comment, and every kernel has a scalar reference beside it.
//!
//! **Status:** only the backend [`dispatch`] exists so far. The fused dequantize,
//! dequant-dot (attention scores) and dequant-axpy (value accumulation) kernels are not
//! implemented yet; nothing here pretends to compute them.
//!
//! ```
//! use kvq_kernels_simd::dispatch::{self, Backend};
//! let best = dispatch::detect();
//! assert!(best.is_available());
//! assert!(dispatch::available().contains(&Backend::Scalar));
//! ```

pub mod dispatch;
