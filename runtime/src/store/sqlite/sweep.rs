//! Retention: bounded passes that remove what the rules say is due.

use super::*;

pub(super) fn sweep_step(
    w: &mut Writer,
    now: Millis,
    rules: &RetentionRules,
    limit: u32,
) -> Result<Swept, StoreError> {
    let conn = &w.conn;
    let mut swept = Swept {
        jobs: sweep_jobs(
            conn,
            now,
            "jobs_finished",
            "state IN ('completed', 'cancelled')",
            rules.jobs,
            limit,
        )?,
        dead_jobs: sweep_jobs(conn, now, "jobs_dead", "state = 'dead'", rules.dead, limit)?,
        ..Swept::default()
    };
    swept.fences = conn
        .prepare_cached(
            "DELETE FROM fences WHERE (namespace, kind, key) IN \
             (SELECT namespace, kind, key FROM fences WHERE state = 'done' AND updated_at < ?1 LIMIT ?2)",
        )?
        .execute(params![now.minus(rules.fences).0, limit])? as u64;
    // A dedup row whose hold expired and whose job is no longer live.
    swept.dedup_keys = conn
        .prepare_cached(
            "DELETE FROM dedup WHERE (queue, key) IN (SELECT d.queue, d.key FROM dedup d \
               LEFT JOIN jobs j ON j.id = d.job_id \
               WHERE (d.hold_until IS NULL OR d.hold_until <= ?1) \
                 AND (j.id IS NULL OR j.state NOT IN ('waiting', 'active')) LIMIT ?2)",
        )?
        .execute(params![now.0, limit])? as u64;
    swept.tombstones = conn
        .prepare_cached(
            "DELETE FROM index_docs WHERE (collection, id) IN (SELECT collection, id \
               FROM index_docs INDEXED BY index_tombstones \
               WHERE document IS NULL AND updated_at < ?1 LIMIT ?2)",
        )?
        .execute(params![now.minus(rules.tombstones).0, limit])? as u64;
    for (ns, keep) in &rules.kv {
        let room = u64::from(limit).saturating_sub(swept.kv);
        if room == 0 {
            break;
        }
        swept.kv += conn
            .prepare_cached(
                "DELETE FROM kv WHERE (namespace, key) IN (SELECT namespace, key \
                   FROM kv INDEXED BY kv_written \
                   WHERE namespace = ?1 AND written_at < ?2 LIMIT ?3)",
            )?
            .execute(params![
                ns,
                now.minus(*keep).0,
                i64::try_from(room).unwrap_or(i64::MAX)
            ])? as u64;
    }
    Ok(swept)
}

/// Removes up to `limit` jobs matching `state_filter` (served by `index`)
/// that finished before `now - keep`, with their attempts and effects,
/// releasing their dedup keys. Returns how many.
pub(super) fn sweep_jobs(
    conn: &Connection,
    now: Millis,
    index: &str,
    state_filter: &str,
    keep: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    let ids: Vec<String> = conn
        .prepare_cached(&format!(
            "SELECT id FROM jobs INDEXED BY {index} WHERE {state_filter} AND finished_at < ?1 LIMIT ?2"
        ))?
        .query_map(params![now.minus(keep).0, limit], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for id in &ids {
        release_dedup(conn, id, now)?;
        conn.prepare_cached("DELETE FROM attempts WHERE job_id = ?1")?
            .execute([id])?;
        conn.prepare_cached("DELETE FROM effects WHERE job_id = ?1")?
            .execute([id])?;
        conn.prepare_cached("DELETE FROM jobs WHERE id = ?1")?
            .execute([id])?;
    }
    Ok(ids.len() as u64)
}
