//! Leasing: the head of the ready order, each job with a new attempt and a
//! fresh fencing token.

use super::*;

pub(super) fn lease_batch(
    tx: &mut Tx,
    queue: &str,
    max: u32,
    plugin_version: &str,
    now: Millis,
) -> Result<Vec<Lease>, StoreError> {
    let prefix = strs(&[queue]);
    let mut picked = Vec::new();
    let trees = Arc::clone(&tx.trees);
    for entry in trees.t[READY].scan_prefix(&prefix) {
        if picked.len() >= max as usize {
            break;
        }
        let (_, id) = entry.map_err(sled_err)?;
        let id = String::from_utf8_lossy(&id).into_owned();
        let job = tx.require_job(&id)?;
        if job.run_at <= now {
            picked.push(job);
        }
    }
    let mut leases = Vec::with_capacity(picked.len());
    for old in picked {
        let token = tx.next_token;
        tx.next_token += 1;
        let mut new = old.clone();
        new.state = JobState::Active;
        new.attempt += 1;
        new.budget_used += 1;
        new.lease_token = Some(token);
        tx.put_job(Some(&old), Some(&new))?;
        let a = AttemptRec {
            number: new.attempt,
            token,
            started_at: now,
            ended_at: None,
            outcome: AttemptOutcome::Running,
            error: None,
            plugin_version: Some(plugin_version.to_owned()),
        };
        tx.insert(ATTEMPTS, attempt_key(&new.id, new.attempt), encode(&a));
        leases.push(Lease {
            job_id: new.id,
            queue: queue.to_owned(),
            payload: new.payload,
            attempt: new.attempt,
            max_attempts: new.max_attempts,
            enqueued_at: new.enqueued_at,
            token,
        });
    }
    Ok(leases)
}
