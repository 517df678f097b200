//! Command lines of `kvq analyze`, `kvq recommend`, `kvq calibrate` and `kvq-eval`, with the
//! files they name, run in process through `kvq::cli::run` and `kvq_candle::cli::run`.
//!
//! An input is a [`Case`]: the arguments and up to [`MAX_FILES`] files, each of a [`Kind`]
//! (a K/V/Q dump, a GGUF model, a token file, a text, a cache config). Arguments name files
//! by placeholders, replaced by real paths in a fresh directory for each run: `@0` ... `@3`
//! the case's files, `@out` and `@out.json` an output path that does not exist yet, `@plot`
//! a directory for figures, `@dir` the run's directory itself, `@missing` a path that does
//! not exist, `@null` `/dev/null`, `@fifo` a named pipe (made once per process with
//! `mkfifo`; opening it would block, so reading or writing it is a hang the watchdog
//! reports).
//!
//! Besides "no panic, no abort, no hang", a run is checked for what the hardening issue
//! promises: the case's files are byte for byte what they were before the run (no input is
//! clobbered, whichever `--out` names it), and `kvq-eval`'s report, when it succeeds, holds
//! no non-finite figure. Runs that would read the real model or a long built-in input
//! (`kvq-eval` without `--model`, `kvq analyze` on the embedded sample or `--synthetic`, the
//! larger tiny model on more than 64 tokens) take seconds, not microseconds; those cases are
//! refused before running, and counted as refused.
//!
//! The first case moves the process into [`scratch_dir`], so that relative paths a mutation
//! makes up (`--out 0.5`) land there and not in the directory the fuzzer was started from.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvq::quant::synth::Rng;

use crate::{NUMBERS, Outcome, Target, edit, mutate};

/// A command fuzzed on its own (one fuzz target each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `kvq analyze`.
    Analyze,
    /// `kvq recommend`.
    Recommend,
    /// `kvq calibrate`.
    Calibrate,
    /// `kvq-eval`.
    Eval,
}

/// What a file of a case holds, which decides how it is mutated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A safetensors K/V/Q dump (`layer<L>.q/.k/.v`).
    Dump,
    /// A GGUF model.
    Gguf,
    /// A safetensors file with `input_ids`.
    Tokens,
    /// A UTF-8 text (or not).
    Text,
    /// A cache config in TOML.
    Toml,
    /// A cache config in JSON.
    Json,
    /// `kvq_candle::tiny`'s model (byte-level tokenizer, chat template; 1.7 MB), written as
    /// it is for each run: the case holds no bytes of it (a corpus of such cases would hold
    /// gigabytes), and the `gguf` target mutates models.
    ChatModel,
}

const KINDS: [Kind; 7] =
    [Kind::Dump, Kind::Gguf, Kind::Tokens, Kind::Text, Kind::Toml, Kind::Json, Kind::ChatModel];

/// Bytes a case holds at most: files past it are not added.
const MAX_CASE: usize = 1 << 18;

/// The bytes a file of a case stands for.
fn contents(kind: Kind, bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    static CHAT: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    match kind {
        Kind::ChatModel => std::borrow::Cow::Borrowed(CHAT.get_or_init(crate::tiny_model_gguf)),
        _ => std::borrow::Cow::Borrowed(bytes),
    }
}

/// Files a case holds at most.
pub const MAX_FILES: usize = 4;

/// Arguments a case holds at most.
const MAX_ARGS: usize = 40;

/// A command line and the files it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// The arguments after the program's name (for `kvq`, the subcommand first).
    pub args: Vec<String>,
    /// The files `@0`, `@1`, ... stand for.
    pub files: Vec<(Kind, Vec<u8>)>,
}

impl Case {
    /// The bytes of a case: per file a kind byte, a 4-byte length and the bytes, after a
    /// count byte; then the arguments, one per line.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![self.files.len() as u8];
        for (kind, bytes) in &self.files {
            out.push(KINDS.iter().position(|k| k == kind).unwrap_or(0) as u8);
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out.extend_from_slice(self.args.join("\n").as_bytes());
        out
    }

