//! # kvq-candle
//!
//! kvq's quantized KV cache under a real model, for engines built on
//! [candle](https://github.com/huggingface/candle):
//!
//! - [`convert`]: candle tensors (f32, f16, bf16; CPU) in and out of kvq's cache, read in place
//!   where the layout allows.
//! - [`LlamaModel`]: a Llama-family decoder (Llama, SmolLM, Qwen2's q/k/v bias) loaded from
//!   GGUF through candle-core's quantized matmuls, whose attention runs on a [`KvStore`]: kvq's
//!   [`KvqStore`] or the [`F32Cache`] reference.
//! - [`eval`]: KL divergence, top-1 agreement and perplexity of a quantized cache against the
//!   reference, in real decode or llama.cpp's perplexity protocol (the `kvq-eval` binary).
//! - [`passkey`]: long-context retrieval, a number hidden in filler text at several depths
//!   and lengths, answered with the reference cache and each candidate (`kvq-eval --passkey`).
//! - [`recommend`]: per-layer cache specs searched on the model for the fewest bits whose KL
//!   stays under a target (`kvq-eval --target-kl`).
//! - [`GgufTokenizer`]: the GGUF's own BPE tokenizer.
//! - [`tiny`]: a tiny random model with a real tokenizer and chat template, for tests and demos.
//!
//! ```no_run
//! use kvq_candle::{KvStore, KvqStore, LlamaModel};
//! use kvq::attention::ScorePath;
//!
//! let model = LlamaModel::load("target/models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! // kvq's defaults for this model's shape: INT4 per-channel keys, INT4 per-token values.
//! let config = model.config().cache_builder().build()?;
//! let mut cache = KvqStore::new(config, ScorePath::Float)?;
//! let logits = model.forward(&mut cache, &[1, 504, 3458])?;   // prefill: [3, vocab]
//! let next = logits.get(2)?.argmax(0)?.to_scalar::<u32>()?;
//! let logits = model.forward(&mut cache, &[next])?;            // one decode step
//! # let _ = logits;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod calibrate;
pub mod cli;
pub mod convert;
pub mod error;
pub mod eval;
pub mod gguf;
pub mod model;
pub mod passkey;
pub mod recommend;
pub mod store;
pub mod tiny;
pub mod tokenizer;

pub use error::{Error, Result};
pub use model::{LlamaConfig, LlamaModel, Weights};
pub use store::{F32Cache, KvStore, KvqSeq, KvqStore};
pub use tokenizer::GgufTokenizer;
