//! The SQLite ledger: WAL, `synchronous = FULL`, one writer with group commit.
//!
//! The store's one writer ([`super::writer`]) owns the only writing
//! connection: a group is one transaction (`BEGIN IMMEDIATE` … `COMMIT`),
//! each step runs inside a savepoint of it (a failing step rolls back
//! alone), and with `synchronous = FULL` the commit fsyncs the WAL, so a
//! group is durable against power loss once `COMMIT` returns. A failed
//! commit is rolled back and halts the ledger ([`super::Halt`]).
//!
//! Readers use their own connections, which see committed state only.
//!
//! The WAL stays bounded: past 64 MiB the writer checkpoints it whole and
//! restarts it ([`bound_wal`]), which SQLite's own passive checkpoints
//! cannot do while readers keep snapshots open.
//!
//! A lock file in the data directory keeps a second daemon off the ledger:
//! crash recovery assumes every `active` job belongs to a dead process.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, params};

use super::rules::{self, invalid_fence, stored_state, visible_state};
use super::writer::{Engine, GroupWriter};
use super::{
    EffectRecord, Fence, FenceBegin, FenceId, FenceState, JobFilter, JobPage, PageBuilder,
    RESOLVED_BY_OPERATOR, Resolution, RetentionRules, Store, StoreError, Swept, UpsertOutcome,
};
use crate::job::{
    Attempt, AttemptOutcome, Enqueued, Finish, Job, JobState, Lease, LeaseRef, Millis, NewJob,
    StateCounts,
};

/// Reader connections kept open.
const READERS: usize = 4;

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = 4;

/// The schema, one entry per version; entry `i` moves version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO meta (key, value) VALUES ('fencing_token', 0), ('seq', 0);

-- state is one of waiting, active, completed, dead, cancelled;
-- 'delayed' is derived: waiting with run_at in the future.
CREATE TABLE jobs (
    id           TEXT PRIMARY KEY,
    queue        TEXT NOT NULL,
    state        TEXT NOT NULL,
    payload      TEXT NOT NULL,
    priority     INTEGER NOT NULL,
    run_at       INTEGER NOT NULL,
    seq          INTEGER NOT NULL UNIQUE,
    attempt      INTEGER NOT NULL DEFAULT 0,
    budget_used  INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    dedup_key    TEXT,
    enqueued_at  INTEGER NOT NULL,
    finished_at  INTEGER,
    result       TEXT,
    last_error   TEXT,
    lease_token  INTEGER
);
-- The ready order.
CREATE INDEX jobs_ready ON jobs (queue, priority DESC, run_at, seq) WHERE state = 'waiting';
-- The next job to become due.
CREATE INDEX jobs_due ON jobs (queue, run_at) WHERE state = 'waiting';
CREATE INDEX jobs_active ON jobs (state) WHERE state = 'active';
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE state IN ('completed', 'cancelled');
CREATE INDEX jobs_queue_state ON jobs (queue, state, seq);

CREATE TABLE attempts (
    job_id     TEXT NOT NULL,
    number     INTEGER NOT NULL,
    token      INTEGER NOT NULL,
    started_at INTEGER NOT NULL,
    ended_at   INTEGER,
    outcome    TEXT NOT NULL,
    error      TEXT,
    PRIMARY KEY (job_id, number)
) WITHOUT ROWID;

-- A dedup key points at the job that holds it; hold_until keeps it held
-- after that job ends (dedup_for).
CREATE TABLE dedup (
    queue      TEXT NOT NULL,
    key        TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    hold_until INTEGER,
    PRIMARY KEY (queue, key)
) WITHOUT ROWID;

CREATE TABLE kv (
    namespace TEXT NOT NULL,
    key       TEXT NOT NULL,
    value     BLOB NOT NULL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;

-- document NULL is a tombstone that keeps its version.
CREATE TABLE index_docs (
    collection TEXT NOT NULL,
    id         TEXT NOT NULL,
    version    INTEGER NOT NULL,
    document   TEXT,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (collection, id)
) WITHOUT ROWID;

-- One fence per effect (DESIGN 4): started -> done, uncertain, or deleted.
CREATE TABLE fences (
    namespace   TEXT NOT NULL,
    kind        TEXT NOT NULL,
    key         TEXT NOT NULL,
    state       TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    job_id      TEXT NOT NULL,
    attempt     INTEGER NOT NULL,
    token       INTEGER NOT NULL,
    result      BLOB,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (namespace, kind, key)
) WITHOUT ROWID;
CREATE INDEX fences_state ON fences (state, updated_at);

-- The effects each attempt performed or replayed.
CREATE TABLE effects (
    job_id    TEXT NOT NULL,
    attempt   INTEGER NOT NULL,
    n         INTEGER NOT NULL,
    kind      TEXT NOT NULL,
    key       TEXT NOT NULL,
    outcome   TEXT NOT NULL,
    at        INTEGER NOT NULL,
    PRIMARY KEY (job_id, attempt, n)
) WITHOUT ROWID;
"#,
    r#"
-- Jobs per queue and stored state, kept by triggers in the transaction that
-- changes the job, so that counting never scans the jobs.
CREATE TABLE job_counts (
    queue TEXT NOT NULL,
    state TEXT NOT NULL,
    n     INTEGER NOT NULL,
    PRIMARY KEY (queue, state)
) WITHOUT ROWID;
INSERT INTO job_counts (queue, state, n) SELECT queue, state, COUNT(*) FROM jobs GROUP BY queue, state;
CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs BEGIN
    INSERT INTO job_counts (queue, state, n) VALUES (new.queue, new.state, 1)
        ON CONFLICT (queue, state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER job_counts_delete AFTER DELETE ON jobs BEGIN
    UPDATE job_counts SET n = n - 1 WHERE queue = old.queue AND state = old.state;
END;
CREATE TRIGGER job_counts_update AFTER UPDATE OF state ON jobs WHEN old.state <> new.state BEGIN
    UPDATE job_counts SET n = n - 1 WHERE queue = old.queue AND state = old.state;
    INSERT INTO job_counts (queue, state, n) VALUES (new.queue, new.state, 1)
        ON CONFLICT (queue, state) DO UPDATE SET n = n + 1;
END;
"#,
    r#"
ALTER TABLE attempts ADD COLUMN plugin_version TEXT;
"#,
    r#"
-- Retention of dead jobs, kv entries and index tombstones: a kv entry's last
-- write (entries from before this version count as written now).
ALTER TABLE kv ADD COLUMN written_at INTEGER NOT NULL DEFAULT 0;
UPDATE kv SET written_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER);
CREATE INDEX kv_written ON kv (namespace, written_at);
CREATE INDEX jobs_dead ON jobs (finished_at) WHERE state = 'dead';
CREATE INDEX index_tombstones ON index_docs (updated_at) WHERE document IS NULL;
"#,
];

/// The writer thread's state: the writing connection and the counters it
/// issues from (written into the group that issued them).
struct Writer {
    conn: Connection,
    next_token: u64,
    next_seq: i64,
    /// The counters as the group's transaction began.
    group_start: (u64, i64),
    /// The WAL file, watched by [`bound_wal`].
    wal_path: PathBuf,
}

impl Engine for Writer {
    fn begin(&mut self) -> Result<(), StoreError> {
        self.group_start = (self.next_token, self.next_seq);
        Ok(self.conn.execute_batch("BEGIN IMMEDIATE")?)
    }

    /// Commits the group's transaction, durable or not: a transaction cannot
    /// stay open past its group.
    fn commit(&mut self, _durable: bool) -> Result<bool, StoreError> {
        persist_counters(self)?;
        injected_commit_failure()?;
        self.conn.execute_batch("COMMIT")?;
        Ok(true)
    }

    fn abort(&mut self) {
        let _ = self.conn.execute_batch("ROLLBACK");
    }

    /// One `stat` a commit: a microsecond beside the commit's fsync.
    fn committed(&mut self) {
        bound_wal(self);
    }
}

/// A SQLite ledger in one file.
pub struct SqliteStore {
    writer: GroupWriter<Writer>,
    readers: Arc<Mutex<Vec<Connection>>>,
    path: PathBuf,
    _lock: File,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> StoreError {
        unavailable(e)
    }
}

