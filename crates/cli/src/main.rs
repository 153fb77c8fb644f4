//! The `hooklatch` binary: parse flags, load config, set up tracing, run a library call,
//! turn the outcome into an exit code.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hooklatch::admin::{AdminClient, HistoryFilter, DEFAULT_ADMIN_URL};
use hooklatch::check::{CheckInput, CheckOptions};
use hooklatch::config::{self, AdminSettings, LogFormat, Settings};
use hooklatch::effect::EffectProbe;
use hooklatch::replay::{ReplayOptions, SignMode, Signer, Signing, Target};
use hooklatch_core::Timestamp;
use tokio_util::sync::CancellationToken;

/// mimalloc for the whole binary: many short-lived buffers per request (bodies, headers,
/// JSON); +5 % ingest alone and +18 % with delivery in a same-run A/B (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// hooklatch — an idempotent webhook gateway.
///
/// Verifies each provider's signature, claims the provider's event id and queues the work in
/// one durable transaction, answers 2xx fast, and delivers to your application with retries,
/// a dead-letter and the same Idempotency-Key on every attempt.
#[derive(Debug, Parser)]
#[command(
    name = "hooklatch",
    version,
    propagate_version = true,
    after_help = "Examples:
  # Run the gateway on the embedded store
  HOOKLATCH_ADMIN_TOKEN=dev-admin-token-0123456789 hooklatch serve --config hooklatch.toml

  # Send it a signed test event, then look at what the gateway kept
  hooklatch send stripe --id evt_1 --secret whsec_local_development_only \\
      --to http://127.0.0.1:8080/in/stripe
  hooklatch events list --config hooklatch.toml

Every verb has its own --help with examples."
)]
struct Cli {
    /// CA certificates (PEM) to trust besides the built-in roots when this command connects
    /// over HTTPS: to a gateway, its admin API, or a local app on a private CA's certificate.
    /// The gateway's own deliveries use each destination's ca_file instead.
    #[arg(long, global = true, value_name = "FILE", env = "HOOKLATCH_CA_FILE")]
    ca_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: ingest on server.listen, admin API on server.admin_listen.
    #[command(after_help = "\
Examples:
  # The embedded store and the example config:
  HOOKLATCH_ADMIN_TOKEN=dev-admin-token-0123456789 hooklatch serve \\
      --config examples/hooklatch.toml

  # Override any setting from the environment (SECTION__KEY):
  HOOKLATCH_SERVER__LISTEN=0.0.0.0:8080 hooklatch serve --config hooklatch.toml

  # HTTPS on the public listener, the certificate read again after a renewal:
  HOOKLATCH_SERVER__TLS_CERT=/etc/letsencrypt/live/hooks.example.com/fullchain.pem \\
  HOOKLATCH_SERVER__TLS_KEY=file:/etc/letsencrypt/live/hooks.example.com/privkey.pem \\
  hooklatch serve --config hooklatch.toml
  kill -HUP \"$(pgrep -x hooklatch)\"

Logs go to stderr; RUST_LOG sets the level (default info). Stop with ctrl-c or SIGTERM:
/readyz says \"shutting down\", requests in flight finish, deliveries in flight finish or are
handed back; a second ctrl-c or SIGTERM stops at once (exit status 130; what was in flight
goes out again, as after a crash). With server.tls_cert, SIGHUP reads the certificate and
key again.")]
    Serve {
        /// The TOML configuration file (defaults apply without one).
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Start even when the PostgreSQL store's settings can lose acknowledged events
        /// (fsync, full_page_writes or synchronous_commit off): a warning at every start and
        /// the gauge hooklatch_unsafe_durability = 1. For throwaway test databases only.
        #[arg(long, env = "HOOKLATCH_ALLOW_UNSAFE_DURABILITY")]
        allow_unsafe_durability: bool,
    },
    /// Send a realistic, signed test event to a gateway (or any handler), as the provider would.
    #[command(after_help = "\
Examples:
  # A Stripe invoice.payment_succeeded, signed with the example config's secret:
  hooklatch send stripe --secret whsec_local_development_only \\
      --to http://127.0.0.1:8080/in/stripe

  # The same event id twice: the second answer says \"duplicate\"
  hooklatch send stripe --id evt_test_1 --secret whsec_local_development_only \\
      --to http://127.0.0.1:8080/in/stripe
  hooklatch send stripe --id evt_test_1 --secret whsec_local_development_only \\
      --to http://127.0.0.1:8080/in/stripe

  # A GitHub pull_request, the secret read from the environment:
  hooklatch send github --event pull_request --secret env:GITHUB_WEBHOOK_SECRET \\
      --to http://127.0.0.1:8080/in/github

  # Twilio behind a proxy: signed for the URL Twilio calls (the source's public_url):
  hooklatch send twilio --secret env:TWILIO_AUTH_TOKEN --to http://127.0.0.1:8080/in/twilio \\
      --public-url https://hooks.example.com

  # What there is to send:
  hooklatch send --list

Exit status: 0 when the answer was 2xx, 1 when it was another status (the answer is printed),
2 when nothing could be sent.")]
    Send(SendArgs),
    /// Receive a gateway's events on this machine: connect to a `listen` destination and send
    /// each delivery on to a local URL, byte-exact.
    #[command(after_help = "\
Examples:
  # The gateway's config has a destination for this laptop:
  #   [[destinations]]
  #   name = \"laptop\"
  #   listen_token = \"env:HOOKLATCH_LISTEN_TOKEN\"
  # and a source delivering to it. On the laptop, with the same token:
  HOOKLATCH_LISTEN_TOKEN=... hooklatch listen laptop \\
    --gateway https://hooks.example.com --forward-to http://127.0.0.1:3000/webhooks/stripe

  # Against a gateway on this machine started with examples/listen.toml:
  HOOKLATCH_LISTEN_TOKEN=dev-listen-token-0123456789 hooklatch listen laptop \\
    --gateway http://127.0.0.1:8080 --forward-to http://127.0.0.1:3000/webhooks/stripe

Each line printed is one delivery: the local status (or ERR and why), its dlv_ id and attempt,
its Idempotency-Key, its event type and how long the local URL took. Deliveries keep their
original headers and body, plus Idempotency-Key and the hooklatch-* headers (and a Standard
Webhooks signature when the destination has a secret). A non-2xx answer is retried by the
gateway's policy. Events that arrive while this is not running wait in the gateway's outbox and
come on reconnect. Stop with ctrl-c. Exit status: 2 when the gateway refuses the token or the
destination, or another listener takes the destination over.")]
    Listen(ListenArgs),
    /// Send a captured delivery again, N times, K at once: at a handler, or through the gateway.
    #[command(after_help = "\
Examples:
  # Request req_42 from the local gateway's history, ten times at once, at your handler,
  # re-signed with the source's secret from the gateway's config (fresh timestamps):
  hooklatch replay req_42 --config hooklatch.toml \\
      --to http://127.0.0.1:3000/webhooks/stripe --times 10 --concurrency 10

  # The request behind delivery dlv_7, through the gateway's ingest: the first may be
  # accepted, the rest must come back \"duplicate\":
  hooklatch replay dlv_7 --config hooklatch.toml --via-gateway --times 5

  # A capture exported from production, on a laptop, signed with a local secret:
  hooklatch replay prod.json --provider stripe --secret env:STRIPE_WEBHOOK_SECRET \\
      --to http://127.0.0.1:3000/webhooks/stripe

  # Request req_42's bytes exactly as captured, its signature too (an old Stripe event is
  # then refused as stale; an export file keeps signatures only with --keep-signatures):
  hooklatch replay req_42 --config hooklatch.toml --original --via-gateway

Ids are looked up on the admin API (--admin, default http://127.0.0.1:8081, or the config's
server.admin_listen) with --token / HOOKLATCH_ADMIN_TOKEN. Exit status: 0 when every response
was 2xx, 1 when any was not, 2 when the replay could not run.")]
    Replay(ReplayArgs),
    /// The idempotency harness: deliver one event sequentially, concurrently, late and
    /// conflicting, count the handler's effects, and explain any that are too many.
    #[command(after_help = "\
Examples:
  # A Stripe invoice.payment_succeeded, 10 times in a row, then a fresh one 10 times at once,
  # then a late replay; the handler's effects counted in its SQLite database:
  hooklatch check --provider stripe --secret whsec_local_development_only \\
    --to http://127.0.0.1:3000/webhooks/stripe --times 10 --concurrency 10 \\
    --effects-sql \"SELECT count(*) FROM credits WHERE event_id = :key\" --db sqlite://app.db

  # The same against PostgreSQL, plus a conflicting body, in CI (exit status 1 on failure):
  hooklatch check --provider stripe --secret env:STRIPE_WEBHOOK_SECRET \\
    --to http://127.0.0.1:3000/webhooks/stripe \\
    --effects-sql \"SELECT count(*) FROM credits WHERE event_id = :key\" \\
    --db postgres://app@localhost/app --conflict --json

  # A captured production event, effects counted by a command (the key is in $HOOKLATCH_KEY):
  hooklatch check --capture prod.json --config hooklatch.toml \\
    --to http://127.0.0.1:3000/webhooks/stripe \\
    --effects-cmd \\
    'psql -tA -c \"SELECT count(*) FROM credits WHERE event_id = '\\''$HOOKLATCH_KEY'\\''\" app'

