//! Hostile plugins through the real daemon (docs/wit.md#the-sandbox): WASI grants nothing,
//! floods and oversized results are bounded, and plugins that do not fit
//! are refused at load with an error naming queue, plugin and cause — while
//! an ordinary queue beside them goes on completing jobs.
//!
//! Covered elsewhere, not repeated here: an endless loop, a memory bomb,
//! deep recursion and a trap each cost one attempt (`jobs.rs`); a payload
//! over `max_payload` on the single enqueue (413 naming `max_payload`) and
//! `khata check` on bad plugins (`bad_input.rs`).

use crate::support;

use std::net::TcpListener;

use serde_json::{Value, json};
use support::{Daemon, payload};

const HOSTILE: &str = r#"
[queues.hostile]
plugin = "chaos"
concurrency = 4
timeout = "5s"
memory = "32MiB"
max_attempts = 1
max_result = "4KiB"
max_payload = "1KiB"
grants = { kv = true }

[queues.echo]
plugin = "echo"
concurrency = 2
"#;

/// A value no guest should see.
const SECRET: (&str, &str) = ("KHATA_HOSTILE_SECRET", "hunter2");

async fn hostile_daemon() -> Daemon {
    let mut d = Daemon::prepare(HOSTILE, &[("chaos", "chaos"), ("echo", "echo")]);
    d.env(SECRET.0, SECRET.1);
    d.start().await;
    d.wait_plugin("hostile").await;
    d.wait_plugin("echo").await;
    d
}

/// Runs one hostile job to its end and returns the job.
async fn run(d: &Daemon, what: Value, end: &str) -> Value {
    let id = d.enqueue("hostile", payload(what)).await;
    d.wait_state(&id, end, 60).await
}

/// Asserts that a probe got an error, not access, and returns the error.
fn denied(probe: &Value, what: &str) -> String {
    assert_eq!(probe["ok"], false, "{what} got access: {probe}");
    let error = probe["error"].as_str().unwrap_or_default().to_owned();
    assert!(!error.is_empty(), "{what}: an error message: {probe}");
    error
}

#[tokio::test]
async fn wasi_grants_nothing_files_environment_sockets_or_names() {
    let d = hostile_daemon().await;
    let echo_load: Vec<String> = {
        let mut ids = Vec::new();
        for n in 0..20 {
            ids.push(d.enqueue("echo", payload(json!({"n": n}))).await);
        }
        ids
    };

    // Files: one that exists on the host, one to create, the root directory.
    let existing = d.config_path();
    let j = run(
        &d,
        json!({"do": "file", "path": existing.to_str().unwrap()}),
        "completed",
    )
    .await;
    let r = &j["result"];
    let read = denied(&r["read"], "reading jobs.toml");
    let create = denied(&r["create"], "creating a file");
    let list = denied(&r["list"], "listing /");
    let relative = run(&d, json!({"do": "file", "path": "jobs.toml"}), "completed").await;
    denied(&relative["result"]["read"], "reading a relative path");
    assert!(
        !std::fs::read_to_string(&existing)
            .unwrap()
            .contains("chaos was here"),
        "the guest wrote nothing"
    );

    // The environment: the daemon has a secret; the guest sees no variable.
    let j = run(&d, json!({"do": "env", "name": SECRET.0}), "completed").await;
    assert_eq!(
        j["result"],
        json!({"value": null, "vars": 0, "args": 0}),
        "{j}"
    );
    assert!(!j.to_string().contains(SECRET.1));

    // A TCP connection to a listener that would accept it.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let j = run(&d, json!({"do": "tcp", "addr": addr}), "completed").await;
    let tcp = denied(&j["result"]["connect"], "connecting to a local listener");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing reached the listener"
    );

    // A name lookup that the host would answer from /etc/hosts.
    let j = run(
        &d,
        json!({"do": "resolve", "host": "localhost"}),
        "completed",
    )
    .await;
    let resolve = denied(&j["result"]["resolve"], "resolving localhost");

    eprintln!(
        "denied: read {read:?}; create {create:?}; list {list:?}; tcp {tcp:?}; resolve {resolve:?}"
    );
    for id in &echo_load {
        d.wait_state(id, "completed", 30).await;
    }
}

