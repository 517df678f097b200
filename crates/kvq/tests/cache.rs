//! The high-level cache: configs that round-trip through TOML and JSON and are validated on
//! load, and a multi-layer cache whose failed calls change nothing.

use kvq::prelude::*;

fn config() -> KvCacheConfig {
    KvCacheConfig::builder(3, 2, 6, 32)
        .block_size(8)
        .layer_specs(1, "int8-token".parse().unwrap(), "int8-token".parse().unwrap())
        .blocks_per_layer(64)
        .rope_pairing(kvq::quant::RopePairing::Interleaved)
        .build()
        .unwrap()
}

#[test]
fn config_round_trips_through_toml_and_json() {
    let c = config();
    let toml = c.to_toml();
    assert!(toml.contains("version = 1") && toml.contains("k = \"int8-token\""), "{toml}");
    assert!(toml.contains("rope_pairing = \"interleaved\""), "{toml}");
    assert_eq!(KvCacheConfig::from_toml(&toml).unwrap(), c);
    assert_eq!(KvCacheConfig::from_json(&c.to_json()).unwrap(), c);
    // The row window is written only when on; files without it load with it off.
    assert!(!toml.contains("row_window"), "{toml}");
    let windowed = KvCacheConfig { row_window: true, ..c.clone() };
    let text = windowed.to_toml();
    assert!(text.contains("row_window = true"), "{text}");
    assert_eq!(KvCacheConfig::from_toml(&text).unwrap(), windowed);
    assert_eq!(KvCacheConfig::from_json(&windowed.to_json()).unwrap(), windowed);
    // So is the values' own window storage (8 bits by default): files without it have the
    // keys' storage for both.
    assert!(toml.contains("tail_dtype = \"f16\"") && toml.contains("value_tail_dtype = \"int8\""), "{toml}");
    let same = KvCacheConfig { value_tail_dtype: None, ..c.clone() };
    let text = same.to_toml();
    assert!(!text.contains("value_tail_dtype"), "{text}");
    assert_eq!(KvCacheConfig::from_toml(&text).unwrap(), same);
    assert_eq!(KvCacheConfig::from_json(&same.to_json()).unwrap(), same);
    assert_eq!(KvCacheConfig::from_toml(&toml.replace("value_tail_dtype = \"int8\"\n", "")).unwrap(), same);
    let dir = std::env::temp_dir().join(format!("kvq-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in [("c.toml", toml.clone()), ("c.json", c.to_json())] {
        std::fs::write(dir.join(name), text).unwrap();
        assert_eq!(KvCacheConfig::load(dir.join(name)).unwrap(), c);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Fixed-codebook specs write their levels beside their text (`codebook3-token` names none):
/// the config reads back equal, and the cache's sequences leave and come back as any other's.
#[test]
fn fixed_codebooks_round_trip_through_configs_and_sequence_files() {
    use kvq::quant::{Codebook, CodebookSource, Granularity, Kind, ParamDtype};
    let levels = vec![-1.0, -0.55, -0.3, -0.12, 0.04, 0.21, 0.5, 1.0];
    let kind = Kind::Codebook(CodebookSource::Fixed(Codebook::new(levels).unwrap()));
    let v = QuantSpec::new(kind, 3, Granularity::PerToken, ParamDtype::F16).unwrap();
    let c = KvCacheConfig::builder(2, 1, 2, 32)
        .block_size(8)
        .specs("int4-channel".parse().unwrap(), v)
        .blocks_per_layer(32)
        .build()
        .unwrap();
    let toml = c.to_toml();
    assert!(toml.contains("v = \"codebook3-token\"") && toml.contains("v_levels"), "{toml}");
    assert_eq!(KvCacheConfig::from_toml(&toml).unwrap(), c);
    assert_eq!(KvCacheConfig::from_json(&c.to_json()).unwrap(), c);
    // Without its levels the spec is an error, not some other codebook.
    let cut: String = toml.lines().filter(|l| !l.starts_with("v_levels")).map(|l| format!("{l}\n")).collect();
    assert!(matches!(KvCacheConfig::from_toml(&cut), Err(KvqError::Config(_))), "{cut}");
    let per = c.kv_heads * c.head_dim;
    let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
    let seq = cache.create();
    for t in 0..29 {
        cache.append_all_layers(seq, &token(2 * per, t), &token(2 * per, t + 5)).unwrap();
    }
    let q = token(c.query_heads * c.head_dim, 2);
    let mut other = QuantizedKvCache::new(KvCacheConfig::from_toml(&toml).unwrap()).unwrap();
    let back = other.import_sequence(&cache.export_sequence(seq).unwrap()).unwrap();
    assert_eq!(attend_layers(&other, back, 2, &q), attend_layers(&cache, seq, 2, &q));
}

#[test]
fn bad_configs_are_errors() {
    let good = config().to_toml();
    for (from, to) in [
        ("version = 1", "version = 2"),
        ("query_heads = 6", "query_heads = 5"),
        ("k = \"int8-token\"", "k = \"int9-token\""),
        ("block_size = 8", "block_size = 0"),
        ("k = \"int8-token\"", "k = \"int4-head\""),
        ("tail_dtype = \"f16\"", "tail_dtype = \"int4\""),
    ] {
        let bad = good.replacen(from, to, 1);
        assert!(matches!(KvCacheConfig::from_toml(&bad), Err(KvqError::Config(_))), "{to}");
    }
    assert!(KvCacheConfig::from_toml(&good[..good.len() / 2]).is_err());
    assert!(KvCacheConfig::from_json("{").is_err());
    assert!(matches!(KvCacheConfig::load("/nonexistent/kvq.toml"), Err(KvqError::Io { .. })));
    assert!(
        KvCacheConfig::builder(2, 2, 2, 8)
            .layer_specs(5, "int4-token".parse().unwrap(), "int4-token".parse().unwrap())
            .build()
            .is_err()
    );
}

#[test]
fn a_multi_layer_cache_stays_consistent() {
    let mut cache = QuantizedKvCache::new(config()).unwrap();
    let seq = cache.create();
    let row = |t: usize| -> Vec<f32> { (0..64).map(|i| ((i * 7 + t * 3) % 11) as f32 * 0.1 - 0.5).collect() };
    for t in 0..30 {
        for l in 0..3 {
            cache.append(seq, l, &row(t), &row(t + 1)).unwrap();
        }
    }
    let fork = cache.fork(seq).unwrap();
    assert_eq!(cache.len(fork, 2).unwrap(), 30);
    // Layers 0 and 2 quantize keys per channel in blocks of 8 (one residual block): tokens
    // 4..12 are a quantized block, so truncating to 7 fails and must leave every layer intact.
    let before: Vec<usize> = (0..3).map(|l| cache.len(seq, l).unwrap()).collect();
    assert!(cache.truncate(seq, 7).is_err());
    assert_eq!((0..3).map(|l| cache.len(seq, l).unwrap()).collect::<Vec<_>>(), before);
    cache.truncate(seq, 12).unwrap();
    assert!((0..3).all(|l| cache.len(seq, l).unwrap() == 12));
    let q: Vec<f32> = (0..6 * 32).map(|i| (i % 5) as f32 * 0.2).collect();
    let mut out = vec![0f32; q.len()];
    cache.attention(&AttentionOptions::default(), fork, 1, &q, &mut out).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
    let used = cache.used_bytes();
    cache.free(fork).unwrap();
    assert!(cache.used_bytes() < used);
    assert!(cache.free(fork).is_err());
    assert!(cache.append(seq, 3, &row(0), &row(0)).is_err());
}

/// The row kernels of this CPU (AVX2 where present, chosen by `QuantizedKvCache`) write the
/// same bytes as the portable ones: real keys and values streamed token by token, with
/// per-token, group, symmetric and per-channel specs, give identical offload files.
#[test]
fn row_kernels_of_this_cpu_write_the_portable_bytes() {
    use kvq::layout::{CacheConfig, PagedCache};
    use kvq::quant::RowKernels;
    use kvq::quant::io::TensorFile;
    let file = TensorFile::from_bytes("sample", kvq::SAMPLE.to_vec()).unwrap();
    let (k, v) = (file.read("layer9.k").unwrap(), file.read("layer9.v").unwrap());
    let s = k.shape();
    let fast = kvq::kernels::row_kernels().unwrap();
    for (ks, vs) in [("int4-channel", "int4-token"), ("int2-token", "int8-g32"), ("sym4-token", "int3-g16")] {
        let bytes = |kernels: RowKernels| {
            let config = CacheConfig::new(1, s.heads, s.head_dim, s.heads * s.tokens.div_ceil(16))
                .with_specs(ks.parse().unwrap(), vs.parse().unwrap())
                .with_block_size(16)
                .with_row_kernels(kernels);
            let mut cache = PagedCache::new(config).unwrap();
            let seq = cache.create();
            let mut kt = vec![0f32; s.heads * s.head_dim];
            let mut vt = kt.clone();
            for t in 0..s.tokens {
                for h in 0..s.heads {
                    kt[h * s.head_dim..(h + 1) * s.head_dim].copy_from_slice(k.row(0, h, t));
                    vt[h * s.head_dim..(h + 1) * s.head_dim].copy_from_slice(v.row(0, h, t));
                }
                cache.append(seq, 0, &kt, &vt).unwrap();
            }
            cache.to_bytes().unwrap()
        };
        assert!(bytes(fast) == bytes(RowKernels::PORTABLE), "{ks}/{vs} with {fast:?}");
    }
}

/// Layer 9 of the embedded SmolLM2 sample: keys, values, queries.
fn sample_layer9() -> (kvq::quant::Tensor, kvq::quant::Tensor, kvq::quant::Tensor) {
    let file = kvq::quant::io::TensorFile::from_bytes("sample", kvq::SAMPLE.to_vec()).unwrap();
    let read = |s: &str| file.read(&format!("layer9.{s}")).unwrap();
    (read("k"), read("v"), read("q"))
}

/// Appends the first `tokens` tokens of `k` and `v` (heads × tokens × head_dim) to layer 0 of
/// `seq`, one token at a time; returns the query rows of every query head at the last one.
fn append_tokens(
    cache: &mut QuantizedKvCache,
    seq: SeqId,
    (k, v, q): (&kvq::quant::Tensor, &kvq::quant::Tensor, &kvq::quant::Tensor),
    tokens: usize,
) -> Vec<f32> {
    let (s, qs) = (k.shape(), q.shape());
    let d = s.head_dim;
    let (mut kt, mut vt) = (vec![0f32; s.heads * d], vec![0f32; s.heads * d]);
    for t in 0..tokens {
        for h in 0..s.heads {
            let at = (h * s.tokens + t) * d;
            kt[h * d..(h + 1) * d].copy_from_slice(&k.data()[at..at + d]);
            vt[h * d..(h + 1) * d].copy_from_slice(&v.data()[at..at + d]);
        }
        cache.append(seq, 0, &kt, &vt).unwrap();
    }
    let t = tokens - 1;
    (0..qs.heads)
        .flat_map(|h| q.data()[(h * qs.tokens + t) * d..(h * qs.tokens + t + 1) * d].to_vec())
        .collect()
}

/// `‖a − b‖ / ‖b‖`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let e2: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x - y).powi(2)).sum();
    let r2: f64 = b.iter().map(|&y| f64::from(y).powi(2)).sum();
    (e2 / r2).sqrt()
}

/// The integer paths on real keys, values and queries (the embedded sample: 3 KV heads, 9
/// query heads, head_dim 64): INT4 keys per channel meet int8 queries, INT8 values per token
/// meet i16 weights (on AVX-512 VNNI; elsewhere whichever integer kernels the CPU has), and
/// the outputs stay within 1% of the float path's at every position asked.
#[test]
fn integer_attention_on_real_data_tracks_the_float_path() {
    use kvq::attention::{AttentionOptions, ScorePath};
    let (k, v, q) = sample_layer9();
    let (s, qs) = (k.shape(), q.shape());
    let config = KvCacheConfig::builder(1, s.heads, qs.heads, s.head_dim)
        .block_size(32)
        .layer_specs(0, "int4-channel".parse().unwrap(), "int8-token".parse().unwrap())
        .blocks_per_layer(2 * s.heads * s.tokens.div_ceil(32))
        .build()
        .unwrap();
    let mut cache = QuantizedKvCache::new(config).unwrap();
    let seq = cache.create();
    let query = append_tokens(&mut cache, seq, (&k, &v, &q), s.tokens);
    let (mut float, mut int) = (vec![0f32; query.len()], vec![0f32; query.len()]);
    cache.attention(&AttentionOptions::with_path(ScorePath::Float), seq, 0, &query, &mut float).unwrap();
    cache.attention(&AttentionOptions::with_path(ScorePath::Int8), seq, 0, &query, &mut int).unwrap();
    let rel = rel(&int, &float);
    // Where the selected backend has integer kernels they ran, and rounding shows.
    use kvq::kernels::Backend;
    if matches!(
        kvq::kernels::dispatch::selected().map(|k| k.backend()),
        Ok(Backend::Avx2 | Backend::Avx512 | Backend::Dotprod)
    ) {
        assert!(rel > 0.0, "the integer path did not run");
    }
    assert!(rel < 1e-2, "relative difference {rel}");
}

/// `int4-channel32` keys in blocks of 128 tokens hold what blocks of 32 hold (a set of channel
/// parameters per 32 tokens): with every token quantized, the same bytes of blocks and the
/// same attention on the float path; the integer path (weights rounded per block) close to
/// it, on real keys and values.
#[test]
fn key_groups_inside_larger_blocks_hold_the_same_keys() {
    use kvq::attention::{AttentionOptions, ScorePath};
    let (k, v, q) = sample_layer9();
    let (s, qs) = (k.shape(), q.shape());
    let (d, tokens) = (s.head_dim, s.tokens / 128 * 128);
    let run = |bs: usize| {
        let config = KvCacheConfig::builder(1, s.heads, qs.heads, d)
            .block_size(bs)
            .residual_blocks(0)
            .sink_tokens(0)
            .specs("int4-channel32".parse().unwrap(), "int4-token".parse().unwrap())
            .blocks_per_layer(s.heads * tokens.div_ceil(bs))
            .build()
            .unwrap();
        let mut cache = QuantizedKvCache::new(config).unwrap();
        let seq = cache.create();
        let query = append_tokens(&mut cache, seq, (&k, &v, &q), tokens);
        let mut out = [vec![0f32; query.len()], vec![0f32; query.len()]];
        for (o, path) in out.iter_mut().zip([ScorePath::Float, ScorePath::Int8]) {
            cache.attention(&AttentionOptions::with_path(path), seq, 0, &query, o).unwrap();
        }
        let m = &cache.memory()[0].layers[0];
        ((m.code_bytes, m.param_bytes, m.tail_bytes), out)
    };
    let ((small_bytes, small), (large_bytes, large)) = (run(32), run(128));
    // The same codes and parameters (the block tables differ: a quarter of the entries).
    assert_eq!(small_bytes, large_bytes, "the same bytes for the same tokens");
    assert!(rel(&large[0], &small[0]) < 1e-5, "float path: {}", rel(&large[0], &small[0]));
    assert!(rel(&large[1], &small[1]) < 3.5e-2, "integer path: {}", rel(&large[1], &small[1]));
}

fn token(n: usize, t: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 13 + t * 7) % 29) as f32 / 10.0 - 1.4).collect()
}