fn open_conn(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // FULL: every commit fsyncs the WAL, so a returned commit survives power loss.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    // Each step runs in a savepoint; its sub-journal (pages to restore if the
    // step fails) lives in memory rather than in a temporary file. It only
    // matters until COMMIT, so nothing durable depends on it.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(unavailable(format!(
            "the ledger has schema version {version}, newer than this khata ({SCHEMA_VERSION}); upgrade khata"
        )));
    }
    for (i, sql) in MIGRATIONS
        .iter()
        .enumerate()
        .skip(usize::try_from(version).unwrap_or(0))
    {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(
            None,
            "user_version",
            i64::try_from(i + 1).unwrap_or(i64::MAX),
        )?;
        tx.commit()?;
    }
    Ok(())
}

impl SqliteStore {
    /// Opens (creating if needed) the ledger `khata.db` in `dir`, migrating
    /// its schema, and takes the directory's lock.
    pub fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| unavailable(format!("cannot create {}: {e}", dir.display())))?;
        let lock_path = dir.join("khata.lock");
        let lock = File::create(&lock_path)
            .map_err(|e| unavailable(format!("cannot create {}: {e}", lock_path.display())))?;
        lock.try_lock().map_err(|_| {
            unavailable(format!(
                "{} is locked: another khata daemon uses this data directory",
                lock_path.display()
            ))
        })?;
        let path = dir.join("khata.db");
        let mut conn = open_conn(&path)?;
        // The writer's page cache: 32 MiB (negative: KiB), so that the ready
        // and due indexes of a large backlog stay in memory.
        conn.pragma_update(None, "cache_size", -32_768)?;
        migrate(&mut conn)?;
        let next_token: i64 = conn.query_row(
            "SELECT value FROM meta WHERE key = 'fencing_token'",
            [],
            |r| r.get(0),
        )?;
        let max_seq: i64 =
            conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM jobs", [], |r| r.get(0))?;
        let meta_seq: i64 =
            conn.query_row("SELECT value FROM meta WHERE key = 'seq'", [], |r| r.get(0))?;
        let mut readers = Vec::with_capacity(READERS);
        for _ in 0..READERS {
            let r = open_conn(&path)?;
            r.pragma_update(None, "query_only", true)?;
            readers.push(r);
        }
        // A WAL that a checkpoint reset is cut back to this size.
        conn.pragma_update(None, "journal_size_limit", WAL_KEPT)?;
        let writer = Writer {
            conn,
            next_token: u64::try_from(next_token).unwrap_or(0) + 1,
            next_seq: max_seq.max(meta_seq) + 1,
            group_start: (0, 0),
            wal_path: PathBuf::from(format!("{}-wal", path.display())),
        };
        Ok(SqliteStore {
            writer: GroupWriter::start(writer)?,
            readers: Arc::new(Mutex::new(readers)),
            path,
            _lock: lock,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the writer inside a savepoint; answers after the commit
    /// when `durable`, else once applied.
    async fn write<T, F>(&self, durable: bool, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Writer) -> Result<T, StoreError> + Send + 'static,
    {
        self.writer
            .write(durable, move |w| in_savepoint(w, f))
            .await
    }

    /// Runs `f` on a reader connection on the blocking pool.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let readers = Arc::clone(&self.readers);
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let conn = readers.lock().ok().and_then(|mut v| v.pop());
            let conn = match conn {
                Some(c) => c,
                None => {
                    let c = open_conn(&path)?;
                    c.pragma_update(None, "query_only", true)?;
                    c
                }
            };
            let out = f(&conn);
            if let Ok(mut v) = readers.lock()
                && v.len() < READERS
            {
                v.push(conn);
            }
            out
        })
        .await
        .map_err(unavailable)?
    }
}

fn in_savepoint<T>(
    w: &mut Writer,
    f: impl FnOnce(&mut Writer) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let saved = (w.next_token, w.next_seq);
    if let Err(e) = w.conn.execute_batch("SAVEPOINT step") {
        return Err(e.into());
    }
    match f(w) {
        Ok(v) => {
            w.conn.execute_batch("RELEASE step")?;
            Ok(v)
        }
        Err(e) => {
            // Undo the step alone; the group's other steps stand.
            let _ = w.conn.execute_batch("ROLLBACK TO step; RELEASE step");
            (w.next_token, w.next_seq) = saved;
            Err(e)
        }
    }
}

/// The WAL's size past which the writer checkpoints it whole.
const WAL_LIMIT: u64 = 64 << 20;
/// What a reset WAL is cut back to (`journal_size_limit`).
const WAL_KEPT: i64 = 16 << 20;

/// Keeps the WAL bounded under continuous load. SQLite's automatic
/// checkpoints are passive: while readers (the API, the dashboard) keep
/// snapshots open, they copy what they can but the WAL never restarts, and
/// it grows without bound. Past [`WAL_LIMIT`] the writer runs a `TRUNCATE`
/// checkpoint, which waits (up to the busy timeout) for the readers of the
/// moment to finish, copies every frame into the database and restarts the
/// WAL. Pages freed by deletions are reused by later writes (no
/// `auto_vacuum`), so the database file levels off too.
fn bound_wal(w: &Writer) {
    let size = std::fs::metadata(&w.wal_path).map_or(0, |m| m.len());
    if size <= WAL_LIMIT {
        return;
    }
    let started = Instant::now();
    let result = w
        .conn
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            r.get::<_, i64>(0)
        });
    metrics::counter!("khata_store_checkpoints_total").increment(1);
    match result {
        Ok(0) => tracing::debug!(
            wal_bytes = size,
            took_ms = started.elapsed().as_millis() as u64,
            "the WAL was checkpointed and restarted"
        ),
        Ok(_) => tracing::warn!(
            wal_bytes = size,
            "the WAL could not be checkpointed whole: readers held it past the busy timeout; trying again later"
        ),
        Err(e) => {
            tracing::warn!(error = %e, wal_bytes = size, "the WAL checkpoint failed; trying again later")
        }
    }
}

/// The crash tests' commit failure: with the `failpoints` feature and
/// `FAILPOINTS="sqlite::commit=return(<path>)"`, every commit fails once a
/// file exists at `<path>` (so a test decides when, after start-up).
fn injected_commit_failure() -> Result<(), StoreError> {
    #[cfg(feature = "failpoints")]
    if let Some(path) = fail::eval("sqlite::commit", |a| a.unwrap_or_default())
        && Path::new(&path).exists()
    {
        return Err(unavailable(format!(
            "injected commit failure ({path} exists)"
        )));
    }
    Ok(())
}

/// Writes the in-memory counters into the group's transaction, so that the
/// fencing token only grows across restarts.
fn persist_counters(w: &Writer) -> Result<(), StoreError> {
    let (token_before, seq_before) = w.group_start;
    if w.next_token != token_before {
        w.conn.execute(
            "UPDATE meta SET value = ?1 WHERE key = 'fencing_token'",
            [i64::try_from(w.next_token - 1).unwrap_or(i64::MAX)],
        )?;
    }
    if w.next_seq != seq_before {
        w.conn.execute(
            "UPDATE meta SET value = ?1 WHERE key = 'seq'",
            [w.next_seq - 1],
        )?;
    }
    Ok(())
}

const JOB_COLUMNS: &str = "id, queue, state, payload, priority, attempt, budget_used, max_attempts, \
     dedup_key, run_at, enqueued_at, finished_at, result, last_error";

fn job_from_row(r: &rusqlite::Row<'_>, now: Millis) -> rusqlite::Result<Job> {
    let state: String = r.get(2)?;
    let run_at = Millis(r.get(9)?);
    Ok(Job {
        id: r.get(0)?,
        queue: r.get(1)?,
        state: visible_state(stored_state(&state), run_at, now),
        payload: r.get(3)?,
        priority: r.get(4)?,
        attempt: r.get(5)?,
        budget_used: r.get(6)?,
        max_attempts: r.get(7)?,
        dedup_key: r.get(8)?,
        run_at,
        enqueued_at: Millis(r.get(10)?),
        finished_at: r.get::<_, Option<i64>>(11)?.map(Millis),
        result: r.get(12)?,
        last_error: r.get(13)?,
        attempts: Vec::new(),
    })
}

