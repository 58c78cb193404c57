//! Moving a ledger from one backend to another (`khata store copy`).
//!
//! A backend writes its ledger out as [`Record`]s with [`Store::export`], a
//! page at a time, and reads them in with [`Store::import`]. The records are
//! the same whatever the backend: jobs (with every attempt and recorded
//! effect), dedup keys, fences (state, fingerprint, recorded result, the
//! attempt that wrote them), kv entries, index documents (tombstones too),
//! and last the [`Counters`] a backend must go on from, so that a fencing
//! token or an enqueue sequence number is never issued twice.
//!
//! An export walks the sections in the order of [`Section`], each in the
//! backend's key order; the [`Cursor`] names the section and the key of the
//! last record given, so that the next page starts after it. The ledger
//! must not change while it is exported (the copy holds its lock, or
//! refuses a source with active jobs).
//!
//! [`copy`] moves every record into an empty target and then verifies:
//! it walks both ledgers again and compares, section by section, the counts
//! (jobs and fences by state, attempts, effects, dedup keys, kv entries,
//! index documents) and an order-independent digest of the records.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{EffectRecord, FenceState, Store, StoreError};
use crate::job::{AttemptOutcome, JobState, Millis};

/// The parts of a ledger, in export order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    Jobs,
    Dedup,
    Fences,
    Kv,
    Index,
    Counters,
}

impl Section {
    /// The section after this one; `None` after the counters.
    pub fn next(self) -> Option<Section> {
        match self {
            Section::Jobs => Some(Section::Dedup),
            Section::Dedup => Some(Section::Fences),
            Section::Fences => Some(Section::Kv),
            Section::Kv => Some(Section::Index),
            Section::Index => Some(Section::Counters),
            Section::Counters => None,
        }
    }
}

/// Where an export goes on: in `section`, after the record whose key is
/// `after` (the parts of its primary key; empty: from the section's start).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub section: Section,
    pub after: Vec<String>,
}

impl Cursor {
    /// The start of the export.
    pub fn start() -> Cursor {
        Cursor {
            section: Section::Jobs,
            after: Vec::new(),
        }
    }

    /// The cursor after a page of `section` that held `n` records of at
    /// most `limit`, the last one keyed `last`: the same section after
    /// `last` when the page was full, else the next section's start.
    /// The counters are one record, the last: nothing follows them.
    pub fn after_page(section: Section, n: usize, limit: u32, last: Vec<String>) -> Option<Cursor> {
        if section != Section::Counters && n > 0 && n >= limit as usize {
            return Some(Cursor {
                section,
                after: last,
            });
        }
        section.next().map(|section| Cursor {
            section,
            after: Vec::new(),
        })
    }

    /// The `i`th part of `after`, or an error naming the section.
    pub fn key(&self, i: usize) -> Result<&str, StoreError> {
        self.after.get(i).map(String::as_str).ok_or_else(|| {
            StoreError::Unavailable(format!(
                "export cursor of section {:?} has {} key parts, wanted at least {}",
                self.section,
                self.after.len(),
                i + 1
            ))
        })
    }
}

/// What an export page is asked for, made whole: `None` is the start, and
/// a page holds 1 to 10,000 records.
pub fn page_request(cursor: Option<Cursor>, limit: u32) -> (Cursor, u32) {
    (cursor.unwrap_or_else(Cursor::start), limit.clamp(1, 10_000))
}

/// The query of one export page of a section keyed by `keys`: `select`
/// (`SELECT ... FROM table`) with the rows after `after` in key order, at
/// most as many as the last parameter says. The parameters are the parts of
/// `after`, then the limit; `placeholder(i)` writes the `i`th (from 1).
pub fn page_sql(
    select: &str,
    keys: &[&str],
    after: &[String],
    placeholder: impl Fn(usize) -> String,
) -> Result<String, StoreError> {
    let order = keys.join(", ");
    let mut sql = select.to_owned();
    if !after.is_empty() {
        if after.len() != keys.len() {
            return Err(StoreError::Unavailable(format!(
                "export cursor has {} key parts where ({order}) has {}",
                after.len(),
                keys.len()
            )));
        }
        let params: Vec<String> = (1..=after.len()).map(&placeholder).collect();
        sql.push_str(&format!(" WHERE ({order}) > ({})", params.join(", ")));
    }
    sql.push_str(&format!(
        " ORDER BY {order} LIMIT {}",
        placeholder(after.len() + 1)
    ));
    Ok(sql)
}

