//! The `khata` command line (DESIGN.md §6.3).
//!
//! One binary: `khata serve` and `khata check` hand over to the daemon
//! ([`crate::daemon`]); every other command is a small client of the daemon's
//! HTTP API (§6.2), built on [`Client`], which tests and benchmarks can reuse.
//!
//! Where the client finds the daemon: `--url` / `KHATA_URL` and `--token` /
//! `KHATA_TOKEN` when given; otherwise `[daemon] listen` and `token` /
//! `token_file` of the configuration file (`-c`, default `jobs.toml`) when it
//! exists; otherwise `http://127.0.0.1:7373` without a token.
//!
//! Exit codes: 0 success, 1 refused or failed (the server's `code: message`
//! on stderr, or a message naming the URL that could not be reached), 2 usage
//! error.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, CommandFactory as _, Parser, Subcommand, ValueEnum};
use reqwest::{Method, RequestBuilder, StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The configuration file read when `-c/--config` is not given.
pub const DEFAULT_CONFIG: &str = "jobs.toml";

/// The daemon's address when neither `--url` nor a configuration file names it.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7373";

/// How long the client waits for a TCP connection to the daemon.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the client waits for a whole answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Parses argv and runs the command; returns the process exit code (0
/// success, 1 refused/failed, 2 usage error).
pub fn main() -> ExitCode {
    run_from(std::env::args_os())
}

/// [`main`] with an explicit argument list (the first item is the program name).
fn run_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => {
            // Help and version go to stdout with 0; real usage errors to
            // stderr with 2. A failure to print is not worth reporting.
            let _ = err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    match cli.run() {
        Ok(code) => code,
        Err(Failure::Usage(err)) => {
            let _ = err.print();
            ExitCode::from(2)
        }
        Err(Failure::Failed(err)) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Why a command did not succeed.
#[derive(Debug)]
enum Failure {
    /// Bad arguments that clap could not see (a payload read from stdin).
    Usage(clap::Error),
    /// The server refused, the daemon was unreachable, or the local side failed.
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(err: anyhow::Error) -> Self {
        Failure::Failed(err)
    }
}

impl From<ClientError> for Failure {
    fn from(err: ClientError) -> Self {
        Failure::Failed(err.into())
    }
}

/// khata: a job runner whose handlers are WebAssembly components and whose
/// effects happen once.
#[derive(Debug, Parser)]
#[command(
    name = "khata",
    version,
    propagate_version = true,
    after_help = "Client commands find the daemon through --url/--token, else through \
                  [daemon] listen and token/token_file of the configuration file, \
                  else at http://127.0.0.1:7373.\n\
                  Exit codes: 0 success, 1 refused or failed, 2 usage error."
)]
pub struct Cli {
    /// Options shared by every command.
    #[command(flatten)]
    pub global: GlobalArgs,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Options accepted by every command (before or after its name).
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Configuration file [default: jobs.toml]
    ///
    /// `serve`, `check` and `store migrate` run it; client commands read `[daemon] listen` and
    /// `token`/`token_file` from it, when it exists and --url is not given.
    #[arg(short, long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Base URL of the daemon's API, e.g. http://127.0.0.1:7373
    #[arg(
        long,
        global = true,
        env = "KHATA_URL",
        value_name = "URL",
        help_heading = "Client options"
    )]
    pub url: Option<String>,

    /// API token, sent as `Authorization: Bearer <TOKEN>`
    #[arg(
        long,
        global = true,
        env = "KHATA_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN",
        help_heading = "Client options"
    )]
    pub token: Option<String>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground (systemd-ready)
    Serve,
    /// Validate the configuration and the plugins; exit 1 with every error
    Check,
    /// Enqueue a job and print its id
    Enqueue(EnqueueArgs),
    /// Show one job with its attempts and effects
    Job {
        /// The job's id
        id: String,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// List jobs, a page at a time
    Jobs(JobsArgs),
    /// Put a dead (or cancelled) job back to waiting
    Retry {
        /// The job's id
        id: String,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Cancel a waiting or delayed job; an active one is interrupted
    Cancel {
        /// The job's id
        id: String,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// List the queues with their plugins and job counts by state
    Queues {
        #[command(flatten)]
        output: OutputArgs,
    },
    /// List the schedules with their next and last fire times
    Schedules {
        #[command(flatten)]
        output: OutputArgs,
    },
    /// List the fences of effects (the uncertain ones need an operator)
    Fences(FencesArgs),
    /// Act on one fence
    #[command(subcommand_required = true, arg_required_else_help = true)]
    Fence {
        #[command(subcommand)]
        command: FenceCommand,
    },
    /// Prove a handler safe to run twice: run it clean, cut at every crash
    /// point of every effect and redelivered, and fresh; exit 1 on any finding
    ///
    /// Runs in this process on throwaway ledgers; every email and HTTP effect is
    /// answered by a recorder, so nothing leaves the machine.
    Verify(VerifyArgs),
    /// Create a handler project in ./NAME that builds as it is
    New(NewArgs),
    /// Manage the configured ledger (on the database itself, not through the daemon)
    #[command(subcommand_required = true, arg_required_else_help = true)]
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
}

/// The subcommands of `khata store`.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Apply the ledger's pending schema migrations and print its schema version
    ///
    /// `khata serve` applies them too when it starts; this does it ahead of
    /// time, for example before starting daemons on a new PostgreSQL database.
    Migrate,
    /// Copy a ledger, fences and all, into an empty one; verify; print a summary
    ///
    /// SOURCE and TARGET are each a jobs.toml (the ledger its [store] and
    /// data_dir name), a data directory (the SQLite or sled ledger it holds;
    /// a target holding neither gets SQLite), or a PostgreSQL
    /// URL (postgres://...). --from-env and --to-env name an environment
    /// variable that holds the URL instead, so that a password stays off the
    /// command line.
    ///
    /// The source's lock is taken (a SQLite or sled ledger a daemon uses is refused),
    /// and jobs a crash left active are recovered first, as the daemon's start
    /// would; a PostgreSQL source with active jobs is refused. The target
    /// must be empty. Jobs with their attempts and effects, dedup keys,
    /// fences (state, fingerprint, recorded result), kv entries and index
    /// documents are copied, and the fencing token and enqueue sequence go on
    /// from the source's. Exit 1 when anything is refused or the two sides
    /// differ at the end.
    Copy(CopyArgs),
}

/// Arguments of `khata store copy`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["from", "from_env"])))]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to", "to_env"])))]
pub struct CopyArgs {
    /// The ledger to copy: a jobs.toml, a data directory (SQLite or sled) or a PostgreSQL URL
    #[arg(long, value_name = "SOURCE")]
    pub from: Option<String>,

    /// An environment variable holding the source's PostgreSQL URL
    #[arg(long, value_name = "VAR")]
    pub from_env: Option<String>,

    /// The empty ledger to copy into: a jobs.toml, a data directory (SQLite unless it holds sled) or a PostgreSQL URL
    #[arg(long, value_name = "TARGET")]
    pub to: Option<String>,

    /// An environment variable holding the target's PostgreSQL URL
    #[arg(long, value_name = "VAR")]
    pub to_env: Option<String>,

    /// Records read and written per step
    #[arg(long, value_name = "N", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub page: u32,
}

impl CopyArgs {
    /// The two ledgers, `from` and `to`.
    fn ledgers(&self) -> anyhow::Result<(crate::daemon::LedgerAt, crate::daemon::LedgerAt)> {
        use crate::daemon::LedgerAt;
        let side = |arg: &Option<String>, env: &Option<String>, flag: &str| match (arg, env) {
            (Some(a), _) => Ok(LedgerAt::parse(a, flag)),
            (None, Some(var)) => LedgerAt::from_env(var, &format!("{flag}-env")),
            (None, None) => anyhow::bail!("{flag} or {flag}-env is required"),
        };
        Ok((
            side(&self.from, &self.from_env, "--from")?,
            side(&self.to, &self.to_env, "--to")?,
        ))
    }
}

/// `--json`, shared by the commands that print an API answer.
#[derive(Debug, Clone, Copy, Args)]
pub struct OutputArgs {
    /// Print the API's JSON answer instead of a summary
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `khata enqueue`.
#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// The queue, as named in jobs.toml
    pub queue: String,

    /// The job's payload as JSON; `-` reads it from stdin
    #[arg(value_name = "PAYLOAD_JSON", default_value = "{}", value_parser = parse_payload)]
    pub payload: PayloadArg,

    /// The job's id: enqueueing the same id again returns the existing job
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,

    /// Returns the live job with this key instead of enqueueing another one
    #[arg(long, value_name = "KEY")]
    pub dedup_key: Option<String>,

    /// Hold the dedup key this long after the first enqueue, whatever the job's state
    #[arg(long, value_name = "DURATION", requires = "dedup_key", value_parser = parse_duration_arg)]
    pub dedup_for: Option<String>,

    /// Run the job no earlier than this from now, e.g. 30s, 5m, 1h
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_arg)]
    pub delay: Option<String>,

    /// Run the job no earlier than this time (RFC 3339)
    #[arg(long, value_name = "TIME", conflicts_with = "delay")]
    pub run_at: Option<String>,

    /// Higher runs first
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub priority: Option<i32>,

    /// Attempts before the job goes dead (default: the queue's)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: Option<u32>,

    #[command(flatten)]
    pub output: OutputArgs,
}