  # A handler behind hooklatch that verifies the gateway's signature: send as it delivers,
  # signed with the destination's secret:
  hooklatch check --provider stripe --secret whsec_local_development_only \\
    --destination-secret env:APP_WEBHOOK_SECRET --to http://127.0.0.1:3000/webhooks/stripe \\
    --effects-sql \"SELECT count(*) FROM credits WHERE event_id = :key\" --db sqlite://app.db

:key is a bind parameter (the event's key, as text), never pasted into the SQL. Exit status: 0
when every phase passed, 1 when one failed, 2 when the check could not run.")]
    Check(CheckArgs),
    /// Load-test a running gateway's ingest: throughput, latency percentiles, the server's
    /// memory, beside the machine's HTTP ceiling; and end-to-end delivery.
    #[command(after_help = "\
Examples:
  # 10,000 pre-signed Stripe events, 10 % duplicates, 64 in flight, beside the HTTP ceiling,
  # with the gateway's peak memory:
  hooklatch bench --target http://127.0.0.1:8080 --secret whsec_local_development_only \\
    --events 10000 --duplicates 0.1 --body-size 2048 --concurrency 64 --baseline \\
        --pid \"$(pgrep -n hooklatch)\"

  # Open loop at 2,000 requests/s for 10 s (latency from each request's due time):
  hooklatch bench --target http://127.0.0.1:8080 --secret whsec_local_development_only \\
      --rate 2000 --duration 10s --events 20000

  # The same after 2 s of the same load that is not counted (a gateway's steady state):
  hooklatch bench --target http://127.0.0.1:8080 --secret whsec_local_development_only \\
      --rate 2000 --warmup 2s --duration 10s --events 20000

  # End-to-end delivery: the gateway's destination is http://127.0.0.1:9090/sink
  hooklatch bench --target http://127.0.0.1:8080 --secret whsec_local_development_only \\
      --events 5000 --sink-listen 127.0.0.1:9090

  # How fast a backlog drains: queue 20,000 events on a gateway with delivery off, then start
  # the sink, then the gateway again with delivery on (its destination http://127.0.0.1:9090/sink):
  hooklatch bench --drain 20000 --sink-listen 127.0.0.1:9090 --sink-wait 120s

  # For scripts (bench/run builds its table from this):
  hooklatch bench --target http://127.0.0.1:8080 --secret whsec_local_development_only \\
      --events 200 --json

Duplicates are a share of all requests: byte-identical copies, half sent right behind their
original, half after it was answered. Exit status: 0 when every request was answered 200 (with
--drain: when every event arrived), 1 when any was not, 2 when the bench could not run.")]
    Bench(BenchArgs),
    /// Work with the gateway's history of events.
    #[command(after_help = "Examples:
  hooklatch events list --source stripe --verdict conflict --config hooklatch.toml
  hooklatch events export req_12 --out capture.json --config hooklatch.toml")]
    Events {
        #[command(subcommand)]
        command: EventsCommand,
    },
    /// Work with the dead-letter: deliveries that ran out of attempts.
    #[command(after_help = "Examples:
  hooklatch dlq list --config hooklatch.toml
  hooklatch dlq retry dlv_7 --config hooklatch.toml
  hooklatch dlq retry --all --destination app --config hooklatch.toml")]
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// See and change which destinations are disabled: a destination that answers 410 Gone is
    /// disabled, and its deliveries wait, uncounted, until it is enabled.
    #[command(after_help = "Examples:
  hooklatch destinations list --config hooklatch.toml
  hooklatch destinations enable app --config hooklatch.toml")]
    Destinations {
        #[command(subcommand)]
        command: DestinationsCommand,
    },
    /// Create or upgrade the store's tables, then exit (serve does it too, at start).
    #[command(after_help = "\
Examples:
  # Before rolling out a new version to several instances on one PostgreSQL:
  hooklatch migrate --config hooklatch.toml

  HOOKLATCH_STORE__URL=postgres://hooklatch@db.internal/hooklatch hooklatch migrate \\
      --config hooklatch.toml

Safe to run while instances are serving and from several places at once (an advisory lock
serializes migrations on PostgreSQL).")]
    Migrate {
        /// The TOML configuration file (for its store url).
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Check a configuration file (with the environment applied) and exit; with --connect,
    /// contact the services it names too.
    #[command(after_help = "\
Examples:
  hooklatch check-config --config hooklatch.toml
  hooklatch check-config --print-defaults > hooklatch.toml   # every setting, documented

  # Before a rollout (an init container, a deploy script): the store and key store answer,
  # PostgreSQL's durability settings pass, and each destination is reachable:
  hooklatch check-config --connect --config hooklatch.toml

--connect changes nothing: PostgreSQL is read (its durability settings, its schema version),
a SQLite file's directory is written to once (a file made and removed), Redis is pinged,
each RabbitMQ destination connected to, each HTTP destination sent a HEAD.

Exit status: 0 when valid (with --connect: and the store and key store answer as serve needs;
a destination that does not answer is a warning, as serve starts without it), 1 when they do
not, 2 when the configuration is invalid.")]
    CheckConfig {
        /// The TOML configuration file.
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the documented default configuration instead.
        #[arg(long)]
        print_defaults: bool,
        /// Contact the store, the key store and each destination, changing nothing.
        #[arg(long, conflicts_with = "print_defaults")]
        connect: bool,
        /// As serve's: PostgreSQL settings that can lose acknowledged events are a warning
        /// with --connect, not a failure.
        #[arg(long, env = "HOOKLATCH_ALLOW_UNSAFE_DURABILITY")]
        allow_unsafe_durability: bool,
    },
}

#[derive(Debug, clap::Args)]
struct ListenArgs {
    /// The gateway's `listen` destination to receive.
    destination: String,
    /// The gateway's public base URL (where it serves /in/...).
    #[arg(long, value_name = "URL", value_parser = http_url, default_value = "http://127.0.0.1:8080")]
    gateway: String,
    /// The destination's listen_token: a literal, env:NAME or file:PATH.
    #[arg(
        long,
        value_name = "TOKEN",
        default_value = "env:HOOKLATCH_LISTEN_TOKEN"
    )]
    token: String,
    /// Where to POST each delivery on this machine.
    #[arg(long, value_name = "URL", value_parser = http_url)]
    forward_to: String,
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
    /// The event id (default: a fresh one shaped like the provider's): visible ASCII without
    /// spaces, quotes or backslashes, as providers send.
    #[arg(long)]
    id: Option<String>,
    /// The signing secret: a literal, env:NAME or file:PATH.
    #[arg(long, required_unless_present = "list")]
    secret: Option<String>,
    /// Where to POST it, e.g. http://127.0.0.1:8080/in/stripe.
    #[arg(long, value_name = "URL", value_parser = http_url, required_unless_present = "list")]
    to: Option<String>,
    /// Twilio signs the URL it calls: sign for this one (the source's public_url, a base or
    /// the whole URL when a proxy maps its path) instead of --to's.
    #[arg(long, value_name = "URL")]
    public_url: Option<String>,
    /// Print the request (headers and body) before sending.
    #[arg(short, long)]
    verbose: bool,
    /// List the providers and event types there are.
    #[arg(long)]
    list: bool,
}

#[derive(Debug, Subcommand)]
enum EventsCommand {
    /// List the gateway's history, newest first: each request's id, arrival, source, verdict
    /// (with the refusal's code), answer, event keys and size.
    #[command(after_help = "\
Examples:
  # The last 20 requests on the local gateway (admin address and token from the config):
  hooklatch events list --config hooklatch.toml

  # Conflicts of the last day, as JSON lines for scripts:
  hooklatch events list --verdict conflict --since 24h --json --config hooklatch.toml

  # Everything the gateway kept about one event key:
  hooklatch events list --key evt_1QXk2LkdIwHu7ix --config hooklatch.toml

Then `hooklatch events export req_N` for a request's headers and body, or the web inspector at
the admin address.")]
    List(ListArgs),
    /// Write captured requests (byte-exact body, headers, metadata; never a secret) to a
    /// JSON file that `replay` and `check` read.
    #[command(after_help = "\
Examples:
  # Two requests from the local gateway:
  hooklatch events export req_41 req_42 --out captures.json

  # The last day's accepted Stripe events (at most 100), providers named from the config:
  hooklatch events export --source stripe --verdict accepted --since 24h \\
      --config hooklatch.toml --out stripe.json

  # Then, anywhere:
  hooklatch replay stripe.json --provider stripe --secret env:STRIPE_WEBHOOK_SECRET \\
      --to http://127.0.0.1:3000/webhooks/stripe

