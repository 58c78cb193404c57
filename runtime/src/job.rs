//! The job and its life cycle: the types every layer shares.
//!
//! A job moves through these states (docs/jobs.md#life-cycle); each says who moves it next:
//!
//! ```text
//!            enqueue                lease (dispatcher)          Ok(result)
//!  producer ─────────► waiting ───────────────────────► active ───────────► completed
//!                        ▲  ▲ run_at reached               │ │ retry/trap/timeout
//!                        │  └──────── delayed ◄────────────┘ │ (budget left)
//!                        │                                   │ fail, or budget used up
//!           retry (operator)                                 ▼
//!                        └───────────────────────────────── dead
//!  waiting / delayed / active ── cancel (operator) ──► cancelled ── retry ──► waiting
//! ```
//!
//! `delayed` is not stored: a waiting job whose `run_at` lies in the future is
//! delayed, so a job becomes ready by the clock alone, with no write.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The most attempts a job may be given (`max_attempts`, in jobs.toml and
/// on enqueue).
pub const MAX_ATTEMPTS: u32 = 1000;

/// The prefix of the ids schedules give the jobs they enqueue
/// (`schedule:<name>:<time>`); the API refuses it in a caller's id.
pub const SCHEDULE_ID_PREFIX: &str = "schedule:";

/// Whether `s` holds a control character (C0, DEL or C1), which ids and
/// keys refuse: they reach logs and terminals.
pub fn has_control(s: &str) -> bool {
    s.chars().any(char::is_control)
}

/// Milliseconds since the Unix epoch: the store's one unit of time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Millis(pub i64);

impl Millis {
    pub fn now() -> Millis {
        Millis::from(SystemTime::now())
    }

    /// The latest time a job may be due: 9999-12-31T23:59:59.999Z, the
    /// last an RFC 3339 time can say.
    pub const LATEST: Millis = Millis(253_402_300_799_999);

    pub fn plus(self, d: Duration) -> Millis {
        Millis(
            self.0
                .saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        )
    }

    pub fn minus(self, d: Duration) -> Millis {
        Millis(
            self.0
                .saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        )
    }

    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(u64::try_from(self.0).unwrap_or(0))
    }

    /// RFC 3339 with millisecond precision, in UTC.
    /// The time as RFC 3339. Cannot fail: a time before 1970 or past
    /// [`Millis::LATEST`] (which no API or configuration lets in) is shown
    /// as that bound.
    pub fn rfc3339(self) -> String {
        let shown = Millis(self.0.clamp(0, Millis::LATEST.0));
        humantime::format_rfc3339_millis(shown.to_system_time()).to_string()
    }

    pub fn parse_rfc3339(s: &str) -> Option<Millis> {
        humantime::parse_rfc3339_weak(s).ok().map(Millis::from)
    }
}

impl From<SystemTime> for Millis {
    fn from(t: SystemTime) -> Millis {
        let ms = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        Millis(i64::try_from(ms).unwrap_or(i64::MAX))
    }
}

/// The stored and reported states of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Ready to be leased once `run_at` is reached. Moved by the dispatcher.
    Waiting,
    /// Waiting with `run_at` in the future (derived, never stored).
    Delayed,
    /// Leased to one attempt. Moved by that attempt's end, by a cancel, or by
    /// crash recovery at the next start.
    Active,
    /// Finished with a result. Final until retention removes it.
    Completed,
    /// Dead-lettered: failed permanently or out of attempts. Moved only by an
    /// operator's retry.
    Dead,
    /// Cancelled by an operator. Moved only by an operator's retry.
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Waiting,
        JobState::Delayed,
        JobState::Active,
        JobState::Completed,
        JobState::Dead,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Waiting => "waiting",
            JobState::Delayed => "delayed",
            JobState::Active => "active",
            JobState::Completed => "completed",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }

    /// A live job holds its dedup key.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            JobState::Waiting | JobState::Delayed | JobState::Active
        )
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobState {
    type Err = String;
    fn from_str(s: &str) -> Result<JobState, String> {
        JobState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown state {s:?}: expected one of waiting, delayed, active, completed, dead, cancelled"
                )
            })
    }
}

/// A job to be enqueued, validated by the caller.
#[derive(Clone, Debug, PartialEq)]
pub struct NewJob {
    pub queue: String,
    /// Caller-chosen id; a fresh one is made when absent.
    pub id: Option<String>,
    /// Canonical JSON text (object keys sorted), so that "the same payload"
    /// is a byte comparison.
    pub payload: String,
    pub priority: i32,
    pub run_at: Millis,
    pub max_attempts: u32,
    pub dedup_key: Option<String>,
    /// Holds the dedup key this long after enqueue, whatever the job's state.
    pub dedup_for: Option<Duration>,
}

/// The answer to one enqueue.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Enqueued {
    pub job: Job,
    pub deduplicated: bool,
}

/// A job as stored, with its history.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Job {
    pub id: String,
    pub queue: String,
    pub state: JobState,
    /// Canonical JSON text of the payload.
    pub payload: String,
    pub priority: i32,
    /// The number of the latest delivery (0 before the first).
    pub attempt: u32,
    /// Deliveries that counted toward `max_attempts` since the last manual retry.
    pub budget_used: u32,
    pub max_attempts: u32,
    pub dedup_key: Option<String>,
    pub run_at: Millis,
    pub enqueued_at: Millis,
    pub finished_at: Option<Millis>,
    /// JSON text of the handler's result.
    pub result: Option<String>,
    pub last_error: Option<String>,
    /// Filled by `Store::job`; empty in listings.
    pub attempts: Vec<Attempt>,
}

