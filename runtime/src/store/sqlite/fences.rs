//! Fences of external effects: each step reads the fence in the writer's
//! transaction and applies the decision of [`crate::store::rules`].

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

/// Whether the attempt that wrote `f` still holds its job.
pub(super) fn holder_alive(conn: &Connection, f: &Fence) -> Result<bool, StoreError> {
    rules::alive(check_lease(conn, &rules::holder_lease(f)))
}

pub(super) fn token_param(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

pub(super) fn fence_begin_step(
    conn: &Connection,
    lease: &LeaseRef,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin, StoreError> {
    check_lease(conn, lease)?;
    let Some(f) = load_fence(conn, id)? else {
        conn.prepare_cached(
            "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, token, created_at, updated_at) \
             VALUES (?1, ?2, ?3, 'started', ?4, ?5, ?6, ?7, ?8, ?8)",
        )?
        .execute(params![id.namespace, id.kind, id.key, fingerprint, lease.job_id, lease.attempt, token_param(lease.token), now.0])?;
        return Ok(FenceBegin::Started);
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive(conn, &f)?;
            rules::begin_if_alive(f, alive)
        }
    })
}

/// Loads a fence that `lease` may move on: started by that lease, or by an
/// attempt that died.
pub(super) fn owned_or_abandoned(
    conn: &Connection,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<Fence, StoreError> {
    let (f, ask) = rules::may_move(load_fence(conn, id)?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(conn, &f)?)?;
    }
    Ok(f)
}

/// Loads a `started` fence that `lease` itself holds (nobody took it over).
pub(super) fn held_by(
    conn: &Connection,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<Fence, StoreError> {
    let f = owned_or_abandoned(conn, lease, id)?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
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

pub(super) fn fence_resolve_step(
    conn: &Connection,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<(), StoreError> {
    let (f, ask) = rules::resolvable(load_fence(conn, id)?, id)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(conn, &f)?)?;
    }
    match resolution {
        Resolution::Done => {
            conn.prepare_cached(
                "UPDATE fences SET state = 'done', result = ?4, updated_at = ?5 \
                 WHERE namespace = ?1 AND kind = ?2 AND key = ?3",
            )?
            .execute(params![
                id.namespace,
                id.kind,
                id.key,
                RESOLVED_BY_OPERATOR,
                now.0
            ])?;
        }
        Resolution::NotDone => delete_fence(conn, id)?,
    }
    Ok(())
}
