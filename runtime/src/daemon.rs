//! `khata serve` and `khata check`: the wiring of config, store, host,
//! queues and API.
//!
//! Start-up order: read jobs.toml, open the ledger (SQLite in `data_dir`,
//! migrating it and taking its lock; or PostgreSQL at `store.url`,
//! migrating it and registering this daemon), recover the attempts a crash
//! left active (on PostgreSQL: those whose lease expired), watch `plugins_dir` and load plugins
//! (compiled code comes from the cache in `data_dir/code-cache` when it can),
//! start the dispatchers, listen. Shutdown (SIGTERM, SIGINT): stop listening
//! and leasing, give the attempts in flight `shutdown_grace`, interrupt the
//! rest (their jobs go back to waiting, uncounted), and close the ledger.
//!
//! SIGHUP reloads jobs.toml: queues added, changed or removed take effect
//! (see [`Queues::reconfigure`]), and so do `[retention]`, `[email]` and
//! `[http.*]` and `[schedules]`; `[daemon]` and `[store]` are read at start only (a change
//! is logged as waiting for a restart). A file that does not
//! parse or validate, or asks for more than the instance pool sized at start
//! can give, is refused with its errors logged, and the running
//! configuration stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::api::{self, AppState};
use crate::clock::{self, Clock};
use crate::config::{Backend, Config};
use crate::effects::email::Mailer;
use crate::effects::http::Providers;
use crate::host::{Host, PoolSize};
use crate::job::Millis;
use crate::plugins::{Loader, ScanKind, Watch, check_grants, plugin_path};
use crate::queue::{Outside, Queues, Reconfigured, Stop};
use crate::schedule::Schedules;
use crate::store::postgres::PostgresStore;
use crate::store::sled::SledStore;
use crate::store::sqlite::SqliteStore;
use crate::store::{RetentionRules, Store};

/// The compiled-code cache, under `data_dir`.
const CODE_CACHE: &str = "code-cache";
/// The retention sweep removes at most [`SWEEP_LIMIT`] rows of each kind
/// per pass (one write step: the other steps wait at most that long). A
/// pass that found more due is followed by the next after [`SWEEP_AGAIN`],
/// back to back, so that the sweep keeps up with any completion rate the
/// writer can reach; one that found some runs again after [`SWEEP_BUSY`],
/// so that a steady load is swept in small steady passes rather than in a
/// burst that stalls the queues; one that found nothing waits
/// [`SWEEP_IDLE`]. The soak (bench figure 11, docs/benchmarks.md) chose
/// these: passes of 2,000 every 15 s dipped the rate every 15 s with an
/// enqueue p99 up to 160 ms; of 2,000 every second, p99 50-75 ms; of 500
/// every second, p99 13-18 ms at the same load.
const SWEEP_LIMIT: u32 = 500;
const SWEEP_AGAIN: Duration = Duration::from_millis(20);
const SWEEP_BUSY: Duration = Duration::from_secs(1);
const SWEEP_IDLE: Duration = Duration::from_secs(15);

