//! The `kvq` command line as a function: [`run`] takes the arguments and two writers, and
//! returns a typed error instead of exiting, so that tests and the fuzzers call the tool in
//! process; [`main`] is the binary.
//!
//! Exit codes: 0 success, 1 an error while running (unreadable file, bad data), 2 bad usage.
//!
//! ```
//! let (mut out, mut err) = (Vec::new(), Vec::new());
//! kvq::cli::run(["kvq", "info"], &mut out, &mut err).unwrap();
//! assert!(String::from_utf8_lossy(&out).contains("selected backend"));
//! let refused = kvq::cli::run(["kvq", "analyze", "--positions"], &mut out, &mut err).unwrap_err();
//! assert_eq!(refused.exit_code(), 2);
//! ```

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate as kvq;
use clap::{Parser, Subcommand};
use kvq::analysis::{self, KvSpec, Options};
use kvq::quant::io::TensorFile;
use kvq::quant::{Calibration, Shape, Tensor};

/// Why a command line did not run to the end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The arguments do not parse (exit code 2), or asked for help or the version (0): clap's
    /// message, which [`main`] prints as clap would.
    #[error("{0}")]
    Usage(#[from] clap::Error),
    /// The command ran and failed: an unreadable or invalid file, bad data, an output that may
    /// not be written (exit code 1).
    #[error("{0}")]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl CliError {
    /// The process exit code the binary gives for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(e) => e.exit_code().clamp(0, 255) as u8,
            CliError::Failed(_) => 1,
        }
    }
}

/// Runs one `kvq` command line (`args[0]` is the program name): tables and JSON go to `out`,
/// notes and progress lines to `err` (the progress bar of `analyze` is drawn only when the
/// process's stderr is a terminal).
pub fn run<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write) -> Result<(), CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args)?;
    command(cli, out, err).map_err(|e| CliError::Failed(e.to_string().into()))
}

/// The `kvq` binary: [`run`] on the process's arguments, stdout and stderr.
pub fn main() -> ExitCode {
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    exit(run(std::env::args_os(), &mut stdout.lock(), &mut stderr.lock()), "kvq: error")
}

