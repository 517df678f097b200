//! Locating real data for the tests.
#![allow(dead_code)]

use std::path::PathBuf;

use kvq_quant_core::io::TensorFile;

/// The full capture in the project's shared data when it is present (CI always has it);
/// otherwise the 256-token excerpt embedded in the `kvq` crate. Both are real model tensors.
pub fn real_data() -> TensorFile {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let shared = std::env::var_os("KVQ_SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../shared/data/kv-smollm2-135m-sample.safetensors"));
    if shared.exists() {
        return TensorFile::open(&shared).expect("shared data readable");
    }
    eprintln!("note: {} not found; using the embedded excerpt", shared.display());
    TensorFile::open(root.join("crates/kvq/data/sample.safetensors")).expect("embedded sample readable")
}

/// The full 2048-token capture only (tests that need its length or its reference outputs).
/// Missing data skips such a test on a developer's machine but fails it under CI.
pub fn full_capture() -> Option<TensorFile> {
    let f = real_data();
    if f.contains("layer0.attn_out") {
        return Some(f);
    }
    assert!(std::env::var_os("CI").is_none(), "CI must provide the shared data (or KVQ_SHARED_DATA)");
    eprintln!("skipped: needs the full capture in ../shared/data or KVQ_SHARED_DATA");
    None
}