    /// Reads a case back leniently: lengths past the end are cut, unknown kinds wrap, the
    /// arguments are the rest of the bytes as text (invalid UTF-8 replaced), so that a case
    /// made by byte edits is still a case.
    pub fn from_bytes(input: &[u8]) -> Case {
        let mut at = 1usize;
        let count = input.first().map_or(0, |&n| usize::from(n).min(MAX_FILES));
        let mut files = Vec::new();
        for _ in 0..count {
            let Some(&kind) = input.get(at) else { break };
            let kind = KINDS[usize::from(kind) % KINDS.len()];
            let len =
                input.get(at + 1..at + 5).map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
            at = (at + 5).min(input.len());
            let end = at.saturating_add(len as usize).min(input.len());
            files.push((kind, input[at..end].to_vec()));
            at = end;
        }
        let text = String::from_utf8_lossy(input.get(at..).unwrap_or_default());
        let args = if text.is_empty() { Vec::new() } else { text.split('\n').map(String::from).collect() };
        Case { args, files }
    }
}

impl Command {
    /// Every command fuzzed.
    pub const ALL: [Command; 4] = [Command::Analyze, Command::Recommend, Command::Calibrate, Command::Eval];

    /// The program and subcommand words before the case's arguments.
    fn program(self) -> &'static [&'static str] {
        match self {
            Command::Analyze | Command::Recommend | Command::Calibrate => &["kvq"],
            Command::Eval => &["kvq-eval"],
        }
    }

    /// Flags of the command that take a value, and those that take none.
    fn flags(self) -> (&'static [&'static str], &'static [&'static str]) {
        const CACHE: [&str; 3] = ["--residual-blocks", "--sinks", "--tail-dtype"];
        match self {
            Command::Analyze => (
                &[
                    "--specs",
                    "--positions",
                    "--block-size",
                    "--rope-pairing",
                    "--rope-theta",
                    "--plot",
                    CACHE[0],
                    CACHE[1],
                    CACHE[2],
                ],
                &["--synthetic", "--per-head", "--cache", "--row-window", "--json", "--force"],
            ),
            Command::Recommend => (
                &[
                    "--budget-bits",
                    "--out",
                    "--model-layers",
                    "--positions",
                    "--rope-pairing",
                    CACHE[0],
                    CACHE[1],
                    CACHE[2],
                ],
                &["--cache", "--row-window", "--json", "--force"],
            ),
            Command::Calibrate => (&["--out", "--percentile"], &["--force"]),
            Command::Eval => (
                &[
                    "--model",
                    "--tokens",
                    "--text",
                    "--specs",
                    "--config",
                    "--prefill",
                    "--ctx",
                    "--chunks",
                    "--max-tokens",
                    "--path",
                    "--block-size",
                    "--residual-blocks",
                    "--sinks",
                    "--tail-dtype",
                    "--weights",
                    "--calibration-tokens",
                    "--passkey-lengths",
                    "--passkey-depths",
                    "--passkey-trials",
                    "--seed",
                    "--skip-tokens",
                    "--target-kl",
                    "--target-p99",
                    "--budget-bits",
                    "--ladder",
                    "--probe",
                    "--max-checks",
                    "--out",
                    "--plot",
                    "--plot-with",
                    "--plot-title",
                ],
                &["--row-window", "--passkey", "--json", "--force"],
            ),
        }
    }

    /// Values worth trying: numbers, specs, enum words and paths.
    fn values(self) -> &'static [&'static str] {
        match self {
            Command::Eval => &[
                "int4-channel/int4-token",
                "int8",
                "f32",
                "int4-channel-p8/int4-token-p8",
                "int3-channel-qa/int4-token",
                "int2-g8,nf4-token",
                "fp8e4m3-token",
                "int4-head",
                "bogus",
                ",",
                "float",
                "int8",
                "native",
                "f16/int8",
                "int8/f32",
                "0.5",
                "1e-9",
                "0.01",
                "int8,int4-channel/int4-token",
                "@out",
                "0,1",
                "2,4,8",
                "3",
                "8",
                "16",
                "40",
                "@0",
                "@1",
                "@2",
                "@3",
                "@0,@1",
                "@missing",
                "@null",
                "@dir",
                "@fifo",
            ],
            _ => &[
                "int4-channel/int4-token",
                "int8",
                "int4-channel-p8/int4-token-p8",
                "int3-channel-qa/int4-token",
                "int4-channel-prerope/int4-token",
                "int2-g8,nf4-token",
                "fp8e4m3-token",
                "int4-head",
                "int4-channel4",
                "bogus",
                ",",
                "half",
                "interleaved",
                "none",
                "f16",
                "f32/int8",
                "int8/bogus",
                "2.5",
                "3.2",
                "4",
                "8",
                "99.9",
                "100",
                "2",
                "3",
                "10000",
                "@0",
                "@1",
                "@2",
                "@out",
                "@out.json",
                "@plot",
                "@dir",
                "@missing",
                "@null",
                "@fifo",
            ],
        }
    }

    /// Valid cases to start from.
    pub fn seeds(self) -> Vec<Case> {
        let dump = |q, k, t, d| (Kind::Dump, crate::tensor_file(q, k, t, d));
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        match self {
            Command::Analyze => vec![
                Case {
                    args: args(&["analyze", "@0", "--specs", "int4-channel/int4-token,int8"]),
                    files: vec![dump(2, 1, 24, 8)],
                },
                Case {
                    args: args(&[
                        "analyze",
                        "@0",
                        "--specs",
                        "int4-channel-p8/int4-token-p8",
                        "--cache",
                        "--per-head",
                        "--json",
                    ]),
                    files: vec![dump(4, 2, 40, 16)],
                },
                Case {
                    args: args(&[
                        "analyze",
                        "@0",
                        "--specs",
                        "int2-g8,nf4-token",
                        "--plot",
                        "@plot",
                        "--block-size",
                        "8",
                    ]),
                    files: vec![dump(2, 1, 24, 8)],
                },
            ],
            Command::Recommend => vec![
                Case {
                    args: args(&["recommend", "@0", "--budget-bits", "4", "--out", "@out"]),
                    files: vec![dump(2, 1, 24, 8)],
                },
                Case {
                    args: args(&[
                        "recommend",
                        "@0",
                        "--budget-bits",
                        "12",
                        "--cache",
                        "--json",
                        "--model-layers",
                        "3",
                    ]),
                    files: vec![dump(4, 2, 40, 16)],
                },
            ],
            Command::Calibrate => vec![
                Case {
                    args: args(&["calibrate", "@0", "@1", "--out", "@out"]),
                    files: vec![dump(2, 1, 24, 8), dump(2, 1, 16, 8)],
                },
                Case {
                    args: args(&["calibrate", "@0", "--out", "@out.json", "--percentile", "99.9"]),
                    files: vec![dump(4, 2, 40, 16)],
                },
            ],
            Command::Eval => {
                let model = (Kind::Gguf, crate::tiny_gguf());
                // Ids inside the one-block model's vocabulary of 16.
                let ids: Vec<u8> = (0..12u32).flat_map(|i| ((i * 5 + 1) % 16).to_le_bytes()).collect();
                let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![1, 12], &ids)
                    .expect("consistent");
                let tokens = (
                    Kind::Tokens,
                    safetensors::serialize(vec![("input_ids".to_string(), view)], None).expect("serializes"),
                );
                let config = kvq::prelude::KvCacheConfig::builder(1, 1, 2, 8)
                    .block_size(4)
                    .blocks_per_layer(16)
                    .build()
                    .expect("valid");
                vec![
                    Case {
                        args: args(&[
                            "--model",
                            "@0",
                            "--tokens",
                            "@1",
                            "--specs",
                            "int4-channel/int4-token,f32",
                            "--prefill",
                            "4",
                            "--block-size",
                            "4",
                        ]),
                        files: vec![model.clone(), tokens.clone()],
                    },
                    Case {
                        args: args(&[
                            "--model", "@0", "--tokens", "@1", "--ctx", "6", "--chunks", "2", "--config",
                            "@2", "--json",
                        ]),
                        files: vec![
                            model.clone(),
                            tokens.clone(),
                            (Kind::Toml, config.to_toml().into_bytes()),
                        ],
                    },
                    Case {
                        args: args(&[
                            "--model",
                            "@0",
                            "--text",
                            "@1",
                            "--specs",
                            "int8",
                            "--max-tokens",
                            "10",
                            "--prefill",
                            "3",
                            "--path",
                            "int8",
                        ]),
                        // The tiny chat model's byte-level tokenizer reads any text.
                        files: vec![
                            (Kind::ChatModel, Vec::new()),
                            (
                                Kind::Text,
                                "A cache of keys, values: 3 bits. \u{e9}t\u{e9}\n".as_bytes().to_vec(),
                            ),
                        ],
                    },
                    Case {
                        args: args(&[
                            "--model",
                            "@0",
                            "--tokens",
                            "@1",
                            "--ctx",
                            "6",
                            "--chunks",
                            "2",
                            "--block-size",
                            "4",
                            "--ladder",
                            "int8,int4-channel/int4-token",
                            "--target-kl",
                            "0.01",
                            "--out",
                            "@out",
                        ]),
                        files: vec![model.clone(), tokens],
                    },
                    // A figure drawn from a saved report alone: no model is read.
                    Case {
                        args: args(&[
                            "--max-tokens",
                            "8",
                            "--plot",
                            "@out",
                            "--plot-with",
                            "@0",
                            "--plot-title",
                            "t",
                        ]),
                        files: vec![(Kind::Text, REPORT.to_vec())],
                    },
                ]
            }
        }
    }
}

