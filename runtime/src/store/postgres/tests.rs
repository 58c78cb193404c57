use crate::store::PutMode;
use crate::store::conformance::{LeaseUpTo, doc_at, put};
use crate::store::{LeaseAsk, LeaseLimits};
use std::sync::Arc;

use super::testing::TestDatabase;
use super::{PostgresStore, SCHEMA_VERSION, migrate};
use crate::job::{AttemptOutcome, Finish, JobState, Millis, NewJob};
use crate::store::{Store, StoreError};

async fn open_fresh() -> (TestDatabase, Arc<dyn Store>) {
    let db = TestDatabase::create().await;
    let store = PostgresStore::open(&db.url, 8).await.expect("open");
    (db, Arc::new(store))
}

crate::conformance_tests!(open_fresh);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_once_when_daemons_start_together() {
    let db = TestDatabase::create().await;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let url = db.url.clone();
            tokio::spawn(async move { migrate(&url).await })
        })
        .collect();
    let mut from_zero = 0;
    for r in runs {
        let m = r.await.unwrap().expect("migrate");
        assert_eq!(m.to, SCHEMA_VERSION);
        from_zero += usize::from(m.from == 0);
    }
    assert_eq!(
        from_zero, 1,
        "one of them migrated, the others found it done"
    );
    let again = migrate(&db.url).await.unwrap();
    assert_eq!((again.from, again.to), (SCHEMA_VERSION, SCHEMA_VERSION));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused() {
    let db = TestDatabase::create().await;
    migrate(&db.url).await.unwrap();
    let cfg = super::parse_url(&db.url).unwrap();
    let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
    let task = tokio::spawn(conn);
    client
        .batch_execute("INSERT INTO khata_schema_migrations (version) VALUES (999)")
        .await
        .unwrap();
    drop(client);
    let _ = task.await;
    let err = PostgresStore::open(&db.url, 2).await.unwrap_err();
    assert!(err.to_string().contains("newer than this khata"), "{err}");
}

/// Sets every active lease of the database to have expired a moment ago,
/// as the database's clock sees it: what a daemon paused past its lease
/// finds, without waiting for it.
async fn expire_leases(db: &TestDatabase) {
    let cfg = super::parse_url(&db.url).unwrap();
    let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
    let task = tokio::spawn(conn);
    client
        .batch_execute(
            "UPDATE jobs SET lease_expires_at = clock_timestamp() - interval '1 second' \
             WHERE state = 'active'",
        )
        .await
        .unwrap();
    drop(client);
    let _ = task.await;
}

fn new_job(id: &str, t0: Millis, max_attempts: u32) -> NewJob {
    NewJob {
        queue: "q".into(),
        id: Some(id.into()),
        payload: "{}".into(),
        priority: 0,
        run_at: t0,
        max_attempts,
        dedup_key: None,
        dedup_for: None,
    }
}