/// One call for every layer equals one call per layer; a bad value in the last layer, or a
/// wrong length, changes no layer.
#[test]
fn append_all_layers_is_all_or_nothing() {
    let c = config();
    let per = c.kv_heads * c.head_dim;
    let (mut one, mut each) =
        (QuantizedKvCache::new(c.clone()).unwrap(), QuantizedKvCache::new(c.clone()).unwrap());
    let (s1, s2) = (one.create(), each.create());
    for t in 0..20 {
        let (k, v) = (token(3 * per, t), token(3 * per, t + 1));
        one.append_all_layers(s1, &k, &v).unwrap();
        for l in 0..3 {
            each.append(s2, l, &k[l * per..(l + 1) * per], &v[l * per..(l + 1) * per]).unwrap();
        }
    }
    for l in 0..3 {
        assert_eq!(one.layer(l), each.layer(l), "layer {l}");
    }
    assert_eq!(one.blocks_needed(s1, 1).unwrap(), each.blocks_needed(s2, 1).unwrap());
    let before: Vec<_> = (0..3).map(|l| one.layer(l).unwrap().paged().clone()).collect();
    let mut k = token(3 * per, 99);
    k[3 * per - 1] = f32::NAN;
    assert!(one.append_all_layers(s1, &k, &token(3 * per, 5)).is_err());
    assert!(one.append_all_layers(s1, &k[1..], &k[1..]).is_err());
    for (l, layer) in before.iter().enumerate() {
        assert_eq!(one.layer(l).unwrap().paged(), layer, "layer {l} changed");
    }
}