/// One page of an export.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExportPage {
    pub records: Vec<Record>,
    /// Where the next page starts; `None` when the export is complete.
    pub next: Option<Cursor>,
}

/// One attempt of a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub number: u32,
    pub token: u64,
    pub started_at: Millis,
    pub ended_at: Option<Millis>,
    pub outcome: AttemptOutcome,
    pub error: Option<String>,
    #[serde(default)]
    pub plugin_version: Option<String>,
}

/// A job as stored: its stored state (never `delayed`, which is derived),
/// its place in the enqueue order, its lease and its history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: String,
    pub queue: String,
    pub state: JobState,
    pub payload: String,
    pub priority: i32,
    pub run_at: Millis,
    /// The enqueue sequence number (FIFO among equals).
    pub seq: u64,
    pub attempt: u32,
    pub budget_used: u32,
    pub max_attempts: u32,
    pub dedup_key: Option<String>,
    pub enqueued_at: Millis,
    pub finished_at: Option<Millis>,
    pub result: Option<String>,
    pub last_error: Option<String>,
    pub lease_token: Option<u64>,
    /// In order of number.
    pub attempts: Vec<AttemptRecord>,
    /// In the order recorded.
    pub effects: Vec<EffectRecord>,
}

impl JobRecord {
    /// The state to store: `delayed` is derived from `run_at`, never
    /// stored, so an exported `delayed` is stored `waiting`.
    pub fn stored_state(&self) -> JobState {
        if self.state == JobState::Delayed {
            JobState::Waiting
        } else {
            self.state
        }
    }

    /// The job's effects, each with its number within its attempt (from 1,
    /// in the order recorded), as a backend that keys effects by (attempt,
    /// n) stores them.
    pub fn numbered_effects(&self) -> Vec<(u32, &EffectRecord)> {
        let mut next: BTreeMap<u32, u32> = BTreeMap::new();
        self.effects
            .iter()
            .map(|e| {
                let n = next.entry(e.attempt).or_default();
                *n += 1;
                (*n, e)
            })
            .collect()
    }
}

/// A dedup key and the job it points at (which may be gone while
/// `hold_until` holds the key).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DedupRecord {
    pub queue: String,
    pub key: String,
    pub job_id: String,
    pub hold_until: Option<Millis>,
}

/// A fence, as [`super::Fence`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FenceRecord {
    pub namespace: String,
    pub kind: String,
    pub key: String,
    pub state: FenceState,
    pub fingerprint: Vec<u8>,
    pub job_id: String,
    pub attempt: u32,
    pub token: u64,
    pub result: Option<Vec<u8>>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvRecord {
    pub namespace: String,
    pub key: String,
    pub value: Vec<u8>,
    /// The entry's last write, from which `[retention] kv` counts.
    pub written_at: Millis,
}

/// An index document; `document: None` is a tombstone that keeps its version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexRecord {
    pub collection: String,
    pub id: String,
    pub version: u64,
    pub document: Option<String>,
    pub updated_at: Millis,
}

/// What a backend must continue from: the highest fencing token and the
/// highest enqueue sequence number it ever issued (not only those still
/// stored: a swept job's token must not come back either).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub fencing_token: u64,
    pub enqueue_seq: u64,
}

/// One record of a ledger.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Job(JobRecord),
    Dedup(DedupRecord),
    Fence(FenceRecord),
    Kv(KvRecord),
    Index(IndexRecord),
    Counters(Counters),
}

impl Record {
    /// The highest fencing token and enqueue sequence number this record
    /// holds, which an import must advance its counters past.
    pub fn counters(&self) -> Counters {
        match self {
            Record::Job(j) => Counters {
                fencing_token: j
                    .attempts
                    .iter()
                    .map(|a| a.token)
                    .chain(j.lease_token)
                    .max()
                    .unwrap_or(0),
                enqueue_seq: j.seq,
            },
            Record::Fence(f) => Counters {
                fencing_token: f.token,
                enqueue_seq: 0,
            },
            Record::Counters(c) => *c,
            Record::Dedup(_) | Record::Kv(_) | Record::Index(_) => Counters::default(),
        }
    }

