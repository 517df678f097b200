//! A decode step performs no heap allocation once its workspace has seen a step of the
//! batch's shape: counted by a global allocator, over every spec kind (affine per channel and
//! per token, groups along head_dim, symmetric, FP8, NF4, calibrated static parts, f16 and
//! f32 tails with sinks), both score paths, f32 and f16 queries and outputs, every SIMD backend of this CPU, a batch with a
//! prefill chunk, and a long context split across threads; and a step of the single-sequence
//! entry point, which keeps a workspace per thread.
//!
//! One test in this binary: the counter is global, and a second test running beside it would
//! allocate into it (libtest's own notice after 60 seconds is handled by measuring a window
//! that allocated once more). The scalar backend, the reference the others are tested against, is
//! plain code that allocates; serving never selects it.

use cap::Cap;
use half::f16;
use kvq::attention::{
    AttentionError, AttentionOptions, BatchSeq, DecodeWorkspace, ScorePath, decode_attention,
    decode_attention_batch,
};
use kvq::kernels::Backend;
use kvq::kernels::dispatch::available;
use kvq::layout::{CacheConfig, PagedCache, SeqId, TailDtype};
use kvq::quant::synth::Rng;
use kvq::quant::{Calibration, Shape, Tensor};

#[global_allocator]
static ALLOCATOR: Cap<std::alloc::System> = Cap::new(std::alloc::System, usize::MAX);

fn random(rng: &mut Rng, shape: Shape) -> Tensor {
    Tensor::new(shape, (0..shape.len()).map(|_| rng.normal() as f32).collect()).unwrap()
}

/// Bytes allocated by a first step, and by three later ones. The counter is the process's:
/// libtest's own thread allocates when it prints its "running for over 60 seconds" notice,
/// which this test can reach under qemu. A step that allocates does so in every window, so a
/// window that allocated is measured once more before it counts.
fn allocations(step: &mut dyn FnMut() -> Result<(), AttentionError>) -> (usize, usize) {
    let before = ALLOCATOR.total_allocated();
    step().unwrap();
    let first = ALLOCATOR.total_allocated() - before;
    let mut window = || {
        let before = ALLOCATOR.total_allocated();
        for _ in 0..3 {
            step().unwrap();
        }
        ALLOCATOR.total_allocated() - before
    };
    let allocated = match window() {
        0 => 0,
        _ => window(),
    };
    (first, allocated)
}

