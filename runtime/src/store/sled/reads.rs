//! [`Reads`] for [`SledStore`]: queries straight on the trees (see the
//! module's "Writes" for what they see).

use super::*;
use crate::store::embedded::Reads;
use crate::store::{DocId, FenceFilter, Result};

/// Job ids from an index tree's values, with their keys.
fn ids_from(
    values: impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
) -> impl Iterator<Item = Result<(sled::IVec, String), StoreError>> {
    values.map(|r| {
        r.map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
            .map_err(sled_err)
    })
}

impl Reads for SledStore {
    type View = Trees;
    type Reader = Arc<Trees>;

    fn reader(&self) -> Arc<Trees> {
        Arc::clone(&self.trees)
    }

    fn view<T>(trees: Arc<Trees>, f: impl FnOnce(&Trees) -> Result<T>) -> Result<T> {
        f(&trees)
    }

    fn next_run_at(t: &Trees, queue: &str) -> Result<Option<Millis>> {
        let prefix = strs(&[queue]);
        let first = t.t[DUE].scan_prefix(&prefix).keys().next();
        match first {
            Some(k) => {
                let k = k.map_err(sled_err)?;
                Ok(get_i64(&k[prefix.len()..]).map(Millis))
            }
            None => Ok(None),
        }
    }

    fn job(t: &Trees, id: &str, now: Millis) -> Result<Option<Job>> {
        let Some(rec) = t.job(id)? else {
            return Ok(None);
        };
        let mut job = rec.to_job(now);
        job.attempts = t.attempts(id)?.iter().map(AttemptRec::to_attempt).collect();
        Ok(Some(job))
    }

    fn jobs(t: &Trees, filter: &JobFilter, now: Millis) -> Result<JobPage> {
        let cursor = filter.before()?;
        let stored = filter.state.map(|s| match s {
            JobState::Delayed => JobState::Waiting,
            s => s,
        });
        // Candidates newest first, below the cursor: from one queue and
        // state when both are given, else from every job.
        let candidates: Box<dyn Iterator<Item = Result<(sled::IVec, String), StoreError>>> =
            match (&filter.queue, stored) {
                (Some(q), Some(s)) => {
                    let start = by_state_key(q, s, 0);
                    let end = by_state_key(q, s, cursor);
                    Box::new(ids_from(t.t[BY_STATE].range(start..end).rev()))
                }
                _ => Box::new(ids_from(
                    t.t[BY_SEQ].range(..cursor.to_be_bytes().to_vec()).rev(),
                )),
            };
        let mut page = PageBuilder::new(filter.limit);
        for c in candidates {
            if !page.has_room() {
                break;
            }
            let (_, id) = c?;
            let Some(rec) = t.job(&id)? else { continue };
            if filter.queue.as_ref().is_some_and(|q| *q != rec.queue) {
                continue;
            }
            let job = rec.to_job(now);
            if filter.state.is_some_and(|s| s != job.state) {
                continue;
            }
            page.push(job, i64::try_from(rec.seq).unwrap_or(i64::MAX));
        }
        Ok(page.finish())
    }

    fn counts(t: &Trees, now: Millis) -> Result<Vec<(String, StateCounts)>> {
        let mut out: BTreeMap<String, StateCounts> = BTreeMap::new();
        for entry in t.t[COUNTS].iter() {
            let (k, v) = entry.map_err(sled_err)?;
            let (queue, rest) = split_str(&k).ok_or_else(|| corrupt(COUNTS, &k))?;
            let (state, _) = split_str(rest).ok_or_else(|| corrupt(COUNTS, &k))?;
            let state: JobState = state.parse().map_err(|_| corrupt(COUNTS, &k))?;
            let n = <[u8; 8]>::try_from(v.as_ref())
                .map(u64::from_be_bytes)
                .map_err(|_| corrupt(COUNTS, &k))?;
            out.entry(queue.to_owned()).or_default().add(state, n);
        }
        // `delayed`: the waiting jobs due after `now`, a range of `due`.
        for (queue, counts) in &mut out {
            if counts.waiting == 0 {
                continue;
            }
            let mut start = strs(&[queue]);
            put_i64(&mut start, now.0.saturating_add(1));
            let prefix = strs(&[queue]);
            let n = t.t[DUE]
                .range(start..)
                .keys()
                .take_while(|k| k.as_ref().is_ok_and(|k| k.starts_with(&prefix)))
                .count() as u64;
            let n = n.min(counts.waiting);
            counts.waiting -= n;
            counts.delayed += n;
        }
        Ok(out.into_iter().collect())
    }

    fn fences(t: &Trees, filter: &FenceFilter) -> Result<Vec<Fence>> {
        let limit = filter.limit.clamp(1, 1000) as usize;
        let mut out = Vec::new();
        for entry in t.t[FENCES_BY_TIME].iter().rev() {
            if out.len() >= limit {
                break;
            }
            let (_, key) = entry.map_err(sled_err)?;
            let Some(f) = t.get_rec::<FenceRec>(FENCES, &key)? else {
                continue;
            };
            if filter.namespace.as_ref().is_some_and(|n| *n != f.namespace)
                || filter.state.is_some_and(|s| s != f.state)
            {
                continue;
            }
            out.push(f.to_fence());
        }
        Ok(out)
    }

    fn index_get(t: &Trees, doc: &DocId) -> Result<Option<(String, u64)>> {
        let d: Option<DocRec> = t.get_rec(INDEX, &strs(&[&doc.collection, &doc.id]))?;
        Ok(d.and_then(|d| d.document.map(|doc| (doc, d.version))))
    }

    fn effects(t: &Trees, job_id: &str) -> Result<Vec<EffectRecord>> {
        t.effects(job_id)
    }

    fn export(t: &Trees, cursor: &copy::Cursor, limit: u32) -> Result<copy::ExportPage> {
        export_page(t, cursor, limit)
    }
}
