//! A sequence split into shared blocks of tokens and a head, and put together again.

use kvq_cache_layout::{CacheConfig, CacheError, PagedCache, SeqId};
use kvq_quant_core::{Codebook, CodebookSource, Granularity, Kind, ParamDtype, QuantSpec};

fn row(seed: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 31 + seed * 17) % 23) as f32 * 0.25 - 2.5) * (1.0 + (seed % 5) as f32)).collect()
}

fn configs() -> Vec<CacheConfig> {
    let base = CacheConfig::new(2, 2, 8, 256).with_block_size(4);
    vec![
        base.clone().with_residual_blocks(1).with_sink_tokens(1),
        base.clone().with_residual_blocks(0).with_sink_tokens(0),
        base.clone()
            .with_specs("int2-channel".parse().unwrap(), "int8-token".parse().unwrap())
            .with_residual_blocks(2)
            .with_sink_tokens(3),
        // Fixed-codebook values: their spec text names no levels; the files carry them.
        base.clone().with_specs("int4-channel".parse().unwrap(), fixed_codebook_values()),
    ]
}

fn fixed_codebook_values() -> QuantSpec {
    let levels = vec![-1.0, -0.6, -0.31, -0.1, 0.05, 0.2, 0.55, 1.0];
    let kind = Kind::Codebook(CodebookSource::Fixed(Codebook::new(levels).unwrap()));
    QuantSpec::new(kind, 3, Granularity::PerToken, ParamDtype::F16).unwrap()
}

#[test]
fn fixed_codebooks_are_offloaded_with_their_levels() {
    let config = configs().pop().unwrap();
    let mut c = PagedCache::new(config.clone()).unwrap();
    let s = filled(&mut c, 23);
    let back = PagedCache::from_bytes(&c.to_bytes().unwrap()).unwrap();
    assert_eq!(back.config().v_spec, fixed_codebook_values());
    assert_eq!(back.export_sequence(s).unwrap(), c.export_sequence(s).unwrap());
    // Another codebook of the same width is another config: its sequences are refused.
    let levels = vec![-1.0, -0.7, -0.31, -0.1, 0.05, 0.2, 0.55, 1.0];
    let kind = Kind::Codebook(CodebookSource::Fixed(Codebook::new(levels).unwrap()));
    let v = QuantSpec::new(kind, 3, Granularity::PerToken, ParamDtype::F16).unwrap();
    let mut other = PagedCache::new(config.with_specs("int4-channel".parse().unwrap(), v)).unwrap();
    let e = other.import_sequence(&c.export_sequence(s).unwrap()).unwrap_err();
    assert!(matches!(e, CacheError::Offload(_)), "{e}");
}

/// A sequence of `len` tokens of the same data (token `t` is always `row(t)`).
fn filled(c: &mut PagedCache, len: usize) -> SeqId {
    let s = c.create();
    let width = c.config().kv_heads * c.config().head_dim;
    for t in 0..len {
        c.append_all_layers(s, &row(t, width * 2), &row(t + 1000, width * 2)).unwrap();
    }
    s
}

#[test]
fn a_split_sequence_imports_bit_for_bit_and_shares_its_prefix_blocks() {
    for config in configs() {
        let mut c = PagedCache::new(config.clone()).unwrap();
        let long = filled(&mut c, 37);
        let (_, long_blocks) = c.export_split(long, c.final_blocks(long).unwrap()).unwrap();
        assert!(!long_blocks.is_empty());
        assert!(c.export_split(long, long_blocks.len() + 1).is_err(), "only final blocks");
        // Fewer blocks: the rest goes in the head.
        let (head2, two) = c.export_split(long, 2).unwrap();
        let mut other = PagedCache::new(config.clone()).unwrap();
        let back = other.import_split(&head2, &[&two[0], &two[1]]).unwrap();
        assert_eq!(other.export_sequence(back).unwrap(), c.export_sequence(long).unwrap());
        assert!(long_blocks.iter().all(|b| b.len() == c.split_block_bytes()));
        for len in 0..=37 {
            let s = filled(&mut c, len);
            let (head, blocks) = c.export_split(s, c.final_blocks(s).unwrap()).unwrap();
            // The blocks of a shorter sequence with the same tokens are the longer one's.
            assert_eq!(blocks[..], long_blocks[..blocks.len()], "{config:?}, {len} tokens");
            let mut other = PagedCache::new(config.clone()).unwrap();
            let given: Vec<&[u8]> = long_blocks[..blocks.len()].iter().map(Vec::as_slice).collect();
            other.check_import_split(&head, &given).unwrap();
            let back = other.import_split(&head, &given).unwrap();
            assert_eq!(other.export_sequence(back).unwrap(), c.export_sequence(s).unwrap(), "{len} tokens");
            // It goes on as the original does.
            let width = config.kv_heads * config.head_dim;
            for t in len..len + 9 {
                let (k, v) = (row(t, width * 2), row(t + 1000, width * 2));
                other.append_all_layers(back, &k, &v).unwrap();
                c.append_all_layers(s, &k, &v).unwrap();
            }
            assert_eq!(other.export_sequence(back).unwrap(), c.export_sequence(s).unwrap());
            c.free(s).unwrap();
        }
    }
}

#[test]
fn heads_and_blocks_that_do_not_go_together_change_nothing() {
    let config = configs().remove(0);
    let mut c = PagedCache::new(config.clone()).unwrap();
    let s = filled(&mut c, 30);
    let (head, blocks) = c.export_split(s, c.final_blocks(s).unwrap()).unwrap();
    assert!(blocks.len() >= 3);
    let given: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    let mut other = PagedCache::new(config.clone()).unwrap();
    let keep = filled(&mut other, 6);
    let before = other.export_sequence(keep).unwrap();
    let free = other.pool().free_blocks();
    let offload = |r: Result<SeqId, CacheError>| match r {
        Err(CacheError::Offload(m)) => m,
        other => panic!("expected an offload error, got {other:?}"),
    };
    let m = offload(other.import_split(&head, &given[1..]));
    assert!(m.contains("stored blocks"), "{m}");
    let mut short = blocks[0].clone();
    short.pop();
    let mut with_short = given.clone();
    with_short[0] = &short;
    let m = offload(other.import_split(&head, &with_short));
    assert!(m.contains("bytes"), "{m}");
    for at in [0, 9, 20, head.len() / 2, head.len() - 1] {
        let mut bad = head.clone();
        bad[at] ^= 0x40;
        offload(other.import_split(&bad, &given));
    }
    offload(other.import_split(&head[..head.len() - 7], &given));
    // A whole-sequence file is not a head, and a head of another config is refused.
    offload(other.import_split(&c.export_sequence(s).unwrap(), &given));
    let mut third = PagedCache::new(configs().remove(2)).unwrap();
    let t = filled(&mut third, 30);
    let (head3, blocks3) = third.export_split(t, third.final_blocks(t).unwrap()).unwrap();
    let given3: Vec<&[u8]> = blocks3.iter().map(Vec::as_slice).collect();
    offload(other.import_split(&head3, &given3));
    // No room: the pool's own error.
    let mut tiny = PagedCache::new(CacheConfig { capacity_blocks: 20, ..config }).unwrap();
    assert!(matches!(tiny.import_split(&head, &given), Err(CacheError::PoolExhausted { .. })));
    assert_eq!(tiny.pool().free_blocks(), 20);
    assert_eq!(other.export_sequence(keep).unwrap(), before, "nothing stored changed");
    assert_eq!(other.pool().free_blocks(), free);
    // And the right pieces still import.
    other.import_split(&head, &given).unwrap();
}
