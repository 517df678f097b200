//! Mutation fuzzing of every loader and parser of kvq, on stable Rust.
//!
//! A [`Target`] is one input surface: safetensors K/V/Q files, cache configs in TOML and JSON,
//! calibration JSON, whole-cache and one-sequence offload files, GGUF models and token files.
//! [`Target::run`] parses an input the way kvq does and, when it is accepted, uses it as a
//! user would (analyses it, appends to and attends over the cache it describes, writes it
//! again and reads that back): a refusal is an `Err` with the typed error's message, a bug is
//! a panic (or, in the `kvq-fuzz` binary, an abort or a hang). [`mutate`] makes new inputs
//! from a corpus: byte-level edits, interesting integers, and for text formats numbers swapped
//! for extreme ones; offload files get their checksum (and header length) recomputed, so that
//! mutations reach the parser behind the CRC.
//!
//! ```
//! use kvq_fuzz::Target;
//! for target in Target::ALL {
//!     for seed in target.seeds() {
//!         target.run(&seed).expect("every seed is a valid input");
//!     }
//! }
//! ```

use std::io::Cursor;
use std::path::{Path, PathBuf};

pub mod cli;
pub mod gguf_fields;

use kvq::analysis::{self, KvSpec, Options};
use kvq::layout::{CacheConfig, PagedCache, SeqId};
use kvq::prelude::*;
use kvq::quant::io::TensorFile;
use kvq::quant::synth::Rng;

/// One input surface of kvq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// `TensorFile` and the analysis and calibration behind `kvq analyze` / `kvq calibrate`.
    Safetensors,
    /// `KvCacheConfig::from_toml`, then a `QuantizedKvCache` of that config.
    ConfigToml,
    /// `KvCacheConfig::from_json`, then a `QuantizedKvCache` of that config.
    ConfigJson,
    /// Calibration JSON, then a cache with per-head static specs that uses it.
    Calibration,
    /// `PagedCache::from_bytes` (a whole offloaded cache).
    OffloadCache,
    /// `PagedCache::import_sequence` (one offloaded sequence) into a cache of the seed's config.
    OffloadSeq,
    /// `QuantizedKvCache::import_sequence` (one sequence of every layer) into a cache of the
    /// seed's config.
    KvqSeq,
    /// `LlamaModel::read` and `GgufTokenizer::from_gguf` on GGUF bytes.
    Gguf,
    /// `kvq_candle::eval::input_ids` (the token files of `kvq-eval --tokens`).
    Tokens,
    /// A command line of `kvq` or `kvq-eval` with the files it names, run in process
    /// ([`cli`]).
    Cli(cli::Command),
}

