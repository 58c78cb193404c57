//! The WebAssembly host: one engine, compiled plugins, and one fresh store
//! per attempt.
//!
//! - [`Host`] owns the wasmtime [`Engine`] (component model, async, pooling
//!   allocator, epoch interruption) and the [`Linker`] with WASI p2 — granting
//!   nothing: no directories, environment, sockets or name lookup — and the
//!   khata interfaces, bound to [`Effects`].
//! - [`Plugin`] is one compiled, pre-instantiated version of a `.wasm` file,
//!   named by its content hash. An attempt keeps the `Arc<Plugin>` it started
//!   with, so a newer version never changes a running attempt.
//! - Compiled code is cached on disk by wasmtime's own compilation cache
//!   (when [`Host::new`] is given a directory): an entry is keyed by a hash of
//!   the component's bytes and the engine's compilation settings, under a
//!   directory named after the wasmtime version, so a restart (or a file put
//!   back) loads without compiling, and an upgraded wasmtime never reads code
//!   compiled by another.
//! - [`Host::run`] instantiates the plugin in a new store with the queue's
//!   limits and calls `handle`. Whatever the guest does — loop, trap, exhaust
//!   memory, overflow its stack — ends as a [`RunOutcome`]; it never reaches
//!   the daemon.
//!
//! Traps (host faults, limits) are kept apart from the errors a guest sees:
//! effect errors go back to the guest as WIT values, limits end the attempt.

mod bindings;
mod limits;
mod stdio;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Cache, CacheConfig, Config, Enabled, Engine, InstanceAllocationStrategy,
    PoolingAllocationConfig, Store, Trap,
};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

pub use bindings::Capability;
use bindings::{Handler, HandlerPre};
use limits::{AttemptLimits, Deadline};
use stdio::Capture;

use crate::effects::Effects;
use crate::job::Millis;

/// How often the epoch advances: the granularity of `timeout`, and how
/// long a computing guest holds a runtime thread before it yields. 2 ms
/// keeps `/healthz` and enqueue p99 near 10 and 17 ms with eight computing
/// guests on two cores (10 ms gave 49 and 75 ms: bench figure 10); the
/// ticker thread waking 500 times a second costs nothing measurable.
const EPOCH_TICK: Duration = Duration::from_millis(2);
/// Captured guest stdout and stderr, per attempt.
const STDIO_CAPTURE: usize = 16 * 1024;
/// Hex digits of the content hash that name a version to people.
pub const SHORT_VERSION: usize = 12;

/// Why a plugin could not be loaded. The previous version, if any, stays.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin {plugin:?}: cannot read {path}: {error}")]
    Read {
        plugin: String,
        path: String,
        error: std::io::Error,
    },
    #[error("plugin {plugin:?}: not a WebAssembly component: {error}")]
    NotAComponent { plugin: String, error: String },
    #[error("plugin {plugin:?}: does not fit the khata:plugin/handler world: {error}")]
    WrongWorld { plugin: String, error: String },
}

/// Where a plugin's machine code came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeSource {
    /// Compiled now; written to the code cache.
    Compiled,
    /// Read from the code cache: not compiled again.
    Cache,
    /// Compiled now; there is no code cache.
    NoCache,
}

impl CodeSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CodeSource::Compiled => "compiled",
            CodeSource::Cache => "cache",
            CodeSource::NoCache => "compiled (no cache)",
        }
    }
}

/// One compiled version of a plugin.
pub struct Plugin {
    pub name: String,
    /// Hex SHA-256 of the `.wasm` file.
    pub version: String,
    pub loaded_at: Millis,
    /// The khata interfaces the component imports.
    pub imports: BTreeSet<Capability>,
    /// Whether the code was compiled or read from the code cache.
    pub code: CodeSource,
    pre: HandlerPre<AttemptState>,
}

impl Plugin {
    /// The version as people see it: the first hex digits of the hash.
    pub fn short_version(&self) -> &str {
        short_version(&self.version)
    }
}

