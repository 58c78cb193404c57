//! Moving a ledger (`store::copy`): export pages read from one snapshot,
//! and imports written in one transaction of the writer.

use super::*;

/// The first key of `tree` after the cursor's: the export goes on past the
/// key its cursor names (`parts` strings, the job id raw in `jobs`).
pub(super) fn page_start(
    tree: usize,
    cursor: &copy::Cursor,
    parts: usize,
) -> Result<std::ops::Bound<Vec<u8>>, StoreError> {
    use std::ops::Bound;
    if cursor.after.is_empty() {
        return Ok(Bound::Unbounded);
    }
    if cursor.after.len() != parts {
        return Err(unavailable(format!(
            "export cursor of section {:?} has {} key parts, wanted {parts}",
            cursor.section,
            cursor.after.len()
        )));
    }
    let key = if tree == JOBS {
        cursor.key(0)?.as_bytes().to_vec()
    } else {
        let after: Vec<&str> = cursor.after.iter().map(String::as_str).collect();
        strs(&after)
    };
    Ok(Bound::Excluded(key))
}

/// Up to `limit` entries of `tree` after the cursor, in key order, each
/// made a record by `make`, with the key parts of the last one.
pub(super) fn page_of(
    t: &Trees,
    tree: usize,
    cursor: &copy::Cursor,
    limit: u32,
    parts: usize,
    make: impl Fn(&[&str], &[u8]) -> Result<copy::Record, StoreError>,
) -> Result<(Vec<copy::Record>, Vec<String>), StoreError> {
    let start = page_start(tree, cursor, parts)?;
    let mut records = Vec::new();
    let mut last = Vec::new();
    for entry in t.t[tree]
        .range::<Vec<u8>, _>((start, std::ops::Bound::Unbounded))
        .take(limit as usize)
    {
        let (k, v) = entry.map_err(sled_err)?;
        let key: Vec<&str> = if tree == JOBS {
            vec![std::str::from_utf8(&k).map_err(|_| corrupt(tree, &k))?]
        } else {
            let mut rest: &[u8] = &k;
            let mut key = Vec::with_capacity(parts);
            for _ in 0..parts {
                let (part, tail) = split_str(rest).ok_or_else(|| corrupt(tree, &k))?;
                key.push(part);
                rest = tail;
            }
            key
        };
        records.push(make(&key, &v)?);
        last = key.iter().map(|p| (*p).to_owned()).collect();
    }
    Ok((records, last))
}

/// One page of the export. sled has no snapshot: the pages agree with one
/// another because nothing writes while the copy holds the ledger's lock.
pub(super) fn export_page(
    t: &Trees,
    cursor: &copy::Cursor,
    limit: u32,
) -> Result<copy::ExportPage, StoreError> {
    use copy::{Record, Section};
    let (records, last) = match cursor.section {
        Section::Jobs => page_of(t, JOBS, cursor, limit, 1, |key, v| {
            let id = key[0];
            let j: JobRec = decode(JOBS, id.as_bytes(), v)?;
            let attempts = t.attempts(id)?;
            let effects = t.effects(id)?;
            Ok(Record::Job(copy::JobRecord {
                id: j.id,
                queue: j.queue,
                state: j.state,
                payload: j.payload,
                priority: j.priority,
                run_at: j.run_at,
                seq: j.seq,
                attempt: j.attempt,
                budget_used: j.budget_used,
                max_attempts: j.max_attempts,
                dedup_key: j.dedup_key,
                enqueued_at: j.enqueued_at,
                finished_at: j.finished_at,
                result: j.result,
                last_error: j.last_error,
                lease_token: j.lease_token,
                attempts,
                effects,
            }))
        })?,
        Section::Dedup => page_of(t, DEDUP, cursor, limit, 2, |key, v| {
            let d: DedupRec = decode(DEDUP, &strs(key), v)?;
            Ok(Record::Dedup(copy::DedupRecord {
                queue: key[0].to_owned(),
                key: key[1].to_owned(),
                job_id: d.job_id,
                hold_until: d.hold_until,
            }))
        })?,
        Section::Fences => page_of(t, FENCES, cursor, limit, 3, |key, v| {
            decode(FENCES, &strs(key), v).map(Record::Fence)
        })?,
        Section::Kv => page_of(t, KV, cursor, limit, 2, |key, v| {
            let (written_at, value) = split_kv_value(v)?;
            Ok(Record::Kv(copy::KvRecord {
                namespace: key[0].to_owned(),
                key: key[1].to_owned(),
                value: value.to_vec(),
                written_at,
            }))
        })?,
        Section::Index => page_of(t, INDEX, cursor, limit, 2, |key, v| {
            let d: DocRec = decode(INDEX, &strs(key), v)?;
            Ok(Record::Index(copy::IndexRecord {
                collection: key[0].to_owned(),
                id: key[1].to_owned(),
                version: d.version,
                document: d.document,
                updated_at: d.updated_at,
            }))
        })?,
        Section::Counters => {
            let counters = copy::Counters {
                fencing_token: t.meta("token")?.unwrap_or(0),
                enqueue_seq: t.highest_seq()?,
            };
            return Ok(copy::ExportPage {
                records: vec![Record::Counters(counters)],
                next: None,
            });
        }
    };
    let next = copy::Cursor::after_page(cursor.section, records.len(), limit, last);
    Ok(copy::ExportPage { records, next })
}

