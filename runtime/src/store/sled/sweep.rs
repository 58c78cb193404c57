//! Retention: bounded passes that remove what the rules say is due.

use super::*;

pub(super) fn sweep_step(
    tx: &mut Tx,
    now: Millis,
    rules: &RetentionRules,
    limit: u32,
) -> Result<Swept, StoreError> {
    let trees = Arc::clone(&tx.trees);
    let limit = limit as usize;
    let mut swept = Swept {
        jobs: sweep_jobs(tx, FINISHED, now.minus(rules.jobs), now, limit)?,
        dead_jobs: sweep_jobs(tx, DEAD, now.minus(rules.dead), now, limit)?,
        ..Swept::default()
    };
    for entry in trees.t[FENCES_BY_TIME].range(..time_cutoff(now.minus(rules.fences))) {
        if swept.fences as usize >= limit {
            break;
        }
        let (_, key) = entry.map_err(sled_err)?;
        if let Some(f) = tx.get_rec::<FenceRec>(FENCES, &key)?
            && f.state == FenceState::Done
        {
            tx.put_fence(Some(&f), None);
            swept.fences += 1;
        }
    }
    // A dedup row whose hold expired and whose job is no longer live.
    for entry in trees.t[DEDUP].iter() {
        if swept.dedup_keys as usize >= limit {
            break;
        }
        let (k, _) = entry.map_err(sled_err)?;
        let Some(d) = tx.get_rec::<DedupRec>(DEDUP, &k)? else {
            continue;
        };
        let live = tx
            .job(&d.job_id)?
            .is_some_and(|j| matches!(j.state, JobState::Waiting | JobState::Active));
        if d.hold_until.is_none_or(|h| h <= now) && !live {
            tx.remove(DEDUP, k.to_vec());
            swept.dedup_keys += 1;
        }
    }
    let before = now.minus(rules.tombstones);
    for entry in trees.t[TOMBSTONES].range(..time_cutoff(before)).take(limit) {
        let (entry_key, key) = entry.map_err(sled_err)?;
        match tx.get_rec::<DocRec>(INDEX, &key)? {
            Some(d) if d.document.is_none() && d.updated_at < before => {
                tx.put_doc(key.to_vec(), Some(&d), None);
            }
            // Written again since: only this entry was left.
            _ => tx.remove(TOMBSTONES, entry_key.to_vec()),
        }
        swept.tombstones += 1;
    }
    for (ns, keep) in &rules.kv {
        let before = now.minus(*keep);
        let from = strs(&[ns]);
        let mut to = from.clone();
        put_i64(&mut to, before.0);
        let room = limit.saturating_sub(swept.kv as usize);
        for entry in trees.t[KV_BY_TIME].range(from..to).take(room) {
            let (entry_key, kv_key) = entry.map_err(sled_err)?;
            let key = split_str(&kv_key)
                .and_then(|(_, rest)| split_str(rest))
                .ok_or_else(|| corrupt(KV_BY_TIME, &entry_key))?
                .0;
            match tx.kv(ns, key)? {
                Some((at, _)) if at < before => tx.put_kv(ns, key, Some(at), None),
                // Written again since: only this entry was left.
                _ => tx.remove(KV_BY_TIME, entry_key.to_vec()),
            }
            swept.kv += 1;
        }
    }
    Ok(swept)
}

/// The bound of a time-ordered tree's range before `at`.
pub(super) fn time_cutoff(at: Millis) -> Vec<u8> {
    let mut k = Vec::new();
    put_i64(&mut k, at.0);
    k
}

/// Removes up to `limit` jobs of the time-ordered tree `by_time`
/// (`finished` or `dead`) that finished before `before`, with their
/// attempts and effects, releasing their dedup keys. Returns how many.
pub(super) fn sweep_jobs(
    tx: &mut Tx,
    by_time: usize,
    before: Millis,
    now: Millis,
    limit: usize,
) -> Result<u64, StoreError> {
    let trees = Arc::clone(&tx.trees);
    let ids: Vec<String> = trees.t[by_time]
        .range(..time_cutoff(before))
        .values()
        .take(limit)
        .map(|v| v.map(|v| String::from_utf8_lossy(&v).into_owned()))
        .collect::<Result<_, _>>()
        .map_err(sled_err)?;
    for id in &ids {
        let job = tx.require_job(id)?;
        release_dedup(tx, &job, now)?;
        for tree in [ATTEMPTS, EFFECTS] {
            for k in trees.t[tree].scan_prefix(strs(&[id])).keys() {
                tx.remove(tree, k.map_err(sled_err)?.to_vec());
            }
        }
        tx.put_job(Some(&job), None)?;
    }
    Ok(ids.len() as u64)
}
