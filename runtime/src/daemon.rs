//! `khata serve` and `khata check`: the wiring of config, store, host,
//! queues and API.
//!
//! Start-up order: read jobs.toml, open the ledger (taking its lock), recover
//! the attempts a crash left active, load plugins, start the dispatchers,
//! listen. Shutdown (SIGTERM, SIGINT): stop listening and leasing, give the
//! attempts in flight `shutdown_grace`, interrupt the rest (their jobs go back
//! to waiting, uncounted), and close the ledger.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::api::{self, AppState};
use crate::config::{Backend, Config, Grants, Queue};
use crate::effects::email::Mailer;
use crate::effects::http::Providers;
use crate::host::{Capability, Host, Plugin, PoolSize};
use crate::job::Millis;
use crate::queue::{Clock, Outside, Queues, Stop};
use crate::schedule::Schedules;
use crate::store::Store;
use crate::store::sqlite::SqliteStore;

/// How often the plugins directory is looked at for new or changed files.
const PLUGIN_POLL: Duration = Duration::from_secs(2);
/// How often the retention sweep runs, and the most rows it removes per pass.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
const SWEEP_LIMIT: u32 = 1000;

/// Runs the daemon until SIGTERM or SIGINT.
pub fn serve(config_path: &Path) -> anyhow::Result<()> {
    init_tracing();
    let config = Config::load(config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("khata")
        .build()?;
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
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
    let host = Host::new(&pool_size(&config))?;
    let mut ok = true;
    if let Err(e) = check_supported(&config) {
        eprintln!("{e}");
        ok = false;
    }
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
                &p.version[..12]
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
        .with_writer(std::io::stderr);
    let _ = if std::env::var("KHATA_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

fn plugin_path(config: &Config, q: &Queue) -> PathBuf {
    config.daemon.plugins_dir.join(format!("{}.wasm", q.plugin))
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

/// Whether the queue's grants cover every khata interface the plugin imports.
pub fn check_grants(q: &Queue, plugin: &Plugin) -> Result<(), String> {
    let missing: Vec<String> = plugin
        .imports
        .iter()
        .filter(|c| !granted(&q.grants, **c))
        .map(|c| c.interface())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "plugin {:?} imports {} but queue {:?} is not granted {}",
            q.plugin,
            missing.join(", "),
            q.name,
            if missing.len() == 1 { "it" } else { "them" }
        ))
    }
}

fn granted(g: &Grants, c: Capability) -> bool {
    match c {
        Capability::Kv => g.kv,
        Capability::Index => !g.index.is_empty(),
        Capability::Email => g.email,
        Capability::Http => !g.http.is_empty(),
        Capability::Log => true,
    }
}

/// Refuses a configuration this build cannot serve as written, rather than
/// silently serving something else.
fn check_supported(config: &Config) -> Result<(), String> {
    if config.store.backend != Backend::Sqlite {
        return Err(format!(
            "{}: store.backend = {:?} is not available in this build of khata; use \"sqlite\"",
            config.path.display(),
            config.store.backend.as_str()
        ));
    }
    Ok(())
}

/// Builds the email transport and HTTP providers. A bad provider stops the
/// start; an email transport that cannot be set up only fails the queues
/// that send email.
fn outside(config: &Config) -> anyhow::Result<Outside> {
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
    })
}

async fn run(config: Config) -> anyhow::Result<()> {
    check_supported(&config).map_err(|e| anyhow::anyhow!(e))?;
    let data_dir = &config.daemon.data_dir;
    let store: Arc<dyn Store> = Arc::new(
        SqliteStore::open(data_dir)
            .with_context(|| format!("opening the ledger in {}", data_dir.display()))?,
    );
    let recovered = store.recover(Millis::now()).await?;
    if recovered > 0 {
        tracing::warn!(
            jobs = recovered,
            "recovered jobs whose attempts were abandoned by the previous run"
        );
    }
    let host = Arc::new(Host::new(&pool_size(&config))?);
    let queues = Arc::new(Queues::new(
        Arc::clone(&store),
        Arc::clone(&host),
        clock(),
        config.queues.values().cloned(),
        &outside(&config)?,
    ));
    let mut watcher = PluginWatcher::default();
    watcher.poll(&config, &host, &queues);

    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| tracing::warn!(error = %e, "metrics recorder not installed"))
        .ok();
    let schedules =
        Arc::new(Schedules::new(&config).map_err(|e| anyhow::anyhow!("schedules: {e}"))?);
    let state = AppState {
        store: Arc::clone(&store),
        queues: Arc::clone(&queues),
        schedules: Arc::clone(&schedules),
        token: config.daemon.token.as_deref().map(Arc::from),
        metrics,
    };
    let listener = tokio::net::TcpListener::bind(config.daemon.listen)
        .await
        .with_context(|| format!("listening on {} (daemon.listen)", config.daemon.listen))?;
    tracing::info!(listen = %config.daemon.listen, data_dir = %data_dir.display(), queues = config.queues.len(), "khata is serving");

    let stop = Stop::default();
    let shutdown = CancellationToken::new();
    let dispatcher = tokio::spawn(Arc::clone(&queues).run(stop.clone()));
    let scheduler = tokio::spawn(Arc::clone(&schedules).run(
        Arc::clone(&store),
        Arc::clone(&queues),
        shutdown.clone(),
    ));
    let api_shutdown = shutdown.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, api::router(state))
            .with_graceful_shutdown(async move { api_shutdown.cancelled().await })
            .await
    });
    let background = tokio::spawn(background(
        config.clone(),
        Arc::clone(&store),
        Arc::clone(&host),
        Arc::clone(&queues),
        watcher,
        shutdown.clone(),
    ));

    wait_for_signal().await;
    tracing::info!(grace = %humantime::format_duration(config.daemon.shutdown_grace), "shutting down: draining attempts in flight");
    shutdown.cancel();
    stop.drain.cancel();
    let mut dispatcher = dispatcher;
    tokio::select! {
        _ = &mut dispatcher => {}
        () = tokio::time::sleep(config.daemon.shutdown_grace) => {
            tracing::warn!("grace is over: interrupting the attempts still running");
            stop.interrupt.cancel();
            let _ = dispatcher.await;
        }
    }
    let _ = server.await;
    let _ = scheduler.await;
    background.abort();
    tracing::info!("stopped");
    Ok(())
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

