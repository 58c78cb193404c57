//! `khata-bench --backend postgres`: the figures of the PostgreSQL store,
//! with one or several daemons on one database.
//!
//! The server is the one `KHATA_BENCH_PG_URL` names (a database where the
//! user may `CREATE DATABASE`), else a throwaway cluster started with
//! `scripts/pg-test-server start` (fsync on, `synchronous_commit = on`) and
//! stopped at the end. Its version and durability settings are printed above
//! the table. Every drain, enqueue run and redelivery runs on a database of
//! its own, created for it and dropped after it, so that one figure's rows,
//! dead tuples and counters do not weigh on the next.
//!
//! The figures keep the numbers of the embedded ones they mirror:
//!
//! 1. jobs/s of `echo` with 1, 2 and 3 daemons (`--daemons`) on one
//!    database, concurrency 16 on each daemon: 20,000 jobs enqueued ahead
//!    through the first daemon, all due at one moment `T` after every daemon
//!    answers; the rate is 20,000 / (moment all are completed − `T`).
//! 2. the same with the existence check (`chaos`, `"do": "exists"`).
//! 3. enqueue/s into a parked queue of one daemon: one at a time, 16 in
//!    flight (p50/p99), batches of 1,000.
//! 5. redelivery: daemon A (`lease = "2s"`, `heartbeat = "500ms"`) runs 16
//!    jobs that sleep; once all are active, daemon B starts on the same
//!    database, then A gets SIGKILL. B serves the same queue with `echo`
//!    (a daemon runs a queue with the plugin its own jobs.toml names), so
//!    that a job B takes over completes at once: the figure is the time
//!    from the kill to the first of A's jobs completed by B, beside
//!    2 × the lease.
//!
//! Beside each rate: the CPU seconds of the daemons and of the PostgreSQL
//! server (the postmaster, its live children, and the children it reaped)
//! while it was measured, and the write transactions per second on the
//! server (XIDs assigned, from `pg_current_snapshot()`; each committed
//! step that wrote takes one). `pg_stat_database.xact_commit` is not used:
//! backends report it up to seconds late.

use std::path::Path;
use std::sync::atomic::AtomicUsize;

use tokio_postgres::NoTls;

use super::{Args, Context, Duration, Instant, PathBuf, SystemTime, Value, bail, ensure, json};
use super::{
    BATCH, Bench, DEADLINE, Daemon, ECHO_QUEUE, EXISTS_QUEUE, OTHERS, PARKED_QUEUE, RUNS, Row,
    Spread, batch_path, echo_payload, enqueue_batches, enqueue_in_flight, machine_seconds, millis,
    note, stat_times, thousands, wait_drained,
};
use khata::store::postgres::{parse_url, testing::url_with_dbname};

/// How far ahead of the enqueue the jobs of a drain become due at first:
/// enqueueing 20,000 jobs through PostgreSQL takes longer than on SQLite
/// (see [`LEAD_SECS`]).
const PG_DUE_LEAD: Duration = Duration::from_secs(10);
/// Jobs daemon A holds when it is killed in figure 5.
const HELD: usize = 16;
/// The short lease of figure 5, and its heartbeat (a quarter of it, as the
/// multi-daemon docs advise a third or less).
const LEASE: &str = "2s";
const LEASE_SECS: f64 = 2.0;
const HEARTBEAT: &str = "500ms";
/// Interval of figure 5's probe (one query on the bench's own connection).
const REDELIVERY_POLL: Duration = Duration::from_millis(10);