/// Two daemons on one database: each registers under its own id; a
/// lease that expired fences its holder at every step, its finish is
/// refused, the other daemon reclaims the job (the attempt recorded as
/// abandoned and counted) and completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_fenced_and_reclaimed_by_another_daemon() {
    let db = TestDatabase::create().await;
    let a = PostgresStore::open(&db.url, 2).await.expect("open a");
    let b = PostgresStore::open(&db.url, 2).await.expect("open b");
    assert_ne!(a.daemon_id(), b.daemon_id());
    let t0 = Millis(1_700_000_000_000);
    a.enqueue(vec![new_job("j", t0, 3)], t0).await.unwrap();
    let l = a.lease_up_to("q", 1, "v1", t0).await.unwrap().remove(0);
    let f = l.fence();
    a.kv_put(&f, put("ns", "k", b"1".to_vec(), PutMode::Replace), t0)
        .await
        .unwrap();
    // A live lease is not reclaimed, neither at start nor periodically.
    assert_eq!(b.recover(t0).await.unwrap(), 0);
    assert_eq!(b.reclaim_expired(t0).await.unwrap(), 0);
    assert!(a.heartbeat().await.unwrap().is_empty(), "renewed, not lost");

    expire_leases(&db).await;
    let fenced = |r: Result<(), StoreError>| {
        assert!(matches!(r, Err(StoreError::Fenced { .. })), "{r:?}");
    };
    fenced(
        a.kv_put(&f, put("ns", "k", b"2".to_vec(), PutMode::Replace), t0)
            .await
            .map(drop),
    );
    fenced(a.kv_get(&f, "ns", "k").await.map(|_| ()));
    fenced(
        a.index_upsert(&f, doc_at("c", "d", 1, "{}"), t0)
            .await
            .map(|_| ()),
    );
    let fid = crate::store::FenceId {
        namespace: "ns".into(),
        kind: "http".into(),
        key: "charge-1".into(),
    };
    fenced(a.fence_begin(&f, &fid, b"fp", t0).await.map(|_| ()));
    // Expired is lost, even before anyone reclaimed it.
    assert_eq!(a.heartbeat().await.unwrap(), vec![f.clone()]);

    assert_eq!(b.reclaim_expired(t0).await.unwrap(), 1);
    let j = b.job("j", t0).await.unwrap().unwrap();
    assert_eq!(j.state, crate::job::JobState::Waiting);
    assert_eq!(j.attempts[0].outcome, crate::job::AttemptOutcome::Abandoned);
    assert_eq!(j.budget_used, 1, "the abandoned attempt counts");

    let l2 = b.lease_up_to("q", 1, "v1", t0).await.unwrap().remove(0);
    assert!(l2.token > l.token, "a newer token");
    let done = a
        .finish(&f, Finish::Completed { result: "1".into() }, t0)
        .await;
    assert!(matches!(done, Err(StoreError::Fenced { .. })), "{done:?}");
    assert_eq!(
        b.kv_get(&l2.fence(), "ns", "k").await.unwrap(),
        Some(b"1".to_vec()),
        "the stale daemon's write after expiry changed nothing"
    );
    b.finish(&l2.fence(), Finish::Completed { result: "2".into() }, t0)
        .await
        .unwrap();
    let j = b.job("j", t0).await.unwrap().unwrap();
    assert_eq!(j.state, crate::job::JobState::Completed);
    assert_eq!(j.result.as_deref(), Some("2"));
    let outcomes: Vec<_> = j.attempts.iter().map(|a| a.outcome).collect();
    assert_eq!(
        outcomes,
        [
            crate::job::AttemptOutcome::Abandoned,
            crate::job::AttemptOutcome::Completed
        ]
    );
}

/// Two stores (daemons) on a fresh database, `n` jobs `j0..` waiting in
/// queue `q` at `t0`, and limits of `concurrency = 2`.
async fn two_daemons_limited_to_two(
    n: usize,
) -> (
    TestDatabase,
    PostgresStore,
    PostgresStore,
    Millis,
    crate::store::LeaseLimits,
) {
    let db = TestDatabase::create().await;
    let a = PostgresStore::open(&db.url, 2).await.expect("open a");
    let b = PostgresStore::open(&db.url, 2).await.expect("open b");
    let t0 = Millis(1_700_000_000_000);
    let jobs = (0..n).map(|i| new_job(&format!("j{i}"), t0, 3)).collect();
    a.enqueue(jobs, t0).await.unwrap();
    let two = crate::store::LeaseLimits {
        concurrency: Some(2),
        rate: None,
    };
    (db, a, b, t0, two)
}

