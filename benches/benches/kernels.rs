//! Reading the cache: the score loop of one query against N keys (head_dim 128), and decode
//! attention for one Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128).
//!
//! Throughput is bytes of cache read (codes + parameters, or the f32/f16 keys), so GB/s
//! compares formats on what they cost in memory traffic. Baselines in the same run: a plain
//! f32 dot over f32 keys and an f16 dot (convert, then dot). Single thread unless named.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use kvq::attention::{ScorePath, decode_attention_path, decode_attention_with};
use kvq_cache_layout::{CacheConfig, PagedCache};
use kvq_kernels_simd::{Backend, Levels, Params, QuantBlock, scores_int8_with, scores_with};
use kvq_quant_core::synth::{Rng, normal_tensor};
use kvq_quant_core::{QuantSpec, Shape, quantize};
use std::hint::black_box;

const D: usize = 128;

fn f32_scores(keys: &[f32], q: &[f32], out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(D)) {
        // Eight independent lanes, so the compiler vectorizes the reduction.
        let mut acc = [0f32; 8];
        for (kc, qc) in k.chunks_exact(8).zip(q.chunks_exact(8)) {
            for i in 0..8 {
                acc[i] += kc[i] * qc[i];
            }
        }
        *o = acc.iter().sum();
    }
}

fn f16_scores(keys: &[f16], q: &[f32], out: &mut [f32]) {
    let mut row = [0f32; D];
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(D)) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(k, &mut row);
        let mut acc = [0f32; 8];
        for (kc, qc) in row.chunks_exact(8).zip(q.chunks_exact(8)) {
            for i in 0..8 {
                acc[i] += kc[i] * qc[i];
            }
        }
        *o = acc.iter().sum();
    }
}

fn scores(c: &mut Criterion) {
    let n = 4096;
    let keys = normal_tensor(Shape::new(1, n, D), 3);
    let q: Vec<f32> = normal_tensor(Shape::new(1, 1, D), 4).into_data();
    let mut out = vec![0f32; n];
    let mut group = c.benchmark_group("scores_4096x128");

    group.throughput(Throughput::Bytes((n * D * 4) as u64));
    group.bench_function("f32", |b| b.iter(|| f32_scores(black_box(keys.data()), &q, &mut out)));
    let keys16: Vec<f16> = keys.data().iter().map(|&x| f16::from_f32(x)).collect();
    group.throughput(Throughput::Bytes((n * D * 2) as u64));
    group.bench_function("f16", |b| b.iter(|| f16_scores(black_box(&keys16), &q, &mut out)));

    for spec in [
        "int8-token",
        "int4-token",
        "int2-token",
        "int8-channel",
        "int4-channel",
        "int2-channel",
        "fp8e4m3-token",
    ] {
        let parsed: QuantSpec = spec.parse().unwrap();
        let qt = quantize(&keys, &parsed).unwrap();
        let mem = qt.memory();
        let scale = qt.scales().to_f32();
        let offset = qt.offsets().map(|o| o.to_f32());
        let table: Vec<f32> = (0..=255u8).map(|c| kvq_quant_core::Fp8Format::E4M3.decode(c)).collect();
        let levels = if spec.starts_with("fp8") { Levels::Table(&table) } else { Levels::Affine };
        let params = if spec.contains("channel") {
            Params::PerChannel { scale: &scale, offset: offset.as_deref() }
        } else {
            Params::PerRow { scale: &scale, offset: offset.as_deref() }
        };
        let block = QuantBlock::new(qt.codes(), n, D, parsed.bits(), levels, params).unwrap();
        group.throughput(Throughput::Bytes(mem.total_bytes() as u64));
        for backend in
            [Backend::Scalar, Backend::Wide, Backend::Avx2].into_iter().filter(|b| b.is_available())
        {
            // Check the result before timing it.
            let mut reference = vec![0f32; n];
            scores_with(Backend::Scalar, &block, &q, 1, &mut reference).unwrap();
            scores_with(backend, &block, &q, 1, &mut out).unwrap();
            assert!(out.iter().zip(&reference).all(|(a, b)| (a - b).abs() <= 1e-3 * (1.0 + b.abs())));
            group.bench_with_input(BenchmarkId::new(spec, backend), &backend, |b, &backend| {
                b.iter(|| scores_with(backend, black_box(&block), &q, 1, &mut out).unwrap())
            });
        }
        if Backend::Avx2.is_available() && scores_int8_with(Backend::Avx2, &block, &q, 1, &mut out).unwrap() {
            group.bench_function(BenchmarkId::new(spec, "avx2-int8"), |b| {
                b.iter(|| scores_int8_with(Backend::Avx2, black_box(&block), &q, 1, &mut out).unwrap())
            });
        }
    }
    group.finish();
}

