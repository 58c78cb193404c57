//! `khata verify`: proves, before deployment, that a handler is safe to run
//! twice — the rule "run it twice, the effect happens once" as a command.
//!
//! The handler runs in this process on the daemon's own [`Host`], fences and
//! [`SqliteStore`], each ledger a throwaway one in a temporary directory.
//! Every email and HTTP effect is answered by a recorder
//! ([`crate::effects::recorded`]): nothing leaves the machine. The runs:
//!
//! 1. **clean**: once, on a fresh ledger;
//! 2. for every effect boundary of the clean run and every crash point of it
//!    ([`Point`]: before `started`, between `started` and `done` — the
//!    provider received the request, its answer is not recorded —, after
//!    `done`), on a fresh ledger: a run **cut** there, its ledger left as the
//!    crash would leave it (kv and index writes applied so far survive: the
//!    worse case for a redelivery), then `Store::recover` and a
//!    **redelivery** on the same ledger, against the same recorder (the
//!    outside world remembers what it received, and answers reconciliation);
//! 3. **fresh**: once more from the start, on a fresh ledger.
//!
//! Every run is the same job (same id, payload and enqueue time); only the
//! attempt number of a redelivery differs, as in the daemon. The findings
//! ([`Finding`]) compare the runs: keys that differ between the clean and the
//! fresh run, requests that change under one key (`key-reused`), effects
//! that a cut and its redelivery performed under two keys (performed twice),
//! results that differ, and redeliveries that end otherwise than the clean run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, Grants, OnUncertain};
use crate::effects::email::{Mail, SendError};
use crate::effects::http::{self, HttpError, HttpRequest, HttpResponse};
use crate::effects::outside::{HttpTransport, MailTransport};
use crate::effects::recorded::{self, Point, Step, Watch};
use crate::effects::{EffectError, Effects, Scope};
use crate::host::{Host, JobInput, Limits, Plugin, PoolSize, RunOutcome};
use crate::job::{Finish, Millis, NewJob};
use crate::store::sqlite::SqliteStore;
use crate::store::{LeaseAsk, LeaseLimits, Store, StoreError};

/// The job every run delivers.
const JOB_ID: &str = "verify-job";
/// Attempts the job may use: a cut and its redelivery never exhaust it.
const MAX_ATTEMPTS: u32 = 1000;
/// The From address of messages that name none (no `[email]` read).
const DEFAULT_FROM: &str = "verify@khata.invalid";
/// Limits when no queue is named.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_MEMORY: u64 = 64 << 20;
const DEFAULT_MAX_RESULT: u64 = 1 << 20;
const LOG_BYTES: usize = 64 * 1024;
const LOG_LINES: usize = 1000;
/// Hex digits of a fingerprint shown in reports.
const FINGERPRINT_HEX: usize = 16;

/// What to verify.
#[derive(Debug, Clone)]
pub struct Options {
    pub plugin: PathBuf,
    /// The payload, as the API would store it.
    pub payload: Value,
    /// Take grants, namespace and limits from this queue of `config`.
    pub queue: Option<String>,
    pub config: PathBuf,
    /// wasmtime's compiled-code cache; `None`: compile every time. Its
    /// entries are keyed by the component's bytes and the engine's settings,
    /// so one directory serves every plugin and khata version safely.
    pub code_cache: Option<PathBuf>,
}

/// The per-user code cache of `khata verify`: `$XDG_CACHE_HOME/khata/code-cache`,
/// else `$HOME/.cache/khata/code-cache`; `None` when neither is set.
pub fn default_code_cache() -> Option<PathBuf> {
    let non_empty = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    non_empty("XDG_CACHE_HOME")
        .or_else(|| non_empty("HOME").map(|h| h.join(".cache")))
        .map(|base| base.join("khata").join("code-cache"))
}

/// Why verification could not run.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Bad input: the plugin, the configuration or the queue (exit 2).
    #[error("{0}")]
    Input(String),
    /// The local machinery failed (exit 1).
    #[error("{0}")]
    Failed(String),
}

impl From<StoreError> for VerifyError {
    fn from(e: StoreError) -> VerifyError {
        VerifyError::Failed(format!("the throwaway ledger failed: {e}"))
    }
}