    /// The parts of the record's key, in the order its section pages by:
    /// a page that ends with it goes on after this key.
    pub fn key(&self) -> Vec<String> {
        match self {
            Record::Job(j) => vec![j.id.clone()],
            Record::Dedup(d) => vec![d.queue.clone(), d.key.clone()],
            Record::Fence(f) => vec![f.namespace.clone(), f.kind.clone(), f.key.clone()],
            Record::Kv(k) => vec![k.namespace.clone(), k.key.clone()],
            Record::Index(i) => vec![i.collection.clone(), i.id.clone()],
            Record::Counters(_) => Vec::new(),
        }
    }

    /// What the record is, for messages: `job "x"`, `fence ns/http/key`, ...
    pub fn describe(&self) -> String {
        match self {
            Record::Job(j) => format!("job {:?}", j.id),
            Record::Dedup(d) => format!("dedup key {:?} of queue {:?}", d.key, d.queue),
            Record::Fence(f) => format!("fence {}/{}/{}", f.namespace, f.kind, f.key),
            Record::Kv(k) => format!("kv entry {:?} of namespace {:?}", k.key, k.namespace),
            Record::Index(i) => {
                format!("index document {:?} of collection {:?}", i.id, i.collection)
            }
            Record::Counters(_) => "the counters".to_owned(),
        }
    }
}

impl Counters {
    /// The larger of each counter.
    pub fn max(self, other: Counters) -> Counters {
        Counters {
            fencing_token: self.fencing_token.max(other.fencing_token),
            enqueue_seq: self.enqueue_seq.max(other.enqueue_seq),
        }
    }

    /// The counters an import of `records` must advance past.
    pub fn of(records: &[Record]) -> Counters {
        records
            .iter()
            .fold(Counters::default(), |c, r| c.max(r.counters()))
    }
}

/// The error of a backend without export or import.
/// The error of an export that found a stored row it cannot read.
pub fn unreadable(what: String) -> StoreError {
    StoreError::Unavailable(format!("cannot export {what}"))
}

impl ExportPage {
    /// The page of `records` read from `cursor` with `limit`: a full page
    /// goes on after its last record, a short one at the next section.
    pub fn of(cursor: &Cursor, limit: u32, records: Vec<Record>) -> ExportPage {
        let last = records.last().map(Record::key).unwrap_or_default();
        let next = Cursor::after_page(cursor.section, records.len(), limit, last);
        ExportPage { records, next }
    }
}

impl FenceRecord {
    /// The record of stored fence `f`, whose state column holds `state`: a
    /// state this build does not know refuses the export rather than copy
    /// a fence as something it is not.
    pub fn exported(f: super::Fence, state: &str) -> Result<FenceRecord, StoreError> {
        let state = FenceState::parse(state).ok_or_else(|| {
            unreadable(format!(
                "fence {}/{}/{}: unknown state {state:?}",
                f.id.namespace, f.id.kind, f.id.key
            ))
        })?;
        Ok(FenceRecord {
            namespace: f.id.namespace,
            kind: f.id.kind,
            key: f.id.key,
            state,
            fingerprint: f.fingerprint,
            job_id: f.job_id,
            attempt: f.attempt,
            token: f.token,
            result: f.result,
            created_at: f.created_at,
            updated_at: f.updated_at,
        })
    }
}

pub fn unsupported(what: &str) -> StoreError {
    StoreError::Unavailable(format!(
        "this backend cannot {what} its ledger (khata store copy does not support it yet)"
    ))
}

/// The error of an import that finds a record already there.
pub fn already_there(record: &Record) -> StoreError {
    StoreError::Unavailable(format!(
        "import refused: the target already holds {}; a copy needs an empty target",
        record.describe()
    ))
}

/// What a ledger holds, as the verification compares it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Jobs by stored state.
    pub jobs: BTreeMap<String, u64>,
    pub attempts: u64,
    pub effects: u64,
    pub dedup_keys: u64,
    /// Fences by state.
    pub fences: BTreeMap<String, u64>,
    pub kv: u64,
    pub index: u64,
    pub counters: Counters,
    /// XOR of the SHA-256 of each record (not the counters), so that two
    /// ledgers holding the same records agree whatever their key order.
    pub digest: [u8; 32],
}

