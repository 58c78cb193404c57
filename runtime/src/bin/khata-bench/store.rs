//! The store's part of figure 6: what the ledger takes on disk with the
//! backlog waiting, and how long the daemon takes to come back on it after
//! `kill -9`.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{Daemon, millis, wait_until};

/// The data directory's entry that is not the ledger (wasmtime's
/// compiled-code cache).
const NOT_THE_LEDGER: &str = "code-cache";

/// The ledger's files in a data directory.
pub struct Disk {
    /// Blocks allocated, in bytes (what the files take on disk).
    pub allocated: u64,
    /// The files' lengths, in bytes (sparse or preallocated files differ).
    pub apparent: u64,
}

impl std::fmt::Display for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0} MiB on disk ({:.0} MiB apparent)",
            self.allocated as f64 / (1 << 20) as f64,
            self.apparent as f64 / (1 << 20) as f64
        )
    }
}

/// What the ledger in `daemon`'s data directory takes: every file under it
/// but the compiled-code cache, whichever backend wrote them.
pub fn ledger_disk(daemon: &Daemon) -> anyhow::Result<Disk> {
    let mut disk = Disk {
        allocated: 0,
        apparent: 0,
    };
    let data = daemon.dir.join("data");
    for entry in std::fs::read_dir(&data).with_context(|| format!("reading {}", data.display()))? {
        let entry = entry?;
        if entry.file_name() != NOT_THE_LEDGER {
            add_tree(&entry.path(), &mut disk)?;
        }
    }
    Ok(disk)
}

fn add_tree(path: &Path, disk: &mut Disk) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).with_context(|| format!("{}", path.display()))?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            add_tree(&entry?.path(), disk)?;
        }
    } else {
        disk.allocated += meta.blocks() * 512;
        disk.apparent += meta.len();
    }
    Ok(())
}

/// How long a restart on the backlog took, from spawning the process.
pub struct Reopen {
    /// Until `GET /healthz` answered.
    pub healthy: Duration,
    /// Until the first job of the backlog was completed: the ledger opened,
    /// recovered and leasing.
    pub first_job: Duration,
}

impl std::fmt::Display for Reopen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "healthy in {}, first backlog job completed in {}",
            millis(self.healthy),
            millis(self.first_job)
        )
    }
}

/// Kills `daemon` with SIGKILL while `queue` holds its backlog (the queue's
/// plugin file `plugin` is absent, so none of it ran), puts `echo` in as
/// that plugin and starts the daemon again on the same ledger; returns
/// when the first job of the backlog completed.
pub async fn reopen(daemon: &mut Daemon, queue: &str, plugin: &str) -> anyhow::Result<Reopen> {
    daemon.kill9()?;
    let plugins = daemon.dir.join("plugins");
    std::fs::copy(
        plugins.join("echo.wasm"),
        plugins.join(format!("{plugin}.wasm")),
    )
    .with_context(|| format!("serving {queue} with echo"))?;
    let spawned = Instant::now();
    daemon.spawn()?;
    daemon.wait_healthy().await?;
    let healthy = spawned.elapsed();
    let api = &daemon.api;
    wait_until(|| api.has_jobs(queue, "completed")).await?;
    Ok(Reopen {
        healthy,
        first_job: spawned.elapsed(),
    })
}
