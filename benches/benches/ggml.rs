//! The weight products of a model in its GGUF types (`kvq_kernels_simd::ggml::matmul_t`):
//! SmolLM2-135M's MLP up projection (1536 × 576) in Q4_1, Q4_0 and Q8_0 against 1 activation
//! row (a decode step), 16 (16 sequences decoding together) and 64 (a prefill chunk), one
//! thread, on every backend of this CPU (the scalar reference, AVX2, AVX-512 VNNI), on the
//! rows as a GGUF stores them (`matmul_t`) and repacked eight rows at a time
//! (`ggml_packed::matmul_packed`, what `kvq-candle` multiplies).
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

/// Random weight rows of `ty` (scales small and positive, codes uniform).
fn weights(ty: GgmlType, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(ROWS * ty.row_bytes(K));
    for _ in 0..ROWS * K / 32 {
        out.extend_from_slice(&half::f16::from_f32(0.01 + rng.uniform() as f32 * 0.01).to_le_bytes());
        if ty == GgmlType::Q4_1 {
            out.extend_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
        }
        let codes = if ty == GgmlType::Q8_0 { 32 } else { 16 };
        out.extend((0..codes).map(|_| (rng.uniform() * 256.0) as u8));
    }
    out
}

fn matmul(c: &mut Criterion) {
    let mut rng = Rng::new(7);
    for ty in [GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::Q8_0] {
        let w = weights(ty, &mut rng);
        let packed = PackedWeights::new(ty, &w, ROWS, K).unwrap();
        let mut group = c.benchmark_group(format!("ggml_{ty:?}_{ROWS}x{K}"));
        group.sample_size(20);
        for n in [1usize, 16, 64] {
            let x: Vec<f32> = (0..n * K).map(|_| rng.normal() as f32).collect();
            let mut act = Activations::new();
            act.quantize(&x, K).unwrap();
            let mut out = vec![0f32; ROWS * n];
            group.throughput(Throughput::Elements((ROWS * K * n) as u64));
            let mut seen = Vec::new();
            for backend in dispatch::available() {
                let runs = implementation(backend);
                if seen.contains(&runs) {
                    continue;
                }
                seen.push(runs);
                group.bench_function(BenchmarkId::new(runs.name(), n), |b| {
                    b.iter(|| matmul_t(backend, ty, black_box(&w), &act, &mut out).unwrap())
                });
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
