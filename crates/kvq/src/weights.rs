//! A model's GGUF weight matrices multiplied by kvq's kernels: the weight types
//! ([`GgmlType`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), activations rounded as
//! ggml rounds them ([`Activations`]), and matrices repacked once at load into the layout
//! the kernels stream ([`PackedWeights`], multiplied by [`matmul_packed`] a range of
//! [`GROUP`] rows at a time, the backend chosen at run time). What a Llama-family model on
//! kvq's cache (kvq-candle) needs of the kernels crate's `ggml` and `ggml_packed` modules.

#[doc(no_inline)]
pub use kvq_kernels_simd::ggml::{Activations, GgmlType};
#[doc(no_inline)]
pub use kvq_kernels_simd::ggml_packed::{GROUP, PackedWeights, matmul_packed};