/// What a binary does with the end of a run: clap prints its own message (usage, help,
/// version), a failure is one line on stderr after `prefix`; the exit code is the error's.
/// Shared by `kvq` and `kvq-eval`.
pub fn exit(result: Result<(), CliError>, prefix: &str) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Usage(e)) => {
            let _ = e.print();
            ExitCode::from(e.exit_code().clamp(0, 255) as u8)
        }
        Err(e) => {
            eprintln!("{prefix}: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// The file to read, or the embedded sample when none is given.
fn open_input(file: Option<&std::path::Path>) -> Result<TensorFile, kvq::quant::io::TensorFileError> {
    match file {
        Some(path) => TensorFile::open(path),
        None => TensorFile::from_bytes("embedded sample (SmolLM2-135M, 256 tokens)", kvq::SAMPLE.to_vec()),
    }
}

/// A progress bar on stderr (drawn only when stderr is a terminal), advanced by the
/// `(done, all)` callbacks of long operations.
fn progress(what: &'static str) -> impl FnMut(usize, usize) {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what);
    move |done, all| {
        bar.set_length(all as u64);
        bar.set_position(done as u64);
        if done == all {
            bar.finish_and_clear();
        }
    }
}

/// Joins tensors of the same heads and head_dim along the token axis. Every part is validated
/// first (not empty, finite), so that no loop runs over the rows of a crafted empty shape.
fn concat_tokens(parts: &[Tensor]) -> Result<Tensor, Box<dyn std::error::Error>> {
    let s0 = parts[0].shape();
    let mut tokens = 0usize;
    for p in parts {
        let s = p.shape();
        if s.batch != s0.batch || s.heads != s0.heads || s.head_dim != s0.head_dim {
            return Err(format!("tensors of shape {s} and {s0} cannot be calibrated together").into());
        }
        p.validate()?;
        tokens = tokens.checked_add(s.tokens).ok_or("token counts overflow")?;
    }
    let len = Shape::with_batch(s0.batch, s0.heads, tokens, s0.head_dim)
        .checked_len()
        .ok_or("the joined tensor's size overflows")?;
    let mut data = Vec::new();
    data.try_reserve_exact(len).map_err(|_| format!("cannot hold {len} values to calibrate"))?;
    for b in 0..s0.batch {
        for h in 0..s0.heads {
            for p in parts {
                for t in 0..p.shape().tokens {
                    data.extend_from_slice(p.row(b, h, t));
                }
            }
        }
    }
    Ok(Tensor::new(Shape::with_batch(s0.batch, s0.heads, tokens, s0.head_dim), data)?)
}

#[derive(Parser)]
#[command(name = "kvq", version, about = "Quantize and analyze transformer KV caches")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time decode attention per spec against an f32 cache on this machine, one thread (one
    /// layer shaped like Llama-3-8B's: 32 query heads, 8 KV heads, head_dim 128, random data).
    /// For careful figures use `cargo xtask bench`; this is a quick look.
    Bench {
        /// Cached tokens.
        #[arg(long, default_value_t = 4096)]
        context: usize,
        /// Decode steps timed per spec (after one warm-up step).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Specs to time, comma-separated (`SPEC` or `KSPEC/VSPEC`).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "int8-token,int4-channel/int4-token,int2-channel/int2-token"
        )]
        specs: Vec<String>,
        /// Also time the integer paths (int8 queries for scores; 8-bit weights for INT4
        /// values, 16-bit for INT8, where the CPU has AVX-512 VNNI; for INT4 keys per channel
        /// with INT4 values per token or per group also on AVX2, in one fused kernel per
        /// block, and for INT4 keys per token or per group with those values; with AVX-512
        /// VBMI also `-qa` keys, keys per channel of any width and values of 1 to 3 bits per
        /// token), one more row per spec. Rows run by a fused block kernel say so: `(integer,
        /// fused)`, and `(fused)` on the float path (FP8 keys and values per token on
        /// AVX-512).
        #[arg(long)]
        integer: bool,
        /// Full-precision (f16) residual blocks of each cache after its quantized ones, as a
        /// serving config keeps (0: every token quantized, the kernels alone).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
        residual_blocks: u32,
        /// Leading tokens of each cache kept in full precision (f16).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4096))]
        sinks: u32,
        /// Tokens per cache block: the unit decode works on, and the group of per-channel
        /// specs written `channel` (`kvq analyze --block-size` shows what it does to fidelity
        /// and bits); `channelN` keeps groups of N tokens inside it (`int4-channel32` with 128).
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
        block_size: u32,
    },
    /// Choose per-layer K and V specs that minimize attention error under an average bit
    /// budget (metadata counted), and write a cache config. To bound what the cache does to
    /// a model's predictions instead (a mean or p99 KL target), `kvq-eval --target-kl`
    /// (package kvq-candle) searches the specs on the model itself.
    Recommend(RecommendArgs),
    /// Gather static K/V ranges (per layer, head and channel) from one or more files into a
    /// calibration file that per-tensor and per-head cache specs use.
    Calibrate(CalibrateArgs),
    /// Print the build, the CPU's kernel backends and the one selected.
    Info,
    /// Compare quantization specs on a model's keys, values and attention.
    ///
    /// Reads tensors named layer<L>.q, layer<L>.k and layer<L>.v ([heads, tokens, head_dim],
    /// f32/f16/bf16) from a safetensors file; without a file, the embedded sample.
    Analyze(AnalyzeArgs),
}

/// The arguments of `kvq recommend`.
#[derive(clap::Args)]
struct RecommendArgs {
    /// The safetensors file (default: the embedded sample).
    file: Option<PathBuf>,
    /// Average bits per cached value, K and V together.
    #[arg(long, required_unless_present = "target_kl")]
    budget_bits: Option<f64>,
    /// Not here: a bound on the model's KL is searched on the model by `kvq-eval
    /// --target-kl` (package kvq-candle); this command says so instead of failing to parse.
    #[arg(long, hide = true)]
    target_kl: Option<f64>,
    /// Where to write the config (TOML, or JSON for a `.json` name).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Layers of the model the written config is for (default: one past the highest
    /// dumped layer). Dumped layer `layer<L>` sets layer L; the others take the specs of
    /// the nearest dumped layer.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    model_layers: Option<u32>,
    /// Query positions at which attention is compared.
    #[arg(long, default_value_t = Options::default().positions)]
    positions: usize,
    /// Which key channels rotate together under RoPE (`half`, `interleaved`, `none`), for
    /// the candidates with bits per key channel (`-qa`), as in `analyze`.
    #[arg(long, default_value = "half", value_parser = parse_pairing)]
    rope_pairing: Pairing,
    /// Measure through the cache (and write its window and sinks into the config).
    #[command(flatten)]
    cache: CacheArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Replace an output file that is not writable.
    #[arg(long)]
    force: bool,
}

