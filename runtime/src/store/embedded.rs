//! The [`Store`] of the embedded ledgers (SQLite, sled), written once.
//!
//! One process owns an embedded ledger: every write is a step on its
//! group-commit writer ([`super::writer`]), every read runs on tokio's
//! blocking pool. `impl<L: Ledger + Reads> Store for L` below decides, for
//! each request, which step runs, whether its answer waits for the commit
//! (**durable**) or only for the step (**applied**), and which checks come
//! before a write: the lease, the fence's holder, the index's version order
//! ([`super::rules`]). A backend only loads and stores: it implements
//! [`Ledger`] (its writer, its steps, its kv, index and fence primitives)
//! and [`Reads`] (its queries).
//!
//! Invariants:
//!
//! - Each `Store` call is one step: the writes it makes apply together or
//!   not at all ([`Ledger::step`]).
//! - Steps that change a job's state, a fence, or what an operator asked
//!   (enqueue, finish, cancel, retry, recover, sweep, import, every fence
//!   step) are durable when they answer. The handler-facing kv and index
//!   steps, leases and effect records are applied: the attempt's durable
//!   finish, later in the same writer, commits them ("applied before
//!   durable", ARCHITECTURE.md).
//! - Every kv and index step of a handler first checks that its lease still
//!   holds the job: a fenced attempt changes nothing.

use async_trait::async_trait;

use super::rules::{self, FenceRow};
use super::writer::{Engine, GroupWriter};
use super::{
    Doc, DocId, EffectRecord, Fence, FenceBegin, FenceFilter, FenceId, FenceState, JobFilter,
    JobPage, KvPut, LeaseAsk, Leased, RESOLVED_BY_OPERATOR, Resolution, Result, RetentionRules,
    Store, StoreError, Swept, Tombstone, UpsertOutcome, copy,
};
use crate::job::{Enqueued, Finish, Job, JobState, Lease, LeaseRef, Millis, NewJob, StateCounts};

