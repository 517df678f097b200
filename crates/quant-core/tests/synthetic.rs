//! The seed's benchmark (standard normal `[1, 32, 512, 128]`), checked against theory.
// Megabytes of data through an interpreter would take hours; miri runs the other tests.
#![cfg(not(miri))]

use kvq_quant_core::metrics::error_stats;
use kvq_quant_core::synth::normal_tensor;
use kvq_quant_core::{QuantSpec, Shape, Tensor, quantize};

fn keys() -> Tensor {
    normal_tensor(Shape::with_batch(1, 32, 512, 128), 1)
}

/// Expected squared error of a standard normal variable rounded to the nearest of the levels
/// `min + i · step` (i = 0..=levels): a numerical integral over ±12 sigma.
fn gaussian_mse(min: f64, step: f64, levels: u32) -> f64 {
    let n = 400_000;
    let (lo, hi) = (-12.0f64, 12.0f64);
    let dx = (hi - lo) / n as f64;
    (0..n)
        .map(|i| {
            let x = lo + (i as f64 + 0.5) * dx;
            let q = ((x - min) / step).round().clamp(0.0, f64::from(levels));
            let e = x - (min + q * step);
            (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt() * e * e * dx
        })
        .sum()
}

#[test]
fn per_tensor_mse_matches_theory() {
    let x = keys();
    let (min, max) = x.data().iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    for (bits, uniform_applies) in [(8u8, true), (4, true), (2, false)] {
        let spec: QuantSpec = format!("int{bits}-tensor-f32").parse().unwrap();
        let mse = error_stats(x.data(), quantize(&x, &spec).unwrap().dequantize().data()).unwrap().mse;
        let levels = (1u32 << bits) - 1;
        let step = f64::from(max - min) / f64::from(levels);
        let exact = gaussian_mse(f64::from(min), step, levels);
        assert!((mse / exact - 1.0).abs() < 0.03, "{bits} bits: mse {mse}, Gaussian prediction {exact}");
        if uniform_applies {
            // Fine steps: the error is uniform over a step, so MSE = step² / 12.
            let uniform = step * step / 12.0;
            assert!((mse / uniform - 1.0).abs() < 0.03, "{bits} bits: mse {mse}, step²/12 = {uniform}");
        } else {
            // Four levels over ±5σ: most values fall to the two inner levels and the error
            // is far from uniform; step²/12 is only the order of magnitude.
            assert!(mse > 0.5 * step * step / 12.0 && mse < 2.0 * step * step / 12.0);
        }
    }
}

#[test]
fn int8_cosine_and_per_head_gain() {
    let x = keys();
    let err = |spec: &str| {
        let spec: QuantSpec = spec.parse().unwrap();
        error_stats(x.data(), quantize(&x, &spec).unwrap().dequantize().data()).unwrap()
    };
    assert!(err("int8-tensor").cosine >= 0.9999);
    let (tensor, head) = (err("int4-tensor").mse, err("int4-head").mse);
    // The seed reports a 22% reduction; with 32 heads of 65536 values each, every head's
    // range is narrower than the tensor's, and we see about 30%.
    assert!(head < 0.85 * tensor, "per-head {head} vs per-tensor {tensor}");
}

#[test]
fn memory_is_counted_honestly() {
    let x = keys();
    let q4 = quantize(&x, &"int4-head".parse().unwrap()).unwrap().memory();
    assert_eq!(q4.code_bytes, x.data().len() / 2);
    assert_eq!(q4.param_bytes, 32 * 2 * 2);
    assert!((q4.ratio_vs_f16() - 4.0).abs() < 0.001 && q4.ratio_vs_f16() < 4.0);
    let q2 = quantize(&x, &"int2-head".parse().unwrap()).unwrap().memory();
    assert!((q2.ratio_vs_f16() - 8.0).abs() < 0.01 && q2.ratio_vs_f16() < 8.0);
    // Per-token INT4 over 128 channels: 4 bits + 32 bits of parameters per 128 values.
    let tok = quantize(&x, &"int4-token".parse().unwrap()).unwrap().memory();
    assert!((tok.bits_per_element() - 4.25).abs() < 1e-9);
    let q3 = quantize(&x, &"int3-g32".parse().unwrap()).unwrap().memory();
    assert_eq!(q3.code_bytes, x.data().len() * 3 / 8);
}
