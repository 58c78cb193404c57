//! `khata-bench`: measures the daemon's throughput and latency and prints a
//! table of figures against their targets.
//!
//! Every figure except the invocation cost runs the real `khata` binary on a
//! fresh data directory under the system's temporary directory, with a
//! generated `jobs.toml` and the guests built by `scripts/build-plugins`, and
//! drives it over HTTP from this process, as a producer would. Every answer
//! the daemon gives is durable (it fsyncs before it answers), so nothing here
//! waits for anything more. The figures:
//!
//! 1. jobs/s of `echo`: 20,000 jobs enqueued ahead, all due at one moment `T`,
//!    concurrency 16; the rate is 20,000 / (moment all are completed - `T`).
//! 2. jobs/s of the existence check (`chaos` with `"do": "exists"`, kv
//!    insert-if-absent and put), the same way.
//! 3. enqueue/s into a parked queue (its plugin file is absent, so nothing
//!    runs): one request at a time, 16 in flight (with latency p50/p99), and
//!    batches of 1,000.
//! 4. µs per handler invocation (instantiate, call, drop) in this process,
//!    through the `khata` library, and invocations/s with 2 tasks.
//! 5. seconds from restarting a `kill -9`ed daemon to the first redelivery.
//! 6. the daemon's RSS with a backlog of waiting jobs, the bulk enqueue rate,
//!    and figure 1 again with that backlog, against a backlog of 10,000:
//!    100,000 by default, 1,000,000 with `--million`; the ledger's size on
//!    disk with the backlog waiting (the data directory but the code cache),
//!    and the reopen time: the daemon killed with `kill -9` holding the
//!    backlog, its queue given `echo`, and the time from spawning the daemon
//!    again to the first job of the backlog completed (the ledger opened,
//!    recovered and leasing), with the time to healthy beside it.
//! 7. effects, durable, concurrency 16, 10,000 jobs due at once
//!    (`--effect-jobs`): jobs/s of `welcome_email` through the outbox, and
//!    through SMTP to a local aiosmtpd sink (python3 with aiosmtpd, as the
//!    tests use; skipped with a note when it is missing; one Python thread,
//!    it may be what bounds the figure: its CPU per message is noted);
//!    jobs/s of `charge_customer` against a payments API served by this
//!    process (axum on 127.0.0.1). And the cost of the fence itself: in this process,
//!    through the `khata` library, one `Effects::http_send` (fence `started`,
//!    durably; the request; fence `done`, durably; the effect record) against
//!    the bare `Provider::send` of the same request, over the same client, to
//!    the same server, one call at a time (`--fenced-calls` of each,
//!    interleaved); the figure is the difference of the medians.
//! 8. the plugin life cycle: seconds from a new build of a plugin renamed
//!    into `plugins_dir` to the daemon serving it (each build distinct, so
//!    each is compiled); seconds from spawning the daemon to all of 10
//!    queues serving their plugins (10 distinct builds of `echo`), cold (a
//!    fresh data directory: every plugin compiled) and warm (a restart: the
//!    compiled-code cache); and µs per `echo` invocation with the sandbox's
//!    in-engine limits (epoch interruption, store limiter) and without them.
//! 9. handler languages: Rust, Python and JavaScript side by side (`langs`).
//! 10. the API while every slot of two queues runs a guest that computes for
//!     20 s: `/healthz` and enqueue latency (p50, p99, max), and the jobs of a
//!     third queue completed meanwhile (`computing`).
//! 11. the soak, only when named (`--only 11 --soak 10m`): a mix of jobs at
//!     80% of the maximum with `kill -9` every two minutes; jobs lost, and
//!     the slopes of RSS and ledger size, with a PNG plot (`soak`).
//!
//! `--backend sled` runs every daemon of the figures on the sled store
//! (`[store] backend = "sled"`) instead of SQLite, so that the two can be
//! set side by side; the store is printed above the table.
//!
//! Completion is watched with two cheap probes (`GET /v1/jobs?queue=&state=`
//! for `waiting` and for `active`, limit 1) every 20 ms; once both are empty
//! one `GET /v1/queues` confirms that every job completed.
//!
//! Figures 1, 2, 6 and 7a-7c drain [`RUNS`] times and report the median
//! with the range. Progress lines on stderr say where the time went: the
//! ledger's group commits (from `GET /metrics`) and the CPU seconds of the
//! daemon, its ledger writer thread, this bench and the rest of the machine
//! (from `/proc`). The table goes to stdout, after the machine, the date and the CPU
//! that other processes used while figures were measured: other work on the
//! machine lowers every figure.

mod store;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail, ensure};
use clap::Parser;
use serde_json::{Value, json};

use khata::config::{Grants, HttpProvider, OnUncertain};
use khata::effects::http::{HttpRequest, Providers};
use khata::effects::{Effects, Scope};
use khata::host::{Host, JobInput, Limits, Plugin, PoolSize, RunOutcome, Safeguards};
use khata::job::{LeaseRef, Millis, NewJob};
use khata::store::sqlite::SqliteStore;
use khata::store::{LeaseAsk, LeaseLimits, Store};

mod computing;
mod effects;
mod langs;
mod plugins;
mod postgres;
mod soak;

use effects::{PaymentsServer, SmtpSink, charge_payload, welcome_payload};
use plugins::{sha256_hex, wait_serving};

