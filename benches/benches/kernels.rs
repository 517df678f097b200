//! The one-thread DRAM read rate (a stream-read group, the floor of the DRAM-sized entries).
//! Reading the cache: the score loop of one query against N keys (head_dim 128 and 64; 4096
//! keys, cache-resident, and 8M keys, DRAM-resident: at least 256 MiB of keys in every format),
//! and decode attention for one Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head_dim
//! 128) at 4k and 32k tokens, on 1 and 2 threads; and batched decode of that layer (16
//! sequences × 4k tokens, 64 × 1k) in one call with a reused workspace.
//!
//! Throughput is bytes of cache read (codes + parameters, or the f32/f16 keys), so GB/s
//! compares formats on what they cost in memory traffic. Baselines in the same run: the FMA
//! kernels over f32 rows and over f16 rows widened in registers (F16C), and for decode the
//! GQA-aware `kvq::baseline::dense_attention` over contiguous f32 and f16 K and V. Single
//! thread unless named.
//! candle-core's q4_0/q8_0 `vec_dot` on the same keys lives in `benches/candle` (a separate
//! package, so ordinary builds never compile candle); `cargo xtask bench` runs both and puts
//! them in one table.

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use kvq::attention::{
    AttentionOptions, BatchSeq, DecodeWorkspace, ScorePath, decode_attention, decode_attention_batch,
};
use kvq::baseline::{DenseDims, DenseKv, DenseScratch, dense_attention};
use kvq_benches::{best_float, layer_cache};

/// How this file's group names begin: a filter that begins so names groups, and the groups it
/// does not name are skipped before their inputs are built (`kvq_benches::wanted`).
const GROUPS: &[&str] = &["scores_", "axpy_", "decode_", "stream_"];
use kvq_kernels_simd::{
    Backend, DenseRow, Kernels, Levels, Params, QuantBlock, axpy_int_with, axpy_with, dense_axpy_with,
    dense_scores_with, dispatch, scores_int8_with, scores_with,
};
use kvq_quant_core::synth::{Rng, normal_tensor};
use kvq_quant_core::{QuantSpec, Shape, quantize};
use std::hint::black_box;

const D: usize = 128;

/// A copy of `src` in memory advised for 2 MiB pages before it is written, as
/// `QuantizedKvCache` advises its block pools. The DRAM-sized groups read every format from
/// such memory, so that page walks favor none of them (one entry per group repeats the
/// headline kernel on ordinary 4 KiB pages).
fn in_huge_pages<T: bytemuck::Pod>(src: &[T]) -> Vec<T> {
    // Zeroed allocation: mapped lazily, so the advice comes before the first touch.
    let mut v: Vec<T> = bytemuck::zeroed_vec(src.len());
    kvq_kernels_simd::advise_huge_pages(bytemuck::cast_slice(&v));
    v.copy_from_slice(src);
    v
}

/// `src` in huge pages for the DRAM-sized groups, as it is otherwise.
fn place<T: bytemuck::Pod>(dram: bool, src: &[T]) -> Vec<T> {
    if dram { in_huge_pages(src) } else { src.to_vec() }
}

/// Keys of `n` rows of `d` channels: `BASE` rows of standard normal values from a fixed seed,
/// repeated (DRAM-resident sizes would take minutes to draw; repetition changes no timing).
fn keys(n: usize, d: usize) -> kvq_quant_core::Tensor {
    const BASE: usize = 65536;
    let base = normal_tensor(Shape::new(1, n.min(BASE), d), 3).into_data();
    let mut data = Vec::with_capacity(n * d);
    while data.len() < n * d {
        let take = (n * d - data.len()).min(base.len());
        data.extend_from_slice(&base[..take]);
    }
    kvq_quant_core::Tensor::new(Shape::new(1, n, d), data).unwrap()
}

/// What a group times: the score loop (one query against every key row) or the value
/// accumulation (one row of weights over every value row, `o += Σ_t p[t] · v̂[t]`).
#[derive(Clone, Copy, PartialEq)]
enum Read {
    Scores,
    Values,
}

