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
//! - [`Store::lease_within`] keeps a queue's `concurrency` and `rate_limit`
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

/// The schema version this build writes.
pub const SCHEMA_VERSION: i32 = 5;

/// The schema, one entry per version; entry `i` moves version `i` to `i + 1`.
pub const MIGRATIONS: &[&str] = &[
    r#"
-- Fencing tokens: daemon-wide, only growing.
CREATE SEQUENCE fencing_tokens AS bigint MINVALUE 1 START 1;

-- state is one of waiting, active, completed, dead, cancelled;
-- 'delayed' is derived: waiting with run_at in the future.
CREATE TABLE jobs (
    id           text PRIMARY KEY,
    queue        text NOT NULL,
    state        text NOT NULL CHECK (state IN ('waiting', 'active', 'completed', 'dead', 'cancelled')),
    payload      text NOT NULL,
    priority     integer NOT NULL,
    run_at       bigint NOT NULL,
    seq          bigint GENERATED BY DEFAULT AS IDENTITY UNIQUE,
    attempt      integer NOT NULL DEFAULT 0,
    budget_used  integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL,
    dedup_key    text,
    enqueued_at  bigint NOT NULL,
    finished_at  bigint,
    result       text,
    last_error   text,
    lease_token  bigint
);
-- The ready order.
CREATE INDEX jobs_ready ON jobs (queue, priority DESC, run_at, seq) WHERE state = 'waiting';
-- The next job to become due, and the delayed count.
CREATE INDEX jobs_due ON jobs (queue, run_at) WHERE state = 'waiting';
CREATE INDEX jobs_active ON jobs (id) WHERE state = 'active';
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE state IN ('completed', 'cancelled');
CREATE INDEX jobs_queue_state ON jobs (queue, state, seq);

CREATE TABLE attempts (
    job_id     text NOT NULL,
    number     integer NOT NULL,
    token      bigint NOT NULL,
    started_at bigint NOT NULL,
    ended_at   bigint,
    outcome    text NOT NULL,
    error      text,
    PRIMARY KEY (job_id, number)
);
CREATE INDEX attempts_open ON attempts (job_id) WHERE ended_at IS NULL;

-- A dedup key points at the job that holds it; hold_until keeps it held
-- after that job ends (dedup_for). The primary key is what makes
-- concurrent enqueues of one key create one job.
CREATE TABLE dedup (
    queue      text NOT NULL,
    key        text NOT NULL,
    job_id     text NOT NULL,
    hold_until bigint,
    PRIMARY KEY (queue, key)
);

CREATE TABLE kv (
    namespace text NOT NULL,
    key       text NOT NULL,
    value     bytea NOT NULL,
    PRIMARY KEY (namespace, key)
);

-- document NULL is a tombstone that keeps its version.
CREATE TABLE index_docs (
    collection text NOT NULL,
    id         text NOT NULL,
    version    bigint NOT NULL,
    document   text,
    updated_at bigint NOT NULL,
    PRIMARY KEY (collection, id)
);

-- One fence per effect (DESIGN 4): started -> done, uncertain, or deleted.
CREATE TABLE fences (
    namespace   text NOT NULL,
    kind        text NOT NULL,
    key         text NOT NULL,
    state       text NOT NULL CHECK (state IN ('started', 'done', 'uncertain')),
    fingerprint bytea NOT NULL,
    job_id      text NOT NULL,
    attempt     integer NOT NULL,
    token       bigint NOT NULL,
    result      bytea,
    created_at  bigint NOT NULL,
    updated_at  bigint NOT NULL,
    PRIMARY KEY (namespace, kind, key)
);
CREATE INDEX fences_state ON fences (state, updated_at);

-- The effects each attempt performed or replayed, in the order recorded.
CREATE TABLE effects (
    n       bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    job_id  text NOT NULL,
    attempt integer NOT NULL,
    kind    text NOT NULL,
    key     text NOT NULL,
    outcome text NOT NULL,
    at      bigint NOT NULL
);
CREATE INDEX effects_job ON effects (job_id, attempt, n);

-- Jobs per queue and stored state, kept by the triggers below in the
-- transaction that changes the jobs, so that counting never scans the jobs.
-- The count of (queue, state) is the sum over its shards; a shard is the
-- server process that wrote the delta, so that concurrent transactions do
-- not wait on one another's counter row until their commits.
CREATE TABLE job_counts (
    queue text NOT NULL,
    state text NOT NULL,
    shard integer NOT NULL,
    n     bigint NOT NULL,
    PRIMARY KEY (queue, state, shard)
);

CREATE FUNCTION job_counts_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO job_counts (queue, state, shard, n)
            SELECT queue, state, pg_backend_pid() % 64, COUNT(*) FROM new_rows GROUP BY queue, state
            ON CONFLICT (queue, state, shard) DO UPDATE SET n = job_counts.n + EXCLUDED.n;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO job_counts (queue, state, shard, n)
            SELECT queue, state, pg_backend_pid() % 64, -COUNT(*) FROM old_rows GROUP BY queue, state
            ON CONFLICT (queue, state, shard) DO UPDATE SET n = job_counts.n + EXCLUDED.n;
    ELSE
        INSERT INTO job_counts (queue, state, shard, n)
            SELECT queue, state, pg_backend_pid() % 64, SUM(d) FROM (
                SELECT o.queue, o.state, -1 AS d FROM old_rows o JOIN new_rows w ON w.id = o.id
                    WHERE o.state <> w.state OR o.queue <> w.queue
                UNION ALL
                SELECT w.queue, w.state, 1 AS d FROM old_rows o JOIN new_rows w ON w.id = o.id
                    WHERE o.state <> w.state OR o.queue <> w.queue
            ) moved GROUP BY queue, state HAVING SUM(d) <> 0
            ON CONFLICT (queue, state, shard) DO UPDATE SET n = job_counts.n + EXCLUDED.n;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION job_counts_add();
CREATE TRIGGER job_counts_update AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION job_counts_add();
CREATE TRIGGER job_counts_delete AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION job_counts_add();
"#,
    r#"
ALTER TABLE attempts ADD COLUMN plugin_version text;
"#,
    r#"
-- Leases that expire (several daemons on one database). An active job is
-- held by lease_owner until lease_expires_at, on the database's clock.
ALTER TABLE jobs ADD COLUMN lease_owner text, ADD COLUMN lease_expires_at timestamptz;
-- A job active before this version belonged to the one daemon of versions 1-2:
-- its lease is expired at once, so the next start reclaims it.
UPDATE jobs SET lease_expires_at = now() WHERE state = 'active';
CREATE INDEX jobs_lease_expiry ON jobs (lease_expires_at) WHERE state = 'active';
CREATE INDEX jobs_lease_owner ON jobs (lease_owner) WHERE state = 'active';

-- The daemons that used this database, for operators: id (random per
-- start), where it runs, and when it last renewed its leases.
CREATE TABLE daemons (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    heartbeat_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"#,
    r#"
-- Limits across daemons (concurrency, rate_limit), kept by the lease step
-- under a per-queue advisory lock.
-- When each attempt started on the database's clock (NULL before version 4,
-- and for attempts copied from an embedded ledger).
ALTER TABLE attempts ADD COLUMN leased_at timestamptz;
-- The starts of rate-limited queues within their current window; a lease of
-- the queue deletes those that left it.
CREATE TABLE queue_starts (
    queue text NOT NULL,
    at    timestamptz NOT NULL
);
CREATE INDEX queue_starts_at ON queue_starts (queue, at);
-- Queues whose lease was held back by their concurrency: the end of any of
-- their attempts wakes every daemon.
CREATE TABLE queue_waits (
    queue text PRIMARY KEY
);
"#,
    r#"
-- Retention of dead jobs, kv entries and index tombstones: a kv entry's last
-- write (entries from before version 5 count as written now).
ALTER TABLE kv ADD COLUMN written_at bigint NOT NULL
    DEFAULT (extract(epoch FROM now()) * 1000)::bigint;
ALTER TABLE kv ALTER COLUMN written_at DROP DEFAULT;
CREATE INDEX kv_written ON kv (namespace, written_at);
CREATE INDEX jobs_dead ON jobs (finished_at) WHERE state = 'dead';
CREATE INDEX index_tombstones ON index_docs (updated_at) WHERE document IS NULL;
"#,
];

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
/// because a count after its wait's commit found room (`lease_within`).
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

use super::RESOLVED_BY_OPERATOR;

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

/// Applies every pending migration, in one transaction under the migration
/// lock. Returns the versions before and after.
pub async fn migrate(url: &str) -> Result<Migrated, StoreError> {
    let cfg = with_defaults(parse_url(url)?);
    let (mut client, task) = connect(&cfg).await?;
    let out = migrate_client(&mut client).await;
    drop(client);
    let _ = task.await;
    out
}

