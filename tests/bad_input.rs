//! Bad input gets a clear error and changes nothing.

use crate::support;

use serde_json::json;
use support::Daemon;

async fn job_count(d: &Daemon) -> usize {
    let (status, v) = d.call("GET", "/v1/jobs?limit=1000", None).await;
    assert_eq!(status, 200, "{v}");
    v["jobs"].as_array().unwrap().len()
}

#[tokio::test]
async fn bad_requests_are_refused_and_change_nothing() {
    let d = Daemon::start_new(
        "[queues.echo]\nplugin = \"echo\"\nmax_payload = \"1KiB\"\n",
        &[("echo", "echo")],
    )
    .await;
    let cases: Vec<(&str, String, u16, &str, &str)> = vec![
        (
            "/v1/queues/echo/jobs",
            "{not json".into(),
            400,
            "invalid_request",
            "request body",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "colour": "red"}"#.into(),
            400,
            "invalid_request",
            "colour",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"id": "x"}"#.into(),
            400,
            "invalid_request",
            "payload",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "delay": "soon"}"#.into(),
            400,
            "invalid_request",
            "delay",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "max_attempts": 0}"#.into(),
            400,
            "invalid_request",
            "max_attempts",
        ),
        (
            "/v1/queues/echo/jobs",
            format!(r#"{{"payload": "{}"}}"#, "x".repeat(2000)),
            413,
            "payload_too_large",
            "max_payload",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "id": "a\u0000b"}"#.into(),
            400,
            "invalid_request",
            "id must not contain control characters",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "dedup_key": "\u0000"}"#.into(),
            400,
            "invalid_request",
            "dedup_key must not contain control characters",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "id": "line\nbreak"}"#.into(),
            400,
            "invalid_request",
            "id must not contain control characters",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "dedup_key": "\u001b[31mred"}"#.into(),
            400,
            "invalid_request",
            "dedup_key must not contain control characters",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "delay": "8000years"}"#.into(),
            400,
            "invalid_request",
            "delay: the job would be due after 9999-12-31T23:59:59.999Z",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "run_at": "10000-01-01T00:00:00Z"}"#.into(),
            400,
            "invalid_request",
            "run_at",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "max_attempts": 4294967295}"#.into(),
            400,
            "invalid_request",
            "max_attempts must be 1 to 1000",
        ),
        (
            "/v1/queues/echo/jobs",
            r#"{"payload": {}, "id": "schedule:nightly:2026-12-05T00:00:00Z"}"#.into(),
            400,
            "invalid_request",
            "schedules' own",
        ),
        (
            "/v1/queues/echo/jobs/batch",
            r#"{"jobs": [{"payload": 1}, {"payload": 2, "delay": "8000years"}]}"#.into(),
            400,
            "invalid_request",
            "jobs[1].delay",
        ),
        (
            "/v1/queues/nope/jobs",
            r#"{"payload": {}}"#.into(),
            404,
            "unknown_queue",
            "nope",
        ),
        (
            "/v1/queues/echo/jobs/batch",
            r#"{"jobs": []}"#.into(),
            400,
            "invalid_request",
            "jobs",
        ),
    ];
    for (path, body, status, code, mention) in cases {
        let (got, v) = d.call_raw("POST", path, &body).await;
        assert_eq!(got, status, "{path} {body:.60}: {v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(mention),
            "message {message:?} should name {mention:?}"
        );
    }
    assert_eq!(job_count(&d).await, 0);
    let (status, v) = d.call("GET", "/v1/jobs?state=sleeping", None).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("state"));
    let (status, _) = d.call("GET", "/v1/jobs/no-such-job", None).await;
    assert_eq!(status, 404);
    // The CLI: malformed payload is a usage error.
    let out = d.cli(&["enqueue", "echo", "{oops"]);
    assert_eq!(out.status.code(), Some(2));
    let out = d.cli(&["enqueue", "nope", "{}"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_queue"));
    assert_eq!(job_count(&d).await, 0);
}

#[tokio::test]
async fn token_is_required_when_configured() {
    let mut d = Daemon::prepare_with(
        "[queues.echo]\nplugin = \"echo\"\n",
        &[("echo", "echo")],
        "token = \"s3cret-s3cret-s3cret\"",
    );
    d.start().await;
    let (status, _) = d
        .call("POST", "/v1/queues/echo/jobs", Some(json!({"payload": {}})))
        .await;
    assert_eq!(status, 201, "the right token works");
    let client = support::client();
    let url = format!("{}/v1/queues/echo/jobs", d.url);
    let none = client
        .post(&url)
        .json(&json!({"payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(none.status().as_u16(), 401);
    let wrong = client
        .post(&url)
        .bearer_auth("nope")
        .json(&json!({"payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    let body: serde_json::Value = wrong.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");
    let health = client
        .get(format!("{}/healthz", d.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200, "healthz needs no token");
    let ready = client
        .get(format!("{}/readyz", d.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 200, "readyz needs no token");
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(body["status"], "ready", "the store answers: {body}");
    // The scheme's name is matched without regard to case (RFC 9110 11.1).
    let lower = client
        .post(&url)
        .header("authorization", "bearer s3cret-s3cret-s3cret")
        .json(&json!({"payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(lower.status().as_u16(), 201, "`bearer` in lower case");
    assert_eq!(job_count(&d).await, 2, "refused requests enqueued nothing");
}

#[test]
fn malformed_jobs_toml_is_refused_with_its_position() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.toml");
    std::fs::write(&path, "[daemon]\nlisten = \"127.0.0.1:0\"\n\n[queues.echo]\nplugin = \"echo\"\ncolour = \"red\"\n").unwrap();
    for cmd in ["check", "serve"] {
        let out = std::process::Command::new(support::KHATA)
            .args([cmd, "-c"])
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("colour") && err.contains(":6:"),
            "{cmd}: {err}"
        );
    }
    assert!(
        !dir.path().join("data").exists(),
        "a refused config created nothing"
    );
}

#[test]
fn check_reports_plugin_errors() {
    let d = Daemon::prepare(
        "[queues.ok]\nplugin = \"echo\"\n[queues.greedy]\nplugin = \"chaos\"\n[queues.missing]\nplugin = \"nothing\"\n[queues.junk]\nplugin = \"junk\"\n",
        &[("echo", "echo"), ("chaos", "chaos")],
    );
    std::fs::write(d.dir.path().join("plugins/junk.wasm"), b"not wasm").unwrap();
    let out = std::process::Command::new(support::KHATA)
        .args(["check", "-c"])
        .arg(d.config_path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"greedy\"") && err.contains("khata:plugin/kv"),
        "ungranted import named: {err}"
    );
    assert!(
        err.contains("\"missing\"") && err.contains("nothing.wasm"),
        "missing file named: {err}"
    );
    assert!(
        err.contains("\"junk\"") && err.contains("not a WebAssembly component"),
        "{err}"
    );
}
