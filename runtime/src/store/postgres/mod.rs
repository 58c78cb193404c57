//! The PostgreSQL ledger: the same [`Store`] contract as [`super::sqlite`],
//! on `tokio-postgres` with a `deadpool-postgres` pool.
//!
//! # Transactions
//!
//! Every trait method but `finish` is one transaction on one pooled
//! connection (READ COMMITTED), so PostgreSQL's own group commit does what
//! the SQLite writer thread does: concurrent transactions that commit
//! together share a WAL flush. Finishes are grouped by the store itself
//! (below). The rules that SQLite gets from having one writer are written
//! into the statements instead:
//!
//! - **Leasing** takes the head of the ready order (priority desc, `run_at`,
//!   enqueue order) with `FOR UPDATE SKIP LOCKED`, so concurrent leases never
//!   pick the same job; each leased job gets a token from the sequence
//!   `fencing_tokens`, in delivery order. Counting the queue's limits,
//!   picking, the tokens, the jobs moved and their attempts opened are one
//!   statement; a limited lease sends it pipelined behind the queue's
//!   advisory lock, so that a lease costs three round trips (BEGIN, lock
//!   and lease, COMMIT).
//! - **The lease check** of every step that writes for an attempt (kv and
//!   index writes, `fence_begin`, `fence_take_over`) reads the job row with
//!   `FOR SHARE` (`finish` with `FOR UPDATE`), so a cancel (or anything else
//!   that moves the job) cannot commit between the check and the write: it
//!   waits for the step, or the step sees it. The lease-checked reads
//!   (`kv_get`, `index_get_leased`) check and read in one statement.
//! - **Dedup** rests on unique constraints: the job's primary key and the
//!   `dedup (queue, key)` primary key. An enqueue that loses a race on either
//!   does not fail: a lost `dedup` race reads the winner (the key's row,
//!   locked, then its job), and a lost id race reruns the whole step, which
//!   then finds the winner's job like any existing id. Deadlocks and
//!   serialization failures between concurrent steps rerun the step too
//!   (a batch is all or none, so rerunning it whole is safe).
//! - **Fences, kv keys and index documents** are created with `INSERT ... ON
//!   CONFLICT DO NOTHING` and otherwise moved under `FOR UPDATE`, so two
//!   attempts never both see a fence absent, or both take one over.
//! - **Job counts** are kept by statement-level triggers (with transition
//!   tables) in the transaction that changes the jobs, as SQLite's triggers
//!   keep them: `job_counts` holds deltas per (queue, state, shard), the shard
//!   being the server process (`pg_backend_pid() % 64`), so concurrent
//!   transactions on different connections do not queue on one counter row
//!   (which they would hold until their commit's fsync). Counting sums at most
//!   64 rows per queue and state; only `delayed` is counted on an index, in
//!   proportion to the delayed jobs.
//!
//! # Group commit of finishes
//!
//! A finish is the one step every job takes once per attempt, and each
//! transaction costs the server its round trips and a WAL flush. So
//! [`Store::finish`] hands its finish to the store's finisher task, which
//! takes every finish waiting (up to [`FINISH_BATCH`], a job at most once)
//! and applies them together in one transaction of two statements:
//!
//! 1. the jobs, read and locked `FOR UPDATE` in the order of their ids (so
//!    that the groups of several daemons never wait on each other in a
//!    cycle), each with its lease token, its dedup key and whether its lease
//!    is unexpired on the database's clock, taken after the lock;
//! 2. every write of the group in one statement of data-modifying CTEs: the
//!    attempts closed, the jobs moved (one `UPDATE` from `unnest` arrays, so
//!    the count trigger fires once), the dedup keys of jobs that ended
//!    released (only for jobs that have one), the queue's concurrency
//!    waiters woken and the queues with a job back to waiting notified.
//!
//! Each finish keeps its own answer: `Fenced` (the attempt's record is
//! closed all the same, as abandoned when its lease had expired) and
//! `NotFound` are outcomes inside the transaction, not failures of it. A
//! group that loses a race (deadlock) is rerun whole; one that a statement
//! error fails while the connection stays up is applied again one finish
//! per transaction, so that the error is that finish's alone; a lost
//! connection fails the whole group with `Unavailable`. Every caller hears
//! only after the COMMIT that holds its finish.
//!
//! Enqueues of a batch without dedup keys (and distinct ids) are one
//! `INSERT ... SELECT FROM unnest(...) ON CONFLICT (id) DO NOTHING`; the ids
//! it did not insert are read back to answer them as deduplicated (or
//! `IdReused`). A batch with dedup keys goes job by job.
//!
//! # What is durable when a method returns
//!
//! Every method that writes commits with `synchronous_commit` on (a
//! connection whose session default is `off` is set back to `on` when the
//! pool opens it) and returns after its COMMIT returned, that is after the
//! commit record was flushed to the WAL. With the server's `fsync` on (a
//! warning is logged at open when it is not), the step then survives a crash
//! of the server or of the machine:
//!
//! - the trait's **durable** methods (`enqueue`, `finish`, `recover`,
//!   `cancel`, `retry`, `sweep`, `fence_begin`, `fence_take_over`,
//!   `fence_done`, `fence_release`, `fence_uncertain`, `fence_resolve`):
//!   durable when they return, as the trait requires (`finish` returns
//!   after the COMMIT of the group that holds it);
//! - the trait's **applied** methods (`lease`, `kv_put`,
//!   `kv_insert_if_absent`, `kv_delete`, `index_upsert`, `index_remove`,
//!   `record_effect`): durable when they return too, which is more than the
//!   trait asks. They are not committed asynchronously
//!   (`synchronous_commit = off` for their own transaction) although that
//!   would meet the trait's words: on SQLite an applied step can only be
//!   lost together with the daemon that applied it, so nothing goes on
//!   building on it; a PostgreSQL server can crash and come back while the
//!   daemon runs on, and an attempt would then read back a kv write that is
//!   gone, complete on top of it, or find its lost lease's fencing token
//!   handed out again (the sequence's unflushed advance is lost with it).
//!   PostgreSQL's group commit (concurrent commits share a WAL flush) is
//!   what keeps this affordable.
//! - Reads (`job`, `jobs`, `counts`, `next_run_at`, `index_get`, `fences`,
//!   `effects`, and the lease-checked `kv_get` and `index_get_leased`) see
//!   committed, hence durable, state; each is one statement or one
//!   repeatable-read snapshot.
//! - Fencing tokens come from the sequence `fencing_tokens`, whose advance is
//!   WAL-logged before a token is handed out and flushed by the lease's
//!   commit, so a token is never issued twice, across crashes of the server
//!   too.
//! - A COMMIT whose answer is lost (the connection broke) is reported as
//!   `Unavailable`; the step may or may not have happened, which is what
//!   `Unavailable` means ("may be retried": enqueue by id, fences by key).
//!
//! # Schema and migrations
//!
//! Versioned migrations ([`MIGRATIONS`]) are applied by [`PostgresStore::open`]
//! and by [`migrate`] (`khata store migrate`), all pending versions in one
//! transaction that first takes a transaction-level advisory lock, so that
//! several daemons starting at once migrate once; `khata_schema_migrations`
//! records the applied versions. A database whose schema is newer than this
//! build is refused. The tables live in the first schema of the connection's
//! `search_path`: give khata a database of its own (or a schema, with
//! `options=-csearch_path%3Dkhata` in the URL).
//!
//! # Several daemons on one database
//!
//! Each open store is one daemon, named by a random id (a UUID, new at every
//! start) registered in the table `daemons` with its host and pid. A lease
//! is the job row's `lease_token`, `lease_owner` (the daemon's id) and
//! `lease_expires_at`, always measured on the database's clock
//! (`clock_timestamp()`), never a daemon's, so that clocks that disagree
//! cannot make two daemons both believe they hold a job:
//!
//! - [`Store::lease`] sets `lease_expires_at` to `lease` from now;
//!   [`Store::heartbeat`] extends the daemon's unexpired leases by `lease`
//!   and reports those it no longer holds.
//! - **Every lease check** (kv and index steps, `fence_begin`,
//!   `fence_take_over`, `finish`) requires the stored token AND
//!   `lease_expires_at > clock_timestamp()`: a daemon paused past its lease
//!   (SIGSTOP, a long pause, a partition) is `Fenced` at its next effect even
//!   before any other daemon reclaimed the job, and its `finish` is refused
//!   (its attempt is closed as abandoned).
//! - [`Store::reclaim_expired`] takes expired leases with `FOR UPDATE SKIP
//!   LOCKED` (a step in progress on a job keeps it until it ends; daemons
//!   reclaiming at once split the work), a bounded number per pass, and
//!   closes each attempt as abandoned (counted toward `max_attempts`).
//!   [`Store::recover`] at start is the same for every expired lease: jobs
//!   leased by live daemons are left alone.
//! - An enqueue, a retry (by hand or with backoff), an interrupted attempt
//!   and a reclaim `NOTIFY` the channel `khata_wake` with the queue's name
//!   as payload, in the step's transaction (delivered at its commit);
//!   [`Store::wakeups`] LISTENs on a connection of its own, reconnecting
//!   when it drops, and yields `*` (every queue) after each (re)connection,
//!   since notifications sent meanwhile are lost.
//! - [`Store::lease`] keeps a queue's `concurrency` and `rate_limit`
//!   across daemons: under a per-queue transaction advisory lock it counts
//!   the queue's unexpired leases and its starts in the window
//!   (`queue_starts`, at the database's time `attempts.leased_at`) and
//!   leases at most what is left. This daemon's attempts whose finish is
//!   on its way (their handlers ended) do not count in its own leases,
//!   unless another daemon waits for room; other daemons count them until
//!   the finish commits. A lease held back
//!   by `concurrency` records a wait in `queue_waits`, commits, and counts
//!   again; after each finish group or cancel commits, one statement of its
//!   own consumes the waits of the queues whose attempts ended and
//!   `NOTIFY`s. Either that statement sees the wait, or the second count
//!   sees the end (see `wake_waiting`), so no wake-up is lost, and an
//!   attempt's end never waits for the queue's lock. [`Store::lease`] takes
//!   no lock.
//! - A step never idles inside its transaction, unless its daemon is paused:
//!   the pool's sessions run with `idle_in_transaction_session_timeout` set
//!   to the lease, so the server ends a paused daemon's open transaction
//!   (and its row locks, which would keep the job from being reclaimed) by
//!   the time its lease expires.
//!
//! # Connections
//!
//! Plain TCP or a Unix socket, without TLS (`NoTls`): run the database on
//! the same machine or a trusted network for now. Unless the URL sets
//! them, TCP connections get `tcp_user_timeout` and keepalives of about a
//! lease, so that a server that stops answering fails the steps
//! (`Unavailable`) rather than hanging them. A server that went away and
//! came back (a restart) is reconnected to by the pool: a pooled
//! connection the server closed is found closed when it is next taken
//! and replaced by a new one. The URL is a libpq-style
//! URL or key-value string (`postgres://user:password@host:port/db`).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use deadpool_postgres::{
    GenericClient, Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime,
};
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};

