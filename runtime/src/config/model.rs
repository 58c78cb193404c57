//! The resolved configuration: plain values with every default applied,
//! which the rest of the daemon reads.

use super::*;

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
    /// Every capability, whatever the fields above say: never set from
    /// jobs.toml, only by `khata verify` run without a queue, which tries a
    /// plugin against everything it imports.
    pub everything: bool,
}

impl Grants {
    /// Every capability (see [`Grants::everything`]).
    pub fn all() -> Grants {
        Grants {
            everything: true,
            ..Grants::default()
        }
    }

    pub fn allows_kv(&self) -> bool {
        self.kv || self.everything
    }

    pub fn allows_email(&self) -> bool {
        self.email || self.everything
    }

    pub fn allows_index(&self, collection: &str) -> bool {
        self.everything || self.index.iter().any(|c| c == collection)
    }

    pub fn allows_http(&self, provider: &str) -> bool {
        self.everything || self.http.iter().any(|p| p == provider)
    }
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

/// What to do with an attempt's effect whose outcome is unknown (docs/effects.md#on_uncertain).
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

/// One `[schedules.NAME]` (docs/jobs-toml.md#schedulesname).
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

/// `[store]` (docs/jobs-toml.md#store).
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