/// What an embedded backend stores and how. Every function but
/// [`Ledger::writer`] and [`Ledger::reader`] runs inside one step of the
/// writer thread and must leave nothing behind when it fails
/// ([`Ledger::step`] undoes the step).
pub(super) trait Ledger: Send + Sync + 'static {
    /// What the writer thread runs groups on.
    type Engine: Engine;
    /// What one step writes through.
    type Tx;
    /// A stored fence.
    type Fence: FenceRow + Send;
    /// A stored index document (or tombstone).
    type Doc;

    fn writer(&self) -> &GroupWriter<Self::Engine>;

    /// Runs `f` as one step of the open group: all of its writes or none.
    fn step<T>(engine: &mut Self::Engine, f: impl FnOnce(&mut Self::Tx) -> Result<T>) -> Result<T>;

    /// Fails with [`StoreError::Fenced`] unless `lease` holds its job.
    fn check_lease(tx: &Self::Tx, lease: &LeaseRef) -> Result<()>;

    /// Creates one job of a batch (`index` is its place, for errors), or
    /// answers the one its id or dedup key already names.
    fn enqueue_one(tx: &mut Self::Tx, job: NewJob, index: usize, now: Millis) -> Result<Enqueued>;
    /// Leases up to `max` due jobs of `queue`, in priority and run order.
    fn lease_batch(
        tx: &mut Self::Tx,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>>;
    /// Records how the attempt ended and moves its job as
    /// [`rules::finish`] decides; `Err(Fenced)` after recording it when the
    /// lease no longer holds the job.
    fn finish(tx: &mut Self::Tx, lease: &LeaseRef, finish: Finish, now: Millis)
    -> Result<JobState>;
    /// Gives the attempts a previous run of this process left active back.
    fn recover(tx: &mut Self::Tx, now: Millis) -> Result<u64>;
    fn cancel(tx: &mut Self::Tx, id: &str, now: Millis) -> Result<(Job, bool)>;
    fn retry(tx: &mut Self::Tx, id: &str, now: Millis) -> Result<Job>;
    fn sweep(tx: &mut Self::Tx, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept>;
    fn import(tx: &mut Self::Tx, records: &[copy::Record]) -> Result<()>;
    /// Appends `record` to its attempt's effects, numbered after the last.
    fn record_effect(tx: &mut Self::Tx, job_id: &str, record: EffectRecord) -> Result<()>;

    fn kv_get(tx: &Self::Tx, ns: &str, key: &str) -> Result<Option<Vec<u8>>>;
    /// Writes `put`; `false` when [`super::PutMode::IfAbsent`] found a value.
    fn kv_put(tx: &mut Self::Tx, put: KvPut, now: Millis) -> Result<bool>;
    /// `false` when there was nothing to delete.
    fn kv_delete(tx: &mut Self::Tx, ns: &str, key: &str) -> Result<bool>;

    fn doc(tx: &Self::Tx, id: &DocId) -> Result<Option<Self::Doc>>;
    /// A stored document's text (`None` for a tombstone) and version.
    fn doc_parts(doc: &Self::Doc) -> (Option<&str>, u64);
    /// Stores `document` (`None`: a tombstone) at `version` over `old`.
    fn put_doc(
        tx: &mut Self::Tx,
        id: &DocId,
        old: Option<&Self::Doc>,
        version: u64,
        document: Option<String>,
        now: Millis,
    ) -> Result<()>;

    fn fence(tx: &Self::Tx, id: &FenceId) -> Result<Option<Self::Fence>>;
    /// Stores a new `started` fence held by `lease`.
    fn insert_fence(
        tx: &mut Self::Tx,
        id: &FenceId,
        fingerprint: &[u8],
        lease: &LeaseRef,
        now: Millis,
    ) -> Result<()>;
    /// Moves `old` to `state`, held by `holder`; keeps its result unless
    /// `result` is given.
    fn set_fence(
        tx: &mut Self::Tx,
        old: &Self::Fence,
        state: FenceState,
        holder: &LeaseRef,
        result: Option<Vec<u8>>,
        now: Millis,
    ) -> Result<()>;
    fn delete_fence(tx: &mut Self::Tx, old: &Self::Fence) -> Result<()>;
}

/// The queries of an embedded backend, on a consistent view of the ledger
/// (each runs on tokio's blocking pool).
pub(super) trait Reads: Ledger {
    /// What a query reads through.
    type View;
    /// A handle that opens a [`Reads::View`] on the blocking pool.
    type Reader: Send + 'static;

    fn reader(&self) -> Self::Reader;
    /// Runs `f` on a view opened from `reader`.
    fn view<T>(reader: Self::Reader, f: impl FnOnce(&Self::View) -> Result<T>) -> Result<T>;

    fn next_run_at(v: &Self::View, queue: &str) -> Result<Option<Millis>>;
    /// The job with its attempts.
    fn job(v: &Self::View, id: &str, now: Millis) -> Result<Option<Job>>;
    fn jobs(v: &Self::View, filter: &JobFilter, now: Millis) -> Result<JobPage>;
    fn counts(v: &Self::View, now: Millis) -> Result<Vec<(String, StateCounts)>>;
    fn index_get(v: &Self::View, doc: &DocId) -> Result<Option<(String, u64)>>;
    fn fences(v: &Self::View, filter: &FenceFilter) -> Result<Vec<Fence>>;
    fn effects(v: &Self::View, job_id: &str) -> Result<Vec<EffectRecord>>;
    fn export(v: &Self::View, cursor: &copy::Cursor, limit: u32) -> Result<copy::ExportPage>;
}

/// Runs `f` as one step; answers after the group's commit when `durable`,
/// else as soon as the step has run.
async fn write<L: Ledger, T: Send + 'static>(
    ledger: &L,
    durable: bool,
    f: impl FnOnce(&mut L::Tx) -> Result<T> + Send + 'static,
) -> Result<T> {
    ledger
        .writer()
        .write(durable, move |engine| L::step(engine, f))
        .await
}

/// Runs `f` on a view of the ledger, on the blocking pool.
async fn read<L: Reads, T: Send + 'static>(
    ledger: &L,
    f: impl FnOnce(&L::View) -> Result<T> + Send + 'static,
) -> Result<T> {
    let reader = ledger.reader();
    tokio::task::spawn_blocking(move || L::view(reader, f))
        .await
        .map_err(|e| StoreError::Unavailable(format!("a ledger read stopped: {e}")))?
}

/// Creates `dir` and takes its `khata.lock`, which the returned file holds
/// until it is dropped: one daemon per data directory.
pub(super) fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File> {
    std::fs::create_dir_all(dir)
        .map_err(|e| StoreError::Unavailable(format!("cannot create {}: {e}", dir.display())))?;
    let lock_path = dir.join("khata.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| {
        StoreError::Unavailable(format!("cannot create {}: {e}", lock_path.display()))
    })?;
    lock.try_lock().map_err(|_| {
        StoreError::Unavailable(format!(
            "{} is locked: another khata daemon uses this data directory",
            lock_path.display()
        ))
    })?;
    Ok(lock)
}

/// A fence that `lease` may move on: started by that lease, or by an
/// attempt that has died since.
fn owned_or_abandoned<L: Ledger>(tx: &L::Tx, lease: &LeaseRef, id: &FenceId) -> Result<L::Fence> {
    let (f, ask) = rules::may_move(L::fence(tx, id)?, id, lease)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive::<L>(tx, &f)?)?;
    }
    Ok(f)
}

