//! Producer-side deduplication through the real daemon (docs/jobs.md#enqueue-deduplication).

use crate::support;

use std::sync::Arc;

use serde_json::json;
use support::Daemon;

const QUEUES: &str = "[queues.echo]\nplugin = \"echo\"\n[queues.parked]\nplugin = \"absent\"\n";

#[tokio::test]
async fn thirty_two_concurrent_enqueues_of_one_id_make_one_job() {
    let d = Arc::new(Daemon::start_new(QUEUES, &[("echo", "echo")]).await);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let d = Arc::clone(&d);
            tokio::spawn(async move {
                d.call(
                    "POST",
                    "/v1/queues/echo/jobs",
                    Some(json!({"id": "order-42", "payload": {"n": 42}})),
                )
                .await
            })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        let (status, v) = t.await.unwrap();
        assert_eq!(v["job"]["id"], "order-42");
        match status {
            201 => {
                created += 1;
                assert_eq!(v["deduplicated"], false);
            }
            200 => assert_eq!(v["deduplicated"], true),
            other => panic!("unexpected {other}: {v}"),
        }
    }
    assert_eq!(created, 1);
    let (_, page) = d.call("GET", "/v1/jobs?queue=echo", None).await;
    assert_eq!(page["jobs"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn same_id_other_payload_is_refused() {
    let d = Daemon::start_new(QUEUES, &[("echo", "echo")]).await;
    d.enqueue("echo", json!({"id": "a", "payload": {"n": 1}}))
        .await;
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"id": "a", "payload": {"n": 2}})),
        )
        .await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["code"], "id_reused");
    // Same payload, keys in another order: the same job.
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"id": "a", "payload": {"n": 1}})),
        )
        .await;
    assert_eq!((status, &v["deduplicated"]), (200, &json!(true)));
    let out = d.cli(&["enqueue", "echo", r#"{"n":2}"#, "--id", "a"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("id_reused"));
}

#[tokio::test]
async fn dedup_key_holds_while_live_and_for_dedup_for() {
    let d = Daemon::start_new(QUEUES, &[("echo", "echo")]).await;
    // A parked queue (its plugin is absent) keeps its job waiting: live.
    let a = d
        .enqueue(
            "parked",
            json!({"dedup_key": "user-7", "payload": {"v": 1}}),
        )
        .await;
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/parked/jobs",
            Some(json!({"dedup_key": "user-7", "payload": {"v": 2}})),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        (v["job"]["id"].as_str().unwrap(), &v["deduplicated"]),
        (a.as_str(), &json!(true))
    );

    // Without dedup_for the key is free once the job completed.
    let b = d
        .enqueue("echo", json!({"dedup_key": "k", "payload": {}}))
        .await;
    d.wait_state(&b, "completed", 30).await;
    let c = d
        .enqueue("echo", json!({"dedup_key": "k", "payload": {}}))
        .await;
    assert_ne!(b, c);

    // With dedup_for it is held after completion.
    let e = d
        .enqueue(
            "echo",
            json!({"dedup_key": "t", "dedup_for": "1h", "payload": {}}),
        )
        .await;
    d.wait_state(&e, "completed", 30).await;
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"dedup_key": "t", "payload": {}})),
        )
        .await;
    assert_eq!(
        (status, v["job"]["id"].as_str().unwrap()),
        (200, e.as_str())
    );
}

#[tokio::test]
async fn release_does_not_free_a_key_a_newer_job_holds() {
    let d = Daemon::start_new(QUEUES, &[("echo", "echo")]).await;
    let a = d
        .enqueue("parked", json!({"dedup_key": "k", "payload": {"a": 1}}))
        .await;
    d.call("DELETE", &format!("/v1/jobs/{a}"), None).await;
    let b = d
        .enqueue("parked", json!({"dedup_key": "k", "payload": {"b": 1}}))
        .await;
    assert_ne!(a, b);
    // A is retried, then cancelled again: its end must not release B's key.
    let (status, _) = d.call("POST", &format!("/v1/jobs/{a}/retry"), None).await;
    assert_eq!(status, 200);
    d.call("DELETE", &format!("/v1/jobs/{a}"), None).await;
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/parked/jobs",
            Some(json!({"dedup_key": "k", "payload": {"c": 1}})),
        )
        .await;
    assert_eq!(
        (status, v["job"]["id"].as_str().unwrap()),
        (200, b.as_str())
    );
}

#[tokio::test]
async fn batch_enqueue_is_all_or_none() {
    let d = Daemon::start_new(QUEUES, &[("echo", "echo")]).await;
    d.enqueue("parked", json!({"id": "taken", "payload": {"x": 1}}))
        .await;
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/parked/jobs/batch",
            Some(json!({"jobs": [{"id": "new-1", "payload": {}}, {"id": "taken", "payload": {"x": 2}}]})),
        )
        .await;
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("jobs[1].id")
    );
    let (status, _) = d.call("GET", "/v1/jobs/new-1", None).await;
    assert_eq!(status, 404, "nothing of a refused batch was enqueued");

    let jobs: Vec<_> = (0..1000).map(|i| json!({"payload": {"i": i}})).collect();
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs/batch",
            Some(json!({"jobs": jobs})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 1000);
    assert_eq!(results[999]["job"]["payload"]["i"], 999);
}
