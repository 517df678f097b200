//! Real keys, values and queries of SmolLM2-135M: what the granularities do on data with
//! outlier channels.
// Megabytes of data through an interpreter would take hours; miri runs the other tests.
#![cfg(not(miri))]

mod common;

use kvq_quant_core::metrics::{attention, compare_attention, error_stats};
use kvq_quant_core::{QuantSpec, Tensor, quantize};

fn mse(x: &Tensor, spec: &str) -> (f64, Tensor) {
    let spec: QuantSpec = spec.parse().unwrap();
    let y = quantize(x, &spec).unwrap().dequantize();
    (error_stats(x.data(), y.data()).unwrap().mse, y)
}

#[test]
fn granularity_order_on_real_layers() {
    // 2048 tokens: on the 256-token excerpt per-channel ranges span too few tokens to say.
    let Some(file) = common::full_capture() else { return };
    for layer in [0, 9, 29] {
        let read = |s: &str| file.read(&format!("layer{layer}.{s}")).unwrap();
        let (q, k, v) = (read("q"), read("k"), read("v"));
        let tokens = k.shape().tokens;
        let positions: Vec<usize> = (tokens - 32..tokens).collect();
        let reference = attention(&q, &k, &v, &positions).unwrap();
        let attn_err = |k_hat: &Tensor, v_hat: &Tensor| {
            compare_attention(&reference, &attention(&q, k_hat, v_hat, &positions).unwrap())
                .unwrap()
                .output_rel_l2
        };

        let (k_tensor, k_tensor_hat) = mse(&k, "int4-tensor");
        let (k_channel, k_channel_hat) = mse(&k, "int4-channel");
        assert!(
            k_channel < 0.25 * k_tensor,
            "layer {layer}: K per-channel {k_channel} vs per-tensor {k_tensor}"
        );
        assert!(attn_err(&k_channel_hat, &v) < attn_err(&k_tensor_hat, &v), "layer {layer}: attention, keys");

        let (v_token, v_token_hat) = mse(&v, "int4-token");
        let (v_channel, v_channel_hat) = mse(&v, "int4-channel");
        let (a_token, a_channel) = (attn_err(&k, &v_token_hat), attn_err(&k, &v_channel_hat));
        if layer == 0 {
            // Layer 0's values are the exception the data's notes describe (kurtosis 32, a
            // 40x smaller scale): a few channels carry most of the range for every token, so
            // per-channel ranges fit them better than per-token ranges. Asserted so that a
            // change in this behaviour is noticed, not to tune anything.
            assert!(v_channel < v_token, "layer 0: V per-channel {v_channel} vs per-token {v_token}");
        } else {
            assert!(v_token < v_channel, "layer {layer}: V per-token {v_token} vs per-channel {v_channel}");
            assert!(a_token < a_channel, "layer {layer}: attention, values: {a_token} vs {a_channel}");
        }
    }
}

/// One captured layer with its exact attention at every 16th position of the second half.
struct Layer {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Vec<usize>,
    reference: kvq_quant_core::metrics::AttentionOutputs,
}

impl Layer {
    fn read(file: &kvq_quant_core::io::TensorFile, layer: usize) -> Self {
        let read = |s: &str| file.read(&format!("layer{layer}.{s}")).unwrap();
        let (q, k, v) = (read("q"), read("k"), read("v"));
        let tokens = k.shape().tokens;
        let positions: Vec<usize> = (tokens / 2..tokens).step_by(16).collect();
        let reference = attention(&q, &k, &v, &positions).unwrap();
        Self { q, k, v, positions, reference }
    }

    /// Mean KL of the attention probabilities with keys `k_hat` (values exact).
    fn key_kl(&self, k_hat: &Tensor) -> f64 {
        let got = attention(&self.q, k_hat, &self.v, &self.positions).unwrap();
        compare_attention(&self.reference, &got).unwrap().kl_mean
    }
}

