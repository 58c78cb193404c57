//! [`Reads`] for [`SqliteStore`]: queries on a reader connection, which
//! sees committed state only.

use super::*;
use crate::store::embedded::Reads;
use crate::store::{DocId, FenceFilter, Result};

/// The reader connections kept open, and the database they open.
#[derive(Clone)]
pub(in crate::store) struct Readers {
    pub(super) pool: Arc<Mutex<Vec<Connection>>>,
    pub(super) path: PathBuf,
}

impl Reads for SqliteStore {
    type View = Connection;
    type Reader = Readers;

    fn reader(&self) -> Readers {
        self.readers.clone()
    }

    fn view<T>(readers: Readers, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let conn = readers.pool.lock().ok().and_then(|mut v| v.pop());
        let conn = match conn {
            Some(c) => c,
            None => {
                let c = open_conn(&readers.path)?;
                c.pragma_update(None, "query_only", true)?;
                c
            }
        };
        let out = f(&conn);
        if let Ok(mut v) = readers.pool.lock()
            && v.len() < READERS
        {
            v.push(conn);
        }
        out
    }

    fn next_run_at(c: &Connection, queue: &str) -> Result<Option<Millis>> {
        let v: Option<i64> = c
            .prepare_cached(
                "SELECT MIN(run_at) FROM jobs INDEXED BY jobs_due WHERE queue = ?1 AND state = 'waiting'",
            )?
            .query_row([queue], |r| r.get(0))?;
        Ok(v.map(Millis))
    }

    fn job(c: &Connection, id: &str, now: Millis) -> Result<Option<Job>> {
        let Some(mut job) = load_job(c, id, now)? else {
            return Ok(None);
        };
        job.attempts = load_attempts(c, id)?;
        Ok(Some(job))
    }

    fn jobs(c: &Connection, filter: &JobFilter, now: Millis) -> Result<JobPage> {
        let limit = filter.limit.clamp(1, 1000);
        let cursor = i64::try_from(filter.before()?).unwrap_or(i64::MAX);
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
    }

    fn counts(c: &Connection, now: Millis) -> Result<Vec<(String, StateCounts)>> {
        // The stored states come from the counters; `delayed` (waiting
        // with run_at in the future) is counted on the jobs_due index,
        // which costs what is delayed, not what is stored.
        let mut stmt =
            c.prepare_cached("SELECT queue, state, n FROM job_counts WHERE n > 0 ORDER BY queue")?;
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
    }

    fn index_get(c: &Connection, doc: &DocId) -> Result<Option<(String, u64)>> {
        Ok(index_read(c, &doc.collection, &doc.id)?.and_then(|(d, v)| d.map(|d| (d, v))))
    }

    fn fences(c: &Connection, filter: &FenceFilter) -> Result<Vec<Fence>> {
        let sql = format!(
            "SELECT {FENCE_COLUMNS} FROM fences WHERE (?1 IS NULL OR namespace = ?1) \
             AND (?2 IS NULL OR state = ?2) ORDER BY updated_at DESC LIMIT ?3"
        );
        let rows = c
            .prepare_cached(&sql)?
            .query_map(
                params![
                    filter.namespace,
                    filter.state.map(FenceState::as_str),
                    filter.limit.clamp(1, 1000)
                ],
                fence_from_row,
            )?
            .collect::<Result<_, _>>()?;
        Ok(rows)
    }

    fn effects(c: &Connection, job_id: &str) -> Result<Vec<EffectRecord>> {
        effects_of(c, job_id)
    }

    fn export(c: &Connection, cursor: &copy::Cursor, limit: u32) -> Result<copy::ExportPage> {
        export_page(c, cursor, limit)
    }
}

/// The effects recorded on a job, in the order recorded: what a job's
/// answer shows and what `copy` moves.
pub(super) fn effects_of(c: &Connection, job_id: &str) -> Result<Vec<EffectRecord>> {
    let rows = c
        .prepare_cached(
            "SELECT attempt, kind, key, outcome, at FROM effects WHERE job_id = ?1 ORDER BY attempt, n",
        )?
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
}
