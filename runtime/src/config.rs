//! `jobs.toml`: reading, validating and resolving the daemon's configuration.
//!
//! This module owns the file format of DESIGN sections 6.4, 6.5 and 10 and
//! nothing else: it turns the text of `jobs.toml` into a [`Config`] of plain,
//! resolved values (defaults applied, `[defaults]` merged into every queue,
//! durations and sizes parsed, relative paths made relative to the directory
//! of the config file, the API token read from `token_file`), so that the rest
//! of the daemon never sees an `Option` that merely means "not written".
//!
//! Errors are for people: every [`ConfigIssue`] names the dotted key
//! (`queues.welcome.timeout`), the line and the column, and the semantic
//! checks collect *all* issues of a file instead of stopping at the first, so
//! that `khata check` can print every mistake at once. The parse happens in
//! two passes:
//!
//! 1. serde, with `deny_unknown_fields` on every raw table: unknown keys and
//!    wrong types. A serde error stops the pass; it is reported with its
//!    position, and the key is found by walking the parsed document for the
//!    innermost key or value under that position.
//! 2. semantic validation of the raw values, which keep their spans
//!    ([`toml::Spanned`]): durations, sizes, enum values, names, ranges and
//!    cross references (grants naming `[http.NAME]` providers, schedules
//!    naming queues).
//!
//! Secrets ([`Secret`]) are only shape-checked here: an environment variable
//! may well be absent while `khata check` runs. They are resolved by whoever
//! needs them, with [`Secret::resolve`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};
use toml::Spanned;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;
/// The size of one WebAssembly page: the smallest memory limit that can run anything.
const WASM_PAGE: u64 = 64 * KIB;

// ---------------------------------------------------------------------------
// The resolved configuration
// ---------------------------------------------------------------------------

/// The whole of `jobs.toml`, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it was read from (as given).
    pub path: PathBuf,
    pub daemon: Daemon,
    pub retention: Retention,
    /// Every queue, with `[defaults]` already applied.
    pub queues: BTreeMap<String, Queue>,
    pub email: Email,
    pub http: BTreeMap<String, HttpProvider>,
    pub schedules: BTreeMap<String, Schedule>,
    pub store: StoreConfig,
}

/// The shortest API token accepted: 16 bytes (128 bits when random).
pub const MIN_TOKEN: usize = 16;

/// `[daemon]`.
#[derive(Clone, PartialEq)]
pub struct Daemon {
    /// The ledger (`khata.db`) and the email outbox. Default `./data`, relative to the config file.
    pub data_dir: PathBuf,
    /// Where `<plugin>.wasm` files are loaded from. Default `./plugins`, relative to the config file.
    pub plugins_dir: PathBuf,
    /// The HTTP API's address. Default `127.0.0.1:7373`.
    pub listen: SocketAddr,
    /// The API token, from `token` or read from `token_file` (trimmed); at
    /// least [`MIN_TOKEN`] bytes.
    pub token: Option<String>,
    /// Host names, beside IP addresses and `localhost`, that requests may
    /// give as `Host` (lower-cased). Default none.
    pub allowed_hosts: Vec<String>,
    /// The API's bounds: a request header (and an idle keep-alive
    /// connection) within `header_timeout` (default 10s), a request within
    /// `request_timeout` (30s), at most `max_connections` open (1024).
    pub header_timeout: Duration,
    pub request_timeout: Duration,
    pub max_connections: u32,
    /// The largest body of a batch enqueue. Default 16 MiB.
    pub max_request: u64,
    /// How long attempts in flight may run on after SIGTERM. Default 30s.
    pub shutdown_grace: Duration,
}

impl fmt::Debug for Daemon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Daemon")
            .field("data_dir", &self.data_dir)
            .field("plugins_dir", &self.plugins_dir)
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("allowed_hosts", &self.allowed_hosts)
            .field("header_timeout", &self.header_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_request", &self.max_request)
            .field("shutdown_grace", &self.shutdown_grace)
            .finish()
    }
}

impl Default for Daemon {
    fn default() -> Self {
        Daemon {
            data_dir: PathBuf::from("data"),
            plugins_dir: PathBuf::from("plugins"),
            listen: SocketAddr::from(([127, 0, 0, 1], 7373)),
            token: None,
            allowed_hosts: Vec::new(),
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_request: 16 << 20,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// `[retention]`: how long ended jobs, done fences, index tombstones and
/// the kv entries of chosen namespaces are kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Retention {
    /// Completed and cancelled jobs. Default 7 days.
    pub jobs: Duration,
    /// Dead jobs. Default 30 days.
    pub dead: Duration,
    /// Done fences. Default 30 days.
    pub fences: Duration,
    /// Index tombstones. Default 30 days.
    pub tombstones: Duration,
    /// kv namespaces whose entries expire this long after their last write;
    /// each names the namespace of some queue. Default: none (kv is kept).
    pub kv: BTreeMap<String, Duration>,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            jobs: Duration::from_secs(7 * 86_400),
            dead: Duration::from_secs(30 * 86_400),
            fences: Duration::from_secs(30 * 86_400),
            tombstones: Duration::from_secs(30 * 86_400),
            kv: BTreeMap::new(),
        }
    }
}

/// One `[queues.NAME]`, with `[defaults]` applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Queue {
    pub name: String,
    /// The plugin's name: `<plugins_dir>/<plugin>.wasm`.
    pub plugin: String,
    /// The scope of keys, fences and kv data. Defaults to the queue's name.
    pub namespace: String,
    pub grants: Grants,
    pub concurrency: u32,
    pub timeout: Duration,
    pub max_attempts: u32,
    pub backoff: Backoff,
    /// Linear memory limit, in bytes.
    pub memory: u64,
    pub on_uncertain: OnUncertain,
    pub rate_limit: Option<RateLimit>,
    /// In bytes.
    pub max_payload: u64,
    /// In bytes.
    pub max_result: u64,
}

/// A queue's capabilities. Nothing is granted by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    pub kv: bool,
    pub email: bool,
    /// Index collections the queue may write.
    pub index: Vec<String>,
    /// `[http.NAME]` providers the queue may call.
    pub http: Vec<String>,
}

/// Retry delays: `min(max, initial * multiplier^(attempt-1))`, then jitter.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    /// At least 1.
    pub multiplier: f64,
    /// In `[0, 1]`: the delay is scaled by a factor in `[1 - jitter, 1 + jitter]`.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(600),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl Backoff {
    /// The delay before the retry that follows failed attempt `attempt`
    /// (attempts start at 1; 0 is treated as 1).
    ///
    /// `unit_random` is a number in `[0, 1)` chosen by the caller (so that
    /// tests are deterministic); 0.5 means no jitter. The result is never
    /// negative and never above `max * (1 + jitter)`.
    pub fn delay(&self, attempt: u32, unit_random: f64) -> Duration {
        let max = self.max.as_secs_f64();
        let exponent = f64::from(attempt.max(1) - 1);
        let grown = self.initial.as_secs_f64() * self.multiplier.powf(exponent);
        // NaN (a multiplier of 0 to the power 0 cannot happen, but be safe) and
        // infinity both end at the cap.
        let base = if grown.is_finite() {
            grown.min(max)
        } else {
            max
        };
        let jitter = if self.jitter.is_finite() {
            self.jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let unit = if unit_random.is_finite() {
            unit_random.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let factor = 1.0 + jitter * (2.0 * unit - 1.0);
        let secs = (base * factor).clamp(0.0, max * (1.0 + jitter));
        Duration::try_from_secs_f64(secs).unwrap_or(self.max)
    }
}

/// What to do with an attempt's effect whose outcome is unknown (DESIGN 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OnUncertain {
    Skip,
    Repeat,
    Dead,
}

impl OnUncertain {
    pub fn as_str(self) -> &'static str {
        match self {
            OnUncertain::Skip => "skip",
            OnUncertain::Repeat => "repeat",
            OnUncertain::Dead => "dead",
        }
    }
}

/// At most `max` attempts started per `per`, per queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    pub max: u32,
    pub per: Duration,
}

/// `[email]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Email {
    pub transport: EmailTransport,
    pub from: String,
    /// Addresses a handler may send as (its message's `from`), beside
    /// `from`; lower-cased. Default none: a handler sends as `from` only.
    pub senders: Vec<String>,
    pub host: String,
    pub port: u16,
    pub tls: SmtpTls,
    pub username: Option<Secret>,
    pub password: Option<Secret>,
    pub timeout: Duration,
}

impl Default for Email {
    fn default() -> Self {
        Email {
            transport: EmailTransport::Outbox,
            from: "khata@localhost".to_owned(),
            senders: Vec::new(),
            host: "127.0.0.1".to_owned(),
            port: 25,
            tls: SmtpTls::None,
            username: None,
            password: None,
            timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EmailTransport {
    /// Messages are written to the outbox in `data_dir` (the default).
    Outbox,
    Smtp,
}

impl EmailTransport {
    pub fn as_str(self) -> &'static str {
        match self {
            EmailTransport::Outbox => "outbox",
            EmailTransport::Smtp => "smtp",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmtpTls {
    None,
    Starttls,
    Tls,
}

impl SmtpTls {
    pub fn as_str(self) -> &'static str {
        match self {
            SmtpTls::None => "none",
            SmtpTls::Starttls => "starttls",
            SmtpTls::Tls => "tls",
        }
    }
}

/// One `[http.NAME]` provider.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpProvider {
    pub name: String,
    /// `http://` or `https://`, without a trailing `/`.
    pub base_url: String,
    /// The header that carries the effect's idempotency key, if the provider has one.
    pub idempotency_header: Option<String>,
    pub timeout: Duration,
    /// Sent with every request; values are resolved when the request is made.
    pub headers: BTreeMap<String, Secret>,
    /// In bytes.
    pub max_response: u64,
    pub reconcile: Option<Reconcile>,
}

/// How to ask a provider whether an uncertain call took effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconcile {
    /// Upper case, e.g. `GET`.
    pub method: String,
    /// Starts with `/`; relative to the provider's `base_url`.
    pub path: String,
}

/// A value that may be written inline or kept out of the file.
///
/// `Debug` does not show inline values.
#[derive(Clone, PartialEq, Eq)]
pub enum Secret {
    Plain(String),
    Env { var: String, prefix: String },
    File { path: PathBuf, prefix: String },
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Plain(_) => f.write_str("Plain(<redacted>)"),
            Secret::Env { var, prefix } => f
                .debug_struct("Env")
                .field("var", var)
                .field("prefix", prefix)
                .finish(),
            Secret::File { path, prefix } => f
                .debug_struct("File")
                .field("path", path)
                .field("prefix", prefix)
                .finish(),
        }
    }
}

impl Secret {
    /// The value: inline, from the environment, or from the file's contents
    /// with trailing newlines removed; with `prefix` prepended. The error
    /// names the variable or the file.
    pub fn resolve(&self) -> Result<String, String> {
        match self {
            Secret::Plain(value) => Ok(value.clone()),
            Secret::Env { var, prefix } => match std::env::var(var) {
                Ok(value) => Ok(format!("{prefix}{value}")),
                Err(std::env::VarError::NotPresent) => {
                    Err(format!("environment variable {var} is not set"))
                }
                Err(std::env::VarError::NotUnicode(_)) => {
                    Err(format!("environment variable {var} is not valid UTF-8"))
                }
            },
            Secret::File { path, prefix } => match std::fs::read_to_string(path) {
                Ok(value) => Ok(format!("{prefix}{}", value.trim_end_matches(['\n', '\r']))),
                Err(e) => Err(format!("cannot read secret file {}: {e}", path.display())),
            },
        }
    }
}

