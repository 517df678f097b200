//! `kvq-eval`: what a quantized KV cache does to a model's next-token predictions.
//!
//! Runs a GGUF Llama-family model over real tokens with the f32 reference cache and with each
//! kvq cache asked for, in lockstep, and reports perplexity, KL(reference ‖ quantized) of the
//! next-token distributions, top-1 agreement, the cache's bits per value from its own memory
//! report, and tokens per second against the reference in the same run.
//!
//! ```text
//! cargo run --release -p kvq-candle --bin kvq-eval -- \
//!     --tokens ../shared/data/kv-smollm2-135m-sample.safetensors --specs int8,int4-channel/int4-token
//! cargo run --release -p kvq-candle --bin kvq-eval -- --text botchan.txt --ctx 512 --chunks 12
//! cargo run --release -p kvq-candle --bin kvq-eval -- --passkey --specs int4-channel-p8/int4-token-p8
//! cargo run --release -p kvq-candle --bin kvq-eval -- --text botchan.txt --ctx 512 --chunks 4 \
//!     --target-kl 0.01 --out searched.toml
//! ```
//!
//! With `--target-kl`, `--target-p99` or `--budget-bits` it searches per-layer specs on the
//! model instead ([`kvq_candle::recommend`]) and writes the config to `--out`.
//!
//! Exit codes: 0 success, 1 runtime error (one line on stderr), 2 usage.
//!
//! [`run`] is the command line as a function (the arguments, a writer for the table and one
//! for notes and progress; a typed error instead of an exit), for tests and the fuzzers;
//! [`main`] is the binary.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate as kvq_candle;
use clap::Parser;
use kvq::analysis::KvSpec;
use kvq::attention::ScorePath;
use kvq::cache::KvCacheConfig;
use kvq::cache::TailDtype;
use kvq::plot::{Point, Series};
use kvq_candle::eval::{Candidate, Protocol, Report, evaluate};
use kvq_candle::passkey::PasskeyPlan;
use kvq_candle::{GgufTokenizer, LlamaModel, Weights};

/// Where `cargo xtask fetch-model smollm2-135m` puts the model.
const DEFAULT_MODEL: &str = "target/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The specs run when none are given: the KIVI-style default at 8, 4, 3 and 2 bits.
const DEFAULT_SPECS: &str =
    "int8-channel/int8-token,int4-channel/int4-token,int3-channel/int3-token,int2-channel/int2-token";