  # With the provider's signature headers, to send a capture exactly as received (--original):
  hooklatch events export req_41 --keep-signatures --out captured.json

Authorization, Proxy-Authorization and Cookie headers are always left out. So are the
providers' signature headers unless --keep-signatures: where a provider signs no timestamp
(GitHub, Shopify, Twilio, ...) a signature never expires, and a file passed around could be
re-sent as new once its key has expired. Give --config so a generic source's own signature
header is known too; replay re-signs with the source's secret.")]
    Export(ExportArgs),
    /// Import an export file's captures into a gateway's history (verdict "imported"), to
    /// replay or redeliver them there, e.g. production events on a laptop.
    #[command(after_help = "\
Examples:
  # On production: export; on the laptop: import, then deliver one to the local handler.
  hooklatch events export req_41 --config prod.toml --out captures.json
  hooklatch events import captures.json --config hooklatch.toml
  hooklatch events redeliver req_7 --config hooklatch.toml

Each capture's source must exist on the importing gateway, and its body fit its body_limit.
Nothing is claimed or queued by the import itself; the whole file is checked before anything
is stored. A capture imported before (same source, keys and body) is not stored twice: its
first import's id is printed, marked \"(imported before)\".")]
    Import {
        /// The export file.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Deliver a request's events again on purpose, bypassing dedup: new deliveries with their
    /// own ids and the original Idempotency-Key, so the handler's guard still decides.
    #[command(after_help = "\
Examples:
  # Deliver req_42's event again to every destination of its source:
  hooklatch events redeliver req_42 --config hooklatch.toml

  # Only to one destination, on another gateway:
  hooklatch events redeliver req_42 --destination app --admin http://10.0.0.5:8081 \\
      --token \"$TOKEN\"

Every call queues anew (nothing is swallowed as a duplicate); the handler sees the same
Idempotency-Key as the first delivery, so a guarded handler changes nothing. A conflict (the
same event id with a different body, never processed) is released this way as a new event,
under its own key: {source}:{key}:req_N; a dismissed conflict is not.

Exit status: 0 when queued, 1 when the gateway refused (no such request, nothing to
redeliver, a dismissed conflict), 2 when it could not be asked.")]
    Redeliver {
        /// The request (req_N), as listed by the admin API.
        #[arg(value_name = "REQUEST")]
        request: String,
        /// Only this destination (default: all of the source's).
        #[arg(long)]
        destination: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Dismiss a conflict: record that its body will not be processed. The first decision
    /// stands: a dismissed conflict is never released, a released one is not dismissed.
    #[command(after_help = "\
Examples:
  # The conflicts waiting for a decision:
  hooklatch events list --verdict conflict --config hooklatch.toml

  hooklatch events dismiss req_57 --reason \"test-mode resend with a changed amount\" \\
      --config hooklatch.toml

Exit status: 0 when dismissed, 1 when the request is not there or not an undecided conflict,
2 when the gateway could not be asked.")]
    Dismiss {
        /// The conflict (req_N).
        #[arg(value_name = "REQUEST")]
        request: String,
        /// Why, kept with the decision (at most 200 characters).
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// List dead-lettered deliveries, newest first, with their last error.
    #[command(after_help = "\
Examples:
  hooklatch dlq list --config hooklatch.toml
  hooklatch dlq list --destination app --limit 20 --json")]
    List {
        /// Only this destination.
        #[arg(long)]
        destination: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50, value_parser = at_least_one)]
        limit: usize,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Put dead-lettered deliveries back in the queue (same Idempotency-Key, fresh attempts).
    #[command(after_help = "\
Examples:
  hooklatch dlq retry dlv_17 dlv_18 --config hooklatch.toml
  hooklatch dlq retry --all --destination app --config hooklatch.toml

Exit status: 0 when every delivery was queued again, 1 when the gateway refused any (not there,
not dead-lettered), 2 when it could not be asked (what was queued before is printed).")]
    Retry {
        /// The deliveries (dlv_N).
        #[arg(value_name = "DELIVERY", required_unless_present = "all")]
        ids: Vec<String>,
        /// Every dead-lettered delivery (of --destination, if given).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only this destination.
        #[arg(long, requires = "all")]
        destination: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Debug, Subcommand)]
enum DestinationsCommand {
    /// List the configured destinations: kind, enabled or disabled (since when, and why).
    #[command(after_help = "\
Examples:
  hooklatch destinations list --config hooklatch.toml
  hooklatch destinations list --json")]
    List {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Hold a destination's deliveries: they stay queued, uncounted, until it is enabled (for
    /// a maintenance window, or an endpoint being moved).
    #[command(after_help = "\
Examples:
  hooklatch destinations disable app --reason \"moving to the new cluster\" \\
      --config hooklatch.toml

Exit status: 0 when disabled, 1 when the destination is not there, 2 when the gateway could
not be asked.")]
    Disable {
        /// The destination's name.
        name: String,
        /// Why, shown by `destinations list` (at most 200 characters).
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Enable a disabled destination: every delivery it held is due at once, with the same
    /// Idempotency-Key as before.
    #[command(after_help = "\
Examples:
  # The endpoint answered 410 Gone and has been fixed:
  hooklatch destinations enable app --config hooklatch.toml

Exit status: 0 when enabled, 1 when it was not disabled or is not there, 2 when the gateway
could not be asked.")]
    Enable {
        /// The destination's name.
        name: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

/// Where history comes from: a running gateway's admin API.
#[derive(Debug, clap::Args)]
struct AdminArgs {
    /// The gateway's admin API (default: the config's server.admin_listen, https:// with
    /// server.admin_tls, else http://127.0.0.1:8081).
    #[arg(long, value_name = "URL", value_parser = http_url)]
    admin: Option<String>,
    /// The admin token (default: the config's server.admin_token).
    #[arg(long, env = "HOOKLATCH_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The gateway's configuration: its admin address and token; for `replay` and `check`
    /// its sources' secrets too (to re-sign), and for `events export` its sources' providers
    /// (to know which headers are signatures), no secret.
    #[arg(short, long, value_name = "FILE")]
    config: Option<PathBuf>,
}

/// How requests are signed.
#[derive(Debug, clap::Args)]
struct SigningArgs {
    /// Sign every request afresh (new timestamp) with the source's secret [default when a
    /// secret is known].
    #[arg(long, conflicts_with = "original")]
    resign: bool,
    /// Send the headers exactly as captured [default without a secret].
    #[arg(long)]
    original: bool,
    /// Sign as this provider (stripe, github, standard-webhooks, …) instead of the config's.
    #[arg(long, requires = "secret")]
    provider: Option<String>,
    /// The signing secret: a literal, env:NAME or file:PATH (Discord: the private key seed).
    #[arg(long, requires = "provider")]
    secret: Option<String>,
    /// Send each request as the gateway delivers it to a destination with this secret
    /// (Idempotency-Key, hooklatch-* headers, a Standard Webhooks signature), to a handler
    /// behind hooklatch that verifies the gateway's signature (--to). A literal, env:NAME or
    /// file:PATH.
    #[arg(long, value_name = "SECRET", conflicts_with_all = ["original", "resign", "provider"])]
    destination_secret: Option<String>,
    /// Send each request as the gateway delivers it (Idempotency-Key, hooklatch-* headers, the
    /// provider's signature made again with --config's secret), to a handler behind hooklatch
    /// that keys on Idempotency-Key (--to); --destination-secret adds the gateway's signature.
    #[arg(long, conflicts_with_all = ["original", "resign", "provider"])]
    as_delivered: bool,
    /// Re-sign requests the gateway rejected when they came, too. Without it such a capture is
    /// refused rather than re-signed: its body was never verified, and a fresh signature would
    /// vouch for it. For a genuine event refused while the source's secret was wrong.
    #[arg(long, conflicts_with = "original")]
    resign_rejected: bool,
}

#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("target").required(true).args(["to", "via_gateway"]))]
struct ReplayArgs {
    /// What to replay: a request id (req_N), a delivery id (dlv_N: its request), or an export
    /// file.
    #[arg(value_name = "ID|FILE")]
    capture: String,
    /// Send straight at this URL (your handler). Without a query of its own it gets the
    /// capture's (a Twilio voice webhook sent as GET carries its parameters there).
    #[arg(long, value_name = "URL", value_parser = http_url)]
    to: Option<String>,
    /// Send through the gateway's ingest, POST {gateway}/in/{source}.
    #[arg(long)]
    via_gateway: bool,
    /// The gateway's ingest base URL (default: the config's server.listen, else
    /// http://127.0.0.1:8080).
    #[arg(long, value_name = "URL", value_parser = http_url, requires = "via_gateway")]
    gateway: Option<String>,
    /// Requests in all.
    #[arg(long, short = 'n', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    times: u32,
    /// Requests in flight at once.
    #[arg(long, short = 'k', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    concurrency: u32,
    /// Time between the starts of consecutive requests (250ms, 1s).
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "0ms")]
    delay: Duration,
    /// Time allowed for one request.
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "30s")]
    timeout: Duration,
    /// In an export file with several captures, only this one (its request_id).
    #[arg(long, value_name = "REQUEST_ID")]
    request: Option<String>,
    #[command(flatten)]
    signing: SigningArgs,
    #[command(flatten)]
    admin: AdminArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["provider", "capture"]))]
struct CheckArgs {
    /// A test event of this provider (as `hooklatch send` sends), signed with --secret.
    #[arg(long, requires = "secret")]
    provider: Option<String>,
    /// The test event's type (default: the provider's first).
    #[arg(long, value_name = "TYPE", requires = "provider")]
    event: Option<String>,
    /// The first test event's id (default: fresh), as `send --id` takes it.
    #[arg(long, requires = "provider")]
    id: Option<String>,
    /// Or a captured event: req_N, dlv_N or an export file.
    #[arg(long, value_name = "ID|FILE")]
    capture: Option<String>,
    /// In an export file with several captures, the one to check (its request_id).
    #[arg(long, value_name = "REQUEST_ID", requires = "capture")]
    request: Option<String>,
    /// The signing secret: a literal, env:NAME or file:PATH.
    #[arg(long)]
    secret: Option<String>,
    /// Send every request as the gateway delivers it to a destination with this secret
    /// (Idempotency-Key, hooklatch-* headers, a Standard Webhooks signature): for a handler
    /// behind hooklatch that verifies the gateway's signature. A literal, env:NAME or file:PATH.
    #[arg(long, value_name = "SECRET")]
    destination_secret: Option<String>,
    /// Send every request as the gateway delivers it (Idempotency-Key, hooklatch-* headers,
    /// the provider's signature made again), for a handler behind hooklatch that keys on
    /// Idempotency-Key; --destination-secret adds the gateway's signature.
    #[arg(long)]
    as_delivered: bool,
    /// The handler's URL.
    #[arg(long, value_name = "URL", value_parser = http_url)]
    to: String,
    /// Phase 1: deliveries one after another.
    #[arg(long, short = 'n', default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    times: u32,
    /// Phase 2: deliveries of a fresh event all at once.
    #[arg(long, short = 'k', default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    concurrency: u32,
    /// Phase 3 waits this long after the handler finished before the late replay.
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "0s")]
    late_after: Duration,
    /// Phase 4: the first event's id with a different body.
    #[arg(long)]
    conflict: bool,
    /// Effects expected per event.
    #[arg(long, default_value_t = 1)]
    expect: i64,
    /// Wait this long after each phase before counting (for handlers that work in background).
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "0s")]
    settle: Duration,
    /// A query counting the effects of one event; :key is bound to its key.
    #[arg(
        long,
        value_name = "SQL",
        requires = "db",
        conflicts_with = "effects_cmd"
    )]
    effects_sql: Option<String>,
    /// The application's database for --effects-sql: sqlite://PATH or postgres://…
    #[arg(long, value_name = "URL", requires = "effects_sql")]
    db: Option<String>,
    /// A shell command printing the effect count; the key is in $HOOKLATCH_KEY.
    #[arg(long, value_name = "CMD")]
    effects_cmd: Option<String>,
    /// Time allowed for one request.
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "30s")]
    timeout: Duration,
    #[command(flatten)]
    admin: AdminArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// Only this source.
    #[arg(long)]
    source: Option<String>,
    /// Only this verdict: accepted, duplicate, conflict, rejected, handshake, imported.
    #[arg(long)]
    verdict: Option<String>,
    /// Only requests carrying this event key.
    #[arg(long)]
    key: Option<String>,
    /// Only requests received within this long (24h, 7d).
    #[arg(long, value_name = "DURATION", value_parser = duration_arg)]
    since: Option<Duration>,
    /// At most this many, newest first.
    #[arg(long, default_value_t = 20, value_parser = at_least_one)]
    limit: usize,
    /// One JSON object per line, as the admin API gives them.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    admin: AdminArgs,
}

#[derive(Debug, clap::Args)]
struct ExportArgs {
    /// Requests (req_N) or deliveries (dlv_N: their request) to export; without any, the
    /// history matching the filters.
    #[arg(value_name = "ID")]
    ids: Vec<String>,
    /// Only this source.
    #[arg(long, conflicts_with = "ids")]
    source: Option<String>,
    /// Only this verdict: accepted, duplicate, conflict, rejected.
    #[arg(long, conflicts_with = "ids")]
    verdict: Option<String>,
    /// Only requests carrying this event key.
    #[arg(long, conflicts_with = "ids")]
    key: Option<String>,
    /// Only requests received within this long (24h, 7d).
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, conflicts_with = "ids")]
    since: Option<Duration>,
    /// At most this many, newest first.
    #[arg(long, default_value_t = 100, conflicts_with = "ids", value_parser = at_least_one)]
    limit: usize,
    /// Write here instead of standard output.
    #[arg(short, long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Keep the providers' signature headers (left out by default: where a provider signs no
    /// timestamp, a signature never expires; `replay --resign` signs captures afresh).
    #[arg(long)]
    keep_signatures: bool,
    #[command(flatten)]
    admin: AdminArgs,
}