/// The server's description, printed above the table by `main`.
pub(super) static SETTINGS: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Runs the chosen PostgreSQL figures and returns their rows.
pub(super) async fn run(bench: &Bench, args: &Args) -> anyhow::Result<Vec<Row>> {
    let wanted = |n: u8| args.only.is_empty() || args.only.contains(&n);
    if let Some(n) = args.only.iter().find(|n| ![1, 2, 3, 5].contains(*n)) {
        bail!(
            "figure {n} has no PostgreSQL variant: --backend postgres runs figures 1, 2, 3 and 5"
        );
    }
    let mut daemons: Vec<usize> = args
        .daemons
        .iter()
        .map(|&n| usize::try_from(n))
        .collect::<Result<_, _>>()?;
    daemons.sort_unstable();
    daemons.dedup();
    let server = Server::start().await?;
    let settings = server.settings().await?;
    note(format!("postgres: {settings}"));
    if let Ok(mut s) = SETTINGS.lock() {
        *s = Some(settings);
    }
    let result = async {
        let mut rows = Vec::new();
        if wanted(1) {
            rows.extend(figure_drains(bench, &server, &daemons, Handler::Echo).await?);
        }
        if wanted(2) {
            rows.extend(figure_drains(bench, &server, &daemons, Handler::Exists).await?);
        }
        if wanted(3) {
            rows.extend(figure_enqueue(bench, &server).await?);
        }
        if wanted(5) {
            rows.push(figure_redelivery(bench, &server).await?);
        }
        anyhow::Ok(rows)
    }
    .await;
    server.stop().await;
    result
}

// ---------------------------------------------------------------------------
// The figures

#[derive(Clone, Copy, PartialEq, Eq)]
enum Handler {
    Echo,
    Exists,
}

impl Handler {
    fn queues(self) -> &'static str {
        match self {
            Handler::Echo => ECHO_QUEUE,
            Handler::Exists => EXISTS_QUEUE,
        }
    }

    fn queue(self) -> &'static str {
        match self {
            Handler::Echo => "echo",
            Handler::Exists => "exists",
        }
    }

    fn guest(self) -> &'static str {
        match self {
            Handler::Echo => "echo",
            Handler::Exists => "chaos",
        }
    }

    fn payload(self, i: usize) -> Value {
        match self {
            Handler::Echo => echo_payload(i),
            Handler::Exists => json!({ "do": "exists", "key": format!("key-{i}") }),
        }
    }
}

/// One drain's rate and what it cost.
struct Drain {
    rate: f64,
    usage: Usage,
}

async fn figure_drains(
    bench: &Bench,
    server: &Server,
    daemons: &[usize],
    handler: Handler,
) -> anyhow::Result<Vec<Row>> {
    let (number, what) = match handler {
        Handler::Echo => (1, "echo"),
        Handler::Exists => (2, "existence check"),
    };
    let mut rows = Vec::new();
    let mut single: Option<Spread> = None;
    for &n in daemons {
        let mut drains = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            drains.push(drain(bench, server, handler, n).await?);
        }
        let rates = Spread::of(drains.iter().map(|d| d.rate).collect());
        // The run whose rate is the median stands for the cost.
        let median = drains
            .iter()
            .find(|d| d.rate == rates.median)
            .context("no drains")?;
        let plural = if n == 1 { "" } else { "s" };
        note(format!(
            "{number}: {what}, {n} daemon{plural}: {rates} jobs/s"
        ));
        let figure = format!(
            "{number}. {what} jobs/s, {n} daemon{plural} (20,000 due at once, concurrency 16 each)"
        );
        let measured = format!("{rates}; {}", median.usage.per_drain());
        rows.push(match (handler, n, single) {
            (Handler::Echo, 1, _) => {
                Row::new(&figure, "≥ 3,000", measured, rates.median >= 3_000.0)
            }
            (_, 1, _) | (_, _, None) => Row::report(&figure, measured),
            // "Does not fall": not below the slowest run with one daemon.
            (_, _, Some(one)) => Row::new(
                &figure,
                "no fall from 1 daemon",
                format!("{measured}; 1 daemon: {}", thousands(one.median)),
                rates.median >= one.min,
            ),
        });
        if n == 1 {
            single = Some(rates);
        }
    }
    Ok(rows)
}

