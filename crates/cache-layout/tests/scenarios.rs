//! Scripted scenarios: block-table snapshots, exhaustion, calibration, memory, real data.

#[path = "../../quant-core/tests/common/shared_data.rs"]
mod shared_data;
use kvq_cache_layout::{CacheConfig, CacheError, PagedCache, SeqId, TailDtype};
use kvq_quant_core::calibration::Part;
use kvq_quant_core::io::TensorFile;
use kvq_quant_core::metrics::{AttentionOutputs, attention, compare_attention};
use kvq_quant_core::{Calibration, QuantSpec, Shape, Tensor, quantize};

fn row(seed: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 31 + seed * 17) % 23) as f32 * 0.25 - 2.5).collect()
}

fn small_cache(capacity: usize) -> PagedCache {
    let config =
        CacheConfig::new(2, 2, 8, capacity).with_block_size(4).with_residual_blocks(1).with_sink_tokens(1);
    PagedCache::new(config).unwrap()
}

#[test]
fn block_tables_through_fork_truncate_and_free() {
    let mut c = small_cache(24);
    let a = c.create();
    for t in 0..10 {
        c.append_all_layers(a, &row(t, 32), &row(t + 100, 32)).unwrap();
    }
    let mut log = format!("after 10 tokens\n{}", c.dump_tables());
    let b = c.fork(a).unwrap();
    log += &format!("\nafter fork\n{}", c.dump_tables());
    c.append(b, 0, &row(50, 16), &row(51, 16)).unwrap();
    log += &format!("\nafter appending to the fork's layer 0\n{}", c.dump_tables());
    c.truncate(a, 5).unwrap();
    log += &format!("\nafter truncating the original to 5\n{}", c.dump_tables());
    c.free(b).unwrap();
    log += &format!("\nafter freeing the fork\n{}", c.dump_tables());
    c.free(a).unwrap();
    assert_eq!(c.pool().free_blocks(), 24);
    insta::assert_snapshot!(log);
}

#[test]
fn exhaustion_is_an_error_that_changes_nothing() {
    let mut c = small_cache(5);
    let a = c.create();
    // 1 sink + 8 tokens: 2 blocks × 2 heads for layer 0.
    for t in 0..9 {
        c.append(a, 0, &row(t, 16), &row(t, 16)).unwrap();
    }
    let before = c.clone();
    let err = c.append(a, 0, &row(9, 16), &row(9, 16)).unwrap_err();
    assert!(matches!(err, CacheError::PoolExhausted { needed: 2, free: 1 }), "{err}");
    assert!(before == c);
    let big = Tensor::new(Shape::new(2, 20, 8), row(3, 320)).unwrap();
    assert!(matches!(c.extend(a, 1, &big, &big), Err(CacheError::PoolExhausted { .. })));
    assert!(before == c);
    // Freeing makes room again.
    c.free(a).unwrap();
    let b = c.create();
    c.extend(b, 1, &big.prefix(9).unwrap(), &big.prefix(9).unwrap()).unwrap();
}

#[test]
fn truncating_into_a_quantized_block_is_refused() {
    let mut c = small_cache(24);
    let a = c.create();
    for t in 0..14 {
        c.append(a, 0, &row(t, 16), &row(t, 16)).unwrap();
    }
    // 1 sink, 13 more tokens, residual 1 block of 4: keys of tokens 1..9 are quantized.
    let before = c.clone();
    let err = c.truncate(a, 7).unwrap_err();
    assert!(
        matches!(err, CacheError::TruncateIntoBlock { quantized_from: 5, quantized_until: 9, .. }),
        "{err}"
    );
    assert!(before == c);
    c.truncate(a, 5).unwrap();
    assert_eq!(c.len(a, 0).unwrap(), 5);
    c.truncate(a, 0).unwrap();
    assert_eq!(c.block_table(a, 0).unwrap().len(), 0);
}

