//! The dispatcher: one loop per queue that leases jobs in batches, runs each
//! attempt under the queue's concurrency, and records how it ended.
//!
//! Invariants:
//!
//! - At most `concurrency` attempts of a queue run their handler at once. A
//!   finished attempt gives its slot to the next job before its completion is
//!   committed, so commits of many attempts share one fsync.
//! - On a store that several daemons share, the queue's `concurrency` and
//!   `rate_limit` also hold across all of them: every lease goes through
//!   [`Store::lease`] with the queue's limits as configured now. A
//!   dispatcher held back by them waits for room (a wake-up, the window's
//!   end, or the slow poll), never asks again at once. This daemon's own
//!   slots and limiter stay: they bound what it runs by itself.
//! - An attempt ends exactly one way in the store: `finish` with the
//!   handler's outcome, or with `Interrupted` when a shutdown stops it. An
//!   attempt whose job was cancelled meanwhile is fenced and changes nothing.
//! - An attempt whose lease the store reports lost ([`Queues::lease_lost`],
//!   from a heartbeat) is stopped; the store refuses its effects and its
//!   finish already, so stopping it only saves the work.
//! - A queue whose plugin is missing or refused leases nothing: its jobs wait.
//! - A configuration reload ([`Queues::reconfigure`]) changes a queue in
//!   place: attempts in flight keep the settings, scope and plugin they
//!   started with; a lower `concurrency` takes effect as slots free up, so
//!   the limit holds across the change. A removed queue stops leasing and
//!   its attempts in flight finish; its jobs stay in the ledger.
//! - Time comes from a [`Clock`], so that delays and backoff follow an
//!   injected clock where one is given.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::clock::Clock;
use crate::config;
use crate::effects::email::Mailer;
use crate::effects::http::Providers;
use crate::effects::{Effects, Scope};
use crate::host::{Host, JobInput, Limits, Plugin, RunOutcome};
use crate::job::{AttemptOutcome, Enqueued, Finish, Lease, LeaseRef, Millis, NewJob};
use crate::store::{Held, LeaseAsk, LeaseLimits, RateWindow, Store, StoreError};

/// Most jobs leased in one store step.
const LEASE_BATCH: u32 = 64;
/// Longest idle wait before a queue looks for due jobs again.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// Shortest idle wait.
const MIN_WAIT: Duration = Duration::from_millis(20);
/// Log bytes and lines kept per attempt.
const LOG_BUDGET: usize = 64 * 1024;
const LOG_LINES: usize = 1024;

/// The plugin a queue runs, or why it has none.
#[derive(Clone, Debug, Default)]
pub struct PluginSlot {
    pub plugin: Option<Arc<Plugin>>,
    pub error: Option<String>,
}

/// A queue's configuration and the scope its effects run in; replaced as a
/// whole by a reload, read once per attempt.
#[derive(Clone, Debug)]
struct Settings {
    config: Arc<config::Queue>,
    scope: Arc<Scope>,
}

impl Settings {
    fn new(q: config::Queue, outside: &Outside) -> Settings {
        Settings {
            scope: Arc::new(Scope {
                queue: q.name.clone(),
                namespace: q.namespace.clone(),
                grants: q.grants.clone(),
                on_uncertain: q.on_uncertain,
                mailer: outside
                    .mailer
                    .clone()
                    .map(|m| m as Arc<dyn crate::effects::outside::MailTransport>),
                providers: outside.providers.clone(),
                email_from: outside.email_from.clone(),
                clock: Arc::clone(&outside.clock),
            }),
            config: Arc::new(q),
        }
    }
}

/// An attempt in flight, as the queue can stop it.
struct Running {
    /// Its lease's fencing token.
    token: u64,
    /// An operator cancelled the job.
    cancel: CancellationToken,
    /// The lease was lost (expired or reclaimed): every effect is refused.
    lost: CancellationToken,
}

/// One configured queue at run time.
pub struct QueueRuntime {
    name: String,
    settings: RwLock<Settings>,
    /// One permit per attempt that may run at once.
    slots: Arc<Semaphore>,
    /// The concurrency the slots were last set to.
    concurrency: Mutex<u32>,
    /// Slots still to take away after a lower concurrency: taken as the
    /// attempts holding them end.
    owed: Arc<AtomicUsize>,
    plugin: RwLock<PluginSlot>,
    wake: Notify,
    /// Cancelled when a reload removes the queue: it stops leasing.
    retired: CancellationToken,
    /// The attempts running now, by job id.
    running: Mutex<HashMap<String, Running>>,
}

