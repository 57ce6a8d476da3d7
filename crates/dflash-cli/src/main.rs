//! The `dflash` command line: a thin surface over the `dflash` library.

mod bench;
mod doctor;
mod flags;
mod generate;
mod models;
mod serve;
mod train;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "dflash", version, about = "DFlash speculative decoding engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text (or token ids) from a prompt, with or without a DFlash draft.
    Generate(generate::GenerateArgs),
    /// What this build can do, and why a model would not run.
    Doctor {
        #[command(flatten)]
        m: flags::ModelFlags,
        /// CUDA builds: time one candle op on the host and the bf16 projections at the
        /// Qwen3-8B shapes (cuBLAS vs dflash's GEMV kernel) on --device (default cuda:0).
        #[arg(long)]
        gpu_probe: bool,
    },
    /// List the DFlash draft registry and whether this build supports each target family.
    Models {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Serve the OpenAI API (chat completions, completions, models) over HTTP.
    Serve(serve::ServeArgs),
    /// Benchmark DFlash against plain decoding (same engine): one pair, a matrix, or --micro.
    Bench(bench::BenchArgs),
    /// Train a DFlash draft for a target (z-lab format; loads with `generate --draft DIR`).
    Train(train::TrainArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DFLASH_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Command::Generate(a) => generate::run(a),
        Command::Doctor { m, gpu_probe } => {
            if gpu_probe {
                doctor::gpu_probe(m.load.device)
            } else {
                doctor::run(m)
            }
        }
        Command::Models { json } => models::run(json),
        Command::Serve(a) => serve::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Train(a) => train::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
