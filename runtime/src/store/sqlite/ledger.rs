//! [`Ledger`] for [`SqliteStore`]: each step is a savepoint of the
//! writer's group transaction; the kv, index and fence primitives are rows.

use super::*;
use crate::store::embedded::Ledger;
use crate::store::{DocId, KvPut, PutMode, Result};

impl Ledger for SqliteStore {
    type Engine = Writer;
    type Tx = Writer;
    type Fence = Fence;
    /// The document (`None`: a tombstone) and its version.
    type Doc = (Option<String>, u64);

    fn writer(&self) -> &GroupWriter<Writer> {
        &self.writer
    }

    fn step<T>(w: &mut Writer, f: impl FnOnce(&mut Writer) -> Result<T>) -> Result<T> {
        in_savepoint(w, f)
    }

    fn check_lease(w: &Writer, lease: &LeaseRef) -> Result<()> {
        check_lease(&w.conn, lease)
    }

    fn enqueue_one(w: &mut Writer, job: NewJob, index: usize, now: Millis) -> Result<Enqueued> {
        enqueue_one(w, job, index, now)
    }

    fn lease_batch(
        w: &mut Writer,
        queue: &str,
        max: u32,
        version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>> {
        lease_batch(w, queue, max, version, now)
    }

    fn finish(w: &mut Writer, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState> {
        finish_step(w, lease, finish, now)
    }

    fn recover(w: &mut Writer, now: Millis) -> Result<u64> {
        recover_step(w, now)
    }

    fn cancel(w: &mut Writer, id: &str, now: Millis) -> Result<(Job, bool)> {
        cancel_step(w, id, now)
    }

    fn retry(w: &mut Writer, id: &str, now: Millis) -> Result<Job> {
        retry_step(w, id, now)
    }

    fn sweep(w: &mut Writer, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept> {
        sweep_step(w, now, rules, limit)
    }

    fn import(w: &mut Writer, records: &[copy::Record]) -> Result<()> {
        import_step(w, records)
    }

    fn record_effect(w: &mut Writer, job_id: &str, record: EffectRecord) -> Result<()> {
        w.conn
            .prepare_cached(
                "INSERT INTO effects (job_id, attempt, n, kind, key, outcome, at) VALUES \
                 (?1, ?2, (SELECT COALESCE(MAX(n), 0) + 1 FROM effects WHERE job_id = ?1 AND attempt = ?2), ?3, ?4, ?5, ?6)",
            )?
            .execute(params![job_id, record.attempt, record.kind, record.key, record.outcome, record.at.0])?;
        Ok(())
    }

    fn kv_get(w: &Writer, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        kv_get_step(&w.conn, ns, key)
    }

    fn kv_put(w: &mut Writer, put: KvPut, now: Millis) -> Result<bool> {
        let sql = match put.mode {
            PutMode::Replace => {
                "INSERT OR REPLACE INTO kv (namespace, key, value, written_at) VALUES (?1, ?2, ?3, ?4)"
            }
            PutMode::IfAbsent => {
                "INSERT OR IGNORE INTO kv (namespace, key, value, written_at) VALUES (?1, ?2, ?3, ?4)"
            }
        };
        let n = w
            .conn
            .prepare_cached(sql)?
            .execute(params![put.ns, put.key, put.value, now.0])?;
        Ok(n == 1)
    }

    fn kv_delete(w: &mut Writer, ns: &str, key: &str) -> Result<bool> {
        let n = w
            .conn
            .prepare_cached("DELETE FROM kv WHERE namespace = ?1 AND key = ?2")?
            .execute(params![ns, key])?;
        Ok(n == 1)
    }

    fn doc(w: &Writer, id: &DocId) -> Result<Option<Self::Doc>> {
        index_read(&w.conn, &id.collection, &id.id)
    }

    fn doc_parts(doc: &Self::Doc) -> (Option<&str>, u64) {
        (doc.0.as_deref(), doc.1)
    }

    fn put_doc(
        w: &mut Writer,
        id: &DocId,
        _old: Option<&Self::Doc>,
        version: u64,
        document: Option<String>,
        now: Millis,
    ) -> Result<()> {
        w.conn
            .prepare_cached(
                "INSERT OR REPLACE INTO index_docs (collection, id, version, document, updated_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                id.collection,
                id.id,
                version_param(version),
                document,
                now.0
            ])?;
        Ok(())
    }

    fn fence(w: &Writer, id: &FenceId) -> Result<Option<Fence>> {
        load_fence(&w.conn, id)
    }

    fn insert_fence(
        w: &mut Writer,
        id: &FenceId,
        fingerprint: &[u8],
        lease: &LeaseRef,
        now: Millis,
    ) -> Result<()> {
        insert_fence(&w.conn, id, fingerprint, lease, now)
    }

    fn set_fence(
        w: &mut Writer,
        old: &Fence,
        state: FenceState,
        holder: &LeaseRef,
        result: Option<Vec<u8>>,
        now: Millis,
    ) -> Result<()> {
        set_fence(&w.conn, &old.id, state, holder, result.as_deref(), now)
    }

    fn delete_fence(w: &mut Writer, old: &Fence) -> Result<()> {
        delete_fence(&w.conn, &old.id)
    }
}
