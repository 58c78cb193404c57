//! Figure 11: the soak (`--only 11 --soak 10m`). One daemon runs a mix of
//! `echo` and existence-check jobs at about 80% of the rate it completes
//! them at under full load (measured first, in a warm-up with the soak's
//! retention and a `kill -9`), with `[retention] jobs = "30s"`, and is
//! killed with `kill -9` and restarted every two minutes. Every 5 s the
//! bench samples the completion rate, the daemon's RSS, the ledger's size on
//! disk (database and WAL), the p99 latency of single enqueues and the jobs
//! waiting. At the end it reports the jobs lost (must be 0) and the slopes
//! of RSS, disk and backlog over the last half of the run (flat within noise
//! when retention keeps up, the load is one the daemon sustains and nothing
//! leaks), and writes the series as a PNG plot.
//!
//! Jobs lost: every acknowledged existence-check job leaves a kv entry
//! `seen:<key>`, written after its acknowledgement, which retention keeps
//! for a minute (`[retention] kv = { exists = "60s" }`, so that the
//! ledger levels off); so after the run the ledger must hold one for each
//! existence check acknowledged in the last [`CHECKED`] before the daemon
//! stopped, which no sweep can have reached yet; every probe job (an `echo` enqueued
//! alone every 100 ms, whose latency is the p99) is looked up 10-20 s after
//! its acknowledgement, before retention may remove it, and must be
//! completed or on its way.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use super::{Bench, Daemon, Row, millis, note, thousands};

const QUEUES: &str = "[retention]\njobs = \"30s\"\nkv = { exists = \"60s\" }\n\n\
     [queues.echo]\nplugin = \"echo\"\nconcurrency = 16\n\n\
     [queues.exists]\nplugin = \"chaos\"\nconcurrency = 16\ngrants = { kv = true }\n";
/// The warm-up that measures the maximum rate: the queues are kept full
/// this long, with a `kill -9` halfway, and the rate is what was completed
/// after [`WARM_UNCOUNTED`] (by when retention sweeps jobs and kv entries as
/// it will in the soak) divided by the time since.
const WARM_UP: Duration = Duration::from_secs(240);
const WARM_UNCOUNTED: Duration = Duration::from_secs(75);
/// During the warm-up each queue is topped up to this many waiting jobs.
const WARM_WAITING: u64 = 4_000;
const SAMPLE: Duration = Duration::from_secs(5);
const KILL_EVERY: Duration = Duration::from_secs(120);
const TICK: Duration = Duration::from_millis(100);
/// The existence checks whose `seen:` entries are counted: those
/// acknowledged this long before the daemon stops, well inside the kv
/// window of `QUEUES` (60 s), so retention cannot have removed them.
const CHECKED: Duration = Duration::from_secs(40);

/// One sample of the series.
#[derive(Debug, Clone, Copy)]
struct Sample {
    minutes: f64,
    jobs_per_second: f64,
    rss_mib: f64,
    disk_mib: f64,
    p99_ms: f64,
    /// Jobs waiting in both queues: a backlog that grows means the load is
    /// more than the daemon completes, and the ledger grows with it.
    waiting: f64,
}

fn exists_job(key: &str) -> Value {
    json!({"id": key, "payload": {"do": "exists", "key": key}})
}

fn echo_job(id: &str) -> Value {
    json!({"id": id, "payload": {"n": id}})
}

