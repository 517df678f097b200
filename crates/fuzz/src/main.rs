//! `kvq-fuzz`: runs one target's mutation loop (see the library docs), or replays files.
//!
//! ```text
//! kvq-fuzz TARGET [--seconds N] [--inputs N] [--seed S] [--timeout-ms MS] [--limit-mib MIB] --out DIR
//! kvq-fuzz TARGET --replay FILE...
//! kvq-fuzz --list | --write-seeds DIR
//! ```
//! Before each input it writes the input to `DIR/current` (one positioned write), so that when
//! the process aborts (an allocation over the limit that was not fallible) or hangs (the
//! watchdog ends it past the time limit), the driver (`cargo xtask fuzz`) still has the input.
//! Panics are caught and their inputs saved as `DIR/panic-<crc>`. The last line sums the run:
//! `TARGET: N inputs, A accepted, P panics, C in corpus, S s` (for `gguf`, `N inputs (M
//! structure-aware)`); the exit code is 0 when no input panicked, 1 otherwise (3 for a hang,
//! the abort's own for an abort).

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvq::quant::synth::Rng;
use kvq_fuzz::{Target, mutate, signature};

/// Every allocation of the process counts against this limit (set in `main`): over it, a
/// fallible allocation fails with an error and an infallible one aborts.
#[global_allocator]
static ALLOC: cap::Cap<std::alloc::System> = cap::Cap::new(std::alloc::System, usize::MAX);

/// Milliseconds since the start at which the current input began (0: none running).
static STARTED: AtomicU64 = AtomicU64::new(0);

