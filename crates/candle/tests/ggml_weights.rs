//! kvq's products of GGML weights against candle's reading of the same bytes: each type that
//! `LlamaModel` multiplies with kvq's kernels, quantized by candle from random weights,
//! repacked by kvq, and multiplied against activations on every backend of this CPU, equals
//! candle's dequantize-then-multiply up to the rounding of the activations to 8 bits per block
//! of 32, which these tests' activations survive exactly.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvq::kernels::dispatch;
use kvq::kernels::ggml::{Activations, GgmlType};
use kvq::kernels::ggml_packed::{PackedWeights, matmul_packed};
use kvq_candle::tiny::Rng;

const TYPES: [(GgmlDType, GgmlType); 8] = [
    (GgmlDType::Q4_0, GgmlType::Q4_0),
    (GgmlDType::Q4_1, GgmlType::Q4_1),
    (GgmlDType::Q8_0, GgmlType::Q8_0),
    (GgmlDType::Q5_0, GgmlType::Q5_0),
    (GgmlDType::Q5_1, GgmlType::Q5_1),
    (GgmlDType::Q4K, GgmlType::Q4K),
    (GgmlDType::Q5K, GgmlType::Q5K),
    (GgmlDType::Q6K, GgmlType::Q6K),
];

#[test]
fn every_kvq_weight_type_multiplies_as_candle_dequantizes_it() {
    let mut rng = Rng::new(5);
    let (rows, k, n) = (37, 512, 5);
    let w: Vec<f32> = (0..rows * k).map(|_| rng.next_f32() * 0.1).collect();
    // Activations that 8-bit rounding keeps exactly: integers up to 127 (127 in every block of
    // 32), times a power of two; the products then differ by float rounding only.
    let x: Vec<f32> = (0..n * k)
        .map(|i| {
            let c = if i % 32 == 7 { 127.0 } else { (rng.next_f32() * 127.0).round() };
            c * 2f32.powi(-7 + (i / 32 % 5) as i32)
        })
        .collect();
    for (theirs, ours) in TYPES {
        let q = QTensor::quantize(&Tensor::from_slice(&w, (rows, k), &Device::Cpu).unwrap(), theirs).unwrap();
        let dequantized =
            q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let packed = PackedWeights::new(ours, &q.data().unwrap(), rows, k).unwrap();
        let mut act = Activations::new();
        act.quantize(&x, k).unwrap();
        let want: Vec<f64> = (0..rows * n)
            .map(|i| {
                let (r, t) = (i / n, i % n);
                (0..k).map(|j| f64::from(dequantized[r * k + j]) * f64::from(x[t * k + j])).sum()
            })
            .collect();
        let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
        for backend in dispatch::available() {
            let mut got = vec![f32::NAN; rows * n];
            matmul_packed(backend, &packed, 0..packed.groups(), &act, &mut got).unwrap();
            let err = got.iter().zip(&want).map(|(&g, w)| (f64::from(g) - w).powi(2)).sum::<f64>().sqrt();
            // The weights are candle's to the bit, the activations kept: f32's rounding only.
            assert!(err / norm < 1e-6, "{ours:?} on {backend}: relative error {}", err / norm);
        }
    }
}
