//! Every refusal of bad input is a typed error, never a panic.

mod common;

use std::collections::HashMap;

use kvq_quant_core::io::{TensorFile, TensorFileError};
use kvq_quant_core::metrics::attention;
use kvq_quant_core::{
    Granularity, Kind, ParamDtype, QuantError, QuantSpec, Shape, Tensor, quantize, quantize_with_ranges,
};
use safetensors::tensor::TensorView;

fn tensor(shape: Shape, f: impl Fn(usize) -> f32) -> Tensor {
    Tensor::new(shape, (0..shape.len()).map(f).collect()).unwrap()
}

#[track_caller]
fn check_quantize(x: &Tensor, spec: &str, expect: impl Fn(&QuantError) -> bool) {
    let err = quantize(x, &spec.parse().unwrap()).unwrap_err();
    assert!(expect(&err), "{spec}: unexpected {err:?}");
    assert!(!err.to_string().is_empty());
}

#[test]
fn empty_tensors() {
    for shape in [Shape::new(0, 4, 8), Shape::new(2, 0, 8), Shape::new(2, 4, 0)] {
        let x = Tensor::new(shape, vec![]).unwrap();
        check_quantize(&x, "int4-token", |e| matches!(e, QuantError::EmptyTensor(_)));
    }
}

#[test]
fn non_finite_values_name_their_position() {
    let shape = Shape::with_batch(2, 3, 5, 8);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let at = shape.len() - 11;
        let x = tensor(shape, |i| if i == at { bad } else { 0.5 });
        check_quantize(
            &x,
            "int8-head",
            |e| matches!(e, QuantError::NonFinite { position, .. } if *position == shape.position(at)),
        );
        assert_eq!(shape.position(at), [1, 2, 3, 5]);
    }
}

#[test]
fn bit_widths_out_of_range() {
    for spec in ["int0", "int9", "sym1", "lloyd9", "int300"] {
        assert!(spec.parse::<QuantSpec>().is_err(), "{spec}");
    }
    let e = QuantSpec::new(Kind::Affine, 9, Granularity::PerToken, ParamDtype::F16).unwrap_err();
    assert!(matches!(e, QuantError::BitsOutOfRange { bits: 9, max: 8, .. }));
    let e =
        QuantSpec::new(Kind::Fp8(kvq_quant_core::Fp8Format::E4M3), 4, Granularity::PerToken, ParamDtype::F16)
            .unwrap_err();
    assert!(matches!(e, QuantError::BitsOutOfRange { .. }));
    assert!(kvq_quant_core::pack::pack(&[0], 0).is_err());
}

#[test]
fn group_sizes() {
    let x = tensor(Shape::new(1, 4, 48), |i| i as f32);
    check_quantize(&x, "int4-g32", |e| matches!(e, QuantError::GroupSize { group: 32, head_dim: 48 }));
    assert!("int4-g0".parse::<QuantSpec>().is_err());
    assert!("int4-channel0".parse::<QuantSpec>().is_err());
    // One-byte parameters: affine groups per channel, token or of N channels, not with bits
    // per channel.
    for good in ["int4-token-p8", "int4-g32-mse-rot-p8", "int2-channel-p8"] {
        assert_eq!(good.parse::<QuantSpec>().unwrap().to_string(), good);
    }
    for bad in ["sym4-channel-p8", "nf4-token-p8", "int4-head-p8", "int4-tensor-p8", "int3-channel-qa-p8"] {
        assert!(matches!(bad.parse::<QuantSpec>(), Err(QuantError::InvalidSpec(_))), "{bad}");
    }
    let p8: QuantSpec = "int4-channel32-mse-prerope-p8".parse().unwrap();
    assert_eq!(p8.to_string(), "int4-channel32-mse-prerope-p8");
    assert!(matches!(p8.clone().with_granularity(Granularity::PerHead), Err(QuantError::InvalidSpec(_))));
    // Set past the constructor's check: refused when used.
    let sneaky = QuantSpec::affine(4, Granularity::PerHead).unwrap().with_param_dtype(ParamDtype::U8);
    let x = kvq_quant_core::Tensor::new(kvq_quant_core::Shape::new(1, 2, 4), vec![0.0; 8]).unwrap();
    assert!(matches!(kvq_quant_core::quantize(&x, &sneaky), Err(QuantError::InvalidSpec(_))));
    assert!("int4-g16".parse::<QuantSpec>().is_ok());
}

#[test]
fn malformed_specs() {
    for spec in ["", "float4", "int", "int4-row", "int4-gx", "nf3"] {
        assert!(spec.parse::<QuantSpec>().is_err(), "{spec:?}");
    }
}

