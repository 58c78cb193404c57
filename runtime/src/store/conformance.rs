//! The conformance suite every [`Store`] backend passes unchanged.
//!
//! Each check takes a fresh, empty store and uses the trait only. A backend
//! runs the whole suite with [`conformance_tests!`](crate::conformance_tests):
//!
//! ```ignore
//! khata::conformance_tests!(|| async { MyStore::open_temp().await });
//! ```

use std::sync::Arc;
use std::time::Duration;

use super::{
    Doc, DocId, EffectRecord, FenceBegin, FenceFilter, FenceId, FenceState, JobFilter, KvPut,
    LeaseAsk, LeaseLimits, PutMode, Resolution, RetentionRules, Store, StoreError, Tombstone,
    UpsertOutcome,
};
use crate::job::{AttemptOutcome, Finish, JobState, Lease, LeaseRef, Millis, NewJob};

/// Generates one `#[tokio::test]` per conformance check. `$open` is an
/// expression for a closure returning a future of `(guard, Arc<dyn Store>)`;
/// the guard (a temporary directory, say) lives as long as the check.
#[macro_export]
macro_rules! conformance_tests {
    ($open:expr) => {
        $crate::conformance_tests!(@each $open;
            enqueue_and_read, id_dedup, batch_is_all_or_none, dedup_key_while_live,
            dedup_for_holds_after_end, dedup_release_is_compare_and_swap, delivery_order,
            delayed_jobs_wait, tokens_grow_and_leases_are_exclusive, finish_outcomes,
            budget_and_dead, interrupted_is_not_counted, cancel_and_retry, recover_abandoned,
            kv_semantics_and_fencing, index_versions, sweep_retention, counts_and_pages,
            pages_end_at_their_byte_budget,
            concurrent_enqueue_one_id, fence_table, fence_of_a_dead_attempt,
            uncertain_fences_and_resolution, effects_are_recorded_per_attempt);
    };
    (@each $open:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (_guard, store) = ($open)().await;
                $crate::store::conformance::$name(store).await;
            }
        )*
    };
}

const T0: Millis = Millis(1_700_000_000_000);

fn at(ms: i64) -> Millis {
    Millis(T0.0 + ms)
}

fn new_job(queue: &str, payload: &str) -> NewJob {
    NewJob {
        queue: queue.to_owned(),
        id: None,
        payload: payload.to_owned(),
        priority: 0,
        run_at: T0,
        max_attempts: 3,
        dedup_key: None,
        dedup_for: None,
    }
}

fn with_id(mut j: NewJob, id: &str) -> NewJob {
    j.id = Some(id.to_owned());
    j
}

fn with_key(mut j: NewJob, key: &str) -> NewJob {
    j.dedup_key = Some(key.to_owned());
    j
}

/// [`Store::lease`] without limits, answering the leases only: what the
/// checks and the backends' own tests ask for.
pub trait LeaseUpTo {
    fn lease_up_to(
        &self,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
    ) -> impl std::future::Future<Output = Result<Vec<Lease>, StoreError>> + Send;
}

impl<S: Store + ?Sized> LeaseUpTo for S {
    async fn lease_up_to(
        &self,
        queue: &str,
        max: u32,
        plugin_version: &str,
        now: Millis,
    ) -> Result<Vec<Lease>, StoreError> {
        let ask = LeaseAsk {
            queue,
            max,
            plugin_version,
            limits: LeaseLimits::default(),
        };
        Ok(self.lease(&ask, now).await?.leases)
    }
}

/// A kv write, for the checks and the backends' own tests.
pub fn put(ns: &str, key: &str, value: Vec<u8>, mode: PutMode) -> KvPut {
    KvPut {
        ns: ns.to_owned(),
        key: key.to_owned(),
        value,
        mode,
    }
}

/// An index upsert, for the checks and the backends' own tests.
pub fn doc_at(collection: &str, id: &str, version: u64, document: &str) -> Doc {
    Doc {
        collection: collection.to_owned(),
        id: id.to_owned(),
        version,
        document: document.to_owned(),
    }
}

/// An index removal, for the checks and the backends' own tests.
pub fn tombstone(collection: &str, id: &str, version: u64) -> Tombstone {
    Tombstone {
        collection: collection.to_owned(),
        id: id.to_owned(),
        version,
    }
}

/// A document's id, for the checks and the backends' own tests.
pub fn doc(collection: &str, id: &str) -> DocId {
    DocId {
        collection: collection.to_owned(),
        id: id.to_owned(),
    }
}

/// A fence listing, for the checks and the backends' own tests.
pub fn fence_filter(namespace: Option<&str>, state: Option<FenceState>, limit: u32) -> FenceFilter {
    FenceFilter {
        namespace: namespace.map(str::to_owned),
        state,
        limit,
    }
}

async fn enqueue1(s: &dyn Store, j: NewJob, now: Millis) -> (String, bool) {
    let r = s.enqueue(vec![j], now).await.expect("enqueue");
    (r[0].job.id.clone(), r[0].deduplicated)
}

async fn lease1(s: &dyn Store, queue: &str, now: Millis) -> crate::job::Lease {
    let mut l = s.lease_up_to(queue, 1, "v1", now).await.expect("lease");
    assert_eq!(l.len(), 1, "expected one job to lease in {queue}");
    l.remove(0)
}