/// Runs the daemon until SIGTERM or SIGINT.
pub fn serve(config_path: &Path) -> anyhow::Result<()> {
    init_tracing();
    let config = Config::load(config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    crate::files::warn_if_shared(&config.daemon.data_dir);
    crate::files::private();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("khata")
        .build()?;
    let _failpoints = crate::failpoints::scenario();
    runtime.block_on(run(config))
}

/// Validates jobs.toml and every queue's plugin; prints every error.
pub fn check(config_path: &Path) -> anyhow::Result<bool> {
    let config = match Config::load(config_path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return Ok(false);
        }
    };
    // No code cache: `check` writes nothing.
    let host = Host::new(&pool_size(&config), None)?;
    let mut ok = true;
    for q in config.queues.values() {
        let path = plugin_path(&config, q);
        let result = host
            .load_file(&q.plugin, &path)
            .map_err(|e| e.to_string())
            .and_then(|p| check_grants(q, &p).map(|()| p));
        match result {
            Ok(p) => println!(
                "queue {:?}: plugin {:?} ok (version {})",
                q.name,
                q.plugin,
                p.short_version()
            ),
            Err(e) => {
                ok = false;
                eprintln!("{}: queue {:?}: {e}", config.path.display(), q.name);
            }
        }
    }
    if ok {
        println!("{}: ok", config.path.display());
    }
    Ok(ok)
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KHATA_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = if std::env::var("KHATA_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

fn pool_size(config: &Config) -> PoolSize {
    let concurrency: u32 = config.queues.values().map(|q| q.concurrency).sum();
    PoolSize {
        // Room for a plugin check and for the next version during a swap.
        instances: concurrency.saturating_mul(2).saturating_add(16),
        max_memory: config
            .queues
            .values()
            .map(|q| q.memory)
            .max()
            .unwrap_or(64 << 20),
    }
}

/// The PostgreSQL URL of `[store] url`, read from where it is kept.
fn postgres_url(config: &Config) -> anyhow::Result<String> {
    let path = config.path.display();
    let url = config.store.url.as_ref().ok_or_else(|| {
        anyhow::anyhow!("{path}: store.url: missing: backend \"postgres\" needs it")
    })?;
    url.resolve()
        .map_err(|e| anyhow::anyhow!("{path}: store.url: {e}"))
}

/// Opens the configured ledger: migrates its schema and takes its lock (one
/// daemon per ledger).
async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match config.store.backend {
        Backend::Postgres => {
            let url = postgres_url(config)?;
            let store = PostgresStore::open_with_lease(
                &url,
                config.store.pool as usize,
                config.store.lease,
            )
            .await
            .context("opening the PostgreSQL ledger (store.url)")?;
            tracing::info!(
                database = %store.target(),
                pool = config.store.pool,
                daemon_id = %store.daemon_id(),
                lease = %humantime::format_duration(config.store.lease),
                heartbeat = %humantime::format_duration(config.store.heartbeat),
                "the ledger is in PostgreSQL; this daemon's id there"
            );
            Arc::new(store)
        }
        Backend::Sled => {
            let data_dir = &config.daemon.data_dir;
            let store = SledStore::open_with_cache(data_dir, config.store.cache)
                .with_context(|| format!("opening the sled ledger in {}", data_dir.display()))?;
            tracing::info!(path = %store.path().display(), cache = %bytesize::ByteSize(config.store.cache), "the ledger is in sled");
            Arc::new(store)
        }
        Backend::Sqlite => {
            let data_dir = &config.daemon.data_dir;
            Arc::new(
                SqliteStore::open(data_dir)
                    .with_context(|| format!("opening the ledger in {}", data_dir.display()))?,
            )
        }
    })
}

/// `khata store migrate`: applies the configured ledger's pending schema
/// migrations and prints its schema version.
pub fn store_migrate(config_path: &Path) -> anyhow::Result<()> {
    let config = Config::load(config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    crate::files::private();
    match config.store.backend {
        Backend::Sled => {
            let data_dir = &config.daemon.data_dir;
            // Opening writes the layout version of a new ledger and refuses a
            // newer one; it fails while a daemon holds the ledger.
            let store = SledStore::open(data_dir)
                .with_context(|| format!("opening the sled ledger in {}", data_dir.display()))?;
            println!(
                "sled: layout version {} ({})",
                crate::store::sled::LAYOUT_VERSION,
                store.path().display()
            );
        }
        Backend::Postgres => {
            let url = postgres_url(&config)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let m = runtime
                .block_on(crate::store::postgres::migrate(&url))
                .context("migrating the PostgreSQL ledger (store.url)")?;
            if m.from == m.to {
                println!("postgres: schema version {} (up to date)", m.to);
            } else {
                println!(
                    "postgres: schema version {} (migrated from version {})",
                    m.to, m.from
                );
            }
        }
        Backend::Sqlite => {
            let data_dir = &config.daemon.data_dir;
            // Opening migrates; it fails while a daemon holds the ledger.
            let store = SqliteStore::open(data_dir)
                .with_context(|| format!("opening the ledger in {}", data_dir.display()))?;
            println!(
                "sqlite: schema version {} ({})",
                crate::store::sqlite::SCHEMA_VERSION,
                store.path().display()
            );
        }
    }
    Ok(())
}

/// Where `khata store copy` finds a ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LedgerAt {
    /// The ledger a jobs.toml configures (`[store]`, `[daemon] data_dir`).
    Config(PathBuf),
    /// The data directory of an embedded ledger: SQLite (`khata.db`) or
    /// sled (`ledger.sled`), whichever it holds; a target that holds
    /// neither gets SQLite, the default.
    DataDir(PathBuf),
    /// A PostgreSQL database. `named` says where the URL came from, for
    /// messages that must not repeat it (it may hold a password).
    Postgres { url: String, named: String },
}

impl LedgerAt {
    /// `postgres://` or `postgresql://` is a URL; an existing file, or a
    /// name ending in `.toml`, a jobs.toml; anything else a data directory.
    pub fn parse(arg: &str, flag: &str) -> LedgerAt {
        if arg.starts_with("postgres://") || arg.starts_with("postgresql://") {
            return LedgerAt::Postgres {
                url: arg.to_owned(),
                named: format!("the URL of {flag}"),
            };
        }
        let path = PathBuf::from(arg);
        if path.is_file() || arg.ends_with(".toml") {
            LedgerAt::Config(path)
        } else {
            LedgerAt::DataDir(path)
        }
    }