/// What a run of one input gave: `Ok` when it was accepted and used, `Err` with the reason
/// it was refused.
pub type Outcome = Result<(), String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 13] = [
        Target::Safetensors,
        Target::ConfigToml,
        Target::ConfigJson,
        Target::Calibration,
        Target::OffloadCache,
        Target::OffloadSeq,
        Target::KvqSeq,
        Target::Gguf,
        Target::Tokens,
        Target::Cli(cli::Command::Analyze),
        Target::Cli(cli::Command::Recommend),
        Target::Cli(cli::Command::Calibrate),
        Target::Cli(cli::Command::Eval),
    ];

    /// The target's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Target::Safetensors => "safetensors",
            Target::ConfigToml => "config-toml",
            Target::ConfigJson => "config-json",
            Target::Calibration => "calibration",
            Target::OffloadCache => "offload-cache",
            Target::OffloadSeq => "offload-seq",
            Target::KvqSeq => "kvq-seq",
            Target::Gguf => "gguf",
            Target::Tokens => "tokens",
            Target::Cli(cli::Command::Analyze) => "cli-analyze",
            Target::Cli(cli::Command::Recommend) => "cli-recommend",
            Target::Cli(cli::Command::Calibrate) => "cli-calibrate",
            Target::Cli(cli::Command::Eval) => "cli-eval",
        }
    }

    /// The target called `name`.
    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Whether inputs are text (numbers in them are worth mutating as numbers).
    fn is_text(self) -> bool {
        matches!(self, Target::ConfigToml | Target::ConfigJson | Target::Calibration)
    }

    /// Where the regression inputs of this target live: beside the tests of the crate that
    /// owns the loader.
    pub fn regression_dir(self) -> PathBuf {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("crates/").to_path_buf();
        let owner = match self {
            Target::Safetensors | Target::ConfigToml | Target::ConfigJson | Target::KvqSeq => "kvq",
            Target::Cli(cli::Command::Eval) => "candle",
            Target::Cli(_) => "kvq",
            Target::Calibration => "quant-core",
            Target::OffloadCache | Target::OffloadSeq => "cache-layout",
            Target::Gguf | Target::Tokens => "candle",
        };
        crates.join(owner).join("tests/regressions").join(self.name())
    }

    /// The committed regression inputs (found by fuzzing or by hand), sorted by name.
    pub fn regressions(self) -> Vec<(PathBuf, Vec<u8>)> {
        let Ok(dir) = std::fs::read_dir(self.regression_dir()) else { return Vec::new() };
        let mut out: Vec<(PathBuf, Vec<u8>)> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .filter_map(|p| std::fs::read(&p).ok().map(|b| (p, b)))
            .collect();
        out.sort();
        out
    }

    /// Valid inputs to start from, made here (so they follow the formats as this build
    /// writes them).
    pub fn seeds(self) -> Vec<Vec<u8>> {
        match self {
            Target::Safetensors => vec![tensor_file(2, 1, 24, 8), tensor_file(4, 2, 40, 16)],
            Target::ConfigToml => seed_configs().iter().map(|c| c.to_toml().into_bytes()).collect(),
            Target::ConfigJson => seed_configs().iter().map(|c| c.to_json().into_bytes()).collect(),
            Target::Calibration => {
                let cal = seed_calibration();
                vec![serde_json::to_vec(&cal).expect("serializes")]
            }
            Target::OffloadCache => seed_caches().iter().map(|c| c.to_bytes().expect("writes")).collect(),
            Target::OffloadSeq => {
                let (cache, seq) = filled(seq_config(), 9);
                vec![cache.export_sequence(seq).expect("writes")]
            }
            Target::KvqSeq => {
                let (cache, seq) = facade_cache(21);
                vec![cache.export_sequence(seq).expect("writes")]
            }
            Target::Gguf => vec![tiny_gguf(), tiny_model_gguf()],
            Target::Tokens => {
                vec![token_file(safetensors::Dtype::I64, 12), token_file(safetensors::Dtype::U32, 5)]
            }
            Target::Cli(c) => c.seeds().iter().map(cli::Case::to_bytes).collect(),
        }
    }

    /// Parses `input` as kvq does and, when it is accepted, uses it.
    ///
    /// # Errors
    /// The refusal, as the typed error's message.
    pub fn run(self, input: &[u8]) -> Outcome {
        match self {
            Target::Safetensors => run_safetensors(input),
            Target::ConfigToml => {
                let text = std::str::from_utf8(input).map_err(err)?;
                let c = KvCacheConfig::from_toml(text).map_err(err)?;
                assert_eq!(KvCacheConfig::from_toml(&c.to_toml()).expect("reads back"), c, "TOML round trip");
                use_config(&c)
            }
            Target::ConfigJson => {
                let text = std::str::from_utf8(input).map_err(err)?;
                let c = KvCacheConfig::from_json(text).map_err(err)?;
                assert_eq!(KvCacheConfig::from_json(&c.to_json()).expect("reads back"), c, "JSON round trip");
                use_config(&c)
            }
            Target::Calibration => run_calibration(input),
            Target::OffloadCache => run_offload_cache(input),
            Target::OffloadSeq => run_offload_seq(input),
            Target::KvqSeq => run_kvq_seq(input),
            // Refusals name tensors and keys from the file (escaped): kept whole, every
            // made-up name would count as a new kind of outcome and churn the corpus.
            Target::Gguf => run_gguf(input).map_err(|e| cli::kind_of(&e)),
            Target::Tokens => kvq_candle::eval::input_ids(input).map(|_| ()),
            Target::Cli(c) => cli::run_case(c, input),
        }
    }
}

/// At most this many values are appended or analysed per accepted input, so that one input's
/// use stays within milliseconds whatever sizes it declares.
const WORK: usize = 1 << 16;

fn token(len: usize, t: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + t * 13) % 23) as f32 * 0.125 - 1.4).collect()
}

