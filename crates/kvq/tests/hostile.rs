//! Hostile input to the facade and the CLI: crafted configs, empty shapes of huge extent,
//! flags out of range, devices instead of files, and a bad `KVQ_FORCE_BACKEND`. Each is a
//! typed error or a one-line message with exit code 1, quickly; none panics, aborts or hangs.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::kvq;
use kvq::layout::CacheError;
use kvq::prelude::*;

/// Runs `kvq args`, expecting a refusal: exit code 1 within `secs`, one line on stderr that
/// contains `needle`.
#[track_caller]
fn refused(args: &[&str], needle: &str, secs: u64) {
    let start = Instant::now();
    let out = kvq(args);
    let took = start.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("backtrace"), "{args:?}: {err}");
    assert!(took < Duration::from_secs(secs), "{args:?} took {took:?}");
}

fn regressions(kind: &str) -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/regressions").join(kind);
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.display().to_string(), std::fs::read_to_string(&p).unwrap_or_default())
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no regression inputs for {kind}");
    out
}

/// A crafted config that parses is valid on its face; its trouble is in use. It is used as
/// the fuzz target uses it: tokens appended up to 2^16 values, then one attention call, which
/// must be a typed error or finite output, quickly.
#[track_caller]
fn used_safely(name: &str, c: &KvCacheConfig) {
    let start = Instant::now();
    let mut cache = QuantizedKvCache::new(c.clone()).unwrap();
    let per_token = c.kv_heads * c.head_dim;
    let tokens = ((1usize << 16) / per_token.max(1)).min(3 * c.block_size + 2).max(1);
    let seq = cache.create();
    let row = |len: usize, t: usize| -> Vec<f32> {
        (0..len).map(|i| ((i * 7 + t * 13) % 23) as f32 * 0.125 - 1.4).collect()
    };
    for t in 0..tokens {
        cache.append(seq, 0, &row(per_token, t), &row(per_token, t + 1)).unwrap();
    }
    let q = row(c.query_heads * c.head_dim, 3);
    let mut out = vec![0f32; q.len()];
    match cache.attention(&AttentionOptions::default(), seq, 0, &q, &mut out) {
        Ok(()) => assert!(out.iter().all(|x| x.is_finite()), "{name}: non-finite output"),
        Err(e) => assert!(matches!(e, KvqError::Attention(_)), "{name}: {e}"),
    }
    assert!(start.elapsed() < Duration::from_secs(20), "{name} took {:?}", start.elapsed());
}

#[test]
fn crafted_configs_are_refused() {
    // Most regression configs are refused as they are read; the rest are used and must fail
    // only with a typed error (the fuzz-* ones found that way).
    let mut used = 0;
    for (name, text) in regressions("config-toml") {
        match KvCacheConfig::from_toml(&text) {
            Err(e) => assert!(matches!(e, KvqError::Config(_)), "{name}: {e}"),
            Ok(c) => {
                assert!(name.contains("/fuzz-"), "{name} was meant to be refused as it is read");
                used_safely(&name, &c);
                used += 1;
            }
        }
    }
    assert!(used >= 1, "the used-config regressions are gone");
    for (name, text) in regressions("config-json") {
        let e = KvCacheConfig::from_json(&text).unwrap_err();
        assert!(matches!(e, KvqError::Config(_)), "{name}: {e}");
    }
    let good = KvCacheConfig::builder(2, 2, 4, 8).block_size(4).blocks_per_layer(8).build().unwrap();
    assert_eq!(KvCacheConfig::from_toml(&good.to_toml()).unwrap(), good);
    // A misspelt field is an error, not a silently ignored setting.
    let typo = good.to_toml().replace("residual_blocks", "residual_block");
    assert!(KvCacheConfig::from_toml(&typo).unwrap_err().to_string().contains("unknown field"));
    let extra = good.to_json().replacen('{', "{\"sinks\": 8,", 1);
    assert!(KvCacheConfig::from_json(&extra).unwrap_err().to_string().contains("unknown field"));
}

#[test]
fn a_huge_pool_is_an_error_not_an_abort() {
    for blocks in [1usize << 40, u32::MAX as usize] {
        let c = KvCacheConfig::builder(1, 8, 8, 128).blocks_per_layer(blocks).build();
        let e = c.and_then(QuantizedKvCache::new).map(|_| ()).unwrap_err();
        assert!(
            matches!(e, KvqError::Config(_) | KvqError::Cache(CacheError::Alloc { .. })),
            "{blocks}: {e}"
        );
    }
}

#[test]
fn configs_are_written_atomically_and_read_only_from_regular_files() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("kvq-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = KvCacheConfig::builder(2, 2, 4, 8).block_size(4).blocks_per_layer(8).build().unwrap();
    for name in ["cache.toml", "cache.json"] {
        let path = dir.join(name);
        config.save(&path).unwrap();
        let ino = std::fs::metadata(&path).unwrap().ino();
        config.save(&path).unwrap();
        assert_ne!(std::fs::metadata(&path).unwrap().ino(), ino, "{name} was rewritten in place");
        assert_eq!(KvCacheConfig::load(&path).unwrap(), config);
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2, "temporary files left behind");
    std::fs::remove_dir_all(&dir).unwrap();
    for p in ["/dev/zero", "/"] {
        let e = KvCacheConfig::load(p).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{p}: {e}");
    }
}