/// The first [`SHORT_VERSION`] hex digits of a content hash.
pub fn short_version(hash: &str) -> &str {
    &hash[..SHORT_VERSION.min(hash.len())]
}

/// The content hash (hex SHA-256) that names a version of a plugin file.
pub fn content_hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("imports", &self.imports)
            .field("code", &self.code)
            .finish_non_exhaustive()
    }
}

/// The limits of one attempt (from the queue's configuration).
#[derive(Clone, Debug)]
pub struct Limits {
    pub timeout: Duration,
    pub memory: u64,
    pub max_result: u64,
    /// Bytes of `log` output kept per attempt; the rest is dropped with a note.
    pub log_bytes: usize,
    /// Lines of `log` output kept per attempt; the rest is dropped with a note.
    pub log_lines: usize,
}

/// The job as the handler sees it.
#[derive(Clone, Debug)]
pub struct JobInput {
    pub id: String,
    pub queue: String,
    pub payload: String,
    pub attempt: u32,
    pub max_attempts: u32,
    pub enqueued_at: Millis,
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum RunOutcome {
    /// The handler returned this JSON text.
    Ok(String),
    /// The handler asked to retry.
    Retry(String),
    /// The handler failed permanently, or one of its effects asked for the
    /// job to be dead-lettered (`on_uncertain = "dead"`).
    Fail(String),
    /// The guest trapped or broke a limit other than time.
    Trap(String),
    /// The attempt ran out of time.
    Timeout(String),
}

/// The data of one attempt's store.
pub struct AttemptState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: AttemptLimits,
    effects: Effects,
    log: LogBudget,
}

impl WasiView for AttemptState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Tags and bounds the `log` output of one attempt: at most `left` bytes and
/// `lines_left` lines (so that empty messages cannot flood the log either);
/// past either, messages are counted and dropped.
struct LogBudget {
    job_id: String,
    queue: String,
    attempt: u32,
    version: String,
    left: usize,
    lines_left: usize,
    truncated: bool,
    dropped_messages: u64,
    dropped_bytes: u64,
}

/// The engine and linker shared by every attempt.
pub struct Host {
    engine: Engine,
    linker: Linker<AttemptState>,
    ticker_stop: Arc<AtomicBool>,
    /// The compilation cache, kept for its hit counter.
    cache: Option<Cache>,
    /// The pool's sizes, fixed for the life of the engine.
    pool: PoolSize,
    safeguards: Safeguards,
}

/// The per-attempt limits enforced inside wasmtime. Both are on in the
/// daemon: a queue's `timeout` relies on epoch interruption while the guest
/// computes, and its `memory` on the store limiter. Turning one off is only
/// for measuring what it costs (`khata-bench`, figure 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Safeguards {
    pub epoch_interruption: bool,
    pub store_limits: bool,
}

impl Default for Safeguards {
    fn default() -> Safeguards {
        Safeguards {
            epoch_interruption: true,
            store_limits: true,
        }
    }
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host").finish_non_exhaustive()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

/// Sizes of the instance pool.
#[derive(Clone, Debug)]
pub struct PoolSize {
    /// Instances alive at once (the sum of the queues' concurrency, plus room).
    pub instances: u32,
    /// The largest linear memory any queue allows.
    pub max_memory: u64,
}

impl Host {
    /// The engine, with wasmtime's compilation cache in `code_cache` if
    /// given (created if missing). A cache that cannot be set up is logged
    /// and left out: plugins are then compiled at every load.
    pub fn new(pool: &PoolSize, code_cache: Option<&Path>) -> anyhow::Result<Host> {
        Host::with_safeguards(pool, code_cache, Safeguards::default())
    }

