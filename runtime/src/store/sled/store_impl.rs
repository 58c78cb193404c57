//! [`Store`] for [`SledStore`]: writes go through the group-commit
//! writer, reads through a consistent view of the trees.

use super::*;
use crate::store::{Doc, DocId, FenceFilter, KvPut, LeaseAsk, Leased, PutMode, Result, Tombstone};

pub(super) fn ids_from(
    values: impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
) -> impl Iterator<Item = Result<(sled::IVec, String), StoreError>> {
    values.map(|r| {
        r.map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
            .map_err(sled_err)
    })
}

#[async_trait]
impl Store for SledStore {
    fn halted(&self) -> Option<String> {
        self.writer.halt().reason()
    }

    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>, StoreError> {
        self.write(true, move |tx| {
            jobs.into_iter()
                .enumerate()
                .map(|(i, j)| enqueue_one(tx, j, i, now))
                .collect()
        })
        .await
    }

    async fn lease(&self, ask: &LeaseAsk<'_>, now: Millis) -> Result<Leased> {
        // One daemon owns this ledger: its own slots and rate limiter keep
        // `ask.limits`, and `max` is the only bound here.
        let (queue, max, version) = (ask.queue.to_owned(), ask.max, ask.plugin_version.to_owned());
        let leases = self
            .write(false, move |tx| lease_batch(tx, &queue, max, &version, now))
            .await?;
        Ok(Leased { leases, held: None })
    }

    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>, StoreError> {
        let prefix = strs(&[queue]);
        self.read(move |t| {
            let first = t.t[DUE].scan_prefix(&prefix).keys().next();
            match first {
                Some(k) => {
                    let k = k.map_err(sled_err)?;
                    Ok(get_i64(&k[prefix.len()..]).map(Millis))
                }
                None => Ok(None),
            }
        })
        .await
    }

    async fn finish(&self, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState> {
        let lease = lease.clone();
        // A fenced finish still records how its attempt ended: apply that
        // part, then report the fence.
        self.write(true, move |tx| match finish_step(tx, &lease, finish, now) {
            fenced @ Err(StoreError::Fenced { .. }) => Ok(fenced),
            other => other.map(Ok),
        })
        .await?
    }

    async fn recover(&self, now: Millis) -> Result<u64, StoreError> {
        self.write(true, move |tx| recover_step(tx, now)).await
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
        let id = id.to_owned();
        self.write(true, move |tx| cancel_step(tx, &id, now)).await
    }

    async fn retry(&self, id: &str, now: Millis) -> Result<Job, StoreError> {
        let id = id.to_owned();
        self.write(true, move |tx| retry_step(tx, &id, now)).await
    }

    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>, StoreError> {
        let id = id.to_owned();
        self.read(move |t| {
            let Some(rec) = t.job(&id)? else {
                return Ok(None);
            };
            let mut job = rec.to_job(now);
            job.attempts = t
                .attempts(&id)?
                .iter()
                .map(AttemptRec::to_attempt)
                .collect();
            Ok(Some(job))
        })
        .await
    }

    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage, StoreError> {
        self.read(move |t| {
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
        })
        .await
    }

    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>, StoreError> {
        self.read(move |t| {
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
        })
        .await
    }

    async fn sweep(&self, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept> {
        let rules = rules.clone();
        self.write(true, move |tx| sweep_step(tx, now, &rules, limit))
            .await
    }

    async fn kv_get(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let (lease, k) = (lease.clone(), strs(&[ns, key]));
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            match tx.get(KV, &k)? {
                Some(stored) => Ok(Some(split_kv_value(&stored)?.1.to_vec())),
                None => Ok(None),
            }
        })
        .await
    }