fn load_job(conn: &Connection, id: &str, now: Millis) -> Result<Option<Job>, StoreError> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1");
    Ok(conn
        .prepare_cached(&sql)?
        .query_row([id], |r| job_from_row(r, now))
        .optional()?)
}

fn load_attempts(conn: &Connection, id: &str) -> Result<Vec<Attempt>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT number, token, started_at, ended_at, outcome, error, plugin_version FROM attempts \
         WHERE job_id = ?1 ORDER BY number",
    )?;
    let rows = stmt.query_map([id], |r| {
        let outcome: String = r.get(4)?;
        Ok(Attempt {
            number: r.get(0)?,
            fencing_token: u64::try_from(r.get::<_, i64>(1)?).unwrap_or(0),
            started_at: Millis(r.get(2)?),
            ended_at: r.get::<_, Option<i64>>(3)?.map(Millis),
            outcome: AttemptOutcome::parse(&outcome).unwrap_or(AttemptOutcome::Error),
            error: r.get(5)?,
            plugin_version: r.get(6)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn require_job(conn: &Connection, id: &str, now: Millis) -> Result<Job, StoreError> {
    load_job(conn, id, now)?.ok_or_else(|| StoreError::NotFound(id.to_owned()))
}

/// Checks that `lease` holds its job: the job is active under that token.
fn check_lease(conn: &Connection, lease: &LeaseRef) -> Result<(), StoreError> {
    let held: Option<i64> = conn
        .prepare_cached("SELECT lease_token FROM jobs WHERE id = ?1 AND state = 'active'")?
        .query_row([&lease.job_id], |r| r.get(0))
        .optional()?
        .flatten();
    let token = held.and_then(|t| u64::try_from(t).ok());
    if rules::holds(JobState::Active, token, lease) {
        Ok(())
    } else {
        Err(rules::fenced(lease))
    }
}

/// Releases the job's dedup key if it still points at this job and is not
/// held by `dedup_for` (compare-and-swap on the holder).
fn release_dedup(conn: &Connection, job_id: &str, now: Millis) -> Result<(), StoreError> {
    conn.prepare_cached(
        "DELETE FROM dedup WHERE (queue, key) IN \
           (SELECT queue, dedup_key FROM jobs WHERE id = ?1 AND dedup_key IS NOT NULL) \
         AND job_id = ?1 AND (hold_until IS NULL OR hold_until <= ?2)",
    )?
    .execute(params![job_id, now.0])?;
    Ok(())
}

fn enqueue_one(
    w: &mut Writer,
    job: NewJob,
    index: usize,
    now: Millis,
) -> Result<Enqueued, StoreError> {
    let conn = &w.conn;
    if let Some(id) = &job.id
        && let Some(existing) = load_job(conn, id, now)?
    {
        if crate::job::same_payload(&existing.payload, &job.payload) && existing.queue == job.queue
        {
            return Ok(Enqueued {
                job: existing,
                deduplicated: true,
            });
        }
        return Err(StoreError::IdReused {
            id: id.clone(),
            index,
        });
    }
    if let Some(key) = &job.dedup_key {
        let holder: Option<(String, Option<i64>)> = conn
            .prepare_cached("SELECT job_id, hold_until FROM dedup WHERE queue = ?1 AND key = ?2")?
            .query_row(params![job.queue, key], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        if let Some((holder_id, hold_until)) = holder
            && let Some(holder) = load_job(conn, &holder_id, now)?
            && (holder.state.is_live() || hold_until.is_some_and(|h| h > now.0))
        {
            return Ok(Enqueued {
                job: holder,
                deduplicated: true,
            });
        }
    }
    let id = job.id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let seq = w.next_seq;
    w.next_seq += 1;
    conn.prepare_cached(
        "INSERT INTO jobs (id, queue, state, payload, priority, run_at, seq, max_attempts, dedup_key, enqueued_at) \
         VALUES (?1, ?2, 'waiting', ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
        id,
        job.queue,
        job.payload,
        job.priority,
        job.run_at.0,
        seq,
        job.max_attempts,
        job.dedup_key,
        now.0
    ])?;
    if let Some(key) = &job.dedup_key {
        let hold_until = job.dedup_for.map(|d| now.plus(d).0);
        conn.prepare_cached(
            "INSERT OR REPLACE INTO dedup (queue, key, job_id, hold_until) VALUES (?1, ?2, ?3, ?4)",
        )?
        .execute(params![job.queue, key, id, hold_until])?;
    }
    // The row just written, without reading it back.
    Ok(Enqueued {
        job: Job {
            id,
            queue: job.queue,
            state: visible_state(JobState::Waiting, job.run_at, now),
            payload: job.payload,
            priority: job.priority,
            attempt: 0,
            budget_used: 0,
            max_attempts: job.max_attempts,
            dedup_key: job.dedup_key,
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

fn lease_batch(
    w: &mut Writer,
    queue: &str,
    max: u32,
    plugin_version: &str,
    now: Millis,
) -> Result<Vec<Lease>, StoreError> {
    let picked: Vec<(String, String, u32, u32, i64)> = w
        .conn
        .prepare_cached(
            "SELECT id, payload, attempt, max_attempts, enqueued_at FROM jobs INDEXED BY jobs_ready \
             WHERE queue = ?1 AND state = 'waiting' AND run_at <= ?2 \
             ORDER BY priority DESC, run_at, seq LIMIT ?3",
        )?
        .query_map(params![queue, now.0, max], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<Result<_, _>>()?;
    let mut leases = Vec::with_capacity(picked.len());
    for (id, payload, attempt, max_attempts, enqueued_at) in picked {
        let token = w.next_token;
        w.next_token += 1;
        let number = attempt + 1;
        let t = i64::try_from(token).unwrap_or(i64::MAX);
        w.conn
            .prepare_cached(
                "UPDATE jobs SET state = 'active', attempt = ?2, budget_used = budget_used + 1, \
                 lease_token = ?3 WHERE id = ?1",
            )?
            .execute(params![id, number, t])?;
        w.conn
            .prepare_cached(
                "INSERT INTO attempts (job_id, number, token, started_at, outcome, plugin_version) \
                 VALUES (?1, ?2, ?3, ?4, 'running', ?5)",
            )?
            .execute(params![id, number, t, now.0, plugin_version])?;
        leases.push(Lease {
            job_id: id,
            queue: queue.to_owned(),
            payload,
            attempt: number,
            max_attempts,
            enqueued_at: Millis(enqueued_at),
            token,
        });
    }
    Ok(leases)
}

fn close_attempt(
    conn: &Connection,
    lease: &LeaseRef,
    outcome: AttemptOutcome,
    error: Option<&str>,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE attempts SET ended_at = ?3, outcome = ?4, error = ?5 \
         WHERE job_id = ?1 AND token = ?2 AND ended_at IS NULL",
    )?
    .execute(params![
        lease.job_id,
        i64::try_from(lease.token).unwrap_or(i64::MAX),
        now.0,
        outcome.as_str(),
        error
    ])?;
    Ok(())
}

/// Moves a job to a final state (completed, dead, cancelled).
fn end_job(
    conn: &Connection,
    id: &str,
    state: JobState,
    result: Option<&str>,
    error: Option<&str>,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE jobs SET state = ?2, finished_at = ?3, result = COALESCE(?4, result), \
         last_error = COALESCE(?5, last_error), lease_token = NULL WHERE id = ?1",
    )?
    .execute(params![id, state.as_str(), now.0, result, error])?;
    release_dedup(conn, id, now)
}

/// Writes what a rule decided for a job: an end (completed or dead), or
/// back to waiting at its `run_at`, refunded or not.
fn move_job(conn: &Connection, id: &str, m: &rules::Move, now: Millis) -> Result<(), StoreError> {
    if m.ends() {
        return end_job(
            conn,
            id,
            m.state,
            m.result.as_deref(),
            m.error.as_deref(),
            now,
        );
    }
    conn.prepare_cached(
        "UPDATE jobs SET state = 'waiting', run_at = ?2, last_error = COALESCE(?3, last_error), \
         lease_token = NULL, budget_used = MAX(budget_used - ?4, 0) WHERE id = ?1",
    )?
    .execute(params![
        id,
        m.run_at.unwrap_or(now).0,
        m.error,
        i64::from(m.refund)
    ])?;
    Ok(())
}

fn finish_step(
    w: &mut Writer,
    lease: &LeaseRef,
    finish: Finish,
    now: Millis,
) -> Result<JobState, StoreError> {
    let conn = &w.conn;
    let job = require_job(conn, &lease.job_id, now)?;
    let held = rules::Held {
        state: job.state,
        budget_used: job.budget_used,
        max_attempts: job.max_attempts,
        holds: check_lease(conn, lease).is_ok(),
        expired: false,
    };
    let ending = rules::finish(held, finish, now);
    close_attempt(conn, lease, ending.outcome, ending.error.as_deref(), now)?;
    if let Some(m) = &ending.then {
        move_job(conn, &job.id, m, now)?;
    }
    ending.answer(lease, now)
}

fn recover_step(w: &mut Writer, now: Millis) -> Result<u64, StoreError> {
    let conn = &w.conn;
    let active: Vec<(String, i64, u32, u32)> = conn
        .prepare(
            "SELECT id, lease_token, budget_used, max_attempts FROM jobs WHERE state = 'active'",
        )?
        .query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get::<_, Option<i64>>(1)?.unwrap_or(0),
                r.get(2)?,
                r.get(3)?,
            ))
        })?
        .collect::<Result<_, _>>()?;
    let error = rules::ABANDONED;
    for (id, token, used, max) in &active {
        let lease = LeaseRef {
            job_id: id.clone(),
            token: u64::try_from(*token).unwrap_or(0),
        };
        close_attempt(conn, &lease, AttemptOutcome::Abandoned, Some(error), now)?;
        move_job(conn, id, &rules::abandon(*used, *max, error, now), now)?;
    }
    // Attempts left open without an active job (should not happen) are closed too.
    conn.execute(
        "UPDATE attempts SET ended_at = ?1, outcome = 'abandoned', error = ?2 WHERE ended_at IS NULL",
        params![now.0, error],
    )?;
    Ok(active.len() as u64)
}

fn cancel_step(w: &mut Writer, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
    let conn = &w.conn;
    let job = require_job(conn, id, now)?;
    if !job.state.is_live() {
        return Err(StoreError::InvalidState {
            id: id.to_owned(),
            state: job.state,
            wanted: "only a waiting, delayed or active job can be cancelled",
        });
    }
    let was_active = job.state == JobState::Active;
    end_job(conn, id, JobState::Cancelled, None, None, now)?;
    Ok((require_job(conn, id, now)?, was_active))
}

fn retry_step(w: &mut Writer, id: &str, now: Millis) -> Result<Job, StoreError> {
    let conn = &w.conn;
    let job = require_job(conn, id, now)?;
    if !matches!(job.state, JobState::Dead | JobState::Cancelled) {
        return Err(StoreError::InvalidState {
            id: id.to_owned(),
            state: job.state,
            wanted: "only a dead or cancelled job can be retried",
        });
    }
    conn.execute(
        "UPDATE jobs SET state = 'waiting', run_at = ?2, budget_used = 0, finished_at = NULL \
         WHERE id = ?1",
        params![id, now.0],
    )?;
    // Take the dedup key back if no other job holds it.
    if let Some(key) = &job.dedup_key {
        conn.execute(
            "INSERT OR IGNORE INTO dedup (queue, key, job_id, hold_until) VALUES (?1, ?2, ?3, NULL)",
            params![job.queue, key, id],
        )?;
    }
    require_job(conn, id, now)
}

fn sweep_step(
    w: &mut Writer,
    now: Millis,
    rules: &RetentionRules,
    limit: u32,
) -> Result<Swept, StoreError> {
    let conn = &w.conn;
    let mut swept = Swept {
        jobs: sweep_jobs(
            conn,
            now,
            "jobs_finished",
            "state IN ('completed', 'cancelled')",
            rules.jobs,
            limit,
        )?,
        dead_jobs: sweep_jobs(conn, now, "jobs_dead", "state = 'dead'", rules.dead, limit)?,
        ..Swept::default()
    };
    swept.fences = conn
        .prepare_cached(
            "DELETE FROM fences WHERE (namespace, kind, key) IN \
             (SELECT namespace, kind, key FROM fences WHERE state = 'done' AND updated_at < ?1 LIMIT ?2)",
        )?
        .execute(params![now.minus(rules.fences).0, limit])? as u64;
    // A dedup row whose hold expired and whose job is no longer live.
    swept.dedup_keys = conn
        .prepare_cached(
            "DELETE FROM dedup WHERE (queue, key) IN (SELECT d.queue, d.key FROM dedup d \
               LEFT JOIN jobs j ON j.id = d.job_id \
               WHERE (d.hold_until IS NULL OR d.hold_until <= ?1) \
                 AND (j.id IS NULL OR j.state NOT IN ('waiting', 'active')) LIMIT ?2)",
        )?
        .execute(params![now.0, limit])? as u64;
    swept.tombstones = conn
        .prepare_cached(
            "DELETE FROM index_docs WHERE (collection, id) IN (SELECT collection, id \
               FROM index_docs INDEXED BY index_tombstones \
               WHERE document IS NULL AND updated_at < ?1 LIMIT ?2)",
        )?
        .execute(params![now.minus(rules.tombstones).0, limit])? as u64;
    for (ns, keep) in &rules.kv {
        let room = u64::from(limit).saturating_sub(swept.kv);
        if room == 0 {
            break;
        }
        swept.kv += conn
            .prepare_cached(
                "DELETE FROM kv WHERE (namespace, key) IN (SELECT namespace, key \
                   FROM kv INDEXED BY kv_written \
                   WHERE namespace = ?1 AND written_at < ?2 LIMIT ?3)",
            )?
            .execute(params![
                ns,
                now.minus(*keep).0,
                i64::try_from(room).unwrap_or(i64::MAX)
            ])? as u64;
    }
    Ok(swept)
}

/// Removes up to `limit` jobs matching `state_filter` (served by `index`)
/// that finished before `now - keep`, with their attempts and effects,
/// releasing their dedup keys. Returns how many.
fn sweep_jobs(
    conn: &Connection,
    now: Millis,
    index: &str,
    state_filter: &str,
    keep: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    let ids: Vec<String> = conn
        .prepare_cached(&format!(
            "SELECT id FROM jobs INDEXED BY {index} WHERE {state_filter} AND finished_at < ?1 LIMIT ?2"
        ))?
        .query_map(params![now.minus(keep).0, limit], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for id in &ids {
        release_dedup(conn, id, now)?;
        conn.prepare_cached("DELETE FROM attempts WHERE job_id = ?1")?
            .execute([id])?;
        conn.prepare_cached("DELETE FROM effects WHERE job_id = ?1")?
            .execute([id])?;
        conn.prepare_cached("DELETE FROM jobs WHERE id = ?1")?
            .execute([id])?;
    }
    Ok(ids.len() as u64)
}

fn kv_get_step(conn: &Connection, ns: &str, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT value FROM kv WHERE namespace = ?1 AND key = ?2")?
        .query_row(params![ns, key], |r| r.get(0))
        .optional()?)
}

fn index_read(
    conn: &Connection,
    collection: &str,
    id: &str,
) -> Result<Option<(Option<String>, u64)>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT document, version FROM index_docs WHERE collection = ?1 AND id = ?2",
        )?
        .query_row(params![collection, id], |r| {
            Ok((r.get(0)?, u64::try_from(r.get::<_, i64>(1)?).unwrap_or(0)))
        })
        .optional()?)
}

