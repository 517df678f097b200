//! A tiny random Llama written as GGUF through candle's writer, shared by the tests.
#![allow(dead_code, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};

/// The tiny model's shape: 3 layers, 4 query heads over 2 KV heads of 64 channels.
pub const LAYERS: usize = 3;
pub const HIDDEN: usize = 256;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const FFN: usize = 512;
pub const VOCAB: usize = 320;

/// A fixed xorshift generator: the tests must not depend on a crate's RNG.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        // Uniform in [-1, 1).
        ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| ((self.next_f32() + 1.0) * 0.5 * VOCAB as f32) as u32 % VOCAB as u32).collect()
    }
}

fn tensor(rng: &mut Rng, dims: &[usize], scale: f32, offset: f32) -> Tensor {
    let n: usize = dims.iter().product();
    let data: Vec<f32> = (0..n).map(|_| offset + scale * rng.next_f32()).collect();
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
}

/// Where the weight types go: matrices of attention, of the MLP, and the output head.
#[derive(Clone, Copy)]
pub struct Types {
    pub attn: GgmlDType,
    pub mlp: GgmlDType,
    pub output: GgmlDType,
}

/// Writes the tiny model to `path` (architecture `arch`; `qwen2` adds q/k/v biases).
pub fn write_tiny(path: &Path, arch: &str, types: Types, seed: u64) {
    let mut rng = Rng::new(seed);
    let (qd, kd) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut put = |name: String, t: Tensor, dtype: GgmlDType| {
        tensors.push((name, QTensor::quantize(&t, dtype).unwrap()));
    };
    put("token_embd.weight".into(), tensor(&mut rng, &[VOCAB, HIDDEN], 1.0, 0.0), GgmlDType::F32);
    put("output_norm.weight".into(), tensor(&mut rng, &[HIDDEN], 0.1, 1.0), GgmlDType::F32);
    put("output.weight".into(), tensor(&mut rng, &[VOCAB, HIDDEN], 0.2, 0.0), types.output);
    let w = 1.5 / (HIDDEN as f32).sqrt();
    for l in 0..LAYERS {
        let p = |s: &str| format!("blk.{l}.{s}");
        put(p("attn_norm.weight"), tensor(&mut rng, &[HIDDEN], 0.1, 1.0), GgmlDType::F32);
        put(p("ffn_norm.weight"), tensor(&mut rng, &[HIDDEN], 0.1, 1.0), GgmlDType::F32);
        // Larger query/key weights give peaked attention, as real models have.
        put(p("attn_q.weight"), tensor(&mut rng, &[qd, HIDDEN], 3.0 * w, 0.0), types.attn);
        put(p("attn_k.weight"), tensor(&mut rng, &[kd, HIDDEN], 3.0 * w, 0.0), types.attn);
        put(p("attn_v.weight"), tensor(&mut rng, &[kd, HIDDEN], w, 0.0), types.attn);
        put(p("attn_output.weight"), tensor(&mut rng, &[HIDDEN, qd], w, 0.0), types.attn);
        put(p("ffn_gate.weight"), tensor(&mut rng, &[FFN, HIDDEN], w, 0.0), types.mlp);
        put(p("ffn_up.weight"), tensor(&mut rng, &[FFN, HIDDEN], w, 0.0), types.mlp);
        put(p("ffn_down.weight"), tensor(&mut rng, &[HIDDEN, FFN], w, 0.0), types.mlp);
        if arch == "qwen2" {
            put(p("attn_q.bias"), tensor(&mut rng, &[qd], 0.5, 0.0), GgmlDType::F32);
            put(p("attn_k.bias"), tensor(&mut rng, &[kd], 0.5, 0.0), GgmlDType::F32);
            put(p("attn_v.bias"), tensor(&mut rng, &[kd], 0.5, 0.0), GgmlDType::F32);
        }
    }
    use gguf_file::Value as V;
    let a = arch;
    let md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (format!("{a}.block_count"), V::U32(LAYERS as u32)),
        (format!("{a}.embedding_length"), V::U32(HIDDEN as u32)),
        (format!("{a}.feed_forward_length"), V::U32(FFN as u32)),
        (format!("{a}.attention.head_count"), V::U32(HEADS as u32)),
        (format!("{a}.attention.head_count_kv"), V::U32(KV_HEADS as u32)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), V::F32(1e-5)),
        (format!("{a}.rope.freq_base"), V::F32(10_000.0)),
        (format!("{a}.rope.dimension_count"), V::U32(HEAD_DIM as u32)),
        (format!("{a}.context_length"), V::U32(2048)),
        ("tokenizer.ggml.bos_token_id".into(), V::U32(1)),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
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