    /// The PostgreSQL URL (or key-value string) in the environment variable `var`.
    pub fn from_env(var: &str, flag: &str) -> anyhow::Result<LedgerAt> {
        match std::env::var(var) {
            Ok(url) if !url.trim().is_empty() => Ok(LedgerAt::Postgres {
                url,
                named: format!("${var}"),
            }),
            Ok(_) => anyhow::bail!("{flag} {var}: the environment variable is empty"),
            Err(std::env::VarError::NotPresent) => {
                anyhow::bail!("{flag} {var}: the environment variable is not set")
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                anyhow::bail!("{flag} {var}: the environment variable is not valid UTF-8")
            }
        }
    }
}

/// A ledger's backend and address, once a jobs.toml is read.
enum Located {
    Sqlite(PathBuf),
    Sled(PathBuf),
    Postgres { url: String, named: String },
}

impl Located {
    /// The data directory of an embedded ledger.
    fn data_dir(&self) -> Option<&Path> {
        match self {
            Located::Sqlite(dir) | Located::Sled(dir) => Some(dir),
            Located::Postgres { .. } => None,
        }
    }
}

/// The embedded ledger a data directory holds, by the files each backend
/// keeps there. A source must hold exactly one; a target that holds neither
/// gets SQLite.
fn embedded_in(dir: &Path, flag: &str, source: bool) -> anyhow::Result<Located> {
    let sqlite = dir.join("khata.db");
    let sled = dir.join(crate::store::sled::DIR_NAME);
    match (sqlite.exists(), sled.exists()) {
        (true, true) => anyhow::bail!(
            "{flag} {}: the directory holds both a SQLite ledger ({}) and a sled ledger ({}); \
             name a jobs.toml whose [store] backend says which",
            dir.display(),
            sqlite.display(),
            sled.display()
        ),
        (true, false) => Ok(Located::Sqlite(dir.to_owned())),
        (false, true) => Ok(Located::Sled(dir.to_owned())),
        (false, false) if source => anyhow::bail!(
            "{flag} {}: there is no ledger there (neither a SQLite ledger, {}, nor a sled \
             ledger, {})",
            dir.display(),
            sqlite.display(),
            sled.display()
        ),
        (false, false) => Ok(Located::Sqlite(dir.to_owned())),
    }
}

fn locate(at: &LedgerAt, flag: &str, source: bool) -> anyhow::Result<Located> {
    Ok(match at {
        LedgerAt::DataDir(dir) => embedded_in(dir, flag, source)?,
        LedgerAt::Postgres { url, named } => Located::Postgres {
            url: url.clone(),
            named: named.clone(),
        },
        LedgerAt::Config(path) => {
            let config = Config::load(path).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
            match config.store.backend {
                Backend::Sled => Located::Sled(config.daemon.data_dir.clone()),
                Backend::Postgres => Located::Postgres {
                    url: postgres_url(&config).with_context(|| flag.to_owned())?,
                    named: format!("store.url of {}", path.display()),
                },
                Backend::Sqlite => Located::Sqlite(config.daemon.data_dir.clone()),
            }
        }
    })
}

/// Opens one side of a copy; `source` takes the extra care a source needs.
/// Returns the store and its name for the summary.
async fn open_for_copy(
    at: &Located,
    flag: &str,
    source: bool,
) -> anyhow::Result<(Arc<dyn Store>, String)> {
    Ok(match at {
        Located::Sqlite(dir) | Located::Sled(dir) => {
            let sled = matches!(at, Located::Sled(_));
            let (kind, db) = if sled {
                ("sled", dir.join(crate::store::sled::DIR_NAME))
            } else {
                ("sqlite", dir.join("khata.db"))
            };
            if source && !db.exists() {
                anyhow::bail!(
                    "{flag} {}: there is no {kind} ledger there ({} does not exist)",
                    dir.display(),
                    db.display()
                );
            }
            // Taking the lock refuses while a daemon uses the directory.
            let opened: Result<Arc<dyn Store>, crate::store::StoreError> = if sled {
                SledStore::open(dir).map(|s| Arc::new(s) as _)
            } else {
                SqliteStore::open(dir).map(|s| Arc::new(s) as _)
            };
            let store = opened.with_context(|| {
                format!(
                    "{flag} {}: cannot open the {kind} ledger; stop the daemon that uses it first",
                    dir.display()
                )
            })?;
            (store, format!("{kind} {}", db.display()))
        }
        Located::Postgres { url, named } => {
            let store = PostgresStore::open(url, 4)
                .await
                .with_context(|| format!("{flag} ({named}): cannot open the PostgreSQL ledger"))?;
            let name = format!("postgres {}", store.target());
            (Arc::new(store), name)
        }
    })
}