/// Arguments of `khata verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// The plugin: a `.wasm` component
    #[arg(value_name = "PLUGIN.wasm")]
    pub plugin: PathBuf,

    /// The job's payload as JSON
    #[arg(long, value_name = "JSON", default_value = "{}", value_parser = parse_json)]
    pub payload: Value,

    /// Take grants, namespace and limits from this queue of the configuration
    /// file (-c); without it, everything the plugin imports is granted
    #[arg(long, short = 'q', value_name = "QUEUE")]
    pub queue: Option<String>,

    /// Keep compiled plugins in DIR, so that verifying the same component
    /// again does not compile it again [default: $XDG_CACHE_HOME/khata/code-cache,
    /// else ~/.cache/khata/code-cache]
    #[arg(long, value_name = "DIR", conflicts_with = "no_code_cache")]
    pub code_cache: Option<PathBuf>,

    /// Compile the plugin every time; keep nothing on disk
    #[arg(long)]
    pub no_code_cache: bool,

    #[command(flatten)]
    pub output: OutputArgs,
}

/// Arguments of `khata new`.
#[derive(Debug, Args)]
pub struct NewArgs {
    /// The handler's name: the directory, and the crate, Python module or npm
    /// package (letters, digits, `_`, `-`; Python: no `-`; JS: lower case)
    pub name: String,

    /// The handler's language
    #[arg(long, value_enum, default_value_t = crate::scaffold::Lang::Rust)]
    pub lang: crate::scaffold::Lang,
}

/// The `PAYLOAD_JSON` argument, once clap has checked it.
#[derive(Debug, Clone, PartialEq)]
pub enum PayloadArg {
    /// `-`: read the JSON from stdin.
    Stdin,
    /// The JSON given on the command line.
    Json(JsonText),
}

/// JSON text, checked to be JSON and sent as it is: its numbers are not
/// turned into floating point on the way (123456789012345678901234567890
/// stays what it is), nor its keys reordered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonText(String);

impl JsonText {
    pub fn parse(text: &str) -> Result<JsonText, serde_json::Error> {
        serde_json::from_str::<&serde_json::value::RawValue>(text)?;
        Ok(JsonText(text.trim().to_owned()))
    }
}

impl Default for JsonText {
    fn default() -> JsonText {
        JsonText("{}".to_owned())
    }
}

impl Serialize for JsonText {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serde_json::from_str::<&serde_json::value::RawValue>(&self.0)
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

/// Arguments of `khata jobs`.
#[derive(Debug, Args)]
pub struct JobsArgs {
    /// Only jobs of this queue
    #[arg(long, value_name = "QUEUE")]
    pub queue: Option<String>,

    /// Only jobs in this state
    #[arg(long, value_name = "STATE")]
    pub state: Option<JobState>,

    /// At most this many jobs
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,

    /// Continue after a previous page (its next cursor)
    #[arg(long, value_name = "CURSOR")]
    pub cursor: Option<String>,

    #[command(flatten)]
    pub output: OutputArgs,
}

/// Arguments of `khata fences`.
#[derive(Debug, Args)]
pub struct FencesArgs {
    /// Only fences of this namespace
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,

    /// Only fences in this state
    #[arg(long, value_name = "STATE")]
    pub state: Option<FenceState>,

    #[command(flatten)]
    pub output: OutputArgs,
}

/// The subcommands of `khata fence`.
#[derive(Debug, Subcommand)]
pub enum FenceCommand {
    /// Settle an uncertain fence by hand: the effect did or did not happen
    Resolve {
        /// The fence's namespace
        namespace: String,
        /// The effect kind (kv, index, email, http)
        kind: String,
        /// The effect's idempotency key
        key: String,
        /// What happened to the effect
        outcome: FenceOutcome,
    },
}

/// A job's state (DESIGN.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum JobState {
    /// Ready to run.
    Waiting,
    /// Waiting for its run time (including backoff).
    Delayed,
    /// Leased to an attempt.
    Active,
    /// Done, with a result.
    Completed,
    /// In the dead-letter queue.
    Dead,
    /// Cancelled.
    Cancelled,
}

impl JobState {
    /// The state's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Waiting => "waiting",
            JobState::Delayed => "delayed",
            JobState::Active => "active",
            JobState::Completed => "completed",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// A fence's state (DESIGN.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FenceState {
    /// The effect was started and has not been recorded done.
    Started,
    /// The effect happened; its result is recorded.
    Done,
    /// Nobody knows whether the effect happened: an operator decides.
    Uncertain,
}

impl FenceState {
    /// The state's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            FenceState::Started => "started",
            FenceState::Done => "done",
            FenceState::Uncertain => "uncertain",
        }
    }
}

/// How an operator resolves a fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FenceOutcome {
    /// The effect happened: record it done, so it is never performed again.
    Done,
    /// The effect did not happen: release the fence, so a retry performs it.
    NotDone,
}

impl FenceOutcome {
    /// The outcome's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            FenceOutcome::Done => "done",
            FenceOutcome::NotDone => "not-done",
        }
    }
}

fn parse_json(arg: &str) -> Result<Value, String> {
    serde_json::from_str(arg).map_err(|err| format!("not JSON: {err}"))
}

fn parse_payload(arg: &str) -> Result<PayloadArg, String> {
    if arg == "-" {
        return Ok(PayloadArg::Stdin);
    }
    JsonText::parse(arg)
        .map(PayloadArg::Json)
        .map_err(|err| format!("not JSON: {err}"))
}

/// Checks a duration such as `30s` or `1h 30m`, and keeps it as written: the
/// API takes durations as strings.
fn parse_duration_arg(arg: &str) -> Result<String, String> {
    let arg = arg.trim();
    humantime::parse_duration(arg)
        .map(|_| arg.to_owned())
        .map_err(|err| format!("{err} (expected e.g. 500ms, 30s, 5m, 1h)"))
}