/// How one attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttemptOutcome {
    /// Still running (or never ended, until recovery marks it abandoned).
    Running,
    Completed,
    /// The handler asked for a retry.
    Retry,
    /// The handler failed permanently.
    Failed,
    /// The guest trapped (panic, stack overflow, out of memory, bad result).
    Trapped,
    /// The attempt ran past the queue's timeout.
    Timeout,
    /// The daemon died during the attempt; counted toward `max_attempts`.
    Abandoned,
    /// Stopped by a shutdown; not counted.
    Interrupted,
    /// Stopped because an operator cancelled the job.
    Cancelled,
    /// The queue's plugin could not be instantiated.
    Error,
}

impl AttemptOutcome {
    pub const ALL: [AttemptOutcome; 10] = [
        AttemptOutcome::Running,
        AttemptOutcome::Completed,
        AttemptOutcome::Retry,
        AttemptOutcome::Failed,
        AttemptOutcome::Trapped,
        AttemptOutcome::Timeout,
        AttemptOutcome::Abandoned,
        AttemptOutcome::Interrupted,
        AttemptOutcome::Cancelled,
        AttemptOutcome::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Running => "running",
            AttemptOutcome::Completed => "completed",
            AttemptOutcome::Retry => "retry",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Trapped => "trapped",
            AttemptOutcome::Timeout => "timeout",
            AttemptOutcome::Abandoned => "abandoned",
            AttemptOutcome::Interrupted => "interrupted",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<AttemptOutcome> {
        AttemptOutcome::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// One delivery of a job to its handler.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Attempt {
    pub number: u32,
    pub fencing_token: u64,
    pub started_at: Millis,
    pub ended_at: Option<Millis>,
    pub outcome: AttemptOutcome,
    pub error: Option<String>,
    /// The content hash of the plugin version the attempt ran on (`None`
    /// for attempts recorded before versions were).
    pub plugin_version: Option<String>,
}

/// The right of one attempt to run a job and perform its effects.
///
/// Invariant: `token` is unique daemon-wide and larger than every token
/// issued before it; the job holds the lease while its stored token equals
/// this one and it is `active`.
#[derive(Clone, Debug, PartialEq)]
pub struct Lease {
    pub job_id: String,
    pub queue: String,
    pub payload: String,
    pub attempt: u32,
    pub max_attempts: u32,
    pub enqueued_at: Millis,
    pub token: u64,
}

impl Lease {
    pub fn fence(&self) -> LeaseRef {
        LeaseRef {
            job_id: self.job_id.clone(),
            attempt: self.attempt,
            token: self.token,
        }
    }
}

/// What an effect or an attempt's end names to prove it holds the lease:
/// the job, the attempt (its number, from 1) and the attempt's token.
///
/// Invariant: `attempt` is the number of the attempt `token` was issued to,
/// so that a fence records the attempt of the lease that took it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaseRef {
    pub job_id: String,
    pub attempt: u32,
    pub token: u64,
}

/// How an attempt asks the store to move its job.
#[derive(Clone, Debug, PartialEq)]
pub enum Finish {
    Completed {
        result: String,
    },
    /// Back to waiting at `run_at`, or dead when the budget is used up.
    Retry {
        outcome: AttemptOutcome,
        error: String,
        run_at: Millis,
    },
    /// Dead at once.
    Fail {
        outcome: AttemptOutcome,
        error: String,
    },
    /// Back to waiting now, not counted (a shutdown stopped the attempt).
    Interrupted {
        error: String,
    },
}

/// Counts of a queue's jobs by state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StateCounts {
    pub waiting: u64,
    pub delayed: u64,
    pub active: u64,
    pub completed: u64,
    pub dead: u64,
    pub cancelled: u64,
}

impl StateCounts {
    pub fn add(&mut self, state: JobState, n: u64) {
        match state {
            JobState::Waiting => self.waiting += n,
            JobState::Delayed => self.delayed += n,
            JobState::Active => self.active += n,
            JobState::Completed => self.completed += n,
            JobState::Dead => self.dead += n,
            JobState::Cancelled => self.cancelled += n,
        }
    }

    pub fn get(&self, state: JobState) -> u64 {
        match state {
            JobState::Waiting => self.waiting,
            JobState::Delayed => self.delayed,
            JobState::Active => self.active,
            JobState::Completed => self.completed,
            JobState::Dead => self.dead,
            JobState::Cancelled => self.cancelled,
        }
    }
}

/// Canonical JSON text of a value: object keys sorted, no whitespace.
/// Whether two stored payloads are the same JSON: the same text, or texts
/// that parse to equal values (another key order or spacing). An enqueue
/// whose id is taken deduplicates only onto the same payload.
pub fn same_payload(a: &str, b: &str) -> bool {
    a == b
        || match (
            serde_json::from_str::<serde_json::Value>(a),
            serde_json::from_str::<serde_json::Value>(b),
        ) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
}

pub fn canonical_json(v: &serde_json::Value) -> String {
    // serde_json's map is ordered by key unless `preserve_order` is enabled,
    // which this crate does not enable.
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned())
}