fn tensor_file(q_heads: usize, kv_heads: usize, tokens: usize, d: usize) -> Vec<u8> {
    let make = |heads: usize, seed: usize| -> Vec<u8> {
        (0..heads * tokens * d)
            .flat_map(|i| (((i * 31 + seed) % 97) as f32 / 40.0 - 1.2).to_le_bytes())
            .collect()
    };
    let (q, k, v) = (make(q_heads, 1), make(kv_heads, 2), make(kv_heads, 3));
    fn view(heads: usize, tokens: usize, d: usize, data: &[u8]) -> safetensors::tensor::TensorView<'_> {
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![heads, tokens, d], data)
            .expect("consistent")
    }
    let views = vec![
        ("layer0.q".to_string(), view(q_heads, tokens, d, &q)),
        ("layer0.k".to_string(), view(kv_heads, tokens, d, &k)),
        ("layer0.v".to_string(), view(kv_heads, tokens, d, &v)),
    ];
    safetensors::serialize(views, None).expect("serializes")
}

fn token_file(dtype: safetensors::Dtype, n: usize) -> Vec<u8> {
    let data: Vec<u8> = match dtype {
        safetensors::Dtype::I64 => (0..n as i64).flat_map(|i| (i * 5).to_le_bytes()).collect(),
        _ => (0..n as u32).flat_map(|i| (i * 3).to_le_bytes()).collect(),
    };
    let view = safetensors::tensor::TensorView::new(dtype, vec![1, n], &data).expect("consistent");
    safetensors::serialize(vec![("input_ids".to_string(), view)], None).expect("serializes")
}

fn run_safetensors(input: &[u8]) -> Outcome {
    let file = TensorFile::from_bytes("fuzz", input.to_vec()).map_err(err)?;
    let _ = file.list();
    let _ = file.metadata();
    let layers = analysis::layers_from_file(&file).map_err(err)?;
    // Analysis is the costliest use: a smaller budget keeps the loop at thousands of inputs
    // per second.
    let values: usize = layers.iter().map(|l| l.q.data().len() + 2 * l.k.data().len()).sum();
    if values > WORK / 8 {
        return Ok(());
    }
    let specs: Vec<KvSpec> = ["int4-channel/int4-token", "int2-g8", "fp8e4m3-token", "nf4-token"]
        .iter()
        .map(|s| KvSpec::parse(s).expect("valid"))
        .collect();
    let (specs, _) = analysis::applicable_specs(&layers, specs);
    let options = Options { positions: 2, per_head: true, histogram_bins: 4, ..Options::default() };
    let report = analysis::analyze("fuzz", &layers, &specs, &options, |_, _| {}).map_err(err)?;
    let _ = report.to_table();
    let k: Vec<Tensor> = layers.iter().map(|l| l.k.clone()).collect();
    let v: Vec<Tensor> = layers.iter().map(|l| l.v.clone()).collect();
    Calibration::from_tensors(&k, &v, Some(99.0)).map_err(err)?;
    Ok(())
}

/// Builds the cache a config describes, appends a few tokens to every layer, attends, and
/// truncates, as an engine would; sizes too large for the work budget are only built.
fn use_config(c: &KvCacheConfig) -> Outcome {
    let mut cache = QuantizedKvCache::new(c.clone()).map_err(err)?;
    let per_token = c.kv_heads * c.head_dim;
    let tokens = (WORK / (per_token * c.layers.len()).max(1)).min(3 * c.block_size + 2);
    let seq = cache.create();
    for t in 0..tokens {
        let (k, v) = (token(per_token, t), token(per_token, t + 1));
        for l in 0..c.layers.len() {
            cache.append(seq, l, &k, &v).map_err(err)?;
        }
    }
    if tokens > 0 && c.query_heads * c.head_dim <= WORK {
        let q = token(c.query_heads * c.head_dim, 3);
        let mut out = vec![0f32; q.len()];
        cache.attention(&AttentionOptions::default(), seq, 0, &q, &mut out).map_err(err)?;
        cache.attention(&AttentionOptions::with_path(ScorePath::Int8), seq, 0, &q, &mut out).map_err(err)?;
    }
    let fork = cache.fork(seq).map_err(err)?;
    let _ = cache.truncate(fork, tokens / 2);
    cache.free(fork).map_err(err)?;
    let _ = cache.used_bytes();
    Ok(())
}