/// A lease within limits counts every daemon's leases. `concurrency = 2`: two
/// daemons lease two jobs in all, a lease held back says so, and the
/// next end of an attempt of the queue wakes the waiting daemons; an
/// expired lease no longer counts. `rate_limit = 2 per minute`: the
/// third start, on either daemon, waits, and the store says for how long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_within_counts_every_daemons_leases() {
    use crate::store::{Held, LeaseLimits, RateWindow};
    let (db, a, b, t0, two) = two_daemons_limited_to_two(6).await;
    let first = a.lease(&ask("q", 1, two), t0).await.unwrap();
    assert_eq!((first.leases.len(), first.held), (1, None));
    let second = b.lease(&ask("q", 5, two), t0).await.unwrap();
    assert_eq!(
        (second.leases.len(), second.held),
        (1, Some(Held::Concurrency))
    );
    let none = a.lease(&ask("q", 5, two), t0).await.unwrap();
    assert_eq!((none.leases.len(), none.held), (0, Some(Held::Concurrency)));
    let mut wake = b.wakeups().expect("postgres has wake-ups");
    assert_eq!(wake.recv().await.as_deref(), Some("*"));
    let done = Finish::Completed { result: "1".into() };
    a.finish(&first.leases[0].fence(), done, t0).await.unwrap();
    assert_eq!(
        wake.recv().await.as_deref(),
        Some("q"),
        "the end of an attempt wakes the daemons that wait for room"
    );
    let third = b.lease(&ask("q", 5, two), t0).await.unwrap();
    assert_eq!(third.leases.len(), 1);
    expire_leases(&db).await;
    let after = a.lease(&ask("q", 5, two), t0).await.unwrap();
    assert_eq!(after.leases.len(), 2, "expired leases do not count");

    let per = std::time::Duration::from_secs(60);
    let rate = LeaseLimits {
        concurrency: None,
        rate: Some(RateWindow { max: 2, per }),
    };
    let limited = (0..3)
        .map(|i| NewJob {
            queue: "r".into(),
            ..new_job(&format!("r{i}"), t0, 3)
        })
        .collect();
    a.enqueue(limited, t0).await.unwrap();
    let x = a.lease(&ask("r", 1, rate), t0).await.unwrap();
    assert_eq!((x.leases.len(), x.held), (1, None));
    let y = b.lease(&ask("r", 5, rate), t0).await.unwrap();
    assert_eq!(y.leases.len(), 1);
    let z = a.lease(&ask("r", 5, rate), t0).await.unwrap();
    assert!(z.leases.is_empty());
    match z.held {
        Some(Held::Rate(wait)) => assert!(wait > std::time::Duration::ZERO && wait <= per),
        other => panic!("held back by the rate limit, not {other:?}"),
    }
}

/// An attempt whose finish is on its way (its handler ended) leaves
/// room in its own daemon's concurrency at once (unless another daemon
/// waits for room), and in the others' only once that finish commits; a
/// waiting daemon hears of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_attempt_leaves_room_in_its_own_daemon_first() {
    use crate::store::Held;
    let (db, a, b, t0, two) = two_daemons_limited_to_two(4).await;
    let first = a.lease(&ask("q", 2, two), t0).await.unwrap();
    assert_eq!(first.leases.len(), 2);
    // The first attempt's handler ended; its finish is not committed.
    let ended = &first.leases[0];
    a.ending.lock().unwrap().insert(super::i64_of(ended.token));
    let own = a.lease(&ask("q", 2, two), t0).await.unwrap();
    assert_eq!(
        (own.leases.len(), own.held),
        (1, Some(Held::Concurrency)),
        "its own daemon does not count it"
    );
    let held = b.lease(&ask("q", 2, two), t0).await.unwrap();
    assert_eq!(
        (held.leases.len(), held.held),
        (0, Some(Held::Concurrency)),
        "another daemon counts it until its finish commits"
    );
    let fair = a.lease(&ask("q", 2, two), t0).await.unwrap();
    assert_eq!(
        (fair.leases.len(), fair.held),
        (0, Some(Held::Concurrency)),
        "while another daemon waits, its own daemon counts it too"
    );
    a.ending.lock().unwrap().clear();
    let mut wake = b.wakeups().expect("postgres has wake-ups");
    assert_eq!(wake.recv().await.as_deref(), Some("*"));
    let done = Finish::Completed { result: "1".into() };
    a.finish(&ended.fence(), done, t0).await.unwrap();
    assert!(
        a.ending().is_empty(),
        "a finish answered is no longer ending"
    );
    assert_eq!(
        wake.recv().await.as_deref(),
        Some("q"),
        "the waiting daemon is woken once the finish committed"
    );
    let c = PostgresStore::open(&db.url, 2).await.expect("open c");
    let waits = c.client().await.unwrap();
    let left = waits
        .query_one("SELECT COUNT(*) FROM queue_waits", &[])
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(left, 0, "the wait was consumed by its wake-up");
}

