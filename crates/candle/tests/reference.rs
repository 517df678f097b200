//! `LlamaModel` against candle-transformers' `quantized_llama` and `quantized_qwen2`,
//! implementations nobody here wrote: a tiny random model written as GGUF, 64 tokens (a
//! 32-token prefill, then 32 decode steps), logits equal to 1e-4 relative at every position,
//! with the f32 reference cache and with kvq's cache holding every token in full precision.
//!
//! With quantized weights, candle rounds each activation row to 8 bits before the integer dot
//! products (as ggml does), so a one-ulp difference in an attention output (a different
//! summation order) can flip one rounding and move the logits by far more than 1e-4. The
//! quantized weight types are therefore checked twice: dequantized to f32 by candle on both
//! sides (`CANDLE_DEQUANTIZE_ALL=1`, in a child process), where 1e-4 must hold everywhere, and
//! on candle's integer path, where most positions must still be bit-identical or nearly so.

mod common;

use candle_core::quantized::{GgmlDType, gguf_file};
use candle_core::{Device, Tensor};
use candle_transformers::models::{quantized_llama, quantized_qwen2};
use common::*;
use kvq::attention::ScorePath;
use kvq::layout::TailDtype;
use kvq_candle::{KvStore, KvqStore, LlamaModel};

/// candle-transformers' logits at every position, one token at a time (its forward returns
/// the last position only), and its prefill's last logits.
fn candle_logits(
    arch: &str,
    path: &std::path::Path,
    tokens: &[u32],
    prefill: usize,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    type Forward = Box<dyn FnMut(&Tensor, usize) -> Tensor>;
    let load = || -> Forward {
        let mut f = std::fs::File::open(path).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        if arch == "qwen2" {
            let mut m = quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
            Box::new(move |x, p| m.forward(x, p).unwrap())
        } else {
            let mut m = quantized_llama::ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
            Box::new(move |x, p| m.forward(x, p).unwrap())
        }
    };
    let row = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut m = load();
    let per_pos = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| row(m(&Tensor::new(&[[t]], &Device::Cpu).unwrap(), i)))
        .collect();
    let mut m = load();
    let last = row(m(&Tensor::new(&tokens[..prefill], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), 0));
    (per_pos, last)
}

/// Ours: a prefill of `prefill` tokens, then one decode step per token; every position's logits.
fn our_logits(model: &LlamaModel, store: &mut dyn KvStore, tokens: &[u32], prefill: usize) -> Vec<Vec<f32>> {
    let mut rows: Vec<Vec<f32>> = model.forward(store, &tokens[..prefill]).unwrap().to_vec2().unwrap();
    for &t in &tokens[prefill..] {
        rows.push(model.forward(store, &[t]).unwrap().squeeze(0).unwrap().to_vec1().unwrap());
    }
    rows
}

/// Logits of the tiny model (`seed`) on 64 tokens: candle-transformers' at every position and
/// its prefill's last, then ours with the f32 cache and with kvq's cache holding every token in
/// full precision (sinks covering the sequence, f32 tails).
struct Run {
    theirs: Vec<Vec<f32>>,
    their_prefill_last: Vec<f32>,
    ours: [Vec<Vec<f32>>; 2],
}

const PREFILL: usize = 32;

fn run(arch: &str, types: Types, seed: u64) -> Run {
    let dir = temp_dir(&format!("ref-{arch}-{:?}-{:?}-{seed}", types.attn, types.mlp));
    let path = tiny_in(&dir, arch, types, seed);
    let tokens = Rng::new(seed + 1).tokens(64);
    let (theirs, their_prefill_last) = candle_logits(arch, &path, &tokens, PREFILL);
    let model = LlamaModel::load(&path).unwrap();
    let mut f32_cache = model.f32_cache().unwrap();
    let exact = model
        .config()
        .cache_builder()
        .sink_tokens(64)
        .tail_dtype(TailDtype::F32)
        .blocks_per_layer(64)
        .build()
        .unwrap();
    let mut kvq_exact = KvqStore::new(exact, ScorePath::Float).unwrap();
    let ours = [
        our_logits(&model, &mut f32_cache, &tokens, PREFILL),
        our_logits(&model, &mut kvq_exact, &tokens, PREFILL),
    ];
    std::fs::remove_dir_all(dir).unwrap();
    assert_eq!(ours[0].len(), 64);
    // The logits are not trivially equal: tokens give different distributions.
    assert!(rel_diff(&ours[0][10], &ours[0][11]) > 1e-2);
    Run { theirs, their_prefill_last, ours }
}