async fn migrate_client(client: &mut tokio_postgres::Client) -> Result<Migrated, StoreError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS khata_schema_migrations (
             version    integer PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )
    .await?;
    let from: i32 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM khata_schema_migrations",
            &[],
        )
        .await?
        .try_get(0)?;
    if from > SCHEMA_VERSION {
        return Err(unavailable(format!(
            "the database has khata schema version {from}, newer than this khata ({SCHEMA_VERSION}); upgrade khata"
        )));
    }
    for (i, sql) in MIGRATIONS
        .iter()
        .enumerate()
        .skip(usize::try_from(from).unwrap_or(0))
    {
        let version = i32::try_from(i + 1).unwrap_or(i32::MAX);
        tx.batch_execute(sql).await.map_err(|e| {
            unavailable(format!(
                "migration to schema version {version} failed: {}",
                describe(&e)
            ))
        })?;
        tx.execute(
            "INSERT INTO khata_schema_migrations (version) VALUES ($1)",
            &[&version],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(Migrated {
        from,
        to: SCHEMA_VERSION.max(from),
    })
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

/// Releases the dedup keys of `ids` that still point at their job and are
/// not held by `dedup_for` (compare-and-swap on the holder).
async fn release_dedup<C: GenericClient>(c: &C, ids: &[String], now: Millis) -> Result<(), Fail> {
    exec(
        c,
        "DELETE FROM dedup d USING jobs j \
         WHERE j.id = ANY($1::text[]) AND j.dedup_key IS NOT NULL \
           AND d.queue = j.queue AND d.key = j.dedup_key AND d.job_id = j.id \
           AND (d.hold_until IS NULL OR d.hold_until <= $2)",
        &[&ids, &now.0],
    )
    .await?;
    Ok(())
}

/// Takes the dedup key `(queue, key)` for the new job `id`, or returns the
/// job that holds it (live, or held by `dedup_for`).
async fn take_dedup_key<C: GenericClient>(
    c: &C,
    queue: &str,
    key: &str,
    id: &str,
    hold_until: Option<i64>,
    now: Millis,
) -> Result<Option<Job>, Fail> {
    for _ in 0..MAX_RERUNS {
        // Locking the key's row waits for a concurrent enqueue that holds it;
        // the holder's job is then read in a later statement, whose snapshot
        // sees that enqueue's commit.
        let row = row_opt(
            c,
            "SELECT job_id, hold_until FROM dedup WHERE queue = $1 AND key = $2 FOR UPDATE",
            &[&queue, &key],
        )
        .await?;
        if let Some(r) = row {
            let holder_id: String = r.try_get(0)?;
            let held: Option<i64> = r.try_get(1)?;
            if let Some(holder) = load_job(c, &holder_id, now).await?
                && (holder.state.is_live() || held.is_some_and(|h| h > now.0))
            {
                return Ok(Some(holder));
            }
            exec(
                c,
                "UPDATE dedup SET job_id = $3, hold_until = $4 WHERE queue = $1 AND key = $2",
                &[&queue, &key, &id, &hold_until],
            )
            .await?;
            return Ok(None);
        }
        let inserted = exec(
            c,
            "INSERT INTO dedup (queue, key, job_id, hold_until) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (queue, key) DO NOTHING",
            &[&queue, &key, &id, &hold_until],
        )
        .await?;
        if inserted == 1 {
            return Ok(None);
        }
        // A concurrent enqueue took the key and committed: look again.
    }
    Err(Fail::Rerun(format!(
        "dedup key {key:?} of queue {queue:?} kept changing"
    )))
}

async fn enqueue_one<C: GenericClient>(
    c: &C,
    job: &NewJob,
    index: usize,
    now: Millis,
) -> Result<Enqueued, Fail> {
    if let Some(id) = &job.id
        && let Some(existing) = load_job(c, id, now).await?
    {
        if crate::job::same_payload(&existing.payload, &job.payload) && existing.queue == job.queue
        {
            return Ok(Enqueued {
                job: existing,
                deduplicated: true,
            });
        }
        return Err(Fail::Store(StoreError::IdReused {
            id: id.clone(),
            index,
        }));
    }
    let id = job
        .id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    if let Some(key) = &job.dedup_key {
        let hold_until = job.dedup_for.map(|d| now.plus(d).0);
        if let Some(holder) = take_dedup_key(c, &job.queue, key, &id, hold_until, now).await? {
            return Ok(Enqueued {
                job: holder,
                deduplicated: true,
            });
        }
    }
    let max_attempts = i32_of(job.max_attempts);
    let inserted = exec(
        c,
        "INSERT INTO jobs (id, queue, state, payload, priority, run_at, max_attempts, dedup_key, enqueued_at) \
         VALUES ($1, $2, 'waiting', $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING",
        &[
            &id,
            &job.queue,
            &job.payload,
            &job.priority,
            &job.run_at.0,
            &max_attempts,
            &job.dedup_key,
            &now.0,
        ],
    )
    .await?;
    if inserted == 0 {
        // A concurrent enqueue of this id committed first. Rerun the whole
        // step: it then finds that job like any existing id.
        return Err(Fail::Rerun(format!(
            "a concurrent enqueue created job {id:?}"
        )));
    }
    // The row just written, without reading it back.
    Ok(Enqueued {
        job: Job {
            id,
            queue: job.queue.clone(),
            state: visible_state(JobState::Waiting, job.run_at, now),
            payload: job.payload.clone(),
            priority: job.priority,
            attempt: 0,
            budget_used: 0,
            max_attempts: job.max_attempts,
            dedup_key: job.dedup_key.clone(),
            run_at: job.run_at,
            enqueued_at: now,
            finished_at: None,
            result: None,
            last_error: None,
            attempts: Vec::new(),
        },
        deduplicated: false,
    })
}

/// Enqueues a batch. A batch without dedup keys whose ids are distinct is
/// inserted in one statement (`ON CONFLICT (id) DO NOTHING`, in the
/// batch's order, so that `seq` keeps it); the ids it did not insert
/// existed (or a concurrent enqueue committed them first, which the insert
/// waited for) and are read back in one more statement: the same payload
/// and queue is that job, deduplicated; anything else is `IdReused`. Other
/// batches go job by job ([`enqueue_one`]), since a job's dedup key or id
/// may name one enqueued before it in the batch.
async fn enqueue_batch<C: GenericClient>(
    c: &C,
    jobs: &[NewJob],
    now: Millis,
) -> Result<Vec<Enqueued>, Fail> {
    let mut named = std::collections::HashSet::new();
    let one_statement = jobs
        .iter()
        .all(|j| j.dedup_key.is_none() && j.id.as_deref().is_none_or(|id| named.insert(id)));
    if !one_statement {
        let mut out = Vec::with_capacity(jobs.len());
        for (i, j) in jobs.iter().enumerate() {
            out.push(enqueue_one(c, j, i, now).await?);
        }
        return Ok(out);
    }
    let ids: Vec<String> = jobs
        .iter()
        .map(|j| {
            j.id.clone()
                .unwrap_or_else(|| uuid::Uuid::now_v7().to_string())
        })
        .collect();
    let queues: Vec<&str> = jobs.iter().map(|j| j.queue.as_str()).collect();
    let payloads: Vec<&str> = jobs.iter().map(|j| j.payload.as_str()).collect();
    let priorities: Vec<i32> = jobs.iter().map(|j| j.priority).collect();
    let run_ats: Vec<i64> = jobs.iter().map(|j| j.run_at.0).collect();
    let max_attempts: Vec<i32> = jobs.iter().map(|j| i32_of(j.max_attempts)).collect();
    let inserted = rows(
        c,
        "INSERT INTO jobs (id, queue, state, payload, priority, run_at, max_attempts, enqueued_at) \
         SELECT v.id, v.queue, 'waiting', v.payload, v.priority, v.run_at, v.max_attempts, $7 \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[], $5::bigint[], $6::integer[]) \
             WITH ORDINALITY AS v(id, queue, payload, priority, run_at, max_attempts, n) \
         ORDER BY v.n \
         ON CONFLICT (id) DO NOTHING RETURNING id",
        &[
            &ids,
            &queues,
            &payloads,
            &priorities,
            &run_ats,
            &max_attempts,
            &now.0,
        ],
    )
    .await?;
    let inserted: std::collections::HashSet<String> = inserted
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<_, _>>()?;
    let mut existing = std::collections::HashMap::new();
    if inserted.len() < ids.len() {
        let others: Vec<&str> = ids
            .iter()
            .filter(|id| !inserted.contains(*id))
            .map(String::as_str)
            .collect();
        let found = rows(
            c,
            &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ANY($1::text[])"),
            &[&others],
        )
        .await?;
        for r in &found {
            let job = job_from_row(r, now)?;
            existing.insert(job.id.clone(), job);
        }
    }
    let mut out = Vec::with_capacity(jobs.len());
    for (index, (job, id)) in jobs.iter().zip(ids).enumerate() {
        if !inserted.contains(&id) {
            let Some(found) = existing.remove(&id) else {
                // Gone again since the conflict (swept): the rerun creates it.
                return Err(Fail::Rerun(format!(
                    "job {id:?} vanished during its enqueue"
                )));
            };
            if crate::job::same_payload(&found.payload, &job.payload) && found.queue == job.queue {
                out.push(Enqueued {
                    job: found,
                    deduplicated: true,
                });
                continue;
            }
            return Err(Fail::Store(StoreError::IdReused { id, index }));
        }
        // The row just written, without reading it back.
        out.push(Enqueued {
            job: Job {
                id,
                queue: job.queue.clone(),
                state: visible_state(JobState::Waiting, job.run_at, now),
                payload: job.payload.clone(),
                priority: job.priority,
                attempt: 0,
                budget_used: 0,
                max_attempts: job.max_attempts,
                dedup_key: None,
                run_at: job.run_at,
                enqueued_at: now,
                finished_at: None,
                result: None,
                last_error: None,
                attempts: Vec::new(),
            },
            deduplicated: false,
        });
    }
    Ok(out)
}

/// The attempts of queue `$1` in flight at `$at` (an SQL scalar subquery):
/// unexpired leases, except the tokens of the `bigint[]` parameter
/// `$ending` (attempts of this daemon whose finishes are on their way) while
/// no daemon waits for room in the queue. See [`lease_step`].
macro_rules! in_flight_sql {
    ($at:literal, $ending:literal) => {
        concat!(
            "(SELECT COUNT(*) FROM jobs WHERE queue = $1 AND state = 'active' AND lease_expires_at > ",
            $at,
            " AND (lease_token <> ALL(",
            $ending,
            "::bigint[]) OR EXISTS (SELECT 1 FROM queue_waits WHERE queue = $1)))"
        )
    };
}

/// The lease, in one statement: it counts the queue's attempts in flight
/// (`$3`, the concurrency, not NULL) and its starts in the window (`$4`, the
/// window in ms, above 0; `$5` starts at most in it), leases what is left of
/// `$2` from the head of the ready order (`FOR UPDATE SKIP LOCKED`), gives
/// the leased jobs tokens from `fencing_tokens` that grow in delivery order,
/// opens their attempts (started at `$6` on the caller's clock and at `t` on
/// the database's), records their starts for the rate limit, and records a
/// wait when the concurrency leaves no room. Other parameters: `$1` the
/// queue, `$7` the owner, `$8` the lease in ms, `$9` the plugin version,
/// `$10` the ending tokens (see [`in_flight_sql`]).
///
/// The jobs are moved by their ids as an array (an index scan of the
/// primary key whatever the plan's guess of how many were picked: a join
/// with `picked` would be planned for the unknown `LIMIT`'s default share
/// of the queue and scan the whole table).
///
/// One row for each job leased, in delivery order, or one row with NULL job
/// columns: `t`, the room by concurrency and by rate, the start whose exit
/// from the window gives room again (only when the rate limit binds), then
/// the job's id, payload, attempt, max attempts, enqueue time and token.
const LEASE_SQL: &str = concat!(
    "WITH t AS MATERIALIZED (SELECT clock_timestamp() AS t), \
     n AS MATERIALIZED (SELECT t.t, \
         CASE WHEN $3::bigint IS NULL THEN 0 ELSE ",
    in_flight_sql!("t.t", "$10"),
    " END AS active, \
         CASE WHEN $4::bigint > 0 THEN (SELECT COUNT(*) FROM queue_starts WHERE queue = $1 \
             AND at > t.t - $4::bigint * interval '1 millisecond') ELSE 0 END AS started \
         FROM t), \
     r AS MATERIALIZED (SELECT n.t, n.started, \
         CASE WHEN $3::bigint IS NULL THEN $2::bigint ELSE GREATEST($3::bigint - n.active, 0) END AS by_conc, \
         CASE WHEN $4::bigint > 0 THEN GREATEST($5::bigint - n.started, 0) ELSE $2::bigint END AS by_rate \
         FROM n), \
     picked AS MATERIALIZED (SELECT id, priority, run_at, seq FROM jobs \
         WHERE queue = $1 AND state = 'waiting' AND run_at <= $6 \
         ORDER BY priority DESC, run_at, seq \
         LIMIT (SELECT LEAST($2::bigint, by_conc, by_rate) FROM r) FOR UPDATE SKIP LOCKED), \
     ordered AS (SELECT id, row_number() OVER (ORDER BY priority DESC, run_at, seq) AS k FROM picked), \
     tokens AS (SELECT row_number() OVER (ORDER BY token) AS k, token \
         FROM (SELECT nextval('fencing_tokens') AS token FROM picked) s), \
     assigned AS MATERIALIZED (SELECT o.id, tk.token FROM ordered o JOIN tokens tk ON tk.k = o.k), \
     leased AS (UPDATE jobs j SET state = 'active', attempt = j.attempt + 1, \
             budget_used = j.budget_used + 1, \
             lease_token = (SELECT a.token FROM assigned a WHERE a.id = j.id), lease_owner = $7, \
             lease_expires_at = clock_timestamp() + $8::bigint * interval '1 millisecond' \
         WHERE j.id = ANY (ARRAY(SELECT id FROM assigned)) \
         RETURNING j.id, j.payload, j.attempt, j.max_attempts, j.enqueued_at, j.lease_token), \
     opened AS (INSERT INTO attempts (job_id, number, token, started_at, outcome, plugin_version, leased_at) \
         SELECT id, attempt, lease_token, $6, 'running', $9, (SELECT t FROM t) FROM leased), \
     aged AS (DELETE FROM queue_starts WHERE $4::bigint > 0 AND queue = $1 \
         AND at <= (SELECT t FROM t) - $4::bigint * interval '1 millisecond' \
         AND EXISTS (SELECT 1 FROM leased)), \
     counted AS (INSERT INTO queue_starts (queue, at) \
         SELECT $1, (SELECT t FROM t) FROM leased WHERE $4::bigint > 0), \
     waited AS (INSERT INTO queue_waits (queue) SELECT $1 FROM r \
         WHERE r.by_conc = 0 AND $2::bigint > 0 AND NOT ($4::bigint > 0 AND r.by_rate <= r.by_conc) \
         ON CONFLICT DO NOTHING) \
     SELECT r.t, r.by_conc, r.by_rate, \
         CASE WHEN LEAST($2::bigint, r.by_conc, r.by_rate) < $2::bigint AND $4::bigint > 0 \
             AND r.by_rate <= r.by_conc THEN (SELECT at FROM queue_starts WHERE queue = $1 \
                 AND at > r.t - $4::bigint * interval '1 millisecond' \
                 ORDER BY at OFFSET GREATEST(r.started - $5::bigint, 0) LIMIT 1) END, \
         l.id, l.payload, l.attempt, l.max_attempts, l.enqueued_at, l.lease_token \
     FROM r LEFT JOIN leased l ON true ORDER BY l.lease_token"
);

/// Counts the attempts of queue `$1` in flight now ([`in_flight_sql`],
/// `$2` the ending tokens).
const IN_FLIGHT_SQL: &str = concat!("SELECT ", in_flight_sql!("clock_timestamp()", "$2"));

/// Takes a queue's limited leases one at a time across daemons
/// ([`lease_step`]).
const QUEUE_LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1, hashtext($2))";

/// The lease of up to `max` jobs of `queue` for `owner`, within `limits`
/// ([`LEASE_SQL`]).
///
/// With limits, it first takes the queue's transaction advisory lock, held
/// to its commit: the limited leases of one queue run one at a time, on
/// every daemon, so what this one counts (the queue's attempts in flight,
/// its starts in the window) cannot change before it commits its own
/// leases, except downwards (an attempt ends, a lease expires). The lease
/// statement after the lock sees every lease committed before the lock was
/// granted (READ COMMITTED: a snapshot per statement). Times are the
/// database's: `t`, read once under the lock, is the start of every attempt
/// leased here, and later than every start already recorded.
///
/// In flight: an unexpired lease, except the attempts in `ending` (this
/// daemon's, whose handlers have ended and whose finishes are on their
/// way). Other daemons' ending attempts count until their finishes commit:
/// the bound is never looser than the handlers running. While a daemon
/// waits for room (a row in `queue_waits`), `ending` counts too: the
/// daemon whose attempts end would otherwise take their room again before
/// their commit wakes the waiting ones, and keep the queue to itself.
#[allow(clippy::too_many_arguments)]
async fn lease_step<C: GenericClient>(
    c: &C,
    queue: &str,
    max: u32,
    plugin_version: &str,
    now: Millis,
    (owner, lease_ms): (&str, i64),
    limits: &LeaseLimits,
    ending: &[i64],
) -> Result<Leased, Fail> {
    let concurrency = limits.concurrency.map(i64::from);
    let (per_ms, per_max) = limits.rate.map_or((0, 0), |r| {
        (
            i64::try_from(r.per.as_millis()).unwrap_or(i64::MAX),
            i64::from(r.max),
        )
    });
    let max_rows = i64::from(max);
    let params: Params<'_> = &[
        &queue,
        &max_rows,
        &concurrency,
        &per_ms,
        &per_max,
        &now.0,
        &owner,
        &lease_ms,
        &plugin_version,
        &ending,
    ];
    let lease = c.prepare_cached(LEASE_SQL).await?;
    let found = if limits.concurrency.is_some() || limits.rate.is_some() {
        let lock = c.prepare_cached(QUEUE_LOCK_SQL).await?;
        let key: Params<'_> = &[&QUEUE_LOCK, &queue];
        // Pipelined: both are sent at once (first polled, first sent) and
        // the server runs them in that order, so the lease's snapshot is
        // taken after the lock was granted.
        let (_, found) = tokio::try_join!(c.execute(&lock, key), c.query(&lease, params))?;
        found
    } else {
        c.query(&lease, params).await?
    };
    let first = found.first().ok_or_else(|| unavailable("no row"))?;
    let t: SystemTime = first.try_get(0)?;
    let room = |v: i64| u32::try_from(v).unwrap_or(u32::MAX);
    let by_conc = room(first.try_get(1)?);
    let by_rate = room(first.try_get(2)?);
    let oldest: Option<SystemTime> = first.try_get(3)?;
    let want = max.min(by_conc).min(by_rate);
    let held = match limits.rate {
        _ if want == max => None,
        // `by_rate < max`: there is a rate limit, and it binds. Room comes
        // back when the start `max` places before the newest leaves the
        // window.
        Some(w) if by_rate <= by_conc => {
            let wait = oldest.map_or(Duration::ZERO, |at| {
                (at + w.per).duration_since(t).unwrap_or_default()
            });
            Some(Held::Rate(wait.max(Duration::from_millis(1))))
        }
        _ => Some(Held::Concurrency),
    };
    let mut leases = Vec::with_capacity(found.len());
    for r in &found {
        let Some(job_id) = r.try_get::<_, Option<String>>(4)? else {
            break;
        };
        leases.push(Lease {
            job_id,
            queue: queue.to_owned(),
            payload: r.try_get(5)?,
            attempt: u32_of(r.try_get(6)?),
            max_attempts: u32_of(r.try_get(7)?),
            enqueued_at: Millis(r.try_get(8)?),
            token: u64_of(r.try_get(9)?),
        });
    }
    Ok(Leased { leases, held })
}

/// Wakes the daemons waiting for room in `queues`' concurrency, once per
/// wait: attempts of theirs ended. Run after, never inside, the transaction
/// that ended them, in a statement of its own (no write, hence no flush,
/// unless a daemon waits).
///
/// No wake-up is lost, and an attempt's end never waits for a limited
/// lease's lock: a lease held back records its wait, commits, and only then
/// counts again (`lease_within`). Either this statement ran after that
/// wait's commit, and sees it, or it ran before, hence after the attempts'
/// end committed, and that second count no longer holds them.
async fn wake_waiting(pool: &Pool, target: &str, queues: &[String]) -> Result<(), StoreError> {
    if queues.is_empty() {
        return Ok(());
    }
    let client = pool_client(pool, target).await?;
    rows(
        &client,
        "WITH w AS (DELETE FROM queue_waits WHERE queue = ANY($1::text[]) RETURNING queue) \
         SELECT pg_notify($2, queue) FROM w",
        &[&queues, &WAKE_CHANNEL],
    )
    .await
    .map_err(store_err)?;
    Ok(())
}

/// Moves a job to a final state (completed, dead, cancelled).
async fn end_job<C: GenericClient>(
    c: &C,
    id: &str,
    state: JobState,
    result: Option<&str>,
    error: Option<&str>,
    now: Millis,
) -> Result<(), Fail> {
    exec(
        c,
        "UPDATE jobs SET state = $2, finished_at = $3, result = COALESCE($4, result), \
         last_error = COALESCE($5, last_error), lease_token = NULL WHERE id = $1",
        &[&id, &state.as_str(), &now.0, &result, &error],
    )
    .await?;
    release_dedup(c, &[id.to_owned()], now).await
}

/// Finishes grouped in one transaction at most.
const FINISH_BATCH: usize = 64;

/// One [`Store::finish`] waiting for the finisher; `answer` is sent after
/// the COMMIT that holds it (or with the error that kept it from one).
struct FinishReq {
    lease: LeaseRef,
    finish: Finish,
    now: Millis,
    answer: tokio::sync::oneshot::Sender<Result<JobState, StoreError>>,
}

/// The group commit of finishes: takes every finish waiting (up to
/// [`FINISH_BATCH`], each job at most once) and applies them in one
/// transaction, so that they share its round trips and its WAL flush; each
/// caller hears after that COMMIT. Ends when the store is dropped (every
/// sender gone) and the channel is drained.
async fn finisher(
    pool: Pool,
    target: String,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<FinishReq>,
) {
    let mut waiting: Vec<FinishReq> = Vec::new();
    loop {
        if waiting.is_empty() {
            match rx.recv().await {
                Some(r) => waiting.push(r),
                None => return,
            }
        }
        while waiting.len() < FINISH_BATCH {
            match rx.try_recv() {
                Ok(r) => waiting.push(r),
                Err(_) => break,
            }
        }
        // A second finish of a job in the group (a stale attempt's and its
        // successor's) waits for the next group: a group locks each job once.
        let mut ids = std::collections::HashSet::new();
        let (group, later): (Vec<FinishReq>, Vec<FinishReq>) = waiting
            .drain(..)
            .partition(|r| ids.insert(r.lease.job_id.clone()));
        waiting = later;
        finish_group(&pool, &target, group).await;
    }
}