/// A lease that expires before its attempt ends, not yet reclaimed: the
/// finish is refused and the attempt closed as abandoned; the job is
/// reclaimed at the next pass, dead when its budget is used up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_after_expiry_is_refused_and_the_budget_holds() {
    let db = TestDatabase::create().await;
    let a = PostgresStore::open(&db.url, 2).await.expect("open");
    let t0 = Millis(1_700_000_000_000);
    a.enqueue(vec![new_job("j", t0, 1)], t0).await.unwrap();
    let l = a.lease_up_to("q", 1, "v1", t0).await.unwrap().remove(0);
    expire_leases(&db).await;
    let r = a
        .finish(&l.fence(), Finish::Completed { result: "1".into() }, t0)
        .await;
    assert!(matches!(r, Err(StoreError::Fenced { .. })), "{r:?}");
    let j = a.job("j", t0).await.unwrap().unwrap();
    assert_eq!(j.state, crate::job::JobState::Active, "until reclaimed");
    assert_eq!(j.attempts[0].outcome, crate::job::AttemptOutcome::Abandoned);
    assert_eq!(a.reclaim_expired(t0).await.unwrap(), 1);
    let j = a.job("j", t0).await.unwrap().unwrap();
    assert_eq!(j.state, crate::job::JobState::Dead, "{j:?}");
    assert!(
        j.last_error.as_deref().unwrap_or("").contains("budget"),
        "{j:?}"
    );
}

/// An enqueue on one daemon wakes the others' listeners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_notifies_every_listening_daemon() {
    let db = TestDatabase::create().await;
    let a = PostgresStore::open(&db.url, 2).await.expect("open a");
    let b = PostgresStore::open(&db.url, 2).await.expect("open b");
    let mut wake = b.wakeups().expect("postgres has wake-ups");
    assert_eq!(
        wake.recv().await.as_deref(),
        Some("*"),
        "first: every queue"
    );
    let t0 = Millis(1_700_000_000_000);
    a.enqueue(vec![new_job("j", t0, 3)], t0).await.unwrap();
    assert_eq!(wake.recv().await.as_deref(), Some("q"));
}

/// Leases from many connections at once: `SKIP LOCKED` gives each job
/// to one attempt, tokens are unique, and the sharded counters add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_leases_take_each_job_once() {
    let (_db, s) = open_fresh().await;
    let t0 = Millis(1_700_000_000_000);
    let jobs: Vec<NewJob> = (0..200)
        .map(|i| NewJob {
            queue: "q".into(),
            id: Some(format!("j{i}")),
            payload: "{}".into(),
            priority: 0,
            run_at: t0,
            max_attempts: 3,
            dedup_key: None,
            dedup_for: None,
        })
        .collect();
    s.enqueue(jobs, t0).await.unwrap();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let leases = s.lease_up_to("q", 5, "v1", t0).await.unwrap();
                    if leases.is_empty() {
                        return mine;
                    }
                    for l in leases {
                        s.finish(&l.fence(), Finish::Completed { result: "1".into() }, t0)
                            .await
                            .unwrap();
                        mine.push((l.job_id, l.token));
                    }
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    assert_eq!(all.len(), 200, "every job leased once");
    let mut ids: Vec<_> = all.iter().map(|(id, _)| id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 200, "no job leased twice");
    let mut tokens: Vec<_> = all.iter().map(|(_, t)| *t).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 200, "tokens are unique");
    let counts = s.counts(t0).await.unwrap();
    let q = &counts.iter().find(|(q, _)| q == "q").unwrap().1;
    assert_eq!((q.completed, q.waiting, q.active), (200, 0, 0), "{q:?}");
}

/// Two batches naming the same ids in opposite orders deadlock in the
/// server; the loser reruns and finds the winner's jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_batches_create_each_job_once() {
    let (_db, s) = open_fresh().await;
    let t0 = Millis(1_700_000_000_000);
    let job = |id: &str| NewJob {
        queue: "q".into(),
        id: Some(id.into()),
        payload: "{}".into(),
        priority: 0,
        run_at: t0,
        max_attempts: 3,
        dedup_key: Some(format!("key-{id}")),
        dedup_for: None,
    };
    for round in 0..5 {
        let (x, y) = (format!("x{round}"), format!("y{round}"));
        let forward = vec![job(&x), job(&y)];
        let backward = vec![job(&y), job(&x)];
        let (a, b) = tokio::join!(
            {
                let s = Arc::clone(&s);
                async move { s.enqueue(forward, t0).await }
            },
            {
                let s = Arc::clone(&s);
                async move { s.enqueue(backward, t0).await }
            }
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        let created = a.iter().chain(&b).filter(|e| !e.deduplicated).count();
        assert_eq!(created, 2, "round {round}: {a:?} {b:?}");
    }
    let counts = s.counts(t0).await.unwrap();
    assert_eq!(counts[0].1.waiting, 10);
}