/// `khata store copy`: copies the ledger at `from` into the empty ledger at
/// `to`, `page` records at a time, verifies that both hold the same and
/// prints a summary. Each page is durable in the target when it is
/// written; a copy that fails part-way leaves a target that a later copy
/// refuses as not empty (start again from an empty one).
pub fn store_copy(from: &LedgerAt, to: &LedgerAt, page: u32) -> anyhow::Result<()> {
    crate::files::private();
    let source = locate(from, "--from", true)?;
    let target = locate(to, "--to", false)?;
    let same = match (&source, &target) {
        (Located::Postgres { url: a, .. }, Located::Postgres { url: b, .. }) => a == b,
        // One data directory has one lock: even two backends in it cannot
        // both be opened by one copy.
        (a, b) => match (a.data_dir(), b.data_dir()) {
            (Some(a), Some(b)) => {
                std::path::absolute(a).ok() == std::path::absolute(b).ok()
                    || (a.exists()
                        && std::fs::canonicalize(a).ok() == std::fs::canonicalize(b).ok())
            }
            _ => false,
        },
    };
    if same {
        anyhow::bail!("--from and --to name the same ledger");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let (from_store, from_name) = open_for_copy(&source, "--from", true).await?;
        match &source {
            // As the daemon's start would: an attempt a crash left running is
            // closed as abandoned, its job waiting again (or dead).
            Located::Sqlite(_) | Located::Sled(_) => {
                let recovered = from_store.recover(Millis::now()).await?;
                if recovered > 0 {
                    eprintln!(
                        "recovered {recovered} jobs of {from_name} whose attempts a crash left running"
                    );
                }
            }
            Located::Postgres { named, .. } => {
                let active: u64 = from_store
                    .counts(Millis::now())
                    .await?
                    .iter()
                    .map(|(_, c)| c.active)
                    .sum();
                if active > 0 {
                    anyhow::bail!(
                        "--from ({named}): {active} jobs are active in {from_name}; stop the daemons \
                         that use it first (a daemon's next start recovers jobs that a crash left active)"
                    );
                }
            }
        }
        let (to_store, to_name) = open_for_copy(&target, "--to", false).await?;
        let mut reported = 0u64;
        let copied = crate::store::copy::copy(&*from_store, &*to_store, page, |n| {
            if n >= reported + 10_000 {
                reported = n;
                eprintln!("{n} records copied");
            }
        })
        .await;
        let copied = match copied {
            Ok(c) => c,
            Err(crate::store::copy::CopyError::TargetNotEmpty(what)) => anyhow::bail!(
                "--to: {to_name} is not empty (it holds {what}); a copy only goes into an empty \
                 ledger, and nothing was written"
            ),
            Err(e) => return Err(anyhow::Error::new(e).context(format!(
                "copying {from_name} to {to_name}"
            ))),
        };
        println!("copied {from_name} to {to_name}");
        println!("{}", copied.target);
        println!(
            "verified: both hold the same jobs (by state), attempts, effects, dedup keys, \
             fences (by state), kv entries and index documents, with equal contents; \
             the target's counters are no lower than the source's"
        );
        Ok(())
    })
}

/// Builds the email transport and HTTP providers. A bad provider stops the
/// start; an email transport that cannot be set up only fails the queues
/// that send email.
fn outside(config: &Config, clock: Arc<dyn Clock>) -> anyhow::Result<Outside> {
    let providers = Providers::from_config(&config.http)
        .map_err(|e| anyhow::anyhow!("{}: {e}", config.path.display()))?;
    let mailer = Mailer::from_config(&config.email, &config.daemon.data_dir).map(Arc::new);
    if let Err(e) = &mailer {
        tracing::error!(error = %e, "the email transport is not available");
    }
    Ok(Outside {
        mailer,
        providers: Arc::new(providers),
        email_from: config.email.from.clone(),
        clock,
    })
}