#[test]
fn calibrating_a_huge_empty_tensor_is_refused_at_once() {
    for (name, _) in regressions("safetensors") {
        let out = std::env::temp_dir().join(format!("kvq-cal-{}.json", std::process::id()));
        refused(&["calibrate", &name, "--out", &out.display().to_string()], "empty", 10);
        assert!(!out.exists());
        refused(&["analyze", &name], "", 10);
        refused(&["recommend", &name, "--budget-bits", "4"], "", 10);
    }
}

#[test]
fn bad_flags_are_refused() {
    refused(&["bench", "--context", "100000000"], "--context", 10);
    for b in ["nan", "inf", "-inf", "0", "-1"] {
        refused(&["recommend", &format!("--budget-bits={b}")], "--budget-bits", 10);
    }
    refused(&["analyze", "/dev/zero"], "not a regular file", 10);
    refused(&["analyze", "/"], "not a regular file", 10);
}

/// A file whose head_dim (16) no group of 32 divides: the built-in list skips those specs and
/// says so; naming one of them explicitly is still an error.
#[test]
fn the_default_list_applies_to_small_heads() {
    let dir = std::env::temp_dir().join(format!("kvq-small-heads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("small.safetensors");
    let (heads, tokens, d) = (2usize, 40usize, 16usize);
    let data: Vec<u8> =
        (0..heads * tokens * d).flat_map(|i| (((i * 37) % 101) as f32 / 50.0 - 1.0).to_le_bytes()).collect();
    let shape = vec![heads, tokens, d];
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = ["q", "k", "v"]
        .iter()
        .map(|n| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), &data).unwrap();
            (format!("layer0.{n}"), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let file = path.display().to_string();
    let out = kvq(&["analyze", &file, "--positions", "4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("skipping built-in spec int8-g32"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("int4-channel32/int4-token"));
    refused(&["analyze", &file, "--specs", "int4-g32"], "group", 10);
    let out = kvq(&["recommend", &file, "--budget-bits", "6", "--positions", "4"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

const BAD_BACKEND: &str = "no-such-backend";

/// `KVQ_FORCE_BACKEND` is read once per process, so this test runs itself again in a child
/// process with a bad value, where the facade must refuse to work rather than fall back to the
/// scalar kernels.
#[test]
fn a_bad_forced_backend_is_an_error_in_the_facade() {
    if std::env::var("KVQ_FORCE_BACKEND").as_deref() == Ok(BAD_BACKEND) {
        let config = KvCacheConfig::builder(1, 1, 1, 8).blocks_per_layer(4).build().unwrap();
        let e = QuantizedKvCache::new(config).unwrap_err();
        assert!(matches!(e, KvqError::Backend(_)), "{e}");
        assert!(e.to_string().contains(BAD_BACKEND), "{e}");
        return;
    }
    if std::env::var("KVQ_TEST_RUNNER").is_ok_and(|r| !r.trim().is_empty()) {
        return; // Under qemu the child would need the runner too; the host run covers it.
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_bad_forced_backend_is_an_error_in_the_facade", "--nocapture"])
        .env("KVQ_FORCE_BACKEND", BAD_BACKEND)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for args in [&["bench", "--context", "64"][..], &["info"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvq"))
            .args(args)
            .env("KVQ_FORCE_BACKEND", BAD_BACKEND)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(BAD_BACKEND), "{args:?}: {err}");
    }
}

/// Found by the fuzzer: `query_heads` was only checked to be a multiple of `kv_heads`, so a
/// config with 2^62 of them loaded and attention's `query_heads × head_dim` overflowed.
#[test]
fn query_heads_are_bounded() {
    let good = KvCacheConfig::builder(1, 2, 4, 8).block_size(4).blocks_per_layer(8).build().unwrap();
    let bad = good.to_toml().replace("query_heads = 4", "query_heads = 4611686018427387904");
    let e = KvCacheConfig::from_toml(&bad).unwrap_err();
    assert!(e.to_string().contains("query_heads"), "{e}");
}

#[test]
fn errors_of_a_layer_name_the_models_layer() {
    // Each layer is a one-layer cache inside; its errors used to say layer 0 whatever the layer.
    let spec: QuantSpec = "int4-token".parse().unwrap();
    let config =
        KvCacheConfig::builder(3, 1, 1, 32).specs(spec.clone(), spec).sink_tokens(0).build().unwrap();
    let mut cache = QuantizedKvCache::new(config).unwrap();
    let seq = cache.create();
    let mut k = vec![0.5f32; 32];
    k[7] = f32::NAN;
    let v = vec![0.5f32; 32];
    match cache.append(seq, 2, &k, &v) {
        Err(KvqError::Cache(CacheError::NonFinite { layer: 2, channel: 7, .. })) => {}
        other => panic!("{other:?}"),
    }
    let mut all_k = vec![0.5f32; 3 * 32];
    all_k[32 + 5] = f32::INFINITY;
    let all_v = vec![0.5f32; 3 * 32];
    let e = cache.append_all_layers(seq, &all_k, &all_v).unwrap_err();
    assert!(matches!(e, KvqError::Cache(CacheError::NonFinite { layer: 1, channel: 5, .. })), "{e:?}");
    assert!(e.to_string().contains("layer 1"), "{e}");
    assert_eq!(cache.len(seq, 0).unwrap(), 0);
}
