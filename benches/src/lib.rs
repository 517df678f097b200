//! Benchmarks live in benches/; this library holds what several of them set up alike.

use kvq_cache_layout::{CacheConfig, PagedCache};
use kvq_kernels_simd::{Backend, Kernels};
use kvq_quant_core::{ChannelBits, QuantSpec};

/// The fastest float backend of this CPU: AVX-512 where present (its own kernels for FP8
/// rows; every other float kernel there is the AVX2 one), else AVX2, else `wide`.
pub fn best_float() -> Kernels {
    [Backend::Avx512, Backend::Avx2].into_iter().find_map(|b| Kernels::new(b).ok()).unwrap_or(Kernels::WIDE)
}

/// The kernels of those of `backends` this CPU runs.
pub fn kernels_of(backends: &[Backend]) -> Vec<Kernels> {
    backends.iter().filter_map(|&b| Kernels::new(b).ok()).collect()
}

/// An empty one-layer cache of `kv_heads` heads of `head_dim` channels, blocks of 32 tokens,
/// room for `blocks` blocks, keys and values in the specs `k` and `v`; its pool advised for
/// huge pages before any block is written, as `QuantizedKvCache::new` does.
/// Keys with bits per channel (`-qa`) get [`ChannelBits::spread`]'s map in every head.
pub fn layer_cache(kv_heads: usize, head_dim: usize, blocks: usize, k: &str, v: &str) -> PagedCache {
    layer_cache_with(kv_heads, head_dim, blocks, k, v, |c| c)
}

/// [`layer_cache`] with its config changed by `f` first (a residual window, sinks, the
/// window's storage).
pub fn layer_cache_with(
    kv_heads: usize,
    head_dim: usize,
    blocks: usize,
    k: &str,
    v: &str,
    f: impl FnOnce(CacheConfig) -> CacheConfig,
) -> PagedCache {
    let k: QuantSpec = k.parse().unwrap();
    let mut config = CacheConfig::new(1, kv_heads, head_dim, blocks)
        .with_specs(k.clone(), v.parse().unwrap())
        .with_block_size(32);
    if k.channel_bits() {
        config = config.with_channel_bits(vec![ChannelBits::spread(head_dim, k.bits()).unwrap(); kv_heads]);
    }
    if k.pre_rope() {
        // Keys stored before RoPE: Llama's frequencies, rotate-half pairs.
        let rope =
            kvq_quant_core::Rope::from_theta(10_000.0, head_dim, kvq_quant_core::RopePairing::Half).unwrap();
        config = config.with_rope(rope);
    }
    let cache = PagedCache::new(f(config)).unwrap();
    kvq_kernels_simd::advise_huge_pages(cache.pool().arena());
    cache
}

/// Criterion's options that take a value (the next argument is not a filter).
const VALUED: &[&str] = &[
    "--warm-up-time",
    "--measurement-time",
    "--sample-size",
    "--save-baseline",
    "--baseline",
    "--baseline-lenient",
    "--load-baseline",
    "--output-format",
    "--plotting-backend",
    "--noise-threshold",
    "--confidence-level",
    "--significance-level",
    "--nresamples",
    "--profile-time",
    "--color",
    "--format",
    "--logfile",
    "-c",
];

/// The benchmark filter in a bench binary's arguments (`cargo bench -- FILTER`): the first
/// argument that is neither an option nor an option's value.
pub fn filter_in(args: &[String]) -> Option<&str> {
    let mut value_next = false;
    for a in args {
        if value_next {
            value_next = false;
        } else if a.starts_with('-') {
            value_next = VALUED.contains(&a.as_str());
        } else {
            return Some(a);
        }
    }
    None
}

/// Whether a group named `group` can hold a benchmark that `filter` selects, for groups whose
/// inputs take long to build (gigabytes of keys, whole caches). A filter is a regex that
/// criterion finds anywhere in `group/entry`. Each branch of its alternation ([`branches`])
/// is judged by the text every match of it begins with (the whole branch when it is plain
/// text, see [`required_literal`]): when that starts with one of `prefixes`, as group names
/// do, the branch selects only groups whose name contains it or that it starts with; any other
/// branch (a spec name, say, which appears in many groups' entries) may select any group.
pub fn group_wanted(filter: Option<&str>, group: &str, prefixes: &[&str]) -> bool {
    let Some(f) = filter else { return true };
    branches(f).into_iter().any(|b| match required_literal(b) {
        Some(lit) if prefixes.iter().any(|p| lit.starts_with(p)) => {
            group.contains(&lit) || lit.starts_with(&format!("{group}/"))
        }
        _ => true,
    })
}

