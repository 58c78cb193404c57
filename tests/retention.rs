//! Retention keeps up (issue 20): the sweep removes everything due in
//! passes that follow each other while more is due, instead of 1,000 rows a
//! minute, on every embedded backend.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::Daemon;

const JOBS: usize = 6_000;

async fn sweeps_everything_due(store: &str) {
    let d = Daemon::start_new(
        &format!("{store}[retention]\njobs = \"1s\"\n\n[queues.echo]\nplugin = \"echo\"\nconcurrency = 16\n"),
        &[("echo", "echo")],
    )
    .await;
    d.wait_plugin("echo").await;
    for batch in 0..JOBS / 1000 {
        let jobs: Vec<_> = (0..1000)
            .map(|i| json!({"payload": {"n": batch * 1000 + i}}))
            .collect();
        let (status, v) = d
            .call(
                "POST",
                "/v1/queues/echo/jobs/batch",
                Some(json!({"jobs": jobs})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    // Every job completes and, a second after, is due for deletion. The old
    // sweep (1,000 rows every 60 s) needed 6 minutes; passes back to back
    // need well under a minute.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last;
    loop {
        let q = d.queue("echo").await;
        last = q["counts"].clone();
        let left: u64 = ["waiting", "active", "completed", "delayed"]
            .iter()
            .map(|s| last[*s].as_u64().unwrap_or(0))
            .sum();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{store}: jobs left a minute after enqueue: {last}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The counter moves once the pass is durable; on sled the counts may
    // show the deletions a moment before.
    loop {
        let swept = d
            .metrics()
            .await
            .lines()
            .find(|l| l.starts_with("khata_retention_swept_total{kind=\"jobs\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok());
        if swept == Some(JOBS as u64) {
            break;
        }
        assert!(
            Instant::now() < deadline && swept.unwrap_or(0) < JOBS as u64,
            "{store}: swept {swept:?} of {JOBS}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_sweep_keeps_up_on_sqlite() {
    sweeps_everything_due("").await;
}

#[tokio::test]
async fn the_sweep_keeps_up_on_sled() {
    sweeps_everything_due("[store]\nbackend = \"sled\"\n\n").await;
}