#[test]
fn blocks_needed_predicts_what_appends_take() {
    let mut cache = QuantizedKvCache::new(config()).unwrap();
    let seq = cache.create();
    let per = 2 * 32;
    for t in 0..37 {
        let need = cache.blocks_needed(seq, 1).unwrap();
        let free = cache.free_blocks();
        cache.append_all_layers(seq, &token(3 * per, t), &token(3 * per, t)).unwrap();
        let after = cache.free_blocks();
        for l in 0..3 {
            assert_eq!(free[l] - after[l], need[l], "token {t} layer {l}");
        }
    }
    assert_eq!(cache.blocks_needed(seq, 64).unwrap().len(), 3);
}

/// Attention of `q` over `seq` in each of the first `layers` layers.
fn attend_layers(cache: &QuantizedKvCache, seq: SeqId, layers: usize, q: &[f32]) -> Vec<Vec<f32>> {
    (0..layers)
        .map(|l| {
            let mut out = vec![0f32; q.len()];
            cache.attention(&AttentionOptions::default(), seq, l, q, &mut out).unwrap();
            out
        })
        .collect()
}

/// A sequence leaves through `export_sequence` and comes back, in the same or another cache of
/// the same config, attending exactly as before; a damaged or foreign file changes nothing.
#[test]
fn sequences_export_and_import_across_layers() {
    let c = config();
    let per = c.kv_heads * c.head_dim;
    let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
    let seq = cache.create();
    for t in 0..45 {
        cache.append_all_layers(seq, &token(3 * per, t), &token(3 * per, t + 3)).unwrap();
    }
    let file = cache.export_sequence(seq).unwrap();
    let q = token(c.query_heads * c.head_dim, 1);
    let attend = |cache: &QuantizedKvCache, s: SeqId| attend_layers(cache, s, 3, &q);
    let mut other = QuantizedKvCache::new(c.clone()).unwrap();
    let back = other.import_sequence(&file).unwrap();
    assert_eq!(attend(&other, back), attend(&cache, seq));
    cache.free(seq).unwrap();
    let again = cache.import_sequence(&file).unwrap();
    assert_eq!(attend(&cache, again), attend(&other, back));

    let before: Vec<_> = (0..3).map(|l| other.layer(l).unwrap().paged().clone()).collect();
    let mut damaged = file.clone();
    let i = damaged.len() / 2;
    damaged[i] ^= 4;
    for bad in [&damaged[..], &file[..file.len() - 1], &file[..10], b"not a file"] {
        assert!(other.import_sequence(bad).is_err());
    }
    let foreign = KvCacheConfig::builder(3, 2, 6, 32).block_size(16).blocks_per_layer(64).build().unwrap();
    let mut f = QuantizedKvCache::new(foreign).unwrap();
    let e = f.import_sequence(&file).unwrap_err();
    assert!(e.to_string().contains("another configuration"), "{e}");
    // Too few free blocks (the sequence takes 12 per layer, 8 are free): refused before any layer imports.
    let small = KvCacheConfig { blocks_per_layer: 16, ..c };
    let mut tiny = QuantizedKvCache::new(small).unwrap();
    let busy = tiny.create();
    for t in 0..30 {
        tiny.append_all_layers(busy, &token(3 * per, t), &token(3 * per, t)).unwrap();
    }
    let free = tiny.free_blocks();
    let e = tiny.import_sequence(&file).unwrap_err();
    assert!(matches!(e, KvqError::Cache(kvq::layout::CacheError::PoolExhausted { .. })), "{e}");
    assert_eq!(tiny.free_blocks(), free);
    for (l, layer) in before.iter().enumerate() {
        assert_eq!(other.layer(l).unwrap().paged(), layer);
    }
}