/// Jobs drained in figures 1, 2 and 6.
const DRAIN_JOBS: usize = 20_000;
/// Drains per figure (1, 2, and each backlog of 6); the median is reported.
const RUNS: usize = 3;
/// Most jobs in one batch request (the API's limit).
const BATCH: usize = 1_000;
/// How far ahead of the enqueue the jobs of a drain become due.
const DUE_LEAD: Duration = Duration::from_secs(5);
/// Interval of the completion probes.
const DRAIN_POLL: Duration = Duration::from_millis(20);
/// Interval of the redelivery probe.
const REDELIVERY_POLL: Duration = Duration::from_millis(10);
/// Longest wait for anything the bench waits for.
const DEADLINE: Duration = Duration::from_secs(600);
/// Jobs held by the killed daemon in figure 5.
const SLEEPERS: usize = 32;
/// Handler invocations timed in figure 4, after the warm-up ones.
const INVOCATIONS: usize = 10_000;
const WARM_UP: usize = 200;
/// The smaller backlog of figure 6.
const SMALL_BACKLOG: usize = 10_000;
/// Fenced and bare calls made before the timed ones of figure 7d.
const FENCED_WARM_UP: usize = 50;
/// Builds swapped in by figure 8a.
const RELOADS: usize = 5;
/// Queues, each with its own plugin build, in figure 8b.
const START_PLUGINS: usize = 10;
/// Rounds of invocations with and without the limits in figure 8c.
const LIMIT_ROUNDS: usize = 5;

const ECHO_QUEUE: &str = "[queues.echo]\nplugin = \"echo\"\nconcurrency = 16\n";
const EXISTS_QUEUE: &str =
    "[queues.exists]\nplugin = \"chaos\"\nconcurrency = 16\ngrants = { kv = true }\n";
/// A queue whose plugin file is never there: its jobs wait.
const PARKED_QUEUE: &str = "[queues.parked]\nplugin = \"absent\"\n";
const SLEEPY_QUEUE: &str = "[queues.sleepy]\nplugin = \"chaos\"\nconcurrency = 32\ntimeout = \"120s\"\ngrants = { kv = true }\n";
const WELCOME_QUEUE: &str = "[queues.welcome]\nplugin = \"welcome_email\"\nconcurrency = 16\ngrants = { kv = true, email = true }\n";

#[derive(Debug, Parser)]
#[command(about = "Measures khata's throughput and latency against its targets")]
struct Args {
    /// The daemon binary [default: `khata` next to this executable].
    #[arg(long)]
    khata: Option<PathBuf>,
    /// Where `echo.wasm` and `chaos.wasm` are [default:
    /// `../wasm32-wasip2/release` from this executable's directory].
    #[arg(long)]
    plugins: Option<PathBuf>,
    /// Figure 6 with 1,000,000 waiting jobs instead of 100,000 (minutes).
    #[arg(long)]
    million: bool,
    /// Run only these figures, e.g. `--only 1,4`.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u8).range(1..=11))]
    only: Vec<u8>,
    /// How long figure 11 soaks (it runs only when named in `--only`).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    soak: Duration,
    /// Where figure 11 writes its plot.
    #[arg(long, default_value = "soak.png")]
    plot: PathBuf,
    /// Jobs drained in each run of figure 7's jobs/s (7a-7c).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    effect_jobs: u64,
    /// Fenced calls, and as many bare ones, timed in figure 7d.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    fenced_calls: u64,
    /// The daemon's store (`[store] backend`) in every figure that runs the
    /// daemon (1-3, 5-7c); figures 4 and 7d run in this process on SQLite
    /// whatever this says. `postgres` runs figures 1, 2, 3 and 5 of its own
    /// (see `postgres.rs`) on `KHATA_BENCH_PG_URL` or a throwaway server.
    #[arg(long, default_value = "sqlite", value_parser = ["sqlite", "sled", "postgres"])]
    backend: String,
    /// With `--backend postgres`: the numbers of daemons on one database
    /// that figures 1 and 2 drain with, e.g. `--daemons 1,2`.
    #[arg(long, value_delimiter = ',', default_values_t = [1u64, 2, 3], value_parser = clap::value_parser!(u64).range(1..=8))]
    daemons: Vec<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The daemon's HTTP client stack wants one TLS provider per process,
    // even for plain http.
    khata::effects::http::install_crypto_provider();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let bench = Bench::new(&args)?;
    let result = run(&bench, &args).await;
    bench.clean_up();
    let rows = result?;
    println!("{}", machine());
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    println!("load average before the run: {}", load.join(" "));
    println!("store: {}", args.backend);
    if let Some(settings) = postgres::SETTINGS.lock().ok().and_then(|s| s.clone()) {
        println!("{settings}");
    }
    let others = OTHERS.lock().map_or(0.0, |o| *o);
    println!("CPU used by other processes while measuring: {others:.1} s");
    println!();
    println!("{}", table(&rows));
    Ok(())
}

