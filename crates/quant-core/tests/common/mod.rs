//! Locating real data for the tests.
#![allow(dead_code)]

use std::path::PathBuf;

use kvq_quant_core::io::TensorFile;

pub mod shared_data;

/// The full capture in the project's shared data when it is present (CI always has it);
/// otherwise the 256-token excerpt embedded in the `kvq` crate. Both are real model tensors.
pub fn real_data() -> TensorFile {
    if let Some(shared) = shared_data::shared_capture() {
        return TensorFile::open(&shared).expect("shared data readable");
    }
    shared_data::note_missing("using the embedded 256-token excerpt");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    TensorFile::open(root.join("crates/kvq/data/sample.safetensors")).expect("embedded sample readable")
}

/// The full 2048-token capture only (tests that need its length or its reference outputs).
/// A capture that is hidden or absent skips such a test, saying so (absent under CI fails it:
/// [`shared_data::shared_capture`]).
pub fn full_capture() -> Option<TensorFile> {
    let f = real_data();
    if f.contains("layer0.attn_out") {
        return Some(f);
    }
    eprintln!("skipped: needs the full capture in ../shared/data or KVQ_SHARED_DATA");
    None
}
