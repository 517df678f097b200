//! Bad input gets a typed error, never a panic: missing, truncated, garbage and crafted model
//! files, unsupported architectures and weight types, tokens outside the vocabulary, cache
//! configs that do not fit the model, tensors of the wrong shape.

mod common;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};
use common::*;
use kvq::attention::ScorePath;
use kvq_candle::eval::{Candidate, Protocol, evaluate};
use kvq_candle::{Error, KvStore, KvqStore, LlamaModel};

const TYPES: Types = Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4_0, output: GgmlDType::F16 };

fn tiny(dir: &std::path::Path) -> std::path::PathBuf {
    tiny_in(dir, "llama", TYPES, 3)
}

#[test]
fn missing_directory_and_garbage_files_are_errors() {
    let dir = temp_dir("errors-files");
    assert!(matches!(LlamaModel::load(dir.join("nope.gguf")), Err(Error::Io { .. })));
    assert!(matches!(LlamaModel::load(&dir), Err(Error::Model { .. })));
    std::fs::write(dir.join("garbage.gguf"), b"this is not a gguf file at all").unwrap();
    let e = LlamaModel::load(dir.join("garbage.gguf")).unwrap_err();
    assert!(matches!(e, Error::Model { .. }), "{e}");
    std::fs::write(dir.join("empty.gguf"), b"").unwrap();
    assert!(matches!(LlamaModel::load(dir.join("empty.gguf")), Err(Error::Model { .. })));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn every_truncation_of_a_model_file_is_an_error() {
    let dir = temp_dir("errors-trunc");
    let bytes = std::fs::read(tiny(&dir)).unwrap();
    let cut = dir.join("cut.gguf");
    // Inside the header, the metadata, the tensor table and the data.
    for len in
        [0, 3, 8, 24, 100, 1000, 5000, bytes.len() / 3, bytes.len() / 2, bytes.len() - 4096, bytes.len() - 1]
    {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        match LlamaModel::load(&cut) {
            Err(Error::Model { reason, .. }) => assert!(!reason.is_empty()),
            other => panic!("{len} of {} bytes: {other:?}", bytes.len()),
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes a GGUF with `md` changed and the tensors of the tiny model (`drop` left out).
fn rewrite(
    dir: &std::path::Path,
    name: &str,
    edit: impl Fn(&mut Vec<(String, gguf_file::Value)>, &mut Vec<(String, QTensor)>),
) -> std::path::PathBuf {
    let src = tiny(dir);
    let mut f = std::fs::File::open(&src).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, gguf_file::Value)> =
        ct.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    let mut ts: Vec<(String, QTensor)> =
        names.iter().map(|n| ((*n).clone(), ct.tensor(&mut f, n, &Device::Cpu).unwrap())).collect();
    edit(&mut md, &mut ts);
    let out = dir.join(name);
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&out).unwrap(), &md_refs, &t_refs).unwrap();
    out
}

#[test]
fn unsupported_or_inconsistent_models_are_refused() {
    let dir = temp_dir("errors-models");
    use gguf_file::Value as V;
    let set = |key: &'static str, v: V| {
        move |md: &mut Vec<(String, V)>, _: &mut Vec<(String, QTensor)>| {
            md.retain(|(k, _)| k != key);
            md.push((key.into(), v.clone()));
        }
    };
    let arch = rewrite(&dir, "arch.gguf", set("general.architecture", V::String("mamba".into())));
    assert!(matches!(LlamaModel::load(arch), Err(Error::Unsupported(m)) if m.contains("mamba")));
    let heads = rewrite(&dir, "heads.gguf", set("llama.attention.head_count_kv", V::U32(3)));
    assert!(matches!(LlamaModel::load(heads), Err(Error::Model { .. })));
    let rope = rewrite(&dir, "rope.gguf", set("llama.rope.dimension_count", V::U32(32)));
    assert!(matches!(LlamaModel::load(rope), Err(Error::Unsupported(m)) if m.contains("partial RoPE")));
    let huge = rewrite(&dir, "huge.gguf", set("llama.embedding_length", V::U64(1 << 40)));
    assert!(matches!(LlamaModel::load(huge), Err(Error::Model { .. })));
    let neg = rewrite(&dir, "neg.gguf", set("llama.block_count", V::I32(-3)));
    assert!(matches!(LlamaModel::load(neg), Err(Error::Model { .. })));
    let eps = rewrite(&dir, "eps.gguf", set("llama.attention.layer_norm_rms_epsilon", V::F32(f32::NAN)));
    assert!(matches!(LlamaModel::load(eps), Err(Error::Model { .. })));
    let missing = rewrite(&dir, "missing.gguf", |_, ts| ts.retain(|(n, _)| n != "blk.1.ffn_up.weight"));
    assert!(
        matches!(LlamaModel::load(missing), Err(Error::Model { reason, .. }) if reason.contains("blk.1.ffn_up.weight"))
    );
    let shape = rewrite(&dir, "shape.gguf", |_, ts| {
        let t = Tensor::zeros((HIDDEN, HIDDEN), DType::F32, &Device::Cpu).unwrap();
        ts.iter_mut().find(|(n, _)| n == "blk.0.attn_k.weight").unwrap().1 =
            QTensor::quantize(&t, GgmlDType::F32).unwrap();
    });
    assert!(matches!(LlamaModel::load(shape), Err(Error::Model { reason, .. }) if reason.contains("attn_k")));
    let q8k = rewrite(&dir, "q8k.gguf", |_, ts| {
        let t = Tensor::zeros((FFN, HIDDEN), DType::F32, &Device::Cpu).unwrap();
        ts.iter_mut().find(|(n, _)| n == "blk.0.ffn_up.weight").unwrap().1 =
            QTensor::quantize(&t, GgmlDType::Q8K).unwrap();
    });
    assert!(matches!(LlamaModel::load(q8k), Err(Error::Unsupported(m)) if m.contains("Q8K")));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_tokens_and_mismatched_caches_change_nothing() {
    let dir = temp_dir("errors-tokens");
    let model = LlamaModel::load(tiny(&dir)).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    let mut cache = model.f32_cache().unwrap();
    model.forward(&mut cache, &[1, 2, 3]).unwrap();
    let e = model.forward(&mut cache, &[4, VOCAB as u32, 5]).unwrap_err();
    assert!(matches!(e, Error::Token { token, position: 1, .. } if token == VOCAB as u32), "{e}");
    assert!(matches!(model.forward(&mut cache, &[]), Err(Error::Shape(_))));
    assert_eq!(cache.len(0), 3, "a refused call appends nothing");

    // A pool too small for the prompt: the error names the cause and the cache is cut back.
    let small = model
        .config()
        .cache_builder()
        .blocks_per_layer(KV_HEADS)
        .block_size(16)
        .residual_blocks(0)
        .build()
        .unwrap();
    let mut q = KvqStore::new(small, ScorePath::Float).unwrap();
    model.forward(&mut q, &[1; 8]).unwrap();
    let e = model.forward(&mut q, &[2; 40]).unwrap_err();
    assert!(matches!(e, Error::Kvq(_)), "{e}");
    assert!((0..LAYERS).all(|l| q.len(l) == 8), "{:?}", (0..LAYERS).map(|l| q.len(l)).collect::<Vec<_>>());
    model.forward(&mut q, &[3]).unwrap();

    // Configs made for another model.
    let c = model.config();
    let other_layers =
        kvq::cache::KvCacheConfig::builder(LAYERS + 1, KV_HEADS, HEADS, HEAD_DIM).build().unwrap();
    let other_dim = kvq::cache::KvCacheConfig::builder(LAYERS, KV_HEADS, HEADS, 32).build().unwrap();
    let other_heads = kvq::cache::KvCacheConfig::builder(LAYERS, 1, HEADS, HEAD_DIM).build().unwrap();
    let other_rope = kvq::cache::KvCacheConfig::builder(LAYERS, KV_HEADS, HEADS, HEAD_DIM)
        .rope_pairing(kvq::quant::RopePairing::Half)
        .build()
        .unwrap();
    for bad in [other_layers, other_dim, other_heads, other_rope] {
        assert!(matches!(c.check_cache(&bad), Err(Error::ConfigMismatch(_))));
        let cand = [Candidate { name: "bad".into(), config: bad, path: ScorePath::Float }];
        let e = evaluate(&model, &[1; 16], Protocol::Decode { prefill: 4 }, &cand, |_, _| {}).unwrap_err();
        assert!(matches!(e, Error::ConfigMismatch(ref m) if m.starts_with("bad")), "{e}");
    }
    // Protocols that the tokens cannot fill.
    let none: [Candidate; 0] = [];
    for p in [
        Protocol::Decode { prefill: 0 },
        Protocol::Decode { prefill: 16 },
        // A prefill of all but the last token decodes nothing: no speed to report (it
        // printed NaN tokens/s; the cli-eval fuzz target found it).
        Protocol::Decode { prefill: 15 },
        Protocol::Chunks { ctx: 8, chunks: 3 },
        Protocol::Chunks { ctx: 2, chunks: 1 },
    ] {
        assert!(matches!(evaluate(&model, &[1; 16], p, &none, |_, _| {}), Err(Error::Eval(_))), "{p:?}");
    }
    assert!(matches!(
        evaluate(&model, &[1, 999], Protocol::Decode { prefill: 1 }, &none, |_, _| {}),
        Err(Error::Token { .. })
    ));
}

#[test]
fn conversions_refuse_bad_tensors_and_read_every_float_dtype() {
    use kvq_candle::convert;
    let config = kvq::cache::KvCacheConfig::builder(1, 2, 4, 8)
        .blocks_per_layer(8)
        .sink_tokens(8)
        .tail_dtype(kvq::layout::TailDtype::F32)
        .build()
        .unwrap();
    let mut cache = kvq::cache::QuantizedKvCache::new(config).unwrap();
    let seq = cache.create();
    let dev = Device::Cpu;
    let mut rng = Rng::new(9);
    let data: Vec<f32> = (0..3 * 2 * 8).map(|_| rng.next_f32()).collect();
    // [tokens, kv_heads, head_dim] in f32, then the same keys in candle's [1, heads, tokens, d].
    let k = Tensor::from_vec(data.clone(), (3, 2, 8), &dev).unwrap();
    convert::append(&mut cache, seq, 0, &k, &k).unwrap();
    let head_major = k.transpose(0, 1).unwrap().unsqueeze(0).unwrap();
    convert::append(&mut cache, seq, 0, &head_major, &head_major).unwrap();
    for dt in [DType::F16, DType::BF16] {
        convert::append(&mut cache, seq, 0, &k.to_dtype(dt).unwrap(), &k.to_dtype(dt).unwrap()).unwrap();
    }
    assert_eq!(cache.len(seq, 0).unwrap(), 12);
    let keys = cache.layer(0).unwrap().dequantize(seq, 0, kvq::quant::Part::K).unwrap();
    // Head 0's rows: tokens 0..3 from each append, exact for f32 (f32 sinks).
    for t in 0..3 {
        assert_eq!(&keys[t * 8..(t + 1) * 8], &data[t * 16..t * 16 + 8]);
        assert_eq!(&keys[(3 + t) * 8..(4 + t) * 8], &data[t * 16..t * 16 + 8]);
    }
    let q = Tensor::from_vec((0..32).map(|i| i as f32 * 0.1).collect::<Vec<_>>(), (4, 8), &dev).unwrap();
    let out = convert::attention(&cache, ScorePath::Float, seq, 0, &q).unwrap();
    assert_eq!(out.dims(), &[4, 8]);
    let out4 =
        convert::attention(&cache, ScorePath::Float, seq, 0, &q.reshape((1, 4, 1, 8)).unwrap()).unwrap();
    assert_eq!(
        out4.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    // A strided view reads the same as its contiguous copy.
    let strided =
        Tensor::from_vec((0..64).map(|i| i as f32).collect::<Vec<_>>(), (8, 8), &dev).unwrap().t().unwrap();
    assert_eq!(
        convert::to_f32_vec(&strided).unwrap(),
        strided.contiguous().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );

    let bad = [
        Tensor::zeros((3, 3, 8), DType::F32, &dev).unwrap(),
        Tensor::zeros((2, 2, 3, 8), DType::F32, &dev).unwrap(),
        Tensor::zeros((3, 2, 8), DType::U32, &dev).unwrap(),
    ];
    for b in &bad {
        assert!(matches!(convert::append(&mut cache, seq, 0, b, b), Err(Error::Shape(_))), "{:?}", b.dims());
    }
    assert!(matches!(
        convert::append(&mut cache, seq, 0, &k, &k.narrow(0, 0, 2).unwrap()),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        convert::attention(
            &cache,
            ScorePath::Float,
            seq,
            0,
            &Tensor::zeros((2, 8), DType::F32, &dev).unwrap()
        ),
        Err(Error::Shape(_))
    ));
    assert_eq!(cache.len(seq, 0).unwrap(), 12, "refused calls appended nothing");
}

#[test]
fn non_finite_values_stop_the_pass_naming_the_layer() {
    let dir = temp_dir("errors-nonfinite");
    let inf = rewrite(&dir, "inf.gguf", |_, ts| {
        let t = Tensor::full(f32::INFINITY, HIDDEN, &Device::Cpu).unwrap();
        ts.iter_mut().find(|(n, _)| n == "blk.1.attn_norm.weight").unwrap().1 =
            QTensor::quantize(&t, GgmlDType::F32).unwrap();
    });
    let model = LlamaModel::load(inf).unwrap();
    let mut cache = KvqStore::new(model.config().cache_builder().build().unwrap(), ScorePath::Float).unwrap();
    match model.forward(&mut cache, &[1, 2, 3]) {
        Err(Error::NonFinite { layer: 1, position: 0 }) => {}
        other => panic!("{other:?}"),
    }
    // Nothing stays in the cache of the refused pass, and its message names the layer.
    assert_eq!((0..LAYERS).map(|l| cache.len(l)).collect::<Vec<_>>(), vec![0; LAYERS]);
    let e = model.forward(&mut cache, &[1]).unwrap_err().to_string();
    assert!(e.contains("layer 1") && e.contains("position 0"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
