//! The plugin life cycle: which version of its plugin each queue runs, when
//! a file in `plugins_dir` changed, and what a queue shows while it has none.
//!
//! - [`Loader::scan`] looks at every queue's `<plugins_dir>/<plugin>.wasm`.
//!   A file whose content hash differs from the one last tried for the queue
//!   is compiled (once per scan, whatever the number of queues using it),
//!   checked against each queue's grants and installed with
//!   [`QueueRuntime::set_plugin`](crate::queue::QueueRuntime::set_plugin).
//!   A refused file (not a component, not the khata world, an import the
//!   queue is not granted) leaves the running version in place and shows the
//!   error in `GET /v1/queues`; so does a file that disappears. A queue that
//!   never had a version holds its jobs until one loads.
//! - [`Watch`] says when to scan: on `notify` events in `plugins_dir`, once
//!   they have been quiet for [`DEBOUNCE`] (a file written in several steps
//!   is read whole; an atomic rename is one event); or, only when the
//!   watcher cannot start, every [`FALLBACK_POLL`], by modification time and
//!   size. A `plugins_dir` that is a symbolic link (`current -> releases/N`)
//!   is watched through its target, and switching the link to another
//!   target is noticed as well: the new target is watched and scanned.
//!
//! Versions are named by the SHA-256 of the file. Attempts hold the
//! `Arc<Plugin>` they started with, so a swap never changes one in flight.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use tokio::sync::mpsc;

use crate::config::{Config, Grants, Queue};
use crate::host::{Capability, Host, Plugin, content_hash};
use crate::queue::Queues;

/// How long `plugins_dir` must be quiet before a scan.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// A directory that never stops changing is scanned at least this often.
const DEBOUNCE_MAX: Duration = Duration::from_secs(2);
/// How often the directory is scanned when `notify` cannot watch it.
pub const FALLBACK_POLL: Duration = Duration::from_secs(2);

/// Where a queue's plugin file is.
pub fn plugin_path(config: &Config, q: &Queue) -> PathBuf {
    config.daemon.plugins_dir.join(format!("{}.wasm", q.plugin))
}

/// Whether the queue's grants cover every khata interface the plugin imports.
/// The error names the plugin, the interfaces and the queue.
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
    g.everything
        || match c {
            Capability::Kv => g.kv,
            Capability::Index => !g.index.is_empty(),
            Capability::Email => g.email,
            Capability::Http => !g.http.is_empty(),
            Capability::Log => true,
        }
}

/// How much of each file a scan looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanKind {
    /// Read and hash every plugin file (after `notify` events).
    Full,
    /// Read only files whose modification time or size changed (polling).
    Changed,
}

/// What a queue's plugin file looked like when last scanned.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    /// (modified, length); `None` when the file was missing.
    stamp: Option<(SystemTime, u64)>,
    /// The content hash last tried (loaded or refused); `None` when missing
    /// or unreadable.
    hash: Option<String>,
}

/// Loads each queue's plugin when its file appears or changes.
#[derive(Debug, Default)]
pub struct Loader {
    /// By queue name.
    seen: HashMap<String, Seen>,
}

impl Loader {
    /// Forgets what was seen for `queue`, so that the next scan loads its
    /// plugin again (a queue added or changed by a configuration reload).
    pub fn forget(&mut self, queue: &str) {
        self.seen.remove(queue);
    }

    /// Looks at every queue's plugin file and installs what changed. Blocks
    /// while compiling: call it off the async threads.
    pub fn scan(&mut self, config: &Config, host: &Host, queues: &Queues, kind: ScanKind) {
        // One read and one compile per file and scan, whatever the number of
        // queues that use it.
        let mut files: HashMap<PathBuf, FileNow> = HashMap::new();
        self.seen.retain(|name, _| config.queues.contains_key(name));
        for q in config.queues.values() {
            let Some(rt) = queues.get(&q.name) else {
                continue;
            };
            let path = plugin_path(config, q);
            let stamp = stamp(&path);
            let before = self.seen.get(&q.name);
            if kind == ScanKind::Changed && before.is_some_and(|s| s.stamp == stamp) {
                continue;
            }
            let now = files
                .entry(path.clone())
                .or_insert_with(|| FileNow::read(&path, stamp));
            let hash = now.hash.clone();
            if before.is_some_and(|s| s.hash == hash && (hash.is_some() || s.stamp == stamp)) {
                // Same content as last tried (a touch, or another queue's
                // event), or still missing.
                self.seen.insert(q.name.clone(), Seen { stamp, hash });
                continue;
            }
            let result = match &now.content {
                Content::Missing => {
                    let running = rt.plugin().plugin;
                    Err(match running {
                        Some(p) => format!(
                            "plugin file {} is missing; version {} keeps serving until it is back",
                            path.display(),
                            p.short_version()
                        ),
                        None => format!(
                            "plugin file {} is missing; the queue's jobs wait until it appears",
                            path.display()
                        ),
                    })
                }
                Content::Unreadable(e) => Err(format!(
                    "plugin {:?}: cannot read {}: {e}",
                    q.plugin,
                    path.display()
                )),
                Content::Bytes(bytes) => now
                    .loaded
                    .get_or_insert_with(|| {
                        host.load(&q.plugin, bytes)
                            .map(Arc::new)
                            .map_err(|e| e.to_string())
                    })
                    .clone()
                    .and_then(|p| check_grants(q, &p).map(|()| p)),
            };
            match &result {
                Ok(p) => tracing::info!(
                    queue = %q.name,
                    plugin = %q.plugin,
                    version = p.short_version(),
                    code = p.code.as_str(),
                    "plugin loaded"
                ),
                Err(e) => {
                    let serving = rt.plugin().plugin.map(|p| p.short_version().to_owned());
                    tracing::error!(
                        queue = %q.name,
                        plugin = %q.plugin,
                        serving = serving.as_deref().unwrap_or("nothing"),
                        error = %e,
                        "plugin refused; the previous version, if any, keeps serving"
                    );
                }
            }
            rt.set_plugin(result);
            self.seen.insert(q.name.clone(), Seen { stamp, hash });
        }
    }
}

