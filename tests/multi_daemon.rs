//! Several daemons on one PostgreSQL database (docs/multi-daemon.md): leases that
//! expire and are renewed by heartbeat, a killed daemon's jobs redelivered by
//! the others, a paused daemon fenced, dedup and schedules across daemons.
//! The server is named by `KHATA_TEST_PG_URL`; each test gets a database of
//! its own. Leases are short here (`lease = "2s"`, `heartbeat = "500ms"`).

use crate::servers;
use crate::support;

use std::process::Command;
use std::time::{Duration, Instant};

use khata::store::postgres::testing::TestDatabase;
use serde_json::{Value, json};
use servers::Payments;
use support::Daemon;

const STORE: &str = "[store]\nbackend = \"postgres\"\nurl = { env = \"KHATA_DATABASE_URL\" }\n\
     pool = 8\nlease = \"2s\"\nheartbeat = \"500ms\"\n";

fn payments_provider(payments: &Payments) -> String {
    format!(
        "[http.payments]\nbase_url = \"{}\"\ntimeout = \"5s\"\nidempotency_header = \"Idempotency-Key\"\n",
        payments.url()
    )
}

/// Prepares `n` daemons with the same jobs.toml on database `db` (each with
/// its own directory and port), without starting them.
fn prepare(n: usize, db: &TestDatabase, queues: &str, plugins: &[(&str, &str)]) -> Vec<Daemon> {
    (0..n)
        .map(|_| {
            let mut d = Daemon::prepare(&format!("{STORE}\n{queues}"), plugins);
            d.env("KHATA_DATABASE_URL", &db.url);
            d
        })
        .collect()
}

async fn sql_rows(db: &TestDatabase, sql: &str) -> Vec<tokio_postgres::Row> {
    let (client, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    let task = tokio::spawn(conn);
    let rows = client.query(sql, &[]).await.expect(sql);
    drop(client);
    let _ = task.await;
    rows
}

async fn sql_count(db: &TestDatabase, sql: &str) -> i64 {
    sql_rows(db, sql).await[0].get(0)
}

/// A random-enough duration in `lo..hi` ms, without a seed to manage.
fn jitter_ms(lo: u64, hi: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    lo + u64::from(nanos) % (hi - lo)
}

fn signal(d: &Daemon, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &d.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig}");
}

/// Waits until `sql` counts `n`.
async fn wait_sql(db: &TestDatabase, sql: &str, n: i64, what: &str, logs: &[&Daemon]) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let got = sql_count(db, sql).await;
        if got == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {got} of {n}\n{}",
            logs.iter()
                .enumerate()
                .map(|(i, d)| format!("--- daemon {i} ---\n{}", d.log()))
                .collect::<String>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Three daemons share the work; one is killed twice at random moments and