async fn state(s: &dyn Store, id: &str, now: Millis) -> JobState {
    s.job(id, now)
        .await
        .expect("job")
        .expect("job exists")
        .state
}

async fn complete(s: &dyn Store, lease: &crate::job::Lease, now: Millis) {
    s.finish(
        &lease.fence(),
        Finish::Completed {
            result: "{}".into(),
        },
        now,
    )
    .await
    .expect("finish");
}

pub async fn enqueue_and_read(s: Arc<dyn Store>) {
    let r = s
        .enqueue(vec![new_job("q", r#"{"a":1}"#)], T0)
        .await
        .unwrap();
    assert_eq!(r.len(), 1);
    assert!(!r[0].deduplicated);
    let job = s.job(&r[0].job.id, T0).await.unwrap().unwrap();
    assert_eq!(job.queue, "q");
    assert_eq!(job.payload, r#"{"a":1}"#);
    assert_eq!(job.state, JobState::Waiting);
    assert_eq!(job.attempt, 0);
    assert_eq!(job.enqueued_at, T0);
    assert!(s.job("no-such-job", T0).await.unwrap().is_none());
}

pub async fn id_dedup(s: Arc<dyn Store>) {
    let (a, d1) = enqueue1(&*s, with_id(new_job("q", "1"), "order-1"), T0).await;
    assert_eq!((a.as_str(), d1), ("order-1", false));
    let (b, d2) = enqueue1(&*s, with_id(new_job("q", "1"), "order-1"), at(5)).await;
    assert_eq!((b.as_str(), d2), ("order-1", true));
    let err = s
        .enqueue(vec![with_id(new_job("q", "2"), "order-1")], at(6))
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::IdReused { ref id, index: 0 } if id == "order-1"),
        "{err:?}"
    );
    // The id stays taken after the job ends.
    let l = lease1(&*s, "q", at(7)).await;
    complete(&*s, &l, at(8)).await;
    let (_, d3) = enqueue1(&*s, with_id(new_job("q", "1"), "order-1"), at(9)).await;
    assert!(d3);
    assert_eq!(
        s.jobs(
            JobFilter {
                limit: 100,
                ..Default::default()
            },
            at(9)
        )
        .await
        .unwrap()
        .jobs
        .len(),
        1
    );
}

pub async fn batch_is_all_or_none(s: Arc<dyn Store>) {
    enqueue1(&*s, with_id(new_job("q", "1"), "taken"), T0).await;
    let err = s
        .enqueue(
            vec![
                with_id(new_job("q", "x"), "fresh-1"),
                with_id(new_job("q", "other"), "taken"),
            ],
            T0,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::IdReused { index: 1, .. }),
        "{err:?}"
    );
    assert!(
        s.job("fresh-1", T0).await.unwrap().is_none(),
        "a refused batch wrote nothing"
    );
    let ok = s
        .enqueue(
            vec![
                new_job("q", "a"),
                new_job("q", "b"),
                with_id(new_job("q", "1"), "taken"),
            ],
            T0,
        )
        .await
        .unwrap();
    assert_eq!(
        ok.iter().map(|e| e.deduplicated).collect::<Vec<_>>(),
        [false, false, true]
    );
}

pub async fn dedup_key_while_live(s: Arc<dyn Store>) {
    let (a, _) = enqueue1(&*s, with_key(new_job("q", "1"), "k"), T0).await;
    let (b, d) = enqueue1(&*s, with_key(new_job("q", "other payload"), "k"), at(1)).await;
    assert_eq!(
        (b.as_str(), d),
        (a.as_str(), true),
        "live key deduplicates whatever the payload"
    );
    // Another queue has its own keys.
    let (_, d_other) = enqueue1(&*s, with_key(new_job("q2", "1"), "k"), at(1)).await;
    assert!(!d_other);
    let l = lease1(&*s, "q", at(2)).await;
    let (c, d) = enqueue1(&*s, with_key(new_job("q", "1"), "k"), at(3)).await;
    assert_eq!(
        (c.as_str(), d),
        (a.as_str(), true),
        "an active job holds its key"
    );
    complete(&*s, &l, at(4)).await;
    let (e, d) = enqueue1(&*s, with_key(new_job("q", "1"), "k"), at(5)).await;
    assert!(!d && e != a, "the key is free once its job completed");
}

pub async fn dedup_for_holds_after_end(s: Arc<dyn Store>) {
    let mut j = with_key(new_job("q", "1"), "k");
    j.dedup_for = Some(Duration::from_secs(60));
    let (a, _) = enqueue1(&*s, j.clone(), T0).await;
    let l = lease1(&*s, "q", at(1)).await;
    complete(&*s, &l, at(2)).await;
    let (b, d) = enqueue1(&*s, with_key(new_job("q", "1"), "k"), at(30_000)).await;
    assert_eq!(
        (b.as_str(), d),
        (a.as_str(), true),
        "held for dedup_for after completion"
    );
    let (c, d) = enqueue1(&*s, with_key(new_job("q", "1"), "k"), at(60_001)).await;
    assert!(!d && c != a, "free after dedup_for");
}

pub async fn dedup_release_is_compare_and_swap(s: Arc<dyn Store>) {
    // Job A holds the key; an operator cancels it; job B takes the key; A is
    // retried and dead-lettered: B must keep the key.
    let (a, _) = enqueue1(&*s, with_key(new_job("q", "a"), "k"), T0).await;
    s.cancel(&a, at(1)).await.unwrap();
    let (b, d) = enqueue1(&*s, with_key(new_job("q", "b"), "k"), at(2)).await;
    assert!(!d && b != a);
    s.retry(&a, at(3)).await.unwrap();
    let la = lease1(&*s, "q", at(4)).await;
    let lb = lease1(&*s, "q", at(4)).await;
    let (first, second) = if la.job_id == a { (la, lb) } else { (lb, la) };
    assert_eq!(first.job_id, a);
    s.finish(
        &first.fence(),
        Finish::Fail {
            outcome: AttemptOutcome::Failed,
            error: "x".into(),
        },
        at(5),
    )
    .await
    .unwrap();
    let (c, d) = enqueue1(&*s, with_key(new_job("q", "c"), "k"), at(6)).await;
    assert_eq!((c.as_str(), d), (b.as_str(), true), "B still holds the key");
    complete(&*s, &second, at(7)).await;
}

pub async fn delivery_order(s: Arc<dyn Store>) {
    let mut jobs = Vec::new();
    for (name, priority, run_at) in [
        ("p0-early", 0, -20),
        ("p0-late", 0, -10),
        ("p5", 5, -5),
        ("p0-early-2", 0, -20),
        ("p9", 9, 0),
    ] {
        let mut j = with_id(new_job("q", "{}"), name);
        j.priority = priority;
        j.run_at = at(run_at);
        jobs.push(j);
    }
    s.enqueue(jobs, T0).await.unwrap();
    let leases = s.lease_up_to("q", 10, "v1", T0).await.unwrap();
    let order: Vec<&str> = leases.iter().map(|l| l.job_id.as_str()).collect();
    assert_eq!(order, ["p9", "p5", "p0-early", "p0-early-2", "p0-late"]);
    let tokens: Vec<u64> = leases.iter().map(|l| l.token).collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens grow in delivery order: {tokens:?}"
    );
}

