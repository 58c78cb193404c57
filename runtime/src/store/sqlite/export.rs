//! Moving a ledger (`store::copy`): export pages read in one snapshot, and
//! imports written in one transaction of the writer.

use super::*;

pub(super) fn sqlite_placeholder(i: usize) -> String {
    format!("?{i}")
}

/// The parameters of a page query: the cursor's key parts, then the limit.
pub(super) fn page_params(cursor: &copy::Cursor, limit: u32) -> Vec<rusqlite::types::Value> {
    let mut v: Vec<rusqlite::types::Value> =
        cursor.after.iter().map(|a| a.clone().into()).collect();
    v.push(i64::from(limit).into());
    v
}

pub(super) fn u64_col(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<u64> {
    Ok(u64::try_from(r.get::<_, i64>(i)?).unwrap_or(0))
}

pub(super) fn bad_row(what: String) -> StoreError {
    copy::unreadable(what)
}

/// One page of the export, read in one snapshot.
pub(super) fn export_page(
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
    let records: Vec<Record> = match cursor.section {
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
                job.effects = effects_of(&tx, &job.id)?;
                out.push(job);
            }
            out.into_iter().map(Record::Job).collect()
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
            out.into_iter().map(Record::Dedup).collect()
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
            out.into_iter()
                .map(|(f, state)| copy::FenceRecord::exported(f, &state).map(Record::Fence))
                .collect::<Result<_, _>>()?
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
            out.into_iter().map(Record::Kv).collect()
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
            out.into_iter().map(Record::Index).collect()
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
    Ok(copy::ExportPage::of(cursor, limit, records))
}

/// Writes one page of imported records in the writer's step (the caller's
/// savepoint: all or none) and moves the writer's counters past them; the
/// group's commit persists those with the records.
pub(super) fn import_step(w: &mut Writer, records: &[copy::Record]) -> Result<(), StoreError> {
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