use super::rules::{self, ABANDONED, LEASE_EXPIRED, stored_state, visible_state};
use super::{
    EffectRecord, Fence, FenceBegin, FenceId, FenceState, Held, JobFilter, JobPage, LeaseLimits,
    Leased, PAGE_BYTES, PageBuilder, Resolution, RetentionRules, Store, StoreError, Swept,
    UpsertOutcome,
};
use crate::job::{
    Attempt, AttemptOutcome, Enqueued, Finish, Job, JobState, Lease, LeaseRef, Millis, NewJob,
    StateCounts,
};

/// The advisory lock that serialises migrations (transaction-level).
const MIGRATION_LOCK: i64 = 0x6b68_6174_615f_6d67; // "khata_mg"
/// The first key of the per-queue advisory locks of limited leases
/// (`pg_advisory_xact_lock(QUEUE_LOCK, hashtext(queue))`); the two-key
/// space is apart from the one-key space of [`MIGRATION_LOCK`].
const QUEUE_LOCK: i32 = 0x6b68_716c; // "khql"

/// How often a step is rerun after losing a race (deadlock, serialization
/// failure, unique violation) before it gives up as `Unavailable`.
const MAX_RERUNS: u32 = 20;
/// The lease of a store opened without [`PostgresStore::with_lease`].
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Limited leases of one call at most: the first, and those run again
/// because a count after its wait's commit found room (`Store::lease`).
const RECOUNTS: u32 = 4;
/// Expired leases reclaimed in one pass at most.
const RECLAIM_BATCH: u32 = 500;
/// The channel of wake-ups; the payload is a queue's name.
const WAKE_CHANNEL: &str = "khata_wake";
/// How long the listener waits before connecting again.
const LISTEN_RETRY: Duration = Duration::from_secs(1);
/// Rows of each kind removed by one sweep at most, whatever `limit` says.
const MAX_SWEEP: u32 = 10_000;

