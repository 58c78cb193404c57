//! [`Store`] for [`SqliteStore`]: writes go through the group-commit
//! writer, reads through the reader pool.

use super::*;
use crate::store::{Doc, DocId, FenceFilter, KvPut, LeaseAsk, Leased, PutMode, Result, Tombstone};

#[async_trait]
impl Store for SqliteStore {
    fn halted(&self) -> Option<String> {
        self.writer.halt().reason()
    }

    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>, StoreError> {
        self.write(true, move |w| {
            jobs.into_iter()
                .enumerate()
                .map(|(i, j)| enqueue_one(w, j, i, now))
                .collect()
        })
        .await
    }

    async fn lease(&self, ask: &LeaseAsk<'_>, now: Millis) -> Result<Leased> {
        // One daemon owns this ledger: its own slots and rate limiter keep
        // `ask.limits`, and `max` is the only bound here.
        let (queue, max, version) = (ask.queue.to_owned(), ask.max, ask.plugin_version.to_owned());
        let leases = self
            .write(false, move |w| lease_batch(w, &queue, max, &version, now))
            .await?;
        Ok(Leased { leases, held: None })
    }

    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>, StoreError> {
        let queue = queue.to_owned();
        self.read(move |c| {
            let v: Option<i64> = c
                .prepare_cached(
                    "SELECT MIN(run_at) FROM jobs INDEXED BY jobs_due WHERE queue = ?1 AND state = 'waiting'",
                )?
                .query_row([queue], |r| r.get(0))?;
            Ok(v.map(Millis))
        })
        .await
    }

    async fn finish(&self, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState> {
        let lease = lease.clone();
        // A fenced finish still records how its attempt ended: commit that
        // part, then report the fence.
        self.write(true, move |w| match finish_step(w, &lease, finish, now) {
            fenced @ Err(StoreError::Fenced { .. }) => Ok(fenced),
            other => other.map(Ok),
        })
        .await?
    }

    async fn recover(&self, now: Millis) -> Result<u64, StoreError> {
        self.write(true, move |w| recover_step(w, now)).await
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
        let id = id.to_owned();
        self.write(true, move |w| cancel_step(w, &id, now)).await
    }

    async fn retry(&self, id: &str, now: Millis) -> Result<Job, StoreError> {
        let id = id.to_owned();
        self.write(true, move |w| retry_step(w, &id, now)).await
    }

    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>, StoreError> {
        let id = id.to_owned();
        self.read(move |c| {
            let Some(mut job) = load_job(c, &id, now)? else {
                return Ok(None);
            };
            job.attempts = load_attempts(c, &id)?;
            Ok(Some(job))
        })
        .await
    }

    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage, StoreError> {
        self.read(move |c| {
            let limit = filter.limit.clamp(1, 1000);
            let cursor = i64::try_from(filter.before()?).unwrap_or(i64::MAX);
            let mut sql = format!("SELECT {JOB_COLUMNS}, seq FROM jobs WHERE seq < ?1");
            let mut args: Vec<rusqlite::types::Value> = vec![cursor.into()];
            if let Some(q) = &filter.queue {
                args.push(q.clone().into());
                sql.push_str(&format!(" AND queue = ?{}", args.len()));
            }
            match filter.state {
                Some(JobState::Delayed) => {
                    args.push(now.0.into());
                    sql.push_str(&format!(
                        " AND state = 'waiting' AND run_at > ?{}",
                        args.len()
                    ));
                }
                Some(JobState::Waiting) => {
                    args.push(now.0.into());
                    sql.push_str(&format!(
                        " AND state = 'waiting' AND run_at <= ?{}",
                        args.len()
                    ));
                }
                Some(s) => {
                    args.push(s.as_str().to_owned().into());
                    sql.push_str(&format!(" AND state = ?{}", args.len()));
                }
                None => {}
            }
            args.push(i64::from(limit).into());
            sql.push_str(&format!(" ORDER BY seq DESC LIMIT ?{}", args.len()));
            let mut stmt = c.prepare_cached(&sql)?;
            let mut page = PageBuilder::new(limit);
            let mut found = stmt.query(rusqlite::params_from_iter(args))?;
            while page.has_room()
                && let Some(r) = found.next()?
            {
                page.push(job_from_row(r, now)?, r.get(14)?);
            }
            Ok(page.finish())
        })
        .await
    }

    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>, StoreError> {
        self.read(move |c| {
            // The stored states come from the counters; `delayed` (waiting
            // with run_at in the future) is counted on the jobs_due index,
            // which costs what is delayed, not what is stored.
            let mut stmt = c.prepare_cached(
                "SELECT queue, state, n FROM job_counts WHERE n > 0 ORDER BY queue",
            )?;
            let mut delayed = c.prepare_cached(
                "SELECT COUNT(*) FROM jobs WHERE queue = ?1 AND state = 'waiting' AND run_at > ?2",
            )?;
            let mut out: Vec<(String, StateCounts)> = Vec::new();
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            for row in rows {
                let (queue, state, n) = row?;
                if out.last().is_none_or(|(q, _)| *q != queue) {
                    out.push((queue, StateCounts::default()));
                }
                if let Some((_, counts)) = out.last_mut() {
                    counts.add(stored_state(&state), u64::try_from(n).unwrap_or(0));
                }
            }
            for (queue, counts) in &mut out {
                if counts.waiting == 0 {
                    continue;
                }
                let n: i64 = delayed.query_row(params![queue.as_str(), now.0], |r| r.get(0))?;
                let n = u64::try_from(n).unwrap_or(0).min(counts.waiting);
                counts.waiting -= n;
                counts.delayed += n;
            }
            Ok(out)
        })
        .await
    }

    async fn sweep(&self, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept> {
        let rules = rules.clone();
        self.write(true, move |w| sweep_step(w, now, &rules, limit))
            .await
    }

    async fn kv_get(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            kv_get_step(&w.conn, &ns, &key)
        })
        .await
    }