/// Backends timed for one size: every one on cache-resident rows; the fastest only (and the
/// baselines) where a run streams gigabytes.
fn read_group(c: &mut Criterion, read: Read, n: usize, d: usize, all_backends: bool) {
    let what = if read == Read::Scores { "scores" } else { "axpy" };
    let name = if n > 1 << 20 { format!("{what}_dram_{n}x{d}") } else { format!("{what}_{n}x{d}") };
    if !kvq_benches::wanted(&name, GROUPS) {
        return;
    }
    // Entries a filter cannot select are not built either (8M rows of a format take a while).
    let want = |entry: &str| kvq_benches::wanted(&format!("{name}/{entry}"), GROUPS);
    let mut group = c.benchmark_group(&name);
    if n > 1 << 20 {
        group.sample_size(10);
    }
    let q: Vec<f32> = normal_tensor(Shape::new(1, 1, d), 4).into_data();
    // Softmax-like weights: positive, summing to about one.
    let p: Vec<f32> = {
        let mut rng = Rng::new(6);
        (0..n).map(|_| rng.uniform() as f32 * 2.0 / n as f32).collect()
    };
    let dram = n > 1 << 20;
    // The DRAM-sized scores (32 MiB of them) in huge pages too: on 4 KiB pages their page
    // walks cost the INT4 kernels 3-12 points of the stream rate on an Intel Xeon, a cost that
    // decode (which scores a block at a time into a small scratch) never pays.
    let mut out = place(dram, &vec![0f32; if read == Read::Scores { n } else { d }]);
    if want("f32") || want("f16") {
        let keys = place(dram, keys(n, d).data());
        if want("f32") {
            dense_entry(&mut group, "f32", read, &keys, d, &q, &p, &mut out);
        }
        if want("f16") {
            let keys16: Vec<f16> = keys.iter().map(|&x| f16::from_f32(x)).collect();
            let keys16 = place(dram, &keys16);
            drop(keys);
            dense_entry(&mut group, "f16", read, &keys16, d, &q, &p, &mut out);
        }
    }
    let specs: &[&str] = if d == D {
        &[
            "int8-token",
            "int4-token",
            "int2-token",
            "int8-channel",
            "int4-channel",
            "int2-channel",
            "fp8e4m3-token",
            "nf4-token",
            "int4-g32",
        ]
    } else {
        &["int8-token", "int4-token", "int8-channel", "int4-channel"]
    };
    for &spec in specs.iter().filter(|s| want(s)) {
        let parsed: QuantSpec = spec.parse().unwrap();
        let qt = quantize(&keys(n, d), &parsed).unwrap();
        let mem = qt.memory();
        let scale = place(dram, &qt.scales().to_f32());
        let offset = qt.offsets().map(|o| place(dram, &o.to_f32()));
        let codes = place(dram, qt.codes());
        let levels = if spec.starts_with("fp8") {
            Levels::Fp8(kvq_quant_core::Fp8Format::E4M3)
        } else if spec.starts_with("nf4") {
            Levels::Table(&kvq_quant_core::codebook::NF4_LEVELS)
        } else {
            Levels::Affine
        };
        let params = if spec.contains("channel") {
            Params::PerChannel { scale: &scale, offset: offset.as_deref() }
        } else if let kvq_quant_core::Granularity::Group(group) = parsed.granularity() {
            Params::PerGroup { group, scale: &scale, offset: offset.as_deref() }
        } else {
            Params::PerRow { scale: &scale, offset: offset.as_deref() }
        };
        let block = QuantBlock::new(&codes, n, d, parsed.bits(), levels, params).unwrap();
        group.throughput(Throughput::Bytes(mem.total_bytes() as u64));
        let backends: Vec<Kernels> = if all_backends {
            kvq_benches::kernels_of(&[Backend::Scalar, Backend::Wide, Backend::Avx2])
        } else {
            vec![best_float()]
        };
        // Check the result before timing it (on the first rows, for the big sizes).
        let check = n.min(4096);
        let small = QuantBlock::new(
            &qt.codes()[..check * block_row_bytes(d, parsed.bits())],
            check,
            d,
            parsed.bits(),
            levels,
            match params {
                Params::PerChannel { .. } => params,
                Params::PerRow { scale, offset } => {
                    Params::PerRow { scale: &scale[..check], offset: offset.map(|o| &o[..check]) }
                }
                Params::PerGroup { group, scale, offset } => {
                    let n = check * (d / group);
                    Params::PerGroup { group, scale: &scale[..n], offset: offset.map(|o| &o[..n]) }
                }
                _ => unreachable!("the specs benched have per-row, per-channel or per-group parameters"),
            },
        )
        .unwrap();
        let run = |backend: Kernels, blk: &QuantBlock<'_>, out: &mut [f32]| match read {
            Read::Scores => scores_with(backend, blk, &q, 1, out).unwrap(),
            Read::Values => axpy_with(backend, blk, &p[..blk.rows()], 1, out).unwrap(),
        };
        let reference = {
            let mut r = vec![0f32; out.len().min(check)];
            run(Kernels::SCALAR, &small, &mut r);
            r
        };
        for &backend in &backends {
            let got = &mut out[..reference.len()];
            got.fill(0.0);
            run(backend, &small, got);
            assert!(got.iter().zip(&reference).all(|(a, b)| (a - b).abs() <= 1e-3 * (1.0 + b.abs())));
            group.bench_with_input(BenchmarkId::new(spec, backend), &backend, |b, &backend| {
                b.iter(|| run(backend, black_box(&block), &mut out))
            });
        }
        if read == Read::Values {
            // The integer value path (weights rounded to bytes for INT4 codes, to i16 for
            // INT8), where the backend has it.
            let mut o = vec![0f32; d];
            if let Ok(avx512) = Kernels::new(Backend::Avx512)
                && axpy_int_with(avx512, &block, &p, 1, &mut o).unwrap()
            {
                group.bench_function(BenchmarkId::new(spec, "avx512-int"), |b| {
                    b.iter(|| axpy_int_with(avx512, black_box(&block), &p, 1, &mut out).unwrap())
                });
            }
            continue;
        }
        for backend in kvq_benches::kernels_of(&[Backend::Avx2, Backend::Avx512]) {
            if scores_int8_with(backend, &block, &q, 1, &mut out).unwrap() {
                group.bench_function(BenchmarkId::new(spec, format!("{backend}-int8")), |b| {
                    b.iter(|| scores_int8_with(backend, black_box(&block), &q, 1, &mut out).unwrap())
                });
            }
        }
        // The headline kernel once more on the quantizer's own allocation (4 KiB pages).
        if dram
            && spec == "int4-channel"
            && let Ok(avx512) = Kernels::new(Backend::Avx512)
        {
            let plain = QuantBlock::new(qt.codes(), n, d, parsed.bits(), levels, params).unwrap();
            group.bench_function(BenchmarkId::new(spec, "avx512-int8-4kpages"), |b| {
                b.iter(|| scores_int8_with(avx512, black_box(&plain), &q, 1, &mut out).unwrap())
            });
        }
    }
    group.finish();
}