/// A saved `kvq-eval --json` report in the shape `--plot-with` reads.
const REPORT: &[u8] =
    br#"{"series": "s", "candidates": [{"name": "a", "bits_per_value": 4.5, "kl_mean": 0.05},
    {"name": "b", "bits_per_value": 8.5, "kl_mean": 0.004}]}"#;

/// A mutated copy of a case's bytes: an argument replaced, inserted, dropped, repeated,
/// moved, joined to its value with `=` or edited as text; or one file mutated as its kind's
/// fuzz target mutates it; or the bytes edited as they are.
pub fn mutate_case(command: Command, rng: &mut Rng, input: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    if rng.below(16) == 0 {
        return edit(rng, input, others, false);
    }
    let mut case = Case::from_bytes(input);
    let pick = |rng: &mut Rng, n: usize| rng.below(n.max(1) as u64) as usize;
    let (valued, bare) = command.flags();
    let word = |rng: &mut Rng| -> String {
        match rng.below(4) {
            0 => valued[pick(rng, valued.len())].to_string(),
            1 => bare[pick(rng, bare.len())].to_string(),
            2 => NUMBERS[pick(rng, NUMBERS.len())].to_string(),
            _ => command.values()[pick(rng, command.values().len())].to_string(),
        }
    };
    // The subcommand of `kvq` stays (it is what this target fuzzes) unless a byte edit moves it.
    let first = usize::from(command != Command::Eval);
    let n = case.args.len();
    match rng.below(if case.files.is_empty() { 8 } else { 11 }) {
        0 | 1 if n > first => {
            let i = first + pick(rng, n - first);
            case.args[i] = word(rng);
        }
        2 | 3 => {
            let i = first + pick(rng, n + 1 - first.min(n));
            let i = i.min(n);
            if rng.below(2) == 0 {
                let flag = valued[pick(rng, valued.len())].to_string();
                let value = word(rng);
                case.args.splice(i..i, [flag, value]);
            } else {
                let w = word(rng);
                case.args.insert(i, w);
            }
        }
        4 if n > first => {
            let i = first + pick(rng, n - first);
            let len = 1 + pick(rng, 2).min(n - i - 1);
            case.args.drain(i..i + len);
        }
        5 if n > first => {
            let i = first + pick(rng, n - first);
            let a = case.args[i].clone();
            case.args.insert(i, a);
        }
        6 if n > first + 1 => {
            let (a, b) = (first + pick(rng, n - first), first + pick(rng, n - first));
            case.args.swap(a, b);
        }
        7 if n > first + 1 => {
            let i = first + pick(rng, n - first - 1);
            if case.args[i].starts_with("--") {
                let v = case.args.remove(i + 1);
                case.args[i] = format!("{}={v}", case.args[i]);
            }
        }
        0..=7 if n > first => {
            let i = first + pick(rng, n - first);
            let edited = edit(rng, case.args[i].as_bytes(), &[], true);
            case.args[i] = String::from_utf8_lossy(&edited).replace('\n', "");
        }
        0..=7 => case.args.push(word(rng)),
        8 | 9 => {
            let i = pick(rng, case.files.len());
            let (kind, bytes) = &case.files[i];
            let target = match kind {
                Kind::Dump => Some(Target::Safetensors),
                Kind::Gguf => Some(Target::Gguf),
                Kind::Tokens => Some(Target::Tokens),
                Kind::Toml => Some(Target::ConfigToml),
                Kind::Json => Some(Target::ConfigJson),
                Kind::Text | Kind::ChatModel => None,
            };
            let mutated = match (target, kind) {
                (Some(t), _) => mutate(t, rng, bytes, &[]),
                (None, Kind::ChatModel) => Vec::new(),
                (None, _) => edit(rng, bytes, &[], true),
            };
            case.files[i].1 = mutated;
        }
        _ => {
            // A file dropped, or another case's file added (a second dump, a config, ...).
            if rng.below(2) == 0 || case.files.len() >= MAX_FILES {
                let i = pick(rng, case.files.len());
                case.files.remove(i);
            } else if let Some(other) = others.get(pick(rng, others.len())) {
                let other = Case::from_bytes(other);
                let held: usize = case.files.iter().map(|(_, b)| b.len()).sum();
                if let Some(f) =
                    other.files.get(pick(rng, other.files.len())).filter(|f| held + f.1.len() <= MAX_CASE)
                {
                    case.files.push(f.clone());
                }
            }
        }
    }
    case.args.truncate(MAX_ARGS);
    case.to_bytes()
}

