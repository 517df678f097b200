//! A Llama-family decoder (Llama, SmolLM, Mistral-style GGUFs, Qwen2 with its q/k/v bias) whose
//! attention reads and writes a [`KvStore`]: kvq's quantized cache or the f32 reference.
//!
//! Weights come from a GGUF file through candle-core's `gguf_file` and `QMatMul`, so every
//! weight type candle can multiply (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K)
//! loads. Projections and the MLP are candle ops; attention is the store's: each new token's
//! keys and values are appended to the layer, then its queries attend over the layer, so a
//! prefill of `T` tokens sees exactly what `T` decode steps would.

use std::collections::HashMap;
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::{GgmlDType, QMatMul, gguf_file};
use candle_core::{Device, Module, Tensor};
use kvq::attention::Kernels;
use kvq::attention::{AttentionOptions, BatchSeq, DecodeWorkspace};
use kvq::cache::QuantizedKvCache;
use kvq::cache::RopePairing;
use kvq::cache::SeqId;
use kvq::weights::{self, Activations, GgmlType, PackedWeights};
use rayon::prelude::*;

use crate::convert::{to_f32_vec, with_f32};
use crate::error::{Error, Result};
use crate::store::KvStore;

/// The shape of a Llama-family model, from its GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture` (`llama` or `qwen2`).
    pub architecture: String,
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads (GQA when fewer than `heads`).
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// MLP width.
    pub ffn: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Which channels RoPE rotates together in these weights.
    pub rope_pairing: RopePairing,
    /// The context the model was trained for (`{arch}.context_length`; 0 when absent).
    pub context_length: usize,
    /// The beginning-of-sequence token.
    pub bos: Option<u32>,
    /// Whether the tokenizer puts `bos` in front of a text.
    pub add_bos: bool,
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Option<&'a gguf_file::Value> {
    ct.metadata.get(key)
}

/// An integer metadata value of any integer type.
fn md_usize(ct: &gguf_file::Content, key: &str) -> Result<Option<usize>> {
    use gguf_file::Value as V;
    let Some(v) = md(ct, key) else { return Ok(None) };
    let n: Option<u64> = match *v {
        V::U8(x) => Some(x.into()),
        V::U16(x) => Some(x.into()),
        V::U32(x) => Some(x.into()),
        V::U64(x) => Some(x),
        V::I8(x) => u64::try_from(x).ok(),
        V::I16(x) => u64::try_from(x).ok(),
        V::I32(x) => u64::try_from(x).ok(),
        V::I64(x) => u64::try_from(x).ok(),
        _ => None,
    };
    match n.and_then(|n| usize::try_from(n).ok()) {
        Some(n) => Ok(Some(n)),
        None => Err(bad(format!("metadata {key} is {v:?}, not a non-negative integer"))),
    }
}

fn md_f64(ct: &gguf_file::Content, key: &str) -> Result<Option<f64>> {
    use gguf_file::Value as V;
    match md(ct, key) {
        None => Ok(None),
        Some(V::F32(x)) => Ok(Some(f64::from(*x))),
        Some(V::F64(x)) => Ok(Some(*x)),
        Some(v) => Err(bad(format!("metadata {key} is {v:?}, not a float"))),
    }
}

fn bad(reason: String) -> Error {
    Error::Model { path: String::new(), reason }
}

/// Upper bounds that no real model reaches; sizes beyond them are a corrupt or crafted file.
const MAX_DIM: usize = 1 << 20;
const MAX_LAYERS: usize = 1024;