#[derive(Parser, Debug)]
#[command(
    name = "kvq-eval",
    about = "KL divergence, top-1 agreement and perplexity of quantized KV caches against an f32 cache, on a real model"
)]
struct Args {
    /// The GGUF model (Llama-family). Default: the model `cargo xtask fetch-model smollm2-135m` fetches.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Token ids: the `input_ids` tensor of a safetensors file (such as a `kvq analyze` dump).
    #[arg(long, conflicts_with = "text", required_unless_present_any = ["text", "passkey", "plot_with"])]
    tokens: Option<PathBuf>,
    /// A text file, tokenized with the GGUF's own tokenizer (BOS added when the model adds one).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Cache specs, comma-separated: `KSPEC/VSPEC`, one spec for both, or `f32` (kvq's cache
    /// holding every token in full precision, to check its attention path). Each gets kvq's
    /// cache defaults (blocks of 32, one residual block, 4 sink tokens, f16 tails) unless the
    /// flags below change them.
    #[arg(long, conflicts_with = "config")]
    specs: Option<String>,
    /// Cache config files (TOML or JSON, as `kvq recommend` writes them), comma-separated; run as they are.
    #[arg(long, value_delimiter = ',')]
    config: Vec<PathBuf>,
    /// Prefill this many tokens, then decode one token at a time (real decode).
    #[arg(long, default_value_t = 256)]
    prefill: usize,
    /// llama-perplexity's protocol: chunks of N tokens from an empty cache, scored over their second half.
    #[arg(long, requires = "chunks")]
    ctx: Option<usize>,
    /// Number of chunks for --ctx.
    #[arg(long, requires = "ctx")]
    chunks: Option<usize>,
    /// Use only the first N tokens.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Attention arithmetic: `float`, or `int8` (int8 queries and i16 value weights where the CPU has them).
    #[arg(long, default_value = "float")]
    path: String,
    /// Tokens per block (for --specs).
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Extra full-precision blocks for per-channel keys (for --specs).
    #[arg(long, default_value_t = 1)]
    residual_blocks: usize,
    /// Leading tokens kept in full precision (for --specs).
    #[arg(long, default_value_t = 4)]
    sinks: usize,
    /// Per-token and gN specs (values) keep the residual window too (for --specs; `-p8` ones
    /// always do).
    #[arg(long)]
    row_window: bool,
    /// Storage of the residual window and sinks (for --specs), `DTYPE` or `KDTYPE/VDTYPE`,
    /// each `f16`, `f32` or `int8` (8 bits and a scale per row); `f16/int8` keeps the keys'
    /// in f16, as the cache builder's default does.
    #[arg(long, default_value = "f16", value_parser = kvq::cache::parse_tail_dtypes)]
    tail_dtype: (TailDtype, Option<TailDtype>),
    /// Weight matrices: `f32` (dequantized at load, so that the caches alone differ) or
    /// `native` (candle's quantized matmuls, which round activations to 8 bits: a noise floor
    /// of its own under every cache's figures).
    #[arg(long, default_value = "f32")]
    weights: String,
    /// Tokens on which the bits per key channel of `-qa` specs are fitted (the keys and
    /// queries of the first N tokens, run through the model with an f32 cache). Default: the
    /// prefill (--prefill), or the first half of the first chunk (--ctx).
    #[arg(long)]
    calibration_tokens: Option<usize>,
    /// Long-context retrieval instead of KL: a pass key hidden in filler text at several
    /// depths and lengths, asked for at the end, the greedy answer checked, for the f32
    /// reference cache and each cache (no --tokens or --text).
    #[arg(long, conflicts_with_all = ["tokens", "text", "ctx"])]
    passkey: bool,
    /// Prompt lengths in tokens for --passkey (each plus its answer within the model's context).
    #[arg(long, value_delimiter = ',', default_values_t = [2048usize, 4096, 8000])]
    passkey_lengths: Vec<usize>,
    /// Depths of the key for --passkey, fractions of the filler before it.
    #[arg(long, value_delimiter = ',', default_values_t = [0.1f64, 0.5, 0.9])]
    passkey_depths: Vec<f64>,
    /// Keys tried per length and depth for --passkey.
    #[arg(long, default_value_t = 2)]
    passkey_trials: usize,
    /// Seed of the keys for --passkey.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Drop the first N tokens (of --tokens or --text) before anything else: check a searched
    /// config on the part of a text the search did not see.
    #[arg(long, default_value_t = 0)]
    skip_tokens: usize,
    /// Search per-layer specs for the fewest bits whose mean KL on these tokens stays at or
    /// under this bound (nats), and write the config to --out (nothing is written, and the
    /// run fails, when no config it measured holds every bound).
    #[arg(long, conflicts_with_all = ["specs", "config", "passkey"], requires = "out")]
    target_kl: Option<f64>,
    /// Search (as --target-kl) with a bound on the 99th-percentile KL, alone or with --target-kl.
    #[arg(long, conflicts_with_all = ["specs", "config", "passkey"], requires = "out")]
    target_p99: Option<f64>,
    /// Search (as --target-kl) under an average of at most this many bits per value, as the
    /// table reports them (window and sinks counted): alone, the smallest KL the search
    /// predicts within it; with a KL bound, the fewest bits that hold it within it.
    #[arg(long, conflicts_with_all = ["specs", "config", "passkey"], requires = "out")]
    budget_bits: Option<f64>,
    /// The spec pairs a searched layer may take, comma-separated (default: INT8, `-p8` pairs
    /// from INT4 to INT2 with rotated values, and `-qa` keys at 3 and 2 bits, whose bits per
    /// channel are fitted on --calibration-tokens).
    #[arg(long)]
    ladder: Option<String>,
    /// The rung whose per-layer KL measures each layer's sensitivity (default: the cheapest).
    #[arg(long)]
    probe: Option<String>,
    /// Configs chosen and measured at most in a search.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=64))]
    max_checks: u32,
    /// Where a search writes its config (TOML, or JSON for a `.json` name).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an output file that is not writable.
    #[arg(long)]
    force: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Write an SVG of mean KL against bits per value: this run's caches (series `kvq`) and the
    /// reports of --plot-with, each series' Pareto front joined and labelled.
    #[arg(long, conflicts_with_all = ["passkey", "target_kl", "target_p99", "budget_bits"])]
    plot: Option<PathBuf>,
    /// Saved reports to draw in --plot, comma-separated: `kvq-eval --json` output, or any JSON
    /// object with `candidates` (each with `name`, `bits_per_value` and `kl_mean`) and an
    /// optional `series` name (default `kvq`). Without --tokens or --text, only these are drawn
    /// and no model is run (--model, --specs and --config are then refused).
    #[arg(long, value_delimiter = ',', requires = "plot")]
    plot_with: Vec<PathBuf>,
    /// The title of --plot's figure.
    #[arg(long, requires = "plot")]
    plot_title: Option<String>,
}

