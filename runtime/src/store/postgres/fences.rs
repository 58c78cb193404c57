//! Fences of external effects: each step locks the fence row and applies
//! the decision of [`crate::store::rules`].

use super::*;

pub(super) fn fence_from_row(r: &Row) -> Result<Fence, Fail> {
    let state: String = r.try_get(3)?;
    Ok(Fence {
        id: FenceId {
            namespace: r.try_get(0)?,
            kind: r.try_get(1)?,
            key: r.try_get(2)?,
        },
        state: FenceState::parse(&state).unwrap_or(FenceState::Uncertain),
        fingerprint: r.try_get(4)?,
        job_id: r.try_get(5)?,
        attempt: u32_of(r.try_get(6)?),
        token: u64_of(r.try_get(7)?),
        result: r.try_get(8)?,
        created_at: Millis(r.try_get(9)?),
        updated_at: Millis(r.try_get(10)?),
    })
}

/// The fence, its row locked for update.
pub(super) async fn lock_fence<C: GenericClient>(
    c: &C,
    id: &FenceId,
) -> Result<Option<Fence>, Fail> {
    const SQL: &str = "SELECT namespace, kind, key, state, fingerprint, job_id, attempt, token, result, \
         created_at, updated_at FROM fences WHERE namespace = $1 AND kind = $2 AND key = $3 FOR UPDATE";
    match row_opt(c, SQL, &[&id.namespace, &id.kind, &id.key]).await? {
        Some(r) => Ok(Some(fence_from_row(&r)?)),
        None => Ok(None),
    }
}

/// Whether the attempt that wrote `f` still holds its job.
pub(super) async fn holder_alive<C: GenericClient>(c: &C, f: &Fence) -> Result<bool, Fail> {
    match check_lease(c, &rules::holder_lease(f), false).await {
        Ok(()) => Ok(true),
        Err(Fail::Store(e)) => Ok(rules::alive::<()>(Err(e))?),
        Err(e) => Err(e),
    }
}

pub(super) async fn fence_begin_step<C: GenericClient>(
    c: &C,
    lease: &LeaseRef,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin, Fail> {
    check_lease(c, lease, true).await?;
    let inserted = exec(
        c,
        "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, token, created_at, updated_at) \
         VALUES ($1, $2, $3, 'started', $4, $5, $6, $7, $8, $8) \
         ON CONFLICT (namespace, kind, key) DO NOTHING",
        &[
            &id.namespace,
            &id.kind,
            &id.key,
            &fingerprint,
            &lease.job_id,
            &i32_of(lease.attempt),
            &i64_of(lease.token),
            &now.0,
        ],
    )
    .await?;
    if inserted == 1 {
        return Ok(FenceBegin::Started);
    }
    let Some(f) = lock_fence(c, id).await? else {
        // Released between the insert and the read: start over.
        return Err(Fail::Rerun(format!(
            "fence {}/{}/{} was released meanwhile",
            id.namespace, id.kind, id.key
        )));
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive(c, &f).await?;
            rules::begin_if_alive(f, alive)
        }
    })
}

/// Locks a fence that `lease` may move on: started by that lease, or by an
/// attempt that died.
pub(super) async fn owned_or_abandoned<C: GenericClient>(
    c: &C,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<Fence, Fail> {
    let (f, ask) = rules::may_move(lock_fence(c, id).await?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(c, &f).await?)?;
    }
    Ok(f)
}

/// Locks a `started` fence that `lease` itself holds (nobody took it over).
pub(super) async fn held_by<C: GenericClient>(
    c: &C,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<Fence, Fail> {
    let f = owned_or_abandoned(c, lease, id).await?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
}

pub(super) async fn set_fence<C: GenericClient>(
    c: &C,
    id: &FenceId,
    state: FenceState,
    lease: &LeaseRef,
    result: Option<&[u8]>,
    now: Millis,
) -> Result<(), Fail> {
    exec(
        c,
        "UPDATE fences SET state = $4, job_id = $5, attempt = $6, token = $7, \
         result = COALESCE($8, result), updated_at = $9 \
         WHERE namespace = $1 AND kind = $2 AND key = $3",
        &[
            &id.namespace,
            &id.kind,
            &id.key,
            &state.as_str(),
            &lease.job_id,
            &i32_of(lease.attempt),
            &i64_of(lease.token),
            &result,
            &now.0,
        ],
    )
    .await?;
    Ok(())
}

pub(super) async fn delete_fence<C: GenericClient>(c: &C, id: &FenceId) -> Result<(), Fail> {
    exec(
        c,
        "DELETE FROM fences WHERE namespace = $1 AND kind = $2 AND key = $3",
        &[&id.namespace, &id.kind, &id.key],
    )
    .await?;
    Ok(())
}

pub(super) async fn fence_resolve_step<C: GenericClient>(
    c: &C,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<(), Fail> {
    let (f, ask) = rules::resolvable(lock_fence(c, id).await?, id)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(c, &f).await?)?;
    }
    match resolution {
        Resolution::Done => {
            exec(
                c,
                "UPDATE fences SET state = 'done', result = $4, updated_at = $5 \
                 WHERE namespace = $1 AND kind = $2 AND key = $3",
                &[
                    &id.namespace,
                    &id.kind,
                    &id.key,
                    &RESOLVED_BY_OPERATOR,
                    &now.0,
                ],
            )
            .await?;
        }
        Resolution::NotDone => delete_fence(c, id).await?,
    }
    Ok(())
}
