//! The schema, its migrations, and opening a connection with the pragmas
//! every connection needs.

use super::*;

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = 4;

/// The schema, one entry per version; entry `i` moves version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[&str] = &[
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

-- One fence per effect (docs/fences.md#fence-states): started -> done, uncertain, or deleted.
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

pub(super) fn open_conn(path: &Path) -> Result<Connection, StoreError> {
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

pub(super) fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
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