/// Why a `kvq-eval` command line did not run to the end: the facade's CLI error (`Usage`,
/// exit code 2 or clap's own; `Failed`, exit code 1).
pub use kvq::cli::CliError;

/// Runs one `kvq-eval` command line (`args[0]` is the program name): the table or JSON goes to
/// `stdout`, notes and progress lines to `stderr` (a progress bar instead when the process's
/// stderr is a terminal).
pub fn run<I, T>(args: I, stdout: &mut dyn Write, stderr: &mut dyn Write) -> Result<(), CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = Args::try_parse_from(args)?;
    command(&args, stdout, stderr).map_err(|e| CliError::Failed(e.to_string().into()))
}

/// The `kvq-eval` binary: [`run`] on the process's arguments, stdout and stderr.
pub fn main() -> ExitCode {
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    kvq::cli::exit(run(std::env::args_os(), &mut stdout.lock(), &mut stderr.lock()), "kvq-eval")
}

fn command(
    args: &Args,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    // Flag values checked before anything runs, whatever the mode: none is ignored unread.
    let weights = match args.weights.as_str() {
        "f32" => Weights::F32,
        "native" => Weights::Native,
        other => return Err(format!("--weights {other:?}: use f32 or native").into()),
    };
    let path = score_path(&args.path)?;
    let search = args.target_kl.is_some() || args.target_p99.is_some() || args.budget_bits.is_some();
    if !search && (args.ladder.is_some() || args.probe.is_some() || args.out.is_some()) {
        return Err(
            "--ladder, --probe and --out belong to a search (--target-kl, --target-p99 or --budget-bits)"
                .into(),
        );
    }
    let plot_only = args.tokens.is_none() && args.text.is_none() && !args.passkey;
    if plot_only && (args.model.is_some() || args.specs.is_some() || !args.config.is_empty()) {
        return Err("--model, --specs and --config name what runs on --tokens or --text (or --passkey); \
                    with --plot-with alone nothing runs"
            .into());
    }
    let default_model = PathBuf::from(DEFAULT_MODEL);
    let plot_inputs = input_files(args, &default_model);
    if let Some(out) = &args.plot {
        // Before any work: a figure that may not be written is refused now.
        kvq::io::check_output(out, &plot_inputs, args.force)
            .map_err(|e| format!("{}: {e}", out.display()))?;
    }
    let mut saved = args.plot_with.iter().map(|p| read_saved_report(p)).collect::<Result<Vec<_>, _>>()?;
    if plot_only {
        return write_plot(args, saved, &plot_inputs, stderr);
    }
    let model_path = args.model.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
    if !model_path.exists() {
        return Err(format!(
            "{}: no such model file; `cargo xtask fetch-model smollm2-135m` fetches SmolLM2-135M-Instruct into target/models/",
            model_path.display()
        )
        .into());
    }
    let model = LlamaModel::load_with(&model_path, weights)?;
    if args.passkey {
        return run_passkey(args, path, &model, &model_path, stdout, stderr);
    }
    let mut tokens = match (&args.tokens, &args.text) {
        (Some(p), _) => read_input_ids(p)?,
        (None, Some(p)) => {
            let bytes = kvq::io::read_regular_file(p, MAX_TEXT_BYTES).map_err(|e| {
                format!("{}: {e} (texts of at most {} MiB are read)", p.display(), MAX_TEXT_BYTES >> 20)
            })?;
            let text = String::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8 text", p.display()))?;
            // In pieces, and no further than --max-tokens: bounded memory whatever the text.
            GgufTokenizer::load(&model_path)?
                .encode_prefix(&text, args.max_tokens.map(|n| n.saturating_add(args.skip_tokens)))?
        }
        (None, None) => unreachable!("clap requires one"),
    };
    if args.skip_tokens > 0 {
        if args.skip_tokens >= tokens.len() {
            return Err(
                format!("--skip-tokens {} of {} tokens leaves none", args.skip_tokens, tokens.len()).into()
            );
        }
        tokens.drain(..args.skip_tokens);
    }
    if let Some(n) = args.max_tokens {
        tokens.truncate(n);
    }
    let protocol = match (args.ctx, args.chunks) {
        (Some(ctx), Some(chunks)) => Protocol::Chunks { ctx, chunks },
        _ => Protocol::Decode { prefill: args.prefill },
    };
    let longest = match protocol {
        Protocol::Chunks { ctx, .. } => ctx,
        Protocol::Decode { .. } => tokens.len(),
    };
    let calibration = args.calibration_tokens.unwrap_or(match protocol {
        Protocol::Chunks { ctx, .. } => ctx / 2,
        Protocol::Decode { prefill } => prefill,
    });
    let calibration = &tokens[..calibration.min(tokens.len())];
    if search {
        let search = SearchArgs { model: &model, tokens: &tokens, protocol, longest, path, calibration };
        return run_search(args, &search, stdout, stderr);
    }
    let candidates = candidates(args, &model, longest, path, calibration, stderr)?;
    let c = model.config();
    writeln!(
        stderr,
        "kvq-eval: {} ({} layers, {} query / {} KV heads of {}, {}; multiplied as {}), {} tokens, {} threads",
        model_path.display(),
        c.layers,
        c.heads,
        c.kv_heads,
        c.head_dim,
        model.weight_types().iter().map(|(t, n)| format!("{n} {t}")).collect::<Vec<_>>().join(", "),
        args.weights,
        tokens.len(),
        candle_core::utils::get_num_threads(),
    )?;
    let report = evaluate(&model, &tokens, protocol, &candidates, progress(stderr))?;
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        print_table(&report, stdout)?;
    }
    if args.plot.is_some() {
        let points = report
            .candidates
            .iter()
            .map(|c| Point { label: c.name.clone(), bits: c.bits_per_value, loss: c.kl_mean })
            .collect();
        saved.insert(0, Series { name: "kvq".into(), points });
        write_plot(args, saved, &plot_inputs, stderr)?;
    }
    Ok(())
}