/// Starts `daemons` daemons on a fresh database, enqueues 20,000 jobs
/// through the first, all due at one moment `T` once every daemon answers,
/// and returns jobs/s counted from `T`. A run whose enqueue outlasted the
/// lead (a busy machine) is discarded and run again with a longer lead.
async fn drain(
    bench: &Bench,
    server: &Server,
    handler: Handler,
    daemons: usize,
) -> anyhow::Result<Drain> {
    for _ in 0..3 {
        if let Some(d) = drain_once(bench, server, handler, daemons).await? {
            return Ok(d);
        }
    }
    bail!(
        "enqueueing {} jobs outlasted the lead three times ({} s)",
        super::DRAIN_JOBS,
        LEAD_SECS.load(std::sync::atomic::Ordering::Relaxed)
    )
}

/// The current lead of a drain, in seconds: [`PG_DUE_LEAD`] at first,
/// raised to twice the enqueue time of a run that outlasted it.
static LEAD_SECS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(PG_DUE_LEAD.as_secs());

/// One drain; `None` when the enqueue outlasted the lead.
async fn drain_once(
    bench: &Bench,
    server: &Server,
    handler: Handler,
    daemons: usize,
) -> anyhow::Result<Option<Drain>> {
    let db = server.database().await?;
    let (bench, ds) =
        daemons_on(bench, &db, "", daemons, handler.queues(), handler.guest()).await?;
    let api = &ds[0].api;
    let queue = handler.queue();
    let lead = Duration::from_secs(LEAD_SECS.load(std::sync::atomic::Ordering::Relaxed));
    let enqueue_started = Instant::now();
    let due = SystemTime::now() + lead;
    let run_at = humantime::format_rfc3339_millis(due).to_string();
    for start in (0..super::DRAIN_JOBS).step_by(BATCH) {
        let jobs: Vec<Value> = (start..(start + BATCH).min(super::DRAIN_JOBS))
            .map(|i| json!({ "payload": handler.payload(i), "run_at": run_at }))
            .collect();
        api.post(&batch_path(queue), json!({ "jobs": jobs }).to_string())
            .await?;
    }
    let early = due.duration_since(SystemTime::now()).unwrap_or_default();
    if early.is_zero() {
        let took = enqueue_started.elapsed();
        let longer = (took.as_secs() + 1) * 2;
        LEAD_SECS.fetch_max(longer, std::sync::atomic::Ordering::Relaxed);
        note(format!(
            "   enqueueing {} jobs took {:.1} s, longer than the {} s lead: discarded, again with a {longer} s lead",
            super::DRAIN_JOBS,
            took.as_secs_f64(),
            lead.as_secs()
        ));
        drop(ds);
        drop(bench);
        db.drop_database().await?;
        return Ok(None);
    }
    tokio::time::sleep(early).await;
    let before = Usage::sample(&db, &ds, server).await?;
    let done = wait_drained(api, queue, super::DRAIN_JOBS as u64).await?;
    let after = Usage::sample(&db, &ds, server).await?;
    let elapsed = done.duration_since(due).context("clock went backwards")?;
    let usage = after.minus(&before);
    note(format!(
        "   drained {queue} with {daemons} daemon(s) in {:.3} s: {}",
        elapsed.as_secs_f64(),
        usage.line(elapsed.as_secs_f64())
    ));
    drop(ds);
    drop(bench);
    db.drop_database().await?;
    Ok(Some(Drain {
        rate: super::DRAIN_JOBS as f64 / elapsed.as_secs_f64(),
        usage,
    }))
}