/// Applies `group` in one transaction and answers each finish. A group that
/// lost a race (deadlock) is rerun whole; one that failed for another
/// reason while the connection stayed up (a statement refused) is applied
/// again one finish per transaction, so that one finish's error is its
/// own; a lost connection fails every finish of the group (`Unavailable`:
/// the COMMIT may or may not have happened).
async fn finish_group(pool: &Pool, target: &str, group: Vec<FinishReq>) {
    let outcome = finish_tx(pool, target, &group).await;
    let mut wake = std::collections::BTreeSet::new();
    match outcome {
        Ok((answers, queues)) => {
            wake.extend(queues);
            for (r, a) in group.into_iter().zip(answers) {
                let _ = r.answer.send(a);
            }
        }
        Err((_, true)) if group.len() > 1 => {
            for r in group {
                let a = match finish_tx(pool, target, std::slice::from_ref(&r)).await {
                    Ok((mut a, queues)) => {
                        wake.extend(queues);
                        a.pop().unwrap_or_else(|| Err(unavailable("no answer")))
                    }
                    Err((e, _)) => Err(e),
                };
                let _ = r.answer.send(a);
            }
        }
        Err((e, _)) => {
            for r in group {
                let _ = r.answer.send(Err(e.clone()));
            }
        }
    }
    let wake: Vec<String> = wake.into_iter().collect();
    if let Err(e) = wake_waiting(pool, target, &wake).await {
        // The waiting daemons look again at their slow poll.
        tracing::debug!(error = %e, "could not wake the daemons waiting for room");
    }
}

/// The answer to each finish of a group, and the queues of the attempts
/// that ended (whose waiters to wake once it committed).
type Answers = (Vec<Result<JobState, StoreError>>, Vec<String>);

/// One transaction applying `group` (distinct jobs), rerun when it lost a
/// race. The error says whether the connection is still up, so that the
/// finishes may be tried one at a time.
async fn finish_tx(
    pool: &Pool,
    target: &str,
    group: &[FinishReq],
) -> Result<Answers, (StoreError, bool)> {
    let mut reruns = 0u32;
    loop {
        let mut client = pool_client(pool, target).await.map_err(|e| (e, false))?;
        let tx = begin(&mut client, Mode::Write)
            .await
            .map_err(|e| (e, false))?;
        match finish_statements(&tx, group).await {
            Ok(answers) => {
                return match tx.commit().await {
                    Ok(()) => Ok(answers),
                    Err(e) => Err((e.into(), false)),
                };
            }
            Err(Fail::Store(e)) => {
                let _ = tx.rollback().await;
                return Err((e, !client.is_closed()));
            }
            Err(Fail::Rerun(why)) => {
                let _ = tx.rollback().await;
                reruns += 1;
                if reruns > MAX_RERUNS {
                    return Err((
                        StoreError::Unavailable(format!(
                            "gave up after {MAX_RERUNS} conflicts with concurrent steps: {why}"
                        )),
                        false,
                    ));
                }
                tracing::debug!(reruns, reason = %why, "finishes lost a race; running them again");
                tokio::time::sleep(Duration::from_millis(u64::from(reruns.min(10)) * 2)).await;
            }
        }
    }
}

/// The attempts' ends of `group` (distinct jobs) in two statements: the jobs
/// read and locked in the order of their ids (so that groups of several
/// daemons never wait on each other in a cycle), then every write in one
/// statement. Per finish, `Fenced` when its attempt no longer holds the job
/// (its attempt record is closed all the same, and that part commits),
/// `NotFound` when there is no such job (nothing written).
async fn finish_statements<C: GenericClient>(c: &C, group: &[FinishReq]) -> Result<Answers, Fail> {
    let mut ids: Vec<&str> = group.iter().map(|r| r.lease.job_id.as_str()).collect();
    ids.sort_unstable();
    // The lease's expiry is compared on the clock after the row's lock.
    let locked = rows(
        c,
        "SELECT id, queue, state, budget_used, max_attempts, lease_token, dedup_key, \
             COALESCE(lease_expires_at > clock_timestamp(), false) \
         FROM (SELECT id, queue, state, budget_used, max_attempts, lease_token, dedup_key, \
                   lease_expires_at \
               FROM jobs WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE) j",
        &[&ids],
    )
    .await?;
    struct Locked {
        queue: String,
        state: JobState,
        budget_used: i32,
        max_attempts: i32,
        token: Option<i64>,
        dedup_key: Option<String>,
        unexpired: bool,
    }
    let mut jobs = std::collections::HashMap::with_capacity(locked.len());
    for r in &locked {
        let id: String = r.try_get(0)?;
        let state: String = r.try_get(2)?;
        jobs.insert(
            id,
            Locked {
                queue: r.try_get(1)?,
                state: stored_state(&state),
                budget_used: r.try_get(3)?,
                max_attempts: r.try_get(4)?,
                token: r.try_get(5)?,
                dedup_key: r.try_get(6)?,
                unexpired: r.try_get(7)?,
            },
        );
    }
    // Attempts to close.
    let mut a_job: Vec<&str> = Vec::new();
    let mut a_token: Vec<i64> = Vec::new();
    let mut a_outcome: Vec<&str> = Vec::new();
    let mut a_error: Vec<Option<String>> = Vec::new();
    let mut a_at: Vec<i64> = Vec::new();
    // Jobs to move; a NULL leaves the column as it is.
    let mut j_id: Vec<&str> = Vec::new();
    let mut j_state: Vec<&str> = Vec::new();
    let mut j_finished: Vec<Option<i64>> = Vec::new();
    let mut j_result: Vec<Option<String>> = Vec::new();
    let mut j_error: Vec<Option<String>> = Vec::new();
    let mut j_run_at: Vec<Option<i64>> = Vec::new();
    let mut j_refund: Vec<bool> = Vec::new();
    // Dedup keys to release (jobs that ended and had one).
    let mut d_queue: Vec<&str> = Vec::new();
    let mut d_key: Vec<&str> = Vec::new();
    let mut d_job: Vec<&str> = Vec::new();
    let mut d_at: Vec<i64> = Vec::new();
    // Queues whose concurrency waiters to wake, and queues with a job back
    // to waiting.
    let mut wake: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    let mut ready: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    let mut answers = Vec::with_capacity(group.len());
    for r in group {
        let (lease, now) = (&r.lease, r.now);
        let Some(job) = jobs.get(&lease.job_id) else {
            answers.push(Err(StoreError::NotFound(lease.job_id.clone())));
            continue;
        };
        let held = rules::Held {
            state: job.state,
            budget_used: u32_of(job.budget_used),
            max_attempts: u32_of(job.max_attempts),
            holds: rules::holds(job.state, job.token.map(u64_of), lease),
            expired: !job.unexpired,
        };
        let ending = rules::finish(held, r.finish.clone(), now);
        a_job.push(&lease.job_id);
        a_token.push(i64_of(lease.token));
        a_at.push(now.0);
        a_outcome.push(ending.outcome.as_str());
        answers.push(ending.answer(lease, now));
        a_error.push(ending.error);
        let Some(m) = ending.then else {
            continue;
        };
        wake.insert(&job.queue);
        let ends = m.ends();
        j_id.push(&lease.job_id);
        j_state.push(m.state.as_str());
        j_finished.push(ends.then_some(now.0));
        j_result.push(m.result);
        j_error.push(m.error);
        j_run_at.push(m.run_at.map(|t| t.0));
        j_refund.push(m.refund);
        if !ends {
            ready.insert(&job.queue);
        } else if let Some(key) = &job.dedup_key {
            d_queue.push(&job.queue);
            d_key.push(key);
            d_job.push(&lease.job_id);
            d_at.push(now.0);
        }
    }
    if a_job.is_empty() {
        return Ok((answers, Vec::new()));
    }
    let wake: Vec<String> = wake.into_iter().map(str::to_owned).collect();
    let ready: Vec<&str> = ready.into_iter().collect();
    // The data-modifying CTEs all run, each on its own table; the jobs'
    // UPDATE fires the count trigger once for the group.
    rows(
        c,
        "WITH a AS ( \
             UPDATE attempts t SET ended_at = v.at, outcome = v.outcome, error = v.error \
             FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::bigint[]) \
                 AS v(job_id, token, outcome, error, at) \
             WHERE t.job_id = v.job_id AND t.token = v.token AND t.ended_at IS NULL), \
         j AS ( \
             UPDATE jobs t SET state = v.state, finished_at = COALESCE(v.finished_at, t.finished_at), \
                 result = COALESCE(v.result, t.result), last_error = COALESCE(v.error, t.last_error), \
                 run_at = COALESCE(v.run_at, t.run_at), lease_token = NULL, \
                 budget_used = CASE WHEN v.refund THEN GREATEST(t.budget_used - 1, 0) \
                     ELSE t.budget_used END \
             FROM unnest($6::text[], $7::text[], $8::bigint[], $9::text[], $10::text[], \
                     $11::bigint[], $12::bool[]) \
                 AS v(id, state, finished_at, result, error, run_at, refund) \
             WHERE t.id = v.id), \
         d AS ( \
             DELETE FROM dedup t \
             USING unnest($13::text[], $14::text[], $15::text[], $16::bigint[]) AS v(queue, key, job_id, at) \
             WHERE t.queue = v.queue AND t.key = v.key AND t.job_id = v.job_id \
                 AND (t.hold_until IS NULL OR t.hold_until <= v.at)) \
         SELECT pg_notify($18, q) FROM unnest($17::text[]) AS n(q)",
        &[
            &a_job, &a_token, &a_outcome, &a_error, &a_at, &j_id, &j_state, &j_finished,
            &j_result, &j_error, &j_run_at, &j_refund, &d_queue, &d_key, &d_job, &d_at, &ready,
            &WAKE_CHANNEL,
        ],
    )
    .await?;
    Ok((answers, wake))
}

/// Tells every listening daemon that `queue` may have a ready job; sent
/// when the step's transaction commits (once per queue and transaction).
async fn notify<C: GenericClient>(c: &C, queue: &str) -> Result<(), Fail> {
    exec(c, "SELECT pg_notify($1, $2)", &[&WAKE_CHANNEL, &queue]).await?;
    Ok(())
}

