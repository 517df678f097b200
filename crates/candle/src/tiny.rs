//! A tiny random Llama-family model written as GGUF, with a byte-level BPE tokenizer and a
//! ChatML chat template in its metadata: everything a real GGUF carries, at 1.6 MB.
//!
//! For tests, examples and smoke runs of a server (`kvq-serve` on loopback, CI's OpenAI client
//! check) on a machine that has no model: its weights are random, so its text is noise, but
//! every code path a real model takes (weights of any GGUF type, GQA, RoPE, the tokenizer, the
//! end-of-generation token, the chat template) runs.
//!
//! ```no_run
//! let path = std::env::temp_dir().join("tiny.gguf");
//! kvq_candle::tiny::TinyModel::default().write(&path)?;
//! let model = kvq_candle::LlamaModel::load(&path)?;
//! assert_eq!(model.config().vocab, kvq_candle::tiny::VOCAB);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// Decoder layers.
pub const LAYERS: usize = 3;
/// Hidden size.
pub const HIDDEN: usize = 256;
/// Query heads.
pub const HEADS: usize = 4;
/// KV heads (two query heads share each).
pub const KV_HEADS: usize = 2;
/// Channels per head.
pub const HEAD_DIM: usize = 64;
/// MLP width.
pub const FFN: usize = 512;
/// Vocabulary: 3 special tokens, 256 byte tokens and 61 merges.
pub const VOCAB: usize = 320;
/// The context the metadata declares.
pub const CONTEXT: usize = 2048;

/// `<|endoftext|>`: BOS, and the end of a completion.
pub const ENDOFTEXT: u32 = 0;
/// `<|im_start|>`: opens a chat turn.
pub const IM_START: u32 = 1;
/// `<|im_end|>`: closes a chat turn; the model's end-of-generation token (`eos_token_id`).
pub const IM_END: u32 = 2;

pub use crate::tokenizer::CHATML_TEMPLATE;

/// The weight types of the tiny model's matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Types {
    /// q, k, v and output projections.
    pub attn: GgmlDType,
    /// gate, up and down.
    pub mlp: GgmlDType,
    /// The output head.
    pub output: GgmlDType,
}

/// What to write; [`TinyModel::default`] is a `llama` model in Q8_0 (attention and output) and
/// Q4_0 (MLP), the types kvq's own kernels multiply, seed 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyModel {
    /// `llama`, or `qwen2` (adds q/k/v biases).
    pub arch: String,
    /// Weight types.
    pub types: Types,
    /// The seed of the weights.
    pub seed: u64,
}

impl Default for TinyModel {
    fn default() -> Self {
        Self {
            arch: "llama".into(),
            types: Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4_0, output: GgmlDType::Q8_0 },
            seed: 1,
        }
    }
}

/// A fixed xorshift generator, so that a seed gives the same model on every machine (and tests
/// the same inputs).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    fn tensor(&mut self, dims: &[usize], scale: f32, offset: f32) -> Result<Tensor> {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n).map(|_| offset + scale * self.next_f32()).collect();
        Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
    }
}

/// GPT-2's byte-level alphabet: the character that stands for each byte in the vocabulary.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap_or('?')
        })
        .collect()
}

/// The tokenizer's tokens and merges: specials, bytes, then 61 merges of frequent English
/// pairs (a space before a letter, common digraphs).
fn vocabulary() -> (Vec<String>, Vec<String>) {
    let chars = byte_chars();
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    tokens.extend(chars.iter().map(char::to_string));
    let space = chars[usize::from(b' ')];
    let mut merges = Vec::new();
    for c in b'a'..=b'z' {
        merges.push((space.to_string(), char::from(c).to_string()));
    }
    for pair in [
        "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed", "is",
        "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le", "ve", "co", "me", "de",
        "hi",
    ] {
        let (a, b) = pair.split_at(1);
        merges.push((a.to_string(), b.to_string()));
    }
    let merges: Vec<String> = merges
        .into_iter()
        .take(VOCAB - tokens.len())
        .map(|(a, b)| {
            tokens.push(format!("{a}{b}"));
            format!("{a} {b}")
        })
        .collect();
    (tokens, merges)
}