const JOB_COLUMNS: &str = "id, queue, state, payload, priority, attempt, budget_used, max_attempts, \
     dedup_key, run_at, enqueued_at, finished_at, result, last_error";

const FENCE_COLUMNS: &str = "namespace, kind, key, state, fingerprint, job_id, attempt, token, result, created_at, updated_at";

use super::{RESOLVED_BY_OPERATOR, copy};

/// What `migrate` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migrated {
    /// The schema version found.
    pub from: i32,
    /// The schema version now (this build's [`SCHEMA_VERSION`]).
    pub to: i32,
}

/// A PostgreSQL ledger.
pub struct PostgresStore {
    pool: Pool,
    /// `host:port/dbname`, for messages (never the password).
    target: String,
    /// For the wake-up listener's connection of its own.
    cfg: tokio_postgres::Config,
    /// This daemon's id in `daemons` and in `jobs.lease_owner`.
    daemon_id: String,
    /// How long a lease lasts unless renewed, in ms; also the sessions'
    /// `idle_in_transaction_session_timeout`.
    lease_ms: i64,
    /// The leases this store handed out and not yet saw end, to report those
    /// that a heartbeat finds lost. Entered after the lease's commit, each
    /// with the instant (this process's monotonic clock) by which it has
    /// surely expired on the database's: `lease` after the answer of the
    /// statement that last set its expiry, which the database computed
    /// before that answer.
    held: std::sync::Mutex<std::collections::HashMap<LeaseRef, std::time::Instant>>,
    /// The fencing tokens of this store's attempts whose finish is on its
    /// way (sent to the finisher, not yet answered). Their handlers have
    /// ended, so a limited lease does not count them as in flight, though
    /// their jobs stay `active` until the finish commits.
    ending: std::sync::Mutex<std::collections::HashSet<i64>>,
    /// The wake-up listener, stopped with the store.
    listener: std::sync::Mutex<Option<AbortOnDrop>>,
    /// The finisher's queue ([`finisher`]); it stops once this is dropped
    /// and it has answered every finish sent.
    finishes: tokio::sync::mpsc::UnboundedSender<FinishReq>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("target", &self.target)
            .finish()
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

fn unavailable(e: impl fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// A driver error as a sentence: the server's code and message when it sent
/// one, else the driver's error and its cause.
fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!(
            "PostgreSQL {} {}: {}",
            db.severity(),
            db.code().code(),
            db.message()
        );
        if let Some(detail) = db.detail() {
            s.push_str(&format!(" ({detail})"));
        }
        return s;
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("PostgreSQL: {e}: {cause}"),
        None => format!("PostgreSQL: {e}"),
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> StoreError {
        StoreError::Unavailable(describe(&e))
    }
}

/// Why a step stopped: for good, or because it lost a race with a
/// concurrent transaction and a rerun will see the winner.
#[derive(Debug)]
enum Fail {
    Store(StoreError),
    Rerun(String),
}

impl From<StoreError> for Fail {
    fn from(e: StoreError) -> Fail {
        Fail::Store(e)
    }
}

impl From<tokio_postgres::Error> for Fail {
    fn from(e: tokio_postgres::Error) -> Fail {
        match e.code() {
            Some(c)
                if *c == SqlState::T_R_DEADLOCK_DETECTED
                    || *c == SqlState::T_R_SERIALIZATION_FAILURE
                    || *c == SqlState::UNIQUE_VIOLATION =>
            {
                Fail::Rerun(describe(&e))
            }
            _ => Fail::Store(e.into()),
        }
    }
}

// ---------------------------------------------------------------------------
// Opening, migrating, the daemon lock
// ---------------------------------------------------------------------------

/// Parses a connection URL (or key-value string). The error never repeats
/// the URL, which may hold a password.
pub fn parse_url(url: &str) -> Result<tokio_postgres::Config, StoreError> {
    tokio_postgres::Config::from_str(url).map_err(|e| {
        StoreError::Unavailable(format!("the PostgreSQL URL is not valid: {}", describe(&e)))
    })
}

/// `host:port/dbname` of a configuration, for messages.
fn target_of(cfg: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = cfg
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(name) => name.clone(),
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}:{port}/{}",
        if hosts.is_empty() {
            "localhost".to_owned()
        } else {
            hosts.join(",")
        },
        cfg.get_dbname().unwrap_or("(default)")
    )
}

