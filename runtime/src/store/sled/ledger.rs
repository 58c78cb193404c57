//! [`Ledger`] for [`SledStore`]: each step collects its writes in a [`Tx`]
//! and applies them in one sled transaction; the kv, index and fence
//! primitives are records of their trees.

use super::*;
use crate::store::embedded::Ledger;
use crate::store::{DocId, KvPut, PutMode, Result};

impl Ledger for SledStore {
    type Engine = Writer;
    type Tx = Tx;
    type Fence = FenceRec;
    type Doc = DocRec;

    fn writer(&self) -> &GroupWriter<Writer> {
        &self.writer
    }

    fn step<T>(w: &mut Writer, f: impl FnOnce(&mut Tx) -> Result<T>) -> Result<T> {
        w.run(f)
    }

    fn check_lease(tx: &Tx, lease: &LeaseRef) -> Result<()> {
        check_lease(tx, lease).map(drop)
    }

    fn enqueue_one(tx: &mut Tx, job: NewJob, index: usize, now: Millis) -> Result<Enqueued> {
        enqueue_one(tx, job, index, now)
    }

    fn lease_batch(
        tx: &mut Tx,
        queue: &str,
        max: u32,
        version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>> {
        lease_batch(tx, queue, max, version, now)
    }

    fn finish(tx: &mut Tx, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState> {
        finish_step(tx, lease, finish, now)
    }

    fn recover(tx: &mut Tx, now: Millis) -> Result<u64> {
        recover_step(tx, now)
    }

    fn cancel(tx: &mut Tx, id: &str, now: Millis) -> Result<(Job, bool)> {
        cancel_step(tx, id, now)
    }

    fn retry(tx: &mut Tx, id: &str, now: Millis) -> Result<Job> {
        retry_step(tx, id, now)
    }

    fn sweep(tx: &mut Tx, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept> {
        sweep_step(tx, now, rules, limit)
    }

    fn import(tx: &mut Tx, records: &[copy::Record]) -> Result<()> {
        import_step(tx, records)
    }

    fn record_effect(tx: &mut Tx, job_id: &str, record: EffectRecord) -> Result<()> {
        let prefix = effect_prefix(job_id, record.attempt);
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
    }

    fn kv_get(tx: &Tx, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        match tx.get(KV, &strs(&[ns, key]))? {
            Some(stored) => Ok(Some(split_kv_value(&stored)?.1.to_vec())),
            None => Ok(None),
        }
    }

    fn kv_put(tx: &mut Tx, put: KvPut, now: Millis) -> Result<bool> {
        let old = tx.kv(&put.ns, &put.key)?.map(|(at, _)| at);
        if old.is_some() && put.mode == PutMode::IfAbsent {
            return Ok(false);
        }
        tx.put_kv(&put.ns, &put.key, old, Some((now, &put.value)));
        Ok(true)
    }

    fn kv_delete(tx: &mut Tx, ns: &str, key: &str) -> Result<bool> {
        let Some((at, _)) = tx.kv(ns, key)? else {
            return Ok(false);
        };
        tx.put_kv(ns, key, Some(at), None);
        Ok(true)
    }

    fn doc(tx: &Tx, id: &DocId) -> Result<Option<DocRec>> {
        tx.get_rec(INDEX, &strs(&[&id.collection, &id.id]))
    }

    fn doc_parts(doc: &DocRec) -> (Option<&str>, u64) {
        (doc.document.as_deref(), doc.version)
    }

    fn put_doc(
        tx: &mut Tx,
        id: &DocId,
        old: Option<&DocRec>,
        version: u64,
        document: Option<String>,
        now: Millis,
    ) -> Result<()> {
        let rec = DocRec {
            version,
            document,
            updated_at: now,
        };
        tx.put_doc(strs(&[&id.collection, &id.id]), old, Some(&rec));
        Ok(())
    }

    fn fence(tx: &Tx, id: &FenceId) -> Result<Option<FenceRec>> {
        tx.fence(id)
    }

    fn insert_fence(
        tx: &mut Tx,
        id: &FenceId,
        fingerprint: &[u8],
        lease: &LeaseRef,
        now: Millis,
    ) -> Result<()> {
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
        Ok(())
    }

    fn set_fence(
        tx: &mut Tx,
        old: &FenceRec,
        state: FenceState,
        holder: &LeaseRef,
        result: Option<Vec<u8>>,
        now: Millis,
    ) -> Result<()> {
        let mut new = old.clone();
        new.state = state;
        new.job_id = holder.job_id.clone();
        new.attempt = holder.attempt;
        new.token = holder.token;
        if result.is_some() {
            new.result = result;
        }
        new.updated_at = now;
        tx.put_fence(Some(old), Some(&new));
        Ok(())
    }

    fn delete_fence(tx: &mut Tx, old: &FenceRec) -> Result<()> {
        tx.put_fence(Some(old), None);
        Ok(())
    }
}
