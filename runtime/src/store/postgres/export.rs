//! Moving a ledger (`store::copy`): export pages read in one snapshot, and
//! imports written in one transaction.

use super::*;

pub(super) fn pg_placeholder(i: usize) -> String {
    format!("${i}")
}

/// The rows of one export page: the cursor's key parts, then the limit.
pub(super) async fn page_rows<C: GenericClient>(
    c: &C,
    select: &str,
    keys: &[&str],
    cursor: &copy::Cursor,
    limit: u32,
) -> Result<Vec<Row>, Fail> {
    let sql = copy::page_sql(select, keys, &cursor.after, pg_placeholder)?;
    let limit = i64::from(limit);
    let mut params: Vec<&(dyn ToSql + Sync)> = cursor
        .after
        .iter()
        .map(|a| a as &(dyn ToSql + Sync))
        .collect();
    params.push(&limit);
    rows(c, &sql, &params).await
}

pub(super) fn bad_row(what: String) -> Fail {
    Fail::Store(copy::unreadable(what))
}

/// One page of the export (the caller's transaction is one snapshot).
pub(super) async fn export_page<C: GenericClient>(
    c: &C,
    cursor: &copy::Cursor,
    limit: u32,
) -> Result<copy::ExportPage, Fail> {
    use copy::{Record, Section};
    let records: Vec<Record> = match cursor.section {
        Section::Jobs => {
            let found = page_rows(
                c,
                "SELECT id, queue, state, payload, priority, run_at, seq, attempt, budget_used, \
                 max_attempts, dedup_key, enqueued_at, finished_at, result, last_error, lease_token \
                 FROM jobs",
                &["id"],
                cursor,
                limit,
            )
            .await?;
            let mut jobs = Vec::with_capacity(found.len());
            for r in &found {
                let state: String = r.try_get(2)?;
                let id: String = r.try_get(0)?;
                jobs.push(copy::JobRecord {
                    state: state
                        .parse()
                        .map_err(|e| bad_row(format!("job {id:?}: {e}")))?,
                    id,
                    queue: r.try_get(1)?,
                    payload: r.try_get(3)?,
                    priority: r.try_get(4)?,
                    run_at: Millis(r.try_get(5)?),
                    seq: u64_of(r.try_get(6)?),
                    attempt: u32_of(r.try_get(7)?),
                    budget_used: u32_of(r.try_get(8)?),
                    max_attempts: u32_of(r.try_get(9)?),
                    dedup_key: r.try_get(10)?,
                    enqueued_at: Millis(r.try_get(11)?),
                    finished_at: r.try_get::<_, Option<i64>>(12)?.map(Millis),
                    result: r.try_get(13)?,
                    last_error: r.try_get(14)?,
                    lease_token: r.try_get::<_, Option<i64>>(15)?.map(u64_of),
                    attempts: Vec::new(),
                    effects: Vec::new(),
                });
            }
            let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
            let mut by_id: std::collections::HashMap<String, usize> = ids
                .iter()
                .enumerate()
                .map(|(i, id)| (id.clone(), i))
                .collect();
            for r in rows(
                c,
                "SELECT job_id, number, token, started_at, ended_at, outcome, error, plugin_version \
                 FROM attempts WHERE job_id = ANY($1::text[]) ORDER BY job_id, number",
                &[&ids],
            )
            .await?
            {
                let job_id: String = r.try_get(0)?;
                let number = u32_of(r.try_get(1)?);
                let outcome: String = r.try_get(5)?;
                let outcome = AttemptOutcome::parse(&outcome).ok_or_else(|| {
                    bad_row(format!(
                        "attempt {number} of job {job_id:?}: unknown outcome {outcome:?}"
                    ))
                })?;
                if let Some(&i) = by_id.get(&job_id) {
                    jobs[i].attempts.push(copy::AttemptRecord {
                        number,
                        token: u64_of(r.try_get(2)?),
                        started_at: Millis(r.try_get(3)?),
                        ended_at: r.try_get::<_, Option<i64>>(4)?.map(Millis),
                        outcome,
                        error: r.try_get(6)?,
                        plugin_version: r.try_get(7)?,
                    });
                }
            }
            for r in rows(
                c,
                "SELECT job_id, attempt, kind, key, outcome, at FROM effects \
                 WHERE job_id = ANY($1::text[]) ORDER BY job_id, attempt, n",
                &[&ids],
            )
            .await?
            {
                let job_id: String = r.try_get(0)?;
                if let Some(&i) = by_id.get(&job_id) {
                    jobs[i].effects.push(EffectRecord {
                        attempt: u32_of(r.try_get(1)?),
                        kind: r.try_get(2)?,
                        key: r.try_get(3)?,
                        outcome: r.try_get(4)?,
                        at: Millis(r.try_get(5)?),
                    });
                }
            }
            by_id.clear();
            jobs.into_iter().map(Record::Job).collect()
        }
        Section::Dedup => {
            let found = page_rows(
                c,
                "SELECT queue, key, job_id, hold_until FROM dedup",
                &["queue", "key"],
                cursor,
                limit,
            )
            .await?;
            let out = found
                .iter()
                .map(|r| {
                    Ok(copy::DedupRecord {
                        queue: r.try_get(0)?,
                        key: r.try_get(1)?,
                        job_id: r.try_get(2)?,
                        hold_until: r.try_get::<_, Option<i64>>(3)?.map(Millis),
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
            out.into_iter().map(Record::Dedup).collect()
        }
        Section::Fences => {
            let found = page_rows(
                c,
                &format!("SELECT {FENCE_COLUMNS} FROM fences"),
                &["namespace", "kind", "key"],
                cursor,
                limit,
            )
            .await?;
            let mut out = Vec::with_capacity(found.len());
            for r in &found {
                let state: String = r.try_get(3)?;
                out.push(copy::FenceRecord::exported(fence_from_row(r)?, &state)?);
            }
            out.into_iter().map(Record::Fence).collect()
        }
        Section::Kv => {
            let found = page_rows(
                c,
                "SELECT namespace, key, value, written_at FROM kv",
                &["namespace", "key"],
                cursor,
                limit,
            )
            .await?;
            let out = found
                .iter()
                .map(|r| {
                    Ok(copy::KvRecord {
                        namespace: r.try_get(0)?,
                        key: r.try_get(1)?,
                        value: r.try_get(2)?,
                        written_at: Millis(r.try_get(3)?),
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
            out.into_iter().map(Record::Kv).collect()
        }
        Section::Index => {
            let found = page_rows(
                c,
                "SELECT collection, id, version, document, updated_at FROM index_docs",
                &["collection", "id"],
                cursor,
                limit,
            )
            .await?;
            let out = found
                .iter()
                .map(|r| {
                    Ok(copy::IndexRecord {
                        collection: r.try_get(0)?,
                        id: r.try_get(1)?,
                        version: u64_of(r.try_get(2)?),
                        document: r.try_get(3)?,
                        updated_at: Millis(r.try_get(4)?),
                    })
                })
                .collect::<Result<Vec<_>, Fail>>()?;
            out.into_iter().map(Record::Index).collect()
        }
        Section::Counters => {
            // The sequences' last values (NULL before their first use), and
            // the stored maximum in case a sequence was set back by hand.
            let r = rows(
                c,
                "SELECT COALESCE(pg_sequence_last_value('fencing_tokens'), 0), \
                 GREATEST(COALESCE(pg_sequence_last_value(pg_get_serial_sequence('jobs', 'seq')::regclass), 0), \
                          (SELECT COALESCE(MAX(seq), 0) FROM jobs))",
                &[],
            )
            .await?;
            let r = r
                .first()
                .ok_or_else(|| bad_row("the counters: no row".into()))?;
            let counters = copy::Counters {
                fencing_token: u64_of(r.try_get(0)?),
                enqueue_seq: u64_of(r.try_get(1)?),
            };
            return Ok(copy::ExportPage {
                records: vec![Record::Counters(counters)],
                next: None,
            });
        }
    };
    Ok(copy::ExportPage::of(cursor, limit, records))
}

/// Writes one page of imported records in the caller's transaction, then
/// moves the sequences past them. `setval` is not undone by a rollback; a
/// sequence moved forward by a failed import only skips numbers.
pub(super) async fn import_page<C: GenericClient>(
    c: &C,
    records: &[copy::Record],
) -> Result<(), Fail> {
    use copy::Record;
    for record in records {
        let inserted = match record {
            Record::Job(j) => {
                let state = j.stored_state();
                let n = exec(
                    c,
                    "INSERT INTO jobs (id, queue, state, payload, priority, run_at, seq, attempt, \
                     budget_used, max_attempts, dedup_key, enqueued_at, finished_at, result, \
                     last_error, lease_token) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
                     ON CONFLICT DO NOTHING",
                    &[
                        &j.id,
                        &j.queue,
                        &state.as_str(),
                        &j.payload,
                        &j.priority,
                        &j.run_at.0,
                        &i64_of(j.seq),
                        &i32_of(j.attempt),
                        &i32_of(j.budget_used),
                        &i32_of(j.max_attempts),
                        &j.dedup_key,
                        &j.enqueued_at.0,
                        &j.finished_at.map(|m| m.0),
                        &j.result,
                        &j.last_error,
                        &j.lease_token.map(i64_of),
                    ],
                )
                .await?;
                if n == 1 {
                    for a in &j.attempts {
                        exec(
                            c,
                            "INSERT INTO attempts \
                             (job_id, number, token, started_at, ended_at, outcome, error, plugin_version) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                            &[
                                &j.id,
                                &i32_of(a.number),
                                &i64_of(a.token),
                                &a.started_at.0,
                                &a.ended_at.map(|m| m.0),
                                &a.outcome.as_str(),
                                &a.error,
                                &a.plugin_version,
                            ],
                        )
                        .await?;
                    }
                    // `n` comes from its identity column, in insertion order.
                    for e in &j.effects {
                        exec(
                            c,
                            "INSERT INTO effects (job_id, attempt, kind, key, outcome, at) \
                             VALUES ($1, $2, $3, $4, $5, $6)",
                            &[
                                &j.id,
                                &i32_of(e.attempt),
                                &e.kind,
                                &e.key,
                                &e.outcome,
                                &e.at.0,
                            ],
                        )
                        .await?;
                    }
                }
                n
            }
            Record::Dedup(d) => {
                exec(
                    c,
                    "INSERT INTO dedup (queue, key, job_id, hold_until) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT DO NOTHING",
                    &[&d.queue, &d.key, &d.job_id, &d.hold_until.map(|m| m.0)],
                )
                .await?
            }
            Record::Fence(f) => exec(
                c,
                "INSERT INTO fences (namespace, kind, key, state, fingerprint, job_id, attempt, \
                     token, result, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
                &[
                    &f.namespace,
                    &f.kind,
                    &f.key,
                    &f.state.as_str(),
                    &f.fingerprint,
                    &f.job_id,
                    &i32_of(f.attempt),
                    &i64_of(f.token),
                    &f.result,
                    &f.created_at.0,
                    &f.updated_at.0,
                ],
            )
            .await?,
            Record::Kv(k) => {
                exec(
                    c,
                    "INSERT INTO kv (namespace, key, value, written_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT DO NOTHING",
                    &[&k.namespace, &k.key, &k.value, &k.written_at.0],
                )
                .await?
            }
            Record::Index(i) => {
                exec(
                    c,
                    "INSERT INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                    &[
                        &i.collection,
                        &i.id,
                        &i64_of(i.version),
                        &i.document,
                        &i.updated_at.0,
                    ],
                )
                .await?
            }
            Record::Counters(_) => 1,
        };
        if inserted != 1 {
            return Err(Fail::Store(copy::already_there(record)));
        }
    }
    let counters = copy::Counters::of(records);
    if counters.fencing_token > 0 {
        exec(
            c,
            "SELECT setval('fencing_tokens', \
             GREATEST(COALESCE(pg_sequence_last_value('fencing_tokens'), 0), $1))",
            &[&i64_of(counters.fencing_token)],
        )
        .await?;
    }
    if counters.enqueue_seq > 0 {
        exec(
            c,
            "SELECT setval(pg_get_serial_sequence('jobs', 'seq'), \
             GREATEST(COALESCE(pg_sequence_last_value(pg_get_serial_sequence('jobs', 'seq')::regclass), 0), $1))",
            &[&i64_of(counters.enqueue_seq)],
        )
        .await?;
    }
    Ok(())
}
