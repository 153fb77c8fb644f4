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
    /// Send a realistic, signed test event to a gateway (or any handler), as the provider would.
    #[command(after_help = "\
Examples:
  # A Stripe invoice.payment_succeeded, signed with the example config's secret:
  hooklatch send stripe --secret whsec_local_development_only --to http://127.0.0.1:8080/in/stripe

  # The same event id twice: the second answer says \"duplicate\"
  hooklatch send stripe --id evt_test_1 --secret whsec_local_development_only --to http://127.0.0.1:8080/in/stripe
  hooklatch send stripe --id evt_test_1 --secret whsec_local_development_only --to http://127.0.0.1:8080/in/stripe

  # A GitHub pull_request, the secret read from the environment:
  hooklatch send github --event pull_request --secret env:GITHUB_WEBHOOK_SECRET --to http://127.0.0.1:8080/in/github

  # What there is to send:
  hooklatch send --list")]
    Send(SendArgs),
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

#[derive(Debug, clap::Args)]
struct SendArgs {
    /// The provider: stripe, github, standard-webhooks, shopify, twilio, slack, whatsapp,
    /// discord, razorpay, paddle.
    #[arg(required_unless_present = "list")]
    provider: Option<String>,
    /// The event type (default: the provider's first, e.g. invoice.payment_succeeded).
    #[arg(long, value_name = "TYPE")]
    event: Option<String>,
    /// The event id (default: a fresh one shaped like the provider's).
    #[arg(long)]
    id: Option<String>,
    /// The signing secret: a literal, env:NAME or file:PATH.
    #[arg(long, required_unless_present = "list")]
    secret: Option<String>,
    /// Where to POST it, e.g. http://127.0.0.1:8080/in/stripe.
    #[arg(long, value_name = "URL", required_unless_present = "list")]
    to: Option<String>,
    /// Print the request (headers and body) before sending.
    #[arg(short, long)]
    verbose: bool,
    /// List the providers and event types there are.
    #[arg(long)]
    list: bool,
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
        Command::Send(args) => send(args, &env),
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

fn send(args: SendArgs, env: &HashMap<String, String>) -> anyhow::Result<()> {
    if args.list {
        for (provider, event_type) in hooklatch::fixtures::catalog() {
            println!("{provider:<20} {event_type}");
        }
        return Ok(());
    }
    let (Some(provider), Some(secret), Some(to)) = (args.provider, args.secret, args.to) else {
        anyhow::bail!("send needs a provider, --secret and --to");
    };
    let secret = config::read_secret("--secret", &secret, env, None)?;
    let event = hooklatch::fixtures::build(
        &provider,
        args.event.as_deref(),
        args.id.as_deref(),
        &secret,
        &to,
        hooklatch_core::Timestamp::now(),
    )?;
    if args.verbose {
        for (name, value) in &event.headers {
            eprintln!("> {name}: {value}");
        }
        eprintln!(">\n{}", String::from_utf8_lossy(&event.body));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (status, body) = runtime
        .block_on(async {
            let client = reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(std::time::Duration::from_secs(30))
                .build()?;
            let mut req = client.post(&to).body(event.body.clone());
            for (name, value) in &event.headers {
                req = req.header(name, value);
            }
            let res = req.send().await?;
            let status = res.status();
            let body = res.text().await?;
            Ok::<_, reqwest::Error>((status, body))
        })
        .with_context(|| format!("sending to {to}"))?;
    println!("sent {provider} {} {}", event.event_type, event.key);
    println!("{status}");
    if !body.is_empty() {
        println!("{body}");
    }
    if !status.is_success() {
        anyhow::bail!("the endpoint answered {status}");
    }
    Ok(())
}