#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("pace").args(["concurrency", "rate"]))]
struct BenchArgs {
    /// The gateway's ingest base URL.
    #[arg(long, value_name = "URL", value_parser = http_url, default_value = "http://127.0.0.1:8080")]
    target: String,
    /// The source: requests go to {target}/in/{source}.
    #[arg(long, default_value = "stripe")]
    source: String,
    /// The provider whose signed test events are sent.
    #[arg(long, default_value = "stripe")]
    provider: String,
    /// The source's signing secret: a literal, env:NAME or file:PATH.
    #[arg(long, default_value = "whsec_local_development_only")]
    secret: String,
    /// Distinct events, pre-signed before the run.
    #[arg(long, short = 'n', default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    events: u64,
    /// Share of all requests that are duplicates (0.0–0.9).
    #[arg(long, default_value_t = 0.0)]
    duplicates: f64,
    /// Pad each body with a JSON field to this many bytes (0: the fixture as it is).
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    body_size: usize,
    /// Closed loop: requests in flight at once [default: 16].
    #[arg(long, short = 'k', value_parser = clap::value_parser!(u32).range(1..=4096))]
    concurrency: Option<u32>,
    /// Open loop: requests per second, each due at a fixed time.
    #[arg(long, value_name = "PER_SECOND")]
    rate: Option<f64>,
    /// Open loop: the most connections kept, all opened before the clock starts; a request
    /// due while all are busy waits, and the wait counts in its latency [default: the
    /// requests of 10 ms at --rate, 8 to 512].
    #[arg(long, value_name = "N", requires = "rate", value_parser = clap::value_parser!(u32).range(1..=65536))]
    connections: Option<u32>,
    /// Open loop: first send the same load for this long, with events of its own, and count
    /// none of it; the measured requests (and --duration) follow without a pause. A gateway
    /// just started answers its first requests more slowly (PostgreSQL: 30-70 ms), which a
    /// short run would otherwise measure [default: none].
    #[arg(long, value_name = "DURATION", requires = "rate", value_parser = duration_arg)]
    warmup: Option<Duration>,
    /// Stop sending new requests after this long.
    #[arg(long, value_name = "DURATION", value_parser = duration_arg)]
    duration: Option<Duration>,
    /// Time allowed for one request.
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "30s")]
    timeout: Duration,
    /// The gateway's process id: its resident memory (VmRSS, VmHWM) is sampled from /proc, and
    /// its CPU time during the run is reported (per request, beside the whole machine's).
    #[arg(long)]
    pid: Option<u32>,
    /// First run the same load against a minimal in-process hyper server answering 200 (the
    /// HTTP ceiling), and report the ratio.
    #[arg(long)]
    baseline: bool,
    /// Start a delivery sink on an ephemeral port (printed; point a destination at it).
    #[arg(long)]
    sink: bool,
    /// Start the delivery sink on this address (what the gateway's destination names, path
    /// /sink); implies --sink.
    #[arg(long, value_name = "ADDR")]
    sink_listen: Option<std::net::SocketAddr>,
    /// The sink waits this long before each answer (a slow destination).
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "0ms")]
    sink_delay: Duration,
    /// How long to wait for every accepted event to reach the sink.
    #[arg(long, value_name = "DURATION", value_parser = duration_arg, default_value = "60s")]
    sink_wait: Duration,
    /// Send nothing: start the sink and wait (up to --sink-wait) for this many distinct events
    /// to arrive, a backlog the gateway already holds, then report how fast they came. Start
    /// it before the gateway; needs --sink-listen.
    #[arg(long, value_name = "EVENTS", requires = "sink_listen", conflicts_with_all = ["baseline", "rate", "concurrency", "duration"], value_parser = clap::value_parser!(u64).range(1..))]
    drain: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// A duration flag: `250ms`, `30s`, `10m`, `2h`, `7d`, or whole seconds (`5`), as the
/// configuration takes them.
fn duration_arg(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .ok()
        .map(Duration::from_secs)
        .or_else(|| config::parse_duration(s))
        .ok_or_else(|| format!("{s:?} is not a duration like 250ms, 30s, 10m (or whole seconds)"))
}

fn main() -> ExitCode {
    // Crash points for the end-to-end crash matrix: only in a binary built with the
    // `failpoints` feature (the tests'); nothing is read otherwise.
    let _crash_points = hooklatch::core::crash::setup();
    quiet_on_a_closed_pipe();
    let cli = Cli::parse();
    match run(cli) {
        Ok(Outcome::Passed) => ExitCode::SUCCESS,
        Ok(Outcome::Failed) => ExitCode::from(1),
        Ok(Outcome::ErrorLogged) => ExitCode::from(2),
        Err(err) => {
            eprintln!("hooklatch: error: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// Output piped into a reader that stops early (`hooklatch events list | head`) ends the
/// process quietly, as other command-line tools end (exit status 141, SIGPIPE's), instead of
/// with a panic and its backtrace: the standard library ignores SIGPIPE and panics when
/// `println!` meets the closed pipe. Every other panic is reported as before.
fn quiet_on_a_closed_pipe() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to std") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        report(info);
    }));
}

/// How a verb that tests something ended: exit status 0 or 1 (errors are 2).
enum Outcome {
    Passed,
    Failed,
    /// An error, said already in the log's own format (`serve` with JSON logs): exit status 2.
    ErrorLogged,
}

fn run(cli: Cli) -> anyhow::Result<Outcome> {
    let env: HashMap<String, String> = std::env::vars().collect();
    if let Some(path) = &cli.ca_file {
        hooklatch::trust::trust_ca_file(path)?;
    }
    match cli.command {
        Command::Serve {
            config,
            allow_unsafe_durability,
        } => {
            let mut settings = match config::load(config.as_deref(), &env) {
                Ok(settings) => settings,
                // A collector that reads JSON lines gets why the gateway did not start as one.
                Err(err) if config::log_format_hint(config.as_deref(), &env) == LogFormat::Json => {
                    init_tracing(LogFormat::Json);
                    tracing::error!(error = %err, "hooklatch cannot start");
                    return Ok(Outcome::ErrorLogged);
                }
                Err(err) => return Err(err.into()),
            };
            if allow_unsafe_durability {
                settings.store.allow_unsafe_durability();
            }
            let log_format = settings.log_format;
            init_tracing(log_format);
            for warning in config::env_warnings(&env) {
                tracing::warn!("{warning}");
            }
            match serve(settings) {
                // A collector that reads JSON lines gets the reason the gateway stopped as one.
                Err(err) if log_format == LogFormat::Json => {
                    tracing::error!(error = %format!("{err:#}"), "hooklatch cannot go on");
                    Ok(Outcome::ErrorLogged)
                }
                done => done.map(|()| Outcome::Passed),
            }
        }
        Command::Send(args) => send(args, &env),
        Command::Listen(args) => listen(args, &env).map(|()| Outcome::Passed),
        Command::Replay(args) => replay(args, &env),
        Command::Check(args) => check(args, &env),
        Command::Bench(args) => bench(args, &env),
        Command::Events {
            command: EventsCommand::Export(args),
        } => export(args, &env),
        Command::Events {
            command: EventsCommand::List(args),
        } => list_events(args, &env).map(|()| Outcome::Passed),
        Command::Events {
            command:
                EventsCommand::Redeliver {
                    request,
                    destination,
                    admin,
                },
        } => redeliver(&request, destination.as_deref(), &admin, &env),
        Command::Events {
            command:
                EventsCommand::Dismiss {
                    request,
                    reason,
                    admin,
                },
        } => dismiss(&request, reason.as_deref(), &admin, &env),
        Command::Dlq { command } => dlq(command, &env),
        Command::Destinations { command } => destinations(command, &env),
        Command::Events {
            command: EventsCommand::Import { file, admin },
        } => {
            let text =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let doc: serde_json::Value = serde_json::from_slice(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            let (doc, refused) = without_refused_captures(doc);
            for label in &refused {
                eprintln!(
                    "skipped {label}: refused when it came, it has no event to deliver again"
                );
            }
            let settings = load_admin_config(&admin, &env)?;
            let client = admin_client(&admin, settings.as_ref());
            let ids = match client_runtime()?.block_on(client.import(doc)) {
                Ok(ids) => ids,
                Err(err) => {
                    eprintln!("{}", refusal(&file.display().to_string(), err)?);
                    return Ok(Outcome::Failed);
                }
            };
            let mut again = 0;
            for imported in &ids {
                // The id here, then where it came from: a script reads the first word.
                let mut line = imported.id.clone();
                if let Some(from) = &imported.from {
                    line.push_str(&format!(" (from {from})"));
                }
                if imported.before {
                    again += 1;
                    line.push_str(" (imported before)");
                }
                println!("{}", terminal_safe(&line));
            }
            let new = ids.len() as u64 - again;
            if again == 0 {
                eprintln!(
                    "imported {}",
                    hooklatch::counted(new, "capture", "captures")
                );
            } else {
                eprintln!(
                    "imported {}; {again} imported before, left as they were",
                    hooklatch::counted(new, "capture", "captures")
                );
            }
            Ok(Outcome::Passed)
        }
        Command::Migrate { config } => {
            let store = config::load_store(config.as_deref(), &env)?;
            // The migrations' steps, and a wait for a database still starting, on stderr.
            init_tracing(LogFormat::Human);
            println!(
                "{}",
                client_runtime()?.block_on(hooklatch::migrate(&store))?
            );
            Ok(Outcome::Passed)
        }
        Command::CheckConfig {
            config,
            print_defaults,
            connect,
            allow_unsafe_durability,
        } => {
            if print_defaults {
                print!("{}", config::DEFAULT_CONFIG);
                return Ok(Outcome::Passed);
            }
            let mut settings = config::load(config.as_deref(), &env)?;
            if allow_unsafe_durability {
                settings.store.allow_unsafe_durability();
            }
            for warning in config::env_warnings(&env)
                .into_iter()
                .chain(settings.warnings())
            {
                eprintln!("warning: {warning}");
            }
            println!(
                "configuration is valid: {}, {}",
                hooklatch::counted(settings.sources.len() as u64, "source", "sources"),
                hooklatch::counted(
                    settings.destinations.len() as u64,
                    "destination",
                    "destinations"
                )
            );
            if !connect {
                println!(
                    "(the file and the environment only: the store, brokers and destinations \
                     were not contacted; --connect contacts them)"
                );
                return Ok(Outcome::Passed);
            }
            let contacts = client_runtime()?.block_on(hooklatch::contact::contact(&settings));
            let mut failed = false;
            for c in &contacts {
                let mark = match c.state {
                    hooklatch::contact::State::Ok => "ok  ",
                    hooklatch::contact::State::Warn => "warn",
                    hooklatch::contact::State::Fail => {
                        failed = true;
                        "FAIL"
                    }
                };
                println!("{mark} {:<12} {}: {}", c.what, c.at, c.said);
            }
            Ok(if failed {
                Outcome::Failed
            } else {
                Outcome::Passed
            })
        }
    }
}

/// The log filter without `RUST_LOG`: hooklatch's own lines, not the libraries' echoes of
/// them (lapin logs every broker error hooklatch reports again, in its own words; PostgreSQL's
/// notices are the migrations' "already exists, skipping").
const DEFAULT_LOG: &str = "info,lapin=off,sqlx::postgres::notice=warn";

/// Always off, whatever `RUST_LOG` says: lapin logs a message the broker returned (an
/// unroutable delivery) whole, its body an event's.
const NEVER_LOGGED: &[&str] = &["lapin::returned_messages=off"];

fn log_filter() -> tracing_subscriber::EnvFilter {
    use tracing_subscriber::EnvFilter;
    let mut filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG));
    for directive in NEVER_LOGGED {
        filter = filter.add_directive(directive.parse().expect("a valid directive"));
    }
    filter
}