/// Every file the command line names to read (the model, tokens or text, configs, saved
/// reports): an output (`--out`, `--plot`) may name none of them.
fn input_files<'a>(args: &'a Args, default_model: &'a Path) -> Vec<&'a Path> {
    let model = args.model.as_deref().unwrap_or(default_model);
    std::iter::once(model)
        .chain(
            args.tokens
                .iter()
                .chain(&args.text)
                .chain(&args.config)
                .chain(&args.plot_with)
                .map(PathBuf::as_path),
        )
        .collect()
}

/// The largest saved report `--plot-with` reads.
const MAX_REPORT_BYTES: u64 = 64 << 20;

/// One `--plot-with` file as a series: its `series` name (default `kvq`) and, per candidate,
/// its name, `bits_per_value` and `kl_mean`.
fn read_saved_report(path: &Path) -> Result<Series, Box<dyn std::error::Error>> {
    let fail = |why: String| format!("{}: {why}", path.display());
    let bytes = kvq::io::read_regular_file(path, MAX_REPORT_BYTES).map_err(|e| fail(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| fail(format!("not a JSON report: {e}")))?;
    let name = match json.get("series") {
        None => "kvq".to_string(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(_) => return Err(fail("`series` is not a string".into()).into()),
    };
    let candidates = json
        .get("candidates")
        .and_then(|c| c.as_array())
        .ok_or_else(|| fail("no `candidates` array (save `kvq-eval --json` output)".into()))?;
    let points = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let number = |key: &str| {
                c.get(key)
                    .and_then(serde_json::Value::as_f64)
                    .ok_or_else(|| fail(format!("candidate {i}: no number `{key}`")))
            };
            let label = c
                .get("name")
                .and_then(|n| n.as_str())
                .ok_or_else(|| fail(format!("candidate {i}: no string `name`")))?;
            Ok(Point { label: label.to_string(), bits: number("bits_per_value")?, loss: number("kl_mean")? })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Series { name, points })
}

/// `--plot`: the series merged by name, in order of first appearance, drawn and written.
fn write_plot(
    args: &Args,
    series: Vec<Series>,
    inputs: &[&Path],
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(out) = &args.plot else { return Err("--plot-with needs --plot, the figure to write".into()) };
    let mut merged: Vec<Series> = Vec::new();
    for s in series {
        match merged.iter_mut().find(|m| m.name == s.name) {
            Some(m) => m.points.extend(s.points),
            None => merged.push(s),
        }
    }
    let left_out: usize = merged.iter().flat_map(|s| &s.points).filter(|p| !p.drawable()).count();
    let title =
        args.plot_title.as_deref().unwrap_or("Mean KL of the next-token distribution against bits per value");
    let svg = kvq::plot::bits_vs_loss(title, "mean KL (nats, log scale)", &merged)?;
    kvq::io::write_output(out, svg.as_bytes(), inputs, args.force)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let points: usize = merged.iter().map(|s| s.points.len()).sum();
    writeln!(
        stderr,
        "kvq-eval: wrote {} ({} series, {} points{})",
        out.display(),
        merged.len(),
        points - left_out,
        if left_out > 0 {
            format!("; {left_out} with a zero or non-finite KL or bits left out")
        } else {
            String::new()
        }
    )?;
    Ok(())
}

/// `--passkey`: the retrieval table (or JSON).
fn run_passkey(
    args: &Args,
    path: ScorePath,
    model: &LlamaModel,
    model_path: &Path,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    let plan = PasskeyPlan {
        lengths: args.passkey_lengths.clone(),
        depths: args.passkey_depths.clone(),
        trials: args.passkey_trials,
        seed: args.seed,
    };
    // Before the caches are built (a `-qa` spec runs the model to fit its maps).
    plan.check(model.config().context_length)?;
    let longest = plan.lengths.iter().copied().max().unwrap_or(0) + kvq_candle::passkey::ANSWER_TOKENS;
    let tokenizer = GgufTokenizer::load(model_path)?;
    // Bits per key channel (`-qa`) are fitted on the first prompt's tokens.
    let (calibration, _) = kvq_candle::passkey::prompt(
        &tokenizer,
        plan.lengths.iter().copied().min().unwrap_or(0),
        0.5,
        10_000,
    )?;
    let candidates = candidates(args, model, longest, path, &calibration, stderr)?;
    writeln!(
        stderr,
        "kvq-eval: passkey, {} lengths x {} depths x {} keys, {} caches and the reference",
        plan.lengths.len(),
        plan.depths.len(),
        plan.trials,
        candidates.len()
    )?;
    let report = kvq_candle::passkey::run(model, &tokenizer, &candidates, &plan, progress(stderr))?;
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(());
    }
    writeln!(
        stdout,
        "pass keys answered right, of {} per cell (greedy, {} tokens at most)",
        plan.trials,
        kvq_candle::passkey::ANSWER_TOKENS
    )?;
    write!(stdout, "{:<8} {:>6}", "tokens", "depth")?;
    for name in &report.caches {
        write!(stdout, " {name:>w$}", w = name.len().max(8))?;
    }
    writeln!(stdout)?;
    for c in &report.cells {
        write!(stdout, "{:<8} {:>6.2}", c.tokens, c.depth)?;
        for (name, f) in report.caches.iter().zip(&c.found) {
            write!(stdout, " {:>w$}", format!("{f}/{}", c.trials), w = name.len().max(8))?;
        }
        writeln!(stdout)?;
    }
    write!(stdout, "{:<15}", "all")?;
    for (name, a) in report.caches.iter().zip(report.accuracy()) {
        write!(stdout, " {:>w$}", format!("{:.0}%", 100.0 * a), w = name.len().max(8))?;
    }
    writeln!(stdout)?;
    Ok(())
}