    async fn kv_put(&self, lease: &LeaseRef, put: KvPut, now: Millis) -> Result<bool> {
        let lease = lease.clone();
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let old = tx.kv(&put.ns, &put.key)?.map(|(at, _)| at);
            if old.is_some() && put.mode == PutMode::IfAbsent {
                return Ok(false);
            }
            tx.put_kv(&put.ns, &put.key, old, Some((now, &put.value)));
            Ok(true)
        })
        .await
    }

    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool, StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let Some((at, _)) = tx.kv(&ns, &key)? else {
                return Ok(false);
            };
            tx.put_kv(&ns, &key, Some(at), None);
            Ok(true)
        })
        .await
    }

    async fn index_upsert(&self, lease: &LeaseRef, doc: Doc, now: Millis) -> Result<UpsertOutcome> {
        let (collection, id, version, document) =
            (doc.collection, doc.id, doc.version, doc.document);
        let lease = lease.clone();
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let current = index_read(tx, &collection, &id)?;
            let stored = current.as_ref().map(|d| (d.document.is_some(), d.version));
            let outcome = rules::upsert(stored, version);
            if !matches!(outcome, UpsertOutcome::Inserted | UpsertOutcome::Updated) {
                return Ok(outcome);
            }
            let rec = DocRec {
                version,
                document: Some(document),
                updated_at: now,
            };
            tx.put_doc(strs(&[&collection, &id]), current.as_ref(), Some(&rec));
            Ok(outcome)
        })
        .await
    }

    async fn index_remove(&self, lease: &LeaseRef, tomb: Tombstone, now: Millis) -> Result<bool> {
        let (collection, id, version) = (tomb.collection, tomb.id, tomb.version);
        let lease = lease.clone();
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let current = index_read(tx, &collection, &id)?;
            let stored = current.as_ref().map(|d| (d.document.is_some(), d.version));
            let Some(removed) = rules::remove(stored, version) else {
                return Ok(false);
            };
            let rec = DocRec {
                version,
                document: None,
                updated_at: now,
            };
            tx.put_doc(strs(&[&collection, &id]), current.as_ref(), Some(&rec));
            Ok(removed)
        })
        .await
    }

    async fn index_get_leased(&self, lease: &LeaseRef, doc: &DocId) -> Result<Option<String>> {
        let (lease, doc) = (lease.clone(), doc.clone());
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            Ok(index_read(tx, &doc.collection, &doc.id)?.and_then(|d| d.document))
        })
        .await
    }

    async fn index_get(&self, doc: &DocId) -> Result<Option<(String, u64)>> {
        let key = strs(&[&doc.collection, &doc.id]);
        self.read(move |t| {
            let d: Option<DocRec> = t.get_rec(INDEX, &key)?;
            Ok(d.and_then(|d| d.document.map(|doc| (doc, d.version))))
        })
        .await
    }

    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin, StoreError> {
        let (lease, id, fingerprint) = (lease.clone(), id.clone(), fingerprint.to_vec());
        self.write(true, move |tx| {
            fence_begin_step(tx, &lease, &id, &fingerprint, now)
        })
        .await
    }

    async fn fence_take_over(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            check_lease(tx, &lease)?;
            let f = owned_or_abandoned(tx, &lease, &id)?;
            set_fence(tx, &f, FenceState::Started, &lease, None, now);
            Ok(())
        })
        .await
    }

    async fn fence_done(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            let f = held_by(tx, &lease, &id)?;
            set_fence(tx, &f, FenceState::Done, &lease, Some(result), now);
            Ok(())
        })
        .await
    }

    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            let f = held_by(tx, &lease, &id)?;
            tx.put_fence(Some(&f), None);
            Ok(())
        })
        .await
    }

    async fn fence_uncertain(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            let f = owned_or_abandoned(tx, &lease, &id)?;
            set_fence(tx, &f, FenceState::Uncertain, &lease, None, now);
            Ok(())
        })
        .await
    }

    async fn fence_resolve(&self, id: &FenceId, resolution: Resolution, now: Millis) -> Result<()> {
        let id = id.clone();
        self.write(true, move |tx| fence_resolve_step(tx, &id, resolution, now))
            .await
    }

    async fn fences(&self, filter: &FenceFilter) -> Result<Vec<Fence>> {
        let (namespace, state, limit) = (filter.namespace.as_deref(), filter.state, filter.limit);
        let namespace = namespace.map(str::to_owned);
        self.read(move |t| {
            let limit = limit.clamp(1, 1000) as usize;
            let mut out = Vec::new();
            for entry in t.t[FENCES_BY_TIME].iter().rev() {
                if out.len() >= limit {
                    break;
                }
                let (_, key) = entry.map_err(sled_err)?;
                let Some(f) = t.get_rec::<FenceRec>(FENCES, &key)? else {
                    continue;
                };
                if namespace.as_ref().is_some_and(|n| *n != f.namespace)
                    || state.is_some_and(|s| s != f.state)
                {
                    continue;
                }
                out.push(f.to_fence());
            }
            Ok(out)
        })
        .await
    }

    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<(), StoreError> {
        let job_id = job_id.to_owned();
        self.write(false, move |tx| {
            let prefix = effect_prefix(&job_id, record.attempt);
            let last = tx.trees.t[EFFECTS]
                .scan_prefix(&prefix)
                .keys()
                .next_back()
                .transpose()
                .map_err(sled_err)?;
            let n = last
                .and_then(|k| <[u8; 4]>::try_from(&k[prefix.len()..]).ok())
                .map_or(0, u32::from_be_bytes);
            let mut key = prefix;
            key.extend_from_slice(&(n + 1).to_be_bytes());
            let rec = EffectRec {
                kind: record.kind,
                key: record.key,
                outcome: record.outcome,
                at: record.at,
            };
            tx.insert(EFFECTS, key, encode(&rec));
            Ok(())
        })
        .await
    }

    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
        let job_id = job_id.to_owned();
        self.read(move |t| t.effects(&job_id)).await
    }

    async fn export(&self, cursor: Option<copy::Cursor>, limit: u32) -> Result<copy::ExportPage> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        self.read(move |t| export_page(t, &cursor, limit)).await
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        self.write(true, move |tx| import_step(tx, &records)).await
    }
}
