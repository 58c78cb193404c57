//! Log lines into the daemon's log, tagged with the job's id and attempt.
//!
//! Logging is not an effect in the at-least-once sense: it is not fenced or
//! deduplicated, so a retried handler logs again. No grant is needed.
//!
//! ```no_run
//! use khata_sdk::log;
//!
//! log::info("indexing product p1");
//! log::warn(format!("price went up by {}%", 12));
//! ```

use crate::bindings::khata::plugin::log as wit;

/// A log line's severity.
pub use crate::bindings::khata::plugin::log::Level;

/// Logs `message` at `level`.
pub fn log(level: Level, message: impl AsRef<str>) {
    wit::log(level, message.as_ref());
}

/// Logs `message` at trace level.
pub fn trace(message: impl AsRef<str>) {
    log(Level::Trace, message);
}

/// Logs `message` at debug level.
pub fn debug(message: impl AsRef<str>) {
    log(Level::Debug, message);
}

/// Logs `message` at info level.
pub fn info(message: impl AsRef<str>) {
    log(Level::Info, message);
}

/// Logs `message` at warn level.
pub fn warn(message: impl AsRef<str>) {
    log(Level::Warn, message);
}

/// Logs `message` at error level.
pub fn error(message: impl AsRef<str>) {
    log(Level::Error, message);
}