/// Appends and attention in f16 and bf16 are the f32 calls on the widened inputs, with each
/// output rounded once to the caller's type; batch, chunk and single calls alike.
#[test]
fn half_precision_inputs_and_outputs_match_the_f32_path() {
    use half::{bf16, f16};
    fn run<T: Element>(label: &str) {
        let c = KvCacheConfig::builder(2, 2, 6, 32)
            .block_size(8)
            .sink_tokens(2)
            .layer_specs(1, "int4-g16".parse().unwrap(), "int8-token-rot".parse().unwrap())
            .blocks_per_layer(64)
            .build()
            .unwrap();
        let (mut narrow, mut wide) =
            (QuantizedKvCache::new(c.clone()).unwrap(), QuantizedKvCache::new(c).unwrap());
        let (a, b) = (narrow.create(), wide.create());
        let n = |x: &[f32]| -> Vec<T> { x.iter().map(|&v| T::from_f32(v)).collect() };
        let w = |x: &[T]| -> Vec<f32> { x.iter().map(|v| v.to_f32()).collect() };
        for t in 0..29 {
            let (k, v) = (n(&token(2 * 32, t)), n(&token(2 * 32, t + 5)));
            if t % 2 == 0 {
                narrow
                    .append_all_layers(a, &[k.clone(), k.clone()].concat(), &[v.clone(), v.clone()].concat())
                    .unwrap();
            } else {
                for l in 0..2 {
                    narrow.append(a, l, &k, &v).unwrap();
                }
            }
            for l in 0..2 {
                wide.append(b, l, &w(&k), &w(&v)).unwrap();
            }
        }
        assert_eq!(narrow.used_bytes(), wide.used_bytes(), "{label}");
        let q: Vec<T> = n(&(0..3 * 6 * 32).map(|i| ((i * 13) % 17) as f32 * 0.1 - 0.8).collect::<Vec<_>>());
        let options = AttentionOptions::default();
        for l in 0..2 {
            let (mut o_n, mut o_w) = (vec![T::ZERO; q.len()], vec![0f32; q.len()]);
            narrow.attention(&options.chunk(3), a, l, &q, &mut o_n).unwrap();
            wide.attention(&options.chunk(3), b, l, &w(&q), &mut o_w).unwrap();
            let expect: Vec<T> = n(&o_w);
            assert!(o_n.iter().zip(&expect).all(|(x, y)| x.to_f32() == y.to_f32()), "{label} layer {l}");
            let mut one = vec![T::ZERO; 6 * 32];
            narrow.attention(&AttentionOptions::default(), a, l, &q[2 * 6 * 32..], &mut one).unwrap();
            assert!(one.iter().all(|x| x.to_f32().is_finite()), "{label}");
        }
    }
    run::<f16>("f16");
    run::<bf16>("bf16");
    run::<f32>("f32");
}