    async fn kv_put(&self, lease: &LeaseRef, put: KvPut, now: Millis) -> Result<bool> {
        let lease = lease.clone();
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
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
        })
        .await
    }

    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool, StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let n = w
                .conn
                .prepare_cached("DELETE FROM kv WHERE namespace = ?1 AND key = ?2")?
                .execute(params![ns, key])?;
            Ok(n == 1)
        })
        .await
    }

    async fn index_upsert(&self, lease: &LeaseRef, doc: Doc, now: Millis) -> Result<UpsertOutcome> {
        let (collection, id, version, document) =
            (doc.collection, doc.id, doc.version, doc.document);
        let lease = lease.clone();
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let current = index_read(&w.conn, &collection, &id)?;
            let outcome = rules::upsert(current.map(|(d, v)| (d.is_some(), v)), version);
            if !matches!(outcome, UpsertOutcome::Inserted | UpsertOutcome::Updated) {
                return Ok(outcome);
            }
            w.conn
                .prepare_cached(
                    "INSERT OR REPLACE INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![collection, id, version_param(version), document, now.0])?;
            Ok(outcome)
        })
        .await
    }

    async fn index_remove(&self, lease: &LeaseRef, tomb: Tombstone, now: Millis) -> Result<bool> {
        let (collection, id, version) = (tomb.collection, tomb.id, tomb.version);
        let lease = lease.clone();
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            let current = index_read(&w.conn, &collection, &id)?;
            let Some(removed) = rules::remove(current.map(|(d, v)| (d.is_some(), v)), version)
            else {
                return Ok(false);
            };
            w.conn
                .prepare_cached(
                    "INSERT OR REPLACE INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES (?1, ?2, ?3, NULL, ?4)",
                )?
                .execute(params![collection, id, version_param(version), now.0])?;
            Ok(removed)
        })
        .await
    }

    async fn index_get_leased(&self, lease: &LeaseRef, doc: &DocId) -> Result<Option<String>> {
        let (lease, doc) = (lease.clone(), doc.clone());
        self.write(false, move |w| {
            check_lease(&w.conn, &lease)?;
            Ok(index_read(&w.conn, &doc.collection, &doc.id)?.and_then(|(d, _)| d))
        })
        .await
    }

    async fn index_get(&self, doc: &DocId) -> Result<Option<(String, u64)>> {
        let doc = doc.clone();
        self.read(move |c| {
            Ok(index_read(c, &doc.collection, &doc.id)?.and_then(|(d, v)| d.map(|d| (d, v))))
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
        self.write(true, move |w| {
            fence_begin_step(&w.conn, &lease, &id, &fingerprint, now)
        })
        .await
    }

    async fn fence_take_over(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            check_lease(&w.conn, &lease)?;
            owned_or_abandoned(&w.conn, &lease, &id)?;
            set_fence(&w.conn, &id, FenceState::Started, &lease, None, now)
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
        self.write(true, move |w| {
            held_by(&w.conn, &lease, &id)?;
            set_fence(&w.conn, &id, FenceState::Done, &lease, Some(&result), now)
        })
        .await
    }

    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            held_by(&w.conn, &lease, &id)?;
            delete_fence(&w.conn, &id)
        })
        .await
    }

    async fn fence_uncertain(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |w| {
            owned_or_abandoned(&w.conn, &lease, &id)?;
            set_fence(&w.conn, &id, FenceState::Uncertain, &lease, None, now)
        })
        .await
    }

    async fn fence_resolve(&self, id: &FenceId, resolution: Resolution, now: Millis) -> Result<()> {
        let id = id.clone();
        self.write(true, move |w| {
            fence_resolve_step(&w.conn, &id, resolution, now)
        })
        .await
    }

    async fn fences(&self, filter: &FenceFilter) -> Result<Vec<Fence>> {
        let (namespace, state, limit) = (filter.namespace.as_deref(), filter.state, filter.limit);
        let namespace = namespace.map(str::to_owned);
        self.read(move |c| {
            let sql = format!(
                "SELECT {FENCE_COLUMNS} FROM fences WHERE (?1 IS NULL OR namespace = ?1) \
                 AND (?2 IS NULL OR state = ?2) ORDER BY updated_at DESC LIMIT ?3"
            );
            let rows = c
                .prepare_cached(&sql)?
                .query_map(
                    params![
                        namespace,
                        state.map(FenceState::as_str),
                        limit.clamp(1, 1000)
                    ],
                    fence_from_row,
                )?
                .collect::<Result<_, _>>()?;
            Ok(rows)
        })
        .await
    }

    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<(), StoreError> {
        let job_id = job_id.to_owned();
        self.write(false, move |w| {
            w.conn
                .prepare_cached(
                    "INSERT INTO effects (job_id, attempt, n, kind, key, outcome, at) VALUES \
                     (?1, ?2, (SELECT COALESCE(MAX(n), 0) + 1 FROM effects WHERE job_id = ?1 AND attempt = ?2), ?3, ?4, ?5, ?6)",
                )?
                .execute(params![job_id, record.attempt, record.kind, record.key, record.outcome, record.at.0])?;
            Ok(())
        })
        .await
    }

    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
        let job_id = job_id.to_owned();
        self.read(move |c| {
            let rows = c
                .prepare_cached("SELECT attempt, kind, key, outcome, at FROM effects WHERE job_id = ?1 ORDER BY attempt, n")?
                .query_map([job_id], |r| {
                    Ok(EffectRecord {
                        attempt: r.get(0)?,
                        kind: r.get(1)?,
                        key: r.get(2)?,
                        outcome: r.get(3)?,
                        at: Millis(r.get(4)?),
                    })
                })?
                .collect::<Result<_, _>>()?;
            Ok(rows)
        })
        .await
    }

    async fn export(&self, cursor: Option<copy::Cursor>, limit: u32) -> Result<copy::ExportPage> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        self.read(move |c| export_page(c, &cursor, limit)).await
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        self.write(true, move |w| import_step(w, &records)).await
    }
}
