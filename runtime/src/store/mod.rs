//! The ledger: jobs, attempts, dedup keys, kv data, index documents and
//! fences in one database, behind one trait.
//!
//! Every backend keeps the same contract, checked by [`conformance`]:
//!
//! - Each method is one atomic step: all of it happens or none of it does.
//! - A method documented **durable** returns only after its step is committed
//!   with an fsync (group commit: many steps share one commit).
//! - A method documented **applied** returns once its step is visible to every
//!   later step of the store, before its commit; the next durable step
//!   carries it to disk. Nothing outside the daemon may learn of an applied
//!   step until a durable one follows it.
//! - Reads see committed state only, except the handler-facing kv and index
//!   reads, which see the applied writes that came before them.
//!
//! Time is always passed in (`now`), never read here, so that the queue's
//! clock can be injected.

pub mod conformance;
pub mod copy;
mod embedded;
pub mod postgres;
pub mod rules;
pub mod sled;
pub mod sqlite;
mod writer;

pub use writer::Halt;

use std::time::Duration;

use async_trait::async_trait;

use crate::job::{Enqueued, Finish, Job, JobState, Lease, LeaseRef, Millis, NewJob, StateCounts};

/// Why a store step did not happen. The step changed nothing.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum StoreError {
    /// An enqueue reused a job id with another payload or queue.
    #[error("job id {id:?} is already used by a job with another payload or queue")]
    IdReused { id: String, index: usize },
    #[error("no job {0:?}")]
    NotFound(String),
    /// The job is not in a state the step applies to.
    #[error("job {id:?} is {state}: {wanted}")]
    InvalidState {
        id: String,
        state: JobState,
        wanted: &'static str,
    },
    /// The caller no longer holds the job's lease.
    #[error("attempt with fencing token {token} no longer holds job {job_id:?}")]
    Fenced { job_id: String, token: u64 },
    /// The fence is not in a state the step applies to.
    #[error("fence {namespace}/{kind}/{key}: {reason}")]
    InvalidFence {
        namespace: String,
        kind: String,
        key: String,
        reason: String,
    },
    /// The database failed or is gone; the step may be retried.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
}

/// What one index upsert did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpsertOutcome {
    Inserted,
    Updated,
    /// Same version as stored: nothing changed.
    Unchanged,
    /// Lower version than stored: ignored.
    Stale,
}

/// The name of one effect: (namespace, kind, key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FenceId {
    pub namespace: String,
    /// `email` or `http` (the external effects).
    pub kind: String,
    pub key: String,
}

/// Where an effect's fence stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FenceState {
    /// Written before the effect left the host; its outcome is not recorded yet.
    Started,
    /// The effect happened; its result is recorded.
    Done,
    /// The effect may or may not have happened, and nothing can tell: an
    /// operator decides.
    Uncertain,
}

impl FenceState {
    pub fn as_str(self) -> &'static str {
        match self {
            FenceState::Started => "started",
            FenceState::Done => "done",
            FenceState::Uncertain => "uncertain",
        }
    }

    pub const ALL: [FenceState; 3] = [FenceState::Started, FenceState::Done, FenceState::Uncertain];

    pub fn parse(s: &str) -> Option<FenceState> {
        FenceState::ALL.into_iter().find(|f| f.as_str() == s)
    }
}

/// The durable record of one effect.
#[derive(Clone, Debug, PartialEq)]
pub struct Fence {
    pub id: FenceId,
    pub state: FenceState,
    /// Hash of the effect's kind and canonical request.
    pub fingerprint: Vec<u8>,
    /// The attempt that wrote the fence last.
    pub job_id: String,
    pub attempt: u32,
    pub token: u64,
    /// The recorded result, once done.
    pub result: Option<Vec<u8>>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

/// What `fence_begin` found (the table of docs/fences.md#what-fence_begin-does), and did.
#[derive(Clone, Debug, PartialEq)]
pub enum FenceBegin {
    /// No fence: `started` is written (durably) for the caller, who may now
    /// perform the effect.
    Started,
    /// Done before with the same request: the recorded result, to replay.
    Replay(Vec<u8>),
    /// Done, uncertain or started before with another request.
    KeyReused,
    /// Started by another attempt that still holds its job.
    InProgress { job_id: String },
    /// Started by an attempt that died (crash, timeout, cancel), or by an
    /// earlier call of this attempt that ended without an outcome: unknown. The caller resolves it by the provider's nature, then
    /// calls `fence_take_over`, `fence_done`, `fence_release` or
    /// `fence_uncertain`.
    Abandoned(Fence),
    /// Marked uncertain before; only an operator can resolve it.
    Uncertain(Fence),
}

/// The result recorded in a fence an operator resolved as done: there is no
/// recorded response, so later attempts replay this marker. The same in
/// every backend.
pub const RESOLVED_BY_OPERATOR: &[u8] = br#"{"resolved_by":"operator"}"#;

/// An operator's answer to an uncertain fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// The effect happened: later attempts replay it.
    Done,
    /// It did not: the fence is released and the next attempt performs it.
    NotDone,
}