/// Runs made in this process so far (each gets a directory of its own).
static RUNS: AtomicUsize = AtomicUsize::new(0);

/// The named pipe the cases may name (`None` where `mkfifo` is missing), one for every
/// process: made once and left in the temporary directory.
fn fifo() -> Option<&'static Path> {
    use std::os::unix::fs::FileTypeExt;
    static FIFO: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    FIFO.get_or_init(|| {
        let path = std::env::temp_dir().join("kvq-fuzz-cli.fifo");
        let is_fifo = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_fifo());
        if !is_fifo(&path) {
            let _ = std::process::Command::new("mkfifo").arg(&path).status();
        }
        is_fifo(&path).then_some(path)
    })
    .as_deref()
}

/// The directory the process works in once it has run a case (made on the first case):
/// relative paths in a case (an `--out 0.5`, a `--text bogus`) land there, not where the
/// fuzzer started.
pub fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("kvq-fuzz-cwd-{}", std::process::id()))
}

fn enter_scratch_dir() -> Result<(), String> {
    static ENTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ENTERED
        .get_or_init(|| {
            let dir = scratch_dir();
            std::fs::create_dir_all(&dir)
                .and_then(|()| std::env::set_current_dir(&dir))
                .map_err(|e| format!("{}: {e}", dir.display()))
        })
        .clone()
}