#[test]
fn error_minimizing_value_ranges_beat_min_max_on_real_layers() {
    // Per-token values at 2, 3 and 4 bits: the searched ranges must lower the values' MSE on
    // every captured layer, and the attention output error (keys exact) but for one exception.
    for_each_layer_values(|layer, v, attn_err| {
        for bits in [2, 3, 4] {
            let (plain, plain_hat) = mse(v, &format!("int{bits}-token"));
            let (fitted, fitted_hat) = mse(v, &format!("int{bits}-token-mse"));
            let (a, b) = (attn_err(&plain_hat), attn_err(&fitted_hat));
            assert!(fitted < plain, "layer {layer}, {bits} bits: V MSE {fitted} vs {plain}");
            if layer == 0 && bits > 2 {
                // Layer 0's values have a few channels carrying most of every token's range.
                // Clipping them shrinks the same channel in every token, an error the
                // attention sum does not average out, unlike rounding noise: at 3 and 4 bits
                // that costs as much as the lower MSE gains (0.1427 -> 0.1433 and
                // 0.0652 -> 0.0661 when measured). Held to "no more than 3% worse", so that a
                // change either way is noticed.
                assert!(b < 1.03 * a, "layer 0, {bits} bits: attention {b} vs {a}");
            } else {
                assert!(b < a, "layer {layer}, {bits} bits: attention {b} vs {a}");
            }
        }
    });
}

#[test]
fn rotated_values_beat_unrotated_ones_on_real_layers() {
    // Per-token values in error-minimizing ranges at 2, 3 and 4 bits, with and without the
    // Hadamard rotation (the same bytes): the rotation spreads a row's outlier channels over
    // all of them, so the values' MSE and the attention output error (keys exact) must fall
    // on every captured layer. Measured: the MSE by 8-58%, least on layer 29 at 4 bits.
    for_each_layer_values(|layer, v, attn_err| {
        for bits in [2, 3, 4] {
            // Quantized once each (the test also runs under qemu): bytes, then errors.
            let q = |spec: &str| quantize(v, &spec.parse::<QuantSpec>().unwrap()).unwrap();
            let (bp, br) = (q(&format!("int{bits}-token-mse")), q(&format!("int{bits}-token-mse-rot")));
            assert_eq!(bp.memory().total_bytes(), br.memory().total_bytes(), "layer {layer}, {bits} bits");
            let (plain_hat, rotated_hat) = (bp.dequantize(), br.dequantize());
            let plain = error_stats(v.data(), plain_hat.data()).unwrap().mse;
            let rotated = error_stats(v.data(), rotated_hat.data()).unwrap().mse;
            assert!(rotated < 0.95 * plain, "layer {layer}, {bits} bits: V MSE {rotated} vs {plain}");
            let (a, b) = (attn_err(&plain_hat), attn_err(&rotated_hat));
            assert!(b < a, "layer {layer}, {bits} bits: attention {b} vs {a}");
        }
    });
}

/// Runs `f` on each captured layer's values with the attention output error of a replacement
/// for them (keys and queries exact), at every 16th position of the second half.
fn for_each_layer_values(mut f: impl FnMut(usize, &Tensor, &dyn Fn(&Tensor) -> f64)) {
    let Some(file) = common::full_capture() else { return };
    for layer in [0, 9, 29] {
        let read = |s: &str| file.read(&format!("layer{layer}.{s}")).unwrap();
        let (q, k, v) = (read("q"), read("k"), read("v"));
        let tokens = k.shape().tokens;
        let positions: Vec<usize> = (tokens / 2..tokens).step_by(16).collect();
        let reference = attention(&q, &k, &v, &positions).unwrap();
        let attn_err = |v_hat: &Tensor| {
            compare_attention(&reference, &attention(&q, &k, v_hat, &positions).unwrap())
                .unwrap()
                .output_rel_l2
        };
        f(layer, &v, &attn_err);
    }
}

#[test]
fn f64_attention_reproduces_the_models_own_output() {
    let Some(file) = common::full_capture() else { return };
    for layer in [0, 9, 29] {
        let read = |s: &str| file.read(&format!("layer{layer}.{s}")).unwrap();
        let (q, k, v, reference) = (read("q"), read("k"), read("v"), read("attn_out"));
        let tokens = k.shape().tokens;
        let ref_positions = reference.shape().tokens;
        let positions: Vec<usize> = (tokens - ref_positions..tokens).collect();
        let ours = attention(&q, &k, &v, &positions).unwrap();
        // attn_out is [heads, positions, head_dim]; ours is [positions, heads, head_dim].
        let (mut e2, mut r2) = (0f64, 0f64);
        for (pi, _) in positions.iter().enumerate() {
            for h in 0..q.shape().heads {
                for (a, &r) in ours.output(0, pi, h).iter().zip(reference.row(0, h, pi)) {
                    e2 += (a - f64::from(r)).powi(2);
                    r2 += f64::from(r).powi(2);
                }
            }
        }
        let rel = (e2 / r2).sqrt();
        // The capture's notes: f16 q/k/v reproduce attn_out to 1e-4..1e-3.
        assert!(rel < 2e-3, "layer {layer}: relative error {rel}");
    }
}

