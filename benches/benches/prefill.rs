//! A prefill chunk attending to a cache: 512 new tokens of one Llama-3-8B-shaped layer (32
//! query heads over 8 KV heads of 128 channels) appended to a 4096-token cache, each attending
//! causally to the cache and to the chunk's earlier tokens, in one `decode_attention_batch`
//! call with a kept workspace; one thread and two. Throughput is the chunk's tokens. There is
//! no dense baseline here yet: `kvq::baseline` decodes one token at a time.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvq::attention::{AttentionOptions, BatchSeq, DecodeWorkspace, decode_attention_batch};
use kvq_benches::{best_float, layer_cache};
use kvq_quant_core::Shape;
use kvq_quant_core::synth::{Rng, normal_tensor};

const D: usize = 128;
const CONTEXT: usize = 4096;
const CHUNK: usize = 512;

fn chunk(c: &mut Criterion) {
    let (q_heads, kv_heads) = (32usize, 8usize);
    let len = CONTEXT + CHUNK;
    let kv = normal_tensor(Shape::new(kv_heads, len, D), 31);
    let vv = normal_tensor(Shape::new(kv_heads, len, D), 32);
    let mut rng = Rng::new(33);
    let q: Vec<f32> = (0..CHUNK * q_heads * D).map(|_| rng.normal() as f32).collect();
    let mut out = vec![0f32; q.len()];
    let mut group = c.benchmark_group(format!("chunk_{CHUNK}_over_{}k_llama3_8b_layer", CONTEXT / 1024));
    group.sample_size(10);
    group.throughput(Throughput::Elements(CHUNK as u64));
    let backend = best_float();
    let options = AttentionOptions::default().backend(backend);
    for (k, v) in [
        ("int8-token", "int8-token"),
        ("int4-channel", "int4-token"),
        ("int2-channel", "int2-token"),
        ("int4-channel", "int4-token-mse-rot"),
    ] {
        let mut cache = layer_cache(kv_heads, D, kv_heads * len.div_ceil(32) + kv_heads, k, v);
        let seq = cache.create();
        cache.extend(seq, 0, &kv, &vv).unwrap();
        let batch = [BatchSeq { seq, tokens: CHUNK }];
        let mut ws = DecodeWorkspace::new();
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            group.bench_function(format!("{k}/{v}/{backend}_{threads}thread"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        decode_attention_batch(&options, &cache, 0, &batch, &q, q_heads, &mut out, &mut ws)
                            .unwrap()
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, chunk);
criterion_main!(benches);