/// Non-finite f16 input is refused like f32's; an output beyond f16's range is an error that
/// leaves `out` as it was, not an infinity.
#[test]
fn half_precision_edge_cases_are_typed_errors() {
    use half::f16;
    let c = KvCacheConfig::builder(1, 1, 1, 32).block_size(8).blocks_per_layer(16).build().unwrap();
    let mut cache = QuantizedKvCache::new(c).unwrap();
    let seq = cache.create();
    let mut k = vec![f16::from_f32(0.5); 32];
    k[3] = f16::NAN;
    let v = vec![f16::from_f32(1.0); 32];
    assert!(matches!(
        cache.append(seq, 0, &k, &v),
        Err(KvqError::Cache(kvq::layout::CacheError::NonFinite { .. }))
    ));
    k[3] = f16::INFINITY;
    assert!(cache.append(seq, 0, &k, &v).is_err());
    assert_eq!(cache.len(seq, 0).unwrap(), 0);
    // Values as large as f16 parameters allow: the output fits in f16.
    let big = vec![30000f32; 32];
    for _ in 0..3 {
        cache.append(seq, 0, &[0.1f32; 32], &big).unwrap();
    }
    let mut out = vec![f16::from_f32(7.0); 32];
    let q = vec![f16::from_f32(0.1); 32];
    cache.attention(&AttentionOptions::default(), seq, 0, &q, &mut out).unwrap();
    let spec: QuantSpec = "int8-token-f32".parse().unwrap();
    let huge = KvCacheConfig::builder(1, 1, 1, 32)
        .specs(spec.clone(), spec)
        .tail_dtype(TailDtype::F32)
        .blocks_per_layer(16)
        .build()
        .unwrap();
    let mut huge = QuantizedKvCache::new(huge).unwrap();
    let s = huge.create();
    // f32 parameters hold values beyond f16's range: their average does not fit in f16.
    for _ in 0..6 {
        huge.append(s, 0, &[0.1f32; 32], &[1e6f32; 32]).unwrap();
    }
    let before = out.clone();
    let err = huge.attention(&AttentionOptions::default(), s, 0, &q, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            KvqError::Attention(kvq::attention::AttentionError::OutputOverflow { dtype: "f16", .. })
        ),
        "{err}"
    );
    assert_eq!(out, before, "out is untouched on error");
    let mut wide = vec![0f32; 32];
    huge.attention(&AttentionOptions::default(), s, 0, &[0.1f32; 32], &mut wide).unwrap();
    assert!(wide.iter().all(|&x| (x - 1e6).abs() < 1e3));
}

/// A reservation covers every layer or none; appends of the reserved tokens cannot fail while
/// other sequences exhaust the pools; freeing returns the blocks.
#[test]
fn reservations_hold_blocks_in_every_layer() {
    let c =
        KvCacheConfig::builder(2, 1, 2, 32).block_size(4).sink_tokens(0).blocks_per_layer(6).build().unwrap();
    let mut cache = QuantizedKvCache::new(c).unwrap();
    let (a, b) = (cache.create(), cache.create());
    let kv = |t: usize| token(2 * 32, t);
    assert!(matches!(
        cache.reserve(a, 100),
        Err(KvqError::Cache(kvq::layout::CacheError::PoolExhausted { .. }))
    ));
    assert_eq!(cache.unreserved_blocks(), [6, 6], "a failed reservation holds nothing");
    cache.reserve(a, 12).unwrap();
    // The default keeps one residual block: the window's tokens take no block, so 12 tokens
    // quantize two blocks (at the 8th and the 12th).
    assert_eq!((cache.unreserved_blocks(), cache.reserved_tokens(a).unwrap()), (vec![4, 4], 12));
    let mut n = 0;
    while cache.append_all_layers(b, &kv(n), &kv(n + 1)).is_ok() {
        n += 1;
    }
    // b takes the 4 unreserved blocks (at its 8th, 12th, 16th and 20th tokens); its 24th would
    // need a fifth.
    assert_eq!(n, 23);
    assert_eq!(cache.len(b, 0).unwrap(), 23);
    assert!(cache.check_capacity(a, 12).is_ok());
    assert!(cache.check_capacity(b, 1).is_err());
    for t in 0..12 {
        cache.append_all_layers(a, &kv(t), &kv(t)).unwrap();
    }
    assert_eq!(cache.reserved_tokens(a).unwrap(), 0);
    // Tokens that stay in the window need no block; the 16th needs one and the pool is empty.
    for t in 12..15 {
        cache.append_all_layers(a, &kv(t), &kv(t)).unwrap();
    }
    assert!(cache.append_all_layers(a, &kv(0), &kv(0)).is_err());
    assert_eq!(cache.len(a, 0).unwrap(), 15, "a failed append stores nothing");
    cache.free(b).unwrap();
    cache.reserve(a, 4).unwrap();
    let fork = cache.fork(a).unwrap();
    assert_eq!(cache.reserved_tokens(fork).unwrap(), 0);
    cache.free(a).unwrap();
    assert_eq!(cache.unreserved_blocks(), cache.free_blocks());
}

