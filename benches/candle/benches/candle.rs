//! candle-core's `k_quants` dot products, one query against N keys, on the same keys and
//! query as kvq's `kernels` bench (same seeds, same repetition of 65536 base rows), under the
//! same group names so that `cargo xtask bench` reports kvq's kernels "vs candle".
//!
//! Each key row of `d` channels is `d / 32` candle blocks (`BlockQ4_0`: 18 bytes, `BlockQ8_0`:
//! 34 bytes); the query is quantized once to `BlockQ8_0`, as candle's quantized matmul does,
//! and each score is one `vec_dot` call. candle picks its AVX path only when the build enables
//! `avx` at compile time; in the default build (no target flags, like kvq's) it runs its
//! portable code, which is what a user of a default build gets.
//!
//! The `kquant_*` groups multiply K-quant weights (Q4_K, Q5_K, Q6_K) by candle's code and by
//! kvq's, in the same group, so the summary's "vs candle" column is their ratio.

use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8_0, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvq_kernels_simd::dispatch;
use kvq_kernels_simd::ggml::{self, Activations};
use kvq_kernels_simd::ggml_packed::{self, PackedWeights};
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

/// SmolLM2-135M's MLP down projection (576 rows of 1536), the one matrix of that model whose
/// rows fit the K-quants' super-blocks of 256.
const KQ_ROWS: usize = 576;
const KQ_K: usize = 1536;

/// A K-quant product, candle's against kvq's, on the same blocks (both quantized by candle from
/// the same normal weights) against `n` activation rows, one thread, each rounding the
/// activations in the loop: candle's `vec_dot` of each weight row with each row quantized to
/// `BlockQ8K` (its default build's portable code),
/// kvq's repacked product on this CPU's best backend (`ggml_packed`, what kvq-candle runs).
fn k_quant<B: GgmlType + Clone>(c: &mut Criterion, dtype: GgmlDType, ty: ggml::GgmlType, n: usize) {
    let w = normal_tensor(Shape::new(1, KQ_ROWS, KQ_K), 5).into_data();
    let x = normal_tensor(Shape::new(1, n, KQ_K), 6).into_data();
    let mut blocks = vec![B::zeros(); KQ_ROWS * KQ_K / B::BLCK_SIZE];
    B::from_float(&w, &mut blocks);
    let mut xq = vec![B::VecDotType::zeros(); n * KQ_K / B::BLCK_SIZE];
    B::VecDotType::from_float(&x, &mut xq);
    let q = QTensor::quantize(&Tensor::from_vec(w, (KQ_ROWS, KQ_K), &Device::Cpu).unwrap(), dtype).unwrap();
    let packed = PackedWeights::new(ty, &q.data().unwrap(), KQ_ROWS, KQ_K).unwrap();
    let mut act = Activations::new();
    let backend = dispatch::detect();
    let mut out = vec![0f32; KQ_ROWS * n];
    let mut g = c.benchmark_group(format!("kquant_{ty:?}_{KQ_ROWS}x{KQ_K}_n{n}"));
    g.sample_size(10);
    g.throughput(Throughput::Elements((KQ_ROWS * KQ_K * n) as u64));
    let per_row = KQ_K / B::BLCK_SIZE;
    g.bench_function("candle", |b| {
        b.iter(|| {
            B::VecDotType::from_float(black_box(&x), &mut xq);
            for (r, row) in black_box(&blocks).chunks_exact(per_row).enumerate() {
                for (t, xr) in xq.chunks_exact(per_row).enumerate() {
                    out[r * n + t] = B::vec_dot(KQ_K, row, xr);
                }
            }
        })
    });
    g.bench_function(format!("kvq-{}", ggml_packed::implementation(backend).name()), |b| {
        b.iter(|| {
            act.quantize_with(backend, black_box(&x), KQ_K).unwrap();
            ggml_packed::matmul_packed(backend, &packed, 0..packed.groups(), &act, &mut out).unwrap()
        })
    });
    g.finish();
}

fn k_quants(c: &mut Criterion) {
    for n in [1, 16] {
        k_quant::<BlockQ4K>(c, GgmlDType::Q4K, ggml::GgmlType::Q4K, n);
        k_quant::<BlockQ5K>(c, GgmlDType::Q5K, ggml::GgmlType::Q5K, n);
        k_quant::<BlockQ6K>(c, GgmlDType::Q6K, ggml::GgmlType::Q6K, n);
    }
}

fn scores(c: &mut Criterion) {
    group(c, 4096, 128);
    group(c, 4096, 64);
    group(c, 8 << 20, 128);
}

criterion_group!(benches, scores, k_quants);
criterion_main!(benches);
