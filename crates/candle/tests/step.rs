//! `LlamaModel::step`, the batched forward of serving: a step over many sequences (prompt
//! chunks and decode tokens mixed) gives each sequence the logits and the cache contents it
//! gets alone, one forward at a time; a prompt prefilled in chunks of any size leaves the same
//! cache; a refused step changes nothing.

mod common;

use candle_core::quantized::GgmlDType;
use common::*;
use kvq::attention::ScorePath;
use kvq::cache::{KvCacheConfig, QuantizedKvCache};
use kvq::layout::{SeqId, TailDtype};
use kvq_candle::model::{Prefill, StepOptions, StepSeq, StepWorkspace};
use kvq_candle::tiny::TinyModel;
use kvq_candle::{Error, KvqSeq, LlamaModel, Weights};

/// The default tiny model: every matrix through kvq's GGML kernels, each activation row on
/// its own, so batching changes no bit.
fn native() -> LlamaModel {
    TinyModel::default().load().unwrap().0
}

/// The tiny model with every matrix dequantized to f32 and multiplied by candle, whose batched
/// and single-row products sum in different orders.
fn float_weights() -> LlamaModel {
    let types = Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4_0, output: GgmlDType::F16 };
    let dir = temp_dir("step-f32");
    let m = LlamaModel::load_with(tiny_in(&dir, "llama", types, 3), Weights::F32).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    m
}

fn quantized(m: &LlamaModel) -> KvCacheConfig {
    m.config().cache_builder().block_size(16).blocks_per_layer(256).build().unwrap()
}

/// A cache that never quantizes within these tests' lengths: f32 windows of 16 blocks.
fn full_precision(m: &LlamaModel) -> KvCacheConfig {
    let b = m.config().cache_builder().block_size(16).residual_blocks(15).tail_dtype(TailDtype::F32);
    b.blocks_per_layer(256).build().unwrap()
}

/// The steps of a run.
struct Script {
    /// Per step: (sequence index, tokens, wants logits).
    steps: Vec<Vec<(usize, Vec<u32>, bool)>>,
}

/// Three sequences: long prompts in uneven chunks, a short one that decodes while the others
/// are still prefilling, and a late one that starts mid-run.
fn script() -> Script {
    let mut rng = Rng::new(11);
    let (p0, p1, p2) = (rng.tokens(70), rng.tokens(5), rng.tokens(37));
    let decode = |rng: &mut Rng| rng.tokens(1);
    let steps = vec![
        vec![(0, p0[..23].to_vec(), false), (1, p1.clone(), true)],
        vec![(1, decode(&mut rng), true), (0, p0[23..40].to_vec(), false)],
        vec![(0, p0[40..].to_vec(), true), (1, decode(&mut rng), true), (2, p2[..16].to_vec(), false)],
        vec![(2, p2[16..].to_vec(), true), (0, decode(&mut rng), true), (1, decode(&mut rng), true)],
        vec![(0, decode(&mut rng), true), (1, decode(&mut rng), true), (2, decode(&mut rng), true)],
        vec![(2, decode(&mut rng), true), (0, decode(&mut rng), true)],
    ];
    Script { steps }
}

/// Runs the script batched (one `step` per step) and alone (one `forward` per sequence and
/// call, in a cache of its own), returning both caches, the sequence ids and every logits row.
fn run_both(
    m: &LlamaModel,
    config: &KvCacheConfig,
    options: &StepOptions,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, [QuantizedKvCache; 2]) {
    let (mut batched, mut alone) =
        (QuantizedKvCache::new(config.clone()).unwrap(), QuantizedKvCache::new(config.clone()).unwrap());
    let a: Vec<SeqId> = (0..3).map(|_| batched.create()).collect();
    let b: Vec<SeqId> = (0..3).map(|_| alone.create()).collect();
    let (mut rows_a, mut rows_b) = (Vec::new(), Vec::new());
    let mut ws = StepWorkspace::new();
    let vocab = m.config().vocab;
    for step in script().steps {
        let batch: Vec<StepSeq<'_>> =
            step.iter().map(|(i, t, logits)| StepSeq { seq: a[*i], tokens: t, logits: *logits }).collect();
        let logits = m.step(&mut batched, &batch, options, &mut ws).unwrap();
        rows_a.extend(logits.chunks_exact(vocab).map(<[f32]>::to_vec));
        for (i, tokens, wants) in &step {
            let mut store = KvqSeq::borrowed(&mut alone, b[*i], ScorePath::Float);
            let out: Vec<Vec<f32>> = m.forward(&mut store, tokens).unwrap().to_vec2().unwrap();
            if *wants {
                rows_b.push(out.last().unwrap().clone());
            }
        }
    }
    (rows_a, rows_b, [batched, alone])
}

#[test]
fn a_batched_step_is_each_sequence_alone_to_the_bit_on_kvq_kernels() {
    let m = native();
    for config in [quantized(&m), full_precision(&m)] {
        let (rows_a, rows_b, [batched, alone]) = run_both(&m, &config, &StepOptions::default());
        assert_eq!(rows_a.len(), 12);
        assert_eq!(rows_a, rows_b);
        for l in 0..LAYERS {
            assert_eq!(batched.layer(l).unwrap().memory(), alone.layer(l).unwrap().memory(), "layer {l}");
        }
    }
}