fn score_path(name: &str) -> Result<ScorePath, Box<dyn std::error::Error>> {
    match name {
        "float" => Ok(ScorePath::Float),
        "int8" => Ok(ScorePath::Int8),
        other => Err(format!("--path {other:?}: use float or int8").into()),
    }
}

/// Blocks per layer that hold a sequence of `longest` tokens in blocks of `block_size`, and
/// one more per KV head for the block being filled.
fn blocks_for(longest: usize, block_size: usize, kv_heads: usize) -> usize {
    longest.div_ceil(block_size.max(1)) * kv_heads + kv_heads
}

/// The builder of every `--specs` cache: the model's shape, blocks for `longest` tokens, and
/// the block size, window, sinks and tails of the flags.
fn base_builder(args: &Args, model: &LlamaModel, longest: usize) -> kvq::cache::KvCacheConfigBuilder {
    let c = model.config();
    c.cache_builder()
        .blocks_per_layer(blocks_for(longest, args.block_size, c.kv_heads))
        .block_size(args.block_size)
        .residual_blocks(args.residual_blocks)
        .sink_tokens(args.sinks)
        .row_window(args.row_window)
        .tail_dtypes(args.tail_dtype.0, args.tail_dtype.1)
}

/// The bits per key channel of a `-qa` spec for every layer, fitted on `calibration`.
fn fit_channel_bits(
    name: &str,
    spec: &KvSpec,
    args: &Args,
    model: &LlamaModel,
    calibration: &[u32],
    stderr: &mut dyn Write,
) -> Result<Vec<Vec<kvq::cache::ChannelBits>>, Box<dyn std::error::Error>> {
    if calibration.is_empty() {
        return Err(format!("spec {name:?}: no calibration tokens to fit its bits per channel").into());
    }
    writeln!(stderr, "kvq-eval: {name}: fitting bits per key channel on {} tokens", calibration.len())?;
    // Fitted with the cache's grouping: a channel over one block.
    Ok(kvq_candle::calibrate::channel_bits(model, calibration, &spec.for_block(args.block_size).k)
        .map_err(|e| format!("spec {name:?}: {e}"))?)
}