/// restarted. Every job completes once (one completed attempt each), every
/// order is charged once at the server, and the killed daemon's attempts
/// are recorded as abandoned and redelivered after their leases expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_daemons_complete_every_job_once_across_kill_nine() {
    const ECHO: usize = 5000;
    const ORDERS: usize = 500;
    let db = TestDatabase::create().await;
    let payments = Payments::start_with_delay(Duration::from_millis(40)).await;
    let queues = format!(
        "[queues.echo]\nplugin = \"echo\"\nconcurrency = 8\n\n\
         [queues.charge]\nplugin = \"charge_customer\"\nconcurrency = 8\nmax_attempts = 20\n\
         backoff = {{ initial = \"10ms\", max = \"50ms\" }}\ngrants = {{ http = [\"payments\"] }}\n\n{}",
        payments_provider(&payments)
    );
    let mut ds = prepare(
        3,
        &db,
        &queues,
        &[("echo", "echo"), ("charge_customer", "charge_customer")],
    );
    for d in &mut ds {
        d.start().await;
        d.wait_plugin("echo").await;
        d.wait_plugin("charge").await;
    }
    // Enqueued through every daemon in turn.
    for (b, start) in (0..ECHO).step_by(250).enumerate() {
        let jobs: Vec<Value> = (start..start + 250)
            .map(|i| json!({"id": format!("echo-{i}"), "payload": {"i": i}}))
            .collect();
        let (status, v) = ds[b % 3]
            .call(
                "POST",
                "/v1/queues/echo/jobs/batch",
                Some(json!({"jobs": jobs})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    for (b, start) in (0..ORDERS).step_by(100).enumerate() {
        let jobs: Vec<Value> = (start..start + 100)
            .map(|i| json!({"id": format!("order-{i}"), "payload": {"order_id": i, "amount": 100, "currency": "EUR", "customer": "c"}}))
            .collect();
        let (status, v) = ds[(b + 1) % 3]
            .call(
                "POST",
                "/v1/queues/charge/jobs/batch",
                Some(json!({"jobs": jobs})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    // Killed at random points of the run, while charges are in flight.
    for (lo, hi) in [(20, 150), (200, 400)] {
        let at = i64::try_from(jitter_ms(lo, hi)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while sql_count(
            &db,
            "SELECT COUNT(*) FROM jobs WHERE queue = 'charge' AND state = 'completed'",
        )
        .await
            < at
        {
            assert!(Instant::now() < deadline, "{}", ds[1].log());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ds[0].kill9();
        ds[0].start().await;
    }
    let logs: Vec<&Daemon> = ds.iter().collect();
    wait_sql(
        &db,
        "SELECT COUNT(*) FROM jobs WHERE queue = 'echo' AND state = 'completed'",
        ECHO as i64,
        "echo jobs completed",
        &logs,
    )
    .await;
    wait_sql(
        &db,
        "SELECT COUNT(*) FROM jobs WHERE queue = 'charge' AND state = 'completed'",
        ORDERS as i64,
        "charges completed",
        &logs,
    )
    .await;

    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM jobs j WHERE (SELECT COUNT(*) FROM attempts a \
             WHERE a.job_id = j.id AND a.outcome = 'completed') <> 1"
        )
        .await,
        0,
        "every job has exactly one completed attempt"
    );
    assert_eq!(
        sql_count(&db, "SELECT COUNT(*) FROM attempts WHERE ended_at IS NULL").await,
        0,
        "no attempt left open"
    );
    let others = sql_rows(
        &db,
        "SELECT outcome, COUNT(*) FROM attempts WHERE outcome NOT IN ('completed', 'abandoned') GROUP BY outcome",
    )
    .await;
    assert!(
        others.is_empty(),
        "attempts end completed, or abandoned by the killed daemon: {:?}",
        others
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .collect::<Vec<_>>()
    );
    let abandoned = sql_count(
        &db,
        "SELECT COUNT(*) FROM attempts WHERE outcome = 'abandoned'",
    )
    .await;
    assert!(
        abandoned >= 1,
        "the killed daemon held leases: their attempts are recorded as abandoned"
    );
    // Each abandoned attempt counted toward its job's budget.
    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM jobs j WHERE budget_used <> (SELECT COUNT(*) FROM attempts a WHERE a.job_id = j.id)"
        )
        .await,
        0,
        "every attempt, abandoned ones too, is counted"
    );
    assert_eq!(payments.charges(), ORDERS, "one charge per order");
    for i in 0..ORDERS {
        let j = ds[i % 3].job(&format!("order-{i}")).await;
        assert_eq!(j["state"], "completed", "{j}");
    }
    let daemons = sql_count(&db, "SELECT COUNT(*) FROM daemons").await;
    assert_eq!(daemons, 5, "three daemons and two restarts registered");
    eprintln!(
        "{abandoned} attempts abandoned by the killed daemon and redelivered; {} requests to the payment server for {ORDERS} orders",
        payments.requests().len()
    );
    for d in &mut ds {
        d.terminate();
    }
}

/// The same id and the same dedup key enqueued through three daemons at
/// once: one job per id, one live job per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_enqueues_through_different_daemons_make_one_job() {
    let db = TestDatabase::create().await;
    // No plugin: the jobs stay waiting, so that every dedup key stays live.
    let mut ds = prepare(3, &db, "[queues.held]\nplugin = \"absent\"\n", &[]);
    for d in &mut ds {
        d.start().await;
    }
    for round in 0..40 {
        let by_id = json!({"id": format!("same-{round}"), "payload": {"round": round}});
        let (a, b, c) = tokio::join!(
            ds[0].call("POST", "/v1/queues/held/jobs", Some(by_id.clone())),
            ds[1].call("POST", "/v1/queues/held/jobs", Some(by_id.clone())),
            ds[2].call("POST", "/v1/queues/held/jobs", Some(by_id.clone())),
        );
        let answers = [a, b, c];
        let created = answers.iter().filter(|(s, _)| *s == 201).count();
        assert_eq!(created, 1, "round {round}: {answers:?}");
        assert!(
            answers
                .iter()
                .all(|(s, v)| (*s == 201 || *s == 200) && v["job"]["id"] == by_id["id"]),
            "{answers:?}"
        );

        let key = format!("key-{round}");
        let (a, b, c) = tokio::join!(
            ds[0].call(
                "POST",
                "/v1/queues/held/jobs",
                Some(json!({"dedup_key": key, "payload": {"from": 0}}))
            ),
            ds[1].call(
                "POST",
                "/v1/queues/held/jobs",
                Some(json!({"dedup_key": key, "payload": {"from": 1}}))
            ),
            ds[2].call(
                "POST",
                "/v1/queues/held/jobs",
                Some(json!({"dedup_key": key, "payload": {"from": 2}}))
            ),
        );
        let answers = [a, b, c];
        let created = answers.iter().filter(|(s, _)| *s == 201).count();
        assert_eq!(created, 1, "round {round}: {answers:?}");
        let winner = &answers.iter().find(|(s, _)| *s == 201).unwrap().1["job"]["id"];
        assert!(
            answers.iter().all(|(_, v)| &v["job"]["id"] == winner),
            "every answer names the one job: {answers:?}"
        );
    }
    assert_eq!(
        sql_count(&db, "SELECT COUNT(*) FROM jobs WHERE id LIKE 'same-%'").await,
        40
    );
    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM jobs WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'active')"
        )
        .await,
        40,
        "one live job per key"
    );
    for d in &mut ds {
        d.terminate();
    }
}

