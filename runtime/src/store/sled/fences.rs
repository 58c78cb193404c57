//! Fences of external effects: each step reads the fence in the writer's
//! transaction and applies the decision of [`crate::store::rules`].

use super::*;

pub(super) fn index_read(
    tx: &Tx,
    collection: &str,
    id: &str,
) -> Result<Option<DocRec>, StoreError> {
    tx.get_rec(INDEX, &strs(&[collection, id]))
}

/// Whether the attempt that wrote `f` still holds its job.
pub(super) fn holder_alive(tx: &Tx, f: &FenceRec) -> Result<bool, StoreError> {
    rules::alive(check_lease(tx, &rules::holder_lease(f)))
}

pub(super) fn fence_begin_step(
    tx: &mut Tx,
    lease: &LeaseRef,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin, StoreError> {
    check_lease(tx, lease)?;
    let Some(f) = tx.fence(id)? else {
        let f = FenceRec {
            namespace: id.namespace.clone(),
            kind: id.kind.clone(),
            key: id.key.clone(),
            state: FenceState::Started,
            fingerprint: fingerprint.to_vec(),
            job_id: lease.job_id.clone(),
            attempt: lease.attempt,
            token: lease.token,
            result: None,
            created_at: now,
            updated_at: now,
        };
        tx.put_fence(None, Some(&f));
        return Ok(FenceBegin::Started);
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive(tx, &f)?;
            rules::begin_if_alive(f, alive)
        }
    })
}

/// Loads a fence that `lease` may move on: started by that lease, or by an
/// attempt that died.
pub(super) fn owned_or_abandoned(
    tx: &Tx,
    lease: &LeaseRef,
    id: &FenceId,
) -> Result<FenceRec, StoreError> {
    let (f, ask) = rules::may_move(tx.fence(id)?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(tx, &f)?)?;
    }
    Ok(f)
}

/// Loads a `started` fence that `lease` itself holds (nobody took it over).
pub(super) fn held_by(tx: &Tx, lease: &LeaseRef, id: &FenceId) -> Result<FenceRec, StoreError> {
    let f = owned_or_abandoned(tx, lease, id)?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
}

pub(super) fn set_fence(
    tx: &mut Tx,
    old: &FenceRec,
    state: FenceState,
    lease: &LeaseRef,
    result: Option<Vec<u8>>,
    now: Millis,
) {
    let mut new = old.clone();
    new.state = state;
    new.job_id = lease.job_id.clone();
    new.attempt = lease.attempt;
    new.token = lease.token;
    if result.is_some() {
        new.result = result;
    }
    new.updated_at = now;
    tx.put_fence(Some(old), Some(&new));
}

pub(super) fn fence_resolve_step(
    tx: &mut Tx,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<(), StoreError> {
    let (f, ask) = rules::resolvable(tx.fence(id)?, id)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(tx, &f)?)?;
    }
    match resolution {
        Resolution::Done => {
            let mut new = f.clone();
            new.state = FenceState::Done;
            new.result = Some(RESOLVED_BY_OPERATOR.to_vec());
            new.updated_at = now;
            tx.put_fence(Some(&f), Some(&new));
        }
        Resolution::NotDone => tx.put_fence(Some(&f), None),
    }
    Ok(())
}