impl Cli {
    fn run(self) -> Result<ExitCode, Failure> {
        let Cli { global, command } = self;
        match command {
            Command::Serve => {
                let config_path = global.config_path();
                crate::daemon::serve(&config_path)?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Check => {
                let config_path = global.config_path();
                let valid = crate::daemon::check(&config_path)?;
                Ok(if valid {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                })
            }
            Command::Store {
                command: StoreCommand::Migrate,
            } => {
                crate::daemon::store_migrate(&global.config_path())?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Verify(args) => {
                let options = crate::verify::Options {
                    plugin: args.plugin,
                    payload: args.payload,
                    queue: args.queue,
                    config: global.config_path(),
                    code_cache: if args.no_code_cache {
                        None
                    } else {
                        args.code_cache.or_else(crate::verify::default_code_cache)
                    },
                };
                match crate::verify::verify(&options) {
                    Ok(report) => {
                        let out = if args.output.json {
                            let mut text = serde_json::to_string_pretty(&report)
                                .context("cannot write the report as JSON")?;
                            text.push('\n');
                            text
                        } else {
                            report.render()
                        };
                        print_stdout(&out)?;
                        Ok(if report.findings.is_empty() {
                            ExitCode::SUCCESS
                        } else {
                            ExitCode::FAILURE
                        })
                    }
                    Err(crate::verify::VerifyError::Input(msg)) => {
                        eprintln!("error: {msg}");
                        Ok(ExitCode::from(2))
                    }
                    Err(crate::verify::VerifyError::Failed(msg)) => {
                        Err(Failure::Failed(anyhow::anyhow!(msg)))
                    }
                }
            }
            Command::New(args) => {
                match crate::scaffold::create(Path::new("."), &args.name, args.lang) {
                    Ok(created) => {
                        print_stdout(&created.render())?;
                        Ok(ExitCode::SUCCESS)
                    }
                    Err(crate::scaffold::ScaffoldError::Usage(msg)) => {
                        eprintln!("error: {msg}");
                        Ok(ExitCode::from(2))
                    }
                    Err(crate::scaffold::ScaffoldError::Failed(msg)) => {
                        Err(Failure::Failed(anyhow::anyhow!(msg)))
                    }
                }
            }
            Command::Store {
                command: StoreCommand::Copy(args),
            } => {
                let (from, to) = args.ledgers()?;
                crate::daemon::store_copy(&from, &to, args.page)?;
                Ok(ExitCode::SUCCESS)
            }
            command => {
                // Read stdin before talking to anyone, so that a bad payload
                // is a usage error whether or not the daemon is up.
                let enqueue_payload = match &command {
                    Command::Enqueue(args) => Some(args.payload()?),
                    _ => None,
                };
                let endpoint = global.endpoint()?;
                let client = Client::new(&endpoint.url, endpoint.token)?;
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("cannot start the async runtime")?;
                let out = runtime.block_on(run_client(&client, command, enqueue_payload))?;
                print_stdout(&out)?;
                Ok(ExitCode::SUCCESS)
            }
        }
    }
}

impl GlobalArgs {
    /// The configuration file: `-c` or `jobs.toml`.
    pub fn config_path(&self) -> PathBuf {
        self.config
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG))
    }

    /// Where the client commands find the daemon; see [`resolve_endpoint`].
    pub fn endpoint(&self) -> anyhow::Result<Endpoint> {
        resolve_endpoint(
            self.url.as_deref(),
            self.token.as_deref(),
            self.config.as_deref(),
        )
    }
}

impl EnqueueArgs {
    /// The payload, read from stdin for `-`.
    fn payload(&self) -> Result<JsonText, Failure> {
        match &self.payload {
            PayloadArg::Json(value) => Ok(value.clone()),
            PayloadArg::Stdin => {
                let text = io::read_to_string(io::stdin())
                    .context("cannot read PAYLOAD_JSON from stdin")?;
                JsonText::parse(&text).map_err(|err| {
                    let mut cli = Cli::command();
                    cli.build();
                    let enqueue = cli
                        .find_subcommand_mut("enqueue")
                        .expect("enqueue is a subcommand");
                    Failure::Usage(enqueue.error(
                        clap::error::ErrorKind::ValueValidation,
                        format!(
                            "invalid value for '[PAYLOAD_JSON]' (read from stdin): not JSON: {err}"
                        ),
                    ))
                })
            }
        }
    }

    /// The API's enqueue body.
    fn request(&self, payload: JsonText) -> EnqueueRequest {
        EnqueueRequest {
            payload,
            id: self.id.clone(),
            dedup_key: self.dedup_key.clone(),
            dedup_for: self.dedup_for.clone(),
            delay: self.delay.clone(),
            run_at: self.run_at.clone(),
            priority: self.priority,
            max_attempts: self.max_attempts,
        }
    }
}

/// Runs one client command; returns what to print on stdout.
async fn run_client(
    client: &Client,
    command: Command,
    enqueue_payload: Option<JsonText>,
) -> Result<String, ClientError> {
    let out = match command {
        Command::Enqueue(args) => {
            let payload = enqueue_payload.unwrap_or_default();
            let answer = client.enqueue(&args.queue, &args.request(payload)).await?;
            if args.output.json {
                pretty(&answer)
            } else {
                let mut line = text(&answer["job"]["id"]);
                if answer["deduplicated"].as_bool() == Some(true) {
                    line.push_str(" (deduplicated)");
                }
                line + "\n"
            }
        }
        Command::Job { id, output } => {
            let job = client.job(&id).await?;
            if output.json {
                pretty(&job)
            } else {
                render_job(&job)
            }
        }
        Command::Jobs(args) => {
            let query = JobsQuery {
                queue: args.queue,
                state: args.state.map(|s| s.as_str().to_owned()),
                limit: args.limit,
                cursor: args.cursor,
            };
            let page = client.jobs(&query).await?;
            if args.output.json {
                pretty(&page)
            } else {
                render_jobs(&page)
            }
        }
        Command::Retry { id, output } => {
            let answer = client.retry(&id).await?;
            if output.json {
                pretty(&answer)
            } else {
                render_job_state(&answer["job"], &id)
            }
        }
        Command::Cancel { id, output } => {
            let answer = client.cancel(&id).await?;
            if output.json {
                pretty(&answer)
            } else {
                render_job_state(&answer["job"], &id)
            }
        }
        Command::Queues { output } => {
            let answer = client.queues().await?;
            if output.json {
                pretty(&answer)
            } else {
                render_queues(&answer)
            }
        }
        Command::Schedules { output } => {
            let answer = client.schedules().await?;
            if output.json {
                pretty(&answer)
            } else {
                render_schedules(&answer)
            }
        }
        Command::Fences(args) => {
            let answer = client
                .fences(
                    args.namespace.as_deref(),
                    args.state.map(FenceState::as_str),
                )
                .await?;
            if args.output.json {
                pretty(&answer)
            } else {
                render_fences(&answer)
            }
        }
        Command::Fence {
            command:
                FenceCommand::Resolve {
                    namespace,
                    kind,
                    key,
                    outcome,
                },
        } => {
            client
                .resolve_fence(&namespace, &kind, &key, outcome)
                .await?;
            format!(
                "fence {namespace}/{kind}/{key} resolved as {}\n",
                outcome.as_str()
            )
        }
        Command::Serve
        | Command::Check
        | Command::Store { .. }
        | Command::Verify(_)
        | Command::New(_) => {
            unreachable!("handled without a client")
        }
    };
    Ok(out)
}