/// Runs the chosen figures in order and returns their rows.
async fn run(bench: &Bench, args: &Args) -> anyhow::Result<Vec<Row>> {
    if args.backend == "postgres" {
        return postgres::run(bench, args).await;
    }
    let wanted = |n: u8| args.only.is_empty() || args.only.contains(&n);
    let mut rows = Vec::new();
    if wanted(1) {
        rows.push(figure_echo(bench).await?);
    }
    if wanted(2) {
        rows.push(figure_exists(bench).await?);
    }
    if wanted(3) {
        rows.extend(figure_enqueue(bench).await?);
    }
    if wanted(4) {
        rows.extend(figure_invocation(bench).await?);
    }
    if wanted(5) {
        rows.push(figure_redelivery(bench).await?);
    }
    if wanted(6) {
        let backlog = if args.million { 1_000_000 } else { 100_000 };
        rows.extend(figure_backlog(bench, backlog).await?);
    }
    if wanted(7) {
        let jobs = usize::try_from(args.effect_jobs)?;
        let calls = usize::try_from(args.fenced_calls)?;
        rows.extend(effects::figure_effects(bench, jobs, calls).await?);
    }
    if wanted(8) {
        rows.extend(plugins::figure_plugins(bench).await?);
    }
    if wanted(9) {
        rows.extend(langs::figure_languages(bench).await?);
    }
    if wanted(10) {
        rows.extend(computing::figure_computing(bench).await?);
    }
    // Minutes long: only when asked for by name.
    if args.only.contains(&11) {
        rows.extend(soak::figure_soak(bench, args.soak, &args.plot).await?);
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------
// The figures

async fn figure_echo(bench: &Bench) -> anyhow::Result<Row> {
    let rates = fresh_drains(bench, ECHO_QUEUE, "echo", "echo", DRAIN_JOBS, echo_payload).await?;
    note(format!("1: echo: {rates} jobs/s"));
    Ok(Row::new(
        "1. echo jobs/s (20,000 due at once, concurrency 16)",
        "≥ 10,000",
        rates.to_string(),
        rates.median >= 10_000.0,
    ))
}

async fn figure_exists(bench: &Bench) -> anyhow::Result<Row> {
    let rates = fresh_drains(
        bench,
        EXISTS_QUEUE,
        "exists",
        "chaos",
        DRAIN_JOBS,
        |i| json!({ "do": "exists", "key": format!("key-{i}") }),
    )
    .await?;
    note(format!("2: existence check: {rates} jobs/s"));
    Ok(Row::new(
        "2. existence check jobs/s (kv insert-if-absent + put)",
        "≥ 7,000",
        rates.to_string(),
        rates.median >= 7_000.0,
    ))
}

async fn figure_enqueue(bench: &Bench) -> anyhow::Result<Vec<Row>> {
    let daemon = bench.daemon(PARKED_QUEUE, &[]).await?;
    let api = &daemon.api;
    let mut usage = (api.commits().await?, daemon.cpu()?);
    let single = enqueue_in_flight(api, "parked", 2_000, 1).await?;
    usage = note_usage(&daemon, usage, "one at a time").await?;
    let sixteen = enqueue_in_flight(api, "parked", 20_000, 16).await?;
    usage = note_usage(&daemon, usage, "16 in flight").await?;
    let batched = enqueue_batches(api, "parked", 50 * BATCH, 1).await?;
    note_usage(&daemon, usage, "batches of 1,000").await?;
    note(format!(
        "3: enqueue/s: {} one at a time, {} with 16 in flight (p50 {} p99 {}), {} in batches",
        thousands(single.rate),
        thousands(sixteen.rate),
        millis(sixteen.p50),
        millis(sixteen.p99),
        thousands(batched)
    ));
    Ok(vec![
        Row::new(
            "3a. enqueue/s, one at a time",
            "≥ 3,000",
            thousands(single.rate),
            single.rate >= 3_000.0,
        ),
        Row::new(
            "3b. enqueue/s, 16 in flight",
            "≥ 20,000",
            thousands(sixteen.rate),
            sixteen.rate >= 20_000.0,
        ),
        Row::new(
            "3c. enqueue/s, batches of 1,000",
            "≥ 100,000",
            thousands(batched),
            batched >= 100_000.0,
        ),
        Row::report(
            "3d. enqueue latency p50 / p99, 16 in flight",
            format!("{} / {}", millis(sixteen.p50), millis(sixteen.p99)),
        ),
    ])
}

async fn figure_invocation(bench: &Bench) -> anyhow::Result<Vec<Row>> {
    let bed = InvocationBed::new(bench, Safeguards::default())?;
    for i in 0..WARM_UP {
        bed.invoke(i).await?;
    }
    let cpu = Cpu::sample(None);
    let started = Instant::now();
    for i in 0..INVOCATIONS {
        bed.invoke(i).await?;
    }
    let mean_us = started.elapsed().as_secs_f64() * 1e6 / INVOCATIONS as f64;
    let bed = Arc::new(bed);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..2 {
        let bed = Arc::clone(&bed);
        tasks.spawn(async move {
            for i in 0..INVOCATIONS / 2 {
                bed.invoke(t * INVOCATIONS + i).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let per_second = INVOCATIONS as f64 / started.elapsed().as_secs_f64();
    note(format!(
        "4: invocation: {mean_us:.1} µs; 2 tasks: {}/s; CPU s: {}",
        thousands(per_second),
        Cpu::sample(None).since(cpu)
    ));
    Ok(vec![
        Row::new(
            "4a. one echo invocation (instantiate + call + drop)",
            "≤ 50 µs",
            format!("{mean_us:.1} µs"),
            mean_us <= 50.0,
        ),
        Row::report(
            "4b. echo invocations/s, 2 concurrent tasks",
            format!("{}/s", thousands(per_second)),
        ),
    ])
}

async fn figure_redelivery(bench: &Bench) -> anyhow::Result<Row> {
    let mut daemon = bench.daemon(SLEEPY_QUEUE, &["chaos"]).await?;
    // The first job in delivery order: all 32 are leased in one step, and it
    // comes first in any lease after the restart.
    let mut first = None;
    for _ in 0..SLEEPERS {
        let answer = daemon
            .api
            .post(
                "/v1/queues/sleepy/jobs",
                json!({ "payload": { "do": "sleep", "ms": 60_000 } }).to_string(),
            )
            .await?;
        first.get_or_insert(text(&answer["job"]["id"])?);
    }
    let first = first.context("no job enqueued")?;
    wait_until(|| async {
        Ok(daemon.api.counts("sleepy").await?["active"].as_u64() == Some(SLEEPERS as u64))
    })
    .await
    .context("waiting for the sleepers to be active")?;
    daemon.kill9()?;
    let spawned = Instant::now();
    daemon.spawn()?;
    let (listening, redelivered) = watch_redelivery(&daemon.api, &first, spawned).await?;
    let secs = redelivered.as_secs_f64();
    note(format!(
        "5: redelivery after kill -9: {secs:.3} s (answering HTTP after {:.3} s)",
        listening.as_secs_f64()
    ));
    Ok(Row::new(
        "5. first redelivery after kill -9 and restart",
        "≤ 1 s",
        format!(
            "{secs:.2} s (HTTP up after {:.2} s)",
            listening.as_secs_f64()
        ),
        secs <= 1.0,
    ))
}

async fn figure_backlog(bench: &Bench, backlog: usize) -> anyhow::Result<Vec<Row>> {
    let small = with_backlog(bench, SMALL_BACKLOG).await?;
    let large = with_backlog(bench, backlog).await?;
    let ratio = large.jobs_per_second.median / small.jobs_per_second.median;
    let n = thousands(backlog as f64);
    note(format!(
        "6: {n} waiting: RSS {:.0} MiB (peak {:.0}), bulk enqueue {}/s, echo {} jobs/s vs {} with 10,000",
        large.rss_mib,
        large.peak_mib,
        thousands(large.enqueue_rate),
        large.jobs_per_second,
        small.jobs_per_second
    ));
    note(format!(
        "6: ledger with {n} waiting: {}; after kill -9: {}",
        large.disk, large.reopen
    ));
    note(format!(
        "6: ledger with 10,000 waiting: {}; after kill -9: {}",
        small.disk, small.reopen
    ));
    let rss_target = if backlog < 1_000_000 {
        "≤ 128 MiB (at 1,000,000)"
    } else {
        "≤ 128 MiB"
    };
    Ok(vec![
        Row::new(
            &format!("6a. daemon RSS with {n} waiting jobs"),
            rss_target,
            format!("{:.0} MiB (peak {:.0} MiB)", large.rss_mib, large.peak_mib),
            large.rss_mib <= 128.0,
        ),
        Row::report(
            &format!("6b. bulk enqueue/s of the {n} (batches of 1,000, 8 in flight)"),
            format!("{}/s", thousands(large.enqueue_rate)),
        ),
        Row::new(
            &format!("6c. echo jobs/s with {n} waiting vs with 10,000"),
            "within 20%",
            format!(
                "{} vs {} ({:+.0}%)",
                large.jobs_per_second,
                small.jobs_per_second,
                (ratio - 1.0) * 100.0
            ),
            ratio >= 0.8,
        ),
        Row::report(
            &format!("6d. ledger on disk with {n} waiting jobs"),
            large.disk.to_string(),
        ),
        Row::report(
            &format!("6e. reopen after kill -9 with {n} waiting (spawn to first backlog job done)"),
            format!(
                "{} (healthy in {})",
                millis(large.reopen.first_job),
                millis(large.reopen.healthy)
            ),
        ),
    ])
}

// ---------------------------------------------------------------------------
// Drains and enqueues over HTTP

/// Runs [`RUNS`] drains of `jobs` jobs of `queue`, each on a fresh daemon.
async fn fresh_drains(
    bench: &Bench,
    queues: &str,
    queue: &str,
    guest: &str,
    jobs: usize,
    payload: impl Fn(usize) -> Value,
) -> anyhow::Result<Spread> {
    let mut rates = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let daemon = bench.daemon(queues, &[guest]).await?;
        rates.push(drain_rate(&daemon, queue, jobs, &payload).await?);
    }
    Ok(Spread::of(rates))
}

fn echo_payload(i: usize) -> Value {
    json!({ "n": i })
}

/// Enqueues `n` jobs due at one future moment `T`, waits until every one is
/// completed, and returns jobs/s counted from `T`.
async fn drain_rate(
    daemon: &Daemon,
    queue: &str,
    n: usize,
    payload: impl Fn(usize) -> Value,
) -> anyhow::Result<f64> {
    let api = &daemon.api;
    let completed = api.counts(queue).await?["completed"].as_u64().unwrap_or(0);
    let due = SystemTime::now() + DUE_LEAD;
    let run_at = humantime::format_rfc3339_millis(due).to_string();
    for start in (0..n).step_by(BATCH) {
        let jobs: Vec<Value> = (start..(start + BATCH).min(n))
            .map(|i| json!({ "payload": payload(i), "run_at": run_at }))
            .collect();
        api.post(&batch_path(queue), json!({ "jobs": jobs }).to_string())
            .await?;
    }
    let early = due.duration_since(SystemTime::now()).unwrap_or_default();
    ensure!(
        !early.is_zero(),
        "enqueueing {n} jobs took longer than the {} lead; the drain would start early",
        humantime::format_duration(DUE_LEAD)
    );
    tokio::time::sleep(early).await;
    let (commits, cpu) = (api.commits().await?, daemon.cpu()?);
    let done = wait_drained(api, queue, completed + n as u64).await?;
    let elapsed = done.duration_since(due).context("clock went backwards")?;
    note(format!(
        "   drained {queue} in {:.3} s: {}; CPU s: {}",
        elapsed.as_secs_f64(),
        api.commits().await?.since(commits),
        daemon.cpu()?.since(cpu)
    ));
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// Polls until no job of `queue` is waiting or active and all are completed;
/// returns when the probe that saw the queue empty was answered.
async fn wait_drained(api: &Api, queue: &str, completed: u64) -> anyhow::Result<SystemTime> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        tokio::time::sleep(DRAIN_POLL).await;
        ensure!(Instant::now() < deadline, "queue {queue} did not drain");
        if !api.has_jobs(queue, "waiting").await? && !api.has_jobs(queue, "active").await? {
            let seen = SystemTime::now();
            let counts = api.counts(queue).await?;
            if counts["completed"].as_u64() == Some(completed) {
                return Ok(seen);
            }
            ensure!(
                counts["dead"].as_u64() == Some(0),
                "jobs of {queue} died: {counts}"
            );
        }
    }
}

/// The median and range of repeated measurements.
#[derive(Clone, Copy, Debug)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(mut values: Vec<f64>) -> Spread {
        values.sort_by(f64::total_cmp);
        Spread {
            median: values[values.len() / 2],
            min: values[0],
            max: values[values.len() - 1],
        }
    }
}

impl Spread {
    /// Median (min–max) with `places` decimals, for small values.
    fn decimals(&self, places: usize) -> String {
        format!(
            "{:.places$} ({:.places$}–{:.places$})",
            self.median, self.min, self.max
        )
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}–{})",
            thousands(self.median),
            thousands(self.min),
            thousands(self.max)
        )
    }
}