/// One `[schedules.NAME]` (DESIGN 6.5).
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub name: String,
    pub queue: String,
    /// Five whitespace-separated fields; only the count is checked here.
    pub cron: String,
    /// An IANA name such as `Europe/Berlin`; default `UTC`. Not checked here.
    pub timezone: String,
    /// The job payload; `{}` when the schedule gives none.
    pub payload: serde_json::Value,
    pub catch_up: CatchUp,
}

/// Parses a cron line of `[schedules.NAME] cron`.
pub fn parse_cron(s: &str) -> Result<croner::Cron, String> {
    <croner::Cron as std::str::FromStr>::from_str(s)
        .map_err(|e| format!("{s:?} is not a valid cron line: {e}"))
}

/// Parses `[schedules.NAME] timezone`.
pub fn parse_timezone(s: &str) -> Result<chrono_tz::Tz, String> {
    <chrono_tz::Tz as std::str::FromStr>::from_str(s)
        .map_err(|_| format!("{s:?} is not an IANA time zone name such as \"Europe/Berlin\""))
}

/// Which firings missed while the daemon was down are enqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CatchUp {
    Latest,
    All,
    None,
}

impl CatchUp {
    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Latest => "latest",
            CatchUp::All => "all",
            CatchUp::None => "none",
        }
    }
}

/// `[store]` (DESIGN 10).
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    pub backend: Backend,
    /// Required for, and only allowed with, `postgres`.
    pub url: Option<Secret>,
    pub pool: u32,
    /// A lease not renewed by heartbeat for this long expires.
    pub lease: Duration,
    pub heartbeat: Duration,
    /// sled's page cache, in bytes (only with `sled`): the most of the
    /// ledger it keeps in memory.
    pub cache: u64,
}

/// sled's page cache unless `[store] cache` says otherwise: sled's own
/// default (1 GiB) makes a million-job ledger use well over a GiB of RSS.
pub const SLED_CACHE: u64 = 64 * MIB;

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: Backend::Sqlite,
            url: None,
            pool: 16,
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(5),
            cache: SLED_CACHE,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    Sqlite,
    Sled,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Sled => "sled",
            Backend::Postgres => "postgres",
        }
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Every problem found in one config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: PathBuf,
    pub errors: Vec<ConfigIssue>,
}

/// One problem, at one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// Dotted, e.g. `queues.welcome.timeout`; empty when the problem has no key
    /// (a syntax error, an unreadable file).
    pub key: String,
    /// 1-based.
    pub line: Option<usize>,
    /// 1-based, in characters.
    pub column: Option<usize>,
    pub message: String,
}

impl ConfigIssue {
    /// Displays as `jobs.toml:12:11: queues.welcome.timeout: message`.
    pub fn in_file<'a>(&'a self, path: &'a Path) -> impl fmt::Display + 'a {
        IssueInFile {
            path: Some(path),
            issue: self,
        }
    }
}

struct IssueInFile<'a> {
    path: Option<&'a Path>,
    issue: &'a ConfigIssue,
}

impl fmt::Display for IssueInFile<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let issue = self.issue;
        let mut sep = "";
        if let Some(path) = self.path {
            write!(f, "{}", path.display())?;
            sep = ":";
        }
        if let Some(line) = issue.line {
            write!(f, "{sep}{line}")?;
            if let Some(column) = issue.column {
                write!(f, ":{column}")?;
            }
            sep = ":";
        }
        if !sep.is_empty() {
            f.write_str(": ")?;
        }
        if !issue.key.is_empty() {
            write!(f, "{}: ", issue.key)?;
        }
        f.write_str(&issue.message)
    }
}

/// `12:11: queues.welcome.timeout: message` (without the file; see [`ConfigIssue::in_file`]).
impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        IssueInFile {
            path: None,
            issue: self,
        }
        .fmt(f)
    }
}

/// One line per issue: `jobs.toml:12:11: queues.welcome.timeout: invalid duration ...`.
impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.errors.is_empty() {
            return write!(f, "{}: invalid configuration", self.path.display());
        }
        for (i, issue) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            issue.in_file(&self.path).fmt(f)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

impl Config {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            Err(e) => Err(ConfigError {
                path: path.to_path_buf(),
                errors: vec![ConfigIssue {
                    key: String::new(),
                    line: None,
                    column: None,
                    message: format!("cannot read the configuration file: {e}"),
                }],
            }),
        }
    }

    /// Parses `text`, read from `path`: `path` names the file in errors, and
    /// relative paths in the file are resolved against its directory.
    /// `daemon.token_file` is read here.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let mut checker = Checker::new(text, path);
        let config = checker.deserialize().map(|raw| checker.resolve(raw));
        let mut issues = checker.issues;
        match config {
            Some(config) if issues.is_empty() => Ok(config),
            _ => {
                // By position; issues without one (there are none today) last.
                issues.sort_by_key(|i| (i.line.is_none(), i.line, i.column));
                Err(ConfigError {
                    path: path.to_path_buf(),
                    errors: issues,
                })
            }
        }
    }

    /// The queue called `name`.
    pub fn queue(&self, name: &str) -> Option<&Queue> {
        self.queues.get(name)
    }
}

// ---------------------------------------------------------------------------
// The raw file, as serde reads it
// ---------------------------------------------------------------------------

