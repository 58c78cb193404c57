//! The command line: every command and flag, as clap reads them, and the
//! checks of their values.

use super::*;

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
    pub(super) fn ledgers(
        &self,
    ) -> anyhow::Result<(crate::daemon::LedgerAt, crate::daemon::LedgerAt)> {
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
        outcome: Resolution,
    },
}

// The states and resolutions the command line takes are the daemon's own
// types; only their help text is the command line's.

impl ValueEnum for JobState {
    fn value_variants<'a>() -> &'a [JobState] {
        &JobState::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let help = match self {
            JobState::Waiting => "Ready to run",
            JobState::Delayed => "Waiting for its run time (including backoff)",
            JobState::Active => "Leased to an attempt",
            JobState::Completed => "Done, with a result",
            JobState::Dead => "In the dead-letter queue",
            JobState::Cancelled => "Cancelled",
        };
        Some(PossibleValue::new(self.as_str()).help(help))
    }
}

impl ValueEnum for FenceState {
    fn value_variants<'a>() -> &'a [FenceState] {
        &FenceState::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let help = match self {
            FenceState::Started => "The effect was started and has not been recorded done",
            FenceState::Done => "The effect happened; its result is recorded",
            FenceState::Uncertain => {
                "Nobody knows whether the effect happened: an operator decides"
            }
        };
        Some(PossibleValue::new(self.as_str()).help(help))
    }
}

impl ValueEnum for Resolution {
    fn value_variants<'a>() -> &'a [Resolution] {
        &Resolution::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let help = match self {
            Resolution::Done => {
                "The effect happened: record it done, so it is never performed again"
            }
            Resolution::NotDone => {
                "The effect did not happen: release the fence, so a retry performs it"
            }
        };
        Some(PossibleValue::new(self.as_str()).help(help))
    }
}

pub(super) fn parse_json(arg: &str) -> Result<Value, String> {
    serde_json::from_str(arg).map_err(|err| format!("not JSON: {err}"))
}

pub(super) fn parse_payload(arg: &str) -> Result<PayloadArg, String> {
    if arg == "-" {
        return Ok(PayloadArg::Stdin);
    }
    JsonText::parse(arg)
        .map(PayloadArg::Json)
        .map_err(|err| format!("not JSON: {err}"))
}

/// Checks a duration such as `30s` or `1h 30m`, and keeps it as written: the
/// API takes durations as strings.
pub(super) fn parse_duration_arg(arg: &str) -> Result<String, String> {
    let arg = arg.trim();
    humantime::parse_duration(arg)
        .map(|_| arg.to_owned())
        .map_err(|err| format!("{err} (expected e.g. 500ms, 30s, 5m, 1h)"))
}