/// The branches of the regex `re`'s alternation outside groups and classes (`a|b(c|d)`:
/// `a` and `b(c|d)`); `re` alone when it has none.
pub fn branches(re: &str) -> Vec<&str> {
    let (mut out, mut from) = (Vec::new(), 0);
    let (mut depth, mut class, mut escaped) = (0usize, false, false);
    for (i, c) in re.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '[' if !class => class = true,
            ']' if class => class = false,
            '(' if !class => depth += 1,
            ')' if !class => depth = depth.saturating_sub(1),
            '|' if !class && depth == 0 => {
                out.push(&re[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    out.push(&re[from..]);
    out
}

/// The literal text that every match of the regex `re` begins with: its characters up to the
/// first one with a meaning in a regex (less the last, when that is a quantifier that can
/// repeat it zero times), after a leading `^`. `None` when there is none, or when `re` has
/// more than one of [`branches`] (they need not share that text).
pub fn required_literal(re: &str) -> Option<String> {
    const META: &[char] = &['\\', '.', '^', '$', '*', '+', '?', '(', ')', '[', ']', '{', '}', '|'];
    if branches(re).len() > 1 {
        return None;
    }
    let body = re.strip_prefix('^').unwrap_or(re);
    let mut lit: String = body.chars().take_while(|c| !META.contains(c)).collect();
    if matches!(body[lit.len()..].chars().next(), Some('*' | '?' | '{')) {
        lit.pop();
    }
    (!lit.is_empty()).then_some(lit)
}

/// [`group_wanted`] with this process's filter.
pub fn wanted(group: &str, prefixes: &[&str]) -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    group_wanted(filter_in(&args), group, prefixes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_filter_is_the_first_argument_that_is_no_option_or_value() {
        assert_eq!(filter_in(&args(&["--bench"])), None);
        assert_eq!(filter_in(&args(&["--bench", "decode_llama3"])), Some("decode_llama3"));
        assert_eq!(
            filter_in(&args(&["--warm-up-time", "0.5", "--save-baseline", "x", "--bench", "scores_4096"])),
            Some("scores_4096")
        );
        assert_eq!(filter_in(&args(&["--sample-size", "20", "--noplot"])), None);
    }

    #[test]
    fn a_filter_naming_a_group_skips_the_others_and_no_other_filter_does() {
        let p = &["decode_", "scores_", "axpy_", "stream_"];
        let g4 = "decode_llama3_8b_layer_4k";
        let g32 = "decode_llama3_8b_layer_32k";
        assert!(group_wanted(None, g32, p));
        assert!(group_wanted(Some(g4), g4, p));
        assert!(!group_wanted(Some(g4), g32, p));
        assert!(group_wanted(Some("decode_llama3"), g32, p));
        assert!(!group_wanted(Some("decode_llama3"), "scores_dram_8388608x128", p));
        assert!(group_wanted(Some("decode_llama3_8b_layer_4k/f16_gqa"), g4, p));
        assert!(!group_wanted(Some("decode_llama3_8b_layer_4k/f16_gqa"), g32, p));
        // Names of entries may select entries of any group.
        assert!(group_wanted(Some("int4-channel"), g32, p));
    }

    #[test]
    fn a_regex_selects_groups_by_the_text_its_matches_begin_with() {
        let p = &["decode_", "scores_", "axpy_", "stream_"];
        let (s4k, sdram) = ("scores_4096x128", "scores_dram_8388608x128");
        let f = "scores_4096x128/int4-(channel|token)/avx512-int8$";
        assert!(group_wanted(Some(f), s4k, p));
        assert!(!group_wanted(Some(f), sdram, p));
        assert!(!group_wanted(Some(f), "scores_4096x64", p));
        assert!(!group_wanted(Some(f), "decode_llama3_8b_layer_32k", p));
        assert!(!group_wanted(Some("^stream_read"), sdram, p));
        assert!(group_wanted(Some("^stream_read"), "stream_read_512MiB", p));
        // `decode_` then anything: every decode group, no other.
        assert!(group_wanted(Some("decode_.*4k"), "decode_llama3_8b_layer_32k", p));
        assert!(!group_wanted(Some("decode_.*4k"), s4k, p));
        // Each branch of an alternation selects its own groups.
        let two = Some("stream_read|scores_dram_8388608x128/int4-channel/avx512-int8$");
        assert!(group_wanted(two, "stream_read_512MiB", p));
        assert!(group_wanted(two, sdram, p));
        assert!(!group_wanted(two, s4k, p));
        assert!(!group_wanted(two, "decode_llama3_8b_layer_32k", p));
        assert!(group_wanted(Some("scores_4096x128|decode_"), "decode_llama3_8b_layer_4k", p));
        assert!(!group_wanted(Some("scores_4096x128|decode_"), sdram, p));
        assert!(group_wanted(Some("scores_4096x128|int4"), sdram, p));
        // Groups, optional characters and entry names may select any group.
        assert!(group_wanted(Some("(scores|axpy)_dram"), sdram, p));
        assert!(group_wanted(Some("scores_dram_8388608x128?/f32"), "scores_dram_8388608x12", p));
        assert!(group_wanted(Some(".*dram"), sdram, p));
        assert!(group_wanted(Some("int4-(channel|token)"), sdram, p));
    }

    #[test]
    fn the_same_test_selects_the_entries_of_a_group_worth_building() {
        // The benches ask for `group/spec` (and `group/keys/values`) before building its inputs.
        let p = &["decode_", "scores_", "axpy_", "stream_"];
        let one = Some("scores_dram_8388608x128/int4-channel/avx512-int8$");
        assert!(group_wanted(one, "scores_dram_8388608x128/int4-channel", p));
        assert!(!group_wanted(one, "scores_dram_8388608x128/int8-channel", p));
        assert!(!group_wanted(one, "scores_dram_8388608x128/f32", p));
        assert!(group_wanted(Some("scores_dram_8388608x128"), "scores_dram_8388608x128/f16", p));
        assert!(group_wanted(Some("scores_dram_8388608x128/int"), "scores_dram_8388608x128/int2-token", p));
        // A key spec that another begins with: the entries of both can match.
        let kv = Some("decode_llama3_8b_layer_4k/int4-channel/int4-token");
        assert!(group_wanted(kv, "decode_llama3_8b_layer_4k/int4-channel/int4-token-mse-rot", p));
        assert!(!group_wanted(kv, "decode_llama3_8b_layer_4k/int4-channel32-p8/int4-g32-mse-rot-p8", p));
    }

    #[test]
    fn the_required_literal_stops_at_the_first_metacharacter() {
        assert_eq!(
            required_literal("scores_4096x128/int4-(channel|token)$").as_deref(),
            Some("scores_4096x128/int4-")
        );
        assert_eq!(required_literal("^decode_llama3.*").as_deref(), Some("decode_llama3"));
        assert_eq!(required_literal("scores_x?").as_deref(), Some("scores_"));
        assert_eq!(required_literal("scores_x{0,2}").as_deref(), Some("scores_"));
        assert_eq!(required_literal("scores_x+").as_deref(), Some("scores_x"));
        assert_eq!(required_literal("scores_\\d").as_deref(), Some("scores_"));
        assert_eq!(required_literal("plain").as_deref(), Some("plain"));
        assert_eq!(required_literal("a|b"), None);
        assert_eq!(branches("a|b(c|d)|[|]e|f\\|g"), vec!["a", "b(c|d)", "[|]e", "f\\|g"]);
        assert_eq!(branches("plain"), vec!["plain"]);
        assert_eq!(branches("a|"), vec!["a", ""]);
        assert_eq!(required_literal("a[|]b").as_deref(), Some("a"));
        assert_eq!(required_literal("a\\|b").as_deref(), Some("a"));
        assert_eq!(required_literal("(?i)scores"), None);
        assert_eq!(required_literal(".*"), None);
        assert_eq!(required_literal("x*"), None);
    }
}
