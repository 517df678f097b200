//! # kvq-cache-layout
//!
//! **Not implemented yet.** This crate will hold the storage of a quantized KV cache while a
//! model decodes: contiguous per-tensor and per-head layouts, a paged block pool with block
//! tables, streaming append with a full-precision residual window, copy-on-write forks and
//! offload to files (see `docs/architecture.md`). It builds on `kvq-quant-core` and knows
//! nothing about SIMD kernels.
//!
//! Until then it exports nothing, so that no caller mistakes it for working code.
