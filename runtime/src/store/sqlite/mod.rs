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

use rusqlite::{Connection, OptionalExtension, params};

use super::copy;
use super::rules::{self, stored_state, visible_state};
use super::writer::{Engine, GroupWriter};
use super::{
    EffectRecord, Fence, FenceId, FenceState, JobFilter, JobPage, PageBuilder, RetentionRules,
    StoreError, Swept,
};
use crate::job::{
    Attempt, AttemptOutcome, Enqueued, Finish, Job, JobState, Lease, LeaseRef, Millis, NewJob,
    StateCounts,
};

/// Reader connections kept open.
const READERS: usize = 4;

/// The writer thread's state: the writing connection and the counters it
/// issues from (written into the group that issued them).
pub(in crate::store) struct Writer {
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
    readers: Readers,
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

impl SqliteStore {
    /// Opens (creating if needed) the ledger `khata.db` in `dir`, migrating
    /// its schema, and takes the directory's lock.
    pub fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        let lock = super::embedded::lock_data_dir(dir)?;
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
            readers: Readers {
                pool: Arc::new(Mutex::new(readers)),
                path: path.clone(),
            },
            path,
            _lock: lock,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
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

/// The crash tests' commit failure (`crate::failpoints`): armed as
/// `sqlite::commit=return(<path>)`, every commit fails once a file exists at
/// `<path>` (so a test decides when, after start-up).
fn injected_commit_failure() -> Result<(), StoreError> {
    if let Some(path) = crate::failpoints::armed("sqlite::commit")
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

mod enqueue;
mod export;
mod fences;
mod finish;
mod kv_index;
mod lease;
mod ledger;
mod reads;
mod schema;
mod sweep;

use self::enqueue::*;
use self::export::*;
use self::fences::*;
use self::finish::*;
use self::kv_index::*;
use self::lease::*;
use self::reads::{Readers, effects_of};
pub use self::schema::*;
use self::sweep::*;

#[cfg(test)]
mod tests;
