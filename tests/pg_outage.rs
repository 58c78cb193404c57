//! The database goes away under running daemons (issue 10, item 5): while
//! PostgreSQL is down, enqueue answers 503 `storage_unavailable` and the
//! daemons stay up; when it is back they recover by themselves, without a
//! restart, and nothing acknowledged is lost or completed twice. Each test
//! starts a PostgreSQL server of its own (`scripts/pg-test-server`), since
//! it stops and restarts it; two daemons share it, so that one daemon's
//! leases lost in the outage are reclaimed by either. Leases are short
//! (`lease = "2s"`, `heartbeat = "500ms"`).

use crate::servers;
use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use servers::Payments;
use support::{Daemon, PgServer};

const STORE: &str = "[store]\nbackend = \"postgres\"\nurl = { env = \"KHATA_DATABASE_URL\" }\n\
     pool = 8\nlease = \"2s\"\nheartbeat = \"500ms\"\n";

/// Starts `n` daemons with the same jobs.toml on `pg`, each with its own
/// directory and port, and waits for `queue`'s plugin on each.
async fn start_daemons(
    n: usize,
    pg: &PgServer,
    queues: &str,
    plugins: &[(&str, &str)],
    queue: &str,
) -> Vec<Daemon> {
    let mut ds = Vec::new();
    for _ in 0..n {
        let mut d = Daemon::prepare(&format!("{STORE}\n{queues}"), plugins);
        d.env("KHATA_DATABASE_URL", &pg.url);
        d.start().await;
        d.wait_plugin(queue).await;
        ds.push(d);
    }
    ds
}

fn logs(ds: &[Daemon]) -> String {
    ds.iter()
        .enumerate()
        .map(|(i, d)| format!("--- daemon {i} ---\n{}", d.log()))
        .collect()
}

