//! The trees and the transaction over them: every step reads and writes
//! through [`Tx`], which keeps the secondary trees and the counters in step
//! with the records.

use super::*;

pub(in crate::store) struct Trees {
    pub(super) db: sled::Db,
    pub(super) t: Vec<sled::Tree>,
}

impl Trees {
    pub(super) fn get(&self, tree: usize, key: &[u8]) -> Result<Option<sled::IVec>, StoreError> {
        self.t[tree].get(key).map_err(sled_err)
    }

    pub(super) fn get_rec<T: DeserializeOwned>(
        &self,
        tree: usize,
        key: &[u8],
    ) -> Result<Option<T>, StoreError> {
        match self.get(tree, key)? {
            Some(v) => decode(tree, key, &v).map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn job(&self, id: &str) -> Result<Option<JobRec>, StoreError> {
        self.get_rec(JOBS, id.as_bytes())
    }

    pub(super) fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRec>, StoreError> {
        let prefix = strs(&[job_id]);
        self.t[ATTEMPTS]
            .scan_prefix(&prefix)
            .map(|r| {
                let (k, v) = r.map_err(sled_err)?;
                decode(ATTEMPTS, &k, &v)
            })
            .collect()
    }

    /// The effects recorded for a job, by attempt and then in the order
    /// recorded (the key order of `effects`).
    pub(super) fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
        let prefix = strs(&[job_id]);
        self.t[EFFECTS]
            .scan_prefix(&prefix)
            .map(|entry| {
                let (k, v) = entry.map_err(sled_err)?;
                let attempt = k
                    .get(prefix.len()..prefix.len() + 4)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok())
                    .map(u32::from_be_bytes)
                    .ok_or_else(|| corrupt(EFFECTS, &k))?;
                let rec: EffectRec = decode(EFFECTS, &k, &v)?;
                Ok(EffectRecord {
                    attempt,
                    kind: rec.kind,
                    key: rec.key,
                    outcome: rec.outcome,
                    at: rec.at,
                })
            })
            .collect()
    }

    /// The highest enqueue seq issued: the one `meta` records, or a stored
    /// job's if higher.
    pub(super) fn highest_seq(&self) -> Result<u64, StoreError> {
        let stored = self.t[BY_SEQ]
            .last()
            .map_err(sled_err)?
            .and_then(|(k, _)| <[u8; 8]>::try_from(k.as_ref()).ok())
            .map_or(0, u64::from_be_bytes);
        Ok(self.meta("seq")?.unwrap_or(0).max(stored))
    }

    pub(super) fn meta(&self, key: &str) -> Result<Option<u64>, StoreError> {
        Ok(self.get(META, key.as_bytes())?.and_then(|v| {
            let a: [u8; 8] = v.as_ref().try_into().ok()?;
            Some(u64::from_be_bytes(a))
        }))
    }
}

/// One step's writes, applied in one sled transaction when the step
/// succeeds. Point reads see the step's own writes first. Range scans read
/// the trees (every earlier step, not this one's writes): a step never scans
/// a range it has written.
pub(in crate::store) struct Tx {
    pub(super) trees: Arc<Trees>,
    pub(super) writes: BTreeMap<(usize, Vec<u8>), Option<Vec<u8>>>,
    pub(super) next_token: u64,
    pub(super) next_seq: u64,
}

impl Tx {
    pub(super) fn get(&self, tree: usize, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(w) = self.writes.get(&(tree, key.to_vec())) {
            return Ok(w.clone());
        }
        Ok(self.trees.get(tree, key)?.map(|v| v.to_vec()))
    }

    pub(super) fn get_rec<T: DeserializeOwned>(
        &self,
        tree: usize,
        key: &[u8],
    ) -> Result<Option<T>, StoreError> {
        match self.get(tree, key)? {
            Some(v) => decode(tree, key, &v).map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn insert(&mut self, tree: usize, key: Vec<u8>, value: Vec<u8>) {
        self.writes.insert((tree, key), Some(value));
    }

    pub(super) fn remove(&mut self, tree: usize, key: Vec<u8>) {
        self.writes.insert((tree, key), None);
    }

    pub(super) fn job(&self, id: &str) -> Result<Option<JobRec>, StoreError> {
        self.get_rec(JOBS, id.as_bytes())
    }

    pub(super) fn require_job(&self, id: &str) -> Result<JobRec, StoreError> {
        self.job(id)?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))
    }