async fn run(config: Config) -> anyhow::Result<()> {
    let data_dir = &config.daemon.data_dir;
    let store = open_store(&config).await?;
    let clock = clock::daemon();
    let recovered = store.recover(clock.now()).await?;
    if recovered > 0 {
        tracing::warn!(
            jobs = recovered,
            "recovered jobs whose attempts were abandoned by the previous run"
        );
    }
    let host = Arc::new(Host::new(
        &pool_size(&config),
        Some(&data_dir.join(CODE_CACHE)),
    )?);
    let outside = outside(&config, Arc::clone(&clock))?;
    let wakeups = store.wakeups();
    let mut queues = Queues::new(
        Arc::clone(&store),
        Arc::clone(&host),
        config.queues.values().cloned(),
        &outside,
    );
    if wakeups.is_some() {
        // Other daemons' enqueues arrive as wake-ups; the poll is the
        // fallback for one that is lost.
        queues = queues.with_idle_poll(config.store.lease);
    }
    let queues = Arc::new(queues);
    let shared = if config.store.backend == Backend::Postgres {
        Some(tokio::spawn(leases(
            Arc::clone(&store),
            Arc::clone(&queues),
            (config.store.heartbeat, config.store.lease),
            wakeups,
        )))
    } else {
        None
    };
    // Watch first, so that a change during the first scan is not missed.
    let watch = Watch::start(&config.daemon.plugins_dir);
    let mut loader = Loader::default();
    loader.scan(&config, &host, &queues, ScanKind::Full);

    let metrics = metrics_recorder()
        .map_err(|e| tracing::warn!(error = %e, "metrics recorder not installed"))
        .ok();
    let schedules =
        Arc::new(Schedules::new(&config).map_err(|e| anyhow::anyhow!("schedules: {e}"))?);
    let state = AppState {
        store: Arc::clone(&store),
        queues: Arc::clone(&queues),
        schedules: Arc::clone(&schedules),
        token: config.daemon.token.as_deref().map(api::TokenDigest::of),
        allowed_hosts: api::guard::AllowedHosts::new(&config.daemon.allowed_hosts),
        max_request: config.daemon.max_request,
        metrics,
    };
    // Before anything can send it: SIGHUP's default action ends the process.
    let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(
            |e| tracing::warn!(error = %e, "SIGHUP cannot be handled: no configuration reload"),
        )
        .ok();
    let listener = tokio::net::TcpListener::bind(config.daemon.listen)
        .await
        .with_context(|| format!("listening on {} (daemon.listen)", config.daemon.listen))?;
    tracing::info!(listen = %config.daemon.listen, data_dir = %data_dir.display(), queues = config.queues.len(), "khata is serving");

    let stop = Stop::default();
    let shutdown = CancellationToken::new();
    let dispatching = Arc::new(AtomicBool::new(true));
    let dispatcher = tokio::spawn({
        let (queues, stop, dispatching) =
            (Arc::clone(&queues), stop.clone(), Arc::clone(&dispatching));
        async move {
            queues.run(stop).await;
            dispatching.store(false, Ordering::Relaxed);
        }
    });
    let scheduler = tokio::spawn(Arc::clone(&schedules).run(Arc::clone(&queues), shutdown.clone()));
    let api_shutdown = shutdown.clone();
    let server_limits = api::serve::Limits {
        header_timeout: config.daemon.header_timeout,
        request_timeout: config.daemon.request_timeout,
        max_connections: config.daemon.max_connections,
    };
    let server = tokio::spawn(async move {
        api::serve::serve(listener, api::router(state), server_limits, api_shutdown).await
    });
    let background = tokio::spawn(background(
        Running {
            config: config.clone(),
            outside,
            store: Arc::clone(&store),
            host: Arc::clone(&host),
            queues: Arc::clone(&queues),
            schedules: Arc::clone(&schedules),
        },
        (loader, watch),
        hangup,
        shutdown.clone(),
    ));

    // The store is open, plugins are loaded and the API listens.
    notify_systemd(&[sd_notify::NotifyState::Ready]);
    let watchdog = sd_notify::watchdog_enabled().map(|period| {
        tokio::spawn(watchdog(
            period,
            Arc::clone(&store),
            Arc::clone(&clock),
            dispatching,
            shutdown.clone(),
        ))
    });

    let halted = tokio::select! {
        () = wait_for_signal() => None,
        why = store_halted(&*store) => Some(why),
    };
    if let Some(why) = &halted {
        tracing::error!(reason = %why, "the ledger stopped taking writes; the daemon exits so that it is restarted and recovery starts from what is durable");
    }
    notify_systemd(&[sd_notify::NotifyState::Stopping]);
    if let Some(w) = watchdog {
        w.abort();
    }
    tracing::info!(grace = %humantime::format_duration(config.daemon.shutdown_grace), "shutting down: draining attempts in flight");
    shutdown.cancel();
    stop.drain.cancel();
    let mut dispatcher = dispatcher;
    // A halted ledger finishes nothing: no grace.
    let grace = if halted.is_some() {
        Duration::ZERO
    } else {
        config.daemon.shutdown_grace
    };
    tokio::select! {
        _ = &mut dispatcher => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!("grace is over: interrupting the attempts still running");
            stop.interrupt.cancel();
            let _ = dispatcher.await;
        }
    }
    let _ = server.await;
    let _ = scheduler.await;
    background.abort();
    if let Some(shared) = shared {
        shared.abort();
    }
    tracing::info!("stopped");
    match halted {
        Some(why) => Err(anyhow::anyhow!("the ledger stopped taking writes: {why}")),
        None => Ok(()),
    }
}