/// Everything `khata verify` found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub plugin: String,
    /// The plugin's content hash (hex SHA-256).
    pub version: String,
    /// How its code was had: `compiled`, read from the code `cache`, or
    /// `compiled (no cache)`.
    pub code: &'static str,
    pub payload: Value,
    /// `"queue <name> of <config>"` or `"everything the plugin imports"`.
    pub grants: String,
    pub runs: Vec<Run>,
    pub findings: Vec<Finding>,
}

/// One attempt.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// `clean`, `cut`, `redelivery` or `fresh`.
    pub name: &'static str,
    /// Runs on one ledger share a number.
    pub ledger: u32,
    pub attempt: u32,
    /// Where a `cut` run was stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cut>,
    /// Every effect call that writes (kv and index writes, email, http), in order.
    pub effects: Vec<Call>,
    pub outcome: Outcome,
}

/// A crash point: effect number `effect` (1-based) of the clean run, at `point`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Cut {
    pub effect: usize,
    pub point: Point,
}

impl Cut {
    fn describe(&self, clean: &[Call]) -> String {
        let kind = clean.get(self.effect - 1).map_or("?", |c| c.kind.as_str());
        format!("effect #{} ({kind}) {}", self.effect, self.point.as_str())
    }
}

/// One effect call of a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Call {
    pub kind: String,
    pub key: String,
    /// The first hex digits of the request's fingerprint.
    pub fingerprint: String,
    /// `performed`, `replayed`, `reconciled:done`, `applied`,
    /// `refused:<reason>`; empty when the run was cut before it ended.
    pub outcome: String,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum Outcome {
    Completed {
        result: Value,
    },
    Retry {
        error: String,
    },
    Failed {
        error: String,
    },
    Trapped {
        error: String,
    },
    TimedOut {
        error: String,
    },
    /// Stopped at its cut, as a crash.
    Cut,
}

impl Outcome {
    fn status(&self) -> &'static str {
        match self {
            Outcome::Completed { .. } => "completed",
            Outcome::Retry { .. } => "retry",
            Outcome::Failed { .. } => "failed",
            Outcome::Trapped { .. } => "trapped",
            Outcome::TimedOut { .. } => "timed-out",
            Outcome::Cut => "cut",
        }
    }

    fn describe(&self) -> String {
        match self {
            Outcome::Completed { result } => format!("completed with {result}"),
            Outcome::Retry { error }
            | Outcome::Failed { error }
            | Outcome::Trapped { error }
            | Outcome::TimedOut { error } => format!("{}: {error}", self.status()),
            Outcome::Cut => "cut".into(),
        }
    }
}

/// What makes a handler unsafe to run twice, and what to change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// `key-unstable`, `effects-unstable`, `key-reused`, `performed-twice`,
    /// `result-unstable` or `redelivery-differs`.
    pub kind: &'static str,
    /// The effect kind concerned (`email`, `http`, `kv`, `index`), if one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
    /// The keys concerned, in the order the runs used them.
    pub keys: Vec<String>,
    pub message: String,
    /// What to change.
    pub fix: String,
}

/// Runs the verification on a runtime of its own.
pub fn verify(options: &Options) -> Result<Report, VerifyError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| VerifyError::Failed(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(run(options))
}

/// The outside world of one ledger: what the recorders received.
#[derive(Default)]
struct World {
    /// (kind, key, attempt) of every delivery, in order.
    deliveries: Mutex<Vec<(String, String, u32)>>,
}

impl World {
    fn deliver(&self, kind: &str, key: &str, attempt: u32) {
        if let Ok(mut d) = self.deliveries.lock() {
            d.push((kind.to_owned(), key.to_owned(), attempt));
        }
    }

    /// Whether `key` of `kind` was delivered, by any attempt.
    fn delivered(&self, kind: &str, key: &str) -> bool {
        self.deliveries
            .lock()
            .is_ok_and(|d| d.iter().any(|(k, x, _)| k == kind && x == key))
    }
}

/// The outside world and the watch of one attempt: it takes every email and
/// HTTP request in place of a transport, answers each with a plausible
/// success, and reconciles exactly against what its ledger's world received.
struct AttemptRecorder {
    world: Arc<World>,
    attempt: u32,
    cut: Option<Cut>,
    calls: Mutex<Vec<Call>>,
    stopped: Notify,
}

