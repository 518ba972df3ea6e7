//! `rcoa orchestrate`: the meeting point of a data-parallel `rcoa run` over
//! several processes (burn-collective's global orchestrator, a WebSocket
//! server on all interfaces).
//!
//! Start it first, then one `rcoa run PLAN --nodes N --node-rank R
//! --orchestrator HOST:PORT --node-address HOST:PORT [--devices D]` per
//! process. One process alone (`rcoa run PLAN --devices D` without
//! `--nodes`) needs no orchestrator. It runs until
//! SIGINT/SIGTERM or `--timeout` seconds (burn-collective 0.21 does not tell
//! its caller when every rank has left, so it cannot stop by itself when the
//! run ends). Exit status: 0 stopped by a signal or the timeout, 2 cannot
//! listen on the port.

use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// Port to listen on (all interfaces).
    #[arg(long)]
    port: u16,
    /// Stop after this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 3600)]
    timeout: u64,
}

pub fn run(args: Args) -> ExitCode {
    eprintln!(
        "rcoa orchestrate: listening on port {} (stops on Ctrl-C, SIGTERM or after {} s)",
        args.port, args.timeout
    );
    match rcoa_backend::distributed::orchestrate(args.port, Duration::from_secs(args.timeout)) {
        Ok(timed_out) => {
            if timed_out {
                eprintln!("rcoa orchestrate: stopped after {} s", args.timeout);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}", rcoa_grammar::render::render_plain(&e));
            ExitCode::from(2)
        }
    }
}