/// User and kernel CPU seconds of a process or thread.
#[derive(Clone, Copy, Debug, Default)]
struct Times {
    user: f64,
    system: f64,
}

impl Times {
    fn minus(self, before: Times) -> Times {
        Times {
            user: self.user - before.user,
            system: self.system - before.system,
        }
    }

    fn total(self) -> f64 {
        self.user + self.system
    }
}

/// CPU seconds used so far: by the daemon, by its ledger writer thread, by
/// this bench, and by the whole machine.
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    daemon: Times,
    ledger: Times,
    bench: Times,
    machine: f64,
}

impl Cpu {
    /// Reads the counters now; `daemon` is the daemon's pid, if one runs.
    fn sample(daemon: Option<u32>) -> Cpu {
        let mut cpu = Cpu {
            bench: stat_times("/proc/self/stat").unwrap_or_default(),
            machine: machine_seconds().unwrap_or(0.0),
            ..Cpu::default()
        };
        let Some(pid) = daemon else {
            return cpu;
        };
        cpu.daemon = stat_times(&format!("/proc/{pid}/stat")).unwrap_or_default();
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten();
        for task in tasks.flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() == "khata-ledger" {
                let stat = task.path().join("stat");
                cpu.ledger = stat_times(&stat.to_string_lossy()).unwrap_or_default();
            }
        }
        cpu
    }

    /// What was used between `before` and `self`, as a progress line. The
    /// rest of the machine's share is added to [`OTHERS`].
    fn since(self, before: Cpu) -> String {
        let daemon = self.daemon.minus(before.daemon);
        let ledger = self.ledger.minus(before.ledger);
        let bench = self.bench.minus(before.bench);
        let rest = (self.machine - before.machine - daemon.total() - bench.total()).max(0.0);
        if let Ok(mut others) = OTHERS.lock() {
            *others += rest;
        }
        let bench_part = format!(
            "bench {:.2} (kernel {:.2}), rest of the machine {rest:.2}",
            bench.total(),
            bench.system
        );
        if daemon.total() == 0.0 {
            return bench_part;
        }
        format!(
            "daemon {:.2} (kernel {:.2}; ledger writer {:.2}, kernel {:.2}), {bench_part}",
            daemon.total(),
            daemon.system,
            ledger.total(),
            ledger.system,
        )
    }
}