impl LlamaConfig {
    /// Reads the model's shape from GGUF metadata and the token embedding's shape.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for an architecture other than `llama`/`qwen2` or partial RoPE;
    /// [`Error::Model`] for missing or inconsistent metadata.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let architecture = match md(ct, "general.architecture") {
            Some(gguf_file::Value::String(s)) => s.clone(),
            _ => return Err(bad("no general.architecture".into())),
        };
        let rope_pairing = match architecture.as_str() {
            // llama.cpp converts Llama checkpoints with q/k rows permuted for interleaved pairs.
            "llama" => RopePairing::Interleaved,
            // Qwen2 keeps the checkpoint's rotate-half layout (llama.cpp's NEOX RoPE).
            "qwen2" => RopePairing::Half,
            other => {
                return Err(Error::Unsupported(format!("architecture {other:?} (supported: llama, qwen2)")));
            }
        };
        let a = architecture.as_str();
        let need = |key: &str| -> Result<usize> {
            md_usize(ct, &format!("{a}.{key}"))?.ok_or_else(|| bad(format!("no {a}.{key}")))
        };
        let layers = need("block_count")?;
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let ffn = need("feed_forward_length")?;
        let kv_heads = md_usize(ct, &format!("{a}.attention.head_count_kv"))?.unwrap_or(heads);
        if layers == 0 || layers > MAX_LAYERS || heads == 0 || kv_heads == 0 || hidden == 0 || ffn == 0 {
            return Err(bad(format!(
                "{layers} layers, {heads} heads, {kv_heads} KV heads, hidden {hidden}, ffn {ffn}"
            )));
        }
        if [hidden, heads, ffn].iter().any(|&x| x > MAX_DIM) {
            return Err(bad(format!("sizes beyond {MAX_DIM}: hidden {hidden}, heads {heads}, ffn {ffn}")));
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(bad(format!("{heads} query heads cannot share {kv_heads} KV heads")));
        }
        let head_dim = match md_usize(ct, &format!("{a}.attention.key_length"))? {
            Some(d) => d,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => return Err(bad(format!("hidden {hidden} is not a multiple of {heads} heads"))),
        };
        if head_dim == 0 || head_dim % 2 == 1 || head_dim > 4096 {
            return Err(bad(format!("head_dim {head_dim}")));
        }
        if let Some(vl) = md_usize(ct, &format!("{a}.attention.value_length"))?
            && vl != head_dim
        {
            return Err(Error::Unsupported(format!(
                "value heads of {vl} channels beside keys of {head_dim}"
            )));
        }
        if let Some(r) = md_usize(ct, &format!("{a}.rope.dimension_count"))?
            && r != head_dim
        {
            return Err(Error::Unsupported(format!("partial RoPE ({r} of {head_dim} channels)")));
        }
        if md(ct, &format!("{a}.rope.scaling.type"))
            .is_some_and(|v| !matches!(v, gguf_file::Value::String(s) if s == "none"))
        {
            return Err(Error::Unsupported("RoPE scaling".into()));
        }
        if md_usize(ct, &format!("{a}.expert_count"))?.unwrap_or(0) > 1 {
            return Err(Error::Unsupported("mixture of experts".into()));
        }
        let rms_eps = md_f64(ct, &format!("{a}.attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5);
        let rope_theta = md_f64(ct, &format!("{a}.rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        if !(rms_eps.is_finite() && rms_eps >= 0.0 && rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(bad(format!("rms epsilon {rms_eps}, rope base {rope_theta}")));
        }
        let vocab = match ct.tensor_infos.get("token_embd.weight") {
            Some(info) => match *info.shape.dims() {
                [v, h] if h == hidden && v > 0 => v,
                ref dims => {
                    return Err(bad(format!("token_embd.weight is {dims:?}, expected [vocab, {hidden}]")));
                }
            },
            None => return Err(bad("no token_embd.weight".into())),
        };
        let context_length = md_usize(ct, &format!("{a}.context_length"))?.unwrap_or(0);
        let bos = md_usize(ct, "tokenizer.ggml.bos_token_id")?.and_then(|b| u32::try_from(b).ok());
        let add_bos = matches!(md(ct, "tokenizer.ggml.add_bos_token"), Some(gguf_file::Value::Bool(true)));
        Ok(Self {
            architecture,
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            rms_eps,
            rope_theta,
            rope_pairing,
            context_length,
            bos: bos.filter(|&b| (b as usize) < vocab),
            add_bos,
        })
    }

    /// A kvq cache config builder for this model's shape (layers, KV heads, query heads,
    /// head_dim), with its RoPE (frequencies and pairing) recorded, which layers with keys
    /// quantized before RoPE (`-prerope`) use.
    pub fn cache_builder(&self) -> kvq::cache::KvCacheConfigBuilder {
        let builder =
            kvq::cache::KvCacheConfig::builder(self.layers, self.kv_heads, self.heads, self.head_dim);
        match kvq::cache::Rope::new(&inv_freq(self.head_dim, self.rope_theta), self.rope_pairing) {
            Ok(rope) => builder.rope(rope),
            // No frequencies (a head_dim under 2): the pairing alone.
            Err(_) => builder.rope_pairing(self.rope_pairing),
        }
    }

    /// Checks that a cache config was made for this model.
    ///
    /// # Errors
    /// [`Error::ConfigMismatch`] naming the first difference.
    pub fn check_cache(&self, c: &kvq::cache::KvCacheConfig) -> Result<()> {
        let pairs = [
            ("layers", c.layers.len(), self.layers),
            ("KV heads", c.kv_heads, self.kv_heads),
            ("query heads", c.query_heads, self.heads),
            ("head_dim", c.head_dim, self.head_dim),
        ];
        for (what, cache, model) in pairs {
            if cache != model {
                return Err(Error::ConfigMismatch(format!(
                    "the config has {cache} {what}, the model {model}"
                )));
            }
        }
        if let Some(p) = c.rope_pairing
            && p != self.rope_pairing
        {
            return Err(Error::ConfigMismatch(format!(
                "the config's keys pair channels {} under RoPE, the model's {}",
                p.name(),
                self.rope_pairing.name()
            )));
        }
        if let Some(r) = &c.rope {
            let model = inv_freq(self.head_dim, self.rope_theta);
            let same = r.inv_freq().len() == model.len()
                && r.inv_freq().iter().zip(&model).all(|(&a, &b)| (a - f64::from(b)).abs() <= 1e-6 * a.abs());
            if !same || r.pairing() != self.rope_pairing {
                return Err(Error::ConfigMismatch(
                    "the config's RoPE frequencies or pairing are not the model's".to_string(),
                ));
            }
        }
        Ok(())
    }
}

/// Weight types this crate loads (candle-core multiplies each of them).
const SUPPORTED: [GgmlDType; 13] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Rotary position embedding in the weights' pairing, with llama.cpp's and candle's
/// frequencies (`theta^(-2i/d)`, angles and their cos/sin in f32).
#[derive(Debug, Clone)]
struct Rope {
    inv_freq: Vec<f32>,
    pairing: RopePairing,
}

/// The RoPE frequencies of a head, `theta^(-2i/d)`, in f32 as llama.cpp and candle compute
/// them.
fn inv_freq(head_dim: usize, theta: f32) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect()
}

