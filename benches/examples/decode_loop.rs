//! A decode step of one Llama-3-8B-shaped layer (32 query heads over 8 KV heads of 128
//! channels, blocks of 32 tokens) repeated in a plain loop, to run under `perf record` or
//! valgrind (criterion's harness adds its own work to a profile), and to compare two builds
//! of kvq alternately on a noisy machine.
//!
//! ```sh
//! cargo run --release -p kvq-benches --example decode_loop -- int4-channel int4-token \
//!     --steps 2000 [--tokens 4096] [--threads 1] [--integer] [--seqs 16] [--window] \
//!     [--block-size 32] [--q-heads 32]
//! ```
//! `--window` gives the cache the facade builder's window: one residual block, 4 sinks, the
//! values' window and sinks in 8 bits (without it: none, as the criterion benches).
//! Prints the mean, fastest and median time per step; `--steps 0` builds the cache only (subtract it from a
//! profile's totals). With `--seqs N` a step is one `decode_attention_batch` call over N
//! sequences of `--tokens` each (one workspace kept across steps), as the `decode_batch`
//! bench runs it. `KVQ_FORCE_BACKEND=avx2` (or another backend's name) runs that backend
//! instead of the best one, on both paths. `--q-heads N` (a multiple of 8) gives the layer N
//! query heads over its 8 KV heads: 8 for multi-head attention, 24 for GQA groups of 3.

use kvq::attention::{
    AttentionOptions, BatchSeq, DecodeWorkspace, ScorePath, decode_attention, decode_attention_batch,
};
use kvq_benches::{best_float, layer_cache_with};
use kvq_kernels_simd::{Backend, Kernels};
use kvq_quant_core::Shape;
use kvq_quant_core::synth::{Rng, normal_tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(k), Some(v)) = (args.first(), args.get(1)) else {
        return Err(
            "usage: decode_loop KSPEC VSPEC [--steps N] [--tokens N] [--threads N] [--integer] [--seqs N] [--window] [--block-size N] [--q-heads N]"
                .into(),
        );
    };
    let option = |name: &str, default: usize| -> Result<usize, Box<dyn std::error::Error>> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args.get(i + 1).ok_or(format!("{name} needs a value"))?.parse()?),
            None => Ok(default),
        }
    };
    let (steps, len, threads) =
        (option("--steps", 1000)?, option("--tokens", 4096)?, option("--threads", 1)?);
    let seqs = option("--seqs", 0)?;
    // Tokens per block (per-channel keys: `channel` groups over the block, `channelN` in groups
    // of N inside it).
    let bs = option("--block-size", 32)?.max(1);
    let integer = args.iter().any(|a| a == "--integer");
    let window = args.iter().any(|a| a == "--window");
    // Checked here: the bench helper below unwraps them.
    for spec in [k, v] {
        spec.parse::<kvq_quant_core::QuantSpec>()?;
    }
    let (q_heads, kv_heads, d) = (option("--q-heads", 32)?, 8usize, 128usize);
    if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(format!("--q-heads {q_heads}: a positive multiple of {kv_heads}").into());
    }
    let kv = normal_tensor(Shape::new(kv_heads, len, d), 21);
    let vv = normal_tensor(Shape::new(kv_heads, len, d), 22);
    let mut rng = Rng::new(9);
    let q: Vec<f32> = (0..q_heads * d).map(|_| rng.normal() as f32).collect();
    let n = seqs.max(1);
    let blocks = n * kv_heads * (len.div_ceil(bs) + 2);
    let mut cache = layer_cache_with(kv_heads, d, blocks, k, v, |c| {
        let c = c.with_block_size(bs);
        if window {
            c.with_residual_blocks(1)
                .with_sink_tokens(4)
                .with_value_tail_dtype(kvq_cache_layout::TailDtype::Int8)
        } else {
            c
        }
    });
    let all: Vec<BatchSeq> = (0..n)
        .map(|_| {
            let seq = cache.create();
            cache.extend(seq, 0, &kv, &vv).map(|()| BatchSeq::decode(seq))
        })
        .collect::<Result<_, _>>()?;
    let seq = all[0].seq;
    let q: Vec<f32> = q.iter().cycle().take(n * q.len()).copied().collect();
    let mut out = vec![0f32; q.len()];
    let mut ws = DecodeWorkspace::new();
    let forced =
        std::env::var_os("KVQ_FORCE_BACKEND").map(|_| kvq_kernels_simd::dispatch::selected()).transpose()?;
    let (backend, path) = if integer {
        let best = Kernels::new(Backend::Avx512).unwrap_or_else(|_| best_float());
        (forced.unwrap_or(best), ScorePath::Int8)
    } else {
        (forced.unwrap_or_else(best_float), ScorePath::Float)
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    // Each step timed on its own: on a shared VM the fastest and the median step compare two
    // builds better than the mean, which a few preempted steps move.
    let mut times = Vec::with_capacity(steps);
    let start = std::time::Instant::now();
    pool.install(|| {
        let options = AttentionOptions::with_path(path);
        for _ in 0..steps {
            let t = std::time::Instant::now();
            if seqs == 0 {
                decode_attention(
                    &AttentionOptions::with_path(path).backend(backend),
                    &cache,
                    seq,
                    0,
                    &q,
                    q_heads,
                    &mut out,
                )?;
            } else {
                decode_attention_batch(
                    &options.backend(backend),
                    &cache,
                    0,
                    &all,
                    &q,
                    q_heads,
                    &mut out,
                    &mut ws,
                )?;
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok::<_, kvq::attention::AttentionError>(())
    })?;
    let ms = start.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64;
    times.sort_by(f64::total_cmp);
    let (fastest, median) =
        (times.first().copied().unwrap_or(0.0), times.get(steps / 2).copied().unwrap_or(0.0));
    let window = if window { ", window" } else { "" };
    let kernel = kvq::attention::decode_kernel(backend, path, &cache, seq, q_heads / kv_heads)?
        .map_or("no blocks", |k| k.name());
    println!(
        "{ms:.3} ms/step, fastest {fastest:.3}, median {median:.3} ({k}/{v}{window}, {n} x {len} tokens, {threads} thread(s), {backend} {path:?}, {kernel})"
    );
    std::hint::black_box(&out);
    Ok(())
}