fn decode(c: &mut Criterion) {
    // 4k context fits in L3 in f32; 32k (256 MiB of f32 K+V) streams from DRAM.
    for len in [4096usize, 32768] {
        decode_at(c, len);
    }
}

fn decode_at(c: &mut Criterion, len: usize) {
    let (q_heads, kv_heads) = (32usize, 8usize);
    let mut rng = Rng::new(9);
    let kv = normal_tensor(Shape::new(kv_heads, len, D), 21);
    let vv = normal_tensor(Shape::new(kv_heads, len, D), 22);
    let q: Vec<f32> = (0..q_heads * D).map(|_| rng.normal() as f32).collect();
    let mut group = c.benchmark_group(format!("decode_llama3_8b_layer_{}k", len / 1024));
    group.sample_size(if len > 8192 { 10 } else { 20 });

    // f32 baseline: the same two-pass attention over contiguous f32 K and V.
    group.throughput(Throughput::Bytes((2 * kv_heads * len * D * 4) as u64));
    let mut out = vec![0f32; q_heads * D];
    group.bench_function("f32_contiguous", |b| {
        b.iter(|| {
            let g = q_heads / kv_heads;
            let mut s = vec![0f32; len];
            for h in 0..q_heads {
                let kvh = h / g;
                let keys = &kv.data()[kvh * len * D..(kvh + 1) * len * D];
                f32_scores(keys, &q[h * D..(h + 1) * D], &mut s);
                let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                s.iter_mut().for_each(|x| {
                    *x = ((*x / (D as f32).sqrt()) - max / (D as f32).sqrt()).exp();
                    sum += *x;
                });
                let o = &mut out[h * D..(h + 1) * D];
                o.fill(0.0);
                for (t, &w) in s.iter().enumerate() {
                    for (ov, &x) in o.iter_mut().zip(&vv.data()[(kvh * len + t) * D..(kvh * len + t + 1) * D])
                    {
                        *ov += w / sum * x;
                    }
                }
            }
            black_box(&out);
        })
    });

    for (k, v) in [("int4-channel", "int4-token"), ("int8-token", "int8-token")] {
        let config = CacheConfig::new(1, kv_heads, D, kv_heads * len / 32)
            .with_specs(k.parse().unwrap(), v.parse().unwrap())
            .with_block_size(32);
        let mut cache = PagedCache::new(config).unwrap();
        let seq = cache.create();
        cache.extend(seq, 0, &kv, &vv).unwrap();
        let mem = cache.memory();
        group.throughput(Throughput::Bytes(mem.used_bytes() as u64));
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for backend in [Backend::Wide, Backend::Avx2].into_iter().filter(|b| b.is_available()) {
            group.bench_function(format!("{k}/{v}/{backend}_1thread"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        decode_attention_with(backend, &cache, seq, 0, &q, q_heads, &mut out).unwrap()
                    })
                })
            });
        }
        if Backend::Avx2.is_available() {
            group.bench_function(format!("{k}/{v}/avx2-int8_1thread"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        decode_attention_path(
                            Backend::Avx2,
                            ScorePath::Int8,
                            &cache,
                            seq,
                            0,
                            &q,
                            q_heads,
                            &mut out,
                        )
                        .unwrap()
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, scores, decode);
criterion_main!(benches);