/// A full-precision entry of a read group over the rows `x` of `d` values: the best float
/// kernels (FMA; f16 widened in registers with F16C), so that "vs f16" compares against code
/// an engine could have.
#[allow(clippy::too_many_arguments)]
fn dense_entry<T: DenseRow>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    label: &str,
    read: Read,
    x: &[T],
    d: usize,
    q: &[f32],
    p: &[f32],
    out: &mut [f32],
) {
    let (best, n) = (best_float(), x.len() / d);
    group.throughput(Throughput::Bytes(std::mem::size_of_val(x) as u64));
    group.bench_function(label, |b| match read {
        Read::Scores => b.iter(|| dense_scores_with(best, black_box(x), n, d, q, 1, out).unwrap()),
        Read::Values => b.iter(|| dense_axpy_with(best, black_box(x), n, d, p, 1, out).unwrap()),
    });
}

fn block_row_bytes(d: usize, bits: u8) -> usize {
    kvq_quant_core::pack::packed_len(d, bits).unwrap()
}

fn scores(c: &mut Criterion) {
    read_group(c, Read::Scores, 4096, D, true);
    read_group(c, Read::Scores, 4096, 64, false);
}

fn values(c: &mut Criterion) {
    read_group(c, Read::Values, 4096, D, true);
    read_group(c, Read::Values, 4096, 64, false);
}

/// 8M keys: 4 GiB in f32, 256 MiB of codes in INT2 (plus parameters), so every format streams
/// from DRAM.
fn scores_dram(c: &mut Criterion) {
    read_group(c, Read::Scores, 8 << 20, D, false);
}