/// Relative differences at every position: (f32 cache, kvq cache), and the prefill's last.
fn differences(arch: &str, types: Types, seed: u64) -> (Vec<(f32, f32)>, f32) {
    let r = run(arch, types, seed);
    let diffs = r
        .theirs
        .iter()
        .enumerate()
        .map(|(p, t)| (rel_diff(&r.ours[0][p], t), rel_diff(&r.ours[1][p], t)))
        .collect();
    (diffs, rel_diff(&r.ours[0][PREFILL - 1], &r.their_prefill_last))
}

fn check_exact(arch: &str, types: Types) {
    let (diffs, last) = differences(arch, types, 11);
    for (pos, &(a, b)) in diffs.iter().enumerate() {
        assert!(a <= 1e-4, "{arch}: f32 cache, position {pos}: relative difference {a}");
        assert!(b <= 1e-4, "{arch}: kvq full-precision cache, position {pos}: relative difference {b}");
    }
    assert!(last <= 1e-4, "{arch}: their prefill's last logits: {last}");
}

const F32: Types = Types { attn: GgmlDType::F32, mlp: GgmlDType::F32, output: GgmlDType::F32 };
/// Every quantized weight type the issue names, over the model's matrices.
const QUANTIZED: [Types; 3] = [
    Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4K, output: GgmlDType::Q4_1 },
    Types { attn: GgmlDType::Q4_0, mlp: GgmlDType::Q6K, output: GgmlDType::F16 },
    Types { attn: GgmlDType::Q4_1, mlp: GgmlDType::Q8_0, output: GgmlDType::Q4K },
];

#[test]
fn llama_agrees_with_candle_transformers() {
    check_exact("llama", F32);
}

#[test]
fn qwen2_with_bias_and_rotate_half_agrees_with_candle_transformers() {
    check_exact("qwen2", F32);
}

/// Runs in a child process with `CANDLE_DEQUANTIZE_ALL=1` (see the module docs).
#[test]
#[ignore = "run by quantized_weights_dequantized_agree, in a child process"]
fn quantized_weights_dequantized_child() {
    assert_eq!(std::env::var("CANDLE_DEQUANTIZE_ALL").as_deref(), Ok("1"));
    for types in QUANTIZED {
        check_exact("llama", types);
    }
    check_exact("qwen2", QUANTIZED[0]);
}

#[test]
fn quantized_weights_dequantized_agree() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "quantized_weights_dequantized_child", "--ignored", "--test-threads", "1"])
        .env("CANDLE_DEQUANTIZE_ALL", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn quantized_weights_on_the_integer_path_give_the_same_predictions() {
    for types in QUANTIZED {
        let (kl, same) = integer_path_agreement(types);
        eprintln!(
            "{:?}/{:?}/{:?}: worst KL {kl:.2e}, same top-1 {same:.3}",
            types.attn, types.mlp, types.output
        );
        // A flipped 8-bit rounding of one activation moves the logits by up to a few percent
        // of their range, and the flip carries on through the cached keys and values; the
        // next-token distributions stay close.
        assert!(kl < 2e-2, "worst KL {kl}");
        assert!(same >= 0.9, "same top-1 at {same}");
    }
}

/// The worst KL(candle-transformers ‖ ours) over both caches and every position, and the share
/// of positions with the same top token.
fn integer_path_agreement(types: Types) -> (f64, f64) {
    let r = run("llama", types, 11);
    let (mut worst, mut same, mut n) = (0f64, 0usize, 0usize);
    for rows in &r.ours {
        for (p, t) in r.theirs.iter().enumerate() {
            let s = kvq_candle::eval::compare(t, &rows[p], 0);
            worst = worst.max(s.kl);
            same += usize::from(s.same_top);
            n += 1;
        }
    }
    (worst, same as f64 / n as f64)
}
