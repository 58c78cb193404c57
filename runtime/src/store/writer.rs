//! The embedded ledgers' one writer: a thread that owns every write of a
//! SQLite or sled ledger and commits them in groups.
//!
//! The thread takes every request waiting in its channel (up to
//! [`MAX_GROUP`]), opens a group ([`Engine::begin`]), runs each step (the
//! engine makes a failing step undo itself alone), answers the **applied**
//! steps at once, commits the group ([`Engine::commit`], durable against
//! power loss when it returns `Ok`) and then answers the **durable** steps
//! with the commit's outcome.
//!
//! Invariants:
//!
//! - A durable step is answered `Ok` only after the commit that carries it
//!   returned `Ok`.
//! - Fail-stop: a group that cannot begin or commit sets the [`Halt`] and the
//!   thread returns; every step still queued, and every later one, gets the
//!   halt's error. Applied steps of a failed group were already answered to
//!   their attempts, so nothing may commit on top of their loss: the daemon
//!   exits and recovery starts from what the disk holds.
//! - A commit that outlives [`Halt::COMMIT_DEADLINE`] halts the ledger as
//!   well; its waiters get the halt's error, and the thread runs nothing
//!   more once the commit returns.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::StoreError;

/// Most steps run in one group.
pub(super) const MAX_GROUP: usize = 1024;

/// What a backend does inside the writer thread. The writer decides when a
/// group begins and ends and what is answered when; the engine only stores.
pub(super) trait Engine: Send + 'static {
    /// Opens a group before its first step.
    fn begin(&mut self) -> Result<(), StoreError>;

    /// Ends the group. When it returns `Ok`, every step run since
    /// [`Engine::begin`] is durable against power loss if `durable` (some
    /// step of the group waits for that); an engine may skip the sync of a
    /// group without durable steps. Returns whether it wrote to the disk
    /// (counted in `khata_store_commit_seconds`).
    fn commit(&mut self, durable: bool) -> Result<bool, StoreError>;

    /// Undoes what a failed [`Engine::commit`] left open.
    fn abort(&mut self) {}

    /// Housekeeping after a group committed (bounding SQLite's WAL).
    fn committed(&mut self) {}
}

/// A step for the writer: runs inside the group and returns the answer to
/// send once the group's commit is known.
type Step<E> = Box<dyn FnOnce(&mut E) -> Answer + Send>;

/// Sends a step's result once the group's commit is known.
type Answer = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

struct Request<E> {
    step: Step<E>,
    durable: bool,
}

/// The handle on a writer thread running engine `E`. Dropping it stops the
/// thread after the steps already sent.
pub(super) struct GroupWriter<E> {
    /// `None` once dropping: closing the channel stops the thread.
    tx: Option<mpsc::UnboundedSender<Request<E>>>,
    halt: Halt,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<E: Engine> GroupWriter<E> {
    /// Starts the thread `khata-ledger` on `engine`.
    pub(super) fn start(engine: E) -> Result<GroupWriter<E>, StoreError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let halt = Halt::default();
        let halting = halt.clone();
        let thread = std::thread::Builder::new()
            .name("khata-ledger".into())
            .spawn(move || run(engine, rx, &halting))
            .map_err(|e| StoreError::Unavailable(format!("starting the ledger writer: {e}")))?;
        Ok(GroupWriter {
            tx: Some(tx),
            halt,
            thread: Some(thread),
        })
    }

    /// Set when the writer stopped taking writes.
    pub(super) fn halt(&self) -> &Halt {
        &self.halt
    }

    /// Runs `f` on the engine within a group; answers after the group's
    /// commit when `durable`, else as soon as `f` has run. `f` must leave
    /// nothing of itself behind when it fails (a savepoint, a transaction
    /// of its own).
    pub(super) async fn write<T, F>(&self, durable: bool, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut E) -> Result<T, StoreError> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let step: Step<E> = Box::new(move |engine: &mut E| {
            let result = f(engine);
            Box::new(move |commit: Result<(), StoreError>| {
                let _ = reply.send(commit.and(result));
            })
        });
        self.tx
            .as_ref()
            .ok_or_else(|| self.halt.error())?
            .send(Request { step, durable })
            .map_err(|_| self.halt.error())?;
        self.halt.answer(rx).await
    }
}