/// The arguments of `kvq calibrate`.
#[derive(clap::Args)]
struct CalibrateArgs {
    /// Safetensors files with layer<L>.k and layer<L>.v tensors (the same layers and heads).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Where to write the calibration (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Clip each channel's range to this percentile (e.g. 99.9) instead of min/max.
    #[arg(long)]
    percentile: Option<f64>,
    /// Replace an output file that is not writable.
    #[arg(long)]
    force: bool,
}

/// The arguments of `kvq analyze`.
#[derive(clap::Args)]
struct AnalyzeArgs {
    /// The safetensors file (default: the embedded SmolLM2-135M sample).
    file: Option<PathBuf>,
    /// Run the synthetic benchmark instead: standard normal [1, 32, 512, 128], fixed seed.
    #[arg(long, conflicts_with = "file")]
    synthetic: bool,
    /// Specs to compare, comma-separated (`SPEC` or `KSPEC/VSPEC`); default: the built-in list.
    #[arg(long, value_delimiter = ',')]
    specs: Vec<String>,
    /// Query positions at which attention is compared.
    #[arg(long, default_value_t = Options::default().positions)]
    positions: usize,
    /// Also report every KV head on its own (K/V MSE and the attention error of the query
    /// heads that read it).
    #[arg(long)]
    per_head: bool,
    /// Tokens per cache block: per-channel specs without a size (`int4-channel`) group a
    /// channel over this many tokens, as the cache does.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    block_size: u32,
    /// Which key channels rotate together under RoPE (`half`: i and i + d/2, Hugging Face
    /// checkpoints; `interleaved`: 2i and 2i + 1, GGUF weights; `none`), for key specs with
    /// bits per channel (`-qa`): both channels of a pair get the same width.
    #[arg(long, default_value = "half", value_parser = parse_pairing)]
    rope_pairing: Pairing,
    /// RoPE base of the model, for key specs quantized before RoPE (`-prerope`):
    /// frequencies `theta^(-2i/head_dim)`. Default: the file's `rope.inv_freq` tensor, else
    /// its `rope_theta` metadata (the embedded sample has it).
    #[arg(long)]
    rope_theta: Option<f64>,
    #[command(flatten)]
    cache: CacheArgs,
    /// Write SVG figures into this directory: error-histograms.svg (per bit width, K and
    /// V, per layer), bits-vs-error.svg (one line per scheme family) and layer-errors.svg.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Replace figures that are not writable.
    #[arg(long)]
    force: bool,
}

/// Running the data through the cache instead of quantizing offline (`analyze`, `recommend`).
/// `--rope-pairing`: a RoPE pairing, or none.
#[derive(Debug, Clone, Copy)]
struct Pairing(Option<kvq::quant::RopePairing>);

fn parse_pairing(s: &str) -> Result<Pairing, String> {
    use kvq::quant::RopePairing;
    match s {
        "half" => Ok(Pairing(Some(RopePairing::Half))),
        "interleaved" => Ok(Pairing(Some(RopePairing::Interleaved))),
        "none" => Ok(Pairing(None)),
        other => Err(format!("{other:?}: expected half, interleaved or none")),
    }
}

#[derive(clap::Args, Debug)]
struct CacheArgs {
    /// Append the tokens to a `QuantizedKvCache` and compare each query against what the
    /// cache holds at its position, residual window and sinks included (their bytes
    /// counted in the bits, at the file's length), instead of quantizing whole tensors
    /// offline. Specs the cache cannot hold are refused (skipped from built-in lists, with
    /// the reason).
    #[arg(long)]
    cache: bool,
    /// With --cache: full-precision residual blocks after the quantized ones.
    #[arg(long, requires = "cache", default_value_t = kvq::cache::DEFAULT_RESIDUAL_BLOCKS as u32,
          value_parser = clap::value_parser!(u32).range(0..=4096))]
    residual_blocks: u32,
    /// With --cache: leading tokens kept in full precision (attention sinks).
    #[arg(long, requires = "cache", default_value_t = kvq::cache::DEFAULT_SINK_TOKENS as u32,
          value_parser = clap::value_parser!(u32).range(0..=1_048_576))]
    sinks: u32,
    /// With --cache: per-token and gN specs (values) keep the residual window too, instead of
    /// being quantized as they arrive (specs with `-p8` always do).
    #[arg(long, requires = "cache")]
    row_window: bool,
    /// With --cache: storage of the residual window and sinks, `DTYPE` or `KDTYPE/VDTYPE`,
    /// each `f16`, `f32` or `int8` (8 bits and a scale per row: about half of f16's bytes);
    /// `f16/int8` keeps the keys' in f16, as the cache builder's default does.
    #[arg(long, requires = "cache", default_value = "f16", value_parser = kvq::cache::parse_tail_dtypes)]
    tail_dtype: (kvq::layout::TailDtype, Option<kvq::layout::TailDtype>),
}