/// Writes one page of imported records as one step (all or none) and moves
/// the writer's counters past them; the step carries the new highest token
/// and seq to `meta` with the records.
pub(super) fn import_step(tx: &mut Tx, records: &[copy::Record]) -> Result<(), StoreError> {
    use copy::Record;
    for record in records {
        let taken = match record {
            Record::Job(j) => {
                let taken = tx.job(&j.id)?.is_some();
                if !taken {
                    let rec = JobRec {
                        id: j.id.clone(),
                        queue: j.queue.clone(),
                        state: j.stored_state(),
                        payload: j.payload.clone(),
                        priority: j.priority,
                        run_at: j.run_at,
                        seq: j.seq,
                        attempt: j.attempt,
                        budget_used: j.budget_used,
                        max_attempts: j.max_attempts,
                        dedup_key: j.dedup_key.clone(),
                        enqueued_at: j.enqueued_at,
                        finished_at: j.finished_at,
                        result: j.result.clone(),
                        last_error: j.last_error.clone(),
                        lease_token: j.lease_token,
                    };
                    tx.put_job(None, Some(&rec))?;
                    for a in &j.attempts {
                        tx.insert(ATTEMPTS, attempt_key(&j.id, a.number), encode(a));
                    }
                    for (n, e) in j.numbered_effects() {
                        let mut key = effect_prefix(&j.id, e.attempt);
                        key.extend_from_slice(&n.to_be_bytes());
                        let rec = EffectRec {
                            kind: e.kind.clone(),
                            key: e.key.clone(),
                            outcome: e.outcome.clone(),
                            at: e.at,
                        };
                        tx.insert(EFFECTS, key, encode(&rec));
                    }
                }
                taken
            }
            Record::Dedup(d) => {
                let key = strs(&[&d.queue, &d.key]);
                let taken = tx.get(DEDUP, &key)?.is_some();
                if !taken {
                    let rec = DedupRec {
                        job_id: d.job_id.clone(),
                        hold_until: d.hold_until,
                    };
                    tx.insert(DEDUP, key, encode(&rec));
                }
                taken
            }
            Record::Fence(f) => {
                let id = FenceId {
                    namespace: f.namespace.clone(),
                    kind: f.kind.clone(),
                    key: f.key.clone(),
                };
                let taken = tx.fence(&id)?.is_some();
                if !taken {
                    tx.put_fence(None, Some(f));
                }
                taken
            }
            Record::Kv(k) => {
                let taken = tx.get(KV, &strs(&[&k.namespace, &k.key]))?.is_some();
                if !taken {
                    tx.put_kv(&k.namespace, &k.key, None, Some((k.written_at, &k.value)));
                }
                taken
            }
            Record::Index(i) => {
                let key = strs(&[&i.collection, &i.id]);
                let taken = tx.get(INDEX, &key)?.is_some();
                if !taken {
                    let rec = DocRec {
                        version: i.version,
                        document: i.document.clone(),
                        updated_at: i.updated_at,
                    };
                    tx.put_doc(key, None, Some(&rec));
                }
                taken
            }
            Record::Counters(_) => false,
        };
        if taken {
            return Err(copy::already_there(record));
        }
    }
    let c = copy::Counters::of(records);
    tx.next_token = tx.next_token.max(c.fencing_token.saturating_add(1));
    tx.next_seq = tx.next_seq.max(c.enqueue_seq.saturating_add(1));
    Ok(())
}