#[async_trait::async_trait]
impl MailTransport for AttemptRecorder {
    /// The recorder reconciles exactly, so its nature never decides.
    fn idempotent(&self) -> bool {
        true
    }

    fn allows_sender(&self, _from: &str) -> bool {
        true
    }

    async fn send(&self, key: &str, _mail: &Mail, _message_id: &str) -> Result<(), SendError> {
        self.world.deliver("email", key, self.attempt);
        Ok(())
    }

    async fn lookup(&self, key: &str, _message_id: &str) -> Option<bool> {
        Some(self.world.delivered("email", key))
    }
}

#[async_trait::async_trait]
impl HttpTransport for AttemptRecorder {
    /// Any provider name will do; the request gets the checks that do not
    /// depend on a provider.
    fn check(&self, _provider: &str, request: &HttpRequest) -> Result<(), EffectError> {
        http::check_request(request)
            .map(drop)
            .map_err(|e| EffectError::Invalid(e.to_string()))
    }

    /// The recorder reconciles exactly, so its nature never decides.
    fn idempotent(&self, _provider: &str) -> bool {
        true
    }

    async fn send(
        &self,
        provider: &str,
        key: &str,
        _fencing_token: u64,
        _request: &HttpRequest,
    ) -> Result<HttpResponse, HttpError> {
        self.world.deliver("http", key, self.attempt);
        Ok(recorded::http_answer(provider, key))
    }

    async fn reconcile(
        &self,
        provider: &str,
        key: &str,
        _fencing_token: u64,
    ) -> Option<Result<Option<HttpResponse>, HttpError>> {
        Some(Ok(self
            .world
            .delivered("http", key)
            .then(|| recorded::http_answer(provider, key))))
    }
}

impl Watch for AttemptRecorder {
    fn stop_at(&self, step: &Step<'_>) -> bool {
        let Ok(mut calls) = self.calls.lock() else {
            return false;
        };
        if step.point == Point::BeforeStarted {
            calls.push(Call {
                kind: step.kind.to_owned(),
                key: step.key.to_owned(),
                fingerprint: hex::encode(step.fingerprint)
                    .chars()
                    .take(FINGERPRINT_HEX)
                    .collect(),
                outcome: String::new(),
            });
        }
        let stop = self
            .cut
            .is_some_and(|c| c.effect == calls.len() && c.point == step.point);
        if stop {
            if let Some(call) = calls.last_mut() {
                call.outcome = if call.outcome.is_empty() {
                    format!("cut {}", step.point.as_str())
                } else {
                    format!("{}, cut {}", call.outcome, step.point.as_str())
                };
            }
            self.stopped.notify_one();
        }
        stop
    }

    fn outcome(&self, kind: &str, key: &str, outcome: &str) {
        if let Ok(mut calls) = self.calls.lock()
            && let Some(call) = calls
                .iter_mut()
                .rev()
                .find(|c| c.kind == kind && c.key == key)
        {
            call.outcome = outcome.to_owned();
        }
    }
}

/// What every run shares.
struct Bench {
    host: Host,
    plugin: Plugin,
    scope: Arc<Scope>,
    limits: Limits,
    payload: String,
    enqueued_at: Millis,
    root: tempfile::TempDir,
    ledgers: u32,
}

/// One throwaway ledger with the job enqueued, and its outside world.
struct Ledger {
    number: u32,
    store: Arc<dyn Store>,
    world: Arc<World>,
}