/// A layer with bits per key channel: its maps are part of the config (TOML and JSON keep
/// them), a `-qa` layer without maps is refused, and decoding through it tracks the same
/// tokens through a plain INT3 layer of the same bytes.
#[test]
fn layers_with_bits_per_key_channel() {
    let (layers, heads, d) = (2usize, 2usize, 32usize);
    let qa: QuantSpec = "int3-channel-qa".parse().unwrap();
    let v: QuantSpec = "int4-token".parse().unwrap();
    // Channel c of every head spreads by 1 + c / 4: the wide channels should take the bits.
    let keys: Vec<f32> = (0..64 * d).map(|i| token(1, i)[0] * (1 + (i % d) / 4) as f32).collect();
    let keys = Tensor::new(Shape::new(1, 64, d), keys).unwrap();
    let map = ChannelBits::fit(&keys, &[1.0; 32], &"int3-channel8-qa".parse().unwrap(), None).unwrap();
    assert!(map.widths()[d - 1] > map.widths()[0], "{:?}", map.widths());
    let build = |maps: Option<Vec<ChannelBits>>| {
        let mut b = KvCacheConfig::builder(layers, heads, 2 * heads, d)
            .block_size(8)
            .layer_specs(1, qa.clone(), v.clone())
            .blocks_per_layer(64);
        if let Some(m) = maps {
            b = b.channel_bits(1, m);
        }
        b.build()
    };
    assert!(matches!(build(None), Err(KvqError::Config(_))));
    let c = build(Some(vec![map.clone(); heads])).unwrap();
    assert_eq!(KvCacheConfig::from_toml(&c.to_toml()).unwrap(), c);
    assert_eq!(KvCacheConfig::from_json(&c.to_json()).unwrap(), c);
    let toml = c.to_toml();
    let (head, maps) = toml.split_at(toml.find("k_channel_bits").unwrap());
    // The first width of the first map made 9.
    let bad = format!("{head}{}", maps.replacen(&format!("{},", map.widths()[0]), "9,", 1));
    assert!(matches!(KvCacheConfig::from_toml(&bad), Err(KvqError::Config(_))), "{bad}");

    let mut cache = QuantizedKvCache::new(c).unwrap();
    let seq = cache.create();
    for t in 0..40 {
        let k: Vec<f32> =
            token(heads * d, t).iter().enumerate().map(|(i, x)| x * (1 + (i % d) / 4) as f32).collect();
        let v = token(heads * d, t + 1);
        cache.append_all_layers(seq, &[k.clone(), k].concat(), &[v.clone(), v].concat()).unwrap();
    }
    let q = token(2 * heads * d, 99);
    let (mut plain, mut fitted) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    cache.attention(&AttentionOptions::default(), seq, 0, &q, &mut plain).unwrap();
    cache.attention(&AttentionOptions::default(), seq, 1, &q, &mut fitted).unwrap();
    let rel = plain.iter().zip(&fitted).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt()
        / plain.iter().map(|a| a * a).sum::<f32>().sqrt();
    // Layer 0 holds INT4 keys, layer 1 the same keys at 3 bits on average: close, not equal.
    assert!(rel > 0.0 && rel < 0.2, "{rel}");
}

#[test]
fn layers_with_keys_before_rope() {
    // A model's RoPE in the config: layers with `-prerope` keys quantize their key blocks in
    // the frame before it. The RoPE goes through TOML, JSON, save/load and sequence files;
    // a config without it, or whose pairing disagrees, is refused.
    use kvq::quant::{Rope, RopePairing};
    let (heads, d) = (2usize, 32usize);
    let rope = Rope::from_theta(10_000.0, d, RopePairing::Interleaved).unwrap();
    let pre: QuantSpec = "int4-channel-prerope".parse().unwrap();
    let v: QuantSpec = "int4-token".parse().unwrap();
    let builder = || {
        KvCacheConfig::builder(2, heads, 2 * heads, d).block_size(8).layer_specs(1, pre.clone(), v.clone())
    };
    assert!(matches!(builder().blocks_per_layer(64).build(), Err(KvqError::Config(_))));
    let other_pairs = builder().rope(rope.clone()).rope_pairing(RopePairing::Half).build();
    assert!(matches!(other_pairs, Err(KvqError::Config(_))));
    let c = builder().rope(rope.clone()).blocks_per_layer(64).build().unwrap();
    assert_eq!(KvCacheConfig::from_toml(&c.to_toml()).unwrap(), c);
    assert_eq!(KvCacheConfig::from_json(&c.to_json()).unwrap(), c);
    let toml = c.to_toml();
    assert!(toml.contains("inv_freq"), "{toml}");
    // The first frequency (1.0) made negative.
    let (head, freqs) = toml.split_at(toml.find("inv_freq").unwrap());
    let negative = format!("{head}{}", freqs.replacen("1.0", "-1.0", 1));
    assert!(negative != toml && KvCacheConfig::from_toml(&negative).is_err(), "{negative}");

    let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
    let seq = cache.create();
    for t in 0..40 {
        // Keys with a constant offset per channel, turned by RoPE as a model's are.
        let mut k: Vec<f32> =
            token(heads * d, t).iter().enumerate().map(|(i, x)| x + (i % 7) as f32).collect();
        rope.apply_rows(&mut k, t);
        let v = token(heads * d, t + 1);
        cache.append_all_layers(seq, &[k.clone(), k].concat(), &[v.clone(), v].concat()).unwrap();
    }
    let q = token(2 * heads * d, 99);
    let attend = |cache: &QuantizedKvCache, s: SeqId, l: usize| {
        let mut out = vec![0f32; q.len()];
        cache.attention(&AttentionOptions::default(), s, l, &q, &mut out).unwrap();
        out
    };
    // The same keys, plain INT4 in layer 0 and before RoPE in layer 1: close, not equal.
    let (plain, before) = (attend(&cache, seq, 0), attend(&cache, seq, 1));
    let rel = plain.iter().zip(&before).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt()
        / plain.iter().map(|a| a * a).sum::<f32>().sqrt();
    assert!(rel > 0.0 && rel < 0.2, "{rel}");
    // Through a sequence file and a saved cache, bit for bit.
    let file = cache.export_sequence(seq).unwrap();
    let mut other = QuantizedKvCache::new(c.clone()).unwrap();
    let back = other.import_sequence(&file).unwrap();
    assert_eq!(attend(&other, back, 1), before);
    let path = std::env::temp_dir().join(format!("kvq-prerope-{}.kvq", std::process::id()));
    let layer = cache.layer(1).unwrap().paged();
    layer.save(&path).unwrap();
    let loaded = kvq::layout::PagedCache::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded.config().rope.as_ref(), Some(&rope));
    for h in 0..heads {
        let keys =
            |c: &kvq::layout::PagedCache| c.dequantize(seq, 0, h, kvq::quant::calibration::Part::K).unwrap();
        assert_eq!(keys(&loaded), keys(layer));
    }
}