/// Sends `reqs` to the finisher as one group and returns each answer.
async fn finish_as_one_group(
    store: &PostgresStore,
    reqs: Vec<(crate::job::LeaseRef, Finish, Millis)>,
) -> Vec<Result<JobState, StoreError>> {
    let mut group = Vec::new();
    let mut answers = Vec::new();
    for (lease, finish, now) in reqs {
        let (answer, answered) = tokio::sync::oneshot::channel();
        group.push(super::FinishReq {
            lease,
            finish,
            now,
            answer,
        });
        answers.push(answered);
    }
    super::finish_group(&store.pool, &store.target, group).await;
    let mut out = Vec::new();
    for a in answers {
        out.push(a.await.expect("every finish of the group is answered"));
    }
    out
}

/// The transactions that last wrote the rows of `table` named by `ids`
/// (`job_id` for attempts), one per row.
async fn writers(db: &TestDatabase, table: &str, ids: &[&str]) -> Vec<String> {
    let cfg = super::parse_url(&db.url).unwrap();
    let (client, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
    let task = tokio::spawn(conn);
    let column = if table == "jobs" { "id" } else { "job_id" };
    let ids: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
    let rows = client
        .query(
            &format!("SELECT xmin::text FROM {table} WHERE {column} = ANY($1::text[])"),
            &[&ids],
        )
        .await
        .unwrap();
    drop(client);
    let _ = task.await;
    rows.iter().map(|r| r.get(0)).collect()
}

/// One group of finishes, one transaction: every kind of end commits
/// with its own rules (completed, retried with its backoff, dead with
/// its dedup key released, interrupted without counting), a cancelled
/// job's finish is `Fenced` with its attempt closed as cancelled, an
/// expired lease's finish is `Fenced` with its attempt abandoned, a
/// job that does not exist is `NotFound`, and none of these undoes the
/// others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_finishes_commits_each_by_its_own_rules() {
    let db = TestDatabase::create().await;
    let s = PostgresStore::open(&db.url, 4).await.expect("open");
    let t0 = Millis(1_700_000_000_000);
    let names = ["done", "again", "dead", "stop", "gone", "late"];
    let mut jobs: Vec<NewJob> = names.iter().map(|n| new_job(n, t0, 3)).collect();
    jobs[2].dedup_key = Some("k".into());
    jobs[2].max_attempts = 1;
    s.enqueue(jobs, t0).await.unwrap();
    let leases = s.lease_up_to("q", 10, "v1", t0).await.unwrap();
    assert_eq!(leases.len(), 6);
    let lease = |id: &str| leases.iter().find(|l| l.job_id == id).unwrap().fence();
    s.cancel("gone", t0).await.unwrap();
    // Only `late`'s lease has run out.
    let (client, conn) = super::parse_url(&db.url)
        .unwrap()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    client
        .execute(
            "UPDATE jobs SET lease_expires_at = clock_timestamp() - interval '1 second' \
             WHERE id = 'late'",
            &[],
        )
        .await
        .unwrap();
    drop(client);
    let _ = task.await;
    let t1 = Millis(t0.0 + 5);
    let retry_at = Millis(t0.0 + 60_000);
    let answers = finish_as_one_group(
        &s,
        vec![
            (lease("done"), Finish::Completed { result: "r".into() }, t1),
            (
                lease("again"),
                Finish::Retry {
                    outcome: AttemptOutcome::Error,
                    error: "later".into(),
                    run_at: retry_at,
                },
                t1,
            ),
            (
                lease("dead"),
                Finish::Retry {
                    outcome: AttemptOutcome::Error,
                    error: "no".into(),
                    run_at: retry_at,
                },
                t1,
            ),
            (
                lease("stop"),
                Finish::Interrupted {
                    error: "shutdown".into(),
                },
                t1,
            ),
            (lease("gone"), Finish::Completed { result: "r".into() }, t1),
            (lease("late"), Finish::Completed { result: "r".into() }, t1),
            (
                crate::job::LeaseRef {
                    job_id: "nowhere".into(),
                    attempt: 1,
                    token: 1,
                },
                Finish::Completed { result: "r".into() },
                t1,
            ),
        ],
    )
    .await;
    assert_eq!(answers[0].as_ref().ok(), Some(&JobState::Completed));
    assert_eq!(answers[1].as_ref().ok(), Some(&JobState::Delayed));
    assert_eq!(answers[2].as_ref().ok(), Some(&JobState::Dead));
    assert_eq!(answers[3].as_ref().ok(), Some(&JobState::Waiting));
    assert!(
        matches!(answers[4], Err(StoreError::Fenced { .. })),
        "{:?}",
        answers[4]
    );
    assert!(
        matches!(answers[5], Err(StoreError::Fenced { .. })),
        "{:?}",
        answers[5]
    );
    assert!(
        matches!(&answers[6], Err(StoreError::NotFound(id)) if id == "nowhere"),
        "{:?}",
        answers[6]
    );

    let job = |id: &'static str| {
        let s = &s;
        async move { s.job(id, t1).await.unwrap().unwrap() }
    };
    let done = job("done").await;
    assert_eq!(
        (done.state, done.result.as_deref()),
        (JobState::Completed, Some("r"))
    );
    assert_eq!(done.attempts[0].outcome, AttemptOutcome::Completed);
    let again = job("again").await;
    assert_eq!(
        (again.state, again.run_at, again.last_error.as_deref()),
        (JobState::Delayed, retry_at, Some("later"))
    );
    let dead = job("dead").await;
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(
        dead.last_error.as_deref(),
        Some("no (attempt budget of 1 used up)")
    );
    let stop = job("stop").await;
    assert_eq!(
        (stop.state, stop.budget_used, stop.attempts[0].outcome),
        (JobState::Waiting, 0, AttemptOutcome::Interrupted)
    );
    let gone = job("gone").await;
    assert_eq!(
        (gone.state, gone.attempts[0].outcome),
        (JobState::Cancelled, AttemptOutcome::Cancelled)
    );
    let late = job("late").await;
    assert_eq!(late.state, JobState::Active, "left for a reclaim");
    assert_eq!(late.attempts[0].outcome, AttemptOutcome::Abandoned);
    // The dead job's dedup key was released with it.
    let mut again_k = new_job("k2", t1, 3);
    again_k.dedup_key = Some("k".into());
    let e = s.enqueue(vec![again_k], t1).await.unwrap();
    assert!(!e[0].deduplicated, "{e:?}");

    // Every write of the group is one transaction's.
    let moved = ["done", "again", "dead", "stop"];
    let mut xids = writers(&db, "jobs", &moved).await;
    xids.extend(
        writers(
            &db,
            "attempts",
            &["done", "again", "dead", "stop", "gone", "late"],
        )
        .await,
    );
    xids.sort();
    xids.dedup();
    assert_eq!(xids.len(), 1, "one transaction wrote the group: {xids:?}");
}