/// A daemon stopped (SIGSTOP) while its job's handler runs, past its lease:
/// another daemon reclaims the job and completes it, charging once with a
/// newer fencing token. After SIGCONT the stale daemon performs nothing: its
/// next effect is refused as `fenced`, or its own heartbeat, finding the
/// lease lost, stops the attempt first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_daemon_is_fenced_and_its_job_completes_elsewhere() {
    let db = TestDatabase::create().await;
    let payments = Payments::start().await;
    let queues = format!(
        "[queues.stale]\nplugin = \"stale\"\ntimeout = \"60s\"\nmax_attempts = 5\n\
         grants = {{ kv = true, index = [\"docs\"], email = true, http = [\"payments\"] }}\n\
         [email]\ntransport = \"outbox\"\nfrom = \"hello@example.com\"\n{}",
        payments_provider(&payments)
    );
    let mut ds = prepare(2, &db, &queues, &[("stale", "stale")]);
    // Only the first daemon runs when the job arrives: it takes the job.
    ds[0].start().await;
    ds[0].wait_plugin("stale").await;
    let id = ds[0]
        .enqueue(
            "stale",
            json!({"id": "stale-1", "payload": {"do": "charge", "order": 1, "pause_ms": 5}}),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ds[0].log().contains("stale: charging later") {
        assert!(Instant::now() < deadline, "{}", ds[0].log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&ds[0], "-STOP");
    let stopped_at = Instant::now();

    ds[1].start().await;
    ds[1].wait_plugin("stale").await;
    let j = ds[1].wait_state(&id, "completed", 120).await;
    assert!(
        stopped_at.elapsed() >= Duration::from_secs(2),
        "redelivered only after the lease (2s) expired"
    );
    let attempts = j["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 2, "{j}");
    assert_eq!(attempts[0]["outcome"], "abandoned", "{j}");
    assert_eq!(attempts[1]["outcome"], "completed", "{j}");
    let newer = attempts[1]["fencing_token"].as_u64().expect("token");
    assert!(newer > attempts[0]["fencing_token"].as_u64().unwrap());

    signal(&ds[0], "-CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        let log = ds[0].log();
        if let Some(line) = log.lines().find(|l| l.contains("stale-charge {")) {
            break line.to_owned();
        }
        // The heartbeat stops the attempt either because the store said the
        // lease is gone, or because its own renewal timed out (the pause
        // outlasted the lease): both stop it before any effect.
        if log.contains("lease lost")
            || log.contains("leases expired while the store could not be reached")
        {
            break "stopped by its heartbeat: lease lost".to_owned();
        }
        assert!(Instant::now() < deadline, "{log}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if outcome.contains("stale-charge") {
        assert!(
            outcome.contains(r#""http_send":"fenced""#),
            "the stale attempt's charge is refused as fenced: {outcome}"
        );
    }
    eprintln!("the stale daemon after SIGCONT: {outcome}");
    // Let the stale attempt end, then look at what reached the server.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = payments.requests();
    assert_eq!(seen.len(), 1, "one request reached the server: {seen:?}");
    assert_eq!(
        seen[0].fencing_token.as_deref(),
        Some(newer.to_string().as_str()),
        "sent by the attempt holding the newer token"
    );
    assert_eq!(payments.charges(), 1);
    let j = ds[1].job(&id).await;
    assert_eq!(j["state"], "completed", "{j}");
    assert_eq!(
        j["attempts"].as_array().map(Vec::len),
        Some(2),
        "the stale attempt's end changed nothing: {j}"
    );
    for d in &mut ds {
        d.terminate();
    }
}

/// Three daemons with the same schedule: each fire time is one job, run once.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_fires_once_across_daemons() {
    let db = TestDatabase::create().await;
    // Daily, so that the seconds this test takes cannot span a fire time.
    let queues = "[queues.tick]\nplugin = \"echo\"\n\n\
                  [schedules.daily]\nqueue = \"tick\"\ncron = \"0 0 * * *\"\ncatch_up = \"all\"\n";
    let mut ds = prepare(3, &db, queues, &[("echo", "echo")]);
    for d in &mut ds {
        d.start().await;
        d.wait_plugin("tick").await;
    }
    // A new schedule fires from its first look at the clock on.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Every daemon's clock moves three days: each sees the same three fire
    // times and enqueues them.
    for d in &ds {
        let (status, v) = d
            .call("POST", "/v1/test/clock", Some(json!({"advance": "3d"})))
            .await;
        assert_eq!(status, 200, "{v}");
    }
    let logs: Vec<&Daemon> = ds.iter().collect();
    wait_sql(
        &db,
        "SELECT COUNT(*) FROM jobs WHERE id LIKE 'schedule:daily:%' AND state = 'completed'",
        3,
        "fire times run",
        &logs,
    )
    .await;
    // Give the slower daemons time to fire too, then count again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM jobs WHERE id LIKE 'schedule:daily:%'"
        )
        .await,
        3,
        "one job per fire time"
    );
    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM attempts WHERE job_id LIKE 'schedule:daily:%' AND outcome = 'completed'"
        )
        .await,
        3,
        "each run once"
    );
    for d in &mut ds {
        d.terminate();
    }
}