/// Writes to stdout; a closed pipe (`khata jobs | head`) is not an error.
fn print_stdout(out: &str) -> anyhow::Result<()> {
    let mut stdout = io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(err) if err.kind() != io::ErrorKind::BrokenPipe => {
            Err(err).context("cannot write to stdout")
        }
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------
// Finding the daemon

/// Where the daemon's API is, and the token it wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Base URL, e.g. `http://127.0.0.1:7373`.
    pub url: String,
    /// Bearer token, if one is known.
    pub token: Option<String>,
}

/// The part of jobs.toml that the client reads; the rest is the daemon's.
#[derive(Debug, Default, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    daemon: DaemonSection,
}

#[derive(Debug, Default, Deserialize)]
struct DaemonSection {
    listen: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
}

/// Decides where the client commands find the daemon.
///
/// `url` (from `--url`/`KHATA_URL`) wins; the configuration file is then not
/// read and the token is `token` alone. Without `url`, the configuration
/// file (`config`, or `jobs.toml` when it exists) gives the URL from
/// `[daemon] listen` and the token from `[daemon] token` or `token_file`
/// (relative to the file's directory), unless `token` is given. Without
/// either, [`DEFAULT_URL`]. A `config` that was named but cannot be read is
/// an error; empty values count as absent.
pub fn resolve_endpoint(
    url: Option<&str>,
    token: Option<&str>,
    config: Option<&Path>,
) -> anyhow::Result<Endpoint> {
    let given_token = token.map(str::trim).filter(|t| !t.is_empty());
    if let Some(url) = url.map(str::trim).filter(|u| !u.is_empty()) {
        return Ok(Endpoint {
            url: url.to_owned(),
            token: given_token.map(str::to_owned),
        });
    }
    let (path, required) = match config {
        Some(path) => (path, true),
        None => (Path::new(DEFAULT_CONFIG), false),
    };
    let mut endpoint = if required || path.exists() {
        endpoint_from_config(path)?
    } else {
        Endpoint {
            url: DEFAULT_URL.to_owned(),
            token: None,
        }
    };
    if let Some(token) = given_token {
        endpoint.token = Some(token.to_owned());
    }
    Ok(endpoint)
}

/// Reads the daemon's URL and token from a configuration file.
fn endpoint_from_config(path: &Path) -> anyhow::Result<Endpoint> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read configuration file {}", path.display()))?;
    let config: ConfigFile = toml::from_str(&text)
        .with_context(|| format!("invalid configuration file {}", path.display()))?;
    let DaemonSection {
        listen,
        token,
        token_file,
    } = config.daemon;
    let url = match listen.as_deref().map(str::trim).filter(|l| !l.is_empty()) {
        Some(listen) => url_from_listen(listen),
        None => DEFAULT_URL.to_owned(),
    };
    let token = match (token, token_file) {
        (Some(token), _) => Some(token.trim().to_owned()),
        (None, Some(file)) => {
            let file = match path.parent() {
                Some(dir) => dir.join(file),
                None => file,
            };
            let token = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "cannot read the token file {} named in {} (or pass --token / KHATA_TOKEN)",
                    file.display(),
                    path.display()
                )
            })?;
            Some(token.trim().to_owned())
        }
        (None, None) => None,
    };
    Ok(Endpoint {
        url,
        token: token.filter(|t| !t.is_empty()),
    })
}

/// The URL at which a client reaches a daemon listening on `listen`: a
/// wildcard address (`0.0.0.0`, `[::]`) is reached on loopback.
fn url_from_listen(listen: &str) -> String {
    if listen.contains("://") {
        return listen.to_owned();
    }
    match listen.parse::<SocketAddr>() {
        Ok(mut addr) => {
            if addr.ip().is_unspecified() {
                addr.set_ip(match addr.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                });
            }
            format!("http://{addr}")
        }
        Err(_) => format!("http://{listen}"),
    }
}

// ---------------------------------------------------------------------------
// The API client

/// A client of the daemon's HTTP API (DESIGN.md §6.2), one method per route.
///
/// Answers are returned as the API's JSON, unchanged.
#[derive(Debug, Clone)]
pub struct Client {
    base: Url,
    token: Option<String>,
    http: reqwest::Client,
}

/// Why an API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The base URL is not usable.
    #[error("invalid daemon URL {url:?}: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No answer: refused connection, unknown host, timeout...
    #[error("cannot reach the daemon at {url}: {reason}")]
    Unreachable {
        /// The daemon's base URL.
        url: String,
        /// The transport's explanation.
        reason: String,
    },
    /// The server answered with an error status.
    #[error("{code}: {message}")]
    Api {
        /// The HTTP status.
        status: StatusCode,
        /// The API's error code, e.g. `id_reused`.
        code: String,
        /// The API's explanation.
        message: String,
    },
    /// The server answered something that is not the API's JSON.
    #[error("unexpected answer from {url}: {reason}")]
    BadResponse {
        /// The request's URL.
        url: String,
        /// What was wrong.
        reason: String,
    },
}

/// The body of `POST /v1/queues/{queue}/jobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EnqueueRequest {
    /// The job's payload.
    pub payload: JsonText,
    /// A stable job id (deduplicates enqueues).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A deduplication key, per queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup_key: Option<String>,
    /// How long the dedup key is held, e.g. `"10m"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup_for: Option<String>,
    /// Delay before the first run, e.g. `"30s"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay: Option<String>,
    /// Earliest run time, RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_at: Option<String>,
    /// Higher runs first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Overrides the queue's `max_attempts`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
}

/// The filters of `GET /v1/jobs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobsQuery {
    /// Only jobs of this queue.
    pub queue: Option<String>,
    /// Only jobs in this state (`waiting`, `dead`...).
    pub state: Option<String>,
    /// Page size.
    pub limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

impl Client {
    /// A client of the daemon at `base` (`http://host:port`, optionally with
    /// a path prefix; a bare `host:port` means `http://host:port`).
    pub fn new(base: &str, token: Option<String>) -> Result<Self, ClientError> {
        let bad = |reason: String| ClientError::BadUrl {
            url: base.to_owned(),
            reason,
        };
        let with_scheme = if base.contains("://") {
            base.to_owned()
        } else {
            format!("http://{base}")
        };
        let url = Url::parse(&with_scheme).map_err(|err| bad(err.to_string()))?;
        if url.scheme() != "http" {
            return Err(bad(format!(
                "the scheme must be http, not {} (this client has no TLS)",
                url.scheme()
            )));
        }
        if url.host().is_none() {
            return Err(bad("no host".to_owned()));
        }
        crate::effects::http::install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("khata/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| bad(error_chain(&err)))?;
        Ok(Client {
            base: url,
            token: token.filter(|t| !t.is_empty()),
            http,
        })
    }

    /// The daemon's base URL.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// `GET /healthz`: `Ok` when the daemon answers.
    pub async fn health(&self) -> Result<(), ClientError> {
        self.call(Method::GET, &["healthz"], |r| r).await.map(drop)
    }

    /// `POST /v1/queues/{queue}/jobs`: `{job, deduplicated}`.
    pub async fn enqueue(
        &self,
        queue: &str,
        request: &EnqueueRequest,
    ) -> Result<Value, ClientError> {
        self.call(Method::POST, &["v1", "queues", queue, "jobs"], |r| {
            r.json(request)
        })
        .await
    }

    /// `POST /v1/queues/{queue}/jobs/batch`: `{results: [{job, deduplicated}]}`.
    pub async fn enqueue_batch(
        &self,
        queue: &str,
        requests: &[EnqueueRequest],
    ) -> Result<Value, ClientError> {
        let body = serde_json::json!({ "jobs": requests });
        self.call(
            Method::POST,
            &["v1", "queues", queue, "jobs", "batch"],
            |r| r.json(&body),
        )
        .await
    }

    /// `GET /v1/jobs/{id}`: the job with its attempts and effects.
    pub async fn job(&self, id: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &["v1", "jobs", id], |r| r).await
    }

