//! The model over kvq's quantized caches: prefill equals decode, errors grow as bits shrink,
//! and the evaluation reports what it measured (including llama.cpp's chunked protocol).

mod common;

use candle_core::quantized::GgmlDType;
use common::*;
use kvq::attention::ScorePath;
use kvq::layout::TailDtype;
use kvq_candle::eval::{Candidate, Protocol, evaluate};
use kvq_candle::{KvStore, KvqStore, LlamaModel, Weights};

fn model(name: &str) -> LlamaModel {
    let dir = temp_dir(name);
    let path = tiny_in(
        &dir,
        "llama",
        Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4K, output: GgmlDType::F16 },
        21,
    );
    let m = LlamaModel::load_with(&path, Weights::F32).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    m
}

fn candidate(m: &LlamaModel, spec: &str) -> Candidate {
    let s = kvq::analysis::KvSpec::parse(spec).unwrap();
    let config = m
        .config()
        .cache_builder()
        .specs(s.k, s.v)
        .block_size(16)
        .tail_dtype(TailDtype::F16)
        .blocks_per_layer(64)
        .build()
        .unwrap();
    Candidate { name: spec.into(), config, path: ScorePath::Float }
}

/// A tiny model whose every matrix kvq's GGML kernels multiply: each activation row is
/// rounded and multiplied on its own, so a row's result does not depend on the rows beside it.
fn native_model(name: &str) -> LlamaModel {
    let dir = temp_dir(name);
    let types = Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4_0, output: GgmlDType::Q8_0 };
    let m = LlamaModel::load_with(tiny_in(&dir, "llama", types, 21), Weights::Native).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    m
}

#[test]
fn a_prefill_equals_the_same_tokens_decoded_one_by_one() {
    // Every matrix row-independent and each token attending right after its own append: a
    // prefill is the same arithmetic as decoding its tokens one at a time, to the bit, with
    // 8-bit or f16 windows alike (with f32 weights, candle's batched and single-row matmuls
    // sum in different orders, 1e-6 apart, and a key on a rounding boundary of the INT4 grid
    // can then take the other code).
    let m = native_model("prefill");
    let tokens = Rng::new(4).tokens(80);
    for f16_window in [false, true] {
        let builder = m.config().cache_builder().block_size(16).blocks_per_layer(64);
        let builder = if f16_window { builder.tail_dtype(TailDtype::F16) } else { builder };
        let config = builder.build().unwrap();
        let (mut a, mut b) = (
            KvqStore::new(config.clone(), ScorePath::Float).unwrap(),
            KvqStore::new(config, ScorePath::Float).unwrap(),
        );
        let pre: Vec<Vec<f32>> = m.forward(&mut a, &tokens).unwrap().to_vec2().unwrap();
        for (i, (t, row)) in tokens.iter().zip(&pre).enumerate() {
            let one = m.forward(&mut b, &[*t]).unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(&one, row, "f16 window {f16_window}, token {i}");
        }
        assert_eq!(a.cache().layer(0).unwrap().memory(), b.cache().layer(0).unwrap().memory());
        assert_eq!((0..LAYERS).map(|l| a.len(l)).collect::<Vec<_>>(), vec![80; LAYERS]);
    }
}

#[test]
fn fewer_bits_cost_more_kl_and_the_report_counts_the_cache() {
    let m = model("bits");
    let tokens = Rng::new(8).tokens(96);
    let cands: Vec<_> = ["int8-channel/int8-token", "int4-channel/int4-token", "int2-channel/int2-token"]
        .iter()
        .map(|s| candidate(&m, s))
        .collect();
    let mut calls = 0;
    let r = evaluate(&m, &tokens, Protocol::Decode { prefill: 32 }, &cands, |d, t| {
        calls += 1;
        assert!(d <= t);
    })
    .unwrap();
    // One prefill, then tokens 32..=94 one at a time (the last token predicts nothing).
    assert_eq!(calls, 1 + 63);
    assert_eq!(r.positions, 96 - 32);
    let kl: Vec<f64> = r.candidates.iter().map(|c| c.kl_mean).collect();
    assert!(kl[0] < 1e-3 && kl[0] < kl[1] && kl[1] < kl[2], "{kl:?}");
    for c in &r.candidates {
        assert!(c.kl_median <= c.kl_p99 && c.kl_p99 <= c.kl_max && c.kl_mean <= c.kl_max);
        assert!(c.same_top1 > 0.0 && c.same_top1 <= 1.0);
        assert!(c.ppl.is_finite() && c.tokens_per_s > 0.0);
        // Bits from the cache's own memory: codes and parameters plus f16 tails and sinks, so
        // above the code width, and below f16.
        assert!(c.cache_bytes > 0 && c.bits_per_value < 16.0, "{c:?}");
    }
    let bits: Vec<f64> = r.candidates.iter().map(|c| c.bits_per_value).collect();
    assert!(
        bits[0] > 8.0 && bits[1] > 4.0 && bits[2] > 2.0 && bits[0] > bits[1] && bits[1] > bits[2],
        "{bits:?}"
    );
    assert!(r.ppl_ref.is_finite() && r.ref_cache_bytes == 95 * LAYERS * KV_HEADS * HEAD_DIM * 2 * 4);
}