/// `serve` once its logging is set up: the runtime, the signals, the gateway.
fn serve(settings: config::Settings) -> anyhow::Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.runtime_workers(cpus))
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // With a TLS certificate, SIGHUP reloads it (and says so); without one there is nothing to
    // reload, and a SIGHUP (certbot's hook, a closed terminal) stops nothing.
    let hangup = if settings.tls.is_some() {
        None
    } else {
        Some("SIGHUP received: nothing to reload (no [server] tls_cert); still serving")
    };
    runtime.block_on(async {
        let cancel = CancellationToken::new();
        tokio::spawn(cancel_on_signal(cancel.clone(), hangup));
        hooklatch::serve(settings, cancel).await
    })
}

fn init_tracing(format: LogFormat) {
    let filter = log_filter();
    // Colours only on a terminal: a log file or a collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Cancels `cancel` on Ctrl-C or SIGTERM. SIGHUP never stops the process (its default
/// would): it is logged with `on_hangup`, or left to the TLS reload that listens for it. A
/// second Ctrl-C or SIGTERM while stopping ends the process at once: what was in flight is
/// given back as after a crash (nothing acknowledged is lost; a delivery goes out again).
async fn cancel_on_signal(cancel: CancellationToken, on_hangup: Option<&'static str>) {
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
        let mut hangup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(err) => {
                tracing::warn!(%err, "cannot listen for SIGHUP: one would stop the process");
                None
            }
        };
        for stop in 0..2 {
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {
                        tracing::info!("ctrl-c received");
                        break;
                    }
                    _ = term.recv() => {
                        tracing::info!("SIGTERM received");
                        break;
                    }
                    Some(()) = async {
                        match hangup.as_mut() {
                            Some(h) => h.recv().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        if let Some(message) = on_hangup {
                            tracing::info!("{message}");
                        }
                    }
                }
            }
            if stop == 0 {
                cancel.cancel();
            }
        }
        tracing::warn!(
            "a second stop signal: stopping now, without waiting for what is in flight \
             (deliveries in flight go out again at the next start)"
        );
        std::process::exit(130);
    }
    #[cfg(not(unix))]
    {
        let _ = on_hangup;
        let _ = tokio::signal::ctrl_c().await;
        cancel.cancel();
    }
}

fn list_events(args: ListArgs, env: &HashMap<String, String>) -> anyhow::Result<()> {
    use std::io::Write;
    let settings = load_admin_config(&args.admin, env)?;
    let client = admin_client(&args.admin, settings.as_ref());
    let filter = HistoryFilter {
        source: args.source,
        verdict: args.verdict,
        key: args.key,
        since: args.since.map(|ago| Timestamp::now().minus(ago)),
        until: None,
        limit: args.limit,
    };
    let items = client_runtime()?.block_on(client.summaries(&filter))?;
    let mut out = std::io::stdout().lock();
    const ROW: fn(&str, &str, &str, &str, &str, &str, &str) -> String =
        |id, received, source, verdict, status, size, keys| {
            format!("{id:<10} {received:<24}  {source:<12} {verdict:<30} {status:>6}  {size:>9}  {keys}")
        };
    if !args.json && !items.is_empty() {
        let header = ROW(
            "ID", "RECEIVED", "SOURCE", "VERDICT", "STATUS", "BODY", "KEYS",
        );
        if writeln!(out, "{}", header.trim_end()).is_err() {
            return Ok(());
        }
    }
    for item in &items {
        let line = if args.json {
            item.to_string()
        } else {
            let text = |name: &str| item[name].as_str().unwrap_or("-").to_owned();
            let verdict = match (item["reason"].as_str(), item["decision"]["action"].as_str()) {
                (Some(reason), _) => format!("{} ({reason})", text("verdict")),
                (None, Some(action)) => format!("{} ({action})", text("verdict")),
                (None, None) => text("verdict"),
            };
            let keys: Vec<&str> = item["keys"]
                .as_array()
                .map(|keys| keys.iter().filter_map(serde_json::Value::as_str).collect())
                .unwrap_or_default();
            terminal_safe(&ROW(
                &text("id"),
                &text("received_at"),
                &text("source"),
                &verdict,
                &item["status"].to_string(),
                &format!("{} B", item["body_len"]),
                &keys.join(" "),
            ))
        };
        // A closed stdout (`| head`) ends the listing quietly.
        if writeln!(out, "{line}").is_err() {
            return Ok(());
        }
    }
    if !args.json {
        eprintln!(
            "{}",
            hooklatch::counted(items.len() as u64, "request", "requests")
        );
    }
    Ok(())
}

fn listen(args: ListenArgs, env: &HashMap<String, String>) -> anyhow::Result<()> {
    // Both flags were checked as http(s) URLs when parsed (`http_url`).
    let url = |flag: &str, text: &str| -> anyhow::Result<reqwest::Url> {
        reqwest::Url::parse(text).with_context(|| format!("{flag} {text:?}"))
    };
    let gateway = url("--gateway", &args.gateway)?;
    anyhow::ensure!(
        !gateway.path().starts_with("/in/"),
        "--gateway is the gateway's base URL ({}://{}), not a source's /in/… URL",
        gateway.scheme(),
        gateway.host_str().unwrap_or_default()
    );
    let options = hooklatch::listener::ListenOptions {
        gateway,
        destination: args.destination,
        token: config::read_secret("--token", &args.token, env, None)?,
        forward_to: url("--forward-to", &args.forward_to)?,
    };
    println!(
        "listening for {:?} on {}, forwarding to {}",
        options.destination, options.gateway, options.forward_to
    );
    client_runtime()?.block_on(async {
        let cancel = CancellationToken::new();
        tokio::spawn(cancel_on_signal(
            cancel.clone(),
            Some("SIGHUP received: ignored; the listener goes on (Ctrl-C or SIGTERM stops it)"),
        ));
        hooklatch::listener::run(options, cancel, |event| {
            use std::io::Write;
            // A closed stdout (`| head`) loses the line, and never stops the listener.
            let now = Timestamp::now();
            let _ = writeln!(std::io::stdout().lock(), "{}  {event}", now.to_rfc3339());
        })
        .await
    })
}

fn send(args: SendArgs, env: &HashMap<String, String>) -> anyhow::Result<Outcome> {
    if args.list {
        for (provider, event_type) in hooklatch::fixtures::catalog() {
            println!("{provider:<20} {event_type}");
        }
        return Ok(Outcome::Passed);
    }
    let (Some(provider), Some(secret), Some(to)) = (args.provider, args.secret, args.to) else {
        anyhow::bail!("send needs a provider, --secret and --to");
    };
    let secret = config::read_secret("--secret", &secret, env, None)?;
    // The URL the signature covers, for the one provider that signs it.
    let signed_url = match &args.public_url {
        None => to.clone(),
        Some(public) => {
            anyhow::ensure!(
                provider == "twilio",
                "--public-url: only Twilio signs the URL it calls; {provider} does not"
            );
            let public = config::twilio_public_url(public)
                .map_err(|e| anyhow::anyhow!("--public-url: {e}"))?;
            let target = reqwest::Url::parse(&to).context("--to")?;
            let path_and_query = match target.query() {
                Some(query) => format!("{}?{query}", target.path()),
                None => target.path().to_owned(),
            };
            hooklatch_core::provider::Twilio {
                public_url: Some(public),
            }
            .url_called(&path_and_query)
        }
    };
    let event = hooklatch::fixtures::build(
        &provider,
        args.event.as_deref(),
        args.id.as_deref(),
        &secret,
        &signed_url,
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
    let (status, verdict, body) = runtime
        .block_on(async {
            let client = hooklatch::trust::client_builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(std::time::Duration::from_secs(30))
                .build()?;
            let mut req = client.post(&to).body(event.body.clone());
            for (name, value) in &event.headers {
                req = req.header(name, value);
            }
            let res = req.send().await?;
            let status = res.status();
            // A gateway's answer in the provider's own format (Twilio's TwiML) carries its
            // verdict in headers rather than in a JSON body.
            let verdict = [
                hooklatch::http::VERDICT_HEADER,
                hooklatch::http::REQUEST_ID_HEADER,
            ]
            .iter()
            .filter_map(|name| res.headers().get(*name)?.to_str().ok())
            .collect::<Vec<_>>()
            .join(", ");
            let body = res.text().await?;
            Ok::<_, reqwest::Error>((status, verdict, body))
        })
        .with_context(|| format!("sending to {to}"))?;
    println!("sent {provider} {} {}", event.event_type, event.key);
    if verdict.is_empty() {
        println!("{status}");
    } else {
        println!("{status} ({verdict})");
    }
    if !body.is_empty() {
        println!("{body}");
    }
    if !status.is_success() {
        eprintln!("the endpoint answered {status}");
        return Ok(Outcome::Failed);
    }
    Ok(Outcome::Passed)
}

/// Prints a report to stdout; a closed pipe (`| head`) is not an error worth a panic.
fn print_out(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().write_all(text.as_bytes());
}

/// The runtime the client verbs (`replay`, `check`, `events`) run on.
fn client_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The gateway's config, when given.
fn load_config(
    args: &AdminArgs,
    env: &HashMap<String, String>,
) -> anyhow::Result<Option<Settings>> {
    args.config
        .as_deref()
        .map(|path| config::load(Some(path), env))
        .transpose()
        .map_err(Into::into)
}

/// What an admin verb needs of `--config`: the admin listener, and its token unless `--token`
/// gives one. No other secret of the file is read.
fn load_admin_config(
    args: &AdminArgs,
    env: &HashMap<String, String>,
) -> anyhow::Result<Option<AdminSettings>> {
    args.config
        .as_deref()
        .map(|path| config::load_admin(Some(path), env, args.token.is_none()))
        .transpose()
        .map_err(Into::into)
}

/// The admin API client: `--admin`/`--token`, else the config's listener and token.
fn admin_client(args: &AdminArgs, settings: Option<&AdminSettings>) -> AdminClient {
    let base = match (&args.admin, settings) {
        (Some(url), _) => url.clone(),
        (None, Some(s)) => {
            let mut addr = s.admin_listen;
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            let scheme = if s.admin_tls { "https" } else { "http" };
            format!("{scheme}://{addr}")
        }
        (None, None) => DEFAULT_ADMIN_URL.to_owned(),
    };
    let token = match (&args.token, settings) {
        (Some(token), _) => Some(hooklatch_core::Secret::from_text(token)),
        (None, Some(s)) => s.admin_token.clone(),
        (None, None) => None,
    };
    AdminClient::new(&base, token)
}

/// A progress bar on stderr, hidden when stderr is not a terminal or the output is JSON.
fn progress_bar(total: u64, json: bool) -> indicatif::ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .expect("the template is valid"),
    );
    bar
}

