//! Adversarial-peer fuzz campaign (issue #11): hostile handshake payloads into the decoder and validator, and
//! hostile-but-well-formed metadata into `PeerPlan`, every remote row and move checked against what the peer
//! advertised. Run it under an address-space limit, so any unbounded allocation kills it:
//!
//! ```sh
//! (ulimit -v 4194304; cargo run --release --example fuzz_peer -- --payloads 1000000 --plans 200000 --seed 1)
//! ```
//!
//! Exit status: 0 when nothing escaped, 1 when a row or move fell outside, 2 for bad arguments. A panic or an
//! allocation failure ends the process (non-zero), which is the failure this campaign looks for.

use std::process::ExitCode;
use std::time::Instant;

use hybrid_kv::core::adversary::{fuzz, Report};

const USAGE: &str = "usage: fuzz_peer [--payloads N] [--plans N] [--seed S]
  --payloads N  handshake payloads to mutate and decode (default 1000000)
  --plans N     mutated metadata sets to hand to PeerPlan unvalidated (default 200000)
  --seed S      campaign seed (default 1); the same seed replays the same inputs";

fn parse() -> Result<(u64, u64, u64), String> {
    let (mut payloads, mut plans, mut seed) = (1_000_000u64, 200_000u64, 1u64);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let n: u64 = value
            .parse()
            .map_err(|_| format!("{flag} must be a non-negative integer, got {value:?}"))?;
        match flag.as_str() {
            "--payloads" => payloads = n,
            "--plans" => plans = n,
            "--seed" => seed = n,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok((payloads, plans, seed))
}

fn main() -> ExitCode {
    let (payloads, plans, seed) = match parse() {
        Ok(v) => v,
        Err(msg) if msg.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("error: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let start = Instant::now();
    let report: Report = fuzz(seed, payloads, plans, &mut |phase, done, r| {
        eprintln!("[{:>6.1} s] {phase}: {done} done; {r}", start.elapsed().as_secs_f64());
    });
    println!("seed {seed}: {report} in {:.1} s", start.elapsed().as_secs_f64());
    if report.rows_outside == 0 && report.moves_outside == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
