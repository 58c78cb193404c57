//! Enqueue: a batch in one transaction, deduplicated by id and by dedup key
//! on the unique constraints (a lost race reads the winner).

use super::*;

/// Releases the dedup keys of `ids` that still point at their job and are
/// not held by `dedup_for` (compare-and-swap on the holder).
pub(super) async fn release_dedup<C: GenericClient>(
    c: &C,
    ids: &[String],
    now: Millis,
) -> Result<(), Fail> {
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
pub(super) async fn take_dedup_key<C: GenericClient>(
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

pub(super) async fn enqueue_one<C: GenericClient>(
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
    Ok(rules::created(id, job.clone(), now))
}

/// Enqueues a batch. A batch without dedup keys whose ids are distinct is
/// inserted in one statement (`ON CONFLICT (id) DO NOTHING`, in the
/// batch's order, so that `seq` keeps it); the ids it did not insert
/// existed (or a concurrent enqueue committed them first, which the insert
/// waited for) and are read back in one more statement: the same payload
/// and queue is that job, deduplicated; anything else is `IdReused`. Other
/// batches go job by job ([`enqueue_one`]), since a job's dedup key or id
/// may name one enqueued before it in the batch.
pub(super) async fn enqueue_batch<C: GenericClient>(
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
        out.push(rules::created(id, job.clone(), now));
    }
    Ok(out)
}
