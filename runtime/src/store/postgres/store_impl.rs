//! [`Store`] for [`PostgresStore`]: each operation one step (one
//! transaction, rerun when it lost a race), except `finish`, which the
//! finisher groups.

use super::*;
use crate::store::{Doc, DocId, FenceFilter, KvPut, LeaseAsk, Leased, PutMode, Result, Tombstone};

#[async_trait]
impl Store for PostgresStore {
    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>, StoreError> {
        step!(self, Mode::Write, |tx| {
            let out = enqueue_batch(&tx, &jobs, now).await?;
            let mut queues = std::collections::BTreeSet::new();
            for (j, e) in jobs.iter().zip(&out) {
                if !e.deduplicated {
                    queues.insert(j.queue.as_str());
                }
            }
            for q in queues {
                notify(&tx, q).await?;
            }
            Ok(out)
        })
    }

    async fn lease(&self, ask: &LeaseAsk<'_>, now: Millis) -> Result<Leased> {
        let LeaseAsk {
            queue,
            max,
            plugin_version,
            limits,
        } = *ask;
        let limits = &limits;
        let owner = (self.daemon_id.as_str(), self.lease_ms());
        let mut tries = 0;
        loop {
            let ending = self.ending();
            let leased = step!(self, Mode::Write, |tx| lease_step(
                &tx,
                queue,
                max,
                plugin_version,
                now,
                owner,
                limits,
                &ending
            )
            .await)?;
            self.hold(&leased.leases);
            tries += 1;
            // Held back by concurrency, with its wait committed: count again,
            // so that an attempt that ended before the wait was visible to
            // its waker (see `wake_waiting`) is not waited for.
            if leased.held != Some(Held::Concurrency)
                || !leased.leases.is_empty()
                || tries >= RECOUNTS
            {
                return Ok(leased);
            }
            let Some(limit) = limits.concurrency else {
                return Ok(leased);
            };
            let ending = self.ending();
            let client = self.client().await?;
            let r = row_opt(&client, IN_FLIGHT_SQL, &[&queue, &ending])
                .await
                .map_err(store_err)?;
            let in_flight = match r {
                Some(r) => u64_of(r.try_get(0)?),
                None => 0,
            };
            if in_flight >= u64::from(limit) {
                return Ok(leased);
            }
        }
    }

    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>, StoreError> {
        let client = self.client().await?;
        let r = row_opt(
            &client,
            "SELECT MIN(run_at) FROM jobs WHERE queue = $1 AND state = 'waiting'",
            &[&queue],
        )
        .await
        .map_err(store_err)?;
        Ok(match r {
            Some(r) => r.try_get::<_, Option<i64>>(0)?.map(Millis),
            None => None,
        })
    }

