//! Benchmarks live in benches/; this library holds what several of them set up alike.

use kvq_cache_layout::{CacheConfig, PagedCache};
use kvq_kernels_simd::Backend;
use kvq_quant_core::{ChannelBits, QuantSpec};

/// The fastest float backend of this CPU (AVX-512 has no float kernels of its own).
pub fn best_float() -> Backend {
    if Backend::Avx2.is_available() { Backend::Avx2 } else { Backend::Wide }
}

/// An empty one-layer cache of `kv_heads` heads of `head_dim` channels, blocks of 32 tokens,
/// room for `blocks` blocks, keys and values in the specs `k` and `v`; its pool advised for
/// huge pages before any block is written, as `QuantizedKvCache::new` does.
/// Keys with bits per channel (`-qa`) get [`ChannelBits::spread`]'s map in every head.
pub fn layer_cache(kv_heads: usize, head_dim: usize, blocks: usize, k: &str, v: &str) -> PagedCache {
    let k: QuantSpec = k.parse().unwrap();
    let mut config = CacheConfig::new(1, kv_heads, head_dim, blocks)
        .with_specs(k.clone(), v.parse().unwrap())
        .with_block_size(32);
    if k.channel_bits() {
        config = config.with_channel_bits(vec![ChannelBits::spread(head_dim, k.bits()).unwrap(); kv_heads]);
    }
    let cache = PagedCache::new(config).unwrap();
    kvq_kernels_simd::advise_huge_pages(cache.pool().arena());
    cache
}
