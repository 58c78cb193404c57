//! The dispatcher: one loop per queue that leases jobs in batches, runs each
//! attempt under the queue's concurrency, and records how it ended.
//!
//! Invariants:
//!
//! - At most `concurrency` attempts of a queue run their handler at once. A
//!   finished attempt gives its slot to the next job before its completion is
//!   committed, so commits of many attempts share one fsync.
//! - An attempt ends exactly one way in the store: `finish` with the
//!   handler's outcome, or with `Interrupted` when a shutdown stops it. An
//!   attempt whose job was cancelled meanwhile is fenced and changes nothing.
//! - A queue whose plugin is missing or refused leases nothing: its jobs wait.
//! - Time comes from a [`Clock`], so that delays and backoff follow an
//!   injected clock where one is given.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config;
use crate::effects::email::Mailer;
use crate::effects::http::Providers;
use crate::effects::{Effects, Scope};
use crate::host::{Host, JobInput, Limits, Plugin, RunOutcome};
use crate::job::{AttemptOutcome, Finish, Lease, Millis};
use crate::store::{Store, StoreError};

/// Most jobs leased in one store step.
const LEASE_BATCH: u32 = 64;
/// Longest idle wait before a queue looks for due jobs again.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// Log bytes kept per attempt.
const LOG_BUDGET: usize = 64 * 1024;

/// The source of time for the queue.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Millis;

    /// Moves the clock forward; false for a clock that cannot be moved.
    fn advance(&self, by: Duration) -> bool {
        let _ = by;
        false
    }
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        Millis::from(SystemTime::now())
    }
}

/// The wall clock plus an offset that only moves forward: the daemon's clock
/// in builds with the `failpoints` feature, so that tests can let a backoff
/// or a delay elapse without waiting for it.
#[derive(Debug, Default)]
pub struct MovableClock {
    offset_ms: AtomicU64,
}

impl Clock for MovableClock {
    fn now(&self) -> Millis {
        SystemClock.now().plus(Duration::from_millis(
            self.offset_ms.load(Ordering::Relaxed),
        ))
    }

    fn advance(&self, by: Duration) -> bool {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.offset_ms.fetch_add(ms, Ordering::Relaxed);
        true
    }
}

/// The plugin a queue runs, or why it has none.
#[derive(Clone, Debug, Default)]
pub struct PluginSlot {
    pub plugin: Option<Arc<Plugin>>,
    pub error: Option<String>,
}

/// One configured queue at run time.
pub struct QueueRuntime {
    pub config: Arc<config::Queue>,
    scope: Arc<Scope>,
    plugin: RwLock<PluginSlot>,
    wake: Notify,
    /// Cancel tokens of the attempts running now, by job id.
    running: Mutex<HashMap<String, CancellationToken>>,
}

impl std::fmt::Debug for QueueRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueRuntime")
            .field("name", &self.config.name)
            .finish_non_exhaustive()
    }
}

impl QueueRuntime {
    pub fn plugin(&self) -> PluginSlot {
        self.plugin.read().map(|p| p.clone()).unwrap_or_default()
    }

    /// Installs a new plugin version (or a load error, keeping the running
    /// version) and wakes the queue.
    pub fn set_plugin(&self, result: Result<Arc<Plugin>, String>) {
        if let Ok(mut slot) = self.plugin.write() {
            match result {
                Ok(p) => {
                    slot.plugin = Some(p);
                    slot.error = None;
                }
                Err(e) => slot.error = Some(e),
            }
        }
        self.wake.notify_one();
    }
}

/// A queue's `rate_limit`, as BullMQ's limiter: at most `max` attempts start
/// in any window of `per`.
struct Limiter {
    max: usize,
    per: Duration,
    /// When the attempts of the current window started, oldest first; never
    /// more than `max`.
    starts: std::collections::VecDeque<tokio::time::Instant>,
}

impl Limiter {
    fn new(limit: &config::RateLimit) -> Limiter {
        Limiter {
            max: usize::try_from(limit.max.max(1)).unwrap_or(usize::MAX),
            per: limit.per,
            starts: std::collections::VecDeque::new(),
        }
    }