/// The value accumulation over the same 8M rows.
fn values_dram(c: &mut Criterion) {
    read_group(c, Read::Values, 8 << 20, D, false);
}

fn decode(c: &mut Criterion) {
    // 4k context fits in L3 in f32; 32k (256 MiB of f32 K+V) streams from DRAM.
    for len in [4096usize, 32768] {
        decode_at(c, len);
    }
}

fn decode_at(c: &mut Criterion, len: usize) {
    let name = format!("decode_llama3_8b_layer_{}k", len / 1024);
    if !kvq_benches::wanted(&name, GROUPS) {
        return;
    }
    let (q_heads, kv_heads) = (32usize, 8usize);
    let mut rng = Rng::new(9);
    let kv = normal_tensor(Shape::new(kv_heads, len, D), 21);
    let vv = normal_tensor(Shape::new(kv_heads, len, D), 22);
    let q: Vec<f32> = (0..q_heads * D).map(|_| rng.normal() as f32).collect();
    let mut group = c.benchmark_group(&name);
    group.sample_size(if len > 8192 { 10 } else { 20 });

    // Baselines: contiguous f32 and f16 K and V through `kvq::baseline::dense_attention`, which
    // reads each row once per KV head for its GQA group on the FMA kernels (f16 widened in
    // registers with F16C), as a good f16 kernel does.
    let mut out = vec![0f32; q_heads * D];
    let dims = DenseDims { q_heads, kv_heads, head_dim: D, tokens: len };
    let mut scratch = DenseScratch::default();
    let best = best_float();
    group.throughput(Throughput::Bytes((2 * kv_heads * len * D * 4) as u64));
    let f32_kv = DenseKv::F32 { k: kv.data(), v: vv.data() };
    group.bench_function("f32_gqa", |b| {
        b.iter(|| dense_attention(best, &f32_kv, dims, &q, &mut out, &mut scratch).unwrap())
    });
    let k16: Vec<f16> = kv.data().iter().map(|&x| f16::from_f32(x)).collect();
    let v16: Vec<f16> = vv.data().iter().map(|&x| f16::from_f32(x)).collect();
    group.throughput(Throughput::Bytes((2 * kv_heads * len * D * 2) as u64));
    let f16_kv = DenseKv::F16 { k: &k16, v: &v16 };
    group.bench_function("f16_gqa", |b| {
        b.iter(|| dense_attention(best, &f16_kv, dims, &q, &mut out, &mut scratch).unwrap())
    });
    drop((k16, v16));

    for (k, v) in [
        ("int4-channel", "int4-token"),
        ("int8-token", "int8-token"),
        ("int2-channel", "int2-token"),
        // The rotated, error-minimizing values of the fidelity work (one inverse rotation
        // per output row on top of the INT4 kernels).
        ("int4-channel", "int4-token-mse-rot"),
        // Bits per key channel (three widths, `ChannelBits::spread`) with those values.
        ("int4-channel-qa", "int4-token-mse-rot"),
        ("int3-channel-qa", "int3-token-mse-rot"),
        // What `kvq recommend --budget-bits 4.5` picks for most layers of SmolLM2 (values per
        // group), and INT4 per group on both sides: fused kernels on AVX-512 VNNI.
        ("int4-channel32-p8", "int4-g32-mse-rot-p8"),
        ("int4-g32", "int4-g32"),
    ] {
        // Caches whose entries a filter cannot select are not built.
        if !kvq_benches::wanted(&format!("{name}/{k}/{v}"), GROUPS) {
            continue;
        }
        let mut cache = layer_cache(kv_heads, D, kv_heads * len / 32, k, v);
        let seq = cache.create();
        cache.extend(seq, 0, &kv, &vv).unwrap();
        let mem = cache.memory();
        group.throughput(Throughput::Bytes(mem.used_bytes() as u64));
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for backend in kvq_benches::kernels_of(&[Backend::Wide, Backend::Avx2]) {
            let on_backend = AttentionOptions::default().backend(backend);
            group.bench_function(format!("{k}/{v}/{backend}_1thread"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        decode_attention(&on_backend, &cache, seq, 0, &q, q_heads, &mut out).unwrap()
                    })
                })
            });
        }
        // Two threads (this machine's cores): KV heads spread over both.
        let pool2 = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let best = best_float();
        let on_best = AttentionOptions::default().backend(best);
        group.bench_function(format!("{k}/{v}/{best}_2threads"), |b| {
            b.iter(|| {
                pool2.install(|| decode_attention(&on_best, &cache, seq, 0, &q, q_heads, &mut out).unwrap())
            })
        });
        // The integer score path (int8 query), with each backend's integer kernel, and on two
        // threads with the best one.
        let int8 = |backend: Kernels, pool: &rayon::ThreadPool, out: &mut [f32]| {
            pool.install(|| {
                decode_attention(
                    &AttentionOptions::with_path(ScorePath::Int8).backend(backend),
                    &cache,
                    seq,
                    0,
                    &q,
                    q_heads,
                    out,
                )
                .unwrap()
            })
        };
        let int8_backends = kvq_benches::kernels_of(&[Backend::Avx2, Backend::Avx512]);
        for &backend in &int8_backends {
            group.bench_function(format!("{k}/{v}/{backend}-int8_1thread"), |b| {
                b.iter(|| int8(backend, &pool, &mut out))
            });
        }
        if let Some(&best) = int8_backends.last() {
            group.bench_function(format!("{k}/{v}/{best}-int8_2threads"), |b| {
                b.iter(|| int8(best, &pool2, &mut out))
            });
        }
    }
    group.finish();
}

