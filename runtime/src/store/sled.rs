//! The sled ledger (`[store] backend = "sled"`): sled 0.34 in
//! `data_dir/ledger.sled`, one writer with group commit, flushed and then
//! fdatasynced by that writer alone.
//!
//! # Trees and keys
//!
//! Keys are built from parts: a string is its length (u32, big-endian) then
//! its bytes, so no string can run into the next part; a number is
//! big-endian, an `i64` with its sign bit flipped so that byte order is
//! numeric order; a priority is stored inverted so that higher comes first.
//! Records are JSON (serde), so that a new field with a default reads old
//! records unchanged.
//!
//! | tree | key | value |
//! | --- | --- | --- |
//! | `meta` | `layout`, `token`, `seq` | u64: layout version, highest fencing token issued, highest enqueue seq |
//! | `jobs` | job id (raw bytes) | [`JobRec`] |
//! | `attempts` | str job id, u32 number | [`AttemptRec`] |
//! | `ready` | str queue, inverted i32 priority, i64 run_at, u64 seq | job id — waiting jobs in delivery order |
//! | `due` | str queue, i64 run_at, u64 seq | job id — waiting jobs by run_at (next due, delayed count) |
//! | `by_seq` | u64 seq | job id — every job, for pages newest first |
//! | `by_state` | str queue, str stored state, u64 seq | job id — pages of one queue and state |
//! | `active` | job id | empty — the jobs crash recovery visits |
//! | `finished` | i64 finished_at, job id | job id — completed and cancelled jobs, for retention |
//! | `dead` | i64 finished_at, job id | job id — dead jobs, for retention |
//! | `dedup` | str queue, str key | [`DedupRec`] |
//! | `counts` | str queue, str stored state | u64 jobs |
//! | `kv` | str namespace, str key | i64 written_at, then the value |
//! | `kv_by_time` | str namespace, i64 written_at, str key | kv key — for retention |
//! | `index` | str collection, str id | [`DocRec`] (document `None`: a tombstone) |
//! | `tombstones` | i64 updated_at, index key | index key — for retention |
//! | `fences` | str namespace, str kind, str key | [`FenceRec`] |
//! | `fences_by_time` | i64 updated_at, fence key | fence key |
//! | `effects` | str job id, u32 attempt, u32 n | [`EffectRec`] |
//!
//! The stored state is never `delayed`: a waiting job whose run_at is in the
//! future is reported as delayed, as on SQLite. Every secondary tree is kept
//! by [`Tx::put_job`] in the same transaction as the job record, so counting
//! never scans jobs and `delayed` costs what is delayed (a range of `due`).
//!
//! # Writes
//!
//! The store's one writer ([`super::writer`]) owns every write, so no two
//! sled transactions ever run at once and none conflicts (sled's optimistic
//! transactions abort by the hundred when many tasks lease the head of one
//! tree). Each step reads the trees, collects its writes in a [`Tx`] (which
//! also answers the step's reads of its own writes) and applies them in one
//! sled transaction over the trees it touched, or not at all when it fails.
//! A group needs no opening; when it holds a **durable** step, its commit
//! calls `flush()` and fdatasyncs sled's files.
//!
//! # Durability
//!
//! sled's `flush()` on Linux writes its log with `pwrite` and
//! `sync_file_range`, never `fdatasync`: it survives a process kill, not a
//! power loss. So after each flush the writer calls `File::sync_data` on
//! sled's data file `db` (every tree is one log in that file) and on each
//! new file under `blobs/` (values too large for a log segment, written by
//! sled without a sync), and fsyncs `blobs/` when it gained entries. Sled's
//! own periodic flusher is off (`flush_every_ms(None)`): concurrent flushes
//! deadlock in sled 0.34, so the writer is the only flusher.
//!
//! - Survives a process kill (`kill -9`): every step that was applied, durable
//!   or not, once sled has written it to the kernel (sled writes its log
//!   buffer when the flush runs or the buffer fills); always every step that
//!   was answered durable.
//! - Survives a power loss: every step answered durable, and every step
//!   applied before it. Applied steps after the last durable answer may be
//!   lost; nothing outside the daemon has learnt of them.
//! - A failed flush or sync leaves the store refusing every later step
//!   (`Unavailable`): what reached the disk is unknown, and the daemon must be
//!   restarted so that recovery starts from what the disk holds.
//!
//! Reads go straight to the trees and see applied steps, not only durable
//! ones (sled has no committed snapshot to read from); the daemon answers
//! nothing from them that a durable step has not already carried.
//!
//! A lock file in the data directory keeps a second daemon off the ledger:
//! crash recovery assumes every `active` job belongs to a dead process.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sled::Transactional;

use super::rules::{self, invalid_fence, visible_state};
use super::writer::{Engine, GroupWriter};
use super::{
    EffectRecord, Fence, FenceBegin, FenceId, FenceState, JobFilter, JobPage, PageBuilder,
    RESOLVED_BY_OPERATOR, Resolution, RetentionRules, Store, StoreError, Swept, UpsertOutcome,
};
use crate::job::{
    Attempt, AttemptOutcome, Enqueued, Finish, Job, JobState, Lease, LeaseRef, Millis, NewJob,
    StateCounts,
};

/// The key layout this build writes (the trees above).
///
/// Version 2 added `dead`, `kv_by_time` and `tombstones` and the written
/// time before each kv value; [`migrate_layout`] brings a version 1 ledger
/// there in one transaction when it opens.
pub const LAYOUT_VERSION: u64 = 2;

/// The sled database's directory inside `data_dir`.
pub const DIR_NAME: &str = "ledger.sled";

const META: usize = 0;
const JOBS: usize = 1;
const ATTEMPTS: usize = 2;
const READY: usize = 3;
const DUE: usize = 4;
const BY_SEQ: usize = 5;
const BY_STATE: usize = 6;
const ACTIVE: usize = 7;
const FINISHED: usize = 8;
const DEDUP: usize = 9;
const COUNTS: usize = 10;
const KV: usize = 11;
const INDEX: usize = 12;
const FENCES: usize = 13;
const FENCES_BY_TIME: usize = 14;
const EFFECTS: usize = 15;
const DEAD: usize = 16;
const KV_BY_TIME: usize = 17;
const TOMBSTONES: usize = 18;

const TREE_NAMES: [&str; 19] = [
    "meta",
    "jobs",
    "attempts",
    "ready",
    "due",
    "by_seq",
    "by_state",
    "active",
    "finished",
    "dedup",
    "counts",
    "kv",
    "index",
    "fences",
    "fences_by_time",
    "effects",
    "dead",
    "kv_by_time",
    "tombstones",
];

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn sled_err(e: sled::Error) -> StoreError {
    unavailable(format!("sled: {e}"))
}

// ---- keys ----

