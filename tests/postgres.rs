//! The real daemon with its ledger in PostgreSQL (docs/jobs-toml.md#store): jobs complete,
//! `kill -9` loses nothing acknowledged and completes nothing twice, and id
//! dedup holds. The server is named by `KHATA_TEST_PG_URL` (scripts/test
//! starts one with scripts/pg-test-server); each test gets a database of
//! its own.

use crate::support;

use std::time::{Duration, Instant};

use khata::store::postgres::testing::TestDatabase;
use serde_json::json;
use support::Daemon;

const BATCHES: usize = 10;
const BATCH: usize = 100;

fn config() -> &'static str {
    "[store]\nbackend = \"postgres\"\nurl = { env = \"KHATA_DATABASE_URL\" }\npool = 8\n\
     lease = \"2s\"\nheartbeat = \"500ms\"\n\n\
     [queues.echo]\nplugin = \"echo\"\nconcurrency = 8\n"
}

async fn sql_count(db: &TestDatabase, sql: &str) -> i64 {
    let (client, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    let task = tokio::spawn(conn);
    let n: i64 = client.query_one(sql, &[]).await.expect(sql).get(0);
    drop(client);
    let _ = task.await;
    n
}

async fn wait_completed(d: &Daemon, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let q = d.queue("echo").await;
        if q["counts"]["completed"] == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not all {n} jobs completed: {}\nlog:\n{}",
            q["counts"],
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_on_postgres_loses_nothing_across_kill_nine() {
    let db = TestDatabase::create().await;
    let mut d = Daemon::prepare(config(), &[("echo", "echo")]);
    d.env("KHATA_DATABASE_URL", &db.url);
    d.start().await;
    d.wait_plugin("echo").await;

    // One at a time: each completes with its payload as the result.
    for i in 0..10 {
        let id = d
            .enqueue(
                "echo",
                json!({"id": format!("one-{i}"), "payload": {"n": i}}),
            )
            .await;
        let j = d.wait_state(&id, "completed", 60).await;
        assert_eq!(j["result"], json!({"n": i}), "{j}");
    }

    // Batches, then kill -9 right after the last one is acknowledged, with
    // jobs still waiting and active.
    for b in 0..BATCHES {
        let jobs: Vec<_> = (0..BATCH)
            .map(
                |i| json!({"id": format!("pg-{}", b * BATCH + i), "payload": {"i": b * BATCH + i}}),
            )
            .collect();
        let (status, v) = d
            .call(
                "POST",
                "/v1/queues/echo/jobs/batch",
                Some(json!({ "jobs": jobs })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    d.kill9();
    let before_restart = sql_count(
        &db,
        "SELECT COUNT(*) FROM jobs WHERE state IN ('waiting', 'active')",
    )
    .await;
    d.start().await;
    let total = 10 + BATCHES * BATCH;
    wait_completed(&d, total).await;

    // Every acknowledged job is there and completed, once.
    assert_eq!(
        sql_count(&db, "SELECT COUNT(*) FROM jobs WHERE state = 'completed'").await,
        i64::try_from(total).unwrap()
    );
    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM (SELECT job_id FROM attempts WHERE outcome = 'completed' \
             GROUP BY job_id HAVING COUNT(*) > 1) twice"
        )
        .await,
        0,
        "no job completed twice"
    );
    assert_eq!(
        sql_count(
            &db,
            "SELECT COUNT(*) FROM attempts a JOIN jobs j ON j.id = a.job_id \
             WHERE a.number > (SELECT MIN(number) FROM attempts c WHERE c.job_id = a.job_id AND c.outcome = 'completed')"
        )
        .await,
        0,
        "nothing ran after a completion"
    );
    assert_eq!(
        sql_count(&db, "SELECT COUNT(*) FROM attempts WHERE ended_at IS NULL").await,
        0
    );
    let abandoned = sql_count(
        &db,
        "SELECT COUNT(*) FROM attempts WHERE outcome = 'abandoned'",
    )
    .await;
    eprintln!(
        "{before_restart} jobs were waiting or active at the kill; {abandoned} abandoned attempts recorded and redelivered"
    );
    let j = d.job("pg-999").await;
    assert_eq!(j["result"], json!({"i": 999}), "{j}");
    assert!(
        !d.dir.path().join("data/khata.db").exists(),
        "the ledger is in PostgreSQL, not in data_dir"
    );

    // Id dedup across the restart: same payload returns the job, another
    // payload is refused.
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"id": "pg-7", "payload": {"i": 7}})),
        )
        .await;
    assert_eq!((status, &v["deduplicated"]), (200, &json!(true)), "{v}");
    assert_eq!(v["job"]["state"], "completed");
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"id": "pg-7", "payload": {"i": 8}})),
        )
        .await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["code"], "id_reused");

    // `khata store migrate` finds the schema the daemon made.
    let out = std::process::Command::new(support::KHATA)
        .args(["store", "migrate", "-c"])
        .arg(d.config_path())
        .env("KHATA_DATABASE_URL", &db.url)
        .output()
        .expect("run khata store migrate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.trim(),
        format!(
            "postgres: schema version {} (up to date)",
            khata::store::postgres::SCHEMA_VERSION
        )
    );
    d.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_migrate_prepares_a_new_database_and_a_missing_url_is_named() {
    let db = TestDatabase::create().await;
    let d = Daemon::prepare(config(), &[("echo", "echo")]);
    let migrate = |url: Option<&str>| {
        let mut cmd = std::process::Command::new(support::KHATA);
        cmd.args(["store", "migrate", "-c"])
            .arg(d.config_path())
            .env_remove("KHATA_DATABASE_URL");
        if let Some(url) = url {
            cmd.env("KHATA_DATABASE_URL", url);
        }
        cmd.output().expect("run khata store migrate")
    };
    let out = migrate(Some(&db.url));
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "postgres: schema version {} (migrated from version 0)",
            khata::store::postgres::SCHEMA_VERSION
        )
    );
    let out = migrate(None);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("store.url: environment variable KHATA_DATABASE_URL is not set"),
        "{stderr}"
    );
}