#[test]
fn window_storage_reads_from_the_command_line_form() {
    use kvq::cache::parse_tail_dtypes;
    assert_eq!(parse_tail_dtypes("int8").unwrap(), (TailDtype::Int8, None));
    assert_eq!(parse_tail_dtypes("f16/int8").unwrap(), (TailDtype::F16, Some(TailDtype::Int8)));
    assert_eq!(parse_tail_dtypes("f32/f32").unwrap(), (TailDtype::F32, None));
    for text in ["f16", "int8", "f16/int8", "f32/f16"] {
        let (k, v) = parse_tail_dtypes(text).unwrap();
        assert_eq!(kvq::cache::tail_dtypes_text(k, v), text);
    }
    for bad in ["", "f8", "f16/", "/int8", "f16/int8/f32", "INT8"] {
        assert!(matches!(parse_tail_dtypes(bad), Err(KvqError::Config(_))), "{bad:?}");
    }
    // The default: one-byte parameters, values' window in 8 bits; `tail_dtype` sets both.
    let b = || KvCacheConfig::builder(1, 2, 4, 64);
    let d = b().build().unwrap();
    assert_eq!(
        (d.layers[0].k.to_string(), d.layers[0].v.to_string()),
        ("int4-channel-p8".into(), "int4-token-p8".into())
    );
    assert_eq!((d.tail_dtype, d.value_tail_dtype), (TailDtype::F16, Some(TailDtype::Int8)));
    assert_eq!(b().tail_dtype(TailDtype::F32).build().unwrap().value_tail_dtype, None);
    let both = b().tail_dtype(TailDtype::F32).value_tail_dtype(TailDtype::F16).build().unwrap();
    assert_eq!((both.tail_dtype, both.value_tail_dtype), (TailDtype::F32, Some(TailDtype::F16)));
    // The default's specs take no calibration, and say so.
    let cal = kvq::quant::Calibration::from_tensors(
        &[kvq::quant::synth::normal_tensor(kvq::quant::Shape::new(2, 8, 64), 1)],
        &[kvq::quant::synth::normal_tensor(kvq::quant::Shape::new(2, 8, 64), 2)],
        None,
    )
    .unwrap();
    let e = b().calibration(cal).build().unwrap_err();
    assert!(matches!(e, KvqError::Config(_)) && e.to_string().contains("p8"), "{e}");
    // A cache with 8-bit values in its window holds fewer bytes than with f16, same tokens.
    let memory = |v: TailDtype| {
        let config = KvCacheConfig::builder(1, 2, 4, 64)
            .specs("int4-channel".parse().unwrap(), "int4-token-p8".parse().unwrap())
            .value_tail_dtype(v)
            .build()
            .unwrap();
        let mut cache = QuantizedKvCache::new(config).unwrap();
        let seq = cache.create();
        for t in 0..50 {
            let x: Vec<f32> = (0..2 * 64).map(|i| ((i + t) % 13) as f32 - 6.0).collect();
            cache.append(seq, 0, &x, &x).unwrap();
        }
        cache.memory().iter().flat_map(|m| &m.layers).map(|l| l.tail_bytes + l.sink_bytes).sum::<usize>()
    };
    let (f16, int8) = (memory(TailDtype::F16), memory(TailDtype::Int8));
    // Keys' rows in f16 (128 bytes), values' in 8 bits (64 + 4).
    assert_eq!(f16 * (128 + 68), int8 * (128 + 128), "{f16} {int8}");
}

/// Tokens in the full-precision window take no block from the pool: with the builder's default
/// (per-channel keys and values with one-byte parameters both wait in the window), a sequence
/// takes a block per KV head when a block of its tokens is quantized, not when its first token
/// arrives, and each append takes what `blocks_needed` said.
#[test]
fn the_window_holds_no_block() {
    let c = KvCacheConfig::builder(1, 2, 4, 32).block_size(8).blocks_per_layer(16).build().unwrap();
    let mut cache = QuantizedKvCache::new(c).unwrap();
    let seq = cache.create();
    for t in 0..40 {
        let need = cache.blocks_needed(seq, 1).unwrap()[0];
        let free = cache.free_blocks()[0];
        cache.append_all_layers(seq, &token(2 * 32, t), &token(2 * 32, t)).unwrap();
        assert_eq!(free - cache.free_blocks()[0], need, "token {t}");
        // 4 sinks, then a block leaves the window whenever it reaches 2 blocks (16 tokens).
        let p = (t + 1).saturating_sub(4);
        let quantized = if p >= 16 { (p - 16) / 8 + 1 } else { 0 };
        assert_eq!(16 - cache.free_blocks()[0], 2 * quantized, "token {t}");
    }
}

