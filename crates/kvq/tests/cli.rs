//! The `kvq` binary, run as a user runs it.

use std::process::Output;

mod common;
#[path = "../../quant-core/tests/common/shared_data.rs"]
mod shared_data;

use common::kvq;

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn analyze_synthetic_table() {
    let out = kvq(&["analyze", "--synthetic"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The table prints 3-4 significant digits, which is the rounding of the snapshot.
    insta::assert_snapshot!(stdout(&out));
}

#[test]
fn analyze_embedded_sample_structure() {
    let out = kvq(&["analyze"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    for layer in ["layer0", "layer9", "layer29"] {
        assert!(text.contains(&format!("\n{layer}: K/V [3, 256, 64], 9 query heads")), "{text}");
    }
    // `channel` groups a channel over the cache's 32-token block, and the name says so.
    assert_eq!(text.lines().filter(|l| l.starts_with("int4-channel32/int4-token ")).count(), 3);
    assert_eq!(text.lines().filter(|l| l.starts_with("int2-channel32/int2-token-mse-rot ")).count(), 3);
    // Bits per key channel, fitted on the first half of each layer.
    assert_eq!(text.lines().filter(|l| l.starts_with("int2-channel32-qa/int2-token-mse-rot ")).count(), 3);
}

#[test]
fn analyze_keys_before_rope_takes_the_models_rope() {
    // The embedded sample has no rope.inv_freq but its rope_theta metadata; --rope-theta
    // overrides it (another base gives other numbers); no pairing, no RoPE.
    let specs = "--specs=int4-channel-prerope/int4-token,int4-channel/int4-token";
    let out = kvq(&["analyze", specs, "--positions", "4", "--rope-pairing", "none"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--rope-theta"), "{err}");
    let out = kvq(&["analyze", specs, "--positions", "4", "--rope-theta", "100000"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    let from_metadata = kvq(&["analyze", specs, "--positions", "4"]);
    assert_eq!(stdout(&from_metadata), text, "the sample's rope_theta is 100000");
    let other = kvq(&["analyze", specs, "--positions", "4", "--rope-theta", "10000"]);
    assert!(other.status.success() && stdout(&other) != text);
    let bits = |name: &str| -> Vec<String> {
        let rows = text.lines().filter(|l| l.starts_with(&format!("{name} ")));
        rows.map(|l| l.split_whitespace().nth(1).unwrap().to_string()).collect()
    };
    let pre = bits("int4-channel32-prerope/int4-token");
    assert_eq!(pre.len(), 3, "{text}");
    assert_eq!(pre, bits("int4-channel32/int4-token"), "the same bytes");
}

#[test]
fn analyze_through_the_cache_counts_its_full_precision_tokens() {
    let bits = |args: &[&str]| -> Vec<f64> {
        let out = kvq(args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        v["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["rows"][0]["bits_per_element"].as_f64().unwrap())
            .collect()
    };
    let spec = ["analyze", "--json", "--positions", "4", "--specs", "int4-channel/int4-token"];
    let offline = bits(&spec);
    let cached = bits(&[&spec[..], &["--cache"]].concat());
    let more_sinks = bits(&[&spec[..], &["--cache", "--sinks", "64", "--residual-blocks", "2"]].concat());
    for ((a, b), c) in offline.iter().zip(&cached).zip(&more_sinks) {
        // 256 tokens: 4 sinks and a 32..63-token window in f16 add about 2 bits; more, more.
        assert!(a + 1.0 < *b && b + 2.0 < *c, "{offline:?} {cached:?} {more_sinks:?}");
    }
    // The same window in 8 bits (a scale per row of 64: 8.5 bits), or only the values':
    // keys wait in the window, values (per-token, no `row_window`) only in the sinks.
    let int8 = bits(&[&spec[..], &["--cache", "--tail-dtype", "int8"]].concat());
    let values = bits(&[&spec[..], &["--cache", "--tail-dtype", "f16/int8"]].concat());
    for (((a, b), c), d) in offline.iter().zip(&cached).zip(&int8).zip(&values) {
        let (f16, eight) = (b - a, c - a);
        // Rows of 68 bytes instead of 128, less the quantized bits they stand in for: 0.53.
        assert!((0.45..0.6).contains(&(eight / f16)), "{cached:?} {int8:?}");
        assert!(d < b && b - d < 0.1, "{cached:?} {values:?}");
    }
    // The built-in list drops what the cache cannot stream, and says why on stderr.
    let out = kvq(&["analyze", "--cache", "--positions", "2"]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("skipping built-in spec int4-tensor") && err.contains("calibration"), "{err}");
    assert!(!stdout(&out).contains("int4-tensor") && stdout(&out).contains("int4-channel32/int4-token "));
    // Bits per key channel stream through the cache, fitted on the first half.
    assert_eq!(
        stdout(&out).lines().filter(|l| l.starts_with("int4-channel32-qa/int4-token-mse-rot ")).count(),
        3
    );
    // Bits per key channel stream through the cache, fitted on the first half.
    assert!(stdout(&out).contains("int4-channel32-qa/int4-token-mse-rot "), "{}", stdout(&out));
}

#[test]
fn analyze_json_has_every_field() {
    let out = kvq(&["analyze", "--json", "--specs", "int4-channel/int4-token,nf4-token", "--positions", "4"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 3);
    for layer in layers {
        assert_eq!(layer["positions"].as_array().unwrap().len(), 4);
        let rows = layer["rows"].as_array().unwrap();
        assert_eq!(rows[0]["spec"], "int4-channel32/int4-token");
        for key in
            ["bits_per_element", "k_mse", "v_mse", "k_cosine", "attn_rel_err", "attn_kl", "ratio_vs_f16"]
        {
            assert!(rows[1][key].as_f64().unwrap().is_finite(), "{key}");
        }
    }
}

#[test]
fn analyze_shared_data_per_head_snapshot() {
    let Some(path) = shared_data::shared_capture() else {
        shared_data::note_missing("skipped: the snapshot is of the 2048-token capture");
        return;
    };
    let path = path.to_str().expect("a UTF-8 path");
    let specs = "int4-tensor,int4-channel/int4-token,int2-channel/int2-token";
    let out = kvq(&["analyze", path, "--specs", specs, "--positions", "8", "--per-head"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    assert!(
        text.contains("layer9: K/V [3, 2048, 64], 9 query heads, attention at 8 positions (1024..=2047)"),
        "{text}"
    );
    // The first line names the file by its path, which depends on the checkout; the rest is
    // printed to 3-4 significant digits, the rounding of the snapshot.
    let (source, table) = text.split_once('\n').unwrap();
    assert!(source.starts_with("source: ") && source.ends_with("kv-smollm2-135m-sample.safetensors"));
    insta::assert_snapshot!(table);
}

#[test]
fn analyze_plot_writes_three_figures() {
    let dir = std::env::temp_dir().join(format!("kvq-plot-{}", std::process::id()));
    let specs = "int8-tensor,int4-tensor,int2-tensor,int4-channel/int4-token";
    let out = kvq(&[
        "analyze",
        "--specs",
        specs,
        "--positions",
        "4",
        "--per-head",
        "--plot",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    // Three KV heads under each of 4 specs in 3 layers.
    assert_eq!(text.lines().filter(|l| l.starts_with("  kv head ")).count(), 36, "{text}");
    let read = |name: &str| {
        let svg = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\"") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count(), "{name}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{name}");
        svg
    };
    // One key and one value panel per bit width (8, 4, 2) and layer.
    let hist = read("error-histograms.svg");
    for layer in ["layer0", "layer9", "layer29"] {
        for spec in ["int8-tensor", "int4-tensor", "int2-tensor"] {
            for side in ["K", "V"] {
                assert_eq!(
                    hist.matches(&format!(">{layer} · {spec} · {side}<")).count(),
                    1,
                    "{layer} {spec}"
                );
            }
        }
    }
    assert!(!hist.contains("int4-channel"), "one panel per bit width: the first spec of each");
    // Families join their bit widths into one line each.
    let lines = read("bits-vs-error.svg");
    assert_eq!(lines.matches("<polyline").count(), 2);
    assert!(lines.contains(">int-tensor<") && lines.contains(">int-channel32/int-token<"));
    assert_eq!(lines.matches("<circle").count(), 4);
    // 4 bars per layer and 4 legend swatches, plus the background.
    let bars = read("layer-errors.svg");
    assert_eq!(bars.matches("<rect").count(), 1 + 1 + 3 * 4 + 4);
    std::fs::remove_dir_all(&dir).unwrap();

    let blocked = kvq(&["analyze", "--specs", "int8-tensor", "--plot", "/dev/null/plots"]);
    assert_eq!(blocked.status.code(), Some(1));
    let err = String::from_utf8_lossy(&blocked.stderr);
    assert!(err.starts_with("kvq: error: /dev/null/plots") && err.trim_end().lines().count() == 1, "{err}");
}

#[test]
fn errors_are_one_line_with_exit_code_1() {
    for (args, needle) in [
        (vec!["analyze", "/nonexistent.safetensors"], "/nonexistent.safetensors"),
        (vec!["analyze", "--specs", "int9-token"], "int9"),
        (vec!["analyze", "--specs", "int4-g48"], "group size 48"),
        (vec!["analyze", "Cargo.toml"], "not a valid safetensors file"),
        (vec!["analyze", "--cache", "--specs", "int4-tensor"], "give a calibration"),
        (vec!["analyze", "--cache", "--specs", "int4-channel64", "--block-size", "32"], "channel32"),
    ] {
        let out = kvq(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.starts_with("kvq: error: ") && err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    assert_eq!(kvq(&["analyze", "--bogus"]).status.code(), Some(2));
    assert_eq!(kvq(&["analyze", "--sinks", "2"]).status.code(), Some(2), "--sinks needs --cache");
    assert_eq!(kvq(&["analyze", "--cache", "--tail-dtype", "f8"]).status.code(), Some(2));
}

#[test]
fn calibrate_writes_a_file_a_cache_accepts() {
    // The embedded sample holds model layers 0, 9 and 29: a calibration of "3 layers" from it
    // would hand layer 9's ranges to model layer 1, so it is refused.
    let embedded = concat!(env!("CARGO_MANIFEST_DIR"), "/data/sample.safetensors");
    let out = std::env::temp_dir().join(format!("kvq-cal-{}.json", std::process::id()));
    let o = kvq(&["calibrate", embedded, "--out", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("holds layer9 where layer1 should be"));
    // The same tensors as layers 0, 1 and 2 of a 3-layer model.
    let file = kvq::quant::io::TensorFile::open(embedded).unwrap();
    let mut tensors = Vec::new();
    for (i, l) in [0, 9, 29].iter().enumerate() {
        for part in ["q", "k", "v"] {
            let t = file.read(&format!("layer{l}.{part}")).unwrap();
            let s = t.shape();
            let bytes: Vec<u8> = t.data().iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((format!("layer{i}.{part}"), vec![s.heads, s.tokens, s.head_dim], bytes));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    let dense = std::env::temp_dir().join(format!("kvq-cal-{}.safetensors", std::process::id()));
    safetensors::serialize_to_file(views, None, &dense).unwrap();
    let sample = dense.to_str().unwrap();
    let o = kvq(&["calibrate", sample, sample, "--out", out.to_str().unwrap(), "--percentile", "99.5"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cal: kvq::quant::Calibration = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!((cal.layers(), cal.heads(), cal.head_dim(), cal.percentile()), (3, 3, 64, Some(99.5)));
    let config = kvq::cache::KvCacheConfig::builder(3, 3, 9, 64)
        .specs("int8-head".parse().unwrap(), "int4-tensor".parse().unwrap())
        .calibration(cal)
        .build()
        .unwrap();
    assert!(kvq::cache::QuantizedKvCache::new(config).is_ok());
    std::fs::remove_file(&out).unwrap();
    let bad = kvq(&["calibrate", sample, "--out", "/tmp/x.json", "--percentile", "20"]);
    assert_eq!(bad.status.code(), Some(1));
    std::fs::remove_file(&dense).unwrap();
}

#[test]
fn recommend_respects_the_budget_and_writes_a_loadable_config() {
    let out = std::env::temp_dir().join(format!("kvq-rec-{}.toml", std::process::id()));
    let mut qa_chosen = false;
    for budget in ["3.2", "4.6", "9"] {
        let o = kvq(&[
            "recommend",
            "--budget-bits",
            budget,
            "--json",
            "--positions",
            "8",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let avg = v["average_bits"].as_f64().unwrap();
        assert!(avg <= budget.parse::<f64>().unwrap() + 1e-9, "{avg} over {budget}");
        let layers = v["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 3);
        // Dumped layers 0, 9 and 29 are those layers of a 30-layer model; the others take the
        // specs of the nearest dumped layer.
        let config = kvq::cache::KvCacheConfig::load(&out).unwrap();
        assert_eq!(config.layers.len(), 30);
        for (m, c) in config.layers.iter().enumerate() {
            // Nearest of 0, 9 and 29; a tie (19) goes to the lower.
            let from = match m {
                0..=4 => 0,
                5..=19 => 1,
                _ => 2,
            };
            let spec = layers[from]["spec"].as_str().unwrap();
            let (k, vv) = spec.split_once('/').unwrap_or((spec, spec));
            // Bits per key channel are fitted to a dumped layer: the layers it stands in for
            // take the same spec without them.
            let dumped = [0, 9, 29].contains(&m);
            let k = if dumped { k.to_string() } else { k.replace("-qa", "") };
            assert_eq!(
                (c.k.to_string().as_str(), c.v.to_string().as_str()),
                (k.as_str(), vv),
                "model layer {m}"
            );
            assert_eq!(c.k_channel_bits.is_some(), c.k.channel_bits(), "model layer {m}");
        }
        qa_chosen |= layers.iter().any(|l| l["spec"].as_str().unwrap().contains("-qa"));
        // The budget holds for the config written, over its 30 layers, not only for the
        // three dumped ones (the weighted average is the config's own).
        let written = config.bits_per_value();
        assert!(
            written <= budget.parse::<f64>().unwrap() + 1e-6,
            "budget {budget}: the config has {written}"
        );
        assert!((written - avg).abs() < 0.02, "budget {budget}: config {written}, reported {avg}");
        assert!(kvq::cache::QuantizedKvCache::new(config).is_ok());
    }
    // Some budget picks bits per key channel, so their maps' path through the config is tested.
    assert!(qa_chosen);
    let short = kvq(&[
        "recommend",
        "--budget-bits",
        "9",
        "--positions",
        "8",
        "--model-layers",
        "20",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(short.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&short.stderr).contains("the dump holds layer 29, the model has 20 layers")
    );
    std::fs::remove_file(&out).unwrap();
    let too_small = kvq(&["recommend", "--budget-bits", "1"]);
    assert_eq!(too_small.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&too_small.stderr).contains("cheapest candidates need"));
    // A KL bound is kvq-eval's: the error says where to go, with or without a budget.
    for args in [
        &["recommend", "--target-kl", "0.01"][..],
        &["recommend", "--target-kl", "0.01", "--budget-bits", "4"],
    ] {
        let o = kvq(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("kvq-eval --text T"), "{args:?}");
    }
    assert_eq!(kvq(&["recommend"]).status.code(), Some(2), "neither is a usage error");
}

#[test]
fn recommend_through_the_cache_counts_and_writes_its_window_and_sinks() {
    let out = std::env::temp_dir().join(format!("kvq-rec-cache-{}.toml", std::process::id()));
    let run = |extra: &[&str]| {
        let args = [
            &["recommend", "--budget-bits", "9", "--json", "--positions", "4", "--out"][..],
            &[out.to_str().unwrap()],
            extra,
        ]
        .concat();
        let o = kvq(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let config = kvq::cache::KvCacheConfig::load(&out).unwrap();
        (
            v["layers"][0]["spec"].as_str().unwrap().to_string(),
            v["layers"][0]["bits"].as_f64().unwrap(),
            config,
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (_, _, config, said) = run(&[]);
    assert!(said.contains("not those (measure with --cache)"), "{said}");
    assert_eq!((config.residual_blocks, config.sink_tokens), (1, 4));
    let (cached_spec, cached_bits, config, said) =
        run(&["--cache", "--residual-blocks", "2", "--sinks", "8"]);
    assert!(said.contains("count them at the dump's 256 tokens"), "{said}");
    assert_eq!((config.residual_blocks, config.sink_tokens), (2, 8));
    // The chosen spec's bits include at least its 8 f16 sinks out of 256 tokens (and the
    // window, for per-channel specs; the whole last block the pool handed out).
    let o = kvq(&["analyze", "--json", "--positions", "4", "--specs", &cached_spec]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let offline_bits = v["layers"][0]["rows"][0]["bits_per_element"].as_f64().unwrap();
    let sinks = 8.0 * (16.0 - offline_bits) / 256.0;
    assert!(cached_bits > offline_bits + sinks, "{cached_spec}: {offline_bits} {cached_bits}");
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn bench_prints_one_row_per_spec_and_the_baseline() {
    let o =
        kvq(&["bench", "--context", "64", "--steps", "1", "--specs", "int4-channel/int4-token,int8-token"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = stdout(&o);
    // The title, the measured read rate, what "x paged" means, the column names, then the rows.
    assert!(text.lines().nth(1).is_some_and(|l| l.starts_with("one-thread DRAM read: ")), "{text}");
    assert!(text.lines().nth(2).is_some_and(|l| l.starts_with("\"x paged\" is ")), "{text}");
    let rows: Vec<&str> = text.lines().skip(4).collect();
    assert_eq!(rows.len(), 4, "{text}");
    assert!(
        rows[0].starts_with("f32 (GQA, ")
            && rows[1].starts_with("f16 (GQA, ")
            && rows[2].starts_with("int4-channel/int4-token")
            && rows[3].starts_with("int8-token")
    );
    // Every row against the stream floor; the quantized caches' also against their own blocks'.
    assert!(rows[..2].iter().all(|r| r.trim_end().ends_with("x        -")), "{text}");
    let last_two = |r: &str| r.split_whitespace().rev().take(2).all(|f| f.ends_with('x') && f.len() > 1);
    assert!(rows[2..].iter().all(|r| last_two(r)), "{text}");
    // --integer adds the integer paths' row under each spec's.
    let o =
        kvq(&["bench", "--context", "64", "--steps", "1", "--specs", "int4-channel/int4-token", "--integer"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = stdout(&o);
    let rows: Vec<&str> = text.lines().skip(4).collect();
    assert_eq!(rows.len(), 4, "{text}");
    assert!(
        rows[2].starts_with("int4-channel/int4-token ")
            && (rows[3].starts_with("int4-channel/int4-token (integer)")
                || rows[3].starts_with("int4-channel/int4-token (integer, fused)"))
    );
    assert_eq!(kvq(&["bench", "--steps", "0"]).status.code(), Some(1));
    assert_eq!(kvq(&["bench", "--specs", "int4-head"]).status.code(), Some(1));
    // Full-precision sinks and a residual window are held (and read) in f16: more MiB.
    let mib = |extra: &[&str]| -> f64 {
        let args = [
            &["bench", "--context", "4096", "--steps", "1", "--specs", "int4-channel/int4-token"][..],
            extra,
        ]
        .concat();
        let o = kvq(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = stdout(&o);
        let row = text.lines().find(|l| l.starts_with("int4-channel/int4-token")).unwrap().to_string();
        row.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    let (plain, tails) = (mib(&[]), mib(&["--residual-blocks", "1", "--sinks", "4"]));
    assert!(tails > plain, "{plain} MiB without tails, {tails} with");
    // Larger blocks: per-channel keys store one scale and offset per channel per block.
    let big = mib(&["--block-size", "128"]);
    assert!(big < plain, "{plain} MiB in blocks of 32, {big} in blocks of 128");
    assert_ne!(kvq(&["bench", "--block-size", "0"]).status.code(), Some(0));
}

/// Every output path of the tools (`recommend --out`, `calibrate --out`, `analyze --plot`)
/// refuses devices, FIFOs and directories, the command's own input, and a read-only file
/// without `--force`, before any work; a replaced file keeps its permissions.
#[cfg(unix)]
#[test]
fn outputs_never_clobber_what_they_must_not() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("kvq-outputs-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let embedded = concat!(env!("CARGO_MANIFEST_DIR"), "/data/sample.safetensors");
    let input = dir.join("input.safetensors");
    std::fs::copy(embedded, &input).unwrap();
    let input = input.to_str().unwrap().to_string();
    let refused = |args: &[&str], what: &str| {
        let o = kvq(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(what) && err.trim_end().lines().count() == 1, "{args:?}: {err}");
    };
    let recommend = |out: &str, extra: &[&str]| {
        let mut a = vec!["recommend", &input, "--budget-bits", "6", "--positions", "4", "--out", out];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    fn strs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let d = dir.to_str().unwrap().to_string();
    refused(&strs(&recommend(&d, &[])), "directory");
    refused(&strs(&recommend("/dev/null", &[])), "not a regular file");
    refused(&strs(&recommend(&input, &[])), "input");
    // Through a hard link, the same file.
    let link = dir.join("link.toml");
    std::fs::hard_link(&input, &link).unwrap();
    refused(&strs(&recommend(link.to_str().unwrap(), &[])), "input");
    let ro = dir.join("ro.toml");
    std::fs::write(&ro, "old").unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    refused(&strs(&recommend(ro.to_str().unwrap(), &[])), "--force");
    assert_eq!(std::fs::read_to_string(&ro).unwrap(), "old");
    let o = kvq(&strs(&recommend(ro.to_str().unwrap(), &["--force"])));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read_to_string(&ro).unwrap().contains("version"), "a config replaced it");
    assert_eq!(std::fs::metadata(&ro).unwrap().permissions().mode() & 0o777, 0o444);

    refused(&["calibrate", &input, "--out", &input], "input");
    refused(&["calibrate", &input, "--out", "/dev/null"], "not a regular file");

    // Plots: a figure that is a directory blocks the set; nothing is written.
    let plots = dir.join("plots");
    std::fs::create_dir_all(plots.join("layer-errors.svg")).unwrap();
    let p = plots.to_str().unwrap();
    refused(&["analyze", &input, "--specs", "int8-tensor", "--positions", "4", "--plot", p], "directory");
    assert!(!plots.join("bits-vs-error.svg").exists(), "all or none");
    refused(
        &["analyze", &input, "--specs", "int8-tensor", "--plot", ro.to_str().unwrap()],
        "not a directory",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