/// The caches to evaluate, each checked against the model and given enough blocks.
fn candidates(
    args: &Args,
    model: &LlamaModel,
    longest: usize,
    path: ScorePath,
    calibration: &[u32],
    stderr: &mut dyn Write,
) -> Result<Vec<Candidate>, Box<dyn std::error::Error>> {
    let c = model.config();
    let mut out = Vec::new();
    if !args.config.is_empty() {
        for p in &args.config {
            let mut config = KvCacheConfig::load(p)?;
            c.check_cache(&config).map_err(|e| format!("{}: {e}", p.display()))?;
            let need = blocks_for(longest, config.block_size, c.kv_heads);
            if config.blocks_per_layer < need {
                writeln!(
                    stderr,
                    "kvq-eval: {}: {} blocks per layer hold fewer than {longest} tokens; using {need}",
                    p.display(),
                    config.blocks_per_layer
                )?;
                config.blocks_per_layer = need;
            }
            out.push(Candidate { name: p.display().to_string(), config, path });
        }
        return Ok(out);
    }
    for name in
        args.specs.as_deref().unwrap_or(DEFAULT_SPECS).split(',').map(str::trim).filter(|s| !s.is_empty())
    {
        let config = if name == "f32" {
            c.cache_builder()
                .sink_tokens(longest)
                .tail_dtype(TailDtype::F32)
                .blocks_per_layer(c.kv_heads)
                .build()?
        } else {
            let spec = KvSpec::parse(name).map_err(|e| format!("spec {name:?}: {e}"))?;
            let maps = if spec.k.channel_bits() {
                fit_channel_bits(name, &spec, args, model, calibration, stderr)?
            } else {
                Vec::new()
            };
            let mut builder = base_builder(args, model, longest).specs(spec.k, spec.v);
            for (layer, m) in maps.into_iter().enumerate() {
                builder = builder.channel_bits(layer, m);
            }
            builder.build().map_err(|e| format!("spec {name:?}: {e}"))?
        };
        out.push(Candidate { name: name.to_string(), config, path });
    }
    if out.is_empty() {
        return Err("--specs names no spec (give KSPEC/VSPEC, one spec for both, or f32)".into());
    }
    Ok(out)
}

/// What a search runs on.
struct SearchArgs<'a> {
    model: &'a LlamaModel,
    tokens: &'a [u32],
    protocol: Protocol,
    longest: usize,
    path: ScorePath,
    calibration: &'a [u32],
}