impl Rope {
    fn new(head_dim: usize, theta: f32, pairing: RopePairing) -> Self {
        Self { inv_freq: inv_freq(head_dim, theta), pairing }
    }

    /// Pushes `(cos, sin)` of every pair at `pos`.
    fn push_table(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.extend(self.inv_freq.iter().map(|f| (pos as f32 * f).sin_cos()).map(|(s, c)| (c, s)));
    }

    /// Rotates every head of `x` (`heads × head_dim`).
    fn apply(&self, x: &mut [f32], table: &[(f32, f32)]) {
        let d = 2 * self.inv_freq.len();
        for head in x.chunks_exact_mut(d) {
            for (i, &(c, s)) in table.iter().enumerate() {
                let (a, b) = self.pairing.channels(i, d);
                let (xa, xb) = (head[a], head[b]);
                head[a] = xa * c - xb * s;
                head[b] = xa * s + xb * c;
            }
        }
    }
}

/// A weight matrix `[rows, k]` and who multiplies it.
#[derive(Debug)]
enum Linear {
    /// candle's matmul: f32 (dequantized) weights, f16, bf16, Q2_K and Q3_K.
    Candle(QMatMul),
    /// Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks, repacked eight rows at a time
    /// at load ([`kvq::kernels::ggml_packed`]: the same bytes for Q4_0, Q4_1 and Q8_0, a byte
    /// per 5-bit code, blocks of 32 with f32 scales for the K-quants) and multiplied by kvq's
    /// kernels (runtime-dispatched SIMD; candle has no fast path for Q4_1, and builds its
    /// others only with target features a default build lacks).
    Ggml { packed: PackedWeights, backend: Kernels },
}

/// Weight rows per parallel task of a [`Linear::Ggml`] product.
const ROWS_PER_TASK: usize = 64;

impl Linear {
    /// The input's rows times the transposed weights into `out` (`[n, rows]`); `t` is
    /// scratch.
    fn forward_into(
        &self,
        x: &mut Input<'_>,
        out: &mut [f32],
        act: &mut Activations,
        t: &mut Vec<f32>,
    ) -> Result<()> {
        let n = x.n;
        if n == 0 {
            return Ok(());
        }
        let (packed, backend) = match self {
            Linear::Candle(m) => {
                let k = x.x.len() / n.max(1);
                let y = m.forward(&Tensor::from_slice(x.x, (n, k), &Device::Cpu)?)?;
                return with_f32(&y, |y| out.copy_from_slice(y));
            }
            Linear::Ggml { packed, backend } => (packed, *backend),
        };
        let (rows, k) = (packed.rows(), packed.k());
        if !x.quantized {
            act.quantize_with(backend, x.x, k).map_err(|e| Error::Shape(e.to_string()))?;
            x.quantized = true;
        }
        t.resize(rows * n, 0.0);
        let (groups, per_task) = (packed.groups(), ROWS_PER_TASK / weights::GROUP);
        t.par_chunks_mut(ROWS_PER_TASK * n)
            .enumerate()
            .try_for_each(|(i, o)| {
                let range = i * per_task..((i + 1) * per_task).min(groups);
                weights::matmul_packed(backend, packed, range, act, o)
            })
            .map_err(|e| Error::Shape(e.to_string()))?;
        // Back to token-major rows, a few tokens per task: each weight row's outputs for
        // them are read together, written into as many output rows.
        const TOKENS: usize = 16;
        let t = &*t;
        let transpose = |(i, o): (usize, &mut [f32])| {
            let first = i * TOKENS;
            let m = o.len() / rows;
            for (r, col) in t.chunks_exact(n).enumerate() {
                for (j, &v) in col[first..first + m].iter().enumerate() {
                    o[j * rows + r] = v;
                }
            }
        };
        if n > TOKENS {
            out[..n * rows].par_chunks_mut(TOKENS * rows).enumerate().for_each(transpose);
        } else {
            transpose((0, &mut out[..n * rows]));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    bias: Option<[Vec<f32>; 3]>,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A Llama-family decoder loaded from GGUF; see the [module docs](self).
#[derive(Debug)]
pub struct LlamaModel {
    config: LlamaConfig,
    /// `[vocab, hidden]`, dequantized.
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: Linear,
    rope: Rope,
    weight_types: Vec<(String, usize)>,
}

/// How the weight matrices are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Weights {
    /// As stored: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K through kvq's integer
    /// kernels, Q2_K and Q3_K through candle's quantized matmuls. Fast and small, but each
    /// activation row is rounded to 8 bits per block of 32 before the integer dot products (as
    /// in ggml), so a one-ulp change upstream (another cache's attention output) can flip a
    /// rounding: two runs that differ only in their KV cache then differ by noise that has
    /// nothing to do with it.
    #[default]
    Native,
    /// Every matrix dequantized to f32 at load (4 bytes per weight): the model's function is
    /// smooth in its inputs, so differences between caches are the caches' own. What
    /// `kvq-eval` uses by default.
    F32,
}

/// Reads tensors from a GGUF after checking their shape, type and extent in the file.
struct Loader<'a, R> {
    ct: &'a gguf_file::Content,
    reader: &'a mut R,
    file_len: u64,
    types: HashMap<String, usize>,
    weights: Weights,
    backend: Kernels,
}

impl<R: Read + Seek> Loader<'_, R> {
    fn get(&mut self, name: &str, dims: &[usize]) -> Result<candle_core::quantized::QTensor> {
        let info = self.ct.tensor_infos.get(name).ok_or_else(|| bad(format!("no tensor {name}")))?;
        if info.shape.dims() != dims {
            return Err(bad(format!("{name} is {:?}, expected {dims:?}", info.shape.dims())));
        }
        let dtype = info.ggml_dtype;
        if !SUPPORTED.contains(&dtype) {
            return Err(Error::Unsupported(format!("{name} is stored as {dtype:?}")));
        }
        let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = elems
            .filter(|e| e.is_multiple_of(dtype.block_size()))
            .and_then(|e| (e / dtype.block_size()).checked_mul(dtype.type_size()))
            .ok_or_else(|| bad(format!("{name}: {dims:?} does not fit {dtype:?} blocks")))?;
        let end =
            self.ct.tensor_data_offset.checked_add(info.offset).and_then(|s| s.checked_add(bytes as u64));
        if end.is_none_or(|e| e > self.file_len) {
            return Err(bad(format!(
                "{name}: its {bytes} bytes run past the end of the file ({} bytes)",
                self.file_len
            )));
        }
        *self.types.entry(format!("{dtype:?}")).or_default() += 1;
        Ok(self.ct.tensor(self.reader, name, &Device::Cpu)?)
    }

