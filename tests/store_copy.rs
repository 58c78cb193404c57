//! `khata store copy` (docs/jobs-toml.md#moving-a-ledger): a ledger moves between SQLite, sled and
//! PostgreSQL with its jobs, attempts, effects, dedup keys, fences and kv, so
//! that a charge made before the move is replayed, not made again, after it.
//! The real daemon does the work on both sides; the copies are checked with
//! SQL of their own against both databases. PostgreSQL comes from
//! `KHATA_TEST_PG_URL`, a database per side.

use crate::servers;
use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use khata::store::copy::{self, Counters};
use khata::store::postgres::testing::TestDatabase;
use serde_json::{Value, json};
use servers::Payments;
use support::{Daemon, KHATA, payload};

const PLUGINS: &[(&str, &str)] = &[
    ("charge_customer", "charge_customer"),
    ("update_search_index", "update_search_index"),
    ("chaos", "chaos"),
];

const ON_POSTGRES: &str =
    "[store]\nbackend = \"postgres\"\nurl = { env = \"KHATA_DATABASE_URL\" }\npool = 4\n\n";

/// Charges through `payments` (idempotency key per order), products into
/// the index and kv, and a queue whose jobs can be made to sleep.
fn queues(payments: &str) -> String {
    format!(
        "[queues.charge]\nplugin = \"charge_customer\"\ngrants = {{ http = [\"payments\"] }}\n\n\
         [queues.idx]\nplugin = \"update_search_index\"\ngrants = {{ kv = true, index = [\"products\"] }}\n\n\
         [queues.slow]\nplugin = \"chaos\"\ntimeout = \"120s\"\ngrants = {{ kv = true }}\n\n\
         [http.payments]\nbase_url = \"{payments}\"\ntimeout = \"5s\"\nidempotency_header = \"Idempotency-Key\"\n"
    )
}

fn order(id: u32) -> Value {
    json!({"order_id": id, "amount": 1250, "currency": "EUR", "customer": "cus_7"})
}

async fn start(config: &str, db: Option<&TestDatabase>) -> Daemon {
    let mut d = Daemon::prepare(config, PLUGINS);
    if let Some(db) = db {
        d.env("KHATA_DATABASE_URL", &db.url);
    }
    d.start().await;
    for q in ["charge", "idx", "slow"] {
        d.wait_plugin(q).await;
    }
    d
}

/// Orders 1..=5 charged (order 5 under a dedup key held for an hour) and
/// three products indexed, all completed. Returns the charge jobs.
async fn charge_and_index(d: &Daemon, prefix: &str) -> Vec<Value> {
    let mut ids = Vec::new();
    for i in 1..=4 {
        ids.push(
            d.enqueue(
                "charge",
                json!({"id": format!("{prefix}-charge-{i}"), "payload": order(i)}),
            )
            .await,
        );
    }
    ids.push(
        d.enqueue(
            "charge",
            json!({"id": format!("{prefix}-charge-5"), "payload": order(5),
                   "dedup_key": "order-5", "dedup_for": "1h"}),
        )
        .await,
    );
    let mut products = Vec::new();
    for (i, name) in ["Tea", "Coffee", "Cocoa"].iter().enumerate() {
        let p = json!({"id": format!("p{i}"), "name": name, "price": 3.5, "updated_at_ms": 1_700_000_000_000u64 + i as u64});
        products.push(d.enqueue("idx", payload(p)).await);
    }
    let mut charges = Vec::new();
    for id in &ids {
        charges.push(d.wait_state(id, "completed", 60).await);
    }
    for id in &products {
        d.wait_state(id, "completed", 60).await;
    }
    charges
}