#[test]
fn chunks_follow_llama_perplexity() {
    let m = model("chunks");
    let tokens = Rng::new(2).tokens(200);
    let cands = [candidate(&m, "int4-channel/int4-token")];
    let r = evaluate(&m, &tokens, Protocol::Chunks { ctx: 64, chunks: 3 }, &cands, |_, _| {}).unwrap();
    // Positions 32..=62 of each chunk predict tokens 33..=63.
    assert_eq!(r.positions, 3 * (64 - 1 - 32));
    assert!(r.candidates[0].kl_mean > 0.0);
    // The reference perplexity equals a direct computation on the chunks.
    let mut nll = 0.0;
    for c in 0..3 {
        let mut seg = tokens[c * 64..(c + 1) * 64].to_vec();
        if let (true, Some(b)) = (m.config().add_bos, m.config().bos) {
            seg[0] = b;
        }
        let mut cache = m.f32_cache().unwrap();
        let rows: Vec<Vec<f32>> = m.forward(&mut cache, &seg[..63]).unwrap().to_vec2().unwrap();
        for j in 32..63 {
            let row = &rows[j];
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln();
            nll += lse - row[seg[j + 1] as usize] as f64;
        }
    }
    let ppl = (nll / r.positions as f64).exp();
    assert!((ppl - r.ppl_ref).abs() < 1e-9 * ppl, "{ppl} vs {}", r.ppl_ref);
}

#[test]
fn bits_per_key_channel_fitted_on_the_model_decode_through_the_cache() {
    // The recorder sees what the model writes and reads; maps fitted on the first 48 tokens
    // configure a `-qa` cache that decodes the rest within sight of the plain INT3 one.
    let m = model("channel-bits");
    let tokens = Rng::new(5).tokens(96);
    let (keys, queries) = kvq_candle::calibrate::record(&m, &tokens[..48]).unwrap().into_parts();
    let mut plain = m.f32_cache().unwrap();
    m.forward(&mut plain, &tokens[..48]).unwrap();
    assert_eq!(keys.len(), LAYERS);
    assert!(keys.iter().all(|k| k.len() == 48 * KV_HEADS * HEAD_DIM));
    assert!(queries.iter().all(|q| q.len() == 48 * HEADS * HEAD_DIM));
    assert_eq!(plain.used_bytes(), 2 * keys.iter().map(|k| k.len() * 4).sum::<usize>());

    let spec: kvq::quant::QuantSpec = "int3-channel16-qa".parse().unwrap();
    let maps = kvq_candle::calibrate::channel_bits(&m, &tokens[..48], &spec).unwrap();
    assert_eq!((maps.len(), maps[0].len()), (LAYERS, KV_HEADS));
    let pairing = m.config().rope_pairing;
    for map in maps.iter().flatten() {
        assert_eq!(map.total_bits(), 3 * HEAD_DIM);
        for i in 0..HEAD_DIM / 2 {
            let (a, b) = pairing.channels(i, HEAD_DIM);
            assert_eq!(map.widths()[a], map.widths()[b]);
        }
    }
    let plain_spec: kvq::quant::QuantSpec = "int4-token".parse().unwrap();
    let mut builder = m
        .config()
        .cache_builder()
        .specs(spec.clone(), plain_spec)
        .block_size(16)
        .tail_dtype(TailDtype::F16)
        .blocks_per_layer(64);
    for (l, maps) in maps.into_iter().enumerate() {
        builder = builder.channel_bits(l, maps);
    }
    let qa = Candidate { name: "qa".into(), config: builder.build().unwrap(), path: ScorePath::Float };
    let cands = [candidate(&m, "int3-channel/int4-token"), qa];
    let r = evaluate(&m, &tokens, Protocol::Decode { prefill: 48 }, &cands, |_, _| {}).unwrap();
    let (a, b) = (&r.candidates[0], &r.candidates[1]);
    assert!(b.kl_mean.is_finite() && b.kl_mean > 0.0 && b.kl_mean < 4.0 * a.kl_mean, "{a:?} {b:?}");
    // The same bytes but for the maps, counted once per layer and head (4 bits a channel).
    assert_eq!(b.cache_bytes, a.cache_bytes + LAYERS * KV_HEADS * HEAD_DIM / 2);
    assert!(matches!(
        kvq_candle::calibrate::channel_bits(&m, &tokens[..48], &"int3-channel16".parse().unwrap()),
        Err(kvq_candle::Error::Eval(_))
    ));
    assert!(kvq_candle::calibrate::channel_bits(&m, &tokens[..8], &spec).is_err());
}