/// The periodic chores: plugin changes, retention, the progress line.
async fn background(
    config: Config,
    store: Arc<dyn Store>,
    host: Arc<Host>,
    queues: Arc<Queues>,
    mut watcher: PluginWatcher,
    shutdown: CancellationToken,
) {
    let mut plugin_tick = tokio::time::interval(PLUGIN_POLL);
    let mut sweep_tick = tokio::time::interval(SWEEP_EVERY);
    let mut progress_tick = tokio::time::interval(Duration::from_secs(5));
    let mut last_completed = 0;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = plugin_tick.tick() => {
                let (config, host, queues) = (config.clone(), Arc::clone(&host), Arc::clone(&queues));
                watcher = tokio::task::spawn_blocking(move || { watcher.poll(&config, &host, &queues); watcher })
                    .await
                    .unwrap_or_default();
            }
            _ = sweep_tick.tick() => {
                match store.sweep(Millis::now(), config.retention.jobs, config.retention.fences, SWEEP_LIMIT).await {
                    Ok(s) if s.jobs + s.fences + s.dedup_keys > 0 => tracing::info!(jobs = s.jobs, fences = s.fences, dedup_keys = s.dedup_keys, "retention sweep"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "retention sweep failed"),
                }
            }
            _ = progress_tick.tick() => {
                let done = queues.completed();
                if done != last_completed {
                    let waiting: u64 = store.counts(Millis::now()).await.map(|c| c.iter().map(|(_, c)| c.waiting + c.delayed).sum()).unwrap_or(0);
                    tracing::info!(completed = done, per_second = (done - last_completed) / 5, waiting, "progress");
                    last_completed = done;
                }
            }
        }
    }
}

/// Loads each queue's plugin when its file appears or changes.
#[derive(Default)]
struct PluginWatcher {
    /// (modified, length) of each plugin file as last loaded or refused.
    seen: HashMap<PathBuf, Option<(SystemTime, u64)>>,
}

impl PluginWatcher {
    fn poll(&mut self, config: &Config, host: &Host, queues: &Queues) {
        let mut loaded: HashMap<PathBuf, Result<Arc<Plugin>, String>> = HashMap::new();
        for q in config.queues.values() {
            let path = plugin_path(config, q);
            let stamp = std::fs::metadata(&path)
                .ok()
                .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
            let Some(rt) = queues.get(&q.name) else {
                continue;
            };
            if self.seen.get(&path).is_some_and(|s| *s == stamp) {
                continue;
            }
            let result = match stamp {
                None => Err(format!(
                    "plugin file {} is missing; the queue's jobs wait until it appears",
                    path.display()
                )),
                Some(_) => loaded
                    .entry(path.clone())
                    .or_insert_with(|| {
                        host.load_file(&q.plugin, &path)
                            .map(Arc::new)
                            .map_err(|e| e.to_string())
                    })
                    .clone(),
            };
            let result = result.and_then(|p| check_grants(q, &p).map(|()| p));
            match &result {
                Ok(p) => {
                    tracing::info!(queue = %q.name, plugin = %q.plugin, version = &p.version[..12], "plugin loaded")
                }
                Err(e) => {
                    tracing::error!(queue = %q.name, error = %e, "plugin refused; the previous version, if any, keeps serving")
                }
            }
            rt.set_plugin(result);
        }
        for q in config.queues.values() {
            let path = plugin_path(config, q);
            let stamp = std::fs::metadata(&path)
                .ok()
                .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
            self.seen.insert(path, stamp);
        }
    }
}

/// The system clock; in `failpoints` builds one that tests can move forward
/// (`POST /v1/test/clock`).
fn clock() -> Arc<dyn Clock> {
    #[cfg(feature = "failpoints")]
    return Arc::new(crate::queue::MovableClock::default());
    #[cfg(not(feature = "failpoints"))]
    Arc::new(crate::queue::SystemClock)
}