impl Resolution {
    pub const ALL: [Resolution; 2] = [Resolution::Done, Resolution::NotDone];

    /// The resolution's name in the API and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Done => "done",
            Resolution::NotDone => "not-done",
        }
    }

    pub fn parse(s: &str) -> Option<Resolution> {
        Resolution::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// One effect an attempt performed, replayed or was refused; also what
/// `copy` moves of it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EffectRecord {
    pub attempt: u32,
    pub kind: String,
    pub key: String,
    /// `performed`, `replayed`, `refused:<reason>`, `uncertain`, `reconciled`, ...
    pub outcome: String,
    pub at: Millis,
}

/// A page of jobs, newest first.
#[derive(Clone, Debug, Default)]
pub struct JobFilter {
    pub queue: Option<String>,
    pub state: Option<JobState>,
    pub limit: u32,
    /// Continue after this cursor (from a previous page).
    pub cursor: Option<String>,
}

impl JobFilter {
    /// The enqueue sequence number the page starts below: the cursor of
    /// the previous page, or past every job. `NotFound` for a cursor that
    /// no page gave.
    pub fn before(&self) -> Result<u64> {
        match &self.cursor {
            Some(s) => s
                .parse()
                .map_err(|_| StoreError::NotFound(format!("cursor {s:?}"))),
            None => Ok(u64::MAX),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    pub next_cursor: Option<String>,
}

/// The most text (payloads, results and errors) one page of jobs holds:
/// a page ends at `limit` jobs or at the job that reaches this, whichever
/// comes first, so that a listing of big payloads costs a bounded amount of
/// memory (it always holds at least one job).
pub const PAGE_BYTES: u64 = 8 << 20;

/// The bytes of a job that count toward [`PAGE_BYTES`].
pub fn page_bytes(job: &Job) -> u64 {
    (job.payload.len()
        + job.result.as_ref().map_or(0, String::len)
        + job.last_error.as_ref().map_or(0, String::len)) as u64
}

/// A page of jobs built as rows arrive newest first; every backend's
/// `jobs` ends its pages by this one rule.
#[derive(Debug)]
pub struct PageBuilder {
    limit: usize,
    bytes: u64,
    jobs: Vec<Job>,
    last_seq: Option<i64>,
    full: bool,
}

impl PageBuilder {
    /// A page of at most `limit` jobs (clamped to 1..=1000).
    pub fn new(limit: u32) -> PageBuilder {
        PageBuilder {
            limit: limit.clamp(1, 1000) as usize,
            bytes: 0,
            jobs: Vec::new(),
            last_seq: None,
            full: false,
        }
    }

    /// Whether the page can take another job.
    pub fn has_room(&self) -> bool {
        !self.full
    }

    /// Adds the job stored at `seq` (its place in enqueue order).
    pub fn push(&mut self, job: Job, seq: i64) {
        self.bytes += page_bytes(&job);
        self.jobs.push(job);
        self.last_seq = Some(seq);
        self.full = self.jobs.len() >= self.limit || self.bytes >= PAGE_BYTES;
    }

    /// The page; a full one names where the next starts.
    pub fn finish(self) -> JobPage {
        JobPage {
            next_cursor: if self.full {
                self.last_seq.map(|s| s.to_string())
            } else {
                None
            },
            jobs: self.jobs,
        }
    }
}

/// What retention removes, and how long after (`[retention]` in
/// docs/jobs-toml.md). Times count from the row's own clock field: a job's
/// `finished_at`, a fence's or tombstone's last change, a kv entry's last
/// write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetentionRules {
    /// Completed and cancelled jobs.
    pub jobs: Duration,
    /// Dead jobs.
    pub dead: Duration,
    /// Done fences (started and uncertain ones are never swept).
    pub fences: Duration,
    /// Index tombstones (a removed document's version).
    pub tombstones: Duration,
    /// kv entries of the named namespaces; other namespaces keep theirs.
    pub kv: Vec<(String, Duration)>,
}

/// What one retention pass removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Completed and cancelled jobs.
    pub jobs: u64,
    pub dead_jobs: u64,
    pub fences: u64,
    pub dedup_keys: u64,
    pub kv: u64,
    pub tombstones: u64,
}