impl TinyModel {
    /// Writes the model to `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be written; [`Error::Candle`] from quantizing.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |source| Error::Io { path: path.display().to_string(), source };
        let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        self.write_to(&mut f)?;
        std::io::Write::flush(&mut f).map_err(io)
    }

    /// The model and its tokenizer, built in memory (no file).
    ///
    /// # Errors
    /// [`Error::Candle`] from quantizing; none for the models this module writes.
    pub fn load(&self) -> Result<(crate::LlamaModel, crate::GgufTokenizer)> {
        let mut bytes = std::io::Cursor::new(Vec::new());
        self.write_to(&mut bytes)?;
        bytes.set_position(0);
        let tokenizer = crate::GgufTokenizer::from_gguf(&gguf_file::Content::read(&mut bytes)?)?;
        let model = crate::LlamaModel::read(&mut bytes, crate::Weights::Native)?;
        Ok((model, tokenizer))
    }

    /// Writes the model as GGUF to `w`.
    ///
    /// # Errors
    /// [`Error::Io`] when `w` fails; [`Error::Candle`] from quantizing.
    pub fn write_to<W: std::io::Write + std::io::Seek>(&self, out: &mut W) -> Result<()> {
        let mut rng = Rng::new(self.seed);
        let (qd, kd) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        let types = self.types;
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut put = |name: String, t: Tensor, dtype: GgmlDType| -> Result<()> {
            tensors.push((name, QTensor::quantize(&t, dtype)?));
            Ok(())
        };
        put("token_embd.weight".into(), rng.tensor(&[VOCAB, HIDDEN], 1.0, 0.0)?, GgmlDType::F32)?;
        put("output_norm.weight".into(), rng.tensor(&[HIDDEN], 0.1, 1.0)?, GgmlDType::F32)?;
        put("output.weight".into(), rng.tensor(&[VOCAB, HIDDEN], 0.2, 0.0)?, types.output)?;
        let w = 1.5 / (HIDDEN as f32).sqrt();
        for l in 0..LAYERS {
            let p = |s: &str| format!("blk.{l}.{s}");
            put(p("attn_norm.weight"), rng.tensor(&[HIDDEN], 0.1, 1.0)?, GgmlDType::F32)?;
            put(p("ffn_norm.weight"), rng.tensor(&[HIDDEN], 0.1, 1.0)?, GgmlDType::F32)?;
            // Larger query/key weights give peaked attention, as real models have.
            put(p("attn_q.weight"), rng.tensor(&[qd, HIDDEN], 3.0 * w, 0.0)?, types.attn)?;
            put(p("attn_k.weight"), rng.tensor(&[kd, HIDDEN], 3.0 * w, 0.0)?, types.attn)?;
            put(p("attn_v.weight"), rng.tensor(&[kd, HIDDEN], w, 0.0)?, types.attn)?;
            put(p("attn_output.weight"), rng.tensor(&[HIDDEN, qd], w, 0.0)?, types.attn)?;
            put(p("ffn_gate.weight"), rng.tensor(&[FFN, HIDDEN], w, 0.0)?, types.mlp)?;
            put(p("ffn_up.weight"), rng.tensor(&[FFN, HIDDEN], w, 0.0)?, types.mlp)?;
            put(p("ffn_down.weight"), rng.tensor(&[HIDDEN, FFN], w, 0.0)?, types.mlp)?;
            if self.arch == "qwen2" {
                put(p("attn_q.bias"), rng.tensor(&[qd], 0.5, 0.0)?, GgmlDType::F32)?;
                put(p("attn_k.bias"), rng.tensor(&[kd], 0.5, 0.0)?, GgmlDType::F32)?;
                put(p("attn_v.bias"), rng.tensor(&[kd], 0.5, 0.0)?, GgmlDType::F32)?;
            }
        }
        use gguf_file::Value as V;
        let a = self.arch.as_str();
        let (tokens, merges) = vocabulary();
        let strings = |v: Vec<String>| V::Array(v.into_iter().map(V::String).collect());
        // Token types as llama.cpp numbers them: 1 normal, 3 control.
        let types_md = V::Array((0..VOCAB).map(|i| V::I32(if i < 3 { 3 } else { 1 })).collect());
        let md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String(a.into())),
            ("general.name".into(), V::String(format!("kvq tiny {a} (random weights, seed {})", self.seed))),
            (format!("{a}.block_count"), V::U32(LAYERS as u32)),
            (format!("{a}.embedding_length"), V::U32(HIDDEN as u32)),
            (format!("{a}.feed_forward_length"), V::U32(FFN as u32)),
            (format!("{a}.attention.head_count"), V::U32(HEADS as u32)),
            (format!("{a}.attention.head_count_kv"), V::U32(KV_HEADS as u32)),
            (format!("{a}.attention.layer_norm_rms_epsilon"), V::F32(1e-5)),
            (format!("{a}.rope.freq_base"), V::F32(10_000.0)),
            (format!("{a}.rope.dimension_count"), V::U32(HEAD_DIM as u32)),
            (format!("{a}.context_length"), V::U32(CONTEXT as u32)),
            ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), V::String("gpt2".into())),
            ("tokenizer.ggml.tokens".into(), strings(tokens)),
            ("tokenizer.ggml.merges".into(), strings(merges)),
            ("tokenizer.ggml.token_type".into(), types_md),
            ("tokenizer.ggml.bos_token_id".into(), V::U32(ENDOFTEXT)),
            ("tokenizer.ggml.eos_token_id".into(), V::U32(IM_END)),
            ("tokenizer.ggml.padding_token_id".into(), V::U32(IM_END)),
            ("tokenizer.chat_template".into(), V::String(CHATML_TEMPLATE.into())),
        ];
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(out, &md_refs, &t_refs)?;
        Ok(())
    }
}