impl Summary {
    fn add(&mut self, record: &Record) -> Result<(), StoreError> {
        match record {
            Record::Job(j) => {
                *self.jobs.entry(j.state.as_str().to_owned()).or_default() += 1;
                self.attempts += j.attempts.len() as u64;
                self.effects += j.effects.len() as u64;
            }
            Record::Dedup(_) => self.dedup_keys += 1,
            Record::Fence(f) => *self.fences.entry(f.state.as_str().to_owned()).or_default() += 1,
            Record::Kv(_) => self.kv += 1,
            Record::Index(_) => self.index += 1,
            Record::Counters(c) => {
                self.counters = self.counters.max(*c);
                return Ok(());
            }
        }
        let bytes = serde_json::to_vec(record)
            .map_err(|e| StoreError::Unavailable(format!("{}: {e}", record.describe())))?;
        for (d, h) in self.digest.iter_mut().zip(Sha256::digest(&bytes)) {
            *d ^= h;
        }
        Ok(())
    }

    /// The number of jobs.
    pub fn job_count(&self) -> u64 {
        self.jobs.values().sum()
    }

    /// The number of fences.
    pub fn fence_count(&self) -> u64 {
        self.fences.values().sum()
    }

    /// How `target` differs from `self` (the source), one line each; empty
    /// when it holds the same records and counters no lower.
    pub fn differences(&self, target: &Summary) -> Vec<String> {
        let mut out = Vec::new();
        let mut same = |what: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{what}: source {a}, target {b}"));
            }
        };
        same(
            "jobs by state",
            by_state(&self.jobs),
            by_state(&target.jobs),
        );
        same(
            "attempts",
            self.attempts.to_string(),
            target.attempts.to_string(),
        );
        same(
            "effects",
            self.effects.to_string(),
            target.effects.to_string(),
        );
        same(
            "dedup keys",
            self.dedup_keys.to_string(),
            target.dedup_keys.to_string(),
        );
        same(
            "fences by state",
            by_state(&self.fences),
            by_state(&target.fences),
        );
        same("kv entries", self.kv.to_string(), target.kv.to_string());
        same(
            "index documents",
            self.index.to_string(),
            target.index.to_string(),
        );
        if out.is_empty() && self.digest != target.digest {
            out.push("the records' contents differ (digests of the records are not equal)".into());
        }
        if target.counters.fencing_token < self.counters.fencing_token {
            out.push(format!(
                "fencing token: source {}, target {} (lower)",
                self.counters.fencing_token, target.counters.fencing_token
            ));
        }
        if target.counters.enqueue_seq < self.counters.enqueue_seq {
            out.push(format!(
                "enqueue sequence: source {}, target {} (lower)",
                self.counters.enqueue_seq, target.counters.enqueue_seq
            ));
        }
        out
    }
}

/// `completed 3, dead 1`, or `none`.
pub fn by_state(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  jobs          {:>8}  ({})",
            self.job_count(),
            by_state(&self.jobs)
        )?;
        writeln!(f, "  attempts      {:>8}", self.attempts)?;
        writeln!(f, "  effects       {:>8}", self.effects)?;
        writeln!(f, "  dedup keys    {:>8}", self.dedup_keys)?;
        writeln!(
            f,
            "  fences        {:>8}  ({})",
            self.fence_count(),
            by_state(&self.fences)
        )?;
        writeln!(f, "  kv entries    {:>8}", self.kv)?;
        writeln!(f, "  index docs    {:>8}", self.index)?;
        write!(
            f,
            "  counters      fencing token {}, enqueue sequence {}",
            self.counters.fencing_token, self.counters.enqueue_seq
        )
    }
}