    fn matmul(&mut self, name: &str, dims: &[usize]) -> Result<Linear> {
        let q = self.get(name, dims)?;
        let ggml = match q.dtype() {
            GgmlDType::Q4_0 => Some(GgmlType::Q4_0),
            GgmlDType::Q4_1 => Some(GgmlType::Q4_1),
            GgmlDType::Q8_0 => Some(GgmlType::Q8_0),
            GgmlDType::Q5_0 => Some(GgmlType::Q5_0),
            GgmlDType::Q5_1 => Some(GgmlType::Q5_1),
            GgmlDType::Q4K => Some(GgmlType::Q4K),
            GgmlDType::Q5K => Some(GgmlType::Q5K),
            GgmlDType::Q6K => Some(GgmlType::Q6K),
            _ => None,
        };
        // candle's switch to dequantize every weight at load (what the cross-checks against
        // candle-transformers set) holds here too.
        let dequantize_all = std::env::var("CANDLE_DEQUANTIZE_ALL").is_ok_and(|v| !v.is_empty() && v != "0");
        match (self.weights, ggml, dims) {
            (Weights::Native, Some(ty), &[rows, k])
                if k.is_multiple_of(ty.block_values()) && !dequantize_all =>
            {
                let bytes = q.data()?;
                let packed =
                    PackedWeights::new(ty, &bytes, rows, k).map_err(|e| bad(format!("{name}: {e}")))?;
                Ok(Linear::Ggml { packed, backend: self.backend })
            }
            (Weights::Native, _, _) => Ok(Linear::Candle(QMatMul::from_qtensor(q)?)),
            (Weights::F32, _, _) => Ok(Linear::Candle(QMatMul::Tensor(q.dequantize(&Device::Cpu)?))),
        }
    }

    fn dense(&mut self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        to_f32_vec(&self.get(name, dims)?.dequantize(&Device::Cpu)?)
    }
}