/// Reclaims at most `max` jobs whose lease expired (see
/// [`Store::reclaim_expired`]), and those leased by `owner` when given; rows
/// a step holds are skipped, for a later pass.
async fn reclaim_step<C: GenericClient>(
    c: &C,
    now: Millis,
    max: u32,
    why: &str,
    owner: Option<&str>,
) -> Result<u64, Fail> {
    let expired = rows(
        c,
        "SELECT id, queue, budget_used, max_attempts FROM jobs \
         WHERE state = 'active' AND (lease_expires_at IS NULL OR lease_expires_at <= clock_timestamp() \
             OR ($2::text IS NOT NULL AND lease_owner = $2)) \
         ORDER BY lease_expires_at NULLS FIRST LIMIT $1 FOR UPDATE SKIP LOCKED",
        &[&i64::from(max), &owner],
    )
    .await?;
    if expired.is_empty() {
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(expired.len());
    let mut back = Vec::new();
    let mut dead = Vec::new();
    let mut queues = std::collections::BTreeSet::new();
    for r in &expired {
        let id: String = r.try_get(0)?;
        let queue: String = r.try_get(1)?;
        let used: i32 = r.try_get(2)?;
        let max: i32 = r.try_get(3)?;
        ids.push(id.clone());
        // Every reclaimed job frees room in its queue's concurrency.
        queues.insert(queue);
        let m = rules::abandon(u32_of(used), u32_of(max), why, now);
        if m.ends() {
            dead.push((id, m.error));
        } else {
            back.push(id);
        }
    }
    exec(
        c,
        "UPDATE attempts SET ended_at = $2, outcome = 'abandoned', error = $3 \
         WHERE job_id = ANY($1::text[]) AND ended_at IS NULL",
        &[&ids, &now.0, &why],
    )
    .await?;
    if !back.is_empty() {
        exec(
            c,
            "UPDATE jobs SET state = 'waiting', run_at = $2, last_error = $3, lease_token = NULL, \
             lease_owner = NULL, lease_expires_at = NULL WHERE id = ANY($1::text[])",
            &[&back, &now.0, &why],
        )
        .await?;
    }
    for (id, error) in &dead {
        end_job(c, id, JobState::Dead, None, error.as_deref(), now).await?;
    }
    for q in &queues {
        notify(c, q).await?;
    }
    Ok(expired.len() as u64)
}

async fn cancel_step<C: GenericClient>(c: &C, id: &str, now: Millis) -> Result<(Job, bool), Fail> {
    let (job, _) = lock_job(c, id, now).await?;
    if !job.state.is_live() {
        return Err(Fail::Store(StoreError::InvalidState {
            id: id.to_owned(),
            state: job.state,
            wanted: "only a waiting, delayed or active job can be cancelled",
        }));
    }
    let was_active = job.state == JobState::Active;
    end_job(c, id, JobState::Cancelled, None, None, now).await?;
    let job = load_job(c, id, now)
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    Ok((job, was_active))
}

async fn retry_step<C: GenericClient>(c: &C, id: &str, now: Millis) -> Result<Job, Fail> {
    let (job, _) = lock_job(c, id, now).await?;
    if !matches!(job.state, JobState::Dead | JobState::Cancelled) {
        return Err(Fail::Store(StoreError::InvalidState {
            id: id.to_owned(),
            state: job.state,
            wanted: "only a dead or cancelled job can be retried",
        }));
    }
    exec(
        c,
        "UPDATE jobs SET state = 'waiting', run_at = $2, budget_used = 0, finished_at = NULL \
         WHERE id = $1",
        &[&id, &now.0],
    )
    .await?;
    // Take the dedup key back if no other job holds it.
    if let Some(key) = &job.dedup_key {
        exec(
            c,
            "INSERT INTO dedup (queue, key, job_id, hold_until) VALUES ($1, $2, $3, NULL) \
             ON CONFLICT (queue, key) DO NOTHING",
            &[&job.queue, key, &id],
        )
        .await?;
    }
    notify(c, &job.queue).await?;
    Ok(load_job(c, id, now)
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?)
}

async fn sweep_step<C: GenericClient>(
    c: &C,
    now: Millis,
    rules: &RetentionRules,
    limit: u32,
) -> Result<Swept, Fail> {
    let limit = i64::from(limit.min(MAX_SWEEP));
    let mut swept = Swept {
        jobs: sweep_jobs(
            c,
            now,
            "state IN ('completed', 'cancelled')",
            rules.jobs,
            limit,
        )
        .await?,
        dead_jobs: sweep_jobs(c, now, "state = 'dead'", rules.dead, limit).await?,
        ..Swept::default()
    };
    swept.fences = exec(
        c,
        "DELETE FROM fences WHERE (namespace, kind, key) IN \
         (SELECT namespace, kind, key FROM fences WHERE state = 'done' AND updated_at < $1 \
          LIMIT $2 FOR UPDATE SKIP LOCKED)",
        &[&now.minus(rules.fences).0, &limit],
    )
    .await?;
    // A dedup row whose hold expired and whose job is no longer live.
    swept.dedup_keys = exec(
        c,
        "DELETE FROM dedup WHERE (queue, key) IN (SELECT d.queue, d.key FROM dedup d \
           LEFT JOIN jobs j ON j.id = d.job_id \
           WHERE (d.hold_until IS NULL OR d.hold_until <= $1) \
             AND (j.id IS NULL OR j.state NOT IN ('waiting', 'active')) \
           LIMIT $2 FOR UPDATE OF d SKIP LOCKED)",
        &[&now.0, &limit],
    )
    .await?;
    swept.tombstones = exec(
        c,
        "DELETE FROM index_docs WHERE (collection, id) IN (SELECT collection, id FROM index_docs \
           WHERE document IS NULL AND updated_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
        &[&now.minus(rules.tombstones).0, &limit],
    )
    .await?;
    for (ns, keep) in &rules.kv {
        let room = limit.saturating_sub(i64::try_from(swept.kv).unwrap_or(i64::MAX));
        if room <= 0 {
            break;
        }
        swept.kv += exec(
            c,
            "DELETE FROM kv WHERE (namespace, key) IN (SELECT namespace, key FROM kv \
               WHERE namespace = $1 AND written_at < $2 LIMIT $3 FOR UPDATE SKIP LOCKED)",
            &[ns, &now.minus(*keep).0, &room],
        )
        .await?;
    }
    Ok(swept)
}

/// Removes up to `limit` jobs matching `state_filter` that finished before
/// `now - keep`, with their attempts and effects, releasing their dedup
/// keys. Returns how many.
async fn sweep_jobs<C: GenericClient>(
    c: &C,
    now: Millis,
    state_filter: &str,
    keep: Duration,
    limit: i64,
) -> Result<u64, Fail> {
    let ids: Vec<String> = rows(
        c,
        &format!(
            "SELECT id FROM jobs WHERE {state_filter} AND finished_at < $1 \
             LIMIT $2 FOR UPDATE SKIP LOCKED"
        ),
        &[&now.minus(keep).0, &limit],
    )
    .await?
    .iter()
    .map(|r| r.try_get(0))
    .collect::<Result<_, _>>()?;
    if !ids.is_empty() {
        release_dedup(c, &ids, now).await?;
        exec(
            c,
            "DELETE FROM attempts WHERE job_id = ANY($1::text[])",
            &[&ids],
        )
        .await?;
        exec(
            c,
            "DELETE FROM effects WHERE job_id = ANY($1::text[])",
            &[&ids],
        )
        .await?;
        exec(c, "DELETE FROM jobs WHERE id = ANY($1::text[])", &[&ids]).await?;
    }
    Ok(ids.len() as u64)
}

// -- kv and index -----------------------------------------------------------

/// A document (or tombstone) and its version; with `lock`, the row is locked.
async fn index_read<C: GenericClient>(
    c: &C,
    collection: &str,
    id: &str,
    lock: bool,
) -> Result<Option<(Option<String>, u64)>, Fail> {
    let sql = if lock {
        "SELECT document, version FROM index_docs WHERE collection = $1 AND id = $2 FOR UPDATE"
    } else {
        "SELECT document, version FROM index_docs WHERE collection = $1 AND id = $2"
    };
    match row_opt(c, sql, &[&collection, &id]).await? {
        Some(r) => Ok(Some((r.try_get(0)?, u64_of(r.try_get(1)?)))),
        None => Ok(None),
    }
}

async fn index_upsert_step<C: GenericClient>(
    c: &C,
    collection: &str,
    id: &str,
    document: &str,
    version: u64,
    now: Millis,
) -> Result<UpsertOutcome, Fail> {
    let v = i64_of(version);
    for _ in 0..MAX_RERUNS {
        let outcome = match index_read(c, collection, id, true).await? {
            Some((_, stored)) if stored > version => return Ok(UpsertOutcome::Stale),
            Some((Some(_), stored)) if stored == version => return Ok(UpsertOutcome::Unchanged),
            Some((None, stored)) if stored == version => return Ok(UpsertOutcome::Stale),
            Some((Some(_), _)) => UpsertOutcome::Updated,
            Some((None, _)) => UpsertOutcome::Inserted,
            None => {
                let inserted = exec(
                    c,
                    "INSERT INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT (collection, id) DO NOTHING",
                    &[&collection, &id, &v, &document, &now.0],
                )
                .await?;
                if inserted == 1 {
                    return Ok(UpsertOutcome::Inserted);
                }
                // A concurrent upsert created it: compare with that one.
                continue;
            }
        };
        exec(
            c,
            "UPDATE index_docs SET version = $3, document = $4, updated_at = $5 \
             WHERE collection = $1 AND id = $2",
            &[&collection, &id, &v, &document, &now.0],
        )
        .await?;
        return Ok(outcome);
    }
    Err(Fail::Rerun(format!(
        "index document {collection}/{id} kept changing"
    )))
}

async fn index_remove_step<C: GenericClient>(
    c: &C,
    collection: &str,
    id: &str,
    version: u64,
    now: Millis,
) -> Result<bool, Fail> {
    let v = i64_of(version);
    for _ in 0..MAX_RERUNS {
        let removed = match index_read(c, collection, id, true).await? {
            Some((_, stored)) if stored > version => return Ok(false),
            Some((doc, _)) => doc.is_some(),
            None => {
                let inserted = exec(
                    c,
                    "INSERT INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES ($1, $2, $3, NULL, $4) ON CONFLICT (collection, id) DO NOTHING",
                    &[&collection, &id, &v, &now.0],
                )
                .await?;
                if inserted == 1 {
                    return Ok(false);
                }
                continue;
            }
        };
        exec(
            c,
            "UPDATE index_docs SET version = $3, document = NULL, updated_at = $4 \
             WHERE collection = $1 AND id = $2",
            &[&collection, &id, &v, &now.0],
        )
        .await?;
        return Ok(removed);
    }
    Err(Fail::Rerun(format!(
        "index document {collection}/{id} kept changing"
    )))
}

// -- fences -----------------------------------------------------------------

fn fence_from_row(r: &Row) -> Result<Fence, Fail> {
    let state: String = r.try_get(3)?;
    Ok(Fence {
        id: FenceId {
            namespace: r.try_get(0)?,
            kind: r.try_get(1)?,
            key: r.try_get(2)?,
        },
        state: FenceState::parse(&state).unwrap_or(FenceState::Uncertain),
        fingerprint: r.try_get(4)?,
        job_id: r.try_get(5)?,
        attempt: u32_of(r.try_get(6)?),
        token: u64_of(r.try_get(7)?),
        result: r.try_get(8)?,
        created_at: Millis(r.try_get(9)?),
        updated_at: Millis(r.try_get(10)?),
    })
}

/// The fence, its row locked for update.
async fn lock_fence<C: GenericClient>(c: &C, id: &FenceId) -> Result<Option<Fence>, Fail> {
    const SQL: &str = "SELECT namespace, kind, key, state, fingerprint, job_id, attempt, token, result, \
         created_at, updated_at FROM fences WHERE namespace = $1 AND kind = $2 AND key = $3 FOR UPDATE";
    match row_opt(c, SQL, &[&id.namespace, &id.kind, &id.key]).await? {
        Some(r) => Ok(Some(fence_from_row(&r)?)),
        None => Ok(None),
    }
}

/// Whether the attempt that wrote `f` still holds its job.
async fn holder_alive<C: GenericClient>(c: &C, f: &Fence) -> Result<bool, Fail> {
    match check_lease(c, &rules::holder_lease(f), false).await {
        Ok(()) => Ok(true),
        Err(Fail::Store(e)) => Ok(rules::alive::<()>(Err(e))?),
        Err(e) => Err(e),
    }
}

fn invalid_fence(id: &FenceId, reason: impl Into<String>) -> Fail {
    Fail::Store(rules::invalid_fence(id, reason))
}

async fn fence_begin_step<C: GenericClient>(
    c: &C,
    lease: &LeaseRef,
    attempt: u32,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin, Fail> {
    check_lease(c, lease, true).await?;
    let inserted = exec(
        c,
        "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, token, created_at, updated_at) \
         VALUES ($1, $2, $3, 'started', $4, $5, $6, $7, $8, $8) \
         ON CONFLICT (namespace, kind, key) DO NOTHING",
        &[
            &id.namespace,
            &id.kind,
            &id.key,
            &fingerprint,
            &lease.job_id,
            &i32_of(attempt),
            &i64_of(lease.token),
            &now.0,
        ],
    )
    .await?;
    if inserted == 1 {
        return Ok(FenceBegin::Started);
    }
    let Some(f) = lock_fence(c, id).await? else {
        // Released between the insert and the read: start over.
        return Err(Fail::Rerun(format!(
            "fence {}/{}/{} was released meanwhile",
            id.namespace, id.kind, id.key
        )));
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive(c, &f).await?;
            rules::begin_if_alive(f, alive)
        }
    })
}

/// Locks a fence that `lease` may move on: started by that lease, or by an
/// attempt that died.
async fn owned_or_abandoned<C: GenericClient>(
    c: &C,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<Fence, Fail> {
    let (f, ask) = rules::may_move(lock_fence(c, id).await?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(c, &f).await?)?;
    }
    Ok(f)
}

/// Locks a `started` fence that `lease` itself holds (nobody took it over).
async fn held_by<C: GenericClient>(c: &C, lease: &LeaseRef, id: &FenceId) -> Result<Fence, Fail> {
    let f = owned_or_abandoned(c, lease, id).await?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
}

async fn set_fence<C: GenericClient>(
    c: &C,
    id: &FenceId,
    state: FenceState,
    lease: &LeaseRef,
    attempt: u32,
    result: Option<&[u8]>,
    now: Millis,
) -> Result<(), Fail> {
    exec(
        c,
        "UPDATE fences SET state = $4, job_id = $5, attempt = $6, token = $7, \
         result = COALESCE($8, result), updated_at = $9 \
         WHERE namespace = $1 AND kind = $2 AND key = $3",
        &[
            &id.namespace,
            &id.kind,
            &id.key,
            &state.as_str(),
            &lease.job_id,
            &i32_of(attempt),
            &i64_of(lease.token),
            &result,
            &now.0,
        ],
    )
    .await?;
    Ok(())
}

async fn delete_fence<C: GenericClient>(c: &C, id: &FenceId) -> Result<(), Fail> {
    exec(
        c,
        "DELETE FROM fences WHERE namespace = $1 AND kind = $2 AND key = $3",
        &[&id.namespace, &id.kind, &id.key],
    )
    .await?;
    Ok(())
}

async fn fence_resolve_step<C: GenericClient>(
    c: &C,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<(), Fail> {
    let f = lock_fence(c, id).await?.ok_or_else(|| {
        StoreError::NotFound(format!("fence {}/{}/{}", id.namespace, id.kind, id.key))
    })?;
    match f.state {
        FenceState::Done => {
            return Err(invalid_fence(id, "it is done; there is nothing to resolve"));
        }
        FenceState::Started if holder_alive(c, &f).await? => {
            return Err(invalid_fence(
                id,
                format!("a live attempt of job {:?} holds it", f.job_id),
            ));
        }
        FenceState::Started | FenceState::Uncertain => {}
    }
    match resolution {
        Resolution::Done => {
            exec(
                c,
                "UPDATE fences SET state = 'done', result = $4, updated_at = $5 \
                 WHERE namespace = $1 AND kind = $2 AND key = $3",
                &[
                    &id.namespace,
                    &id.kind,
                    &id.key,
                    &RESOLVED_BY_OPERATOR,
                    &now.0,
                ],
            )
            .await?;
        }
        Resolution::NotDone => delete_fence(c, id).await?,
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Several daemons: registration, heartbeat, wake-ups
// ---------------------------------------------------------------------------

impl PostgresStore {
    /// Records this daemon in `daemons`. Durable when it returns.
    async fn register(&self) -> Result<(), StoreError> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        let pid = i32::try_from(std::process::id()).unwrap_or(0);
        step!(self, Mode::Write, |tx| {
            exec(
                &tx,
                "INSERT INTO daemons (id, host, pid) VALUES ($1, $2, $3)",
                &[&self.daemon_id, &host, &pid],
            )
            .await?;
            Ok(())
        })
    }

    /// Renews this daemon's unexpired leases and its `daemons` row; returns
    /// the leases it held that are lost. Durable when it returns.
    async fn heartbeat_step(&self) -> Result<Vec<LeaseRef>, StoreError> {
        // Leases entered before the renewal began were committed before it,
        // so the renewal sees every one of them.
        let before: Vec<LeaseRef> = self
            .held
            .lock()
            .map(|h| h.keys().cloned().collect())
            .unwrap_or_default();
        let lease_ms = self.lease_ms();
        let ids: Vec<&str> = before.iter().map(|l| l.job_id.as_str()).collect();
        let tokens: Vec<i64> = before.iter().map(|l| i64_of(l.token)).collect();
        // Only the leases of attempts still running here: a lease whose
        // attempt ended without its finish committing is left to expire.
        let renewed: Vec<(String, i64)> = step!(self, Mode::Write, |tx| {
            exec(
                &tx,
                "UPDATE daemons SET heartbeat_at = clock_timestamp() WHERE id = $1",
                &[&self.daemon_id],
            )
            .await?;
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            let r = rows(
                &tx,
                "UPDATE jobs j SET lease_expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond' \
                 FROM unnest($2::text[], $3::bigint[]) AS v(id, token) \
                 WHERE j.id = v.id AND j.lease_token = v.token AND j.lease_owner = $1 \
                   AND j.state = 'active' AND j.lease_expires_at > clock_timestamp() \
                 RETURNING j.id, j.lease_token",
                &[&self.daemon_id, &ids, &tokens, &lease_ms],
            )
            .await?;
            r.iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get::<_, Option<i64>>(1)?.unwrap_or(0))))
                .collect::<Result<Vec<_>, Fail>>()
        })?;
        let renewed: std::collections::HashSet<(String, u64)> =
            renewed.into_iter().map(|(id, t)| (id, u64_of(t))).collect();
        let expired_by = std::time::Instant::now() + self.lease_duration();
        let mut lost = Vec::new();
        if let Ok(mut held) = self.held.lock() {
            for l in before {
                if renewed.contains(&(l.job_id.clone(), l.token)) {
                    // Still held in memory (its attempt has not ended): its
                    // new expiry was set before this answer.
                    if let Some(by) = held.get_mut(&l) {
                        *by = expired_by;
                    }
                } else if held.remove(&l).is_some() {
                    // Still held in memory and not renewed: lost.
                    lost.push(l);
                }
            }
        }
        Ok(lost)
    }

    /// Starts the wake-up listener (once) and returns its stream.
    fn start_listener(&self) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let task = AbortOnDrop(tokio::spawn(listen(self.cfg.clone(), tx)));
        if let Ok(mut l) = self.listener.lock() {
            *l = Some(task);
        }
        rx
    }
}