    /// How many attempts may start now, or how long until one may.
    fn room(&mut self, now: tokio::time::Instant) -> Result<u32, Duration> {
        while let Some(&oldest) = self.starts.front() {
            if now.duration_since(oldest) < self.per {
                break;
            }
            self.starts.pop_front();
        }
        match self.starts.front() {
            Some(&oldest) if self.starts.len() >= self.max => {
                Err(self.per.saturating_sub(now.duration_since(oldest)))
            }
            _ => Ok(u32::try_from(self.max - self.starts.len()).unwrap_or(u32::MAX)),
        }
    }

    fn started(&mut self, n: usize, now: tokio::time::Instant) {
        self.starts.extend(std::iter::repeat_n(now, n));
    }
}

/// The providers every queue's effects reach, built once from jobs.toml.
#[derive(Debug, Clone)]
pub struct Outside {
    /// The email transport, or why it could not be set up.
    pub mailer: Result<Arc<Mailer>, String>,
    pub providers: Arc<Providers>,
    /// The From address of messages that name none.
    pub email_from: String,
}

/// Every queue of the daemon, and what their attempts share.
pub struct Queues {
    store: Arc<dyn Store>,
    host: Arc<Host>,
    clock: Arc<dyn Clock>,
    queues: HashMap<String, Arc<QueueRuntime>>,
    /// Completed attempts since start, for the progress line.
    completed: AtomicU64,
}

impl std::fmt::Debug for Queues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queues")
            .field("queues", &self.queues.keys())
            .finish_non_exhaustive()
    }
}

/// Tokens that stop the dispatcher: `drain` stops leasing, `interrupt`
/// stops the attempts still running.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    pub drain: CancellationToken,
    pub interrupt: CancellationToken,
}