impl CacheArgs {
    fn run(&self) -> Option<analysis::CacheRun> {
        self.cache.then_some(analysis::CacheRun {
            residual_blocks: self.residual_blocks as usize,
            sink_tokens: self.sinks as usize,
            row_window: self.row_window,
            tail_dtype: self.tail_dtype.0,
            value_tail_dtype: self.tail_dtype.1,
        })
    }
}

fn command(
    cli: Cli,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Bench { context, steps, specs, integer, residual_blocks, sinks, block_size } => bench(
            context,
            steps,
            &specs,
            integer,
            (residual_blocks as usize, sinks as usize, block_size as usize),
            stdout,
        ),
        Command::Recommend(args) => recommend(args, stdout, stderr),
        Command::Calibrate(args) => calibrate(args, stderr),
        Command::Info => {
            use kvq::kernels::dispatch;
            writeln!(stdout, "kvq {}", env!("CARGO_PKG_VERSION"))?;
            writeln!(stdout, "arch: {}", std::env::consts::ARCH)?;
            let names: Vec<&str> = dispatch::available().iter().map(|b| b.name()).collect();
            writeln!(stdout, "available backends: {}", names.join(", "))?;
            writeln!(stdout, "best backend: {}", dispatch::detect())?;
            writeln!(stdout, "selected backend: {}", dispatch::selected()?)?;
            Ok(())
        }
        Command::Analyze(args) => analyze(args, stdout, stderr),
    }
}

/// `kvq recommend`: per-layer specs under a bit budget, and the config.
fn recommend(
    args: RecommendArgs,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    let RecommendArgs {
        file,
        budget_bits,
        target_kl,
        out,
        model_layers,
        positions,
        rope_pairing,
        cache,
        json,
        force,
    } = args;
    let Some(budget_bits) = budget_bits.filter(|_| target_kl.is_none()) else {
        return Err("--target-kl bounds the model's KL, which only a run of the model measures: \
             `kvq-eval --text T --ctx 512 --chunks 4 --target-kl X --out cache.toml` (package \
             kvq-candle) searches per-layer specs for it; `kvq recommend` takes --budget-bits"
            .into());
    };
    if !(budget_bits.is_finite() && budget_bits > 0.0) {
        return Err(format!("--budget-bits {budget_bits} is not a positive finite number").into());
    }
    // Before any work: an output that may not be written is refused now.
    let inputs: Vec<&Path> = file.iter().map(PathBuf::as_path).collect();
    if let Some(out) = &out {
        check_output(out, &inputs, force)?;
    }
    let tf = open_input(file.as_deref())?;
    let layers = analysis::layers_from_file(&tf)?;
    let options = Options {
        positions,
        block_size: kvq::recommend::BLOCK_SIZE,
        cache: cache.run(),
        rope_pairing: rope_pairing.0,
        ..Options::default()
    };
    let (candidates, skipped) =
        analysis::applicable_with(&layers, kvq::recommend::default_candidates(), &options);
    for (spec, why) in skipped {
        writeln!(stderr, "kvq: skipping candidate {}: {why}", spec.name())?;
    }
    if candidates.is_empty() {
        return Err("no candidate spec applies to these layers (see the lines above)".into());
    }
    // The budget is the written config's: each dumped layer weighs as many model
    // layers as take its specs.
    let weights = kvq::recommend::layer_weights(&layers, model_layers.map(|n| n as usize))?;
    let (rec, specs) = kvq::recommend::recommend_weighted(
        &layers,
        &candidates,
        budget_bits,
        &weights,
        &options,
        |done, all| {
            let _ = writeln!(stderr, "kvq: measured {done}/{all} layers");
        },
    )?;
    if json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&rec)?)?;
    } else {
        writeln!(
            stdout,
            "budget {:.3} bits per value; chosen average {:.3}",
            rec.budget_bits, rec.average_bits
        )?;
        let w = rec.layers.iter().map(|c| c.spec.len()).max().unwrap_or(0).max(4);
        writeln!(stdout, "{:<10} {:<w$} {:>7} {:>10}", "layer", "spec", "bits", "attn err")?;
        for c in &rec.layers {
            writeln!(stdout, "{:<10} {:<w$} {:>7.3} {:>10.3e}", c.layer, c.spec, c.bits, c.attn_rel_err)?;
        }
    }
    if let Some(out) = out {
        let run = options.cache.unwrap_or_default();
        let (config, source) = kvq::recommend::config_with(
            &layers,
            &specs,
            model_layers.map(|n| n as usize),
            run,
            options.rope_pairing,
        )?;
        kvq::quant::io::write_output(&out, config.to_text_for(&out).as_bytes(), &inputs, force)
            .map_err(|e| format!("{}: {e}", out.display()))?;
        let filled = source.iter().enumerate().filter(|&(m, &from)| m != from).count();
        // Model layers that take a dumped layer's `-qa` spec without its maps (the
        // dumped layer `from` is model layer `from` of the config).
        let unfitted = source
            .iter()
            .enumerate()
            .filter(|&(m, &from)| m != from && config.layers[from].k.channel_bits())
            .count();
        let unfitted = if unfitted > 0 {
            format!(
                " ({unfitted} of them without -qa: bits per key channel are fitted to a dumped layer only)"
            )
        } else {
            String::new()
        };
        let counted = if options.cache.is_some() {
            format!("the bits above count them at the dump's {} tokens", layers[0].k.shape().tokens)
        } else {
            "the bits above count codes and parameters, not those (measure with --cache)".to_string()
        };
        writeln!(
            stderr,
            "kvq: wrote {} ({} layers; {filled} not in the dump take the specs of the nearest dumped layer{unfitted}; \
             residual window of {} block(s) of {} and {} sink tokens in {}: {counted})",
            out.display(),
            config.layers.len(),
            config.residual_blocks,
            config.block_size,
            config.sink_tokens,
            kvq::cache::tail_dtypes_text(config.tail_dtype, config.value_tail_dtype),
        )?;
    }
    Ok(())
}

