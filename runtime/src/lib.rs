//! khata: a job runner whose handlers are WebAssembly components and whose
//! side effects happen once.
//!
//! The crate follows the data path of a job, each module depending only on
//! those above it:
//!
//! - [`job`]: the job, its states and attempts — the vocabulary.
//! - [`config`]: `jobs.toml`, parsed with positions for every error.
//! - [`store`]: the ledger trait, its SQLite backend with group commit, its
//!   PostgreSQL backend, and the conformance suite every backend passes.
//! - [`effects`]: what a handler may do to the world (kv, index, log), each
//!   checked against the queue's grants and the attempt's lease.
//! - [`host`]: the wasmtime engine, plugins and their versions, limits, and
//!   the binding of the WIT imports to [`effects`].
//! - [`queue`]: the dispatcher: leasing, running attempts under the queue's
//!   concurrency, backoff, and the attempt's end.
//! - [`schedule`]: `[schedules.NAME]`: cron entries that enqueue a job per
//!   fire time, each under an id that makes it once.
//! - [`plugins`]: the plugin life cycle: watching `plugins_dir`, loading
//!   versions by content hash, grant checks at load time.
//! - [`api`]: the HTTP API (axum): routes, auth, errors, metrics.
//! - [`verify`]: `khata verify`: a handler run clean, cut at every crash
//!   point and redelivered, on throwaway ledgers with recorded providers.
//! - [`scaffold`]: `khata new`: a handler project that builds as it is.
//! - [`daemon`]: `khata serve` and `khata check`: wiring it all together.
//! - [`cli`]: the command line and the API client.

pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod effects;
pub mod failpoints;
pub mod files;
pub mod host;
pub mod job;
pub mod plugins;
pub mod queue;
pub mod scaffold;
pub mod schedule;
pub mod store;
pub mod verify;