async fn figure_enqueue(bench: &Bench, server: &Server) -> anyhow::Result<Vec<Row>> {
    let db = server.database().await?;
    let (bench_for_db, ds) = daemons_on(bench, &db, "", 1, PARKED_QUEUE, "echo").await?;
    let api = &ds[0].api;
    let mut costs = Vec::new();
    let mut before = Usage::sample(&db, &ds, server).await?;
    let mut started = Instant::now();
    let single = enqueue_in_flight(api, "parked", 2_000, 1).await?;
    let mut cost = async |label: &str, before: &mut Usage, started: &mut Instant| {
        let secs = started.elapsed().as_secs_f64();
        let now = Usage::sample(&db, &ds, server).await?;
        let used = now.minus(before);
        note(format!("   {label}: {}", used.line(secs)));
        costs.push(used);
        *before = now;
        *started = Instant::now();
        anyhow::Ok(())
    };
    cost("one at a time", &mut before, &mut started).await?;
    let sixteen = enqueue_in_flight(api, "parked", 20_000, 16).await?;
    cost("16 in flight", &mut before, &mut started).await?;
    let batched = enqueue_batches(api, "parked", 50 * BATCH, 1).await?;
    cost("batches of 1,000", &mut before, &mut started).await?;
    note(format!(
        "3: enqueue/s: {} one at a time, {} with 16 in flight (p50 {} p99 {}), {} in batches",
        thousands(single.rate),
        thousands(sixteen.rate),
        millis(sixteen.p50),
        millis(sixteen.p99),
        thousands(batched)
    ));
    drop(ds);
    drop(bench_for_db);
    db.drop_database().await?;
    let cost = |i: usize| costs.get(i).map(Usage::per_drain).unwrap_or_default();
    Ok(vec![
        Row::report(
            "3a. enqueue/s, one at a time (2,000)",
            format!("{}; {}", thousands(single.rate), cost(0)),
        ),
        Row::report(
            "3b. enqueue/s, 16 in flight (20,000)",
            format!("{}; {}", thousands(sixteen.rate), cost(1)),
        ),
        Row::report(
            "3c. enqueue/s, batches of 1,000 (50)",
            format!("{}; {}", thousands(batched), cost(2)),
        ),
        Row::report(
            "3d. enqueue latency p50 / p99, 16 in flight",
            format!("{} / {}", millis(sixteen.p50), millis(sixteen.p99)),
        ),
    ])
}

async fn figure_redelivery(bench: &Bench, server: &Server) -> anyhow::Result<Row> {
    let mut firsts = Vec::with_capacity(RUNS);
    let mut alls = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let (first, all) = redelivery(bench, server).await?;
        firsts.push(first.as_secs_f64());
        alls.push(all.as_secs_f64());
    }
    let first = Spread::of(firsts);
    let all = Spread::of(alls);
    let target = 2.0 * LEASE_SECS;
    note(format!(
        "5: kill -9 to the first of its jobs completed by the other daemon: {} s (all {HELD}: {} s); lease {LEASE}",
        first.decimals(2),
        all.decimals(2)
    ));
    Ok(Row::new(
        &format!(
            "5. kill -9 of a daemon → first of its jobs completed by the other (lease {LEASE}, heartbeat {HEARTBEAT})"
        ),
        &format!("≤ {target:.0} s (2 × lease)"),
        format!(
            "{} s; all {HELD} of its jobs: {} s",
            first.decimals(2),
            all.decimals(2)
        ),
        first.median <= target,
    ))
}