#[test]
fn query_aware_channel_bits_beat_uniform_keys_on_real_layers() {
    // Keys per channel over 64-token groups at 2, 3 and 4 bits, values exact: a map fitted on
    // the first half (its keys and the energy of the queries that read them) must lower the
    // attention KL on the second half, at the same code and parameter bits.
    use kvq_quant_core::{ChannelBits, RopePairing, Shape, quantize_channel_bits};
    let Some(file) = common::full_capture() else { return };
    for layer in [0, 9, 29] {
        let l = Layer::read(&file, layer);
        let (q, k) = (&l.q, &l.k);
        let (ks, qs) = (k.shape(), q.shape());
        let (half, d, group) = (ks.tokens / 2, ks.head_dim, qs.heads / ks.heads);
        let kl = |k_hat: &Tensor| l.key_kl(k_hat);
        for bits in [2, 3, 4] {
            let spec: QuantSpec = format!("int{bits}-channel64-qa").parse().unwrap();
            let maps: Vec<ChannelBits> = (0..ks.heads)
                .map(|h| {
                    let keys: Vec<f32> = (0..half).flat_map(|t| k.row(0, h, t).to_vec()).collect();
                    let mut energy = vec![0f32; d];
                    for qh in h * group..(h + 1) * group {
                        for t in 0..half {
                            for (e, x) in energy.iter_mut().zip(q.row(0, qh, t)) {
                                *e += x * x / (half * group) as f32;
                            }
                        }
                    }
                    let keys = Tensor::new(Shape::new(1, half, d), keys).unwrap();
                    ChannelBits::fit(&keys, &energy, &spec, Some(RopePairing::Half)).unwrap()
                })
                .collect();
            let fitted = quantize_channel_bits(k, &spec, &maps).unwrap();
            let plain = quantize(k, &format!("int{bits}-channel64").parse().unwrap()).unwrap();
            assert_eq!(fitted.memory().code_bytes, plain.memory().code_bytes);
            let (a, b) = (kl(&plain.dequantize()), kl(&fitted.dequantize()));
            // Measured: layer 0 5.46e-2 -> 5.17e-2 (2 bits), 1.05e-2 -> 8.73e-3, 2.23e-3 ->
            // 1.77e-3; layer 9 0.394 -> 0.307, 6.36e-2 -> 4.30e-2, 1.51e-2 -> 8.83e-3; layer 29
            // 0.226 -> 0.140, 3.19e-2 -> 2.06e-2, 7.48e-3 -> 4.12e-3.
            assert!(b < a, "layer {layer}, {bits} bits: KL {b} vs {a}");
        }
    }
}

#[test]
fn keys_quantized_before_rope_beat_keys_after_it_on_real_layers() {
    // Per-channel keys over 64-token groups at 2, 3 and 4 bits, values exact: taking the keys
    // out of RoPE before quantizing (the model's own frequencies, from the file) must lower
    // the attention KL at the same bytes, since a channel's constant offset no longer
    // oscillates within a group.
    use kvq_quant_core::{Rope, RopePairing};
    let Some(file) = common::full_capture() else { return };
    let rope = Rope::new(&file.read_vector("rope.inv_freq").unwrap(), RopePairing::Half).unwrap();
    for layer in [0, 9, 29] {
        let l = Layer::read(&file, layer);
        let k = &l.k;
        // Undoing RoPE gives the model's own keys before it (f16 rounding of both apart).
        let pre = rope.undo(k, 0).unwrap();
        let k_pre = file.read(&format!("layer{layer}.k_pre")).unwrap();
        let scale = k_pre.data().iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = pre.data().iter().zip(k_pre.data()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 2e-3 * scale, "layer {layer}: undone RoPE is {worst} from k_pre (max {scale})");
        let kl = |k_hat: &Tensor| l.key_kl(k_hat);
        for bits in [2, 3, 4] {
            let plain_spec: QuantSpec = format!("int{bits}-channel64").parse().unwrap();
            let plain = quantize(k, &plain_spec).unwrap();
            let before = quantize(&pre, &plain_spec).unwrap();
            assert_eq!(before.memory(), plain.memory());
            let (a, b) = (kl(&plain.dequantize()), kl(&rope.apply(&before.dequantize(), 0).unwrap()));
            // Measured: layer 0 5.46e-2 -> 2.65e-2 (2 bits), 1.05e-2 -> 4.71e-3, 2.23e-3 ->
            // 1.04e-3; layer 9 0.394 -> 0.199, 6.36e-2 -> 3.47e-2, 1.51e-2 -> 8.31e-3;
            // layer 29 0.226 -> 0.165, 3.19e-2 -> 2.42e-2, 7.48e-3 -> 5.36e-3.
            assert!(b < a, "layer {layer}, {bits} bits: KL {b} before RoPE vs {a} after");
        }
        // The spec form says so, and the plain quantizer refuses it (it has no frequencies).
        let spec: QuantSpec = "int4-channel64-prerope".parse().unwrap();
        assert!(spec.pre_rope() && spec.to_string() == "int4-channel64-prerope");
        assert!(quantize(k, &spec).is_err());
    }
}