fn replay(args: ReplayArgs, env: &HashMap<String, String>) -> anyhow::Result<Outcome> {
    // The sources' secrets re-sign captures: the whole configuration.
    let settings = load_config(&args.admin, env)?;
    let admin = admin_client(
        &args.admin,
        settings.as_ref().map(AdminSettings::from).as_ref(),
    );
    let given = signer_arg(&args.signing, env)?;
    let as_delivered = as_delivered_by(
        args.signing.as_delivered,
        destination_secret(args.signing.destination_secret.as_deref(), env)?,
    );
    let mode = match (args.signing.resign, args.signing.original) {
        (true, _) => SignMode::Resign,
        (_, true) => SignMode::Original,
        _ => SignMode::Auto,
    };
    let target = match &args.to {
        Some(url) => Target::Url(url.clone()),
        None => Target::Gateway(
            args.gateway
                .clone()
                .unwrap_or_else(|| hooklatch::replay::gateway_base(settings.as_ref())),
        ),
    };
    client_runtime()?.block_on(async {
        let mut captures = admin.resolve(&args.capture).await?;
        only_request(&mut captures, args.request.as_deref(), &args.capture)?;
        if let Some(s) = &settings {
            hooklatch::capture::fill_providers(&mut captures, &s.outlines());
        }
        let mut reports = Vec::new();
        for capture in &captures {
            let (signing, note) = match &as_delivered {
                // The gateway never delivers what it rejected: nor is it made to look so.
                Some(_) if capture.was_refused() && !args.signing.resign_rejected => {
                    return Err(hooklatch::replay::ReplayError::Rejected(capture.label()).into())
                }
                Some(how) => (
                    Signing::AsDelivered(hooklatch::replay::AsDelivered {
                        secret: how.secret.clone(),
                        // The provider's signature made again where --config has the
                        // source's secret; as captured otherwise.
                        signer: hooklatch::replay::signer_for(
                            capture,
                            None,
                            settings.as_ref(),
                            &target,
                        )
                        .ok()
                        .flatten(),
                    }),
                    format!(
                        "{}: sending as the gateway delivers it ({})",
                        capture.label(),
                        if how.secret.is_some() {
                            "--destination-secret"
                        } else {
                            "--as-delivered"
                        }
                    ),
                ),
                None => {
                    let signer = hooklatch::replay::signer_for(
                        capture,
                        given.as_ref(),
                        settings.as_ref(),
                        &target,
                    )?;
                    hooklatch::replay::choose_signing(
                        mode,
                        signer,
                        capture,
                        args.signing.resign_rejected,
                        Timestamp::now(),
                    )?
                }
            };
            if !args.json {
                eprintln!("{note}");
            }
            let opts = ReplayOptions {
                target: target.clone(),
                times: args.times,
                concurrency: args.concurrency,
                delay: args.delay,
                signing,
                timeout: args.timeout,
            };
            let bar = progress_bar(u64::from(args.times), args.json);
            let report = hooklatch::replay::replay(capture, &opts, &|_| bar.inc(1)).await?;
            bar.finish_and_clear();
            if !args.json {
                print_out(&report.render());
            }
            reports.push(report);
        }
        let ok = reports.iter().all(|r| r.ok());
        if args.json {
            let doc = serde_json::json!({
                "ok": ok,
                "replays": reports.iter().map(|r| r.to_json()).collect::<Vec<_>>(),
            });
            print_out(&format!("{doc:#}\n"));
        }
        Ok(if ok { Outcome::Passed } else { Outcome::Failed })
    })
}

/// `--provider` and `--secret` as a signer.
fn signer_arg(args: &SigningArgs, env: &HashMap<String, String>) -> anyhow::Result<Option<Signer>> {
    match (&args.provider, &args.secret) {
        (Some(provider), Some(secret)) => {
            let secret = config::read_secret("--secret", secret, env, None)?;
            Ok(Some(Signer::for_provider(provider, secret)?))
        }
        _ => Ok(None),
    }
}

/// Keeps the capture of request `id` alone, when one is named (`--request`); an error if
/// `from` holds none.
/// How to send as the gateway delivers: with `--as-delivered`, or with `--destination-secret`
/// (which implies it); `None` for neither.
fn as_delivered_by(
    asked: bool,
    secret: Option<hooklatch::core::Secret>,
) -> Option<hooklatch::replay::AsDelivered> {
    (asked || secret.is_some()).then(|| hooklatch::replay::AsDelivered {
        secret,
        signer: None,
    })
}

/// `--destination-secret`, read and checked as a destination's `secret` is.
fn destination_secret(
    arg: Option<&str>,
    env: &HashMap<String, String>,
) -> anyhow::Result<Option<hooklatch::core::Secret>> {
    let Some(arg) = arg else { return Ok(None) };
    let secret = config::read_secret("--destination-secret", arg, env, None)?;
    hooklatch::fixtures::secret_shape("standard-webhooks", &secret)
        .map_err(|why| anyhow::anyhow!("--destination-secret: {why}"))?;
    Ok(Some(secret))
}

/// An `http://` or `https://` URL argument, kept as written. One without a scheme (the
/// commonest slip, `127.0.0.1:8080`) is refused with the URL it was most likely meant to be,
/// rather than the URL parser's "relative URL without a base".
fn http_url(text: &str) -> Result<String, String> {
    // `localhost:8080` would parse as the scheme "localhost"; `127.0.0.1:8080` as nothing.
    if !text.contains("://") {
        return Err(format!(
            "not a URL: write it with its scheme, http://{text}"
        ));
    }
    match reqwest::Url::parse(text) {
        Ok(url) if !matches!(url.scheme(), "http" | "https") => {
            Err(format!("{}:// is not http:// or https://", url.scheme()))
        }
        Ok(url) if !url.has_host() => Err("the URL names no host".to_owned()),
        Ok(_) => Ok(text.to_owned()),
        Err(err) => Err(format!("not a URL: {err}")),
    }
}

fn only_request(
    captures: &mut Vec<hooklatch::capture::Capture>,
    id: Option<&str>,
    from: &str,
) -> anyhow::Result<()> {
    if let Some(id) = id {
        captures.retain(|c| c.request_id.as_deref() == Some(id));
        anyhow::ensure!(!captures.is_empty(), "{from} holds no capture {id}");
    }
    Ok(())
}

fn check(args: CheckArgs, env: &HashMap<String, String>) -> anyhow::Result<Outcome> {
    // The sources' secrets re-sign captures: the whole configuration.
    let settings = load_config(&args.admin, env)?;
    let admin = admin_client(
        &args.admin,
        settings.as_ref().map(AdminSettings::from).as_ref(),
    );
    let secret = args
        .secret
        .as_deref()
        .map(|s| config::read_secret("--secret", s, env, None))
        .transpose()?;
    let effect = match (&args.effects_sql, &args.db, &args.effects_cmd) {
        (Some(sql), Some(db), _) => Some(EffectProbe::sql(db, sql)?),
        (_, _, Some(cmd)) => Some(EffectProbe::Command(cmd.clone())),
        _ => None,
    };
    let opts = CheckOptions {
        to: args.to.clone(),
        times: args.times,
        concurrency: args.concurrency,
        late_after: args.late_after,
        conflict: args.conflict,
        expect: args.expect,
        settle: args.settle,
        effect,
        timeout: args.timeout,
        as_delivered: as_delivered_by(
            args.as_delivered,
            destination_secret(args.destination_secret.as_deref(), env)?,
        ),
    };
    let total = u64::from(args.times + args.concurrency + 1 + u32::from(args.conflict));
    client_runtime()?.block_on(async {
        let input = match (&args.provider, &args.capture) {
            (Some(provider), _) => CheckInput::Fixture {
                provider: provider.clone(),
                event: args.event.clone(),
                id: args.id.clone(),
                secret: secret.context("--provider needs --secret")?,
            },
            (None, Some(arg)) => {
                let mut captures = admin.resolve(arg).await?;
                only_request(&mut captures, args.request.as_deref(), arg)?;
                anyhow::ensure!(
                    captures.len() == 1,
                    "{arg} holds {} captures; check takes one (name it with --request req_N)",
                    captures.len()
                );
                let mut capture = captures.remove(0);
                // check re-signs what it sends: a body nothing verified is not one to vouch for.
                anyhow::ensure!(
                    !capture.was_refused(),
                    "{} was rejected when it came (its signature, key or body did not pass): \
                     check a capture the gateway accepted, or a test event (--provider)",
                    capture.label()
                );
                if let Some(s) = &settings {
                    hooklatch::capture::fill_providers(
                        std::slice::from_mut(&mut capture),
                        &s.outlines(),
                    );
                }
                let signer = match (secret, &capture.provider) {
                    (Some(secret), Some(provider)) => Some(Signer::for_provider(provider, secret)?),
                    (Some(_), None) => {
                        anyhow::bail!("the capture does not say its provider: pass --config")
                    }
                    (None, _) => hooklatch::replay::signer_for(
                        &capture,
                        None,
                        settings.as_ref(),
                        &Target::Url(args.to.clone()),
                    )?,
                };
                CheckInput::Capture {
                    capture: Box::new(capture),
                    signer,
                }
            }
            (None, None) => anyhow::bail!("check needs --provider or --capture"),
        };
        let bar = progress_bar(total, args.json);
        let report = hooklatch::check::check(input, &opts, &|_| bar.inc(1)).await?;
        bar.finish_and_clear();
        if args.json {
            print_out(&format!("{:#}\n", report.to_json()));
        } else {
            print_out(&report.render());
        }
        Ok(if report.ok() {
            Outcome::Passed
        } else {
            Outcome::Failed
        })
    })
}

