//! `kvq-serve`: an OpenAI-compatible server for a Llama-family GGUF model on kvq's quantized
//! KV cache.
//!
//! ```sh
//! cargo xtask fetch-model smollm2-135m
//! cargo run --release -p kvq-serve -- --model target/models/SmolLM2-135M-Instruct.Q4_1.gguf
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "What is a KV cache?"}], "max_tokens": 64}'
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvq::attention::ScorePath;
use kvq_candle::Weights;
use kvq_serve::engine::{Admission, Prefill};
use kvq_serve::server::{ServerConfig, run};

/// Serve a GGUF model on kvq's quantized KV cache, over OpenAI's HTTP API.
#[derive(Debug, Parser)]
#[command(name = "kvq-serve", version)]
struct Args {
    /// The GGUF model (`cargo xtask fetch-model smollm2-135m` fetches the default).
    #[arg(long, default_value = "target/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// The model's id in the API (default: the file name without `.gguf`).
    #[arg(long)]
    model_id: Option<String>,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: SocketAddr,
    /// A cache config (TOML, as `kvq recommend --out` writes it); kvq's default cache if absent.
    #[arg(long, conflicts_with = "specs")]
    cache_config: Option<PathBuf>,
    /// K/V specs instead of a config, e.g. `int8` or `int4-channel-p8/int4-token-p8`.
    #[arg(long)]
    specs: Option<String>,
    /// The cache pool's size in MiB.
    #[arg(long, default_value_t = 1024)]
    pool_mib: usize,
    /// Requests decoded together at most.
    #[arg(long, default_value_t = 16)]
    max_running: usize,
    /// Prompt tokens prefilled per step, over all requests.
    #[arg(long, default_value_t = 512)]
    prefill_budget: usize,
    /// Requests in flight at most; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_requests: usize,
    /// Largest request body in KiB.
    #[arg(long, default_value_t = 4096)]
    max_body_kib: usize,
    /// Longest sequence (prompt and output) served; 0 for the model's context length.
    #[arg(long, default_value_t = 0)]
    ctx: usize,
    /// Weights as stored (`native`) or dequantized to f32 (`f32`).
    #[arg(long, default_value = "native", value_parser = ["native", "f32"])]
    weights: String,
    /// Attention's score path: `int8` (fused integer kernels) or `float`.
    #[arg(long, default_value = "int8", value_parser = ["int8", "float"])]
    path: String,
    /// Prefix snapshots kept for reuse (0 turns prefix caching off).
    #[arg(long, default_value_t = 64)]
    prefix_entries: usize,
    /// Admission: `optimistic` reserves a request's prompt and a block more when its whole
    /// length does not fit (more requests at once; the youngest is preempted to host memory
    /// when blocks run out), `full` reserves prompt plus max_tokens (nothing preempted).
    #[arg(long, default_value = "optimistic", value_parser = ["optimistic", "full"])]
    admission: String,
    /// How prompt chunks attend: `exact` (each token as a decode step would: batching, chunk
    /// sizes and prefix-cache hits change no output) or `chunked` (a chunk's tokens together
    /// between the points where the cache quantizes a block: faster on long prompts, the
    /// same results up to float rounding).
    #[arg(long, default_value = "exact", value_parser = ["exact", "chunked"])]
    prefill: String,
    /// Threads of the engine's pool (matrix products and attention; the HTTP runtime takes at
    /// most 4).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Share prompt prefixes' quantized blocks with other processes through a store:
    /// `dir://PATH[?max_bytes=N]` (files, the default directory when no URL is given),
    /// `redis://HOST:PORT/DB[?ttl=SECONDS]`, or `memory://`. A prompt whose prefix another
    /// process computed is read from it instead of prefilled.
    #[arg(long, value_name = "URL", num_args = 0..=1, default_missing_value = "")]
    prefix_store: Option<String>,
    /// Print this machine's one-thread read rate from memory (GB/s: 256 MiB read by
    /// `kvq::baseline::stream_read`, best of 3, as `kvq bench` measures it) and exit. `cargo
    /// xtask serve-bench` sets each decode step against it, measured by this optimized build.
    #[arg(long)]
    read_rate: bool,
}

fn main() -> ExitCode {
    let a = Args::parse();
    if a.read_rate {
        println!("{:.2}", kvq::baseline::read_rate(kvq::baseline::STREAM_BYTES, 3) / 1e9);
        return ExitCode::SUCCESS;
    }
    let config = ServerConfig {
        model: a.model,
        model_id: a.model_id,
        cache_config: a.cache_config,
        specs: a.specs,
        pool_bytes: a.pool_mib.saturating_mul(1 << 20),
        max_running: a.max_running,
        prefill_budget: a.prefill_budget,
        max_requests: a.max_requests,
        max_body: a.max_body_kib.saturating_mul(1024),
        context: a.ctx,
        weights: if a.weights == "f32" { Weights::F32 } else { Weights::Native },
        path: if a.path == "float" { ScorePath::Float } else { ScorePath::Int8 },
        prefix_entries: a.prefix_entries,
        threads: a.threads.max(1),
        admission: if a.admission == "full" { Admission::Full } else { Admission::Optimistic },
        prefill: if a.prefill == "chunked" { Prefill::Chunked } else { Prefill::Exact },
        prefix_store: a.prefix_store,
    };
    match run(&config, a.addr, a.threads.max(1)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvq-serve: {e}");
            ExitCode::FAILURE
        }
    }
}
