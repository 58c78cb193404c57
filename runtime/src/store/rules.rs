//! The rules every backend applies, written once: what a finish does to a
//! job, what recovery does to an attempt the daemon lost, what
//! `fence_begin` answers, who may move a started fence, and what state a
//! reader sees. Each is a pure function of what the backend loaded; the
//! backend only loads, locks and writes what the rule decided (as River's
//! driver is handed a completed, retryable or discarded job and decides
//! nothing). So a change to what a finish does is made here, and the
//! conformance suite checks that every backend writes it.

use crate::job::{AttemptOutcome, Enqueued, Finish, Job, JobState, LeaseRef, Millis, NewJob};

use super::{Fence, FenceBegin, FenceId, FenceState, StoreError, UpsertOutcome};

/// The error of an attempt that recovery closed: the daemon that ran it
/// stopped (crash, `kill -9`, power loss).
pub const ABANDONED: &str = "abandoned: the daemon stopped during this attempt";

/// The error of an attempt whose lease expired on a shared store before it
/// ended: another daemon may have reclaimed its job.
pub const LEASE_EXPIRED: &str =
    "abandoned: its lease expired (the daemon holding it stopped renewing it)";

/// The state a reader sees of a stored state: a waiting job whose `run_at`
/// is in the future is delayed. (`delayed` is never stored.)
pub fn visible_state(stored: JobState, run_at: Millis, now: Millis) -> JobState {
    if stored == JobState::Waiting && run_at > now {
        JobState::Delayed
    } else {
        stored
    }
}

/// A stored state's text read back; text no version wrote reads as dead,
/// so that a job nobody understands is never run.
pub fn stored_state(s: &str) -> JobState {
    s.parse().unwrap_or(JobState::Dead)
}

/// Whether `lease` holds a job stored as `state` under `token`: it is
/// active under that very token. Every write an attempt makes checks this
/// first; a job cancelled, recovered or reclaimed meanwhile fails it.
pub fn holds(state: JobState, token: Option<u64>, lease: &LeaseRef) -> bool {
    state == JobState::Active && token == Some(lease.token)
}

/// The answer to a write by an attempt that no longer holds its job.
pub fn fenced(lease: &LeaseRef) -> StoreError {
    StoreError::Fenced {
        job_id: lease.job_id.clone(),
        token: lease.token,
    }
}