impl LlamaModel {
    /// Loads a GGUF file.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened; [`Error::Model`] for a malformed or
    /// truncated file; [`Error::Unsupported`] for what this crate does not implement.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_with(path, Weights::Native)
    }

    /// Loads a GGUF file, multiplying its weights as `weights` says.
    ///
    /// # Errors
    /// As [`LlamaModel::load`].
    pub fn load_with(path: impl AsRef<Path>, weights: Weights) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io = |source| Error::Io { path: name.clone(), source };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(Error::Model { path: name, reason: "not a regular file".into() });
        }
        let mut file = std::io::BufReader::new(std::fs::File::open(path).map_err(io)?);
        Self::read(&mut file, weights).map_err(|e| match e {
            Error::Model { reason, .. } => Error::Model { path: name.clone(), reason },
            Error::Candle(c) => Error::Model { path: name.clone(), reason: crate::error::candle_message(&c) },
            other => other,
        })
    }

    /// Loads a model from a GGUF stream, multiplying its weights as `weights` says.
    ///
    /// # Errors
    /// As [`LlamaModel::load`].
    pub fn read<R: Read + Seek>(reader: &mut R, weights: Weights) -> Result<Self> {
        let file_len = reader
            .seek(std::io::SeekFrom::End(0))
            .map_err(|source| Error::Io { path: "<reader>".into(), source })?;
        // Checked before candle's parser reads it (see `crate::gguf`).
        crate::gguf::check(reader, file_len)?;
        reader
            .seek(std::io::SeekFrom::Start(0))
            .map_err(|source| Error::Io { path: "<reader>".into(), source })?;
        let ct = gguf_file::Content::read(reader)?;
        let config = LlamaConfig::from_gguf(&ct)?;
        let c = &config;
        let backend = kvq::attention::selected_backend().map_err(|e| Error::Unsupported(e.to_string()))?;
        let mut ld = Loader { ct: &ct, reader, file_len, types: HashMap::new(), weights, backend };
        let embed = ld.dense("token_embd.weight", &[c.vocab, c.hidden])?;
        let norm = ld.dense("output_norm.weight", &[c.hidden])?;
        let output = if ct.tensor_infos.contains_key("output.weight") {
            ld.matmul("output.weight", &[c.vocab, c.hidden])?
        } else {
            ld.matmul("token_embd.weight", &[c.vocab, c.hidden])?
        };
        let (qd, kd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let bias = if ct.tensor_infos.contains_key(&p("attn_q.bias")) {
                Some([
                    ld.dense(&p("attn_q.bias"), &[qd])?,
                    ld.dense(&p("attn_k.bias"), &[kd])?,
                    ld.dense(&p("attn_v.bias"), &[kd])?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: ld.dense(&p("attn_norm.weight"), &[c.hidden])?,
                q: ld.matmul(&p("attn_q.weight"), &[qd, c.hidden])?,
                k: ld.matmul(&p("attn_k.weight"), &[kd, c.hidden])?,
                v: ld.matmul(&p("attn_v.weight"), &[kd, c.hidden])?,
                o: ld.matmul(&p("attn_output.weight"), &[c.hidden, qd])?,
                bias,
                ffn_norm: ld.dense(&p("ffn_norm.weight"), &[c.hidden])?,
                gate: ld.matmul(&p("ffn_gate.weight"), &[c.ffn, c.hidden])?,
                up: ld.matmul(&p("ffn_up.weight"), &[c.ffn, c.hidden])?,
                down: ld.matmul(&p("ffn_down.weight"), &[c.hidden, c.ffn])?,
            });
        }
        let mut weight_types: Vec<_> = ld.types.into_iter().collect();
        weight_types.sort();
        let rope = Rope::new(c.head_dim, c.rope_theta, c.rope_pairing);
        Ok(Self { config, embed, layers, norm, output, rope, weight_types })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// How many weight tensors of each type the file held (`"Q4_1"`, `"F32"`, ...).
    pub fn weight_types(&self) -> &[(String, usize)] {
        &self.weight_types
    }

    /// A plain f32 cache for this model (the reference).
    ///
    /// # Errors
    /// Never for a loaded model; the signature follows [`crate::F32Cache::new`].
    pub fn f32_cache(&self) -> Result<crate::F32Cache> {
        let c = &self.config;
        crate::F32Cache::new(c.layers, c.kv_heads, c.heads, c.head_dim)
    }

    /// Runs `tokens` through the model after what `store` already holds (a prefill when it is
    /// empty, a decode step for one token), appending their keys and values to every layer.
    /// Returns the logits of every position, `[tokens, vocab]`.
    ///
    /// Input, the store's layers and its capacity ([`KvStore::check_capacity`]) are checked
    /// before anything is appended, so a refused call leaves the store as it was. An error
    /// from the store in mid-pass (a non-finite value the quantizer refuses) is followed by
    /// an attempt to cut the store back to its length before the call ([`KvStore::truncate`]).
    ///
    /// # Errors
    /// [`Error::Token`] for an id outside the vocabulary, [`Error::Shape`] for an empty input
    /// or a store whose layers are out of step, [`Error::NonFinite`] when the model's values
    /// overflow; the store's errors (a full pool).
    pub fn forward(&self, store: &mut dyn KvStore, tokens: &[u32]) -> Result<Tensor> {
        let c = &self.config;
        self.check_tokens(tokens)?;
        let start = store.len(0);
        if let Some(l) = (1..c.layers).find(|&l| store.len(l) != start) {
            return Err(Error::Shape(format!(
                "the store holds {start} tokens in layer 0 and {} in layer {l}",
                store.len(l)
            )));
        }
        store.check_capacity(tokens.len())?;
        let (n, qd, kd) = (tokens.len(), c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut b = Buffers::default();
        b.positions.extend(start..start + n);
        let mut attend = |l: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]| -> Result<()> {
            for t in 0..n {
                store.append(l, &k[t * kd..(t + 1) * kd], &v[t * kd..(t + 1) * kd])?;
                store.attention(l, &q[t * qd..(t + 1) * qd], &mut out[t * qd..(t + 1) * qd])?;
            }
            Ok(())
        };
        let result = self.run_layers(&mut b, tokens, &mut attend);
        if result.is_err() {
            // Best effort: the error is what the caller needs; a store that cannot be cut
            // back says so on its next call (layers out of step).
            let _ = store.truncate(start);
        }
        result?;
        b.selected.extend(0..n);
        let mut logits = Vec::new();
        self.logits(&mut b, &mut logits)?;
        Ok(Tensor::from_vec(logits, (n, c.vocab), &Device::Cpu)?)
    }

    /// One step of continuous batching on kvq's cache: every entry of `batch` brings new
    /// tokens of its sequence (one to decode, or a chunk of a prompt), and the whole step runs
    /// as one pass: each projection and the MLP are one matrix product over all of the
    /// step's tokens (the weights are read once per step, not once per sequence), and each
    /// layer's attention is one [`QuantizedKvCache::attention_batch`] call over the batch per
    /// round (below). Returns the logits of the last token of every entry whose
    /// [`StepSeq::logits`] is set, in batch order, `vocab` values each.
    ///
    /// The result is the one the tokens would get one at a time: a token attends over the
    /// cache as it was right after its own keys and values were appended. The cache changes
    /// what older tokens see only when a block is quantized, so a prompt chunk is cut before
    /// each token that completes a block (rounds), and the tokens of one round append
    /// together and then attend causally together. Prefilling a prompt in chunks of any size
    /// therefore leaves the same cache and gives the same logits (up to floating-point
    /// association), which the prefix cache of a server relies on.
    ///
    /// Once `ws` and the cache have served steps as large, a decode step allocates nothing on
    /// the heap when its matrices are ones kvq's kernels multiply (Q4_0, Q4_1, Q8_0; candle's,
    /// for other types and under [`Weights::F32`], allocate their results), it runs on a
    /// worker of a rayon pool ([`rayon::ThreadPool::install`]; from outside, rayon's injector
    /// allocates a block of its queue every 63 parallel calls), and no sequence completes a
    /// block (quantizing one still allocates its parameters, a few KiB per layer).
    ///
    /// Nothing is appended when a check fails (ids, distinct sequences of equal length in
    /// every layer, room in the pool); a failure in mid-pass cuts every sequence back to its
    /// length before the call.
    ///
    /// ```
    /// use kvq::cache::QuantizedKvCache;
    /// use kvq_candle::model::{StepOptions, StepSeq, StepWorkspace};
    /// use kvq_candle::tiny::TinyModel;
    ///
    /// let (model, _tokenizer) = TinyModel::default().load()?;
    /// let mut cache = QuantizedKvCache::new(model.config().cache_builder().build()?)?;
    /// let (a, b) = (cache.create(), cache.create());
    /// let mut ws = StepWorkspace::new();
    /// let options = StepOptions::default();
    /// // Prefill two prompts in one step, then decode both in one step.
    /// let batch = [StepSeq::new(a, &[0, 72, 105]), StepSeq::new(b, &[0, 33])];
    /// let vocab = model.config().vocab;
    /// let logits = model.step(&mut cache, &batch, &options, &mut ws)?;
    /// assert_eq!(logits.len(), 2 * vocab);
    /// let logits = model.step(&mut cache, &[StepSeq::new(a, &[7]), StepSeq::new(b, &[9])], &options, &mut ws)?;
    /// assert_eq!(logits.len(), 2 * vocab);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Shape`] for an empty batch or entry, a sequence twice or with layers out of
    /// step; [`Error::Token`]; [`Error::NonFinite`]; the cache's errors (an unknown sequence,
    /// a full pool).
    pub fn step<'w>(
        &self,
        cache: &mut QuantizedKvCache,
        batch: &[StepSeq<'_>],
        options: &StepOptions,
        ws: &'w mut StepWorkspace,
    ) -> Result<&'w [f32]> {
        let c = &self.config;
        if batch.is_empty() {
            return Err(Error::Shape("an empty batch".into()));
        }
        ws.starts.clear();
        for (i, e) in batch.iter().enumerate() {
            self.check_tokens(e.tokens)?;
            if batch[..i].iter().any(|o| o.seq == e.seq) {
                return Err(Error::Shape(format!("sequence {:?} twice in one step", e.seq)));
            }
            let start = cache.len(e.seq, 0)?;
            for l in 1..c.layers {
                let len = cache.len(e.seq, l)?;
                if len != start {
                    return Err(Error::Shape(format!(
                        "sequence {:?} holds {start} tokens in layer 0 and {len} in layer {l}",
                        e.seq
                    )));
                }
            }
            cache.check_capacity(e.seq, e.tokens.len())?;
            ws.starts.push(start);
        }
        let StepWorkspace { buffers: b, rounds, starts, logits } = ws;
        b.positions.clear();
        b.tokens.clear();
        for (e, &start) in batch.iter().zip(starts.iter()) {
            b.positions.extend(start..start + e.tokens.len());
            b.tokens.extend_from_slice(e.tokens);
        }
        let tokens = std::mem::take(&mut b.tokens);
        let dims = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let geometry = (cache.config().sink_tokens, cache.config().block_size);
        let result = {
            let cache = &mut *cache;
            // Both ways cut a chunk before each token that completes a block; under
            // `Prefill::Exact` its tokens then attend token by token.
            let attention = options.attention.token_by_token(options.prefill == Prefill::Exact);
            let mut attend = |l: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]| {
                rounds.attend(cache, &attention, l, batch, starts, geometry, (q, k, v), out, dims)
            };
            self.run_layers(b, &tokens, &mut attend)
        };
        b.tokens = tokens;
        if let Err(e) = result {
            for (e, &start) in batch.iter().zip(starts.iter()) {
                // Best effort, as in `forward`.
                let _ = cache.truncate(e.seq, start);
            }
            return Err(e);
        }
        b.selected.clear();
        let mut row = 0;
        for e in batch {
            row += e.tokens.len();
            if e.logits {
                b.selected.push(row - 1);
            }
        }
        self.logits(b, logits)?;
        Ok(logits)
    }

    /// Checks a pass's token ids.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Shape("no tokens".into()));
        }
        let vocab = self.config.vocab;
        match tokens.iter().enumerate().find(|&(_, &t)| t as usize >= vocab) {
            Some((position, &token)) => Err(Error::Token { token, position, vocab }),
            None => Ok(()),
        }
    }

    /// Runs `tokens` (at `b.positions`) through every layer, `attend` appending each layer's
    /// keys and values and writing its attention; leaves the last hidden states in `b.x`.
    fn run_layers(&self, b: &mut Buffers, tokens: &[u32], attend: &mut Attend<'_>) -> Result<()> {
        let c = &self.config;
        let (n, hd, ffn) = (tokens.len(), c.hidden, c.ffn);
        let (qd, kd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        b.x.clear();
        for &t in tokens {
            b.x.extend_from_slice(&self.embed[t as usize * hd..(t as usize + 1) * hd]);
        }
        b.rope.clear();
        for &p in &b.positions {
            self.rope.push_table(p, &mut b.rope);
        }
        let half = c.head_dim / 2;
        for (buf, len) in [
            (&mut b.h, n * hd),
            (&mut b.q, n * qd),
            (&mut b.k, n * kd),
            (&mut b.v, n * kd),
            (&mut b.attn, n * qd),
        ] {
            buf.resize(len, 0.0);
        }
        b.gate.resize(n * ffn, 0.0);
        b.up.resize(n * ffn, 0.0);
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&b.x, &layer.attn_norm, c.rms_eps, &mut b.h);
            finite(&b.h, hd, l, &b.positions)?;
            let mut input = Input::new(&b.h, n);
            layer.q.forward_into(&mut input, &mut b.q, &mut b.act, &mut b.t)?;
            layer.k.forward_into(&mut input, &mut b.k, &mut b.act, &mut b.t)?;
            layer.v.forward_into(&mut input, &mut b.v, &mut b.act, &mut b.t)?;
            if let Some([bq, bk, bv]) = &layer.bias {
                for (out, bias) in [(&mut b.q, bq), (&mut b.k, bk), (&mut b.v, bv)] {
                    for row in out.chunks_exact_mut(bias.len()) {
                        row.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
                    }
                }
            }
            for t in 0..n {
                let table = &b.rope[t * half..(t + 1) * half];
                self.rope.apply(&mut b.q[t * qd..(t + 1) * qd], table);
                self.rope.apply(&mut b.k[t * kd..(t + 1) * kd], table);
            }
            // Non-finite values stop the pass here, named by layer and position, before the
            // cache refuses them (or a softmax turns them into NaN).
            for (buf, width) in [(&b.q, qd), (&b.k, kd), (&b.v, kd)] {
                finite(buf, width, l, &b.positions)?;
            }
            attend(l, &b.q, &b.k, &b.v, &mut b.attn)?;
            finite(&b.attn, qd, l, &b.positions)?;
            layer.o.forward_into(&mut Input::new(&b.attn, n), &mut b.h, &mut b.act, &mut b.t)?;
            b.x.iter_mut().zip(&b.h).for_each(|(x, h)| *x += h);
            rms_norm(&b.x, &layer.ffn_norm, c.rms_eps, &mut b.h);
            finite(&b.h, hd, l, &b.positions)?;
            let mut input = Input::new(&b.h, n);
            layer.gate.forward_into(&mut input, &mut b.gate, &mut b.act, &mut b.t)?;
            layer.up.forward_into(&mut input, &mut b.up, &mut b.act, &mut b.t)?;
            b.gate.iter_mut().zip(&b.up).for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
            finite(&b.gate, ffn, l, &b.positions)?;
            layer.down.forward_into(&mut Input::new(&b.gate, n), &mut b.h, &mut b.act, &mut b.t)?;
            b.x.iter_mut().zip(&b.h).for_each(|(x, h)| *x += h);
            finite(&b.x, hd, l, &b.positions)?;
        }
        Ok(())
    }

    /// The logits of the rows `b.selected` of the last hidden states, into `out`.
    fn logits(&self, b: &mut Buffers, out: &mut Vec<f32>) -> Result<()> {
        let c = &self.config;
        let (hd, m) = (c.hidden, b.selected.len());
        out.clear();
        if m == 0 {
            return Ok(());
        }
        b.t.clear();
        for &r in &b.selected {
            b.t.extend_from_slice(&b.x[r * hd..(r + 1) * hd]);
        }
        b.h.resize(m * hd, 0.0);
        rms_norm(&b.t, &self.norm, c.rms_eps, &mut b.h);
        out.resize(m * c.vocab, 0.0);
        self.output.forward_into(&mut Input::new(&b.h[..m * hd], m), out, &mut b.act, &mut b.t)?;
        // The output head, named as the layer after the last.
        match out.iter().position(|v| !v.is_finite()) {
            Some(i) => {
                Err(Error::NonFinite { layer: c.layers, position: b.positions[b.selected[i / c.vocab]] })
            }
            None => Ok(()),
        }
    }
}

