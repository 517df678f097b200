//! # kvq
//!
//! Quantized key/value caches for transformer inference. This facade re-exports the
//! workspace's crates and hosts the analysis behind the `kvq` command-line tool.
//!
//! - [`quant`] (`kvq-quant-core`): formats, packing, metrics, safetensors input.
//! - [`layout`] (`kvq-cache-layout`): the paged, streaming cache.
//! - [`kernels`] (`kvq-kernels-simd`): fused dequant-dot and dequant-axpy kernels.
//! - [`attention`]: decode attention over the paged cache; [`baseline`]: the same over an
//!   unquantized contiguous f32/f16 cache, GQA-aware on FMA kernels (what benches compare with).
//! - [`cache`]: [`cache::KvCacheConfig`] (TOML/JSON, validated) and [`cache::QuantizedKvCache`],
//!   a model's cache with per-layer specs; [`prelude`] imports the common types.
//! - [`element`]: [`element::Element`], the f32, f16 and bf16 inputs and outputs of the cache.
//! - With the `cli` feature (on by default; an engine that only needs the cache turns it off):
//!   the `kvq` binary and the modules behind it, listed below.
#![cfg_attr(
    feature = "cli",
    doc = r#"
  - [`analysis`]: the `kvq analyze` report; [`plot`]: its SVG figures; [`recommend`]: per-layer
    specs from dumped tensors; [`cli`]: the command line as a function.

```
use kvq::analysis::{analyze, layers_from_file, KvSpec, Options};
use kvq::quant::io::TensorFile;

let file = TensorFile::from_bytes("sample", kvq::SAMPLE.to_vec())?;
let layers = layers_from_file(&file)?;
let specs = [KvSpec::parse("int4-channel/int4-token")?];
let report = analyze("sample", &layers[..1], &specs, &Options::default(), |_, _| {})?;
assert!(report.layers[0].rows[0].attn_rel_err < 0.2);
# Ok::<(), Box<dyn std::error::Error>>(())
```
"#
)]

#[cfg(feature = "cli")]
pub mod analysis;
pub mod attention;
pub mod baseline;
pub mod cache;
#[cfg(feature = "cli")]
pub mod cli;
pub mod element;
pub mod io;
#[cfg(feature = "cli")]
pub mod plot;
pub mod prelude;
#[cfg(feature = "cli")]
pub mod recommend;
pub mod weights;

pub use kvq_cache_layout as layout;
pub use kvq_kernels_simd as kernels;
pub use kvq_quant_core as quant;

/// The embedded default data: the first 256 tokens of the Q, K and V of three layers of
/// SmolLM2-135M reading *Botchan* (see `crates/kvq/data/README.md`).
pub const SAMPLE: &[u8] = include_bytes!("../data/sample.safetensors");

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}

/// The user's guide's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/guide.md")]
mod guide {}
