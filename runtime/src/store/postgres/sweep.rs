//! Retention: bounded passes that remove what the rules say is due.

use super::*;

pub(super) async fn sweep_step<C: GenericClient>(
    c: &C,
    now: Millis,
    rules: &RetentionRules,
    limit: u32,
) -> Result<Swept, Fail> {
    let limit = i64::from(limit.min(MAX_SWEEP));
    let mut swept = Swept {
        jobs: sweep_jobs(
            c,
            now,
            "state IN ('completed', 'cancelled')",
            rules.jobs,
            limit,
        )
        .await?,
        dead_jobs: sweep_jobs(c, now, "state = 'dead'", rules.dead, limit).await?,
        ..Swept::default()
    };
    swept.fences = exec(
        c,
        "DELETE FROM fences WHERE (namespace, kind, key) IN \
         (SELECT namespace, kind, key FROM fences WHERE state = 'done' AND updated_at < $1 \
          LIMIT $2 FOR UPDATE SKIP LOCKED)",
        &[&now.minus(rules.fences).0, &limit],
    )
    .await?;
    // A dedup row whose hold expired and whose job is no longer live.
    swept.dedup_keys = exec(
        c,
        "DELETE FROM dedup WHERE (queue, key) IN (SELECT d.queue, d.key FROM dedup d \
           LEFT JOIN jobs j ON j.id = d.job_id \
           WHERE (d.hold_until IS NULL OR d.hold_until <= $1) \
             AND (j.id IS NULL OR j.state NOT IN ('waiting', 'active')) \
           LIMIT $2 FOR UPDATE OF d SKIP LOCKED)",
        &[&now.0, &limit],
    )
    .await?;
    swept.tombstones = exec(
        c,
        "DELETE FROM index_docs WHERE (collection, id) IN (SELECT collection, id FROM index_docs \
           WHERE document IS NULL AND updated_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
        &[&now.minus(rules.tombstones).0, &limit],
    )
    .await?;
    for (ns, keep) in &rules.kv {
        let room = limit.saturating_sub(i64::try_from(swept.kv).unwrap_or(i64::MAX));
        if room <= 0 {
            break;
        }
        swept.kv += exec(
            c,
            "DELETE FROM kv WHERE (namespace, key) IN (SELECT namespace, key FROM kv \
               WHERE namespace = $1 AND written_at < $2 LIMIT $3 FOR UPDATE SKIP LOCKED)",
            &[ns, &now.minus(*keep).0, &room],
        )
        .await?;
    }
    Ok(swept)
}

/// Removes up to `limit` jobs matching `state_filter` that finished before
/// `now - keep`, with their attempts and effects, releasing their dedup
/// keys. Returns how many.
pub(super) async fn sweep_jobs<C: GenericClient>(
    c: &C,
    now: Millis,
    state_filter: &str,
    keep: Duration,
    limit: i64,
) -> Result<u64, Fail> {
    let ids: Vec<String> = rows(
        c,
        &format!(
            "SELECT id FROM jobs WHERE {state_filter} AND finished_at < $1 \
             LIMIT $2 FOR UPDATE SKIP LOCKED"
        ),
        &[&now.minus(keep).0, &limit],
    )
    .await?
    .iter()
    .map(|r| r.try_get(0))
    .collect::<Result<_, _>>()?;
    if !ids.is_empty() {
        release_dedup(c, &ids, now).await?;
        exec(
            c,
            "DELETE FROM attempts WHERE job_id = ANY($1::text[])",
            &[&ids],
        )
        .await?;
        exec(
            c,
            "DELETE FROM effects WHERE job_id = ANY($1::text[])",
            &[&ids],
        )
        .await?;
        exec(c, "DELETE FROM jobs WHERE id = ANY($1::text[])", &[&ids]).await?;
    }
    Ok(ids.len() as u64)
}
