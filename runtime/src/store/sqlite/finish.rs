//! Ending attempts: finish, crash recovery, cancel and retry, each moving
//! the job as [`crate::store::rules`] decided.

use super::*;

pub(super) fn close_attempt(
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
pub(super) fn end_job(
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
pub(super) fn move_job(
    conn: &Connection,
    id: &str,
    m: &rules::Move,
    now: Millis,
) -> Result<(), StoreError> {
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

pub(super) fn finish_step(
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

pub(super) fn recover_step(w: &mut Writer, now: Millis) -> Result<u64, StoreError> {
    let conn = &w.conn;
    let active: Vec<(String, i64, u32, u32, u32)> = conn
        .prepare(
            "SELECT id, lease_token, budget_used, max_attempts, attempt FROM jobs WHERE state = 'active'",
        )?
        .query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get::<_, Option<i64>>(1)?.unwrap_or(0),
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
            ))
        })?
        .collect::<Result<_, _>>()?;
    let error = rules::ABANDONED;
    for (id, token, used, max, attempt) in &active {
        let lease = LeaseRef {
            job_id: id.clone(),
            attempt: *attempt,
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

pub(super) fn cancel_step(
    w: &mut Writer,
    id: &str,
    now: Millis,
) -> Result<(Job, bool), StoreError> {
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

pub(super) fn retry_step(w: &mut Writer, id: &str, now: Millis) -> Result<Job, StoreError> {
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
