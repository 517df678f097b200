//! `cargo xtask <command>`: project automation that needs nothing but cargo.
//!
//! Commands:
//! - `make-sample SRC OUT [TOKENS]`: cut the embedded default sample (the first TOKENS tokens
//!   of the q, k and v tensors of every layer) out of a capture such as
//!   `../shared/data/kv-smollm2-135m-sample.safetensors`, keeping its metadata.
//! - `ci`: formatting, clippy with warnings denied, and the tests.

use std::collections::HashMap;
use std::process::{Command, ExitCode};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("make-sample") => make_sample(&args[1..]),
        Some("ci") => ci(),
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
    "usage: cargo xtask <make-sample SRC OUT [TOKENS] | ci>".into()
}

fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} failed with {status}")) }
}

fn ci() -> Result<(), String> {
    run(Command::new("cargo").args(["fmt", "--all", "--", "--check"]))?;
    run(Command::new("cargo").args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    run(Command::new("cargo").args(["test", "--workspace"]))
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
