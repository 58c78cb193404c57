//! Fences of external effects as rows of `fences`: what the shared fence
//! steps ([`crate::store::embedded`]) load and store.

use super::*;

pub(super) const FENCE_COLUMNS: &str = "namespace, kind, key, state, fingerprint, job_id, attempt, token, result, created_at, updated_at";

pub(super) fn fence_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Fence> {
    let state: String = r.get(3)?;
    Ok(Fence {
        id: FenceId {
            namespace: r.get(0)?,
            kind: r.get(1)?,
            key: r.get(2)?,
        },
        state: FenceState::parse(&state).unwrap_or(FenceState::Uncertain),
        fingerprint: r.get(4)?,
        job_id: r.get(5)?,
        attempt: r.get(6)?,
        token: u64::try_from(r.get::<_, i64>(7)?).unwrap_or(0),
        result: r.get(8)?,
        created_at: Millis(r.get(9)?),
        updated_at: Millis(r.get(10)?),
    })
}

pub(super) fn load_fence(conn: &Connection, id: &FenceId) -> Result<Option<Fence>, StoreError> {
    let sql = format!(
        "SELECT {FENCE_COLUMNS} FROM fences WHERE namespace = ?1 AND kind = ?2 AND key = ?3"
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![id.namespace, id.kind, id.key], fence_from_row)
        .optional()?)
}

pub(super) fn token_param(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

/// Stores a new `started` fence held by `lease`.
pub(super) fn insert_fence(
    conn: &Connection,
    id: &FenceId,
    fingerprint: &[u8],
    lease: &LeaseRef,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, token, created_at, updated_at) \
         VALUES (?1, ?2, ?3, 'started', ?4, ?5, ?6, ?7, ?8, ?8)",
    )?
    .execute(params![id.namespace, id.kind, id.key, fingerprint, lease.job_id, lease.attempt, token_param(lease.token), now.0])?;
    Ok(())
}

pub(super) fn set_fence(
    conn: &Connection,
    id: &FenceId,
    state: FenceState,
    lease: &LeaseRef,
    result: Option<&[u8]>,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE fences SET state = ?4, job_id = ?5, attempt = ?6, token = ?7, result = COALESCE(?8, result), \
         updated_at = ?9 WHERE namespace = ?1 AND kind = ?2 AND key = ?3",
    )?
    .execute(params![
        id.namespace,
        id.kind,
        id.key,
        state.as_str(),
        lease.job_id,
        lease.attempt,
        token_param(lease.token),
        result,
        now.0
    ])?;
    Ok(())
}

pub(super) fn delete_fence(conn: &Connection, id: &FenceId) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM fences WHERE namespace = ?1 AND kind = ?2 AND key = ?3")?
        .execute(params![id.namespace, id.kind, id.key])?;
    Ok(())
}
