//! # kvq-serve
//!
//! An OpenAI-compatible HTTP server for Llama-family GGUF models whose KV cache is kvq's
//! quantized cache: `/v1/completions` and `/v1/chat/completions` (streaming over server-sent
//! events or not), `/v1/models`, `/health` and `/metrics` (Prometheus text).
//!
//! - [`engine`]: the scheduler thread, continuous batching over a shared block pool, admission
//!   by reserved blocks, cancellation when a client goes away.
//! - [`prefix`]: automatic prefix caching, exact, keyed by a hash chain over blocks of tokens.
//! - [`sampling`]: greedy, temperature, top-k, top-p, min-p, penalties, seeds.
//! - [`text`]: incremental detokenization and stop strings.
//! - [`chat`]: the model's chat template (Jinja).
//! - [`api`]: the request and response bodies and their checks.
//! - [`server`]: routes, limits and start-up.
//!
//! ```no_run
//! use kvq_serve::server::{ServerConfig, run};
//!
//! let config = ServerConfig { model: "target/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(), ..Default::default() };
//! run(&config, "127.0.0.1:8080".parse()?, 2)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod api;
pub mod chat;
pub mod engine;
pub mod prefix;
pub mod sampling;
pub mod server;
pub mod store;
pub mod text;
