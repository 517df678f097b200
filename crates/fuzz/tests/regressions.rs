//! Every committed regression input and every seed, through every target: none may panic,
//! each is decided (accepted and used, or refused) within seconds, and every seed is accepted.

use std::time::{Duration, Instant};

use kvq_fuzz::Target;

#[test]
fn seeds_are_accepted() {
    for target in Target::ALL {
        for (i, seed) in target.seeds().iter().enumerate() {
            target.run(seed).unwrap_or_else(|e| panic!("{} seed {i}: {e}", target.name()));
        }
    }
}

#[test]
fn regressions_are_decided_quickly_without_panics() {
    let mut n = 0;
    for target in Target::ALL {
        for (path, bytes) in target.regressions() {
            let start = Instant::now();
            let outcome = target.run(&bytes);
            assert!(start.elapsed() < Duration::from_secs(10), "{}: {:?}", path.display(), start.elapsed());
            eprintln!("{}: {}", path.display(), kvq_fuzz::signature(&outcome));
            n += 1;
        }
    }
    assert!(n >= 12, "only {n} regression inputs found");
}

/// A few thousand mutations per target, from a fixed seed: the loop itself works, and a
/// regression that a short run finds shows up in `cargo test`.
#[test]
fn a_short_fixed_run_finds_nothing() {
    for target in Target::ALL {
        let mut rng = kvq::quant::synth::Rng::new(7);
        let corpus = target.seeds();
        for _ in 0..2000 {
            let base = &corpus[rng.below(corpus.len() as u64) as usize];
            let input = kvq_fuzz::mutate(target, &mut rng, base, &corpus);
            let _ = target.run(&input);
        }
    }
}
