//! Ending attempts: the group commit of finishes, reclaiming expired
//! leases, cancel and retry.

use super::*;

/// Moves a job to a final state (completed, dead, cancelled).
pub(super) async fn end_job<C: GenericClient>(
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
pub(super) const FINISH_BATCH: usize = 64;

/// One [`Store::finish`] waiting for the finisher; `answer` is sent after
/// the COMMIT that holds it (or with the error that kept it from one).
pub(super) struct FinishReq {
    pub(super) lease: LeaseRef,
    pub(super) finish: Finish,
    pub(super) now: Millis,
    pub(super) answer: tokio::sync::oneshot::Sender<Result<JobState, StoreError>>,
}

/// The group commit of finishes: takes every finish waiting (up to
/// [`FINISH_BATCH`], each job at most once) and applies them in one
/// transaction, so that they share its round trips and its WAL flush; each
/// caller hears after that COMMIT. Ends when the store is dropped (every
/// sender gone) and the channel is drained.
pub(super) async fn finisher(
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
pub(super) async fn finish_group(pool: &Pool, target: &str, group: Vec<FinishReq>) {
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
pub(super) type Answers = (Vec<Result<JobState, StoreError>>, Vec<String>);

/// One transaction applying `group` (distinct jobs), rerun when it lost a
/// race. The error says whether the connection is still up, so that the
/// finishes may be tried one at a time.
pub(super) async fn finish_tx(
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
pub(super) async fn finish_statements<C: GenericClient>(
    c: &C,
    group: &[FinishReq],
) -> Result<Answers, Fail> {
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
pub(super) async fn notify<C: GenericClient>(c: &C, queue: &str) -> Result<(), Fail> {
    exec(c, "SELECT pg_notify($1, $2)", &[&WAKE_CHANNEL, &queue]).await?;
    Ok(())
}

/// Reclaims at most `max` jobs whose lease expired (see
/// [`Store::reclaim_expired`]), and those leased by `owner` when given; rows
/// a step holds are skipped, for a later pass.
pub(super) async fn reclaim_step<C: GenericClient>(
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

pub(super) async fn cancel_step<C: GenericClient>(
    c: &C,
    id: &str,
    now: Millis,
) -> Result<(Job, bool), Fail> {
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

pub(super) async fn retry_step<C: GenericClient>(
    c: &C,
    id: &str,
    now: Millis,
) -> Result<Job, Fail> {
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