/// Returns once the store has halted ([`Store::halted`]), with why.
async fn store_halted(store: &dyn Store) -> String {
    loop {
        if let Some(why) = store.halted() {
            return why;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Prometheus histograms (not summaries), so that dashboards can aggregate
/// quantiles across queues and daemons.
fn metrics_recorder() -> anyhow::Result<metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    const SECONDS: &[f64] = &[
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0, 300.0,
    ];
    const STEPS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0];
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS)?
        .set_buckets_for_metric(Matcher::Full("khata_store_commit_steps".into()), STEPS)?
        .install_recorder()?)
}

/// Tells systemd (`Type=notify`) how the daemon stands; nothing without
/// `NOTIFY_SOCKET`.
fn notify_systemd(state: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "could not notify systemd");
    }
}

/// `WATCHDOG=1` every half `period` while the ledger answers a read within
/// that half and the dispatchers run; systemd restarts a daemon that stops
/// sending it.
async fn watchdog(
    period: Duration,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    dispatching: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    let half = period / 2;
    let mut tick = tokio::time::interval(half);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let store_ok = matches!(
            tokio::time::timeout(half, store.counts(clock.now())).await,
            Ok(Ok(_))
        );
        if store_ok && dispatching.load(Ordering::Relaxed) {
            notify_systemd(&[sd_notify::NotifyState::Watchdog]);
        } else {
            tracing::error!(
                store_ok,
                "watchdog: the daemon is not healthy; not telling systemd it is alive"
            );
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    tokio::select! {
        _ = async { if let Some(t) = term.as_mut() { t.recv().await } else { std::future::pending().await } } => {}
        _ = async { if let Some(i) = int.as_mut() { i.recv().await } else { std::future::pending().await } } => {}
    }
}

/// The chores of a daemon that shares its store with others: renewing its
/// leases every `heartbeat` (stopping the attempts whose lease is lost,
/// also those whose lease ran out while the store could not be reached),
/// reclaiming expired leases as often, and waking queues on other daemons'
/// enqueues. Off the path of any job: an attempt never waits for them.
///
/// While the store is unreachable each chore logs its first failure as a
/// warning and the return of the store once; the gauge `khata_store_up`
/// is 0 from a failed heartbeat to the next one that succeeds.
async fn leases(
    store: Arc<dyn Store>,
    queues: Arc<Queues>,
    (heartbeat, lease_period): (Duration, Duration),
    wakeups: Option<tokio::sync::mpsc::UnboundedReceiver<String>>,
) {
    if let Some(mut rx) = wakeups {
        let queues = Arc::clone(&queues);
        tokio::spawn(async move {
            while let Some(queue) = rx.recv().await {
                queues.wake(&queue);
            }
        });
    }
    let reclaimer = {
        let store = Arc::clone(&store);
        let queues = Arc::clone(&queues);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(heartbeat);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut outage = Outage::new("reclaiming expired leases");
            loop {
                tick.tick().await;
                loop {
                    let reclaimed = store.reclaim_expired(queues.now()).await;
                    outage.saw(reclaimed.as_ref().err());
                    match reclaimed {
                        Ok(0) => break,
                        Ok(n) => {
                            metrics::counter!("khata_leases_reclaimed_total").increment(n);
                            tracing::warn!(
                                jobs = n,
                                "reclaimed jobs whose lease expired: their attempts are recorded as abandoned"
                            );
                        }
                        Err(_) => break,
                    }
                }
            }
        })
    };
    let _reclaimer = AbortOnDrop(reclaimer);
    let mut tick = tokio::time::interval(heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut outage = Outage::new("the heartbeat (renewing this daemon's leases)");
    metrics::gauge!("khata_store_up").set(1.0);
    loop {
        tick.tick().await;
        let started = std::time::Instant::now();
        // A heartbeat that has not answered within a lease renews nothing
        // that is still held: give up on it and count the failure.
        let beat = match tokio::time::timeout(lease_period, store.heartbeat()).await {
            Ok(beat) => beat,
            Err(_) => Err(crate::store::StoreError::Unavailable(format!(
                "the store did not answer the heartbeat within the lease ({})",
                humantime::format_duration(lease_period)
            ))),
        };
        outage.saw(beat.as_ref().err());
        match beat {
            Ok(lost) => {
                metrics::gauge!("khata_store_up").set(1.0);
                metrics::histogram!("khata_heartbeat_seconds")
                    .record(started.elapsed().as_secs_f64());
                for lease in lost {
                    metrics::counter!("khata_leases_lost_total").increment(1);
                    let stopped = queues.lease_lost(&lease);
                    tracing::warn!(job = %lease.job_id, token = lease.token, stopped, "lease lost (expired before it was renewed): the attempt's effects are refused from now on");
                }
            }
            Err(_) => {
                metrics::gauge!("khata_store_up").set(0.0);
                metrics::counter!("khata_heartbeat_failures_total").increment(1);
            }
        }
        // Leases that ran out while no heartbeat got through: the store
        // refuses their attempts' effects and finishes when it answers
        // again, so those attempts stop now rather than run on.
        let expired = store.leases_past_expiry();
        if !expired.is_empty() {
            metrics::counter!("khata_leases_lost_total").increment(expired.len() as u64);
            let stopped = expired.iter().filter(|l| queues.lease_lost(l)).count();
            tracing::warn!(
                leases = expired.len(),
                stopped,
                "leases expired while the store could not be reached to renew them: their attempts are stopped, and their jobs are redelivered once the store answers and the leases are reclaimed"
            );
        }
    }
}

