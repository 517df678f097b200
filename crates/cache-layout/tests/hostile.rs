//! Crafted files and sizes, as a hostile user would send them: each is refused with a typed
//! error, quickly, with nothing changed, or loads into a cache that stays usable. The
//! `regressions/` inputs are the smallest files fuzzing found for each finding; the others are
//! built here from a valid file, its checksum recomputed so that the parser itself is reached.

use std::path::Path;
use std::time::{Duration, Instant};

use kvq_cache_layout::cache::MAX_SEQ_ID;
use kvq_cache_layout::config::MAX_WINDOW_TOKENS;
use kvq_cache_layout::{CacheConfig, CacheError, PagedCache, SeqId, TailDtype};
use kvq_quant_core::QuantSpec;
use kvq_quant_core::calibration::Part;

fn spec(s: &str) -> QuantSpec {
    s.parse().unwrap()
}

/// The config of the crafted one-sequence file in `regressions/offload-seq`.
fn seq_config() -> CacheConfig {
    CacheConfig::new(2, 2, 8, 48)
        .with_block_size(4)
        .with_specs(spec("int4-channel"), spec("int4-token"))
        .with_residual_blocks(1)
        .with_sink_tokens(2)
}

fn token(c: &CacheConfig, t: usize) -> Vec<f32> {
    (0..c.kv_heads * c.head_dim).map(|i| ((i * 7 + t * 3) % 11) as f32 * 0.25 - 1.0).collect()
}

/// A cache of `c` with one sequence of `n` tokens in every layer.
fn filled(c: CacheConfig, n: usize) -> (PagedCache, SeqId) {
    let mut cache = PagedCache::new(c.clone()).unwrap();
    let seq = cache.create();
    for t in 0..n {
        for l in 0..c.layers {
            cache.append(seq, l, &token(&c, t), &token(&c, t + 1)).unwrap();
        }
    }
    (cache, seq)
}

/// Recomputes the trailing CRC-32, as a crafted file would.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
}

/// Offset of the body (after magic, version, kind, header length and header).
fn body_start(bytes: &[u8]) -> usize {
    17 + u32::from_le_bytes(bytes[13..17].try_into().unwrap()) as usize
}

/// The file with its JSON header replaced by `f(header)`, lengths and checksum fixed.
fn with_header(bytes: &[u8], f: impl Fn(&str) -> String) -> Vec<u8> {
    let start = body_start(bytes);
    let header = f(std::str::from_utf8(&bytes[17..start]).unwrap());
    let mut out = bytes[..13].to_vec();
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&bytes[start..]);
    reseal(&mut out);
    out
}

fn regressions(kind: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/regressions").join(kind);
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no regression inputs for {kind}");
    out
}

#[track_caller]
fn quick<T>(f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    out
}

#[test]
fn every_crafted_cache_file_is_refused_quickly() {
    // `fuzz-*` inputs are valid files that once broke a later step; the fuzz crate's
    // regression test replays those through every step.
    for (name, bytes) in regressions("offload-cache").into_iter().filter(|(n, _)| !n.starts_with("fuzz-")) {
        let got = quick(|| PagedCache::from_bytes(&bytes));
        // copied-overflow holds a legal (if extreme) counter: it loads, and counting saturates.
        if name.contains("copied-overflow") {
            let mut cache = got.unwrap_or_else(|e| panic!("{name}: {e}"));
            let seqs: Vec<SeqId> = cache.sequences().collect();
            for s in seqs {
                let f = cache.fork(s).unwrap();
                let c = cache.config().clone();
                for t in 0..2 * c.block_size {
                    cache.append(f, 0, &token(&c, t), &token(&c, t)).unwrap();
                }
            }
            assert_eq!(cache.stats().copied_blocks, u64::MAX, "{name}: the counter saturates");
            continue;
        }
        let e = got.err().unwrap_or_else(|| panic!("{name} loaded"));
        assert!(matches!(e, CacheError::Offload(_) | CacheError::Config(_)), "{name}: {e}");
    }
}