fn seed_configs() -> Vec<KvCacheConfig> {
    let spec = |s: &str| s.parse::<QuantSpec>().expect("valid");
    vec![
        KvCacheConfig::builder(2, 2, 4, 8).block_size(4).blocks_per_layer(16).build().expect("valid"),
        KvCacheConfig::builder(1, 1, 2, 16)
            .block_size(8)
            .residual_blocks(0)
            .sink_tokens(1)
            .tail_dtype(kvq::layout::TailDtype::F32)
            .specs(spec("int2-channel-f32"), spec("nf4-token"))
            .blocks_per_layer(8)
            .build()
            .expect("valid"),
        KvCacheConfig::builder(2, 1, 1, 8)
            .block_size(4)
            .specs(spec("int4-head"), spec("int8-tensor"))
            .calibration(seed_calibration())
            .blocks_per_layer(8)
            .build()
            .expect("valid"),
        KvCacheConfig::builder(1, 1, 1, 8)
            .block_size(4)
            .specs(spec("int4-channel"), fixed_codebook())
            .blocks_per_layer(8)
            .build()
            .expect("valid"),
        // Rotated keys (each query rotated too) and rotated values.
        KvCacheConfig::builder(1, 1, 2, 16)
            .block_size(4)
            .specs(spec("int4-token-rot"), spec("int3-token-mse-rot-p8"))
            .blocks_per_layer(8)
            .build()
            .expect("valid"),
    ]
}

/// A 2-bit fixed codebook spec of values: files write its levels beside its text.
fn fixed_codebook() -> QuantSpec {
    use kvq::quant::{Codebook, CodebookSource, Granularity, Kind, ParamDtype};
    let levels = Codebook::new(vec![-1.0, -0.3, 0.25, 1.0]).expect("valid");
    QuantSpec::new(Kind::Codebook(CodebookSource::Fixed(levels)), 2, Granularity::PerToken, ParamDtype::F16)
        .expect("valid")
}

fn seed_calibration() -> Calibration {
    let shape = Shape::new(1, 6, 8);
    let t = |s: usize| Tensor::new(shape, token(shape.len(), s)).expect("consistent");
    Calibration::from_tensors(&[t(1), t(2)], &[t(3), t(4)], None).expect("valid")
}

fn run_calibration(input: &[u8]) -> Outcome {
    let cal: Calibration = serde_json::from_slice(input).map_err(err)?;
    let back: Calibration =
        serde_json::from_str(&serde_json::to_string(&cal).expect("writes")).expect("reads back");
    assert_eq!(back, cal, "calibration round trip");
    if cal
        .layers()
        .checked_mul(cal.heads())
        .and_then(|n| n.checked_mul(cal.head_dim()))
        .is_none_or(|n| n > WORK)
    {
        return Ok(());
    }
    let spec = |s: &str| s.parse::<QuantSpec>().expect("valid");
    let config = KvCacheConfig::builder(cal.layers(), cal.heads(), cal.heads(), cal.head_dim())
        .block_size(4)
        .blocks_per_layer(8)
        .specs(spec("int4-head"), spec("int4-channel"))
        .calibration(cal)
        .build()
        .map_err(err)?;
    use_config(&config)
}

/// The config of the one-sequence seed, and of the cache the `offload-seq` target imports
/// into (`regressions/offload-seq` holds files of this config).
fn seq_config() -> CacheConfig {
    let spec = |s: &str| s.parse::<QuantSpec>().expect("valid");
    CacheConfig::new(2, 2, 8, 48)
        .with_block_size(4)
        .with_specs(spec("int4-channel"), spec("int4-token"))
        .with_residual_blocks(1)
        .with_sink_tokens(2)
}

fn filled(c: CacheConfig, n: usize) -> (PagedCache, SeqId) {
    let mut cache = PagedCache::new(c.clone()).expect("valid");
    let seq = cache.create();
    let len = c.kv_heads * c.head_dim;
    for t in 0..n {
        for l in 0..c.layers {
            cache.append(seq, l, &token(len, t), &token(len, t + 2)).expect("fits");
        }
    }
    (cache, seq)
}

