//! Enqueue: each job of a batch deduplicated by id and by dedup key, in
//! the writer's transaction.

use super::*;

/// Releases the job's dedup key if it still points at this job and is not
/// held by `dedup_for` (compare-and-swap on the holder).
pub(super) fn release_dedup(
    conn: &Connection,
    job_id: &str,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "DELETE FROM dedup WHERE (queue, key) IN \
           (SELECT queue, dedup_key FROM jobs WHERE id = ?1 AND dedup_key IS NOT NULL) \
         AND job_id = ?1 AND (hold_until IS NULL OR hold_until <= ?2)",
    )?
    .execute(params![job_id, now.0])?;
    Ok(())
}

pub(super) fn enqueue_one(
    w: &mut Writer,
    mut job: NewJob,
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
    let id = job
        .id
        .take()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
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
    Ok(rules::created(id, job, now))
}