#[test]
fn a_non_finite_tail_in_a_file_is_refused_and_the_cache_keeps_working() {
    for (name, bytes) in regressions("offload-cache").into_iter().filter(|(n, _)| n.contains("nan-tail")) {
        let e = PagedCache::from_bytes(&bytes).unwrap_err();
        assert!(e.to_string().contains("full-precision key value"), "{name}: {e}");
    }
    let (mut cache, _) = filled(seq_config(), 3);
    let before = cache.clone();
    for (name, bytes) in regressions("offload-seq") {
        let e = quick(|| cache.import_sequence(&bytes)).unwrap_err();
        assert!(e.to_string().contains("full-precision"), "{name}: {e}");
        assert_eq!(cache, before, "{name}: a refused import changed the cache");
    }
    // The same file, valid: a tail value of 70000 (over f16's largest) written as f32 tails is
    // refused too, since the cache itself would never have stored it.
    let c = seq_config().with_tail_dtype(TailDtype::F32);
    let (cache, seq) = filled(c.clone(), 3);
    let file = cache.export_sequence(seq).unwrap();
    let one = 1.0f32.to_le_bytes();
    let at = file.windows(4).rposition(|w| w == one).expect("a 1.0 in some tail");
    let mut bad = file.clone();
    bad[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    reseal(&mut bad);
    let mut target = PagedCache::new(c).unwrap();
    assert!(target.import_sequence(&bad).is_err());
    assert!(target.import_sequence(&file).is_ok());
}

#[test]
fn sequence_ids_never_wrap() {
    let (cache, seq) = filled(CacheConfig::new(1, 1, 8, 16).with_block_size(4), 5);
    let bytes = cache.to_bytes().unwrap();
    let at = body_start(&bytes);
    let with_next = |id: u64| {
        let mut b = bytes.clone();
        b[at..at + 8].copy_from_slice(&id.to_le_bytes());
        reseal(&mut b);
        b
    };
    for id in [u64::MAX, u64::MAX - 1, MAX_SEQ_ID + 1] {
        let e = PagedCache::from_bytes(&with_next(id)).unwrap_err();
        assert!(e.to_string().contains("next sequence id"), "{id}: {e}");
    }
    let mut loaded = PagedCache::from_bytes(&with_next(MAX_SEQ_ID)).unwrap();
    let a = loaded.create();
    let b = loaded.fork(seq).unwrap();
    assert_eq!((a, b), (SeqId(MAX_SEQ_ID), SeqId(MAX_SEQ_ID + 1)));
    assert_eq!(loaded.len(seq, 0).unwrap(), 5, "the live sequence was not replaced");
    assert_eq!(loaded.sequences().count(), 3);
    // Found by the fuzzer: such a cache wrote a file its own loader refused. It is not
    // written now; one sequence of it still is.
    assert!(matches!(loaded.to_bytes(), Err(CacheError::SequenceIds(_))));
    assert!(loaded.export_sequence(a).is_ok());
    let at_bound = PagedCache::from_bytes(&with_next(MAX_SEQ_ID)).unwrap();
    assert_eq!(PagedCache::from_bytes(&at_bound.to_bytes().unwrap()).unwrap(), at_bound);
}

#[test]
fn unknown_header_fields_are_refused() {
    let (cache, _) = filled(CacheConfig::new(1, 1, 8, 16).with_block_size(4), 2);
    let bytes = cache.to_bytes().unwrap();
    assert!(PagedCache::from_bytes(&with_header(&bytes, str::to_string)).is_ok());
    let extra = with_header(&bytes, |h| h.replacen('{', "{\"residual_block\":4,", 1));
    let e = PagedCache::from_bytes(&extra).unwrap_err();
    assert!(e.to_string().contains("unknown field"), "{e}");
}

#[test]
fn huge_pools_in_a_header_are_refused_before_allocation() {
    let (cache, _) = filled(CacheConfig::new(1, 1, 8, 16).with_block_size(4), 2);
    let bytes = cache.to_bytes().unwrap();
    for cap in [1u64 << 40, u64::from(u32::MAX) + 1, u64::from(u32::MAX), 1 << 24] {
        let crafted = with_header(&bytes, |h| {
            h.replace("\"capacity_blocks\":16", &format!("\"capacity_blocks\":{cap}"))
        });
        let e = quick(|| PagedCache::from_bytes(&crafted)).unwrap_err();
        assert!(matches!(e, CacheError::Offload(_)), "{cap}: {e}");
    }
}

#[test]
fn overflowing_sizes_in_a_config_are_errors() {
    let base = CacheConfig::new(1, 2, 8, 16).with_block_size(4);
    let cases = [
        ("head_dim", CacheConfig { head_dim: 1 << 62, ..base.clone() }),
        ("block_size", CacheConfig { block_size: usize::MAX, ..base.clone() }),
        ("kv_heads", CacheConfig { kv_heads: usize::MAX / 2, ..base.clone() }),
        ("residual_blocks", CacheConfig { residual_blocks: usize::MAX, ..base.clone() }),
        ("residual_blocks", CacheConfig { residual_blocks: 1 << 62, ..base.clone() }),
        ("residual_blocks", CacheConfig { residual_blocks: MAX_WINDOW_TOKENS, ..base.clone() }),
        ("sink_tokens", CacheConfig { sink_tokens: usize::MAX, ..base.clone() }),
        ("capacity_blocks", CacheConfig { capacity_blocks: 1 << 40, ..base.clone() }),
        ("capacity_blocks", CacheConfig { capacity_blocks: u32::MAX as usize + 1, ..base.clone() }),
        ("layers", CacheConfig { layers: usize::MAX, ..base.clone() }),
    ];
    for (field, c) in cases {
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains(field), "{field}: {e}");
        assert!(PagedCache::new(c).is_err(), "{field}");
    }
    // Valid sizes, but a pool no machine has: a typed error, not an abort.
    let c = CacheConfig { capacity_blocks: u32::MAX as usize, head_dim: 1 << 12, ..base };
    assert!(matches!(PagedCache::new(c), Err(CacheError::Alloc { .. })));
}

