//! Leasing: the head of the ready order, each job with a new attempt and a
//! fresh fencing token.

use super::*;

pub(super) fn lease_batch(
    w: &mut Writer,
    queue: &str,
    max: u32,
    plugin_version: &str,
    now: Millis,
) -> Result<Vec<Lease>, StoreError> {
    let picked: Vec<(String, String, u32, u32, i64)> = w
        .conn
        .prepare_cached(
            "SELECT id, payload, attempt, max_attempts, enqueued_at FROM jobs INDEXED BY jobs_ready \
             WHERE queue = ?1 AND state = 'waiting' AND run_at <= ?2 \
             ORDER BY priority DESC, run_at, seq LIMIT ?3",
        )?
        .query_map(params![queue, now.0, max], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<Result<_, _>>()?;
    let mut leases = Vec::with_capacity(picked.len());
    for (id, payload, attempt, max_attempts, enqueued_at) in picked {
        let token = w.next_token;
        w.next_token += 1;
        let number = attempt + 1;
        let t = i64::try_from(token).unwrap_or(i64::MAX);
        w.conn
            .prepare_cached(
                "UPDATE jobs SET state = 'active', attempt = ?2, budget_used = budget_used + 1, \
                 lease_token = ?3 WHERE id = ?1",
            )?
            .execute(params![id, number, t])?;
        w.conn
            .prepare_cached(
                "INSERT INTO attempts (job_id, number, token, started_at, outcome, plugin_version) \
                 VALUES (?1, ?2, ?3, ?4, 'running', ?5)",
            )?
            .execute(params![id, number, t, now.0, plugin_version])?;
        leases.push(Lease {
            job_id: id,
            queue: queue.to_owned(),
            payload,
            attempt: number,
            max_attempts,
            enqueued_at: Millis(enqueued_at),
            token,
        });
    }
    Ok(leases)
}