/// LISTENs on `khata_wake` on a connection of its own and forwards each
/// notification's queue name; after every (re)connection it sends `*`
/// (every queue), since notifications sent while it was not listening are
/// lost. Ends when the receiver is gone.
async fn listen(cfg: tokio_postgres::Config, tx: tokio::sync::mpsc::UnboundedSender<String>) {
    let target = target_of(&cfg);
    let mut connected_once = false;
    loop {
        match cfg.connect(NoTls).await {
            Ok((client, mut connection)) => {
                let (msg_tx, mut msg_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
                let driver = AbortOnDrop(tokio::spawn(async move {
                    loop {
                        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                            Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                                if msg_tx.send(n.payload().to_owned()).is_err() {
                                    return;
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => {
                                tracing::warn!(error = %describe(&e), "the wake-up connection to PostgreSQL failed");
                                return;
                            }
                            None => return,
                        }
                    }
                }));
                match client
                    .batch_execute(&format!("LISTEN {WAKE_CHANNEL}"))
                    .await
                {
                    Ok(()) => {
                        if connected_once {
                            tracing::info!(database = %target, "listening for wake-ups again");
                        }
                        connected_once = true;
                        if tx.send("*".to_owned()).is_err() {
                            return;
                        }
                        while let Some(queue) = msg_rx.recv().await {
                            if tx.send(queue).is_err() {
                                return;
                            }
                        }
                        tracing::warn!(database = %target, "the wake-up connection closed; connecting again (queues poll meanwhile)");
                    }
                    Err(e) => {
                        tracing::warn!(database = %target, error = %describe(&e), "cannot LISTEN for wake-ups");
                    }
                }
                drop(client);
                drop(driver);
            }
            Err(e) => {
                tracing::warn!(database = %target, error = %describe(&e), "cannot connect for wake-ups; queues poll meanwhile");
            }
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(LISTEN_RETRY).await;
    }
}

// ---------------------------------------------------------------------------
// The trait
// ---------------------------------------------------------------------------

#[async_trait]
impl Store for PostgresStore {
    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>, StoreError> {
        step!(self, Mode::Write, |tx| {
            let out = enqueue_batch(&tx, &jobs, now).await?;
            let mut queues = std::collections::BTreeSet::new();
            for (j, e) in jobs.iter().zip(&out) {
                if !e.deduplicated {
                    queues.insert(j.queue.as_str());
                }
            }
            for q in queues {
                notify(&tx, q).await?;
            }
            Ok(out)
        })
    }

    async fn lease(
        &self,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>, StoreError> {
        let leased = self
            .lease_within(queue, max, plugin_version, now, &LeaseLimits::default())
            .await?;
        Ok(leased.leases)
    }

    async fn lease_within(
        &self,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
        limits: &LeaseLimits,
    ) -> Result<Leased, StoreError> {
        let owner = (self.daemon_id.as_str(), self.lease_ms());
        let mut tries = 0;
        loop {
            let ending = self.ending();
            let leased = step!(self, Mode::Write, |tx| lease_step(
                &tx,
                queue,
                max,
                plugin_version,
                now,
                owner,
                limits,
                &ending
            )
            .await)?;
            self.hold(&leased.leases);
            tries += 1;
            // Held back by concurrency, with its wait committed: count again,
            // so that an attempt that ended before the wait was visible to
            // its waker (see `wake_waiting`) is not waited for.
            if leased.held != Some(Held::Concurrency)
                || !leased.leases.is_empty()
                || tries >= RECOUNTS
            {
                return Ok(leased);
            }
            let Some(limit) = limits.concurrency else {
                return Ok(leased);
            };
            let ending = self.ending();
            let client = self.client().await?;
            let r = row_opt(&client, IN_FLIGHT_SQL, &[&queue, &ending])
                .await
                .map_err(store_err)?;
            let in_flight = match r {
                Some(r) => u64_of(r.try_get(0)?),
                None => 0,
            };
            if in_flight >= u64::from(limit) {
                return Ok(leased);
            }
        }
    }

    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>, StoreError> {
        let client = self.client().await?;
        let r = row_opt(
            &client,
            "SELECT MIN(run_at) FROM jobs WHERE queue = $1 AND state = 'waiting'",
            &[&queue],
        )
        .await
        .map_err(store_err)?;
        Ok(match r {
            Some(r) => r.try_get::<_, Option<i64>>(0)?.map(Millis),
            None => None,
        })
    }

    /// Grouped with the finishes of other attempts by the finisher (see
    /// the module's notes). Durable when it returns `Ok` or `Fenced`: the
    /// COMMIT of the transaction holding it returned. `Unavailable`: it
    /// may or may not have committed.
    async fn finish(
        &self,
        lease: &LeaseRef,
        finish: Finish,
        now: Millis,
    ) -> Result<JobState, StoreError> {
        // A fenced finish still records how its attempt ended: that part
        // commits, then the fence is reported.
        let (answer, answered) = tokio::sync::oneshot::channel();
        let token = i64_of(lease.token);
        if let Ok(mut ending) = self.ending.lock() {
            ending.insert(token);
        }
        let req = FinishReq {
            lease: lease.clone(),
            finish,
            now,
            answer,
        };
        let r = match self.finishes.send(req) {
            Ok(()) => answered.await.unwrap_or_else(|_| {
                Err(unavailable(
                    "the PostgreSQL finisher stopped before answering",
                ))
            }),
            Err(_) => Err(unavailable("the PostgreSQL finisher has stopped")),
        };
        // Its attempt is over, whatever the answer: the lease is renewed no
        // more (if the finish did not commit, the lease expires and another
        // pass reclaims the job, counted in flight until then).
        self.release(lease);
        if let Ok(mut ending) = self.ending.lock() {
            ending.remove(&token);
        }
        r
    }

    /// Expired leases, and this store's own: jobs leased by other live
    /// daemons are theirs. A job this daemon's previous run (another id)
    /// left active is reclaimed once its lease expires, by
    /// [`Store::reclaim_expired`]. This store's own leases exist only when
    /// it leased before recovering, which stands for a restart of this
    /// daemon: they are abandoned too.
    async fn recover(&self, now: Millis) -> Result<u64, StoreError> {
        if let Ok(mut held) = self.held.lock() {
            held.clear();
        }
        let mut total = 0;
        let me = Some(self.daemon_id.as_str());
        loop {
            let n = step!(self, Mode::Write, |tx| reclaim_step(
                &tx,
                now,
                RECLAIM_BATCH,
                ABANDONED,
                me
            )
            .await)?;
            total += n;
            if n < u64::from(RECLAIM_BATCH) {
                return Ok(total);
            }
        }
    }

    async fn heartbeat(&self) -> Result<Vec<LeaseRef>, StoreError> {
        self.heartbeat_step().await
    }

    /// Measured on this process's monotonic clock from the answer of the
    /// statement that last set each lease's expiry: the database set it
    /// to `lease` after a moment before that answer, so once `lease` has
    /// passed here it has passed there (clock rates agree; their readings
    /// need not).
    fn leases_past_expiry(&self) -> Vec<LeaseRef> {
        let now = std::time::Instant::now();
        let Ok(mut held) = self.held.lock() else {
            return Vec::new();
        };
        let lost: Vec<LeaseRef> = held
            .iter()
            .filter(|(_, by)| **by <= now)
            .map(|(l, _)| l.clone())
            .collect();
        for l in &lost {
            held.remove(l);
        }
        lost
    }

    async fn reclaim_expired(&self, now: Millis) -> Result<u64, StoreError> {
        step!(self, Mode::Write, |tx| reclaim_step(
            &tx,
            now,
            RECLAIM_BATCH,
            LEASE_EXPIRED,
            None
        )
        .await)
    }

    fn wakeups(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<String>> {
        Some(self.start_listener())
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
        let (job, was_active) = step!(self, Mode::Write, |tx| cancel_step(&tx, id, now).await)?;
        if was_active
            && let Err(e) =
                wake_waiting(&self.pool, &self.target, std::slice::from_ref(&job.queue)).await
        {
            // The waiting daemons look again at their slow poll.
            tracing::debug!(error = %e, queue = %job.queue, "could not wake the daemons waiting for room");
        }
        Ok((job, was_active))
    }

    async fn retry(&self, id: &str, now: Millis) -> Result<Job, StoreError> {
        step!(self, Mode::Write, |tx| retry_step(&tx, id, now).await)
    }

    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>, StoreError> {
        step!(self, Mode::Read, |tx| {
            let Some(mut job) = load_job(&tx, id, now).await? else {
                return Ok(None);
            };
            job.attempts = load_attempts(&tx, id).await?;
            Ok(Some(job))
        })
    }

    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage, StoreError> {
        let limit = filter.limit.clamp(1, 1000);
        let cursor: i64 = match &filter.cursor {
            Some(s) => s
                .parse()
                .map_err(|_| StoreError::NotFound(format!("cursor {s:?}")))?,
            None => i64::MAX,
        };
        let mut sql = " FROM jobs WHERE seq < $1".to_owned();
        let mut args: Vec<Box<dyn ToSql + Sync + Send>> = vec![Box::new(cursor)];
        if let Some(q) = &filter.queue {
            args.push(Box::new(q.clone()));
            sql.push_str(&format!(" AND queue = ${}", args.len()));
        }
        match filter.state {
            Some(JobState::Delayed) => {
                args.push(Box::new(now.0));
                sql.push_str(&format!(
                    " AND state = 'waiting' AND run_at > ${}",
                    args.len()
                ));
            }
            Some(JobState::Waiting) => {
                args.push(Box::new(now.0));
                sql.push_str(&format!(
                    " AND state = 'waiting' AND run_at <= ${}",
                    args.len()
                ));
            }
            Some(s) => {
                args.push(Box::new(s.as_str().to_owned()));
                sql.push_str(&format!(" AND state = ${}", args.len()));
            }
            None => {}
        }
        args.push(Box::new(i64::from(limit)));
        sql.push_str(&format!(" ORDER BY seq DESC LIMIT ${}", args.len()));
        let params: Vec<&(dyn ToSql + Sync)> =
            args.iter().map(|a| &**a as &(dyn ToSql + Sync)).collect();
        let client = self.client().await?;
        // The rows' sizes first (no payload crosses the wire), so that the
        // page's rows are fetched only as far as PAGE_BYTES reaches: a
        // query's rows arrive whole.
        let sizes = rows(
            &client,
            &format!(
                "SELECT octet_length(payload) + coalesce(octet_length(result), 0)                  + coalesce(octet_length(last_error), 0){sql}"
            ),
            &params,
        )
        .await
        .map_err(store_err)?;
        let mut bytes = 0i64;
        let mut fit = 0usize;
        for r in &sizes {
            fit += 1;
            bytes += r.try_get::<_, i32>(0)? as i64;
            if bytes >= PAGE_BYTES as i64 {
                break;
            }
        }
        drop(params);
        let mut page = PageBuilder::new(limit);
        if fit > 0 {
            args.pop();
            args.push(Box::new(fit as i64));
            let params: Vec<&(dyn ToSql + Sync)> =
                args.iter().map(|a| &**a as &(dyn ToSql + Sync)).collect();
            let found = rows(&client, &format!("SELECT {JOB_COLUMNS}, seq{sql}"), &params)
                .await
                .map_err(store_err)?;
            for r in found.iter().take(fit) {
                if !page.has_room() {
                    break;
                }
                page.push(job_from_row(r, now).map_err(store_err)?, r.try_get(14)?);
            }
        }
        Ok(page.finish())
    }

    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>, StoreError> {
        step!(self, Mode::Read, |tx| {
            // The stored states come from the counters; `delayed` (waiting
            // with run_at in the future) is counted on the jobs_due index,
            // which costs what is delayed, not what is stored.
            let stored = rows(
                &tx,
                "SELECT queue, state, SUM(n)::bigint FROM job_counts GROUP BY queue, state \
                 HAVING SUM(n) > 0 ORDER BY queue, state",
                &[],
            )
            .await?;
            let mut out: Vec<(String, StateCounts)> = Vec::new();
            for r in &stored {
                let queue: String = r.try_get(0)?;
                let state: String = r.try_get(1)?;
                let n: i64 = r.try_get(2)?;
                if out.last().is_none_or(|(q, _)| *q != queue) {
                    out.push((queue, StateCounts::default()));
                }
                if let Some((_, counts)) = out.last_mut() {
                    counts.add(stored_state(&state), u64_of(n));
                }
            }
            for (queue, counts) in &mut out {
                if counts.waiting == 0 {
                    continue;
                }
                let n: i64 = rows(
                    &tx,
                    "SELECT COUNT(*) FROM jobs WHERE queue = $1 AND state = 'waiting' AND run_at > $2",
                    &[&queue.as_str(), &now.0],
                )
                .await?
                .first()
                .map(|r| r.try_get(0))
                .transpose()?
                .unwrap_or(0);
                let n = u64_of(n).min(counts.waiting);
                counts.waiting -= n;
                counts.delayed += n;
            }
            Ok(out)
        })
    }

    async fn sweep(
        &self,
        now: Millis,
        rules: &RetentionRules,
        limit: u32,
    ) -> Result<Swept, StoreError> {
        step!(self, Mode::Write, |tx| sweep_step(&tx, now, rules, limit)
            .await)
    }

    async fn kv_get(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.leased_read(
            lease,
            "SELECT value FROM kv WHERE namespace = $2 AND key = $3",
            ns,
            key,
        )
        .await
    }

    async fn kv_put(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
        value: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            exec(
                &tx,
                "INSERT INTO kv (namespace, key, value, written_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (namespace, key) DO UPDATE \
                 SET value = EXCLUDED.value, written_at = EXCLUDED.written_at",
                &[&ns, &key, &value, &now.0],
            )
            .await?;
            Ok(())
        })
    }

    async fn kv_insert_if_absent(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
        value: Vec<u8>,
        now: Millis,
    ) -> Result<bool, StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            let n = exec(
                &tx,
                "INSERT INTO kv (namespace, key, value, written_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (namespace, key) DO NOTHING",
                &[&ns, &key, &value, &now.0],
            )
            .await?;
            Ok(n == 1)
        })
    }

    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool, StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            let n = exec(
                &tx,
                "DELETE FROM kv WHERE namespace = $1 AND key = $2",
                &[&ns, &key],
            )
            .await?;
            Ok(n == 1)
        })
    }

    async fn index_upsert(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
        document: &str,
        version: u64,
        now: Millis,
    ) -> Result<UpsertOutcome, StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            index_upsert_step(&tx, collection, id, document, version, now).await
        })
    }

    async fn index_remove(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
        version: u64,
        now: Millis,
    ) -> Result<bool, StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            index_remove_step(&tx, collection, id, version, now).await
        })
    }

    async fn index_get_leased(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
    ) -> Result<Option<String>, StoreError> {
        // A tombstone's document is NULL, as is a missing one's.
        self.leased_read(
            lease,
            "SELECT document FROM index_docs WHERE collection = $2 AND id = $3",
            collection,
            id,
        )
        .await
    }

    async fn index_get(
        &self,
        collection: &str,
        id: &str,
    ) -> Result<Option<(String, u64)>, StoreError> {
        let client = self.client().await?;
        let found = index_read(&client, collection, id, false)
            .await
            .map_err(store_err)?;
        Ok(found.and_then(|(d, v)| d.map(|d| (d, v))))
    }

    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin, StoreError> {
        step!(self, Mode::Write, |tx| fence_begin_step(
            &tx,
            lease,
            attempt,
            id,
            fingerprint,
            now
        )
        .await)
    }

    async fn fence_take_over(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        now: Millis,
    ) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            owned_or_abandoned(&tx, lease, id).await?;
            set_fence(&tx, id, FenceState::Started, lease, attempt, None, now).await
        })
    }

    async fn fence_done(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            held_by(&tx, lease, id).await?;
            set_fence(
                &tx,
                id,
                FenceState::Done,
                lease,
                attempt,
                Some(&result),
                now,
            )
            .await
        })
    }

    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            held_by(&tx, lease, id).await?;
            delete_fence(&tx, id).await
        })
    }

    async fn fence_uncertain(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        now: Millis,
    ) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            owned_or_abandoned(&tx, lease, id).await?;
            set_fence(&tx, id, FenceState::Uncertain, lease, attempt, None, now).await
        })
    }

    async fn fence_resolve(
        &self,
        id: &FenceId,
        resolution: Resolution,
        now: Millis,
    ) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| fence_resolve_step(
            &tx, id, resolution, now
        )
        .await)
    }

    async fn fences(
        &self,
        namespace: Option<&str>,
        state: Option<FenceState>,
        limit: u32,
    ) -> Result<Vec<Fence>, StoreError> {
        let sql = format!(
            "SELECT {FENCE_COLUMNS} FROM fences WHERE ($1::text IS NULL OR namespace = $1) \
             AND ($2::text IS NULL OR state = $2) ORDER BY updated_at DESC LIMIT $3"
        );
        let client = self.client().await?;
        let found = rows(
            &client,
            &sql,
            &[
                &namespace,
                &state.map(FenceState::as_str),
                &i64::from(limit.clamp(1, 1000)),
            ],
        )
        .await
        .map_err(store_err)?;
        found
            .iter()
            .map(fence_from_row)
            .collect::<Result<_, _>>()
            .map_err(store_err)
    }

    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            exec(
                &tx,
                "INSERT INTO effects (job_id, attempt, kind, key, outcome, at) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[
                    &job_id,
                    &i32_of(record.attempt),
                    &record.kind,
                    &record.key,
                    &record.outcome,
                    &record.at.0,
                ],
            )
            .await?;
            Ok(())
        })
    }

    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
        let client = self.client().await?;
        let found = rows(
            &client,
            "SELECT attempt, kind, key, outcome, at FROM effects WHERE job_id = $1 \
             ORDER BY attempt, n",
            &[&job_id],
        )
        .await
        .map_err(store_err)?;
        found
            .iter()
            .map(|r| {
                Ok(EffectRecord {
                    attempt: u32_of(r.try_get(0)?),
                    kind: r.try_get(1)?,
                    key: r.try_get(2)?,
                    outcome: r.try_get(3)?,
                    at: Millis(r.try_get(4)?),
                })
            })
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(StoreError::from)
    }

    async fn export(
        &self,
        cursor: Option<copy::Cursor>,
        limit: u32,
    ) -> Result<copy::ExportPage, StoreError> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        step!(self, Mode::Read, |tx| export_page(&tx, &cursor, limit)
            .await)
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| import_page(&tx, &records).await)
    }
}