    /// [`Host::new`], with the given safeguards (see [`Safeguards`]: the
    /// daemon never turns them off).
    pub fn with_safeguards(
        pool: &PoolSize,
        code_cache: Option<&Path>,
        safeguards: Safeguards,
    ) -> anyhow::Result<Host> {
        let mut config = Config::new();
        let cache = code_cache.and_then(|dir| match open_cache(dir) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %format!("{e:#}"), "the compiled-code cache is not available; plugins are compiled at every load");
                None
            }
        });
        config.cache(cache.clone());
        config.wasm_component_model(true);
        config.epoch_interruption(safeguards.epoch_interruption);
        config.max_wasm_stack(512 * 1024);
        let mut pooling = PoolingAllocationConfig::new();
        let instances = pool.instances.max(16);
        pooling
            .total_component_instances(instances)
            // Every slot can hold as many core instances, memories and
            // tables as one attempt may create (limits.rs), so that one
            // queue's guests cannot take the pool's slots from another's.
            .total_core_instances(instances * limits::INSTANCES as u32)
            .total_memories(instances * limits::MEMORIES as u32)
            .total_tables(instances * limits::TABLES as u32)
            .total_stacks(instances)
            .max_memories_per_component(limits::MEMORIES as u32)
            .max_tables_per_component(limits::TABLES as u32)
            .max_core_instances_per_component(limits::INSTANCES as u32)
            .max_memory_size(usize::try_from(pool.max_memory).unwrap_or(usize::MAX))
            // Reusing a slot resets its memory; keeping the first MiB resident
            // (zeroed with memset instead of madvise) and letting the kernel
            // report which pages were touched makes that reset cost
            // proportional to what the last attempt dirtied.
            .linear_memory_keep_resident(1 << 20)
            .table_keep_resident(1 << 16)
            .pagemap_scan(Enabled::Auto);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
        let engine = Engine::new(&config)?;

        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        Handler::add_to_linker::<AttemptState, HasSelf<AttemptState>>(&mut linker, |s| s)?;

        let ticker_stop = Arc::new(AtomicBool::new(false));
        let weak: Weak<AtomicBool> = Arc::downgrade(&ticker_stop);
        let ticking = engine.clone();
        std::thread::Builder::new()
            .name("khata-epoch".into())
            .spawn(move || {
                while let Some(stop) = weak.upgrade() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    drop(stop);
                    std::thread::sleep(EPOCH_TICK);
                    ticking.increment_epoch();
                }
            })?;
        Ok(Host {
            engine,
            linker,
            ticker_stop,
            cache,
            pool: pool.clone(),
            safeguards,
        })
    }

    /// The instance pool's sizes, set at start.
    pub fn pool(&self) -> &PoolSize {
        &self.pool
    }

    /// Reads and compiles `path` as plugin `name`.
    pub fn load_file(&self, name: &str, path: &Path) -> Result<Plugin, LoadError> {
        let bytes = std::fs::read(path).map_err(|error| LoadError::Read {
            plugin: name.to_owned(),
            path: path.display().to_string(),
            error,
        })?;
        self.load(name, &bytes)
    }

    /// Compiles `bytes` as plugin `name` and checks that it fits the world.
    /// Loads are expected one at a time (the plugin watcher's thread): the
    /// code cache's hit counter tells whether this one was compiled.
    pub fn load(&self, name: &str, bytes: &[u8]) -> Result<Plugin, LoadError> {
        let version = content_hash(bytes);
        let not_a_component = |error: String| LoadError::NotAComponent {
            plugin: name.to_owned(),
            error,
        };
        if bytes.starts_with(b"\0asm") && bytes.get(4..8) == Some(&[1u8, 0, 0, 0][..]) {
            return Err(not_a_component(
                "it is a core WebAssembly module; build it for wasm32-wasip2 \
                 (or wrap it with `wasm-tools component new`)"
                    .into(),
            ));
        }
        let hits = self.cache.as_ref().map(Cache::cache_hits);
        let component =
            Component::new(&self.engine, bytes).map_err(|e| not_a_component(format!("{e:#}")))?;
        let code = match (&self.cache, hits) {
            (Some(c), Some(before)) if c.cache_hits() > before => CodeSource::Cache,
            (Some(_), _) => CodeSource::Compiled,
            _ => CodeSource::NoCache,
        };
        let wrong_world = |e: wasmtime::Error| LoadError::WrongWorld {
            plugin: name.to_owned(),
            error: format!("{e:#}"),
        };
        let imports = component
            .component_type()
            .imports(&self.engine)
            .filter_map(|(import, _)| Capability::from_import(import))
            .collect();
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(wrong_world)?;
        let pre = HandlerPre::new(pre).map_err(wrong_world)?;
        Ok(Plugin {
            name: name.to_owned(),
            version,
            loaded_at: Millis::now(),
            imports,
            code,
            pre,
        })
    }

    /// Runs one attempt of `job` on `plugin`.
    pub async fn run(
        &self,
        plugin: &Plugin,
        job: JobInput,
        effects: Effects,
        limits: &Limits,
    ) -> RunOutcome {
        let stdout = Capture::new(STDIO_CAPTURE);
        let stderr = Capture::new(STDIO_CAPTURE);
        let wasi = WasiCtx::builder()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .build();
        let state = AttemptState {
            wasi,
            table: ResourceTable::new(),
            limits: AttemptLimits::new(limits.memory),
            effects,
            log: LogBudget {
                job_id: job.id.clone(),
                queue: job.queue.clone(),
                attempt: job.attempt,
                version: plugin.version.clone(),
                left: limits.log_bytes,
                lines_left: limits.log_lines,
                truncated: false,
                dropped_messages: 0,
                dropped_bytes: 0,
            },
        };
        let mut store = Store::new(&self.engine, state);
        if self.safeguards.store_limits {
            store.limiter(|s| &mut s.limits);
        }
        if self.safeguards.epoch_interruption {
            // At every tick a computing guest yields its worker thread (the
            // runtime's two threads also serve the API, heartbeats and the
            // watchdog), and past the timeout it is interrupted.
            let deadline = Deadline::after(limits.timeout);
            store.set_epoch_deadline(1);
            store.epoch_deadline_callback(move |_| Ok(deadline.update()));
        }

        let wit_job = bindings::Job {
            id: job.id.clone(),
            queue: job.queue.clone(),
            payload: job.payload,
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            enqueued_at_ms: u64::try_from(job.enqueued_at.0).unwrap_or(0),
        };
        let call = async {
            let handler: Handler = plugin.pre.instantiate_async(&mut store).await?;
            handler.call_handle(&mut store, &wit_job).await
        };
        // The epoch stops a guest that computes; this stops one that waits in
        // a host call.
        let outcome = match tokio::time::timeout(limits.timeout + EPOCH_TICK * 2, call).await {
            Err(_) => RunOutcome::Timeout(timeout_message(limits.timeout)),
            Ok(Ok(Ok(result))) => {
                if result.len() as u64 > limits.max_result {
                    RunOutcome::Trap(format!(
                        "result is {} bytes, more than max_result ({} bytes)",
                        result.len(),
                        limits.max_result
                    ))
                } else if serde_json::from_str::<serde_json::Value>(&result).is_err() {
                    RunOutcome::Fail(format!(
                        "result is not JSON: {:?}",
                        result.chars().take(100).collect::<String>()
                    ))
                } else {
                    RunOutcome::Ok(result)
                }
            }
            Ok(Ok(Err(bindings::JobError::Retry(reason)))) => RunOutcome::Retry(guest_text(reason)),
            Ok(Ok(Err(bindings::JobError::Fail(reason)))) => RunOutcome::Fail(guest_text(reason)),
            Ok(Err(trap)) => match classify_trap(&trap, limits, &stderr.contents().0) {
                RunOutcome::Trap(text) => RunOutcome::Trap(guest_text(text)),
                other => other,
            },
        };
        // An effect whose outcome is unknown under `on_uncertain = "dead"`
        // ends the attempt for a person to look at, whatever the handler
        // did next.
        let outcome = match store.data().effects.dead_letter() {
            Some(reason) => RunOutcome::Fail(reason.to_owned()),
            None => outcome,
        };
        let log = &store.data().log;
        if log.truncated {
            tracing::warn!(
                job = %job.id, queue = %job.queue, attempt = job.attempt, plugin = %plugin.name,
                dropped_messages = log.dropped_messages, dropped_bytes = log.dropped_bytes,
                "log output of this attempt was truncated: {} messages ({} bytes) dropped past the per-attempt budget of {} bytes or {} lines",
                log.dropped_messages, log.dropped_bytes, limits.log_bytes, limits.log_lines
            );
        }
        drop(store);
        log_stdio(&job.id, job.attempt, &plugin.name, "stdout", &stdout);
        log_stdio(&job.id, job.attempt, &plugin.name, "stderr", &stderr);
        outcome
    }
}

