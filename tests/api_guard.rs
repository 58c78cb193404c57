//! The API against web pages and broken routes (issue 19, docs/security.md):
//! a cross-site request cannot enqueue, a rebound host name cannot read, a
//! request without a JSON content type cannot change anything, and a route
//! that panics answers 500 with a JSON error while later requests work.

use crate::support;

use serde_json::{Value, json};
use support::{Daemon, payload};

async fn job_count(d: &Daemon) -> usize {
    let (status, v) = d.call("GET", "/v1/jobs?limit=1000", None).await;
    assert_eq!(status, 200, "{v}");
    v["jobs"].as_array().unwrap().len()
}

async fn answer(r: reqwest::RequestBuilder) -> (u16, Value) {
    let resp = r.send().await.expect("the daemon answers");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn cross_site_and_rebound_requests_are_refused_and_change_nothing() {
    let d = Daemon::start_new("[queues.echo]\nplugin = \"echo\"\n", &[("echo", "echo")]).await;
    d.wait_plugin("echo").await;
    let http = support::client();
    let enqueue = format!("{}/v1/queues/echo/jobs", d.url);
    let body = r#"{"payload": {"charge": 100}}"#;

    // A form or `no-cors` fetch from another site: text/plain, with its Origin.
    let (status, v) = answer(
        http.post(&enqueue)
            .header("content-type", "text/plain")
            .header("origin", "https://evil.example")
            .body(body),
    )
    .await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "origin_not_allowed", "{v}");

    // Without an Origin (an older browser), the content type still refuses it.
    for kind in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let (status, v) = answer(http.post(&enqueue).header("content-type", kind).body(body)).await;
        assert_eq!(status, 415, "{kind}: {v}");
        assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
    }
    let (status, v) = answer(http.post(format!("{}/v1/jobs/x/retry", d.url))).await;
    assert_eq!(status, 415, "a retry without a content type: {v}");

    // DNS rebinding: the page's own name, resolved to 127.0.0.1.
    let (status, v) = answer(
        http.get(format!("{}/v1/jobs", d.url))
            .header("host", "rebind.evil.example"),
    )
    .await;
    assert_eq!(status, 421, "{v}");
    assert_eq!(v["error"]["code"], "host_not_allowed", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("allowed_hosts"),
        "{v}"
    );
    // Probes name the daemon however they reach it.
    let (status, _) = answer(
        http.get(format!("{}/healthz", d.url))
            .header("host", "rebind.evil.example"),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(job_count(&d).await, 0, "nothing was enqueued");

    // The daemon's own origin and localhost work, as the dashboard does.
    let (status, v) = answer(
        http.post(&enqueue)
            .header("content-type", "application/json")
            .header("origin", &d.url)
            .body(body),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    let port = d.port;
    let (status, v) = answer(
        http.get(format!("{}/v1/queues", d.url))
            .header("host", format!("localhost:{port}"))
            .header("origin", format!("http://localhost:{port}")),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(job_count(&d).await, 1);
}

#[tokio::test]
async fn a_name_in_allowed_hosts_is_taken() {
    let d = Daemon::start_new_with(
        "[queues.echo]\nplugin = \"echo\"\n",
        &[("echo", "echo")],
        "allowed_hosts = [\"jobs.internal\"]",
    )
    .await;
    let http = support::client();
    let (status, v) = answer(
        http.get(format!("{}/v1/queues", d.url))
            .header("host", "Jobs.Internal:7373"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = answer(
        http.get(format!("{}/v1/queues", d.url))
            .header("host", "other.internal"),
    )
    .await;
    assert_eq!(status, 421);
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_route_that_panics_answers_500_and_the_daemon_goes_on() {
    let mut d = Daemon::prepare("[queues.echo]\nplugin = \"echo\"\n", &[("echo", "echo")]);
    d.env("FAILPOINTS", "api::get_job=1*panic");
    d.start().await;
    d.wait_plugin("echo").await;
    let id = d.enqueue("echo", payload(json!({"n": 1}))).await;
    let (status, v) = d.call("GET", &format!("/v1/jobs/{id}"), None).await;
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["error"]["code"], "internal", "{v}");
    // The failpoint fired once: the same request now works.
    let job = d.wait_state(&id, "completed", 30).await;
    assert_eq!(job["id"], id.as_str());
    let metrics = d.metrics().await;
    assert!(metrics.contains("khata_api_panics_total 1"), "{metrics}");
    assert!(d.log().contains("an API route panicked"), "{}", d.log());
}

/// 300 connections that send half a header and stop (slowloris) are closed
/// after `header_timeout`, and `/healthz` answers while they hang.
#[tokio::test]
async fn half_sent_requests_are_closed_and_the_api_answers_meanwhile() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start_new_with(
        "[queues.echo]\nplugin = \"echo\"\n",
        &[("echo", "echo")],
        "header_timeout = \"2s\"",
    )
    .await;
    let mut hanging = Vec::new();
    for _ in 0..300 {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
            .await
            .unwrap();
        s.write_all(b"POST /v1/queues/echo/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
            .await
            .unwrap();
        hanging.push(s);
    }
    let (status, _) = d.call("GET", "/healthz", None).await;
    assert_eq!(status, 200, "/healthz while 300 requests hang");
    // Each is closed by the daemon: a read ends (EOF or reset) well within
    // the 2 s timeout plus slack, where before nothing ever closed them.
    let closed = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        for mut s in hanging {
            let mut buf = [0u8; 256];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "half-sent requests were still open after 20 s"
    );
    assert_eq!(job_count(&d).await, 0);
}