fn seed_caches() -> Vec<PagedCache> {
    let spec = |s: &str| s.parse::<QuantSpec>().expect("valid");
    let (mut a, s) = filled(seq_config(), 11);
    let f = a.fork(s).expect("live");
    a.append(f, 0, &token(16, 1), &token(16, 2)).expect("fits");
    let b = CacheConfig::new(1, 1, 8, 16)
        .with_block_size(4)
        .with_specs(spec("int8-token"), spec("int2-g4"))
        .with_tail_dtype(kvq::layout::TailDtype::F32);
    // Values waiting in an 8-bit window (rows of codes and a scale each).
    let c = CacheConfig::new(1, 2, 8, 16)
        .with_block_size(4)
        .with_residual_blocks(1)
        .with_sink_tokens(1)
        .with_specs(spec("int4-channel-p8"), spec("int4-token-p8"))
        .with_value_tail_dtype(kvq::layout::TailDtype::Int8);
    let d =
        CacheConfig::new(1, 1, 8, 16).with_block_size(4).with_specs(spec("int4-channel"), fixed_codebook());
    vec![a, filled(b, 6).0, filled(c, 7).0, filled(d, 9).0]
}

/// Appends to, forks, reads and re-writes a loaded cache; the re-written file must read back
/// as the same cache.
fn use_paged(cache: &mut PagedCache) -> Outcome {
    let c = cache.config().clone();
    let per_token = c.kv_heads * c.head_dim;
    let seqs: Vec<SeqId> = cache.sequences().take(4).collect();
    for s in seqs {
        for l in 0..c.layers.min(4) {
            let _ = cache.dequantize(s, l, 0, Part::K);
            let _ = cache.segments(s, l, 0, Part::V);
        }
        let f = cache.fork(s).map_err(err)?;
        let tokens = (WORK / (per_token * c.layers).max(1)).min(c.block_size + 1);
        for t in 0..tokens {
            for l in 0..c.layers {
                // A refusal (a full pool) changes nothing, and the next call still works: the
                // round trip below checks the state that is left.
                let _ = cache.append(f, l, &token(per_token, t), &token(per_token, t));
            }
        }
        let _ = cache.truncate(f, 1);
    }
    let _ = cache.memory();
    let bytes = cache.to_bytes().map_err(err)?;
    let back = PagedCache::from_bytes(&bytes).expect("a written cache reads back");
    assert!(back == *cache, "offload round trip");
    Ok(())
}

fn run_offload_cache(input: &[u8]) -> Outcome {
    let mut cache = PagedCache::from_bytes(input).map_err(err)?;
    let _ = cache.create();
    use_paged(&mut cache)
}

fn run_offload_seq(input: &[u8]) -> Outcome {
    let (mut cache, _) = filled(seq_config(), 3);
    let before = cache.clone();
    match cache.import_sequence(input) {
        Err(e) => {
            assert!(cache == before, "a refused import changed the cache");
            Err(err(e))
        }
        Ok(seq) => {
            let again = cache.export_sequence(seq).expect("writes");
            let id = cache.import_sequence(&again).expect("an exported sequence imports");
            assert_eq!(cache.dequantize(seq, 0, 0, Part::K).ok(), cache.dequantize(id, 0, 0, Part::K).ok());
            use_paged(&mut cache)
        }
    }
}

/// A facade cache of the first seed config with one sequence of `n` tokens.
fn facade_cache(n: usize) -> (QuantizedKvCache, SeqId) {
    let c = seed_configs().remove(0);
    let mut cache = QuantizedKvCache::new(c.clone()).expect("valid");
    let seq = cache.create();
    let per = c.layers.len() * c.kv_heads * c.head_dim;
    for t in 0..n {
        cache.append_all_layers(seq, &token(per, t), &token(per, t + 1)).expect("fits");
    }
    (cache, seq)
}

fn run_kvq_seq(input: &[u8]) -> Outcome {
    let (mut cache, _) = facade_cache(5);
    let free = cache.free_blocks();
    let seq = match cache.import_sequence(input) {
        Err(e) => {
            assert_eq!(cache.free_blocks(), free, "a refused import took blocks");
            return Err(err(e));
        }
        Ok(seq) => seq,
    };
    let c = cache.config().clone();
    let q = token(c.query_heads * c.head_dim, 1);
    let mut out = vec![0f32; q.len()];
    for l in 0..c.layers.len() {
        cache.attention(&AttentionOptions::default(), seq, l, &q, &mut out).map_err(err)?;
    }
    let again = cache.export_sequence(seq).expect("writes");
    cache.free(seq).map_err(err)?;
    let id = cache.import_sequence(&again).expect("an exported sequence imports where it was");
    let per = c.layers.len() * c.kv_heads * c.head_dim;
    cache.append_all_layers(id, &token(per, 2), &token(per, 3)).map_err(err)?;
    Ok(())
}