/// Enqueues `payloads` into `queue`, in turn through each daemon.
async fn enqueue_spread(ds: &[Daemon], queue: &str, payloads: Vec<Value>) {
    for (i, p) in payloads.into_iter().enumerate() {
        let (status, v) = ds[i % ds.len()]
            .call("POST", &format!("/v1/queues/{queue}/jobs"), Some(p))
            .await;
        assert_eq!(status, 201, "{v}");
    }
}

/// `concurrency` holds across daemons: three daemons serve one queue with
/// `concurrency = 2`, and each attempt holds its slot through a slow charge.
/// The payment server sees at most two charges in flight (each daemon alone
/// would allow two: six in all), and does see two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_holds_across_daemons() {
    const ORDERS: usize = 24;
    let db = TestDatabase::create().await;
    let payments = Payments::start_with_delay(Duration::from_millis(300)).await;
    let queues = format!(
        "[queues.charge]\nplugin = \"charge_customer\"\nconcurrency = 2\n\
         grants = {{ http = [\"payments\"] }}\n\n{}",
        payments_provider(&payments)
    );
    let mut ds = prepare(3, &db, &queues, &[("charge_customer", "charge_customer")]);
    for d in &mut ds {
        d.start().await;
        d.wait_plugin("charge").await;
    }
    let orders = (0..ORDERS)
        .map(|i| json!({"id": format!("order-{i}"), "payload": {"order_id": i, "amount": 100, "currency": "EUR", "customer": "c"}}))
        .collect();
    enqueue_spread(&ds, "charge", orders).await;
    let logs: Vec<&Daemon> = ds.iter().collect();
    wait_sql(
        &db,
        "SELECT COUNT(*) FROM jobs WHERE queue = 'charge' AND state = 'completed'",
        ORDERS as i64,
        "charges completed",
        &logs,
    )
    .await;
    assert_eq!(payments.charges(), ORDERS, "one charge per order");
    assert_eq!(
        payments.max_in_flight(),
        2,
        "charges in flight at once, all daemons together"
    );
    let daemons = sql_count(
        &db,
        "SELECT COUNT(DISTINCT lease_owner) FROM jobs WHERE queue = 'charge'",
    )
    .await;
    assert!(
        daemons >= 2,
        "the daemons shared the work: {daemons} ran jobs"
    );
    for d in &mut ds {
        d.terminate();
    }
}