fn copy(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(KHATA)
        .args(["store", "copy"])
        .args(args)
        .envs(envs.iter().copied())
        .env("KHATA_LOG", "warn")
        .output()
        .expect("run khata store copy")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_copied(out: &Output) -> String {
    assert!(
        out.status.success(),
        "copy failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    assert!(stdout.contains("verified"), "{stdout}");
    stdout
}

/// The tables of a ledger, as both backends store them, with every column
/// that a copy must carry (effects without their per-backend numbering).
const TABLES: &[(&str, &str)] = &[
    (
        "jobs",
        "SELECT id, queue, state, payload, priority, run_at, seq, attempt, budget_used, max_attempts, \
         dedup_key, enqueued_at, finished_at, result, last_error, lease_token FROM jobs",
    ),
    (
        "attempts",
        "SELECT job_id, number, token, started_at, ended_at, outcome, error FROM attempts",
    ),
    (
        "effects",
        "SELECT job_id, attempt, kind, key, outcome, at FROM effects",
    ),
    ("dedup", "SELECT queue, key, job_id, hold_until FROM dedup"),
    (
        "fences",
        "SELECT namespace, kind, key, state, fingerprint, job_id, attempt, token, result, \
         created_at, updated_at FROM fences",
    ),
    ("kv", "SELECT namespace, key, value FROM kv"),
    (
        "index_docs",
        "SELECT collection, id, version, document, updated_at FROM index_docs",
    ),
];

/// Every row of every table, as text (bytes as `\x` and lowercase hex, as
/// PostgreSQL writes them), sorted.
type Snapshot = BTreeMap<&'static str, Vec<Vec<Option<String>>>>;

fn sqlite_snapshot(data_dir: &Path) -> Snapshot {
    use rusqlite::types::ValueRef;
    let conn = rusqlite::Connection::open_with_flags(
        data_dir.join("khata.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .expect("open the SQLite ledger");
    let mut out = Snapshot::new();
    for (table, sql) in TABLES {
        let mut stmt = conn.prepare(sql).expect(sql);
        let n = stmt.column_count();
        let mut rows: Vec<Vec<Option<String>>> = stmt
            .query_map([], |r| {
                (0..n)
                    .map(|i| {
                        Ok(match r.get_ref(i)? {
                            ValueRef::Null => None,
                            ValueRef::Integer(v) => Some(v.to_string()),
                            ValueRef::Real(v) => Some(v.to_string()),
                            ValueRef::Text(t) => Some(text(t)),
                            ValueRef::Blob(b) => Some(format!("\\x{}", hex::encode(b))),
                        })
                    })
                    .collect()
            })
            .expect(sql)
            .collect::<Result<_, _>>()
            .expect(sql);
        rows.sort();
        out.insert(table, rows);
    }
    out
}

async fn pg_snapshot(db: &TestDatabase) -> Snapshot {
    let (client, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    let task = tokio::spawn(conn);
    let mut out = Snapshot::new();
    for (table, sql) in TABLES {
        // The simple protocol answers in text: numbers in decimal, bytea in hex.
        let mut rows: Vec<Vec<Option<String>>> = client
            .simple_query(sql)
            .await
            .expect(sql)
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => {
                    Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
                }
                _ => None,
            })
            .collect();
        rows.sort();
        out.insert(table, rows);
    }
    drop(client);
    let _ = task.await;
    out
}

/// A copy from the ledger of `config`, whose daemon runs, into `target`
/// is refused, and makes no target.
fn refused_in_use(config: &str, target: &Path) {
    let out = copy(&["--from", config, "--to", target.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("stop the daemon"), "{stderr}");
    assert!(stderr.contains("another khata daemon"), "{stderr}");
    assert!(!target.exists(), "nothing was written");
}

fn rows<'a>(s: &'a Snapshot, table: &str) -> &'a [Vec<Option<String>>] {
    s.get(table).map_or(&[], Vec::as_slice)
}

fn max_token(s: &Snapshot) -> u64 {
    rows(s, "attempts")
        .iter()
        .filter_map(|r| r[2].as_deref()?.parse().ok())
        .max()
        .expect("some attempt")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_ledger_moves_to_postgres_and_its_charges_are_replayed_not_repeated() {
    let payments = Payments::start().await;
    let mut src = start(&queues(&payments.url()), None).await;
    let before = charge_and_index(&src, "a").await;
    src.terminate();
    assert_eq!(
        payments.requests().len(),
        5,
        "five orders charged once each"
    );
    let data_dir = src.dir.path().join("data");
    let source = sqlite_snapshot(&data_dir);
    assert_eq!(rows(&source, "fences").len(), 5);
    assert_eq!(rows(&source, "kv").len(), 3);

    let db = TestDatabase::create().await;
    let config = src.config_path();
    let out = copy(
        &[
            "--from",
            config.to_str().unwrap(),
            "--to-env",
            "KHATA_COPY_TO",
        ],
        &[("KHATA_COPY_TO", &db.url)],
    );
    let summary = assert_copied(&out);
    assert!(summary.contains("(completed 8)"), "{summary}");
    assert!(summary.contains("(done 5)"), "{summary}");
    assert!(
        !text(&out.stdout).contains(&db.url) && !text(&out.stderr).contains(&db.url),
        "the URL is not repeated"
    );

    // Every row of every table, fingerprints and recorded results included.
    let copied = pg_snapshot(&db).await;
    assert_eq!(source, copied);

    // A daemon on PostgreSQL with the same plugins: the same orders under
    // new job ids are replayed from the copied fences.
    let mut dst = start(
        &format!("{ON_POSTGRES}{}", queues(&payments.url())),
        Some(&db),
    )
    .await;
    let old_token = max_token(&source);
    for (i, old) in (1..=5).zip(&before) {
        let id = dst
            .enqueue(
                "charge",
                json!({"id": format!("b-charge-{i}"), "payload": order(i)}),
            )
            .await;
        let j = dst.wait_state(&id, "completed", 60).await;
        assert_eq!(j["result"]["replayed"], true, "{j}");
        assert_eq!(j["result"]["charge"], old["result"]["charge"], "{j}");
        assert_eq!(j["effects"][0]["outcome"], "replayed", "{j}");
        let token = j["attempts"][0]["fencing_token"].as_u64().unwrap();
        assert!(
            token > old_token,
            "fencing tokens go on from the source's ({token} after {old_token})"
        );
    }
    assert_eq!(
        payments.requests().len(),
        5,
        "no order was charged a second time"
    );
    assert_eq!(payments.charges(), 5);

    // The copied jobs are served as they were, and the held dedup key holds.
    let j = dst.job("a-charge-3").await;
    assert_eq!(j["state"], "completed");
    assert_eq!(j["result"], before[2]["result"]);
    assert_eq!(j["attempts"], before[2]["attempts"]);
    let (status, v) = dst
        .call(
            "POST",
            "/v1/queues/charge/jobs",
            Some(json!({"payload": order(6), "dedup_key": "order-5"})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["deduplicated"], true, "{v}");
    assert_eq!(v["job"]["id"], "a-charge-5", "{v}");
    dst.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_to_sqlite_and_back_keeps_every_job_fence_and_kv_entry() {
    let payments = Payments::start().await;
    let db = TestDatabase::create().await;
    let mut d = start(
        &format!("{ON_POSTGRES}{}", queues(&payments.url())),
        Some(&db),
    )
    .await;
    charge_and_index(&d, "pg").await;
    // A job that failed for good, with its error, is moved too.
    let dead = d
        .enqueue("slow", json!({"id": "dead-1", "payload": {"do": "fail"}}))
        .await;
    d.wait_state(&dead, "dead", 60).await;
    d.terminate();
    let original = pg_snapshot(&db).await;
    assert_eq!(rows(&original, "jobs").len(), 9);

    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("moved");
    let out = copy(
        &[
            "--from-env",
            "KHATA_COPY_FROM",
            "--to",
            data_dir.to_str().unwrap(),
        ],
        &[("KHATA_COPY_FROM", &db.url)],
    );
    let summary = assert_copied(&out);
    assert!(summary.contains("(completed 8, dead 1)"), "{summary}");
    assert_eq!(original, sqlite_snapshot(&data_dir));

    let back = TestDatabase::create().await;
    let out = copy(
        &["--from", data_dir.to_str().unwrap(), "--to", &back.url],
        &[],
    );
    assert_copied(&out);
    assert_eq!(original, pg_snapshot(&back).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_refuses_a_ledger_in_use_and_a_target_that_is_not_empty() {
    let payments = Payments::start().await;
    let mut d = start(&queues(&payments.url()), None).await;
    charge_and_index(&d, "r").await;
    let config = d.config_path();
    let config = config.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target");

    // The daemon holds the ledger's lock: refused, and no target made.
    refused_in_use(config, &target);

    // A job left active by kill -9 is recovered first, as a start would.
    let sleeper = d
        .enqueue(
            "slow",
            json!({"id": "sleeper", "payload": {"do": "sleep", "ms": 60_000}}),
        )
        .await;
    d.wait_state(&sleeper, "active", 30).await;
    d.kill9();
    let db = TestDatabase::create().await;
    let out = copy(
        &["--from", config, "--to-env", "KHATA_COPY_TO"],
        &[("KHATA_COPY_TO", &db.url)],
    );
    assert_copied(&out);
    assert!(
        text(&out.stderr).contains("recovered 1 jobs"),
        "{}",
        text(&out.stderr)
    );
    let copied = pg_snapshot(&db).await;
    let sleeper_attempt = rows(&copied, "attempts")
        .iter()
        .find(|r| r[0].as_deref() == Some("sleeper"))
        .expect("the sleeper's attempt");
    assert_eq!(sleeper_attempt[5].as_deref(), Some("abandoned"));
    let sleeper_job = rows(&copied, "jobs")
        .iter()
        .find(|r| r[0].as_deref() == Some("sleeper"))
        .expect("the sleeper");
    assert_eq!(sleeper_job[2].as_deref(), Some("waiting"));

    // The target now holds a ledger: a second copy into it is refused and
    // changes nothing.
    let out = copy(
        &["--from", config, "--to-env", "KHATA_COPY_TO"],
        &[("KHATA_COPY_TO", &db.url)],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("is not empty"), "{stderr}");
    assert!(stderr.contains("nothing was written"), "{stderr}");
    assert_eq!(copied, pg_snapshot(&db).await);

    // A PostgreSQL ledger with active jobs (its daemon killed mid-attempt:
    // the copied sleeper, waiting again, and one more) is refused as a
    // source, naming the count.
    let mut on_pg = start(
        &format!("{ON_POSTGRES}{}", queues(&payments.url())),
        Some(&db),
    )
    .await;
    let sleeper = on_pg
        .enqueue(
            "slow",
            json!({"id": "pg-sleeper", "payload": {"do": "sleep", "ms": 60_000}}),
        )
        .await;
    on_pg.wait_state(&sleeper, "active", 30).await;
    on_pg.wait_state("sleeper", "active", 30).await;
    on_pg.kill9();
    let elsewhere = dir.path().join("elsewhere");
    let out = copy(
        &[
            "--from-env",
            "KHATA_COPY_FROM",
            "--to",
            elsewhere.to_str().unwrap(),
        ],
        &[("KHATA_COPY_FROM", &db.url)],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("2 jobs are active"), "{stderr}");
    assert!(stderr.contains("stop the daemons"), "{stderr}");
    assert!(!elsewhere.exists(), "nothing was written");
}

const ON_SLED: &str = "[store]\nbackend = \"sled\"\n\n";

/// Every record `store` exports but its counters, as JSON and sorted (the
/// backends' key orders differ), and its counters.
async fn exported(store: &dyn khata::store::Store) -> (Vec<String>, Counters) {
    let mut records = Vec::new();
    let mut counters = Counters::default();
    copy::walk(store, 7, |page| {
        for r in page {
            match r {
                copy::Record::Counters(c) => counters = c,
                r => records.push(serde_json::to_string(&r).expect("a record is JSON")),
            }
        }
        Ok(())
    })
    .await
    .expect("export");
    records.sort();
    (records, counters)
}

/// The export of the sled ledger in `data_dir` (no daemon may hold it).
async fn sled_export(data_dir: &Path) -> (Vec<String>, Counters) {
    let store = khata::store::sled::SledStore::open(data_dir).expect("open the sled ledger");
    exported(&store).await
}

async fn sqlite_export(data_dir: &Path) -> (Vec<String>, Counters) {
    let store = khata::store::sqlite::SqliteStore::open(data_dir).expect("open the SQLite ledger");
    exported(&store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_to_sqlite_and_back_to_sled_keeps_every_record_and_replays_the_charges() {
    let payments = Payments::start().await;
    let mut src = start(&format!("{ON_SLED}{}", queues(&payments.url())), None).await;
    let before = charge_and_index(&src, "s").await;
    let config = src.config_path();
    let config = config.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let moved = dir.path().join("moved");

    // The daemon holds the sled ledger's lock: refused, nothing made.
    refused_in_use(config, &moved);
    src.terminate();
    assert_eq!(
        payments.requests().len(),
        5,
        "five orders charged once each"
    );

    let sled_dir = src.dir.path().join("data");
    let (source, source_counters) = sled_export(&sled_dir).await;
    let count = |kind: &str| {
        source
            .iter()
            .filter(|r| r.starts_with(&format!("{{\"record\":\"{kind}\"")))
            .count()
    };
    assert_eq!(
        (
            count("job"),
            count("dedup"),
            count("fence"),
            count("kv"),
            count("index")
        ),
        (8, 1, 5, 3, 3),
        "{source:#?}"
    );

    // sled → SQLite, the source named by its data directory.
    let out = copy(
        &[
            "--from",
            sled_dir.to_str().unwrap(),
            "--to",
            moved.to_str().unwrap(),
        ],
        &[],
    );
    let summary = assert_copied(&out);
    assert!(
        summary.contains(&format!(
            "copied sled {}",
            sled_dir.join("ledger.sled").display()
        )),
        "{summary}"
    );
    assert!(summary.contains("(completed 8)"), "{summary}");
    assert!(summary.contains("(done 5)"), "{summary}");
    assert!(moved.join("khata.db").is_file());
    let (on_sqlite, sqlite_counters) = sqlite_export(&moved).await;
    assert_eq!(source, on_sqlite, "SQLite holds what sled held");
    assert!(sqlite_counters.fencing_token >= source_counters.fencing_token);
    assert!(sqlite_counters.enqueue_seq >= source_counters.enqueue_seq);

    // sled → PostgreSQL: the same rows as the SQLite copy.
    let db = TestDatabase::create().await;
    let out = copy(
        &["--from", config, "--to-env", "KHATA_COPY_TO"],
        &[("KHATA_COPY_TO", &db.url)],
    );
    assert_copied(&out);
    assert_eq!(sqlite_snapshot(&moved), pg_snapshot(&db).await);

    // SQLite → a fresh sled ledger, named by the jobs.toml of the daemon
    // that will serve it.
    let mut dst = Daemon::prepare(&format!("{ON_SLED}{}", queues(&payments.url())), PLUGINS);
    let dst_config = dst.config_path();
    let out = copy(
        &[
            "--from",
            moved.to_str().unwrap(),
            "--to",
            dst_config.to_str().unwrap(),
        ],
        &[],
    );
    let summary = assert_copied(&out);
    assert!(summary.contains("to sled "), "{summary}");
    let dst_dir = dst.dir.path().join("data");
    let (back, back_counters) = sled_export(&dst_dir).await;
    assert_eq!(source, back, "the round trip keeps every record");
    assert!(back_counters.fencing_token >= source_counters.fencing_token);
    assert!(back_counters.enqueue_seq >= source_counters.enqueue_seq);

    // A second copy into it is refused: the target is not empty.
    let out = copy(
        &[
            "--from",
            moved.to_str().unwrap(),
            "--to",
            dst_dir.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("is not empty"), "{stderr}");
    assert_eq!(source, sled_export(&dst_dir).await.0, "and changed nothing");

    // The daemon on the copied sled ledger replays the same orders, under
    // new job ids, from the copied fences.
    dst.start().await;
    for q in ["charge", "idx", "slow"] {
        dst.wait_plugin(q).await;
    }
    for (i, old) in (1..=5).zip(&before) {
        let id = dst
            .enqueue(
                "charge",
                json!({"id": format!("t-charge-{i}"), "payload": order(i)}),
            )
            .await;
        let j = dst.wait_state(&id, "completed", 60).await;
        assert_eq!(j["result"]["replayed"], true, "{j}");
        assert_eq!(j["result"]["charge"], old["result"]["charge"], "{j}");
        let token = j["attempts"][0]["fencing_token"].as_u64().unwrap();
        assert!(
            token > source_counters.fencing_token,
            "fencing tokens go on from the source's ({token} after {})",
            source_counters.fencing_token
        );
    }
    assert_eq!(
        payments.requests().len(),
        5,
        "no order was charged a second time"
    );
    assert_eq!(payments.charges(), 5);
    let j = dst.job("s-charge-3").await;
    assert_eq!(j["result"], before[2]["result"]);
    assert_eq!(j["attempts"], before[2]["attempts"]);
    let (status, v) = dst
        .call(
            "POST",
            "/v1/queues/charge/jobs",
            Some(json!({"payload": order(6), "dedup_key": "order-5"})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["job"]["id"], "s-charge-5",
        "the held dedup key holds: {v}"
    );
    dst.terminate();
}

#[test]
fn a_data_dir_without_a_ledger_is_refused_as_a_source() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = copy(
        &[
            "--from",
            empty.to_str().unwrap(),
            "--to",
            dir.path().join("t").to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("there is no ledger there"), "{stderr}");
    assert!(
        stderr.contains("khata.db") && stderr.contains("ledger.sled"),
        "{stderr}"
    );
    assert!(!dir.path().join("t").exists(), "nothing was written");
}