fn bench(args: BenchArgs, env: &HashMap<String, String>) -> anyhow::Result<Outcome> {
    use hooklatch::bench::{self, BenchOptions, Load};
    let opts = BenchOptions {
        target: args.target.clone(),
        source: args.source.clone(),
        provider: args.provider.clone(),
        secret: config::read_secret("--secret", &args.secret, env, None)?,
        events: args.events,
        duplicates: args.duplicates,
        body_size: args.body_size,
        load: match (args.rate, args.concurrency) {
            (Some(rate), _) => Load::Rate(rate),
            (None, k) => Load::Concurrency(k.unwrap_or(16)),
        },
        duration: args.duration,
        timeout: args.timeout,
        connections: args.connections.map(|n| n as usize),
        warmup: args.warmup,
    };
    if let (Some(want), Some(addr)) = (args.drain, args.sink_listen) {
        return client_runtime()?.block_on(async {
            let sink = bench::Sink::start(addr, args.sink_delay, want as usize).await?;
            eprintln!(
                "delivery sink: http://{}/sink; waiting for {want} events",
                sink.addr
            );
            let drain = sink.wait_for_drain(want as usize, args.sink_wait).await;
            if args.json {
                print_out(&format!(
                    "{:#}\n",
                    serde_json::json!({ "drain": drain.to_json() })
                ));
            } else {
                print_out(&drain.render());
            }
            Ok(if drain.complete() {
                Outcome::Passed
            } else {
                Outcome::Failed
            })
        });
    }
    client_runtime()?.block_on(async {
        let plan = std::sync::Arc::new(bench::plan(&opts)?);
        let total = plan.len() as u64;
        let mut doc = serde_json::json!({
            "target": opts.target,
            "provider": opts.provider,
            "events": opts.events,
            "duplicates_share": opts.duplicates,
            "body_bytes": plan.events.first().map_or(0, |e| e.body.len()),
            "load": match opts.load {
                Load::Concurrency(k) => serde_json::json!({"concurrency": k}),
                Load::Rate(r) => serde_json::json!({
                    "rate": r,
                    "connections": opts.connections.unwrap_or_else(|| bench::warm_connections(r)),
                    "warmup_s": opts.warmup.map_or(0.0, |w| w.as_secs_f64()),
                }),
            },
        });
        let mut baseline = None;
        if args.baseline {
            let server = bench::baseline_server()?;
            let bar = progress_bar(total, args.json);
            let tick = bar.clone();
            bar.set_message("baseline");
            let cpu = CpuAtStart::default();
            let report = bench::run(
                plan.clone(),
                &format!("http://{}", server.addr),
                &opts,
                "baseline (hyper, 200)",
                std::sync::Arc::new(move || tick.inc(1)),
                cpu.start(None),
            )
            .await?;
            let cpu = cpu.finish();
            bar.finish_and_clear();
            drop(server);
            if !args.json {
                print_out(&report.render());
                print_out(&cpu.render(report.sent));
            }
            doc["baseline"] = report.to_json();
            doc["baseline"]["cpu"] = cpu.to_json(report.sent);
            baseline = Some(report);
        }
        let sink = match (args.sink_listen, args.sink) {
            (Some(addr), _) => Some(bench::Sink::start(addr, args.sink_delay, plan.events.len()).await?),
            (None, true) => {
                let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
                Some(bench::Sink::start(any, args.sink_delay, plan.events.len()).await?)
            }
            (None, false) => None,
        };
        if let Some(sink) = &sink {
            eprintln!("delivery sink: http://{}/sink", sink.addr);
        }
        let sampler = args.pid.map(bench::RssSampler::start).transpose()?;
        let rss_before = sampler.as_ref().and_then(|s| s.now());
        let bar = progress_bar(total, args.json);
        bar.set_message("hooklatch");
        let tick = bar.clone();
        let cpu = CpuAtStart::default();
        let report = bench::run(
            plan.clone(),
            &opts.target,
            &opts,
            "hooklatch",
            std::sync::Arc::new(move || tick.inc(1)),
            cpu.start(args.pid),
        )
        .await?;
        let cpu = cpu.finish();
        bar.finish_and_clear();
        if !args.json {
            print_out(&report.render());
            print_out(&cpu.render(report.sent));
        }
        doc["hooklatch"] = report.to_json();
        doc["hooklatch"]["cpu"] = cpu.to_json(report.sent);
        if let Some(base) = &baseline {
            let ratio = report.throughput() / base.throughput().max(1e-9);
            doc["ratio_to_ceiling"] = ratio.into();
            if !args.json {
                print_out(&format!(
                    "hooklatch / ceiling: {:.1} %\n",
                    100.0 * ratio
                ));
            }
        }
        if let Some(sink) = &sink {
            let delivery = sink
                .wait_and_measure(&report, &opts.source, args.sink_wait)
                .await;
            if !args.json {
                print_out(&delivery.render());
            }
            doc["delivery"] = delivery.to_json();
        }
        if let Some(sampler) = &sampler {
            let (rss_after, hwm) = sampler.now().unwrap_or((0, 0));
            let memory = serde_json::json!({
                "rss_before_kib": rss_before.map(|r| r.0),
                "rss_peak_sampled_kib": sampler.peak(),
                "rss_after_kib": rss_after,
                "vm_hwm_kib": hwm,
            });
            if !args.json {
                print_out(&format!(
                    "server memory: {:.1} MiB before, peak {:.1} MiB sampled (VmHWM {:.1} MiB), {:.1} MiB after\n",
                    rss_before.map_or(0, |r| r.0) as f64 / 1024.0,
                    sampler.peak() as f64 / 1024.0,
                    hwm as f64 / 1024.0,
                    rss_after as f64 / 1024.0
                ));
            }
            doc["memory"] = memory;
        }
        if args.json {
            print_out(&format!("{doc:#}\n"));
        }
        Ok(if report.all_ok() {
            Outcome::Passed
        } else {
            Outcome::Failed
        })
    })
}

/// The CPU span of a bench run's measured requests, started by the run when the first of
/// them is due (after its warm-up).
#[derive(Default)]
struct CpuAtStart(std::sync::Arc<std::sync::Mutex<Option<hooklatch::bench::CpuSpan>>>);

impl CpuAtStart {
    fn start(&self, pid: Option<u32>) -> Box<dyn FnOnce() + Send> {
        let slot = self.0.clone();
        Box::new(move || {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(hooklatch::bench::CpuSpan::start(pid));
        })
    }

    fn finish(&self) -> hooklatch::bench::CpuUse {
        let span = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        span.unwrap_or_else(|| hooklatch::bench::CpuSpan::start(None))
            .finish()
    }
}

fn export(args: ExportArgs, env: &HashMap<String, String>) -> anyhow::Result<Outcome> {
    // The sources' providers name the signature headers an export leaves out; no secret but
    // the admin token is read.
    let admin_settings = load_admin_config(&args.admin, env)?;
    let outlines = match &args.admin.config {
        Some(path) => config::load_outlines(Some(path), env)?,
        None => Vec::new(),
    };
    let admin = admin_client(&args.admin, admin_settings.as_ref());
    let now = Timestamp::now();
    let filter = HistoryFilter {
        source: args.source.clone(),
        verdict: args.verdict.clone(),
        key: args.key.clone(),
        since: args.since.map(|d| now.minus(d)),
        until: None,
        limit: args.limit,
    };
    let (mut captures, skipped) =
        match client_runtime()?.block_on(admin.collect(&args.ids, &filter)) {
            Ok(found) => found,
            Err(err) => {
                eprintln!("{}", refusal("export", err)?);
                return Ok(Outcome::Failed);
            }
        };
    hooklatch::capture::fill_providers(&mut captures, &outlines);
    let options = hooklatch::capture::ExportOptions::new(args.keep_signatures, &outlines);
    let doc = hooklatch::capture::write_export(&captures, now, &options);
    match &args.out {
        Some(path) => {
            std::fs::write(path, &doc).with_context(|| format!("writing {}", path.display()))?
        }
        None => {
            use std::io::Write;
            std::io::stdout()
                .write_all(&doc)
                .context("writing the export")?;
        }
    }
    for id in &skipped {
        eprintln!(
            "skipped {id}: its body was not kept whole (refused as too large, or refused \
             with a body over server.refused_body_limit)"
        );
    }
    eprintln!(
        "exported {}",
        hooklatch::counted(captures.len() as u64, "capture", "captures")
    );
    Ok(Outcome::Passed)
}