pub async fn delayed_jobs_wait(s: Arc<dyn Store>) {
    let mut j = with_id(new_job("q", "{}"), "later");
    j.run_at = at(1_000);
    s.enqueue(vec![j], T0).await.unwrap();
    assert_eq!(state(&*s, "later", T0).await, JobState::Delayed);
    assert_eq!(s.next_run_at("q").await.unwrap(), Some(at(1_000)));
    assert!(
        s.lease_up_to("q", 10, "v1", at(999))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(state(&*s, "later", at(1_000)).await, JobState::Waiting);
    let l = lease1(&*s, "q", at(1_000)).await;
    assert_eq!(l.job_id, "later");
    complete(&*s, &l, at(1_001)).await;
    assert_eq!(s.next_run_at("q").await.unwrap(), None);
}

pub async fn tokens_grow_and_leases_are_exclusive(s: Arc<dyn Store>) {
    s.enqueue((0..5).map(|i| new_job("q", &i.to_string())).collect(), T0)
        .await
        .unwrap();
    let a = s.lease_up_to("q", 3, "v1", T0).await.unwrap();
    let b = s.lease_up_to("q", 3, "v1", T0).await.unwrap();
    assert_eq!((a.len(), b.len()), (3, 2));
    let tokens: Vec<u64> = a.iter().chain(&b).map(|l| l.token).collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens grow: {tokens:?}"
    );
    let mut ids: Vec<&str> = a.iter().chain(&b).map(|l| l.job_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 5, "no job leased twice");
    assert!(s.lease_up_to("q", 3, "v1", T0).await.unwrap().is_empty());
    assert!(a.iter().all(|l| l.attempt == 1));
}