/// The most of a guest's retry or fail reason that is kept in the ledger.
pub const MAX_REASON: usize = 4096;

/// Text from a guest (its retry or fail reason, or a trap's message with
/// its stderr) as the ledger keeps it: at most [`MAX_REASON`] bytes (cut at a
/// character boundary, with the number of bytes dropped said), and no NUL
/// character (replaced by U+FFFD, which every backend's text takes).
fn guest_text(reason: String) -> String {
    let mut reason = if reason.contains('\0') {
        reason.replace('\0', "\u{FFFD}")
    } else {
        reason
    };
    if reason.len() > MAX_REASON {
        let cut = reason.floor_char_boundary(MAX_REASON);
        let dropped = reason.len() - cut;
        reason.truncate(cut);
        reason.push_str(&format!("… ({dropped} more bytes dropped)"));
    }
    reason
}

/// wasmtime's compilation cache in `dir`, made absolute (wasmtime requires it).
fn open_cache(dir: &Path) -> anyhow::Result<Cache> {
    std::fs::create_dir_all(dir)?;
    let dir = std::path::absolute(dir)?;
    let mut config = CacheConfig::new();
    config.with_directory(dir);
    Ok(Cache::new(config)?)
}

fn timeout_message(timeout: Duration) -> String {
    format!(
        "timeout: the attempt ran longer than the queue's timeout of {}",
        humantime::format_duration(timeout)
    )
}