    /// `GET /v1/jobs`: `{jobs, next_cursor}`.
    pub async fn jobs(&self, query: &JobsQuery) -> Result<Value, ClientError> {
        let mut params: Vec<(&str, String)> = Vec::new();
        if let Some(queue) = &query.queue {
            params.push(("queue", queue.clone()));
        }
        if let Some(state) = &query.state {
            params.push(("state", state.clone()));
        }
        if let Some(limit) = query.limit {
            params.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = &query.cursor {
            params.push(("cursor", cursor.clone()));
        }
        self.call(Method::GET, &["v1", "jobs"], |r| r.query(&params))
            .await
    }

    /// `POST /v1/jobs/{id}/retry`: `{job}`.
    pub async fn retry(&self, id: &str) -> Result<Value, ClientError> {
        self.call(Method::POST, &["v1", "jobs", id, "retry"], |r| {
            r.header(reqwest::header::CONTENT_TYPE, "application/json")
        })
        .await
    }

    /// `DELETE /v1/jobs/{id}`: `{job}`.
    pub async fn cancel(&self, id: &str) -> Result<Value, ClientError> {
        self.call(Method::DELETE, &["v1", "jobs", id], |r| r).await
    }

    /// `GET /v1/queues`: `{queues}`.
    pub async fn queues(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, &["v1", "queues"], |r| r).await
    }

    /// `GET /v1/schedules`: `{schedules}`.
    pub async fn schedules(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, &["v1", "schedules"], |r| r).await
    }

    /// `GET /v1/fences`: `{fences}`.
    pub async fn fences(
        &self,
        namespace: Option<&str>,
        state: Option<&str>,
    ) -> Result<Value, ClientError> {
        let mut params: Vec<(&str, &str)> = Vec::new();
        if let Some(namespace) = namespace {
            params.push(("namespace", namespace));
        }
        if let Some(state) = state {
            params.push(("state", state));
        }
        self.call(Method::GET, &["v1", "fences"], |r| r.query(&params))
            .await
    }

    /// `POST /v1/fences/resolve`.
    pub async fn resolve_fence(
        &self,
        namespace: &str,
        kind: &str,
        key: &str,
        outcome: FenceOutcome,
    ) -> Result<Value, ClientError> {
        let body = serde_json::json!({
            "namespace": namespace,
            "kind": kind,
            "key": key,
            "outcome": outcome,
        });
        self.call(Method::POST, &["v1", "fences", "resolve"], |r| {
            r.json(&body)
        })
        .await
    }

    /// The URL of a route: the base URL's path, then `segments`, each
    /// percent-encoded.
    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        url.set_query(None);
        url.set_fragment(None);
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// Sends one request; returns the answer's JSON (`null` for an empty body).
    async fn call(
        &self,
        method: Method,
        segments: &[&str],
        build: impl FnOnce(RequestBuilder) -> RequestBuilder,
    ) -> Result<Value, ClientError> {
        let url = self.url(segments);
        let mut request = build(self.http.request(method, url.clone()));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let unreachable = |err: reqwest::Error| ClientError::Unreachable {
            url: self.base.as_str().trim_end_matches('/').to_owned(),
            reason: if err.is_timeout() {
                "no answer in time".to_owned()
            } else {
                root_cause(&err)
            },
        };
        let response = request.send().await.map_err(unreachable)?;
        let status = response.status();
        let body = response.bytes().await.map_err(unreachable)?;
        if !status.is_success() {
            return Err(api_error(status, &body));
        }
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body).map_err(|err| ClientError::BadResponse {
            url: url.to_string(),
            reason: format!("not JSON: {err}"),
        })
    }
}

/// The error of a non-2xx answer: the API's `{error: {code, message}}`, or
/// the status and the start of whatever body came instead (a proxy's page).
fn api_error(status: StatusCode, body: &[u8]) -> ClientError {
    #[derive(Deserialize)]
    struct Envelope {
        error: ErrorBody,
    }
    #[derive(Deserialize)]
    struct ErrorBody {
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Envelope>(body) {
        Ok(Envelope { error }) => ClientError::Api {
            status,
            code: error.code,
            message: error.message,
        },
        Err(_) => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let message = if text.is_empty() {
                status.canonical_reason().unwrap_or("no message").to_owned()
            } else {
                let mut short: String = text.chars().take(200).collect();
                if short.len() < text.len() {
                    short.push('…');
                }
                short
            };
            ClientError::Api {
                status,
                code: format!("http_{}", status.as_u16()),
                message,
            }
        }
    }
}

/// The innermost explanation of an error ("Connection refused (os error
/// 111)"), which says more than reqwest's own "error sending request".
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = err;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

/// An error with all its causes, `outer: inner: ...`.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(source) = cause {
        let _ = write!(text, ": {source}");
        cause = source.source();
    }
    text
}

// ---------------------------------------------------------------------------
// Human output

fn pretty(value: &Value) -> String {
    // Serializing a `Value` cannot fail.
    serde_json::to_string_pretty(value).unwrap_or_default() + "\n"
}

