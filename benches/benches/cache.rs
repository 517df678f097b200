//! Streaming append: the cost of quantizing one 128-value row (alone, with min/max and with
//! error-minimizing ranges, and among the 8 KV heads
//! of a token), and tokens per second into a
//! paged cache of one layer with 8 KV heads × head_dim 128, INT4 per-channel K and INT4
//! per-token V (blocks of 32 tokens, f16 tails).

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvq_cache_layout::{CacheConfig, PagedCache};
use kvq_quant_core::synth::normal_tensor;
use kvq_quant_core::{
    Codec, GroupParams, QuantSpec, RowKernels, Shape, encode_row_with, quantize_row_with, row_params_with,
};
use std::hint::black_box;

/// Row kernels to compare: the portable `wide` ones (the baseline) and this CPU's best.
fn kernel_sets() -> Vec<RowKernels> {
    let best = kvq_kernels_simd::row_kernels().unwrap_or(RowKernels::PORTABLE);
    if best == RowKernels::PORTABLE { vec![best] } else { vec![RowKernels::PORTABLE, best] }
}

fn row_quantize(c: &mut Criterion) {
    let x = normal_tensor(Shape::new(1, 64, 128), 5).into_data();
    let mut group = c.benchmark_group("quantize_row_128");
    group.throughput(Throughput::Elements(1));
    for kernels in kernel_sets() {
        for spec in ["int4-token", "int8-token", "int2-token", "int4-g32", "int4-token-mse", "int2-token-mse"]
        {
            let spec: QuantSpec = spec.parse().unwrap();
            let codec = Codec::new(&spec, None);
            let seg = match spec.granularity() {
                kvq_quant_core::Granularity::Group(g) => g,
                _ => 128,
            };
            let mut params = vec![GroupParams::default(); 128 / seg];
            let mut scratch = vec![0u8; 128];
            let mut packed = vec![0u8; kvq_quant_core::pack::packed_len(128, spec.bits()).unwrap()];
            let mut i = 0;
            let id = format!("{spec}/{}", kernels.name());
            group.bench_function(BenchmarkId::from_parameter(id), |b| {
                b.iter(|| {
                    // Cycle through 64 rows so the branch predictor cannot learn one row.
                    i = (i + 1) % 64;
                    let row = &x[i * 128..(i + 1) * 128];
                    quantize_row_with(
                        &kernels,
                        &codec,
                        spec.bits(),
                        black_box(row),
                        seg,
                        &mut params,
                        &mut scratch,
                        &mut packed,
                    )
                    .unwrap();
                    black_box(&packed);
                })
            });
        }
    }
    group.finish();
}

/// One token's rows for 8 KV heads, as the cache quantizes them: every head's parameters,
/// then every head's codes. Reported per row (throughput 8 elements per iteration).
fn token_rows(c: &mut Criterion) {
    let heads = 8;
    let x = normal_tensor(Shape::new(1, 64, heads * 128), 6).into_data();
    let mut group = c.benchmark_group("quantize_token_8x128");
    group.throughput(Throughput::Elements(heads as u64));
    for kernels in kernel_sets() {
        for spec in ["int4-token", "int8-token", "int2-token"] {
            let spec: QuantSpec = spec.parse().unwrap();
            let codec = Codec::new(&spec, None);
            let row_bytes = kvq_quant_core::pack::packed_len(128, spec.bits()).unwrap();
            let mut params = vec![GroupParams::default(); heads];
            let mut scratch = vec![0u8; 128];
            let mut packed = vec![0u8; heads * row_bytes];
            let mut i = 0;
            group.bench_function(BenchmarkId::from_parameter(format!("{spec}/{}", kernels.name())), |b| {
                b.iter(|| {
                    i = (i + 1) % 64;
                    let token = black_box(&x[i * heads * 128..(i + 1) * heads * 128]);
                    for (p, row) in params.iter_mut().zip(token.chunks_exact(128)) {
                        row_params_with(&kernels, &codec, row, 128, std::slice::from_mut(p)).unwrap();
                    }
                    for ((p, row), out) in
                        params.iter().zip(token.chunks_exact(128)).zip(packed.chunks_exact_mut(row_bytes))
                    {
                        encode_row_with(
                            &kernels,
                            &codec,
                            spec.bits(),
                            row,
                            128,
                            std::slice::from_ref(p),
                            &mut scratch,
                            out,
                        )
                        .unwrap();
                    }
                    black_box(&packed);
                })
            });
        }
    }
    group.finish();
}

fn append(c: &mut Criterion) {
    let (heads, d, tokens) = (8, 128, 1024);
    let k = normal_tensor(Shape::new(1, tokens, heads * d), 7).into_data();
    let v = normal_tensor(Shape::new(1, tokens, heads * d), 8).into_data();
    let mut group = c.benchmark_group("append_1layer_8x128_k4ch_v4tok");
    group.throughput(Throughput::Elements(tokens as u64));
    for kernels in kernel_sets() {
        let config = CacheConfig::new(1, heads, d, heads * tokens / 32).with_row_kernels(kernels);
        group.bench_function(format!("1024_tokens/{}", kernels.name()), |b| {
            b.iter_batched(
                || {
                    let mut cache = PagedCache::new(config.clone()).unwrap();
                    let seq = cache.create();
                    (cache, seq)
                },
                |(mut cache, seq)| {
                    for t in 0..tokens {
                        let span = t * heads * d..(t + 1) * heads * d;
                        cache.append(seq, 0, &k[span.clone()], &v[span]).unwrap();
                    }
                    cache
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, row_quantize, token_rows, append);
criterion_main!(benches);