/// CPU seconds that processes other than the daemon and the bench used
/// while figures were measured: anything much above zero means the figures
/// are lower than the machine can do.
static OTHERS: Mutex<f64> = Mutex::new(0.0);

/// Kernel clock ticks per second of `/proc/*/stat` times (`USER_HZ`, 100 on
/// every mainstream Linux).
const USER_HZ: f64 = 100.0;

/// Busy time of all CPUs (`/proc/stat`: everything but idle and iowait), in
/// seconds.
fn machine_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<f64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let (idle, iowait) = (ticks.get(3)?, ticks.get(4)?);
    // guest and guest_nice (fields 9 and 10) are already counted in user.
    let busy: f64 = ticks.iter().take(8).sum::<f64>() - idle - iowait;
    Some(busy / USER_HZ)
}

/// User and system time of a `/proc/.../stat` file.
fn stat_times(path: &str) -> Option<Times> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The fields after the command name, which may hold spaces, start with
    // field 3 (state); utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some(Times {
        user: ticks(11)? / USER_HZ,
        system: ticks(12)? / USER_HZ,
    })
}

/// Totals of the ledger's group commits (`khata_store_commit_*`).
#[derive(Clone, Copy, Debug, Default)]
struct Commits {
    count: f64,
    seconds: f64,
    durable_steps: f64,
}