/// `kvq calibrate`: static ranges from dumps into a calibration file.
fn calibrate(args: CalibrateArgs, stderr: &mut dyn Write) -> Result<(), Box<dyn std::error::Error>> {
    let CalibrateArgs { files, out, percentile, force } = args;
    let inputs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    check_output(&out, &inputs, force)?;
    let mut per_layer: Vec<(Vec<Tensor>, Vec<Tensor>)> = Vec::new();
    for path in &files {
        let tf = TensorFile::open(path)?;
        let layers = analysis::layers_from_file(&tf)?;
        // A calibration holds layers 0..n of the model in order: a dump of some layers
        // only (0, 9 and 29, say) would give model layer 1 the ranges of layer 9.
        if let Some((i, l)) =
            layers.iter().enumerate().find(|(i, l)| kvq::recommend::model_layer(&l.name) != Some(*i))
        {
            return Err(format!(
                "{}: holds {} where layer{i} should be; a calibration needs every layer of the model from layer0 on",
                path.display(),
                l.name
            )
            .into());
        }
        if per_layer.is_empty() {
            per_layer = layers.iter().map(|_| (Vec::new(), Vec::new())).collect();
        }
        if layers.len() != per_layer.len() {
            return Err(format!(
                "{}: {} layers, the first file has {}",
                path.display(),
                layers.len(),
                per_layer.len()
            )
            .into());
        }
        for (acc, layer) in per_layer.iter_mut().zip(layers) {
            acc.0.push(layer.k);
            acc.1.push(layer.v);
        }
    }
    let join = |parts: &[Tensor]| concat_tokens(parts);
    let k = per_layer.iter().map(|(k, _)| join(k)).collect::<Result<Vec<_>, _>>()?;
    let v = per_layer.iter().map(|(_, v)| join(v)).collect::<Result<Vec<_>, _>>()?;
    let cal = Calibration::from_tensors(&k, &v, percentile)?;
    let json = serde_json::to_string_pretty(&cal)?;
    kvq::quant::io::write_output(&out, json.as_bytes(), &inputs, force)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    writeln!(
        stderr,
        "kvq: wrote {} ({} layers, {} KV heads × {} channels, from {} file(s))",
        out.display(),
        cal.layers(),
        cal.heads(),
        cal.head_dim(),
        files.len()
    )?;
    Ok(())
}