/// `--target-kl`, `--target-p99`, `--budget-bits`: the search, its tables, and the config.
fn run_search(
    args: &Args,
    s: &SearchArgs<'_>,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    use kvq_candle::recommend::{SearchOptions, Stage, Target, default_ladder, search};
    let out = args.out.as_deref().ok_or("a search needs --out, the config file to write")?;
    let default_model = PathBuf::from(DEFAULT_MODEL);
    let inputs = input_files(args, &default_model);
    // Before any work: an output that may not be written is refused now.
    kvq::io::check_output(out, &inputs, args.force).map_err(|e| format!("{}: {e}", out.display()))?;
    let parse = |name: &str| KvSpec::parse(name).map_err(|e| format!("spec {name:?}: {e}"));
    let ladder = match &args.ladder {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(parse)
            .collect::<Result<Vec<_>, _>>()?,
        None => default_ladder(),
    };
    let probe = args.probe.as_deref().map(parse).transpose()?;
    let channel_bits = if ladder.iter().any(|r| r.k.channel_bits()) {
        ladder
            .iter()
            .map(|r| {
                r.k.channel_bits()
                    .then(|| fit_channel_bits(&r.name(), r, args, s.model, s.calibration, stderr))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        Vec::new()
    };
    let target = Target { kl_mean: args.target_kl, kl_p99: args.target_p99, budget_bits: args.budget_bits };
    let options = SearchOptions {
        target,
        ladder,
        probe,
        base: base_builder(args, s.model, s.longest).build()?,
        path: s.path,
        protocol: s.protocol,
        max_checks: args.max_checks as usize,
        channel_bits,
    };
    let used = match s.protocol {
        Protocol::Chunks { ctx, chunks } => ctx.saturating_mul(chunks).min(s.tokens.len()),
        Protocol::Decode { .. } => s.tokens.len(),
    };
    writeln!(
        stderr,
        "kvq-eval: searching {} rungs over {} layers on {used} tokens: one pass with {} caches, then up to {} checks",
        options.ladder.len(),
        options.base.layers.len(),
        options.ladder.len() + options.base.layers.len(),
        options.max_checks
    )?;
    let mut p = labeled_progress(stderr);
    let r = search(s.model, s.tokens, &options, |stage, d, t| match stage {
        Stage::Measure => p("measuring rungs and layers", d, t),
        Stage::Check(n) => p(&format!("check {}", n + 1), d, t),
    })?;
    drop(p);
    // A config that misses its bounds is not written: a failed run changes no file.
    if r.met {
        kvq::io::write_output(out, r.config.to_text_for(out).as_bytes(), &inputs, args.force)
            .map_err(|e| format!("{}: {e}", out.display()))?;
    }
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&r)?)?;
    } else {
        print_search(&r, s.protocol, stdout)?;
    }
    let got = r.result();
    if !r.met {
        return Err(format!(
            "no config the search measured meets the bounds (the closest: {:.3} bits, mean KL {:.3e}, p99 {:.3e}); \
             {} was not written",
            got.bits_per_value,
            got.kl_mean,
            got.kl_p99,
            out.display(),
        )
        .into());
    }
    writeln!(
        stderr,
        "kvq-eval: wrote {} ({:.3} bits per value, mean KL {:.3e}, p99 {:.3e} on these tokens)",
        out.display(),
        got.bits_per_value,
        got.kl_mean,
        got.kl_p99
    )?;
    Ok(())
}

fn print_search(
    r: &kvq_candle::recommend::Search,
    protocol: Protocol,
    stdout: &mut dyn Write,
) -> std::io::Result<()> {
    let what = match protocol {
        Protocol::Decode { prefill } => format!("real decode after a prefill of {prefill} tokens"),
        Protocol::Chunks { ctx, chunks } => format!("{chunks} chunks of {ctx} tokens"),
    };
    let bounds: Vec<String> = [
        r.target.kl_mean.map(|v| format!("mean KL <= {v}")),
        r.target.kl_p99.map(|v| format!("p99 KL <= {v}")),
        r.target.budget_bits.map(|v| format!("bits <= {v}")),
    ]
    .into_iter()
    .flatten()
    .collect();
    writeln!(stdout, "search on {what}; bounds: {}", bounds.join(", "))?;
    let w = r.rungs.iter().map(|g| g.spec.len()).max().unwrap_or(4).max(6);
    writeln!(
        stdout,
        "\nrungs, every layer on one:\n{:<w$} {:>7} {:>10} {:>10}",
        "spec", "bits", "mean KL", "p99"
    )?;
    for g in &r.rungs {
        writeln!(stdout, "{:<w$} {:>7.3} {:>10.3e} {:>10.3e}", g.spec, g.bits, g.kl_mean, g.kl_p99)?;
    }
    let chosen = r.layer_specs();
    writeln!(
        stdout,
        "\nlayers, each alone at {} (the others at the richest rung), and the result:\n{:<6} {:>10} {:>7}  chosen",
        r.probe, "layer", "KL added", "share"
    )?;
    for (l, ((k, share), spec)) in r.layer_kl.iter().zip(&r.sensitivity).zip(&chosen).enumerate() {
        writeln!(stdout, "{l:<6} {k:>10.3e} {:>6.1}%  {spec}", 100.0 * share)?;
    }
    writeln!(
        stdout,
        "\nchecks:\n{:<3} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:>7}  met",
        "#", "aimed KL", "predicted", "bits", "mean KL", "p99", "top-1", "PPL x"
    )?;
    for (i, c) in r.checks.iter().enumerate() {
        writeln!(
            stdout,
            "{:<3} {:>10.3e} {:>10.3e} {:>7.3} {:>10.3e} {:>10.3e} {:>6.1}% {:>7.4}  {}{}",
            i + 1,
            c.aimed_kl,
            c.predicted_kl,
            c.report.bits_per_value,
            c.report.kl_mean,
            c.report.kl_p99,
            100.0 * c.report.same_top1,
            c.report.ppl_ratio,
            if c.met { "yes" } else { "no" },
            match (i == r.chosen, r.met) {
                (true, true) => "  <- written",
                (true, false) => "  <- the closest (not written)",
                _ => "",
            }
        )?;
    }
    Ok(())
}