impl Commits {
    /// What happened between `before` and `self`, as a progress line.
    fn since(self, before: Commits) -> String {
        let count = (self.count - before.count).max(1.0);
        format!(
            "{} commits, {:.2} ms each, {:.1} durable steps each",
            thousands(count),
            (self.seconds - before.seconds) * 1e3 / count,
            (self.durable_steps - before.durable_steps) / count
        )
    }
}

/// Notes the commits and CPU time since `before` under `label`; returns the
/// new totals.
async fn note_usage(
    daemon: &Daemon,
    before: (Commits, Cpu),
    label: &str,
) -> anyhow::Result<(Commits, Cpu)> {
    let now = (daemon.api.commits().await?, daemon.cpu()?);
    note(format!(
        "   {label}: {}; CPU s: {}",
        now.0.since(before.0),
        now.1.since(before.1)
    ));
    Ok(now)
}

/// Enqueue rate and latencies of single enqueues.
struct Enqueues {
    rate: f64,
    p50: Duration,
    p99: Duration,
}

/// Sends `n` single enqueues from `tasks` tasks, each one request at a time.
async fn enqueue_in_flight(
    api: &Api,
    queue: &str,
    n: usize,
    tasks: usize,
) -> anyhow::Result<Enqueues> {
    let next = Arc::new(AtomicUsize::new(0));
    let path = format!("/v1/queues/{queue}/jobs");
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (api, next, path) = (api.clone(), Arc::clone(&next), path.clone());
        set.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return anyhow::Ok(latencies);
                }
                let body = json!({ "payload": { "n": i } }).to_string();
                let sent = Instant::now();
                api.post(&path, body).await?;
                latencies.push(sent.elapsed());
            }
        });
    }
    let mut latencies = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        latencies.extend(r??);
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    Ok(Enqueues {
        rate,
        p50: latencies[latencies.len() / 2],
        p99: latencies[latencies.len() * 99 / 100],
    })
}