/// Sum of `khata_jobs_finished_total` over queues and states.
async fn finished(daemon: &Daemon) -> anyhow::Result<f64> {
    let text = daemon
        .api
        .http
        .get(format!("{}/metrics", daemon.api.base))
        .send()
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("khata_jobs_finished_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// Bytes of the ledger's files (the database, its WAL and shared memory).
fn ledger_bytes(data: &Path) -> u64 {
    ["khata.db", "khata.db-wal", "khata.db-shm"]
        .iter()
        .filter_map(|f| std::fs::metadata(data.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

/// Least-squares slope of `y` over `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if den == 0.0 { 0.0 } else { num / den }
}

/// Jobs waiting in both queues; `None` while the daemon is down.
async fn waiting(daemon: &Daemon) -> Option<u64> {
    let mut n = 0;
    for q in ["echo", "exists"] {
        n += daemon.api.counts(q).await.ok()?["waiting"].as_u64()?;
    }
    Some(n)
}

/// Completions counted since `last` read of `khata_jobs_finished_total`,
/// which a restart resets to zero.
fn since(last: f64, now: f64) -> f64 {
    if now >= last { now - last } else { now }
}

/// The rate the daemon completes the mix at under full load, in the
/// conditions of the soak: retention sweeping (`QUEUES`) and a `kill -9`
/// and restart (see [`WARM_UP`]). A drain from a standstill on an empty
/// ledger is faster than what the daemon sustains with sweeps and restarts,
/// and 80% of it is not a load the daemon keeps up with. Ends when the
/// warm-up's backlog is drained.
async fn sustained_rate(daemon: &mut Daemon) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut killed = false;
    let mut next = 0usize;
    let mut counted: Option<(Instant, f64)> = None;
    let mut last = 0.0;
    let mut done = 0.0;
    while started.elapsed() < WARM_UP {
        for queue in ["echo", "exists"] {
            let Ok(c) = daemon.api.counts(queue).await else {
                continue;
            };
            let short = WARM_WAITING.saturating_sub(c["waiting"].as_u64().unwrap_or(0));
            if short < WARM_WAITING / 4 {
                continue;
            }
            let jobs: Vec<Value> = (next..next + short as usize)
                .map(|i| match queue {
                    "echo" => echo_job(&format!("w-e-{i}")),
                    _ => exists_job(&format!("w-x-{i}")),
                })
                .collect();
            for chunk in jobs.chunks(1000) {
                post_until_taken(daemon, queue, chunk).await?;
            }
            next += short as usize;
        }
        if let Ok(now) = finished(daemon).await {
            done += since(last, now);
            last = now;
        }
        if counted.is_none() && started.elapsed() >= WARM_UNCOUNTED {
            counted = Some((Instant::now(), done));
        }
        if !killed && started.elapsed() >= WARM_UP / 2 {
            daemon.kill9()?;
            daemon.spawn()?;
            daemon.wait_healthy().await?;
            killed = true;
            last = 0.0;
        }
        tokio::time::sleep(TICK).await;
    }
    let (from, before) = counted.context("the warm-up was shorter than its uncounted start")?;
    let rate = (done - before) / from.elapsed().as_secs_f64();
    let drained = Instant::now();
    while waiting(daemon).await != Some(0) {
        ensure!(
            drained.elapsed() < Duration::from_secs(600),
            "the warm-up's backlog did not drain in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(rate > 0.0, "nothing was completed in the warm-up");
    Ok(rate)
}

/// Posts `jobs` as one batch until the daemon takes it (it may be down for
/// a restart); the ids make a repeat harmless.
async fn post_until_taken(daemon: &Daemon, queue: &str, jobs: &[Value]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let sent = daemon
            .api
            .post(
                &format!("/v1/queues/{queue}/jobs/batch"),
                json!({"jobs": jobs}).to_string(),
            )
            .await;
        match sent {
            Ok(_) => return Ok(()),
            Err(e) => {
                ensure!(
                    Instant::now() < deadline,
                    "a batch was refused for 120 s: {e:#}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

pub async fn figure_soak(
    bench: &Bench,
    run_for: Duration,
    plot: &Path,
) -> anyhow::Result<Vec<Row>> {
    let mut daemon = bench.daemon(QUEUES, &["echo", "chaos"]).await?;
    let data = daemon.dir.join("data");

    let max_rate = sustained_rate(&mut daemon).await?;
    let rate = 0.8 * max_rate;
    note(format!(
        "11: the mix is completed at {} jobs/s under full load, with retention and a kill -9; soaking at {} jobs/s for {}",
        thousands(max_rate),
        thousands(rate),
        humantime::format_duration(run_for)
    ));

    let soak_start = Instant::now();
    let mut last_kill = Instant::now();
    let mut last_sample = Instant::now();
    let mut last_finished = finished(&daemon).await.unwrap_or(0.0);
    let mut owed = 0.0_f64;
    let (mut next_e, mut next_x, mut next_p) = (0usize, 0usize, 0usize);
    let mut latencies: Vec<Duration> = Vec::new();
    // Probe jobs waiting to be looked up: (id, acknowledged at).
    let mut probes: VecDeque<(String, Instant)> = VecDeque::new();
    let (mut probes_checked, mut probes_lost) = (0usize, 0usize);
    let mut samples: Vec<Sample> = Vec::new();
    // Existence-check batches: (acknowledged at, first number, how many).
    let mut checks_acked: Vec<(Instant, usize, usize)> = Vec::new();
    let mut kills = 0;
    while soak_start.elapsed() < run_for {
        let tick = Instant::now();
        // The load: what the rate owes since the last tick, half each kind.
        owed += rate * TICK.as_secs_f64();
        let n = owed.floor() as usize;
        owed -= n as f64;
        let echoes: Vec<Value> = (0..n / 2)
            .map(|i| echo_job(&format!("e-{}", next_e + i)))
            .collect();
        let checks: Vec<Value> = (0..n - n / 2)
            .map(|i| exists_job(&format!("x-{}", next_x + i)))
            .collect();
        if !echoes.is_empty() {
            post_until_taken(&daemon, "echo", &echoes).await?;
            next_e += echoes.len();
        }
        if !checks.is_empty() {
            post_until_taken(&daemon, "exists", &checks).await?;
            checks_acked.push((Instant::now(), next_x, checks.len()));
            next_x += checks.len();
        }
        // One probe, timed alone.
        let id = format!("p-{next_p}");
        let sent = Instant::now();
        if daemon
            .api
            .post("/v1/queues/echo/jobs", echo_job(&id).to_string())
            .await
            .is_ok()
        {
            latencies.push(sent.elapsed());
            probes.push_back((id, Instant::now()));
            next_p += 1;
        }
        // Probes acknowledged 10 s ago: completed, or still on their way.
        while let Some((id, at)) = probes.front().cloned() {
            if at.elapsed() < Duration::from_secs(10) {
                break;
            }
            match daemon.api.get(&format!("/v1/jobs/{id}")).await {
                Ok(job) => {
                    let state = job["state"].as_str().unwrap_or_default();
                    if state == "completed" || at.elapsed() > Duration::from_secs(20) {
                        probes_checked += 1;
                        if state != "completed" {
                            probes_lost += 1;
                            note(format!(
                                "11: probe {id} is {state} 20 s after its acknowledgement"
                            ));
                        }
                        probes.pop_front();
                    } else {
                        break;
                    }
                }
                Err(e) if e.to_string().contains("404") => {
                    probes_checked += 1;
                    probes_lost += 1;
                    note(format!(
                        "11: probe {id} is gone 10-20 s after its acknowledgement"
                    ));
                    probes.pop_front();
                }
                // Down for a restart: look again next tick.
                Err(_) => break,
            }
        }
        if last_sample.elapsed() >= SAMPLE {
            let now_finished = finished(&daemon).await.unwrap_or(last_finished);
            let done = since(last_finished, now_finished);
            let mut window = std::mem::take(&mut latencies);
            window.sort();
            let p99 = window
                .get((window.len() * 99 / 100).min(window.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default();
            let sample = Sample {
                minutes: soak_start.elapsed().as_secs_f64() / 60.0,
                jobs_per_second: done / last_sample.elapsed().as_secs_f64(),
                rss_mib: daemon.memory("VmRSS").unwrap_or(0.0),
                disk_mib: ledger_bytes(&data) as f64 / f64::from(1 << 20),
                p99_ms: p99.as_secs_f64() * 1e3,
                waiting: waiting(&daemon).await.map_or(f64::NAN, |n| n as f64),
            };
            note(format!(
                "11: {:.1} min: {} jobs/s, RSS {:.0} MiB, ledger {:.0} MiB, enqueue p99 {:.1} ms, {} waiting",
                sample.minutes,
                thousands(sample.jobs_per_second),
                sample.rss_mib,
                sample.disk_mib,
                sample.p99_ms,
                thousands(sample.waiting)
            ));
            samples.push(sample);
            last_finished = now_finished;
            last_sample = Instant::now();
        }
        if last_kill.elapsed() >= KILL_EVERY {
            daemon.kill9()?;
            daemon.spawn()?;
            daemon.wait_healthy().await?;
            kills += 1;
            last_kill = Instant::now();
            last_finished = 0.0;
        }
        if let Some(rest) = TICK.checked_sub(tick.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }

    // Drain, stop, and count what the ledger holds of the acknowledged.
    let drained = Instant::now();
    loop {
        let mut left = 0;
        for q in ["echo", "exists"] {
            let c = daemon.api.counts(q).await?;
            left += c["waiting"].as_u64().unwrap_or(0) + c["active"].as_u64().unwrap_or(0);
        }
        if left == 0 {
            break;
        }
        ensure!(
            drained.elapsed() < Duration::from_secs(600),
            "the soak's backlog did not drain"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    daemon.kill9()?;
    let cutoff = Instant::now().checked_sub(CHECKED).unwrap_or(soak_start);
    let keys: Vec<String> = checks_acked
        .iter()
        .filter(|(at, ..)| *at >= cutoff)
        .flat_map(|&(_, first, n)| (first..first + n).map(|i| format!("seen:x-{i}")))
        .collect();
    let seen = count_seen(&data, &keys)?;
    let expected = keys.len() as u64;
    let lost = expected.saturating_sub(seen) + probes_lost as u64;

    let half: Vec<&Sample> = samples.iter().skip(samples.len() / 2).collect();
    let rss_slope = slope(
        &half
            .iter()
            .map(|s| (s.minutes, s.rss_mib))
            .collect::<Vec<_>>(),
    );
    let disk_slope = slope(
        &half
            .iter()
            .map(|s| (s.minutes, s.disk_mib))
            .collect::<Vec<_>>(),
    );
    let backlog_slope = slope(
        &half
            .iter()
            .filter(|s| s.waiting.is_finite())
            .map(|s| (s.minutes, s.waiting))
            .collect::<Vec<_>>(),
    );
    draw(plot, &samples).with_context(|| format!("drawing {}", plot.display()))?;
    note(format!(
        "11: {} jobs acknowledged ({} existence checks; of the {} acknowledged in the last {} before the stop, {} found in the ledger; {probes_checked} probes checked), {lost} lost, {kills} kill -9; last half: RSS {rss_slope:+.2} MiB/min, ledger {disk_slope:+.2} MiB/min, backlog {backlog_slope:+.0} jobs/min; plot in {}",
        thousands((next_e + next_x + next_p) as f64),
        thousands(next_x as f64),
        thousands(expected as f64),
        humantime::format_duration(CHECKED),
        thousands(seen as f64),
        plot.display()
    ));
    let p99_all = {
        let mut all: Vec<f64> = samples.iter().map(|s| s.p99_ms).collect();
        all.sort_by(f64::total_cmp);
        all.last().copied().unwrap_or(0.0)
    };
    Ok(vec![
        Row::new(
            "11a. soak: jobs lost (kill -9 every 2 min)",
            "0",
            lost.to_string(),
            lost == 0,
        ),
        Row::report(
            "11b. soak: RSS, ledger and backlog slopes over the last half",
            format!(
                "{rss_slope:+.2} MiB/min, {disk_slope:+.2} MiB/min, {backlog_slope:+.0} jobs/min"
            ),
        ),
        Row::report(
            "11c. soak: load, and the worst 5 s enqueue p99",
            format!(
                "{} jobs/s (80% of {}), {}",
                thousands(rate),
                thousands(max_rate),
                millis(Duration::from_secs_f64(p99_all / 1e3))
            ),
        ),
    ])
}

/// How many of `keys` the ledger holds in the `exists` kv namespace, read
/// from the stopped daemon's SQLite file.
fn count_seen(data: &Path, keys: &[String]) -> anyhow::Result<u64> {
    let conn = rusqlite::Connection::open_with_flags(
        data.join("khata.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )?;
    let mut held = conn.prepare("SELECT 1 FROM kv WHERE namespace = 'exists' AND key = ?1")?;
    let mut n = 0;
    for key in keys {
        if held.exists([key])? {
            n += 1;
        }
    }
    Ok(n)
}

/// One series of the plot: its value in a sample.
type Series = fn(&Sample) -> f64;

/// The five series, one chart each, minutes across.
fn draw(path: &Path, samples: &[Sample]) -> anyhow::Result<()> {
    use plotters::prelude::*;
    register_font()?;
    let fail = |e: &dyn std::fmt::Debug| anyhow::anyhow!("{e:?}");
    let root = BitMapBackend::new(path, (1200, 1700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let areas = root.split_evenly((5, 1));
    let end = samples.last().map_or(1.0, |s| s.minutes).max(0.1);
    let series: [(&str, Series); 5] = [
        ("jobs completed per second", |s| s.jobs_per_second),
        ("daemon RSS (MiB)", |s| s.rss_mib),
        ("ledger on disk: database + WAL (MiB)", |s| s.disk_mib),
        ("enqueue latency p99 over 5 s (ms)", |s| s.p99_ms),
        ("jobs waiting (both queues)", |s| s.waiting),
    ];
    for (area, (title, value)) in areas.iter().zip(series) {
        let top = samples
            .iter()
            .map(value)
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max)
            .max(1.0)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("minutes")
            .draw()
            .map_err(|e| fail(&e))?;
        chart
            .draw_series(LineSeries::new(
                samples
                    .iter()
                    .map(|s| (s.minutes, value(s)))
                    .filter(|(_, v)| v.is_finite()),
                &BLUE,
            ))
            .map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// plotters draws text with a font it is given: DejaVu Sans, which Debian
/// installs with most desktops (`fonts-dejavu-core`).
fn register_font() -> anyhow::Result<()> {
    let candidates = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    ];
    let path: PathBuf = candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .context("no DejaVuSans.ttf for the plot's text: apt-get install fonts-dejavu-core")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(&path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{} is not a font plotters can use", path.display()))
}