pub async fn finish_outcomes(s: Arc<dyn Store>) {
    let (id, _) = enqueue1(&*s, new_job("q", "{}"), T0).await;
    let l = lease1(&*s, "q", T0).await;
    let next = s
        .finish(
            &l.fence(),
            Finish::Retry {
                outcome: AttemptOutcome::Retry,
                error: "busy".into(),
                run_at: at(500),
            },
            at(10),
        )
        .await
        .unwrap();
    assert_eq!(next, JobState::Delayed);
    let job = s.job(&id, at(10)).await.unwrap().unwrap();
    assert_eq!(job.last_error.as_deref(), Some("busy"));
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(job.attempts[0].outcome, AttemptOutcome::Retry);
    assert_eq!(job.attempts[0].ended_at, Some(at(10)));
    assert_eq!(job.attempts[0].plugin_version.as_deref(), Some("v1"));
    // Each attempt records the plugin version it was leased for.
    let l2 = s
        .lease_up_to("q", 1, "v2", at(500))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(l2.attempt, 2);
    assert!(l2.token > l.token);
    // The first attempt's lease is gone: its finish is fenced.
    let stale = s
        .finish(
            &l.fence(),
            Finish::Completed { result: "1".into() },
            at(501),
        )
        .await;
    assert!(matches!(stale, Err(StoreError::Fenced { .. })), "{stale:?}");
    s.finish(
        &l2.fence(),
        Finish::Completed {
            result: r#"{"ok":true}"#.into(),
        },
        at(502),
    )
    .await
    .unwrap();
    let job = s.job(&id, at(502)).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Completed);
    assert_eq!(job.result.as_deref(), Some(r#"{"ok":true}"#));
    assert_eq!(job.finished_at, Some(at(502)));
    assert_eq!(
        job.attempts.iter().map(|a| a.outcome).collect::<Vec<_>>(),
        [AttemptOutcome::Retry, AttemptOutcome::Completed]
    );
    let versions: Vec<_> = job
        .attempts
        .iter()
        .map(|a| a.plugin_version.as_deref())
        .collect();
    assert_eq!(versions, [Some("v1"), Some("v2")]);
    assert!(
        s.lease_up_to("q", 10, "v1", at(10_000))
            .await
            .unwrap()
            .is_empty(),
        "a completed job never runs again"
    );
}

pub async fn budget_and_dead(s: Arc<dyn Store>) {
    let (id, _) = enqueue1(&*s, new_job("q", "{}"), T0).await; // max_attempts 3
    for n in 1..=3 {
        let l = lease1(&*s, "q", at(n)).await;
        assert_eq!(l.attempt, u32::try_from(n).unwrap());
        let next = s
            .finish(
                &l.fence(),
                Finish::Retry {
                    outcome: AttemptOutcome::Trapped,
                    error: format!("trap {n}"),
                    run_at: at(n),
                },
                at(n),
            )
            .await
            .unwrap();
        assert_eq!(
            next,
            if n < 3 {
                JobState::Waiting
            } else {
                JobState::Dead
            }
        );
    }
    let job = s.job(&id, at(10)).await.unwrap().unwrap();
    assert!(job.last_error.unwrap().contains("trap 3"));
    // fail is dead at once.
    let (id2, _) = enqueue1(&*s, new_job("q", "2"), at(20)).await;
    let l = lease1(&*s, "q", at(20)).await;
    let next = s
        .finish(
            &l.fence(),
            Finish::Fail {
                outcome: AttemptOutcome::Failed,
                error: "bad card".into(),
            },
            at(21),
        )
        .await
        .unwrap();
    assert_eq!(next, JobState::Dead);
    assert_eq!(
        s.job(&id2, at(21))
            .await
            .unwrap()
            .unwrap()
            .last_error
            .as_deref(),
        Some("bad card")
    );
}

pub async fn interrupted_is_not_counted(s: Arc<dyn Store>) {
    let mut j = new_job("q", "{}");
    j.max_attempts = 1;
    let (id, _) = enqueue1(&*s, j, T0).await;
    let l = lease1(&*s, "q", T0).await;
    s.finish(
        &l.fence(),
        Finish::Interrupted {
            error: "shutdown".into(),
        },
        at(1),
    )
    .await
    .unwrap();
    assert_eq!(state(&*s, &id, at(1)).await, JobState::Waiting);
    let l = lease1(&*s, "q", at(2)).await;
    assert_eq!(l.attempt, 2, "attempt numbers never repeat");
    complete(&*s, &l, at(3)).await;
    assert_eq!(state(&*s, &id, at(3)).await, JobState::Completed);
}

pub async fn cancel_and_retry(s: Arc<dyn Store>) {
    let (waiting, _) = enqueue1(&*s, new_job("q", "1"), T0).await;
    let (job, was_active) = s.cancel(&waiting, at(1)).await.unwrap();
    assert_eq!((job.state, was_active), (JobState::Cancelled, false));
    assert!(matches!(
        s.cancel(&waiting, at(1)).await,
        Err(StoreError::InvalidState { .. })
    ));
    assert!(matches!(
        s.cancel("nope", at(1)).await,
        Err(StoreError::NotFound(_))
    ));

    let (active, _) = enqueue1(&*s, new_job("q", "2"), at(2)).await;
    let l = lease1(&*s, "q", at(2)).await;
    assert_eq!(l.job_id, active);
    let (_, was_active) = s.cancel(&active, at(3)).await.unwrap();
    assert!(was_active);
    let kv = s
        .kv_put(
            &l.fence(),
            put("ns", "k", b"v".to_vec(), PutMode::Replace),
            at(3),
        )
        .await;
    assert!(
        matches!(kv, Err(StoreError::Fenced { .. })),
        "a cancelled attempt is fenced: {kv:?}"
    );
    let fin = s
        .finish(&l.fence(), Finish::Completed { result: "1".into() }, at(4))
        .await;
    assert!(matches!(fin, Err(StoreError::Fenced { .. })));
    let job = s.job(&active, at(4)).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(job.attempts[0].outcome, AttemptOutcome::Cancelled);

    let retried = s.retry(&active, at(5)).await.unwrap();
    assert_eq!(retried.state, JobState::Waiting);
    assert!(matches!(
        s.retry(&active, at(5)).await,
        Err(StoreError::InvalidState { .. })
    ));
    let l = lease1(&*s, "q", at(6)).await;
    assert_eq!((l.job_id.as_str(), l.attempt), (active.as_str(), 2));
}

pub async fn recover_abandoned(s: Arc<dyn Store>) {
    let mut last = new_job("q", "last");
    last.max_attempts = 1;
    s.enqueue(
        vec![with_id(new_job("q", "1"), "a"), with_id(last, "b")],
        T0,
    )
    .await
    .unwrap();
    let leases = s.lease_up_to("q", 2, "v1", T0).await.unwrap();
    assert_eq!(leases.len(), 2);
    assert_eq!(s.recover(at(100)).await.unwrap(), 2);
    let a = s.job("a", at(100)).await.unwrap().unwrap();
    assert_eq!(a.state, JobState::Waiting);
    assert_eq!(a.attempts[0].outcome, AttemptOutcome::Abandoned);
    assert_eq!(a.budget_used, 1, "an abandoned attempt counts");
    assert_eq!(
        s.job("b", at(100)).await.unwrap().unwrap().state,
        JobState::Dead
    );
    let kv = s.kv_get(&leases[0].fence(), "ns", "k").await;
    assert!(matches!(kv, Err(StoreError::Fenced { .. })));
    let again = lease1(&*s, "q", at(100)).await;
    assert_eq!((again.job_id.as_str(), again.attempt), ("a", 2));
    assert!(again.token > leases[1].token);
}

pub async fn kv_semantics_and_fencing(s: Arc<dyn Store>) {
    enqueue1(&*s, new_job("q", "{}"), T0).await;
    let l = lease1(&*s, "q", T0).await.fence();
    assert_eq!(s.kv_get(&l, "ns", "k").await.unwrap(), None);
    assert!(
        s.kv_put(&l, put("ns", "k", b"1".to_vec(), PutMode::IfAbsent), T0)
            .await
            .unwrap()
    );
    assert!(
        !s.kv_put(&l, put("ns", "k", b"2".to_vec(), PutMode::IfAbsent), T0)
            .await
            .unwrap()
    );
    assert_eq!(
        s.kv_get(&l, "ns", "k").await.unwrap().as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(
        s.kv_get(&l, "other-ns", "k").await.unwrap(),
        None,
        "namespaces are apart"
    );
    s.kv_put(&l, put("ns", "k", b"3".to_vec(), PutMode::Replace), T0)
        .await
        .unwrap();
    assert_eq!(
        s.kv_get(&l, "ns", "k").await.unwrap().as_deref(),
        Some(&b"3"[..])
    );
    assert!(s.kv_delete(&l, "ns", "k").await.unwrap());
    assert!(!s.kv_delete(&l, "ns", "k").await.unwrap());
    let forged = LeaseRef {
        job_id: l.job_id.clone(),
        attempt: l.attempt,
        token: l.token + 1000,
    };
    assert!(matches!(
        s.kv_put(&forged, put("ns", "k", vec![], PutMode::Replace), T0)
            .await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(
        s.kv_get(&l, "ns", "k").await.unwrap(),
        None,
        "a fenced write changed nothing"
    );
}

pub async fn index_versions(s: Arc<dyn Store>) {
    enqueue1(&*s, new_job("q", "{}"), T0).await;
    let lease = lease1(&*s, "q", T0).await;
    let l = lease.fence();
    let up = |doc: &'static str, v: u64| {
        let (s, l) = (Arc::clone(&s), l.clone());
        async move {
            s.index_upsert(&l, doc_at("products", "p1", v, doc), T0)
                .await
                .unwrap()
        }
    };
    assert_eq!(up("v10", 10).await, UpsertOutcome::Inserted);
    assert_eq!(up("v10", 10).await, UpsertOutcome::Unchanged);
    assert_eq!(up("v5", 5).await, UpsertOutcome::Stale);
    assert_eq!(up("v20", 20).await, UpsertOutcome::Updated);
    assert_eq!(
        s.index_get_leased(&l, &doc("products", "p1"))
            .await
            .unwrap()
            .as_deref(),
        Some("v20")
    );
    assert!(
        !s.index_remove(&l, tombstone("products", "p1", 15), T0)
            .await
            .unwrap(),
        "older remove ignored"
    );
    assert!(
        s.index_remove(&l, tombstone("products", "p1", 25), T0)
            .await
            .unwrap()
    );
    assert_eq!(
        s.index_get_leased(&l, &doc("products", "p1"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        up("v21", 21).await,
        UpsertOutcome::Stale,
        "the tombstone keeps its version"
    );
    assert_eq!(up("v30", 30).await, UpsertOutcome::Inserted);
    // Operators read committed state: the attempt's end carries the writes.
    complete(&*s, &lease, at(1)).await;
    assert_eq!(
        s.index_get(&doc("products", "p1")).await.unwrap(),
        Some(("v30".into(), 30))
    );
    assert_eq!(s.index_get(&doc("other", "p1")).await.unwrap(), None);
}

/// Each kind goes after its own window, counted from its own clock; what is
/// younger, and kv of namespaces without a rule, stays.
pub async fn sweep_retention(s: Arc<dyn Store>) {
    let day = Duration::from_secs(86_400);
    s.enqueue(
        vec![
            with_id(new_job("q", "1"), "old"),
            with_id(new_job("q", "2"), "dead"),
            with_id(new_job("q", "3"), "fresh"),
            with_id(new_job("q", "4"), "writer"),
        ],
        T0,
    )
    .await
    .unwrap();
    let ls = s.lease_up_to("q", 4, "v1", T0).await.unwrap();
    let writer = ls.iter().find(|l| l.job_id == "writer").unwrap().fence();
    // kv: "cache" keeps a day, "forever" has no rule.
    for (ns, key, when) in [
        ("cache", "old", T0),
        ("cache", "new", T0.plus(day * 7)),
        ("forever", "old", T0),
    ] {
        s.kv_put(&writer, put(ns, key, b"v".to_vec(), PutMode::Replace), when)
            .await
            .unwrap();
    }
    // A tombstone of version 10 written at T0, another at day 7.
    for (id, when) in [("gone", T0), ("recent", T0.plus(day * 7))] {
        s.index_upsert(&writer, doc_at("products", id, 9, "{}"), when)
            .await
            .unwrap();
        assert!(
            s.index_remove(&writer, tombstone("products", id, 10), when)
                .await
                .unwrap()
        );
    }
    for l in &ls {
        let finish = if l.job_id == "dead" {
            Finish::Fail {
                outcome: AttemptOutcome::Failed,
                error: "x".into(),
            }
        } else {
            Finish::Completed { result: "1".into() }
        };
        let when = match l.job_id.as_str() {
            "fresh" | "writer" => T0.plus(day * 6),
            _ => T0,
        };
        s.finish(&l.fence(), finish, when).await.unwrap();
    }
    let rules = RetentionRules {
        jobs: day * 7,
        dead: day * 30,
        fences: day * 30,
        tombstones: day * 3,
        kv: vec![("cache".into(), day)],
    };
    let now = T0.plus(day * 7 + Duration::from_secs(1));
    let swept = s.sweep(now, &rules, 100).await.unwrap();
    assert_eq!(
        (swept.jobs, swept.dead_jobs, swept.kv, swept.tombstones),
        (1, 0, 1, 1),
        "{swept:?}"
    );
    assert!(s.job("old", now).await.unwrap().is_none());
    assert!(
        s.job("dead", now).await.unwrap().is_some(),
        "a dead job stays for its own window"
    );
    assert!(s.job("fresh", now).await.unwrap().is_some());
    let counts = s.counts(now).await.unwrap();
    let q = &counts.iter().find(|(q, _)| q == "q").unwrap().1;
    assert_eq!(
        (q.completed, q.dead, q.waiting),
        (2, 1, 0),
        "a swept job leaves the counts"
    );

    // A later attempt sees what stayed and what went.
    s.enqueue(vec![with_id(new_job("q", "5"), "reader")], now)
        .await
        .unwrap();
    let reader = lease1(&*s, "q", now).await;
    let r = reader.fence();
    let kv = |ns: &'static str, key: &'static str| {
        let (s, r) = (Arc::clone(&s), r.clone());
        async move { s.kv_get(&r, ns, key).await.unwrap().is_some() }
    };
    assert!(!kv("cache", "old").await, "past its namespace's window");
    assert!(kv("cache", "new").await, "written within the window");
    assert!(kv("forever", "old").await, "no rule: kept");
    let up = |id: &'static str| {
        let (s, r) = (Arc::clone(&s), r.clone());
        async move {
            s.index_upsert(&r, doc_at("products", id, 5, "{}"), now)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        up("gone").await,
        UpsertOutcome::Inserted,
        "a swept tombstone no longer holds its version"
    );
    assert_eq!(up("recent").await, UpsertOutcome::Stale);
    complete(&*s, &reader, now).await;

    // Past the dead window the dead job goes too, and nothing is left to do.
    let later = T0.plus(day * 31);
    let swept = s.sweep(later, &rules, 100).await.unwrap();
    assert_eq!(swept.dead_jobs, 1, "{swept:?}");
    assert!(s.job("dead", later).await.unwrap().is_none());
    let again = s.sweep(later, &rules, 100).await.unwrap();
    assert_eq!(
        (again.jobs, again.dead_jobs, again.kv, again.tombstones),
        (0, 0, 0, 0),
        "a second pass finds nothing: {again:?}"
    );
}

/// A page ends at the job that brings its text to `PAGE_BYTES`, before
/// `limit`, and names where the next page starts; every job is on exactly
/// one page.
pub async fn pages_end_at_their_byte_budget(s: Arc<dyn Store>) {
    let big = format!("\"{}\"", "x".repeat(3 << 20));
    for _ in 0..5 {
        s.enqueue(vec![new_job("big", &big)], T0).await.unwrap();
    }
    let mut seen = 0;
    let mut cursor = None;
    let mut sizes = Vec::new();
    loop {
        let page = s
            .jobs(
                JobFilter {
                    queue: Some("big".into()),
                    limit: 100,
                    cursor: cursor.take(),
                    ..Default::default()
                },
                T0,
            )
            .await
            .unwrap();
        sizes.push(page.jobs.len());
        seen += page.jobs.len();
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    // 3 MiB each against 8 MiB: three on a page (the third passes the
    // budget), then two.
    assert_eq!(sizes, [3, 2], "pages of {sizes:?}");
    assert_eq!(seen, 5);
}

pub async fn counts_and_pages(s: Arc<dyn Store>) {
    let mut delayed = new_job("a", "d");
    delayed.run_at = at(1_000);
    s.enqueue(
        vec![
            new_job("a", "1"),
            new_job("a", "2"),
            new_job("a", "3"),
            delayed,
            with_id(new_job("b", "1"), "b-1"),
        ],
        T0,
    )
    .await
    .unwrap();
    let l = lease1(&*s, "a", T0).await;
    complete(&*s, &l, T0).await;
    let counts = s.counts(T0).await.unwrap();
    let a = &counts.iter().find(|(q, _)| q == "a").unwrap().1;
    assert_eq!((a.waiting, a.delayed, a.completed, a.active), (2, 1, 1, 0));
    let b = &counts.iter().find(|(q, _)| q == "b").unwrap().1;
    assert_eq!(b.waiting, 1);
    let active = lease1(&*s, "a", T0).await;
    s.cancel("b-1", T0).await.unwrap();
    let counts = s.counts(T0).await.unwrap();
    let a = &counts.iter().find(|(q, _)| q == "a").unwrap().1;
    assert_eq!((a.waiting, a.active), (1, 1), "{a:?}");
    let b = &counts.iter().find(|(q, _)| q == "b").unwrap().1;
    assert_eq!((b.waiting, b.cancelled), (0, 1), "{b:?}");
    complete(&*s, &active, T0).await;

    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .jobs(
                JobFilter {
                    queue: Some("a".into()),
                    state: None,
                    limit: 2,
                    cursor,
                },
                T0,
            )
            .await
            .unwrap();
        seen.extend(page.jobs.into_iter().map(|j| j.id));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen.len(), 4);
    let delayed = s
        .jobs(
            JobFilter {
                state: Some(JobState::Delayed),
                limit: 10,
                ..Default::default()
            },
            T0,
        )
        .await
        .unwrap();
    assert_eq!(delayed.jobs.len(), 1);
    assert_eq!(delayed.jobs[0].payload, "d");
}

pub async fn concurrent_enqueue_one_id(s: Arc<dyn Store>) {
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let s = Arc::clone(&s);
            tokio::spawn(async move { enqueue1(&*s, with_id(new_job("q", "1"), "same"), T0).await })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        let (id, dedup) = t.await.unwrap();
        assert_eq!(id, "same");
        created += usize::from(!dedup);
    }
    assert_eq!(created, 1);
    let keyed: Vec<_> = (0..32)
        .map(|i| {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                enqueue1(&*s, with_key(new_job("q", &i.to_string()), "key"), T0).await
            })
        })
        .collect();
    let mut created = 0;
    for t in keyed {
        created += usize::from(!t.await.unwrap().1);
    }
    assert_eq!(created, 1);
}

fn fence_id(key: &str) -> FenceId {
    FenceId {
        namespace: "ns".into(),
        kind: "http".into(),
        key: key.into(),
    }
}

pub async fn fence_table(s: Arc<dyn Store>) {
    s.enqueue(
        vec![
            with_id(new_job("q", "1"), "a"),
            with_id(new_job("q", "2"), "b"),
        ],
        T0,
    )
    .await
    .unwrap();
    let la = lease1(&*s, "q", T0).await;
    let lb = lease1(&*s, "q", T0).await;
    let id = fence_id("charge-1");
    // absent → started
    let begun = s.fence_begin(&la.fence(), &id, b"fp1", T0).await.unwrap();
    assert_eq!(begun, FenceBegin::Started);
    // started by a live attempt → in progress, for anyone
    let other = s.fence_begin(&lb.fence(), &id, b"fp1", T0).await.unwrap();
    assert_eq!(other, FenceBegin::InProgress { job_id: "a".into() });
    // another request under the same key → key reused
    assert_eq!(
        s.fence_begin(&lb.fence(), &id, b"fp2", T0).await.unwrap(),
        FenceBegin::KeyReused
    );
    // only the holder records the result
    assert!(matches!(
        s.fence_done(&lb.fence(), &id, b"x".to_vec(), T0).await,
        Err(StoreError::InvalidFence { .. })
    ));
    s.fence_done(&la.fence(), &id, b"response".to_vec(), at(1))
        .await
        .unwrap();
    // done, same request → replay; other request → key reused
    assert_eq!(
        s.fence_begin(&lb.fence(), &id, b"fp1", at(2))
            .await
            .unwrap(),
        FenceBegin::Replay(b"response".to_vec())
    );
    assert_eq!(
        s.fence_begin(&lb.fence(), &id, b"fp2", at(2))
            .await
            .unwrap(),
        FenceBegin::KeyReused
    );
    // a stale attempt cannot begin anything
    let forged = LeaseRef {
        job_id: "a".into(),
        attempt: la.attempt,
        token: la.token + 100,
    };
    assert!(matches!(
        s.fence_begin(&forged, &fence_id("other"), b"fp", at(3))
            .await,
        Err(StoreError::Fenced { .. })
    ));
    // release: the effect did not happen; the next try starts afresh
    let id2 = fence_id("charge-2");
    assert_eq!(
        s.fence_begin(&la.fence(), &id2, b"fp", at(3))
            .await
            .unwrap(),
        FenceBegin::Started
    );
    s.fence_release(&la.fence(), &id2).await.unwrap();
    assert_eq!(
        s.fence_begin(&lb.fence(), &id2, b"fp", at(4))
            .await
            .unwrap(),
        FenceBegin::Started
    );
}

pub async fn fence_of_a_dead_attempt(s: Arc<dyn Store>) {
    enqueue1(&*s, with_id(new_job("q", "1"), "a"), T0).await;
    let first = lease1(&*s, "q", T0).await;
    let id = fence_id("mail-1");
    assert_eq!(
        s.fence_begin(&first.fence(), &id, b"fp", T0).await.unwrap(),
        FenceBegin::Started
    );
    // The daemon dies between started and done.
    s.recover(at(10)).await.unwrap();
    let second = lease1(&*s, "q", at(10)).await;
    let FenceBegin::Abandoned(f) = s
        .fence_begin(&second.fence(), &id, b"fp", at(11))
        .await
        .unwrap()
    else {
        panic!("a fence started by a dead attempt is abandoned");
    };
    assert_eq!(
        (f.state, f.job_id.as_str(), f.token),
        (FenceState::Started, "a", first.token)
    );
    // The dead attempt cannot record anything any more once taken over.
    s.fence_take_over(&second.fence(), &id, at(12))
        .await
        .unwrap();
    assert!(
        s.fence_done(&first.fence(), &id, b"late".to_vec(), at(12))
            .await
            .is_err()
    );
    // Another job sees the fence held by a live attempt.
    enqueue1(&*s, with_id(new_job("q", "2"), "b"), at(12)).await;
    let other = lease1(&*s, "q", at(12)).await;
    assert_eq!(
        s.fence_begin(&other.fence(), &id, b"fp", at(12))
            .await
            .unwrap(),
        FenceBegin::InProgress { job_id: "a".into() }
    );
    // The holder's own next call finds its earlier call over: unknown.
    assert!(matches!(
        s.fence_begin(&second.fence(), &id, b"fp", at(12))
            .await
            .unwrap(),
        FenceBegin::Abandoned(_)
    ));
    s.fence_done(&second.fence(), &id, b"sent".to_vec(), at(13))
        .await
        .unwrap();
    let fences = s
        .fences(&fence_filter(Some("ns"), Some(FenceState::Done), 10))
        .await
        .unwrap();
    assert_eq!(fences.len(), 1);
    assert_eq!(
        (fences[0].attempt, fences[0].result.as_deref()),
        (2, Some(&b"sent"[..]))
    );
}

pub async fn uncertain_fences_and_resolution(s: Arc<dyn Store>) {
    enqueue1(&*s, with_id(new_job("q", "1"), "a"), T0).await;
    let first = lease1(&*s, "q", T0).await;
    let (done_id, not_done_id) = (fence_id("m-done"), fence_id("m-not-done"));
    for id in [&done_id, &not_done_id] {
        s.fence_begin(&first.fence(), id, b"fp", T0).await.unwrap();
    }
    // A live attempt's fence cannot be resolved by hand.
    assert!(matches!(
        s.fence_resolve(&done_id, Resolution::Done, at(1)).await,
        Err(StoreError::InvalidFence { .. })
    ));
    s.recover(at(10)).await.unwrap();
    let second = lease1(&*s, "q", at(10)).await;
    for id in [&done_id, &not_done_id] {
        assert!(matches!(
            s.fence_begin(&second.fence(), id, b"fp", at(11))
                .await
                .unwrap(),
            FenceBegin::Abandoned(_)
        ));
        s.fence_uncertain(&second.fence(), id, at(11))
            .await
            .unwrap();
        assert!(matches!(
            s.fence_begin(&second.fence(), id, b"fp", at(12))
                .await
                .unwrap(),
            FenceBegin::Uncertain(_)
        ));
    }
    let uncertain = s
        .fences(&fence_filter(None, Some(FenceState::Uncertain), 10))
        .await
        .unwrap();
    assert_eq!(uncertain.len(), 2);
    s.fence_resolve(&done_id, Resolution::Done, at(20))
        .await
        .unwrap();
    s.fence_resolve(&not_done_id, Resolution::NotDone, at(20))
        .await
        .unwrap();
    assert!(matches!(
        s.fence_begin(&second.fence(), &done_id, b"fp", at(21))
            .await
            .unwrap(),
        FenceBegin::Replay(_)
    ));
    assert_eq!(
        s.fence_begin(&second.fence(), &not_done_id, b"fp", at(21))
            .await
            .unwrap(),
        FenceBegin::Started
    );
    assert!(matches!(
        s.fence_resolve(&fence_id("nope"), Resolution::Done, at(22))
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(
        matches!(
            s.fence_resolve(&done_id, Resolution::NotDone, at(22)).await,
            Err(StoreError::InvalidFence { .. })
        ),
        "a done fence is not resolved again"
    );
}

pub async fn effects_are_recorded_per_attempt(s: Arc<dyn Store>) {
    let (id, _) = enqueue1(&*s, new_job("q", "1"), T0).await;
    let l = lease1(&*s, "q", T0).await;
    for (kind, key, outcome) in [("http", "k1", "performed"), ("email", "k2", "replayed")] {
        let record = EffectRecord {
            attempt: 1,
            kind: kind.into(),
            key: key.into(),
            outcome: outcome.into(),
            at: T0,
        };
        s.record_effect(&id, record).await.unwrap();
    }
    complete(&*s, &l, at(1)).await;
    let effects = s.effects(&id).await.unwrap();
    assert_eq!(
        effects
            .iter()
            .map(|e| (e.kind.as_str(), e.outcome.as_str()))
            .collect::<Vec<_>>(),
        [("http", "performed"), ("email", "replayed")]
    );
}