impl Swept {
    /// Each kind with its count, as `khata_retention_swept_total{kind}`
    /// names them.
    pub fn kinds(&self) -> [(&'static str, u64); 6] {
        [
            ("jobs", self.jobs),
            ("dead_jobs", self.dead_jobs),
            ("fences", self.fences),
            ("dedup_keys", self.dedup_keys),
            ("kv", self.kv),
            ("tombstones", self.tombstones),
        ]
    }
}

/// A queue's limits as [`Store::lease`] keeps them across daemons.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseLimits {
    /// Most attempts of the queue holding an unexpired lease at once.
    pub concurrency: Option<u32>,
    /// Most attempts of the queue started in any window.
    pub rate: Option<RateWindow>,
}

/// At most `max` attempts started in any window of `per`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateWindow {
    pub max: u32,
    pub per: Duration,
}

/// What [`Store::lease`] leased, and why not more.
#[derive(Debug, Default)]
pub struct Leased {
    pub leases: Vec<Lease>,
    /// Set when a limit left less room than was asked for.
    pub held: Option<Held>,
}

/// The limit that held a lease back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// `concurrency`: room comes back when an attempt of the queue ends (the
    /// store wakes the queue through [`Store::wakeups`]) or its lease expires.
    Concurrency,
    /// `rate_limit`: the window has room again after this long.
    Rate(Duration),
}

/// What every ledger operation answers.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What a lease asks for: up to `max` jobs of `queue` for handlers of
/// `plugin_version`, within `limits`.
#[derive(Clone, Copy, Debug)]
pub struct LeaseAsk<'a> {
    pub queue: &'a str,
    pub max: u32,
    pub plugin_version: &'a str,
    pub limits: LeaseLimits,
}

/// A kv write: `value` at (`ns`, `key`), replacing what is there or only
/// when nothing is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPut {
    pub ns: String,
    pub key: String,
    pub value: Vec<u8>,
    pub mode: PutMode,
}

/// Whether a [`KvPut`] replaces a stored value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutMode {
    Replace,
    IfAbsent,
}

/// A document of the index: its collection and id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DocId {
    pub collection: String,
    pub id: String,
}

/// An index upsert: `document` as `version` of (`collection`, `id`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Doc {
    pub collection: String,
    pub id: String,
    pub version: u64,
    pub document: String,
}

/// An index removal: a tombstone at `version` of (`collection`, `id`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tombstone {
    pub collection: String,
    pub id: String,
    pub version: u64,
}

/// Which fences an operator lists: of `namespace` and in `state` when
/// given, at most `limit`, most recently changed first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FenceFilter {
    pub namespace: Option<String>,
    pub state: Option<FenceState>,
    pub limit: u32,
}