/// `kvq analyze`: specs compared on a file's (or a synthetic) keys, values and attention.
fn analyze(
    args: AnalyzeArgs,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    let AnalyzeArgs {
        file,
        synthetic,
        specs,
        positions,
        per_head,
        block_size,
        rope_pairing,
        rope_theta,
        cache,
        plot,
        json,
        force,
    } = args;
    let inputs: Vec<&Path> = file.iter().map(PathBuf::as_path).collect();
    if let Some(dir) = &plot {
        kvq::plot::check_targets(dir, &inputs, force)?;
    }
    let (source, layers, inv_freq, file_theta) = if synthetic {
        let synthetic = vec![analysis::synthetic_layer()];
        ("synthetic N(0,1) [1, 32, 512, 128]".to_string(), synthetic, None, None)
    } else {
        let tf = open_input(file.as_deref())?;
        let inv_freq =
            if tf.contains("rope.inv_freq") { Some(tf.read_vector("rope.inv_freq")?) } else { None };
        let theta = tf.metadata().get("rope_theta").and_then(|t| t.parse::<f64>().ok());
        (tf.label().to_string(), analysis::layers_from_file(&tf)?, inv_freq, theta)
    };
    // The model's RoPE, for `-prerope` key specs: --rope-theta, else the file's
    // frequencies, else its base.
    let d = layers[0].k.shape().head_dim;
    let rope = match (rope_pairing.0, rope_theta, inv_freq, file_theta) {
        (None, ..) => None,
        (Some(p), Some(theta), ..) => Some(kvq::quant::Rope::from_theta(theta, d, p)?),
        (Some(p), None, Some(f), _) => Some(kvq::quant::Rope::new(&f, p)?),
        (Some(p), None, None, Some(theta)) => Some(kvq::quant::Rope::from_theta(theta, d, p)?),
        (Some(_), None, None, None) => None,
    };
    let options = Options {
        positions,
        per_head,
        histogram_bins: if plot.is_some() { 80 } else { 0 },
        block_size: block_size as usize,
        cache: cache.run(),
        rope_pairing: rope_pairing.0,
        rope,
    };
    let specs = if specs.is_empty() {
        // The built-in list applies to any model: what cannot apply is skipped, said so.
        let (kept, skipped) = analysis::applicable_with(&layers, analysis::default_specs(), &options);
        for (spec, why) in skipped {
            writeln!(stderr, "kvq: skipping built-in spec {}: {why}", spec.name())?;
        }
        if kept.is_empty() {
            return Err("no built-in spec applies to these layers (see the lines above)".into());
        }
        kept
    } else {
        specs
            .iter()
            .map(|s| KvSpec::parse(s).map_err(|e| format!("--specs {s:?}: {e}")))
            .collect::<Result<_, _>>()?
    };
    let report = analysis::analyze(&source, &layers, &specs, &options, progress("analyzing"))?;
    if json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(stdout, "{}", report.to_table())?;
    }
    if let Some(dir) = plot {
        for path in kvq::plot::write_all(&report, &dir, &inputs, force)? {
            writeln!(stderr, "kvq: wrote {}", path.display())?;
        }
    }
    Ok(())
}

/// [`kvq::quant::io::check_output`], its error naming the path.
fn check_output(out: &Path, inputs: &[&Path], force: bool) -> Result<(), String> {
    kvq::quant::io::check_output(out, inputs, force).map_err(|e| format!("{}: {e}", out.display()))
}

/// The longest context `kvq bench` builds (K and V in f32 alone: 8 GiB at this length).
const MAX_BENCH_CONTEXT: usize = 1 << 20;