#[test]
fn bad_configs_and_inputs() {
    let base = CacheConfig::new(1, 2, 8, 4);
    let spec = |s: &str| s.parse::<QuantSpec>().unwrap();
    let rope = kvq_quant_core::Rope::from_theta(10_000.0, 8, kvq_quant_core::RopePairing::Half).unwrap();
    let keys = Tensor::new(Shape::new(2, 4, 8), (0..64).map(|i| i as f32).collect()).unwrap();
    let calibration =
        Calibration::from_tensors(std::slice::from_ref(&keys), std::slice::from_ref(&keys), None).unwrap();
    // The same spec with its RoPE is a good config.
    let good =
        base.clone().with_specs(spec("int4-channel-prerope"), spec("int4-token")).with_rope(rope.clone());
    assert!(PagedCache::new(good).is_ok());
    // Key groups that divide the block: a set of channel parameters per group.
    let sets = base.clone().with_specs(spec("int4-channel16-p8"), spec("int4-channel32")).with_block_size(64);
    assert!(PagedCache::new(sets).is_ok());
    for cfg in [
        base.clone().with_specs(spec("int4-head"), spec("int4-token")),
        base.clone().with_specs(spec("lloyd4-token"), spec("int4-token")),
        base.clone().with_specs(spec("int4-channel8"), spec("int4-token")).with_block_size(4),
        // Key groups that do not divide the block; groups inside a block with -qa or -prerope.
        base.clone().with_specs(spec("int4-channel24"), spec("int4-token")).with_block_size(64),
        base.clone().with_specs(spec("int4-channel2"), spec("int4-token")).with_block_size(64),
        base.clone()
            .with_specs(spec("int2-channel16-qa"), spec("int4-token"))
            .with_channel_bits(vec![kvq_quant_core::ChannelBits::uniform(8, 2).unwrap(); 2])
            .with_block_size(64),
        base.clone()
            .with_specs(spec("int4-channel16-prerope"), spec("int4-token"))
            .with_rope(rope.clone())
            .with_block_size(64),
        base.clone().with_specs(spec("int4-g3"), spec("int4-token")),
        CacheConfig::new(1, 2, 12, 4).with_specs(spec("int4-token-rot"), spec("int4-token")),
        base.clone().with_specs(spec("int4-channel-prerope"), spec("int4-token")),
        base.clone().with_specs(spec("int4-channel"), spec("int4-token-prerope")),
        // A RoPE for plain keys, for per-token keys, or beside -qa or a calibration.
        base.clone().with_rope(rope.clone()),
        base.clone().with_specs(spec("int4-token-prerope"), spec("int4-token")).with_rope(rope.clone()),
        base.clone()
            .with_specs(spec("int2-channel-qa-prerope"), spec("int4-token"))
            .with_channel_bits(vec![kvq_quant_core::ChannelBits::uniform(8, 2).unwrap(); 2])
            .with_rope(rope.clone()),
        base.clone()
            .with_specs(spec("int4-channel-prerope"), spec("int4-token"))
            .with_calibration(calibration.clone())
            .with_rope(rope.clone()),
        CacheConfig::new(1, 2, 12, 4).with_specs(spec("int4-channel"), spec("int4-token-rot")),
        base.clone().with_block_size(0),
        CacheConfig::new(0, 2, 8, 4),
    ] {
        assert!(matches!(PagedCache::new(cfg), Err(CacheError::Config(_))));
    }
    let mut c = PagedCache::new(base).unwrap();
    let a = c.create();
    assert!(matches!(c.append(a, 1, &row(0, 16), &row(0, 16)), Err(CacheError::Layer { .. })));
    assert!(matches!(c.append(a, 0, &row(0, 15), &row(0, 16)), Err(CacheError::Shape { .. })));
    let mut huge = row(0, 16);
    huge[3] = 1e6;
    assert!(matches!(c.append(a, 0, &huge, &row(0, 16)), Err(CacheError::Quant(_))));
    c.free(a).unwrap();
    assert!(matches!(c.free(a), Err(CacheError::UnknownSequence(_))));
    assert!(matches!(c.fork(a), Err(CacheError::UnknownSequence(_))));
}