/// Walks the whole export of `store` in pages of `page` records, calling
/// `each` with every page.
pub async fn walk(
    store: &dyn Store,
    page: u32,
    mut each: impl FnMut(Vec<Record>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut cursor = Some(Cursor::start());
    while let Some(c) = cursor {
        let section = c.section;
        let p = store.export(Some(c.clone()), page).await?;
        if p.next.as_ref().is_some_and(|n| *n == c) {
            return Err(StoreError::Unavailable(format!(
                "the export of section {section:?} does not advance"
            )));
        }
        cursor = p.next;
        each(p.records)?;
    }
    Ok(())
}

/// Counts and digests what `store` holds.
pub async fn summarize(store: &dyn Store, page: u32) -> Result<Summary, StoreError> {
    let mut s = Summary::default();
    walk(store, page, |records| {
        records.iter().try_for_each(|r| s.add(r))
    })
    .await?;
    Ok(s)
}

/// The first record of `store` that is not its counters, if any: a ledger
/// without one is empty.
pub async fn first_record(store: &dyn Store) -> Result<Option<Record>, StoreError> {
    let mut cursor = Some(Cursor::start());
    while let Some(c) = cursor {
        let p = store.export(Some(c), 1).await?;
        if let Some(r) = p
            .records
            .into_iter()
            .find(|r| !matches!(r, Record::Counters(_)))
        {
            return Ok(Some(r));
        }
        cursor = p.next;
    }
    Ok(None)
}

/// Why a copy stopped.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("the target is not empty: it holds {0}, and a copy only goes into an empty ledger")]
    TargetNotEmpty(String),
    #[error("{0}")]
    Store(#[from] StoreError),
    /// Everything was copied, but the two sides do not agree.
    #[error("verification failed: {}", .0.join("; "))]
    Mismatch(Vec<String>),
}

/// What a copy moved: the source's and the target's summaries, equal.
#[derive(Clone, Debug)]
pub struct Copied {
    pub source: Summary,
    pub target: Summary,
}

/// Copies every record of `from` into `to`, which must be empty, in pages
/// of `page` records, then verifies that both hold the same. Each imported
/// page is durable in `to` when its import returns; `progress` hears the
/// number of records copied so far after each page.
pub async fn copy(
    from: &dyn Store,
    to: &dyn Store,
    page: u32,
    mut progress: impl FnMut(u64),
) -> Result<Copied, CopyError> {
    if let Some(r) = first_record(to).await? {
        return Err(CopyError::TargetNotEmpty(r.describe()));
    }
    let page = page.max(1);
    let mut copied = 0u64;
    let mut cursor = Some(Cursor::start());
    while let Some(c) = cursor {
        let p = from.export(Some(c.clone()), page).await?;
        if p.next.as_ref().is_some_and(|n| *n == c) {
            return Err(StoreError::Unavailable(format!(
                "the export of section {:?} does not advance",
                c.section
            ))
            .into());
        }
        cursor = p.next;
        if p.records.is_empty() {
            continue;
        }
        copied += p.records.len() as u64;
        to.import(p.records).await?;
        progress(copied);
    }
    let source = summarize(from, page).await?;
    let target = summarize(to, page).await?;
    let diff = source.differences(&target);
    if !diff.is_empty() {
        return Err(CopyError::Mismatch(diff));
    }
    Ok(Copied { source, target })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_move_on_by_section() {
        let full = Cursor::after_page(Section::Kv, 2, 2, vec!["ns".into(), "k".into()]);
        assert_eq!(
            full,
            Some(Cursor {
                section: Section::Kv,
                after: vec!["ns".into(), "k".into()]
            })
        );
        let short = Cursor::after_page(Section::Kv, 1, 2, vec!["ns".into(), "k".into()]);
        assert_eq!(
            short,
            Some(Cursor {
                section: Section::Index,
                after: vec![]
            })
        );
        assert_eq!(Cursor::after_page(Section::Counters, 1, 1, vec![]), None);
    }

    #[test]
    fn the_digest_ignores_order_and_sees_contents() {
        let kv = |k: &str, v: &[u8]| {
            Record::Kv(KvRecord {
                namespace: "n".into(),
                key: k.into(),
                value: v.to_vec(),
                written_at: Millis(1),
            })
        };
        let (mut a, mut b, mut c) = (Summary::default(), Summary::default(), Summary::default());
        for r in [kv("x", b"1"), kv("y", b"2")] {
            a.add(&r).unwrap();
        }
        for r in [kv("y", b"2"), kv("x", b"1")] {
            b.add(&r).unwrap();
        }
        for r in [kv("x", b"1"), kv("y", b"3")] {
            c.add(&r).unwrap();
        }
        assert!(a.differences(&b).is_empty());
        assert_eq!(
            a.differences(&c),
            vec!["the records' contents differ (digests of the records are not equal)"]
        );
    }
}