/// Whether a lease check's outcome says its holder is alive: `Ok` yes,
/// `Fenced` no, any other error is the store's and is passed on.
pub fn alive<T>(check: Result<T, StoreError>) -> Result<bool, StoreError> {
    match check {
        Ok(_) => Ok(true),
        Err(StoreError::Fenced { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What a finish found of its job, under the job's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub state: JobState,
    pub budget_used: u32,
    pub max_attempts: u32,
    /// Whether the finishing lease holds the job ([`holds`]).
    pub holds: bool,
    /// On a shared store: the lease held but expired before the finish (the
    /// store's clock says so). Always false on an embedded store.
    pub expired: bool,
}

/// What happens to the job, when anything does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// The stored state it moves to: `waiting`, `completed` or `dead`.
    pub state: JobState,
    /// For `waiting`: when it is due.
    pub run_at: Option<Millis>,
    /// For `completed`: the result, stored as given.
    pub result: Option<String>,
    /// The job's `last_error` from now on (None: left as it is).
    pub error: Option<String>,
    /// The attempt does not count toward `max_attempts` (a shutdown
    /// stopped it): `budget_used` goes down by one.
    pub refund: bool,
}

impl Move {
    /// The job ended (completed or dead): `finished_at` is set, the lease
    /// token cleared and its dedup key released (when nothing holds it).
    pub fn ends(&self) -> bool {
        !self.state.is_live()
    }

    /// The state the finish answers (a retry due later is delayed).
    pub fn answer(&self, now: Millis) -> JobState {
        match self.run_at {
            Some(at) => visible_state(self.state, at, now),
            None => self.state,
        }
    }
}

/// What a finish does: the attempt is closed as `outcome` with `error`
/// whatever else happens; `then` is what happens to the job, `None` when
/// the lease no longer holds it (the finish then answers [`fenced`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    pub outcome: AttemptOutcome,
    pub error: Option<String>,
    pub then: Option<Move>,
}

impl Ending {
    /// What `Store::finish` answers.
    pub fn answer(&self, lease: &LeaseRef, now: Millis) -> Result<JobState, StoreError> {
        self.then
            .as_ref()
            .map(|m| m.answer(now))
            .ok_or_else(|| fenced(lease))
    }
}

/// (docs/jobs.md#how-an-attempt-ends): a completion completes; a retry goes
/// back to waiting at its `run_at` while the attempt budget lasts and is
/// dead once it is used up; a failure is dead at once; an interrupted
/// attempt (a shutdown) goes back to waiting now and is not counted. A lease
/// that no longer holds its job changes nothing but its attempt, closed as
/// `cancelled` when the job was cancelled; a lease that expired before the
/// finish (shared stores) closes its attempt as abandoned and leaves the job
/// to be reclaimed like any expired lease.
pub fn finish(job: Held, finish: Finish, now: Millis) -> Ending {
    let (outcome, error) = match &finish {
        Finish::Completed { .. } => (AttemptOutcome::Completed, None),
        Finish::Retry { outcome, error, .. } | Finish::Fail { outcome, error } => {
            (*outcome, Some(error.clone()))
        }
        Finish::Interrupted { error } => (AttemptOutcome::Interrupted, Some(error.clone())),
    };
    if !job.holds {
        let outcome = if job.state == JobState::Cancelled {
            AttemptOutcome::Cancelled
        } else {
            outcome
        };
        return Ending {
            outcome,
            error,
            then: None,
        };
    }
    if job.expired {
        return Ending {
            outcome: AttemptOutcome::Abandoned,
            error: Some(format!(
                "{LEASE_EXPIRED}; the attempt ended as {} afterwards",
                outcome.as_str()
            )),
            then: None,
        };
    }
    let then = match finish {
        Finish::Completed { result } => Move {
            state: JobState::Completed,
            run_at: None,
            result: Some(result),
            error: None,
            refund: false,
        },
        Finish::Retry { error, run_at, .. } if job.budget_used < job.max_attempts => Move {
            state: JobState::Waiting,
            run_at: Some(run_at),
            result: None,
            error: Some(error),
            refund: false,
        },
        Finish::Retry { error, .. } => dead(budget_used_up(&error, job.max_attempts)),
        Finish::Fail { error, .. } => dead(error),
        Finish::Interrupted { error } => Move {
            state: JobState::Waiting,
            run_at: Some(now),
            result: None,
            error: Some(error),
            refund: true,
        },
    };
    Ending {
        outcome,
        error,
        then: Some(then),
    }
}

/// What recovery does to a job whose attempt was running when the daemon
/// stopped (or whose lease expired, with [`LEASE_EXPIRED`]): the attempt
/// counted, so the job waits again, due now, while its budget lasts, and is
/// dead once it is used up.
pub fn abandon(budget_used: u32, max_attempts: u32, error: &str, now: Millis) -> Move {
    if budget_used < max_attempts {
        Move {
            state: JobState::Waiting,
            run_at: Some(now),
            result: None,
            error: Some(error.to_owned()),
            refund: false,
        }
    } else {
        dead(budget_used_up(error, max_attempts))
    }
}

fn dead(error: String) -> Move {
    Move {
        state: JobState::Dead,
        run_at: None,
        result: None,
        error: Some(error),
        refund: false,
    }
}

fn budget_used_up(error: &str, max_attempts: u32) -> String {
    format!("{error} (attempt budget of {max_attempts} used up)")
}

/// What a backend stores of a fence, as the rules read it.
pub trait FenceRow {
    fn state(&self) -> FenceState;
    fn fingerprint(&self) -> &[u8];
    /// The attempt that wrote it last: its job and lease token.
    fn holder(&self) -> (&str, u64);
    /// That attempt's number.
    fn holder_attempt(&self) -> u32;
    fn into_fence(self) -> Fence;
}

impl FenceRow for Fence {
    fn state(&self) -> FenceState {
        self.state
    }
    fn fingerprint(&self) -> &[u8] {
        &self.fingerprint
    }
    fn holder(&self) -> (&str, u64) {
        (&self.job_id, self.token)
    }
    fn holder_attempt(&self) -> u32 {
        self.attempt
    }
    fn into_fence(self) -> Fence {
        self
    }
}

impl FenceRow for super::copy::FenceRecord {
    fn state(&self) -> FenceState {
        self.state
    }
    fn fingerprint(&self) -> &[u8] {
        &self.fingerprint
    }
    fn holder(&self) -> (&str, u64) {
        (&self.job_id, self.token)
    }
    fn holder_attempt(&self) -> u32 {
        self.attempt
    }
    fn into_fence(self) -> Fence {
        Fence {
            id: FenceId {
                namespace: self.namespace,
                kind: self.kind,
                key: self.key,
            },
            state: self.state,
            fingerprint: self.fingerprint,
            job_id: self.job_id,
            attempt: self.attempt,
            token: self.token,
            result: self.result,
            created_at: self.created_at,
            updated_at: self.updated_at,
        }
    }
}

/// What an enqueue answers for `job`, just stored as `id` at `now`: the
/// row as written, without reading it back.
pub fn created(id: String, job: NewJob, now: Millis) -> Enqueued {
    Enqueued {
        job: Job {
            id,
            state: visible_state(JobState::Waiting, job.run_at, now),
            queue: job.queue,
            payload: job.payload,
            priority: job.priority,
            attempt: 0,
            budget_used: 0,
            max_attempts: job.max_attempts,
            dedup_key: job.dedup_key,
            run_at: job.run_at,
            enqueued_at: now,
            finished_at: None,
            result: None,
            last_error: None,
            attempts: Vec::new(),
        },
        deduplicated: false,
    }
}

/// What an index upsert at `version` answers, given the stored row
/// (`Some((live, version))`; `live` is false for a tombstone): a higher
/// stored version, or a tombstone at this version, makes it `Stale`; the
/// same live version, `Unchanged`. Only `Inserted` and `Updated` write.
pub fn upsert(stored: Option<(bool, u64)>, version: u64) -> UpsertOutcome {
    match stored {
        Some((_, v)) if v > version => UpsertOutcome::Stale,
        Some((true, v)) if v == version => UpsertOutcome::Unchanged,
        Some((false, v)) if v == version => UpsertOutcome::Stale,
        Some((true, _)) => UpsertOutcome::Updated,
        Some((false, _)) | None => UpsertOutcome::Inserted,
    }
}

/// What an index removal at `version` does, given the stored row (as for
/// [`upsert`]): `None` when a higher version is stored (nothing changes),
/// else it writes a tombstone at `version` and answers whether a live
/// document was removed.
pub fn remove(stored: Option<(bool, u64)>, version: u64) -> Option<bool> {
    match stored {
        Some((_, v)) if v > version => None,
        Some((live, _)) => Some(live),
        None => Some(false),
    }
}

/// The holder of a fence as a lease, to check whether it still holds its
/// job ([`alive`]).
pub fn holder_lease(f: &impl FenceRow) -> LeaseRef {
    let (job_id, token) = f.holder();
    LeaseRef {
        job_id: job_id.to_owned(),
        attempt: f.holder_attempt(),
        token,
    }
}

fn is_mine(f: &impl FenceRow, lease: &LeaseRef) -> bool {
    f.holder() == (lease.job_id.as_str(), lease.token)
}

/// What `fence_begin` answers for a fence that exists, or that it must
/// first ask whether the fence's holder is alive ([`begin_if_alive`]).
/// (No fence at all: the backend writes a `started` one and answers
/// [`FenceBegin::Started`].)
#[derive(Debug)]
pub enum Begin<F> {
    Answer(FenceBegin),
    AskHolder(F),
}

/// The table of docs/fences.md#what-fence_begin-does: another request under the same key is `KeyReused`;
/// `done` replays its result; `uncertain` stays so until an operator
/// resolves it; `started` by this very attempt belongs to an earlier call
/// that ended without an outcome (a guest's host calls are sequential), so
/// it is abandoned; `started` by another attempt is in progress while that
/// attempt holds its job, and abandoned once it does not.
pub fn fence_begin<F: FenceRow>(f: F, lease: &LeaseRef, fingerprint: &[u8]) -> Begin<F> {
    if f.fingerprint() != fingerprint {
        return Begin::Answer(FenceBegin::KeyReused);
    }
    Begin::Answer(match f.state() {
        FenceState::Done => FenceBegin::Replay(f.into_fence().result.unwrap_or_default()),
        FenceState::Uncertain => FenceBegin::Uncertain(f.into_fence()),
        FenceState::Started if is_mine(&f, lease) => FenceBegin::Abandoned(f.into_fence()),
        FenceState::Started => return Begin::AskHolder(f),
    })
}

/// The answer for a fence another attempt started, once the backend knows
/// whether that attempt still holds its job.
pub fn begin_if_alive(f: impl FenceRow, alive: bool) -> FenceBegin {
    if alive {
        FenceBegin::InProgress {
            job_id: f.holder().0.to_owned(),
        }
    } else {
        FenceBegin::Abandoned(f.into_fence())
    }
}

/// Whether `lease` may move the fence it found (take it over, mark it done,
/// release it or mark it uncertain): it must be `started`, by `lease`
/// itself or by an attempt that died. Answers the fence, and whether the
/// backend must first check that its holder is dead ([`moved_if_dead`]).
pub fn may_move<F: FenceRow>(
    found: Option<F>,
    id: &FenceId,
    lease: &LeaseRef,
) -> Result<(F, bool), StoreError> {
    let f = found.ok_or_else(|| invalid_fence(id, "no such fence"))?;
    if f.state() != FenceState::Started {
        return Err(invalid_fence(
            id,
            format!("it is {}, not started", f.state().as_str()),
        ));
    }
    let ask = !is_mine(&f, lease);
    Ok((f, ask))
}

/// The refusal of a move on a fence whose holder is alive, or nothing.
pub fn moved_if_dead(f: &impl FenceRow, id: &FenceId, alive: bool) -> Result<(), StoreError> {
    if alive {
        Err(invalid_fence(
            id,
            format!("a live attempt of job {:?} holds it", f.holder().0),
        ))
    } else {
        Ok(())
    }
}

/// Whether an operator may resolve the fence found for `id`: `NotFound`
/// when there is none, refused when it is done (nothing to resolve).
/// Answers the fence, and whether the backend must first check that its
/// holder is dead ([`moved_if_dead`]): a `started` fence is resolvable only
/// once the attempt that wrote it died; an `uncertain` one always.
pub fn resolvable<F: FenceRow>(found: Option<F>, id: &FenceId) -> Result<(F, bool), StoreError> {
    let f = found.ok_or_else(|| {
        StoreError::NotFound(format!("fence {}/{}/{}", id.namespace, id.kind, id.key))
    })?;
    match f.state() {
        FenceState::Done => Err(invalid_fence(id, "it is done; there is nothing to resolve")),
        FenceState::Started => Ok((f, true)),
        FenceState::Uncertain => Ok((f, false)),
    }
}

/// A move that needs the fence held by `lease` itself (its own `done` or
/// `release` after a `started`): refused when another attempt took it over.
pub fn held_by(f: &impl FenceRow, id: &FenceId, lease: &LeaseRef) -> Result<(), StoreError> {
    if f.holder().1 == lease.token {
        Ok(())
    } else {
        Err(invalid_fence(id, "another attempt took it over"))
    }
}

/// A fence operation refused, naming the fence and why.
pub fn invalid_fence(id: &FenceId, reason: impl Into<String>) -> StoreError {
    StoreError::InvalidFence {
        namespace: id.namespace.clone(),
        kind: id.kind.clone(),
        key: id.key.clone(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Millis = Millis(1_000);

    fn lease(job: &str, token: u64) -> LeaseRef {
        LeaseRef {
            job_id: job.to_owned(),
            attempt: 1,
            token,
        }
    }

    fn held(state: JobState, used: u32, holds: bool, expired: bool) -> Held {
        Held {
            state,
            budget_used: used,
            max_attempts: 3,
            holds,
            expired,
        }
    }

    fn retry(at: Millis) -> Finish {
        Finish::Retry {
            outcome: AttemptOutcome::Failed,
            error: "e".into(),
            run_at: at,
        }
    }

    fn fail() -> Finish {
        Finish::Fail {
            outcome: AttemptOutcome::Failed,
            error: "e".into(),
        }
    }

    fn interrupted() -> Finish {
        Finish::Interrupted { error: "e".into() }
    }

    fn completed() -> Finish {
        Finish::Completed { result: "r".into() }
    }

    /// Every finish on a job its lease holds, within and past the budget
    /// of 3: the attempt's outcome, the job's new state, what the finish
    /// answers, its error and whether the attempt is refunded.
    #[test]
    fn every_finish_outcome_by_budget() {
        /// The finish, budget used, attempt outcome, new state, answer,
        /// error, refund.
        type Row = (
            Finish,
            u32,
            AttemptOutcome,
            JobState,
            JobState,
            Option<&'static str>,
            bool,
        );
        use JobState::*;
        let later = Millis(5_000);
        let e = Some("e");
        let used_up = Some("e (attempt budget of 3 used up)");
        #[rustfmt::skip]
        let table: Vec<Row> = vec![
            (completed(),     1, AttemptOutcome::Completed,   Completed, Completed, None,    false),
            (completed(),     3, AttemptOutcome::Completed,   Completed, Completed, None,    false),
            (retry(later),    1, AttemptOutcome::Failed,      Waiting,   Delayed,   e,       false),
            (retry(NOW),      2, AttemptOutcome::Failed,      Waiting,   Waiting,   e,       false),
            (retry(later),    3, AttemptOutcome::Failed,      Dead,      Dead,      used_up, false),
            (fail(),          1, AttemptOutcome::Failed,      Dead,      Dead,      e,       false),
            (fail(),          3, AttemptOutcome::Failed,      Dead,      Dead,      e,       false),
            (interrupted(),   1, AttemptOutcome::Interrupted, Waiting,   Waiting,   e,       true),
            (interrupted(),   3, AttemptOutcome::Interrupted, Waiting,   Waiting,   e,       true),
        ];
        for (finish, used, outcome, state, answer, error, refund) in table {
            let what = format!("{finish:?} with {used} of 3 used");
            let ending = super::finish(held(Active, used, true, false), finish, NOW);
            assert_eq!(ending.outcome, outcome, "{what}");
            let then = ending.then.clone().expect(&what);
            assert_eq!(then.state, state, "{what}");
            assert_eq!(then.error.as_deref(), error, "{what}");
            assert_eq!(then.refund, refund, "{what}");
            assert_eq!(then.ends(), !state.is_live(), "{what}");
            assert_eq!(then.result.is_some(), state == Completed, "{what}");
            assert_eq!(
                ending.answer(&lease("j", 1), NOW).unwrap(),
                answer,
                "{what}"
            );
        }
    }

    /// A lease that no longer holds its job moves nothing and is fenced;
    /// its attempt is closed as cancelled when the job was cancelled, as
    /// abandoned when the lease expired first, else as it ended.
    #[test]
    fn a_finish_without_the_job_moves_nothing() {
        for finish in [completed(), retry(NOW), fail(), interrupted()] {
            let own =
                super::finish(held(JobState::Active, 1, true, false), finish.clone(), NOW).outcome;
            for (job, outcome) in [
                (
                    held(JobState::Cancelled, 1, false, false),
                    AttemptOutcome::Cancelled,
                ),
                (held(JobState::Waiting, 1, false, false), own),
                (held(JobState::Active, 1, false, false), own),
                (
                    held(JobState::Active, 1, true, true),
                    AttemptOutcome::Abandoned,
                ),
            ] {
                let ending = super::finish(job, finish.clone(), NOW);
                assert_eq!(ending.outcome, outcome, "{finish:?} on {job:?}");
                assert_eq!(ending.then, None, "{finish:?} on {job:?}");
                assert!(
                    matches!(
                        ending.answer(&lease("j", 7), NOW),
                        Err(StoreError::Fenced { token: 7, .. })
                    ),
                    "{finish:?} on {job:?}"
                );
                if job.expired {
                    let error = ending.error.unwrap();
                    assert!(error.starts_with(LEASE_EXPIRED), "{error}");
                    assert!(
                        error.ends_with(&format!("ended as {} afterwards", own.as_str())),
                        "{error}"
                    );
                }
            }
        }
    }

    #[test]
    fn recovery_retries_within_the_budget_and_kills_past_it() {
        let back = abandon(2, 3, ABANDONED, NOW);
        assert_eq!((back.state, back.run_at), (JobState::Waiting, Some(NOW)));
        assert_eq!(back.error.as_deref(), Some(ABANDONED));
        let dead = abandon(3, 3, ABANDONED, NOW);
        assert_eq!((dead.state, dead.run_at), (JobState::Dead, None));
        assert_eq!(
            dead.error.as_deref().unwrap(),
            format!("{ABANDONED} (attempt budget of 3 used up)")
        );
        assert!(dead.ends() && !back.ends());
    }

    #[test]
    fn states_as_readers_see_them() {
        assert_eq!(
            visible_state(JobState::Waiting, Millis(1_001), NOW),
            JobState::Delayed
        );
        assert_eq!(
            visible_state(JobState::Waiting, NOW, NOW),
            JobState::Waiting
        );
        assert_eq!(
            visible_state(JobState::Active, Millis(9_999), NOW),
            JobState::Active
        );
        assert_eq!(stored_state("completed"), JobState::Completed);
        assert_eq!(stored_state("written by a later version"), JobState::Dead);
        let l = lease("j", 4);
        assert!(holds(JobState::Active, Some(4), &l));
        assert!(!holds(JobState::Active, Some(5), &l));
        assert!(!holds(JobState::Active, None, &l));
        assert!(!holds(JobState::Cancelled, Some(4), &l));
        assert!(alive(Ok(())).unwrap());
        assert!(!alive::<()>(Err(fenced(&l))).unwrap());
        assert!(alive::<()>(Err(StoreError::Unavailable("down".into()))).is_err());
    }

    fn fence(state: FenceState, job: &str, token: u64) -> Fence {
        Fence {
            id: id(),
            state,
            fingerprint: b"fp".to_vec(),
            job_id: job.to_owned(),
            attempt: 1,
            token,
            result: (state == FenceState::Done).then(|| b"done".to_vec()),
            created_at: NOW,
            updated_at: NOW,
        }
    }

    fn id() -> FenceId {
        FenceId {
            namespace: "n".into(),
            kind: "http".into(),
            key: "k".into(),
        }
    }

    /// What `fence_begin` answers, for every stored state and every
    /// caller: the attempt that wrote the fence, another attempt that still
    /// holds its job, and one that does not; with the same request and
    /// another one.
    #[test]
    fn every_fence_state_by_caller() {
        #[derive(Debug, Clone, Copy, PartialEq)]
        enum Want {
            Replay,
            KeyReused,
            InProgress,
            Abandoned,
            StaysUncertain,
        }
        use FenceState::{Done, Started};
        use Want::*;
        let (me, live, dead) = (lease("a", 1), lease("b", 2), lease("c", 3));
        #[rustfmt::skip]
        let table = [
            // the fence, written by  -> the caller: itself, while live, once dead
            (Done,      Replay,    Replay,     Replay),
            (FenceState::Uncertain, StaysUncertain, StaysUncertain, StaysUncertain),
            (Started,   Abandoned, InProgress, Abandoned),
        ];
        for (state, by_itself, by_live, by_dead) in table {
            for (caller, holder, holder_alive, want) in [
                (&me, &me, true, by_itself),
                (&me, &live, true, by_live),
                (&me, &dead, false, by_dead),
            ] {
                for (fp, want) in [(&b"fp"[..], want), (&b"other"[..], KeyReused)] {
                    let f = fence(state, &holder.job_id, holder.token);
                    let what = format!("{state:?} by {holder:?} for {caller:?}, request {fp:?}");
                    let got = match fence_begin(f, caller, fp) {
                        Begin::Answer(a) => a,
                        Begin::AskHolder(f) => {
                            assert_eq!(holder_lease(&f), *holder, "{what}");
                            begin_if_alive(f, holder_alive)
                        }
                    };
                    let got_want = match &got {
                        FenceBegin::Replay(r) => {
                            assert_eq!(r, b"done", "{what}");
                            Replay
                        }
                        FenceBegin::KeyReused => KeyReused,
                        FenceBegin::InProgress { job_id } => {
                            assert_eq!(job_id, &holder.job_id, "{what}");
                            InProgress
                        }
                        FenceBegin::Abandoned(f) => {
                            assert_eq!(f.token, holder.token, "{what}");
                            Abandoned
                        }
                        FenceBegin::Uncertain(_) => StaysUncertain,
                        FenceBegin::Started => panic!("{what}: an existing fence is never started"),
                    };
                    assert_eq!(got_want, want, "{what}");
                }
            }
        }
    }

    /// Who may move a fence: only a started one, by its own attempt at
    /// once, by another once the holder is dead; its own `done` and
    /// `release` only while nobody took it over.
    #[test]
    fn who_may_move_a_fence() {
        let (me, other) = (lease("a", 1), lease("b", 2));
        let refused = |r: Result<(Fence, bool), StoreError>| match r {
            Err(StoreError::InvalidFence { reason, .. }) => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            refused(may_move(None::<Fence>, &id(), &me)),
            "no such fence"
        );
        assert_eq!(
            refused(may_move(Some(fence(FenceState::Done, "a", 1)), &id(), &me)),
            "it is done, not started"
        );
        assert_eq!(
            refused(may_move(
                Some(fence(FenceState::Uncertain, "a", 1)),
                &id(),
                &me
            )),
            "it is uncertain, not started"
        );
        let (_, ask) = may_move(Some(fence(FenceState::Started, "a", 1)), &id(), &me).unwrap();
        assert!(!ask, "its own attempt moves it at once");
        let (f, ask) = may_move(Some(fence(FenceState::Started, "a", 1)), &id(), &other).unwrap();
        assert!(ask, "another attempt asks whether the holder is dead");
        assert!(moved_if_dead(&f, &id(), false).is_ok());
        match moved_if_dead(&f, &id(), true) {
            Err(StoreError::InvalidFence { reason, .. }) => {
                assert_eq!(reason, "a live attempt of job \"a\" holds it")
            }
            other => panic!("{other:?}"),
        }
        assert!(held_by(&f, &id(), &me).is_ok());
        assert!(held_by(&f, &id(), &lease("a", 9)).is_err());
    }

    /// An operator resolves an uncertain fence at once and a started one
    /// once its holder is dead; a done fence has nothing to resolve, and a
    /// missing one is not found.
    #[test]
    fn which_fences_an_operator_may_resolve() {
        assert!(matches!(
            resolvable(None::<Fence>, &id()),
            Err(StoreError::NotFound(what)) if what == "fence n/http/k"
        ));
        match resolvable(Some(fence(FenceState::Done, "a", 1)), &id()) {
            Err(StoreError::InvalidFence { reason, .. }) => {
                assert_eq!(reason, "it is done; there is nothing to resolve")
            }
            other => panic!("{other:?}"),
        }
        let (_, ask) = resolvable(Some(fence(FenceState::Uncertain, "a", 1)), &id()).unwrap();
        assert!(!ask, "an uncertain fence is resolved whoever wrote it");
        let (f, ask) = resolvable(Some(fence(FenceState::Started, "a", 1)), &id()).unwrap();
        assert!(ask, "a started fence only once its holder is dead");
        assert!(moved_if_dead(&f, &id(), true).is_err());
    }

    /// A new job answers as stored: waiting, or delayed while its run_at
    /// is ahead, with no attempt yet.
    #[test]
    fn a_created_job_is_waiting_or_delayed() {
        let job = |run_at| NewJob {
            queue: "q".into(),
            id: None,
            payload: "{}".into(),
            priority: 0,
            run_at: Millis(run_at),
            max_attempts: 3,
            dedup_key: Some("k".into()),
            dedup_for: None,
        };
        let now = Millis(1_000);
        let e = created("j".into(), job(1_000), now);
        assert_eq!((e.job.state, e.deduplicated), (JobState::Waiting, false));
        assert_eq!((e.job.attempt, e.job.enqueued_at), (0, now));
        assert_eq!(e.job.dedup_key.as_deref(), Some("k"));
        let e = created("j".into(), job(2_000), now);
        assert_eq!(e.job.state, JobState::Delayed);
    }

    /// Versions order the index: a write below the stored version is
    /// stale, the same live version unchanged, and a tombstone keeps older
    /// upserts out.
    #[test]
    fn index_writes_by_version() {
        use UpsertOutcome::*;
        let cases = [
            (None, 1, Inserted, Some(false)),
            (Some((true, 1)), 2, Updated, Some(true)),
            (Some((true, 2)), 2, Unchanged, Some(true)),
            (Some((true, 3)), 2, Stale, None),
            (Some((false, 1)), 2, Inserted, Some(false)),
            (Some((false, 2)), 2, Stale, Some(false)),
            (Some((false, 3)), 2, Stale, None),
        ];
        for (stored, version, up, rm) in cases {
            assert_eq!(
                upsert(stored, version),
                up,
                "upsert {version} over {stored:?}"
            );
            assert_eq!(
                remove(stored, version),
                rm,
                "remove {version} over {stored:?}"
            );
        }
    }
}