fn version_param(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

const FENCE_COLUMNS: &str = "namespace, kind, key, state, fingerprint, job_id, attempt, token, result, created_at, updated_at";

fn fence_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Fence> {
    let state: String = r.get(3)?;
    Ok(Fence {
        id: FenceId {
            namespace: r.get(0)?,
            kind: r.get(1)?,
            key: r.get(2)?,
        },
        state: FenceState::parse(&state).unwrap_or(FenceState::Uncertain),
        fingerprint: r.get(4)?,
        job_id: r.get(5)?,
        attempt: r.get(6)?,
        token: u64::try_from(r.get::<_, i64>(7)?).unwrap_or(0),
        result: r.get(8)?,
        created_at: Millis(r.get(9)?),
        updated_at: Millis(r.get(10)?),
    })
}

fn load_fence(conn: &Connection, id: &FenceId) -> Result<Option<Fence>, StoreError> {
    let sql = format!(
        "SELECT {FENCE_COLUMNS} FROM fences WHERE namespace = ?1 AND kind = ?2 AND key = ?3"
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![id.namespace, id.kind, id.key], fence_from_row)
        .optional()?)
}

/// Whether the attempt that wrote `f` still holds its job.
fn holder_alive(conn: &Connection, f: &Fence) -> Result<bool, StoreError> {
    rules::alive(check_lease(conn, &rules::holder_lease(f)))
}

