//! candle-core's `k_quants` dot products, one query against N keys, on the same keys and
//! query as kvq's `kernels` bench (same seeds, same repetition of 65536 base rows), under the
//! same group names so that `cargo xtask bench` reports kvq's kernels "vs candle".
//!
//! Each key row of `d` channels is `d / 32` candle blocks (`BlockQ4_0`: 18 bytes, `BlockQ8_0`:
//! 34 bytes); the query is quantized once to `BlockQ8_0`, as candle's quantized matmul does,
//! and each score is one `vec_dot` call. candle picks its AVX path only when the build enables
//! `avx` at compile time; in the default build (no target flags, like kvq's) it runs its
//! portable code, which is what a user of a default build gets.

use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvq_quant_core::Shape;
use kvq_quant_core::synth::normal_tensor;
use std::hint::black_box;

const BASE: usize = 65536;

/// Blocks of `n` key rows of `d` channels, from the kvq bench's keys.
fn blocks<B: GgmlType + Clone>(n: usize, d: usize) -> Vec<B> {
    let base = normal_tensor(Shape::new(1, n.min(BASE), d), 3).into_data();
    let mut b = vec![B::zeros(); base.len() / 32];
    B::from_float(&base, &mut b);
    let per_base = b.len();
    let mut out = Vec::with_capacity(n * d / 32);
    while out.len() < n * d / 32 {
        let take = (n * d / 32 - out.len()).min(per_base);
        out.extend_from_slice(&b[..take]);
    }
    out
}

fn group(c: &mut Criterion, n: usize, d: usize) {
    let name = if n > 1 << 20 { format!("scores_dram_{n}x{d}") } else { format!("scores_{n}x{d}") };
    let mut g = c.benchmark_group(name);
    if n > 1 << 20 {
        g.sample_size(10);
    }
    let q = normal_tensor(Shape::new(1, 1, d), 4).into_data();
    let mut q8 = vec![BlockQ8_0::zeros(); d / 32];
    BlockQ8_0::from_float(&q, &mut q8);
    let mut out = vec![0f32; n];
    let per_row = d / 32;
    {
        let k4: Vec<BlockQ4_0> = blocks(n, d);
        g.throughput(Throughput::Bytes((n * per_row * std::mem::size_of::<BlockQ4_0>()) as u64));
        g.bench_function("candle_q4_0", |b| {
            b.iter(|| {
                for (o, row) in out.iter_mut().zip(black_box(&k4).chunks_exact(per_row)) {
                    *o = BlockQ4_0::vec_dot(d, row, &q8);
                }
            })
        });
    }
    let k8: Vec<BlockQ8_0> = blocks(n, d);
    g.throughput(Throughput::Bytes((n * per_row * std::mem::size_of::<BlockQ8_0>()) as u64));
    g.bench_function("candle_q8_0", |b| {
        b.iter(|| {
            for (o, row) in out.iter_mut().zip(black_box(&k8).chunks_exact(per_row)) {
                *o = BlockQ8_0::vec_dot(d, row, &q8);
            }
        })
    });
    g.finish();
}

fn scores(c: &mut Criterion) {
    group(c, 4096, 128);
    group(c, 4096, 64);
    group(c, 8 << 20, 128);
}

criterion_group!(benches, scores);
criterion_main!(benches);