/// The largest token file read (a regular file only: not `/dev/zero`, not a FIFO).
const MAX_INPUT_BYTES: u64 = 1 << 30;
/// The largest text read: held whole, with 4 bytes per token of its ids (tokenized in
/// pieces of [`kvq_candle::tokenizer::PIECE_BYTES`], whose working memory is bounded).
const MAX_TEXT_BYTES: u64 = 256 << 20;

/// The `input_ids` of a safetensors file (a regular file only).
fn read_input_ids(path: &Path) -> Result<Vec<u32>, Box<dyn std::error::Error>> {
    let bytes =
        kvq::io::read_regular_file(path, MAX_INPUT_BYTES).map_err(|e| format!("{}: {e}", path.display()))?;
    kvq_candle::eval::input_ids(&bytes).map_err(|e| format!("{}: {e}", path.display()).into())
}

/// A progress bar on a terminal; elsewhere (a log, CI) one line per tenth of the work.
fn progress(stderr: &mut dyn Write) -> impl FnMut(usize, usize) + '_ {
    let mut p = labeled_progress(stderr);
    move |done, all| p("evaluating", done, all)
}

/// [`progress`] for work in passes: each pass named, and counted from zero when its name
/// changes.
fn labeled_progress(stderr: &mut dyn Write) -> impl FnMut(&str, usize, usize) + '_ {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps ({elapsed}, {eta} left)")
            .expect("valid template")
            .progress_chars("=> "),
    );
    // A pass starts where the one before it ended (its first report comes after a step).
    let (mut start, mut last) = (std::time::Instant::now(), std::time::Instant::now());
    let (mut tenth, mut pass) = (0, String::new());
    move |what, done, all| {
        if what != pass {
            pass = what.to_string();
            tenth = 0;
            start = last;
            bar.reset();
            bar.set_message(pass.clone());
        }
        last = std::time::Instant::now();
        if terminal {
            bar.set_length(all as u64);
            bar.set_position(done as u64);
            if done == all {
                bar.finish_and_clear();
            }
        } else if done * 10 >= (tenth + 1) * all {
            tenth = done * 10 / all;
            let _ = writeln!(
                stderr,
                "kvq-eval: {what}: {}% ({done}/{all} steps, {:.0} s)",
                tenth * 10,
                start.elapsed().as_secs_f64()
            );
        }
    }
}

fn print_table(r: &Report, stdout: &mut dyn Write) -> std::io::Result<()> {
    let what = match r.protocol {
        Protocol::Decode { prefill } => format!("real decode after a prefill of {prefill} tokens"),
        Protocol::Chunks { ctx, chunks } => format!("{chunks} chunks of {ctx} tokens, second halves scored"),
    };
    writeln!(
        stdout,
        "{what}: {} predictions; reference (f32 cache): PPL {:.4}, {:.1} KiB",
        r.positions,
        r.ppl_ref,
        r.ref_cache_bytes as f64 / 1024.0
    )?;
    writeln!(
        stdout,
        "{:<32} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7} {:>7} {:>6}",
        "cache",
        "bits",
        "KiB",
        "PPL",
        "ratio",
        "mean KL",
        "median",
        "p99",
        "p99.9",
        "max",
        "top-1",
        "tok/s",
        "vs ref"
    )?;
    for c in &r.candidates {
        writeln!(
            stdout,
            "{:<32} {:>6.3} {:>9.1} {:>9.4} {:>7.4} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>8.2e} {:>6.1}% {:>7.1} {:>5.2}x",
            c.name,
            c.bits_per_value,
            c.cache_bytes as f64 / 1024.0,
            c.ppl,
            c.ppl_ratio,
            c.kl_mean,
            c.kl_median,
            c.kl_p99,
            c.kl_p999,
            c.kl_max,
            100.0 * c.same_top1,
            c.tokens_per_s,
            c.tokens_per_s / c.ref_tokens_per_s,
        )?;
    }
    Ok(())
}
