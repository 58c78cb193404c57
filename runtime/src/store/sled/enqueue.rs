//! Enqueue: each job of a batch deduplicated by id and by dedup key, in
//! the writer's transaction.

use super::*;

pub(super) fn enqueue_one(
    tx: &mut Tx,
    job: NewJob,
    index: usize,
    now: Millis,
) -> Result<Enqueued, StoreError> {
    if let Some(id) = &job.id
        && let Some(existing) = tx.job(id)?
    {
        if crate::job::same_payload(&existing.payload, &job.payload) && existing.queue == job.queue
        {
            return Ok(Enqueued {
                job: existing.to_job(now),
                deduplicated: true,
            });
        }
        return Err(StoreError::IdReused {
            id: id.clone(),
            index,
        });
    }
    if let Some(key) = &job.dedup_key
        && let Some(holder) = tx.get_rec::<DedupRec>(DEDUP, &strs(&[&job.queue, key]))?
        && let Some(held) = tx.job(&holder.job_id)?
        && (held.state.is_live() || holder.hold_until.is_some_and(|h| h > now))
    {
        return Ok(Enqueued {
            job: held.to_job(now),
            deduplicated: true,
        });
    }
    let id = job.id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let seq = tx.next_seq;
    tx.next_seq += 1;
    let rec = JobRec {
        id: id.clone(),
        queue: job.queue,
        state: JobState::Waiting,
        payload: job.payload,
        priority: job.priority,
        run_at: job.run_at,
        seq,
        attempt: 0,
        budget_used: 0,
        max_attempts: job.max_attempts,
        dedup_key: job.dedup_key,
        enqueued_at: now,
        finished_at: None,
        result: None,
        last_error: None,
        lease_token: None,
    };
    tx.put_job(None, Some(&rec))?;
    if let Some(key) = &rec.dedup_key {
        let d = DedupRec {
            job_id: id,
            hold_until: job.dedup_for.map(|d| now.plus(d)),
        };
        tx.insert(DEDUP, strs(&[&rec.queue, key]), encode(&d));
    }
    Ok(Enqueued {
        job: rec.to_job(now),
        deduplicated: false,
    })
}