/// What [`LlamaModel::run_layers`] calls in each layer: append the keys and values of the
/// pass's tokens and write their attention (`layer, q, k, v, out`).
type Attend<'a> = dyn FnMut(usize, &[f32], &[f32], &[f32], &mut [f32]) -> Result<()> + 'a;

/// One sequence's part of a [`LlamaModel::step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSeq<'a> {
    /// The sequence, created in the cache.
    pub seq: SeqId,
    /// Its new tokens: one to decode, or a chunk of its prompt.
    pub tokens: &'a [u32],
    /// Whether the step returns the logits of its last token (not for a prompt chunk that
    /// more chunks follow).
    pub logits: bool,
}

impl<'a> StepSeq<'a> {
    /// `tokens` of `seq`, with the logits of the last one.
    pub fn new(seq: SeqId, tokens: &'a [u32]) -> Self {
        Self { seq, tokens, logits: true }
    }

    /// `tokens` of `seq`, without logits: a chunk of a prompt that more chunks follow.
    pub fn chunk(seq: SeqId, tokens: &'a [u32]) -> Self {
        Self { seq, tokens, logits: false }
    }
}

/// How a [`LlamaModel::step`] attends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOptions {
    /// The cache's attention options (score path, scale, window, soft cap).
    pub attention: AttentionOptions,
    /// How prompt chunks attend.
    pub prefill: Prefill,
}