#[test]
fn fixed_codebook_specs_read_back_only_with_their_levels() {
    use kvq_quant_core::{Codebook, CodebookSource};
    let cb = Codebook::new(vec![-1.0, -0.25, 0.3, 1.0]).unwrap();
    let kind = Kind::Codebook(CodebookSource::Fixed(cb.clone()));
    let spec = QuantSpec::new(kind, 2, Granularity::PerToken, ParamDtype::F16).unwrap();
    let text = spec.to_string();
    assert_eq!(text, "codebook2-token");
    // The text alone names no levels.
    assert!(text.parse::<QuantSpec>().is_err());
    assert!(QuantSpec::parse_with_levels(&text, None).is_err());
    let levels = spec.fixed_levels().map(<[f32]>::to_vec);
    assert_eq!(levels.as_deref(), Some(cb.levels()));
    assert_eq!(QuantSpec::parse_with_levels(&text, levels.clone()).unwrap(), spec);
    // Levels of another width, for another kind, or not levels at all, are refused.
    for (text, levels) in [
        ("codebook3-token", levels.clone()),
        ("int2-token", levels.clone()),
        ("codebook2-token", Some(vec![0.5, 0.1, 0.2, 0.3])),
        ("codebook2-token", Some(vec![f32::NAN, 0.1, 0.2, 0.3])),
        ("codebook2-token", Some(vec![0.1; 300])),
    ] {
        assert!(
            matches!(QuantSpec::parse_with_levels(text, levels), Err(QuantError::InvalidSpec(_))),
            "{text}"
        );
    }
    assert!(QuantSpec::parse_with_levels("codebook2-row", levels).is_err());
    assert!("int4-token".parse::<QuantSpec>().unwrap().fixed_levels().is_none());
}

#[test]
fn shape_mismatches() {
    assert!(matches!(Tensor::new(Shape::new(2, 2, 2), vec![0.0; 7]), Err(QuantError::ShapeMismatch { .. })));
    let x = tensor(Shape::new(2, 4, 8), |i| i as f32);
    let spec: QuantSpec = "int4-head".parse().unwrap();
    let e = quantize_with_ranges(&x, &spec, &[0.0], &[1.0]).unwrap_err();
    assert!(matches!(e, QuantError::ShapeMismatch { .. }));
    let e = quantize_with_ranges(&x, &spec, &[0.0, 2.0], &[1.0, 1.0]).unwrap_err();
    assert!(matches!(e, QuantError::InvalidArgument(_)));
    let q = tensor(Shape::new(3, 4, 8), |i| i as f32);
    assert!(matches!(attention(&q, &x, &x, &[0]), Err(QuantError::ShapeMismatch { .. })));
}

#[test]
fn zero_range_groups_decode_to_their_constant() {
    let x = tensor(Shape::new(2, 3, 8), |i| if i < 24 { 0.3 } else { -1e-3 });
    for spec in ["int1-token-f32", "int4-head-f32", "int8-channel-f32", "int2-g4-f32"] {
        let y = quantize(&x, &spec.parse().unwrap()).unwrap().dequantize();
        assert_eq!(y.data(), x.data(), "{spec}");
    }
    // Affine with f16 parameters: exact for a constant that f16 represents.
    let z = tensor(Shape::new(1, 2, 8), |_| 0.375);
    for spec in ["int4-token", "int8-tensor", "int2-channel"] {
        let y = quantize(&z, &spec.parse().unwrap()).unwrap().dequantize();
        assert_eq!(y.data(), z.data(), "{spec}");
    }
    // Scale-only formats store `absmax / max level`, rounded up to f16: the constant comes
    // back within that rounding (2^-11 relative), never NaN.
    for spec in ["sym4-token", "fp8e4m3-token", "nf4-token", "sym8-tensor-f32"] {
        let y = quantize(&z, &spec.parse().unwrap()).unwrap().dequantize();
        assert!(y.data().iter().all(|v| (v / 0.375 - 1.0).abs() <= 1.0 / 2048.0), "{spec}: {:?}", y.data());
    }
    let zeros = tensor(Shape::new(1, 2, 8), |_| 0.0);
    for spec in ["int4-token", "sym4-token", "fp8e5m2-token", "nf4-token", "lloyd2-token"] {
        let y = quantize(&zeros, &spec.parse().unwrap()).unwrap().dequantize();
        assert!(y.data().iter().all(|&v| v == 0.0), "{spec}");
    }
}