/// A `started` fence that `lease` itself holds (nobody took it over).
fn held_by<L: Ledger>(tx: &L::Tx, lease: &LeaseRef, id: &FenceId) -> Result<L::Fence> {
    let f = owned_or_abandoned::<L>(tx, lease, id)?;
    rules::held_by(&f, id, lease)?;
    Ok(f)
}

/// Whether the attempt that wrote `f` still holds its job.
fn holder_alive<L: Ledger>(tx: &L::Tx, f: &L::Fence) -> Result<bool> {
    rules::alive(L::check_lease(tx, &rules::holder_lease(f)))
}

fn fence_begin<L: Ledger>(
    tx: &mut L::Tx,
    lease: &LeaseRef,
    id: &FenceId,
    fingerprint: &[u8],
    now: Millis,
) -> Result<FenceBegin> {
    L::check_lease(tx, lease)?;
    let Some(f) = L::fence(tx, id)? else {
        L::insert_fence(tx, id, fingerprint, lease, now)?;
        return Ok(FenceBegin::Started);
    };
    Ok(match rules::fence_begin(f, lease, fingerprint) {
        rules::Begin::Answer(a) => a,
        rules::Begin::AskHolder(f) => {
            let alive = holder_alive::<L>(tx, &f)?;
            rules::begin_if_alive(f, alive)
        }
    })
}

fn fence_resolve<L: Ledger>(
    tx: &mut L::Tx,
    id: &FenceId,
    resolution: Resolution,
    now: Millis,
) -> Result<()> {
    let (f, ask) = rules::resolvable(L::fence(tx, id)?, id)?;
    if ask {
        rules::moved_if_dead(&f, id, holder_alive::<L>(tx, &f)?)?;
    }
    match resolution {
        Resolution::Done => {
            let holder = rules::holder_lease(&f);
            let result = Some(RESOLVED_BY_OPERATOR.to_vec());
            L::set_fence(tx, &f, FenceState::Done, &holder, result, now)
        }
        Resolution::NotDone => L::delete_fence(tx, &f),
    }
}

/// What an index write decided, from the stored document's state.
fn stored<L: Ledger>(current: Option<&L::Doc>) -> Option<(bool, u64)> {
    current.map(|d| {
        let (document, version) = L::doc_parts(d);
        (document.is_some(), version)
    })
}

#[async_trait]
impl<L: Reads> Store for L {
    fn halted(&self) -> Option<String> {
        self.writer().halt().reason()
    }

    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>> {
        write(self, true, move |tx| {
            jobs.into_iter()
                .enumerate()
                .map(|(i, j)| L::enqueue_one(tx, j, i, now))
                .collect()
        })
        .await
    }

    async fn lease(&self, ask: &LeaseAsk<'_>, now: Millis) -> Result<Leased> {
        // One daemon owns this ledger: its own slots and rate limiter keep
        // `ask.limits`, and `max` is the only bound here.
        let (queue, max, version) = (ask.queue.to_owned(), ask.max, ask.plugin_version.to_owned());
        let leases = write(self, false, move |tx| {
            L::lease_batch(tx, &queue, max, &version, now)
        })
        .await?;
        Ok(Leased { leases, held: None })
    }

    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>> {
        let queue = queue.to_owned();
        read(self, move |v| L::next_run_at(v, &queue)).await
    }