fn with_defaults(mut cfg: tokio_postgres::Config) -> tokio_postgres::Config {
    if cfg.get_application_name().is_none() {
        cfg.application_name("khata");
    }
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(Duration::from_secs(10));
    }
    cfg
}

async fn connect(
    cfg: &tokio_postgres::Config,
) -> Result<(tokio_postgres::Client, JoinHandle<()>), StoreError> {
    let (client, connection) = cfg.connect(NoTls).await.map_err(|e| {
        StoreError::Unavailable(format!(
            "cannot connect to PostgreSQL at {}: {}",
            target_of(cfg),
            describe(&e)
        ))
    })?;
    let task = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "PostgreSQL connection ended");
        }
    });
    Ok((client, task))
}

impl PostgresStore {
    /// A handler-facing read checked against `lease` in one statement, so
    /// that the lease check and the read see one snapshot. `read` selects
    /// one column by `$2` and `$3`; `Fenced` when the lease is not held.
    async fn leased_read<T>(
        &self,
        lease: &LeaseRef,
        read: &str,
        a: &str,
        b: &str,
    ) -> Result<Option<T>, StoreError>
    where
        T: for<'r> tokio_postgres::types::FromSql<'r>,
    {
        let client = self.client().await?;
        let sql = format!(
            "SELECT (SELECT lease_token FROM jobs WHERE id = $1 AND state = 'active' \
                     AND lease_expires_at > clock_timestamp()), ({read})"
        );
        let r = rows(&client, &sql, &[&lease.job_id, &a, &b])
            .await
            .map_err(store_err)?;
        let r = r.first().ok_or_else(|| unavailable("no row"))?;
        holds(lease, r.try_get(0)?)?;
        Ok(r.try_get(1)?)
    }
    /// Opens the ledger at `url` with at most `pool` connections: applies
    /// pending migrations and registers this daemon in `daemons` under a
    /// new random id. Other daemons may use the same database.
    pub async fn open(url: &str, pool: usize) -> Result<PostgresStore, StoreError> {
        Self::open_config(parse_url(url)?, pool).await
    }