// ---------------------------------------------------------------------------
// Moving a ledger (`store::copy`)
// ---------------------------------------------------------------------------

use super::copy;

fn pg_placeholder(i: usize) -> String {
    format!("${i}")
}

/// The rows of one export page: the cursor's key parts, then the limit.
async fn page_rows<C: GenericClient>(
    c: &C,
    select: &str,
    keys: &[&str],
    cursor: &copy::Cursor,
    limit: u32,
) -> Result<Vec<Row>, Fail> {
    let sql = copy::page_sql(select, keys, &cursor.after, pg_placeholder)?;
    let limit = i64::from(limit);
    let mut params: Vec<&(dyn ToSql + Sync)> = cursor
        .after
        .iter()
        .map(|a| a as &(dyn ToSql + Sync))
        .collect();
    params.push(&limit);
    rows(c, &sql, &params).await
}

fn bad_row(what: String) -> Fail {
    Fail::Store(unavailable(format!("cannot export {what}")))
}

/// One page of the export (the caller's transaction is one snapshot).
async fn export_page<C: GenericClient>(
    c: &C,
    cursor: &copy::Cursor,
    limit: u32,
) -> Result<copy::ExportPage, Fail> {
    use copy::{Record, Section};
    let (records, last): (Vec<Record>, Vec<String>) = match cursor.section {
        Section::Jobs => {
            let found = page_rows(
                c,
                "SELECT id, queue, state, payload, priority, run_at, seq, attempt, budget_used, \
                 max_attempts, dedup_key, enqueued_at, finished_at, result, last_error, lease_token \
                 FROM jobs",
                &["id"],
                cursor,
                limit,
            )
            .await?;
            let mut jobs = Vec::with_capacity(found.len());
            for r in &found {
                let state: String = r.try_get(2)?;
                let id: String = r.try_get(0)?;
                jobs.push(copy::JobRecord {
                    state: state
                        .parse()
                        .map_err(|e| bad_row(format!("job {id:?}: {e}")))?,
                    id,
                    queue: r.try_get(1)?,
                    payload: r.try_get(3)?,
                    priority: r.try_get(4)?,
                    run_at: Millis(r.try_get(5)?),
                    seq: u64_of(r.try_get(6)?),
                    attempt: u32_of(r.try_get(7)?),
                    budget_used: u32_of(r.try_get(8)?),
                    max_attempts: u32_of(r.try_get(9)?),
                    dedup_key: r.try_get(10)?,
                    enqueued_at: Millis(r.try_get(11)?),
                    finished_at: r.try_get::<_, Option<i64>>(12)?.map(Millis),
                    result: r.try_get(13)?,
                    last_error: r.try_get(14)?,
                    lease_token: r.try_get::<_, Option<i64>>(15)?.map(u64_of),
                    attempts: Vec::new(),
                    effects: Vec::new(),
                });
            }
            let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
            let mut by_id: std::collections::HashMap<String, usize> = ids
                .iter()
                .enumerate()
                .map(|(i, id)| (id.clone(), i))
                .collect();
            for r in rows(
                c,
                "SELECT job_id, number, token, started_at, ended_at, outcome, error, plugin_version \
                 FROM attempts WHERE job_id = ANY($1::text[]) ORDER BY job_id, number",
                &[&ids],
            )
            .await?
            {
                let job_id: String = r.try_get(0)?;
                let number = u32_of(r.try_get(1)?);
                let outcome: String = r.try_get(5)?;
                let outcome = AttemptOutcome::parse(&outcome).ok_or_else(|| {
                    bad_row(format!(
                        "attempt {number} of job {job_id:?}: unknown outcome {outcome:?}"
                    ))
                })?;
                if let Some(&i) = by_id.get(&job_id) {
                    jobs[i].attempts.push(copy::AttemptRecord {
                        number,
                        token: u64_of(r.try_get(2)?),
                        started_at: Millis(r.try_get(3)?),
                        ended_at: r.try_get::<_, Option<i64>>(4)?.map(Millis),
                        outcome,
                        error: r.try_get(6)?,
                        plugin_version: r.try_get(7)?,
                    });
                }
            }
            for r in rows(
                c,
                "SELECT job_id, attempt, kind, key, outcome, at FROM effects \
                 WHERE job_id = ANY($1::text[]) ORDER BY job_id, attempt, n",
                &[&ids],
            )
            .await?
            {
                let job_id: String = r.try_get(0)?;
                if let Some(&i) = by_id.get(&job_id) {
                    jobs[i].effects.push(copy::EffectRow {
                        attempt: u32_of(r.try_get(1)?),
                        kind: r.try_get(2)?,
                        key: r.try_get(3)?,
                        outcome: r.try_get(4)?,
                        at: Millis(r.try_get(5)?),
                    });
                }
            }
            by_id.clear();
            let last = ids.last().map(|id| vec![id.clone()]).unwrap_or_default();
            (jobs.into_iter().map(Record::Job).collect(), last)
        }
        Section::Dedup => {
            let found = page_rows(
                c,
                "SELECT queue, key, job_id, hold_until FROM dedup",
                &["queue", "key"],
                cursor,
                limit,
            )
            .await?;
            let out = found
                .iter()
                .map(|r| {
                    Ok(copy::DedupRecord {
                        queue: r.try_get(0)?,
                        key: r.try_get(1)?,
                        job_id: r.try_get(2)?,
                        hold_until: r.try_get::<_, Option<i64>>(3)?.map(Millis),
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
            let last = out
                .last()
                .map(|d| vec![d.queue.clone(), d.key.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Dedup).collect(), last)
        }
        Section::Fences => {
            let found = page_rows(
                c,
                &format!("SELECT {FENCE_COLUMNS} FROM fences"),
                &["namespace", "kind", "key"],
                cursor,
                limit,
            )
            .await?;
            let mut out = Vec::with_capacity(found.len());
            for r in &found {
                let state: String = r.try_get(3)?;
                let f = fence_from_row(r)?;
                let state = FenceState::parse(&state).ok_or_else(|| {
                    bad_row(format!(
                        "fence {}/{}/{}: unknown state {state:?}",
                        f.id.namespace, f.id.kind, f.id.key
                    ))
                })?;
                out.push(copy::FenceRecord {
                    namespace: f.id.namespace,
                    kind: f.id.kind,
                    key: f.id.key,
                    state,
                    fingerprint: f.fingerprint,
                    job_id: f.job_id,
                    attempt: f.attempt,
                    token: f.token,
                    result: f.result,
                    created_at: f.created_at,
                    updated_at: f.updated_at,
                });
            }
            let last = out
                .last()
                .map(|f| vec![f.namespace.clone(), f.kind.clone(), f.key.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Fence).collect(), last)
        }
        Section::Kv => {
            let found = page_rows(
                c,
                "SELECT namespace, key, value, written_at FROM kv",
                &["namespace", "key"],
                cursor,
                limit,
            )
            .await?;
            let out = found
                .iter()
                .map(|r| {
                    Ok(copy::KvRecord {
                        namespace: r.try_get(0)?,
                        key: r.try_get(1)?,
                        value: r.try_get(2)?,
                        written_at: Millis(r.try_get(3)?),
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
            let last = out
                .last()
                .map(|k| vec![k.namespace.clone(), k.key.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Kv).collect(), last)
        }
        Section::Index => {
            let found = page_rows(
                c,
                "SELECT collection, id, version, document, updated_at FROM index_docs",
                &["collection", "id"],
                cursor,
                limit,
            )
            .await?;
            let out = found
                .iter()
                .map(|r| {
                    Ok(copy::IndexRecord {
                        collection: r.try_get(0)?,
                        id: r.try_get(1)?,
                        version: u64_of(r.try_get(2)?),
                        document: r.try_get(3)?,
                        updated_at: Millis(r.try_get(4)?),
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
            let last = out
                .last()
                .map(|i| vec![i.collection.clone(), i.id.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Index).collect(), last)
        }
        Section::Counters => {
            // The sequences' last values (NULL before their first use), and
            // the stored maximum in case a sequence was set back by hand.
            let r = rows(
                c,
                "SELECT COALESCE(pg_sequence_last_value('fencing_tokens'), 0), \
                 GREATEST(COALESCE(pg_sequence_last_value(pg_get_serial_sequence('jobs', 'seq')::regclass), 0), \
                          (SELECT COALESCE(MAX(seq), 0) FROM jobs))",
                &[],
            )
            .await?;
            let r = r
                .first()
                .ok_or_else(|| bad_row("the counters: no row".into()))?;
            let counters = copy::Counters {
                fencing_token: u64_of(r.try_get(0)?),
                enqueue_seq: u64_of(r.try_get(1)?),
            };
            return Ok(copy::ExportPage {
                records: vec![Record::Counters(counters)],
                next: None,
            });
        }
    };
    let next = copy::Cursor::after_page(cursor.section, records.len(), limit, last);
    Ok(copy::ExportPage { records, next })
}

/// Writes one page of imported records in the caller's transaction, then
/// moves the sequences past them. `setval` is not undone by a rollback; a
/// sequence moved forward by a failed import only skips numbers.
async fn import_page<C: GenericClient>(c: &C, records: &[copy::Record]) -> Result<(), Fail> {
    use copy::Record;
    for record in records {
        let inserted = match record {
            Record::Job(j) => {
                let state = j.stored_state();
                let n = exec(
                    c,
                    "INSERT INTO jobs (id, queue, state, payload, priority, run_at, seq, attempt, \
                     budget_used, max_attempts, dedup_key, enqueued_at, finished_at, result, \
                     last_error, lease_token) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
                     ON CONFLICT DO NOTHING",
                    &[
                        &j.id,
                        &j.queue,
                        &state.as_str(),
                        &j.payload,
                        &j.priority,
                        &j.run_at.0,
                        &i64_of(j.seq),
                        &i32_of(j.attempt),
                        &i32_of(j.budget_used),
                        &i32_of(j.max_attempts),
                        &j.dedup_key,
                        &j.enqueued_at.0,
                        &j.finished_at.map(|m| m.0),
                        &j.result,
                        &j.last_error,
                        &j.lease_token.map(i64_of),
                    ],
                )
                .await?;
                if n == 1 {
                    for a in &j.attempts {
                        exec(
                            c,
                            "INSERT INTO attempts \
                             (job_id, number, token, started_at, ended_at, outcome, error, plugin_version) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                            &[
                                &j.id,
                                &i32_of(a.number),
                                &i64_of(a.token),
                                &a.started_at.0,
                                &a.ended_at.map(|m| m.0),
                                &a.outcome.as_str(),
                                &a.error,
                                &a.plugin_version,
                            ],
                        )
                        .await?;
                    }
                    // `n` comes from its identity column, in insertion order.
                    for e in &j.effects {
                        exec(
                            c,
                            "INSERT INTO effects (job_id, attempt, kind, key, outcome, at) \
                             VALUES ($1, $2, $3, $4, $5, $6)",
                            &[
                                &j.id,
                                &i32_of(e.attempt),
                                &e.kind,
                                &e.key,
                                &e.outcome,
                                &e.at.0,
                            ],
                        )
                        .await?;
                    }
                }
                n
            }
            Record::Dedup(d) => {
                exec(
                    c,
                    "INSERT INTO dedup (queue, key, job_id, hold_until) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT DO NOTHING",
                    &[&d.queue, &d.key, &d.job_id, &d.hold_until.map(|m| m.0)],
                )
                .await?
            }
            Record::Fence(f) => exec(
                c,
                "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, \
                     token, result, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
                &[
                    &f.namespace,
                    &f.kind,
                    &f.key,
                    &f.state.as_str(),
                    &f.fingerprint,
                    &f.job_id,
                    &i32_of(f.attempt),
                    &i64_of(f.token),
                    &f.result,
                    &f.created_at.0,
                    &f.updated_at.0,
                ],
            )
            .await?,
            Record::Kv(k) => {
                exec(
                    c,
                    "INSERT INTO kv (namespace, key, value, written_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT DO NOTHING",
                    &[&k.namespace, &k.key, &k.value, &k.written_at.0],
                )
                .await?
            }
            Record::Index(i) => {
                exec(
                    c,
                    "INSERT INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                    &[
                        &i.collection,
                        &i.id,
                        &i64_of(i.version),
                        &i.document,
                        &i.updated_at.0,
                    ],
                )
                .await?
            }
            Record::Counters(_) => 1,
        };
        if inserted != 1 {
            return Err(Fail::Store(copy::already_there(record)));
        }
    }
    let counters = copy::Counters::of(records);
    if counters.fencing_token > 0 {
        exec(
            c,
            "SELECT setval('fencing_tokens', \
             GREATEST(COALESCE(pg_sequence_last_value('fencing_tokens'), 0), $1))",
            &[&i64_of(counters.fencing_token)],
        )
        .await?;
    }
    if counters.enqueue_seq > 0 {
        exec(
            c,
            "SELECT setval(pg_get_serial_sequence('jobs', 'seq'), \
             GREATEST(COALESCE(pg_sequence_last_value(pg_get_serial_sequence('jobs', 'seq')::regclass), 0), $1))",
            &[&i64_of(counters.enqueue_seq)],
        )
        .await?;
    }
    Ok(())
}

/// Fresh databases for tests, on the server named by `KHATA_TEST_PG_URL`.
/// Not part of the daemon; public so that the integration tests use it too.
#[doc(hidden)]
pub mod testing {
    use std::time::Duration;

    use super::{describe, parse_url, with_defaults};

    /// The variable that names the test server: a URL of a database on it
    /// where the user may `CREATE DATABASE`.
    pub const ENV: &str = "KHATA_TEST_PG_URL";

    /// The admin URL, or a panic that says how to start a server: the
    /// PostgreSQL tests fail, never skip, when there is none.
    pub fn admin_url() -> String {
        match std::env::var(ENV) {
            Ok(url) if !url.trim().is_empty() => url,
            _ => panic!(
                "{ENV} is not set, and the PostgreSQL tests need a server. Start a throwaway one \
                 (initdb in a temporary directory, a free port of 127.0.0.1) with\n\n    \
                 eval \"$(scripts/pg-test-server start)\"\n\nand stop it afterwards with \
                 `scripts/pg-test-server stop \"$KHATA_TEST_PG_DIR\"` (scripts/test does both), \
                 or set {ENV} to a server where this user may CREATE DATABASE, e.g. \
                 postgres://postgres@127.0.0.1:5432/postgres"
            ),
        }
    }

    /// A database made for one test, dropped (with its connections) when
    /// this is dropped.
    #[derive(Debug)]
    pub struct TestDatabase {
        admin: String,
        /// The database's name.
        pub name: String,
        /// A URL of this database (from the admin URL, another database name).
        pub url: String,
    }

    impl TestDatabase {
        /// Creates an empty database with a unique name.
        pub async fn create() -> TestDatabase {
            let admin = admin_url();
            let name = format!("khata_test_{}", uuid::Uuid::now_v7().simple());
            let cfg = with_defaults(parse_url(&admin).expect("KHATA_TEST_PG_URL"));
            let (client, connection) = cfg.connect(tokio_postgres::NoTls).await.unwrap_or_else(|e| {
                panic!(
                    "cannot connect to the test server {ENV}={admin}: {}\nIs it running? Start one with: eval \"$(scripts/pg-test-server start)\"",
                    describe(&e)
                )
            });
            let task = tokio::spawn(connection);
            client
                .batch_execute(&format!(
                    "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8'"
                ))
                .await
                .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {}", describe(&e)));
            drop(client);
            let _ = task.await;
            let url = url_with_dbname(&admin, &name);
            TestDatabase { admin, name, url }
        }
    }

    impl Drop for TestDatabase {
        fn drop(&mut self) {
            let (admin, name) = (self.admin.clone(), self.name.clone());
            // Drop runs inside the test's runtime: use a thread of its own.
            let dropped = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async move {
                    let cfg = with_defaults(parse_url(&admin).ok()?);
                    let (client, connection) = cfg.connect(tokio_postgres::NoTls).await.ok()?;
                    let task = tokio::spawn(connection);
                    let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                    let r =
                        tokio::time::timeout(Duration::from_secs(30), client.batch_execute(&sql))
                            .await;
                    drop(client);
                    let _ = task.await;
                    r.ok()?.ok()
                })
            });
            let _ = dropped.join();
        }
    }

    /// `url` with its database replaced by `dbname`: the path of a
    /// `postgres://` URL, or a `dbname=` pair appended to a key-value string.
    pub fn url_with_dbname(url: &str, dbname: &str) -> String {
        let Some(scheme_end) = url.find("://") else {
            return format!("{url} dbname={dbname}");
        };
        let rest_start = scheme_end + 3;
        let (base, query) = match url.find('?') {
            Some(q) => (&url[..q], &url[q..]),
            None => (url, ""),
        };
        let base = match base[rest_start..].find('/') {
            Some(slash) => &base[..rest_start + slash],
            None => base,
        };
        format!("{base}/{dbname}{query}")
    }

    #[test]
    fn dbname_is_replaced() {
        assert_eq!(
            url_with_dbname("postgres://u:p@127.0.0.1:5/postgres", "t"),
            "postgres://u:p@127.0.0.1:5/t"
        );
        assert_eq!(
            url_with_dbname("postgresql://h:5?sslmode=disable", "t"),
            "postgresql://h:5/t?sslmode=disable"
        );
        assert_eq!(
            url_with_dbname("host=h port=5", "t"),
            "host=h port=5 dbname=t"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::testing::TestDatabase;
    use super::{PostgresStore, SCHEMA_VERSION, migrate};
    use crate::job::{AttemptOutcome, Finish, JobState, Millis, NewJob};
    use crate::store::{Store, StoreError};

    async fn open_fresh() -> (TestDatabase, Arc<dyn Store>) {
        let db = TestDatabase::create().await;
        let store = PostgresStore::open(&db.url, 8).await.expect("open");
        (db, Arc::new(store))
    }

    crate::conformance_tests!(open_fresh);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn migrations_run_once_when_daemons_start_together() {
        let db = TestDatabase::create().await;
        let runs: Vec<_> = (0..4)
            .map(|_| {
                let url = db.url.clone();
                tokio::spawn(async move { migrate(&url).await })
            })
            .collect();
        let mut from_zero = 0;
        for r in runs {
            let m = r.await.unwrap().expect("migrate");
            assert_eq!(m.to, SCHEMA_VERSION);
            from_zero += usize::from(m.from == 0);
        }
        assert_eq!(
            from_zero, 1,
            "one of them migrated, the others found it done"
        );
        let again = migrate(&db.url).await.unwrap();
        assert_eq!((again.from, again.to), (SCHEMA_VERSION, SCHEMA_VERSION));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_newer_schema_is_refused() {
        let db = TestDatabase::create().await;
        migrate(&db.url).await.unwrap();
        let cfg = super::parse_url(&db.url).unwrap();
        let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        let task = tokio::spawn(conn);
        client
            .batch_execute("INSERT INTO khata_schema_migrations (version) VALUES (999)")
            .await
            .unwrap();
        drop(client);
        let _ = task.await;
        let err = PostgresStore::open(&db.url, 2).await.unwrap_err();
        assert!(err.to_string().contains("newer than this khata"), "{err}");
    }

    /// Sets every active lease of the database to have expired a moment ago,
    /// as the database's clock sees it: what a daemon paused past its lease
    /// finds, without waiting for it.
    async fn expire_leases(db: &TestDatabase) {
        let cfg = super::parse_url(&db.url).unwrap();
        let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        let task = tokio::spawn(conn);
        client
            .batch_execute(
                "UPDATE jobs SET lease_expires_at = clock_timestamp() - interval '1 second' \
                 WHERE state = 'active'",
            )
            .await
            .unwrap();
        drop(client);
        let _ = task.await;
    }

    fn new_job(id: &str, t0: Millis, max_attempts: u32) -> NewJob {
        NewJob {
            queue: "q".into(),
            id: Some(id.into()),
            payload: "{}".into(),
            priority: 0,
            run_at: t0,
            max_attempts,
            dedup_key: None,
            dedup_for: None,
        }
    }

    /// Two daemons on one database: each registers under its own id; a
    /// lease that expired fences its holder at every step, its finish is
    /// refused, the other daemon reclaims the job (the attempt recorded as
    /// abandoned and counted) and completes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expired_lease_is_fenced_and_reclaimed_by_another_daemon() {
        let db = TestDatabase::create().await;
        let a = PostgresStore::open(&db.url, 2).await.expect("open a");
        let b = PostgresStore::open(&db.url, 2).await.expect("open b");
        assert_ne!(a.daemon_id(), b.daemon_id());
        let t0 = Millis(1_700_000_000_000);
        a.enqueue(vec![new_job("j", t0, 3)], t0).await.unwrap();
        let l = a.lease("q", 1, "v1", t0).await.unwrap().remove(0);
        let f = l.fence();
        a.kv_put(&f, "ns", "k", b"1".to_vec(), t0).await.unwrap();
        // A live lease is not reclaimed, neither at start nor periodically.
        assert_eq!(b.recover(t0).await.unwrap(), 0);
        assert_eq!(b.reclaim_expired(t0).await.unwrap(), 0);
        assert!(a.heartbeat().await.unwrap().is_empty(), "renewed, not lost");

        expire_leases(&db).await;
        let fenced = |r: Result<(), StoreError>| {
            assert!(matches!(r, Err(StoreError::Fenced { .. })), "{r:?}");
        };
        fenced(a.kv_put(&f, "ns", "k", b"2".to_vec(), t0).await);
        fenced(a.kv_get(&f, "ns", "k").await.map(|_| ()));
        fenced(a.index_upsert(&f, "c", "d", "{}", 1, t0).await.map(|_| ()));
        let fid = crate::store::FenceId {
            namespace: "ns".into(),
            kind: "http".into(),
            key: "charge-1".into(),
        };
        fenced(a.fence_begin(&f, 1, &fid, b"fp", t0).await.map(|_| ()));
        // Expired is lost, even before anyone reclaimed it.
        assert_eq!(a.heartbeat().await.unwrap(), vec![f.clone()]);

        assert_eq!(b.reclaim_expired(t0).await.unwrap(), 1);
        let j = b.job("j", t0).await.unwrap().unwrap();
        assert_eq!(j.state, crate::job::JobState::Waiting);
        assert_eq!(j.attempts[0].outcome, crate::job::AttemptOutcome::Abandoned);
        assert_eq!(j.budget_used, 1, "the abandoned attempt counts");

        let l2 = b.lease("q", 1, "v1", t0).await.unwrap().remove(0);
        assert!(l2.token > l.token, "a newer token");
        let done = a
            .finish(&f, Finish::Completed { result: "1".into() }, t0)
            .await;
        assert!(matches!(done, Err(StoreError::Fenced { .. })), "{done:?}");
        assert_eq!(
            b.kv_get(&l2.fence(), "ns", "k").await.unwrap(),
            Some(b"1".to_vec()),
            "the stale daemon's write after expiry changed nothing"
        );
        b.finish(&l2.fence(), Finish::Completed { result: "2".into() }, t0)
            .await
            .unwrap();
        let j = b.job("j", t0).await.unwrap().unwrap();
        assert_eq!(j.state, crate::job::JobState::Completed);
        assert_eq!(j.result.as_deref(), Some("2"));
        let outcomes: Vec<_> = j.attempts.iter().map(|a| a.outcome).collect();
        assert_eq!(
            outcomes,
            [
                crate::job::AttemptOutcome::Abandoned,
                crate::job::AttemptOutcome::Completed
            ]
        );
    }

    /// Two stores (daemons) on a fresh database, `n` jobs `j0..` waiting in
    /// queue `q` at `t0`, and limits of `concurrency = 2`.
    async fn two_daemons_limited_to_two(
        n: usize,
    ) -> (
        TestDatabase,
        PostgresStore,
        PostgresStore,
        Millis,
        crate::store::LeaseLimits,
    ) {
        let db = TestDatabase::create().await;
        let a = PostgresStore::open(&db.url, 2).await.expect("open a");
        let b = PostgresStore::open(&db.url, 2).await.expect("open b");
        let t0 = Millis(1_700_000_000_000);
        let jobs = (0..n).map(|i| new_job(&format!("j{i}"), t0, 3)).collect();
        a.enqueue(jobs, t0).await.unwrap();
        let two = crate::store::LeaseLimits {
            concurrency: Some(2),
            rate: None,
        };
        (db, a, b, t0, two)
    }

    /// `lease_within` counts every daemon's leases. `concurrency = 2`: two
    /// daemons lease two jobs in all, a lease held back says so, and the
    /// next end of an attempt of the queue wakes the waiting daemons; an
    /// expired lease no longer counts. `rate_limit = 2 per minute`: the
    /// third start, on either daemon, waits, and the store says for how long.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lease_within_counts_every_daemons_leases() {
        use crate::store::{Held, LeaseLimits, RateWindow};
        let (db, a, b, t0, two) = two_daemons_limited_to_two(6).await;
        let first = a.lease_within("q", 1, "v1", t0, &two).await.unwrap();
        assert_eq!((first.leases.len(), first.held), (1, None));
        let second = b.lease_within("q", 5, "v1", t0, &two).await.unwrap();
        assert_eq!(
            (second.leases.len(), second.held),
            (1, Some(Held::Concurrency))
        );
        let none = a.lease_within("q", 5, "v1", t0, &two).await.unwrap();
        assert_eq!((none.leases.len(), none.held), (0, Some(Held::Concurrency)));
        let mut wake = b.wakeups().expect("postgres has wake-ups");
        assert_eq!(wake.recv().await.as_deref(), Some("*"));
        let done = Finish::Completed { result: "1".into() };
        a.finish(&first.leases[0].fence(), done, t0).await.unwrap();
        assert_eq!(
            wake.recv().await.as_deref(),
            Some("q"),
            "the end of an attempt wakes the daemons that wait for room"
        );
        let third = b.lease_within("q", 5, "v1", t0, &two).await.unwrap();
        assert_eq!(third.leases.len(), 1);
        expire_leases(&db).await;
        let after = a.lease_within("q", 5, "v1", t0, &two).await.unwrap();
        assert_eq!(after.leases.len(), 2, "expired leases do not count");

        let per = std::time::Duration::from_secs(60);
        let rate = LeaseLimits {
            concurrency: None,
            rate: Some(RateWindow { max: 2, per }),
        };
        let limited = (0..3)
            .map(|i| NewJob {
                queue: "r".into(),
                ..new_job(&format!("r{i}"), t0, 3)
            })
            .collect();
        a.enqueue(limited, t0).await.unwrap();
        let x = a.lease_within("r", 1, "v1", t0, &rate).await.unwrap();
        assert_eq!((x.leases.len(), x.held), (1, None));
        let y = b.lease_within("r", 5, "v1", t0, &rate).await.unwrap();
        assert_eq!(y.leases.len(), 1);
        let z = a.lease_within("r", 5, "v1", t0, &rate).await.unwrap();
        assert!(z.leases.is_empty());
        match z.held {
            Some(Held::Rate(wait)) => assert!(wait > std::time::Duration::ZERO && wait <= per),
            other => panic!("held back by the rate limit, not {other:?}"),
        }
    }

    /// An attempt whose finish is on its way (its handler ended) leaves
    /// room in its own daemon's concurrency at once (unless another daemon
    /// waits for room), and in the others' only once that finish commits; a
    /// waiting daemon hears of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ending_attempt_leaves_room_in_its_own_daemon_first() {
        use crate::store::Held;
        let (db, a, b, t0, two) = two_daemons_limited_to_two(4).await;
        let first = a.lease_within("q", 2, "v1", t0, &two).await.unwrap();
        assert_eq!(first.leases.len(), 2);
        // The first attempt's handler ended; its finish is not committed.
        let ended = &first.leases[0];
        a.ending.lock().unwrap().insert(super::i64_of(ended.token));
        let own = a.lease_within("q", 2, "v1", t0, &two).await.unwrap();
        assert_eq!(
            (own.leases.len(), own.held),
            (1, Some(Held::Concurrency)),
            "its own daemon does not count it"
        );
        let held = b.lease_within("q", 2, "v1", t0, &two).await.unwrap();
        assert_eq!(
            (held.leases.len(), held.held),
            (0, Some(Held::Concurrency)),
            "another daemon counts it until its finish commits"
        );
        let fair = a.lease_within("q", 2, "v1", t0, &two).await.unwrap();
        assert_eq!(
            (fair.leases.len(), fair.held),
            (0, Some(Held::Concurrency)),
            "while another daemon waits, its own daemon counts it too"
        );
        a.ending.lock().unwrap().clear();
        let mut wake = b.wakeups().expect("postgres has wake-ups");
        assert_eq!(wake.recv().await.as_deref(), Some("*"));
        let done = Finish::Completed { result: "1".into() };
        a.finish(&ended.fence(), done, t0).await.unwrap();
        assert!(
            a.ending().is_empty(),
            "a finish answered is no longer ending"
        );
        assert_eq!(
            wake.recv().await.as_deref(),
            Some("q"),
            "the waiting daemon is woken once the finish committed"
        );
        let c = PostgresStore::open(&db.url, 2).await.expect("open c");
        let waits = c.client().await.unwrap();
        let left = waits
            .query_one("SELECT COUNT(*) FROM queue_waits", &[])
            .await
            .unwrap()
            .get::<_, i64>(0);
        assert_eq!(left, 0, "the wait was consumed by its wake-up");
    }

    /// A lease that expires before its attempt ends, not yet reclaimed: the
    /// finish is refused and the attempt closed as abandoned; the job is
    /// reclaimed at the next pass, dead when its budget is used up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_finish_after_expiry_is_refused_and_the_budget_holds() {
        let db = TestDatabase::create().await;
        let a = PostgresStore::open(&db.url, 2).await.expect("open");
        let t0 = Millis(1_700_000_000_000);
        a.enqueue(vec![new_job("j", t0, 1)], t0).await.unwrap();
        let l = a.lease("q", 1, "v1", t0).await.unwrap().remove(0);
        expire_leases(&db).await;
        let r = a
            .finish(&l.fence(), Finish::Completed { result: "1".into() }, t0)
            .await;
        assert!(matches!(r, Err(StoreError::Fenced { .. })), "{r:?}");
        let j = a.job("j", t0).await.unwrap().unwrap();
        assert_eq!(j.state, crate::job::JobState::Active, "until reclaimed");
        assert_eq!(j.attempts[0].outcome, crate::job::AttemptOutcome::Abandoned);
        assert_eq!(a.reclaim_expired(t0).await.unwrap(), 1);
        let j = a.job("j", t0).await.unwrap().unwrap();
        assert_eq!(j.state, crate::job::JobState::Dead, "{j:?}");
        assert!(
            j.last_error.as_deref().unwrap_or("").contains("budget"),
            "{j:?}"
        );
    }

    /// An enqueue on one daemon wakes the others' listeners.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_enqueue_notifies_every_listening_daemon() {
        let db = TestDatabase::create().await;
        let a = PostgresStore::open(&db.url, 2).await.expect("open a");
        let b = PostgresStore::open(&db.url, 2).await.expect("open b");
        let mut wake = b.wakeups().expect("postgres has wake-ups");
        assert_eq!(
            wake.recv().await.as_deref(),
            Some("*"),
            "first: every queue"
        );
        let t0 = Millis(1_700_000_000_000);
        a.enqueue(vec![new_job("j", t0, 3)], t0).await.unwrap();
        assert_eq!(wake.recv().await.as_deref(), Some("q"));
    }

    /// Leases from many connections at once: `SKIP LOCKED` gives each job
    /// to one attempt, tokens are unique, and the sharded counters add up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_leases_take_each_job_once() {
        let (_db, s) = open_fresh().await;
        let t0 = Millis(1_700_000_000_000);
        let jobs: Vec<NewJob> = (0..200)
            .map(|i| NewJob {
                queue: "q".into(),
                id: Some(format!("j{i}")),
                payload: "{}".into(),
                priority: 0,
                run_at: t0,
                max_attempts: 3,
                dedup_key: None,
                dedup_for: None,
            })
            .collect();
        s.enqueue(jobs, t0).await.unwrap();
        let workers: Vec<_> = (0..8)
            .map(|_| {
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        let leases = s.lease("q", 5, "v1", t0).await.unwrap();
                        if leases.is_empty() {
                            return mine;
                        }
                        for l in leases {
                            s.finish(&l.fence(), Finish::Completed { result: "1".into() }, t0)
                                .await
                                .unwrap();
                            mine.push((l.job_id, l.token));
                        }
                    }
                })
            })
            .collect();
        let mut all = Vec::new();
        for w in workers {
            all.extend(w.await.unwrap());
        }
        assert_eq!(all.len(), 200, "every job leased once");
        let mut ids: Vec<_> = all.iter().map(|(id, _)| id.clone()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 200, "no job leased twice");
        let mut tokens: Vec<_> = all.iter().map(|(_, t)| *t).collect();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 200, "tokens are unique");
        let counts = s.counts(t0).await.unwrap();
        let q = &counts.iter().find(|(q, _)| q == "q").unwrap().1;
        assert_eq!((q.completed, q.waiting, q.active), (200, 0, 0), "{q:?}");
    }

    /// Two batches naming the same ids in opposite orders deadlock in the
    /// server; the loser reruns and finds the winner's jobs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn crossing_batches_create_each_job_once() {
        let (_db, s) = open_fresh().await;
        let t0 = Millis(1_700_000_000_000);
        let job = |id: &str| NewJob {
            queue: "q".into(),
            id: Some(id.into()),
            payload: "{}".into(),
            priority: 0,
            run_at: t0,
            max_attempts: 3,
            dedup_key: Some(format!("key-{id}")),
            dedup_for: None,
        };
        for round in 0..5 {
            let (x, y) = (format!("x{round}"), format!("y{round}"));
            let forward = vec![job(&x), job(&y)];
            let backward = vec![job(&y), job(&x)];
            let (a, b) = tokio::join!(
                {
                    let s = Arc::clone(&s);
                    async move { s.enqueue(forward, t0).await }
                },
                {
                    let s = Arc::clone(&s);
                    async move { s.enqueue(backward, t0).await }
                }
            );
            let (a, b) = (a.unwrap(), b.unwrap());
            let created = a.iter().chain(&b).filter(|e| !e.deduplicated).count();
            assert_eq!(created, 2, "round {round}: {a:?} {b:?}");
        }
        let counts = s.counts(t0).await.unwrap();
        assert_eq!(counts[0].1.waiting, 10);
    }

    /// Sends `reqs` to the finisher as one group and returns each answer.
    async fn finish_as_one_group(
        store: &PostgresStore,
        reqs: Vec<(crate::job::LeaseRef, Finish, Millis)>,
    ) -> Vec<Result<JobState, StoreError>> {
        let mut group = Vec::new();
        let mut answers = Vec::new();
        for (lease, finish, now) in reqs {
            let (answer, answered) = tokio::sync::oneshot::channel();
            group.push(super::FinishReq {
                lease,
                finish,
                now,
                answer,
            });
            answers.push(answered);
        }
        super::finish_group(&store.pool, &store.target, group).await;
        let mut out = Vec::new();
        for a in answers {
            out.push(a.await.expect("every finish of the group is answered"));
        }
        out
    }

    /// The transactions that last wrote the rows of `table` named by `ids`
    /// (`job_id` for attempts), one per row.
    async fn writers(db: &TestDatabase, table: &str, ids: &[&str]) -> Vec<String> {
        let cfg = super::parse_url(&db.url).unwrap();
        let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        let task = tokio::spawn(conn);
        let column = if table == "jobs" { "id" } else { "job_id" };
        let ids: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
        let rows = client
            .query(
                &format!("SELECT xmin::text FROM {table} WHERE {column} = ANY($1::text[])"),
                &[&ids],
            )
            .await
            .unwrap();
        drop(client);
        let _ = task.await;
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// One group of finishes, one transaction: every kind of end commits
    /// with its own rules (completed, retried with its backoff, dead with
    /// its dedup key released, interrupted without counting), a cancelled
    /// job's finish is `Fenced` with its attempt closed as cancelled, an
    /// expired lease's finish is `Fenced` with its attempt abandoned, a
    /// job that does not exist is `NotFound`, and none of these undoes the
    /// others.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_of_finishes_commits_each_by_its_own_rules() {
        let db = TestDatabase::create().await;
        let s = PostgresStore::open(&db.url, 4).await.expect("open");
        let t0 = Millis(1_700_000_000_000);
        let names = ["done", "again", "dead", "stop", "gone", "late"];
        let mut jobs: Vec<NewJob> = names.iter().map(|n| new_job(n, t0, 3)).collect();
        jobs[2].dedup_key = Some("k".into());
        jobs[2].max_attempts = 1;
        s.enqueue(jobs, t0).await.unwrap();
        let leases = s.lease("q", 10, "v1", t0).await.unwrap();
        assert_eq!(leases.len(), 6);
        let lease = |id: &str| leases.iter().find(|l| l.job_id == id).unwrap().fence();
        s.cancel("gone", t0).await.unwrap();
        // Only `late`'s lease has run out.
        let (client, conn) = super::parse_url(&db.url)
            .unwrap()
            .connect(tokio_postgres::NoTls)
            .await
            .unwrap();
        let task = tokio::spawn(conn);
        client
            .execute(
                "UPDATE jobs SET lease_expires_at = clock_timestamp() - interval '1 second' \
                 WHERE id = 'late'",
                &[],
            )
            .await
            .unwrap();
        drop(client);
        let _ = task.await;
        let t1 = Millis(t0.0 + 5);
        let retry_at = Millis(t0.0 + 60_000);
        let answers = finish_as_one_group(
            &s,
            vec![
                (lease("done"), Finish::Completed { result: "r".into() }, t1),
                (
                    lease("again"),
                    Finish::Retry {
                        outcome: AttemptOutcome::Error,
                        error: "later".into(),
                        run_at: retry_at,
                    },
                    t1,
                ),
                (
                    lease("dead"),
                    Finish::Retry {
                        outcome: AttemptOutcome::Error,
                        error: "no".into(),
                        run_at: retry_at,
                    },
                    t1,
                ),
                (
                    lease("stop"),
                    Finish::Interrupted {
                        error: "shutdown".into(),
                    },
                    t1,
                ),
                (lease("gone"), Finish::Completed { result: "r".into() }, t1),
                (lease("late"), Finish::Completed { result: "r".into() }, t1),
                (
                    crate::job::LeaseRef {
                        job_id: "nowhere".into(),
                        token: 1,
                    },
                    Finish::Completed { result: "r".into() },
                    t1,
                ),
            ],
        )
        .await;
        assert_eq!(answers[0].as_ref().ok(), Some(&JobState::Completed));
        assert_eq!(answers[1].as_ref().ok(), Some(&JobState::Delayed));
        assert_eq!(answers[2].as_ref().ok(), Some(&JobState::Dead));
        assert_eq!(answers[3].as_ref().ok(), Some(&JobState::Waiting));
        assert!(
            matches!(answers[4], Err(StoreError::Fenced { .. })),
            "{:?}",
            answers[4]
        );
        assert!(
            matches!(answers[5], Err(StoreError::Fenced { .. })),
            "{:?}",
            answers[5]
        );
        assert!(
            matches!(&answers[6], Err(StoreError::NotFound(id)) if id == "nowhere"),
            "{:?}",
            answers[6]
        );

        let job = |id: &'static str| {
            let s = &s;
            async move { s.job(id, t1).await.unwrap().unwrap() }
        };
        let done = job("done").await;
        assert_eq!(
            (done.state, done.result.as_deref()),
            (JobState::Completed, Some("r"))
        );
        assert_eq!(done.attempts[0].outcome, AttemptOutcome::Completed);
        let again = job("again").await;
        assert_eq!(
            (again.state, again.run_at, again.last_error.as_deref()),
            (JobState::Delayed, retry_at, Some("later"))
        );
        let dead = job("dead").await;
        assert_eq!(dead.state, JobState::Dead);
        assert_eq!(
            dead.last_error.as_deref(),
            Some("no (attempt budget of 1 used up)")
        );
        let stop = job("stop").await;
        assert_eq!(
            (stop.state, stop.budget_used, stop.attempts[0].outcome),
            (JobState::Waiting, 0, AttemptOutcome::Interrupted)
        );
        let gone = job("gone").await;
        assert_eq!(
            (gone.state, gone.attempts[0].outcome),
            (JobState::Cancelled, AttemptOutcome::Cancelled)
        );
        let late = job("late").await;
        assert_eq!(late.state, JobState::Active, "left for a reclaim");
        assert_eq!(late.attempts[0].outcome, AttemptOutcome::Abandoned);
        // The dead job's dedup key was released with it.
        let mut again_k = new_job("k2", t1, 3);
        again_k.dedup_key = Some("k".into());
        let e = s.enqueue(vec![again_k], t1).await.unwrap();
        assert!(!e[0].deduplicated, "{e:?}");

        // Every write of the group is one transaction's.
        let moved = ["done", "again", "dead", "stop"];
        let mut xids = writers(&db, "jobs", &moved).await;
        xids.extend(
            writers(
                &db,
                "attempts",
                &["done", "again", "dead", "stop", "gone", "late"],
            )
            .await,
        );
        xids.sort();
        xids.dedup();
        assert_eq!(xids.len(), 1, "one transaction wrote the group: {xids:?}");
    }

    /// A finish that the server refuses (here an error text holding NUL,
    /// which PostgreSQL text cannot store) fails alone: the group is
    /// applied again one finish at a time, and the others commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_finish_fails_alone() {
        let db = TestDatabase::create().await;
        let s = PostgresStore::open(&db.url, 4).await.expect("open");
        let t0 = Millis(1_700_000_000_000);
        s.enqueue(
            vec![
                new_job("a", t0, 3),
                new_job("b", t0, 3),
                new_job("c", t0, 3),
            ],
            t0,
        )
        .await
        .unwrap();
        let leases = s.lease("q", 3, "v1", t0).await.unwrap();
        let reqs = leases
            .iter()
            .map(|l| {
                let finish = if l.job_id == "b" {
                    Finish::Fail {
                        outcome: AttemptOutcome::Error,
                        error: "nul \0 here".into(),
                    }
                } else {
                    Finish::Completed { result: "r".into() }
                };
                (l.fence(), finish, t0)
            })
            .collect();
        let answers = finish_as_one_group(&s, reqs).await;
        for (l, a) in leases.iter().zip(&answers) {
            if l.job_id == "b" {
                assert!(matches!(a, Err(StoreError::Unavailable(_))), "{a:?}");
            } else {
                assert_eq!(a.as_ref().ok(), Some(&JobState::Completed), "{}", l.job_id);
            }
        }
        for (id, state) in [
            ("a", JobState::Completed),
            ("b", JobState::Active),
            ("c", JobState::Completed),
        ] {
            assert_eq!(s.job(id, t0).await.unwrap().unwrap().state, state, "{id}");
        }
    }

    /// Concurrent finishes through the trait: each caller gets its own
    /// answer (the cancelled jobs' finishes `Fenced`, the others
    /// `Completed`), whichever groups they shared.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_finishes_each_get_their_answer() {
        let (_db, s) = open_fresh().await;
        let t0 = Millis(1_700_000_000_000);
        let jobs: Vec<NewJob> = (0..300).map(|i| new_job(&format!("j{i}"), t0, 3)).collect();
        s.enqueue(jobs, t0).await.unwrap();
        let leases = s.lease("q", 300, "v1", t0).await.unwrap();
        assert_eq!(leases.len(), 300);
        for i in (0..300).step_by(7) {
            s.cancel(&format!("j{i}"), t0).await.unwrap();
        }
        let finishing: Vec<_> = leases
            .into_iter()
            .map(|l| {
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let r = s
                        .finish(&l.fence(), Finish::Completed { result: "1".into() }, t0)
                        .await;
                    (l.job_id, r)
                })
            })
            .collect();
        for f in finishing {
            let (id, r) = f.await.unwrap();
            let n: usize = id[1..].parse().unwrap();
            if n.is_multiple_of(7) {
                assert!(matches!(r, Err(StoreError::Fenced { .. })), "{id}: {r:?}");
            } else {
                assert_eq!(r.ok(), Some(JobState::Completed), "{id}");
            }
        }
        let counts = s.counts(t0).await.unwrap();
        let q = &counts.iter().find(|(q, _)| q == "q").unwrap().1;
        assert_eq!((q.completed, q.cancelled, q.active), (257, 43, 0), "{q:?}");
    }

    /// Batches with overlapping ids enqueued at once through two stores (two
    /// daemons) on one database: one job per id, the other batch's answer
    /// for it deduplicated to that job; a batch naming an existing id with
    /// another payload is refused whole (`IdReused`, with its index).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_batches_on_two_daemons_create_each_job_once() {
        let db = TestDatabase::create().await;
        let a: Arc<dyn Store> = Arc::new(PostgresStore::open(&db.url, 4).await.expect("open"));
        let b: Arc<dyn Store> = Arc::new(PostgresStore::open(&db.url, 4).await.expect("open"));
        let t0 = Millis(1_700_000_000_000);
        for round in 0..5 {
            let ids = |r: std::ops::Range<usize>| -> Vec<NewJob> {
                r.map(|i| new_job(&format!("r{round}-{i}"), t0, 3))
                    .collect()
            };
            let forward = ids(0..100);
            let mut backward = ids(50..150);
            backward.reverse();
            let (x, y) = tokio::join!(
                {
                    let a = Arc::clone(&a);
                    async move { a.enqueue(forward, t0).await }
                },
                {
                    let b = Arc::clone(&b);
                    async move { b.enqueue(backward, t0).await }
                }
            );
            let (x, y) = (x.unwrap(), y.unwrap());
            let mut created: Vec<&str> = x
                .iter()
                .chain(&y)
                .filter(|e| !e.deduplicated)
                .map(|e| e.job.id.as_str())
                .collect();
            created.sort_unstable();
            created.dedup();
            assert_eq!(
                created.len(),
                x.iter().chain(&y).filter(|e| !e.deduplicated).count(),
                "round {round}: an id created twice"
            );
            assert_eq!(created.len(), 150, "round {round}");
            for e in x.iter().chain(&y) {
                assert_eq!(e.job.state, JobState::Waiting, "{e:?}");
            }
        }
        let counts = a.counts(t0).await.unwrap();
        assert_eq!(counts[0].1.waiting, 750);

        let mut clash = vec![new_job("fresh", t0, 3), new_job("r0-7", t0, 3)];
        clash[1].payload = r#"{"other":1}"#.into();
        let err = b.enqueue(clash, t0).await.unwrap_err();
        assert!(
            matches!(&err, StoreError::IdReused { id, index: 1 } if id == "r0-7"),
            "{err:?}"
        );
        assert!(a.job("fresh", t0).await.unwrap().is_none(), "all or none");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_url_does_not_echo_the_password() {
        let err = PostgresStore::open("postgres://u:s3cret@127.0.0.1:notaport/db", 1)
            .await
            .unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
