//! `kvq-afl`: a `kvq-fuzz` target under AFL++ with coverage feedback (afl.rs), for the
//! targets whose inputs are plain bytes. Built only with the `afl` feature, by `cargo afl`:
//!
//! ```text
//! cargo install cargo-afl            # once; its AFL++ needs clang and llvm-config of rustc's LLVM
//! cargo afl config --build           # builds AFL++ (LLVM_CONFIG=llvm-config-22 on Debian 12)
//! cargo afl build --release -p kvq-fuzz --features afl --bin kvq-afl
//! kvq-fuzz --write-seeds target/fuzz/seeds
//! KVQ_AFL_TARGET=gguf cargo afl fuzz -i target/fuzz/seeds/gguf -o target/afl/gguf target/release/kvq-afl
//! ```
//!
//! A panic of the target (a bug, or a broken check of what a run left) aborts the process,
//! which AFL++ records as a crash; a refusal is a normal return.

fn main() {
    let name = std::env::var("KVQ_AFL_TARGET").unwrap_or_else(|_| "gguf".into());
    let target = kvq_fuzz::Target::from_name(&name).unwrap_or_else(|| {
        eprintln!("kvq-afl: unknown KVQ_AFL_TARGET {name:?} (kvq-fuzz --list names them)");
        std::process::exit(2);
    });
    afl::fuzz!(|data: &[u8]| {
        let _ = target.run(data);
    });
}
