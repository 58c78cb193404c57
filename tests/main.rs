//! The integration tests: one binary that runs the real `khata` daemon
//! (`CARGO_BIN_EXE_khata`) on real ledgers, SMTP and HTTP servers. One
//! module per concern; `support` starts daemons and `servers` the peers.
//! One binary links the daemon and its dependencies once instead of once
//! per file.

mod servers;
mod support;

mod api_guard;
mod api_limits;
mod api_props;
mod bad_input;
mod crash;
mod dashboard;
mod dedup;
mod disk_full;
mod effects;
#[cfg(feature = "failpoints")]
mod failpoints;
mod hostile;
mod jobs;
mod long_guests;
mod multi_daemon;
mod ops;
mod pg_outage;
mod plugins;
mod postgres;
mod retention;
mod schedules;
mod sdks;
mod store_copy;
mod verify;