#[test]
fn static_calibration_streams_and_counts_clamps() {
    let shape = Shape::new(2, 16, 8);
    let sample =
        Tensor::new(shape, (0..shape.len()).map(|i| ((i * 7) % 19) as f32 * 0.1 - 0.9).collect()).unwrap();
    let cal = Calibration::from_tensors(std::slice::from_ref(&sample), std::slice::from_ref(&sample), None)
        .unwrap();
    let config = CacheConfig::new(1, 2, 8, 12)
        .with_block_size(4)
        .with_specs("int8-head".parse().unwrap(), "int4-tensor".parse().unwrap())
        .with_calibration(cal);
    let mut c = PagedCache::new(config).unwrap();
    let a = c.create();
    c.extend(a, 0, &sample, &sample).unwrap();
    assert_eq!(c.stats().clamped_values, 0);
    let k = c.dequantize(a, 0, 1, Part::K).unwrap();
    let head1 = &sample.data()[16 * 8..];
    let max_err = k.iter().zip(head1).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_err < 1.8 / 255.0, "{max_err}");
    // Out-of-range values are clamped and counted, not wrong silently.
    let mut out = vec![0.0f32; 16];
    out[0] = 5.0;
    out[9] = -5.0;
    c.append(a, 0, &out, &out).unwrap();
    assert_eq!(c.stats().clamped_values, 4);
    let mem = c.memory();
    // Static parameters are held once: one (scale, offset) per head for K, one per layer for V.
    assert_eq!(mem.layers[0].static_param_bytes, 2 * 2 * 2 + 2 * 2 * 2);
    assert_eq!(mem.layers[0].param_bytes, 0);
}

#[test]
fn memory_is_exact() {
    let mut c = small_cache(24);
    let a = c.create();
    for t in 0..10 {
        c.append(a, 0, &row(t, 16), &row(t, 16)).unwrap();
    }
    let m = c.memory();
    let l0 = m.layers[0];
    // Blocks: 9 tokens after the sink → 3 blocks of 4 × 2 heads.
    assert_eq!(l0.blocks, 6);
    // Per block: K codes 4 rows × 4 bytes + 8 channels × (scale, offset) × 2 bytes,
    // V codes 4 × 4 + 4 rows × (scale, offset) × 2.
    assert_eq!(m.block_bytes, (16 + 32) + (16 + 16));
    assert_eq!(l0.code_bytes, 6 * 32);
    assert_eq!(l0.param_bytes, 6 * 48);
    // Sinks: 1 token × 8 × f16 for K and V, 2 heads. Tail: residual 1 block + 1 token of K.
    assert_eq!(l0.sink_bytes, 2 * 2 * 8 * 2);
    assert_eq!(l0.tail_bytes, 2 * 5 * 8 * 2);
    assert_eq!(l0.table_bytes, 6 * 4);
    assert_eq!(m.layers[1], Default::default());
    assert_eq!(m.free_blocks, 18);
    let b = c.fork(a).unwrap();
    let shared = c.memory();
    assert_eq!(shared.layers[0].blocks, 6, "shared blocks count once");
    assert_eq!(shared.layers[0].tail_bytes, 2 * l0.tail_bytes);
    c.free(b).unwrap();
}

fn real_layer(layer: usize) -> Option<(Tensor, Tensor, Tensor)> {
    let file = match shared_data::shared_capture() {
        Some(path) => TensorFile::open(path).unwrap(),
        None => {
            shared_data::note_missing("using the embedded 256-token sample");
            TensorFile::open(concat!(env!("CARGO_MANIFEST_DIR"), "/../kvq/data/sample.safetensors")).unwrap()
        }
    };
    let read = |s: &str| file.read(&format!("layer{layer}.{s}")).ok();
    Some((read("q")?, read("k")?, read("v")?))
}

/// The first `tokens` tokens (at most) of real layer `layer`: `(q, k, v)`, and the attention
/// positions (the last 16) with their exact reference outputs.
fn real_prefix(layer: usize, tokens: usize) -> ((Tensor, Tensor, Tensor), Vec<usize>, AttentionOutputs) {
    let (q, k, v) = real_layer(layer).unwrap();
    let tokens = k.shape().tokens.min(tokens);
    let (q, k, v) = (q.prefix(tokens).unwrap(), k.prefix(tokens).unwrap(), v.prefix(tokens).unwrap());
    let positions: Vec<usize> = (tokens - 16..tokens).collect();
    let reference = attention(&q, &k, &v, &positions).unwrap();
    ((q, k, v), positions, reference)
}