/// A finish that the server refuses (here an error text holding NUL,
/// which PostgreSQL text cannot store) fails alone: the group is
/// applied again one finish at a time, and the others commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_finish_fails_alone() {
    let db = TestDatabase::create().await;
    let s = PostgresStore::open(&db.url, 4).await.expect("open");
    let t0 = Millis(1_700_000_000_000);
    s.enqueue(
        vec![
            new_job("a", t0, 3),
            new_job("b", t0, 3),
            new_job("c", t0, 3),
        ],
        t0,
    )
    .await
    .unwrap();
    let leases = s.lease_up_to("q", 3, "v1", t0).await.unwrap();
    let reqs = leases
        .iter()
        .map(|l| {
            let finish = if l.job_id == "b" {
                Finish::Fail {
                    outcome: AttemptOutcome::Error,
                    error: "nul \0 here".into(),
                }
            } else {
                Finish::Completed { result: "r".into() }
            };
            (l.fence(), finish, t0)
        })
        .collect();
    let answers = finish_as_one_group(&s, reqs).await;
    for (l, a) in leases.iter().zip(&answers) {
        if l.job_id == "b" {
            assert!(matches!(a, Err(StoreError::Unavailable(_))), "{a:?}");
        } else {
            assert_eq!(a.as_ref().ok(), Some(&JobState::Completed), "{}", l.job_id);
        }
    }
    for (id, state) in [
        ("a", JobState::Completed),
        ("b", JobState::Active),
        ("c", JobState::Completed),
    ] {
        assert_eq!(s.job(id, t0).await.unwrap().unwrap().state, state, "{id}");
    }
}