/// One run of figure 5; returns the times from the kill to the first and
/// to the last of A's jobs completed by B.
async fn redelivery(bench: &Bench, server: &Server) -> anyhow::Result<(Duration, Duration)> {
    let db = server.database().await?;
    let store = format!("lease = \"{LEASE}\"\nheartbeat = \"{HEARTBEAT}\"\n");
    let sleepy = "[queues.sleepy]\nplugin = \"chaos\"\nconcurrency = 16\ntimeout = \"120s\"\ngrants = { kv = true }\n";
    let (bench_a, mut a) = daemons_on(bench, &db, &store, 1, sleepy, "chaos").await?;
    for _ in 0..HELD {
        a[0].api
            .post(
                "/v1/queues/sleepy/jobs",
                json!({ "payload": { "do": "sleep", "ms": 60_000 } }).to_string(),
            )
            .await?;
    }
    let active = "SELECT count(*) FROM jobs WHERE queue = 'sleepy' AND state = 'active'";
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.count(active).await? < HELD as i64 {
        ensure!(
            Instant::now() < deadline,
            "the sleepers did not all become active in 60 s; daemon A's log:\n{}",
            a[0].log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // B runs the same queue with echo: what it takes over completes at once.
    let echo_sleepy = "[queues.sleepy]\nplugin = \"echo\"\nconcurrency = 16\n";
    let (bench_b, b) = daemons_on(bench, &db, &store, 1, echo_sleepy, "echo").await?;
    ensure!(
        db.count(active).await? == HELD as i64,
        "daemon B took jobs that daemon A held before A was killed"
    );
    let killed = Instant::now();
    a[0].kill9()?;
    let completed = "SELECT count(*) FROM jobs WHERE queue = 'sleepy' AND state = 'completed'";
    let mut first = None;
    let all = loop {
        let n = db.count(completed).await?;
        let at = killed.elapsed();
        if n > 0 {
            first.get_or_insert(at);
        }
        if n == HELD as i64 {
            break at;
        }
        ensure!(
            at < DEADLINE,
            "the killed daemon's jobs were not redelivered"
        );
        tokio::time::sleep(REDELIVERY_POLL).await;
    };
    let abandoned = db
        .count("SELECT count(*) FROM attempts WHERE outcome = 'abandoned'")
        .await?;
    ensure!(
        abandoned == HELD as i64,
        "{abandoned} attempts recorded abandoned, expected the {HELD} of the killed daemon"
    );
    let first = first.unwrap_or(all);
    note(format!(
        "   first completed by B {:.3} s after the kill, all {HELD} after {:.3} s",
        first.as_secs_f64(),
        all.as_secs_f64()
    ));
    drop((a, b, bench_a, bench_b));
    db.drop_database().await?;
    Ok((first, all))
}

// ---------------------------------------------------------------------------
// Daemons on one database

/// A bench whose daemons use `db` (with `extra` lines in `[store]`), under
/// its own directory of `bench`'s root, and `n` daemons of it started one
/// after the other (the first applies the migrations), each answering.
async fn daemons_on(
    bench: &Bench,
    db: &Database,
    extra: &str,
    n: usize,
    queues: &str,
    guest: &str,
) -> anyhow::Result<(Bench, Vec<Daemon>)> {
    let sub = bench.fresh_dir("pg")?;
    let on_db = Bench {
        khata: bench.khata.clone(),
        plugins: bench.plugins.clone(),
        root: sub,
        dirs: AtomicUsize::new(0),
        store: format!(
            "[store]\nbackend = \"postgres\"\nurl = {}\n{extra}\n",
            toml_string(&db.url)
        ),
    };
    let mut daemons = Vec::with_capacity(n);
    for _ in 0..n {
        daemons.push(on_db.daemon(queues, &[guest]).await?);
    }
    Ok((on_db, daemons))
}

/// `s` as a TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

// ---------------------------------------------------------------------------
// CPU and transactions

/// Counters read at one moment: CPU seconds of the daemons, of the
/// PostgreSQL server, of this bench and of the machine; XIDs assigned.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    daemons: f64,
    postgres: f64,
    bench: f64,
    machine: f64,
    xids: i64,
}

impl Usage {
    async fn sample(db: &Database, daemons: &[Daemon], server: &Server) -> anyhow::Result<Usage> {
        let xids = db.xid_horizon().await?;
        let daemons = daemons
            .iter()
            .filter_map(|d| d.child.as_ref())
            .filter_map(|c| stat_times(&format!("/proc/{}/stat", c.id())))
            .map(|t| t.total())
            .sum();
        Ok(Usage {
            daemons,
            postgres: server.postmaster.map_or(0.0, server_seconds),
            bench: stat_times("/proc/self/stat").map_or(0.0, |t| t.total()),
            machine: machine_seconds().unwrap_or(0.0),
            xids,
        })
    }

    /// What was used between `before` and `self`; the rest of the
    /// machine's share goes to [`OTHERS`].
    fn minus(&self, before: &Usage) -> Usage {
        let d = Usage {
            daemons: self.daemons - before.daemons,
            postgres: self.postgres - before.postgres,
            bench: self.bench - before.bench,
            machine: self.machine - before.machine,
            xids: self.xids - before.xids,
        };
        if let Ok(mut others) = OTHERS.lock() {
            *others += d.rest();
        }
        d
    }

    fn rest(&self) -> f64 {
        (self.machine - self.daemons - self.postgres - self.bench).max(0.0)
    }

    /// A progress line for a span of `secs` seconds.
    fn line(&self, secs: f64) -> String {
        format!(
            "{} write transactions ({}/s); CPU s: daemons {:.2}, PostgreSQL {:.2}, bench {:.2}, rest of the machine {:.2}",
            thousands(self.xids as f64),
            thousands(self.xids as f64 / secs.max(1e-9)),
            self.daemons,
            self.postgres,
            self.bench,
            self.rest()
        )
    }

    /// The cost for the table's cell.
    fn per_drain(&self) -> String {
        format!(
            "CPU s: daemons {:.1}, PostgreSQL {:.1}; {} write tx",
            self.daemons,
            self.postgres,
            thousands(self.xids as f64)
        )
    }
}

/// CPU seconds of a PostgreSQL server: the postmaster, its children that it
/// reaped (`cutime`, `cstime`), and its live children.
fn server_seconds(postmaster: u32) -> f64 {
    let mut total = 0.0;
    if let Some(f) = stat_fields(&format!("/proc/{postmaster}/stat")) {
        // utime, stime, cutime, cstime: fields 14-17.
        total += (11..=14)
            .filter_map(|i| f.get(i)?.parse::<f64>().ok())
            .sum::<f64>()
            / super::USER_HZ;
    }
    let procs = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    for p in procs {
        let name = p.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let path = p.path().join("stat");
        let Some(f) = stat_fields(&path.to_string_lossy()) else {
            continue;
        };
        // ppid: field 4.
        if f.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(postmaster) {
            total += (11..=12)
                .filter_map(|i| f.get(i)?.parse::<f64>().ok())
                .sum::<f64>()
                / super::USER_HZ;
        }
    }
    total
}

/// The fields of a `/proc/.../stat` file after the command name, from
/// field 3 (state) on.
fn stat_fields(path: &str) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(path).ok()?;
    Some(
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

// ---------------------------------------------------------------------------
// The server and its databases

/// The PostgreSQL server the figures run on.
struct Server {
    /// A URL of a database on it where the user may `CREATE DATABASE`.
    admin: String,
    /// The cluster's directory, when this bench started the server.
    throwaway: Option<PathBuf>,
    /// The postmaster's pid, when the server runs on this machine.
    postmaster: Option<u32>,
    databases: AtomicUsize,
}

/// `scripts/pg-test-server` of the source tree this bench was built from.
fn pg_test_server() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/pg-test-server")
}

impl Server {
    /// `KHATA_BENCH_PG_URL`, else a throwaway cluster.
    async fn start() -> anyhow::Result<Server> {
        let (admin, throwaway) = match std::env::var("KHATA_BENCH_PG_URL") {
            Ok(url) if !url.trim().is_empty() => (url, None),
            _ => {
                let script = pg_test_server();
                ensure!(
                    script.is_file(),
                    "{} is missing: set KHATA_BENCH_PG_URL to a PostgreSQL server where this user may CREATE DATABASE",
                    script.display()
                );
                note(
                    "postgres: starting a throwaway cluster (scripts/pg-test-server start)".into(),
                );
                let out = std::process::Command::new(&script)
                    .arg("start")
                    .stderr(std::process::Stdio::inherit())
                    .output()
                    .with_context(|| format!("running {}", script.display()))?;
                ensure!(
                    out.status.success(),
                    "{} start failed ({}); set KHATA_BENCH_PG_URL to use a running server",
                    script.display(),
                    out.status
                );
                let text = String::from_utf8_lossy(&out.stdout);
                let var = |name: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(&format!("export {name}=")))
                        .map(str::to_owned)
                        .with_context(|| format!("no {name} in the output of {}", script.display()))
                };
                (
                    var("KHATA_TEST_PG_URL")?,
                    Some(PathBuf::from(var("KHATA_TEST_PG_DIR")?)),
                )
            }
        };
        let mut server = Server {
            admin,
            throwaway,
            postmaster: None,
            databases: AtomicUsize::new(0),
        };
        let client = server.connect(&server.admin).await?;
        let backend: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0);
        // A backend is a child of the postmaster; on another machine there
        // is no such process here, and the server's CPU is not reported.
        server.postmaster =
            stat_fields(&format!("/proc/{backend}/stat")).and_then(|f| f.get(1)?.parse().ok());
        Ok(server)
    }

    async fn connect(&self, url: &str) -> anyhow::Result<tokio_postgres::Client> {
        let (client, connection) = parse_url(url)?
            .connect(NoTls)
            .await
            .with_context(|| format!("connecting to PostgreSQL at {url}"))?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// The version and the settings that make commits durable, for the
    /// report.
    async fn settings(&self) -> anyhow::Result<String> {
        let client = self.connect(&self.admin).await?;
        let mut parts = Vec::new();
        for name in [
            "server_version",
            "fsync",
            "synchronous_commit",
            "wal_sync_method",
            "full_page_writes",
            "shared_buffers",
            "max_connections",
        ] {
            let value: String = client.query_one(&format!("SHOW {name}"), &[]).await?.get(0);
            parts.push(format!("{name} = {value}"));
        }
        let whose = match &self.throwaway {
            Some(dir) => format!("throwaway cluster in {}", dir.display()),
            None => "KHATA_BENCH_PG_URL".to_owned(),
        };
        let cpu = if self.postmaster.is_some() {
            ""
        } else {
            " (not on this machine: its CPU is not reported)"
        };
        Ok(format!("PostgreSQL ({whose}){cpu}: {}", parts.join(", ")))
    }

    /// A new, empty database.
    async fn database(&self) -> anyhow::Result<Database> {
        let n = self
            .databases
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("khata_bench_{}_{n}", std::process::id());
        let admin = self.connect(&self.admin).await?;
        admin
            .batch_execute(&format!(
                "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8'"
            ))
            .await
            .with_context(|| format!("CREATE DATABASE {name}"))?;
        let url = url_with_dbname(&self.admin, &name);
        let client = self.connect(&url).await?;
        Ok(Database {
            admin,
            client,
            name,
            url,
        })
    }

    /// Stops the throwaway cluster; a server named by the environment is
    /// left running.
    async fn stop(self) {
        if let Some(dir) = &self.throwaway {
            let status = std::process::Command::new(pg_test_server())
                .arg("stop")
                .arg(dir)
                .status();
            if !matches!(status, Ok(s) if s.success()) {
                eprintln!("could not stop the PostgreSQL cluster in {}", dir.display());
            }
        }
    }
}

/// A database of one figure's run, with a connection of the bench's own.
struct Database {
    admin: tokio_postgres::Client,
    client: tokio_postgres::Client,
    name: String,
    url: String,
}

impl Database {
    async fn count(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(self.client.query_one(sql, &[]).await?.get(0))
    }

    /// The next XID the server will assign (server-wide).
    async fn xid_horizon(&self) -> anyhow::Result<i64> {
        self.count("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
            .await
    }

    /// Drops the database, ending the sessions still on it.
    async fn drop_database(self) -> anyhow::Result<()> {
        drop(self.client);
        self.admin
            .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .await
            .with_context(|| format!("DROP DATABASE {}", self.name))?;
        Ok(())
    }
}
