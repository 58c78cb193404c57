//! Ending attempts: finish, crash recovery, cancel and retry, each moving
//! the job as [`crate::store::rules`] decided.

use super::*;

/// Closes the open attempt of `lease`'s token, if any.
pub(super) fn close_attempt(
    tx: &mut Tx,
    lease: &LeaseRef,
    outcome: AttemptOutcome,
    error: Option<&str>,
    now: Millis,
) -> Result<(), StoreError> {
    let attempts = tx.trees.attempts(&lease.job_id)?;
    for mut a in attempts {
        let key = attempt_key(&lease.job_id, a.number);
        // This step's own writes win over the tree.
        if let Some(current) = tx.get_rec::<AttemptRec>(ATTEMPTS, &key)? {
            a = current;
        }
        if a.token == lease.token && a.ended_at.is_none() {
            a.ended_at = Some(now);
            a.outcome = outcome;
            a.error = error.map(str::to_owned);
            tx.insert(ATTEMPTS, key, encode(&a));
        }
    }
    Ok(())
}

/// Moves a job to a final state (completed, dead, cancelled).
pub(super) fn end_job(
    tx: &mut Tx,
    old: &JobRec,
    state: JobState,
    result: Option<&str>,
    error: Option<&str>,
    now: Millis,
) -> Result<(), StoreError> {
    let mut new = old.clone();
    new.state = state;
    new.finished_at = Some(now);
    if let Some(r) = result {
        new.result = Some(r.to_owned());
    }
    if let Some(e) = error {
        new.last_error = Some(e.to_owned());
    }
    new.lease_token = None;
    tx.put_job(Some(old), Some(&new))?;
    release_dedup(tx, &new, now)
}

/// Writes what a rule decided for a job: an end (completed or dead), or
/// back to waiting at its `run_at`, refunded or not.
pub(super) fn move_job(
    tx: &mut Tx,
    job: &JobRec,
    m: rules::Move,
    now: Millis,
) -> Result<(), StoreError> {
    if m.ends() {
        return end_job(
            tx,
            job,
            m.state,
            m.result.as_deref(),
            m.error.as_deref(),
            now,
        );
    }
    let mut new = job.clone();
    new.state = JobState::Waiting;
    new.run_at = m.run_at.unwrap_or(now);
    if let Some(e) = m.error {
        new.last_error = Some(e);
    }
    new.lease_token = None;
    if m.refund {
        new.budget_used = new.budget_used.saturating_sub(1);
    }
    tx.put_job(Some(job), Some(&new))
}

pub(super) fn finish_step(
    tx: &mut Tx,
    lease: &LeaseRef,
    finish: Finish,
    now: Millis,
) -> Result<JobState, StoreError> {
    let job = tx.require_job(&lease.job_id)?;
    let held = rules::Held {
        state: job.state,
        budget_used: job.budget_used,
        max_attempts: job.max_attempts,
        holds: rules::holds(job.state, job.lease_token, lease),
        expired: false,
    };
    let mut ending = rules::finish(held, finish, now);
    close_attempt(tx, lease, ending.outcome, ending.error.as_deref(), now)?;
    let answer = ending.answer(lease, now);
    if let Some(m) = ending.then.take() {
        move_job(tx, &job, m, now)?;
    }
    answer
}

pub(super) fn recover_step(tx: &mut Tx, now: Millis) -> Result<u64, StoreError> {
    let trees = Arc::clone(&tx.trees);
    let ids: Vec<String> = trees.t[ACTIVE]
        .iter()
        .keys()
        .map(|k| k.map(|k| String::from_utf8_lossy(&k).into_owned()))
        .collect::<Result<_, _>>()
        .map_err(sled_err)?;
    let error = rules::ABANDONED;
    for id in &ids {
        let job = tx.require_job(id)?;
        let lease = LeaseRef {
            job_id: id.clone(),
            attempt: job.attempt,
            token: job.lease_token.unwrap_or(0),
        };
        close_attempt(tx, &lease, AttemptOutcome::Abandoned, Some(error), now)?;
        let m = rules::abandon(job.budget_used, job.max_attempts, error, now);
        move_job(tx, &job, m, now)?;
    }
    Ok(ids.len() as u64)
}

pub(super) fn cancel_step(tx: &mut Tx, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
    let job = tx.require_job(id)?;
    let state = visible_state(job.state, job.run_at, now);
    if !state.is_live() {
        return Err(StoreError::InvalidState {
            id: id.to_owned(),
            state,
            wanted: "only a waiting, delayed or active job can be cancelled",
        });
    }
    let was_active = job.state == JobState::Active;
    end_job(tx, &job, JobState::Cancelled, None, None, now)?;
    Ok((tx.require_job(id)?.to_job(now), was_active))
}

pub(super) fn retry_step(tx: &mut Tx, id: &str, now: Millis) -> Result<Job, StoreError> {
    let job = tx.require_job(id)?;
    if !matches!(job.state, JobState::Dead | JobState::Cancelled) {
        return Err(StoreError::InvalidState {
            id: id.to_owned(),
            state: visible_state(job.state, job.run_at, now),
            wanted: "only a dead or cancelled job can be retried",
        });
    }
    let mut new = job.clone();
    new.state = JobState::Waiting;
    new.run_at = now;
    new.budget_used = 0;
    new.finished_at = None;
    tx.put_job(Some(&job), Some(&new))?;
    // Take the dedup key back if no other job holds it.
    if let Some(key) = &job.dedup_key {
        let k = strs(&[&job.queue, key]);
        if tx.get(DEDUP, &k)?.is_none() {
            let d = DedupRec {
                job_id: id.to_owned(),
                hold_until: None,
            };
            tx.insert(DEDUP, k, encode(&d));
        }
    }
    Ok(new.to_job(now))
}