/// With f32 parameters and f16 tails, a value over f16's range would become infinite in the
/// tail; it is refused before anything is written.
#[test]
fn values_that_f16_tails_cannot_hold_are_refused_up_front() {
    let c = CacheConfig::new(1, 1, 8, 16)
        .with_block_size(4)
        .with_specs(spec("int4-channel-f32"), spec("int4-token-f32"))
        .with_sink_tokens(1);
    let mut cache = PagedCache::new(c.clone()).unwrap();
    let seq = cache.create();
    let mut big = vec![0.5f32; 8];
    big[3] = 70_000.0;
    for t in 0..12 {
        let before = cache.clone();
        // Keys stream through the f16 tail (per channel); values are quantized at once except
        // for the sink.
        let e = cache.append(seq, 0, &big, &token(&c, t)[..8]).unwrap_err();
        assert!(e.to_string().contains("f16 tail"), "{e}");
        assert_eq!(cache, before);
        let v_ok = cache.append(seq, 0, &token(&c, t)[..8], &big);
        assert_eq!(v_ok.is_ok(), t > 0, "token {t}: values go to an f16 tail only as sinks");
        if v_ok.is_err() {
            cache.append(seq, 0, &token(&c, t)[..8], &token(&c, t)[..8]).unwrap();
        }
    }
    let mut f32_tails = PagedCache::new(c.with_tail_dtype(TailDtype::F32)).unwrap();
    let s = f32_tails.create();
    for _ in 0..12 {
        f32_tails.append(s, 0, &big, &big).unwrap();
    }
}