type Opt<T> = Option<Spanned<T>>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a jobs.toml document")]
struct RawConfig {
    daemon: RawDaemon,
    retention: RawRetention,
    defaults: RawLimits,
    queues: BTreeMap<Spanned<String>, RawQueue>,
    email: RawEmail,
    http: BTreeMap<Spanned<String>, RawHttp>,
    schedules: BTreeMap<Spanned<String>, RawSchedule>,
    store: RawStore,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [daemon] table")]
struct RawDaemon {
    data_dir: Opt<String>,
    plugins_dir: Opt<String>,
    listen: Opt<String>,
    token: Opt<String>,
    token_file: Opt<String>,
    allowed_hosts: Opt<Vec<String>>,
    header_timeout: Opt<String>,
    request_timeout: Opt<String>,
    max_connections: Opt<RawInt>,
    max_request: Opt<RawSize>,
    shutdown_grace: Opt<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [retention] table")]
struct RawRetention {
    jobs: Opt<String>,
    dead: Opt<String>,
    fences: Opt<String>,
    tombstones: Opt<String>,
    kv: BTreeMap<Spanned<String>, Spanned<String>>,
}

/// `[defaults]`, and the same fields of a queue.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [defaults] table")]
struct RawLimits {
    concurrency: Opt<RawInt>,
    timeout: Opt<String>,
    max_attempts: Opt<RawInt>,
    backoff: Opt<RawBackoff>,
    memory: Opt<RawSize>,
    on_uncertain: Opt<String>,
    rate_limit: Opt<RawRateLimit>,
    max_payload: Opt<RawSize>,
    max_result: Opt<RawSize>,
}

#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a table such as { initial = \"1s\", max = \"10m\", multiplier = 2.0, jitter = 0.2 }"
)]
struct RawBackoff {
    initial: Opt<String>,
    max: Opt<String>,
    multiplier: Opt<RawFloat>,
    jitter: Opt<RawFloat>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as { max = 100, per = \"1s\" }"
)]
struct RawRateLimit {
    max: Spanned<RawInt>,
    per: Spanned<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [queues.NAME] table")]
struct RawQueue {
    plugin: Opt<String>,
    namespace: Opt<String>,
    grants: Opt<RawGrants>,
    concurrency: Opt<RawInt>,
    timeout: Opt<String>,
    max_attempts: Opt<RawInt>,
    backoff: Opt<RawBackoff>,
    memory: Opt<RawSize>,
    on_uncertain: Opt<String>,
    rate_limit: Opt<RawRateLimit>,
    max_payload: Opt<RawSize>,
    max_result: Opt<RawSize>,
}

impl RawQueue {
    /// The fields a queue shares with `[defaults]`.
    fn limits(&mut self) -> RawLimits {
        RawLimits {
            concurrency: self.concurrency.take(),
            timeout: self.timeout.take(),
            max_attempts: self.max_attempts.take(),
            backoff: self.backoff.take(),
            memory: self.memory.take(),
            on_uncertain: self.on_uncertain.take(),
            rate_limit: self.rate_limit.take(),
            max_payload: self.max_payload.take(),
            max_result: self.max_result.take(),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a table such as { kv = true, email = true, index = [\"products\"], http = [\"payments\"] }"
)]
struct RawGrants {
    kv: Option<bool>,
    email: Option<bool>,
    index: Vec<Spanned<String>>,
    http: Vec<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "an [email] table")]
struct RawEmail {
    transport: Opt<String>,
    from: Opt<String>,
    senders: Opt<Vec<String>>,
    host: Opt<String>,
    port: Opt<RawInt>,
    tls: Opt<String>,
    username: Opt<RawSecret>,
    password: Opt<RawSecret>,
    timeout: Opt<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "an [http.NAME] table")]
struct RawHttp {
    base_url: Opt<String>,
    idempotency_header: Opt<String>,
    timeout: Opt<String>,
    headers: BTreeMap<Spanned<String>, Spanned<RawSecret>>,
    max_response: Opt<RawSize>,
    reconcile: Opt<RawReconcile>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as { method = \"GET\", path = \"/v1/charges\" }"
)]
struct RawReconcile {
    method: Spanned<String>,
    path: Spanned<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [schedules.NAME] table")]
struct RawSchedule {
    queue: Opt<String>,
    cron: Opt<String>,
    timezone: Opt<String>,
    payload: Opt<toml::Table>,
    catch_up: Opt<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [store] table")]
struct RawStore {
    backend: Opt<String>,
    url: Opt<RawSecret>,
    pool: Opt<RawInt>,
    lease: Opt<String>,
    heartbeat: Opt<String>,
    cache: Opt<RawSize>,
}

/// A size: `"64MiB"` or a number of bytes.
enum RawSize {
    Bytes(i64),
    Text(String),
}

impl<'de> Deserialize<'de> for RawSize {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = RawSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"64MiB\" or a number of bytes")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawSize, E> {
                Ok(RawSize::Bytes(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawSize, E> {
                Ok(RawSize::Bytes(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawSize, E> {
                Ok(RawSize::Text(v.to_owned()))
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

/// An integer (only so that a wrong type reads "expected an integer").
struct RawInt(i64);

impl<'de> Deserialize<'de> for RawInt {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = RawInt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawInt, E> {
                Ok(RawInt(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawInt, E> {
                Ok(RawInt(i64::try_from(v).unwrap_or(i64::MAX)))
            }
        }
        deserializer.deserialize_any(IntVisitor)
    }
}

/// A number, integer or float.
struct RawFloat(f64);

impl<'de> Deserialize<'de> for RawFloat {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FloatVisitor;
        impl Visitor<'_> for FloatVisitor {
            type Value = RawFloat;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<RawFloat, E> {
                Ok(RawFloat(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawFloat, E> {
                Ok(RawFloat(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawFloat, E> {
                Ok(RawFloat(v as f64))
            }
        }
        deserializer.deserialize_any(FloatVisitor)
    }
}

/// A secret: a string, `{ env = "VAR", prefix = "..." }` or `{ file = "...", prefix = "..." }`.
enum RawSecret {
    Plain(String),
    Table(RawSecretTable),
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "{ env = \"VAR\" } or { file = \"/path\" }"
)]
struct RawSecretTable {
    env: Opt<String>,
    file: Opt<String>,
    prefix: Opt<String>,
}

impl<'de> Deserialize<'de> for RawSecret {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SecretVisitor;
        impl<'de> Visitor<'de> for SecretVisitor {
            type Value = RawSecret;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, { env = \"VAR\" } or { file = \"/path\" }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawSecret, E> {
                Ok(RawSecret::Plain(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawSecret, A::Error> {
                RawSecretTable::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(RawSecret::Table)
            }
        }
        deserializer.deserialize_any(SecretVisitor)
    }
}

// ---------------------------------------------------------------------------
// Validation and resolution
// ---------------------------------------------------------------------------

/// The fields of `[defaults]`, resolved.
#[derive(Clone)]
struct Limits {
    concurrency: u32,
    timeout: Duration,
    max_attempts: u32,
    backoff: Backoff,
    memory: u64,
    on_uncertain: OnUncertain,
    rate_limit: Option<RateLimit>,
    max_payload: u64,
    max_result: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            concurrency: 4,
            timeout: Duration::from_secs(30),
            max_attempts: 5,
            backoff: Backoff::default(),
            memory: 64 * MIB,
            on_uncertain: OnUncertain::Skip,
            rate_limit: None,
            max_payload: MIB,
            max_result: MIB,
        }
    }
}

const ON_UNCERTAIN: &[(&str, OnUncertain)] = &[
    ("skip", OnUncertain::Skip),
    ("repeat", OnUncertain::Repeat),
    ("dead", OnUncertain::Dead),
];
const TRANSPORTS: &[(&str, EmailTransport)] = &[
    ("outbox", EmailTransport::Outbox),
    ("smtp", EmailTransport::Smtp),
];
const TLS: &[(&str, SmtpTls)] = &[
    ("none", SmtpTls::None),
    ("starttls", SmtpTls::Starttls),
    ("tls", SmtpTls::Tls),
];
const CATCH_UP: &[(&str, CatchUp)] = &[
    ("latest", CatchUp::Latest),
    ("all", CatchUp::All),
    ("none", CatchUp::None),
];
const BACKENDS: &[(&str, Backend)] = &[
    ("sqlite", Backend::Sqlite),
    ("sled", Backend::Sled),
    ("postgres", Backend::Postgres),
];

/// Collects issues while turning the raw file into a [`Config`].
struct Checker<'a> {
    text: &'a str,
    path: &'a Path,
    /// The directory relative paths are resolved against.
    base_dir: PathBuf,
    /// Byte offsets at which lines start.
    line_starts: Vec<usize>,
    issues: Vec<ConfigIssue>,
}

impl<'a> Checker<'a> {
    fn new(text: &'a str, path: &'a Path) -> Self {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Checker {
            text,
            path,
            base_dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            line_starts,
            issues: Vec::new(),
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    fn position(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.line_starts.partition_point(|&start| start <= offset) - 1;
        let start = self.line_starts[line];
        let column = match self.text.get(start..offset) {
            Some(before) => before.chars().count(),
            None => offset - start,
        };
        (line + 1, column + 1)
    }

    fn issue(&mut self, key: &str, span: Option<Range<usize>>, message: impl Into<String>) {
        let (line, column) = match span {
            Some(span) => {
                let (line, column) = self.position(span.start);
                (Some(line), Some(column))
            }
            None => (None, None),
        };
        self.issues.push(ConfigIssue {
            key: key.to_owned(),
            line,
            column,
            message: message.into(),
        });
    }

    /// Pass 1: syntax, unknown keys and types. `None` when an issue was recorded.
    fn deserialize(&mut self) -> Option<RawConfig> {
        let text = self.text;
        let (document, syntax_errors) = toml::de::DeTable::parse_recoverable(text);
        if !syntax_errors.is_empty() {
            for error in syntax_errors {
                let key = error
                    .span()
                    .map(|span| key_at(document.get_ref(), span.start))
                    .unwrap_or_default();
                self.issue(&key, error.span(), error.message());
            }
            return None;
        }
        match toml::from_str::<RawConfig>(text) {
            Ok(raw) => Some(raw),
            Err(error) => {
                let key = error
                    .span()
                    .map(|span| key_at(document.get_ref(), span.start))
                    .unwrap_or_default();
                self.issue(&key, error.span(), error.message());
                None
            }
        }
    }

    /// Pass 2: every semantic check, collecting all issues.
    fn resolve(&mut self, mut raw: RawConfig) -> Config {
        let daemon = self.daemon(&raw.daemon);
        let defaults = self.limits("defaults", &raw.defaults, &Limits::default());

        let mut http = BTreeMap::new();
        for (name, provider) in &raw.http {
            let key = join("http", name.get_ref());
            self.name(&key, "provider name", name);
            http.insert(name.get_ref().clone(), self.http(&key, name, provider));
        }

        let mut queues = BTreeMap::new();
        for (name, queue) in &mut raw.queues {
            let key = join("queues", name.get_ref());
            let resolved = self.queue(&key, name, queue, &defaults, &http);
            queues.insert(name.get_ref().clone(), resolved);
        }

        let retention = self.retention(&raw.retention, &queues);
        let email = self.email(&raw.email);

        let mut schedules = BTreeMap::new();
        for (name, schedule) in &raw.schedules {
            let key = join("schedules", name.get_ref());
            let resolved = self.schedule(&key, name, schedule, &queues);
            schedules.insert(name.get_ref().clone(), resolved);
        }

        let store = self.store(&raw.store);

        Config {
            path: self.path.to_path_buf(),
            daemon,
            retention,
            queues,
            email,
            http,
            schedules,
            store,
        }
    }

    fn daemon(&mut self, raw: &RawDaemon) -> Daemon {
        let defaults = Daemon::default();
        let data_dir = self.dir("daemon.data_dir", raw.data_dir.as_ref(), "data");
        let plugins_dir = self.dir("daemon.plugins_dir", raw.plugins_dir.as_ref(), "plugins");
        let listen = match &raw.listen {
            None => defaults.listen,
            Some(listen) => match listen.get_ref().trim().parse::<SocketAddr>() {
                Ok(addr) => addr,
                Err(e) => {
                    self.issue(
                        "daemon.listen",
                        Some(listen.span()),
                        format!(
                            "invalid address {:?}: {e}; expected IP:PORT such as \"127.0.0.1:7373\" or \"[::1]:7373\"",
                            listen.get_ref()
                        ),
                    );
                    defaults.listen
                }
            },
        };

        // A token was configured, even if it could not be read: do not also
        // complain that there is none.
        let token_given = raw.token.is_some() || raw.token_file.is_some();
        let mut token = None;
        if let (Some(_), Some(file)) = (&raw.token, &raw.token_file) {
            self.issue(
                "daemon.token_file",
                Some(file.span()),
                "give either daemon.token or daemon.token_file, not both",
            );
        } else if let Some(inline) = &raw.token {
            if inline.get_ref().trim().is_empty() {
                self.issue("daemon.token", Some(inline.span()), "the token is empty");
            } else {
                token = Some(inline.get_ref().trim().to_owned());
            }
        } else if let Some(file) = &raw.token_file {
            let path = resolve_path(&self.base_dir, file.get_ref());
            match std::fs::read_to_string(&path) {
                Ok(contents) if contents.trim().is_empty() => self.issue(
                    "daemon.token_file",
                    Some(file.span()),
                    format!("the token file {} is empty", path.display()),
                ),
                Ok(contents) => token = Some(contents.trim().to_owned()),
                Err(e) => self.issue(
                    "daemon.token_file",
                    Some(file.span()),
                    format!("cannot read the token file {}: {e}", path.display()),
                ),
            }
        }
        if let Some(t) = &token
            && t.len() < MIN_TOKEN
        {
            let (key, span) = match &raw.token {
                Some(inline) => ("daemon.token", Some(inline.span())),
                None => (
                    "daemon.token_file",
                    raw.token_file.as_ref().map(Spanned::span),
                ),
            };
            self.issue(
                key,
                span,
                format!(
                    "the token is {} bytes; a token must be at least {MIN_TOKEN} bytes (make one with `head -c 32 /dev/urandom | base64`)",
                    t.len()
                ),
            );
            token = None;
        }
        let mut allowed_hosts = Vec::new();
        if let Some(names) = &raw.allowed_hosts {
            for name in names.get_ref() {
                let ok = !name.is_empty()
                    && name.len() <= 253
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
                if ok {
                    allowed_hosts.push(name.to_ascii_lowercase());
                } else {
                    self.issue(
                        "daemon.allowed_hosts",
                        Some(names.span()),
                        format!(
                            "{name:?} is not a host name (letters, digits, '-' and '.', no port)"
                        ),
                    );
                }
            }
        }
        if !token_given && !listen.ip().is_loopback() {
            let span = raw.listen.as_ref().map(Spanned::span);
            self.issue(
                "daemon.listen",
                span,
                format!(
                    "{listen} is not a loopback address and no token is configured: \
                     set daemon.token_file (or daemon.token), or listen on 127.0.0.1"
                ),
            );
        }

        let shutdown_grace = self
            .duration("daemon.shutdown_grace", raw.shutdown_grace.as_ref(), false)
            .unwrap_or(defaults.shutdown_grace);
        let header_timeout = self
            .duration("daemon.header_timeout", raw.header_timeout.as_ref(), true)
            .unwrap_or(defaults.header_timeout);
        let request_timeout = self
            .duration("daemon.request_timeout", raw.request_timeout.as_ref(), true)
            .unwrap_or(defaults.request_timeout);
        let max_connections = self
            .int(
                "daemon.max_connections",
                raw.max_connections.as_ref(),
                1,
                1_000_000,
            )
            .map_or(defaults.max_connections, |n| n as u32);
        let max_request = self
            .size("daemon.max_request", raw.max_request.as_ref(), 1 << 10)
            .unwrap_or(defaults.max_request);
        Daemon {
            data_dir,
            plugins_dir,
            listen,
            token,
            allowed_hosts,
            header_timeout,
            request_timeout,
            max_connections,
            max_request,
            shutdown_grace,
        }
    }

    fn dir(&mut self, key: &str, raw: Option<&Spanned<String>>, default: &str) -> PathBuf {
        match raw {
            Some(value) if value.get_ref().trim().is_empty() => {
                self.issue(key, Some(value.span()), "the path is empty");
                resolve_path(&self.base_dir, default)
            }
            Some(value) => resolve_path(&self.base_dir, value.get_ref()),
            None => resolve_path(&self.base_dir, default),
        }
    }

    /// `[defaults]` or a queue's own fields, on top of `base`.
    fn limits(&mut self, prefix: &str, raw: &RawLimits, base: &Limits) -> Limits {
        let key = |field: &str| join(prefix, field);
        let concurrency = self
            .int(
                &key("concurrency"),
                raw.concurrency.as_ref(),
                1,
                i64::from(u32::MAX),
            )
            .map_or(base.concurrency, |v| v as u32);
        let timeout = self
            .duration(&key("timeout"), raw.timeout.as_ref(), true)
            .unwrap_or(base.timeout);
        let max_attempts = self
            .int(
                &key("max_attempts"),
                raw.max_attempts.as_ref(),
                1,
                i64::from(crate::job::MAX_ATTEMPTS),
            )
            .map_or(base.max_attempts, |v| v as u32);
        let backoff = match &raw.backoff {
            Some(backoff) => self.backoff(&key("backoff"), backoff, &base.backoff),
            None => base.backoff.clone(),
        };
        let memory = self
            .size(&key("memory"), raw.memory.as_ref(), WASM_PAGE)
            .unwrap_or(base.memory);
        let on_uncertain = self
            .choice(
                &key("on_uncertain"),
                raw.on_uncertain.as_ref(),
                ON_UNCERTAIN,
            )
            .unwrap_or(base.on_uncertain);
        let rate_limit = match &raw.rate_limit {
            Some(limit) => {
                let prefix = key("rate_limit");
                let max = self.int(
                    &join(&prefix, "max"),
                    Some(&limit.get_ref().max),
                    1,
                    i64::from(u32::MAX),
                );
                let per = self.duration(&join(&prefix, "per"), Some(&limit.get_ref().per), true);
                match (max, per) {
                    (Some(max), Some(per)) => Some(RateLimit {
                        max: max as u32,
                        per,
                    }),
                    _ => base.rate_limit.clone(),
                }
            }
            None => base.rate_limit.clone(),
        };
        let max_payload = self
            .size(&key("max_payload"), raw.max_payload.as_ref(), 1)
            .unwrap_or(base.max_payload);
        let max_result = self
            .size(&key("max_result"), raw.max_result.as_ref(), 1)
            .unwrap_or(base.max_result);
        Limits {
            concurrency,
            timeout,
            max_attempts,
            backoff,
            memory,
            on_uncertain,
            rate_limit,
            max_payload,
            max_result,
        }
    }

    fn backoff(&mut self, prefix: &str, raw: &Spanned<RawBackoff>, base: &Backoff) -> Backoff {
        let fields = raw.get_ref();
        let initial = self.duration(&join(prefix, "initial"), fields.initial.as_ref(), true);
        let max = self.duration(&join(prefix, "max"), fields.max.as_ref(), true);
        let multiplier = self.float(
            &join(prefix, "multiplier"),
            fields.multiplier.as_ref(),
            |m| (1.0..=1e6).contains(&m),
            "must be at least 1.0 (and at most 1000000)",
        );
        let jitter = self.float(
            &join(prefix, "jitter"),
            fields.jitter.as_ref(),
            |j| (0.0..=1.0).contains(&j),
            "must be between 0.0 and 1.0",
        );
        let backoff = Backoff {
            initial: initial.unwrap_or(base.initial),
            max: max.unwrap_or(base.max),
            multiplier: multiplier.unwrap_or(base.multiplier),
            jitter: jitter.unwrap_or(base.jitter),
        };
        let checked_fields_ok = fields.initial.is_none() || initial.is_some();
        let checked_fields_ok = checked_fields_ok && (fields.max.is_none() || max.is_some());
        if checked_fields_ok && backoff.max < backoff.initial {
            let (field, span) = match (&fields.max, &fields.initial) {
                (Some(max), _) => ("max", max.span()),
                (None, Some(initial)) => ("initial", initial.span()),
                (None, None) => ("max", raw.span()),
            };
            self.issue(
                &join(prefix, field),
                Some(span),
                format!(
                    "backoff max ({}) is shorter than initial ({})",
                    humantime::format_duration(backoff.max),
                    humantime::format_duration(backoff.initial)
                ),
            );
        }
        backoff
    }

    fn queue(
        &mut self,
        key: &str,
        name: &Spanned<String>,
        raw: &mut RawQueue,
        defaults: &Limits,
        http: &BTreeMap<String, HttpProvider>,
    ) -> Queue {
        self.name(key, "queue name", name);
        let plugin = match &raw.plugin {
            Some(plugin) => {
                self.name(&join(key, "plugin"), "plugin name", plugin);
                plugin.get_ref().clone()
            }
            None => {
                self.issue(
                    &join(key, "plugin"),
                    Some(name.span()),
                    "missing: every queue needs `plugin = \"NAME\"` (loaded from plugins_dir/NAME.wasm)",
                );
                String::new()
            }
        };
        let namespace = match &raw.namespace {
            Some(namespace) => {
                self.name(&join(key, "namespace"), "namespace", namespace);
                namespace.get_ref().clone()
            }
            None => name.get_ref().clone(),
        };

        let mut grants = Grants::default();
        if let Some(raw_grants) = &raw.grants {
            let prefix = join(key, "grants");
            let raw_grants = raw_grants.get_ref();
            grants.kv = raw_grants.kv.unwrap_or(false);
            grants.email = raw_grants.email.unwrap_or(false);
            for (i, collection) in raw_grants.index.iter().enumerate() {
                let item = format!("{}[{i}]", join(&prefix, "index"));
                if self.name(&item, "index collection name", collection)
                    && !grants.index.contains(collection.get_ref())
                {
                    grants.index.push(collection.get_ref().clone());
                }
            }
            for (i, provider) in raw_grants.http.iter().enumerate() {
                let item = format!("{}[{i}]", join(&prefix, "http"));
                if !http.contains_key(provider.get_ref()) {
                    let known: Vec<String> = http.keys().map(|k| format!("{k:?}")).collect();
                    let known = if known.is_empty() {
                        "there are none".to_owned()
                    } else {
                        format!("known: {}", known.join(", "))
                    };
                    self.issue(
                        &item,
                        Some(provider.span()),
                        format!(
                            "no [http.{}] provider is configured ({known})",
                            quote_key(provider.get_ref())
                        ),
                    );
                } else if !grants.http.contains(provider.get_ref()) {
                    grants.http.push(provider.get_ref().clone());
                }
            }
        }

        let own = raw.limits();
        let limits = self.limits(key, &own, defaults);
        Queue {
            name: name.get_ref().clone(),
            plugin,
            namespace,
            grants,
            concurrency: limits.concurrency,
            timeout: limits.timeout,
            max_attempts: limits.max_attempts,
            backoff: limits.backoff,
            memory: limits.memory,
            on_uncertain: limits.on_uncertain,
            rate_limit: limits.rate_limit,
            max_payload: limits.max_payload,
            max_result: limits.max_result,
        }
    }

    fn email(&mut self, raw: &RawEmail) -> Email {
        let defaults = Email::default();
        let transport = self
            .choice("email.transport", raw.transport.as_ref(), TRANSPORTS)
            .unwrap_or(defaults.transport);
        let from = match &raw.from {
            Some(from) => {
                let value = from.get_ref().trim();
                if !value.contains('@') || value.starts_with('@') || value.ends_with('@') {
                    self.issue(
                        "email.from",
                        Some(from.span()),
                        format!("{:?} is not an email address", from.get_ref()),
                    );
                }
                value.to_owned()
            }
            None => defaults.from,
        };
        let mut senders = Vec::new();
        if let Some(list) = &raw.senders {
            for address in list.get_ref() {
                let a = address.trim();
                if !a.contains('@')
                    || a.starts_with('@')
                    || a.ends_with('@')
                    || a.contains(['<', '>', ' '])
                {
                    self.issue(
                        "email.senders",
                        Some(list.span()),
                        format!("{address:?} is not an email address (give the bare address, as \"reports@example.com\")"),
                    );
                } else {
                    senders.push(a.to_ascii_lowercase());
                }
            }
        }
        let host = match &raw.host {
            Some(host) if host.get_ref().trim().is_empty() => {
                self.issue("email.host", Some(host.span()), "the host is empty");
                defaults.host
            }
            Some(host) => host.get_ref().trim().to_owned(),
            None => defaults.host,
        };
        let port = self
            .int("email.port", raw.port.as_ref(), 1, i64::from(u16::MAX))
            .map_or(defaults.port, |p| p as u16);
        let tls = self
            .choice("email.tls", raw.tls.as_ref(), TLS)
            .unwrap_or(defaults.tls);
        let username = raw
            .username
            .as_ref()
            .and_then(|s| self.secret("email.username", s));
        let password = raw
            .password
            .as_ref()
            .and_then(|s| self.secret("email.password", s));
        match (&raw.username, &raw.password) {
            (Some(username), None) => self.issue(
                "email.password",
                Some(username.span()),
                "email.username is set but email.password is not",
            ),
            (None, Some(password)) => self.issue(
                "email.username",
                Some(password.span()),
                "email.password is set but email.username is not",
            ),
            _ => {}
        }
        let timeout = self
            .duration("email.timeout", raw.timeout.as_ref(), true)
            .unwrap_or(defaults.timeout);
        Email {
            transport,
            from,
            senders,
            host,
            port,
            tls,
            username,
            password,
            timeout,
        }
    }

    fn http(&mut self, key: &str, name: &Spanned<String>, raw: &RawHttp) -> HttpProvider {
        let base_url = match &raw.base_url {
            Some(url) => {
                let value = url.get_ref().trim();
                let rest = value
                    .strip_prefix("http://")
                    .or_else(|| value.strip_prefix("https://"));
                let host_ok = rest.is_some_and(|rest| {
                    !rest.is_empty()
                        && !rest.starts_with('/')
                        && !rest.contains(char::is_whitespace)
                });
                if !host_ok {
                    self.issue(
                        &join(key, "base_url"),
                        Some(url.span()),
                        format!(
                            "{:?} is not an http:// or https:// URL with a host",
                            url.get_ref()
                        ),
                    );
                }
                value.trim_end_matches('/').to_owned()
            }
            None => {
                self.issue(
                    &join(key, "base_url"),
                    Some(name.span()),
                    "missing: every provider needs `base_url = \"https://...\"`",
                );
                String::new()
            }
        };
        let idempotency_header = raw.idempotency_header.as_ref().map(|header| {
            self.header_name(&join(key, "idempotency_header"), header);
            header.get_ref().clone()
        });
        let timeout = self
            .duration(&join(key, "timeout"), raw.timeout.as_ref(), true)
            .unwrap_or(Duration::from_secs(10));
        let mut headers = BTreeMap::new();
        let headers_key = join(key, "headers");
        for (header, value) in &raw.headers {
            let header_key = join(&headers_key, header.get_ref());
            self.header_name(&header_key, header);
            if let Some(secret) = self.secret(&header_key, value) {
                headers.insert(header.get_ref().clone(), secret);
            }
        }
        let max_response = self
            .size(&join(key, "max_response"), raw.max_response.as_ref(), 1)
            .unwrap_or(MIB);
        let reconcile = raw.reconcile.as_ref().map(|reconcile| {
            let prefix = join(key, "reconcile");
            let fields = reconcile.get_ref();
            let method = fields.method.get_ref().trim().to_ascii_uppercase();
            if method.is_empty() || !method.chars().all(|c| c.is_ascii_uppercase()) {
                self.issue(
                    &join(&prefix, "method"),
                    Some(fields.method.span()),
                    format!("{:?} is not an HTTP method", fields.method.get_ref()),
                );
            }
            let path = fields.path.get_ref().trim().to_owned();
            if !path.starts_with('/') {
                self.issue(
                    &join(&prefix, "path"),
                    Some(fields.path.span()),
                    format!(
                        "{:?} must start with `/` (it is relative to base_url)",
                        fields.path.get_ref()
                    ),
                );
            }
            Reconcile { method, path }
        });
        HttpProvider {
            name: name.get_ref().clone(),
            base_url,
            idempotency_header,
            timeout,
            headers,
            max_response,
            reconcile,
        }
    }

    fn schedule(
        &mut self,
        key: &str,
        name: &Spanned<String>,
        raw: &RawSchedule,
        queues: &BTreeMap<String, Queue>,
    ) -> Schedule {
        self.name(key, "schedule name", name);
        let queue = match &raw.queue {
            Some(queue) => {
                if !queues.contains_key(queue.get_ref()) {
                    self.issue(
                        &join(key, "queue"),
                        Some(queue.span()),
                        format!("no [queues.{}] is configured", quote_key(queue.get_ref())),
                    );
                }
                queue.get_ref().clone()
            }
            None => {
                self.issue(
                    &join(key, "queue"),
                    Some(name.span()),
                    "missing: every schedule needs `queue = \"NAME\"`",
                );
                String::new()
            }
        };
        let cron = match &raw.cron {
            Some(cron) => {
                let fields = cron.get_ref().split_whitespace().count();
                if fields == 5
                    && let Err(message) = parse_cron(cron.get_ref())
                {
                    self.issue(&join(key, "cron"), Some(cron.span()), message);
                }
                if fields != 5 {
                    self.issue(
                        &join(key, "cron"),
                        Some(cron.span()),
                        format!(
                            "{:?} has {fields} fields; expected the 5 of standard cron \
                             (minute hour day-of-month month day-of-week)",
                            cron.get_ref()
                        ),
                    );
                }
                cron.get_ref()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            }
            None => {
                self.issue(
                    &join(key, "cron"),
                    Some(name.span()),
                    "missing: every schedule needs `cron = \"MIN HOUR DOM MON DOW\"`",
                );
                String::new()
            }
        };
        let timezone = match &raw.timezone {
            Some(tz) if tz.get_ref().trim().is_empty() => {
                self.issue(
                    &join(key, "timezone"),
                    Some(tz.span()),
                    "the timezone is empty",
                );
                "UTC".to_owned()
            }
            Some(tz) => {
                if let Err(message) = parse_timezone(tz.get_ref().trim()) {
                    self.issue(&join(key, "timezone"), Some(tz.span()), message);
                }
                tz.get_ref().trim().to_owned()
            }
            None => "UTC".to_owned(),
        };
        let payload = match &raw.payload {
            Some(payload) => match table_to_json(payload.get_ref()) {
                Ok(json) => json,
                Err(message) => {
                    self.issue(&join(key, "payload"), Some(payload.span()), message);
                    serde_json::Value::Object(serde_json::Map::new())
                }
            },
            None => serde_json::Value::Object(serde_json::Map::new()),
        };
        let catch_up = self
            .choice(&join(key, "catch_up"), raw.catch_up.as_ref(), CATCH_UP)
            .unwrap_or(CatchUp::Latest);
        Schedule {
            name: name.get_ref().clone(),
            queue,
            cron,
            timezone,
            payload,
            catch_up,
        }
    }

    fn store(&mut self, raw: &RawStore) -> StoreConfig {
        let defaults = StoreConfig::default();
        let backend = self
            .choice("store.backend", raw.backend.as_ref(), BACKENDS)
            .unwrap_or(defaults.backend);
        let url = raw
            .url
            .as_ref()
            .and_then(|url| self.secret("store.url", url));
        match (backend, &raw.url) {
            (Backend::Postgres, None) => {
                let span = raw.backend.as_ref().map(Spanned::span);
                self.issue(
                    "store.url",
                    span,
                    "missing: backend \"postgres\" needs `url` (a string, { env = \"VAR\" } or { file = \"/path\" })",
                );
            }
            (Backend::Postgres, Some(raw_url)) => {
                // An inline URL is checked now; one from `env` or `file`
                // when the daemon reads it. The message never repeats the
                // URL: it may hold a password.
                if let Some(Secret::Plain(text)) = &url
                    && let Err(e) = text.parse::<tokio_postgres::Config>()
                {
                    let cause = std::error::Error::source(&e)
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default();
                    self.issue(
                        "store.url",
                        Some(raw_url.span()),
                        format!(
                            "not a PostgreSQL connection URL ({e}{cause}); expected e.g. \"postgres://user:password@host:5432/khata\""
                        ),
                    );
                }
            }
            (Backend::Sqlite | Backend::Sled, Some(url)) => self.issue(
                "store.url",
                Some(url.span()),
                format!(
                    "url is only used by backend \"postgres\"; backend is \"{}\" (the ledger is kept in data_dir)",
                    backend.as_str()
                ),
            ),
            _ => {}
        }
        let pool = self
            .int("store.pool", raw.pool.as_ref(), 1, 10_000)
            .map_or(defaults.pool, |p| p as u32);
        let lease = self.duration("store.lease", raw.lease.as_ref(), true);
        let heartbeat = self.duration("store.heartbeat", raw.heartbeat.as_ref(), true);
        let cache = self.size("store.cache", raw.cache.as_ref(), MIB);
        if let Some(c) = &raw.cache
            && backend != Backend::Sled
        {
            self.issue(
                "store.cache",
                Some(c.span()),
                format!(
                    "cache is only used by backend \"sled\" (its page cache); backend is \"{}\"",
                    backend.as_str()
                ),
            );
        }
        let resolved = StoreConfig {
            backend,
            url,
            pool,
            lease: lease.unwrap_or(defaults.lease),
            heartbeat: heartbeat.unwrap_or(defaults.heartbeat),
            cache: cache.unwrap_or(defaults.cache),
        };
        let values_ok = (raw.lease.is_none() || lease.is_some())
            && (raw.heartbeat.is_none() || heartbeat.is_some());
        if values_ok && resolved.heartbeat >= resolved.lease {
            let (key, span) = match (&raw.heartbeat, &raw.lease) {
                (Some(h), _) => ("store.heartbeat", Some(h.span())),
                (None, Some(l)) => ("store.lease", Some(l.span())),
                (None, None) => ("store.heartbeat", None),
            };
            self.issue(
                key,
                span,
                format!(
                    "heartbeat ({}) must be shorter than lease ({}), or every lease expires",
                    humantime::format_duration(resolved.heartbeat),
                    humantime::format_duration(resolved.lease)
                ),
            );
        }
        resolved
    }

    /// `[retention]`; a kv rule must name a namespace some queue writes
    /// (a misspelt one would silently keep everything).
    fn retention(&mut self, raw: &RawRetention, queues: &BTreeMap<String, Queue>) -> Retention {
        let base = Retention::default();
        let mut window = |key: &str, raw: &Opt<String>, default: Duration| {
            self.duration(key, raw.as_ref(), true).unwrap_or(default)
        };
        let mut retention = Retention {
            jobs: window("retention.jobs", &raw.jobs, base.jobs),
            dead: window("retention.dead", &raw.dead, base.dead),
            fences: window("retention.fences", &raw.fences, base.fences),
            tombstones: window("retention.tombstones", &raw.tombstones, base.tombstones),
            kv: BTreeMap::new(),
        };
        for (ns, raw_window) in &raw.kv {
            let key = join("retention.kv", ns.get_ref());
            let Some(window) = self.duration(&key, Some(raw_window), true) else {
                continue;
            };
            if !queues.values().any(|q| q.namespace == *ns.get_ref()) {
                let mut known: Vec<&str> = queues.values().map(|q| q.namespace.as_str()).collect();
                known.sort_unstable();
                known.dedup();
                self.issue(
                    &key,
                    Some(ns.span()),
                    format!(
                        "no queue writes the kv namespace {:?} (the queues' namespaces: {})",
                        ns.get_ref(),
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
                continue;
            }
            retention.kv.insert(ns.get_ref().clone(), window);
        }
        retention
    }

    // -- single values ------------------------------------------------------

    fn duration(
        &mut self,
        key: &str,
        raw: Option<&Spanned<String>>,
        positive: bool,
    ) -> Option<Duration> {
        let raw = raw?;
        match humantime::parse_duration(raw.get_ref().trim()) {
            Ok(d) if positive && d.is_zero() => {
                self.issue(key, Some(raw.span()), "must be longer than zero");
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                self.issue(
                    key,
                    Some(raw.span()),
                    format!(
                        "invalid duration {:?}: {e} (write e.g. \"500ms\", \"30s\", \"10m\", \"1h\", \"7d\")",
                        raw.get_ref()
                    ),
                );
                None
            }
        }
    }

    fn size(&mut self, key: &str, raw: Option<&Spanned<RawSize>>, min: u64) -> Option<u64> {
        let raw = raw?;
        let bytes = match raw.get_ref() {
            RawSize::Bytes(n) => match u64::try_from(*n) {
                Ok(n) => n,
                Err(_) => {
                    self.issue(key, Some(raw.span()), format!("invalid size {n}: negative"));
                    return None;
                }
            },
            RawSize::Text(text) => match text.trim().parse::<bytesize::ByteSize>() {
                Ok(size) => size.as_u64(),
                Err(e) => {
                    self.issue(
                        key,
                        Some(raw.span()),
                        format!(
                            "invalid size {text:?}: {e} (write e.g. \"64MiB\", \"512KiB\" or a number of bytes)"
                        ),
                    );
                    return None;
                }
            },
        };
        if bytes < min {
            let message = if min == WASM_PAGE {
                format!(
                    "{bytes} bytes is less than one WebAssembly page; must be at least {min} bytes (64KiB)"
                )
            } else {
                format!("must be at least {min} byte(s), got {bytes}")
            };
            self.issue(key, Some(raw.span()), message);
            return None;
        }
        Some(bytes)
    }

    fn int(&mut self, key: &str, raw: Option<&Spanned<RawInt>>, min: i64, max: i64) -> Option<i64> {
        let raw = raw?;
        let value = raw.get_ref().0;
        if value < min || value > max {
            self.issue(
                key,
                Some(raw.span()),
                format!("must be between {min} and {max}, got {value}"),
            );
            return None;
        }
        Some(value)
    }

    fn float(
        &mut self,
        key: &str,
        raw: Option<&Spanned<RawFloat>>,
        ok: impl Fn(f64) -> bool,
        requirement: &str,
    ) -> Option<f64> {
        let raw = raw?;
        let value = raw.get_ref().0;
        if !value.is_finite() || !ok(value) {
            self.issue(key, Some(raw.span()), format!("{requirement}, got {value}"));
            return None;
        }
        Some(value)
    }

    fn choice<T: Copy>(
        &mut self,
        key: &str,
        raw: Option<&Spanned<String>>,
        options: &[(&str, T)],
    ) -> Option<T> {
        let raw = raw?;
        match options.iter().find(|(name, _)| *name == raw.get_ref()) {
            Some((_, value)) => Some(*value),
            None => {
                let expected: Vec<String> = options
                    .iter()
                    .map(|(name, _)| format!("{name:?}"))
                    .collect();
                self.issue(
                    key,
                    Some(raw.span()),
                    format!(
                        "unknown value {:?}; expected one of {}",
                        raw.get_ref(),
                        expected.join(", ")
                    ),
                );
                None
            }
        }
    }

    /// Queue, plugin, namespace, provider, schedule and collection names:
    /// `[A-Za-z0-9_-]`, 1 to 64 characters.
    fn name(&mut self, key: &str, what: &str, raw: &Spanned<String>) -> bool {
        if valid_name(raw.get_ref()) {
            return true;
        }
        self.issue(
            key,
            Some(raw.span()),
            format!(
                "invalid {what} {:?}: use 1 to 64 of the characters A-Z a-z 0-9 _ -",
                raw.get_ref()
            ),
        );
        false
    }

    fn header_name(&mut self, key: &str, raw: &Spanned<String>) -> bool {
        let is_tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        let name = raw.get_ref();
        if !name.is_empty() && name.chars().all(is_tchar) {
            return true;
        }
        self.issue(
            key,
            Some(raw.span()),
            format!("{name:?} is not a valid HTTP header name"),
        );
        false
    }

    fn secret(&mut self, key: &str, raw: &Spanned<RawSecret>) -> Option<Secret> {
        let table = match raw.get_ref() {
            RawSecret::Plain(value) => return Some(Secret::Plain(value.clone())),
            RawSecret::Table(table) => table,
        };
        let prefix = table
            .prefix
            .as_ref()
            .map(|p| p.get_ref().clone())
            .unwrap_or_default();
        match (&table.env, &table.file) {
            (Some(var), None) => {
                let name = var.get_ref();
                if name.is_empty() || name.contains(['=', '\0']) {
                    self.issue(
                        &join(key, "env"),
                        Some(var.span()),
                        format!("{name:?} is not a valid environment variable name"),
                    );
                    return None;
                }
                Some(Secret::Env {
                    var: name.clone(),
                    prefix,
                })
            }
            (None, Some(file)) => {
                if file.get_ref().trim().is_empty() {
                    self.issue(&join(key, "file"), Some(file.span()), "the path is empty");
                    return None;
                }
                Some(Secret::File {
                    path: resolve_path(&self.base_dir, file.get_ref()),
                    prefix,
                })
            }
            (Some(_), Some(file)) => {
                self.issue(
                    &join(key, "file"),
                    Some(file.span()),
                    "give either `env` or `file`, not both",
                );
                None
            }
            (None, None) => {
                self.issue(
                    key,
                    Some(raw.span()),
                    "a secret table needs `env = \"VAR\"` or `file = \"/path\"`",
                );
                None
            }
        }
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `base/p`, or `p` when absolute; without `.` components.
fn resolve_path(base: &Path, path: &str) -> PathBuf {
    let path = Path::new(path);
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    };
    let cleaned: PathBuf = joined
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect();
    if cleaned.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        cleaned
    }
}

/// A key as TOML would write it: bare when it can be, quoted otherwise.
fn quote_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_owned()
    } else {
        let mut quoted = String::from("\"");
        for c in key.chars() {
            match c {
                '"' => quoted.push_str("\\\""),
                '\\' => quoted.push_str("\\\\"),
                c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
                c => quoted.push(c),
            }
        }
        quoted.push('"');
        quoted
    }
}

/// `parent.child`, quoting `child` when needed.
fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        quote_key(child)
    } else {
        format!("{parent}.{}", quote_key(child))
    }
}

/// The dotted path of the innermost key or value of `document` at byte
/// `offset` (for serde errors, which carry a position but no key).
fn key_at(document: &toml::de::DeTable<'_>, offset: usize) -> String {
    let mut best: Option<(usize, String)> = None;
    let mut path = String::new();
    walk_table(document, offset, &mut path, &mut best);
    best.map(|(_, key)| key).unwrap_or_default()
}

fn walk_table(
    table: &toml::de::DeTable<'_>,
    offset: usize,
    path: &mut String,
    best: &mut Option<(usize, String)>,
) {
    for (key, value) in table.iter() {
        let saved = path.len();
        let segment = quote_key(key.get_ref());
        if path.is_empty() {
            path.push_str(&segment);
        } else {
            path.push('.');
            path.push_str(&segment);
        }
        consider(key.span(), offset, path, best);
        walk_value(value, offset, path, best);
        path.truncate(saved);
    }
}

fn walk_value(
    value: &Spanned<toml::de::DeValue<'_>>,
    offset: usize,
    path: &mut String,
    best: &mut Option<(usize, String)>,
) {
    consider(value.span(), offset, path, best);
    match value.get_ref() {
        toml::de::DeValue::Table(table) => walk_table(table, offset, path, best),
        toml::de::DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let saved = path.len();
                path.push_str(&format!("[{i}]"));
                walk_value(item, offset, path, best);
                path.truncate(saved);
            }
        }
        _ => {}
    }
}

/// Keeps the smallest span around `offset`; on a tie, the deeper (later) path.
fn consider(span: Range<usize>, offset: usize, path: &str, best: &mut Option<(usize, String)>) {
    let contains = span.contains(&offset) || (span.is_empty() && span.start == offset);
    if !contains {
        return;
    }
    let len = span.len();
    if best.as_ref().is_none_or(|(best_len, _)| len <= *best_len) {
        *best = Some((len, path.to_owned()));
    }
}

/// A TOML table as JSON. Datetimes become their RFC 3339 strings; floats
/// that JSON cannot hold (NaN, infinities) are errors.
fn table_to_json(table: &toml::Table) -> Result<serde_json::Value, String> {
    let mut object = serde_json::Map::new();
    for (key, value) in table {
        object.insert(key.clone(), value_to_json(value)?);
    }
    Ok(serde_json::Value::Object(object))
}

fn value_to_json(value: &toml::Value) -> Result<serde_json::Value, String> {
    Ok(match value {
        toml::Value::String(s) => serde_json::Value::String(s.clone()),
        toml::Value::Integer(i) => serde_json::Value::from(*i),
        toml::Value::Float(f) => match serde_json::Number::from_f64(*f) {
            Some(n) => serde_json::Value::Number(n),
            None => return Err(format!("{f} cannot be represented in JSON")),
        },
        toml::Value::Boolean(b) => serde_json::Value::Bool(*b),
        toml::Value::Datetime(dt) => serde_json::Value::String(dt.to_string()),
        toml::Value::Array(items) => serde_json::Value::Array(
            items
                .iter()
                .map(value_to_json)
                .collect::<Result<Vec<_>, _>>()?,
        ),
        toml::Value::Table(table) => table_to_json(table)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The examples of DESIGN 6.4, 6.5 and 10, with the queue the schedule names.
    const DESIGN_EXAMPLE: &str = r#"
[daemon]
data_dir = "./data"            # the ledger (khata.db) and the email outbox
plugins_dir = "./plugins"      # <name>.wasm, watched for changes
listen = "127.0.0.1:7373"
# token_file = "/etc/khata/token"
# shutdown_grace = "30s"

[retention]
jobs = "7d"
fences = "30d"

[defaults]                      # every queue inherits these
concurrency = 4
timeout = "30s"
max_attempts = 5
backoff = { initial = "1s", max = "10m", multiplier = 2.0, jitter = 0.2 }
memory = "64MiB"
on_uncertain = "skip"           # skip | repeat | dead
# rate_limit = { max = 100, per = "1s" }   # attempts started per queue, as BullMQ's limiter
# max_payload = "1MiB"  max_result = "1MiB"

[queues.welcome-email]
plugin = "welcome_email"
namespace = "users"
grants = { kv = true, email = true }

[queues.charge-customer]
plugin = "charge_customer"
grants = { http = ["payments"] }

[queues.update-search-index]
plugin = "update_search_index"
grants = { kv = true, index = ["products"] }

[queues.generate-report]
plugin = "generate_report"
grants = { kv = true, email = true }

[email]
transport = "outbox"            # or "smtp"
from = "noreply@example.com"
# host = "127.0.0.1"  port = 2525  tls = "none" | "starttls" | "tls"

[http.payments]
base_url = "http://127.0.0.1:12111"
idempotency_header = "Idempotency-Key"
timeout = "10s"
headers = { Authorization = { env = "PAYMENTS_TOKEN", prefix = "Bearer " } }

[schedules.daily-report]
queue = "generate-report"
cron = "0 6 * * *"              # standard 5-field cron, in `timezone` (default UTC)
payload = { kind = "daily" }
catch_up = "latest"             # latest | all | none: fires missed while the daemon was down

[store]
backend = "postgres"           # "sqlite" (the default, in data_dir) | "sled" | "postgres"
url = { env = "KHATA_DATABASE_URL" }   # or a string, or { file = "/etc/khata/db-url" }
pool = 16
lease = "30s"                  # a lease not renewed by heartbeat for this long expires
heartbeat = "5s"
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("/etc/khata/jobs.toml"))
    }

    fn errors(text: &str) -> Vec<ConfigIssue> {
        match parse(text) {
            Ok(config) => panic!("expected errors, got {config:#?}"),
            Err(e) => e.errors,
        }
    }

    fn issue<'a>(issues: &'a [ConfigIssue], key: &str) -> &'a ConfigIssue {
        issues
            .iter()
            .find(|i| i.key == key)
            .unwrap_or_else(|| panic!("no issue for {key}: {issues:#?}"))
    }

    #[test]
    fn retention_windows_and_kv_namespaces() {
        let config = parse(
            r#"
[retention]
dead = "90d"
tombstones = "1d"
kv = { users = "12h" }
[queues.a]
plugin = "p"
namespace = "users"
"#,
        )
        .unwrap();
        let r = &config.retention;
        assert_eq!(r.jobs, Duration::from_secs(7 * 86_400), "default kept");
        assert_eq!(r.dead, Duration::from_secs(90 * 86_400));
        assert_eq!(r.tombstones, Duration::from_secs(86_400));
        assert_eq!(r.kv["users"], Duration::from_secs(12 * 3600));

        let issues = errors(
            "[retention]\nkv = { userz = \"1h\", users = \"0s\" }\n[queues.a]\nplugin = \"p\"\nnamespace = \"users\"\n",
        );
        let typo = issue(&issues, "retention.kv.userz");
        assert_eq!((typo.line, typo.column), (Some(2), Some(8)));
        assert!(
            typo.message.contains("\"userz\"") && typo.message.contains("users"),
            "{typo:?}"
        );
        assert!(
            issue(&issues, "retention.kv.users")
                .message
                .contains("longer than zero")
        );
    }

    #[test]
    fn design_example_parses() {
        let config = parse(DESIGN_EXAMPLE).unwrap();
        assert_eq!(config.path, Path::new("/etc/khata/jobs.toml"));
        assert_eq!(config.daemon.data_dir, Path::new("/etc/khata/data"));
        assert_eq!(config.daemon.plugins_dir, Path::new("/etc/khata/plugins"));
        assert_eq!(config.daemon.listen, "127.0.0.1:7373".parse().unwrap());
        assert_eq!(config.daemon.token, None);
        assert_eq!(config.daemon.shutdown_grace, Duration::from_secs(30));
        assert_eq!(config.retention, Retention::default());
        assert_eq!(config.retention.jobs, Duration::from_secs(7 * 86_400));

        let names: Vec<&str> = config.queues.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "charge-customer",
                "generate-report",
                "update-search-index",
                "welcome-email"
            ]
        );
        let welcome = config.queue("welcome-email").unwrap();
        assert_eq!(welcome.plugin, "welcome_email");
        assert_eq!(welcome.namespace, "users");
        assert_eq!(
            welcome.grants,
            Grants {
                kv: true,
                email: true,
                index: vec![],
                http: vec![]
            }
        );
        assert_eq!(welcome.concurrency, 4);
        assert_eq!(welcome.timeout, Duration::from_secs(30));
        assert_eq!(welcome.max_attempts, 5);
        assert_eq!(welcome.backoff, Backoff::default());
        assert_eq!(welcome.memory, 64 * MIB);
        assert_eq!(welcome.on_uncertain, OnUncertain::Skip);
        assert_eq!(welcome.rate_limit, None);
        assert_eq!(welcome.max_payload, MIB);
        assert_eq!(welcome.max_result, MIB);

        let charge = &config.queues["charge-customer"];
        assert_eq!(charge.namespace, "charge-customer");
        assert_eq!(charge.grants.http, ["payments"]);
        assert!(!charge.grants.kv && !charge.grants.email);
        let index = &config.queues["update-search-index"];
        assert_eq!(index.grants.index, ["products"]);

        assert_eq!(config.email.transport, EmailTransport::Outbox);
        assert_eq!(config.email.from, "noreply@example.com");
        assert_eq!(config.email.host, "127.0.0.1");
        assert_eq!(config.email.port, 25);
        assert_eq!(config.email.tls, SmtpTls::None);
        assert_eq!(config.email.timeout, Duration::from_secs(10));

        let payments = &config.http["payments"];
        assert_eq!(payments.name, "payments");
        assert_eq!(payments.base_url, "http://127.0.0.1:12111");
        assert_eq!(
            payments.idempotency_header.as_deref(),
            Some("Idempotency-Key")
        );
        assert_eq!(payments.timeout, Duration::from_secs(10));
        assert_eq!(payments.max_response, MIB);
        assert_eq!(payments.reconcile, None);
        assert_eq!(
            payments.headers["Authorization"],
            Secret::Env {
                var: "PAYMENTS_TOKEN".into(),
                prefix: "Bearer ".into()
            }
        );

        let report = &config.schedules["daily-report"];
        assert_eq!(report.queue, "generate-report");
        assert_eq!(report.cron, "0 6 * * *");
        assert_eq!(report.timezone, "UTC");
        assert_eq!(report.payload, serde_json::json!({"kind": "daily"}));
        assert_eq!(report.catch_up, CatchUp::Latest);

        assert_eq!(config.store.backend, Backend::Postgres);
        assert_eq!(
            config.store.url,
            Some(Secret::Env {
                var: "KHATA_DATABASE_URL".into(),
                prefix: String::new()
            })
        );
        assert_eq!(config.store.pool, 16);
        assert_eq!(config.store.lease, Duration::from_secs(30));
        assert_eq!(config.store.heartbeat, Duration::from_secs(5));
    }

    #[test]
    fn empty_file_is_all_defaults() {
        let config = parse("").unwrap();
        assert!(config.queues.is_empty());
        assert_eq!(config.daemon.data_dir, Path::new("/etc/khata/data"));
        assert_eq!(config.daemon.listen, Daemon::default().listen);
        assert_eq!(config.retention, Retention::default());
        assert_eq!(config.email, Email::default());
        assert_eq!(config.store, StoreConfig::default());
        assert!(config.http.is_empty() && config.schedules.is_empty());
    }

    #[test]
    fn defaults_applied_and_overridden() {
        let config = parse(
            r#"
[defaults]
concurrency = 8
timeout = "1m"
backoff = { initial = "2s", jitter = 0.0 }
rate_limit = { max = 100, per = "1s" }
max_payload = "512KiB"

[queues.plain]
plugin = "echo"

[queues.tuned]
plugin = "echo"
concurrency = 1
timeout = "500ms"
max_attempts = 10
backoff = { multiplier = 3 }
memory = 1048576
on_uncertain = "dead"
rate_limit = { max = 5, per = "1m" }
max_payload = "2MiB"
max_result = "4KiB"
"#,
        )
        .unwrap();
        let plain = &config.queues["plain"];
        assert_eq!(plain.namespace, "plain");
        assert_eq!(plain.grants, Grants::default());
        assert_eq!(plain.concurrency, 8);
        assert_eq!(plain.timeout, Duration::from_secs(60));
        assert_eq!(plain.max_attempts, 5);
        assert_eq!(
            plain.backoff,
            Backoff {
                initial: Duration::from_secs(2),
                max: Duration::from_secs(600),
                multiplier: 2.0,
                jitter: 0.0
            }
        );
        assert_eq!(plain.memory, 64 * MIB);
        assert_eq!(plain.on_uncertain, OnUncertain::Skip);
        assert_eq!(
            plain.rate_limit,
            Some(RateLimit {
                max: 100,
                per: Duration::from_secs(1)
            })
        );
        assert_eq!(plain.max_payload, 512 * KIB);
        assert_eq!(plain.max_result, MIB);

        let tuned = &config.queues["tuned"];
        assert_eq!(tuned.concurrency, 1);
        assert_eq!(tuned.timeout, Duration::from_millis(500));
        assert_eq!(tuned.max_attempts, 10);
        // Only the multiplier is the queue's own; the rest come from [defaults].
        assert_eq!(
            tuned.backoff,
            Backoff {
                initial: Duration::from_secs(2),
                max: Duration::from_secs(600),
                multiplier: 3.0,
                jitter: 0.0
            }
        );
        assert_eq!(tuned.memory, MIB);
        assert_eq!(tuned.on_uncertain, OnUncertain::Dead);
        assert_eq!(
            tuned.rate_limit,
            Some(RateLimit {
                max: 5,
                per: Duration::from_secs(60)
            })
        );
        assert_eq!(tuned.max_payload, 2 * MIB);
        assert_eq!(tuned.max_result, 4 * KIB);
    }

    #[test]
    fn unknown_key_in_queue_has_line_and_column() {
        let text = "[queues.x]\nplugin = \"echo\"\n  bogus = 1\n";
        let issues = errors(text);
        assert_eq!(issues.len(), 1, "{issues:#?}");
        let e = &issues[0];
        assert_eq!(e.key, "queues.x.bogus");
        assert_eq!((e.line, e.column), (Some(3), Some(3)));
        assert!(e.message.contains("unknown field `bogus`"), "{}", e.message);

        // In an inline table, and in a grant.
        let e = &errors("[queues.x]\nplugin = \"echo\"\ngrants = { kv = true, disk = true }\n")[0];
        assert_eq!(e.key, "queues.x.grants.disk");
        assert_eq!((e.line, e.column), (Some(3), Some(23)));

        // At the top level.
        let e = &errors("[deamon]\n")[0];
        assert_eq!(e.key, "deamon");
        assert_eq!((e.line, e.column), (Some(1), Some(2)));
    }

    #[test]
    fn wrong_type_names_key_and_position() {
        let e = &errors("[queues.x]\nplugin = \"echo\"\nconcurrency = \"4\"\n")[0];
        assert_eq!(e.key, "queues.x.concurrency");
        assert_eq!((e.line, e.column), (Some(3), Some(15)));

        let e = &errors("[queues.x]\nplugin = \"echo\"\ngrants = { index = [\"a\", 3] }\n")[0];
        assert_eq!(e.key, "queues.x.grants.index[1]");
        assert_eq!((e.line, e.column), (Some(3), Some(26)));

        let e = &errors("[http.p]\nbase_url = \"http://x\"\nheaders = { A = 5 }\n")[0];
        assert_eq!(e.key, "http.p.headers.A");

        let e = &errors(
            "[http.p]\nbase_url = \"http://x\"\nheaders = { A = { env = \"X\", pre = \"Bearer \" } }\n",
        )[0];
        assert_eq!(e.key, "http.p.headers.A.pre");
        assert_eq!((e.line, e.column), (Some(3), Some(30)));
    }

    #[test]
    fn syntax_error_has_position() {
        let e = &errors("[daemon]\nlisten = \"127.0.0.1:7373\ndata_dir = \"x\"\n")[0];
        assert_eq!(e.line, Some(2));
        assert!(e.column.is_some());
    }

    #[test]
    fn bad_duration_names_key_and_position() {
        let text = "\n[queues.welcome]\nplugin = \"welcome_email\"\ntimeout = \"30 parsecs\"\n";
        let err = parse(text).unwrap_err();
        assert_eq!(err.errors.len(), 1, "{err}");
        let e = &err.errors[0];
        assert_eq!(e.key, "queues.welcome.timeout");
        assert_eq!((e.line, e.column), (Some(4), Some(11)));
        let shown = err.to_string();
        assert!(
            shown.starts_with(
                "/etc/khata/jobs.toml:4:11: queues.welcome.timeout: invalid duration \"30 parsecs\": "
            ),
            "{shown}"
        );
        let relative = Config::parse(text, Path::new("jobs.toml")).unwrap_err();
        assert!(
            relative
                .to_string()
                .starts_with("jobs.toml:4:11: queues.welcome.timeout: ")
        );
    }

    #[test]
    fn semantic_errors_are_all_reported() {
        let text = r#"
[defaults]
concurrency = 0
backoff = { multiplier = 0.5, jitter = 1.5 }

[queues."bad name"]
plugin = "echo"

[queues.a]
plugin = "echo"
max_attempts = 0
memory = "lots"
on_uncertain = "maybe"
grants = { http = ["payments", "nowhere"] }

[queues.b]
namespace = "b"

[http.payments]
base_url = "ftp://example.com"

[schedules.s]
queue = "missing"
cron = "0 6 * *"
catch_up = "sometimes"

[store]
backend = "mysql"
lease = "5s"
heartbeat = "10s"
"#;
        let err = parse(text).unwrap_err();
        let issues = &err.errors;
        let expect = [
            ("defaults.concurrency", 3, 15),
            ("defaults.backoff.multiplier", 4, 26),
            ("defaults.backoff.jitter", 4, 40),
            ("queues.\"bad name\"", 6, 9),
            ("queues.a.max_attempts", 11, 16),
            ("queues.a.memory", 12, 10),
            ("queues.a.on_uncertain", 13, 16),
            ("queues.a.grants.http[1]", 14, 32),
            ("queues.b.plugin", 16, 9),
            ("http.payments.base_url", 20, 12),
            ("schedules.s.queue", 23, 9),
            ("schedules.s.cron", 24, 8),
            ("schedules.s.catch_up", 25, 12),
            ("store.backend", 28, 11),
            ("store.heartbeat", 30, 13),
        ];
        for (key, line, column) in expect {
            let found = issue(issues, key);
            assert_eq!(
                (found.line, found.column),
                (Some(line), Some(column)),
                "{key}: {found:?}"
            );
        }
        assert_eq!(issues.len(), expect.len(), "{err}");
        // Sorted by position, one line each.
        assert_eq!(err.to_string().lines().count(), expect.len());
        assert!(issues.windows(2).all(|w| w[0].line <= w[1].line));
    }

    #[test]
    fn relative_paths_resolve_against_the_config_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("secrets")).unwrap();
        std::fs::write(
            dir.path().join("secrets/token"),
            "  s3cret-s3cret-s3cret \n",
        )
        .unwrap();
        std::fs::write(dir.path().join("secrets/db"), "postgres://x\n").unwrap();
        let text = r#"
[daemon]
data_dir = "state"
plugins_dir = "/opt/khata/plugins"
token_file = "secrets/token"

[store]
backend = "postgres"
url = { file = "./secrets/db" }
"#;
        let path = dir.path().join("jobs.toml");
        std::fs::write(&path, text).unwrap();
        let config = Config::load(&path).unwrap();
        assert_eq!(config.daemon.data_dir, dir.path().join("state"));
        assert_eq!(config.daemon.plugins_dir, Path::new("/opt/khata/plugins"));
        assert_eq!(config.daemon.token.as_deref(), Some("s3cret-s3cret-s3cret"));
        let url = config.store.url.clone().unwrap();
        assert_eq!(
            url,
            Secret::File {
                path: dir.path().join("secrets/db"),
                prefix: String::new()
            }
        );
        assert_eq!(url.resolve().unwrap(), "postgres://x");
        assert!(!format!("{config:?}").contains("s3cret"));

        // A bare file name: relative to the working directory, as given.
        let config = Config::parse("", Path::new("jobs.toml")).unwrap();
        assert_eq!(config.daemon.data_dir, Path::new("data"));
        assert_eq!(config.daemon.plugins_dir, Path::new("plugins"));
    }

    #[test]
    fn token_file_problems_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.toml");
        let text = "[daemon]\nlisten = \"0.0.0.0:7373\"\ntoken_file = \"nope\"\n";
        let err = Config::parse(text, &path).unwrap_err();
        assert_eq!(err.errors.len(), 1, "{err}");
        let e = &err.errors[0];
        assert_eq!(e.key, "daemon.token_file");
        assert_eq!((e.line, e.column), (Some(3), Some(14)));
        assert!(e.message.contains("nope"), "{}", e.message);

        let err = parse("[daemon]\ntoken = \"a\"\ntoken_file = \"b\"\n").unwrap_err();
        assert_eq!(err.errors[0].key, "daemon.token_file");
    }

    #[test]
    fn a_short_token_and_a_bad_host_name_are_named() {
        let e = &errors("[daemon]\ntoken = \"s3cret\"\n")[0];
        assert_eq!(e.key, "daemon.token");
        assert_eq!((e.line, e.column), (Some(2), Some(9)));
        assert!(
            e.message.contains("6 bytes") && e.message.contains("16"),
            "{}",
            e.message
        );

        let e = &errors("[daemon]\nallowed_hosts = [\"jobs.internal\", \"x:80\"]\n")[0];
        assert_eq!(e.key, "daemon.allowed_hosts");
        assert_eq!((e.line, e.column), (Some(2), Some(17)));
        assert!(e.message.contains("\"x:80\""), "{}", e.message);
        let config = parse("[daemon]\nallowed_hosts = [\"Jobs.Internal\"]\n").unwrap();
        assert_eq!(config.daemon.allowed_hosts, ["jobs.internal"]);
    }

    #[test]
    fn non_loopback_listen_needs_a_token() {
        let e = &errors("[daemon]\nlisten = \"0.0.0.0:7373\"\n")[0];
        assert_eq!(e.key, "daemon.listen");
        assert_eq!((e.line, e.column), (Some(2), Some(10)));
        assert!(e.message.contains("token"), "{}", e.message);

        let config =
            parse("[daemon]\nlisten = \"0.0.0.0:7373\"\ntoken = \"0123456789abcdef\"\n").unwrap();
        assert_eq!(config.daemon.token.as_deref(), Some("0123456789abcdef"));
        assert_eq!(config.daemon.listen.port(), 7373);
        parse("[daemon]\nlisten = \"[::1]:8080\"\n").unwrap();

        let e = &errors("[daemon]\nlisten = \"localhost\"\n")[0];
        assert_eq!(e.key, "daemon.listen");
    }

    #[test]
    fn missing_plugin_and_several_sections_checked() {
        let issues = errors(
            r#"
[queues.q]
plugin = "../evil"
namespace = "a.b"

[email]
transport = "smtp"
from = "nobody"
port = 70000
username = "u"

[http.p]
base_url = "https://api.example.com/"
idempotency_header = "Idem Key"
headers = { "X Bad" = "v", X-Env = { prefix = "p" } }
reconcile = { method = "G3T", path = "v1" }
max_response = 0
"#,
        );
        for key in [
            "queues.q.plugin",
            "queues.q.namespace",
            "email.from",
            "email.port",
            "email.password",
            "http.p.idempotency_header",
            "http.p.headers.\"X Bad\"",
            "http.p.headers.X-Env",
            "http.p.reconcile.method",
            "http.p.reconcile.path",
            "http.p.max_response",
        ] {
            issue(&issues, key);
        }
    }

    #[test]
    fn smtp_http_and_store_values() {
        let config = parse(
            r#"
[email]
transport = "smtp"
host = "mail.example.com"
port = 2525
tls = "starttls"
username = "khata"
password = { file = "/etc/khata/smtp", prefix = "" }
timeout = "3s"

[http.push]
base_url = "https://push.example.com/api/"
headers = { X-Plain = "value", X-File = { file = "push-key" } }
max_response = 4096
reconcile = { method = "get", path = "/v1/messages" }

[store]
backend = "sled"
pool = 2
cache = "32MiB"
"#,
        )
        .unwrap();
        assert_eq!(config.email.transport, EmailTransport::Smtp);
        assert_eq!(config.email.port, 2525);
        assert_eq!(config.email.tls, SmtpTls::Starttls);
        assert_eq!(config.email.username, Some(Secret::Plain("khata".into())));
        assert_eq!(config.email.timeout, Duration::from_secs(3));
        let push = &config.http["push"];
        assert_eq!(push.base_url, "https://push.example.com/api");
        assert_eq!(push.headers["X-Plain"], Secret::Plain("value".into()));
        assert_eq!(
            push.headers["X-File"],
            Secret::File {
                path: "/etc/khata/push-key".into(),
                prefix: String::new()
            }
        );
        assert_eq!(push.max_response, 4096);
        assert_eq!(
            push.reconcile,
            Some(Reconcile {
                method: "GET".into(),
                path: "/v1/messages".into()
            })
        );
        assert_eq!(config.store.backend, Backend::Sled);
        assert_eq!(config.store.pool, 2);
        assert_eq!(config.store.cache, 32 * MIB);
        assert!(!format!("{:?}", config.email).contains("\"khata\""));
    }

    #[test]
    fn store_cache_only_with_sled_and_at_least_a_mebibyte() {
        assert_eq!(parse("").unwrap().store.cache, SLED_CACHE);
        let issues = errors("[store]\ncache = \"64MiB\"\n");
        let found = issue(&issues, "store.cache");
        assert_eq!((found.line, found.column), (Some(2), Some(9)), "{found:?}");
        assert!(
            found.message.contains("only used by backend \"sled\""),
            "{found:?}"
        );
        let issues = errors("[store]\nbackend = \"sled\"\ncache = \"12KiB\"\n");
        assert_eq!(issue(&issues, "store.cache").line, Some(3));
    }

    #[test]
    fn store_url_only_with_postgres() {
        let issues = errors("[store]\nbackend = \"postgres\"\n");
        assert_eq!(issue(&issues, "store.url").line, Some(2));
        let issues = errors("[store]\nurl = \"postgres://x\"\n");
        assert_eq!(issue(&issues, "store.url").line, Some(2));
    }

    #[test]
    fn an_inline_store_url_is_checked_without_being_repeated() {
        let issues = errors(
            "[store]\nbackend = \"postgres\"\npool = 4\nurl = \"postgres://u:s3cret@db:port/khata\"\n",
        );
        let found = issue(&issues, "store.url");
        assert_eq!((found.line, found.column), (Some(4), Some(7)), "{found:?}");
        assert!(
            found.message.contains("not a PostgreSQL connection URL"),
            "{found:?}"
        );
        assert!(!found.message.contains("s3cret"), "{found:?}");
        let issues = errors("[store]\nbackend = \"postgres\"\nurl = \"postgres://db\"\npool = 0\n");
        let found = issue(&issues, "store.pool");
        assert_eq!((found.line, found.column), (Some(4), Some(8)), "{found:?}");
        let config = parse(
            "[store]\nbackend = \"postgres\"\nurl = { env = \"KHATA_DATABASE_URL\" }\npool = 4\n",
        )
        .unwrap();
        assert_eq!(config.store.pool, 4);
    }

    #[test]
    fn schedule_payload_becomes_json() {
        let config = parse(
            r#"
[queues.r]
plugin = "generate_report"

[schedules.weekly]
queue = "r"
cron = "0  6 * *   1"
timezone = "Europe/Berlin"
payload = { period = "week", n = 2, ratio = 0.5, tags = ["a", "b"], at = 1979-05-27T07:32:00Z, nested = { ok = true } }
catch_up = "all"

[schedules.bare]
queue = "r"
cron = "*/5 * * * *"
"#,
        )
        .unwrap();
        let weekly = &config.schedules["weekly"];
        assert_eq!(weekly.cron, "0 6 * * 1");
        assert_eq!(weekly.timezone, "Europe/Berlin");
        assert_eq!(weekly.catch_up, CatchUp::All);
        assert_eq!(
            weekly.payload,
            serde_json::json!({
                "period": "week", "n": 2, "ratio": 0.5, "tags": ["a", "b"],
                "at": "1979-05-27T07:32:00Z", "nested": {"ok": true}
            })
        );
        let bare = &config.schedules["bare"];
        assert_eq!(bare.payload, serde_json::json!({}));
        assert_eq!(bare.catch_up, CatchUp::Latest);
        assert_eq!(bare.timezone, "UTC");

        let issues = errors(
            "[queues.r]\nplugin = \"x\"\n[schedules.s]\nqueue = \"r\"\ncron = \"* * * * *\"\npayload = { x = nan }\n",
        );
        assert_eq!(issue(&issues, "schedules.s.payload").line, Some(6));
    }

    #[test]
    fn backoff_cannot_start_above_its_max() {
        let issues = errors("[defaults]\nbackoff = { initial = \"20m\" }\n");
        assert_eq!(issue(&issues, "defaults.backoff.initial").line, Some(2));
        let issues = errors(
            "[defaults]\nbackoff = { max = \"1h\" }\n[queues.q]\nplugin = \"x\"\nbackoff = { max = \"1s\", initial = \"5s\" }\n",
        );
        assert_eq!(issues.len(), 1);
        assert_eq!(issue(&issues, "queues.q.backoff.max").line, Some(5));
    }

    #[test]
    fn backoff_delay() {
        let b = Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
            multiplier: 2.0,
            jitter: 0.0,
        };
        assert_eq!(b.delay(1, 0.3), Duration::from_secs(1));
        assert_eq!(b.delay(0, 0.3), Duration::from_secs(1));
        assert_eq!(b.delay(2, 0.3), Duration::from_secs(2));
        assert_eq!(b.delay(3, 0.3), Duration::from_secs(4));
        assert_eq!(b.delay(6, 0.3), Duration::from_secs(32));
        assert_eq!(b.delay(7, 0.3), Duration::from_secs(60));
        assert_eq!(b.delay(1000, 0.3), Duration::from_secs(60));
        assert_eq!(b.delay(u32::MAX, 0.3), Duration::from_secs(60));

        let j = Backoff {
            jitter: 0.2,
            ..b.clone()
        };
        let close = |d: Duration, secs: f64| (d.as_secs_f64() - secs).abs() < 1e-9;
        assert!(close(j.delay(1, 0.5), 1.0));
        assert!(close(j.delay(1, 0.0), 0.8));
        assert!(close(j.delay(3, 0.75), 4.0 * 1.1));
        assert!(close(j.delay(100, 0.0), 48.0));
        for i in 0..100 {
            let u = f64::from(i) / 100.0;
            for attempt in [1, 2, 5, 10, 50] {
                let d = j.delay(attempt, u).as_secs_f64();
                let base = b.delay(attempt, u).as_secs_f64();
                assert!(d >= base * 0.8 - 1e-9 && d <= base * 1.2 + 1e-9);
                assert!(d <= 60.0 * 1.2 + 1e-9);
            }
        }
        // Out-of-range randomness is clamped, never negative or above the bound.
        assert!(close(j.delay(100, 7.0), 72.0));
        assert!(close(j.delay(100, -3.0), 48.0));
        let full = Backoff {
            jitter: 1.0,
            ..b.clone()
        };
        assert_eq!(full.delay(3, 0.0), Duration::ZERO);
        assert_eq!(full.delay(100, 0.999_999_999_9).as_secs(), 119);
        assert!(full.delay(100, f64::NAN) <= Duration::from_secs(120));
    }

