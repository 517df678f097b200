//! # kvq-kernels-simd
//!
//! **Not implemented yet.** This crate will hold the fused kernels that read a quantized KV
//! cache without materializing it: dequantize, dequant-dot (attention scores) and dequant-axpy
//! (value accumulation) for every block format, each with a scalar reference, on `wide` for the
//! portable path and `std::arch` paths chosen at run time (see `docs/architecture.md`). It is
//! the only crate of the workspace allowed `unsafe`, and it knows nothing about pages.
//!
//! Until then it exports nothing, so that no caller mistakes it for working code.