    /// [`open`](Self::open) with a parsed configuration.
    pub async fn open_config(
        cfg: tokio_postgres::Config,
        pool: usize,
    ) -> Result<PostgresStore, StoreError> {
        Self::open_inner(cfg, pool, DEFAULT_LEASE).await
    }

    /// [`open`](Self::open) for a daemon whose leases last `lease` unless
    /// renewed by [`Store::heartbeat`] (`[store] lease`).
    pub async fn open_with_lease(
        url: &str,
        pool: usize,
        lease: Duration,
    ) -> Result<PostgresStore, StoreError> {
        Self::open_inner(parse_url(url)?, pool, lease).await
    }

    async fn open_inner(
        cfg: tokio_postgres::Config,
        pool: usize,
        lease: Duration,
    ) -> Result<PostgresStore, StoreError> {
        let mut cfg = with_defaults(cfg);
        // A connection to a server that stopped answering (a partition, a
        // machine gone) fails within about a lease instead of hanging: an
        // unacknowledged write by TCP_USER_TIMEOUT, an idle connection (the
        // wake-up listener's) by keepalives. The URL's own settings win.
        let lease_floor = lease.max(Duration::from_secs(1));
        if cfg.get_tcp_user_timeout().is_none() {
            cfg.tcp_user_timeout(lease_floor);
        }
        if cfg.get_keepalives_interval().is_none() {
            cfg.keepalives_idle(lease_floor)
                .keepalives_interval((lease_floor / 3).max(Duration::from_secs(1)))
                .keepalives_retries(3);
        }
        let target = target_of(&cfg);
        {
            let (mut client, task) = connect(&cfg).await?;
            migrate_client(&mut client).await?;
            warn_if_not_durable(&client, &target).await?;
            drop(client);
            let _ = task.await;
        }
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1);
        let manager = Manager::from_config(
            cfg.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool.max(1))
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_secs(10)))
            .wait_timeout(Some(Duration::from_secs(60)))
            .recycle_timeout(Some(Duration::from_secs(10)))
            .post_create(Hook::async_fn(move |client, _| {
                let idle_ms = lease_ms;
                Box::pin(async move {
                    // Durable steps rely on the session's synchronous_commit:
                    // never let a server default of `off` weaken them. A
                    // step never idles inside its transaction unless the
                    // daemon is paused (SIGSTOP, a partition): the server
                    // then ends the session after a lease, releasing the
                    // row locks that would keep others from reclaiming.
                    client
                        .batch_execute(&format!(
                            "SELECT set_config('synchronous_commit', 'on', false) \
                             WHERE current_setting('synchronous_commit') = 'off'; \
                             SET idle_in_transaction_session_timeout = {idle_ms}"
                        ))
                        .await
                        .map_err(HookError::Backend)
                })
            }))
            .build()
            .map_err(unavailable)?;
        let (finishes, queued) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(finisher(pool.clone(), target.clone(), queued));
        let store = PostgresStore {
            finishes,
            pool,
            target,
            cfg,
            daemon_id: uuid::Uuid::now_v7().to_string(),
            lease_ms,
            held: std::sync::Mutex::new(std::collections::HashMap::new()),
            ending: std::sync::Mutex::new(std::collections::HashSet::new()),
            listener: std::sync::Mutex::new(None),
        };
        store.register().await?;
        Ok(store)
    }

    /// This daemon's id (in `daemons` and `jobs.lease_owner`).
    pub fn daemon_id(&self) -> &str {
        &self.daemon_id
    }

    fn lease_ms(&self) -> i64 {
        self.lease_ms
    }

    fn lease_duration(&self) -> Duration {
        Duration::from_millis(u64_of(self.lease_ms))
    }

    fn hold(&self, leases: &[Lease]) {
        let expired_by = std::time::Instant::now() + self.lease_duration();
        if let Ok(mut held) = self.held.lock() {
            held.extend(leases.iter().map(|l| (l.fence(), expired_by)));
        }
    }

    /// The tokens of this store's attempts whose finish is on its way.
    fn ending(&self) -> Vec<i64> {
        self.ending
            .lock()
            .map(|e| e.iter().copied().collect())
            .unwrap_or_default()
    }

    fn release(&self, lease: &LeaseRef) {
        if let Ok(mut held) = self.held.lock() {
            held.remove(lease);
        }
    }

    /// `host:port/dbname` of the database.
    pub fn target(&self) -> &str {
        &self.target
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, StoreError> {
        pool_client(&self.pool, &self.target).await
    }
}