impl Bench {
    async fn ledger(&mut self) -> Result<Ledger, VerifyError> {
        self.ledgers += 1;
        let dir = self.root.path().join(format!("ledger-{}", self.ledgers));
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir)?);
        let job = NewJob {
            queue: self.scope.queue.clone(),
            id: Some(JOB_ID.to_owned()),
            payload: self.payload.clone(),
            priority: 0,
            run_at: self.enqueued_at,
            max_attempts: MAX_ATTEMPTS,
            dedup_key: None,
            dedup_for: None,
        };
        store.enqueue(vec![job], self.enqueued_at).await?;
        Ok(Ledger {
            number: self.ledgers,
            store,
            world: Arc::default(),
        })
    }

    /// Leases the job on `ledger` and runs one attempt, stopped at `cut` if
    /// given; a run that ends is finished in the ledger as the daemon would.
    async fn attempt(
        &self,
        name: &'static str,
        ledger: &Ledger,
        cut: Option<Cut>,
    ) -> Result<Run, VerifyError> {
        let lease = ledger
            .store
            .lease(
                &LeaseAsk {
                    queue: &self.scope.queue,
                    max: 1,
                    plugin_version: &self.plugin.version,
                    limits: LeaseLimits::default(),
                },
                self.scope.clock.now(),
            )
            .await?
            .leases
            .pop()
            .ok_or_else(|| VerifyError::Failed("the job could not be leased".into()))?;
        let recorder = Arc::new(AttemptRecorder {
            world: Arc::clone(&ledger.world),
            attempt: lease.attempt,
            cut,
            calls: Mutex::default(),
            stopped: Notify::new(),
        });
        let scope = Scope {
            mailer: Ok(Arc::clone(&recorder) as Arc<dyn MailTransport>),
            providers: Arc::clone(&recorder) as Arc<dyn HttpTransport>,
            ..Scope::clone(&self.scope)
        };
        let effects = Effects::new(Arc::clone(&ledger.store), Arc::new(scope), lease.fence())
            .watched(Arc::clone(&recorder) as Arc<dyn Watch>);
        let input = JobInput {
            id: lease.job_id.clone(),
            queue: lease.queue.clone(),
            payload: lease.payload.clone(),
            attempt: lease.attempt,
            max_attempts: lease.max_attempts,
            enqueued_at: lease.enqueued_at,
        };
        let ran = tokio::select! {
            out = self.host.run(&self.plugin, input, effects, &self.limits) => Some(out),
            () = recorder.stopped.notified() => None,
        };
        let outcome = match ran {
            None => Outcome::Cut,
            Some(out) => {
                let outcome = match out {
                    RunOutcome::Ok(result) => Outcome::Completed {
                        result: serde_json::from_str(&result).unwrap_or(Value::String(result)),
                    },
                    RunOutcome::Retry(error) => Outcome::Retry { error },
                    RunOutcome::Fail(error) => Outcome::Failed { error },
                    RunOutcome::Trap(error) => Outcome::Trapped { error },
                    RunOutcome::Timeout(error) => Outcome::TimedOut { error },
                };
                // Only the completion matters to later runs (none follow on
                // this ledger otherwise): any other end puts the job back.
                let finish = match &outcome {
                    Outcome::Completed { result } => Finish::Completed {
                        result: result.to_string(),
                    },
                    other => Finish::Interrupted {
                        error: other.describe(),
                    },
                };
                ledger
                    .store
                    .finish(&lease.fence(), finish, self.scope.clock.now())
                    .await?;
                outcome
            }
        };
        let effects = recorder.calls.lock().map(|c| c.clone()).unwrap_or_default();
        Ok(Run {
            name,
            ledger: ledger.number,
            attempt: lease.attempt,
            cut,
            effects,
            outcome,
        })
    }
}