/// `rate_limit` holds across daemons: three daemons serve one queue with
/// `rate_limit = { max = 3, per = "1s" }` (each alone would start three a
/// second: nine in all). Any four consecutive starts, of all daemons, span
/// at least the window on the database's clock, which is the clock the
/// limit is kept on (`attempts.leased_at`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_holds_across_daemons() {
    const JOBS: usize = 12;
    let db = TestDatabase::create().await;
    let queues = "[queues.limited]\nplugin = \"echo\"\nconcurrency = 8\n\
                  rate_limit = { max = 3, per = \"1s\" }\n";
    let mut ds = prepare(3, &db, queues, &[("echo", "echo")]);
    for d in &mut ds {
        d.start().await;
        d.wait_plugin("limited").await;
    }
    let jobs = (0..JOBS)
        .map(|i| json!({"id": format!("limited-{i}"), "payload": {"n": i}}))
        .collect();
    enqueue_spread(&ds, "limited", jobs).await;
    let logs: Vec<&Daemon> = ds.iter().collect();
    wait_sql(
        &db,
        "SELECT COUNT(*) FROM jobs WHERE queue = 'limited' AND state = 'completed'",
        JOBS as i64,
        "jobs completed",
        &logs,
    )
    .await;
    let started: Vec<std::time::SystemTime> = sql_rows(
        &db,
        "SELECT a.leased_at FROM attempts a JOIN jobs j ON j.id = a.job_id \
         WHERE j.queue = 'limited' ORDER BY a.leased_at",
    )
    .await
    .iter()
    .map(|r| r.get(0))
    .collect();
    assert_eq!(started.len(), JOBS, "one attempt per job");
    for w in started.windows(4) {
        let span = w[3].duration_since(w[0]).unwrap();
        assert!(
            span >= Duration::from_secs(1),
            "4 attempts started within {span:?}: {started:?}"
        );
    }
    let daemons = sql_count(
        &db,
        "SELECT COUNT(DISTINCT lease_owner) FROM jobs WHERE queue = 'limited'",
    )
    .await;
    assert!(
        daemons >= 2,
        "the daemons shared the work: {daemons} ran jobs"
    );
    for d in &mut ds {
        d.terminate();
    }
}
