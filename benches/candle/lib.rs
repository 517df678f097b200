//! Bench-only package: see `benches/candle.rs`.
