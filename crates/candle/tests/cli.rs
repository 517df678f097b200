//! `kvq-eval` as a user runs it, on the tiny model: specs and config files, both protocols,
//! JSON, and one-line errors with exit code 1 (2 for usage).

mod common;

use std::process::Command;

use candle_core::quantized::GgmlDType;
use common::*;

fn eval() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvq-eval"))
}

/// A tiny model and a safetensors file of its token ids.
fn setup(name: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let dir = temp_dir(name);
    let model = tiny_in(
        &dir,
        "llama",
        Types { attn: GgmlDType::Q8_0, mlp: GgmlDType::Q4_0, output: GgmlDType::F32 },
        4,
    );
    let ids: Vec<i32> = Rng::new(6).tokens(200).into_iter().map(|t| t as i32).collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![ids.len()], &bytes).unwrap();
    let tokens = dir.join("tokens.safetensors");
    safetensors::serialize_to_file([("input_ids", view)], None, &tokens).unwrap();
    (dir, model, tokens)
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn specs_and_configs_in_both_protocols() {
    let (dir, model, tokens) = setup("cli");
    let out = eval()
        .arg("--model")
        .arg(&model)
        .arg("--tokens")
        .arg(&tokens)
        .args([
            "--prefill",
            "64",
            "--max-tokens",
            "128",
            "--specs",
            "f32,int8,int4-channel/int4-token",
            "--json",
        ])
        .output()
        .unwrap();
    let r = json(&out);
    assert_eq!(r["positions"], 64);
    let c = r["candidates"].as_array().unwrap();
    assert_eq!(c.len(), 3);
    assert_eq!(c[0]["name"], "f32");
    // kvq's cache holding everything in f32 gives the reference's distributions.
    assert!(c[0]["kl_mean"].as_f64().unwrap() < 1e-9, "{}", c[0]);
    assert!(c[1]["kl_mean"].as_f64().unwrap() < c[2]["kl_mean"].as_f64().unwrap());

    // A config file (as `kvq recommend` writes it) runs as it is; its pool is enlarged only if
    // it cannot hold the context, and says so.
    let model_cfg = kvq_candle::LlamaModel::load(&model).unwrap().config().clone();
    let config = model_cfg
        .cache_builder()
        .specs("int4-channel".parse().unwrap(), "int8-token".parse().unwrap())
        .blocks_per_layer(4)
        .build()
        .unwrap();
    let file = dir.join("cache.toml");
    std::fs::write(&file, config.to_toml()).unwrap();
    let out = eval()
        .arg("--model")
        .arg(&model)
        .arg("--tokens")
        .arg(&tokens)
        .args(["--ctx", "64", "--chunks", "2", "--json", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let r = json(&out);
    assert_eq!(r["positions"], 2 * 31);
    assert!(String::from_utf8_lossy(&out.stderr).contains("blocks per layer"));
    // The table form.
    let out = eval()
        .arg("--model")
        .arg(&model)
        .arg("--tokens")
        .arg(&tokens)
        .args(["--max-tokens", "80", "--prefill", "70", "--specs", "int4,int3-channel-qa/int4-token"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("mean KL") && text.contains("int4"), "{text}");
    // Bits per key channel are fitted on the prefill's keys and queries first.
    assert!(text.contains("int3-channel-qa/int4-token"), "{text}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fitting bits per key channel on 70 tokens"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn passkey_runs_every_cell_for_every_cache() {
    let (dir, model, _) = setup("cli-passkey");
    let out = eval()
        .arg("--model")
        .arg(&model)
        .args(["--passkey", "--passkey-lengths", "400,800", "--passkey-depths", "0,0.5,1"])
        .args(["--passkey-trials", "2", "--specs", "f32,int4", "--json"])
        .output()
        .unwrap();
    let r = json(&out);
    assert_eq!(r["caches"], serde_json::json!(["f32 (reference)", "f32", "int4"]));
    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 6);
    for (i, c) in cells.iter().enumerate() {
        let (want, tokens) = ([400, 800][i / 3], c["tokens"].as_u64().unwrap());
        // The length asked for, to within one filler sentence (long ones in the tiny vocabulary).
        assert!(tokens <= want && 2 * tokens > want, "{c}");
        assert_eq!(c["depth"].as_f64().unwrap(), [0.0, 0.5, 1.0][i % 3]);
        let found = c["found"].as_array().unwrap();
        assert!(found.iter().all(|f| f.as_u64().unwrap() <= 2), "{c}");
        // kvq's cache holding everything in f32 answers as the reference does.
        assert_eq!(found[0], found[1], "{c}");
    }
    // The table form, and the errors.
    let out = eval()
        .arg("--model")
        .arg(&model)
        .args(["--passkey", "--passkey-lengths", "400", "--passkey-depths", "0.5", "--passkey-trials", "1"])
        .args(["--specs", "int8"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let cell = text.contains("0/1") || text.contains("1/1");
    assert!(out.status.success() && text.contains("f32 (reference)") && cell, "{text}");
    for (args, needle) in [
        (vec!["--passkey-lengths", "30"], "at least"),
        (vec!["--passkey-lengths", "5000"], "context"),
        (vec!["--passkey-depths", "1.5"], "from 0 to 1"),
        (vec!["--passkey-trials", "0"], "a trial"),
    ] {
        let out = eval().arg("--model").arg(&model).arg("--passkey").args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn errors_are_one_line_and_exit_1() {
    let (dir, model, tokens) = setup("cli-errors");
    let run = |args: &[&str]| {
        let out = eval().args(args).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (m, t) = (model.to_str().unwrap(), tokens.to_str().unwrap());
    // A text past the documented limit (a sparse file: nothing is written), refused before
    // it is read.
    let huge = dir.join("huge.txt");
    std::fs::File::create(&huge).unwrap().set_len((256 << 20) + 1).unwrap();
    let huge = huge.to_str().unwrap();
    let (code, err) = run(&["--model", dir.join("none.gguf").to_str().unwrap(), "--tokens", t]);
    assert_eq!(code, Some(1));
    assert!(err.contains("cargo xtask fetch-model smollm2-135m"), "{err}");
    for (args, needle) in [
        (vec!["--model", m, "--tokens", t, "--specs", "int9-token"], "int9"),
        (vec!["--model", m, "--tokens", t, "--prefill", "500"], "prefill"),
        (vec!["--model", m, "--tokens", t, "--ctx", "150", "--chunks", "2"], "chunks"),
        (vec!["--model", m, "--tokens", m], "tiny.gguf"),
        (vec!["--model", t, "--tokens", t], "model"),
        (vec!["--model", m, "--tokens", t, "--path", "fast"], "--path"),
        (vec!["--model", m, "--text", dir.join("none.txt").to_str().unwrap()], "none.txt"),
        (vec!["--model", m, "--text", huge], "256 MiB"),
        (vec!["--model", m, "--tokens", t, "--prefill", "100", "--specs", ""], "spec"),
        (vec!["--model", m, "--tokens", t, "--prefill", "100", "--specs", ",,"], "spec"),
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        // The error is one line, the last (a line describing the loaded model may precede it).
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(last.starts_with("kvq-eval: ") && last.contains(needle), "{args:?}: {err}");
    }
    let (code, _) = run(&["--model", m]);
    assert_eq!(code, Some(2), "no tokens is a usage error");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_searched_config_holds_its_bound_when_run_again() {
    let (dir, model, tokens) = setup("cli-search");
    let (m, t) = (model.to_str().unwrap(), tokens.to_str().unwrap());
    let out_path = dir.join("searched.toml");
    let o = out_path.to_str().unwrap();
    let common = ["--model", m, "--tokens", t, "--ctx", "64", "--chunks", "3", "--block-size", "16"];
    let ladder = "int8-channel/int8-token,int4-channel/int4-token,int2-channel/int2-token";
    // The uniform rungs, for a bound between the cheapest and the richest.
    let rungs = json(&eval().args(common).args(["--specs", ladder, "--json"]).output().unwrap());
    let kl = |c: &serde_json::Value| c["kl_mean"].as_f64().unwrap();
    let (rich, cheap) = (kl(&rungs["candidates"][0]), kl(&rungs["candidates"][2]));
    assert!(rich < cheap, "{rungs}");
    let bound = (rich * cheap).sqrt();
    let run = |extra: &[&str]| {
        eval()
            .args(common)
            .args(["--ladder", ladder, "--out", o, "--force", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    let r = json(&run(&["--target-kl", &bound.to_string()]));
    assert_eq!(r["met"], true, "{r}");
    let chosen = &r["checks"][r["chosen"].as_u64().unwrap() as usize]["report"];
    assert!(kl(chosen) <= bound, "{r}");
    assert_eq!(r["sensitivity"].as_array().unwrap().len(), LAYERS);
    let share: f64 = r["sensitivity"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap()).sum();
    assert!((share - 1.0).abs() < 1e-9, "{r}");
    // The written config, run as a config file on the same tokens, gives what the search
    // measured: it is the config that was measured.
    let again = json(&eval().args(common).args(["--config", o, "--json"]).output().unwrap());
    let c = &again["candidates"][0];
    assert_eq!(kl(c), kl(chosen), "{again}");
    assert_eq!(c["bits_per_value"], chosen["bits_per_value"]);
    // The default ladder (its -qa rungs fitted on the calibration tokens) holds it too.
    let out = eval()
        .args(common)
        .args(["--target-kl", &bound.to_string(), "--out", o, "--force", "--json"])
        .output();
    let r = json(&out.unwrap());
    assert_eq!(r["rungs"].as_array().unwrap().len(), kvq_candle::recommend::default_ladder().len());
    assert!(
        r["met"] == true && kl(&r["checks"][r["chosen"].as_u64().unwrap() as usize]["report"]) <= bound,
        "{r}"
    );
    // A budget alone (between the two cheaper rungs' bits, window and sinks counted): one
    // check, within it, above the cheapest rung.
    let bits = |i: usize| rungs["candidates"][i]["bits_per_value"].as_f64().unwrap();
    let budget = (bits(1) + bits(2)) / 2.0;
    let r = json(&run(&["--budget-bits", &budget.to_string()]));
    assert_eq!(r["checks"].as_array().unwrap().len(), 1, "{r}");
    let got = r["checks"][0]["report"]["bits_per_value"].as_f64().unwrap();
    assert!(got <= budget + 1e-9 && got > bits(2), "{got} against {budget}: {r}");
    // A bound no rung reaches: the run fails saying so, and the config file is left as it was.
    let before = std::fs::read(&out_path).unwrap();
    let out = run(&["--target-kl", "1e-15", "--max-checks", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.trim_end().lines().last().unwrap().contains("no config the search measured meets"), "{err}");
    assert_eq!(std::fs::read(&out_path).unwrap(), before);
    // Bad bounds and searches without an output are refused before any work.
    for (args, code) in [
        (vec!["--target-kl", "0.01"], Some(2)),
        (vec!["--target-kl=-1", "--out", o], Some(1)),
        (vec!["--budget-bits", "NaN", "--out", o], Some(1)),
        (vec!["--target-kl", "0.01", "--out", o, "--specs", "int8"], Some(2)),
        (vec!["--target-kl", "0.01", "--out", o, "--ladder", "int8"], Some(1)),
        (vec!["--budget-bits", "1", "--out", o, "--force"], Some(1)),
        (
            vec![
                "--target-kl",
                "0.01",
                "--out",
                o,
                "--force",
                "--ladder",
                ladder,
                "--probe",
                "int8-channel/int8-token",
            ],
            Some(1),
        ),
        (
            vec!["--target-kl", "0.01", "--out", o, "--force", "--ladder", ladder, "--probe", "int3-token"],
            Some(1),
        ),
        (vec!["--specs", "int8", "--skip-tokens", "200"], Some(1)),
        (vec!["--specs", "int8", "--skip-tokens", "9"], Some(1)),
    ] {
        let out = eval().args(common).args(&args).output().unwrap();
        assert_eq!(out.status.code(), code, "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Real decode instead of chunks: the same search, over a prefill and one token at a time.
    let decode = ["--model", m, "--tokens", t, "--prefill", "48", "--max-tokens", "96", "--block-size", "16"];
    let r = json(
        &eval()
            .args(decode)
            .args(["--ladder", ladder, "--budget-bits", "9", "--out", o, "--force", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(r["checks"][0]["report"]["name"], "check 0", "{r}");
    // The other part of the tokens: 8 skipped leave 192, three chunks of 64 (9 leave two).
    let held_out =
        json(&eval().args(common).args(["--config", o, "--skip-tokens", "8", "--json"]).output().unwrap());
    assert_eq!(held_out["positions"], 3 * 31);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_bits_against_kl_figure_draws_this_run_and_saved_reports() {
    let (dir, model, tokens) = setup("cli-plot");
    let figure = dir.join("kl.svg");
    let out = eval()
        .arg("--model")
        .arg(&model)
        .arg("--tokens")
        .arg(&tokens)
        .args(["--prefill", "64", "--max-tokens", "128", "--specs", "int8,int2-channel/int2-token", "--json"])
        .arg("--plot")
        .arg(&figure)
        .output()
        .unwrap();
    let report = json(&out);
    let svg = std::fs::read_to_string(&figure).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains(">kvq (line: its Pareto front)<"), "{svg}");
    // INT8 costs more bits and loses less: both are on the front, so both are labelled.
    assert!(svg.contains(">int8<") && svg.contains(">int2-channel/int2-token<"), "{svg}");

    // Saved: this run's report, and another system's points in the same shape.
    let saved = dir.join("kvq.json");
    std::fs::write(&saved, serde_json::to_vec(&report).unwrap()).unwrap();
    let other = dir.join("other.json");
    std::fs::write(
        &other,
        r#"{"series": "llama.cpp", "candidates": [{"name": "q4_0", "bits_per_value": 4.5, "kl_mean": 0.05},
            {"name": "f16", "bits_per_value": 16.0, "kl_mean": 0.0}]}"#,
    )
    .unwrap();
    let figure2 = dir.join("saved.svg");
    let out = eval()
        .arg("--plot")
        .arg(&figure2)
        .arg("--plot-with")
        .arg(format!("{},{}", saved.display(), other.display()))
        .args(["--plot-title", "saved <runs>"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("2 series, 3 points; 1 with a zero"), "{stderr}");
    let svg2 = std::fs::read_to_string(&figure2).unwrap();
    assert!(
        svg2.contains(">int8<") && svg2.contains(">q4_0<") && svg2.contains(">llama.cpp (line"),
        "{svg2}"
    );
    assert!(!svg2.contains(">f16<"), "a zero KL has no place on a log scale");
    assert!(svg2.contains(">saved &lt;runs&gt;<"), "{svg2}");

    // A report that is not one fails in one line and writes nothing.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"candidates": [{"name": "x", "bits_per_value": "four", "kl_mean": 0.1}]}"#)
        .unwrap();
    let figure3 = dir.join("bad.svg");
    for input in [&bad, &dir.join("missing.json"), &model] {
        let out = eval().arg("--plot").arg(&figure3).arg("--plot-with").arg(input).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&input.display().to_string()), "{stderr}");
        assert!(!figure3.exists());
    }
    // Nor the model (the fuzzer found --plot overwriting --model's file).
    let model_bytes = std::fs::read(&model).unwrap();
    let out = eval()
        .arg("--model")
        .arg(&model)
        .arg("--tokens")
        .arg(&tokens)
        .args(["--prefill", "64", "--max-tokens", "128", "--specs", "int8"])
        .arg("--plot")
        .arg(&model)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&model.display().to_string()));
    assert_eq!(std::fs::read(&model).unwrap(), model_bytes);
    // Flags that name caches to run, or values nobody reads, are refused, not ignored.
    let m = model.to_str().unwrap();
    for extra in [
        &["--specs", "int8"][..],
        &["--path", "fast"],
        &["--weights", "q4"],
        &["--ladder", "int8"],
        &["--model", m],
    ] {
        let out =
            eval().arg("--plot").arg(&figure3).arg("--plot-with").arg(&saved).args(extra).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!figure3.exists());
    }
    // --plot-with alone is a usage error; --plot may not replace an input.
    let out = eval().arg("--plot-with").arg(&saved).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = eval().arg("--plot").arg(&saved).arg("--plot-with").arg(&saved).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&saved).unwrap(), serde_json::to_vec(&report).unwrap());
}