fn put_str(k: &mut Vec<u8>, s: &str) {
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    k.extend_from_slice(&len.to_be_bytes());
    k.extend_from_slice(s.as_bytes());
}

fn put_i64(k: &mut Vec<u8>, v: i64) {
    k.extend_from_slice(&((v as u64) ^ (1 << 63)).to_be_bytes());
}

fn get_i64(b: &[u8]) -> Option<i64> {
    let a: [u8; 8] = b.get(..8)?.try_into().ok()?;
    Some((u64::from_be_bytes(a) ^ (1 << 63)) as i64)
}

fn strs(parts: &[&str]) -> Vec<u8> {
    let mut k = Vec::new();
    for p in parts {
        put_str(&mut k, p);
    }
    k
}

fn ready_key(queue: &str, priority: i32, run_at: Millis, seq: u64) -> Vec<u8> {
    let mut k = strs(&[queue]);
    // Higher priority first: the order-preserving u32 of the i32, inverted.
    k.extend_from_slice(&(!((priority as u32) ^ 0x8000_0000)).to_be_bytes());
    put_i64(&mut k, run_at.0);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

fn due_key(queue: &str, run_at: Millis, seq: u64) -> Vec<u8> {
    let mut k = strs(&[queue]);
    put_i64(&mut k, run_at.0);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

fn by_state_key(queue: &str, state: JobState, seq: u64) -> Vec<u8> {
    let mut k = strs(&[queue, state.as_str()]);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

fn finished_key(at: Millis, id: &str) -> Vec<u8> {
    let mut k = Vec::new();
    put_i64(&mut k, at.0);
    k.extend_from_slice(id.as_bytes());
    k
}

fn kv_time_key(ns: &str, written_at: Millis, key: &str) -> Vec<u8> {
    let mut k = strs(&[ns]);
    put_i64(&mut k, written_at.0);
    put_str(&mut k, key);
    k
}

/// A kv value as stored: its write time, then its bytes.
fn kv_value(written_at: Millis, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + value.len());
    put_i64(&mut v, written_at.0);
    v.extend_from_slice(value);
    v
}

/// The write time and bytes of a stored kv value.
fn split_kv_value(stored: &[u8]) -> Result<(Millis, &[u8]), StoreError> {
    match (get_i64(stored), stored.get(8..)) {
        (Some(at), Some(value)) => Ok((Millis(at), value)),
        _ => Err(unavailable(
            "sled: a kv value shorter than its written time: the ledger is damaged",
        )),
    }
}

fn attempt_key(job_id: &str, number: u32) -> Vec<u8> {
    let mut k = strs(&[job_id]);
    k.extend_from_slice(&number.to_be_bytes());
    k
}

fn fence_key(id: &FenceId) -> Vec<u8> {
    strs(&[&id.namespace, &id.kind, &id.key])
}

/// A time-ordered entry of `fences_by_time` or `tombstones`: the time, then
/// the key of the record it points at.
fn fence_time_key(updated_at: Millis, fence_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::new();
    put_i64(&mut k, updated_at.0);
    k.extend_from_slice(fence_key);
    k
}

fn effect_prefix(job_id: &str, attempt: u32) -> Vec<u8> {
    attempt_key(job_id, attempt)
}

// ---- records ----

/// A job as stored. `state` is never `delayed`.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct JobRec {
    id: String,
    queue: String,
    state: JobState,
    payload: String,
    priority: i32,
    run_at: Millis,
    seq: u64,
    attempt: u32,
    budget_used: u32,
    max_attempts: u32,
    dedup_key: Option<String>,
    enqueued_at: Millis,
    finished_at: Option<Millis>,
    result: Option<String>,
    last_error: Option<String>,
    lease_token: Option<u64>,
}

impl JobRec {
    fn to_job(&self, now: Millis) -> Job {
        Job {
            id: self.id.clone(),
            queue: self.queue.clone(),
            state: visible_state(self.state, self.run_at, now),
            payload: self.payload.clone(),
            priority: self.priority,
            attempt: self.attempt,
            budget_used: self.budget_used,
            max_attempts: self.max_attempts,
            dedup_key: self.dedup_key.clone(),
            run_at: self.run_at,
            enqueued_at: self.enqueued_at,
            finished_at: self.finished_at,
            result: self.result.clone(),
            last_error: self.last_error.clone(),
            attempts: Vec::new(),
        }
    }

    /// The secondary entries this record owns: (tree, key, value).
    fn derived(&self) -> Vec<(usize, Vec<u8>, Vec<u8>)> {
        let id = self.id.as_bytes().to_vec();
        let mut out = vec![
            (BY_SEQ, self.seq.to_be_bytes().to_vec(), id.clone()),
            (
                BY_STATE,
                by_state_key(&self.queue, self.state, self.seq),
                id.clone(),
            ),
        ];
        match self.state {
            JobState::Waiting | JobState::Delayed => {
                out.push((
                    READY,
                    ready_key(&self.queue, self.priority, self.run_at, self.seq),
                    id.clone(),
                ));
                out.push((DUE, due_key(&self.queue, self.run_at, self.seq), id));
            }
            JobState::Active => out.push((ACTIVE, id, Vec::new())),
            JobState::Completed | JobState::Cancelled => {
                if let Some(at) = self.finished_at {
                    out.push((FINISHED, finished_key(at, &self.id), id));
                }
            }
            JobState::Dead => {
                if let Some(at) = self.finished_at {
                    out.push((DEAD, finished_key(at, &self.id), id));
                }
            }
        }
        out
    }
}

// An attempt is stored as the record a copy moves.
use super::copy::AttemptRecord as AttemptRec;

impl AttemptRec {
    fn to_attempt(&self) -> Attempt {
        Attempt {
            number: self.number,
            fencing_token: self.token,
            started_at: self.started_at,
            ended_at: self.ended_at,
            outcome: self.outcome,
            error: self.error.clone(),
            plugin_version: self.plugin_version.clone(),
        }
    }
}

/// A dedup key points at the job that holds it; `hold_until` keeps it held
/// after that job ends (`dedup_for`).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DedupRec {
    job_id: String,
    hold_until: Option<Millis>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct DocRec {
    version: u64,
    document: Option<String>,
    updated_at: Millis,
}

// A fence is stored as the record a copy moves.
use super::copy::FenceRecord as FenceRec;

impl FenceRec {
    fn to_fence(&self) -> Fence {
        rules::FenceRow::into_fence(self.clone())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct EffectRec {
    kind: String,
    key: String,
    outcome: String,
    at: Millis,
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing these plain records cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(tree: usize, key: &[u8], bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| {
        unavailable(format!(
            "corrupt record in sled tree {} at key {}: {e}",
            TREE_NAMES[tree],
            hex::encode(key)
        ))
    })
}

// ---- the trees ----

struct Trees {
    db: sled::Db,
    t: Vec<sled::Tree>,
}

impl Trees {
    fn get(&self, tree: usize, key: &[u8]) -> Result<Option<sled::IVec>, StoreError> {
        self.t[tree].get(key).map_err(sled_err)
    }

    fn get_rec<T: DeserializeOwned>(
        &self,
        tree: usize,
        key: &[u8],
    ) -> Result<Option<T>, StoreError> {
        match self.get(tree, key)? {
            Some(v) => decode(tree, key, &v).map(Some),
            None => Ok(None),
        }
    }

    fn job(&self, id: &str) -> Result<Option<JobRec>, StoreError> {
        self.get_rec(JOBS, id.as_bytes())
    }

    fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRec>, StoreError> {
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
    fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError> {
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
    fn highest_seq(&self) -> Result<u64, StoreError> {
        let stored = self.t[BY_SEQ]
            .last()
            .map_err(sled_err)?
            .and_then(|(k, _)| <[u8; 8]>::try_from(k.as_ref()).ok())
            .map_or(0, u64::from_be_bytes);
        Ok(self.meta("seq")?.unwrap_or(0).max(stored))
    }

    fn meta(&self, key: &str) -> Result<Option<u64>, StoreError> {
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
struct Tx {
    trees: Arc<Trees>,
    writes: BTreeMap<(usize, Vec<u8>), Option<Vec<u8>>>,
    next_token: u64,
    next_seq: u64,
}

impl Tx {
    fn get(&self, tree: usize, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(w) = self.writes.get(&(tree, key.to_vec())) {
            return Ok(w.clone());
        }
        Ok(self.trees.get(tree, key)?.map(|v| v.to_vec()))
    }

    fn get_rec<T: DeserializeOwned>(
        &self,
        tree: usize,
        key: &[u8],
    ) -> Result<Option<T>, StoreError> {
        match self.get(tree, key)? {
            Some(v) => decode(tree, key, &v).map(Some),
            None => Ok(None),
        }
    }

    fn insert(&mut self, tree: usize, key: Vec<u8>, value: Vec<u8>) {
        self.writes.insert((tree, key), Some(value));
    }

    fn remove(&mut self, tree: usize, key: Vec<u8>) {
        self.writes.insert((tree, key), None);
    }

    fn job(&self, id: &str) -> Result<Option<JobRec>, StoreError> {
        self.get_rec(JOBS, id.as_bytes())
    }

    fn require_job(&self, id: &str) -> Result<JobRec, StoreError> {
        self.job(id)?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))
    }

    fn count(&mut self, queue: &str, state: JobState, delta: i64) -> Result<(), StoreError> {
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
    fn put_job(&mut self, old: Option<&JobRec>, new: Option<&JobRec>) -> Result<(), StoreError> {
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

    fn fence(&self, id: &FenceId) -> Result<Option<FenceRec>, StoreError> {
        self.get_rec(FENCES, &fence_key(id))
    }

    fn put_fence(&mut self, old: Option<&FenceRec>, new: Option<&FenceRec>) {
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
    fn kv(&self, ns: &str, key: &str) -> Result<Option<(Millis, Vec<u8>)>, StoreError> {
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
    fn put_kv(&mut self, ns: &str, key: &str, old: Option<Millis>, new: Option<(Millis, &[u8])>) {
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
    fn put_doc(&mut self, key: Vec<u8>, old: Option<&DocRec>, new: Option<&DocRec>) {
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
    fn commit(self) -> Result<(), StoreError> {
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

// ---- the writer ----

struct Writer {
    trees: Arc<Trees>,
    next_token: u64,
    next_seq: u64,
    /// sled's data file, kept open for `sync_data` after each flush.
    data_file: File,
    blobs_dir: PathBuf,
    /// Blob files already synced.
    synced_blobs: HashSet<OsString>,
}

impl Engine for Writer {
    fn begin(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Each step applied its own transaction; a group with a durable step
    /// is made durable by [`Writer::persist`], one without is left to the
    /// next.
    fn commit(&mut self, durable: bool) -> Result<bool, StoreError> {
        if durable {
            self.persist()?;
        }
        Ok(durable)
    }
}

impl Writer {
    /// Runs one step and applies its writes in one transaction, or none of
    /// them when it fails.
    fn run<T>(
        &mut self,
        f: impl FnOnce(&mut Tx) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut tx = Tx {
            trees: Arc::clone(&self.trees),
            writes: BTreeMap::new(),
            next_token: self.next_token,
            next_seq: self.next_seq,
        };
        let value = f(&mut tx)?;
        // The highest token and seq issued travel with the step that issued
        // them, so that both only grow across restarts.
        if tx.next_token != self.next_token {
            tx.insert(
                META,
                b"token".to_vec(),
                (tx.next_token - 1).to_be_bytes().to_vec(),
            );
        }
        if tx.next_seq != self.next_seq {
            tx.insert(
                META,
                b"seq".to_vec(),
                (tx.next_seq - 1).to_be_bytes().to_vec(),
            );
        }
        let (token, seq) = (tx.next_token, tx.next_seq);
        tx.commit()?;
        (self.next_token, self.next_seq) = (token, seq);
        Ok(value)
    }

    /// Makes every applied step durable: flush, then fdatasync of the blobs
    /// and of the data file. Durable against power loss when it returns Ok.
    fn persist(&mut self) -> Result<(), StoreError> {
        self.trees
            .db
            .flush()
            .map_err(sled_err)
            .and_then(|_| self.sync_blobs())
            .and_then(|()| {
                self.data_file
                    .sync_data()
                    .map_err(|e| unavailable(format!("fdatasync of sled's data file: {e}")))
            })
    }

    fn sync_blobs(&mut self) -> Result<(), StoreError> {
        let entries = match std::fs::read_dir(&self.blobs_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(unavailable(format!(
                    "reading {}: {e}",
                    self.blobs_dir.display()
                )));
            }
        };
        let mut present = HashSet::new();
        let mut added = false;
        for entry in entries {
            let entry = entry.map_err(unavailable)?;
            let name = entry.file_name();
            if !self.synced_blobs.contains(&name) {
                let path = entry.path();
                match File::open(&path) {
                    Ok(f) => f.sync_data().map_err(|e| {
                        unavailable(format!("fdatasync of {}: {e}", path.display()))
                    })?,
                    // Collected by sled meanwhile.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(unavailable(format!("{}: {e}", path.display()))),
                }
                added = true;
            }
            present.insert(name);
        }
        if added {
            sync_dir(&self.blobs_dir)?;
        }
        self.synced_blobs = present;
        Ok(())
    }
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| unavailable(format!("fsync of {}: {e}", dir.display())))
}

/// A sled ledger in `data_dir/ledger.sled`.
pub struct SledStore {
    writer: GroupWriter<Writer>,
    trees: Arc<Trees>,
    path: PathBuf,
    _lock: File,
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SledStore {
    /// Opens (creating if needed) the ledger `ledger.sled` in `dir`, takes
    /// the directory's lock and checks the key layout. A created ledger is
    /// durable (its directory entries synced) when this returns.
    pub fn open(dir: &Path) -> Result<SledStore, StoreError> {
        SledStore::open_with_cache(dir, crate::config::SLED_CACHE)
    }

    /// [`SledStore::open`] with a page cache of `cache` bytes, the most of
    /// the ledger sled keeps in memory (`[store] cache`).
    pub fn open_with_cache(dir: &Path, cache: u64) -> Result<SledStore, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| unavailable(format!("cannot create {}: {e}", dir.display())))?;
        let lock_path = dir.join("khata.lock");
        let lock = File::create(&lock_path)
            .map_err(|e| unavailable(format!("cannot create {}: {e}", lock_path.display())))?;
        lock.try_lock().map_err(|_| {
            unavailable(format!(
                "{} is locked: another khata daemon uses this data directory",
                lock_path.display()
            ))
        })?;
        let path = dir.join(DIR_NAME);
        // khata.lock, held above, keeps other processes out; sled's own lock
        // on its file can still be held for a moment by the threads of a
        // store of this process that was just dropped: wait for them.
        let mut patience = 500;
        let db = loop {
            let opened = sled::Config::new()
                .path(&path)
                .cache_capacity(cache)
                // The writer is the only flusher (concurrent flushes deadlock).
                .flush_every_ms(None)
                .open();
            match opened {
                // sled reports its lock taken as an `Other` I/O error.
                Err(sled::Error::Io(e))
                    if e.to_string().contains("could not acquire lock") && patience > 0 =>
                {
                    patience -= 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => {
                    break other.map_err(|e| {
                        unavailable(format!("opening {}: sled: {e}", path.display()))
                    })?;
                }
            }
        };
        let t = TREE_NAMES
            .iter()
            .map(|name| db.open_tree(name))
            .collect::<Result<Vec<_>, _>>()
            .map_err(sled_err)?;
        let trees = Arc::new(Trees { db, t });
        let layout = trees.meta("layout")?;
        match layout {
            Some(v) if v > LAYOUT_VERSION => {
                return Err(unavailable(format!(
                    "the ledger {} has layout version {v}, newer than this khata ({LAYOUT_VERSION}); upgrade khata",
                    path.display()
                )));
            }
            Some(1) => migrate_layout(&trees, Millis::now())?,
            Some(_) => {}
            None => {
                trees.t[META]
                    .insert(b"layout", &LAYOUT_VERSION.to_be_bytes())
                    .map_err(sled_err)?;
            }
        }
        let data_path = path.join("db");
        let data_file = File::open(&data_path)
            .map_err(|e| unavailable(format!("opening {}: {e}", data_path.display())))?;
        let mut writer = Writer {
            trees: Arc::clone(&trees),
            next_token: trees.meta("token")?.unwrap_or(0) + 1,
            next_seq: trees.highest_seq()? + 1,
            data_file,
            blobs_dir: path.join("blobs"),
            synced_blobs: HashSet::new(),
        };
        writer.persist()?;
        sync_dir(&path)?;
        sync_dir(dir)?;
        Ok(SledStore {
            writer: GroupWriter::start(writer)?,
            trees,
            path,
            _lock: lock,
        })
    }

    /// The sled database's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the writer as one transaction; answers after the flush
    /// and fdatasync when `durable`, else once applied.
    async fn write<T, F>(&self, durable: bool, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Tx) -> Result<T, StoreError> + Send + 'static,
    {
        self.writer.write(durable, move |w| w.run(f)).await
    }

    /// Runs `f` on the trees on the blocking pool.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Trees) -> Result<T, StoreError> + Send + 'static,
    {
        let trees = Arc::clone(&self.trees);
        tokio::task::spawn_blocking(move || f(&trees))
            .await
            .map_err(unavailable)?
    }
}

// ---- steps ----

/// Checks that `lease` holds its job: the job is active under that token.
fn check_lease(tx: &Tx, lease: &LeaseRef) -> Result<JobRec, StoreError> {
    match tx.job(&lease.job_id)? {
        Some(j) if rules::holds(j.state, j.lease_token, lease) => Ok(j),
        _ => Err(rules::fenced(lease)),
    }
}

/// Releases the job's dedup key if it still points at this job and is not
/// held by `dedup_for` (compare-and-swap on the holder).
fn release_dedup(tx: &mut Tx, job: &JobRec, now: Millis) -> Result<(), StoreError> {
    let Some(key) = &job.dedup_key else {
        return Ok(());
    };
    let k = strs(&[&job.queue, key]);
    if let Some(d) = tx.get_rec::<DedupRec>(DEDUP, &k)?
        && d.job_id == job.id
        && d.hold_until.is_none_or(|h| h <= now)
    {
        tx.remove(DEDUP, k);
    }
    Ok(())
}

fn enqueue_one(
    tx: &mut Tx,
    job: NewJob,
    index: usize,
    now: Millis,
) -> Result<Enqueued, StoreError> {
    if let Some(id) = &job.id
        && let Some(existing) = tx.job(id)?
    {
        if crate::job::same_payload(&existing.payload, &job.payload) && existing.queue == job.queue
        {
            return Ok(Enqueued {
                job: existing.to_job(now),
                deduplicated: true,
            });
        }
        return Err(StoreError::IdReused {
            id: id.clone(),
            index,
        });
    }
    if let Some(key) = &job.dedup_key
        && let Some(holder) = tx.get_rec::<DedupRec>(DEDUP, &strs(&[&job.queue, key]))?
        && let Some(held) = tx.job(&holder.job_id)?
        && (held.state.is_live() || holder.hold_until.is_some_and(|h| h > now))
    {
        return Ok(Enqueued {
            job: held.to_job(now),
            deduplicated: true,
        });
    }
    let id = job.id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let seq = tx.next_seq;
    tx.next_seq += 1;
    let rec = JobRec {
        id: id.clone(),
        queue: job.queue,
        state: JobState::Waiting,
        payload: job.payload,
        priority: job.priority,
        run_at: job.run_at,
        seq,
        attempt: 0,
        budget_used: 0,
        max_attempts: job.max_attempts,
        dedup_key: job.dedup_key,
        enqueued_at: now,
        finished_at: None,
        result: None,
        last_error: None,
        lease_token: None,
    };
    tx.put_job(None, Some(&rec))?;
    if let Some(key) = &rec.dedup_key {
        let d = DedupRec {
            job_id: id,
            hold_until: job.dedup_for.map(|d| now.plus(d)),
        };
        tx.insert(DEDUP, strs(&[&rec.queue, key]), encode(&d));
    }
    Ok(Enqueued {
        job: rec.to_job(now),
        deduplicated: false,
    })
}

fn lease_batch(
    tx: &mut Tx,
    queue: &str,
    max: u32,
    plugin_version: &str,
    now: Millis,
) -> Result<Vec<Lease>, StoreError> {
    let prefix = strs(&[queue]);
    let mut picked = Vec::new();
    let trees = Arc::clone(&tx.trees);
    for entry in trees.t[READY].scan_prefix(&prefix) {
        if picked.len() >= max as usize {
            break;
        }
        let (_, id) = entry.map_err(sled_err)?;
        let id = String::from_utf8_lossy(&id).into_owned();
        let job = tx.require_job(&id)?;
        if job.run_at <= now {
            picked.push(job);
        }
    }
    let mut leases = Vec::with_capacity(picked.len());
    for old in picked {
        let token = tx.next_token;
        tx.next_token += 1;
        let mut new = old.clone();
        new.state = JobState::Active;
        new.attempt += 1;
        new.budget_used += 1;
        new.lease_token = Some(token);
        tx.put_job(Some(&old), Some(&new))?;
        let a = AttemptRec {
            number: new.attempt,
            token,
            started_at: now,
            ended_at: None,
            outcome: AttemptOutcome::Running,
            error: None,
            plugin_version: Some(plugin_version.to_owned()),
        };
        tx.insert(ATTEMPTS, attempt_key(&new.id, new.attempt), encode(&a));
        leases.push(Lease {
            job_id: new.id,
            queue: queue.to_owned(),
            payload: new.payload,
            attempt: new.attempt,
            max_attempts: new.max_attempts,
            enqueued_at: new.enqueued_at,
            token,
        });
    }
    Ok(leases)
}

/// Closes the open attempt of `lease`'s token, if any.
fn close_attempt(
    tx: &mut Tx,
    lease: &LeaseRef,
    outcome: AttemptOutcome,
    error: Option<&str>,
    now: Millis,
) -> Result<(), StoreError> {
    let attempts = tx.trees.attempts(&lease.job_id)?;
    for mut a in attempts {
        let key = attempt_key(&lease.job_id, a.number);
        // This step's own writes win over the tree.
        if let Some(current) = tx.get_rec::<AttemptRec>(ATTEMPTS, &key)? {
            a = current;
        }
        if a.token == lease.token && a.ended_at.is_none() {
            a.ended_at = Some(now);
            a.outcome = outcome;
            a.error = error.map(str::to_owned);
            tx.insert(ATTEMPTS, key, encode(&a));
        }
    }
    Ok(())
}

/// Moves a job to a final state (completed, dead, cancelled).
fn end_job(
    tx: &mut Tx,
    old: &JobRec,
    state: JobState,
    result: Option<&str>,
    error: Option<&str>,
    now: Millis,
) -> Result<(), StoreError> {
    let mut new = old.clone();
    new.state = state;
    new.finished_at = Some(now);
    if let Some(r) = result {
        new.result = Some(r.to_owned());
    }
    if let Some(e) = error {
        new.last_error = Some(e.to_owned());
    }
    new.lease_token = None;
    tx.put_job(Some(old), Some(&new))?;
    release_dedup(tx, &new, now)
}

/// Writes what a rule decided for a job: an end (completed or dead), or
/// back to waiting at its `run_at`, refunded or not.
fn move_job(tx: &mut Tx, job: &JobRec, m: rules::Move, now: Millis) -> Result<(), StoreError> {
    if m.ends() {
        return end_job(
            tx,
            job,
            m.state,
            m.result.as_deref(),
            m.error.as_deref(),
            now,
        );
    }
    let mut new = job.clone();
    new.state = JobState::Waiting;
    new.run_at = m.run_at.unwrap_or(now);
    if let Some(e) = m.error {
        new.last_error = Some(e);
    }
    new.lease_token = None;
    if m.refund {
        new.budget_used = new.budget_used.saturating_sub(1);
    }
    tx.put_job(Some(job), Some(&new))
}

fn finish_step(
    tx: &mut Tx,
    lease: &LeaseRef,
    finish: Finish,
    now: Millis,
) -> Result<JobState, StoreError> {
    let job = tx.require_job(&lease.job_id)?;
    let held = rules::Held {
        state: job.state,
        budget_used: job.budget_used,
        max_attempts: job.max_attempts,
        holds: rules::holds(job.state, job.lease_token, lease),
        expired: false,
    };
    let mut ending = rules::finish(held, finish, now);
    close_attempt(tx, lease, ending.outcome, ending.error.as_deref(), now)?;
    let answer = ending.answer(lease, now);
    if let Some(m) = ending.then.take() {
        move_job(tx, &job, m, now)?;
    }
    answer
}

fn recover_step(tx: &mut Tx, now: Millis) -> Result<u64, StoreError> {
    let trees = Arc::clone(&tx.trees);
    let ids: Vec<String> = trees.t[ACTIVE]
        .iter()
        .keys()
        .map(|k| k.map(|k| String::from_utf8_lossy(&k).into_owned()))
        .collect::<Result<_, _>>()
        .map_err(sled_err)?;
    let error = rules::ABANDONED;
    for id in &ids {
        let job = tx.require_job(id)?;
        let lease = LeaseRef {
            job_id: id.clone(),
            token: job.lease_token.unwrap_or(0),
        };
        close_attempt(tx, &lease, AttemptOutcome::Abandoned, Some(error), now)?;
        let m = rules::abandon(job.budget_used, job.max_attempts, error, now);
        move_job(tx, &job, m, now)?;
    }
    Ok(ids.len() as u64)
}

fn cancel_step(tx: &mut Tx, id: &str, now: Millis) -> Result<(Job, bool), StoreError> {
    let job = tx.require_job(id)?;
    let state = visible_state(job.state, job.run_at, now);
    if !state.is_live() {
        return Err(StoreError::InvalidState {
            id: id.to_owned(),
            state,
            wanted: "only a waiting, delayed or active job can be cancelled",
        });
    }
    let was_active = job.state == JobState::Active;
    end_job(tx, &job, JobState::Cancelled, None, None, now)?;
    Ok((tx.require_job(id)?.to_job(now), was_active))
}

fn retry_step(tx: &mut Tx, id: &str, now: Millis) -> Result<Job, StoreError> {
    let job = tx.require_job(id)?;
    if !matches!(job.state, JobState::Dead | JobState::Cancelled) {
        return Err(StoreError::InvalidState {
            id: id.to_owned(),
            state: visible_state(job.state, job.run_at, now),
            wanted: "only a dead or cancelled job can be retried",
        });
    }
    let mut new = job.clone();
    new.state = JobState::Waiting;
    new.run_at = now;
    new.budget_used = 0;
    new.finished_at = None;
    tx.put_job(Some(&job), Some(&new))?;
    // Take the dedup key back if no other job holds it.
    if let Some(key) = &job.dedup_key {
        let k = strs(&[&job.queue, key]);
        if tx.get(DEDUP, &k)?.is_none() {
            let d = DedupRec {
                job_id: id.to_owned(),
                hold_until: None,
            };
            tx.insert(DEDUP, k, encode(&d));
        }
    }
    Ok(new.to_job(now))
}

/// Brings a layout 1 ledger to layout 2 in one transaction (the layout
/// number with it, so that a crash leaves version 1 whole): `dead` and
/// `tombstones` entries for what exists, and every kv value prefixed with
/// `now` as its written time. The writer's first flush makes it durable.
fn migrate_layout(trees: &Arc<Trees>, now: Millis) -> Result<(), StoreError> {
    let mut tx = Tx {
        trees: Arc::clone(trees),
        writes: BTreeMap::new(),
        next_token: 0,
        next_seq: 0,
    };
    for entry in trees.t[JOBS].iter() {
        let (k, v) = entry.map_err(sled_err)?;
        let job: JobRec = decode(JOBS, &k, &v)?;
        if job.state == JobState::Dead {
            for (tree, key, value) in job.derived() {
                if tree == DEAD {
                    tx.insert(tree, key, value);
                }
            }
        }
    }
    for entry in trees.t[KV].iter() {
        let (k, v) = entry.map_err(sled_err)?;
        let (ns, rest) = split_str(&k).ok_or_else(|| corrupt(KV, &k))?;
        let (key, _) = split_str(rest).ok_or_else(|| corrupt(KV, &k))?;
        tx.put_kv(ns, key, None, Some((now, &v)));
    }
    for entry in trees.t[INDEX].iter() {
        let (k, v) = entry.map_err(sled_err)?;
        let doc: DocRec = decode(INDEX, &k, &v)?;
        tx.put_doc(k.to_vec(), None, Some(&doc));
    }
    tx.insert(
        META,
        b"layout".to_vec(),
        LAYOUT_VERSION.to_be_bytes().to_vec(),
    );
    tx.commit()
}

fn sweep_step(
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
fn time_cutoff(at: Millis) -> Vec<u8> {
    let mut k = Vec::new();
    put_i64(&mut k, at.0);
    k
}

/// Removes up to `limit` jobs of the time-ordered tree `by_time`
/// (`finished` or `dead`) that finished before `before`, with their
/// attempts and effects, releasing their dedup keys. Returns how many.
fn sweep_jobs(
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

fn index_read(tx: &Tx, collection: &str, id: &str) -> Result<Option<DocRec>, StoreError> {
    tx.get_rec(INDEX, &strs(&[collection, id]))
}

/// Whether the attempt that wrote `f` still holds its job.
fn holder_alive(tx: &Tx, f: &FenceRec) -> Result<bool, StoreError> {
    rules::alive(check_lease(tx, &rules::holder_lease(f)))
}

fn fence_begin_step(
    tx: &mut Tx,
    lease: &LeaseRef,
    attempt: u32,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin, StoreError> {
    check_lease(tx, lease)?;
    let Some(f) = tx.fence(id)? else {
        let f = FenceRec {
            namespace: id.namespace.clone(),
            kind: id.kind.clone(),
            key: id.key.clone(),
            state: FenceState::Started,
            fingerprint: fingerprint.to_vec(),
            job_id: lease.job_id.clone(),
            attempt,
            token: lease.token,
            result: None,
            created_at: now,
            updated_at: now,
        };
        tx.put_fence(None, Some(&f));
        return Ok(FenceBegin::Started);
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive(tx, &f)?;
            rules::begin_if_alive(f, alive)
        }
    })
}

/// Loads a fence that `lease` may move on: started by that lease, or by an
/// attempt that died.
fn owned_or_abandoned(tx: &Tx, lease: &LeaseRef, id: &FenceId) -> Result<FenceRec, StoreError> {
    let (f, ask) = rules::may_move(tx.fence(id)?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive(tx, &f)?)?;
    }
    Ok(f)
}

/// Loads a `started` fence that `lease` itself holds (nobody took it over).
fn held_by(tx: &Tx, lease: &LeaseRef, id: &FenceId) -> Result<FenceRec, StoreError> {
    let f = owned_or_abandoned(tx, lease, id)?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
}

fn set_fence(
    tx: &mut Tx,
    old: &FenceRec,
    state: FenceState,
    lease: &LeaseRef,
    attempt: u32,
    result: Option<Vec<u8>>,
    now: Millis,
) {
    let mut new = old.clone();
    new.state = state;
    new.job_id = lease.job_id.clone();
    new.attempt = attempt;
    new.token = lease.token;
    if result.is_some() {
        new.result = result;
    }
    new.updated_at = now;
    tx.put_fence(Some(old), Some(&new));
}

fn fence_resolve_step(
    tx: &mut Tx,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<(), StoreError> {
    let f = tx.fence(id)?.ok_or_else(|| {
        StoreError::NotFound(format!("fence {}/{}/{}", id.namespace, id.kind, id.key))
    })?;
    match f.state {
        FenceState::Done => {
            return Err(invalid_fence(id, "it is done; there is nothing to resolve"));
        }
        FenceState::Started if holder_alive(tx, &f)? => {
            return Err(invalid_fence(
                id,
                format!("a live attempt of job {:?} holds it", f.job_id),
            ));
        }
        FenceState::Started | FenceState::Uncertain => {}
    }
    match resolution {
        Resolution::Done => {
            let mut new = f.clone();
            new.state = FenceState::Done;
            new.result = Some(RESOLVED_BY_OPERATOR.to_vec());
            new.updated_at = now;
            tx.put_fence(Some(&f), Some(&new));
        }
        Resolution::NotDone => tx.put_fence(Some(&f), None),
    }
    Ok(())
}

fn ids_from(
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

    async fn lease(
        &self,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>, StoreError> {
        let (queue, version) = (queue.to_owned(), plugin_version.to_owned());
        self.write(false, move |tx| lease_batch(tx, &queue, max, &version, now))
            .await
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

    async fn finish(
        &self,
        lease: &LeaseRef,
        finish: Finish,
        now: Millis,
    ) -> Result<JobState, StoreError> {
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
            let cursor: u64 = match &filter.cursor {
                Some(s) => s
                    .parse()
                    .map_err(|_| StoreError::NotFound(format!("cursor {s:?}")))?,
                None => u64::MAX,
            };
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

    async fn sweep(
        &self,
        now: Millis,
        rules: &RetentionRules,
        limit: u32,
    ) -> Result<Swept, StoreError> {
        let rules = rules.clone();
        self.write(true, move |tx| sweep_step(tx, now, &rules, limit))
            .await
    }

    async fn kv_get(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
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

    async fn kv_put(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
        value: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let old = tx.kv(&ns, &key)?.map(|(at, _)| at);
            tx.put_kv(&ns, &key, old, Some((now, &value)));
            Ok(())
        })
        .await
    }

    async fn kv_insert_if_absent(
        &self,
        lease: &LeaseRef,
        ns: &str,
        key: &str,
        value: Vec<u8>,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            if tx.get(KV, &strs(&[&ns, &key]))?.is_some() {
                return Ok(false);
            }
            tx.put_kv(&ns, &key, None, Some((now, &value)));
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

    async fn index_upsert(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
        document: &str,
        version: u64,
        now: Millis,
    ) -> Result<UpsertOutcome, StoreError> {
        let (lease, collection, id, document) = (
            lease.clone(),
            collection.to_owned(),
            id.to_owned(),
            document.to_owned(),
        );
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let current = index_read(tx, &collection, &id)?;
            let outcome = match &current {
                Some(d) if d.version > version => return Ok(UpsertOutcome::Stale),
                Some(d) if d.version == version && d.document.is_some() => {
                    return Ok(UpsertOutcome::Unchanged);
                }
                Some(d) if d.version == version => return Ok(UpsertOutcome::Stale),
                Some(d) if d.document.is_some() => UpsertOutcome::Updated,
                _ => UpsertOutcome::Inserted,
            };
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

    async fn index_remove(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
        version: u64,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let (lease, collection, id) = (lease.clone(), collection.to_owned(), id.to_owned());
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            let current = index_read(tx, &collection, &id)?;
            let removed = match &current {
                Some(d) if d.version > version => return Ok(false),
                Some(d) => d.document.is_some(),
                None => false,
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

    async fn index_get_leased(
        &self,
        lease: &LeaseRef,
        collection: &str,
        id: &str,
    ) -> Result<Option<String>, StoreError> {
        let (lease, collection, id) = (lease.clone(), collection.to_owned(), id.to_owned());
        self.write(false, move |tx| {
            check_lease(tx, &lease)?;
            Ok(index_read(tx, &collection, &id)?.and_then(|d| d.document))
        })
        .await
    }

    async fn index_get(
        &self,
        collection: &str,
        id: &str,
    ) -> Result<Option<(String, u64)>, StoreError> {
        let key = strs(&[collection, id]);
        self.read(move |t| {
            let d: Option<DocRec> = t.get_rec(INDEX, &key)?;
            Ok(d.and_then(|d| d.document.map(|doc| (doc, d.version))))
        })
        .await
    }

    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin, StoreError> {
        let (lease, id, fingerprint) = (lease.clone(), id.clone(), fingerprint.to_vec());
        self.write(true, move |tx| {
            fence_begin_step(tx, &lease, attempt, &id, &fingerprint, now)
        })
        .await
    }

    async fn fence_take_over(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            check_lease(tx, &lease)?;
            let f = owned_or_abandoned(tx, &lease, &id)?;
            set_fence(tx, &f, FenceState::Started, &lease, attempt, None, now);
            Ok(())
        })
        .await
    }

    async fn fence_done(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            let f = held_by(tx, &lease, &id)?;
            set_fence(tx, &f, FenceState::Done, &lease, attempt, Some(result), now);
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

    async fn fence_uncertain(
        &self,
        lease: &LeaseRef,
        attempt: u32,
        id: &FenceId,
        now: Millis,
    ) -> Result<(), StoreError> {
        let (lease, id) = (lease.clone(), id.clone());
        self.write(true, move |tx| {
            let f = owned_or_abandoned(tx, &lease, &id)?;
            set_fence(tx, &f, FenceState::Uncertain, &lease, attempt, None, now);
            Ok(())
        })
        .await
    }

    async fn fence_resolve(
        &self,
        id: &FenceId,
        resolution: Resolution,
        now: Millis,
    ) -> Result<(), StoreError> {
        let id = id.clone();
        self.write(true, move |tx| fence_resolve_step(tx, &id, resolution, now))
            .await
    }

    async fn fences(
        &self,
        namespace: Option<&str>,
        state: Option<FenceState>,
        limit: u32,
    ) -> Result<Vec<Fence>, StoreError> {
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

    async fn export(
        &self,
        cursor: Option<copy::Cursor>,
        limit: u32,
    ) -> Result<copy::ExportPage, StoreError> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        self.read(move |t| export_page(t, &cursor, limit)).await
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        self.write(true, move |tx| import_step(tx, &records)).await
    }
}

// ---- moving a ledger (`store::copy`) ----

use super::copy;

/// The first key of `tree` after the cursor's: the export goes on past the
/// key its cursor names (`parts` strings, the job id raw in `jobs`).
fn page_start(
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
fn page_of(
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
fn export_page(
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
            let effects = t
                .effects(id)?
                .into_iter()
                .map(|e| copy::EffectRow {
                    attempt: e.attempt,
                    kind: e.kind,
                    key: e.key,
                    outcome: e.outcome,
                    at: e.at,
                })
                .collect();
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
fn import_step(tx: &mut Tx, records: &[copy::Record]) -> Result<(), StoreError> {
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

/// Splits a length-prefixed string off the front of `b`.
fn split_str(b: &[u8]) -> Option<(&str, &[u8])> {
    let len = u32::from_be_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let s = std::str::from_utf8(b.get(4..4 + len)?).ok()?;
    Some((s, &b[4 + len..]))
}

fn corrupt(tree: usize, key: &[u8]) -> StoreError {
    unavailable(format!(
        "corrupt key in sled tree {}: {}",
        TREE_NAMES[tree],
        hex::encode(key)
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::SledStore;
    use crate::store::Store;

    crate::conformance_tests!(|| async {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).expect("open"));
        (dir, store)
    });

    #[test]
    fn a_second_daemon_is_kept_off_the_ledger() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _first = SledStore::open(dir.path()).expect("open");
        let second = SledStore::open(dir.path());
        assert!(
            second
                .unwrap_err()
                .to_string()
                .contains("another khata daemon")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reopened_ledger_keeps_jobs_fences_and_the_token_order() {
        use crate::job::{Finish, Millis, NewJob};
        use crate::store::{FenceBegin, FenceId};
        let dir = tempfile::tempdir().expect("tempdir");
        let now = Millis(1_700_000_000_000);
        let job = |id: &str| NewJob {
            queue: "q".into(),
            id: Some(id.into()),
            payload: "{}".into(),
            priority: 0,
            run_at: now,
            max_attempts: 3,
            dedup_key: None,
            dedup_for: None,
        };
        let fence = FenceId {
            namespace: "q".into(),
            kind: "http".into(),
            key: "charge-1".into(),
        };
        let first_token = {
            let s = SledStore::open(dir.path()).expect("open");
            s.enqueue(vec![job("a"), job("b")], now).await.unwrap();
            let l = s.lease("q", 1, "v1", now).await.unwrap().remove(0);
            let lease = l.fence();
            assert_eq!(
                s.fence_begin(&lease, 1, &fence, b"fp", now).await.unwrap(),
                FenceBegin::Started
            );
            s.fence_done(&lease, 1, &fence, b"paid".to_vec(), now)
                .await
                .unwrap();
            s.finish(
                &lease,
                Finish::Completed {
                    result: "{}".into(),
                },
                now,
            )
            .await
            .unwrap();
            // Leased, never finished: the next start recovers it.
            s.lease("q", 1, "v1", now).await.unwrap().remove(0).token
        };
        let s = SledStore::open(dir.path()).expect("reopen");
        assert_eq!(s.recover(now).await.unwrap(), 1);
        let l = s.lease("q", 1, "v1", now).await.unwrap().remove(0);
        assert_eq!(l.job_id, "b");
        assert!(l.token > first_token, "tokens only grow across a reopen");
        assert_eq!(
            s.fence_begin(&l.fence(), 2, &fence, b"fp", now)
                .await
                .unwrap(),
            FenceBegin::Replay(b"paid".to_vec())
        );
        let a = s.job("a", now).await.unwrap().unwrap();
        assert_eq!(a.state, crate::job::JobState::Completed);
        let counts = s.counts(now).await.unwrap();
        assert_eq!((counts[0].1.completed, counts[0].1.active), (1, 1));
        let page = s
            .jobs(
                crate::store::JobFilter {
                    limit: 10,
                    ..Default::default()
                },
                now,
            )
            .await
            .unwrap();
        let ids: Vec<_> = page.jobs.iter().map(|j| j.id.as_str()).collect();
        assert_eq!(ids, ["b", "a"], "newest first, seq kept across the reopen");
        s.enqueue(vec![job("c")], now).await.unwrap();
        let page = s
            .jobs(
                crate::store::JobFilter {
                    limit: 1,
                    ..Default::default()
                },
                now,
            )
            .await
            .unwrap();
        assert_eq!(
            page.jobs[0].id, "c",
            "a new job's seq is above the old ones"
        );
    }

    /// A layout 1 ledger (no dead, kv_by_time or tombstones trees; kv
    /// values without their write time) is brought to layout 2 when it
    /// opens: its kv reads as before and retention finds its dead jobs, kv
    /// entries and tombstones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_layout_1_ledger_is_migrated_when_it_opens() {
        use std::time::Duration;

        use super::{DIR_NAME, LAYOUT_VERSION, split_kv_value};
        use crate::job::{AttemptOutcome, Finish, Millis, NewJob};
        use crate::store::RetentionRules;
        let dir = tempfile::tempdir().expect("tempdir");
        let t0 = Millis(1_700_000_000_000);
        let job = |id: &str| NewJob {
            queue: "q".into(),
            id: Some(id.into()),
            payload: "{}".into(),
            priority: 0,
            run_at: t0,
            max_attempts: 1,
            dedup_key: None,
            dedup_for: None,
        };
        {
            let s = SledStore::open(dir.path()).expect("open");
            s.enqueue(vec![job("a")], t0).await.unwrap();
            let l = s.lease("q", 1, "v1", t0).await.unwrap().remove(0).fence();
            s.kv_put(&l, "ns", "k", b"value".to_vec(), t0)
                .await
                .unwrap();
            s.index_upsert(&l, "docs", "d", "{}", 1, t0).await.unwrap();
            assert!(s.index_remove(&l, "docs", "d", 2, t0).await.unwrap());
            let fail = Finish::Fail {
                outcome: AttemptOutcome::Failed,
                error: "x".into(),
            };
            s.finish(&l, fail, t0).await.unwrap();
        }
        // Rewrite it as layout 1 wrote it.
        {
            let db = sled::open(dir.path().join(DIR_NAME)).expect("sled");
            for name in ["dead", "kv_by_time", "tombstones"] {
                db.open_tree(name).unwrap().clear().unwrap();
            }
            let kv = db.open_tree("kv").unwrap();
            for entry in kv.iter() {
                let (k, v) = entry.unwrap();
                let (_, bare) = split_kv_value(&v).unwrap();
                kv.insert(k, bare).unwrap();
            }
            let meta = db.open_tree("meta").unwrap();
            meta.insert(b"layout", &1u64.to_be_bytes()).unwrap();
            db.flush().unwrap();
        }
        let s = SledStore::open(dir.path()).expect("reopen migrates");
        assert_eq!(s.trees.meta("layout").unwrap(), Some(LAYOUT_VERSION));
        s.enqueue(vec![job("b")], t0).await.unwrap();
        let l = s.lease("q", 1, "v1", t0).await.unwrap().remove(0).fence();
        assert_eq!(
            s.kv_get(&l, "ns", "k").await.unwrap().as_deref(),
            Some(&b"value"[..]),
            "kv reads as before"
        );
        let day = Duration::from_secs(86_400);
        let rules = RetentionRules {
            jobs: day,
            dead: day,
            fences: day,
            tombstones: day,
            kv: vec![("ns".into(), day)],
        };
        // Dead jobs and tombstones keep their times; a layout 1 kv entry had
        // none, and counts from the migration.
        let swept = s.sweep(t0.plus(day * 2), &rules, 100).await.unwrap();
        assert_eq!(
            (swept.dead_jobs, swept.kv, swept.tombstones),
            (1, 0, 1),
            "{swept:?}"
        );
        let far = Millis::now().plus(day * 2);
        let swept = s.sweep(far, &rules, 100).await.unwrap();
        assert_eq!(swept.kv, 1, "{swept:?}");
    }

    #[test]
    fn keys_sort_in_delivery_order() {
        use super::{Millis, ready_key};
        let mut keys = [
            (ready_key("q", -5, Millis(10), 1), "low"),
            (ready_key("q", 0, Millis(-3), 9), "zero-early"),
            (ready_key("q", 0, Millis(20), 2), "zero-late-first"),
            (ready_key("q", 0, Millis(20), 3), "zero-late-second"),
            (ready_key("q", 7, Millis(99), 4), "high"),
        ];
        keys.sort();
        let order: Vec<_> = keys.iter().map(|(_, n)| *n).collect();
        assert_eq!(
            order,
            [
                "high",
                "zero-early",
                "zero-late-first",
                "zero-late-second",
                "low"
            ]
        );
    }
}