/// A tiny Llama (1 layer, 2 query heads and 1 KV head of 8 channels, 16 tokens of vocabulary)
/// in F32, written by candle's GGUF writer.
fn tiny_gguf() -> Vec<u8> {
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
    use candle_core::{Device, Tensor as T};
    let (hidden, heads, kv, d, ffn, vocab) = (16usize, 2usize, 1usize, 8usize, 32usize, 16usize);
    let mut seed = 0usize;
    let mut t = |dims: &[usize]| {
        let n: usize = dims.iter().product();
        seed += 1;
        let data = token(n, seed).iter().map(|x| x * 0.1).collect::<Vec<f32>>();
        QTensor::quantize(&T::from_vec(data, dims, &Device::Cpu).expect("shape"), GgmlDType::F32)
            .expect("f32")
    };
    let tensors = vec![
        ("token_embd.weight", t(&[vocab, hidden])),
        ("output_norm.weight", t(&[hidden])),
        ("output.weight", t(&[vocab, hidden])),
        ("blk.0.attn_norm.weight", t(&[hidden])),
        ("blk.0.ffn_norm.weight", t(&[hidden])),
        ("blk.0.attn_q.weight", t(&[heads * d, hidden])),
        ("blk.0.attn_k.weight", t(&[kv * d, hidden])),
        ("blk.0.attn_v.weight", t(&[kv * d, hidden])),
        ("blk.0.attn_output.weight", t(&[hidden, heads * d])),
        ("blk.0.ffn_gate.weight", t(&[ffn, hidden])),
        ("blk.0.ffn_up.weight", t(&[ffn, hidden])),
        ("blk.0.ffn_down.weight", t(&[hidden, ffn])),
    ];
    use gguf_file::Value as V;
    let md: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("llama.block_count", V::U32(1)),
        ("llama.embedding_length", V::U32(hidden as u32)),
        ("llama.feed_forward_length", V::U32(ffn as u32)),
        ("llama.attention.head_count", V::U32(heads as u32)),
        ("llama.attention.head_count_kv", V::U32(kv as u32)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("llama.rope.freq_base", V::F32(10_000.0)),
        ("llama.rope.dimension_count", V::U32(d as u32)),
        ("llama.context_length", V::U32(64)),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        ("tokenizer.ggml.tokens", V::Array((0..vocab).map(|i| V::String(format!("t{i}"))).collect())),
        ("tokenizer.ggml.merges", V::Array(vec![V::String("t 1".into())])),
        ("tokenizer.ggml.bos_token_id", V::U32(1)),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("writes");
    out.into_inner()
}

/// The tiny model of `kvq_candle::tiny` (Q8_0 weights, a byte-level BPE tokenizer, a chat
/// template): what the server's tests run on.
fn tiny_model_gguf() -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    kvq_candle::tiny::TinyModel::default().write_to(&mut out).expect("writes");
    out.into_inner()
}

fn run_gguf(input: &[u8]) -> Outcome {
    use kvq_candle::{GgufTokenizer, KvStore, LlamaModel, Weights};
    let model = LlamaModel::read(&mut Cursor::new(input), Weights::F32).map_err(err)?;
    let c = model.config();
    if c.hidden.checked_mul(c.vocab).is_some_and(|n| n <= WORK) {
        let mut store = model.f32_cache().map_err(err)?;
        model.forward(&mut store as &mut dyn KvStore, &[1, 2]).map_err(err)?;
    }
    if let Ok(ct) = candle_core::quantized::gguf_file::Content::read(&mut Cursor::new(input))
        && let Ok(tok) = GgufTokenizer::from_gguf(&ct)
    {
        let ids = tok.encode("t1 t2 123").map_err(err)?;
        let _ = tok.decode(&ids);
    }
    Ok(())
}

/// Interesting integers: boundaries of the widths files use.
const INTS: [u64; 14] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 62,
    (1 << 63) - 1,
    1 << 63,
    u64::MAX,
];

/// Interesting numbers in text.
const NUMBERS: [&str; 16] = [
    "0",
    "-1",
    "1",
    "65505",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "1099511627776",
    "1e400",
    "-1e400",
    "NaN",
    "inf",
    "1e-45",
    "0.5",
    "1073741824",
];

