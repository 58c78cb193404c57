//! No acknowledged job is lost and no completed job runs again across
//! `kill -9` of the real daemon at random moments (docs/jobs.md#crash-recovery-and-lease-expiry).

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use support::Daemon;
use tokio::sync::RwLock;

const JOBS: usize = 2000;
const BATCH: usize = 50;

fn jitter_ms(lo: u64, hi: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    lo + u64::from(nanos) % (hi - lo)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_three_times_loses_nothing_and_completes_each_job_once() {
    kill_nine_three_times("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_three_times_on_sled_loses_nothing_and_completes_each_job_once() {
    kill_nine_three_times("[store]\nbackend = \"sled\"\n").await;
}

/// The run, on the store that `store_toml` (a `[store]` section, or nothing
/// for the default) configures.
async fn kill_nine_three_times(store_toml: &str) {
    let d = Daemon::start_new(
        &format!(
            "{store_toml}[queues.work]\nplugin = \"chaos\"\nconcurrency = 16\nmax_attempts = 10\ngrants = {{ kv = true }}\n"
        ),
        &[("chaos", "chaos")],
    )
    .await;
    d.wait_plugin("work").await;
    let d = Arc::new(RwLock::new(d));
    let producing = Arc::new(AtomicBool::new(true));

    // The producer retries each batch (same ids) until it is acknowledged,
    // as a real producer retries across a daemon's restart.
    let producer = {
        let (d, producing) = (Arc::clone(&d), Arc::clone(&producing));
        tokio::spawn(async move {
            for start in (0..JOBS).step_by(BATCH) {
                let jobs: Vec<_> = (start..start + BATCH)
                    .map(|i| json!({"id": format!("crash-{i}"), "payload": {"do": "sleep", "ms": 3, "i": i}}))
                    .collect();
                loop {
                    let attempt = {
                        let d = d.read().await;
                        d.http
                            .post(format!("{}/v1/queues/work/jobs/batch", d.url))
                            .json(&json!({"jobs": jobs}))
                            .timeout(Duration::from_secs(10))
                            .send()
                            .await
                    };
                    match attempt {
                        Ok(r) if r.status().is_success() => break,
                        Ok(r) => assert!(
                            r.status().is_server_error(),
                            "batch refused: {}",
                            r.status()
                        ),
                        Err(_) => {}
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            producing.store(false, Ordering::SeqCst);
        })
    };

    for kill in 0..3 {
        tokio::time::sleep(Duration::from_millis(jitter_ms(150, 900))).await;
        let mut guard = d.write().await;
        guard.kill9();
        // Restart on the same data directory.
        guard.start().await;
        eprintln!("kill -9 number {} done, restarted", kill + 1);
    }
    producer.await.unwrap();
    assert!(!producing.load(Ordering::SeqCst));

    let d = d.read().await;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let q = d.queue("work").await;
        let counts = &q["counts"];
        if counts["completed"] == JOBS {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not all jobs completed: {counts}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let mut abandoned = 0;
    for i in 0..JOBS {
        let j = d.job(&format!("crash-{i}")).await;
        assert_eq!(j["state"], "completed", "crash-{i}: {j}");
        assert_eq!(j["result"]["slept"], 3);
        let attempts = j["attempts"].as_array().unwrap();
        let completed = attempts
            .iter()
            .filter(|a| a["outcome"] == "completed")
            .count();
        assert_eq!(completed, 1, "crash-{i} completed more than once: {j}");
        assert_eq!(
            attempts.last().unwrap()["outcome"],
            "completed",
            "crash-{i}: nothing ran after completion: {j}"
        );
        for a in &attempts[..attempts.len() - 1] {
            assert_eq!(
                a["outcome"], "abandoned",
                "crash-{i}: an earlier attempt that is not abandoned: {j}"
            );
            assert!(a["ended_at"].is_string());
            abandoned += 1;
        }
    }
    let (_, page) = d.call("GET", "/v1/jobs?queue=work&limit=1000", None).await;
    assert!(
        page["next_cursor"].is_string(),
        "more than one page of jobs"
    );
    eprintln!("{abandoned} abandoned attempts recorded and redelivered");
}