    pub(super) fn count(
        &mut self,
        queue: &str,
        state: JobState,
        delta: i64,
    ) -> Result<(), StoreError> {
        let key = strs(&[queue, state.as_str()]);
        let n = self
            .get(COUNTS, &key)?
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_be_bytes);
        let n = n.saturating_add_signed(delta);
        if n == 0 {
            self.remove(COUNTS, key);
        } else {
            self.insert(COUNTS, key, n.to_be_bytes().to_vec());
        }
        Ok(())
    }

    /// Replaces the job `old` with `new` (either may be absent), with every
    /// secondary entry and count.
    pub(super) fn put_job(
        &mut self,
        old: Option<&JobRec>,
        new: Option<&JobRec>,
    ) -> Result<(), StoreError> {
        if let Some(old) = old {
            for (tree, key, _) in old.derived() {
                self.remove(tree, key);
            }
            self.count(&old.queue, old.state, -1)?;
            if new.is_none() {
                self.remove(JOBS, old.id.as_bytes().to_vec());
            }
        }
        if let Some(new) = new {
            for (tree, key, value) in new.derived() {
                self.insert(tree, key, value);
            }
            self.count(&new.queue, new.state, 1)?;
            self.insert(JOBS, new.id.as_bytes().to_vec(), encode(new));
        }
        Ok(())
    }

    pub(super) fn fence(&self, id: &FenceId) -> Result<Option<FenceRec>, StoreError> {
        self.get_rec(FENCES, &fence_key(id))
    }

    pub(super) fn put_fence(&mut self, old: Option<&FenceRec>, new: Option<&FenceRec>) {
        let key = match (old, new) {
            (Some(f), _) | (None, Some(f)) => fence_key(&FenceId {
                namespace: f.namespace.clone(),
                kind: f.kind.clone(),
                key: f.key.clone(),
            }),
            (None, None) => return,
        };
        if let Some(old) = old {
            self.remove(FENCES_BY_TIME, fence_time_key(old.updated_at, &key));
        }
        match new {
            Some(new) => {
                self.insert(
                    FENCES_BY_TIME,
                    fence_time_key(new.updated_at, &key),
                    key.clone(),
                );
                self.insert(FENCES, key, encode(new));
            }
            None => self.remove(FENCES, key),
        }
    }

    /// The kv entry `ns`/`key`: its write time and value.
    pub(super) fn kv(&self, ns: &str, key: &str) -> Result<Option<(Millis, Vec<u8>)>, StoreError> {
        match self.get(KV, &strs(&[ns, key]))? {
            Some(stored) => {
                let (at, value) = split_kv_value(&stored)?;
                Ok(Some((at, value.to_vec())))
            }
            None => Ok(None),
        }
    }

    /// Replaces the kv entry `ns`/`key` (written at `old`, if it exists)
    /// with `new`, keeping `kv_by_time`.
    pub(super) fn put_kv(
        &mut self,
        ns: &str,
        key: &str,
        old: Option<Millis>,
        new: Option<(Millis, &[u8])>,
    ) {
        if let Some(at) = old {
            self.remove(KV_BY_TIME, kv_time_key(ns, at, key));
        }
        let k = strs(&[ns, key]);
        match new {
            Some((at, value)) => {
                self.insert(KV_BY_TIME, kv_time_key(ns, at, key), k.clone());
                self.insert(KV, k, kv_value(at, value));
            }
            None => self.remove(KV, k),
        }
    }

    /// Replaces the index entry `key` (`old`, if it exists) with `new`,
    /// keeping `tombstones`.
    pub(super) fn put_doc(&mut self, key: Vec<u8>, old: Option<&DocRec>, new: Option<&DocRec>) {
        if let Some(old) = old.filter(|d| d.document.is_none()) {
            self.remove(TOMBSTONES, fence_time_key(old.updated_at, &key));
        }
        match new {
            Some(new) => {
                if new.document.is_none() {
                    self.insert(
                        TOMBSTONES,
                        fence_time_key(new.updated_at, &key),
                        key.clone(),
                    );
                }
                self.insert(INDEX, key, encode(new));
            }
            None => self.remove(INDEX, key),
        }
    }

    /// Applies the writes in one sled transaction over the trees they touch.
    pub(super) fn commit(self) -> Result<(), StoreError> {
        if self.writes.is_empty() {
            return Ok(());
        }
        let mut touched: Vec<usize> = self.writes.keys().map(|(t, _)| *t).collect();
        touched.dedup();
        let trees: Vec<sled::Tree> = touched.iter().map(|&t| self.trees.t[t].clone()).collect();
        let writes = &self.writes;
        trees
            .as_slice()
            .transaction(|txs| {
                for ((tree, key), value) in writes {
                    let at = touched.iter().position(|t| t == tree).unwrap_or(0);
                    match value {
                        Some(v) => {
                            txs[at].insert(key.as_slice(), v.as_slice())?;
                        }
                        None => {
                            txs[at].remove(key.as_slice())?;
                        }
                    }
                }
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| unavailable(format!("sled transaction: {e:?}")))
    }
}