/// A pooled connection; the error names the database's `target`.
async fn pool_client(pool: &Pool, target: &str) -> Result<deadpool_postgres::Client, StoreError> {
    pool.get().await.map_err(|e| {
        StoreError::Unavailable(match e {
            deadpool_postgres::PoolError::Backend(e) => {
                format!("PostgreSQL at {target}: {}", describe(&e))
            }
            other => format!("PostgreSQL at {target}: {other}"),
        })
    })
}

async fn warn_if_not_durable(
    client: &tokio_postgres::Client,
    target: &str,
) -> Result<(), StoreError> {
    let fsync: String = client.query_one("SHOW fsync", &[]).await?.try_get(0)?;
    if fsync != "on" {
        tracing::error!(database = %target, "the PostgreSQL server runs with fsync = off: its commits are not durable, and a crash of the machine may lose acknowledged jobs");
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Steps: one transaction each
// ---------------------------------------------------------------------------

/// What a step's transaction does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Writes; COMMIT waits for the WAL flush (the session's
    /// `synchronous_commit`, which the pool keeps on). The trait's applied
    /// steps too: see the module's notes on durability.
    Write,
    /// Reads only, one snapshot.
    Read,
}

async fn begin(
    client: &mut deadpool_postgres::Client,
    mode: Mode,
) -> Result<deadpool_postgres::Transaction<'_>, StoreError> {
    Ok(match mode {
        Mode::Read => {
            client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await?
        }
        Mode::Write => client.transaction().await?,
    })
}