fn token_param(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

fn fence_begin_step(
    conn: &Connection,
    lease: &LeaseRef,
    attempt: u32,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin, StoreError> {
    check_lease(conn, lease)?;
    let Some(f) = load_fence(conn, id)? else {
        conn.prepare_cached(
            "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, token, created_at, updated_at) \
             VALUES (?1, ?2, ?3, 'started', ?4, ?5, ?6, ?7, ?8, ?8)",
        )?
        .execute(params![id.namespace, id.kind, id.key, fingerprint, lease.job_id, attempt, token_param(lease.token), now.0])?;
        return Ok(FenceBegin::Started);
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive(conn, &f)?;
            rules::begin_if_alive(f, alive)
        }
    })
}

/// Loads a fence that `lease` may move on: started by that lease, or by an
/// attempt that died.
fn owned_or_abandoned(
    conn: &Connection,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<Fence, StoreError> {
    let (f, ask) = rules::may_move(load_fence(conn, id)?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(conn, &f)?)?;
    }
    Ok(f)
}

/// Loads a `started` fence that `lease` itself holds (nobody took it over).
fn held_by(conn: &Connection, lease: &LeaseRef, id: &FenceId) -> Result<Fence, StoreError> {
    let f = owned_or_abandoned(conn, lease, id)?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
}

fn set_fence(
    conn: &Connection,
    id: &FenceId,
    state: FenceState,
    lease: &LeaseRef,
    attempt: u32,
    result: Option<&[u8]>,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE fences SET state = ?4, job_id = ?5, attempt = ?6, token = ?7, result = COALESCE(?8, result), \
         updated_at = ?9 WHERE namespace = ?1 AND kind = ?2 AND key = ?3",
    )?
    .execute(params![
        id.namespace,
        id.kind,
        id.key,
        state.as_str(),
        lease.job_id,
        attempt,
        token_param(lease.token),
        result,
        now.0
    ])?;
    Ok(())
}

fn delete_fence(conn: &Connection, id: &FenceId) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM fences WHERE namespace = ?1 AND kind = ?2 AND key = ?3")?
        .execute(params![id.namespace, id.kind, id.key])?;
    Ok(())
}