#[tokio::test]
async fn floods_and_oversized_results_are_bounded_and_cost_one_attempt() {
    let d = hostile_daemon().await;
    let mut echo_load = Vec::new();
    for n in 0..20 {
        echo_load.push(d.enqueue("echo", payload(json!({"n": n}))).await);
    }

    // 20,000 log lines: the job completes; the log keeps at most the
    // per-attempt budget (1,024 lines) and says how much it dropped.
    let j = run(&d, json!({"do": "log_flood", "lines": 20_000}), "completed").await;
    assert_eq!(j["result"], json!({"lines": 20_000}));
    let id = j["id"].as_str().unwrap();
    let log = d.log();
    let kept = log
        .lines()
        .filter(|l| l.contains("chaos log line") && l.contains(id))
        .count();
    assert!((1..=1024).contains(&kept), "{kept} guest lines kept");
    let note = log
        .lines()
        .find(|l| l.contains(id) && l.contains("log output of this attempt was truncated"))
        .unwrap_or_else(|| panic!("a truncation note for {id}:\n{log}"));
    assert!(note.contains("messages"), "{note}");

    // Empty messages cost a line each: they cannot flood the log either.
    let j = run(
        &d,
        json!({"do": "log_flood", "lines": 20_000, "text": ""}),
        "completed",
    )
    .await;
    let id = j["id"].as_str().unwrap();
    let log = d.log();
    let kept = log
        .lines()
        .filter(|l| l.contains("khata::guest") && l.contains(id))
        .count();
    assert!((1..=1024).contains(&kept), "{kept} empty lines kept");

    // stdout: captured up to 16 KiB, the rest counted and noted.
    let j = run(
        &d,
        json!({"do": "print_flood", "lines": 20_000}),
        "completed",
    )
    .await;
    let id = j["id"].as_str().unwrap();
    let log = d.log();
    let printed: usize = log
        .lines()
        .filter(|l| l.contains("chaos stdout line") && l.contains(id))
        .count();
    assert!(
        (1..=1000).contains(&printed),
        "{printed} stdout lines kept (16 KiB)"
    );
    assert!(
        log.lines()
            .any(|l| l.contains(id) && l.contains("guest output truncated")),
        "a truncation note for stdout"
    );

    // A result over max_result (4 KiB): refused, one attempt, a clear error.
    let j = run(&d, json!({"do": "big_result", "bytes": 100_000}), "dead").await;
    let attempts = j["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{j}");
    let last = j["last_error"].as_str().unwrap();
    assert!(
        last.contains("100002 bytes") && last.contains("max_result"),
        "{last}"
    );
    assert!(j["result"].is_null(), "nothing of it is kept: {j}");
    // A 100 MiB result cannot even be built inside the 32 MiB memory limit.
    let j = run(
        &d,
        json!({"do": "big_result", "bytes": 100 * 1024 * 1024}),
        "dead",
    )
    .await;
    let last = j["last_error"].as_str().unwrap();
    assert!(last.contains("memory limit"), "{last}");

    // A 900 KB fail reason with NUL characters: the ledger keeps 4 KiB of
    // it, NULs replaced (PostgreSQL's text cannot hold them), and says how
    // much it dropped.
    let j = run(
        &d,
        json!({"do": "fail_with", "message": "card\0declined ", "times": 50_000}),
        "dead",
    )
    .await;
    for error in [&j["last_error"], &j["attempts"][0]["error"]] {
        let error = error.as_str().unwrap();
        assert!(error.len() < 4096 + 64, "{} bytes kept", error.len());
        assert!(!error.contains('\0'), "{error:.40}");
        assert!(
            error.starts_with("card\u{FFFD}declined card"),
            "{error:.40}"
        );
        assert!(error.ends_with("more bytes dropped)"), "{error:.40}");
    }
    // A kv key with a NUL, a newline or ESC is refused at the host, naming
    // the rule: keys reach logs and terminals.
    for key in ["a\0b", "a\nb", "\u{1b}[31mred"] {
        let j = run(&d, json!({"do": "kv_get", "key": key}), "dead").await;
        let last = j["last_error"].as_str().unwrap();
        assert!(
            last.contains("must not contain control characters"),
            "{key:?}: {last}"
        );
    }

    // A batch with one payload over max_payload (1 KiB): refused whole,
    // naming the job and the limit.
    let big = "x".repeat(2000);
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/hostile/jobs/batch",
            Some(json!({"jobs": [{"payload": {"ok": 1}}, {"payload": big}]})),
        )
        .await;
    assert_eq!(status, 413, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("jobs[1].payload") && message.contains("max_payload"),
        "{message}"
    );

    for id in &echo_load {
        d.wait_state(id, "completed", 30).await;
    }
    let counts = d.queue("hostile").await["counts"].clone();
    assert_eq!(
        counts["completed"], 3,
        "only the floods completed: {counts}"
    );
    // big result, memory, fail reason, and three refused kv keys.
    assert_eq!(counts["dead"], 6, "{counts}");
    assert_eq!(counts["waiting"], 0, "the refused batch enqueued nothing");
}