/// One plugin file as read by the current scan.
struct FileNow {
    content: Content,
    hash: Option<String>,
    /// The file compiled, once the first queue needed it.
    loaded: Option<Result<Arc<Plugin>, String>>,
}

enum Content {
    Missing,
    Unreadable(String),
    Bytes(Vec<u8>),
}

impl FileNow {
    fn read(path: &Path, stamp: Option<(SystemTime, u64)>) -> FileNow {
        let content = match std::fs::read(path) {
            Ok(bytes) => Content::Bytes(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound || stamp.is_none() => {
                Content::Missing
            }
            Err(e) => Content::Unreadable(e.to_string()),
        };
        let hash = match &content {
            Content::Bytes(b) => Some(content_hash(b)),
            _ => None,
        };
        FileNow {
            content,
            hash,
            loaded: None,
        }
    }
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()))
}

/// When to scan `plugins_dir`: on its `notify` events, or by polling while
/// the watcher cannot run (the directory does not exist yet, or was removed
/// or renamed). Each poll also tries to watch again.
#[derive(Debug)]
pub struct Watch {
    dir: PathBuf,
    /// The watcher (kept alive) and its signals; `None` when polling.
    events: Option<(RecommendedWatcher, mpsc::UnboundedReceiver<Signal>)>,
    poll: tokio::time::Interval,
    /// The signal being debounced and the latest moment of its scan. Kept
    /// here, not in `next`'s future, so that a caller that races `next`
    /// against other events (and drops it) never loses a received signal.
    pending: Option<(Option<Signal>, Instant)>,
}

/// What the watcher's thread tells the scanning loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Signal {
    /// A plugin file may have changed.
    Changed,
    /// The directory itself went away: the watch is gone.
    Lost,
    /// `plugins_dir` is a symbolic link and was pointed elsewhere (a release
    /// switch): the watch still follows the old target.
    Retargeted,
}