/// Runs `$body` (an expression of type `Result<T, Fail>` that may `.await`
/// and use `?`, with the transaction bound to `$tx`) in one transaction and
/// commits it; reruns the whole step when it lost a race.
macro_rules! step {
    ($store:expr, $mode:expr, |$tx:ident| $body:expr) => {{
        let mut reruns = 0u32;
        loop {
            // Failures break out of the loop rather than return, so that a
            // caller's code after the step (e.g. `finish` releasing its
            // lease) runs whatever the outcome.
            let mut client = match $store.client().await {
                Ok(c) => c,
                Err(e) => break Err(e),
            };
            let $tx = match begin(&mut client, $mode).await {
                Ok(tx) => tx,
                Err(e) => break Err(e),
            };
            let out: Result<_, Fail> = async { $body }.await;
            match out {
                Ok(v) => match $tx.commit().await {
                    Ok(()) => break Ok(v),
                    Err(e) => break Err(StoreError::from(e)),
                },
                Err(Fail::Store(e)) => {
                    let _ = $tx.rollback().await;
                    break Err(e);
                }
                Err(Fail::Rerun(why)) => {
                    let _ = $tx.rollback().await;
                    reruns += 1;
                    if reruns > MAX_RERUNS {
                        break Err(StoreError::Unavailable(format!(
                            "gave up after {MAX_RERUNS} conflicts with concurrent steps: {why}"
                        )));
                    }
                    tracing::debug!(reruns, reason = %why, "store step lost a race; running it again");
                    tokio::time::sleep(Duration::from_millis(u64::from(reruns.min(10)) * 2))
                        .await;
                }
            }
        }
    }};
}

// Query helpers over a transaction or a plain pooled connection, with
// statements prepared once per connection.

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

async fn rows<C: GenericClient>(c: &C, sql: &str, params: Params<'_>) -> Result<Vec<Row>, Fail> {
    let stmt = c.prepare_cached(sql).await?;
    Ok(c.query(&stmt, params).await?)
}

async fn row_opt<C: GenericClient>(
    c: &C,
    sql: &str,
    params: Params<'_>,
) -> Result<Option<Row>, Fail> {
    let stmt = c.prepare_cached(sql).await?;
    Ok(c.query_opt(&stmt, params).await?)
}

async fn exec<C: GenericClient>(c: &C, sql: &str, params: Params<'_>) -> Result<u64, Fail> {
    let stmt = c.prepare_cached(sql).await?;
    Ok(c.execute(&stmt, params).await?)
}

/// A step's failure as the trait reports it.
fn store_err(f: Fail) -> StoreError {
    match f {
        Fail::Store(e) => e,
        Fail::Rerun(why) => StoreError::Unavailable(why),
    }
}