/// The ledger's operations. Every backend implements all of them with the
/// same semantics; `conformance::run` checks that.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Enqueues `jobs` in one step, all or none, deduplicating by id and by
    /// dedup key (docs/jobs.md#enqueue-deduplication). Answers in the order given. **Durable.**
    async fn enqueue(&self, jobs: Vec<NewJob>, now: Millis) -> Result<Vec<Enqueued>, StoreError>;

    /// Leases up to `ask.max` jobs of `ask.queue` that are waiting with
    /// `run_at <= now`, in delivery order (priority desc, run_at, enqueue
    /// order); each gets a new attempt, recorded with the plugin version it
    /// will run on, and a fresh fencing token. **Applied.**
    ///
    /// A store that several daemons share keeps `ask.limits` across all of
    /// them: it leases no job that would bring the attempts of the queue in
    /// flight (holding an unexpired lease, except this store's attempts whose
    /// [`Store::finish`] is on its way: their handlers have ended) above
    /// `limits.concurrency`, or the attempts of the queue started in any
    /// window of `limits.rate.per` (on the store's clock) above
    /// `limits.rate.max`, counting every daemon's leases. Fewer leases than
    /// `max` come back when the limits leave less room; [`Leased::held`] then
    /// says why, so that the caller waits instead of asking again at once.
    ///
    /// A store that one daemon owns (its lock file keeps others out) leaves
    /// the limits to that daemon: its own concurrency slots and rate limiter
    /// are then the whole count, and `max` is the only bound.
    async fn lease(&self, ask: &LeaseAsk<'_>, now: Millis) -> Result<Leased>;

    /// The earliest `run_at` of a waiting job of `queue`, if any. Committed state.
    async fn next_run_at(&self, queue: &str) -> Result<Option<Millis>, StoreError>;

    /// Ends the attempt holding `lease` and moves its job. `Fenced` when the
    /// attempt no longer holds the job (cancelled meanwhile); the attempt's
    /// record is still closed. Returns the job's new state. **Durable.**
    async fn finish(&self, lease: &LeaseRef, finish: Finish, now: Millis) -> Result<JobState>;

    /// Crash recovery, run once at start before any lease: every `active`
    /// job's attempt is closed as abandoned (counted), and the job goes back to
    /// waiting at `now`, or to dead when its budget is used up. Returns how
    /// many jobs were recovered. On a store that several daemons share
    /// (PostgreSQL) only jobs whose lease expired: a live daemon's are its
    /// own. **Durable.**
    async fn recover(&self, now: Millis) -> Result<u64, StoreError>;

    /// Cancels a waiting, delayed or active job. An active job's lease is
    /// revoked: its attempt is fenced from here on. Returns the job and whether
    /// it was active. **Durable.**
    async fn cancel(&self, id: &str, now: Millis) -> Result<(Job, bool), StoreError>;

    /// Puts a dead or cancelled job back to waiting with a fresh attempt
    /// budget. Its fences stay. **Durable.**
    async fn retry(&self, id: &str, now: Millis) -> Result<Job, StoreError>;

    /// The job with its attempts. Committed state.
    async fn job(&self, id: &str, now: Millis) -> Result<Option<Job>, StoreError>;

    /// A page of jobs, newest first. Committed state.
    async fn jobs(&self, filter: JobFilter, now: Millis) -> Result<JobPage, StoreError>;

    /// Job counts by queue and state. Committed state.
    async fn counts(&self, now: Millis) -> Result<Vec<(String, StateCounts)>, StoreError>;

    /// Removes what `rules` says is due at `now` (each job with its
    /// attempts and effects, releasing its dedup key), and expired dedup
    /// keys: at most `limit` rows of each kind per pass, so that one pass is
    /// one bounded write. **Durable**: what it reports removed stays
    /// removed.
    async fn sweep(&self, now: Millis, rules: &RetentionRules, limit: u32) -> Result<Swept>;

    // Handler-facing kv and index steps. Each checks first that `lease` still
    // holds its job (else `Fenced`) and is **applied**: durable no later than
    // the attempt's next durable step (its finish or an external effect).

    async fn kv_get(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<Option<Vec<u8>>>;
    /// Writes `put.value` (unless `put.mode` is `IfAbsent` and the key
    /// exists: then nothing changes); true when it was written. `now` is the
    /// entry's write time, from which [`RetentionRules::kv`] counts.
    async fn kv_put(&self, lease: &LeaseRef, put: KvPut, now: Millis) -> Result<bool>;
    /// True when a value was deleted.
    async fn kv_delete(&self, lease: &LeaseRef, ns: &str, key: &str) -> Result<bool, StoreError>;

    /// Upserts a document unless the stored version is higher (`Stale`) or
    /// equal (`Unchanged`).
    async fn index_upsert(&self, lease: &LeaseRef, doc: Doc, now: Millis) -> Result<UpsertOutcome>;
    /// Removes a document whose stored version is not higher than `version`,
    /// leaving a tombstone at `version` so that older upserts stay stale.
    /// True when a live document was removed.
    async fn index_remove(&self, lease: &LeaseRef, tomb: Tombstone, now: Millis) -> Result<bool>;
    async fn index_get_leased(&self, lease: &LeaseRef, doc: &DocId) -> Result<Option<String>>;
    /// A document and its version, for operators. Committed state.
    async fn index_get(&self, doc: &DocId) -> Result<Option<(String, u64)>>;

    // Fences of external effects (docs/fences.md).

    /// Checks `lease`, looks at the fence of `id` and acts on the table of docs/fences.md#what-fence_begin-does (see hand-written list)
    /// table: absent → writes `started` for this attempt. **Durable**: the
    /// effect leaves the host only after `started` is on disk, together with
    /// every applied step before it.
    async fn fence_begin(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        fingerprint: &[u8],
        now: Millis,
    ) -> Result<FenceBegin, StoreError>;
    /// Checks `lease` and makes an abandoned `started` fence this attempt's,
    /// to perform the effect again (idempotent provider, or policy `repeat`).
    /// **Durable.**
    async fn fence_take_over(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()>;
    /// Records the effect's result: `done`. No lease check — the effect
    /// happened — but the fence must still be this attempt's. **Durable.**
    async fn fence_done(
        &self,
        lease: &LeaseRef,
        id: &FenceId,
        result: Vec<u8>,
        now: Millis,
    ) -> Result<(), StoreError>;
    /// Deletes this attempt's fence: the effect certainly did not happen and
    /// may be performed by a later attempt. **Durable.**
    async fn fence_release(&self, lease: &LeaseRef, id: &FenceId) -> Result<(), StoreError>;
    /// Marks a fence of this attempt, or one abandoned by a dead attempt,
    /// `uncertain` for an operator. **Durable.**
    async fn fence_uncertain(&self, lease: &LeaseRef, id: &FenceId, now: Millis) -> Result<()>;
    /// An operator resolves an uncertain fence (or one started by a dead
    /// attempt). `NotFound` when there is no such fence, `InvalidFence` when
    /// it is done or held by a live attempt. **Durable.**
    async fn fence_resolve(&self, id: &FenceId, resolution: Resolution, now: Millis) -> Result<()>;
    /// Fences for operators, most recently changed first. Committed state.
    async fn fences(&self, filter: &FenceFilter) -> Result<Vec<Fence>>;
    /// Records an effect on its attempt. **Applied.**
    async fn record_effect(&self, job_id: &str, record: EffectRecord) -> Result<(), StoreError>;
    /// The effects recorded for a job, in order. Committed state.
    async fn effects(&self, job_id: &str) -> Result<Vec<EffectRecord>, StoreError>;

    // Moving a ledger (`copy`). A backend that does not implement these
    // cannot be the source or the target of `khata store copy`.

    /// Up to `limit` records of the ledger from `cursor` (`None`: the
    /// start) in [`copy::Section`] order, and where the next page starts
    /// (`None` after the counters, the last record). Committed state; each
    /// page is read in one snapshot, and the pages are consistent with one
    /// another only while nothing writes to the ledger.
    async fn export(&self, cursor: Option<copy::Cursor>, limit: u32) -> Result<copy::ExportPage> {
        let _ = (cursor, limit);
        Err(copy::unsupported("export"))
    }

    /// Writes `records` (pages of another ledger's export, in export order)
    /// into this ledger, all or none, refusing a record whose key is already
    /// there; advances the fencing token and the enqueue sequence past every
    /// one the records hold, so that neither is ever issued twice. For a
    /// copy into an empty ledger: it does not merge. **Durable.**
    async fn import(&self, records: Vec<copy::Record>) -> Result<(), StoreError> {
        let _ = records;
        Err(copy::unsupported("import"))
    }

    // Several daemons on one store. The defaults are those of a store that
    // one daemon owns (SQLite's lock file): its leases last until the
    // attempt ends, and `recover` at start reclaims every active job.

    /// Renews this daemon's live leases for another lease period and returns
    /// the leases it held that are lost (expired, or taken over), so that
    /// their attempts are stopped: every effect of theirs is already refused
    /// as `Fenced`. **Durable.**
    async fn heartbeat(&self) -> Result<Vec<LeaseRef>, StoreError> {
        Ok(Vec::new())
    }

    /// The leases this daemon holds that have surely expired by now because
    /// no heartbeat renewed them in time (the store could not be reached),
    /// without asking the store; each is reported once, as `heartbeat`
    /// reports lost leases, so that its attempt is stopped: the store will
    /// refuse its effects and its finish whenever it answers again.
    fn leases_past_expiry(&self) -> Vec<LeaseRef> {
        Vec::new()
    }

    /// Reclaims up to a bounded number of jobs whose lease expired: each
    /// attempt is closed as abandoned (counted), each job goes back to
    /// waiting at `now`, or to dead when its budget is used up. Returns how
    /// many jobs were reclaimed; the caller repeats until it returns 0.
    /// **Durable.**
    async fn reclaim_expired(&self, now: Millis) -> Result<u64, StoreError> {
        let _ = now;
        Ok(0)
    }

    /// The names of queues that may have ready jobs because another daemon
    /// enqueued, retried or reclaimed them; `None` for a store that one
    /// daemon owns (it wakes its own queues). The stream may lose names (a
    /// dropped connection): the caller keeps a slow poll as well.
    fn wakeups(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<String>> {
        None
    }

    /// Why the store stopped taking writes for good, if it did: an embedded
    /// ledger whose commit (or flush) failed cannot know what reached the
    /// disk, refuses every later step, and says so here, so that the daemon
    /// exits and recovery starts from what is durable ([`Halt`]).
    fn halted(&self) -> Option<String> {
        None
    }
}
