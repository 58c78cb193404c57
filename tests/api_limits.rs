//! Bounded bodies and listings (issue 19): a body past its route's limit is
//! refused by its `Content-Length` before it is read, or as soon as the read
//! passes the limit, with the JSON error body and nothing stored; payloads
//! are kept as the JSON text that was sent (big numbers exactly); a listing
//! of big payloads ends at its byte budget and costs the daemon about twice
//! the answer, not a tree of it.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::Daemon;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn job_count(d: &Daemon) -> usize {
    let (status, v) = d.call("GET", "/v1/jobs?limit=1000", None).await;
    assert_eq!(status, 200, "{v}");
    v["jobs"].as_array().unwrap().len()
}

/// The daemon's resident set, and its peak since the last reset, in KiB
/// (`/proc/PID/status`).
fn memory(d: &Daemon) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {status}"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the peak resident set to the current one.
fn reset_peak(d: &Daemon) {
    std::fs::write(format!("/proc/{}/clear_refs", d.pid()), "5").unwrap();
}

/// Sends `head` (a request's header) and then `body` in pieces, stopping at
/// the first write error (the daemon may close once it has answered), and
/// returns the status line and the JSON error body.
async fn raw_request(d: &Daemon, head: &str, body: &[u8]) -> (String, Value) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut reader, mut writer) = s.into_split();
    let body = body.to_vec();
    let sender = tokio::spawn(async move {
        for piece in body.chunks(64 << 10) {
            if writer.write_all(piece).await.is_err() {
                break;
            }
        }
        writer
    });
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        let mut buf = [0u8; 8192];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buf[..n]);
                    if let Some(end) = find(&answer, b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&answer[..end]).to_lowercase();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if answer.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer within 30 s");
    sender.abort();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.lines().next().unwrap_or_default().to_owned();
    (
        status,
        serde_json::from_str(body).unwrap_or(Value::String(body.to_owned())),
    )
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[tokio::test]
async fn bodies_past_their_limit_are_refused_before_they_are_read() {
    let d = Daemon::start_new_with(
        "[queues.echo]\nplugin = \"echo\"\nmax_payload = \"64KiB\"\n",
        &[("echo", "echo")],
        "max_request = \"1MiB\"",
    )
    .await;
    d.wait_plugin("echo").await;
    reset_peak(&d);
    let (rss_before, _) = memory(&d);

    // 60 MiB announced, none of it sent: refused by the length alone.
    for (path, what) in [
        ("/v1/queues/echo/jobs", "max_payload"),
        ("/v1/queues/echo/jobs/batch", "max_request"),
        ("/v1/fences/resolve", "fence resolution"),
    ] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            60 << 20
        );
        let (status, v) = raw_request(&d, &head, b"").await;
        assert!(status.contains(" 413 "), "{path}: {status} {v}");
        assert_eq!(v["error"]["code"], "request_too_large", "{path}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(what), "{path}: {message}");
    }

    // 8 MiB chunked, without a length: refused once the read passes 1 MiB.
    let chunk = format!("{:x}\r\n{}\r\n", 1 << 20, "x".repeat(1 << 20));
    let body = chunk.repeat(8);
    let (status, v) = raw_request(
        &d,
        "POST /v1/queues/echo/jobs/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
        body.as_bytes(),
    )
    .await;
    assert!(status.contains(" 413 "), "{status} {v}");
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");

    // A payload past max_payload inside a body that fits the route.
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"payload": "x".repeat(100 << 10)})),
        )
        .await;
    assert_eq!(status, 413, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_payload")
    );

    let (_, peak) = memory(&d);
    assert!(
        peak < rss_before + 16 * 1024,
        "peak resident set rose by {} KiB to refuse bodies",
        peak.saturating_sub(rss_before)
    );
    assert_eq!(job_count(&d).await, 0, "nothing was stored");
    let (status, _) = d.call("GET", "/healthz", None).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_payload_is_kept_as_sent_and_an_id_deduplicates_by_its_meaning() {
    let d = Daemon::start_new("[queues.parked]\nplugin = \"absent\"\n", &[]).await;
    let body = r#"{"payload": {"big": 123456789012345678901234567890, "z": 1, "a": [1.50, "é"]}, "id": "exact"}"#;
    let (status, v) = d.call_raw("POST", "/v1/queues/parked/jobs", body).await;
    assert_eq!(status, 201, "{v}");
    let text = d
        .http
        .get(format!("{}/v1/jobs/exact", d.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(
            r#""payload":{"big": 123456789012345678901234567890, "z": 1, "a": [1.50, "é"]}"#
        ),
        "the payload as sent: {text}"
    );
    // The same id with the same JSON in another order and spacing is the
    // same job; with another value it is a conflict.
    let again = r#"{"id": "exact", "payload": {"a":[1.50,"é"],"z":1,"big":123456789012345678901234567890}}"#;
    let (status, v) = d.call_raw("POST", "/v1/queues/parked/jobs", again).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["deduplicated"], true, "{v}");
    let other = r#"{"id": "exact", "payload": {"big": 1, "z": 1, "a": [1.50, "é"]}}"#;
    let (status, v) = d.call_raw("POST", "/v1/queues/parked/jobs", other).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(job_count(&d).await, 1);

    // The CLI sends its payload argument as it is, too.
    let out = d.cli(&[
        "enqueue",
        "parked",
        r#"{"big": 123456789012345678901234567890}"#,
        "--id",
        "from-cli",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = d
        .http
        .get(format!("{}/v1/jobs/from-cli", d.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(r#""payload":{"big":123456789012345678901234567890}"#)
            || text.contains(r#""payload":{"big": 123456789012345678901234567890}"#),
        "{text}"
    );
}

#[tokio::test]
async fn listing_big_payloads_costs_about_twice_the_answer() {
    let d = Daemon::start_new(
        "[queues.parked]\nplugin = \"absent\"\nmax_payload = \"2MiB\"\n",
        &[],
    )
    .await;
    // 20 jobs of 1 MiB each, of the shape that cost most as a tree: many
    // small numbers.
    let numbers: Vec<u32> = (0..150_000).collect();
    for i in 0..20 {
        let (status, v) = d
            .call(
                "POST",
                "/v1/queues/parked/jobs",
                Some(json!({"payload": {"i": i, "numbers": numbers}})),
            )
            .await;
        assert_eq!(status, 201, "{v}");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    reset_peak(&d);
    let (rss_before, _) = memory(&d);
    let answer = d
        .http
        .get(format!("{}/v1/jobs?limit=20", d.url))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let page: Value = serde_json::from_slice(&answer).unwrap();
    let (_, peak) = memory(&d);
    let rise = peak.saturating_sub(rss_before) * 1024;
    assert!(
        rise < 3 * answer.len() as u64,
        "a {} byte answer raised the peak resident set by {rise} bytes",
        answer.len()
    );
    // The page ended at its byte budget (8 MiB), before `limit`, and the
    // cursor leads through the rest: every job once.
    let first = page["jobs"].as_array().unwrap().len();
    assert!((8..20).contains(&first), "{first} jobs on the first page");
    assert!(answer.len() < 10 << 20, "{} bytes", answer.len());
    let mut seen = first;
    let mut cursor = page["next_cursor"].as_str().map(str::to_owned);
    while let Some(c) = cursor {
        let (status, v) = d
            .call("GET", &format!("/v1/jobs?limit=20&cursor={c}"), None)
            .await;
        assert_eq!(status, 200, "{v}");
        seen += v["jobs"].as_array().unwrap().len();
        cursor = v["next_cursor"].as_str().map(str::to_owned);
    }
    assert_eq!(seen, 20);
}