/// A component that exports `handle` as `func() -> u32`: not the khata world.
const WRONG_WORLD: &str = r#"
(component
  (core module $m (func (export "h") (result i32) i32.const 7))
  (core instance $i (instantiate $m))
  (func (export "handle") (result u32) (canon lift (core func $i "h"))))
"#;

#[tokio::test]
async fn plugins_that_do_not_fit_are_refused_at_load_naming_the_cause() {
    let mut d = Daemon::prepare(
        r#"
[queues.module]
plugin = "module"
[queues.wrongworld]
plugin = "wrongworld"
[queues.greedy]
plugin = "chaos"
grants = { index = ["products"] }
[queues.echo]
plugin = "echo"
"#,
        &[("chaos", "chaos"), ("echo", "echo")],
    );
    let plugins = d.dir.path().join("plugins");
    std::fs::write(
        plugins.join("module.wasm"),
        wat::parse_str("(module (func (export \"handle\")))").unwrap(),
    )
    .unwrap();
    std::fs::write(
        plugins.join("wrongworld.wasm"),
        wat::parse_str(WRONG_WORLD).unwrap(),
    )
    .unwrap();
    d.start().await;
    d.wait_plugin("echo").await;

    let cases = [
        (
            "module",
            "plugin \"module\": not a WebAssembly component: it is a core WebAssembly module",
        ),
        (
            "wrongworld",
            "plugin \"wrongworld\": does not fit the khata:plugin/handler world",
        ),
        (
            "greedy",
            "plugin \"chaos\" imports khata:plugin/kv but queue \"greedy\" is not granted it",
        ),
    ];
    let mut held = Vec::new();
    for (queue, reason) in cases {
        let q = d
            .wait_queue(queue, "refused", 30, |q| !q["load_error"].is_null())
            .await;
        let error = q["load_error"].as_str().unwrap();
        assert!(error.contains(reason), "{queue}: {error}");
        assert!(q["version"].is_null(), "{queue}: nothing serves: {q}");
        held.push(d.enqueue(queue, payload(json!({}))).await);
        eprintln!("{queue}: {error}");
    }
    let queues = d.cli_queues();
    for (_, reason) in cases {
        assert!(
            queues.contains(reason),
            "khata queues shows {reason:?}:\n{queues}"
        );
    }
    let log = d.log();
    for (queue, reason) in cases {
        assert!(
            log.lines()
                .any(|l| l.contains("plugin refused") && l.contains(reason)),
            "{queue}: the refusal is logged:\n{log}"
        );
    }
    // The ordinary queue is not affected; the refused queues hold their jobs.
    let ok = d.enqueue("echo", payload(json!({"fine": true}))).await;
    d.wait_state(&ok, "completed", 30).await;
    for id in &held {
        let j = d.job(id).await;
        assert_eq!(j["state"], "waiting", "{j}");
        assert!(j["attempts"].as_array().unwrap().is_empty(), "{j}");
    }
}