/// A mutated copy of `input` (`others`: the rest of the corpus, for splicing).
pub fn mutate(target: Target, rng: &mut Rng, input: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    // Half the time, a structure-aware edit of a checksummed file (which re-seals it).
    let structured = match target {
        Target::KvqSeq if rng.below(2) == 0 => mutate_kvq_seq_layer(rng, input),
        Target::OffloadCache | Target::OffloadSeq if input.len() > 21 && rng.below(2) == 0 => {
            Some(mutate_offload_parts(rng, input, others))
        }
        // One header field, metadata value, tensor dim, type or offset given a new value.
        // (A base whose structure no longer parses lends none: another corpus entry does.)
        Target::Gguf if rng.below(2) == 0 => gguf_fields::mutate(rng, input).or_else(|| {
            (0..4).find_map(|_| {
                let other = others.get(rng.below(others.len().max(1) as u64) as usize)?;
                gguf_fields::mutate(rng, other)
            })
        }),
        // Arguments and files edited as such (the case's own byte edits included).
        Target::Cli(c) => return cli::mutate_case(c, rng, input, others),
        _ => None,
    };
    if let Some(out) = structured {
        return out;
    }
    let mut out = edit(rng, input, others, target.is_text());
    // Splices and duplications grow inputs; past the size of any seed they only cost time.
    out.truncate(MAX_INPUT);
    let sealed = matches!(target, Target::OffloadCache | Target::OffloadSeq | Target::KvqSeq);
    if sealed && out.len() >= 4 && rng.below(4) != 0 {
        reseal(&mut out);
    }
    out
}

/// The longest input [`mutate`] makes.
pub const MAX_INPUT: usize = 1 << 16;

fn edit(rng: &mut Rng, input: &[u8], others: &[Vec<u8>], text: bool) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(if text { 2 } else { 4 }) {
        let pick = |rng: &mut Rng, n: usize| rng.below(n.max(1) as u64) as usize;
        // Text is mostly mutated as text (numbers, lines): byte edits rarely keep it parseable.
        let op = if text && rng.below(4) != 0 { 9 + rng.below(3) } else { rng.below(9) };
        match op {
            _ if v.is_empty() => v.push(rng.below(256) as u8),
            0 => {
                let i = pick(rng, v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = pick(rng, v.len());
                v[i] = rng.below(256) as u8;
            }
            2 => {
                let i = pick(rng, v.len());
                v[i] = [0u8, 1, 0x7f, 0x80, 0xff][pick(rng, 5)];
            }
            3 => {
                let x = INTS[pick(rng, INTS.len())];
                let bytes = if rng.below(2) == 0 {
                    x.to_le_bytes().to_vec()
                } else {
                    (x as u32).to_le_bytes().to_vec()
                };
                let i = pick(rng, v.len());
                for (j, b) in bytes.into_iter().enumerate() {
                    if let Some(slot) = v.get_mut(i + j) {
                        *slot = b;
                    }
                }
            }
            4 => {
                let i = pick(rng, v.len());
                let n = pick(rng, 16).min(v.len() - i);
                v.drain(i..i + n);
            }
            5 => {
                let i = pick(rng, v.len() + 1);
                let n = 1 + pick(rng, 8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
                v.splice(i..i, bytes);
            }
            6 => {
                let (a, b) = (pick(rng, v.len()), pick(rng, v.len()));
                let chunk = v[a.min(b)..a.max(b)].to_vec();
                let at = pick(rng, v.len() + 1);
                v.splice(at..at, chunk.into_iter().take(256));
            }
            7 if !others.is_empty() => {
                let other = &others[pick(rng, others.len())];
                let (a, b) = (pick(rng, v.len()), pick(rng, other.len()));
                v.truncate(a);
                v.extend_from_slice(&other[b..]);
            }
            8 => v.truncate(pick(rng, v.len())),
            // Text: a number replaced by an extreme one, a field duplicated, a token dropped.
            9 | 10 => {
                let digits: Vec<usize> = (0..v.len()).filter(|&i| v[i].is_ascii_digit()).collect();
                if let Some(&start) = digits.get(pick(rng, digits.len())) {
                    let mut end = start;
                    while end < v.len() && (v[end].is_ascii_digit() || v[end] == b'.') {
                        end += 1;
                    }
                    let mut s = start;
                    while s > 0 && (v[s - 1].is_ascii_digit() || v[s - 1] == b'-') {
                        s -= 1;
                    }
                    v.splice(s..end, NUMBERS[pick(rng, NUMBERS.len())].bytes());
                }
            }
            _ => {
                let lines: Vec<usize> = std::iter::once(0)
                    .chain((0..v.len()).filter(|&i| v[i] == b'\n').map(|i| i + 1))
                    .collect();
                let a = lines[pick(rng, lines.len())];
                let b = v[a..].iter().position(|&c| c == b'\n').map_or(v.len(), |p| a + p + 1);
                let line = v[a..b].to_vec();
                if rng.below(2) == 0 {
                    v.splice(a..a, line);
                } else {
                    v.drain(a..b);
                }
            }
        }
    }
    v
}

/// An offload file mutated in its JSON header (as text) or its body (as bytes), reassembled
/// with the right header length and checksum.
fn mutate_offload_parts(rng: &mut Rng, input: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    let header_len = u32::from_le_bytes(input[13..17].try_into().expect("4 bytes")) as usize;
    let Some(end) = 17usize.checked_add(header_len).filter(|&e| e + 4 <= input.len()) else {
        return edit(rng, input, others, false);
    };
    let (mut header, mut body) = (input[17..end].to_vec(), input[end..input.len() - 4].to_vec());
    body.truncate(MAX_INPUT);
    if rng.below(3) == 0 {
        header = edit(rng, &header, &[], true);
    } else {
        body = edit(rng, &body, &[], false);
    }
    let mut out = input[..13].to_vec();
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&body);
    out.extend_from_slice(&[0; 4]);
    reseal(&mut out);
    out
}