/// The larger GGUF seed (the byte-level tokenizer's model) runs at about a millisecond a
/// token here: at most this many tokens of it, so that a case stays far under the watchdog.
const LARGE_MODEL_TOKENS: usize = 64;

/// Whether the case asks for work measured in seconds (the real model, the embedded
/// sample, the synthetic benchmark, thousands of tokens through the larger tiny model):
/// such cases are refused, not run.
fn too_slow(command: Command, case: &Case) -> Option<&'static str> {
    let args = &case.args;
    let named = |flag: &str| args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    // The value of `--flag V` or `--flag=V` (the last one given).
    let value = |flag: &str| {
        let prefix = format!("{flag}=");
        let mut v = None;
        for (i, a) in args.iter().enumerate() {
            if a == flag {
                v = args.get(i + 1).map(String::as_str);
            } else if let Some(rest) = a.strip_prefix(&prefix) {
                v = Some(rest);
            }
        }
        v
    };
    match command {
        // Without --model a run reads the real model; a figure from saved reports alone
        // (no --tokens, --text or --passkey) reads none, and takes no --model.
        Command::Eval
            if !named("--model") && ["--tokens", "--text", "--passkey"].iter().any(|f| named(f)) =>
        {
            Some("skipped: kvq-eval without --model reads the real model")
        }
        Command::Eval => {
            let model = value("--model")
                .and_then(|m| m.strip_prefix('@'))
                .and_then(|i| i.parse::<usize>().ok())
                .and_then(|i| case.files.get(i));
            let large = model.is_some_and(|(kind, bytes)| *kind == Kind::ChatModel || bytes.len() > 1 << 16);
            let few = value("--max-tokens")
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n <= LARGE_MODEL_TOKENS);
            (large && (!few || named("--passkey"))).then_some(
                "skipped: the larger tiny model runs on --max-tokens 64 at most, without --passkey",
            )
        }
        Command::Analyze if named("--synthetic") => {
            Some("skipped: --synthetic analyzes a large random tensor")
        }
        Command::Analyze | Command::Recommend => {
            // A positional argument (the file): one that is not a flag and not a flag's value.
            let (valued, _) = command.flags();
            let mut positional = false;
            let mut i = 1;
            while i < args.len() {
                let a = &args[i];
                if a == "--" {
                    positional |= i + 1 < args.len();
                    break;
                }
                if valued.contains(&a.as_str()) {
                    i += 2;
                    continue;
                }
                positional |= !a.starts_with('-');
                i += 1;
            }
            (!positional).then_some("skipped: without a file the command reads the embedded 256-token sample")
        }
        _ => None,
    }
}