    async fn finish(&self, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState> {
        let lease = lease.clone();
        // A fenced finish still records how its attempt ended: commit that
        // part, then report the fence.
        write(self, true, move |tx| {
            match L::finish(tx, &lease, finish, now) {
                fenced @ Err(StoreError::Fenced { .. }) => Ok(fenced),
                other => other.map(Ok),
            }
        })
        .await?
    }

    async fn recover(&self, now: Millis) -> Result<u64> {
        write(self, true, move |tx| L::recover(tx, now)).await
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool)> {
        let id = id.to_owned();
        write(self, true, move |tx| L::cancel(tx, &id, now)).await
    }

    async fn retry(&self, id: &str, now: Millis) -> Result<Job> {
        let id = id.to_owned();
        write(self, true, move |tx| L::retry(tx, &id, now)).await
    }

    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>> {
        let id = id.to_owned();
        read(self, move |v| L::job(v, &id, now)).await
    }

    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage> {
        read(self, move |v| L::jobs(v, &filter, now)).await
    }

    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>> {
        read(self, move |v| L::counts(v, now)).await
    }

    async fn sweep(&self, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept> {
        let rules = rules.clone();
        write(self, true, move |tx| L::sweep(tx, now, &rules, limit)).await
    }

    async fn kv_get(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        write(self, false, move |tx| {
            L::check_lease(tx, &lease)?;
            L::kv_get(tx, &ns, &key)
        })
        .await
    }

    async fn kv_put(&self, lease: &LeaseRef, put: KvPut, now: Millis) -> Result<bool> {
        let lease = lease.clone();
        write(self, false, move |tx| {
            L::check_lease(tx, &lease)?;
            L::kv_put(tx, put, now)
        })
        .await
    }

    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool> {
        let (lease, ns, key) = (lease.clone(), ns.to_owned(), key.to_owned());
        write(self, false, move |tx| {
            L::check_lease(tx, &lease)?;
            L::kv_delete(tx, &ns, &key)
        })
        .await
    }

    async fn index_upsert(&self, lease: &LeaseRef, doc: Doc, now: Millis) -> Result<UpsertOutcome> {
        let lease = lease.clone();
        write(self, false, move |tx| {
            L::check_lease(tx, &lease)?;
            let Doc {
                collection,
                id,
                version,
                document,
            } = doc;
            let id = DocId { collection, id };
            let current = L::doc(tx, &id)?;
            let outcome = rules::upsert(stored::<L>(current.as_ref()), version);
            if matches!(outcome, UpsertOutcome::Inserted | UpsertOutcome::Updated) {
                L::put_doc(tx, &id, current.as_ref(), version, Some(document), now)?;
            }
            Ok(outcome)
        })
        .await
    }

    async fn index_remove(&self, lease: &LeaseRef, tomb: Tombstone, now: Millis) -> Result<bool> {
        let lease = lease.clone();
        write(self, false, move |tx| {
            L::check_lease(tx, &lease)?;
            let Tombstone {
                collection,
                id,
                version,
            } = tomb;
            let id = DocId { collection, id };
            let current = L::doc(tx, &id)?;
            let Some(removed) = rules::remove(stored::<L>(current.as_ref()), version) else {
                return Ok(false);
            };
            L::put_doc(tx, &id, current.as_ref(), version, None, now)?;
            Ok(removed)
        })
        .await
    }

    async fn index_get_leased(&self, lease: &LeaseRef, doc: &DocId) -> Result<Option<String>> {
        let (lease, doc) = (lease.clone(), doc.clone());
        write(self, false, move |tx| {
            L::check_lease(tx, &lease)?;
            let current = L::doc(tx, &doc)?;
            Ok(current.and_then(|d| L::doc_parts(&d).0.map(str::to_owned)))
        })
        .await
    }

    async fn index_get(&self, doc: &DocId) -> Result<Option<(String, u64)>> {
        let doc = doc.clone();
        read(self, move |v| L::index_get(v, &doc)).await
    }

    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin> {
        let (lease, id, fingerprint) = (lease.clone(), id.clone(), fingerprint.to_vec());
        write(self, true, move |tx| {
            fence_begin::<L>(tx, &lease, &id, &fingerprint, now)
        })
        .await
    }

    async fn fence_take_over(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        write(self, true, move |tx| {
            L::check_lease(tx, &lease)?;
            let f = owned_or_abandoned::<L>(tx, &lease, &id)?;
            L::set_fence(tx, &f, FenceState::Started, &lease, None, now)
        })
        .await
    }

    async fn fence_done(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        write(self, true, move |tx| {
            let f = held_by::<L>(tx, &lease, &id)?;
            L::set_fence(tx, &f, FenceState::Done, &lease, Some(result), now)
        })
        .await
    }

    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        write(self, true, move |tx| {
            let f = held_by::<L>(tx, &lease, &id)?;
            L::delete_fence(tx, &f)
        })
        .await
    }

    async fn fence_uncertain(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()> {
        let (lease, id) = (lease.clone(), id.clone());
        write(self, true, move |tx| {
            let f = owned_or_abandoned::<L>(tx, &lease, &id)?;
            L::set_fence(tx, &f, FenceState::Uncertain, &lease, None, now)
        })
        .await
    }

    async fn fence_resolve(&self, id: &FenceId, resolution: Resolution, now: Millis) -> Result<()> {
        let id = id.clone();
        write(self, true, move |tx| {
            fence_resolve::<L>(tx, &id, resolution, now)
        })
        .await
    }

    async fn fences(&self, filter: &FenceFilter) -> Result<Vec<Fence>> {
        let filter = filter.clone();
        read(self, move |v| L::fences(v, &filter)).await
    }

    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<()> {
        let job_id = job_id.to_owned();
        write(self, false, move |tx| L::record_effect(tx, &job_id, record)).await
    }

    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>> {
        let job_id = job_id.to_owned();
        read(self, move |v| L::effects(v, &job_id)).await
    }

    async fn export(&self, cursor: Option<copy::Cursor>, limit: u32) -> Result<copy::ExportPage> {
        let (cursor, limit) = copy::page_request(cursor, limit);
        read(self, move |v| L::export(v, &cursor, limit)).await
    }

    async fn import(&self, records: Vec<copy::Record>) -> Result<()> {
        write(self, true, move |tx| L::import(tx, &records)).await
    }
}