/// `kvq bench`: decode attention per spec, against contiguous f32 and f16 caches read by
/// [`kvq::baseline::dense_attention`] (GQA-aware, F16C and FMA kernels) on the same backend.
fn bench(
    context: usize,
    steps: usize,
    specs: &[String],
    integer: bool,
    (residual_blocks, sinks, block_size): (usize, usize, usize),
    stdout: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    use kvq::attention::{AttentionOptions, ScorePath, decode_attention};
    use kvq::quant::synth::normal_tensor;
    use std::time::Instant;
    if context == 0 || steps == 0 {
        return Err("--context and --steps must be positive".into());
    }
    let (q_heads, kv_heads, d) = (32usize, 8usize, 128usize);
    check_bench_memory(context, kv_heads, d)?;
    let specs = specs
        .iter()
        .map(|s| KvSpec::parse(s).map_err(|e| format!("--specs {s:?}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let k = normal_tensor(Shape::new(kv_heads, context, d), 1);
    let v = normal_tensor(Shape::new(kv_heads, context, d), 2);
    let q = normal_tensor(Shape::new(1, 1, q_heads * d), 3).into_data();
    let mut out = vec![0f32; q_heads * d];
    let backend = kvq::kernels::dispatch::selected()?;
    let time = |f: &mut dyn FnMut()| {
        f();
        let start = Instant::now();
        for _ in 0..steps {
            f();
        }
        start.elapsed().as_secs_f64() / steps as f64
    };
    // Baselines: contiguous f32 and f16 caches read as a good GQA kernel reads them, each K and
    // V row once per KV head for its whole group of query heads, f16 widened with F16C, the
    // dots and sums on the same backend's FMA kernels.
    use kvq::baseline::{DenseDims, DenseKv, DenseScratch, dense_attention};
    // On the pages the quantized caches get (2 MiB where the system gives them), so that the
    // baselines' reads wait on no more page walks than the caches' do.
    let huge = |x: &[f32]| {
        let mut h = vec![half::f16::ZERO; x.len()];
        kvq::kernels::advise_huge_pages_of(&h);
        h.iter_mut().zip(x).for_each(|(h, &x)| *h = half::f16::from_f32(x));
        h
    };
    let (k16, v16) = (huge(k.data()), huge(v.data()));
    let dims = DenseDims { q_heads, kv_heads, head_dim: d, tokens: context };
    let mut scratch = DenseScratch::default();
    let mut dense = |kv: &DenseKv<'_>| {
        time(&mut || {
            dense_attention(backend, kv, dims, &q, &mut out, &mut scratch).expect("shapes checked above")
        })
    };
    let base = dense(&DenseKv::F32 { k: k.data(), v: v.data() });
    let base16 = dense(&DenseKv::F16 { k: &k16, v: &v16 });
    drop((k16, v16));
    // The floor of a step: its bytes at the one-thread DRAM read rate of this machine, in this
    // run (a buffer far larger than the caches, read once, best of 3).
    let rate = kvq::baseline::read_rate(kvq::baseline::STREAM_BYTES, 3);
    let floor = |bytes: usize| bytes as f64 / rate;
    let f32_bytes = 2 * kv_heads * context * d * 4;
    write_bench_header(stdout, (q_heads, kv_heads, d), (context, steps, block_size), backend, rate)?;
    // The kernels that ran the baselines (AVX-512 or AVX2: FMA, f16 widened with F16C; wide:
    // SSE2/NEON).
    let dense = kvq::kernels::dense_implementation(backend, d);
    for (name, t, bytes) in [
        (format!("f32 (GQA, {dense})"), base, f32_bytes),
        (format!("f16 (GQA, {dense})"), base16, f32_bytes / 2),
    ] {
        writeln!(
            stdout,
            "{:<46} {:>10.3} {:>12.1} {:>9.2} {:>7.2}x {:>7.2}x {:>7.2}x {:>8}",
            name,
            t * 1e3,
            bytes as f64 / 1048576.0,
            bytes as f64 / t / 1e9,
            base / t,
            base16 / t,
            t / floor(bytes),
            "-"
        )?;
    }
    for spec in &specs {
        let (cache, seq) = bench_cache(spec, &k, &v, (residual_blocks, sinks, block_size))?;
        let bytes = cache.memory().used_bytes();
        // One thread, like the baseline, so the ratio compares code, not cores.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
        // The rows name the code they time: a fused block kernel or the separate ones.
        let fused = |path| -> Result<bool, Box<dyn std::error::Error>> {
            Ok(kvq::attention::decode_kernel(backend, path, &cache, seq, q_heads / kv_heads)?
                == Some(kvq::attention::DecodeKernel::FusedBlock))
        };
        let float_label = if fused(ScorePath::Float)? { " (fused)" } else { "" };
        let int_label = if fused(ScorePath::Int8)? { " (integer, fused)" } else { " (integer)" };
        let paths: &[(ScorePath, &str)] = if integer {
            &[(ScorePath::Float, float_label), (ScorePath::Int8, int_label)]
        } else {
            &[(ScorePath::Float, float_label)]
        };
        // The cache's own blocks read in decode's order: the floor its scattered layout sets.
        let mut paged = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            std::hint::black_box(kvq::baseline::paged_read(&cache, seq, 0)?);
            paged = paged.min(start.elapsed().as_secs_f64());
        }
        for &(path, label) in paths {
            let t = time(&mut || {
                pool.install(|| {
                    let options = AttentionOptions::with_path(path).backend(backend);
                    decode_attention(&options, &cache, seq, 0, &q, q_heads, &mut out)
                })
                .expect("shapes checked above");
            });
            writeln!(
                stdout,
                "{:<46} {:>10.3} {:>12.1} {:>9.2} {:>7.2}x {:>7.2}x {:>7.2}x {:>7.2}x",
                format!("{}{label}", spec.name()),
                t * 1e3,
                bytes as f64 / 1048576.0,
                bytes as f64 / t / 1e9,
                base / t,
                base16 / t,
                t / floor(bytes),
                t / paged
            )?;
        }
    }
    Ok(())
}

/// `kvq bench`'s memory, counted and asked for before anything is made: K and V in f32 plus
/// the largest cache (INT8, f32 tails), and the stream buffer of the floor.
fn check_bench_memory(context: usize, kv_heads: usize, d: usize) -> Result<(), Box<dyn std::error::Error>> {
    if context > MAX_BENCH_CONTEXT {
        return Err(format!(
            "--context {context} is over the limit of {MAX_BENCH_CONTEXT} tokens (K and V alone would take {} GiB)",
            context.saturating_mul(2 * kv_heads * d * 4) >> 30
        )
        .into());
    }
    let need = 2 * kv_heads * context * d * (4 + 4) + kvq::baseline::STREAM_BYTES;
    let mut probe: Vec<u8> = Vec::new();
    probe
        .try_reserve_exact(need)
        .map_err(|_| format!("--context {context} needs about {} MiB, which cannot be had", need >> 20))?;
    Ok(())
}

/// A one-layer cache of `spec` holding the keys `k` and values `v` (`kv_heads × context ×
/// d`) as one sequence, its pool on huge pages as `QuantizedKvCache` puts it.
fn bench_cache(
    spec: &KvSpec,
    k: &Tensor,
    v: &Tensor,
    (residual_blocks, sinks, block_size): (usize, usize, usize),
) -> Result<(kvq::layout::PagedCache, kvq::cache::SeqId), Box<dyn std::error::Error>> {
    use kvq::layout::{CacheConfig, PagedCache};
    let Shape { heads: kv_heads, tokens: context, head_dim: d, .. } = k.shape();
    let mut config = CacheConfig::new(1, kv_heads, d, kv_heads * context.div_ceil(block_size))
        .with_specs(spec.k.clone(), spec.v.clone())
        .with_block_size(block_size)
        .with_residual_blocks(residual_blocks)
        .with_sink_tokens(sinks)
        .with_row_kernels(kvq::kernels::row_kernels()?);
    if spec.k.channel_bits() {
        // Random keys have nothing to fit: a fixed three-width map.
        config = config.with_channel_bits(vec![kvq::quant::ChannelBits::spread(d, spec.k.bits())?; kv_heads]);
    }
    if spec.k.pre_rope() {
        // Llama's frequencies; random keys are no better or worse in any frame.
        config = config.with_rope(kvq::quant::Rope::from_theta(10_000.0, d, kvq::quant::RopePairing::Half)?);
    }
    let mut cache = PagedCache::new(config)?;
    kvq::kernels::advise_huge_pages(cache.pool().arena());
    let seq = cache.create();
    cache.extend(seq, 0, k, v)?;
    Ok((cache, seq))
}

/// `kvq bench`'s header: the shapes, the backend, the floor's read rate, the columns.
fn write_bench_header(
    stdout: &mut dyn Write,
    (q_heads, kv_heads, d): (usize, usize, usize),
    (context, steps, block_size): (usize, usize, usize),
    backend: kvq::kernels::Kernels,
    rate: f64,
) -> std::io::Result<()> {
    writeln!(
        stdout,
        "decode attention, {q_heads} query / {kv_heads} KV heads × {d}, {context} tokens, {steps} steps, blocks of {block_size} tokens, backend {backend} (float kernels: {}), one thread",
        kvq::kernels::implementation(backend)
    )?;
    writeln!(
        stdout,
        "one-thread DRAM read: {:.1} GB/s ({} MiB, best of 3); \"x floor\" is ms/step over the cache's bytes at that rate",
        rate / 1e9,
        kvq::baseline::STREAM_BYTES >> 20
    )?;
    writeln!(
        stdout,
        "\"x paged\" is ms/step over the time to read the cache's own blocks in decode's order, with its prefetch (kvq::baseline::paged_read, best of 3)"
    )?;
    writeln!(
        stdout,
        "{:<46} {:>10} {:>12} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "cache", "ms/step", "cache MiB", "GB/s", "vs f32", "vs f16", "x floor", "x paged"
    )?;
    Ok(())
}
