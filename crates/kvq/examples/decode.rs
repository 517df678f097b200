//! Prefill a quantized KV cache from real keys and values, decode new tokens with attention,
//! and compare with full precision.
//!
//! ```sh
//! cargo run --release --example decode                      # embedded SmolLM2 sample
//! cargo run --release --example decode -- path/to/kv.safetensors
//! ```
//! The file needs `layer<L>.q`, `layer<L>.k` and `layer<L>.v` tensors; the first 3/4 of the
//! tokens prefill the cache, the rest are decoded one at a time.

use kvq::prelude::*;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = match std::env::args().nth(1) {
        Some(path) => TensorFile::open(path)?,
        None => TensorFile::from_bytes("embedded sample", kvq::SAMPLE.to_vec())?,
    };
    let layers = kvq::analysis::layers_from_file(&file)?;
    let (q0, k0) = (layers[0].q.shape(), layers[0].k.shape());
    let (tokens, prefill) = (k0.tokens, k0.tokens * 3 / 4);

    let config = KvCacheConfig::builder(layers.len(), k0.heads, q0.heads, k0.head_dim)
        .blocks_per_layer(k0.heads * tokens.div_ceil(32))
        .build()?;
    println!(
        "{} layers, {} KV heads, {} query heads, head_dim {}",
        layers.len(),
        k0.heads,
        q0.heads,
        k0.head_dim
    );
    println!(
        "specs: K {} / V {}, {:.3} bits per value in full blocks",
        config.layers[0].k,
        config.layers[0].v,
        config.bits_per_value()
    );
    let mut cache = QuantizedKvCache::new(config)?;
    let seq = cache.create();
    for (l, layer) in layers.iter().enumerate() {
        cache.extend(seq, l, &layer.k.prefix(prefill)?, &layer.v.prefix(prefill)?)?;
    }

    let d = k0.head_dim;
    let (mut err2, mut ref2) = (0f64, 0f64);
    for t in prefill..tokens {
        for (l, layer) in layers.iter().enumerate() {
            let row =
                |x: &Tensor| (0..x.shape().heads).flat_map(|h| x.row(0, h, t).to_vec()).collect::<Vec<f32>>();
            cache.append(seq, l, &row(&layer.k), &row(&layer.v))?;
            let q = row(&layer.q);
            let mut out = vec![0f32; q.len()];
            cache.attention(&AttentionOptions::default(), seq, l, &q, &mut out)?;
            // Full-precision reference: the same attention over the original tensors.
            let reference = kvq::quant::metrics::attention(
                &layer.q.prefix(t + 1)?,
                &layer.k.prefix(t + 1)?,
                &layer.v.prefix(t + 1)?,
                &[t],
            )?;
            for (a, b) in out.iter().zip(reference.outputs()) {
                err2 += (f64::from(*a) - b).powi(2);
                ref2 += b * b;
            }
        }
    }
    let f16_bytes = 2 * 2 * layers.len() * k0.heads * tokens * d;
    println!("decoded {} tokens after a prefill of {prefill}", tokens - prefill);
    println!(
        "memory in use: {} bytes ({:.2}x smaller than f16 K and V)",
        cache.used_bytes(),
        f16_bytes as f64 / cache.used_bytes() as f64
    );
    println!("attention output relative error vs full precision: {:.4}", (err2 / ref2).sqrt());
    Ok(())
}
