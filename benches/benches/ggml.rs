//! The weight products of a model in its GGUF types (`kvq_kernels_simd::ggml::matmul_t`):
//! SmolLM2-135M's MLP up projection (1536 × 576) in Q4_1, Q4_0 and Q8_0, and its down
//! projection (576 × 1536, whose rows fit super-blocks of 256) in Q4_K, Q5_K and Q6_K, against
//! 1 activation row (a decode step), 16 (16 sequences decoding together) and 64 (a prefill
//! chunk), one thread, on every backend of this CPU (the scalar reference, AVX2, AVX-512
//! VNNI), on the rows as a GGUF stores them (`matmul_t`, blocks of 32 only) and repacked eight
//! rows at a time (`ggml_packed::matmul_packed`, what `kvq-candle` multiplies). candle's K-quant
//! products beside kvq's are in `benches/candle` (`kquant_*`).
//! Throughput is multiply-adds (weights × activation rows), so backends and batch sizes
//! compare on the same scale.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvq_kernels_simd::dispatch;
use kvq_kernels_simd::ggml::{Activations, GgmlType, implementation, matmul_t};
use kvq_kernels_simd::ggml_packed::{PackedWeights, matmul_packed};
use kvq_quant_core::synth::Rng;
use std::hint::black_box;

const ROWS: usize = 1536;
const K: usize = 576;

/// Random weight rows of `ty` (scales small and positive, codes uniform; for the K-quants any
/// bytes but `d` and `dmin`).
fn weights(ty: GgmlType, rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * ty.row_bytes(k));
    let scale =
        |rng: &mut Rng, base: f32| half::f16::from_f32(base + rng.uniform() as f32 * base).to_le_bytes();
    for _ in 0..rows * k / ty.block_values() {
        let start = out.len();
        out.extend((0..ty.block_bytes()).map(|_| (rng.uniform() * 256.0) as u8));
        let block = &mut out[start..];
        match ty {
            GgmlType::Q6K => block[208..210].copy_from_slice(&scale(rng, 1e-3)),
            GgmlType::Q4K | GgmlType::Q5K => {
                block[0..2].copy_from_slice(&scale(rng, 1e-3));
                block[2..4].copy_from_slice(&scale(rng, 1e-3));
            }
            GgmlType::Q4_1 => {
                block[0..2].copy_from_slice(&scale(rng, 0.01));
                block[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
            }
            _ => block[0..2].copy_from_slice(&scale(rng, 0.01)),
        }
    }
    out
}

fn matmul(c: &mut Criterion) {
    let mut rng = Rng::new(7);
    for ty in [GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let (rows, k) = if ty.is_k_quant() { (K, ROWS) } else { (ROWS, K) };
        let w = weights(ty, rows, k, &mut rng);
        let packed = PackedWeights::new(ty, &w, rows, k).unwrap();
        let mut group = c.benchmark_group(format!("ggml_{ty:?}_{rows}x{k}"));
        group.sample_size(20);
        for n in [1usize, 16, 64] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.normal() as f32).collect();
            let mut act = Activations::new();
            act.quantize(&x, k).unwrap();
            let mut out = vec![0f32; rows * n];
            group.throughput(Throughput::Elements((rows * k * n) as u64));
            let mut seen = Vec::new();
            for backend in dispatch::available() {
                let runs = implementation(backend);
                if seen.contains(&runs) {
                    continue;
                }
                seen.push(runs);
                if !ty.is_k_quant() {
                    group.bench_function(BenchmarkId::new(runs.name(), n), |b| {
                        b.iter(|| matmul_t(backend, ty, black_box(&w), &act, &mut out).unwrap())
                    });
                }
                group.bench_function(BenchmarkId::new(format!("packed-{}", runs.name()), n), |b| {
                    b.iter(|| {
                        matmul_packed(backend, black_box(&packed), 0..packed.groups(), &act, &mut out)
                            .unwrap()
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, matmul);
criterion_main!(benches);