/// A cache for `config` with every token of `k` and `v` appended one at a time.
fn streamed(config: CacheConfig, k: &Tensor, v: &Tensor) -> (PagedCache, SeqId) {
    let s = k.shape();
    let mut c = PagedCache::new(config).unwrap();
    let a = c.create();
    for t in 0..s.tokens {
        let gather = |x: &Tensor| (0..s.heads).flat_map(|h| x.row(0, h, t).to_vec()).collect::<Vec<f32>>();
        c.append(a, 0, &gather(k), &gather(v)).unwrap();
    }
    (c, a)
}

/// Streams real keys and values token by token and compares attention against the offline
/// per-channel (K) / per-token (V) quantization of the same tokens.
#[test]
fn streaming_real_data_matches_offline_quantization() {
    let ((q, k, v), positions, reference) = real_prefix(9, 512);
    let s = k.shape();
    let tokens = s.tokens;
    let mut errors = Vec::new();
    // Key groups of the whole block, and of 16 tokens inside blocks of 64 (a set of channel
    // parameters per group: the same codes and parameters as blocks of 16).
    for (bs, group) in [(16usize, 16usize), (64, 64), (64, 16)] {
        let config = CacheConfig::new(1, s.heads, s.head_dim, s.heads * tokens.div_ceil(bs))
            .with_block_size(bs)
            .with_specs(format!("int4-channel{group}").parse().unwrap(), "int4-token".parse().unwrap())
            .with_tail_dtype(TailDtype::F32);
        let (c, a) = streamed(config, &k, &v);
        let d = s.head_dim;
        let collect = |part| {
            let data: Vec<f32> = (0..s.heads).flat_map(|h| c.dequantize(a, 0, h, part).unwrap()).collect();
            Tensor::new(Shape::new(s.heads, tokens, d), data).unwrap()
        };
        let (k_hat, v_hat) = (collect(Part::K), collect(Part::V));
        // Saved and loaded, and the sequence offloaded and brought back: the same blocks.
        let loaded = PagedCache::from_bytes(&c.to_bytes().unwrap()).unwrap();
        assert!(loaded == c, "block size {bs}, groups of {group}: a saved cache loads as it was");
        let mut other = PagedCache::new(c.config().clone()).unwrap();
        let back = other.import_sequence(&c.export_sequence(a).unwrap()).unwrap();
        for h in 0..s.heads {
            assert_eq!(
                other.dequantize(back, 0, h, Part::K).unwrap(),
                c.dequantize(a, 0, h, Part::K).unwrap()
            );
        }
        let streamed =
            compare_attention(&reference, &attention(&q, &k_hat, &v_hat, &positions).unwrap()).unwrap();

        // Offline: the same grouping (blocks of bs tokens) over the tokens the cache quantized,
        // with the residual tail exact.
        let done = tokens / bs * bs;
        let k_off = quantize(&k.prefix(done).unwrap(), &format!("int4-channel{group}").parse().unwrap())
            .unwrap()
            .dequantize();
        let mut k_data = Vec::new();
        for h in 0..s.heads {
            k_data.extend_from_slice(&k_off.data()[h * done * d..(h + 1) * done * d]);
            k_data.extend_from_slice(&k.data()[(h * tokens + done) * d..(h + 1) * tokens * d]);
        }
        let k_off = Tensor::new(k.shape(), k_data).unwrap();
        let v_off = quantize(&v, &"int4-token".parse().unwrap()).unwrap().dequantize();
        let offline =
            compare_attention(&reference, &attention(&q, &k_off, &v_off, &positions).unwrap()).unwrap();
        assert_eq!(
            k_hat.data(),
            k_off.data(),
            "block size {bs}, groups of {group}: streamed keys equal offline keys"
        );
        assert_eq!(v_hat.data(), v_off.data(), "block size {bs}: streamed values equal offline values");
        assert!((streamed.output_rel_l2 - offline.output_rel_l2).abs() < 1e-12);
        errors.push(streamed.output_rel_l2);
    }
    eprintln!(
        "attention-output relative error, key groups of 16, 64 and 16 tokens (blocks of 16, 64, 64): {errors:?}"
    );
    assert!(errors[0] < errors[1], "smaller blocks should fit key ranges better: {errors:?}");
    assert!(errors[2] < errors[1], "smaller key groups inside a block should too: {errors:?}");
}