/// A facade sequence file with one layer's one-sequence file mutated (as an offload file is:
/// header or body, re-sealed) and the container's lengths and checksum recomputed; `None`
/// when the input is not such a container.
fn mutate_kvq_seq_layer(rng: &mut Rng, input: &[u8]) -> Option<Vec<u8>> {
    let content = input.get(..input.len().checked_sub(4)?)?;
    let layers = u32::from_le_bytes(content.get(12..16)?.try_into().ok()?) as usize;
    let mut parts = Vec::new();
    let mut at = 16usize;
    for _ in 0..layers.min(64) {
        let n = usize::try_from(u64::from_le_bytes(content.get(at..at + 8)?.try_into().ok()?)).ok()?;
        parts.push(content.get(at + 8..(at + 8).checked_add(n)?)?.to_vec());
        at += 8 + n;
    }
    if parts.is_empty() {
        return None;
    }
    let i = rng.below(parts.len() as u64) as usize;
    parts[i] = mutate(Target::OffloadSeq, rng, &parts[i], &[]);
    let mut out = content[..16].to_vec();
    for p in &parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out.extend_from_slice(&[0; 4]);
    reseal(&mut out);
    Some(out)
}

/// Recomputes an offload file's trailing CRC-32.
pub fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
}

/// A short signature of an outcome, for keeping inputs that reach somewhere new: "ok", or the
/// refusal's message with its numbers blanked.
pub fn signature(outcome: &Outcome) -> String {
    // Words with a digit in them (numbers, hex, sizes) become `#` and quoted text `_`: what
    // varies with the input goes, the kind of error stays.
    let blank = |s: &str| -> String {
        let mut out = String::new();
        let mut word = String::new();
        let mut quote: Option<char> = None;
        let flush = |word: &mut String, out: &mut String| {
            if word.chars().any(|c| c.is_ascii_digit()) {
                if !out.ends_with('#') {
                    out.push('#');
                }
            } else {
                out.push_str(word);
            }
            word.clear();
        };
        for c in s.chars() {
            match quote {
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if matches!(c, '`' | '"' | '\'') => {
                    flush(&mut word, &mut out);
                    quote = Some(c);
                    out.push('_');
                }
                None if c.is_ascii_alphanumeric() || c == '_' => word.push(c),
                None => {
                    flush(&mut word, &mut out);
                    out.push(c);
                }
            }
        }
        flush(&mut word, &mut out);
        out.chars().take(48).collect()
    };
    match outcome {
        Ok(()) => "ok".into(),
        // Parsers quote the input around an error in the lines between; the first and the last
        // line say what kind of error it is.
        Err(e) => {
            let mut lines = e.lines().filter(|l| !l.trim().is_empty());
            let first = lines.next().unwrap_or_default();
            format!("{} | {}", blank(first), blank(lines.next_back().unwrap_or_default()))
        }
    }
}