impl Watch {
    /// Watches `dir`; falls back to polling (and says so) when `notify`
    /// cannot watch it.
    pub fn start(dir: &Path) -> Watch {
        let events = match watch_dir(dir) {
            Ok(w) => {
                tracing::info!(dir = %dir.display(), "watching the plugins directory");
                Some(w)
            }
            Err(e) => {
                tracing::warn!(
                    dir = %dir.display(),
                    error = %e,
                    "cannot watch the plugins directory; looking at it every {}s until it can be watched",
                    FALLBACK_POLL.as_secs()
                );
                None
            }
        };
        let mut poll = tokio::time::interval(FALLBACK_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Watch {
            dir: dir.to_path_buf(),
            events,
            poll,
            pending: None,
        }
    }

    /// Waits until the next scan is due, and says which kind.
    /// Cancel-safe: dropped before it returns, the next call goes on where
    /// it stopped.
    pub async fn next(&mut self) -> ScanKind {
        let Some((_, rx)) = self.events.as_mut() else {
            self.poll.tick().await;
            if let Ok(w) = watch_dir(&self.dir) {
                tracing::info!(dir = %self.dir.display(), "watching the plugins directory");
                self.events = Some(w);
                return ScanKind::Full;
            }
            return ScanKind::Changed;
        };
        if self.pending.is_none() {
            let signal = rx.recv().await;
            self.pending = Some((signal, Instant::now() + DEBOUNCE_MAX));
        }
        // Debounce: wait for DEBOUNCE without events (at most DEBOUNCE_MAX).
        while let Some((Some(Signal::Changed), deadline)) = self.pending {
            let quiet = DEBOUNCE.min(deadline.saturating_duration_since(Instant::now()));
            match tokio::time::timeout(quiet, rx.recv()).await {
                Ok(next @ Some(_)) if Instant::now() < deadline => {
                    self.pending = Some((next, deadline));
                }
                Ok(None) => self.pending = Some((None, deadline)),
                _ => {
                    self.pending = None;
                    return ScanKind::Full;
                }
            }
        }
        let signal = self.pending.take().and_then(|(s, _)| s);
        if signal == Some(Signal::Retargeted) {
            // A switch that removes the link before creating it again (`ln
            // -sfn`) may leave nothing to watch yet: then the polling below
            // finds the new target.
            if let Ok(w) = watch_dir(&self.dir) {
                tracing::info!(dir = %self.dir.display(), "plugins_dir points elsewhere now; watching its new target");
                self.events = Some(w);
                return ScanKind::Full;
            }
        }
        tracing::warn!(
            dir = %self.dir.display(),
            "the plugins directory is no longer watched (removed or renamed?); looking at it every {}s until it can be watched again",
            FALLBACK_POLL.as_secs()
        );
        self.events = None;
        self.poll.reset();
        ScanKind::Changed
    }
}

fn watch_dir(
    dir: &Path,
) -> Result<(RecommendedWatcher, mpsc::UnboundedReceiver<Signal>), notify::Error> {
    let (tx, rx) = mpsc::unbounded_channel();
    // notify reports paths made absolute, not canonical.
    let watched = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let link = std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink());
    let parent = watched.parent().map(Path::to_path_buf);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let signal = match &event {
            Ok(e) if link && is_retargeted(e, &watched) => Some(Signal::Retargeted),
            Ok(e) if is_gone(e, &watched) => Some(Signal::Lost),
            Ok(e) => is_relevant(e).then_some(Signal::Changed),
            // A lost event (queue overflow): scan everything.
            Err(_) => Some(Signal::Changed),
        };
        if let Some(s) = signal {
            let _ = tx.send(s);
        }
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    // inotify follows a symbolic link to its target; the link itself is an
    // entry of its parent, so that is where a switch of it shows.
    if let Some(parent) = parent.filter(|_| link) {
        watcher.watch(&parent, RecursiveMode::NonRecursive)?;
    }
    Ok((watcher, rx))
}

/// Whether the event, seen in the parent of a symbolic-link `plugins_dir`,
/// says the link was replaced or created (pointed at another directory).
fn is_retargeted(e: &notify::Event, link: &Path) -> bool {
    use notify::event::ModifyKind;
    matches!(
        e.kind,
        EventKind::Create(_) | EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
    ) && e.paths.iter().any(|p| p == link)
}

/// Whether the event says that the watched directory itself was removed or
/// renamed (after which inotify reports nothing more about it).
fn is_gone(e: &notify::Event, dir: &Path) -> bool {
    use notify::event::ModifyKind;
    matches!(
        e.kind,
        EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
    ) && e.paths.iter().any(|p| p == dir)
}

/// Changes to `.wasm` files (created, written, renamed, removed); not the
/// daemon's own reads of them.
fn is_relevant(e: &notify::Event) -> bool {
    use notify::event::{AccessKind, AccessMode};
    let kind = match e.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    };
    kind && (e.need_rescan()
        || e.paths.is_empty()
        || e.paths
            .iter()
            .any(|p| p.extension().is_some_and(|x| x == "wasm")))
}

#[cfg(test)]
mod tests {
    use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};

    use super::*;

    fn event(kind: EventKind, path: &str) -> notify::Event {
        notify::Event::new(kind).add_path(PathBuf::from(path))
    }

    #[test]
    fn only_changes_to_wasm_files_count() {
        let renamed = EventKind::Modify(ModifyKind::Name(RenameMode::To));
        assert!(is_relevant(&event(renamed, "/p/echo.wasm")));
        assert!(is_relevant(&event(
            EventKind::Create(CreateKind::File),
            "/p/echo.wasm"
        )));
        assert!(is_relevant(&event(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            "/p/echo.wasm"
        )));
        assert!(!is_relevant(&event(
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            "/p/echo.wasm"
        )));
        assert!(!is_relevant(&event(
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            "/p/echo.wasm"
        )));
        assert!(!is_relevant(&event(
            EventKind::Create(CreateKind::File),
            "/p/notes.txt"
        )));
    }

    #[test]
    fn the_directory_itself_going_away_ends_the_watch() {
        let dir = Path::new("/p");
        let removed = EventKind::Remove(notify::event::RemoveKind::Folder);
        assert!(is_gone(&event(removed, "/p"), dir));
        assert!(is_gone(
            &event(EventKind::Modify(ModifyKind::Name(RenameMode::From)), "/p"),
            dir
        ));
        assert!(!is_gone(&event(removed, "/p/echo.wasm"), dir));
    }
}