#[test]
fn one_byte_parameters_over_shorter_groups_beat_f16_ones_at_the_same_bytes() {
    // Per-channel keys, values exact: `-p8` parameters over 32-token groups take the bytes of
    // f16 ones over 64-token groups (plus a 4-byte grid per group of 32 tokens), and the
    // shorter groups' tighter ranges must lower the attention KL on every layer and width
    // (the grid's rounding costs little: within 3% of f16 parameters over the same groups).
    let Some(file) = common::full_capture() else { return };
    for layer in [0, 9, 29] {
        let l = Layer::read(&file, layer);
        let (k, kl) = (&l.k, |k_hat: &Tensor| l.key_kl(k_hat));
        for bits in [2, 3, 4] {
            let f16 = quantize(k, &format!("int{bits}-channel64").parse().unwrap()).unwrap();
            let p8 = quantize(k, &format!("int{bits}-channel32-p8").parse().unwrap()).unwrap();
            let (m16, m8) = (f16.memory(), p8.memory());
            assert_eq!(m8.code_bytes, m16.code_bytes);
            let groups_of_32 = m16.param_bytes / (2 * 2 * k.shape().head_dim) * 2;
            assert_eq!(m8.param_bytes, m16.param_bytes + 4 * groups_of_32, "layer {layer}");
            let (a, b) = (kl(&f16.dequantize()), kl(&p8.dequantize()));
            // Measured: layer 0 5.46e-2 -> 4.35e-2 (2 bits), 1.05e-2 -> 7.65e-3, 2.23e-3 ->
            // 1.68e-3; layer 9 0.394 -> 0.236, 6.36e-2 -> 4.35e-2, 1.51e-2 -> 9.66e-3; layer 29
            // 0.226 -> 0.130, 3.19e-2 -> 2.40e-2, 7.48e-3 -> 5.41e-3.
            assert!(b < a, "layer {layer}, {bits} bits: KL {b} with -p8 vs {a}");
        }
    }
}

#[test]
fn one_byte_value_parameters_cost_less_for_the_same_error() {
    // Rotated per-token values in error-minimizing ranges: `-p8` parameters (a grid per 32
    // tokens of a head) must keep the values' error of f16 ones within 2% for fewer bytes, and
    // `-g32-…-p8`, at about the bytes of f16 per-token parameters, must lower it.
    let Some(file) = common::full_capture() else { return };
    for layer in [0, 9, 29] {
        let v = file.read(&format!("layer{layer}.v")).unwrap();
        for bits in [2, 3, 4] {
            let (f16, f16_hat) = mse(&v, &format!("int{bits}-token-mse-rot"));
            let (p8, p8_hat) = mse(&v, &format!("int{bits}-token-mse-rot-p8"));
            let (g32, g32_hat) = mse(&v, &format!("int{bits}-g32-mse-rot-p8"));
            let bytes = |t: &str| quantize(&v, &t.parse().unwrap()).unwrap().memory().param_bytes;
            let (b16, b8, bg) = (
                bytes(&format!("int{bits}-token-mse-rot")),
                bytes(&format!("int{bits}-token-mse-rot-p8")),
                bytes(&format!("int{bits}-g32-mse-rot-p8")),
            );
            assert!(b8 < b16 && bg <= b16 + b16 / 16, "layer {layer}: {b8} {bg} vs {b16} bytes");
            assert!(p8 <= f16 * 1.02, "layer {layer}, {bits} bits: V MSE {p8} with -p8 vs {f16}");
            assert!(g32 < f16, "layer {layer}, {bits} bits: V MSE {g32} in groups of 32 vs {f16}");
            assert!(f16_hat.data().iter().chain(p8_hat.data()).chain(g32_hat.data()).all(|x| x.is_finite()));
        }
    }
}