fn fence_resolve_step(
    conn: &Connection,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<(), StoreError> {
    let f = load_fence(conn, id)?.ok_or_else(|| {
        StoreError::NotFound(format!("fence {}/{}/{}", id.namespace, id.kind, id.key))
    })?;
    match f.state {
        FenceState::Done => {
            return Err(invalid_fence(id, "it is done; there is nothing to resolve"));
        }
        FenceState::Started if holder_alive(conn, &f)? => {
            return Err(invalid_fence(
                id,
                format!("a live attempt of job {:?} holds it", f.job_id),
            ));
        }
        FenceState::Started | FenceState::Uncertain => {}
    }
    match resolution {
        Resolution::Done => {
            conn.prepare_cached(
                "UPDATE fences SET state = 'done', result = ?4, updated_at = ?5 \
                 WHERE namespace = ?1 AND kind = ?2 AND key = ?3",
            )?
            .execute(params![
                id.namespace,
                id.kind,
                id.key,
                RESOLVED_BY_OPERATOR,
                now.0
            ])?;
        }
        Resolution::NotDone => delete_fence(conn, id)?,
    }
    Ok(())
}

#[async_trait]
impl Store for SqliteStore {
    fn halted(&self) -> Option<String> {
        self.writer.halt().reason()
    }

    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>, StoreError> {
        self.write(true, move |w| {
            jobs.into_iter()
                .enumerate()
                .map(|(i, j)| enqueue_one(w, j, i, now))
                .collect()
        })
        .await
    }

    async fn lease(
        &self,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>, StoreError> {
        let (queue, version) = (queue.to_owned(), plugin_version.to_owned());
        self.write(false, move |w| lease_batch(w, &queue, max, &version, now))
            .await
    }

    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>, StoreError> {
        let queue = queue.to_owned();
        self.read(move |c| {
            let v: Option<i64> = c
                .prepare_cached(
                    "SELECT MIN(run_at) FROM jobs INDEXED BY jobs_due WHERE queue = ?1 AND state = 'waiting'",
                )?
                .query_row([queue], |r| r.get(0))?;
            Ok(v.map(Millis))
        })
        .await
    }

    async fn finish(
        &self,
        lease: &LeaseRef,
        finish: Finish,
        now: Millis,
    ) -> Result<JobState, StoreError> {
        let lease = lease.clone();
        // A fenced finish still records how its attempt ended: commit that
        // part, then report the fence.
        self.write(true, move |w| match finish_step(w, &lease, finish, now) {
            fenced @ Err(StoreError::Fenced { .. }) => Ok(fenced),
            other => other.map(Ok),
        })
        .await?
    }

    async fn recover(&self, now: Millis) -> Result<u64, StoreError> {
        self.write(true, move |w| recover_step(w, now)).await
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
        let id = id.to_owned();
        self.write(true, move |w| cancel_step(w, &id, now)).await
    }

    async fn retry(&self, id: &str, now: Millis) -> Result<Job, StoreError> {
        let id = id.to_owned();
        self.write(true, move |w| retry_step(w, &id, now)).await
    }

    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>, StoreError> {
        let id = id.to_owned();
        self.read(move |c| {
            let Some(mut job) = load_job(c, &id, now)? else {
                return Ok(None);
            };
            job.attempts = load_attempts(c, &id)?;
            Ok(Some(job))
        })
        .await
    }

    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage, StoreError> {
        self.read(move |c| {
            let limit = filter.limit.clamp(1, 1000);
            let cursor: i64 = match &filter.cursor {
                Some(s) => s
                    .parse()
                    .map_err(|_| StoreError::NotFound(format!("cursor {s:?}")))?,
                None => i64::MAX,
            };
            let mut sql = format!("SELECT {JOB_COLUMNS}, seq FROM jobs WHERE seq < ?1");
            let mut args: Vec<rusqlite::types::Value> = vec![cursor.into()];
            if let Some(q) = &filter.queue {
                args.push(q.clone().into());
                sql.push_str(&format!(" AND queue = ?{}", args.len()));
            }
            match filter.state {
                Some(JobState::Delayed) => {
                    args.push(now.0.into());
                    sql.push_str(&format!(
                        " AND state = 'waiting' AND run_at > ?{}",
                        args.len()
                    ));
                }
                Some(JobState::Waiting) => {
                    args.push(now.0.into());
                    sql.push_str(&format!(
                        " AND state = 'waiting' AND run_at <= ?{}",
                        args.len()
                    ));
                }
                Some(s) => {
                    args.push(s.as_str().to_owned().into());
                    sql.push_str(&format!(" AND state = ?{}", args.len()));
                }
                None => {}
            }
            args.push(i64::from(limit).into());
            sql.push_str(&format!(" ORDER BY seq DESC LIMIT ?{}", args.len()));
            let mut stmt = c.prepare_cached(&sql)?;
            let mut page = PageBuilder::new(limit);
            let mut found = stmt.query(rusqlite::params_from_iter(args))?;
            while page.has_room()
                && let Some(r) = found.next()?
            {
                page.push(job_from_row(r, now)?, r.get(14)?);
            }
            Ok(page.finish())
        })
        .await
    }

    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>, StoreError> {
        self.read(move |c| {
            // The stored states come from the counters; `delayed` (waiting
            // with run_at in the future) is counted on the jobs_due index,
            // which costs what is delayed, not what is stored.
            let mut stmt = c.prepare_cached(
                "SELECT queue, state, n FROM job_counts WHERE n > 0 ORDER BY queue",
            )?;
            let mut delayed = c.prepare_cached(
                "SELECT COUNT(*) FROM jobs WHERE queue = ?1 AND state = 'waiting' AND run_at > ?2",
            )?;
            let mut out: Vec<(String, StateCounts)> = Vec::new();
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            for row in rows {
                let (queue, state, n) = row?;
                if out.last().is_none_or(|(q, _)| *q != queue) {
                    out.push((queue, StateCounts::default()));
                }
                if let Some((_, counts)) = out.last_mut() {
                    counts.add(stored_state(&state), u64::try_from(n).unwrap_or(0));
                }
            }
            for (queue, counts) in &mut out {
                if counts.waiting == 0 {
                    continue;
                }
                let n: i64 = delayed.query_row(params![queue.as_str(), now.0], |r| r.get(0))?;
                let n = u64::try_from(n).unwrap_or(0).min(counts.waiting);
                counts.waiting -= n;
                counts.delayed += n;
            }
            Ok(out)
        })
        .await
    }

    async fn sweep(
        &self,
        now: Millis,
        rules: &RetentionRules,
        limit: u32,
    ) -> Result<Swept, StoreError> {
        let rules = rules.clone();
        self.write(true, move |w| sweep_step(w, now, &rules, limit))
            .await
    }

    async fn kv_get(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            kv_get_step(&w.conn, &ns, &key)
        })
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
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            w.conn
                .prepare_cached(
                    "INSERT OR REPLACE INTO kv (namespace, key, value, written_at) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![ns, key, value, now.0])?;
            Ok(())
        })
        .await
    }

    async fn kv_insert_if_absent(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
        value: Vec<u8>,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let n = w
                .conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO kv (namespace, key, value, written_at) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![ns, key, value, now.0])?;
            Ok(n == 1)
        })
        .await
    }

    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool, StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let n = w
                .conn
                .prepare_cached("DELETE FROM kv WHERE namespace = ?1 AND key = ?2")?
                .execute(params![ns, key])?;
            Ok(n == 1)
        })
        .await
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
        let (lease, collection, id, document) = (
            lease.clone(),
            collection.to_owned(),
            id.to_owned(),
            document.to_owned(),
        );
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let current = index_read(&w.conn, &collection, &id)?;
            let outcome = match current {
                Some((_, v)) if v > version => return Ok(UpsertOutcome::Stale),
                Some((Some(_), v)) if v == version => return Ok(UpsertOutcome::Unchanged),
                Some((None, v)) if v == version => return Ok(UpsertOutcome::Stale),
                Some((Some(_), _)) => UpsertOutcome::Updated,
                Some((None, _)) | None => UpsertOutcome::Inserted,
            };
            w.conn
                .prepare_cached(
                    "INSERT OR REPLACE INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![collection, id, version_param(version), document, now.0])?;
            Ok(outcome)
        })
        .await
    }

    async fn index_remove(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
        version: u64,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let (lease, collection, id) = (lease.clone(), collection.to_owned(), id.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let current = index_read(&w.conn, &collection, &id)?;
            let removed = match current {
                Some((_, v)) if v > version => return Ok(false),
                Some((doc, _)) => doc.is_some(),
                None => false,
            };
            w.conn
                .prepare_cached(
                    "INSERT OR REPLACE INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES (?1, ?2, ?3, NULL, ?4)",
                )?
                .execute(params![collection, id, version_param(version), now.0])?;
            Ok(removed)
        })
        .await
    }

    async fn index_get_leased(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
    ) -> Result<Option<String>, StoreError> {
        let (lease, collection, id) = (lease.clone(), collection.to_owned(), id.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            Ok(index_read(&w.conn, &collection, &id)?.and_then(|(d, _)| d))
        })
        .await
    }

    async fn index_get(
        &self,
        collection: &str,
        id: &str,
    ) -> Result<Option<(String, u64)>, StoreError> {
        let (collection, id) = (collection.to_owned(), id.to_owned());
        self.read(
            move |c| Ok(index_read(c, &collection, &id)?.and_then(|(d, v)| d.map(|d| (d, v)))),
        )
        .await
    }

    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin, StoreError> {
        let (lease, id, fingerprint) = (lease.clone(), id.clone(), fingerprint.to_vec());
        self.write(true, move |w| {
            fence_begin_step(&w.conn, &lease, attempt, &id, &fingerprint, now)
        })
        .await
    }

    async fn fence_take_over(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            check_lease(&w.conn, &lease)?;
            owned_or_abandoned(&w.conn, &lease, &id)?;
            set_fence(
                &w.conn,
                &id,
                FenceState::Started,
                &lease,
                attempt,
                None,
                now,
            )
        })
        .await
    }

    async fn fence_done(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            held_by(&w.conn, &lease, &id)?;
            set_fence(
                &w.conn,
                &id,
                FenceState::Done,
                &lease,
                attempt,
                Some(&result),
                now,
            )
        })
        .await
    }

    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            held_by(&w.conn, &lease, &id)?;
            delete_fence(&w.conn, &id)
        })
        .await
    }

    async fn fence_uncertain(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            owned_or_abandoned(&w.conn, &lease, &id)?;
            set_fence(
                &w.conn,
                &id,
                FenceState::Uncertain,
                &lease,
                attempt,
                None,
                now,
            )
        })
        .await
    }

    async fn fence_resolve(
        &self,
        id: &FenceId,
        resolution: Resolution,
        now: Millis,
    ) -> Result<(), StoreError> {
        let id = id.clone();
        self.write(true, move |w| {
            fence_resolve_step(&w.conn, &id, resolution, now)
        })
        .await
    }

    async fn fences(
        &self,
        namespace: Option<&str>,
        state: Option<FenceState>,
        limit: u32,
    ) -> Result<Vec<Fence>, StoreError> {
        let namespace = namespace.map(str::to_owned);
        self.read(move |c| {
            let sql = format!(
                "SELECT {FENCE_COLUMNS} FROM fences WHERE (?1 IS NULL OR namespace = ?1) \
                 AND (?2 IS NULL OR state = ?2) ORDER BY updated_at DESC LIMIT ?3"
            );
            let rows = c
                .prepare_cached(&sql)?
                .query_map(
                    params![
                        namespace,
                        state.map(FenceState::as_str),
                        limit.clamp(1, 1000)
                    ],
                    fence_from_row,
                )?
                .collect::<Result<_, _>>()?;
            Ok(rows)
        })
        .await
    }

    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<(), StoreError> {
        let job_id = job_id.to_owned();
        self.write(false, move |w| {
            w.conn
                .prepare_cached(
                    "INSERT INTO effects (job_id, attempt, n, kind, key, outcome, at) VALUES \
                     (?1, ?2, (SELECT COALESCE(MAX(n), 0) + 1 FROM effects WHERE job_id = ?1 AND attempt = ?2), ?3, ?4, ?5, ?6)",
                )?
                .execute(params![job_id, record.attempt, record.kind, record.key, record.outcome, record.at.0])?;
            Ok(())
        })
        .await
    }

    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
        let job_id = job_id.to_owned();
        self.read(move |c| {
            let rows = c
                .prepare_cached("SELECT attempt, kind, key, outcome, at FROM effects WHERE job_id = ?1 ORDER BY attempt, n")?
                .query_map([job_id], |r| {
                    Ok(EffectRecord {
                        attempt: r.get(0)?,
                        kind: r.get(1)?,
                        key: r.get(2)?,
                        outcome: r.get(3)?,
                        at: Millis(r.get(4)?),
                    })
                })?
                .collect::<Result<_, _>>()?;
            Ok(rows)
        })
        .await
    }

    async fn export(
        &self,
        cursor: Option<copy::Cursor>,
        limit: u32,
    ) -> Result<copy::ExportPage, StoreError> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        self.read(move |c| export_page(c, &cursor, limit)).await
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        self.write(true, move |w| import_step(w, &records)).await
    }
}

// ---------------------------------------------------------------------------
// Moving a ledger (`store::copy`)
// ---------------------------------------------------------------------------

