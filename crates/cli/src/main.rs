//! The `hooklatch` binary: parse flags, load config, set up tracing, run a library call,
//! turn the outcome into an exit code.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hooklatch::config::{self, LogFormat};
use tokio_util::sync::CancellationToken;

/// hooklatch — an idempotent webhook gateway.
///
/// Verifies each provider's signature, claims the provider's event id and queues the work in
/// one durable transaction, answers 2xx fast, and delivers to your application with retries,
/// a dead-letter and the same Idempotency-Key on every attempt.
#[derive(Debug, Parser)]
#[command(name = "hooklatch", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: ingest on server.listen, admin API on server.admin_listen.
    #[command(after_help = "\
Examples:
  # The embedded store and the example config:
  HOOKLATCH_ADMIN_TOKEN=dev-admin-token-0123456789 hooklatch serve --config examples/hooklatch.toml

  # Override any setting from the environment (SECTION__KEY):
  HOOKLATCH_SERVER__LISTEN=0.0.0.0:8080 hooklatch serve --config hooklatch.toml

Logs go to stderr; RUST_LOG sets the level (default info). Stop with ctrl-c or SIGTERM:
requests in flight finish, deliveries in flight finish or are handed back.")]
    Serve {
        /// The TOML configuration file (defaults apply without one).
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Check a configuration file (with the environment applied) and exit.
    #[command(after_help = "\
Examples:
  hooklatch check-config --config hooklatch.toml
  hooklatch check-config --print-defaults > hooklatch.toml   # every setting, documented")]
    CheckConfig {
        /// The TOML configuration file.
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the documented default configuration instead.
        #[arg(long)]
        print_defaults: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hooklatch: error: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let env: HashMap<String, String> = std::env::vars().collect();
    match cli.command {
        Command::Serve { config } => {
            let settings = config::load(config.as_deref(), &env)?;
            init_tracing(settings.log_format);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async {
                let cancel = CancellationToken::new();
                tokio::spawn(cancel_on_signal(cancel.clone()));
                hooklatch::serve(settings, cancel).await
            })
        }
        Command::CheckConfig {
            config,
            print_defaults,
        } => {
            if print_defaults {
                print!("{}", config::DEFAULT_CONFIG);
                return Ok(());
            }
            let settings = config::load(config.as_deref(), &env)?;
            println!(
                "configuration is valid: {} source(s), {} destination(s)",
                settings.sources.len(),
                settings.destinations.len()
            );
            Ok(())
        }
    }
}

fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn cancel_on_signal(cancel: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(%err, "cannot listen for SIGTERM");
                let _ = tokio::signal::ctrl_c().await;
                cancel.cancel();
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("ctrl-c received"),
            _ = term.recv() => tracing::info!("SIGTERM received"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    cancel.cancel();
}