fn i32_of(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

fn u32_of(v: i32) -> u32 {
    u32::try_from(v).unwrap_or(0)
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn u64_of(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn job_from_row(r: &Row, now: Millis) -> Result<Job, Fail> {
    let state: String = r.try_get(2)?;
    let run_at = Millis(r.try_get(9)?);
    Ok(Job {
        id: r.try_get(0)?,
        queue: r.try_get(1)?,
        state: visible_state(stored_state(&state), run_at, now),
        payload: r.try_get(3)?,
        priority: r.try_get(4)?,
        attempt: u32_of(r.try_get(5)?),
        budget_used: u32_of(r.try_get(6)?),
        max_attempts: u32_of(r.try_get(7)?),
        dedup_key: r.try_get(8)?,
        run_at,
        enqueued_at: Millis(r.try_get(10)?),
        finished_at: r.try_get::<_, Option<i64>>(11)?.map(Millis),
        result: r.try_get(12)?,
        last_error: r.try_get(13)?,
        attempts: Vec::new(),
    })
}

async fn load_job<C: GenericClient>(c: &C, id: &str, now: Millis) -> Result<Option<Job>, Fail> {
    const SQL: &str = "SELECT id, queue, state, payload, priority, attempt, budget_used, max_attempts, \
         dedup_key, run_at, enqueued_at, finished_at, result, last_error FROM jobs WHERE id = $1";
    match row_opt(c, SQL, &[&id]).await? {
        Some(r) => Ok(Some(job_from_row(&r, now)?)),
        None => Ok(None),
    }
}

/// The job, its row locked for update, with its lease token.
async fn lock_job<C: GenericClient>(
    c: &C,
    id: &str,
    now: Millis,
) -> Result<(Job, Option<i64>), Fail> {
    const SQL: &str = "SELECT id, queue, state, payload, priority, attempt, budget_used, max_attempts, \
         dedup_key, run_at, enqueued_at, finished_at, result, last_error, lease_token FROM jobs \
         WHERE id = $1 FOR UPDATE";
    let r = row_opt(c, SQL, &[&id])
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    Ok((job_from_row(&r, now)?, r.try_get(14)?))
}

async fn load_attempts<C: GenericClient>(c: &C, id: &str) -> Result<Vec<Attempt>, Fail> {
    let rows = rows(
        c,
        "SELECT number, token, started_at, ended_at, outcome, error, plugin_version FROM attempts \
         WHERE job_id = $1 ORDER BY number",
        &[&id],
    )
    .await?;
    rows.iter()
        .map(|r| {
            let outcome: String = r.try_get(4)?;
            Ok(Attempt {
                number: u32_of(r.try_get(0)?),
                fencing_token: u64_of(r.try_get(1)?),
                started_at: Millis(r.try_get(2)?),
                ended_at: r.try_get::<_, Option<i64>>(3)?.map(Millis),
                outcome: AttemptOutcome::parse(&outcome).unwrap_or(AttemptOutcome::Error),
                error: r.try_get(5)?,
                plugin_version: r.try_get(6)?,
            })
        })
        .collect()
}

/// Checks that `lease` holds its job: the job is active under that token
/// and the lease has not expired on the database's clock. With `lock`, the
/// job row is share-locked until the step ends, so nothing (a cancel, a
/// reclaim) can move the job between this check and the step's writes.
async fn check_lease<C: GenericClient>(c: &C, lease: &LeaseRef, lock: bool) -> Result<(), Fail> {
    let sql = if lock {
        "SELECT lease_token FROM jobs WHERE id = $1 AND state = 'active' \
         AND lease_expires_at > clock_timestamp() FOR SHARE"
    } else {
        "SELECT lease_token FROM jobs WHERE id = $1 AND state = 'active' \
         AND lease_expires_at > clock_timestamp()"
    };
    let held: Option<i64> = match row_opt(c, sql, &[&lease.job_id]).await? {
        Some(r) => r.try_get(0)?,
        None => None,
    };
    Ok(holds(lease, held)?)
}

/// `Fenced` unless `held` (the job's token, when it is active) is the lease's.
fn holds(lease: &LeaseRef, held: Option<i64>) -> Result<(), StoreError> {
    // The query read the token of an active job only.
    if rules::holds(JobState::Active, held.map(u64_of), lease) {
        Ok(())
    } else {
        Err(rules::fenced(lease))
    }
}

mod daemons;
mod enqueue;
mod export;
mod fences;
mod finish;
mod kv_index;
mod lease;
mod schema;
mod store_impl;
mod sweep;

use self::enqueue::*;
use self::export::*;
use self::fences::*;
use self::finish::*;
use self::kv_index::*;
use self::lease::*;
pub use self::schema::*;
use self::sweep::*;

/// Fresh databases for tests, on the server named by `KHATA_TEST_PG_URL`.
/// Not part of the daemon; public so that the integration tests use it too.
#[doc(hidden)]
pub mod testing;

#[cfg(test)]
mod tests;