/// Loads the plugin and the grants, then runs and compares every run.
async fn run(options: &Options) -> Result<Report, VerifyError> {
    let path = &options.plugin;
    let bytes = std::fs::read(path)
        .map_err(|e| VerifyError::Input(format!("cannot read plugin {}: {e}", path.display())))?;
    let name = path
        .file_stem()
        .map_or_else(|| "plugin".to_owned(), |s| s.to_string_lossy().into_owned());
    let (queue, limits, on_uncertain, email_from, described) = match &options.queue {
        Some(queue) => {
            let config =
                Config::load(&options.config).map_err(|e| VerifyError::Input(e.to_string()))?;
            let q = config.queues.get(queue).ok_or_else(|| {
                let known: Vec<&str> = config.queues.keys().map(String::as_str).collect();
                VerifyError::Input(format!(
                    "--queue: there is no queue {queue:?} in {} (its queues: {})",
                    options.config.display(),
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ))
            })?;
            let limits = Limits {
                timeout: q.timeout,
                memory: q.memory,
                max_result: q.max_result,
                log_bytes: LOG_BYTES,
                log_lines: LOG_LINES,
            };
            let described = format!("queue {queue:?} of {}", options.config.display());
            (
                q.clone(),
                limits,
                q.on_uncertain,
                config.email.from.clone(),
                described,
            )
        }
        None => {
            let limits = Limits {
                timeout: DEFAULT_TIMEOUT,
                memory: DEFAULT_MEMORY,
                max_result: DEFAULT_MAX_RESULT,
                log_bytes: LOG_BYTES,
                log_lines: LOG_LINES,
            };
            let queue = crate::config::Queue {
                name: "verify".into(),
                plugin: name.clone(),
                namespace: "verify".into(),
                grants: Grants::all(),
                concurrency: 1,
                timeout: limits.timeout,
                max_attempts: MAX_ATTEMPTS,
                backoff: crate::config::Backoff::default(),
                memory: limits.memory,
                on_uncertain: OnUncertain::Skip,
                rate_limit: None,
                max_payload: DEFAULT_MAX_RESULT,
                max_result: limits.max_result,
            };
            (
                queue,
                limits,
                OnUncertain::Skip,
                DEFAULT_FROM.to_owned(),
                "everything the plugin imports".to_owned(),
            )
        }
    };
    let pool = PoolSize {
        instances: 2,
        max_memory: limits.memory,
    };
    let host = Host::new(&pool, options.code_cache.as_deref())
        .map_err(|e| VerifyError::Failed(format!("{e:#}")))?;
    let plugin = host
        .load(&name, &bytes)
        .map_err(|e| VerifyError::Input(format!("{}: {e}", path.display())))?;
    crate::plugins::check_grants(&queue, &plugin).map_err(VerifyError::Input)?;
    // Each attempt's scope replaces both transports with its recorder.
    let scope = Arc::new(Scope {
        queue: queue.name.clone(),
        namespace: queue.namespace.clone(),
        grants: queue.grants.clone(),
        on_uncertain,
        mailer: Err("khata verify records email instead of sending it".into()),
        providers: Arc::new(crate::effects::http::Providers::default()),
        email_from,
        clock: Arc::new(SystemClock),
    });
    let root = tempfile::Builder::new()
        .prefix("khata-verify-")
        .tempdir()
        .map_err(|e| VerifyError::Failed(format!("cannot create a temporary directory: {e}")))?;
    let mut bench = Bench {
        host,
        plugin,
        scope,
        limits,
        payload: options.payload.to_string(),
        enqueued_at: SystemClock.now(),
        root,
        ledgers: 0,
    };

    let mut runs = Vec::new();
    let ledger = bench.ledger().await?;
    let clean = bench.attempt("clean", &ledger, None).await?;
    drop(ledger);
    let mut sequences = Vec::new();
    for (i, call) in clean.effects.iter().enumerate() {
        if !matches!(
            call.outcome.as_str(),
            "performed" | "applied" | "replayed" | "reconciled:done"
        ) {
            continue;
        }
        let points: &[Point] = if is_external(&call.kind) {
            &[Point::BeforeStarted, Point::Started, Point::Done]
        } else {
            &[Point::BeforeStarted, Point::Done]
        };
        for &point in points {
            let cut = Cut {
                effect: i + 1,
                point,
            };
            let ledger = bench.ledger().await?;
            let first = bench.attempt("cut", &ledger, Some(cut)).await?;
            let second = if first.outcome == Outcome::Cut {
                ledger.store.recover(bench.scope.clock.now()).await?;
                Some(bench.attempt("redelivery", &ledger, None).await?)
            } else {
                None
            };
            let deliveries = ledger
                .world
                .deliveries
                .lock()
                .map(|d| d.clone())
                .unwrap_or_default();
            sequences.push(Sequence {
                cut,
                first,
                second,
                deliveries,
            });
        }
    }
    let ledger = bench.ledger().await?;
    let fresh = bench.attempt("fresh", &ledger, None).await?;
    drop(ledger);

    let findings = findings(&clean, &fresh, &sequences);
    runs.push(clean);
    for s in sequences {
        runs.push(s.first);
        runs.extend(s.second);
    }
    runs.push(fresh);
    Ok(Report {
        plugin: path.display().to_string(),
        version: bench.plugin.version.clone(),
        code: bench.plugin.code.as_str(),
        payload: options.payload.clone(),
        grants: described,
        runs,
        findings,
    })
}

fn is_external(kind: &str) -> bool {
    kind == "email" || kind == "http"
}

/// A cut run, its redelivery, and what the outside world received from both.
struct Sequence {
    cut: Cut,
    first: Run,
    second: Option<Run>,
    deliveries: Vec<(String, String, u32)>,
}

