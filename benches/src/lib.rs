//! Benchmarks live in benches/; this library holds what several of them set up alike.

use kvq_cache_layout::{CacheConfig, PagedCache};
use kvq_kernels_simd::Backend;

/// The fastest float backend of this CPU (AVX-512 has no float kernels of its own).
pub fn best_float() -> Backend {
    if Backend::Avx2.is_available() { Backend::Avx2 } else { Backend::Wide }
}

/// An empty one-layer cache of `kv_heads` heads of `head_dim` channels, blocks of 32 tokens,
/// room for `blocks` blocks, keys and values in the specs `k` and `v`; its pool advised for
/// huge pages before any block is written, as `QuantizedKvCache::new` does.
pub fn layer_cache(kv_heads: usize, head_dim: usize, blocks: usize, k: &str, v: &str) -> PagedCache {
    let config = CacheConfig::new(1, kv_heads, head_dim, blocks)
        .with_specs(k.parse().unwrap(), v.parse().unwrap())
        .with_block_size(32);
    let cache = PagedCache::new(config).unwrap();
    kvq_kernels_simd::advise_huge_pages(cache.pool().arena());
    cache
}