impl Queues {
    pub fn new(
        store: Arc<dyn Store>,
        host: Arc<Host>,
        clock: Arc<dyn Clock>,
        configs: impl IntoIterator<Item = config::Queue>,
        outside: &Outside,
    ) -> Queues {
        let queues = configs
            .into_iter()
            .map(|q| {
                let rt = QueueRuntime {
                    scope: Arc::new(Scope {
                        queue: q.name.clone(),
                        namespace: q.namespace.clone(),
                        grants: q.grants.clone(),
                        on_uncertain: q.on_uncertain,
                        mailer: outside.mailer.clone(),
                        providers: Arc::clone(&outside.providers),
                        email_from: outside.email_from.clone(),
                    }),
                    config: Arc::new(q),
                    plugin: RwLock::new(PluginSlot::default()),
                    wake: Notify::new(),
                    running: Mutex::new(HashMap::new()),
                };
                (rt.config.name.clone(), Arc::new(rt))
            })
            .collect();
        Queues {
            store,
            host,
            clock,
            queues,
            completed: AtomicU64::new(0),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<QueueRuntime>> {
        self.queues.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<QueueRuntime>> {
        self.queues.values()
    }

    pub fn now(&self) -> Millis {
        self.clock.now()
    }

    /// Moves the queues' clock forward and wakes every dispatcher; false
    /// when the clock is the system's.
    pub fn advance_clock(&self, by: Duration) -> bool {
        if !self.clock.advance(by) {
            return false;
        }
        for q in self.queues.values() {
            q.wake.notify_one();
        }
        true
    }

    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Tells a queue that a job may be ready.
    pub fn wake(&self, queue: &str) {
        if let Some(q) = self.queues.get(queue) {
            q.wake.notify_one();
        }
    }

    /// Stops the running attempt of a job that was just cancelled.
    ///
    /// The cancel is committed before this is called, so from then on every
    /// effect of that attempt is refused as `fenced`; the failpoint
    /// `queue::before_interrupt` (tests only) holds the attempt running in
    /// that window, so that a test can watch its effects being refused.
    pub async fn interrupt(&self, queue: &str, job_id: &str) {
        crate::effects::fenced::failpoint("queue::before_interrupt").await;
        if let Some(q) = self.queues.get(queue)
            && let Ok(running) = q.running.lock()
            && let Some(token) = running.get(job_id)
        {
            token.cancel();
        }
    }

    /// Runs every queue's dispatcher until `stop.drain`, then waits for the
    /// attempts in flight; `stop.interrupt` stops those still running.
    pub async fn run(self: Arc<Self>, stop: Stop) {
        let mut loops = JoinSet::new();
        for q in self.queues.values() {
            loops.spawn(Arc::clone(&self).dispatch(Arc::clone(q), stop.clone()));
        }
        while loops.join_next().await.is_some() {}
    }

    async fn dispatch(self: Arc<Self>, q: Arc<QueueRuntime>, stop: Stop) {
        let name = q.config.name.clone();
        let slots = Arc::new(Semaphore::new(q.config.concurrency as usize));
        let mut limiter = q.config.rate_limit.as_ref().map(Limiter::new);
        let mut attempts = JoinSet::new();
        loop {
            while attempts.try_join_next().is_some() {}
            let Some(plugin) = q.plugin().plugin else {
                tokio::select! {
                    () = q.wake.notified() => {}
                    () = stop.drain.cancelled() => break,
                }
                continue;
            };
            let first = tokio::select! {
                p = Arc::clone(&slots).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                () = stop.drain.cancelled() => break,
            };
            let mut want = u32::try_from(slots.available_permits() + 1)
                .unwrap_or(LEASE_BATCH)
                .min(LEASE_BATCH);
            if let Some(limiter) = &mut limiter {
                match limiter.room(tokio::time::Instant::now()) {
                    Ok(room) => want = want.min(room),
                    Err(wait) => {
                        drop(first);
                        tokio::select! {
                            () = tokio::time::sleep(wait) => {}
                            () = stop.drain.cancelled() => break,
                        }
                        continue;
                    }
                }
            }
            let now = self.clock.now();
            let leases = match self.store.lease(&name, want, now).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(queue = %name, error = %e, "lease failed; retrying");
                    drop(first);
                    tokio::select! {
                        () = tokio::time::sleep(IDLE_POLL) => {}
                        () = stop.drain.cancelled() => break,
                    }
                    continue;
                }
            };
            if leases.is_empty() {
                drop(first);
                let wait = match self.store.next_run_at(&name).await {
                    Ok(Some(at)) => Duration::from_millis(u64::try_from(at.0 - now.0).unwrap_or(0))
                        .min(IDLE_POLL),
                    _ => IDLE_POLL,
                };
                tokio::select! {
                    () = q.wake.notified() => {}
                    () = tokio::time::sleep(wait) => {}
                    () = stop.drain.cancelled() => break,
                }
                continue;
            }
            if let Some(limiter) = &mut limiter {
                limiter.started(leases.len(), tokio::time::Instant::now());
            }
            let mut first = Some(first);
            for lease in leases {
                let permit = match first.take() {
                    Some(p) => p,
                    None => match Arc::clone(&slots).try_acquire_owned() {
                        Ok(p) => p,
                        // Cannot happen: we leased no more than the free slots.
                        Err(_) => match Arc::clone(&slots).acquire_owned().await {
                            Ok(p) => p,
                            Err(_) => break,
                        },
                    },
                };
                let this = Arc::clone(&self);
                let (q, plugin, interrupt) =
                    (Arc::clone(&q), Arc::clone(&plugin), stop.interrupt.clone());
                attempts.spawn(async move {
                    this.attempt(&q, &plugin, lease, permit, interrupt).await;
                });
            }
        }
        // Drain: no new leases; the attempts in flight finish or are interrupted.
        while attempts.join_next().await.is_some() {}
        tracing::debug!(queue = %name, "dispatcher stopped");
    }

    async fn attempt(
        &self,
        q: &QueueRuntime,
        plugin: &Plugin,
        lease: Lease,
        permit: tokio::sync::OwnedSemaphorePermit,
        interrupt: CancellationToken,
    ) {
        let cfg = &q.config;
        let cancel = CancellationToken::new();
        if let Ok(mut running) = q.running.lock() {
            running.insert(lease.job_id.clone(), cancel.clone());
        }
        let effects = Effects::new(
            Arc::clone(&self.store),
            Arc::clone(&q.scope),
            lease.fence(),
            lease.attempt,
        );
        let dead_letter = effects.dead_letter_flag();
        let input = JobInput {
            id: lease.job_id.clone(),
            queue: lease.queue.clone(),
            payload: lease.payload.clone(),
            attempt: lease.attempt,
            max_attempts: lease.max_attempts,
            enqueued_at: lease.enqueued_at,
        };
        let limits = Limits {
            timeout: cfg.timeout,
            memory: cfg.memory,
            max_result: cfg.max_result,
            log_bytes: LOG_BUDGET,
        };
        let started = std::time::Instant::now();
        let run = self.host.run(plugin, input, effects, &limits);
        let ended = tokio::select! {
            out = run => Ended::Ran(out),
            () = cancel.cancelled() => Ended::Cancelled,
            () = interrupt.cancelled() => Ended::Interrupted,
        };
        drop(permit);
        if let Ok(mut running) = q.running.lock() {
            running.remove(&lease.job_id);
        }
        let now = self.clock.now();
        let dead_letter = dead_letter.lock().ok().and_then(|mut d| d.take());
        let finish = match ended {
            // An effect's unknown outcome under `on_uncertain = "dead"` ends
            // the job for a person to look at, whatever the handler did next.
            Ended::Ran(_) if dead_letter.is_some() => Finish::Fail {
                outcome: AttemptOutcome::Failed,
                error: dead_letter.unwrap_or_default(),
            },
            Ended::Ran(RunOutcome::Ok(result)) => Finish::Completed { result },
            Ended::Ran(RunOutcome::Retry(error)) => {
                self.retry(cfg, &lease, AttemptOutcome::Retry, error, now)
            }
            Ended::Ran(RunOutcome::Trap(error)) => {
                self.retry(cfg, &lease, AttemptOutcome::Trapped, error, now)
            }
            Ended::Ran(RunOutcome::Timeout(error)) => {
                self.retry(cfg, &lease, AttemptOutcome::Timeout, error, now)
            }
            Ended::Ran(RunOutcome::Fail(error)) => Finish::Fail {
                outcome: AttemptOutcome::Failed,
                error,
            },
            Ended::Cancelled => Finish::Fail {
                outcome: AttemptOutcome::Cancelled,
                error: "cancelled by an operator".into(),
            },
            Ended::Interrupted => Finish::Interrupted {
                error: "interrupted: the daemon shut down during this attempt".into(),
            },
        };
        crate::effects::fenced::failpoint("queue::before_finish").await;
        let outcome = outcome_label(&finish);
        metrics::counter!("khata_attempts_total", "queue" => cfg.name.clone(), "outcome" => outcome).increment(1);
        metrics::histogram!("khata_attempt_duration_seconds", "queue" => cfg.name.clone())
            .record(started.elapsed().as_secs_f64());
        match self.store.finish(&lease.fence(), finish, now).await {
            Ok(state) => {
                if outcome == "completed" {
                    self.completed.fetch_add(1, Ordering::Relaxed);
                }
                metrics::counter!("khata_jobs_finished_total", "queue" => cfg.name.clone(), "state" => state.as_str())
                    .increment(1);
                tracing::debug!(job = %lease.job_id, queue = %cfg.name, attempt = lease.attempt, outcome, next = %state, "attempt ended");
            }
            Err(StoreError::Fenced { .. }) => {
                tracing::info!(job = %lease.job_id, queue = %cfg.name, attempt = lease.attempt, "attempt ended after its job was cancelled");
            }
            Err(e) => {
                // The job stays active in the ledger; the next start redelivers it.
                tracing::error!(job = %lease.job_id, queue = %cfg.name, error = %e, "could not record the end of an attempt");
            }
        }
    }

    fn retry(
        &self,
        cfg: &config::Queue,
        lease: &Lease,
        outcome: AttemptOutcome,
        error: String,
        now: Millis,
    ) -> Finish {
        let delay = cfg.backoff.delay(lease.attempt, rand::random::<f64>());
        Finish::Retry {
            outcome,
            error,
            run_at: now.plus(delay),
        }
    }
}

enum Ended {
    Ran(RunOutcome),
    Cancelled,
    Interrupted,
}

fn outcome_label(f: &Finish) -> &'static str {
    match f {
        Finish::Completed { .. } => "completed",
        Finish::Retry { outcome, .. } | Finish::Fail { outcome, .. } => outcome.as_str(),
        Finish::Interrupted { .. } => "interrupted",
    }
}