/// Sends `n` jobs in batches of [`BATCH`], `in_flight` batches at a time;
/// returns jobs/s.
async fn enqueue_batches(
    api: &Api,
    queue: &str,
    n: usize,
    in_flight: usize,
) -> anyhow::Result<f64> {
    let next = Arc::new(AtomicUsize::new(0));
    let path = batch_path(queue);
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        let (api, next, path) = (api.clone(), Arc::clone(&next), path.clone());
        set.spawn(async move {
            loop {
                let start = next.fetch_add(BATCH, Ordering::Relaxed);
                if start >= n {
                    return anyhow::Ok(());
                }
                let jobs: Vec<Value> = (start..(start + BATCH).min(n))
                    .map(|i| json!({ "payload": { "n": i } }))
                    .collect();
                api.post(&path, json!({ "jobs": jobs }).to_string()).await?;
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

fn batch_path(queue: &str) -> String {
    format!("/v1/queues/{queue}/jobs/batch")
}

/// Polls job `id` after a restart; returns when the daemon first answered
/// and when the job showed its second attempt, both from `spawned`.
async fn watch_redelivery(
    api: &Api,
    id: &str,
    spawned: Instant,
) -> anyhow::Result<(Duration, Duration)> {
    let mut listening = None;
    while spawned.elapsed() < DEADLINE {
        if let Ok(job) = api.get(&format!("/v1/jobs/{id}")).await {
            let at = spawned.elapsed();
            listening.get_or_insert(at);
            if job["attempts"].as_array().map_or(0, Vec::len) >= 2 {
                return Ok((listening.unwrap_or(at), at));
            }
        }
        tokio::time::sleep(REDELIVERY_POLL).await;
    }
    bail!("job {id} was not redelivered")
}

/// What figure 6 measures on one daemon.
struct Backlog {
    enqueue_rate: f64,
    rss_mib: f64,
    peak_mib: f64,
    jobs_per_second: Spread,
    disk: store::Disk,
    reopen: store::Reopen,
}

/// Fills a parked queue with `waiting` jobs, then drains echo jobs past them;
/// last, restarts the daemon after `kill -9` on that backlog.
async fn with_backlog(bench: &Bench, waiting: usize) -> anyhow::Result<Backlog> {
    let mut daemon = bench
        .daemon(&format!("{ECHO_QUEUE}{PARKED_QUEUE}"), &["echo"])
        .await?;
    note(format!(
        "6: enqueueing {} waiting jobs",
        thousands(waiting as f64)
    ));
    let enqueue_rate = enqueue_batches(&daemon.api, "parked", waiting, 8).await?;
    let rss_mib = daemon.memory("VmRSS")?;
    let disk = store::ledger_disk(&daemon)?;
    let asked = Instant::now();
    daemon.api.counts("parked").await?;
    note(format!(
        "   GET /v1/queues (counts kept by the ledger) took {} with this backlog",
        millis(asked.elapsed())
    ));
    let mut rates = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        rates.push(drain_rate(&daemon, "echo", DRAIN_JOBS, echo_payload).await?);
    }
    let jobs_per_second = Spread::of(rates);
    let peak_mib = daemon.memory("VmHWM")?;
    let reopen = store::reopen(&mut daemon, "parked", "absent").await?;
    Ok(Backlog {
        enqueue_rate,
        rss_mib,
        peak_mib,
        jobs_per_second,
        disk,
        reopen,
    })
}

/// Polls `check` every 10 ms until it holds.
async fn wait_until<F, Fut>(check: F) -> anyhow::Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + DEADLINE;
    while !check().await? {
        ensure!(Instant::now() < deadline, "gave up after {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// In-process invocations (figure 4)

/// A host with `echo` loaded and a ledger for the effects it never calls.
struct InvocationBed {
    host: Host,
    plugin: Plugin,
    store: Arc<dyn Store>,
    scope: Arc<Scope>,
    limits: Limits,
}

impl InvocationBed {
    fn new(bench: &Bench, safeguards: Safeguards) -> anyhow::Result<InvocationBed> {
        let host = Host::with_safeguards(
            &PoolSize {
                instances: 16,
                max_memory: 64 << 20,
            },
            None,
            safeguards,
        )?;
        InvocationBed::echo(bench, host, "echo", 64 << 20)
    }

    /// A bed running `guest` (`echo` or one of its twins in other
    /// languages) on `host`, each attempt within `memory` bytes.
    fn echo(bench: &Bench, host: Host, guest: &str, memory: u64) -> anyhow::Result<InvocationBed> {
        let plugin = host.load_file(guest, &bench.plugins.join(format!("{guest}.wasm")))?;
        let dir = bench.fresh_dir("invocation")?;
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir)?);
        let scope = Arc::new(Scope {
            queue: "echo".into(),
            namespace: "echo".into(),
            grants: Grants::default(),
            on_uncertain: OnUncertain::Skip,
            mailer: Err("no email in this bench".into()),
            providers: Arc::new(
                Providers::from_config(&Default::default()).map_err(anyhow::Error::msg)?,
            ),
            email_from: "bench@localhost".into(),
            clock: Arc::new(khata::clock::SystemClock),
        });
        Ok(InvocationBed {
            host,
            plugin,
            store,
            scope,
            limits: Limits {
                timeout: Duration::from_secs(30),
                memory,
                max_result: 1 << 20,
                log_bytes: 64 << 10,
                log_lines: 1024,
            },
        })
    }

    /// Runs one attempt of echo job `i` and checks that it succeeded.
    async fn invoke(&self, i: usize) -> anyhow::Result<()> {
        let job_id = format!("job-{i}");
        let lease = LeaseRef {
            job_id: job_id.clone(),
            attempt: 1,
            token: 1,
        };
        let effects = Effects::new(Arc::clone(&self.store), Arc::clone(&self.scope), lease);
        let input = JobInput {
            id: job_id,
            queue: "echo".into(),
            payload: format!("{{\"n\":{i}}}"),
            attempt: 1,
            max_attempts: 5,
            enqueued_at: Millis::now(),
        };
        match self
            .host
            .run(&self.plugin, input, effects, &self.limits)
            .await
        {
            RunOutcome::Ok(_) => Ok(()),
            other => bail!("echo invocation ended {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// The daemon under test

/// Paths shared by every figure, and the root of their temporary directories.
struct Bench {
    khata: PathBuf,
    plugins: PathBuf,
    root: PathBuf,
    dirs: AtomicUsize,
    /// The `[store]` section of every daemon's jobs.toml.
    store: String,
}

impl Bench {
    fn new(args: &Args) -> anyhow::Result<Bench> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let exe_dir = exe.parent().context("executable has no directory")?;
        let khata = args.khata.clone().unwrap_or_else(|| exe_dir.join("khata"));
        let plugins = args
            .plugins
            .clone()
            .unwrap_or_else(|| exe_dir.join("../wasm32-wasip2/release"));
        ensure!(
            khata.is_file(),
            "{} is missing: build it with `cargo build --release -p khata-runtime --bins`",
            khata.display()
        );
        for guest in ["echo", "chaos"] {
            let path = plugins.join(format!("{guest}.wasm"));
            ensure!(
                path.is_file(),
                "{} is missing: build the guests with scripts/build-plugins",
                path.display()
            );
        }
        let root = std::env::temp_dir().join(format!("khata-bench-{}", std::process::id()));
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        Ok(Bench {
            khata,
            plugins,
            root,
            dirs: AtomicUsize::new(0),
            store: format!("[store]\nbackend = \"{}\"\n\n", args.backend),
        })
    }

    /// A new, empty directory under the bench's root.
    fn fresh_dir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let n = self.dirs.fetch_add(1, Ordering::Relaxed);
        let dir = self.root.join(format!("{n:02}-{name}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(dir)
    }

    /// Starts a daemon with `queues` and the guests named in `guests`.
    async fn daemon(&self, queues: &str, guests: &[&str]) -> anyhow::Result<Daemon> {
        let mut daemon = self.prepare(queues, guests)?;
        daemon.spawn()?;
        daemon.wait_healthy().await?;
        Ok(daemon)
    }

    /// A daemon's directory with `queues` and the guests named in `guests`,
    /// not started yet.
    fn prepare(&self, queues: &str, guests: &[&str]) -> anyhow::Result<Daemon> {
        let dir = self.fresh_dir("daemon")?;
        let plugins_dir = dir.join("plugins");
        std::fs::create_dir_all(&plugins_dir)?;
        for guest in guests {
            let file = format!("{guest}.wasm");
            std::fs::copy(self.plugins.join(&file), plugins_dir.join(&file))
                .with_context(|| format!("copying {file}"))?;
        }
        let port = free_port()?;
        let config = format!(
            "[daemon]\ndata_dir = \"data\"\nplugins_dir = \"plugins\"\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace = \"2s\"\n\n{}{queues}",
            self.store
        );
        std::fs::write(dir.join("jobs.toml"), config)?;
        Ok(Daemon {
            khata: self.khata.clone(),
            dir,
            child: None,
            api: Api::new(port)?,
        })
    }

    fn clean_up(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.root) {
            eprintln!("could not remove {}: {e}", self.root.display());
        }
    }
}

/// One `khata serve` process on its own directory; killed when dropped.
struct Daemon {
    khata: PathBuf,
    dir: PathBuf,
    child: Option<Child>,
    api: Api,
}

impl Daemon {
    /// Starts the process, without waiting for it to answer.
    fn spawn(&mut self) -> anyhow::Result<()> {
        ensure!(self.child.is_none(), "the daemon is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("daemon.log"))?;
        let child = Command::new(&self.khata)
            .arg("serve")
            .arg("-c")
            .arg(self.dir.join("jobs.toml"))
            .env("KHATA_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.khata.display()))?;
        self.child = Some(child);
        Ok(())
    }

    async fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.api.get("/healthz").await.is_err() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!("khata exited with {status} at start:\n{}", self.log());
            }
            ensure!(
                Instant::now() < deadline,
                "khata did not answer in 60 s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// SIGKILL, as `kill -9`, and reap.
    fn kill9(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// A memory line of `/proc/PID/status` (`VmRSS`, `VmHWM`), in MiB.
    fn memory(&self, field: &str) -> anyhow::Result<f64> {
        let pid = self.child.as_ref().context("not running")?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
        Ok(kib / 1024.0)
    }

    /// CPU time of the daemon, of its ledger writer thread, and of this bench.
    fn cpu(&self) -> anyhow::Result<Cpu> {
        let pid = self.child.as_ref().context("not running")?.id();
        Ok(Cpu::sample(Some(pid)))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// A small client of the daemon's API.
#[derive(Clone)]
struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(port: u16) -> anyhow::Result<Api> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()?;
        Ok(Api {
            http,
            base: format!("http://127.0.0.1:{port}"),
        })
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let request = self.http.get(format!("{}{path}", self.base));
        answer(path, request.send().await?).await
    }

    async fn post(&self, path: &str, body: String) -> anyhow::Result<Value> {
        let request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        answer(path, request.send().await?).await
    }

    /// Whether `queue` has a job in `state` (one cheap indexed look-up).
    async fn has_jobs(&self, queue: &str, state: &str) -> anyhow::Result<bool> {
        let page = self
            .get(&format!("/v1/jobs?queue={queue}&state={state}&limit=1"))
            .await?;
        Ok(page["jobs"].as_array().is_some_and(|j| !j.is_empty()))
    }

    /// The ledger's group commits so far, from `GET /metrics`.
    async fn commits(&self) -> anyhow::Result<Commits> {
        let response = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await?;
        let text = response.error_for_status()?.text().await?;
        let metric = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
                .unwrap_or(0.0)
        };
        Ok(Commits {
            count: metric("khata_store_commit_seconds_count"),
            seconds: metric("khata_store_commit_seconds_sum"),
            durable_steps: metric("khata_store_commit_steps_sum"),
        })
    }

    /// The `counts` of `queue` in `GET /v1/queues`.
    async fn counts(&self, queue: &str) -> anyhow::Result<Value> {
        let list = self.get("/v1/queues").await?;
        list["queues"]
            .as_array()
            .and_then(|qs| qs.iter().find(|q| q["name"] == queue))
            .map(|q| q["counts"].clone())
            .with_context(|| format!("no queue {queue} in {list}"))
    }
}

/// The JSON body of a successful answer, or an error with the daemon's.
async fn answer(path: &str, response: reqwest::Response) -> anyhow::Result<Value> {
    let status = response.status();
    let bytes = response.bytes().await?;
    ensure!(
        status.is_success(),
        "{path} answered {status}: {}",
        String::from_utf8_lossy(&bytes)
    );
    Ok(serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn text(v: &Value) -> anyhow::Result<String> {
    v.as_str()
        .map(str::to_owned)
        .with_context(|| format!("expected a string, got {v}"))
}

// ---------------------------------------------------------------------------
// The report

/// One line of the table.
struct Row {
    figure: String,
    target: String,
    measured: String,
}

impl Row {
    /// A figure with a target; `(missed)` is appended when `met` is false.
    fn new(figure: &str, target: &str, measured: String, met: bool) -> Row {
        Row {
            figure: figure.into(),
            target: target.into(),
            measured: if met {
                measured
            } else {
                format!("{measured} (missed)")
            },
        }
    }

    /// A figure reported without a target.
    fn report(figure: &str, measured: String) -> Row {
        Row::new(figure, "report", measured, true)
    }
}

fn table(rows: &[Row]) -> String {
    let mut out = String::from("| figure | target | measured |\n| --- | --- | --- |\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} |\n",
            r.figure, r.target, r.measured
        ));
    }
    out
}

/// The machine and the date, for the report.
fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let kernel = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, m)| m.trim())
        })
        .unwrap_or("unknown CPU");
    let date = humantime::format_rfc3339_seconds(SystemTime::now());
    format!("machine: {cpus} CPUs ({model}), Linux {kernel}; date: {date}")
}

/// `12345.6` as `12,346`.
fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn millis(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// `1234.5 µs` as `1,235 µs`.
fn micros(d: Duration) -> String {
    format!("{} µs", thousands(d.as_secs_f64() * 1e6))
}

/// A progress line on stderr; the table goes to stdout.
fn note(line: String) {
    eprintln!("khata-bench {line}");
}
