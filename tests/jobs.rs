//! The job life cycle through the real daemon: run, order, concurrency,
//! retries, limits, dead-letter, manual retry and cancel (docs/jobs.md#life-cycle).

use crate::support;

use serde_json::json;
use support::{Daemon, payload};

const CHAOS: &str = r#"
[queues.chaos]
plugin = "chaos"
concurrency = 4
timeout = "2s"
memory = "32MiB"
max_attempts = 3
backoff = { initial = "50ms", max = "200ms", multiplier = 2.0, jitter = 0.0 }
grants = { kv = true }
"#;

#[tokio::test]
async fn enqueue_run_complete_over_http_and_cli() {
    let d = Daemon::start_new("[queues.echo]\nplugin = \"echo\"\n", &[("echo", "echo")]).await;
    d.wait_plugin("echo").await;
    let id = d
        .enqueue("echo", payload(json!({"hello": "world", "n": 1})))
        .await;
    let job = d.wait_state(&id, "completed", 30).await;
    assert_eq!(job["result"], json!({"hello": "world", "n": 1}));
    assert_eq!(job["attempt"], 1);
    assert_eq!(job["attempts"][0]["outcome"], "completed");
    assert!(job["finished_at"].is_string());

    let out = d.cli(&["enqueue", "echo", r#"{"via":"cli"}"#, "--id", "cli-1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("cli-1"));
    let job = d.wait_state("cli-1", "completed", 30).await;
    assert_eq!(job["result"], json!({"via": "cli"}));

    let out = d.cli(&["job", "cli-1", "--json"]);
    assert!(out.status.success());
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("job --json");
    assert_eq!(shown["state"], "completed");
    let out = d.cli(&["jobs", "--queue", "echo", "--state", "completed"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cli-1") && text.contains(&id), "{text}");
    let out = d.cli(&["queues"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("echo"));
}

#[tokio::test]
async fn delivery_order_is_priority_then_run_at_then_fifo() {
    // The plugin is added only after every job is enqueued, so the queue sees
    // them all at once; concurrency 1 makes the order observable.
    let mut d = Daemon::prepare(
        "[queues.order]\nplugin = \"chaos\"\nconcurrency = 1\ngrants = { kv = true }\n",
        &[],
    );
    d.start().await;
    let now = std::time::SystemTime::now();
    let past = |s: u64| {
        humantime::format_rfc3339_millis(now - std::time::Duration::from_secs(s)).to_string()
    };
    let mut ids = Vec::new();
    for (tag, priority, run_at) in [
        ("low-1", 0, past(10)),
        ("low-older", 0, past(20)),
        ("high", 10, past(1)),
        ("low-2", 0, past(10)),
        ("mid", 5, past(1)),
    ] {
        ids.push(
            d.enqueue(
                "order",
                json!({"payload": {"do": "order", "tag": tag}, "priority": priority, "run_at": run_at}),
            )
            .await,
        );
    }
    std::fs::copy(
        support::guest("chaos"),
        d.dir.path().join("plugins/chaos.wasm"),
    )
    .unwrap();
    for id in &ids {
        d.wait_state(id, "completed", 30).await;
    }
    let mut order = Vec::new();
    for id in &ids {
        let j = d.job(id).await;
        order.push((
            j["result"]["position"].as_u64().unwrap(),
            j["payload"]["tag"].as_str().unwrap().to_owned(),
        ));
    }
    order.sort();
    let tags: Vec<_> = order.into_iter().map(|(_, t)| t).collect();
    assert_eq!(tags, ["high", "mid", "low-older", "low-1", "low-2"]);
}

#[tokio::test]
async fn concurrency_is_never_exceeded() {
    let d = Daemon::start_new(
        "[queues.slots]\nplugin = \"chaos\"\nconcurrency = 3\ngrants = { kv = true }\n",
        &[("chaos", "chaos")],
    )
    .await;
    d.wait_plugin("slots").await;
    let mut ids = Vec::new();
    for _ in 0..24 {
        ids.push(
            d.enqueue(
                "slots",
                payload(json!({"do": "slot", "ms": 30, "slots": 16})),
            )
            .await,
        );
    }
    let mut used = std::collections::BTreeSet::new();
    for id in &ids {
        let j = d.wait_state(id, "completed", 60).await;
        used.insert(j["result"]["slot"].as_u64().unwrap());
    }
    // A handler takes the lowest free slot; slot 3 or above would mean a
    // fourth handler ran while three held theirs.
    assert!(used.iter().all(|s| *s < 3), "slots used: {used:?}");
    assert!(
        used.len() >= 2,
        "the queue ran handlers in parallel: {used:?}"
    );
}

#[tokio::test]
async fn retry_backoff_fail_and_budget() {
    let d = Daemon::start_new(CHAOS, &[("chaos", "chaos")]).await;
    d.wait_plugin("chaos").await;

    let until = d
        .enqueue("chaos", payload(json!({"do": "retry_until", "n": 3})))
        .await;
    let j = d.wait_state(&until, "completed", 30).await;
    assert_eq!(j["result"], json!({"attempt": 3}));
    let attempts = j["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3);
    assert_eq!(attempts[0]["outcome"], "retry");
    // Backoff: the second attempt started at least `initial` after the first ended.
    let ended = humantime::parse_rfc3339(attempts[0]["ended_at"].as_str().unwrap()).unwrap();
    let next = humantime::parse_rfc3339(attempts[1]["started_at"].as_str().unwrap()).unwrap();
    assert!(next.duration_since(ended).unwrap() >= std::time::Duration::from_millis(45));

    let fail = d.enqueue("chaos", payload(json!({"do": "fail"}))).await;
    let j = d.wait_state(&fail, "dead", 30).await;
    assert_eq!(
        j["attempts"].as_array().unwrap().len(),
        1,
        "fail is dead at once"
    );
    assert_eq!(j["last_error"], "asked to fail");

    let retry = d.enqueue("chaos", payload(json!({"do": "retry"}))).await;
    let j = d.wait_state(&retry, "dead", 30).await;
    assert_eq!(
        j["attempts"].as_array().unwrap().len(),
        3,
        "max_attempts = 3"
    );
    assert!(j["last_error"].as_str().unwrap().contains("asked to retry"));

    // A dead job retried by hand runs again with a fresh budget.
    let out = d.cli(&["retry", &retry]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = d.wait_state(&retry, "dead", 30).await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 6);
    assert_eq!(j["attempts"][5]["number"], 6);
}

#[cfg(feature = "failpoints")]
fn time(v: &serde_json::Value) -> std::time::SystemTime {
    humantime::parse_rfc3339(v.as_str().expect("a time")).expect("RFC 3339")
}

/// The gap between an attempt's end and the job's next run, to the second.
#[cfg(feature = "failpoints")]
fn backoff_after(j: &serde_json::Value, attempt: usize) -> u64 {
    let ended = time(&j["attempts"][attempt]["ended_at"]);
    let next = time(&j["run_at"]);
    next.duration_since(ended)
        .expect("run_at after the end")
        .as_secs()
}

/// Backoff against the daemon's clock, moved forward by the test instead of
/// waited for (`POST /v1/test/clock`, built with the `failpoints` feature).
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn backoff_grows_on_the_daemons_clock() {
    let config = r#"
[queues.chaos]
plugin = "chaos"
max_attempts = 5
backoff = { initial = "1h", max = "3h", multiplier = 2.0, jitter = 0.0 }
grants = { kv = true }
"#;
    let d = Daemon::start_new(config, &[("chaos", "chaos")]).await;
    d.wait_plugin("chaos").await;
    let id = d
        .enqueue("chaos", payload(json!({"do": "retry_until", "n": 4})))
        .await;
    let j = d.wait_state(&id, "delayed", 30).await;
    assert_eq!(backoff_after(&j, 0), 3600, "initial: {j}");

    // Not run early: nothing happens while the clock stands still.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let j = d.job(&id).await;
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_array().unwrap().len()),
        (Some("delayed"), 1)
    );

    let advance = |by: &'static str| {
        let d = &d;
        async move {
            let (status, v) = d
                .call("POST", "/v1/test/clock", Some(json!({"advance": by})))
                .await;
            assert_eq!(status, 200, "{v}");
        }
    };
    advance("1h").await;
    let j = wait_attempts(&d, &id, 2).await;
    assert_eq!(j["state"], "delayed");
    assert_eq!(backoff_after(&j, 1), 7200, "initial x multiplier: {j}");
    advance("2h").await;
    let j = wait_attempts(&d, &id, 3).await;
    assert_eq!(backoff_after(&j, 2), 3 * 3600, "capped at max: {j}");
    advance("3h").await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"], json!({"attempt": 4}));
}

#[cfg(feature = "failpoints")]
async fn wait_attempts(d: &Daemon, id: &str, n: usize) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let j = d.job(id).await;
        let ended = j["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| !a["ended_at"].is_null())
            .count();
        if ended >= n && j["state"] != "active" {
            return j;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "attempt {n} of {id} did not end: {j}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn trap_timeout_and_memory_each_cost_one_attempt() {
    let d = Daemon::start_new(CHAOS, &[("chaos", "chaos")]).await;
    d.wait_plugin("chaos").await;
    let cases = [
        ("trap", "chaos trap", "trapped"),
        ("loop", "timeout", "timeout"),
        ("memory", "memory limit", "trapped"),
        ("recurse", "stack overflow", "trapped"),
    ];
    let mut ids = Vec::new();
    for (what, _, _) in cases {
        ids.push(
            d.enqueue("chaos", json!({"payload": {"do": what}, "max_attempts": 1}))
                .await,
        );
    }
    for (id, (what, error, outcome)) in ids.iter().zip(cases) {
        let j = d.wait_state(id, "dead", 60).await;
        let attempts = j["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 1, "{what}: {j}");
        assert_eq!(attempts[0]["outcome"], outcome, "{what}: {j}");
        let last = j["last_error"].as_str().unwrap();
        assert!(
            last.contains(error),
            "{what}: last_error {last:?} should mention {error:?}"
        );
    }
    // The daemon is still there and still runs jobs.
    let ok = d.enqueue("chaos", payload(json!({"do": "echo"}))).await;
    d.wait_state(&ok, "completed", 30).await;
}

#[tokio::test]
async fn cancel_waiting_and_active_jobs() {
    let d = Daemon::start_new(CHAOS, &[("chaos", "chaos")]).await;
    d.wait_plugin("chaos").await;
    let delayed = d
        .enqueue("chaos", json!({"payload": {}, "delay": "1h"}))
        .await;
    assert_eq!(d.job(&delayed).await["state"], "delayed");
    let out = d.cli(&["cancel", &delayed]);
    assert!(out.status.success());
    assert_eq!(d.job(&delayed).await["state"], "cancelled");

    let sleeper = d
        .enqueue("chaos", payload(json!({"do": "sleep", "ms": 60_000})))
        .await;
    d.wait_state(&sleeper, "active", 30).await;
    let (status, v) = d.call("DELETE", &format!("/v1/jobs/{sleeper}"), None).await;
    assert_eq!(status, 200, "{v}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let j = d.job(&sleeper).await;
        assert_eq!(j["state"], "cancelled");
        if j["attempts"][0]["outcome"] == "cancelled" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the active attempt was not interrupted: {j}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // A completed job cannot be cancelled.
    let done = d.enqueue("chaos", payload(json!({}))).await;
    d.wait_state(&done, "completed", 30).await;
    let (status, v) = d.call("DELETE", &format!("/v1/jobs/{done}"), None).await;
    assert_eq!(status, 409, "{v}");
    let out = d.cli(&["cancel", &done]);
    assert_eq!(out.status.code(), Some(1));
}

#[tokio::test]
async fn kv_and_index_effects_of_the_example_plugin() {
    let d = Daemon::start_new(
        "[queues.idx]\nplugin = \"update_search_index\"\ngrants = { kv = true, index = [\"products\"] }\n",
        &[("update_search_index", "update_search_index")],
    )
    .await;
    d.wait_plugin("idx").await;
    let doc = |v: u64, price: f64| {
        payload(json!({"id": "p1", "name": "Lamp", "price": price, "updated_at_ms": v}))
    };
    let a = d.enqueue("idx", doc(200, 10.0)).await;
    d.wait_state(&a, "completed", 30).await;
    let b = d.enqueue("idx", doc(100, 5.0)).await;
    let jb = d.wait_state(&b, "completed", 30).await;
    assert_eq!(jb["result"]["outcome"], "stale");
    let c = d.enqueue("idx", doc(200, 10.0)).await;
    assert_eq!(
        d.wait_state(&c, "completed", 30).await["result"]["outcome"],
        "unchanged"
    );
    let (status, v) = d.call("GET", "/v1/index/products/p1", None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["version"], 200);
    assert_eq!(v["document"]["price"], 10.0);
}

#[tokio::test]
async fn rate_limit_bounds_attempts_started_per_window() {
    let config = r#"
[queues.limited]
plugin = "echo"
concurrency = 8
rate_limit = { max = 3, per = "1s" }
"#;
    let d = Daemon::start_new(config, &[("echo", "echo")]).await;
    d.wait_plugin("limited").await;
    let mut ids = Vec::new();
    for i in 0..9 {
        ids.push(d.enqueue("limited", payload(json!({"n": i}))).await);
    }
    let mut started = Vec::new();
    for id in &ids {
        let j = d.wait_state(id, "completed", 30).await;
        let at = &j["attempts"][0]["started_at"];
        started.push(humantime::parse_rfc3339(at.as_str().unwrap()).unwrap());
    }
    started.sort();
    // Any 4 consecutive starts span at least the window (less a little for
    // the millisecond rounding of recorded times).
    for w in started.windows(4) {
        let span = w[3].duration_since(w[0]).unwrap();
        assert!(
            span >= std::time::Duration::from_millis(950),
            "4 attempts started within {span:?}: {started:?}"
        );
    }
}

/// `[store] backend = "sled"`: jobs run, retry and keep their kv writes in
/// `data_dir/ledger.sled`, across a restart; `khata store migrate` names the
/// layout.
#[tokio::test]
async fn jobs_run_on_the_sled_store_and_survive_a_restart() {
    let mut d = Daemon::start_new(
        &format!("[store]\nbackend = \"sled\"\n{CHAOS}"),
        &[("chaos", "chaos")],
    )
    .await;
    d.wait_plugin("chaos").await;
    let data = d.dir.path().join("data");
    assert!(
        data.join("ledger.sled").is_dir(),
        "the sled ledger is in data_dir"
    );
    assert!(
        !data.join("khata.db").exists(),
        "no SQLite ledger beside it"
    );

    let first = d
        .enqueue("chaos", payload(json!({"do": "exists", "key": "k1"})))
        .await;
    let job = d.wait_state(&first, "completed", 30).await;
    assert_eq!(job["result"], json!({"new": true}));
    let retried = d
        .enqueue("chaos", payload(json!({"do": "retry_until", "n": 2})))
        .await;
    let job = d.wait_state(&retried, "completed", 30).await;
    assert_eq!(job["result"], json!({"attempt": 2}));
    let outcomes: Vec<_> = job["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["outcome"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(outcomes, ["retry", "completed"]);

    assert!(d.terminate().success());
    let out = std::process::Command::new(support::KHATA)
        .args(["store", "migrate", "-c"])
        .arg(d.config_path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("sled: layout version 2"), "{text}");
    d.start().await;

    // The kv write of the first run is there: the same key is not new.
    let again = d
        .enqueue("chaos", payload(json!({"do": "exists", "key": "k1"})))
        .await;
    let job = d.wait_state(&again, "completed", 30).await;
    assert_eq!(job["result"], json!({"new": false}));
    assert_eq!(d.job(&first).await["state"], "completed");
    let q = d.queue("chaos").await;
    assert_eq!(q["counts"]["completed"], 3, "{q}");
}
