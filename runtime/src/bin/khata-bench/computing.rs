//! Figure 10: the daemon while every slot runs a guest that computes.
//!
//! Two queues of `chaos` (concurrency 4 each: four times the machine's two
//! runtime threads) take jobs that compute for [`COMPUTE`] without calling
//! the host. Once all eight are active, this process asks `/healthz` and
//! enqueues one `echo` job at a time on a third queue, for [`PROBE`], and
//! reports the latency of each kind (p50, p99, max) and whether every probe
//! job completed while the guests still computed. Before guests yielded at
//! each epoch tick, a health check waited for a computing guest to finish
//! (seconds).

use std::time::{Duration, Instant};

use anyhow::ensure;
use serde_json::json;

use super::{Bench, Row, millis, note};

const QUEUES: &str = "[queues.busy_a]\nplugin = \"chaos\"\nconcurrency = 4\ntimeout = \"120s\"\ngrants = { kv = true }\n\n\
     [queues.busy_b]\nplugin = \"chaos\"\nconcurrency = 4\ntimeout = \"120s\"\ngrants = { kv = true }\n\n\
     [queues.echo]\nplugin = \"echo\"\n";
/// How long each computing job computes.
const COMPUTE: Duration = Duration::from_secs(20);
/// How long the probes run, all within the guests' computing.
const PROBE: Duration = Duration::from_secs(12);

/// p50, p99 and max of `samples` (sorted here).
fn spread(samples: &mut [Duration]) -> (Duration, Duration, Duration) {
    samples.sort();
    let at = |q: usize| samples[(samples.len() * q / 100).min(samples.len() - 1)];
    (at(50), at(99), samples[samples.len() - 1])
}

pub async fn figure_computing(bench: &Bench) -> anyhow::Result<Vec<Row>> {
    let daemon = bench.daemon(QUEUES, &["chaos", "echo"]).await?;
    let api = &daemon.api;
    let ms = u64::try_from(COMPUTE.as_millis())?;
    for queue in ["busy_a", "busy_b"] {
        for _ in 0..4 {
            api.post(
                &format!("/v1/queues/{queue}/jobs"),
                json!({"payload": {"do": "compute", "ms": ms}}).to_string(),
            )
            .await?;
        }
    }
    let waiting = Instant::now();
    loop {
        let active: u64 = [api.counts("busy_a").await?, api.counts("busy_b").await?]
            .iter()
            .map(|c| c["active"].as_u64().unwrap_or(0))
            .sum();
        if active == 8 {
            break;
        }
        ensure!(
            waiting.elapsed() < Duration::from_secs(30),
            "only {active} of 8 computing jobs became active"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let computing_since = Instant::now();
    let (mut health, mut enqueue) = (Vec::new(), Vec::new());
    let mut ids = Vec::new();
    while computing_since.elapsed() < PROBE {
        let t = Instant::now();
        api.get("/healthz").await?;
        health.push(t.elapsed());
        let t = Instant::now();
        let answer = api
            .post(
                "/v1/queues/echo/jobs",
                json!({"payload": {"n": ids.len()}}).to_string(),
            )
            .await?;
        enqueue.push(t.elapsed());
        ids.push(answer["job"]["id"].as_str().unwrap_or_default().to_owned());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let echo = api.counts("echo").await?;
    let completed = echo["completed"].as_u64().unwrap_or(0);
    ensure!(
        computing_since.elapsed() < COMPUTE,
        "the probes outlasted the computing guests: the figure would not say what it claims"
    );
    let (h50, h99, hmax) = spread(&mut health);
    let (e50, e99, emax) = spread(&mut enqueue);
    note(format!(
        "10: while 8 guests computed: {} health checks p50 {} p99 {} max {}; {} enqueues p50 {} p99 {} max {}; {completed} of {} echo jobs completed meanwhile",
        health.len(),
        millis(h50),
        millis(h99),
        millis(hmax),
        enqueue.len(),
        millis(e50),
        millis(e99),
        millis(emax),
        ids.len()
    ));
    Ok(vec![
        Row::new(
            "10a. /healthz p99 while every slot computes (8 guests, 2 cores)",
            "≤ 50 ms",
            format!("{} (max {})", millis(h99), millis(hmax)),
            h99 <= Duration::from_millis(50),
        ),
        Row::new(
            "10b. enqueue p99 while every slot computes",
            "≤ 50 ms",
            format!("{} (max {})", millis(e99), millis(emax)),
            e99 <= Duration::from_millis(50),
        ),
        Row::report(
            "10c. echo jobs completed while every slot of two other queues computed",
            format!("{completed} of {}", ids.len()),
        ),
    ])
}
