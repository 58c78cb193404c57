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

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sled::Transactional;

use super::copy;
use super::rules::{self, visible_state};
use super::writer::{Engine, GroupWriter};
use super::{
    EffectRecord, Fence, FenceId, FenceState, JobFilter, JobPage, PageBuilder, RetentionRules,
    StoreError, Swept,
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

// ---- the writer ----

pub(in crate::store) struct Writer {
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
        let lock = super::embedded::lock_data_dir(dir)?;
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

mod enqueue;
mod export;
mod finish;
mod keys;
mod layout;
mod lease;
mod ledger;
mod reads;
mod records;
mod sweep;
mod trees;

use self::enqueue::*;
use self::export::*;
use self::finish::*;
use self::keys::*;
use self::layout::*;
use self::lease::*;
use self::records::*;
use self::sweep::*;
use self::trees::*;

#[cfg(test)]
mod tests;