impl<E> Drop for GroupWriter<E> {
    /// Stops the thread after the steps already sent and waits for it, so
    /// that the ledger is closed (its files unlocked) once the store is gone.
    fn drop(&mut self) {
        self.tx.take();
        // A thread stuck in a commit (sled's flush on a full disk) never
        // returns: it is left to the process's exit.
        if self.halt.reason().is_some() {
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs groups until the channel closes or the ledger halts.
fn run<E: Engine>(mut engine: E, mut rx: mpsc::UnboundedReceiver<Request<E>>, halt: &Halt) {
    let mut group: Vec<Request<E>> = Vec::with_capacity(MAX_GROUP);
    let mut durable_answers: Vec<Answer> = Vec::with_capacity(MAX_GROUP);
    while let Some(first) = rx.blocking_recv() {
        // A commit that outlived `Halt::COMMIT_DEADLINE` and then returned
        // leaves the ledger halted all the same: its waiters were answered
        // with the halt's error, so nothing more is committed.
        if halt.reason().is_some() {
            return;
        }
        group.push(first);
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(r) => group.push(r),
                Err(_) => break,
            }
        }
        if let Err(e) = engine.begin() {
            // No step of the group has run: dropping them answers each with
            // the halt's error.
            halt.set(format!("a group could not begin: {e}"));
            tracing::error!(error = %e, "the ledger could not begin a group; it takes no writes from now on");
            return;
        }
        for r in group.drain(..) {
            let answer = (r.step)(&mut engine);
            if r.durable {
                durable_answers.push(answer);
            } else {
                answer(Ok(()));
            }
        }
        let started = Instant::now();
        let committed = halt.committing(|| engine.commit(!durable_answers.is_empty()));
        if !matches!(committed, Ok(false)) {
            metrics::histogram!("khata_store_commit_seconds")
                .record(started.elapsed().as_secs_f64());
            metrics::histogram!("khata_store_commit_steps").record(durable_answers.len() as f64);
        }
        let committed = committed.map(drop);
        if let Err(e) = &committed {
            tracing::error!(error = %e, "ledger commit failed; the ledger takes no writes from now on");
            engine.abort();
            halt.set(format!("a commit failed: {e}"));
        }
        for answer in durable_answers.drain(..) {
            answer(committed.clone());
        }
        if committed.is_err() {
            return;
        }
        engine.committed();
    }
}

/// Set once by an embedded ledger's writer when a commit fails, or when a
/// commit has not returned within [`Halt::COMMIT_DEADLINE`]; read by the
/// daemon (which then exits non-zero) and by `/readyz` (503).
///
/// Invariant: once set it stays set, and the writer has run no step since
/// (a commit that never returns runs none either: its thread is stuck in
/// it, as sled's flush is on a full disk, and the daemon exits around it).
#[derive(Debug, Clone, Default)]
pub struct Halt {
    why: Arc<std::sync::OnceLock<String>>,
    /// When the commit in progress started, in ms since `epoch` plus one;
    /// 0 while none is.
    committing: Arc<std::sync::atomic::AtomicU64>,
    epoch: Arc<std::sync::OnceLock<std::time::Instant>>,
}

impl Halt {
    /// How long a durable commit may take before the ledger counts as
    /// stopped. A healthy disk commits in milliseconds and a loaded one in
    /// a few seconds; one that has not answered in 20 s will not, and the
    /// requests waiting on it would otherwise hang until their timeouts.
    pub const COMMIT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

    /// Records why the writer stopped (the first reason is kept).
    pub fn set(&self, why: String) {
        let _ = self.why.set(why);
    }

    /// Runs a durable commit under [`Halt::COMMIT_DEADLINE`].
    pub fn committing<T>(&self, commit: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering;
        let epoch = *self.epoch.get_or_init(std::time::Instant::now);
        let since = epoch.elapsed().as_millis() as u64 + 1;
        self.committing.store(since, Ordering::Release);
        let done = commit();
        self.committing.store(0, Ordering::Release);
        done
    }

    pub fn reason(&self) -> Option<String> {
        use std::sync::atomic::Ordering;
        if let Some(why) = self.why.get() {
            return Some(why.clone());
        }
        let since = self.committing.load(Ordering::Acquire);
        let epoch = self.epoch.get()?;
        if since != 0 {
            let taken = epoch
                .elapsed()
                .saturating_sub(std::time::Duration::from_millis(since - 1));
            if taken > Self::COMMIT_DEADLINE {
                self.set(format!(
                    "a commit has not returned in {} s (a full disk or a failing device)",
                    taken.as_secs()
                ));
            }
        }
        self.why.get().cloned()
    }

    /// Waits for the answer to a step sent to the writer, or for the
    /// writer to stop: a writer stuck in a commit answers nothing, and its
    /// callers get the halt's error instead of waiting for ever.
    pub async fn answer<T>(
        &self,
        rx: tokio::sync::oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let stopped = async {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                if self.reason().is_some() {
                    return;
                }
            }
        };
        tokio::select! {
            answer = rx => answer.map_err(|_| self.error())?,
            () = stopped => Err(self.error()),
        }
    }

    /// The error a step gets from a stopped writer.
    pub fn error(&self) -> StoreError {
        StoreError::Unavailable(match self.why.get() {
            Some(why) => format!("the ledger stopped taking writes after: {why}"),
            None => "the ledger writer has stopped".to_owned(),
        })
    }
}