/// Turns a wasmtime error into a clear attempt error.
fn classify_trap(err: &wasmtime::Error, limits: &Limits, stderr: &[u8]) -> RunOutcome {
    let panic = String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(3)
        .collect::<Vec<_>>()
        .join(" | ");
    let with_panic = |msg: String| {
        if panic.is_empty() {
            msg
        } else {
            format!("{msg}; guest stderr: {panic}")
        }
    };
    match err.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => RunOutcome::Timeout(timeout_message(limits.timeout)),
        Some(Trap::StackOverflow) => RunOutcome::Trap(with_panic(
            "trap: wasm stack overflow (recursion too deep)".into(),
        )),
        Some(trap) => RunOutcome::Trap(with_panic(format!("trap: {trap}"))),
        None => {
            let text = format!("{err:#}");
            if text.contains("forcing trap when growing memory")
                || text.contains("memory") && text.contains("limit")
            {
                RunOutcome::Trap(format!(
                    "memory limit: the guest tried to grow its memory past the queue's memory limit of {} ({text})",
                    bytesize::ByteSize(limits.memory)
                ))
            } else {
                RunOutcome::Trap(with_panic(format!("trap: {text}")))
            }
        }
    }
}

fn log_stdio(job_id: &str, attempt: u32, plugin: &str, stream: &str, capture: &Capture) {
    let (bytes, dropped) = capture.contents();
    for line in String::from_utf8_lossy(&bytes).lines() {
        tracing::info!(job = job_id, attempt, plugin, stream, "{line}");
    }
    if dropped > 0 {
        tracing::warn!(
            job = job_id,
            attempt,
            plugin,
            stream,
            dropped,
            "guest output truncated past {STDIO_CAPTURE} bytes"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::limits::{self, AttemptLimits};
    use super::{Host, MAX_REASON, PoolSize, guest_text};
    use wasmtime::Store;
    use wasmtime::component::{Component, Linker};

    /// A component of the largest shape an attempt may take: every core
    /// instance, memory and table [`limits`] allows one attempt.
    fn largest_component() -> String {
        let mut wat = String::from(
            "(component\n (core module $mem (memory 1))\n (core module $tab (table 1 funcref))\n (core module $none)\n",
        );
        let plain = limits::INSTANCES - limits::MEMORIES - limits::TABLES;
        for (module, n) in [
            ("$mem", limits::MEMORIES),
            ("$tab", limits::TABLES),
            ("$none", plain),
        ] {
            for _ in 0..n {
                wat.push_str(&format!(" (core instance (instantiate {module}))\n"));
            }
        }
        wat.push(')');
        wat
    }

    /// The pool has one slot per attempt whatever the attempt's shape: a
    /// pool of N slots holds N attempts of the largest shape at once, and
    /// the next one is refused for want of a component slot, not of
    /// memories or core instances. So a queue whose guests hold several
    /// memories takes no more of the pool than its `concurrency`, and the
    /// daemon reserves every queue's share (`daemon::pool_size`).
    #[tokio::test]
    async fn a_pool_slot_holds_the_largest_attempt_so_no_queue_takes_another_queues_slots() {
        let host = Host::new(
            &PoolSize {
                instances: 16,
                max_memory: 1 << 20,
            },
            None,
        )
        .unwrap();
        let component = Component::new(&host.engine, largest_component()).unwrap();
        let linker = Linker::<AttemptLimits>::new(&host.engine);
        let mut alive = Vec::new();
        for n in 0..16 {
            let mut store = Store::new(&host.engine, AttemptLimits::new(64 << 20));
            store.limiter(|l| l);
            if let Err(e) = linker.instantiate_async(&mut store, &component).await {
                panic!("attempt {} of 16 did not fit: {e:#}", n + 1);
            }
            alive.push(store);
        }
        let mut store = Store::new(&host.engine, AttemptLimits::new(64 << 20));
        store.limiter(|l| l);
        let refused = linker
            .instantiate_async(&mut store, &component)
            .await
            .err()
            .map(|e| format!("{e:#}"))
            .expect("a 17th attempt found a slot in a pool of 16");
        assert!(
            refused.contains("maximum concurrent limit of 16 for component instances"),
            "{refused}"
        );
        drop(alive);
        // A slot comes back when its attempt ends.
        let mut store = Store::new(&host.engine, AttemptLimits::new(64 << 20));
        store.limiter(|l| l);
        linker
            .instantiate_async(&mut store, &component)
            .await
            .unwrap();
    }

    #[test]
    fn a_guest_reason_is_bounded_at_a_character_boundary_and_loses_its_nuls() {
        assert_eq!(guest_text("card\0declined".into()), "card\u{FFFD}declined");
        assert_eq!(guest_text("short".into()), "short");
        // 'é' is two bytes: a cut in its middle moves back before it.
        let long = format!("{}é{}", "x".repeat(MAX_REASON - 1), "y".repeat(10));
        let kept = guest_text(long.clone());
        assert!(kept.starts_with(&"x".repeat(MAX_REASON - 1)));
        assert!(
            kept.ends_with(&format!(
                "… ({} more bytes dropped)",
                long.len() - (MAX_REASON - 1)
            )),
            "{kept:.50}…"
        );
        assert!(!kept.contains('é'));
    }
}