/// Concurrent finishes through the trait: each caller gets its own
/// answer (the cancelled jobs' finishes `Fenced`, the others
/// `Completed`), whichever groups they shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_finishes_each_get_their_answer() {
    let (_db, s) = open_fresh().await;
    let t0 = Millis(1_700_000_000_000);
    let jobs: Vec<NewJob> = (0..300).map(|i| new_job(&format!("j{i}"), t0, 3)).collect();
    s.enqueue(jobs, t0).await.unwrap();
    let leases = s.lease_up_to("q", 300, "v1", t0).await.unwrap();
    assert_eq!(leases.len(), 300);
    for i in (0..300).step_by(7) {
        s.cancel(&format!("j{i}"), t0).await.unwrap();
    }
    let finishing: Vec<_> = leases
        .into_iter()
        .map(|l| {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                let r = s
                    .finish(&l.fence(), Finish::Completed { result: "1".into() }, t0)
                    .await;
                (l.job_id, r)
            })
        })
        .collect();
    for f in finishing {
        let (id, r) = f.await.unwrap();
        let n: usize = id[1..].parse().unwrap();
        if n.is_multiple_of(7) {
            assert!(matches!(r, Err(StoreError::Fenced { .. })), "{id}: {r:?}");
        } else {
            assert_eq!(r.ok(), Some(JobState::Completed), "{id}");
        }
    }
    let counts = s.counts(t0).await.unwrap();
    let q = &counts.iter().find(|(q, _)| q == "q").unwrap().1;
    assert_eq!((q.completed, q.cancelled, q.active), (257, 43, 0), "{q:?}");
}

/// Batches with overlapping ids enqueued at once through two stores (two
/// daemons) on one database: one job per id, the other batch's answer
/// for it deduplicated to that job; a batch naming an existing id with
/// another payload is refused whole (`IdReused`, with its index).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_batches_on_two_daemons_create_each_job_once() {
    let db = TestDatabase::create().await;
    let a: Arc<dyn Store> = Arc::new(PostgresStore::open(&db.url, 4).await.expect("open"));
    let b: Arc<dyn Store> = Arc::new(PostgresStore::open(&db.url, 4).await.expect("open"));
    let t0 = Millis(1_700_000_000_000);
    for round in 0..5 {
        let ids = |r: std::ops::Range<usize>| -> Vec<NewJob> {
            r.map(|i| new_job(&format!("r{round}-{i}"), t0, 3))
                .collect()
        };
        let forward = ids(0..100);
        let mut backward = ids(50..150);
        backward.reverse();
        let (x, y) = tokio::join!(
            {
                let a = Arc::clone(&a);
                async move { a.enqueue(forward, t0).await }
            },
            {
                let b = Arc::clone(&b);
                async move { b.enqueue(backward, t0).await }
            }
        );
        let (x, y) = (x.unwrap(), y.unwrap());
        let mut created: Vec<&str> = x
            .iter()
            .chain(&y)
            .filter(|e| !e.deduplicated)
            .map(|e| e.job.id.as_str())
            .collect();
        created.sort_unstable();
        created.dedup();
        assert_eq!(
            created.len(),
            x.iter().chain(&y).filter(|e| !e.deduplicated).count(),
            "round {round}: an id created twice"
        );
        assert_eq!(created.len(), 150, "round {round}");
        for e in x.iter().chain(&y) {
            assert_eq!(e.job.state, JobState::Waiting, "{e:?}");
        }
    }
    let counts = a.counts(t0).await.unwrap();
    assert_eq!(counts[0].1.waiting, 750);

    let mut clash = vec![new_job("fresh", t0, 3), new_job("r0-7", t0, 3)];
    clash[1].payload = r#"{"other":1}"#.into();
    let err = b.enqueue(clash, t0).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::IdReused { id, index: 1 } if id == "r0-7"),
        "{err:?}"
    );
    assert!(a.job("fresh", t0).await.unwrap().is_none(), "all or none");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_url_does_not_echo_the_password() {
    let err = PostgresStore::open("postgres://u:s3cret@127.0.0.1:notaport/db", 1)
        .await
        .unwrap_err();
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

/// A lease of up to `max` jobs of `queue` within `limits`.
fn ask(queue: &str, max: u32, limits: LeaseLimits) -> LeaseAsk<'_> {
    LeaseAsk {
        queue,
        max,
        plugin_version: "v1",
        limits,
    }
}
