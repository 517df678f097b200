//! Where the tests find the project's shared capture of SmolLM2-135M (2048 tokens of K/V/Q,
//! `../shared/data/kv-smollm2-135m-sample.safetensors` beside the checkout). One file, included
//! by the test crates of every package that reads it (`#[path]`), so that they agree on one rule:
//!
//! - `KVQ_SHARED_DATA=PATH` names the capture; `KVQ_SHARED_DATA=none` hides it, which is what a
//!   fresh clone without `../shared` sees (`.ci/run` runs the tests once that way).
//! - Without the variable, the capture beside the checkout is used when it is there.
//! - Under CI (`CI` set) a capture that is neither found nor hidden fails the test: CI provides
//!   it, so its absence there is a broken setup, not a newcomer's machine.
//!
//! A test that falls back to the embedded 256-token sample, or skips, says so on stderr.
#![allow(dead_code)]

use std::path::PathBuf;

/// The shared capture's path, or `None` when it is hidden or absent (the caller falls back or
/// skips, and says which).
pub fn shared_capture() -> Option<PathBuf> {
    let default = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/kv-smollm2-135m-sample.safetensors");
    let path = match std::env::var_os("KVQ_SHARED_DATA") {
        Some(v) if v == "none" => return None,
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => default,
    };
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must provide the shared capture at {} (or KVQ_SHARED_DATA; `none` hides it)",
        path.display()
    );
    None
}

/// Says on stderr why a test runs on less than the full capture, or not at all.
pub fn note_missing(what: &str) {
    eprintln!("note: the shared capture is hidden or absent (KVQ_SHARED_DATA, ../shared/data): {what}");
}