#[test]
fn saving_replaces_the_file_in_one_rename() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("kvq-atomic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cache.kvqc");
    let (cache, _) = filled(CacheConfig::new(1, 1, 8, 16).with_block_size(4), 6);
    cache.save(&path).unwrap();
    let first = std::fs::metadata(&path).unwrap().ino();
    cache.save(&path).unwrap();
    // A write in place keeps the inode; a temporary file renamed over the old one does not.
    assert_ne!(std::fs::metadata(&path).unwrap().ino(), first);
    assert_eq!(PagedCache::load(&path).unwrap(), cache);
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "temporary files left behind: {names:?}");
    assert!(cache.save(dir.join("missing-dir/cache.kvqc")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn devices_and_directories_are_not_read() {
    for p in ["/dev/zero", "/dev/urandom", "/"] {
        if Path::new(p).exists() {
            let e = quick(|| PagedCache::load(p)).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{p}: {e}");
        }
    }
}

#[test]
fn channel_bit_maps_that_do_not_fit_are_refused() {
    use kvq_quant_core::ChannelBits;
    let base = CacheConfig::new(2, 2, 16, 16)
        .with_block_size(4)
        .with_specs(spec("int3-channel-qa"), spec("int4-token"));
    let good = |i: usize| {
        ChannelBits::new((0..16).map(|c| if (c + i).is_multiple_of(2) { 2 } else { 4 }).collect()).unwrap()
    };
    let maps: Vec<ChannelBits> = (0..4).map(good).collect();
    assert!(PagedCache::new(base.clone().with_channel_bits(maps.clone())).is_ok());
    let mut off_sum = maps.clone();
    off_sum[3] = ChannelBits::uniform(16, 4).unwrap();
    // 2 bits on 4 channels: a width that is not a whole 8-channel unit.
    let mut ragged = maps.clone();
    ragged[1] = ChannelBits::new([2, 2, 2, 2, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3, 3, 3].to_vec()).unwrap();
    let cases = [
        ("no maps", base.clone()),
        ("too few maps", base.clone().with_channel_bits(maps[..3].to_vec())),
        ("a map of another head_dim", {
            let mut m = maps.clone();
            m[0] = ChannelBits::uniform(8, 3).unwrap();
            base.clone().with_channel_bits(m)
        }),
        ("widths that do not sum", base.clone().with_channel_bits(off_sum)),
        ("a ragged width", base.clone().with_channel_bits(ragged)),
        (
            "maps without -qa",
            base.clone().with_specs(spec("int3-channel"), spec("int4-token")).with_channel_bits(maps.clone()),
        ),
        (
            "-qa values",
            base.clone()
                .with_specs(spec("int3-channel-qa"), spec("int3-channel-qa"))
                .with_channel_bits(maps.clone()),
        ),
    ];
    for (what, config) in cases {
        assert!(matches!(PagedCache::new(config), Err(CacheError::Config(_))), "{what}");
    }
    // A file whose map was edited to widths outside 1..=8 is refused, not decoded wrongly.
    let (cache, _) = filled(base.with_channel_bits(maps), 9);
    let bytes = cache.to_bytes().unwrap();
    let back = PagedCache::from_bytes(&bytes).unwrap();
    assert_eq!(back, cache);
    let crafted = with_header(&bytes, |h| h.replacen("[2,4,", "[9,4,", 1));
    assert_ne!(crafted, bytes);
    assert!(matches!(PagedCache::from_bytes(&crafted), Err(CacheError::Offload(_))));
    let crafted = with_header(&bytes, |h| h.replacen("[2,4,", "[4,4,", 1));
    assert!(matches!(PagedCache::from_bytes(&crafted), Err(CacheError::Offload(_))));
}

#[test]
fn one_byte_parameter_grids_that_are_not_ranges_are_refused() {
    // Blocks of `-p8` keys hold their grid (two f16 ends) after the codes: a file whose grid
    // is reversed or not finite is refused on import, and the cache is left as it was.
    let c = seq_config().with_specs(spec("int4-channel-p8"), spec("int4-token")).with_residual_blocks(0);
    let (cache, seq) = filled(c.clone(), 11);
    let file = cache.export_sequence(seq).unwrap();
    let bb = cache.memory().block_bytes as u64;
    // Each block: its length (u64) then its contents, K codes (4 rows of 8 INT4 codes) first.
    let code_bytes = 4 * 4;
    let at = file.windows(8).position(|w| w == bb.to_le_bytes()).expect("a block in the file") + 8;
    let grid = at + code_bytes;
    let (lo, hi) = (&file[grid..grid + 2], &file[grid + 2..grid + 4]);
    let lo = half::f16::from_le_bytes([lo[0], lo[1]]);
    let hi = half::f16::from_le_bytes([hi[0], hi[1]]);
    assert!(lo < hi, "the grid of the first block: [{lo}, {hi}]");
    let mut target = PagedCache::new(c).unwrap();
    let empty = target.clone();
    for bad_grid in [[hi, lo], [half::f16::NAN, hi], [lo, half::f16::INFINITY]] {
        let mut bad = file.clone();
        bad[grid..grid + 2].copy_from_slice(&bad_grid[0].to_le_bytes());
        bad[grid + 2..grid + 4].copy_from_slice(&bad_grid[1].to_le_bytes());
        reseal(&mut bad);
        let e = target.import_sequence(&bad).unwrap_err();
        assert!(e.to_string().contains("parameter grid"), "{e}");
        assert_eq!(target, empty, "a refused import changed the cache");
    }
    let imported = target.import_sequence(&file).unwrap();
    for h in 0..2 {
        assert_eq!(
            target.dequantize(imported, 0, h, Part::K).unwrap(),
            cache.dequantize(seq, 0, h, Part::K).unwrap()
        );
    }
}

#[test]
fn int8_tails_with_bad_scales_or_another_type_are_refused() {
    // Keys in f16, values in 8 bits: the values' sinks and window hold a scale per row.
    let c = seq_config().with_value_tail_dtype(TailDtype::Int8);
    let (cache, seq) = filled(c.clone(), 7);
    let file = cache.export_sequence(seq).unwrap();
    let mut target = PagedCache::new(c.clone()).unwrap();
    target.import_sequence(&file).unwrap();
    // The scale of the first value row of head 0 (token 1's values, as `filled` appends them).
    let row = &token(&c, 1)[..c.head_dim];
    let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
    let at = file.windows(4).position(|w| w == scale.to_le_bytes()).expect("the scale of a sink row");
    for bad_scale in [f32::NAN, f32::INFINITY, 1e38] {
        let mut bad = file.clone();
        bad[at..at + 4].copy_from_slice(&bad_scale.to_le_bytes());
        reseal(&mut bad);
        let before = target.clone();
        let e = quick(|| target.import_sequence(&bad)).unwrap_err();
        assert!(e.to_string().contains("full-precision value"), "scale {bad_scale}: {e}");
        assert_eq!(target, before, "a refused import changed the cache");
    }
    // A whole cache whose header names another storage type than its bytes were written in:
    // rows of another length, refused by their count.
    let whole = cache.to_bytes().unwrap();
    assert_eq!(PagedCache::from_bytes(&whole).unwrap(), cache);
    for (from, to) in [
        ("\"value_tail_dtype\":\"int8\"", "\"value_tail_dtype\":\"f16\""),
        ("\"tail_dtype\":\"f16\"", "\"tail_dtype\":\"int8\""),
    ] {
        let bad = with_header(&whole, |h| {
            assert!(h.contains(from), "{h}");
            h.replace(from, to)
        });
        let e = quick(|| PagedCache::from_bytes(&bad)).unwrap_err();
        assert!(e.to_string().contains("partial row") || e.to_string().contains("lengths"), "{to}: {e}");
    }
}