/// Logs a run of failures of one chore once: a warning at the first, a
/// line when it works again with how many failed in between.
struct Outage {
    what: &'static str,
    failures: u64,
    since: Option<std::time::Instant>,
}

impl Outage {
    fn new(what: &'static str) -> Outage {
        Outage {
            what,
            failures: 0,
            since: None,
        }
    }

    fn saw(&mut self, error: Option<&crate::store::StoreError>) {
        match (error, self.since) {
            (Some(e), None) => {
                self.since = Some(std::time::Instant::now());
                self.failures = 1;
                tracing::warn!(error = %e, chore = self.what, "the store is unavailable; retrying every heartbeat (logged once until it answers again)");
            }
            (Some(e), Some(_)) => {
                self.failures += 1;
                tracing::debug!(error = %e, chore = self.what, failures = self.failures, "the store is still unavailable");
            }
            (None, Some(since)) => {
                tracing::info!(chore = self.what, failures = self.failures, after = %humantime::format_duration(Duration::from_millis(u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX))), "the store answers again");
                self.since = None;
                self.failures = 0;
            }
            (None, None) => {}
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the background chores work on; a reload replaces `config` and
/// `outside`.
struct Running {
    config: Config,
    outside: Outside,
    store: Arc<dyn Store>,
    host: Arc<Host>,
    queues: Arc<Queues>,
    schedules: Arc<Schedules>,
}

/// One retention pass; returns how long to wait before the next. Removed
/// rows are counted in `khata_retention_swept_total{kind}` and logged at
/// debug level (a busy daemon sweeps many times a second).
async fn sweep(run: &Running) -> Duration {
    let retention = &run.config.retention;
    let rules = RetentionRules {
        jobs: retention.jobs,
        dead: retention.dead,
        fences: retention.fences,
        tombstones: retention.tombstones,
        kv: retention
            .kv
            .iter()
            .map(|(ns, window)| (ns.clone(), *window))
            .collect(),
    };
    match run.store.sweep(run.queues.now(), &rules, SWEEP_LIMIT).await {
        Ok(s) => {
            let kinds = s.kinds();
            for (kind, n) in kinds {
                if n > 0 {
                    metrics::counter!("khata_retention_swept_total", "kind" => kind).increment(n);
                }
            }
            if kinds.iter().any(|&(_, n)| n > 0) {
                tracing::debug!(
                    jobs = s.jobs,
                    dead_jobs = s.dead_jobs,
                    fences = s.fences,
                    dedup_keys = s.dedup_keys,
                    kv = s.kv,
                    tombstones = s.tombstones,
                    "retention sweep"
                );
            }
            if kinds.iter().any(|&(_, n)| n >= u64::from(SWEEP_LIMIT)) {
                SWEEP_AGAIN
            } else if kinds.iter().any(|&(_, n)| n > 0) {
                SWEEP_BUSY
            } else {
                SWEEP_IDLE
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "retention sweep failed");
            SWEEP_IDLE
        }
    }
}

/// The background chores: plugin changes, configuration reloads, retention,
/// the progress line.
async fn background(
    mut run: Running,
    (loader, mut watch): (Loader, Watch),
    mut hangup: Option<tokio::signal::unix::Signal>,
    shutdown: CancellationToken,
) {
    let mut loader = Some(loader);
    let mut next_sweep = tokio::time::Instant::now();
    let mut progress_tick = tokio::time::interval(Duration::from_secs(5));
    let mut last_completed = 0;
    loop {
        let scan = tokio::select! {
            () = shutdown.cancelled() => return,
            kind = watch.next() => Some(kind),
            Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                match reload(&mut run) {
                    Ok(done) => {
                        if let Some(l) = loader.as_mut() {
                            for name in done.added.iter().chain(&done.reload_plugin) {
                                l.forget(name);
                            }
                        }
                        Some(ScanKind::Full)
                    }
                    Err(e) => {
                        tracing::error!(config = %run.config.path.display(), "configuration reload refused; the running configuration stays: {e}");
                        None
                    }
                }
            }
            () = tokio::time::sleep_until(next_sweep) => {
                next_sweep = tokio::time::Instant::now() + sweep(&run).await;
                None
            }
            _ = progress_tick.tick() => {
                let done = run.queues.completed();
                if done != last_completed {
                    let waiting: u64 = run.store.counts(run.queues.now()).await.map(|c| c.iter().map(|(_, c)| c.waiting + c.delayed).sum()).unwrap_or(0);
                    tracing::info!(completed = done, per_second = (done - last_completed) / 5, waiting, "progress");
                    last_completed = done;
                }
                None
            }
        };
        if let Some(kind) = scan {
            let (config, host, queues) = (
                run.config.clone(),
                Arc::clone(&run.host),
                Arc::clone(&run.queues),
            );
            let mut l = loader.take().unwrap_or_default();
            loader = tokio::task::spawn_blocking(move || {
                l.scan(&config, &host, &queues, kind);
                l
            })
            .await
            .ok();
        }
    }
}

/// SIGHUP: reads jobs.toml again and applies it, or refuses it whole.
fn reload(run: &mut Running) -> Result<Reconfigured, String> {
    let new = Config::load(&run.config.path).map_err(|e| e.to_string())?;
    let path = new.path.display();
    // The instance pool is sized at start.
    let pool = run.host.pool();
    let concurrency: u32 = new.queues.values().map(|q| q.concurrency).sum();
    if concurrency > pool.instances {
        return Err(format!(
            "{path}: the queues' concurrency adds up to {concurrency}, more than the {} attempts at once that this daemon's instance pool was sized for at start; restart khata to apply it",
            pool.instances
        ));
    }
    if let Some(q) = new.queues.values().find(|q| q.memory > pool.max_memory) {
        return Err(format!(
            "{path}: queue {:?}: memory = {} is more than the {} this daemon's instance pool was sized for at start; restart khata to apply it",
            q.name,
            bytesize::ByteSize(q.memory),
            bytesize::ByteSize(pool.max_memory)
        ));
    }
    let plans = Schedules::plans_of(&new).map_err(|e| format!("{path}: schedules: {e}"))?;
    let old = &run.config;
    let outside_now = if new.email != old.email || new.http != old.http {
        Some(outside(&new, Arc::clone(&run.outside.clock)).map_err(|e| e.to_string())?)
    } else {
        None
    };
    for (key, same) in [
        (
            "daemon.data_dir",
            new.daemon.data_dir == old.daemon.data_dir,
        ),
        (
            "daemon.plugins_dir",
            new.daemon.plugins_dir == old.daemon.plugins_dir,
        ),
        ("daemon.listen", new.daemon.listen == old.daemon.listen),
        ("daemon.token", new.daemon.token == old.daemon.token),
        (
            "daemon.shutdown_grace",
            new.daemon.shutdown_grace == old.daemon.shutdown_grace,
        ),
        ("store", new.store == old.store),
    ] {
        if !same {
            tracing::warn!(
                key,
                "changed in jobs.toml; takes effect at the next restart"
            );
        }
    }
    if let Some(o) = outside_now {
        run.outside = o;
    }
    let done = run
        .queues
        .reconfigure(new.queues.values().cloned(), &run.outside);
    for name in &done.reload_plugin {
        if let Some(q) = run.queues.get(name) {
            q.unload_plugin(format!(
                "the configuration changed the queue's plugin or grants; loading plugin {:?} again",
                q.config().plugin
            ));
        }
    }
    run.schedules.install(plans, run.queues.now());
    tracing::info!(
        added = ?done.added,
        changed = ?done.changed,
        removed = ?done.removed,
        schedules = new.schedules.len(),
        "configuration reloaded"
    );
    // What is read at start only stays as it runs.
    let (daemon, store) = (run.config.daemon.clone(), run.config.store.clone());
    run.config = Config {
        daemon,
        store,
        ..new
    };
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::pool_size;
    use crate::config::Config;

    /// Every queue's `concurrency` is reserved in the pool, twice over (a
    /// plugin check and the next version during a swap), with room for 16
    /// more: one queue whose attempts all run holds its own share only.
    #[test]
    fn the_pool_reserves_every_queues_concurrency() {
        let text = "[queues.hog]\nplugin = \"hog\"\nconcurrency = 40\nmemory = \"256MiB\"\n\n\
                    [queues.echo]\nplugin = \"echo\"\nconcurrency = 2\n";
        let config = Config::parse(text, std::path::Path::new("jobs.toml")).unwrap();
        let pool = pool_size(&config);
        assert_eq!(pool.instances, 2 * (40 + 2) + 16);
        assert_eq!(pool.max_memory, 256 << 20);
    }
}