impl StepOptions {
    /// The default options on `path`.
    pub fn with_path(path: kvq::attention::ScorePath) -> Self {
        Self { attention: AttentionOptions::with_path(path), ..Self::default() }
    }
}

/// How the tokens of a prompt chunk attend in a [`LlamaModel::step`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Prefill {
    /// The tokens of a chunk attend in one call per block of the chunk, each of them with
    /// the very arithmetic of its own decode step ([`AttentionOptions::token_by_token`]), so
    /// a prompt prefilled in chunks of any size, alone or beside others, gives the same cache
    /// and logits to the bit (on kvq's GGML kernels), what an exact prefix cache needs.
    #[default]
    Exact,
    /// The tokens of a chunk attend together, cut only where a block is quantized (the
    /// cache a token sees is still the one it would see alone): the query rows of the
    /// chunk's tokens go through the kernels together. The causal kernels sum in another order
    /// than a decode step's, so results match [`Prefill::Exact`] to float association (and
    /// the 8-bit rounding of the activations that follows), not to the bit.
    Chunked,
}

/// The buffers of [`LlamaModel::step`], kept across steps (see its allocation note).
#[derive(Debug, Default)]
pub struct StepWorkspace {
    buffers: Buffers,
    rounds: Rounds,
    starts: Vec<usize>,
    logits: Vec<f32>,
}

