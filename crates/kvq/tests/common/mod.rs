//! What the CLI tests share.

use std::process::{Command, Output};

/// Runs the binary; under cross-compiled tests `KVQ_TEST_RUNNER` (e.g. `qemu-aarch64 -cpu max`)
/// runs it, since the host cannot execute it directly.
pub fn kvq(args: &[&str]) -> Output {
    let bin = env!("CARGO_BIN_EXE_kvq");
    let mut cmd = match std::env::var("KVQ_TEST_RUNNER") {
        Ok(runner) if !runner.trim().is_empty() => {
            let mut words = runner.split_whitespace();
            let mut c = Command::new(words.next().expect("non-empty runner"));
            c.args(words).arg(bin);
            c
        }
        _ => Command::new(bin),
    };
    cmd.args(args).output().expect("kvq runs")
}