/// Continuous batching: one decode step of many sequences of one Llama-3-8B-shaped layer in
/// one `decode_attention_batch` call, with a workspace kept across steps (no allocation per
/// step), on one thread and on two.
fn decode_batch(c: &mut Criterion) {
    for (seqs, len) in [(16usize, 4096usize), (64, 1024)] {
        let name = format!("decode_batch_{seqs}x{}k", len / 1024);
        if !kvq_benches::wanted(&name, GROUPS) {
            continue;
        }
        let (q_heads, kv_heads) = (32usize, 8usize);
        let mut rng = Rng::new(17);
        let kv = normal_tensor(Shape::new(kv_heads, len, D), 23);
        let vv = normal_tensor(Shape::new(kv_heads, len, D), 24);
        let mut group = c.benchmark_group(name);
        group.sample_size(10);
        let (k, v) = ("int4-channel", "int4-token");
        let mut cache = layer_cache(kv_heads, D, seqs * kv_heads * len / 32, k, v);
        let batch: Vec<BatchSeq> = (0..seqs)
            .map(|_| {
                let seq = cache.create();
                cache.extend(seq, 0, &kv, &vv).unwrap();
                BatchSeq::decode(seq)
            })
            .collect();
        group.throughput(Throughput::Bytes(cache.memory().used_bytes() as u64));
        let q: Vec<f32> = (0..seqs * q_heads * D).map(|_| rng.normal() as f32).collect();
        let mut out = vec![0f32; q.len()];
        let best = dispatch::selected().unwrap();
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for path in [ScorePath::Float, ScorePath::Int8] {
                let options = AttentionOptions::with_path(path);
                let mut ws = DecodeWorkspace::new();
                let name = format!(
                    "{k}/{v}/{best}{}_{threads}thread",
                    if path == ScorePath::Int8 { "-int8" } else { "" }
                );
                group.bench_function(name, |b| {
                    b.iter(|| {
                        pool.install(|| {
                            decode_attention_batch(
                                &options.backend(best),
                                &cache,
                                0,
                                &batch,
                                &q,
                                q_heads,
                                &mut out,
                                &mut ws,
                            )
                            .unwrap()
                        })
                    })
                });
            }
        }
        group.finish();
    }
}

/// The machine's one-thread DRAM read rate in this run (`kvq::baseline::stream_read` over
/// 512 MiB): the floor against which the DRAM-sized entries are read (bytes ÷ this rate).
fn stream(c: &mut Criterion) {
    const BYTES: usize = 512 << 20;
    if !kvq_benches::wanted("stream_read_512MiB", GROUPS) {
        return;
    }
    let data = in_huge_pages(&vec![1u64; BYTES / 8]);
    let mut group = c.benchmark_group("stream_read_512MiB");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("u64_sum", |b| b.iter(|| kvq::baseline::stream_read(black_box(&data))));
    group.finish();
}

criterion_group!(benches, stream, scores, values, scores_dram, values_dram, decode, decode_batch);
criterion_main!(benches);