    /// Grouped with the finishes of other attempts by the finisher (see
    /// the module's notes). Durable when it returns `Ok` or `Fenced`: the
    /// COMMIT of the transaction holding it returned. `Unavailable`: it
    /// may or may not have committed.
    async fn finish(&self, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState> {
        // A fenced finish still records how its attempt ended: that part
        // commits, then the fence is reported.
        let (answer, answered) = tokio::sync::oneshot::channel();
        let token = i64_of(lease.token);
        if let Ok(mut ending) = self.ending.lock() {
            ending.insert(token);
        }
        let req = FinishReq {
            lease: lease.clone(),
            finish,
            now,
            answer,
        };
        let r = match self.finishes.send(req) {
            Ok(()) => answered.await.unwrap_or_else(|_| {
                Err(unavailable(
                    "the PostgreSQL finisher stopped before answering",
                ))
            }),
            Err(_) => Err(unavailable("the PostgreSQL finisher has stopped")),
        };
        // Its attempt is over, whatever the answer: the lease is renewed no
        // more (if the finish did not commit, the lease expires and another
        // pass reclaims the job, counted in flight until then).
        self.release(lease);
        if let Ok(mut ending) = self.ending.lock() {
            ending.remove(&token);
        }
        r
    }

    /// Expired leases, and this store's own: jobs leased by other live
    /// daemons are theirs. A job this daemon's previous run (another id)
    /// left active is reclaimed once its lease expires, by
    /// [`Store::reclaim_expired`]. This store's own leases exist only when
    /// it leased before recovering, which stands for a restart of this
    /// daemon: they are abandoned too.
    async fn recover(&self, now: Millis) -> Result<u64, StoreError> {
        if let Ok(mut held) = self.held.lock() {
            held.clear();
        }
        let mut total = 0;
        let me = Some(self.daemon_id.as_str());
        loop {
            let n = step!(self, Mode::Write, |tx| reclaim_step(
                &tx,
                now,
                RECLAIM_BATCH,
                ABANDONED,
                me
            )
            .await)?;
            total += n;
            if n < u64::from(RECLAIM_BATCH) {
                return Ok(total);
            }
        }
    }

    async fn heartbeat(&self) -> Result<Vec<LeaseRef>, StoreError> {
        self.heartbeat_step().await
    }

    /// Measured on this process's monotonic clock from the answer of the
    /// statement that last set each lease's expiry: the database set it
    /// to `lease` after a moment before that answer, so once `lease` has
    /// passed here it has passed there (clock rates agree; their readings
    /// need not).
    fn leases_past_expiry(&self) -> Vec<LeaseRef> {
        let now = std::time::Instant::now();
        let Ok(mut held) = self.held.lock() else {
            return Vec::new();
        };
        let lost: Vec<LeaseRef> = held
            .iter()
            .filter(|(_, by)| **by <= now)
            .map(|(l, _)| l.clone())
            .collect();
        for l in &lost {
            held.remove(l);
        }
        lost
    }

    async fn reclaim_expired(&self, now: Millis) -> Result<u64, StoreError> {
        step!(self, Mode::Write, |tx| reclaim_step(
            &tx,
            now,
            RECLAIM_BATCH,
            LEASE_EXPIRED,
            None
        )
        .await)
    }

    fn wakeups(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<String>> {
        Some(self.start_listener())
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
        let (job, was_active) = step!(self, Mode::Write, |tx| cancel_step(&tx, id, now).await)?;
        if was_active
            && let Err(e) =
                wake_waiting(&self.pool, &self.target, std::slice::from_ref(&job.queue)).await
        {
            // The waiting daemons look again at their slow poll.
            tracing::debug!(error = %e, queue = %job.queue, "could not wake the daemons waiting for room");
        }
        Ok((job, was_active))
    }

    async fn retry(&self, id: &str, now: Millis) -> Result<Job, StoreError> {
        step!(self, Mode::Write, |tx| retry_step(&tx, id, now).await)
    }

    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>, StoreError> {
        step!(self, Mode::Read, |tx| {
            let Some(mut job) = load_job(&tx, id, now).await? else {
                return Ok(None);
            };
            job.attempts = load_attempts(&tx, id).await?;
            Ok(Some(job))
        })
    }

    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage, StoreError> {
        let limit = filter.limit.clamp(1, 1000);
        let cursor = i64::try_from(filter.before()?).unwrap_or(i64::MAX);
        let mut sql = " FROM jobs WHERE seq < $1".to_owned();
        let mut args: Vec<Box<dyn ToSql + Sync + Send>> = vec![Box::new(cursor)];
        if let Some(q) = &filter.queue {
            args.push(Box::new(q.clone()));
            sql.push_str(&format!(" AND queue = ${}", args.len()));
        }
        match filter.state {
            Some(JobState::Delayed) => {
                args.push(Box::new(now.0));
                sql.push_str(&format!(
                    " AND state = 'waiting' AND run_at > ${}",
                    args.len()
                ));
            }
            Some(JobState::Waiting) => {
                args.push(Box::new(now.0));
                sql.push_str(&format!(
                    " AND state = 'waiting' AND run_at <= ${}",
                    args.len()
                ));
            }
            Some(s) => {
                args.push(Box::new(s.as_str().to_owned()));
                sql.push_str(&format!(" AND state = ${}", args.len()));
            }
            None => {}
        }
        args.push(Box::new(i64::from(limit)));
        sql.push_str(&format!(" ORDER BY seq DESC LIMIT ${}", args.len()));
        let params: Vec<&(dyn ToSql + Sync)> =
            args.iter().map(|a| &**a as &(dyn ToSql + Sync)).collect();
        let client = self.client().await?;
        // The rows' sizes first (no payload crosses the wire), so that the
        // page's rows are fetched only as far as PAGE_BYTES reaches: a
        // query's rows arrive whole.
        let sizes = rows(
            &client,
            &format!(
                "SELECT octet_length(payload) + coalesce(octet_length(result), 0)                  + coalesce(octet_length(last_error), 0){sql}"
            ),
            &params,
        )
        .await
        .map_err(store_err)?;
        let mut bytes = 0i64;
        let mut fit = 0usize;
        for r in &sizes {
            fit += 1;
            bytes += r.try_get::<_, i32>(0)? as i64;
            if bytes >= PAGE_BYTES as i64 {
                break;
            }
        }
        drop(params);
        let mut page = PageBuilder::new(limit);
        if fit > 0 {
            args.pop();
            args.push(Box::new(fit as i64));
            let params: Vec<&(dyn ToSql + Sync)> =
                args.iter().map(|a| &**a as &(dyn ToSql + Sync)).collect();
            let found = rows(&client, &format!("SELECT {JOB_COLUMNS}, seq{sql}"), &params)
                .await
                .map_err(store_err)?;
            for r in found.iter().take(fit) {
                if !page.has_room() {
                    break;
                }
                page.push(job_from_row(r, now).map_err(store_err)?, r.try_get(14)?);
            }
        }
        Ok(page.finish())
    }

    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>, StoreError> {
        step!(self, Mode::Read, |tx| {
            // The stored states come from the counters; `delayed` (waiting
            // with run_at in the future) is counted on the jobs_due index,
            // which costs what is delayed, not what is stored.
            let stored = rows(
                &tx,
                "SELECT queue, state, SUM(n)::bigint FROM job_counts GROUP BY queue, state \
                 HAVING SUM(n) > 0 ORDER BY queue, state",
                &[],
            )
            .await?;
            let mut out: Vec<(String, StateCounts)> = Vec::new();
            for r in &stored {
                let queue: String = r.try_get(0)?;
                let state: String = r.try_get(1)?;
                let n: i64 = r.try_get(2)?;
                if out.last().is_none_or(|(q, _)| *q != queue) {
                    out.push((queue, StateCounts::default()));
                }
                if let Some((_, counts)) = out.last_mut() {
                    counts.add(stored_state(&state), u64_of(n));
                }
            }
            for (queue, counts) in &mut out {
                if counts.waiting == 0 {
                    continue;
                }
                let n: i64 = rows(
                    &tx,
                    "SELECT COUNT(*) FROM jobs WHERE queue = $1 AND state = 'waiting' AND run_at > $2",
                    &[&queue.as_str(), &now.0],
                )
                .await?
                .first()
                .map(|r| r.try_get(0))
                .transpose()?
                .unwrap_or(0);
                let n = u64_of(n).min(counts.waiting);
                counts.waiting -= n;
                counts.delayed += n;
            }
            Ok(out)
        })
    }

    async fn sweep(&self, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept> {
        step!(self, Mode::Write, |tx| sweep_step(&tx, now, rules, limit)
            .await)
    }

    async fn kv_get(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        self.leased_read(
            lease,
            "SELECT value FROM kv WHERE namespace = $2 AND key = $3",
            ns,
            key,
        )
        .await
    }

    async fn kv_put(&self, lease: &LeaseRef, put: KvPut, now: Millis) -> Result<bool> {
        let sql = match put.mode {
            PutMode::Replace => {
                "INSERT INTO kv (namespace, key, value, written_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (namespace, key) DO UPDATE \
                 SET value = EXCLUDED.value, written_at = EXCLUDED.written_at"
            }
            PutMode::IfAbsent => {
                "INSERT INTO kv (namespace, key, value, written_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (namespace, key) DO NOTHING"
            }
        };
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            let n = exec(&tx, sql, &[&put.ns, &put.key, &put.value, &now.0]).await?;
            Ok(n == 1)
        })
    }

    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool, StoreError> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            let n = exec(
                &tx,
                "DELETE FROM kv WHERE namespace = $1 AND key = $2",
                &[&ns, &key],
            )
            .await?;
            Ok(n == 1)
        })
    }

    async fn index_upsert(&self, lease: &LeaseRef, doc: Doc, now: Millis) -> Result<UpsertOutcome> {
        let (collection, id, version, document) =
            (doc.collection, doc.id, doc.version, doc.document);
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            index_upsert_step(&tx, &collection, &id, &document, version, now).await
        })
    }

    async fn index_remove(&self, lease: &LeaseRef, tomb: Tombstone, now: Millis) -> Result<bool> {
        let (collection, id, version) = (tomb.collection, tomb.id, tomb.version);
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            index_remove_step(&tx, &collection, &id, version, now).await
        })
    }

    async fn index_get_leased(&self, lease: &LeaseRef, doc: &DocId) -> Result<Option<String>> {
        let (collection, id) = (doc.collection.as_str(), doc.id.as_str());
        // A tombstone's document is NULL, as is a missing one's.
        self.leased_read(
            lease,
            "SELECT document FROM index_docs WHERE collection = $2 AND id = $3",
            collection,
            id,
        )
        .await
    }

    async fn index_get(&self, doc: &DocId) -> Result<Option<(String, u64)>> {
        let (collection, id) = (doc.collection.as_str(), doc.id.as_str());
        let client = self.client().await?;
        let found = index_read(&client, collection, id, false)
            .await
            .map_err(store_err)?;
        Ok(found.and_then(|(d, v)| d.map(|d| (d, v))))
    }

    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin, StoreError> {
        step!(self, Mode::Write, |tx| fence_begin_step(
            &tx,
            lease,
            id,
            fingerprint,
            now
        )
        .await)
    }

    async fn fence_take_over(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        step!(self, Mode::Write, |tx| {
            check_lease(&tx, lease, true).await?;
            owned_or_abandoned(&tx, lease, id).await?;
            set_fence(&tx, id, FenceState::Started, lease, None, now).await
        })
    }

    async fn fence_done(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            held_by(&tx, lease, id).await?;
            set_fence(&tx, id, FenceState::Done, lease, Some(&result), now).await
        })
    }

    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            held_by(&tx, lease, id).await?;
            delete_fence(&tx, id).await
        })
    }

    async fn fence_uncertain(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        step!(self, Mode::Write, |tx| {
            owned_or_abandoned(&tx, lease, id).await?;
            set_fence(&tx, id, FenceState::Uncertain, lease, None, now).await
        })
    }

    async fn fence_resolve(&self, id: &FenceId, resolution: Resolution, now: Millis) -> Result<()> {
        step!(self, Mode::Write, |tx| fence_resolve_step(
            &tx, id, resolution, now
        )
        .await)
    }

    async fn fences(&self, filter: &FenceFilter) -> Result<Vec<Fence>> {
        let (namespace, state, limit) = (filter.namespace.as_deref(), filter.state, filter.limit);
        let sql = format!(
            "SELECT {FENCE_COLUMNS} FROM fences WHERE ($1::text IS NULL OR namespace = $1) \
             AND ($2::text IS NULL OR state = $2) ORDER BY updated_at DESC LIMIT $3"
        );
        let client = self.client().await?;
        let found = rows(
            &client,
            &sql,
            &[
                &namespace,
                &state.map(FenceState::as_str),
                &i64::from(limit.clamp(1, 1000)),
            ],
        )
        .await
        .map_err(store_err)?;
        found
            .iter()
            .map(fence_from_row)
            .collect::<Result<_, _>>()
            .map_err(store_err)
    }

    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| {
            exec(
                &tx,
                "INSERT INTO effects (job_id, attempt, kind, key, outcome, at) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[
                    &job_id,
                    &i32_of(record.attempt),
                    &record.kind,
                    &record.key,
                    &record.outcome,
                    &record.at.0,
                ],
            )
            .await?;
            Ok(())
        })
    }

    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
        let client = self.client().await?;
        let found = rows(
            &client,
            "SELECT attempt, kind, key, outcome, at FROM effects WHERE job_id = $1 \
             ORDER BY attempt, n",
            &[&job_id],
        )
        .await
        .map_err(store_err)?;
        found
            .iter()
            .map(|r| {
                Ok(EffectRecord {
                    attempt: u32_of(r.try_get(0)?),
                    kind: r.try_get(1)?,
                    key: r.try_get(2)?,
                    outcome: r.try_get(3)?,
                    at: Millis(r.try_get(4)?),
                })
            })
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(StoreError::from)
    }

    async fn export(&self, cursor: Option<copy::Cursor>, limit: u32) -> Result<copy::ExportPage> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        step!(self, Mode::Read, |tx| export_page(&tx, &cursor, limit)
            .await)
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        step!(self, Mode::Write, |tx| import_page(&tx, &records).await)
    }
}
