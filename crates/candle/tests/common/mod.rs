//! A tiny random Llama written as GGUF through candle's writer, shared by the tests.
#![allow(dead_code, missing_docs)]

use std::path::{Path, PathBuf};

#[allow(unused_imports)]
pub use kvq_candle::tiny::{FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, Rng, Types, VOCAB};

/// Random token ids of the tiny model's vocabulary.
pub trait Tokens {
    fn tokens(&mut self, n: usize) -> Vec<u32>;
}

impl Tokens for Rng {
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| ((self.next_f32() + 1.0) * 0.5 * VOCAB as f32) as u32 % VOCAB as u32).collect()
    }
}

/// Writes the tiny model to `path` (architecture `arch`; `qwen2` adds q/k/v biases).
pub fn write_tiny(path: &Path, arch: &str, types: Types, seed: u64) {
    kvq_candle::tiny::TinyModel { arch: arch.into(), types, seed }.write(path).unwrap();
}

/// Writes the tiny model as `dir/tiny.gguf` and returns that path.
pub fn tiny_in(dir: &Path, arch: &str, types: Types, seed: u64) -> PathBuf {
    let path = dir.join("tiny.gguf");
    write_tiny(&path, arch, types, seed);
    path
}

/// A fresh temporary directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-candle-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `max |a − b| / max |b|`.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    num / den
}
