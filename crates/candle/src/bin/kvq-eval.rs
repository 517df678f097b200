//! `kvq-eval`: what a quantized KV cache does to a model's next-token predictions
//! ([`kvq_candle::cli`] on the process's arguments).

fn main() -> std::process::ExitCode {
    kvq_candle::cli::main()
}
