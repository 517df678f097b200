//! What one key or value row costs in the fused kernels, for every spec family: one cache
//! block (32 rows) of head_dim 64 and 128, in cache, against the 4 query rows of a GQA group
//! (scores) or their 4 weight rows (values), through the fastest float backend of this CPU;
//! and the dense f32 and f16 kernels on the same shapes as baselines (groups `rows_scores_*`
//! and `rows_values_*`). Criterion reports the time of one block; divide by 32 for a row.
//! Group `rows_regions_*`: the width regions of `-qa` keys (per-channel affine blocks of 16
//! and 32 channels at every width), scored the same way.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use kvq_benches::best_float;
use kvq_kernels_simd::{
    Levels, Params, QuantBlock, Scratch, axpy_in, dense_axpy_with, dense_scores_with, scores_in,
};
use kvq_quant_core::codebook::NF4_LEVELS;
use kvq_quant_core::synth::normal_tensor;
use kvq_quant_core::{CodebookSource, Granularity, Kind, QuantSpec, Shape, quantize};
use std::hint::black_box;

/// Rows of a block (the cache's default block size).
const ROWS: usize = 32;
/// Query rows of a GQA group (Llama-3-8B: 32 query heads over 8 KV heads).
const NQ: usize = 4;

/// Every family `kvq analyze` lists or `kvq recommend` can choose, at its usual width.
const SPECS: &[&str] = &[
    "int8-token",
    "int4-token",
    "int3-token",
    "int2-token",
    "int8-channel",
    "int4-channel",
    "int3-channel",
    "int2-channel",
    "int4-g32",
    "sym4-token",
    "sym8-g32",
    "nf4-token",
    "fp8e4m3-token",
    "fp8e5m2-token",
];

fn levels(spec: &QuantSpec) -> Levels<'static> {
    match spec.kind() {
        Kind::Affine => Levels::Affine,
        Kind::Symmetric => Levels::Symmetric { zero: (1u32 << (spec.bits() - 1)) as f32 },
        Kind::Fp8(f) => Levels::Fp8(*f),
        Kind::Codebook(CodebookSource::Nf4) => Levels::Table(&NF4_LEVELS),
        other => panic!("no fixed levels for {other:?}"),
    }
}

fn rows(c: &mut Criterion) {
    let backend = best_float();
    for d in [64usize, 128] {
        let x = normal_tensor(Shape::new(1, ROWS, d), 11);
        let q: Vec<f32> = normal_tensor(Shape::new(1, NQ, d), 12).into_data();
        let p: Vec<f32> = (0..NQ * ROWS).map(|i| 1.0 / (1 + i % 7) as f32).collect();
        let x16: Vec<f16> = x.data().iter().map(|&v| f16::from_f32(v)).collect();
        let blocks: Vec<_> = SPECS
            .iter()
            .map(|&text| {
                let spec: QuantSpec = text.parse().unwrap();
                let qt = quantize(&x, &spec).unwrap();
                let scale = qt.scales().to_f32();
                let offset = qt.offsets().map(|o| o.to_f32());
                (text, spec, qt, scale, offset)
            })
            .collect();
        // Scores and values in groups of their own, so that each entry's f32/f16 baseline is
        // the same operation's (what `cargo xtask bench` divides by).
        for scores in [true, false] {
            let name = if scores { "scores" } else { "values" };
            let mut group = c.benchmark_group(format!("rows_{name}_{ROWS}x{d}"));
            group.throughput(Throughput::Elements(ROWS as u64));
            let (mut s, mut o) = (vec![0f32; NQ * ROWS], vec![0f32; NQ * d]);
            group.bench_function("f32", |b| {
                b.iter(|| match scores {
                    true => dense_scores_with(backend, black_box(x.data()), ROWS, d, &q, NQ, &mut s),
                    false => dense_axpy_with(backend, black_box(x.data()), ROWS, d, &p, NQ, &mut o),
                })
            });
            group.bench_function("f16", |b| {
                b.iter(|| match scores {
                    true => dense_scores_with(backend, black_box(&x16), ROWS, d, &q, NQ, &mut s),
                    false => dense_axpy_with(backend, black_box(&x16), ROWS, d, &p, NQ, &mut o),
                })
            });
            let mut scratch = Scratch::default();
            for (text, spec, qt, scale, offset) in &blocks {
                let params = match spec.granularity() {
                    Granularity::PerChannel { .. } => Params::PerChannel { scale, offset: offset.as_deref() },
                    Granularity::Group(group) => Params::PerGroup { group, scale, offset: offset.as_deref() },
                    _ => Params::PerRow { scale, offset: offset.as_deref() },
                };
                let block = QuantBlock::new(qt.codes(), ROWS, d, spec.bits(), levels(spec), params).unwrap();
                let kernel = kvq_kernels_simd::implementation_for(backend, &block);
                group.bench_function(BenchmarkId::new(*text, kernel), |b| match scores {
                    true => b.iter(|| {
                        scores_in(backend, &mut scratch, black_box(&block), &q, NQ, &mut s).unwrap()
                    }),
                    false => {
                        b.iter(|| axpy_in(backend, &mut scratch, black_box(&block), &p, NQ, &mut o).unwrap())
                    }
                });
            }
            group.finish();
        }
    }
}

/// The scores of the width regions that `-qa` key blocks are made of: a quarter, a half and a
/// quarter of the channels at three widths (`ChannelBits::spread`) give regions of 16 and 32
/// channels at head_dim 64 and 128, at any width from 1 to 8 bits.
fn regions(c: &mut Criterion) {
    let backend = best_float();
    for d in [16usize, 32] {
        let x = normal_tensor(Shape::new(1, ROWS, d), 13);
        let q: Vec<f32> = normal_tensor(Shape::new(1, NQ, d), 14).into_data();
        let mut s = vec![0f32; NQ * ROWS];
        let mut scratch = Scratch::default();
        let mut group = c.benchmark_group(format!("rows_regions_{ROWS}x{d}"));
        group.throughput(Throughput::Elements(ROWS as u64));
        for bits in 1..=8u8 {
            let spec: QuantSpec = format!("int{bits}-channel").parse().unwrap();
            let qt = quantize(&x, &spec).unwrap();
            let (scale, offset) = (qt.scales().to_f32(), qt.offsets().map(|o| o.to_f32()));
            let params = Params::PerChannel { scale: &scale, offset: offset.as_deref() };
            let block = QuantBlock::new(qt.codes(), ROWS, d, bits, Levels::Affine, params).unwrap();
            let kernel = kvq_kernels_simd::implementation_for(backend, &block);
            group.bench_function(BenchmarkId::new(format!("int{bits}"), kernel), |b| {
                b.iter(|| scores_in(backend, &mut scratch, black_box(&block), &q, NQ, &mut s).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, rows, regions);
criterion_main!(benches);
