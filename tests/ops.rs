//! Operating the daemon: graceful shutdown, metrics, refusing what this
//! build cannot serve.

use crate::support;

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
    let text = d.metrics().await;
    for line in [
        "khata_jobs_enqueued_total{queue=\"echo\"} 1",
        "khata_jobs_deduplicated_total{queue=\"echo\"} 1",
        "khata_attempts_total{queue=\"echo\",outcome=\"completed\"} 1",
        "khata_queue_depth{queue=\"echo\",state=\"completed\"} 1",
        "khata_jobs_finished_total{queue=\"echo\",state=\"completed\"} 1",
        // Histograms with buckets, not summaries.
        "khata_attempt_duration_seconds_bucket{queue=\"echo\",le=\"+Inf\"} 1",
        "khata_store_commit_seconds_bucket{le=\"0.001\"}",
        "khata_store_commit_steps_bucket{le=\"1\"}",
    ] {
        assert!(text.contains(line), "metrics lack {line:?}:\n{text}");
    }
}

/// systemd's notify protocol (README.md#running-as-a-service): `READY=1` once the API answers,
/// `WATCHDOG=1` while running, `STOPPING=1` on SIGTERM.
#[tokio::test]
async fn systemd_hears_ready_watchdog_and_stopping() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixDatagram;

    let mut d = Daemon::prepare("[queues.e]\nplugin = \"echo\"\n", &[("echo", "echo")]);
    let socket_path = d.dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    d.env("NOTIFY_SOCKET", socket_path.to_str().unwrap());
    d.env("WATCHDOG_USEC", "200000");
    let port = d.port;
    // Reads every message; on READY=1 it asks the API at once, so the answer
    // says whether the API was up when systemd was told it was.
    let listener = std::thread::spawn(move || {
        socket
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut seen: Vec<(String, Option<bool>)> = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = socket.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            let api_up = msg.lines().any(|l| l == "READY=1").then(|| {
                let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").unwrap();
                let mut answer = String::new();
                let _ = s.read_to_string(&mut answer);
                answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200")
            });
            let stopping = msg.lines().any(|l| l == "STOPPING=1");
            seen.push((msg, api_up));
            if stopping {
                break;
            }
        }
        seen
    });
    d.start().await;
    d.wait_plugin("e").await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(d.terminate().success());
    let seen = listener.join().unwrap();
    let lines: Vec<&str> = seen.iter().flat_map(|(m, _)| m.lines()).collect();
    let ready = seen
        .iter()
        .position(|(_, up)| up.is_some())
        .unwrap_or_else(|| panic!("no READY=1: {lines:?}"));
    assert_eq!(seen[ready].1, Some(true), "READY=1 before the API answered");
    let watchdogs = seen[ready..]
        .iter()
        .filter(|(m, _)| m.lines().any(|l| l == "WATCHDOG=1"))
        .count();
    assert!(watchdogs >= 3, "watchdog pings while running: {lines:?}");
    assert_eq!(lines.last(), Some(&"STOPPING=1"), "{lines:?}");
}

/// JSON logs (`KHATA_LOG_FORMAT=json`): every line of an attempt names its
/// job, queue, attempt and plugin version.
#[tokio::test]
async fn json_log_lines_of_an_attempt_name_job_queue_attempt_and_version() {
    let mut d = Daemon::prepare("[queues.e]\nplugin = \"echo\"\n", &[("echo", "echo")]);
    d.env("KHATA_LOG_FORMAT", "json");
    d.env("KHATA_LOG", "khata=debug");
    d.start().await;
    d.wait_plugin("e").await;
    let id = d.enqueue("e", payload(json!({"hello": 1}))).await;
    d.wait_state(&id, "completed", 30).await;
    let version = d.queue("e").await["version"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<serde_json::Value> = d
            .log()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
            .collect();
        let ours: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|v| v["span"]["job"] == id.as_str())
            .collect();
        if let Some(line) = ours
            .iter()
            .find(|v| v["fields"]["message"] == "attempt ended")
        {
            let span = &line["span"];
            assert_eq!(span["name"], "attempt", "{line}");
            assert_eq!(span["queue"], "e", "{line}");
            assert_eq!(span["attempt"], 1, "{line}");
            assert_eq!(span["plugin"], "echo", "{line}");
            assert_eq!(span["version"], version.as_str(), "{line}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no tagged line for {id}:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The data directory and everything in it are the daemon's user's alone,
/// whatever umask it was started with (docs/security.md): the ledger holds
/// every payload, the outbox every email.
#[tokio::test]
async fn the_ledger_and_the_outbox_are_private_to_the_daemons_user() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start_new(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = { kv = true, email = true }\n\n[email]\ntransport = \"outbox\"\nfrom = \"hello@example.com\"\n",
        &[("welcome_email", "welcome_email")],
    )
    .await;
    d.wait_plugin("welcome").await;
    let id = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 7, "email": "ada@example.com", "name": "Ada"})),
        )
        .await;
    d.wait_state(&id, "completed", 30).await;
    let data = d.dir.path().join("data");
    let mut seen = 0;
    let mut stack = vec![data.clone()];
    while let Some(p) = stack.pop() {
        let meta = std::fs::symlink_metadata(&p).unwrap();
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_dir() {
            assert_eq!(mode, 0o700, "{}", p.display());
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if meta.is_file() {
            assert_eq!(mode & 0o077, 0, "{} is {mode:o}", p.display());
        }
        seen += 1;
    }
    assert!(data.join("khata.db").exists() && data.join("outbox").exists());
    assert!(seen > 5, "{seen} entries");
}