/// One number from `sql`, or the error while the server is away.
async fn try_sql_count(pg: &PgServer, sql: &str) -> Result<i64, String> {
    let (client, conn) = tokio_postgres::connect(&pg.url, tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    let task = tokio::spawn(conn);
    let n = client
        .query_one(sql, &[])
        .await
        .map(|r| r.get::<_, i64>(0))
        .map_err(|e| e.to_string());
    drop(client);
    let _ = task.await;
    n
}

async fn sql_count(pg: &PgServer, sql: &str) -> i64 {
    try_sql_count(pg, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Waits until `sql` counts at least `n` (errors while the server comes
/// back are waited out too), or panics after `secs` naming `what`.
async fn wait_count(pg: &PgServer, sql: &str, n: i64, secs: u64, what: &str, ds: &[Daemon]) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut last = Err(String::from("not asked yet"));
    loop {
        if let Ok(got) = &last
            && *got >= n
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {last:?} of {n} after {secs} s\n{}",
            logs(ds)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        last = try_sql_count(pg, sql).await;
    }
}

/// `ids` as an SQL array literal (the ids are the test's own, plain ASCII).
fn sql_ids(ids: &BTreeSet<String>) -> String {
    let quoted: Vec<String> = ids.iter().map(|i| format!("'{i}'")).collect();
    format!("ARRAY[{}]::text[]", quoted.join(","))
}

/// The checks every run ends with: each job of `ids` completed, with exactly
/// one completed attempt; no attempt left open (an attempt whose end could
/// not be recorded is closed as abandoned when its lease is reclaimed);
/// every attempt counted toward its job's budget.
async fn assert_each_completed_once(pg: &PgServer, ids: &BTreeSet<String>) {
    let ids_sql = sql_ids(ids);
    assert_eq!(
        sql_count(
            pg,
            &format!("SELECT COUNT(*) FROM jobs WHERE id = ANY({ids_sql}) AND state = 'completed'")
        )
        .await,
        ids.len() as i64,
        "every acknowledged job is in the ledger, completed"
    );
    assert_eq!(
        sql_count(
            pg,
            "SELECT COUNT(*) FROM jobs j WHERE (SELECT COUNT(*) FROM attempts a \
             WHERE a.job_id = j.id AND a.outcome = 'completed') <> \
             CASE WHEN j.state = 'completed' THEN 1 ELSE 0 END"
        )
        .await,
        0,
        "a completed job has exactly one completed attempt, any other job none"
    );
    assert_eq!(
        sql_count(pg, "SELECT COUNT(*) FROM attempts WHERE ended_at IS NULL").await,
        0,
        "no attempt is left open"
    );
    assert_eq!(
        sql_count(
            pg,
            "SELECT COUNT(*) FROM jobs j WHERE budget_used <> (SELECT COUNT(*) FROM attempts a WHERE a.job_id = j.id)"
        )
        .await,
        0,
        "every attempt, abandoned ones too, is counted toward its job's budget"
    );
}

/// A producer's enqueue: tries the daemons in turn until one acknowledges
/// the job (201, or 200 when an earlier try that looked failed had in fact
/// committed), taking 503 and connection errors as "try again". Returns how
/// many tries were refused. Panics on any other answer.
async fn enqueue_until_acknowledged(
    targets: &[(reqwest::Client, String)],
    queue: &str,
    body: &Value,
) -> usize {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut refused = 0;
    loop {
        let (http, url) = &targets[refused % targets.len()];
        match http
            .post(format!("{url}/v1/queues/{queue}/jobs"))
            .json(body)
            .send()
            .await
        {
            Ok(r) => {
                let status = r.status().as_u16();
                let v: Value = r.json().await.unwrap_or(Value::Null);
                match status {
                    200 | 201 => {
                        assert_eq!(v["job"]["id"], body["id"], "{v}");
                        return refused;
                    }
                    503 => assert_eq!(v["error"]["code"], "storage_unavailable", "{v}"),
                    _ => panic!("enqueue answered {status}: {v}"),
                }
            }
            Err(e) => assert!(
                e.is_connect() || e.is_request(),
                "enqueue failed unexpectedly: {e}"
            ),
        }
        refused += 1;
        assert!(
            Instant::now() < deadline,
            "job {} not acknowledged after {refused} tries",
            body["id"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn block<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// PostgreSQL stopped (`pg_ctl stop -m fast`) while attempts run, for longer
/// than a lease, then started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_answers_503_and_daemons_recover_by_themselves() {
    const BEFORE: usize = 60;
    const AFTER: usize = 40;
    let pg = block(PgServer::start);
    let queues = "[queues.work]\nplugin = \"chaos\"\nconcurrency = 4\nmax_attempts = 20\n\
                  backoff = { initial = \"10ms\", max = \"50ms\" }\ngrants = { kv = true }\n";
    let mut ds = start_daemons(2, &pg, queues, &[("chaos", "chaos")], "work").await;
    let mut acked = BTreeSet::new();
    for (n, d) in ds.iter().enumerate() {
        let jobs: Vec<Value> = (0..BEFORE / 2)
            .map(
                |i| json!({"id": format!("before-{n}-{i}"), "payload": {"do": "sleep", "ms": 150}}),
            )
            .collect();
        let (status, v) = d
            .call(
                "POST",
                "/v1/queues/work/jobs/batch",
                Some(json!({"jobs": jobs})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        acked.extend(jobs.iter().map(|j| j["id"].as_str().unwrap().to_owned()));
    }
    wait_count(
        &pg,
        "SELECT COUNT(*) FROM jobs WHERE state = 'completed'",
        8,
        60,
        "jobs completed before the outage",
        &ds,
    )
    .await;
    let active = sql_count(&pg, "SELECT COUNT(*) FROM jobs WHERE state = 'active'").await;
    for d in &ds {
        let (status, v) = d.call("GET", "/readyz", None).await;
        assert_eq!((status, &v["status"]), (200, &json!("ready")), "{v}");
    }

    block(|| pg.stop_server());
    // Down for longer than a lease: every heartbeat fails meanwhile.
    let down = Instant::now();
    let mut answers = 0;
    while down.elapsed() < Duration::from_secs(4) || answers < 4 {
        let d = &ds[answers % 2];
        let (status, v) = d
            .call(
                "POST",
                "/v1/queues/work/jobs",
                Some(json!({"id": format!("during-{answers}"), "payload": {}})),
            )
            .await;
        assert_eq!(status, 503, "enqueue while the database is down: {v}");
        assert_eq!(v["error"]["code"], "storage_unavailable", "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("PostgreSQL"),
            "the message names what is unavailable: {v}"
        );
        answers += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (i, d) in ds.iter_mut().enumerate() {
        assert!(
            d.running(),
            "daemon {i} exited while the database was down\n{}",
            d.log()
        );
        // Alive, not ready.
        let (status, _) = d.call("GET", "/healthz", None).await;
        assert_eq!(status, 200, "liveness while the database is down");
        let (status, v) = d.call("GET", "/readyz", None).await;
        assert_eq!(status, 503, "readiness while the database is down: {v}");
        assert_eq!(v["error"]["code"], "storage_unavailable", "{v}");
    }
    block(|| pg.start_server());

    // Each daemon takes enqueues again by itself (no restart of the daemon).
    let targets: Vec<(reqwest::Client, String)> =
        ds.iter().map(|d| (d.http.clone(), d.url.clone())).collect();
    for (n, t) in targets.iter().enumerate() {
        for i in 0..AFTER / 2 {
            let body =
                json!({"id": format!("after-{n}-{i}"), "payload": {"do": "sleep", "ms": 20}});
            enqueue_until_acknowledged(std::slice::from_ref(t), "work", &body).await;
            acked.insert(body["id"].as_str().unwrap().to_owned());
        }
    }
    for d in &ds {
        let (status, v) = d.call("GET", "/readyz", None).await;
        assert_eq!(status, 200, "ready again once the database is back: {v}");
    }
    let ids_sql = sql_ids(&acked);
    wait_count(
        &pg,
        &format!("SELECT COUNT(*) FROM jobs WHERE id = ANY({ids_sql}) AND state = 'completed'"),
        acked.len() as i64,
        120,
        "acknowledged jobs completed after the outage",
        &ds,
    )
    .await;
    assert_each_completed_once(&pg, &acked).await;
    // No enqueue answered 503 created a job: the server was down.
    assert_eq!(
        sql_count(&pg, "SELECT COUNT(*) FROM jobs WHERE id LIKE 'during-%'").await,
        0
    );
    let abandoned = sql_count(
        &pg,
        "SELECT COUNT(*) FROM attempts WHERE outcome = 'abandoned'",
    )
    .await;
    eprintln!(
        "{active} jobs active when the server stopped; {abandoned} attempts abandoned and redelivered"
    );
    for d in &mut ds {
        d.terminate();
    }
}

/// `pg_ctl restart -m fast` twice while charges run on two daemons and a
/// producer enqueues one order at a time: every order charged once at the
/// payment server, every job completed once, nothing acknowledged lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restarted_mid_run_charges_every_order_once() {
    const ORDERS: usize = 240;
    let pg = block(PgServer::start);
    let payments = Payments::start_with_delay(Duration::from_millis(60)).await;
    let queues = format!(
        "[queues.charge]\nplugin = \"charge_customer\"\nconcurrency = 8\nmax_attempts = 20\n\
         backoff = {{ initial = \"10ms\", max = \"50ms\" }}\ngrants = {{ http = [\"payments\"] }}\n\n\
         [http.payments]\nbase_url = \"{}\"\ntimeout = \"5s\"\nidempotency_header = \"Idempotency-Key\"\n",
        payments.url()
    );
    let mut ds = start_daemons(
        2,
        &pg,
        &queues,
        &[("charge_customer", "charge_customer")],
        "charge",
    )
    .await;
    let targets: Vec<(reqwest::Client, String)> =
        ds.iter().map(|d| (d.http.clone(), d.url.clone())).collect();
    let producer = tokio::spawn(async move {
        let mut refused = 0;
        for i in 0..ORDERS {
            let body = json!({"id": format!("order-{i}"), "payload": {"order_id": i, "amount": 100, "currency": "EUR", "customer": "c"}});
            // Alternate the first daemon asked.
            let start = i % targets.len();
            let order: Vec<_> = targets[start..]
                .iter()
                .chain(&targets[..start])
                .cloned()
                .collect();
            refused += enqueue_until_acknowledged(&order, "charge", &body).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        refused
    });
    for at in [30, 120] {
        wait_count(
            &pg,
            "SELECT COUNT(*) FROM jobs WHERE state = 'completed'",
            at,
            120,
            "charges completed before the restart",
            &ds,
        )
        .await;
        block(|| pg.restart());
    }
    let refused = producer.await.expect("the producer");
    let acked: BTreeSet<String> = (0..ORDERS).map(|i| format!("order-{i}")).collect();
    wait_count(
        &pg,
        "SELECT COUNT(*) FROM jobs WHERE state = 'completed'",
        ORDERS as i64,
        180,
        "charges completed",
        &ds,
    )
    .await;
    assert_each_completed_once(&pg, &acked).await;
    assert_eq!(
        sql_count(&pg, "SELECT COUNT(*) FROM jobs").await,
        ORDERS as i64,
        "one job per order, however often its enqueue was tried"
    );
    assert_eq!(payments.charges(), ORDERS, "one charge per order");
    let charged: BTreeSet<u64> = payments
        .requests()
        .iter()
        .filter_map(|r| r.body["order_id"].as_u64())
        .collect();
    assert_eq!(
        charged.len(),
        ORDERS,
        "every order reached the payment server"
    );
    for (i, d) in ds.iter_mut().enumerate() {
        assert!(d.running(), "daemon {i} exited\n{}", d.log());
    }
    let abandoned = sql_count(
        &pg,
        "SELECT COUNT(*) FROM attempts WHERE outcome = 'abandoned'",
    )
    .await;
    eprintln!(
        "{refused} enqueues refused during the restarts; {abandoned} attempts abandoned; {} requests to the payment server for {ORDERS} orders",
        payments.requests().len()
    );
    for d in &mut ds {
        d.terminate();
    }
}