struct Args {
    target: Target,
    seconds: f64,
    inputs: u64,
    seed: u64,
    timeout_ms: u64,
    limit_mib: usize,
    out: PathBuf,
    replay: Vec<PathBuf>,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let first = it.next();
    if first.as_deref() == Some("--write-seeds") {
        // `kvq-fuzz --write-seeds DIR`: every target's seeds as files, to look at or replay.
        let dir = PathBuf::from(it.next().unwrap_or_else(|| "target/fuzz/seeds".into()));
        for t in Target::ALL {
            std::fs::create_dir_all(dir.join(t.name())).expect("seed directory");
            for (i, seed) in t.seeds().iter().enumerate() {
                std::fs::write(dir.join(t.name()).join(format!("seed-{i}")), seed).expect("write seed");
            }
        }
        std::process::exit(0);
    }
    if first.as_deref() == Some("--list") {
        for t in Target::ALL {
            println!("{}", t.name());
        }
        std::process::exit(0);
    }
    let name = first.ok_or("usage: kvq-fuzz TARGET [--seconds N] [--inputs N] [--seed S] [--timeout-ms MS] [--limit-mib MIB] --out DIR | --replay FILE...")?;
    let target = Target::from_name(&name).ok_or_else(|| {
        let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
        format!("unknown target {name:?} (targets: {})", names.join(", "))
    })?;
    let mut a = Args {
        target,
        seconds: 10.0,
        inputs: u64::MAX,
        seed: 1,
        timeout_ms: 5000,
        limit_mib: 2048,
        out: PathBuf::from("target/fuzz").join(name),
        replay: Vec::new(),
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<f64>().map_err(|_| format!("{flag} {v:?} is not a number"));
        match flag.as_str() {
            "--seconds" => a.seconds = num(value()?)?,
            "--inputs" => a.inputs = num(value()?)? as u64,
            "--seed" => a.seed = num(value()?)? as u64,
            "--timeout-ms" => a.timeout_ms = num(value()?)? as u64,
            "--limit-mib" => a.limit_mib = num(value()?)? as usize,
            "--out" => a.out = PathBuf::from(value()?),
            "--replay" => {
                a.replay.extend(it.by_ref().map(PathBuf::from));
            }
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(a)
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvq-fuzz: {e}");
            std::process::exit(2);
        }
    };
    // A failed input's panic message is reported once, by the loop, not by the default hook.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("kvq-fuzz: panic: {info}");
    }));
    // The CLI targets move the process into a scratch directory: paths given relative to
    // where it started are made absolute first.
    let mut args = args;
    let absolute = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
    args.replay = args.replay.iter().map(absolute).collect();
    args.out = absolute(&args.out);
    if !args.replay.is_empty() {
        let mut bad = 0;
        for p in &args.replay {
            let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            match std::panic::catch_unwind(|| args.target.run(&bytes)) {
                Ok(outcome) => println!("{}: {}", p.display(), signature(&outcome)),
                Err(_) => {
                    println!("{}: PANIC", p.display());
                    bad += 1;
                }
            }
        }
        std::process::exit(i32::from(bad > 0));
    }
    std::fs::create_dir_all(&args.out).expect("output directory");
    ALLOC.set_limit(args.limit_mib << 20).expect("limit above what is allocated");
    let clock = Instant::now();
    let timeout = args.timeout_ms;
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let started = STARTED.load(Ordering::Relaxed);
            let now = clock.elapsed().as_millis() as u64 + 1;
            if started > 0 && now - started > timeout {
                eprintln!("kvq-fuzz: an input ran over {timeout} ms (its bytes are in `current`)");
                std::process::exit(3);
            }
        }
    });
    let current = std::fs::File::create(args.out.join("current")).expect("current file");
    let target = args.target;
    let mut corpus: Vec<Vec<u8>> = target.seeds();
    let seeds = corpus.len();
    corpus.extend(target.regressions().into_iter().map(|(_, b)| b));
    let mut seen = std::collections::HashSet::new();
    let mut rng = Rng::new(args.seed);
    let (mut n, mut accepted, mut panics) = (0u64, 0u64, 0u64);
    let deadline = Duration::from_secs_f64(args.seconds);
    while n < args.inputs && clock.elapsed() < deadline {
        let base = &corpus[rng.below(corpus.len() as u64) as usize];
        let input = if n < corpus.len() as u64 {
            corpus[n as usize].clone()
        } else {
            mutate(target, &mut rng, base, &corpus)
        };
        let mut record = (input.len() as u64).to_le_bytes().to_vec();
        record.extend_from_slice(&input);
        current.write_all_at(&record, 0).expect("write current input");
        STARTED.store(clock.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
        let outcome = std::panic::catch_unwind(|| target.run(&input));
        STARTED.store(0, Ordering::Relaxed);
        n += 1;
        match outcome {
            Ok(outcome) => {
                accepted += u64::from(outcome.is_ok());
                if seen.insert(signature(&outcome)) || (outcome.is_ok() && rng.below(8) == 0) {
                    if corpus.len() < 1024 {
                        corpus.push(input);
                    } else {
                        // The seeds stay: valid inputs are what structure-aware mutators need.
                        let i = seeds + rng.below((corpus.len() - seeds) as u64) as usize;
                        corpus[i] = input;
                    }
                }
            }
            Err(_) => {
                panics += 1;
                let path = args.out.join(format!("panic-{:08x}", crc32fast::hash(&input)));
                std::fs::write(&path, &input).expect("write panic input");
                eprintln!("kvq-fuzz: saved {}", path.display());
            }
        }
        if n.is_multiple_of(100_000) {
            eprintln!(
                "kvq-fuzz: {}: {n} inputs, {:.0} s, {} MiB allocated",
                target.name(),
                clock.elapsed().as_secs_f64(),
                ALLOC.allocated() >> 20
            );
        }
    }
    let _ = std::fs::remove_file(args.out.join("current"));
    if matches!(target, kvq_fuzz::Target::Cli(_)) {
        let _ = std::fs::remove_dir_all(kvq_fuzz::cli::scratch_dir());
    }
    let structured = match target {
        kvq_fuzz::Target::Gguf => {
            format!(" ({} structure-aware)", kvq_fuzz::gguf_fields::MUTANTS.load(Ordering::Relaxed))
        }
        _ => String::new(),
    };
    let line = format!(
        "{}: {n} inputs{structured}, {accepted} accepted, {panics} panics, {} in corpus, {} signatures, {:.1} s",
        target.name(),
        corpus.len(),
        seen.len(),
        clock.elapsed().as_secs_f64()
    );
    println!("{line}");
    let _ = std::io::stdout().flush();
    std::process::exit(i32::from(panics > 0));
}