impl StepWorkspace {
    /// An empty workspace; the first step sizes it.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The activations of a pass, row-major over its tokens.
#[derive(Debug, Default)]
struct Buffers {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    /// Rows whose logits are wanted.
    selected: Vec<usize>,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// A matrix product's transposed result, or rows gathered for the logits.
    t: Vec<f32>,
    act: Activations,
    rope: Vec<(f32, f32)>,
}

/// The attention of a [`LlamaModel::step`], in rounds.
#[derive(Debug, Default)]
struct Rounds {
    decode: DecodeWorkspace,
    batch: Vec<BatchSeq>,
    /// Per entry: tokens appended in this layer so far.
    cursor: Vec<usize>,
    /// Per round entry: its first row in the step, its rows.
    rows: Vec<(usize, usize)>,
    q: Vec<f32>,
    out: Vec<f32>,
}

impl Rounds {
    /// Appends the keys and values of every entry's tokens to `layer` and writes their
    /// attention into `out`, round by round: a round takes each entry's tokens up to (not
    /// including) the next one that completes a block (`geometry`: sink tokens, block size),
    /// appends them, and attends with all of them in one call.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        cache: &mut QuantizedKvCache,
        options: &AttentionOptions,
        layer: usize,
        batch: &[StepSeq<'_>],
        starts: &[usize],
        (sinks, block): (usize, usize),
        (q, k, v): (&[f32], &[f32], &[f32]),
        out: &mut [f32],
        (qd, kd): (usize, usize),
    ) -> Result<()> {
        // Where a round must end: before a token that completes the sinks or a block (the
        // cache changes what older tokens look like only then).
        let completes = |p: usize| p + 1 == sinks || (p >= sinks && (p - sinks + 1).is_multiple_of(block));
        self.cursor.clear();
        self.cursor.resize(batch.len(), 0);
        loop {
            self.batch.clear();
            self.rows.clear();
            let mut first = 0;
            for (i, e) in batch.iter().enumerate() {
                let (s, n) = (self.cursor[i], e.tokens.len());
                if s < n {
                    let mut end = s + 1;
                    while end < n && !completes(starts[i] + end) {
                        end += 1;
                    }
                    for r in first + s..first + end {
                        cache.append(e.seq, layer, &k[r * kd..(r + 1) * kd], &v[r * kd..(r + 1) * kd])?;
                    }
                    self.batch.push(BatchSeq { seq: e.seq, tokens: end - s });
                    self.rows.push((first + s, end - s));
                    self.cursor[i] = end;
                }
                first += n;
            }
            if self.batch.is_empty() {
                return Ok(());
            }
            self.q.clear();
            for &(r, n) in &self.rows {
                self.q.extend_from_slice(&q[r * qd..(r + n) * qd]);
            }
            self.out.resize(self.q.len(), 0.0);
            cache.attention_batch(options, layer, &self.batch, &self.q, &mut self.out, &mut self.decode)?;
            let mut at = 0;
            for &(r, n) in &self.rows {
                out[r * qd..(r + n) * qd].copy_from_slice(&self.out[at..at + n * qd]);
                at += n * qd;
            }
        }
    }
}

/// The input of one or more matrix products: rows of `k` values, rounded to 8 bits for kvq's
/// kernels once, by the first product that needs it.
struct Input<'a> {
    x: &'a [f32],
    n: usize,
    quantized: bool,
}

impl<'a> Input<'a> {
    fn new(x: &'a [f32], n: usize) -> Self {
        Self { x, n, quantized: false }
    }
}

/// [`Error::NonFinite`] for the first non-finite value of `buf` (rows of `width` values, at
/// `positions`), in `layer`.
fn finite(buf: &[f32], width: usize, layer: usize, positions: &[usize]) -> Result<()> {
    match buf.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::NonFinite { layer, position: positions[i / width] }),
        None => Ok(()),
    }
}

/// RMSNorm of each row of `x` (rows of `w.len()` values) into `out`, in f32.
fn rms_norm(x: &[f32], w: &[f32], eps: f64, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let inv = 1.0 / (ms + eps as f32).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(w) {
            *o = v * inv * w;
        }
    }
}