    #[test]
    fn secrets_resolve() {
        let path = std::env::var("PATH").unwrap_or_default();
        let secret = Secret::Env {
            var: "PATH".into(),
            prefix: "p:".into(),
        };
        if !path.is_empty() {
            assert_eq!(secret.resolve().unwrap(), format!("p:{path}"));
        }
        let missing = Secret::Env {
            var: "KHATA_TEST_SURELY_UNSET_7f3a".into(),
            prefix: String::new(),
        };
        assert!(
            missing
                .resolve()
                .unwrap_err()
                .contains("KHATA_TEST_SURELY_UNSET_7f3a")
        );
        let file = Secret::File {
            path: "/nonexistent/khata/secret".into(),
            prefix: String::new(),
        };
        assert!(
            file.resolve()
                .unwrap_err()
                .contains("/nonexistent/khata/secret")
        );
        assert_eq!(Secret::Plain("x".into()).resolve().unwrap(), "x");
        assert_eq!(
            format!("{:?}", Secret::Plain("x".into())),
            "Plain(<redacted>)"
        );
    }

    #[test]
    fn load_reports_unreadable_file() {
        let err = Config::load(Path::new("/nonexistent/khata/jobs.toml")).unwrap_err();
        assert_eq!(err.errors.len(), 1);
        assert!(
            err.to_string()
                .starts_with("/nonexistent/khata/jobs.toml: cannot read")
        );
    }
}