#[test]
fn decode_steps_do_not_allocate() {
    let mut rng = Rng::new(5);
    let (kv_heads, g, d) = (2usize, 4usize, 128usize);
    let qh = kv_heads * g;
    // Four threads and two KV heads: the long single sequence below is split.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let specs = [
        ("int4-channel", "int4-token"),
        ("int8-channel", "int8-token"),
        ("int2-channel", "int2-token-rot"), // decodes as int2-token; the output is unrotated in place
        ("int3-channel", "int3-token"),
        ("int4-g32", "int4-g32"),
        ("sym4-token", "sym8-token"),
        ("fp8e4m3-token", "fp8e5m2-token"),
        ("nf4-token", "nf4-token"),
        ("int8-head", "int4-channel"),
        ("int3-channel-qa", "int4-token"), // keys in width regions, queries permuted per step
        ("int4-channel-prerope", "int4-token"), // keys before RoPE: turned per block and row
        ("int4-channel-p8", "int4-token-p8"), // one-byte parameters read from their grid
        ("int4-channel16", "int4-channel8"), // channel groups inside the block: its token groups
    ];
    let mut checked = 0;
    for (i, (k, v)) in specs.iter().enumerate() {
        let shape = Shape::new(kv_heads, 64, d);
        let calibration =
            Calibration::from_tensors(&[random(&mut rng, shape)], &[random(&mut rng, shape)], None).unwrap();
        let config = CacheConfig::new(1, kv_heads, d, 256)
            .with_specs(k.parse().unwrap(), v.parse().unwrap())
            .with_block_size(32)
            .with_residual_blocks(i % 2)
            .with_sink_tokens(4 * (i % 2))
            .with_tail_dtype([TailDtype::F32, TailDtype::F16, TailDtype::Int8][i % 3])
            .with_value_tail_dtype([TailDtype::Int8, TailDtype::F16][i % 2]);
        let config = if k.contains("-head") { config.with_calibration(calibration) } else { config };
        // Widths 2, 3 and 4 over interleaved channels: three regions, a real permutation.
        let widths: Vec<u8> = (0..d).map(|c| [2, 4, 3, 3][c % 4]).collect();
        let config = if k.contains("-qa") {
            config.with_channel_bits(vec![kvq::quant::ChannelBits::new(widths).unwrap(); kv_heads])
        } else {
            config
        };
        let config = if k.contains("-prerope") {
            let rope = kvq::quant::Rope::from_theta(10_000.0, d, kvq::quant::RopePairing::Half).unwrap();
            config.with_rope(rope)
        } else {
            config
        };
        let mut cache = PagedCache::new(config).unwrap();
        let mut seq = |len: usize, cache: &mut PagedCache| -> SeqId {
            let s = cache.create();
            let shape = Shape::new(kv_heads, len, d);
            cache.extend(s, 0, &random(&mut rng, shape), &random(&mut rng, shape)).unwrap();
            s
        };
        let (long, a, b) = (seq(3000, &mut cache), seq(100, &mut cache), seq(45, &mut cache));
        let batches = [
            vec![BatchSeq::decode(long)],
            vec![BatchSeq::decode(a), BatchSeq { seq: b, tokens: 9 }, BatchSeq::decode(long)],
        ];
        for backend in available().into_iter().filter(|&b| b != Backend::Scalar) {
            for path in [ScorePath::Float, ScorePath::Int8] {
                let options = AttentionOptions::with_path(path);
                for batch in &batches {
                    let rows: usize = batch.iter().map(|e| e.tokens).sum();
                    let q: Vec<f32> = (0..rows * qh * d).map(|_| rng.normal() as f32).collect();
                    let mut out = vec![0f32; q.len()];
                    let mut ws = DecodeWorkspace::new();
                    let on = options.backend(backend);
                    let (first, allocated) = pool.install(|| {
                        allocations(&mut || {
                            decode_attention_batch(&on, &cache, 0, batch, &q, qh, &mut out, &mut ws)
                        })
                    });
                    // The counter sees the first step sizing the fresh workspace.
                    assert!(first > 0, "the first step of a new workspace allocates its buffers");
                    assert_eq!(
                        allocated,
                        0,
                        "K {k} V {v}, {backend}, {path:?}, {} sequences: {allocated} bytes allocated in 3 steps",
                        batch.len()
                    );
                    assert!(out.iter().all(|x| x.is_finite()));
                    // f16 queries and outputs are converted in the workspace's buffers.
                    let q: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
                    let mut out = vec![f16::ZERO; q.len()];
                    let (_, allocated) = pool.install(|| {
                        allocations(&mut || {
                            decode_attention_batch(&on, &cache, 0, batch, &q, qh, &mut out, &mut ws)
                        })
                    });
                    assert_eq!(allocated, 0, "f16: K {k} V {v}, {backend}, {path:?}");
                    checked += 1;
                }
                // The single-sequence entry point keeps a workspace per thread.
                for s in [long, a] {
                    let q: Vec<f32> = (0..qh * d).map(|_| rng.normal() as f32).collect();
                    let mut out = vec![0f32; q.len()];
                    let (_, allocated) = pool.install(|| {
                        allocations(&mut || {
                            decode_attention(&options.backend(backend), &cache, s, 0, &q, qh, &mut out)
                        })
                    });
                    assert_eq!(allocated, 0, "one sequence: K {k} V {v}, {backend}, {path:?}");
                }
            }
        }
    }
    assert!(checked >= specs.len() * 4, "at least one SIMD backend on every CPU (wide)");
}