/// A value as one table cell or field: strings as they are, `null` or absent
/// as `-`, anything else as compact JSON.
fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(s) if s.is_empty() => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Like [`text`], on one line (for tables).
fn cell(value: &Value) -> String {
    text(value)
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Columns aligned with two spaces between them; the last is not padded.
fn table(indent: &str, headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, value) in widths.iter_mut().zip(row) {
            *width = (*width).max(value.chars().count());
        }
    }
    let mut out = String::new();
    let headers: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&headers).chain(rows) {
        let mut line = indent.to_owned();
        for (i, (value, width)) in row.iter().zip(&widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(value);
            } else {
                let _ = write!(line, "{value:<width$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One `label  value` line; the lines of a multi-line value are aligned.
fn field(out: &mut String, label: &str, value: &str) {
    const WIDTH: usize = 13;
    let mut lines = value.lines();
    let _ = writeln!(out, "{label:<WIDTH$}{}", lines.next().unwrap_or("-"));
    for line in lines {
        let _ = writeln!(out, "{:WIDTH$}{line}", "");
    }
}

fn render_job(job: &Value) -> String {
    let mut out = String::new();
    field(&mut out, "id", &text(&job["id"]));
    field(&mut out, "queue", &text(&job["queue"]));
    field(&mut out, "state", &text(&job["state"]));
    field(
        &mut out,
        "attempt",
        &format!(
            "{} of {}",
            text(&job["attempt"]),
            text(&job["max_attempts"])
        ),
    );
    field(&mut out, "priority", &text(&job["priority"]));
    field(&mut out, "dedup key", &text(&job["dedup_key"]));
    field(&mut out, "run at", &text(&job["run_at"]));
    field(&mut out, "enqueued at", &text(&job["enqueued_at"]));
    field(&mut out, "finished at", &text(&job["finished_at"]));
    field(&mut out, "payload", &text(&job["payload"]));
    field(&mut out, "result", &text(&job["result"]));
    field(&mut out, "last error", &text(&job["last_error"]));

    let attempts = job["attempts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    out.push('\n');
    if attempts.is_empty() {
        out.push_str("attempts: none\n");
    } else {
        out.push_str("attempts:\n");
        let rows: Vec<Vec<String>> = attempts
            .iter()
            .map(|a| {
                vec![
                    cell(&a["number"]),
                    cell(&a["started_at"]),
                    cell(&a["ended_at"]),
                    cell(&a["outcome"]),
                    cell(&a["fencing_token"]),
                    cell(&a["plugin_version"]).chars().take(12).collect(),
                    cell(&a["error"]),
                ]
            })
            .collect();
        out.push_str(&table(
            "  ",
            &[
                "#", "STARTED", "ENDED", "OUTCOME", "TOKEN", "VERSION", "ERROR",
            ],
            &rows,
        ));
    }

    let effects = job["effects"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if effects.is_empty() {
        out.push_str("effects: none\n");
    } else {
        out.push_str("effects:\n");
        let rows: Vec<Vec<String>> = effects
            .iter()
            .map(|e| {
                vec![
                    cell(&e["attempt"]),
                    cell(&e["kind"]),
                    cell(&e["key"]),
                    cell(&e["outcome"]),
                    cell(&e["at"]),
                ]
            })
            .collect();
        out.push_str(&table(
            "  ",
            &["ATTEMPT", "KIND", "KEY", "OUTCOME", "AT"],
            &rows,
        ));
    }
    out
}

fn render_jobs(page: &Value) -> String {
    let jobs = page["jobs"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let mut out = if jobs.is_empty() {
        "no jobs\n".to_owned()
    } else {
        let rows: Vec<Vec<String>> = jobs
            .iter()
            .map(|job| {
                vec![
                    cell(&job["id"]),
                    cell(&job["queue"]),
                    cell(&job["state"]),
                    format!("{}/{}", cell(&job["attempt"]), cell(&job["max_attempts"])),
                    cell(&job["enqueued_at"]),
                ]
            })
            .collect();
        table(
            "",
            &["ID", "QUEUE", "STATE", "ATTEMPT", "ENQUEUED AT"],
            &rows,
        )
    };
    if let Some(cursor) = page["next_cursor"].as_str().filter(|c| !c.is_empty()) {
        let _ = writeln!(out, "more: --cursor {cursor}");
    }
    out
}

fn render_job_state(job: &Value, id: &str) -> String {
    let id = job["id"].as_str().unwrap_or(id);
    format!("{id}: {}\n", text(&job["state"]))
}

fn render_schedules(answer: &Value) -> String {
    let schedules = answer["schedules"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if schedules.is_empty() {
        return "no schedules\n".to_owned();
    }
    let any_error = schedules.iter().any(|s| !s["last_error"].is_null());
    let mut headers = vec![
        "NAME",
        "QUEUE",
        "CRON",
        "TIMEZONE",
        "NEXT FIRE",
        "LAST FIRE",
    ];
    if any_error {
        headers.push("LAST ERROR");
    }
    let rows: Vec<Vec<String>> = schedules
        .iter()
        .map(|s| {
            let mut row = vec![
                cell(&s["name"]),
                cell(&s["queue"]),
                cell(&s["cron"]),
                cell(&s["timezone"]),
                cell(&s["next_fire"]),
                cell(&s["last_fire"]),
            ];
            if any_error {
                row.push(cell(&s["last_error"]));
            }
            row
        })
        .collect();
    table("", &headers, &rows)
}

fn render_queues(answer: &Value) -> String {
    let queues = answer["queues"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if queues.is_empty() {
        return "no queues\n".to_owned();
    }
    let any_error = queues.iter().any(|q| !q["load_error"].is_null());
    let mut headers = vec![
        "NAME",
        "PLUGIN",
        "VERSION",
        "WAITING",
        "DELAYED",
        "ACTIVE",
        "COMPLETED",
        "DEAD",
        "CANCELLED",
    ];
    if any_error {
        headers.push("LOAD ERROR");
    }
    let rows: Vec<Vec<String>> = queues
        .iter()
        .map(|q| {
            let counts = &q["counts"];
            let mut row = vec![
                cell(&q["name"]),
                cell(&q["plugin"]),
                cell(&q["version"]).chars().take(12).collect(),
                cell(&counts["waiting"]),
                cell(&counts["delayed"]),
                cell(&counts["active"]),
                cell(&counts["completed"]),
                cell(&counts["dead"]),
                cell(&counts["cancelled"]),
            ];
            if any_error {
                row.push(cell(&q["load_error"]));
            }
            row
        })
        .collect();
    table("", &headers, &rows)
}

fn render_fences(answer: &Value) -> String {
    let fences = answer["fences"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if fences.is_empty() {
        return "no fences\n".to_owned();
    }
    let rows: Vec<Vec<String>> = fences
        .iter()
        .map(|f| {
            vec![
                cell(&f["namespace"]),
                cell(&f["kind"]),
                cell(&f["key"]),
                cell(&f["state"]),
                cell(&f["job_id"]),
                cell(&f["attempt"]),
                cell(&f["updated_at"]),
            ]
        })
        .collect();
    table(
        "",
        &[
            "NAMESPACE",
            "KIND",
            "KEY",
            "STATE",
            "JOB",
            "ATTEMPT",
            "UPDATED AT",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;
    use serde_json::json;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("khata").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serve_and_check_take_a_config_path() {
        let cli = parse(&["serve", "-c", "/etc/khata/jobs.toml"]).unwrap();
        assert!(matches!(cli.command, Command::Serve));
        assert_eq!(
            cli.global.config_path(),
            PathBuf::from("/etc/khata/jobs.toml")
        );

        let cli = parse(&["--config", "x.toml", "check"]).unwrap();
        assert!(matches!(cli.command, Command::Check));
        assert_eq!(cli.global.config_path(), PathBuf::from("x.toml"));

        let cli = parse(&["check"]).unwrap();
        assert_eq!(cli.global.config_path(), PathBuf::from("jobs.toml"));

        let cli = parse(&["store", "migrate", "-c", "x.toml"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Store {
                command: StoreCommand::Migrate
            }
        ));
        assert_eq!(cli.global.config_path(), PathBuf::from("x.toml"));
        assert!(parse(&["store"]).is_err(), "a store subcommand is required");
    }

    #[test]
    fn store_copy_takes_one_source_and_one_target() {
        use crate::daemon::LedgerAt;
        let cli = parse(&["store", "copy", "--from", "data", "--to-env", "PG_URL"]).unwrap();
        let Command::Store {
            command: StoreCommand::Copy(args),
        } = cli.command
        else {
            panic!("not store copy: {:?}", cli.command);
        };
        assert_eq!(args.page, 500);
        assert_eq!(
            LedgerAt::parse(args.from.as_deref().unwrap(), "--from"),
            LedgerAt::DataDir(PathBuf::from("data"))
        );
        assert_eq!(args.to_env.as_deref(), Some("PG_URL"));
        assert!(matches!(
            LedgerAt::parse("postgres://u:p@h/db", "--to"),
            LedgerAt::Postgres { named, .. } if named == "the URL of --to"
        ));
        assert_eq!(
            LedgerAt::parse("/etc/khata/jobs.toml", "--to"),
            LedgerAt::Config(PathBuf::from("/etc/khata/jobs.toml"))
        );
        for bad in [
            &["store", "copy", "--from", "a"][..],
            &["store", "copy", "--to", "b"],
            &[
                "store",
                "copy",
                "--from",
                "a",
                "--from-env",
                "X",
                "--to",
                "b",
            ],
            &["store", "copy", "--from", "a", "--to", "b", "--page", "0"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} is a usage error");
        }
    }

    #[test]
    fn enqueue_with_every_option() {
        let cli = parse(&[
            "enqueue",
            "welcome-email",
            r#"{"user_id": 42}"#,
            "--id",
            "job-1",
            "--dedup-key",
            "user-42",
            "--dedup-for",
            "10m",
            "--delay",
            "30s",
            "--priority",
            "-3",
            "--max-attempts",
            "7",
            "--json",
            "--url",
            "http://example:1",
        ])
        .unwrap();
        let Command::Enqueue(args) = cli.command else {
            panic!("not enqueue: {:?}", cli.command)
        };
        assert_eq!(args.queue, "welcome-email");
        assert!(args.output.json);
        assert_eq!(cli.global.url.as_deref(), Some("http://example:1"));
        let payload = match args.payload.clone() {
            PayloadArg::Json(v) => v,
            PayloadArg::Stdin => panic!("stdin"),
        };
        let body = serde_json::to_value(args.request(payload)).unwrap();
        assert_eq!(
            body,
            json!({
                "payload": {"user_id": 42},
                "id": "job-1",
                "dedup_key": "user-42",
                "dedup_for": "10m",
                "delay": "30s",
                "priority": -3,
                "max_attempts": 7,
            })
        );
    }

    #[test]
    fn enqueue_payload_defaults_to_an_empty_object_and_dash_means_stdin() {
        let Command::Enqueue(args) = parse(&["enqueue", "q"]).unwrap().command else {
            panic!()
        };
        assert_eq!(args.payload, PayloadArg::Json(JsonText::default()));
        let body = serde_json::to_value(args.request(JsonText::default())).unwrap();
        assert_eq!(body, json!({"payload": {}}));

        let Command::Enqueue(args) = parse(&["enqueue", "q", "-"]).unwrap().command else {
            panic!()
        };
        assert_eq!(args.payload, PayloadArg::Stdin);
    }

    #[test]
    fn enqueue_refuses_bad_arguments_as_usage_errors() {
        let err = parse(&["enqueue", "q", "{not json"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueValidation);
        assert_eq!(err.exit_code(), 2);
        let message = err.to_string();
        assert!(message.contains("PAYLOAD_JSON"), "{message}");
        assert!(message.contains("key must be a string"), "{message}");

        let err = parse(&["enqueue", "q", "--delay", "soon"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueValidation);

        let err = parse(&["enqueue", "q", "--dedup-for", "1m"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);

        let err = parse(&[
            "enqueue",
            "q",
            "--delay",
            "1m",
            "--run-at",
            "2030-01-01T00:00:00Z",
        ])
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ArgumentConflict);

        let err = parse(&["enqueue", "q", "--max-attempts", "0"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueValidation);

        let err = parse(&["enqueue"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn read_commands() {
        let cli = parse(&["job", "abc", "--json"]).unwrap();
        assert!(
            matches!(cli.command, Command::Job { ref id, output } if id == "abc" && output.json)
        );

        let Command::Jobs(args) = parse(&[
            "jobs", "--queue", "q", "--state", "dead", "--limit", "5", "--cursor", "c1",
        ])
        .unwrap()
        .command
        else {
            panic!()
        };
        assert_eq!(args.queue.as_deref(), Some("q"));
        assert_eq!(args.state, Some(JobState::Dead));
        assert_eq!(args.limit, Some(5));
        assert_eq!(args.cursor.as_deref(), Some("c1"));
        assert!(!args.output.json);

        let err = parse(&["jobs", "--state", "sleeping"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidValue);

        assert!(matches!(
            parse(&["queues", "--json"]).unwrap().command,
            Command::Queues { output } if output.json
        ));

        let Command::Fences(args) =
            parse(&["fences", "--state", "uncertain", "--namespace", "users"])
                .unwrap()
                .command
        else {
            panic!()
        };
        assert_eq!(args.state, Some(FenceState::Uncertain));
        assert_eq!(args.namespace.as_deref(), Some("users"));
    }

    #[test]
    fn write_commands() {
        assert!(matches!(
            parse(&["retry", "j1"]).unwrap().command,
            Command::Retry { ref id, .. } if id == "j1"
        ));
        assert!(matches!(
            parse(&["cancel", "j1"]).unwrap().command,
            Command::Cancel { ref id, .. } if id == "j1"
        ));

        let cli = parse(&[
            "fence",
            "resolve",
            "users",
            "email",
            "welcome:42",
            "not-done",
        ])
        .unwrap();
        let Command::Fence {
            command:
                FenceCommand::Resolve {
                    namespace,
                    kind,
                    key,
                    outcome,
                },
        } = cli.command
        else {
            panic!()
        };
        assert_eq!(
            (namespace.as_str(), kind.as_str(), key.as_str()),
            ("users", "email", "welcome:42")
        );
        assert_eq!(outcome, FenceOutcome::NotDone);
        assert_eq!(serde_json::to_value(outcome).unwrap(), json!("not-done"));

        let err = parse(&["fence", "resolve", "users", "email", "k", "maybe"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidValue);
    }

    #[test]
    fn help_and_version_exit_zero() {
        for args in [&["--help"][..], &["--version"], &["enqueue", "--help"]] {
            let err = parse(args).unwrap_err();
            assert_eq!(err.exit_code(), 0, "{args:?}");
        }
        let err = parse(&[]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
        let err = parse(&["frobnicate"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn an_explicit_url_wins_and_skips_the_config() {
        let endpoint = resolve_endpoint(
            Some("http://10.0.0.1:9000"),
            Some("t0k"),
            Some(Path::new("/does/not/exist.toml")),
        )
        .unwrap();
        assert_eq!(
            endpoint,
            Endpoint {
                url: "http://10.0.0.1:9000".to_owned(),
                token: Some("t0k".to_owned())
            }
        );
    }

    #[test]
    fn the_config_gives_url_and_token_file_relative_to_itself() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("secrets")).unwrap();
        std::fs::write(dir.path().join("secrets/token"), "s3cret\n").unwrap();
        let config = dir.path().join("jobs.toml");
        std::fs::write(
            &config,
            r#"
[daemon]
data_dir = "./data"
listen = "127.0.0.1:8080"
token_file = "secrets/token"

[queues.echo]
plugin = "echo"
"#,
        )
        .unwrap();
        let endpoint = resolve_endpoint(None, None, Some(&config)).unwrap();
        assert_eq!(endpoint.url, "http://127.0.0.1:8080");
        assert_eq!(endpoint.token.as_deref(), Some("s3cret"));

        // --token overrides the file's token but keeps its URL.
        let endpoint = resolve_endpoint(None, Some("other"), Some(&config)).unwrap();
        assert_eq!(endpoint.url, "http://127.0.0.1:8080");
        assert_eq!(endpoint.token.as_deref(), Some("other"));
    }

    #[test]
    fn the_config_may_give_a_token_inline_and_a_wildcard_listen() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("khata.toml");
        std::fs::write(
            &config,
            "[daemon]\nlisten = \"0.0.0.0:7000\"\ntoken = \"inline\"\n",
        )
        .unwrap();
        let endpoint = resolve_endpoint(None, None, Some(&config)).unwrap();
        assert_eq!(endpoint.url, "http://127.0.0.1:7000");
        assert_eq!(endpoint.token.as_deref(), Some("inline"));

        assert_eq!(url_from_listen("[::]:7373"), "http://[::1]:7373");
        assert_eq!(url_from_listen("localhost:7373"), "http://localhost:7373");
        assert_eq!(url_from_listen("http://h:1/x"), "http://h:1/x");
    }

    #[test]
    fn a_config_without_daemon_section_means_the_default_url() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("jobs.toml");
        std::fs::write(&config, "[queues.echo]\nplugin = \"echo\"\n").unwrap();
        let endpoint = resolve_endpoint(None, None, Some(&config)).unwrap();
        assert_eq!(
            endpoint,
            Endpoint {
                url: DEFAULT_URL.to_owned(),
                token: None
            }
        );
    }

    #[test]
    fn a_named_config_must_be_readable_and_valid() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.toml");
        let err = resolve_endpoint(None, None, Some(&missing)).unwrap_err();
        assert!(format!("{err:#}").contains("missing.toml"), "{err:#}");

        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[daemon\n").unwrap();
        let err = resolve_endpoint(None, None, Some(&bad)).unwrap_err();
        assert!(format!("{err:#}").contains("bad.toml"), "{err:#}");

        let no_token = dir.path().join("no-token.toml");
        std::fs::write(&no_token, "[daemon]\ntoken_file = \"nope\"\n").unwrap();
        let err = resolve_endpoint(None, None, Some(&no_token)).unwrap_err();
        assert!(format!("{err:#}").contains("nope"), "{err:#}");
    }

    #[test]
    fn client_urls_keep_a_prefix_and_encode_segments() {
        let client = Client::new("http://h:1/khata/", None).unwrap();
        assert_eq!(
            client.url(&["v1", "jobs", "a/b c"]).as_str(),
            "http://h:1/khata/v1/jobs/a%2Fb%20c"
        );
        let client = Client::new("127.0.0.1:7373", None).unwrap();
        assert_eq!(
            client.url(&["v1", "queues"]).as_str(),
            "http://127.0.0.1:7373/v1/queues"
        );
        assert!(matches!(
            Client::new("https://h", None),
            Err(ClientError::BadUrl { .. })
        ));
        assert!(matches!(
            Client::new("http://", None),
            Err(ClientError::BadUrl { .. })
        ));
    }

    #[test]
    fn api_errors_carry_the_servers_code_and_message() {
        let err = api_error(
            StatusCode::CONFLICT,
            br#"{"error": {"code": "id_reused", "message": "job j1 exists with another payload"}}"#,
        );
        assert_eq!(
            err.to_string(),
            "id_reused: job j1 exists with another payload"
        );
        let err = api_error(StatusCode::BAD_GATEWAY, b"<html>bad gateway</html>");
        assert_eq!(err.to_string(), "http_502: <html>bad gateway</html>");
        let err = api_error(StatusCode::SERVICE_UNAVAILABLE, b"");
        assert_eq!(err.to_string(), "http_503: Service Unavailable");
    }

    /// Serves one canned HTTP answer; returns the address and the request
    /// as received.
    async fn one_shot_server(
        status: &'static str,
        body: &'static str,
    ) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            // Read the head, then as much body as Content-Length says.
            loop {
                let n = socket.read(&mut buf).await.unwrap();
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap())
                        })
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
                if n == 0 {
                    break;
                }
            }
            let answer = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(answer.as_bytes()).await.unwrap();
            String::from_utf8(request).unwrap()
        });
        (addr, task)
    }

    #[tokio::test]
    async fn the_client_sends_the_token_and_the_body() {
        let (addr, server) = one_shot_server(
            "201 Created",
            r#"{"job": {"id": "j1", "state": "waiting"}, "deduplicated": false}"#,
        )
        .await;
        let client = Client::new(&format!("http://{addr}"), Some("t0k".into())).unwrap();
        let request = EnqueueRequest {
            payload: JsonText::parse(r#"{"a": 1}"#).unwrap(),
            dedup_key: Some("k".into()),
            ..Default::default()
        };
        let answer = client.enqueue("my queue", &request).await.unwrap();
        assert_eq!(answer["job"]["id"], "j1");
        let seen = server.await.unwrap();
        assert!(
            seen.starts_with("POST /v1/queues/my%20queue/jobs HTTP/1.1\r\n"),
            "{seen}"
        );
        assert!(
            seen.to_ascii_lowercase()
                .contains("authorization: bearer t0k\r\n"),
            "{seen}"
        );
        let body = &seen[seen.find("\r\n\r\n").unwrap() + 4..];
        assert_eq!(
            serde_json::from_str::<Value>(body).unwrap(),
            json!({"payload": {"a": 1}, "dedup_key": "k"})
        );
    }

    #[tokio::test]
    async fn the_client_sends_queries_and_reports_api_errors() {
        let (addr, server) = one_shot_server(
            "404 Not Found",
            r#"{"error": {"code": "unknown_queue", "message": "no queue nope"}}"#,
        )
        .await;
        let client = Client::new(&format!("http://{addr}"), None).unwrap();
        let query = JobsQuery {
            queue: Some("nope".into()),
            state: Some("dead".into()),
            limit: Some(10),
            cursor: None,
        };
        let err = client.jobs(&query).await.unwrap_err();
        assert!(
            matches!(err, ClientError::Api { status, ref code, .. }
                if status == StatusCode::NOT_FOUND && code == "unknown_queue"),
            "{err:?}"
        );
        assert_eq!(err.to_string(), "unknown_queue: no queue nope");
        let seen = server.await.unwrap();
        assert!(
            seen.starts_with("GET /v1/jobs?queue=nope&state=dead&limit=10 HTTP/1.1\r\n"),
            "{seen}"
        );
        assert!(
            !seen.to_ascii_lowercase().contains("authorization"),
            "{seen}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_daemon_is_named() {
        // Bind then drop, so the port is (very likely) closed.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let client = Client::new(&format!("http://{addr}"), None).unwrap();
        let err = client.queues().await.unwrap_err();
        assert!(matches!(err, ClientError::Unreachable { .. }), "{err:?}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }

    #[test]
    fn human_output() {
        let job = json!({
            "id": "j1", "queue": "q", "state": "dead", "payload": {"a": 1},
            "priority": 0, "attempt": 2, "max_attempts": 2, "dedup_key": null,
            "run_at": "2030-01-01T00:00:00Z", "enqueued_at": "2030-01-01T00:00:00Z",
            "finished_at": null, "result": null, "last_error": "boom\nat line 2",
            "attempts": [
                {"number": 1, "started_at": "t1", "ended_at": "t2", "outcome": "retry", "error": "boom", "fencing_token": 7, "plugin_version": "0123456789abcdef"},
            ],
            "effects": [],
        });
        let out = render_job(&job);
        assert!(out.contains("state        dead\n"), "{out}");
        assert!(out.contains("attempt      2 of 2\n"), "{out}");
        assert!(
            out.contains("last error   boom\n             at line 2\n"),
            "{out}"
        );
        assert!(
            out.contains("  #  STARTED  ENDED  OUTCOME  TOKEN  VERSION       ERROR\n"),
            "{out}"
        );
        assert!(
            out.contains("  1  t1       t2     retry    7      0123456789ab  boom\n"),
            "{out}"
        );
        assert!(out.contains("effects: none\n"), "{out}");

        let queues = json!({"queues": [{
            "name": "echo", "plugin": "echo", "namespace": "echo",
            "version": "0123456789abcdef", "loaded_at": "t", "load_error": null,
            "counts": {"waiting": 1, "delayed": 0, "active": 0, "completed": 5, "dead": 0, "cancelled": 0},
        }]});
        let out = render_queues(&queues);
        assert_eq!(
            out,
            "NAME  PLUGIN  VERSION       WAITING  DELAYED  ACTIVE  COMPLETED  DEAD  CANCELLED\n\
             echo  echo    0123456789ab  1        0        0       5          0     0\n"
        );

        let page = json!({"jobs": [], "next_cursor": "c2"});
        assert_eq!(render_jobs(&page), "no jobs\nmore: --cursor c2\n");
    }
}