/// Runs one case of `command` and checks what the run left.
///
/// # Errors
/// The command's refusal (its message), or why the case was not run.
///
/// # Panics
/// When the command panics, or changed one of its input files, or `kvq-eval` reported a
/// non-finite figure with success.
pub fn run_case(command: Command, input: &[u8]) -> Outcome {
    let case = Case::from_bytes(input);
    if let Some(why) = too_slow(command, &case) {
        return Err(why.to_string());
    }
    enter_scratch_dir()?;
    let dir = std::env::temp_dir().join(format!(
        "kvq-fuzz-cli-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("fuzz directory: {e}"))?;
    // Removed however the run ends, a panic included.
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = Remove(dir);
    run_in(command, &case, &dir.0).map_err(|e| kind_of(&e))
}

/// What kind of refusal a message is: its first line after the last `": "` (what a path, a
/// flag or a spec the case made up was refused for, without them) and its last line, so
/// that made-up names do not each count as a new outcome.
pub(crate) fn kind_of(message: &str) -> String {
    let mut lines = message.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or_default();
    let first = first.rsplit(": ").next().unwrap_or(first);
    match lines.next_back() {
        Some(last) => format!("{first}\n{last}"),
        None => first.to_string(),
    }
}

fn run_in(command: Command, case: &Case, dir: &Path) -> Outcome {
    let paths: Vec<PathBuf> = (0..case.files.len()).map(|i| dir.join(format!("f{i}"))).collect();
    for (path, (kind, bytes)) in paths.iter().zip(&case.files) {
        std::fs::write(path, contents(*kind, bytes)).map_err(|e| format!("fuzz file: {e}"))?;
    }
    let fifo = fifo().map_or_else(|| dir.join("no-fifo"), Path::to_path_buf);
    let subst = |a: &str| -> String {
        let mut s = a.replace("@out.json", &dir.join("out.json").to_string_lossy());
        for (token, path) in [
            ("@out", dir.join("out")),
            ("@plot", dir.join("plot")),
            ("@dir", dir.to_path_buf()),
            ("@missing", dir.join("missing")),
            ("@null", PathBuf::from("/dev/null")),
            ("@fifo", fifo.clone()),
        ] {
            s = s.replace(token, &path.to_string_lossy());
        }
        for (i, p) in paths.iter().enumerate() {
            s = s.replace(&format!("@{i}"), &p.to_string_lossy());
        }
        s
    };
    let mut argv: Vec<String> = command.program().iter().map(|s| s.to_string()).collect();
    argv.extend(case.args.iter().map(|a| subst(a)));
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let result = match command {
        Command::Eval => kvq_candle::cli::run(&argv, &mut stdout, &mut stderr).map_err(|e| e.to_string()),
        _ => kvq::cli::run(&argv, &mut stdout, &mut stderr).map_err(|e| e.to_string()),
    };
    // A file changes only as the output of a run that succeeded (`--out`, or kvq-eval's
    // `--plot`), and never when the command also reads it (an output naming its own input is
    // refused).
    for (path, (kind, bytes)) in paths.iter().zip(&case.files) {
        let bytes = contents(*kind, bytes);
        let now = std::fs::read(path).unwrap_or_default();
        let p = path.to_string_lossy();
        let as_out = |i: usize| {
            ["--out", "--plot"]
                .iter()
                .any(|flag| argv[i] == format!("{flag}={p}") || (argv[i] == *p && argv[i - 1] == *flag))
        };
        // A path inside a text value (a figure's title) names no file.
        let text = |i: usize| argv[i - 1] == "--plot-title" || argv[i].starts_with("--plot-title=");
        let named: Vec<usize> =
            (1..argv.len()).filter(|&i| argv[i].contains(p.as_ref()) && !text(i)).collect();
        let output_only = !named.is_empty() && named.iter().all(|&i| as_out(i));
        assert!(
            now == *bytes || (result.is_ok() && output_only),
            "{} changed a file it should not have ({}): {argv:?}",
            command.program()[0],
            path.display()
        );
    }
    if result.is_ok() && command == Command::Eval {
        // Figures are finite: no NaN or infinity in the table, no null (serde_json's
        // non-finite number) in the JSON.
        let out = String::from_utf8_lossy(&stdout);
        let bad_word = out.split_whitespace().find(|w| {
            let w = w.trim_start_matches('-');
            w.starts_with("NaN") || w.starts_with("inf") || w.trim_end_matches(',') == "null"
        });
        assert!(bad_word.is_none(), "kvq-eval reported a non-finite figure ({bad_word:?}): {argv:?}\n{out}");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_read_back_and_survive_byte_edits() {
        for command in Command::ALL {
            for case in command.seeds() {
                assert_eq!(Case::from_bytes(&case.to_bytes()), case);
                let bytes = case.to_bytes();
                for cut in [0, 1, 3, bytes.len() / 2, bytes.len() - 1] {
                    let _ = Case::from_bytes(&bytes[..cut]);
                }
            }
        }
    }

    #[test]
    fn an_output_naming_an_input_is_refused_and_the_input_kept() {
        let seed = &Command::Calibrate.seeds()[0];
        for out in ["--out=@0", "@0"] {
            let mut case = seed.clone();
            let at = case.args.iter().position(|a| a == "@out").expect("an output");
            if out == "@0" {
                case.args[at] = out.into();
            } else {
                case.args.drain(at - 1..=at);
                case.args.push(out.into());
            }
            let refused = run_case(Command::Calibrate, &case.to_bytes()).expect_err("its own input");
            assert!(refused.contains("input"), "{refused}");
        }
        // The same file named only as the output is replaced.
        let mut case = seed.clone();
        case.args.retain(|a| a != "@1");
        let at = case.args.iter().position(|a| a == "@out").expect("an output");
        case.args[at] = "@1".into();
        run_case(Command::Calibrate, &case.to_bytes()).expect("an output that is no input");
    }

    #[test]
    fn slow_cases_are_refused_before_running() {
        let eval = &Command::Eval.seeds()[2];
        let mut case = eval.clone();
        case.args.retain(|a| a != "--max-tokens" && a != "10");
        assert!(too_slow(Command::Eval, &case).is_some());
        assert!(too_slow(Command::Eval, eval).is_none());
        let mut case = Command::Analyze.seeds()[0].clone();
        case.args.remove(1);
        assert!(too_slow(Command::Analyze, &case).is_some());
    }
}