use super::copy;

fn sqlite_placeholder(i: usize) -> String {
    format!("?{i}")
}

/// The parameters of a page query: the cursor's key parts, then the limit.
fn page_params(cursor: &copy::Cursor, limit: u32) -> Vec<rusqlite::types::Value> {
    let mut v: Vec<rusqlite::types::Value> =
        cursor.after.iter().map(|a| a.clone().into()).collect();
    v.push(i64::from(limit).into());
    v
}

fn u64_col(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<u64> {
    Ok(u64::try_from(r.get::<_, i64>(i)?).unwrap_or(0))
}

fn bad_row(what: String) -> StoreError {
    unavailable(format!("cannot export {what}"))
}

/// One page of the export, read in one snapshot.
fn export_page(
    conn: &Connection,
    cursor: &copy::Cursor,
    limit: u32,
) -> Result<copy::ExportPage, StoreError> {
    use copy::{Record, Section};
    let tx = rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Deferred)?;
    let params = page_params(cursor, limit);
    let query = |select: &str, keys: &[&str]| {
        copy::page_sql(select, keys, &cursor.after, sqlite_placeholder)
    };
    let (records, last): (Vec<Record>, Vec<String>) = match cursor.section {
        Section::Jobs => {
            let sql = query(
                "SELECT id, queue, state, payload, priority, run_at, seq, attempt, budget_used, \
                 max_attempts, dedup_key, enqueued_at, finished_at, result, last_error, lease_token \
                 FROM jobs",
                &["id"],
            )?;
            let mut stmt = tx.prepare(&sql)?;
            let rows: Vec<(copy::JobRecord, String)> = stmt
                .query_map(rusqlite::params_from_iter(params), |r| {
                    Ok((
                        copy::JobRecord {
                            id: r.get(0)?,
                            queue: r.get(1)?,
                            state: JobState::Waiting,
                            payload: r.get(3)?,
                            priority: r.get(4)?,
                            run_at: Millis(r.get(5)?),
                            seq: u64_col(r, 6)?,
                            attempt: r.get(7)?,
                            budget_used: r.get(8)?,
                            max_attempts: r.get(9)?,
                            dedup_key: r.get(10)?,
                            enqueued_at: Millis(r.get(11)?),
                            finished_at: r.get::<_, Option<i64>>(12)?.map(Millis),
                            result: r.get(13)?,
                            last_error: r.get(14)?,
                            lease_token: r
                                .get::<_, Option<i64>>(15)?
                                .map(|t| u64::try_from(t).unwrap_or(0)),
                            attempts: Vec::new(),
                            effects: Vec::new(),
                        },
                        r.get::<_, String>(2)?,
                    ))
                })?
                .collect::<Result<_, _>>()?;
            let mut attempts = tx.prepare(
                "SELECT number, token, started_at, ended_at, outcome, error, plugin_version \
                 FROM attempts WHERE job_id = ?1 ORDER BY number",
            )?;
            let mut effects = tx.prepare(
                "SELECT attempt, kind, key, outcome, at FROM effects WHERE job_id = ?1 \
                 ORDER BY attempt, n",
            )?;
            let mut out = Vec::with_capacity(rows.len());
            for (mut job, state) in rows {
                job.state = state
                    .parse()
                    .map_err(|e| bad_row(format!("job {:?}: {e}", job.id)))?;
                let found: Vec<(copy::AttemptRecord, String)> = attempts
                    .query_map([&job.id], |r| {
                        Ok((
                            copy::AttemptRecord {
                                number: r.get(0)?,
                                token: u64_col(r, 1)?,
                                started_at: Millis(r.get(2)?),
                                ended_at: r.get::<_, Option<i64>>(3)?.map(Millis),
                                outcome: AttemptOutcome::Running,
                                error: r.get(5)?,
                                plugin_version: r.get(6)?,
                            },
                            r.get::<_, String>(4)?,
                        ))
                    })?
                    .collect::<Result<_, _>>()?;
                for (mut a, outcome) in found {
                    a.outcome = AttemptOutcome::parse(&outcome).ok_or_else(|| {
                        bad_row(format!(
                            "attempt {} of job {:?}: unknown outcome {outcome:?}",
                            a.number, job.id
                        ))
                    })?;
                    job.attempts.push(a);
                }
                job.effects = effects
                    .query_map([&job.id], |r| {
                        Ok(copy::EffectRow {
                            attempt: r.get(0)?,
                            kind: r.get(1)?,
                            key: r.get(2)?,
                            outcome: r.get(3)?,
                            at: Millis(r.get(4)?),
                        })
                    })?
                    .collect::<Result<_, _>>()?;
                out.push(job);
            }
            let last = out.last().map(|j| vec![j.id.clone()]).unwrap_or_default();
            (out.into_iter().map(Record::Job).collect(), last)
        }
        Section::Dedup => {
            let sql = query(
                "SELECT queue, key, job_id, hold_until FROM dedup",
                &["queue", "key"],
            )?;
            let out: Vec<copy::DedupRecord> = tx
                .prepare(&sql)?
                .query_map(rusqlite::params_from_iter(params), |r| {
                    Ok(copy::DedupRecord {
                        queue: r.get(0)?,
                        key: r.get(1)?,
                        job_id: r.get(2)?,
                        hold_until: r.get::<_, Option<i64>>(3)?.map(Millis),
                    })
                })?
                .collect::<Result<_, _>>()?;
            let last = out
                .last()
                .map(|d| vec![d.queue.clone(), d.key.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Dedup).collect(), last)
        }
        Section::Fences => {
            let sql = query(
                &format!("SELECT {FENCE_COLUMNS} FROM fences"),
                &["namespace", "kind", "key"],
            )?;
            let out: Vec<(Fence, String)> = tx
                .prepare(&sql)?
                .query_map(rusqlite::params_from_iter(params), |r| {
                    Ok((fence_from_row(r)?, r.get::<_, String>(3)?))
                })?
                .collect::<Result<_, _>>()?;
            let mut records = Vec::with_capacity(out.len());
            for (f, state) in out {
                let state = FenceState::parse(&state).ok_or_else(|| {
                    bad_row(format!(
                        "fence {}/{}/{}: unknown state {state:?}",
                        f.id.namespace, f.id.kind, f.id.key
                    ))
                })?;
                records.push(copy::FenceRecord {
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
            let last = records
                .last()
                .map(|f| vec![f.namespace.clone(), f.kind.clone(), f.key.clone()])
                .unwrap_or_default();
            (records.into_iter().map(Record::Fence).collect(), last)
        }
        Section::Kv => {
            let sql = query(
                "SELECT namespace, key, value, written_at FROM kv",
                &["namespace", "key"],
            )?;
            let out: Vec<copy::KvRecord> = tx
                .prepare(&sql)?
                .query_map(rusqlite::params_from_iter(params), |r| {
                    Ok(copy::KvRecord {
                        namespace: r.get(0)?,
                        key: r.get(1)?,
                        value: r.get(2)?,
                        written_at: Millis(r.get(3)?),
                    })
                })?
                .collect::<Result<_, _>>()?;
            let last = out
                .last()
                .map(|k| vec![k.namespace.clone(), k.key.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Kv).collect(), last)
        }
        Section::Index => {
            let sql = query(
                "SELECT collection, id, version, document, updated_at FROM index_docs",
                &["collection", "id"],
            )?;
            let out: Vec<copy::IndexRecord> = tx
                .prepare(&sql)?
                .query_map(rusqlite::params_from_iter(params), |r| {
                    Ok(copy::IndexRecord {
                        collection: r.get(0)?,
                        id: r.get(1)?,
                        version: u64_col(r, 2)?,
                        document: r.get(3)?,
                        updated_at: Millis(r.get(4)?),
                    })
                })?
                .collect::<Result<_, _>>()?;
            let last = out
                .last()
                .map(|i| vec![i.collection.clone(), i.id.clone()])
                .unwrap_or_default();
            (out.into_iter().map(Record::Index).collect(), last)
        }
        Section::Counters => {
            let (token, seq): (i64, i64) = tx.query_row(
                "SELECT (SELECT value FROM meta WHERE key = 'fencing_token'), \
                 MAX((SELECT value FROM meta WHERE key = 'seq'), (SELECT COALESCE(MAX(seq), 0) FROM jobs))",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            let counters = copy::Counters {
                fencing_token: u64::try_from(token).unwrap_or(0),
                enqueue_seq: u64::try_from(seq).unwrap_or(0),
            };
            return Ok(copy::ExportPage {
                records: vec![Record::Counters(counters)],
                next: None,
            });
        }
    };
    drop(tx);
    let next = copy::Cursor::after_page(cursor.section, records.len(), limit, last);
    Ok(copy::ExportPage { records, next })
}

/// Writes one page of imported records in the writer's step (the caller's
/// savepoint: all or none) and moves the writer's counters past them; the
/// group's commit persists those with the records.
fn import_step(w: &mut Writer, records: &[copy::Record]) -> Result<(), StoreError> {
    use copy::Record;
    let conn = &w.conn;
    for record in records {
        let inserted = match record {
            Record::Job(j) => {
                let state = j.stored_state();
                let n = conn
                    .prepare_cached(
                        "INSERT OR IGNORE INTO jobs (id, queue, state, payload, priority, run_at, seq, \
                         attempt, budget_used, max_attempts, dedup_key, enqueued_at, finished_at, \
                         result, last_error, lease_token) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
                    )?
                    .execute(params![
                        j.id,
                        j.queue,
                        state.as_str(),
                        j.payload,
                        j.priority,
                        j.run_at.0,
                        token_param(j.seq),
                        j.attempt,
                        j.budget_used,
                        j.max_attempts,
                        j.dedup_key,
                        j.enqueued_at.0,
                        j.finished_at.map(|m| m.0),
                        j.result,
                        j.last_error,
                        j.lease_token.map(token_param),
                    ])?;
                if n == 1 {
                    for a in &j.attempts {
                        conn.prepare_cached(
                            "INSERT INTO attempts \
                             (job_id, number, token, started_at, ended_at, outcome, error, plugin_version) \
                             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                        )?
                        .execute(params![
                            j.id,
                            a.number,
                            token_param(a.token),
                            a.started_at.0,
                            a.ended_at.map(|m| m.0),
                            a.outcome.as_str(),
                            a.error,
                            a.plugin_version,
                        ])?;
                    }
                    for (n, e) in j.numbered_effects() {
                        conn.prepare_cached(
                            "INSERT INTO effects (job_id, attempt, n, kind, key, outcome, at) \
                             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                        )?
                        .execute(params![j.id, e.attempt, n, e.kind, e.key, e.outcome, e.at.0])?;
                    }
                }
                n
            }
            Record::Dedup(d) => conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO dedup (queue, key, job_id, hold_until) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![d.queue, d.key, d.job_id, d.hold_until.map(|m| m.0)])?,
            Record::Fence(f) => conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO fences (namespace, kind, key, state, fingerprint, job_id, \
                     attempt, token, result, created_at, updated_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                )?
                .execute(params![
                    f.namespace,
                    f.kind,
                    f.key,
                    f.state.as_str(),
                    f.fingerprint,
                    f.job_id,
                    f.attempt,
                    token_param(f.token),
                    f.result,
                    f.created_at.0,
                    f.updated_at.0,
                ])?,
            Record::Kv(k) => conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO kv (namespace, key, value, written_at) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![k.namespace, k.key, k.value, k.written_at.0])?,
            Record::Index(i) => conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![
                    i.collection,
                    i.id,
                    version_param(i.version),
                    i.document,
                    i.updated_at.0
                ])?,
            Record::Counters(_) => 1,
        };
        if inserted != 1 {
            return Err(copy::already_there(record));
        }
    }
    let c = copy::Counters::of(records);
    w.next_token = w.next_token.max(c.fencing_token.saturating_add(1));
    w.next_seq = w.next_seq.max(token_param(c.enqueue_seq).saturating_add(1));
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::SqliteStore;
    use crate::store::Store;

    crate::conformance_tests!(|| async {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(dir.path()).expect("open"));
        (dir, store)
    });

    /// Readers that always hold a snapshot starve SQLite's passive
    /// checkpoints; the writer's own checkpoint keeps the WAL bounded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wal_stays_bounded_while_readers_never_let_go() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path()).expect("open");
        let db = store.path().to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        // Two readers whose read transactions overlap: at every moment one
        // of them holds a snapshot.
        let readers: Vec<_> = (0..2)
            .map(|i| {
                let (db, stop) = (db.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let conn = rusqlite::Connection::open(&db).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(5 * i));
                    while !stop.load(Ordering::Relaxed) {
                        conn.execute_batch("BEGIN").unwrap();
                        let _: i64 = conn
                            .query_row("SELECT count(*) FROM jobs", [], |r| r.get(0))
                            .unwrap();
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        conn.execute_batch("COMMIT").unwrap();
                    }
                })
            })
            .collect();
        let payload = format!("\"{}\"", "x".repeat(64 << 10));
        let mut biggest = 0;
        for batch in 0..40 {
            let jobs = (0..50)
                .map(|i| crate::job::NewJob {
                    queue: "q".into(),
                    id: Some(format!("{batch}-{i}")),
                    payload: payload.clone(),
                    priority: 0,
                    run_at: crate::job::Millis(0),
                    max_attempts: 1,
                    dedup_key: None,
                    dedup_for: None,
                })
                .collect();
            store.enqueue(jobs, crate::job::Millis(0)).await.unwrap();
            let wal = std::fs::metadata(format!("{}-wal", db.display())).map_or(0, |m| m.len());
            biggest = biggest.max(wal);
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        // 130 MB were written; the WAL never held much more than its limit.
        assert_eq!(super::WAL_LIMIT, 64 << 20);
        assert!(biggest < 72 << 20, "the WAL reached {biggest} bytes");
    }

    #[test]
    fn a_second_daemon_is_kept_off_the_ledger() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _first = SqliteStore::open(dir.path()).expect("open");
        let second = SqliteStore::open(dir.path());
        assert!(
            second
                .unwrap_err()
                .to_string()
                .contains("another khata daemon")
        );
    }

    #[tokio::test]
    async fn migrating_a_version_one_ledger_counts_its_jobs() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let conn = rusqlite::Connection::open(dir.path().join("khata.db")).unwrap();
            conn.execute_batch(super::MIGRATIONS[0]).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
            for (i, state) in ["waiting", "waiting", "completed", "dead"]
                .iter()
                .enumerate()
            {
                conn.execute(
                    "INSERT INTO jobs (id, queue, state, payload, priority, run_at, seq, max_attempts, enqueued_at) \
                     VALUES (?1, 'q', ?2, '{}', 0, 0, ?1, 3, 0)",
                    rusqlite::params![i64::try_from(i).unwrap(), state],
                )
                .unwrap();
            }
        }
        let store = SqliteStore::open(dir.path()).expect("open");
        let counts = store.counts(crate::job::Millis(1)).await.unwrap();
        let q = &counts[0].1;
        assert_eq!((q.waiting, q.completed, q.dead), (2, 1, 1), "{q:?}");
    }

    /// Migration 4 gives each kv entry of an older ledger a write time (the
    /// migration's), from which `[retention] kv` counts.
    #[test]
    fn migrating_a_version_three_ledger_dates_its_kv_entries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("khata.db");
        {
            let conn = rusqlite::Connection::open(&path).unwrap();
            for sql in &super::MIGRATIONS[..3] {
                conn.execute_batch(sql).unwrap();
            }
            conn.pragma_update(None, "user_version", 3).unwrap();
            conn.execute(
                "INSERT INTO kv (namespace, key, value) VALUES ('ns', 'k', x'01')",
                [],
            )
            .unwrap();
        }
        let before = crate::job::Millis::now().0;
        drop(SqliteStore::open(dir.path()).expect("open migrates"));
        let conn = rusqlite::Connection::open(&path).unwrap();
        let (value, written_at): (Vec<u8>, i64) = conn
            .query_row("SELECT value, written_at FROM kv", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        assert_eq!(value, [1]);
        assert!(
            (before - 1_000..=crate::job::Millis::now().0 + 1_000).contains(&written_at),
            "written_at {written_at}, migrated at about {before}"
        );
    }
}