/// A line for a terminal: a control character in it (from a reason, an event key, an
/// error a destination answered — text others wrote) is shown escaped (`\u{1b}`), so it can
/// neither move the cursor, clear the screen nor retitle the window.
fn terminal_safe(line: &str) -> String {
    line.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A count of at least one (`--limit`).
fn at_least_one(arg: &str) -> Result<usize, String> {
    match arg.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// An export document without its captures that name no event (requests the gateway refused:
/// nothing to deliver, and an import takes none), and their labels.
fn without_refused_captures(mut doc: serde_json::Value) -> (serde_json::Value, Vec<String>) {
    let mut refused = Vec::new();
    if let Some(captures) = doc["captures"].as_array_mut() {
        let mut i = 0;
        captures.retain(|capture| {
            let keep = capture["keys"]
                .as_array()
                .is_none_or(|keys| !keys.is_empty());
            if !keep {
                refused.push(
                    capture["request_id"]
                        .as_str()
                        .map_or_else(|| format!("captures[{i}]"), str::to_owned),
                );
            }
            i += 1;
            keep
        });
    }
    (doc, refused)
}

/// The request a CLI argument names, and a client of the gateway holding it.
fn request_and_client(
    request: &str,
    args: &AdminArgs,
    env: &HashMap<String, String>,
) -> anyhow::Result<(hooklatch::core::RequestId, AdminClient)> {
    let id = hooklatch::core::RequestId::parse(request)
        .with_context(|| format!("{request:?} is not a request id (req_N)"))?;
    let settings = load_admin_config(args, env)?;
    Ok((id, admin_client(args, settings.as_ref())))
}

/// An admin call's outcome for an exit status: done (`done` printed), refused with a 409 (the
/// API's message printed, exit 1), or not answered (exit 2).
fn done_or_refused<T>(
    what: &str,
    answer: Result<T, hooklatch::admin::AdminError>,
    done: impl FnOnce(T) -> String,
) -> anyhow::Result<Outcome> {
    match answer {
        Ok(value) => {
            println!("{}", terminal_safe(&format!("{what}: {}", done(value))));
            Ok(Outcome::Passed)
        }
        Err(err) => {
            eprintln!("{}", refusal(what, err)?);
            Ok(Outcome::Failed)
        }
    }
}

/// The gateway's "no" to a request about `what` — it is not there (404), or not in a state to
/// do it (409) — as the line to print ([`terminal_safe`]: the gateway's message may quote
/// text others wrote); `Err` when the gateway could not be asked.
fn refusal(
    what: &str,
    err: hooklatch::admin::AdminError,
) -> Result<String, hooklatch::admin::AdminError> {
    match err {
        // "dlv_9 not found on the gateway" names what is missing already.
        err @ hooklatch::admin::AdminError::NotFound(_) => Ok(terminal_safe(&err.to_string())),
        // Not in a state to do it (409), or a request it refuses (400: a destination it does
        // not have, a capture it cannot take). A token it does not take (401, 403) is the
        // caller's configuration: the gateway was not asked.
        hooklatch::admin::AdminError::Status { status, message }
            if (400..500).contains(&status) && !matches!(status, 401 | 403) =>
        {
            Ok(terminal_safe(&format!("{what}: {message}")))
        }
        err => Err(err),
    }
}

fn redeliver(
    request: &str,
    destination: Option<&str>,
    args: &AdminArgs,
    env: &HashMap<String, String>,
) -> anyhow::Result<Outcome> {
    let (id, admin) = request_and_client(request, args, env)?;
    let queued = client_runtime()?.block_on(admin.redeliver(id, destination));
    done_or_refused(&id.to_string(), queued, |queued| {
        format!("redelivery queued as {}", queued.join(", "))
    })
}

fn dismiss(
    request: &str,
    reason: Option<&str>,
    args: &AdminArgs,
    env: &HashMap<String, String>,
) -> anyhow::Result<Outcome> {
    let (id, admin) = request_and_client(request, args, env)?;
    let answer = client_runtime()?.block_on(admin.dismiss_conflict(id, reason));
    done_or_refused(&id.to_string(), answer, |()| {
        "conflict dismissed".to_owned()
    })
}

fn destinations(
    command: DestinationsCommand,
    env: &HashMap<String, String>,
) -> anyhow::Result<Outcome> {
    let runtime = client_runtime()?;
    let state = |d: &serde_json::Value| {
        if d["enabled"].as_bool().unwrap_or(true) {
            "enabled".to_owned()
        } else {
            format!(
                "disabled since {}: {}",
                d["disabled_at"].as_str().unwrap_or("?"),
                d["disabled_reason"].as_str().unwrap_or("")
            )
        }
    };
    match command {
        DestinationsCommand::List { json, admin } => {
            let settings = load_admin_config(&admin, env)?;
            let client = admin_client(&admin, settings.as_ref());
            for item in runtime.block_on(client.destinations())? {
                if json {
                    println!("{item}");
                } else {
                    let line = format!(
                        "{:<20} {:<7} {}",
                        item["name"].as_str().unwrap_or("?"),
                        item["kind"].as_str().unwrap_or("?"),
                        state(&item)
                    );
                    println!("{}", terminal_safe(&line));
                }
            }
            Ok(Outcome::Passed)
        }
        DestinationsCommand::Disable {
            name,
            reason,
            admin,
        } => {
            let settings = load_admin_config(&admin, env)?;
            let client = admin_client(&admin, settings.as_ref());
            let answer = runtime.block_on(client.disable_destination(&name, reason.as_deref()));
            done_or_refused(&name, answer, |item| state(&item))
        }
        DestinationsCommand::Enable { name, admin } => {
            let settings = load_admin_config(&admin, env)?;
            let client = admin_client(&admin, settings.as_ref());
            let answer = runtime.block_on(client.enable_destination(&name));
            done_or_refused(&name, answer, |item| {
                let woken = item["woken"].as_u64().unwrap_or(0);
                format!(
                    "enabled; {} due now",
                    hooklatch::counted(woken, "held delivery", "held deliveries")
                )
            })
        }
    }
}

fn dlq(command: DlqCommand, env: &HashMap<String, String>) -> anyhow::Result<Outcome> {
    let runtime = client_runtime()?;
    match command {
        DlqCommand::List {
            destination,
            limit,
            json,
            admin,
        } => {
            let settings = load_admin_config(&admin, env)?;
            let client = admin_client(&admin, settings.as_ref());
            let items =
                runtime.block_on(client.deliveries("dead", destination.as_deref(), limit))?;
            let row =
                |id: &str, request: &str, dest: &str, attempts: &str, key: &str, error: &str| {
                    let line = format!(
                        "{id:<10} {request:<10} {dest:<12} {attempts:>8}  {key:<40} {error}"
                    );
                    terminal_safe(line.trim_end())
                };
            if !json && !items.is_empty() {
                println!(
                    "{}",
                    row(
                        "ID",
                        "REQUEST",
                        "DESTINATION",
                        "ATTEMPTS",
                        "IDEMPOTENCY KEY",
                        "LAST ERROR"
                    )
                );
            }
            for item in &items {
                if json {
                    println!("{item}");
                } else {
                    let text = |name: &str| item[name].as_str().unwrap_or("?").to_owned();
                    println!(
                        "{}",
                        row(
                            &text("id"),
                            &text("request_id"),
                            &text("destination"),
                            &item["history"].as_array().map_or(0, Vec::len).to_string(),
                            &text("idempotency_key"),
                            item["last_error"].as_str().unwrap_or(""),
                        )
                    );
                }
            }
            if !json {
                eprintln!(
                    "{}",
                    hooklatch::counted(
                        items.len() as u64,
                        "dead-lettered delivery",
                        "dead-lettered deliveries"
                    )
                );
            }
            Ok(Outcome::Passed)
        }
        DlqCommand::Retry {
            ids,
            all,
            destination,
            admin,
        } => {
            let settings = load_admin_config(&admin, env)?;
            let client = admin_client(&admin, settings.as_ref());
            let ids: Vec<String> = if all {
                runtime
                    .block_on(client.deliveries("dead", destination.as_deref(), usize::MAX))?
                    .iter()
                    .filter_map(|d| d["id"].as_str().map(str::to_owned))
                    .collect()
            } else {
                ids
            };
            if all && ids.is_empty() {
                eprintln!("nothing to retry: the dead-letter is empty");
            }
            let mut failed = 0;
            for raw in &ids {
                let Some(id) = hooklatch::core::DeliveryId::parse(raw) else {
                    eprintln!("{raw}: not a delivery id (dlv_N)");
                    failed += 1;
                    continue;
                };
                match runtime.block_on(client.retry_delivery(id)) {
                    Ok(()) => println!("{id}: queued again"),
                    Err(err) => {
                        eprintln!("{}", refusal(&id.to_string(), err)?);
                        failed += 1;
                    }
                }
            }
            Ok(if failed == 0 {
                Outcome::Passed
            } else {
                Outcome::Failed
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn url_arguments_need_an_http_scheme_and_say_how_to_write_one() {
        assert_eq!(
            http_url("http://127.0.0.1:8080/in/stripe").as_deref(),
            Ok("http://127.0.0.1:8080/in/stripe")
        );
        assert_eq!(
            http_url("https://hooks.example.com").as_deref(),
            Ok("https://hooks.example.com")
        );
        for (bad, said) in [
            (
                "127.0.0.1:8080/in/stripe",
                "write it with its scheme, http://127.0.0.1:8080/in/stripe",
            ),
            (
                "localhost:8080",
                "write it with its scheme, http://localhost:8080",
            ),
            (
                "ftp://files.example.com",
                "ftp:// is not http:// or https://",
            ),
            ("http://", "not a URL: empty host"),
        ] {
            let err = http_url(bad).unwrap_err();
            assert!(err.ends_with(said), "{bad}: {err}");
        }
    }

    #[test]
    fn the_flags_are_consistent() {
        Cli::command().debug_assert();
    }

    /// A duration flag takes what the configuration takes: units, or whole seconds.
    #[test]
    fn a_duration_flag_takes_units_or_whole_seconds() {
        assert_eq!(duration_arg("5"), Ok(Duration::from_secs(5)));
        assert_eq!(duration_arg("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration_arg("2h"), Ok(Duration::from_secs(7200)));
        assert!(duration_arg("5 parsecs").is_err());
        assert!(duration_arg("-1").is_err());
    }

    /// Every example in a help text fits a terminal of 100 columns, so none is wrapped in the
    /// middle of a command and each can be pasted as it is shown.
    #[test]
    fn help_examples_fit_a_terminal() {
        // The texts as written: clap wraps what is wider when it prints them.
        fn walk(cmd: &clap::Command, path: &str, long: &mut Vec<String>) {
            let texts = [cmd.get_after_help(), cmd.get_after_long_help()];
            for text in texts.into_iter().flatten().map(ToString::to_string) {
                for line in text.lines().filter(|l| l.chars().count() > 99) {
                    long.push(format!("{path}: {line}"));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), long);
            }
        }
        let mut long = Vec::new();
        walk(&Cli::command(), "hooklatch", &mut long);
        assert!(
            long.is_empty(),
            "examples wider than 99 columns:\n{}",
            long.join("\n")
        );
    }
}