/// Compares the runs; each finding once.
fn findings(clean: &Run, fresh: &Run, sequences: &[Sequence]) -> Vec<Finding> {
    let mut out = Vec::new();
    key_stability(clean, fresh, &mut out);
    key_reuse(clean, fresh, sequences, &mut out);
    performed_twice(clean, sequences, &mut out);
    if clean.outcome != fresh.outcome {
        out.push(Finding {
            kind: "result-unstable",
            effect: None,
            keys: Vec::new(),
            message: format!(
                "two runs of the same payload on fresh ledgers ended differently: {} then {}",
                clean.outcome.describe(),
                fresh.outcome.describe()
            ),
            fix: "compute the result from the payload and the effects' responses only, \
                  not from the clock, randomness or the attempt number"
                .into(),
        });
    }
    let mut differing: Vec<String> = Vec::new();
    let mut example = None;
    for s in sequences {
        if let Some(second) = &s.second
            && second.outcome.status() != clean.outcome.status()
        {
            differing.push(s.cut.describe(&clean.effects));
            example.get_or_insert_with(|| second.outcome.describe());
        }
    }
    if let Some(example) = example {
        out.push(Finding {
            kind: "redelivery-differs",
            effect: None,
            keys: Vec::new(),
            message: format!(
                "the clean run {}, but the redelivery after a crash at {} ended {}",
                clean.outcome.status(),
                differing.join("; "),
                example
            ),
            fix: "a redelivery must reach the same end as the first delivery: \
                  treat `replayed` answers as success and make every step safe to repeat"
                .into(),
        });
    }
    out
}