impl std::fmt::Debug for QueueRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueRuntime")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl QueueRuntime {
    fn new(q: config::Queue, outside: &Outside) -> QueueRuntime {
        let concurrency = q.concurrency;
        QueueRuntime {
            name: q.name.clone(),
            settings: RwLock::new(Settings::new(q, outside)),
            slots: Arc::new(Semaphore::new(concurrency as usize)),
            concurrency: Mutex::new(concurrency),
            owed: Arc::new(AtomicUsize::new(0)),
            plugin: RwLock::new(PluginSlot::default()),
            wake: Notify::new(),
            retired: CancellationToken::new(),
            running: Mutex::new(HashMap::new()),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The queue's configuration now (a reload may replace it).
    pub fn config(&self) -> Arc<config::Queue> {
        self.settings().config
    }

    fn settings(&self) -> Settings {
        match self.settings.read() {
            Ok(s) => s.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Applies a reloaded configuration. Attempts in flight keep theirs.
    fn reconfigure(&self, q: config::Queue, outside: &Outside) {
        self.set_concurrency(q.concurrency);
        let settings = Settings::new(q, outside);
        match self.settings.write() {
            Ok(mut s) => *s = settings,
            Err(poisoned) => *poisoned.into_inner() = settings,
        }
        self.wake.notify_one();
    }

    /// Grows the slots at once; shrinks them at once by the free slots and,
    /// for the rest, as attempts in flight end (a collector takes those
    /// permits, in turn with the dispatcher, and forgets them).
    fn set_concurrency(&self, target: u32) {
        let Ok(mut current) = self.concurrency.lock() else {
            return;
        };
        if target > *current {
            let more = (target - *current) as usize;
            // First cancel slots still owed from an earlier decrease.
            let owed = self.owed.load(Ordering::SeqCst);
            let repaid = more.min(owed);
            self.owed.fetch_sub(repaid, Ordering::SeqCst);
            self.slots.add_permits(more - repaid);
        } else if target < *current {
            let fewer = (*current - target) as usize;
            let rest = fewer - self.slots.forget_permits(fewer);
            if rest > 0 && self.owed.fetch_add(rest, Ordering::SeqCst) == 0 {
                let (slots, owed) = (Arc::clone(&self.slots), Arc::clone(&self.owed));
                tokio::spawn(async move {
                    while owed.load(Ordering::SeqCst) > 0 {
                        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
                            break;
                        };
                        if owed
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                            .is_ok()
                        {
                            permit.forget();
                        }
                    }
                });
            }
        }
        *current = target;
    }

    pub fn plugin(&self) -> PluginSlot {
        self.plugin.read().map(|p| p.clone()).unwrap_or_default()
    }

    /// Drops the running plugin (its attempts in flight keep it): the queue
    /// holds its jobs until the next version loads. For a reload that
    /// changed which plugin the queue runs or what it is granted.
    pub fn unload_plugin(&self, why: String) {
        if let Ok(mut slot) = self.plugin.write() {
            slot.plugin = None;
            slot.error = Some(why);
        }
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
    /// The daemon's time, for the queues and their effects alike.
    pub clock: Arc<dyn Clock>,
}

/// Every queue of the daemon, and what their attempts share.
pub struct Queues {
    store: Arc<dyn Store>,
    host: Arc<Host>,
    clock: Arc<dyn Clock>,
    queues: RwLock<HashMap<String, Arc<QueueRuntime>>>,
    /// Queues added by a reload, for `run` to start their dispatchers.
    added_tx: mpsc::UnboundedSender<Arc<QueueRuntime>>,
    added_rx: Mutex<Option<mpsc::UnboundedReceiver<Arc<QueueRuntime>>>>,
    /// Completed attempts since start, for the progress line.
    completed: AtomicU64,
    /// Longest idle wait before a queue looks for due jobs again.
    idle_poll: Duration,
}

impl std::fmt::Debug for Queues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queues")
            .field("queues", &self.list())
            .finish_non_exhaustive()
    }
}

/// What a configuration reload changed, by queue name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconfigured {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
    /// Changed queues whose plugin or grants changed: their plugin must be
    /// loaded (and checked) again.
    pub reload_plugin: Vec<String>,
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
        configs: impl IntoIterator<Item = config::Queue>,
        outside: &Outside,
    ) -> Queues {
        let queues = configs
            .into_iter()
            .map(|q| (q.name.clone(), Arc::new(QueueRuntime::new(q, outside))))
            .collect();
        let (added_tx, added_rx) = mpsc::unbounded_channel();
        Queues {
            store,
            host,
            clock: Arc::clone(&outside.clock),
            queues: RwLock::new(queues),
            added_tx,
            added_rx: Mutex::new(Some(added_rx)),
            completed: AtomicU64::new(0),
            idle_poll: IDLE_POLL,
        }
    }

    /// Sets the longest idle wait of every dispatcher: long where the store
    /// wakes the queues itself ([`Store::wakeups`]), so that the poll is only
    /// the fallback for a lost wake-up.
    pub fn with_idle_poll(mut self, idle_poll: Duration) -> Queues {
        self.idle_poll = idle_poll.max(Duration::from_millis(10));
        self
    }

    pub fn get(&self, name: &str) -> Option<Arc<QueueRuntime>> {
        self.queues.read().ok()?.get(name).cloned()
    }

    /// Every queue, by name.
    pub fn list(&self) -> Vec<Arc<QueueRuntime>> {
        let mut list: Vec<_> = self
            .queues
            .read()
            .map(|q| q.values().cloned().collect())
            .unwrap_or_default();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// Applies a reloaded set of queues: new ones start, changed ones change
    /// in place, removed ones stop leasing (their attempts in flight end as
    /// usual). `outside` is the providers the queues' effects reach now.
    pub fn reconfigure(
        &self,
        configs: impl IntoIterator<Item = config::Queue>,
        outside: &Outside,
    ) -> Reconfigured {
        let mut done = Reconfigured::default();
        let Ok(mut queues) = self.queues.write() else {
            return done;
        };
        let mut keep = std::collections::HashSet::new();
        for q in configs {
            keep.insert(q.name.clone());
            match queues.get(&q.name) {
                Some(rt) => {
                    let old = rt.config();
                    if old.plugin != q.plugin || old.grants != q.grants {
                        done.reload_plugin.push(q.name.clone());
                    }
                    if *old != q {
                        done.changed.push(q.name.clone());
                    }
                    // Always: the providers may have changed under it.
                    rt.reconfigure(q, outside);
                }
                None => {
                    let rt = Arc::new(QueueRuntime::new(q, outside));
                    done.added.push(rt.name.clone());
                    let _ = self.added_tx.send(Arc::clone(&rt));
                    queues.insert(rt.name.clone(), rt);
                }
            }
        }
        queues.retain(|name, rt| {
            let stays = keep.contains(name);
            if !stays {
                rt.retired.cancel();
                done.removed.push(name.clone());
            }
            stays
        });
        done.added.sort();
        done.changed.sort();
        done.removed.sort();
        done.reload_plugin.sort();
        done
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
        for q in self.list() {
            q.wake.notify_one();
        }
        true
    }

    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Enqueues `jobs` into `queue` (one store step, all or none), counts
    /// them in `khata_jobs_enqueued_total` and `khata_jobs_deduplicated_total`,
    /// and wakes the queue: what every producer (the API and schedules) does.
    /// **Durable** when it returns, as [`Store::enqueue`].
    pub async fn enqueue(
        &self,
        queue: &str,
        jobs: Vec<NewJob>,
        now: Millis,
    ) -> Result<Vec<Enqueued>, StoreError> {
        let results = self.store.enqueue(jobs, now).await?;
        let deduplicated = results.iter().filter(|r| r.deduplicated).count() as u64;
        let enqueued = results.len() as u64 - deduplicated;
        for (name, n) in [
            ("khata_jobs_enqueued_total", enqueued),
            ("khata_jobs_deduplicated_total", deduplicated),
        ] {
            if n > 0 {
                metrics::counter!(name, "queue" => queue.to_owned()).increment(n);
            }
        }
        self.wake(queue);
        Ok(results)
    }

    /// Tells a queue that a job may be ready; `*` tells every queue.
    pub fn wake(&self, queue: &str) {
        if queue == "*" {
            for q in self.list() {
                q.wake.notify_one();
            }
        } else if let Some(q) = self.get(queue) {
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
        crate::failpoints::pause("queue::before_interrupt").await;
        if let Some(q) = self.get(queue)
            && let Ok(running) = q.running.lock()
            && let Some(r) = running.get(job_id)
        {
            r.cancel.cancel();
        }
    }

    /// Stops the attempt holding `lease`, which the store reported lost (a
    /// heartbeat found it expired or taken over): its effects are refused
    /// already; this ends the handler. False when no such attempt runs here
    /// (it ended meanwhile).
    pub fn lease_lost(&self, lease: &LeaseRef) -> bool {
        for q in self.list() {
            if let Ok(running) = q.running.lock()
                && let Some(r) = running.get(&lease.job_id)
                && r.token == lease.token
            {
                r.lost.cancel();
                return true;
            }
        }
        false
    }

    /// Runs every queue's dispatcher (and those a reload adds) until
    /// `stop.drain`, then waits for the attempts in flight; `stop.interrupt`
    /// stops those still running.
    pub async fn run(self: Arc<Self>, stop: Stop) {
        let mut added = self.added_rx.lock().ok().and_then(|mut rx| rx.take());
        let mut loops = JoinSet::new();
        // A queue added before this point is both listed and announced: it
        // gets one dispatcher. (Kept, not just compared by address, so that
        // an address is never reused by another queue.)
        let mut started: Vec<Arc<QueueRuntime>> = self.list();
        for q in &started {
            loops.spawn(Arc::clone(&self).dispatch(Arc::clone(q), stop.clone()));
        }
        loop {
            tokio::select! {
                q = async { match added.as_mut() { Some(rx) => rx.recv().await, None => std::future::pending().await } } => match q {
                    Some(q) if !stop.drain.is_cancelled() && !started.iter().any(|s| Arc::ptr_eq(s, &q)) => {
                        started.push(Arc::clone(&q));
                        loops.spawn(Arc::clone(&self).dispatch(q, stop.clone()));
                    }
                    Some(_) => {}
                    None => added = None,
                },
                _ = loops.join_next(), if !loops.is_empty() => {}
                () = stop.drain.cancelled(), if loops.is_empty() => break,
            }
        }
    }

    async fn dispatch(self: Arc<Self>, q: Arc<QueueRuntime>, stop: Stop) {
        let name = q.name.clone();
        let slots = Arc::clone(&q.slots);
        // Stops leasing: the daemon drains, or a reload removed the queue.
        let drain = {
            let token = CancellationToken::new();
            let (t, d, r) = (token.clone(), stop.drain.clone(), q.retired.clone());
            tokio::spawn(async move {
                tokio::select! {
                    () = d.cancelled() => {}
                    () = r.cancelled() => {}
                }
                t.cancel();
            });
            token
        };
        // Set at start; a reload that changes `rate_limit` takes effect
        // when the queue's dispatcher next starts.
        let mut limiter = q.config().rate_limit.as_ref().map(Limiter::new);
        let mut attempts = JoinSet::new();
        // Leasing failed since then (the store is unavailable): logged at
        // the first failure and when leasing works again, not at each try.
        let mut lease_failing: Option<std::time::Instant> = None;
        loop {
            while attempts.try_join_next().is_some() {}
            let Some(plugin) = q.plugin().plugin else {
                tokio::select! {
                    () = q.wake.notified() => {}
                    () = drain.cancelled() => break,
                }
                continue;
            };
            let first = tokio::select! {
                p = Arc::clone(&slots).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                () = drain.cancelled() => break,
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
                            () = drain.cancelled() => break,
                        }
                        continue;
                    }
                }
            }
            // The newest version: one swapped in while this loop waited for a
            // slot runs these jobs (the attempts already running keep theirs),
            // and each attempt records it.
            let plugin = q.plugin().plugin.unwrap_or(plugin);
            let now = self.clock.now();
            let limits = lease_limits(&q.config());
            let leased = self
                .store
                .lease(
                    &LeaseAsk {
                        queue: &name,
                        max: want,
                        plugin_version: &plugin.version,
                        limits,
                    },
                    now,
                )
                .await;
            if leased.is_ok()
                && let Some(since) = lease_failing.take()
            {
                tracing::info!(queue = %name, after = ?since.elapsed(), "leasing works again");
            }
            let leases = match leased {
                Ok(l) if l.leases.is_empty() && l.held.is_some() => {
                    // The queue's limits across daemons are reached: wait
                    // for room, not for a ready job.
                    drop(first);
                    let wait = match l.held {
                        Some(Held::Rate(wait)) => wait,
                        _ => self.idle_poll,
                    };
                    tokio::select! {
                        () = q.wake.notified(), if l.held == Some(Held::Concurrency) => {}
                        () = tokio::time::sleep(wait) => {}
                        () = drain.cancelled() => break,
                    }
                    continue;
                }
                Ok(l) => l.leases,
                Err(e) => {
                    if lease_failing.is_none() {
                        lease_failing = Some(std::time::Instant::now());
                        tracing::error!(queue = %name, error = %e, "lease failed; retrying every {IDLE_POLL:?} (logged once until it works again)");
                    } else {
                        tracing::debug!(queue = %name, error = %e, "lease failed again");
                    }
                    drop(first);
                    tokio::select! {
                        () = tokio::time::sleep(IDLE_POLL) => {}
                        () = drain.cancelled() => break,
                    }
                    continue;
                }
            };
            if leases.is_empty() {
                drop(first);
                let wait = match self.store.next_run_at(&name).await {
                    // A due job that the lease skipped is being leased by
                    // another daemon: look again shortly, without spinning.
                    Ok(Some(at)) => Duration::from_millis(u64::try_from(at.0 - now.0).unwrap_or(0))
                        .clamp(MIN_WAIT, self.idle_poll.max(MIN_WAIT)),
                    Ok(None) => self.idle_poll,
                    Err(_) => IDLE_POLL,
                };
                tokio::select! {
                    () = q.wake.notified() => {}
                    () = tokio::time::sleep(wait) => {}
                    () = drain.cancelled() => break,
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
                        // Only when a lower concurrency from a reload took
                        // the free slots meanwhile: wait for one.
                        Err(_) => match Arc::clone(&slots).acquire_owned().await {
                            Ok(p) => p,
                            Err(_) => break,
                        },
                    },
                };
                let this = Arc::clone(&self);
                let (q, plugin, interrupt) =
                    (Arc::clone(&q), Arc::clone(&plugin), stop.interrupt.clone());
                // Every log line of the attempt, the daemon's and the guest's,
                // carries the job, queue, attempt and plugin version.
                let span = tracing::info_span!(
                    "attempt",
                    job = %lease.job_id,
                    queue = %lease.queue,
                    attempt = lease.attempt,
                    plugin = %plugin.name,
                    version = %plugin.version.get(..12).unwrap_or(&plugin.version),
                );
                attempts.spawn(
                    async move {
                        this.attempt(&q, &plugin, lease, permit, interrupt).await;
                    }
                    .instrument(span),
                );
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
        let Settings { config: cfg, scope } = q.settings();
        let cfg = &*cfg;
        let (cancel, lost) = (CancellationToken::new(), CancellationToken::new());
        if let Ok(mut running) = q.running.lock() {
            running.insert(
                lease.job_id.clone(),
                Running {
                    token: lease.token,
                    cancel: cancel.clone(),
                    lost: lost.clone(),
                },
            );
        }
        let effects = Effects::new(Arc::clone(&self.store), scope, lease.fence());
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
            log_lines: LOG_LINES,
        };
        let started = std::time::Instant::now();
        let run = self.host.run(plugin, input, effects, &limits);
        let ended = tokio::select! {
            out = run => Ended::Ran(out),
            () = cancel.cancelled() => Ended::Cancelled,
            () = lost.cancelled() => Ended::LeaseLost,
            () = interrupt.cancelled() => Ended::Interrupted,
        };
        drop(permit);
        if let Ok(mut running) = q.running.lock()
            && running
                .get(&lease.job_id)
                .is_some_and(|r| r.token == lease.token)
        {
            running.remove(&lease.job_id);
        }
        let now = self.clock.now();
        let finish = match ended {
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
            // The store refuses this finish (the lease is not held); the
            // attempt is recorded as abandoned there.
            Ended::LeaseLost => Finish::Interrupted {
                error: "stopped: its lease was lost".into(),
            },
        };
        crate::failpoints::pause("queue::before_finish").await;
        let outcome = outcome_label(&finish);
        metrics::histogram!("khata_attempt_duration_seconds", "queue" => cfg.name.clone())
            .record(started.elapsed().as_secs_f64());
        let finished = self.store.finish(&lease.fence(), finish, now).await;
        // An attempt whose end did not commit is not counted as its handler
        // ended: it is recorded as abandoned when its lease is reclaimed.
        let recorded = match &finished {
            Ok(_) | Err(StoreError::Fenced { .. }) => outcome,
            Err(_) => "abandoned",
        };
        metrics::counter!("khata_attempts_total", "queue" => cfg.name.clone(), "outcome" => recorded).increment(1);
        match finished {
            Ok(state) => {
                if outcome == "completed" {
                    self.completed.fetch_add(1, Ordering::Relaxed);
                }
                metrics::counter!("khata_jobs_finished_total", "queue" => cfg.name.clone(), "state" => state.as_str())
                    .increment(1);
                tracing::debug!(job = %lease.job_id, queue = %cfg.name, attempt = lease.attempt, outcome, next = %state, "attempt ended");
            }
            Err(StoreError::Fenced { .. }) => {
                tracing::info!(job = %lease.job_id, queue = %cfg.name, attempt = lease.attempt, "attempt ended after it lost its job (cancelled, or its lease expired): its end changed nothing");
            }
            Err(e) => {
                // The job stays active in the ledger, and is not reported
                // completed: its lease expires and a reclaim (on PostgreSQL,
                // by any daemon) or the next start redelivers it.
                tracing::error!(job = %lease.job_id, queue = %cfg.name, error = %e, "could not record the end of an attempt: the job is redelivered once its lease is reclaimed");
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

/// The limits a shared store keeps across daemons for queue `cfg`.
fn lease_limits(cfg: &config::Queue) -> LeaseLimits {
    LeaseLimits {
        concurrency: Some(cfg.concurrency),
        rate: cfg.rate_limit.as_ref().map(|r| RateWindow {
            max: r.max.max(1),
            per: r.per,
        }),
    }
}

enum Ended {
    Ran(RunOutcome),
    Cancelled,
    LeaseLost,
    Interrupted,
}

fn outcome_label(f: &Finish) -> &'static str {
    match f {
        Finish::Completed { .. } => "completed",
        Finish::Retry { outcome, .. } | Finish::Fail { outcome, .. } => outcome.as_str(),
        Finish::Interrupted { .. } => "interrupted",
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn queue(concurrency: u32) -> QueueRuntime {
        let text = format!("[queues.q]\nplugin = \"p\"\nconcurrency = {concurrency}\n");
        let config = config::Config::parse(&text, Path::new("jobs.toml")).expect("config");
        let outside = Outside {
            mailer: Err("no email here".into()),
            providers: Arc::new(Providers::from_config(&Default::default()).expect("providers")),
            email_from: "khata@localhost".into(),
            clock: Arc::new(crate::clock::SystemClock),
        };
        QueueRuntime::new(config.queues["q"].clone(), &outside)
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_lower_concurrency_takes_free_slots_at_once_and_busy_ones_as_they_end() {
        let q = queue(4);
        let mut busy: Vec<_> = (0..3)
            .map(|_| Arc::clone(&q.slots).try_acquire_owned().unwrap())
            .collect();
        q.set_concurrency(1);
        assert_eq!(q.slots.available_permits(), 0, "the free slot went at once");
        busy.pop();
        settle().await;
        assert_eq!(q.slots.available_permits(), 0, "taken by the collector");
        // Raised again while one slot is still owed: the debt is cancelled first.
        q.set_concurrency(2);
        assert_eq!(q.slots.available_permits(), 0);
        busy.pop();
        settle().await;
        assert_eq!(
            q.slots.available_permits(),
            1,
            "one attempt runs, one slot free"
        );
        busy.pop();
        settle().await;
        assert_eq!(q.slots.available_permits(), 2);
        q.set_concurrency(5);
        assert_eq!(q.slots.available_permits(), 5);
    }
}