#[test]
fn parameters_that_overflow_f16() {
    let x = tensor(Shape::new(1, 2, 8), |i| i as f32 * 1e5);
    check_quantize(&x, "int4-token", |e| matches!(e, QuantError::ParamOverflow { dtype: "f16", .. }));
    assert!(quantize(&x, &"int4-token-f32".parse().unwrap()).is_ok());
}

fn write_file(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dt, shape, data)| (n.to_string(), TensorView::new(*dt, shape.clone(), data).unwrap()))
        .collect();
    safetensors::serialize(views, None::<HashMap<String, String>>).unwrap()
}

#[test]
fn tensor_file_errors() {
    let good = write_file(&[
        ("k", safetensors::Dtype::F32, vec![1, 2, 2], vec![0; 16]),
        ("ids", safetensors::Dtype::I32, vec![1, 2, 2], vec![0; 16]),
        ("flat", safetensors::Dtype::F16, vec![4], vec![0; 8]),
        ("bf", safetensors::Dtype::BF16, vec![1, 1, 2, 2], vec![0x80, 0x3f, 0, 0x40, 0, 0, 0, 0xc0]),
    ]);
    let f = TensorFile::from_bytes("mem", good.clone()).unwrap();
    assert_eq!(f.list().len(), 4);
    assert_eq!(f.read("bf").unwrap().data(), &[1.0, 2.0, 0.0, -2.0]);
    assert!(matches!(f.read("nope"), Err(TensorFileError::MissingTensor { .. })));
    assert!(matches!(f.read("ids"), Err(TensorFileError::UnsupportedDtype { .. })));
    assert!(matches!(f.read("flat"), Err(TensorFileError::WrongRank { .. })));

    for cut in [0, 4, 8, 20, good.len() - 1] {
        let e = TensorFile::from_bytes("cut", good[..cut].to_vec()).unwrap_err();
        assert!(matches!(e, TensorFileError::Corrupt { .. }), "cut at {cut}: {e:?}");
    }
    let mut garbage = good.clone();
    garbage[10] = b'{';
    garbage[9] = 0xff;
    assert!(matches!(TensorFile::from_bytes("garbage", garbage), Err(TensorFileError::Corrupt { .. })));
    let e = TensorFile::open("/nonexistent/kv.safetensors").unwrap_err();
    assert!(matches!(e, TensorFileError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/kv.safetensors"));
}

#[test]
fn real_file_rejects_non_kv_tensors() {
    let f = common::real_data();
    if f.contains("input_ids") {
        assert!(matches!(f.read("input_ids"), Err(TensorFileError::UnsupportedDtype { .. })));
        assert!(matches!(f.read("rope.inv_freq"), Err(TensorFileError::WrongRank { .. })));
        let inv_freq = f.read_vector("rope.inv_freq").unwrap();
        assert_eq!((inv_freq.len(), inv_freq[0]), (32, 1.0));
        assert!(matches!(f.read_vector("layer9.k"), Err(TensorFileError::WrongRank { .. })));
        assert!(matches!(f.read_vector("nothing"), Err(TensorFileError::MissingTensor { .. })));
    }
    let k = f.read("layer9.k").unwrap();
    assert_eq!((k.shape().heads, k.shape().head_dim), (3, 64));
}

/// Crafted calibration files (`tests/regressions/calibration`): sizes whose product overflows
/// are an error, in debug and release builds alike.
#[test]
fn crafted_calibrations_are_refused() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/regressions/calibration");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let e = serde_json::from_str::<kvq_quant_core::Calibration>(&text).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{}: {e}", path.display());
        n += 1;
    }
    assert!(n > 0);
}

#[test]
fn only_regular_files_are_read() {
    use kvq_quant_core::io::{TensorFile, read_regular_file};
    for p in ["/dev/zero", "/"] {
        let e = read_regular_file(std::path::Path::new(p), 1 << 20).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{p}");
        assert!(TensorFile::open(p).unwrap_err().to_string().contains("not a regular file"));
    }
    let dir = std::env::temp_dir().join(format!("kvq-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A FIFO would block an open() forever: it is refused from its metadata alone.
    let fifo = dir.join("fifo");
    if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        assert!(TensorFile::open(&fifo).unwrap_err().to_string().contains("not a regular file"));
    }
    let path = dir.join("big.bin");
    kvq_quant_core::io::write_atomic(&path, &[7u8; 100]).unwrap();
    assert_eq!(read_regular_file(&path, 100).unwrap(), vec![7u8; 100]);
    assert!(read_regular_file(&path, 99).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}
