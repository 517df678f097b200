//! The `kvq` command-line tool.
//!
//! Exit codes: 0 success, 1 an error while running (unreadable file, bad data), 2 bad usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvq::analysis::{self, KvSpec, Options};
use kvq::quant::io::TensorFile;

#[derive(Parser)]
#[command(name = "kvq", version, about = "Quantize and analyze transformer KV caches")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the build, the CPU's kernel backends and the one selected.
    Info,
    /// Compare quantization specs on a model's keys, values and attention.
    ///
    /// Reads tensors named layer<L>.q, layer<L>.k and layer<L>.v ([heads, tokens, head_dim],
    /// f32/f16/bf16) from a safetensors file; without a file, the embedded sample.
    Analyze {
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
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvq: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Info => {
            use kvq::kernels::dispatch;
            println!("kvq {}", env!("CARGO_PKG_VERSION"));
            println!("arch: {}", std::env::consts::ARCH);
            let names: Vec<&str> = dispatch::available().iter().map(|b| b.name()).collect();
            println!("available backends: {}", names.join(", "));
            println!("best backend: {}", dispatch::detect());
            println!("selected backend: {}", dispatch::selected()?);
            Ok(())
        }
        Command::Analyze { file, synthetic, specs, positions, json } => {
            let specs = if specs.is_empty() {
                analysis::default_specs()
            } else {
                specs
                    .iter()
                    .map(|s| KvSpec::parse(s).map_err(|e| format!("--specs {s:?}: {e}")))
                    .collect::<Result<_, _>>()?
            };
            let (source, layers) = if synthetic {
                ("synthetic N(0,1) [1, 32, 512, 128]".to_string(), vec![analysis::synthetic_layer()])
            } else {
                let tf = match &file {
                    Some(path) => TensorFile::open(path)?,
                    None => TensorFile::from_bytes(
                        "embedded sample (SmolLM2-135M, 256 tokens)",
                        kvq::SAMPLE.to_vec(),
                    )?,
                };
                (tf.label().to_string(), analysis::layers_from_file(&tf)?)
            };
            let options = Options { positions };
            let report = analysis::analyze(&source, &layers, &specs, &options, |done, all| {
                if all > 1 {
                    eprintln!("kvq: analyzed {done}/{all} layers");
                }
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.to_table());
            }
            Ok(())
        }
    }
}
