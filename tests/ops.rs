//! Operating the daemon: graceful shutdown, metrics, refusing what this
//! build cannot serve.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{Daemon, payload};

const SLEEPY: &str = "[queues.sleepy]\nplugin = \"chaos\"\nconcurrency = 4\ntimeout = \"5m\"\ngrants = { kv = true }\n";

#[tokio::test]
async fn sigterm_lets_short_attempts_finish_and_interrupts_long_ones_uncounted() {
    // shutdown_grace is 2s in the test harness.
    let mut d = Daemon::start_new(SLEEPY, &[("chaos", "chaos")]).await;
    d.wait_plugin("sleepy").await;
    let short = d
        .enqueue("sleepy", payload(json!({"do": "sleep", "ms": 500})))
        .await;
    let long = d
        .enqueue(
            "sleepy",
            json!({"payload": {"do": "sleep", "ms": 600_000}, "max_attempts": 1}),
        )
        .await;
    d.wait_state(&short, "active", 30).await;
    d.wait_state(&long, "active", 30).await;
    let status = d.terminate();
    assert!(status.success(), "khata exits 0 after a drain: {status}");

    // Look at the ledger through a restarted daemon with no plugin, so that
    // nothing runs again.
    std::fs::remove_file(d.dir.path().join("plugins/chaos.wasm")).unwrap();
    d.start().await;
    let s = d.job(&short).await;
    assert_eq!(s["state"], "completed", "{s}");
    let l = d.job(&long).await;
    assert_eq!(
        l["state"], "waiting",
        "interrupted, back to waiting although max_attempts is 1: {l}"
    );
    assert_eq!(l["attempts"][0]["outcome"], "interrupted");
    assert!(
        d.log().contains("interrupting"),
        "the log says the grace ran out"
    );
}

#[tokio::test]
async fn metrics_count_jobs_and_queue_depth() {
    let d = Daemon::start_new("[queues.echo]\nplugin = \"echo\"\n", &[("echo", "echo")]).await;
    d.wait_plugin("echo").await;
    let id = d.enqueue("echo", payload(json!({}))).await;
    d.wait_state(&id, "completed", 30).await;
    let (status, _) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"id": id, "payload": {}})),
        )
        .await;
    assert_eq!(status, 200);
    // Completion is counted after its commit; give the counter a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let text = d
        .http
        .get(format!("{}/metrics", d.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "khata_jobs_enqueued_total{queue=\"echo\"} 1",
        "khata_jobs_deduplicated_total{queue=\"echo\"} 1",
        "khata_attempts_total{queue=\"echo\",outcome=\"completed\"} 1",
        "khata_queue_depth{queue=\"echo\",state=\"completed\"} 1",
    ] {
        assert!(text.contains(line), "metrics lack {line:?}:\n{text}");
    }
}

#[test]
fn a_backend_this_build_lacks_is_refused() {
    let d = Daemon::prepare("[store]\nbackend = \"sled\"\n", &[]);
    let out = std::process::Command::new(support::KHATA)
        .args(["serve", "-c"])
        .arg(d.config_path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sled") && err.contains("not available"),
        "{err}"
    );
    assert!(!d.dir.path().join("data").exists(), "nothing was created");
}
