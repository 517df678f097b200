//! Writes kvq's tiny random model (a real tokenizer and chat template, random weights) to the
//! path given, for a smoke run of the server where no real model is at hand:
//!
//! ```sh
//! cargo run -p kvq-serve --example tiny_model -- target/tiny.gguf
//! cargo run -p kvq-serve -- --model target/tiny.gguf
//! ```

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: tiny_model PATH")?;
    kvq_candle::tiny::TinyModel::default().write(&path)?;
    println!("{path}");
    Ok(())
}