/// Rotated values (`-rot`) stream as the offline quantizer stores them: the cache's values,
/// decoded and unrotated, equal `quantize(v, spec).dequantize()`, sinks and an f32 residual
/// tail included (those rows are exact up to the rotation's rounding); and rotation lowers
/// the attention error of 2-bit values on real data.
#[test]
fn rotated_values_stream_as_offline() {
    let ((q, k, v), positions, reference) = real_prefix(0, 256);
    let s = k.shape();
    let (tokens, d) = (s.tokens, s.head_dim);
    let mut errors = Vec::new();
    for v_spec in ["int2-token-mse", "int2-token-mse-rot"] {
        let spec: QuantSpec = v_spec.parse().unwrap();
        let config = CacheConfig::new(1, s.heads, d, s.heads * tokens)
            .with_specs("int8-token".parse().unwrap(), spec.clone())
            .with_block_size(16)
            .with_sink_tokens(2)
            .with_tail_dtype(TailDtype::F32);
        let (c, a) = streamed(config, &k, &v);
        let v_hat: Vec<f32> = (0..s.heads).flat_map(|h| c.dequantize(a, 0, h, Part::V).unwrap()).collect();
        let offline = quantize(&v, &spec).unwrap().dequantize();
        for h in 0..s.heads {
            for t in 0..tokens {
                let at = (h * tokens + t) * d;
                let (got, want) = (
                    &v_hat[at..at + d],
                    if t < 2 { &v.data()[at..at + d] } else { &offline.data()[at..at + d] },
                );
                for (&g, &w) in got.iter().zip(want) {
                    assert!(
                        (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                        "{v_spec} head {h} token {t}: {g} vs {w}"
                    );
                }
            }
        }
        let v_hat = Tensor::new(v.shape(), v_hat).unwrap();
        errors.push(
            compare_attention(&reference, &attention(&q, &k, &v_hat, &positions).unwrap())
                .unwrap()
                .output_rel_l2,
        );
    }
    assert!(
        errors[1] < 0.8 * errors[0],
        "layer 0, 2-bit values: rotated {} vs plain {}",
        errors[1],
        errors[0]
    );
}

/// One layer, one head of 8 channels, per-token INT8 (no tail), blocks of 4, no sinks.
fn row_cache(capacity: usize) -> PagedCache {
    let spec: QuantSpec = "int8-token".parse().unwrap();
    PagedCache::new(
        CacheConfig::new(1, 1, 8, capacity)
            .with_specs(spec.clone(), spec)
            .with_block_size(4)
            .with_sink_tokens(0),
    )
    .unwrap()
}

/// Appends to `seq` until the pool refuses; returns how many tokens went in.
fn fill(c: &mut PagedCache, seq: SeqId) -> usize {
    let mut n = 0;
    loop {
        match c.append(seq, 0, &row(n, 8), &row(n + 1, 8)) {
            Ok(()) => n += 1,
            Err(CacheError::PoolExhausted { .. }) => return n,
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn a_reservation_survives_other_sequences_forks_and_truncation() {
    let mut c = row_cache(5);
    let a = c.create();
    for t in 0..8 {
        c.append(a, 0, &row(t, 8), &row(t, 8)).unwrap();
    }
    let b = c.fork(a).unwrap(); // both of a's full blocks are shared
    c.reserve(a, 0, 4).unwrap(); // a new block for tokens 8..12
    assert_eq!(c.reservation(a, 0).unwrap().blocks, 1);
    assert_eq!((c.reserved_blocks(), c.unreserved_blocks()), (1, 2));
    let other = c.create();
    assert_eq!(fill(&mut c, other), 8, "the other sequence gets the two unreserved blocks");
    // Cut back to 6: tokens 6..10 now write into a block shared with the fork (a copy) and a
    // new one. The pool has nothing left for the copy: the truncation is refused whole.
    let before = c.clone();
    assert!(matches!(c.truncate(a, 6), Err(CacheError::PoolExhausted { needed: 2, free: 1 })));
    assert!(c == before);
    c.free(other).unwrap();
    c.truncate(a, 6).unwrap();
    assert_eq!(c.reservation(a, 0).unwrap().blocks, 2);
    let other = c.create();
    fill(&mut c, other);
    assert_eq!(c.unreserved_blocks(), 0);
    for t in 0..4 {
        c.append(a, 0, &row(t, 8), &row(t, 8)).unwrap();
    }
    assert_eq!(c.reservation(a, 0).unwrap(), Default::default(), "used up");
    assert!(c.append(b, 0, &row(0, 8), &row(0, 8)).is_err(), "the fork had no reservation");
}

#[test]
fn forking_a_reserved_sequence_reserves_its_copies_or_fails() {
    let mut c = row_cache(4);
    let a = c.create();
    for t in 0..6 {
        c.append(a, 0, &row(t, 8), &row(t, 8)).unwrap();
    }
    c.reserve(a, 0, 2).unwrap(); // tokens 6 and 7 fit in a's own second block
    assert_eq!(c.reservation(a, 0).unwrap().blocks, 0);
    let other = c.create();
    assert_eq!(fill(&mut c, other), 8);
    // A fork would share that block, and a's reserved tokens would need a copy of it.
    let before = c.clone();
    assert!(matches!(c.fork(a), Err(CacheError::PoolExhausted { needed: 1, free: 0 })));
    assert!(c == before);
    c.truncate(other, 4).unwrap();
    let b = c.fork(a).unwrap();
    assert_eq!(c.reservation(a, 0).unwrap().blocks, 1);
    assert_eq!(c.reservation(b, 0).unwrap(), Default::default());
    // The one free block is a's: the other sequence's next token needs a block of its own.
    assert!(matches!(c.append(other, 0, &row(0, 8), &row(0, 8)), Err(CacheError::PoolExhausted { .. })));
    for t in 0..2 {
        c.append(a, 0, &row(t, 8), &row(t, 8)).unwrap();
    }
    // a wrote a copy; the fork owns the original alone now and fills it.
    assert_eq!(fill(&mut c, b), 2);
    // Freeing returns what a reservation held; reserving 0 releases it.
    c.reserve(b, 0, 0).unwrap();
    c.free(a).unwrap();
    assert_eq!(c.reserved_blocks(), 0);
    assert!(matches!(c.reserve(b, 0, 100), Err(CacheError::PoolExhausted { .. })));
    assert!(matches!(c.reserve(SeqId(99), 0, 1), Err(CacheError::UnknownSequence(_))));
    assert!(matches!(c.reserve(b, 3, 1), Err(CacheError::Layer { .. })));
}

/// Queries come into the keys' frame so that a stored key's dot product is the score: plain
/// keys leave them as they are, rotated keys rotate them (dots kept), and a row that is not
/// whole is an error that changes nothing.
#[test]
fn queries_turn_into_the_keys_frame() {
    let plain = small_cache(8);
    let q = row(3, 16);
    let mut x = q.clone();
    let mut tmp = Vec::new();
    plain.queries_to_key_frame(0, 1, &mut x, &mut tmp).unwrap();
    assert_eq!(x, q);
    let mut short = q[..7].to_vec();
    assert!(matches!(plain.queries_to_key_frame(0, 0, &mut short, &mut tmp), Err(CacheError::Shape { .. })));
    assert_eq!(short, q[..7]);

    let rotated = PagedCache::new(
        CacheConfig::new(1, 1, 8, 8)
            .with_specs("int4-token-rot".parse().unwrap(), "int4-token".parse().unwrap()),
    )
    .unwrap();
    let k = row(9, 8);
    let (mut qr, mut kr) = (q[..8].to_vec(), k.clone());
    rotated.queries_to_key_frame(0, 0, &mut qr, &mut tmp).unwrap();
    rotated.queries_to_key_frame(0, 0, &mut kr, &mut tmp).unwrap();
    assert_ne!(qr, q[..8]);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    assert!((dot(&qr, &kr) - dot(&q[..8], &k)).abs() < 1e-4);
}