/// `blocks_for_tokens` is what a sequence of that many tokens holds, for parts that wait in
/// the window (the default), parts quantized on arrival, and a mix of layers.
#[test]
fn blocks_for_tokens_is_what_a_sequence_holds() {
    let base = || KvCacheConfig::builder(2, 2, 4, 32).block_size(8).blocks_per_layer(64);
    let configs = [
        base().build().unwrap(),
        base().specs("int4-channel".parse().unwrap(), "int4-token".parse().unwrap()).build().unwrap(),
        base()
            .layer_specs(1, "int8-token".parse().unwrap(), "int8-token".parse().unwrap())
            .residual_blocks(0)
            .build()
            .unwrap(),
    ];
    for (i, c) in configs.into_iter().enumerate() {
        for tokens in [0, 3, 4, 11, 12, 20, 21, 29, 60] {
            let want = c.blocks_for_tokens(tokens).unwrap();
            let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
            let seq = cache.create();
            for t in 0..tokens {
                cache.append_all_layers(seq, &token(2 * 2 * 32, t), &token(2 * 2 * 32, t)).unwrap();
            }
            let held: Vec<usize> = cache.free_blocks().iter().map(|f| 64 - f).collect();
            assert_eq!(held, want, "config {i}, {tokens} tokens");
        }
    }
    // The default waits in the window; per-token values with f16 parameters do not.
    let c = base().build().unwrap();
    assert_eq!(c.blocks_for_tokens(12).unwrap(), [0, 0]);
    let eager = base().specs("int4-channel".parse().unwrap(), "int4-token".parse().unwrap()).build().unwrap();
    assert_eq!(eager.blocks_for_tokens(12).unwrap(), [2, 2]);
}

/// A sequence split into blocks of tokens and a head comes back whole in another cache; a
/// shorter sequence of the same tokens shares the longer one's blocks; pieces that do not go
/// together change nothing.
#[test]
fn split_sequences_share_their_blocks_and_import_exactly() {
    let c = config();
    let per = c.kv_heads * c.head_dim;
    let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
    let fill = |cache: &mut QuantizedKvCache, len: usize| {
        let s = cache.create();
        for t in 0..len {
            cache.append_all_layers(s, &token(3 * per, t), &token(3 * per, t + 3)).unwrap();
        }
        s
    };
    let long = fill(&mut cache, 70);
    let n = cache.final_blocks(long).unwrap();
    assert!(n >= 2, "{n} final blocks");
    let (_, blocks) = cache.export_split(long, n).unwrap();
    assert!(blocks.iter().all(|b| b.len() == cache.split_block_bytes()));
    let short = fill(&mut cache, 40);
    let m = cache.final_blocks(short).unwrap();
    let (head, own) = cache.export_split(short, m).unwrap();
    assert_eq!(own[..], blocks[..m], "the same tokens, the same blocks");
    let given: Vec<&[u8]> = blocks[..m].iter().map(Vec::as_slice).collect();
    let mut other = QuantizedKvCache::new(c.clone()).unwrap();
    let back = other.import_split(&head, &given).unwrap();
    assert_eq!(other.export_sequence(back).unwrap(), cache.export_sequence(short).unwrap());

    let before = other.export_sequence(back).unwrap();
    let free = other.free_blocks();
    let mut damaged = head.clone();
    damaged[head.len() / 2] ^= 1;
    assert!(other.import_split(&damaged, &given).is_err());
    assert!(other.import_split(&head, &given[..m - 1]).is_err());
    let mut cut = blocks[0].clone();
    cut.truncate(cut.len() - 1);
    let mut with_cut = given.clone();
    with_cut[0] = &cut;
    assert!(other.import_split(&head, &with_cut).is_err());
    assert!(other.import_split(&cache.export_sequence(short).unwrap(), &given).is_err());
    assert_eq!(other.free_blocks(), free);
    assert_eq!(other.export_sequence(back).unwrap(), before);
}

/// A layer of the cache reads without a layer index: its index is the model's, its contents
/// are those of the single-layer paged cache underneath, and past the last layer there is none.
#[test]
fn a_layer_reads_as_the_models_layer() {
    let c = config();
    let per = c.kv_heads * c.head_dim;
    let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
    let seq = cache.create();
    for t in 0..40 {
        cache.append_all_layers(seq, &token(3 * per, t), &token(3 * per, t + 3)).unwrap();
    }
    assert!(cache.layer(3).is_none());
    for l in 0..3 {
        let layer = cache.layer(l).unwrap();
        assert_eq!(layer.index(), l);
        assert_eq!(layer.len(seq).unwrap(), 40);
        assert_eq!(layer.memory(), layer.paged().memory());
        for part in [Part::K, Part::V] {
            let rows = layer.dequantize(seq, 1, part).unwrap();
            assert_eq!(rows, layer.paged().dequantize(seq, 0, 1, part).unwrap());
            assert_eq!(rows.len(), 40 * c.head_dim);
        }
        assert!(layer.len(SeqId(77)).is_err());
        assert!(layer.dequantize(seq, c.kv_heads, Part::K).is_err());
    }
}
