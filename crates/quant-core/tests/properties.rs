//! Property tests: packing round-trips, and per-element error bounds of every format.

use kvq_quant_core::pack::{pack, packed_len, unpack};
use kvq_quant_core::{Codebook, Fp8Format, QuantSpec, ROW_SET_TOKENS, Shape, Tensor, quantize};
use proptest::prelude::*;

/// A small tensor with head_dim a multiple of 8 and values of varied scale and offset.
fn tensor() -> impl Strategy<Value = Tensor> {
    (1usize..3, 1usize..9, 1usize..5, -3i32..4, -4.0f32..4.0).prop_flat_map(
        |(heads, tokens, d8, exp, shift)| {
            let shape = Shape::new(heads, tokens, d8 * 8);
            let scale = 10f32.powi(exp);
            prop::collection::vec(-1.0f32..1.0, shape.len()).prop_map(move |v| {
                Tensor::new(shape, v.iter().map(|x| x * scale + shift * scale).collect()).unwrap()
            })
        },
    )
}

const GRANULARITIES: [&str; 6] = ["tensor", "head", "channel", "channel3", "token", "g8"];

/// Checks `bound(x, x̂, params of x's group)` for every element.
fn check_elements(
    x: &Tensor,
    spec: &QuantSpec,
    bound: impl Fn(f32, f32, f32) -> bool,
) -> Result<(), TestCaseError> {
    let q = quantize(x, spec).unwrap();
    let y = q.dequantize();
    let d = x.shape().head_dim;
    let layout = q.layout();
    for (i, (&a, &b)) in x.data().iter().zip(y.data()).enumerate() {
        let (first, seg) = layout.row_groups(i / d);
        let p = q.group_params(first + (i % d) / seg);
        prop_assert!(bound(a, b, p.scale), "{spec}: x {a} x̂ {b} scale {}", p.scale);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn pack_round_trips(bits in 1u8..=8, seed in prop::collection::vec(any::<u8>(), 0..600)) {
        let codes: Vec<u8> = seed.iter().map(|c| c & ((1u16 << bits) - 1) as u8).collect();
        let packed = pack(&codes, bits).unwrap();
        prop_assert_eq!(packed.len(), packed_len(codes.len(), bits).unwrap());
        prop_assert!(packed.len() <= (codes.len() * bits as usize).div_ceil(8) + 2);
        prop_assert_eq!(unpack(&packed, bits, codes.len()).unwrap(), codes);
    }

    #[test]
    fn one_byte_parameters_keep_half_a_step_and_cost_less(x in tensor(), bits in 1u8..=8, g in 2usize..6, mse in any::<bool>()) {
        let base = format!("int{bits}-{}{}", GRANULARITIES[g], if mse { "-mse" } else { "" });
        let spec: QuantSpec = format!("{base}-p8").parse().unwrap();
        // Range ends on the nearest grid points (min/max): half a step, plus at most half a
        // grid step for a value beyond its group's rounded range. A set's grid spans at most
        // the tensor's range (its ends rounded outward to f16).
        if !mse {
            let (lo, hi) = x.data().iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
            let grid = (hi - lo) / 255.0 * 1.01 + 2e-3 * lo.abs().max(hi.abs());
            check_elements(&x, &spec, |a, b, step| {
                (a - b).abs() <= 0.5 * step * (1.0 + 1e-4) + 0.5 * grid + 4.0 * f32::EPSILON * a.abs().max(b.abs())
            })?;
        }
        let (q8, q16) = (quantize(&x, &spec).unwrap(), quantize(&x, &base.parse().unwrap()).unwrap());
        // One byte per parameter and 4 per set against 2 each: a set is one head over one token
        // group (per channel) or over up to ROW_SET_TOKENS rows (per token, gN).
        let (groups, s) = (q16.scales().len(), x.shape());
        let sets = if g < 4 { groups / s.head_dim } else { s.batch * s.heads * s.tokens.div_ceil(ROW_SET_TOKENS) };
        prop_assert_eq!(q8.memory().param_bytes, 2 * groups + 4 * sets);
        prop_assert_eq!(q16.memory().param_bytes, 4 * groups);
        prop_assert!(q8.dequantize().data().iter().all(|v| v.is_finite()));
    }

    #[test]
    fn affine_error_is_at_most_half_a_step(x in tensor(), bits in 1u8..=8, g in 0usize..6, f32_params in any::<bool>()) {
        let suffix = if f32_params { "-f32" } else { "" };
        let spec: QuantSpec = format!("int{bits}-{}{suffix}", GRANULARITIES[g]).parse().unwrap();
        // Half a step, plus f32 rounding of the decode relative to the values' magnitude.
        check_elements(&x, &spec, |a, b, step| (a - b).abs() <= 0.5 * step * (1.0 + 1e-4) + 4.0 * f32::EPSILON * a.abs().max(b.abs()))?;
    }

    #[test]
    fn symmetric_error_is_at_most_half_a_step(x in tensor(), bits in 2u8..=8, g in 0usize..6) {
        let spec: QuantSpec = format!("sym{bits}-{}", GRANULARITIES[g]).parse().unwrap();
        check_elements(&x, &spec, |a, b, step| (a - b).abs() <= 0.5 * step * (1.0 + 1e-4) + 4.0 * f32::EPSILON * a.abs())?;
    }

    #[test]
    fn fp8_error_is_relative(x in tensor(), e5m2 in any::<bool>(), g in 0usize..6) {
        let (name, fmt, mantissa) = if e5m2 { ("fp8e5m2", Fp8Format::E5M2, 2) } else { ("fp8e4m3", Fp8Format::E4M3, 3) };
        let spec: QuantSpec = format!("{name}-{}", GRANULARITIES[g]).parse().unwrap();
        // Round to nearest: half an ulp relative to the value, or half the smallest
        // subnormal step (times the scale) near zero.
        let rel = 0.5f32.powi(mantissa + 1);
        check_elements(&x, &spec, |a, b, scale| {
            let bound = (a.abs() * rel).max(0.5 * scale * fmt.min_positive());
            (a - b).abs() <= bound * (1.0 + 1e-4) + 4.0 * f32::EPSILON * a.abs()
        })?;
    }

    #[test]
    fn nf4_error_is_half_the_widest_gap(x in tensor(), g in 0usize..6) {
        let spec: QuantSpec = format!("nf4-{}", GRANULARITIES[g]).parse().unwrap();
        let gap = Codebook::nf4().levels().windows(2).map(|w| w[1] - w[0]).fold(0.0, f32::max);
        check_elements(&x, &spec, |a, b, scale| (a - b).abs() <= 0.5 * gap * scale * (1.0 + 1e-4) + 4.0 * f32::EPSILON * a.abs())?;
    }

    #[test]
    fn error_minimizing_ranges_never_lose_to_min_max(x in tensor(), kind in 0usize..4, bits in 2u8..=8, g in 0usize..6) {
        let kind = ["int{b}", "sym{b}", "fp8e4m3", "nf4"][kind].replace("{b}", &bits.to_string());
        let plain: QuantSpec = format!("{kind}-{}", GRANULARITIES[g]).parse().unwrap();
        let fitted: QuantSpec = format!("{kind}-{}-mse", GRANULARITIES[g]).parse().unwrap();
        prop_assert_eq!(fitted.to_string().parse::<QuantSpec>().unwrap(), fitted.clone());
        let sse = |spec: &QuantSpec| {
            let y = quantize(&x, spec).unwrap().dequantize();
            x.data().iter().zip(y.data()).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum::<f64>()
        };
        let (a, b) = (sse(&plain), sse(&fitted));
        // Each group's error can only fall; the sum of squares is exact up to f64 rounding.
        prop_assert!(b <= a * (1.0 + 1e-12), "{}: {} > {}", fitted, b, a);
        let (qa, qb) = (quantize(&x, &plain).unwrap(), quantize(&x, &fitted).unwrap());
        prop_assert_eq!(qa.memory(), qb.memory(), "same storage");
    }

    #[test]
    fn rotated_rows_keep_the_error_bound_of_their_grid(x in tensor(), bits in 2u8..=8, token in any::<bool>()) {
        // The rotation is orthonormal: a row's L2 error is that of its rotated row, at most half
        // a step per element. Head dims that are not powers of two are refused.
        let g = if token { "token" } else { "g8" };
        let spec: QuantSpec = format!("int{bits}-{g}-rot").parse().unwrap();
        let d = x.shape().head_dim;
        if !d.is_power_of_two() {
            prop_assert!(matches!(quantize(&x, &spec), Err(kvq_quant_core::QuantError::InvalidSpec(_))));
            return Ok(());
        }
        let q = quantize(&x, &spec).unwrap();
        let y = q.dequantize();
        let layout = q.layout();
        for (r, (a, b)) in x.data().chunks_exact(d).zip(y.data().chunks_exact(d)).enumerate() {
            let (first, seg) = layout.row_groups(r);
            let step = (0..d / seg).map(|i| q.group_params(first + i).scale).fold(0.0, f32::max);
            let err = a.iter().zip(b).map(|(&u, &v)| f64::from(u - v).powi(2)).sum::<f64>().sqrt();
            let norm = a.iter().map(|&u| f64::from(u).powi(2)).sum::<f64>().sqrt();
            let bound = 0.5 * f64::from(step) * (d as f64).sqrt() * (1.0 + 1e-4) + 1e-5 * norm;
            prop_assert!(err <= bound, "{}: row {} error {} over {}", spec, r, err, bound);
        }
    }

    #[test]
    fn channel_bits_keep_each_channels_half_step(
        x in tensor(),
        bits in 1u8..=8,
        moves in prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>()), 0..40),
    ) {
        // A map of any widths summing to bits · d (random transfers of one bit between
        // channels): every element is within half a step of its channel's own width over the
        // channel's range in its head.
        use kvq_quant_core::{ChannelBits, quantize_channel_bits};
        let s = x.shape();
        let d = s.head_dim;
        let mut w = vec![bits; d];
        for (a, b) in &moves {
            let (a, b) = (a.index(d), b.index(d));
            if a != b && w[a] < 8 && w[b] > 1 {
                w[a] += 1;
                w[b] -= 1;
            }
        }
        let spec: QuantSpec = format!("int{bits}-channel-qa-f32").parse().unwrap();
        let maps = vec![ChannelBits::new(w.clone()).unwrap(); s.heads];
        let q = quantize_channel_bits(&x, &spec, &maps).unwrap();
        let y = q.dequantize();
        prop_assert_eq!(y.shape(), s);
        for h in 0..s.heads {
            for (c, &wc) in w.iter().enumerate() {
                let col: Vec<f32> = (0..s.tokens).map(|t| x.row(0, h, t)[c]).collect();
                let (lo, hi) = col.iter().fold((f32::MAX, f32::MIN), |(l, u), &v| (l.min(v), u.max(v)));
                let step = (hi - lo) / ((1u32 << wc) - 1) as f32;
                for t in 0..s.tokens {
                    let (a, b) = (x.row(0, h, t)[c], y.row(0, h, t)[c]);
                    let bound = 0.5 * step * (1.0 + 1e-4) + 4.0 * f32::EPSILON * a.abs().max(b.abs());
                    prop_assert!((a - b).abs() <= bound, "head {} channel {} width {}: x {} x̂ {}", h, c, wc, a, b);
                }
            }
        }
        let code_bits: usize = w.iter().map(|&b| usize::from(b)).sum();
        prop_assert_eq!(code_bits, usize::from(bits) * d);
    }

    #[test]
    fn fitted_channel_bits_sum_pair_and_fill_units(x in tensor(), bits in 1u8..=8, e in prop::collection::vec(0.0f32..10.0, 32)) {
        use kvq_quant_core::{ChannelBits, RopePairing};
        let s = x.shape();
        let d = s.head_dim;
        let keys = Tensor::new(Shape::new(1, s.tokens, d), x.data()[..s.tokens * d].to_vec()).unwrap();
        let spec: QuantSpec = format!("int{bits}-channel1-qa").parse().unwrap();
        for pairing in [None, Some(RopePairing::Half), Some(RopePairing::Interleaved)] {
            let map = ChannelBits::fit(&keys, &e[..d], &spec, pairing).unwrap();
            prop_assert_eq!(map.total_bits(), usize::from(bits) * d);
            prop_assert!(map.widths().iter().all(|w| (1..=8).contains(w)));
            for (_, channels) in map.segments() {
                prop_assert_eq!(channels.len() % 8, 0);
            }
            let mut perm = map.permutation();
            perm.sort_unstable();
            prop_assert_eq!(perm, (0..d).collect::<Vec<_>>());
            if let Some(p) = pairing {
                for i in 0..d / 2 {
                    let (a, b) = p.channels(i, d);
                    prop_assert_eq!(map.widths()[a], map.widths()[b]);
                }
            }
        }
    }
}