#[test]
fn a_batched_step_matches_each_sequence_alone_with_float_weights() {
    // candle's products of 1 and of many rows differ by float association only.
    let m = float_weights();
    let (rows_a, rows_b, _) = run_both(&m, &full_precision(&m), &StepOptions::default());
    for (x, y) in rows_a.iter().zip(&rows_b) {
        assert!(rel_diff(x, y) <= 1e-4, "{}", rel_diff(x, y));
    }
}

#[test]
fn chunked_prefill_matches_one_token_at_a_time_to_float_association() {
    // The chunk's causal kernels sum in another order: with f32 weights and a cache that
    // keeps these lengths in f32, nothing amplifies the difference.
    let m = float_weights();
    let options = StepOptions { prefill: Prefill::Chunked, ..StepOptions::default() };
    let (rows_a, rows_b, _) = run_both(&m, &full_precision(&m), &options);
    assert_eq!(rows_a.len(), 12);
    for (x, y) in rows_a.iter().zip(&rows_b) {
        assert!(rel_diff(x, y) <= 1e-4, "{}", rel_diff(x, y));
    }
    // On the quantized cache, each token still sees the blocks it would see alone: the same
    // blocks are quantized (one per 16 tokens in every layer), and the logits stay close.
    let m = native();
    let (rows_a, rows_b, [batched, alone]) = run_both(&m, &quantized(&m), &options);
    for l in 0..LAYERS {
        let (a, b) = (batched.layer(l).unwrap().memory(), alone.layer(l).unwrap().memory());
        assert_eq!((a.free_blocks, a.used_bytes()), (b.free_blocks, b.used_bytes()), "layer {l}");
    }
    let worst = rows_a.iter().zip(&rows_b).map(|(x, y)| rel_diff(x, y)).fold(0f32, f32::max);
    assert!(worst < 0.05, "{worst}");
}

#[test]
fn chunk_sizes_do_not_change_the_cache_or_the_logits() {
    let m = native();
    let prompt = Rng::new(5).tokens(90);
    let mut reference: Option<(Vec<f32>, Vec<_>)> = None;
    for chunk in [90, 1, 7, 16, 33] {
        let mut cache = QuantizedKvCache::new(quantized(&m)).unwrap();
        let seq = cache.create();
        let mut ws = StepWorkspace::new();
        let mut last = Vec::new();
        for (i, c) in prompt.chunks(chunk).enumerate() {
            let e = StepSeq { seq, tokens: c, logits: (i + 1) * chunk >= prompt.len() };
            last = m.step(&mut cache, &[e], &StepOptions::default(), &mut ws).unwrap().to_vec();
        }
        let memory: Vec<_> = (0..LAYERS).map(|l| cache.layer(l).unwrap().memory()).collect();
        match &reference {
            None => reference = Some((last, memory)),
            Some((logits, mem)) => {
                assert_eq!(&last, logits, "chunks of {chunk}");
                assert_eq!(&memory, mem, "chunks of {chunk}");
            }
        }
    }
}

#[test]
fn a_refused_step_changes_nothing() {
    let m = native();
    let mut cache = QuantizedKvCache::new(quantized(&m)).unwrap();
    let (a, b) = (cache.create(), cache.create());
    let mut ws = StepWorkspace::new();
    let opts = StepOptions::default();
    m.step(&mut cache, &[StepSeq::new(a, &[1, 2, 3]), StepSeq::new(b, &[4])], &opts, &mut ws).unwrap();
    let lens = |c: &QuantizedKvCache| (c.len(a, 0).unwrap(), c.len(b, 0).unwrap());
    let before = lens(&cache);
    let bad = [6, VOCAB as u32];
    let cases: Vec<(Vec<StepSeq<'_>>, &str)> = vec![
        (vec![], "empty batch"),
        (vec![StepSeq::new(a, &[5]), StepSeq::new(b, &[])], "empty entry"),
        (vec![StepSeq::new(a, &[5]), StepSeq::new(a, &[6])], "a sequence twice"),
        (vec![StepSeq::new(a, &[5]), StepSeq::new(b, &bad)], "a token outside the vocabulary"),
    ];
    for (batch, what) in &cases {
        let e = m.step(&mut cache, batch, &opts, &mut ws).unwrap_err();
        assert!(matches!(e, Error::Shape(_) | Error::Token { .. }), "{what}: {e}");
        assert_eq!(lens(&cache), before, "{what}");
    }
    // An unknown sequence, and a pool too small for the step: the cache's errors.
    let gone = cache.create();
    cache.free(gone).unwrap();
    let e = m.step(&mut cache, &[StepSeq::new(a, &[5]), StepSeq::new(gone, &[6])], &opts, &mut ws);
    assert!(matches!(e, Err(Error::Kvq(_))), "{e:?}");
    let long = vec![7; 256 * 16];
    let e = m.step(&mut cache, &[StepSeq::new(a, &[5]), StepSeq::new(b, &long)], &opts, &mut ws);
    assert!(matches!(e, Err(Error::Kvq(_))), "{e:?}");
    assert_eq!(lens(&cache), before);
    // And the cache still serves both.
    m.step(&mut cache, &[StepSeq::new(a, &[5]), StepSeq::new(b, &[6])], &opts, &mut ws).unwrap();
    assert_eq!(lens(&cache), (before.0 + 1, before.1 + 1));
}