fn key_stability(clean: &Run, fresh: &Run, out: &mut Vec<Finding>) {
    let (a, c) = (&clean.effects, &fresh.effects);
    let same_shape = a.len() == c.len() && a.iter().zip(c).all(|(x, y)| x.kind == y.kind);
    if !same_shape {
        let list = |calls: &[Call]| {
            calls
                .iter()
                .map(|c| c.kind.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push(Finding {
            kind: "effects-unstable",
            effect: None,
            keys: Vec::new(),
            message: format!(
                "two runs of the same payload made different effects: [{}] then [{}]",
                list(a),
                list(c)
            ),
            fix: "decide which effects to make from the payload and earlier effects' \
                  results only"
                .into(),
        });
    }
    for (i, (x, y)) in a.iter().zip(c).enumerate() {
        if x.kind == y.kind && x.key != y.key {
            out.push(Finding {
                kind: "key-unstable",
                effect: Some(x.kind.clone()),
                keys: vec![x.key.clone(), y.key.clone()],
                message: format!(
                    "effect #{} ({}) used key {:?} in one run and {:?} in another run of the \
                     same payload: the key is built from something that changes between runs \
                     (the clock, randomness, the attempt), so the ledger cannot recognise a \
                     repeat",
                    i + 1,
                    x.kind,
                    x.key,
                    y.key
                ),
                fix: "build the key from what identifies the effect: a business key from the \
                      payload (such as order-charge-<order_id>) or the job (job.key(\"name\")); \
                      see docs/keys.md"
                    .into(),
            });
        }
    }
}

fn key_reuse(clean: &Run, fresh: &Run, sequences: &[Sequence], out: &mut Vec<Finding>) {
    let mut seen = BTreeSet::new();
    let mut push = |kind: &str, key: &str, how: String, out: &mut Vec<Finding>| {
        if seen.insert((kind.to_owned(), key.to_owned())) {
            out.push(Finding {
                kind: "key-reused",
                effect: Some(kind.to_owned()),
                keys: vec![key.to_owned()],
                message: format!(
                    "the {kind} request under key {key:?} changes between runs ({how}): \
                     a redelivery is refused with key-reused instead of replaying the effect"
                ),
                fix: "build the request only from the payload and earlier effects' results \
                      (no timestamps, random ids or attempt numbers in it), or, if it really \
                      is another effect, give it a key of its own"
                    .into(),
            });
        }
    };
    for (x, y) in clean.effects.iter().zip(&fresh.effects) {
        if is_external(&x.kind)
            && x.kind == y.kind
            && x.key == y.key
            && x.fingerprint != y.fingerprint
        {
            let how = format!("fingerprint {} then {}", x.fingerprint, y.fingerprint);
            push(&x.kind, &x.key, how, out);
        }
    }
    for s in sequences {
        for call in s.second.iter().flat_map(|r| &r.effects) {
            if call.outcome == "refused:key-reused" {
                let how = format!(
                    "refused after a crash at {}",
                    s.cut.describe(&clean.effects)
                );
                push(&call.kind, &call.key, how, out);
            }
        }
    }
}

fn performed_twice(clean: &Run, sequences: &[Sequence], out: &mut Vec<Finding>) {
    let expected: BTreeSet<(&str, &str)> = clean
        .effects
        .iter()
        .filter(|c| is_external(&c.kind) && c.outcome == "performed")
        .map(|c| (c.kind.as_str(), c.key.as_str()))
        .collect();
    // Per effect kind: the crash points after which it happened twice, and
    // the first example's keys.
    let mut twice: BTreeMap<String, (Vec<String>, Vec<String>)> = BTreeMap::new();
    for s in sequences {
        let delivered: BTreeSet<(&str, &str)> = s
            .deliveries
            .iter()
            .map(|(k, key, _)| (k.as_str(), key.as_str()))
            .collect();
        if delivered.len() <= expected.len() {
            continue;
        }
        let before: Vec<&(String, String, u32)> = s
            .deliveries
            .iter()
            .filter(|d| d.2 == s.first.attempt)
            .collect();
        for (kind, key, attempt) in &s.deliveries {
            if *attempt == s.first.attempt || before.iter().any(|d| d.0 == *kind && d.1 == *key) {
                continue;
            }
            let Some(earlier) = before.iter().find(|d| d.0 == *kind) else {
                continue;
            };
            let entry = twice.entry(kind.clone()).or_default();
            let at = s.cut.describe(&clean.effects);
            if !entry.0.contains(&at) {
                entry.0.push(at);
            }
            if entry.1.is_empty() {
                entry.1 = vec![earlier.1.clone(), key.clone()];
            }
        }
    }
    for (kind, (points, keys)) in twice {
        out.push(Finding {
            kind: "performed-twice",
            effect: Some(kind.clone()),
            message: format!(
                "the {kind} effect was performed twice after a crash at {}: first under key \
                 {:?}, then by the redelivery under key {:?}",
                points.join("; "),
                keys[0],
                keys[1]
            ),
            keys,
            fix: "the key must not depend on anything the first attempt changed or on the \
                  attempt itself (kv or index values it wrote, the attempt number, the clock): \
                  derive it from the payload or the job, so that the redelivery replays the \
                  recorded effect"
                .into(),
        });
    }
}

impl Report {
    /// The report for people: short when clean, every run and finding otherwise.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let clean = self.runs.first();
        let _ = writeln!(
            s,
            "plugin {} (version {}, code {}), payload {}, grants: {}",
            self.plugin,
            crate::host::short_version(&self.version),
            self.code,
            self.payload,
            self.grants
        );
        let cuts = self.runs.iter().filter(|r| r.name == "cut").count();
        let _ = writeln!(
            s,
            "{} runs: clean, {cuts} cut at every crash point of every effect (each followed by a redelivery), fresh",
            self.runs.len()
        );
        let show = |s: &mut String, run: &Run| {
            let cut = run
                .cut
                .map(|c| format!(" at effect #{} {}", c.effect, c.point.as_str()))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "  {} (ledger {}, attempt {}){cut}: {}",
                run.name,
                run.ledger,
                run.attempt,
                run.outcome.describe()
            );
            for c in &run.effects {
                let outcome = if c.outcome.is_empty() {
                    "-"
                } else {
                    &c.outcome
                };
                let _ = writeln!(
                    s,
                    "    {:<5} {:?} fingerprint {} {outcome}",
                    c.kind, c.key, c.fingerprint
                );
            }
        };
        if self.findings.is_empty() {
            if let Some(clean) = clean {
                show(&mut s, clean);
            }
            let _ = writeln!(
                s,
                "clean: every run used the same keys and requests, no effect was performed twice, the result is stable"
            );
            return s;
        }
        for run in &self.runs {
            show(&mut s, run);
        }
        let _ = writeln!(s, "{} finding(s):", self.findings.len());
        for f in &self.findings {
            let _ = writeln!(s, "- {}: {}", f.kind, f.message);
            let _ = writeln!(s, "  fix: {}", f.fix);
        }
        s
    }
}
