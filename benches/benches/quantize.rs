//! Quantize-and-pack throughput: 4096 tokens × 128 channels of f32, per-token groups.
//!
//! Throughput is counted in bytes of f32 input read.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvq_quant_core::synth::normal_tensor;
use kvq_quant_core::{QuantSpec, Shape, quantize};
use std::hint::black_box;

fn quantize_per_token(c: &mut Criterion) {
    let x = normal_tensor(Shape::new(1, 4096, 128), 42);
    let mut group = c.benchmark_group("quantize_pack_4096x128");
    group.throughput(Throughput::Bytes((x.data().len() * 4) as u64));
    for spec in ["int8-token", "int4-token", "int4-channel32", "int2-token", "fp8e4m3-token"] {
        let spec: QuantSpec = spec.parse().unwrap();
        // Check the result before timing it.
        let q = quantize(&x, &spec).unwrap();
        assert_eq!(q.shape(), x.shape());
        group.bench_with_input(BenchmarkId::from_parameter(&spec), &spec, |b, spec| {
            b.iter(|| quantize(black_box(&x), spec).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, quantize_per_token);
criterion_main!(benches);
