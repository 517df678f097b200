//! A decode step of the batched forward (every layer's projections, appends and attention,
//! and the logits) performs no heap allocation once its workspace and the cache's buffers
//! have seen steps as large, on weights kvq's kernels multiply: counted by a global
//! allocator. The exception, stated: a step in which a sequence completes a block still
//! allocates that block's parameter vectors while it quantizes it (a few KiB per layer, once
//! per block of tokens). The steps run on a worker of a rayon pool, as `kvq-serve`'s engine
//! does: a thread outside the pool hands each parallel call to the pool's injector queue,
//! which allocates a block of slots every 63 calls. One test in this binary: the counter is
//! global.

use cap::Cap;
use kvq::cache::QuantizedKvCache;
use kvq_candle::model::{StepOptions, StepSeq, StepWorkspace};
use kvq_candle::tiny::TinyModel;

#[global_allocator]
static ALLOCATOR: Cap<std::alloc::System> = Cap::new(std::alloc::System, usize::MAX);

#[test]
fn warm_decode_steps_allocate_only_to_quantize_a_block() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(steps);
}

fn steps() {
    let (model, _) = TinyModel::default().load().unwrap();
    let config = model.config().cache_builder().block_size(16).blocks_per_layer(64).build().unwrap();
    let (sinks, block) = (config.sink_tokens, config.block_size);
    let mut cache = QuantizedKvCache::new(config).unwrap();
    let seqs: Vec<_> = (0..3).map(|_| cache.create()).collect();
    let mut ws = StepWorkspace::new();
    let options = StepOptions::default();
    let prompts: [&[u32]; 3] = [&[0, 40, 41, 42, 43, 44, 45], &[0, 50], &[0, 60, 61, 62, 63]];
    let batch: Vec<_> = seqs.iter().zip(prompts).map(|(&s, p)| StepSeq::new(s, p)).collect();
    model.step(&mut cache, &batch, &options, &mut ws).unwrap();
    let mut tokens = [70u32, 71, 72];
    // One greedy decode step of the three sequences; whether one of them completed a block.
    let mut step = |tokens: &mut [u32; 3]| {
        let lens = [0, 1, 2].map(|i| cache.len(seqs[i], 0).unwrap());
        let batch = [
            StepSeq::new(seqs[0], &tokens[0..1]),
            StepSeq::new(seqs[1], &tokens[1..2]),
            StepSeq::new(seqs[2], &tokens[2..3]),
        ];
        let logits = model.step(&mut cache, &batch, &options, &mut ws).unwrap();
        let vocab = logits.len() / 3;
        for (t, row) in tokens.iter_mut().zip(logits.chunks_exact(vocab)) {
            *t = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        }
        lens.iter().any(|&p| p >= sinks && (p - sinks + 1).is_multiple_of(block))
    };
    // Warm: every sequence past two quantized blocks, so that every buffer has its size.
    for _ in 0..2 * block + 8 {
        step(&mut tokens);
    }
    let (mut quiet, mut quantizing) = (0, 0);
    for i in 0..3 * block {
        let before = ALLOCATOR.total_allocated();
        let completes = step(&mut tokens);
        let allocated = ALLOCATOR.total_allocated() - before;
        if completes {
            quantizing += 1;
        } else {
            quiet += 1;
            assert_eq!(allocated, 0, "warm decode step {i} (no block completed) allocated {allocated} bytes");
        }
    }
    assert!(quiet >= 2 * block && quantizing >= 3, "{quiet} quiet steps, {quantizing} quantizing");
}
